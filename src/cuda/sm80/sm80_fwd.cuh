// sm_80 forward (mma.sync m16n8k16, ldmatrix, cp.async; FlashAttention-2 style). Runs on sm_80+.
//
// One CTA per (query tile, q head): 128 query rows; each warp owns MT 16-row m-tiles (MT = 2 for D
// <= 128). A tile walks the key blocks of its segment's ancestors (the root first, then the
// others from the parent up) and then its own segment's causally, with one online softmax
// (KeyBlockWalk; the depth-two layout: a response tile walks the prompt, then its own response;
// a prompt tile its prompt). Only blocks on the causal diagonal, the window edge or a region end
// are masked element-wise (with MaskRule).
// K/V blocks are double-buffered. D = 512: 64-row CTAs (half tiles), and two warps per 16-row slab
// that split O's columns (each computes the slab's S in full: 1.5x the matrix work of one warp).
// kSmall (D = 256 and 512 on GPUs with less shared memory per block than their regular configs
// need: D = 512 on A100 and sm_86/89, D = 256 on sm_86/89): 64-row CTAs at D = 256, 32-row CTAs
// and 16-key blocks at D = 512, 96 KB (FwdCfg).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/epilogue.cuh"
#include "collective/online_softmax.cuh"
#include "collective/score_mod.cuh"
#include "launch.h"

namespace dualkv::cuda::detail {

// kSmall: GPUs with less shared memory per block than the regular sm_80 configs need
// (KernelPolicy::sm80_small_smem; at most kSmemSmall). D = 512: BM 32, BN 16, Q 32 KB + two K/V
// stages of 2 x 16 KB = 96 KB; 4 warps (2 slabs x DSPLIT 2), each with O's 16 x 256 fp32 (128
// registers) as at BM 64, S 16 x 16. D = 256: BM 64 (half a tile, as D = 512's regular config),
// BN 32: Q 32 KB + two K/V stages of 2 x 16 KB = 96 KB; 4 warps.
template <int D, bool kSmall = false>
struct FwdCfg {
  static_assert(!kSmall || D >= 256, "the small shared-memory configs are D = 256's and 512's");
  // Query rows per CTA: a 128-token tile, or half of one at D = 512 (Q and two K/V stages of
  // 512 columns must fit in shared memory); kSmall: half a tile at D = 256, a quarter at 512.
  static constexpr int BM = kSmall ? (D >= 512 ? 32 : 64) : D >= 512 ? 64 : kTileSize;
  static constexpr int MT =
      D >= 256 ? 1 : 2;  // 16-row m-tiles per warp (reuse of each K/V fragment)
  static constexpr int BN = kSmall && D >= 512 ? 16 : D >= 128 ? 32 : 64;  // D = 128 with 64 spills
  // Warps sharing a 16-row slab, each owning D / DSPLIT columns of O (a 16 x 512 fp32
  // accumulator would be 256 registers per thread); each computes the slab's S in full.
  static constexpr int DSPLIT = D >= 512 ? 2 : 1;
  static constexpr int DC = D / DSPLIT;
  static constexpr int WARPS = BM / (16 * MT) * DSPLIT;
  static constexpr int THREADS = WARPS * 32;
  // Shared memory; the OFF_* offsets come from here.
  struct SharedStorage {
    uint16_t q[BM * D];
    uint16_t k[2][BN * D];  // two stages
    uint16_t v[2][BN * D];
  };
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int SMEM = int(sizeof(SharedStorage));
  static constexpr int MIN_BLOCKS = D >= 256 ? 1 : 2;
  // load_tile's row offsets per call (kFreshAddr): with the prefix-tree key walk, 0 spills in
  // sm_80 code at D >= 128 and in sm_90a code at D >= 256 (without: 8-68 bytes at D = 128 / 256 /
  // 512); at D = 128 in sm_90a code it spills 12 bytes, 8 without (see fwd_kernel_sm80).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr bool FRESH_ADDR = D >= 256;
#else
  static constexpr bool FRESH_ADDR = D >= 128;
#endif
};
static_assert(sm80_configs_fit<FwdCfg>(), "policy.h's smem_regular / kSmemSmall");

template <typename T, int D, bool kCap, bool kSmall>
__global__ void __launch_bounds__(FwdCfg<D, kSmall>::THREADS, FwdCfg<D, kSmall>::MIN_BLOCKS)
    fwd_kernel_sm80(const __grid_constant__ FwdParams p) {
  using Cfg = FwdCfg<D, kSmall>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem);

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const QueryTileCta<BM> cta(p);
  if (!cta.valid) return;
  const int h = cta.h, q0 = cta.q0, nq = cta.nq;
  const T* qg = static_cast<const T*>(p.q) + int64_t(q0) * p.q_tok + int64_t(h) * p.q_head;

