// The layout of a micro-batch: a forest of prefix-tree segments in packed order (Layout::tree), or
// its depth-two case, G groups [prompt | r_1 | ... | r_N] packed group after group. One
// definition for CPU, GPU, forward and backward.
#pragma once

#include <cstdint>
#include <vector>

#include "dualkv/mask.h"

namespace dualkv {

// One non-empty contiguous run of tokens: a segment of a prefix tree (a prompt or a response in
// the depth-two layout). Plain int32 fields so the same table is read on the host and on the
// device (tensor form: int32 [num_segments, kSegmentFields]). Segments are in packed order, which
// need not be depth-first; empty segments of the user's list are dropped (their children hang
// from the nearest non-empty ancestor).
struct Segment {
  int32_t start;       // packed index of the first token
  int32_t len;         // tokens (> 0)
  int32_t pos0;        // logical position of the first token = tokens of all its ancestors
  int32_t root_start;  // packed start of its tree's root segment (region A; itself for a root)
  int32_t root_len;    // that root's length
  int32_t group;       // tree index, in packed order of the roots (the depth-two layout: g,
                       //   except that a group with P = 0 makes each response a tree of its own)
  int32_t parent;      // table index of the nearest non-empty ancestor; -1 for a root
  int32_t depth;       // number of non-empty ancestors (0 root; depth-two: 1 = response)
  int32_t pre;         // depth-first pre-order rank of the segment in the forest (children in
                       //   packed order); pre == table index when the order is depth-first
  int32_t pre_end;     // one past the pre-order rank of the last segment of its subtree
  int32_t last_desc;   // highest table index in its subtree (itself for a leaf)
  DUALKV_HD bool is_root() const { return parent < 0; }
};
inline constexpr int kSegmentFields = 11;
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
  // prefix_lens[g] = P_g; response_lens[g] = {R_g1, ..., R_gN}: the depth-two forest (each
  // prompt a root, its responses its children). Throws dualkv::Error on negative lengths,
  // mismatched group counts, or positions or a total that do not fit in int32.
  Layout(std::vector<int64_t> prefix_lens, std::vector<std::vector<int64_t>> response_lens);

  // A forest of segments in packed order: segment i has lengths[i] tokens (>= 0) and parent
  // parents[i] (< i, or -1 for a root). Its tokens attend to every token of its ancestors and
  // causally to its own; its positions continue from its parent's end. Throws dualkv::Error
  // (naming the argument) on mismatched sizes, a parent out of range or after its child, a
  // negative length, or positions or a total beyond int32.
  static Layout tree(std::vector<int64_t> parents, std::vector<int64_t> lengths);

  // False for the prompt/response layout.
  bool is_tree() const { return is_tree_; }
  // The forest in the user's terms, one entry per segment of the user's list, empty ones
  // included (for the prompt/response layout: its depth-two forest, prompt before responses).
  const std::vector<int64_t>& parents() const { return parents_; }
  const std::vector<int64_t>& lengths() const { return lengths_; }

  // The prompt/response description; throw dualkv::Error on a tree layout.
  int32_t num_groups() const;
  const std::vector<int64_t>& prefix_lens() const;
  const std::vector<std::vector<int64_t>>& response_lens() const;

  int32_t total_tokens() const { return total_tokens_; }

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

  // Tokens of the unshared rows: a tree has one row per leaf of the user's list (empty leaves
  // included), its root-to-leaf path; the prompt/response layout one row P + R_i per response (a
  // group without responses has none). token_reduction = unshared / packed tokens, 1 when empty.
  int64_t unshared_tokens() const { return unshared_tokens_; }
  double token_reduction() const;

 private:
  Layout() = default;
  // Builds the table and totals from parents_ / lengths_ (validated).
  void build();

  bool is_tree_ = false;
  std::vector<int64_t> parents_, lengths_;
  std::vector<int64_t> prefix_lens_;
  std::vector<std::vector<int64_t>> response_lens_;
  std::vector<Segment> segments_;
  int32_t total_tokens_ = 0;
  int64_t unshared_tokens_ = 0;
};

// Checks a segment table that did not come from a Layout (e.g. tensors a user built): throws
// dualkv::Error naming `what`[i] for the first entry that differs from the table Layout::tree
// builds from the table's own parents and lengths, or if it does not cover total_tokens tokens.
// Afterwards every walk over it stays in range.
void check_segment_table(const Segment* segments, int32_t num_segments, int32_t total_tokens,
                         const char* what);

}  // namespace dualkv
