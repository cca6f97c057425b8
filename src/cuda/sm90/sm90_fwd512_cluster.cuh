// sm_90a D = 512 forward on 2-CTA clusters that split the head dim (the default D = 512 forward:
// KernelPolicy::d512_fwd_cluster; DUALKV_SM90_D512_FWD=0 runs fwd_ws_kernel_sm90's KSPLIT = 2
// kernel). Design, arithmetic and measurements: src/cuda/NOTES.md, "D = 512 forward on 2-CTA
// clusters".
//   - One cluster of two CTAs per (128-query tile, q head). CTA rank r holds columns
//     [256r, 256r + 256) of Q (resident) and of every K / V block of the tile's key walk, and owns
//     those columns of O. Each producer loads only its own half (no multicast, no cluster-wide
//     stage barriers): the cluster still reads every K / V block once per 128 queries.
//   - Inside a CTA the D = 256 shape of fwd_ws_kernel_sm90: consumer warpgroup w owns query rows
//     [64w, 64w + 64) and the CTA's 256 columns of O (128 registers); BN = 64, 2 stages. S_j over
//     the CTA's 256 reduction columns is a partial: it goes to the same warpgroup of the peer CTA
//     by st.async (distributed shared memory; its bytes complete the peer's xfull[w]), the peer's
//     partial is added (IEEE addition commutes: both CTAs hold bitwise the same S, so the same
//     softmax, max and sum), then O += P V[:, own columns] (RS). The two warpgroups work on
//     different rows, so they ping-pong their GEMM issue as the D <= 256 kernels do.
//   - Exchange buffer X[w] (16 KB, one per warpgroup, single-buffered): written by the peer's
//     warpgroup w, read by w. The peer may send block j + 1's partial once w's 4 warps have read
//     block j's: they arrive on the peer's xfree[w] (4 remote warp arrivals per phase).
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
#include "sm90/pipeline.cuh"
#include "sm90/sm90_bwd512_ws.cuh"  // ws::mapa_shared, ws::st_async_f32x4
#include "sm90/sm90_fwd_ws.cuh"     // FwdWsArgs, the TMA and setmaxnreg wrappers
#include "sm90/sm90_ws.h"

namespace dualkv::cuda::detail {

struct FwdD512ClusterCfg {
  static constexpr int D = 512;
  static constexpr int CLUSTER = 2;       // CTAs splitting the head dim
  static constexpr int DH = D / CLUSTER;  // 256 columns per CTA (of Q, K, V and O)
  static constexpr int BM = kTileSize;    // 128 queries per cluster: 64 per consumer warpgroup
  static constexpr int BN = 64;           // keys per block
  static constexpr int STAGES = 2;
  static constexpr int THREADS = 384;  // warpgroup 0 produces, 1 and 2 consume
  static constexpr int CONSUMERS = 256;
  static constexpr int OR = DH / 2;      // O floats per consumer thread (64 x 256)
  static constexpr int SR = BN / 2;      // S floats per consumer thread (64 x 64)
  static constexpr int X_VECS = SR / 4;  // float4s per thread of one partial S
  static constexpr int Q_BYTES = BM * DH * 2;
  static constexpr int KV_BYTES = BN * DH * 2;
  static constexpr int X_BYTES = X_VECS * 128 * 16;  // per consumer warpgroup
  struct Barriers {                                  // mbarriers
    uint64_t q, full_k[STAGES], full_v[STAGES], empty_k[STAGES], empty_v[STAGES];
    uint64_t xfull[2];  // per warpgroup: the local arrive.expect_tx + the peer's X_BYTES
    uint64_t xfree[2];  // per warpgroup: the peer's 4 warps have read what this CTA sent
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
  static constexpr int SMEM = int(sizeof(SharedStorage)) + 1024;
  // setmaxnreg: 40 + 2 x 232 = 504 registers per thread slot of the three warpgroups (<= 512).
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  static_assert(PRODUCER_REGS + 2 * CONSUMER_REGS <= 3 * 168, "register pool of one CTA");
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
  static_assert(SMEM <= kSmemHeadDim512, "api.cu checks the GPU offers this much");
  static_assert(DH % 64 == 0 && BN % 16 == 0 && SR % 4 == 0, "whole SW128 blocks, float4 words");
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
      }
      ws::mbar_init_fence();
    }
    ws::cluster_sync();
  }
};

