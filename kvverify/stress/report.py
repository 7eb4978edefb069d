"""Stress-run results: cells, cell verdicts, summary, headline and the JSON document.

A *cell* is (scenario, direction, source access order, host memory kind, executor). Its
*contract verdict* (``SAFE`` / ``RACY``, from the happens-before checker) is joined with
what the executor *observed* into one ``CellVerdict`` by ``cell_verdict``, the only
place that rule lives (``docs/report-schema.md``, "Cell verdicts", tabulates it).

The terminal table and JUnit XML are in ``kvverify.stress.render``, which reads this module
(never the reverse); the JSON document follows ``kvverify/schemas/stress-report-v2.json``
(described in ``docs/report-schema.md``).

A run on several GPUs (``torchrun``, ``--gpus``) makes one report: a row per GPU (``Gpu``:
platform, memory trend), each cell's observation per GPU, and the cell's verdict over them
(``joined_verdict``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any, NamedTuple

from kvverify import __version__
from kvverify.stats import clopper_pearson_upper
from kvverify.stress.memory import QuantityTrend, Trend
from kvverify.terms import (
    ADVERSARIAL,
    BLOCK_STATES,
    CONTRACTS,
    COPY_KIND,
    DIRECTIONS,
    EXECUTORS,
    HOST_MEMORY_KINDS,
    ORDERS,
    RACY,
    SAFE,
    CellVerdict,
)

__all__ = [
    "CONFIDENCE",
    "EXIT_CANNOT_START",
    "EXIT_FAILED",
    "EXIT_MEMORY_GREW",
    "EXIT_OK",
    "HOST_MEMORY_KINDS",
    "SCHEMA_VERSION",
    "Cell",
    "CellResult",
    "Execution",
    "Gpu",
    "Headline",
    "Observation",
    "Platform",
    "StressReport",
    "cell_verdict",
    "joined_verdict",
    "load_schema",
    "worst_exit_status",
]

SCHEMA_VERSION = 2
CONFIDENCE = 0.95  # of the upper bound on the corruption rate, as the issue asks

# Exit statuses of `kvverify stress`, which the report's `exit_status` repeats.
EXIT_OK = 0
EXIT_FAILED = 1  # a failing cell verdict, a cell not run by error, or cells the --max-seconds cap left unrun
EXIT_CANNOT_START = 2  # bad options, campaign, model config, memory that does not fit (no report); a report file not written
EXIT_MEMORY_GREW = 3  # nothing failed, but host or device memory grew over the run (a leak)
_EXIT_PRECEDENCE = (EXIT_OK, EXIT_MEMORY_GREW, EXIT_FAILED, EXIT_CANNOT_START)


def worst_exit_status(statuses: Iterable[int]) -> int:
    """The status that says most of several runs' (e.g. one per model): cannot start over a
    failure over a memory growth over success. Raises ValueError for an unknown status."""
    return max(statuses, key=_EXIT_PRECEDENCE.index, default=EXIT_OK)


def _one_of(field: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}; got {value!r}")


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    """One combination the stress run checks.

    ``direction`` is ``"store"`` (D2H) or ``"load"`` (H2D); ``order`` one of ``ORDERS``;
    ``host_memory`` one of ``HOST_MEMORY_KINDS``; ``executor`` one of ``EXECUTORS``.
    Raises ValueError for any other value or an empty scenario name.
    """

    scenario: str
    direction: str
    order: str
    host_memory: str
    executor: str

    def __post_init__(self) -> None:
        if not self.scenario:
            raise ValueError("scenario must be named")
        _one_of("direction", self.direction, DIRECTIONS)
        _one_of("order", self.order, ORDERS)
        _one_of("host_memory", self.host_memory, HOST_MEMORY_KINDS)
        _one_of("executor", self.executor, EXECUTORS)

    @property
    def copy_kind(self) -> str:
        """``"D2H"`` for a store, ``"H2D"`` for a load."""
        return COPY_KIND[self.direction]

    @property
    def label(self) -> str:
        """E.g. ``"H1 store/D2H/ANY/pinned/adversarial"``: unique within a run."""
        return (
            f"{self.scenario} {self.direction}/{self.copy_kind}/{self.order}/"
            f"{self.host_memory}/{self.executor}"
        )


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one executor saw in one cell.

    - ``trials``: repetitions run (at least 1); ``corrupted_trials``: those with any block
      not OK;
    - ``blocks_checked``, ``bytes_checked``: blocks verified over all trials and their bytes;
    - ``ok``, ``stale``, ``torn``, ``garbage``: blocks per ``kvverify.device.pattern.BlockState``,
      summing to ``blocks_checked``;
    - ``elapsed_s``: wall-clock seconds of the cell;
    - ``window``: how the race window was widened, name → value (e.g.
      ``{"writer_spin_ns": 200000, "reader_ns": 100000}``); shown as given.

    Raises ValueError when a count is negative, ``trials < 1``, the state counts do not sum
    to ``blocks_checked``, or ``corrupted_trials`` disagrees with them (corrupted trials
    exactly when some block was not OK).
    """

    trials: int
    corrupted_trials: int
    blocks_checked: int
    bytes_checked: int
    ok: int
    stale: int
    torn: int
    garbage: int
    elapsed_s: float
    window: Mapping[str, int | float | str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        counts = ("trials", "corrupted_trials", "blocks_checked", "bytes_checked") + tuple(
            s.lower() for s in BLOCK_STATES
        )
        for field in counts:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
        if self.trials < 1:
            raise ValueError(
                "an observation needs at least one trial (use None for a cell not run)"
            )
        if self.corrupted_trials > self.trials:
            raise ValueError(f"corrupted_trials {self.corrupted_trials} > trials {self.trials}")
        if sum(self.counts.values()) != self.blocks_checked:
            raise ValueError(
                f"block states {self.counts} do not sum to blocks_checked {self.blocks_checked}"
            )
        bad_blocks = self.stale + self.torn + self.garbage
        if (self.corrupted_trials > 0) != (bad_blocks > 0):
            raise ValueError(
                f"corrupted_trials={self.corrupted_trials} but {bad_blocks} blocks were not OK"
            )
        if not (
            isinstance(self.elapsed_s, (int, float))
            and math.isfinite(self.elapsed_s)
            and self.elapsed_s >= 0
        ):
            raise ValueError(
                f"elapsed_s must be a finite non-negative number, got {self.elapsed_s!r}"
            )

    @property
    def corrupted(self) -> bool:
        """True when any trial saw a block that was not OK."""
        return self.corrupted_trials > 0

    @property
    def counts(self) -> dict[str, int]:
        """Blocks per state name, in ``BLOCK_STATES`` order."""
        return {s: getattr(self, s.lower()) for s in BLOCK_STATES}

    @property
    def gb_per_s(self) -> float | None:
        """Bytes checked per second, in GB/s (10^9 bytes); None when no time elapsed."""
        return self.bytes_checked / self.elapsed_s / 1e9 if self.elapsed_s > 0 else None

    @classmethod
    def combined(cls, observations: Iterable[Observation | None]) -> Observation | None:
        """One cell's observations on several GPUs as one: trials and counts summed, the longest
        ``elapsed_s`` (the GPUs run at once), the first one's ``window``. None when none ran."""
        seen = [o for o in observations if o is not None]
        if not seen:
            return None
        if len(seen) == 1:
            return seen[0]
        total = {f: sum(getattr(o, f) for o in seen) for f in
                 ("trials", "corrupted_trials", "blocks_checked", "bytes_checked", "ok", "stale", "torn", "garbage")}
        return cls(**total, elapsed_s=max(o.elapsed_s for o in seen), window=dict(seen[0].window))


def cell_verdict(contract: str, observation: Observation | None, executor: str) -> CellVerdict:
    """Join a contract verdict with an observation, as ``docs/report-schema.md`` tabulates it.

    ``contract``: ``"SAFE"`` or ``"RACY"``; ``observation``: None when the cell did not
    run; ``executor``: one of ``EXECUTORS`` (only a RACY cell without corruption depends on
    it: the adversarial executor must make every permitted reordering visible, the native
    and kernel copy paths run as a user runs them and need not). Raises ValueError for
    other values.
    """
    _one_of("contract", contract, CONTRACTS)
    _one_of("executor", executor, EXECUTORS)
    if observation is None:
        return CellVerdict.NOT_RUN
    if contract == SAFE:
        if observation.corrupted:
            return CellVerdict.UNEXPECTED_CORRUPTION
        return CellVerdict.SAFE_CONFIRMED
    if observation.corrupted:
        return CellVerdict.CONFIRMED_RACE
    if executor == ADVERSARIAL:
        return CellVerdict.SENSITIVITY_FAILURE
    return CellVerdict.NO_RACE_OBSERVED


_JOIN_ORDER = (
    CellVerdict.UNEXPECTED_CORRUPTION,
    CellVerdict.SENSITIVITY_FAILURE,
    CellVerdict.CONFIRMED_RACE,
    CellVerdict.NO_RACE_OBSERVED,
    CellVerdict.SAFE_CONFIRMED,
    CellVerdict.NOT_RUN,
)


def joined_verdict(verdicts: Iterable[CellVerdict]) -> CellVerdict:
    """One cell's verdict over several GPUs (or runs), from each one's ``cell_verdict``: a failing
    verdict on any of them; else ``CONFIRMED_RACE`` when any saw the race; else the verdict of
    those that ran it; ``NOT_RUN`` when none did (or none is given).

    It equals ``cell_verdict`` of the summed observations except where the adversarial executor
    missed a race on one GPU that another caught: that is still a ``SENSITIVITY_FAILURE``, since
    the harness must make a permitted reordering visible on every GPU.
    """
    given = set(verdicts)
    return next((v for v in _JOIN_ORDER if v in given), CellVerdict.NOT_RUN)


@dataclasses.dataclass(frozen=True)
class CellResult:
    """A cell with its contract verdict, the checker's witness and what was observed.

    ``witness``: the first race's summary (ops, kind, reason) for a RACY contract, None
    for a SAFE one. ``observation``: None when the cell did not run. ``per_gpu``: ``(rank,
    observation or None)`` for each GPU the cell was given to (empty for a report not made by
    a run); ``observation`` is then their ``Observation.combined``. ``error``: why the cell
    could not be run (on some GPU), or None. The verdict and the rate bound are derived,
    never stored, so they cannot disagree with the evidence.

    Raises ValueError for an unknown contract, a RACY contract without a witness or a
    SAFE one with a witness, a GPU listed twice, or an ``observation`` that is not the
    combination of ``per_gpu``.
    """

    cell: Cell
    contract: str
    witness: str | None = None
    observation: Observation | None = None
    per_gpu: tuple[tuple[int, Observation | None], ...] = ()
    error: str | None = None

    def __post_init__(self) -> None:
        _one_of("contract", self.contract, CONTRACTS)
        if (self.contract == RACY) != bool(self.witness):
            raise ValueError(
                f"{self.cell.label}: a RACY contract needs a witness, a SAFE one has none"
            )
        object.__setattr__(self, "per_gpu", tuple((int(g), o) for g, o in self.per_gpu))
        ranks = [g for g, _ in self.per_gpu]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{self.cell.label}: a GPU appears twice in per_gpu {ranks}")
        if self.per_gpu and self.observation != Observation.combined(o for _, o in self.per_gpu):
            raise ValueError(f"{self.cell.label}: observation is not the combination of per_gpu")

    @classmethod
    def on_gpus(cls, cell: Cell, contract: str, witness: str | None,
                per_gpu: Iterable[tuple[int, Observation | None]], error: str | None = None) -> CellResult:
        """A cell's result from each GPU's observation (None where it did not run there)."""
        per_gpu = tuple(per_gpu)
        return cls(cell, contract, witness, Observation.combined(o for _, o in per_gpu), per_gpu, error)

    @property
    def gpu_verdicts(self) -> tuple[tuple[int, CellVerdict], ...]:
        """``(rank, cell_verdict)`` per GPU of ``per_gpu``."""
        return tuple((g, cell_verdict(self.contract, o, self.cell.executor)) for g, o in self.per_gpu)

    @property
    def verdict(self) -> CellVerdict:
        """``cell_verdict`` of this cell; over several GPUs, ``joined_verdict`` of theirs."""
        if self.per_gpu:
            return joined_verdict(v for _, v in self.gpu_verdicts)
        return cell_verdict(self.contract, self.observation, self.cell.executor)

    @property
    def unrun_gpus(self) -> tuple[int, ...]:
        """GPUs the cell was given to that have no observation of it."""
        return tuple(g for g, o in self.per_gpu if o is None)

    @property
    def rate_upper_bound(self) -> float | None:
        """One-sided ``CONFIDENCE`` Clopper–Pearson bound on the per-trial corruption rate.

        Given when the cell ran and saw no corruption; None otherwise.
        """
        obs = self.observation
        if obs is None or obs.corrupted:
            return None
        return clopper_pearson_upper(0, obs.trials, CONFIDENCE)

    @property
    def safe(self) -> bool:
        """Safe on paper (contract SAFE) and not contradicted by an observation."""
        return self.contract == SAFE and self.verdict is not CellVerdict.UNEXPECTED_CORRUPTION


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where the run happened: versions as strings, None where there is no such thing.

    ``gpu``: device name (None without a CUDA device); ``driver``: driver version;
    ``cuda``: CUDA runtime version torch was built with; ``torch``: torch version;
    ``host_memory_kinds``: the kinds of host memory the run used or could use.
    """

    gpu: str | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    host_memory_kinds: tuple[str, ...] = HOST_MEMORY_KINDS
    kvverify: str = __version__

    def __post_init__(self) -> None:
        for kind in self.host_memory_kinds:
            _one_of("host_memory_kinds", kind, HOST_MEMORY_KINDS)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU of a run (one rank under torchrun).

    ``rank``: the torch.distributed rank (0 without torchrun); ``host``: the host's name;
    ``device``: CUDA device index (None without one); ``platform``: where it ran;
    ``not_run_reason``: why it ran no cell (e.g. no CUDA device), or None; ``memory``: its
    process's footprint over the run (``kvverify.stress.memory.Trend``), None when not sampled.
    """

    rank: int
    host: str
    device: int | None
    platform: Platform
    not_run_reason: str | None = None
    memory: Trend | None = None


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the run used its time.

    ``shard``: the cells were split across GPUs (else every GPU ran every cell); ``rounds_planned``,
    ``rounds_run``: rounds of trials over every cell (``planning.rounds``); ``trials_planned``,
    ``trials_run``: over every GPU; ``max_seconds``: the cap (None without one); ``stopped``: the
    cap ended the run before its plan (trials cut short; cells left unrun fail the run).
    """

    shard: bool = False
    rounds_planned: int = 0
    rounds_run: int = 0
    trials_planned: int = 0
    trials_run: int = 0
    max_seconds: float | None = None
    stopped: bool = False


class Headline(NamedTuple):
    """Whether ``ANY`` was safe exactly for the host-source loads with a quiescent source.

    ``holds`` is None when the run cannot tell (no ANY cell, or an ANY load cell without
    the STREAM and DURING_API_CALL counterparts that define quiescence). The tuples name
    the cells (labels) that break the claim or could not be decided.
    """

    holds: bool | None
    text: str
    safe_but_not_quiescent_load: tuple[str, ...] = ()
    quiescent_load_but_not_safe: tuple[str, ...] = ()
    undecided: tuple[str, ...] = ()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class StressReport:
    """The outcome of one ``kvverify stress`` run.

    ``layout``: ``KVLayout.describe()`` of the geometry used (None if none);
    ``not_run_reason``: why the observed columns are empty (e.g. no CUDA device), or None;
    ``platform``: where rank 0 ran; ``gpus``: one row per GPU of the run (empty for a report
    not made by a run); ``execution``: rounds, trials and the cap (None: not recorded).

    Raises ValueError when two results share a cell, when results that differ only in
    executor disagree on the contract (the trace does not depend on the executor), when two
    GPU rows share a rank, or when a cell names a GPU that has no row.
    """

    platform: Platform
    campaign: str
    seed: int
    cells: tuple[CellResult, ...]
    layout: Mapping[str, Any] | None = None
    not_run_reason: str | None = None
    created: str = dataclasses.field(default_factory=_now)
    gpus: tuple[Gpu, ...] = ()
    execution: Execution | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cells", tuple(self.cells))
        object.__setattr__(self, "gpus", tuple(self.gpus))
        ranks = [g.rank for g in self.gpus]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"GPU ranks {ranks} repeat")
        for r in self.cells:
            missing = {g for g, _ in r.per_gpu} - set(ranks)
            if missing:
                raise ValueError(f"{r.cell.label}: GPU(s) {sorted(missing)} have no row in gpus")
        seen: set[Cell] = set()
        contracts: dict[tuple[str, str, str, str], str] = {}
        for r in self.cells:
            if r.cell in seen:
                raise ValueError(f"cell {r.cell.label} appears twice")
            seen.add(r.cell)
            key = _contract_key(r.cell, r.cell.order)
            if contracts.setdefault(key, r.contract) != r.contract:
                raise ValueError(f"{r.cell.label}: executors disagree on the contract verdict")

    # -- verdicts ---------------------------------------------------------------------

    def exit_status(self) -> int:
        """What ``kvverify stress`` exits with, from the report alone.

        ``EXIT_FAILED`` (1) when a cell's verdict fails on any GPU (UNEXPECTED_CORRUPTION,
        SENSITIVITY_FAILURE), a cell could not be run (``error``), or a cell has no observation
        on a GPU that ran cells (the --max-seconds cap left it unrun); else ``EXIT_MEMORY_GREW``
        (3) when a GPU's process footprint grew (``memory_growing``); else ``EXIT_OK`` (0). A run
        where no GPU ran anything (contract verdicts only) exits 0.
        """
        if self.unrun_cells() or any(r.error for r in self.cells) or any(
            r.verdict.failing or any(v.failing for _, v in r.gpu_verdicts) for r in self.cells
        ):
            return EXIT_FAILED
        return EXIT_MEMORY_GREW if self.memory_growing() else EXIT_OK

    def unrun_cells(self) -> tuple[CellResult, ...]:
        """Cells without an observation (on some GPU they were given to) although a GPU ran:
        what a cap or an error left out. Empty when no GPU ran anything."""
        if self.gpus:
            ran = {g.rank for g in self.gpus if g.not_run_reason is None}
            if not ran:
                return ()
            return tuple(r for r in self.cells if r.error is None
                         and (set(r.unrun_gpus) & ran or (not r.per_gpu and r.observation is None)))
        if self.not_run_reason is not None:
            return ()
        return tuple(r for r in self.cells if r.error is None and r.observation is None)

    def memory_growing(self) -> bool | None:
        """True when any GPU's process footprint grew beyond its tolerance, False when every
        GPU that could tell stayed flat, None when none could tell."""
        known = [g.memory.growing for g in self.gpus if g.memory is not None and g.memory.growing is not None]
        if any(known):
            return True
        return False if known else None

    def ran(self) -> tuple[CellResult, ...]:
        """The cells that ran on a device (those with an observation), in report order."""
        return tuple(r for r in self.cells if r.observation is not None)

    def summary(self, *, ran_only: bool = False) -> dict[str, dict[str, dict[str, list[str]]]]:
        """Where each order was safe: order → direction → scenario → host memory kinds.

        A (scenario, direction, order, host memory) is safe when every executor's cell of
        it is ``CellResult.safe``. Every order present among the cells considered appears,
        with both directions (an empty mapping where it was safe nowhere). ``ran_only``:
        consider only the cells that ran (``ran()``), so that a run cut short, or one without
        a device, claims nothing from contract verdicts alone; the JSON document keeps every
        cell.
        """
        groups: dict[tuple[str, str, str, str], bool] = {}
        for r in self.ran() if ran_only else self.cells:
            key = (r.cell.order, r.cell.direction, r.cell.scenario, r.cell.host_memory)
            groups[key] = groups.get(key, True) and r.safe
        out: dict[str, dict[str, dict[str, list[str]]]] = {}
        for order in ORDERS:
            if not any(k[0] == order for k in groups):
                continue
            out[order] = {d: {} for d in DIRECTIONS}
            for (o, direction, scenario, host), safe in sorted(groups.items()):
                if o == order and safe:
                    out[order][direction].setdefault(scenario, []).append(host)
        return out

    def headline(self) -> Headline:
        """Whether ``ANY`` was safe exactly for the host-source loads with a quiescent source.

        Two sets of ANY cells are compared:

        - *safe*: ``CellResult.safe`` (contract SAFE, no corruption observed);
        - *quiescent host-source loads*: loads (H2D) whose host source stays untouched over
          ANY's whole read window, from the call to the copy's stream-order completion.
          That window's two ends are what ``DURING_API_CALL`` (read at the call) and
          ``STREAM`` (read in stream order) allow, so a load's source counts as quiescent
          when the contracts of its ``DURING_API_CALL`` and ``STREAM`` counterparts (same
          scenario, direction and host memory) are both SAFE.

        The claim holds when the two sets are equal. Taken from the contract verdicts and
        the observations, never from scenario names. Only the ANY cells that ran are
        compared (a run cut short speaks of what it ran). When no cell ran at all (no
        device), nothing was observed, so ``holds`` is None and the text says what the
        contracts predict, counting the ANY cells of the matrix (one per scenario form and host
        memory kind) and then each executor's cell.
        """
        ran = self.ran()
        every_any = [r for r in self.cells if r.cell.order == "ANY"]
        any_cells = [r for r in (ran or self.cells) if r.cell.order == "ANY"]
        if not any_cells:
            where = "ran" if ran else "in this run"
            return Headline(None, f"ANY: no ANY cell {where}, nothing to compare")
        contracts = {_contract_key(r.cell, r.cell.order): r.contract for r in self.cells}
        safe_extra, unsafe_quiescent, undecided = [], [], []
        for r in any_cells:
            quiescent = False
            if r.cell.direction == "load":
                ends = [
                    contracts.get(_contract_key(r.cell, o)) for o in ("STREAM", "DURING_API_CALL")
                ]
                if None in ends:
                    undecided.append(r.cell.label)
                    continue
                quiescent = ends == [SAFE, SAFE]
            if r.safe and not quiescent:
                safe_extra.append(r.cell.label)
            elif quiescent and not r.safe:
                unsafe_quiescent.append(r.cell.label)
        n_safe = sum(r.safe for r in any_cells)
        subject = "ANY was safe exactly for the host-source loads whose source stayed untouched"
        if undecided:
            text = (
                f"cannot tell whether {subject}: {len(undecided)} ANY load cell(s) lack "
                "STREAM and DURING_API_CALL counterparts"
            )
            return Headline(
                None, text, tuple(safe_extra), tuple(unsafe_quiescent), tuple(undecided)
            )
        if not ran:
            return self._predicted(any_cells, n_safe, safe_extra, unsafe_quiescent)
        not_run = len(every_any) - len(any_cells)
        if not_run:
            tally = f"{n_safe} of the {len(any_cells)} ANY cells that ran safe; {not_run} not run"
        else:
            tally = f"{n_safe} of {len(any_cells)} ANY cells safe"
        if not safe_extra and not unsafe_quiescent:
            return Headline(True, f"YES: {subject} ({tally})")
        parts = []
        if safe_extra:
            parts.append(f"safe but not such a load: {', '.join(safe_extra)}")
        if unsafe_quiescent:
            parts.append(f"such a load but not safe: {', '.join(unsafe_quiescent)}")
        text = f"NO: it is not true that {subject} ({tally}); " + "; ".join(parts)
        return Headline(False, text, tuple(safe_extra), tuple(unsafe_quiescent))

    @staticmethod
    def _predicted(any_cells: list[CellResult], n_safe: int, safe_extra: list[str],
                   unsafe_quiescent: list[str]) -> Headline:
        """The headline of a report where nothing ran: what the contracts predict, never a result."""
        # the matrix shows one cell per scenario form and host memory kind, with a mark per executor
        shown = {(r.cell.scenario, r.cell.direction, r.cell.host_memory) for r in any_cells}
        shown_safe = {(r.cell.scenario, r.cell.direction, r.cell.host_memory) for r in any_cells if r.safe}
        exact = not safe_extra and not unsafe_quiescent
        text = (f"on paper only: no cell ran. The contracts {'predict' if exact else 'do not predict'} that ANY "
                "is safe exactly for the host-source loads whose source stays untouched: "
                f"{len(shown_safe)} of the matrix's {len(shown)} ANY cells are SAFE on paper ({n_safe} of "
                f"{len(any_cells)} counting each executor's cell, as the JSON report does)")
        if safe_extra:
            text += f"; SAFE but not such a load: {', '.join(safe_extra)}"
        if unsafe_quiescent:
            text += f"; such a load but RACY: {', '.join(unsafe_quiescent)}"
        return Headline(None, text, tuple(safe_extra), tuple(unsafe_quiescent))

    # -- JSON -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict following ``stress-report-v2.json``."""
        headline = self.headline()
        return {
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "campaign": self.campaign,
            "seed": self.seed,
            "platform": dataclasses.asdict(self.platform)
            | {"host_memory_kinds": list(self.platform.host_memory_kinds)},
            "layout": dict(self.layout) if self.layout is not None else None,
            "confidence": CONFIDENCE,
            "not_run_reason": self.not_run_reason,
            "gpus": [_gpu_json(g) for g in self.gpus],
            "execution": dataclasses.asdict(self.execution) if self.execution is not None else None,
            "cells": [_cell_json(r) for r in self.cells],
            "summary": self.summary(),
            "headline": {"holds": headline.holds, "text": headline.text},
            "memory_growing": self.memory_growing(),
            "exit_status": self.exit_status(),
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write ``to_json()`` to ``path`` (UTF-8, indented). Raises OSError on failure."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StressReport:
        """Rebuild a report from a ``to_json()`` document (derived fields are recomputed). A version 1
        document (before several GPUs, rounds and memory trends) reads as a run with no per-GPU rows.

        Raises ValueError for another schema version, KeyError for a missing field.
        """
        version = doc.get("schema_version")
        if version == 1:
            return cls(
                platform=_platform_from_json(doc["platform"]), campaign=doc["campaign"], seed=doc["seed"],
                cells=tuple(CellResult(Cell(c["scenario"], c["direction"], c["order"], c["host_memory"], c["executor"]),
                                       c["contract"]["verdict"], c["contract"]["witness"],
                                       _observed_from_json(c["observed"])) for c in doc["cells"]),
                layout=doc.get("layout"), not_run_reason=doc.get("not_run_reason"), created=doc["created"],
            )
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {version!r} is neither 1 nor {SCHEMA_VERSION}")
        execution = doc["execution"]
        return cls(
            platform=_platform_from_json(doc["platform"]),
            campaign=doc["campaign"],
            seed=doc["seed"],
            cells=tuple(_cell_from_json(c) for c in doc["cells"]),
            layout=doc.get("layout"),
            not_run_reason=doc.get("not_run_reason"),
            created=doc["created"],
            gpus=tuple(_gpu_from_json(g) for g in doc["gpus"]),
            execution=Execution(**execution) if execution is not None else None,
        )


def _contract_key(cell: Cell, order: str) -> tuple[str, str, str, str]:
    return (cell.scenario, cell.direction, order, cell.host_memory)


def _platform_from_json(d: Mapping[str, Any]) -> Platform:
    return Platform(**(dict(d) | {"host_memory_kinds": tuple(d["host_memory_kinds"])}))


def _observed_json(obs: Observation | None) -> dict[str, Any] | None:
    if obs is None:
        return None
    return {
        "trials": obs.trials,
        "corrupted_trials": obs.corrupted_trials,
        "blocks_checked": obs.blocks_checked,
        "bytes_checked": obs.bytes_checked,
        "counts": obs.counts,
        "window": dict(obs.window),
        "elapsed_s": obs.elapsed_s,
        "gb_per_s": obs.gb_per_s,
    }


def _observed_from_json(o: Mapping[str, Any] | None) -> Observation | None:
    if o is None:
        return None
    counts = o["counts"]
    return Observation(
        trials=o["trials"],
        corrupted_trials=o["corrupted_trials"],
        blocks_checked=o["blocks_checked"],
        bytes_checked=o["bytes_checked"],
        **{s.lower(): counts[s] for s in BLOCK_STATES},
        elapsed_s=o["elapsed_s"],
        window=dict(o["window"]),
    )


def _trend_json(t: Trend | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return dataclasses.asdict(t) | {"series": [list(p) for p in t.series]}


def _trend_from_json(d: Mapping[str, Any] | None) -> Trend | None:
    if d is None:
        return None

    def quantity(s: Mapping[str, Any] | None) -> QuantityTrend | None:
        return QuantityTrend(**s) if s is not None else None

    return Trend(**(dict(d) | {"host_rss": quantity(d["host_rss"]), "device_used": quantity(d["device_used"]),
                               "series": tuple(tuple(p) for p in d["series"])}))


def _gpu_json(g: Gpu) -> dict[str, Any]:
    return {
        "rank": g.rank,
        "host": g.host,
        "device": g.device,
        "platform": dataclasses.asdict(g.platform) | {"host_memory_kinds": list(g.platform.host_memory_kinds)},
        "not_run_reason": g.not_run_reason,
        "memory": _trend_json(g.memory),
    }


def _gpu_from_json(d: Mapping[str, Any]) -> Gpu:
    return Gpu(d["rank"], d["host"], d["device"], _platform_from_json(d["platform"]), d["not_run_reason"],
               _trend_from_json(d["memory"]))


def _cell_json(r: CellResult) -> dict[str, Any]:
    return {
        "label": r.cell.label,
        "scenario": r.cell.scenario,
        "direction": r.cell.direction,
        "copy_kind": r.cell.copy_kind,
        "order": r.cell.order,
        "host_memory": r.cell.host_memory,
        "executor": r.cell.executor,
        "contract": {"verdict": r.contract, "witness": r.witness},
        "observed": _observed_json(r.observation),
        "rate_upper_bound": r.rate_upper_bound,
        "verdict": r.verdict.value,
        "error": r.error,
        "per_gpu": [{"gpu": g, "observed": _observed_json(o), "verdict": v.value}
                    for (g, o), (_, v) in zip(r.per_gpu, r.gpu_verdicts)],
    }


def _cell_from_json(c: Mapping[str, Any]) -> CellResult:
    cell = Cell(c["scenario"], c["direction"], c["order"], c["host_memory"], c["executor"])
    per_gpu = tuple((p["gpu"], _observed_from_json(p["observed"])) for p in c["per_gpu"])
    return CellResult(cell, c["contract"]["verdict"], c["contract"]["witness"], _observed_from_json(c["observed"]),
                      per_gpu, c["error"])


def load_schema(version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the report document of ``version`` (1 or 2), from the
    package data. Raises FileNotFoundError for a version that has no schema."""
    text = resources.files("kvverify").joinpath(f"schemas/stress-report-v{version}.json").read_text("utf-8")
    return json.loads(text)
