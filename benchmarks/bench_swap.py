"""Bandwidth of 4096 scattered 64 KiB copies per source access order, H2D and D2H (pinned host),
against one contiguous copy of the same bytes. Prints GB/s (1e9 bytes/s); a figure, not a test.

Method: the copy stream is held by a sleep kernel while the batch is queued, and CUDA events
recorded right around the batch time the copy alone; median of --reps repetitions; the page
set is drawn from a pool 4x larger than the bytes moved, so L2 holds none of it.

    python benchmarks/bench_swap.py [--pages 4096] [--page-bytes 65536] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from kvverify.device import ops
from kvverify.device.host_memory import allocate_host
from kvverify.device.ops import SrcAccessOrder


def timed(fn, stream, reps):
    """Median seconds of ``fn()`` on ``stream`` over ``reps`` runs, with the stream held while queued."""
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)  # ~50 ms hold: the whole batch is queued before it runs
            start.record()
            fn()
            stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--page-bytes", type=int, default=64 << 10)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    n, page = args.pages, args.page_bytes
    pool_pages = 4 * n
    total = n * page
    gpu = torch.empty(pool_pages * page, dtype=torch.uint8, device="cuda")
    host = allocate_host("pinned", pool_pages * page)
    host.numpy(np.uint8)[:] = 1
    rng = np.random.default_rng(0)
    gpu_ids = rng.choice(pool_pages, n, replace=False)
    host_ids = rng.choice(pool_pages, n, replace=False)
    gpu_ptrs = torch.tensor(gpu.data_ptr() + gpu_ids * page, dtype=torch.int64)
    host_ptrs = torch.tensor(host.ptr + host_ids * page, dtype=torch.int64)
    sizes = torch.full((n,), page, dtype=torch.int64)
    host_view = torch.from_numpy(host.numpy(np.uint8)[:total])
    stream = torch.cuda.Stream()
    print(f"{n} scattered copies of {page} B = {total / 2**20:.0f} MiB per batch, pinned host, median of {args.reps}")
    print(f"{'direction':<10}{'path':<24}{'GB/s':>10}")
    for direction in ("H2D", "D2H"):
        src, dst = (host_ptrs, gpu_ptrs) if direction == "H2D" else (gpu_ptrs, host_ptrs)

        def contiguous():
            if direction == "H2D":
                gpu[:total].copy_(host_view, non_blocking=True)
            else:
                host_view.copy_(gpu[:total], non_blocking=True)

        rows = [("contiguous (ceiling)", contiguous)]
        for order in SrcAccessOrder:
            rows.append((f"batch {order.name}", lambda o=order: ops.swap_blocks_batch(src, dst, sizes, o)))
        rows.append(("cudaMemcpyAsync loop", lambda: ops.swap_blocks_batch(src, dst, sizes, use_batch_api=False)))
        for label, fn in rows:
            fn()  # warm-up
            seconds = timed(fn, stream, args.reps)
            print(f"{direction:<10}{label:<24}{total / seconds / 1e9:>10.2f}")
    host.free()


if __name__ == "__main__":
    main()
