"""A device witness for a recorded race: run the program again in the order CUDA permits and the
program did not ask for, and compare the bytes (``kvverify record --confirm``).

A race is two ops, ``first`` issued before ``second``, that nothing orders. The recording names
each by its place in the program (``Target``: its thread, its line, the op, and how many calls of
that op at that line came before it), so a later run of the same program finds them again. Three
runs per pair of lines (``Plan``), each stopping the program at the first point where both ops are
complete and reading the bytes they wrote there:

- ``in-order`` (twice): the program waits for ``first`` to complete right after issuing it, so
  ``second`` sees its effect: the order the program meant. Two such runs that differ say the
  program is not deterministic here, and nothing can be concluded.
- ``forced``: ``first``'s stream is held before ``first`` is issued (a stream-memory wait on a host
  flag, ``kvverify.device.gate``, with a watchdog) until ``second`` has completed, so ``second``
  happens first. A host access as ``second`` is complete when its call returns; a host read is
  witnessed by the bytes it read, taken right then. A batched swap as
  ``second`` that reads ``first``'s output in source access order ``ANY`` or ``DURING_API_CALL``
  may read its sources at its call, before ``first`` ran (CUDA Driver API, ``cuMemcpyBatchAsync``,
  ``CUmemcpySrcAccessOrder``), while its stream may still wait for ``first``: the bytes ``first``
  is about to write are read while it is held (then it runs at once), and once the swap completed
  its destinations get them where its sources overlap them.

``judge`` compares them: CONFIRMED with the count of bytes that differ and the first of them, or
not confirmed (the forced order changed no byte, or ``second`` could not complete while ``first``
was held: it waits for it), or no witness (the pair was not found again, the runs in issue order
differ). A free as ``second`` (kind FREE, use after free) is forced where its bytes stay reachable:
a pool's hand-over (``kvverify.record.reuse``) and ``cuMemUnmap`` (the virtual range stays
reserved). Once the free returned, the witness stands in for the bytes' next owner: it maps fresh
memory where the range was unmapped (the held op would otherwise read an unmapped address, a
device fault that ends the context; a sleep-capable allocator's wake maps there the same way),
writes ``MARK`` over them, then lets ``first`` go, and reads back what ``first`` wrote and what
the next owner is left with; its own mapping goes again before the program goes on. A free that
gives its bytes back (a raw or allocator free, a host unregister, ``kvverify.record.free``) is
not forced: the bytes may be gone. Ops seen only by native
capture (Triton, kernels launched from C++, ``cudaMemcpyAsync`` from C) are not forced: holding
their stream before the call would need the driver callback to do it; they are named as such.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvverify.record.trace.writer import buffer_name
from kvverify.terms import DEVICE_SPACE

IN_ORDER, FORCED = "in-order", "forced"
CONFIRMED, NOT_CONFIRMED, NO_WITNESS = "CONFIRMED", "not confirmed", "no witness"
WAIT_S = 10.0  # how long a forced run waits for the second op before it calls the pair ordered
DONE_S = 60.0  # how long a witness run waits for an op that nothing holds
MAX_BYTES = 256 << 20  # the most bytes one witness reads back
EARLY_READ_ORDERS = ("ANY", "DURING_API_CALL")
NEXT_OWNERS = ("reused", "unmapped")  # frees whose bytes a witness run can stand in for (Recorder.released)
MARK = 0xA5  # what the witness writes over released bytes as their next owner
ADDRESS = re.compile(r" @0x[0-9a-f]+")
NUMBERS = re.compile(r"\d+")  # in a thread's name: Python's and executors' counters go on from run to run


@dataclass(frozen=True)
class Target:
    """An op found again by its place in the program: ``thread`` (None: the recording's own),
    ``at`` (``file.py:12 in f``), ``name`` (the dispatcher op, ``aten.copy_.default``) and
    ``call``, how many calls of ``name`` at ``at`` on ``thread`` came before it."""

    thread: str | None
    at: str
    name: str
    call: int


@dataclass(frozen=True)
class Plan:
    """The witness runs of one pair of lines: hold ``first`` until ``second`` has completed.
    ``races``: the numbers (1-based, as the verdict lists them) of every race of that pair;
    ``kind``: RAW / WAR / WAW; ``second_on_host``: ``second`` is a host access (complete when its
    call returns); ``early_read``: ``second`` is a batched swap reading ``first``'s output in an
    order that lets it read at its call; ``next_owner``: ``second`` is a free whose bytes are
    ``"reused"`` or ``"unmapped"`` after it (``Recorder.released``), which the witness stands in
    for."""

    races: tuple[int, ...]
    kind: str
    first: Target
    second: Target
    second_on_host: bool
    early_read: bool
    next_owner: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        return cls(tuple(d["races"]), d["kind"], Target(**d["first"]), Target(**d["second"]),
                   d["second_on_host"], d["early_read"], d.get("next_owner"))


@dataclass
class WitnessObservation:
    """What one witness run saw: whether it found ``first`` and ``second``; ``ordered``: in a
    forced run, ``second`` did not complete while ``first`` was held (it waits for it);
    ``expired``: holds the watchdog released; ``ranges``: ``(label, bytes)`` read where both ops
    were complete, ``data`` their bytes back to back; ``status``: the program's exit status."""

    mode: str
    found_first: bool = False
    found_second: bool = False
    ordered: bool = False
    expired: int = 0
    ranges: list[tuple[str, int]] = field(default_factory=list)
    data: bytes = b""
    status: int = 0
    note: str | None = None

    def meta(self) -> dict:
        """The observation without its bytes (JSON)."""
        d = asdict(self)
        d.pop("data")
        return d

    @classmethod
    def from_meta(cls, d: dict, data: bytes) -> WitnessObservation:
        d = dict(d, ranges=[tuple(r) for r in d["ranges"]])
        return cls(**d, data=data)


@dataclass
class Outcome:
    """The witness of one pair of lines: ``status`` CONFIRMED / not confirmed / no witness, and
    why (``detail``); ``differ`` of ``compared`` bytes differ between the forced run and the runs
    in issue order; ``program``: the forced run's exit status where it failed."""

    races: tuple[int, ...]
    kind: str
    first_at: str | None
    second_at: str | None
    status: str
    detail: str
    differ: int = 0
    compared: int = 0
    program: int | None = None

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        races = ", ".join(str(r) for r in self.races)
        return f"{self.status}: race{'s' if len(self.races) > 1 else ''} {races} ({self.kind}): {self.detail}"


# -- plans ----------------------------------------------------------------------------------------


def _target(op: dict) -> Target | None:
    if op.get("call") is None:
        return None
    return Target(op.get("caller"), op.get("at") or "", op.get("name") or op["op"], op["call"])


def plans(log: Sequence[dict], sources: Sequence[int], races: Sequence) -> tuple[list[Plan], list[Outcome]]:
    """The witness plans of ``races`` (``kvverify.check.Race``, their ops indices into the trace
    whose ops came from ``log[sources[k]]``), one per pair of lines and kind, and the outcomes of
    the races no run can witness (an op not issued through the dispatcher, a free, a race inside
    one op)."""
    groups: dict[tuple, list[int]] = {}
    pair: dict[tuple, tuple[Target, Target, dict, dict]] = {}
    left: dict[tuple, tuple[list[int], str]] = {}
    for number, race in enumerate(races, 1):
        key = (race.first_at, race.second_at, race.kind)
        first, second = log[sources[race.first]], log[sources[race.second]]
        targets = _target(first), _target(second)
        why = None
        if race.kind == "FREE" and second.get("after") not in NEXT_OWNERS:
            why = ("the free gives its bytes back (a raw or allocator free, a host unregister, "
                   "kvverify.record.free): holding the op past it would touch memory that may be gone; a pool's "
                   "hand-over marked with kvverify.record.reuse, or a cuMemUnmap, is witnessed")
        elif race.first == race.second or (targets[0] is not None and targets[0] == targets[1]):
            why = ("the pair is one call (copies or groups of one batched call): there is no second call to "
                   "hold it for")
        elif None in targets:
            why = ("an op of the pair was seen only by native capture (a kernel or copy issued outside torch's "
                   "dispatcher and cuda-python): forcing it is not built")
        if why is not None:
            left.setdefault(key, ([], why))[0].append(number)
            continue
        groups.setdefault(key, []).append(number)
        pair.setdefault(key, (*targets, first, second))
    out = []
    for key, numbers in groups.items():
        first, second, first_op, second_op = pair[key]
        on_host = second_op["op"] in ("host_read", "host_write", "free")
        early = (second_op["op"] == "copy_batch" and second_op.get("order") in EARLY_READ_ORDERS
                 and key[2] == "RAW")
        out.append(Plan(tuple(numbers), key[2], first, second, on_host, early, second_op.get("after")))
    outcomes = [Outcome(tuple(numbers), key[2], key[0], key[1], NO_WITNESS, why)
                for key, (numbers, why) in left.items()]
    return out, outcomes


# -- a witness run --------------------------------------------------------------------------------


class DeviceTools:
    """What a witness run asks of the device: ``kvverify.record.capture.hooks.CudaTools`` on a CUDA device,
    a stand-in in the CPU tests."""

    def hold(self, stream: int | None = None) -> None:
        """Make work issued to ``stream`` (a raw handle; None: the current stream) from now on wait
        until ``release``."""
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def expired(self) -> int:
        """How many holds the watchdog released (the host blocked while one was open)."""
        return 0

    def mark(self, stream: int | None = None) -> Callable[[float], bool]:
        """A marker after the work so far of ``stream`` (a raw handle; None: the current stream):
        ``wait(seconds)`` is True once it completed."""
        raise NotImplementedError

    def read(self, address: int, nbytes: int, device: bool) -> bytes:
        raise NotImplementedError

    def write(self, address: int, data: bytes, device: bool) -> None:
        raise NotImplementedError

    def back(self, address: int, nbytes: int) -> Callable[[], None]:
        """Map fresh device memory at ``[address, address + nbytes)``, a virtual range the program
        unmapped and still reserves; returns the call that unmaps and releases it again."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _copies(op: dict) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """A logged batched swap's ``(source span, destination span)`` pairs."""
    c = op["copies"]
    sizes = c.size.tolist()
    return list(zip(zip(c.src_index.tolist(), c.src_offset.tolist(), sizes),
                    zip(c.dst_index.tolist(), c.dst_offset.tolist(), sizes)))


def _written(op: dict) -> list[tuple[int, int, int]]:
    """The spans ``(allocation, offset, bytes)`` a logged op writes."""
    kind = op["op"]
    if kind == "kernel":
        return list(op["writes"])
    if kind == "copy":
        return [op["dst"]]
    if kind == "copy_batch":
        return [dst for _, dst in _copies(op)]
    if kind == "host_write":
        return list(op["ranges"])
    return []


class Forcer:
    """Installed in a recording's dispatch hook (``RecordingMode.forcer``): counts every op's calls
    at its line, writes the count into what the op logs (``"call"``), and in a witness run
    (``plan`` and ``mode`` given) holds or waits for the plan's pair and reads the bytes."""

    def __init__(self, recorder, plan: Plan | None = None, mode: str | None = None,
                 tools: DeviceTools | None = None, wait_s: float = WAIT_S) -> None:
        self.recorder = recorder
        self.plan, self.mode, self.tools = plan, mode, tools
        self.wait_s = wait_s
        self.calls: Counter = Counter()
        self._threads: dict[str, str] = {}  # the recording's thread name -> the stable one (_thread)
        self._bases: Counter = Counter()
        self._lock = threading.Lock()
        self._first_ops: list[dict] | None = None
        self._first_done: Callable[[float], bool] | None = None
        self._unwritten: list[tuple[tuple[int, int, int], bytes]] = []  # an early read's bytes (FORCED)
        self.observation = WitnessObservation(mode or "counting")

    def _thread(self, name: str | None) -> str | None:
        """The name a witness run finds a thread again by: the recording's, with its numbers
        (``Thread-3 (worker)``, ``ThreadPoolExecutor-1_0``: counters that go on from run to run in
        one process) left out and the order in which this run first saw an op of such a thread
        put in their place (``Thread-# (worker) #1``)."""
        if name is None:
            return None
        stable = self._threads.get(name)
        if stable is None:
            base = NUMBERS.sub("#", name)
            self._bases[base] += 1
            stable = self._threads[name] = f"{base} #{self._bases[base]}"
        return stable

    def before(self, name: str, stream: int | None = None) -> tuple[Target, str | None, int]:
        """Called before an op is issued (``stream``: its raw stream handle where it names one,
        else the current stream's); holds the stream where the op is the plan's first. Returns
        what ``after`` and ``failed`` take: the op's ``Target``, the recording's name of its
        thread, and where the log stood."""
        rec = self.recorder
        start = len(rec.ops)
        ident = threading.get_ident()
        thread = None if ident == rec.first else rec.threads.get(ident)
        at = rec.locate(1) or ""  # (a thread whose target is library code has no line of the program)
        with self._lock:
            key = (thread, at, name)
            call = self.calls[key]
            self.calls[key] = call + 1
            target = Target(self._thread(thread), at, name, call)
        if self.mode == FORCED and target == self.plan.first:
            self.tools.hold(stream)  # before the op is issued to the stream
        return target, thread, start

    def failed(self, issued: tuple[Target, str | None, int]) -> None:
        """The op raised instead of being issued: a hold put in for it is taken away."""
        if self.mode == FORCED and issued[0] == self.plan.first:
            self.tools.release()

    def after(self, issued: tuple[Target, str | None, int], stream: int | None = None) -> None:
        """Called once the op is issued and logged: its entries are those since ``before`` of its
        thread, line and name (another thread may have logged meanwhile, also at this line)."""
        target, thread, start = issued
        ops = [op for op in self.recorder.ops[start:] if (op.get("at") or "") == target.at
               and (op.get("name") or op["op"]) == target.name and op.get("thread") == thread]
        for op in ops:
            op["call"], op["caller"] = target.call, target.thread
        plan = self.plan
        if plan is None:
            return
        if target == plan.first:
            self.observation.found_first = True
            self._first_ops = ops
            self._first_done = self.tools.mark(stream)
            if self.mode == IN_ORDER and not self._first_done(DONE_S):
                self.observation.note = f"the first op did not complete within {DONE_S:.0f} s"
            elif self.mode == FORCED and plan.early_read:
                # the bytes the first op is about to write, read while it is held; then it runs at once:
                # holding it until the swap's call would block a program that waits on its stream
                self._unwritten = [(span, self._read(span)) for op in ops for span in _written(op)
                                   if span[2] <= MAX_BYTES]
                self.tools.release()
        elif target == plan.second and self._first_ops is not None and not self.observation.found_second:
            self.observation.found_second = True
            self._witness(ops, stream)

    def _witness(self, second_ops: list[dict], stream: int | None) -> None:
        tools, obs, memory = self.tools, self.observation, self.recorder.memory
        swaps = [op for op in second_ops if op["op"] == "copy_batch" and op.get("order") in EARLY_READ_ORDERS]
        stood_in: list[tuple[str, int, int, bool]] = []
        undo: list[Callable[[], None]] = []
        if self.plan.next_owner is not None:
            try:
                stood_in = self._stand_in(second_ops, undo)
            except Exception as exc:  # the program runs on; this run witnesses nothing
                obs.note = f"the witness could not stand in for the freed bytes' next owner: {exc}"
                tools.release()
                return
        if self.plan.second_on_host:
            second_done = True
        elif self.mode == FORCED and self.plan.early_read and swaps:
            # a read at the swap's call, before the first op wrote: where a copy's source overlaps what
            # the first op wrote, its destination gets the bytes from before that write, once the
            # swap itself (which may wait for the first op in stream order) has completed
            second_done = tools.mark(stream)(DONE_S)
            for op in swaps:
                for (s, so, n), (d, do, _) in _copies(op):
                    for (a, ao, an), data in self._unwritten:
                        lo, hi = max(so, ao), min(so + n, ao + an)
                        if a == s and lo < hi:
                            target = memory.allocations[d]
                            tools.write(target.base + do + lo - so, data[lo - ao:hi - ao], target.space == DEVICE_SPACE)
        else:
            second_done = tools.mark(stream)(self.wait_s if self.mode == FORCED else DONE_S)
        obs.ordered = self.mode == FORCED and not second_done
        # a host read as the second op writes nothing: what it saw is the bytes it read, as they are
        # now, with the first op still held in a forced run
        seen = [span for op in second_ops if op["op"] == "host_read" for span in op["ranges"]]
        if sum(s[2] for s in seen) > MAX_BYTES:
            obs.note = f"the host read more than {MAX_BYTES >> 20} MiB: not read back"
            seen = []
        host_read = [self._read(span) for span in seen]
        tools.release()
        if not self._first_done(DONE_S):
            # memory mapped for the next owner stays: the op may still reach it
            obs.note = f"the first op did not complete within {DONE_S:.0f} s of the release"
            undo.clear()
        obs.expired = tools.expired()
        try:
            spans = [s for op in (self._first_ops or []) + second_ops for s in _written(op)]
            if sum(s[2] for s in spans) + sum(s[2] for s in stood_in) > MAX_BYTES:
                obs.note = f"the pair writes more than {MAX_BYTES >> 20} MiB: not read back"
                return
            obs.data = b"".join([self._read(span) for span in spans]
                                + [tools.read(address, n, device) for _, address, n, device in stood_in] + host_read)
            obs.ranges = ([(f"{buffer_name(memory.allocations[a])}+{offset:#x}", n) for a, offset, n in spans]
                          + [(f"{label} as its next owner left it", n) for label, _, n, _ in stood_in]
                          + [(f"{buffer_name(memory.allocations[a])}+{offset:#x} as the host read it", n)
                             for a, offset, n in seen])
        finally:
            for call in undo:
                call()

    def _stand_in(self, frees: list[dict], undo: list[Callable[[], None]]) -> list[tuple[str, int, int, bool]]:
        """Be the next owner of what ``frees`` released, as the program's next owner could be: map
        fresh device memory where a range was unmapped (appending the call that unmaps it again to
        ``undo``), then write ``MARK`` over every released byte. Returns what it wrote, as
        ``(label, address, bytes, on the device)``."""
        memory, out = self.recorder.memory, []
        for op in frees:
            if op["op"] != "free":
                continue
            parts = [(memory.allocations[a], offset, n) for a, offset, n in op["ranges"]]
            if op.get("after") == "unmapped":
                lo = min(a.base + offset for a, offset, _ in parts)
                hi = max(a.base + offset + n for a, offset, n in parts)
                if hi - lo > MAX_BYTES:
                    raise ValueError(f"the unmapped range is {hi - lo:,} bytes, more than the "
                                     f"{MAX_BYTES >> 20} MiB a witness maps and reads")
                undo.append(self.tools.back(lo, hi - lo))
            for a, offset, n in parts:
                device = op.get("after") == "unmapped" or a.space == DEVICE_SPACE
                self.tools.write(a.base + offset, bytes([MARK]) * n, device)
                out.append((f"{buffer_name(a)}+{offset:#x}", a.base + offset, n, device))
        return out

    def _read(self, span: tuple[int, int, int]) -> bytes:
        a = self.recorder.memory.allocations[span[0]]
        return self.tools.read(a.base + span[1], span[2], a.space == DEVICE_SPACE)


# -- the verdict of three runs --------------------------------------------------------------------


def _first_difference(ranges: list[tuple[str, int]], got: np.ndarray, expected: np.ndarray, at: int) -> str:
    start = 0
    for label, n in ranges:
        if at < start + n:
            k = at - start
            return (f"first at {label}[{k}]: {bytes(got[at:at + 8]).hex()} where the issue order gives "
                    f"{bytes(expected[at:at + 8]).hex()}")
        start += n
    return "?"


def judge(plan: Plan, first_at: str | None, second_at: str | None, in_order: WitnessObservation,
          again: WitnessObservation, forced: WitnessObservation) -> Outcome:
    """The outcome of ``plan``'s three runs (see the module docstring)."""

    def outcome(status: str, detail: str, differ: int = 0, compared: int = 0) -> Outcome:
        program = forced.status if forced.status else None
        return Outcome(plan.races, plan.kind, first_at, second_at, status, detail, differ, compared, program)

    runs = (in_order, again, forced)
    missing = [r.mode for r in runs if not (r.found_first and r.found_second)]
    if missing:
        return outcome(NO_WITNESS, "the program did not issue the pair again in the "
                       f"{' and '.join(dict.fromkeys(missing))} run (it took another path, or stopped first)")
    if forced.ordered:
        return outcome(NOT_CONFIRMED, "the second op did not complete while the first was held: it waits for "
                       "it (stream order or a host wait), so this order cannot happen here")
    if forced.expired:
        return outcome(NOT_CONFIRMED, "the program blocked while the first op was held (a synchronization "
                       "between the two ops): the watchdog released it")
    notes = [r.note for r in runs if r.note]
    if notes:
        return outcome(NO_WITNESS, notes[0])
    # (a buffer made before the recording is named by its address, which another run need not share)
    places = {tuple((ADDRESS.sub("", label), n) for label, n in r.ranges) for r in runs}
    if len(places) > 1 or len({len(r.data) for r in runs}) > 1:
        return outcome(NO_WITNESS, "the runs read back other byte ranges (other buffers, offsets or sizes): "
                       "the program is not deterministic here")
    a, b, f = (np.frombuffer(r.data, dtype=np.uint8) for r in runs)
    if not len(a):
        return outcome(NOT_CONFIRMED, "the pair writes no bytes to compare")
    if (a != b).any():
        return outcome(NO_WITNESS, f"the program is not deterministic here: two runs in issue order differ in "
                       f"{int((a != b).sum()):,} of {len(a):,} bytes")
    diff = np.flatnonzero(a != f)
    if not len(diff):
        return outcome(NOT_CONFIRMED, f"the forced order changed no byte of {len(a):,} (a benign race here, or "
                       "one whose effect this program does not keep)", 0, len(a))
    emulated = ("; the swap's read at its call was made by the witness: the order permits it, this driver "
                "may still read in stream order") if plan.early_read else ""
    if plan.next_owner is not None:
        mapped = " on fresh memory it mapped at the unmapped range" if plan.next_owner == "unmapped" else ""
        emulated = (f"; the witness stood in for the freed bytes' next owner: it wrote {MARK:#04x} over them"
                    f"{mapped} before the held op ran")
    second = "the free" if plan.kind == "FREE" else "the second op"
    return outcome(CONFIRMED, f"{len(diff):,} of {len(a):,} bytes differ with {second} first ("
                   f"{_first_difference(in_order.ranges, f, a, int(diff[0]))}){emulated}", len(diff), len(a))


def save(obs: WitnessObservation, path: str) -> None:
    """Write an observation: its JSON at ``path``, its bytes at ``path + ".bin"``."""
    with open(path + ".bin", "wb") as f:
        f.write(obs.data)
    with open(path, "w") as f:
        json.dump(obs.meta(), f)


def load(path: str) -> WitnessObservation:
    with open(path + ".bin", "rb") as f:
        data = f.read()
    with open(path) as f:
        return WitnessObservation.from_meta(json.load(f), data)


@contextlib.contextmanager
def witnessing(plan: Plan, mode: str, *, swap_ops: Sequence[str] = (), platform=None, skip=None):
    """A witness run of ``plan`` in ``mode`` (``IN_ORDER`` or ``FORCED``) around the program's code
    inside the ``with``, under a recording without native capture; yields ``(recording,
    observation)``, the observation complete when the ``with`` ends (its ``status`` is the
    caller's to set). No stream stays held after it. Raises RecordingError where no recording
    can start, ValueError for another mode."""
    from kvverify.record.session import recording

    if mode not in (IN_ORDER, FORCED):
        raise ValueError(f"a witness run is {IN_ORDER} or {FORCED}, not {mode!r}")
    rec = recording(swap_ops=swap_ops, platform=platform, skip=skip, native=False)
    rec.start()
    tools = None
    try:
        tools = rec.witness_tools()
        forcer = Forcer(rec.recorder, plan, mode, tools)
        rec.follow_calls(forcer)
        yield rec, forcer.observation
    finally:
        if tools is not None:
            tools.release()  # never leave a stream held behind the program
        rec.stop()
        if tools is not None:
            tools.close()


def observe(run: Callable[[], int], plan: Plan, mode: str, *, swap_ops: Sequence[str] = (), platform=None,
            skip=None) -> WitnessObservation:
    """Run the program once (``run()`` returns its exit status) as a witness run of ``plan`` in
    ``mode`` (see ``witnessing``) and return what it saw."""
    with witnessing(plan, mode, swap_ops=swap_ops, platform=platform, skip=skip) as (_, observation):
        observation.status = run()
    return observation


def confirm(plan_list: Sequence[Plan], witness_run: Callable[[Plan, str], WitnessObservation],
            progress: Callable[[str], None] = lambda line: None) -> list[Outcome]:
    """The outcome of each plan: its two runs in issue order and its forced run, each made by
    ``witness_run(plan, mode)`` (in this process, or in a child process of the program)."""
    out = []
    for k, plan in enumerate(plan_list, 1):
        runs = []
        for mode in (IN_ORDER, IN_ORDER, FORCED):
            progress(f"race{'s' if len(plan.races) > 1 else ''} {', '.join(map(str, plan.races))}: witness run "
                     f"{len(runs) + 1} of 3 ({mode}); pair {k} of {len(plan_list)}")
            runs.append(witness_run(plan, mode))
        out.append(judge(plan, plan.first.at, plan.second.at, *runs))
    return out


def in_race_order(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """``outcomes`` in the order of the races they witness (the verdict's numbers)."""
    return sorted(outcomes, key=lambda o: o.races[0])
