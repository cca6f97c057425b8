// sm_90a D = 512 backward: warp-specialised dK/dV and dQ kernels on wgmma in 2-CTA clusters that
// split the head dim: the default D = 512 backward on Hopper; DUALKV_SM90_D512_BWD=0 runs the
// sm_80 one (A/B, cross-check). Design: src/cuda/NOTES.md, "Head dim 512"; arithmetic and
// history: src/cuda/LAB_NOTEBOOK.md, "D = 512 dK/dV on wgmma", "D = 512 backward: the exchange
// behind the previous block's products" and "Tenth session". The dK/dV kernel (the dQ kernel is
// described above its Cfg):
//   - One cluster of two CTAs per (64-key half of a key tile, kv head). CTA rank r holds columns
//     [256r, 256r + 256) of K, V and of every Q / dO block, and owns those columns of dK and dV.
//     Both CTAs walk the same query blocks of 64 in the fixed order of query_walk.cuh (as every
//     dK/dV kernel: deterministic, atomic-free).
//   - Producer warp 0 (per CTA, its own half only): TMA for K and V once, then per query block
//     Q and dO by TMA, lse2/delta rows by cp.async on the same full barrier, and a record
//     {q head, count, first position, first row} or "end", through a 2-stage ring (as
//     dkdv_ws_kernel_sm90).
//   - Consumer warpgroup w (both own the CTA's 64 keys): the partial S^T and dP^T of queries
//     32w..32w+31 over the CTA's 256 columns (m64n32k16 SS), then the half exchange with the same
//     warpgroup of the peer CTA (Ws512HalfExchange; distributed shared memory, st.async bytes
//     completing the peer's barriers): CTA r finalises 16 of the 32 queries. It sends the peer
//     the partials of the other 16, adds the peer's partials of its own, computes P and dS
//     (softcap: tanh of the summed S) of its 16, shares their P^T / dS^T slices with its other
//     warpgroup through X (named barrier) and sends them to the peer. One CTA computes each P /
//     dS element, so both CTAs use the same numbers.
//   - Block j's dV += P^T dO and dK += dS^T Q (m64n128k16 RS on the warpgroup's 128 columns,
//     the peer's slices arriving by then) are issued behind block j + 1's S^T / dP^T and retired
//     inside block j + 1's exchange, so the round trip runs while the tensor cores work; block
//     j's ring stage is released there.
//   - Exchange buffer X[w] (16 KB per warpgroup): the peer's halves of the partials, the slices
//     kept for the other warpgroup, the peer's slices; the xfree / xfree_d barriers tell the peer
//     when it may refill them.
// TMA reads whole boxes, so rows past a region's end (inside T) are neighbouring tokens; they are
// masked (P = 0, dS = 0), as in the other warp-specialised kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "collective/epilogue.cuh"
#include "collective/query_walk.cuh"
#include "collective/score_mod.cuh"
#include "sm90/dsmem.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/producers.cuh"
#include "sm90/warp_roles.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

// What the two D = 512 kernels share: the split of the head dim over a 2-CTA cluster, blocks of
// 64 rows on both sides, the 2-stage ring (the dQ kernel: K and V rings of its own), the warp roles
// and register split, and the exchange buffer X[w] of each consumer warpgroup (its HP = 32 rows of
// the S / dP partials: S^T and dP^T for dK/dV, S and dP for dQ).
struct Ws512Cfg : WsRoles<40, 232> {
  static constexpr int D = 512;
  static constexpr int CLUSTER = 2;       // CTAs splitting the head dim
  static constexpr int DH = D / CLUSTER;  // 256 columns per CTA
  static constexpr int DW = DH / 2;       // 128 output columns per consumer warpgroup
  static constexpr int BN = 64;           // keys per CTA or per block
  static constexpr int BM = 64;           // queries per block or per CTA
  static constexpr int HP = 32;           // rows of a warpgroup's partial products
  static constexpr int HR = HP / 2;       // their fragment floats per thread
  static constexpr int STAGES = 2;
  static constexpr int X_VECS = 2 * HR / 4;          // float4s per thread: the two partials
  static constexpr int X_BYTES = X_VECS * 128 * 16;  // per consumer warpgroup
  // The barriers of a ring of s stages (and sv of a separate V ring), xf xfree barriers and two
  // pairs of slice-exchange barriers: Ws512Bars<s, sv, xf>.
  static constexpr int nbars(int s, int sv, int xf) { return 1 + 2 * s + 2 * sv + 2 + xf + 4; }
  static_assert(DW % 64 == 0 && DH % 64 == 0, "whole SW128 column blocks");
};

