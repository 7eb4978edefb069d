"""``kvverify stress``: run a campaign of cells on the GPU and print one verdict per cell.

``DESCRIPTION`` and ``EPILOG`` are its ``--help`` (what it runs, the exit status, an example);
``docs/stress.md`` has the long form.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvverify import annotate
from kvverify import device
from kvverify.stress import distributed, render
from kvverify.stress.campaign import DATA_MODES, CampaignError
from kvverify.stress.render import say
from kvverify.stress.report import (
    EXIT_CANNOT_START,
    EXIT_MEMORY_GREW,
    EXIT_OK,
    worst_exit_status,
)
from kvverify.terms import EXECUTORS, HOST_MEMORY_KINDS, ORDERS

if TYPE_CHECKING:
    from kvverify.stress.memory import Trend
    from kvverify.stress.report import Cell, Platform
    from kvverify.stress.running import CellOutcome
from kvverify.units import HelpFormatter, choice_list_arg, positive_int_arg, size_arg

DESCRIPTION = """\
Options left out take the campaign's values: a bare kvverify stress runs the
smoke campaign (stress/smoke.toml; about 90 s on one H200) and prints a verdict
matrix, the cells that need a reader's eye, and a headline. Without a CUDA
device: the contract verdicts only."""

EPILOG = """\
Exit status: 0 when every cell agrees with its contract (or nothing ran: no
device); 1 when a cell is UNEXPECTED_CORRUPTION or SENSITIVITY_FAILURE (on any
GPU), could not run, or --max-seconds left it unrun; 2 when the run cannot
start or a report cannot be written (the reason on stderr); 3 when nothing
failed but host or device memory grew (a leak). Several GPUs: --gpus N, or
torchrun --nproc-per-node N -m kvverify stress (docs/stress.md).

