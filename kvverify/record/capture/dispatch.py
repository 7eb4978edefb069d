"""Every op the program runs through torch's dispatcher, as device work and host accesses.

``RecordingMode`` is a ``TorchDispatchMode`` (as PyTorch's CUDA Stream Sanitizer,
``torch/cuda/_sanitizer.py``, uses one): it sees each aten op with its tensor arguments and the
schema's alias annotations (``Tensor(a!)`` is written, ``Tensor(a)`` only aliased), and custom ops
(``torch.ops.kvverify.*``, a serving engine's own) with theirs. What it makes of them:

- an op on CUDA tensors: a ``kernel`` on the current stream of their device, reading and writing
  the byte ranges of the allocations the tensors lie in (a strided view as its covering span);
  fresh outputs are new allocations, written by the op (``empty`` and views launch nothing);
- an op on CPU tensors: ``host_read`` / ``host_write`` of their storages at this point of the host
  program (the trace keeps those that matter: pinned staging and descriptor buffers);
- ``copy_`` and ``_to_copy`` (``.to()``, ``.cuda()``, ``.cpu()``) between host and device: a
  ``copy`` on the current stream of the device side; a blocking one (``non_blocking=False``) is
  followed by the stream synchronization torch performs for it (``at::cuda::memcpy_and_sync``);
- a batched swap (``kvverify::swap_blocks_batch`` and every op of its schema under another name):
  a ``copy_batch`` in the order the call asked for, every raw pointer resolved to the allocation it
  lies in (``kvverify.record.trace.memory``); ``kvverify::swap_blocks_loop``: one ``copy`` per entry;
- kvverify's harness kernels (``write_blocks``, ``read_blocks``, ``verify_blocks``,
  ``checksum_blocks``): their accesses through the block pointers they are given;
- ``kvverify::host_alloc`` / ``host_register`` (``kvverify.device.host_memory``): new pinned /
  registered host memory; ``host_free`` / ``host_unregister``: a ``free`` of it (device work still
  pending on it races with the release);
- ``Tensor.record_stream(s)``: the caching allocator's fence for the block (``Recorder.memory_freed``);
- fresh outputs through ``Recorder.allocated``, which writes the allocators' ordering of reused bytes.

Pointers held in a CUDA tensor are known from the host copy that filled it; where none was seen,
the tensor is read back (a synchronizing copy the trace does not show).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from kvverify.record.capture.oplog import (
    BACKENDS,
    CPU_VALUES,
    CURRENT_STREAM,
    LOG,
    SWALLOW,
    TRANSPARENT,
    LoggedTensor,
    NotLogged,
)
from kvverify.record.capture.threads import RECORDER_ERROR
from kvverify.record.trace.memory import Span
from kvverify.record.trace.recorder import CopyArrays, Recorder, busy
from kvverify.terms import DEVICE_SPACE, HOST_SPACE, SrcAccessOrder

DEFAULT_SWAP_OPS = ("kvverify::swap_blocks_batch",)
unfollowed: Callable[[str], None] | None = None
"""The recording running now's note of missed work (``kvverify.record.session`` sets it): where an
op reaches the dispatch mode of a recording that is not recording (a thread it followed runs on
after it stopped or while it is paused), the running one does not see the op either."""
SWAP_ORDER_ARGS = ("src_access_order", "is_src_access_order_any")
# kvverify's harness kernels: each reaches ``block_bytes`` at every address of ``block_ptrs``.
POINTER_KERNELS = {"kvverify::write_blocks": "writes", "kvverify::read_blocks": "reads",
                   "kvverify::verify_blocks": "reads", "kvverify::checksum_blocks": "reads"}
# Ops that launch nothing on the device and touch no data.
NO_ACCESS = frozenset(("aten::is_pinned", "aten::set_", "aten::resize_", "aten::resize_as_",
                       "kvverify::check_pointers", "kvverify::spin", "kvverify::batch_api_available",
                       "kvverify::driver_version"))
FACTORY = re.compile(r"(new_.*|.*_like)$")  # tensor arguments give only shape and dtype
POINTER_TABLES = 16384  # device pointer tensors whose values are kept, the oldest dropped first
# Where a handler's locate() starts: the handler's frame and __torch_dispatch__'s are the recorder's
# own, and walking a frame makes its frame object; the third is whatever called the op.
HANDLER_DEPTH = 3
TENSORS = (Tensor, LoggedTensor)
"""What the handlers take for a tensor: a live one (the dispatch mode's), or one the op log wrote down."""


class RecordingPlatform:
    """What the recorder asks of the device layer. ``kvverify.record.capture.hooks.CudaPlatform`` answers
    with torch.cuda; the CPU tests answer with a stand-in (``tests/record/fake_cuda.py``)."""

    def where(self, t: torch.Tensor) -> str | None:
        """``"device"`` (device memory), ``"host"`` (host memory) or None (not memory: meta, a
        FakeTensor)."""
        raise NotImplementedError

    def stream_key(self, t: torch.Tensor | None) -> object:
        """``Recorder.stream_key`` of the current stream of ``t``'s device (None: current device)."""
        raise NotImplementedError

    def stream_key_of(self, stream) -> object:
        """``Recorder.stream_key`` of a stream object (``torch.Stream``, ``torch.cuda.Stream``)."""
        raise NotImplementedError

    def logged_stream_key(self, stream: tuple[int, int] | None) -> object:
        """``Recorder.stream_key`` of a stream the op log wrote down as ``(handle, device)``; raises
        ``NotLogged`` for None (it wrote none down)."""
        if stream is None:
            raise NotLogged("the current stream (the op log did not write it down)")
        return Recorder.stream_key(*stream)

    def handle_key(self, handle: int) -> object:
        """``Recorder.stream_key`` of a raw stream handle on the current device (cuda-python's)."""
        return Recorder.stream_key(int(handle), 0)

    def is_pinned(self, t: torch.Tensor) -> bool:
        raise NotImplementedError

    def read_values(self, t: torch.Tensor) -> np.ndarray:
        """The values of an int64 device tensor, read back to the host (synchronizes)."""
        raise NotImplementedError

    def allocator_blocks(self) -> list[tuple[int, int]]:
        """``(base, bytes)`` of every live block of torch's caching allocator."""
        return []

    def host_range(self, address: int) -> tuple[int, int, str] | None:
        """``(base, bytes, space)`` of the CUDA allocation holding ``address`` that the allocator
        does not know of (pinned or registered host memory, raw ``cudaMalloc``), or None."""
        return None

    def install(self, recorder: Recorder, guard: Callable[[Callable], Callable], native: bool = True) -> None:
        """Start reporting streams, events and synchronization to ``recorder``, each report
        through ``guard(report)`` (which drops other threads' and the recorder's own), and set
        ``recorder.pending`` / ``take`` to the native log; ``native``: capture driver calls too,
        setting ``capture_off`` to why not where it cannot."""
        raise NotImplementedError

    def uninstall(self) -> None:
        """Stop reporting (idempotent)."""
        raise NotImplementedError

    def suppressed(self):
        """A context manager: the driver calls of this thread inside it are not captured natively
        (the recorder sees them another way)."""
        return contextlib.nullcontext()

    def last_call(self) -> int | None:
        """When this thread's last call inside ``suppressed()`` began (``time.perf_counter_ns()``),
        once: a second ask, or one where no such call was timed, gets None (``Recorder.when``)."""
        return None

    host_watch = None
    """The running host watch (``kvverify.record.capture.watch.HostWatch``), or None."""
    watch_off: str | None = "this platform has no host watch"
    """Why there is no host watch (None: there is one), where host accesses outside the dispatcher to
    bytes device work may still touch are then not seen."""

    def witness_tools(self, internal: Callable):
        """The device side of a witness run (``kvverify.record.confirm.witness.DeviceTools``); the recorder's
        own work goes inside ``internal()``."""
        raise NotImplementedError

    def function_name(self, function: int) -> str:
        """The name of a kernel native capture saw launched."""
        return "?"

    def on_launch(self, report: Callable[[int], None]) -> None:
        """Call ``report(function)`` where a launcher that releases the GIL (Triton) is about to
        launch kernel ``function`` on this thread, for as long as the recording runs."""

    def on_graph_replay(self, report: Callable[[], None]) -> None:
        """Call ``report()`` where the program is about to launch a CUDA graph on this thread with
        the GIL released (``torch.cuda.CUDAGraph.replay``), for as long as the recording runs."""

    def op_log(self):
        """The op log (``kvverify.record.capture.oplog.OpLog``) that writes this platform's ops down at
        the call, or None where there is none (the dispatch mode then sees every op)."""
        return None

    def native_leftover(self):
        """The native log's records no ``take`` removed (a ``collections.Counter`` by ``(thread,
        kind)``), now removed; called once the recording's own thread has taken its own."""
        return Counter()


@dataclass(frozen=True)
class OpInfo:
    """What a schema says about an op, computed once per op."""

    name: str  # "aten.add_.Tensor"
    qualified: str  # "aten::add_"
    handler: Callable
    tensor_args: tuple  # (position, name, is_write, metadata_only) of Tensor-typed arguments
    fresh_returns: tuple  # positions of returns that are new tensors (no alias annotation)
    launches: bool  # False for empty() and friends: the output is allocated, not written
    schema: object
    # name -> (position, kwarg_only, has_default, default) of every argument: the schema's own
    # objects are made anew at each access of ``schema.arguments``
    arguments: dict
    pins: bool  # the output is pinned whatever the arguments say (``_pin_memory``)
    returns_many: bool  # more than one return: the output is their tuple
    origin: str  # "output of aten.add.Tensor": what a fresh output's allocation says of itself


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, TENSORS):
        yield from _strided(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, TENSORS):
                yield from _strided(v)
            elif isinstance(v, NotLogged):
                raise v
    elif isinstance(value, NotLogged):  # a tensor the op log could not write down: the op is not recorded
        raise value


