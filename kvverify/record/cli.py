"""``kvverify record [-o TRACE.json] [--no-check] -- python prog.py ... | -- pytest ...``.

Runs a Python program in this process under the recorder, writes the trace, checks it and prints
each race with both source locations. Exit status: the program's own when it failed (``os._exit(N)``
is an exit with N); else 1 on a race, 0 when safe; 2 when nothing could be recorded (no CUDA device,
a bad command line, a program that did not start: its script or module not found, or not compiled;
no verdict then, and ``--json`` says ``"verdict": "NOT_STARTED"``). A program a signal ended
(SIGTERM, an uncaught KeyboardInterrupt): 1 on a race, else 128 + the signal's number; never 0.
The ends that never return here (``os._exit``, SIGTERM) are ``kvverify.record.ends``'s.

The program runs as ``kvverify.record.inprocess`` runs it; the witness runs of ``--confirm`` are
``kvverify.record.confirm.runs``'s.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import traceback

from kvverify.record.confirm import runs
from kvverify.record.ends import HardEnds
from kvverify.record.inprocess import check_start, program, run_program
from kvverify.record.session import NO_OP_LOG_HELP
from kvverify.terms import NOT_RECORDED, NOT_STARTED

OWNS_STDOUT = True  # the recorded program runs in this process and writes to the real standard output

EPILOG = """\
exit status (os._exit(N) counts as an exit with N):
  0  the program succeeded and its recorded device work is SAFE
  1  its recorded work races, and it succeeded or a signal ended it (each race
     with both ops, the lines that issued them, the bytes, the kind, why, a fix)
  N  the program's own exit status, when it failed (the trace written, checked)
  128+S  a signal S ended it (SIGTERM, SIGINT), and no race was found
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
        "CUDA device to do (streams, events, kernels, copies, swaps, host accesses to\n"
        "pinned memory) becomes a trace, which kvverify check decides.")
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
    finish = functools.partial(_finish, args, rec, command, argv, platform)
    ends = HardEnds(rec, finish, lambda line: _no_verdict(args, command, line, NOT_RECORDED))
    try:
        rec.start()
    except RecordingError as exc:
        return _fail(str(exc))
    if args.confirm:
        from kvverify.record.confirm.witness import Forcer

        rec.follow_calls(Forcer(rec.recorder))
    ends.install()
    not_started = signum = None
    try:
        status = run_program(kind, target, arguments)
    except NotStartedError as exc:
        not_started = str(exc)
    except KeyboardInterrupt:  # (SIGINT: the program's finally blocks ran; its traceback, as python prints it)
        traceback.print_exc()
        status, signum = 0, signal.SIGINT
    finally:
        ends.remove()
        rec.stop()
    if not_started is not None:
        return _no_verdict(args, command, not_started)
    return finish(status, signum=signum)


def _finish(args: argparse.Namespace, rec, command: str, argv: list[str], platform, status: int,
            signum: int | None = None, how: str | None = None) -> int:
    """The command's end, the recording stopped: write the trace, check it, print the report (the
    witnesses of ``--confirm``, the JSON report of ``--json``); returns the exit status (the
    module's docstring). ``status``: the program's own; ``signum``: the signal that ended it (then
    1 where its recorded work races, else 128 + ``signum``: never 0); ``how``: how it ended where it
    never returned (``os._exit(N)``, ``SIGTERM``: ``kvverify.record.ends``)."""
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
        if signum is not None:
            return _ended_by_signal(signum, None)
        return status if status != 0 or written else 2
    from kvverify.check import check

    verdict = check(rec.trace(), max_races=args.max_races)
    _show(verdict.render(source=command).rstrip("\n") + "\n\n" + "\n".join(rec.summary().lines()))
    witnesses = None  # (null in the JSON report: no witness runs were made)
    if args.confirm and verdict.races:
        if status != 0 or signum is not None:
            print("kvverify record: --confirm: the program failed; no witness runs", file=sys.stderr)
        elif how is not None:
            print(f"kvverify record: --confirm: the program ended by {how}, which would end its witness runs too, "
                  "before they write what they saw: no witness runs", file=sys.stderr)
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
    if signum is not None:
        return _ended_by_signal(signum, verdict)
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


def _ended_by_signal(signum: int, verdict) -> int:
    """The exit status of a program the signal ``signum`` ended (``verdict``: None unchecked): 1
    where its recorded work races, else 128 + ``signum``, as a shell reports the signal; never 0,
    whatever the program would have done after it. Says which on stderr."""
    name = signal.Signals(signum).name
    if verdict is not None and not verdict.safe:
        print(f"kvverify record: the program was ended by {name}, and its recorded work races: exit status 1",
              file=sys.stderr)
        return 1
    found = "no race found in its recorded work" if verdict is not None else "its recorded work not checked"
    print(f"kvverify record: the program was ended by {name} ({found}): exit status {128 + signum}",
          file=sys.stderr)
    return 128 + signum


def _no_verdict(args: argparse.Namespace, command: str, line: str, verdict: str = NOT_STARTED) -> int:
    """No trace, no verdict: a program that did not start (a SAFE over what never ran would be a
    lie; ``verdict`` NOT_STARTED), or one that ended where its recording could not be stopped
    (NOT_RECORDED); ``line`` on stderr, and in the JSON report (``--json``) as its ``error``.
    Returns 2."""
    if args.json:
        _write_report(args.json, {"command": command, "verdict": verdict, "error": line, "races": [],
                                  "complete": False, "witnesses": None}, say_so=False)
    return _fail(line)


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
