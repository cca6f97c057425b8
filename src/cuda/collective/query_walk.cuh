// The query walk of a key block's dK/dV CTA (the sm_80, synchronous sm_90a and warp-specialised
// dK/dV kernels): which query blocks see the key block, in the fixed order that makes dK/dV
// deterministic. With the key walk (KeyBlockWalk, collective/common.cuh) the only code that knows
// the layout's shape.
#pragma once

#include "collective/common.cuh"

namespace dualkv::cuda::detail {

// Iteration state of the dkdv kernel: q head (within the kv head's group), query segment, block.
struct QIter {
  int hi, si, qb, qb_end;
  Segment qs;
  // The current block of BM queries: its first query's packed row and logical position, its size.
  __device__ __forceinline__ int row(int BM) const { return qs.start + qb * BM; }
  __device__ __forceinline__ int pos(int BM) const { return qs.pos0 + qb * BM; }
  __device__ __forceinline__ int count(int BM) const { return min(BM, qs.len - qb * BM); }
};

// The first query segment from table index si on, in the walk of key segment kseg (table index
// ksi), whose queries see some of the keys at positions [pk_first, pk_last]: its blocks go to it.
template <int BM>
__device__ __forceinline__ bool seek_query_region(const Params& p, const Segment& kseg, int ksi,
                                                  int si, int pk_first, int pk_last, QIter& it) {
  for (;; ++si) {
    Segment s;
    if (si == ksi) {
      s = kseg;
    } else {
      // The other query segments are kseg's descendants, all in (ksi, kseg.last_desc]; the
      // pre-order rank tells them from the other segments there (an order that is not
      // depth-first). The depth-two layout: a prompt's responses follow it, a response has none.
      // Its subtree's fields are read from the table here, not kept from kseg: the producer
      // warps of the warp-specialised dK/dV kernels walk at 24 registers.
      const Segment& k = p.segs[ksi];
      if (si > k.last_desc) return false;
      s = p.segs[si];
      if (!(k.pre < s.pre && s.pre < k.pre_end)) continue;
    }
    int b0, b1;
    if (query_blocks<BM>(s, pk_first, pk_last, p.mask, &b0, &b1)) {
      it.si = si;
      it.qs = s;
      it.qb = b0;
      it.qb_end = b1;
      return true;
    }
  }
}

// The fixed walk of a key tile's dK/dV CTA over query blocks of BM (the order of the CPU backend's
// for_each_query_segment, src/cpu/kernels.h): for each q head of the GQA group, the blocks of the
// keys' own segment, then of each of its descendants that sees them, in increasing table index.
// query_walk_begin starts it, query_walk_next steps it; false: past the end.
template <int BM>
__device__ __forceinline__ bool query_walk_begin(const Params& p, const Segment& kseg, int ksi,
                                                 int pk_first, int pk_last, QIter& it) {
  it.hi = 0;
  return seek_query_region<BM>(p, kseg, ksi, ksi, pk_first, pk_last, it);
}
template <int BM>
__device__ __forceinline__ bool query_walk_next(const Params& p, const Segment& kseg, int ksi,
                                                int pk_first, int pk_last, QIter& it) {
  if (++it.qb < it.qb_end) return true;
  if (seek_query_region<BM>(p, kseg, ksi, it.si + 1, pk_first, pk_last, it)) return true;
  if (++it.hi < p.group) return seek_query_region<BM>(p, kseg, ksi, ksi, pk_first, pk_last, it);
  return false;
}

// A synchronous dK/dV kernel's cp.async of query block `it` (kv head hk) into stage `stage`: its
// Q and dO rows (tiles of QB bytes from sQ0 / sdO0, in Tiles' layout) and its lse2 / delta rows
// (threads 0 .. 2 BM - 1; lse2[2][BM] then delta[2][BM] from sL0).
template <typename T, class Tiles, int BM, int D, int THREADS, int QB, bool kFresh = false>
__device__ __forceinline__ void load_query_block(const BwdParams& p, const QIter& it, int hk,
                                                 int tid, int stage, uint32_t sQ0, uint32_t sdO0,
                                                 uint32_t sL0) {
  const int h = hk * p.group + it.hi;
  const int qs = it.row(BM);
  const int nq = it.count(BM);
  load_q_do_rows<T, Tiles, BM, D, THREADS, kFresh>(p, qs, nq, h, sQ0 + stage * QB,
                                                   sdO0 + stage * QB);
  if (tid < 2 * BM) {
    const int r = tid % BM;
    const float* src = (tid < BM ? p.lse2 : p.delta) + int64_t(h) * p.T + qs + (r < nq ? r : 0);
    cp_async4(sL0 + ((tid < BM ? 0 : 2 * BM) + stage * BM + r) * 4, src, r < nq);
  }
}

}  // namespace dualkv::cuda::detail
