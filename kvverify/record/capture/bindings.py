"""Device and host work that bypasses torch, seen where Python calls it: cuda-python's driver API
and the operating system's vectored reads.

Serving engines issue KV transfers through cuda-python on raw stream handles (an engine's CPU
offload connector calls ``cuMemcpyBatchAsync`` from a copy thread: vllm-project/vllm#45704) and read
offloaded KV from disk into pinned slots with ``os.preadv`` (vllm-project/vllm#51667). Neither
reaches torch's dispatcher or the methods the recorder observes. While a recording runs, the functions of
``cuda.bindings.driver`` below and ``os.preadv`` / ``os.readv`` are replaced on their modules by
wrappers that call them and then log what they did, on the calling thread if the recording follows
it (``kvverify.record.capture.threads``), else as missed work:

- ``cuMemcpyBatchAsync``, ``cuMemcpyAsync`` and the ``cuMemcpy{HtoD,DtoH,DtoD}Async`` family,
  ``cuEventCreate`` / ``cuEventDestroy`` (a handle made again is a new event),
  ``cuEventRecord[WithFlags]``, ``cuStreamWaitEvent``, ``cuEventSynchronize``, ``cuEventQuery``
  (with its answer), ``cuStreamSynchronize``, ``cuCtxSynchronize``, ``cuMemMap``, ``cuMemUnmap``:
  as ``kvverify.record.capture.driver`` writes them, located at the Python line that called them;
- ``os.preadv`` / ``os.readv``: a ``host_write`` of the bytes the call read into its buffers;
  ``os.write`` / ``pwrite`` / ``writev`` / ``pwritev``: a ``host_read`` of the bytes they wrote
  from pinned or registered memory. The host watch (``kvverify.record.capture.watch``) opens their
  buffers for the call: the kernel would answer EFAULT on a page it protects.

What a program bound before the recording (``from cuda.bindings.driver import cuMemcpyAsync``)
calls directly, the runtime API, and kernels launched through cuda-python are not seen here:
native capture (``kvverify.record.capture.native``) sees them, where it runs. The calls made through these
wrappers are left to them (native capture is quiet inside: cuda-python releases the GIL, so
native capture could not tell their Python line).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable

from kvverify.record.capture.driver import DriverOps
from kvverify.record.trace.recorder import busy

OS_CALLS = ("preadv", "readv", "writev", "pwritev", "write", "pwrite", "FileIO.readinto", "FileIO.write")
ONE_BUFFER = ("write", "pwrite", "FileIO.readinto", "FileIO.write")  # (the others take a sequence of buffers)


def _readonly_address(view: memoryview) -> int:
    """The address of a read-only buffer's bytes (``bytes``, a read-only numpy array)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)

DRIVER_CALLS = ("cuMemcpyBatchAsync", "cuMemcpyAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync",
                "cuEventCreate", "cuEventDestroy", "cuEventRecord", "cuEventRecordWithFlags", "cuStreamWaitEvent",
                "cuEventSynchronize", "cuEventQuery", "cuStreamSynchronize", "cuCtxSynchronize", "cuMemMap",
                "cuMemUnmap")