struct DkdvWs512Cfg : Ws512Cfg {
  static constexpr int HQ = HP;  // queries of a warpgroup's S^T / dP^T
  // Shared memory from the kernel's 1024-byte aligned base (SMEM adds the slack for that
  // alignment); the OFF_* offsets come from here: the producer's tiles (this CTA's column half)
  // and rows (DkdvSmem), and the exchange buffers.
  using Tiles = DkdvTiles<BN, BM, DH, STAGES>;
  struct SharedStorage {
    Tiles t;
    float x[2][X_BYTES / 4];  // X[w] per consumer warpgroup
    DkdvRows<BM, STAGES> r;
    uint64_t bar[nbars(STAGES, 0, 1)];
  };
  static constexpr int OFF_X = int(offsetof(SharedStorage, x));
  static constexpr int OFF_ROWS = int(offsetof(SharedStorage, r));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
  static_assert(SMEM <= kSmemHeadDim512, "api.cu checks the GPU offers this much");
  // The slices (2 x 2 x 16-query A fragments of 16 bytes per thread) fit in X[w] at words the
  // thread itself has read.
  static_assert(X_VECS >= 2 * (HQ / 16), "slices reuse the exchange buffer");
};

#if DUALKV_SM90_BODY
// The barriers of a D = 512 CTA (1 + 2 S + 2 SV + 2 + XF from `b0`): b0 itself for the resident
// tiles, the ring's full[S] / empty[S] (SV > 0: the K ring, and fullv[SV] / emptyv[SV] a separate
// V ring; SV = 0: one ring for both streamed tiles), xfull[w] (the peer's partials for warpgroup w
// have arrived: the local arrive.expect_tx plus the peer's bytes) and xfree (XF = 1: the peer's 8
// consumer warps have read their slices, so its X may be refilled; XF = 2: xfree(w), the peer's
// warpgroup w's 4 warps have read its partials).
template <int S, int SV, int XF = 1>
struct Ws512Bars {
  static constexpr int XD = 2;  // xfull_d / xfree_d per warpgroup
  static constexpr int NBARS = Ws512Cfg::nbars(S, SV, XF);
  uint32_t b0;
  __device__ __forceinline__ uint32_t full(int s) const { return b0 + 8u * (1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return b0 + 8u * (1 + S + s); }
  __device__ __forceinline__ uint32_t fullv(int s) const { return b0 + 8u * (1 + 2 * S + s); }
  __device__ __forceinline__ uint32_t emptyv(int s) const { return b0 + 8u * (1 + 2 * S + SV + s); }
  __device__ __forceinline__ uint32_t xfull(int w) const {
    return b0 + 8u * (1 + 2 * S + 2 * SV + w);
  }
  __device__ __forceinline__ uint32_t xfree(int w) const {
    return b0 + 8u * (3 + 2 * S + 2 * SV + (XF > 1 ? w : 0));
  }
  // The half exchange's slices: the peer's slices for warpgroup w's X have arrived / the peer's
  // warps that read them (xd_count of init) have.
  __device__ __forceinline__ uint32_t xfull_d(int w) const {
    return b0 + 8u * (3 + 2 * S + 2 * SV + XF + w);
  }
  __device__ __forceinline__ uint32_t xfree_d(int w) const {
    return b0 + 8u * (3 + 2 * S + 2 * SV + XF + XD + w);
  }
  // Thread 0 initialises them (full: `full_count` arrivals), then the cluster synchronises: the
  // peer's barriers are initialised before any st.async or remote arrival.
  // xd_count: arrivals per phase of xfree_d (the peer's warps that read a slice word).
  __device__ __forceinline__ void init(int tid, uint32_t full_count, uint32_t xd_count = 4) const {
    constexpr uint32_t NC = Ws512Cfg::CONSUMERS;
    if (tid == 0) {
      ws::mbar_init(b0, 1);
      ws::ring_init<S>([&](int s) { return full(s); }, [&](int s) { return empty(s); }, full_count,
                       NC);
      if constexpr (SV > 0)
        ws::ring_init<SV>([&](int s) { return fullv(s); }, [&](int s) { return emptyv(s); },
                          full_count, NC);
      ws::mbar_init(xfull(0), 1);  // the local arrive.expect_tx; the peer's bytes complete it
      ws::mbar_init(xfull(1), 1);
      for (int w = 0; w < XF; ++w) ws::mbar_init(xfree(w), NC / 32 / XF);  // the peer's warps
      for (int w = 0; w < XD; ++w) {
        ws::mbar_init(xfull_d(w), 1);
        ws::mbar_init(xfree_d(w), xd_count);
      }
      ws::mbar_init_fence();
    }
    ws::cluster_sync();
  }
};

// The half exchange (consumer warpgroup cw with the same warpgroup of the peer CTA). Of the
// warpgroup's 32 query (dK/dV) or key (dQ) rows of the partials, CTA rank r finalises the 16 rows
// 16r.. (fragment floats 8r..8r + 7 of the m64n32 accumulators): it sends the peer the partials of
// the other 16 (8 KB per warpgroup instead of 16), adds the peer's partials of its own, computes P
// and dS of its 16 rows only, and sends their NS slices (A fragments: dS for dQ, P^T and dS^T for
// dK/dV; NS x 2 KB) to the peer, whose products use them a block later. One CTA computes each P /
// dS element, so both use the same numbers. Words of X[w] (16 bytes per thread): 0-1 the S partial,
// 2-3 the dP partial, then LS words of slices kept locally for the other warpgroup (dK/dV: LS =
// NS), then NS words of the peer's slices.
template <int NS, int LS, class Bars>
struct Ws512HalfExchange : ws::PeerWords {
  using Cfg = Ws512Cfg;
  static constexpr int H = Cfg::HR / 2;            // floats of one CTA's half of a partial
  static constexpr int P_BYTES = 2 * H * 128 * 4;  // both partials' halves, per warpgroup
  static constexpr int D_BYTES = NS * 128 * 16;    // the slices sent per warpgroup
  static constexpr int LW = 2 * H / 4;             // first local-slice word
  static constexpr int RW = LW + LS;               // first remote-slice word
  static_assert(Cfg::X_VECS >= RW + NS, "the halves and the slices fit in X[cw]");
  Bars bars;  // the barrier addresses: immediate offsets from its b0
  int cw;
  __device__ __forceinline__ Ws512HalfExchange(uint32_t base, int off_x, const Bars& bars_, int cw_,
                                               int t_, uint32_t rank_)
      : ws::PeerWords{base + uint32_t(off_x + cw_ * Cfg::X_BYTES + t_ * 16), rank_, t_},
        bars(bars_),
        cw(cw_) {}
  // Floats 0..H-1 <- this CTA's half (8 rank..), H.. <- the peer's, by selects.
  __device__ __forceinline__ void own_half_first(float (&v)[Cfg::HR]) const {
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float a = v[i], b = v[i + H];
      v[i] = rank ? b : a;
      v[i + H] = rank ? a : b;
    }
  }
  __device__ __forceinline__ void arm_partials() const {
    if (t == 0) ws::mbar_expect_tx(bars.xfull(cw), P_BYTES);
  }
  // This block's phase of xfull_d(cw) (after the previous block's has completed).
  __device__ __forceinline__ void arm_slices() const {
    if (t == 0) ws::mbar_expect_tx(bars.xfull_d(cw), D_BYTES);
  }
  __device__ __forceinline__ void send_half(const float (&v)[Cfg::HR], int w0) const {
    const uint32_t px = peer(xs), pbar = peer(bars.xfull(cw));
#pragma unroll
    for (int i = 0; i < H / 4; ++i)
      ws::st_async_f32x4(px + uint32_t(w0 + i) * WS, v[H + 4 * i], v[H + 4 * i + 1],
                         v[H + 4 * i + 2], v[H + 4 * i + 3], pbar);
  }
  // Block j's partials a (S), b (dP) in flight as two commit groups, then (G = 3) a third one, the
  // previous block's products (G = 2: none, the first block). The peer's halves of a and b are
  // sent as they complete (once the peer's X[cw] is free), b_done runs once b has completed (the
  // dQ kernel releases V_j there), done once everything has (it releases the previous block's ring
  // stage), then the peer's partials of this CTA's half are added (floats 0..H-1 after
  // own_half_first): the DSMEM round trip runs behind the previous block's products. (The two
  // group counts are two code paths: an empty commit group after a conditional wgmma made ptxas
  // add a dummy wgmma group, whose waits then also waited for the products.) kFree: X[cw]'s
  // partial words are free for the peer's next block at once (per-warpgroup xfree); otherwise
  // release() frees them later.
  template <int G, bool kFree, typename FB, typename F>
  __device__ __forceinline__ void swap_add_pipe(float (&a)[Cfg::HR], float (&b)[Cfg::HR], int j,
                                                FB&& b_done, F&& done) const {
    static_assert(G == 2 || G == 3, "two or three commit groups");
    ws::mbar_wait(bars.xfree(cw), (uint32_t(j) & 1u) ^ 1u);
    wg_wait<G - 1>();
    fence_regs(a);
    own_half_first(a);
    send_half(a, 0);
    wg_wait<G - 2>();
    b_done();
    fence_regs(b);
    own_half_first(b);
    send_half(b, H / 4);
    wg_wait<0>();
    done();
    ws::mbar_wait_cluster(bars.xfull(cw), uint32_t(j) & 1u);
#pragma unroll
    for (int i = 0; i < H / 4; ++i) {
      const float4 x = word<float4>(i), y = word<float4>(H / 4 + i);
      a[4 * i] += x.x, a[4 * i + 1] += x.y, a[4 * i + 2] += x.z, a[4 * i + 3] += x.w;
      b[4 * i] += y.x, b[4 * i + 1] += y.y, b[4 * i + 2] += y.z, b[4 * i + 3] += y.w;
    }
    if constexpr (kFree) release();
  }
  // Tells the peer X[cw]'s partial words may be refilled (one arrival per warp).
  __device__ __forceinline__ void release() const { free_peer(bars.xfree(cw)); }
  // This CTA's slices of block j to the peer, once the peer has read block j - 1's.
  __device__ __forceinline__ void send_slices(const uint32_t (&f)[NS][4], int j) const {
    ws::mbar_wait(bars.xfree_d(cw), (uint32_t(j) & 1u) ^ 1u);
    const uint32_t px = peer(xs), pbar = peer(bars.xfull_d(cw));
#pragma unroll
    for (int n = 0; n < NS; ++n)
      ws::st_async_b32x4(px + uint32_t(RW + n) * WS, make_uint4(f[n][0], f[n][1], f[n][2], f[n][3]),
                         pbar);
  }
  // Word w of this thread's place in warpgroup w2's X.
  __device__ __forceinline__ void get_word(int w2, int w, uint32_t (&f)[4]) const {
    const uint4 u = word<uint4>(w, (w2 - cw) * Cfg::X_BYTES);
    f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w;
  }
  // The slices for the other warpgroup (read by get_local after a named barrier).
  __device__ __forceinline__ void put_local(const uint32_t (&f)[NS][4]) const {
#pragma unroll
    for (int n = 0; n < LS; ++n) put(LW + n, make_uint4(f[n][0], f[n][1], f[n][2], f[n][3]));
  }
  __device__ __forceinline__ void get_local(int w2, int n, uint32_t (&f)[4]) const {
    get_word(w2, LW + n, f);
  }
  // The peer's slice n of block j in warpgroup w2's X (after wait_remote(w2, j)).
  __device__ __forceinline__ void wait_remote(int w2, int j) const {
    ws::mbar_wait_cluster(bars.xfull_d(w2), uint32_t(j) & 1u);
  }
  __device__ __forceinline__ void get_remote(int w2, int n, uint32_t (&f)[4]) const {
    get_word(w2, RW + n, f);
  }
  // Warpgroup w2's remote slices have been read by this warp.
  __device__ __forceinline__ void free_remote(int w2) const { free_peer(bars.xfree_d(w2)); }
  // The A fragments of the warpgroup's 32 rows in order: slice 0 is rank 0's.
  __device__ __forceinline__ void order(uint32_t (&da)[2][4], const uint32_t (&own)[4],
                                        const uint32_t (&other)[4]) const {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      da[0][c] = rank ? other[c] : own[c];
      da[1][c] = rank ? own[c] : other[c];
    }
  }
};
#endif

