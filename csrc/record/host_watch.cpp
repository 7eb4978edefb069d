// The host watch (host_watch.h): page protection over host memory that device work may still
// touch, and a signal handler that sees the host's first touch of it.
//
// Why: a race detector must see every host access to bytes the device may still read or write.
// The dispatcher sees torch's ops; numpy views of pinned memory, .tolist(), the buffer protocol,
// ctypes.memmove and native code touch the bytes without it. The watch sees them all where the
// CPU does: the pages are protected (mprotect) from the call that issued the device work until the
// host has observed that work complete (a synchronization, or an event query that returned
// success, followed through the waits between streams), and a page fault on them is a host access.
// Device memory access (DMA, UVA) does not go through the CPU's page tables: the device is not
// slowed or stopped by the protection (checked on an H200, docs/record.md).
//
// What a fault does. The faulting address is the byte the instruction touched; the error code says
// read or write. A touch that conflicts with pending device work (a read of bytes the device
// writes, a write of bytes it reads or writes) is recorded once per thread, per pending range and
// per kind (a later access of the same thread races with that device work only if the first one
// does: trace format rules 1 and 4), with the thread's Python stack (frames.h), and the page is
// lifted for that kind where no other thread can touch it meanwhile (one thread in the process) and
// every conflicting range on the page has this thread's touch. Otherwise, and for accesses that
// conflict with nothing (another allocation on a shared page), for the driver's own accesses (its
// code in libcuda) and for the recorder's own (internal()), the page is opened for one instruction:
// the trap flag single-steps it and the SIGTRAP handler protects the page again. A fault on a page
// the watch does not hold goes to the handler that was there before (or the default: the process
// dies as it would have).
//
// Everything the signal handler reads lives in memory this file maps for itself (never on a page
// the watch protects: registered host memory can share a page with malloc's), under one spinlock
// that no code holds while it touches user memory. No allocation and no other lock in the handler.
//
// x86-64 Linux only (the fault's error code and the trap flag); elsewhere start() says why not.

#include "host_watch.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

#include "driver_entry.h"
#include "frames.h"
#include "native_log.h"