_SPARSE_PARTS = {torch.sparse_coo: ("_indices", "_values"),
                 torch.sparse_csr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
                 torch.sparse_bsc: ("ccol_indices", "row_indices", "values")}


def _strided(t: torch.Tensor) -> tuple:
    """The strided tensors holding ``t``'s bytes: ``t`` itself, or a sparse tensor's indices and
    values (a sparse tensor has no storage of its own)."""
    parts = _SPARSE_PARTS.get(t.layout)
    return (t,) if parts is None else tuple(getattr(t, part)() for part in parts)


def _covering(t: torch.Tensor) -> tuple[int, int]:
    """``(start address, bytes)`` of the span from ``t``'s first element to its last (0 bytes for an
    empty tensor); a logged tensor carries its own (``LoggedTensor.span``, written by the op log)."""
    length = t.nbytes  # elements times element size: one read for both, and 0 for an empty tensor
    start = t.data_ptr()
    if not length or t.is_contiguous():
        return start, length
    size = t.element_size()
    lo = hi = 0
    for extent, stride in zip(t.shape, t.stride()):
        if extent > 1:
            reach = (extent - 1) * stride
            if reach < 0:
                lo += reach
            else:
                hi += reach
    return start + lo * size, (hi - lo + 1) * size


def _flat(t: torch.Tensor) -> np.ndarray:
    """A host tensor's elements as a 1-D numpy array: a view of its memory where it is one already
    (``contiguous`` and ``view`` are dispatcher calls, a microsecond each); a logged one's values
    as the op log copied them at the call."""
    if type(t) is LoggedTensor:
        if t.values is None:
            raise NotLogged("the values of an int64 tensor the op log did not copy")
        return t.values
    t = t.detach()
    if t.dim() != 1 or not t.is_contiguous():
        t = t.contiguous().view(-1)
    return t.numpy()


