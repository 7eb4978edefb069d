// Both directions at once on the SM-kernel copy path: which launch shape gets 16 KiB pages closest
// to the link's ~97 GB/s both ways (issue 14; results and reading in docs/bench.md, "Both
// directions at 16 KiB"). An experiment, not kvverify's kernel (csrc/op/copy_kernel.cu): its copy loop
// is that kernel's 16-byte path with the threads per block and loads in flight as template
// parameters, beside the driver's batch and a contiguous copy for scale. CUDA runtime only:
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o duplex_probe benchmarks/duplex_probe.cu && ./duplex_probe
//
// Pinned pools of 2 GiB, H2D between the first halves and D2H between the second halves of the two
// pools, 4 calls of 4096 scattered 16 KiB pages per direction, event-timed, median of 6 reps after
// a warm-up; per stream GB/s is its bytes over its own finish time.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#include <string>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

// Chunk c of descriptor table d (n chunks: sources, destinations, sizes): 16-byte pairs, F loads in
// flight per thread of T; STREAMING: evict-first loads and stores (__ldcs/__stcs).
template <int T, int F, bool STREAMING>
__device__ __forceinline__ void copy_chunk(const int64_t* __restrict__ d, uint32_t n, uint32_t c) {
  const ulonglong2* s = reinterpret_cast<const ulonglong2*>(d[c]);
  ulonglong2* o = reinterpret_cast<ulonglong2*>(d[n + c]);
  uint32_t pairs = static_cast<uint32_t>(d[2 * n + c]) / 16;
  uint32_t k = threadIdx.x;
  for (; k + (F - 1) * T < pairs; k += F * T) {
    ulonglong2 v[F];
#pragma unroll
    for (int u = 0; u < F; ++u) v[u] = STREAMING ? __ldcs(s + k + u * T) : s[k + u * T];
#pragma unroll
    for (int u = 0; u < F; ++u) {
      if (STREAMING) __stcs(o + k + u * T, v[u]); else o[k + u * T] = v[u];
    }
  }
  for (; k < pairs; k += T) o[k] = s[k];
}

// Block b copies chunks b, b + gridDim.x, ... (kvverify's kernel walks its chunks the same way).
template <int T, int F, bool STREAMING = false>
__global__ void __launch_bounds__(T) copy_k(const int64_t* __restrict__ d, uint32_t n) {
  for (uint32_t c = blockIdx.x; c < n; c += gridDim.x) copy_chunk<T, F, STREAMING>(d, n, c);
}

__device__ __forceinline__ unsigned smid() { unsigned r; asm volatile("mov.u32 %0, %%smid;" : "=r"(r)); return r; }
// Two chunk lists (H2D, D2H); a block takes work from list 0 if its SM id < split, else list 1,
// through one atomic counter per list; when its list is empty it helps with the other.
template <int T, int F>
__global__ void __launch_bounds__(T) part_k(const int64_t* __restrict__ d0, uint32_t n0, const int64_t* __restrict__ d1, uint32_t n1, unsigned split, unsigned* ctr) {
  __shared__ uint32_t cs;
  int role = smid() < split ? 0 : 1;
  for (int pass = 0; pass < 2; ++pass, role ^= 1) {
    const int64_t* d = role ? d1 : d0; uint32_t n = role ? n1 : n0;
    for (;;) {
      if (threadIdx.x == 0) cs = atomicAdd(ctr + role, 1u);
      __syncthreads();
      uint32_t c = cs;
      __syncthreads();
      if (c >= n) break;
      copy_chunk<T, F, false>(d, n, c);
    }
  }
}

