"""How long ``kvverify check`` takes on serving-engine-like traces of 10,000 and 100,000 ops.

    python benchmarks/bench_checker.py            # 10k and 100k ops, both scenarios, safe and racy
    python benchmarks/bench_checker.py --ops 5000 --scenario layerwise --write /tmp/trace.json

Two scenarios. ``layerwise`` (layer-wise offloading, many streams and big batches) is described at
:func:`layerwise_trace`. ``serving`` is what an LLM serving engine with KV-cache offloading asks of
one GPU, step after step, over long-lived buffers:

- streams: ``compute``, ``store`` (GPU→CPU offload), ``load`` (CPU→GPU), ``io`` (inputs), and two
  side streams (``draft``, ``aux``) that follow compute through events;
- buffers: a paged GPU KV cache, a pinned CPU KV cache, activations, logits, token ids, a pageable
  staging buffer for inputs and a pinned one for outputs;
- each step: the host writes token ids into pageable staging and copies them up on ``io``;
  resumed requests load their CPU blocks into fresh GPU blocks with one ``copy_batch`` in ANY order
  (host sources, untouched until the load completes); ``compute`` waits on both events and runs a
  forward pass whose kernels read every active request's KV blocks and write the new token's
  slot; finished requests store their GPU blocks with one ``copy_batch`` in STREAM order behind
  ``store.wait_stream(compute)``; sampling copies logits to the host, which synchronizes on the
  step's event and reads them; the host polls older store events (``query_event``) and only then
  reuses their GPU blocks and loads from their CPU blocks.

Blocks are recycled through free lists, so every GPU and CPU block is touched thousands of times
over a 100k-op trace. Its racy variant swaps the stores to ANY order (hazard H1) every 50th step,
so the race-listing path is timed too. Not a test: it prints the times.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvverify.check import Trace, check

BLOCK = 16 * 1024          # bytes per KV block (one page of all layers, scaled down)
SLOT = BLOCK // 16         # bytes one token adds to a block
GPU_BLOCKS = 4096
CPU_BLOCKS = 16384
LAYER_GROUPS = 6


def serving_trace(n_ops: int, seed: int = 0, racy: bool = False) -> dict:
    rng = random.Random(seed)
    buffers = {
        "gpu_kv": {"space": "device", "bytes": GPU_BLOCKS * BLOCK},
        "cpu_kv": {"space": "host_pinned", "bytes": CPU_BLOCKS * BLOCK},
        "act": {"space": "device", "bytes": 64 << 20},
        "logits": {"space": "device", "bytes": 1 << 20},
        "logits_host": {"space": "host_pinned", "bytes": 1 << 20},
        "ids": {"space": "device", "bytes": 64 << 10},
        "ids_staging": {"space": "host_pageable", "bytes": 64 << 10},
        "draft_kv": {"space": "device", "bytes": 8 << 20},
    }
    streams = ["compute", "store", "load", "io", "draft", "aux"]
    ops: list[dict] = []

    def gk(b, off=0, n=BLOCK):
        return ["gpu_kv", b * BLOCK + off, n]

    def ck(b):
        return ["cpu_kv", b * BLOCK, BLOCK]

    gpu_free = deque(range(GPU_BLOCKS))
    cpu_free = deque(range(CPU_BLOCKS))
    cpu_stored: deque = deque()           # cpu blocks whose store the host has confirmed
    active: list[dict] = []               # requests: {"blocks": [...], "len": tokens}
    pending: deque = deque()              # (event, gpu blocks to free, cpu blocks now stored)
    step = 0
    while len(ops) < n_ops:
        step += 1
        ev = f"s{step % 64}"
        # inputs: pageable staging (read during the call, rule 6)
        ops.append({"op": "host_write", "ranges": [["ids_staging", 0, 4096]], "name": "ids"})
        ops.append({"op": "copy", "stream": "io", "src": ["ids_staging", 0, 4096], "dst": ["ids", 0, 4096]})
        ops.append({"op": "record", "event": "inputs", "stream": "io"})
        ops.append({"op": "wait_event", "stream": "compute", "event": "inputs"})
        # admissions: new requests, some resumed from CPU blocks (loads in ANY order)
        loads = []
        for _ in range(rng.randint(0, 3)):
            need = rng.randint(1, 6)
            if len(gpu_free) < need + 8:
                break
            blocks = [gpu_free.popleft() for _ in range(need)]
            req = {"blocks": blocks, "len": need * 16 - rng.randint(0, 15)}
            if cpu_stored and rng.random() < 0.5:
                for b in blocks[: min(len(cpu_stored), need)]:
                    c = cpu_stored.popleft()
                    loads.append({"src": ck(c), "dst": gk(b)})
                    cpu_free.append(c)        # the host frees it once the step is synchronized
            active.append(req)
        if loads:
            ops.append({"op": "copy_batch", "stream": "load", "order": "ANY", "copies": loads, "name": "load"})
            ops.append({"op": "record", "event": "loaded", "stream": "load"})
            ops.append({"op": "wait_event", "stream": "compute", "event": "loaded"})
        # forward pass: every layer group reads all active blocks, writes the new token's slot
        for g in range(LAYER_GROUPS):
            reads = [gk(b) for r in active for b in r["blocks"]]
            writes = []
            for r in active:
                pos = r["len"] % 16
                writes.append(gk(r["blocks"][-1], pos * SLOT, SLOT))
            reads.append(["act", g * (8 << 20), 8 << 20])
            writes.append(["act", (g + 1) % LAYER_GROUPS * (8 << 20), 8 << 20])
            ops.append({"op": "kernel", "stream": "compute", "name": f"layers{g}", "reads": reads, "writes": writes})
        for r in active:
            r["len"] += 1
            if r["len"] % 16 == 0 and len(gpu_free) > 8:
                r["blocks"].append(gpu_free.popleft())
        # a draft model on a side stream, following compute
        ops.append({"op": "record", "event": "fwd", "stream": "compute"})
        ops.append({"op": "wait_event", "stream": "draft", "event": "fwd"})
        ops.append({"op": "kernel", "stream": "draft", "name": "draft", "reads": [["act", 0, 8 << 20]],
                    "writes": [["draft_kv", (step % 8) << 20, 1 << 20]]})
        ops.append({"op": "record", "event": "drafted", "stream": "draft"})
        ops.append({"op": "wait_event", "stream": "compute", "event": "drafted"})
        # finished requests: store their blocks (STREAM order behind a barrier on compute)
        done = [r for r in active if rng.random() < 0.12]
        stores, freed, stored = [], [], []
        for r in done:
            active.remove(r)
            for b in r["blocks"]:
                if cpu_free and rng.random() < 0.7:
                    c = cpu_free.popleft()
                    stores.append({"src": gk(b), "dst": ck(c)})
                    stored.append(c)
                freed.append(b)
        if stores:
            order = "ANY" if racy and step % 50 == 0 else "STREAM"
            ops.append({"op": "wait_stream", "stream": "store", "on": "compute"})
            ops.append({"op": "copy_batch", "stream": "store", "order": order, "copies": stores, "name": "store"})
            ops.append({"op": "record", "event": ev, "stream": "store"})
            pending.append((ev, freed, stored))
        elif freed:
            pending.append((None, freed, stored))
        # sampling: logits to the host, synchronized every step
        ops.append({"op": "kernel", "stream": "compute", "name": "sample", "reads": [["act", 0, 8 << 20]],
                    "writes": [["logits", 0, 1 << 20]]})
        ops.append({"op": "copy", "stream": "compute", "src": ["logits", 0, 1 << 20], "dst": ["logits_host", 0, 1 << 20]})
        ops.append({"op": "record", "event": "step", "stream": "compute"})
        ops.append({"op": "sync_event", "event": "step", "name": "sync step"})
        ops.append({"op": "host_read", "ranges": [["logits_host", 0, 1 << 20]]})
        if step % 7 == 0:   # statistics on a side stream, fenced both ways
            ops.append({"op": "wait_stream", "stream": "aux", "on": "compute"})
            ops.append({"op": "kernel", "stream": "aux", "name": "stats", "reads": [["act", 0, 1 << 20]], "writes": []})
            ops.append({"op": "wait_stream", "stream": "compute", "on": "aux"})
        # poll the oldest store: once complete, its GPU blocks are free and its CPU blocks loadable
        while pending and len(pending) > 2:
            e, freed, stored = pending.popleft()
            if e is not None:
                ops.append({"op": "query_event", "event": e, "result": True})
            gpu_free.extend(freed)
            cpu_stored.extend(stored)
    return {"version": 1, "buffers": buffers, "streams": streams, "ops": ops[:n_ops]}


def layerwise_trace(n_ops: int, seed: int = 0, racy: bool = False, layers: int = 16, lanes: int = 4) -> dict:
    """Layer-wise offloading: every layer's KV lives in its own region; each layer's load is one
    copy_batch (ANY, host sources) on one of ``lanes`` load streams that compute waits for just
    before that layer's kernel, and each layer's store is one copy_batch (STREAM) on one of
    ``lanes`` store streams that waits on that layer's forward event. 2 + 2 x lanes streams, many
    events, batches of up to a few hundred copies. ``racy`` drops one layer's load wait about every
    50 steps (hazard H6)."""
    rng = random.Random(seed)
    nb, nc = 1024, 4096                        # GPU / CPU blocks per layer
    buffers = {
        "gpu_kv": {"space": "device", "bytes": layers * nb * BLOCK},
        "cpu_kv": {"space": "host_pinned", "bytes": layers * nc * BLOCK},
        "act": {"space": "device", "bytes": 64 << 20},
        "logits": {"space": "device", "bytes": 1 << 20},
        "logits_host": {"space": "host_pinned", "bytes": 1 << 20},
        "ids": {"space": "device", "bytes": 64 << 10},
        "ids_staging": {"space": "host_pageable", "bytes": 64 << 10},
    }
    stores = [f"store{k}" for k in range(lanes)]
    loads = [f"load{k}" for k in range(lanes)]
    streams = ["compute", "io", *stores, *loads]
    ops: list[dict] = []

    def gk(layer, b, off=0, n=BLOCK):
        return ["gpu_kv", (layer * nb + b) * BLOCK + off, n]

    def ck(layer, c):
        return ["cpu_kv", (layer * nc + c) * BLOCK, BLOCK]

    gpu_free, cpu_free, cpu_stored = deque(range(nb)), deque(range(nc)), deque()
    active: list[dict] = []
    pending: deque = deque()
    step, next_skip = 0, 50
    while len(ops) < n_ops:
        step += 1
        ops.append({"op": "host_write", "ranges": [["ids_staging", 0, 4096]]})
        ops.append({"op": "copy", "stream": "io", "src": ["ids_staging", 0, 4096], "dst": ["ids", 0, 4096]})
        ops.append({"op": "record", "event": "inputs", "stream": "io"})
        ops.append({"op": "wait_event", "stream": "compute", "event": "inputs"})
        resumed = []                       # (gpu block, cpu block) loaded this step
        for _ in range(rng.randint(0, 4)):
            need = rng.randint(2, 24)
            if len(gpu_free) < need + 16:
                break
            blocks = [gpu_free.popleft() for _ in range(need)]
            if cpu_stored and rng.random() < 0.6:
                for b in blocks[: min(len(cpu_stored), need)]:
                    c = cpu_stored.popleft()
                    resumed.append((b, c))
                    cpu_free.append(c)
            active.append({"blocks": blocks, "len": need * 16 - rng.randint(0, 15)})
        skip = racy and bool(resumed) and step >= next_skip   # the first step with loads after each 50
        if skip:
            next_skip += 50
        for layer in range(layers):
            if resumed:
                lane = loads[layer % lanes]
                ops.append({"op": "copy_batch", "stream": lane, "order": "ANY", "name": f"load L{layer}",
                            "copies": [{"src": ck(layer, c), "dst": gk(layer, b)} for b, c in resumed]})
                ops.append({"op": "record", "event": f"loaded{layer}", "stream": lane})
                if not (skip and layer == 3):
                    ops.append({"op": "wait_event", "stream": "compute", "event": f"loaded{layer}"})
            reads = [gk(layer, b) for r in active for b in r["blocks"]] + [["act", 0, 8 << 20]]
            writes = [gk(layer, r["blocks"][-1], r["len"] % 16 * SLOT, SLOT) for r in active]
            ops.append({"op": "kernel", "stream": "compute", "name": f"layer{layer}", "reads": reads,
                        "writes": [*writes, ["act", 8 << 20, 8 << 20]]})
            ops.append({"op": "record", "event": f"fwd{layer}", "stream": "compute"})
        for r in active:
            r["len"] += 1
            if r["len"] % 16 == 0 and len(gpu_free) > 16:
                r["blocks"].append(gpu_free.popleft())
        done = [r for r in active if rng.random() < 0.1]
        pairs, freed, stored = [], [], []
        for r in done:
            active.remove(r)
            for b in r["blocks"]:
                if cpu_free and rng.random() < 0.8:
                    c = cpu_free.popleft()
                    pairs.append((b, c))
                    stored.append(c)
                freed.append(b)
        if pairs:
            for layer in range(layers):
                lane = stores[layer % lanes]
                ops.append({"op": "wait_event", "stream": lane, "event": f"fwd{layer}"})
                ops.append({"op": "copy_batch", "stream": lane, "order": "STREAM", "name": f"store L{layer}",
                            "copies": [{"src": gk(layer, b), "dst": ck(layer, c)} for b, c in pairs]})
            for lane in stores:
                ops.append({"op": "record", "event": f"{lane}.{step % 64}", "stream": lane})
            pending.append(([f"{lane}.{step % 64}" for lane in stores], freed, stored))
        elif freed:
            pending.append(([], freed, stored))
        ops.append({"op": "kernel", "stream": "compute", "name": "sample", "reads": [["act", 8 << 20, 8 << 20]],
                    "writes": [["logits", 0, 1 << 20]]})
        ops.append({"op": "copy", "stream": "compute", "src": ["logits", 0, 1 << 20], "dst": ["logits_host", 0, 1 << 20]})
        ops.append({"op": "record", "event": "step", "stream": "compute"})
        ops.append({"op": "sync_event", "event": "step"})
        ops.append({"op": "host_read", "ranges": [["logits_host", 0, 1 << 20]]})
        while len(pending) > 2:
            events, freed, stored = pending.popleft()
            for e in events:
                ops.append({"op": "query_event", "event": e, "result": True})
            gpu_free.extend(freed)
            cpu_stored.extend(stored)
    return {"version": 1, "buffers": buffers, "streams": streams, "ops": ops[:n_ops]}


SCENARIOS = {"serving": serving_trace, "layerwise": layerwise_trace}


def bench(n_ops: int, racy: bool, scenario: str = "serving") -> None:
    doc = SCENARIOS[scenario](n_ops, racy=racy)
    text = json.dumps(doc)
    t0 = time.perf_counter()
    trace = Trace.from_json(text)
    t1 = time.perf_counter()
    report = check(trace)
    t2 = time.perf_counter()
    n_acc = sum(len(op.get("reads", ())) + len(op.get("writes", ())) + len(op.get("ranges", ()))
                + 2 * len(op.get("copies", ())) + (2 if op["op"] == "copy" else 0) for op in doc["ops"])
    print(f"{scenario:>9} {n_ops:>7} ops {len(doc['streams']):>2} streams {n_acc:>8} ranges  "
          f"{'racy' if racy else 'safe'}: parse {t1 - t0:6.2f} s"
          f"  check {t2 - t1:6.2f} s  -> {report.verdict}, {len(report.races)} races", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, nargs="*", default=[10_000, 100_000], help="trace sizes in ops")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--write", metavar="PATH", help="write the (safe) trace of the first size there and exit")
    args = ap.parse_args()
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.write:
        Path(args.write).write_text(json.dumps(SCENARIOS[scenarios[0]](args.ops[0])))
        return
    for n in args.ops:
        for scenario in scenarios:
            for racy in (False, True):
                bench(n, racy, scenario)


if __name__ == "__main__":
    main()
