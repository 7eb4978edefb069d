"""``kvverify record -- ...`` of a program that never returns to it: ``os._exit`` (on the recording's
thread, on another one, in a forked child), SIGTERM, and SIGINT's KeyboardInterrupt; on the CUDA
stand-in (``fake_cuda.shared()``). Each run is a process of its own: ``os._exit`` ends it."""

from __future__ import annotations

import json
import os
import posix
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_cuda import shared
from test_record_cli import PROGRAM, args

from kvverify.record import cli
from kvverify.record.ends import NOT_RUN

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# kvverify record's run() in a process of its own, on the stand-in, SIGTERM at its default;
# KVTEST_INCOMPLETE: a stand-in whose pinned-memory answer fails, which leaves the recording incomplete
RUNNER = textwrap.dedent("""\
    import argparse, os, signal, sys
    import torch
    import fake_cuda
    from kvverify.record import cli

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (as a shell starts it; a runner may leave it ignored)
    if os.environ.get("KVTEST_INCOMPLETE"):
        class Broken(fake_cuda.FakeCuda):
            def is_pinned(self, t):
                raise RuntimeError("no answer")

        fake_cuda.SHARED.insert(0, Broken())
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    sys.exit(cli.run(parser.parse_args(sys.argv[1:]), platform=fake_cuda.shared()))
    """)
END = 'sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)\n'
assert PROGRAM.endswith(END)


def ending(end: str) -> str:
    """PROGRAM (a copy racing with its staging refill at lines 11 and 15, unless --fixed) ending at
    line 16 with ``end``, and a line after it that says whether it ran."""
    return PROGRAM.removesuffix(END) + textwrap.dedent(end) + 'print("after the end")\n'


