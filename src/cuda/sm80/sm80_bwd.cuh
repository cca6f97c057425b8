// sm_80 backward (mma.sync m16n8k16, ldmatrix, cp.async). Runs on sm_80+.
//
//   1. bwd_pre (collective/bwd_preprocess.cuh): delta = rowsum(dO * O) - dlse and
//      lse2 = lse * log2(e) into the workspace.
//   2. dkdv: one CTA per (key block, kv head). It loops, in a fixed order, over every q head of
//      the kv head's group and every query block that sees the key block (its segment's own later
//      queries, then those of each descendant segment; in the depth-two layout a prompt key
//      block's responses; the walk: collective/query_walk.cuh), accumulating dK and dV in
//      registers: deterministic, no atomics.
//      Each warp owns 16 keys (S^T = K Q^T lives in registers as the A operand of dV += P^T dO and
//      dK += dS^T Q).
//   3. dq: one CTA per (64-query block, q head) walks the key blocks like the forward pass and
//      accumulates dQ in registers (fixed order). Every output is bitwise reproducible. (A fused
//      variant adding dS K into an fp32 accumulator with atomics was slower than this pass and was
//      deleted; src/cuda/LAB_NOTEBOOK.md, "Defaults and deletions".)
// kSmall (GPUs with less shared memory per block than the regular configs need,
// KernelPolicy::sm80_small_smem): at D = 512 16-key dK/dV CTAs over 16-query blocks and 16-query
// dQ CTAs (BwdCfg, DqCfg), each at most 96.3 KB, whose slab exchange reuses the other stage's
// buffer, the next load then issued after the exchange (XSTAGE); at D = 256 the dQ pass on
// 16-key blocks (96 KB; the regular dK/dV config, 99 KB, runs there as it is).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/epilogue.cuh"
#include "collective/query_walk.cuh"
#include "collective/score_mod.cuh"
#include "launch.h"

namespace dualkv::cuda::detail {

// ---- 1. preprocess: collective/bwd_preprocess.cuh (shared by every backward path) ----------

// The two products of a backward step over KSTEPS 16-column steps of the head dim from column
// c0, for the warp's 16 rows of A / Ao (ldmatrix rows a_row, a_col) and all NB rows of B / Bo:
// x += A B^T, y += Ao Bo^T (n-tiled mma.sync fragments). dK/dV: S^T = K Q^T and dP^T = V dO^T;
// dQ: S = Q K^T and dP = dO V^T.
template <typename T, int D, int KSTEPS, int NT>
__device__ __forceinline__ void two_products(float (&x)[NT][4], float (&y)[NT][4], uint32_t sA,
                                             uint32_t sAo, uint32_t sB, uint32_t sBo, uint32_t c0,
                                             int a_row, int a_col, int b_row, int b_col) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    uint32_t a[4], ao[4];
    ldsm_x4(a, sA + c0 + swz<D>(a_row, kk * 16 + a_col));
    ldsm_x4(ao, sAo + c0 + swz<D>(a_row, kk * 16 + a_col));
#pragma unroll
    for (int n2 = 0; n2 < NT / 2; ++n2) {
      uint32_t b[4], bo[4];
      ldsm_x4(b, sB + c0 + swz<D>(n2 * 16 + b_row, kk * 16 + b_col));
      mma<T>(x[2 * n2], a, b[0], b[1]);
      mma<T>(x[2 * n2 + 1], a, b[2], b[3]);
      ldsm_x4(bo, sBo + c0 + swz<D>(n2 * 16 + b_row, kk * 16 + b_col));
      mma<T>(y[2 * n2], ao, bo[0], bo[1]);
      mma<T>(y[2 * n2 + 1], ao, bo[2], bo[3]);
    }
  }
}

