// The recorder's log of torch's caching allocator: every block handed out and every free asked
// for, from every thread, kept here until the recorder takes it (kvverify/record/hooks.py).
//
// torch reports the same to Python through its GPU-trace hooks, which it calls with the GIL from
// C++, also while an op's exception unwinds: the hook's module import then fails and the program
// sees a SystemError instead of its own error. The allocator's trace trackers
// (CUDACachingAllocator::attachAllocatorTraceTracker) run in C++ under the allocator's lock, and
// this one only appends to a vector: no Python, no torch call (as the allocator asks of them).
//
// The functions below are C (loaded with ctypes), not ops: the recorder checks the count before
// each op it logs, and a dispatcher call would cost more than the check and be seen by its own
// dispatch mode. A tracker cannot be detached: it is attached once and switched on and off.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using c10::cuda::CUDACachingAllocator::TraceEntry;

// One row: the columns a take() writes, in this order (kvverify/record/hooks.py: ALLOCATOR_COLUMNS).
struct Row {
  int64_t thread, action, address, size, stream, device;
};
constexpr int64_t kAlloc = 1, kFreeRequested = 2;

std::mutex mutex;
std::unordered_map<uint64_t, std::vector<Row>> pending;  // by thread (pthread_self)
std::atomic<int64_t> count{0};
std::atomic<bool> enabled{false};
std::once_flag attached;
bool attach_failed = false;

// The entry's stream is a raw handle in some torch versions, a c10::Stream or CUDAStream in others.
int64_t stream_handle(const void* stream) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream)); }
int64_t stream_handle(const c10::Stream& stream) {
  return stream_handle(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream());
}
int64_t stream_handle(const c10::cuda::CUDAStream& stream) { return stream_handle(stream.stream()); }

void track(const TraceEntry& entry) {
  if (!enabled.load(std::memory_order_relaxed)) {
    return;
  }
  int64_t action;
  switch (entry.action_) {
    case TraceEntry::ALLOC:
      action = kAlloc;
      break;
    case TraceEntry::FREE_REQUESTED:
      action = kFreeRequested;
      break;
    default:
      return;
  }
  const auto thread = static_cast<uint64_t>(pthread_self());
  Row row{static_cast<int64_t>(thread), action, static_cast<int64_t>(entry.addr_),
          static_cast<int64_t>(entry.size_), stream_handle(entry.stream_), static_cast<int64_t>(entry.device_)};
  std::lock_guard<std::mutex> guard(mutex);
  pending[thread].push_back(row);
  count.fetch_add(1, std::memory_order_relaxed);
}

void move_rows(std::vector<Row>& rows, int64_t*& out, int64_t& room, int64_t& written) {
  size_t n = 0;
  for (; n < rows.size() && room > 0; ++n, --room, ++written) {
    const Row& r = rows[n];
    *out++ = r.thread, *out++ = r.action, *out++ = r.address, *out++ = r.size, *out++ = r.stream, *out++ = r.device;
  }
  rows.erase(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(n));
  count.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
}

}  // namespace

extern "C" {

// Attach the tracker (once per process; CUDA must be initialised, or the allocator has no device
// allocators to attach it to). Returns 0, or -1 where the allocator refused it (a pluggable one).
__attribute__((visibility("default"))) int kvverify_allocator_log_attach() {
  std::call_once(attached, [] {
    try {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(track);
    } catch (...) {
      attach_failed = true;
    }
  });
  return attach_failed ? -1 : 0;
}

// Switch logging on (dropping anything left from before) or off.
__attribute__((visibility("default"))) void kvverify_allocator_log_enable(int on) {
  std::lock_guard<std::mutex> guard(mutex);
  pending.clear();
  count.store(0);
  enabled.store(on != 0);
}

// The address of the count of rows not taken yet: read without a call.
__attribute__((visibility("default"))) const int64_t* kvverify_allocator_log_count() {
  static_assert(sizeof(std::atomic<int64_t>) == sizeof(int64_t), "the count is read as a plain int64");
  return reinterpret_cast<const int64_t*>(&count);
}

// Move up to `capacity` rows of thread `thread` (pthread_self, as Python's threading.get_ident),
// or of every thread where `thread` is 0, into `out` (capacity x 6 int64), oldest first per
// thread; returns how many were written.
__attribute__((visibility("default"))) int64_t kvverify_allocator_log_take(uint64_t thread, int64_t* out,
                                                                            int64_t capacity) {
  std::lock_guard<std::mutex> guard(mutex);
  int64_t written = 0;
  if (thread != 0) {
    auto found = pending.find(thread);
    if (found != pending.end()) {
      move_rows(found->second, out, capacity, written);
    }
    return written;
  }
  for (auto& [_, rows] : pending) {
    move_rows(rows, out, capacity, written);
  }
  return written;
}

}  // extern "C"