# where the stream argument of the calls that issue device work lies (a witness run holds or marks it)
STREAM_ARGUMENT = {"cuMemcpyBatchAsync": 7, "cuMemcpyAsync": 3, "cuMemcpyHtoDAsync": 3, "cuMemcpyDtoHAsync": 3,
                   "cuMemcpyDtoDAsync": 3}


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

    ``driver``: the recording's ``kvverify.record.capture.driver.DriverOps`` (what each call becomes);
    ``follows``: whether this thread is recorded (else its work is noted as missed, through
    ``missed(what)``); ``quiet``: a context manager factory each driver call runs inside (native
    capture then leaves it to these wrappers, which locate it in Python)."""

    def __init__(self, driver: DriverOps, follows: Callable[[], bool], missed: Callable[[str], None],
                 quiet: Callable = contextlib.nullcontext, watch=None) -> None:
        self.driver = driver
        self.rec = driver.rec
        self.follows = follows
        self.missed = missed
        self.quiet = quiet
        self.watch = watch  # the host watch (kvverify.record.capture.watch.HostWatch), or None
        self._held = threading.local()  # per thread: the buffers of the system call that the watch held
        self.forcer = None  # kvverify.record.confirm.witness.Forcer, as the dispatch hook's
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
        for name in ("writev", "pwritev", "write", "pwrite"):
            original = getattr(os, name, None)
            if original is not None:
                self._replace(os, name, self._wrap(name, original, self._written_from))
        # a file object's own system calls (open(path, "rb", buffering=0).readinto(pinned_view)),
        # observed on the C type in place
        import _io

        from kvverify.record.capture.patching import patch_method

        for name, log in (("readinto", self._read_into), ("write", self._written_from)):
            original = _io.FileIO.__dict__[name]
            self._undo.append(patch_method(_io.FileIO, name, self._wrap(f"FileIO.{name}", original, log), original))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _replace(self, module, name: str, fn) -> None:
        original = getattr(module, name)
        setattr(module, name, fn)
        self._undo.append(lambda: setattr(module, name, original))

    def _wrap(self, name: str, original, log: Callable) -> Callable:
        bindings = self
        # as the ops it logs are named
        label = f"cuda-python {name}" if name in DRIVER_CALLS else name if "." in name else f"os.{name}"
        stream_at = STREAM_ARGUMENT.get(name)

        def call(*args, **kwargs):
            forcer, target = bindings.forcer, None
            stream = _int(args[stream_at]) if stream_at is not None and len(args) > stream_at else None
            if forcer is not None and not busy() and bindings.follows():
                target = forcer.before(label, stream)
            try:
                with bindings.quiet(), bindings.windows(name, args):
                    result = original(*args, **kwargs)
            except BaseException:
                if target is not None:
                    forcer.failed(target)
                raise
            if busy():  # the recorder's own call
                return result
            if bindings.follows():
                at = bindings.rec.locate()
                with bindings.rec.exclusive():
                    bindings.rec.collect()  # what the native log holds of this thread happened before
                    try:
                        log(name, args, kwargs, result, at)
                    except Exception as exc:  # the program runs on: the summary says what is missing
                        from kvverify.record.capture.threads import RECORDER_ERROR

                        bindings.rec.notes[f"{RECORDER_ERROR} {name}: {type(exc).__name__}: {exc}"] += 1
                if target is not None:
                    forcer.after(target, stream)
            else:
                bindings.missed(label)
            return result

        call.__name__ = call.__qualname__ = name
        call.__doc__ = getattr(original, "__doc__", None)
        call.__wrapped__ = original
        return call

    # -- cuda-python ---------------------------------------------------------------------------

    def _key(self, stream) -> object:
        return self.driver.stream_key(_int(stream))

    def _cuMemcpyBatchAsync(self, name, args, kwargs, result, at) -> None:
        if not _ok(result):
            return
        import numpy as np

        dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream = args[:8]
        count, num_attrs = int(count), int(num_attrs)
        dst = np.array([_int(p) for p in list(dsts)[:count]], dtype=np.int64)
        src = np.array([_int(p) for p in list(srcs)[:count]], dtype=np.int64)
        size = np.array([int(n) for n in list(sizes)[:count]], dtype=np.int64)
        groups = [(int(attr.srcAccessOrder), int(first))
                  for attr, first in zip(list(attrs)[:num_attrs], list(attr_idxs)[:num_attrs])]
        self.driver.copy_batch(_int(stream), dst, src, size, groups, f"cuda-python {name}", at)

    def _cuMemcpyAsync(self, name, args, kwargs, result, at) -> None:
        if not _ok(result):
            return
        dst, src, nbytes, stream = args[:4]
        # the host side of HtoD / DtoH is any host pointer cuda-python accepts
        src = _host_pointer(src) if name == "cuMemcpyHtoDAsync" else _int(src)
        dst = _host_pointer(dst) if name == "cuMemcpyDtoHAsync" else _int(dst)
        self.driver.copy(_int(stream), dst, src, int(nbytes), f"cuda-python {name}", at)

    _cuMemcpyHtoDAsync = _cuMemcpyDtoHAsync = _cuMemcpyDtoDAsync = _cuMemcpyAsync

    def _cuEventCreate(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_created(_int(result[1]))

    def _cuEventDestroy(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_deleted(_int(args[0]))

    def _cuEventRecord(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_recorded(_int(args[0]), self._key(args[1]), at=at)

    _cuEventRecordWithFlags = _cuEventRecord

    def _cuStreamWaitEvent(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_waited(_int(args[1]), self._key(args[0]), at=at)

    def _cuEventSynchronize(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.event_synchronized(_int(args[0]), at=at)

    def _cuEventQuery(self, name, args, kwargs, result, at) -> None:
        # CUDA_SUCCESS: complete; CUDA_ERROR_NOT_READY: not yet (an answer too); anything else: no answer
        status = int(result[0] if isinstance(result, tuple) else result)
        if status in (0, 600):
            self.rec.event_queried(_int(args[0]), status == 0, at=at)

    def _cuStreamSynchronize(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.stream_synchronized(self._key(args[0]), at=at)

    def _cuCtxSynchronize(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.rec.device_synchronized(at=at)

    def _cuMemMap(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.driver.mapped(_int(args[0]), int(args[1]), f"cuda-python {name}", at)

    def _cuMemUnmap(self, name, args, kwargs, result, at) -> None:
        if _ok(result):
            self.driver.unmapped(_int(args[0]), int(args[1]), f"cuda-python {name}", at)

    # -- the operating system ------------------------------------------------------------------

    @contextlib.contextmanager
    def windows(self, name: str, args: tuple):
        """The buffers of a system call opened in the host watch for the call (the kernel answers
        EFAULT on a page the watch protects instead of faulting); the wrapper records the access.
        ``self._held.buffers``: those the watch held (the call touched bytes device work may
        still touch)."""
        buffers = self._buffers(name, args) if self.watch is not None and name in OS_CALLS else []
        self._held.buffers = []
        with contextlib.ExitStack() as stack:
            for address, nbytes in buffers:
                if stack.enter_context(self.watch.opened(address, nbytes)):
                    self._held.buffers.append((address, nbytes))
            yield

    @staticmethod
    def _buffers(name: str, args: tuple) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the buffers of ``os.<name>(*args)`` (an object without the buffer
        protocol: none; the call raises its own error)."""
        found = args[1:2] if name in ONE_BUFFER else (list(args[1]) if len(args) > 1 else [])
        out = []
        for buffer in found:
            try:
                view = memoryview(buffer).cast("B")
            except (TypeError, ValueError):
                continue
            if view.nbytes:
                out.append((ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly
                            else _readonly_address(view), view.nbytes))
        return out

    def _written_from(self, name, args, kwargs, result, at) -> None:
        """``os.write`` / ``pwrite`` / ``writev`` / ``pwritev`` / ``FileIO.write`` read ``result``
        bytes of their buffers: a ``host_read`` of those the host watch held (bytes device work may
        still touch; the watch saw no other since its last first touch)."""
        if result is None:
            return
        left, spans = int(result), []
        held = getattr(self._held, "buffers", [])
        for address, nbytes in self._buffers(name, args):
            if left <= 0:
                break
            n = min(left, nbytes)
            left -= n
            if (address, nbytes) in held:
                spans.append(self.driver.mode.host_span(address, n, at))
        if spans:
            self.rec.host_access("host_read", spans, name if "." in name else f"os.{name}", at)

    def _read_into(self, name, args, kwargs, result, at) -> None:
        """``os.preadv(fd, buffers, offset)`` / ``os.readv(fd, buffers)`` returned ``result`` bytes,
        written into the buffers in order (``FileIO.readinto(buffer)``: where the host watch held
        the buffer, as for ``_written_from``; a file's own reads into its buffer are not the
        program's concern)."""
        if result is None:  # (a non-blocking file had nothing to read)
            return
        if name.startswith("FileIO.") and not getattr(self._held, "buffers", []):
            return
        left = int(result)
        spans = []
        for buffer in (args[1:2] if name in ONE_BUFFER else args[1]):
            if left <= 0:
                break
            view = memoryview(buffer).cast("B")
            n = min(left, view.nbytes)
            spans.append(self.driver.mode.host_span(ctypes.addressof(ctypes.c_char.from_buffer(view)), n, at))
            left -= n
        self.rec.host_access("host_write", spans, name if "." in name else f"os.{name}", at)
