"""What ``kvverify check`` costs, on this machine: the figures of issue #11, and serving-engine-like
traces of 10,000 and 100,000 ops.

    python benchmarks/bench_checker.py                        # start-up, the small traces, 1M-op mixed
    python benchmarks/bench_checker.py --figures scenarios    # in-process parse / check, 10k and 100k ops
    python benchmarks/bench_checker.py --figures mixed --mixed-ops 100000
    python benchmarks/bench_checker.py --ops 5000 --scenario layerwise --write /tmp/trace.json

``startup``: ``python -c pass``, ``python -m kvverify check`` on an empty trace and ``python -m
kvverify --help``, best and median of 15 runs each (targets: check under 0.15 s, help under 0.3 s;
Python alone is most of it). ``small``: the four traces that once cost minutes or gigabytes
(:func:`sync_device_trace`, :func:`host_syncs_trace`, :func:`wide_host_write_trace`,
:func:`scattered_writer_trace`, and the last at the 10,000-race cap; targets 2 s and 500 MB
each). ``mixed``: :func:`mixed_ops`, 1,000,000 ops, safe and racy (targets 20 s and 1.5 GB).
Each of these runs ``python -m kvverify check FILE`` in a child process and prints its wall time,
CPU time (user + system) and peak resident memory, with the load average before it: this machine
is shared, and under load wall time stretches while CPU time does not much.

``scenarios`` (in-process, parse and check apart): ``layerwise`` (layer-wise offloading, many streams
and big batches) is described at :func:`layerwise_trace`, ``mixed`` at :func:`mixed_ops`. ``serving``
is what an LLM serving engine with KV-cache offloading asks of one GPU, step after step, over
long-lived buffers:

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
so the race-listing path is timed too. Not a test: it prints the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvverify.check import Trace, check

BLOCK = 16 * 1024          # bytes per KV block (one page of all layers, scaled down)
SLOT = BLOCK // 16         # bytes one token adds to a block
GPU_BLOCKS = 4096
CPU_BLOCKS = 16384
LAYER_GROUPS = 6


def input_ops(name: str | None = None) -> list[dict]:
    """A step's inputs, as each generator below starts a step: the host writes token ids into the
    pageable staging buffer (op named ``name``), ``io`` copies them up (the source is read during
    the call, rule 6), and ``compute`` waits for them."""
    write = {"op": "host_write", "ranges": [["ids_staging", 0, 4096]]}
    if name is not None:
        write["name"] = name
    return [write, {"op": "copy", "stream": "io", "src": ["ids_staging", 0, 4096], "dst": ["ids", 0, 4096]},
            {"op": "record", "event": "inputs", "stream": "io"},
            {"op": "wait_event", "stream": "compute", "event": "inputs"}]


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
        ops.extend(input_ops(name="ids"))
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
        ops.extend(input_ops())
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


def mixed_ops(n_ops: int, seed: int = 0, racy: bool = False) -> tuple[dict, Iterator[dict]]:
    """A trace as a recorder of a whole serving test run would write it: ``(header, ops)`` with
    ``header`` the version, buffers and streams, ``ops`` yielding ``n_ops`` ops one by one (a
    million ops are never held at once). Every op has an ``at`` (from 300 call sites) and many
    a ``name``.

    - 12 streams: ``compute``, ``store``, ``load``, ``io`` and 8 side streams; 64 buffers: a paged
      GPU KV cache (8192 blocks of 16 KiB), a pinned CPU KV cache (16384 blocks), 48 activation
      buffers of 1–8 MiB, 8 pinned staging buffers, pageable inputs, logits on both sides;
    - per step (about 47 ops): inputs staged through pageable memory and copied up on ``io``;
      resumed requests loaded with one ``copy_batch`` (ANY order, host sources); 4 layers, each 6
      aten-like kernels reading 1–3 and writing one activation range plus one attention kernel
      reading every active request's KV blocks (about a hundred ranges, scattered) and writing
      each request's new slot; a side-stream kernel fenced by events both ways; finished requests
      stored with one ``copy_batch`` (STREAM order behind ``store.wait_stream(compute)``); logits
      to the host after ``sync_event``; older stores polled with ``query_event`` before their
      blocks are reused;
    - about 10 ranges per op; ``racy``: every 50th step stores in ANY order (hazard H1).
    """
    rng = random.Random(seed)
    gpu_blocks, cpu_blocks = 8192, 16384
    acts = [f"act{k}" for k in range(48)]
    buffers = {"gpu_kv": {"space": "device", "bytes": gpu_blocks * BLOCK},
               "cpu_kv": {"space": "host_pinned", "bytes": cpu_blocks * BLOCK},
               "ids_staging": {"space": "host_pageable", "bytes": 1 << 16},
               "ids": {"space": "device", "bytes": 1 << 16},
               "logits": {"space": "device", "bytes": 1 << 20},
               "logits_host": {"space": "host_pinned", "bytes": 1 << 20}}
    for k, a in enumerate(acts):
        buffers[a] = {"space": "device", "bytes": (1 + k % 8) << 20}
    for k in range(8):
        buffers[f"pin{k}"] = {"space": "host_pinned", "bytes": 1 << 20}
    side = [f"side{k}" for k in range(8)]
    header = {"version": 1, "buffers": buffers, "streams": ["compute", "store", "load", "io", *side]}
    sites = [f"model/layer{f}.py:{rng.randint(10, 900)} in {fn}" for f in range(30)
             for fn in ("forward", "attn", "mlp", "swap", "step", "sample", "offload", "load", "norm", "rope")]

    def arange(a):
        n = buffers[a]["bytes"]
        length = min(rng.choice((4096, 65536, 1 << 18)), n)
        return [a, rng.randrange(0, n - length + 1, 4096), length]

    def gk(b, off=0, n=BLOCK):
        return ["gpu_kv", b * BLOCK + off, n]

    def ck(c):
        return ["cpu_kv", c * BLOCK, BLOCK]

    def step_ops(step: int, gpu_free: deque, cpu_free: deque, cpu_stored: deque, active: list, pending: deque):
        yield from input_ops()
        loads = []
        for _ in range(rng.randint(0, 3)):
            need = rng.randint(1, 8)
            if len(gpu_free) < need + 16:
                break
            blocks = [gpu_free.popleft() for _ in range(need)]
            if cpu_stored and rng.random() < 0.5:
                for b in blocks[: min(len(cpu_stored), need)]:
                    c = cpu_stored.popleft()
                    loads.append({"src": ck(c), "dst": gk(b)})
                    cpu_free.append(c)
            active.append({"blocks": blocks, "len": need * 16 - rng.randint(0, 15)})
        if loads:
            yield {"op": "copy_batch", "stream": "load", "order": "ANY", "copies": loads, "name": "load"}
            yield {"op": "record", "event": "loaded", "stream": "load"}
            yield {"op": "wait_event", "stream": "compute", "event": "loaded"}
        for _ in range(4):
            for _ in range(6):   # aten ops on activations
                yield {"op": "kernel", "stream": "compute", "name": "aten::op",
                       "reads": [arange(rng.choice(acts)) for _ in range(rng.randint(1, 3))],
                       "writes": [arange(rng.choice(acts))]}
            yield {"op": "kernel", "stream": "compute", "name": "attention",
                   "reads": [gk(b) for r in active for b in r["blocks"]],
                   "writes": [gk(r["blocks"][-1], r["len"] % 16 * SLOT, SLOT) for r in active]}
        for r in active:
            r["len"] += 1
            if r["len"] % 16 == 0 and len(gpu_free) > 16:
                r["blocks"].append(gpu_free.popleft())
        s = side[step % len(side)]
        yield {"op": "record", "event": "fwd", "stream": "compute"}
        yield {"op": "wait_event", "stream": s, "event": "fwd"}
        yield {"op": "kernel", "stream": s, "reads": [arange(acts[0])], "writes": [arange(acts[40 + step % 8])]}
        yield {"op": "record", "event": f"side{step % 8}", "stream": s}
        yield {"op": "wait_event", "stream": "compute", "event": f"side{step % 8}"}
        stores, freed, stored = [], [], []
        for r in [r for r in active if rng.random() < 0.1]:
            active.remove(r)
            for b in r["blocks"]:
                if cpu_free and rng.random() < 0.7:
                    c = cpu_free.popleft()
                    stores.append({"src": gk(b), "dst": ck(c)})
                    stored.append(c)
                freed.append(b)
        if stores:
            yield {"op": "wait_stream", "stream": "store", "on": "compute"}
            yield {"op": "copy_batch", "stream": "store", "order": "ANY" if racy and step % 50 == 0 else "STREAM",
                   "copies": stores, "name": "store"}
            yield {"op": "record", "event": f"st{step % 64}", "stream": "store"}
            pending.append((f"st{step % 64}", freed, stored))
        elif freed:
            pending.append((None, freed, stored))
        yield {"op": "kernel", "stream": "compute", "name": "sample", "reads": [arange(acts[1])],
               "writes": [["logits", 0, 1 << 20]]}
        yield {"op": "copy", "stream": "compute", "src": ["logits", 0, 1 << 20], "dst": ["logits_host", 0, 1 << 20]}
        yield {"op": "record", "event": "step", "stream": "compute"}
        yield {"op": "sync_event", "event": "step"}
        yield {"op": "host_read", "ranges": [["logits_host", 0, 1 << 20]]}
        while len(pending) > 2:
            e, freed, stored = pending.popleft()
            if e is not None:
                yield {"op": "query_event", "event": e, "result": True}
            gpu_free.extend(freed)
            cpu_stored.extend(stored)

    def ops() -> Iterator[dict]:
        state = (deque(range(gpu_blocks)), deque(range(cpu_blocks)), deque(), [], deque())
        n, step = 0, 0
        while True:
            step += 1
            for op in step_ops(step, *state):
                op["at"] = rng.choice(sites)
                yield op
                n += 1
                if n == n_ops:
                    return

    return header, ops()


def mixed_trace(n_ops: int, seed: int = 0, racy: bool = False) -> dict:
    header, ops = mixed_ops(n_ops, seed, racy)
    return {**header, "ops": list(ops)}


SCENARIOS = {"serving": serving_trace, "layerwise": layerwise_trace, "mixed": mixed_trace}


# -- the small traces that once cost minutes or gigabytes (issue #11) -------------------------------


def _doc(buffers: dict, streams: list[str], ops: list[dict]) -> dict:
    return {"version": 1, "buffers": buffers, "streams": streams, "ops": ops}


def sync_device_trace(streams: int = 1000, syncs: int = 2000) -> dict:
    """``streams`` streams, ``syncs`` rounds of a kernel on the next stream and a ``sync_device``
    (once each sync_device joined every stream's clock: ops x streams²)."""
    names = [f"s{k}" for k in range(streams)]
    ops = []
    for r in range(syncs):
        ops.append({"op": "kernel", "stream": names[r % streams], "writes": [["buf", (r % streams) * 64, 64]]})
        ops.append({"op": "sync_device"})
    return _doc({"buf": {"space": "device", "bytes": streams * 64}}, names, ops)


def host_syncs_trace(streams: int = 1000, syncs: int = 200_000) -> dict:
    """A kernel and a record on each of ``streams`` streams, then ``syncs`` host synchronizations
    round robin (``sync_stream`` and ``query_event`` true), with a new kernel after each round
    (once every op kept a clock as wide as the stream count: 1.7 GB)."""
    names = [f"s{k}" for k in range(streams)]
    ops = []
    for k, s in enumerate(names):
        ops.append({"op": "kernel", "stream": s, "writes": [["buf", k * 64, 64]]})
        ops.append({"op": "record", "event": f"e{k}", "stream": s})
    for n in range(syncs):
        k = n % streams
        ops.append({"op": "sync_stream", "stream": names[k]} if n % 2 else
                   {"op": "query_event", "event": f"e{k}", "result": True})
        if k == streams - 1:
            k2 = (n // streams) % streams
            ops.append({"op": "kernel", "stream": names[k2], "writes": [["buf", k2 * 64, 64]]})
    return _doc({"buf": {"space": "device", "bytes": streams * 64}}, names, ops)


def wide_host_write_trace(ranges: int = 50_000, streams: int = 1000) -> dict:
    """One host write of ``ranges`` ranges, then a kernel on each of ``streams`` streams reading the
    whole buffer (once: a shadow per stream per cell, 3.3 GB)."""
    names = [f"s{k}" for k in range(streams)]
    n = ranges * 128
    ops = [{"op": "host_write", "ranges": [["pinned", k * 128, 64] for k in range(ranges)]}]
    ops += [{"op": "kernel", "stream": s, "reads": [["pinned", 0, n]], "writes": [["out", k * 64, 64]]}
            for k, s in enumerate(names)]
    return _doc({"pinned": {"space": "host_pinned", "bytes": n}, "out": {"space": "device", "bytes": streams * 64}},
                names, ops)


def scattered_writer_trace(ranges: int = 100_000, readers: int = 200) -> dict:
    """One kernel writing ``ranges`` disjoint ranges, then ``readers`` kernels on as many other
    streams reading the whole buffer, unsynchronized: ``readers`` races (once a Python walk of
    every cell per racing op: 42 s; at the 10,000-race cap, about half an hour)."""
    names = [f"s{k}" for k in range(readers + 1)]
    n = ranges * 128
    ops = [{"op": "kernel", "stream": "s0", "writes": [["buf", k * 128, 64] for k in range(ranges)]}]
    ops += [{"op": "kernel", "stream": s, "reads": [["buf", 0, n]]} for s in names[1:]]
    return _doc({"buf": {"space": "device", "bytes": n}}, names, ops)


SMALL = {
    "1000 streams x 2000 sync_device": sync_device_trace,
    "1000 streams x 200k host syncs": host_syncs_trace,
    "host write of 50k ranges, 1000 streams": wide_host_write_trace,
    "100k-range writer, 200 readers": scattered_writer_trace,
    "100k-range writer, 10k readers (race cap)": lambda: scattered_writer_trace(readers=10_000),
}


# -- measuring ------------------------------------------------------------------------------------


# The child reports its own peak resident memory (VmHWM: the high-water mark of its address space,
# which starts afresh at exec). getrusage's ru_maxrss would carry over the memory of this process,
# which the child shares until it execs.
_CHILD = """
import atexit, runpy, sys
def peak():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(f"peak-kb {kb}", file=sys.stderr)
atexit.register(peak)
sys.argv = ["kvverify", "check", sys.argv[1]]
runpy.run_module("kvverify", run_name="__main__", alter_sys=True)
"""


def measure(path: str) -> tuple[int, float, float, float]:
    """Run ``python -m kvverify check PATH`` in a child; its exit status, wall time (s), CPU time
    (user + system, s) and peak resident memory (MB)."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[1])
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    peak = [int(line.split()[1]) for line in err.splitlines() if line.startswith("peak-kb ")]
    return os.waitstatus_to_exitcode(status), wall, usage.ru_utime + usage.ru_stime, peak[-1] / 1024 if peak else float("nan")


def report(label: str, path: str, target: str) -> None:
    load = os.getloadavg()[0]
    status, wall, cpu, rss = measure(path)
    size = os.path.getsize(path) / 1e6
    print(f"  {label:44s} {size:7.1f} MB in  exit {status}  {wall:6.2f} s wall  {cpu:6.2f} s CPU  "
          f"{rss:7.0f} MB peak   (load {load:.1f}; target {target})", flush=True)


def startup(runs: int = 15) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.json"
        empty.write_text(json.dumps({"version": 1, "buffers": {}, "streams": [], "ops": []}))
        print(f"start-up, best and median of {runs} runs (load {os.getloadavg()[0]:.1f}):")
        for label, argv, target in (("python -c pass", ["-c", "pass"], "Python alone"),
                                    ("kvverify check (empty trace)", ["-m", "kvverify", "check", str(empty)], "< 0.15 s"),
                                    ("kvverify --help", ["-m", "kvverify", "--help"], "< 0.3 s")):
            times = []
            for _ in range(runs + 1):      # the first run writes bytecode caches: not counted
                t0 = time.perf_counter()
                subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL, check=False,
                               cwd=Path(__file__).resolve().parents[1])
                times.append(time.perf_counter() - t0)
            times = times[1:]
            print(f"  {label:30s} best {min(times):.3f} s  median {statistics.median(times):.3f} s   ({target})",
                  flush=True)


def small() -> None:
    print("the small traces of issue #11 (targets: under 2 s and 500 MB each):")
    with tempfile.TemporaryDirectory() as tmp:
        for label, make in SMALL.items():
            path = Path(tmp) / "trace.json"
            path.write_text(json.dumps(make()))
            report(label, str(path), "2 s, 500 MB")


def mixed(n_ops: int) -> None:
    print(f"the mixed trace, {n_ops:,} ops (targets: under 20 s and 1.5 GB):")
    with tempfile.TemporaryDirectory() as tmp:
        for racy in (False, True):
            path = Path(tmp) / "mixed.json"
            header, ops = mixed_ops(n_ops, racy=racy)
            with open(path, "w") as f:      # written op by op: the generator never holds the trace
                f.write(json.dumps(header)[:-1] + ', "ops": [\n')
                f.writelines(("" if k == 0 else ",\n") + json.dumps(op) for k, op in enumerate(ops))
                f.write("]}\n")
            report("mixed, racy" if racy else "mixed, safe", str(path), "20 s, 1.5 GB")


def bench(n_ops: int, racy: bool, scenario: str = "serving") -> None:
    doc = SCENARIOS[scenario](n_ops, racy=racy)
    text = json.dumps(doc)
    t0 = time.perf_counter()
    trace = Trace.from_json(text)
    t1 = time.perf_counter()
    verdict = check(trace)
    t2 = time.perf_counter()
    n_acc = sum(len(op.get("reads", ())) + len(op.get("writes", ())) + len(op.get("ranges", ()))
                + 2 * len(op.get("copies", ())) + (2 if op["op"] == "copy" else 0) for op in doc["ops"])
    print(f"{scenario:>9} {n_ops:>7} ops {len(doc['streams']):>2} streams {n_acc:>8} ranges  "
          f"{'racy' if racy else 'safe'}: parse {t1 - t0:6.2f} s"
          f"  check {t2 - t1:6.2f} s  -> {verdict.verdict}, {len(verdict.races)} races", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figures", default="startup,small,mixed",
                    help="comma list of startup, small, mixed, scenarios (default: the first three)")
    ap.add_argument("--mixed-ops", type=int, default=1_000_000, help="ops of the mixed trace (default 1,000,000)")
    ap.add_argument("--ops", type=int, nargs="*", default=[10_000, 100_000], help="scenario trace sizes in ops")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--write", metavar="PATH", help="write the (safe) trace of the first size there and exit")
    args = ap.parse_args()
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.write:
        Path(args.write).write_text(json.dumps(SCENARIOS[scenarios[0]](args.ops[0])))
        return
    figures = args.figures.split(",")
    unknown = set(figures) - {"startup", "small", "mixed", "scenarios"}
    if unknown:
        ap.error(f"unknown figures: {', '.join(sorted(unknown))}")
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    if "startup" in figures:
        startup()
    if "small" in figures:
        small()
    if "mixed" in figures:
        mixed(args.mixed_ops)
    if "scenarios" in figures:
        for n in args.ops:
            for scenario in scenarios:
                for racy in (False, True):
                    bench(n, racy, scenario)


if __name__ == "__main__":
    main()
