// Launchers of the harness kernels (csrc/harness/harness_kernels.cu), called by the ops in
// csrc/harness/harness_ops.cpp. Pointers are device-visible addresses; every launcher queues its kernel
// on `stream` and returns the launch's error for the caller to check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pattern.cuh"

namespace kvverify {

// Guard against unit mistakes (nanoseconds, not microseconds): no hold may exceed a minute.
constexpr int64_t kMaxHoldNs = 60LL * 1000 * 1000 * 1000;

namespace launch {

cudaError_t write_blocks(const int64_t* ptrs, const int64_t* ids, int64_t n, uint32_t n_words, uint32_t generation,
                         uint64_t seed, uint64_t spin_ns, int grid, cudaStream_t stream);
cudaError_t read_blocks(const int64_t* ptrs, int64_t n, uint32_t n_words, uint64_t duration_ns, int grid,
                        cudaStream_t stream);
cudaError_t verify_blocks(const int64_t* ptrs, const int64_t* ids, int64_t n, uint32_t n_words, uint32_t expected,
                          uint64_t seed, int8_t* states, int64_t* generations, cudaStream_t stream);
cudaError_t checksum_blocks(const int64_t* ptrs, int64_t n, uint32_t n_words, int64_t* out, cudaStream_t stream);
cudaError_t spin(uint64_t duration_ns, cudaStream_t stream);

}  // namespace launch
}  // namespace kvverify
