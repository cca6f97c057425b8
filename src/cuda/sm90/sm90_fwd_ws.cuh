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
#include "sm90/dsmem.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/sm90_ws.h"

namespace dualkv::cuda::detail {

// NWG consumer warpgroups of 64 query rows each: 2 (a kTileSize-row CTA), or 3 at D = 64
// (KernelPolicy::d64_fwd_bm192: 192-row CTAs on wide tiles, FlashAttention-3's hdim-64 tile, so
// that each SM scheduler has three consumer warps instead of two; setmaxnreg 24 / 160).
template <int D, int NWG = 2>
struct FwdWsCfg {
  static_assert(D <= 256, "a 64 x D fp32 O per warpgroup; D = 512: sm90_fwd512_cluster.cuh");
  static_assert(NWG == 2 || (NWG == 3 && D == 64),
                "three consumer warpgroups at D = 64 only: 160 registers each hold O, S and P "
                "of a 64 x 64 / 64 x 128 tile, no wider O");
  static constexpr int BM = 64 * NWG;  // kTileSize, or a wide tile (QueryTileCta, B > kTileSize)
  static constexpr int BN = D >= 256 ? 64 : 128;
  static constexpr int STAGES = 2;
  static constexpr int THREADS = 128 * (NWG + 1);  // warpgroup 0 produces, 1 .. NWG consume
  static constexpr int CONSUMERS = 128 * NWG;
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
  static constexpr int SMEM = int(sizeof(SharedStorage)) + 1024;
  // setmaxnreg: 40 + 2 x 232 = 504 registers per thread slot of the three warpgroups; with
  // three consumer warpgroups 24 + 3 x 160 = 504 of the four.
  static constexpr int PRODUCER_REGS = NWG == 2 ? 40 : 24;
  static constexpr int CONSUMER_REGS = NWG == 2 ? 232 : 160;
  // setmaxnreg moves registers within the CTA's pool: THREADS x the launch bound's allocation
  // (65536 / THREADS in steps of 8: 168 at 384 threads, 128 at 512).
  static constexpr int REG_POOL = 65536 / THREADS / 8 * 8;
  static_assert(PRODUCER_REGS + NWG * CONSUMER_REGS <= (NWG + 1) * REG_POOL,
                "register pool of one CTA");
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
};

// Kernel parameter block: the common parameters plus the TMA maps (by value, __grid_constant__).
struct FwdWsArgs {
  CUtensorMap tq, tk, tv;
  FwdParams p;
  int pingpong;
  int prescale;  // 1: scale the scores first (scale <= 0: the FFMA fold needs scale > 0)
};

namespace ws {

#if DUALKV_SM90_BODY
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                          int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The NB column blocks of 64 from column col0 (coordinates {col, c1, c2}) of a tile into dst
// (SW128 blocks of ROWS x 128 bytes), completing on bar.
template <int NB, int ROWS>
__device__ __forceinline__ void tma_load3_cols(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                               int col0, int c1, int c2) {
#pragma unroll
  for (int c = 0; c < NB; ++c) tma_load3(dst + c * (ROWS * 128), map, bar, col0 + c * 64, c1, c2);
}
// The NB column blocks of 64 from column col0 (coordinates {col, c1, c2}) of two tiles that
// complete on the same barrier: map_a's into dst_a, map_b's into dst_b (SW128 blocks of ROWS x 128
// bytes), one block of each in turn.
template <int NB, int ROWS>
__device__ __forceinline__ void tma_load3_pair(uint32_t dst_a, const CUtensorMap* map_a,
                                               uint32_t dst_b, const CUtensorMap* map_b,
                                               uint32_t bar, int col0, int c1, int c2) {
#pragma unroll
  for (int c = 0; c < NB; ++c) {
    tma_load3(dst_a + c * (ROWS * 128), map_a, bar, col0 + c * 64, c1, c2);
    tma_load3(dst_b + c * (ROWS * 128), map_b, bar, col0 + c * 64, c1, c2);
  }
}
// The same copy delivered to the same shared-memory offsets of every CTA of the cluster in
// `cta_mask` (and completing on the barrier at the same offset in each).
__device__ __forceinline__ void tma_load3_multicast(uint32_t dst, const CUtensorMap* map,
                                                    uint32_t bar, int c0, int c1, int c2,
                                                    uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ void prefetch_tmap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
template <int N>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
#endif

}  // namespace ws

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

template <typename T, int D, bool kCap, int NWG = 2>
__global__ void __launch_bounds__(FwdWsCfg<D, NWG>::THREADS, 1)
    fwd_ws_kernel_sm90(const __grid_constant__ FwdWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = FwdWsCfg<D, NWG>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  const FwdParams& p = a.p;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
  const uint32_t sQ = base, sK0 = base + Cfg::OFF_K, sV0 = base + Cfg::OFF_V;
  const uint32_t bQ = base + Cfg::OFF_BAR;
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

  if (tid == 0) {
    ws::mbar_init(bQ, 1);
    ws::ring_init<S>(full_k, empty_k, 1, NC);
    ws::ring_init<S>(full_v, empty_v, 1, NC);
    ws::mbar_init_fence();
  }
  __syncthreads();

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
#pragma unroll
    for (int i = 0; i < OR; ++i) o[i] = 0.f;
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
