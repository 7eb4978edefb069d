"""What ``kvverify bench`` measures: its points (direction x page geometry), defaults and the order of
methods in a round. No GPU, no torch: the device side (``bench_device``) and the tables
(``bench_render``) read this module, ``bench`` runs the plan."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from kvverify.errors import PlanError
from kvverify.units import format_size

KiB, MiB, GiB = 1024, 1024**2, 1024**3
DEFAULT_PAGE_SIZES = [4 * KiB * 2**i for i in range(10)]  # 4 KiB ... 2 MiB
QUICK_PAGE_SIZES = [16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB]
DEFAULT_REPS, QUICK_REPS = 10, 8
QUICK_MAX_SECONDS = 120.0
MIN_REP_BYTES = 256 * MiB  # calls/rep defaults to the fewest calls that move this much
REPEAT_CHECK_MIN_PAGE = 256 * KiB
REPEAT_TOLERANCE = 0.03


@dataclass(frozen=True)
class Point:
    """One benchmark point: a direction and a page geometry. Sizes in bytes."""

    direction: str
    page_bytes: int
    pages_per_call: int
    calls_per_rep: int
    label: str

    @property
    def call_bytes(self) -> int:
        return self.page_bytes * self.pages_per_call

    @property
    def rep_bytes(self) -> int:
        return self.call_bytes * self.calls_per_rep


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options that ``--quick`` changes; an option given explicitly wins. Returns ``args``."""
    if args.page_sizes is None:
        args.page_sizes = list(QUICK_PAGE_SIZES if args.quick else DEFAULT_PAGE_SIZES)
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else DEFAULT_REPS
    if args.max_seconds is None and args.quick:
        args.max_seconds = QUICK_MAX_SECONDS
    return args


def methods_for(args: argparse.Namespace, batch_api: bool = True) -> list[str]:
    """Methods measured at every point: the selected orders (when the batch API exists), loop, ceiling."""
    methods = list(args.orders) if batch_api else []
    if not args.no_loop:
        methods.append("loop")
    methods.append("ceiling")
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


def plan_points(args: argparse.Namespace) -> list[Point]:
    """The points to measure, page sizes outermost (so a run cut short still covers both directions).

    Raises ``PlanError`` when a call's pages do not fit the pool or a rep exceeds it.
    """
    if args.model:
        shapes = _model_shapes(args)
    else:
        shapes = []
        for page in args.page_sizes:
            if page > args.call_bytes:
                raise PlanError(f"page size {format_size(page)} is larger than --call-bytes {format_size(args.call_bytes)}")
            shapes.append((page, args.call_bytes // page, format_size(page)))
    points = []
    for page, pages, label in shapes:
        slots = args.pool_bytes // page
        if pages > slots:
            raise PlanError(
                f"{label}: {pages} pages per call of {format_size(page)} do not fit a pool of {format_size(args.pool_bytes)} "
                "(raise --pool-bytes or lower --call-bytes / --blocks-per-transfer)"
            )
        call_bytes = page * pages
        calls = args.calls_per_rep or max(1, math.ceil(MIN_REP_BYTES / call_bytes))
        if call_bytes * calls > args.pool_bytes:
            if args.calls_per_rep:
                raise PlanError(f"{label}: a rep of {calls} calls moves more than the pool of {format_size(args.pool_bytes)}")
            calls = max(1, args.pool_bytes // call_bytes)
        for direction in args.directions:
            points.append(Point(direction, page, pages, calls, label))
    return points


def round_order(round_index: int, methods: list[str]) -> list[str]:
    """Methods in the order of one round: ANY and STREAM first, adjacent, alternating which leads."""
    pair = [m for m in ("ANY", "STREAM") if m in methods]
    if len(pair) == 2 and round_index % 2 == 1:
        pair.reverse()
    return pair + [m for m in methods if m not in pair]
