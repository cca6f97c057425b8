// sm_90a D = 512 forward on 2-CTA clusters that split the head dim (the D = 512 forward on Hopper;
// the sm_80 one when a tensor map cannot be encoded). Design: src/cuda/NOTES.md, "Head dim 512";
// arithmetic and measurements: src/cuda/LAB_NOTEBOOK.md, "D = 512 forward on 2-CTA clusters" and
// "Eleventh session".
//   - One cluster of two CTAs per (128-query tile, q head). CTA rank r holds columns
//     [256r, 256r + 256) of Q (resident) and of every K / V block of the tile's key walk, and owns
//     those columns of O. Each producer loads only its own half (no multicast, no cluster-wide
//     stage barriers): the cluster still reads every K / V block once per 128 queries.
//   - Inside a CTA the D = 256 shape of fwd_ws_kernel_sm90: consumer warpgroup w owns query rows
//     [64w, 64w + 64) and the CTA's 256 columns of O (128 registers); BN = 64, 2 stages. S_j over
//     the CTA's 256 reduction columns is a partial. The half exchange with the same warpgroup of
//     the peer CTA (FwdD512HalfExchange): of each thread's two fragment rows (g, g + 8), CTA rank r
//     finalises row g + 8r: it sends the peer its partial of the other row by st.async
//     (distributed shared memory; the bytes complete the peer's xfull[w]), adds the peer's partial
//     of its own row, runs the softmax of that row only and sends the peer the row's P (bf16
//     A-fragment words) and rescale factor (xfull_p[w]). The peer's half of P_j and its factor
//     are taken in the next turn, after S_{j+1} is issued (fwd512_mainloop), so that transfer
//     overlaps a GEMM; then O += P_j V_j[:, own columns] (RS). Each P
//     element is computed by one CTA, so both CTAs use the same numbers. After the walk the two
//     CTAs swap their rows' running max and sum, and rank 0 writes lse. The two warpgroups work on
//     different rows, so they ping-pong their GEMM issue as the D <= 256 kernels do.
//   - Exchange buffer X[w] (one per warpgroup, single-buffered): words 0-3 the peer's partial
//     (xfull[w]; freed by the reader's 4 warps on the peer's xfree[w]), words 4-6 its P words and
//     factor, or after the walk its max and sum (xfull_p[w] / xfree_p[w]).
// TMA reads whole boxes: K / V rows past a region's end (inside T) are neighbouring tokens, masked
// to P = 0, as in the other warp-specialised kernels; Q rows past the tile's end are computed and
// not written.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "collective/online_softmax.cuh"
#include "collective/score_mod.cuh"
#include "launch.h"
#include "sm90/dsmem.cuh"
#include "sm90/fwd_mainloop.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/producers.cuh"
#include "sm90/sm90_ws.h"
#include "sm90/tma.cuh"
#include "sm90/warp_roles.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