def _argument(info: OpInfo, args: tuple, kwargs: dict, name: str, default=None):
    found = info.arguments.get(name)
    if found is None:
        return default
    k, kwarg_only, has_default, value = found
    if k < len(args) and not kwarg_only:
        return args[k]
    if name in kwargs:
        return kwargs[name]
    return value if has_default else default


class RecordingMode(TorchDispatchMode):
    """Records every op the current thread dispatches into ``recorder`` (see module docstring).

    ``swap_ops``: qualified names (``"ns::name"``) of ops with the batched swap's schema
    (``Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes`` and ``int src_access_order`` or ``bool
    is_src_access_order_any``), besides ``kvverify::swap_blocks_batch``; any op named
    ``*::swap_blocks_batch`` of that schema counts too. ``internal``: a context manager factory
    the mode enters while it reads pointer tensors back (the hooks then report nothing).
    """

    def __init__(self, recorder: Recorder, platform: RecordingPlatform, swap_ops: Iterable[str],
                 internal: Callable) -> None:
        super().__init__()
        self.rec = recorder
        self.platform = platform
        self.swap_ops = frozenset(DEFAULT_SWAP_OPS) | frozenset(swap_ops)
        self._internal = internal
        self._infos: dict[int, OpInfo] = {}
        self._pointers: OrderedDict[int, tuple] = OrderedDict()  # data_ptr -> (allocation, version, values)
        self.active = True  # false once the recording stopped: the modes of threads still running pass through
        # kvverify.record.confirm.witness.Forcer: counts each op's calls at its line, and in a witness run holds
        # or waits for the pair of a race (None: a plain recording)
        self.forcer = None

    def fork(self) -> RecordingMode:
        """A mode for another thread (torch keeps modes per thread) that shares this one's state:
        what it learnt of ops and of pointer tables, and whether the recording still runs."""
        child = RecordingMode.__new__(RecordingMode)
        child.__dict__.update(self.__dict__)
        child._parent = self
        return child

    # -- dispatch ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = self._infos.get(id(func))  # OpOverloads live as long as torch: id() skips their Python __hash__
        if info is None:
            with self.rec.exclusive():
                info = self._infos[id(func)] = self._describe(func)
        if info.handler is None or not self.is_active():
            if info.handler is not None and unfollowed is not None and not busy():
                unfollowed(info.name)  # a thread this mode's recording followed, after it stopped or paused
            return func(*args, **kwargs)
        rec = self.rec
        forcer = self.forcer
        call = None if forcer is None else forcer.before(info.name)
        rec.begin_op()
        t0 = time.perf_counter_ns()
        try:
            out = func(*args, **kwargs)
        except BaseException:
            with rec.exclusive():
                rec.end_op()
            if call is not None:
                forcer.failed(call)
            raise
        when = (t0, time.perf_counter_ns())
        with rec.exclusive():
            try:
                rec.collect()  # the op's fresh blocks and its frees come before its entry
                rec.when(when)
                self.handle(info, args, kwargs, out)
            finally:
                rec.when(None)
                rec.end_op()
        if call is not None:  # outside the recorder's lock: a witness run may wait here
            forcer.after(call)
        return out

    def handle(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        """Log the op ``info`` called with ``args`` and ``kwargs``, which returned ``out`` (live
        tensors, or what the op log wrote down of them), holding the recorder."""
        try:
            info.handler(self, info, args, kwargs, out)
        except Exception as exc:  # the program must run on: the summary says what is missing
            self.rec.notes[f"{RECORDER_ERROR} {info.name}: {type(exc).__name__}: {exc}"] += 1

    def locate(self, depth: int) -> str | None:
        """``at`` of the op a handler handles, ``depth`` frames above the handler's caller (the op
        log's replay answers with the frame it logged)."""
        return self.rec.locate(depth + 1)

    def log_class(self, func, backend: int) -> tuple[int, int, int, OpInfo | None]:
        """What the op log does with op ``func`` on tensors of ``backend`` (a ``c10::DeviceType``;
        -1: none): ``(class, flags, CUDA input positions whose int64 values it reads back, OpInfo)``
        (``kvverify.record.capture.oplog``). An op torch decomposes above a dispatch mode (tensor
        arguments, a ``CompositeImplicitAutograd`` kernel and neither one for the backend nor a
        ``CompositeExplicitAutograd`` one: the dispatcher's rule for the Autograd keys) is looked
        into, as the dispatch mode sees the ops it decomposes into."""
        info = self._infos.get(id(func))
        if info is None:
            with self.rec.exclusive():
                info = self._infos[id(func)] = self._describe(func)
        name = info.qualified + (f".{func._overloadname}" if func._overloadname != "default" else "")
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
        key = BACKENDS.get(backend)
        # (an op with no tensor argument has no Autograd key to decompose at: a dispatch mode sees it)
        if (backend >= 0 and has_kernel(name, "CompositeImplicitAutograd")
                and not has_kernel(name, "CompositeExplicitAutograd") and not (key and has_kernel(name, key))):
            return TRANSPARENT, 0, 0, None
        handler = info.handler
        if handler is None:
            return SWALLOW, 0, 0, None
        flags, cuda_values = 0, 0
        if handler in (RecordingMode._copy, RecordingMode._to_copy, RecordingMode._foreach_copy):
            flags = CPU_VALUES
        elif handler in (RecordingMode._swap, RecordingMode._swap_loop, RecordingMode._pointer_kernel):
            flags = CPU_VALUES | CURRENT_STREAM
            names = ("block_ptrs",) if handler is RecordingMode._pointer_kernel else \
                tuple(name for _, name, _, _ in info.tensor_args[:3])
            for name in names:
                cuda_values |= 1 << info.arguments[name][0]
        return LOG, flags, cuda_values, info

    def is_active(self) -> bool:
        """Whether the recording this mode belongs to still runs."""
        return getattr(self, "_parent", self).active

    def _describe(self, func) -> OpInfo:
        schema = func._schema
        qualified = schema.name
        tensor_args = []
        factory = bool(FACTORY.match(qualified.split("::")[-1]))
        for k, a in enumerate(schema.arguments):
            if "Tensor" not in str(a.type):
                continue
            alias = a.alias_info
            is_write = alias is not None and alias.is_write
            view = alias is not None and not alias.is_write
            tensor_args.append((k, a.name, is_write, factory or view))
        fresh = tuple(k for k, r in enumerate(schema.returns) if "Tensor" in str(r.type) and r.alias_info is None)
        base = qualified.split("::")[-1]
        launches = not base.startswith(("empty", "new_empty", "_empty"))
        handler = RecordingMode._generic
        view = not fresh and all(metadata_only and not is_write for _, _, is_write, metadata_only in tensor_args)
        if qualified in NO_ACCESS or (view and schema.name.startswith("aten::")) or torch.Tag.inplace_view in func.tags:
            handler = None  # launches nothing, or only makes a view of its input (or changes a tensor's view of it)
        elif qualified == "aten::record_stream":
            handler = RecordingMode._record_stream
        elif qualified == "aten::copy_":
            handler = RecordingMode._copy
        elif qualified == "aten::_to_copy":
            handler = RecordingMode._to_copy
        elif qualified in ("aten::_foreach_copy_", "aten::_foreach_copy"):
            handler = RecordingMode._foreach_copy
        elif qualified in self.swap_ops and not _is_swap_schema(schema):
            self.rec.notes[f"{qualified} was named as a batched swap, but its schema ({schema}) is not the swap's "
                           "(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int src_access_order | bool "
                           "is_src_access_order_any): recorded as a kernel over its tensor arguments"] += 1
        elif qualified in self.swap_ops or (qualified.endswith("::swap_blocks_batch") and _is_swap_schema(schema)):
            handler = RecordingMode._swap
        elif qualified == "kvverify::swap_blocks_loop":
            handler = RecordingMode._swap_loop
        elif qualified in POINTER_KERNELS:
            handler = RecordingMode._pointer_kernel
        elif qualified in ("kvverify::host_alloc", "kvverify::host_register"):
            handler = RecordingMode._host_memory
        elif qualified in ("kvverify::host_free", "kvverify::host_unregister"):
            handler = RecordingMode._host_release
        arguments = {a.name: (k, a.kwarg_only, a.has_default_value(),
                              a.default_value if a.has_default_value() else None)
                     for k, a in enumerate(schema.arguments)}
        name = str(func)
        return OpInfo(name, qualified, handler, tuple(tensor_args), fresh, launches, schema, arguments,
                      qualified == "aten::_pin_memory", len(schema.returns) > 1, f"output of {name}")

    # -- tensors as byte ranges --------------------------------------------------------------

    def span(self, t: torch.Tensor, where: str, at: str | None) -> Span | None:
        """The covering span of ``t``'s elements, resolved; None for an empty tensor."""
        start, length = t.span if type(t) is LoggedTensor else _covering(t)
        if not length:
            return None
        memory = self.rec.memory
        span = memory.resolve_known(start, length)
        if span is not None and (memory.allocations[span[0]].space == DEVICE_SPACE) == (where == "device"):
            return span
        storage = t.untyped_storage()
        base, nbytes = storage.data_ptr(), max(1, storage.nbytes())
        if where == "device":
            space = DEVICE_SPACE
        else:
            space = HOST_SPACE["pinned"] if self.platform.is_pinned(t) else HOST_SPACE["pageable"]
        # Host memory is freed without a report: a live storage that the map's allocations overlap
        # without holding it (or hold on the other side of the bus) proves them gone.
        if span is not None or any(not a.placeholder and not (a.base <= base and base + nbytes <= a.end)
                                   for a in memory.overlapping(base, base + nbytes)):
            self.rec.notes["tensors found where the recording still had other memory (freed unseen)"] += 1
            self.rec.allocated(base, nbytes, space, "a tensor made where freed memory was", at)
        else:
            memory.known(base, nbytes, space, "a tensor made before the recording")
        span = memory.resolve(start, length)
        if span is not None:
            return span
        return memory.unresolved_span(start, length, memory.why_not(start, length), at)

    def host_span(self, address: int, length: int, at: str | None) -> Span:
        """The span of ``length`` >= 1 host bytes at ``address`` the host touched (an annotation, a
        read into a buffer): in the allocation that holds them; else in what CUDA says of the
        address (pinned or registered memory made elsewhere); else in pageable host memory learnt
        now; unresolved where they run past a live allocation."""
        memory = self.rec.memory
        span = memory.resolve(address, length)
        if span is None:
            self.learn(np.array([address], dtype=np.int64))
            span = memory.resolve(address, length)
        if span is None:
            memory.known(address, length, HOST_SPACE["pageable"], "memory the host touched", at)
            span = memory.resolve(address, length) or memory.unresolved_span(address, length,
                                                                              memory.why_not(address, length), at)
        return span

    def _fresh(self, t: torch.Tensor, where: str, at: str | None, origin: str, may_pin: bool) -> None:
        """Register the storage of a new output tensor as a new allocation."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if where == "device":
            space = DEVICE_SPACE
        else:
            space = HOST_SPACE["pinned"] if may_pin and self.platform.is_pinned(t) else HOST_SPACE["pageable"]
        self.rec.allocated(storage.data_ptr(), nbytes, space, origin, at)

    def _accesses(self, info: OpInfo, args: tuple, kwargs: dict, out, at: str | None, may_pin: bool = False):
        """The op's device stream (or None) and its ranges: device reads, device writes, host
        reads, host writes. Registers fresh outputs."""
        where = self.platform.where
        span_of = self.span
        fresh_returns = info.fresh_returns
        stream = None
        reads: list = []
        writes: list = []
        host_reads: list = []
        host_writes: list = []
        inputs: set[int] = set()  # storages of the inputs, where an output may alias one
        n_args = len(args)
        for k, name, is_write, metadata_only in info.tensor_args:
            value = args[k] if k < n_args else kwargs.get(name)
            if isinstance(value, TENSORS):
                tensors = _strided(value)
            elif isinstance(value, (list, tuple, NotLogged)):
                tensors = _tensors(value)
            else:
                continue
            for t in tensors:
                w = where(t)
                if w is None:
                    continue
                if w == "device" and stream is None:
                    stream = self.platform.stream_key(t)
                if fresh_returns:
                    inputs.add(t.untyped_storage().data_ptr())
                if metadata_only:
                    continue
                span = span_of(t, w, at)
                if span is not None:
                    if w == "device":
                        (writes if is_write else reads).append(span)
                    else:
                        (host_writes if is_write else host_reads).append(span)
        if fresh_returns:
            outs = out if isinstance(out, (tuple, list)) and info.returns_many else (out,)
            for k in fresh_returns:
                if k >= len(outs):
                    continue
                for t in _tensors(outs[k]):
                    w = where(t)
                    if w is None or t.untyped_storage().data_ptr() in inputs:
                        continue
                    if w == "device" and stream is None:
                        stream = self.platform.stream_key(t)
                    self._fresh(t, w, at, info.origin, may_pin)
                    if info.launches:
                        span = self.span(t, w, at)
                        if span is not None:
                            (writes if w == "device" else host_writes).append(span)
        return stream, reads, writes, host_reads, host_writes

    def _emit(self, info: OpInfo, stream, reads, writes, host_reads, host_writes, at) -> None:
        rec = self.rec
        if host_reads:
            rec.host_access("host_read", host_reads, info.name, at)
        if stream is not None and (reads or writes):  # views and empty() launch nothing
            rec.kernel(stream, info.name, reads, writes, at)
        if host_writes:
            rec.host_access("host_write", host_writes, info.name, at)

    # -- handlers ---------------------------------------------------------------------------

    def _generic(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        at = self.locate(HANDLER_DEPTH)
        may_pin = info.pins or bool(kwargs.get("pin_memory"))
        self._emit(info, *self._accesses(info, args, kwargs, out, at, may_pin), at)

    def _copy(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        dst, src = args[0], _argument(info, args, kwargs, "src")
        non_blocking = bool(_argument(info, args, kwargs, "non_blocking", False))
        self._transfer(info, src, dst, non_blocking, args, kwargs, out)

    def _to_copy(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        non_blocking = bool(_argument(info, args, kwargs, "non_blocking", False))
        self._transfer(info, args[0], out, non_blocking, args, kwargs, out, fresh=True)

    def _foreach_copy(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        """``torch._foreach_copy_(dsts, srcs, non_blocking)`` (and its out-of-place form): one
        ``copy_`` per pair (torch runs the pairs across host and device as ``copy_`` does)."""
        at = self.locate(HANDLER_DEPTH)
        non_blocking = bool(_argument(info, args, kwargs, "non_blocking", False))
        fresh = info.qualified == "aten::_foreach_copy"
        srcs, dsts = _argument(info, args, kwargs, "src"), out if fresh else args[0]
        where = self.platform.where
        pairs = [(src, dst, where(src), where(dst)) for src, dst in zip(srcs, dsts)]
        for src, dst, ws, wd in pairs:
            if fresh and wd is not None:
                self._fresh(dst, wd, at, info.origin, may_pin=False)
            if ws is not None and wd is not None and ws != wd:
                self._cross(info, src, dst, ws, wd, non_blocking, at, bumps=0 if fresh else 1)
                continue
            # not across host and device: as any op, a kernel on device memory or a host access
            reads = [s for s in (ws and self.span(src, ws, at),) if s]
            writes = [s for s in (wd and self.span(dst, wd, at),) if s]
            if "device" in (ws, wd):
                self._emit(info, self.platform.stream_key(dst if wd == "device" else src), reads, writes, [], [], at)
            else:
                self._emit(info, None, [], [], reads, writes, at)

    def _transfer(self, info: OpInfo, src, dst, non_blocking: bool, args, kwargs, out, fresh: bool = False) -> None:
        """``dst`` gets ``src``'s elements: a copy when one side is host memory and the other
        device memory, otherwise a kernel or a host access like any op. Called by a handler."""
        where = self.platform.where
        ws, wd = where(src), where(dst)
        at = self.locate(HANDLER_DEPTH + 1)
        if ws is None or wd is None or ws == wd:
            may_pin = info.qualified == "aten::_to_copy" and bool(kwargs.get("pin_memory"))
            self._emit(info, *self._accesses(info, args, kwargs, out, at, may_pin), at)
            return
        if fresh:
            # torch pins the output of a non-blocking copy to the host (``_to_copy``)
            self._fresh(dst, wd, at, info.origin, may_pin=True)
        self._cross(info, src, dst, ws, wd, non_blocking, at, bumps=0 if fresh else 1)

    def _cross(self, info: OpInfo, src, dst, ws: str, wd: str, non_blocking: bool, at: str | None,
               bumps: int = 1) -> None:
        """A copy between host (``ws`` or ``wd``: ``"host"``) and device memory, and what torch
        does after it: the stream synchronization of a blocking one, the pinned allocator's event
        after a non-blocking one from or to its memory. ``bumps``: 1 where ``dst`` is written in
        place (its version counter moves once the op returns), 0 for a new tensor."""
        device_side = src if ws == "device" else dst
        stream = self.platform.stream_key(device_side)
        src_span, dst_span = self.span(src, ws, at), self.span(dst, wd, at)
        if src_span is None or dst_span is None:
            return
        n = min(src_span[2], dst_span[2])
        self.rec.copy(stream, info.name, src_span[:2] + (n,), dst_span[:2] + (n,), at)
        if src_span[2] != dst_span[2]:
            # a copy that converts dtype or layout: the rest of the longer side, in stream order
            rest = (src_span, "reads") if src_span[2] > n else (dst_span, "writes")
            span = rest[0][:1] + (rest[0][1] + n, rest[0][2] - n)
            self.rec.kernel(stream, info.name, [span] if rest[1] == "reads" else [],
                            [span] if rest[1] == "writes" else [], at)
        if not non_blocking:
            self.rec.synchronized_by_op(stream, at)
        else:
            host = src_span[0] if ws == "host" else dst_span[0]
            if self.rec.memory.allocations[host].space == HOST_SPACE["pinned"]:
                self.rec.host_copy_fenced(host, stream, at)
        if ws == "host" and src.dtype == torch.int64:
            # copy_ writes dst in place: torch bumps its version counter once this op returns
            # (ADInplaceOrView runs above the dispatcher hook); _to_copy's output stays at 0
            self._remember_pointers(dst, src, bumps=bumps)

    def values(self, t: torch.Tensor) -> np.ndarray | None:
        """An int64 tensor's values as a numpy array (a device tensor: from the host copy that
        filled it, else read back); None for a tensor that is no memory (meta, a FakeTensor)."""
        where = self.platform.where(t)
        if where is None:
            return None
        if where != "device":
            return _flat(t)
        logged = type(t) is LoggedTensor
        entry = self._pointers.get(t.data_ptr())
        if entry is not None:
            allocation, version, values = entry
            try:
                current = t._version
            except (RuntimeError, AttributeError):  # inference tensors have no version counter (a logged one: unset)
                current = version
            if self.rec.memory.find(t.data_ptr()) is allocation and current == version and len(values) == t.numel():
                return values
        self.rec.notes["pointer tensors read back from the device (no host copy of them seen)"] += 1
        if logged:  # read back by the op log at the call, on the current stream
            return _flat(t)
        with self._internal():
            return self.platform.read_values(t)

    def _remember_pointers(self, dst: torch.Tensor, src: torch.Tensor, bumps: int) -> None:
        if not (dst.is_contiguous() and src.numel() == dst.numel() and dst.numel()):
            return
        allocation = self.rec.memory.find(dst.data_ptr())
        try:
            version = dst._version + bumps
        except (RuntimeError, AttributeError):  # an inference tensor: no version counter
            version = 0
        self._pointers[dst.data_ptr()] = (allocation, version, _flat(src).copy())
        self._pointers.move_to_end(dst.data_ptr())
        while len(self._pointers) > POINTER_TABLES:
            self._pointers.popitem(last=False)

    def resolve(self, addresses: np.ndarray, lengths: np.ndarray, what: str, at: str | None):
        """Allocation indices and offsets of raw ranges; what no allocation holds is learnt from
        the allocator's snapshot and CUDA's host allocations, else kept unresolved."""
        memory = self.rec.memory
        index, offset, found = memory.resolve_batch(addresses, lengths)
        if found.all():
            return index, offset
        # what lies in a placeholder was looked for already: memory made since would have replaced it
        unknown = [i for i in np.flatnonzero(~found).tolist()
                   if (holder := memory.find(int(addresses[i]))) is None or not holder.placeholder]
        if unknown:
            self.learn(addresses[unknown])
            index, offset, found = memory.resolve_batch(addresses, lengths)
        if not found.all():
            index, offset = index.copy(), offset.copy()
            for i in np.flatnonzero(~found).tolist():
                a, n = int(addresses[i]), int(lengths[i])
                index[i], offset[i], _ = memory.unresolved_span(a, n, f"{what}[{i}] {memory.why_not(a, n)}", at)
        return index, offset

    def resolve_one(self, address: int, nbytes: int, at: str | None) -> tuple[int, int]:
        """``(allocation index, offset)`` of ``nbytes`` at ``address`` (see ``resolve``)."""
        index, offset = self.resolve(np.array([address], dtype=np.int64), np.array([nbytes], dtype=np.int64),
                                      "address", at)
        return int(index[0]), int(offset[0])

    def pointer_table(self, address: int) -> np.ndarray | None:
        """The values of the device pointer table at ``address``, where a host copy the recording
        saw filled it and its allocation is still the one it filled; else None."""
        entry = self._pointers.get(address)
        if entry is None or self.rec.memory.find(address) is not entry[0]:
            return None
        return entry[2]

    def resolve_both(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, at: str | None):
        """``_resolve`` of a swap's sources, then of its destinations: one lookup for both where
        every pointer lies in known memory (a swap's usual case)."""
        n = len(sizes)
        index, offset, found = self.rec.memory.resolve_batch(np.concatenate((src, dst)), np.concatenate((sizes, sizes)))
        if found.all():
            return index[:n], offset[:n], index[n:], offset[n:]
        return (*self.resolve(src, sizes, "src_ptrs", at), *self.resolve(dst, sizes, "dst_ptrs", at))

    def learn(self, addresses: np.ndarray) -> None:
        """Learn the allocations that hold ``addresses`` (int64, shape ``(n,)``) where the map has
        none: from the caching allocator's snapshot, else from CUDA's host allocations."""
        memory = self.rec.memory
        unknown = [a for a in sorted(set(addresses.tolist()))
                   if (holder := memory.find(a)) is None or holder.placeholder]
        if not unknown:  # (a native launch's words, most of the time): no snapshot of the allocator
            return
        blocks = sorted(self.platform.allocator_blocks())
        starts = [b for b, _ in blocks]
        for address in unknown:
            if (holder := memory.find(address)) is not None and not holder.placeholder:
                continue  # a block learnt for an earlier address holds this one too
            i = np.searchsorted(starts, address, side="right") - 1 if starts else -1
            if i >= 0 and address < blocks[i][0] + blocks[i][1]:
                memory.known(blocks[i][0], blocks[i][1], DEVICE_SPACE, "a caching-allocator block")
                continue
            host = self.platform.host_range(address)
            if host is not None:
                memory.known(host[0], host[1], host[2], "CUDA host memory made outside torch")

    def _swap(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        tables = [self.values(args[k] if k < len(args) else kwargs.get(name)) for k, name, _, _ in info.tensor_args[:3]]
        if any(t is None for t in tables):  # run on tensors that are no memory (FakeTensorMode): no device work
            return
        src, dst, sizes = (t.astype(np.int64, copy=False) for t in tables)
        if not len(sizes):
            return
        order = SrcAccessOrder.STREAM
        for name in SWAP_ORDER_ARGS:
            value = _argument(info, args, kwargs, name)
            if value is not None:
                if name == "is_src_access_order_any":
                    order = SrcAccessOrder.ANY if value else SrcAccessOrder.STREAM
                else:
                    order = SrcAccessOrder(int(value))
        at = self.locate(HANDLER_DEPTH)
        s_index, s_offset, d_index, d_offset = self.resolve_both(src, dst, sizes, at)
        stream = self.platform.stream_key(None)
        # sizes may be a view of the program's tensor: the log keeps its own copy
        self.rec.copy_batch(stream, info.name, order.name,
                            CopyArrays(s_index, s_offset, d_index, d_offset, sizes.copy()), at)

    def _swap_loop(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        # one cudaMemcpyAsync per entry: stream-ordered, and ordered among themselves
        tables = [self.values(t) for t in args[:3]]
        if any(t is None for t in tables):  # (as _swap)
            return
        src, dst, sizes = (t.astype(np.int64, copy=False) for t in tables)
        at = self.locate(HANDLER_DEPTH)
        s_index, s_offset, d_index, d_offset = self.resolve_both(src, dst, sizes, at)
        stream = self.platform.stream_key(None)
        for si, so, di, do, n in zip(s_index.tolist(), s_offset.tolist(), d_index.tolist(), d_offset.tolist(),
                                     sizes.tolist()):
            self.rec.copy(stream, info.name, (si, so, n), (di, do, n), at)

    def _pointer_kernel(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        at = self.locate(HANDLER_DEPTH)
        stream, reads, writes, host_reads, host_writes = self._accesses(info, args, kwargs, out, at)
        ptrs = _argument(info, args, kwargs, "block_ptrs")
        block_bytes = int(_argument(info, args, kwargs, "block_bytes"))
        table = self.values(ptrs)
        if table is None:  # (as _swap)
            return
        addresses = table.astype(np.int64, copy=False)
        if len(addresses):
            lengths = np.full(len(addresses), block_bytes, dtype=np.int64)
            index, offset = self.resolve(addresses, lengths, "block_ptrs", at)
            spans = [(i, o, block_bytes) for i, o in zip(index.tolist(), offset.tolist())]
            (writes if POINTER_KERNELS[info.qualified] == "writes" else reads).extend(spans)
        if stream is None:
            stream = self.platform.stream_key(None)
        self._emit(info, stream, reads, writes, host_reads, host_writes, at)

    def _record_stream(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        t, stream = args[0], _argument(info, args, kwargs, "s")
        if self.platform.where(t) == "device":
            self.rec.stream_used(t.untyped_storage().data_ptr(), self.platform.stream_key_of(stream))

    def _host_memory(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        at = self.locate(HANDLER_DEPTH)
        if info.qualified == "kvverify::host_alloc":
            address, nbytes, space = int(out), int(_argument(info, args, kwargs, "nbytes")), HOST_SPACE["pinned"]
        else:
            address = int(_argument(info, args, kwargs, "ptr"))
            nbytes, space = int(_argument(info, args, kwargs, "nbytes")), HOST_SPACE["registered"]
        self.rec.allocated(address, nbytes, space, info.qualified, at)

    def _host_release(self, info: OpInfo, args: tuple, kwargs: dict, out) -> None:
        # cudaFreeHost / cudaHostUnregister order nothing of their own in the trace format's terms:
        # device work still pending on the bytes races with the release
        memory = self.rec.memory
        released = memory.retire(int(_argument(info, args, kwargs, "ptr")))
        if released is not None:
            self.rec.released([(released.index, 0, released.size)], info.name, self.locate(HANDLER_DEPTH))


def _is_swap_schema(schema) -> bool:
    args = schema.arguments
    tensors = [a for a in args[:3] if str(a.type) == "Tensor"]
    return len(tensors) == 3 and any(a.name in SWAP_ORDER_ARGS for a in args[3:])
