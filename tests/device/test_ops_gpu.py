"""GPU tests of swap_blocks_batch: byte-exact round trips for every direction, order, backend and
host memory kind; opcheck; CUDA tensors rejected by name; the context survives a driver error."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from device_pools import Pool  # noqa: E402

from kvverify.device import ops  # noqa: E402
from kvverify.device.host_memory import HOST_MEMORY_KINDS, allocate_host  # noqa: E402
from kvverify.device.ops import SrcAccessOrder  # noqa: E402

SLOT = 8 << 20  # the largest block: 8 MiB
SLOTS = 16
BLOCK_SIZES = [8, 24, 4096, 65536 + 8, 1 << 20, SLOT]
PATHS = ["batch", "loop", "cuda-python"]


def random_bytes(rng) -> np.ndarray:
    return rng.integers(0, 256, SLOTS * SLOT, dtype=np.uint8)


def run_path(path, src, dst, sizes, order):
    if path == "batch":
        ops.swap_blocks_batch(src, dst, sizes, order)
    elif path == "loop":
        ops.swap_blocks_batch(src, dst, sizes, order, use_batch_api=False)
    else:
        ops.swap_blocks_batch(src, dst, sizes, order, backend="cuda-python")


@pytest.fixture(params=["D2H", "H2D", "D2D"])
def direction(request):
    return request.param


CASES = [(d, h) for d in ("D2H", "H2D") for h in HOST_MEMORY_KINDS] + [("D2D", "device")]


@pytest.mark.parametrize("direction, host_kind", CASES, ids=[f"{d}-{h}" for d, h in CASES])
@pytest.mark.parametrize("order", list(SrcAccessOrder), ids=lambda o: o.name)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("default_stream", [False, True], ids=["side-stream", "default-stream"])
def test_round_trip_is_byte_exact(direction, host_kind, order, path, default_stream):
    rng = np.random.default_rng(hash((direction, host_kind, int(order), path, default_stream)) % 2**32)
    src_kind, dst_kind = {"D2H": ("device", host_kind), "H2D": (host_kind, "device"), "D2D": ("device", "device")}[direction]
    src_pool, dst_pool = Pool(src_kind, SLOTS, SLOT), Pool(dst_kind, SLOTS, SLOT)
    try:
        src_bytes = src_pool.fill(random_bytes(rng))
        dst_before = dst_pool.fill(random_bytes(rng))  # random "poison": a missed byte cannot match by chance
        n = 12
        src_slots = rng.choice(SLOTS, n, replace=False)
        dst_slots = rng.choice(SLOTS, n, replace=False)
        sizes = rng.choice(BLOCK_SIZES, n)
        offsets = rng.integers(0, 8, n) * 8  # not only slot-aligned addresses
        sizes = np.minimum(sizes, SLOT - offsets)
        src = torch.tensor(src_pool.ptr + src_slots * SLOT + offsets, dtype=torch.int64)
        dst = torch.tensor(dst_pool.ptr + dst_slots * SLOT + offsets, dtype=torch.int64)
        size = torch.tensor(sizes, dtype=torch.int64)
        torch.cuda.synchronize()
        stream = torch.cuda.default_stream() if default_stream else torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run_path(path, src, dst, size, order)
        stream.synchronize()
        expected = dst_before.copy()
        for s, d, z, o in zip(src_slots, dst_slots, sizes, offsets):
            expected[d * SLOT + o : d * SLOT + o + z] = src_bytes[s * SLOT + o : s * SLOT + o + z]
        got = dst_pool.bytes()
        mismatch = np.flatnonzero(got != expected)
        assert mismatch.size == 0, f"{mismatch.size} bytes differ, first at byte {mismatch[:1]}"
    finally:
        src_pool.free()
        dst_pool.free()


def test_backends_agree_on_the_same_batch():
    """The extension and cuda-python move the same bytes for one scattered D2H batch."""
    rng = np.random.default_rng(7)
    src = Pool("device", SLOTS, SLOT)
    outs = {}
    try:
        src.fill(random_bytes(rng))
        slots = rng.choice(SLOTS, 12, replace=False)
        sizes = torch.tensor(rng.choice(BLOCK_SIZES, 12), dtype=torch.int64)
        for backend in ops.BACKENDS:
            dst = Pool("pinned", SLOTS, SLOT)
            dst.host.numpy(np.uint8)[:] = 0xA5
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                ops.swap_blocks_batch(
                    torch.tensor(src.ptr + slots * SLOT, dtype=torch.int64),
                    torch.tensor(dst.ptr + np.arange(12) * SLOT, dtype=torch.int64),
                    sizes,
                    SrcAccessOrder.ANY,
                    backend=backend,
                )
            s.synchronize()
            outs[backend] = dst.bytes()
            dst.free()
    finally:
        src.free()
    a, b = outs.values()
    assert np.array_equal(a, b) and not np.all(a == 0xA5)


@pytest.mark.parametrize("path", [*PATHS, "kernel"])
def test_a_fresh_worker_thread_can_swap(path):
    """A thread whose first CUDA work is the op (an engine's transfer thread): the driver API needs
    the device's context current there, which no runtime call has made yet."""
    import threading

    src = Pool("pinned", 1, 4096)
    dst = Pool("device", 1, 4096)
    outcome = {}

    def transfer():
        try:
            sizes = torch.tensor([4096], dtype=torch.int64)
            src_ptrs, dst_ptrs = torch.tensor([src.ptr], dtype=torch.int64), torch.tensor([dst.ptr], dtype=torch.int64)
            if path == "kernel":
                ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes, SrcAccessOrder.ANY, method="kernel")
            else:
                run_path(path, src_ptrs, dst_ptrs, sizes, SrcAccessOrder.ANY)
            torch.cuda.current_stream().synchronize()
            outcome["ok"] = True
        except Exception as exc:  # reported below, with the thread's message
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    try:
        expected = src.fill(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8))
        worker = threading.Thread(target=transfer)
        worker.start()
        worker.join()
        assert outcome == {"ok": True}, outcome.get("error")
        torch.cuda.synchronize()
        assert np.array_equal(dst.bytes(), expected)
    finally:
        src.free()
        dst.free()


