// The layout walks of the kernels, in plain C++ (DUALKV_HD) so that the CPU tests check them
// against the mask rule without a GPU (tests/cpp/test_cuda_walks.cpp): the parameter block every
// kernel reads (Params), the key walk of a query tile (KeyBlockWalk: which key blocks, in which
// order, which of them need the element mask), the queries of a wide query tile
// (wide_query_tile) and the query walk of a key block's dK/dV CTA (QIter, query_walk_begin /
// query_walk_next). With them the only code that knows the layout's
// shape; the kernels consume the walks' blocks (packed row, logical position, count).
#pragma once

#include <cstdint>

#include "dualkv/hd.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::cuda::detail {

// min / max of two ints: CUDA's in device code (the kernels' machine code as before the walks
// moved here), a comparison on the host.
#if defined(__CUDA_ARCH__)
DUALKV_HD int imin(int a, int b) { return ::min(a, b); }
DUALKV_HD int imax(int a, int b) { return ::max(a, b); }
#else
DUALKV_HD int imin(int a, int b) { return a < b ? a : b; }
DUALKV_HD int imax(int a, int b) { return a < b ? b : a; }
#endif

// The parameters every kernel reads: the layout tables, the shape, the score (scale, softcap,
// mask) and q, k, v with their strides. The forward and backward kernels take FwdParams /
// BwdParams (passed by value), which add their own tensors; the pieces both use (region and
// query walks, score modifier, CTA decode) take this base.
struct Params {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head;  // element strides (D contiguous)
  const Segment* segs;
  const Tile* qtiles;
  const Tile* ktiles;
  int32_t nseg, nqt, nkt, T;
  int32_t Hq, Hkv, group;  // group = Hq / Hkv
  float scale;             // softmax scale
  float scale_log2;        // scale * log2(e)          (no softcap)
  float softcap;           // c > 0: s = c * tanh(scale * qk / c)
  float cap_inv;           // scale / c
  float cap_log2;          // c * log2(e)
  MaskRule mask;
  // The order of the dK/dV kernels' CTAs (KeyTileCta): 0 = the kv heads of one key tile next to
  // each other (index = unit * Hkv + head); n > 0 = the key tiles in chunks of n units, the kv
  // heads outer within a chunk, so that the CTAs running together share one kv head's queries.
  int32_t key_chunk;
};

// A contiguous key region seen by a query segment: one segment of its ancestor chain or the
// segment itself. Keys [start, start + len) packed, logical positions from pos0.
struct Region {
  int32_t start, pos0, len;
};

// Blocks of `B` keys of region `r` (aligned to its start) seen by queries at positions
// [pq_first, pq_last]: [*b0, *b0 + return value).
template <int B>
DUALKV_HD int key_blocks(const Region& r, int pq_first, int pq_last, const MaskRule& m, int* b0) {
  if (r.len <= 0) return 0;
  const int lo = imax(r.pos0, m.lowest_key(pq_first));
  const int hi = imin(r.pos0 + r.len - 1, pq_last);
  if (lo > hi) return 0;
  *b0 = (lo - r.pos0) / B;
  return (hi - r.pos0) / B + 1 - *b0;
}

// Whether a (query block, key block) pair needs per-element masking: partial blocks, the causal
// diagonal, or the window edge.
DUALKV_HD bool needs_mask(int nq, int BM, int nk, int BN, int pq_first, int pq_last, int pk_first,
                          int pk_last, const MaskRule& m) {
  return nq < BM || nk < BN || pk_last > pq_first ||
         int64_t(pq_last) - int64_t(pk_first) >= int64_t(m.window);
}

// One block of at most `B` keys of a walk: keys [off, off + B) of region R, cut at its end.
template <int B>
struct KeyBlock {
  Region R;
  int off;
  DUALKV_HD int64_t row() const { return int64_t(R.start) + off; }  // first key
  DUALKV_HD int pos() const { return R.pos0 + off; }                // its logical position
  DUALKV_HD int count() const { return imin(B, R.len - off); }
};

