// The query walk of a key block's dK/dV CTA (the sm_80 and warp-specialised dK/dV kernels): which
// query blocks see the key block, in the fixed order that makes dK/dV deterministic (QIter,
// query_walk_begin / query_walk_next: collective/walks.h), and the sm_80 kernel's loads of its
// query blocks.
#pragma once

#include "collective/common.cuh"

namespace dualkv::cuda::detail {

// The sm_80 dK/dV kernel's cp.async of query block `it` (kv head hk) into stage `stage`: its Q
// and dO rows (tiles of QB bytes from sQ0 / sdO0, swz<D> layout) and its lse2 / delta rows
// (threads 0 .. 2 BM - 1; lse2[2][BM] then delta[2][BM] from sL0).
template <typename T, int BM, int D, int THREADS, int QB, bool kFresh = false>
__device__ __forceinline__ void load_query_block(const BwdParams& p, const QIter& it, int hk,
                                                 int tid, int stage, uint32_t sQ0, uint32_t sdO0,
                                                 uint32_t sL0) {
  const int h = hk * p.group + it.hi;
  const int qs = it.row(BM);
  const int nq = it.count(BM);
  load_q_do_rows<T, BM, D, THREADS, kFresh>(p, qs, nq, h, sQ0 + stage * QB, sdO0 + stage * QB);
  if (tid < 2 * BM) {
    const int r = tid % BM;
    const float* src = (tid < BM ? p.lse2 : p.delta) + int64_t(h) * p.T + qs + (r < nq ? r : 0);
    cp_async4(sL0 + ((tid < BM ? 0 : 2 * BM) + stage * BM + r) * 4, src, r < nq);
  }
}

}  // namespace dualkv::cuda::detail
