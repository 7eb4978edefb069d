"""What ``kvverify record`` costs: an engine-style offload loop run with and without the recorder, and
how long its trace takes to write and to check.

    python benchmarks/bench_record.py                    # 32 layers, 16 transfers in flight, both loads
    python benchmarks/bench_record.py --steps 50 --json out/bench-record.json
    python benchmarks/bench_record.py --host-only        # no GPU: the recorder's cost per op on the host
    python benchmarks/bench_record.py --repeats 1 --steps 30 --profile 25   # and where the recorded time goes

The loop is the recorder's demo offload handler in its safe form (``kvverify.record.demo``): per step,
every layer's KV is written, zero-filled and attended on the compute stream; one store and two loads
(one batched swap each, over all layers) go out on a pool of streams, chained by end events, at
most ``--in-flight`` pending, completion found by polling ``Event.query()``. Two compute loads:
``light`` (the demo's own kernels only: a few microseconds each, so the loop is bound by the host
launching them, the recorder's worst case) and ``model`` (a ``tokens x hidden`` by ``hidden x
hidden`` fp16 matmul per layer too, as a forward pass has). Each repeat runs the loop plain, under a
pass-through dispatch mode (what any ``__torch_dispatch__`` hook costs: the floor of a recorder
built on one), recorded (the op log: each op written down in C++, logged at the recording's stop),
recorded without native capture, and recorded by the dispatch mode as each op runs
(``op_log=False``), in turn; the loop is timed, the recording's start and stop are not (the stop's
time is printed); medians and bests are printed, and each repeat's plain and recorded runs with the
host's speed before each (``host_speed_ms``: a shared host's cores change speed from run to run) and
where their steps' time went; ``--csan`` then runs each load under PyTorch's CUDA Stream Sanitizer.
Needs a CUDA device and ``kvverify._C``. Not a test: it prints the figures (the target is at most
1.5x; docs/record-design.md has the figures).

``--host-only`` needs no GPU: it times ``layer[0:8].fill_(1)`` (a view and an in-place op) over 32
small CPU tensors that a stand-in platform calls device memory, plain, under a dispatch mode that
only calls the op (the floor any dispatcher hook pays), and recorded: the recorder's own cost per
op on this host.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@functools.cache
def pass_through_mode() -> type:
    """A dispatch mode class that only calls each op: what any ``__torch_dispatch__`` hook costs
    (defined on first use, so that the module imports without torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return PassThrough


LOOP = dict(layers=32, in_flight=16, blocks_per_transfer=8, block_bytes=16 << 10, steps=100, hidden=8192, tokens=512)
"""The engine-style loop's defaults (the issue's: 32 layers, 16 transfers in flight); each is an option too."""


def engine_shapes(**overrides) -> dict:
    """The two compute loads of the engine-style loop (``LOOP``, with ``overrides``), as
    ``kvverify.record.demo.Shape``: ``light`` and ``model`` (a ``tokens x hidden`` fp16 matmul
    per layer too)."""
    from kvverify.record import demo

    loop = LOOP | overrides
    n = loop["blocks_per_transfer"]
    common = dict(layers=loop["layers"], in_flight=loop["in_flight"], blocks_per_transfer=n,
                  block_bytes=loop["block_bytes"], gpu_blocks=12 * n, cpu_blocks=8 * n, steps=loop["steps"])
    return {"light": demo.Shape(**common), "model": demo.Shape(**common, hidden=loop["hidden"], tokens=loop["tokens"])}


def kernel_only(doc: dict) -> int:
    """The kernels of a written trace whose every range lies in buffers that only kernels touch (of
    two streams or more: a trace writes no other such buffer): what writing kernels of several
    streams adds to a trace that wrote only buffers a copy or the host touches."""
    touched = {r[0] for op in doc["ops"] if op["op"] != "kernel"
               for r in (op.get("ranges", []) + [op[k] for k in ("src", "dst") if k in op]
                         + [c[k] for c in op.get("copies", []) for k in ("src", "dst")])}
    return sum(1 for op in doc["ops"] if op["op"] == "kernel" and op["reads"] + op["writes"]
               and not {r[0] for r in op["reads"] + op["writes"]} & touched)


def host_speed_ms() -> float:
    """Wall ms of a fixed pure-Python loop (summing 200,000 ints) on the calling thread: the host's
    speed just before a run. On a shared host (a VM whose cores the machine under it shares out), a
    core's speed changes from run to run; a run slower than its peers with a slower figure here was
    slowed by the host, not by what it ran. It is a sample before the run, not a guarantee over it."""
    start, total = time.perf_counter(), 0
    for i in range(200_000):
        total += i
    return 1e3 * (time.perf_counter() - start)


def time_loop(shape, context, after: list | None = None, steps: list | None = None, cuda=None) -> float:
    """Wall seconds of one run of the demo's loop of ``shape`` inside ``context`` (allocation
    outside the timing, and the context's entry and exit too: a recording's stop, where its op log
    is logged, is appended to ``after`` where given). ``steps``: gets, per step, a tuple of
    ``STEP_PARTS`` and the CPU the step ended on. ``cuda``: the demo's device (default: the current
    CUDA device; the tests pass the CPU stand-in)."""
    import gc

    from kvverify.record import demo

    engine = demo.Engine(shape, cuda=cuda)
    if steps is not None:
        import resource

        step, wait, stage, spent = engine.step, engine.handler.wait, engine._stage_descriptor, [0.0, 0.0]

        def timed(call, part: int):
            def run(*args) -> None:
                start = time.perf_counter()
                call(*args)
                spent[part] += time.perf_counter() - start
            return run

        def timed_step(k: int) -> None:
            spent[:] = [0.0, 0.0]
            before = resource.getrusage(resource.RUSAGE_THREAD)
            start, cpu = time.perf_counter(), time.thread_time()
            step(k)
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            after = resource.getrusage(resource.RUSAGE_THREAD)
            steps.append((wall, cpu, *spent, after.ru_minflt - before.ru_minflt, after.ru_nivcsw - before.ru_nivcsw,
                          int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])))

        engine.step, engine.handler.wait, engine._stage_descriptor = timed_step, timed(wait, 0), timed(stage, 1)
    # what an earlier run left for the cycle collector (a recording by the dispatch mode leaves a
    # heap of it) is collected here, not in this run's loop
    gc.collect()
    with context:
        start = time.perf_counter()
        engine.run()
        seconds = time.perf_counter() - start
        ended = time.perf_counter()
    if after is not None:
        after.append(time.perf_counter() - ended)
    return seconds


