// The CUDA kernels' layout walks (src/cuda/collective/walks.h), run on the host: KeyBlockWalk
// (forward, dQ), the dK/dV query walk (query_walk_begin / query_walk_next) and the spelled-out
// copies of query_walk_next in the warp-specialised dK/dV producers, with the kernels' fragment
// masks (DUALKV_VISIBLE / DUALKV_VISIBLE_KQ). The copies and the masks are the kernels' own text,
// cut from their sources by tests/cpp/CMakeLists.txt into kernel_walk_text.inc.
//
// On random forests and at every block size a kernel uses, every query (key) tile part is walked
// and the (query, key) pairs the kernels would compute are collected: the masked blocks' pairs
// that pass the fragment mask, every pair of an unmasked block. Against the brute-force rule over
// the user's parents / lengths (UserForest, test_util.h), every allowed pair must be computed
// exactly once (per q head of the GQA group) and no other; no block may hold a key off the query's
// path; regions / segments come in the CPU backend's order (src/cpu/kernels.h). On depth-two
// layouts the walks must visit exactly the blocks of the prompt-then-response walks that ran
// before prefix trees (commit 9311358), restated below from DESIGN.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "collective/walks.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"
#include "kernels.h"
#include "test_util.h"

namespace dualkv::cuda::detail {
#include "kernel_walk_text.inc"
}  // namespace dualkv::cuda::detail

