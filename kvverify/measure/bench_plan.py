"""What ``kvverify bench`` measures: its points (direction x page geometry), its methods (copy paths),
defaults (``--quick``, ``--calibrate``) and the order of methods in a round. No GPU, no torch: the
device side (``bench_device``) and the tables (``bench_render``) read this module, ``bench`` runs
the plan."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from kvverify.errors import PlanError
from kvverify.terms import COPY_KINDS, ORDERS
from kvverify.units import format_size

KiB, MiB, GiB = 1024, 1024**2, 1024**3
DEFAULT_PAGE_SIZES = [4 * KiB * 2**i for i in range(10)]  # 4 KiB ... 2 MiB
QUICK_PAGE_SIZES = [16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB]
DEFAULT_REPS, QUICK_REPS = 10, 8
QUICK_MAX_SECONDS = 120.0
MIN_REP_BYTES = 256 * MiB  # calls/rep defaults to the fewest calls that move this much
REPEAT_CHECK_MIN_PAGE = 256 * KiB
REPEAT_TOLERANCE = 0.03
# A rep of small calls is many calls: capped, so a point of 16 pages per call stays seconds long.
MAX_CALLS_PER_REP = 256

BOTH = "both"
DIRECTIONS = (*COPY_KINDS, BOTH)
"""``h2d``, ``d2h``, and ``both``: an H2D and a D2H call issued together on two streams, each between
its own half of the pools (the link carries both directions at once); on the kernel path, one call
carrying both, its pages interleaved."""
LOOP, KERNEL, CEILING = "loop", "kernel", "ceiling"
METHODS = (*ORDERS, LOOP, KERNEL, CEILING)
"""The batch under each order, the per-copy ``cudaMemcpyAsync`` loop, the SM-kernel copy path, and one
contiguous copy of the rep's bytes (the ceiling, not a way to copy scattered pages)."""

CALIBRATE_PAGES_PER_CALL = [16, 256, 4096, 16384]
# DURING_API_CALL blocks the caller until the stream's pending work is done (docs/bench.md): no engine's pick.
CALIBRATE_ORDERS = ("STREAM", "ANY")
CALIBRATE_REPS = 5
CALIBRATE_MIN_REP_BYTES = 64 * MiB  # ~1 ms at the link rate: ~100 points stay a few minutes