namespace kvverify::watch {
namespace {

constexpr uint64_t kPage = 4096;
constexpr int kReadOk = 1, kWriteOk = 2;  // a page's lift: the kinds its conflicting ranges saw this thread's touch of
constexpr uint64_t kLegacy = 1;           // CU_STREAM_LEGACY; handle 0 outside the per-thread API
constexpr uint64_t kPerThread = 2;        // CU_STREAM_PER_THREAD
constexpr uint64_t kPointerLo = 1ull << 16, kPointerHi = 1ull << 57;  // argument words taken for addresses
constexpr uint64_t kMaxWatched = 64ull << 20;  // an allocation a kernel reaches is watched whole up to this size

// -- fixed tables in memory of the watch's own ----------------------------------------------------

constexpr size_t kPages = 1 << 20;      // pages held at once
constexpr size_t kPending = 1 << 16;    // device ranges pending at once
constexpr size_t kStreams = 1 << 12;
constexpr size_t kWaits = 1 << 16;
constexpr size_t kEvents = 1 << 16;
constexpr size_t kKnown = 1 << 16;      // allocations the driver described
constexpr size_t kCover = 1 << 18;      // watched intervals, merged
constexpr size_t kTables = 256;         // device pointer tables a host copy filled
constexpr size_t kTableBytes = 4096;
constexpr size_t kTouchSlots = 1024;
constexpr size_t kTouchWords = 1024;
constexpr int kMaxFrames = 16;
constexpr size_t kThreadSlots = 4096;
constexpr int kMaxSteps = 8;            // pages one instruction may be single-stepped over

struct PageEntry {
  uint64_t key;  // page number + 1; 0: empty
  uint32_t nany, nwrite;  // pending ranges on the page; of them, device writes
  uint8_t prot, lift;
  bool eager;  // pageable memory: its protection is lifted as soon as nothing needs it
};

struct Touched {
  uint64_t thread;
  uint8_t kinds;  // kReadOk | kWriteOk
};

struct Pending {
  uint64_t lo, hi;
  uint32_t stream;  // index in streams
  uint32_t next;    // the stream's next pending range (FIFO), or kNone
  uint64_t pos;     // its position in the stream
  bool device_writes, live;
  Touched touched[4];
};

struct Stream {
  uint64_t key;  // 0: empty
  uint64_t count, done;  // positions issued; every position below `done` has completed
  uint32_t head, tail;  // pending FIFO
  uint32_t waits;       // list of waits
  bool capturing;
};

struct Wait {
  uint64_t pos;  // work after this position of the waiting stream waits for...
  uint32_t target;
  uint64_t target_pos;  // ...the target stream's positions below this one
  uint32_t next;
};

struct Event {
  uint64_t key;
  uint32_t stream;
  uint64_t pos;
};

struct Known {
  uint64_t base, end;
  int kind;  // kHost (watched) or kDevice
};
enum : int { kUnknown = 0, kHost = 1, kDevice = 2 };

struct Interval {
  uint64_t lo, hi;
};

struct Table {
  uint64_t lo, hi;  // the device table's bytes
  uint64_t values[kTableBytes / 8];
  bool live;
};

struct TouchSlot {
  std::atomic<int> state;  // 0 free, 1 being written, 2 ready
  uint64_t thread, seq;
  int nwords;
  int64_t words[kTouchWords];
};

constexpr uint32_t kNone = 0xffffffffu;

struct State {
  PageEntry pages[kPages];
  Pending pending[kPending];
  uint32_t free_pending;
  uint32_t pending_used;
  uint32_t pending_hw;  // every live pending range lies below this index
  Stream streams[kStreams];
  Wait waits[kWaits];
  uint32_t free_wait;
  uint32_t waits_used;
  Event events[kEvents];
  Known known[kKnown];
  size_t nknown;
  Interval cover[kCover];
  size_t ncover;
  Table tables[kTables];
  size_t next_table;
  TouchSlot touches[kTouchSlots];
  int capturing;  // streams capturing now
  // what could not be watched, for the recorder's summary
  uint64_t overflow_pending, overflow_pages, overflow_cover, large_skipped, protect_failed;
};

struct ThreadSlot {
  std::atomic<uint64_t> owner;  // pthread_t + 1; 0: free
  int internal;
  int seen_elsewhere;
  int nsteps;
  uint64_t steps[kMaxSteps];  // pages opened for the instruction being single-stepped
  bool unblocked_trap;         // SIGTRAP was blocked where the instruction runs: block it again
  int chained;                 // handlers beneath the watch's this fault was handed to so far
};

State* g = nullptr;  // the tables (mmap'd at start)
std::atomic<bool> watching{false};
std::atomic<int> in_handlers{0};  // threads inside a handler now (stop() waits for them)
std::atomic<int> spin{0};
std::atomic<int> live_threads{1};
std::atomic<uint64_t> touch_seq{0};
std::atomic<int64_t> touches_ready{0};
std::atomic<uint64_t> touches_lost{0};
std::atomic<uint64_t> passes_untracked{0};
ThreadSlot thread_slots[kThreadSlots];
pthread_key_t slot_key;
std::once_flag slot_key_once;
struct sigaction old_segv, old_trap;
constexpr int kBeneath = 4;
struct sigaction beneath[kBeneath];  // what old_segv was before kvverify_watch_on_top
int nbeneath = 0;
bool handlers_installed = false;
struct CodeRange {
  uintptr_t lo, hi;
};
CodeRange driver_code[16];
int ndriver_code = 0;
std::string failure;

// Where the watch's time goes (kvverify_watch_stats; benchmarks/bench_record.py prints it):
// counts and nanoseconds, reset at each start.
enum Stat { kProtects, kProtectNs, kFaults, kFaultNs, kOps, kOpNs, kQueries, kQueryNs, kCompletes, kCompleteNs, kStats };
std::atomic<uint64_t> stats[kStats];
uint64_t now_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000ull + static_cast<uint64_t>(t.tv_nsec);
}
struct Timed {  // adds one to stats[count] and the nanoseconds of its scope to stats[count + 1]
  Stat count;
  uint64_t start = now_ns();
  explicit Timed(Stat c) : count(c) {}
  ~Timed() {
    stats[count].fetch_add(1, std::memory_order_relaxed);
    stats[count + 1].fetch_add(now_ns() - start, std::memory_order_relaxed);
  }
};

void lock() {
  while (spin.exchange(1, std::memory_order_acquire) != 0) {
    while (spin.load(std::memory_order_relaxed) != 0) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }
}
void unlock() { spin.store(0, std::memory_order_release); }
struct Guard {
  Guard() { lock(); }
  ~Guard() { unlock(); }
};

uint64_t self() { return static_cast<uint64_t>(pthread_self()); }

// A call that reads the tables from another thread than the one stopping the watch (a driver call's
// callback): stop() waits for it before it unmaps them. `ok`: the watch runs.
struct Entry {
  bool ok;
  Entry() {
    in_handlers.fetch_add(1, std::memory_order_acq_rel);
    ok = watching.load(std::memory_order_acquire);
  }
  ~Entry() { in_handlers.fetch_sub(1, std::memory_order_acq_rel); }
};

// -- per-thread slots (found from a signal handler by pthread_self) --------------------------------

size_t slot_hash(uint64_t t) { return static_cast<size_t>((t >> 4) * 0x9E3779B97F4A7C15ull >> 52) % kThreadSlots; }

ThreadSlot* find_slot(uint64_t t) {
  const size_t h = slot_hash(t);
  for (size_t i = 0; i < kThreadSlots; ++i) {
    ThreadSlot& s = thread_slots[(h + i) % kThreadSlots];
    const uint64_t owner = s.owner.load(std::memory_order_acquire);
    if (owner == t + 1) return &s;
    if (owner == 0) return nullptr;
  }
  return nullptr;
}

// The calling thread's slot, claimed where it has none (async-signal-safe: a compare-exchange).
// A thread's end hands its slot back (the key destructor of my_slot) as a tombstone (owner 1: no
// pthread_t + 1 is 1), which probing passes over and a later claim takes.
ThreadSlot* claim_slot(uint64_t t) {
  if (ThreadSlot* mine = find_slot(t)) return mine;
  const size_t h = slot_hash(t);
  for (size_t i = 0; i < kThreadSlots; ++i) {
    ThreadSlot& s = thread_slots[(h + i) % kThreadSlots];
    uint64_t owner = s.owner.load(std::memory_order_acquire);
    if (owner > 1) continue;
    if (s.owner.compare_exchange_strong(owner, t + 1, std::memory_order_acq_rel)) {
      s.internal = 0;  // (only once it is this thread's: a claim that lost must not clear the winner's)
      s.seen_elsewhere = 0;
      s.nsteps = 0;
      s.unblocked_trap = false;
      s.chained = 0;
      return &s;
    }
  }
  return nullptr;
}

void release_slot(void* slot) { static_cast<ThreadSlot*>(slot)->owner.store(1, std::memory_order_release); }

ThreadSlot* my_slot() {
  thread_local ThreadSlot* mine = nullptr;
  if (mine == nullptr) {
    std::call_once(slot_key_once, [] { pthread_key_create(&slot_key, release_slot); });
    mine = claim_slot(self());
    if (mine != nullptr) pthread_setspecific(slot_key, mine);
  }
  return mine;
}

// -- pages -------------------------------------------------------------------------------------------

// Runs of 64 pages keep their order in the table (an op's pages are looked up one after the other:
// neighbouring entries, not one cache miss each); the runs are spread by a multiplicative hash.
size_t page_hash(uint64_t key) {
  return ((static_cast<size_t>((key >> 6) * 0x9E3779B97F4A7C15ull >> 44) << 6) | (key & 63)) & (kPages - 1);
}

PageEntry* find_page(uint64_t page) {
  const uint64_t key = page + 1;
  for (size_t i = page_hash(key);; i = (i + 1) & (kPages - 1)) {
    PageEntry& e = g->pages[i];
    if (e.key == key) return &e;
    if (e.key == 0) return nullptr;
  }
}

PageEntry* page_entry(uint64_t page, bool* made = nullptr) {
  const uint64_t key = page + 1;
  size_t probes = 0;
  for (size_t i = page_hash(key);; i = (i + 1) & (kPages - 1), ++probes) {
    PageEntry& e = g->pages[i];
    if (e.key == key) return &e;
    if (e.key == 0) {
      if (probes > kPages / 2) return nullptr;  // (the table is full enough that a miss costs too much)
      e = PageEntry{key, 0, 0, PROT_READ | PROT_WRITE, 0, false};
      if (made != nullptr) *made = true;
      return &e;
    }
  }
}

// Remove an entry, shifting the ones after it back so that probing stays correct (linear probing).
void erase_page(PageEntry* e) {
  size_t i = static_cast<size_t>(e - g->pages);
  g->pages[i].key = 0;
  for (size_t j = (i + 1) & (kPages - 1); g->pages[j].key != 0; j = (j + 1) & (kPages - 1)) {
    const size_t home = page_hash(g->pages[j].key);
    // move j back to i where i lies (cyclically) between home and j
    if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
      g->pages[i] = g->pages[j];
      g->pages[j].key = 0;
      i = j;
    }
  }
}

