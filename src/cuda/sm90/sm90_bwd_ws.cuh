// sm_90a dK/dV kernel at D <= 128, warp-specialised, in the style of sm90_fwd_ws.cuh, with dQ
// fused in (the default) or not (then the separate dQ pass of sm90_dq_ws.cuh runs; the launcher:
// bwd_launch.cuh). One CTA per (128-key tile, kv head), query blocks of 64 in the fixed walk of
// query_walk_begin/next (as every dK/dV kernel), so dK/dV are atomic-free and deterministic.
//   - producer warp 0: TMA of K and V once, then per query block of the walk: Q and dO tiles by
//     TMA, lse2/delta rows by cp.async (completing on the same full barrier with
//     cp.async.mbarrier.arrive.noinc), and a small record (query count, first position, or "end")
//     in shared memory, through a STAGES-deep ring. The consumers read the walk from the ring, so
//     they never touch the segment tables.
//   - consumer warpgroups 1, 2 (64 keys each): S^T = K Q^T and dP^T = V dO^T issued as two wgmma
//     groups; P is computed while dP^T is in flight, dV += P^T dO is issued before dS is computed,
//     so dS overlaps the dV product. With softcap the tanh derivative needs S, so that variant
//     waits for both products first.
// With kFusedDq (the default unless deterministic; DUALKV_FUSED_DQ=0 turns it off) the kernel
// also computes dQ = dS K, in FlashAttention-3's order, instead of the separate dQ pass
// (sm90_dq_ws.cuh: 7 matmul units per block pair instead of 5): dS^T goes to shared memory
// (double-buffered by iteration); at D = 128 each consumer warpgroup computes 64 of the 128 dQ
// columns over all 128 keys (a named barrier joins the two dS halves), at D = 64 all columns over
// its own 64 keys; dK += dS^T Q from the dS registers is issued after dQ and retired within the
// block. The consumers hand their fp32 dQ block to shared memory in dq_accum's swizzled layout
// (conflict-free stores) and lane 0 of producer warp 1 + c adds it into dq_accum with one bulk
// async reduction (cp.reduce.async.bulk, L2 evict_last), so the consumers never wait on global
// atomics; a conversion kernel writes dq. Not bitwise reproducible (the reductions' order varies).
// Fused is the faster backward (bench/RESULTS.md; the variants this replaced:
// src/cuda/LAB_NOTEBOOK.md). D = 256 has its own dK/dV kernel, sm90_bwd256_ws.cuh (these
// accumulators would not fit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "collective/epilogue.cuh"
#include "collective/query_walk.cuh"
#include "collective/score_mod.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/producers.cuh"
#include "sm90/tma.cuh"
#include "sm90/warp_roles.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

// BM_: queries per step, 64; or 128 at D = 64 with the fused dQ (KernelPolicy::d64_bwd_bm128,
// FlashAttention-3/4's hdim-64 backward tile: S^T / dP^T as m64n128 products, and each consumer
// warpgroup adds the dQ of 64 of the block's query rows over all 128 keys, so that one bulk
// reduction of 16 KB covers 128 x 64 x 128 of dQ's work instead of 64 x 64 x 128; 2 stages, as
// the 32 KB Q + dO blocks and 32 KB dS^T buffers fill the shared memory).
template <int D, bool kFusedDq = false, int BM_ = 64>
struct DkdvWsCfg : WsRoles<BM_ == 64 ? 24 : 40, BM_ == 64 ? 240 : 232> {
  static constexpr int BN = kTileSize;  // 128 keys: 2 consumer warpgroups x 64
  static constexpr int BM = BM_;        // queries per step
  static constexpr int STAGES = BM == 64 ? 3 : 2;
  static constexpr int DS_BYTES = BN * BM * 2;  // dS^T [BN keys][BM queries]
  static constexpr int DQ_BYTES = 64 * 64 * 4;  // kFusedDq: a warpgroup's fp32 m64n64 dQ block
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the OFF_* offsets come from here. The producer's tiles and rows
  // (DkdvSmem); between the tiles and the tail, kFusedDq: the two dS^T buffers and the two
  // warpgroups' dQ blocks.
  using Tiles = DkdvTiles<BN, BM, D, STAGES>;
  struct Tail {
    DkdvRows<BM, STAGES> r;
    int dq_meta[2][4];                 // kFusedDq: per warpgroup
    uint64_t bar[1 + 2 * STAGES + 4];  // kv, full[S], empty[S], dq_full[2], dq_empty[2]
  };
  struct Storage0 {
    Tiles t;
    Tail x;
  };
  struct Storage2 {
    Tiles t;
    uint16_t ds[2][BN * BM];
    float dq[2][64 * 64];
    Tail x;
  };
  using SharedStorage = std::conditional_t<kFusedDq, Storage2, Storage0>;
  static_assert(sizeof(Storage2::ds[0]) == DS_BYTES && sizeof(Storage2::dq[0]) == DQ_BYTES);
  static constexpr int OFF_DS = int(sizeof(Tiles));           // kFusedDq
  static constexpr int OFF_DQ = int(offsetof(Storage2, dq));  // kFusedDq
  static constexpr int OFF_ROWS = int(offsetof(SharedStorage, x) + offsetof(Tail, r));
  static constexpr int OFF_DQMETA = int(offsetof(SharedStorage, x) + offsetof(Tail, dq_meta));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, x) + offsetof(Tail, bar));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
  // Registers (WsRoles): 24 / 240, or with 128-query blocks 40 / 232 (at 24 registers the
  // producer warps spill 32 bytes).
  static_assert(D <= 128, "D = 256: sm90_bwd256_ws.cuh");
  static_assert(BM == 64 || (BM == 128 && D == 64 && kFusedDq),
                "128-query blocks: D = 64 with the fused dQ only (dQ's rows split between the "
                "warpgroups; D = 128 splits its columns)");
};

