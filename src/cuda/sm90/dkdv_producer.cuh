// The warp-specialised dK/dV kernels' producer (D <= 128, D = 256 and D = 512 alike): the
// kernel arguments with the Q / dO / K / V tensor maps (make_bwd_ws_args), and producer warp 0,
// which walks the key block's fixed query-block order (collective/query_walk.cuh) and fills one
// ring stage per query block: Q and dO by TMA, the lse2 / delta rows by cp.async completing on
// the same full barrier, and a per-stage record the consumers read instead of the segment tables.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "collective/query_walk.cuh"
#include "launch.h"
#include "sm90/pipeline.cuh"
#include "sm90/sm90_ws.h"
#include "sm90/tma.cuh"

namespace dualkv::cuda::detail {

struct DkdvWsArgs {
  CUtensorMap tq, tdo, tk, tv;
  BwdParams p;
};

namespace ws {
#if DUALKV_SM90_BODY
// Arrives on `bar` once this thread's earlier cp.async copies have landed (counts as one of the
// barrier's expected arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
// dst[0:bytes/4] += src[0:bytes/4] (fp32), asynchronously, with an L2 cache policy
// (createpolicy_evict_last) for the destination lines; bytes a multiple of 16.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes,
                                                    uint64_t policy) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, "
      "%3;" ::"l"(dst),
      "r"(src), "r"(bytes), "l"(policy)
      : "memory");
}
// An L2 policy that keeps the lines it is applied to ahead of normal ones when evicting.
__device__ __forceinline__ uint64_t createpolicy_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// This thread's committed bulk operations have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// ... and have completed.
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif
}  // namespace ws

#if DUALKV_SM90_BODY
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
// kernels): the key tile's K and V columns [col0, col0 + 64 NCB) (KB bytes each, on bKV), then
// one ring stage per query block of the walk (dkdv_produce_stage) until a stage marks its end.
// The walk starts at query_walk_begin; step(cur) advances it (false: past its end) and is the
// kernel's own (its register-pressure workarounds at the producer's 24 registers differ).
template <int NCB, int BN, int BM, int S, int QB, int KB, class Full, class Empty, class Meta,
          class Step>
__device__ __forceinline__ void dkdv_producer_warp(const DkdvWsArgs& a, const Segment& kseg,
                                                   int ksi, int hk, int k0, int pk_first,
                                                   int pk_last, uint32_t sK, uint32_t sV,
                                                   uint32_t bKV, uint32_t sQ0, uint32_t sdO0,
                                                   uint32_t sL0, int col0, int lane, Full&& full,
                                                   Empty&& empty, Meta&& meta, Step&& step) {
  if (lane == 0) {
    ws::prefetch_tmap(&a.tq);
    ws::prefetch_tmap(&a.tdo);
    ws::mbar_expect_tx(bKV, 2 * KB);
    ws::tma_load3_pair<NCB, BN>(sK, &a.tk, sV, &a.tv, bKV, col0, hk, k0);
  }
  QIter cur;
  bool valid = query_walk_begin<BM>(a.p, kseg, ksi, pk_first, pk_last, cur);
  for (int it = 0;; ++it) {
    const int s = Ring<S>::stage(it);
    if (!dkdv_produce_stage<NCB, BM, QB>(a, s, Ring<S>::empty_parity(it), valid, cur, hk, full(s),
                                         empty(s), meta(s), sQ0, sdO0, sL0, col0, lane))
      break;
    valid = step(cur);
  }
  cp_wait<0>();  // no lse/delta copy outlives its thread
}
#endif

// The backward kernels' arguments: p, and the tensor maps of Q and dO (boxes of bm rows) and of K
// and V (bn rows), d columns each. False, with the fallback warning, when a map cannot be encoded.
inline bool make_bwd_ws_args(DkdvWsArgs& a, const BwdParams& p, int d, int bm, int bn) {
  if (!encode_tmap_thd(&a.tq, p.q, p.T, p.Hq, d, p.q_tok, p.q_head, bm) ||
      !encode_tmap_thd(&a.tdo, p.dout, p.T, p.Hq, d, int64_t(p.Hq) * d, d, bm) ||
      !encode_tmap_thd(&a.tk, p.k, p.T, p.Hkv, d, p.k_tok, p.k_head, bn) ||
      !encode_tmap_thd(&a.tv, p.v, p.T, p.Hkv, d, p.v_tok, p.v_head, bn)) {
    warn_ws_fallback("cuTensorMapEncodeTiled failed or is unavailable");
    return false;
  }
  a.p = p;
  return true;
}

}  // namespace dualkv::cuda::detail
