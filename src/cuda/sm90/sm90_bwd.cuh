// sm_90a backward: the sm_80 backward's schedule (preprocess, collective/bwd_preprocess.cuh; dK/dV
// over key blocks in a fixed order; dQ over query blocks), with the matrix products on wgmma.
// Atomic-free and deterministic. Instantiated for D = 256 only (CMakeLists.txt): the D <= 128
// backward is warp-specialised (sm90_bwd_ws.cuh); the D <= 128 branches (Dkdv90Cfg, Dq90Cfg) stay
// as the generic form of the kernels.
//   dkdv: one CTA per (128-key tile, kv head), two warpgroups of 64 keys. Per query block:
//         S^T = K Q^T and dP^T = V dO^T (SS), then dV += P^T dO and dK += dS^T Q with P^T and dS^T
//         from registers (RS, dO and Q MN-major). D = 256 splits the work differently (see
//         Dkdv90Cfg): 64 keys per CTA, dK/dV columns split between the warpgroups.
//   dq:   one CTA per (128-query tile, q head), two warpgroups of 64 queries, walking the key
//         blocks like the forward: S = Q K^T, dP = dO V^T (SS), dQ += dS K (RS, K MN-major).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "collective/bwd_preprocess.cuh"
#include "collective/query_walk.cuh"
#include "collective/score_mod.cuh"
#include "sm90/pipeline.cuh"

