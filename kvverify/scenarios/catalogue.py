"""The scenario catalogue: hazards H1–H7 (broken and fixed) and the production patterns P1, P2.

Each builder writes its schedule once, as a ``Program``; the trace (``to_trace``) and the
executors read that same program. No builder says which source access orders make it
racy: that is the checker's verdict on the program's trace.

Every scenario is laid out as the engine's offload pipeline: ``transfers`` batched swaps of
``blocks_per_transfer`` blocks each, transfer ``t`` on its own stream ``xfer<t>`` (a pool of
streams, one per transfer), waiting on the previous transfer's end event, completion found
by polling the end events while compute has gone on to write the next blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvverify.scenarios.program import (
    GPU,
    HOST,
    BlockCopy,
    Blocks,
    Expect,
    HostConsume,
    HostFill,
    Poll,
    Program,
    Read,
    Record,
    Step,
    Swap,
    SyncEvent,
    WaitEvent,
    WaitStream,
    Write,
    validate,
)
from kvverify.terms import LOAD, STORE

COMPUTE = "compute"


@dataclasses.dataclass(frozen=True)
class Params:
    """Pipeline shape: blocks per batched swap and swaps in flight at once."""

    blocks_per_transfer: int = 4
    transfers: int = 3

    def __post_init__(self) -> None:
        if self.blocks_per_transfer < 1:
            raise ValueError(f"blocks_per_transfer must be at least 1, got {self.blocks_per_transfer}")
        # Two in flight is the least that shows a pipeline (H3 rewrites its staging block
        # while the previous transfer is pending); the generation space allows 32.
        if not 2 <= self.transfers <= 32:
            raise ValueError(f"transfers (in flight) must lie in [2, 32], got {self.transfers}")


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str  # "H1-broken", "P1", ...
    hazard: str  # "H1".."H7", "P1", "P2"
    form: str  # "broken", "fixed" or "production"
    directions: tuple[str, ...]
    title: str
    builder: Callable[[str, Params], Program]

    def program(self, direction: str, params: Params) -> Program:
        if direction not in self.directions:
            raise ValueError(f"scenario {self.name} runs {'/'.join(self.directions)}, not {direction}")
        program = self.builder(direction, params)
        validate(program)
        return program


class _Builder:
    """Allocates fresh slots, names streams and collects steps."""

    def __init__(self) -> None:
        self.counts = {GPU: 0, HOST: 0}
        self.streams: list[str] = [COMPUTE]
        self.steps: list[Step] = []

    def blocks(self, pool: str, n: int) -> Blocks:
        start = self.counts[pool]
        self.counts[pool] += n
        return Blocks(pool, tuple(range(start, start + n)))

    def stream(self, name: str) -> str:
        if name not in self.streams:
            self.streams.append(name)
        return name

    def add(self, *steps: Step) -> None:
        self.steps.extend(steps)

    def transfer(self, t: int, swaps: Sequence[Sequence[BlockCopy]], before: Sequence[Step] = (), prefix: str = "xfer",
                 chain: bool = True) -> str:
        """Issue transfer ``t`` on stream ``<prefix><t>``: wait on the previous transfer's end
        event (``chain``), the steps in ``before``, the swaps, and record ``<prefix>-end<t>``."""
        stream = self.stream(f"{prefix}{t}")
        if chain and t > 0:
            self.add(WaitEvent(stream, f"{prefix}-end{t - 1}"))
        self.add(*before)
        for copies in swaps:
            self.add(Swap(stream, tuple(copies)))
        end = f"{prefix}-end{t}"
        self.add(Record(end, stream))
        return end

    def program(self) -> Program:
        return Program(tuple(self.streams), self.counts[GPU], self.counts[HOST], tuple(self.steps))


def _copy(direction: str, gpu: Blocks, host: Blocks) -> BlockCopy:
    return BlockCopy(gpu, host) if direction == STORE else BlockCopy(host, gpu)


# -- H1 and P1: the store's source read against the compute writer ---------------------------


def _written_by_compute(b: _Builder, gpu: Blocks, t: int) -> list[Step]:
    """Compute writes generation 2 of ``gpu`` (what a store exists to move); return the
    barrier an engine puts before the store: transfer ``t``'s stream waits on compute."""
    b.add(Write(COMPUTE, gpu, 2))
    return [WaitStream(f"xfer{t}", COMPUTE)]


