"""The batched swap op: ``swap_blocks_batch`` under the three source access orders, and its copy paths.

Thin wrapper over ``torch.ops.kvverify.swap_blocks_batch`` (the extension, ``csrc/op/swap_blocks.cpp``)
with a second, independent backend through cuda-python (``kvverify.device.cuda_python``); the GPU
tests cross-check the two. Semantics follow the CUDA Driver API reference of
``cuMemcpyBatchAsync`` (CUDA 12.8+): the batch as a whole runs in stream order, the copies
inside it in no particular order, and ``srcAccessOrder`` says when the source may be read.

Three copy paths serve one batch (``method=``): the driver's batch, one ``cudaMemcpyAsync`` per
copy, and thread blocks of a kernel (``torch.ops.kvverify.swap_blocks_kernel``,
``csrc/op/copy_kernel.cu``). The last two are stream-ordered on both sides: their contract is
``STREAM``'s whatever order is asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvverify.device import extension
from kvverify.terms import SrcAccessOrder

if TYPE_CHECKING:
    import torch


BACKENDS = ("extension", "cuda-python")
BATCH, LOOP, KERNEL = "batch", "loop", "kernel"
METHODS = (BATCH, LOOP, KERNEL)
"""Copy paths: ``cuMemcpyBatchAsync``; one ``cudaMemcpyAsync`` per copy; an SM kernel through UVA."""

IndexLike = "torch.Tensor | Sequence[int]"


def resolve_order(
    src_access_order: SrcAccessOrder | int | str | None, is_src_access_order_any: bool | None
) -> SrcAccessOrder:
    """Return the order the caller asked for, from either argument (never both).

    ``src_access_order`` may be a ``SrcAccessOrder``, its integer value or its name (any case);
    ``None`` means ``STREAM`` unless ``is_src_access_order_any`` is given (``True``: ``ANY``,
    ``False``: ``STREAM``), the serving-engine spelling this op is a drop-in for.

    Raises:
        ValueError: both arguments given, or an unknown order.
        TypeError: an order of another type (a bool included: it is not an order).
    """
    if is_src_access_order_any is not None:
        if src_access_order is not None:
            raise ValueError(
                "give either src_access_order or is_src_access_order_any, not both "
                f"(got {src_access_order!r} and {is_src_access_order_any!r})"
            )
        if not isinstance(is_src_access_order_any, bool):
            raise TypeError(f"is_src_access_order_any must be a bool, got {type(is_src_access_order_any).__name__}")
        return SrcAccessOrder.ANY if is_src_access_order_any else SrcAccessOrder.STREAM
    if src_access_order is None:
        return SrcAccessOrder.STREAM
    if isinstance(src_access_order, bool):
        raise TypeError("src_access_order must be a SrcAccessOrder, int or name, got a bool")
    if isinstance(src_access_order, str):
        try:
            return SrcAccessOrder[src_access_order.upper()]
        except KeyError:
            raise ValueError(
                f"unknown src_access_order {src_access_order!r}; use one of {[o.name for o in SrcAccessOrder]}"
            ) from None
    if isinstance(src_access_order, int):
        try:
            return SrcAccessOrder(src_access_order)
        except ValueError:
            raise ValueError(
                f"unknown src_access_order {src_access_order}; use 1 (STREAM), 2 (DURING_API_CALL) or 3 (ANY)"
            ) from None
    raise TypeError(f"src_access_order must be a SrcAccessOrder, int or name, got {type(src_access_order).__name__}")


def resolve_method(method: str, use_batch_api: bool) -> str:
    """The copy path from ``method`` and the older ``use_batch_api=False`` (which means ``"loop"``).

    Raises:
        ValueError: an unknown method, or ``use_batch_api=False`` with a method other than ``"batch"``
            or ``"loop"`` (two different paths asked for).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    if use_batch_api:
        return method
    if method == KERNEL:
        raise ValueError("use_batch_api=False asks for the per-copy loop, method='kernel' for the kernel path; "
                         "give one of them (method='loop' is the same as use_batch_api=False)")
    return LOOP