namespace dualkv::cuda::detail {

// D <= 128: one CTA per 128-key tile, warpgroup w owns keys 64w.. and all D columns of dK/dV.
// D = 256 (kSplitD; 2 x 64 x 256 accumulators would not fit in registers): one CTA per 64 keys,
// both warpgroups own the same keys and warpgroup w the dK/dV columns 128w..128w+127. Per query
// block warpgroup w computes S^T and dP^T, P and dS for queries 32w..32w+31 (64 x 32 x 256
// products), writes its P^T / dS^T A fragments to shared memory and, after a named barrier of
// both warpgroups, reads all four 16-query slices back (thread t of one warpgroup holds the same
// (key, query) positions as thread t of the other, so a slice is one 16-byte access per thread).
template <int D>
struct Dkdv90Cfg {
  static constexpr bool kSplitD = D > 128;
  static constexpr int BN = kSplitD ? 64 : kTileSize;  // keys per CTA
  static constexpr int BM = 64;                        // queries per iteration
  static constexpr int DW = kSplitD ? D / 2 : D;       // dK/dV columns per warpgroup
  static constexpr int THREADS = 256;
  static constexpr int K_BYTES = BN * D * 2;
  static constexpr int Q_BYTES = BM * D * 2;
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the OFF_* offsets come from here. kSplitD puts the exchange buffers between
  // the tiles and the row statistics: 128 threads x (P^T fragments 64 B, dS^T fragments 64 B).
  struct Tiles {
    uint16_t k[BN * D];
    uint16_t v[BN * D];
    uint16_t q[2][BM * D];  // two stages
    uint16_t dout[2][BM * D];
  };
  struct RowStats {
    float lse2[2][BM];
    float delta[2][BM];
  };
  struct SplitStorage {
    Tiles t;
    uint4 xpa[BM / 16][128];
    uint4 xda[BM / 16][128];
    RowStats l;
  };
  struct PlainStorage {
    Tiles t;
    RowStats l;
  };
  using SharedStorage = std::conditional_t<kSplitD, SplitStorage, PlainStorage>;
  static_assert(sizeof(Tiles::k) == K_BYTES && sizeof(Tiles::q[0]) == Q_BYTES);
  static constexpr int OFF_V = int(offsetof(Tiles, v));
  static constexpr int OFF_Q = int(offsetof(Tiles, q));
  static constexpr int OFF_DO = int(offsetof(Tiles, dout));
  static constexpr int OFF_XPA = int(offsetof(SplitStorage, xpa));  // kSplitD only
  static constexpr int OFF_XDA = int(offsetof(SplitStorage, xda));
  static constexpr int OFF_L = int(offsetof(SharedStorage, l));  // lse2[2][BM], delta[2][BM]
  static constexpr int SMEM = OFF_L + int(sizeof(RowStats)) + 1024;
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
  static_assert(DW % 64 == 0, "a warpgroup's dK/dV columns are whole SW128 column blocks");
};

template <typename T, int D, bool kCap>
__global__ void __launch_bounds__(256, 1) dkdv_kernel_sm90(const __grid_constant__ BwdParams p) {
#if DUALKV_SM90_BODY
  using Cfg = Dkdv90Cfg<D>;
  constexpr bool kSplitD = Cfg::kSplitD;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, DW = Cfg::DW, THREADS = Cfg::THREADS;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
  unsigned char* gbase = smem + (base - smem_u32(smem));
  const uint32_t sK = base, sV = base + Cfg::OFF_V;
  const uint32_t sQ0 = base + Cfg::OFF_Q, sdO0 = base + Cfg::OFF_DO, sL0 = base + Cfg::OFF_L;
  const float* lse_s = reinterpret_cast<const float*>(gbase + Cfg::OFF_L);
  const float* del_s = lse_s + 2 * BM;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const KeyTileCta<BN> cta(p);
  if (!cta.valid) return;
  const int hk = cta.hk, k0 = cta.k0, nk = cta.nk, ksi = cta.ksi;
  const int pk_first = cta.pk_first, pk_last = cta.pk_last;
  const Segment& kseg = cta.kseg;

  load_tile_sw128<BN, D, THREADS>(
      sK, static_cast<const T*>(p.k) + int64_t(k0) * p.k_tok + int64_t(hk) * p.k_head, p.k_tok, nk);
  load_tile_sw128<BN, D, THREADS>(
      sV, static_cast<const T*>(p.v) + int64_t(k0) * p.v_tok + int64_t(hk) * p.v_head, p.v_tok, nk);

  auto issue = [&](const QIter& it, int stage) {
    load_query_block<T, SW128Tiles, BM, D, THREADS, Cfg::Q_BYTES>(p, it, hk, tid, stage, sQ0, sdO0,
                                                                  sL0);
  };
  auto advance = [&](QIter& it) {
    return query_walk_next<BM>(p, kseg, ksi, pk_first, pk_last, it);
  };

  QIter cur;
  bool valid = query_walk_begin<BM>(p, kseg, ksi, pk_first, pk_last, cur);
  if (valid) issue(cur, 0);
  cp_commit();

  const int g = lane >> 2, tq = lane & 3;
  const int kr0 = (kSplitD ? 0 : wg * 64) + (warp & 3) * 16 + g;  // key rows kr0, kr0 + 8
  const int col0 = kSplitD ? wg * DW : 0;                         // first dK/dV column
  constexpr int AR = DW / 2, SR = BM / 2;
  float dk[AR], dv[AR];
#pragma unroll
  for (int i = 0; i < AR; ++i) dk[i] = dv[i] = 0.f;

  int stage = 0;
  while (valid) {
    QIter nxt = cur;
    const bool has_next = advance(nxt);
    cp_pipeline_step(has_next, [&] { issue(nxt, stage ^ 1); });
    fence_proxy_async();
    __syncthreads();

    const int nq = cur.count(BM);
    const int pq_first = cur.pos(BM);
    const bool msk =
        needs_mask(nq, BM, nk, BN, pq_first, pq_first + nq - 1, pk_first, pk_last, p.mask);
    const uint32_t sQ = sQ0 + stage * Cfg::Q_BYTES, sdO = sdO0 + stage * Cfg::Q_BYTES;
    const float* lse_c = lse_s + stage * BM;
    const float* del_c = del_s + stage * BM;
    // P of element i of an m64n64 S^T fragment (before dsoftcap); *dcap = dsoftcap.
    // (q_off: the fragment's first query column, kSplitD's warpgroup 1 holds queries 32..63.)
    auto prob = [&](int i, float sv, float* dcap, int q_off = 0) {
      const int qc = q_off + (i >> 2) * 8 + 2 * tq + (i & 1);
      *dcap = 1.f;
      const float x = score_log2<kCap>(p, sv, *dcap);
      return fast_exp2(x - lse_c[qc]);
    };
    // Element i of a fragment whose first query column is q_off: visible or masked.
    auto visible = [&](int i, int q_off = 0) {
      const int qc = q_off + (i >> 2) * 8 + 2 * tq + (i & 1);
      const int kr = kr0 + ((i >> 1) & 1) * 8;
      return DUALKV_VISIBLE_KQ(p.mask, kr, nk, pk_first, qc, nq, pq_first);
    };
    auto delta_of = [&](int i, int q_off = 0) {
      return del_c[q_off + (i >> 2) * 8 + 2 * tq + (i & 1)];
    };
    uint32_t pa[BM / 16][4], da[BM / 16][4];

    if constexpr (!kSplitD) {
      float s[SR], dp[SR];
      wg_fence();
      wgmma_rows<T, BM, D, BN, BM>(s, sK, wg * 64, sQ, 0);
      wgmma_rows<T, BM, D, BN, BM>(dp, sV, wg * 64, sdO, 0);
      wg_commit();
      wg_wait<0>();
      fence_regs(s, dp);
#pragma unroll
      for (int i = 0; i < SR; ++i) {
        float dcap;
        const float pr = prob(i, s[i], &dcap);
        s[i] = pr;
        dp[i] = pr * (dp[i] - delta_of(i)) * dcap;
      }
      mask_fragment<SR>(msk, visible, [&](int i) { s[i] = dp[i] = 0.f; });
      pack_a_frag<T>(pa, s);
      pack_a_frag<T>(da, dp);
      fence_regs(pa, da, dv, dk);
      wg_fence();
      wgmma_rs_acc<T, D, BM>(dv, pa, sdO);
      wgmma_rs_acc<T, D, BM>(dk, da, sQ);
      wg_commit();
    } else {
      const int t = tid & 127;
      uint4* xpa = reinterpret_cast<uint4*>(gbase + Cfg::OFF_XPA);  // [BM / 16][128]
      uint4* xda = reinterpret_cast<uint4*>(gbase + Cfg::OFF_XDA);  // [BM / 16][128]
      // This warpgroup's half of dO and Q (column blocks of 64 of the SW128 tiles).
      const uint32_t half = uint32_t(col0 / 64) * (BM * 128);
      constexpr int HQ = BM / 2, HR = HQ / 2;  // queries per warpgroup, fragment floats
      const int q_off = wg * HQ;
      float s[HR], dp[HR];
      wg_fence();
      wgmma_rows<T, HQ, D, BN, BM>(s, sK, 0, sQ, q_off);
      wg_commit();
      wgmma_rows<T, HQ, D, BN, BM>(dp, sV, 0, sdO, q_off);
      wg_commit();
      wg_wait<1>();  // S^T done: P (and dsoftcap, kept in s) while dP^T runs
      fence_regs(s);
      float dc[kCap ? HR : 1];
#pragma unroll
      for (int i = 0; i < HR; ++i) {
        float dcap;
        s[i] = prob(i, s[i], &dcap, q_off);
        if constexpr (kCap) dc[i] = dcap;
      }
      mask_fragment<HR>(msk, [&](int i) { return visible(i, q_off); }, [&](int i) { s[i] = 0.f; });
      wg_wait<0>();
      fence_regs(dp);
#pragma unroll
      for (int i = 0; i < HR; ++i)
        dp[i] = s[i] * (dp[i] - delta_of(i, q_off)) * (kCap ? dc[i] : 1.f);
      // This warpgroup's 16-query slices of P^T and dS^T to shared memory, then all four back.
#pragma unroll
      for (int kl = 0; kl < HQ / 16; ++kl) {
        uint32_t pw[4], dw[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          pw[c] = pack2<T>(s[8 * kl + 2 * c], s[8 * kl + 2 * c + 1]);
          dw[c] = pack2<T>(dp[8 * kl + 2 * c], dp[8 * kl + 2 * c + 1]);
        }
        const int kt = wg * (HQ / 16) + kl;
        xpa[kt * 128 + t] = make_uint4(pw[0], pw[1], pw[2], pw[3]);
        xda[kt * 128 + t] = make_uint4(dw[0], dw[1], dw[2], dw[3]);
      }
      ws::bar_sync(1, THREADS);
#pragma unroll
      for (int kt = 0; kt < BM / 16; ++kt) {
        const uint4 v = xpa[kt * 128 + t], w = xda[kt * 128 + t];
        pa[kt][0] = v.x, pa[kt][1] = v.y, pa[kt][2] = v.z, pa[kt][3] = v.w;
        da[kt][0] = w.x, da[kt][1] = w.y, da[kt][2] = w.z, da[kt][3] = w.w;
      }
      fence_regs(pa, dv);
      wg_fence();
      wgmma_rs_acc<T, DW, BM>(dv, pa, sdO + half);
      fence_regs(da, dk);
      wgmma_rs_acc<T, DW, BM>(dk, da, sQ + half);
      wg_commit();
    }
    wg_wait<0>();
    fence_regs(dv, dk, pa, da);
    __syncthreads();
    cur = nxt;
    valid = has_next;
    stage ^= 1;
  }
  cp_wait<0>();

  store_dkdv_rows<T, D, DW>(p, dk, dv, k0, nk, hk, kr0, col0, tq);
#endif
}

template <int D>
struct Dq90Cfg {
  static constexpr int BM = kTileSize;  // 128 queries: 2 warpgroups x 64
  static constexpr int BN = D >= 256 ? 32 : 64;
  static constexpr int THREADS = 256;
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the OFF_* offsets come from here.
  struct SharedStorage {
    uint16_t q[BM * D];
    uint16_t dout[BM * D];
    uint16_t k[2][BN * D];  // two stages
    uint16_t v[2][BN * D];
  };
  static_assert(sizeof(SharedStorage::q) == Q_BYTES && sizeof(SharedStorage::k[0]) == KV_BYTES);
  static constexpr int OFF_DO = int(offsetof(SharedStorage, dout));
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int SMEM = int(sizeof(SharedStorage)) + 1024;
};

template <typename T, int D, bool kCap>
__global__ void __launch_bounds__(256, 1) dq_kernel_sm90(const __grid_constant__ BwdParams p) {
#if DUALKV_SM90_BODY
  using Cfg = Dq90Cfg<D>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, THREADS = Cfg::THREADS;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
  const uint32_t sQ = base, sdO = base + Cfg::OFF_DO;
  const uint32_t sK0 = base + Cfg::OFF_K, sV0 = base + Cfg::OFF_V;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const QueryTileCta<kTileSize> cta(p);
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;
  const Segment& seg = cta.seg;
  const T* kg = static_cast<const T*>(p.k) + int64_t(hk) * p.k_head;
  const T* vg = static_cast<const T*>(p.v) + int64_t(hk) * p.v_head;

  load_q_do_rows<T, SW128Tiles, BM, D, THREADS>(p, q0, nq, h, sQ, sdO);

  const KeyBlockWalk<BN> walk(p, seg, q0, nq);
  const int total = walk.total, pq_first = walk.pq_first;
  auto load_kv = [&](int j, int stage) {
    load_kv_block<SW128Tiles, BN, D, THREADS>(p, walk.at(j), sK0 + stage * Cfg::KV_BYTES,
                                              sV0 + stage * Cfg::KV_BYTES, kg, vg);
  };
  if (total > 0) load_kv(0, 0);
  cp_commit();

  const int g = lane >> 2, tq = lane & 3;
  const int row0 = wg * 64 + (warp & 3) * 16 + g;
  float lse2[2], del[2];
  load_row_stats(p, h, q0, nq, row0, lse2, del);
  constexpr int AR = D / 2, SR = BN / 2;
  float acc[AR];
#pragma unroll
  for (int i = 0; i < AR; ++i) acc[i] = 0.f;

  for (int j = 0; j < total; ++j) {
    const int st = j & 1;
    cp_pipeline_step(j + 1 < total, [&] { load_kv(j + 1, st ^ 1); });
    fence_proxy_async();
    __syncthreads();
    const uint32_t sK = sK0 + st * Cfg::KV_BYTES, sV = sV0 + st * Cfg::KV_BYTES;

    float s[SR], dp[SR];
    wg_fence();
    wgmma_rows<T, BN, D, BM, BN>(s, sQ, wg * 64, sK, 0);
    wgmma_rows<T, BN, D, BM, BN>(dp, sdO, wg * 64, sV, 0);
    wg_commit();
    wg_wait<0>();
    fence_regs(s, dp);

    const auto kb = walk.at(j);
    const bool msk = walk.masked(kb, nq, BM, p.mask);
#pragma unroll
    for (int i = 0; i < SR; ++i) {
      const int r = (i >> 1) & 1;
      float x, dcap = 1.f;
      x = score_log2<kCap>(p, s[i], dcap);
      dp[i] = fast_exp2(x - lse2[r]) * (dp[i] - del[r]) * dcap;
    }
    mask_fragment<SR>(
        msk,
        [&](int i) {
          const int kr = kb.off + (i >> 2) * 8 + 2 * tq + (i & 1);
          return DUALKV_VISIBLE(p.mask, kb, pq_first + row0 + 8 * ((i >> 1) & 1), kr);
        },
        [&](int i) { dp[i] = 0.f; });
    uint32_t da[BN / 16][4];
    pack_a_frag<T>(da, dp);
    fence_regs(da, acc);
    wg_fence();
    wgmma_rs_acc<T, D, BN>(acc, da, sK);
    wg_commit();
    wg_wait<0>();
    fence_regs(acc, da);
    __syncthreads();
  }
  cp_wait<0>();

  store_dq_rows<T, D, D>(p, acc, q0, nq, h, row0, 0, tq);
#endif
}

// The synchronous dK/dV kernel (the D = 256 backward on Hopper).
template <typename T, int D>
void launch_dkdv_sm90(const BwdParams& p, cudaStream_t stream) {
  using C = Dkdv90Cfg<D>;
  const int64_t grid = int64_t(p.nkt) * (kTileSize / C::BN) * p.Hkv;
  if (grid == 0) return;
  auto kernel = p.softcap > 0.f ? dkdv_kernel_sm90<T, D, true> : dkdv_kernel_sm90<T, D, false>;
  launch_kernel(kernel, grid, C::THREADS, C::SMEM, stream, p, "dualkv backward dk/dv (sm90a)");
}

// The synchronous dQ pass.
template <typename T, int D>
void launch_dq_sm90(const BwdParams& p, cudaStream_t stream) {
  using C = Dq90Cfg<D>;
  const int64_t grid = int64_t(p.nqt) * p.Hq;
  if (grid == 0) return;
  auto kernel = p.softcap > 0.f ? dq_kernel_sm90<T, D, true> : dq_kernel_sm90<T, D, false>;
  launch_kernel(kernel, grid, C::THREADS, C::SMEM, stream, p, "dualkv backward dq (sm90a)");
}

template <typename T, int D>
void launch_backward_sm90(const BwdParams& p, cudaStream_t stream) {
  if (int64_t(p.T) * p.Hq == 0) return;
  launch_bwd_pre<T, D>(p, false, stream);
  launch_dkdv_sm90<T, D>(p, stream);
  launch_dq_sm90<T, D>(p, stream);
}

}  // namespace dualkv::cuda::detail
