"""The recorder's hooks into torch on a CUDA device (``CudaPlatform``).

What reports what:

- torch's caching allocator: every block handed out and every free asked for, from every thread,
  through the extension's native log (``kvverify.record.capture.native``: a trace tracker of
  ``CUDACachingAllocator``, kept in C++). The recorder takes this thread's records before
  anything it logs (``Recorder.collect``), so they land in program order;
- native capture (CUPTI, same log): the driver calls of every thread that neither the dispatcher
  nor the methods below see: kernels launched by Triton or pybind11 code, torch's own work
  outside ops, graph launches (``kvverify.record.capture.driver`` writes them). Where it cannot start
  (another CUPTI subscriber: Nsight Systems, torch.profiler), ``capture_off`` says why and the
  rest runs on;
- the methods that order work: ``record``, ``wait``, ``synchronize`` and ``query`` of
  ``torch.cuda.Event`` and of the device-generic ``torch.Event``; ``synchronize`` and ``query`` of
  the streams, the generic stream's ``wait_event``, ``wait_stream`` and ``record_event``;
  ``torch.cuda.synchronize``. Each is observed in its type's own dictionary (``patch_method``), so
  every event and stream stays exactly what it is (``type(e) is torch.Event``, ``elapsed_time``,
  pickling and torch's C++ type checks see no difference), and its result and exception are the
  original's;
- ``torch.cuda.cudart().cudaHostRegister`` / ``cudaHostUnregister`` are wrapped (registered host
  memory made through torch's cudart);
- everything else comes through the dispatcher (``kvverify.record.capture.dispatch``).

torch's GPU-trace hooks (``torch._C._activate_gpu_trace``, which PyTorch's CUDA Stream Sanitizer
uses) are not used: torch never turns them off, and they change the program's exceptions (C++
calls Python at a free during an op's unwinding, and the program sees a ``SystemError``).

Not seen, each only an ordering left out (a race reported, never one hidden): events and
synchronization inside an op of torch's dispatcher (a ``nonzero``'s stream synchronization), and
torch's pinned-allocator events, which the dispatcher hook writes for the copies it sees
(``Recorder.host_copy_fenced``).

Only threads the recording follows are recorded: reports from other threads are counted and left
out (``NOT_RECORDED``). Nothing is reported while the recorder reads pointer tensors back
(``internal``).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from kvverify.errors import RecordingError
from kvverify.record.capture.dispatch import RecordingPlatform
from kvverify.record.capture.native import NativeLog, cupti_library
from kvverify.record.capture.patching import patch_method
from kvverify.record.capture.threads import OTHER_THREAD_WORK
from kvverify.record.trace.recorder import DEFAULT_STREAMS, Recorder
from kvverify.terms import DEVICE_SPACE, HOST_SPACE


def _event_handle(event) -> int:
    """The CUDA event handle of a ``torch.cuda.Event`` or ``torch.Event`` (0: not made yet, as
    before its first record, or a CPU event)."""
    return int(event.cuda_event if hasattr(event, "cuda_event") else event.event_id)


def _argument(args: tuple, kwargs: dict, name: str):
    """The first argument after ``self``, given by position or as ``name`` (None: not given)."""
    return args[0] if args else kwargs.get(name)


class CudaPlatform(RecordingPlatform):
    """The platform of a live CUDA device through torch (``kvverify.record.capture.dispatch.RecordingPlatform``)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        from torch._subclasses.fake_tensor import FakeTensor

        self._tensor, self._fake = torch.Tensor, FakeTensor
        # the current stream's raw handle without making a Python stream object (torch's own codegen uses it)
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._current_device = torch.cuda.current_device
        self._undo: list[Callable[[], None]] = []
        self.log: NativeLog | None = None  # made by install()
        self.capture_off: str | None = "not installed"
        self.watch_off: str | None = "not installed"

    def where(self, t) -> str | None:
        if type(t) is not self._tensor and isinstance(t, self._fake):  # FakeTensorMode's: no memory behind it
            return None
        if t.is_cuda:
            return "device"
        return "host" if t.is_cpu else None

    def stream_key(self, t) -> object:
        device = t.get_device() if t is not None and t.is_cuda else self._current_device()
        if self._raw_stream is not None:
            handle = self._raw_stream(device)
        else:
            handle = self.torch.cuda.current_stream(device).cuda_stream
        return Recorder.stream_key(int(handle), device)

    def handle_key(self, handle: int) -> object:
        """A callback, or cuda-python, gives the handle alone: only the default streams need the device."""
        handle = int(handle)
        return Recorder.stream_key(handle, self._current_device() if handle in DEFAULT_STREAMS else None)

    def is_pinned(self, t) -> bool:
        return bool(t.is_pinned())

    def read_values(self, t) -> np.ndarray:
        return t.detach().to("cpu").contiguous().view(-1).numpy()

    def witness_tools(self, internal: Callable) -> CudaTools:
        """The device side of a witness run (``kvverify.record.confirm.witness``), its calls kept out of
        the recording through ``internal``."""
        return CudaTools(internal)

    def allocator_blocks(self) -> list[tuple[int, int]]:
        blocks = []
        for segment in self.torch.cuda.memory_snapshot():
            for b in segment.get("blocks", ()):
                if b.get("state") == "active_allocated":
                    blocks.append((int(b["address"]), int(b["size"])))
        return blocks

    def host_range(self, address: int) -> tuple[int, int, str] | None:
        from kvverify.device.cuda_python import pointer_range

        found = pointer_range(address)
        if found is None:
            return None
        kind, base, size = found
        space = {"host": HOST_SPACE["pinned"], "device": DEVICE_SPACE}.get(kind)
        return (base, size, space) if space else None

    # -- hooks ---------------------------------------------------------------------------------

    def install(self, recorder: Recorder, guard: Callable[[Callable], Callable], native: bool = True) -> None:
        """Start reporting to ``recorder``; ``guard`` wraps each report (thread and internal
        checks); ``native``: start native capture too (``capture_off`` says why it did not).
        Raises RecordingError where this torch lacks a method the recorder observes, or its
        caching allocator does not report to the extension's log."""
        torch = self.torch
        torch.cuda.init()  # the allocator attaches trackers to the devices it has set up
        self._current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        self.log = NativeLog()
        self._probe()
        self.log.enable(True)
        self._undo.append(lambda: self.log.enable(False))
        recorder.pending, recorder.take = self.log.pending, self.log.take
        recorder.stream_info = self.log.stream_info  # (the legacy default stream's implicit synchronization)
        self._observe_events(recorder, guard)
        self._observe_streams(recorder, guard)
        self._observe_device_sync(recorder, guard)
        self._wrap_host_register(recorder, guard)
        self.capture_off = self.log.start_capture(cupti_library()) if native else "not asked for"
        self._undo.append(self.log.stop_capture)
        # the host watch needs native capture: it learns of device work on host memory from the driver calls
        self.watch_off = "native capture is off"
        if self.capture_off is None:
            self.watch_off = self.log.watch.start()
            self._undo.append(self.log.watch.stop)

    def _probe(self) -> None:
        """Check that an allocation reaches the native log (it does not where torch uses another
        allocator): better one clear error than a trace without lifetimes."""
        log = self.log
        log.enable(True)
        try:
            self.torch.empty(1, device="cuda")
            seen = log.take(threading.get_ident())
        finally:
            log.enable(False)
        if not any(record.kind == "alloc" for record in seen):
            raise RecordingError(
                "torch's CUDA caching allocator did not report an allocation to kvverify's native log: "
                "record with torch's own caching allocator (unset PYTORCH_CUDA_ALLOC_CONF's backend, no "
                "CUDAPluggableAllocator)")

    def suppressed(self):
        return self.log.suppressed() if self.log is not None else contextlib.nullcontext()

    def last_call(self) -> int | None:
        return self.log.suppressed().last_call() if self.log is not None else None

    def on_graph_replay(self, report: Callable[[], None]) -> None:
        """Call ``report()`` as ``torch.cuda.CUDAGraph.replay`` is about to launch its graph (torch
        releases the GIL for the launch, where native capture cannot read the Python stack):
        observed on its C base in place."""
        base = getattr(self.torch._C, "_CUDAGraph", None)
        original = base.__dict__.get("replay") if base is not None else None
        if original is None:
            return

        def replay(graph, *args, **kwargs):
            report()
            return original(graph, *args, **kwargs)

        self._undo.append(patch_method(base, "replay", replay, original))

    def on_launch(self, report: Callable[[int], None]) -> None:
        """Call ``report(function)`` as Triton is about to launch a kernel (its launch-enter hook,
        on the launching thread, with the GIL): Triton launches with the GIL released, where
        native capture cannot read the Python stack, so the launch is located here."""
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without knobs (before 3.3): its launches are not located
            return
        chain = getattr(knobs.runtime, "launch_enter_hook", None)

        def hook(metadata) -> None:
            # Triton's LazyDict: its ready part, without running the kernel's own metadata function
            data = getattr(metadata, "data", metadata)
            function = data.get("function") if isinstance(data, dict) else None
            if function is not None:
                report(int(function))

        if hasattr(chain, "add"):  # a HookChain (3.5 and later)
            chain.add(hook)
            self._undo.append(lambda: chain.remove(hook))
        else:  # one callable, or None: ours calls the program's
            def chained(metadata, previous=chain) -> None:
                hook(metadata)
                if previous is not None:
                    previous(metadata)
            knobs.runtime.launch_enter_hook = chained
            self._undo.append(lambda: setattr(knobs.runtime, "launch_enter_hook", chain))

    def function_name(self, function: int) -> str:
        return self.log.function_name(function)

    def _patch(self, cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
        """Observe ``cls.<name>`` in place: ``make(original)`` returns the method to put there."""
        original = cls.__dict__[name]
        self._undo.append(patch_method(cls, name, make(original), original))

    def _observe_events(self, recorder: Recorder, guard) -> None:
        """``record``, ``wait``, ``synchronize`` and ``query`` of ``torch.cuda.Event`` (its C base
        ``torch._C._CudaEventBase``) and of the device-generic ``torch.Event``, in their types' own
        dictionaries: every event stays exactly what it was."""
        quiet = self.suppressed  # native capture leaves what these report to them
        torch = self.torch
        created, recorded = guard(recorder.event_created), guard(recorder.event_recorded)
        waited, synchronized = guard(recorder.event_waited), guard(recorder.event_synchronized)
        queried = guard(recorder.event_queried)
        stream_of = self._stream_or_current

        def record(original):
            def method(event, *args, **kwargs):
                before = _event_handle(event)
                with quiet():
                    result = original(event, *args, **kwargs)
                handle = _event_handle(event)
                if handle:  # a CPU event has none
                    if handle != before:  # torch makes the CUDA event at its first record
                        created(handle)
                    recorded(handle, stream_of(_argument(args, kwargs, "stream"), event))
                return result
            return method

        def wait(original):
            def method(event, *args, **kwargs):
                with quiet():
                    result = original(event, *args, **kwargs)
                handle = _event_handle(event)
                if handle:  # never recorded: the wait orders nothing, in CUDA as in the trace
                    waited(handle, stream_of(_argument(args, kwargs, "stream"), event))
                return result
            return method

        def synchronize(original):
            def method(event):
                with quiet():
                    result = original(event)
                handle = _event_handle(event)
                if handle:
                    synchronized(handle)
                return result
            return method

        def query(original):
            def method(event):
                with quiet():
                    result = original(event)
                handle = _event_handle(event)
                if handle:  # 0: never recorded, nothing to order (and no handle to name it by)
                    queried(handle, result)
                return result
            return method

        for cls in (torch._C._CudaEventBase, torch.Event):
            for name, make in (("record", record), ("wait", wait), ("synchronize", synchronize), ("query", query)):
                self._patch(cls, name, make)

    def _observe_streams(self, recorder: Recorder, guard) -> None:
        """``synchronize`` and ``query`` of ``torch.cuda.Stream`` (its C base) and of the generic
        ``torch.Stream``, and the generic stream's own ``wait_event``, ``wait_stream`` and
        ``record_event`` (``torch.cuda.Stream``'s are Python, made of the event methods above)."""
        quiet = self.suppressed  # native capture leaves what these report to them
        torch = self.torch
        key = self.stream_key_of
        synchronized, queried = guard(recorder.stream_synchronized), guard(recorder.stream_queried)
        created, recorded = guard(recorder.event_created), guard(recorder.event_recorded)
        waited, stream_waited = guard(recorder.event_waited), guard(recorder.stream_waited)

        def synchronize(original):
            def method(stream):
                with quiet():
                    result = original(stream)
                synchronized(key(stream))
                return result
            return method

        def query(original):
            def method(stream):
                with quiet():
                    result = original(stream)
                queried(key(stream), result)
                return result
            return method

        def wait_event(original):
            def method(stream, event):
                with quiet():
                    result = original(stream, event)
                handle = _event_handle(event)
                if handle:
                    waited(handle, key(stream))
                return result
            return method

        def wait_stream(original):
            def method(stream, other):
                with quiet():
                    result = original(stream, other)
                stream_waited(key(stream), key(other))
                return result
            return method

        def record_event(original):
            def method(stream, *args, **kwargs):
                given = _argument(args, kwargs, "event")
                before = _event_handle(given) if given is not None else 0
                with quiet():
                    event = original(stream, *args, **kwargs)
                handle = _event_handle(event)
                if handle:
                    if handle != before:
                        created(handle)
                    recorded(handle, key(stream))
                return event
            return method

        for cls in (torch._C._CudaStreamBase, torch.Stream):
            self._patch(cls, "synchronize", synchronize)
            self._patch(cls, "query", query)
        for name, make in (("wait_event", wait_event), ("wait_stream", wait_stream), ("record_event", record_event)):
            self._patch(torch.Stream, name, make)

    def _observe_device_sync(self, recorder: Recorder, guard) -> None:
        """``torch.cuda.synchronize`` and ``torch.accelerator.synchronize`` call these functions of
        ``torch._C`` at each call: replaced on the module while recording."""
        quiet = self.suppressed  # native capture leaves what these report to them
        module = self.torch._C
        report = guard(recorder.device_synchronized)
        for name in ("_cuda_synchronize", "_accelerator_synchronizeDevice"):
            original = getattr(module, name, None)
            if original is None:
                continue

            def synchronize(*args, original=original, **kwargs):
                with quiet():
                    result = original(*args, **kwargs)
                report()
                return result

            synchronize.__name__, synchronize.__doc__ = name, original.__doc__
            setattr(module, name, synchronize)
            self._undo.append(lambda name=name, original=original: setattr(module, name, original))

    def _stream_or_current(self, stream, event) -> object:
        """The key of ``stream``, or of the current stream of ``event``'s device where it is None
        (as ``Event.record()`` and ``wait()`` default)."""
        if stream is not None:
            return self.stream_key_of(stream)
        device = getattr(event, "device", None)
        index = getattr(device, "index", None)
        if index is None:
            index = self._current_device()
        handle = self._raw_stream(index) if self._raw_stream is not None else self.torch.cuda.current_stream(index).cuda_stream
        return Recorder.stream_key(int(handle), index)

    def stream_key_of(self, stream) -> object:
        """The key of a ``torch.cuda.Stream``, or of a device-generic ``torch.Stream`` (what the
        dispatcher hands ``aten::record_stream``), which has no raw handle of its own."""
        if not hasattr(stream, "cuda_stream"):
            stream = self.torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                            device_type=stream.device_type)
        device = stream.device_index if stream.device_index is not None else self._current_device()
        return Recorder.stream_key(int(stream.cuda_stream), device)

    def _wrap_host_register(self, recorder: Recorder, guard) -> None:
        quiet = self.suppressed  # native capture leaves what these report to them
        try:
            module = self.torch.cuda.cudart()
        except Exception:  # no CUDA runtime module in this torch build: nothing to wrap
            return
        if not hasattr(module, "cudaHostRegister"):
            return
        register, unregister = module.cudaHostRegister, module.cudaHostUnregister

        def learn(ptr, size):
            recorder.allocated(int(ptr), int(size), HOST_SPACE["registered"], "cudaHostRegister (torch cudart)",
                               recorder.locate())

        def release(ptr):
            # as kvverify's own host_unregister: the release orders nothing, device work still on
            # the bytes races with it (a free of the whole registration)
            released = recorder.memory.retire(int(ptr))
            if released is not None:
                recorder.released([(released.index, 0, released.size)], "cudaHostUnregister (torch cudart)",
                                  recorder.locate())

        learn_guarded, retire_guarded = guard(learn), guard(release)

        def host_register(ptr, size, flags):
            with quiet():
                result = register(ptr, size, flags)
            if int(result) == 0:
                learn_guarded(ptr, size)
            return result

        def host_unregister(ptr):
            retire_guarded(ptr)
            with quiet():
                return unregister(ptr)

        module.cudaHostRegister, module.cudaHostUnregister = host_register, host_unregister
        self._undo.append(lambda: (setattr(module, "cudaHostRegister", register),
                                   setattr(module, "cudaHostUnregister", unregister)))

    def native_leftover(self) -> Counter:
        return self.log.leftover()

    @property
    def host_watch(self):
        """The running ``kvverify.record.capture.watch.HostWatch``, or None (``watch_off`` says why)."""
        return self.log.watch if self.log is not None and self.watch_off is None else None

    def op_log(self):
        return self.log.op_log() if self.log is not None else None

    def uninstall(self) -> None:
        """Undo ``install`` (idempotent)."""
        while self._undo:
            with contextlib.suppress(Exception):
                self._undo.pop()()


