"""Programs from traces: the recorder's inverse, for a soundness test of ``kvverify record``.

A trace (format 1.2) of the shapes one torch call can issue becomes a Python program with one
line per op of the trace; the program runs under ``kvverify.record.recording()``, and the racing
pairs of the recording, mapped to program lines through each op's ``at``, must be the racing pairs
``kvverify.check`` finds in the trace itself, mapped to the lines that issued them.

- ``realizable_traces``: a hypothesis strategy for such traces (2-3 streams, 1-2 host threads,
  tiny buffers of every memory space, so that accesses overlap often);
- ``generate``: trace -> program source and the line of each op (``ValueError`` for an op no
  line of the generator can issue);
- ``TorchCuda`` / ``FakeDevice``: what the program calls a device: torch's CUDA, or the CPU
  stand-in of ``fake_cuda``;
- ``disagreement``: run a trace's program recorded and compare the two sets of racing lines.

How each op becomes a line (``with api.on(stream): ...`` makes the stream current for that line):

- ``kernel`` (device ranges of one length, reads apart from the write): no read ``w.fill_(k)``,
  one ``w.copy_(r)``, two ``torch.add(r1, r2, out=w)``; no write ``r.sum()`` / ``torch.add(r1, r2)``
  (a fresh output, which only that stream's kernels touch: the recorder summarizes it);
- ``copy``: ``dst.copy_(src, non_blocking=True)`` between a host and a device view;
- ``copy_batch``: ``api.swap(src_ptrs, dst_ptrs, sizes, order)`` with ``view.data_ptr()``
  pointers (``kvverify.swap_blocks_batch``; on the stand-in its ``kvtest`` batched-swap op);
- ``record`` / ``wait_event`` / ``wait_stream`` / ``sync_event`` / ``sync_stream`` / ``sync_device``:
  ``e.record(s)``, ``s.wait_event(e)``, ``s.wait_stream(o)``, ``e.synchronize()``,
  ``s.synchronize()``, ``api.synchronize()``; ``query_event`` (true only: a false answer orders
  nothing, and no program can be made to get one) ``while not e.query(): pass``;
- ``host_read`` / ``host_write``: ``v.sum()`` / ``v.fill_(k)`` of CPU views, one per range;
- ``free``: ``kvverify.record.reuse(views)`` (a pool handing the bytes to a new owner);
- ``release`` / ``acquire`` (one of each per sync name, by two threads): ``q.put(None)`` /
  ``q.get()`` of a ``queue.Queue`` of the sync's own.

With two threads, each thread's ops run in its own function and the threads take turns by spinning
on a shared list (no lock, no queue: the recorder writes those as host ordering the trace lacks),
so that the run issues the ops in the trace's order. The worker starts before any op and is joined
after the last: its start and end order no op of the trace.
"""

from __future__ import annotations

import itertools
import json
import runpy
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from kvverify.record.capture.threads import NOT_RECORDED
from kvverify.terms import ORDERS, SrcAccessOrder

BYTES = 16  # per buffer: ranges of 4 or 8 bytes at multiples of 4 overlap often
DEVICE = ("dev0", "dev1")
HOST = {"pin": "host_pinned", "page": "host_pageable", "reg": "host_registered"}
STREAMS = ("s0", "s1", "s2")
EVENTS = ("e0", "e1")
THREADS = ("main", "worker")
ALLOCATE = {"device": "device", "host_pinned": "pinned", "host_pageable": "pageable",
            "host_registered": "registered"}
HEADER = '"""Generated from a trace by tests/record/trace_programs.py: one line per op of the trace."""'


# -- the traces ----------------------------------------------------------------------------------