struct FwdD512ClusterCfg : WsRoles<40, 232> {
  static constexpr int D = 512;
  static constexpr int CLUSTER = 2;       // CTAs splitting the head dim
  static constexpr int DH = D / CLUSTER;  // 256 columns per CTA (of Q, K, V and O)
  static constexpr int BM = kTileSize;    // 128 queries per cluster: 64 per consumer warpgroup
  static constexpr int BN = 64;           // keys per block
  static constexpr int STAGES = 2;
  static constexpr int OR = DH / 2;  // O floats per consumer thread (64 x 256)
  static constexpr int SR = BN / 2;  // S floats per consumer thread (64 x 64): 2 rows x 16
  static constexpr int Q_BYTES = BM * DH * 2;
  static constexpr int KV_BYTES = BN * DH * 2;
  // X[w]: 16-byte words per thread of the consumer warpgroup (word-major, [word][thread]).
  static constexpr int XW_PART = SR / 2 / 4;  // words 0-3: a row's 16 partial floats
  static constexpr int XW_P = XW_PART;        // words 4-5: a row's P, 8 packed bf16/fp16 pairs
  static constexpr int XW_F = XW_P + 2;       // word 6: the row's rescale factor, or (max, sum)
  static constexpr int X_VECS = XW_F + 1;
  static constexpr int X_BYTES = X_VECS * 128 * 16;      // per consumer warpgroup
  static constexpr int PART_BYTES = XW_PART * 128 * 16;  // one exchange of partials
  static constexpr int P_BYTES = (2 * 16 + 4) * 128;     // one exchange of P and factors
  static constexpr int FINAL_BYTES = 8 * 128;            // the rows' max and sum, at the end
  struct Barriers {                                      // mbarriers
    uint64_t q, full_k[STAGES], full_v[STAGES], empty_k[STAGES], empty_v[STAGES];
    uint64_t xfull[2];    // per warpgroup: the local arrive.expect_tx + the peer's partial
    uint64_t xfree[2];    // per warpgroup: the peer's 4 warps have read what this CTA sent
    uint64_t xfull_p[2];  // the same for the P words and factors (and the final max / sum)
    uint64_t xfree_p[2];
  };
  // Shared memory from the kernel's 1024-byte aligned base (SMEM adds the slack for that
  // alignment); the OFF_* offsets come from here.
  struct SharedStorage {
    uint16_t q[BM * DH];
    uint16_t k[STAGES][BN * DH];
    uint16_t v[STAGES][BN * DH];
    float4 x[2][X_VECS][128];  // X[w]: [word][thread of the warpgroup]
    Barriers bar;
  };
  static_assert(sizeof(SharedStorage::q) == Q_BYTES && sizeof(SharedStorage::k[0]) == KV_BYTES);
  static_assert(sizeof(SharedStorage::x[0]) == X_BYTES);
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int OFF_X = int(offsetof(SharedStorage, x));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
  static_assert(SMEM <= kSmemHeadDim512, "api.cu checks the GPU offers this much");
  static_assert(DH % 64 == 0 && BN == 64, "whole SW128 blocks; 16 floats per fragment row");
};

#if DUALKV_SM90_BODY
// The barriers of one CTA (addresses from the SharedStorage's Barriers member at b0).
struct FwdD512Bars {
  using Cfg = FwdD512ClusterCfg;
  using B = Cfg::Barriers;
  uint32_t b0;
  __device__ __forceinline__ uint32_t at(size_t off) const { return b0 + uint32_t(off); }
  __device__ __forceinline__ uint32_t q() const { return at(offsetof(B, q)); }
  __device__ __forceinline__ uint32_t full_k(int s) const {
    return at(offsetof(B, full_k)) + 8u * s;
  }
  __device__ __forceinline__ uint32_t full_v(int s) const {
    return at(offsetof(B, full_v)) + 8u * s;
  }
  __device__ __forceinline__ uint32_t empty_k(int s) const {
    return at(offsetof(B, empty_k)) + 8u * s;
  }
  __device__ __forceinline__ uint32_t empty_v(int s) const {
    return at(offsetof(B, empty_v)) + 8u * s;
  }
  __device__ __forceinline__ uint32_t xfull(int w) const { return at(offsetof(B, xfull)) + 8u * w; }
  __device__ __forceinline__ uint32_t xfree(int w) const { return at(offsetof(B, xfree)) + 8u * w; }
  __device__ __forceinline__ uint32_t xfull_p(int w) const {
    return at(offsetof(B, xfull_p)) + 8u * w;
  }
  __device__ __forceinline__ uint32_t xfree_p(int w) const {
    return at(offsetof(B, xfree_p)) + 8u * w;
  }
  // Thread 0 initialises them, then the cluster synchronises: the peer's barriers are initialised
  // before any st.async or remote arrival.
  __device__ __forceinline__ void init(int tid) const {
    if (tid == 0) {
      ws::mbar_init(q(), 1);
      ws::ring_init<Cfg::STAGES>([&](int s) { return full_k(s); },
                                 [&](int s) { return empty_k(s); }, 1, Cfg::CONSUMERS);
      ws::ring_init<Cfg::STAGES>([&](int s) { return full_v(s); },
                                 [&](int s) { return empty_v(s); }, 1, Cfg::CONSUMERS);
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        ws::mbar_init(xfull(w), 1);
        ws::mbar_init(xfree(w), 4);  // one arrival per warp of the peer's warpgroup w
        ws::mbar_init(xfull_p(w), 1);
        ws::mbar_init(xfree_p(w), 4);
      }
      ws::mbar_init_fence();
    }
    ws::cluster_sync();
  }
};

