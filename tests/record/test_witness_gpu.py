"""``--confirm``'s witness on the device: corpus cases whose race the device shows once the
second op is forced first come back CONFIRMED with their bytes; their fixed forms are SAFE and
never forced."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["vllm-31341", "vllm-47282", "sglang-36738"])
def test_a_broken_corpus_case_is_confirmed_and_its_fixed_form_is_never_forced(name):
    from kvverify.record.corpus import find, runner

    (case,) = find([name])
    broken = runner.recorded(case, "broken", confirm=True)
    assert broken.error is None and broken.verdict == "RACY", broken
    print(name, broken.witnesses)
    assert broken.witnesses and any(w.startswith("CONFIRMED") for w in broken.witnesses), broken.witnesses
    fixed = runner.recorded(case, "fixed", confirm=True)
    assert fixed.verdict == "SAFE" and fixed.witnesses is None
