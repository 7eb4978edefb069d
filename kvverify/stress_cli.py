"""``kvverify stress``: run a campaign of cells on the GPU and print one verdict per cell.

Exit status: 0 when every cell passed (or there is no CUDA device: contract verdicts
only); 1 when a cell is UNEXPECTED_CORRUPTION or SENSITIVITY_FAILURE, or a cell could not
be run; 2 when the run could not start (bad options, campaign or model config, memory
that does not fit), with the reason on stderr.

Campaign files live in the repository's ``stress/`` folder; options given here override
the campaign's values.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

from kvverify import annotate
from kvverify.campaign import DATA_MODES, EXECUTORS, ORDERS, CampaignError
from kvverify.sizes import size_arg

HOST_KINDS = ("pinned", "registered", "pageable")


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or 'nothing'} not in {','.join(allowed)}")
        return values

    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    a = parser.add_argument
    a("--campaign", default="smoke", metavar="NAME|PATH", help="campaign name in stress/ or a .toml path (default: smoke)")
    a("--model", metavar="PRESET", help="model preset (e.g. llama-3.1-8b, qwen2.5-7b); overrides the campaign's models")
    a("--model-config", metavar="PATH", help="a Hugging Face config.json (or its directory) instead of a preset")
    a("--block-size", type=_positive, metavar="TOKENS", help="tokens per KV page")
    a("--tp", type=_positive, help="tensor-parallel ranks (KV heads per rank)")
    a("--trials", type=_positive, help="at least this many trials per cell")
    a("--seed", type=int, help="block pattern seed")
    a("--gpu-mem", type=size_arg, metavar="SIZE", help="cap on device memory, e.g. 8GiB")
    a("--host-mem", type=size_arg, metavar="SIZE", help="cap on host memory, e.g. 6GiB")
    a("--host-memory", type=_choices(HOST_KINDS), metavar="KINDS", help="comma list of pinned,registered,pageable")
    a("--orders", type=_choices(ORDERS), metavar="ORDERS", help="comma list of STREAM,DURING_API_CALL,ANY")
    a("--scenarios", type=_names, metavar="NAMES", help="comma list of scenarios (H1-broken, P2) or hazards (H3)")
    a("--executors", type=_choices(EXECUTORS), metavar="NAMES", help="comma list of native,adversarial")
    a("--blocks-per-transfer", type=_positive, metavar="N", help="KV blocks per batched swap")
    a("--transfers", type=_positive, metavar="N", help="transfers in flight (2..32)")
    a("--writer-delay-us", type=int, metavar="US", help="spin before each compute write")
    a("--data", choices=DATA_MODES, help="block contents: the generation pattern (default) or random bytes with checksums")
    a("--json", metavar="PATH", help="write the report as JSON (kvverify/schemas/stress-report-v1.json)")
    a("--junit", metavar="PATH", help="write JUnit XML, one testcase per cell")
    a("--dump-traces", metavar="DIR", help="write each cell's trace, for `kvverify check`")
    a("--no-gpu", action="store_true", help="contract verdicts only, even where a CUDA device is present")
    annotate.add_cli_option(parser)


class _StartError(Exception):
    """The run cannot start; the message is the reason."""


def _campaign(args):
    from kvverify import campaign as campaigns

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
        geometries = [geometry.from_hf_config(args.model_config)]
    else:
        geometries = [geometry.preset(m) for m in c.models]
    return [geometry.KVLayout(g, block_size=c.block_size, tp=c.tp) for g in geometries]


def _gpu_unavailable() -> str | None:
    """Why the observed columns cannot run here (short: it is printed in one line), or None."""
    from kvverify import _extension

    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if _extension.load_error() is not None:
        return "the CUDA extension kvverify._C is not built (pip install --no-build-isolation --no-deps -e .)"
    return None


def _platform(gpu: bool):
    """The report's Platform, from ``kvverify.platform_info`` (fields it cannot read: None)."""
    from kvverify import platform_info
    from kvverify.report import Platform

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


def run(args) -> int:
    from rich.console import Console

    console = Console()
    err = Console(stderr=True)
    try:
        c = _campaign(args)
        if c.data == "random" and "adversarial" in c.executors:
            raise _StartError("--data random checks by checksums and runs with the native executor only; "
                              "add --executors native")
        layouts = _layouts(args, c)
    except (CampaignError, ValueError, _StartError) as exc:
        err.print(f"kvverify stress: cannot start: {exc}", markup=False, highlight=False)
        return 2

    # SIGTERM ends a run like Ctrl-C, so the finally blocks free pinned and device memory.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        status = 0
        for layout in layouts:
            status = max(status, _run_one(args, c, layout, console, err, several=len(layouts) > 1))
            if status == 2:
                break
        return status
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _run_one(args, c, layout, console, err, several: bool) -> int:
    from kvverify import runner
    from kvverify.report import CellResult, StressReport

    try:
        params, note = runner.fit_params(c, layout)
        planned = runner.plan(c, layout, params)
    except (CampaignError, ValueError) as exc:
        err.print(f"kvverify stress: cannot start: {exc}", markup=False, highlight=False)
        return 2
    if note:
        err.print(f"kvverify stress: {note}", markup=False, highlight=False)
    if args.dump_traces:
        _dump_traces(planned, Path(args.dump_traces))
    reason = "--no-gpu was given" if args.no_gpu else _gpu_unavailable()
    outcomes: dict = {}
    with annotate.run_range(f"kvverify stress {c.name} {layout.geometry.name}"):
        if reason is None:
            outcomes = _execute_with_progress(planned, c, layout, params, console)
    errors = [o.error for o in outcomes.values() if o.error]
    results = [
        CellResult(pc.cell, pc.contract, pc.witness, outcomes[pc.cell].observation if pc.cell in outcomes else None)
        for pc in planned
    ]
    report = StressReport(
        platform=_platform(reason is None), campaign=c.name, seed=c.seed, cells=tuple(results),
        layout=layout.describe(), not_run_reason=reason,
    )
    report.render_table(console)
    if outcomes:
        console.print(_throughput_line(outcomes), markup=False, highlight=False)
    for e in errors:
        err.print(f"kvverify stress: cell not run: {e}", markup=False, highlight=False)
    if args.json:
        report.write_json(_output_path(args.json, layout.geometry.name, several))
    if args.junit:
        report.write_junit(_output_path(args.junit, layout.geometry.name, several))
    return max(report.exit_status(), 1 if errors else 0)


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


def _execute_with_progress(planned, c, layout, params, console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvverify import runner

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"stress {c.name}", total=len(planned))

        def done(pc, outcome):
            progress.update(task, advance=1, description=pc.cell.label)

        return runner.execute(planned, c, layout, params, on_cell_done=done)


def _dump_traces(planned, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    seen = set()
    for pc in planned:
        key = (pc.cell.scenario, pc.cell.direction, pc.cell.order, pc.cell.host_memory)
        if key not in seen:
            seen.add(key)
            (folder / ("_".join(key) + ".json")).write_text(json.dumps(pc.trace, indent=1) + "\n")
