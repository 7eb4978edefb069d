"""vllm-project/vllm#45268: the KV pool unmapped for sleep mode while a store still reads it.

Public source: https://github.com/vllm-project/vllm/issues/45268 (open in the stored copy) reports
only the symptom: the engine dies on the first request after a sleep/wake cycle when native KV
offloading and sleep mode are both on. Root cause, as the fix attempt that names #45268 states it
(https://github.com/vllm-project/vllm/pull/45363, closed in the stored copy):
``CuMemAllocator.sleep()`` unmapped and released the pool's memory without synchronizing the
offloading connector's transfer streams, so a GPU->CPU store still in flight read an unmapped
address, which poisons the CUDA context. The fix synchronizes the device before the allocator
unmaps.

Re-created with the driver's virtual memory API, as a sleep-capable allocator maps its pool: a store
from the pool to pinned host memory queued behind a spin, then the unmap. Only the fixed form is
ever executed: the broken one (the same without the synchronize in ``sleep_mode``) would make the
DMA read an unmapped address and could leave the context unusable for everything after it, so no
recording can show it either; the fixed form's ``cuMemMap`` and ``cuMemUnmap`` are recorded where
cuda-python is called.
"""

from __future__ import annotations

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    PAGE_BYTES,
    PAGES,
    is_fixed,
    pinned_pages,
    spin,
    swap_args,
    witness,
)

NOT_RUN = "not run: unmapping memory under a DMA can fault the CUDA context for the rest of the process"

CASE = Case(
    name="vllm-45268", source="vllm-project/vllm#45268", url="https://github.com/vllm-project/vllm/issues/45268",
    root_cause="sleep mode unmaps the KV pool (cuMemUnmap) while a GPU->CPU store from it is in flight",
    hazard="release", capture="native", kind="FREE", pair=("store", "sleep_mode"),
    witness="host pages of the store that do not hold the pool's bytes (fixed form only)", module=__name__,
    unseen="the race itself is never run (a DMA from unmapped memory can end the context); the fixed form's "
           "cuMemMap and cuMemUnmap are recorded through cuda-python", not_run=NOT_RUN)

KV = 0x4D
DEVICE_INDEX = 0
# The lookup was written for memory the runtime allocates; the pool's addresses are this mapping's
# own, and a mapping's range attributes are not worth a failed run on a driver that reports them
# otherwise.
CHECK_POINTERS = False


def _ok(result):
    """The value of a cuda-python call's ``(CUresult, value...)``; RuntimeError naming the error."""
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(result[0])
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else result[0]}")
    return result[1] if len(result) > 1 else None


def map_pool(nbytes: int) -> tuple[int, int, object]:
    """Map at least ``nbytes`` of device memory on cuda:0 with the virtual memory API; return
    ``(address, bytes, handle)``."""
    from cuda.bindings import driver as d

    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = DEVICE_INDEX
    grain = _ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    size = -(-nbytes // grain) * grain
    handle = _ok(d.cuMemCreate(size, prop, 0))
    address = _ok(d.cuMemAddressReserve(size, 0, 0, 0))
    _ok(d.cuMemMap(address, size, 0, handle, 0))
    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = DEVICE_INDEX
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(d.cuMemSetAccess(address, size, [access], 1))
    return int(address), size, handle


def store(pool: int, host, offload) -> None:
    """The connector's store of the pool's pages to ``host`` on ``offload``, behind earlier transfers."""
    import torch

    from kvverify.device import ops

    spin(offload)
    with torch.cuda.stream(offload):
        ops.swap_blocks_batch(*swap_args(pool, host), check_pointers=CHECK_POINTERS)


def sleep_mode(pool: int, size: int, handle) -> None:
    """The allocator's sleep: drain the device (the fix), then unmap and release the pool."""
    import torch
    from cuda.bindings import driver as d

    torch.cuda.synchronize()
    _ok(d.cuMemUnmap(pool, size))
    _ok(d.cuMemRelease(handle))
    _ok(d.cuMemAddressFree(pool, size))


def run(form: str) -> Witness:
    """The fixed form on cuda:0 (count the stored pages that do not hold the pool's bytes); the
    broken form is not executed (its witness says so). Needs cuda-python."""
    import torch

    from kvverify.device import ops

    if not is_fixed(form):
        return Witness(corrupted=0, total=0, note=NOT_RUN)
    source, host = pinned_pages(PAGES, KV), pinned_pages(PAGES)
    offload = torch.cuda.Stream()
    pool, size, handle = map_pool(PAGES * PAGE_BYTES)
    with torch.cuda.stream(offload):
        ops.swap_blocks_batch(*swap_args(source, pool), check_pointers=CHECK_POINTERS)  # the pool's KV
    store(pool, host, offload)
    sleep_mode(pool, size, handle)
    return witness(host, KV)
