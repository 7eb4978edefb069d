"""GPU tests of the kernel copy path (``method="kernel"``, ``torch.ops.kvverify.swap_blocks_kernel``):
byte-exact against the driver's batch for odd page mixes in every direction, descriptors that no
later call can rewrite while an earlier copy may still read them, memory a kernel cannot reach
refused by name, opcheck."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from device_pools import Pool  # noqa: E402

from kvverify.device import kernels, ops  # noqa: E402
from kvverify.device.host_memory import allocate_host  # noqa: E402

SLOT = 4 << 20  # room for a 2 MiB page at any offset used below
SLOTS = 20
# Odd mixes: single words, words past a 16-byte pair, pages around the 64 KiB chunk size, a page
# of many chunks with a partial last one.
SIZES = [8, 24, 40, 4096 + 8, 16 << 10, (64 << 10) - 8, (64 << 10) + 8, (1 << 20) + 24, 2 << 20]


def _batch(rng, src: Pool, dst: Pool, n: int):
    """``n`` copies of mixed sizes between distinct slots, at offsets of 0 or 8 mod 16 on each side
    independently (so both the 16-byte and the 8-byte kernel paths run)."""
    src_slots = rng.choice(SLOTS, n, replace=False)
    dst_slots = rng.choice(SLOTS, n, replace=False)
    sizes = np.array([SIZES[i % len(SIZES)] for i in range(n)], dtype=np.int64)
    rng.shuffle(sizes)
    src_off = rng.integers(0, 4, n) * 8
    dst_off = rng.integers(0, 4, n) * 8
    src_off[:2], dst_off[:2] = (8, 8), (8, 16)  # at least one copy of each kind
    src_ptrs = src.ptr + src_slots * SLOT + src_off
    dst_ptrs = dst.ptr + dst_slots * SLOT + dst_off
    return [torch.tensor(a, dtype=torch.int64) for a in (src_ptrs, dst_ptrs, sizes)]


def _run(method: str, src_kind: str, dst_kind: str, default_stream: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The destination pool's bytes after one batch by ``method``, and what they should be."""
    rng = np.random.default_rng(seed)
    src, dst = Pool(src_kind, SLOTS, SLOT), Pool(dst_kind, SLOTS, SLOT)
    try:
        src_bytes = np.frombuffer(rng.bytes(SLOTS * SLOT), dtype=np.uint8).copy()
        before = np.frombuffer(rng.bytes(SLOTS * SLOT), dtype=np.uint8).copy()  # random poison: a missed byte shows
        src.fill(src_bytes)
        dst.fill(before)
        batch = _batch(rng, src, dst, 2 * len(SIZES))
        torch.cuda.synchronize()
        stream = torch.cuda.default_stream() if default_stream else torch.cuda.Stream()
        with torch.cuda.stream(stream):
            ops.swap_blocks_batch(*batch, method=method)
        stream.synchronize()
        expected = before.copy()
        for s, d, z in zip(*(t.tolist() for t in batch)):
            expected[d - dst.ptr:d - dst.ptr + z] = src_bytes[s - src.ptr:s - src.ptr + z]
        return dst.bytes(), expected
    finally:
        src.free()
        dst.free()


CASES = [("H2D", "pinned", "device"), ("H2D", "registered", "device"), ("D2H", "device", "pinned"),
         ("D2H", "device", "registered"), ("D2D", "device", "device")]


@pytest.mark.parametrize("default_stream", [False, True], ids=["side-stream", "default-stream"])
@pytest.mark.parametrize("direction, src_kind, dst_kind", CASES, ids=[f"{d}-{s}-{t}" for d, s, t in CASES])
def test_kernel_matches_the_driver_batch_byte_for_byte(direction, src_kind, dst_kind, default_stream):
    seed = hash((direction, src_kind, dst_kind)) % 2**32
    got_kernel, expected = _run("kernel", src_kind, dst_kind, default_stream, seed)
    got_batch, expected_again = _run("batch", src_kind, dst_kind, default_stream, seed)
    assert np.array_equal(expected, expected_again)  # the same draws: the same batch
    for name, got in (("kernel", got_kernel), ("batch", got_batch)):
        wrong = np.flatnonzero(got != expected)
        assert wrong.size == 0, f"{name}: {wrong.size} bytes differ, first at byte {wrong[:1]}"


