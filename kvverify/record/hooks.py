"""The recorder's hooks into torch on a CUDA device (``CudaPlatform``).

What reports what:

- torch's GPU-trace callbacks (``torch.cuda._gpu_trace``, which PyTorch's CUDA Stream Sanitizer
  uses; C++ calls them once ``torch._C._activate_gpu_trace()`` ran): event creation, deletion,
  record, wait and synchronize, for ``torch.cuda.Event`` and the device-generic ``torch.Event``
  alike; stream synchronize (also the one inside a blocking copy); device synchronize; the caching
  allocator's allocations and frees;
- ``Event.query()`` reports nothing to those callbacks, so ``torch.cuda.Event.query`` and
  ``torch.cuda.Stream.query`` are wrapped while recording, and so is ``torch.Event.query``: a type
  defined in C, whose method is replaced in the type's own dictionary (``patch_method``), so that
  every event stays exactly a ``torch.Event`` (``type(e) is torch.Event``, ``elapsed_time``,
  pickling and torch's C++ type checks see no difference);
- ``torch.cuda.cudart().cudaHostRegister`` / ``cudaHostUnregister`` are wrapped (registered host
  memory made through torch's cudart);
- everything else comes through the dispatcher (``kvverify.record.dispatch``).

Only the recording thread is recorded (the trace format is one host thread's program order):
callbacks from other threads are counted and left out. Nothing is reported while the recorder
reads pointer tensors back (``internal``).

torch offers no way to turn the GPU-trace callbacks off again: after a recording, each CUDA event
and stream operation still calls into Python once, to find no callback (a few microseconds).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import numpy as np

from kvverify.errors import RecordingError
from kvverify.record.dispatch import Platform
from kvverify.record.patching import patch_method
from kvverify.record.recorder import DEFAULT_STREAMS, Recorder
from kvverify.record.threads import OTHER_THREAD_WORK
from kvverify.terms import DEVICE_SPACE, HOST_SPACE


class CudaPlatform(Platform):
    """The platform of a live CUDA device through torch (``kvverify.record.dispatch.Platform``)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        # the current stream's raw handle without making a Python stream object (torch's own codegen uses it)
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._current_device = torch.cuda.current_device
        self._undo: list[Callable[[], None]] = []

    def where(self, t) -> str | None:
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

    def install(self, recorder: Recorder, guard: Callable[[Callable], Callable]) -> None:
        """Start reporting to ``recorder``; ``guard`` wraps each callback (thread and internal
        checks). Raises RecordingError where this torch lacks the hooks."""
        torch = self.torch
        activate = getattr(torch._C, "_activate_gpu_trace", None)
        try:
            import torch.cuda._gpu_trace as gpu_trace
        except ImportError:
            gpu_trace = None
        if activate is None or gpu_trace is None:
            raise RecordingError(
                f"torch {torch.__version__} has no GPU-trace callbacks (torch._C._activate_gpu_trace, "
                "torch.cuda._gpu_trace; PyTorch's CUDA Stream Sanitizer needs them too): record with torch >= 2.1")
        activate()
        self._probe(gpu_trace)
        # CUDA is initialised now (the probe recorded an event): torch.cuda.current_device would
        # check that again at every call
        self._current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        key = self.handle_key
        try:
            callbacks = (
                (gpu_trace.EventCreationCallbacks, recorder.event_created),
                (gpu_trace.EventDeletionCallbacks, recorder.event_deleted),
                (gpu_trace.EventRecordCallbacks, lambda e, s: recorder.event_recorded(e, key(s))),
                (gpu_trace.EventWaitCallbacks, lambda e, s: recorder.event_waited(e, key(s))),
                (gpu_trace.EventSynchronizationCallbacks, recorder.event_synchronized),
                (gpu_trace.StreamSynchronizationCallbacks, lambda s: recorder.stream_synchronized(key(s))),
                (gpu_trace.DeviceSynchronizationCallbacks, recorder.device_synchronized),
                (gpu_trace.MemoryAllocationCallbacks, recorder.memory_allocated),
                (gpu_trace.MemoryDeallocationCallbacks, recorder.memory_freed),
            )
        except AttributeError as exc:
            raise RecordingError(f"torch {torch.__version__}'s torch.cuda._gpu_trace lacks a callback registry the "
                                 f"recorder needs ({exc})") from None
        for registry, fn in callbacks:
            cb = guard(fn)
            registry.callback_list.append(cb)
            self._undo.append(lambda registry=registry, cb=cb: registry.callback_list.remove(cb))
        self._wrap_queries(recorder, guard)
        self._wrap_host_register(recorder, guard)

    def _probe(self, gpu_trace) -> None:
        """Check that recording an event reaches the callbacks (it does not on a torch whose C++
        was built without them): better one clear error than a trace without synchronization."""
        seen = []

        def probe(*args) -> None:  # called as (event, stream)
            seen.append(args)
        gpu_trace.EventRecordCallbacks.callback_list.insert(0, probe)
        try:
            self.torch.cuda.Event().record()
        finally:
            gpu_trace.EventRecordCallbacks.callback_list.remove(probe)
        if not seen:
            raise RecordingError(
                f"torch {self.torch.__version__} did not report an event record to torch.cuda._gpu_trace: "
                "the recorder cannot see streams and events with this torch")

    def _wrap_queries(self, recorder: Recorder, guard) -> None:
        torch = self.torch
        report_event = guard(recorder.event_queried)
        report_stream = guard(lambda key, result: recorder.stream_queried(key, result))

        def wrap_method(cls, name: str, report: Callable) -> None:
            own = cls.__dict__.get(name)  # defined by the class itself, or inherited (put back by deleting ours)
            original = own if own is not None else getattr(cls, name)

            def query(obj):
                result = original(obj)
                report(obj, result)
                return result

            query.__doc__ = original.__doc__
            setattr(cls, name, query)
            self._undo.append(lambda: setattr(cls, name, own) if own is not None else delattr(cls, name))

        def event_handle(e) -> int:
            return int(e.cuda_event if hasattr(e, "cuda_event") else e.event_id)

        def report_query(e, result) -> None:
            handle = event_handle(e)
            if handle:  # 0: never recorded, nothing to order (and no handle to name it by)
                report_event(handle, result)

        wrap_method(torch.cuda.Event, "query", report_query)
        wrap_method(torch.cuda.Stream, "query", lambda s, r: report_stream(self.stream_key_of(s), r))
        generic = getattr(torch, "Event", None)
        if isinstance(generic, type) and hasattr(generic, "event_id"):
            original = generic.__dict__["query"]

            def query(event):
                result = original(event)
                report_query(event, result)
                return result

            try:
                self._undo.append(patch_method(generic, "query", query, original))
            except RecordingError as exc:
                # unseen true answers only leave orderings out: more races reported, none missed
                recorder.notes[f"torch.Event.query() answers not seen, written as not complete ({exc})"] += 1

    def stream_key_of(self, stream) -> object:
        """The key of a ``torch.cuda.Stream``, or of a device-generic ``torch.Stream`` (what the
        dispatcher hands ``aten::record_stream``), which has no raw handle of its own."""
        if not hasattr(stream, "cuda_stream"):
            stream = self.torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                            device_type=stream.device_type)
        device = stream.device_index if stream.device_index is not None else self._current_device()
        return Recorder.stream_key(int(stream.cuda_stream), device)

    def _wrap_host_register(self, recorder: Recorder, guard) -> None:
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
            result = register(ptr, size, flags)
            if int(result) == 0:
                learn_guarded(ptr, size)
            return result

        def host_unregister(ptr):
            retire_guarded(ptr)
            return unregister(ptr)

        module.cudaHostRegister, module.cudaHostUnregister = host_register, host_unregister
        self._undo.append(lambda: (setattr(module, "cudaHostRegister", register),
                                   setattr(module, "cudaHostUnregister", unregister)))

    def uninstall(self) -> None:
        """Undo ``install`` (the GPU-trace callbacks stay active in torch, calling nothing)."""
        while self._undo:
            with contextlib.suppress(Exception):
                self._undo.pop()()


def thread_guard(recorder: Recorder, busy: Callable[[], bool]) -> Callable[[Callable], Callable]:
    """A ``guard`` for ``install``: the wrapped callback runs on the threads ``recorder`` follows
    (``Recorder.threads``), unless ``busy()`` (the recorder's own work on that thread), holding the
    recorder; calls from other threads are noted as missed work (``NOT_RECORDED``)."""

    def guard(fn: Callable) -> Callable:
        def cb(*args):
            if threading.get_ident() not in recorder.threads:
                with recorder.exclusive():
                    recorder.notes[f"{OTHER_THREAD_WORK} torch's stream, event and allocator reports from thread "
                                   f"{threading.current_thread().name!r}"] += 1
                return None
            if busy():
                return None
            with recorder.exclusive():
                return fn(*args)

        return cb

    return guard