def record(tmp_path: Path, source: str, *argv: str, incomplete: bool = False) -> subprocess.CompletedProcess:
    """``kvverify record --json report.json -- python prog.py ARGV`` of ``source``, in ``tmp_path``."""
    (tmp_path / "prog.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    env.pop("KVTEST_INCOMPLETE", None)
    if incomplete:
        env["KVTEST_INCOMPLETE"] = "1"
    return subprocess.run([sys.executable, "-c", RUNNER, "--json", "report.json", "--", "python", "prog.py", *argv],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report.json").read_text())


def test_a_racy_program_ending_by_os_exit_0_exits_1_with_the_race_and_where_it_ended(tmp_path):
    """Measured on the H200 before: no verdict, no trace, exit 0."""
    p = record(tmp_path, ending("import os; os._exit(0)\n"))
    assert p.returncode == 1, p.stderr
    assert "RACY" in p.stdout and "1 race" in p.stdout
    assert "prog.py:11 in <module>" in p.stdout and "prog.py:15 in <module>" in p.stdout
    assert f"kvverify record: the program ended by os._exit(0) at prog.py:16 in <module>; {NOT_RUN}\n" in p.stderr
    assert "after the end" not in p.stdout
    assert "kvverify record: trace written to kvverify-trace.json" in p.stderr
    assert {op["op"] for op in json.loads((tmp_path / "kvverify-trace.json").read_text())["ops"]} >= {"copy"}
    assert report(tmp_path)["verdict"] == "RACY"


@pytest.mark.parametrize("fixed, status, incomplete, expected", [
    (True, 0, False, 0),  # SAFE and complete: the program's own status
    (True, 3, False, 3),
    (False, 3, False, 3),  # a failed program's status, as for sys.exit(3): the report says RACY
    (True, 0, True, 2),  # SAFE of what was recorded only: never 0
])
def test_os_exit_n_exits_as_an_exit_with_n(tmp_path, fixed, status, incomplete, expected):
    source = ending(f"import os; os._exit({status})\n")
    p = record(tmp_path, source, *(["--fixed"] if fixed else []), incomplete=incomplete)
    assert p.returncode == expected, p.stderr
    assert f"the program ended by os._exit({status}) at prog.py:16 in <module>" in p.stderr
    assert ("SAFE" if fixed else "RACY") in p.stdout
    assert ("NOT RECORDED" in p.stdout) is incomplete
    assert (f"the program exited with status {status}" in p.stderr) is (status != 0)
    assert report(tmp_path)["complete"] is not incomplete


def test_os_exit_on_another_thread_is_not_recorded_and_exits_2(tmp_path):
    """The recording can be stopped on its own thread only (torch's dispatch modes are per
    thread); the main thread waits for good meanwhile, so the thread's exit is the program's end."""
    source = ending("""\
        import os, threading

        def worker():
            os._exit(0)

        threading.Thread(target=worker, name="ender").start()
        threading.Event().wait()
        """)
    p = record(tmp_path, source)
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    line = ("kvverify record: NOT RECORDED: the program ended by os._exit(0) at prog.py:19 in worker on thread "
            "'ender', where the recording cannot be stopped (only on the thread that started it: torch's dispatch "
            f"modes are per thread): no trace, no verdict; {NOT_RUN}. End the program from its main thread to "
            "have them\n")
    assert p.stderr == line
    assert not (tmp_path / "kvverify-trace.json").exists()
    assert report(tmp_path) == {"command": "python prog.py", "verdict": "NOT_RECORDED", "error": line[17:-1],
                                "races": [], "complete": False, "witnesses": None}


def test_a_forked_child_ends_as_it_asks_and_only_the_parent_reports(tmp_path):
    """A child forked inside the recording inherits its os._exit and SIGTERM handler: the one ends
    with its own status, the other kills it, and neither reports anything."""
    source = ending("""\
        import os, signal, time

        child = os.fork()
        if child == 0:
            print("the child ran", flush=True)
            os._exit(7)
        print("first child:", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
        ready, tell = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(tell, b"!")  # (a signal that comes while python sets up the child is dropped)
            time.sleep(60)
            os._exit(0)
        os.read(ready, 1)
        os.kill(child, signal.SIGTERM)
        print("second child:", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
        """)
    p = record(tmp_path, source)
    assert p.returncode == 1, p.stderr
    assert "the child ran\n" in p.stdout and "first child: 7\n" in p.stdout
    assert f"second child: {-signal.SIGTERM}\n" in p.stdout
    assert p.stdout.count("RACY") == 1 and "after the end" in p.stdout
    assert "ended by" not in p.stderr and p.stderr.count("trace written") == 1


@pytest.mark.parametrize("fixed, expected", [(False, 1), (True, 128 + signal.SIGTERM)])
def test_sigterm_reports_and_exits_1_on_a_race_else_143(tmp_path, fixed, expected):
    source = ending("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    p = record(tmp_path, source, *(["--fixed"] if fixed else []))
    assert p.returncode == expected, p.stderr
    assert ("SAFE" if fixed else "RACY") in p.stdout and "after the end" not in p.stdout
    assert (f"kvverify record: the program was ended by SIGTERM at prog.py:17 in <module> (where its main thread "
            f"was); {NOT_RUN}\n") in p.stderr
    assert p.stderr.endswith("kvverify record: the program was ended by SIGTERM, and its recorded work races: exit "
                             "status 1\n" if not fixed else
                             "kvverify record: the program was ended by SIGTERM (no race found in its recorded "
                             "work): exit status 143\n")
    assert report(tmp_path)["verdict"] == ("SAFE" if fixed else "RACY")


def test_sigterm_inside_an_op_ends_the_recording_once_the_op_is_logged(tmp_path):
    """The signal's handler runs inside the op (a Python kernel), where the dispatch mode is off
    the stack and the op not logged: stopping there failed (no verdict); the end waits for it."""
    source = ending("""\
        import os, signal, torch

        @torch.library.custom_op("kvtest_hard_ends::terminate", mutates_args=())
        def terminate(x: torch.Tensor) -> torch.Tensor:
            os.kill(os.getpid(), signal.SIGTERM)
            return x.clone()

        terminate(torch.ones(4))
        """)
    p = record(tmp_path, source, "--fixed")
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert "SAFE" in p.stdout and "after the end" not in p.stdout
    assert "the program was ended by SIGTERM at prog.py:20 in terminate" in p.stderr
    assert "could not be finished" not in p.stderr


@pytest.mark.parametrize("fixed, expected", [(False, 1), (True, 128 + signal.SIGINT)])
def test_an_uncaught_keyboard_interrupt_is_reported_as_the_end_by_sigint(tmp_path, fixed, expected):
    """Before: no verdict, "kvverify: interrupted", exit 130 whatever was recorded."""
    source = ending("""\
        import os, signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (python's own, unless SIGINT came ignored)
        try:
            os.kill(os.getpid(), signal.SIGINT)
        finally:
            print("finally ran")
        """)
    p = record(tmp_path, source, *(["--fixed"] if fixed else []))
    assert p.returncode == expected, p.stderr
    assert ("SAFE" if fixed else "RACY") in p.stdout
    assert "finally ran" in p.stdout and "after the end" not in p.stdout
    assert "Traceback (most recent call last)" in p.stderr and "KeyboardInterrupt" in p.stderr
    assert "kvverify record: the program was ended by SIGINT" in p.stderr
    assert "kvverify record: trace written" in p.stderr


def test_os_exit_and_sigterm_are_given_back_as_the_recording_stops(tmp_path, monkeypatch, capsys):
    """Taken while the recording runs; afterwards os._exit is the original again, and SIGTERM's
    default; a handler the program installs meanwhile is its own, and stays."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    original = os._exit
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    Path("prog.py").write_text(textwrap.dedent("""\
        import os, posix, signal, sys
        print("taken:", type(os._exit).__name__, os._exit is posix._exit,
              signal.getsignal(signal.SIGTERM) != signal.SIG_DFL)
        if sys.argv[1:] == ["--own"]:
            signal.signal(signal.SIGTERM, print)
        """))
    assert cli.run(args("python", "prog.py"), platform=shared()) == 0
    assert "taken: method True True" in capsys.readouterr().out
    assert os._exit is original and posix._exit is original
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    try:
        assert cli.run(args("python", "prog.py", "--own"), platform=shared()) == 0
        assert signal.getsignal(signal.SIGTERM) is print
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert os._exit is original
