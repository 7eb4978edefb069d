"""Native capture on a GPU (``csrc/record/cupti_capture.cpp``): what CUPTI reports of work no dispatch mode
sees (a Triton kernel, a runtime copy called from C), written as the recording's ops; work the
recorder sees another way is not written twice; under another CUPTI subscriber the recording says
so and runs on."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvverify.record import host_read, recording

pytestmark = pytest.mark.gpu

N = 1 << 16


def triton_copy():
    """A Triton kernel copying ``n`` floats from ``src`` to ``dst`` (launched outside torch's dispatcher)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    def launch(src, dst):
        copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), BLOCK=1024)

    return launch


def races(rec):
    doc = rec.trace()
    return [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]


@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait_stream"])
def test_a_triton_load_on_a_side_stream_races_with_a_read_unless_the_reader_waits(wait):
    """The engine's small-load path: a Triton copy kernel fills a device block on the load stream;
    attention (here a copy of the block) on the default stream reads it. Without ``wait_stream``:
    RACY, the kernel named and located at the launching line; with it: SAFE."""
    launch = triton_copy()
    src, dst = torch.randn(N, device="cuda"), torch.empty(N, device="cuda")
    host = torch.empty(N, pin_memory=True)
    load = torch.cuda.Stream()
    launch(src, dst)  # compiled before the recording
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(load):
            torch.cuda._sleep(20_000_000)
            launch(src, dst)  # <- the load
        if wait:
            torch.cuda.current_stream().wait_stream(load)
        host.copy_(dst, non_blocking=True)
        torch.cuda.synchronize()
    assert rec.capture_off is None, rec.capture_off
    kernels = [op for op in rec.recorder.ops if op["op"] == "kernel" and "copy_kernel" in op["name"]]
    assert len(kernels) == 1, rec.recorder.ops
    # Triton launches with the GIL released: the line is its launch-enter hook's, the user's frame
    # innermost there (the helper that launches)
    assert kernels[0]["at"] and "test_record_native_gpu.py:" in kernels[0]["at"] and kernels[0]["at"].endswith(" in launch")
    assert races(rec) == ([] if wait else [("RAW", "kernel", "copy")])
    assert rec.complete(), rec.summary().notes


