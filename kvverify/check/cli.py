"""``kvverify check TRACE.json [--json]``: the happens-before checker on the command line.

Exit statuses: 0 SAFE, 1 RACY, 2 invalid or unreadable input, 3 anything else (a bug, or a report
that could not be written). Only a race reaches 1. Every message is one printable line of at most
``MAX_LINE`` characters, whatever the trace holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvverify import screen
from kvverify.units import format_size, size_arg

EXIT_SAFE, EXIT_RACY, EXIT_INVALID, EXIT_ERROR = 0, 1, 2, 3
OWNS_STDOUT = True  # a report not written keeps its own statuses (_emit): a SAFE nobody read is 3
MAX_LINE = 1000
DEFAULT_MAX_INPUT = 1 << 30
_READ_CHUNK = 1 << 24

EPILOG = """\
exit status:
  0  SAFE   no two accesses to the same bytes can happen in either order
  1  RACY   each race is listed with both ops, the bytes, the kind (RAW /
            WAR / WAW by issue order), why no rule orders them, and a fix
  2  the trace is invalid (or unreadable, or over --max-input-size): one
     line on stderr names the op and the field (with --json, stdout gets
     {"verdict": "INVALID", "error": ..., "op": 2, "field": "order"})
  3  anything unexpected: a bug (please report it; --debug shows the
     traceback), or a report not written (a SAFE nobody read is not SAFE)

Format: docs/trace-format.md; rules and the CUDA behaviour they follow:
docs/checker.md (rule 6 as amended: a copy INTO pageable memory has not
completed when the call returns; the host must synchronize before it reads).

example:
  $ cat store.json
  {"version": 1, "streams": ["compute", "offload"],
   "buffers": {"gpu": {"space": "device", "bytes": 8192},
               "cpu": {"space": "host_pinned", "bytes": 8192}},
   "ops": [{"op": "kernel", "stream": "compute", "writes": [["gpu", 0, 4096]]},
           {"op": "wait_stream", "stream": "offload", "on": "compute"},
           {"op": "copy_batch", "stream": "offload", "order": "ANY",
            "copies": [{"src": ["gpu", 0, 4096], "dst": ["cpu", 0, 4096]}]}]}
  $ kvverify check store.json
  RACY in store.json (3 ops, 2 streams): 1 race
  race 1: RAW on gpu[0:4096] (4096 bytes), rule 5
    ...
    fix:    use STREAM order for op 2: a device source must be read in ...
  $ kvverify check --json - < store.json | jq .verdict
  "RACY"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Decide from CUDA's ordering rules alone (program and stream order, events,\n"
        "host synchronization, cuMemcpyBatchAsync's source access order, pageable\n"
        "memory, batch internals) whether two accesses in a trace of stream work can\n"
        "touch the same bytes in either order. Nothing runs on a GPU.")
    parser.epilog = EPILOG
    parser.add_argument("trace", metavar="TRACE.json",
                        help="the trace to check; '-' reads it from standard input")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"verdict": "SAFE"|"RACY"|"INVALID", ...} instead of the report')
    parser.add_argument("--max-races", type=int, default=None, metavar="N",
                        help="list at most N races (default 10000); the verdict does not depend on it")
    parser.add_argument("--max-input-size", type=size_arg, default=DEFAULT_MAX_INPUT, metavar="SIZE",
                        help=f"refuse a trace larger than this (default {format_size(DEFAULT_MAX_INPUT)}; "
                             "e.g. 8GiB for a recording of a long run: about 400 bytes per op)")
    parser.add_argument("--debug", action="store_true",
                        help="on an unexpected error (exit status 3), print the traceback")


class _Unreadable(Exception):
    """The input could not be read, or is too large: exit status 2."""


def run(args: argparse.Namespace) -> int:
    """Run ``kvverify check``; return the exit status (see the module docstring)."""
    try:
        return _run(args)
    except Exception as e:    # noqa: BLE001 - the one place that turns a bug into exit status 3
        if args.debug:
            import traceback

            traceback.print_exc()
        _say(f"internal error ({type(e).__name__}: {e}); this is a bug in kvverify: please report it "
             f"with the trace{'' if args.debug else ' and the traceback that --debug prints'}")
        return EXIT_ERROR


