"""``kvverify bench``: bandwidth of each copy path (the driver batch under each source access
order, a per-copy loop, the SM-kernel copy) per direction, page size and pages per call, against a
contiguous copy (the ceiling); the compute slowdown each path causes; and, with ``--calibrate``, the
fastest safe path per shape.

``docs/bench.md`` describes the method (pools and random page draws, event timing behind a stream
hold, end-to-end timing, paired ANY / STREAM rounds, the compute slowdown, repeatability,
calibration); ``DESCRIPTION`` and ``EPILOG`` are the ``--help`` text. GB/s is 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvverify.errors import PlanError
from kvverify.measure import common
from kvverify.measure.bench_plan import (
    CALIBRATE_REPS,
    CEILING,
    DEFAULT_REPS,
    DIRECTIONS,
    QUICK_MAX_SECONDS,
    QUICK_PAGE_SIZES,
    QUICK_REPS,
    REPEAT_CHECK_MIN_PAGE,
    REPEAT_TOLERANCE,
    GiB,
    MiB,
    Point,
    methods_for,
    plan_points,
    resolve,
    round_order,
)
from kvverify.measure.probe import parse_orders
from kvverify.terms import HOST_MEMORY_KINDS, ORDERS
from kvverify.units import (
    HelpFormatter,
    choice_list_arg,
    format_size,
    positive_float_arg,
    positive_int_arg,
    size_arg,
    size_list_arg,
)

DESCRIPTION = """\
Copies random pages host <-> device by each path (driver batch per order,
per-copy loop, SM kernel) beside one contiguous copy, timed behind a stream
hold and end to end, with each path's slowdown of a matmul (docs/bench.md)."""

EPILOG = """\
Examples:
  kvverify bench --quick --json bench.json --plot bench.png
  kvverify bench --calibrate -o paths.json"""

WARMUP_TRIAL = -1  # NVTX trial payload of the warm-up round; counted rounds are 0, 1, ...
COMPUTE_REPS = 3  # alone / during pairs per method and point
MATMUL_PROBE = 10  # matmuls timed once per run to size the compute loops

