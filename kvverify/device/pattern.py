"""The block pattern: its one definition (numpy), and the classification of a checked block.

Every 8-byte word ``i`` of logical block ``b`` written in generation ``g`` holds::

    word = (g << 32) | h32(seed, b, g, i)

so a word says which generation wrote it (high 32 bits) and proves, through its low 32 bits,
that it belongs at word ``i`` of block ``b`` in generation ``g`` under ``seed``.
``csrc/harness/pattern.cuh`` mirrors ``h32`` for the CUDA kernels; ``tests/device/test_pattern_cuh.py``
(host compile of the header, CPU) and ``tests/device/test_kernels_gpu.py`` (kernels vs this module)
hold the two equal. Change one, change both.

``h32`` (all arithmetic on uint32, wrapping mod 2**32)::

    fmix32(x):  x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    key(seed, b) = fmix32(fmix32(fmix32(fmix32(KEY_SALT ^ seed_hi) ^ seed_lo) ^ b_hi) ^ b_lo)
    h32(seed, b, g, i) = fmix32(key(seed, b) + g * 0x9E3779B1 + i * 0x85EBCA77)

with ``seed`` and ``b`` taken as 64-bit two's-complement integers split into 32-bit halves,
``g`` and ``i`` as 32-bit integers. ``fmix32`` is MurmurHash3's finaliser: a bijection with
full avalanche. Why this shape:

- cheap where it matters: the per-block key costs four mixes once per block; each word then
  costs two multiply-adds and one ``fmix32`` (vectorises in numpy, a dozen integer ops on a GPU);
- exact, not probabilistic, where it can be: both multipliers are odd and every step is a
  bijection, so for fixed other inputs a change of ``g`` alone, of ``i`` alone (a word moved
  inside its block) or of ``b_lo`` alone (a block landed at the wrong address) always changes
  the hash; other confusions match a word with probability 2**-32, a block of many words
  practically never.

Classification (``classify_blocks``), in order of precedence:

- GARBAGE: some word's low half is not ``h32`` of the generation in its own high half (poison,
  uninitialised bytes, a block written at the wrong address, a word moved), or some word carries
  the reserved ``POISON_GENERATION``;
- TORN: every word is valid but words come from several generations;
- OK: every word is from ``expected_generation``;
- STALE: every word is from one other generation.

The generation reported is that single generation (OK, STALE), else -1.
"""

from __future__ import annotations

import sys

import numpy as np

from kvverify.terms import BlockState

__all__ = [
    "MAX_GENERATION",
    "POISON_GENERATION",
    "POISON_WORD",
    "BlockState",
    "block_keys",
    "checksum_blocks_reference",
    "classify_blocks",
    "fill_blocks",
    "h32",
    "mix64",
    "pattern_words",
    "poison_blocks",
]


# Constants shared with csrc/harness/pattern.cuh (same names in kCamelCase there).
KEY_SALT = 0x6A09E667  # SHA-256's first IV word: an arbitrary constant with no structure
GENERATION_MUL = 0x9E3779B1  # odd (2**32 / golden ratio): g -> g * GENERATION_MUL is a bijection
WORD_MUL = 0x85EBCA77  # odd (xxHash32 prime 2): i -> i * WORD_MUL is a bijection
FMIX_MUL1 = 0x85EBCA6B
FMIX_MUL2 = 0xC2B2AE35
CHECKSUM_INDEX_MUL = 0x9E3779B97F4A7C15  # odd (2**64 / golden ratio)
MIX64_MUL1 = 0xBF58476D1CE4E5B9  # splitmix64 finaliser
MIX64_MUL2 = 0x94D049BB133111EB

# The poison word is all ones (what `cudaMemset(p, 0xFF, n)` or `np.full(..., ~0)` leaves).
# It can never pass as a pattern word, not by luck of the hash but by construction: its high
# half is POISON_GENERATION, which no writer may use (fill_blocks and the write_blocks kernel
# reject it), and the classifier declares any word carrying it GARBAGE whatever its low half.
POISON_GENERATION = 0xFFFFFFFF
POISON_WORD = np.uint64(0xFFFFFFFFFFFFFFFF)
MAX_GENERATION = POISON_GENERATION - 1  # generations are 0 ..= MAX_GENERATION

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# Index of the low / high uint32 half of a uint64 word in memory.
_LO, _HI = (0, 1) if sys.byteorder == "little" else (1, 0)

