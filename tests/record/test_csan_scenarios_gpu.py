"""PyTorch's CUDA Stream Sanitizer's own scenarios (``csan_scenarios.py``) as real programs on a
CUDA device: by default, a recording gives each the verdict the sanitizer's own test expects
(kernels on two streams race like copies); the sanitizer itself, run over the same programs in a
child process (it cannot be turned off again in a process), is the column beside it. With ``-s``,
the table is printed (``ci/gpu.sh soundness``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from csan_scenarios import SCENARIOS, Cuda

from kvverify.record import recording

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def csan() -> dict[str, bool]:
    """Per scenario: whether PyTorch's sanitizer reported a race (run in a child process)."""
    result = subprocess.run([sys.executable, str(HERE / "csan_scenarios.py")], capture_output=True, text=True,
                            timeout=300, cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_scenario_is_recorded_with_the_verdict_the_sanitizers_test_expects(csan):
    rows, wrong = [], []
    for name, (expected, program) in SCENARIOS.items():
        with recording() as rec:
            program(Cuda())
        verdict = rec.check().verdict
        rows.append(f"{name:28} expected {expected:5} recorded {verdict:5} ({len(rec.check().races)} races)"
                    f" CSAN {'reported' if csan[name] else 'nothing'}")
        if verdict != expected or not rec.complete():
            wrong.append(f"{name}: expected {expected}, recorded {verdict}, complete {rec.complete()}:\n"
                         + rec.report())
    print("\nPyTorch's CSAN TestEventHandler scenarios as programs (H200):\n" + "\n".join(rows))
    assert not wrong, "\n\n".join(wrong)


def test_the_sanitizer_reports_exactly_the_racy_scenarios(csan):
    """The sanitizer's column agrees with its own test's expectations, which shows the programs
    re-create its scenarios."""
    assert {name for name, reported in csan.items() if reported} == \
        {name for name, (expected, _) in SCENARIOS.items() if expected == "RACY"}
