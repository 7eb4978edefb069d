"""``kvverify bench`` on the device: pools, stream and events for timed reps (``kvverify.measure.bench``
has the method)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvverify.measure.bench_plan import Point


class CudaBench:
    """Pools, stream and events for bench reps on one CUDA device."""

    def __init__(self, device_index: int, host_kind: str, pool_bytes: int):
        import numpy as np
        import torch

        from kvverify.device import host_memory, kernels, ops

        self.np, self.torch, self.ops, self.kernels = np, torch, ops, kernels
        torch.cuda.set_device(device_index)
        self.pool_bytes = pool_bytes
        self.host = host_memory.allocate_host(host_kind, pool_bytes)
        # Touch every host page now, so that no first-touch fault lands inside a timed rep.
        self.host.numpy(np.uint8)[:pool_bytes].fill(0x5A)
        self.dev = torch.empty(pool_bytes, dtype=torch.uint8, device=f"cuda:{device_index}")
        self.dev.fill_(0xA5)
        self.stream = torch.cuda.Stream()
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()

    def close(self) -> None:
        self.torch.cuda.synchronize()
        self.host.free()

    def recover(self) -> None:
        """After an op raised: wait for the stream (a sticky CUDA error raises here and ends the run)."""
        self.torch.cuda.synchronize()

    def _bases(self, direction: str) -> tuple[int, int]:
        host, dev = int(self.host.ptr), int(self.dev.data_ptr())
        return (host, dev) if direction == "h2d" else (dev, host)

    def prepare(self, point: Point, seed: int):
        """``calls_per_rep`` call-sets of (src_ptrs, dst_ptrs, sizes) int64 CPU tensors at random page slots.

        Each call-set goes once through the op with its pointer check on (an address the driver
        cannot resolve raises a ValueError instead of crashing the process); the timed calls skip it.
        """
        np, torch = self.np, self.torch
        rng = np.random.default_rng(seed)
        slots = self.pool_bytes // point.page_bytes
        src_base, dst_base = self._bases(point.direction)
        sizes = torch.full((point.pages_per_call,), point.page_bytes, dtype=torch.int64)
        calls = []
        for _ in range(point.calls_per_rep):
            src = rng.choice(slots, size=point.pages_per_call, replace=False).astype(np.int64) * point.page_bytes + src_base
            dst = rng.choice(slots, size=point.pages_per_call, replace=False).astype(np.int64) * point.page_bytes + dst_base
            calls.append((torch.from_numpy(src), torch.from_numpy(dst), sizes))
        for src, dst, n in calls:
            self.ops.swap_blocks_batch(src, dst, n, self.ops.SrcAccessOrder.STREAM, check_pointers=True)
        torch.cuda.synchronize()
        return calls

    def issuer(self, method: str, point: Point, calls) -> Callable[[], None]:
        ops, torch = self.ops, self.torch
        stream_order = ops.SrcAccessOrder.STREAM
        if method == "ceiling":
            src_base, dst_base = self._bases(point.direction)
            one = (
                torch.tensor([src_base], dtype=torch.int64),
                torch.tensor([dst_base], dtype=torch.int64),
                torch.tensor([point.rep_bytes], dtype=torch.int64),
            )
            ops.swap_blocks_batch(*one, stream_order, use_batch_api=False, check_pointers=True)  # checked once
            torch.cuda.synchronize()
            return lambda: ops.swap_blocks_batch(*one, stream_order, use_batch_api=False, check_pointers=False)
        if method == "loop":
            def loop() -> None:
                for src, dst, sizes in calls:
                    ops.swap_blocks_batch(src, dst, sizes, stream_order, use_batch_api=False, check_pointers=False)
            return loop
        order = ops.SrcAccessOrder[method]

        def batch() -> None:
            for src, dst, sizes in calls:
                ops.swap_blocks_batch(src, dst, sizes, order, use_batch_api=True, check_pointers=False)
        return batch

    def held(self, issue: Callable[[], None], hold_ns: int) -> tuple[float, float, bool]:
        """Spin, start event, the rep's calls, stop event, all on the copy stream; returns
        (event seconds between start and stop, host seconds spent queueing, hold covered)."""
        torch, s = self.torch, self.stream
        with torch.cuda.stream(s):
            self.kernels.spin(int(hold_ns))
            self.start.record(s)
            t0 = time.perf_counter()
            issue()
            self.stop.record(s)
            queue_s = time.perf_counter() - t0
            covered = not self.start.query()
        self.stop.synchronize()
        return self.start.elapsed_time(self.stop) / 1e3, queue_s, covered

    def end_to_end(self, issue: Callable[[], None]) -> float:
        """Host seconds from before the first call to the completion of a stop event after the last (idle stream, no hold)."""
        torch, s = self.torch, self.stream
        s.synchronize()
        with torch.cuda.stream(s):
            t0 = time.perf_counter()
            issue()
            self.stop.record(s)
        self.stop.synchronize()
        return time.perf_counter() - t0
