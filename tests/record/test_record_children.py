"""Child processes that use CUDA (``kvverify.record.capture.processes``), on the CPU: the injection
library ``csrc/inject/inject.c`` compiles, exports ``InitializeInjection`` alone and leaves its
marker where ``KVVERIFY_CHILD_DIR`` says (and nowhere else, never failing); a recording sets and
restores the variables, and a marker of another process (a real child that calls the library as
the CUDA driver does at ``cuInit``) makes it incomplete, naming the child; ``kvverify record`` then
exits 2. On a device: ``test_record_children_gpu.py``."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_cuda import shared
from nvtx_support import find_c_compiler

import kvverify.record as record
from kvverify.record import cli
from kvverify.record.capture import processes
from kvverify.record.capture.processes import CHILD, CHILD_DIR, INJECTION, LIBRARY, NEXT, ChildWatch
from kvverify.record.confirm import runs

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SOURCE = ROOT / "csrc" / "inject" / "inject.c"
# What the CUDA driver does at cuInit, in a child of its own: load the library CUDA_INJECTION64_PATH
# names and call InitializeInjection; the child prints its pid.
AS_THE_DRIVER = ("import ctypes, os; ctypes.CDLL(os.environ['CUDA_INJECTION64_PATH']).InitializeInjection(); "
                 "print(os.getpid())")


def compile_library(out: Path, source: Path = SOURCE) -> Path:
    compiler = find_c_compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc, clang or $CC) on PATH")
    subprocess.run([compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden", "-shared", "-fPIC",
                    str(source), "-o", str(out), "-ldl"], check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    """The injection library compiled from its source for this test (the installed one may be older)."""
    return compile_library(tmp_path_factory.mktemp("inject") / "inject.so")


@pytest.fixture
def clean_env(monkeypatch):
    """No recording's variables around the test (a run under ``kvverify record`` has them)."""
    for name in (INJECTION, CHILD_DIR, NEXT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "1000")  # (the summary read line by line)
    return monkeypatch


def marker(path: Path) -> tuple[int, int, list[str]]:
    pid, ppid, cmdline = path.read_bytes().split(b"\n", 2)
    return int(pid), int(ppid), [a.decode() for a in cmdline.removesuffix(b"\0").split(b"\0")]


def child_lines(rec) -> list[str]:
    return [line for line in rec.summary().lines() if line.startswith(CHILD)]


# -- the library -------------------------------------------------------------------------------------


def test_the_install_built_the_library():
    assert os.path.isfile(LIBRARY), f"{LIBRARY} is missing: pip install --no-build-isolation -e . builds it"


def test_the_library_exports_initialize_injection_and_nothing_of_its_own(library):
    lib = ctypes.CDLL(str(library))
    assert lib.InitializeInjection
    for private in ("write_marker", "read_cmdline", "call_next", "write_all"):
        with pytest.raises(AttributeError):
            getattr(lib, private)


def test_with_a_folder_the_marker_names_the_process_its_parent_and_its_command_line(library, tmp_path):
    env = dict(os.environ, **{INJECTION: str(library), CHILD_DIR: str(tmp_path)})
    env.pop(NEXT, None)
    argument = "two words\nand a line"
    done = subprocess.run([sys.executable, "-c", AS_THE_DRIVER, argument], env=env, capture_output=True, text=True,
                          check=True)
    pid = int(done.stdout)
    assert os.listdir(tmp_path) == [str(pid)]  # (no half-written marker left)
    assert marker(tmp_path / str(pid)) == (pid, os.getpid(), [sys.executable, "-c", AS_THE_DRIVER, argument])


def test_in_this_process_it_returns_1_and_leaves_errno_alone(library, tmp_path, clean_env):
    lib = ctypes.CDLL(str(library), use_errno=True)
    clean_env.setenv(CHILD_DIR, str(tmp_path))
    ctypes.set_errno(7)
    assert lib.InitializeInjection() == 1
    assert ctypes.get_errno() == 7
    pid, ppid, command = marker(tmp_path / str(os.getpid()))
    assert (pid, ppid) == (os.getpid(), os.getppid())
    assert command == Path("/proc/self/cmdline").read_bytes().removesuffix(b"\0").decode().split("\0")