class CudaTools:
    """``kvverify.record.confirm.witness.DeviceTools`` on the current CUDA device: holds through
    ``kvverify.device.gate.StreamGate``, markers as events, reads and writes of raw addresses
    through the driver on a stream of its own that no other stream waits for (``CU_STREAM_NON_BLOCKING``:
    a read while the program's stream is held must not wait for it)."""

    def __init__(self, internal: Callable) -> None:
        import torch
        from cuda.bindings import driver

        from kvverify.device.gate import StreamGate

        self.torch, self.driver, self._internal = torch, driver, internal
        with internal():
            self.gate = StreamGate(torch.device("cuda", torch.cuda.current_device()), deadline_s=30.0)
            err, self.stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        self._check(err, "cuStreamCreate")

    def _check(self, err, what: str) -> None:
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RecordingError(f"witness run: {what} failed: {err}")

    def _stream(self, handle: int | None):
        cuda = self.torch.cuda
        return cuda.current_stream() if handle is None else cuda.ExternalStream(handle)

    def hold(self, stream: int | None = None) -> None:
        with self._internal():
            self.gate.hold(self._stream(stream))

    def release(self) -> None:
        self.gate.release_all()

    def expired(self) -> int:
        return self.gate.expired

    def mark(self, stream: int | None = None) -> Callable[[float], bool]:
        with self._internal():
            event = self.torch.cuda.Event()
            event.record(self._stream(stream))

        def wait(seconds: float) -> bool:
            deadline = time.monotonic() + seconds
            with self._internal():
                while not event.query():
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.0005)
            return True

        return wait

    def read(self, address: int, nbytes: int, device: bool) -> bytes:
        if not device:
            return ctypes.string_at(address, nbytes)
        d = self.driver
        out = np.empty(nbytes, dtype=np.uint8)
        with self._internal():
            (err,) = d.cuMemcpyDtoHAsync(out.ctypes.data, d.CUdeviceptr(address), nbytes, self.stream)
            self._check(err, "cuMemcpyDtoHAsync")
            self._check(d.cuStreamSynchronize(self.stream)[0], "cuStreamSynchronize")
        return out.tobytes()

    def write(self, address: int, data: bytes, device: bool) -> None:
        if not device:
            ctypes.memmove(address, data, len(data))
            return
        d = self.driver
        buffer = np.frombuffer(data, dtype=np.uint8)
        with self._internal():
            (err,) = d.cuMemcpyHtoDAsync(d.CUdeviceptr(address), buffer.ctypes.data, len(data), self.stream)
            self._check(err, "cuMemcpyHtoDAsync")
            self._check(d.cuStreamSynchronize(self.stream)[0], "cuStreamSynchronize")

    def back(self, address: int, nbytes: int) -> Callable[[], None]:
        # the virtual memory calls a sleep-capable allocator makes to wake (CUDA Driver API, Virtual
        # Memory Management: cuMemCreate, cuMemMap, cuMemSetAccess)
        d = self.driver
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.torch.cuda.current_device()
        access = d.CUmemAccessDesc()
        access.location.type = prop.location.type
        access.location.id = prop.location.id
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        with self._internal():
            err, handle = d.cuMemCreate(nbytes, prop, 0)
            self._check(err, f"cuMemCreate of {nbytes:,} bytes for the unmapped range at {address:#x}")
            (err,) = d.cuMemMap(d.CUdeviceptr(address), nbytes, 0, handle, 0)
            if err == d.CUresult.CUDA_SUCCESS:
                (err,) = d.cuMemSetAccess(d.CUdeviceptr(address), nbytes, [access], 1)
                if err != d.CUresult.CUDA_SUCCESS:
                    d.cuMemUnmap(d.CUdeviceptr(address), nbytes)
            if err != d.CUresult.CUDA_SUCCESS:
                d.cuMemRelease(handle)
                self._check(err, f"mapping {nbytes:,} bytes at the unmapped range {address:#x}")

        def undo() -> None:
            with self._internal():
                self._check(d.cuMemUnmap(d.CUdeviceptr(address), nbytes)[0], f"cuMemUnmap at {address:#x}")
                self._check(d.cuMemRelease(handle)[0], "cuMemRelease")

        return undo

    def close(self) -> None:
        self.gate.close()
        self.driver.cuStreamDestroy(self.stream)