// The DSPLIT warps of one slab (warps slab * DSPLIT + [0, DSPLIT)) have each computed a partial
// sum of the same two fragment arrays (over their share of the reduction dim): afterwards every
// one of them holds the full sums, added in the same order (so bitwise equal in all of them).
// xb: shared memory of WARPS * (NA + NB) float4s per lane; one __syncthreads (all threads).
template <int DSPLIT, int NA, int NB>
__device__ __forceinline__ void sum_slab_partials(float4* xb, float (&a)[NA][4], float (&b)[NB][4],
                                                  int warp, int lane) {
  constexpr int NV = NA + NB;
  auto at = [&](int w, int i) -> float4& { return xb[(w * NV + i) * 32 + lane]; };
#pragma unroll
  for (int i = 0; i < NA; ++i) at(warp, i) = make_float4(a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
  for (int i = 0; i < NB; ++i) at(warp, NA + i) = make_float4(b[i][0], b[i][1], b[i][2], b[i][3]);
  __syncthreads();
  const int w0 = warp - warp % DSPLIT;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float4 t = at(w0, i);
#pragma unroll
    for (int d = 1; d < DSPLIT; ++d) {
      const float4 u = at(w0 + d, i);
      t.x += u.x, t.y += u.y, t.z += u.z, t.w += u.w;
    }
    float* f = i < NA ? a[i] : b[i - NA];
    f[0] = t.x, f[1] = t.y, f[2] = t.z, f[3] = t.w;
  }
}

// Both kernels' block step of the two products (dK/dV: S^T, dP^T; dQ: S, dP) with fresh
// accumulators: over the whole head dim, or (Cfg::XCHG) over this warp's D / DSPLIT columns from
// column block dpart, then summed over the slab's warps through the exchange buffer xb.
template <class Cfg, typename T, int D, int NT>
__device__ __forceinline__ void slab_products(float (&x)[NT][4], float (&y)[NT][4], uint32_t sA,
                                              uint32_t sAo, uint32_t sB, uint32_t sBo, int dpart,
                                              int a_row, int a_col, int b_row, int b_col,
                                              unsigned char* xb, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
    y[i][0] = y[i][1] = y[i][2] = y[i][3] = 0.f;
  }
  constexpr int KSTEPS = Cfg::XCHG ? D / 16 / Cfg::DSPLIT : D / 16;
  // Byte offset of the warp's first column (a multiple of 64 columns: the swizzle's 8-chunk
  // pattern is unchanged, so the offset just adds).
  const uint32_t c0 = Cfg::XCHG ? uint32_t(dpart * KSTEPS * 16 * 2) : 0u;
  two_products<T, D, KSTEPS>(x, y, sA, sAo, sB, sBo, c0, a_row, a_col, b_row, b_col);
  if constexpr (Cfg::XCHG)
    sum_slab_partials<Cfg::DSPLIT>(reinterpret_cast<float4*>(xb), x, y, warp, lane);
}