def _as_index_tensor(values: IndexLike, name: str) -> torch.Tensor:
    """A sequence of ints becomes an int64 CPU tensor; a tensor is passed through unchanged
    (a tensor of the wrong dtype, shape or device is the caller's mistake, reported by
    ``validate_batch``, not silently converted)."""
    import torch

    if isinstance(values, torch.Tensor):
        return values
    try:
        return torch.as_tensor(values, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{name} must be an int64 tensor or a sequence of ints ({exc})") from None


def validate_batch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, *,
                   whole_words: bool = False) -> int:
    """Check a batch before anything is issued; return the number of copies.

    Mirrors the checks the C++ ops make for direct ``torch.ops`` callers, for the cuda-python
    backend (which has no C++ in front of it) and ahead of ``check_pointers``. ``whole_words``: the
    kernel path's rule too, every size and address a multiple of 8 bytes.

    Raises:
        TypeError: a tensor that is not int64.
        ValueError: a tensor that is not 1-D or not on the CPU, lengths that differ, a size
            ``<= 0`` bytes, a null pointer, with ``whole_words`` a size or address that is not a
            multiple of 8, or no CUDA device for a non-empty batch.
    """
    import torch

    for name, t in (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got {t.dim()} dimensions")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU (it is read by the host), got {t.device}")
    n = src_ptrs.numel()
    if dst_ptrs.numel() != n or sizes.numel() != n:
        raise ValueError(
            f"src_ptrs, dst_ptrs and sizes must have the same length, got {n}, {dst_ptrs.numel()} and {sizes.numel()}"
        )
    if n == 0:
        return 0
    for name, t, bad in (("sizes", sizes, sizes <= 0), ("src_ptrs", src_ptrs, src_ptrs == 0), ("dst_ptrs", dst_ptrs, dst_ptrs == 0)):
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            what = f"must be > 0 bytes, got {int(t[i])}" if name == "sizes" else "is a null pointer"
            raise ValueError(f"{name}[{i}] {what}")
    if whole_words:
        for name, t in (("sizes", sizes), ("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs)):
            bad = t % 8 != 0
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                what = f"= {int(t[i])} bytes is not a multiple of 8" if name == "sizes" else f"= {int(t[i])} is not 8-byte aligned"
                raise ValueError(f"{name}[{i}] {what}: the kernel copy path moves whole 8-byte words; use method='batch'")
    if not torch.cuda.is_available():
        raise ValueError("swap_blocks_batch needs a CUDA device, and none is visible")
    return n


def swap_blocks_batch(
    src_ptrs: IndexLike,
    dst_ptrs: IndexLike,
    sizes: IndexLike,
    src_access_order: SrcAccessOrder | int | str | None = None,
    *,
    is_src_access_order_any: bool | None = None,
    use_batch_api: bool = True,
    method: str = BATCH,
    backend: str = "extension",
    check_pointers: bool = True,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every ``i``, asynchronously,
    on the current torch CUDA stream of the current device.

    Args:
        src_ptrs, dst_ptrs: raw byte addresses (device, pinned, registered or pageable host
            memory), 1-D int64 CPU tensors of shape ``(n,)`` or sequences of ints.
        sizes: bytes per copy, same shape, each ``> 0``.
        src_access_order: when the driver may read each source (``SrcAccessOrder``, its value or
            its name; default ``STREAM``). Follows CUDA Driver API ``cuMemcpyBatchAsync``.
        is_src_access_order_any: the serving-engine spelling: ``True`` means ``ANY``, ``False``
            ``STREAM``. Giving both order arguments is an error.
        method: the copy path (``METHODS``). ``"batch"``: one ``cuMemcpyBatchAsync``.
            ``"loop"``: one ``cudaMemcpyAsync(cudaMemcpyDefault)`` per copy. ``"kernel"``: thread
            blocks copy the pages through UVA (``torch.ops.kvverify.swap_blocks_kernel``; CUDA
            Programming Guide, "Mapped Memory"): every size and address a multiple of 8 bytes,
            device memory of the current device, host memory pinned (``cudaHostAlloc``) or
            registered with ``cudaHostRegisterMapped``; pageable memory is refused (a kernel cannot
            read it), see ``check_pointers``. The loop and the kernel are stream-ordered on both
            sides whatever order is asked (``STREAM``'s contract, which every order permits), and
            so is the batch when the driver lacks ``cuMemcpyBatchAsync`` (before CUDA 12.8).
        use_batch_api: ``False`` is the older spelling of ``method="loop"``.
        backend: ``"extension"`` (``kvverify._C``) or ``"cuda-python"``
            (``cuda.bindings.driver.cuMemcpyBatchAsync``, an independent implementation of the
            batch; it serves ``method="batch"`` only).
        check_pointers: look every address up first (``cuPointerGetAttributes``; a host read
            probe for addresses CUDA does not know) and reject, with a ``ValueError`` naming the
            copy, a device copy running past its allocation or an address that is neither CUDA
            memory nor mapped host memory. The driver treats such an address as pageable host
            memory and the process dies with SIGSEGV (docs/op.md). For ``method="kernel"`` it
            also rejects what a kernel cannot dereference (pageable memory, host memory not mapped
            at its address, another device's memory): a kernel touching it faults and ends the
            CUDA context. Costs a lookup per address (two for the kernel path); ``False`` skips it.
            Direct ``torch.ops`` callers never get it, nor does the cuda-python backend where the
            extension is not built.

    An empty batch is a no-op. On torch's default stream (the legacy NULL stream, which
    ``cuMemcpyBatchAsync`` refuses) the batch runs on a side stream joined to the current
    stream by events both ways, which keeps every order's semantics.

    Raises:
        TypeError, ValueError: bad arguments (named in the message), before any copy is issued;
            for ``method="kernel"`` also a size or address that is not a multiple of 8 bytes.
        RuntimeError: the driver refused the batch; the message names the CUresult and, where
            the driver reports it (12.8 signature), the failing copy. The context stays usable.
        kvverify.device.extension.ExtensionUnavailableError: torch or the extension is missing.
    """
    order = resolve_order(src_access_order, is_src_access_order_any)
    path = resolve_method(method, use_batch_api)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if backend == "extension":
        kv = extension.ops()
        src, dst, size = (_as_index_tensor(v, n) for v, n in ((src_ptrs, "src_ptrs"), (dst_ptrs, "dst_ptrs"), (sizes, "sizes")))
        if check_pointers and validate_batch(src, dst, size, whole_words=path == KERNEL) > 0:
            kv.check_pointers(src, dst, size, path == KERNEL)
        if path == BATCH:
            kv.swap_blocks_batch(src, dst, size, int(order))
        elif path == LOOP:
            kv.swap_blocks_loop(src, dst, size)
        else:
            kv.swap_blocks_kernel(src, dst, size)
        return
    if path != BATCH:
        raise ValueError(f"method={path!r} is served by the extension backend only; use backend='extension'")
    src, dst, size = (_as_index_tensor(v, n) for v, n in ((src_ptrs, "src_ptrs"), (dst_ptrs, "dst_ptrs"), (sizes, "sizes")))
    if validate_batch(src, dst, size) == 0:
        return
    if check_pointers and extension.load_error() is None:  # the check lives in the extension
        extension.ops().check_pointers(src, dst, size)
    from kvverify.device import cuda_python

    cuda_python.swap_blocks_batch(src.tolist(), dst.tolist(), size.tolist(), order)


def batch_api_available() -> bool:
    """Whether this host's driver offers ``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers).

    Raises ``ExtensionUnavailableError`` where the extension is missing.
    """
    return bool(extension.ops().batch_api_available())


def _register_fakes() -> None:
    # torch.compile and opcheck trace the op with fake tensors: it has no outputs to shape.
    import torch

    for name in ("swap_blocks_batch", "swap_blocks_loop", "swap_blocks_kernel"):
        torch.library.register_fake(f"kvverify::{name}")(lambda *args, **kwargs: None)


if extension.load_error() is None:
    _register_fakes()
