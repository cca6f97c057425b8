// sm_90a forward, FlashAttention-3 style: the forward on Hopper, every head dim (the sm_80 one
// when a TMA map cannot be encoded). One CTA per (query tile, q head), region A then region B,
// one online softmax, masks on boundary blocks only:
//   - warpgroup 0 is the producer: one thread issues TMA copies (cp.async.bulk.tensor, 128-byte
//     swizzle straight into the SW128 wgmma layout) of Q once and of K/V blocks through a
//     STAGES-deep ring; full barriers complete on the copies' byte count, empty barriers on the
//     256 consumer threads' arrivals. setmaxnreg gives its registers to the consumers.
//   - warpgroups 1 and 2 consume, 64 query rows each. Intra-warpgroup overlap: S_j = Q K_j^T and
//     O += P_{j-1} V_{j-1} are issued back to back as two wgmma groups; the softmax of S_j runs
//     while P V is in flight (wait_group 1), O is rescaled after wait_group 0.
//   - ping-pong (named barriers 1, 2): the two consumer warpgroups take turns issuing their GEMMs,
//     so one's softmax (MUFU/FMA) overlaps the other's tensor-core work. Off when
//     DUALKV_SM90_PINGPONG=0, for A/B timing.
//   - softmax in the log2 domain with the scale folded into one FFMA per element
//     (exp2(s * scale_log2 - m * scale_log2)); softcap or a non-positive scale pre-scales instead.
// Unlike the sm_80 kernel (and the synchronous one deleted since), K/V rows past a region's end
// (inside T) are read from the neighbouring tokens instead of zero-filled; they are masked to P =
// 0, so only a non-finite V value there could leak (0 * inf). Q rows past the tile's end are
// likewise real tokens (their rows are computed and not written). D = 512 (KSPLIT = 2): a 64 x 512
// fp32 O does not fit one warpgroup's registers. A CTA owns 64 query rows (half a tile); both
// consumer warpgroups work on them: warpgroup c owns O's columns [256c, 256c + 256) and computes
// the partial S_c = Q[:, cols] K[:, cols]^T over the same columns of the reduction dim. The two
// partials go through shared memory (double-buffered by block parity, one named barrier per block)
// and each warpgroup adds them in the same order, so both hold bitwise the same S and run the same
// online softmax; then O_c += P V[:, cols]. No ping-pong (the warpgroups meet every block); the O
// rescale is skipped in a warp whose rows kept their max. The two 64-row halves of a tile run as a
// cluster of two CTAs (CLUSTER = 2) that walk the same key blocks (the whole tile's walk): each
// producer loads half of a K/V block's column blocks with TMA multicast into both CTAs, so every
// block is read from L2 once per 128 queries, not per 64 (64 queries x 32 keys x 512 columns is 64
// FLOP per byte of K/V: L2 bandwidth bound). A stage is refilled when the consumer warps of both
// CTAs have released it (their empty barrier counts 2 x 8 warp arrivals, one of them remote).
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

