"""GPU tests of the harness kernels (kvverify.device.kernels) against the numpy reference (kvverify.device.pattern).

Blocks live in device memory, in pinned host memory (torch's pin_memory) and in registered host
memory (an mmap registered with cudaHostRegister), the latter two reached by the kernels through
UVA. Blocks sit one poison word apart, starting 0 or 8 bytes into their allocation, so both the
16-byte-aligned and the 8-byte-head paths run and any write outside a block shows as a changed
gap word.
"""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from kvverify.device import kernels, pattern
from kvverify.device.pattern import BlockState

MS = 1_000_000  # nanoseconds per millisecond
POISON = pattern.POISON_WORD
KINDS = ["device", "pinned", "registered"]
WORDS = [1, 2, 3, 515, 4099]  # 4099: the 4-deep unrolled loop, the remainder loop and a tail word
OFFSETS = [0, 8]


class Blocks:
    """``n`` blocks of ``words`` words in one allocation of ``kind`` memory, one poison word apart,
    the first ``offset`` bytes in. ``ptrs`` holds their addresses (numpy int64)."""

    GAP = 1  # words between blocks; with it the blocks alternate 16- and 8-byte alignment

    def __init__(self, kind: str, n: int, words: int, offset: int = 0):
        self.kind, self.n, self.words = kind, n, words
        self.stride = words + self.GAP
        self.first = offset // 8
        self.total = self.first + n * self.stride
        self._registered = None
        if kind == "device":
            self.tensor = torch.empty(self.total, dtype=torch.int64, device="cuda")
            base = self.tensor.data_ptr()
        elif kind == "pinned":
            self.tensor = torch.empty(self.total, dtype=torch.int64, pin_memory=True)
            self.host = self.tensor.numpy().view(np.uint64)
            base = self.tensor.data_ptr()
        elif kind == "registered":
            size = -(-self.total * 8 // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages
            self._mm = mmap.mmap(-1, size)  # page aligned, pageable until registered
            self.host = np.frombuffer(self._mm, dtype=np.uint64, count=self.total)
            base = self.host.ctypes.data
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(base, size, 0)  # default flags: mapped and portable under UVA
            assert err == cudart.cudaError.success, f"cudaHostRegister failed: {err}"
            self._registered = base
        else:
            raise ValueError(kind)
        self.ptrs = (base + 8 * (self.first + self.stride * np.arange(n, dtype=np.int64))).astype(np.int64)
        self.mask = np.zeros(self.total, dtype=bool)
        self.blocks_of(self.mask)[:] = True
        self.store(np.full(self.total, POISON, dtype=np.uint64))

    def blocks_of(self, all_words: np.ndarray) -> np.ndarray:
        """The (n, words) view of the blocks inside an array of all words."""
        return all_words[self.first :].reshape(self.n, self.stride)[:, : self.words]

    def store(self, all_words: np.ndarray) -> None:
        if self.kind == "device":
            self.tensor.copy_(torch.from_numpy(all_words.view(np.int64)))
            torch.cuda.synchronize()
        else:
            self.host[:] = all_words

    def load(self) -> np.ndarray:
        """A copy of all words (the caller synchronises first)."""
        if self.kind == "device":
            return self.tensor.cpu().numpy().view(np.uint64)
        return self.host.copy()

    def store_blocks(self, blocks: np.ndarray) -> None:
        all_words = np.full(self.total, POISON, dtype=np.uint64)
        self.blocks_of(all_words)[:] = blocks
        self.store(all_words)

    def gaps_untouched(self, all_words: np.ndarray) -> bool:
        return bool((all_words[~self.mask] == POISON).all())

    def close(self) -> None:
        if self._registered is not None:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None


@pytest.fixture
def make_blocks():
    made = []

    def make(*args, **kwargs):
        b = Blocks(*args, **kwargs)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def random_ids(rng, n):
    return rng.integers(-(1 << 63), (1 << 63) - 1, size=n, dtype=np.int64)


def built_cases(ids, words, expected, seed, rng):
    """Host-built blocks covering every state on purpose, then random mixtures and corruptions."""
    n = len(ids)
    blocks = pattern.pattern_words(ids, words, expected, seed)  # OK unless changed below
    older = pattern.pattern_words(ids, words, expected - 1, seed)
    newer = pattern.pattern_words(ids, words, expected + 5, seed)
    blocks[1] = older[1]  # STALE
    blocks[2] = newer[2]  # STALE (newer)
    if words >= 2:
        blocks[3, words // 2 :] = older[3, words // 2 :]  # TORN
    blocks[4, words - 1] ^= np.uint64(1 << 3)  # GARBAGE: one flipped bit in the last word
    blocks[5] = pattern.pattern_words(ids[6:7], words, expected, seed)[0]  # GARBAGE: block 6's bytes at 5
    blocks[6] = POISON  # GARBAGE: poison
    blocks[7] = 0  # GARBAGE: "uninitialised"
    blocks[8, 0] = POISON  # GARBAGE: one poison word
    for j in range(9, n):  # random: per word one of three generations, sometimes one bad bit
        gens = rng.choice([expected - 1, expected, expected + 5], size=words) if rng.random() < 0.5 else \
            np.full(words, rng.choice([expected - 1, expected]))
        for g in np.unique(gens):
            sel = gens == g
            blocks[j, sel] = pattern.pattern_words(ids[j : j + 1], words, int(g), seed)[0, sel]
        if rng.random() < 0.3:
            blocks[j, rng.integers(words)] ^= np.uint64(1) << np.uint64(rng.integers(64))
    return blocks


# ---- write ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("words", WORDS)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_write_equals_reference(make_blocks, kind, words, offset):
    rng = np.random.default_rng(words * 10 + offset)
    b = make_blocks(kind, 9, words, offset)
    ids = random_ids(rng, b.n)
    seed = int(rng.integers(0, 1 << 63)) * 2 + 1  # above 2**63 half the time
    seed &= (1 << 64) - 1
    kernels.write_blocks(b.ptrs, words * 8, ids, 7, seed)
    torch.cuda.synchronize()
    all_words = b.load()
    np.testing.assert_array_equal(b.blocks_of(all_words), pattern.pattern_words(ids, words, 7, seed))
    states, gens = pattern.classify_blocks(b.blocks_of(all_words), ids, 7, seed)
    assert (states == BlockState.OK).all() and (gens == 7).all()
    assert b.gaps_untouched(all_words), "write_blocks wrote outside its blocks"


def test_kernel_write_large_pool_with_cuda_tensors(make_blocks):
    """Many blocks (more than the grid: the grid-stride loop), addresses and ids already on the device."""
    b = make_blocks("device", 2000, 1024 + 1)
    ids = np.arange(b.n, dtype=np.int64) * 3
    ptrs, ids_dev = torch.from_numpy(b.ptrs).cuda(), torch.from_numpy(ids).cuda()
    kernels.write_blocks(ptrs, b.words * 8, ids_dev, pattern.MAX_GENERATION, 77)
    torch.cuda.synchronize()
    all_words = b.load()
    states, gens = pattern.classify_blocks(b.blocks_of(all_words), ids, pattern.MAX_GENERATION, 77)
    assert (states == BlockState.OK).all() and (gens == pattern.MAX_GENERATION).all()
    assert b.gaps_untouched(all_words)


# ---- verify -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("words", WORDS)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_verify_equals_reference(make_blocks, kind, words, offset):
    rng = np.random.default_rng(1000 + words * 10 + offset)
    b = make_blocks(kind, 40, words, offset)
    ids = random_ids(rng, b.n)
    seed, expected = int(rng.integers(0, 1 << 62)), 50
    host_blocks = built_cases(ids, words, expected, seed, rng)
    b.store_blocks(host_blocks)
    want_states, want_gens = pattern.classify_blocks(host_blocks, ids, expected, seed)
    got_states, got_gens = kernels.verify_blocks(b.ptrs, words * 8, ids, expected, seed)
    assert got_states.dtype == torch.int8 and got_gens.dtype == torch.int64 and got_states.is_cuda
    np.testing.assert_array_equal(got_states.cpu().numpy(), want_states)
    np.testing.assert_array_equal(got_gens.cpu().numpy(), want_gens)
    # The deliberate cases are what they claim to be.
    want = [BlockState.OK, BlockState.STALE, BlockState.STALE, BlockState.TORN if words >= 2 else BlockState.OK] + [BlockState.GARBAGE] * 5
    assert want_states[:9].tolist() == want
    assert want_gens[:3].tolist() == [expected, expected - 1, expected + 5]


def test_kernel_write_then_kernel_verify(make_blocks):
    b = make_blocks("device", 64, 65536 + 1, offset=8)
    ids = np.arange(b.n, dtype=np.int64) + 1000
    ptrs, ids_dev = torch.from_numpy(b.ptrs).cuda(), torch.from_numpy(ids).cuda()
    kernels.write_blocks(ptrs, b.words * 8, ids_dev, 3, 9)
    states, gens = kernels.verify_blocks(ptrs, b.words * 8, ids_dev, 3, 9)
    assert (states.cpu() == BlockState.OK).all() and (gens.cpu() == 3).all()
    states, gens = kernels.verify_blocks(ptrs, b.words * 8, ids_dev, 4, 9)
    assert (states.cpu() == BlockState.STALE).all() and (gens.cpu() == 3).all()
    states, _ = kernels.verify_blocks(ptrs, b.words * 8, ids_dev + 1, 3, 9)  # every block at the wrong id
    assert (states.cpu() == BlockState.GARBAGE).all()
    kernels.write_blocks(ptrs[5:6], b.words * 8, ids_dev[5:6], 4, 9)  # block 5 moves on to generation 4
    states, gens = kernels.verify_blocks(ptrs, b.words * 8, ids_dev, 3, 9)
    s = states.cpu().numpy()
    assert s[5] == BlockState.STALE and gens.cpu()[5] == 4 and (np.delete(s, 5) == BlockState.OK).all()


def test_bad_addresses_in_cuda_tensors_are_skipped_not_faulted(make_blocks):
    """A null or misaligned address reaching the kernels in a CUDA tensor must not fault the context."""
    b = make_blocks("device", 2, 8)
    ptrs = torch.tensor([int(b.ptrs[0]), 0, int(b.ptrs[1]) + 4], dtype=torch.int64, device="cuda")
    ids = torch.tensor([0, 1, 2], dtype=torch.int64, device="cuda")
    kernels.write_blocks(ptrs, 64, ids, 1, 2)
    states, gens = kernels.verify_blocks(ptrs, 64, ids, 1, 2)
    sums = kernels.checksum_blocks(ptrs, 64)
    torch.cuda.synchronize()
    assert states.cpu().tolist() == [BlockState.OK, BlockState.GARBAGE, BlockState.GARBAGE]
    assert gens.cpu().tolist() == [1, -1, -1]
    assert sums.cpu().tolist()[1:] == [0, 0]
    assert (b.blocks_of(b.load())[1] == POISON).all()  # the misaligned block was not written


# ---- checksum ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("words", WORDS)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_checksum_equals_reference(make_blocks, kind, words, offset):
    rng = np.random.default_rng(2000 + words * 10 + offset)
    b = make_blocks(kind, 12, words, offset)
    data = rng.integers(0, 1 << 64, size=(b.n, words), dtype=np.uint64, endpoint=False)
    data[0] = 0
    data[1] = POISON
    b.store_blocks(data)
    got = kernels.checksum_blocks(b.ptrs, words * 8)
    assert got.dtype == torch.int64 and got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), pattern.checksum_blocks_reference(data))


