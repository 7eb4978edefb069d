"""``--confirm``'s witness on the device: corpus cases whose race the device shows once the
second op is forced first come back CONFIRMED with their bytes; their fixed forms are SAFE and
never forced. A free under a pending copy is confirmed with the witness as the bytes' next owner."""

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


@pytest.mark.parametrize("name", ["vllm-45268", "sglang-28468"])
def test_a_free_under_a_pending_copy_is_confirmed_with_the_witness_as_the_next_owner(name):
    """vllm-45268 unmaps the pool under a store (the witness maps fresh memory at the range);
    sglang-28468 hands a host slot on under a D2H backup. Every race of each is CONFIRMED."""
    from kvverify.record.corpus import find, runner

    (case,) = find([name])
    broken = runner.recorded(case, "broken", confirm=True)
    assert broken.error is None and broken.verdict == "RACY", broken
    print(name, broken.witnesses)
    assert broken.witnesses and all(w.startswith("CONFIRMED") for w in broken.witnesses), broken.witnesses
    assert any("with the free first" in w for w in broken.witnesses), broken.witnesses
