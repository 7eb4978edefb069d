"""The interpreter both executors share: a scenario's program, run on the GPU, one trial at a time.

Everything except ``Swap`` means the same in every executor: writers and readers are
harness kernels on the program's streams, events and waits are CUDA's, host syncs and the
engine's completion polling are host waits, host writes and reads happen at their point of
the host program. Executors differ only in how a ``Swap`` reaches the device
(``_swap``) and in what a host wait releases first (``_before_host_wait``).

A trial: setup (every block of the program written with generation 1, then a drain);
the steps; a drain; the final ``Expect`` checks. Checks are GPU verify kernels whose
per-page states are counted once per trial, after the drain, so checking adds no host
round trip per block. Host waits poll with a deadline: a hang becomes a ``HarnessError``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvverify import annotate
from kvverify.errors import HarnessError
from kvverify.scenarios.program import (
    GPU,
    HOST,
    SETUP_GENERATION,
    Blocks,
    Expect,
    HostConsume,
    HostFill,
    Poll,
    Program,
    Read,
    Record,
    Swap,
    SyncEvent,
    SyncStream,
    WaitEvent,
    WaitStream,
    Write,
    reference_contents,
)
from kvverify.stress.executors.pools import Pools, PreparedBlocks

GEN_STRIDE = 64  # generations per trial (prepare refuses a program that uses more); each trial gets fresh ones


@dataclasses.dataclass(frozen=True)
class Settings:
    seed: int = 0
    writer_delay_ns: int = 1_000_000
    reader_ns: int = 1_000_000
    hold_timeout_s: float = 30.0
    data: str = "pattern"  # or "random" (see executors.contents)


@dataclasses.dataclass
class TrialResult:
    counts: np.ndarray  # int64[4]: pages OK, STALE, TORN, GARBAGE
    checked_bytes: int
    copied_bytes: int
    schedule: str  # "native", or the adversarial schedule used
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time of write / swap / verify

    @property
    def corrupted(self) -> bool:
        return bool(self.counts[1:].sum())


@dataclasses.dataclass
class SwapData:
    step: Swap
    pairs: list[tuple[tuple[str, int], tuple[str, int]]]  # block-level copies in issue order
    src: np.ndarray  # int64 page addresses, issue order, tensor-major per copy group
    dst: np.ndarray
    src_pool: str
    dst_pool: str
    snapshot_first_page: int
    cpu: tuple  # (src, dst, sizes) int64 CPU tensors for swap_blocks_batch
    extra: dict = dataclasses.field(default_factory=dict)  # executor-specific precomputation


@dataclasses.dataclass
class BlockData:
    """Blocks of a step and the content they get (writes) or should hold (checks)."""

    blocks: PreparedBlocks
    ids: object  # pattern ids of the pages (cuda int64)
    cids: np.ndarray  # content id per block
    generation: int  # relative


@dataclasses.dataclass
class Prepared:
    program: Program
    steps: list[tuple[object, object]]
    setup_gpu: BlockData | None
    setup_host: BlockData | None
    checked_pages: int
    copied_pages: int


class Executor:
    name = "base"

    def __init__(self, pools: Pools, settings: Settings) -> None:
        import torch

        self.torch = torch
        self.pools, self.settings = pools, settings
        self.page_bytes = pools.page_bytes
        self._streams: dict[str, object] = {}
        self._owned: list = []  # every stream this executor made, each a distinct CUDA stream
        self._created: list = []  # handles of streams made with cuStreamCreate (past torch's pool)
        self.host_stream = self._new_stream()  # the host's own writes and reads
        self._epoch = 0
        self.schedule = self.name
        from kvverify.stress.executors import contents

        self.contents = contents.make(settings.data, pools, settings.seed)

    # -- preparation (once per cell) -------------------------------------------------------

    def prepare(self, program: Program) -> Prepared:
        if program.max_generation() >= GEN_STRIDE:
            raise HarnessError(f"a program uses generation {program.max_generation()}; a trial has {GEN_STRIDE}")
        pools = self.pools
        states = reference_contents(program)
        steps: list[tuple[object, object]] = []
        checked = copied = snapshot = 0

        def data(blocks: Blocks, i: int, generation: int) -> BlockData:
            # A write puts its own content there; a check expects what the reference model says.
            state = states[i + 1] if isinstance(program.steps[i], (Write, HostFill)) else states[i]
            cids = np.array([state[(blocks.pool, s)][0] for s in blocks.slots], dtype=np.int64)
            return BlockData(pools.prepare(blocks), pools.page_ids(cids), cids, generation)

        for i, step in enumerate(program.steps):
            if isinstance(step, (Write, HostFill)):
                steps.append((step, data(step.blocks, i, step.generation)))
            elif isinstance(step, (Read, HostConsume, Expect)):
                steps.append((step, data(step.blocks, i, step.generation)))
                checked += len(step.blocks) * pools.tensors * (2 if isinstance(step, Read) else 1)
            elif isinstance(step, Swap):
                swap = self._swap_data(step, program, snapshot)
                snapshot += len(swap.src)
                copied += len(swap.src)
                steps.append((step, swap))
            else:
                steps.append((step, None))
        setup: dict[str, BlockData | None] = {GPU: None, HOST: None}
        for pool, n in ((GPU, program.gpu_slots), (HOST, program.host_slots)):
            if n:
                cids = np.array([states[0][(pool, s)][0] for s in range(n)], dtype=np.int64)
                setup[pool] = BlockData(pools.prepare(Blocks(pool, tuple(range(n)))), pools.page_ids(cids), cids,
                                        SETUP_GENERATION)
        setup_gpu, setup_host = setup[GPU], setup[HOST]
        return Prepared(program, steps, setup_gpu, setup_host, checked, copied)

    def _swap_data(self, step: Swap, program: Program, snapshot_first_page: int) -> SwapData:
        torch = self.torch
        pairs = [p for c in step.copies for p in c.pairs()]
        src_pool, dst_pool = step.copies[0].src.pool, step.copies[0].dst.pool
        if any(c.src.pool != src_pool for c in step.copies):
            raise ValueError(f"{step}: one batch moves blocks in one direction here")
        src = np.concatenate([self.pools.prepare(c.src).ptrs for c in step.copies])
        dst = np.concatenate([self.pools.prepare(c.dst).ptrs for c in step.copies])
        sizes = np.full(len(src), self.page_bytes, dtype=np.int64)
        cpu = (torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(sizes))
        return SwapData(step, pairs, src, dst, src_pool, dst_pool, snapshot_first_page, cpu)

    # -- one trial -------------------------------------------------------------------------

    def run_trial(self, prepared: Prepared, order: str, trial: int, inject_fault: bool = False) -> TrialResult:
        """One trial; ``inject_fault`` raises a HarnessError inside the verify phase (tests
        of the runner's error path and of balanced NVTX ranges)."""
        torch = self.torch
        self._epoch += 1
        base = self._epoch * GEN_STRIDE
        self._begin_trial(trial)
        self.contents.begin_trial()
        self._events: dict[str, object] = {}
        pending: list[object] = []
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        phase_s: dict[str, float] = {}
        try:
            with annotate.phase_range("write"):
                self._setup(prepared, base)
            phase_s["write"] = lap()
            self._after_setup(prepared)
            with annotate.phase_range("swap"):
                for step, data in prepared.steps:
                    if not isinstance(step, Expect):
                        self._step(step, data, order, base, pending)
                self._drain()
            phase_s["swap"] = lap()
            with annotate.phase_range("verify"):
                compute = self._stream(prepared.program.streams[0])
                for step, data in prepared.steps:
                    if isinstance(step, Expect):
                        on = compute if step.blocks.pool == GPU else self.host_stream
                        pending.append(self._verify(data, base, on))
                self._sync_all("the final checks")
                self._check_trial()
                if inject_fault:
                    raise HarnessError("injected fault (KVVERIFY_STRESS_FAIL_CELL)")
                states = torch.cat([p.to(torch.int64) for p in pending]) if pending else torch.zeros(0, dtype=torch.int64)
                counts = torch.bincount(states, minlength=4)[:4].cpu().numpy().astype(np.int64)
            phase_s["verify"] = lap()
        finally:
            self._end_trial()
        return TrialResult(counts, prepared.checked_pages * self.page_bytes,
                           prepared.copied_pages * self.page_bytes, self.schedule, phase_s)

    def _setup(self, prepared: Prepared, base: int) -> None:
        if prepared.setup_gpu:
            d = prepared.setup_gpu
            with self.torch.cuda.stream(self._stream(prepared.program.streams[0])):
                self.contents.write_device(d.blocks, d.ids, d.cids, base + d.generation, 0)
        if prepared.setup_host:
            self._host_write(prepared.setup_host, base)
        self._sync_all("the setup")

    def _step(self, step, data, order: str, base: int, pending: list) -> None:
        from kvverify.device import kernels

        torch = self.torch
        if isinstance(step, Write):
            with torch.cuda.stream(self._stream(step.stream)):
                spin = self.settings.writer_delay_ns if step.spin else 0
                self.contents.write_device(data.blocks, data.ids, data.cids, base + step.generation, spin)
        elif isinstance(step, Read):
            s = self._stream(step.stream)
            pending.append(self._verify(data, base, s))  # what the reader sees when it starts ...
            with torch.cuda.stream(s):
                kernels.read_blocks(data.blocks.ptrs_cuda, self.page_bytes, self.settings.reader_ns)
            pending.append(self._verify(data, base, s))  # ... and at the end of its window
        elif isinstance(step, Swap):
            self._swap(self._stream(step.stream), data, order)
        elif isinstance(step, Record):
            event = torch.cuda.Event()
            event.record(self._stream(step.stream))
            self._events[step.event] = event
        elif isinstance(step, WaitEvent):
            if step.event in self._events:  # CUDA: waiting on a never-recorded event orders nothing
                self._stream(step.stream).wait_event(self._events[step.event])
        elif isinstance(step, WaitStream):
            self._stream(step.stream).wait_stream(self._stream(step.on))
        elif isinstance(step, SyncEvent):
            event = self._events.get(step.event)
            if event is not None:
                self._host_wait([event], f"sync on event {step.event!r}")
        elif isinstance(step, SyncStream):
            self._host_wait([self._mark(self._stream(step.stream))], f"sync on stream {step.stream!r}")
        elif isinstance(step, Poll):
            self._host_wait([self._events[e] for e in step.events if e in self._events], "polling end events")
        elif isinstance(step, HostFill):
            self._before_host_access()
            self._host_write(data, base)
        elif isinstance(step, HostConsume):
            self._before_host_access()
            pending.append(self._verify(data, base, self.host_stream))
            self._own_wait(self.host_stream, "host read")
        else:  # pragma: no cover
            raise TypeError(f"no execution for step {step!r}")

    # -- host writes, checks ------------------------------------------------------------------

    def _host_write(self, data: BlockData, base: int) -> None:
        """The host writes ``data.blocks`` now and continues once the bytes are in place."""
        with self.torch.cuda.stream(self.host_stream):
            self.contents.write_host(data.blocks, data.ids, data.cids, base + data.generation)
        self._own_wait(self.host_stream, "host write")

    def _verify(self, data: BlockData, base: int, stream):
        """Check ``data.blocks`` on ``stream`` (a host block: the host reads it now); return the
        per-page states (int8, on the device, valid once the stream gets there)."""
        with self.torch.cuda.stream(stream):
            return self.contents.verify(data.blocks, data.ids, data.cids, base + data.generation)

    # -- streams and host waits -----------------------------------------------------------

    def _stream(self, name: str):
        if name not in self._streams:
            self._streams[name] = self._new_stream()
        return self._streams[name]

    def _new_stream(self):
        """A stream that is none of this executor's other streams. ``torch.cuda.Stream()``
        hands out torch's pool of 32 streams round robin, so the 33rd request returns a stream
        already in use: two program streams would then be one (an order the program does not
        have, hiding races), or a held transfer stream would be the host's own stream (the
        host would wait on a hold). Skip pool streams this executor has; past the pool, a
        fresh non-blocking stream (cuda-python)."""
        torch = self.torch
        taken = {s.cuda_stream for s in self._owned}
        stream = None
        for _ in range(64):  # the pool has 32 per priority: one lap finds a free one if any
            s = torch.cuda.Stream(device=self.pools.device)
            if s.cuda_stream not in taken:
                stream = s
                break
        if stream is None:
            try:
                from cuda.bindings import driver as d

                err, handle = d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
                if err != d.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuStreamCreate: {err}")
                self._created.append(handle)
                stream = torch.cuda.ExternalStream(int(handle), device=self.pools.device)
            except Exception as exc:
                raise HarnessError(f"{self.name} executor: needs more than {len(taken)} distinct streams and "
                                   f"torch's pool has no more ({exc}); lower transfers") from None
        self._owned.append(stream)
        return stream

    def _mark(self, stream):
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def _host_wait(self, events: list, what: str) -> None:
        """The host blocks until ``events`` completed (as cudaEventSynchronize / a poll loop)."""
        self._before_host_wait()
        self._poll(events, what)

    def _own_wait(self, stream, what: str) -> None:
        """Wait for the harness's own stream (host writes / reads), which waits on nothing."""
        self._poll([self._mark(stream)], what)

    def _poll(self, events: list, what: str) -> None:
        deadline = time.monotonic() + self.settings.hold_timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{self.name} executor: {what} did not complete within {self.settings.hold_timeout_s} s; "
                    "a stream is stuck (raise hold_timeout_s in the campaign if the device is just slow)"
                )
            time.sleep(20e-6)

    def _drain(self) -> None:
        self._host_wait([self._mark(s) for s in self._streams.values()] + [self._mark(self.host_stream)], "drain")

    def _all_streams(self) -> list:
        return [*self._streams.values(), self.host_stream, self.torch.cuda.current_stream(self.pools.device)]

    def _sync_all(self, what: str) -> None:
        """Wait, with the deadline, for everything issued to the executor's streams and the
        current stream (a device-wide synchronize that cannot hang on a held stream)."""
        self._host_wait([self._mark(s) for s in self._all_streams()], what)

    def release_holds(self) -> None:
        """Release every stream hold of this executor now (a failed trial's cleanup); it stays usable."""
        self._before_host_wait()

    def close(self) -> None:
        """Release whatever the executor holds (every exit path of the runner calls it)."""
        self._before_host_wait()

    def host_buffers(self) -> list:
        """Host memory the executor owns beside the pools (``HostBuffer``), for ``abandon``."""
        return []

    def free_memory(self) -> None:
        """Free what the executor owns: the streams it made past torch's pool
        (``cuStreamDestroy``); called only once the device is idle (after ``close``)."""
        if self._created:
            from cuda.bindings import driver as d

            for handle in self._created:
                d.cuStreamDestroy(handle)
            self._created = []

    # -- executor hooks ---------------------------------------------------------------------

    def _begin_trial(self, trial: int) -> None:
        pass

    def _after_setup(self, prepared: Prepared) -> None:
        pass

    def _end_trial(self) -> None:
        self._before_host_wait()

    def _check_trial(self) -> None:
        """Raise HarnessError when the trial did not run as scheduled (executor hook)."""

    def _before_host_wait(self) -> None:
        pass

    def _before_host_access(self) -> None:
        """The host is about to read or write host blocks of the program (executor hook)."""

    def _swap(self, stream, data: SwapData, order: str) -> None:
        raise NotImplementedError