// TMA bulk copies: global -> shared -> global, one page (<= 16 KiB, multiple of 16) per step, thread 0
// issues, an mbarrier tracks the load's bytes; PAGE_SMEM bytes of shared memory per block.
constexpr int PAGE_SMEM = 16384;
__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__global__ void __launch_bounds__(32) tma_k(const int64_t* __restrict__ d, uint32_t n) {
  __shared__ alignas(128) unsigned char buf[PAGE_SMEM];
  __shared__ alignas(8) uint64_t bar;
  if (threadIdx.x != 0) return;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(&bar)), "r"(1));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t phase = 0;
  for (uint32_t c = blockIdx.x; c < n; c += gridDim.x) {
    const uint64_t src = static_cast<uint64_t>(d[c]);
    const uint64_t dst = static_cast<uint64_t>(d[n + c]);
    const uint32_t bytes = static_cast<uint32_t>(d[2 * n + c]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(&bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sa(buf)), "l"(src), "r"(bytes), "r"(sa(&bar)) : "memory");
    asm volatile("{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}"
                 :: "r"(sa(&bar)), "r"(phase) : "memory");
    phase ^= 1;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(sa(buf)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

typedef void (*KFn)(const int64_t*, uint32_t);
struct Kern { const char* name; KFn fn; int threads; };
static Kern kerns[] = {
  {"t256f4", copy_k<256, 4>, 256}, {"t256f2", copy_k<256, 2>, 256}, {"t256f1", copy_k<256, 1>, 256}, {"t512f2", copy_k<512, 2>, 512}, {"t256f8", copy_k<256, 8>, 256},
  {"t128f4", copy_k<128, 4>, 128}, {"t512f4", copy_k<512, 4>, 512}, {"t1024f1", copy_k<1024, 1>, 1024},
  {"cs256f4", copy_k<256, 4, true>, 256}, {"tma", tma_k, 32},
};
Kern* find(const char* n) { for (auto& k : kerns) if (std::string(k.name) == n) return &k; printf("no kernel %s\n", n); exit(1); }

const size_t POOL = 2ull << 30, HALF = POOL / 2;
char *host, *dev;
const size_t PAGE = 16 << 10;
const int PAGES = 4096, CALLS = 4, REPS = 7;
int sms;

struct Call { std::vector<int64_t> desc; int64_t* ddesc; std::vector<void*> s, d; std::vector<size_t> sz; };

Call make(std::mt19937_64& rng, bool h2d, size_t off, int pages = PAGES, size_t page = PAGE) {
  Call c;
  size_t slots = HALF / page;
  std::vector<int64_t> a(slots), b(slots);
  for (size_t i = 0; i < slots; ++i) a[i] = b[i] = i;
  std::shuffle(a.begin(), a.end(), rng); std::shuffle(b.begin(), b.end(), rng);
  char* sb = (h2d ? host : dev) + off; char* db = (h2d ? dev : host) + off;
  c.desc.resize(3 * pages);
  for (int i = 0; i < pages; ++i) {
    c.s.push_back(sb + a[i] * page); c.d.push_back(db + b[i] * page); c.sz.push_back(page);
    c.desc[i] = (int64_t)c.s.back(); c.desc[pages + i] = (int64_t)c.d.back(); c.desc[2 * pages + i] = page;
  }
  CK(cudaMalloc(&c.ddesc, c.desc.size() * 8));
  CK(cudaMemcpy(c.ddesc, c.desc.data(), c.desc.size() * 8, cudaMemcpyHostToDevice));
  return c;
}
Call fuse(const Call& x, const Call& y) {  // interleave the chunks of two calls into one launch
  Call c; int n = x.s.size() + y.s.size();
  for (size_t i = 0; i < x.s.size(); ++i) { c.s.push_back(x.s[i]); c.d.push_back(x.d[i]); c.sz.push_back(x.sz[i]); c.s.push_back(y.s[i]); c.d.push_back(y.d[i]); c.sz.push_back(y.sz[i]); }
  c.desc.resize(3 * n);
  for (int i = 0; i < n; ++i) { c.desc[i] = (int64_t)c.s[i]; c.desc[n + i] = (int64_t)c.d[i]; c.desc[2 * n + i] = c.sz[i]; }
  CK(cudaMalloc(&c.ddesc, c.desc.size() * 8));
  CK(cudaMemcpy(c.ddesc, c.desc.data(), c.desc.size() * 8, cudaMemcpyHostToDevice));
  return c;
}

cudaStream_t s1, s2;
cudaEvent_t e0, e1, e2;

void kernel(const Kern* k, int grid, const Call& c, cudaStream_t s) {
  int n = c.s.size();
  k->fn<<<std::min(grid, n), k->threads, 0, s>>>(c.ddesc, n);
}
void batch(const Call& c, cudaStream_t s) {
  cudaMemcpyAttributes a = {};
  a.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t idx = 0;
  CK(cudaMemcpyBatchAsync((void* const*)c.d.data(), (const void* const*)c.s.data(), c.sz.data(), c.s.size(), &a, &idx, 1, s));
}

// A duplex run: `a` calls on s1, `b` calls on s2 (either may be empty), started by one event.
// Prints total GB/s and each side's own GB/s (its bytes over its own finish time).
template <class FA, class FB>
void duplex(const char* label, FA fa, size_t abytes, FB fb, size_t bbytes) {
  std::vector<double> tot, ra, rb;
  for (int r = 0; r < REPS; ++r) {
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(e0, s1));
    CK(cudaStreamWaitEvent(s2, e0));
    fa(s1); fb(s2);
    CK(cudaEventRecord(e1, s1)); CK(cudaEventRecord(e2, s2));
    CK(cudaDeviceSynchronize());
    float ta = 0, tb = 0; CK(cudaEventElapsedTime(&ta, e0, e1)); CK(cudaEventElapsedTime(&tb, e0, e2));
    if (r == 0) continue;  // warm-up
    double t = std::max(abytes ? ta : 0.f, bbytes ? tb : 0.f);
    tot.push_back((abytes + bbytes) / (t * 1e6)); ra.push_back(abytes ? abytes / (ta * 1e6) : 0); rb.push_back(bbytes ? bbytes / (tb * 1e6) : 0);
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  printf("%-44s total %6.1f GB/s   s1 %6.1f   s2 %6.1f\n", label, med(tot), med(ra), med(rb));
  fflush(stdout);
}

int main(int argc, char** argv) {
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaHostAlloc((void**)&host, POOL, cudaHostAllocMapped));
  CK(cudaMalloc(&dev, POOL));
  memset(host, 0x5a, POOL); CK(cudaMemset(dev, 0xa5, POOL));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); CK(cudaEventCreate(&e2));
  std::mt19937_64 rng(1);
  std::vector<Call> H, D, F;
  for (int i = 0; i < CALLS; ++i) { H.push_back(make(rng, true, 0)); D.push_back(make(rng, false, HALF)); F.push_back(fuse(H.back(), D.back())); }
  const size_t B = (size_t)CALLS * PAGES * PAGE;
  int G = sms * 4;
  printf("SMs %d, 16 KiB pages, %d pages/call, %d calls per direction\n", sms, PAGES, CALLS);
  auto none = [](cudaStream_t) {};
  auto K = [&](const char* kn, int grid, std::vector<Call>& cs) { Kern* k = find(kn); return [=, &cs](cudaStream_t s) { for (auto& c : cs) kernel(k, grid, c, s); }; };
  auto Bt = [&](std::vector<Call>& cs) { return [&cs](cudaStream_t s) { for (auto& c : cs) batch(c, s); }; };

  duplex("kernel t256f4 H2D alone", K("t256f4", G, H), B, none, 0);
  duplex("kernel t256f4 D2H alone", none, 0, K("t256f4", G, D), B);
  duplex("batch H2D alone", Bt(H), B, none, 0);
  duplex("batch D2H alone", none, 0, Bt(D), B);
  duplex("batch both", Bt(H), B, Bt(D), B);
  char label[128];
  // two kernels on two streams, each shape with half of the device's threads
  for (const char* kn : {"t256f4", "t256f2", "t256f1", "t256f8", "t128f4", "t512f4", "t1024f1", "cs256f4"}) {
    Kern* k = find(kn);
    int g = sms * (2048 / k->threads) / 2;
    snprintf(label, sizeof label, "two streams %s grid %d/%d", kn, g, g);
    duplex(label, K(kn, g, H), B, K(kn, g, D), B);
  }
  // the same with one direction given fewer blocks
  for (int dg : {G / 2, G / 4, G / 8, sms / 4}) {
    snprintf(label, sizeof label, "two streams t256f4 grid H %d / D %d", G, dg);
    duplex(label, K("t256f4", G, H), B, K("t256f4", dg, D), B);
  }
  for (int hg : {G / 2, G / 4}) {
    snprintf(label, sizeof label, "two streams t256f4 grid H %d / D %d", hg, G);
    duplex(label, K("t256f4", hg, H), B, K("t256f4", G, D), B);
  }
  // one launch, H2D and D2H pages interleaved
  for (const char* kn : {"t256f4", "t256f2", "t256f1", "t512f2", "t1024f1"}) {
    Kern* k = find(kn);
    for (int bps : {1, 2, 4, 8}) {
      int g = sms * bps;
      if (g * k->threads > sms * 2048) continue;
      snprintf(label, sizeof label, "one launch %s grid %d", kn, g);
      duplex(label, K(kn, g, F), 2 * B, none, 0);
    }
  }
  // one launch, each SM's blocks on one direction (SM id below the split: H2D)
  unsigned* ctr; CK(cudaMalloc(&ctr, 8 * CALLS));
  for (int tb : {2, 4, 8}) for (unsigned split : {66u, 80u, 92u, 106u}) {
    int g = sms * tb;
    snprintf(label, sizeof label, "one launch by SM t256f2 grid %d H2D SMs %u", g, split);
    auto P = [&, g, split](cudaStream_t s) {
      CK(cudaMemsetAsync(ctr, 0, 8 * CALLS, s));
      for (int i = 0; i < CALLS; ++i)
        part_k<256, 2><<<g, 256, 0, s>>>(H[i].ddesc, PAGES, D[i].ddesc, PAGES, split, ctr + 2 * i);
    };
    duplex(label, P, 2 * B, none, 0);
  }
  // the Tensor Memory Accelerator's bulk copies through shared memory, one warp per block
  duplex("tma H2D alone grid 1056", K("tma", 1056, H), B, none, 0);
  duplex("tma D2H alone grid 1056", none, 0, K("tma", 1056, D), B);
  for (int g : {528, 1056, 2112}) {
    snprintf(label, sizeof label, "tma one launch grid %d", g);
    duplex(label, K("tma", g, F), 2 * B, none, 0);
    snprintf(label, sizeof label, "tma two streams grid %d/%d", g, g);
    duplex(label, K("tma", g, H), B, K("tma", g, D), B);
  }
  duplex("tma H2D 1056 + kernel D2H 528", K("tma", 1056, H), B, K("t256f4", G, D), B);
  duplex("kernel H2D 528 + tma D2H 1056", K("t256f4", G, H), B, K("tma", 1056, D), B);
  // a kernel one way, the driver's batch the other
  duplex("kernel H2D + batch D2H", K("t256f4", G, H), B, Bt(D), B);
  duplex("batch H2D + kernel D2H", Bt(H), B, K("t256f4", G, D), B);
  // the ceiling: contiguous copies both ways
  auto CH = [&](cudaStream_t s) { CK(cudaMemcpyAsync(dev, host, B, cudaMemcpyHostToDevice, s)); };
  auto CD = [&](cudaStream_t s) { CK(cudaMemcpyAsync(host + HALF, dev + HALF, B, cudaMemcpyDeviceToHost, s)); };
  duplex("contiguous memcpy both", CH, B, CD, B);
  return 0;
}
