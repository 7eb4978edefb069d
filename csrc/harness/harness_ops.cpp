// Host side of the harness kernels (csrc/harness/harness_kernels.cu): argument checks that name the
// argument, tensor handling, launches on the current stream, and the op registrations.
//
// Ops (torch.ops.kvverify.*; Python wrappers with full docs in kvverify/device/kernels.py):
//   write_blocks(Tensor block_ptrs, int block_bytes, Tensor block_ids, int generation, int seed, int spin_ns) -> ()
//   read_blocks(Tensor block_ptrs, int block_bytes, int duration_ns) -> ()
//   verify_blocks(Tensor block_ptrs, int block_bytes, Tensor block_ids, int expected_generation, int seed)
//       -> (Tensor states, Tensor generations)
//   checksum_blocks(Tensor block_ptrs, int block_bytes) -> Tensor
//   spin(int duration_ns) -> ()
//
// Every op launches on the current CUDA stream of block_ptrs' device and never synchronises. The
// current stream comes from c10/cuda/CUDAStream.h: ATen/cuda/CUDAContext.h would also pull in
// cuBLAS/cuSPARSE headers that a minimal toolkit, like the CI image's, lacks.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "message.h"

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "harness_kernels.h"
#include "record/host_watch.h"

namespace {

using namespace kvverify;
using kvverify::pattern::kPoisonGeneration;

// ------------------------------------------------------------------------------------------
// Host side: argument checks (each names its argument) and launches
// ------------------------------------------------------------------------------------------

void check_address_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, kvverify::cat(name, " must be an int64 tensor, got ", t.scalar_type()));
  TORCH_CHECK_VALUE(t.is_cuda(), kvverify::cat(name,
                    " must be a CUDA tensor (kvverify.kernels moves host arrays to the device), got device ",
                    t.device()));
  TORCH_CHECK_VALUE(t.dim() == 1, kvverify::cat(name, " must be 1-D (one entry per block), got shape ", t.sizes()));
}

void check_ids(const at::Tensor& block_ids, const at::Tensor& block_ptrs) {
  check_address_tensor(block_ids, "block_ids");
  TORCH_CHECK_VALUE(block_ids.device() == block_ptrs.device(), kvverify::cat("block_ids must be on block_ptrs' device ",
                    block_ptrs.device(), ", got ", block_ids.device()));
  TORCH_CHECK_VALUE(block_ids.numel() == block_ptrs.numel(), kvverify::cat("block_ids must have one id per block: ",
                    block_ptrs.numel(), " block_ptrs but ", block_ids.numel(), " block_ids"));
}

uint32_t check_block_bytes(int64_t block_bytes) {
  TORCH_CHECK_VALUE(block_bytes > 0 && block_bytes % 8 == 0, kvverify::cat("block_bytes must be a positive multiple of 8 (whole 8-byte words), got ", block_bytes));
  TORCH_CHECK_VALUE(block_bytes / 8 <= 0xFFFFFFFFLL, kvverify::cat("block_bytes must be at most 8 * (2**32 - 1) (32-bit word index), got ",
                    block_bytes));
  return static_cast<uint32_t>(block_bytes / 8);
}

uint32_t check_generation(int64_t generation, const char* name) {
  TORCH_CHECK_VALUE(generation >= 0 && generation < static_cast<int64_t>(kPoisonGeneration), kvverify::cat(name,
                    " must lie in [0, 2**32 - 2] (2**32 - 1 is reserved for poison), got ", generation));
  return static_cast<uint32_t>(generation);
}

uint64_t check_hold(int64_t ns, const char* name) {
  TORCH_CHECK_VALUE(ns >= 0 && ns <= kMaxHoldNs, kvverify::cat(name, " must lie in [0, ", kMaxHoldNs,
                    "] nanoseconds (at most a minute), got ", ns));
  return static_cast<uint64_t>(ns);
}

int64_t check_grid(const at::Tensor& block_ptrs) {
  const int64_t n = block_ptrs.numel();
  TORCH_CHECK_VALUE(n <= 0x7FFFFFFFLL, kvverify::cat("block_ptrs may hold at most 2**31 - 1 blocks (one CTA each), got ", n));
  return n;
}

// Grid of the grid-stride kernels (write, read): `per_sm` CTAs per SM at most. With a spin or a
// read duration it is 1: all CTAs are resident at once (so the hold covers the whole grid), and
// each SM keeps most of its room for kernels on other streams (an executor's copy or snapshot must
// still run while a writer spins or a reader reads). A plain write uses 4 for store throughput.
int grid_for(int64_t n, int per_sm) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<int>(std::min<int64_t>(n, static_cast<int64_t>(sms) * per_sm));
}

// The blocks a kernel just issued reaches through `ptrs` (pinned or registered ones: host memory
// the device may still touch), for the host watch of a recording (host_watch.h): a kernel of the
// dispatcher is not looked into by native capture.
void watched(const at::Tensor& ptrs, int64_t n, int64_t block_bytes, bool writes) {
  if (!kvverify::watch::on()) return;
  const auto stream = reinterpret_cast<uint64_t>(c10::cuda::getCurrentCUDAStream().stream());
  kvverify::watch::table_op(kvverify::watch::stream_key(stream, false), reinterpret_cast<uint64_t>(ptrs.data_ptr()),
                            n, static_cast<uint64_t>(block_bytes), writes);
}