@dataclass(frozen=True)
class Point:
    """One benchmark point: a direction (``DIRECTIONS``) and a page geometry. Sizes in bytes; for
    ``both`` a call is one call each way, ``pages_per_call`` pages each."""

    direction: str
    page_bytes: int
    pages_per_call: int
    calls_per_rep: int
    label: str

    @property
    def call_bytes(self) -> int:
        """Bytes of one call in one direction."""
        return self.page_bytes * self.pages_per_call

    @property
    def ways(self) -> int:
        """Directions a call moves bytes in: 2 for ``both``, else 1."""
        return 2 if self.direction == BOTH else 1

    @property
    def rep_bytes(self) -> int:
        """Bytes a rep moves, both ways counted."""
        return self.call_bytes * self.calls_per_rep * self.ways


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options that ``--quick`` and ``--calibrate`` change; an option given explicitly wins.
    Returns ``args``.

    ``--calibrate``: every page size from 4 KiB to 2 MiB at ``CALIBRATE_PAGES_PER_CALL`` pages per
    call, both directions and both at once, ``CALIBRATE_ORDERS``, ``CALIBRATE_REPS`` reps, no
    repeat series and no compute slowdown.
    """
    calibrate = bool(getattr(args, "calibrate", False))
    if args.page_sizes is None:
        args.page_sizes = list(QUICK_PAGE_SIZES if args.quick else DEFAULT_PAGE_SIZES)
    if args.pages_per_call is None and calibrate and not args.model:
        args.pages_per_call = list(CALIBRATE_PAGES_PER_CALL)
    if args.orders is None:
        args.orders = CALIBRATE_ORDERS if calibrate else ORDERS
    if args.reps is None:
        args.reps = CALIBRATE_REPS if calibrate else QUICK_REPS if args.quick else DEFAULT_REPS
    if args.max_seconds is None and args.quick:
        args.max_seconds = QUICK_MAX_SECONDS
    if args.compute is None:
        args.compute = not calibrate
    if calibrate:
        args.no_repeat = True
    return args


def methods_for(args: argparse.Namespace, batch_api: bool = True) -> list[str]:
    """Methods measured at every point: the selected orders (when the batch API exists), loop, kernel, ceiling."""
    methods = list(args.orders) if batch_api else []
    if not args.no_loop:
        methods.append(LOOP)
    if not args.no_kernel:
        methods.append(KERNEL)
    methods.append(CEILING)
    return methods


def _model_shapes(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    try:
        from kvverify import geometry
    except ImportError as exc:
        raise PlanError(f"--model needs kvverify.geometry ({exc})") from None
    try:
        preset = geometry.preset(args.model)
    except ValueError as exc:
        raise PlanError(f"--model: {exc}") from None
    shapes = []
    for tokens in args.block_tokens:
        try:
            layout = geometry.KVLayout(geometry=preset, block_size=tokens)
        except ValueError as exc:
            raise PlanError(f"--model {preset.name} --block-tokens {tokens}: {exc}") from None
        page = int(layout.page_bytes)
        pages = int(layout.num_tensors) * args.blocks_per_transfer
        shapes.append((page, pages, f"{preset.name} {tokens} tok"))
    return shapes


def _shapes(args: argparse.Namespace) -> list[tuple[int, int | None, str]]:
    """(page bytes, pages per call or None for ``--call-bytes / page``, label) to measure."""
    if args.model:
        if args.pages_per_call:
            raise PlanError("--pages-per-call goes with --page-sizes; --model sets pages per call (--blocks-per-transfer)")
        return [(page, pages, label) for page, pages, label in _model_shapes(args)]
    if args.pages_per_call:
        return [(page, pages, f"{format_size(page)} x {pages}") for page in args.page_sizes for pages in args.pages_per_call]
    shapes = []
    for page in args.page_sizes:
        if page > args.call_bytes:
            raise PlanError(f"page size {format_size(page)} is larger than --call-bytes {format_size(args.call_bytes)}")
        shapes.append((page, None, format_size(page)))
    return shapes


def plan_points(args: argparse.Namespace) -> tuple[list[Point], list[str]]:
    """The points to measure, page sizes outermost (so a run cut short still covers every direction),
    and, with ``--pages-per-call``, the (direction, page size, pages per call) left out because one
    call's pages do not fit the pool (a ``both`` call uses half of each pool in each direction).

    Raises ``PlanError`` when a page does not fit ``--call-bytes``, when a call's pages of ``--model``
    or ``--call-bytes`` do not fit the pool, or when a rep of ``--calls-per-rep`` calls exceeds it.
    """
    points: list[Point] = []
    skipped: list[str] = []
    min_rep = CALIBRATE_MIN_REP_BYTES if getattr(args, "calibrate", False) else MIN_REP_BYTES
    for page, pages_given, label in _shapes(args):
        for direction in args.directions:
            ways = 2 if direction == BOTH else 1
            pool = args.pool_bytes // ways  # each direction of a `both` call has half of each pool
            pages = pages_given if pages_given is not None else args.call_bytes // page
            if pages > pool // page:
                if args.pages_per_call:
                    skipped.append(f"{direction} {label}: {format_size(pages * page)} per call do not fit "
                                   f"{format_size(pool)} of pool")
                    continue
                raise PlanError(
                    f"{label}: {pages} pages per call of {format_size(page)} do not fit a pool of {format_size(pool)} "
                    "(raise --pool-bytes or lower --call-bytes / --blocks-per-transfer)"
                )
            call_bytes = page * pages
            calls = args.calls_per_rep or min(MAX_CALLS_PER_REP, max(1, math.ceil(min_rep / call_bytes)))
            if call_bytes * calls > pool:
                if args.calls_per_rep:
                    raise PlanError(f"{label}: a rep of {calls} calls moves more than the pool of {format_size(pool)}")
                calls = max(1, pool // call_bytes)
            points.append(Point(direction, page, pages, calls, label))
    return points, skipped


def round_order(round_index: int, methods: list[str]) -> list[str]:
    """Methods in the order of one round: ANY and STREAM first, adjacent, alternating which leads."""
    pair = [m for m in ("ANY", "STREAM") if m in methods]
    if len(pair) == 2 and round_index % 2 == 1:
        pair.reverse()
    return pair + [m for m in methods if m not in pair]
