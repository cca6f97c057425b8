// The producers of the warp-specialised sm_90a kernels: the thread or warp of warpgroup 0 that
// issues every load of the CTA (TMA for the tiles, cp.async for the backward's row statistics) into
// the stage rings, in the order of the region walk (the consumers never read the segment tables):
//   - ws_fwd_producer: the forwards' (Q once, then each key block's K and V);
//   - dkdv_producer_warp / dkdv_produce_stage: the dK/dV kernels' (K and V once, then each query
//     block's Q, dO, lse2 and delta, and its record for the consumers);
//   - dq_producer_thread: the dQ passes' (Q and dO once, then each key block's K and V).
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/common.cuh"
#include "collective/query_walk.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/tma.cuh"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

// The shared memory a dK/dV kernel's producer warp fills, in the kernel's SharedStorage: at its
// front the tiles, K and V (BN rows of DC columns) and S stages of Q and dO (BM rows); further on
// the rows, per stage the lse2 / delta rows and the query block's record; and the barrier array,
// which starts with the barrier of K and V and the ring's full[S] and empty[S].
template <int BN_, int BM_, int DC_, int S_>
struct DkdvTiles {
  static constexpr int BN = BN_, BM = BM_, DC = DC_, S = S_;
  static constexpr int K_BYTES = BN * DC * 2;  // K (and V)
  static constexpr int Q_BYTES = BM * DC * 2;  // a stage's Q (and dO)
  uint16_t k[BN * DC];
  uint16_t v[BN * DC];
  uint16_t q[S][BM * DC];
  uint16_t dout[S][BM * DC];
};
template <int BM, int S>
struct DkdvRows {
  float l[S][2 * BM];  // per stage: lse2, delta
  int meta[S][4];      // per stage: the query block's record
};

