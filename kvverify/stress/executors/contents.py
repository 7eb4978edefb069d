"""What the blocks hold and how a check decides OK: the two ``--data`` modes.

- ``pattern`` (default): the generation pattern of ``kvverify.device.pattern`` written by the
  writer kernel; the verify kernel tells OK / STALE / TORN / GARBAGE per page. Pinned and
  (mapped) registered host pages are written and checked in place through UVA; pageable
  ones go through the device staging area and a pinned bounce buffer.
- ``random``: random bytes; a per-page checksum of the source is taken on the writer's
  stream right after it wrote, and a check compares the page's checksum with the one of
  the content it should hold: OK, or GARBAGE on a mismatch (a checksum cannot tell a stale
  page from a torn one). Host pages are written and read by the host (numpy), through the
  staging area.

Both are called with the stream the access belongs to already current, and never wait
for the device except where the host itself touches host memory.
"""

from __future__ import annotations

import numpy as np

from kvverify.stress.executors.pools import Pools, PreparedBlocks

OK, GARBAGE = 0, 3


class PatternContents:
    def __init__(self, pools: Pools, seed: int) -> None:
        self.pools, self.seed = pools, seed
        self.staged = not pools.host_in_place  # host pages kernels cannot reach at their address

    def begin_trial(self) -> None:
        pass

    def write_device(self, blocks: PreparedBlocks, ids, cids, generation: int, spin_ns: int) -> None:
        from kvverify.device import kernels

        kernels.write_blocks(blocks.ptrs_cuda, self.pools.page_bytes, ids, generation, self.seed, spin_ns)

    def write_host(self, blocks: PreparedBlocks, ids, cids, generation: int) -> None:
        from kvverify.device import kernels

        if not self.staged:  # pinned / mapped registered memory: written in place through UVA
            kernels.write_blocks(blocks.ptrs_cuda, self.pools.page_bytes, ids, generation, self.seed, 0)
            return
        staging = self.pools.staging_ptrs(blocks.pages)
        kernels.write_blocks(staging, self.pools.page_bytes, ids, generation, self.seed, 0)
        _to_host(self.pools, blocks, self.pools.staging[: blocks.pages])

    def verify(self, blocks: PreparedBlocks, ids, cids, generation: int):
        from kvverify.device import kernels

        ptrs = blocks.ptrs_cuda
        if self.staged and blocks.blocks.pool == "host":
            ptrs = _from_host(self.pools, blocks)
        states, _ = kernels.verify_blocks(ptrs, self.pools.page_bytes, ids, generation, self.seed)
        return states


class RandomContents:
    def __init__(self, pools: Pools, seed: int) -> None:
        import torch

        self.pools, self.torch = pools, torch
        self.generator = torch.Generator(device=pools.device)
        self.generator.manual_seed(seed)
        self.sums: dict[tuple[int, int], object] = {}  # (content id, generation) -> checksums of its pages

    def begin_trial(self) -> None:
        self.sums.clear()

    def _random(self, pages: int):
        torch = self.torch
        return torch.randint(0, 256, (pages, self.pools.page_bytes), dtype=torch.uint8, device=self.pools.device,
                             generator=self.generator)

    def _remember(self, sums, cids, generation: int) -> None:
        per_block = sums.view(self.pools.tensors, len(cids))
        for j, cid in enumerate(cids):
            self.sums[(int(cid), generation)] = per_block[:, j]

    def write_device(self, blocks: PreparedBlocks, ids, cids, generation: int, spin_ns: int) -> None:
        from kvverify.device import kernels

        if spin_ns:
            kernels.spin(spin_ns)
        view = self.pools.gpu.view(self.pools.tensors, self.pools.sizes.gpu_slots, self.pools.page_bytes)
        data = self._random(blocks.pages).view(self.pools.tensors, len(blocks.slots), -1)
        # One device-to-device copy per run of consecutive slots, on the current stream. Not an
        # index tensor built from the host slots: ``.to(device)`` from pageable memory waits for
        # the current stream, which the adversarial executor may hold (early schedule).
        for at, first, n in _runs(blocks.slots):
            view[:, first:first + n] = data[:, at:at + n]
        self._remember(kernels.checksum_blocks(blocks.ptrs_cuda, self.pools.page_bytes), cids, generation)

    def write_host(self, blocks: PreparedBlocks, ids, cids, generation: int) -> None:
        from kvverify.device import kernels

        data = self._random(blocks.pages)
        self._remember(kernels.checksum_blocks(_rows(self.pools, data), self.pools.page_bytes), cids, generation)
        _to_host(self.pools, blocks, data)  # the host writes the bytes itself

    def verify(self, blocks: PreparedBlocks, ids, cids, generation: int):
        from kvverify.device import kernels

        torch = self.torch
        ptrs = blocks.ptrs_cuda if blocks.blocks.pool == "gpu" else _from_host(self.pools, blocks)
        actual = kernels.checksum_blocks(ptrs, self.pools.page_bytes)
        expected = torch.stack([self.sums[(int(c), generation)] for c in cids], dim=1).reshape(-1)
        return torch.where(actual == expected, OK, GARBAGE).to(torch.int8)


