// The online softmax of the forward kernels: per block of scores and per row of a thread's
// fragment, the new running max, the factor corr that rescales the running sum and O, the
// unnormalised probabilities (in place of the scores) and the running sum (log2 domain, exp2).
// The row's NT n-tiles hold elements 4 nt + 2 r + {0, 1} (collective/fragment.cuh); the four
// lanes of a quad share a row (quad_max). A row that has seen no visible key keeps max -inf and
// uses 0 in its exponents, so its probabilities are exactly 0 and corr = exp2(-inf) = 0.
#pragma once

#include "collective/common.cuh"
#include "collective/fragment.cuh"
#include "collective/score_mod.cuh"

namespace dualkv::cuda::detail {

// O *= corr on row r of a thread's O fragment (ND n-tiles).
template <int ND, class Frag>
__device__ __forceinline__ void rescale_o_row(Frag& o, int r, float corr) {
#pragma unroll
  for (int nd = 0; nd < ND; ++nd) {
    frag_at(o, nd * 4 + 2 * r) *= corr;
    frag_at(o, nd * 4 + 2 * r + 1) *= corr;
  }
}

// O *= corr[r] on both rows of a thread's O fragment; kVote: skipped where no row of the warp
// moved its max (corr exactly 1: online_softmax_row's kExactKeep).
template <int ND, bool kVote, class Frag>
__device__ __forceinline__ void rescale_o_rows(Frag& o, const float (&corr)[2]) {
  bool any = true;
  if constexpr (kVote) any = __any_sync(~0u, corr[0] != 1.f || corr[1] != 1.f);
  if (any) {
#pragma unroll
    for (int r = 0; r < 2; ++r) rescale_o_row<ND>(o, r, corr[r]);
  }
}

// v[0] = f over v[0..W) as a pairwise tree (a fixed order: ceil(log2 W) dependent steps).
template <int W, class F>
__device__ __forceinline__ float tree_reduce(float* v, F f) {
  if constexpr (W > 1) {
    constexpr int H = (W + 1) / 2;
#pragma unroll
    for (int i = 0; i < W / 2; ++i) v[i] = f(v[i], v[i + H]);
    return tree_reduce<H>(v, f);
  } else {
    return v[0];
  }
}

// One online-softmax step of row r over a block's NT n-tiles of scores s; returns corr.
//   kFold = false (sm_80): the scores are log2-domain logits already
//     (score_log2); l = l * corr, rescale_o(corr) runs, then l += each n-tile's p0 + p1.
//   kFold = true (warp-specialised sm_90a): the logits are s * sl (sl = scale * log2(e) folded into
//     one FFMA per element, or 1 after a pre-scale); l = l * corr + the block's sum; rescale_o
//     still runs right after corr (the warp-specialised kernel passes a no-op and rescales O after
//     its P V wait). kExactKeep: corr = 1 exactly when the row max did not move (lets a caller
//     skip the rescale). Its row max and sum are pairwise trees over the n-tiles (the serial
//     chains were the warp-specialised forward's latency-bound dependency).
template <int NT, bool kFold, bool kExactKeep = false, class Frag, class RescaleO>
__device__ __forceinline__ float online_softmax_row(Frag& s, int r, float& m_run, float& l_run,
                                                    float sl, RescaleO&& rescale_o) {
  float mx = m_run;
  if constexpr (kFold) {
    float t[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      t[nt] = fmaxf(frag_at(s, nt * 4 + 2 * r), frag_at(s, nt * 4 + 2 * r + 1));
    mx = fmaxf(mx, tree_reduce<NT>(t, [](float a, float b) { return fmaxf(a, b); }));
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      mx = fmaxf(mx, fmaxf(frag_at(s, nt * 4 + 2 * r), frag_at(s, nt * 4 + 2 * r + 1)));
  }
  mx = quad_max(mx);
  if constexpr (!kFold) {
    const float mu = mx == -INFINITY ? 0.f : mx;
    const float corr = fast_exp2(m_run - mu);
    m_run = mx;
    l_run *= corr;
    rescale_o(corr);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float p0 = fast_exp2(frag_at(s, nt * 4 + 2 * r) - mu),
                  p1 = fast_exp2(frag_at(s, nt * 4 + 2 * r + 1) - mu);
      frag_at(s, nt * 4 + 2 * r) = p0;
      frag_at(s, nt * 4 + 2 * r + 1) = p1;
      l_run += p0 + p1;
    }
    return corr;
  } else {
    const float mu = (mx == -INFINITY ? 0.f : mx) * sl;  // scaled max; 0 while the row saw nothing
    float corr = fast_exp2(fmaf(m_run, sl, -mu));        // m_run = -inf -> 0
    if constexpr (kExactKeep) {
      if (mx == m_run) corr = 1.f;  // exactly: the rescale may then be skipped
    }
    m_run = mx;
    rescale_o(corr);
    float t[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float p0 = fast_exp2(fmaf(frag_at(s, nt * 4 + 2 * r), sl, -mu));
      const float p1 = fast_exp2(fmaf(frag_at(s, nt * 4 + 2 * r + 1), sl, -mu));
      frag_at(s, nt * 4 + 2 * r) = p0;
      frag_at(s, nt * 4 + 2 * r + 1) = p1;
      t[nt] = p0 + p1;
    }
    l_run = l_run * corr + tree_reduce<NT>(t, [](float a, float b) { return a + b; });
    return corr;
  }
}

// The warp-specialised forwards' step (sm_90a WS and D = 512 cluster kernels) from key block kb's
// raw scores s (a thread's m64nBN fragment: rows at logical positions pq_row0 and pq_row0 + 8,
// columns 8 nt + 2 tq + {0, 1}) to its unnormalised probabilities, in place: the score modifier
// (kCap, or the pre-scale when sl = 1), the fragment mask (`masked`: KeyBlockWalk::masked) and
// the online softmax of both rows; corr[r] = the factor by which row r of O must be rescaled
// (the caller rescales after its P V wait). kExactKeep: corr = 1 exactly where the max did not
// move (online_softmax_row). ROWS = 1 (the D = 512 forward's half exchange): only the fragment's
// row-0 slots, holding the row at logical position pq_row0; the row-1 slots are left as they are.
template <int BN, bool kCap, bool kExactKeep, int ROWS = 2, int SR, int B>
__device__ __forceinline__ void ws_fwd_block_softmax(const Params& p, float (&s)[SR],
                                                     const KeyBlock<B>& kb, bool masked,
                                                     bool prescale, int pq_row0, int tq, float sl,
                                                     float (&m_run)[2], float (&l_run)[2],
                                                     float (&corr)[2]) {
  static_assert(ROWS == 1 || ROWS == 2, "one or both rows of the fragment");
  auto in_rows = [](int i) { return ROWS == 2 || (i & 2) == 0; };
  if (kCap || prescale) {
#pragma unroll
    for (int i = 0; i < SR; ++i)
      if (in_rows(i)) s[i] = score_log2<kCap>(p, s[i]);
  }
  if (masked) {
#pragma unroll
    for (int i = 0; i < SR; ++i) {
      const int nt = i >> 2, e = i & 3;
      const int pq = pq_row0 + (e >> 1) * 8;
      const int kr = kb.off + nt * 8 + 2 * tq + (e & 1);
      if (in_rows(i) && !DUALKV_VISIBLE(p.mask, kb, pq, kr)) s[i] = -INFINITY;
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
    corr[r] =
        online_softmax_row<BN / 8, true, kExactKeep>(s, r, m_run[r], l_run[r], sl, [](float) {});
}

}  // namespace dualkv::cuda::detail
