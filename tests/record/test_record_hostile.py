"""A hostile review of the recorder: programs that race which a recording must not call SAFE,
behaviour a recording must not change, state it must not leave behind. Each test is one finding;
a strict xfail names a defect left for the lead to fix."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda

import kvverify.record as record
from kvverify.check import check
from kvverify.record.recorder import Recorder
from kvverify.record.writer import build

SIDE, COMPUTE = 0x7F10, 0x7F00
BLOCK = 4096


class Lines:
    def __init__(self):
        self.line = 0

    def __call__(self, depth: int = 1):
        self.line += 1
        return f"prog.py:{self.line} in step"


def verdict(rec: Recorder):
    doc, _ = build(rec)
    return doc, check(doc).races


@pytest.fixture
def fake():
    return FakeCuda()


# -- host threads --------------------------------------------------------------------------------


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