// Consumer warpgroup cw's exchange of a block's partial S with the same warpgroup of the peer CTA:
// this thread's X_VECS words of X[cw] (written by the peer) and the same words of the peer's X[cw]
// (written here).
struct FwdD512Exchange {
  using Cfg = FwdD512ClusterCfg;
  static constexpr int V = Cfg::X_VECS;
  const float4* mine;  // this thread's first word of X[cw] (generic address)
  uint32_t peer_x;     // the same word of the peer's X[cw] (shared::cluster)
  uint32_t xfull, xfull_peer, xfree, peer;
  int t;
  __device__ __forceinline__ FwdD512Exchange(const unsigned char* gbase, uint32_t base,
                                             const FwdD512Bars& bars, int cw, int t_,
                                             uint32_t peer_)
      : mine(reinterpret_cast<const float4*>(gbase + Cfg::OFF_X + cw * Cfg::X_BYTES) + t_),
        peer_x(ws::mapa_shared(base + uint32_t(Cfg::OFF_X + cw * Cfg::X_BYTES + t_ * 16), peer_)),
        xfull(bars.xfull(cw)),
        xfull_peer(ws::mapa_shared(bars.xfull(cw), peer_)),
        xfree(bars.xfree(cw)),
        peer(peer_),
        t(t_) {}
  // s (this CTA's partial of block j, complete in registers) += the peer's partial of block j.
  //   1. arm this block's phase of xfull[cw] (this arrival + the peer's X_BYTES; the peer's bytes
  //      may land first: the phase cannot complete before this arrival);
  //   2. wait until the peer's warpgroup has read block j - 1's partial (xfree, parity of j - 1;
  //      block 0 passes: a fresh barrier's parity-1 phase counts as completed), send s;
  //   3. wait for the peer's partial (cluster-scope acquire), add it (own + peer: the peer adds
  //      the same two numbers), and tell the peer its X[cw] is free (one arrival per warp, after
  //      every lane's reads).
  __device__ __forceinline__ void swap_add(float (&s)[Cfg::SR], int j) const {
    if (t == 0) ws::mbar_expect_tx(xfull, Cfg::X_BYTES);
    ws::mbar_wait(xfree, (uint32_t(j) & 1u) ^ 1u);
#pragma unroll
    for (int i = 0; i < V; ++i)
      ws::st_async_f32x4(peer_x + uint32_t(i * 128 * 16), s[4 * i], s[4 * i + 1], s[4 * i + 2],
                         s[4 * i + 3], xfull_peer);
    ws::mbar_wait_cluster(xfull, uint32_t(j) & 1u);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float4 x = mine[i * 128];
      s[4 * i] += x.x, s[4 * i + 1] += x.y, s[4 * i + 2] += x.z, s[4 * i + 3] += x.w;
    }
    __syncwarp();
    if ((t & 31) == 0) ws::mbar_arrive_cluster(xfree, peer);  // maps xfree into the peer
  }
};
#endif

template <typename T, bool kCap>
__global__ void __launch_bounds__(384, 1)
    fwd_d512_cluster_kernel_sm90(const __grid_constant__ FwdWsArgs a) {
#if DUALKV_SM90_BODY
  using Cfg = FwdD512ClusterCfg;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, S = Cfg::STAGES, NC = Cfg::CONSUMERS;
  constexpr int DH = Cfg::DH, OR = Cfg::OR, SR = Cfg::SR;
  const FwdParams& p = a.p;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
  const unsigned char* gbase = smem + (base - smem_u32(smem));
  const uint32_t sQ = base, sK0 = base + Cfg::OFF_K, sV0 = base + Cfg::OFF_V;
  const FwdD512Bars bars{base + Cfg::OFF_BAR};

  // blockIdx.x = (tile * Hq + q head) * 2 + rank: the two CTAs of a cluster share every index but
  // the rank, so they agree on validity and on the key walk.
  const uint32_t rank = blockIdx.x & 1u, peer = rank ^ 1u;
  const QueryTileCta<BM> cta(p, blockIdx.x >> 1);
  if (!cta.valid) return;  // both CTAs of the cluster, before any cluster barrier
  const int h = cta.h, hk = cta.hk, q0 = cta.q0, nq = cta.nq;
  const int cb0 = int(rank) * DH;  // this CTA's first column

  const KeyBlockWalk<BN> walk(cta.seg, q0, nq, p.mask);
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
    const FwdD512Exchange x(gbase, base, bars, cw, tid & 127, peer);
    const float sl = (kCap || a.prescale) ? 1.f : p.scale_log2;  // log2-domain factor of the scores

    float o[OR];
#pragma unroll
    for (int i = 0; i < OR; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float s[SR];
    uint32_t pa[BN / 16][4];

    // Scores of block j (in s, the whole head dim) -> unnormalised probabilities (in place);
    // updates the running max and sum; corr = factor by which O must be rescaled (exactly 1 where
    // the row max did not move).
    auto softmax = [&](int j, float (&corr)[2]) {
      const auto kb = walk.at(j);
      ws_fwd_block_softmax<BN, kCap, true>(p, s, kb, walk.masked(kb, nq, BM, p.mask), a.prescale,
                                           pq_first + row0, tq, sl, m_run, l_run, corr);
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
    ws_fwd_mainloop<T, S, DH / 8, true>(
        total, pp, s, o, pa, l_run, [&](int st) { return bars.full_k(st); },
        [&](int st) { return bars.full_v(st); }, [&](int st) { ws::mbar_arrive(bars.empty_k(st)); },
        [&](int st) { ws::mbar_arrive(bars.empty_v(st)); }, issue_s, issue_pv,
        [&](int j) { x.swap_add(s, j); }, softmax);
    pp.finish();

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
