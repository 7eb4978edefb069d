"""Work that bypasses torch, seen where Python calls it (``kvverify.record.capture.bindings``): cuda-python's
driver calls from a copy thread (vllm-project/vllm#45704's shape) and ``os.preadv`` into a pinned
slot (vllm-project/vllm#51667's), on the CPU stand-in; what the calls were given (an unmap of several
mappings frees each, a host pointer passed as an array is its address). The driver functions are
stand-ins that answer CUDA_SUCCESS: what is under test is what the recording makes of the calls."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from fake_cuda import ptrs, swap_ops

import kvverify.record as record

driver = pytest.importorskip("cuda.bindings.driver")

BLOCK = 4096


class Attr:
    def __init__(self, order: int):
        self.srcAccessOrder = order


@pytest.fixture
def calls(monkeypatch):
    """The driver functions the recording wraps, as stand-ins that succeed; each call is kept."""
    seen = []

    def stand_in(name, *result):
        def call(*args):
            seen.append(name)
            return (driver.CUresult.CUDA_SUCCESS, *result)
        return call

    for name in ("cuMemcpyBatchAsync", "cuEventRecord", "cuStreamWaitEvent", "cuEventSynchronize", "cuMemUnmap"):
        monkeypatch.setattr(driver, name, stand_in(name))
    return seen


def copy_thread_store(fake, *, wait: bool):
    gpu, cpu = fake.device(BLOCK), fake.pinned(BLOCK)
    compute, store_stream = fake.stream(), fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with fake.use(compute):
            gpu.fill_(1)  # the model's KV write

        def store():
            if wait:
                driver.cuEventRecord(0xE1, compute.handle)
                driver.cuStreamWaitEvent(store_stream.handle, 0xE1, 0)
            order = 1 if wait else 3  # STREAM behind the wait; ANY with none
            driver.cuMemcpyBatchAsync([cpu.data_ptr()], [gpu.data_ptr()], [BLOCK], 1, [Attr(order)], [0], 1,
                                      store_stream.handle)
            driver.cuEventRecord(0xE2, store_stream.handle)
            driver.cuEventSynchronize(0xE2)

        copier = threading.Thread(target=store, name="copy-thread")
        copier.start()
        copier.join()
        cpu.sum()  # the host consumes the stored block
    return rec


def test_a_copy_threads_cuda_python_store_without_a_wait_races_with_the_write_it_reads(fake, calls):
    rec = copy_thread_store(fake, wait=False)
    doc = rec.trace()
    batch = next(op for op in doc["ops"] if op["op"] == "copy_batch")
    assert batch["order"] == "ANY" and batch["thread"] == "copy-thread" and batch["name"] == "cuda-python cuMemcpyBatchAsync"
    assert "in store" in batch["at"] and rec.complete()
    kinds = {(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races}
    assert kinds == {("RAW", "kernel", "copy_batch")}


def test_the_same_store_behind_an_event_from_compute_in_stream_order_is_safe(fake, calls):
    rec = copy_thread_store(fake, wait=True)
    assert rec.check().safe and rec.complete(), rec.check().render()
    assert calls.count("cuMemcpyBatchAsync") == 1


def test_driver_calls_of_a_thread_the_recording_does_not_follow_are_noted_as_missed(fake, calls):
    go, done = threading.Event(), threading.Event()
    old = threading.Thread(target=lambda: (go.wait(), driver.cuEventRecord(0xE3, 0), done.set()), name="old-copier")
    old.start()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        go.set()
        done.wait()
    old.join()
    assert not rec.complete()
    assert any("cuda-python cuEventRecord from thread 'old-copier'" in n for n in rec.summary().notes)


def test_an_unmap_is_a_free_of_the_range(fake, calls):
    gpu = fake.device(BLOCK)
    cpu = fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with fake.use(fake.stream()):
            cpu.copy_(gpu, non_blocking=True)  # a store still in flight
        driver.cuMemUnmap(gpu.data_ptr(), BLOCK)  # sleep mode releases the memory under it
    races = rec.check().races
    assert [(r.kind, rec.trace()["ops"][r.second]["name"]) for r in races] == [("FREE", "cuda-python cuMemUnmap")]


def test_the_recording_puts_every_function_back(fake, calls):
    before = {name: getattr(driver, name) for name in ("cuMemcpyBatchAsync", "cuEventQuery")}
    preadv = os.preadv
    with record.recording(platform=fake, skip=fake.skip()):
        assert driver.cuMemcpyBatchAsync is not before["cuMemcpyBatchAsync"]
        assert driver.cuMemcpyBatchAsync.__wrapped__ is before["cuMemcpyBatchAsync"] and os.preadv is not preadv
    assert {name: getattr(driver, name) for name in before} == before and os.preadv is preadv


@pytest.mark.parametrize("drained", [False, True], ids=["returns-with-its-copy-pending", "drains-its-event"])
def test_a_preadv_into_a_pinned_slot_its_h2d_still_reads_races(fake, tmp_path, drained):
    kvswap, _ = swap_ops()
    slot = fake.pinned(BLOCK)
    first, second = fake.device(BLOCK), fake.device(BLOCK)
    data = tmp_path / "kv.bin"
    data.write_bytes(bytes([1]) * BLOCK + bytes([2]) * BLOCK)
    io = fake.stream()
    fd = os.open(data, os.O_RDONLY)
    try:
        with record.recording(platform=fake, skip=fake.skip()) as rec:
            for k, dst in enumerate((first, second)):
                assert os.preadv(fd, [slot.numpy()], k * BLOCK) == BLOCK  # the I/O into the slot
                with fake.use(io):
                    kvswap(ptrs(slot.data_ptr()), ptrs(dst.data_ptr()), ptrs(BLOCK), 1)
                    copied = fake.event()
                    copied.record(io)
                if drained:
                    copied.synchronize()
    finally:
        os.close(fd)
    assert np.all(second.numpy() == 2)
    doc = rec.trace()
    writes = [op for op in doc["ops"] if op["op"] == "host_write"]
    assert [op["name"] for op in writes] == ["os.preadv", "os.preadv"] and "test_record_bindings.py" in writes[0]["at"]
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["name"]) for r in rec.check().races]
    assert kinds == ([] if drained else [("WAR", "copy_batch", "os.preadv")])
    assert torch.equal(first, torch.full((BLOCK,), 1, dtype=torch.uint8))


# -- what the driver calls were given ----------------------------------------------------------------


@pytest.fixture
def driver_calls(monkeypatch):
    driver = pytest.importorskip("cuda.bindings.driver")

    def ok(*args):
        return (driver.CUresult.CUDA_SUCCESS,)

    for name in ("cuMemMap", "cuMemUnmap", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuEventRecord",
                 "cuEventSynchronize"):
        monkeypatch.setattr(driver, name, ok)
    return driver


def test_an_unmap_of_several_mappings_at_once_frees_each_of_them(fake, driver_calls):
    """``cuMemUnmap`` of a range two ``cuMemMap`` calls mapped: the range lies in no one allocation,
    so its ``free`` went to a placeholder buffer of its own, which no device work touches: the copy
    still reading the first mapping was called SAFE against the unmap."""
    driver = driver_calls
    base = 0x7_0000_0000
    cpu = fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        driver.cuMemMap(base, BLOCK, 0, 1, 0)
        driver.cuMemMap(base + BLOCK, BLOCK, 0, 2, 0)
        with fake.use(fake.stream()):
            driver.cuMemcpyDtoHAsync(cpu.data_ptr(), base, BLOCK, fake.current.handle)  # in flight
        driver.cuMemUnmap(base, 2 * BLOCK)
    doc = rec.trace()
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races] == \
        [("FREE", "copy", "free")]


def test_a_host_pointer_given_as_a_one_element_array_is_its_address_not_its_value(fake, driver_calls):
    """cuda-python takes a host pointer (``srcHost``, ``dstHost``) from any buffer: a numpy array
    is its data's address. The recorder took ``int(array)``, the value of a one-element array, as
    the address: the copy read some unresolved bytes, and the host's write of the array raced with
    nothing."""
    driver = driver_calls
    gpu = fake.device(8)
    host = np.zeros(1, dtype=np.int64)  # one 8-byte slot
    host[0] = 0x1234
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        record.host_buffer(host, "pinned", name="slot")
        with fake.use(fake.stream()):
            driver.cuMemcpyHtoDAsync(gpu.data_ptr(), host, 8, fake.current.handle)
        host[0] = 7
        record.host_write(host)  # rewritten under the copy
    doc = rec.trace()
    copy = next(op for op in doc["ops"] if op["op"] == "copy")
    assert copy["src"][0] == "slot"
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races] == \
        [("WAR", "copy", "host_write")]