namespace dualkv::test {
namespace {

using cuda::detail::KeyBlock;
using cuda::detail::KeyBlockWalk;
using cuda::detail::Params;
using cuda::detail::QIter;

#define WALK_FAIL(msg)      \
  do {                      \
    std::ostringstream os_; \
    os_ << msg;             \
    return os_.str();       \
  } while (0)

// The rule on every (query, key) pair of a forest, brute force, and the counts per token.
struct Pairs {
  Pairs(const Forest& f, MaskRule rule) : uf(f), T(int(uf.owner.size())) {
    allowed.assign(size_t(T) * size_t(T), 0);
    keys_of.assign(size_t(T), 0);
    queries_of.assign(size_t(T), 0);
    for (int q = 0; q < T; ++q) {
      for (int k = 0; k < T; ++k) {
        if (!uf.sees(q, k, rule)) continue;
        allowed[size_t(q) * size_t(T) + size_t(k)] = 1;
        ++keys_of[size_t(q)];
        ++queries_of[size_t(k)];
      }
    }
  }
  bool sees(int q, int k) const { return allowed[size_t(q) * size_t(T) + size_t(k)] != 0; }
  // Whether key k's segment is q's or one of its ancestors.
  bool on_path(int q, int k) const {
    return uf.ancestor_or_self(uf.owner[size_t(k)], uf.owner[size_t(q)]);
  }
  int pos(int t) const { return int(uf.position(t)); }
  UserForest uf;
  int T;
  std::vector<uint8_t> allowed;          // [q * T + k]
  std::vector<int> keys_of, queries_of;  // allowed keys per query, queries per key
};

// Pairs computed in one pass (a key walk over all query tiles, or one q head of the query walks):
// a stamp per pair, so that nothing is cleared between passes.
struct Cover {
  explicit Cover(int T) : T(T), stamp(size_t(T) * size_t(T), 0) {}
  void next_pass() { ++pass; }
  // False if (q, k) was already computed in this pass.
  bool mark(int q, int k) {
    uint32_t& s = stamp[size_t(q) * size_t(T) + size_t(k)];
    if (s == pass) return false;
    s = pass;
    return true;
  }
  int T;
  uint32_t pass = 0;
  std::vector<uint32_t> stamp;
};

// Parts of B rows of every tile, as the kernels cut a tile: {segment, first row, rows}.
struct Part {
  int seg, begin, count;
};
std::vector<Part> tile_parts(const std::vector<Tile>& tiles, int B) {
  std::vector<Part> parts;
  for (const Tile& t : tiles) {
    for (int b = t.begin; b < t.end; b += B)
      parts.push_back({t.segment, b, std::min(B, t.end - b)});
  }
  return parts;
}

// The query parts of a query-tile kernel of BQ rows, as its CTAs decode them: the BQ-row parts of
// each tile (BQ <= kTileSize), or the wide tiles (wide_query_tile: the D = 64 forward's 192-row
// tiles), one per tile whose wide tile exists. "" or what is wrong: every token of the layout in
// exactly one part, each part inside its own segment.
template <int BQ>
std::string query_parts(const Layout& L, std::vector<Part>& parts) {
  if constexpr (BQ <= kTileSize) {
    parts = tile_parts(L.query_tiles(), BQ);
  } else {
    parts.clear();
    for (const Tile& tile : L.query_tiles()) {
      int q0 = -1, nq = -1;
      if (cuda::detail::wide_query_tile<BQ>(L.segments()[size_t(tile.segment)], tile, &q0, &nq))
        parts.push_back({tile.segment, q0, nq});
    }
  }
  std::vector<int> owner(size_t(L.total_tokens()), 0);
  for (const Part& part : parts) {
    const Segment& seg = L.segments()[size_t(part.seg)];
    if (part.count < 1 || part.count > BQ || part.begin < seg.start ||
        part.begin + part.count > seg.start + seg.len)
      WALK_FAIL("BQ " << BQ << ": part [" << part.begin << ", " << part.begin + part.count
                      << ") outside segment " << part.seg);
    for (int q = part.begin; q < part.begin + part.count; ++q) ++owner[size_t(q)];
  }
  for (int q = 0; q < L.total_tokens(); ++q) {
    if (owner[size_t(q)] != 1)
      WALK_FAIL("BQ " << BQ << ": query " << q << " in " << owner[size_t(q)] << " parts");
  }
  return "";
}

Params params_of(const Layout& L, int group, MaskRule rule) {
  Params p{};
  p.segs = L.segments().data();
  p.nseg = int32_t(L.segments().size());
  p.T = L.total_tokens();
  p.group = group;
  p.mask = rule;
  return p;
}

// ---- the key walk ------------------------------------------------------------------------------

// KeyBlockWalk<BK> over every BQ-row part of the query tiles: "" or what is wrong.
template <int BQ, int BK>
std::string check_key_walk(const Layout& L, const Pairs& o, MaskRule rule, Cover& cover) {
  const std::vector<Segment>& segs = L.segments();
  const Params p = params_of(L, 1, rule);
  cover.next_pass();
  std::vector<Part> parts;
  if (std::string e = query_parts<BQ>(L, parts); !e.empty()) return e;
  for (const Part& part : parts) {
    const Segment& seg = segs[size_t(part.seg)];
    const int q0 = part.begin, nq = part.count;
    const KeyBlockWalk<BK> walk(p, seg, q0, nq);
    const std::string where = "BQ " + std::to_string(BQ) + ", BK " + std::to_string(BK) +
                              ", queries [" + std::to_string(q0) + ", " + std::to_string(q0 + nq) +
                              ") of segment " + std::to_string(part.seg) + ": ";
    if (walk.pq_first != o.pos(q0))
      WALK_FAIL(where << "pq_first " << walk.pq_first << ", position " << o.pos(q0));
    // With the memo of the last middle ancestor, blocks asked for out of order (a prefetch a
    // block ahead, then backwards) are the blocks of the walk without it: only a shortcut.
    {
      const KeyBlockWalk<BK, true> ahead(p, seg, q0, nq), back(p, seg, q0, nq);
      std::vector<int> js;
      for (int j = 0; j < walk.total; ++j) js.insert(js.end(), {j + 1, j});
      for (int j = walk.total; j-- > 0;) js.push_back(j);
      for (size_t i = 0; i < js.size(); ++i) {
        const int j = js[i];
        if (j >= walk.total) continue;
        const KeyBlock<BK> want = KeyBlockWalk<BK, false>(p, seg, q0, nq).at(j);
        const KeyBlock<BK> got = (i < 2 * size_t(walk.total) ? ahead : back).at(j);
        if (got.row() != want.row() || got.pos() != want.pos() || got.count() != want.count())
          WALK_FAIL(where << "block " << j << " asked out of order is keys from " << got.row()
                          << ", in order from " << want.row());
      }
    }
    std::vector<int64_t> order;  // the CPU backend's region order
    cpu::detail::for_each_key_region(
        segs.data(), seg, [&](const cpu::detail::Region& r) { order.push_back(r.start); });
    size_t ri = 0;
    int64_t last_row = -1;
    std::vector<int> computed(size_t(nq), 0);
    for (int j = 0; j < walk.total; ++j) {
      const KeyBlock<BK> kb = walk.at(j);
      const int n = kb.count();
      const int64_t row = kb.row();
      if (n < 1 || n > BK || kb.off < 0 || row < 0 || row + n > o.T)
        WALK_FAIL(where << "block " << j << " of " << walk.total << " is keys [" << row << ", "
                        << row + n << ") (region start " << kb.R.start << ", len " << kb.R.len
                        << ", off " << kb.off << ")");
      // Regions in the CPU backend's order, blocks in increasing rows within each.
      const size_t prev = ri;
      while (ri < order.size() && order[ri] != kb.R.start) ++ri;
      if (ri == order.size() || (ri == prev && row <= last_row))
        WALK_FAIL(where << "block " << j << " (keys from " << row
                        << ") is out of the CPU backend's region order");
      last_row = row;
      for (int c = 0; c < n; ++c) {
        const int k = int(row) + c;
        if (o.pos(k) != kb.pos() + c)
          WALK_FAIL(where << "block " << j << ": key " << k << " at position " << o.pos(k)
                          << ", the walk says " << kb.pos() + c);
        if (!o.on_path(q0, k))
          WALK_FAIL(where << "block " << j << " holds key " << k << ", off the query's path");
      }
      const bool masked = walk.masked(kb, nq, BQ, p.mask);
      if (!masked && (nq != BQ || n != BK))
        WALK_FAIL(where << "block " << j << " is unmasked with " << nq << " queries, " << n
                        << " keys");
      for (int r = 0; r < nq; ++r) {
        const int pq = walk.pq_first + r;
        for (int c = 0; c < BK; ++c) {
          const int kr = kb.off + c;
          if (masked && !DUALKV_VISIBLE(p.mask, kb, pq, kr)) continue;
          const int q = q0 + r, k = int(row) + c;
          if (!o.sees(q, k))
            WALK_FAIL(where << "block " << j << (masked ? " (masked)" : " (unmasked)")
                            << " computes query " << q << " x key " << k
                            << ", which the rule forbids");
          if (!cover.mark(q, k))
            WALK_FAIL(where << "query " << q << " x key " << k << " computed twice");
          ++computed[size_t(r)];
        }
      }
    }
    for (int r = 0; r < nq; ++r) {
      if (computed[size_t(r)] != o.keys_of[size_t(q0 + r)])
        WALK_FAIL(where << "query " << q0 + r << " computes " << computed[size_t(r)] << " of its "
                        << o.keys_of[size_t(q0 + r)] << " keys");
    }
  }
  return "";
}

// ---- the query walk ----------------------------------------------------------------------------

struct Step {
  int hi, si, qb, qb_end;
  int start, len, pos0;  // the step's query segment record
  bool operator==(const Step&) const = default;
};

// The steps of a query walk that begins with query_walk_begin and advances with step(cur).
template <int BM, class StepFn>
std::vector<Step> query_walk(const Params& p, const Segment& kseg, int ksi, int pk_first,
                             int pk_last, StepFn&& step) {
  std::vector<Step> steps;
  QIter cur;
  bool valid = cuda::detail::query_walk_begin<BM>(p, kseg, ksi, pk_first, pk_last, cur);
  // Bounded: a walk that does not end shows as too long.
  const size_t limit = size_t(p.group) * size_t(p.T + 1) + 1;
  while (valid && steps.size() <= limit) {
    steps.push_back({cur.hi, cur.si, cur.qb, cur.qb_end, cur.qs.start, cur.qs.len, cur.qs.pos0});
    valid = step(cur);
  }
  return steps;
}

// Every dK/dV producer's walk over a key tile part: query_walk_next's (into `steps`), and the
// warp-specialised kernels' spelled-out copies, which must step the same.
template <int BM>
std::string walk_variants(const Params& p, const Segment& kseg, int ksi, int pk_first, int pk_last,
                          std::vector<Step>& steps) {
  using namespace cuda::detail;
  steps = query_walk<BM>(p, kseg, ksi, pk_first, pk_last, [&](QIter& c) {
    return query_walk_next<BM>(p, kseg, ksi, pk_first, pk_last, c);
  });
  const std::vector<Step> copies[] = {
      query_walk<BM>(p, kseg, ksi, pk_first, pk_last,
                     [&](QIter& c) {
                       return step_sm90_bwd_ws<BM, false>(p, kseg, ksi, pk_first, pk_last, c);
                     }),
      query_walk<BM>(
          p, kseg, ksi, pk_first, pk_last,
          [&](QIter& c) { return step_sm90_bwd_ws<BM, true>(p, kseg, ksi, pk_first, pk_last, c); }),
      query_walk<BM>(p, kseg, ksi, pk_first, pk_last, [&](QIter& c) {
        return step_sm90_bwd512_ws<BM, false>(p, kseg, ksi, pk_first, pk_last, c);
      })};
  const char* names[] = {"sm90_bwd_ws.cuh's (kFusedDq = false)",
                         "sm90_bwd_ws.cuh's (kFusedDq = true)", "sm90_bwd512_ws.cuh's"};
  for (int v = 0; v < 3; ++v) {
    if (copies[v] != steps)
      WALK_FAIL("the spelled-out query_walk_next of " << names[v] << " walks " << copies[v].size()
                                                      << " blocks, query_walk_next " << steps.size()
                                                      << " (or other ones)");
  }
  return "";
}

// The query walk (BM queries per block) over every BK-key part of the key tiles, with `group` q
// heads per kv head: "" or what is wrong.
template <int BK, int BM>
std::string check_query_walk(const Layout& L, const Pairs& o, MaskRule rule, int group,
                             Cover& cover) {
  const std::vector<Segment>& segs = L.segments();
  const Params p = params_of(L, group, rule);
  for (const Part& part : tile_parts(L.key_tiles(), BK)) {
    const int ksi = part.seg, k0 = part.begin, nk = part.count;
    const Segment& kseg = segs[size_t(ksi)];
    // As KeyTileCta.
    const int pk_first = kseg.pos0 + (k0 - kseg.start), pk_last = pk_first + nk - 1;
    const std::string where = "BK " + std::to_string(BK) + ", BM " + std::to_string(BM) +
                              ", group " + std::to_string(group) + ", keys [" + std::to_string(k0) +
                              ", " + std::to_string(k0 + nk) + ") of segment " +
                              std::to_string(ksi) + ": ";
    if (pk_first != o.pos(k0)) WALK_FAIL(where << "pk_first " << pk_first << ", " << o.pos(k0));
    std::vector<Step> steps;
    const std::string err = walk_variants<BM>(p, kseg, ksi, pk_first, pk_last, steps);
    if (!err.empty()) WALK_FAIL(where << err);
    if (steps.size() > size_t(group) * size_t(o.T + 1)) WALK_FAIL(where << "the walk does not end");
    std::vector<int> order;  // the CPU backend's segment order
    cpu::detail::for_each_query_segment(segs.data(), ksi, [&](int32_t i) { order.push_back(i); });

    std::vector<int> computed;
    int head = -1;
    size_t oi = 0;
    auto end_head = [&]() -> std::string {
      for (int kr = 0; kr < nk; ++kr) {
        if (computed[size_t(kr)] != o.queries_of[size_t(k0 + kr)])
          WALK_FAIL(where << "q head " << head << ": key " << k0 + kr << " computes "
                          << computed[size_t(kr)] << " of its " << o.queries_of[size_t(k0 + kr)]
                          << " queries");
      }
      return "";
    };
    for (size_t j = 0; j < steps.size(); ++j) {
      const Step& s = steps[j];
      if (s.hi != head) {
        if (s.hi != head + 1) WALK_FAIL(where << "step " << j << " jumps to q head " << s.hi);
        if (head >= 0) {
          const std::string e = end_head();
          if (!e.empty()) return e;
        }
        head = s.hi;
        computed.assign(size_t(nk), 0);
        cover.next_pass();
        oi = 0;
      } else {
        const Step& b = steps[j - 1];
        if (!(s.si > b.si || (s.si == b.si && s.qb > b.qb)))
          WALK_FAIL(where << "step " << j << " (segment " << s.si << ", block " << s.qb
                          << ") does not follow step " << j - 1 << " (segment " << b.si
                          << ", block " << b.qb << ")");
      }
      if (s.hi >= group || s.si < 0 || s.si >= p.nseg || s.start != segs[size_t(s.si)].start ||
          s.len != segs[size_t(s.si)].len || s.pos0 != segs[size_t(s.si)].pos0 || s.qb < 0 ||
          s.qb >= s.qb_end || int64_t(s.qb) * BM >= s.len)
        WALK_FAIL(where << "step " << j << ": q head " << s.hi << ", segment " << s.si
                        << ", blocks " << s.qb << " of [.., " << s.qb_end << ")");
      while (oi < order.size() && order[oi] != s.si) ++oi;
      if (oi == order.size())
        WALK_FAIL(where << "step " << j << ": segment " << s.si
                        << " out of the CPU backend's order");
      QIter it{};
      it.qs = segs[size_t(s.si)], it.qb = s.qb;
      const int row = it.row(BM), nq = it.count(BM), pq_first = it.pos(BM);
      if (nq < 1 || nq > BM || o.pos(row) != pq_first)
        WALK_FAIL(where << "step " << j << ": rows from " << row << " (" << nq << "), position "
                        << pq_first << " vs " << o.pos(row));
      if (!o.on_path(row, k0))
        WALK_FAIL(where << "step " << j << ": queries of segment " << s.si
                        << " do not see the key's segment");
      // As the dK/dV kernels (sm_80 adds nk < BN, which needs_mask holds).
      const bool masked = cuda::detail::needs_mask(nq, BM, nk, BK, pq_first, pq_first + nq - 1,
                                                   pk_first, pk_last, p.mask);
      if (!masked && (nq != BM || nk != BK))
        WALK_FAIL(where << "step " << j << " is unmasked with " << nq << " queries, " << nk
                        << " keys");
      for (int kr = 0; kr < nk; ++kr) {
        for (int qc = 0; qc < BM; ++qc) {
          if (masked && !DUALKV_VISIBLE_KQ(p.mask, kr, nk, pk_first, qc, nq, pq_first)) continue;
          const int q = row + qc, k = k0 + kr;
          if (!o.sees(q, k))
            WALK_FAIL(where << "step " << j << (masked ? " (masked)" : " (unmasked)")
                            << " computes query " << q << " x key " << k
                            << ", which the rule forbids");
          if (!cover.mark(q, k))
            WALK_FAIL(where << "q head " << head << ": query " << q << " x key " << k
                            << " computed twice");
          ++computed[size_t(kr)];
        }
      }
    }
    if (head != group - 1) WALK_FAIL(where << "the walk ends at q head " << head);
    const std::string e = end_head();
    if (!e.empty()) return e;
  }
  return "";
}

// ---- every block size --------------------------------------------------------------------------

// The kernels' tile parts and blocks: query parts / key blocks of 16, 32, 64, 128 (KeyBlockWalk)
// and 192-row wide tiles / 128 key blocks, key parts of 16, 32, 64, 128 and query blocks of 16, 32,
// 64 (the query walk), and 128 under 128-key parts. each_key_walk /
// each_query_walk run fn.template operator()<B1, B2>() on every pair until one returns an error.
template <int B1, int... B2, class Fn>
std::string each_b2(Fn&& fn) {
  std::string e;
  ((e.empty() ? (void)(e = fn.template operator()<B1, B2>()) : (void)0), ...);
  return e;
}
template <class Fn>
std::string each_key_walk(Fn&& fn) {
  std::string e = each_b2<16, 16, 32, 64, 128>(fn);
  if (e.empty()) e = each_b2<32, 16, 32, 64, 128>(fn);
  if (e.empty()) e = each_b2<64, 16, 32, 64, 128>(fn);
  if (e.empty()) e = each_b2<128, 16, 32, 64, 128>(fn);
  if (e.empty()) e = each_b2<192, 128>(fn);  // the D = 64 forward's wide tiles
  return e;
}
template <class Fn>
std::string each_query_walk(Fn&& fn) {
  std::string e = each_b2<16, 16, 32, 64>(fn);
  if (e.empty()) e = each_b2<32, 16, 32, 64>(fn);
  if (e.empty()) e = each_b2<64, 16, 32, 64>(fn);
  if (e.empty()) e = each_b2<128, 16, 32, 64, 128>(fn);  // 128: the D = 64 dK/dV's query blocks
  return e;
}

std::string check_all_walks(const Forest& f, MaskRule rule, int group) {
  const Layout L = Layout::tree(f.parents, f.lengths);
  const Pairs o(f, rule);
  if (L.total_tokens() != o.T) return "the layout has another number of tokens";
  Cover cover(o.T);
  std::string e =
      each_key_walk([&]<int BQ, int BK>() { return check_key_walk<BQ, BK>(L, o, rule, cover); });
  if (e.empty()) {
    e = each_query_walk(
        [&]<int BK, int BM>() { return check_query_walk<BK, BM>(L, o, rule, group, cover); });
  }
  return e;
}

// ---- random forests ----------------------------------------------------------------------------

// A segment length: empty, one token, short, around the block sizes 64 / 128, or long.
int64_t walk_length(std::mt19937_64& rng) {
  switch (uniform(rng, 0, 7)) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
    case 3:
      return uniform(rng, 2, 40);
    case 4:
      return 64 + uniform(rng, -1, 1);
    case 5:
      return 128 + uniform(rng, -1, 1);
    default:
      return uniform(rng, 41, 300);
  }
}

MaskRule random_rule(std::mt19937_64& rng) {
  const int32_t windows[] = {1, 2, 17, 64, 100, 129, 300};
  return MaskRule{uniform(rng, 0, 2) == 0 ? windows[uniform(rng, 0, 6)] : kNoWindow};
}

std::string describe(MaskRule rule, int group) {
  return ", window " +
         (rule.window == kNoWindow ? std::string("none") : std::to_string(rule.window)) + ", " +
         std::to_string(group) + " q heads per kv head";
}

enum class Order { kBreadthFirst, kDepthFirst, kRandom };

// 1-3 trees of depth up to max_depth (segments on a root-to-leaf path), each segment with up to
// `branching` children, at most 40 segments, packed in the given order (parents before children;
// the pre-order ranks equal the table indices only depth-first).
Forest shaped_forest(std::mt19937_64& rng, int max_depth, int branching, Order order) {
  struct Node {
    int parent, depth;
    std::vector<int> children;
  };
  std::vector<Node> nodes;
  std::vector<int> roots;
  const int trees = int(uniform(rng, 1, 3));
  for (int t = 0; t < trees; ++t) {
    roots.push_back(int(nodes.size()));
    nodes.push_back({-1, 1, {}});
  }
  for (size_t i = 0; i < nodes.size(); ++i) {  // grows breadth-first
    if (nodes[i].depth >= max_depth || nodes.size() >= 40) continue;
    // The first node of each depth has children, so that the depth is reached.
    const bool first_of_depth = i == 0 || nodes[i - 1].depth != nodes[i].depth;
    const int n = int(uniform(rng, first_of_depth ? 1 : 0, branching));
    for (int c = 0; c < n && nodes.size() < 40; ++c) {
      nodes[i].children.push_back(int(nodes.size()));
      nodes.push_back({int(i), nodes[i].depth + 1, {}});
    }
  }
  std::vector<int> packed;  // node ids in packed order
  if (order == Order::kBreadthFirst) {
    for (size_t i = 0; i < nodes.size(); ++i) packed.push_back(int(i));
  } else if (order == Order::kDepthFirst) {
    std::vector<int> stack(roots.rbegin(), roots.rend());
    while (!stack.empty()) {
      const int x = stack.back();
      stack.pop_back();
      packed.push_back(x);
      const auto& ch = nodes[size_t(x)].children;
      stack.insert(stack.end(), ch.rbegin(), ch.rend());
    }
  } else {
    std::vector<int> ready = roots;
    while (!ready.empty()) {
      const size_t r = size_t(uniform(rng, 0, int64_t(ready.size()) - 1));
      const int x = ready[r];
      ready.erase(ready.begin() + int64_t(r));
      packed.push_back(x);
      for (int c : nodes[size_t(x)].children) ready.push_back(c);
    }
  }
  std::vector<int64_t> index_of(nodes.size());
  for (size_t i = 0; i < packed.size(); ++i) index_of[size_t(packed[i])] = int64_t(i);
  Forest f;
  for (int x : packed) {
    const int par = nodes[size_t(x)].parent;
    f.parents.push_back(par < 0 ? -1 : index_of[size_t(par)]);
    f.lengths.push_back(walk_length(rng));
  }
  // At most ~2500 tokens (the pairs are T x T).
  int64_t total = 0;
  for (int64_t len : f.lengths) total += len;
  for (size_t i = 0; total > 2500; i = (i + 1) % f.lengths.size()) {
    total -= f.lengths[i] - f.lengths[i] / 4;
    f.lengths[i] /= 4;
  }
  return f;
}

TEST(CudaWalks, RandomForests) {
  DUALKV_SEEDED_RNG(rng);
  const Order orders[] = {Order::kBreadthFirst, Order::kDepthFirst, Order::kRandom};
  for (int depth = 1; depth <= 5; ++depth) {
    for (int branching : {1, 2, 3, 8}) {
      for (Order order : orders) {
        const Forest f = shaped_forest(rng, depth, branching, order);
        const MaskRule rule = random_rule(rng);
        const int group = int(uniform(rng, 1, 3));
        ASSERT_EQ(check_all_walks(f, rule, group), "") << describe(f) << describe(rule, group);
      }
    }
  }
}

// Forests of certain edge cases: a chain of five whose middle segments cross the block sizes, an
// empty root and empty middle segments (children re-parented), a breadth-first order, one-token
// segments and a lone root; parents anywhere earlier (test_util.h's random_forest).
TEST(CudaWalks, EdgeForests) {
  const std::pair<Forest, int32_t> forests[] = {
      {{{-1, 0, 1, 2, 3}, {129, 63, 1, 128, 65}}, kNoWindow},
      {{{-1, 0, 1, 2, 3}, {129, 63, 1, 128, 65}}, 64},
      {{{-1, 0, 0, 1, 1, 2, 2}, {65, 0, 130, 64, 1, 127, 0}}, kNoWindow},
      {{{-1, 0, 0, 1, 1, 3}, {0, 70, 129, 0, 5, 200}}, kNoWindow},
      {{{-1, 0, 0, 1, 2, 3, 4}, {1, 1, 1, 1, 1, 1, 1}}, kNoWindow},
      {{{-1, 0, 0, 1}, {300, 20, 150, 64}}, 100},
      {{{-1}, {257}}, kNoWindow},
      {{{-1, -1, 0, 1}, {0, 128, 64, 64}}, 1},
  };
  for (const auto& [f, window] : forests) {
    for (int group : {1, 2}) {
      EXPECT_EQ(check_all_walks(f, MaskRule{window}, group), "")
          << describe(f) << describe(MaskRule{window}, group);
    }
  }
  DUALKV_SEEDED_RNG(rng);
  for (int i = 0; i < 30; ++i) {
    const Forest f = random_forest(rng, 16, 5, 200, /*long_first=*/i == 0);
    const MaskRule rule = random_rule(rng);
    ASSERT_EQ(check_all_walks(f, rule, 2), "") << describe(f) << describe(rule, 2);
  }
}

// Wide query tiles (192 rows, from the 128-token tile list): a segment of L tokens has
// ceil(L / 192) of them, longest first within the segment, and the tiles past them decode to none.
TEST(CudaWalks, WideQueryTiles) {
  const Layout L({16384, 1000}, {{}, {1, 191, 192, 193, 500}});
  std::vector<Part> parts;
  ASSERT_EQ(query_parts<192>(L, parts), "");
  std::vector<int> per_segment(L.segments().size(), 0), last_q0(L.segments().size(), 1 << 30);
  for (const Part& part : parts) {
    const size_t si = size_t(part.seg);
    ++per_segment[si];
    EXPECT_LT(part.begin, last_q0[si]) << "segment " << si << ": not longest first";
    last_q0[si] = part.begin;
    const Segment& seg = L.segments()[si];
    EXPECT_EQ((part.begin - seg.start) % 192, 0);
    EXPECT_EQ(part.count, std::min(192, seg.start + seg.len - part.begin));
  }
  for (size_t si = 0; si < L.segments().size(); ++si)
    EXPECT_EQ(per_segment[si], (L.segments()[si].len + 191) / 192) << "segment " << si;
  EXPECT_EQ(per_segment[0], 86);  // 16384 = 85 x 192 + 64
}

// ---- the depth-two walks as they ran before prefix trees (9311358) -----------------------------
// Restated from DESIGN.md ("GPU kernel guidance"): a prompt's query tile walks the prompt's key
// blocks causally; a response's walks the prompt's blocks, then its own response's, with one
// online softmax. The CTA of a key block of a prompt walks the prompt's own query blocks, then
// each response's of its group in order; of a response, its own query blocks; the whole walk
// once per q head of the GQA group. Blocks are aligned to their segment's start; a block is
// walked iff it holds a pair the rule allows, and a key block needs the element mask iff one of
// the BQ x BK slots (rows past the part and keys past the region included) is not such a pair.
namespace before_trees {

struct Seg {
  int start, len, pos0, prompt;  // prompt: the table index of the group's prompt, -1 if none
};

// The non-empty segments in packed order: prompt g, then its responses (positions from P_g).
std::vector<Seg> segments(const Lens& l) {
  std::vector<Seg> segs;
  int at = 0;
  for (size_t g = 0; g < l.prefix.size(); ++g) {
    const int P = int(l.prefix[g]);
    const int prompt = P > 0 ? int(segs.size()) : -1;
    if (P > 0) segs.push_back({at, P, 0, -1});
    at += P;
    for (int64_t r : l.responses[g]) {
      if (r > 0) segs.push_back({at, int(r), P, prompt});
      at += int(r);
    }
  }
  return segs;
}

// Queries at positions [q_lo, q_hi] and keys at [k_lo, k_hi] of a region they see: the rule is
// pk <= pq and pq - pk < w, a condition on pq - pk alone, which ranges over
// [q_lo - k_hi, q_hi - k_lo].
bool some_pair(int q_lo, int q_hi, int k_lo, int k_hi, int32_t w) {
  return q_hi - k_lo >= 0 && int64_t(q_lo) - k_hi < int64_t(w);
}
bool every_pair(int q_lo, int q_hi, int k_lo, int k_hi, int32_t w) {
  return q_lo - k_hi >= 0 && int64_t(q_hi) - k_lo < int64_t(w);
}

struct KeyStep {
  int64_t row;
  int pos, count;
  bool masked;
  bool operator==(const KeyStep&) const = default;
};

// The key blocks of queries [q0, q0 + nq) of segment s (BQ-row part).
std::vector<KeyStep> key_walk(const std::vector<Seg>& segs, int s, int q0, int nq, int BQ, int BK,
                              int32_t w) {
  const Seg& qs = segs[size_t(s)];
  const int q_lo = qs.pos0 + q0 - qs.start;
  std::vector<int> regions;
  if (qs.prompt >= 0) regions.push_back(qs.prompt);
  regions.push_back(s);
  std::vector<KeyStep> walk;
  for (int r : regions) {
    const Seg& ks = segs[size_t(r)];
    for (int off = 0; off < ks.len; off += BK) {
      const int n = std::min(BK, ks.len - off), k_lo = ks.pos0 + off;
      if (!some_pair(q_lo, q_lo + nq - 1, k_lo, k_lo + n - 1, w)) continue;
      const bool full =
          nq == BQ && n == BK && every_pair(q_lo, q_lo + BQ - 1, k_lo, k_lo + BK - 1, w);
      walk.push_back({ks.start + off, k_lo, n, !full});
    }
  }
  return walk;
}

// The query blocks of the CTA of keys [k0, k0 + nk) of segment s, for `group` q heads.
std::vector<Step> query_walk(const std::vector<Seg>& segs, int s, int k0, int nk, int BM, int group,
                             int32_t w) {
  const Seg& ks = segs[size_t(s)];
  const int k_lo = ks.pos0 + k0 - ks.start, k_hi = k_lo + nk - 1;
  std::vector<int> queries = {s};
  for (size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].prompt == s) queries.push_back(int(i));
  }
  std::vector<Step> walk;
  for (int h = 0; h < group; ++h) {
    for (int i : queries) {
      const Seg& qs = segs[size_t(i)];
      std::vector<int> blocks;
      for (int b = 0; b * BM < qs.len; ++b) {
        const int q_lo = qs.pos0 + b * BM, q_hi = q_lo + std::min(BM, qs.len - b * BM) - 1;
        if (some_pair(q_lo, q_hi, k_lo, k_hi, w)) blocks.push_back(b);
      }
      for (int b : blocks) walk.push_back({h, i, b, blocks.back() + 1, qs.start, qs.len, qs.pos0});
    }
  }
  return walk;
}

}  // namespace before_trees