int required(const PageEntry& e) {
  const bool write_ok = e.nany == 0 || (e.lift & kWriteOk);
  const bool read_ok = e.nwrite == 0 || (e.lift & (kReadOk | kWriteOk));
  return read_ok ? (write_ok ? PROT_READ | PROT_WRITE : PROT_READ) : PROT_NONE;
}

// Give pages [first, first + n) the protection their entries require; contiguous pages that change
// to the same protection are one mprotect.
// A page of pinned or registered memory stays write-protected while its pending work needs less
// (`relax` false) until the host writes it: each mprotect that takes rights away costs every CPU the
// process runs on a TLB flush, and a pool of KV blocks the host never writes is then not protected
// again at every load. Reads are given back at once (the driver reads a small host source with the
// CPU). Pageable memory (`eager`) gets every right back at once: the program's heap may put
// anything there.
void apply(uint64_t first, uint64_t n, bool relax = false) {
  uint64_t run = 0, len = 0;
  int run_prot = -1;
  auto flush = [&] {
    if (len == 0) return;
    const Timed timed(kProtects);
    if (mprotect(reinterpret_cast<void*>(run * kPage), len * kPage, run_prot) != 0) ++g->protect_failed;
    len = 0;
  };
  for (uint64_t p = first; p < first + n; ++p) {
    PageEntry* e = find_page(p);
    if (e == nullptr) continue;
    int want = required(*e);
    // (PROT_NONE < PROT_READ < read-write; reads come back at once, writes when the host writes)
    if (want > e->prot && !relax && !e->eager) want = e->prot == PROT_NONE ? std::min(want, PROT_READ) : e->prot;
    if (want != e->prot) {
      if (len == 0 || run + len != p || run_prot != want) {
        flush();
        run = p, run_prot = want;
      }
      ++len;
      e->prot = static_cast<uint8_t>(want);
    }
    if (e->nany == 0 && e->prot == (PROT_READ | PROT_WRITE)) erase_page(e);
  }
  flush();
}

// -- streams, events, pending ranges -------------------------------------------------------------------

size_t key_hash(uint64_t key, size_t size) { return static_cast<size_t>((key >> 3) * 0x9E3779B97F4A7C15ull >> 40) & (size - 1); }

uint32_t stream_index(uint64_t key) {
  for (size_t n = 0, i = key_hash(key, kStreams); n < kStreams; ++n, i = (i + 1) & (kStreams - 1)) {
    Stream& s = g->streams[i];
    if (s.key == key) return static_cast<uint32_t>(i);
    if (s.key == 0) {
      s = Stream{key, 0, 0, kNone, kNone, kNone, false};
      return static_cast<uint32_t>(i);
    }
  }
  return kNone;
}

Event* event_slot(uint64_t key, bool make) {
  for (size_t n = 0, i = key_hash(key, kEvents); n < kEvents; ++n, i = (i + 1) & (kEvents - 1)) {
    Event& e = g->events[i];
    if (e.key == key) return &e;
    if (e.key == 0) {
      if (!make) return nullptr;
      e = Event{key, kNone, 0};
      return &e;
    }
  }
  return nullptr;
}

void cover_add(uint64_t lo, uint64_t hi) {
  Interval* c = g->cover;
  size_t n = g->ncover;
  size_t i = std::lower_bound(c, c + n, lo, [](const Interval& a, uint64_t v) { return a.hi < v; }) - c;
  if (i < n && c[i].lo <= hi) {  // overlaps or touches c[i]: merge forward
    c[i].lo = std::min(c[i].lo, lo);
    c[i].hi = std::max(c[i].hi, hi);
    size_t j = i + 1;
    while (j < n && c[j].lo <= c[i].hi) c[i].hi = std::max(c[i].hi, c[j++].hi);
    std::memmove(c + i + 1, c + j, (n - j) * sizeof(Interval));
    g->ncover = n - (j - i - 1);
    return;
  }
  if (n == kCover) {
    ++g->overflow_cover;
    return;
  }
  std::memmove(c + i + 1, c + i, (n - i) * sizeof(Interval));
  c[i] = Interval{lo, hi};
  g->ncover = n + 1;
}

void release_pending(uint32_t k) {
  Pending& p = g->pending[k];
  p.live = false;
  const uint64_t first = p.lo / kPage, last = (p.hi + kPage - 1) / kPage;
  for (uint64_t q = first; q < last; ++q) {
    PageEntry* e = find_page(q);
    if (e == nullptr) continue;
    --e->nany;
    if (p.device_writes) --e->nwrite;
  }
  apply(first, last - first);
  p.next = g->free_pending;
  g->free_pending = k;
  --g->pending_used;
}

// Everything of stream `s` below position `d` has completed, and what its waits waited for.
void complete(uint32_t s0, uint64_t d0) {
  const Timed timed(kCompletes);
  struct Item {
    uint32_t s;
    uint64_t d;
  };
  Item stack[64];
  int top = 0;
  stack[top++] = Item{s0, d0};
  while (top > 0) {
    const Item it = stack[--top];
    Stream& s = g->streams[it.s];
    if (it.d <= s.done) continue;
    s.done = it.d;
    while (s.head != kNone && g->pending[s.head].pos < s.done) {
      const uint32_t k = s.head;
      s.head = g->pending[k].next;
      release_pending(k);
    }
    if (s.head == kNone) s.tail = kNone;
    uint32_t* link = &s.waits;
    while (*link != kNone) {
      Wait& w = g->waits[*link];
      if (w.pos < s.done) {
        if (top < 64) {
          stack[top++] = Item{w.target, w.target_pos};
        }  // (deeper chains stay pending: completion is only ever under-estimated)
        const uint32_t k = *link;
        *link = w.next;
        w.next = g->free_wait;
        g->free_wait = k;
        --g->waits_used;
      } else {
        link = &w.next;
      }
    }
  }
}

// -- what memory an address is ---------------------------------------------------------------------

using PointerGetAttributes = PFN_cuPointerGetAttributes_v7000;

PointerGetAttributes pointer_attributes() {
  static const auto fn = driver_entry<PointerGetAttributes>("cuPointerGetAttributes", 7000);
  return fn;
}

const Known* find_known(uint64_t address) {
  const Known* k = g->known;
  const size_t n = g->nknown;
  const Known* it = std::upper_bound(k, k + n, address, [](uint64_t v, const Known& a) { return v < a.base; });
  if (it == k) return nullptr;
  --it;
  return address < it->end ? it : nullptr;
}

