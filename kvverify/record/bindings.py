"""Device and host work that bypasses torch, seen where Python calls it: cuda-python's driver API
and the operating system's vectored reads.

Serving engines issue KV transfers through cuda-python on raw stream handles (an engine's CPU
offload connector calls ``cuMemcpyBatchAsync`` from a copy thread: vllm-project/vllm#45704) and read
offloaded KV from disk into pinned slots with ``os.preadv`` (vllm-project/vllm#51667). Neither
reaches torch's dispatcher or the methods the recorder observes. While a recording runs, the functions of
``cuda.bindings.driver`` below and ``os.preadv`` / ``os.readv`` are replaced on their modules by
wrappers that call them and then log what they did, on the calling thread if the recording follows
it (``kvverify.record.threads``), else as missed work:

- ``cuMemcpyBatchAsync``: a ``copy_batch`` per attribute group, in its ``srcAccessOrder``;
  ``cuMemcpyAsync`` and the ``cuMemcpy{HtoD,DtoH,DtoD}Async`` family: a ``copy``;
- ``cuEventCreate`` / ``cuEventDestroy`` (a handle made again is a new event),
  ``cuEventRecord[WithFlags]``, ``cuStreamWaitEvent``, ``cuEventSynchronize``, ``cuEventQuery``
  (with its answer), ``cuStreamSynchronize``, ``cuCtxSynchronize``;
- ``cuMemMap``: device memory there from now on; ``cuMemUnmap``: a ``free`` of the range;
- ``os.preadv`` / ``os.readv``: a ``host_write`` of the bytes the call read into its buffers.

What a program bound before the recording (``from cuda.bindings.driver import cuMemcpyAsync``)
calls directly, the runtime API, and kernels launched through cuda-python are not seen here:
native capture (CUPTI) is what sees every call.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from kvverify.record.recorder import CopyArrays, Recorder
from kvverify.record.threads import busy
from kvverify.terms import DEVICE_SPACE, SrcAccessOrder

DRIVER_CALLS = ("cuMemcpyBatchAsync", "cuMemcpyAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync",
                "cuEventCreate", "cuEventDestroy", "cuEventRecord", "cuEventRecordWithFlags", "cuStreamWaitEvent",
                "cuEventSynchronize", "cuEventQuery", "cuStreamSynchronize", "cuCtxSynchronize", "cuMemMap",
                "cuMemUnmap")


def _int(handle) -> int:
    """The integer behind a cuda-python handle (``CUstream``, ``CUevent``, ``CUdeviceptr``: each
    converts to its value) or an int."""
    return int(handle)


def _host_pointer(ptr) -> int:
    """The address cuda-python passes for a host pointer argument (``srcHost``, ``dstHost``: an
    int, or any object with the buffer protocol, whose data's address it takes: a numpy array of
    one element is its address, not its value), decoded by cuda-python's own helper."""
    try:
        from cuda.bindings.driver import _HelperInputVoidPtr
    except ImportError:  # a cuda-python without the helper: ints, and buffers by their address
        if ptr is None:
            return 0
        if isinstance(ptr, int):
            return ptr
        import numpy as np

        return int(np.frombuffer(memoryview(ptr).cast("B"), dtype=np.uint8).ctypes.data)
    return int(_HelperInputVoidPtr(ptr).cptr)


def _ok(result) -> bool:
    """Whether a cuda-python call succeeded: its first return value is ``CUDA_SUCCESS`` (0)."""
    status = result[0] if isinstance(result, tuple) else result
    return int(status) == 0