Example:
  kvverify stress --scenarios H1 --orders STREAM,ANY --json r.json --plot m.png"""


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _gpus_arg(text: str) -> int | str:
    if text == "all":
        return text
    return positive_int_arg(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.usage = "%(prog)s [OPTIONS]"
    parser.description = (parser.description or "") + ".\n\n" + DESCRIPTION
    parser.epilog = EPILOG
    a = parser.add_argument
    a("--campaign", default="smoke", metavar="NAME|PATH", help="smoke (default), nightly, soak, or a campaign .toml file")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="PRESET", help="model preset (llama-3.1-8b, qwen2.5-7b, ...) instead of the campaign's")
    model.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json (or its folder) instead of a preset")
    a("--kv-cache-dtype", metavar="DTYPE", help="with --model-config: KV-cache dtype, e.g. bfloat16, float8_e4m3fn")
    a("--block-size", type=positive_int_arg, metavar="TOKENS", help="tokens per KV page")
    a("--tp", type=positive_int_arg, help="tensor-parallel ranks (KV heads per rank)")
    a("--trials", type=positive_int_arg, metavar="N", help="at least this many trials per cell")
    a("--seed", type=int, metavar="N", help="block pattern seed")
    a("--gpu-mem", type=size_arg, metavar="SIZE", help="cap on device memory, e.g. 8GiB")
    a("--host-mem", type=size_arg, metavar="SIZE", help="cap on host memory, e.g. 6GiB")
    a("--host-memory", type=choice_list_arg(HOST_MEMORY_KINDS, upper=False), metavar="KINDS",
      help=f"comma list of {','.join(HOST_MEMORY_KINDS)}, or all")
    a("--orders", type=choice_list_arg(ORDERS, upper=True), metavar="ORDERS", help=f"comma list of {','.join(ORDERS)}, or all")
    a("--scenarios", type=_names, metavar="NAMES", help="comma list of scenarios (H1-broken, P2) or hazards (H3)")
    a("--executors", type=choice_list_arg(EXECUTORS, upper=False), metavar="NAMES",
      help=f"comma list of {','.join(EXECUTORS)}, or all")
    a("--blocks-per-transfer", type=positive_int_arg, metavar="N", help="KV blocks per batched swap")
    a("--transfers", type=positive_int_arg, metavar="N", help="transfers in flight (2..32)")
    a("--writer-delay-us", type=int, metavar="US", help="spin before each compute write, microseconds")
    a("--data", choices=DATA_MODES, help="block contents: generation pattern (default) or random + checksums")
    a("--no-gpu", action="store_true", help="contract verdicts only, even where a CUDA device is present")
    a("--max-seconds", type=float, metavar="S", help="start nothing after S seconds (rounds cover every cell first)")
    a("--gpus", type=_gpus_arg, metavar="N|all", help="one process per GPU of this host (not under torchrun)")
    a("--shard", action="store_true", help="with several GPUs, split the cells across them (default: all on each)")
    a("--details", action="store_true", help="one row per cell (counts, window, bound, witness), not the matrix")
    a("--plot", metavar="PATH.png", help="also draw the verdict matrix as a PNG (needs matplotlib)")
    a("--json", metavar="PATH", help="write the report as JSON; - for stdout (the report then on stderr)")
    a("--junit", metavar="PATH", help="write JUnit XML, one testcase per cell")
    a("--dump-traces", metavar="DIR", help="write each cell's trace, for kvverify check")
    annotate.add_cli_option(parser)


class _StartError(Exception):
    """The run cannot start; the message is the reason."""


def _campaign(args):
    from kvverify.stress import campaign as campaigns

    c = campaigns.load(args.campaign)
    models = (args.model,) if args.model else None
    return c.override(
        models=models, block_size=args.block_size, tp=args.tp, trials=args.trials, seed=args.seed,
        gpu_mem=args.gpu_mem, host_mem=args.host_mem, host_memory=args.host_memory, orders=args.orders,
        scenarios=args.scenarios, executors=args.executors, blocks_per_transfer=args.blocks_per_transfer,
        transfers=args.transfers, writer_delay_us=args.writer_delay_us, data=args.data,
        max_trials=max(args.trials, c.max_trials) if args.trials else None,
    )


def _layouts(args, c):
    from kvverify import geometry

    if args.model_config:
        try:
            geometries = [geometry.from_hf_config(args.model_config, kv_cache_dtype=args.kv_cache_dtype)]
        except geometry.ConfigError as exc:
            raise _StartError(f"--model-config {args.model_config}: {exc}") from None
    else:
        if args.kv_cache_dtype:
            raise _StartError("--kv-cache-dtype goes with --model-config; a preset has its own dtype")
        geometries = [geometry.preset(m) for m in c.models]
    return [geometry.KVLayout(g, block_size=c.block_size, tp=c.tp) for g in geometries]


def _platform(gpu: bool):
    """The report's Platform, from ``kvverify.device.platform_info`` (fields it cannot read: None)."""
    from kvverify.device import platform_info
    from kvverify.stress.report import Platform

    info = platform_info.collect() if gpu else {}

    def field(key: str) -> str | None:
        value = info.get(key, platform_info.UNKNOWN)
        return None if value == platform_info.UNKNOWN else str(value)

    if not gpu:
        try:
            import torch

            return Platform(cuda=torch.version.cuda, torch=torch.__version__)
        except ImportError:
            return Platform()
    return Platform(gpu=field("gpu_name"), driver=field("driver_version"), cuda=field("cuda_runtime_version"),
                    torch=field("torch_version"))


def _output_path(path: str | None, model: str, several: bool) -> str | None:
    if path is None or not several:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{model}{p.suffix}"))


def _check_writable(option: str, path: str | None) -> None:
    """Fail before the campaign runs, not after it, when a report cannot be written to ``path``.

    Raises ``_StartError`` naming the option and the reason.
    """
    if path is None or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise _StartError(f"{option} {path}: is a directory; give a file path")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise _StartError(f"{option} {path}: cannot be written ({exc.strerror})") from None
    if not existed:
        target.unlink()  # the probe file; the report replaces it at the end


def _check_folder(option: str, path: str | None) -> None:
    """Fail before the campaign runs when ``path`` cannot be (or become) a folder to write in.

    Raises ``_StartError`` naming the option and the reason.
    """
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise _StartError(f"{option} {path}: exists and is not a folder; give a folder path")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _StartError(f"{option} {path}: cannot be created ({exc.strerror})") from None
    if not os.access(target, os.W_OK):
        raise _StartError(f"{option} {path}: the folder is not writable")


