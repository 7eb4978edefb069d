"""Slots of device memory or of one kind of host memory, with byte access from the host: the
source and destination of the op's byte-exact GPU tests (needs CUDA and ``kvverify._C``)."""

from __future__ import annotations

import numpy as np
import torch

from kvverify.device.host_memory import allocate_host


class Pool:
    """``slots`` slots of ``slot`` bytes in ``kind`` memory: ``"device"``, or a host memory kind
    (``kvverify.device.host_memory.HOST_MEMORY_KINDS``); ``ptr`` is the first slot's address."""

    def __init__(self, kind: str, slots: int, slot: int):
        self.kind = kind
        self.size = slots * slot
        if kind == "device":
            self.tensor = torch.empty(self.size, dtype=torch.uint8, device="cuda")
            self.ptr = self.tensor.data_ptr()
        else:
            self.host = allocate_host(kind, self.size)
            self.ptr = self.host.ptr

    def fill(self, data: np.ndarray) -> np.ndarray:
        """Write ``data`` (uint8, the pool's size) over the whole pool; returns it."""
        if self.kind == "device":
            self.tensor.copy_(torch.from_numpy(data))
        else:
            self.host.numpy(np.uint8)[:] = data
        return data

    def bytes(self) -> np.ndarray:
        """A host copy of the pool's bytes (uint8; synchronizes for device memory)."""
        if self.kind == "device":
            return self.tensor.cpu().numpy()
        return self.host.numpy(np.uint8).copy()

    def free(self) -> None:
        if self.kind != "device":
            self.host.free()