// ---- 2. dK, dV over key blocks ------------------------------------------------------------------
// kSmall (D = 512): BN 16, BM 16; K + V 32 KB, two Q/dO stages 64 KB, lse/delta 256 B: 96.3 KB;
// 4 warps (one slab, DSPLIT 4: dK + dV 16 x 128 fp32 per warp as in the regular config); the
// exchange (8 KB) lives in the other stage's Q buffer (XSTAGE).
template <int D, bool kSmall = false>
struct BwdCfg {
  static_assert(!kSmall || D == 512, "the small shared-memory config is D = 512's");
  static constexpr int BN = kSmall ? 16 : D >= 256 ? 32 : 64;  // keys per CTA
  static constexpr int BM = kSmall ? 16 : D >= 128 ? 32 : 64;  // queries per iteration
  static constexpr int DSPLIT = D >= 512 ? 4
                                : D >= 256
                                    ? 2
                                    : 1;  // warps sharing a 16-key slab (split dK/dV columns)
  static constexpr int WARPS = (BN / 16) * DSPLIT;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int DC = D / DSPLIT;  // dK/dV columns per warp
  static constexpr int PITCH = BM + 8;   // dS^T row pitch (elements), conflict-free
  // D = 512: the DSPLIT warps of a slab split S^T's and dP^T's reduction dim too (each
  // D / DSPLIT columns) and add their partials through shared memory (sum_slab_partials) instead
  // of each computing them in full.
  static constexpr bool XCHG = D >= 512;
  static constexpr int X_VECS = WARPS * (BM / 8) * 2 * 32;  // float4s of the exchange (XCHG)
  // XSTAGE: the exchange in the Q buffer of the stage not being computed on (free between the
  // previous iteration's end and this one's issue of the next block, which then follows the
  // exchange instead of starting the iteration).
  static constexpr bool XSTAGE = kSmall;
  static constexpr bool X_OWN = XCHG && !XSTAGE;  // x has shared memory of its own
  // Shared memory; the OFF_* offsets come from here. x is last: without X_OWN SMEM ends before it.
  struct SharedStorage {
    uint16_t k[BN * D];
    uint16_t v[BN * D];
    uint16_t q[2][BM * D];  // two stages
    uint16_t dout[2][BM * D];
    float lse2[2][BM];
    float delta[2][BM];
    // Unused since the atomic-dQ variant was deleted; kept (for now) so that x's offset, and with
    // it the D = 512 machine code, stays the same (removing it changes shared memory per CTA: an
    // A/B of its own). Not in the small config.
    uint16_t ds[kSmall ? 1 : BN * PITCH];
    float4 x[X_OWN ? X_VECS : 1];
  };
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int OFF_Q = int(offsetof(SharedStorage, q));
  static constexpr int OFF_DO = int(offsetof(SharedStorage, dout));
  static constexpr int OFF_L = int(offsetof(SharedStorage, lse2));  // lse2[2][BM], delta[2][BM]
  static constexpr int OFF_X = int(offsetof(SharedStorage, x));
  static constexpr int SMEM = OFF_X + (X_OWN ? int(sizeof(SharedStorage::x)) : 0);
  static constexpr int MIN_BLOCKS = D >= 512 ? 1 : 2;  // D = 512: dK + dV are 128 registers
  static constexpr bool FRESH_ADDR = kSmall;  // load_tile's row offsets per call (0 spills)
  static_assert(2 * BM <= THREADS, "bad backward tile config");
  static_assert(!XSTAGE || (XCHG && X_VECS * 16 <= BM * D * 2), "the exchange fits a Q stage");
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
};
static_assert(BwdCfg<512>::SMEM <= kSmemHeadDim512, "api.cu checks the GPU offers this much");
static_assert(BwdCfg<512, true>::SMEM <= kSmemSmall, "api.cu checks this much");
// D = 256 has no small dK/dV config: the regular one fits (launch_backward_sm80).
static_assert(BwdCfg<256>::SMEM <= kSmemSmall, "BwdCfg<256> runs where the small configs do");

