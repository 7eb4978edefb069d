// The native log (native_log.h): per-thread records, torch's caching allocator's reports, and the
// C functions the recorder calls through ctypes (kvverify/record/capture/native.py).
//
// torch reports allocations to Python through its GPU-trace hooks, which it calls with the GIL
// from C++, also while an op's exception unwinds: the hook's module import then fails and the
// program sees a SystemError instead of its own error. The allocator's trace trackers
// (CUDACachingAllocator::attachAllocatorTraceTracker) run in C++ under the allocator's lock; this
// one appends a record, with no Python and no torch call (as the allocator asks of them). A
// tracker cannot be detached: it is attached once and switched on and off with the log.
//
// The functions are C, not ops: the recorder checks the count before each op it logs, and a
// dispatcher call would cost more than the check and be seen by the recorder's own dispatch mode.
// They are loaded with ctypes.PyDLL (the GIL held): take() hands code objects' references over.

#include "native_log.h"

#include "frames.h"
#include "host_watch.h"

#include <Python.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <pthread.h>

#include <time.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

// Outside the limited API the extension is built against (3.10), in every CPython since 3.9: the
// abi3 build declares them itself.
extern "C" int PyGILState_Check(void);
extern "C" PyFrameObject* PyFrame_GetBack(PyFrameObject* frame);

namespace kvverify::native {
namespace {

using c10::cuda::CUDACachingAllocator::TraceEntry;

// What Python reads at load (kvverify/record/capture/native.py): every kind's name and number, once.
constexpr const char* kKinds =
    "alloc=1 free=2 launch=10 copy=11 copy_batch=12 memset=13 event_record=20 event_wait=21 event_sync=22 "
    "event_query=23 stream_sync=24 stream_query=25 device_sync=26 event_create=27 event_destroy=28 unmap=30 "
    "map=31 host_register=32 host_unregister=33 graph_launch=40 capture_begin=41 capture_end=42 graph_instantiate=43 "
    "graph_destroy=44 graph_exec_destroy=45 "
    "unmodelled=50 op_begin=60 op=61 op_failed=62 mark=63 host_touch=70";
constexpr int kMaxFrames = 24;

std::mutex mutex;
std::unordered_map<uint64_t, std::vector<int64_t>> pending;  // words, by thread (pthread_self)
std::atomic<int64_t> count{0};                                // records not taken yet
std::atomic<bool> on{false};
std::once_flag attached;
bool attach_failed = false;
thread_local int64_t own_count = 0;  // records this thread appended and has not taken itself

// (code, line) pairs of the calling thread's Python stack, innermost first, where it holds the
// GIL; taking it here could deadlock (the caller may hold a lock the GIL's holder waits for, as
// torch's allocators do around their CUDA calls). A thread that released the GIL (a driver call
// through ctypes, cupy, Triton's launcher) still has its Python frames, read without it as text
// (frames.h): nframes is then -1, followed by the words of the text.
void capture_frames(std::vector<int64_t>& words) {
  words.push_back(0);
  if (!Py_IsInitialized()) {
    return;
  }
  if (!PyGILState_Check()) {
    int64_t text[2048];
    const int n = frames::snapshot(text, 2048, 16);
    if (text[0] > 0) {
      words.back() = -1;
      words.push_back(n);
      words.insert(words.end(), text, text + n);
    }
    return;
  }
  const size_t at = words.size() - 1;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  int n = 0;
  while (frame != nullptr && n < kMaxFrames) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference: the record holds it
    words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(code)));
    words.push_back(PyFrame_GetLineNumber(frame));
    ++n;
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  words[at] = n;
}

int64_t stream_handle(const void* stream) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream)); }
// The allocator's entry holds a raw handle in some torch versions, a c10::Stream or CUDAStream in others.
[[maybe_unused]] int64_t stream_handle(const c10::Stream& stream) {
  return stream_handle(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream());
}
[[maybe_unused]] int64_t stream_handle(const c10::cuda::CUDAStream& stream) { return stream_handle(stream.stream()); }