template <int D>
struct FwdWsCfg {
  // Consumer warpgroups sharing one 64-row slab (splitting O's columns and S's reduction dim).
  static constexpr int KSPLIT = D >= 512 ? 2 : 1;
  static constexpr int DC = D / KSPLIT;          // columns per consumer warpgroup
  static constexpr int BM = kTileSize / KSPLIT;  // 2 consumer warpgroups x 64 rows / KSPLIT
  static constexpr int BN = D >= 512 ? 32 : D >= 256 ? 64 : 128;
  static constexpr int STAGES = 2;
  static constexpr int CLUSTER = KSPLIT > 1 ? 2 : 1;  // CTAs sharing each K/V block (multicast)
  static constexpr int THREADS = 384;                 // warpgroup 0 produces, 1 and 2 consume
  static constexpr int CONSUMERS = 256;
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the OFF_* offsets come from here. KSPLIT > 1 puts the partial-S exchange,
  // [2 block parities][KSPLIT][BN / 8][128 threads] float4, between the tiles and the barriers.
  struct Tiles {
    uint16_t q[BM * D];
    uint16_t k[STAGES][BN * D];
    uint16_t v[STAGES][BN * D];
  };
  struct Barriers {  // mbarriers
    uint64_t q, full_k[STAGES], full_v[STAGES], empty_k[STAGES], empty_v[STAGES];
  };
  struct SplitStorage {
    Tiles t;
    float4 x[2][KSPLIT][BN / 8][128];
    Barriers bar;
  };
  struct PlainStorage {
    Tiles t;
    Barriers bar;
  };
  using SharedStorage = std::conditional_t<(KSPLIT > 1), SplitStorage, PlainStorage>;
  static_assert(sizeof(Tiles::q) == Q_BYTES && sizeof(Tiles::k[0]) == KV_BYTES);
  static constexpr int OFF_K = int(offsetof(Tiles, k));
  static constexpr int OFF_V = int(offsetof(Tiles, v));
  static constexpr int OFF_X = int(offsetof(SplitStorage, x));  // KSPLIT > 1 only
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar));
  // Ends at the barriers (sizeof(SplitStorage) would round up to float4 alignment).
  static constexpr int SMEM = OFF_BAR + int(sizeof(Barriers)) + 1024;
  // setmaxnreg: 40 + 2 x 232 = 504 registers per thread slot of the three warpgroups (<= 512).
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  // setmaxnreg moves registers within the CTA's pool (384 x 168 at this launch bound).
  static_assert(PRODUCER_REGS + 2 * CONSUMER_REGS <= 3 * 168, "register pool of one CTA");
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
};
static_assert(FwdWsCfg<512>::SMEM <= kSmemHeadDim512, "api.cu checks the GPU offers this much");

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
// barrier, first key row) (the kernel's own column blocks: all of them, its column half, or its
// share multicast to the cluster).
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
// (stage), committed), combine(s, j) (the peer's partial S added: the split head dim), softmax(j,
// corr) (ws_fwd_block_softmax) and whether the O rescale is voted per warp (kVote: skipped where
// no row of the warp moved its max) or always run.
template <typename T, int S, int ND, bool kVote, int NC, int SR, int OR, int KT, class FullK,
          class FullV, class ReleaseK, class ReleaseV, class IssueS, class IssuePV, class Combine,
          class Softmax>
