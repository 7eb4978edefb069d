"""Campaign -> cells -> contract verdicts, sizes and a cost estimate: everything before the GPU.

``plan`` builds every cell's program and asks the checker for its contract verdict (once per
scenario, direction, order and host memory kind: the trace does not depend on the executor).
``fit_params`` sizes the pools to the campaign's memory caps; ``estimate`` predicts the run's
trials, bytes and wall time from rates measured on an H200 (``docs/stress.md``).
"""

from __future__ import annotations

import dataclasses
import math

from kvverify.geometry import KVLayout
from kvverify.scenarios import Params, Program, Scenario, select
from kvverify.scenarios.contract import CONTRACT_TENSORS, contract, to_trace
from kvverify.scenarios.program import HOST, Expect, HostConsume, HostFill
from kvverify.stress.campaign import Campaign, CampaignError
from kvverify.stress.report import Cell
from kvverify.terms import ADVERSARIAL, KERNEL
from kvverify.units import format_size


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


def runs(executor: str, order: str, host_memory: str) -> bool:
    """Whether ``executor`` has a cell of this order and host memory kind. The kernel copy path is
    stream-ordered on both sides whatever order is asked (its contract is ``STREAM``'s), so it
    runs the ``STREAM`` cells only; and a kernel cannot dereference pageable memory
    (``swap_blocks_batch(method="kernel")`` refuses it), so it runs pinned and registered cells."""
    if executor == KERNEL:
        return order == "STREAM" and host_memory != "pageable"
    return True


def plan(campaign: Campaign, layout: KVLayout, params: Params | None = None) -> list[PlannedCell]:
    """Every cell of the campaign with its contract verdict (the executors' cells as ``runs``
    says). Raises ValueError for an unknown scenario name."""
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
                    for executor in (e for e in campaign.executors if runs(e, order, host)):
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
        if ADVERSARIAL in campaign.executors:  # its host snapshot area (AdversarialExecutor)
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
            f"{campaign.transfers} transfers) does not fit --gpu-mem {format_size(campaign.gpu_mem)} / --host-mem "
            f"{format_size(campaign.host_mem)}; raise them or lower transfers"
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


def first_round_trials(campaign: Campaign, executor: str) -> int:
    """Trials every cell gets before any cell gets more: ``trials``, and for the adversarial
    executor at least one trial of each of its schedules (so its verdict means something)."""
    from kvverify.stress.executors.adversarial import SCHEDULES

    return max(campaign.trials, len(SCHEDULES)) if executor == ADVERSARIAL else campaign.trials


def trials_for(campaign: Campaign, checked_bytes_per_trial: int, executor: str) -> int:
    """Enough trials to check ``min_checked`` bytes, within [trials, max_trials]; the
    adversarial executor runs each of its schedules at least once."""
    need = math.ceil(campaign.min_checked / max(1, checked_bytes_per_trial))
    return max(first_round_trials(campaign, executor), min(need, campaign.max_trials))


def round_trials() -> int:
    """Trials a cell gets in each round after the first: one per adversarial schedule, so every
    round rotates through all of them."""
    from kvverify.stress.executors.adversarial import SCHEDULES

    return len(SCHEDULES)


def rounds(planned: list[PlannedCell], campaign: Campaign, layout: KVLayout) -> list[list[tuple[PlannedCell, int]]]:
    """The run as rounds of trials over every cell: ``[[(cell, trials), ...], ...]``, in plan order
    within a round.

    Round 0 gives every cell ``first_round_trials``; each later round gives ``round_trials()`` more
    (fewer in a cell's last round) to every cell that has not reached ``trials_for`` yet. A run
    stopped at any round boundary has therefore seen every cell, and its later rounds spread the
    remaining time over the whole matrix instead of spending it on the first cells of the plan.
    A cell's trials are numbered on across rounds (the adversarial schedule is trial mod 3).
    """
    remaining = []
    for pc in planned:
        b = program_blocks(pc.program)
        total = trials_for(campaign, b["checked"] * layout.block_bytes, pc.cell.executor)
        remaining.append(total)
    out: list[list[tuple[PlannedCell, int]]] = []
    step = [first_round_trials(campaign, pc.cell.executor) for pc in planned]
    while any(remaining):
        this = []
        for i, pc in enumerate(planned):
            n = min(remaining[i], step[i])
            if n:
                this.append((pc, n))
                remaining[i] -= n
            step[i] = round_trials()
        out.append(this)
    return out


# -- cost estimate (no GPU) ------------------------------------------------------------------

# Rough rates of one H200 host (PCIe Gen5 x16; docs/stress.md): DMA and kernel access over PCIe,
# the device's own memory, and host-side passes over pageable memory (driver staging, CPU copies).
PCIE_BPS, DEVICE_BPS, PAGEABLE_BPS = 50e9, 2e12, 10e9
# A device-to-host batch into pageable memory pays per page, whatever its size.
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