@pytest.mark.parametrize("direction", ["H2D", "D2H"])
def test_many_scattered_16_kib_pages(direction):
    """4096 pages of 16 KiB in one call (the bench's shape), both directions, every byte checked."""
    page, n = 16 << 10, 4096
    rng = np.random.default_rng(14)
    dev = torch.empty(2 * n * page, dtype=torch.uint8, device="cuda")
    with allocate_host("pinned", 2 * n * page) as host:
        data = np.frombuffer(rng.bytes(2 * n * page), dtype=np.uint8).copy()
        src_is_host = direction == "H2D"
        if src_is_host:
            host.numpy(np.uint8)[:] = data
            dev.fill_(0x5A)
            src_base, dst_base = host.ptr, dev.data_ptr()
        else:
            dev.copy_(torch.from_numpy(data))
            host.numpy(np.uint8)[:] = 0x5A
            src_base, dst_base = dev.data_ptr(), host.ptr
        src_slots = rng.choice(2 * n, n, replace=False)
        dst_slots = rng.choice(2 * n, n, replace=False)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            ops.swap_blocks_batch(torch.tensor(src_base + src_slots * page), torch.tensor(dst_base + dst_slots * page),
                                  torch.full((n,), page, dtype=torch.int64), method="kernel")
        s.synchronize()
        out = (dev.cpu().numpy() if src_is_host else host.numpy(np.uint8).copy()).reshape(2 * n, page)
        assert np.array_equal(out[dst_slots], data.reshape(2 * n, page)[src_slots])
        untouched = np.setdiff1d(np.arange(2 * n), dst_slots)
        assert (out[untouched] == 0x5A).all()


def test_one_call_carries_both_directions_interleaved():
    """The bench's ``both`` shape on the kernel path: one call whose pages alternate H2D and D2H
    (2 x 1024 pages of 16 KiB), every byte of both sides checked."""
    page, n = 16 << 10, 1024
    rng = np.random.default_rng(41)
    dev = torch.empty(2 * n * page, dtype=torch.uint8, device="cuda")
    with allocate_host("pinned", 2 * n * page) as host:
        host_data = np.frombuffer(rng.bytes(n * page), dtype=np.uint8).copy()
        dev_data = np.frombuffer(rng.bytes(n * page), dtype=np.uint8).copy()
        # slots [0, n) of each side are sources, slots [n, 2n) destinations, poisoned
        host.numpy(np.uint8)[:n * page] = host_data
        host.numpy(np.uint8)[n * page:] = 0x5A
        dev[:n * page].copy_(torch.from_numpy(dev_data))
        dev[n * page:].fill_(0x5A)
        h_src, d_src = rng.permutation(n), rng.permutation(n)
        h_dst, d_dst = n + rng.permutation(n), n + rng.permutation(n)
        src = np.stack((host.ptr + h_src * page, dev.data_ptr() + d_src * page), axis=1).reshape(-1)
        dst = np.stack((dev.data_ptr() + h_dst * page, host.ptr + d_dst * page), axis=1).reshape(-1)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            ops.swap_blocks_batch(torch.from_numpy(src), torch.from_numpy(dst),
                                  torch.full((2 * n,), page, dtype=torch.int64), method="kernel")
        s.synchronize()
        on_dev = dev.cpu().numpy().reshape(2 * n, page)
        on_host = host.numpy(np.uint8).copy().reshape(2 * n, page)
        assert np.array_equal(on_dev[h_dst], host_data.reshape(n, page)[h_src])  # H2D half
        assert np.array_equal(on_host[d_dst], dev_data.reshape(n, page)[d_src])  # D2H half
        assert np.array_equal(on_dev[:n].reshape(-1), dev_data)  # sources untouched
        assert np.array_equal(on_host[:n].reshape(-1), host_data)