__device__ __forceinline__ void ws_fwd_mainloop(int total, const PingPong<NC>& pp, float (&s)[SR],
                                                float (&o)[OR], uint32_t (&pa)[KT][4],
                                                const float (&l_run)[2], FullK&& full_k,
                                                FullV&& full_v, ReleaseK&& release_k,
                                                ReleaseV&& release_v, IssueS&& issue_s,
                                                IssuePV&& issue_pv, Combine&& combine,
                                                Softmax&& softmax) {
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
  combine(0);
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
    combine(j);
    softmax(j, corr);
    // Keep the exp2s before the wait: ptxas hoists the wait over straight-line code, which
    // would stall on P V before the softmax instead of overlapping it. A branch on the row
    // sums (never taken: they are >= 0 or NaN) ends the basic block after the last exp2.
    fence_regs(s);
    if (l_run[0] + l_run[1] < 0.f) asm volatile("nanosleep.u32 0;");
    wg_wait<0>();
    fence_regs(o, pa);
    release_v(pst);
    rescale_o_rows<ND, kVote>(o, corr);
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

template <typename T, int D, bool kCap>
__global__ void __launch_bounds__(384, 1) fwd_ws_kernel_sm90(const __grid_constant__ FwdWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = FwdWsCfg<D>;
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
  constexpr int CLUSTER = Cfg::CLUSTER;
  int h, hk, q0, nq;  // this CTA's q head, kv head and query rows [q0, q0 + nq)
  int wq0, wnq;       // the queries whose key walk the CTA follows (CLUSTER: the whole tile)
  Segment seg;
  if constexpr (CLUSTER == 1) {
    const QueryTileCta<BM> cta(p);
    if (!cta.valid) return;
    h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq, seg = cta.seg;
    wq0 = q0, wnq = nq;
  } else {
    // Both halves of the tile run, the second one also when the tile has <= 64 rows (nq = 0:
    // it computes rows it does not write), since the pair shares every K/V load.
    static_assert(CLUSTER == 2 && BM * 2 == kTileSize, "a cluster holds one tile's two halves");
    const TilePart<BM, true> part(p.qtiles, p.Hq);
    h = part.head, hk = h / p.group, q0 = part.begin, nq = part.valid ? part.count : 0;
    seg = p.segs[part.segment];
    wq0 = part.tile_begin, wnq = part.tile_end - part.tile_begin;
  }
  const uint32_t rank = CLUSTER > 1 ? blockIdx.x % CLUSTER : 0u;  // = %cluster_ctarank

  const KeyBlockWalk<BN> walk(seg, wq0, wnq, p.mask);
  const int total = walk.total, pq_first = walk.pq_first;
  // Empty-barrier arrivals per phase: every consumer thread, or (CLUSTER) one per consumer warp
  // of each CTA of the cluster.
  constexpr uint32_t kEmptyCount = CLUSTER > 1 ? CLUSTER * (NC / 32) : NC;

  if (tid == 0) {
    ws::mbar_init(bQ, 1);
    ws::ring_init<S>(full_k, empty_k, 1, kEmptyCount);
    ws::ring_init<S>(full_v, empty_v, 1, kEmptyCount);
    ws::mbar_init_fence();
  }
  if constexpr (CLUSTER > 1) {
    ws::cluster_sync();  // the peer's barriers are initialised before any copy or arrival
  } else {
    __syncthreads();
  }

  if (warp < 4) {
    // ---- producer warpgroup: one thread issues every copy ------------------------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (tid == 0) {
      ws_fwd_producer<S, D / 64, BM, Cfg::Q_BYTES, Cfg::KV_BYTES>(
          a, walk, sQ, sK0, sV0, bQ, 0, h, q0, full_k, full_v, empty_k, empty_v,
          [&](const CUtensorMap* map, uint32_t dst, uint32_t bar, int row) {
            if constexpr (CLUSTER > 1) {
              // This CTA's share of the column blocks, multicast to both; each CTA's full
              // barrier expects the whole block (half from each producer).
              constexpr int CB = D / 64 / CLUSTER;
              constexpr uint16_t kAll = (1u << CLUSTER) - 1u;
#pragma unroll
              for (int c = int(rank) * CB; c < int(rank) * CB + CB; ++c)
                ws::tma_load3_multicast(dst + c * (BN * 128), map, bar, c * 64, hk, row, kAll);
            } else {
              ws::tma_load3_cols<D / 64, BN>(dst, map, bar, 0, hk, row);
            }
          });
    }
  } else {
    // ---- consumer warpgroups -----------------------------------------------------------------
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    constexpr int KSPLIT = Cfg::KSPLIT, DC = Cfg::DC;
    // KSPLIT = 1: warpgroup cw (0 or 1) owns query rows [64 cw, 64 cw + 64) and all D columns;
    // KSPLIT = 2: both own rows [0, 64), cw the columns [DC cw, DC cw + DC).
    const int cw = (warp >> 2) - 1;
    const int wrow = KSPLIT > 1 ? 0 : cw * 64, col0 = KSPLIT > 1 ? cw * DC : 0;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = wrow + (warp & 3) * 16 + g;  // rows row0, row0 + 8
    const PingPong<NC> pp(KSPLIT == 1 && a.pingpong != 0, cw);
    const int row_base = CLUSTER > 1 ? q0 - wq0 : 0;  // first row's offset in the walk's rows
    // A consumer's release of a stage: every thread arrives, or (CLUSTER) one per warp, on the
    // barrier of each CTA of the cluster.
    auto release = [&](uint32_t bar) {
      if constexpr (CLUSTER > 1) {
        __syncwarp();
        if (lane == 0) {
#pragma unroll
          for (uint32_t c = 0; c < uint32_t(CLUSTER); ++c) ws::mbar_arrive_cluster(bar, c);
        }
      } else {
        ws::mbar_arrive(bar);
      }
    };
    const float sl = (kCap || a.prescale) ? 1.f : p.scale_log2;  // log2-domain factor of the scores

    constexpr int OR = DC / 2, SR = BN / 2;  // accumulator floats per thread
    float o[OR];
#pragma unroll
    for (int i = 0; i < OR; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float s[SR];
    uint32_t pa[BN / 16][4];

    // KSPLIT > 1: s += the other warpgroup's partial S of block j (through shared memory).
    auto exchange = [&](int j) {
      if constexpr (KSPLIT > 1) {
        static_assert(KSPLIT == 2 && SR % 4 == 0, "two warpgroups exchange float4s");
        float4* xb = reinterpret_cast<float4*>(smem + (base + Cfg::OFF_X - smem_u32(smem)));
        const int wt = tid & 127, par = j & 1;
        float4* mine = xb + (par * 2 + cw) * (SR / 4) * 128 + wt;
        const float4* other = xb + (par * 2 + (1 - cw)) * (SR / 4) * 128 + wt;
#pragma unroll
        for (int i = 0; i < SR / 4; ++i)
          mine[i * 128] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
        ws::bar_sync(3, NC);
#pragma unroll
        for (int i = 0; i < SR / 4; ++i) {
          const float4 x = other[i * 128];
          // Both warpgroups add the same two numbers (commutative): bitwise the same S.
          s[4 * i] += x.x, s[4 * i + 1] += x.y, s[4 * i + 2] += x.z, s[4 * i + 3] += x.w;
        }
      }
    };
    // Scores of block j (in s) -> unnormalised probabilities (in place); updates the running max
    // and sum; corr = factor by which O must be rescaled.
    auto softmax = [&](int j, float (&corr)[2]) {
      const auto kb = walk.at(j);
      ws_fwd_block_softmax<BN, kCap, (KSPLIT > 1)>(
          p, s, kb, walk.masked(kb, wnq, CLUSTER > 1 ? kTileSize : BM, p.mask), a.prescale,
          pq_first + row_base + row0, tq, sl, m_run, l_run, corr);
    };
    auto issue_s = [&](int st) {
      const uint32_t sK = sK0 + st * Cfg::KV_BYTES;
      wgmma_rows_cols<T, BN, DC, BM, BN>(s, sQ, wrow, sK, 0, col0);
      wg_commit();
    };
    auto issue_pv = [&](int st) {
      // V's columns [col0, col0 + DC): SW128 column blocks of BN rows x 64 columns.
      const uint32_t sV = sV0 + st * Cfg::KV_BYTES + (col0 / 64) * (BN * 128);
      wgmma_rs_acc<T, DC, BN>(o, pa, sV);
      wg_commit();
    };

    pp.start();
    ws::mbar_wait(bQ, 0);
    ws_fwd_mainloop<T, S, DC / 8, (KSPLIT > 1)>(
        total, pp, s, o, pa, l_run, full_k, full_v, [&](int st) { release(empty_k(st)); },
        [&](int st) { release(empty_v(st)); }, issue_s, issue_pv, exchange, softmax);
    pp.finish();

    store_out_rows<T, D, DC>(p, o, m_run, l_run, sl, q0, nq, h, row0, tq, col0,
                             KSPLIT == 1 || cw == 0);
  }
  // No CTA of a cluster exits while its peer may still arrive on its barriers.
  if constexpr (CLUSTER > 1) ws::cluster_sync();
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

template <typename T, int D>
bool launch_forward_sm90_ws(const FwdParams& p, const KernelPolicy& policy, cudaStream_t stream) {
  using Cfg = FwdWsCfg<D>;
  const int64_t grid = int64_t(p.nqt) * (kTileSize / Cfg::BM) * p.Hq;
  if (grid == 0) return true;
  FwdWsArgs a{};
  if (!make_fwd_ws_args(a, p, policy, D, Cfg::BM, Cfg::BN)) return false;
  auto kernel = p.softcap > 0.f ? fwd_ws_kernel_sm90<T, D, true> : fwd_ws_kernel_sm90<T, D, false>;
  launch_kernel(kernel, grid, Cfg::THREADS, Cfg::SMEM, stream, a,
                "dualkv forward (sm90a, warp-specialised)", Cfg::CLUSTER);
  return true;
}

}  // namespace dualkv::cuda::detail
