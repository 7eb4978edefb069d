"""Exact-size host memory of the three kinds the harness tests.

- ``pinned``: ``cudaHostAlloc`` (page-locked, mapped for the device under UVA);
- ``registered``: page-aligned memory from the process heap pinned with ``cudaHostRegister``;
- ``pageable``: page-aligned memory from the process heap, never pinned.

torch's pinned allocator rounds requests up to a power of two and caches blocks; the harness
sizes pools exactly and frees them at exit, so it allocates through ``kvverify._C`` instead.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from kvverify.device import extension
from kvverify.terms import HOST_MEMORY_KINDS

PAGE = mmap.PAGESIZE


class HostBuffer:
    """``nbytes`` of host memory of one kind at byte address ``ptr``.

    Use as a context manager or call ``free()`` (idempotent). ``numpy(dtype)`` is a view of the
    bytes, valid until ``free()``.
    """

    def __init__(self, kind: str, nbytes: int):
        if kind not in HOST_MEMORY_KINDS:
            raise ValueError(f"unknown host memory kind {kind!r}; use one of {HOST_MEMORY_KINDS}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.kind = kind
        self.nbytes = int(nbytes)
        self._heap: np.ndarray | None = None  # owns the bytes of registered / pageable memory
        if kind == "pinned":
            self.ptr = int(extension.ops().host_alloc(self.nbytes))
        else:
            # Whole pages from a page boundary: cudaHostRegister pins pages, and the DMA engine
            # moves pageable memory through staging buffers page by page.
            heap = np.empty(self.nbytes + PAGE, dtype=np.uint8)
            start = (-heap.ctypes.data) % PAGE
            self._heap = heap
            self.ptr = int(heap.ctypes.data + start)
            if kind == "registered":
                extension.ops().host_register(self.ptr, self.nbytes)
        self._live = True

    def numpy(self, dtype=np.uint64) -> np.ndarray:
        """A 1-D view of the buffer's bytes as ``dtype`` (``nbytes`` must divide evenly)."""
        if not self._live:
            raise RuntimeError(f"{self.kind} host buffer at {self.ptr:#x} was freed")
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=np.uint8).view(dtype)

    def free(self) -> None:
        """Release the memory (unregister / cudaFreeHost); safe to call twice."""
        if not getattr(self, "_live", False):
            return
        self._live = False
        if self.kind == "pinned":
            extension.ops().host_free(self.ptr)
        elif self.kind == "registered":
            extension.ops().host_unregister(self.ptr)
        self._heap = None

    def abandon(self) -> None:
        """Leave the bytes to the process exit: ``free()`` and ``__del__`` become no-ops and the memory
        stays mapped. For memory a stuck stream may still touch: freeing pinned or registered memory
        synchronizes the device, which would hang on that very work."""
        self._live = False

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __del__(self):
        # A last resort for buffers dropped without free(); interpreter shutdown may already
        # have torn the extension down, and then the OS reclaims the memory anyway.
        try:
            self.free()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"HostBuffer(kind={self.kind!r}, nbytes={self.nbytes}, ptr={self.ptr:#x})"


def allocate_host(kind: str, nbytes: int) -> HostBuffer:
    """Allocate exactly ``nbytes`` bytes of host memory of ``kind`` (see module docstring).

    Raises:
        ValueError: an unknown kind or ``nbytes <= 0``.
        RuntimeError: the CUDA allocation or registration failed (e.g. out of pinnable memory).
        kvverify.device.extension.ExtensionUnavailableError: pinned/registered memory without the extension.
    """
    return HostBuffer(kind, nbytes)