template <typename T, int D, bool kCap, bool kSmall>
__global__ void __launch_bounds__(BwdCfg<D, kSmall>::THREADS, BwdCfg<D, kSmall>::MIN_BLOCKS)
    dkdv_kernel_sm80(const __grid_constant__ BwdParams p) {
  using Cfg = BwdCfg<D, kSmall>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, THREADS = Cfg::THREADS, DC = Cfg::DC;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sK = smem_u32(smem), sV = sK + Cfg::OFF_V;
  const uint32_t sQ0 = sK + Cfg::OFF_Q, sdO0 = sK + Cfg::OFF_DO, sL0 = sK + Cfg::OFF_L;
  const float* lse_s = reinterpret_cast<const float*>(smem + Cfg::OFF_L);  // [2][BM]
  const float* del_s = lse_s + 2 * BM;                                     // [2][BM]

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const KeyTileCta<BN> cta(p);
  if (!cta.valid) return;
  const int hk = cta.hk, k0 = cta.k0, nk = cta.nk, ksi = cta.ksi;
  const int pk_first = cta.pk_first, pk_last = cta.pk_last;
  const Segment& kseg = cta.kseg;

  load_tile<BN, D, THREADS, Cfg::FRESH_ADDR>(
      sK, static_cast<const T*>(p.k) + int64_t(k0) * p.k_tok + int64_t(hk) * p.k_head, p.k_tok, nk);
  load_tile<BN, D, THREADS, Cfg::FRESH_ADDR>(
      sV, static_cast<const T*>(p.v) + int64_t(k0) * p.v_tok + int64_t(hk) * p.v_head, p.v_tok, nk);

  auto issue = [&](const QIter& it, int stage) {
    load_query_block<T, BM, D, THREADS, BM * D * 2, Cfg::FRESH_ADDR>(p, it, hk, tid, stage, sQ0,
                                                                     sdO0, sL0);
  };
  auto advance = [&](QIter& it) {
    return query_walk_next<BM>(p, kseg, ksi, pk_first, pk_last, it);
  };

  QIter cur;
  bool valid = query_walk_begin<BM>(p, kseg, ksi, pk_first, pk_last, cur);
  if (valid) issue(cur, 0);
  cp_commit();

  const int g = lane >> 2, tq = lane & 3;
  const int slab = warp / Cfg::DSPLIT, dpart = warp % Cfg::DSPLIT;
  const int dbase = dpart * DC;
  const int a_row = slab * 16 + (lane & 15), a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
  const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3), t_col = (lane >> 4) * 8;
  const int kr0 = slab * 16 + g;  // key rows kr0 and kr0 + 8 (within the block)

  float dk[DC / 8][4], dv[DC / 8][4];
#pragma unroll
  for (int i = 0; i < DC / 8; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }

  // XSTAGE: the walk steps after the exchange in sm_80 machine code, before it in sm_90a's (either
  // order is correct; each is the one ptxas compiles without spills at 255 registers).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kLateWalk = false;
#else
  constexpr bool kLateWalk = Cfg::XSTAGE;
#endif
  int stage = 0;
  while (valid) {
    QIter nxt = cur;
    bool has_next = false;
    if constexpr (!kLateWalk) has_next = advance(nxt);
    // cp_pipeline_step spelled out: through the helper nvcc schedules this loop differently
    if (!Cfg::XSTAGE && has_next) {
      issue(nxt, stage ^ 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();  // XSTAGE: the next block is issued after the exchange
    }
    __syncthreads();

    const int nq = cur.count(BM);
    const int pq_first = cur.pos(BM);
    const bool msk =
        needs_mask(nq, BM, nk, BN, pq_first, pq_first + nq - 1, pk_first, pk_last, p.mask) ||
        nk < BN;
    const uint32_t sQ = sQ0 + stage * BM * D * 2, sdO = sdO0 + stage * BM * D * 2;
    const float* lse_c = lse_s + stage * BM;
    const float* del_c = del_s + stage * BM;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BM queries (XCHG: over this warp's
    // D / DSPLIT columns, then summed over the slab's warps).
    float s[BM / 8][4], dp[BM / 8][4];
    slab_products<Cfg, T, D>(
        s, dp, sK, sV, sQ, sdO, dpart, a_row, a_col, b_row, b_col,
        smem + (Cfg::XSTAGE ? Cfg::OFF_Q + (stage ^ 1) * BM * D * 2 : Cfg::OFF_X), warp, lane);
    if constexpr (Cfg::XSTAGE) {
      __syncthreads();  // every warp has read its sums: the other stage is free
      if constexpr (kLateWalk) has_next = advance(nxt);
      if (has_next) issue(nxt, stage ^ 1);
      cp_commit();
    }

    // P^T and dS^T (in place of s and dp).
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * tq + (e & 1);
        const int kr = kr0 + (e >> 1) * 8;
        float x, dcap = 1.f;
        x = score_log2<kCap>(p, s[nt][e], dcap);
        float pr = fast_exp2(x - lse_c[qc]);
        if (msk && !DUALKV_VISIBLE_KQ(p.mask, kr, nk, pk_first, qc, nq, pq_first)) pr = 0.f;
        s[nt][e] = pr;
        dp[nt][e] = pr * (dp[nt][e] - del_c[qc]) * dcap;
      }
    }

    // dV += P^T dO, dK += dS^T Q (this warp's DC columns).
#pragma unroll
    for (int kt = 0; kt < BM / 16; ++kt) {
      uint32_t ap[4], ad[4];
      pack_a_ktile<T>(ap, s, kt);
      pack_a_ktile<T>(ad, dp, kt);
#pragma unroll
      for (int n2 = 0; n2 < DC / 16; ++n2) {
        uint32_t b[4];
        ldsm_x4_t(b, sdO + swz<D>(kt * 16 + t_row, dbase + n2 * 16 + t_col));
        mma<T>(dv[2 * n2], ap, b[0], b[1]);
        mma<T>(dv[2 * n2 + 1], ap, b[2], b[3]);
        ldsm_x4_t(b, sQ + swz<D>(kt * 16 + t_row, dbase + n2 * 16 + t_col));
        mma<T>(dk[2 * n2], ad, b[0], b[1]);
        mma<T>(dk[2 * n2 + 1], ad, b[2], b[3]);
      }
    }

    __syncthreads();
    cur = nxt;
    valid = has_next;
    stage ^= 1;
  }
  cp_wait<0>();

  // dK = scale * sum dS^T Q, dV = sum P^T dO; key rows < nk.
  store_dkdv_rows<T, D, DC>(p, dk, dv, k0, nk, hk, kr0, dbase, tq);
}

