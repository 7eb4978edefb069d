"""What ``kvverify record`` costs as a run grows: an offload-style loop at 10^5, 10^6 and 10^7
recorded ops, plain and recorded, one run each.

    python benchmarks/bench_record_scale.py                       # 1e5 and 1e6 ops, both loads
    python benchmarks/bench_record_scale.py --ops 1e5 1e6 1e7 --json out/scale.json
    python benchmarks/bench_record_scale.py --load loop --ops 2e4 # a quick look

The loop (issue 37's): per step, compute writes a page (a kernel on the current stream), records an
event, a side stream waits on it and stores the page to pinned host memory (a D2H copy), and the
host synchronizes every 64 steps: about 5 recorded ops a step. ``model`` adds a ``tokens x hidden``
by ``hidden x hidden`` fp16 matmul a step, as a forward pass has. Each size runs in a child process
of its own, plain and then under ``kvverify record -o TRACE``; the child times every step and writes
the times down, and this process prints, for each size and load:

- the median per-step cost in each tenth (decile) of the run, plain and recorded, and their ratio
  (the target: at most 1.5x in every decile);
- peak resident memory of the run's process (its rusage at exit: the recorder runs in it, so its
  stop and check count), plain and recorded, and the difference (the target: at most 2 GB);
- the time from the program's last step to the verdict (the recorded run's wall time after its
  loop ended; the target: within 60 s), the verdict's line, and the trace's size on disk;
- the host's speed before each run (``host_speed_ms``: a shared host's cores change speed).

Needs a CUDA device and ``kvverify._C``. Not a test: it prints the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_record import host_speed_ms  # noqa: E402

OPS_PER_STEP = 5  # the kernel, the event's record, the wait, the copy, and a sixty-fourth of a sync

# The program each run executes (plain, or under `kvverify record`): argv[1] steps, argv[2] load,
# argv[3] where the step times (ns, one per line) go; the loop's end time is the file's last line,
# so that the time to the verdict is measured from the loop's end, not from exit.
PROGRAM = r"""
import sys, time, torch
steps, load, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
page = torch.empty(1 << 16, device="cuda")
host = torch.empty(1 << 16, pin_memory=True)
side = torch.cuda.Stream()
done = torch.cuda.Event()
if load == "model":
    a = torch.randn(512, 4096, device="cuda", dtype=torch.half)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
times = []
clock = time.perf_counter_ns
for step in range(steps):
    t0 = clock()
    if load == "model":
        torch.mm(a, w)
    page.fill_(step)
    done.record()
    side.wait_event(done)
    with torch.cuda.stream(side):
        host.copy_(page, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    if step % 64 == 63:
        torch.cuda.synchronize()
    times.append(clock() - t0)
torch.cuda.synchronize()
end = time.time()
with open(out, "w") as f:
    f.write("\n".join(map(str, times)))
    f.write(f"\nend {end!r}\n")
"""


def read_run(path: Path) -> tuple[list[int], float]:
    """``(per-step ns, the loop's end as time.time())`` a run's child wrote."""
    lines = path.read_text().splitlines()
    end = float(next(line for line in lines if line.startswith("end ")).split()[1])
    return [int(line) for line in lines if line and line[0].isdigit()], end


def deciles(times: list[int]) -> list[float]:
    """The median step time (us) of each tenth of the run, in order."""
    n = len(times)
    return [statistics.median(times[k * n // 10:max((k + 1) * n // 10, k * n // 10 + 1)]) / 1e3 for k in range(10)]


def run(steps: int, load: str, recorded: bool, folder: Path) -> dict:
    """One run of the loop in a child process; its figures."""
    program = folder / "loop.py"
    program.write_text(PROGRAM)
    out = folder / f"{load}-{steps}-{'rec' if recorded else 'plain'}.times"
    trace = folder / f"{load}-{steps}.trace.json"
    cmd = [sys.executable, str(program), str(steps), load, str(out)]
    if recorded:
        cmd = [sys.executable, "-m", "kvverify", "record", "-o", str(trace), "--"] + cmd
    speed = host_speed_ms()
    start = time.time()
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (kB on Linux)
        finished = time.time()
        code = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        text = stdout.read()
    if not out.exists():
        raise SystemExit(f"bench_record_scale: the {'recorded' if recorded else 'plain'} run of {steps} steps "
                         f"({load}) wrote no step times (exit {code}):\n{text[-2000:]}")
    times, end = read_run(out)
    figures = {"steps": steps, "load": load, "recorded": recorded, "host_speed_ms": round(speed, 2),
               "wall_s": round(finished - start, 2), "exit": code, "rss_mb": usage.ru_maxrss // 1024,
               "deciles_us": [round(d, 2) for d in deciles(times)]}
    if recorded:
        lines = [line for line in text.splitlines() if line.strip()]
        figures.update(verdict_after_s=round(finished - end, 2), trace_bytes=trace.stat().st_size if trace.exists() else 0,
                       verdict=next((line for line in lines if line.split()[0] in ("SAFE", "RACY", "NOT")), lines[-1] if lines else ""))
        trace.unlink(missing_ok=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", type=float, default=[1e5, 1e6], metavar="N",
                        help="recorded ops per run (about %d a step; default 1e5 1e6)" % OPS_PER_STEP)
    parser.add_argument("--load", choices=("loop", "model", "both"), default="both")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures here too")
    args = parser.parse_args(argv)
    loads = ("loop", "model") if args.load == "both" else (args.load,)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvverify-scale-") as tmp:
        for ops in args.ops:
            steps = int(ops) // OPS_PER_STEP
            for load in loads:
                plain = run(steps, load, False, Path(tmp))
                rec = run(steps, load, True, Path(tmp))
                ratio = [round(r / p, 2) if p else None for r, p in zip(rec["deciles_us"], plain["deciles_us"])]
                results.append({"plain": plain, "recorded": rec, "decile_ratio": ratio})
                print(f"{load}, {steps:,} steps (~{int(ops):,} ops), host {plain['host_speed_ms']} / "
                      f"{rec['host_speed_ms']} ms:")
                print(f"  per step by decile, us: plain {plain['deciles_us']}")
                print(f"                          recorded {rec['deciles_us']}")
                print(f"  ratio by decile: {ratio} (worst {max(r for r in ratio if r is not None)}x)")
                print(f"  peak RSS: {plain['rss_mb']} -> {rec['rss_mb']} MB (+{rec['rss_mb'] - plain['rss_mb']} MB); "
                      f"wall {plain['wall_s']} -> {rec['wall_s']} s")
                print(f"  verdict {rec['verdict_after_s']} s after the loop's end: {rec['verdict']} "
                      f"(exit {rec['exit']}); trace {rec['trace_bytes']:,} bytes", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"host": os.uname().nodename, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
