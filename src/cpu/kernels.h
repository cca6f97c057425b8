// Shared definitions of the CPU backend's kernels (src/cpu/kernels_impl.h) and their driver
// (src/cpu/attention_cpu.cpp). Internal: not part of the public headers.
#pragma once

#include <cstdint>
#include <vector>

#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::cpu::detail {

// Keys per block and width of a register-resident accumulator chunk: 256 bytes, i.e. eight AVX2
// registers (64 floats, 32 doubles).
template <class A>
inline constexpr int kBlock = int(256 / sizeof(A));
// The head dim is padded with zeros to a multiple of one cache line so every inner loop runs
// over whole vectors.
template <class A>
inline constexpr int kPad = int(64 / sizeof(A));
// Query rows batched together in the dk/dv pass.
inline constexpr int kQBlock = 64;

inline int padded_head_dim(int d, int pad) { return (d + pad - 1) / pad * pad; }

// One attention call, with q/k/v/dout already widened to the accumulation type A and laid out
// per head: x[(h * T + t) * Dp + d], zero-padded for d in [D, Dp).
template <class A>
struct Problem {
  int32_t T = 0, Hq = 0, Hkv = 0, D = 0, Dp = 0;
  int32_t group = 1;  // Hq / Hkv
  A scale = 1, softcap = 0;
  MaskRule mask{};
  const Segment* segs = nullptr;
  int32_t nseg = 0;
  const A* q = nullptr;      // [Hq][T][Dp]
  const A* k = nullptr;      // [Hkv][T][Dp]
  const A* v = nullptr;      // [Hkv][T][Dp]
  const A* dout = nullptr;   // [Hq][T][Dp]   (backward)
  const A* delta = nullptr;  // [Hq][T] rowsum(dO * O) - dlse   (backward)
  const A* lse = nullptr;    // [Hq][T]   (backward)
};

// Per-thread working memory, sized once per call.
template <class A>
struct Scratch {
  explicit Scratch(int Dp)
      : kt(size_t(Dp) * kBlock<A>),
        vt(size_t(Dp) * kBlock<A>),
        s(size_t(kTileSize) * kBlock<A>),
        dp(size_t(kTileSize) * kBlock<A>),
        th(kBlock<A>),
        o(size_t(kTileSize) * Dp),
        m(kTileSize),
        l(kTileSize),
        pt(size_t(kBlock<A>) * kQBlock),
        dst(size_t(kBlock<A>) * kQBlock) {}
  std::vector<A> kt, vt;   // K and V blocks transposed: [Dp][kBlock]
  std::vector<A> s, dp;    // scores and dO.V of up to kTileSize rows: [row][kBlock]
  std::vector<A> th;       // tanh(score / softcap) of one row
  std::vector<A> o;        // [kTileSize][Dp]: output (forward) or dq (backward) accumulator
  std::vector<A> m, l;     // running max and sum of exp per query row
  std::vector<A> pt, dst;  // P and dS of a query batch, transposed: [kBlock][kQBlock]
};

// A contiguous run of keys: packed index of its first token and logical positions
// [pos0, pos0 + len).
struct Region {
  int64_t start;
  int32_t pos0;
  int32_t len;
};

// The key walk of a query segment: fn(region) for each key region its queries see, in a fixed
// order: its tree's root (for a root query: itself, causally), the ancestors between root and
// segment from the parent upwards, then the segment itself (causally). The depth-two layout's
// order is the prompt, then the own response.
template <class Fn>
inline void for_each_key_region(const Segment* segs, const Segment& seg, Fn&& fn) {
  fn(Region{seg.root_start, 0, seg.root_len});
  if (seg.is_root()) return;
  for (int32_t a = seg.parent; segs[a].depth > 0; a = segs[a].parent) {
    fn(Region{segs[a].start, segs[a].pos0, segs[a].len});
  }
  fn(Region{seg.start, seg.pos0, seg.len});
}

// The query walk of a key segment k: fn(i) for each segment i whose queries see k's keys, in a
// fixed order: k itself, then its descendants in increasing table index (all within
// (k, last_desc]; the pre-order ranks tell them from the other segments there). The depth-two
// layout's order is the prompt, then its responses.
template <class Fn>
inline void for_each_query_segment(const Segment* segs, int32_t k, Fn&& fn) {
  fn(k);
  const Segment& ks = segs[k];
  for (int32_t i = k + 1; i <= ks.last_desc; ++i) {
    if (ks.pre < segs[i].pre && segs[i].pre < ks.pre_end) fn(i);
  }
}

}  // namespace dualkv::cpu::detail
