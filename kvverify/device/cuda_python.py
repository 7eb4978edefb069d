"""An independent implementation of the batched swap through cuda-python.

It shares nothing with ``csrc/op/swap_blocks.cpp`` but the CUDA driver: the GPU tests run the
same batches through both and compare the bytes, so a bug in either shows as a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvverify.terms import SrcAccessOrder


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ImportError(
            "the cuda-python backend needs the cuda-python package (`pip install cuda-python`)"
        ) from exc
    if not hasattr(driver, "cuMemcpyBatchAsync"):
        raise RuntimeError("this cuda-python is older than CUDA 12.8 and has no cuMemcpyBatchAsync")
    return driver


def swap_blocks_batch(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], sizes: Sequence[int], order: SrcAccessOrder) -> None:
    """Issue one ``cuMemcpyBatchAsync`` with one ``CUmemcpyAttributes`` for all copies, on the
    current torch stream (a side stream on the legacy default stream, as the extension does).

    Arguments are validated by the caller (``kvverify.device.ops.validate_batch``): byte addresses and
    sizes in bytes, equal lengths, ``n > 0``.

    Raises:
        RuntimeError: the driver's CUresult name and, where the binding returns it, the failing copy.
    """
    import torch

    driver = _driver()
    current = torch.cuda.current_stream()
    _bind_primary_context(driver, current.device.index)
    attr = driver.CUmemcpyAttributes()
    attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder(int(order))
    dsts = [driver.CUdeviceptr(p) for p in dst_ptrs]
    srcs = [driver.CUdeviceptr(p) for p in src_ptrs]

    def issue(stream: torch.cuda.Stream) -> None:
        out = driver.cuMemcpyBatchAsync(
            dsts, srcs, list(sizes), len(sizes), [attr], [0], 1, driver.CUstream(stream.cuda_stream)
        )
        # cuda-python 12.x returns (CUresult, failIdx); 13.x returns (CUresult,).
        result = out[0]
        if result != driver.CUresult.CUDA_SUCCESS:
            where = f" at copy {out[1]} of {len(sizes)}" if len(out) > 1 else ""
            _, name = driver.cuGetErrorName(result)
            label = name.decode() if isinstance(name, bytes) else str(result)
            raise RuntimeError(f"cuMemcpyBatchAsync failed{where}: {label} (srcAccessOrder={int(order)})")

    if current.cuda_stream != 0:
        issue(current)
        return
    # Legacy NULL stream: refused by the batch API (CUDA Driver API, cuMemcpyBatchAsync).
    side = torch.cuda.Stream()
    side.wait_stream(current)
    issue(side)
    current.wait_stream(side)


def _bind_primary_context(driver, device: int) -> None:
    """Make ``device``'s primary context current on this thread where none is: the runtime binds
    it only at a thread's first runtime call that needs it (CUDA Runtime API, "Interactions with the
    CUDA Driver API"), and a worker thread's first driver call would fail with
    CUDA_ERROR_INVALID_VALUE. Raises RuntimeError when the runtime refuses the device."""
    from cuda.bindings import runtime

    err, ctx = driver.cuCtxGetCurrent()
    if err == driver.CUresult.CUDA_SUCCESS and int(ctx) != 0:
        return
    (err,) = runtime.cudaSetDevice(device)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaSetDevice({device}) failed: {err.name}: cannot make the device's context current on "
                           "this thread")


MEMORY_TYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}  # CUmemorytype values


def pointer_range(address: int) -> tuple[str, int, int] | None:
    """What CUDA knows of byte ``address``: ``(memory type, base, bytes)`` of the allocation
    holding it (memory type: ``"host"`` for ``cudaHostAlloc`` / ``cudaHostRegister`` memory,
    ``"device"`` for ``cudaMalloc`` memory, as ``CUmemorytype`` says), or None where CUDA does not
    know the address (pageable host memory, an unmapped address), cuda-python is not installed, or
    there is no CUDA context. CUDA Driver API ``cuPointerGetAttribute``
    (``CU_POINTER_ATTRIBUTE_MEMORY_TYPE``, ``_RANGE_START_ADDR``, ``_RANGE_SIZE``). Never raises.
    """
    try:
        from cuda.bindings import driver as d

        attrs = d.CUpointer_attribute
        values = []
        for attr in (attrs.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, attrs.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                     attrs.CU_POINTER_ATTRIBUTE_RANGE_SIZE):
            err, value = d.cuPointerGetAttribute(attr, int(address))
            if err != d.CUresult.CUDA_SUCCESS:
                return None
            values.append(int(value))
    except Exception:
        return None
    kind, base, size = values
    if kind not in MEMORY_TYPES or size <= 0 or not base <= address < base + size:
        return None
    return MEMORY_TYPES[kind], base, size
