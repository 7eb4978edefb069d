"""Stress-run results: cells, cell verdicts, summary, headline and the JSON document.

A *cell* is (scenario, direction, source access order, host memory kind, executor). Its
*contract verdict* (``SAFE`` / ``RACY``, from the happens-before checker) is joined with
what the executor *observed* into one ``CellVerdict`` by ``cell_verdict``, the only
place that rule lives (``shared/DESIGN.md``, "Three kinds of evidence").

The terminal table and JUnit XML are in ``kvverify.stress.render``, which reads this module
(never the reverse); the JSON document follows ``kvverify/schemas/stress-report-v1.json``
(described in ``docs/report-schema.md``).
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
    "Cell",
    "CellResult",
    "HOST_MEMORY_KINDS",
    "Headline",
    "Observation",
    "Platform",
    "SCHEMA_VERSION",
    "StressReport",
    "cell_verdict",
    "load_schema",
]

SCHEMA_VERSION = 1
CONFIDENCE = 0.95  # of the upper bound on the corruption rate, as the issue asks


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


def cell_verdict(contract: str, observation: Observation | None, executor: str) -> CellVerdict:
    """Join a contract verdict with an observation, exactly as ``shared/DESIGN.md`` says.

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


@dataclasses.dataclass(frozen=True)
class CellResult:
    """A cell with its contract verdict, the checker's witness and what was observed.

    ``witness``: the first race's summary (ops, kind, reason) for a RACY contract, None
    for a SAFE one. ``observation``: None when the cell did not run. The verdict and the
    rate bound are derived, never stored, so they cannot disagree with the evidence.

    Raises ValueError for an unknown contract, a RACY contract without a witness or a
    SAFE one with a witness.
    """

    cell: Cell
    contract: str
    witness: str | None = None
    observation: Observation | None = None

    def __post_init__(self) -> None:
        _one_of("contract", self.contract, CONTRACTS)
        if (self.contract == RACY) != bool(self.witness):
            raise ValueError(
                f"{self.cell.label}: a RACY contract needs a witness, a SAFE one has none"
            )

    @property
    def verdict(self) -> CellVerdict:
        """``cell_verdict`` of this cell."""
        return cell_verdict(self.contract, self.observation, self.cell.executor)

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
    ``not_run_reason``: why the observed columns are empty (e.g. no CUDA device), or None.

    Raises ValueError when two results share a cell, or when results that differ only
    in executor disagree on the contract (the trace does not depend on the executor).
    """

    platform: Platform
    campaign: str
    seed: int
    cells: tuple[CellResult, ...]
    layout: Mapping[str, Any] | None = None
    not_run_reason: str | None = None
    created: str = dataclasses.field(default_factory=_now)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cells", tuple(self.cells))
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
        """1 if any cell is UNEXPECTED_CORRUPTION or SENSITIVITY_FAILURE, else 0."""
        return int(any(r.verdict.failing for r in self.cells))

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
        compared (a run cut short speaks of what it ran); when no cell ran at all (no
        device), every ANY cell is, by its contract alone, and the text says "on paper only".
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
        not_run = len(every_any) - len(any_cells)
        if not ran:
            tally = f"{n_safe} of {len(any_cells)} ANY cells safe, on paper only: no cell ran"
        elif not_run:
            tally = f"{n_safe} of the {len(any_cells)} ANY cells that ran safe; {not_run} not run"
        else:
            tally = f"{n_safe} of {len(any_cells)} ANY cells safe"
        if undecided:
            text = (
                f"cannot tell whether {subject}: {len(undecided)} ANY load cell(s) lack "
                "STREAM and DURING_API_CALL counterparts"
            )
            return Headline(
                None, text, tuple(safe_extra), tuple(unsafe_quiescent), tuple(undecided)
            )
        if not safe_extra and not unsafe_quiescent:
            return Headline(True, f"YES: {subject} ({tally})")
        parts = []
        if safe_extra:
            parts.append(f"safe but not such a load: {', '.join(safe_extra)}")
        if unsafe_quiescent:
            parts.append(f"such a load but not safe: {', '.join(unsafe_quiescent)}")
        text = f"NO: it is not true that {subject} ({tally}); " + "; ".join(parts)
        return Headline(False, text, tuple(safe_extra), tuple(unsafe_quiescent))

    # -- JSON -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict following ``stress-report-v1.json``."""
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
            "cells": [_cell_json(r) for r in self.cells],
            "summary": self.summary(),
            "headline": {"holds": headline.holds, "text": headline.text},
            "exit_status": self.exit_status(),
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write ``to_json()`` to ``path`` (UTF-8, indented). Raises OSError on failure."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StressReport:
        """Rebuild a report from a ``to_json()`` document (derived fields are recomputed).

        Raises ValueError for a different schema version, KeyError for a missing field.
        """
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {doc.get('schema_version')!r} is not {SCHEMA_VERSION}"
            )
        platform = dict(doc["platform"])
        platform["host_memory_kinds"] = tuple(platform["host_memory_kinds"])
        return cls(
            platform=Platform(**platform),
            campaign=doc["campaign"],
            seed=doc["seed"],
            cells=tuple(_cell_from_json(c) for c in doc["cells"]),
            layout=doc.get("layout"),
            not_run_reason=doc.get("not_run_reason"),
            created=doc["created"],
        )


def _contract_key(cell: Cell, order: str) -> tuple[str, str, str, str]:
    return (cell.scenario, cell.direction, order, cell.host_memory)


def _cell_json(r: CellResult) -> dict[str, Any]:
    obs = r.observation
    observed = None
    if obs is not None:
        observed = {
            "trials": obs.trials,
            "corrupted_trials": obs.corrupted_trials,
            "blocks_checked": obs.blocks_checked,
            "bytes_checked": obs.bytes_checked,
            "counts": obs.counts,
            "window": dict(obs.window),
            "elapsed_s": obs.elapsed_s,
            "gb_per_s": obs.gb_per_s,
        }
    return {
        "label": r.cell.label,
        "scenario": r.cell.scenario,
        "direction": r.cell.direction,
        "copy_kind": r.cell.copy_kind,
        "order": r.cell.order,
        "host_memory": r.cell.host_memory,
        "executor": r.cell.executor,
        "contract": {"verdict": r.contract, "witness": r.witness},
        "observed": observed,
        "rate_upper_bound": r.rate_upper_bound,
        "verdict": r.verdict.value,
    }


def _cell_from_json(c: Mapping[str, Any]) -> CellResult:
    cell = Cell(c["scenario"], c["direction"], c["order"], c["host_memory"], c["executor"])
    o = c["observed"]
    observation = None
    if o is not None:
        counts = o["counts"]
        observation = Observation(
            trials=o["trials"],
            corrupted_trials=o["corrupted_trials"],
            blocks_checked=o["blocks_checked"],
            bytes_checked=o["bytes_checked"],
            **{s.lower(): counts[s] for s in BLOCK_STATES},
            elapsed_s=o["elapsed_s"],
            window=dict(o["window"]),
        )
    return CellResult(cell, c["contract"]["verdict"], c["contract"]["witness"], observation)


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the report document, from the package data."""
    text = resources.files("kvverify").joinpath("schemas/stress-report-v1.json").read_text("utf-8")
    return json.loads(text)