def _overlap(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


@st.composite
def realizable_traces(draw, *, max_steps: int = 7):
    """A trace (a JSON-ready dict) that ``generate`` can turn into a program: 2-3 streams, one or
    two threads (``main``, ``worker``), one or two device buffers and one or two host buffers of
    any kind (``BYTES`` bytes each), up to ``max_steps`` steps of an access, an optional record of
    its stream, an optional synchronization and, with two threads, an optional hand-off; without
    what the recorder's trace writer leaves out where that changes the verdict
    (``without_what_the_writer_leaves_out``).
    """
    streams = STREAMS[: draw(st.integers(2, 3))]
    threads = THREADS[: draw(st.integers(1, 2))]
    host = draw(st.lists(st.sampled_from(sorted(HOST)), min_size=1, max_size=2, unique=True))
    device = list(DEVICE[: draw(st.integers(1, 2))])
    buffers = {name: {"space": "device", "bytes": BYTES} for name in device}
    buffers.update({name: {"space": HOST[name], "bytes": BYTES} for name in host})
    ops: list[dict] = []
    pending: list[dict] = []  # acquires of hand-offs released already, not yet issued
    handoffs = itertools.count()

    def rng(pool, n: int | None = None) -> list:
        n = n or draw(st.sampled_from((4, 8)))
        return [draw(st.sampled_from(pool)), draw(st.sampled_from(range(0, BYTES - n + 1, 4))), n]

    def by(op: dict, thread: str) -> dict:
        if thread != threads[0] or (len(threads) > 1 and draw(st.booleans())):
            op["thread"] = thread
        return op

    def kernel(stream: str) -> dict:
        n = draw(st.sampled_from((4, 8)))
        writes = [rng(device, n)] if draw(st.integers(0, 3)) else []
        reads = [rng(device, n) for _ in range(draw(st.integers(0 if writes else 1, 2)))]
        if writes and any(_overlap(r, writes[0]) for r in reads):
            reads = []  # torch refuses an output that partly overlaps an input
        return {"op": "kernel", "stream": stream, "reads": reads, "writes": writes}

    def copy(stream: str) -> dict:
        n = draw(st.sampled_from((4, 8)))
        sides = [rng(host, n), rng(device, n)]
        if draw(st.booleans()):
            sides.reverse()
        return {"op": "copy", "stream": stream, "src": sides[0], "dst": sides[1]}

    def copy_batch(stream: str) -> dict:
        copies = []
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.sampled_from((4, 8)))
            # one side on the device at least: the driver's batch of host-to-host copies is not this test's
            pools = draw(st.sampled_from([(device, device), (device, host), (host, device)]))
            copies.append({"src": rng(list(pools[0]), n), "dst": rng(list(pools[1]), n)})
        return {"op": "copy_batch", "stream": stream, "order": draw(st.sampled_from(ORDERS)), "copies": copies}

    def access(stream: str) -> dict:
        kind = draw(st.sampled_from(("kernel", "kernel", "copy", "copy", "copy_batch", "copy_batch",
                                     "host_write", "host_read", "free")))
        if kind == "kernel":
            return kernel(stream)
        if kind == "copy":
            return copy(stream)
        if kind == "copy_batch":
            return copy_batch(stream)
        pool = device + host if kind == "free" else host
        return {"op": kind, "ranges": [rng(pool) for _ in range(draw(st.integers(1, 2)))]}

    def sync(stream: str, event: str) -> dict | None:
        other = draw(st.sampled_from(streams))
        kind = draw(st.sampled_from(("wait_event", "wait_event", "sync_event", "query_event", "wait_stream",
                                     "sync_stream", "sync_device", "none", "none")))
        if kind == "wait_event" and not any(op["op"] == "record" and op["event"] == event for op in ops):
            # torch calls nothing for an event never recorded: no stream op of the program's
            # reaches the driver, where the checker places one (ordering two threads' work on the stream)
            return None
        return {"wait_event": {"op": "wait_event", "stream": other, "event": event},
                "sync_event": {"op": "sync_event", "event": event},
                "query_event": {"op": "query_event", "event": event, "result": True},
                "wait_stream": {"op": "wait_stream", "stream": other, "on": stream},
                "sync_stream": {"op": "sync_stream", "stream": draw(st.sampled_from(streams))},
                "sync_device": {"op": "sync_device"}}.get(kind)

    def flush(all_of_them: bool = False) -> None:
        while pending and (all_of_them or draw(st.booleans())):
            ops.append(pending.pop(draw(st.integers(0, len(pending) - 1))))

    for _ in range(draw(st.integers(1, max_steps))):
        thread = draw(st.sampled_from(threads))
        stream = draw(st.sampled_from(streams))
        event = draw(st.sampled_from(EVENTS))
        ops.append(by(access(stream), thread))
        if draw(st.booleans()):
            ops.append(by({"op": "record", "event": event, "stream": stream}, thread))
        s = sync(stream, event if draw(st.integers(0, 3)) else draw(st.sampled_from(EVENTS)))
        if s is not None:
            # the thread that synchronizes is often the one that passes what it saw on
            thread = thread if draw(st.booleans()) else draw(st.sampled_from(threads))
            ops.append(by(s, thread))
        flush()
        if len(threads) > 1 and draw(st.booleans()):
            name = f"h{next(handoffs)}"
            ops.append(by({"op": "release", "sync": name}, thread))
            pending.append(by({"op": "acquire", "sync": name}, next(t for t in threads if t != thread)))
            flush()
    flush(all_of_them=draw(st.booleans()))
    doc = {"version": 1, "buffers": buffers, "streams": list(streams), "ops": ops}
    if len(threads) > 1:
        doc["threads"] = list(threads)
    return without_what_the_writer_leaves_out(doc)


