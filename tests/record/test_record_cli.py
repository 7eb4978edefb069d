"""``kvverify record -- ...``: which programs it runs in-process, its exit status, the trace it writes
and the report it prints; on the CUDA stand-in (``fake_cuda.shared()``) and, for the no-device
line, on this host as it is."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fake_cuda import shared
from help_screen import check_screen, help_lines

from kvverify.record import cli, inprocess
from kvverify.record.confirm import runs

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# A program of the CPU offload handler's shape on the stand-in: a pinned staging buffer refilled
# while its H2D copy may still be pending (H3), or, with --fixed, only after the copy's end event.
PROGRAM = textwrap.dedent("""\
    import sys
    import fake_cuda

    fake = fake_cuda.shared()
    gpu = fake.device(4096)
    staging = fake.pinned(4096)
    load = fake.stream()
    done = fake.event()
    staging.fill_(1)
    with fake.use(load):
        gpu.copy_(staging, non_blocking=True)
        done.record()
    if "--fixed" in sys.argv:
        done.synchronize()
    staging.fill_(2)
    sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)
    """)


def args(*command: str, **options) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if v is not True]
    flags += [f"--{k.replace('_', '-')}" for k, v in options.items() if v is True]
    return parser.parse_args([*flags, "--", *command])


@pytest.fixture
def program(tmp_path, monkeypatch):
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    return path


@pytest.mark.parametrize("command, expected", [
    (["python", "prog.py", "-x"], ("script", "prog.py", ["-x"])),
    (["python3.12", "-m", "pkg.mod", "a"], ("module", "pkg.mod", ["a"])),
    (["python", "-m", "pytest", "-q"], ("pytest", "pytest", ["-q"])),
    (["/usr/bin/pytest", "tests/x.py"], ("pytest", "pytest", ["tests/x.py"])),
    (["python", "-c", "print(1)", "z"], ("code", "print(1)", ["z"])),
    (["prog.py"], ("script", "prog.py", [])),
    (["--", "pytest"], ("pytest", "pytest", [])),
])
def test_programs_it_runs_in_process(command, expected):
    assert inprocess.program(command) == expected


@pytest.mark.parametrize("command, message", [
    ([], "name the program to record"),
    (["python"], "has nothing to run"),
    (["python", "-u", "prog.py"], "python option -u is not supported in-process"),
    (["bash", "run.sh"], "'bash' is not a Python program"),
    (["python", "-m"], "'python -m' needs a module name"),
    (["python", "-c"], "'python -c' needs a line of code"),
])
def test_commands_it_cannot_run_in_process_are_refused_by_name(command, message):
    with pytest.raises(ValueError, match=message):
        inprocess.program(command)


def test_a_racy_program_exits_1_with_both_lines_in_the_report(program, capsys):
    status = cli.run(args("python", str(program)), platform=shared())
    out = capsys.readouterr()
    assert status == 1
    assert "RACY" in out.out and "1 race" in out.out
    assert "prog.py:11 in <module>" in out.out and "prog.py:15 in <module>" in out.out
    assert "kvverify record: trace written to kvverify-trace.json" in out.err
    trace = json.loads(Path("kvverify-trace.json").read_text())
    assert {op["op"] for op in trace["ops"]} >= {"copy", "host_write"}


def test_a_trace_that_cannot_be_written_leaves_the_verdict_and_the_programs_status_alone(program, capsys):
    """A bad ``-o`` once turned a racy run into "the program exited with status 2" (and
    --confirm into "the program failed"): the program succeeded, and its race is the verdict."""
    status = cli.run(args("python", str(program), output="no/such/folder/t.json"), platform=shared())
    err = capsys.readouterr().err
    assert status == 1 and "cannot write no/such/folder/t.json" in err
    assert "the program exited with status" not in err
    status = cli.run(args("python", str(program), "--fixed", output="no/such/folder/t.json"), platform=shared())
    assert status == 2  # SAFE, but the trace it speaks of is not there


def test_a_safe_program_exits_0_and_the_trace_goes_where_asked(program, capsys):
    status = cli.run(args("python", str(program), "--fixed", output="out.json", json="report.json"), platform=shared())
    assert status == 0
    out = capsys.readouterr()
    assert "SAFE" in out.out
    assert Path("out.json").exists() and Path("report.json").exists()
    # where each file went
    assert out.err == "kvverify record: trace written to out.json\nkvverify record: report written to report.json\n"


def test_a_failing_program_gives_its_own_status_and_is_still_recorded(program, capsys):
    assert cli.run(args("python", str(program), "3"), platform=shared()) == 3
    out = capsys.readouterr()
    assert "RACY" in out.out and "the program exited with status 3" in out.err
    (Path(program).parent / "boom.py").write_text("raise RuntimeError('boom')\n")
    assert cli.run(args("python", "boom.py"), platform=shared()) == 1
    assert "RuntimeError: boom" in capsys.readouterr().err


def _no_verdict(out) -> None:
    """Nothing on stdout says SAFE (nor RACY): a program that did not start gets no verdict."""
    assert "SAFE" not in out.out and "RACY" not in out.out, out.out
    assert "SAFE" not in out.err, out.err


def test_a_missing_module_did_not_start_and_gets_no_verdict(program, capsys):
    """``python -m`` of a module that is not there once printed "SAFE ... (0 ops ...)" over what
    never ran: now one line naming it and where it was looked for, exit 2, no trace."""
    status = cli.run(args("python", "-m", "kvverify_no_such_module", "--layers", "2", json="report.json"),
                     platform=shared())
    out = capsys.readouterr()
    assert status == 2
    _no_verdict(out)
    assert out.err.count("\n") == 1, out.err
    assert out.err.startswith("kvverify record: python -m kvverify_no_such_module did not start: ")
    assert "No module named kvverify_no_such_module" in out.err
    assert f"the working directory ({os.getcwd()})" in out.err and "check the module name" in out.err
    assert not Path("kvverify-trace.json").exists()
    report = json.loads(Path("report.json").read_text())
    assert report == {"command": "python -m kvverify_no_such_module --layers 2", "verdict": "NOT_STARTED",
                      "error": out.err.strip().removeprefix("kvverify record: "), "races": [], "complete": False,
                      "witnesses": None}


def test_a_module_in_a_missing_package_did_not_start(program, capsys):
    assert cli.run(args("python", "-m", "kvverify_no_such_package.offload"), platform=shared()) == 2
    out = capsys.readouterr()
    _no_verdict(out)
    assert "python -m kvverify_no_such_package.offload did not start" in out.err
    assert "No module named 'kvverify_no_such_package'" in out.err


def test_a_missing_script_did_not_start_and_gets_no_verdict(program, capsys):
    status = cli.run(args("python", "no_such_prog.py", "-x", json="report.json", no_check=True), platform=shared())
    out = capsys.readouterr()
    assert status == 2
    _no_verdict(out)
    assert out.out == "" and out.err.count("\n") == 1, out
    where = Path(program).parent / "no_such_prog.py"
    assert out.err == (f"kvverify record: python no_such_prog.py did not start: {where} does not exist (the working "
                       f"directory is {Path(program).parent}): no trace, no verdict; check the script's path\n")
    assert not Path("kvverify-trace.json").exists()
    assert json.loads(Path("report.json").read_text())["verdict"] == "NOT_STARTED"
    assert cli.run(args("python", str(Path(program).parent)), platform=shared()) == 2  # (a folder: no script)
    assert "is a directory, not a script file" in capsys.readouterr().err


def test_a_script_that_does_not_compile_did_not_start(program, capsys):
    Path("broken.py").write_text("blocks = (1,\n")
    assert cli.run(args("python", "broken.py"), platform=shared()) == 2
    out = capsys.readouterr()
    _no_verdict(out)
    assert "python broken.py did not start: SyntaxError: " in out.err and "(broken.py, line 1)" in out.err
    assert cli.run(args("python", "-c", "1 +"), platform=shared()) == 2
    assert "python -c CODE did not start: SyntaxError" in capsys.readouterr().err


def test_a_witness_run_whose_program_does_not_start_exits_2_with_the_line(program, capsys):
    """A child of --confirm (``--witness MODE:FOLDER``) whose script is gone says so in one line,
    which its parent shows as the witness run's failure; it writes no observation."""
    from kvverify.record.confirm.witness import IN_ORDER, Plan, Target

    plan = Plan((1,), "RAW", Target(None, "prog.py:11 in <module>", "aten.copy_.default", 0),
                Target(None, "prog.py:15 in <module>", "aten.fill_.Scalar", 0), False, False)
    Path("w").mkdir()
    plan_file, observation = runs.witness_files("w")
    Path(plan_file).write_text(json.dumps(plan.to_json()))
    assert cli.run(args("python", "gone.py", witness=f"{IN_ORDER}:w"), platform=shared()) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvverify record: python gone.py did not start: ") and err.count("\n") == 1
    assert not Path(observation).exists() and not Path(observation + ".bin").exists()


