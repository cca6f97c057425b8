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
    for (size_t i = 0; i < response_lens_[g].size(); ++i) {
      const int64_t R = response_lens_[g][i];
      DUALKV_CHECK(R >= 0, "response_lens[", g, "][", i, "] = ", R, " is negative");
      DUALKV_CHECK(R <= kMaxTokens && P + R <= kMaxTokens, "response_lens[", g, "][", i, "] = ", R,
                   ": logical positions exceed the int32 range");
    }
    const int64_t prompt_start = total;
    if (P > 0) {
      segments_.push_back(
          {int32_t(total), int32_t(P), 0, int32_t(prompt_start), int32_t(P), int32_t(g), -1});
    }
    total += P;
    DUALKV_CHECK(total <= kMaxTokens, "total tokens exceed the int32 range (", kMaxTokens, ")");
    for (size_t i = 0; i < response_lens_[g].size(); ++i) {
      const int64_t R = response_lens_[g][i];
      if (R > 0) {
        segments_.push_back({int32_t(total), int32_t(R), int32_t(P), int32_t(prompt_start),
                             int32_t(P), int32_t(g), int32_t(i)});
      }
      total += R;
      DUALKV_CHECK(total <= kMaxTokens, "total tokens exceed the int32 range (", kMaxTokens, ")");
    }
  }
  total_tokens_ = int32_t(total);
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
std::vector<Tile> tiles_longest_first(const std::vector<Segment>& segments, int32_t num_groups,
                                      bool keys) {
  // Every response query of a group sees the group's prompt keys.
  std::vector<int64_t> response_tokens(size_t(num_groups), 0);
  for (const Segment& s : segments) {
    if (s.is_response()) response_tokens[size_t(s.group)] += s.len;
  }
  std::vector<Tile> tiles;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const int64_t group_response_tokens = response_tokens[size_t(s.group)];
    // 64-bit steps: a segment of up to INT32_MAX tokens ends within kTileSize of the int32 limit.
    for (int64_t b = 0; b < s.len; b += kTileSize) {
      const int64_t e = std::min<int64_t>(s.len, b + kTileSize);
      int64_t cost;
      if (!keys) {
        cost = (s.is_response() ? s.prompt_len : 0) + e;  // keys seen by the tile's last row
      } else {
        cost = (s.len - b) + group_response_tokens * (s.is_response() ? 0 : 1);
      }
      tiles.push_back({int32_t(i), int32_t(s.start + b), int32_t(s.start + e),
                       int32_t(std::min<int64_t>(cost, kMaxTokens))});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}
}  // namespace

std::vector<Tile> Layout::query_tiles() const {
  return tiles_longest_first(segments_, num_groups(), false);
}
std::vector<Tile> Layout::key_tiles() const {
  return tiles_longest_first(segments_, num_groups(), true);
}

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

int64_t Layout::unshared_tokens() const {
  int64_t n = 0;
  for (size_t g = 0; g < prefix_lens_.size(); ++g) {
    for (int64_t R : response_lens_[g]) n += prefix_lens_[g] + R;
  }
  return n;
}

double Layout::token_reduction() const {
  return total_tokens_ == 0 ? 1.0 : double(unshared_tokens()) / double(total_tokens_);
}

}  // namespace dualkv