def _store_after_write(barrier: bool, busy: bool = False) -> Callable[[str, Params], Program]:
    """Compute writes generation 2 of a block set, then it is stored, behind the barrier or
    not; ``busy``: compute also goes on writing other blocks while the stores are in flight."""

    def build(direction: str, p: Params) -> Program:
        b, ends, checks = _Builder(), [], []
        for t in range(p.transfers):
            g, h = b.blocks(GPU, p.blocks_per_transfer), b.blocks(HOST, p.blocks_per_transfer)
            before = _written_by_compute(b, g, t)
            ends.append(b.transfer(t, [[_copy(direction, g, h)]], before if barrier else []))
            checks.append(Expect(h, 2))
            if busy:
                other = b.blocks(GPU, p.blocks_per_transfer)
                b.add(Write(COMPUTE, other, 3))
                checks.append(Expect(other, 3))
        b.add(Poll(tuple(ends)), *checks)
        return b.program()

    return build


# -- H2: a load overwrites a GPU block compute still writes and reads ------------------------


def _load_into_busy_block(wait: bool) -> Callable[[str, Params], Program]:
    def build(direction: str, p: Params) -> Program:
        b, ends, loaded = _Builder(), [], []
        for t in range(p.transfers):
            g, h = b.blocks(GPU, p.blocks_per_transfer), b.blocks(HOST, p.blocks_per_transfer)
            # The block's previous user still zero-fills (WAW) and then reads (WAR) it.
            b.add(Write(COMPUTE, g, 2), Read(COMPUTE, g, 2))
            before = [WaitStream(f"xfer{t}", COMPUTE)] if wait else []
            ends.append(b.transfer(t, [[_copy(direction, g, h)]], before))
            loaded.append(g)
        b.add(Poll(tuple(ends)), *(Expect(g, 1) for g in loaded))
        return b.program()

    return build


# -- H3: a pinned staging block rewritten while its load is pending ------------------------


def _staging_reuse(wait: bool) -> Callable[[str, Params], Program]:
    def build(direction: str, p: Params) -> Program:
        b, ends, loaded = _Builder(), [], []
        staging = b.blocks(HOST, p.blocks_per_transfer)
        for t in range(p.transfers):
            g = b.blocks(GPU, p.blocks_per_transfer)
            if wait and t > 0:
                b.add(SyncEvent(ends[-1]))  # the fix: the previous load has read the staging block
            b.add(HostFill(staging, t + 2))
            ends.append(b.transfer(t, [[_copy(direction, g, staging)]]))
            loaded.append((g, t + 2))
        b.add(Poll(tuple(ends)), *(Expect(g, gen) for g, gen in loaded))
        return b.program()

    return build


# -- H4: the host reads a store's destination before observing completion -------------------


def _host_reads_store(wait: bool) -> Callable[[str, Params], Program]:
    def build(direction: str, p: Params) -> Program:
        b, ends = _Builder(), []
        for t in range(p.transfers):
            g, h = b.blocks(GPU, p.blocks_per_transfer), b.blocks(HOST, p.blocks_per_transfer)
            ends.append(b.transfer(t, [[_copy(direction, g, h)]], _written_by_compute(b, g, t)))
            if wait:
                b.add(SyncEvent(ends[-1]))
            b.add(HostConsume(h, 2))
        b.add(Poll(tuple(ends)))
        return b.program()

    return build


# -- H5: a host block reloaded while its store is in flight --------------------------------


def _store_then_reload(wait: bool) -> Callable[[str, Params], Program]:
    def build(direction: str, p: Params) -> Program:
        b, ends, checks = _Builder(), [], []
        for t in range(p.transfers):
            g, h, r = (b.blocks(GPU, p.blocks_per_transfer), b.blocks(HOST, p.blocks_per_transfer),
                       b.blocks(GPU, p.blocks_per_transfer))
            stored = b.transfer(t, [[BlockCopy(g, h)]])
            reload = [WaitEvent(f"reload{t}", stored)]  # ordered by a device event only
            if wait:
                reload.insert(0, SyncEvent(stored))  # the fix: the host saw the store complete
            ends += [stored, b.transfer(t, [[BlockCopy(h, r)]], reload, prefix="reload", chain=False)]
            checks += [Expect(h, 1), Expect(r, 1)]
        b.add(Poll(tuple(ends)), *checks)
        return b.program()

    return build


# -- H6: compute reads a loaded block without waiting for the load ---------------------------


def _read_after_load(wait: bool) -> Callable[[str, Params], Program]:
    def build(direction: str, p: Params) -> Program:
        b, ends = _Builder(), []
        for t in range(p.transfers):
            g, h = b.blocks(GPU, p.blocks_per_transfer), b.blocks(HOST, p.blocks_per_transfer)
            ends.append(b.transfer(t, [[_copy(direction, g, h)]]))
            if wait:
                b.add(WaitEvent(COMPUTE, ends[-1]))
            b.add(Read(COMPUTE, g, 1))
        b.add(Poll(tuple(ends)))
        return b.program()

    return build


