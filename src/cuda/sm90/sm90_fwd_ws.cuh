// sm_90a forward, FlashAttention-3 style: the forward on Hopper at head dims 64, 128 and 256 (the
// sm_80 one when a TMA map cannot be encoded; D = 512: sm90_fwd512_cluster.cuh). One CTA per (query
// tile, q head), the key walk (KeyBlockWalk: ancestors, then its own segment), one online softmax,
// masks on boundary blocks only:
//   - warpgroup 0 is the producer: one thread issues TMA copies (cp.async.bulk.tensor, 128-byte
//     swizzle straight into the SW128 wgmma layout) of Q once and of K/V blocks through a
//     STAGES-deep ring; full barriers complete on the copies' byte count, empty barriers on the
//     consumer threads' arrivals. setmaxnreg gives its registers to the consumers.
//   - warpgroups 1 .. NWG consume, 64 query rows each (NWG = 2: the layout's 128-row tiles; at
//     D = 64 optionally 3, 192-row wide tiles: FwdWsCfg). Intra-warpgroup overlap: S_j = Q K_j^T
//     and O += P_{j-1} V_{j-1} are issued back to back as two wgmma groups; the softmax of S_j runs
//     while P V is in flight (wait_group 1), O is rescaled after wait_group 0.
//   - ping-pong (named barriers 1 .. NWG): the consumer warpgroups take turns issuing their GEMMs,
//     so one's softmax (MUFU/FMA) overlaps the others' tensor-core work. Off when
//     DUALKV_SM90_PINGPONG=0, for A/B timing.
//   - softmax in the log2 domain with the scale folded into one FFMA per element
//     (exp2(s * scale_log2 - m * scale_log2)); softcap or a non-positive scale pre-scales instead.
// Unlike the sm_80 kernel (and the synchronous one deleted since), K/V rows past a region's end
// (inside T) are read from the neighbouring tokens instead of zero-filled; they are masked to P =
// 0, so only a non-finite V value there could leak (0 * inf). Q rows past the tile's end are
// likewise real tokens (their rows are computed and not written).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "collective/online_softmax.cuh"
#include "collective/score_mod.cuh"
#include "launch.h"
#include "sm90/fwd_mainloop.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/producers.cuh"
#include "sm90/sm90_ws.h"
#include "sm90/tma.cuh"
#include "sm90/warp_roles.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

// NWG consumer warpgroups of 64 query rows each: 2 (a kTileSize-row CTA), or 3 at D = 64
// (KernelPolicy::d64_fwd_bm192: 192-row CTAs on wide tiles, FlashAttention-3's hdim-64 tile, so
// that each SM scheduler has three consumer warps instead of two; setmaxnreg 24 / 160, else
// 40 / 232).
template <int D, int NWG = 2>
struct FwdWsCfg : WsRoles<NWG == 2 ? 40 : 24, NWG == 2 ? 232 : 160, NWG> {
  static_assert(D <= 256, "a 64 x D fp32 O per warpgroup; D = 512: sm90_fwd512_cluster.cuh");
  static_assert(NWG == 2 || (NWG == 3 && D == 64),
                "three consumer warpgroups at D = 64 only: 160 registers each hold O, S and P "
                "of a 64 x 64 / 64 x 128 tile, no wider O");
  static constexpr int BM = 64 * NWG;  // kTileSize, or a wide tile (QueryTileCta, B > kTileSize)
  static constexpr int BN = D >= 256 ? 64 : 128;
  static constexpr int STAGES = 2;
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the OFF_* offsets come from here.
  struct Barriers {  // mbarriers
    uint64_t q, full_k[STAGES], full_v[STAGES], empty_k[STAGES], empty_v[STAGES];
  };
  struct SharedStorage {
    uint16_t q[BM * D];
    uint16_t k[STAGES][BN * D];
    uint16_t v[STAGES][BN * D];
    Barriers bar;
  };
  static_assert(sizeof(SharedStorage::q) == Q_BYTES && sizeof(SharedStorage::k[0]) == KV_BYTES);
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
};

template <typename T, int D, bool kCap, int NWG = 2>
__global__ void __launch_bounds__(FwdWsCfg<D, NWG>::THREADS, 1)
    fwd_ws_kernel_sm90(const __grid_constant__ FwdWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = FwdWsCfg<D, NWG>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  const FwdParams& p = a.p;
  const SmemBase sm;
  const uint32_t sQ = sm.base, sK0 = sm.base + Cfg::OFF_K, sV0 = sm.base + Cfg::OFF_V;
  const uint32_t bQ = sm.base + Cfg::OFF_BAR;
  auto full_k = [&](int s) { return bQ + 8u * (1 + s); };
  auto full_v = [&](int s) { return bQ + 8u * (1 + S + s); };
  auto empty_k = [&](int s) { return bQ + 8u * (1 + 2 * S + s); };
  auto empty_v = [&](int s) { return bQ + 8u * (1 + 3 * S + s); };

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const QueryTileCta<BM> cta(p);
  if (!cta.valid) return;
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;

  const KeyBlockWalk<BN> walk(p, cta.seg, q0, nq);
  const int total = walk.total, pq_first = walk.pq_first;

  ws::init_barriers(tid, [&] {
    ws::mbar_init(bQ, 1);
    ws::ring_init<S>(full_k, empty_k, 1, NC);
    ws::ring_init<S>(full_v, empty_v, 1, NC);
  });

  if (warp < 4) {
    // ---- producer warpgroup: one thread issues every copy ------------------------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (tid == 0) {
      ws_fwd_producer<S, D / 64, BM, Cfg::Q_BYTES, Cfg::KV_BYTES>(
          a, walk, sQ, sK0, sV0, bQ, 0, h, q0, full_k, full_v, empty_k, empty_v,
          [&](const CUtensorMap* map, uint32_t dst, uint32_t bar, int row) {
            ws::tma_load3_cols<D / 64, BN>(dst, map, bar, 0, hk, row);
          });
    }
  } else {
    // ---- consumer warpgroups: warpgroup cw (0 .. NWG - 1) owns query rows [64 cw, 64 cw + 64) --
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const int cw = (warp >> 2) - 1;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = cw * 64 + (warp & 3) * 16 + g;        // rows row0, row0 + 8
    const PingPong<2 * 128, NWG> pp(a.pingpong != 0, cw);  // each barrier joins two warpgroups
    const float sl = (kCap || a.prescale) ? 1.f : p.scale_log2;  // log2-domain factor of the scores

    constexpr int OR = D / 2, SR = BN / 2;  // accumulator floats per thread
    float o[OR];
    zero_frag(o);
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float s[SR];
    uint32_t pa[BN / 16][4];

    // Scores of block j (in s) -> unnormalised probabilities (in place); updates the running max
    // and sum; corr = factor by which O must be rescaled.
    auto softmax = [&](int j, float (&corr)[2]) {
      const auto kb = walk.at(j);
      ws_fwd_block_softmax<BN, kCap, false>(p, s, kb, walk.masked(kb, nq, BM, p.mask), a.prescale,
                                            pq_first + row0, tq, sl, m_run, l_run, corr);
    };
    auto issue_s = [&](int st) {
      const uint32_t sK = sK0 + st * Cfg::KV_BYTES;
      wgmma_rows_cols<T, BN, D, BM, BN>(s, sQ, cw * 64, sK, 0, 0);
      wg_commit();
    };
    auto issue_pv = [&](int st) {
      wgmma_rs_acc<T, D, BN>(o, pa, sV0 + st * Cfg::KV_BYTES);
      wg_commit();
    };

    pp.start();
    ws::mbar_wait(bQ, 0);
    ws_fwd_mainloop<T, S, D / 8>(
        total, pp, s, o, pa, l_run, full_k, full_v, [&](int st) { ws::mbar_arrive(empty_k(st)); },
        [&](int st) { ws::mbar_arrive(empty_v(st)); }, issue_s, issue_pv, softmax);
    pp.finish();

    store_out_rows<T, D, D>(p, o, m_run, l_run, sl, q0, nq, h, row0, tq, 0, true);
  }
#endif
}

// Launches `kernel`, a forward with NWG consumer warpgroups (FwdWsCfg), one CTA per tile of the
// layout's list and q head (with NWG = 3 a tile stands for a wide tile: QueryTileCta).
template <int D, int NWG>
bool launch_fwd_ws_kernel(void (*kernel)(FwdWsArgs), const FwdParams& p, const KernelPolicy& policy,
                          cudaStream_t stream) {
  using Cfg = FwdWsCfg<D, NWG>;
  const int64_t grid = int64_t(p.nqt) * p.Hq;
  if (grid == 0) return true;
  FwdWsArgs a{};
  if (!make_fwd_ws_args(a, p, policy, D, Cfg::BM, Cfg::BN)) return false;
  launch_kernel(kernel, grid, Cfg::THREADS, Cfg::SMEM, stream, a,
                "dualkv forward (sm90a, warp-specialised)");
  return true;
}

template <typename T, int D>
bool launch_forward_sm90_ws(const FwdParams& p, const KernelPolicy& policy, cudaStream_t stream) {
  const bool cap = p.softcap > 0.f;
  if constexpr (D == 64) {
    // Not with softcap: its consumers spill at the three warpgroups' 160 registers.
    if (policy.d64_fwd_bm192 && !cap)
      return launch_fwd_ws_kernel<D, 3>(fwd_ws_kernel_sm90<T, D, false, 3>, p, policy, stream);
  }
  return launch_fwd_ws_kernel<D, 2>(
      cap ? fwd_ws_kernel_sm90<T, D, true> : fwd_ws_kernel_sm90<T, D, false>, p, policy, stream);
}

}  // namespace dualkv::cuda::detail
