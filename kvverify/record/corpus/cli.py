"""``kvverify corpus [NAME...] [--json PATH] [--no-csan] [--forms broken,fixed]`` and ``kvverify corpus --list``.

Runs the race corpus (``kvverify.record.corpus``): each case's forms natively, recorded and under
PyTorch's CUDA Stream Sanitizer, and prints the table. ``--list`` needs neither torch nor a GPU.
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Re-create known stream-ordering races, broken and fixed, and show what each
tool sees of them. A case is one race re-created in kvverify's own code, in a
broken form and in the form its fix made: races of public reports (issues and
pull requests of vLLM, SGLang, PyTorch and TorchRec) and of kvverify's own
demo (docs/record.md). Its race has a kind (RAW, WAR, WAW, FREE) and a pair:
the two functions of the case's module whose lines issue the racing ops.
Capture "recorded": a default kvverify record decides the race; "native": no
capture sees the racing work (no case is so marked today).

Each form runs three times, one column each: natively (pages the device
corrupted, of those checked; a spin holds the writer's stream so the race can
strike), under kvverify record (the verdict and the racing pair it found; a
native case says what the recording cannot see), and under PyTorch's CUDA
Stream Sanitizer (all forms in one child process: reported, nothing, or
error)."""

EPILOG = """\
exit status:
  0  every case a recording sees is RACY with its pair in the broken form and
     SAFE in the fixed form (the forms asked for)
  1  some such case is not (each is listed on stderr)
  2  a case or form that does not exist, or no CUDA device or kvverify._C
     (one line)
  --confirm's witnesses never change it: read the witness column or the JSON

Examples:
  kvverify corpus --list
  kvverify corpus --json corpus.json
  kvverify corpus vllm-31341 torchrec-4231 --forms broken --no-csan
  kvverify corpus --confirm --no-csan   # and a device witness of each race"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``kvverify corpus``'s arguments on ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.add_argument("names", nargs="*", metavar="NAME", help="cases to run (default: all; --list names them)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit (no torch, no GPU)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--no-csan", action="store_true", help="skip the run under the CUDA Stream Sanitizer")
    parser.add_argument("--confirm", action="store_true",
                        help="where a form races, its device witness too: each racing pair of lines run again twice "
                             "in issue order and once with the second op forced first (kvverify record --confirm)")
    parser.add_argument("--forms", default="broken,fixed", metavar="FORMS",
                        help="comma-separated forms to run (default: %(default)s)")


def _fail(message: str) -> int:
    print(f"kvverify corpus: {message}", file=sys.stderr)
    return 2


def parse_forms(text: str) -> list[str]:
    """The forms of ``--forms`` (``"broken,fixed"``), in corpus order. Raises ValueError naming an
    unknown or missing form."""
    from kvverify.record.corpus import FORMS

    asked = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in asked if f not in FORMS]
    choices = f"use {', '.join(FORMS)}, comma-separated"
    if unknown:
        raise ValueError(f"unknown form{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; {choices}")
    if not asked:
        raise ValueError(f"no form given; {choices}")
    return [f for f in FORMS if f in asked]


def run(args: argparse.Namespace) -> int:
    """List the cases, or run the ones named and print the table; the exit status (``EPILOG``)."""
    from kvverify.record.corpus import CASES, find, report

    if args.list:
        if args.names:
            return _fail("--list lists every case; give no names with it")
        from kvverify import screen

        print(screen.fit(report.listing(CASES), sys.stdout), end="")
        return 0
    try:
        cases = find(args.names)
        forms = parse_forms(args.forms)
    except ValueError as exc:
        return _fail(str(exc))
    from kvverify import device

    reason = device.gpu_refusal()
    if reason is not None:
        return _fail(reason)
    from kvverify.record.corpus import runner

    def progress(row) -> None:
        witness = f"; witness {report.witness_cell(row)}" if row.recorded.witnesses is not None else ""
        print(f"kvverify corpus: {row.case} {row.form}: native {report.native_cell(row)}; "
              f"recorded {report.recorded_cell(row)}{witness}", file=sys.stderr, flush=True)

    if not args.no_csan:
        print("kvverify corpus: the sanitizer's run follows, in one child process", file=sys.stderr)
    result = runner.run_corpus(cases, forms, csan=not args.no_csan, confirm=args.confirm, progress=progress)
    print(report.markdown(result), end="")
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(report.to_json(result))
        except OSError as exc:
            return _fail(f"cannot write {args.json}: {exc.strerror or exc}")
        print(f"kvverify corpus: results written to {args.json}", file=sys.stderr)
    for failure in result.failures:
        print(f"kvverify corpus: {failure}", file=sys.stderr)
    return 0 if result.ok else 1
