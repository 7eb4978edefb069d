"""Host threads in a recording: what orders one thread's work after another's, and what does not.
A lock orders what the releasing thread did before the acquiring thread's later work only where the
release happened (one that raises released nothing); threading's own bookkeeping lock orders no
thread after another; a queue orders a ``get`` after the ``put`` of the item it returns, not after
every earlier put. A thread that gets the ident of one that ended is named apart from it. (Two
threads issuing to one stream: test_driver_order.py.) On the CUDA stand-in."""

from __future__ import annotations

import threading
import time

import pytest
from fake_cuda import FakeCuda

import kvverify.record as record

BLOCK = 4096


# -- locks, thread starts and names ----------------------------------------------------------------


def test_a_lock_release_that_raises_orders_nothing(fake):
    """``lock.release()`` of a lock that is not held raises RuntimeError and releases nothing; the
    recorder logged the release before calling it, so another thread's later acquire of the lock was
    ordered after everything the releasing thread did: a race of its host write hidden."""
    cpu, gpu = fake.pinned(BLOCK), fake.device(BLOCK)
    side = fake.stream()
    lock = threading.Lock()
    wrote = []  # a flag no lock guards: orders nothing (docs/record.md), only makes the order below happen
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        def writer():
            record.host_write(cpu)
            try:
                lock.release()  # a bug of the program: the lock is not held
            except RuntimeError:
                pass
            wrote.append(True)

        def reader():
            while not wrote:
                time.sleep(0.001)
            with lock, fake.use(side):
                gpu.copy_(cpu, non_blocking=True)  # the H2D reads what the writer wrote

        # the reader runs before the writer ends: threading's own bookkeeping lock, taken at each
        # thread's start and end, orders nothing here (test_threadings_own_bookkeeping_lock...)
        threads = [threading.Thread(target=reader, name="reader"), threading.Thread(target=writer, name="writer")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "host_write", "copy")]


def test_threadings_own_bookkeeping_lock_orders_no_thread_after_another():
    """Every thread takes ``threading._active_limbo_lock`` as it begins and ends, and ``Thread.start``
    takes it too: observed as a program lock, it ordered a thread started after another one ended
    after everything that one did. The program never synchronized them: its writer's host write and
    the copy that reads the bytes race (a slower writer would still be writing)."""
    fake = FakeCuda()
    cpu, gpu = fake.pinned(BLOCK), fake.device(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        writer = threading.Thread(target=lambda: record.host_write(cpu), name="writer")
        writer.start()
        while writer.is_alive():  # (not a join: the program does not wait for it; this run happens to)
            time.sleep(0.001)

        def reader():
            with fake.use(side):
                gpu.copy_(cpu, non_blocking=True)

        copier = threading.Thread(target=reader, name="reader")
        copier.start()
        copier.join()
        writer.join()
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "host_write", "copy")]


def test_a_thread_that_gets_the_ident_of_one_that_ended_keeps_both_names_apart(fake):
    """Thread idents are reused once a thread ended (glibc hands the next thread the same pthread):
    the new thread's name replaced the old one's in the recorder, so the old thread's ops named a
    thread the trace did not declare (an invalid trace: ``check`` raised), and a third thread of
    the old one's name got that name again, merging two program orders into one."""
    gpu = fake.device(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        idents = []
        for _ in range(3):
            t = threading.Thread(target=lambda: (idents.append(threading.get_ident()), gpu.add_(1)), name="worker")
            t.start()
            t.join()
    if len(set(idents)) == 3:
        pytest.skip("this system gave each thread a new ident")
    doc = rec.trace()
    assert doc["threads"] == ["MainThread", "worker", "worker #2", "worker #3"]
    assert {op["thread"] for op in doc["ops"] if "thread" in op} == {"worker", "worker #2", "worker #3"}
    rec.check()  # a valid trace


# -- queues ------------------------------------------------------------------------------------------


def _hand_off(fake, *, first_item_to_consumer: bool):
    """Two producers each write a pinned slot on the host and put its index in one queue; the
    consumer gets one item and copies that slot to the device. Through the queue's mutex the get
    came after both puts in this run, but only the put of the item it got orders the consumer."""
    import queue

    slots = [fake.pinned(BLOCK), fake.pinned(BLOCK)]
    gpu = fake.device(BLOCK)
    side = fake.stream()
    q = queue.Queue()
    put = []  # a flag no lock guards: it orders nothing, it only makes the puts happen in this order
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        def producer(k):
            record.host_write(slots[k])
            q.put(k)
            put.append(k)

        threads = [threading.Thread(target=producer, args=(k,), name=f"producer{k}") for k in (0, 1)]
        for k, t in enumerate(threads):
            t.start()
            while len(put) <= k:
                time.sleep(0.001)
        got = []

        def consumer():
            k = q.get()
            got.append(k)
            with fake.use(side):
                gpu.copy_(slots[1 - k if not first_item_to_consumer else k], non_blocking=True)

        c = threading.Thread(target=consumer, name="consumer")
        c.start()
        c.join()
        for t in threads:
            t.join()
    return rec, got


def test_a_queue_orders_a_get_only_after_the_put_of_its_item(fake):
    """The consumer copies the slot of the item it did *not* get: that producer's host write is
    ordered before the copy only by the queue's mutex (this run's timing), so it races."""
    rec, got = _hand_off(fake, first_item_to_consumer=False)
    assert got == [0]
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "host_write", "copy")]


def test_the_item_a_get_returns_orders_its_producer_before_the_consumer(fake):
    rec, got = _hand_off(fake, first_item_to_consumer=True)
    assert got == [0] and rec.check().verdict == "SAFE", rec.check().render()
