#include "dualkv/layout.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "dualkv/error.h"
#include "dualkv/params.h"

namespace dualkv {

namespace {
constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();

// Sum of min(p + 1, window) over the logical positions p in [pos0, pos0 + len).
int64_t keys_seen_sum(int64_t pos0, int64_t len, int64_t window) {
  // Positions p with p + 1 <= window see p + 1 keys; the rest see window keys.
  const int64_t end = pos0 + len;                           // one past the last position
  const int64_t split = std::clamp(window - 1, pos0, end);  // first position seeing `window` keys
  const int64_t ramp = (split - pos0) * (pos0 + 1 + split) / 2;  // sum of p + 1 over [pos0, split)
  return ramp + (end - split) * window;
}
}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "unknown";
}

namespace {
// The table of the non-empty segments of a forest given as parents / lengths, with its number of
// packed tokens and unshared tokens (the root-to-leaf paths of the user's list). Throws
// dualkv::Error naming parents[i] / lengths[i] on an invalid forest.
struct Forest {
  std::vector<Segment> segments;
  int64_t total = 0, unshared = 0;
};

Forest build_forest(const std::vector<int64_t>& parents, const std::vector<int64_t>& lengths) {
  DUALKV_CHECK(parents.size() == lengths.size(), "parents has ", parents.size(),
               " entries but lengths has ", lengths.size(), "; give one parent per segment");
  DUALKV_CHECK(int64_t(parents.size()) <= kMaxTokens, "too many segments (", parents.size(), ")");
  const size_t n = parents.size();
  Forest f;
  std::vector<int32_t> table_of(n);  // table index of the nearest non-empty ancestor-or-self
  std::vector<int64_t> end(n);       // one past the last logical position of segment i
  std::vector<uint8_t> has_child(n, 0);
  int32_t trees = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t p = parents[i], len = lengths[i];
    DUALKV_CHECK(p >= -1 && p < int64_t(i), "parents[", i, "] = ", p,
                 ": a segment's parent must come before it in the list (parents[i] < i) or be -1 "
                 "for a root");
    DUALKV_CHECK(len >= 0, "lengths[", i, "] = ", len, " is negative");
    const int64_t pos0 = p < 0 ? 0 : end[size_t(p)];
    DUALKV_CHECK(len <= kMaxTokens && pos0 + len <= kMaxTokens, "lengths[", i, "] = ", len,
                 ": the logical positions of segment ", i, " (", pos0,
                 " tokens of ancestors before it) exceed the int32 range");
    end[i] = pos0 + len;
    if (p >= 0) has_child[size_t(p)] = 1;
    const int32_t anc = p < 0 ? -1 : table_of[size_t(p)];
    if (len == 0) {  // dropped: its children hang from `anc`
      table_of[i] = anc;
      continue;
    }
    const auto index = int32_t(f.segments.size());
    Segment s{};
    s.start = int32_t(f.total);
    s.len = int32_t(len);
    s.pos0 = int32_t(pos0);
    s.parent = anc;
    if (anc < 0) {
      s.root_start = s.start;
      s.root_len = s.len;
      s.group = trees++;
      s.depth = 0;
    } else {
      const Segment& a = f.segments[size_t(anc)];
      s.root_start = a.root_start;
      s.root_len = a.root_len;
      s.group = a.group;
      s.depth = a.depth + 1;
    }
    s.last_desc = index;
    f.segments.push_back(s);
    table_of[i] = index;
    f.total += len;
    DUALKV_CHECK(f.total <= kMaxTokens, "total tokens exceed the int32 range (", kMaxTokens, ")");
  }
  for (size_t i = 0; i < n; ++i) {
    if (!has_child[i]) f.unshared += end[i];
  }
  // Subtree sizes and last descendants, children before parents (parent < child).
  std::vector<Segment>& segs = f.segments;
  const size_t S = segs.size();
  std::vector<int32_t> size(S, 1);
  for (size_t j = S; j-- > 0;) {
    const int32_t p = segs[j].parent;
    if (p < 0) continue;
    size[size_t(p)] += size[j];
    segs[size_t(p)].last_desc = std::max(segs[size_t(p)].last_desc, segs[j].last_desc);
  }
  // Pre-order ranks: the roots in packed order, each child after its earlier siblings' subtrees.
  std::vector<int32_t> next(S);  // rank of the next child of segment j
  int32_t next_root = 0;
  for (size_t j = 0; j < S; ++j) {
    Segment& s = segs[j];
    int32_t& slot = s.parent < 0 ? next_root : next[size_t(s.parent)];
    s.pre = slot;
    slot += size[j];
    s.pre_end = s.pre + size[j];
    next[j] = s.pre + 1;
  }
  return f;
}
}  // namespace