parse_directions = choice_list_arg(DIRECTIONS, upper=False)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def _confidence(text: str) -> float:
    value = positive_float_arg(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a confidence is between 0 and 1, e.g. 0.95")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.usage = "%(prog)s [OPTIONS]"
    parser.description = (parser.description or "") + ".\n\n" + DESCRIPTION
    parser.epilog = EPILOG
    quick = ",".join(format_size(p).replace(" ", "") for p in QUICK_PAGE_SIZES)
    g = parser.add_argument_group("what to measure")
    g.add_argument("--quick", action="store_true",
                   help=f"pages {quick}, {QUICK_REPS} reps, at most {QUICK_MAX_SECONDS:g} s; options given win")
    g.add_argument("--page-sizes", type=size_list_arg, metavar="LIST",
                   help="page sizes, e.g. 4KiB,64KiB,2MiB (default 4KiB to 2MiB, powers of 2)")
    g.add_argument("--model", metavar="PRESET", help="page sizes and pages per call of a model preset (llama-3.1-8b)")
    g.add_argument("--block-tokens", type=_int_list, default=[16, 32, 64], metavar="LIST",
                   help="with --model: tokens per KV block (default 16,32,64)")
    g.add_argument("--blocks-per-transfer", type=positive_int_arg, default=16, metavar="N",
                   help="with --model: KV blocks per batch call (default 16)")
    g.add_argument("--calibrate", action="store_true", help="the fastest safe path per shape (write it with -o)")
    g.add_argument("--pages-per-call", type=_int_list, metavar="LIST",
                   help="pages per call, e.g. 16,256,4096 (instead of --call-bytes)")
    g.add_argument("--directions", type=parse_directions, default=DIRECTIONS, metavar="DIRS",
                   help=f"comma list of {','.join(DIRECTIONS)} (both: each way at once; default all)")
    g.add_argument("--orders", type=parse_orders, metavar="ORDERS",
                   help=f"comma list of {','.join(ORDERS)} (default all; --calibrate STREAM,ANY)")
    g.add_argument("--no-loop", action="store_true", help="skip the per-copy cudaMemcpyAsync loop baseline")
    g.add_argument("--no-kernel", action="store_true", help="skip the SM-kernel copy path")
    g.add_argument("--compute", action=argparse.BooleanOptionalAction,
                   help="each path's slowdown of a concurrent bf16 matmul (default on; --calibrate off)")
    g.add_argument("--matmul-size", type=positive_int_arg, default=4096, metavar="N",
                   help="N of the N x N bf16 matmul (default 4096)")
    g.add_argument("--host-memory", choices=HOST_MEMORY_KINDS, default="pinned", metavar="KIND",
                   help=f"host pool: {', '.join(HOST_MEMORY_KINDS)} (default pinned)")
    g = parser.add_argument_group("how much")
    g.add_argument("--reps", type=positive_int_arg, metavar="N",
                   help=f"timed reps per method and point (default {DEFAULT_REPS}; --quick {QUICK_REPS}; "
                        f"--calibrate {CALIBRATE_REPS})")
    g.add_argument("--call-bytes", type=size_arg, default=64 * MiB, metavar="SIZE",
                   help="bytes per batch call without --model (default 64MiB)")
    g.add_argument("--calls-per-rep", type=positive_int_arg, metavar="N",
                   help="batch calls per rep (default: the fewest moving 256 MiB)")
    g.add_argument("--pool-bytes", type=size_arg, default=2 * GiB, metavar="SIZE",
                   help="bytes of each pool, host and device (default 2GiB)")
    g.add_argument("--confidence", type=_confidence, default=0.95, metavar="C",
                   help="confidence of the ANY/STREAM interval (default 0.95)")
    g.add_argument("--no-repeat", action="store_true", help="skip the second STREAM series (repeatability)")
    g.add_argument("--max-seconds", type=positive_float_arg, metavar="S",
                   help=f"start no point after S seconds; the report says so (--quick: {QUICK_MAX_SECONDS:g})")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random page draws (default 0)")
    g = parser.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write every sample, summary and the platform (- for stdout)")
    g.add_argument("-o", "--output", metavar="PATH", help="with --calibrate: the paths document (schemas/paths-v1.json)")
    g.add_argument("--plot", metavar="PATH.png", help="plot GB/s against page size (needs matplotlib)")
    g.add_argument("--device", type=int, default=0, metavar="N", help="CUDA device index (default 0)")
    from kvverify import annotate

    annotate.add_cli_option(g)


# --------------------------------------------------------------------------- measurement core


class HoldController:
    """Sizes the stream hold (nanoseconds) so that it outlasts the queueing of one rep.

    After a covered rep the hold becomes ``2 x queue time + 1 ms``. After an uncovered one it grows
    to at least ``4 x queue time + 2 ms``; three uncovered reps in a row, or the cap, mean the calls
    wait for the held work (no hold can cover them): the method is ``blocking`` and runs behind the
    minimum hold from then on.
    """

    MIN_NS = 1_000_000
    MAX_NS = 500_000_000
    INITIAL_NS = 5_000_000
    BLOCKING_AFTER = 3

    def __init__(self) -> None:
        self.hold_ns = self.INITIAL_NS
        self.uncovered_in_a_row = 0
        self.blocking = False

    def update(self, queue_s: float, covered: bool) -> None:
        if self.blocking:
            return
        queue_ns = queue_s * 1e9
        if covered:
            self.uncovered_in_a_row = 0
            self.hold_ns = int(min(self.MAX_NS, max(self.MIN_NS, 2 * queue_ns + 1_000_000)))
            return
        self.uncovered_in_a_row += 1
        if self.uncovered_in_a_row >= self.BLOCKING_AFTER or self.hold_ns >= self.MAX_NS:
            self.blocking = True
            self.hold_ns = self.MIN_NS
            return
        self.hold_ns = int(min(self.MAX_NS, max(4 * queue_ns, 2 * self.hold_ns) + 2_000_000))


@dataclass
class Rep:
    """One rep of one method: ``copy_s`` event-timed seconds behind the hold, ``queue_s`` host seconds to
    queue the calls, ``covered`` whether the hold outlasted the queueing, ``hold_s`` the hold used,
    ``e2e_s`` end-to-end seconds of the same rep without a hold."""

    copy_s: float
    queue_s: float
    covered: bool
    hold_s: float
    e2e_s: float


@dataclass
class Slowdown:
    """The compute slowdown under one method at one point: ``matmuls`` bf16 matmuls timed alone
    (``alone_s``) and while ``copy_reps`` reps of the method ran on the copy stream (``during_s``,
    the copies taking ``copies_s``); ``overlapped``: per rep, whether the copies shared the whole
    matmul window (queued before the hold ended, done after the last matmul)."""

    matmuls: int
    copy_reps: int
    alone_s: list[float] = field(default_factory=list)
    during_s: list[float] = field(default_factory=list)
    copies_s: list[float] = field(default_factory=list)
    overlapped: list[bool] = field(default_factory=list)


@dataclass
class Series:
    """The counted reps of one method at one point; ``error``: why the method stopped early (its op
    raised); ``slowdown``: the compute slowdown measured under it, if asked."""

    reps: list[Rep] = field(default_factory=list)
    blocking: bool = False
    error: str | None = None
    slowdown: Slowdown | None = None


def _one_rep(backend, issue: Callable[[], None], hold: HoldController, annotate) -> Rep:
    hold_ns = hold.hold_ns
    with annotate.phase_range("swap"):  # held: spin, start event, the calls, stop event, wait
        copy_s, queue_s, covered = backend.held(issue, hold_ns)
    hold.update(queue_s, covered)
    with annotate.phase_range("swap"):  # end-to-end: the calls on an idle stream, wait
        e2e_s = backend.end_to_end(issue)
    return Rep(copy_s, queue_s, covered, hold_ns / 1e9, e2e_s)


def measure_slowdown(backend, issue: Callable[[], None], series: Series, matmul_s: float, reps: int) -> Slowdown:
    """The slowdown of bf16 matmuls while ``issue``'s reps run: one pass not counted, then ``reps``
    pairs of (matmuls alone, matmuls during the copies). The matmul loop is sized to half a rep's
    copy time (``matmul_s``: seconds of one matmul), and the copies repeat until they last twice the
    loop's time alone, so a slowdown of up to 100% still finds the copies running throughout."""
    copy_s = common.summary(r.copy_s for r in series.reps)["median"]
    queue_s = common.summary(r.queue_s for r in series.reps)["median"]
    matmuls = max(2, round(0.5 * copy_s / matmul_s))
    copy_reps = max(1, math.ceil(2 * matmuls * matmul_s / copy_s))
    # The hold covers queueing the matmuls and every copy call (a blocking method waits for it anyway).
    hold_ns = int(2e6 + 2 * copy_reps * queue_s * 1e9 + matmuls * 50e3)
    out = Slowdown(matmuls, copy_reps)
    # Not counted: the first pass may allocate (cuBLAS workspace; the kernel path's pinned descriptor
    # blocks for copy_reps reps in flight), and an allocation may synchronize the device.
    backend.matmuls_during(issue, copy_reps, matmuls, hold_ns)
    for _ in range(reps):
        out.alone_s.append(backend.matmuls_alone(matmuls, hold_ns))
        during_s, copies_s, overlapped = backend.matmuls_during(issue, copy_reps, matmuls, hold_ns)
        out.during_s.append(during_s)
        out.copies_s.append(copies_s)
        out.overlapped.append(overlapped)
    return out


def measure_point(backend, point: Point, methods: list[str], reps: int, seed: int, annotate,
                  matmul_s: float | None = None) -> dict[str, Series]:
    """Measure ``methods`` at ``point``: one warm-up rep each (sizes the hold, not counted), then
    ``reps`` interleaved rounds (``round_order``); then, with ``matmul_s`` (seconds of one bf16
    matmul), the compute slowdown under each method that ran. A method whose op raises is dropped
    from the point's remaining rounds with the error kept (``backend.recover()`` then
    re-synchronizes; a sticky CUDA error raises there and ends the run)."""
    calls = backend.prepare(point, seed)
    issuers = {m: backend.issuer(m, point, calls) for m in methods}
    holds = {m: HoldController() for m in methods}
    out = {m: Series() for m in methods}

    def attempt(m: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as exc:  # noqa: BLE001  (the op's own errors: unsupported memory, invalid value, ...)
            out[m].error = " ".join(str(exc).split())[:300] or type(exc).__name__
            backend.recover()
            return None

    def rep(m: str) -> Rep | None:
        return attempt(m, lambda: _one_rep(backend, issuers[m], holds[m], annotate))

    with annotate.trial_range(WARMUP_TRIAL):
        for m in methods:
            rep(m)
    for i in range(reps):
        with annotate.trial_range(i):
            for m in round_order(i, methods):
                if out[m].error is None:
                    result = rep(m)
                    if result is not None:
                        out[m].reps.append(result)
    for m in methods:
        out[m].blocking = holds[m].blocking
    if matmul_s is not None:
        with annotate.trial_range(reps), annotate.phase_range("swap"):
            for m in methods:
                if out[m].error is None and out[m].reps:
                    out[m].slowdown = attempt(m, lambda m=m: measure_slowdown(backend, issuers[m], out[m], matmul_s,
                                                                              COMPUTE_REPS))
    return out


def slowdown_summary(point: Point, slowdown: Slowdown | None) -> dict[str, Any] | None:
    """JSON of a ``Slowdown``: per-rep ``slowdown`` (during / alone - 1, a fraction), the copies' GB/s
    while the matmuls ran, and in how many reps the copies shared the whole matmul window."""
    if slowdown is None:
        return None
    ratios = [d / a - 1 for d, a in zip(slowdown.during_s, slowdown.alone_s) if a > 0]
    return {
        "matmuls": slowdown.matmuls,
        "copy_reps": slowdown.copy_reps,
        "slowdown": common.summary(ratios),
        "matmul_s_alone": common.summary(slowdown.alone_s),
        "matmul_s_during": common.summary(slowdown.during_s),
        "copy_gbps_during": common.summary(common.gbps(point.rep_bytes * slowdown.copy_reps, t) for t in slowdown.copies_s),
        "overlapped": sum(slowdown.overlapped),
        "n": len(ratios),
    }


def summarize_series(point: Point, series: Series) -> dict[str, Any]:
    """GB/s summaries (event-timed and end-to-end) of one method at one point, with every sample."""
    bw = [common.gbps(point.rep_bytes, r.copy_s) for r in series.reps]
    e2e = [common.gbps(point.rep_bytes, r.e2e_s) for r in series.reps]
    return {
        "gbps": common.summary(bw),
        "e2e_gbps": common.summary(e2e),
        "hold_covered": sum(1 for r in series.reps if r.covered),
        "blocking": series.blocking,
        "error": series.error,
        "queue_s": common.summary(r.queue_s for r in series.reps),
        "hold_s": common.summary(r.hold_s for r in series.reps),
        "samples_gbps": bw,
        "samples_e2e_gbps": e2e,
        "compute": slowdown_summary(point, series.slowdown),
    }


def summarize_point(point: Point, measured: dict[str, Series], repeat: Series | None, confidence: float) -> dict[str, Any]:
    """Everything reported for one point: per-method summaries, fraction of the ceiling, the paired
    ANY/STREAM ratios (event-timed and end-to-end) and the repeatability of STREAM."""
    methods = {m: summarize_series(point, s) for m, s in measured.items()}
    ceiling = methods.get(CEILING, {}).get("gbps", {}).get("median", float("nan"))
    for m in methods.values():
        m["of_ceiling"] = m["gbps"]["median"] / ceiling if ceiling and ceiling == ceiling else float("nan")
    result: dict[str, Any] = {
        "direction": point.direction,
        "label": point.label,
        "page_bytes": point.page_bytes,
        "pages_per_call": point.pages_per_call,
        "calls_per_rep": point.calls_per_rep,
        "bytes_per_rep": point.rep_bytes,
        # event-timed bytes of one method (its counted reps); the end-to-end reps and the warm-up move as much again
        "bytes_timed_per_method": point.rep_bytes * len(next(iter(measured.values())).reps) if measured else 0,
        "methods": methods,
        "any_over_stream": None,
        "any_over_stream_e2e": None,
        "repeat": None,
    }
    if "ANY" in methods and "STREAM" in methods:
        a, s = methods["ANY"], methods["STREAM"]
        n = min(len(a["samples_gbps"]), len(s["samples_gbps"]))  # round i of one pairs with round i of the other
        if n >= 1:
            result["any_over_stream"] = common.ratio_ci(a["samples_gbps"][:n], s["samples_gbps"][:n], confidence)
            result["any_over_stream_e2e"] = common.ratio_ci(a["samples_e2e_gbps"][:n], s["samples_e2e_gbps"][:n], confidence)
    if repeat is not None and repeat.reps and "STREAM" in methods:
        second = summarize_series(point, repeat)
        first_median = methods["STREAM"]["gbps"]["median"]
        delta = abs(second["gbps"]["median"] - first_median) / first_median if first_median else float("nan")
        checked = point.page_bytes >= REPEAT_CHECK_MIN_PAGE
        result["repeat"] = {
            "method": "STREAM",
            "first_gbps": first_median,
            "second_gbps": second["gbps"]["median"],
            "rel_delta": delta,
            "checked": checked,
            "within_tolerance": (delta <= REPEAT_TOLERANCE) if checked and delta == delta else None,
            "tolerance": REPEAT_TOLERANCE,
            "second_series": second,
        }
    return result


def run_bench(args: argparse.Namespace, backend, platform: dict[str, Any], annotate, progress=None) -> dict[str, Any]:
    """Measure every planned point on ``backend``, then the repeat series; return the report document.

    ``backend`` provides ``prepare(point, seed)``, ``issuer(method, point, calls)``,
    ``held(issue, hold_ns) -> (copy_s, queue_s, covered)``, ``end_to_end(issue) -> seconds``,
    ``recover()``, and with ``args.compute`` ``matmuls_alone(count, hold_ns) -> seconds`` and
    ``matmuls_during(issue, repeats, count, hold_ns) -> (matmul_s, copies_s, overlapped)``.
    """
    resolve(args)
    points, skipped = plan_points(args)
    batch_api = platform.get("batch_api_available") is not False
    methods = methods_for(args, batch_api)
    started = time.perf_counter()
    elapsed = lambda: time.perf_counter() - started  # noqa: E731
    measured: list[tuple[Point, dict[str, Series]]] = []
    truncated = False
    matmul_s = None
    with annotate.run_range("kvverify bench"):
        if args.compute:
            backend.matmuls_alone(1, HoldController.MIN_NS)  # warm-up: library load, first launch
            matmul_s = backend.matmuls_alone(MATMUL_PROBE, HoldController.INITIAL_NS) / MATMUL_PROBE
        for index, point in enumerate(points):
            if args.max_seconds is not None and elapsed() > args.max_seconds:
                truncated = True
                break
            with annotate.cell_range(f"bench {point.direction} {point.label}", _nvtx_direction(point.direction)):
                series = measure_point(backend, point, methods, args.reps, args.seed * 1_000_003 + index, annotate,
                                       matmul_s)
            measured.append((point, series))
            if progress is not None:
                progress(_progress_line(point, series, elapsed()))
        repeats: dict[int, Series] = {}
        if not args.no_repeat and "STREAM" in methods:
            for index, (point, _) in enumerate(measured):
                if args.max_seconds is not None and elapsed() > args.max_seconds:
                    truncated = True
                    break
                with annotate.cell_range(f"bench repeat {point.direction} {point.label}", _nvtx_direction(point.direction)):
                    repeats[index] = measure_point(
                        backend, point, ["STREAM"], args.reps, args.seed * 1_000_003 + 500_000 + index, annotate
                    )["STREAM"]
                if progress is not None:
                    progress("repeat " + _progress_line(point, {"STREAM": repeats[index]}, elapsed()))
    results = [summarize_point(p, s, repeats.get(i), args.confidence) for i, (p, s) in enumerate(measured)]
    return {
        "kind": "kvverify-bench",
        "version": 1,
        "platform": platform,
        "config": {
            "host_memory": args.host_memory,
            "directions": list(args.directions),
            "methods": methods,
            "page_sizes": sorted({p.page_bytes for p in points}),
            "pages_per_call": list(args.pages_per_call) if args.pages_per_call else None,
            "model": args.model,
            "block_tokens": list(args.block_tokens) if args.model else None,
            "blocks_per_transfer": args.blocks_per_transfer if args.model else None,
            "reps": args.reps,
            "warmup_reps": 1,
            "pool_bytes": args.pool_bytes,
            "call_bytes": None if args.model or args.pages_per_call else args.call_bytes,
            "confidence": args.confidence,
            "repeat": not args.no_repeat,
            "compute": {"matmul_size": args.matmul_size, "dtype": "bfloat16", "matmul_s": matmul_s,
                        "reps": COMPUTE_REPS} if args.compute else None,
            "max_seconds": args.max_seconds,
            "seed": args.seed,
            "quick": bool(args.quick),
            "calibrate": bool(args.calibrate),
            "units": "GB/s = 1e9 bytes/s; times in seconds; sizes in bytes",
        },
        "ceiling_gbps": _ceilings(results),
        "points": results,
        "points_planned": len(points),
        "points_not_reached": [{"direction": p.direction, "page_bytes": p.page_bytes, "pages_per_call": p.pages_per_call}
                               for p in points[len(measured):]],
        "skipped_points": skipped,
        "truncated": truncated,
        "elapsed_s": elapsed(),
    }


def _nvtx_direction(direction: str) -> str:
    """The NVTX category of a point: ``annotate`` knows H2D and D2H; ``both`` counts as H2D."""
    return "d2h" if direction == "d2h" else "h2d"


def _ceilings(results: list[dict[str, Any]]) -> dict[str, float]:
    """Per direction: the median over points of the ceiling's median GB/s (the plot's horizontal line)."""
    out = {}
    for direction in DIRECTIONS:
        values = [r["methods"][CEILING]["gbps"]["median"] for r in results if r["direction"] == direction and CEILING in r["methods"]]
        if values:
            out[direction] = common.summary(values)["median"]
    return out


def _progress_line(point: Point, series: dict[str, Series], elapsed_s: float) -> str:
    parts = []
    for m, s in series.items():
        med = common.summary(common.gbps(point.rep_bytes, r.copy_s) for r in s.reps)["median"]
        parts.append(f"{m} {med:.1f}")
    return f"{point.direction} {point.label} ({point.pages_per_call} pages/call): " + ", ".join(parts) + f" GB/s [{elapsed_s:.1f} s]"


# --------------------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> int:
    resolve(args)
    try:
        if args.output and not args.calibrate:
            raise PlanError("-o/--output writes the paths document of --calibrate; add --calibrate (or use --json)")
        points, skipped = plan_points(args)
    except PlanError as exc:
        print(f"kvverify bench: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvverify bench: --plot needs matplotlib (pip install 'kvverify[plot]')", file=sys.stderr)
            return 2
    measurement = common.begin("bench", args)
    if isinstance(measurement, int):
        return measurement
    annotate, platform, out, progress = (measurement.annotate, measurement.platform, measurement.out,
                                         measurement.progress)

    from kvverify import stats

    if not args.calibrate and args.reps < stats.min_pairs(args.confidence):
        progress(f"warning: {args.reps} reps give no {args.confidence:.0%} interval for ANY/STREAM "
                 f"(it needs {stats.min_pairs(args.confidence)} pairs)")
    l2 = platform.get("l2_cache_bytes")
    if isinstance(l2, int) and args.pool_bytes < 4 * l2:
        progress(f"warning: the pool ({format_size(args.pool_bytes)}) is less than 4x the L2 ({format_size(l2)})")
    methods = methods_for(args, platform.get("batch_api_available") is not False)
    if platform.get("batch_api_available") is False:
        progress("the batch API (cuMemcpyBatchAsync) is absent: the orders are not measured")
    for line in skipped:
        progress(f"left out: {line}")
    progress(f"{len(points)} points x {len(methods)} methods x ({args.reps} reps + 1 warm-up), each rep held and end-to-end"
             + ("" if args.no_repeat else ", then a second STREAM series per point")
             + (", then the compute slowdown under each method" if args.compute else ""))
    from kvverify.measure import calibration
    from kvverify.measure.bench_device import CudaBench
    from kvverify.measure.bench_render import plot, render_calibration, render_tables

    backend = CudaBench(args.device, args.host_memory, args.pool_bytes, args.matmul_size)
    try:
        document = run_bench(args, backend, platform, annotate, progress)
    finally:
        backend.close()
    render_tables(document, out)
    if args.json:
        common.write_json(args.json, document)
        if args.json != "-":
            progress(f"report written to {args.json}")
    if args.calibrate:
        paths = calibration.build(document)
        render_calibration(paths, out)
        if args.output:
            common.write_json(args.output, paths)
            progress(f"paths written to {args.output}")
    if args.plot:
        plot(document, args.plot)
        progress(f"plot written to {args.plot}")
    return 0
