// Native capture: the CUDA driver calls of every thread, through CUPTI's callback API (the
// interface Nsight Systems and compute-sanitizer use), into the native log (native_log.h).
//
// What the recorder sees another way is not logged: driver calls inside an op of torch's
// dispatcher (a RecordFunction observer keeps the depth; the recorder's dispatch mode writes the
// op) and inside the methods the recorder observes in Python (kvverify_native_suppress). The
// rest is what no dispatch mode sees: Triton and pybind11 kernels, cuda-python's calls, torch's own
// work outside ops, CUDA graph launches, unmaps; from any thread.
//
// CUPTI is loaded at run time (dlopen of the path Python finds), as the driver is: the extension
// links neither. Driver-domain callbacks only: the runtime reaches the driver for every call.
// CUPTI allows one subscriber per process: where Nsight Systems or torch.profiler holds it,
// start() fails with CUPTI's reason and the recorder falls back to its Python-level capture.

#include <ATen/record_function.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>

#include <mutex>
#include <string>
#include <unordered_map>

#if __has_include(<cupti.h>)
#include <cupti.h>
#define KVVERIFY_HAS_CUPTI 1
#else
#define KVVERIFY_HAS_CUPTI 0
#endif

#include "driver_entry.h"
#include "host_watch.h"
#include "native_log.h"

namespace kvverify::native {
namespace {

std::mutex mutex;
std::string failure;                                // the last start()'s reason, for Python
std::unordered_map<uintptr_t, std::string> names;  // function -> its name
std::unordered_map<uintptr_t, std::vector<size_t>> param_sizes;
std::unique_ptr<at::ObserverContext> enter_op(const at::RecordFunction&) {
  ++suppressed();
  return nullptr;
}
void leave_op(const at::RecordFunction&, at::ObserverContext*) { --suppressed(); }
at::CallbackHandle observer = 0;

int64_t word(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

#if KVVERIFY_HAS_CUPTI

struct Cupti {
  decltype(&cuptiSubscribe) subscribe = nullptr;
  decltype(&cuptiUnsubscribe) unsubscribe = nullptr;
  decltype(&cuptiEnableCallback) enable = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  CUpti_SubscriberHandle subscriber = nullptr;
};
Cupti cupti;

// The sizes of a kernel's parameters, in order (cuFuncGetParamInfo, CUDA 12.4; a library
// kernel's through cuKernelGetParamInfo); empty where neither answers.
const std::vector<size_t>* parameter_sizes(CUfunction f) {
  static auto func_info = driver_entry<PFN_cuFuncGetParamInfo_v12040>("cuFuncGetParamInfo", 12040);
  static auto kernel_info = driver_entry<PFN_cuKernelGetParamInfo_v12040>("cuKernelGetParamInfo", 12040);
  static auto func_name = driver_entry<PFN_cuFuncGetName_v12030>("cuFuncGetName", 12030);
  static auto kernel_name = driver_entry<PFN_cuKernelGetName_v12030>("cuKernelGetName", 12030);
  const auto key = reinterpret_cast<uintptr_t>(f);
  std::lock_guard<std::mutex> guard(mutex);
  auto found = param_sizes.find(key);
  if (found != param_sizes.end()) {
    return found->second.empty() ? nullptr : &found->second;
  }
  std::vector<size_t> sizes;
  bool readable = false;
  size_t offset = 0, size = 0;
  if (func_info != nullptr && func_info(f, 0, &offset, &size) == CUDA_SUCCESS) {
    readable = true;
    for (size_t i = 0; func_info(f, i, &offset, &size) == CUDA_SUCCESS; ++i) sizes.push_back(size);
  } else if (kernel_info != nullptr && kernel_info(reinterpret_cast<CUkernel>(f), 0, &offset, &size) == CUDA_SUCCESS) {
    readable = true;
    for (size_t i = 0; kernel_info(reinterpret_cast<CUkernel>(f), i, &offset, &size) == CUDA_SUCCESS; ++i) {
      sizes.push_back(size);
    }
  }
  const char* name = nullptr;
  if (!(func_name != nullptr && func_name(&name, f) == CUDA_SUCCESS) &&
      !(kernel_name != nullptr && kernel_name(&name, reinterpret_cast<CUkernel>(f)) == CUDA_SUCCESS)) {
    name = nullptr;
  }
  names[key] = name != nullptr ? name : "?";
  if (readable && sizes.empty()) {
    sizes.push_back(0);  // a kernel without parameters: readable, no words
  }
  auto& kept = param_sizes[key] = std::move(sizes);
  return kept.empty() ? nullptr : &kept;
}

constexpr int64_t kMaxWords = 4096;

// The per-thread default stream is handle 0 in a call of the per-thread API (the _ptsz entry
// points, which code built with per-thread default streams calls): written as CU_STREAM_PER_THREAD,
// so that the recorder keeps one such stream per host thread.
int64_t stream_word(CUstream stream, bool per_thread_api) {
  return stream == nullptr && per_thread_api ? 2 : word(stream);
}

// The 8-byte-aligned words of a launch's parameters: any of them may be a pointer.
std::vector<int64_t> launch(int64_t stream, CUfunction f, void** params, void** extra) {
  std::vector<int64_t> fields{stream, word(f), 0};
  const auto* sizes = parameter_sizes(f);
  int64_t n = 0;
  auto add = [&](const char* bytes, size_t size) {
    for (size_t k = 0; k + 8 <= size && n < kMaxWords; k += 8, ++n) {
      int64_t w;
      std::memcpy(&w, bytes + k, 8);
      fields.push_back(w);
    }
  };
  if (params != nullptr && sizes != nullptr) {
    for (size_t i = 0; i < sizes->size(); ++i) {
      if ((*sizes)[i] >= 8) add(static_cast<const char*>(params[i]), (*sizes)[i]);
    }
  } else if (extra != nullptr) {
    const char* buffer = nullptr;
    size_t size = 0;
    for (size_t k = 0; extra[k] != CU_LAUNCH_PARAM_END; k += 2) {
      if (extra[k] == CU_LAUNCH_PARAM_BUFFER_POINTER) buffer = static_cast<const char*>(extra[k + 1]);
      if (extra[k] == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(extra[k + 1]);
    }
    if (buffer == nullptr) {
      n = -1;
    } else {
      add(buffer, size);
    }
  } else if (params != nullptr) {
    n = -1;  // the kernel's parameters cannot be told apart: a kernel the recorder cannot place
  }
  fields[2] = n;
  return fields;
}

// A batched copy's fields (both forms of cuMemcpyBatchAsync's parameters).
template <typename Params>
std::vector<int64_t> batch(const Params& a, bool per_thread_api) {
  std::vector<int64_t> fields{stream_word(a.hStream, per_thread_api), static_cast<int64_t>(a.count),
                              static_cast<int64_t>(a.numAttrs)};
  for (size_t i = 0; i < a.count; ++i) {
    fields.insert(fields.end(), {static_cast<int64_t>(a.dsts[i]), static_cast<int64_t>(a.srcs[i]),
                                 static_cast<int64_t>(a.sizes[i])});
  }
  for (size_t i = 0; i < a.numAttrs; ++i) {
    fields.insert(fields.end(), {static_cast<int64_t>(a.attrs[i].srcAccessOrder), static_cast<int64_t>(a.attrsIdxs[i])});
  }
  return fields;
}

bool per_thread_api(CUpti_CallbackId cbid) {
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_ptsz:
#if CUDA_VERSION >= 13000
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2_ptsz:
#endif
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture_ptsz:
      return true;
    default:
      return false;
  }
}

// What the host watch (host_watch.h) needs of a driver call, from every thread and also inside
// work the recorder sees another way (a copy inside torch's copy_ touches host memory all the
// same): the host memory device work reads and writes, and the order and completion of streams.
// Launches inside an op of torch's dispatcher are not looked at: torch's kernels touch no host
// memory, and each launch would pay for its argument words.
void watch_call(CUpti_CallbackId cbid, const void* p, CUresult result) {
  const bool ok = result == CUDA_SUCCESS;
  const bool pt = per_thread_api(cbid);
  auto key = [pt](CUstream s) { return watch::stream_key(static_cast<uint64_t>(word(s)), pt); };
  using watch::Access;
  // cuMemcpyBatchAsync's two parameter structs (CUDA 12.8's and 13.0's) name the same fields
  auto watch_batch = [&key](const auto& a) {
    std::vector<Access> all;
    all.reserve(2 * a.count);
    for (size_t i = 0; i < a.count; ++i) {
      all.push_back({a.srcs[i], a.sizes[i], false});
      all.push_back({a.dsts[i], a.sizes[i], true, true});  // (a pageable one may be written after the call)
    }
    watch::device_op(key(a.hStream), all.data(), all.size());
  };
#define PARAMS(T) (*static_cast<const T*>(p))
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyAsync_params);
        const Access both[] = {{a.src, a.ByteCount, false}, {a.dst, a.ByteCount, true}};
        watch::device_op(key(a.hStream), both, 2);
        watch::table_copied(a.dst, reinterpret_cast<const void*>(a.src), a.ByteCount);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyHtoDAsync_v2_params);
        const Access src{reinterpret_cast<uint64_t>(a.srcHost), a.ByteCount, false};
        watch::device_op(key(a.hStream), &src, 1);
        watch::table_copied(a.dstDevice, a.srcHost, a.ByteCount);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyDtoHAsync_v2_params);
        const Access dst{reinterpret_cast<uint64_t>(a.dstHost), a.ByteCount, true};
        watch::device_op(key(a.hStream), &dst, 1);
      }
      break;
#if CUDA_VERSION >= 13000
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2_ptsz:
      if (ok) watch_batch(PARAMS(cuMemcpyBatchAsync_v2_params));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2:
#endif
    case CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize:
      if (ok) watch::device_completed();
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_ptsz:
      if (ok) watch_batch(PARAMS(cuMemcpyBatchAsync_params));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemsetD8Async_params);
        const Access dst{a.dstDevice, a.N, true};
        watch::device_op(key(a.hStream), &dst, 1);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemsetD32Async_params);
        const Access dst{a.dstDevice, 4 * a.N, true};
        watch::device_op(key(a.hStream), &dst, 1);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz:
      if (ok) watch::event_recorded(static_cast<uint64_t>(word(PARAMS(cuEventRecord_params).hEvent)),
                                    key(PARAMS(cuEventRecord_params).hStream));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz:
      if (ok) watch::event_recorded(static_cast<uint64_t>(word(PARAMS(cuEventRecordWithFlags_params).hEvent)),
                                    key(PARAMS(cuEventRecordWithFlags_params).hStream));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz:
      if (ok) watch::stream_waited(key(PARAMS(cuStreamWaitEvent_params).hStream),
                                   static_cast<uint64_t>(word(PARAMS(cuStreamWaitEvent_params).hEvent)));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize:
      if (ok) watch::event_completed(static_cast<uint64_t>(word(PARAMS(cuEventSynchronize_params).hEvent)));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventQuery:
      if (ok) watch::event_completed(static_cast<uint64_t>(word(PARAMS(cuEventQuery_params).hEvent)));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz:
      if (ok) watch::stream_completed(key(PARAMS(cuStreamSynchronize_params).hStream));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz:
      if (ok) watch::stream_completed(key(PARAMS(cuStreamQuery_params).hStream));
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz:
      if (ok) watch::capture(key(PARAMS(cuStreamBeginCapture_params).hStream), true);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture_ptsz:
      watch::capture(key(PARAMS(cuStreamEndCapture_params).hStream), false);
      break;
    default:
      break;
  }
#undef PARAMS
}

void CUPTIAPI on_driver_call(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  const auto* call = static_cast<const CUpti_CallbackData*>(data);
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API || !enabled()) {
    return;
  }
  const void* p = call->functionParams;
