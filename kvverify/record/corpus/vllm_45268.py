"""vllm-project/vllm#45268: the KV pool unmapped for sleep mode while a store still reads it.

Public source: https://github.com/vllm-project/vllm/issues/45268 (open in the stored copy) reports
only the symptom: the engine dies on the first request after a sleep/wake cycle when native KV
offloading and sleep mode are both on. Root cause, as the fix attempt that names #45268 states it
(https://github.com/vllm-project/vllm/pull/45363, closed in the stored copy):
``CuMemAllocator.sleep()`` unmapped and released the pool's memory without synchronizing the
offloading connector's transfer streams, so a GPU->CPU store still in flight read an unmapped
address, which poisons the CUDA context. The fix synchronizes the device before the allocator
unmaps.

Re-created with the driver's virtual memory API, as a sleep-capable allocator maps its pool (the
virtual range stays reserved across sleep, the physical memory is released): a store from the pool
to pinned host memory, then sleep. A DMA from an unmapped address could end the context, so the
broken form holds the store's stream on a host flag (the adversarial executor's gate) until fresh
memory is mapped at the pool's address again (the wake), then lets it go: the store reads the new
memory instead of the KV, a corrupted page the host sees, and the context survives. The unmap and
the map are cuda-python calls the recording sees.
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

CASE = Case(
    name="vllm-45268", source="vllm-project/vllm#45268", url="https://github.com/vllm-project/vllm/issues/45268",
    root_cause="sleep mode unmaps the KV pool (cuMemUnmap) while a GPU->CPU store from it is in flight",
    hazard="release", capture="recorded", kind="FREE", pair=("store", "sleep_mode"),
    witness="host pages of the store that do not hold the pool's bytes (the held store reads the memory mapped "
            "at the pool's address after the wake)", module=__name__)

KV = 0x4D
DEVICE_INDEX = 0
GATE_DEADLINE_S = 10.0  # the watchdog's release of a hold the case forgot: never a hang
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


def _properties():
    from cuda.bindings import driver as d

    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = DEVICE_INDEX
    return prop


def _access():
    from cuda.bindings import driver as d

    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = DEVICE_INDEX
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return access


def map_pool(nbytes: int) -> tuple[int, int, object]:
    """Map at least ``nbytes`` of device memory on cuda:0 with the virtual memory API; return
    ``(address, bytes, handle)``."""
    from cuda.bindings import driver as d

    prop = _properties()
    grain = _ok(d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    size = -(-nbytes // grain) * grain
    handle = _ok(d.cuMemCreate(size, prop, 0))
    address = _ok(d.cuMemAddressReserve(size, 0, 0, 0))
    _ok(d.cuMemMap(address, size, 0, handle, 0))
    _ok(d.cuMemSetAccess(address, size, [_access()], 1))
    return int(address), size, handle


def store(pool: int, host, offload) -> None:
    """The connector's store of the pool's pages to ``host`` on ``offload``, behind earlier transfers."""
    import torch

    from kvverify.device import ops

    spin(offload)
    with torch.cuda.stream(offload):
        ops.swap_blocks_batch(*swap_args(pool, host), check_pointers=CHECK_POINTERS)


def sleep_mode(pool: int, size: int, handle, fixed: bool) -> None:
    """The allocator's sleep: drain the device (the fix), then unmap and release the pool's
    physical memory (its virtual range stays reserved for the wake)."""
    import torch
    from cuda.bindings import driver as d

    if fixed:
        torch.cuda.synchronize()
    _ok(d.cuMemUnmap(pool, size))
    _ok(d.cuMemRelease(handle))


def wake(pool: int, size: int):
    """Fresh physical memory at the pool's address, zeroed; returns its handle."""
    from cuda.bindings import driver as d

    handle = _ok(d.cuMemCreate(size, _properties(), 0))
    _ok(d.cuMemMap(pool, size, 0, handle, 0))
    _ok(d.cuMemSetAccess(pool, size, [_access()], 1))
    _ok(d.cuMemsetD8(pool, 0, size))  # the legacy stream: the held store's stream does not wait for it
    return handle


def run(form: str) -> Witness:
    """One form on cuda:0; counts the stored pages that do not hold the pool's bytes. Needs cuda-python."""
    import torch
    from cuda.bindings import driver as d

    from kvverify.device import ops
    from kvverify.device.gate import StreamGate

    source, host = pinned_pages(PAGES, KV), pinned_pages(PAGES)
    offload = torch.cuda.Stream()
    pool, size, handle = map_pool(PAGES * PAGE_BYTES)
    gate = StreamGate(torch.device("cuda", DEVICE_INDEX), deadline_s=GATE_DEADLINE_S)
    try:
        with torch.cuda.stream(offload):
            ops.swap_blocks_batch(*swap_args(source, pool), check_pointers=CHECK_POINTERS)  # the pool's KV
        fixed = is_fixed(form)
        if not fixed:
            gate.hold(offload)  # the store below cannot start before the wake maps memory again
        store(pool, host, offload)
        sleep_mode(pool, size, handle, fixed)
        awake = wake(pool, size)
        gate.release_all()
        torch.cuda.synchronize()
        expired = gate.expired
    finally:
        gate.close()
    _ok(d.cuMemUnmap(pool, size))
    _ok(d.cuMemRelease(awake))
    _ok(d.cuMemAddressFree(pool, size))
    note = (f"the stream hold was released by its watchdog after {GATE_DEADLINE_S:g} s: the store may have read "
            "the pool before the unmap") if expired else None
    return witness(host, KV, note)
