"""``kvverify record [-o TRACE.json] [--no-check] -- python prog.py ... | -- pytest ...``.

Runs a Python program in this process under the recorder, writes the trace, checks it and prints
each race with both source locations. Exit status: the program's own when it failed; else 1 on a
race, 0 when safe; 2 when nothing could be recorded (no CUDA device, a bad command line, a program
that did not start: its script or module not found, or not compiled; no verdict then, and
``--json`` says ``"verdict": "NOT_STARTED"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

OWNS_STDOUT = True  # the recorded program runs in this process and writes to the real standard output

EPILOG = """\
exit status:
  0  the program succeeded and its recorded device work is SAFE
  1  it succeeded and its recorded work races (each race with both ops, the
     lines that issued them, the bytes, the kind, why, and a fix)
  N  the program's own exit status, when it failed (the trace written, checked)
  2  nothing was recorded (no CUDA device, another allocator than torch's, a
     command this cannot run in-process, a program that did not start: stderr
     says which); or no race, but NOT RECORDED lines (the JSON has complete:
     false); or the trace was not written. --confirm changes none.

The program runs in this process (runpy, or pytest.main). Threads it starts
are recorded; threads running before, and tests that record themselves, are
NOT RECORDED, and the rest is never called SAFE (docs/record.md).

Examples:
  kvverify record -- python offload_test.py --layers 32
  kvverify record -o trace.json -- pytest -x tests/offload
  kvverify record --swap-op myengine::swap_blocks -- python -m myengine.bench
  kvverify record --confirm --json report.json -- python offload_test.py
  kvverify check trace.json              # decide a written trace again
