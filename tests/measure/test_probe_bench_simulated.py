"""The device-side glue of probe and bench (``CudaProbe``, ``CudaBench``, ``run``) on a CPU stand-in.

torch's CUDA streams and events, ``kvverify.device.ops``, ``kvverify.device.kernels`` and ``kvverify.device.host_memory``
are replaced by a synchronous "device": every copy is a ``memmove`` done inside the call, every
event is complete when recorded, the spin kernel does nothing. No timing or ordering result
means anything here; what this checks is that the whole command runs end to end through the same
code the GPU runs (attribute names, call shapes, pointer arithmetic, output) and that pointer
arithmetic moves the right bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import json
import sys
import time
import types

import numpy as np
import pytest
import torch

import kvverify.device
from kvverify.measure import bench, bench_device, bench_plan, probe


class _Event:
    def __init__(self, enable_timing=False, **_):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def query(self):
        return True

    def synchronize(self):
        return None

    def elapsed_time(self, end):
        return max((end.t - self.t) * 1e3, 1e-6)


class _Stream:
    def __init__(self, *_, **__):
        self.waited = []

    def synchronize(self):
        return None

    def wait_event(self, event):
        self.waited.append(event)


class _HostBuffer:
    def __init__(self, kind, nbytes):
        self.kind, self.nbytes = kind, nbytes
        self._array = np.zeros(nbytes, dtype=np.uint8)
        self.ptr = self._array.ctypes.data
        self.freed = False

    def numpy(self, dtype):
        return self._array.view(dtype)

    def free(self):
        self.freed = True


@pytest.fixture
def simulated(monkeypatch):
    """Install the stand-in; returns a record of the ops' calls."""
    record = {"swaps": [], "spins": [], "buffers": []}

    class SrcAccessOrder(enum.IntEnum):
        STREAM = 1
        DURING_API_CALL = 2
        ANY = 3

    def swap_blocks_batch(src_ptrs, dst_ptrs, sizes, src_access_order=None, *, use_batch_api=True, method="batch", **_):
        src, dst, n = (torch.as_tensor(x, dtype=torch.int64) for x in (src_ptrs, dst_ptrs, sizes))
        assert src.dim() == dst.dim() == n.dim() == 1 and len(src) == len(dst) == len(n) > 0
        assert isinstance(src_access_order, SrcAccessOrder) and method in ("batch", "loop", "kernel")
        record["swaps"].append((src_access_order.name, method if use_batch_api else "loop", len(src)))
        for s, d, k in zip(src.tolist(), dst.tolist(), n.tolist()):
            ctypes.memmove(d, s, k)

    ops = types.ModuleType("kvverify.device.ops")
    ops.SrcAccessOrder = SrcAccessOrder
    ops.swap_blocks_batch = swap_blocks_batch
    ops.batch_api_available = lambda: True
    kernels = types.ModuleType("kvverify.device.kernels")
    kernels.spin = lambda duration_ns: record["spins"].append(duration_ns)
    host_memory = types.ModuleType("kvverify.device.host_memory")

    def allocate_host(kind, nbytes):
        assert kind in ("pinned", "registered", "pageable")
        buf = _HostBuffer(kind, nbytes)
        record["buffers"].append(buf)
        return buf

    host_memory.allocate_host = allocate_host
    for name, module in (("ops", ops), ("kernels", kernels), ("host_memory", host_memory)):
        monkeypatch.setitem(sys.modules, f"kvverify.device.{name}", module)
        monkeypatch.setattr(kvverify.device, name, module, raising=False)

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(kvverify.device, "gpu_refusal", lambda: None)
    from kvverify import annotate

    yield record
    annotate._reset_for_tests()


def parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_probe_end_to_end_on_the_stand_in(simulated, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert probe.run(parse(probe, ["--reps", "3", "--hold-ms", "5", "--pages", "4", "--page-bytes", "4KiB",
                                   "--json", str(out)])) == 0
    doc = json.loads(out.read_text())
    assert len(doc["cells"]) == 18 and all(not c["errors"] for c in doc["cells"])
    by = {(c["direction"], c["order"], c["host_memory"]): c for c in doc["cells"]}
    # A synchronous copy reads the host bytes inside the call (H2D: OLD lands) ...
    assert by[("h2d", "ANY", "pinned")]["source_read"]["value"] == "call"
    # ... and the stand-in's writer "finished" before the D2H call (NEW lands).
    assert by[("d2h", "ANY", "pageable")]["source_read"]["value"] == "stream"
    assert all(c["blocks"]["value"] == "yes" for c in doc["cells"])  # events are complete at once
    assert simulated["spins"] and set(simulated["spins"]) == {5_000_000}
    assert {s[2] for s in simulated["swaps"]} == {4}
    assert all(b.freed for b in simulated["buffers"])
    text, err = capsys.readouterr()
    assert "kvverify probe" in text and "call 3/3" in text
    assert err.endswith(f"[probe] report written to {out}\n")  # where the file went


def test_bench_end_to_end_on_the_stand_in(simulated, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--page-sizes", "64KiB,256KiB", "--call-bytes", "1MiB", "--calls-per-rep", "2", "--pool-bytes", "16MiB",
            "--reps", "3", "--matmul-size", "16", "--json", str(out), "--plot", str(png)]
    assert bench.run(parse(bench, argv)) == 0
    doc = json.loads(out.read_text())
    assert len(doc["points"]) == 6
    for p in doc["points"]:
        assert set(p["methods"]) == {"STREAM", "DURING_API_CALL", "ANY", "loop", "kernel", "ceiling"}
        for m in p["methods"].values():
            assert m["error"] is None and m["gbps"]["n"] == 3
            assert m["blocking"] is True  # the stand-in's events complete at once: never covered
            assert m["compute"]["n"] == 3 and m["compute"]["matmuls"] >= 2
        assert p["any_over_stream"]["n"] == 3 and p["repeat"] is not None
    swaps = simulated["swaps"]
    # the ceiling: one contiguous cudaMemcpyAsync of the whole rep (half of it each way for `both`);
    # the loop and the kernel: the same pages as the batch
    assert ("STREAM", "loop", 1) in swaps
    assert ("STREAM", "loop", 16) in swaps and ("ANY", "batch", 16) in swaps and ("DURING_API_CALL", "batch", 4) in swaps
    assert ("STREAM", "kernel", 16) in swaps and ("STREAM", "kernel", 4) in swaps
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert all(b.freed for b in simulated["buffers"])
    text, err = capsys.readouterr()
    assert "ANY/STREAM" in text
    assert err.endswith(f"[bench] report written to {out}\n[bench] plot written to {png}\n")  # where each went


def test_bench_page_draws_move_the_right_bytes(simulated):
    backend = bench_device.CudaBench(0, "pinned", 1 << 20)
    try:
        host = backend.host.numpy(np.uint8)
        host[:] = np.arange(host.size, dtype=np.uint64).astype(np.uint8)
        backend.dev.zero_()
        point = bench_plan.Point("h2d", 4096, 8, 2, "4 KiB")
        calls = backend.prepare(point, seed=7)
        assert len(calls) == 2
        for src, dst, sizes in calls:
            assert len(set(src.tolist())) == 8 and len(set(dst.tolist())) == 8  # no page drawn twice in a call
            assert all((p - backend.host.ptr) % 4096 == 0 for p in src.tolist())
            assert all(0 <= p - backend.dev.data_ptr() < (1 << 20) for p in dst.tolist())
            assert sizes.tolist() == [4096] * 8
        dev = backend.dev.numpy()
        for src, dst, sizes in calls:  # one call at a time: two calls may draw the same destination page
            backend.ops.swap_blocks_batch(src, dst, sizes, backend.ops.SrcAccessOrder.ANY)
            for s, d in zip(src.tolist(), dst.tolist()):
                so, do = s - backend.host.ptr, d - backend.dev.data_ptr()
                assert np.array_equal(dev[do:do + 4096], host[so:so + 4096])
        d2h = bench_plan.Point("d2h", 4096, 8, 2, "4 KiB")
        src, dst, _ = backend.prepare(d2h, seed=1)[0]
        assert all(0 <= p - backend.dev.data_ptr() < (1 << 20) for p in src.tolist())
        assert all(0 <= p - backend.host.ptr < (1 << 20) for p in dst.tolist())
    finally:
        backend.close()


def test_bench_both_ways_use_their_own_halves_and_move_the_right_bytes(simulated):
    half = 1 << 19
    backend = bench_device.CudaBench(0, "pinned", 2 * half)
    try:
        host, dev = backend.host.numpy(np.uint8), backend.dev.numpy()
        host[:] = np.arange(host.size, dtype=np.uint64).astype(np.uint8)
        dev[:] = (np.arange(dev.size, dtype=np.uint64) * 7).astype(np.uint8)
        point = bench_plan.Point("both", 4096, 8, 2, "4 KiB")
        calls = backend.prepare(point, seed=3)
        for (h_src, h_dst, _), (d_src, d_dst, _) in calls:
            assert all(0 <= p - backend.host.ptr < half for p in h_src.tolist())  # H2D: first halves
            assert all(0 <= p - backend.dev.data_ptr() < half for p in h_dst.tolist())
            assert all(half <= p - backend.dev.data_ptr() < 2 * half for p in d_src.tolist())  # D2H: second halves
            assert all(half <= p - backend.host.ptr < 2 * half for p in d_dst.tolist())
        host_before, dev_before = host.copy(), dev.copy()
        backend.issuer("kernel", point, calls[:1])()
        (h_src, h_dst, _), (d_src, d_dst, _) = calls[0]
        for s, d in zip(h_src.tolist(), h_dst.tolist()):
            so, do = s - backend.host.ptr, d - backend.dev.data_ptr()
            assert np.array_equal(dev[do:do + 4096], host_before[so:so + 4096])
        for s, d in zip(d_src.tolist(), d_dst.tolist()):
            so, do = s - backend.dev.data_ptr(), d - backend.host.ptr
            assert np.array_equal(host[do:do + 4096], dev_before[so:so + 4096])
        # the kernel path: one call carrying both directions' 8 + 8 pages; the batch: one call each way
        assert simulated["swaps"][-1] == ("STREAM", "kernel", 16)
        backend.issuer("STREAM", point, calls[:1])()
        assert simulated["swaps"][-2:] == [("STREAM", "batch", 8), ("STREAM", "batch", 8)]
    finally:
        backend.close()
