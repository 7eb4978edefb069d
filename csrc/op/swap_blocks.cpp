// torch.ops.kvverify.swap_blocks_batch: one cuMemcpyBatchAsync over raw byte addresses, under
// the source access order the caller asks for; swap_blocks_loop: one cudaMemcpyAsync per copy;
// swap_blocks_kernel: the same batch copied by thread blocks (csrc/op/copy_kernel.cu).
//
// The driver entry point is resolved at run time (cudaGetDriverEntryPointByVersion) so that the
// extension never links libcuda: build hosts have no driver, and one build serves both the
// CUDA 12.8 signature of cuMemcpyBatchAsync (with failIdx) and the CUDA 13 one (without).

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <torch/library.h>

#include "context.h"
#include "copy_kernel.h"
#include "record/host_watch.h"
#include "message.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

// A module object so that `import kvverify._C` works under Py_LIMITED_API; the ops register
// themselves with the dispatcher when the shared object loads.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace kvverify {
namespace {

// The two published signatures of cuMemcpyBatchAsync (cudaTypedefs.h).
using BatchV12080 = PFN_cuMemcpyBatchAsync_v12080;  // ..., size_t* failIdx, CUstream
using BatchV13000 = PFN_cuMemcpyBatchAsync_v13000;  // ..., CUstream
using GetErrorName = PFN_cuGetErrorName_v6000;

struct DriverApi {
  BatchV13000 batch_v13 = nullptr;
  BatchV12080 batch_v12 = nullptr;
  GetErrorName get_error_name = nullptr;
  int driver_version = 0;
  bool has_batch() const { return batch_v13 != nullptr || batch_v12 != nullptr; }
};

template <typename Fn>
Fn resolve(const char* symbol, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // a missing symbol is an answer, not an error to leave behind
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

const DriverApi& driver_api() {
  static DriverApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverGetVersion(&api.driver_version);
    // Ask for the newest signature first: a 13.x driver answers the 13000 request with the
    // variant without failIdx; a 12.8/12.9 driver only knows the 12080 one.
    if (api.driver_version >= 13000) api.batch_v13 = resolve<BatchV13000>("cuMemcpyBatchAsync", 13000);
    if (api.batch_v13 == nullptr && api.driver_version >= 12080)
      api.batch_v12 = resolve<BatchV12080>("cuMemcpyBatchAsync", 12080);
    api.get_error_name = resolve<GetErrorName>("cuGetErrorName", 6000);
  });
  return api;
}

std::string driver_error_name(CUresult result) {
  const char* name = nullptr;
  if (driver_api().get_error_name != nullptr) driver_api().get_error_name(result, &name);
  return name != nullptr ? std::string(name) : "CUresult " + std::to_string(static_cast<int>(result));
}

void check_index_tensor(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, kvverify::cat(arg, " must be an int64 tensor, got ", t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1, kvverify::cat(arg, " must be 1-D, got ", t.dim(), " dimensions"));
  TORCH_CHECK_VALUE(t.device().is_cpu(), kvverify::cat(arg, " must be on the CPU (it is read by the host), got ", t.device()));
}

// Validates every argument before anything is issued, so a rejected call changes nothing.
// `whole_words`: the kernel path's further rule, sizes and addresses in whole 8-byte words.
// Returns the number of copies.
int64_t validate(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes, bool whole_words = false) {
  check_index_tensor(src_ptrs, "src_ptrs");
  check_index_tensor(dst_ptrs, "dst_ptrs");
  check_index_tensor(sizes, "sizes");
  const int64_t n = src_ptrs.numel();
  TORCH_CHECK_VALUE(dst_ptrs.numel() == n && sizes.numel() == n, kvverify::cat("src_ptrs, dst_ptrs and sizes must have the same length, got ", n, ", ", dst_ptrs.numel(),
                    " and ", sizes.numel()));
  if (n == 0) return 0;
  const auto src = src_ptrs.contiguous();
  const auto dst = dst_ptrs.contiguous();
  const auto len = sizes.contiguous();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* z = len.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(z[i] > 0, kvverify::cat("sizes[", i, "] must be > 0 bytes, got ", z[i]));
    TORCH_CHECK_VALUE(s[i] != 0, kvverify::cat("src_ptrs[", i, "] is a null pointer"));
    TORCH_CHECK_VALUE(d[i] != 0, kvverify::cat("dst_ptrs[", i, "] is a null pointer"));
  }
  // The kernel moves 8-byte words (16-byte pairs where both sides allow): a partial word would
  // need byte accesses, which the driver's copy paths do better.
  for (int64_t i = 0; whole_words && i < n; ++i) {
    TORCH_CHECK_VALUE(z[i] % 8 == 0, kvverify::cat("sizes[", i, "] = ", z[i],
                      " bytes is not a multiple of 8: the kernel copy path moves whole 8-byte words; "
                      "use method='batch'"));
    TORCH_CHECK_VALUE(s[i] % 8 == 0, kvverify::cat("src_ptrs[", i, "] = ", s[i],
                      " is not 8-byte aligned: the kernel copy path moves whole 8-byte words; use method='batch'"));
    TORCH_CHECK_VALUE(d[i] % 8 == 0, kvverify::cat("dst_ptrs[", i, "] = ", d[i],
                      " is not 8-byte aligned: the kernel copy path moves whole 8-byte words; use method='batch'"));
  }
  TORCH_CHECK_VALUE(c10::cuda::device_count() > 0, kvverify::cat("swap_blocks_batch needs a CUDA device, and none is visible"));
  return n;
}