void write_blocks(const at::Tensor& block_ptrs, int64_t block_bytes, const at::Tensor& block_ids, int64_t generation,
                  int64_t seed, int64_t spin_ns) {
  check_address_tensor(block_ptrs, "block_ptrs");
  check_ids(block_ids, block_ptrs);
  const uint32_t n_words = check_block_bytes(block_bytes);
  const uint32_t g = check_generation(generation, "generation");
  const uint64_t spin = check_hold(spin_ns, "spin_ns");
  const int64_t n = block_ptrs.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(block_ptrs.device());
  const auto ptrs = block_ptrs.contiguous();
  const auto ids = block_ids.contiguous();
  C10_CUDA_CHECK(launch::write_blocks(ptrs.data_ptr<int64_t>(), ids.data_ptr<int64_t>(), n, n_words, g,
                                      static_cast<uint64_t>(seed), spin, grid_for(n, spin != 0 ? 1 : 4),
                                      c10::cuda::getCurrentCUDAStream()));
  watched(ptrs, n, block_bytes, true);
}

void read_blocks(const at::Tensor& block_ptrs, int64_t block_bytes, int64_t duration_ns) {
  check_address_tensor(block_ptrs, "block_ptrs");
  const uint32_t n_words = check_block_bytes(block_bytes);
  const uint64_t duration = check_hold(duration_ns, "duration_ns");
  const int64_t n = block_ptrs.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(block_ptrs.device());
  const auto ptrs = block_ptrs.contiguous();
  C10_CUDA_CHECK(
      launch::read_blocks(ptrs.data_ptr<int64_t>(), n, n_words, duration, grid_for(n, 1), c10::cuda::getCurrentCUDAStream()));
  watched(ptrs, n, block_bytes, false);
}

std::tuple<at::Tensor, at::Tensor> verify_blocks(const at::Tensor& block_ptrs, int64_t block_bytes,
                                                 const at::Tensor& block_ids, int64_t expected_generation,
                                                 int64_t seed) {
  check_address_tensor(block_ptrs, "block_ptrs");
  check_ids(block_ids, block_ptrs);
  const uint32_t n_words = check_block_bytes(block_bytes);
  const uint32_t expected = check_generation(expected_generation, "expected_generation");
  const int64_t n = check_grid(block_ptrs);
  const c10::cuda::CUDAGuard guard(block_ptrs.device());
  auto states = at::empty({n}, block_ptrs.options().dtype(at::kChar));
  auto generations = at::empty({n}, block_ptrs.options().dtype(at::kLong));
  if (n == 0) return {states, generations};
  const auto ptrs = block_ptrs.contiguous();
  const auto ids = block_ids.contiguous();
  C10_CUDA_CHECK(launch::verify_blocks(ptrs.data_ptr<int64_t>(), ids.data_ptr<int64_t>(), n, n_words, expected,
                                       static_cast<uint64_t>(seed), states.data_ptr<int8_t>(),
                                       generations.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()));
  watched(ptrs, n, block_bytes, false);
  return {states, generations};
}

at::Tensor checksum_blocks(const at::Tensor& block_ptrs, int64_t block_bytes) {
  check_address_tensor(block_ptrs, "block_ptrs");
  const uint32_t n_words = check_block_bytes(block_bytes);
  const int64_t n = check_grid(block_ptrs);
  const c10::cuda::CUDAGuard guard(block_ptrs.device());
  auto out = at::empty({n}, block_ptrs.options().dtype(at::kLong));
  if (n == 0) return out;
  const auto ptrs = block_ptrs.contiguous();
  C10_CUDA_CHECK(launch::checksum_blocks(ptrs.data_ptr<int64_t>(), n, n_words, out.data_ptr<int64_t>(),
                                         c10::cuda::getCurrentCUDAStream()));
  watched(ptrs, n, block_bytes, false);
  return out;
}

// Holds the current stream of the current device.
void spin(int64_t duration_ns) {
  const uint64_t duration = check_hold(duration_ns, "duration_ns");
  C10_CUDA_CHECK(launch::spin(duration, c10::cuda::getCurrentCUDAStream()));
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(kvverify, m) {
  m.def("write_blocks(Tensor block_ptrs, int block_bytes, Tensor block_ids, int generation, int seed, int spin_ns) -> ()");
  m.def("read_blocks(Tensor block_ptrs, int block_bytes, int duration_ns) -> ()");
  m.def(
      "verify_blocks(Tensor block_ptrs, int block_bytes, Tensor block_ids, int expected_generation, int seed)"
      " -> (Tensor states, Tensor generations)");
  m.def("checksum_blocks(Tensor block_ptrs, int block_bytes) -> Tensor");
  m.def("spin(int duration_ns) -> ()");
}

TORCH_LIBRARY_IMPL(kvverify, CUDA, m) {
  m.impl("write_blocks", &write_blocks);
  m.impl("read_blocks", &read_blocks);
  m.impl("verify_blocks", &verify_blocks);
  m.impl("checksum_blocks", &checksum_blocks);
}

// spin takes no tensor, so the dispatcher has no device key to route on: a CUDA-key kernel
// would never be found. CompositeExplicitAutograd is the slot used for tensor-less calls.
TORCH_LIBRARY_IMPL(kvverify, CompositeExplicitAutograd, m) { m.impl("spin", &spin); }
