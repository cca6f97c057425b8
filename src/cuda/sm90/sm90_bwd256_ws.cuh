// sm_90a backward for D = 256, warp-specialised (the D = 256 backward on Hopper). The dK/dV
// kernel keeps the decomposition of the synchronous wgmma kernel it replaced (deleted since):
// one CTA per (64-key block, kv head), both consumer warpgroups own the same 64 keys and
// warpgroup c the dK/dV columns 128c..128c+127 (64 keys x 128 columns x 2 fp32 accumulators =
// 128 registers per thread); per 64-query block warpgroup c computes S^T and dP^T for queries
// 32c..32c+31 (64 x 32 x 256 products), P and dS for them, and the two warpgroups swap their
// P^T / dS^T A fragments through shared memory. The schedule is that of sm90_bwd_ws.cuh's
// kernel:
//   - producer warp 0 (setmaxnreg 24): TMA of K and V once, then per query block of the fixed
//     walk (query_walk_begin / seek_query_region, the same order as every dK/dV kernel, so dK/dV
//     stay bitwise reproducible) the Q and dO tiles by TMA and the lse2 / delta rows by cp.async,
//     on one full barrier per stage of a 2-deep ring, with a record (q head, count, position,
//     row) that the consumers read instead of the segment tables;
//   - consumer warpgroups 1, 2 (setmaxnreg 240): S^T and dP^T issued as two groups; P while dP^T
//     runs; P^T swapped (named barrier 1), dV += P^T dO issued; dS while dV runs; dS^T swapped
//     (named barrier 2), dK += dS^T Q; retire, release the stage. The two swaps replace the
//     synchronous kernel's one swap + __syncthreads: a warpgroup writes a swap buffer again only
//     after the other barrier, which the other warpgroup reaches after reading it, so one buffer
//     each suffices (ws_protocol_sim.py, run_d256).
// dQ: sm90_dq_ws.cuh's warp-specialised dQ pass (deterministic: no atomics). A variant with dQ
// fused into this kernel (bulk reductions, as sm90_bwd_ws.cuh's: twice their bytes per FLOP at
// this head dim) was slower and was deleted. Design: src/cuda/NOTES.md; shared memory, registers
// and tensor cycles: src/cuda/LAB_NOTEBOOK.md, "D = 256 warp-specialised backward".
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/epilogue.cuh"
#include "collective/query_walk.cuh"
#include "collective/score_mod.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/producers.cuh"
#include "sm90/warp_roles.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