# Tiles of at most this many words bound the temporaries (a few uint32 arrays of one tile each)
# and keep them in a core's L2 cache; 64 Ki words = 512 KiB of input per tile. See
# benchmarks/bench_pattern.py for the measurement behind the choice.
TILE_WORDS = 1 << 16


# --------------------------------------------------------------------------------------------
# The hash
# --------------------------------------------------------------------------------------------


def _fmix32_int(x: int) -> int:
    """MurmurHash3 fmix32 of a Python int (scalar path, used for per-call constants)."""
    x &= _M32
    x ^= x >> 16
    x = (x * FMIX_MUL1) & _M32
    x ^= x >> 13
    x = (x * FMIX_MUL2) & _M32
    x ^= x >> 16
    return x


def _fmix32_(x: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """fmix32 of a uint32 array, in place (``tmp``: scratch of the same shape, no allocation)."""
    np.right_shift(x, 16, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(FMIX_MUL1), out=x)
    np.right_shift(x, 13, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(FMIX_MUL2), out=x)
    np.right_shift(x, 16, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    return x


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = np.array(x, dtype=np.uint32, copy=True)
    return _fmix32_(x, np.empty_like(x))


def _as_u64(x) -> np.ndarray:
    """Integers (Python ints of any sign below 2**64, or integer arrays) as uint64, mod 2**64."""
    if isinstance(x, (int, np.integer)):
        return np.asarray(int(x) & _M64, dtype=np.uint64)
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"expected integers, got dtype {a.dtype}")
    return a.astype(np.int64 if a.dtype.kind == "i" else np.uint64, copy=False).astype(np.uint64)


def _check_seed(seed) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not -(1 << 63) <= int(seed) < (1 << 64):
        raise ValueError(f"seed must lie in [-2**63, 2**64) (it is used mod 2**64), got {seed}")
    return int(seed) & _M64


def _seed_state(seed: int) -> int:
    """The seed's share of the block key: fmix32(fmix32(KEY_SALT ^ seed_hi) ^ seed_lo)."""
    s = int(seed) & _M64
    return _fmix32_int(_fmix32_int(KEY_SALT ^ (s >> 32)) ^ (s & _M32))


def block_keys(block_ids, seed: int) -> np.ndarray:
    """Per-block key ``key(seed, b)`` (uint32, same shape as ``block_ids``); see the module doc."""
    b = _as_u64(block_ids)
    k = (b >> np.uint64(32)).astype(np.uint32) ^ np.uint32(_seed_state(_check_seed(seed)))
    tmp = np.empty_like(k)
    _fmix32_(k, tmp)
    k ^= (b & np.uint64(_M32)).astype(np.uint32)
    return _fmix32_(k, tmp)


def h32(seed, block, generation, word) -> np.ndarray:
    """``h32(seed, block, generation, word)`` as uint32, broadcasting its four integer arguments.

    ``seed`` and ``block`` are taken mod 2**64, ``generation`` and ``word`` mod 2**32. This is the
    readable definition (tests and small uses); the fill/classify paths compute the same values
    tile by tile.
    """
    s, b = np.broadcast_arrays(_as_u64(seed), _as_u64(block))
    s_state = _fmix32(_fmix32((s >> np.uint64(32)).astype(np.uint32) ^ np.uint32(KEY_SALT)) ^ (s & np.uint64(_M32)).astype(np.uint32))
    key = _fmix32(_fmix32(s_state ^ (b >> np.uint64(32)).astype(np.uint32)) ^ (b & np.uint64(_M32)).astype(np.uint32))
    g = _as_u64(generation).astype(np.uint32)  # uint64 -> uint32 keeps the low half (mod 2**32)
    i = _as_u64(word).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = key + g * np.uint32(GENERATION_MUL) + i * np.uint32(WORD_MUL)
    return _fmix32(x)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_blocks(blocks, *, writable: bool) -> np.ndarray:
    if not isinstance(blocks, np.ndarray):
        raise TypeError(f"blocks must be a numpy array, got {type(blocks).__name__}")
    if blocks.dtype != np.uint64:
        raise TypeError(f"blocks must have dtype uint64 (one 8-byte word per element), got {blocks.dtype}")
    if blocks.ndim != 2 or blocks.shape[1] == 0:
        raise ValueError(f"blocks must be 2-D (n_blocks, words_per_block) with at least one word, got shape {blocks.shape}")
    if blocks.shape[1] > 1 << 32:
        raise ValueError(f"blocks may hold at most 2**32 words each (the word index is 32-bit), got {blocks.shape[1]}")
    if writable and not blocks.flags.writeable:
        raise ValueError("blocks must be writable")
    return blocks


def _check_ids(block_ids, n: int) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"block_ids must be integers (int64), got dtype {ids.dtype}")
    if ids.shape != (n,):
        raise ValueError(f"block_ids must have shape ({n},) (one id per block), got {ids.shape}")
    return ids