def _ranges(op: dict) -> list:
    if op["op"] == "copy":
        return [op["src"], op["dst"]]
    if op["op"] == "copy_batch":
        return [c[side] for c in op["copies"] for side in ("src", "dst")]
    return op.get("reads", []) + op.get("writes", []) + op.get("ranges", [])


def without_what_the_writer_leaves_out(doc: dict) -> dict:
    """``doc`` (changed in place) without the host accesses and frees of a host buffer no copy
    touches: memory no device work touches, where two threads' accesses race only as a CPU data
    race, which the recorder leaves to CPU race detectors (its trace writer does not write them:
    ``kvverify.record.trace.writer``, docs/record.md "Keeping traces small")."""
    ops = doc["ops"]
    device = {name for name, b in doc["buffers"].items() if b["space"] == "device"}
    copied = {r[0] for op in ops if op["op"] in ("copy", "copy_batch") for r in _ranges(op)}
    for op in ops:
        if op["op"] in ("host_read", "host_write", "free"):
            op["ranges"] = [r for r in op["ranges"] if r[0] in copied or r[0] in device]
    doc["ops"] = [op for op in ops if op.get("ranges", True)]
    return doc


# -- the programs ----------------------------------------------------------------------------------


@dataclass
class Program:
    """A generated program: its ``source`` and, for each op index of the trace, the 1-based
    ``lines`` that issues it."""

    source: str
    lines: list[int]


