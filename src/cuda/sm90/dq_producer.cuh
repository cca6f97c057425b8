// The producer thread of the warp-specialised dQ kernels (sm90_dq_ws.cuh, and per CTA of its
// cluster the D = 512 one in sm90_bwd512_ws.cuh): Q and dO of its query tile once, then each key
// block's K and V (in the forward's key walk) through the stage ring, by TMA.
#pragma once

#include <cstdint>

#include "sm90/pipeline.cuh"
#include "sm90/tma.cuh"

namespace dualkv::cuda::detail {

#if DUALKV_SM90_BODY
// The producer thread of the dQ kernels (dq_ws_kernel_sm90, and per CTA of its cluster the D = 512
// one: NB column blocks of 64 from col0): Q and dO of the CTA's queries once on bQ, then K and V
// of each key block of the walk: SV = 0, both through the S-stage ring (full / empty); SV > 0, K
// through it and V through a separate SV-stage ring (full_v / empty_v).
template <int BM, int BN, int S, int NB, int SV, class Args, class Walk, class Full, class Empty,
          class FullV, class EmptyV>
__device__ __forceinline__ void dq_producer_thread(const Args& a, const Walk& walk, int total,
                                                   int h, int hk, int q0, int col0, uint32_t sQ,
                                                   uint32_t sdO, uint32_t bQ, uint32_t sK0,
                                                   uint32_t sV0, Full full, Empty empty,
                                                   FullV full_v, EmptyV empty_v) {
  constexpr int Q_BYTES = BM * NB * 128, KV_BYTES = BN * NB * 128;
  ws::prefetch_tmap(&a.tk);
  ws::prefetch_tmap(&a.tv);
  ws::mbar_expect_tx(bQ, 2 * Q_BYTES);
  ws::tma_load3_pair<NB, BM>(sQ, &a.tq, sdO, &a.tdo, bQ, col0, h, q0);
  for (int j = 0; j < total; ++j) {
    const int s = Ring<S>::stage(j);
    const int row = int(walk.at(j).row());
    ws::mbar_wait(empty(s), Ring<S>::empty_parity(j));
    if constexpr (SV == 0) {
      ws::mbar_expect_tx(full(s), 2 * KV_BYTES);
      ws::tma_load3_pair<NB, BN>(sK0 + s * KV_BYTES, &a.tk, sV0 + s * KV_BYTES, &a.tv, full(s),
                                 col0, hk, row);
    } else {
      const int sv = Ring<SV>::stage(j);
      ws::mbar_expect_tx(full(s), KV_BYTES);
      ws::tma_load3_cols<NB, BN>(sK0 + s * KV_BYTES, &a.tk, full(s), col0, hk, row);
      ws::mbar_wait(empty_v(sv), Ring<SV>::empty_parity(j));
      ws::mbar_expect_tx(full_v(sv), KV_BYTES);
      ws::tma_load3_cols<NB, BN>(sV0 + sv * KV_BYTES, &a.tv, full_v(sv), col0, hk, row);
    }
  }
}
#endif

}  // namespace dualkv::cuda::detail
