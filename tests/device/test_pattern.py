"""CPU tests of the block-pattern reference (kvverify.device.pattern).

The scalar functions below re-derive h32, the classification and the checksum from their
documented definitions, one Python int at a time, so the vectorised code is checked against
something independent of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvverify.device import pattern
from kvverify.device.pattern import BlockState

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF


# ---- scalar re-derivations of the documented definitions ----------------------------------


def fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def h32_scalar(seed: int, b: int, g: int, i: int) -> int:
    seed &= M64
    b &= M64
    key = fmix32(0x6A09E667 ^ (seed >> 32))
    key = fmix32(key ^ (seed & M32))
    key = fmix32(key ^ (b >> 32))
    key = fmix32(key ^ (b & M32))
    return fmix32((key + (g & M32) * 0x9E3779B1 + (i & M32) * 0x85EBCA77) & M32)


def word_scalar(seed, b, g, i) -> int:
    return (g << 32) | h32_scalar(seed, b, g, i)


def classify_scalar(words, b: int, expected: int, seed: int) -> tuple[int, int]:
    gens = set()
    for i, w in enumerate(int(x) for x in words):
        g = w >> 32
        if g == 0xFFFFFFFF or (w & M32) != h32_scalar(seed, b, g, i):
            return BlockState.GARBAGE, -1
        gens.add(g)
    if len(gens) > 1:
        return BlockState.TORN, -1
    (g,) = gens
    return (BlockState.OK if g == expected else BlockState.STALE), g


def mix64_scalar(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def checksum_scalar(words) -> int:
    s = sum(mix64_scalar(int(w) ^ ((i * 0x9E3779B97F4A7C15) & M64)) for i, w in enumerate(words)) & M64
    return s - (1 << 64) if s >= 1 << 63 else s


# ---- h32 ------------------------------------------------------------------------------------


def test_h32_matches_scalar_definition():
    rng = np.random.default_rng(0)
    for _ in range(200):
        seed = int(rng.integers(0, 1 << 63)) * int(rng.integers(1, 3))  # some seeds >= 2**63
        b = int(rng.integers(-(1 << 63), 1 << 63))
        g = int(rng.integers(0, 1 << 32))
        i = int(rng.integers(0, 1 << 32))
        assert int(pattern.h32(seed, b, g, i)) == h32_scalar(seed, b, g, i), (seed, b, g, i)


def test_h32_known_values():
    # Pinned so that an accidental change of the definition is loud (also checked against
    # csrc/harness/pattern.cuh in tests/device/test_pattern_cuh.py).
    assert [int(pattern.h32(0, 0, 0, i)) for i in range(3)] == [h32_scalar(0, 0, 0, i) for i in range(3)]
    assert int(pattern.h32(42, 7, 3, 5)) == h32_scalar(42, 7, 3, 5)
    assert int(pattern.h32(-1, -1, 0, 0)) == h32_scalar(M64, M64, 0, 0)


def test_h32_broadcasts():
    out = pattern.h32(1, np.arange(4)[:, None], 2, np.arange(5)[None, :])
    assert out.shape == (4, 5) and out.dtype == np.uint32
    assert int(out[3, 4]) == h32_scalar(1, 3, 2, 4)


def test_h32_is_injective_in_each_of_generation_word_and_block_low_half():
    # One coordinate varied, the rest fixed: bijective steps mean no two values collide.
    assert len(set(pattern.h32(9, 5, np.arange(100_000), 17).tolist())) == 100_000
    assert len(set(pattern.h32(9, 5, 17, np.arange(100_000)).tolist())) == 100_000
    assert len(set(pattern.h32(9, np.arange(100_000), 17, 3).tolist())) == 100_000


def test_block_keys_accept_negative_and_large_ids():
    ids = np.array([-1, 0, 1 << 40, (1 << 63) - 1], dtype=np.int64)
    blocks = pattern.pattern_words(ids, 3, 1, seed=5)
    for j, b in enumerate(ids.tolist()):
        assert [int(w) for w in blocks[j]] == [word_scalar(5, b, 1, i) for i in range(3)]


# ---- fill / classify ------------------------------------------------------------------------


def test_fill_matches_scalar_definition():
    ids = np.array([0, 3, 99, 12345678901], dtype=np.int64)
    blocks = np.zeros((4, 9), dtype=np.uint64)
    pattern.fill_blocks(blocks, ids, generation=77, seed=2024)
    for j, b in enumerate(ids.tolist()):
        assert [int(w) for w in blocks[j]] == [word_scalar(2024, b, 77, i) for i in range(9)]


@pytest.mark.parametrize("words", [1, 2, 7, 512, pattern.TILE_WORDS + 3])
def test_fill_classify_round_trip(words):
    n = 5
    ids = np.arange(n, dtype=np.int64) * 31 + 2
    blocks = np.empty((n, words), dtype=np.uint64)
    pattern.fill_blocks(blocks, ids, 4, 11)
    states, gens = pattern.classify_blocks(blocks, ids, 4, 11)
    assert states.dtype == np.int8 and gens.dtype == np.int64
    assert (states == BlockState.OK).all() and (gens == 4).all()


def test_round_trip_on_non_contiguous_views():
    big = np.zeros((6, 40), dtype=np.uint64)
    view = big[::2, 5:25]  # strided rows and an offset column window
    ids = np.array([1, 2, 3])
    pattern.fill_blocks(view, ids, 2, 3)
    assert (big[1] == 0).all() and (big[0, :5] == 0).all()
    states, gens = pattern.classify_blocks(view, ids, 2, 3)
    assert (states == BlockState.OK).all() and (gens == 2).all()


def test_tiling_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(1)
    ids = np.arange(20, dtype=np.int64)
    blocks = pattern.pattern_words(ids, 50, 3, 8)
    blocks[4, 10:] = pattern.pattern_words(ids[4:5], 50, 2, 8)[0, 10:]  # TORN
    blocks[7] = pattern.pattern_words(ids[7:8], 50, 1, 8)  # STALE
    blocks[9, 49] ^= np.uint64(1)  # GARBAGE in the last word
    blocks[11, rng.integers(50)] = pattern.POISON_WORD
    expected = pattern.classify_blocks(blocks, ids, 3, 8)
    for tile in (1, 7, 50, 64, 1000):
        monkeypatch.setattr(pattern, "TILE_WORDS", tile)
        got = pattern.classify_blocks(blocks, ids, 3, 8)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
        again = np.empty_like(blocks)
        pattern.fill_blocks(again, ids, 3, 8)
        np.testing.assert_array_equal(again, pattern.pattern_words(ids, 50, 3, 8))
    assert expected[0].tolist()[4] == BlockState.TORN
    assert expected[0].tolist()[7] == BlockState.STALE
    assert expected[0].tolist()[9] == BlockState.GARBAGE
    assert expected[0].tolist()[11] == BlockState.GARBAGE


def _built_blocks():
    """One block per state, built deliberately; returns blocks, ids, expected generation, seed."""
    seed, exp, words = 99, 6, 16
    ids = np.array([10, 11, 12, 13, 14, 15, 16], dtype=np.int64)
    blocks = np.empty((len(ids), words), dtype=np.uint64)
    pattern.fill_blocks(blocks, ids, exp, seed)  # 0: OK
    pattern.fill_blocks(blocks[1:2], ids[1:2], 5, seed)  # 1: STALE (older)
    older = pattern.pattern_words(ids[2:3], words, 5, seed)[0]
    blocks[2, words // 2 :] = older[words // 2 :]  # 2: TORN (half old, half new)
    blocks[3, 3] ^= np.uint64(1 << 7)  # 3: GARBAGE (one flipped bit in a low half)
    blocks[4] = pattern.pattern_words(ids[0:1], words, exp, seed)[0]  # 4: GARBAGE (block 10's bytes at 14)
    pattern.poison_blocks(blocks[5])  # 5: GARBAGE (poison)
    pattern.fill_blocks(blocks[6:7], ids[6:7], 1000, seed)  # 6: STALE (newer generation)
    return blocks, ids, exp, seed


def test_each_state_built_deliberately():
    blocks, ids, exp, seed = _built_blocks()
    states, gens = pattern.classify_blocks(blocks, ids, exp, seed)
    assert states.tolist() == [BlockState.OK, BlockState.STALE, BlockState.TORN, BlockState.GARBAGE,
                               BlockState.GARBAGE, BlockState.GARBAGE, BlockState.STALE]
    assert gens.tolist() == [exp, 5, -1, -1, -1, -1, 1000]
    for j in range(len(ids)):
        assert classify_scalar(blocks[j], int(ids[j]), exp, seed) == (states[j], gens[j])


def test_wrong_block_id_and_wrong_seed_are_garbage():
    ids = np.arange(4, dtype=np.int64)
    blocks = pattern.pattern_words(ids, 8, 1, 5)
    states, _ = pattern.classify_blocks(blocks, ids + 1, 1, 5)
    assert (states == BlockState.GARBAGE).all()
    states, _ = pattern.classify_blocks(blocks, ids, 1, 6)
    assert (states == BlockState.GARBAGE).all()
    states, _ = pattern.classify_blocks(blocks[::-1], ids, 1, 5)  # blocks permuted
    assert (states == BlockState.GARBAGE).all()


def test_words_moved_inside_a_block_are_garbage():
    ids = np.array([3])
    blocks = pattern.pattern_words(ids, 8, 2, 5)
    blocks[0, [1, 2]] = blocks[0, [2, 1]]
    assert pattern.classify_blocks(blocks, ids, 2, 5)[0].tolist() == [BlockState.GARBAGE]


def test_poison_and_uninitialised_bytes_are_garbage():
    ids = np.arange(3)
    for fill in (pattern.POISON_WORD, np.uint64(0)):
        blocks = np.full((3, 4), fill, dtype=np.uint64)
        assert (pattern.classify_blocks(blocks, ids, 0, 0)[0] == BlockState.GARBAGE).all()
    # A poison word is GARBAGE even though the rest of the block is valid.
    blocks = pattern.pattern_words(ids, 4, 0, 0)
    blocks[1, 2] = pattern.POISON_WORD
    assert pattern.classify_blocks(blocks, ids, 0, 0)[0].tolist() == [0, 3, 0]


def test_poison_generation_is_rejected_for_writers():
    blocks = np.zeros((1, 2), dtype=np.uint64)
    with pytest.raises(ValueError, match="generation"):
        pattern.fill_blocks(blocks, [0], pattern.POISON_GENERATION, 0)
    pattern.fill_blocks(blocks, [0], pattern.MAX_GENERATION, 0)
    assert pattern.classify_blocks(blocks, [0], pattern.MAX_GENERATION, 0)[0].tolist() == [0]


def test_argument_errors_name_the_argument():
    good = np.zeros((2, 4), dtype=np.uint64)
    with pytest.raises(TypeError, match="blocks"):
        pattern.fill_blocks(np.zeros((2, 4), dtype=np.int64), [0, 1], 0, 0)
    with pytest.raises(ValueError, match="blocks"):
        pattern.classify_blocks(np.zeros(8, dtype=np.uint64), [0], 0, 0)
    with pytest.raises(ValueError, match="block_ids"):
        pattern.fill_blocks(good, [0, 1, 2], 0, 0)
    with pytest.raises(TypeError, match="block_ids"):
        pattern.fill_blocks(good, [0.5, 1.5], 0, 0)
    with pytest.raises(ValueError, match="expected_generation"):
        pattern.classify_blocks(good, [0, 1], -1, 0)
    with pytest.raises(TypeError, match="seed"):
        pattern.classify_blocks(good, [0, 1], 0, 1.5)
    with pytest.raises(ValueError, match="seed"):
        pattern.classify_blocks(good, [0, 1], 0, 1 << 64)
    with pytest.raises(ValueError, match="writable"):
        ro = good.copy()
        ro.flags.writeable = False
        pattern.fill_blocks(ro, [0, 1], 0, 0)


def test_empty_block_list():
    states, gens = pattern.classify_blocks(np.zeros((0, 4), dtype=np.uint64), np.zeros(0, np.int64), 0, 0)
    assert states.shape == gens.shape == (0,)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 6),
    words=st.integers(1, 12),
    seed=st.integers(-(1 << 63), (1 << 64) - 1),
    expected=st.integers(0, pattern.MAX_GENERATION),
)
def test_classification_matches_scalar_reference(data, n, words, seed, expected):
    """Blocks whose every word comes from a random (generation, id, corruption) agree with the
    scalar reference, and blocks built from one generation classify as that generation."""
    ids = np.array(data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=n, max_size=n)), dtype=np.int64)
    gens_pool = [expected, data.draw(st.integers(0, pattern.MAX_GENERATION))]
    blocks = np.empty((n, words), dtype=np.uint64)
    for j in range(n):
        kind = data.draw(st.sampled_from(["one", "mixed", "corrupt"]))
        if kind == "one":
            g = data.draw(st.sampled_from(gens_pool))
            blocks[j] = [word_scalar(seed, int(ids[j]), g, i) for i in range(words)]
        else:
            for i in range(words):
                g = data.draw(st.sampled_from(gens_pool))
                blocks[j, i] = word_scalar(seed, int(ids[j]), g, i)
            if kind == "corrupt":
                i = data.draw(st.integers(0, words - 1))
                blocks[j, i] ^= np.uint64(1 << data.draw(st.integers(0, 63)))
    states, gens = pattern.classify_blocks(blocks, ids, expected, seed)
    for j in range(n):
        assert (states[j], gens[j]) == classify_scalar(blocks[j], int(ids[j]), expected, seed)


@settings(max_examples=40, deadline=None)
@given(g=st.integers(0, pattern.MAX_GENERATION), exp=st.integers(0, pattern.MAX_GENERATION),
       seed=st.integers(0, (1 << 64) - 1), ids=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=5))
def test_single_generation_blocks_are_ok_or_stale(g, exp, seed, ids):
    blocks = pattern.pattern_words(np.array(ids, dtype=np.int64), 6, g, seed)
    states, gens = pattern.classify_blocks(blocks, np.array(ids, dtype=np.int64), exp, seed)
    assert (states == (BlockState.OK if g == exp else BlockState.STALE)).all()
    assert (gens == g).all()


# ---- checksum -------------------------------------------------------------------------------


def test_checksum_matches_scalar_definition():
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 1 << 64, size=(4, 33), dtype=np.uint64)
    got = pattern.checksum_blocks_reference(blocks)
    assert got.dtype == np.int64 and got.shape == (4,)
    assert got.tolist() == [checksum_scalar(row) for row in blocks]


def test_checksum_tiles_agree(monkeypatch):
    blocks = np.random.default_rng(3).integers(0, 1 << 64, size=(3, 100), dtype=np.uint64)
    want = pattern.checksum_blocks_reference(blocks)
    monkeypatch.setattr(pattern, "TILE_WORDS", 7)
    np.testing.assert_array_equal(pattern.checksum_blocks_reference(blocks), want)


def test_checksum_sees_every_single_bit_flip():
    rng = np.random.default_rng(4)
    block = rng.integers(0, 1 << 64, size=(1, 16), dtype=np.uint64)
    base = pattern.checksum_blocks_reference(block)[0]
    flipped = np.repeat(block, 16 * 64, axis=0)
    for i in range(16):
        for bit in range(64):
            flipped[i * 64 + bit, i] ^= np.uint64(1 << bit)
    sums = pattern.checksum_blocks_reference(flipped)
    assert (sums != base).all()


def test_checksum_depends_on_word_order():
    rng = np.random.default_rng(5)
    block = rng.integers(0, 1 << 64, size=(1, 8), dtype=np.uint64)
    swapped = block.copy()
    swapped[0, [2, 5]] = swapped[0, [5, 2]]
    assert pattern.checksum_blocks_reference(block)[0] != pattern.checksum_blocks_reference(swapped)[0]
    rotated = np.roll(block, 1, axis=1)
    assert pattern.checksum_blocks_reference(block)[0] != pattern.checksum_blocks_reference(rotated)[0]
    # Equal words swapped leave the bytes, and so the checksum, unchanged.
    same = np.full((1, 4), 7, dtype=np.uint64)
    assert pattern.checksum_blocks_reference(same)[0] == pattern.checksum_blocks_reference(same[:, ::-1].copy())[0]