// cuMemcpyBatchAsync refuses the legacy NULL stream (CUDA Driver API, cuMemcpyBatchAsync:
// "hStream ... Must not be legacy NULL stream"), which is torch's default stream. On it the
// batch runs on a side stream joined both ways by events, which keeps the stream-order
// semantics of every source access order: the side stream's only pending work is the wait.
template <typename Issue>
void on_batch_capable_stream(cudaStream_t stream, Issue issue) {
  if (stream != nullptr && stream != cudaStreamLegacy) {
    issue(stream);
    return;
  }
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  cudaEvent_t before = nullptr, after = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&after, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(before, stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), before, 0));
  try {
    issue(side.stream());
  } catch (...) {
    cudaEventDestroy(before);
    cudaEventDestroy(after);
    throw;
  }
  C10_CUDA_CHECK(cudaEventRecord(after, side.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream, after, 0));
  // Destroying an event with pending work is allowed: its resources go once the work completes.
  C10_CUDA_CHECK(cudaEventDestroy(before));
  C10_CUDA_CHECK(cudaEventDestroy(after));
}

void copy_loop(const int64_t* s, const int64_t* d, const int64_t* z, int64_t n, cudaStream_t stream) {
  for (int64_t i = 0; i < n; ++i) {
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(d[i]), reinterpret_cast<const void*>(s[i]),
                                      static_cast<size_t>(z[i]), cudaMemcpyDefault, stream);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky: leave the runtime usable for the next call
      TORCH_CHECK(false, kvverify::cat("cudaMemcpyAsync failed for copy ", i, " of ", n, ": ", cudaGetErrorName(err), " (",
                  cudaGetErrorString(err), ")"));
    }
  }
}

void copy_batch(const int64_t* s, const int64_t* d, const int64_t* z, int64_t n, int64_t order,
                const c10::cuda::CUDAStream& current) {
  const DriverApi& api = driver_api();
  bind_primary_context(current.device_index());
  const cudaStream_t stream = current.stream();
  CUmemcpyAttributes attr = {};
  attr.srcAccessOrder = static_cast<CUmemcpySrcAccessOrder>(order);
  size_t attr_index = 0;
  // The driver takes non-const arrays of its own integer types; int64 and CUdeviceptr/size_t
  // have the same width on every platform CUDA supports, but copy rather than alias.
  std::vector<CUdeviceptr> srcs(s, s + n), dsts(d, d + n);
  std::vector<size_t> bytes(z, z + n);
  CUresult result;
  size_t fail_index = SIZE_MAX;
  on_batch_capable_stream(stream, [&](cudaStream_t st) {
    if (api.batch_v13 != nullptr) {
      result = api.batch_v13(dsts.data(), srcs.data(), bytes.data(), static_cast<size_t>(n), &attr, &attr_index, 1,
                             reinterpret_cast<CUstream>(st));
    } else {
      result = api.batch_v12(dsts.data(), srcs.data(), bytes.data(), static_cast<size_t>(n), &attr, &attr_index, 1,
                             &fail_index, reinterpret_cast<CUstream>(st));
    }
    if (result != CUDA_SUCCESS) {
      std::string where = fail_index != SIZE_MAX ? " at copy " + std::to_string(fail_index) + " of " + std::to_string(n)
                                                 : " (the driver does not report which copy failed)";
      TORCH_CHECK(false, kvverify::cat("cuMemcpyBatchAsync failed", where, ": ", driver_error_name(result),
                  " (srcAccessOrder=", order, ")"));
    }
  });
}

struct Pointers {
  at::Tensor src, dst, len;
  const int64_t* s() const { return src.data_ptr<int64_t>(); }
  const int64_t* d() const { return dst.data_ptr<int64_t>(); }
  const int64_t* z() const { return len.data_ptr<int64_t>(); }
};

Pointers contiguous(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes) {
  return {src_ptrs.contiguous(), dst_ptrs.contiguous(), sizes.contiguous()};
}

