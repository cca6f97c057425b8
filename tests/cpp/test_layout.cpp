// The layout: validation, segments and positions, tile work lists, pair and FLOP counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
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
  const std::vector<Segment> want = {
      {0, 3, 0, 0, 3, 0, -1}, {3, 2, 3, 0, 3, 0, 0},    {5, 1, 3, 0, 3, 0, 2},
      {6, 4, 0, 6, 0, 1, 0},  {10, 2, 0, 10, 2, 2, -1},
  };
  ASSERT_EQ(l.segments().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const Segment& s = l.segments()[i];
    const Segment& w = want[i];
    EXPECT_TRUE(s.start == w.start && s.len == w.len && s.pos0 == w.pos0 &&
                s.prompt_start == w.prompt_start && s.prompt_len == w.prompt_len &&
                s.group == w.group && s.response_index == w.response_index)
        << "segment " << i;
  }
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
// on a tile boundary of it; longest-first with the documented cost.
void check_tiles(const Layout& l, const std::vector<Tile>& tiles, bool keys) {
  const auto& segs = l.segments();
  std::vector<int> count(size_t(l.total_tokens()), 0);
  std::vector<int64_t> response_tokens(size_t(l.num_groups()), 0);
  for (const Segment& s : segs) {
    if (s.is_response()) response_tokens[size_t(s.group)] += s.len;
  }
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
    const int64_t cost = keys ? (s.start + s.len - t.begin) +
                                    (s.is_response() ? 0 : response_tokens[size_t(s.group)])
                              : (s.is_response() ? s.prompt_len : 0) + (t.end - s.start);
    EXPECT_EQ(t.cost, cost);
    if (i > 0) {
      EXPECT_GE(tiles[i - 1].cost, t.cost) << "not sorted longest-first at " << i;
    }
    for (int32_t x = t.begin; x < t.end; ++x) ++count[size_t(x)];
  }
  for (size_t x = 0; x < count.size(); ++x) ASSERT_EQ(count[x], 1) << "token " << x;
}

// Brute force over all (q, k) pairs with MaskRule::allowed: same group, and the key in the
// group's prompt or in the query's own response.
int64_t brute_force_pairs(const Layout& l, const MaskRule& rule) {
  const auto pos = l.position_ids();
  const auto seg = l.segment_of_token();
  const auto& segs = l.segments();
  int64_t n = 0;
  for (size_t q = 0; q < pos.size(); ++q) {
    const Segment& sq = segs[size_t(seg[q])];
    for (size_t k = 0; k < pos.size(); ++k) {
      const Segment& sk = segs[size_t(seg[k])];
      if (sq.group != sk.group) continue;
      if (sk.is_response() && sk.start != sq.start) continue;  // another response
      n += rule.allowed(int32_t(pos[q]), int32_t(pos[k]));
    }
  }
  return n;
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
    check_tiles(l, l.query_tiles(), false);
    check_tiles(l, l.key_tiles(), true);
    for (int32_t w : {kNoWindow, 1, 2, int32_t(uniform(rng, 3, 400))}) {
      const MaskRule rule{w};
      const int64_t pairs = l.allowed_pairs(rule);
      ASSERT_EQ(pairs, brute_force_pairs(l, rule)) << "window " << w;
      EXPECT_DOUBLE_EQ(l.forward_flops(128, 32, rule), 4.0 * 128 * 32 * double(pairs));
      EXPECT_DOUBLE_EQ(l.backward_flops(64, 8, rule), 2.5 * 4.0 * 64 * 8 * double(pairs));
    }
  }
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
