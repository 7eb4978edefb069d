"""The step language of a scenario: one program, read by the trace builder and the executors.

A program touches two pools of KV blocks: ``gpu`` (device memory) and ``host`` (host
memory of the cell's kind). A block is one slot of a pool; on the device it is spread over
the layout's ``num_tensors`` pages, as an engine's KV cache is. Steps mirror the trace ops
(``docs/trace-format.md``) but carry what the GPU must do:

- ``Write`` is the compute writer (block pattern of a generation, after an optional spin);
- ``Read`` is a compute reader: it checks the blocks at the start and at the end of a long
  scan, so a copy that lands before it (RAW) or inside its window (WAR) is seen;
- ``Swap`` is one batched copy (``cuMemcpyBatchAsync``) in the cell's source access order;
- ``Record``, ``WaitEvent``, ``WaitStream``, ``SyncEvent``, ``SyncStream`` are the trace format's
  own ops (``kvverify.check.model``): they mean the same on paper and on the device;
- ``HostFill`` / ``HostConsume`` are the host thread touching host blocks at that point;
- ``Poll`` is the engine finding completion by querying end events until they are done;
- ``Expect`` is the harness's final check, after the executor drained the device.

Generations in a program are relative (1 = the setup content); executors add a per-trial
base so that a leftover from an earlier trial never looks right.

Contents are tracked by a reference model (``reference_contents``): the program run
sequentially, each copy in issue order, which is what the author of the schedule meant.
Every check compares against it, and the generation a scenario writes in ``Expect`` /
``HostConsume`` / ``Read`` must agree with it (``validate``), which catches scenario typos.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from kvverify.check.model import Record, SyncEvent, SyncStream, WaitEvent, WaitStream
from kvverify.errors import ProgramError

GPU, HOST = "gpu", "host"
POOLS = (GPU, HOST)
SETUP_GENERATION = 1


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Slots of one pool, in order."""

    pool: str
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if not self.slots or min(self.slots) < 0:
            raise ValueError(f"Blocks need at least one non-negative slot, got {self.slots}")

    def __len__(self) -> int:
        return len(self.slots)


@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """``src.slots[i]`` is copied to ``dst.slots[i]`` (every page of the block)."""

    src: Blocks
    dst: Blocks

    def __post_init__(self) -> None:
        if len(self.src) != len(self.dst):
            raise ValueError(f"a BlockCopy pairs blocks one to one: {len(self.src)} sources, {len(self.dst)} destinations")
        if self.src.pool == self.dst.pool:
            raise ValueError("a BlockCopy moves blocks between the GPU and the host pool")

    def pairs(self) -> Iterator[tuple[tuple[str, int], tuple[str, int]]]:
        for s, d in zip(self.src.slots, self.dst.slots):
            yield (self.src.pool, s), (self.dst.pool, d)


# -- steps -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Write:
    stream: str
    blocks: Blocks
    generation: int
    spin: bool = True  # spin for the run's writer delay first: widens the window of a reader racing it


@dataclasses.dataclass(frozen=True)
class Read:
    stream: str
    blocks: Blocks
    generation: int  # what the reader must see, at the start and at the end of its window


@dataclasses.dataclass(frozen=True)
class Swap:
    stream: str
    copies: tuple[BlockCopy, ...]  # one batch; copies inside it are unordered (rule 7)
    name: str = "swap"


@dataclasses.dataclass(frozen=True)
class Poll:
    events: tuple[str, ...]  # queried until all are complete, as an engine's completion check


@dataclasses.dataclass(frozen=True)
class HostFill:
    blocks: Blocks
    generation: int


@dataclasses.dataclass(frozen=True)
class HostConsume:
    blocks: Blocks
    generation: int


@dataclasses.dataclass(frozen=True)
class Expect:
    blocks: Blocks
    generation: int


Step = Write | Read | Swap | Record | WaitEvent | WaitStream | SyncEvent | SyncStream | Poll | HostFill | HostConsume | Expect


@dataclasses.dataclass(frozen=True)
class Program:
    """Setup (every used block written with generation 1, then a device sync) + steps + checks."""

    streams: tuple[str, ...]
    gpu_slots: int
    host_slots: int
    steps: tuple[Step, ...]

    def swaps(self) -> list[Swap]:
        return [s for s in self.steps if isinstance(s, Swap)]

    def max_generation(self) -> int:
        return max([SETUP_GENERATION] + [s.generation for s in self.steps if hasattr(s, "generation")])


def content_id(pool: str, slot: int, gpu_slots: int) -> int:
    """Logical id of the content a writer puts into a slot (GPU slots first, then host slots).

    Copies carry ids along, so a block that lands at the wrong address fails the pattern
    hash (GARBAGE), while an old generation of the right block reads as STALE.
    """
    return slot if pool == GPU else gpu_slots + slot


def reference_contents(program: Program) -> list[dict[tuple[str, int], tuple[int, int]]]:
    """Intended (content id, generation) of every slot before each step (index = step index).

    The last entry (index ``len(steps)``) is the state after the program.
    """
    state: dict[tuple[str, int], tuple[int, int]] = {}
    for pool, n in ((GPU, program.gpu_slots), (HOST, program.host_slots)):
        for s in range(n):
            state[(pool, s)] = (content_id(pool, s, program.gpu_slots), SETUP_GENERATION)
    states = [dict(state)]
    for step in program.steps:
        if isinstance(step, (Write, HostFill)):
            for s in step.blocks.slots:
                state[(step.blocks.pool, s)] = (content_id(step.blocks.pool, s, program.gpu_slots), step.generation)
        elif isinstance(step, Swap):
            # What the author means by one batch: every source as it was before the batch,
            # destinations in issue order (a later copy to the same block wins).
            before = states[-1]
            for copy in step.copies:
                for src, dst in copy.pairs():
                    state[dst] = before[src]
        states.append(dict(state))
    return states


def validate(program: Program) -> None:
    """Raise ProgramError when a step names an unknown stream, a block outside its pool,
    a block of the wrong pool, or a check whose generation the reference model contradicts."""
    limits = {GPU: program.gpu_slots, HOST: program.host_slots}
    states = reference_contents(program)
    for i, step in enumerate(program.steps):
        where = f"step {i} ({type(step).__name__})"
        for attr in ("stream", "on"):
            name = getattr(step, attr, None)
            if name is not None and name not in program.streams:
                raise ProgramError(f"{where}: unknown stream {name!r}; declared: {program.streams}")
        blocks = [step.blocks] if hasattr(step, "blocks") else []
        if isinstance(step, Swap):
            blocks = [b for c in step.copies for b in (c.src, c.dst)]
        for b in blocks:
            if max(b.slots) >= limits[b.pool]:
                raise ProgramError(f"{where}: {b.pool} slot {max(b.slots)} outside the pool of {limits[b.pool]}")
        if isinstance(step, (Write, Read)) and step.blocks.pool != GPU:
            raise ProgramError(f"{where}: compute kernels touch GPU blocks only")
        if isinstance(step, (HostFill, HostConsume)) and step.blocks.pool != HOST:
            raise ProgramError(f"{where}: the host touches host blocks only")
        if isinstance(step, (Read, HostConsume, Expect)):
            found = {states[i][(step.blocks.pool, s)][1] for s in step.blocks.slots}
            if found != {step.generation}:
                raise ProgramError(
                    f"{where}: expects generation {step.generation} but the program leaves {sorted(found)} there"
                )
