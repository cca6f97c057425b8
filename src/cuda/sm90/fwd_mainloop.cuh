// The warp-specialised forwards' pieces, shared by sm90_fwd_ws.cuh (D <= 256) and
// sm90_fwd512_cluster.cuh: the parameter block with the TMA maps, the producer thread (Q once,
// then each key block's K and V through the stage ring, in the key walk's order) and the
// consumers' mainloop (S_j and P_{j-1} V_{j-1} issued together, the softmax of S_j overlapping
// P V), and the host's argument builder (make_fwd_ws_args: the tensor maps).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "collective/online_softmax.cuh"
#include "launch.h"
#include "sm90/pipeline.cuh"
#include "sm90/sm90_ws.h"
#include "sm90/tma.cuh"

namespace dualkv::cuda::detail {

// Kernel parameter block: the common parameters plus the TMA maps (by value, __grid_constant__).
struct FwdWsArgs {
  CUtensorMap tq, tk, tv;
  FwdParams p;
  int pingpong;
  int prescale;  // 1: scale the scores first (scale <= 0: the FFMA fold needs scale > 0)
};

#if DUALKV_SM90_BODY
// The warp-specialised forwards' producer (one thread): the Q tile (NQB column blocks from
// column qcol0 of query rows q0.., q head h, on bar_q), then per key block j of the walk its K
// and V tiles into ring stage Ring<S>::stage(j): each waits for the stage's release, expects
// KVB bytes on its full barrier and issues its copies through load_kv(map, stage tile, full
// barrier, first key row) (the kernel's own column blocks: all of them, or its column half).
template <int S, int NQB, int BM, int QB, int KVB, int BN, class FullK, class FullV, class EmptyK,
          class EmptyV, class LoadKV>
__device__ __forceinline__ void ws_fwd_producer(const FwdWsArgs& a, const KeyBlockWalk<BN>& walk,
                                                uint32_t sQ, uint32_t sK0, uint32_t sV0,
                                                uint32_t bar_q, int qcol0, int h, int q0,
                                                FullK&& full_k, FullV&& full_v, EmptyK&& empty_k,
                                                EmptyV&& empty_v, LoadKV&& load_kv) {
  ws::prefetch_tmap(&a.tq);
  ws::prefetch_tmap(&a.tk);
  ws::prefetch_tmap(&a.tv);
  ws::mbar_expect_tx(bar_q, QB);
  ws::tma_load3_cols<NQB, BM>(sQ, &a.tq, bar_q, qcol0, h, q0);
  for (int j = 0; j < walk.total; ++j) {
    const int s = Ring<S>::stage(j);
    const uint32_t ph = Ring<S>::empty_parity(j);
    const int row = int(walk.at(j).row());
    ws::mbar_wait(empty_k(s), ph);
    ws::mbar_expect_tx(full_k(s), KVB);
    load_kv(&a.tk, sK0 + s * KVB, full_k(s), row);
    ws::mbar_wait(empty_v(s), ph);
    ws::mbar_expect_tx(full_v(s), KVB);
    load_kv(&a.tv, sV0 + s * KVB, full_v(s), row);
  }
}

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

// The forwards' kernel arguments: the Q / K / V tensor maps (boxes of bm query and bn key rows
// of head dim d), the parameters, the ping-pong switch and whether the scores are pre-scaled.
// False (after the fallback warning) when a map cannot be encoded.
inline bool make_fwd_ws_args(FwdWsArgs& a, const FwdParams& p, const KernelPolicy& policy, int d,
                             int bm, int bn) {
  if (!encode_tmap_thd(&a.tq, p.q, p.T, p.Hq, d, p.q_tok, p.q_head, bm) ||
      !encode_tmap_thd(&a.tk, p.k, p.T, p.Hkv, d, p.k_tok, p.k_head, bn) ||
      !encode_tmap_thd(&a.tv, p.v, p.T, p.Hkv, d, p.v_tok, p.v_head, bn)) {
    warn_ws_fallback("cuTensorMapEncodeTiled failed or is unavailable");
    return false;
  }
  a.p = p;
  a.pingpong = policy.pingpong;
  a.prescale = !(p.scale_log2 > 0.f);
  return true;
}

}  // namespace dualkv::cuda::detail