void track(const TraceEntry& entry) {
  if (!enabled()) {
    return;
  }
  Kind kind;
  switch (entry.action_) {
    case TraceEntry::ALLOC:
      kind = kAlloc;
      break;
    case TraceEntry::FREE_REQUESTED:
      kind = kFree;
      break;
    default:
      return;
  }
  // no frames: the allocator holds its lock here (see capture_frames)
  append(kind, {static_cast<int64_t>(entry.addr_), static_cast<int64_t>(entry.size_), stream_handle(entry.stream_),
                static_cast<int64_t>(entry.device_)},
         false);
}

// Drop the code references of the records in words[begin, end) (the GIL held).
void release(const int64_t* words, size_t n) {
  size_t k = 0;
  while (k + 2 < n) {
    const int64_t size = words[k + 1], frames = words[k + 2];  // (-1: frames as text, no reference)
    for (int64_t f = 0; f < frames; ++f) {
      Py_XDECREF(reinterpret_cast<PyObject*>(static_cast<uintptr_t>(words[k + 3 + 2 * f])));
    }
    k += 2 + static_cast<size_t>(size);
  }
}

// Move whole records, oldest first, while they fit in `room` words.
void move_records(std::vector<int64_t>& words, int64_t*& out, int64_t& room, int64_t& written) {
  size_t k = 0;
  int64_t records = 0;
  while (k < words.size()) {
    const size_t length = 2 + static_cast<size_t>(words[k + 1]);
    if (static_cast<int64_t>(length) > room) {
      break;
    }
    std::copy(words.begin() + k, words.begin() + k + length, out);
    out += length, room -= length, written += length, k += length, ++records;
  }
  words.erase(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(k));
  count.fetch_sub(records, std::memory_order_relaxed);
}

thread_local bool begin_owed = false;  // an op of the op log is open and its op_begin not written

// Append `parts` (spans of words) as one record of the calling thread, the span [t0, now] last (t0
// 0, or not before now: not known); an owed op_begin first.
void push(std::initializer_list<std::pair<const int64_t*, size_t>> parts, int64_t t0) {
  size_t n = 0;
  for (const auto& [_, size] : parts) {
    n += size;
  }
  const auto thread = static_cast<uint64_t>(pthread_self());
  const int64_t t1 = now_ns();
  std::lock_guard<std::mutex> guard(mutex);
  auto& words = pending[thread];
  if (begin_owed) {
    begin_owed = false;
    words.insert(words.end(), {static_cast<int64_t>(kOpBegin), 3, 0, 0, t1});
    count.fetch_add(1, std::memory_order_relaxed);
    ++own_count;
  }
  own_count += watch::drain(thread, kHostTouch, words);  // the thread's touches came before this record
  ++own_count;
  words.push_back(*parts.begin()->first);  // the kind
  words.push_back(static_cast<int64_t>(n) + 1);
  bool first = true;
  for (const auto& [data, size] : parts) {
    words.insert(words.end(), data + (first ? 1 : 0), data + size);
    first = false;
  }
  words.push_back(t0 > 0 && t0 <= t1 ? t0 : 0);
  words.push_back(t1);
  count.fetch_add(1, std::memory_order_relaxed);
}

// Move the host watch's touch records of `thread` (of every thread where it is 0) to the end of
// that thread's records: each came after everything the thread logged before it (push() moves
// them before anything the thread logs later). The mutex held.
void drain_touches(uint64_t thread) {
  uint64_t threads[64];
  const size_t n = thread != 0 ? (threads[0] = thread, 1) : watch::touch_threads(threads, 64);
  for (size_t i = 0; i < n; ++i) {
    std::vector<int64_t> words;
    if (watch::drain(threads[i], kHostTouch, words) != 0) {
      auto& mine = pending[threads[i]];
      mine.insert(mine.end(), words.begin(), words.end());
    }
  }
}

}  // namespace

bool enabled() { return on.load(std::memory_order_relaxed); }

std::atomic<int64_t>& record_count() { return count; }

int64_t own_pending_records() { return own_count; }

int& suppressed() { return watch::seen_elsewhere(); }

