// Distributed shared memory of a 2-CTA cluster (sm_90a): the cluster barrier, the peer CTA's
// addresses, st.async stores that complete a barrier's transaction bytes there, and a consumer
// thread's words of an exchange buffer. Used by the cluster kernels (sm90_fwd_ws.cuh's multicast
// forward, sm90_fwd512_cluster.cuh, sm90_bwd512_ws.cuh) and tests/cuda/dsmem_bench.cu.
#pragma once

#include <cstdint>

#include "sm90/pipeline.cuh"

namespace dualkv::cuda::detail {
namespace ws {
#if DUALKV_SM90_BODY
// All threads of all CTAs of the cluster meet (and see each other's earlier writes).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// The shared::cluster address of the same offset in cluster CTA `cta`.
__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(cta));
  return r;
}
// 16 bytes to a (remote) shared::cluster address; they count as complete-tx bytes on the
// mbarrier at `rbar` (in the same CTA as the destination), with release semantics at cluster
// scope.
__device__ __forceinline__ void st_async_f32x4(uint32_t raddr, float a, float b, float c, float d,
                                               uint32_t rbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(raddr),
      "f"(a), "f"(b), "f"(c), "f"(d), "r"(rbar)
      : "memory");
}
__device__ __forceinline__ void st_async_f32(uint32_t raddr, float a, uint32_t rbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(raddr),
      "f"(a), "r"(rbar)
      : "memory");
}
__device__ __forceinline__ void st_async_f32x2(uint32_t raddr, float a, float b, uint32_t rbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(
          raddr),
      "f"(a), "f"(b), "r"(rbar)
      : "memory");
}
__device__ __forceinline__ void st_async_b32x4(uint32_t raddr, uint4 v, uint32_t rbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(raddr),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(rbar)
      : "memory");
}

// A consumer thread's words of its warpgroup's exchange buffer ([word][128 threads] 16-byte words,
// WS bytes apart), as few registers as possible: the word-0 address, the CTA's rank and the thread
// (the D = 512 mainloops hold O, S / dP and P fragments; everything else is an immediate offset
// from these or their mapa into the peer).
struct PeerWords {
  static constexpr uint32_t WS = 128 * 16;
  uint32_t xs;    // this thread's word 0 (shared::cta)
  uint32_t rank;  // this CTA's rank in the cluster
  int t;          // the thread in its warpgroup
  // The shared::cluster address of addr (a shared::cta address) in the peer.
  __device__ __forceinline__ uint32_t peer(uint32_t addr) const {
    return mapa_shared(addr, rank ^ 1u);
  }
  // Word w (off: bytes from this thread's word 0, e.g. another warpgroup's buffer).
  template <typename V>
  __device__ __forceinline__ V word(int w, int off = 0) const {
    static_assert(sizeof(V) == 16 || sizeof(V) == 8 || sizeof(V) == 4, "a 4, 8 or 16-byte word");
    V v;
    uint32_t* r = reinterpret_cast<uint32_t*>(&v);
    const uint32_t a = xs + uint32_t(off) + uint32_t(w) * WS;
    if constexpr (sizeof(V) == 16)
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(a)
                   : "memory");
    else if constexpr (sizeof(V) == 8)
      asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(a) : "memory");
    else
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r[0]) : "r"(a) : "memory");
    return v;
  }
  __device__ __forceinline__ void put(int w, uint4 v) const {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(xs + uint32_t(w) * WS), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
  // This warp has read its words of a phase: one arrival per warp on the barrier `bar` (a
  // shared::cta address) of the peer.
  __device__ __forceinline__ void free_peer(uint32_t bar) const {
    __syncwarp();
    if ((t & 31) == 0) mbar_arrive_cluster(bar, rank ^ 1u);  // maps bar into the peer
  }
};
#endif
}  // namespace ws
}  // namespace dualkv::cuda::detail