def _run(args: argparse.Namespace) -> int:
    from kvverify.check.checker import DEFAULT_MAX_RACES, check_ops
    from kvverify.check.model import TraceError, TraceText

    max_races = DEFAULT_MAX_RACES if args.max_races is None else args.max_races
    if max_races < 1:
        _say("--max-races must be at least 1")
        return EXIT_INVALID
    source = "<stdin>" if args.trace == "-" else args.trace
    try:
        text = TraceText(_read(args.trace, source, args.max_input_size))
        verdict = check_ops(text.buffers, text.streams, text.ops(), text.trace, max_races=max_races,
                           threads=text.threads)
    except _Unreadable as e:
        return _invalid(args, str(e))
    except TraceError as e:
        return _invalid(args, f"invalid trace: {e}", op=e.op_index, field=e.field)
    status = EXIT_SAFE if verdict.safe else EXIT_RACY
    if args.json:
        return _emit(json.dumps(verdict.to_json(), indent=2) + "\n", status)
    return _emit(screen.fit(verdict.render(source=source), sys.stdout), status)


def _read(path: str, source: str, limit: int) -> bytes | bytearray:
    """The bytes of the trace, at most ``limit`` of them; stops early at a first byte that cannot
    start a trace (so ``/dev/zero`` or a binary file fails at once, not at the limit)."""
    try:
        if path == "-":
            if sys.stdin is None:
                raise _Unreadable("cannot read the trace: standard input is closed")
            return _read_from(sys.stdin.buffer, source, limit)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise _Unreadable(_too_large(f"{source} is {format_size(size)}, more", limit))
            return _read_from(f, source, limit)
    except OSError as e:
        raise _Unreadable(f"cannot read {source}: {e.strerror or e}") from None


def _read_from(f, source: str, limit: int) -> bytes | bytearray:
    # one buffer that grows in place (no list of chunks joined into a copy at the end)
    data = bytearray()
    while True:
        chunk = f.read(min(_READ_CHUNK, limit + 1 - len(data)))
        if not chunk:
            return data
        if not data and not chunk.lstrip(b" \t\r\n").startswith((b"{", b"\xef\xbb\xbf")) and chunk.strip():
            return chunk     # not JSON text of a trace: the parser names what it found
        data += chunk
        if len(data) > limit:
            raise _Unreadable(_too_large(f"{source} holds more", limit))


def _too_large(what: str, limit: int) -> str:
    return (f"{what} than --max-input-size allows ({format_size(limit)}): a trace takes about 400 bytes "
            "per op; if it is meant to be this large, raise the limit (e.g. --max-input-size 8GiB)")


def _invalid(args: argparse.Namespace, message: str, op: int | None = None, field: str | None = None) -> int:
    line = _say(message)
    if args.json:
        from kvverify.terms import INVALID

        _emit(json.dumps({"verdict": INVALID, "error": line, "op": op, "field": field}) + "\n", EXIT_INVALID)
    return EXIT_INVALID


def _say(message: str) -> str:
    """Print one line on stderr, escaped and cut to ``MAX_LINE`` characters; return the message part."""
    from kvverify.check.model import cut, printable

    prefix = "kvverify check: "
    line = cut(printable(message.replace("\n", " ")), MAX_LINE - len(prefix))
    try:
        print(prefix + line, file=sys.stderr)
    except (OSError, AttributeError, ValueError):
        pass            # no stderr to say it on: the exit status still does
    return line


def _emit(text: str, status: int) -> int:
    """Write the report; a report that could not be written ends quietly, and a SAFE verdict
    nobody read is exit status 3, not 0."""
    out = sys.stdout
    try:
        if out is None:
            raise OSError("standard output is closed")
        if hasattr(out, "reconfigure"):
            out.reconfigure(errors="backslashreplace")   # names in any script, on any terminal
        out.write(text)
        out.flush()
    except BrokenPipeError:
        _quiet(out)
        return EXIT_ERROR if status == EXIT_SAFE else status
    except OSError as e:
        _quiet(out)
        _say(f"cannot write the report: {e.strerror or e}")
        return EXIT_ERROR if status == EXIT_SAFE else status
    return status


def _quiet(out) -> None:
    """Point the broken standard output at /dev/null, so that the interpreter's flush at exit
    does not fail again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass
