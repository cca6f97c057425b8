// The CUDA kernels' layout walks (src/cuda/collective/walks.h), run on the host: on random
// forests, with and without a window, at the kernels' block sizes, the key walk of every query
// block must visit each key its queries may attend to (MaskRule over the ancestor relation,
// brute force from the segment table) exactly once and no other, with every block that holds a
// disallowed pair marked for the element mask; the query walk of every key block must visit
// exactly the query blocks that see one of its keys, in increasing segment order, per q head.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "collective/walks.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::cuda::detail {
namespace {

struct Forest {
  std::vector<int64_t> parents, lengths;
};

// Up to 20 segments, depth up to 5, parents anywhere earlier (rarely depth-first), lengths
// often 0 or 1, else short or longer than a 128-token tile.
Forest random_forest(std::mt19937_64& rng) {
  Forest f;
  std::vector<int> depth;
  const int n = 1 + int(rng() % 20);
  for (int i = 0; i < n; ++i) {
    int64_t p = (i == 0 || rng() % 5 == 0) ? -1 : int64_t(rng() % uint64_t(i));
    if (p >= 0 && depth[size_t(p)] >= 5) p = -1;
    depth.push_back(p < 0 ? 0 : depth[size_t(p)] + 1);
    f.parents.push_back(p);
    const int k = int(rng() % 8);
    f.lengths.push_back(k == 0   ? 0
                        : k == 1 ? 1
                        : k < 5  ? 2 + int(rng() % 47)
                                 : 100 + int(rng() % 121));
  }
  return f;
}

// The segment table's brute-force visibility: segment and position of every token.
struct Visibility {
  const std::vector<Segment>& segs;
  MaskRule mask;
  std::vector<int> seg_of, pos_of;
  Visibility(const std::vector<Segment>& s, int T, MaskRule m) : segs(s), mask(m) {
    seg_of.resize(size_t(T)), pos_of.resize(size_t(T));
    for (size_t i = 0; i < s.size(); ++i)
      for (int t = 0; t < s[i].len; ++t)
        seg_of[size_t(s[i].start + t)] = int(i), pos_of[size_t(s[i].start + t)] = s[i].pos0 + t;
  }
  bool ancestor_or_self(int a, int s) const {
    for (int x = s; x >= 0; x = segs[size_t(x)].parent)
      if (x == a) return true;
    return false;
  }
  bool allowed(int q, int k) const {
    return ancestor_or_self(seg_of[size_t(k)], seg_of[size_t(q)]) &&
           mask.allowed(pos_of[size_t(q)], pos_of[size_t(k)]);
  }
};

// A query-tile kernel's blocks of BM queries, as its CTAs decode them (QueryTileCta): (segment,
// first row, rows). BM <= kTileSize: the parts of each tile of the list; BM > kTileSize: the wide
// tiles (wide_query_tile), one per tile whose wide tile exists. Each token of the layout must be
// in exactly one block, in its own segment.
template <int BM>
std::vector<std::array<int, 3>> query_tile_blocks(const Layout& L, const std::string& at) {
  std::vector<std::array<int, 3>> blocks;
  for (const Tile& tile : L.query_tiles()) {
    if constexpr (BM <= kTileSize) {
      for (int q0 = tile.begin; q0 < tile.end; q0 += BM)
        blocks.push_back({tile.segment, q0, std::min(BM, tile.end - q0)});
    } else {
      int q0 = -1, nq = -1;
      if (wide_query_tile<BM>(L.segments()[size_t(tile.segment)], tile, &q0, &nq))
        blocks.push_back({tile.segment, q0, nq});
    }
  }
  std::vector<int> owner(size_t(L.total_tokens()), 0);
  for (const auto& [si, q0, nq] : blocks) {
    const Segment& seg = L.segments()[size_t(si)];
    EXPECT_TRUE(nq >= 1 && nq <= BM && q0 >= seg.start && q0 + nq <= seg.start + seg.len)
        << at << ": block of " << BM << " at " << q0 << " (" << nq << " rows) outside segment "
        << si;
    for (int q = q0; q < q0 + nq && q < L.total_tokens(); ++q) ++owner[size_t(q)];
  }
  for (int q = 0; q < L.total_tokens(); ++q)
    EXPECT_EQ(owner[size_t(q)], 1) << at << ": query " << q << " in blocks of " << BM;
  return blocks;
}

template <int BM, int BN>
void check_key_walk(const Layout& L, const Params& p, const Visibility& vis,
                    const std::string& at) {
  const int T = L.total_tokens();
  for (const auto& [si, q0, nq] : query_tile_blocks<BM>(L, at)) {
    const KeyBlockWalk<BN> walk(p, L.segments()[size_t(si)], q0, nq);
    std::vector<int> seen(size_t(nq) * size_t(T), 0);
    for (int j = 0; j < walk.total; ++j) {
      const KeyBlock<BN> kb = walk.at(j);
      const bool masked = walk.masked(kb, nq, BM, p.mask);
      for (int kr = 0; kr < BN; ++kr) {
        const int64_t key = kb.row() + kr;
        for (int qi = 0; qi < nq; ++qi) {
          // The kernels' fragment mask (DUALKV_VISIBLE, collective/score_mod.cuh).
          const bool visible =
              kb.off + kr < kb.R.len && p.mask.allowed(walk.pq_first + qi, kb.pos() + kr);
          ASSERT_TRUE(masked || visible) << at << ": block " << j << " needs the mask";
          if (!visible) continue;
          ASSERT_TRUE(key < T && vis.allowed(q0 + qi, int(key)))
              << at << ": query " << q0 + qi << " key " << key << " not allowed";
          ASSERT_EQ(seen[size_t(qi) * size_t(T) + size_t(key)]++, 0)
              << at << ": query " << q0 + qi << " key " << key << " twice";
        }
      }
    }
    for (int qi = 0; qi < nq; ++qi)
      for (int k = 0; k < T; ++k)
        ASSERT_EQ(seen[size_t(qi) * size_t(T) + size_t(k)], vis.allowed(q0 + qi, k) ? 1 : 0)
            << at << ": query " << q0 + qi << " key " << k;
  }
}

template <int BN, int BM>
void check_query_walk(const Layout& L, Params p, const Visibility& vis, const std::string& at) {
  const auto& S = L.segments();
  p.group = 2;  // two q heads per kv head: the walk restarts at the key segment for the second
  for (const Tile& tile : L.key_tiles()) {
    for (int k0 = tile.begin; k0 < tile.end; k0 += BN) {
      const int nk = std::min(BN, tile.end - k0), ksi = tile.segment;
      const Segment& ks = S[size_t(ksi)];
      const int pk_first = ks.pos0 + (k0 - ks.start), pk_last = pk_first + nk - 1;
      // Expected: the query blocks (of BM, aligned to their segment) holding an allowed pair.
      std::vector<std::pair<int, int>> want;  // (segment, first row)
      for (size_t si = 0; si < S.size(); ++si)
        for (int b = 0; b * BM < S[si].len; ++b) {
          const int r0 = S[si].start + b * BM, n = std::min(BM, S[si].len - b * BM);
          bool any = false;
          for (int q = r0; q < r0 + n && !any; ++q)
            for (int k = k0; k < k0 + nk && !any; ++k) any = vis.allowed(q, k);
          if (any) want.push_back({int(si), r0});
        }
      std::vector<std::pair<int, int>> got[2];
      QIter it;
      for (bool v = query_walk_begin<BM>(p, ks, ksi, pk_first, pk_last, it); v;
           v = query_walk_next<BM>(p, ks, ksi, pk_first, pk_last, it)) {
        ASSERT_LT(it.hi, 2);
        ASSERT_EQ(it.pos(BM), S[size_t(it.si)].pos0 + (it.row(BM) - S[size_t(it.si)].start));
        got[it.hi].push_back({it.si, it.row(BM)});
      }
      for (int h = 0; h < 2; ++h)
        ASSERT_EQ(got[h], want) << at << ": key block at " << k0 << ", q head " << h;
    }
  }
}

TEST(CudaWalks, RandomForestsMatchTheMaskRule) {
  std::mt19937_64 rng(20261204);
  for (int round = 0; round < 150; ++round) {
    const Forest f = random_forest(rng);
    const Layout L = Layout::tree(f.parents, f.lengths);
    MaskRule m;
    if (round % 2) m.window = 1 + int(rng() % 300);
    Params p{};
    p.segs = L.segments().data();
    p.nseg = int32_t(L.segments().size());
    p.group = 1;
    p.mask = m;
    const Visibility vis(L.segments(), L.total_tokens(), m);
    std::ostringstream os;
    os << "round " << round << " window " << m.window << " forest";
    for (size_t i = 0; i < f.parents.size(); ++i) os << " " << f.parents[i] << ":" << f.lengths[i];
    const std::string at = os.str();
    // The kernels' shapes: query blocks of 64 / 128 / 192 (wide tiles: the D = 64 forward with
    // three consumer warpgroups) against key blocks of 64 / 128 (forwards, dQ), key blocks of
    // 64 / 128 against query blocks of 64 / 128 (dK/dV; 128: the D = 64 dK/dV kernel's
    // 128-query blocks).
    check_key_walk<64, 64>(L, p, vis, at);
    check_key_walk<128, 128>(L, p, vis, at);
    check_key_walk<64, 128>(L, p, vis, at);
    check_key_walk<192, 128>(L, p, vis, at);
    check_query_walk<64, 64>(L, p, vis, at);
    check_query_walk<128, 64>(L, p, vis, at);
    check_query_walk<128, 128>(L, p, vis, at);
    if (HasFatalFailure()) return;
  }
}

// Wide query tiles (192 rows, from the 128-token tile list): a segment of L tokens has
// ceil(L / 192) of them, longest first within the segment, and the tiles past them decode to none.
TEST(CudaWalks, WideQueryTiles) {
  const Layout L({16384, 1000}, {{}, {1, 191, 192, 193, 500}});
  const auto blocks = query_tile_blocks<192>(L, "wide tiles");
  std::vector<int> per_segment(L.segments().size(), 0), last_q0(L.segments().size(), 1 << 30);
  for (const auto& [si, q0, nq] : blocks) {
    ++per_segment[size_t(si)];
    EXPECT_LT(q0, last_q0[size_t(si)]) << "segment " << si << ": not longest first";
    last_q0[size_t(si)] = q0;
    const Segment& seg = L.segments()[size_t(si)];
    EXPECT_EQ((q0 - seg.start) % 192, 0);
    EXPECT_EQ(nq, std::min(192, seg.start + seg.len - q0));
  }
  for (size_t si = 0; si < L.segments().size(); ++si)
    EXPECT_EQ(per_segment[si], (L.segments()[si].len + 191) / 192) << "segment " << si;
  EXPECT_EQ(per_segment[0], 86);  // 16384 = 85 x 192 + 64
}

// The depth-two layout: the walks are the prompt/response ones (prompt, then own response; a
// prompt key block's own queries, then each response's).
TEST(CudaWalks, DepthTwoOrder) {
  const Layout L({300, 0, 129}, {{200, 129, 1, 0}, {5, 70}, {}});
  Params p{};
  p.segs = L.segments().data();
  p.nseg = int32_t(L.segments().size());
  p.group = 1;
  const auto& S = L.segments();
  // Query block 64 of response 0 (segment 1): the prompt's 5 blocks of 64, then its own 2.
  const KeyBlockWalk<64> walk(p, S[1], S[1].start + 64, 64);
  ASSERT_EQ(walk.total, 7);
  for (int j = 0; j < 7; ++j)
    EXPECT_EQ(walk.at(j).row(), j < 5 ? S[0].start + 64 * j : S[1].start + 64 * (j - 5));
  // Key block 0 of the prompt: the prompt's queries, then responses 0, 1, 2 (segments 1-3).
  QIter it;
  std::vector<int> segs_seen;
  for (bool v = query_walk_begin<64>(p, S[0], 0, 0, 63, it); v;
       v = query_walk_next<64>(p, S[0], 0, 0, 63, it))
    if (segs_seen.empty() || segs_seen.back() != it.si) segs_seen.push_back(it.si);
  EXPECT_EQ(segs_seen, (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace dualkv::cuda::detail
