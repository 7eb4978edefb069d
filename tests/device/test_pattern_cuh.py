"""csrc/harness/pattern.cuh (the device hash) equals kvverify/device/pattern.py (the reference), checked on the CPU.

The header is plain C++ outside nvcc (its __host__ __device__ markers compile away), so a host
C++ compiler builds a tiny driver that prints h32, block keys, pattern words and checksum terms
for a set of inputs; numpy must produce the same numbers. Skipped where no C++ compiler exists.
The GPU side of the same promise is tests/device/test_kernels_gpu.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from kvverify.device import pattern

HEADER_DIR = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc", "harness")

DRIVER = r"""
#include <cinttypes>
#include <cstdio>
#include "pattern.cuh"
using namespace kvverify::pattern;
int main() {
  unsigned long long seed, block, gen, word, data;
  // Each input line: seed block generation word data (decimal, uint64).
  while (std::scanf("%llu %llu %llu %llu %llu", &seed, &block, &gen, &word, &data) == 5) {
    const uint32_t key = block_key(seed, block);
    std::printf("%u %u %llu %llu\n", key, h32(seed, block, (uint32_t)gen, (uint32_t)word),
                (unsigned long long)pattern_word(key, (uint32_t)gen, (uint32_t)word),
                (unsigned long long)checksum_term(data, word));
  }
  return 0;
}
"""


def _compiler():
    for cxx in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler to build csrc/harness/pattern.cuh with")
    d = tmp_path_factory.mktemp("cuh")
    src, exe = d / "driver.cpp", d / "driver"
    src.write_text(DRIVER)
    # -x c++: the header's .cuh suffix means nothing to a host compiler.
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", HEADER_DIR, "-x", "c++", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return str(exe)


def test_header_matches_numpy(driver):
    rng = np.random.default_rng(7)
    n = 2000
    seeds = rng.integers(0, 1 << 64, size=n, dtype=np.uint64)
    blocks = rng.integers(0, 1 << 64, size=n, dtype=np.uint64)
    gens = rng.integers(0, 1 << 32, size=n, dtype=np.uint64)
    words = rng.integers(0, 1 << 32, size=n, dtype=np.uint64)
    data = rng.integers(0, 1 << 64, size=n, dtype=np.uint64)
    # Edge values: zeros, all ones, small ids and generations.
    seeds[:4], blocks[:4], gens[:4], words[:4] = 0, [0, 1, (1 << 64) - 1, 1 << 32], [0, 1, (1 << 32) - 1, 2], [0, 1, 2, 3]
    lines = "\n".join(f"{s} {b} {g} {w} {x}" for s, b, g, w, x in zip(seeds, blocks, gens, words, data, strict=True))
    out = subprocess.run([driver], input=lines, capture_output=True, text=True, check=True).stdout.split("\n")
    got = np.array([[int(v) for v in line.split()] for line in out if line], dtype=object)
    assert got.shape == (n, 4)

    keys = np.array([int(pattern.block_keys(np.array([b]).view(np.int64), int(s))[0]) for s, b in zip(seeds, blocks, strict=True)])
    assert got[:, 0].tolist() == keys.tolist()
    assert got[:, 1].tolist() == pattern.h32(seeds, blocks, gens, words).tolist()
    want_words = [(int(g) << 32) | int(h) for g, h in zip(gens, pattern.h32(seeds, blocks, gens, words), strict=True)]
    assert got[:, 2].tolist() == want_words
    idx_mul = (words * np.uint64(pattern.CHECKSUM_INDEX_MUL))
    assert got[:, 3].tolist() == pattern.mix64(data ^ idx_mul).tolist()


def test_header_constants_match():
    with open(os.path.join(HEADER_DIR, "pattern.cuh")) as f:
        text = f.read()
    for name, value in [("kKeySalt", pattern.KEY_SALT), ("kGenerationMul", pattern.GENERATION_MUL),
                        ("kWordMul", pattern.WORD_MUL), ("kPoisonGeneration", pattern.POISON_GENERATION),
                        ("kPoisonWord", int(pattern.POISON_WORD)), ("kChecksumIndexMul", pattern.CHECKSUM_INDEX_MUL)]:
        assert f"{name} = {value:#X}".replace("0X", "0x") in text.replace("u;", ";").replace("ull;", ";"), name
    for state in pattern.BlockState:
        assert f"k{state.name.capitalize()} = {int(state)}" in text, state
