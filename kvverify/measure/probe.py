"""``kvverify probe``: what this driver does with each source access order: whether a batch call
blocks the host behind pending stream work, and when it reads its source.

``docs/bench.md`` describes the method and each answer; ``DESCRIPTION`` and ``EPILOG`` are the
``--help`` text.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvverify.measure import common
from kvverify.terms import COPY_KINDS, HOST_MEMORY_KINDS, ORDERS
from kvverify.units import HelpFormatter, choice_list_arg, format_size, positive_float_arg, positive_int_arg, size_arg

DESCRIPTION = """\
Per cell (direction x order x host memory kind): one swap_blocks_batch call of
--pages pages of --page-bytes bytes, issued behind --hold-ms of pending stream
work, --reps times (plus a warm-up). By majority over the trials it reports
whether the call blocked the host until the pending work had finished, and
whether the source was read during the call or later, in stream order
(docs/bench.md explains each answer). With the defaults the 18 cells take a
few seconds. Needs a CUDA device and the built extension; without them: exit
status 2, one line on stderr."""

EPILOG = """\
Example:
  kvverify probe --directions d2h --host-memory pinned,pageable --json p.json"""

# Generations as whole 64-bit words; every word of the buffer holds one of them.
OLD = 0x0101010101010101
NEW = 0x0202020202020202
SENTINEL = 0x5E5E5E5E5E5E5E5E

READ_VALUES = ("call", "stream", "torn", "not-landed", "garbage", "inconclusive", "error")

parse_directions = choice_list_arg(COPY_KINDS, upper=False)
parse_orders = choice_list_arg(ORDERS, upper=True)
parse_host_kinds = choice_list_arg(HOST_MEMORY_KINDS, upper=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.usage = "%(prog)s [OPTIONS]"
    parser.description = (parser.description or "") + ".\n\n" + DESCRIPTION
    parser.epilog = EPILOG
    parser.add_argument("--reps", type=positive_int_arg, default=5, metavar="N",
                        help="counted trials per cell; the majority decides (default 5)")
    parser.add_argument("--hold-ms", type=positive_float_arg, default=20.0, metavar="MS",
                        help="length of the pending work ahead of the copy, ms (default 20)")
    parser.add_argument("--page-bytes", type=size_arg, default=64 * 1024, metavar="SIZE",
                        help="bytes per copied page, a multiple of 8 (default 64KiB)")
    parser.add_argument("--pages", type=positive_int_arg, default=16, metavar="N",
                        help="pages in the one batch call (default 16)")
    parser.add_argument("--directions", type=parse_directions, default=COPY_KINDS, metavar="DIRS",
                        help=f"comma list of {','.join(COPY_KINDS)} (default both)")
    parser.add_argument("--orders", type=parse_orders, default=ORDERS, metavar="ORDERS",
                        help=f"comma list of {','.join(ORDERS)} (default all)")
    parser.add_argument("--host-memory", type=parse_host_kinds, default=HOST_MEMORY_KINDS, metavar="KINDS",
                        help=f"comma list of {','.join(HOST_MEMORY_KINDS)} (default all)")
    parser.add_argument("--device", type=int, default=0, metavar="N", help="CUDA device index (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the cells and the platform as JSON (- for stdout)")
    from kvverify import annotate

    annotate.add_cli_option(parser)


# --------------------------------------------------------------------------- pure logic


@dataclass
class Trial:
    """One probe trial. ``call_s``: host seconds inside the call; ``pending_at_return``: the held work
    had not finished when the call returned; ``pending_after_rewrite`` (H2D): still not finished once
    the host bytes were rewritten; ``landed``: old / new / torn / sentinel / garbage."""

    call_s: float
    pending_at_return: bool
    pending_after_rewrite: bool | None
    landed: str
    source_read: str
    error: str | None = None

    @property
    def blocks(self) -> str:
        if self.error is not None:
            return "error"
        return "no" if self.pending_at_return else "yes"


def classify_words(words) -> str:
    """What landed in a destination of 64-bit words: ``old``, ``new``, ``torn`` (both), ``sentinel``
    (nothing landed) or ``garbage`` (any other word)."""
    import numpy as np

    words = np.asarray(words, dtype=np.uint64).ravel()
    n = words.size
    n_old = int(np.count_nonzero(words == np.uint64(OLD)))
    n_new = int(np.count_nonzero(words == np.uint64(NEW)))
    if n_old == n:
        return "old"
    if n_new == n:
        return "new"
    if n_old + n_new == n:
        return "torn"
    if int(np.count_nonzero(words == np.uint64(SENTINEL))) == n:
        return "sentinel"
    return "garbage"


def source_read(direction: str, landed: str, pending_at_return: bool, pending_after_rewrite: bool | None) -> str:
    """Turn what landed into when the source was read (see the module docstring)."""
    if landed == "new":
        return "stream"
    if landed == "old":
        if direction == "h2d" and pending_at_return and pending_after_rewrite is False:
            return "inconclusive"
        return "call"
    return {"torn": "torn", "sentinel": "not-landed"}.get(landed, "garbage")


def summarize_cell(direction: str, order: str, host_memory: str, hold_s: float, trials: list[Trial]) -> dict[str, Any]:
    """Majority verdicts of one cell with the agreement counts, the call-time summary (seconds) and every trial."""
    ok = [t for t in trials if t.error is None]
    call = common.summary(t.call_s for t in ok)
    median_call = call["median"]
    errors = sorted({t.error for t in trials if t.error is not None})
    return {
        "direction": direction,
        "order": order,
        "host_memory": host_memory,
        "reps": len(trials),
        "blocks": common.majority([t.blocks for t in trials]),
        "source_read": common.majority([t.source_read for t in trials]),
        "call_s": call,
        "hold_s": hold_s,
        "call_over_hold": median_call / hold_s if ok else float("nan"),
        "errors": errors,
        "trials": [asdict(t) for t in trials],
    }


def _agree(m: dict[str, Any]) -> str:
    if m["value"] == "split":
        counts = ", ".join(f"{k} {v}" for k, v in m["counts"].items())
        return f"split ({counts})"
    return f"{m['value']} {m['agree']}/{m['n']}"


def render_table(document: dict[str, Any], console) -> None:
    """Print the probe cells as one rich table, the platform line above it and the legend below."""
    from rich.markup import escape
    from rich.table import Table

    from kvverify.device import platform_info

    cfg = document["config"]
    table = Table(
        title="kvverify probe",
        caption=(
            f"{cfg['reps']} counted trials per cell (+1 warm-up); a cell shows the majority and how many trials agreed. "
            f"One batch call of {cfg['pages']} × {format_size(cfg['page_bytes'])} behind a {cfg['hold_s'] * 1e3:g} ms hold.\n"
            "source read — h2d: call = host bytes read before the call returned, stream = read later in stream order; "
            "d2h: call = device bytes read before the pending writer finished, stream = in stream order."
        ),
    )
    for name, justify in (
        ("direction", "left"),
        ("order", "left"),
        ("host memory", "left"),
        ("blocks host", "left"),
        ("call ms median (min–max)", "right"),
        ("call / hold", "right"),
        ("source read", "left"),
    ):
        table.add_column(name, justify=justify)
    for cell in document["cells"]:
        call = cell["call_s"]
        call_text = "—" if call["n"] == 0 else f"{call['median'] * 1e3:.3f} ({call['min'] * 1e3:.3f}–{call['max'] * 1e3:.3f})"
        ratio = cell["call_over_hold"]
        ratio_text = "—" if ratio != ratio else f"{ratio:.2f}"
        read = _agree(cell["source_read"])
        if cell["errors"]:
            read += f" ({cell['errors'][0][:60]})"
        row = (cell["direction"], cell["order"], cell["host_memory"], _agree(cell["blocks"]), call_text, ratio_text, read)
        table.add_row(*(escape(x) for x in row))
    platform_info.render(document["platform"], console)
    console.print(table)


# --------------------------------------------------------------------------- the device side


class CudaProbe:
    """Buffers, streams and events for probe trials on one CUDA device."""

    def __init__(self, device_index: int, page_bytes: int, pages: int, host_kinds: list[str], annotate):
        import numpy as np
        import torch

        from kvverify.device import host_memory, kernels, ops

        self.np, self.torch, self.ops, self.kernels, self.annotate = np, torch, ops, kernels, annotate
        torch.cuda.set_device(device_index)
        self.nbytes = page_bytes * pages
        self.dev = torch.empty(self.nbytes // 8, dtype=torch.int64, device=f"cuda:{device_index}")
        self.host = {kind: host_memory.allocate_host(kind, self.nbytes) for kind in host_kinds}
        self.words = {kind: buf.numpy(np.uint64)[: self.nbytes // 8] for kind, buf in self.host.items()}
        self.copy_stream = torch.cuda.Stream()
        self.writer_stream = torch.cuda.Stream()
        self.pending = torch.cuda.Event()
        offsets = np.arange(pages, dtype=np.int64) * page_bytes
        self.sizes = torch.full((pages,), page_bytes, dtype=torch.int64)
        self.dev_ptrs = torch.from_numpy(offsets + self.dev.data_ptr())
        self.host_ptrs = {kind: torch.from_numpy(offsets + int(buf.ptr)) for kind, buf in self.host.items()}

        # Check every address once, through the op's own pointer check (an address the driver cannot
        # resolve raises a ValueError here instead of crashing the process); timed calls skip it.
        for ptrs in self.host_ptrs.values():
            ops.swap_blocks_batch(ptrs, self.dev_ptrs, self.sizes, ops.SrcAccessOrder.STREAM, check_pointers=True)
            ops.swap_blocks_batch(self.dev_ptrs, ptrs, self.sizes, ops.SrcAccessOrder.STREAM, check_pointers=True)
        torch.cuda.synchronize()

    def _swap(self, src_ptrs, dst_ptrs, order: str) -> None:
        """The call under test: the batch API, this order, no pointer lookup (checked once above)."""
        self.ops.swap_blocks_batch(src_ptrs, dst_ptrs, self.sizes, self.ops.SrcAccessOrder[order], check_pointers=False)

    def close(self) -> None:
        self.torch.cuda.synchronize()
        for buf in self.host.values():
            buf.free()
        self.host.clear()

    def trial(self, direction: str, order: str, kind: str, hold_ns: int) -> Trial:
        """Run one trial; a failure of the op becomes a Trial with ``error`` set."""
        try:
            if direction == "h2d":
                return self._h2d(order, kind, hold_ns)
            return self._d2h(order, kind, hold_ns)
        except Exception as exc:
            self.torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the run
            return Trial(float("nan"), True, None, "error", "error", error=" ".join(str(exc).split())[:200])

    def _h2d(self, order: str, kind: str, hold_ns: int) -> Trial:
        torch, np, a = self.torch, self.np, self.annotate
        host = self.words[kind]
        host.fill(OLD)
        self.dev.fill_(SENTINEL)
        torch.cuda.synchronize()
        s = self.copy_stream
        with torch.cuda.stream(s):
            with a.phase_range("write"):  # the pending work: the hold on the copy stream
                self.kernels.spin(hold_ns)
                self.pending.record(s)
            with a.phase_range("swap"):
                t0 = time.perf_counter()
                self._swap(self.host_ptrs[kind], self.dev_ptrs, order)
                t1 = time.perf_counter()
            pending_at_return = not self.pending.query()
            with a.phase_range("write"):  # the host rewrites the source
                host.fill(NEW)
            pending_after_rewrite = not self.pending.query()
        with a.phase_range("verify"):
            torch.cuda.synchronize()
            landed = classify_words(self.dev.cpu().numpy().view(np.uint64))
        return Trial(t1 - t0, pending_at_return, pending_after_rewrite, landed,
                     source_read("h2d", landed, pending_at_return, pending_after_rewrite))

    def _d2h(self, order: str, kind: str, hold_ns: int) -> Trial:
        torch, a = self.torch, self.annotate
        host = self.words[kind]
        host.fill(SENTINEL)
        self.dev.fill_(OLD)
        torch.cuda.synchronize()
        w, s = self.writer_stream, self.copy_stream
        with a.phase_range("write"):  # the pending writer on the other stream
            with torch.cuda.stream(w):
                self.kernels.spin(hold_ns)
                self.dev.fill_(NEW)
                self.pending.record(w)
            s.wait_event(self.pending)
        with torch.cuda.stream(s):
            with a.phase_range("swap"):
                t0 = time.perf_counter()
                self._swap(self.dev_ptrs, self.host_ptrs[kind], order)
                t1 = time.perf_counter()
            pending_at_return = not self.pending.query()
        with a.phase_range("verify"):
            torch.cuda.synchronize()
            landed = classify_words(host.copy())
        return Trial(t1 - t0, pending_at_return, None, landed, source_read("d2h", landed, pending_at_return, None))


# --------------------------------------------------------------------------- driver


def run_probe(args: argparse.Namespace, backend, platform: dict[str, Any], annotate, progress=None) -> dict[str, Any]:
    """Run every selected cell on ``backend`` (anything with ``trial(direction, order, kind, hold_ns)``) and return the document."""
    hold_ns = int(round(args.hold_ms * 1e6))
    started = time.perf_counter()
    cells = []
    batch_ok = platform.get("batch_api_available") is not False
    with annotate.run_range("kvverify probe"):
        for direction in args.directions:
            for order in args.orders:
                for kind in args.host_memory:
                    label = f"probe {direction} {order} {kind}"
                    if not batch_ok:
                        trials = [Trial(float("nan"), True, None, "error", "error", error="batch API absent")] * args.reps
                    else:
                        with annotate.cell_range(label, direction):
                            backend.trial(direction, order, kind, hold_ns)  # warm-up, not counted
                            trials = []
                            for i in range(args.reps):
                                with annotate.trial_range(i):
                                    trials.append(backend.trial(direction, order, kind, hold_ns))
                    cells.append(summarize_cell(direction, order, kind, hold_ns / 1e9, trials))
                    if progress is not None:
                        c = cells[-1]
                        progress(f"{label}: blocks {_agree(c['blocks'])}, source read {_agree(c['source_read'])}")
    return {
        "kind": "kvverify-probe",
        "version": 1,
        "platform": platform,
        "config": {
            "reps": args.reps,
            "warmup_trials": 1,
            "hold_s": hold_ns / 1e9,
            "page_bytes": args.page_bytes,
            "pages": args.pages,
            "directions": list(args.directions),
            "orders": list(args.orders),
            "host_memory": list(args.host_memory),
        },
        "cells": cells,
        "elapsed_s": time.perf_counter() - started,
    }


def run(args: argparse.Namespace) -> int:
    if args.page_bytes % 8:
        print(f"kvverify probe: --page-bytes must be a multiple of 8, got {args.page_bytes}", file=sys.stderr)
        return 2
    measurement = common.begin("probe", args)
    if isinstance(measurement, int):
        return measurement
    annotate, platform, out, progress = (measurement.annotate, measurement.platform, measurement.out,
                                         measurement.progress)

    backend = CudaProbe(args.device, args.page_bytes, args.pages, list(args.host_memory), annotate)
    try:
        document = run_probe(args, backend, platform, annotate, progress)
    finally:
        backend.close()
    render_table(document, out)
    if args.json:
        common.write_json(args.json, document)
        if args.json != "-":
            progress(f"report written to {args.json}")
    return 0