// ---- 3'. deterministic dQ over query blocks -----------------------------------------------------
// kSmall (D = 512): BM 16; Q + dO 32 KB, two K/V stages 64 KB: 96 KB; 4 warps (one slab, DSPLIT
// 4: dQ 16 x 128 fp32 per warp); the exchange (8 KB) in the other stage's K buffer (XSTAGE).
// kSmall (D = 256): BN 16; Q + dO 64 KB, two K/V stages 32 KB: 96 KB; 4 warps as the regular.
template <int D, bool kSmall = false>
struct DqCfg {
  static_assert(!kSmall || D >= 256, "the small shared-memory configs are D = 256's and 512's");
  static constexpr int BM = kSmall && D >= 512 ? 16 : 64;
  static constexpr int BN = D >= 512 || (kSmall && D >= 256) ? 16 : D >= 256 ? 32 : 64;
  // Warps sharing a 16-query slab, each owning D / DSPLIT columns of dQ (each computes the
  // slab's S and dP in full).
  static constexpr int DSPLIT = kSmall && D >= 512 ? 4 : D >= 512 ? 2 : 1;
  static constexpr int DC = D / DSPLIT;
  static constexpr int WARPS = BM / 16 * DSPLIT;
  static constexpr int THREADS = WARPS * 32;
  // D = 512: the slab's warps split S's and dP's reduction dim too and add their partials
  // through shared memory (sum_slab_partials).
  static constexpr bool XCHG = D >= 512;
  static constexpr int X_VECS = WARPS * (BN / 8) * 2 * 32;  // float4s of the exchange (XCHG)
  static constexpr bool XSTAGE = kSmall && XCHG;  // as in BwdCfg (the other stage's K buffer)
  static constexpr bool X_OWN = XCHG && !XSTAGE;
  // Shared memory; the OFF_* offsets come from here. x is last: without X_OWN SMEM ends before it.
  struct SharedStorage {
    uint16_t q[BM * D];
    uint16_t dout[BM * D];
    uint16_t k[2][BN * D];  // two stages
    uint16_t v[2][BN * D];
    float4 x[X_OWN ? X_VECS : 1];
  };
  static constexpr int OFF_DO = int(offsetof(SharedStorage, dout));
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int OFF_X = int(offsetof(SharedStorage, x));
  static constexpr int SMEM = OFF_X + (X_OWN ? int(sizeof(SharedStorage::x)) : 0);
  static constexpr int MIN_BLOCKS = D >= 512 ? 1 : 2;
  static constexpr bool FRESH_ADDR = kSmall;  // as in BwdCfg
  static_assert(!XSTAGE || (XCHG && X_VECS * 16 <= BN * D * 2), "the exchange fits a K stage");
};
static_assert(sm80_configs_fit<DqCfg>(), "policy.h's smem_regular / kSmemSmall");