def generate(trace: dict) -> Program:
    """The program that issues ``trace``'s ops in its order, one line per op (see the module
    docstring for each op's line). The program expects a global ``api`` (``TorchCuda``,
    ``FakeDevice``) and keeps its buffers in its globals ``buf0``, ``buf1``... in the order of
    ``trace["buffers"]``.

    Raises ValueError for a trace outside what a line can issue: a kernel on host memory, of ranges
    of several lengths, writing more than one range, reading three or more, or writing a range one
    of its reads overlaps; a host access to device memory; a copy between two host or two device
    ranges; a copy batch of a host-to-host copy; a ``query_event`` with a false result; a sync name
    released or acquired twice, acquired before its release or by the thread that released it; more
    than two threads.
    """
    buffers = {name: f"buf{k}" for k, name in enumerate(trace["buffers"])}
    spaces = {name: b["space"] for name, b in trace["buffers"].items()}
    streams = {name: f"stream{k}" for k, name in enumerate(trace["streams"])}
    threads = list(trace.get("threads") or ["main"])
    if len(threads) > 2:
        raise ValueError(f"at most two threads, got {threads}")
    ops = trace["ops"]
    events: dict[str, str] = {}
    syncs: dict[str, str] = {}
    released: dict[str, str] = {}
    for op in ops:
        if "event" in op:
            events.setdefault(op["event"], f"event{len(events)}")
        if op["op"] in ("release", "acquire"):
            syncs.setdefault(op["sync"], f"handoff{len(syncs)}")

    def view(r, host: bool | None = None) -> str:
        buf, offset, n = r
        if host is not None and (spaces[buf] == "device") == host:
            raise ValueError(f"range {r} is not in {'host' if host else 'device'} memory")
        return f"{buffers[buf]}[{offset}:{offset + n}]"

    def on(op: dict, statement: str) -> str:
        return f"with api.on({streams[op['stream']]}): {statement}"

    def line(k: int, op: dict) -> str:
        kind = op["op"]
        thread = op.get("thread", threads[0])
        if kind == "kernel":
            reads, writes = op["reads"], op["writes"]
            if len({r[2] for r in reads + writes}) != 1 or len(writes) > 1 or len(reads) > 2 or not reads + writes:
                raise ValueError(f"op {k}: no torch call makes this kernel: {op}")
            if writes and any(_overlap(r, writes[0]) for r in reads):
                raise ValueError(f"op {k}: torch refuses an output that partly overlaps an input: {op}")
            r = [view(x, host=False) for x in reads]
            if not writes:
                return on(op, f"{r[0]}.sum()" if len(r) == 1 else f"torch.add({r[0]}, {r[1]})")
            w = view(writes[0], host=False)
            if not r:
                return on(op, f"{w}.fill_({k % 200 + 1})")
            return on(op, f"{w}.copy_({r[0]})" if len(r) == 1 else f"torch.add({r[0]}, {r[1]}, out={w})")
        if kind == "copy":
            src_host = spaces[op["src"][0]] != "device"
            if src_host == (spaces[op["dst"][0]] != "device"):
                raise ValueError(f"op {k}: a copy here is copy_ between host and device memory, not {op}")
            return on(op, f"{view(op['dst'])}.copy_({view(op['src'])}, non_blocking=True)")
        if kind == "copy_batch":
            if any(spaces[c["src"][0]] != "device" and spaces[c["dst"][0]] != "device" for c in op["copies"]):
                raise ValueError(f"op {k}: a host-to-host copy in a batch: {op}")
            src = ", ".join(f"{view(c['src'])}.data_ptr()" for c in op["copies"])
            dst = ", ".join(f"{view(c['dst'])}.data_ptr()" for c in op["copies"])
            sizes = ", ".join(str(c["src"][2]) for c in op["copies"])
            return on(op, f"api.swap([{src}], [{dst}], [{sizes}], {op['order']!r})")
        if kind in ("host_read", "host_write"):
            call = "sum()" if kind == "host_read" else f"fill_({k % 200 + 1})"
            return "; ".join(f"{view(r, host=True)}.{call}" for r in op["ranges"])
        if kind == "free":
            return f"reuse({', '.join(view(r) for r in op['ranges'])})"
        if kind == "record":
            return f"{events[op['event']]}.record({streams[op['stream']]})"
        if kind == "wait_event":
            return f"{streams[op['stream']]}.wait_event({events[op['event']]})"
        if kind == "wait_stream":
            return f"{streams[op['stream']]}.wait_stream({streams[op['on']]})"
        if kind == "sync_event":
            return f"{events[op['event']]}.synchronize()"
        if kind == "sync_stream":
            return f"{streams[op['stream']]}.synchronize()"
        if kind == "sync_device":
            return "api.synchronize()"
        if kind == "query_event":
            if not op["result"]:
                raise ValueError(f"op {k}: a program cannot be made to see an event not yet complete: {op}")
            return f"while not {events[op['event']]}.query(): pass"
        if kind == "release":
            if op["sync"] in released:
                raise ValueError(f"op {k}: sync {op['sync']!r} released twice")
            released[op["sync"]] = thread
            return f"{syncs[op['sync']]}.put(None)"
        if kind == "acquire":
            if released.pop(op["sync"], thread) == thread:
                raise ValueError(f"op {k}: sync {op['sync']!r} acquired with no release by another thread before")
            return f"{syncs[op['sync']]}.get()"
        raise ValueError(f"op {k}: no line issues a {kind!r} op")

    head = [HEADER, "import queue", "import threading", "import time", "", "import torch", "",
            "from kvverify.record import reuse", ""]
    head += [f"{var} = api.{ALLOCATE[spaces[name]]}({trace['buffers'][name]['bytes']})  # {name}"
             for name, var in buffers.items()]
    head += [f"{var} = api.stream()  # {name}" for name, var in streams.items()]
    head += [f"{var} = api.event()  # {name}" for name, var in events.items()]
    head += [f"{var} = queue.Queue()  # {name}" for name, var in syncs.items()]
    head += ["turn = [-1]  # the segment of the trace that runs now: a run of ops of one thread",
             "failed = []", "", "",
             "def wait(segment):",
             "    deadline = time.monotonic() + 60",
             "    while turn[0] != segment:",
             "        if failed or time.monotonic() > deadline:",
             "            raise RuntimeError(f'segment {segment} never came: another thread failed or hangs')",
             "        time.sleep(0)", "", "",
             "def run(body):",
             "    try:",
             "        body()",
             "    except BaseException as exc:",
             "        failed.append(exc)"]
    text = list(head)
    lines = [0] * len(ops)
    segment = -1
    bodies: dict[str, list[tuple[int, str]]] = {t: [] for t in threads}  # (op index or -1, line)
    for k, op in enumerate(ops):
        thread = op.get("thread", threads[0])
        if thread not in bodies:
            raise ValueError(f"op {k}: unknown thread {thread!r}")
        if k == 0 or thread != ops[k - 1].get("thread", threads[0]):
            segment += 1
            if k:
                previous = ops[k - 1].get("thread", threads[0])
                bodies[previous].append((-1, f"turn[0] = {segment}"))
            bodies[thread].append((-1, f"wait({segment})"))
        bodies[thread].append((k, line(k, op)))
    if ops:
        bodies[ops[-1].get("thread", threads[0])].append((-1, f"turn[0] = {segment + 1}"))
    for n, thread in enumerate(threads):
        text += ["", "", f"def thread{n}():  # {thread}"]
        for k, statement in bodies[thread] or [(-1, "pass")]:
            text.append(f"    {statement}")
            if k >= 0:
                lines[k] = len(text)
    text += ["", ""]
    if len(threads) > 1:
        text += ["worker = threading.Thread(target=run, args=(thread1,), name='worker')", "worker.start()"]
    # from now on: the locks of the worker's start, taken before its first segment, order no op
    text += ["turn[0] = 0", "run(thread0)"]
    if len(threads) > 1:
        text.append("worker.join()")
    text += ["if failed:", "    raise failed[0]", ""]
    return Program("\n".join(text), lines)