void add_known(uint64_t base, uint64_t end, int kind) {
  Known* k = g->known;
  const size_t n = g->nknown;
  Known* it = std::lower_bound(k, k + n, base, [](const Known& a, uint64_t v) { return a.base < v; });
  if (it != k + n && it->base == base) {
    *it = Known{base, end, kind};
    return;
  }
  if (n == kKnown) return;  // (looked up again next time)
  std::memmove(it + 1, it, static_cast<size_t>(k + n - it) * sizeof(Known));
  *it = Known{base, end, kind};
  g->nknown = n + 1;
}

// The allocation `address` lies in and its kind (kHost: pinned or registered, watched; kDevice;
// kUnknown: pageable or not an address). Takes the lock itself; asks the driver outside it.
int classify(uint64_t address, uint64_t* base, uint64_t* end) {
  {
    Guard guard;
    if (const Known* k = find_known(address)) {
      *base = k->base, *end = k->end;
      return k->kind;
    }
  }
  PointerGetAttributes fn = pointer_attributes();
  if (fn == nullptr) return kUnknown;
  CUmemorytype type = static_cast<CUmemorytype>(0);
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* values[] = {&type, &start, &size};
  CUresult asked;
  {
    const Timed timed(kQueries);
    asked = fn(3, attrs, values, static_cast<CUdeviceptr>(address));
  }
  if (asked != CUDA_SUCCESS || size == 0) return kUnknown;
  const int kind = type == CU_MEMORYTYPE_HOST ? kHost : type == CU_MEMORYTYPE_DEVICE ? kDevice : kUnknown;
  if (kind == kUnknown) return kUnknown;
  *base = start, *end = start + size;
  Guard guard;
  add_known(*base, *end, kind);
  return kind;
}

// Add one pending range of stream `s` at position `pos` and protect its pages (the lock held).
void watch_range(uint32_t s, uint64_t pos, uint64_t lo, uint64_t hi, bool device_writes, bool pageable) {
  if (g->free_pending == kNone) {
    ++g->overflow_pending;
    return;
  }
  const uint32_t k = g->free_pending;
  Pending& p = g->pending[k];
  g->free_pending = p.next;
  ++g->pending_used;
  g->pending_hw = std::max(g->pending_hw, k + 1);
  p = Pending{lo, hi, s, kNone, pos, device_writes, true, {}};
  Stream& st = g->streams[s];
  if (st.tail == kNone) {
    st.head = st.tail = k;
  } else {
    g->pending[st.tail].next = k;
    st.tail = k;
  }
  const uint64_t first = lo / kPage, last = (hi + kPage - 1) / kPage;
  uint64_t fresh = 0, fresh_len = 0;  // a run of pages the table had no entry for: new to the coverage
  for (uint64_t q = first; q < last; ++q) {
    bool made = false;
    PageEntry* e = page_entry(q, &made);
    if (e == nullptr) {
      ++g->overflow_pages;
      continue;
    }
    ++e->nany;
    if (device_writes) ++e->nwrite;
    e->lift = 0;  // new device work on the page: first touches are recorded again
    e->eager |= pageable;
    if (made) {
      if (fresh_len != 0 && fresh + fresh_len != q) {
        cover_add(fresh * kPage, (fresh + fresh_len) * kPage);
        fresh_len = 0;
      }
      if (fresh_len == 0) fresh = q;
      ++fresh_len;
    }
  }
  if (fresh_len != 0) cover_add(fresh * kPage, (fresh + fresh_len) * kPage);
  apply(first, last - first);
}

// -- the signal handlers ---------------------------------------------------------------------------

bool in_driver(uintptr_t pc) {
  for (int i = 0; i < ndriver_code; ++i) {
    if (pc >= driver_code[i].lo && pc < driver_code[i].hi) return true;
  }
  return false;
}

void call_handler(const struct sigaction& old, int sig, siginfo_t* info, void* context) {
  if (old.sa_flags & SA_SIGINFO) {
    if (old.sa_sigaction != nullptr) {
      old.sa_sigaction(sig, info, context);
      return;
    }
  } else if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
    old.sa_handler(sig);
    return;
  }
  // the default action: let the instruction fault again with nothing in the way
  signal(sig, SIG_DFL);
}

// Hand a SIGSEGV that is not the watch's to the handler beneath it. A handler that gives up by
// putting back what it found (the watch's) and raising the signal again (Python's faulthandler
// does, after its traceback) comes back here while it runs: it is then handed further down, to what
// that handler had beneath it, and past the last one to the default action.
void chain_segv(int sig, siginfo_t* info, void* context) {
  ThreadSlot* slot = claim_slot(self());
  const int depth = slot != nullptr ? slot->chained : 0;
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  const struct sigaction& next = depth == 0 ? old_segv : depth <= nbeneath ? beneath[nbeneath - depth] : fallback;
  if (slot != nullptr) ++slot->chained;
  call_handler(next, sig, info, context);
  if (slot != nullptr) --slot->chained;
}

// Write one touch record for the calling thread (outside the lock: the frames are read here).
void record_touch(uint64_t address, bool write, uint64_t lo, uint64_t hi) {
  const size_t start = static_cast<size_t>(touch_seq.load(std::memory_order_relaxed)) % kTouchSlots;
  for (size_t i = 0; i < kTouchSlots; ++i) {
    TouchSlot& slot = g->touches[(start + i) % kTouchSlots];
    int expected = 0;
    if (!slot.state.compare_exchange_strong(expected, 1, std::memory_order_acquire)) continue;
    slot.thread = self();
    slot.seq = touch_seq.fetch_add(1, std::memory_order_relaxed);
    int64_t* w = slot.words;
    w[0] = static_cast<int64_t>(address), w[1] = write, w[2] = static_cast<int64_t>(lo), w[3] = static_cast<int64_t>(hi);
    slot.nwords = 4 + frames::snapshot(w + 4, static_cast<int>(kTouchWords) - 4, kMaxFrames);
    slot.state.store(2, std::memory_order_release);
    touches_ready.fetch_add(1, std::memory_order_release);
    native::record_count().fetch_add(1, std::memory_order_relaxed);  // (the recorder sees records are waiting)
    return;
  }
  touches_lost.fetch_add(1, std::memory_order_relaxed);
}

// Open `page` for the one instruction that faulted on it: the trap flag single-steps it, and
// on_trap protects the page again. False where the thread has no slot for it.
bool step_over(PageEntry* e, uint64_t page, ucontext_t* uc) {
  ThreadSlot* slot = claim_slot(self());
  if (slot == nullptr || slot->nsteps == kMaxSteps) return false;
  slot->steps[slot->nsteps++] = page;
  mprotect(reinterpret_cast<void*>(page * kPage), kPage, PROT_READ | PROT_WRITE);
  e->prot = PROT_READ | PROT_WRITE;
#if defined(__x86_64__)
  uc->uc_mcontext.gregs[REG_EFL] |= 0x100;  // TF
#endif
  if (sigismember(&uc->uc_sigmask, SIGTRAP)) {  // a blocked trap would kill the process
    sigdelset(&uc->uc_sigmask, SIGTRAP);
    slot->unblocked_trap = true;
  }
  return true;
}

void on_segv(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  auto* uc = static_cast<ucontext_t*>(context);
  in_handlers.fetch_add(1, std::memory_order_acq_rel);
  const Timed timed(kFaults);  // (clock_gettime is async-signal-safe)
  if (!watching.load(std::memory_order_acquire) || info->si_code != SEGV_ACCERR) {
    in_handlers.fetch_sub(1, std::memory_order_acq_rel);
    errno = saved_errno;
    chain_segv(sig, info, context);
    return;
  }
#if defined(__x86_64__)
  const bool write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
  const uintptr_t pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
#else
  const bool write = true;
  const uintptr_t pc = 0;
#endif
  const uint64_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  const uint64_t page = address / kPage;
  const uint64_t thread = self();
  ThreadSlot* slot = find_slot(thread);
  const bool passive = in_driver(pc) || (slot != nullptr && slot->internal > 0);
  const bool elsewhere = slot != nullptr && slot->seen_elsewhere > 0;  // an op's own access: its record holds it
  bool record = false;
  uint64_t lo = 0, hi = 0;
  lock();
  PageEntry* e = find_page(page);
  if (e == nullptr) {  // not a page of the watch's: whoever handled faults before
    unlock();
    in_handlers.fetch_sub(1, std::memory_order_acq_rel);
    errno = saved_errno;
    chain_segv(sig, info, context);
    return;
  }
  if (required(*e) & (write ? PROT_WRITE : PROT_READ)) {
    apply(page, 1, true);  // allowed by now (the work completed, or the page was lifted): protected no more
  } else if (passive) {
    if (!step_over(e, page, uc)) {
      passes_untracked.fetch_add(1, std::memory_order_relaxed);
      e->lift |= kReadOk | kWriteOk;
      apply(page, 1, true);
    }
  } else {
    // the pending ranges on this page that conflict with this access (a read: device writes; a
    // write: any device access), and whether this thread's touch of each is recorded already
    const uint8_t kind = write ? kWriteOk : kReadOk;
    const uint8_t covers = write ? kWriteOk : (kReadOk | kWriteOk);  // (a write touch stands for reads too)
    const uint64_t page_lo = page * kPage, page_hi = page_lo + kPage;
    bool conflicts = false, all_touched = true;
    for (uint32_t k = 0; k < g->pending_hw; ++k) {
      Pending& p = g->pending[k];
      if (!p.live || p.hi <= page_lo || p.lo >= page_hi || (!write && !p.device_writes)) continue;
      int found = -1, free_at = -1;
      for (int t = 0; t < 4; ++t) {
        if (p.touched[t].kinds != 0 && p.touched[t].thread == thread) found = t;
        if (p.touched[t].kinds == 0 && free_at < 0) free_at = t;
      }
      const bool seen = found >= 0 && (p.touched[found].kinds & covers);
      if (address < p.lo || address >= p.hi) {
        if (!seen) all_touched = false;  // another range on the page this thread has not touched yet
        continue;
      }
      conflicts = true;
      if (seen) continue;
      record = !elsewhere;
      const uint64_t a = std::max(p.lo, page_lo), b = std::min(p.hi, page_hi);
      lo = hi == 0 ? a : std::min(lo, a);
      hi = std::max(hi, b);
      if (found >= 0) {
        p.touched[found].kinds |= kind;
      } else if (free_at >= 0) {
        p.touched[free_at] = Touched{thread, kind};
      }  // (a fifth thread's touches are recorded each time: more records, never fewer)
    }
    if (conflicts && all_touched && live_threads.load(std::memory_order_relaxed) <= 1) {
      e->lift |= write ? (kReadOk | kWriteOk) : kReadOk;
      apply(page, 1, true);
    } else if (!step_over(e, page, uc)) {  // no slot to step with: open the page (rare; counted)
      passes_untracked.fetch_add(1, std::memory_order_relaxed);
      e->lift |= kReadOk | kWriteOk;
      apply(page, 1, true);
    }
  }
  unlock();
  if (record) record_touch(address, write, lo, hi);
  in_handlers.fetch_sub(1, std::memory_order_acq_rel);
  errno = saved_errno;
}

void on_trap(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  auto* uc = static_cast<ucontext_t*>(context);
  ThreadSlot* slot = find_slot(self());
  if (slot == nullptr || slot->nsteps == 0) {
    errno = saved_errno;
    call_handler(old_trap, sig, info, context);
    return;
  }
  in_handlers.fetch_add(1, std::memory_order_acq_rel);
#if defined(__x86_64__)
  uc->uc_mcontext.gregs[REG_EFL] &= ~0x100ll;
#endif
  if (slot->unblocked_trap) {
    sigaddset(&uc->uc_sigmask, SIGTRAP);
    slot->unblocked_trap = false;
  }
  lock();
  if (watching.load(std::memory_order_acquire)) {
    for (int i = 0; i < slot->nsteps; ++i) apply(slot->steps[i], 1);
  }
  slot->nsteps = 0;
  unlock();
  in_handlers.fetch_sub(1, std::memory_order_acq_rel);
  errno = saved_errno;
}

int find_driver_code(struct dl_phdr_info* info, size_t, void*) {
  const char* name = info->dlpi_name;
  if (name == nullptr || (std::strstr(name, "libcuda.so") == nullptr && std::strstr(name, "libcupti") == nullptr)) {
    return 0;
  }
  for (int i = 0; i < info->dlpi_phnum && ndriver_code < 16; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD && (ph.p_flags & PF_X)) {
      driver_code[ndriver_code++] = CodeRange{info->dlpi_addr + ph.p_vaddr, info->dlpi_addr + ph.p_vaddr + ph.p_memsz};
    }
  }
  return 0;
}

}  // namespace

uint64_t stream_key(uint64_t handle, bool per_thread_api) {
  if (handle == kPerThread || (handle == 0 && per_thread_api)) return self() | kPerThread;
  return handle == 0 ? kLegacy : handle;
}

bool on() { return watching.load(std::memory_order_relaxed); }