STEP_PARTS = ("wall", "thread_cpu", "polling", "staging", "minor_faults", "involuntary_switches")
"""What ``time_loop`` keeps of each step: its wall seconds, the loop thread's CPU seconds in it, the wall
seconds spent polling for finished transfers and staging the block ids (which synchronizes on the
previous step's copy: a wait for the device that spins, so it counts as CPU time), the thread's minor
page faults and involuntary context switches, and then the CPU it ended on."""


def step_parts(steps: list) -> dict:
    """Medians of each of ``STEP_PARTS`` over ``steps`` (``time_loop``), the times in ms; and
    ``cpus``, the CPUs the steps ended on."""
    parts = {part: (1e3 if k < 4 else 1) * statistics.median(t[k] for t in steps) for k, part in enumerate(STEP_PARTS)}
    return parts | {"cpus": sorted({t[len(STEP_PARTS)] for t in steps})}


def run_once(shape, how: str, after: list | None = None, steps: list | None = None):
    """Wall seconds of one loop, run ``how``: ``"plain"``, ``"mode"`` (under
    ``pass_through_mode``), ``"recorded"``, ``"dispatcher"`` (recorded without native capture) or
    ``"live"`` (recorded by the dispatch mode as each op runs: no op log); and the recording if
    any. ``after``: gets the seconds of the recording's stop; ``steps``: see ``time_loop``."""
    from kvverify.record import recording

    context = {"plain": contextlib.nullcontext, "mode": pass_through_mode(), "recorded": recording,
               "dispatcher": lambda: recording(native=False), "live": lambda: recording(op_log=False)}[how]()
    return time_loop(shape, context, after, steps), context if how == "recorded" else None


RUNS = ("plain", "mode", "recorded", "dispatcher", "live")
"""How each loop runs (``run_once``): the median of each, and the recorded / plain ratio, are printed."""


