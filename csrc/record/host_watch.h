// The host watch (host_watch.cpp): host memory that device work may still read or write is
// protected, so that the host's first touch of it through any path (numpy, .tolist(), ctypes, the
// buffer protocol, native code) is seen, with the thread and its Python line, and written into the
// native log as a host access (native_log.h, kind host_touch).
// The op (csrc/op/) and the harness kernels (csrc/harness/) include it as "record/host_watch.h": they
// tell the watch which host bytes the device work they issue reads or writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvverify::watch {

// The key completion is tracked by: a stream handle; the legacy default stream (handles 0 and
// CU_STREAM_LEGACY) is one stream; the per-thread default stream (CU_STREAM_PER_THREAD, or handle
// 0 in a driver call of the per-thread API, `per_thread_api`) is one stream per host thread.
uint64_t stream_key(uint64_t handle, bool per_thread_api);

// Whether the watch runs (started, and not stopped).
bool on();

// One range of host memory a device op reads or writes.
struct Access {
  uint64_t address;
  uint64_t bytes;
  bool device_writes;
  bool pageable = false;  // watched also where the driver does not know the address (pageable memory)
};

// Device work was issued to `stream`: the ranges of `accesses` that lie in pinned or registered
// host memory, or in pageable memory where the access says so (a batched copy's destination, which
// the driver may write after the call returned), are protected until the host has observed the work
// complete (the page-granular protection: mprotect). Ranges in device memory are not watched.
void device_op(uint64_t stream, const Access* accesses, size_t n);

// The kernel launch words of a launch outside torch's dispatcher: those that point into pinned or
// registered memory, or into a device pointer table a host copy filled from such memory, are
// watched as read and written by it (a kernel touches what its arguments point to).
void launch(uint64_t stream, const int64_t* words, size_t n);

// kvverify's own kernels given a device table of `n` block addresses (harness_ops.cpp): the
// blocks of `block_bytes` each that lie in pinned or registered memory are watched as read (or
// written) by the kernel just issued to `stream`, where a host copy the watch saw filled the table.
void table_op(uint64_t stream, uint64_t table, int64_t n, uint64_t block_bytes, bool device_writes);

// A copy from host memory into device memory: small ones are kept (their bytes as they were at the
// call), so that a launch given the device table knows the host addresses it holds.
void table_copied(uint64_t device_address, const void* host, uint64_t bytes);

// Stream order and what the host observed complete (CUDA: an event captures the work issued to its
// stream before it; a wait orders later work on the waiting stream after the event).
void event_recorded(uint64_t event, uint64_t stream);
void stream_waited(uint64_t stream, uint64_t event);
void event_completed(uint64_t event);  // cuEventSynchronize, or cuEventQuery that returned success
void stream_completed(uint64_t stream);  // cuStreamSynchronize, or cuStreamQuery that returned success
void device_completed();  // cuCtxSynchronize

// A stream capture into a graph begins or ends: work issued to it meanwhile does not run now.
void capture(uint64_t stream, bool begin);

// The host allocation at `address` is released (cuMemFreeHost, cuMemHostUnregister): its pages
// lose their protection before the driver unmaps them, and the watch forgets it.
void host_released(uint64_t address);

// Move the touch records of thread `thread` (pthread_t) into `words`, oldest first, each as a
// native-log record of kind `kind` (fields: address, write, first byte, end, then the frames as
// frames.h writes them); returns how many.
int64_t drain(uint64_t thread, int64_t kind, std::vector<int64_t>& words);

// The calling thread's depth in work the recorder sees another way (an op of torch's dispatcher, a
// method the recorder observes in Python): native_log.h's suppression depth. Kept where the
// signal handler finds it: a fault there is the op's own access, which the op's record holds.
int& seen_elsewhere();

// Whether the page of `address` is one the watch protects now (memory that is mapped: a system
// call the program's own code makes to probe it gets EFAULT there, which means nothing).
bool holds(uint64_t address);

// The threads with touch records not drained yet (up to `capacity` into `out`); returns how many.
size_t touch_threads(uint64_t* out, size_t capacity);

}  // namespace kvverify::watch
