// DSMEM exchange microbenchmark (sm_90a): the partial-S exchange protocol of the D = 512 cluster
// forward (its whole-partial exchange of the fourth session; the kernel now runs the half
// exchange, FwdD512HalfExchange in src/cuda/sm90/sm90_fwd512_cluster.cuh) run alone, to tell
// whether that exchange is limited by the SM-to-SM network's bandwidth or by its latency.
//   dsmem_bench [ROUNDS [WORK]]   (defaults 4000 rounds, WORK = 256 dependent FMAs, ~1000 cycles)
// A grid of 2-CTA clusters, as many as can be co-resident (one CTA per SM: ~225 KB of shared
// memory, as the kernel), 2 "consumer" warpgroups per CTA. Each round, every warpgroup: arms its
// xfull (expect_tx MSG bytes), waits for xfree (the peer has read the previous round), sends MSG
// bytes to the same warpgroup of the peer CTA by st.async (16 B per thread per word), waits for
// the peer's MSG bytes on xfull, reads and checks them, arrives on the peer's xfree (one per
// warp), then WORK dependent FMAs (the GEMM time the exchange would hide behind).
// Acquire on xfull: "cluster" = ws::mbar_wait_cluster (try_wait.acquire.cluster, the kernel's;
// SASS: a CCTL.IVALL after the wait); "relax+fence" = wait_cluster_shared below
// (try_wait.relaxed.cluster + fence.acquire.sync_restrict::shared::cluster.cluster: the PTX ISA
// 8.6 acquire pattern restricted to shared memory, legal for data that st.async wrote into this
// CTA's shared memory; no CCTL.IVALL);
// "cta(ref)" = the default .acquire.cta try_wait, no fence: NOT a valid protocol under the PTX
// memory model (the release is by another CTA's thread), a timing reference only.
// Prints per configuration: cycles per round (clock64 of each warpgroup: mean, max), the
// aggregate bytes sent per second over the GPU, bytes sent per SM per cycle, and mismatches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sm90/dsmem.cuh"  // ws::mapa_shared, ws::st_async_f32x4 (+ pipeline.cuh)

using namespace dualkv::cuda::detail;

#if DUALKV_SM90_BODY
// The xfull wait with an acquire for shared memory only: the wait observes the phase completed by
// the peer's st.async complete-tx (a release at cluster scope); the relaxed cluster-scope wait +
// the acquire fence restricted to shared::cluster form an acquire pattern that orders this
// thread's later reads of its CTA's shared memory. On sm_90a the fence is no instruction.
__device__ __forceinline__ void wait_cluster_shared(uint32_t bar, uint32_t parity) {
  DUALKV_MBAR_WAIT(".relaxed.cluster", bar, parity);
  asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;" ::: "memory");
}
#endif

constexpr int kThreads = 256;                     // 2 warpgroups
constexpr int kSmem = 225 * 1024;                 // one CTA per SM, as the D = 512 forward
constexpr int kMaxVecs = 16;                      // 32 KB per warpgroup
constexpr int kBarOff = 2 * kMaxVecs * 128 * 16;  // after X[0], X[1]

template <int VECS, int ACQ>
__global__ void __launch_bounds__(kThreads, 1)
    dsmem_kernel(int rounds, int work, int exchange, long long* cycles, int* bad, float* sink) {
#if DUALKV_SM90_BODY
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr uint32_t BYTES = VECS * 128 * 16;
  const uint32_t base = smem_u32(smem);
  const int tid = int(threadIdx.x), w = tid >> 7, t = tid & 127;
  const uint32_t rank = blockIdx.x & 1u, peer = rank ^ 1u;
  const uint32_t xfull = base + kBarOff + 8u * w, xfree = base + kBarOff + 16u + 8u * w;
  if (tid == 0) {
    for (int i = 0; i < 2; ++i)
      ws::mbar_init(base + kBarOff + 8u * i, 1), ws::mbar_init(base + kBarOff + 16u + 8u * i, 4);
    ws::mbar_init_fence();
  }
  ws::cluster_sync();
  const uint32_t xoff = uint32_t(w * kMaxVecs * 128 * 16 + t * 16);
  const float4* mine = reinterpret_cast<const float4*>(smem + xoff);
  const uint32_t peer_x = ws::mapa_shared(base + xoff, peer);
  const uint32_t xfull_peer = ws::mapa_shared(xfull, peer);
  float acc = float(t);
  int nbad = 0;
  const long long c0 = clock64();
  for (int r = 0; r < rounds && exchange; ++r) {
    if (t == 0) ws::mbar_expect_tx(xfull, BYTES);
    ws::mbar_wait(xfree, (uint32_t(r) & 1u) ^ 1u);
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      const float f = float((r * 7 + i) & 1023);  // what the peer expects from this thread
      ws::st_async_f32x4(peer_x + uint32_t(i * 128 * 16), f, f + 1.f, f + 2.f, f + 3.f, xfull_peer);
    }
    if constexpr (ACQ == 0) ws::mbar_wait_cluster(xfull, uint32_t(r) & 1u);
    if constexpr (ACQ == 1) wait_cluster_shared(xfull, uint32_t(r) & 1u);
    if constexpr (ACQ == 2) ws::mbar_wait(xfull, uint32_t(r) & 1u);
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
      const float4 x = mine[i * 128];
      const float f = float((r * 7 + i) & 1023);
      nbad += (x.x != f) + (x.y != f + 1.f) + (x.z != f + 2.f) + (x.w != f + 3.f);
      acc += x.x;
    }
    __syncwarp();
    if ((t & 31) == 0) ws::mbar_arrive_cluster(xfree, peer);
    for (int k = 0; k < work; ++k) acc = fmaf(acc, 0.999f, 1.f);
  }
  for (int r = 0; r < rounds && !exchange; ++r)  // the work alone
    for (int k = 0; k < work; ++k) acc = fmaf(acc, 0.999f, 1.f);
  const long long c1 = clock64();
  if (t == 0) cycles[blockIdx.x * 2 + w] = (c1 - c0);
  if (nbad) atomicAdd(bad, nbad);
  sink[blockIdx.x * kThreads + tid] = acc;
  ws::cluster_sync();  // no CTA exits while its peer may still write to it