# -- H7: two copies of one batch write the same block ---------------------------------------


def _overlapping_batch(split: bool) -> Callable[[str, Params], Program]:
    def build(direction: str, p: Params) -> Program:
        b, ends, dsts = _Builder(), [], []
        src_pool, dst_pool = (GPU, HOST) if direction == STORE else (HOST, GPU)
        for t in range(p.transfers):
            first, second = b.blocks(src_pool, p.blocks_per_transfer), b.blocks(src_pool, p.blocks_per_transfer)
            dst = b.blocks(dst_pool, p.blocks_per_transfer)
            # A store moves what compute wrote (behind the engine's barrier); a load's host
            # sources are quiescent.
            before, gen = [], 1
            if direction == STORE:
                _written_by_compute(b, first, t)
                before, gen = _written_by_compute(b, second, t), 2
            copies = [BlockCopy(first, dst), BlockCopy(second, dst)]  # the second is meant to win
            ends.append(b.transfer(t, [[c] for c in copies] if split else [copies], before))
            dsts.append((dst, gen))
        b.add(Poll(tuple(ends)), *(Expect(d, gen) for d, gen in dsts))
        return b.program()

    return build


# -- P2: a load from a quiescent host block ---------------------------------------------------


def _quiescent_load(direction: str, p: Params) -> Program:
    b, ends, checks = _Builder(), [], []
    for t in range(p.transfers):
        g, h, busy = (b.blocks(GPU, p.blocks_per_transfer), b.blocks(HOST, p.blocks_per_transfer),
                      b.blocks(GPU, p.blocks_per_transfer))
        b.add(Write(COMPUTE, busy, 2))  # compute keeps writing other blocks meanwhile
        ends.append(b.transfer(t, [[_copy(direction, g, h)]]))
        b.add(WaitEvent(COMPUTE, ends[-1]), Read(COMPUTE, g, 1))
        checks += [Expect(g, 1), Expect(busy, 2)]
    b.add(Poll(tuple(ends)), *checks)
    return b.program()


def _pair(hazard: str, directions: tuple[str, ...], broken: str, fixed: str, factory) -> list[Scenario]:
    return [
        Scenario(f"{hazard}-broken", hazard, "broken", directions, broken, factory(False)),
        Scenario(f"{hazard}-fixed", hazard, "fixed", directions, fixed, factory(True)),
    ]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("H1-broken", "H1", "broken", (STORE,), "store with no cross-stream order to the writer",
                 _store_after_write(barrier=False)),
        Scenario("H1-fixed", "H1", "fixed", (STORE,), "store behind wait_stream(compute)",
                 _store_after_write(barrier=True)),
        *_pair("H2", (LOAD,), "load into a block compute still writes and reads",
               "load after wait_stream(compute)", _load_into_busy_block),
        *_pair("H3", (LOAD,), "staging block rewritten while its load is pending",
               "staging block rewritten after the previous load's end event", _staging_reuse),
        *_pair("H4", (STORE,), "host reads the store's destination before completion",
               "host reads the destination after synchronizing the end event", _host_reads_store),
        *_pair("H5", (LOAD,), "reload ordered after its store by a device event only",
               "reload after the host saw the store complete", _store_then_reload),
        *_pair("H6", (LOAD,), "compute reads a loaded block without waiting for the load",
               "compute waits for the load's end event", _read_after_load),
        *_pair("H7", (STORE, LOAD), "two copies of one batch write the same block",
               "the two copies in consecutive batches", _overlapping_batch),
        Scenario("P1", "P1", "production", (STORE,),
                 "store behind wait_stream(compute) while compute writes the next blocks",
                 _store_after_write(barrier=True, busy=True)),
        Scenario("P2", "P2", "production", (LOAD,), "load from a quiescent host block", _quiescent_load),
    ]
}


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None


def select(spec: str | Sequence[str] | None) -> list[Scenario]:
    """Scenarios by name or hazard (``H3`` means both forms); ``None``/``all`` means every one."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec or ["all"]) if s.strip()]
    if "all" in names:
        return list(SCENARIOS.values())
    chosen: list[Scenario] = []
    for n in names:
        matches = [s for s in SCENARIOS.values() if n in (s.name, s.hazard)]
        if not matches:
            raise ValueError(f"unknown scenario {n!r}; known: {', '.join(SCENARIOS)} (or a hazard id such as H3)")
        chosen += [m for m in matches if m not in chosen]
    return chosen