// Consumer warpgroup cw's half exchange with the same warpgroup of the peer CTA, through X[cw]
// (words of FwdD512ClusterCfg). A thread's score fragment holds rows g and g + 8 (slots
// 4 nt + 2 r + {0, 1}); CTA rank r finalises row g + 8r, which own_row_first moves into the row-0
// slots by selects (no register array is indexed at run time). The same thread of the peer holds
// the same rows and columns.
struct FwdD512HalfExchange : ws::PeerWords {
  using Cfg = FwdD512ClusterCfg;
  static constexpr int NT = Cfg::SR / 4;  // n-tiles of 8 keys: P words of a row
  using B = Cfg::Barriers;
  uint32_t bx;  // xfull(cw); xfree(cw), xfull_p(cw), xfree_p(cw) at these offsets from it
  static constexpr uint32_t XFULL = 0, XFREE = offsetof(B, xfree) - offsetof(B, xfull),
                            XFULL_P = offsetof(B, xfull_p) - offsetof(B, xfull),
                            XFREE_P = offsetof(B, xfree_p) - offsetof(B, xfull);
  __device__ __forceinline__ FwdD512HalfExchange(uint32_t base, const FwdD512Bars& bars, int cw,
                                                 int t_, uint32_t rank_)
      : ws::PeerWords{base + uint32_t(Cfg::OFF_X + cw * Cfg::X_BYTES + t_ * 16), rank_, t_},
        bx(bars.xfull(cw)) {}
  __device__ __forceinline__ void own_row_first(float (&s)[Cfg::SR]) const {
#pragma unroll
    for (int i = 0; i < Cfg::SR; i += 4)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float a = s[i + c], b = s[i + 2 + c];
        s[i + c] = rank ? b : a;
        s[i + 2 + c] = rank ? a : b;
      }
  }
  // Block j's partial s (complete in registers): own row into the row-0 slots, the other row's
  // partial to the peer, the peer's partial of the own row added.
  //   1. arm this block's phase of xfull[cw] (this arrival + the peer's PART_BYTES; the peer's
  //      bytes may land first: the phase cannot complete before this arrival);
  //   2. wait until the peer's warpgroup has read block j - 1's partial (xfree, parity of j - 1;
  //      block 0 passes: a fresh barrier's parity-1 phase counts as completed), send;
  //   3. wait for the peer's partial (cluster-scope acquire), add it, free X's partial words.
  __device__ __forceinline__ void swap_add(float (&s)[Cfg::SR], int j) const {
    own_row_first(s);
    if (t == 0) ws::mbar_expect_tx(bx + XFULL, Cfg::PART_BYTES);
    ws::mbar_wait(bx + XFREE, (uint32_t(j) & 1u) ^ 1u);
    const uint32_t px = peer(xs), pbar = peer(bx + XFULL);
#pragma unroll
    for (int i = 0; i < Cfg::XW_PART; ++i)  // row-1 slots of n-tiles 2i, 2i + 1
      ws::st_async_f32x4(px + uint32_t(i) * WS, s[8 * i + 2], s[8 * i + 3], s[8 * i + 6],
                         s[8 * i + 7], pbar);
    ws::mbar_wait_cluster(bx + XFULL, uint32_t(j) & 1u);
#pragma unroll
    for (int i = 0; i < Cfg::XW_PART; ++i) {
      const float4 x = word<float4>(i);
      s[8 * i] += x.x, s[8 * i + 1] += x.y, s[8 * i + 4] += x.z, s[8 * i + 5] += x.w;
    }
    free_peer(bx + XFREE);
  }
  // After block j's softmax of the own row (its probabilities in the row-0 slots of s, its
  // factor c): own <- the row's A-fragment words, sent to the peer with c once the peer has read
  // block j - 1's (xfree_p).
  template <typename T>
  __device__ __forceinline__ void send_p(const float (&s)[Cfg::SR], float c, uint32_t (&own)[NT],
                                         int j) const {
#pragma unroll
    for (int n = 0; n < NT; ++n) own[n] = pack2<T>(s[4 * n], s[4 * n + 1]);
    if (t == 0) ws::mbar_expect_tx(bx + XFULL_P, Cfg::P_BYTES);
    ws::mbar_wait(bx + XFREE_P, (uint32_t(j) & 1u) ^ 1u);
    const uint32_t px = peer(xs), pbar = peer(bx + XFULL_P);
    ws::st_async_b32x4(px + Cfg::XW_P * WS, make_uint4(own[0], own[1], own[2], own[3]), pbar);
    ws::st_async_b32x4(px + (Cfg::XW_P + 1) * WS, make_uint4(own[4], own[5], own[6], own[7]), pbar);
    ws::st_async_f32(px + Cfg::XW_F * WS, c, pbar);
  }
  // The peer's half of block j: corr (on entry: the own row's factor in corr[0]) <- both rows'
  // factors in fragment order, pa (K-step kt: n-tiles 2 kt, 2 kt + 1, rows g, g + 8) <- P.
  template <int KT>
  __device__ __forceinline__ void recv_p(int j, const uint32_t (&own)[NT], float (&corr)[2],
                                         uint32_t (&pa)[KT][4]) const {
    static_assert(2 * KT == NT, "two n-tiles per K-step");
    ws::mbar_wait_cluster(bx + XFULL_P, uint32_t(j) & 1u);
    const uint4 u0 = word<uint4>(Cfg::XW_P), u1 = word<uint4>(Cfg::XW_P + 1);
    const float c = word<float>(Cfg::XW_F);
    free_peer(bx + XFREE_P);
    const uint32_t other[NT] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      pa[n / 2][2 * (n % 2)] = rank ? other[n] : own[n];      // row g
      pa[n / 2][2 * (n % 2) + 1] = rank ? own[n] : other[n];  // row g + 8
    }
    const float c_own = corr[0];
    corr[0] = rank ? c : c_own;
    corr[1] = rank ? c_own : c;
  }
  // After the walk (phase j = total of xfull_p): the own row's running max and sum (slot 0) to
  // the peer; m / l <- both rows in fragment order.
  __device__ __forceinline__ void swap_stats(int j, float (&m)[2], float (&l)[2]) const {
    if (t == 0) ws::mbar_expect_tx(bx + XFULL_P, Cfg::FINAL_BYTES);
    ws::mbar_wait(bx + XFREE_P, (uint32_t(j) & 1u) ^ 1u);
    ws::st_async_f32x2(peer(xs) + Cfg::XW_F * WS, m[0], l[0], peer(bx + XFULL_P));
    ws::mbar_wait_cluster(bx + XFULL_P, uint32_t(j) & 1u);
    const float2 w = word<float2>(Cfg::XW_F);
    const float mo = m[0], lo = l[0];
    m[0] = rank ? w.x : mo, m[1] = rank ? mo : w.x;
    l[0] = rank ? w.y : lo, l[1] = rank ? lo : w.y;
  }
};
#endif