# -- the devices the programs run on ----------------------------------------------------------------


class TorchCuda:
    """The program's device through torch: CUDA tensors, pinned tensors, plain CPU tensors, a page
    of numpy memory registered with ``torch.cuda.cudart().cudaHostRegister``, ``torch.cuda.Stream``
    and ``Event``, ``kvverify.swap_blocks_batch``. ``close()`` after the recording synchronizes and
    unregisters what the program registered (raises RuntimeError where CUDA refuses either)."""

    PAGE = 4096

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self._registered: list = []  # the numpy pages the program registered

    def recording(self):
        from kvverify.record import recording
        from kvverify.record.capture.frames import library_dirs

        return recording(skip=(*library_dirs(), __file__))

    def device(self, n: int):
        return self.torch.empty(n, dtype=self.torch.uint8, device="cuda")

    def pinned(self, n: int):
        return self.torch.empty(n, dtype=self.torch.uint8, pin_memory=True)

    def pageable(self, n: int):
        return self.torch.empty(n, dtype=self.torch.uint8)

    def registered(self, n: int):
        import numpy as np

        raw = np.zeros(2 * self.PAGE, dtype=np.uint8)
        page = raw[-raw.ctypes.data % self.PAGE:][: self.PAGE]  # cudaHostRegister wants whole pages
        status = int(self.torch.cuda.cudart().cudaHostRegister(page.ctypes.data, self.PAGE, 0))
        if status:
            raise RuntimeError(f"cudaHostRegister failed: cudaError {status}")
        self._registered.append(page)
        return self.torch.from_numpy(page[:n])

    def stream(self):
        return self.torch.cuda.Stream()

    def event(self):
        return self.torch.cuda.Event()

    def on(self, stream):
        return self.torch.cuda.stream(stream)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def swap(self, src: list[int], dst: list[int], sizes: list[int], order: str) -> None:
        import kvverify

        kvverify.swap_blocks_batch(src, dst, sizes, order)

    def close(self) -> None:
        self.torch.cuda.synchronize()
        while self._registered:
            status = int(self.torch.cuda.cudart().cudaHostUnregister(self._registered.pop().ctypes.data))
            if status:
                raise RuntimeError(f"cudaHostUnregister failed: cudaError {status}")