def test_without_a_folder_or_with_one_gone_it_writes_nothing_and_returns_1(library, tmp_path, clean_env):
    lib = ctypes.CDLL(str(library))
    assert lib.InitializeInjection() == 1
    clean_env.setenv(CHILD_DIR, "")
    assert lib.InitializeInjection() == 1
    clean_env.setenv(CHILD_DIR, str(tmp_path / "gone"))  # a recording that ended and took its folder away
    assert lib.InitializeInjection() == 1
    assert os.listdir(tmp_path) == []


def test_the_injection_it_replaced_is_called_too_and_itself_never_again(library, tmp_path, clean_env):
    source = tmp_path / "tool.c"
    source.write_text(textwrap.dedent("""\
        #include <stdio.h>
        #include <stdlib.h>
        __attribute__((visibility("default"))) int InitializeInjection(void) {
            FILE *f = fopen(getenv("TOOL_SAW"), "w");
            if (f) { fputs("called", f); fclose(f); }
            return 1;
        }
        """))
    tool = compile_library(tmp_path / "tool.so", source)
    markers = tmp_path / "markers"
    markers.mkdir()
    lib = ctypes.CDLL(str(library))
    clean_env.setenv(CHILD_DIR, str(markers))
    clean_env.setenv("TOOL_SAW", str(tmp_path / "saw"))
    clean_env.setenv(NEXT, str(tool))
    assert lib.InitializeInjection() == 1
    assert (tmp_path / "saw").read_text() == "called" and os.listdir(markers) == [str(os.getpid())]
    clean_env.setenv(NEXT, str(library))  # (dlopen hands back this library: no recursion)
    assert lib.InitializeInjection() == 1
    clean_env.setenv(NEXT, str(tmp_path / "no-such-tool.so"))
    assert lib.InitializeInjection() == 1


# -- the environment of a recording ----------------------------------------------------------------------


def test_a_recording_sets_the_variables_and_restores_them_at_its_stop(fake, clean_env):
    clean_env.setenv(INJECTION, "/opt/tool/libinjection.so")  # another tool's: chained to
    with record.recording(platform=fake):
        folder = os.environ[CHILD_DIR]
        assert os.environ[INJECTION] == LIBRARY and os.path.isdir(folder)
        assert os.environ[NEXT] == "/opt/tool/libinjection.so"
    assert os.environ[INJECTION] == "/opt/tool/libinjection.so"
    assert CHILD_DIR not in os.environ and NEXT not in os.environ and not os.path.exists(folder)
    clean_env.delenv(INJECTION)
    clean_env.setenv(NEXT, "/stale/next.so")  # left by someone else: never loaded into a child
    with record.recording(platform=fake):
        assert NEXT not in os.environ
    assert INJECTION not in os.environ and os.environ[NEXT] == "/stale/next.so"


def test_the_variables_are_restored_when_the_program_raises(fake, clean_env):
    with pytest.raises(RuntimeError, match="boom"):
        with record.recording(platform=fake):
            folder = os.environ[CHILD_DIR]
            raise RuntimeError("boom")
    assert INJECTION not in os.environ and CHILD_DIR not in os.environ and not os.path.exists(folder)


def test_a_nested_recording_gives_the_outer_ones_variables_back(fake, clean_env):
    clean_env.setenv(INJECTION, "/opt/tool/libinjection.so")
    with record.recording(platform=fake):
        outer = {name: os.environ[name] for name in (INJECTION, CHILD_DIR, NEXT)}
        with record.recording(platform=fake):
            assert os.environ[CHILD_DIR] != outer[CHILD_DIR]
            assert os.environ[NEXT] == "/opt/tool/libinjection.so"  # (not this library: never itself)
        assert {name: os.environ[name] for name in (INJECTION, CHILD_DIR, NEXT)} == outer


def test_the_recordings_own_process_is_not_named(fake, clean_env):
    with record.recording(platform=fake) as rec:
        ctypes.CDLL(LIBRARY).InitializeInjection()  # as where this process initializes CUDA after the start
    assert child_lines(rec) == [] and rec.complete(), rec.summary().lines()


# -- children ------------------------------------------------------------------------------------------


def test_a_child_that_initialized_cuda_is_named_and_the_recording_is_incomplete(fake, clean_env):
    with record.recording(platform=fake) as rec:
        done = subprocess.run([sys.executable, "-c", AS_THE_DRIVER, "--rank", "1"], capture_output=True, text=True,
                              check=True)
        untouched = subprocess.run([sys.executable, "-c", "pass"], check=True)  # (no CUDA: not named)
    pid = int(done.stdout)
    assert untouched.returncode == 0
    # the command line as a shell takes it
    assert child_lines(rec) == [f"{CHILD} pid {pid} `{sys.executable} -c {shlex.quote(AS_THE_DRIVER)} --rank 1`): 1"]
    assert not rec.complete()