def _rows(pools: Pools, data):
    import torch

    return torch.arange(data.shape[0], dtype=torch.int64, device=pools.device) * pools.page_bytes + data.data_ptr()


def _host_view(pools: Pools):
    # torch's CPU gather / scatter run on every core; numpy's fancy indexing on one.
    import torch

    return torch.from_numpy(pools.host_pages().view(np.int64))


def _bounce(pools: Pools, blocks: PreparedBlocks):
    """The pinned bounce rows for ``blocks``: as bytes (pages, page_bytes) and as int64 words
    (tensors, blocks, words)."""
    import torch

    bounce = pools.bounce[: blocks.pages]
    return bounce, bounce.view(torch.int64).view(pools.tensors, len(blocks.slots), -1)


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(position in ``slots``, first slot, count) of each run of consecutive slots."""
    slots = np.asarray(slots, dtype=np.int64)
    if not len(slots):
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends)]


def gather_host_pages(pools: Pools, slots: np.ndarray, out) -> None:
    """The host reads the pages of host ``slots`` into ``out`` (int64, (tensors, len(slots),
    words)): one strided copy per run of consecutive slots (torch copies those on every
    core; a gather by index is slower)."""
    view = _host_view(pools)
    for at, first, n in _runs(slots):
        out[:, at:at + n].copy_(view[:, first:first + n])


def scatter_host_pages(pools: Pools, slots: np.ndarray, pages) -> None:
    """The host writes ``pages`` (int64, (tensors, len(slots), words)) into host ``slots``."""
    view = _host_view(pools)
    for at, first, n in _runs(slots):
        view[:, first:first + n].copy_(pages[:, at:at + n])


def _to_host(pools: Pools, blocks: PreparedBlocks, device_pages) -> None:
    """The host writes ``device_pages`` ((pages, page_bytes) uint8 on the device, tensor-major)
    into the host pages of ``blocks``, once the current stream has produced them."""
    bounce, pages = _bounce(pools, blocks)
    bounce.copy_(device_pages)  # waits for the current stream, then the DMA
    scatter_host_pages(pools, blocks.slots, pages)


def _from_host(pools: Pools, blocks: PreparedBlocks):
    """The host reads the host pages of ``blocks`` now; return staging page addresses holding them."""
    bounce, pages = _bounce(pools, blocks)
    gather_host_pages(pools, blocks.slots, pages)
    pools.staging[: blocks.pages].copy_(bounce)
    return pools.staging_ptrs(blocks.pages)


def make(data: str, pools: Pools, seed: int):
    if data == "pattern":
        return PatternContents(pools, seed)
    if data == "random":
        return RandomContents(pools, seed)
    raise ValueError(f"unknown data mode {data!r}; use pattern or random")