// Block j's dV/dK products are issued behind block j + 1's S^T/dP^T (a third commit group) and
// retired inside the exchange of block j + 1 (Ws512HalfExchange::swap_add_pipe), so the round trip
// runs while the tensor cores work; the ring stage of block j is released there. Each CTA
// accumulates its local slices first, then the peer's (deterministic: a fixed order per rank).
template <typename T, bool kCap>
__global__ void __launch_bounds__(384, 1)
    dkdv_ws512_kernel_sm90(const __grid_constant__ DkdvWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = DkdvWs512Cfg;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES;
  constexpr int DH = Cfg::DH, DW = Cfg::DW, HQ = Cfg::HQ, HR = Cfg::HR;
  const BwdParams& p = a.p;
  const DkdvSmem<Cfg> sm;
  const Ws512Bars<S, 0, 1> bars{sm.kv_bar};

  // blockIdx.x = unit * 2 + rank, the unit ((tile * 2 + half) * Hkv + kv head, after key_order's
  // renumbering) shared by the two CTAs of a cluster, so they agree on validity and on the walk.
  const uint32_t rank = blockIdx.x & 1u;
  const KeyTileCta<BN> cta(p, blockIdx.x >> 1);
  if (!cta.valid) return;  // both CTAs of the cluster, before any cluster barrier
  const int hk = cta.hk, k0 = cta.k0, nk = cta.nk, ksi = cta.ksi;
  const int pk_first = cta.pk_first, pk_last = cta.pk_last;
  const Segment& kseg = cta.kseg;
  const int cb0 = int(rank) * DH;  // this CTA's first column

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  bars.init(tid, sm.FULL_COUNT, Cfg::CONSUMERS / 32);  // xfree_d: both peer warpgroups read

  if (warp < 4) {
    // ---- producer: warp 0 walks the query blocks (this CTA's column half) --------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (warp == 0) {
      dkdv_producer_warp(a, sm, kseg, ksi, hk, k0, pk_first, pk_last, cb0, lane, [&](QIter& cur) {
        // query_walk_next, spelled out (as dkdv_ws_kernel_sm90: the call made the producer
        // spill at 24 registers).
        if (++cur.qb < cur.qb_end) return true;
        bool valid = seek_query_region<BM>(p, kseg, ksi, cur.si + 1, pk_first, pk_last, cur);
        if (!valid && ++cur.hi < p.group)
          valid = seek_query_region<BM>(p, kseg, ksi, ksi, pk_first, pk_last, cur);
        return valid;
      });
    }
  } else {
    // ---- consumers ---------------------------------------------------------------------------
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const int cw = (warp >> 2) - 1;  // consumer warpgroup: queries HQ cw.., columns DW cw..
    const int t = tid & 127;
    const int g = lane >> 2, tq = lane & 3;
    const int kr0 = (warp & 3) * 16 + g;  // key rows kr0, kr0 + 8
    const int q_off = cw * HQ;
    constexpr int AR = DW / 2;
    float dk[AR], dv[AR];
    zero_frag(dk);
    zero_frag(dv);
    const float* lse_s = sm.lse();
    const Ws512HalfExchange<2, 2, std::remove_cv_t<decltype(bars)>> hx(sm.base, Cfg::OFF_X, bars,
                                                                       cw, t, rank);
    const uint32_t half = uint32_t(cw * DW / 64) * (BM * 128);  // this warpgroup's column blocks
    // The P^T / dS^T A fragments of all BM queries of block it - 1 (live across block it's S^T /
    // dP^T until their dV/dK products have completed) and that block's stage: [0..1] this CTA's
    // slices of warpgroups 0, 1 (queries 16 (2w + rank)..), [2..3] the peer's.
    uint32_t pa[BM / 16][4], da[BM / 16][4];
    int prev_s = 0;
    // dV += P^T dO, dK += dS^T Q from stage st's tiles, issued.
    auto products = [&](int st) {
      const int rk = int(rank), rows[BM / 16] = {rk, 2 + rk, 1 - rk, 3 - rk};
      wgmma_rs_acc_rows<T, DW, BM>(dv, pa, sm.dout(st) + half, rows);
      wgmma_rs_acc_rows<T, DW, BM>(dk, da, sm.q(st) + half, rows);
    };
    // The peer's slices of block jj (it may then send block jj + 1's).
    auto recv_remote = [&](int jj) {
#pragma unroll
      for (int w2 = 0; w2 < 2; ++w2) {
        hx.wait_remote(w2, jj);
        hx.get_remote(w2, 0, pa[2 + w2]);
        hx.get_remote(w2, 1, da[2 + w2]);
      }
      hx.free_remote(0);
      hx.free_remote(1);
    };
    // ... waited for; then the stage is released.
    auto retire = [&](int st) {
      fence_regs(pa, da, dv, dk);
      wg_fence();
      products(st);
      wg_commit();
      wg_wait<0>();
      fence_regs(dv, dk, pa, da);
      ws::mbar_arrive(bars.empty(st));
    };

    ws::mbar_wait(bars.b0, 0);
    int it = 0;
    for (;; ++it) {
      const int s = Ring<S>::stage(it);
      int nq, pq_first;
      if (!sm.wait_block(s, it, nq, pq_first)) break;
      const bool msk =
          needs_mask(nq, BM, nk, BN, pq_first, pq_first + nq - 1, pk_first, pk_last, p.mask);
      const uint32_t sQ = sm.q(s), sdO = sm.dout(s);
      const float* lse_c = lse_s + s * 2 * BM;
      const float* del_c = lse_c + BM;
      hx.arm_partials();

      float sc[HR], dp[HR];
      wg_fence();
      wgmma_rows_cols<T, HQ, DH, BN, BM>(sc, sm.k, 0, sQ, q_off, 0);
      wg_commit();
      wgmma_rows_cols<T, HQ, DH, BN, BM>(dp, sm.v, 0, sdO, q_off, 0);
      wg_commit();
      if (it > 0) {  // block it - 1's dV += P^T dO, dK += dS^T Q (its fragments, its stage)
        recv_remote(it - 1);
        hx.arm_slices();  // block it's phase (block it - 1's has completed)
        wg_fence();       // (ptxas injects it otherwise: the fragments' registers)
        products(prev_s);
        wg_commit();
        hx.template swap_add_pipe<3, false>(
            sc, dp, it, [] {},
            [&] {
              fence_regs(dv, dk, pa, da);
              ws::mbar_arrive(bars.empty(prev_s));
            });
      } else {
        hx.arm_slices();
        hx.template swap_add_pipe<2, false>(sc, dp, it, [] {}, [] {});
      }
      // P (and dsoftcap) and dS of this CTA's 16 of the warpgroup's queries (floats 0..7 after
      // own_half_first), as dkdv_ws256_kernel_sm90's.
      constexpr int NF = decltype(hx)::H;
      const int qf = q_off + 16 * int(rank);
#pragma unroll
      for (int i = 0; i < NF; ++i) {
        const int qc = qf + (i >> 2) * 8 + 2 * tq + (i & 1);
        float dcap;
        const float xl = score_log2<kCap>(p, sc[i], dcap);
        const float pr = fast_exp2(xl - lse_c[qc]);
        sc[i] = pr;
        dp[i] = pr * (dp[i] - del_c[qc]) * dcap;
      }
      mask_fragment<NF>(
          msk,
          [&](int i) {
            const int qc = qf + (i >> 2) * 8 + 2 * tq + (i & 1);
            const int kr = kr0 + ((i >> 1) & 1) * 8;
            return DUALKV_VISIBLE_KQ(p.mask, kr, nk, pk_first, qc, nq, pq_first);
          },
          [&](int i) { sc[i] = dp[i] = 0.f; });
      // This CTA's 16-query slices of P^T and dS^T: to the other warpgroup through X[cw] and to
      // the peer; the local ones of both warpgroups back (the peer's arrive by next block).
      uint32_t own[2][4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        own[0][c] = pack2<T>(sc[2 * c], sc[2 * c + 1]);
        own[1][c] = pack2<T>(dp[2 * c], dp[2 * c + 1]);
      }
      hx.put_local(own);
      hx.send_slices(own, it);
      ws::bar_sync(1, Cfg::CONSUMERS);
#pragma unroll
      for (int w2 = 0; w2 < 2; ++w2) {
        hx.get_local(w2, 0, pa[w2]);
        hx.get_local(w2, 1, da[w2]);
      }
      hx.release();    // X's partial words, once both warpgroups have read the local slices
      fence_regs(pa);  // in registers before the next block's wgmma.fence
      fence_regs(da);
      prev_s = s;  // the products go behind the next block's S^T / dP^T
    }
    if (it > 0) {  // the last block's products
      recv_remote(it - 1);
      retire(prev_s);
    }
    store_dkdv_rows<T, Cfg::D, DW>(p, dk, dv, k0, nk, hk, kr0, cb0 + cw * DW, tq);
  }
  // No CTA of a cluster exits while its peer may still write to or arrive on its shared memory.
  ws::cluster_sync();
