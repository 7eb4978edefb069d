"""The CI helpers that judge GPU rounds: compute-sanitizer logs (ci/sanitize.py), report checks
(ci/reports.py) and ci/gpu.sh's step list. They run where no GPU is, on logs and reports shaped
like the real ones."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"ci_{name}", ROOT / "ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sanitize = _load("sanitize")
reports = _load("reports")

NOISE = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to '
         'cuGetProcAddress_v2.\n'
         '=========     Saved host backtrace up to driver entry point at error\n'
         '=========         Host Frame: [0x2f0f1] in libcuda.so.1\n'
         '=========\n')
WRAPPED = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to\n'
           '=========     "invalid argument" on CUDA API call to cuGetProcAddress_v2.\n'
           '=========\n')
OOB = ('========= Invalid __global__ read of size 8 bytes\n'
       '=========     at verify_blocks_kernel(const long *, long, ...)+0x1f0\n'
       '=========     by thread (3,0,0) in block (0,0,0)\n'
       '=========     Address 0x7f00001000 is out of bounds\n'
       '=========\n')


def log(*reports, summary):
    return "========= COMPUTE-SANITIZER\n" + "".join(reports) + "pytest output between reports\n" + summary + "\n"


def test_known_noise_alone_passes():
    j = sanitize.judge(log(NOISE, WRAPPED, NOISE, summary="========= ERROR SUMMARY: 3 errors"))
    assert j.passed and j.noise == {"cuGetProcAddress INVALID_VALUE": 3} and j.other == []


def test_a_memory_error_fails_and_is_shown():
    j = sanitize.judge(log(NOISE, OOB, summary="========= ERROR SUMMARY: 2 errors"))
    assert not j.passed and j.unexplained == 1
    assert j.other == [("Invalid __global__ read of size 8 bytes at verify_blocks_kernel(const long *, long, ...)+0x1f0 "
                        "by thread (3,0,0) in block (0,0,0) Address 0x7f00001000 is out of bounds")]


def test_errors_counted_but_not_printed_still_fail():
    """Past the print limit the summary still counts: what it counts beyond the noise seen fails."""
    j = sanitize.judge(log(*[NOISE] * 5, summary="========= ERROR SUMMARY: 6 errors"))
    assert not j.passed and j.unexplained == 1


def test_racecheck_hazards_fail_warnings_too():
    assert sanitize.judge(log(summary="========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")).passed
    j = sanitize.judge(log(summary="========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)"))
    assert not j.passed and j.counted == 2


def test_a_log_without_a_summary_fails():
    j = sanitize.judge("========= COMPUTE-SANITIZER\nSegmentation fault\n")
    assert not j.passed and j.summaries == 0


def test_judge_command_over_several_logs(tmp_path, capsys):
    a, b = tmp_path / "sanitizer-memcheck.11.log", tmp_path / "sanitizer-memcheck.12.log"
    a.write_text(log(NOISE, summary="========= ERROR SUMMARY: 1 error"))
    b.write_text(log(summary="========= ERROR SUMMARY: 0 errors"))
    assert sanitize.main(["--judge", str(a), str(b)]) == 0
    assert "unexplained: 0" in capsys.readouterr().out
    b.write_text(log(OOB, summary="========= ERROR SUMMARY: 1 error"))
    assert sanitize.main(["--judge", str(a), str(b)]) == 1


def test_missing_sanitizer_is_exit_2(monkeypatch, tmp_path):
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: None)
    assert sanitize.main(["--out", str(tmp_path)]) == 2


def _stress_doc(verdicts, executor="native", contract="RACY"):
    return {"schema_version": 2, "cells": [{"label": k, "verdict": v, "executor": executor,
                                            "contract": {"verdict": contract}} for k, v in verdicts.items()]}


def _same(tmp_path, a, b):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return reports.main(["same-verdicts", str(pa), str(pb)])


def test_same_verdicts(tmp_path, capsys):
    base = {"x": "SAFE_CONFIRMED", "y": "CONFIRMED_RACE"}
    assert _same(tmp_path, _stress_doc(base), _stress_doc(base)) == 0
    # a native RACY cell whose race showed in one run only: timing, reported and forgiven
    luck = {"x": "SAFE_CONFIRMED", "y": "NO_RACE_OBSERVED"}
    assert _same(tmp_path, _stress_doc(base), _stress_doc(luck)) == 0
    out = capsys.readouterr().out
    assert "y: " in out and "1 native RACY cells where the race showed in one run only (timing), 0 other" in out
    # the same difference on the adversarial executor, whose races are forced, is real
    assert _same(tmp_path, _stress_doc(base, "adversarial"), _stress_doc(luck, "adversarial")) == 1
    # as are a SAFE cell that changed, a cell missing from one report, and a changed contract
    assert _same(tmp_path, _stress_doc(base), _stress_doc({**base, "x": "UNEXPECTED_CORRUPTION"})) == 1
    assert _same(tmp_path, _stress_doc(base), _stress_doc({"x": "SAFE_CONFIRMED"})) == 1
    assert _same(tmp_path, _stress_doc(base), _stress_doc(luck, contract="SAFE")) == 1
    assert "0 native RACY cells where the race showed in one run only (timing), 1 other" in capsys.readouterr().out


def test_validate_reports_and_merged_documents(tmp_path):
    pytest.importorskip("jsonschema")
    smoke = ROOT / "tests" / "data" / "stress-smoke-h200.json"  # schema version 1
    merged = tmp_path / "merged.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "kvverify", "merge", str(smoke), str(ROOT / "tests" / "data" / "probe-h200.json"),
                    "--json", str(merged)], capture_output=True, env=env, check=True)
    assert reports.main(["validate", str(smoke), str(merged)]) == 0
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(json.loads(merged.read_text()) | {"exit_status": 7}))
    assert reports.main(["validate", str(broken)]) == 1
    assert reports.main(["validate", str(ROOT / "tests" / "data" / "probe-h200.json")]) == 1  # not a report it knows


def test_gpu_sh_names_its_steps(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "ci" / "gpu.sh"), "no-such-step"], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path)), check=False)
    assert p.returncode == 2
    assert "on request: sanitizer soak torchrun-1 stress-2gpu stress-2gpu-shard merge hook-probe" in p.stderr


def test_cpu_sh_reruns_existing_width_tests_and_checks_what_tests_leave():
    script = (ROOT / "ci" / "cpu.sh").read_text()
    start = script.index("WIDTH_TESTS=(") + len("WIDTH_TESTS=(")
    files = script[start:script.index(")", start)].split()
    assert len(files) >= 5 and all((ROOT / f).is_file() for f in files), files
    assert 'COLUMNS=$other python3 -m pytest -q -p no:cacheprovider "${WIDTH_TESTS[@]}"' in script
    assert 'export TMPDIR="$scratch/tmp" TORCH_EXTENSIONS_DIR="$scratch/torch_extensions"' in script


def test_cpu_sh_says_each_long_step_before_it_and_keeps_hypothesis_out_of_the_checkout():
    """ci/cpu.sh ran about 3 minutes silent before its first test (installing, building) and left
    .hypothesis/ in the checkout: a line says what each install and each pytest run does before it
    starts, and hypothesis keeps its files under the scratch folder (exported before the first
    pytest), which the closing check holds."""
    script = (ROOT / "ci" / "cpu.sh").read_text()
    lines = [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]
    long = [i for i, line in enumerate(lines) if "pip install" in line or "-m pytest" in line]
    assert len(long) >= 4, lines
    for before, step in zip([-1, *long], long):
        assert any(line.startswith("say ") for line in lines[before + 1:step]), lines[step]
    first_pytest = next(i for i in long if "-m pytest" in lines[i])
    assert lines.index('export HYPOTHESIS_STORAGE_DIRECTORY="$scratch/hypothesis"') < first_pytest
    assert '[ -z "$checkout_had_hypothesis" ] && [ -e .hypothesis ]' in script
    say = next(line for line in lines if line.startswith("say()"))
    p = subprocess.run(["bash", "-c", f"{say}\nsay installing torch"], capture_output=True, text=True, check=True)
    assert p.stdout == "ci/cpu.sh: installing torch\n"
