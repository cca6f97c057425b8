// TMA and bulk-copy wrappers of the sm_90a kernels (one thread issues them): 3-D tensor copies
// (cp.async.bulk.tensor) of column blocks into SW128 shared-memory tiles, completing on an
// mbarrier's transaction count, their cluster multicast, and the tensor-map prefetch.
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
#endif  // DUALKV_SM90_BODY

}  // namespace dualkv::cuda::detail::ws
