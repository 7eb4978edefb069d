"""The op log: the recording thread's dispatcher ops written down in C++ at the call
(``csrc/record/op_log.cpp``), and handled by the dispatch mode's handlers after it, in the native log's
order.

A ``TorchDispatchMode`` costs every op a Python call before any handler runs (the engine loops of
``benchmarks/bench_record.py`` run 1.5-1.9x slower under one that does nothing). The op log's
``at::RecordFunction`` observer keeps the ops such a mode sees and writes each one's facts into the
native log: its tensors as address, covering span, storage, device, pinned, version and the current
stream of their device; its scalars; the values of the int64 tensors a handler reads (a batched
swap's pointer tables, the host side of a copy of pointers); the user's frame. The recorder's other
reports on that thread (the observed event and stream methods) become marks in the same log, so
that ``Recorder.collect`` handles everything in the order it happened: once the program ends, or
where the recorder logs anything else itself (a lock, an annotation, a thread's start).

It runs on the recording thread only, for as long as that thread is the only one the recording
follows and no witness run forces it: the session then goes back to the dispatch mode
(``kvverify.record.session``).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable

import numpy as np
import torch

from kvverify.record.capture.threads import OTHER_THREAD_WORK, RECORDER_ERROR
from kvverify.record.trace.recorder import NativeRecord

TRANSPARENT, SWALLOW, LOG = 0, 1, 2
"""The classifier's answers (``csrc/record/op_log.cpp``): look inside the op (torch decomposes it above a
dispatch mode), keep it and log nothing (a view, an op that touches nothing), keep it and log it."""
CPU_VALUES, CURRENT_STREAM = 1, 2
"""Flags of a logged op: the values of its int64 CPU inputs; the current device's current stream."""
KINDS = frozenset(("op_begin", "op", "op_failed", "mark"))
"""The native log's record kinds the op log writes."""
# c10::ScalarType's numbering (c10/core/ScalarType.h), as far as the handlers need it
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
           torch.float64, torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.qint8,
           torch.quint8, torch.qint32, torch.bfloat16)
_CPU, _CUDA = 0, 1  # c10::DeviceType
BACKENDS = {_CPU: "CPU", _CUDA: "CUDA", 9: "Meta"}
"""c10::DeviceType -> the dispatch key of its backend (the classifier asks per backend)."""


class LoggedStorage:
    """``untyped_storage()`` of a ``LoggedTensor``."""

    __slots__ = ("_ptr", "_nbytes")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


class LoggedTensor:
    """A tensor argument or output of a logged op, as it was at the call: the part of
    ``torch.Tensor``'s interface the dispatch mode's handlers read, plus ``span`` (start address,
    bytes of the covering span), ``_version`` (unset for an inference tensor), ``stream`` (``(handle, device)`` of its device's current stream;
    None off CUDA), ``pinned`` and ``values`` (an int64 numpy array of shape ``(numel,)``, or None
    where not logged)."""

    __slots__ = ("_device", "_index", "_scalar", "_contiguous", "pinned", "_ptr", "span", "_storage",
                 "_numel", "_version", "stream", "values")
    layout = torch.strided

    @property
    def is_cuda(self) -> bool:
        return self._device == _CUDA

    @property
    def is_cpu(self) -> bool:
        return self._device == _CPU

    @property
    def dtype(self):
        return _DTYPES[self._scalar] if 0 <= self._scalar < len(_DTYPES) else None

    def get_device(self) -> int:
        return self._index if self._device == _CUDA else -1

    def data_ptr(self) -> int:
        return self._ptr

    def untyped_storage(self) -> LoggedStorage:
        return self._storage

    def is_contiguous(self) -> bool:
        return self._contiguous

    def numel(self) -> int:
        return self._numel

    def is_pinned(self) -> bool:
        return self.pinned


class LoggedStream:
    """A stream argument of a logged op (``aten::record_stream``'s): ``key`` is its ``(handle, device)``."""

    __slots__ = ("key",)

    def __init__(self, handle: int, device: int) -> None:
        self.key = (handle, device)


class NotLogged(Exception):
    """A value the op log could not write down (a sparse or nested tensor, an int64 table it did not
    copy): the handler fails, and the summary names the op as not recorded."""


def _decode_tensor(words: list[int], k: int) -> tuple[LoggedTensor, int]:
    t = LoggedTensor()
    (t._device, t._index, t._scalar, flags, start, length, storage, storage_bytes, t._numel, version, stream,
     nvalues) = words[k:k + 12]
    t._contiguous, t.pinned = bool(flags & 1), bool(flags & 2)
    if flags & 4:  # (an inference tensor has no version counter: reading it raises, as torch's does)
        t._version = version
    t._ptr, t.span = start, (start, length)  # (strides are never negative: the span starts at the data)
    t._storage = LoggedStorage(storage, storage_bytes)
    t.stream = (stream, t._index) if t._device == _CUDA else None
    k += 12
    if nvalues >= 0:
        t.values = np.array(words[k:k + nvalues], dtype=np.int64)
        k += nvalues
    else:
        t.values = None
    return t, k


