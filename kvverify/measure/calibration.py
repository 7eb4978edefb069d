"""The fastest safe copy path per (direction, page size, pages per call) on this device: the paths
document ``kvverify bench --calibrate -o paths.json`` writes and a serving engine reads at start-up
(``kvverify/schemas/paths-v1.json``; docs/bench.md, "Calibration").

Standard library only (with ``kvverify.check``'s strict JSON reader), so an engine can read the
document without torch or a GPU::

    from kvverify.measure import calibration
    paths = calibration.load("paths.json")
    entry = calibration.choose(paths, "h2d", page_bytes=16384, pages_per_call=1024)
    swap_blocks_batch(src, dst, sizes, **entry["best"]["call"])   # e.g. method="kernel"
"""

from __future__ import annotations

import datetime
import json
import numbers
import os
from fractions import Fraction
from typing import Any

from kvverify.check import jsontext
from kvverify.errors import CalibrationError
from kvverify.measure.bench_plan import DIRECTIONS
from kvverify.terms import HOST_MEMORY_KINDS

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


MAX_BYTES = 16 * 2**20
"""The largest file ``load`` reads: the ``--calibrate`` grid's document is about 100 KiB."""

_REWRITE = "write the document again with kvverify bench --calibrate -o PATH"


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a paths document and check it against ``kvverify/schemas/paths-v1.json``: every field
    ``choose`` and an engine use has its type and range, each ``best`` and ``runner_up`` is a safe
    path with that path's ``call``, and no shape appears twice. Members the schema does not name are
    kept, unchecked; so is ``platform``'s content.

    Raises:
        OSError: the file cannot be read. CalibrationError (a ValueError): larger than ``MAX_BYTES``,
        not UTF-8, not strict JSON (``kvverify.check.jsontext``: NaN, Infinity, a number beyond a
        float, a repeated key, nesting deeper than the decoder allows), or not a paths document of
        this version; the message names the file and the field, ``field`` the field.
    """
    with open(path, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise CalibrationError(f"{path}: larger than {MAX_BYTES // 2**20} MiB, so not a paths document (the "
                               f"--calibrate grid's is about 100 KiB); {_REWRITE}")
    try:
        doc = jsontext.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{path}: not UTF-8 (byte {exc.start} is {data[exc.start]:#04x}); {_REWRITE}") from None
    except jsontext.JSONTextError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc})") from None
    _check(doc, str(path))
    return doc


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(doc: Any, where: str) -> None:
    """Raise CalibrationError naming ``where`` and the field where ``doc`` (strict JSON) is not a paths
    document of this version."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND or not _is_int(doc.get("version")) \
            or doc["version"] != VERSION:
        found = (f"kind {_show(doc.get('kind'))}, version {_show(doc.get('version'))}" if isinstance(doc, dict)
                 else f"a JSON {'array' if isinstance(doc, list) else 'value'}, not an object")
        raise CalibrationError(f"{where}: not a {KIND} document of version {VERSION} ({found}); write one with "
                               "kvverify bench --calibrate -o PATH")

    def get(obj: dict[str, Any], key: str, at: str, ok, wanted: str) -> Any:
        name = f"{at}.{key}" if at else key
        if key not in obj:
            raise CalibrationError(f"{where}: field '{name}' is missing; {_REWRITE}", name)
        if not ok(obj[key]):
            raise CalibrationError(f"{where}: field '{name}' is {_show(obj[key])}, not {wanted}; {_REWRITE}", name)
        return obj[key]

    def gbps(obj: dict[str, Any], at: str) -> None:
        get(obj, "gbps", at, lambda v: _is_number(v) and v > 0, "a positive number (GB/s)")
        get(obj, "event_gbps", at, lambda v: v is None or _is_number(v), "a number or null")

    def figure(obj: dict[str, Any], key: str, at: str, paths: tuple[str, ...], wanted: str) -> None:
        """``obj[key]``: a figure of one of ``paths``, or null where ``wanted`` allows it."""
        value = get(obj, key, at, lambda v: isinstance(v, dict) or (v is None and wanted.startswith("null")),
                    wanted)
        if value is not None:
            at = f"{at}.{key}"
            path = get(value, "path", at, lambda v: v in paths, f"one of {', '.join(paths)}")
            get(value, "call", at, lambda v: v == CALLS[path], f"{_show(CALLS[path])} (the call of path {path})")
            gbps(value, at)

    get(doc, "created", "", lambda v: isinstance(v, str), "a string")
    get(doc, "platform", "", lambda v: isinstance(v, dict), "an object")
    get(doc, "host_memory", "", lambda v: v in HOST_MEMORY_KINDS, f"one of {', '.join(HOST_MEMORY_KINDS)}")
    get(doc, "ranked_by", "", lambda v: v == RANKED_BY, _show(RANKED_BY))
    get(doc, "safe_paths", "", lambda v: isinstance(v, list) and all(p in SAFE_PATHS for p in v)
        and len(set(v)) == len(v), f"an array of distinct safe paths ({', '.join(SAFE_PATHS)})")
    get(doc, "units", "", lambda v: isinstance(v, str), "a string")
    get(doc, "unmeasured", "", lambda v: isinstance(v, list) and all(isinstance(u, str) for u in v),
        "an array of strings")
    shapes: dict[tuple[str, int, int], int] = {}
    for i, e in enumerate(get(doc, "entries", "", lambda v: isinstance(v, list), "an array")):
        at = f"entries[{i}]"
        if not isinstance(e, dict):
            raise CalibrationError(f"{where}: field '{at}' is {_show(e)}, not an object; {_REWRITE}", at)
        direction = get(e, "direction", at, lambda v: v in DIRECTIONS, f"one of {', '.join(DIRECTIONS)}")
        page = get(e, "page_bytes", at, lambda v: _is_int(v) and v >= 8, "an integer of at least 8 (bytes)")
        pages = get(e, "pages_per_call", at, lambda v: _is_int(v) and v >= 1, "a positive integer")
        if (direction, page, pages) in shapes:
            raise CalibrationError(f"{where}: field '{at}' repeats the shape of entries[{shapes[direction, page, pages]}] "
                                   f"({direction} {page} B x {pages}): which one counts? {_REWRITE}", at)
        shapes[direction, page, pages] = i
        figure(e, "best", at, SAFE_PATHS, "an object (a point without a measured safe path belongs under "
               "'unmeasured')")
        figure(e, "runner_up", at, SAFE_PATHS, "null or an object")
        if direction == "h2d":
            figure(e, "if_host_source_untouched", at, (IF_HOST_SOURCE_UNTOUCHED,), "null or an object")
        else:
            get(e, "if_host_source_untouched", at, lambda v: v is None,
                f"null ({IF_HOST_SOURCE_UNTOUCHED} is never safe for {direction}, only for h2d loads)")
        candidates = get(e, "candidates", at, lambda v: isinstance(v, dict) and all(p in SAFE_PATHS for p in v),
                         f"an object keyed by safe paths ({', '.join(SAFE_PATHS)})")
        for p, candidate in candidates.items():
            get(candidates, p, f"{at}.candidates", lambda v: isinstance(v, dict), "an object")
            gbps(candidate, f"{at}.candidates.{p}")
        get(e, "ceiling_gbps", at, lambda v: v is None or _is_number(v), "a number or null")


