// torch.ops.kvverify.check_pointers: find the copies whose addresses the driver cannot resolve
// before they reach it.
//
// Measured on an H200 with driver 580 (docs/op.md): cuMemcpyBatchAsync and cudaMemcpyAsync treat
// an address that CUDA does not know as pageable host memory and copy it with the CPU, so a freed
// device pointer or an unmapped host address kills the process with SIGSEGV instead of returning
// an error. This check turns those into a ValueError naming the copy. What it cannot see: an
// address inside a live allocation that the caller no longer owns (a tensor freed back to torch's
// caching allocator whose segment is still mapped), and a pageable range with a hole in the middle.
//
// With `for_kernel` it also checks what the kernel copy path needs (swap_blocks_kernel): a kernel
// dereferences each address itself, so a host address must be mapped for the device at that very
// address, and device memory must belong to the current device. A kernel that touches anything
// else faults with cudaErrorIllegalAddress, which ends the CUDA context.

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <fcntl.h>
#include <torch/library.h>

#include "context.h"
#include "driver_entry.h"
#include "record/host_watch.h"
#include "message.h"
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <mutex>
#include <string>

namespace kvverify {
namespace {

using PointerGetAttributes = PFN_cuPointerGetAttributes_v7000;

PointerGetAttributes pointer_get_attributes() {
  static const auto fn = driver_entry<PointerGetAttributes>("cuPointerGetAttributes", 7000);
  return fn;
}

// Whether the host can read one byte at `address`. write(2) copies from the caller's memory inside
// the kernel, which answers EFAULT instead of faulting, for unmapped pages and for the PROT_NONE
// reservations in which the driver keeps device virtual addresses. (process_vm_readv would do the
// same, but container seccomp profiles commonly refuse it.) One pipe serves every call; the byte
// written is read back at once so the pipe never fills.
bool host_byte_readable(uintptr_t address) {
  if (kvverify::watch::holds(address)) return true;  // protected by a recording's host watch: mapped memory
  static int fds[2] = {-1, -1};
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  if (fds[0] < 0 && pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    fds[0] = fds[1] = -1;
    return true;  // no pipe, no answer: let the address pass rather than refuse valid memory
  }
  const ssize_t wrote = write(fds[1], reinterpret_cast<const void*>(address), 1);
  if (wrote == 1) {
    char byte;
    (void)!read(fds[0], &byte, 1);
    return true;
  }
  return !(wrote < 0 && errno == EFAULT);
}

// Checks one operand; returns an empty string when it is fine, else what is wrong with it.
std::string operand_problem(PointerGetAttributes get, uintptr_t address, uint64_t bytes, bool for_kernel, int device) {
  unsigned int memory_type = 0;
  CUdeviceptr start = 0;
  size_t range = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* data[] = {&memory_type, &start, &range};
  const CUresult result = get(3, attrs, data, static_cast<CUdeviceptr>(address));
  if (result == CUDA_SUCCESS && memory_type != 0) {
    // CUDA memory (device, pinned or registered): the copy must stay inside its allocation.
    if (address + bytes > static_cast<uintptr_t>(start) + range) {
      return "runs " + std::to_string(address + bytes - (start + range)) + " bytes past the end of its CUDA allocation (" +
             std::to_string(range) + " bytes from " + std::to_string(start) + ")";
    }
    if (!for_kernel) return "";
    // Asked apart: where the device cannot use the memory, the driver may refuse the whole query.
    CUdeviceptr device_pointer = 0;
    int ordinal = -1;
    CUpointer_attribute reach[] = {CU_POINTER_ATTRIBUTE_DEVICE_POINTER, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    void* reach_data[] = {&device_pointer, &ordinal};
    if (get(2, reach, reach_data, static_cast<CUdeviceptr>(address)) != CUDA_SUCCESS) device_pointer = 0;
    if (static_cast<uintptr_t>(device_pointer) != address) {
      return "is CUDA memory that kernels cannot use at this address (host memory registered without "
             "cudaHostRegisterMapped, or a platform where its device address differs); use method='batch'";
    }
    if (memory_type == CU_MEMORYTYPE_DEVICE && ordinal != device) {
      return "is memory of device " + std::to_string(ordinal) + ", but the kernel runs on the current device " +
             std::to_string(device) + "; make that device current, or use method='batch'";
    }
    return "";
  }
  // Not CUDA memory: the driver will treat it as pageable host memory.
  if (!host_byte_readable(address) || !host_byte_readable(address + bytes - 1)) {
    return "is neither CUDA memory nor mapped host memory (freed device memory or an unmapped address)";
  }
  if (for_kernel) {
    return "is pageable host memory, which a kernel cannot read or write; pin it (cudaHostAlloc, or "
           "cudaHostRegister with cudaHostRegisterMapped) or use method='batch'";
  }
  return "";
}

void check_pointers(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes, bool for_kernel) {
  // Shapes and dtypes are checked by the caller (kvverify.ops) or by swap_blocks_batch itself.
  const int64_t n = src_ptrs.numel();
  TORCH_CHECK_VALUE(dst_ptrs.numel() == n && sizes.numel() == n, kvverify::cat("src_ptrs, dst_ptrs and sizes must have the same length"));
  PointerGetAttributes get = pointer_get_attributes();
  if (n == 0 || get == nullptr) return;
  const auto s = src_ptrs.contiguous(), d = dst_ptrs.contiguous(), z = sizes.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* dp = d.data_ptr<int64_t>();
  const int64_t* zp = z.data_ptr<int64_t>();
  int device = -1;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  bind_primary_context(device);
  for (int64_t i = 0; i < n; ++i) {
    const std::string src = operand_problem(get, static_cast<uintptr_t>(sp[i]), static_cast<uint64_t>(zp[i]), for_kernel, device);
    TORCH_CHECK_VALUE(src.empty(), kvverify::cat("src_ptrs[", i, "] = ", sp[i], " (", zp[i], " bytes) ", src));
    const std::string dst = operand_problem(get, static_cast<uintptr_t>(dp[i]), static_cast<uint64_t>(zp[i]), for_kernel, device);
    TORCH_CHECK_VALUE(dst.empty(), kvverify::cat("dst_ptrs[", i, "] = ", dp[i], " (", zp[i], " bytes) ", dst));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvverify, m) {
  m.def("check_pointers(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool for_kernel=False) -> ()");
}

TORCH_LIBRARY_IMPL(kvverify, CompositeExplicitAutograd, m) { m.impl("check_pointers", &check_pointers); }

}  // namespace kvverify
