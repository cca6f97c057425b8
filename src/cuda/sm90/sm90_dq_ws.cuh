// Warp-specialised sm_90a dQ pass: the separate dQ pass of the Hopper backward at D <= 128
// (deterministic=True, or DUALKV_FUSED_DQ=0 for A/B) and the one at D = 256 (BN = 32);
// bitwise reproducible, no atomics. One CTA per (128-query tile, q head) walks the key blocks as
// the forward does, with the forward's warp specialisation: a producer thread issues
// TMA for Q and dO once and K/V blocks through a STAGES-deep ring; two consumer warpgroups of 64
// query rows. Per block j, one issue turn: dQ += dS_{j-1} K_{j-1}, S_j = Q K_j^T and
// dP_j = dO V_j^T as three wgmma groups back to back; P_j is computed while dP_j runs, then dS_j.
// Ping-pong (named barriers 1, 2, as in the forward): the two consumer warpgroups take turns
// issuing, so one's exp2/dS work overlaps the other's GEMMs (DUALKV_SM90_PINGPONG=0: off).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/epilogue.cuh"
#include "collective/score_mod.cuh"
#include "launch.h"
#include "sm90/pipeline.cuh"
#include "sm90/producers.cuh"
#include "sm90/sm90_ws.h"
#include "sm90/warp_roles.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

template <int D>
struct DqWsCfg : WsRoles<40, 232> {
  static constexpr int BM = kTileSize;  // 2 consumer warpgroups x 64 queries
  static constexpr int BN = D >= 256 ? 32 : 64;
  // The consumers hold two stages (K_{j-1} for the deferred dQ product, and block j), so a third
  // keeps one load in flight; at D = 256 it still fits (Q + dO 128 KB + 3 x 32 KB).
  static constexpr int STAGES = 3;
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the tiles are 128B-swizzled (SW128), the OFF_* offsets come from here.
  struct SharedStorage {
    uint16_t q[BM * D];
    uint16_t dout[BM * D];
    uint16_t k[STAGES][BN * D];
    uint16_t v[STAGES][BN * D];
    uint64_t bar_q, full[STAGES], empty[STAGES];  // mbarriers
  };
  static_assert(sizeof(SharedStorage::q) == Q_BYTES && sizeof(SharedStorage::k[0]) == KV_BYTES);
  static constexpr int OFF_DO = int(offsetof(SharedStorage, dout));
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar_q));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
};

