// The shared-prompt layout of a micro-batch: G groups, each [prompt | r_1 | ... | r_N],
// packed group after group. One definition for CPU, GPU, forward and backward.
#pragma once

#include <cstdint>
#include <vector>

#include "dualkv/mask.h"

namespace dualkv {

// One non-empty contiguous run of tokens: a group's prompt or one of its responses.
// Plain int32 fields so the same table is read on the host and on the device
// (tensor form: int32 [num_segments, kSegmentFields]).
struct Segment {
  int32_t start;           // packed index of the first token
  int32_t len;             // number of tokens (> 0)
  int32_t pos0;            // logical position of the first token (0 for a prompt, P for a response)
  int32_t prompt_start;    // packed index of the group's prompt (region A)
  int32_t prompt_len;      // P of the group
  int32_t group;           // group index
  int32_t response_index;  // -1 for the prompt, i for response i

  DUALKV_HD bool is_response() const { return response_index >= 0; }
};
inline constexpr int kSegmentFields = 7;
static_assert(sizeof(Segment) == kSegmentFields * sizeof(int32_t));

// A unit of scheduled work: tokens [begin, end) of one segment (query tile in the forward pass,
// key tile in the backward pass). Tiles are kTileSize tokens (the last of a segment may be
// shorter); kernels with smaller blocks split a tile. Tensor form: int32 [num_tiles, kTileFields].
struct Tile {
  int32_t segment;  // index into the segment table
  int32_t begin;    // packed token index of the first token
  int32_t end;      // one past the last
  int32_t cost;     // keys (query tile) or queries (key tile) per token of the tile's first row,
                    // used only to order the work longest-first
};
inline constexpr int kTileFields = 4;
inline constexpr int32_t kTileSize = 128;
static_assert(sizeof(Tile) == kTileFields * sizeof(int32_t));

class Layout {
 public:
  // prefix_lens[g] = P_g; response_lens[g] = {R_g1, ..., R_gN}. Throws dualkv::Error on negative
  // lengths, mismatched group counts, or a total that does not fit in int32.
  Layout(std::vector<int64_t> prefix_lens, std::vector<std::vector<int64_t>> response_lens);

  int32_t total_tokens() const { return total_tokens_; }
  int32_t num_groups() const { return int32_t(prefix_lens_.size()); }
  const std::vector<int64_t>& prefix_lens() const { return prefix_lens_; }
  const std::vector<std::vector<int64_t>>& response_lens() const { return response_lens_; }

  // Non-empty segments in packed order.
  const std::vector<Segment>& segments() const { return segments_; }
  // Logical position of every packed token (RoPE positions), length total_tokens().
  std::vector<int64_t> position_ids() const;
  // Segment index of every packed token.
  std::vector<int32_t> segment_of_token() const;

  // Query tiles, longest-first (cost = keys seen by the tile's last row, ignoring the window).
  std::vector<Tile> query_tiles() const;
  // Key tiles, longest-first (cost = queries that see the tile's first key, ignoring the window).
  std::vector<Tile> key_tiles() const;

  // Number of allowed (query, key) pairs under the mask rule.
  int64_t allowed_pairs(const MaskRule& rule = {}) const;
  // Useful FLOPs of the forward pass: 4 * D * Hq * allowed pairs. Backward = 2.5 x forward.
  double forward_flops(int64_t head_dim, int64_t num_q_heads, const MaskRule& rule = {}) const;
  double backward_flops(int64_t head_dim, int64_t num_q_heads, const MaskRule& rule = {}) const;

  // Tokens of the unshared layout (N rows of P + R_i) over packed tokens; 1 when empty.
  int64_t unshared_tokens() const;
  double token_reduction() const;

 private:
  std::vector<int64_t> prefix_lens_;
  std::vector<std::vector<int64_t>> response_lens_;
  std::vector<Segment> segments_;
  int32_t total_tokens_ = 0;
};

}  // namespace dualkv
