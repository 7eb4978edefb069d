"""``kvverify check TRACE.json [--json]``: the happens-before checker on the command line."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """\
exit status:
  0  SAFE   no two accesses to the same bytes can happen in either order
  1  RACY   at least one race; each is listed with both ops, the bytes, the kind
            (RAW / WAR / WAW by issue order), why no rule orders them, and a fix
  2  the trace is invalid (or unreadable): one line on stderr names the op index
     and the field, e.g.
       kvverify check: invalid trace: op 2 (copy_batch), field 'order': unknown order "FAST" ...

The trace format is docs/trace-format.md (version 1); docs/checker.md explains the rules
and the CUDA behaviour each follows. One deliberate difference: a copy INTO pageable host
memory is not taken to have completed when the call returns (rule 6 as amended, after the
current CUDA docs and a measurement on an H200): the host must synchronize before it reads.

example:
  $ cat store.json
  {"version": 1,
   "buffers": {"gpu": {"space": "device", "bytes": 8192},
               "cpu": {"space": "host_pinned", "bytes": 8192}},
   "streams": ["compute", "offload"],
   "ops": [
    {"op": "kernel", "stream": "compute", "name": "write_kv", "writes": [["gpu", 0, 4096]]},
    {"op": "wait_stream", "stream": "offload", "on": "compute"},
    {"op": "copy_batch", "stream": "offload", "order": "ANY",
     "copies": [{"src": ["gpu", 0, 4096], "dst": ["cpu", 0, 4096]}]}]}
  $ kvverify check store.json
  RACY in store.json (3 ops, 2 streams): 1 race
  race 1: RAW on gpu[0:4096] (4096 bytes), rule 5
    ...
    fix:    use STREAM order for op 2: a device source must be read in stream order, ...
  $ kvverify check --json - < store.json | jq .verdict
  "RACY"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Decide from CUDA's ordering rules alone (program order, stream order, events, host\n"
        "synchronization, the source access order of cuMemcpyBatchAsync, pageable memory, batch\n"
        "internals) whether two accesses in a trace of stream work can touch the same bytes in\n"
        "either order. Nothing runs on a GPU.")
    parser.epilog = EPILOG
    parser.add_argument("trace", metavar="TRACE.json",
                        help="the trace to check; '-' reads it from standard input")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"verdict": "SAFE"|"RACY", "races": [...]} instead of the report')
    parser.add_argument("--max-races", type=int, default=None, metavar="N",
                        help="list at most N races (default 10000); the verdict does not depend on it")


def _fail(message: str) -> int:
    print(f"kvverify check: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from kvverify.check.checker import DEFAULT_MAX_RACES, check
    from kvverify.check.model import Trace, TraceError

    source = "<stdin>" if args.trace == "-" else args.trace
    try:
        if args.trace == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.trace, "rb") as f:
                data = f.read()
    except OSError as e:
        return _fail(f"cannot read {source}: {e.strerror or e}")
    try:
        trace = Trace.from_json(data)
    except TraceError as e:
        return _fail(f"invalid trace: {e}".replace("\n", " "))
    max_races = DEFAULT_MAX_RACES if args.max_races is None else args.max_races
    if max_races < 1:
        return _fail("--max-races must be at least 1")
    report = check(trace, max_races=max_races)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(report.render(trace, source))
    return 0 if report.safe else 1