void device_op(uint64_t stream, const Access* accesses, size_t n) {
  const Entry entry;
  if (!entry.ok || n == 0) return;
  const Timed timed(kOps);
  // what memory each access lies in: under one lock, the last allocation found tried first (a
  // batch's blocks lie in a few allocations); the driver is asked outside it, for what is new
  std::vector<int> kinds(n, kUnknown);
  std::vector<uint64_t> ends(n, 0);
  std::vector<size_t> misses;
  {
    Guard guard;
    const Known* last = nullptr;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t address = accesses[i].address;
      if (accesses[i].bytes == 0) continue;
      if (last == nullptr || address < last->base || address >= last->end) last = find_known(address);
      if (last != nullptr) {
        kinds[i] = last->kind, ends[i] = last->end;
      } else {
        misses.push_back(i);
      }
    }
  }
  for (size_t i : misses) {
    uint64_t base = 0;
    kinds[i] = classify(accesses[i].address, &base, &ends[i]);
  }
  struct Host {
    uint64_t lo, hi;
    bool writes, pageable;
  };
  std::vector<Host> hosts;
  for (size_t i = 0; i < n; ++i) {
    const Access& a = accesses[i];
    if (a.bytes == 0) continue;
    const bool pageable = kinds[i] == kUnknown && a.pageable;
    if (!pageable && kinds[i] != kHost) continue;
    const uint64_t lo = a.address, hi = pageable ? a.address + a.bytes : std::min(a.address + a.bytes, ends[i]);
    if (!hosts.empty() && hosts.back().writes == a.device_writes && hosts.back().pageable == pageable &&
        hosts.back().hi == lo) {
      hosts.back().hi = hi;  // (a batch of adjacent blocks: one range)
      continue;
    }
    hosts.push_back(Host{lo, hi, a.device_writes, pageable});
  }
  if (hosts.empty()) return;
  Guard guard;
  const uint32_t s = stream_index(stream);
  if (s == kNone || g->streams[s].capturing) return;
  const uint64_t pos = ++g->streams[s].count;
  for (const Host& h : hosts) watch_range(s, pos, h.lo, h.hi, h.writes, h.pageable);
}

void launch(uint64_t stream, const int64_t* words, size_t n) {
  const Entry entry;
  if (!entry.ok) return;
  Access accesses[64];
  size_t na = 0;
  auto add = [&](uint64_t address) {
    uint64_t base = 0, end = 0;
    if (na == 64 || classify(address, &base, &end) != kHost) return;
    if (end - base > kMaxWatched) {
      Guard guard;
      ++g->large_skipped;
      return;
    }
    for (size_t i = 0; i < na; ++i) {
      if (accesses[i].address == base) return;
    }
    accesses[na++] = Access{base, end - base, true};
  };
  for (size_t i = 0; i < n; ++i) {
    const uint64_t w = static_cast<uint64_t>(words[i]);
    if (w < kPointerLo || w >= kPointerHi) continue;
    uint64_t values[kTableBytes / 8];
    size_t nvalues = 0;
    {
      Guard guard;
      for (size_t t = 0; t < kTables; ++t) {
        const Table& table = g->tables[t];
        if (table.live && w >= table.lo && w < table.hi) {
          nvalues = static_cast<size_t>(table.hi - w) / 8;
          std::memcpy(values, table.values + (w - table.lo) / 8, nvalues * 8);
          break;
        }
      }
    }
    for (size_t v = 0; v < nvalues; ++v) {
      if (values[v] >= kPointerLo && values[v] < kPointerHi) add(values[v]);
    }
    add(w);
  }
  device_op(stream, accesses, na);
}

void table_op(uint64_t stream, uint64_t table, int64_t n, uint64_t block_bytes, bool device_writes) {
  const Entry entry;
  if (!entry.ok || n <= 0) return;
  std::vector<uint64_t> values;
  {
    Guard guard;
    for (size_t t = 0; t < kTables; ++t) {
      const Table& found = g->tables[t];
      if (found.live && table >= found.lo && table + 8 * static_cast<uint64_t>(n) <= found.hi) {
        values.assign(found.values + (table - found.lo) / 8, found.values + (table - found.lo) / 8 + n);
        break;
      }
    }
  }
  std::vector<Access> accesses;
  accesses.reserve(values.size());
  for (uint64_t v : values) accesses.push_back(Access{v, block_bytes, device_writes});
  device_op(stream, accesses.data(), accesses.size());
}

void table_copied(uint64_t device_address, const void* host, uint64_t bytes) {
  const Entry entry;
  if (!entry.ok || bytes == 0 || bytes > kTableBytes || bytes % 8 != 0) return;
  uint64_t values[kTableBytes / 8];
  ThreadSlot* slot = my_slot();
  if (slot != nullptr) ++slot->internal;  // (the recorder's read of the bytes the copy read, not the program's)
  std::memcpy(values, host, bytes);
  if (slot != nullptr) --slot->internal;
  Guard guard;
  for (size_t t = 0; t < kTables; ++t) {  // a table copied again over the same bytes replaces it
    Table& table = g->tables[t];
    if (table.live && table.lo < device_address + bytes && device_address < table.hi) table.live = false;
  }
  Table& table = g->tables[g->next_table++ % kTables];
  table.lo = device_address, table.hi = device_address + bytes, table.live = true;
  std::memcpy(table.values, values, bytes);
}

void event_recorded(uint64_t event, uint64_t stream) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  const uint32_t s = stream_index(stream);
  Event* e = event_slot(event, true);
  if (s == kNone || e == nullptr) return;
  e->stream = s;
  e->pos = ++g->streams[s].count;
}

void stream_waited(uint64_t stream, uint64_t event) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  Event* e = event_slot(event, false);
  const uint32_t s = stream_index(stream);
  if (e == nullptr || e->stream == kNone || s == kNone || g->free_wait == kNone) return;
  const uint32_t k = g->free_wait;
  Wait& w = g->waits[k];
  g->free_wait = w.next;
  ++g->waits_used;
  w = Wait{++g->streams[s].count, e->stream, e->pos, g->streams[s].waits};
  g->streams[s].waits = k;
}

void event_completed(uint64_t event) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  Event* e = event_slot(event, false);
  if (e != nullptr && e->stream != kNone) complete(e->stream, e->pos);
}

void stream_completed(uint64_t stream) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  const uint32_t s = stream_index(stream);
  if (s != kNone) complete(s, g->streams[s].count + 1);
}

void device_completed() {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  for (size_t i = 0; i < kStreams; ++i) {
    if (g->streams[i].key != 0) complete(static_cast<uint32_t>(i), g->streams[i].count + 1);
  }
}

void capture(uint64_t stream, bool begin) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  const uint32_t s = stream_index(stream);
  if (s != kNone && g->streams[s].capturing != begin) {
    g->streams[s].capturing = begin;
    g->capturing += begin ? 1 : -1;
  }
}