# compute-sanitizer serializes kernels: the 200 ms hold ends before the other stream's calls run,
# and the test rightly refuses to count that as proof (seen under memcheck on the H200).
@pytest.mark.sanitizer_incompatible
def test_descriptors_are_never_rewritten_while_an_earlier_copy_may_read_them():
    """Call A is issued on a held stream: its descriptors wait in pinned memory for their H2D copy.
    While A waits, the caller rewrites A's pointer tensors and 64 more calls run to completion on
    another stream, each staging its own descriptors. Had any of them reused A's pinned block,
    A's copy would read their descriptors and land at their addresses. A must land exactly where
    it was asked to, and the hold must still have been pending when the others finished (else
    the test proved nothing)."""
    page, n = 4096, 64
    dev = torch.zeros(4 * n * page, dtype=torch.uint8, device="cuda")
    with allocate_host("pinned", n * page) as host:
        host.numpy(np.uint8)[:] = np.repeat(np.arange(1, n + 1, dtype=np.uint8), page)  # page i holds i + 1
        held, other = torch.cuda.Stream(), torch.cuda.Stream()
        a_src = torch.tensor(host.ptr + np.arange(n) * page, dtype=torch.int64)
        a_dst = torch.tensor(dev.data_ptr() + np.arange(n) * page, dtype=torch.int64)  # quarter 0
        sizes = torch.full((n,), page, dtype=torch.int64)
        # Warm torch's caching allocators first: 80 calls in flight at once leave 80 pinned blocks of
        # this size (and device blocks on both streams) cached, so no call below allocates (a
        # page-locked or device allocation may synchronize the device, which would end the hold).
        for stream in (held, other):
            with torch.cuda.stream(stream):
                kernels.spin(5_000_000)
                for _ in range(80):
                    ops.swap_blocks_batch(a_src, dev.data_ptr() + 3 * n * page + np.arange(n) * page, sizes,
                                          method="kernel")
        torch.cuda.synchronize()
        dev.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(held):
            kernels.spin(200_000_000)  # 200 ms
            pending = torch.cuda.Event()
            pending.record(held)
            ops.swap_blocks_batch(a_src, a_dst, sizes, method="kernel")
        a_src.fill_(host.ptr)  # the caller reuses its tensors at once
        a_dst.fill_(dev.data_ptr() + 3 * n * page)
        with torch.cuda.stream(other):
            for k in range(64):  # into quarters 1 and 2 only, from reversed host pages
                b_dst = dev.data_ptr() + ((1 + k % 2) * n + np.arange(n)) * page
                ops.swap_blocks_batch(torch.tensor(host.ptr + np.arange(n)[::-1].copy() * page),
                                      torch.tensor(b_dst), sizes, method="kernel")
        other.synchronize()
        still_held = not pending.query()
        torch.cuda.synchronize()
        pages = dev.cpu().numpy().reshape(4, n, page)
    assert still_held, "the hold ended before the other calls finished: raise the spin"
    assert (pages[0] == np.arange(1, n + 1, dtype=np.uint8)[:, None]).all(), "A landed wrong: its descriptors changed"
    assert (pages[1] == np.arange(n, 0, -1, dtype=np.uint8)[:, None]).all()
    assert (pages[3] == 0).all(), "A followed its caller's rewritten tensors"


def test_calls_queued_on_one_held_stream_keep_their_own_descriptors():
    """Eight calls queued behind one hold on the same stream, each to its own destination pages:
    each call's device descriptor buffer comes back to torch's allocator when the call returns, and
    the next call may get it; stream order must keep every copy's descriptors intact."""
    page, n, calls = 8192, 32, 8
    dev = torch.zeros(calls * n * page, dtype=torch.uint8, device="cuda")
    with allocate_host("pinned", calls * n * page) as host:
        host.numpy(np.uint8)[:] = np.repeat(np.arange(calls * n, dtype=np.int64) % 251 + 1, page).astype(np.uint8)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            kernels.spin(50_000_000)
            for c in range(calls):
                pages = np.arange(c * n, (c + 1) * n)
                ops.swap_blocks_batch(torch.tensor(host.ptr + pages * page), torch.tensor(dev.data_ptr() + pages * page),
                                      torch.full((n,), page, dtype=torch.int64), method="kernel")
        s.synchronize()
        assert np.array_equal(dev.cpu().numpy(), host.numpy(np.uint8))


def test_memory_a_kernel_cannot_reach_is_refused_by_name():
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    with allocate_host("pageable", 1 << 20) as pageable:
        with pytest.raises(ValueError, match=r"src_ptrs\[0\] .*pageable host memory.*method='batch'"):
            ops.swap_blocks_batch([pageable.ptr], [dev.data_ptr()], [4096], method="kernel")
        with pytest.raises(ValueError, match=r"dst_ptrs\[1\] .*pageable host memory"):
            ops.swap_blocks_batch([dev.data_ptr()] * 2, [dev.data_ptr() + 8192, pageable.ptr], [4096] * 2, method="kernel")
        # The same copy through the driver is fine: the refusal is the kernel path's alone.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            ops.swap_blocks_batch([dev.data_ptr()], [pageable.ptr], [4096], method="batch")
        s.synchronize()
    with allocate_host("registered", 1 << 20) as registered:  # mapped at its own address on x86-64 Linux
        torch.ops.kvverify.check_pointers(torch.tensor([registered.ptr]), torch.tensor([dev.data_ptr()]),
                                          torch.tensor([4096]), True)


def test_opcheck():
    buf = torch.arange(1024, dtype=torch.uint8, device="cuda")
    out = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    args = (torch.tensor([buf.data_ptr()]), torch.tensor([out.data_ptr()]), torch.tensor([1024]))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.library.opcheck(torch.ops.kvverify.swap_blocks_kernel.default, args)
    s.synchronize()
    assert torch.equal(out, buf)