  load_tile<BM, D, Cfg::THREADS, Cfg::FRESH_ADDR>(sQ, qg, p.q_tok, nq);

  const QueryTileKv<T, D, Cfg> kv(p, cta, sQ);
  const int total = kv.walk.total, pq_first = kv.walk.pq_first;
  if (total > 0) kv.load(0, 0);
  cp_commit();

  constexpr int MT = Cfg::MT, DC = Cfg::DC;
  float o[MT][DC / 8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < DC / 8; ++i) o[m][i][0] = o[m][i][1] = o[m][i][2] = o[m][i][3] = 0.f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
    m_run[m][0] = m_run[m][1] = -INFINITY, l_run[m][0] = l_run[m][1] = 0.f;

  const int g = lane >> 2, tq = lane & 3;
  const int slab = warp / Cfg::DSPLIT, dpart = warp % Cfg::DSPLIT;
  const int dbase = dpart * DC;     // this warp's O columns [dbase, dbase + DC)
  const int wrow = slab * 16 * MT;  // m-tile m covers rows wrow + 16 m + [0, 16)
  const int a_row = wrow + (lane & 15), a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
  const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3), t_col = (lane >> 4) * 8;

  for (int j = 0; j < total; ++j) {
    const int st = j & 1;
    cp_pipeline_step(j + 1 < total, [&] { kv.load(j + 1, st ^ 1); });
    __syncthreads();
    const uint32_t sK = kv.k_stage(st), sV = kv.v_stage(st);

    float s[MT][BN / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) s[m][i][0] = s[m][i][1] = s[m][i][2] = s[m][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) ldsm_x4(a[m], sQ + swz<D>(a_row + 16 * m, kk * 16 + a_col));
#pragma unroll
      for (int n2 = 0; n2 < BN / 16; ++n2) {
        uint32_t b[4];
        ldsm_x4(b, sK + swz<D>(n2 * 16 + b_row, kk * 16 + b_col));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma<T>(s[m][2 * n2], a[m], b[0], b[1]);
          mma<T>(s[m][2 * n2 + 1], a[m], b[2], b[3]);
        }
      }
    }

    const auto kb = kv.walk.at(j);
    const bool msk = kv.walk.masked(kb, nq, BM, p.mask);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = score_log2<kCap>(p, s[m][nt][e]);
          if (msk) {
            const int pq = pq_first + wrow + 16 * m + g + (e >> 1) * 8;
            const int kr = kb.off + nt * 8 + 2 * tq + (e & 1);
            if (!DUALKV_VISIBLE(p.mask, kb, pq, kr)) x = -INFINITY;
          }
          s[m][nt][e] = x;
        }
      }
    }

    // Online softmax (per m-tile: rows g and g + 8).
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        online_softmax_row<BN / 8, false>(s[m], i, m_run[m][i], l_run[m][i], 1.f, [&](float corr) {
          rescale_o_row<DC / 8>(o[m], i, corr);
        });
      }
    }

    // O += P V.
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) pack_a_ktile<T>(a[m], s[m], kt);
#pragma unroll
      for (int n2 = 0; n2 < DC / 16; ++n2) {
        uint32_t b[4];
        ldsm_x4_t(b, sV + swz<D>(kt * 16 + t_row, dbase + n2 * 16 + t_col));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma<T>(o[m][2 * n2], a[m], b[0], b[1]);
          mma<T>(o[m][2 * n2 + 1], a[m], b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_wait<0>();

  // Epilogue: O / l and lse, rows < nq.
#pragma unroll
  for (int m = 0; m < MT; ++m)
    store_out_rows<T, D, DC>(p, o[m], m_run[m], l_run[m], 1.f, q0, nq, h, wrow + 16 * m + g, tq,
                             dbase, dpart == 0);
}

template <typename T, int D>
void launch_forward_sm80(const FwdParams& p, bool small_smem, cudaStream_t stream) {
  with_sm80_smem_cfg<D>(small_smem, [&](auto small) {
    constexpr bool kSmall = decltype(small)::value;
    using Cfg = FwdCfg<D, kSmall>;
    const int64_t grid = int64_t(p.nqt) * (kTileSize / Cfg::BM) * p.Hq;
    if (grid == 0) return;
    launch_kernel(p.softcap > 0.f ? fwd_kernel_sm80<T, D, true, kSmall>
                                  : fwd_kernel_sm80<T, D, false, kSmall>,
                  grid, Cfg::THREADS, Cfg::SMEM, stream, p,
                  kSmall ? "dualkv forward (sm80, small smem)" : "dualkv forward (sm80)");
  });
}

}  // namespace dualkv::cuda::detail
