// The epilogues: a thread's rows of an output accumulator to global memory, for every kernel
// (sm_80 mma.sync and sm_90a wgmma fragments alike: element i = 4 nd + 2 r + {0, 1} of a thread
// (lane = 4 g + tq) holds row g + 8 r, columns nd * 8 + 2 * tq + {0, 1}; collective/fragment.cuh).
//   - store_out_rows: the forward's O / l and lse;
//   - store_dkdv_rows: dK (times the softmax scale) and dV;
//   - store_dq_rows: dQ (times the softmax scale).
// Each writes the thread's two rows row0 and row0 + 8 (when inside the tile's count), W columns
// from col0, as 32-bit pairs of T.
#pragma once

#include "collective/common.cuh"
#include "collective/fragment.cuh"

namespace dualkv::cuda::detail {

// Output rows row0 and row0 + 8 (queries q0 + row, of nq, q head h): O over the softmax sum to
// out, and lse = ln(sum) + the row max (m_run * m_scale, in log2 units) to lse. W < D: the
// accumulator holds the W columns from col0 (and `with_lse` says whether this thread's warp
// writes lse).
template <typename T, int D, int W = D, class Frag>
__device__ __forceinline__ void store_out_rows(const FwdParams& p, const Frag& o,
                                               const float (&m_run)[2], const float (&l_run)[2],
                                               float m_scale, int q0, int nq, int h, int row0,
                                               int tq, int col0 = 0, bool with_lse = true) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_run[r]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row0 + 8 * r;
    if (row < nq) {
      T* og = static_cast<T*>(p.out) + (int64_t(q0 + row) * p.Hq + h) * D + col0;
#pragma unroll
      for (int nd = 0; nd < W / 8; ++nd) {
        *reinterpret_cast<uint32_t*>(og + nd * 8 + 2 * tq) =
            pack2<T>(frag_at(o, nd * 4 + 2 * r) * inv, frag_at(o, nd * 4 + 2 * r + 1) * inv);
      }
      if (tq == 0 && with_lse) {
        p.lse[int64_t(h) * p.T + q0 + row] =
            l > 0.f ? (m_run[r] * m_scale + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
}

// dK and dV rows kr0 and kr0 + 8 (keys k0 + kr, of nk, kv head hk), their W columns from col0:
// dK takes the softmax scale.
template <typename T, int D, int W, class Frag>
__device__ __forceinline__ void store_dkdv_rows(const BwdParams& p, const Frag& dk, const Frag& dv,
                                                int k0, int nk, int hk, int kr0, int col0, int tq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int kr = kr0 + 8 * r;
    if (kr < nk) {
      const int64_t off = (int64_t(k0 + kr) * p.Hkv + hk) * D + col0 + 2 * tq;
      T* dkg = static_cast<T*>(p.dk) + off;
      T* dvg = static_cast<T*>(p.dv) + off;
#pragma unroll
      for (int nd = 0; nd < W / 8; ++nd) {
        *reinterpret_cast<uint32_t*>(dkg + nd * 8) = pack2<T>(
            frag_at(dk, nd * 4 + 2 * r) * p.scale, frag_at(dk, nd * 4 + 2 * r + 1) * p.scale);
        *reinterpret_cast<uint32_t*>(dvg + nd * 8) =
            pack2<T>(frag_at(dv, nd * 4 + 2 * r), frag_at(dv, nd * 4 + 2 * r + 1));
      }
    }
  }
}

// dQ rows row0 and row0 + 8 (queries q0 + row, of nq, q head h), W columns from col0, times the
// softmax scale; `any` = false writes zeros (an accumulator that no product has defined).
template <typename T, int D, int W, class Frag>
__device__ __forceinline__ void store_dq_rows(const BwdParams& p, const Frag& acc, int q0, int nq,
                                              int h, int row0, int col0, int tq, bool any = true) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row < nq) {
      T* dst = static_cast<T*>(p.dq) + (int64_t(q0 + row) * p.Hq + h) * D + col0 + 2 * tq;
#pragma unroll
      for (int nd = 0; nd < W / 8; ++nd) {
        *reinterpret_cast<uint32_t*>(dst + nd * 8) =
            pack2<T>(any ? frag_at(acc, nd * 4 + 2 * r) * p.scale : 0.f,
                     any ? frag_at(acc, nd * 4 + 2 * r + 1) * p.scale : 0.f);
      }
    }
  }
}

}  // namespace dualkv::cuda::detail
