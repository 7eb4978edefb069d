"""The host watch on a CUDA device: the host's reads and writes of pinned and registered memory that
a copy or kernel may still write or read are seen whatever path they take (a numpy view,
``.numpy()``, ``.tolist()``, ctypes, the buffer protocol), located at their line, and race with the
pending work; the same accesses after a synchronization are SAFE and the recording complete. The
protection never changes what the device does (the copies' bytes are checked), nor what the driver
does with a page it reads with the CPU itself (a small copy)."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from kvverify.record import recording

pytestmark = pytest.mark.gpu

PAGE = 4096
N = 16 * PAGE
HOLD_NS = 50_000_000  # the copy's stream is held this long first: the host's access comes first for real


def touches(rec) -> list[dict]:
    return [op for op in rec.trace()["ops"] if op["op"] in ("host_read", "host_write")
            and op.get("name") == "host access seen by the host watch"]


def race_pairs(rec) -> list[tuple[str, str, str]]:
    ops = rec.trace()["ops"]
    return [(r.kind, ops[r.first]["op"], ops[r.second]["op"]) for r in rec.check().races]


def read_of(how: str, host: torch.Tensor):
    """The host reads the first 64 bytes of ``host``, by ``how``."""
    if how == "tolist":
        return host[:64].tolist()
    if how == ".numpy()":
        return host.numpy()[:64].copy()
    if how == "numpy view":
        return np.frombuffer(memoryview(host.numpy()), dtype=np.uint8)[:64].sum()
    if how == "ctypes":
        return ctypes.string_at(host.data_ptr(), 64)
    return bytes(memoryview(host.numpy())[:64])  # the buffer protocol


@pytest.mark.parametrize("synced", [False, True], ids=["before-sync", "after-sync"])
@pytest.mark.parametrize("how", ["tolist", ".numpy()", "numpy view", "ctypes", "buffer"])
def test_a_host_read_of_a_pending_copys_destination(how, synced):
    dev = torch.full((N,), 7, dtype=torch.uint8, device="cuda")
    host = torch.zeros(N, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)
            host.copy_(dev, non_blocking=True)
        if synced:
            side.synchronize()
        read_of(how, host)  # the host read
        torch.cuda.synchronize()
    assert bool((host == 7).all()), "the copy wrote every byte (the protection does not touch the device's access)"
    if synced:
        assert rec.check().safe and rec.complete(), rec.report()
        assert touches(rec) == []
        return
    assert race_pairs(rec) == [("RAW", "copy", "host_read")], rec.report()
    (touch,) = touches(rec)
    assert "test_host_watch_gpu.py:" in touch["at"] and touch["at"].endswith("in read_of"), touch
    assert rec.complete(), rec.summary().notes


def write_of(how: str, desc: torch.Tensor) -> None:
    """The host writes block ids into ``desc`` (int64), by ``how``."""
    ids = np.arange(16, dtype=np.int64)
    if how == "numpy view":
        desc.numpy()[:16] = ids
    elif how == "ctypes":
        ctypes.memmove(desc.data_ptr(), ids.ctypes.data, ids.nbytes)
    else:  # the buffer protocol
        memoryview(desc.numpy()).cast("B")[:ids.nbytes] = ids.tobytes()


@pytest.mark.parametrize("synced", [False, True], ids=["before-sync", "after-sync"])
@pytest.mark.parametrize("how", ["numpy view", "ctypes", "buffer"])
def test_a_host_write_of_a_pending_copys_source(how, synced):
    """Block ids written into a pinned descriptor while the H2D that reads it is pending."""
    desc = torch.zeros(512, dtype=torch.int64, pin_memory=True)
    ids = torch.empty(512, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)
            ids.copy_(desc, non_blocking=True)
        if synced:
            side.synchronize()
        write_of(how, desc)  # the host write
        torch.cuda.synchronize()
    if synced:
        assert rec.check().safe and rec.complete(), rec.report()
        return
    assert race_pairs(rec) == [("WAR", "copy", "host_write")], rec.report()
    assert rec.complete(), rec.summary().notes


def test_registered_memory_is_watched_too():
    buffer = mmap.mmap(-1, N)
    array = np.frombuffer(buffer, dtype=np.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, N, 0)) == 0
    try:
        host = torch.from_numpy(array)
        dev = torch.full((N,), 3, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        with recording() as rec:
            with torch.cuda.stream(side):
                torch.cuda._sleep(HOLD_NS)
                host.copy_(dev, non_blocking=True)
            array[:64].sum()  # the host read
            torch.cuda.synchronize()
        assert race_pairs(rec) == [("RAW", "copy", "host_read")], rec.report()
        assert int(array.sum()) == 3 * N
    finally:
        torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)


def test_a_tensor_beside_the_pending_one_on_its_page_is_no_race():
    """torch's pinned allocator puts small tensors on one page: the fault's address tells them apart."""
    a, b = torch.zeros(64, dtype=torch.uint8, pin_memory=True), torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    dev = torch.full((64,), 5, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)
            a.copy_(dev, non_blocking=True)
        b.numpy()[:8] = 1  # another tensor (on the same page where the allocator put it so)
        torch.cuda.synchronize()
    assert rec.check().safe, rec.report()
    assert bool((a == 5).all()) and b.numpy()[:8].tolist() == [1] * 8


@pytest.mark.parametrize("nbytes", [8, 64, 4096])
def test_a_small_copy_the_driver_makes_with_the_cpu_from_a_protected_page_goes_through(nbytes):
    """A small copy from pinned memory is read by the driver with the CPU at its call; here from a
    page a pending copy on the same stream writes (protected against every host access): the
    driver's own access is let through, and stream order makes the second copy read what the first
    wrote."""
    host = torch.zeros(PAGE, dtype=torch.uint8, pin_memory=True)
    src = torch.full((PAGE,), 9, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(PAGE, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            host[:nbytes].copy_(src[:nbytes], non_blocking=True)
            dst[:nbytes].copy_(host[:nbytes], non_blocking=True)
        torch.cuda.synchronize()
    assert rec.check().safe and rec.complete(), rec.report()
    assert int(dst[:nbytes].sum()) == 9 * nbytes


def test_a_batched_swap_protects_its_host_bytes_like_a_copy():
    """``kvverify.swap_blocks_batch`` (one cuMemcpyBatchAsync): its destination, pinned, is watched."""
    from kvverify import SrcAccessOrder, swap_blocks_batch

    host = torch.zeros(N, dtype=torch.uint8, pin_memory=True)
    dev = torch.full((N,), 4, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)
            swap_blocks_batch([dev.data_ptr()], [host.data_ptr()], [N], SrcAccessOrder.STREAM)
        host.numpy()[PAGE:PAGE + 8].sum()  # the host read
        torch.cuda.synchronize()
    assert race_pairs(rec) == [("RAW", "copy_batch", "host_read")], rec.report()
    assert int(host.sum()) == 4 * N


@pytest.mark.parametrize("synced", [False, True], ids=["before-sync", "after-sync"])
def test_a_pageable_destination_of_a_batched_copy_is_watched(synced):
    """A ``cuMemcpyBatchAsync`` into pageable memory can return before its copy ran (the driver
    writes the bytes later): its destination is held like pinned memory (the driver's own writes
    go through)."""
    from kvverify import SrcAccessOrder, swap_blocks_batch

    buffer = mmap.mmap(-1, N)
    host = np.frombuffer(buffer, dtype=np.uint8)
    dev = torch.full((N,), 6, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)
            swap_blocks_batch([dev.data_ptr()], [host.ctypes.data], [N], SrcAccessOrder.STREAM)
        if synced:
            side.synchronize()
        host[:64].sum()  # the host read
        torch.cuda.synchronize()
    assert int(host.sum()) == 6 * N
    if synced:
        assert rec.check().safe and rec.complete(), rec.report()
    else:
        assert race_pairs(rec) == [("RAW", "copy_batch", "host_read")], rec.report()
        assert rec.complete(), rec.summary().notes


def test_a_file_read_into_pinned_memory_a_copy_still_reads_is_a_race_and_still_reads(tmp_path):
    """``readinto`` of a raw file object: the kernel would answer EFAULT on the protected page; the
    recorder opens it for the call, and records the write."""
    path = tmp_path / "kv"
    path.write_bytes(b"\x07" * PAGE)
    host = torch.zeros(PAGE, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(PAGE, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec, open(path, "rb", buffering=0) as f:
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)
            dev.copy_(host, non_blocking=True)
        assert f.readinto(memoryview(host.numpy())) == PAGE  # the program's read, as it would run unrecorded
        torch.cuda.synchronize()
    assert race_pairs(rec) == [("WAR", "copy", "host_write")], rec.report()
    assert bool((host == 7).all())
