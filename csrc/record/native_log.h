// The recorder's native log (kvverify/record/capture/native.py reads it): what torch's caching allocator
// and the CUDA driver report, from every thread, kept per thread until the recorder takes it.
//
// A record is int64 words: [kind, n, nframes, (code, line) x nframes, fields..., t0, t1], n counting
// what follows it. [t0, t1] is the span of the call the record is of, in CLOCK_MONOTONIC
// nanoseconds (Python's time.perf_counter_ns): t0 before the call began (0: not known), t1 after
// it returned; two threads' calls whose spans do not overlap reached the driver in span order. `code` is a PyCodeObject* whose reference the record holds (native.py releases it).
// Where the calling thread does not hold the GIL, its frames are read as text (frames.h) and
// nframes is -1: [kind, n, -1, m, m words of text, fields...]. The kinds and their fields are
// listed once, in kKinds (native_log.cpp), which Python reads at load.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace kvverify::native {

enum Kind : int64_t {
  kAlloc = 1,          // address, size, stream, device
  kFree = 2,           // address, size, stream, device
  kLaunch = 10,        // stream, function, nwords (-1: arguments not readable), words...
  kCopy = 11,          // stream, dst, src, bytes, blocking
  kCopyBatch = 12,     // stream, count, nattrs, (dst, src, size) x count, (order, first) x nattrs
  kMemset = 13,        // stream, dst, bytes
  kEventRecord = 20,   // event, stream
  kEventWait = 21,     // stream, event
  kEventSync = 22,     // event
  kEventQuery = 23,    // event, complete (1 / 0)
  kStreamSync = 24,    // stream
  kStreamQuery = 25,   // stream, complete (1 / 0)
  kDeviceSync = 26,    //
  kEventCreate = 27,   // event
  kEventDestroy = 28,  // event
  kUnmap = 30,         // address, size
  kMap = 31,           // address, size
  kHostRegister = 32,  // address, size
  kHostUnregister = 33,  // address
  kGraphLaunch = 40,   // graph exec, stream
  kCaptureBegin = 41,  // stream
  kCaptureEnd = 42,    // stream, graph
  kGraphInstantiate = 43,  // graph exec, graph
  kGraphDestroy = 44,  // graph (a later graph at the handle is another one)
  kGraphExecDestroy = 45,  // graph exec
  kUnmodelled = 50,    // cbid, name (a char* CUPTI keeps: a driver call the recorder cannot write down)
  kOpBegin = 60,       // (op_log.cpp) a kept dispatcher op started, and something was logged inside it
  kOp = 61,            // (op_log.cpp) it ended: its facts
  kOpFailed = 62,      // (op_log.cpp) it raised: id
  kMark = 63,          // (op_log.cpp) a report the recorder holds in Python: its index
  kHostTouch = 70,     // (host_watch.cpp) address, write, first byte, end, frames as text (frames.h)
};

// Whether the log takes records now (a recording runs).
bool enabled();

// The count of records not taken yet, which Python reads without a call (the host watch's signal
// handler adds its touch records to it; they are moved into their thread's records when taken).
std::atomic<int64_t>& record_count();

// Now, in CLOCK_MONOTONIC nanoseconds: a record's span.
int64_t now_ns();

// Append one record of the calling thread: `fields` after its frames (captured here when the
// thread holds the GIL and `frames` is true); `t0`: when the call it is of began (0: not known).
void append(Kind kind, const std::vector<int64_t>& fields, bool frames, int64_t t0 = 0);

// An op of the op log opens (true) on the calling thread: the next record it appends is preceded
// by an op_begin (the op then holds back what is reported inside it); or it closes (false).
void owe_begin(bool owed);

// Records of the calling thread not taken yet (appended by it, not yet taken by it).
int64_t own_pending_records();

// Append one record of the calling thread with frames captured already: `frames` is
// [n, (code, line) x n], each code's reference now the record's; `t0` as append's.
void append_record(Kind kind, const std::vector<int64_t>& frames, const std::vector<int64_t>& fields, int64_t t0);

// The calling thread's depth in work the recorder sees another way (an op of torch's dispatcher,
// a method the recorder observes in Python): driver calls there are not logged.
int& suppressed();

}  // namespace kvverify::native
