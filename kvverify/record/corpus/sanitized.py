"""``python -m kvverify.record.corpus.sanitized CASE:FORM ...``: run corpus forms under PyTorch's CUDA
Stream Sanitizer, one after another in this process, and print one marked JSON line per form
(``runner.CSAN_MARK``): ``{"case", "form", "outcome": "reported" | "nothing" | "error", "detail"}``.

The sanitizer is enabled once and cannot be turned off; it raises at the first race it sees, so a
form that races stops there, the device is synchronized, and the next form runs. The runner starts
this module in a child process of its own (``runner.sanitized``).
"""

from __future__ import annotations

import json
import sys

from kvverify.record.corpus import find
from kvverify.record.corpus.runner import CSAN_MARK, one_line


def run_one(case, form: str, errors: type) -> tuple[str, str | None]:
    """``(outcome, detail)`` of ``form`` of ``case`` under the enabled sanitizer, whose race reports
    are ``errors``; the device is synchronized after it either way."""
    import torch

    try:
        case.run(form)
        outcome, detail = "nothing", None
    except errors as exc:
        outcome, detail = "reported", " ".join(str(exc).split())[:200]
    except Exception as exc:
        outcome, detail = "error", one_line(exc)
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # what the form left queued when the sanitizer stopped it
    except Exception as exc:
        if outcome != "error":
            outcome, detail = "error", f"the device failed after the form: {one_line(exc)}"
    return outcome, detail


def main(argv: list[str] | None = None) -> int:
    """Run each ``CASE:FORM`` of ``argv``; exit status 0, or 2 for an argument naming no case or form."""
    import torch.cuda._sanitizer as csan

    specs = sys.argv[1:] if argv is None else argv
    try:
        selection = [(find([name])[0], form) for name, _, form in (s.partition(":") for s in specs)]
    except ValueError as exc:
        print(f"kvverify.record.corpus.sanitized: {exc}", file=sys.stderr)
        return 2
    csan.enable_cuda_sanitizer()
    for case, form in selection:
        outcome, detail = run_one(case, form, csan.CUDASanitizerErrors)
        print(CSAN_MARK + json.dumps({"case": case.name, "form": form, "outcome": outcome, "detail": detail}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
