// The warp-specialised forwards' consumer mainloop, shared by sm90_fwd_ws.cuh (D <= 256) and
// sm90_fwd512_cluster.cuh: S_j and P_{j-1} V_{j-1} issued together, the softmax of S_j
// overlapping P V, in the key walk's order through the stage ring.
#pragma once

#include <cstdint>

#include "collective/online_softmax.cuh"
#include "sm90/pipeline.cuh"

namespace dualkv::cuda::detail {

#if DUALKV_SM90_BODY
// The warp-specialised forwards' consumer mainloop over the walk's `total` key blocks (after the
// Q wait, inside the ping-pong's start/finish): block 0's S, then per block j the products
// S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together, block j's softmax overlapping P V, and
// the last block's P V. The kernel supplies its stage barriers (full_k/full_v(stage): the address
// waited on; release_k/release_v(stage): its consumers' release), the products (issue_s/issue_pv
// (stage), committed) and softmax(j, corr) (ws_fwd_block_softmax).
template <typename T, int S, int ND, int NC, int NW, int SR, int OR, int KT, class FullK,
          class FullV, class ReleaseK, class ReleaseV, class IssueS, class IssuePV, class Softmax>
__device__ __forceinline__ void ws_fwd_mainloop(
    int total, const PingPong<NC, NW>& pp, float (&s)[SR], float (&o)[OR], uint32_t (&pa)[KT][4],
    const float (&l_run)[2], FullK&& full_k, FullV&& full_v, ReleaseK&& release_k,
    ReleaseV&& release_v, IssueS&& issue_s, IssuePV&& issue_pv, Softmax&& softmax) {
  if (total <= 0) return;
  // Block 0: S only (O is still zero).
  ws::mbar_wait(full_k(0), 0);
  pp.begin_turn();
  wg_fence();
  issue_s(0);
  pp.end_turn();
  wg_wait<0>();
  fence_regs(s);
  release_k(0);
  float corr[2];
  softmax(0, corr);
  pack_a_frag<T>(pa, s);

  for (int j = 1; j < total; ++j) {
    const int st = Ring<S>::stage(j), pst = Ring<S>::stage(j - 1);
    ws::mbar_wait(full_k(st), Ring<S>::full_parity(j));
    ws::mbar_wait(full_v(pst), Ring<S>::full_parity(j - 1));
    pp.begin_turn();
    fence_regs(pa, o);
    wg_fence();
    issue_s(st);    // S_j = Q K_j^T
    issue_pv(pst);  // O += P_{j-1} V_{j-1}
    pp.end_turn();
    wg_wait<1>();  // S_j done; P V still in flight
    fence_regs(s);
    release_k(st);
    softmax(j, corr);
    // Keep the exp2s before the wait: ptxas hoists the wait over straight-line code, which
    // would stall on P V before the softmax instead of overlapping it. A branch on the row
    // sums (never taken: they are >= 0 or NaN) ends the basic block after the last exp2.
    fence_regs(s);
    if (l_run[0] + l_run[1] < 0.f) asm volatile("nanosleep.u32 0;");
    wg_wait<0>();
    fence_regs(o, pa);
    release_v(pst);
    rescale_o_rows<ND, false>(o, corr);
    pack_a_frag<T>(pa, s);
  }

  // Last block's P V.
  const int lst = Ring<S>::stage(total - 1);
  ws::mbar_wait(full_v(lst), Ring<S>::full_parity(total - 1));
  pp.begin_turn();
  fence_regs(pa, o);
  wg_fence();
  issue_pv(lst);
  pp.end_turn();
  wg_wait<0>();
  fence_regs(o, pa);
}
#endif  // DUALKV_SM90_BODY

}  // namespace dualkv::cuda::detail
