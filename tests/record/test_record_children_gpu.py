"""Child processes on a CUDA device: the driver loads ``kvverify/_inject.so`` at each child's
``cuInit`` (``CUDA_INJECTION64_PATH``), so that ``kvverify record`` names a child that used CUDA and
exits 2; a child without CUDA, and the recording process's own CUDA work, name nothing. The same
on the CPU, with a child that calls the library as the driver does: ``test_record_children.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvverify.record.capture.processes import CHILD

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

CHILD_CODE = "import os, torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize(); print(os.getpid())"
NO_CUDA = "import os; print(os.getpid())"

PROGRAM = textwrap.dedent("""\
    import multiprocessing, subprocess, sys
    import torch

    def child(code):
        exec(code)

    if __name__ == "__main__":
        how, code = sys.argv[1], sys.argv[2]
        torch.ones(4, device="cuda").mul_(2)  # the recording process's own CUDA work
        torch.cuda.synchronize()
        if how == "subprocess":
            done = subprocess.run([sys.executable, "-c", code, "--rank", "1"], check=True, capture_output=True, text=True)
            print("child pid", done.stdout.strip())
        else:
            process = multiprocessing.get_context("spawn").Process(target=child, args=(code,))
            process.start()
            process.join()
            assert process.exitcode == 0, process.exitcode
            print("child pid", process.pid)
    """)


def record(tmp_path: Path, how: str, code: str, **env: str) -> tuple[subprocess.CompletedProcess, int]:
    """``kvverify record -- python prog.py HOW CODE``; returns its result and the child's pid."""
    (tmp_path / "prog.py").write_text(PROGRAM)
    command = [sys.executable, "-m", "kvverify", "record", "-o", str(tmp_path / "t.json"), "--", "python",
               str(tmp_path / "prog.py"), how, code]
    # the report read whole: a screen is laid out for COLUMNS (kvverify.screen)
    r = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env=dict(os.environ, COLUMNS="1000", PYTHONPATH=str(ROOT), **env))
    pids = [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("child pid ")]
    assert pids and pids[0].isdigit(), r.stdout + r.stderr
    return r, int(pids[0])


@pytest.mark.parametrize("how", ["subprocess", "spawn"])
def test_a_child_that_uses_cuda_is_named_and_the_exit_status_is_2(tmp_path, how):
    r, pid = record(tmp_path, how, CHILD_CODE)
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = [line for line in r.stdout.splitlines() if line.startswith(CHILD)]
    assert line.startswith(f"{CHILD} pid {pid} `"), line
    # the command: the child's own (subprocess), or multiprocessing's spawn entry point
    assert ("--rank 1" if how == "subprocess" else "multiprocessing") in line, line
    assert "child processes that used CUDA" in r.stderr


@pytest.mark.parametrize("how", ["subprocess", "spawn"])
def test_a_child_without_cuda_leaves_the_program_safe(tmp_path, how):
    r, _ = record(tmp_path, how, NO_CUDA)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SAFE" in r.stdout and "NOT RECORDED" not in r.stdout


def test_the_recording_process_loading_the_library_itself_names_nothing(tmp_path):
    """With torch's NVML device check, the recording can start before this process's cuInit: the
    driver then loads the library here too, and its marker is left out by its pid."""
    r, _ = record(tmp_path, "subprocess", NO_CUDA, PYTORCH_NVML_BASED_CUDA_CHECK="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert CHILD not in r.stdout