@pytest.mark.parametrize("command", [
    ["python", "raises_elsewhere.py"],
    ["python", "-m", "raises_elsewhere"],
    ["python", "-m", "kvverify_pkg_raises.offload"],  # (its package's __init__ runs, and raises)
    ["python", "-c", "import kvverify_missing_dependency"],
])
def test_a_program_that_started_and_raised_module_not_found_gets_the_program_raised_path(program, capsys, command):
    """Only the program's own script or module failing to load means it did not start: a
    ModuleNotFoundError from an import the program makes is the program's failure (status 1, its
    traceback, the trace written and checked), as any exception it raises."""
    Path("raises_elsewhere.py").write_text(PROGRAM.replace("import fake_cuda\n",
                                                           "import fake_cuda\nimport kvverify_missing_dependency\n"))
    Path("kvverify_pkg_raises").mkdir()
    Path("kvverify_pkg_raises/__init__.py").write_text("import kvverify_missing_dependency\n")
    Path("kvverify_pkg_raises/offload.py").write_text("")
    status = cli.run(args(*command, json="report.json"), platform=shared())
    out = capsys.readouterr()
    assert status == 1
    assert "ModuleNotFoundError: No module named 'kvverify_missing_dependency'" in out.err
    assert "Traceback (most recent call last)" in out.err
    assert "did not start" not in out.err and "the program exited with status 1" in out.err
    assert Path("kvverify-trace.json").exists()
    assert json.loads(Path("report.json").read_text())["verdict"] == "SAFE"  # (of the 0 ops it recorded; exit 1)