std::string check_depth_two(const Lens& l, MaskRule rule, int group) {
  const Layout L(l.prefix, l.responses);
  const std::vector<before_trees::Seg> was = before_trees::segments(l);
  if (was.size() != L.segments().size()) return "another number of segments";
  for (size_t i = 0; i < was.size(); ++i) {
    const Segment& s = L.segments()[i];
    if (was[i].start != s.start || was[i].len != s.len || was[i].pos0 != s.pos0)
      return "segment " + std::to_string(i) + " differs";
  }
  std::string e = each_key_walk([&]<int BQ, int BK>() -> std::string {
    const Params p = params_of(L, 1, rule);
    std::vector<Part> parts;
    if (std::string err = query_parts<BQ>(L, parts); !err.empty()) return err;
    for (const Part& part : parts) {
      const KeyBlockWalk<BK> walk(p, L.segments()[size_t(part.seg)], part.begin, part.count);
      std::vector<before_trees::KeyStep> steps;
      for (int j = 0; j < walk.total; ++j) {
        const KeyBlock<BK> kb = walk.at(j);
        steps.push_back({kb.row(), kb.pos(), kb.count(), walk.masked(kb, part.count, BQ, p.mask)});
      }
      if (steps !=
          before_trees::key_walk(was, part.seg, part.begin, part.count, BQ, BK, rule.window))
        WALK_FAIL("BQ " << BQ << ", BK " << BK << ", queries from " << part.begin
                        << ": other key blocks than before trees");
    }
    return "";
  });
  if (e.empty()) {
    e = each_query_walk([&]<int BK, int BM>() -> std::string {
      const Params p = params_of(L, group, rule);
      for (const Part& part : tile_parts(L.key_tiles(), BK)) {
        const Segment& kseg = L.segments()[size_t(part.seg)];
        const int pk_first = kseg.pos0 + (part.begin - kseg.start);
        std::vector<Step> steps;
        const std::string err =
            walk_variants<BM>(p, kseg, part.seg, pk_first, pk_first + part.count - 1, steps);
        if (!err.empty()) WALK_FAIL("BK " << BK << ", BM " << BM << ": " << err);
        if (steps !=
            before_trees::query_walk(was, part.seg, part.begin, part.count, BM, group, rule.window))
          WALK_FAIL("BK " << BK << ", BM " << BM << ", keys from " << part.begin
                          << ": other query blocks than before trees");
      }
      return "";
    });
  }
  return e;
}