// The key walk of queries [q0, q0 + nq) of segment `seg` in blocks of `B` keys, in the fixed
// order of the CPU backend's for_each_key_region (src/cpu/kernels.h; one online softmax runs over
// all of them): its tree's root (region 0; for a root query the root itself, causally), the
// middle ancestors (from the parent up to the root's child, nearest first), then the segment
// itself (region 1, causally; empty for a root).
// The depth-two layout (prompt, then own response) has no middle ancestors: its walk keeps two
// regions in registers, and only a walk with middle blocks reads the table again in at().
// kMemo: at() remembers the last middle ancestor it read (two registers, see middle_block), so
// deep chains are read once per ancestor. Off by default until measured on a GPU (a build with
// DUALKV_WALK_MEMO=1 turns it on in the sm_90 kernels: bench/walk_memo_ab.sh); the sm_80 kernels,
// at their register limit, keep it off (the memo spills there).
#ifndef DUALKV_WALK_MEMO
#define DUALKV_WALK_MEMO 0
#endif
template <int B, bool kMemo = DUALKV_WALK_MEMO != 0>
struct KeyBlockWalk {
  const Params& p;
  Region r0, r1;
  int b00 = 0, o1 = 0;    // region 0's first block; region 1's first block less its walk index
  int nb0, nbe, total;    // blocks in region 0; up to the end of the middle ones; in the walk
  int mid;                // (nbe > nb0) the table index of the parent, the first middle ancestor
  int pq_first, pq_last;  // logical positions of the first and last query

  DUALKV_HD KeyBlockWalk(const Params& p_, const Segment& seg, int q0, int nq) : p(p_) {
    r0 = {seg.root_start, 0, seg.root_len};
    r1 = {seg.start, seg.pos0, seg.is_root() ? 0 : seg.len};
    pq_first = seg.pos0 + (q0 - seg.start), pq_last = pq_first + nq - 1;
    nb0 = key_blocks<B>(r0, pq_first, pq_last, p.mask, &b00);
    nbe = nb0, mid = seg.parent;
    if (seg.depth > 1) {
      for (int a = mid; p.segs[a].depth > 0; a = p.segs[a].parent) {
        int b0;
        nbe += key_blocks<B>(region_of(a), pq_first, pq_last, p.mask, &b0);
      }
    }
    int b01 = 0;
    total = nbe + key_blocks<B>(r1, pq_first, pq_last, p.mask, &b01);
    o1 = b01 - nbe;
  }
  // Key block j of the walk.
  DUALKV_HD KeyBlock<B> at(int j) const {
    const bool first = j < nb0;
    if (!first && j < nbe) return middle_block(j - nb0);
    return {first ? r0 : r1, (first ? b00 + j : o1 + j) * B};
  }
  // Whether key block `kb` needs per-element masking against the walk's queries (`nq` rows of a
  // `BM`-row tile).
  DUALKV_HD bool masked(const KeyBlock<B>& kb, int nq, int BM, const MaskRule& m) const {
    return needs_mask(nq, BM, kb.count(), B, pq_first, pq_last, kb.pos(), kb.pos() + B - 1, m);
  }

 private:
  DUALKV_HD Region region_of(int a) const {
    const Segment* s = p.segs + a;
    return {s->start, s->pos0, s->len};
  }
  // The ancestor whose blocks the last middle_block call returned and the index (among the
  // middle blocks) of its first block: each thread of the sm_90 kernels asks for the blocks in
  // increasing order, so the chain is read once per ancestor instead of from the parent for
  // every block (depth - 1 reads for a block of the root's child).
  mutable int seen_a = -1, seen_j = 0;
  // Block j of the middle ancestors' blocks (0 <= j < nbe - nb0): the chain read from the last
  // ancestor seen when j is not before its blocks, else from the parent.
  DUALKV_HD KeyBlock<B> middle_block(int j) const {
    int a = mid;
    const int asked = j;
    if (kMemo && seen_a >= 0 && j >= seen_j) a = seen_a, j -= seen_j;
    for (;; a = p.segs[a].parent) {
      const Region r = region_of(a);
      int b0 = 0;
      const int n = key_blocks<B>(r, pq_first, pq_last, p.mask, &b0);
      if (j < n) {
        if constexpr (kMemo) seen_a = a, seen_j = asked - j;
        return {r, (b0 + j) * B};
      }
      j -= n;
    }
  }
};