def choose(paths: dict[str, Any], direction: str, page_bytes: int, pages_per_call: int) -> dict[str, Any]:
    """The entry of ``paths`` (a document as ``load``, which checks it, or ``build`` returns it) for
    ``direction`` (``h2d``, ``d2h`` or ``both``) nearest to the shape: the nearest page size on a log
    scale, then among its entries the nearest pages per call (ties go to the smaller).
    ``entry["best"]["call"]`` holds the keyword arguments for ``swap_blocks_batch``.

    Raises:
        CalibrationError (a ValueError): ``paths`` is not a paths document, ``direction`` is not one
        of ``DIRECTIONS`` or has no entry, or a size is not a positive integer.
    """
    if not isinstance(paths, dict) or paths.get("kind") != KIND:
        raise CalibrationError(f"paths is a {type(paths).__name__} that is not a {KIND} document: pass what "
                               "calibration.load returns")
    for name, value in (("page_bytes", page_bytes), ("pages_per_call", pages_per_call)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise CalibrationError(f"{name} must be a positive integer, got {value!r}", name)
    if direction not in DIRECTIONS:
        raise CalibrationError(f"no calibration entry for direction {direction!r}: a direction is one of "
                               f"{', '.join(DIRECTIONS)}", "direction")
    mine = [e for e in paths["entries"] if e["direction"] == direction]
    if not mine:
        have = sorted({e["direction"] for e in paths["entries"]})
        raise CalibrationError(f"no calibration entry for direction {direction!r}; the document has {have} "
                               "(its 'unmeasured' lists the points the calibration left out)", "direction")

    def ratio(a: int, b: int) -> Fraction:  # exact: a log-scale distance without a float's range or rounding
        return Fraction(max(a, b), min(a, b))

    def distance(e: dict[str, Any]) -> tuple[Fraction, Fraction, int, int]:
        return (ratio(e["page_bytes"], page_bytes), ratio(e["pages_per_call"], pages_per_call),
                e["page_bytes"], e["pages_per_call"])

    return min(mine, key=distance)
