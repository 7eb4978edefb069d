"""The ``kvverify`` command line: one subcommand per job.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status), and ``OWNS_STDOUT = True`` where it handles its
standard output itself. Only the module of the subcommand named on the command line is
imported, so ``kvverify check`` never pays for torch, numpy or scipy, ``kvverify --help``
imports none of them, and a host without the extension can still use every subcommand that
does not drive a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

# name -> (module, one-line summary). The summary is repeated here, not taken from the
# module, so that `kvverify --help` does not import torch.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "check": (
        "kvverify.check.cli",
        "decide from CUDA's ordering rules alone whether a trace of stream work races",
    ),
    "record": (
        "kvverify.record.cli",
        "run a PyTorch program (a script or pytest) under the recorder and find the races of its device work",
    ),
    "corpus": (
        "kvverify.record.corpus.cli",
        "re-create known races (public reports of vLLM, SGLang, PyTorch, TorchRec; the demo's), broken and "
        "fixed, and show what each tool sees",
    ),
    "stress": (
        "kvverify.stress.cli",
        "run every hazard scenario on the GPU under each source access order and check every block",
    ),
    "probe": (
        "kvverify.measure.probe",
        "measure whether a batch copy blocks the host and when it reads its source, per order",
    ),
    "bench": (
        "kvverify.measure.bench",
        "measure each copy path's bandwidth per direction and page size; calibrate the fastest safe one",
    ),
    "merge": (
        "kvverify.stress.merge",
        "merge stress and probe reports from several hosts into one table per platform (GPU, driver, CUDA)",
    ),
}

HELP_WIDTH = 78  # a help's own lines leave the two columns argparse leaves at the edge of 80

DESCRIPTION = """\
kvverify proves whether batched KV-cache swaps between GPU and host memory are
safe under each source access order of cuMemcpyBatchAsync (STREAM,
DURING_API_CALL, ANY): on paper (a happens-before checker over a trace), on the
device (a stress harness), and in your own PyTorch program (a recorder that
writes its device work as a trace).

Run kvverify COMMAND --help for each command's options and an example. Without
a GPU, kvverify check and kvverify stress (contract verdicts) still work."""

EPILOG = """\
Examples:
  kvverify stress            the smoke campaign on the GPU (90 s on an H200)
  kvverify check trace.json  the happens-before verdict on a trace of GPU work"""


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """Return the top-level parser with one sub-parser per entry of ``SUBCOMMANDS``, and the
    sub-parsers by name; only the subcommand that ``argv`` names (its first word that is one) gets
    its arguments declared."""
    from kvverify import __version__

    parser = argparse.ArgumentParser(
        prog="kvverify",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvverify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in (argv or []) if a in SUBCOMMANDS), None)
    parsers = {}
    for name, (module, summary) in SUBCOMMANDS.items():
        # a subcommand's help keeps its description's lines (raw text), each laid out for 80 columns
        p = parsers[name] = sub.add_parser(name, help=summary, description=textwrap.fill(summary, HELP_WIDTH))
        p.set_defaults(_module=module, _command=name)  # not `command`: record's program arguments take that name
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser, parsers


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser, parsers = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    command = getattr(args, "_command", None)
    if command is None and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if command is None:
        parser.print_usage(sys.stderr)
        print("kvverify: name a command (kvverify --help lists them)", file=sys.stderr)
        return 2
    if extra:  # argparse would blame the top-level parser; the subcommand's usage is the useful one
        parsers[command].error(f"unrecognized arguments: {' '.join(extra)}")
    args.command_argv = argv  # for a subcommand that starts copies of itself (stress --gpus)
    # Subcommands that call kvverify.annotate.add_cli_option get --no-nvtx; apply it once here.
    from kvverify import annotate

    annotate.configure_from_args(args)
    module = importlib.import_module(args._module)
    # A subcommand that handles its standard output itself says so (OWNS_STDOUT); for the others
    # a closed or failing one is one line and exit status 2 here.
    owns_stdout = getattr(module, "OWNS_STDOUT", False)
    if sys.stdout is None and not owns_stdout:
        print(f"kvverify {command}: standard output is closed: nowhere to write the report", file=sys.stderr)
        return 2
    out = _WatchedOutput(sys.stdout)
    if not owns_stdout:
        sys.stdout = out
    try:
        status = int(module.run(args))
        if sys.stdout is out:
            out.flush()
        return status
    except KeyboardInterrupt:
        print("kvverify: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        if isinstance(out.error, BrokenPipeError):  # rich ends the process on a closed pipe, with status 1
            return 2
        raise
    except OSError as exc:
        if exc is not out.error:
            raise
        # the reader went away (a closed pipe) or the output is full: say so once, and point the
        # descriptor at /dev/null so that the interpreter's last flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        if not isinstance(exc, BrokenPipeError):
            print(f"kvverify {command}: cannot write to standard output ({exc.strerror or exc})", file=sys.stderr)
        return 2
    finally:
        if sys.stdout is out:
            sys.stdout = out.stream


class _WatchedOutput:
    """Standard output that keeps the error of a failed write, so that ``main`` tells a report
    that could not be written (exit status 2, one line) from any other OSError (a bug: raised)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


if __name__ == "__main__":
    raise SystemExit(main())
