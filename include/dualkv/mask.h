// The one definition of which keys a query may attend to. Used by the layout (FLOP count,
// schedule), the CPU backend and the CUDA kernels, forward and backward.
//
// Within a group, a query at logical position pq sees the keys at logical positions
//   [lo, pq]  with  lo = max(0, pq - window + 1),
// taken from two contiguous key regions of the packed stream:
//   region A, the group's prompt:            positions [0, P)          (prompt and response
//   queries) region B, the query's own response:      positions [P, P + R)      (response queries
//   only)
// Causality (pk <= pq) and the sliding window (pq - pk < window) are the only position rules.
#pragma once

#include <cstdint>
#include <limits>

#include "dualkv/hd.h"

namespace dualkv {

// "No sliding window": every earlier position is in range (positions are < 2^31).
inline constexpr int32_t kNoWindow = std::numeric_limits<int32_t>::max();

struct MaskRule {
  int32_t window = kNoWindow;  // >= 1; kNoWindow when there is no sliding window

  // May a query at logical position pq attend to a key at logical position pk (same group,
  // key in region A or in the query's own region B)?
  DUALKV_HD bool allowed(int32_t pq, int32_t pk) const {
    return pk <= pq && int64_t(pq) - int64_t(pk) < int64_t(window);
  }
  // Lowest key position visible to a query at pq.
  DUALKV_HD int32_t lowest_key(int32_t pq) const {
    return int64_t(pq) - int64_t(window) + 1 > 0 ? int32_t(int64_t(pq) - window + 1) : 0;
  }
  // Highest query position that sees a key at pk (saturates at INT32_MAX).
  DUALKV_HD int32_t highest_query(int32_t pk) const {
    const int64_t h = int64_t(pk) + int64_t(window) - 1;
    return h > int64_t(std::numeric_limits<int32_t>::max()) ? std::numeric_limits<int32_t>::max()
                                                            : int32_t(h);
  }
  // Number of keys a query at pq sees: min(pq + 1, window).
  DUALKV_HD int64_t keys_seen(int32_t pq) const {
    return int64_t(pq) + 1 < int64_t(window) ? int64_t(pq) + 1 : int64_t(window);
  }
};

}  // namespace dualkv
