"""Helpers shared by ``kvverify probe`` and ``kvverify bench``: the no-GPU refusal, NVTX
loading, small order statistics, and JSON / console output.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

GB = 1e9  # GB/s in every report is 1e9 bytes per second (decimal), as vendors quote link rates




def refuse(command: str, reason: str) -> int:
    """Print ``kvverify COMMAND: cannot run: REASON`` as one line on stderr; return exit status 2."""
    print(f"kvverify {command}: cannot run: {_one_line(reason)}", file=sys.stderr)
    return 2


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def load_annotate(args):
    """Return ``kvverify.annotate`` with ``--no-nvtx`` from ``args`` applied (``kvverify.cli`` applies it
    too; applying it here keeps ``run(args)`` right when called directly)."""
    from kvverify import annotate

    annotate.configure_from_args(args)
    return annotate


# --------------------------------------------------------------------------- statistics


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second) of ``nbytes`` bytes moved in ``seconds`` seconds."""
    if seconds <= 0 or not math.isfinite(seconds):
        return float("nan")
    return nbytes / seconds / GB


def summary(samples: Iterable[float]) -> dict[str, Any]:
    """Median, min, max, relative spread and n of ``samples`` (NaNs dropped).

    ``rel_spread`` is ``(max - min) / median``: the full range of the samples as a fraction of
    their median; ``rel_iqr`` is the interquartile range over the median. Both are NaN when
    fewer than two samples remain.
    """
    values = sorted(float(v) for v in samples if v == v)
    n = len(values)
    if n == 0:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "rel_spread": nan, "rel_iqr": nan, "n": 0}
    median = statistics.median(values)
    if n >= 2 and median != 0:
        rel_spread = (values[-1] - values[0]) / median
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        rel_iqr = (q3 - q1) / median
    else:
        rel_spread = rel_iqr = float("nan")
    return {
        "median": median,
        "min": values[0],
        "max": values[-1],
        "rel_spread": rel_spread,
        "rel_iqr": rel_iqr,
        "n": n,
    }


def majority(values: Sequence[Any]) -> dict[str, Any]:
    """The value most trials agree on: ``{"value", "agree", "n", "counts"}``.

    ``value`` is the strict plurality winner, or ``"split"`` when two values tie for the most
    trials. ``agree`` counts the trials that gave ``value`` (0 for a split).
    """
    counts = Counter(values)
    n = len(values)
    if n == 0:
        return {"value": None, "agree": 0, "n": 0, "counts": {}}
    ranked = counts.most_common()
    top, top_count = ranked[0]
    if len(ranked) > 1 and ranked[1][1] == top_count:
        return {"value": "split", "agree": 0, "n": n, "counts": {str(k): c for k, c in ranked}}
    return {"value": top, "agree": top_count, "n": n, "counts": {str(k): c for k, c in ranked}}


def ratio_ci(numerators: Sequence[float], denominators: Sequence[float], confidence: float) -> dict[str, Any]:
    """Median of the paired ratios ``numerators[i] / denominators[i]`` with its confidence interval
    (``kvverify.stats.paired_ratio_ci``: distribution-free, from binomial order statistics).

    With fewer pairs than ``stats.min_pairs(confidence)`` (6 at 95%), or a sample that is not a
    finite positive number, there is no interval: ``low`` and ``high`` are None and ``note`` says why;
    ``median`` is then the plain median of the finite ratios (NaN if none).
    """
    from kvverify import stats

    num, den = list(numerators), list(denominators)
    try:
        r = stats.paired_ratio_ci(num, den, confidence)
        return {"median": r.median, "low": r.low, "high": r.high, "n": r.n, "confidence": confidence, "note": None}
    except ValueError as exc:
        ratios = [a / b for a, b in zip(num, den) if b and a == a and b == b and math.isfinite(a / b)]
        return {
            "median": statistics.median(ratios) if ratios else float("nan"),
            "low": None,
            "high": None,
            "n": len(num),
            "confidence": confidence,
            "note": f"no interval: {exc}",
        }


# --------------------------------------------------------------------------- output


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON to ``path`` (``-`` is stdout); NaN and infinity become null."""
    text = json.dumps(_jsonable(document), indent=2, sort_keys=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)


def console(stderr: bool = False):
    """A rich console at least 160 columns wide when not writing to a terminal (logs keep whole rows)."""
    from rich.console import Console

    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=max(probe.width, 160))


@dataclasses.dataclass
class Measurement:
    """What probe and bench both start from: the NVTX module (or None), the platform (a dict from
    ``platform_info.collect``), the output console, and a progress printer to stderr."""

    annotate: Any
    platform: dict[str, Any]
    out: Any
    progress: Callable[[str], None]


def begin(command: str, args) -> Measurement | int:
    """The common start of ``kvverify probe`` and ``kvverify bench``: the exit status of a refusal
    (no CUDA device, no torch, no extension: one line, status 2), else a ``Measurement``."""
    from kvverify import device

    reason = device.gpu_refusal()
    if reason is not None:
        return refuse(command, reason)
    from kvverify.device import platform_info

    def progress(line: str) -> None:
        print(f"[{command}] {line}", file=sys.stderr, flush=True)

    return Measurement(load_annotate(args), platform_info.collect(args.device), console(stderr=args.json == "-"),
                       progress)
