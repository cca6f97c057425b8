// The pipeline pieces of the sm_90a kernels: stages and phases of a ring of shared-memory buffers
// (Ring), the mbarrier operations that hand a stage between producer and consumers, named
// barriers (bar_sync / bar_arrive) and the ping-pong turns of the consumer warpgroups built on
// them (PingPong). Used by the warp-specialised kernels.
#pragma once

#include <cstdint>

#include "sm90/sm90_common.cuh"

namespace dualkv::cuda::detail {

// A ring of S stages that the blocks 0, 1, 2, ... of a walk pass through in order: block j uses
// stage j % S. An mbarrier completes one phase per use of its stage, so block j's full barrier has
// landed once the phase of parity (j / S) & 1 has completed; the producer refilling the stage for
// block j waits for the consumers' release of block j - S, the empty barrier's phase of the other
// parity (a fresh barrier counts its parity-1 phase as completed: the first pass does not wait).
template <int S>
struct Ring {
  static __device__ __forceinline__ int stage(int j) { return j % S; }
  static __device__ __forceinline__ uint32_t full_parity(int j) { return uint32_t(j / S) & 1u; }
  static __device__ __forceinline__ uint32_t empty_parity(int j) { return full_parity(j) ^ 1u; }
};

// Named barriers (id 1..15; 0 is __syncthreads): n threads, a multiple of 32, meet at `id`;
// bar_arrive counts without waiting (the producer side of a hand-off).
namespace ws {
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

#if DUALKV_SM90_BODY
// mbarriers in shared memory (8 bytes each; `bar` is the shared-memory address).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the barriers this thread initialised visible to the copy engine (async proxy) and to the
// cluster; the CTA (or cluster) synchronises after it.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  fence_proxy_async();
}
// A ring's barriers (thread 0, before mbar_init_fence): full(s) of S stages expecting
// full_count arrivals, empty(s) expecting empty_count (a stage's releases).
template <int S, class Full, class Empty>
__device__ __forceinline__ void ring_init(Full&& full, Empty&& empty, uint32_t full_count,
                                          uint32_t empty_count) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    mbar_init(full(s), full_count);
    mbar_init(empty(s), empty_count);
  }
}
// Thread 0 initialises the CTA's mbarriers (init()) and fences them; then the CTA synchronises, so
// that no thread uses a barrier before its initialisation. (The 2-CTA cluster kernels synchronise
// the cluster instead: Ws512Bars::init, FwdD512Bars.)
template <class Init>
__device__ __forceinline__ void init_barriers(int tid, Init&& init) {
  if (tid == 0) {
    init();
    mbar_init_fence();
  }
  __syncthreads();
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives on `bar` once this thread's earlier cp.async copies have landed (counts as one of the
// barrier's expected arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Blocks until the phase of parity `parity` has completed (a fresh barrier counts its phase of
// parity 1 as completed, so a producer's first pass through the ring does not wait). No watchdog:
// a clock64 timeout here made ptxas spill and serialise the wgmmas; the test scripts time out.
// SEM: the try_wait's semantics qualifier ("": the default, acquire at CTA scope).
#define DUALKV_MBAR_WAIT(SEM, bar, parity) \
  asm volatile(                            \
      "{\n.reg .pred P1;\nWAIT:\n"         \
      "mbarrier.try_wait.parity" SEM       \
      ".shared::cta.b64 P1, [%0], %1;\n"   \
      "@!P1 bra WAIT;\n}\n" ::"r"(bar),    \
      "r"(parity)                          \
      : "memory")
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  DUALKV_MBAR_WAIT("", bar, parity);
}
// The same wait with acquire at cluster scope: what a remote CTA wrote with st.async (completing
// on this barrier) is visible after it (the D = 512 backward's exchange).
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  DUALKV_MBAR_WAIT(".acquire.cluster", bar, parity);
}
// Arrives on the barrier at offset `bar` of cluster CTA `cta`. A consumer's release of a stage
// publishes no memory writes (its reads of the stage are wgmma operands, complete at its
// wait_group), so the default (.release.cta) semantics suffice, as in CUTLASS's pipelines; a
// .release.cluster arrive compiled to a MEMBAR.ALL.GPU per arrival.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}
#endif
}  // namespace ws

// Ping-pong of the NW consumer warpgroups (cw = 0 .. NW - 1) of a warp-specialised kernel: they
// take turns issuing their GEMMs in the order 0, 1, .., NW - 1, 0, .., so one's softmax work
// overlaps the others' tensor-core work. Warpgroup cw waits on named barrier 1 + cw, which the
// warpgroup before it arrives on after its turn: each barrier joins two warpgroups (NC = their
// threads), and since a warpgroup's next arrival needs a turn that needs this one's, no barrier
// is ever arrived on twice before its owner syncs (a named barrier completes on its thread count,
// so two arrivals from one warpgroup would complete a generation alone). `on` = false: no
// barriers at all (A/B). start() before the first turn (the last warpgroup lets warpgroup 0 go
// first), begin_turn() / end_turn() around each issue, finish() after the last (warpgroup 0
// takes the last warpgroup's last hand-over, so no barrier is left half-arrived; every warpgroup
// takes the same number of turns).
template <int NC, int NW = 2>
struct PingPong {
  static_assert(NW >= 2, "turns between two or more warpgroups");
  bool on;
  int cw, mine, other;  // this warpgroup, its barrier, the next one's
  __device__ __forceinline__ PingPong(bool on_, int cw_)
      : on(on_), cw(cw_), mine(1 + cw_), other(NW == 2 ? 2 - cw_ : 1 + (cw_ + 1) % NW) {}
  __device__ __forceinline__ void start() const {
    if (on && cw == NW - 1) ws::bar_arrive(other, NC);
  }
  __device__ __forceinline__ void begin_turn() const {
    if (on) ws::bar_sync(mine, NC);
  }
  __device__ __forceinline__ void end_turn() const {
    if (on) ws::bar_arrive(other, NC);
  }
  __device__ __forceinline__ void finish() const {
    if (on && cw == 0) ws::bar_sync(mine, NC);
  }
};

}  // namespace dualkv::cuda::detail
