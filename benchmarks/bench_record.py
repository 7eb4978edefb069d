"""What ``kvverify record`` costs: an engine-style offload loop run with and without the recorder, and
how long its trace takes to write and to check.

    python benchmarks/bench_record.py                    # 32 layers, 16 transfers in flight, both loads
    python benchmarks/bench_record.py --steps 50 --json out/bench-record.json
    python benchmarks/bench_record.py --host-only        # no GPU: the recorder's cost per op on the host

The loop is the recorder's demo offload handler in its safe form (``kvverify.record.demo``): per step,
every layer's KV is written, zero-filled and attended on the compute stream; one store and two loads
(one batched swap each, over all layers) go out on a pool of streams, chained by end events, at
most ``--in-flight`` pending, completion found by polling ``Event.query()``. Two compute loads:
``light`` (the demo's own kernels only: a few microseconds each, so the loop is bound by the host
launching them, the recorder's worst case) and ``model`` (a ``tokens x hidden`` by ``hidden x
hidden`` fp16 matmul per layer too, as a forward pass has). Runs alternate unrecorded and recorded;
medians are printed. Needs a CUDA device and ``kvverify._C``. Not a test: it prints the figures
(the target is at most 2x, docs/record.md).

``--host-only`` needs no GPU: it times ``layer[0:8].fill_(1)`` (a view and an in-place op) over 32
small CPU tensors that a stand-in platform calls device memory, plain, under a dispatch mode that
only calls the op (the floor any dispatcher hook pays), and recorded: the recorder's own cost per
op on this host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_once(shape, recorded: bool):
    """Wall seconds of one loop (allocation outside the timing), and the recording if any."""
    from kvverify.record import demo, recording

    engine = demo.Engine(shape)
    if not recorded:
        start = time.perf_counter()
        engine.run()
        return time.perf_counter() - start, None
    rec = recording()
    start = time.perf_counter()
    with rec:
        engine.run()
    return time.perf_counter() - start, rec


def host_overhead(repeats: int = 5, steps: int = 200) -> dict:
    """Microseconds per ``layer[0:8].fill_(1)`` plain, under a pass-through dispatch mode, and recorded."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvverify.record import recording
    from kvverify.record.dispatch import Platform

    class HostAsDevice(Platform):
        def where(self, t):
            return "device" if t.is_cpu else None

        def stream_key(self, t):
            return 0x1000

        def is_pinned(self, t):
            return False

        def install(self, recorder, guard):
            pass

        def uninstall(self):
            pass

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    layers = [torch.zeros(96, 16, dtype=torch.uint8) for _ in range(32)]

    def per_op() -> float:
        for _ in range(steps // 10):  # warm-up (the first dispatch imports torch._dynamo)
            for layer in layers:
                layer[0:8].fill_(1)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                for layer in layers:
                    layer[0:8].fill_(1)
            best = min(best, (time.perf_counter() - start) / steps / len(layers) * 1e6)
        return best

    plain = per_op()
    with PassThrough():
        mode = per_op()
    with recording(platform=HostAsDevice()):
        recorded = per_op()
    return {"plain_us": plain, "pass_through_mode_us": mode, "recorded_us": recorded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--blocks-per-transfer", type=int, default=8)
    parser.add_argument("--block-bytes", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=8192, help="the model load's matmul width")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--host-only", action="store_true", help="only the recorder's cost per op on the host")
    args = parser.parse_args(argv)

    if args.host_only:
        r = host_overhead()
        print(f"host: layer[0:8].fill_(1) takes {r['plain_us']:.1f} us plain, {r['pass_through_mode_us']:.1f} us under "
              f"a pass-through dispatch mode, {r['recorded_us']:.1f} us recorded (best of 5 x 200 x 32)")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
        return 0
    from kvverify.device import extension

    reason = extension.gpu_refusal()
    if reason:
        print(f"bench_record: {reason}", file=sys.stderr)
        return 2
    from kvverify.check import check
    from kvverify.record import demo

    n = args.blocks_per_transfer
    common = dict(layers=args.layers, in_flight=args.in_flight, blocks_per_transfer=n, block_bytes=args.block_bytes,
                  gpu_blocks=12 * n, cpu_blocks=8 * n, steps=args.steps)
    loads = {"light": demo.Shape(**common), "model": demo.Shape(**common, hidden=args.hidden, tokens=args.tokens)}
    results = {}
    for name, shape in loads.items():
        warm = demo.Shape(**{**common, "steps": 3, "hidden": shape.hidden, "tokens": shape.tokens})
        run_once(warm, False)
        run_once(warm, True)  # the first recorded op imports torch._dynamo (seconds): not the recorder's cost
        plain, recorded = [], []
        rec = None
        for _ in range(args.repeats):
            plain.append(run_once(shape, False)[0])
            seconds, rec = run_once(shape, True)
            recorded.append(seconds)
        start = time.perf_counter()
        doc = rec.trace()
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        verdict = check(doc)
        check_s = time.perf_counter() - start
        summary = rec.summary()
        copies = sum(len(op["copies"]) for op in doc["ops"] if op["op"] == "copy_batch")
        row = {
            "load": name, "steps": shape.steps, "layers": shape.layers, "in_flight": shape.in_flight,
            "unrecorded_ms_per_step": 1e3 * statistics.median(plain) / shape.steps,
            "recorded_ms_per_step": 1e3 * statistics.median(recorded) / shape.steps,
            "ratio": statistics.median(recorded) / statistics.median(plain),
            "ops_recorded": summary.ops_recorded, "ops_written": summary.ops_written, "copies_written": copies,
            "trace_build_s": build_s, "check_s": check_s, "verdict": verdict.verdict,
        }
        results[name] = row
        print(f"{name:5s}: {row['unrecorded_ms_per_step']:.2f} ms/step unrecorded, {row['recorded_ms_per_step']:.2f} "
              f"ms/step recorded ({row['ratio']:.2f}x); {row['ops_recorded']} ops recorded, {row['ops_written']} "
              f"written ({copies} copies); trace built in {build_s:.2f} s, checked in {check_s:.2f} s: "
              f"{verdict.verdict}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