def _check_generation(generation, name: str) -> int:
    if not isinstance(generation, (int, np.integer)) or isinstance(generation, bool):
        raise TypeError(f"{name} must be an int, got {type(generation).__name__}")
    if not 0 <= int(generation) <= MAX_GENERATION:
        raise ValueError(
            f"{name} must lie in [0, {MAX_GENERATION}] ({POISON_GENERATION:#x} is reserved for poison), got {generation}"
        )
    return int(generation)


def _tiles(n: int, words: int):
    """Yield (row slice, column slice) tiles of at most ~TILE_WORDS words covering (n, words)."""
    cols = min(words, TILE_WORDS)
    rows = max(1, TILE_WORDS // cols)
    for r0 in range(0, n, rows):
        for c0 in range(0, words, cols):
            yield slice(r0, min(n, r0 + rows)), slice(c0, min(words, c0 + cols))


def _word_mul_column(c: slice) -> np.ndarray:
    """``i * WORD_MUL`` (uint32) for the word indices of a column slice."""
    return np.arange(c.start, c.stop, dtype=np.uint32) * np.uint32(WORD_MUL)


# --------------------------------------------------------------------------------------------
# Fill, poison, classify
# --------------------------------------------------------------------------------------------


def pattern_words(block_ids, words: int, generation: int, seed: int) -> np.ndarray:
    """A new (len(block_ids), words) uint64 array holding the pattern (see ``fill_blocks``)."""
    ids = np.asarray(block_ids)
    out = np.empty((len(ids), words), dtype=np.uint64)
    fill_blocks(out, ids, generation, seed)
    return out


def fill_blocks(blocks: np.ndarray, block_ids, generation: int, seed: int) -> None:
    """Write the pattern of ``generation`` into every word of every block, in place.

    blocks: uint64 array (n, words), writable (e.g. ``pinned_tensor.numpy().view(np.uint64)``).
    block_ids: integer array (n,): block ``blocks[j]`` is logical block ``block_ids[j]``.
    generation: 0 ..= MAX_GENERATION. seed: int, used mod 2**64.
    Raises TypeError / ValueError naming the offending argument.
    """
    _check_blocks(blocks, writable=True)
    n, words = blocks.shape
    ids = _check_ids(block_ids, n)
    g = _check_generation(generation, "generation")
    keys = block_keys(ids, _check_seed(seed))
    # Pattern word = (g << 32) | fmix32(key + g*GENERATION_MUL + i*WORD_MUL): the generation's share
    # folds into the per-block key once.
    keys_g = keys + np.uint32((g * GENERATION_MUL) & _M32)
    hi = np.uint64(g << 32)
    h = t = None
    for r, c in _tiles(n, words):
        shape = (r.stop - r.start, c.stop - c.start)
        if h is None or h.shape != shape:
            h, t = np.empty(shape, np.uint32), np.empty(shape, np.uint32)
        np.add(keys_g[r, None], _word_mul_column(c)[None, :], out=h)
        _fmix32_(h, t)
        out = blocks[r, c]
        np.bitwise_or(h, hi, out=out, casting="unsafe")  # uint32 -> uint64, then | (g << 32)


def poison_blocks(blocks: np.ndarray) -> None:
    """Fill every word of ``blocks`` (uint64 array, any shape) with ``POISON_WORD``.

    Poisoned blocks always classify as GARBAGE (see ``POISON_WORD``), so a destination
    poisoned before a copy shows GARBAGE wherever the copy did not land.
    """
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint64:
        raise TypeError("blocks must be a numpy uint64 array")
    blocks[...] = POISON_WORD


def classify_blocks(blocks: np.ndarray, block_ids, expected_generation: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Classify every block; return ``(states int8[n], generations int64[n])``.

    states[j] is a ``BlockState`` code (see the module doc); generations[j] is the block's single
    generation (OK, STALE) or -1 (TORN, GARBAGE). Vectorised over tiles of ~TILE_WORDS words,
    so temporaries stay small whatever the size of ``blocks``.
    """
    _check_blocks(blocks, writable=False)
    n, words = blocks.shape
    ids = _check_ids(block_ids, n)
    expected = _check_generation(expected_generation, "expected_generation")
    keys = block_keys(ids, _check_seed(seed))

    bad = np.zeros(n, dtype=bool)
    gmin = np.full(n, POISON_GENERATION, dtype=np.uint32)
    gmax = np.zeros(n, dtype=np.uint32)
    buf = None
    for r, c in _tiles(n, words):
        rows, cols = r.stop - r.start, c.stop - c.start
        if buf is None or buf[0].shape != (rows, cols):
            buf = tuple(np.empty((rows, cols), np.uint32) for _ in range(3)) + (np.empty((rows, cols), bool),)
        hi, h, tmp, eq = buf
        tile = blocks[r, c]
        if not tile.flags.c_contiguous:
            tile = np.ascontiguousarray(tile)
        halves = tile.view(np.uint32).reshape(rows, cols, 2)
        np.copyto(hi, halves[:, :, _HI])  # one strided pass; the rest runs on contiguous arrays
        # h = fmix32(key + hi * GENERATION_MUL + i * WORD_MUL)
        np.multiply(hi, np.uint32(GENERATION_MUL), out=h)
        h += keys[r, None]
        h += _word_mul_column(c)[None, :]
        _fmix32_(h, tmp)
        np.equal(h, halves[:, :, _LO], out=eq)
        bad[r] |= ~eq.all(axis=1)
        np.minimum(gmin[r], hi.min(axis=1), out=gmin[r])
        np.maximum(gmax[r], hi.max(axis=1), out=gmax[r])

    # gmax == POISON_GENERATION catches poison words without a per-word test.
    garbage = bad | (gmax == POISON_GENERATION)
    torn = ~garbage & (gmin != gmax)
    single = ~garbage & ~torn
    states = np.full(n, BlockState.GARBAGE, dtype=np.int8)
    states[torn] = BlockState.TORN
    states[single & (gmin == expected)] = BlockState.OK
    states[single & (gmin != expected)] = BlockState.STALE
    generations = np.where(single, gmin.astype(np.int64), np.int64(-1))
    return states, generations


# --------------------------------------------------------------------------------------------
# Checksum of arbitrary bytes (``--data random``)
# --------------------------------------------------------------------------------------------


def _mix64_(z: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of a uint64 array, in place (``tmp``: scratch of the same shape)."""
    np.right_shift(z, np.uint64(30), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    np.multiply(z, np.uint64(MIX64_MUL1), out=z)
    np.right_shift(z, np.uint64(27), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    np.multiply(z, np.uint64(MIX64_MUL2), out=z)
    np.right_shift(z, np.uint64(31), out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    return z


def mix64(x) -> np.ndarray:
    """splitmix64's finaliser (a bijection on uint64) of a uint64 array."""
    z = np.array(x, dtype=np.uint64, copy=True)
    return _mix64_(z, np.empty_like(z))


def checksum_blocks_reference(blocks: np.ndarray) -> np.ndarray:
    """Per-block 64-bit checksum, bit for bit what the ``checksum_blocks`` kernel computes.

    checksum(block) = sum over words i of mix64(word_i ^ (i * CHECKSUM_INDEX_MUL))  (mod 2**64),
    returned as int64 (the uint64 bits reinterpreted). Because mix64 is a bijection, changing any
    single word always changes the sum; mixing in the index makes the order of words matter
    (swapping two different words changes the sum except with probability ~2**-64).
    blocks: uint64 array (n, words). Returns int64[n].
    """
    _check_blocks(blocks, writable=False)
    n, words = blocks.shape
    total = np.zeros(n, dtype=np.uint64)
    z = tmp = None
    for r, c in _tiles(n, words):
        shape = (r.stop - r.start, c.stop - c.start)
        if z is None or z.shape != shape:
            z, tmp = np.empty(shape, np.uint64), np.empty(shape, np.uint64)
        idx = np.arange(c.start, c.stop, dtype=np.uint64) * np.uint64(CHECKSUM_INDEX_MUL)
        np.bitwise_xor(blocks[r, c], idx[None, :], out=z)
        _mix64_(z, tmp)
        total[r] += z.sum(axis=1, dtype=np.uint64)  # uint64 sums wrap mod 2**64, as on the GPU
    return total.view(np.int64)