int64_t now_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void append(Kind kind, const std::vector<int64_t>& fields, bool frames, int64_t t0) {
  std::vector<int64_t> record{static_cast<int64_t>(kind)};
  if (frames) {
    capture_frames(record);
  } else {
    record.push_back(0);
  }
  push({{record.data(), record.size()}, {fields.data(), fields.size()}}, t0);
}

void append_record(Kind kind, const std::vector<int64_t>& frames, const std::vector<int64_t>& fields, int64_t t0) {
  const int64_t head = static_cast<int64_t>(kind);
  push({{&head, 1}, {frames.data(), frames.size()}, {fields.data(), fields.size()}}, t0);
}

void owe_begin(bool owed) { begin_owed = owed; }

}  // namespace kvverify::native

using namespace kvverify::native;

extern "C" {

// "name=number ..." of every record kind.
__attribute__((visibility("default"))) const char* kvverify_native_kinds() { return kKinds; }

// Attach the allocator's tracker (once per process; CUDA must be initialised, or the allocator
// has no device allocators to attach it to). Returns 0, or -1 where it refused (a pluggable one).
__attribute__((visibility("default"))) int kvverify_native_attach_allocator() {
  std::call_once(attached, [] {
    try {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(track);
    } catch (...) {
      attach_failed = true;
    }
  });
  return attach_failed ? -1 : 0;
}

// Switch the log on or off; either way, records left are dropped (the GIL held: their code
// references are released).
__attribute__((visibility("default"))) void kvverify_native_enable(int enable) {
  kvverify::frames::usable();  // (once, with the GIL: whether frames can be read without it)
  std::unordered_map<uint64_t, std::vector<int64_t>> dropped;
  {
    std::lock_guard<std::mutex> guard(mutex);
    on.store(enable != 0);
    dropped.swap(pending);
    count.store(0);
  }
  own_count = 0;
  for (auto& [_, words] : dropped) {
    release(words.data(), words.size());
  }
}

// The address of the count of records not taken yet: read without a call.
__attribute__((visibility("default"))) const int64_t* kvverify_native_count() {
  static_assert(sizeof(std::atomic<int64_t>) == sizeof(int64_t), "the count is read as a plain int64");
  return reinterpret_cast<const int64_t*>(&count);
}

// Move whole records of thread `thread` (pthread_self, as Python's threading.get_ident), or of
// every thread where `thread` is 0 (each record then preceded by its thread), into `out` (up to
// `capacity` words); returns the words written. Call again while it fills `out` nearly full.
__attribute__((visibility("default"))) int64_t kvverify_native_take(uint64_t thread, int64_t* out,
                                                                     int64_t capacity) {
  std::lock_guard<std::mutex> guard(mutex);
  int64_t written = 0;
  drain_touches(thread);
  if (thread != 0) {
    auto found = pending.find(thread);
    if (found != pending.end()) {
      move_records(found->second, out, capacity, written);
      if (thread == static_cast<uint64_t>(pthread_self())) {
        own_count = found->second.empty() ? 0 : own_count;  // (what stays is taken by the next call)
      }
    }
    return written;
  }
  // every record preceded by its thread; the words moved are erased once per thread (erasing each
  // record from the front of the rest would take time quadratic in a thread's records)
  for (auto& [who, words] : pending) {
    size_t k = 0;
    int64_t records = 0;
    while (k < words.size() && capacity >= 3 + words[k + 1]) {
      const size_t length = 2 + static_cast<size_t>(words[k + 1]);
      *out++ = static_cast<int64_t>(who);
      std::copy(words.begin() + k, words.begin() + k + length, out);
      out += length, capacity -= 1 + length, written += 1 + length, k += length, ++records;
    }
    words.erase(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(k));
    count.fetch_sub(records, std::memory_order_relaxed);
  }
  return written;
}

// The calling thread's suppression depth moves by `delta` (+1 entering work the recorder sees in
// Python, -1 leaving it).
__attribute__((visibility("default"))) void kvverify_native_suppress(int delta) { suppressed() += delta; }

}  // extern "C"
