"""What NVTX annotation costs a kvverify run: ns per range, and its share of a smoke run.

Measures, per kind of range (run, cell, trial, phase), the cost of one ``with`` block
(push on enter, pop on exit) in a fresh process for each mode:

- ``no-tool``: annotation on (the default), no NVTX tool attached: what users pay;
- ``off``: ``--no-nvtx`` (``annotate.configure(False)``);
- ``recorder``: the test recorder attached through ``NVTX_INJECTION64_PATH`` (a tool that
  writes every event to a file; shows the cost when a tool listens, for reference).

Then estimates the share of a smoke run: ranges per run x cost / run time, where a run
has 1 run range, C cell ranges, C x T trial ranges and 3 x C x T phase ranges. Give
``--cells``, ``--trials`` and ``--run-seconds`` of the smoke run, or ``--report`` (a
``kvverify stress --json`` report: cells run, their trials and seconds), or ``--smoke-cmd`` to
time ``kvverify stress`` itself, with and without ``--no-nvtx``.

    python benchmarks/bench_nvtx_overhead.py
    python benchmarks/bench_nvtx_overhead.py --cells 324 --trials 3 --run-seconds 90
    python benchmarks/bench_nvtx_overhead.py --report out/stress.json
    python benchmarks/bench_nvtx_overhead.py --smoke-cmd "kvverify stress --campaign smoke --trials 1"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("run", "cell", "trial", "phase")


def _time_kind(annotate, kind: str, n: int) -> float:
    """ns per `with` block of one kind, best of 5 rounds of n blocks."""
    run_range, cell_range = annotate.run_range, annotate.cell_range
    trial_range, phase_range = annotate.trial_range, annotate.phase_range
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        if kind == "run":
            for _ in range(n):
                with run_range("kvverify stress smoke"):
                    pass
        elif kind == "cell":
            for _ in range(n):
                with cell_range("H1 store/D2H/ANY/pinned/adversarial", "store"):
                    pass
        elif kind == "trial":
            for i in range(n):
                with trial_range(i):
                    pass
        else:
            for _ in range(n):
                with phase_range("swap"):
                    pass
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def _time_empty(n: int) -> float:
    """ns per iteration of the same loop with no range (subtracted from the figures)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for i in range(n):
            pass
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def child(mode: str, n: int) -> dict:
    """Runs in a fresh process: measure every kind of range in one mode, as JSON."""
    sys.path.insert(0, str(REPO))
    from kvverify import annotate

    annotate.configure(mode != "off")
    # Inside a cell, as a real run is (trial and phase ranges inherit its category).
    empty = _time_empty(n)
    with annotate.run_range("kvverify bench"), annotate.cell_range("bench cell", "store"):
        per_kind = {kind: max(0.0, _time_kind(annotate, kind, n) - empty) for kind in KINDS}
    return {"mode": mode, "state": annotate.state(), "ns": per_kind}


def measure(mode: str, n: int, recorder: Path | None = None, work: Path | None = None) -> dict:
    env = dict(os.environ)
    env.pop("NVTX_INJECTION64_PATH", None)
    if mode == "recorder":
        env["NVTX_INJECTION64_PATH"] = str(recorder)
        env["KVVERIFY_NVTX_LOG"] = str(work / "recorder.jsonl")
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--n", str(n)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def build_recorder(work: Path) -> Path | None:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import nvtx_support

        return nvtx_support.build_injection_library(work)
    except Exception as exc:  # no compiler / headers: skip that mode
        print(f"(recorder mode skipped: {exc})")
        return None


def time_smoke(cmd: str, repeats: int, report: Path) -> tuple[float, float]:
    """Median wall seconds of ``cmd`` with annotation on (no tool) and with ``--no-nvtx``; the
    last annotated run writes its JSON report to ``report``."""
    on, off = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for args, sink in ((shlex.split(cmd) + ["--json", str(report)], on), (shlex.split(cmd) + ["--no-nvtx"], off)):
            t0 = time.perf_counter()
            subprocess.run(args, check=False, capture_output=True)
            sink.append(time.perf_counter() - t0)
    return statistics.median(on), statistics.median(off)


