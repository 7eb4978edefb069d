"""``kvverify bench`` on the device: pools, streams and events for timed reps, and a bf16 matmul for the
compute slowdown (``kvverify.measure.bench`` has the method)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvverify.measure.bench_plan import BOTH, CEILING, KERNEL, LOOP
from kvverify.terms import ORDERS

if TYPE_CHECKING:
    from kvverify.measure.bench_plan import Point


class CudaBench:
    """Pools, streams and events for bench reps on one CUDA device.

    A ``both`` point runs its H2D calls on the copy stream and its D2H calls on a second stream
    forked from it and joined back, each direction between its own half of the two pools; the
    kernel path instead makes one call of each pair, its pages interleaved (``issuer``).
    """

    def __init__(self, device_index: int, host_kind: str, pool_bytes: int, matmul_size: int = 4096):
        import numpy as np
        import torch

        from kvverify.device import host_memory, kernels, ops

        self.np, self.torch, self.ops, self.kernels = np, torch, ops, kernels
        torch.cuda.set_device(device_index)
        self.pool_bytes = pool_bytes
        self.matmul_size = matmul_size
        self.host = host_memory.allocate_host(host_kind, pool_bytes)
        # Touch every host page now, so that no first-touch fault lands inside a timed rep.
        self.host.numpy(np.uint8)[:pool_bytes].fill(0x5A)
        self.dev = torch.empty(pool_bytes, dtype=torch.uint8, device=f"cuda:{device_index}")
        self.dev.fill_(0xA5)
        self.stream = torch.cuda.Stream()
        self.other = torch.cuda.Stream()  # the D2H half of a `both` call
        self.compute = torch.cuda.Stream()  # the matmuls of the compute slowdown
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)
        self.fork, self.join, self.gate = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()
        self.mm_start = torch.cuda.Event(enable_timing=True)
        self.mm_stop = torch.cuda.Event(enable_timing=True)
        self._matmul = None  # (a, b, out), made on first use
        torch.cuda.synchronize()

    def close(self) -> None:
        self.torch.cuda.synchronize()
        self.host.free()

    def recover(self) -> None:
        """After an op raised: wait for the streams (a sticky CUDA error raises here and ends the run)."""
        self.torch.cuda.synchronize()

    def _bases(self, direction: str, offset: int = 0) -> tuple[int, int]:
        host, dev = int(self.host.ptr) + offset, int(self.dev.data_ptr()) + offset
        return (host, dev) if direction == "h2d" else (dev, host)

    def _draw(self, rng, direction: str, point: Point, offset: int, region: int):
        """One call's (src_ptrs, dst_ptrs, sizes): ``pages_per_call`` distinct page slots drawn from
        ``region`` bytes at ``offset`` of each pool."""
        np, torch = self.np, self.torch
        slots = region // point.page_bytes
        src_base, dst_base = self._bases(direction, offset)
        src = rng.choice(slots, size=point.pages_per_call, replace=False).astype(np.int64) * point.page_bytes + src_base
        dst = rng.choice(slots, size=point.pages_per_call, replace=False).astype(np.int64) * point.page_bytes + dst_base
        return torch.from_numpy(src), torch.from_numpy(dst), torch.full((point.pages_per_call,), point.page_bytes,
                                                                         dtype=torch.int64)

    def prepare(self, point: Point, seed: int) -> list:
        """``calls_per_rep`` call-sets at random page slots: (src_ptrs, dst_ptrs, sizes) int64 CPU
        tensors, or for ``both`` an (H2D, D2H) pair of them, H2D in the first half of each pool.

        Each call-set goes once through the op with its pointer check on (an address the driver
        cannot resolve raises a ValueError instead of crashing the process); the timed calls skip it.
        """
        rng = self.np.random.default_rng(seed)
        if point.direction == BOTH:
            half = self.pool_bytes // 2
            calls = [(self._draw(rng, "h2d", point, 0, half), self._draw(rng, "d2h", point, half, half))
                     for _ in range(point.calls_per_rep)]
            checked = [c for pair in calls for c in pair]
        else:
            calls = [self._draw(rng, point.direction, point, 0, self.pool_bytes) for _ in range(point.calls_per_rep)]
            checked = calls
        for src, dst, n in checked:
            self.ops.swap_blocks_batch(src, dst, n, self.ops.SrcAccessOrder.STREAM, check_pointers=True)
        self.torch.cuda.synchronize()
        return calls

    def _copy(self, method: str) -> Callable:
        """One call of ``method`` on the current stream, the pointer check off."""
        ops = self.ops
        if method in ORDERS:
            order = ops.SrcAccessOrder[method]
            return lambda src, dst, sizes: ops.swap_blocks_batch(src, dst, sizes, order, check_pointers=False)
        if method not in (LOOP, KERNEL):
            raise ValueError(f"unknown bench method {method!r}")
        stream_order = ops.SrcAccessOrder.STREAM
        return lambda src, dst, sizes: ops.swap_blocks_batch(src, dst, sizes, stream_order, method=method,
                                                            check_pointers=False)

    def _ceiling_calls(self, point: Point) -> list:
        """One contiguous copy per direction of the rep's bytes, between the same pools (halves for ``both``)."""
        torch = self.torch
        per_way = point.rep_bytes // point.ways
        ways = [("h2d", 0), ("d2h", self.pool_bytes // 2)] if point.direction == BOTH else [(point.direction, 0)]
        calls = []
        for direction, offset in ways:
            src, dst = self._bases(direction, offset)
            calls.append(tuple(torch.tensor([v], dtype=torch.int64) for v in (src, dst, per_way)))
        for one in calls:  # checked once
            self.ops.swap_blocks_batch(*one, self.ops.SrcAccessOrder.STREAM, method=LOOP, check_pointers=True)
        torch.cuda.synchronize()
        return [tuple(calls)] if point.direction == BOTH else calls

    def issuer(self, method: str, point: Point, calls) -> Callable[[], None]:
        """A function that queues one rep of ``method`` on the current stream (for ``both``: its D2H
        calls on a second stream forked from the current one and joined back before it returns;
        for ``both`` on the kernel path: one call per H2D and D2H pair, their pages interleaved)."""
        if method == CEILING:
            copy, calls = self._copy(LOOP), self._ceiling_calls(point)
        else:
            copy = self._copy(method)
        if point.direction == BOTH and method == KERNEL:
            # One launch carrying both directions' pages, interleaved, so that every thread block
            # alternates H2D and D2H: on an H200 at 16 KiB pages two copy kernels on two streams
            # move 62-70 GB/s together, one mixed launch 78-81 (docs/bench.md, "Both directions").
            mixed = [tuple(self.torch.stack((h, d), dim=1).reshape(-1) for h, d in zip(h2d, d2h, strict=True))
                     for h2d, d2h in calls]

            def one_mixed_call() -> None:
                for src, dst, sizes in mixed:
                    copy(src, dst, sizes)
            return one_mixed_call
        if point.direction != BOTH:
            def one_way() -> None:
                for src, dst, sizes in calls:
                    copy(src, dst, sizes)
            return one_way
        torch, other = self.torch, self.other

        def both_ways() -> None:
            current = torch.cuda.current_stream()
            self.fork.record(current)
            other.wait_event(self.fork)
            for h2d, d2h in calls:
                copy(*h2d)
                with torch.cuda.stream(other):
                    copy(*d2h)
            self.join.record(other)
            current.wait_event(self.join)
        return both_ways

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

    # -- compute slowdown --------------------------------------------------------------------

    def _matmuls(self, count: int) -> None:
        """``count`` bf16 matmuls of ``matmul_size`` squared matrices on the current stream."""
        torch = self.torch
        if self._matmul is None:
            n = self.matmul_size
            gen = torch.Generator(device=self.dev.device).manual_seed(0)
            a, b = (torch.randn(n, n, device=self.dev.device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
            self._matmul = (a, b, torch.empty(n, n, device=self.dev.device, dtype=torch.bfloat16))
        a, b, out = self._matmul
        for _ in range(count):
            torch.mm(a, b, out=out)

    def matmuls_alone(self, count: int, hold_ns: int) -> float:
        """Event seconds of ``count`` matmuls queued behind a hold on the compute stream, nothing else running."""
        torch, c = self.torch, self.compute
        with torch.cuda.stream(c):
            self.kernels.spin(int(hold_ns))
            self.mm_start.record(c)
            self._matmuls(count)
            self.mm_stop.record(c)
        self.mm_stop.synchronize()
        return self.mm_start.elapsed_time(self.mm_stop) / 1e3

    def matmuls_during(self, issue: Callable[[], None], repeats: int, count: int,
                       hold_ns: int) -> tuple[float, float, bool]:
        """``count`` matmuls on the compute stream while ``repeats`` reps of ``issue`` run on the copy
        stream, both released together by one hold. Returns (event seconds of the matmuls, event
        seconds of the copies, whether the copies shared the whole matmul window: every copy call was
        queued before the hold ended, and the copies' stop event came after the matmuls')."""
        torch, s, c = self.torch, self.stream, self.compute
        with torch.cuda.stream(s):
            self.kernels.spin(int(hold_ns))
            self.gate.record(s)
        c.wait_event(self.gate)
        with torch.cuda.stream(c):
            self.mm_start.record(c)
            self._matmuls(count)
            self.mm_stop.record(c)
        with torch.cuda.stream(s):
            self.start.record(s)
            for _ in range(repeats):
                issue()
            self.stop.record(s)
            # A call that blocked the host past the hold (one that waits for pending work, or an
            # allocation that synchronizes) queued its copies late: the start event cannot tell.
            covered = not self.gate.query()
        self.mm_stop.synchronize()
        self.stop.synchronize()
        overlapped = self.start.elapsed_time(self.mm_stop) <= self.start.elapsed_time(self.stop)
        return (self.mm_start.elapsed_time(self.mm_stop) / 1e3, self.start.elapsed_time(self.stop) / 1e3,
                covered and overlapped)
