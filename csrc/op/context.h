// The device's primary context, current on the calling thread before a driver API call.
//
// A driver API call needs a context current on the calling thread, and the runtime binds the
// device's primary context to a thread only at that thread's first runtime call that needs one
// (CUDA Runtime API, "Initialization" and "Interactions with the CUDA Driver API"). A worker
// thread whose first CUDA work is one of our ops would otherwise get CUDA_ERROR_INVALID_VALUE from
// cuMemcpyBatchAsync, and wrong answers from cuPointerGetAttributes. cudaSetDevice makes the
// primary context current (CUDA 12.0 and later); it is called only where none is, since a thread
// that has one pays nothing but the query.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>

namespace kvverify {

inline void bind_primary_context(int device) {
  static PFN_cuCtxGetCurrent_v4000 get_current = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 4000, cudaEnableDefault, &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      get_current = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(fn);
    } else {
      cudaGetLastError();  // a missing symbol is an answer, not an error to leave behind
    }
  });
  CUcontext current = nullptr;
  if (get_current != nullptr && get_current(&current) == CUDA_SUCCESS && current != nullptr) return;
  C10_CUDA_CHECK(cudaSetDevice(device));
}

}  // namespace kvverify
