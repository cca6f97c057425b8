// TMA and bulk-copy wrappers of the sm_90a kernels (one thread issues them): 3-D tensor copies
// (cp.async.bulk.tensor) of column blocks into SW128 shared-memory tiles, completing on an
// mbarrier's transaction count, their cluster multicast, the tensor-map prefetch, and the bulk
// asynchronous fp32 reduction from shared to global memory with its commit / wait groups (the
// fused dQ's accumulation).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "sm90/sm90_common.cuh"

namespace dualkv::cuda::detail::ws {

#if DUALKV_SM90_BODY
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                          int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The NB column blocks of 64 from column col0 (coordinates {col, c1, c2}) of a tile into dst
// (SW128 blocks of ROWS x 128 bytes), completing on bar.
template <int NB, int ROWS>
__device__ __forceinline__ void tma_load3_cols(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                               int col0, int c1, int c2) {
#pragma unroll
  for (int c = 0; c < NB; ++c) tma_load3(dst + c * (ROWS * 128), map, bar, col0 + c * 64, c1, c2);
}
// The NB column blocks of 64 from column col0 (coordinates {col, c1, c2}) of two tiles that
// complete on the same barrier: map_a's into dst_a, map_b's into dst_b (SW128 blocks of ROWS x 128
// bytes), one block of each in turn.
template <int NB, int ROWS>
__device__ __forceinline__ void tma_load3_pair(uint32_t dst_a, const CUtensorMap* map_a,
                                               uint32_t dst_b, const CUtensorMap* map_b,
                                               uint32_t bar, int col0, int c1, int c2) {
#pragma unroll
  for (int c = 0; c < NB; ++c) {
    tma_load3(dst_a + c * (ROWS * 128), map_a, bar, col0 + c * 64, c1, c2);
    tma_load3(dst_b + c * (ROWS * 128), map_b, bar, col0 + c * 64, c1, c2);
  }
}
// The same copy delivered to the same shared-memory offsets of every CTA of the cluster in
// `cta_mask` (and completing on the barrier at the same offset in each).
__device__ __forceinline__ void tma_load3_multicast(uint32_t dst, const CUtensorMap* map,
                                                    uint32_t bar, int c0, int c1, int c2,
                                                    uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ void prefetch_tmap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// dst[0:bytes/4] += src[0:bytes/4] (fp32), asynchronously, with an L2 cache policy
// (createpolicy_evict_last) for the destination lines; bytes a multiple of 16.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes,
                                                    uint64_t policy) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, "
      "%3;" ::"l"(dst),
      "r"(src), "r"(bytes), "l"(policy)
      : "memory");
}
// An L2 policy that keeps the lines it is applied to ahead of normal ones when evicting.
__device__ __forceinline__ uint64_t createpolicy_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// This thread's committed bulk operations have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// ... and have completed.
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif  // DUALKV_SM90_BODY

}  // namespace dualkv::cuda::detail::ws
