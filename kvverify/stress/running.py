"""Planned cells -> GPU runs -> observations: ``execute`` runs the cells of a plan
(``kvverify.stress.planning``) on the device, one host memory kind at a time so that each kind's
pools are allocated once and freed before the next (also on Ctrl-C).
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
from kvverify.stress.planning import PlannedCell, pool_sizes, trials_for
from kvverify.stress.report import Cell, Observation

# A cell label here makes trial 0 of that cell fail in its verify phase: how tests check that
# a failing cell fails the run, the run goes on, and NVTX ranges stay balanced.
FAIL_CELL_ENV = "KVVERIFY_STRESS_FAIL_CELL"


@dataclasses.dataclass
class CellOutcome:
    observation: Observation | None
    error: str | None = None
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)  # summed over trials


SETTLE_S = 30.0  # how long cleanup waits for the device to go idle before it gives up


def execute(
    planned: list[PlannedCell],
    campaign: Campaign,
    layout: KVLayout,
    params: Params,
    on_cell_done: Callable[[PlannedCell, CellOutcome], None] = lambda pc, o: None,
    device=None,
    deadline: float | None = None,
) -> dict[Cell, CellOutcome]:
    """Run every planned cell on ``device`` (default: the current CUDA device). A cell whose
    run fails (a refused copy, a hang) gets an outcome with ``error`` and no observation;
    the run goes on. ``deadline`` (``time.monotonic()``): no cell starts after it; cells not
    run have no outcome.

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
    outcomes: dict[Cell, CellOutcome] = {}
    for host_kind in campaign.host_memory:
        mine = [pc for pc in planned if pc.cell.host_memory == host_kind]
        if not mine or (deadline is not None and time.monotonic() > deadline):
            continue
        # Registered memory gets a staging area too, used where kernels cannot reach it in place.
        staged = host_kind in ("pageable", "registered") or campaign.data == "random"
        sizes = pool_sizes([pc.program for pc in mine], layout, staged)
        pools = Pools(layout, host_kind, sizes, device)
        runners: dict = {}
        try:
            for name in campaign.executors:
                runners[name] = executors.make(name, pools, settings)
            for pc in mine:
                if deadline is not None and time.monotonic() > deadline:
                    break
                outcome = _run_cell(pc, runners[pc.cell.executor], campaign, params)
                outcomes[pc.cell] = outcome
                on_cell_done(pc, outcome)
        finally:
            _release_and_free(runners, pools, device)
    return outcomes


def _release_and_free(runners: dict, pools, device) -> None:
    from kvverify.stress.executors.gate import release_everything

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


def _run_cell(pc: PlannedCell, executor, campaign: Campaign, params: Params) -> CellOutcome:
    from kvverify.stress.executors import HarnessError

    start = time.perf_counter()
    with annotate.cell_range(pc.cell.label, pc.cell.direction):
        try:
            prepared = executor.prepare(pc.program)
            trials = trials_for(campaign, prepared.checked_pages * executor.page_bytes, pc.cell.executor)
            counts = [0, 0, 0, 0]
            corrupted = checked = 0
            phase_s: dict[str, float] = {}
            fault = os.environ.get(FAIL_CELL_ENV) == pc.cell.label
            for trial in range(trials):
                with annotate.trial_range(trial):
                    result = executor.run_trial(prepared, pc.cell.order, trial, inject_fault=fault and trial == 0)
                counts = [a + int(b) for a, b in zip(counts, result.counts)]
                corrupted += result.corrupted
                checked += result.checked_bytes
                for name, seconds in result.phase_s.items():
                    phase_s[name] = phase_s.get(name, 0.0) + seconds
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
            return CellOutcome(None, f"{pc.cell.label}: {type(exc).__name__}: {exc}{note}")
    window: dict[str, int | float | str] = {
        "writer_spin_ns": campaign.writer_delay_us * 1000,
        "reader_ns": campaign.reader_us * 1000,
        "blocks_per_transfer": params.blocks_per_transfer,
        "transfers_in_flight": params.transfers,
    }
    if pc.cell.executor == "adversarial":
        window["hold"] = executor.hold_note
    observation = Observation(
        trials=trials,
        corrupted_trials=corrupted,
        blocks_checked=sum(counts),
        bytes_checked=checked,
        ok=counts[0],
        stale=counts[1],
        torn=counts[2],
        garbage=counts[3],
        elapsed_s=time.perf_counter() - start,
        window=window,
    )
    return CellOutcome(observation, None, phase_s)