"""


# What --no-op-log trades (the pytest plugin's --kvverify-no-op-log says the same).
NO_OP_LOG_HELP = ("record ops by a dispatch mode as they run instead of the op log (C++, logged after the "
                  "program): the same trace, slower (docs/record.md)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Run a PyTorch program under the recorder and find its races: what it asks the\n"
        "CUDA device to do (streams, events, synchronization, kernels, copies, batched\n"
        "swaps with their source access order, host accesses to pinned memory) becomes\n"
        "a trace, which kvverify check decides.")
    parser.epilog = EPILOG
    parser.add_argument("-o", "--output", default="kvverify-trace.json", metavar="TRACE.json",
                        help="where to write the trace (default: %(default)s)")
    parser.add_argument("--no-check", action="store_true", help="write the trace, do not check it")
    parser.add_argument("--swap-op", action="append", default=[], metavar="NS::NAME",
                        help="an op with the schema of kvverify::swap_blocks_batch under another name (a serving "
                             "engine's own); repeat for several. Ops named *::swap_blocks_batch are found anyway")
    parser.add_argument("--keep-all", action="store_true",
                        help="write every kernel access, also to buffers only kernels on one stream touch (they cannot race)")
    parser.add_argument("--no-op-log", action="store_true",
                        help=NO_OP_LOG_HELP)
    parser.add_argument("--max-races", type=int, default=20, metavar="N",
                        help="list at most N races (default %(default)s); the verdict does not depend on it")
    parser.add_argument("--confirm", action="store_true",
                        help="per racing pair of lines, run the program again: twice in issue order, once with "
                             "the second op forced first; CONFIRMED where the bytes differ")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the verdict and each witness as JSON")
    parser.add_argument("--witness", default=None, help=argparse.SUPPRESS)  # MODE:FOLDER, a child's own
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="python SCRIPT.py ARGS | python -m MODULE ARGS | python -c CODE | pytest ARGS | "
                             "SCRIPT.py ARGS")


def _fail(message: str) -> int:
    print(f"kvverify record: {message}", file=sys.stderr)
    return 2


def program(command: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, arguments)`` of a command line: kind ``"script"`` (target: its path),
    ``"module"``, ``"code"`` or ``"pytest"``. Raises ValueError for a command that cannot run
    in-process, naming it."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("name the program to record after '--', e.g. kvverify record -- python prog.py")
    first, rest = command[0], command[1:]
    name = os.path.basename(first)
    if name in ("pytest", "py.test"):
        return "pytest", "pytest", rest
    if name.startswith("python"):
        if not rest:
            raise ValueError(f"'{first}' without a script, -m MODULE or -c CODE has nothing to run")
        if rest[0] == "-m" and len(rest) > 1:
            if rest[1] == "pytest":
                return "pytest", "pytest", rest[2:]
            return "module", rest[1], rest[2:]
        if rest[0] == "-c" and len(rest) > 1:
            return "code", rest[1], rest[2:]
        if rest[0] in ("-m", "-c"):
            raise ValueError(f"'{first} {rest[0]}' needs a {'module name' if rest[0] == '-m' else 'line of code'} "
                             "after it")
        if rest[0].startswith("-"):
            raise ValueError(f"python option {rest[0]} is not supported in-process; give python SCRIPT.py, "
                             "-m MODULE or -c CODE")
        return "script", rest[0], rest[1:]
    if first.endswith(".py"):
        return "script", first, rest
    raise ValueError(f"'{first}' is not a Python program this can run in-process; give python SCRIPT.py ..., "
                     "python -m MODULE ..., or pytest ...")


def after_dashes(args: argparse.Namespace) -> bool:
    """Whether the command line put the program after ``--`` (``kvverify record [OPTIONS] --
    COMMAND``), so that no option of the program's is taken for kvverify's, nor the reverse. A
    Namespace without ``command_argv`` (built by a caller, not ``kvverify.cli.main``) counts as so."""
    argv = getattr(args, "command_argv", None)
    if argv is None:
        return True
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return "--" in argv and argv[argv.index("--") + 1:] == command


def check_start(kind: str, target: str) -> None:
    """Raise NotStartedError, with the line ``run_program`` would give, where the program cannot
    start: a script that is not a file or does not compile, a module python -m would not find (found
    here without running any package's code) or that does not compile, code for -c that does not
    compile, pytest not installed. Asked before the recording starts, so that a host without a
    CUDA device says so only of a program that could run."""
    import importlib.util

    from kvverify.errors import NotStartedError

    try:
        if kind == "pytest":
            if importlib.util.find_spec("pytest") is None:
                raise ModuleNotFoundError("No module named 'pytest'")
        elif kind == "code":
            compile(target, "<string>", "exec")
        elif kind == "script":
            if not os.path.isfile(target):
                raise NotStartedError(_no_script(target))
            _compile_source(target, target)
        else:
            origin = _module_origin(target)
            if origin is not None:
                _compile_source(origin, origin)
    except NotStartedError:
        raise
    except (ImportError, SyntaxError, ValueError) as exc:  # (ValueError: a null byte in source, before 3.12)
        raise NotStartedError(_could_not_start(kind, target, exc)) from exc


def _compile_source(path: str, filename: str) -> None:
    """Compile the Python source at ``path`` as runpy would (a zip archive or bytecode, which runpy
    also runs, is left to it)."""
    import importlib.util
    import zipfile

    if zipfile.is_zipfile(path):
        return
    with open(path, "rb") as f:
        source = f.read()
    if not source.startswith(importlib.util.MAGIC_NUMBER):
        compile(source, filename, "exec")


def _module_origin(name: str) -> str | None:
    """The source file python -m ``name`` runs (a package's ``__main__``), looked up as runpy looks it
    up but without importing any package, from the working directory first; None where it is no
    source file. Raises ImportError as runpy words it where the module or a package is missing."""
    import importlib.machinery
    import importlib.util

    parts = name.split(".")
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(parts[0])  # (a top-level name: nothing is imported)
        for depth in range(1, len(parts) + 1):
            if spec is None:
                missing = ".".join(parts[:depth])
                raise ImportError(f"No module named {name}") if depth == len(parts) else \
                    ModuleNotFoundError(f"No module named {missing!r}")
            if depth < len(parts):
                if spec.submodule_search_locations is None:
                    raise ModuleNotFoundError(f"No module named {name!r}; {spec.name!r} is not a package")
                spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]),
                                                                list(spec.submodule_search_locations))
        if spec.submodule_search_locations is not None:
            main = importlib.machinery.PathFinder.find_spec(f"{name}.__main__", list(spec.submodule_search_locations))
            if main is None:
                raise ImportError(f"No module named {name}.__main__; {name!r} is a package and cannot be directly "
                                  "executed")
            spec = main
    finally:
        sys.path.remove(os.getcwd())
    origin = spec.origin
    return origin if spec.has_location and origin and origin.endswith(".py") else None


def run_program(kind: str, target: str, arguments: list[str]) -> int:
    """Run the program here, on this thread; return its exit status (an uncaught exception is
    printed and gives 1, as python does). Raises NotStartedError, one line naming what, where and
    what to do, where the program did not start: its script or module not found, or not read or
    compiled (an exception with none of the program's code in its traceback, see ``_not_started``)."""
    import runpy
    import traceback

    from kvverify.errors import NotStartedError

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if kind == "pytest":
            import pytest

            return int(pytest.main(arguments))
        if kind == "script":
            if not os.path.isfile(target):
                raise NotStartedError(_no_script(target))
            sys.argv = [target, *arguments]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.argv = [target, *arguments]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *arguments]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except NotStartedError:
        raise
    except Exception as exc:
        if _not_started(exc):
            raise NotStartedError(_could_not_start(kind, target, exc)) from exc
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


# Python's own code that finds, reads and compiles a program before any of it runs (runpy's lookup
# of a module, importlib's finders and loaders); frozen modules have file names "<frozen NAME>".
_MACHINERY = ("runpy", "pkgutil", "importlib", "zipimport")


def _machinery(filename: str) -> bool:
    if filename.startswith("<frozen ") and filename.endswith(">"):
        return filename[len("<frozen "):-1].partition(".")[0] in _MACHINERY
    import importlib
    import pkgutil
    import runpy

    path = os.path.normcase(os.path.realpath(filename))
    files = {os.path.normcase(os.path.realpath(m.__file__)) for m in (runpy, pkgutil)}
    return path in files or os.path.dirname(path) == os.path.normcase(
        os.path.dirname(os.path.realpath(importlib.__file__)))


def _not_started(exc: BaseException) -> bool:
    """Whether ``exc``, caught in run_program, was raised before the program started: no frame of
    its traceback after run_program's own runs other code than Python's import machinery (a
    missing module, or a script or module that cannot be read or compiled). An exception from the
    program's own code, a ModuleNotFoundError of an import it makes included, has its frames."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # (the first: run_program)
    while tb is not None:
        if not _machinery(tb.tb_frame.f_code.co_filename):
            return False
        tb = tb.tb_next
    return True


def _working_directory() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "(unknown: it was removed)"


def _no_script(target: str) -> str:
    """The line for a script that is not there (or not a file)."""
    from kvverify.check.model import printable

    try:
        where = os.path.abspath(target)
    except OSError:  # (no working directory)
        where = target
    problem = ("is a directory, not a script file" if os.path.isdir(target) else
               "is not a regular file" if os.path.exists(target) else "does not exist")
    return printable(f"python {target} did not start: {where} {problem} (the working directory is "
                     f"{_working_directory()}): no trace, no verdict; check the script's path")


def _could_not_start(kind: str, target: str, exc: BaseException) -> str:
    """The line for a program that did not start (``exc``: why)."""
    from kvverify.check.model import printable

    what = {"module": f"python -m {target}", "script": f"python {target}", "code": "python -c CODE"}.get(kind, kind)
    if isinstance(exc, (SyntaxError, ValueError)):  # (ValueError: a null byte in source, before 3.12)
        todo = {"module": "fix the module", "script": "fix the script", "code": "fix the code given to -c"}.get(
            kind, "fix it")
    elif kind == "module":
        todo = (f"check the module name (python -m takes a dotted name without .py; run a file as python PATH) "
                f"and the working directory ({_working_directory()}), where python -m looks first")
    elif kind == "pytest":
        todo = "install pytest where this python finds it"
    else:
        todo = f"check the path (relative to the working directory, {_working_directory()}) and its permissions"
    return printable(f"{what} did not start: {type(exc).__name__}: {exc}: no trace, no verdict; {todo}")


def run(args: argparse.Namespace, platform=None) -> int:
    """``platform``: the device layer (default: the CUDA device through torch; tests pass a stand-in)."""
    from kvverify.errors import NotStartedError, RecordingError
    from kvverify.record.session import recording

    try:
        kind, target, arguments = program(args.command)
    except ValueError as exc:
        return _fail(str(exc))
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = " ".join(argv)
    if not after_dashes(args):
        return _fail(f"put '--' before the program to record: kvverify record [OPTIONS] -- {command} (all after "
                     "'--' is the program's command line, all before it kvverify's)")
    if args.max_races < 1:
        return _fail("--max-races must be at least 1")
    if args.witness:
        return _witness_run(args.witness, kind, target, arguments, args.swap_op, platform)
    try:
        check_start(kind, target)  # before the device: a host without one says it of a program that runs
    except NotStartedError as exc:
        return _no_verdict(args, command, str(exc))
    rec = recording(swap_ops=args.swap_op, keep_all=args.keep_all, platform=platform, op_log=not args.no_op_log)
    try:
        rec.start()
    except RecordingError as exc:
        return _fail(str(exc))
    if args.confirm:
        from kvverify.record.confirm.witness import Forcer

        rec.follow_calls(Forcer(rec.recorder))
    not_started = None
    try:
        status = run_program(kind, target, arguments)
    except NotStartedError as exc:
        not_started = str(exc)
    finally:
        rec.stop()
    if not_started is not None:
        return _no_verdict(args, command, not_started)
    written = True  # (a trace that could not be written is said so; it changes neither the program's status nor the verdict)
    try:
        rec.write(args.output)
    except OSError as exc:
        written = False
        print(f"kvverify record: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
    else:
        print(f"kvverify record: trace written to {args.output}", file=sys.stderr)
    if args.no_check:
        _show("\n".join(rec.summary().lines()))
        if args.confirm:
            print("kvverify record: --confirm needs the check (--no-check was given): no witness runs",
                  file=sys.stderr)
        return status if status != 0 or written else 2
    from kvverify.check import check

    verdict = check(rec.trace(), max_races=args.max_races)
    _show(verdict.render(source=command).rstrip("\n") + "\n\n" + "\n".join(rec.summary().lines()))
    witnesses = None  # (null in the JSON report: no witness runs were made)
    if args.confirm and verdict.races:
        if status != 0:
            print("kvverify record: --confirm: the program failed; no witness runs", file=sys.stderr)
        else:
            # every race, not only those listed: each racing pair of lines gets its witness
            try:
                every = check(rec.trace(), max_races=None) if verdict.truncated else verdict
                witnesses = _confirm(argv, args.swap_op, rec, every, platform)
            except Exception as exc:  # the verdict and its exit status stand
                print(f"kvverify record: --confirm failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if args.json:
        _write_report(args.json, {"command": command, **verdict.to_json(), "complete": rec.complete(),
                                  "witnesses": None if witnesses is None else [w.to_json() for w in witnesses]})
    if status != 0:
        print(f"kvverify record: the program exited with status {status}", file=sys.stderr)
        return status
    if verdict.safe and not rec.complete():
        print("kvverify record: the recording missed device work (the NOT RECORDED lines above: ops the recorder "
              "failed on, work of other threads, recordings nested in this one): SAFE covers only what was "
              "recorded", file=sys.stderr)
        return 2
    if verdict.safe and not written:
        return 2
    return 0 if verdict.safe else 1


def _no_verdict(args: argparse.Namespace, command: str, not_started: str) -> int:
    """A program that did not start: no trace, no verdict (a SAFE over what never ran would be a
    lie); the line on stderr, and in the JSON report (``--json``) as NOT_STARTED. Returns 2."""
    if args.json:
        from kvverify.terms import NOT_STARTED

        _write_report(args.json, {"command": command, "verdict": NOT_STARTED, "error": not_started, "races": [],
                                  "complete": False, "witnesses": None}, say_so=False)
    return _fail(not_started)


def _show(text: str) -> None:
    """Print a screen of the report (the verdict, the summary, the witnesses) as every screen is
    laid out (``kvverify.screen``)."""
    from kvverify import screen

    print(screen.fit(text, sys.stdout))


def _write_report(path: str, report: dict, say_so: bool = True) -> None:
    """The JSON report (``--json``); where it went is said on stderr (``say_so``: a refusal keeps its
    one line), as is a report that cannot be written."""
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    except OSError as exc:
        print(f"kvverify record: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
    else:
        if say_so:
            print(f"kvverify record: report written to {path}", file=sys.stderr)


WITNESS_ENV = "KVVERIFY_WITNESS"  # MODE:FOLDER for the pytest plugin of a witness run of one test


def witness_runs(command: list[str], swap_ops, scratch: str, platform=None, per_test: bool = False):
    """``run(plan, mode)``: one witness run of ``command`` (``python prog.py ...``, ``pytest ...``)
    in a child process, its observation read back from a folder under ``scratch`` (the caller's);
    with ``platform``, in this process (the CPU tests' stand-in). ``per_test``: ``command`` runs
    one pytest test, whose witness run the plugin starts where it starts the test's recording
    (``WITNESS_ENV``), so that calls are counted from the same point; else the whole command is
    the witness run, as it was the recording. A child that fails before it observes anything gives
    an observation that says so."""
    import subprocess

    from kvverify.record.confirm import witness

    kind, target, arguments = program(command)
    if per_test:
        if kind != "pytest":
            raise ValueError(f"a witness run per test needs a pytest command, not {command!r}")
        arguments = [*arguments, *(a for op in swap_ops for a in ("--kvverify-swap-op", op))]
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):  # (else its entry point loads the plugin)
            arguments = ["-p", "kvverify.record.pytest_plugin", *arguments]

    def run(plan, mode: str):
        folder = os.path.join(scratch, mode)
        os.makedirs(folder, exist_ok=True)
        plan_file, out = witness_files(folder)
        for leftover in (out, out + ".bin"):
            if os.path.exists(leftover):
                os.remove(leftover)
        with open(plan_file, "w") as f:
            json.dump(plan.to_json(), f)
        spec = f"{mode}:{folder}"
        done = None
        if per_test:
            saved = os.environ.get(WITNESS_ENV)
            os.environ[WITNESS_ENV] = spec  # (the plugin takes it out at once: nothing the test starts sees it)
            try:
                if platform is not None:
                    run_program("pytest", "pytest", arguments)
                else:
                    done = subprocess.run([sys.executable, "-m", "pytest", *arguments], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True)
            finally:
                if saved is None:
                    os.environ.pop(WITNESS_ENV, None)
                else:
                    os.environ[WITNESS_ENV] = saved
        elif platform is not None:
            _witness_run(spec, kind, target, arguments, swap_ops, platform)
        else:
            swap = [a for op in swap_ops for a in ("--swap-op", op)]
            done = subprocess.run([sys.executable, "-m", "kvverify", "record", "--witness", spec, *swap, "--",
                                   *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not os.path.exists(out + ".bin"):
            if done is None:
                return witness.Observation(mode, note=f"the {mode} run observed nothing (it failed before the pair)")
            tail = " / ".join(done.stderr.strip().splitlines()[-3:])
            return witness.Observation(mode, status=done.returncode,
                                       note=f"the {mode} run failed (exit {done.returncode}): {tail}")
        return witness.load(out)

    return run


def witness_files(folder: str) -> tuple[str, str]:
    """``(plan file, observation file)`` of a witness run's folder."""
    return os.path.join(folder, "plan.json"), os.path.join(folder, "observation.json")


def read_witness_spec(spec: str):
    """``(mode, plan, observation file)`` of a witness run's ``MODE:FOLDER`` (the folder holds the
    plan, and gets the observation). Raises ValueError naming what is wrong with it."""
    from kvverify.record.confirm import witness

    mode, _, folder = spec.partition(":")
    if mode not in (witness.IN_ORDER, witness.FORCED) or not folder:
        raise ValueError(f"a witness run takes {witness.IN_ORDER}|{witness.FORCED}:FOLDER, not {spec!r}")
    plan_file, out = witness_files(folder)
    try:
        with open(plan_file) as f:
            plan = witness.Plan.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the witness plan {plan_file}: {exc}") from exc
    return mode, plan, out


def confirm_races(command: list[str], swap_ops, rec, verdict, platform=None,
                  progress=lambda line: None, per_test: bool = False) -> list:
    """The witness outcomes (``kvverify.record.confirm.witness.Outcome``) of ``verdict``'s races in the
    recording ``rec`` of ``command``, in the order of the races, its witness runs in child
    processes (see ``witness_runs``)."""
    import shutil
    import tempfile

    from kvverify.record.confirm import witness

    plan_list, outcomes = witness.plans(rec.recorder.ops, rec.summary().sources, verdict.races)
    scratch = tempfile.mkdtemp(prefix="kvverify-witness-")
    try:
        runs = witness_runs(command, swap_ops, scratch, platform, per_test)
        return witness.in_race_order(witness.confirm(plan_list, runs, progress) + outcomes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _confirm(command: list[str], swap_ops, rec, verdict, platform) -> list:
    def progress(line: str) -> None:
        print(f"kvverify record: --confirm: {line}", file=sys.stderr, flush=True)

    outcomes = confirm_races(command, swap_ops, rec, verdict, platform, progress)
    _show("\n".join([f"\nwitnesses ({len(outcomes)} pair{'s' if len(outcomes) != 1 else ''} of lines):",
                      *(f"  {outcome.line()}" for outcome in outcomes)]))
    return outcomes


def _witness_run(spec: str, kind: str, target: str, arguments: list[str], swap_ops, platform) -> int:
    """A child of ``--confirm``: the program once as a witness run (``MODE:FOLDER``, the folder
    holding its plan); writes the observation there and returns the program's exit status (2 and
    one line for a bad spec, where no recording can start, or where the program does not start)."""
    from kvverify.errors import NotStartedError, RecordingError
    from kvverify.record.confirm import witness

    try:
        mode, plan, out = read_witness_spec(spec)
        obs = witness.observe(lambda: run_program(kind, target, arguments), plan, mode, swap_ops=swap_ops,
                              platform=platform)
    except (RecordingError, ValueError, NotStartedError) as exc:
        return _fail(str(exc))
    witness.save(obs, out)
    return obs.status