void swap_blocks_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                       int64_t src_access_order) {
  TORCH_CHECK_VALUE(src_access_order >= CU_MEMCPY_SRC_ACCESS_ORDER_STREAM &&
                        src_access_order <= CU_MEMCPY_SRC_ACCESS_ORDER_ANY, kvverify::cat("src_access_order must be 1 (STREAM), 2 (DURING_API_CALL) or 3 (ANY), got ", src_access_order));
  const int64_t n = validate(src_ptrs, dst_ptrs, sizes);
  if (n == 0) return;
  const Pointers p = contiguous(src_ptrs, dst_ptrs, sizes);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  if (driver_api().has_batch()) {
    copy_batch(p.s(), p.d(), p.z(), n, src_access_order, stream);
  } else {
    copy_loop(p.s(), p.d(), p.z(), n, stream.stream());
  }
}

void swap_blocks_loop(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes) {
  const int64_t n = validate(src_ptrs, dst_ptrs, sizes);
  if (n == 0) return;
  const Pointers p = contiguous(src_ptrs, dst_ptrs, sizes);
  copy_loop(p.s(), p.d(), p.z(), n, c10::cuda::getCurrentCUDAStream().stream());
}

// The chunk descriptors (source, destination, bytes) reach the device in stream order: packed into
// a pinned tensor from torch's caching host allocator, copied with a non-blocking copy_ into a
// device tensor on the current stream, then read by the kernel behind it. copy_ records an event
// on the pinned block (CachingHostAllocator_recordEvent), so torch hands that block out again only
// after the copy has read it: a later call never rewrites descriptors an earlier copy may still
// read, whichever stream either runs on and however long the earlier one waits. The device tensor
// goes back to torch's caching allocator for the current stream, whose next user is ordered after
// this kernel by that stream.
void swap_blocks_kernel(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes) {
  const int64_t n = validate(src_ptrs, dst_ptrs, sizes, /*whole_words=*/true);
  if (n == 0) return;
  const Pointers p = contiguous(src_ptrs, dst_ptrs, sizes);
  const int64_t* s = p.s();
  const int64_t* d = p.d();
  const int64_t* z = p.z();
  int64_t chunks = 0;
  for (int64_t i = 0; i < n; ++i) chunks += (z[i] + kCopyChunkBytes - 1) / kCopyChunkBytes;
  TORCH_CHECK_VALUE(chunks <= 0x7FFFFFFFLL, kvverify::cat("the batch splits into ", chunks, " chunks of at most ",
                    kCopyChunkBytes, " bytes, more than one launch holds (2**31 - 1); split the batch"));
  auto staged = at::empty({3 * chunks}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = staged.data_ptr<int64_t>();
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t offset = 0; offset < z[i]; offset += kCopyChunkBytes, ++c) {
      h[c] = s[i] + offset;
      h[chunks + c] = d[i] + offset;
      h[2 * chunks + c] = std::min(kCopyChunkBytes, z[i] - offset);
    }
  }
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  auto descriptors = at::empty({3 * chunks}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, stream.device_index()));
  descriptors.copy_(staged, /*non_blocking=*/true);
  C10_CUDA_CHECK(launch::copy_chunks(descriptors.data_ptr<int64_t>(), chunks, stream.stream()));
  if (kvverify::watch::on()) {  // a recording's host watch: what the kernel reads and writes (host_watch.h)
    std::vector<kvverify::watch::Access> accesses;
    accesses.reserve(2 * n);
    for (int64_t i = 0; i < n; ++i) {
      accesses.push_back({static_cast<uint64_t>(s[i]), static_cast<uint64_t>(z[i]), false});
      accesses.push_back({static_cast<uint64_t>(d[i]), static_cast<uint64_t>(z[i]), true});
    }
    kvverify::watch::device_op(kvverify::watch::stream_key(reinterpret_cast<uint64_t>(stream.stream()), false),
                               accesses.data(), accesses.size());
  }
}

bool batch_api_available() { return driver_api().has_batch(); }

int64_t driver_version() { return driver_api().driver_version; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvverify, m) {
  m.def("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int src_access_order=1) -> ()");
  m.def("swap_blocks_loop(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes) -> ()");
  m.def("swap_blocks_kernel(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes) -> ()");
  m.def("batch_api_available() -> bool", &batch_api_available);
  m.def("driver_version() -> int", &driver_version);
}

// The pointer tensors live on the CPU whatever the copies touch, so one kernel serves every
// backend; registering it for all of them lets the op itself reject a CUDA tensor by name.
TORCH_LIBRARY_IMPL(kvverify, CompositeExplicitAutograd, m) {
  m.impl("swap_blocks_batch", &swap_blocks_batch);
  m.impl("swap_blocks_loop", &swap_blocks_loop);
  m.impl("swap_blocks_kernel", &swap_blocks_kernel);
}

}  // namespace kvverify