Layout::Layout(std::vector<int64_t> prefix_lens, std::vector<std::vector<int64_t>> response_lens)
    : prefix_lens_(std::move(prefix_lens)), response_lens_(std::move(response_lens)) {
  DUALKV_CHECK(prefix_lens_.size() == response_lens_.size(), "prefix_lens has ",
               prefix_lens_.size(), " groups but response_lens has ", response_lens_.size(),
               "; they must describe the same groups");
  int64_t total = 0;
  for (size_t g = 0; g < prefix_lens_.size(); ++g) {
    const int64_t P = prefix_lens_[g];
    DUALKV_CHECK(P >= 0, "prefix_lens[", g, "] = ", P, " is negative");
    DUALKV_CHECK(P <= kMaxTokens, "prefix_lens[", g, "] = ", P, " exceeds the int32 range");
    total += P;
    DUALKV_CHECK(total <= kMaxTokens, "total tokens exceed the int32 range (", kMaxTokens, ")");
    const auto prompt = int64_t(parents_.size());
    parents_.push_back(-1);
    lengths_.push_back(P);
    for (size_t i = 0; i < response_lens_[g].size(); ++i) {
      const int64_t R = response_lens_[g][i];
      DUALKV_CHECK(R >= 0, "response_lens[", g, "][", i, "] = ", R, " is negative");
      DUALKV_CHECK(R <= kMaxTokens && P + R <= kMaxTokens, "response_lens[", g, "][", i, "] = ", R,
                   ": logical positions exceed the int32 range");
      total += R;
      DUALKV_CHECK(total <= kMaxTokens, "total tokens exceed the int32 range (", kMaxTokens, ")");
      parents_.push_back(prompt);
      lengths_.push_back(R);
    }
  }
  build();
  // N rows of P + R_i per group: a group without responses has no row (the tree rule would count
  // its prompt as a leaf).
  unshared_tokens_ = 0;
  for (size_t g = 0; g < prefix_lens_.size(); ++g) {
    for (int64_t R : response_lens_[g]) unshared_tokens_ += prefix_lens_[g] + R;
  }
}

Layout Layout::tree(std::vector<int64_t> parents, std::vector<int64_t> lengths) {
  Layout l;
  l.is_tree_ = true;
  l.parents_ = std::move(parents);
  l.lengths_ = std::move(lengths);
  l.build();
  return l;
}

void Layout::build() {
  Forest f = build_forest(parents_, lengths_);
  segments_ = std::move(f.segments);
  total_tokens_ = int32_t(f.total);
  unshared_tokens_ = f.unshared;
}

int32_t Layout::num_groups() const { return int32_t(prefix_lens().size()); }

const std::vector<int64_t>& Layout::prefix_lens() const {
  DUALKV_CHECK(!is_tree_, "a tree layout has parents and lengths, not prefix_lens / response_lens");
  return prefix_lens_;
}

const std::vector<std::vector<int64_t>>& Layout::response_lens() const {
  DUALKV_CHECK(!is_tree_, "a tree layout has parents and lengths, not prefix_lens / response_lens");
  return response_lens_;
}