def run(args) -> int:
    # Each stream held by the adversarial executor's gate must not share a hardware work queue
    # with a stream it waits for; CUDA's default is 8 queues per process, 32 the most. Read when
    # the process first initializes CUDA, which happens later in this run.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

    # The width is the terminal's, else COLUMNS, else rich's 80; only --details in a log without
    # COLUMNS gets 200, so that its table keeps one line per cell.
    console = render.console(stderr=args.json == "-")
    if args.details and not console.is_terminal and "COLUMNS" not in os.environ:
        console = render.console(stderr=args.json == "-", width=200)
    err = render.console(stderr=True)
    try:
        under_torchrun = distributed.from_env()
        if args.gpus is not None and under_torchrun is not None:
            raise _StartError("--gpus starts its own ranks; under torchrun leave it out (--nproc-per-node decides)")
        ranks = under_torchrun or distributed.Ranks()
        if ranks.leader:  # only rank 0 writes (with --gpus: this process checks for the ranks it starts)
            _check_writable("--json", args.json)
            _check_writable("--junit", args.junit)
            _check_writable("--plot", args.plot)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise _StartError("--plot needs matplotlib: pip install matplotlib (or the plot extra: "
                              "pip install -e '.[plot]')")
        c = _campaign(args)
        if c.data == "random" and "adversarial" in c.executors:
            raise _StartError("--data random checks by checksums and runs with the native executor only; "
                              "add --executors native")
        layouts = _layouts(args, c)
        if args.json == "-" and len(layouts) > 1:
            raise _StartError(f"--json - writes one JSON document, and campaign {c.name} runs {len(layouts)} model "
                              "presets: give a path (one file per preset, named after it)")
        if args.max_seconds is not None and args.max_seconds <= 0:
            raise _StartError("--max-seconds must be positive")
        if ranks.leader:
            _check_folder("--dump-traces", args.dump_traces)  # last: it creates the folder
        if args.gpus is not None:
            return _launch(args)
    except (CampaignError, ValueError, _StartError) as exc:
        err.print(f"kvverify stress: cannot start: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_CANNOT_START

    deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
    joined = ranks.world > 1  # one rank needs no process group (nor torch.distributed)
    if joined:
        distributed.join(ranks)
    try:
        with _interrupts():
            statuses = []
            shown: dict = {}
            for layout in layouts:
                statuses.append(_run_one(args, c, layout, console, err, several=len(layouts) > 1, deadline=deadline,
                                         ranks=ranks, shown=shown))
                if statuses[-1] == EXIT_CANNOT_START:
                    break
            return worst_exit_status(statuses)
    finally:
        if joined:
            distributed.leave()


def _launch(args) -> int:
    """``--gpus``: this command line, without it, on that many local ranks (torch.distributed.run).
    Raises ``_StartError`` where this host has no CUDA device for them (nothing starts: the ranks
    would run nothing), or fewer than asked."""
    n = args.gpus
    reason = device.gpu_refusal()
    if reason is not None:
        raise _StartError(f"--gpus {n}: {reason}")
    import torch

    visible = torch.cuda.device_count()
    if n == "all":
        n = visible
    elif n > visible:
        raise _StartError(f"--gpus {n}: this host shows {visible} CUDA device{'s' if visible != 1 else ''}; ask for "
                          f"at most {visible} (or all), or check CUDA_VISIBLE_DEVICES")
    argv = list(args.command_argv)
    i = next((k for k, a in enumerate(argv) if a == "--gpus" or a.startswith("--gpus=")), None)
    if i is not None:
        del argv[i:i + (1 if "=" in argv[i] else 2)]
    return distributed.launch(argv, n)


# -- SIGINT / SIGTERM -------------------------------------------------------------------------

GRACE_S = 90.0  # after the first signal, the longest the run may take to clean up and exit


@contextlib.contextmanager
def _interrupts():
    """SIGINT and SIGTERM during a run. The first: every stream hold is released at once (by a
    watcher thread that the signal wakes, even while the main thread is blocked in a CUDA
    call), and KeyboardInterrupt is raised in the main thread so that finally blocks free
    memory; if cleanup has not ended ``GRACE_S`` later, the process exits. A second signal:
    the process exits at once. Exit status 128 + the signal number in both forced exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from kvverify.device import gate

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    stop = threading.Event()
    raised = []

    def handler(signum, frame):
        if not raised:  # later signals are the watcher's: they must not interrupt cleanup
            raised.append(signum)
            raise KeyboardInterrupt

    def watch():
        signals: list[int] = []
        while not stop.is_set():
            timeout = GRACE_S if signals else None
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if stop.is_set():
                return
            if not ready:  # the grace period after the first signal ran out
                os.write(2, f"kvverify stress: cleanup did not end within {GRACE_S:g} s of the signal; "
                            "exiting now\n".encode())
                os._exit(128 + signals[0])
            data = os.read(read_fd, 64)
            new = [b for b in data if b]  # 0 is the stop byte
            if not new:
                continue
            gate.release_everything(disarm=True)
            signals += new
            if len(signals) >= 2:
                os.write(2, b"kvverify stress: second signal: exiting now\n")
                os._exit(128 + signals[-1])

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="kvverify-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, old in previous.items():
            signal.signal(sig, old)
        stop.set()
        try:
            os.write(write_fd, b"\0")
        except OSError:
            pass
        watcher.join(timeout=5)
        if not watcher.is_alive():
            os.close(read_fd)
            os.close(write_fd)
        gate.release_everything()


@dataclasses.dataclass
class _RankResult:
    """What one rank sends rank 0: where it ran, what it was given and what it saw."""

    rank: int
    host: str
    device: int | None
    platform: Platform
    not_run_reason: str | None
    given: tuple[Cell, ...]  # the cells of its share
    outcomes: dict[Cell, CellOutcome]
    memory: Trend | None
    rounds_planned: int
    trials_planned: int


def _run_one(args, c, layout, console, err, several: bool, deadline: float | None,
             ranks: distributed.Ranks, shown: dict) -> int:
    """Plan, run (where a device is) and report one model preset's campaign; return its exit status.
    ``shown``: the contract verdicts already printed without a device, and the preset they were
    printed for."""
    from kvverify.stress import memory, planning

    try:
        params, note = planning.fit_params(c, layout)
        planned = planning.plan(c, layout, params)
    except (CampaignError, ValueError) as exc:
        err.print(f"kvverify stress: cannot start: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_CANNOT_START
    if note and ranks.leader:
        say(err, f"kvverify stress: {note}")
    if args.dump_traces and ranks.leader:
        _written(err, f"{_dump_traces(planned, Path(args.dump_traces))} traces written to {args.dump_traces}")
    reason = "--no-gpu was given" if args.no_gpu else device.gpu_refusal()
    if reason is None:
        reason = distributed.bind_device(ranks)
    mine = distributed.shard(planned, c, layout, ranks.world)[ranks.rank] if args.shard else planned
    schedule = planning.rounds(mine, c, layout)
    outcomes: dict = {}
    sampler = None
    with annotate.run_range(f"kvverify stress {c.name} {layout.geometry.name}"):
        if reason is None:
            if ranks.leader:
                where = ""
                if ranks.world > 1:
                    where = f", split across {ranks.world} GPUs" if args.shard else f", on each of {ranks.world} GPUs"
                say(err, f"{planning.estimate(mine, c, layout).line()} in {len(schedule)} round(s) "
                          f"({c.name}, {layout.geometry.name}, {layout.block_bytes / 2**20:g} MiB blocks, "
                          f"{params.blocks_per_transfer} blocks x {params.transfers} transfers{where})")
            sampler = memory.MemorySampler(device=distributed.current_device())
            started = time.monotonic()
            outcomes = _execute_with_progress(schedule, c, layout, params, console, err, deadline, ranks, sampler)
            if ranks.world > 1:
                say(err, f"[stress] GPU {ranks.rank}: {len(outcomes)} of {len(mine)} cells in "
                          f"{time.monotonic() - started:.1f} s")
        else:
            # Nothing runs: each cell's range covers its contract verdict (no trials, no phases).
            for pc in mine:
                with annotate.cell_range(pc.cell.label, pc.cell.direction):
                    pass
    own = _RankResult(
        ranks.rank, distributed.host_name(), _device_index() if reason is None else None,
        _platform(reason is None), reason, tuple(pc.cell for pc in mine), outcomes,
        sampler.trend() if sampler is not None else None, len(schedule) if reason is None else 0,
        sum(n for this in schedule for _, n in this) if reason is None else 0,
    )
    gathered = distributed.gather(own, ranks)
    if not ranks.leader:
        return EXIT_OK  # rank 0 reports for every rank
    report = _report(args, c, layout, planned, gathered)
    # Without a device each model preset's matrix is its contracts alone: print one once and name
    # the presets whose contracts are the same (the nightly campaign has six).
    contracts = tuple((r.cell.label, r.contract) for r in report.cells) if report.not_run_reason else None
    twin = shown.get(contracts) if contracts is not None and not args.details else None
    if twin is not None:
        say(console, f"kvverify stress: {c.name} ({layout.geometry.name}): the same contract verdicts as {twin}")
    else:
        if contracts is not None:
            shown[contracts] = layout.geometry.name
        (render.render_table if args.details else render.render_matrix)(report, console)
        every = {(r.rank, cell): o for r in gathered for cell, o in r.outcomes.items()}
        if every:
            say(console, _throughput_line(every))
        render.render_gpus(report, console)
        if report.ran():  # the ranges mark device work: where none ran, their state says nothing
            say(console, f"NVTX: {annotate.state()}")
            if annotate.is_active():
                say(console, annotate.HOST_SIDE_NOTE)
    for r in report.cells:
        if r.error:
            err.print(f"kvverify stress: cell not run: {r.error}", markup=False, highlight=False, soft_wrap=True)
    execution = report.execution
    unrun = report.unrun_cells()
    if unrun:
        say(err, f"kvverify stress: --max-seconds {args.max_seconds:g} reached: {len(unrun)} of {len(planned)} "
                  "cells not run (NOT_RUN)")
    elif execution.stopped:
        say(err, f"kvverify stress: --max-seconds {args.max_seconds:g} reached in round {execution.rounds_run} of "
                  f"{execution.rounds_planned}: every cell ran, {execution.trials_run} of {execution.trials_planned} "
                  "planned trials")
    if args.json == "-":
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    outputs = [("--json", "report", args.json if args.json != "-" else None, report.write_json),
               ("--junit", "JUnit XML", args.junit, lambda path: render.write_junit(report, path)),
               ("--plot", "matrix plot", args.plot, lambda path: _plot(report, path))]
    for option, what, path, write in outputs:
        if not path:
            continue
        path = _output_path(path, layout.geometry.name, several)
        try:
            write(path)
        except OSError as exc:  # checked before the run; a full disk or a vanished folder since
            say(err, f"kvverify stress: {option} {path}: cannot be written ({exc.strerror or exc}); the run's "
                      "verdicts are above")
            return EXIT_CANNOT_START
        _written(err, f"{what} written to {path}")
    status = report.exit_status()
    if status == EXIT_MEMORY_GREW:
        say(err, "kvverify stress: memory grew over the run (exit status 3); see the GPU memory lines above")
    return status


def _written(err, line: str) -> None:
    """Say where a file went: one line on stderr, whole at any width (a path to copy)."""
    err.print(f"kvverify stress: {line}", markup=False, highlight=False, soft_wrap=True)


def _plot(report, path: str) -> None:
    from kvverify.stress import plot

    plot.plot_matrix(report, path)


def _device_index() -> int | None:
    current = distributed.current_device()
    return None if current is None else current.index


def _report(args, c, layout, planned, gathered):
    """Rank 0's report from every rank's ``_RankResult``."""
    from kvverify.stress.report import CellResult, Execution, Gpu, StressReport

    results = []
    several = len(gathered) > 1
    for pc in planned:
        per_gpu, errors = [], []
        for r in gathered:
            if pc.cell not in r.given:
                continue
            outcome = r.outcomes.get(pc.cell)
            per_gpu.append((r.rank, outcome.observation if outcome is not None else None))
            if outcome is not None and outcome.error:
                errors.append(f"GPU {r.rank}: {outcome.error}" if several else outcome.error)
        results.append(CellResult.on_gpus(pc.cell, pc.contract, pc.witness, per_gpu, "; ".join(errors) or None))
    ran = [r for r in gathered if r.not_run_reason is None]
    trials_run = sum(o.observation.trials for r in ran for o in r.outcomes.values() if o.observation is not None)
    stopped = any(
        cell not in r.outcomes
        or (r.outcomes[cell].error is None and r.outcomes[cell].observation.trials < r.outcomes[cell].planned_trials)
        for r in ran for cell in r.given
    )
    execution = Execution(
        shard=args.shard, rounds_planned=max((r.rounds_planned for r in ran), default=0),
        rounds_run=max((o.rounds for r in ran for o in r.outcomes.values()), default=0),
        trials_planned=sum(r.trials_planned for r in ran), trials_run=trials_run, max_seconds=args.max_seconds,
        stopped=stopped and args.max_seconds is not None,
    )
    gpus = tuple(Gpu(r.rank, r.host, r.device, r.platform, r.not_run_reason, r.memory) for r in gathered)
    return StressReport(
        platform=gathered[0].platform, campaign=c.name, seed=c.seed, cells=tuple(results), layout=layout.describe(),
        not_run_reason=None if ran else gathered[0].not_run_reason, gpus=gpus, execution=execution,
    )


def _throughput_line(outcomes) -> str:
    """Bytes checked, GB/s, and wall time of checking against the phase that runs the copies."""
    observed = [o for o in outcomes.values() if o.observation is not None]
    checked = sum(o.observation.bytes_checked for o in observed)
    elapsed = sum(o.observation.elapsed_s for o in observed)
    phases = {name: sum(o.phase_s.get(name, 0.0) for o in observed) for name in ("write", "swap", "verify")}
    rate = checked / elapsed / 1e9 if elapsed else 0.0
    return (
        f"Checked {checked / 2**30:.1f} GiB in {elapsed:.1f} s ({rate:.2f} GB/s over {len(observed)} cells); "
        f"wall time per phase: write {phases['write']:.1f} s, swap {phases['swap']:.1f} s, "
        f"verify {phases['verify']:.1f} s (checking {'within' if phases['verify'] <= phases['swap'] else 'OVER'} "
        "the time of the swaps it checks)"
    )


def _execute_with_progress(schedule, c, layout, params, console, err, deadline, ranks, memory):
    """Run the rounds of ``schedule`` (``planning.rounds``) with a progress bar on a terminal, else
    one plain line per cell and round on stderr (logs show where the time goes, and which cell was
    running when a run stopped). Only rank 0 shows progress: every rank runs at about its pace."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvverify.stress import running
    from kvverify.stress.report import cell_verdict

    planned = [pc for pc, _ in schedule[0]] if schedule else []
    plain = not err.is_terminal and ranks.leader
    start = time.monotonic()
    state = {"in_round": 0, "last": start, "round": 0}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not (console.is_terminal and ranks.leader)) as progress:
        task = progress.add_task(f"stress {c.name}", total=len(planned))

        def done(pc, outcome, round_index):
            if round_index != state["round"]:
                state["round"], state["in_round"] = round_index, 0
                progress.reset(task, total=len(schedule[round_index]))
            state["in_round"] += 1
            progress.update(task, advance=1, description=f"round {round_index + 1}/{len(schedule)} {pc.cell.label}")
            now = time.monotonic()
            took, state["last"] = now - state["last"], now
            if plain:
                verdict = "ERROR" if outcome.error else cell_verdict(pc.contract, outcome.observation,
                                                                     pc.cell.executor).value
                print(f"[stress] round {round_index + 1}/{len(schedule)}, {state['in_round']}/"
                      f"{len(schedule[round_index])} cells, {now - start:.1f} s, {pc.cell.label}: {verdict} "
                      f"({took:.2f} s)", file=sys.stderr, flush=True)

        return running.execute(planned, c, layout, params, on_cell_done=done, deadline=deadline, memory=memory)


def _dump_traces(planned, folder: Path) -> int:
    """Write each planned cell's trace (once per scenario, direction, order and host memory kind)
    into ``folder``; return how many."""
    folder.mkdir(parents=True, exist_ok=True)
    seen = set()
    for pc in planned:
        key = (pc.cell.scenario, pc.cell.direction, pc.cell.order, pc.cell.host_memory)
        if key not in seen:
            seen.add(key)
            (folder / ("_".join(key) + ".json")).write_text(json.dumps(pc.trace, indent=1) + "\n")
    return len(seen)