class FakeDevice:
    """The program's device on the CPU stand-in (``fake_cuda.FakeCuda``): registered memory is
    pageable memory declared registered (``kvverify.record.host_buffer``), as the wrapped
    ``cudaHostRegister`` tells the recorder on a GPU; a batched swap is the stand-in's
    ``kvtest::swap_blocks_batch``, run on the host."""

    def __init__(self) -> None:
        from fake_cuda import FakeCuda, swap_ops

        self.fake = FakeCuda()
        self.kvswap = swap_ops()[0]

    def recording(self):
        from kvverify.record import recording

        return recording(platform=self.fake, skip=(*self.fake.skip(), __file__))

    def device(self, n: int):
        return self.fake.device(n)

    def pinned(self, n: int):
        return self.fake.pinned(n)

    def pageable(self, n: int):
        return self.fake.pageable(n)

    def registered(self, n: int):
        from kvverify.record import host_buffer

        t = self.fake.pageable(n)
        host_buffer(t, "registered")
        return t

    def stream(self):
        return self.fake.stream()

    def event(self):
        return self.fake.event()

    def on(self, stream):
        return self.fake.use(stream)

    def synchronize(self) -> None:
        self.fake.synchronize()

    def swap(self, src: list[int], dst: list[int], sizes: list[int], order: str) -> None:
        from fake_cuda import ptrs

        self.kvswap(ptrs(*src), ptrs(*dst), ptrs(*sizes), SrcAccessOrder[order].value)

    def close(self) -> None:
        pass


# -- running and comparing ----------------------------------------------------------------------------


def _line(at: str | None, path: Path) -> int | None:
    """The line of ``path`` an ``at`` names (``"file.py:12 in thread0"``), or None for another place."""
    if not at:
        return None
    where = at.split(" in ", 1)[0]
    name, _, number = where.rpartition(":")
    return int(number) if Path(name).name == path.name else None


def racing_lines(trace: dict, program: Program) -> set[tuple[int, int]]:
    """``(line, line)`` of each race ``kvverify.check`` finds in ``trace``, lower line first."""
    from kvverify.check import check

    return {tuple(sorted((program.lines[r.first], program.lines[r.second]))) for r in check(trace).races}


def recorded_lines(rec, path: Path) -> set[tuple]:
    """``(line, line)`` of each race of the recording ``rec`` of the program at ``path``, lower line
    first (None for an op issued elsewhere, which no op of the trace is)."""
    ops = rec.trace()["ops"]
    return {tuple(sorted((_line(ops[r.first].get("at"), path), _line(ops[r.second].get("at"), path)),
                         key=lambda x: (x is None, x or 0)))
            for r in rec.check().races}


# Between the program's first op and its last, a thread acquires queue items alone: an acquire of
# a lock there would be host ordering the trace lacks (threading's own, as the worker starts and
# as it is joined, come before the first op and after the last).
QUEUE_ITEM = "queue item"
UNORDERED_SHARING = f"{NOT_RECORDED} (ops of two threads on one stream or event"


def disagreement(trace: dict, api, folder: Path) -> str | None:
    """Run ``trace``'s program on ``api`` under a recording (the program written to
    ``folder / "program.py"``); None where the recording's racing lines are the checker's on the
    trace, else a report with both sets, both traces, the program and the recording's summary.
    A recording that holds host ordering the program does not ask for (a lock between its
    threads' ops), or that missed work (a NOT RECORDED note other than two threads' unordered use of
    one stream, which the turns make exact), is a disagreement too. The program's own exceptions
    propagate."""
    from kvverify.check import check

    program = generate(trace)
    path = folder / "program.py"
    path.write_text(program.source)
    namespace: dict = {}  # the program's globals: its buffers, which outlive the device's work on them
    try:
        with api.recording() as rec:
            namespace = runpy.run_path(str(path), init_globals={"api": api})
    finally:
        api.close()
        namespace.clear()
    expected = racing_lines(trace, program)
    recorded = recorded_lines(rec, path)
    doc = rec.trace()
    work = [k for k, op in enumerate(doc["ops"]) if op["op"] not in ("release", "acquire")]
    syncs = sorted({op["sync"] for k, op in enumerate(doc["ops"]) if op["op"] == "acquire"
                    and not op["sync"].startswith(QUEUE_ITEM) and work and work[0] < k < work[-1]})
    missed = [note for note in rec.summary().notes if note.startswith(NOT_RECORDED)
              and not note.startswith(UNORDERED_SHARING)]
    if expected == recorded and not syncs and not missed:
        return None
    numbered = "\n".join(f"{k:4} {text}" for k, text in enumerate(program.source.splitlines(), 1))
    return (f"racing lines: checker on the trace {sorted(expected)}, recording {sorted(recorded, key=str)}\n"
            f"host orderings the program does not ask for: {syncs}\nmissed: {missed}\n"
            f"trace:\n{json.dumps(trace)}\nprogram:\n{numbered}\n"
            f"recorded trace:\n{json.dumps(doc, indent=None)}\n"
            f"checker on the trace:\n{check(trace).render()}\nrecording:\n{rec.report()}")


