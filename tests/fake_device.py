"""A serial stand-in for the GPU, so the executors' plumbing runs on any CPU host.

Every "device" op runs at once, on the host, in issue order: streams, events and waits are
no-ops, the harness kernels are their numpy references (``kvverify.device.pattern``) applied to the
raw addresses, ``swap_blocks_batch`` is a memmove per copy in list order. Device memory is
host memory (``device="cpu"``), host memory is pageable (the only kind that needs no CUDA).

That is one legal schedule (the reference model's), so it shows whether programs, content
ids, generations, snapshots, batch reordering and counting fit together, not whether the
harness provokes races: that needs the real device (tests/stress/test_stress_gpu.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools

import numpy as np
import pytest
import torch

from kvverify.device import kernels, ops, pattern

_ids = itertools.count(1)


def _pages(ptrs, block_bytes):
    words = block_bytes // 8
    for p in np.asarray(torch.as_tensor(ptrs).cpu(), dtype=np.int64):
        yield np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(int(p)))


def _ids_of(ids):
    return np.asarray(torch.as_tensor(ids).cpu(), dtype=np.int64)


def write_blocks(block_ptrs, block_bytes, block_ids, generation, seed, spin_ns=0, *, stream=None):
    for page, b in zip(_pages(block_ptrs, block_bytes), _ids_of(block_ids)):
        pattern.fill_blocks(page[None, :], np.array([b]), generation, seed)


def verify_blocks(block_ptrs, block_bytes, block_ids, expected_generation, seed, *, stream=None):
    pages = list(_pages(block_ptrs, block_bytes))
    blocks = np.stack(pages) if pages else np.zeros((0, block_bytes // 8), np.uint64)
    states, gens = pattern.classify_blocks(blocks, _ids_of(block_ids), expected_generation, seed)
    return torch.from_numpy(states.astype(np.int8)), torch.from_numpy(gens.astype(np.int64))


def checksum_blocks(block_ptrs, block_bytes, *, stream=None):
    pages = list(_pages(block_ptrs, block_bytes))
    return torch.from_numpy(pattern.checksum_blocks_reference(np.stack(pages)).astype(np.int64))


def swap_blocks_batch(src_ptrs, dst_ptrs, sizes, src_access_order=None, **_):
    for s, d, n in zip(*(np.asarray(torch.as_tensor(a), dtype=np.int64) for a in (src_ptrs, dst_ptrs, sizes))):
        ctypes.memmove(int(d), int(s), int(n))


class FakeStream:
    def __init__(self, device=None, **_):
        self.cuda_stream = next(_ids)
        self.device = device

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class FakeEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True


def install(monkeypatch) -> torch.device:
    """Put the stand-in in place through ``monkeypatch`` (a ``pytest.MonkeyPatch``, also usable
    outside pytest, e.g. in a subprocess); return the device to run on."""
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    for name, fn in (("write_blocks", write_blocks), ("verify_blocks", verify_blocks),
                     ("checksum_blocks", checksum_blocks), ("read_blocks", lambda *a, **k: None),
                     ("spin", lambda *a, **k: None)):
        monkeypatch.setattr(kernels, name, fn)
    monkeypatch.setattr(ops, "swap_blocks_batch", swap_blocks_batch)
    return torch.device("cpu")


def install_for_stress(monkeypatch) -> torch.device:
    """``install``, and make ``kvverify stress`` run its cells on the stand-in: a GPU counts as
    present, the platform is the stand-in's, the runner executes on its device."""
    import functools

    from kvverify import device as kvverify_device
    from kvverify.stress import cli as stress_cli
    from kvverify.stress import running
    from kvverify.stress.report import Platform

    device = install(monkeypatch)
    monkeypatch.setattr(kvverify_device, "gpu_refusal", lambda: None)
    monkeypatch.setattr(stress_cli, "_platform", lambda gpu: Platform(gpu="stand-in"))
    monkeypatch.setattr(running, "execute", functools.partial(running.execute, device=device))
    return device


@pytest.fixture
def fake_device(monkeypatch):
    return install(monkeypatch)
