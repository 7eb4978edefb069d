"""The fastest safe copy path per (direction, page size, pages per call) on this device: the paths
document ``kvverify bench --calibrate -o paths.json`` writes and a serving engine reads at start-up
(``kvverify/schemas/paths-v1.json``; docs/bench.md, "Calibration").

Standard library only, so an engine can read the document without torch or a GPU::

    from kvverify.measure import calibration
    paths = calibration.load("paths.json")
    entry = calibration.choose(paths, "h2d", page_bytes=16384, pages_per_call=1024)
    swap_blocks_batch(src, dst, sizes, **entry["best"]["call"])   # e.g. method="kernel"
"""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Any

from kvverify.measure.bench_plan import DIRECTIONS

KIND, VERSION = "kvverify-paths", 1

SAFE_PATHS = ("STREAM", "loop", "kernel")
"""Paths that read their sources and write their destinations in stream order: safe wherever a
``STREAM`` batch is (the kernel and loop paths' contract is ``STREAM``'s, docs/op.md)."""

IF_HOST_SOURCE_UNTOUCHED = "ANY"
"""Safe for loads (H2D) only while the host source stays untouched from the call until the copy
completes (the stress headline); never for stores, whose device source ``ANY`` may read before
the compute stream's writer finished (H1)."""

CALLS: dict[str, dict[str, str]] = {
    "STREAM": {"method": "batch", "src_access_order": "STREAM"},
    "ANY": {"method": "batch", "src_access_order": "ANY"},
    "loop": {"method": "loop"},
    "kernel": {"method": "kernel"},
}
"""Keyword arguments of ``kvverify.device.ops.swap_blocks_batch`` that take each path."""

RANKED_BY = "e2e_gbps"
"""Paths are ranked by end-to-end GB/s (host clock from the first call to the copies' completion):
what a caller waits for, call overhead included. The event-timed figure is kept beside it."""


def _figure(path: str, method: dict[str, Any]) -> dict[str, Any]:
    return {"path": path, "call": dict(CALLS[path]), "gbps": method["e2e_gbps"]["median"],
            "event_gbps": method["gbps"]["median"]}


def _measured(method: dict[str, Any] | None) -> bool:
    if method is None or method.get("error") and method["e2e_gbps"]["n"] == 0:
        return False
    value = method["e2e_gbps"]["median"]
    return value is not None and value == value and value > 0


def build(bench: dict[str, Any]) -> dict[str, Any]:
    """The paths document from a ``kvverify bench`` document (``kind: kvverify-bench``).

    Per point (direction, page size, pages per call): ``best`` and ``runner_up`` among the measured
    ``SAFE_PATHS`` by ``RANKED_BY``; ``candidates`` (every measured safe path); for H2D points
    ``if_host_source_untouched``, ``ANY`` where it beats ``best``; ``ceiling_gbps``. Points with no
    measured safe path, and points the run did not reach before ``--max-seconds``, are listed under
    ``unmeasured``.

    Raises:
        ValueError: ``bench`` is not a bench document.
    """
    if bench.get("kind") != "kvverify-bench":
        raise ValueError(f"not a kvverify bench document (kind {bench.get('kind')!r}); run kvverify bench --json")
    entries, unmeasured = [], []
    for point in bench["points"]:
        methods = point["methods"]
        ranked = sorted((_figure(p, methods[p]) for p in SAFE_PATHS if _measured(methods.get(p))),
                        key=lambda f: f["gbps"], reverse=True)
        where = f"{point['direction']} {point['page_bytes']} B x {point['pages_per_call']}"
        if not ranked:
            unmeasured.append(f"{where}: every path raised")
            continue
        faster = None
        any_method = methods.get(IF_HOST_SOURCE_UNTOUCHED)
        if point["direction"] == "h2d" and _measured(any_method):
            figure = _figure(IF_HOST_SOURCE_UNTOUCHED, any_method)
            faster = figure if figure["gbps"] > ranked[0]["gbps"] else None
        ceiling = methods.get("ceiling")
        entries.append({
            "direction": point["direction"],
            "page_bytes": point["page_bytes"],
            "pages_per_call": point["pages_per_call"],
            "best": ranked[0],
            "runner_up": ranked[1] if len(ranked) > 1 else None,
            "candidates": {f["path"]: {"gbps": f["gbps"], "event_gbps": f["event_gbps"]} for f in ranked},
            "if_host_source_untouched": faster,
            "ceiling_gbps": ceiling["gbps"]["median"] if _measured(ceiling) else None,
        })
    unmeasured += [f"{p['direction']} {p['page_bytes']} B x {p['pages_per_call']}: not reached (--max-seconds)"
                   for p in bench.get("points_not_reached", ())]
    return {
        "kind": KIND,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": bench["platform"],
        "host_memory": bench["config"]["host_memory"],
        "ranked_by": RANKED_BY,
        "safe_paths": list(SAFE_PATHS),
        "units": "GB/s = 1e9 bytes/s (both directions counted for direction 'both'); sizes in bytes",
        "entries": entries,
        "unmeasured": unmeasured,
    }


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a paths document.

    Raises:
        OSError: the file cannot be read. ValueError: not JSON, or not a paths document of this version.
    """
    with open(path, encoding="utf-8") as fh:
        try:
            doc = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("version") != VERSION:
        raise ValueError(f"{path}: not a {KIND} document of version {VERSION}; write one with "
                         "kvverify bench --calibrate -o PATH")
    return doc


def choose(paths: dict[str, Any], direction: str, page_bytes: int, pages_per_call: int) -> dict[str, Any]:
    """The entry of ``paths`` for ``direction`` (``h2d``, ``d2h`` or ``both``) nearest to the shape:
    the nearest page size on a log scale, then among its entries the nearest pages per call (ties go
    to the smaller). ``entry["best"]["call"]`` holds the keyword arguments for ``swap_blocks_batch``.

    Raises:
        ValueError: no entry for ``direction``, or a size that is not positive.
    """
    if page_bytes <= 0 or pages_per_call <= 0:
        raise ValueError(f"page_bytes and pages_per_call must be positive, got {page_bytes} and {pages_per_call}")
    mine = [e for e in paths["entries"] if e["direction"] == direction]
    if not mine:
        have = sorted({e["direction"] for e in paths["entries"]})
        raise ValueError(f"no calibration entry for direction {direction!r}; the document has {have} "
                         f"(directions: {', '.join(DIRECTIONS)})")

    def distance(e: dict[str, Any]) -> tuple[float, float, int, int]:
        return (abs(math.log2(e["page_bytes"] / page_bytes)), abs(math.log2(e["pages_per_call"] / pages_per_call)),
                e["page_bytes"], e["pages_per_call"])

    return min(mine, key=distance)