def _decode_value(words: list[int], k: int):
    tag = words[k]
    k += 1
    if tag == 1:
        return _decode_tensor(words, k)
    if tag in (2, 3):
        return (words[k] if tag == 2 else bool(words[k])), k + 1
    if tag == 4:
        return struct.unpack("<d", struct.pack("<q", words[k]))[0], k + 1
    if tag == 5:
        out = []
        n, k = words[k], k + 1
        for _ in range(n):
            item, k = _decode_value(words, k)
            out.append(item)
        return out, k
    if tag == 6:
        return LoggedStream(words[k], words[k + 1]), k + 2
    if tag == 7:
        return NotLogged("a tensor that is not strided memory (sparse, nested)"), k
    return None, k


def decode(fields: list[int]) -> tuple[int, tuple[int, int] | None, list, list]:
    """An ``op`` record's fields as ``(op id, (stream handle, device) or None, inputs, outputs)``;
    inputs and outputs are lists of Python values (``LoggedTensor``, ``LoggedStream``, int, bool,
    float, lists of them, None, or a ``NotLogged``)."""
    op, device, stream = fields[0], fields[1], fields[2]
    k = 3
    lists = []
    for _ in range(2):
        n = fields[k]
        k += 1
        values = []
        for _ in range(n):
            value, k = _decode_value(fields, k)
            values.append(value)
        lists.append(values)
    return op, ((stream, device) if device >= 0 else None), lists[0], lists[1]


class OpLog:
    """The C side of the op log (``kvverify._C``, loaded with ctypes: the GIL stays held). Raises
    AttributeError where the extension predates it."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        lib.kvverify_ops_start.restype = ctypes.c_char_p
        lib.kvverify_ops_start.argtypes = [ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.c_int64]
        lib.kvverify_ops_below.restype = ctypes.c_int64
        lib.kvverify_ops_mark.argtypes = [ctypes.c_int64]
        lib.kvverify_ops_quiet.argtypes = [ctypes.c_int]
        lib.kvverify_ops_elsewhere.restype = ctypes.c_int64
        self._lib = lib
        self._mark = lib.kvverify_ops_mark

    def start(self, classify: Callable[[str, str, int], tuple], library: Callable[[object], bool],
              flush: Callable[[], None], below: int | None = None) -> str | None:
        """Log this thread's ops from now on; returns None, or why it could not start. ``flush()``
        is called before an op where the log holds many records (the recorder logs them then).
        ``below``: how many of the program's dispatch modes lie below the recording (None: those on
        the stack now); an op that a mode above them sees first is left to the calls it makes."""
        why = self._lib.kvverify_ops_start(classify, library, flush, -1 if below is None else below)
        return None if why is None else why.decode()

    def below(self) -> int:
        """The program's dispatch modes the running op log lies above."""
        return int(self._lib.kvverify_ops_below())

    def stop(self) -> None:
        self._lib.kvverify_ops_stop()

    def mark(self, index: int) -> None:
        """A mark of this thread's log at report ``index`` (``Replayer.marks``)."""
        self._mark(index)

    def quiet(self, delta: int) -> None:
        """This thread's ops are not logged while its depth in the recorder's own work is above 0."""
        self._lib.kvverify_ops_quiet(delta)

    def elsewhere(self) -> int:
        """Ops of other threads the observer reached since the start (torch hands it to the
        threads that work for the recording one: autograd's), not logged; the count restarts."""
        return int(self._lib.kvverify_ops_elsewhere())