def csan_seconds(shape, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` loops under PyTorch's CUDA Stream Sanitizer
    (``torch.cuda._sanitizer``), which cannot be turned off again: call it after every other run."""
    import warnings

    import torch.cuda._sanitizer as csan

    csan.enable_cuda_sanitizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its reports are not what is measured here
        time_loop(dataclasses.replace(shape, steps=3), contextlib.nullcontext())
        return [time_loop(shape, contextlib.nullcontext()) for _ in range(repeats)]

# The host-only cases: what each does once (a fixture of tensors and ids is passed in), and how many
# times one call does it (the figures are per op, or per report).
HOST_CASES = {
    "fill": ("layer[0:8].fill_(1): a view, an in-place op", 1),
    "attend": ("torch.sum(layer[0:8], dim=(0, 1), dtype=int64, out=scores[0]): two views, an out= op", 1),
    "strided": ("layer[:, 0:4].zero_(): a strided view's covering span", 1),
    "copy": ("ids.copy_(descriptor, non_blocking=True): a host-to-device copy of pointers", 1),
    "swap": ("a batched swap of 256 pointers each way (sizes made by torch.full, as the demo)", 1),
    "event": ("the reports of one event as Stream.wait_stream makes it: create, record, wait", 3),
    "alloc": ("one caching-allocator block's two records (allocate, free), taken from the native log", 2),
}


def host_overhead(repeats: int = 5, steps: int = 200) -> dict:
    """CPU microseconds per op (per report for ``event`` and ``alloc``) of each of ``HOST_CASES``:
    plain, under a pass-through dispatch mode (the floor any dispatcher hook pays; None for the
    reports, which no dispatch mode sees), recorded (through the op log, as ``recording()`` records
    by default; None where ``kvverify._C`` is not built) and recorded live (by the dispatch mode as
    each op runs, ``op_log=False``). The recordings' stops, where the op log is logged, are not
    timed. No GPU: device memory is a CPU arena a stand-in platform calls device memory; the event
    reports go through the recorder's guard as the observed methods send them (into the op log, as
    marks, where it runs), and the allocator's rows through ``Recorder.collect``, after what the
    extension's native log holds, as they come from it on a GPU."""
    import itertools
    from collections import Counter

    import torch

    from kvverify.record import recording
    from kvverify.record.capture.hooks import CudaPlatform
    from kvverify.record.trace.recorder import NativeRecord

    arena = torch.zeros(5 << 20, dtype=torch.uint8)  # everything the stand-in calls device memory
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()

    def native_log():  # the extension's native log, which holds the op log; None where it is not built
        from kvverify.device import extension

        if extension.load_error() is not None:
            return None
        from kvverify.record.capture.native import NativeLog

        return NativeLog()

    class ArenaAsDevice(CudaPlatform):
        host_watch = None  # its device work runs at its call: nothing is ever pending, nothing to watch

        def __init__(self, log):
            super().__init__()
            self.log = log
            self.watch_off = None

        def where(self, t):
            return "device" if lo <= t.data_ptr() < hi else "host"

        def stream_key(self, t):
            return 0x1000

        def logged_stream_key(self, stream):
            return 0x1000

        def is_pinned(self, t):
            return True

        def allocator_blocks(self):  # the arena is one block of the caching allocator
            return [(lo, hi - lo)]

        def host_range(self, address):  # the host caches are pinned: CUDA knows them (cuPointerGetAttribute)
            for t in host_caches:
                if t.data_ptr() <= address < t.data_ptr() + t.numel():
                    return t.data_ptr(), t.numel(), "host_pinned"
            return None

        def install(self, recorder, guard, native=True):  # the observed C methods need CUDA: their reports are sent below
            self.capture_off = "a stand-in without a GPU"
            self.rows = []
            if self.log is not None:
                self.log.enable(True)
            recorder.pending = lambda: bool(self.rows) or (self.log is not None and self.log.pending())
            recorder.take = self.take
            self.collect = recorder.collect
            self.reports = [guard(getattr(recorder, name)) for name in ("event_created", "event_recorded",
                                                                           "event_waited")]

        def take(self, thread):
            rows, self.rows = self.rows, []
            return (self.log.take(thread) if self.log is not None else []) + rows

        def native_leftover(self):
            return self.log.leftover() if self.log is not None else Counter()

        def uninstall(self):
            if self.log is not None:
                self.log.enable(False)

    lib = torch.library.Library("kvbench", "DEF")
    lib.define("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int src_access_order=1) -> ()")
    lib.impl("swap_blocks_batch", lambda *args: None, "CompositeExplicitAutograd")
    swap = torch.ops.kvbench.swap_blocks_batch

    block = 1 << 14  # the layers' caches lie past the small tensors, from 1 MiB on
    layers = [arena[k * (96 << 4):(k + 1) * (96 << 4)].view(96, 16) for k in range(32)]
    gpu_caches = [arena[(1 << 20) + k * 8 * block:(1 << 20) + (k + 1) * 8 * block] for k in range(32)]
    host_caches = [torch.zeros(8 * block, dtype=torch.uint8) for _ in range(32)]
    offsets = torch.arange(8, dtype=torch.int64) * block
    gpu_ptrs = (torch.tensor([t.data_ptr() for t in gpu_caches])[:, None] + offsets).reshape(-1)
    host_ptrs = (torch.tensor([t.data_ptr() for t in host_caches])[:, None] + offsets).reshape(-1)
    scores = arena[-64:].view(torch.int64)
    ids, descriptor = scores[:4], torch.arange(4, dtype=torch.int64)
    handles = itertools.count(0x7000_0000, 0x100)

    platform: list = [None]  # the stand-in of the recording running now (None: plain)

    def event_cycle(_):
        if platform[0] is None:
            return
        created, recorded, waited = platform[0].reports
        h = next(handles)
        created(h)
        recorded(h, 0x5100)
        waited(h, 0x5200)

    def alloc_cycle(layer):
        if platform[0] is None:
            return
        platform[0].rows += [NativeRecord("alloc", [layer.data_ptr(), 0, 0, 0]),
                             NativeRecord("free", [layer.data_ptr(), 0, 0, 0])]
        platform[0].collect()

    cases = {
        "fill": lambda layer: layer[0:8].fill_(1),
        "attend": lambda layer: torch.sum(layer[0:8], dim=(0, 1), dtype=torch.int64, out=scores[0]),
        "strided": lambda layer: layer[:, 0:4].zero_(),
        "copy": lambda layer: ids.copy_(descriptor, non_blocking=True),
        "swap": lambda layer: swap(gpu_ptrs, host_ptrs, torch.full((256,), block, dtype=torch.int64), 1),
        "event": event_cycle,
        "alloc": alloc_cycle,
    }

    def per_op(case) -> float:
        run, (_, per_call) = cases[case], HOST_CASES[case]
        n = steps // 10 if case == "swap" else steps
        for _ in range(max(1, n // 10)):  # warm-up (the first dispatch imports torch._dynamo)
            for layer in layers:
                run(layer)
        start = time.process_time()  # CPU time: what the host spends, not the waits for a core on a busy one
        for _ in range(n):
            for layer in layers:
                run(layer)
        return (time.process_time() - start) / n / len(layers) / per_call * 1e6

    # no device here to say which one is current (reports of the default streams ask)
    saved = [(owner, name, getattr(owner, name)) for owner, name in ((torch.cuda, "current_device"),
                                                                      (torch._C, "_cuda_getDevice"))
             if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, lambda: 0)
    log = native_log()

    def recorded_per_op(case, op_log: bool) -> float:
        platform[0] = ArenaAsDevice(log)
        try:
            with recording(platform=platform[0], op_log=op_log):
                return per_op(case)
        finally:
            platform[0] = None

    try:
        out = {}
        for case in HOST_CASES:
            reports = case in ("event", "alloc")
            plain, mode, logged, live = [], [], [], []
            for _ in range(repeats):  # in turn: a busy host slows all of them alike
                plain.append(per_op(case))
                if not reports:
                    with pass_through_mode()():
                        mode.append(per_op(case))
                if log is not None:
                    logged.append(recorded_per_op(case, op_log=True))
                live.append(recorded_per_op(case, op_log=False))
            # the live recorder's own cost is over the dispatch mode it runs in; the op log's, over plain
            floor = min(plain) if reports else min(mode)
            out[case] = {"plain_us": min(plain), "pass_through_mode_us": None if reports else min(mode),
                         "recorded_us": min(logged) if logged else None,
                         "op_log_us": min(logged) - min(plain) if logged else None,
                         "recorded_live_us": min(live), "live_recorder_us": min(live) - floor}
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in LOOP.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value,
                            help="the model load's matmul width" if name == "hidden" else None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--host-only", action="store_true", help="only the recorder's cost per op on the host")
    parser.add_argument("--csan", action="store_true",
                        help="then each load under PyTorch's CUDA Stream Sanitizer (last: it stays on in the process)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then run each load recorded once more under cProfile and print the N functions with "
                             "the most own time (where the recorded time goes; cProfile slows every call)")
    args = parser.parse_args(argv)

    if args.host_only:
        r = host_overhead(repeats=args.repeats)
        print(f"host only, CPU us per op (per report for event, alloc), best of {args.repeats} runs of 200 x 32 "
              "(swap: 20 x 32), each recorded in a new recording (its stop not timed). recorded: through the op log "
              "(the default; +: minus plain); live: by the dispatch mode as each op runs (+: minus the pass-through "
              "mode, minus plain for reports)")
        print(f"{'case':8s} {'plain':>7s} {'mode':>7s} {'recorded':>9s} {'+':>6s} {'live':>7s} {'+':>6s}  what")

        def cell(value, width):
            return f"{'-' if value is None else f'{value:.1f}':>{width}s}"

        for case, row in r.items():
            print(f"{case:8s} {row['plain_us']:7.1f} {cell(row['pass_through_mode_us'], 7)} "
                  f"{cell(row['recorded_us'], 9)} {cell(row['op_log_us'], 6)} {row['recorded_live_us']:7.1f} "
                  f"{row['live_recorder_us']:6.1f}  {HOST_CASES[case][0]}")
        if r["fill"]["recorded_us"] is None:
            print("kvverify._C is not built here: no op log, the live recording only")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
        return 0
    from kvverify import device

    reason = device.gpu_refusal()
    if reason:
        print(f"bench_record: {reason}", file=sys.stderr)
        return 2
    from kvverify.check import check

    loads = engine_shapes(**{name: getattr(args, name) for name in LOOP})
    results = {}
    for name, shape in loads.items():
        warm = dataclasses.replace(shape, steps=3)
        for how in RUNS:
            run_once(warm, how)  # the first recorded op imports torch._dynamo (seconds): not the recorder's cost
        seconds = {how: [] for how in RUNS}
        stops: list[float] = []  # the recorded runs' stops: their op logs logged after the loop
        steps: dict[str, list] = {how: [] for how in RUNS}  # per run, its steps (time_loop)
        rec = None
        watch_stats: dict = {}
        host_ms: dict[str, list] = {how: [] for how in RUNS}  # host_speed_ms() before each run
        for _ in range(args.repeats):  # in turn: a busy host slows each of them alike
            for how in RUNS:
                steps[how].append([])
                host_ms[how].append(host_speed_ms())
                s, r = run_once(shape, how, stops if how == "recorded" else None, steps[how][-1])
                seconds[how].append(s)
                rec = r or rec
                if how == "recorded" and getattr(r._platform_in_use, "log", None) is not None:
                    watch_stats = r._platform_in_use.log.watch.stats()  # (the host watch's, of this run)
        start = time.perf_counter()
        doc = rec.trace()
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        verdict = check(doc)
        check_s = time.perf_counter() - start
        summary = rec.summary()
        copies = sum(len(op["copies"]) for op in doc["ops"] if op["op"] == "copy_batch")
        two_streams = kernel_only(doc)
        row = {
            "load": name, "steps": shape.steps, "layers": shape.layers, "in_flight": shape.in_flight,
            **{f"{how}_ms_per_step": 1e3 * statistics.median(seconds[how]) / shape.steps for how in RUNS},
            **{f"{how}_best_ms_per_step": 1e3 * min(seconds[how]) / shape.steps for how in RUNS},
            **{f"{how}_runs_ms_per_step": [1e3 * s / shape.steps for s in seconds[how]] for how in RUNS},
            # medians of each step's parts (STEP_PARTS) over every step of the runs, and of each run's
            # steps (a run slower than the others shows which of them grew)
            **{f"{how}_step_ms": step_parts([t for run in steps[how] for t in run]) for how in steps},
            **{f"{how}_runs_step_ms": [step_parts(run) for run in steps[how]] for how in steps},
            **{f"{how}_runs_host_speed_ms": host_ms[how] for how in RUNS},
            "ratio": statistics.median(seconds["recorded"]) / statistics.median(seconds["plain"]),
            "best_ratio": min(seconds["recorded"]) / min(seconds["plain"]),
            "mode_ratio": statistics.median(seconds["mode"]) / statistics.median(seconds["plain"]),
            "dispatcher_ratio": statistics.median(seconds["dispatcher"]) / statistics.median(seconds["plain"]),
            "live_ratio": statistics.median(seconds["live"]) / statistics.median(seconds["plain"]),
            "stop_s": statistics.median(stops),
            "ops_recorded": summary.ops_recorded, "ops_written": summary.ops_written, "copies_written": copies,
            "trace_build_s": build_s, "check_s": check_s, "verdict": verdict.verdict,
            "trace_bytes": len(json.dumps(doc)), "kernel_only_ops": two_streams, "notes": summary.notes,
            "watch_per_step": {what: (n / shape.steps, ms / shape.steps) for what, (n, ms) in watch_stats.items()},
        }
        results[name] = row
        print(f"{name:5s}: {row['plain_ms_per_step']:.2f} ms/step plain, {row['mode_ms_per_step']:.2f} under a "
              f"pass-through dispatch mode ({row['mode_ratio']:.2f}x), {row['recorded_ms_per_step']:.2f} recorded "
              f"({row['ratio']:.2f}x; without native capture {row['dispatcher_ms_per_step']:.2f}, "
              f"{row['dispatcher_ratio']:.2f}x; by the dispatch mode as each op runs {row['live_ms_per_step']:.2f}, "
              f"{row['live_ratio']:.2f}x; each recording's stop, where its op log is logged: {row['stop_s']:.2f} s; "
              f"best of {args.repeats}: {row['plain_best_ms_per_step']:.2f} / "
              f"{row['recorded_best_ms_per_step']:.2f}, {row['best_ratio']:.2f}x); {row['ops_recorded']} ops recorded, "
              f"{row['ops_written']} written ({copies} copies; {two_streams} kernels on buffers only kernels of two "
              f"streams touch), {row['trace_bytes']:,} bytes; trace built in {build_s:.2f} s, checked in "
              f"{check_s:.2f} s: {verdict.verdict}; {len(summary.notes)} summary notes", flush=True)
        for note in summary.notes:
            print(f"  {note}", flush=True)
        print(f"{name:5s}: the host watch per step (count, ms): " + ", ".join(
            f"{what} {n:.1f} / {ms:.3f}" for what, (n, ms) in row["watch_per_step"].items()), flush=True)
        # each repeat's runs, in the order they ran: a median hides a loop that is slow in some runs only;
        # the step's parts say whether a slow run waited (polling, staging), ran slower on the host (CPU
        # time alike to the wall time), faulted pages or lost its core
        def parts(t: dict) -> str:
            return (f"{t['wall']:.2f} = cpu {t['thread_cpu']:.2f}, poll {t['polling']:.2f}, stage {t['staging']:.2f}, "
                    f"{t['minor_faults']:.0f} faults, {t['involuntary_switches']:.0f} preempted, cpus {t['cpus']}")

        print(f"{name:5s}: each repeat, ms/step [the host's speed before it: host_speed_ms()] and the median step "
              "(wall = the loop thread's CPU, polling, staging the block ids; minor faults, involuntary switches; "
              "the CPUs it ended on):")
        for k in range(args.repeats):
            for how in ("plain", "recorded"):
                print(f"  {k + 1} {how:8s} {row[how + '_runs_ms_per_step'][k]:6.2f} [{host_ms[how][k]:5.2f}]: "
                      f"{parts(row[how + '_runs_step_ms'][k])}", flush=True)
        print(f"{name:5s}: a step, medians over every step, ms: " + "; ".join(
            f"{how} {parts(row[how + '_step_ms'])}" for how in ("plain", "recorded")), flush=True)
        if args.profile:
            profile_recorded(shape, name, args.profile)
    if args.csan:
        for name, shape in loads.items():
            row = results[name]
            row["csan_ms_per_step"] = 1e3 * statistics.median(csan_seconds(shape, args.repeats)) / shape.steps
            row["csan_ratio"] = row["csan_ms_per_step"] / row["plain_ms_per_step"]
            print(f"{name:5s}: {row['csan_ms_per_step']:.2f} ms/step under PyTorch's CUDA Stream Sanitizer "
                  f"({row['csan_ratio']:.2f}x plain)", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


def profile_recorded(shape, name: str, top: int) -> None:
    """One recorded loop of ``shape`` under cProfile; prints the ``top`` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_once(shape, "recorded")
    profiler.disable()
    print(f"{name}: one recorded loop under cProfile, the {top} functions with the most own time")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    raise SystemExit(main())