#define PARAMS(T) (*static_cast<const T*>(p))
  if (call->callbackSite == CUPTI_API_ENTER) {
    // the call's span starts here (CUPTI hands the same word to its exit callback)
    if (call->correlationData != nullptr) *call->correlationData = static_cast<uint64_t>(now_ns());
    // a release of host memory: unwatched before it is unmapped
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost) watch::host_released(word(PARAMS(cuMemFreeHost_params).p));
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemHostUnregister) {
      watch::host_released(word(PARAMS(cuMemHostUnregister_params).p));
    }
    return;
  }
  const CUresult result = *static_cast<const CUresult*>(call->functionReturnValue);
  const int64_t t0 = call->correlationData != nullptr ? static_cast<int64_t>(*call->correlationData) : 0;
  watch_call(cbid, p, result);
  if (suppressed() > 0) {
    return;
  }
  const bool ok = result == CUDA_SUCCESS;
  const bool pt = per_thread_api(cbid);
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuLaunchKernel_params);
        auto fields = launch(stream_word(a.hStream, pt), a.f, a.kernelParams, a.extra);
        if (fields[2] > 0) watch::launch(watch::stream_key(word(a.hStream), pt), fields.data() + 3, fields[2]);
        append(kLaunch, fields, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuLaunchKernelEx_params);
        auto fields = launch(stream_word(a.config->hStream, pt), a.f, a.kernelParams, a.extra);
        if (fields[2] > 0) watch::launch(watch::stream_key(word(a.config->hStream), pt), fields.data() + 3, fields[2]);
        append(kLaunch, fields, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost:  // (watched at its entry; the recorder writes host frees it knows)
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyAsync_params);
        append(kCopy, {stream_word(a.hStream, pt), static_cast<int64_t>(a.dst), static_cast<int64_t>(a.src),
                       static_cast<int64_t>(a.ByteCount), 0}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyHtoDAsync_v2_params);
        append(kCopy, {stream_word(a.hStream, pt), static_cast<int64_t>(a.dstDevice), word(a.srcHost),
                       static_cast<int64_t>(a.ByteCount), 0}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyDtoHAsync_v2_params);
        append(kCopy, {stream_word(a.hStream, pt), word(a.dstHost), static_cast<int64_t>(a.srcDevice),
                       static_cast<int64_t>(a.ByteCount), 0}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemcpyDtoDAsync_v2_params);
        append(kCopy, {stream_word(a.hStream, pt), static_cast<int64_t>(a.dstDevice), static_cast<int64_t>(a.srcDevice),
                       static_cast<int64_t>(a.ByteCount), 0}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpy:
      if (ok) {  // on the legacy default stream, and the host waits for it
        const auto& a = PARAMS(cuMemcpy_params);
        append(kCopy, {0, static_cast<int64_t>(a.dst), static_cast<int64_t>(a.src), static_cast<int64_t>(a.ByteCount), 1},
               true);
      }
      break;
#if CUDA_VERSION >= 13000
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2_ptsz:
      if (ok) append(kCopyBatch, batch(PARAMS(cuMemcpyBatchAsync_v2_params), pt), true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2:
      if (ok) append(kDeviceSync, {}, true, t0);
      break;
#endif
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync:  // CUDA 12.8's form (with failIdx)
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_ptsz:
      if (ok) append(kCopyBatch, batch(PARAMS(cuMemcpyBatchAsync_params), pt), true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemsetD8Async_params);
        append(kMemset, {stream_word(a.hStream, pt), static_cast<int64_t>(a.dstDevice), static_cast<int64_t>(a.N)}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuMemsetD32Async_params);
        append(kMemset, {stream_word(a.hStream, pt), static_cast<int64_t>(a.dstDevice), static_cast<int64_t>(4 * a.N)}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz:
      if (ok) append(kEventRecord, {word(PARAMS(cuEventRecord_params).hEvent), stream_word(PARAMS(cuEventRecord_params).hStream, pt)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuEventRecordWithFlags_params);
        append(kEventRecord, {word(a.hEvent), stream_word(a.hStream, pt)}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz:
      if (ok) append(kEventWait, {stream_word(PARAMS(cuStreamWaitEvent_params).hStream, pt), word(PARAMS(cuStreamWaitEvent_params).hEvent)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize:
      if (ok) append(kEventSync, {word(PARAMS(cuEventSynchronize_params).hEvent)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventQuery:
      if (ok || result == CUDA_ERROR_NOT_READY) {
        append(kEventQuery, {word(PARAMS(cuEventQuery_params).hEvent), ok ? 1 : 0}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz:
      if (ok) append(kStreamSync, {stream_word(PARAMS(cuStreamSynchronize_params).hStream, pt)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz:
      if (ok || result == CUDA_ERROR_NOT_READY) {
        append(kStreamQuery, {stream_word(PARAMS(cuStreamQuery_params).hStream, pt), ok ? 1 : 0}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize:
      if (ok) append(kDeviceSync, {}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventCreate:
      if (ok) append(kEventCreate, {word(*PARAMS(cuEventCreate_params).phEvent)}, false, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuEventDestroy_v2:
      if (ok) append(kEventDestroy, {word(PARAMS(cuEventDestroy_v2_params).hEvent)}, false, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemUnmap:
      if (ok) append(kUnmap, {static_cast<int64_t>(PARAMS(cuMemUnmap_params).ptr), static_cast<int64_t>(PARAMS(cuMemUnmap_params).size)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemMap:
      if (ok) append(kMap, {static_cast<int64_t>(PARAMS(cuMemMap_params).ptr), static_cast<int64_t>(PARAMS(cuMemMap_params).size)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemHostRegister_v2:
      if (ok) append(kHostRegister, {word(PARAMS(cuMemHostRegister_v2_params).p), static_cast<int64_t>(PARAMS(cuMemHostRegister_v2_params).bytesize)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemHostUnregister:
      if (ok) append(kHostUnregister, {word(PARAMS(cuMemHostUnregister_params).p)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz:
      if (ok) append(kGraphLaunch, {word(PARAMS(cuGraphLaunch_params).hGraph), stream_word(PARAMS(cuGraphLaunch_params).hStream, pt)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz:
      // every form starts with the stream
      if (ok) append(kCaptureBegin, {stream_word(PARAMS(cuStreamBeginCapture_params).hStream, pt)}, true, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuStreamEndCapture_params);
        append(kCaptureEnd, {stream_word(a.hStream, pt), word(*a.phGraph)}, true, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithFlags:
      if (ok) {
        const auto& a = PARAMS(cuGraphInstantiateWithFlags_params);
        append(kGraphInstantiate, {word(*a.phGraphExec), word(a.hGraph)}, false, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams_ptsz:
      if (ok) {
        const auto& a = PARAMS(cuGraphInstantiateWithParams_params);
        append(kGraphInstantiate, {word(*a.phGraphExec), word(a.hGraph)}, false, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiate_v2:
      if (ok) {
        const auto& a = PARAMS(cuGraphInstantiate_v2_params);
        append(kGraphInstantiate, {word(*a.phGraphExec), word(a.hGraph)}, false, t0);
      }
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuGraphDestroy:
      if (ok) append(kGraphDestroy, {word(PARAMS(cuGraphDestroy_params).hGraph)}, false, t0);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuGraphExecDestroy:
      if (ok) append(kGraphExecDestroy, {word(PARAMS(cuGraphExecDestroy_params).hGraphExec)}, false, t0);
      break;
    default:  // a call the recorder sees and cannot write down: said by name, never left out silently
      if (ok) append(kUnmodelled, {static_cast<int64_t>(cbid), word(call->functionName)}, true, t0);
      break;
  }
#undef PARAMS
}

// Calls written down, then calls only named (the trace format cannot say them yet).
constexpr CUpti_CallbackId kCalls[] = {
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync, CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpy, CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_ptsz, CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz, CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz, CUPTI_DRIVER_TRACE_CBID_cuEventRecord,
    CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz, CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags,
    CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz, CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent,
    CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz, CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize,
    CUPTI_DRIVER_TRACE_CBID_cuEventQuery, CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize,
    CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz, CUPTI_DRIVER_TRACE_CBID_cuStreamQuery,
    CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz, CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize,
    CUPTI_DRIVER_TRACE_CBID_cuEventCreate,
    CUPTI_DRIVER_TRACE_CBID_cuEventDestroy_v2, CUPTI_DRIVER_TRACE_CBID_cuMemUnmap, CUPTI_DRIVER_TRACE_CBID_cuMemMap,
    CUPTI_DRIVER_TRACE_CBID_cuMemHostRegister_v2, CUPTI_DRIVER_TRACE_CBID_cuMemHostUnregister,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture, CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2, CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture, CUPTI_DRIVER_TRACE_CBID_cuStreamEndCapture_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithFlags, CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams,
    CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams_ptsz, CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiate_v2,
    CUPTI_DRIVER_TRACE_CBID_cuGraphDestroy, CUPTI_DRIVER_TRACE_CBID_cuGraphExecDestroy,
    CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost,  // (the host watch's)
    // named only
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpy2DAsync_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpy3DAsync_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeerAsync,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async, CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchHostFunc, CUPTI_DRIVER_TRACE_CBID_cuMemcpy3DBatchAsync,
    CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph, CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph_ptsz,
#if CUDA_VERSION >= 13000
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpy3DBatchAsync_v2,
#endif
};

const char* start(const char* library) {
  if (cupti.subscriber != nullptr) return "native capture is running already";
  if (cupti.subscribe == nullptr) {
    void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      failure = std::string("cannot load CUPTI (") + library + "): " + dlerror();
      return failure.c_str();
    }
    cupti.subscribe = reinterpret_cast<decltype(cupti.subscribe)>(dlsym(handle, "cuptiSubscribe"));
    cupti.unsubscribe = reinterpret_cast<decltype(cupti.unsubscribe)>(dlsym(handle, "cuptiUnsubscribe"));
    cupti.enable = reinterpret_cast<decltype(cupti.enable)>(dlsym(handle, "cuptiEnableCallback"));
    cupti.result_string = reinterpret_cast<decltype(cupti.result_string)>(dlsym(handle, "cuptiGetResultString"));
    if (!cupti.subscribe || !cupti.unsubscribe || !cupti.enable || !cupti.result_string) {
      cupti.subscribe = nullptr;
      failure = std::string(library) + " lacks the callback API (cuptiSubscribe, cuptiEnableCallback)";
      return failure.c_str();
    }
  }
  CUptiResult status = cupti.subscribe(&cupti.subscriber, on_driver_call, nullptr);
  if (status != CUPTI_SUCCESS) {
    const char* text = nullptr;
    cupti.result_string(status, &text);
    cupti.subscriber = nullptr;
    failure = std::string("CUPTI refused a subscriber: ") + (text != nullptr ? text : "?");
    return failure.c_str();
  }
  for (CUpti_CallbackId cbid : kCalls) {
    status = cupti.enable(1, cupti.subscriber, CUPTI_CB_DOMAIN_DRIVER_API, cbid);
    if (status != CUPTI_SUCCESS) {
      const char* text = nullptr;
      cupti.result_string(status, &text);
      cupti.unsubscribe(cupti.subscriber);
      cupti.subscriber = nullptr;
      failure = std::string("CUPTI refused a driver callback: ") + (text != nullptr ? text : "?");
      return failure.c_str();
    }
  }
  observer = at::addGlobalCallback(
      at::RecordFunctionCallback(enter_op, leave_op).scopes({at::RecordScope::FUNCTION}).needsInputs(false));
  return nullptr;
}

void stop() {
  if (observer != 0) {
    at::removeCallback(observer);
    observer = 0;
  }
  if (cupti.subscriber != nullptr) {
    cupti.unsubscribe(cupti.subscriber);
    cupti.subscriber = nullptr;
  }
}

#else

const char* start(const char*) { return "kvverify._C was built without CUPTI's headers (cupti.h)"; }
void stop() {}

#endif

}  // namespace
}  // namespace kvverify::native

extern "C" {

// Subscribe to the driver calls of every thread through the CUPTI library at `library`. Returns
// nullptr, or why not (another subscriber holds CUPTI: Nsight Systems, torch.profiler).
__attribute__((visibility("default"))) const char* kvverify_native_start(const char* library) {
  return kvverify::native::start(library);
}

// Stop the capture (idempotent); the log keeps what it holds.
__attribute__((visibility("default"))) void kvverify_native_stop() { kvverify::native::stop(); }

// Whether stream `handle` is a blocking stream (created without CU_STREAM_NON_BLOCKING: the legacy
// default stream synchronizes with it, CUDA "Stream synchronization behavior") and its device.
// Returns 0, or -1 where the driver cannot say (no driver; a handle it does not know).
__attribute__((visibility("default"))) int kvverify_native_stream_info(int64_t handle, int* blocking, int* device) {
  using kvverify::driver_entry;
  static auto get_flags = driver_entry<PFN_cuStreamGetFlags_v5050>("cuStreamGetFlags", 5050);
  static auto get_device = driver_entry<PFN_cuStreamGetDevice_v12080>("cuStreamGetDevice", 12080);
  unsigned int flags = 0;
  CUdevice d = 0;
  auto stream = reinterpret_cast<CUstream>(static_cast<uintptr_t>(handle));
  if (get_flags == nullptr || get_flags(stream, &flags) != CUDA_SUCCESS) return -1;
  *blocking = (flags & CU_STREAM_NON_BLOCKING) ? 0 : 1;
  *device = get_device != nullptr && get_device(stream, &d) == CUDA_SUCCESS ? static_cast<int>(d) : -1;
  return 0;
}

// The name of the kernel `function` of a launch record ("?" where the driver gave none).
__attribute__((visibility("default"))) const char* kvverify_native_function_name(int64_t function) {
  std::lock_guard<std::mutex> guard(kvverify::native::mutex);
  auto found = kvverify::native::names.find(static_cast<uintptr_t>(function));
  return found == kvverify::native::names.end() ? "?" : found->second.c_str();
}

}  // extern "C"