#if DUALKV_SM90_BODY
// Their addresses in the CTA's shared memory (SmemBase), for a config Cfg with Tiles (a DkdvTiles
// at the aligned base) and the offsets OFF_ROWS (the DkdvRows) and OFF_BAR (the barrier array).
template <class Cfg>
struct DkdvSmem : SmemBase {
  using Tiles = typename Cfg::Tiles;
  static constexpr int S = Tiles::S;
  using Rows = DkdvRows<Tiles::BM, S>;
  // A full barrier's arrivals: the elected lane's arrive.expect_tx + the producer warp's 32
  // cp.async arrivals.
  static constexpr int FULL_COUNT = 1 + 32;
  static constexpr int OFF_L = Cfg::OFF_ROWS + int(offsetof(Rows, l));
  static constexpr int OFF_META = Cfg::OFF_ROWS + int(offsetof(Rows, meta));
  uint32_t k, v, q0, dout0, l0, kv_bar;  // K, V, stage 0's Q / dO / rows, the kv barrier
  __device__ __forceinline__ DkdvSmem()
      : k(base),
        v(base + int(offsetof(Tiles, v))),
        q0(base + int(offsetof(Tiles, q))),
        dout0(base + int(offsetof(Tiles, dout))),
        l0(base + OFF_L),
        kv_bar(base + Cfg::OFF_BAR) {}
  __device__ __forceinline__ uint32_t q(int s) const { return q0 + s * Tiles::Q_BYTES; }
  __device__ __forceinline__ uint32_t dout(int s) const { return dout0 + s * Tiles::Q_BYTES; }
  // Stage 0's lse2 (stage s's at + 2 BM s, its delta BM floats on).
  __device__ __forceinline__ const float* lse() const {
    return reinterpret_cast<const float*>(gbase + OFF_L);
  }
  __device__ __forceinline__ volatile int* meta(int s) const {
    return reinterpret_cast<volatile int*>(gbase + OFF_META + 16 * s);
  }
  __device__ __forceinline__ uint32_t full(int s) const { return kv_bar + 8u * (1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return kv_bar + 8u * (1 + S + s); }
  // The kv barrier and the ring (empty: the consumer threads' releases), by the thread that
  // initialises the CTA's barriers.
  __device__ __forceinline__ void init_ring(uint32_t consumers) const {
    ws::mbar_init(kv_bar, 1);
    ws::ring_init<S>([&](int s) { return full(s); }, [&](int s) { return empty(s); }, FULL_COUNT,
                     consumers);
  }
  // The consumers' acquire of stage s for block `it` of the walk: waits until it is full; false at
  // the walk's end record, else the block's query count and first logical position.
  __device__ __forceinline__ bool wait_block(int s, int it, int& nq, int& pq_first) const {
    ws::mbar_wait(full(s), Ring<S>::full_parity(it));
    volatile int* m = meta(s);
    if (m[0] == 0) return false;
    nq = m[1];
    pq_first = m[2];
    return true;
  }
  // ... and a consumer thread's release of the stage.
  __device__ __forceinline__ void release(int s) const { ws::mbar_arrive(empty(s)); }
};

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

// One stage of a warp-specialised dK/dV kernel's producer warp (the D <= 128, D = 256 and D = 512
// kernels): waits until ring stage s is free (`parity`: Ring::empty_parity), then, past the end
// of the walk (valid = false), marks the stage's record 0 and returns false; else writes block
// cur's record in meta (1 + q head within the group, rows, logical position, first packed row)
// and loads into stage s, all on its full barrier: Q and dO columns [col0, col0 + 64 NCB) of the
// block's QB-byte tiles through TMA (lane 0), its lse2 and delta rows through cp.async (every
// lane).
template <int NCB, int BM, int QB>
__device__ __forceinline__ bool dkdv_produce_stage(const DkdvWsArgs& a, int s, uint32_t parity,
                                                   bool valid, const QIter& cur, int hk,
                                                   uint32_t full, uint32_t empty,
                                                   volatile int* meta, uint32_t sQ0, uint32_t sdO0,
                                                   uint32_t sL0, int col0, int lane) {
  const BwdParams& p = a.p;
  ws::mbar_wait(empty, parity);
  if (!valid) {
    if (lane == 0) {
      meta[0] = 0;  // end of the walk
      ws::mbar_arrive(full);
    }
    ws::mbar_arrive(full);
    return false;
  }
  const int h = hk * p.group + cur.hi;
  const int qs = cur.row(BM);
  const int nq = cur.count(BM);
  if (lane == 0) {
    meta[0] = 1 + cur.hi;  // which q head of the GQA group
    meta[1] = nq;
    meta[2] = cur.pos(BM);
    meta[3] = qs;
    ws::mbar_expect_tx(full, 2 * QB);
    ws::tma_load3_pair<NCB, BM>(sQ0 + s * QB, &a.tq, sdO0 + s * QB, &a.tdo, full, col0, h, qs);
  }
#pragma unroll
  for (int i = lane; i < 2 * BM; i += 32) {
    const int r = i % BM;
    const float* src = (i < BM ? p.lse2 : p.delta) + int64_t(h) * p.T + qs + (r < nq ? r : 0);
    cp_async4(sL0 + (s * 2 * BM + i) * 4, src, r < nq);
  }
  ws::cp_async_mbar_arrive(full);
  return true;
}

// A warp-specialised dK/dV kernel's producer warp (warp 0; the D <= 128, D = 256 and D = 512
// kernels), into the shared memory of `sm` (DkdvSmem): the key tile's K and V columns
// [col0, col0 + DC) (its kv barrier), then one ring stage per query block of the walk
// (dkdv_produce_stage) until a stage marks its end. The walk starts at query_walk_begin;
// step(cur) advances it (false: past its end) and is the kernel's own (its register-pressure
// workarounds at the producer's 24 registers differ).
template <class Smem, class Step>
__device__ __forceinline__ void dkdv_producer_warp(const DkdvWsArgs& a, const Smem& sm,
                                                   const Segment& kseg, int ksi, int hk, int k0,
                                                   int pk_first, int pk_last, int col0, int lane,
                                                   Step&& step) {
  using Tiles = typename Smem::Tiles;
  constexpr int NCB = Tiles::DC / 64, BN = Tiles::BN, BM = Tiles::BM, S = Tiles::S;
  constexpr int QB = Tiles::Q_BYTES, KB = Tiles::K_BYTES;
  if (lane == 0) {
    ws::prefetch_tmap(&a.tq);
    ws::prefetch_tmap(&a.tdo);
    ws::mbar_expect_tx(sm.kv_bar, 2 * KB);
    ws::tma_load3_pair<NCB, BN>(sm.k, &a.tk, sm.v, &a.tv, sm.kv_bar, col0, hk, k0);
  }
  QIter cur;
  bool valid = query_walk_begin<BM>(a.p, kseg, ksi, pk_first, pk_last, cur);
  for (int it = 0;; ++it) {
    const int s = Ring<S>::stage(it);
    if (!dkdv_produce_stage<NCB, BM, QB>(a, s, Ring<S>::empty_parity(it), valid, cur, hk,
                                         sm.full(s), sm.empty(s), sm.meta(s), sm.q0, sm.dout0,
                                         sm.l0, col0, lane))
      break;
    valid = step(cur);
  }
  cp_wait<0>();  // no lse/delta copy outlives its thread
}

// The producer thread of the dQ kernels (dq_ws_kernel_sm90, and per CTA of its cluster the D = 512
// one: NB column blocks of 64 from col0): Q and dO of the CTA's queries once on bQ, then K and V
// of each key block of the walk: SV = 0, both through the S-stage ring (full / empty); SV > 0, K
// through it and V through a separate SV-stage ring (full_v / empty_v).
template <int BM, int BN, int S, int NB, int SV, class Args, class Walk, class Full, class Empty,
          class FullV, class EmptyV>
__device__ __forceinline__ void dq_producer_thread(const Args& a, const Walk& walk, int total,
                                                   int h, int hk, int q0, int col0, uint32_t sQ,
                                                   uint32_t sdO, uint32_t bQ, uint32_t sK0,
                                                   uint32_t sV0, Full full, Empty empty,
                                                   FullV full_v, EmptyV empty_v) {
  constexpr int Q_BYTES = BM * NB * 128, KV_BYTES = BN * NB * 128;
  ws::prefetch_tmap(&a.tk);
  ws::prefetch_tmap(&a.tv);
  ws::mbar_expect_tx(bQ, 2 * Q_BYTES);
  ws::tma_load3_pair<NB, BM>(sQ, &a.tq, sdO, &a.tdo, bQ, col0, h, q0);
  for (int j = 0; j < total; ++j) {
    const int s = Ring<S>::stage(j);
    const int row = int(walk.at(j).row());
    ws::mbar_wait(empty(s), Ring<S>::empty_parity(j));
    if constexpr (SV == 0) {
      ws::mbar_expect_tx(full(s), 2 * KV_BYTES);
      ws::tma_load3_pair<NB, BN>(sK0 + s * KV_BYTES, &a.tk, sV0 + s * KV_BYTES, &a.tv, full(s),
                                 col0, hk, row);
    } else {
      const int sv = Ring<SV>::stage(j);
      ws::mbar_expect_tx(full(s), KV_BYTES);
      ws::tma_load3_cols<NB, BN>(sK0 + s * KV_BYTES, &a.tk, full(s), col0, hk, row);
      ws::mbar_wait(empty_v(sv), Ring<SV>::empty_parity(j));
      ws::mbar_expect_tx(full_v(sv), KV_BYTES);
      ws::tma_load3_cols<NB, BN>(sV0 + sv * KV_BYTES, &a.tv, full_v(sv), col0, hk, row);
    }
  }
}
#endif  // DUALKV_SM90_BODY

}  // namespace dualkv::cuda::detail