#endif
}

#define CK(x)                                                       \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

template <int VECS, int ACQ>
void run(int rounds, int work, int exchange, int sms, double clock_hz) {
  auto k = dsmem_kernel<VECS, ACQ>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = kSmem, cfg.attrs = &attr, cfg.numAttrs = 1;
  cfg.gridDim = dim3(2);
  int clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&clusters, k, &cfg));
  clusters = std::min(clusters, sms / 2);
  if (clusters < 1) {
    std::fprintf(stderr, "dsmem_bench: no 2-CTA cluster of %d bytes of shared memory fits\n",
                 kSmem);
    std::exit(1);
  }
  const int ctas = 2 * clusters;
  cfg.gridDim = dim3(ctas);
  long long* cyc;
  int* bad;
  float* sink;
  CK(cudaMalloc(&cyc, ctas * 2 * sizeof(long long)));
  CK(cudaMalloc(&bad, sizeof(int)));
  CK(cudaMalloc(&sink, size_t(ctas) * kThreads * sizeof(float)));
  CK(cudaMemset(bad, 0, sizeof(int)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaLaunchKernelEx(&cfg, k, rounds / 10 + 1, work, exchange, cyc, bad, sink));  // warm-up
  CK(cudaEventRecord(e0));
  CK(cudaLaunchKernelEx(&cfg, k, rounds, work, exchange, cyc, bad, sink));
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<long long> c(size_t(ctas) * 2);
  int nbad = 0;
  CK(cudaMemcpy(c.data(), cyc, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&nbad, bad, sizeof(int), cudaMemcpyDeviceToHost));
  double sum = 0, mx = 0;
  for (long long v : c) sum += double(v) / rounds, mx = std::max(mx, double(v) / rounds);
  const double mean = sum / double(c.size());
  const double msg = VECS * 128 * 16;
  const char* acq[] = {"cluster", "relax+fence", "cta(ref)"};
  if (exchange) {
    const double bytes = double(ctas) * 2 * msg * rounds;  // sent, both directions
    std::printf("%6.0f %6d %-12s %4d %9.0f %9.0f %9.1f %10.1f %10.1f %6d\n", msg / 1024, work,
                acq[ACQ], ctas, mean, mx, bytes / (ms * 1e-3) / 1e9, 2 * msg / mean,
                2 * msg / (ms * 1e-3 / rounds * clock_hz), nbad);
  } else {
    std::printf("%6s %6d %-12s %4d %9.0f %9.0f %9s %10s %10s %6s\n", "-", work, "work only", ctas,
                mean, mx, "-", "-", "-", "-");
  }
  CK(cudaFree(cyc));
  CK(cudaFree(bad));
  CK(cudaFree(sink));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

template <int VECS>
void sizes(int rounds, int work, int sms, double hz) {
  run<VECS, 0>(rounds, work, 1, sms, hz);
  run<VECS, 1>(rounds, work, 1, sms, hz);
  run<VECS, 2>(rounds, work, 1, sms, hz);
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 4000;
  const int fmas = argc > 2 ? std::atoi(argv[2]) : 256;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "dsmem_bench: needs an sm_90 GPU (found %s, %d.%d)\n", prop.name,
                 prop.major, prop.minor);
    return 2;
  }
  int khz = 0;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const double hz = khz * 1e3;
  std::printf("dsmem_bench: %s, %d SMs, %.0f MHz (max clock; B/clk/SM(wall) uses it), %d rounds\n",
              prop.name, prop.multiProcessorCount, hz / 1e6, rounds);
  std::printf("%6s %6s %-12s %4s %9s %9s %9s %10s %10s %6s\n", "KB/wg", "FMAs", "acquire", "CTAs",
              "cyc/rnd", "max", "GB/s", "B/clk/SM", "B/clk(wall)", "bad");
  const int sms = prop.multiProcessorCount;
  for (int work : {0, fmas}) {
    run<8, 0>(rounds, work, 0, sms, hz);
    sizes<2>(rounds, work, sms, hz);
    sizes<4>(rounds, work, sms, hz);
    sizes<8>(rounds, work, sms, hz);
    sizes<16>(rounds, work, sms, hz);
  }
  return 0;
}