class Bindings:
    """The wrappers of one recording (see the module docstring).

    ``recorder``: where ops go; ``mode``: the recording's ``RecordingMode`` (its pointer
    resolution); ``follows``: whether this thread is recorded (else its work is noted as missed,
    through ``missed(what)``); ``stream_key``: ``(handle) -> Recorder stream key`` for the current
    device."""

    def __init__(self, recorder: Recorder, mode, follows: Callable[[], bool], missed: Callable[[str], None],
                 stream_key: Callable[[int], object]) -> None:
        self.rec = recorder
        self.mode = mode
        self.follows = follows
        self.missed = missed
        self.stream_key = stream_key
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        """Replace the functions on their modules (the ones this Python has)."""
        try:
            from cuda.bindings import driver
        except ImportError:  # no cuda-python: nothing of it to see
            driver = None
        if driver is not None:
            for name in DRIVER_CALLS:
                original = getattr(driver, name, None)
                if original is not None:
                    self._replace(driver, name, self._wrap(name, original, getattr(self, "_" + name)))
        for name in ("preadv", "readv"):
            original = getattr(os, name, None)
            if original is not None:
                self._replace(os, name, self._wrap(name, original, self._read_into))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _replace(self, module, name: str, fn) -> None:
        original = getattr(module, name)
        setattr(module, name, fn)
        self._undo.append(lambda: setattr(module, name, original))

    def _wrap(self, name: str, original, log: Callable) -> Callable:
        bindings = self

        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            if busy():  # the recorder's own call
                return result
            if bindings.follows():
                at = bindings.rec.locate()
                with bindings.rec.exclusive():
                    try:
                        log(name, args, kwargs, result, at)
                    except Exception as exc:  # the program runs on: the summary says what is missing
                        from kvverify.record.dispatch import RECORDER_ERROR

                        bindings.rec.notes[f"{RECORDER_ERROR} {name}: {type(exc).__name__}: {exc}"] += 1
            else:
                bindings.missed(f"cuda-python {name}" if name in DRIVER_CALLS else f"os.{name}")
            return result

        call.__name__ = call.__qualname__ = name
        call.__doc__ = getattr(original, "__doc__", None)
        call.__wrapped__ = original
        return call

    # -- cuda-python ---------------------------------------------------------------------------

    def _cuMemcpyBatchAsync(self, name, args, kwargs, result, at) -> None:
        if not _ok(result):
            return
        import numpy as np

        dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream = args[:8]
        count = int(count)
        dst = np.array([_int(p) for p in list(dsts)[:count]], dtype=np.int64)
        src = np.array([_int(p) for p in list(srcs)[:count]], dtype=np.int64)
        size = np.array([int(n) for n in list(sizes)[:count]], dtype=np.int64)
        s_index, s_offset, d_index, d_offset = self.mode.resolve_both(src, dst, size, at)
        starts = [int(i) for i in list(attr_idxs)[:int(num_attrs)]] + [count]
        for k, attr in enumerate(list(attrs)[:int(num_attrs)]):
            group = slice(starts[k], starts[k + 1])
            order = SrcAccessOrder(int(attr.srcAccessOrder)).name
            self.rec.copy_batch(self.stream_key(_int(stream)), f"cuda-python {name}", order,
                                CopyArrays(s_index[group], s_offset[group], d_index[group], d_offset[group],
                                           size[group]), at)

    def _copy(self, dst, src, nbytes, stream, name, at) -> None:
        import numpy as np

        size = np.array([int(nbytes)], dtype=np.int64)
        # the host side of HtoD / DtoH is any host pointer cuda-python accepts
        src = _host_pointer(src) if name == "cuMemcpyHtoDAsync" else _int(src)
        dst = _host_pointer(dst) if name == "cuMemcpyDtoHAsync" else _int(dst)
        s_index, s_offset, d_index, d_offset = self.mode.resolve_both(
            np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64), size, at)
        n = int(nbytes)
        self.rec.copy(self.stream_key(_int(stream)), f"cuda-python {name}", (int(s_index[0]), int(s_offset[0]), n),
                      (int(d_index[0]), int(d_offset[0]), n), at)

    def _cuMemcpyAsync(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            dst, src, nbytes, stream = args[:4]
            self._copy(dst, src, nbytes, stream, name, at)

    _cuMemcpyHtoDAsync = _cuMemcpyDtoHAsync = _cuMemcpyDtoDAsync = _cuMemcpyAsync

    def _cuEventCreate(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_created(_int(result[1]))

    def _cuEventDestroy(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_deleted(_int(args[0]))

    def _cuEventRecord(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_recorded(_int(args[0]), self.stream_key(_int(args[1])))

    _cuEventRecordWithFlags = _cuEventRecord

    def _cuStreamWaitEvent(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_waited(_int(args[1]), self.stream_key(_int(args[0])))

    def _cuEventSynchronize(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_synchronized(_int(args[0]))

    def _cuEventQuery(self, name, args, kwargs, result, at) -> None:
        # CUDA_SUCCESS: complete; CUDA_ERROR_NOT_READY: not yet (an answer too); anything else: no answer
        status = int(result[0] if isinstance(result, tuple) else result)
        if status in (0, 600):
            self.rec.event_queried(_int(args[0]), status == 0)

    def _cuStreamSynchronize(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.stream_synchronized(self.stream_key(_int(args[0])))

    def _cuCtxSynchronize(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.device_synchronized()

    def _cuMemMap(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.allocated(_int(args[0]), int(args[1]), DEVICE_SPACE, f"cuda-python {name}", at)

    def _cuMemUnmap(self, name, args, kwargs, result, at) -> None:
        if not _ok(result):
            return
        base, nbytes = _int(args[0]), int(args[1])
        end = base + nbytes
        memory = self.rec.memory
        # the range may cover several mappings (and bytes the recording never learnt of): a free of
        # each part where it lies, so that device work on any of them races with the unmap
        spans, cursor = [], base
        mapped = memory.overlapping(base, end)
        for a in mapped:
            lo, hi = max(a.base, base), min(a.end, end)
            if lo > cursor:
                spans.append(memory.unresolved_span(cursor, lo - cursor, "lies in no allocation the recording knows", at))
            spans.append((a.index, lo - a.base, hi - lo))
            cursor = hi
        if cursor < end:
            spans.append(memory.unresolved_span(cursor, end - cursor, "lies in no allocation the recording knows", at))
        self.rec.released(spans, f"cuda-python {name}", at)
        for a in mapped:
            if not a.placeholder:
                memory.retire(a.base)

    # -- the operating system ------------------------------------------------------------------

    def _read_into(self, name, args, kwargs, result, at) -> None:
        """``os.preadv(fd, buffers, offset)`` / ``os.readv(fd, buffers)`` returned ``result`` bytes,
        written into ``buffers`` in order."""
        left = int(result)
        spans = []
        for buffer in args[1]:
            if left <= 0:
                break
            view = memoryview(buffer).cast("B")
            n = min(left, view.nbytes)
            spans.append(self.mode.host_span(ctypes.addressof(ctypes.c_char.from_buffer(view)), n, at))
            left -= n
        self.rec.host_access("host_write", spans, f"os.{name}", at)