def test_a_grandchild_is_named_with_the_process_that_started_it(fake, clean_env):
    code = (f"import subprocess, sys, os; print(os.getpid()); "
            f"subprocess.run([sys.executable, '-c', {AS_THE_DRIVER!r}], check=True)")
    with record.recording(platform=fake) as rec:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    parent, grandchild = map(int, done.stdout.split())
    [line] = child_lines(rec)
    assert line.startswith(f"{CHILD} pid {grandchild} (started by pid {parent}) `")


def _as_the_driver() -> None:
    ctypes.CDLL(os.environ[INJECTION]).InitializeInjection()


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # (3.12: fork of a process with threads)
def test_multiprocessing_children_get_the_variables(fake, clean_env, method):
    """spawn and fork children start with this process's environment; a forkserver started while
    recording has it too, and so has each process it forks."""
    context = multiprocessing.get_context(method)
    try:
        with record.recording(platform=fake) as rec:
            child = context.Process(target=_as_the_driver)
            child.start()
            child.join()
        assert child.exitcode == 0
        [line] = child_lines(rec)
        assert line.startswith(f"{CHILD} pid {child.pid}")
    finally:
        _stop_forkserver()


def test_a_forkserver_running_before_the_recording_is_named_where_it_starts_a_process(fake, clean_env):
    context = multiprocessing.get_context("forkserver")
    try:
        warm = context.Process(target=os.getpid)
        warm.start()
        warm.join()
        from multiprocessing import forkserver

        server = forkserver._forkserver._forkserver_pid
        with record.recording(platform=fake) as idle:
            pass
        assert idle.complete(), idle.summary().lines()  # (running, not used: nothing missed)
        with record.recording(platform=fake) as rec:
            for _ in range(2):
                child = context.Process(target=_as_the_driver)
                child.start()
                child.join()
        assert child_lines(rec) == []  # (its children lack the variables: that is the point)
        assert (f"NOT RECORDED (processes started by multiprocessing's forkserver, pid {server}, which was running "
                "before the recording started") in "\n".join(rec.summary().lines())
        assert "or use the spawn start method): 2" in "\n".join(rec.summary().lines())
        assert not rec.complete()
    finally:
        _stop_forkserver()


def _stop_forkserver() -> None:
    """(CPython's own tests stop it so; else it outlives the test, with a recording's variables.)"""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is not None:
        forkserver._forkserver._stop()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_that_ends_the_recording_leaves_the_folder_to_its_parent(clean_env, tmp_path):
    watch = ChildWatch()
    watch.start()
    folder = watch.folder
    pid = os.fork()
    if pid == 0:  # (a program that forks and returns into the recording's stop in both processes)
        status = 0
        try:
            ctypes.CDLL(LIBRARY).InitializeInjection()
            watch.stop()
        except BaseException:
            status = 1
        os._exit(status)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.path.isdir(folder)
    assert [line for line in watch.stop() if line.startswith(f"{CHILD} pid {pid} ")]
    assert not os.path.exists(folder)


def test_past_ten_children_the_rest_are_counted_and_a_marker_being_written_counts(clean_env):
    watch = ChildWatch()
    watch.start()
    for pid in range(1_000_001, 1_000_012):
        Path(watch.folder, str(pid)).write_bytes(f"{pid}\n{os.getpid()}\npython\0worker.py\0".encode())
    Path(watch.folder, ".1000020.part").write_bytes(b"1000020\n")
    Path(watch.folder, "stray").write_text("not a marker")
    lines = watch.stop()
    named = [line for line in lines if line.startswith(CHILD)]
    assert len(named) == processes.NAMED
    assert f"{CHILD} pid 1000001 `python worker.py`)" in named
    more = f"NOT RECORDED (more child processes that used CUDA, not followed; the first {processes.NAMED} are named above)"
    assert lines[more] == 2


