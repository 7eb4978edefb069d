"""``kvverify record [-o TRACE.json] [--no-check] -- python prog.py ... | -- pytest ...``.

Runs a Python program in this process under the recorder, writes the trace, checks it and prints
each race with both source locations. Exit status: the program's own when it failed; else 1 on a
race, 0 when safe; 2 when nothing could be recorded (no CUDA device, a bad command line, a program
that did not start: its script or module not found, or not compiled; no verdict then, and
``--json`` says ``"verdict": "NOT_STARTED"``).

The program runs as ``kvverify.record.inprocess`` runs it; the witness runs of ``--confirm`` are
``kvverify.record.confirm.runs``'s.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvverify.record.confirm import runs
from kvverify.record.inprocess import check_start, program, run_program
from kvverify.record.session import NO_OP_LOG_HELP

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

Runs in this process (runpy, pytest.main), with the threads it starts; threads
running before, tests that record themselves, and child processes that use
CUDA are NOT RECORDED, and the rest is never called SAFE (docs/record.md).

Examples:
  kvverify record -- python offload_test.py --layers 32
  kvverify record -o trace.json -- pytest -x tests/offload
  kvverify record --swap-op myengine::swap_blocks -- python -m myengine.bench
  kvverify record --confirm --json report.json -- python offload_test.py
  kvverify check trace.json              # decide a written trace again
"""


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


def after_dashes(args: argparse.Namespace) -> bool:
    """Whether the command line put the program after ``--`` (``kvverify record [OPTIONS] --
    COMMAND``), so that no option of the program's is taken for kvverify's, nor the reverse. A
    Namespace without ``command_argv`` (built by a caller, not ``kvverify.cli.main``) counts as so."""
    argv = getattr(args, "command_argv", None)
    if argv is None:
        return True
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return "--" in argv and argv[argv.index("--") + 1:] == command



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
        return runs.witness_run(args.witness, kind, target, arguments, args.swap_op, platform)
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
              "failed on, work of other threads, recordings nested in this one, child processes that used CUDA): "
              "SAFE covers only what was recorded", file=sys.stderr)
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


def _confirm(command: list[str], swap_ops, rec, verdict, platform) -> list:
    def progress(line: str) -> None:
        print(f"kvverify record: --confirm: {line}", file=sys.stderr, flush=True)

    outcomes = runs.confirm_races(command, swap_ops, rec, verdict, platform, progress)
    _show("\n".join([f"\nwitnesses ({len(outcomes)} pair{'s' if len(outcomes) != 1 else ''} of lines):",
                      *(f"  {outcome.line()}" for outcome in outcomes)]))
    return outcomes