void check_segment_table(const Segment* segments, int32_t num_segments, int32_t total_tokens,
                         const char* what) {
  DUALKV_CHECK(num_segments >= 0 && total_tokens >= 0, what, ": ", num_segments, " segments and ",
               total_tokens, " tokens: sizes must be non-negative");
  DUALKV_CHECK(num_segments == 0 || segments != nullptr, what, " must not be null");
  // Parents and lengths in range first, so that rebuilding cannot fail; then every field must be
  // the one the builder derives.
  const auto n = size_t(num_segments);
  std::vector<int64_t> parents(n), lengths(n), end(n);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const Segment& s = segments[i];
    total += std::max(s.len, 0);
    DUALKV_CHECK(s.len > 0 && s.parent >= -1 && s.parent < int64_t(i) && total <= total_tokens,
                 what, "[", i, "] is inconsistent: len ", s.len, ", parent ", s.parent, " (",
                 total_tokens, " tokens)");
    parents[i] = s.parent;
    lengths[i] = s.len;
    end[i] = (s.parent < 0 ? 0 : end[size_t(s.parent)]) + s.len;
    DUALKV_CHECK(end[i] <= kMaxTokens, what, "[", i,
                 "]: its logical positions exceed the int32 range");
  }
  DUALKV_CHECK(total == total_tokens, what, " covers ", total, " of ", total_tokens, " tokens");
  const Forest f = build_forest(parents, lengths);
  for (int32_t i = 0; i < num_segments; ++i) {
    const Segment &s = segments[i], &w = f.segments[size_t(i)];
    const bool same = s.start == w.start && s.len == w.len && s.pos0 == w.pos0 &&
                      s.root_start == w.root_start && s.root_len == w.root_len &&
                      s.group == w.group && s.parent == w.parent && s.depth == w.depth &&
                      s.pre == w.pre && s.pre_end == w.pre_end && s.last_desc == w.last_desc;
    DUALKV_CHECK(same, what, "[", i, "] = {start ", s.start, ", len ", s.len, ", pos0 ", s.pos0,
                 ", root_start ", s.root_start, ", root_len ", s.root_len, ", group ", s.group,
                 ", parent ", s.parent, ", depth ", s.depth, ", pre ", s.pre, ", pre_end ",
                 s.pre_end, ", last_desc ", s.last_desc,
                 "} is inconsistent with its parents and lengths (expected start ", w.start,
                 ", pos0 ", w.pos0, ", root_start ", w.root_start, ", root_len ", w.root_len,
                 ", group ", w.group, ", depth ", w.depth, ", pre ", w.pre, ", pre_end ", w.pre_end,
                 ", last_desc ", w.last_desc, ")");
  }
}

std::vector<int64_t> Layout::position_ids() const {
  std::vector<int64_t> pos(static_cast<size_t>(total_tokens_));
  for (const Segment& s : segments_)
    std::iota(pos.begin() + s.start, pos.begin() + s.start + s.len, int64_t(s.pos0));
  return pos;
}

std::vector<int32_t> Layout::segment_of_token() const {
  std::vector<int32_t> seg(static_cast<size_t>(total_tokens_));
  for (size_t i = 0; i < segments_.size(); ++i) {
    std::fill_n(seg.begin() + segments_[i].start, segments_[i].len, int32_t(i));
  }
  return seg;
}

namespace {
std::vector<Tile> tiles_longest_first(const std::vector<Segment>& segments, bool keys) {
  // A key of a segment is seen by its own later queries and by every query of its descendants.
  std::vector<int64_t> subtree_tokens(segments.size());
  for (size_t j = segments.size(); j-- > 0;) {
    subtree_tokens[j] += segments[j].len;
    if (!segments[j].is_root()) subtree_tokens[size_t(segments[j].parent)] += subtree_tokens[j];
  }
  std::vector<Tile> tiles;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const int64_t descendant_tokens = subtree_tokens[i] - s.len;
    // 64-bit steps: a segment of up to INT32_MAX tokens ends within kTileSize of the int32 limit.
    for (int64_t b = 0; b < s.len; b += kTileSize) {
      const int64_t e = std::min<int64_t>(s.len, b + kTileSize);
      // Keys seen by the tile's last row, or queries that see the tile's first key.
      const int64_t cost = keys ? (s.len - b) + descendant_tokens : s.pos0 + e;
      tiles.push_back({int32_t(i), int32_t(s.start + b), int32_t(s.start + e),
                       int32_t(std::min<int64_t>(cost, kMaxTokens))});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}
}  // namespace

std::vector<Tile> Layout::query_tiles() const { return tiles_longest_first(segments_, false); }
std::vector<Tile> Layout::key_tiles() const { return tiles_longest_first(segments_, true); }

int64_t Layout::allowed_pairs(const MaskRule& rule) const {
  DUALKV_CHECK(rule.window >= 1, "window must be >= 1, got ", rule.window);
  int64_t pairs = 0;
  for (const Segment& s : segments_) pairs += keys_seen_sum(s.pos0, s.len, rule.window);
  return pairs;
}

double Layout::forward_flops(int64_t head_dim, int64_t num_q_heads, const MaskRule& rule) const {
  return 4.0 * double(head_dim) * double(num_q_heads) * double(allowed_pairs(rule));
}

double Layout::backward_flops(int64_t head_dim, int64_t num_q_heads, const MaskRule& rule) const {
  return 2.5 * forward_flops(head_dim, num_q_heads, rule);
}

double Layout::token_reduction() const {
  return total_tokens_ == 0 ? 1.0 : double(unshared_tokens()) / double(total_tokens_);
}

}  // namespace dualkv