def test_opcheck():
    buf = torch.arange(1024, dtype=torch.uint8, device="cuda")
    out = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    args = (
        torch.tensor([buf.data_ptr()], dtype=torch.int64),
        torch.tensor([out.data_ptr()], dtype=torch.int64),
        torch.tensor([1024], dtype=torch.int64),
        1,
    )
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # buf and out are written on the default stream
    with torch.cuda.stream(s):
        torch.library.opcheck(torch.ops.kvverify.swap_blocks_batch.default, args)
        torch.library.opcheck(torch.ops.kvverify.swap_blocks_loop.default, args[:3])
    s.synchronize()
    assert torch.equal(out, buf)


@pytest.mark.parametrize("which", ["src_ptrs", "dst_ptrs", "sizes"])
@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
def test_cuda_pointer_tensors_are_rejected_by_name(which, entry):
    args = {k: torch.tensor([8], dtype=torch.int64) for k in ("src_ptrs", "dst_ptrs", "sizes")}
    args[which] = args[which].cuda()
    with pytest.raises(ValueError, match=f"{which} must be on the CPU"):
        if entry == "wrapper":
            ops.swap_blocks_batch(**args)
        else:
            torch.ops.kvverify.swap_blocks_batch(args["src_ptrs"], args["dst_ptrs"], args["sizes"], 1)


def test_batch_api_is_present_on_this_driver():
    # The H200 hosts we test on run driver 580 (CUDA 13.0): the batch path must be the one tested.
    assert ops.batch_api_available()


def _valid_copy_works():
    a = torch.arange(4096, dtype=torch.uint8, device="cuda")
    with allocate_host("pinned", 4096) as host:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # a is written on the default stream
        with torch.cuda.stream(s):
            ops.swap_blocks_batch([a.data_ptr()], [host.ptr], [4096], SrcAccessOrder.STREAM)
        s.synchronize()
        return np.array_equal(host.numpy(np.uint8), a.cpu().numpy())