#if DUALKV_SM90_BODY
// The D = 512 cluster forward's consumer mainloop (after the Q wait, inside the ping-pong's
// start/finish): block 0's S, then per block j a turn that issues S_j, takes the peer's half of
// P_{j-1} and the rescale factors (x.recv_p: sent after the peer's softmax, so the transfer
// overlaps S_j's GEMM), rescales O and issues P_{j-1} V_{j-1}; then block j's half exchange of the
// partial S (x.swap_add), the own row's softmax and its P to the peer (softmax(j, corr): its
// corr[0]), and the P V wait; the last turn issues the last block's P V.
template <typename T, int S, int NC, int SR, int OR, int KT, class Bars, class Softmax,
          class IssueS, class IssuePV>
__device__ __forceinline__ void fwd512_mainloop(int total, const PingPong<NC>& pp,
                                                const FwdD512HalfExchange& x, const Bars& bars,
                                                float (&s)[SR], float (&o)[OR],
                                                uint32_t (&pa)[KT][4],
                                                const uint32_t (&pown)[FwdD512HalfExchange::NT],
                                                const float (&l_run)[2], Softmax&& softmax,
                                                IssueS&& issue_s, IssuePV&& issue_pv) {
  constexpr int ND = OR / 4;
  if (total <= 0) return;
  float corr[2];
  // S_j's partial complete: its K stage released, the half exchange, the own row's softmax.
  auto scores = [&](int j) {
    fence_regs(s);
    ws::mbar_arrive(bars.empty_k(Ring<S>::stage(j)));
    x.swap_add(s, j);
    softmax(j, corr);
  };
  // In a turn: the peer's half of P_j, the rescale of O, O += P_j V_j.
  auto pv = [&](int j) {
    x.recv_p(j, pown, corr, pa);
    rescale_o_rows<ND, true>(o, corr);
    fence_regs(pa, o);
    wg_fence();
    issue_pv(Ring<S>::stage(j));
  };

  ws::mbar_wait(bars.full_k(0), 0);
  pp.begin_turn();
  wg_fence();
  issue_s(0);
  pp.end_turn();
  wg_wait<0>();
  scores(0);
  for (int j = 1; j < total; ++j) {
    const int st = Ring<S>::stage(j), pst = Ring<S>::stage(j - 1);
    ws::mbar_wait(bars.full_k(st), Ring<S>::full_parity(j));
    ws::mbar_wait(bars.full_v(pst), Ring<S>::full_parity(j - 1));
    pp.begin_turn();
    fence_regs(o);
    wg_fence();
    issue_s(st);  // S_j = Q K_j^T
    pv(j - 1);    // O += P_{j-1} V_{j-1}
    pp.end_turn();
    wg_wait<1>();  // S_j done; P V still in flight
    scores(j);
    // Keep the exp2s before the wait (ws_fwd_mainloop).
    fence_regs(s);
    if (l_run[0] + l_run[1] < 0.f) asm volatile("nanosleep.u32 0;");
    wg_wait<0>();
    fence_regs(o, pa);
    ws::mbar_arrive(bars.empty_v(pst));
  }
  // The last block's P V.
  ws::mbar_wait(bars.full_v(Ring<S>::stage(total - 1)), Ring<S>::full_parity(total - 1));
  pp.begin_turn();
  pv(total - 1);
  pp.end_turn();
  wg_wait<0>();
  fence_regs(o, pa);
}
#endif

