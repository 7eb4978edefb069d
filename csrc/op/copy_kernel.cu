// The SM-kernel copy path: thread blocks copy the chunks of a batch through loads and stores, the
// host side of each copy reached through UVA (pinned memory from cudaHostAlloc is mapped into
// the device's address space at its host address; so is memory registered with
// cudaHostRegisterMapped where cudaDevAttrCanUseHostPointerForRegisteredMem is 1).
//
// A kernel is stream-ordered on both sides: it reads its sources and writes its destinations
// after everything issued earlier to its stream, like a cuMemcpyBatchAsync in STREAM order.
// Only the CUDA runtime API is used: the extension never links libcuda.

#include <cuda_runtime.h>

#include <cstdint>

#include "copy_kernel.h"

namespace {

constexpr int kThreads = 256;  // threads per block: 4 KiB per pass of 16-byte accesses
constexpr int kInFlight = 4;   // independent loads per thread before the first store
// Blocks per SM at most (1024 threads, 32 registers each: half of an SM's threads and registers).
// A batch's kernel then never fills the device: the other direction's kernel of a swap issued on
// another stream at the same time gets the other half and runs beside it instead of after it
// (the block scheduler dispatches a later kernel's blocks only where the earlier one leaves room),
// and a compute kernel finds room sooner. 64 KiB in flight per SM is still far more than the link's
// bandwidth-delay product (about 55 GB/s x a few microseconds).
constexpr int kBlocksPerSm = 4;

static_assert(kvverify::kCopyChunkBytes / 16 < (1LL << 31), "chunk offsets must fit 32 bits");

// Copies `bytes` (a multiple of 8) from `src` to `dst`, both at the same offset (0 or 8) from a
// 16-byte boundary: an 8-byte head word brings both onto a boundary, 16-byte pairs follow, and an
// 8-byte tail word ends it when one is left. Each thread keeps kInFlight pairs in flight, so a
// load from host memory (a PCIe round trip of about a microsecond) overlaps its neighbours'.
__device__ __forceinline__ void copy_pairs(uint64_t src, uint64_t dst, uint32_t bytes) {
  const uint32_t head = static_cast<uint32_t>(src & 15);  // 0 or 8
  const uint32_t pairs = (bytes - head) / 16;
  const uint32_t tail = (bytes - head) & 8;
  if (head != 0 && threadIdx.x == 0) {
    *reinterpret_cast<uint64_t*>(dst) = *reinterpret_cast<const uint64_t*>(src);
  }
  if (tail != 0 && threadIdx.x == kThreads - 1) {
    *reinterpret_cast<uint64_t*>(dst + bytes - 8) = *reinterpret_cast<const uint64_t*>(src + bytes - 8);
  }
  const ulonglong2* s = reinterpret_cast<const ulonglong2*>(src + head);
  ulonglong2* d = reinterpret_cast<ulonglong2*>(dst + head);
  uint32_t k = threadIdx.x;
  for (; k + (kInFlight - 1) * kThreads < pairs; k += kInFlight * kThreads) {
    ulonglong2 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = s[k + u * kThreads];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) d[k + u * kThreads] = v[u];
  }
  for (; k < pairs; k += kThreads) d[k] = s[k];
}

// The same for addresses at different offsets from a 16-byte boundary: 8-byte words throughout
// (a 16-byte access would be misaligned on one side).
__device__ __forceinline__ void copy_words(uint64_t src, uint64_t dst, uint32_t bytes) {
  const uint32_t words = bytes / 8;
  const uint64_t* s = reinterpret_cast<const uint64_t*>(src);
  uint64_t* d = reinterpret_cast<uint64_t*>(dst);
  uint32_t k = threadIdx.x;
  for (; k + (kInFlight - 1) * kThreads < words; k += kInFlight * kThreads) {
    uint64_t v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = s[k + u * kThreads];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) d[k + u * kThreads] = v[u];
  }
  for (; k < words; k += kThreads) d[k] = s[k];
}

// Each thread block copies chunks blockIdx.x, blockIdx.x + gridDim.x, ...; every thread reads the
// chunk's descriptor (one broadcast load each). The launch bound caps registers at 32 per thread so
// that two such kernels (an H2D and a D2H batch at once) fit one SM's register file together.
__global__ void __launch_bounds__(kThreads, 2 * kBlocksPerSm) copy_chunks_kernel(const int64_t* __restrict__ descriptors, uint32_t chunks) {
  for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const uint64_t src = static_cast<uint64_t>(descriptors[c]);
    const uint64_t dst = static_cast<uint64_t>(descriptors[static_cast<uint64_t>(chunks) + c]);
    const uint32_t bytes = static_cast<uint32_t>(descriptors[2 * static_cast<uint64_t>(chunks) + c]);
    if (((src ^ dst) & 15) == 0) {
      copy_pairs(src, dst, bytes);
    } else {
      copy_words(src, dst, bytes);
    }
  }
}

}  // namespace

namespace kvverify::launch {

cudaError_t copy_chunks(const int64_t* descriptors, int64_t chunks, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t grid = chunks < static_cast<int64_t>(sms) * kBlocksPerSm ? chunks : static_cast<int64_t>(sms) * kBlocksPerSm;
  // The caller keeps chunks below 2**31 (one grid-stride index in 32 bits).
  copy_chunks_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(descriptors, static_cast<uint32_t>(chunks));
  return cudaGetLastError();
}

}  // namespace kvverify::launch