# ---- spin, spin before write, read --------------------------------------------------------------------


def elapsed_ms(stream, launch):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    launch()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def test_spin_holds_the_stream():
    s = torch.cuda.Stream()
    kernels.spin(1000, stream=s)  # first launch loads the module
    torch.cuda.synchronize()
    for ms in (5, 20):
        assert elapsed_ms(s, lambda ms=ms: kernels.spin(ms * MS, stream=s)) >= 0.9 * ms
    with torch.cuda.stream(s):  # the current stream when none is given
        assert elapsed_ms(s, lambda: kernels.spin(10 * MS)) >= 0.9 * 10


@pytest.mark.sanitizer_incompatible  # a kernel on another stream must run meanwhile: the sanitizer serializes
def test_write_with_spin_delays_the_write_and_leaves_room(make_blocks):
    b = make_blocks("device", 8, 64)
    ptrs, ids = torch.from_numpy(b.ptrs).cuda(), torch.arange(b.n, dtype=torch.int64, device="cuda")
    writer, other = torch.cuda.Stream(), torch.cuda.Stream()
    kernels.write_blocks(ptrs, 512, ids, 1, 5, stream=writer)  # warm up (module load)
    # Warm up too the allocator's cache for verify's outputs on `other`, so that the verify during
    # the spin allocates nothing (device allocations may synchronise).
    kernels.verify_blocks(ptrs, 512, ids, 1, 5, stream=other)  # results dropped at once
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(writer)
    kernels.write_blocks(ptrs, 512, ids, 2, 5, spin_ns=300 * MS, stream=writer)
    end.record(writer)
    assert not end.query(), "write_blocks with spin_ns finished at once"
    # A kernel on another stream runs during the spin and still sees the old generation.
    states, gens = kernels.verify_blocks(ptrs, 512, ids, 2, 5, stream=other)
    other.synchronize()
    assert not end.query(), "the spinning writer kept the other stream from running"
    assert (states.cpu() == BlockState.STALE).all() and (gens.cpu() == 1).all()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.9 * 300
    states, gens = kernels.verify_blocks(ptrs, 512, ids, 2, 5)
    assert (states.cpu() == BlockState.OK).all()