struct DkdvWs256Cfg : WsRoles<24, 240> {
  static constexpr int D = 256;
  static constexpr int BN = 64;  // keys per CTA (both consumer warpgroups)
  static constexpr int BM = 64;  // queries per step; each warpgroup's S^T / dP^T covers 32
  static constexpr int HQ = BM / 2;
  static constexpr int DW = D / 2;  // dK/dV columns per consumer warpgroup
  static constexpr int STAGES = 2;
  // The producer's tiles and rows (DkdvSmem), and the two warpgroups' exchange buffers.
  using Tiles = DkdvTiles<BN, BM, D, STAGES>;
  struct SharedStorage {
    Tiles t;
    uint4 xpa[BM / 16][128];  // P^T A fragments, slice kt of thread t (of either warpgroup)
    uint4 xda[BM / 16][128];  // dS^T A fragments
    DkdvRows<BM, STAGES> r;
    uint64_t bar[1 + 2 * STAGES];  // kv, full[S], empty[S]
  };
  static constexpr int OFF_XPA = int(offsetof(SharedStorage, xpa));
  static constexpr int OFF_XDA = int(offsetof(SharedStorage, xda));
  static constexpr int OFF_ROWS = int(offsetof(SharedStorage, r));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
  static_assert(OFF_BAR % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(DW % 64 == 0, "a warpgroup's dK/dV columns are whole SW128 column blocks");
};

template <typename T, bool kCap>
__global__ void __launch_bounds__(384, 1)
    dkdv_ws256_kernel_sm90(const __grid_constant__ DkdvWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = DkdvWs256Cfg;
  constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN, HQ = Cfg::HQ, DW = Cfg::DW;
  constexpr int S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  const BwdParams& p = a.p;
  const DkdvSmem<Cfg> sm;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  // Each role decodes its key block after the split (cta_of): a value kept live across the
  // producer's setmaxnreg 24 was spilled to local memory (ptxas -v) and reloaded by the consumers
  // in every step.
  if (!KeyTileCta<BN>(p).valid) return;  // uniform over the CTA, before any barrier
  auto cta_of = [&]() { return KeyTileCta<BN>(p); };

  ws::init_barriers(tid, [&] { sm.init_ring(NC); });

  if (warp < 4) {
    // ---- producer: warp 0 walks the query blocks ---------------------------------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (warp == 0) {
      const KeyTileCta<BN> cta = cta_of();
      const int hk = cta.hk, k0 = cta.k0, ksi = cta.ksi;
      const int pk_first = cta.pk_first, pk_last = cta.pk_last;
      const Segment& kseg = cta.kseg;
      dkdv_producer_warp(a, sm, kseg, ksi, hk, k0, pk_first, pk_last, 0, lane, [&](QIter& cur) {
        // pk_last through an empty asm, so that nothing derived from it is kept live across
        // the loop (at 24 registers ptxas spilled it, as in dkdv_ws_kernel_sm90's producer).
        int pkl = pk_last;
        asm volatile("" : "+r"(pkl));
        return query_walk_next<BM>(p, kseg, ksi, pk_first, pkl, cur);
      });
    }
  } else {
    // ---- consumers ---------------------------------------------------------------------------
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const KeyTileCta<BN> cta = cta_of();
    const int hk = cta.hk, k0 = cta.k0, nk = cta.nk;
    const int pk_first = cta.pk_first, pk_last = cta.pk_last;
    const int cw = (warp >> 2) - 1;  // consumer warpgroup 0, 1
    const int t = tid & 127;
    const int g = lane >> 2, tq = lane & 3;
    const int kr0 = (warp & 3) * 16 + g;  // key rows kr0, kr0 + 8 (both warpgroups)
    const int col0 = cw * DW;             // first dK/dV column
    const int q_off = cw * HQ;            // first query of this warpgroup's S^T / dP^T
    const uint32_t half = uint32_t(col0 / 64) * (BM * 128);  // its column blocks of dO and Q
    constexpr int AR = DW / 2, HR = HQ / 2;
    float dk[AR], dv[AR];
    zero_frag(dk);
    zero_frag(dv);
    const float* lse_s = sm.lse();
    uint4* xpa = reinterpret_cast<uint4*>(sm.gbase + Cfg::OFF_XPA);
    uint4* xda = reinterpret_cast<uint4*>(sm.gbase + Cfg::OFF_XDA);
    // This warpgroup's HQ query columns of an S^T-shaped fragment f (P^T or dS^T) as bf16/fp16
    // A-fragment slices into the exchange buffer x, the named barrier `bar` of both warpgroups,
    // then all BM / 16 slices (both warpgroups' columns) back into a.
    auto swap_slices = [&](const float (&f)[HR], uint4* x, int bar, uint32_t (&a)[BM / 16][4]) {
#pragma unroll
      for (int kl = 0; kl < HQ / 16; ++kl) {
        uint32_t w[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) w[c] = pack2<T>(f[8 * kl + 2 * c], f[8 * kl + 2 * c + 1]);
        x[(cw * (HQ / 16) + kl) * 128 + t] = make_uint4(w[0], w[1], w[2], w[3]);
      }
      ws::bar_sync(bar, NC);
#pragma unroll
      for (int kt = 0; kt < BM / 16; ++kt) {
        const uint4 v = x[kt * 128 + t];
        a[kt][0] = v.x, a[kt][1] = v.y, a[kt][2] = v.z, a[kt][3] = v.w;
      }
    };
    // The swap, then acc += (the swapped fragment) B over this warpgroup's DW columns of B.
    auto swap_and_issue = [&](const float (&f)[HR], uint4* x, int bar, uint32_t (&a)[BM / 16][4],
                              float (&acc)[AR], uint32_t b) {
      swap_slices(f, x, bar, a);
      fence_regs(a, acc);
      wg_fence();
      wgmma_rs_acc<T, DW, BM>(acc, a, b);
      wg_commit();
    };

    ws::mbar_wait(sm.kv_bar, 0);
    for (int it = 0;; ++it) {
      const int s = Ring<S>::stage(it);
      int nq, pq_first;
      if (!sm.wait_block(s, it, nq, pq_first)) break;  // the end record
      const bool msk =
          needs_mask(nq, BM, nk, BN, pq_first, pq_first + nq - 1, pk_first, pk_last, p.mask);
      const uint32_t sQ = sm.q(s), sdO = sm.dout(s);
      const float* lse_c = lse_s + s * 2 * BM;
      const float* del_c = lse_c + BM;
      auto qc_of = [&](int i) { return q_off + (i >> 2) * 8 + 2 * tq + (i & 1); };
      auto visible = [&](int i) {
        const int kr = kr0 + ((i >> 1) & 1) * 8;
        return DUALKV_VISIBLE_KQ(p.mask, kr, nk, pk_first, qc_of(i), nq, pq_first);
      };

      // This thread's lse2 columns, read before the GEMMs are issued (read after the S^T wait,
      // the exponentials waited on the loads); not with softcap (register pressure).
      float lse_r[kCap ? 1 : HR / 2];
      if constexpr (!kCap) {
        frag_cols_load<HR>(lse_c + q_off, tq, lse_r);
        fence_regs(lse_r);
      }
      float sc[HR], dp[HR];
      wg_fence();
      wgmma_rows<T, HQ, D, BN, BM>(sc, sm.k, 0, sQ, q_off);
      wg_commit();
      wgmma_rows<T, HQ, D, BN, BM>(dp, sm.v, 0, sdO, q_off);
      wg_commit();
      wg_wait<1>();  // S^T done: P (and the softcap's derivative factor) while dP^T runs
      fence_regs(sc);
      float dc[kCap ? HR : 1];
#pragma unroll
      for (int i = 0; i < HR; ++i) {
        float dcap = 1.f;
        const float x = score_log2<kCap>(p, sc[i], dcap);
        if constexpr (kCap) {
          sc[i] = fast_exp2(x - lse_c[qc_of(i)]);
        } else {
          sc[i] = fast_exp2(x - lse_r[frag_col_slot(i)]);
        }
        if constexpr (kCap) dc[i] = dcap;
      }
      mask_fragment<HR>(msk, visible, [&](int i) { sc[i] = 0.f; });
      // This warpgroup's two 16-query slices of P^T to shared memory, then all four back.
      uint32_t pa[BM / 16][4];
      swap_and_issue(sc, xpa, 1, pa, dv, sdO + half);  // dV += P^T dO
      wg_wait<1>();                                    // dP^T done: dS while dV runs
      fence_regs(dp);
#pragma unroll
      for (int i = 0; i < HR; ++i) dp[i] = sc[i] * (dp[i] - del_c[qc_of(i)]) * (kCap ? dc[i] : 1.f);
      uint32_t da[BM / 16][4];
      swap_and_issue(dp, xda, 2, da, dk, sQ + half);  // dK += dS^T Q
      wg_wait<0>();  // dV, dK done: the stage (sQ, sdO, lse2/delta) is free
      fence_regs(dv, dk, pa, da);
      sm.release(s);
    }
    store_dkdv_rows<T, D, DW>(p, dk, dv, k0, nk, hk, kr0, col0, tq);
  }
#endif
}

}  // namespace dualkv::cuda::detail
