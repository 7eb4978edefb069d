// Harness kernels: stamp, read, verify and checksum blocks at raw addresses, and hold a stream.
// The ops that check arguments and launch these live in csrc/harness/harness_ops.cpp.
//
// Block pointers are raw byte addresses in an int64 CUDA tensor; each may point into device
// memory or into pinned / registered host memory (UVA: the host address is valid on the device).
// The pattern itself (h32, poison, checksum) lives in pattern.cuh, mirrored from kvverify/device/pattern.py.
//
// Only the CUDA runtime API is used: the extension never links libcuda.

#include <cuda_runtime.h>

#include <cstdint>

#include "harness_kernels.h"
#include "pattern.cuh"

namespace {

using namespace kvverify::pattern;

constexpr int kThreads = 256;  // threads per CTA, every kernel but spin
constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------

// Nanoseconds from the device's global timer (the same clock for every SM). Its update
// granularity is up to ~1 us on some GPUs, far below the holds used here (us to ms).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Called by one thread: return no earlier than `ns` after the call. Sleeps between polls so
// a held SM leaves its issue slots to co-resident kernels.
__device__ void hold_for(uint64_t ns) {
  if (ns == 0) return;
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < ns) __nanosleep(256);
}

// How a block's words split for 16-byte accesses: an 8-byte head word when the block starts on
// an 8- but not 16-byte boundary, then 16-byte pairs, then an 8-byte tail word if one is left.
// Block sizes are multiples of 8 bytes (checked on the host), so this covers every word.
struct Span {
  uint64_t* words;  // nullptr: null or not 8-byte aligned (the block is not touched)
  uint32_t head;    // 0 or 1: word 0 is accessed alone
  uint32_t pairs;   // pair k covers words head + 2k, head + 2k + 1
  uint32_t tail;    // 0 or 1: word n_words - 1 is accessed alone
};

__device__ __forceinline__ Span span_of(int64_t address, uint32_t n_words) {
  const uint64_t a = static_cast<uint64_t>(address);
  Span s{nullptr, 0, 0, 0};
  // Defence in depth: the Python wrappers reject null and misaligned pointers given on the
  // host; a bad one arriving in a CUDA tensor must not fault the context (which would end the
  // whole run), so it is skipped here and verify_blocks reports the block as GARBAGE.
  if (a == 0 || (a & 7) != 0) return s;
  s.words = reinterpret_cast<uint64_t*>(a);
  s.head = (a & 15) != 0 ? 1u : 0u;
  const uint32_t rest = n_words - s.head;
  s.pairs = rest / 2;
  s.tail = rest & 1u;
  return s;
}

__device__ __forceinline__ const ulonglong2* pairs_of(const Span& s) {
  return reinterpret_cast<const ulonglong2*>(s.words + s.head);
}

// Calls visit(word, index) for every word of the span this thread owns: 16-byte pairs strided
// over the CTA with four loads in flight per thread, then the unaligned head (thread 0) and the
// odd tail (the last thread). Verify and checksum share it; write and read have their own
// loops (stores, volatile loads).
template <typename Visit>
__device__ __forceinline__ void for_each_word(const Span& s, uint32_t n_words, Visit visit) {
  const ulonglong2* v = pairs_of(s);
  uint32_t k = threadIdx.x;
  for (; k + 3 * kThreads < s.pairs; k += 4 * kThreads) {
    ulonglong2 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = v[k + u * kThreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t i = s.head + 2 * (k + u * kThreads);
      visit(x[u].x, i);
      visit(x[u].y, i + 1);
    }
  }
  for (; k < s.pairs; k += kThreads) {
    const ulonglong2 x = v[k];
    visit(x.x, s.head + 2 * k);
    visit(x.y, s.head + 2 * k + 1);
  }
  if (threadIdx.x == 0 && s.head) visit(s.words[0], 0u);
  if (threadIdx.x == kThreads - 1 && s.tail) visit(s.words[n_words - 1], n_words - 1);
}

