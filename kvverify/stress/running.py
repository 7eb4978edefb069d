"""Planned cells -> GPU runs -> observations: ``execute`` runs the cells of a plan
(``kvverify.stress.planning``) on the device in rounds of trials over every cell
(``planning.rounds``), and within a round one host memory kind at a time, so that each kind's
pools are allocated once per round and freed before the next kind (also on Ctrl-C). A run cut
short by its deadline has seen every cell once its first round is done.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from kvverify import annotate
from kvverify.geometry import KVLayout
from kvverify.scenarios import Params
from kvverify.stress.campaign import Campaign
from kvverify.stress.planning import PlannedCell, pool_sizes, rounds
from kvverify.stress.report import Cell, Observation

# A cell label here makes trial 0 of that cell fail in its verify phase: how tests check that
# a failing cell fails the run, the run goes on, and NVTX ranges stay balanced.
FAIL_CELL_ENV = "KVVERIFY_STRESS_FAIL_CELL"


@dataclasses.dataclass
class CellOutcome:
    """A cell's evidence so far: ``observation`` over every trial it ran (None once a round of it
    failed: ``error`` says how), the wall time per phase summed over trials, the trials its plan
    asks for and the rounds it took part in."""

    observation: Observation | None
    error: str | None = None
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)  # summed over trials
    planned_trials: int = 0
    rounds: int = 0


SETTLE_S = 30.0  # how long cleanup waits for the device to go idle before it gives up


def execute(
    planned: list[PlannedCell],
    campaign: Campaign,
    layout: KVLayout,
    params: Params,
    on_cell_done: Callable[[PlannedCell, CellOutcome, int], None] = lambda pc, o, r: None,
    device=None,
    deadline: float | None = None,
    memory=None,
) -> dict[Cell, CellOutcome]:
    """Run every planned cell on ``device`` (default: the current CUDA device), in the rounds of
    ``planning.rounds``. ``on_cell_done(cell, outcome so far, round index)`` is called after each
    cell's share of a round. A cell whose run fails (a refused copy, a hang) gets an outcome with
    ``error`` and no observation, and no later rounds; the run goes on. ``deadline``
    (``time.monotonic()``): no cell's share of a round starts after it; cells not run have no
    outcome. ``memory`` (a ``kvverify.stress.memory.MemorySampler``): sampled after each cell's
    share of a round and after each host memory kind's pools are freed.

    Every exit (normal, error, KeyboardInterrupt) releases every stream hold first, then
    waits at most ``SETTLE_S`` for the device to go idle before freeing the pools (memory
    that cannot be freed safely is left to the process exit, with one line on stderr)."""
    import torch

    from kvverify.stress import executors
    from kvverify.stress.executors.pools import Pools

    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    settings = executors.Settings(
        seed=campaign.seed,
        writer_delay_ns=campaign.writer_delay_us * 1000,
        reader_ns=campaign.reader_us * 1000,
        hold_timeout_s=campaign.hold_timeout_s,
        data=campaign.data,
    )
    schedule = rounds(planned, campaign, layout)
    planned_trials = {pc.cell: 0 for pc in planned}
    for this in schedule:
        for pc, n in this:
            planned_trials[pc.cell] += n
    # Each kind's pools are sized for all of its cells, every round: the same footprint each
    # round, so that memory samples compare across rounds.
    sizes = {}
    for host_kind in campaign.host_memory:
        mine = [pc.program for pc in planned if pc.cell.host_memory == host_kind]
        if mine:
            # Registered memory gets a staging area too, used where kernels cannot reach it in place.
            staged = host_kind in ("pageable", "registered") or campaign.data == "random"
            sizes[host_kind] = pool_sizes(mine, layout, staged)
    tallies: dict[Cell, _Tally] = {}
    outcomes: dict[Cell, CellOutcome] = {}
    for round_index, this in enumerate(schedule):
        for host_kind in campaign.host_memory:
            mine = [(pc, n) for pc, n in this if pc.cell.host_memory == host_kind
                    and not (pc.cell in outcomes and outcomes[pc.cell].error)]
            if not mine:
                continue
            if _past(deadline):
                return outcomes
            pools = Pools(layout, host_kind, sizes[host_kind], device)
            runners: dict = {}
            try:
                for name in campaign.executors:
                    runners[name] = executors.make(name, pools, settings)
                for pc, n in mine:
                    if _past(deadline):
                        break
                    tally = tallies.setdefault(pc.cell, _Tally())
                    _run_trials(pc, runners[pc.cell.executor], campaign, n, tally)
                    outcome = tally.outcome(campaign, params, planned_trials[pc.cell])
                    outcomes[pc.cell] = outcome
                    if memory is not None:
                        memory.sample(round_index, settled=False)
                    on_cell_done(pc, outcome, round_index)
            finally:
                _release_and_free(runners, pools, device)
                if memory is not None:
                    memory.sample(round_index, settled=True)
    return outcomes


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _release_and_free(runners: dict, pools, device) -> None:
    from kvverify.device.gate import release_everything

    for r in runners.values():
        try:
            r.close()
        except Exception:  # pragma: no cover - cleanup goes on
            pass
    release_everything()
    if settle(device, SETTLE_S):
        for r in runners.values():
            try:
                r.free_memory()
            except Exception:  # pragma: no cover - cleanup goes on
                pass
        pools.close()
    else:
        import sys

        _abandon(runners, pools)
        print(f"kvverify stress: the device did not go idle within {SETTLE_S:g} s of the end of the "
              f"{pools.host_kind} cells; their memory is left to the process exit", file=sys.stderr, flush=True)


# Memory of host memory kinds whose device work never finished: kept referenced until the
# process exits, never freed (see _abandon).
_ABANDONED: list = []


def _abandon(runners: dict, pools) -> None:
    """Leave the memory of ``runners`` and ``pools`` to the process exit. Dropping it would
    free it at once (``HostBuffer.__del__``): ``cudaFreeHost`` and ``cudaHostUnregister``
    synchronize the device, so the main thread would hang on the very work that did not
    finish, and device memory or the gate's flag word would be reused while a stuck stream
    may still touch it."""
    buffers = pools.host_buffers() + [b for r in runners.values() for b in r.host_buffers()]
    for buf in buffers:
        buf.abandon()
    _ABANDONED.append((runners, pools, buffers))


def settle(device, timeout_s: float) -> bool:
    """Wait for the device to go idle, at most ``timeout_s``; True when it did. The wait runs
    in a helper thread (torch releases the GIL), so it cannot hang the caller."""
    import threading

    import torch

    done = threading.Event()

    def sync() -> None:
        try:
            torch.cuda.synchronize(device)
        except Exception:
            pass
        finally:
            done.set()

    threading.Thread(target=sync, name="kvverify-settle", daemon=True).start()
    return done.wait(timeout_s)


@dataclasses.dataclass
class _Tally:
    """What a cell's trials have shown so far, across rounds."""

    trials: int = 0
    counts: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])
    corrupted: int = 0
    checked: int = 0
    elapsed_s: float = 0.0
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)
    rounds: int = 0
    hold: str | None = None
    error: str | None = None

    def outcome(self, campaign: Campaign, params: Params, planned_trials: int) -> CellOutcome:
        if self.error is not None:
            return CellOutcome(None, self.error, dict(self.phase_s), planned_trials, self.rounds)
        window: dict[str, int | float | str] = {
            "writer_spin_ns": campaign.writer_delay_us * 1000,
            "reader_ns": campaign.reader_us * 1000,
            "blocks_per_transfer": params.blocks_per_transfer,
            "transfers_in_flight": params.transfers,
        }
        if self.hold is not None:
            window["hold"] = self.hold
        observation = Observation(
            trials=self.trials,
            corrupted_trials=self.corrupted,
            blocks_checked=sum(self.counts),
            bytes_checked=self.checked,
            ok=self.counts[0],
            stale=self.counts[1],
            torn=self.counts[2],
            garbage=self.counts[3],
            elapsed_s=self.elapsed_s,
            window=window,
        )
        return CellOutcome(observation, None, dict(self.phase_s), planned_trials, self.rounds)


