"""A CUDA stand-in on the CPU for the recorder's tests: the recording logic runs in CI, not only on a GPU.

Tensors from ``FakeCuda.device`` are CPU tensors the stand-in calls device memory; ``pinned``
ones are CPU tensors it calls pinned. Both are made with ``torch.from_numpy`` (which the dispatcher
does not see), as memory the caching allocator and the pinned allocator would hand out. Streams
and events report to the recorder exactly what the observed event and stream methods report on a
GPU (``kvverify.record.capture.hooks``): event creation at first record, record / wait / synchronize with
the event's handle and the stream's handle, query with its result. The caching allocator's
allocations and frees go into a per-thread log the recorder takes them from, as the extension's
native log on a GPU. Everything runs at once on the host: only the recording is under test.

What this cannot test is torch's side of the hooks (what its methods and allocator do, and when):
the GPU tests in ``test_record_gpu.py`` do.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections import Counter, defaultdict

import numpy as np
import torch

from kvverify.record.capture.dispatch import RecordingPlatform
from kvverify.record.confirm.witness import DeviceTools
from kvverify.record.trace.recorder import LEGACY_STREAM, NativeRecord, Recorder

_handles = itertools.count(0x7000_0000, 0x100)
SHARED: list[FakeCuda] = []  # the stand-in of programs run by `kvverify record` in-process (shared())


class FakeStream:
    def __init__(self, fake: FakeCuda, handle: int | None = None) -> None:
        self.fake = fake
        self.handle = next(_handles) if handle is None else handle
        self.done = True  # what query() answers

    def key(self):
        return Recorder.stream_key(self.handle, 0)

    def wait_event(self, event: FakeEvent) -> None:
        if event.handle:
            self.fake.report("event_waited", event.handle, self.key())

    def wait_stream(self, other: FakeStream) -> None:
        # as torch.cuda.Stream.wait_stream: a fresh event recorded on `other`, waited on here
        event = FakeEvent(self.fake)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        self.fake.report("stream_synchronized", self.key())

    def query(self) -> bool:
        self.fake.report("stream_queried", self.key(), self.done)
        return self.done


class FakeEvent:
    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.handle = 0  # CUDA makes the event at its first record, as torch.cuda.Event does
        self.done = True

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.fake.current
        if not self.handle:
            self.handle = next(_handles)
            self.fake.report("event_created", self.handle)
        self.fake.report("event_recorded", self.handle, stream.key())

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.fake.current).wait_event(self)

    def synchronize(self) -> None:
        if self.handle:
            self.fake.report("event_synchronized", self.handle)

    def query(self) -> bool:
        if self.handle:
            self.fake.report("event_queried", self.handle, self.done)
        return self.done

    def destroy(self) -> None:
        if self.handle:
            self.fake.report("event_deleted", self.handle)
            self.handle = 0


class FakeCuda(RecordingPlatform):
    """The stand-in platform; pass it as ``recording(platform=...)``. Its device work runs at its
    call: no host byte is ever pending, so it needs no host watch (``host_watch`` None, ``watch_off``
    None: nothing is said unwatched)."""

    watch_off = None

    def __init__(self) -> None:
        self.device_storages: set[int] = set()
        self.pinned_storages: set[int] = set()
        self.pinned_ranges: list[tuple[int, int]] = []
        self.blocks: list[tuple[int, int]] = []  # the "caching allocator's" live blocks
        self.default = FakeStream(self, LEGACY_STREAM)
        self.current = self.default
        self.recorder: Recorder | None = None
        self.guard = None
        self.native_rows: defaultdict[int, list[NativeRecord]] = defaultdict(list)  # the native log, by thread
        self.capture_off = None  # native capture "runs": tests put its records in with native()
        self._keep: list = []  # numpy arrays behind the tensors
        self._calls = threading.local()  # per thread: when its last reported call began

    # -- kvverify.record.capture.dispatch.RecordingPlatform --------------------------------------

    def where(self, t) -> str | None:
        if t.device.type != "cpu":
            return None
        return "device" if t.untyped_storage().data_ptr() in self.device_storages else "host"

    def stream_key(self, t) -> object:
        return self.current.key()

    def is_pinned(self, t) -> bool:
        return t.untyped_storage().data_ptr() in self.pinned_storages

    def read_values(self, t) -> np.ndarray:
        return t.detach().contiguous().view(-1).numpy().copy()

    def allocator_blocks(self) -> list[tuple[int, int]]:
        return list(self.blocks)

    def host_range(self, address: int) -> tuple[int, int, str] | None:
        # what cuPointerGetAttribute tells of pinned memory
        for base, size in self.pinned_ranges:
            if base <= address < base + size:
                return base, size, "host_pinned"
        return None

    def skip(self) -> tuple[str, ...]:
        """``recording(skip=...)``: the stand-in's own frames are library code, as torch's are."""
        from kvverify.record.capture.frames import library_dirs

        return (*library_dirs(), __file__)

    def install(self, recorder: Recorder, guard, native: bool = True) -> None:
        self.recorder, self.guard = recorder, guard
        self.native_rows.clear()
        recorder.pending = lambda: any(self.native_rows.values())
        recorder.take = lambda thread: self.native_rows.pop(thread, [])

    def native_leftover(self) -> Counter:
        left = Counter((thread, record.kind) for thread, rows in self.native_rows.items() for record in rows)
        self.native_rows.clear()
        return left

    def uninstall(self) -> None:
        self.recorder = self.guard = None

    # -- what a program uses -----------------------------------------------------------------

    def report(self, what: str, *args) -> None:
        """A call of torch's observed stream or event methods: it begins here (its span starts, as
        ``CudaPlatform.suppressed()`` times it) and the recorder hears of it."""
        if self.recorder is not None:
            self._calls.t0 = time.perf_counter_ns()
            self.guard(getattr(self.recorder, what))(*args)

    def last_call(self) -> int | None:
        t0, self._calls.t0 = getattr(self._calls, "t0", None), None
        return t0

    def _tensor(self, shape, dtype) -> torch.Tensor:
        # a probe without storage: one with, made while recording, would be recorded as host memory
        # where the array may then land
        array = np.zeros(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
        self._keep.append(array)
        return torch.from_numpy(array)

    def device(self, *shape, dtype=torch.uint8) -> torch.Tensor:
        """Device memory (a caching-allocator block, as ``torch.empty(..., device="cuda")``)."""
        t = self._tensor(shape, dtype)
        storage = t.untyped_storage()
        self.device_storages.add(storage.data_ptr())
        self.blocks.append((storage.data_ptr(), storage.nbytes()))
        self.native("alloc", storage.data_ptr(), storage.nbytes(), 0, 0)
        return t

    def pinned(self, *shape, dtype=torch.uint8) -> torch.Tensor:
        """Pinned host memory (as ``torch.empty(..., pin_memory=True)``)."""
        t = self._tensor(shape, dtype)
        storage = t.untyped_storage()
        self.pinned_storages.add(storage.data_ptr())
        self.pinned_ranges.append((storage.data_ptr(), storage.nbytes()))
        return t

    def pageable(self, *shape, dtype=torch.uint8) -> torch.Tensor:
        return self._tensor(shape, dtype)

    def free(self, t: torch.Tensor) -> None:
        """The caching allocator takes the block back."""
        base = t.untyped_storage().data_ptr()
        self.blocks = [b for b in self.blocks if b[0] != base]
        self.native("free", base, 0, 0, 0)

    def native(self, kind: str, *fields: int, frames: tuple = (), when: tuple[int, int] | None = None) -> None:
        """What the extension's native log does on a GPU: a record of this thread's, taken later
        (the allocator's ``alloc`` / ``free``, native capture's driver calls, each of a call that
        ran in ``when``)."""
        if self.recorder is not None:
            self.native_rows[threading.get_ident()].append(NativeRecord(kind, list(fields), frames, when))

    def stream(self) -> FakeStream:
        return FakeStream(self)

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        """``with torch.cuda.stream(stream)``."""
        previous, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = previous

    def synchronize(self) -> None:
        self.report("device_synchronized")

    def witness_tools(self, internal) -> FakeTools:
        return FakeTools(self)


class FakeTools(DeviceTools):
    """A witness run's device side on the stand-in: holds, releases and markers go into
    ``calls`` (with the current stream's handle); every op has run at its call, so a held op
    runs in issue order anyway. What a witness run on the stand-in shows is that it finds the
    pair again, holds the first op's stream before the op, releases it, and reads back the bytes
    the pair wrote (all of them host memory here)."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.calls: list[tuple] = []
        fake.witness_calls = self.calls

    def hold(self, stream: int | None = None) -> None:
        self.calls.append(("hold", self.fake.current.handle if stream is None else stream))

    def release(self) -> None:
        self.calls.append(("release",))

    def mark(self, stream: int | None = None):
        self.calls.append(("mark", self.fake.current.handle if stream is None else stream))
        return lambda seconds: True

    def read(self, address: int, nbytes: int, device: bool) -> bytes:
        return ctypes.string_at(address, nbytes)

    def write(self, address: int, data: bytes, device: bool) -> None:
        ctypes.memmove(address, data, len(data))

    def back(self, address: int, nbytes: int):
        """The stand-in's memory stays where it was: only the calls are kept."""
        self.calls.append(("back", address, nbytes))
        return lambda: self.calls.append(("unback", address, nbytes))


_LIBRARIES: list = []


def swap_ops():
    """Two batched-swap ops under other namespaces, run on the host: ``kvtest::swap_blocks_batch``
    (kvverify's schema: found by its name) and ``engine::transfer`` (a serving engine's spelling,
    ``is_src_access_order_any``: found only when named with ``swap_ops=``). Defined once."""
    if not _LIBRARIES:
        def run(src, dst, sizes, *_):
            for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
                ctypes.memmove(d, s, n)

        for ns, schema in (("kvtest", "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
                                      "int src_access_order=1) -> ()"),
                           ("engine", "transfer(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
                                      "bool is_src_access_order_any) -> ()")):
            lib = torch.library.Library(ns, "DEF")
            lib.define(schema)
            lib.impl(schema.split("(")[0], run, "CompositeExplicitAutograd")
            _LIBRARIES.append(lib)
    return torch.ops.kvtest.swap_blocks_batch, torch.ops.engine.transfer


class DemoDevice:
    """``kvverify.record.demo.Cuda`` on the stand-in: the demo's engine runs on the CPU."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.swap = swap_ops()[0]

    def zeros(self, *shape: int, dtype=torch.uint8) -> torch.Tensor:
        return self.fake.device(*shape, dtype=dtype)

    def pinned(self, *shape: int, dtype=torch.uint8) -> torch.Tensor:
        return self.fake.pinned(*shape, dtype=dtype)

    def new_stream(self) -> FakeStream:
        return self.fake.stream()

    def new_event(self) -> FakeEvent:
        return self.fake.event()

    def stream(self, stream: FakeStream):
        return self.fake.use(stream)

    def synchronize(self) -> None:
        self.fake.synchronize()


def shared() -> FakeCuda:
    """One stand-in per process, for programs the tests run in-process (``kvverify record``,
    the pytest plugin) that cannot be handed an object."""
    if not SHARED:
        SHARED.append(FakeCuda())
    return SHARED[0]


class Lines:
    """A fake locator for a ``Recorder`` fed by hand: every op is issued at the next line of
    prog.py, in ``step``."""

    def __init__(self):
        self.line = 0

    def __call__(self, depth: int = 1):
        self.line += 1
        return f"prog.py:{self.line} in step"


def ptrs(*values) -> torch.Tensor:
    return torch.tensor([int(v) for v in values], dtype=torch.int64)


def race_kinds(rec) -> list[tuple[str, str, str]]:
    """``(kind, first op, second op)`` of each race a recording's check found."""
    doc = rec.trace()
    return [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