template <typename T, bool kCap>
__global__ void __launch_bounds__(384, 1)
    fwd_d512_cluster_kernel_sm90(const __grid_constant__ FwdWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = FwdD512ClusterCfg;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  constexpr int DH = Cfg::DH, OR = Cfg::OR, SR = Cfg::SR;
  const FwdParams& p = a.p;
  const SmemBase sm;
  const uint32_t sQ = sm.base, sK0 = sm.base + Cfg::OFF_K, sV0 = sm.base + Cfg::OFF_V;
  const FwdD512Bars bars{sm.base + Cfg::OFF_BAR};

  // blockIdx.x = (tile * Hq + q head) * 2 + rank: the two CTAs of a cluster share every index but
  // the rank, so they agree on validity and on the key walk.
  const uint32_t rank = blockIdx.x & 1u;
  const QueryTileCta<BM> cta(p, blockIdx.x >> 1);
  if (!cta.valid) return;  // both CTAs of the cluster, before any cluster barrier
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;
  const int cb0 = int(rank) * DH;  // this CTA's first column

  const KeyBlockWalk<BN> walk(p, cta.seg, q0, nq);
  const int total = walk.total, pq_first = walk.pq_first;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  bars.init(tid);

  if (warp < 4) {
    // ---- producer warpgroup: one thread issues every copy (this CTA's column half) -----------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (tid == 0) {
      ws_fwd_producer<S, DH / 64, BM, Cfg::Q_BYTES, Cfg::KV_BYTES>(
          a, walk, sQ, sK0, sV0, bars.q(), cb0, h, q0, [&](int s) { return bars.full_k(s); },
          [&](int s) { return bars.full_v(s); }, [&](int s) { return bars.empty_k(s); },
          [&](int s) { return bars.empty_v(s); },
          [&](const CUtensorMap* map, uint32_t dst, uint32_t bar, int row) {
            ws::tma_load3_cols<DH / 64, BN>(dst, map, bar, cb0, hk, row);
          });
    }
  } else {
    // ---- consumer warpgroups: cw owns query rows [64 cw, 64 cw + 64), the CTA's 256 columns --
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const int cw = (warp >> 2) - 1;
    const int wrow = cw * 64;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = wrow + (warp & 3) * 16 + g;  // rows row0, row0 + 8
    const PingPong<NC> pp(a.pingpong != 0, cw);
    const FwdD512HalfExchange x(sm.base, bars, cw, tid & 127, rank);
    const float sl = (kCap || a.prescale) ? 1.f : p.scale_log2;  // log2-domain factor of the scores

    float o[OR];
    zero_frag(o);
    // The own row's running max and sum in slot 0 (both rows, fragment order, after swap_stats).
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float s[SR];
    uint32_t pa[BN / 16][4];
    uint32_t pown[FwdD512HalfExchange::NT];  // the own row's P of the latest block, packed

    // Scores of block j -> the own row's unnormalised probabilities (in the row-0 slots), its
    // running max and sum, corr[0] = the factor by which its O row must be rescaled (exactly 1
    // where the max did not move); then its P and factor go to the peer.
    auto softmax = [&](int j, float (&corr)[2]) {
      const auto kb = walk.at(j);
      ws_fwd_block_softmax<BN, kCap, true, 1>(p, s, kb, walk.masked(kb, nq, BM, p.mask), a.prescale,
                                              pq_first + row0 + 8 * int(rank), tq, sl, m_run, l_run,
                                              corr);
      x.send_p<T>(s, corr[0], pown, j);
    };
    auto issue_s = [&](int st) {
      wgmma_rows_cols<T, BN, DH, BM, BN>(s, sQ, wrow, sK0 + st * Cfg::KV_BYTES, 0, 0);
      wg_commit();
    };
    auto issue_pv = [&](int st) {
      wgmma_rs_acc<T, DH, BN>(o, pa, sV0 + st * Cfg::KV_BYTES);
      wg_commit();
    };

    pp.start();
    ws::mbar_wait(bars.q(), 0);
    fwd512_mainloop<T, S>(total, pp, x, bars, s, o, pa, pown, l_run, softmax, issue_s, issue_pv);
    pp.finish();
    x.swap_stats(total, m_run, l_run);

    // Both CTAs hold the same m_run / l_run: rank 0 writes lse.
    store_out_rows<T, Cfg::D, DH>(p, o, m_run, l_run, sl, q0, nq, h, row0, tq, cb0, rank == 0);
  }
  // No CTA of a cluster exits while its peer may still write to or arrive on its shared memory.
  ws::cluster_sync();
#endif
}

template <typename T>
bool launch_forward_sm90_d512c(const FwdParams& p, const KernelPolicy& policy,
                               cudaStream_t stream) {
  using Cfg = FwdD512ClusterCfg;
  constexpr int D = Cfg::D;
  const int64_t grid = int64_t(p.nqt) * p.Hq * Cfg::CLUSTER;
  if (grid == 0) return true;
  FwdWsArgs a{};
  if (!make_fwd_ws_args(a, p, policy, D, Cfg::BM, Cfg::BN)) return false;
  auto kernel = p.softcap > 0.f ? fwd_d512_cluster_kernel_sm90<T, true>
                                : fwd_d512_cluster_kernel_sm90<T, false>;
  launch_kernel(kernel, grid, Cfg::THREADS, Cfg::SMEM, stream, a,
                "dualkv forward D=512 (sm90a, warp-specialised, 2-CTA clusters)", Cfg::CLUSTER);
  return true;
}

}  // namespace dualkv::cuda::detail
