"""The adversarial executor: each swap realizes an extreme its source access order allows.

Every trial follows one of three schedules (trial index mod 3), each a schedule the order
permits, so a SAFE cell must show no corruption under any of them and a RACY one shows it
under at least one:

- ``early``: every copy as early as possible against the compute around it. Sources read at
  API-call time for ``ANY`` and ``DURING_API_CALL`` (a snapshot on a stream that waits on
  nothing, or by the host for a host source; the host waits for it, as the call would), in
  stream order for ``STREAM``; destinations written as soon as stream order allows (a
  pageable one when the host next looks, see below: only the host can observe it); and the
  compute streams (those that run writers and readers) held until the host next waits, so
  a copy not ordered after a writer reads before it, and a load not ordered against compute
  lands before compute touches the block (H1, H2, and stores under ``ANY``), on any GPU and
  whatever the copy sizes.
- ``mixed``: sources read as in ``early``, destinations held as late as stream order
  allows: the copy stream waits on a host flag (``StreamGate``) until the host next waits
  for the device. Shows a host block reloaded while its store is pending (H5) and a
  destination consumed before completion (H4, H6).
- ``late``: sources read as late as possible too (``STREAM`` and ``ANY`` read after the
  hold; ``DURING_API_CALL`` still at the call), widening the window for host rewrites (H3).

Rules that bind every schedule (trace rule 6 for ``copy_batch``, docs/trace-format.md): a
pageable source is read during the call, whatever the order; a pageable destination is
written after the copy's place in its stream and before the host observes its completion
(held late like any other; below, how). An earliest read is a
snapshot taken at call time, before anything in the call waits for compute or for the
copy stream: a host source (pinned, registered or pageable) is read by the host itself
into a pinned host snapshot area, a device source is copied into the device snapshot area
on a stream that waits on nothing. Copies inside one batch run in an order other than issue order: later-issued
copies first wherever two copies touch the same block (``batch_rounds``), as the batch's
lack of internal order allows (H7).

No hold may ever be waited on by the host. Held streams therefore only ever carry H2D and
D2H batches between device and pinned memory, never a device-to-device batch and never a
batch into pageable memory: a driver may complete those inside the call, which would then
wait for the hold (seen on an H200, docs/stress.md). So a host source is snapshot on the
host, not into device memory (the destination write is then a pinned H2D batch, as in
``STREAM`` order), and a copy into pageable memory lands in a pinned landing area on its
stream (held like any other) and the host writes it into the pageable destination the first
time it finds the landing done: at every host wait and before every host read, host write
and host snapshot. That is a write between the copy's place in its stream and the host's
observing its completion, which rule 6 (as kvverify reads it) allows.

A hold the watchdog had to release (``StreamGate.deadline_s``: the host was blocked in a
call that waited for a held stream) still leaves a permitted schedule (a hold only delays),
so the trial stands; stderr and the cell's window say so.

The physical copies are ``swap_blocks_batch`` in ``STREAM`` order: the executor, not the
driver, decides when a source is read.
"""

from __future__ import annotations

import numpy as np

from kvverify.stress.executors.base import Executor, SwapData
from kvverify.device.gate import StreamGate

SCHEDULES = ("early", "mixed", "late")
GATE_DEADLINE_S = 2.0  # no hold outlives this: the host issues a trial's work in milliseconds


def batch_rounds(pairs: list[tuple[tuple[str, int], tuple[str, int]]]) -> list[int]:
    """Round of each block copy so that running rounds 0, 1, ... reverses the issue order
    of every two copies that touch a common block (one writes it); unrelated copies share
    a round. ``pairs[i] = (src, dst)`` blocks, in issue order."""
    rounds = [0] * len(pairs)
    for i in range(len(pairs) - 1, -1, -1):
        src, dst = pairs[i]
        later = [rounds[j] + 1 for j in range(i + 1, len(pairs))
                 if dst in pairs[j] or src == pairs[j][1]]
        rounds[i] = max(later, default=0)
    return rounds