#endif
}

// The dQ pass of the same design: one cluster of two CTAs per (64-query half of a query tile, q
// head), CTA rank r holding columns [256r, 256r + 256) of Q, dO (resident) and of every K / V
// block of the key walk (KeyBlockWalk over the CTA's 64 queries, as the forward), and owning those
// columns of dQ. Consumer warpgroup w takes keys 32w..32w+31 of each block: their partial S and dP
// over the CTA's columns (m64n32k16 SS), exchanged with the peer; then P, dS and
// dQ_w += dS K[its 32 keys] on all 256 columns (m64n256k16 RS, 128 accumulator registers). The two
// warpgroups never meet inside the loop (no shared slices, no named barrier, an xfree barrier
// each), so one's exchange wait overlaps the other's products; after the loop they add their two
// partial dQ through shared memory (the K ring's tiles), each finishing 128 columns. The exchange
// is the half exchange (Ws512HalfExchange: each CTA finalises 16 of the 32 keys and sends the peer
// their dS slice), block j's product behind block j + 1's S / dP.
// Same accumulation order in every run (the walk is fixed): deterministic.
struct DqWs512Cfg : Ws512Cfg {
  static constexpr int HK = HP;                 // keys of a warpgroup's S / dP
  static constexpr int Q_BYTES = BM * DH * 2;   // one CTA's half of Q (and of dO)
  static constexpr int KV_BYTES = BN * DH * 2;  // its half of a K (and V) block
  // K and V on separate rings: the consumers hold a K tile for two blocks (block j's dQ product
  // runs in block j + 1) but a V tile only until block j's dP, so 3 K stages + 1 V stage
  // keep a load of each in flight in the 4 tiles that 2 stages of both used.
  static constexpr int K_STAGES = 3, V_STAGES = 1;
  static constexpr int STAGES = 0;  // hides Ws512Cfg::STAGES (the dK/dV kernel's ring)
  struct SharedStorage {            // from the 1024-byte aligned base, as DkdvWs512Cfg's
    uint16_t q[BM * DH];
    uint16_t dout[BM * DH];
    uint16_t k[K_STAGES][BN * DH];
    uint16_t v[V_STAGES][BN * DH];
    float x[2][X_BYTES / 4];  // X[w] per consumer warpgroup
    uint64_t bar[nbars(K_STAGES, V_STAGES, 2)];
  };
  static_assert(sizeof(SharedStorage::q) == Q_BYTES && sizeof(SharedStorage::k[0]) == KV_BYTES);
  static constexpr int OFF_DO = int(offsetof(SharedStorage, dout));
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int OFF_X = int(offsetof(SharedStorage, x));
  static constexpr int OFF_BAR = int(offsetof(SharedStorage, bar));
  static constexpr int SMEM = smem_bytes<SharedStorage>();
  static_assert(SMEM <= kSmemHeadDim512, "api.cu checks the GPU offers this much");
  // The two warpgroups' partial dQ (the other's half of the columns, 64 x 128 fp32 each) meet in
  // the K ring's tiles after the loop.
  static_assert(2 * BM * DW * 4 <= K_STAGES * KV_BYTES, "the dQ halves fit in the K ring");
};

