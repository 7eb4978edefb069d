// Exact-size host memory for the harness: cudaHostAlloc / cudaHostRegister take exactly the
// bytes asked for, where torch's pinned allocator rounds up to a power of two and caches.
// Pointers cross into Python as int64 byte addresses.

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "message.h"

namespace kvverify {
namespace {

void* as_ptr(int64_t address, const char* arg) {
  TORCH_CHECK_VALUE(address != 0, kvverify::cat(arg, " is a null pointer"));
  return reinterpret_cast<void*>(address);
}

// cudaHostAlloc (CUDA Runtime API, Memory Management): page-locked, and under UVA mapped into
// the device address space at the same address, so kernels can verify it in place.
int64_t host_alloc(int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes > 0, kvverify::cat("nbytes must be > 0, got ", nbytes));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocPortable | cudaHostAllocMapped));
  return reinterpret_cast<int64_t>(ptr);
}

void host_free(int64_t ptr) { C10_CUDA_CHECK(cudaFreeHost(as_ptr(ptr, "ptr"))); }

// cudaHostRegister pins memory the caller allocated (page-aligned, whole pages, for the
// best DMA path); Portable pins it for every context, Mapped lets kernels use it (at its host
// address where cudaDevAttrCanUseHostPointerForRegisteredMem is 1, as on x86-64 Linux).
void host_register(int64_t ptr, int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes > 0, kvverify::cat("nbytes must be > 0, got ", nbytes));
  C10_CUDA_CHECK(cudaHostRegister(as_ptr(ptr, "ptr"), static_cast<size_t>(nbytes), cudaHostRegisterPortable | cudaHostRegisterMapped));
}

void host_unregister(int64_t ptr) { C10_CUDA_CHECK(cudaHostUnregister(as_ptr(ptr, "ptr"))); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvverify, m) {
  m.def("host_alloc(int nbytes) -> int", &host_alloc);
  m.def("host_free(int ptr) -> ()", &host_free);
  m.def("host_register(int ptr, int nbytes) -> ()", &host_register);
  m.def("host_unregister(int ptr) -> ()", &host_unregister);
}

}  // namespace kvverify