template <typename T, int D, bool kCap, bool kSmall>
__global__ void __launch_bounds__(DqCfg<D, kSmall>::THREADS, DqCfg<D, kSmall>::MIN_BLOCKS)
    dq_kernel_sm80(const __grid_constant__ BwdParams p) {
  using Cfg = DqCfg<D, kSmall>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, DC = Cfg::DC;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem), sdO = sQ + Cfg::OFF_DO;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const QueryTileCta<BM> cta(p);
  if (!cta.valid) return;
  const int h = cta.h, q0 = cta.q0, nq = cta.nq;

  load_q_do_rows<T, BM, D, Cfg::THREADS, Cfg::FRESH_ADDR>(p, q0, nq, h, sQ, sdO);

  const QueryTileKv<T, D, Cfg> kv(p, cta, sQ);
  const int total = kv.walk.total, pq_first = kv.walk.pq_first;
  if (total > 0) kv.load(0, 0);
  cp_commit();

  const int g = lane >> 2, tq = lane & 3;
  const int slab = warp / Cfg::DSPLIT, dpart = warp % Cfg::DSPLIT, dbase = dpart * DC;
  const int row0 = slab * 16 + g;
  float lse2[2], del[2];
  load_row_stats(p, h, q0, nq, row0, lse2, del);
  const int a_row = slab * 16 + (lane & 15), a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
  const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3), t_col = (lane >> 4) * 8;

  float acc[DC / 8][4];
#pragma unroll
  for (int i = 0; i < DC / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int j = 0; j < total; ++j) {
    const int st = j & 1;
    if constexpr (Cfg::XSTAGE) {
      cp_wait<0>();  // the next block is issued after the exchange
    } else {
      cp_pipeline_step(j + 1 < total, [&] { kv.load(j + 1, st ^ 1); });
    }
    __syncthreads();
    const uint32_t sK = kv.k_stage(st), sV = kv.v_stage(st);

    float s[BN / 8][4], dp[BN / 8][4];
    slab_products<Cfg, T, D>(s, dp, sQ, sdO, sK, sV, dpart, a_row, a_col, b_row, b_col,
                             smem + (Cfg::XSTAGE ? Cfg::OFF_K + (st ^ 1) * BN * D * 2 : Cfg::OFF_X),
                             warp, lane);
    if constexpr (Cfg::XSTAGE) {
      __syncthreads();  // every warp has read its sums: the other stage is free
      if (j + 1 < total) kv.load(j + 1, st ^ 1);
      cp_commit();
    }

    const auto kb = kv.walk.at(j);
    const bool msk = kv.walk.masked(kb, nq, BM, p.mask);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1;
        float x, dcap = 1.f;
        x = score_log2<kCap>(p, s[nt][e], dcap);
        float pr = fast_exp2(x - lse2[i]);
        if (msk) {
          const int kr = kb.off + nt * 8 + 2 * tq + (e & 1);
          if (!DUALKV_VISIBLE(p.mask, kb, pq_first + row0 + 8 * i, kr)) pr = 0.f;
        }
        dp[nt][e] = pr * (dp[nt][e] - del[i]) * dcap;
      }
    }

    // dQ += dS K.
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      uint32_t a[4];
      pack_a_ktile<T>(a, dp, kt);
#pragma unroll
      for (int n2 = 0; n2 < DC / 16; ++n2) {
        uint32_t b[4];
        ldsm_x4_t(b, sK + swz<D>(kt * 16 + t_row, dbase + n2 * 16 + t_col));
        mma<T>(acc[2 * n2], a, b[0], b[1]);
        mma<T>(acc[2 * n2 + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cp_wait<0>();

  store_dq_rows<T, D, DC>(p, acc, q0, nq, h, row0, dbase, tq);
}

}  // namespace dualkv::cuda::detail