void host_released(uint64_t address) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  const Known* k = find_known(address);
  if (k == nullptr || k->kind != kHost) return;
  const uint64_t base = k->base, end = k->end;
  for (uint32_t i = 0; i < g->pending_hw; ++i) {  // its pending ranges end here (what raced is the recorder's to say)
    Pending& p = g->pending[i];
    if (!p.live || p.hi <= base || p.lo >= end) continue;
    Stream& s = g->streams[p.stream];
    uint32_t* link = &s.head;
    uint32_t prev = kNone;
    while (*link != kNone && *link != i) prev = *link, link = &g->pending[*link].next;
    if (*link == i) {
      *link = p.next;
      if (s.tail == i) s.tail = prev;
    }
    release_pending(i);
  }
  for (uint64_t q = base / kPage; q < (end + kPage - 1) / kPage; ++q) {  // (and lifts left on its pages)
    PageEntry* e = find_page(q);
    if (e != nullptr && e->nany == 0) {
      e->lift = 0;
      apply(q, 1, true);  // (the memory is about to go: its pages get every right back)
    }
  }
  Known* it = const_cast<Known*>(k);
  std::memmove(it, it + 1, static_cast<size_t>(g->known + g->nknown - it - 1) * sizeof(Known));
  --g->nknown;
}

int64_t drain(uint64_t thread, int64_t kind, std::vector<int64_t>& words) {
  const Entry entry;
  if (!entry.ok || touches_ready.load(std::memory_order_acquire) == 0) return 0;
  std::pair<uint64_t, size_t> ready[kTouchSlots];
  size_t n = 0;
  for (size_t i = 0; i < kTouchSlots; ++i) {
    const TouchSlot& slot = g->touches[i];
    if (slot.state.load(std::memory_order_acquire) == 2 && slot.thread == thread) ready[n++] = {slot.seq, i};
  }
  std::sort(ready, ready + n);
  for (size_t r = 0; r < n; ++r) {
    TouchSlot& slot = g->touches[ready[r].second];
    words.push_back(kind);
    words.push_back(3 + slot.nwords);  // n: nframes (0), the fields and the span
    words.push_back(0);
    words.insert(words.end(), slot.words, slot.words + slot.nwords);
    words.push_back(0);  // the span: not known (the touch's order in its thread's records is what counts)
    words.push_back(0);
    slot.state.store(0, std::memory_order_release);
  }
  touches_ready.fetch_sub(static_cast<int64_t>(n), std::memory_order_acq_rel);
  return static_cast<int64_t>(n);
}

bool holds(uint64_t address) {
  const Entry entry;
  if (!entry.ok) return false;
  Guard guard;
  const PageEntry* e = find_page(address / kPage);
  return e != nullptr && e->prot != (PROT_READ | PROT_WRITE);
}

int& seen_elsewhere() {
  thread_local int fallback = 0;  // (a thread the slot table had no room for)
  ThreadSlot* slot = my_slot();
  return slot != nullptr ? slot->seen_elsewhere : fallback;
}

size_t touch_threads(uint64_t* out, size_t capacity) {
  const Entry entry;
  if (!entry.ok || touches_ready.load(std::memory_order_acquire) == 0) return 0;
  size_t n = 0;
  for (size_t i = 0; i < kTouchSlots && n < capacity; ++i) {
    const TouchSlot& slot = g->touches[i];
    if (slot.state.load(std::memory_order_acquire) != 2 || std::find(out, out + n, slot.thread) != out + n) continue;
    out[n++] = slot.thread;
  }
  return n;
}

namespace {

const char* start() {
#if !defined(__x86_64__) || !defined(__linux__)
  return "the host watch needs x86-64 Linux (a page fault's error code and the trap flag)";
#else
  if (watching.load()) return "the host watch is running already";
  if (sysconf(_SC_PAGESIZE) != static_cast<long>(kPage)) return "the host watch needs 4 KiB pages";
  void* p = mmap(nullptr, sizeof(State), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    failure = std::string("the host watch could not map its tables: ") + std::strerror(errno);
    return failure.c_str();
  }
  g = static_cast<State*>(p);  // (zero-filled by the kernel: every table starts empty)
  for (uint32_t k = 0; k < kPending; ++k) g->pending[k].next = k + 1 < kPending ? k + 1 : kNone;
  g->free_pending = 0;
  for (uint32_t k = 0; k < kWaits; ++k) g->waits[k].next = k + 1 < kWaits ? k + 1 : kNone;
  g->free_wait = 0;
  touches_lost.store(0);
  passes_untracked.store(0);
  touches_ready.store(0);
  for (auto& stat : stats) stat.store(0);
  frames::usable();
  ndriver_code = 0;
  dl_iterate_phdr(find_driver_code, nullptr);
  struct sigaction segv {}, trap {};
  segv.sa_sigaction = on_segv;
  segv.sa_flags = SA_SIGINFO | SA_NODEFER | SA_RESTART;  // (NODEFER: a fault inside the handler, on a shared page)
  sigemptyset(&segv.sa_mask);
  trap.sa_sigaction = on_trap;
  trap.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&trap.sa_mask);
  struct sigaction now {};
  sigaction(SIGTRAP, nullptr, &now);
  const bool trap_ours = (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_trap;  // (from an earlier start)
  if (sigaction(SIGSEGV, &segv, &old_segv) != 0 || (!trap_ours && sigaction(SIGTRAP, &trap, &old_trap) != 0)) {
    failure = std::string("the host watch could not install its signal handlers: ") + std::strerror(errno);
    return failure.c_str();
  }
  handlers_installed = true;
  nbeneath = 0;
  watching.store(true, std::memory_order_release);
  return nullptr;
#endif
}

// Stop: every page the watch holds gets its protection back, the handler of SIGSEGV is taken away
// (where nobody replaced it meanwhile), the tables are unmapped.
void stop() {
  if (g == nullptr) return;
  {
    Guard guard;
    watching.store(false, std::memory_order_release);
    for (size_t i = 0; i < kPages; ++i) {
      PageEntry& e = g->pages[i];
      if (e.key != 0 && e.prot != (PROT_READ | PROT_WRITE)) {
        mprotect(reinterpret_cast<void*>((e.key - 1) * kPage), kPage, PROT_READ | PROT_WRITE);
      }
    }
  }
  if (handlers_installed) {
    // SIGTRAP's handler stays: a thread may be single-stepping an instruction right now, and its
    // trap must find the handler (it hands any other trap on); SIGSEGV's goes back where nobody
    // replaced it meanwhile
    struct sigaction now {};
    sigaction(SIGSEGV, nullptr, &now);
    if (now.sa_sigaction == on_segv) sigaction(SIGSEGV, &old_segv, nullptr);
    handlers_installed = false;
  }
  // a thread inside a handler that read `watching` before it changed finishes before the unmap
  while (in_handlers.load(std::memory_order_acquire) != 0) sched_yield();
  munmap(static_cast<void*>(g), sizeof(State));
  g = nullptr;
  touches_ready.store(0);
}

}  // namespace
}  // namespace kvverify::watch

