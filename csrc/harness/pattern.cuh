// The block pattern's hash and checksum, for device (and host) code.
//
// The reference is kvverify/device/pattern.py: its module docstring defines h32, the poison word and
// the checksum; this header mirrors it constant for constant. Two tests hold them equal:
//   tests/device/test_pattern_cuh.py   compiles this header for the host and compares it with numpy (CPU);
//   tests/device/test_kernels_gpu.py   kernel-written blocks classified by numpy, numpy-written blocks
//                                      verified by the kernel, kernel checksum vs the numpy checksum (GPU).
// Change one side, change both.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVV_HD __host__ __device__ __forceinline__
#else
#define KVV_HD inline
#endif

namespace kvverify {
namespace pattern {

constexpr uint32_t kKeySalt = 0x6A09E667u;        // KEY_SALT
constexpr uint32_t kGenerationMul = 0x9E3779B1u;  // GENERATION_MUL (odd: a bijection of g)
constexpr uint32_t kWordMul = 0x85EBCA77u;        // WORD_MUL (odd: a bijection of i)
constexpr uint32_t kPoisonGeneration = 0xFFFFFFFFu;       // POISON_GENERATION: never written
constexpr uint64_t kPoisonWord = 0xFFFFFFFFFFFFFFFFull;   // POISON_WORD
constexpr uint64_t kChecksumIndexMul = 0x9E3779B97F4A7C15ull;  // CHECKSUM_INDEX_MUL

// BlockState codes, as in kvverify.pattern.BlockState.
constexpr int8_t kOk = 0, kStale = 1, kTorn = 2, kGarbage = 3;

// MurmurHash3's 32-bit finaliser: a bijection with full avalanche.
KVV_HD uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// key(seed, b): computed once per block, so each word costs one fmix32.
KVV_HD uint32_t block_key(uint64_t seed, uint64_t block) {
  uint32_t x = fmix32(kKeySalt ^ static_cast<uint32_t>(seed >> 32));
  x = fmix32(x ^ static_cast<uint32_t>(seed));
  x = fmix32(x ^ static_cast<uint32_t>(block >> 32));
  return fmix32(x ^ static_cast<uint32_t>(block));
}

KVV_HD uint32_t h32_keyed(uint32_t key, uint32_t generation, uint32_t word) {
  return fmix32(key + generation * kGenerationMul + word * kWordMul);
}

KVV_HD uint32_t h32(uint64_t seed, uint64_t block, uint32_t generation, uint32_t word) {
  return h32_keyed(block_key(seed, block), generation, word);
}

// Word `word` of a block with key `key` in generation `generation`.
KVV_HD uint64_t pattern_word(uint32_t key, uint32_t generation, uint32_t word) {
  return (static_cast<uint64_t>(generation) << 32) | h32_keyed(key, generation, word);
}

// splitmix64's finaliser: a bijection on 64 bits.
KVV_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One word's share of checksum_blocks: sum over i of mix64(word_i ^ i * kChecksumIndexMul).
KVV_HD uint64_t checksum_term(uint64_t word, uint64_t index) {
  return mix64(word ^ (index * kChecksumIndexMul));
}

}  // namespace pattern
}  // namespace kvverify