template <typename T, bool kCap>
__global__ void __launch_bounds__(384, 1)
    dq_ws512_kernel_sm90(const __grid_constant__ DkdvWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = DqWs512Cfg;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::K_STAGES, SV = Cfg::V_STAGES;
  constexpr int NC = Cfg::CONSUMERS;
  constexpr int DH = Cfg::DH, DW = Cfg::DW, HK = Cfg::HK, HR = Cfg::HR;
  const BwdParams& p = a.p;
  const SmemBase sm;
  const uint32_t sQ = sm.base, sdO = sm.base + Cfg::OFF_DO, sK0 = sm.base + Cfg::OFF_K,
                 sV0 = sm.base + Cfg::OFF_V;
  const Ws512Bars<S, SV, 2> bars{sm.base + Cfg::OFF_BAR};
  const uint32_t bQ = bars.b0;

  // blockIdx.x = ((tile * 2 + half) * Hq + q head) * 2 + rank (see dkdv_ws512_kernel_sm90).
  const uint32_t rank = blockIdx.x & 1u;
  const QueryTileCta<BM> cta(p, blockIdx.x >> 1);
  if (!cta.valid) return;  // both CTAs of the cluster, before any cluster barrier
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;
  const Segment& seg = cta.seg;
  const int cb0 = int(rank) * DH;

  const KeyBlockWalk<BN> walk(p, seg, q0, nq);
  const int total = walk.total, pq_first = walk.pq_first;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  bars.init(tid, 1);

  if (warp < 4) {
    // ---- producer: one thread, this CTA's column half ----------------------------------------
    ws::reg_dealloc<Cfg::PRODUCER_REGS>();
    if (tid == 0) {
      dq_producer_thread<BM, BN, S, DH / 64, SV>(
          a, walk, total, h, hk, q0, cb0, sQ, sdO, bQ, sK0, sV0,
          [&](int s) { return bars.full(s); }, [&](int s) { return bars.empty(s); },
          [&](int s) { return bars.fullv(s); }, [&](int s) { return bars.emptyv(s); });
    }
  } else {
    // ---- consumers ---------------------------------------------------------------------------
    ws::reg_alloc<Cfg::CONSUMER_REGS>();
    const int cw = (warp >> 2) - 1;  // keys HK cw.. of each block
    const int t = tid & 127;
    const int g = lane >> 2, tq = lane & 3;
    const int row0 = (warp & 3) * 16 + g;  // query rows row0, row0 + 8
    const int k_off = cw * HK;
    float lse2[2], del[2];
    load_row_stats(p, h, q0, nq, row0, lse2, del);
    float acc[DH / 2];  // this warpgroup's keys' share of the CTA's DH columns of dQ
    zero_frag(acc);
    const Ws512HalfExchange<1, 0, std::remove_cv_t<decltype(bars)>> hx(sm.base, Cfg::OFF_X, bars,
                                                                       cw, t, rank);
    // The dS A fragments of the warpgroup's HK keys of block j - 1 until its product has completed
    // (built from this CTA's slice and the peer's) and that block's stage.
    uint32_t da[HK / 16][4], ds_own[1][4], ds_other[4];
    // The peer's dS slice of block jj (it may then send block jj + 1's).
    auto recv_slice = [&](int jj) {
      hx.wait_remote(cw, jj);
      hx.get_remote(cw, 0, ds_other);
      hx.free_remote(cw);
    };
    int prev_s = 0;
    // dQ += dS K (rows k_off.. of the K tile of stage st), issued.
    auto product = [&](int st) {
      wgmma_rs_acc<T, DH, BN>(acc, da, sK0 + st * Cfg::KV_BYTES + uint32_t(k_off) * 128u);
    };
    // ... waited for; then the stage is released.
    auto retire = [&](int st) {
      fence_regs(da, acc);
      wg_fence();
      product(st);
      wg_commit();
      wg_wait<0>();
      fence_regs(acc, da);
      ws::mbar_arrive(bars.empty(st));
    };

    ws::mbar_wait(bQ, 0);
    for (int j = 0; j < total; ++j) {
      const int s = Ring<S>::stage(j), sv = Ring<SV>::stage(j);
      ws::mbar_wait(bars.full(s), Ring<S>::full_parity(j));
      ws::mbar_wait(bars.fullv(sv), Ring<SV>::full_parity(j));
      const uint32_t sK = sK0 + s * Cfg::KV_BYTES, sV = sV0 + sv * Cfg::KV_BYTES;
      hx.arm_partials();

      float sc[HR], dp[HR];
      wg_fence();
      wgmma_rows_cols<T, HK, DH, BM, BN>(sc, sQ, 0, sK, k_off, 0);
      wg_commit();
      wgmma_rows_cols<T, HK, DH, BM, BN>(dp, sdO, 0, sV, k_off, 0);
      wg_commit();
      if (j > 0) {  // block j - 1's dQ += dS K, once the peer's dS slice is here
        recv_slice(j - 1);
        hx.order(da, ds_own[0], ds_other);
        hx.arm_slices();  // block j's phase (block j - 1's has completed)
        wg_fence();
        product(prev_s);
        wg_commit();
        hx.template swap_add_pipe<3, true>(
            sc, dp, j, [&] { ws::mbar_arrive(bars.emptyv(sv)); },  // dP has read V_j
            [&] {
              fence_regs(acc, da);
              ws::mbar_arrive(bars.empty(prev_s));
            });
      } else {
        hx.arm_slices();
        hx.template swap_add_pipe<2, true>(
            sc, dp, j, [&] { ws::mbar_arrive(bars.emptyv(sv)); }, [] {});
      }
      // P and dS of this CTA's 16 keys (floats 0..7 after own_half_first).
      const auto kb = walk.at(j);
      const bool msk = walk.masked(kb, nq, BM, p.mask);
      constexpr int NF = decltype(hx)::H;
      const int kr0 = kb.off + k_off + 16 * int(rank);
#pragma unroll
      for (int i = 0; i < NF; ++i) {
        const int r = (i >> 1) & 1;
        float dcap;
        const float xl = score_log2<kCap>(p, sc[i], dcap);
        dp[i] = fast_exp2(xl - lse2[r]) * (dp[i] - del[r]) * dcap;
      }
      mask_fragment<NF>(
          msk,
          [&](int i) {
            const int kr = kr0 + (i >> 2) * 8 + 2 * tq + (i & 1);
            return DUALKV_VISIBLE(p.mask, kb, pq_first + row0 + 8 * ((i >> 1) & 1), kr);
          },
          [&](int i) { dp[i] = 0.f; });
#pragma unroll
      for (int c = 0; c < 4; ++c) ds_own[0][c] = pack2<T>(dp[2 * c], dp[2 * c + 1]);
      hx.send_slices(ds_own, j);  // the product waits for the peer's slice (next block)
      prev_s = s;
    }
    if (total > 0) {  // the last block's product
      recv_slice(total - 1);
      hx.order(da, ds_own[0], ds_other);
      retire(prev_s);
    }
    // acc holds this warpgroup's keys' share of all DH columns; warpgroup cw finishes columns
    // [DW cw, DW cw + DW): it hands the other half to the other warpgroup through the K ring
    // (free: every product has completed once both warpgroups pass the first barrier) and adds
    // the other's share of its own half (own + other: the same two numbers in every run).
    constexpr int HALF = DW / 2;  // floats per thread of 64 x DW
    float4* red = reinterpret_cast<float4*>(sm.gbase + Cfg::OFF_K);
    // acc[i] of half hf, by selects (a run-time index would put acc in local memory).
    auto half_at = [&](int hf, int i) { return hf == 0 ? acc[i] : acc[HALF + i]; };
    ws::bar_sync(1, NC);
#pragma unroll
    for (int i = 0; i < HALF / 4; ++i) {
      const int o = 4 * i, other = 1 - cw;
      red[(cw * (HALF / 4) + i) * 128 + t] = make_float4(
          half_at(other, o), half_at(other, o + 1), half_at(other, o + 2), half_at(other, o + 3));
    }
    ws::bar_sync(1, NC);
    float fin[HALF];
#pragma unroll
    for (int i = 0; i < HALF / 4; ++i) {
      const float4 v = red[((1 - cw) * (HALF / 4) + i) * 128 + t];
      const int o = 4 * i;
      fin[o] = half_at(cw, o) + v.x, fin[o + 1] = half_at(cw, o + 1) + v.y;
      fin[o + 2] = half_at(cw, o + 2) + v.z, fin[o + 3] = half_at(cw, o + 3) + v.w;
    }
    store_dq_rows<T, Cfg::D, DW>(p, fin, q0, nq, h, row0, cb0 + cw * DW, tq);
  }
  ws::cluster_sync();
#endif
}

}  // namespace dualkv::cuda::detail
