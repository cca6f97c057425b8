// The score modifier and the fragment mask: what every kernel does to a raw product q.k of its
// S (or S^T) accumulator before the exponential, forward and backward, sm_80 and sm_90a.
//   - score_log2<kCap>: s -> the logit in log2 units, scale * s * log2(e), or with softcap c
//     c * tanh(scale * s / c) * log2(e); the backward form also returns the softcap's derivative
//     factor for dS (1 - tanh^2; 1 without softcap).
//   - the mask: whether an element's (query, key) pair is visible, always through
//     MaskRule::allowed (include/dualkv/mask.h) plus the block's bounds. Kernels ask only for
//     blocks that need it (KeyBlockWalk::masked, needs_mask).
#pragma once

#include "collective/common.cuh"

namespace dualkv::cuda::detail {

// Softcap c, in three steps (a kernel that keeps t between them calls them directly):
// t = tanh(scale * s / c), the logit c * t * log2(e), and its derivative factor 1 - t^2.
__device__ __forceinline__ float softcap_tanh(const Params& p, float s) {
  return tanhf(s * p.cap_inv);
}
__device__ __forceinline__ float softcap_logit(const Params& p, float t) { return p.cap_log2 * t; }
__device__ __forceinline__ float softcap_dfactor(float t) { return 1.f - t * t; }

// The forward's score modifier: the log2-domain logit of the raw product s.
template <bool kCap>
__device__ __forceinline__ float score_log2(const Params& p, float s) {
  if constexpr (kCap) {
    return p.cap_log2 * tanhf(s * p.cap_inv);  // = softcap_logit(p, softcap_tanh(p, s))
  } else {
    return s * p.scale_log2;
  }
}
// The backward's: the same logit, and in dcap the factor d(logit)/d(scaled score) that dS takes
// (1 - tanh^2 with softcap, 1 without).
template <bool kCap>
__device__ __forceinline__ float score_log2(const Params& p, float s, float& dcap) {
  if constexpr (kCap) {
    const float t = softcap_tanh(p, s);
    const float x = softcap_logit(p, t);
    dcap = softcap_dfactor(t);
    return x;
  } else {
    dcap = 1.f;
    return s * p.scale_log2;
  }
}

// The fragment mask of a query-major tile (forward, dQ): the query at logical position pq and key
// kr of key block kb (kr counted from the start of kb's region) is inside the region and allowed.
// Macros, not inline functions: the same predicate through a bool-returning inline function
// changed the schedule ptxas chose for the loops around it, and these pieces were made without
// changing any kernel's machine code.
#define DUALKV_VISIBLE(m, kb, pq, kr) ((kr) < (kb).R.len && (m).allowed((pq), (kb).R.pos0 + (kr)))
// The fragment mask of a key-major tile (dK/dV): key row kr of the nk keys at positions
// pk_first.., query column qc of the nq queries at positions pq_first...
#define DUALKV_VISIBLE_KQ(m, kr, nk, pk_first, qc, nq, pq_first) \
  ((kr) < (nk) && (qc) < (nq) && (m).allowed((pq_first) + (qc), (pk_first) + (kr)))

// The fragment mask over a whole fragment of N elements: apply(i) (e.g. s[i] = -inf, or
// p[i] = ds[i] = 0) for every element i that visible(i) rejects, behind one uniform branch on
// the block's `masked`. Kernels run it after the fragment's exponentials, never inside their
// loop: with the test inside, ptxas branched per element (in the dK/dV kernel those branches and
// their instruction-fetch stalls were ~10% of the consumers' issue slots).
template <int N, typename Visible, typename Apply>
__device__ __forceinline__ void mask_fragment(bool masked, Visible&& visible, Apply&& apply) {
  if (masked) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (!visible(i)) apply(i);
  }
}

}  // namespace dualkv::cuda::detail
