// Launcher of the SM-kernel copy path (csrc/op/copy_kernel.cu), called by swap_blocks_kernel in
// csrc/op/swap_blocks.cpp, which validates the batch, splits it into chunks and stages the chunk
// descriptors on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvverify {

// The largest piece of one copy that one thread block moves: a 2 MiB page becomes 32 chunks, so
// a batch of a few big pages still spreads over every SM; a 16 KiB page is one chunk.
constexpr int64_t kCopyChunkBytes = 64 * 1024;

namespace launch {

// Queues the copy of `chunks` chunks on `stream`, on the current device, with at most a few thread
// blocks per SM (copy_kernel.cu says why). `descriptors` is device memory holding three
// int64 arrays of `chunks` entries each, back to back: source addresses, destination addresses,
// bytes (each a multiple of 8, at most kCopyChunkBytes; addresses 8-byte aligned, device or
// mapped host memory). Returns the launch's error for the caller to check.
cudaError_t copy_chunks(const int64_t* descriptors, int64_t chunks, cudaStream_t stream);

}  // namespace launch
}  // namespace kvverify
