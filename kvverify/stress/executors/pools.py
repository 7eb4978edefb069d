"""Device and host memory of a stress run, sized once per host memory kind and freed on close.

- GPU pool: ``num_tensors`` cache tensors of ``gpu_slots`` pages each, in one allocation;
  a block's pages sit at ``layout.page_ptrs`` (engine pointer math).
- host pool: the same shape in exact-size host memory of the cell's kind
  (``kvverify.device.host_memory``: cudaHostAlloc, cudaHostRegister or plain pages).
- snapshot area (device): where the adversarial executor copies sources at API-call time.
- staging area (device) and its pinned bounce buffer, where host blocks are not reachable
  by kernels in place (pageable memory, registered memory the device cannot address at the
  host pointer) or ``--data random`` runs: host blocks are written and checked through it
  (a numpy pass over a GiB would be slower than the copies it checks).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvverify.device.host_memory import allocate_host
from kvverify.geometry import KVLayout
from kvverify.scenarios.program import GPU, Blocks


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    gpu_slots: int
    host_slots: int
    snapshot_pages: int
    staging_pages: int

    def device_bytes(self, layout: KVLayout) -> int:
        return (self.gpu_slots * layout.num_tensors + self.snapshot_pages + self.staging_pages) * layout.page_bytes

    def host_bytes(self, layout: KVLayout) -> int:
        """The host pool and, where there is a staging area, its pinned bounce buffer."""
        return (self.host_slots * layout.num_tensors + self.staging_pages) * layout.page_bytes


@dataclasses.dataclass
class PreparedBlocks:
    """Page addresses and pattern ids of a set of blocks, tensor-major (as an engine issues them)."""

    blocks: Blocks
    ptrs: np.ndarray  # int64 (pages,)
    ptrs_cuda: object  # torch int64 cuda tensor
    slots: np.ndarray  # int64 (blocks,)

    @property
    def pages(self) -> int:
        return len(self.ptrs)


class Pools:
    """Owns the memory; ``close()`` frees it and is idempotent (also called on Ctrl-C)."""

    def __init__(self, layout: KVLayout, host_kind: str, sizes: PoolSizes, device) -> None:
        import torch

        self.layout, self.host_kind, self.sizes, self.device = layout, host_kind, sizes, device
        self.page_bytes, self.tensors = layout.page_bytes, layout.num_tensors
        self.gpu = None
        self.host = self._bounce_host = None
        try:
            pb = self.page_bytes
            self.gpu = torch.empty(sizes.gpu_slots * self.tensors * pb, dtype=torch.uint8, device=device)
            self.snapshot = torch.empty((max(1, sizes.snapshot_pages), pb), dtype=torch.uint8, device=device)
            self.staging = torch.empty((max(1, sizes.staging_pages), pb), dtype=torch.uint8, device=device)
            self.host = allocate_host(host_kind, sizes.host_slots * self.tensors * pb)
            if sizes.staging_pages:
                # Pinned bounce buffer between the staging area and host pages the GPU cannot
                # reach: DMA at full speed, no page faults, exact size.
                kind = "pinned" if torch.device(device).type == "cuda" else "pageable"
                self._bounce_host = allocate_host(kind, sizes.staging_pages * pb)
                self.bounce = torch.from_numpy(self._bounce_host.numpy(np.uint8)).view(sizes.staging_pages, pb)
        except BaseException:
            self.close()
            raise
        self.host_in_place = host_kind == "pinned" or (
            host_kind == "registered" and torch.device(device).type == "cuda" and _kernels_reach(self.host.ptr)
        )
        self._bases = {
            GPU: [self.gpu.data_ptr() + t * sizes.gpu_slots * pb for t in range(self.tensors)],
            "host": [self.host.ptr + t * sizes.host_slots * pb for t in range(self.tensors)],
        }

    def prepare(self, blocks: Blocks) -> PreparedBlocks:
        """Page addresses of ``blocks`` in this pool layout."""
        import torch

        slots = np.asarray(blocks.slots, dtype=np.int64)
        limit = self.sizes.gpu_slots if blocks.pool == GPU else self.sizes.host_slots
        if slots.max() >= limit:
            raise ValueError(f"{blocks.pool} slot {slots.max()} outside the pool of {limit} slots")
        ptrs = self.layout.page_ptrs(self._bases[blocks.pool], slots).reshape(-1)
        return PreparedBlocks(blocks, ptrs, torch.from_numpy(ptrs).to(self.device), slots)

    def page_ids(self, content_ids: np.ndarray):
        """Pattern ids of the pages of blocks holding ``content_ids`` (tensor-major), on the device."""
        import torch

        t = np.arange(self.tensors, dtype=np.int64)[:, None]
        ids = (np.asarray(content_ids, dtype=np.int64)[None, :] * self.tensors + t).reshape(-1)
        return torch.from_numpy(ids).to(self.device)

    def host_pages(self) -> np.ndarray:
        """The host pool as uint64 ``(tensors, host_slots, page_words)`` (pageable access)."""
        return self.host.numpy(np.uint64).reshape(self.tensors, self.sizes.host_slots, self.page_bytes // 8)

    def snapshot_ptr(self, page: int) -> int:
        return self.snapshot.data_ptr() + page * self.page_bytes

    def staging_ptrs(self, pages: int):
        import torch

        if pages > self.sizes.staging_pages:
            raise ValueError(f"{pages} pages do not fit the staging area of {self.sizes.staging_pages}")
        base = self.staging.data_ptr()
        return torch.arange(pages, dtype=torch.int64, device=self.device) * self.page_bytes + base

    def host_buffers(self) -> list:
        """The host memory the pools own (``HostBuffer``), for a caller that must leave it to the
        process exit (``HostBuffer.abandon``)."""
        return [buf for buf in (self.host, self._bounce_host) if buf is not None]

    def close(self) -> None:
        self.gpu = self.snapshot = self.staging = self.bounce = None
        for buf in (self.host, self._bounce_host):
            if buf is not None:
                buf.free()
        self.host = self._bounce_host = None


def _kernels_reach(ptr: int) -> bool:
    """Whether kernels can use the host address ``ptr`` itself (UVA mapping of registered
    memory: cudaDevAttrCanUseHostPointerForRegisteredMem and a mapped registration). Where it
    cannot be asked, answer False: the staging path is slower but always right."""
    try:
        from cuda.bindings import driver as d

        err, value = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ptr)
        return err == d.CUresult.CUDA_SUCCESS and int(value) == ptr
    except Exception:
        return False