template <typename T, int D, bool kCap, bool kFusedDq, int BM_ = 64>
__global__ void __launch_bounds__(384, 1)
    dkdv_ws_kernel_sm90(const __grid_constant__ DkdvWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = DkdvWsCfg<D, kFusedDq, BM_>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  const BwdParams& p = a.p;
  const DkdvSmem<Cfg> sm;
  // kFusedDq: consumer warpgroup c's dQ block is ready (128 arrivals) / free again (1 arrival),
  // and its record {valid, first query token, q head, query count}.
  auto dq_full = [&](int c) { return sm.kv_bar + 8u * (1 + 2 * S + c); };
  auto dq_empty = [&](int c) { return sm.kv_bar + 8u * (3 + 2 * S + c); };
  auto dq_meta = [&](int c) {
    return reinterpret_cast<volatile int*>(sm.gbase + Cfg::OFF_DQMETA + 16 * c);
  };
  // kFusedDq: D = 128 splits dQ's columns between the consumer warpgroups (each sums all 128
  // keys), D = 64 splits the keys (each adds all columns over its own 64 keys), or with 128-query
  // blocks the query rows (each adds all columns of its 64 rows over all 128 keys).
  constexpr bool kSplitD = D == 128, kSplitRows = BM == 128;
  // Whether a warpgroup's dQ needs the other's dS^T half (the keys it does not own).
  constexpr bool kJoinDs = kSplitD || kSplitRows;
  static_assert(!(kSplitRows && kCap),
                "128-query blocks: without softcap (its S and dP live "
                "together would not fit the consumers' registers)");

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const KeyTileCta<kTileSize> cta(p);
  const int hk = cta.hk, k0 = cta.k0, nk = cta.nk, ksi = cta.ksi;
  const int pk_first = cta.pk_first, pk_last = cta.pk_last;
  const Segment& kseg = cta.kseg;

  ws::init_barriers(tid, [&] {
    sm.init_ring(NC);
    if constexpr (kFusedDq) {
      for (int c = 0; c < 2; ++c) {
        ws::mbar_init(dq_full(c), NC / 2);
        ws::mbar_init(dq_empty(c), 1);
      }
    }
  });

  if (warp < 4) {
    // ---- producer: warp 0 walks the query blocks ---------------------------------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (warp == 0) {
      dkdv_producer_warp(a, sm, kseg, ksi, hk, k0, pk_first, pk_last, 0, lane, [&](QIter& cur) {
        // query_walk_next, spelled out: as a call it changes this producer's machine code,
        // which has not been run on a GPU that way yet.
        if (++cur.qb < cur.qb_end) return true;
        // kFusedDq: pk_last passed through an empty asm, so that nothing derived from it is
        // kept live across the loop (ptxas hoisted its sign extension and spilled it at 24
        // registers).
        int pkl = pk_last;
        if constexpr (kFusedDq) asm volatile("" : "+r"(pkl));
        bool valid = seek_query_region<BM>(p, kseg, ksi, cur.si + 1, pk_first, pkl, cur);
        if (!valid && ++cur.hi < p.group)
          valid = seek_query_region<BM>(p, kseg, ksi, ksi, pk_first, pkl, cur);
        return valid;
      });
    } else if (kFusedDq && warp <= 2) {
      if constexpr (kFusedDq) {
        // ---- dQ reducers: lane 0 of warp 1 + c adds warpgroup c's blocks into dq_accum --------
        // (one lane: the bulk copies issue one lane at a time anyway, and 24 registers suffice)
        const int c = warp - 1;
        const uint32_t src = sm.base + Cfg::OFF_DQ + uint32_t(c) * Cfg::DQ_BYTES;
        volatile int* dm = dq_meta(c);
        const int col0 = kSplitD ? c * 64 : 0;
        const uint64_t l2pol = ws::createpolicy_evict_last();
        for (int it = 0; lane == 0; ++it) {
          ws::mbar_wait(dq_full(c), uint32_t(it) & 1u);
          if (dm[0] == 0) break;
          // The block's nq rows x 64 columns are contiguous in dq_accum's slab layout, from the
          // first row's start (the same in the swizzled layout: the image in shared memory
          // already holds each row's columns permuted).
          // (kSplitRows: a block of at most 64 queries leaves the second warpgroup's rows empty.)
          if (!kSplitRows || dm[3] > 0) {
            float* dst = dq_accum_at<D>(p, dm[1], dm[2], col0);
            ws::bulk_reduce_add_f32(dst, src, uint32_t(dm[3]) * 256, l2pol);
            ws::bulk_commit();
            ws::bulk_wait_read();
          }
          ws::mbar_arrive(dq_empty(c));
        }
        ws::bulk_wait();  // every reduction has landed before the CTA ends
      }
    }
  } else {
    // ---- consumers ---------------------------------------------------------------------------
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const int cw = (warp >> 2) - 1;
    const int g = lane >> 2, tq = lane & 3;
    const int kr0 = cw * 64 + (warp & 3) * 16 + g;  // key rows kr0, kr0 + 8
    constexpr int AR = D / 2, SR = BM / 2;
    float dk[AR], dv[AR];
    zero_frag(dk);
    zero_frag(dv);
    const float* lse_s = sm.lse();
    constexpr int DQ_KEYS = kJoinDs ? BN : 64;
    // With 128-query blocks the query columns' lse2 stay in shared memory (in registers, 32 of
    // them beside the m64n128 S^T and dP^T would not fit), as with softcap.
    constexpr bool kLseRegs = !kCap && BM == 64;

    ws::mbar_wait(sm.kv_bar, 0);
    int it = 0;  // after the loop: the number of query blocks seen
    for (;; ++it) {
      const int s = Ring<S>::stage(it);
      int nq, pq_first;
      if (!sm.wait_block(s, it, nq, pq_first)) break;
      const int hq = hk * p.group + sm.meta(s)[0] - 1, qs = sm.meta(s)[3];
      const bool msk =
          needs_mask(nq, BM, nk, BN, pq_first, pq_first + nq - 1, pk_first, pk_last, p.mask);
      const uint32_t sQ = sm.q(s), sdO = sm.dout(s);
      const float* lse_c = lse_s + s * 2 * BM;
      const float* del_c = lse_c + BM;

      // This thread's lse2 columns, read before the GEMMs are issued: read among them, the loads
      // completed only after dP^T's shared-memory operands (a profile showed the first exponential
      // stalling on them). Not with softcap: there the 16 registers spill.
      float lse_r[kLseRegs ? SR / 2 : 1];
      if constexpr (kLseRegs) {
        frag_cols_load<SR>(lse_c, tq, lse_r);
        fence_regs(lse_r);
      }
      float sc[SR], dp[SR];
      wg_fence();
      wgmma_rows<T, BM, D, BN, BM>(sc, sm.k, cw * 64, sQ, 0);
      wg_commit();
      wgmma_rows<T, BM, D, BN, BM>(dp, sm.v, cw * 64, sdO, 0);
      wg_commit();

      uint32_t pa[BM / 16][4], da[BM / 16][4];
      // Element i of an S^T fragment: key row kr0 + kr_of(i), query column qc_of(i).
      auto qc_of = [&](int i) { return (i >> 2) * 8 + 2 * tq + (i & 1); };
      auto kr_of = [&](int i) { return kr0 + ((i >> 1) & 1) * 8; };
      auto visible = [&](int i) {
        return DUALKV_VISIBLE_KQ(p.mask, kr_of(i), nk, pk_first, qc_of(i), nq, pq_first);
      };
      auto prob = [&](int i, float x) {
        if constexpr (kLseRegs) {
          return fast_exp2(x - lse_r[frag_col_slot(i)]);
        } else {
          return fast_exp2(x - lse_c[qc_of(i)]);
        }
      };
      // The softcap path masks inside its fused loop (it keeps few registers live there).
      auto prob_masked = [&](int i, float x) {
        const float pr = prob(i, x);
        return msk && !visible(i) ? 0.f : pr;
      };
      auto dsc = [&](int i, float pr, float dcap) {
        const int qc = (i >> 2) * 8 + 2 * tq + (i & 1);
        return pr * (dp[i] - del_c[qc]) * dcap;
      };
      // kFusedDq: dS^T (key rows x query columns, SW128) to this iteration's shared buffer.
      const uint32_t sDS = sm.base + Cfg::OFF_DS + uint32_t(it & 1) * Cfg::DS_BYTES;
      auto stash_ds = [&]() {
#pragma unroll
        for (int kt = 0; kt < BM / 16; ++kt)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int kr = kr0 + 8 * (c & 1), qc = (2 * kt + (c >> 1)) * 8 + 2 * tq;
            ws::st_shared_u32(sDS + sw128<BN>(kr, qc & ~7) + (qc & 7) * 2, da[kt][c]);
          }
        fence_proxy_async();
      };
      if constexpr (kCap) {
        // dS needs tanh'(S): wait for both products, then one pass.
        wg_wait<0>();
        fence_regs(sc, dp);
        // Packed as computed, so each pair of S/dP registers dies at once (no spills).
#pragma unroll
        for (int kt = 0; kt < BM / 16; ++kt)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float pr[2], ds[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int i = 8 * kt + 2 * c + u;
              const float t = softcap_tanh(p, sc[i]);
              pr[u] = prob_masked(i, softcap_logit(p, t));
              ds[u] = dsc(i, pr[u], softcap_dfactor(t));
            }
            pa[kt][c] = pack2<T>(pr[0], pr[1]);
            da[kt][c] = pack2<T>(ds[0], ds[1]);
          }
        if constexpr (kFusedDq) stash_ds();
        fence_regs(pa, da, dv, dk);
        wg_fence();
        wgmma_rs_acc<T, D, BM>(dv, pa, sdO);
        if constexpr (!kFusedDq) {
          wgmma_rs_acc<T, D, BM>(dk, da, sQ);
        }
        wg_commit();
      } else {
        wg_wait<1>();  // S^T done, dP^T in flight
        fence_regs(sc);
#pragma unroll
        for (int i = 0; i < SR; ++i) sc[i] = prob(i, score_log2<false>(p, sc[i]));
        mask_fragment<SR>(msk, visible, [&](int i) { sc[i] = 0.f; });
        pack_a_frag<T>(pa, sc);
        fence_regs(pa, dv);
        wg_fence();
        wgmma_rs_acc<T, D, BM>(dv, pa, sdO);
        wg_commit();
        wg_wait<1>();  // dP^T done, dV in flight
        fence_regs(dp);
        if constexpr (kSplitRows) {
          // dS from the 16-bit P that dV reads (the fp32 P kept beside dP^T, dK, dV and P's
          // fragment spilled and serialised the wgmmas at 128 queries).
#pragma unroll
          for (int kt = 0; kt < BM / 16; ++kt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int i = 8 * kt + 2 * c;
              const float2 pr = unpack2<T>(pa[kt][c]);
              dp[i] = dsc(i, pr.x, 1.f);
              dp[i + 1] = dsc(i + 1, pr.y, 1.f);
            }
        } else {
#pragma unroll
          for (int i = 0; i < SR; ++i) dp[i] = dsc(i, sc[i], 1.f);
        }
        pack_a_frag<T>(da, dp);
        if constexpr (kFusedDq) {
          stash_ds();  // for dQ, below
        } else {
          fence_regs(da, dk);
          wg_fence();
          wgmma_rs_acc<T, D, BM>(dk, da, sQ);
          wg_commit();
        }
      }
      float dqa[32];  // kFusedDq: this warpgroup's m64n64 block of dQ
      if constexpr (kFusedDq) {
        // Both dS^T halves (kJoinDs) or this warpgroup's own (D = 64, 64-query blocks) are in
        // shared memory.
        if constexpr (kJoinDs) {
          ws::bar_sync(1, NC);
        } else {
          ws::bar_sync(2 + cw, NC / 2);
        }
        // A = dS (query rows: MN-major from dS^T's columns; kSplitRows: column block cw, this
        // warpgroup's 64 queries), B = K (its keys' rows; kSplitD: column block cw of D).
        const uint32_t a_tile = sDS + (kSplitD      ? 0u
                                       : kSplitRows ? uint32_t(cw * BN * 128)
                                                    : uint32_t(cw * 64 * 128));
        const uint32_t b_tile = sm.k + (kSplitD      ? uint32_t(cw * BN * 128)
                                        : kSplitRows ? 0u
                                                     : uint32_t(cw * 64 * 128));
        fence_regs(dk, da);
        wg_fence();
#pragma unroll
        for (int kt = 0; kt < DQ_KEYS / 16; ++kt) {
          Wgmma<T, 64>::template ss<1, 1>(dqa, desc_mnmajor<BN>(a_tile, kt * 16),
                                          desc_mnmajor<BN>(b_tile, kt * 16), kt > 0);
        }
        wg_commit();
        // dK += dS^T Q with dS^T from registers, committed last: it runs on while dQ is handed
        // over, and is retired at the end of this block (which then releases the stage).
        wgmma_rs_acc<T, D, BM>(dk, da, sQ);
        wg_commit();
        wg_wait<1>();  // dV and dQ done
        fence_regs(dv, pa);
        // Hand the block to this warpgroup's reducer warp once it has read the previous one.
        fence_regs(dqa);
        ws::mbar_wait(dq_empty(cw), (uint32_t(it) & 1u) ^ 1u);
        const uint32_t dst = sm.base + Cfg::OFF_DQ + uint32_t(cw) * Cfg::DQ_BYTES;
        // This warpgroup's dQ rows: queries q_c .. of the block, n_c of them.
        const int q_c = kSplitRows ? qs + 64 * cw : qs;
        const int n_c = kSplitRows ? max(0, min(64, nq - 64 * cw)) : nq;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int qr = (warp & 3) * 16 + g + 8 * r;
          // Row qr is token q_c + qr of dq_accum's swizzled layout (dq_accum_at).
          const int sw = (q_c + qr) & 7;
#pragma unroll
          for (int nd = 0; nd < 8; ++nd)
            ws::st_shared_f32x2(dst + qr * 256 + ((nd ^ sw) * 8 + 2 * tq) * 4, dqa[nd * 4 + 2 * r],
                                dqa[nd * 4 + 2 * r + 1]);
        }
        if ((tid & 127) == 0) {
          volatile int* dm = dq_meta(cw);
          dm[0] = 1, dm[1] = q_c, dm[2] = hq, dm[3] = n_c;
        }
        fence_proxy_async();  // the bulk reduction reads through the async proxy
        ws::mbar_arrive(dq_full(cw));
        wg_wait<0>();  // dK done: the stage (sQ) and dS^T's registers are free
        fence_regs(dk, da);
        sm.release(s);
      } else {
        wg_wait<0>();
        fence_regs(dv, dk, pa, da);
        sm.release(s);
      }
    }
    if constexpr (kFusedDq) {
      // Tells this warpgroup's reducer that the walk has ended.
      ws::mbar_wait(dq_empty(cw), (uint32_t(it) & 1u) ^ 1u);
      if ((tid & 127) == 0) dq_meta(cw)[0] = 0;
      ws::mbar_arrive(dq_full(cw));
    }

    store_dkdv_rows<T, D, D>(p, dk, dv, k0, nk, hk, kr0, 0, tq);
  }
#endif
}

}  // namespace dualkv::cuda::detail