using namespace kvverify::watch;

extern "C" {

// Start watching (nullptr) or why not.
__attribute__((visibility("default"))) const char* kvverify_watch_start() { return start(); }

__attribute__((visibility("default"))) void kvverify_watch_stop() { stop(); }

// How many threads may touch host memory now (1: a page is opened for good at its first touch).
__attribute__((visibility("default"))) void kvverify_watch_threads(int n) { live_threads.store(n); }

// The address of the calling thread's depth in the recorder's own work (an int Python moves around
// it: faults there are not the program's accesses), or null where it has no slot.
__attribute__((visibility("default"))) int* kvverify_watch_internal() {
  ThreadSlot* slot = my_slot();
  return slot == nullptr ? nullptr : &slot->internal;
}

// Memory the driver cannot describe (the CPU tests' stand-in, Python's own knowledge): `kind` 1
// host (watched), 2 device.
__attribute__((visibility("default"))) void kvverify_watch_declare(uint64_t base, uint64_t bytes, int kind) {
  const Entry entry;
  if (!entry.ok) return;
  Guard guard;
  add_known(base, base + bytes, kind);
}

// What native capture feeds the watch, for the tests' stand-in of a device: one device op on
// `stream` with `n` accesses (addresses, bytes, and whether the device writes each).
__attribute__((visibility("default"))) void kvverify_watch_device_op(uint64_t stream, const uint64_t* addresses,
                                                                     const uint64_t* bytes, const uint8_t* writes,
                                                                     int64_t n) {
  std::vector<Access> accesses;
  accesses.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) accesses.push_back(Access{addresses[i], bytes[i], writes[i] != 0});
  device_op(stream, accesses.data(), accesses.size());
}
__attribute__((visibility("default"))) void kvverify_watch_event_recorded(uint64_t event, uint64_t stream) {
  event_recorded(event, stream);
}
__attribute__((visibility("default"))) void kvverify_watch_stream_waited(uint64_t stream, uint64_t event) {
  stream_waited(stream, event);
}
__attribute__((visibility("default"))) void kvverify_watch_event_completed(uint64_t event) { event_completed(event); }
__attribute__((visibility("default"))) void kvverify_watch_stream_completed(uint64_t stream) { stream_completed(stream); }
__attribute__((visibility("default"))) void kvverify_watch_device_completed() { device_completed(); }
__attribute__((visibility("default"))) uint64_t kvverify_watch_stream_key(uint64_t handle, int per_thread_api) {
  return stream_key(handle, per_thread_api != 0);
}

// Open [address, address + bytes) for a system call of the calling thread (a read into it, a write
// from it: the kernel answers EFAULT on a protected page instead of faulting); returns how many
// pages it opened. The caller records the access itself. kvverify_watch_close protects them again.
__attribute__((visibility("default"))) int64_t kvverify_watch_open(uint64_t address, uint64_t bytes) {
  const Entry entry;
  if (!entry.ok || bytes == 0) return 0;
  Guard guard;
  int64_t opened = 0;
  for (uint64_t q = address / kPage; q < (address + bytes + kPage - 1) / kPage; ++q) {
    PageEntry* e = find_page(q);
    if (e != nullptr && e->prot != (PROT_READ | PROT_WRITE)) {
      mprotect(reinterpret_cast<void*>(q * kPage), kPage, PROT_READ | PROT_WRITE);
      e->prot = PROT_READ | PROT_WRITE;
      ++opened;
    }
  }
  return opened;
}
__attribute__((visibility("default"))) void kvverify_watch_close(uint64_t address, uint64_t bytes) {
  const Entry entry;
  if (!entry.ok || bytes == 0) return;
  Guard guard;
  const uint64_t first = address / kPage;
  apply(first, (address + bytes + kPage - 1) / kPage - first);
}

// Another handler of SIGSEGV was installed over the watch's (Python's faulthandler.enable, as pytest
// calls it): put the watch's back on top, handing what it does not handle to that one.
__attribute__((visibility("default"))) void kvverify_watch_on_top() {
  if (!handlers_installed) return;
  struct sigaction now {};
  sigaction(SIGSEGV, nullptr, &now);
  if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_segv) return;
  if (nbeneath == kBeneath) return;
  beneath[nbeneath++] = old_segv;
  old_segv = now;
  struct sigaction ours {};
  ours.sa_sigaction = on_segv;
  ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_RESTART;
  sigemptyset(&ours.sa_mask);
  sigaction(SIGSEGV, &ours, nullptr);
}

// The handler put beneath by kvverify_watch_on_top is about to be taken away by its owner
// (faulthandler.disable, which puts back what it found: the watch's): hand it its place for that,
// and the watch chains to what was beneath it again.
__attribute__((visibility("default"))) void kvverify_watch_before_off() {
  if (!handlers_installed || nbeneath == 0) return;
  sigaction(SIGSEGV, &old_segv, nullptr);
  old_segv = beneath[--nbeneath];
}

// The watched intervals so far, merged: up to `capacity` (lo, hi) pairs into `out`; returns how
// many there are (more than `capacity`: call again with room).
__attribute__((visibility("default"))) int64_t kvverify_watch_covered(uint64_t* out, int64_t capacity) {
  if (g == nullptr) return 0;
  Guard guard;
  const int64_t n = static_cast<int64_t>(g->ncover);
  for (int64_t i = 0; i < std::min(n, capacity); ++i) out[2 * i] = g->cover[i].lo, out[2 * i + 1] = g->cover[i].hi;
  return n;
}

// Where the watch's time went since it started: [mprotect calls, their ns, faults handled, their
// ns, device ops looked at, their ns, driver queries of what memory an address is, their ns,
// completions followed, their ns].
__attribute__((visibility("default"))) void kvverify_watch_stats(uint64_t* out) {
  for (int k = 0; k < kStats; ++k) out[k] = stats[k].load(std::memory_order_relaxed);
}

// What could not be watched: [touches lost (no free record slot), device ranges past the pending
// table, pages past the page table, intervals past the coverage table, allocations too large for a
// kernel's whole-allocation watch, failed mprotect calls, faults opened without a single step].
__attribute__((visibility("default"))) void kvverify_watch_losses(uint64_t* out) {
  out[0] = touches_lost.load();
  out[1] = g ? g->overflow_pending : 0;
  out[2] = g ? g->overflow_pages : 0;
  out[3] = g ? g->overflow_cover : 0;
  out[4] = g ? g->large_skipped : 0;
  out[5] = g ? g->protect_failed : 0;
  out[6] = passes_untracked.load();
}

}  // extern "C"
