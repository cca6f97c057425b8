// The layout: validation, segments and positions, tile work lists, pair and FLOP counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dualkv/error.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"
#include "test_util.h"

namespace dualkv::test {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

void expect_layout_error(const Lens& l, const std::string& what) {
  try {
    Layout layout(l.prefix, l.responses);
    ADD_FAILURE() << "accepted " << describe(l);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

void expect_tree_error(const Forest& f, const std::string& what) {
  try {
    Layout::tree(f.parents, f.lengths);
    ADD_FAILURE() << "accepted " << describe(f);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

std::string describe(const Segment& s) {
  std::ostringstream os;
  os << "{" << s.start << ", " << s.len << ", " << s.pos0 << ", " << s.root_start << ", "
     << s.root_len << ", " << s.group << ", " << s.parent << ", " << s.depth << ", " << s.pre
     << ", " << s.pre_end << ", " << s.last_desc << "}";
  return os.str();
}

void expect_segments(const Layout& l, const std::vector<Segment>& want) {
  ASSERT_EQ(l.segments().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(describe(l.segments()[i]), describe(want[i])) << "segment " << i;
  }
}

TEST(Layout, Validation) {
  expect_layout_error({{-1}, {{}}}, "prefix_lens[0]");
  expect_layout_error({{2, 3}, {{1}, {4, -2}}}, "response_lens[1][1]");
  expect_layout_error({{2, 3}, {{1}}}, "same groups");
  expect_layout_error({{2}, {{1}, {}}}, "same groups");
  expect_layout_error({{kInt32Max + 1}, {{}}}, "int32");
  expect_layout_error({{kInt32Max - 5}, {{6}}}, "int32");        // positions P + R overflow
  expect_layout_error({{1 << 30, 1 << 30}, {{}, {}}}, "int32");  // total overflows
  expect_layout_error({{1 << 30}, {{1 << 29, 1 << 29}}}, "int32");
  // The largest legal sizes are accepted (nothing is allocated per token).
  EXPECT_NO_THROW(Layout({kInt32Max - 6}, {{6}}));
  EXPECT_EQ(Layout({kInt32Max - 6}, {{6}}).total_tokens(), kInt32Max);
}

TEST(Layout, TreeValidation) {
  expect_tree_error({{-1, 0}, {3}}, "lengths has 1");
  expect_tree_error({{-1, 1}, {3, 2}}, "parents[1] = 1");  // its own parent
  expect_tree_error({{-1, 0, 3, 1}, {3, 2, 1, 1}}, "parents[2] = 3");
  expect_tree_error({{0}, {3}}, "parents[0] = 0");
  expect_tree_error({{-1, -2}, {3, 2}}, "parents[1] = -2");
  expect_tree_error({{-1, 0}, {3, -1}}, "lengths[1] = -1 is negative");
  expect_tree_error({{-1, 0, 1}, {kInt32Max - 5, 0, 6}}, "lengths[2] = 6");  // path positions
  expect_tree_error({{-1}, {kInt32Max + 1}}, "int32");
  expect_tree_error({{-1, -1}, {1 << 30, 1 << 30}}, "int32");  // total
  expect_tree_error({{-1, 0}, {4, std::numeric_limits<int64_t>::max()}}, "int32");
  EXPECT_EQ(Layout::tree({-1, 0, -1}, {kInt32Max - 7, 6, 1}).total_tokens(), kInt32Max);
  // A tree layout has no prompt/response description.
  const Layout t = Layout::tree({-1, 0}, {2, 3});
  EXPECT_TRUE(t.is_tree());
  EXPECT_THROW(t.num_groups(), Error);
  EXPECT_THROW(t.prefix_lens(), Error);
  EXPECT_THROW(t.response_lens(), Error);
  EXPECT_FALSE(Layout({2}, {{3}}).is_tree());
}

TEST(Layout, TilesOfTheLargestSegment) {
  // A segment of INT32_MAX tokens: its last tile ends at the int32 limit (the tile walk steps
  // past it; in 32 bits that step overflowed). A one-token response keeps the order checkable.
  const Layout layout({kInt32Max - 1}, {{1}});
  for (const std::vector<Tile>& tiles : {layout.query_tiles(), layout.key_tiles()}) {
    ASSERT_EQ(int64_t(tiles.size()), (kInt32Max - 1 + kTileSize - 1) / kTileSize + 1);
    int64_t covered = 0, last_end = 0;
    for (const Tile& t : tiles) {
      ASSERT_LT(t.begin, t.end);
      ASSERT_LE(t.end - t.begin, kTileSize);
      covered += t.end - t.begin;
      last_end = std::max<int64_t>(last_end, t.end);
    }
    EXPECT_EQ(covered, kInt32Max);
    EXPECT_EQ(last_end, kInt32Max);
  }
}

TEST(Layout, SegmentsAndPositions) {
  // Group 0: P=3, responses 2, 0, 1. Group 1: no prompt, one response of 4. Group 2: prompt only.
  // Group 3: empty.
  const Layout l({3, 0, 2, 0}, {{2, 0, 1}, {4}, {}, {}});
  EXPECT_EQ(l.total_tokens(), 12);
  EXPECT_EQ(l.num_groups(), 4);
  // {start, len, pos0, root_start, root_len, group, parent, depth, pre, pre_end, last_desc}: group
  // 1 has no prompt, so its response is a tree (a root) of its own.
  expect_segments(l, {
                         {0, 3, 0, 0, 3, 0, -1, 0, 0, 3, 2},
                         {3, 2, 3, 0, 3, 0, 0, 1, 1, 2, 1},
                         {5, 1, 3, 0, 3, 0, 0, 1, 2, 3, 2},
                         {6, 4, 0, 6, 4, 1, -1, 0, 3, 4, 3},
                         {10, 2, 0, 10, 2, 2, -1, 0, 4, 5, 4},
                     });
  EXPECT_EQ(l.parents(), (std::vector<int64_t>{-1, 0, 0, 0, -1, 4, -1, -1}));
  EXPECT_EQ(l.lengths(), (std::vector<int64_t>{3, 2, 0, 1, 0, 4, 2, 0}));
  EXPECT_EQ(l.position_ids(), (std::vector<int64_t>{0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(l.segment_of_token(), (std::vector<int32_t>{0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 4}));
  EXPECT_EQ(l.unshared_tokens(), 3 * 3 + 2 + 0 + 1 + 4);
}

TEST(Layout, EmptyAndDegenerate) {
  for (const Lens& e : {Lens{{}, {}}, Lens{{0}, {{}}}, Lens{{0, 0}, {{0, 0}, {}}}}) {
    const Layout l(e.prefix, e.responses);
    EXPECT_EQ(l.total_tokens(), 0) << describe(e);
    EXPECT_TRUE(l.segments().empty());
    EXPECT_TRUE(l.query_tiles().empty());
    EXPECT_TRUE(l.key_tiles().empty());
    EXPECT_TRUE(l.position_ids().empty());
    EXPECT_EQ(l.allowed_pairs(), 0);
    EXPECT_EQ(l.forward_flops(128, 8), 0.0);
    EXPECT_EQ(l.token_reduction(), 1.0);
  }
  // N = 0: the prompt alone, causal.
  const Layout p({5}, {{}});
  EXPECT_EQ(p.total_tokens(), 5);
  EXPECT_EQ(p.allowed_pairs(), 15);
  EXPECT_EQ(p.unshared_tokens(), 0);
  // P = 0: responses are independent causal sequences.
  const Layout r({0}, {{3, 2}});
  EXPECT_EQ(r.allowed_pairs(), 6 + 3);
  EXPECT_EQ(r.position_ids(), (std::vector<int64_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(r.token_reduction(), 1.0);
}

TEST(Layout, TokenReduction) {
  const Layout l({8192}, {std::vector<int64_t>(16, 1024)});
  EXPECT_DOUBLE_EQ(l.token_reduction(), 6.0);  // N(P+R)/(P+NR) from DESIGN.md
  const Layout m({10, 4}, {{2, 3}, {1}});
  EXPECT_EQ(m.unshared_tokens(), 12 + 13 + 5);
  EXPECT_DOUBLE_EQ(m.token_reduction(), 30.0 / 20.0);
}

// Every token in exactly one tile; tiles inside one segment, at most kTileSize long and starting
// on a tile boundary of it; longest-first with the documented cost: keys seen by the tile's last
// row (queries), or queries of its own segment from the tile on plus every token of the
// segment's descendants (keys).
void check_tiles(const Layout& l, const std::vector<Tile>& tiles, bool keys) {
  const auto& segs = l.segments();
  const UserForest uf(Forest{l.parents(), l.lengths()});
  std::vector<int> count(size_t(l.total_tokens()), 0);
  for (size_t i = 0; i < tiles.size(); ++i) {
    const Tile& t = tiles[i];
    ASSERT_GE(t.segment, 0);
    ASSERT_LT(t.segment, int32_t(segs.size()));
    const Segment& s = segs[size_t(t.segment)];
    ASSERT_GE(t.begin, s.start);
    ASSERT_LT(t.begin, t.end);
    ASSERT_LE(t.end, s.start + s.len);
    EXPECT_LE(t.end - t.begin, kTileSize);
    EXPECT_EQ((t.begin - s.start) % kTileSize, 0);
    EXPECT_TRUE(t.end - t.begin == kTileSize || t.end == s.start + s.len);
    int64_t cost = keys ? s.start + s.len - t.begin : uf.position(t.end - 1) + 1;
    if (keys) {
      const int64_t own = uf.owner[size_t(t.begin)];
      for (int64_t x = s.start + s.len; x < l.total_tokens(); ++x) {
        cost += uf.ancestor_or_self(own, uf.owner[size_t(x)]);
      }
    }
    EXPECT_EQ(t.cost, cost);
    if (i > 0) {
      EXPECT_GE(tiles[i - 1].cost, t.cost) << "not sorted longest-first at " << i;
    }
    for (int32_t x = t.begin; x < t.end; ++x) ++count[size_t(x)];
  }
  for (size_t x = 0; x < count.size(); ++x) ASSERT_EQ(count[x], 1) << "token " << x;
}

// Brute force over all (q, k) pairs from DESIGN.md's rule with MaskRule::allowed: k's segment is
// an ancestor of q's or q's own (causality and the window on the path positions).
int64_t brute_force_pairs(const Forest& f, const MaskRule& rule) {
  const UserForest uf(f);
  const auto T = int64_t(uf.owner.size());
  int64_t n = 0;
  for (int64_t q = 0; q < T; ++q) {
    for (int64_t k = 0; k < T; ++k) n += uf.sees(q, k, rule);
  }
  return n;
}

// The table, the positions and the unshared tokens of a forest, brute force from the user's list.
void check_forest(const Layout& l, const Forest& f) {
  const UserForest uf(f);
  ASSERT_EQ(l.total_tokens(), int64_t(uf.owner.size()));
  std::vector<int64_t> pos, user_of;  // user segment of each table entry
  for (int64_t t = 0; t < l.total_tokens(); ++t) pos.push_back(uf.position(t));
  EXPECT_EQ(l.position_ids(), pos);
  for (size_t i = 0; i < f.lengths.size(); ++i) {
    if (f.lengths[i] > 0) user_of.push_back(int64_t(i));
  }
  const auto& segs = l.segments();
  ASSERT_EQ(segs.size(), user_of.size());
  const auto table_index = [&](int64_t u) {
    return int32_t(std::find(user_of.begin(), user_of.end(), u) - user_of.begin());
  };
  int32_t trees = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    SCOPED_TRACE("segment " + std::to_string(i) + " = " + describe(segs[i]));
    const Segment& s = segs[i];
    const int64_t u = user_of[i];
    EXPECT_EQ(s.start, uf.start[size_t(u)]);
    EXPECT_EQ(s.len, f.lengths[size_t(u)]);
    EXPECT_EQ(s.pos0, uf.pos0[size_t(u)]);
    // Non-empty ancestors, nearest first.
    std::vector<int64_t> anc;
    for (int64_t a = f.parents[size_t(u)]; a >= 0; a = f.parents[size_t(a)]) {
      if (f.lengths[size_t(a)] > 0) anc.push_back(a);
    }
    EXPECT_EQ(s.depth, int32_t(anc.size()));
    EXPECT_EQ(s.parent, anc.empty() ? -1 : table_index(anc.front()));
    const int32_t root = anc.empty() ? int32_t(i) : table_index(anc.back());
    EXPECT_EQ(s.root_start, segs[size_t(root)].start);
    EXPECT_EQ(s.root_len, segs[size_t(root)].len);
    EXPECT_EQ(s.group, anc.empty() ? trees++ : segs[size_t(root)].group);
    int32_t last = int32_t(i);
    for (size_t j = 0; j < segs.size(); ++j) {
      const bool desc = j != i && uf.ancestor_or_self(u, user_of[j]);
      EXPECT_EQ(s.pre < segs[j].pre && segs[j].pre < s.pre_end, desc) << "descendant " << j;
      if (desc) last = std::max(last, int32_t(j));
    }
    EXPECT_EQ(s.last_desc, last);
  }
  int64_t unshared = 0;  // one row per leaf of the user's list: its path
  for (size_t i = 0; i < f.parents.size(); ++i) {
    if (std::find(f.parents.begin(), f.parents.end(), int64_t(i)) == f.parents.end()) {
      unshared += uf.pos0[i] + f.lengths[i];
    }
  }
  EXPECT_EQ(l.unshared_tokens(), unshared);
}

void check_counts(const Layout& l, const Forest& f, std::mt19937_64& rng) {
  check_tiles(l, l.query_tiles(), false);
  check_tiles(l, l.key_tiles(), true);
  for (int32_t w : {kNoWindow, 1, 2, int32_t(uniform(rng, 3, 400))}) {
    const MaskRule rule{w};
    const int64_t pairs = l.allowed_pairs(rule);
    ASSERT_EQ(pairs, brute_force_pairs(f, rule)) << "window " << w;
    EXPECT_DOUBLE_EQ(l.forward_flops(128, 32, rule), 4.0 * 128 * 32 * double(pairs));
    EXPECT_DOUBLE_EQ(l.backward_flops(64, 8, rule), 2.5 * 4.0 * 64 * 8 * double(pairs));
  }
}

TEST(Layout, RandomLayouts) {
  DUALKV_SEEDED_RNG(rng);
  for (int iter = 0; iter < 40; ++iter) {
    const Lens lens = random_lens(rng, 4, 300, 5, 200, iter % 2 == 0);
    SCOPED_TRACE(describe(lens));
    const Layout l(lens.prefix, lens.responses);
    int64_t T = 0;
    for (size_t g = 0; g < lens.prefix.size(); ++g) {
      T += lens.prefix[g];
      for (int64_t r : lens.responses[g]) T += r;
    }
    ASSERT_EQ(l.total_tokens(), T);
    check_counts(l, forest_of(lens), rng);
  }
}

// The table and tiles of the prompt/response layout as they were before prefix trees (7 fields:
// start, len, pos0, prompt_start, prompt_len, group, response_index; tile costs from P and the
// group's response tokens), written out independently.
struct OldSegment {
  int32_t start, len, pos0, prompt_start, prompt_len, group, response_index;
};
std::vector<OldSegment> old_segments(const Lens& l) {
  std::vector<OldSegment> segs;
  int32_t total = 0;
  for (size_t g = 0; g < l.prefix.size(); ++g) {
    const auto P = int32_t(l.prefix[g]);
    if (P > 0) segs.push_back({total, P, 0, total, P, int32_t(g), -1});
    const int32_t prompt_start = total;
    total += P;
    for (size_t i = 0; i < l.responses[g].size(); ++i) {
      const auto R = int32_t(l.responses[g][i]);
      if (R > 0) segs.push_back({total, R, P, prompt_start, P, int32_t(g), int32_t(i)});
      total += R;
    }
  }
  return segs;
}
std::vector<Tile> old_tiles(const std::vector<OldSegment>& segs, bool keys) {
  std::vector<Tile> tiles;
  for (size_t i = 0; i < segs.size(); ++i) {
    const OldSegment& s = segs[i];
    int32_t responses = 0;  // the group's response tokens
    for (const OldSegment& r : segs) {
      if (r.group == s.group && r.response_index >= 0) responses += r.len;
    }
    for (int32_t b = 0; b < s.len; b += kTileSize) {
      const int32_t e = std::min(s.len, b + kTileSize);
      const int32_t cost = keys ? (s.len - b) + (s.response_index >= 0 ? 0 : responses)
                                : (s.response_index >= 0 ? s.prompt_len : 0) + e;
      tiles.push_back({int32_t(i), s.start + b, s.start + e, cost});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}

TEST(Layout, DepthTwoTablesUnchanged) {
  DUALKV_SEEDED_RNG(rng);
  for (int iter = 0; iter < 40; ++iter) {
    const Lens lens = random_lens(rng, 5, 300, 6, 300, iter % 2 == 0);
    SCOPED_TRACE(describe(lens));
    const Layout l(lens.prefix, lens.responses);
    const std::vector<OldSegment> old = old_segments(lens);
    ASSERT_EQ(l.segments().size(), old.size());
    for (size_t i = 0; i < old.size(); ++i) {
      const Segment& s = l.segments()[i];
      const OldSegment& o = old[i];
      EXPECT_TRUE(s.start == o.start && s.len == o.len && s.pos0 == o.pos0) << "segment " << i;
      // Region A: the prompt, or the segment itself for a response without one (a root).
      EXPECT_EQ(s.root_start, o.prompt_len > 0 ? o.prompt_start : o.start) << "segment " << i;
      EXPECT_EQ(s.root_len, o.prompt_len > 0 ? o.prompt_len : o.len) << "segment " << i;
      EXPECT_EQ(s.depth, o.response_index >= 0 && o.prompt_len > 0 ? 1 : 0) << "segment " << i;
    }
    const Layout t = Layout::tree(forest_of(lens).parents, forest_of(lens).lengths);
    for (bool keys : {false, true}) {
      const std::vector<Tile> a = keys ? l.key_tiles() : l.query_tiles();
      const std::vector<Tile> b = old_tiles(old, keys);
      const std::vector<Tile> c = keys ? t.key_tiles() : t.query_tiles();
      ASSERT_EQ(a.size(), b.size());
      ASSERT_EQ(c.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(a[i].segment == b[i].segment && a[i].begin == b[i].begin &&
                    a[i].end == b[i].end && a[i].cost == b[i].cost)
            << (keys ? "key" : "query") << " tile " << i;
        EXPECT_TRUE(std::memcmp(&a[i], &c[i], sizeof(Tile)) == 0) << "tree tile " << i;
      }
    }
    // The same forest given as a tree: the same table (only unshared_tokens may differ).
    ASSERT_EQ(t.segments().size(), l.segments().size());
    EXPECT_EQ(0, std::memcmp(t.segments().data(), l.segments().data(),
                             l.segments().size() * sizeof(Segment)));
    EXPECT_EQ(t.position_ids(), l.position_ids());
  }
}

TEST(Layout, BreadthFirstTree) {
  // Root 4, children 3 and 2, then a child 5 of the first child, listed after both children.
  const Forest f{{-1, 0, 0, 1}, {4, 3, 2, 5}};
  const Layout l = Layout::tree(f.parents, f.lengths);
  expect_segments(l, {
                         {0, 4, 0, 0, 4, 0, -1, 0, 0, 4, 3},
                         {4, 3, 4, 0, 4, 0, 0, 1, 1, 3, 3},
                         {7, 2, 4, 0, 4, 0, 0, 1, 3, 4, 2},
                         {9, 5, 7, 0, 4, 0, 1, 2, 2, 3, 3},
                     });
  EXPECT_EQ(l.position_ids(), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 4, 5, 7, 8, 9, 10, 11}));
  EXPECT_EQ(l.unshared_tokens(), 6 + 12);  // rows [0 | 1] and [0 | 1 | 3]
  EXPECT_DOUBLE_EQ(l.token_reduction(), 18.0 / 14.0);
  EXPECT_EQ(l.allowed_pairs(), 10 + 18 + 11 + 50);
  const auto order = [](const std::vector<Tile>& tiles) {
    std::vector<int32_t> o;
    for (const Tile& t : tiles) o.push_back(t.segment), o.push_back(t.cost);
    return o;
  };
  EXPECT_EQ(order(l.query_tiles()), (std::vector<int32_t>{3, 12, 1, 7, 2, 6, 0, 4}));
  EXPECT_EQ(order(l.key_tiles()), (std::vector<int32_t>{0, 14, 1, 8, 3, 5, 2, 2}));
  DUALKV_SEEDED_RNG(rng);
  check_forest(l, f);
  check_counts(l, f, rng);
}

TEST(Layout, EmptySegmentsOfATree) {
  // An empty inner segment (1) whose children hang from the root, and an empty root (4) whose
  // child becomes a root (and a tree) of its own.
  const Forest f{{-1, 0, 1, 1, -1, 4}, {3, 0, 2, 1, 0, 2}};
  const Layout l = Layout::tree(f.parents, f.lengths);
  expect_segments(l, {
                         {0, 3, 0, 0, 3, 0, -1, 0, 0, 3, 2},
                         {3, 2, 3, 0, 3, 0, 0, 1, 1, 2, 1},
                         {5, 1, 3, 0, 3, 0, 0, 1, 2, 3, 2},
                         {6, 2, 0, 6, 2, 1, -1, 0, 3, 4, 3},
                     });
  EXPECT_EQ(l.unshared_tokens(), 5 + 4 + 2);
  EXPECT_EQ(l.parents(), f.parents);
  EXPECT_EQ(l.lengths(), f.lengths);
  DUALKV_SEEDED_RNG(rng);
  check_forest(l, f);
  check_counts(l, f, rng);
  // Only empty segments: nothing to compute, but the paths still count as (empty) rows.
  const Layout e = Layout::tree({-1, 0, -1}, {0, 0, 0});
  EXPECT_EQ(e.total_tokens(), 0);
  EXPECT_TRUE(e.segments().empty() && e.query_tiles().empty() && e.key_tiles().empty());
  EXPECT_EQ(e.token_reduction(), 1.0);
  EXPECT_EQ(Layout::tree({}, {}).total_tokens(), 0);
}

TEST(Layout, OneTokenSegmentsTwoTrees) {
  // Two trees, one-token segments, children listed out of depth-first order.
  const Forest f{{-1, -1, 0, 1, 2, 0}, {1, 2, 1, 1, 1, 3}};
  const Layout l = Layout::tree(f.parents, f.lengths);
  expect_segments(l, {
                         {0, 1, 0, 0, 1, 0, -1, 0, 0, 4, 5},
                         {1, 2, 0, 1, 2, 1, -1, 0, 4, 6, 3},
                         {3, 1, 1, 0, 1, 0, 0, 1, 1, 3, 4},
                         {4, 1, 2, 1, 2, 1, 1, 1, 5, 6, 3},
                         {5, 1, 2, 0, 1, 0, 2, 2, 2, 3, 4},
                         {6, 3, 1, 0, 1, 0, 0, 1, 3, 4, 5},
                     });
  EXPECT_EQ(l.position_ids(), (std::vector<int64_t>{0, 0, 1, 1, 2, 2, 1, 2, 3}));
  EXPECT_EQ(l.unshared_tokens(), 3 + 3 + 4);
  DUALKV_SEEDED_RNG(rng);
  check_forest(l, f);
  check_counts(l, f, rng);
}

TEST(Layout, RandomForests) {
  DUALKV_SEEDED_RNG(rng);
  for (int iter = 0; iter < 60; ++iter) {
    const Forest f = random_forest(rng, 14, int(uniform(rng, 1, 5)), 150, iter % 2 == 0);
    SCOPED_TRACE(describe(f));
    const Layout l = Layout::tree(f.parents, f.lengths);
    check_forest(l, f);
    check_counts(l, f, rng);
    EXPECT_NO_THROW(check_segment_table(l.segments().data(), int32_t(l.segments().size()),
                                        l.total_tokens(), "segments"));
  }
}

TEST(Layout, CheckSegmentTableRejectsEveryChange) {
  const Layout l = Layout::tree({-1, 0, 0, 1, -1, 4}, {4, 3, 2, 5, 2, 1});
  const std::vector<Segment> good = l.segments();
  const auto n = int32_t(good.size());
  EXPECT_NO_THROW(check_segment_table(good.data(), n, l.total_tokens(), "t"));
  for (int32_t i = 0; i < n; ++i) {
    for (int field = 0; field < kSegmentFields; ++field) {
      for (int32_t delta : {-1, 1}) {
        std::vector<Segment> bad = good;
        reinterpret_cast<int32_t*>(&bad[size_t(i)])[field] += delta;
        try {
          check_segment_table(bad.data(), n, l.total_tokens(), "t");
          ADD_FAILURE() << "accepted field " << field << " of segment " << i << " + " << delta;
        } catch (const Error& e) {
          const std::string what = e.what();
          EXPECT_TRUE(what.find("t[") == 0 || what.find("t covers") == 0) << what;
        }
      }
    }
  }
  EXPECT_THROW(check_segment_table(good.data(), n, l.total_tokens() + 1, "t"), Error);
  EXPECT_THROW(check_segment_table(good.data(), n - 1, l.total_tokens(), "t"), Error);
  EXPECT_THROW(check_segment_table(nullptr, n, l.total_tokens(), "t"), Error);
  EXPECT_NO_THROW(check_segment_table(nullptr, 0, 0, "t"));
}

TEST(Layout, AllowedPairsRejectsBadWindow) {
  const Layout l({4}, {{2}});
  EXPECT_THROW(l.allowed_pairs(MaskRule{0}), Error);
  EXPECT_THROW(l.forward_flops(64, 1, MaskRule{-3}), Error);
}

TEST(MaskRule, Basics) {
  const MaskRule none{};
  EXPECT_TRUE(none.allowed(5, 0));
  EXPECT_TRUE(none.allowed(5, 5));
  EXPECT_FALSE(none.allowed(5, 6));
  EXPECT_EQ(none.lowest_key(1000), 0);
  EXPECT_EQ(none.highest_query(7), std::numeric_limits<int32_t>::max());  // saturates
  EXPECT_EQ(none.keys_seen(9), 10);
  const MaskRule w{3};
  EXPECT_TRUE(w.allowed(5, 3));
  EXPECT_FALSE(w.allowed(5, 2));
  EXPECT_EQ(w.lowest_key(5), 3);
  EXPECT_EQ(w.lowest_key(1), 0);
  EXPECT_EQ(w.highest_query(3), 5);
  EXPECT_EQ(w.keys_seen(1), 2);
  EXPECT_EQ(w.keys_seen(10), 3);
  const MaskRule one{1};
  EXPECT_EQ(one.lowest_key(4), 4);
  EXPECT_EQ(one.highest_query(4), 4);
}

}  // namespace
}  // namespace dualkv::test