def triton_table_load():
    """A Triton kernel copying block ``i`` of pinned memory to device block ``i`` through two tables
    of block addresses in device memory: an engine's small-load path (launched outside torch's
    dispatcher)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def load_kernel(src_table, dst_table, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        src = tl.load(src_table + i).to(tl.pointer_type(tl.float32))
        dst = tl.load(dst_table + i).to(tl.pointer_type(tl.float32))
        offsets = tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets))

    def launch(src_table, dst_table, block):
        load_kernel[(src_table.numel(),)](src_table, dst_table, BLOCK=block)

    return launch


@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait_stream"])
def test_a_triton_load_through_pointer_tables_races_with_compute_zero_filling_the_blocks(wait):
    """The load kernel on a side stream writes device blocks named only in a device table (filled
    by a host copy in the recording), while compute zero-fills the same blocks: a kernel against a
    kernel on two streams (RACY, WAW) unless the load stream waits for compute (SAFE)."""
    launch = triton_table_load()
    blocks, block = 8, 1024
    pinned = torch.randn(blocks, block, pin_memory=True)
    gpu = torch.empty(2 * blocks, block, device="cuda")
    load = torch.cuda.Stream()
    launch(torch.tensor([pinned[i].data_ptr() for i in range(blocks)], device="cuda"),
           torch.tensor([gpu[i].data_ptr() for i in range(blocks)], device="cuda"), block)  # compiled before
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    with recording() as rec:
        src_table = torch.tensor([pinned[i].data_ptr() for i in range(blocks)]).to("cuda")
        dst_table = torch.tensor([gpu[2 * i].data_ptr() for i in range(blocks)]).to("cuda")
        load.wait_stream(compute)  # the tables are in place for the load stream
        torch.cuda._sleep(20_000_000)
        gpu.zero_()  # compute: fresh blocks zero-filled
        with torch.cuda.stream(load):
            if wait:
                load.wait_stream(compute)
            launch(src_table, dst_table, block)  # <- the load
        torch.cuda.synchronize()
    kernels = [op for op in rec.recorder.ops if op["op"] == "kernel" and "load_kernel" in op["name"]]
    assert len(kernels) == 1, rec.recorder.ops
    # (a kernel outside the dispatcher reads and writes what its arguments reach: RAW or WAW, by the lowest overlap)
    assert [(kind in ("RAW", "WAW"), *ops) for kind, *ops in races(rec)] == \
        ([] if wait else [(True, "kernel", "kernel")]), rec.report()
    assert rec.complete(), rec.summary().notes


def _cudart():
    """The CUDA runtime library torch loaded, through ctypes (a C caller torch's dispatcher never sees)."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    if not paths:
        pytest.skip("no libcudart.so is mapped in this process")
    return ctypes.CDLL(paths[0])


def test_a_runtime_copy_made_from_c_is_seen_from_the_driver():
    """``cudaMemcpyAsync`` called from C (ctypes here; a pybind11 extension in an engine): the
    runtime reaches the driver, and native capture writes the copy; the host reading the pinned
    destination unsynchronized races with it."""
    cudart = _cudart()
    gpu = torch.randn(N, device="cuda")
    host = torch.empty(N, pin_memory=True)
    side = torch.cuda.Stream()
    with recording() as rec:
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
        status = cudart.cudaMemcpyAsync(ctypes.c_void_p(host.data_ptr()), ctypes.c_void_p(gpu.data_ptr()),
                                        ctypes.c_size_t(gpu.nbytes), 2, ctypes.c_void_p(side.cuda_stream))
        assert status == 0
        host_read(host)
        torch.cuda.synchronize()
    assert ("RAW", "copy", "host_read") in races(rec)


def test_an_op_of_the_dispatcher_is_written_once():
    """Its kernels reach CUPTI too; the RecordFunction observer keeps them out of the native log."""
    x = torch.zeros(N, device="cuda")
    with recording() as rec:
        x.add_(1)
        torch.cuda.synchronize()
    kernels = [op for op in rec.recorder.ops if op["op"] == "kernel"]
    assert [op["name"] for op in kernels] == ["aten.add_.Tensor"]


def test_an_event_recorded_through_torch_is_written_once():
    with recording() as rec:
        e = torch.cuda.Event()
        e.record()
        e.synchronize()
    assert [op["op"] for op in rec.recorder.ops if op["op"] in ("record", "sync_event")] == ["record", "sync_event"]


@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait_stream"])
def test_a_copy_inside_a_replayed_cuda_graph_races_with_a_read_unless_the_reader_waits(wait):
    """A forward pass replayed as a CUDA graph: the copy captured into it runs at each replay, on
    the replay's stream, not at capture. A read of its destination on the default stream races
    with the replay unless the default stream waits for it."""
    src, dst = torch.randn(N, device="cuda"), torch.zeros(N, device="cuda")
    host = torch.empty(N, pin_memory=True)
    graph, warm = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        dst.copy_(src)  # as torch asks: warm up outside the capture
    torch.cuda.current_stream().wait_stream(warm)
    with recording() as rec:
        with torch.cuda.graph(graph):
            dst.copy_(src)  # <- captured
        replay = torch.cuda.Stream()
        with torch.cuda.stream(replay):
            torch.cuda._sleep(20_000_000)
            graph.replay()  # <- the launch
        if wait:
            torch.cuda.current_stream().wait_stream(replay)
        host.copy_(dst, non_blocking=True)
        torch.cuda.synchronize()
    assert rec.capture_off is None, rec.capture_off
    replays = [op for op in rec.recorder.ops if (op.get("name") or "").startswith("graph replay")]
    assert len(replays) == 1, rec.recorder.ops
    assert "test_record_native_gpu.py" in replays[0]["name"]  # the replay's line (torch.cuda.CUDAGraph.replay)
    assert rec.complete(), rec.summary().notes
    assert races(rec) == ([] if wait else [("RAW", "kernel", "copy")])


PROFILED = """
import torch
from kvverify.record import recording
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
    torch.zeros(1, device="cuda").add_(1)
    with recording() as rec:
        torch.zeros(1, device="cuda").add_(1)
print(repr(rec.capture_off))
print(repr([note for note in rec.summary().notes if note.startswith("native capture off")]))
"""


def test_under_the_profiler_native_capture_steps_aside_and_says_so():
    """CUPTI allows one subscriber: under torch.profiler (or Nsight Systems) the recording runs
    with its dispatcher-level capture and names what that cannot see. In a child process: torch's
    profiler keeps CUPTI for the rest of its process."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", PROFILED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    capture_off, notes = (eval(line) for line in child.stdout.strip().splitlines()[-2:])
    if capture_off is None:
        pytest.skip("this CUPTI let a second subscriber in beside the profiler")
    assert notes and "Triton" in notes[0], notes