class Replayer:
    """The op log of one recording: answers the observer's classifier with the dispatch mode's
    knowledge of each op (``RecordingMode.log_class``), holds the recorder's deferred reports, and
    replays ``op_begin`` / ``op`` / ``op_failed`` / ``mark`` records through ``mode``'s handlers.

    ``log``: the ``OpLog`` (None: the platform has none, and nothing is logged); ``mode``: the
    recording's ``RecordingMode`` (a fork of it replays, with ``platform``'s answers
    replaced by the logged facts); ``locate_frames``: ``(code, line)`` frames to ``at``;
    ``library``: whether a code object's frames are library code."""

    def __init__(self, mode, locate_frames: Callable, library: Callable[[object], bool]) -> None:
        self.log: OpLog | None = None  # set where the platform has one
        self.mode = mode
        self.rec = mode.rec
        self._library = library
        self._locate_frames = locate_frames
        self._infos: list = []  # op id -> OpInfo
        self.marks: list = []  # deferred reports: (fn, args, kwargs), None once replayed
        self.on = False
        self.thread: int | None = None
        self.below: int | None = None  # the program's dispatch modes it lies above, once started
        self._replay = mode.fork()
        self._replay.platform = _Logged(mode.platform)
        self._replay.locate = self._at
        self._current_at: str | None = None

    def start(self, thread: int, below: int | None = None) -> str | None:
        """Log the ops of ``thread`` (the calling one) from now on, above ``below`` of the program's
        dispatch modes (None: those on the stack now; then ``below`` is set); None, or why not."""
        why = self.log.start(self._classify, self._library, self._flush, below)
        if why is None:
            self.on, self.thread, self.below = True, thread, self.log.below()
        return why

    def stop(self) -> None:
        """Stop logging (what is in the log stays there, for ``Recorder.collect``); the ops other
        threads ran for this one meanwhile are the recording's missed work."""
        if not self.on:
            return
        self.on = False
        self.log.stop()
        missed = self.log.elsewhere()
        if missed:
            with self.rec.exclusive():
                self.rec.notes[f"{OTHER_THREAD_WORK} dispatcher ops that torch ran for the recording thread on "
                               "threads of its own (autograd's backward pass)"] += missed

    def defer(self, fn: Callable, args: tuple, kwargs: dict, when: tuple[int, int] | None = None) -> None:
        """Run the report ``fn(*args, **kwargs)`` where the log reaches this point, its ops of a
        call that ran in ``when`` (``Recorder.when``)."""
        index = len(self.marks)
        self.marks.append((fn, args, kwargs, when))
        self.log.mark(index)

    def quiet(self, delta: int) -> None:
        self.log.quiet(delta)

    def _classify(self, name: str, overload: str, backend: int) -> tuple[int, int, int, int]:
        packet = getattr(torch.ops, name.split("::")[0])
        op = getattr(getattr(packet, name.split("::")[1]), overload or "default")
        cls, flags, cuda_values, info = self.mode.log_class(op, backend)
        if cls != LOG:
            return cls, 0, 0, 0
        self._infos.append(info)
        return cls, len(self._infos) - 1, flags, cuda_values

    def _flush(self) -> None:
        with self.rec.exclusive():
            self.rec.collect()

    def _at(self, depth: int = 1) -> str | None:
        return self._current_at

    def replay(self, record: NativeRecord) -> None:
        """Handle one record of the op log (``Recorder.collect`` calls it, holding the recorder)."""
        try:
            self._replay_record(record)
        except Exception as exc:  # the rest of the log is still the program's: the summary names what is missing
            self.rec.notes[f"{RECORDER_ERROR} the op log's {record.kind} record: {type(exc).__name__}: {exc}"] += 1

    def _replay_record(self, record: NativeRecord) -> None:
        kind = record.kind
        rec = self.rec
        if kind == "mark":
            index = record.fields[0]
            fn, args, kwargs, when = self.marks[index]
            self.marks[index] = None
            if index == len(self.marks) - 1:
                self.marks.clear()  # every mark before it was replayed: the list starts again
            rec.when(when)
            fn(*args, **kwargs)
        elif kind == "op_begin":
            rec.begin_op()
        elif kind == "op_failed":
            rec.end_op()
        else:
            # (where nothing was logged inside the op, no op_begin was written: the op starts here, as
            # live, so that what its handler reports is held back and released as the mode's is)
            rec.begin_op()
            try:
                self._replay_op(record)
            finally:
                rec.end_op()

    def _replay_op(self, record: NativeRecord) -> None:
        op, stream, inputs, outputs = decode(record.fields)
        info = self._infos[op] if 0 <= op < len(self._infos) else None
        rec = self.rec
        if info is None:
            rec.notes[f"{RECORDER_ERROR} ops the op log could not write down"] += 1
            return
        args, kwargs = [], {}
        for (name, (k, kwarg_only, _, _)), value in zip(info.arguments.items(), inputs):
            if kwarg_only:
                kwargs[name] = value
            else:
                args.append(value)
        out = tuple(outputs) if info.returns_many or len(outputs) != 1 else outputs[0]
        self._current_at = self._locate_frames(record.frames)
        self._replay.platform.current = stream
        self._replay.handle(info, tuple(args), kwargs, out)


class _Logged:
    """The platform's answers for a logged op: from its facts, not from live tensors."""

    def __init__(self, platform) -> None:
        self._platform = platform
        self.current: tuple[int, int] | None = None  # the op's current device's current stream

    def where(self, t) -> str | None:
        if isinstance(t, NotLogged):
            raise t
        return self._platform.where(t)

    def stream_key(self, t) -> object:
        return self._platform.logged_stream_key(self.current if t is None else t.stream)

    def stream_key_of(self, stream) -> object:
        return self._platform.logged_stream_key(stream.key)

    def is_pinned(self, t) -> bool:
        return self._platform.is_pinned(t)

    def read_values(self, t):
        raise NotLogged("the values of a device tensor the op log did not read back")

    def allocator_blocks(self):
        return self._platform.allocator_blocks()

    def host_range(self, address: int):
        return self._platform.host_range(address)