def ranges_in(report: Path) -> tuple[int, int, float]:
    """(cells run, trials run, seconds in cells) of a ``kvverify stress --json`` report."""
    ran = [c["observed"] for c in json.loads(report.read_text())["cells"] if c["observed"]]
    return len(ran), sum(o["trials"] for o in ran), sum(o["elapsed_s"] for o in ran)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=200_000, help="ranges per timing round (default 200000)")
    # Defaults: stress/smoke.toml: 18 (scenario, direction) pairs x 3 orders x 3 host memory
    # kinds x 2 executors = 324 cells, at least 3 trials each, "under 90 s on one H200".
    p.add_argument("--cells", type=int, default=324, help="cells in the smoke run (default 324)")
    p.add_argument("--trials", type=int, default=3, help="trials per cell (default 3)")
    p.add_argument("--report", help="a `kvverify stress --json` report: take cells, trials and run seconds from it")
    p.add_argument("--run-seconds", type=float, default=None,
                   help="wall time of a smoke run without annotation (default: from --smoke-cmd, else 90)")
    p.add_argument("--smoke-cmd", help="time this command with and without --no-nvtx (and count its ranges)")
    p.add_argument("--repeats", type=int, default=5, help="--smoke-cmd repeats (default 5)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)

    if args.child:
        print(json.dumps(child(args.child, args.n)))
        return 0

    # the recorder library and the smoke's report live only as long as the run
    with tempfile.TemporaryDirectory(prefix="kvverify-nvtx-") as work:
        return _measure_and_report(args, Path(work))


def _measure_and_report(args, work: Path) -> int:
    recorder = build_recorder(work)
    results = [measure("no-tool", args.n), measure("off", args.n)]
    if recorder is not None:
        results.append(measure("recorder", max(1000, args.n // 20), recorder, work))

    print(f"ns per range (one `with` block: push + pop), best of 5 x {args.n}, empty loop subtracted")
    print(f"{'mode':10} " + " ".join(f"{k:>9}" for k in KINDS) + "   state")
    for r in results:
        print(f"{r['mode']:10} " + " ".join(f"{r['ns'][k]:9.0f}" for k in KINDS) + f"   {r['state']}")

    measured, report = None, Path(args.report) if args.report else None
    if args.smoke_cmd:
        report = work / "stress.json"
        measured = time_smoke(args.smoke_cmd, args.repeats, report)
    cells, trials, report_seconds = args.cells, args.cells * args.trials, None
    if report is not None:
        cells, trials, report_seconds = ranges_in(report)
    counts = {"run": 1, "cell": cells, "trial": trials, "phase": 3 * trials}
    run_seconds = args.run_seconds or (measured[1] if measured else report_seconds or 90.0)
    total_ranges = sum(counts.values())
    print(f"\nsmoke run: {cells} cells, {trials} trials -> {total_ranges} ranges "
          f"({counts['phase']} phases), run time {run_seconds:.3f} s")
    summary = {"ranges": counts, "run_seconds": run_seconds, "modes": {}}
    for r in results:
        cost_s = sum(counts[k] * r["ns"][k] for k in KINDS) * 1e-9
        share = 100.0 * cost_s / run_seconds
        summary["modes"][r["mode"]] = {"ns_per_range": r["ns"], "cost_seconds": cost_s, "share_percent": share}
        print(f"  {r['mode']:10} {cost_s * 1e3:9.3f} ms = {share:.5f} % of the run")
    if measured:
        on, off = measured
        delta = 100.0 * (on - off) / off
        summary["measured"] = {"on_seconds": on, "off_seconds": off, "delta_percent": delta}
        print(f"  measured: median {on:.3f} s annotated vs {off:.3f} s with --no-nvtx "
              f"({delta:+.2f} %, within run-to-run noise unless well above 1 %)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