@pytest.mark.sanitizer_incompatible  # a kernel on another stream must run meanwhile: the sanitizer serializes
def test_read_blocks_reads_for_the_duration_and_writes_nothing(make_blocks):
    b = make_blocks("device", 16, 1000)
    ptrs, ids = torch.from_numpy(b.ptrs).cuda(), torch.arange(b.n, dtype=torch.int64, device="cuda")
    kernels.write_blocks(ptrs, 8000, ids, 4, 4)
    torch.cuda.synchronize()
    before = b.load()
    reader, other = torch.cuda.Stream(), torch.cuda.Stream()
    kernels.read_blocks(ptrs, 8000, 0, stream=reader)  # warm up: one pass
    torch.cuda.synchronize()
    assert elapsed_ms(reader, lambda: kernels.read_blocks(ptrs, 8000, 20 * MS, stream=reader)) >= 0.9 * 20
    np.testing.assert_array_equal(b.load(), before)
    # While a long reader runs, a writer on another stream still runs (and finishes first).
    end = torch.cuda.Event()
    kernels.read_blocks(ptrs, 8000, 300 * MS, stream=reader)
    end.record(reader)
    kernels.write_blocks(ptrs, 8000, ids, 5, 4, stream=other)
    other.synchronize()
    assert not end.query(), "the reader kept the other stream from running"
    end.synchronize()