// Loads that the compiler may neither drop, merge nor hoist out of a loop (read_blocks must
// touch memory on every pass). Generic addressing: the pointer may be device or UVA host memory.
__device__ __forceinline__ ulonglong2 load_volatile_pair(const ulonglong2* p) {
  ulonglong2 v;
  asm volatile("ld.volatile.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t load_volatile_word(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Block-wide reductions. Results are valid in thread 0. Every thread of the CTA must call them.
__device__ __forceinline__ void block_min_max(uint32_t& lo, uint32_t& hi) {
  __shared__ uint32_t s_lo[kWarps], s_hi[kWarps];
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_lo[warp] = lo;
    s_hi[warp] = hi;
  }
  __syncthreads();
  if (warp == 0) {
    lo = lane < kWarps ? s_lo[lane] : 0xFFFFFFFFu;
    hi = lane < kWarps ? s_hi[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) {
      lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
  }
}

__device__ __forceinline__ uint64_t block_sum(uint64_t v) {
  __shared__ uint64_t s_sum[kWarps];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) s_sum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? s_sum[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;  // addition mod 2**64 is associative and commutative: the order does not matter
}

// ------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------

// Grid-stride over blocks. With a spin the grid is at most one CTA per SM (see grid_for), so every
// CTA is resident from the start and the spin delays the whole write by about spin_ns.
__global__ void __launch_bounds__(kThreads) write_blocks_kernel(const int64_t* __restrict__ ptrs,
                                                                const int64_t* __restrict__ ids, int64_t n,
                                                                uint32_t n_words, uint32_t generation,
                                                                uint64_t seed, uint64_t spin_ns) {
  if (spin_ns != 0) {
    if (threadIdx.x == 0) hold_for(spin_ns);
    __syncthreads();
  }
  for (int64_t b = blockIdx.x; b < n; b += gridDim.x) {
    const Span s = span_of(ptrs[b], n_words);
    if (s.words == nullptr) continue;
    const uint32_t key = block_key(seed, static_cast<uint64_t>(ids[b]));
    ulonglong2* v = reinterpret_cast<ulonglong2*>(s.words + s.head);
    for (uint32_t k = threadIdx.x; k < s.pairs; k += kThreads) {
      const uint32_t i = s.head + 2 * k;
      v[k] = make_ulonglong2(pattern_word(key, generation, i), pattern_word(key, generation, i + 1));
    }
    if (threadIdx.x == 0 && s.head) s.words[0] = pattern_word(key, generation, 0);
    if (threadIdx.x == kThreads - 1 && s.tail) s.words[n_words - 1] = pattern_word(key, generation, n_words - 1);
  }
}

__device__ uint64_t g_read_sink;  // written only if a reader's sum hits a magic value

// Each thread scans its share of the blocks again and again until duration_ns has passed since
// it started (at least once). Grid as for write_blocks, so all CTAs read at the same time.
__global__ void __launch_bounds__(kThreads) read_blocks_kernel(const int64_t* __restrict__ ptrs, int64_t n,
                                                               uint32_t n_words, uint64_t duration_ns) {
  const uint64_t start = global_timer_ns();
  uint64_t acc = 0;
  do {
    for (int64_t b = blockIdx.x; b < n; b += gridDim.x) {
      const Span s = span_of(ptrs[b], n_words);
      if (s.words == nullptr) continue;
      const ulonglong2* v = pairs_of(s);
      for (uint32_t k = threadIdx.x; k < s.pairs; k += kThreads) {
        const ulonglong2 x = load_volatile_pair(v + k);
        acc = acc * 31 + (x.x ^ x.y);
      }
      if (threadIdx.x == 0 && s.head) acc += load_volatile_word(s.words);
      if (threadIdx.x == kThreads - 1 && s.tail) acc += load_volatile_word(s.words + n_words - 1);
    }
  } while (global_timer_ns() - start < duration_ns);
  // The loads are volatile already; the sink makes their values observable too.
  if (acc == 0x6B7676657269667AULL) g_read_sink = acc;
}

// One CTA per block. Each thread checks its words (four 16-byte loads in flight per thread), then
// the CTA reduces "any word bad", the smallest and the largest generation seen.
__global__ void __launch_bounds__(kThreads) verify_blocks_kernel(const int64_t* __restrict__ ptrs,
                                                                 const int64_t* __restrict__ ids, uint32_t n_words,
                                                                 uint32_t expected, uint64_t seed,
                                                                 int8_t* __restrict__ states,
                                                                 int64_t* __restrict__ generations) {
  const int64_t b = blockIdx.x;
  const Span s = span_of(ptrs[b], n_words);
  if (s.words == nullptr) {  // uniform over the CTA: no thread reaches the barriers below
    if (threadIdx.x == 0) {
      states[b] = kGarbage;
      generations[b] = -1;
    }
    return;
  }
  const uint32_t key = block_key(seed, static_cast<uint64_t>(ids[b]));
  bool bad = false;
  uint32_t gmin = 0xFFFFFFFFu, gmax = 0;
  auto check = [&](uint64_t w, uint32_t i) {
    const uint32_t g = static_cast<uint32_t>(w >> 32);
    bad |= static_cast<uint32_t>(w) != h32_keyed(key, g, i);
    gmin = min(gmin, g);
    gmax = max(gmax, g);
  };
  for_each_word(s, n_words, check);

  const bool any_bad = __syncthreads_or(bad) != 0;
  block_min_max(gmin, gmax);
  if (threadIdx.x == 0) {
    // Same precedence as kvverify.pattern.classify_blocks. A poison word has the reserved
    // generation, which is the largest possible, so gmax catches it.
    int8_t state;
    int64_t generation = -1;
    if (any_bad || gmax == kPoisonGeneration) {
      state = kGarbage;
    } else if (gmin != gmax) {
      state = kTorn;
    } else {
      state = gmin == expected ? kOk : kStale;
      generation = gmin;
    }
    states[b] = state;
    generations[b] = generation;
  }
}

// One CTA per block: sum over words of checksum_term(word, index), mod 2**64.
__global__ void __launch_bounds__(kThreads) checksum_blocks_kernel(const int64_t* __restrict__ ptrs, uint32_t n_words,
                                                                   int64_t* __restrict__ out) {
  const int64_t b = blockIdx.x;
  const Span s = span_of(ptrs[b], n_words);
  if (s.words == nullptr) {  // uniform over the CTA
    if (threadIdx.x == 0) out[b] = 0;
    return;
  }
  uint64_t sum = 0;
  for_each_word(s, n_words, [&](uint64_t w, uint32_t i) { sum += checksum_term(w, i); });
  sum = block_sum(sum);
  if (threadIdx.x == 0) out[b] = static_cast<int64_t>(sum);
}

__global__ void spin_kernel(uint64_t duration_ns) { hold_for(duration_ns); }

}  // namespace

namespace kvverify::launch {

// Launchers for csrc/harness/harness_ops.cpp, which checks arguments and owns the tensors: keeping the
// throwing, tensor-handling host code out of nvcc's translation units (extension-cpp's layout).
// Each returns the launch's error, left for the caller to check.

cudaError_t write_blocks(const int64_t* ptrs, const int64_t* ids, int64_t n, uint32_t n_words, uint32_t generation,
                         uint64_t seed, uint64_t spin_ns, int grid, cudaStream_t stream) {
  write_blocks_kernel<<<grid, kThreads, 0, stream>>>(ptrs, ids, n, n_words, generation, seed, spin_ns);
  return cudaGetLastError();
}

cudaError_t read_blocks(const int64_t* ptrs, int64_t n, uint32_t n_words, uint64_t duration_ns, int grid,
                        cudaStream_t stream) {
  read_blocks_kernel<<<grid, kThreads, 0, stream>>>(ptrs, n, n_words, duration_ns);
  return cudaGetLastError();
}

cudaError_t verify_blocks(const int64_t* ptrs, const int64_t* ids, int64_t n, uint32_t n_words, uint32_t expected,
                          uint64_t seed, int8_t* states, int64_t* generations, cudaStream_t stream) {
  verify_blocks_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(ptrs, ids, n_words, expected, seed, states,
                                                                          generations);
  return cudaGetLastError();
}

cudaError_t checksum_blocks(const int64_t* ptrs, int64_t n, uint32_t n_words, int64_t* out, cudaStream_t stream) {
  checksum_blocks_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(ptrs, n_words, out);
  return cudaGetLastError();
}

cudaError_t spin(uint64_t duration_ns, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(duration_ns);
  return cudaGetLastError();
}

}  // namespace kvverify::launch