template <typename T, int D, bool kCap>
__global__ void __launch_bounds__(384, 1) dq_ws_kernel_sm90(const __grid_constant__ DqWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = DqWsCfg<D>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  const BwdParams& p = a.p;
  const SmemBase sm;
  const uint32_t sQ = sm.base, sdO = sm.base + Cfg::OFF_DO, sK0 = sm.base + Cfg::OFF_K,
                 sV0 = sm.base + Cfg::OFF_V;
  const uint32_t bQ = sm.base + Cfg::OFF_BAR;
  auto full = [&](int s) { return bQ + 8u * (1 + s); };
  auto empty = [&](int s) { return bQ + 8u * (1 + S + s); };

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const QueryTileCta<kTileSize> cta(p);
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;
  const Segment& seg = cta.seg;

  const KeyBlockWalk<BN> walk(p, seg, q0, nq);
  const int total = walk.total, pq_first = walk.pq_first;

  if (tid == 0) {
    ws::mbar_init(bQ, 1);
    ws::ring_init<S>(full, empty, 1, NC);
    ws::mbar_init_fence();
  }
  __syncthreads();

  if (warp < 4) {
    // ---- producer warpgroup: one thread issues every copy ------------------------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (tid == 0) {
      dq_producer_thread<BM, BN, S, D / 64, 0>(a, walk, total, h, hk, q0, 0, sQ, sdO, bQ, sK0, sV0,
                                               full, empty, full, empty);
    }
  } else {
    // ---- consumer warpgroups -----------------------------------------------------------------
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const int cw = (warp >> 2) - 1;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = cw * 64 + (warp & 3) * 16 + g;  // rows row0, row0 + 8
    float lse2[2], del[2];
    load_row_stats(p, h, q0, nq, row0, lse2, del);
    constexpr int AR = D / 2, SR = BN / 2;
    float acc[AR];  // defined by the first dQ product (zero when no key block is seen)
    float sc[SR], dp[SR];
    uint32_t da[BN / 16][4];

    const PingPong<NC> pp(a.pingpong != 0, cw);
    // dQ += dS_j K_j (dS_j in da, K_j in stage st); the first product overwrites acc: a zero fill
    // before the loop would be a non-wgmma definition of an accumulator in flight across the back
    // edge (ptxas then serialises every wgmma).
    auto issue_dq = [&](int j, int st) {
      const uint32_t sK = sK0 + st * Cfg::KV_BYTES;
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt)
        Wgmma<T, D>::template rs<1>(acc, da[kt], desc_mnmajor<BN>(sK, kt * 16), j > 0 || kt > 0);
      wg_commit();
    };

    // S_j = Q K_j^T and dP_j = dO V_j^T (K_j, V_j in stage st), two groups.
    auto issue_sdp = [&](int st) {
      wgmma_rows<T, BN, D, BM, BN>(sc, sQ, cw * 64, sK0 + st * Cfg::KV_BYTES, 0);
      wg_commit();
      wgmma_rows<T, BN, D, BM, BN>(dp, sdO, cw * 64, sV0 + st * Cfg::KV_BYTES, 0);
      wg_commit();
    };
    // After block j's turn: wait for dQ_{j-1} and S_j (then stage j-1 is free), P_j while dP_j
    // runs, then dS_j into da.
    auto process = [&](int j) {
      // Pending: dQ_{j-1}, S_j, dP_j. Waiting down to one leaves only dP_j running.
      wg_wait<1>();
      fence_regs(sc);
      fence_regs(da);  // dQ_{j-1} read them: keep them untouched until here
      if (j > 0) ws::mbar_arrive(empty(Ring<S>::stage(j - 1)));  // dQ_{j-1} has read K_{j-1}

      const auto kb = walk.at(j);
      const bool msk = walk.masked(kb, nq, BM, p.mask);
      float dcap[kCap ? SR : 1];
#pragma unroll
      for (int i = 0; i < SR; ++i) {
        const int r = (i >> 1) & 1;
        float x, dc;
        x = score_log2<kCap>(p, sc[i], dc);
        if constexpr (kCap) dcap[i] = dc;
        sc[i] = fast_exp2(x - lse2[r]);
      }
      mask_fragment<SR>(
          msk,
          [&](int i) {
            const int kr = kb.off + (i >> 2) * 8 + 2 * tq + (i & 1);
            return DUALKV_VISIBLE(p.mask, kb, pq_first + row0 + 8 * ((i >> 1) & 1), kr);
          },
          [&](int i) { sc[i] = 0.f; });
      // Keep the exp2s ahead of the wait (ptxas hoists the wait over straight-line code); the
      // branch is never taken (probabilities are >= 0 or NaN).
      fence_regs(sc);
      if (sc[0] + sc[SR - 1] < 0.f) asm volatile("nanosleep.u32 0;");
      wg_wait<0>();  // dP_j done (the only group still pending)
      fence_regs(dp);
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float ds[2];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int i = 8 * kt + 2 * c + u;
            const float d = sc[i] * (dp[i] - del[(i & 3) >> 1]);
            if constexpr (kCap) {
              ds[u] = d * dcap[i];
            } else {
              ds[u] = d;
            }
          }
          da[kt][c] = pack2<T>(ds[0], ds[1]);
        }
      }
      fence_regs(da);
    };

    // Turns: (S_0, dP_0), (dQ_0, S_1, dP_1), ..., (dQ_{total-1}). The first turn is peeled so
    // that no wgmma sits behind a branch (ptxas would serialise them all, C7520).
    pp.start();
    ws::mbar_wait(bQ, 0);
    if (total > 0) {
      ws::mbar_wait(full(0), 0);
      pp.begin_turn();
      wg_fence();
      issue_sdp(0);
      pp.end_turn();
      process(0);
      for (int j = 1; j < total; ++j) {
        const int st = Ring<S>::stage(j);
        ws::mbar_wait(full(st), Ring<S>::full_parity(j));
        pp.begin_turn();
        fence_regs(da, acc);
        wg_fence();
        issue_dq(j - 1, Ring<S>::stage(j - 1));
        issue_sdp(st);
        pp.end_turn();
        process(j);
      }
      // The last block's dQ product: one more turn.
      pp.begin_turn();
      fence_regs(da, acc);
      wg_fence();
      issue_dq(total - 1, Ring<S>::stage(total - 1));
      pp.end_turn();
      wg_wait<0>();
      fence_regs(acc, da);
    }
    pp.finish();

    store_dq_rows<T, D, D>(p, acc, q0, nq, h, row0, 0, tq, total > 0);
  }
#endif
}

// The separate dQ pass, with the arguments of make_dq_ws_args.
template <typename T, int D>
void launch_dq_sm90_ws(const DqWsArgs& a, cudaStream_t stream) {
  using C = DqWsCfg<D>;
  const BwdParams& p = a.p;
  const int64_t grid = int64_t(p.nqt) * p.Hq;
  if (grid == 0) return;
  auto kernel = p.softcap > 0.f ? dq_ws_kernel_sm90<T, D, true> : dq_ws_kernel_sm90<T, D, false>;
  launch_kernel(kernel, grid, C::THREADS, C::SMEM, stream, a,
                "dualkv backward dq (sm90a, warp-specialised)");
}

}  // namespace dualkv::cuda::detail