def _run_trials(pc: PlannedCell, executor, campaign: Campaign, count: int, tally: _Tally) -> None:
    """Run ``count`` more trials of ``pc`` (numbered on from ``tally.trials``) and add them to
    ``tally``; a failure sets ``tally.error`` instead."""
    from kvverify.stress.executors import HarnessError

    start = time.perf_counter()
    with annotate.cell_range(pc.cell.label, pc.cell.direction):
        try:
            prepared = executor.prepare(pc.program)
            fault = os.environ.get(FAIL_CELL_ENV) == pc.cell.label
            for trial in range(tally.trials, tally.trials + count):
                with annotate.trial_range(trial):
                    result = executor.run_trial(prepared, pc.cell.order, trial, inject_fault=fault and trial == 0)
                tally.counts = [a + int(b) for a, b in zip(tally.counts, result.counts)]
                tally.corrupted += result.corrupted
                tally.checked += result.checked_bytes
                for name, seconds in result.phase_s.items():
                    tally.phase_s[name] = tally.phase_s.get(name, 0.0) + seconds
            tally.trials += count
        except (HarnessError, RuntimeError, ValueError) as exc:
            # The failed trial may have left work on the device (a timed-out wait, a refused
            # copy after others were queued): let it finish before the next cell writes the
            # same pools, or it would land in that cell's blocks (a false UNEXPECTED_CORRUPTION).
            note = ""
            try:
                executor.release_holds()
            except Exception:  # pragma: no cover - cleanup goes on
                pass
            if not settle(executor.pools.device, SETTLE_S):
                note = f" (and the device did not go idle within {SETTLE_S:g} s: later cells may see its copies)"
            tally.error = f"{pc.cell.label}: {type(exc).__name__}: {exc}{note}"
        finally:
            tally.elapsed_s += time.perf_counter() - start
            tally.rounds += 1
    if pc.cell.executor == "adversarial" and tally.error is None:
        tally.hold = executor.hold_note