@pytest.mark.sanitizer_incompatible  # memcheck counts the driver error it provokes on purpose as an error
def test_context_is_usable_after_a_driver_error_cuda_python():
    from kvverify.device import cuda_python

    a = torch.zeros(64, dtype=torch.uint8, device="cuda")
    b = torch.zeros(64, dtype=torch.uint8, device="cuda")
    # srcAccessOrder 0 (INVALID) passes no validation of ours: the driver must refuse it with
    # CUDA_ERROR_INVALID_VALUE (CUDA Driver API, cuMemcpyBatchAsync).
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
            cuda_python.swap_blocks_batch([a.data_ptr()], [b.data_ptr()], [64], 0)
    assert _valid_copy_works()


def _freed_device_address():
    """An address of device memory given back to the driver. Allocated with cudaMalloc itself: a
    tensor freed to torch's cache may sit in a segment that other live blocks keep mapped (it did
    once kernel-path tests ran first), and then the address is still CUDA memory."""
    cudart = pytest.importorskip("cuda.bindings.runtime")
    err, address = cudart.cudaMalloc(64 << 20)
    assert err == cudart.cudaError_t.cudaSuccess
    (err,) = cudart.cudaFree(address)
    assert err == cudart.cudaError_t.cudaSuccess
    return int(address)


UNMAPPED_HOST = 0x7E0000001000  # far from the heap, stacks and CUDA's reservations on x86-64 Linux


# compute-sanitizer keeps freed allocations mapped (to catch use after free), so a freed address
# still resolves and the check cannot refuse it there.
FREED = pytest.mark.sanitizer_incompatible


@pytest.mark.parametrize("backend", ops.BACKENDS)
@pytest.mark.parametrize(
    "case", [pytest.param("freed-device-src", marks=FREED), pytest.param("freed-device-dst", marks=FREED),
             "unmapped-host-src", "unmapped-host-dst", "pinned-overrun", "device-overrun"]
)
def test_unresolvable_pointers_are_rejected_before_the_driver(case, backend):
    """Without the check these copies kill the process with SIGSEGV (docs/op.md); with it they
    raise ValueError naming the copy, and the context goes on working."""
    cudart = pytest.importorskip("cuda.bindings.runtime")
    dev = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    with allocate_host("pinned", 1 << 20) as pinned:
        exact = None
        if case in ("freed-device-src", "freed-device-dst"):
            bad = _freed_device_address()
            src, dst, size = (bad, pinned.ptr, 4096) if case.endswith("src") else (pinned.ptr, bad, 4096)
            arg = "src_ptrs[0]" if case.endswith("src") else "dst_ptrs[0]"
        elif case.startswith("unmapped"):
            src, dst, size = (UNMAPPED_HOST, dev.data_ptr(), 4096) if case.endswith("src") else (dev.data_ptr(), UNMAPPED_HOST, 4096)
            arg = "src_ptrs[0]" if case.endswith("src") else "dst_ptrs[0]"
        elif case == "pinned-overrun":
            src, dst, size, arg = pinned.ptr, dev.data_ptr(), 2 << 20, "src_ptrs[0]"
        else:
            err, exact = cudart.cudaMalloc(1 << 20)  # exact size: torch's segments are larger
            assert err == cudart.cudaError_t.cudaSuccess
            src, dst, size, arg = int(exact), dev.data_ptr(), 2 << 20, "src_ptrs[0]"
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                with pytest.raises(ValueError, match=arg.replace("[", r"\[").replace("]", r"\]")):
                    ops.swap_blocks_batch([src], [dst], [size], SrcAccessOrder.ANY, backend=backend)
        finally:
            if exact is not None:
                cudart.cudaFree(exact)
    assert _valid_copy_works()


def test_valid_pointers_pass_the_check_for_every_memory_kind():
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    for kind in HOST_MEMORY_KINDS:
        with allocate_host(kind, 1 << 20) as host:
            torch.ops.kvverify.check_pointers(
                torch.tensor([host.ptr, dev.data_ptr()]), torch.tensor([dev.data_ptr(), host.ptr]), torch.tensor([1 << 20, 1 << 20])
            )
