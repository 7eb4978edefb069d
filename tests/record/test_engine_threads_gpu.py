"""Engine-style programs with several host threads on the H200, correct and broken: a forward
thread and a scheduler issuing to one stream, a copy thread fed by a ``queue.SimpleQueue`` that
waits on events another thread records and whose stores the main thread polls, and a thread-pool
loader whose workers issue to one shared stream. Correct, each is SAFE and complete (nothing left
undecided: the driver's order of calls that did not overlap is used, host waits that did are
taken as the earlier); broken, each is RACY at the pair that corrupts; every device op has its
line in this file."""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvverify.record import recording

pytestmark = pytest.mark.gpu

PAGES, N = 8, 1 << 18  # pages, bytes per page
HOLD_NS = 2_000_000  # device time ahead of each compute write: a write the reader does not wait for is still running
DEVICE_OPS = ("kernel", "copy", "copy_batch", "record", "wait_event")


def _pages(**kwargs) -> torch.Tensor:
    return torch.zeros(PAGES, N, dtype=torch.uint8, **kwargs)


def forward_and_scheduler(correct: bool):
    """The scheduler (main thread) fills each page's input on the shared stream and hands the page
    to the forward thread through a queue; the forward thread reads it into its output on the
    shared stream (broken: on a stream of its own, which waits for nothing) and records an event;
    the scheduler syncs the events and reads the outputs."""
    shared = torch.cuda.Stream()
    kv, out = _pages(device="cuda"), _pages(device="cuda")
    done = [torch.cuda.Event() for _ in range(PAGES)]
    work: queue.Queue = queue.Queue()

    def forward():
        stream = shared if correct else torch.cuda.Stream()
        for _ in range(PAGES):
            i = work.get()
            with torch.cuda.stream(stream):
                out[i].copy_(kv[i])
                done[i].record(stream)

    torch.cuda.synchronize()
    with recording() as rec:
        t = threading.Thread(target=forward, name="forward")
        t.start()
        for i in range(PAGES):
            with torch.cuda.stream(shared):
                torch.cuda._sleep(HOLD_NS)
                kv[i].fill_(i + 1)
            work.put(i)
        t.join()
        for event in done:
            event.synchronize()
        seen = out.cpu()
    return rec, seen


def copy_thread(correct: bool):
    """Compute (main thread) writes each page and records an event; a copy thread fed by a
    SimpleQueue waits on that event on its copy stream (broken: does not), stores the page into
    pinned memory and records a store event, which the main thread polls before it reads."""
    gpu, host = _pages(device="cuda"), _pages(pin_memory=True)
    copy_stream = torch.cuda.Stream()
    stored = [torch.cuda.Event() for _ in range(PAGES)]
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def copier():
        while (job := jobs.get()) is not None:
            i, written = job
            with torch.cuda.stream(copy_stream):
                if correct:
                    copy_stream.wait_event(written)
                host[i].copy_(gpu[i], non_blocking=True)
                stored[i].record(copy_stream)

    torch.cuda.synchronize()
    with recording() as rec:
        t = threading.Thread(target=copier, name="copier")
        t.start()
        for i in range(PAGES):
            torch.cuda._sleep(HOLD_NS)
            gpu[i].fill_(i + 1)
            written = torch.cuda.Event()
            written.record()
            jobs.put((i, written))
        jobs.put(None)
        t.join()
        waiting = set(range(PAGES))
        while waiting:
            waiting = {i for i in waiting if not stored[i].query()}
        seen = host.clone()
    return rec, seen


def pool_loader(correct: bool):
    """Thread-pool workers copy pinned pages to the device on one shared stream and synchronize it
    (broken: do not); the main thread waits for every task's result, then compute reads the pages
    on the default stream."""
    shared = torch.cuda.Stream()
    gpu = _pages(device="cuda")
    host = torch.arange(1, PAGES + 1, dtype=torch.uint8).repeat_interleave(N).view(PAGES, N).pin_memory()

    def load(i):
        with torch.cuda.stream(shared):
            torch.cuda._sleep(HOLD_NS)
            gpu[i].copy_(host[i], non_blocking=True)
        if correct:
            shared.synchronize()

    torch.cuda.synchronize()
    with recording() as rec:
        with ThreadPoolExecutor(4, thread_name_prefix="loader") as pool:
            for task in [pool.submit(load, i) for i in range(PAGES)]:
                task.result()
        sums = gpu.sum(dim=1, dtype=torch.int64)
        torch.cuda.synchronize()
        seen = sums.cpu()
    return rec, seen


PROGRAMS = {"forward-and-scheduler": (forward_and_scheduler, ("RAW", "kernel", "copy")),
            "copy-thread": (copy_thread, ("RAW", "kernel", "copy")),
            "pool-loader": (pool_loader, ("RAW", "copy", "kernel"))}


def _unlocated(rec) -> list[dict]:
    here = os.path.basename(__file__)
    return [op for op in rec.trace()["ops"]
            if op["op"] in DEVICE_OPS and not op.get("name", "").startswith("implicit")
            and here not in (op.get("at") or "")]


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_correct_engine_program_with_several_threads_is_safe_and_complete(name):
    program, _ = PROGRAMS[name]
    rec, _ = program(correct=True)
    assert rec.complete(), rec.report()
    assert rec.check().safe, rec.report()
    assert not _unlocated(rec), _unlocated(rec)[:3]


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_broken_engine_program_with_several_threads_is_racy_at_its_pair(name):
    program, pair = PROGRAMS[name]
    rec, _ = program(correct=False)
    ops = rec.trace()["ops"]
    kinds = {(r.kind, ops[r.first]["op"], ops[r.second]["op"]) for r in rec.check().races}
    assert pair in kinds, rec.report()
    assert not _unlocated(rec), _unlocated(rec)[:3]