# -- disagreements ---------------------------------------------------------------------------------

_B = {"dev0": {"space": "device", "bytes": 16}, "dev1": {"space": "device", "bytes": 16},
      "pin": {"space": "host_pinned", "bytes": 16}}


def _handed_over(middle: list[dict], first: tuple[dict, ...] = ()) -> dict:
    """The main thread does ``first``, reads pinned bytes, then issues ``middle`` to stream s1; the
    worker copies into those bytes on s1: stream order puts the copy after ``middle``, and so after
    the read."""
    return {"version": 1, "buffers": _B, "streams": ["s0", "s1"], "threads": ["main", "worker"],
            "ops": [*first, {"op": "host_read", "ranges": [["pin", 0, 4]]}, *middle,
                    {"op": "copy", "stream": "s1", "src": ["dev0", 0, 4], "dst": ["pin", 0, 4], "thread": "worker"}]}


HANDED_ON = {
    "record": _handed_over([{"op": "record", "event": "e0", "stream": "s1"}]),
    # a query before the first record names no event of the recording's
    "record-queried-before": _handed_over([{"op": "record", "event": "e0", "stream": "s1"}],
                                          first=({"op": "query_event", "event": "e0", "result": True},)),
    "summarized-kernel": _handed_over([{"op": "kernel", "stream": "s1", "reads": [], "writes": [["dev1", 0, 4]]}]),
    # as hypothesis found it: the main thread's record of e0 on s1 (op 4) orders its host reads before
    # the worker's batch into the same pinned bytes (op 5)
    "found": {"version": 1, "buffers": {"dev0": {"space": "device", "bytes": 16},
                                        "reg": {"space": "host_registered", "bytes": 16},
                                        "pin": {"space": "host_pinned", "bytes": 16}},
              "streams": ["s0", "s1"], "threads": ["main", "worker"],
              "ops": [{"op": "host_read", "ranges": [["pin", 12, 4]], "thread": "main"},
                      {"op": "record", "event": "e1", "stream": "s0"},
                      {"op": "query_event", "event": "e1", "result": True},
                      {"op": "host_read", "ranges": [["pin", 0, 8], ["pin", 8, 4]]},
                      {"op": "record", "event": "e0", "stream": "s1"},
                      {"op": "copy_batch", "stream": "s1", "order": "STREAM",
                       "copies": [{"src": ["dev0", 0, 4], "dst": ["pin", 8, 4]},
                                  {"src": ["dev0", 12, 4], "dst": ["dev0", 8, 4]}], "thread": "worker"},
                      {"op": "record", "event": "e0", "stream": "s1", "thread": "worker"},
                      {"op": "release", "sync": "h0", "thread": "worker"},
                      {"op": "acquire", "sync": "h0"},
                      {"op": "host_read", "ranges": [["pin", 0, 8]], "thread": "main"},
                      {"op": "record", "event": "e1", "stream": "s1", "thread": "main"},
                      {"op": "wait_event", "stream": "s1", "event": "e1"},
                      {"op": "release", "sync": "h1"},
                      {"op": "kernel", "stream": "s0", "reads": [], "writes": [["dev0", 0, 4]]},
                      {"op": "sync_device", "thread": "main"},
                      {"op": "acquire", "sync": "h1", "thread": "worker"},
                      {"op": "release", "sync": "h2", "thread": "main"},
                      {"op": "acquire", "sync": "h2", "thread": "worker"}]},
}
"""Traces a recording once disagreed on: with two threads, a stream op that orders nothing itself (a
record nothing uses, a kernel of summarized accesses only) was left out of the recording, while it
orders its thread's earlier ops before the other thread's later work on that stream (rule 2 holds
across threads): the recording raced where the trace does not."""