def test_a_marker_renamed_since_the_folder_was_listed_is_read_under_its_final_name(clean_env):
    watch = ChildWatch()
    watch.start()
    Path(watch.folder, "1000001").write_bytes(f"1000001\n{os.getpid()}\npython\0w.py\0".encode())
    listed = [".1000001.part"]  # (listed before the child's rename)
    clean_env.setattr(processes.os, "listdir", lambda folder: listed)
    assert f"{CHILD} pid 1000001 `python w.py`)" in watch.stop()


def test_a_folder_removed_under_the_recording_is_said(clean_env):
    watch = ChildWatch()
    watch.start()
    os.rmdir(watch.folder)  # (a cleaner of the temporary folder)
    [line] = watch.stop()
    assert line.startswith("NOT RECORDED (child processes: their markers in ") and "could not be read" in line


def test_without_the_library_the_recording_says_children_are_not_watched(fake, clean_env, tmp_path):
    clean_env.setattr(processes, "LIBRARY", str(tmp_path / "_inject.so"))
    with record.recording(platform=fake) as rec:
        assert INJECTION not in os.environ
    assert not rec.complete()
    assert (f"NOT RECORDED (child processes are not watched: {tmp_path / '_inject.so'} is missing (kvverify was "
            "installed before it was built): reinstall kvverify") in "\n".join(rec.summary().lines())


# -- kvverify record -----------------------------------------------------------------------------------

PROGRAM = textwrap.dedent("""\
    import subprocess, sys
    import fake_cuda

    fake = fake_cuda.shared()
    gpu = fake.device(4096)
    gpu.fill_(1)
    done = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True, check=True)
    open("child.pid", "w").write(done.stdout)
    if sys.argv[2:] == ["raise"]:
        raise RuntimeError("the program failed")
    """)


@pytest.fixture
def program(tmp_path, clean_env):
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    clean_env.chdir(tmp_path)
    clean_env.syspath_prepend(str(HERE))
    return path


def test_kvverify_record_exits_2_naming_a_child_that_used_cuda(program, capsys):
    status = cli.run(_args("python", str(program), AS_THE_DRIVER), platform=shared())
    out = capsys.readouterr()
    pid = int(Path("child.pid").read_text())
    assert status == 2, out
    assert "SAFE" in out.out
    assert f"{CHILD} pid {pid} `{sys.executable} -c {shlex.quote(AS_THE_DRIVER)}`): 1" in out.out.splitlines()
    assert "child processes that used CUDA): SAFE covers only what was recorded" in out.err
    assert INJECTION not in os.environ and CHILD_DIR not in os.environ


def test_kvverify_record_of_a_child_without_cuda_stays_safe(program, capsys):
    assert cli.run(_args("python", str(program), "import os; print(os.getpid())"), platform=shared()) == 0
    assert "NOT RECORDED" not in capsys.readouterr().out


def test_kvverify_record_restores_the_variables_when_the_program_raises(program, capsys):
    status = cli.run(_args("python", str(program), AS_THE_DRIVER, "raise"), platform=shared())
    assert status == 1 and "RuntimeError: the program failed" in capsys.readouterr().err
    assert INJECTION not in os.environ and CHILD_DIR not in os.environ


def _args(*command: str):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--", *command])


# -- the recorder's own children -----------------------------------------------------------------------


def test_outside_a_recording_the_environment_has_none_of_its_variables():
    ours = {INJECTION: LIBRARY, CHILD_DIR: "/tmp/kvverify-children-x", "PATH": "/bin"}
    assert processes.outside_environment(ours) == {"PATH": "/bin"}
    assert processes.outside_environment({**ours, NEXT: "/opt/tool.so"}) == {INJECTION: "/opt/tool.so", "PATH": "/bin"}
    theirs = {INJECTION: "/opt/tool.so", "PATH": "/bin"}
    assert processes.outside_environment(theirs) == theirs


def test_the_witness_runs_start_without_a_recordings_variables(fake, clean_env, tmp_path):
    seen = []

    def run(command, **options):
        seen.append(options["env"])
        return subprocess.CompletedProcess(command, 2, "", "no device here")

    class Plan:
        def to_json(self):
            return {}

    clean_env.setattr(subprocess, "run", run)
    with record.recording(platform=fake):
        runs.witness_runs(["python", "prog.py"], [], str(tmp_path))(Plan(), "in-order")
        runs.witness_runs(["pytest", "test_x.py"], [], str(tmp_path), per_test=True)(Plan(), "in-order")
    assert len(seen) == 2
    for env in seen:
        assert CHILD_DIR not in env and INJECTION not in env
