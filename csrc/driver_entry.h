// A driver function by name and version, through the runtime (CUDA Runtime API,
// "Driver Entry Point Access": cudaGetDriverEntryPointByVersion). The extension links the runtime
// only; what the driver of the host lacks is an answer (nullptr), not an error left behind.
#pragma once

#include <cuda_runtime.h>

namespace kvverify {

// `Fn`: the function's PFN_ type of that version (cudaTypedefs.h); `version`: the CUDA version the
// caller's signature is of (e.g. 7000 for PFN_cuPointerGetAttributes_v7000). Returns nullptr where
// the driver has no such symbol; callers keep the answer in a function-local static.
template <typename Fn>
Fn driver_entry(const char* symbol, int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // (a missing symbol, or no driver: the CPU tests declare their memory)
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace kvverify