// The queries of a wide query tile, B > kTileSize tokens (the D = 64 forward's 192-query CTAs),
// read from the layout's kTileSize-token tile list: the segment's tile k (its tokens
// [k kTileSize, (k + 1) kTileSize)) stands for its wide tile k, tokens [k B, k B + B) cut at the
// segment's end. A segment of L tokens has ceil(L / kTileSize) >= ceil(L / B) tiles, so every
// wide tile has one; for the others (k >= ceil(L / B)) the result is false and *q0 / *nq are not
// set. The tile list's longest-first order is kept within a segment (its tiles' wide tiles
// decrease with k too).
template <int B>
DUALKV_HD bool wide_query_tile(const Segment& seg, const Tile& tile, int* q0, int* nq) {
  static_assert(B > kTileSize && B % 64 == 0, "wide tiles: a multiple of 64 rows above a tile");
  const int64_t k = (tile.begin - seg.start) / kTileSize;
  const int64_t first = seg.start + k * B, end = int64_t(seg.start) + seg.len;
  if (first >= end) return false;
  *q0 = int(first);
  *nq = int(end - first < B ? end - first : B);
  return true;
}

// Blocks of `B` queries of segment `qs` (aligned to its start) that see some key at positions
// [pk_first, pk_last] of the same tree (the keys are in qs itself or in one of its ancestors).
template <int B>
DUALKV_HD bool query_blocks(const Segment& qs, int pk_first, int pk_last, const MaskRule& m,
                            int* b0, int* b1) {
  const int lo = imax(qs.pos0, pk_first);
  const int hi = imin(qs.pos0 + qs.len - 1, m.highest_query(pk_last));
  if (lo > hi) return false;
  *b0 = (lo - qs.pos0) / B;
  *b1 = (hi - qs.pos0) / B + 1;
  return true;
}

// Iteration state of the dkdv kernel: q head (within the kv head's group), query segment, block.
struct QIter {
  int hi, si, qb, qb_end;
  Segment qs;
  // The current block of BM queries: its first query's packed row and logical position, its size.
  DUALKV_HD int row(int BM) const { return qs.start + qb * BM; }
  DUALKV_HD int pos(int BM) const { return qs.pos0 + qb * BM; }
  DUALKV_HD int count(int BM) const { return imin(BM, qs.len - qb * BM); }
};

// The first query segment from table index si on, in the walk of key segment kseg (table index
// ksi), whose queries see some of the keys at positions [pk_first, pk_last]: its blocks go to it.
template <int BM>
DUALKV_HD bool seek_query_region(const Params& p, const Segment& kseg, int ksi, int si,
                                 int pk_first, int pk_last, QIter& it) {
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
DUALKV_HD bool query_walk_begin(const Params& p, const Segment& kseg, int ksi, int pk_first,
                                int pk_last, QIter& it) {
  it.hi = 0;
  return seek_query_region<BM>(p, kseg, ksi, ksi, pk_first, pk_last, it);
}
template <int BM>
DUALKV_HD bool query_walk_next(const Params& p, const Segment& kseg, int ksi, int pk_first,
                               int pk_last, QIter& it) {
  if (++it.qb < it.qb_end) return true;
  if (seek_query_region<BM>(p, kseg, ksi, it.si + 1, pk_first, pk_last, it)) return true;
  if (++it.hi < p.group) return seek_query_region<BM>(p, kseg, ksi, ksi, pk_first, pk_last, it);
  return false;
}

}  // namespace dualkv::cuda::detail
