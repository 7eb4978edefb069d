"""Campaign -> cells -> contract verdicts -> GPU runs -> ``StressReport``.

``plan`` needs no GPU: it builds every cell's program and asks the checker for its
contract verdict (once per scenario, direction, order and host memory kind: the trace does
not depend on the executor). ``execute`` runs the planned cells on the device, one host
memory kind at a time so that each kind's pools are allocated once and freed before the
next (also on Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable

from kvverify import annotate
from kvverify.geometry import KVLayout
from kvverify.scenarios import Params, Program, Scenario, select
from kvverify.scenarios.contract import CONTRACT_TENSORS, contract, to_trace
from kvverify.scenarios.program import HOST, Expect, HostConsume, HostFill
from kvverify.stress.campaign import Campaign, CampaignError
from kvverify.stress.report import Cell, Observation


@dataclasses.dataclass(frozen=True)
class PlannedCell:
    cell: Cell
    scenario: Scenario
    program: Program
    contract: str  # "SAFE" or "RACY", from the checker
    witness: str | None  # the first race, for a RACY contract
    trace: dict  # what the checker saw (``--dump-traces``)


def witness_text(race) -> str:
    return f"ops {race.first} and {race.second} ({race.kind}): {race.reason}"


def plan(campaign: Campaign, layout: KVLayout, params: Params | None = None) -> list[PlannedCell]:
    """Every cell of the campaign with its contract verdict. Raises ValueError for an
    unknown scenario name."""
    params = params or Params(campaign.blocks_per_transfer, campaign.transfers)
    cells: list[PlannedCell] = []
    for scenario in select(list(campaign.scenarios)):
        for direction in scenario.directions:
            program = scenario.program(direction, params)
            for order in campaign.orders:
                for host in campaign.host_memory:
                    doc = to_trace(program, order, host, layout.page_bytes, min(CONTRACT_TENSORS, layout.num_tensors))
                    report = contract(doc)
                    witness = witness_text(report.races[0]) if report.races else None
                    for executor in campaign.executors:
                        cell = Cell(scenario.name, direction, order, host, executor)
                        cells.append(PlannedCell(cell, scenario, program, report.verdict, witness, doc))
    return cells


# -- sizing -------------------------------------------------------------------------------


def pool_sizes(programs: list[Program], layout: KVLayout, staged: bool):
    """Pools for ``programs``; ``staged``: host blocks go through the device staging area
    (pageable memory, or ``--data random``)."""
    from kvverify.stress.executors.pools import PoolSizes

    tensors = layout.num_tensors

    def host_check_pages(p: Program) -> int:
        pages = [len(s.blocks) for s in p.steps if isinstance(s, (HostFill, HostConsume, Expect)) and s.blocks.pool == HOST]
        return max(pages + [p.host_slots]) * tensors  # the setup writes every host slot at once

    return PoolSizes(
        gpu_slots=max(p.gpu_slots for p in programs),
        host_slots=max(p.host_slots for p in programs),
        snapshot_pages=max(sum(len(c.src) for s in p.swaps() for c in s.copies) for p in programs) * tensors,
        staging_pages=max(host_check_pages(p) for p in programs) if staged else 0,
    )


def fit_params(campaign: Campaign, layout: KVLayout) -> tuple[Params, str | None]:
    """The largest ``blocks_per_transfer`` (up to the campaign's) whose pools fit
    ``gpu_mem`` / ``host_mem``; a note when it had to shrink. Raises CampaignError when
    not even one block per transfer fits."""
    staged = bool({"pageable", "registered"} & set(campaign.host_memory)) or campaign.data == "random"
    scenarios = select(list(campaign.scenarios))

    def fits(n: int) -> bool:
        params = Params(n, campaign.transfers)
        sizes = pool_sizes([s.program(d, params) for s in scenarios for d in s.directions], layout, staged)
        dev, host = sizes.device_bytes(layout), sizes.host_bytes(layout)
        if "adversarial" in campaign.executors:  # its host snapshot area (AdversarialExecutor)
            host += max(1, sizes.snapshot_pages) * layout.page_bytes
        return dev <= campaign.gpu_mem and host <= campaign.host_mem

    # Every scenario moves n blocks per transfer from one pool to the other, so each pool holds
    # at least n blocks: a bound that spares building programs for absurd requests.
    high = min(campaign.blocks_per_transfer,
               campaign.gpu_mem // layout.block_bytes, campaign.host_mem // layout.block_bytes)
    if high >= 1 and fits(high):  # the usual case: one evaluation
        low = high
    elif high < 1 or not fits(1):
        raise CampaignError(
            f"one block per transfer of {layout.geometry.name} ({layout.block_bytes / 2**20:.1f} MiB per block, "
            f"{campaign.transfers} transfers) does not fit --gpu-mem {campaign.gpu_mem} / --host-mem "
            f"{campaign.host_mem} bytes; raise them or lower transfers"
        )
    else:
        low = 1  # fits; pool sizes grow with n, so the largest fitting n is found by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    note = None if low == campaign.blocks_per_transfer else (
        f"blocks_per_transfer lowered from {campaign.blocks_per_transfer} to {low} to fit "
        f"--gpu-mem {campaign.gpu_mem / 2**30:.1f} GiB / --host-mem {campaign.host_mem / 2**30:.1f} GiB")
    return Params(low, campaign.transfers), note


def trials_for(campaign: Campaign, checked_bytes_per_trial: int, executor: str) -> int:
    """Enough trials to check ``min_checked`` bytes, within [trials, max_trials]; the
    adversarial executor runs each of its schedules at least once."""
    from kvverify.stress.executors.adversarial import SCHEDULES

    need = math.ceil(campaign.min_checked / max(1, checked_bytes_per_trial))
    low = campaign.trials if executor == "native" else max(campaign.trials, len(SCHEDULES))
    return max(low, min(need, campaign.max_trials))


# -- cost estimate (no GPU) ------------------------------------------------------------------

# Rough rates of one H200 host (PCIe Gen5 x16): DMA and kernel access over PCIe, the device's
# own memory, and host-side passes over pageable memory (driver staging, CPU copies).
PCIE_BPS, DEVICE_BPS, PAGEABLE_BPS = 50e9, 2e12, 10e9
# A device-to-host batch into pageable memory pays per page, whatever its size: ~30 µs per page
# on the H200 (driver 580; the smoke's native pageable store cells, docs/stress.md).
PAGEABLE_D2H_PAGE_S = 30e-6
TRIAL_FIXED_S = 4e-3  # Python issue, syncs and polls of one trial


@dataclasses.dataclass(frozen=True)
class Estimate:
    cells: int
    trials: int
    checked_bytes: int
    copied_bytes: int
    seconds: float

    def line(self) -> str:
        return (f"planned: {self.cells} cells, {self.trials} trials, ~{self.checked_bytes / 2**30:.0f} GiB to check, "
                f"~{self.copied_bytes / 2**30:.0f} GiB to copy, ~{self.seconds:.0f} s estimated")


def program_blocks(program: Program) -> dict[str, int]:
    """Per trial, in blocks: checked (``Read`` twice, as ``Executor.prepare`` counts), of them on
    the host, copied, of them into host memory, written by the host (setup and ``HostFill``);
    and the writer / reader kernels (each spins or scans for its window)."""
    from kvverify.scenarios.program import GPU, Read, Write

    checked = host_checked = copied = 0
    host_written = program.host_slots
    writes = reads = 0
    for s in program.steps:
        if isinstance(s, (Read, HostConsume, Expect)):
            n = len(s.blocks) * (2 if isinstance(s, Read) else 1)
            checked += n
            host_checked += n if s.blocks.pool != GPU else 0
        elif isinstance(s, HostFill):
            host_written += len(s.blocks)
        if isinstance(s, Write):
            writes += 1
        elif isinstance(s, Read):
            reads += 1
    copied = sum(len(c.src) for sw in program.swaps() for c in sw.copies)
    copied_to_host = sum(len(c.dst) for sw in program.swaps() for c in sw.copies if c.dst.pool != GPU)
    return {"checked": checked, "host_checked": host_checked, "copied": copied, "copied_to_host": copied_to_host,
            "host_written": host_written, "writes": writes, "reads": reads}


def estimate(planned: list[PlannedCell], campaign: Campaign, layout: KVLayout) -> Estimate:
    """Trials, bytes and a rough wall time of running ``planned`` (see the rates above)."""
    trials = checked = copied = 0
    seconds = 0.0
    block = layout.block_bytes
    for pc in planned:
        b = program_blocks(pc.program)
        n = trials_for(campaign, b["checked"] * block, pc.cell.executor)
        host_rate = PAGEABLE_BPS if pc.cell.host_memory == "pageable" else PCIE_BPS
        # The adversarial executor lands copies into pageable memory in pinned memory (a host pass).
        per_page_d2h = pc.cell.host_memory == "pageable" and pc.cell.executor == "native"
        copy_s = (b["copied_to_host"] * layout.num_tensors * PAGEABLE_D2H_PAGE_S
                  + (b["copied"] - b["copied_to_host"]) * block / host_rate) if per_page_d2h else b["copied"] * block / host_rate
        per_trial = (TRIAL_FIXED_S
                     + (b["writes"] * campaign.writer_delay_us + b["reads"] * campaign.reader_us) * 1e-6
                     + copy_s
                     + (b["host_checked"] + b["host_written"]) * block / host_rate
                     + (b["checked"] - b["host_checked"]) * block / DEVICE_BPS)
        trials += n
        checked += n * b["checked"] * block
        copied += n * b["copied"] * block
        seconds += n * per_trial
    return Estimate(len(planned), trials, checked, copied, seconds)


# -- execution ------------------------------------------------------------------------------


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