TEST(CudaWalks, DepthTwoVisitsTheBlocksOfBefore) {
  DUALKV_SEEDED_RNG(rng);
  for (int run = 0; run < 200; ++run) {
    Lens l;
    const int G = int(uniform(rng, 1, 4));
    for (int g = 0; g < G; ++g) {
      l.prefix.push_back(walk_length(rng));
      std::vector<int64_t> r(size_t(uniform(rng, 0, 5)));
      for (auto& x : r) x = walk_length(rng);
      l.responses.push_back(r);
    }
    const MaskRule rule = random_rule(rng);
    const int group = int(uniform(rng, 1, 3));
    ASSERT_EQ(check_depth_two(l, rule, group), "") << describe(l) << describe(rule, group);
  }
}

// A hand-checked case of the depth-two order (prompt, then own response; a prompt key block's own
// queries, then each response's).
TEST(CudaWalks, DepthTwoOrder) {
  const Layout L({300, 0, 129}, {{200, 129, 1, 0}, {5, 70}, {}});
  const Params p = params_of(L, 1, MaskRule{});
  const auto& S = L.segments();
  // Query block 64 of response 0 (segment 1): the prompt's 5 blocks of 64, then its own 2.
  const KeyBlockWalk<64> walk(p, S[1], S[1].start + 64, 64);
  ASSERT_EQ(walk.total, 7);
  for (int j = 0; j < 7; ++j)
    EXPECT_EQ(walk.at(j).row(), j < 5 ? S[0].start + 64 * j : S[1].start + 64 * (j - 5));
  // Key block 0 of the prompt: the prompt's queries, then responses 0, 1, 2 (segments 1-3).
  QIter it;
  std::vector<int> segs_seen;
  for (bool v = cuda::detail::query_walk_begin<64>(p, S[0], 0, 0, 63, it); v;
       v = cuda::detail::query_walk_next<64>(p, S[0], 0, 0, 63, it))
    if (segs_seen.empty() || segs_seen.back() != it.si) segs_seen.push_back(it.si);
  EXPECT_EQ(segs_seen, (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace dualkv::test