def thread_guard(recorder: Recorder, busy: Callable[[], bool], replayer=None,
                 last_call: Callable[[], int | None] = lambda: None) -> Callable[[Callable], Callable]:
    """A ``guard`` for ``install``: the wrapped callback runs on the threads ``recorder`` follows
    (``Recorder.threads``), unless ``busy()`` (the recorder's own work on that thread), holding the
    recorder; calls from other threads are noted as missed work (``NOT_RECORDED``). While
    ``replayer`` (``kvverify.record.capture.oplog.Replayer``) logs the ops of the calling thread,
    the reports of ``DEFERRED`` go into its log instead, located now, and run when it is replayed.
    ``last_call()``: when the call the report is of began (the platform's ``suppressed()`` timed
    it; None: not known); the ops it logs ran from then to now (``Recorder.when``)."""

    def guard(fn: Callable) -> Callable:
        deferrable = replayer is not None and getattr(fn, "__name__", None) in DEFERRED
        located = deferrable and "at" in inspect.signature(fn).parameters

        def cb(*args):
            ident = threading.get_ident()
            if ident not in recorder.threads:
                with recorder.exclusive():
                    recorder.notes[f"{OTHER_THREAD_WORK} torch's stream, event and allocator reports from thread "
                                   f"{threading.current_thread().name!r}"] += 1
                return None
            if busy():
                return None
            t0 = last_call()
            when = None if t0 is None else (t0, time.perf_counter_ns())
            if deferrable and replayer.on and ident == replayer.thread:
                replayer.defer(fn, args, {"at": recorder.locate()} if located else {}, when)
                return None
            with recorder.exclusive():
                recorder.collect()  # what the native log holds of this thread happened before
                recorder.when(when)
                try:
                    return fn(*args)
                finally:
                    recorder.when(None)

        return cb

    return guard


DEFERRED = frozenset(("event_created", "event_recorded", "event_waited", "event_synchronized", "event_queried",
                      "stream_synchronized", "stream_queried", "stream_waited", "device_synchronized"))
"""The recorder's reports that the op log holds until it is replayed: those an engine's loop makes at
every transfer, which return nothing the caller uses."""