def test_no_check_writes_the_trace_and_returns_the_programs_status(program, capsys):
    assert cli.run(args("python", str(program), no_check=True), platform=shared()) == 0
    out = capsys.readouterr().out
    assert "RACY" not in out and "recorded" in out


def test_pytest_runs_in_process_under_the_recording(program, capsys):
    test = Path(program).parent / "test_offload.py"
    test.write_text("import runpy, pytest\n\ndef test_offload():\n    with pytest.raises(SystemExit):\n"
                    "        runpy.run_path('prog.py', run_name='__main__')\n")
    status = cli.run(args("pytest", "-q", "-p", "no:cacheprovider", str(test)), platform=shared())
    out = capsys.readouterr().out
    assert "1 passed" in out, out
    assert status == 1 and "RACY" in out


def test_without_a_cuda_device_it_says_so_in_one_line_and_exits_2(program, capsys):
    from kvverify.cli import main

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    assert main(["record", "--", "python", str(program)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("kvverify record: nothing to record: no CUDA device is visible")
    assert out.err.count("\n") == 1
    assert not (Path(program).parent / "kvverify-trace.json").exists()


@pytest.mark.parametrize("command, line", [
    (["python", "no_such_prog.py"], "python no_such_prog.py did not start: {cwd}/no_such_prog.py does not exist"),
    (["python", "-m", "kvverify_no_such_module"], "python -m kvverify_no_such_module did not start: ImportError: "
                                                 "No module named kvverify_no_such_module: "),
    (["python", "-m", "kvverify_pkg.offlaod"], "python -m kvverify_pkg.offlaod did not start: ImportError: No module "
                                               "named kvverify_pkg.offlaod: "),
    (["python", "-m", "kvverify_pkg"], "python -m kvverify_pkg did not start: ImportError: No module named "
                                       "kvverify_pkg.__main__; 'kvverify_pkg' is a package and cannot be directly "
                                       "executed: "),
    (["python", "broken.py"], "python broken.py did not start: SyntaxError: "),
    (["python", "-m", "kvverify_pkg.broken"], "python -m kvverify_pkg.broken did not start: SyntaxError: "),
    (["python", "-c", "1 +"], "python -c CODE did not start: SyntaxError: "),
])
def test_a_program_that_cannot_start_says_so_before_any_device_check(program, capsys, monkeypatch, command, line):
    """Without a GPU, a missing script, a misspelt module or a syntax error once got "nothing to
    record: no CUDA device": whether the program can start is asked first, as on a GPU host, and
    without running any of its package's code (its ``__init__`` here would raise)."""
    from kvverify import device
    from kvverify.cli import main
    from kvverify.device import extension

    monkeypatch.setattr(extension, "cuda_refusal", lambda: pytest.fail("the device was asked for"))
    monkeypatch.setattr(device, "gpu_refusal", lambda: pytest.fail("the device was asked for"))
    Path("broken.py").write_text("blocks = (1,\n")
    Path("kvverify_pkg").mkdir()
    Path("kvverify_pkg/__init__.py").write_text("raise RuntimeError('a package is run before its module')\n")
    Path("kvverify_pkg/offload.py").write_text("")
    Path("kvverify_pkg/broken.py").write_text("def f(:\n")
    assert main(["record", "--json", "report.json", "--", *command]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out.err
    assert out.err.startswith("kvverify record: " + line.format(cwd=Path(program).parent)), out.err
    assert "kvverify_pkg" not in sys.modules
    assert json.loads(Path("report.json").read_text())["verdict"] == "NOT_STARTED"


@pytest.mark.parametrize("argv", [["python", "x.py"], ["-o", "t.json", "python", "x.py", "--", "--layers", "2"]])
def test_a_command_without_dashes_before_it_is_refused_saying_what_was_taken(program, capsys, argv):
    """``kvverify record python x.py`` was accepted silently, where an option after the program's
    name goes to the program and one before it to kvverify: the '--' is required, and the line
    names the command it took."""
    from kvverify.cli import main

    assert main(["record", *argv]) == 2
    err = capsys.readouterr().err
    taken = " ".join(argv[argv.index("python"):])
    assert err == (f"kvverify record: put '--' before the program to record: kvverify record [OPTIONS] -- {taken} "
                   "(all after '--' is the program's command line, all before it kvverify's)\n")
    assert not Path("t.json").exists() and not Path("kvverify-trace.json").exists()


def test_without_torch_it_says_so_in_one_line_and_exits_2(program, tmp_path):
    # a None in sys.modules makes `import torch` raise ImportError, as on a host without torch
    code = ("import sys; sys.modules['torch'] = None; from kvverify.cli import main; "
            f"sys.exit(main(['record', '--', 'python', {str(program)!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr == ("kvverify record: nothing to record: torch is not installed; work on the device needs a CUDA "
                        "build of torch on a host with an NVIDIA GPU (README: Install)\n")


def test_record_help_the_package_and_the_pytest_plugin_import_without_torch():
    probe = "import sys; from kvverify.cli import main\ntry: main(['record', '--help'])\nexcept SystemExit: pass\n" \
            "import kvverify.record, kvverify.record.pytest_plugin\n" \
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules), file=sys.stderr)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "-- COMMAND" in r.stdout and "exit status" in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "[]"


def test_a_safe_verdict_over_an_incomplete_recording_exits_2(program, capsys):
    import fake_cuda

    class Broken(fake_cuda.FakeCuda):
        def is_pinned(self, t):
            raise RuntimeError("no answer")

    fake_cuda.SHARED.insert(0, Broken())
    try:
        status = cli.run(args("python", str(program), "--fixed"), platform=fake_cuda.shared())
    finally:
        fake_cuda.SHARED.pop(0)
    out = capsys.readouterr()
    assert status == 2
    assert "NOT RECORDED" in out.out and "SAFE covers only what was recorded" in out.err


def test_help_fits_a_screen_in_plain_text_and_ends_with_examples():
    examples = check_screen(help_lines("record"))
    assert all(e.split()[1] in ("record", "check") for e in examples)


def test_no_op_log_hands_the_ops_to_the_dispatch_mode_and_records_the_same_ops(tmp_path, monkeypatch, capsys):
    # a platform with the extension's op log (test_oplog's stand-in): the op log writes the ops down
    # and the dispatch mode never sees one; --no-op-log hands every op to the dispatch mode
    from test_oplog import ArenaAsDevice, _native_log, dispatch_calls

    _native_log()  # skips where the extension is not built
    arena = torch.zeros(8 << 10, dtype=torch.uint8)
    holder = type(sys)("kvverify_cli_arena")  # how the program reaches the stand-in's device memory
    holder.arena = arena
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    code = "import kvverify_cli_arena as a\nfor k in range(3):\n    a.arena[k * 64:(k + 1) * 64].fill_(k)\n"
    seen = dispatch_calls(monkeypatch)
    monkeypatch.chdir(tmp_path)
    kernels = {}
    for no_op_log in (False, True):
        seen.clear()
        flags = {"no_op_log": True} if no_op_log else {}  # (--keep-all: the kernels are written)
        status = cli.run(args("python", "-c", code, keep_all=True, **flags),
                         platform=ArenaAsDevice(arena, []))
        assert status == 0, capsys.readouterr()
        kernels[no_op_log] = [op for op in json.loads((tmp_path / "kvverify-trace.json").read_text())["ops"]
                              if op["op"] == "kernel"]
        assert (seen.count("aten.fill_.Scalar") == 3) is no_op_log, seen
    assert len(kernels[False]) == 3 and all(op["at"] == "<string>:3 in <module>" for op in kernels[False])
    # (the spy's frame is where the dispatch mode locates an op, in "at" and the stream's label:
    # test_oplog.py compares those without a spy)
    same = ("name", "reads", "writes")
    assert [[op[k] for k in same] for op in kernels[True]] == [[op[k] for k in same] for op in kernels[False]]


def test_no_op_log_s_help_says_what_it_trades_in_the_command_and_the_pytest_plugin():
    """``--no-op-log``'s help ("log each op as it runs...") read as the opposite of its name: it
    says what the option gives up (the op log) and what it costs (speed), for the same trace."""
    from kvverify.record import pytest_plugin

    options = {}

    class Group:
        def addoption(self, name, **kwargs):
            options[name] = kwargs["help"]

    pytest_plugin.pytest_addoption(type("Parser", (), {"getgroup": lambda self, *a: Group()})())
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    command = next(a.help for a in parser._actions if "--no-op-log" in a.option_strings)
    for text in (command, options["--kvverify-no-op-log"]):
        assert "instead of the op log" in text and "the same trace, slower" in text, text
        assert not text.startswith("log each op"), text
    assert "after the test" in options["--kvverify-no-op-log"] and "after the program" in command