@pytest.mark.sanitizer_incompatible  # a kernel on another stream must run meanwhile: the sanitizer serializes
def test_host_addresses_do_not_wait_for_a_held_stream(make_blocks):
    """Numpy addresses are staged asynchronously: a call behind a held stream returns at once."""
    b = make_blocks("device", 4, 32)
    ids = np.arange(b.n, dtype=np.int64)
    s = torch.cuda.Stream()
    kernels.write_blocks(b.ptrs, 256, ids, 1, 1, stream=s)  # warm up the pinned and device caches
    torch.cuda.synchronize()
    kernels.spin(300 * MS, stream=s)
    t0 = time.perf_counter()
    kernels.write_blocks(b.ptrs, 256, ids, 2, 1, stream=s)
    seconds = time.perf_counter() - t0
    done = torch.cuda.Event()
    done.record(s)
    assert not done.query() and seconds < 0.15, f"write_blocks took {seconds:.3f} s behind a held stream"
    done.synchronize()
    states, _ = kernels.verify_blocks(b.ptrs, 256, ids, 2, 1)
    assert (states.cpu() == BlockState.OK).all()


# ---- arguments ---------------------------------------------------------------------------------------


def test_invalid_arguments_raise_naming_the_argument(make_blocks):
    b = make_blocks("device", 2, 4)
    op = kernels.ops()
    ptrs, ids = torch.from_numpy(b.ptrs).cuda(), torch.tensor([0, 1], dtype=torch.int64, device="cuda")
    cases = [
        # the ops themselves (C++ checks)
        (lambda: op.write_blocks(ptrs, 12, ids, 0, 0, 0), ValueError, "block_bytes"),
        (lambda: op.verify_blocks(ptrs, 0, ids, 0, 0), ValueError, "block_bytes"),
        (lambda: op.checksum_blocks(ptrs, -8), ValueError, "block_bytes"),
        (lambda: op.write_blocks(ptrs, 32, ids, -1, 0, 0), ValueError, "generation"),
        (lambda: op.write_blocks(ptrs, 32, ids, pattern.POISON_GENERATION, 0, 0), ValueError, "generation"),
        (lambda: op.verify_blocks(ptrs, 32, ids, 1 << 32, 0), ValueError, "expected_generation"),
        (lambda: op.write_blocks(ptrs, 32, ids, 0, 0, -1), ValueError, "spin_ns"),
        (lambda: op.read_blocks(ptrs, 32, -1), ValueError, "duration_ns"),
        (lambda: op.spin(-1), ValueError, "duration_ns"),
        (lambda: op.spin(61 * 1000 * MS), ValueError, "duration_ns"),
        (lambda: op.verify_blocks(ptrs.float(), 32, ids, 0, 0), TypeError, "block_ptrs"),
        (lambda: op.verify_blocks(ptrs, 32, ids.int(), 0, 0), TypeError, "block_ids"),
        (lambda: op.write_blocks(ptrs, 32, ids[:1], 0, 0, 0), ValueError, "block_ids"),
        (lambda: op.checksum_blocks(ptrs.view(1, 2), 32), ValueError, "block_ptrs"),
        (lambda: op.verify_blocks(ptrs.cpu(), 32, ids, 0, 0), ValueError, "block_ptrs"),
        # the wrappers (host-side checks)
        (lambda: kernels.write_blocks(b.ptrs + 4, 32, [0, 1], 0, 0), ValueError, "block_ptrs"),
        (lambda: kernels.verify_blocks(np.array([0, b.ptrs[1]]), 32, [0, 1], 0, 0), ValueError, "block_ptrs"),
        (lambda: kernels.checksum_blocks(b.ptrs.astype(np.float64), 32), TypeError, "block_ptrs"),
        (lambda: kernels.verify_blocks(b.ptrs, 32.0, [0, 1], 0, 0), TypeError, "block_bytes"),
        (lambda: kernels.verify_blocks(b.ptrs, 32, [0, 1], 0, 1 << 64), ValueError, "seed"),
        (lambda: kernels.read_blocks(b.ptrs, 33, 0), ValueError, "block_bytes"),
        (lambda: kernels.spin(1.5), TypeError, "duration_ns"),
    ]
    for call, exc, name in cases:
        with pytest.raises(exc, match=name):
            call()
    kernels.spin(0)  # nothing was launched with bad arguments: the context is fine
    torch.cuda.synchronize()


