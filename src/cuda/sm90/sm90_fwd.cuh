// sm_90a forward: the sm_80 forward's schedule (one CTA per (query tile, q head), region A then
// region B, one online softmax, masks only on boundary blocks) with the matrix products on wgmma:
// two warpgroups of 64 query rows each; S = Q K^T with both operands in shared memory, O += P V
// with P in registers. K/V blocks are double-buffered with cp.async (no TMA, no warp
// specialisation yet).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/online_softmax.cuh"
#include "collective/score_mod.cuh"
#include "launch.h"
#include "sm90/sm90_common.cuh"

namespace dualkv::cuda::detail {

template <int D>
struct Fwd90Cfg {
  static constexpr int BM = kTileSize;  // 128 rows: 2 warpgroups x 64
  static constexpr int BN = D >= 256 ? 64 : 128;
  static constexpr int THREADS = 256;
  static constexpr int Q_BYTES = BM * D * 2;
  static constexpr int KV_BYTES = BN * D * 2;
  // Shared memory from the kernel's 1024-byte aligned base (the + 1024 of SMEM is the slack for
  // that alignment); the OFF_* offsets come from here.
  struct SharedStorage {
    uint16_t q[BM * D];
    uint16_t k[2][BN * D];  // two stages
    uint16_t v[2][BN * D];
  };
  static_assert(sizeof(SharedStorage::q) == Q_BYTES && sizeof(SharedStorage::k[0]) == KV_BYTES);
  static constexpr int OFF_K = int(offsetof(SharedStorage, k));
  static constexpr int OFF_V = int(offsetof(SharedStorage, v));
  static constexpr int SMEM = int(sizeof(SharedStorage)) + 1024;
};

template <typename T, int D, bool kCap>
__global__ void __launch_bounds__(256, 1) fwd_kernel_sm90(const __grid_constant__ Params p) {
#if DUALKV_SM90_BODY
  using Cfg = Fwd90Cfg<D>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, THREADS = Cfg::THREADS;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
  const uint32_t sQ = base;
  const uint32_t sK0 = base + Cfg::OFF_K;  // stage s: + s * KV_BYTES
  const uint32_t sV0 = base + Cfg::OFF_V;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2;
  const QueryTileCta<kTileSize> cta(p);
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;
  const Segment& seg = cta.seg;
  const T* qg = static_cast<const T*>(p.q) + int64_t(q0) * p.q_tok + int64_t(h) * p.q_head;
  const T* kg = static_cast<const T*>(p.k) + int64_t(hk) * p.k_head;
  const T* vg = static_cast<const T*>(p.v) + int64_t(hk) * p.v_head;

  load_tile_sw128<BM, D, THREADS>(sQ, qg, p.q_tok, nq);

  const KeyBlockWalk<BN> walk(seg, q0, nq, p.mask);
  const int total = walk.total, pq_first = walk.pq_first;
  auto load_kv = [&](int j, int stage) {
    const auto kb = walk.at(j);
    const int nk = kb.count();
    const int64_t ks = kb.row();
    load_tile_sw128<BN, D, THREADS>(sK0 + stage * Cfg::KV_BYTES, kg + ks * p.k_tok, p.k_tok, nk);
    load_tile_sw128<BN, D, THREADS>(sV0 + stage * Cfg::KV_BYTES, vg + ks * p.v_tok, p.v_tok, nk);
  };
  if (total > 0) load_kv(0, 0);
  cp_commit();

  constexpr int OR = D / 2, SR = BN / 2;  // accumulator floats per thread
  float o[OR];
#pragma unroll
  for (int i = 0; i < OR; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int g = lane >> 2, tq = lane & 3;
  const int row0 = wg * 64 + (warp & 3) * 16 + g;  // rows row0, row0 + 8

  for (int j = 0; j < total; ++j) {
    const int st = j & 1;
    cp_pipeline_step(j + 1 < total, [&] { load_kv(j + 1, st ^ 1); });
    fence_proxy_async();
    __syncthreads();
    const uint32_t sK = sK0 + st * Cfg::KV_BYTES, sV = sV0 + st * Cfg::KV_BYTES;

    float s[SR];
    wg_fence();
    wgmma_rows<T, BN, D, BM, BN>(s, sQ, wg * 64, sK, 0);
    wg_commit();
    wg_wait<0>();
    fence_regs(s);

    const auto kb = walk.at(j);
    const bool msk = walk.masked(kb, nq, BM, p.mask);
#pragma unroll
    for (int i = 0; i < SR; ++i) {
      const int nt = i >> 2, e = i & 3;
      float x;
      x = score_log2<kCap>(p, s[i]);
      if (msk) {
        const int pq = pq_first + row0 + (e >> 1) * 8;
        const int kr = kb.off + nt * 8 + 2 * tq + (e & 1);
        if (!DUALKV_VISIBLE(p.mask, kb, pq, kr)) x = -INFINITY;
      }
      s[i] = x;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      online_softmax_row<BN / 8, false>(s, r, m_run[r], l_run[r], 1.f,
                                        [&](float corr) { rescale_o_row<D / 8>(o, r, corr); });
    }

    // O += P V (P from registers, V MN-major).
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt) {
      pa[kt][0] = pack2<T>(s[8 * kt + 0], s[8 * kt + 1]);
      pa[kt][1] = pack2<T>(s[8 * kt + 2], s[8 * kt + 3]);
      pa[kt][2] = pack2<T>(s[8 * kt + 4], s[8 * kt + 5]);
      pa[kt][3] = pack2<T>(s[8 * kt + 6], s[8 * kt + 7]);
    }
    fence_regs(pa);
    fence_regs(o);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < BN / 16; ++kt)
      Wgmma<T, D>::template rs<1>(o, pa[kt], desc_mnmajor<BN>(sV, kt * 16), 1);
    wg_commit();
    wg_wait<0>();
    fence_regs(o);
    fence_regs(pa);
    __syncthreads();
  }
  cp_wait<0>();

  store_out_rows<T, D>(p, o, m_run, l_run, 1.f, q0, nq, h, row0, tq);
#endif
}

template <typename T, int D>
void launch_forward_sm90(const Params& p, cudaStream_t stream) {
  using Cfg = Fwd90Cfg<D>;
  const int64_t grid = int64_t(p.nqt) * p.Hq;
  if (grid == 0) return;
  auto kernel = p.softcap > 0.f ? fwd_kernel_sm90<T, D, true> : fwd_kernel_sm90<T, D, false>;
  launch_kernel(kernel, grid, Cfg::THREADS, Cfg::SMEM, stream, p, "dualkv forward (sm90a)");
}

}  // namespace dualkv::cuda::detail