class AdversarialExecutor(Executor):
    name = "adversarial"

    def __init__(self, pools, settings) -> None:
        super().__init__(pools, settings)
        self.gate = StreamGate(pools.device, deadline_s=min(settings.hold_timeout_s, GATE_DEADLINE_S))
        self.snap_stream = self._new_stream()  # depends on nothing
        # Host sources are snapshot here, by the host (pinned where there is a device, so the
        # destination write is a pinned H2D batch); allocated now, before any hold, and freed by
        # free_memory() once the device is idle. Page numbering as in the device snapshot area.
        from kvverify.device.host_memory import allocate_host

        pages = max(1, pools.sizes.snapshot_pages)
        kind = "pinned" if self.torch.device(pools.device).type == "cuda" else "pageable"
        self._host_snapshot_buffer = allocate_host(kind, pages * self.page_bytes)
        self.host_snapshot = self.torch.from_numpy(self._host_snapshot_buffer.numpy(np.uint8)).view(pages, self.page_bytes)
        self._landings: list = []  # (event, data) of batches into pageable memory not yet written there
        self._expired_before = 0  # gate.expired already reported
        self._warm_up()

    def _warm_up(self) -> None:
        """Launch every harness kernel once now, before any hold. torch sets
        CUDA_MODULE_LOADING=LAZY: a kernel's module is loaded at its first launch, and loading
        may synchronize the context (CUDA programming guide, lazy loading), i.e. wait for a
        held stream until the watchdog releases it. The native cells that usually run first
        load them too, but not in a run of adversarial cells only."""
        from kvverify.device import kernels

        torch, pools = self.torch, self.pools
        try:
            ptrs = torch.tensor([pools.snapshot_ptr(0)], dtype=torch.int64).to(pools.device)  # scratch page
            ids = torch.zeros(1, dtype=torch.int64).to(pools.device)
            with torch.cuda.stream(self.host_stream):
                kernels.write_blocks(ptrs, self.page_bytes, ids, 1, self.settings.seed, 0)
                kernels.read_blocks(ptrs, self.page_bytes, 0)
                kernels.verify_blocks(ptrs, self.page_bytes, ids, 1, self.settings.seed)
                kernels.checksum_blocks(ptrs, self.page_bytes)
                kernels.spin(0)
                if pools.sizes.staging_pages:
                    pools.staging_ptrs(1)
            self._own_wait(self.host_stream, "kernel warm-up")
        except Exception as exc:  # pragma: no cover - a warm-up must never stop a run
            import sys

            print(f"kvverify: kernel warm-up failed ({type(exc).__name__}: {exc}); going on", file=sys.stderr)

    def _begin_trial(self, trial: int) -> None:
        self.schedule = SCHEDULES[trial % len(SCHEDULES)]
        self.gate.reset()
        self._landings = []  # a failed trial's leftovers belong to no schedule

    def _check_trial(self) -> None:
        # A hold released early is still a schedule the order permits (holds only delay), so
        # the trial stands; it was less adversarial than planned, which the report says.
        if self.gate.expired != self._expired_before:
            if not self._expired_before:
                import sys

                print(f"kvverify: a stream hold was released by the watchdog after {self.gate.deadline_s:g} s: "
                      "the host was blocked in a call that waited for a held stream", file=sys.stderr, flush=True)
            self._expired_before = self.gate.expired

    @property
    def hold_note(self) -> str:
        """How holds were made, for the report's window."""
        note = self.gate.mechanism
        if self.gate.expired:
            note += f"; {self.gate.expired} hold(s) released by the watchdog after {self.gate.deadline_s:g} s"
        if self.pools.host_kind == "pageable":
            note += "; copies into pageable memory land in pinned memory, written by the host once landed"
        return note

    def _all_streams(self) -> list:
        return [*super()._all_streams(), self.snap_stream]

    def close(self) -> None:
        super().close()
        self.gate.close()

    def free_memory(self) -> None:
        """Free the host snapshot area and the base's streams (the caller made sure the device is idle)."""
        self.host_snapshot = None
        self._host_snapshot_buffer.free()
        super().free_memory()

    def host_buffers(self) -> list:
        return [self._host_snapshot_buffer]

    def _before_host_wait(self) -> None:
        self.gate.release_all()

    def _poll(self, events: list, what: str) -> None:
        super()._poll(events, what)
        self._land()

    def _before_host_access(self) -> None:
        self._land()

    def _land(self) -> None:
        """The host writes into pageable memory what every landed batch carries: those whose
        landing event has completed (no waiting), in issue order, each batch's copies in its
        rounds' order. Events are queried latest first: a batch ordered after another can only
        be found landed if that one is found landed too, so their writes keep stream order."""
        if not self._landings:
            return
        from kvverify.stress.executors.contents import scatter_host_pages

        landed = [event.query() for event, _ in reversed(self._landings)][::-1]
        for (_, data), done in zip(self._landings, landed):
            if done:
                for slots, rows, blocks in data.extra["landing"]:
                    scatter_host_pages(self.pools, slots, rows if blocks is None else rows[:, blocks])
        self._landings = [entry for entry, done in zip(self._landings, landed) if not done]

    def _after_setup(self, prepared) -> None:
        if self.schedule == "early":
            from kvverify.scenarios.program import Read, Write

            kernel_streams = {s.stream for s in prepared.program.steps if isinstance(s, (Write, Read))}
            for name in sorted(kernel_streams):
                self.gate.hold(self._stream(name))

    def _rounds(self, data: SwapData):
        """(src, snapshot, dst, sizes) CPU tensors per round, computed once per cell."""
        if "rounds" not in data.extra:
            import numpy as np

            torch = self.torch
            tensors = self.pools.tensors
            block_round = batch_rounds(data.pairs)
            # Page k of the batch belongs to block copy k // tensors within its BlockCopy group:
            # pages were laid out BlockCopy by BlockCopy, tensor-major inside each.
            page_round, k = [], 0
            for copy in data.step.copies:
                n = len(copy.src)
                for _t in range(tensors):
                    page_round += block_round[k:k + n]
                k += n
            page_round = np.array(page_round)
            pages = data.snapshot_first_page + np.arange(len(data.src), dtype=np.int64)
            host_area = self.host_snapshot.data_ptr() + pages * self.page_bytes
            dst = data.dst
            if data.src_pool == "host":  # snapshot by the host, into the pinned host snapshot area
                snap = host_area
            else:  # snapshot into the device snapshot area
                snap = np.array([self.pools.snapshot_ptr(int(p)) for p in pages], dtype=np.int64)
                if self.pools.host_kind == "pageable" and data.dst_pool == "host":
                    # Into the pinned landing area (the batch's pages of the host snapshot area,
                    # which a device source leaves unused); _land writes the pageable pages.
                    dst = host_area
                    data.extra["landing"] = self._landing_writes(data, block_round)
            out = []
            for r in range(page_round.max() + 1):
                sel = page_round == r
                out.append(tuple(torch.from_numpy(np.ascontiguousarray(a[sel])) for a in
                                 (data.src, snap, dst, np.full(len(data.src), self.page_bytes, np.int64))))
            data.extra["snapshot"] = torch.from_numpy(snap)
            data.extra["rounds"] = out
        return data.extra["rounds"]

    def _landing_writes(self, data: SwapData, block_round: list[int]) -> list:
        """(host slots, the copy group's landing rows as int64 (tensors, blocks, words), the
        blocks of the group to take or None for all) per copy group and round, in round order:
        what ``_land`` writes for this batch. Rows are views, read when ``_land`` runs."""
        writes, at, k = [], data.snapshot_first_page, 0
        groups = []
        for c in data.step.copies:
            n = len(c.src)
            rows = self.host_snapshot[at:at + n * self.pools.tensors].view(self.torch.int64).view(
                self.pools.tensors, n, -1)
            groups.append((np.asarray(c.dst.slots, dtype=np.int64), rows, np.asarray(block_round[k:k + n])))
            at, k = at + n * self.pools.tensors, k + n
        for r in range(max(block_round) + 1):
            for slots, rows, rounds in groups:
                sel = np.flatnonzero(rounds == r)
                if len(sel) == len(rounds):
                    writes.append((slots, rows, None))
                elif len(sel):
                    writes.append((slots[sel], rows, self.torch.from_numpy(sel)))
        return writes

    def _snapshot(self, data: SwapData) -> None:
        """Read every source of the batch now, into a snapshot area (the call has read its
        sources when it returns). Host sources, whatever their kind: the host itself reads
        them into the host snapshot area, so nothing here waits for the device and the
        destination write is a pinned H2D batch. Device sources: a copy into the device
        snapshot area on a stream that waits on nothing, which the host waits for."""
        from kvverify.device import ops

        if data.src_pool == "host":
            from kvverify.stress.executors.contents import gather_host_pages

            self._land()
            torch = self.torch
            # Pages were laid out copy by copy, tensor-major inside each.
            at = data.snapshot_first_page
            for c in data.step.copies:
                k = len(c.src) * self.pools.tensors
                rows = self.host_snapshot[at:at + k].view(torch.int64).view(self.pools.tensors, len(c.src), -1)
                gather_host_pages(self.pools, np.asarray(c.src.slots, dtype=np.int64), rows)
                at += k
            return
        with self.torch.cuda.stream(self.snap_stream):
            ops.swap_blocks_batch(data.cpu[0], data.extra["snapshot"], data.cpu[2], "STREAM")
        self._own_wait(self.snap_stream, "source snapshot")

    def _swap(self, stream, data: SwapData, order: str) -> None:
        from kvverify.device import ops

        torch = self.torch
        src_pageable = self.pools.host_kind == "pageable" and data.src_pool == "host"
        may_read_early = order in ("ANY", "DURING_API_CALL") or src_pageable
        read_at_call = may_read_early and (self.schedule != "late" or order == "DURING_API_CALL" or src_pageable)
        rounds = self._rounds(data)
        if read_at_call:
            # At call time, before anything here waits for compute or for the copy stream.
            self._snapshot(data)
        if self.schedule != "early":
            self.gate.hold(stream)
        with torch.cuda.stream(stream):
            for src, snap, dst, sizes in rounds:
                ops.swap_blocks_batch(snap if read_at_call else src, dst, sizes, "STREAM")
        if "landing" in data.extra:
            self._landings.append((self._mark(stream), data))