def test_seed_above_2_63_matches_reference(make_blocks):
    b = make_blocks("device", 3, 5)
    ids = np.array([1, 2, 3], dtype=np.int64)
    seed = (1 << 64) - 12345
    kernels.write_blocks(b.ptrs, 40, ids, 6, seed)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(b.blocks_of(b.load()), pattern.pattern_words(ids, 5, 6, seed))
    states, _ = kernels.verify_blocks(b.ptrs, 40, ids, 6, seed - (1 << 64))  # the same seed mod 2**64
    assert (states.cpu() == BlockState.OK).all()


def test_empty_block_lists():
    empty = np.zeros(0, dtype=np.int64)
    kernels.write_blocks(empty, 8, empty, 0, 0)
    kernels.read_blocks(empty, 8, 0)
    states, gens = kernels.verify_blocks(empty, 8, empty, 0, 0)
    assert states.shape == gens.shape == (0,)
    assert kernels.checksum_blocks(empty, 8).shape == (0,)


def test_opcheck(make_blocks):
    b = make_blocks("device", 3, 16)
    ptrs, ids = torch.from_numpy(b.ptrs).cuda(), torch.tensor([4, 5, 6], dtype=torch.int64, device="cuda")
    kernels.write_blocks(ptrs, 128, ids, 1, 2)
    op = kernels.ops()  # registers the fake kernels
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(op.verify_blocks.default, (ptrs, 128, ids, 1, 2), test_utils=utils)
    torch.library.opcheck(op.checksum_blocks.default, (ptrs, 128), test_utils=utils)
