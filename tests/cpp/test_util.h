// Shared helpers of the C++ tests: seeds, random layouts, typed buffers and the naive fp64
// oracle (attention over the *unshared* rows), independent of the library's mask code.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "convert.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"
#include "dualkv/params.h"

namespace dualkv::test {

// Fresh seed per test (random_device), or DUALKV_TEST_SEED to replay a failure.
inline uint64_t test_seed() {
  if (const char* s = std::getenv("DUALKV_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}
#define DUALKV_SEEDED_RNG(rng)                                                                  \
  const uint64_t rng##_seed = ::dualkv::test::test_seed();                                      \
  SCOPED_TRACE(::testing::Message() << "seed " << rng##_seed                                    \
                                    << " (replay with DUALKV_TEST_SEED=" << rng##_seed << ")"); \
  std::mt19937_64 rng(rng##_seed)

struct Lens {
  std::vector<int64_t> prefix;
  std::vector<std::vector<int64_t>> responses;
};

inline std::string describe(const Lens& l) {
  std::ostringstream os;
  for (size_t g = 0; g < l.prefix.size(); ++g) {
    os << "[P=" << l.prefix[g] << " R={";
    for (size_t i = 0; i < l.responses[g].size(); ++i) os << (i ? "," : "") << l.responses[g][i];
    os << "}]";
  }
  return os.str();
}

inline int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// A random length in [0, hi], often exactly 0 or 1.
inline int64_t edge_length(std::mt19937_64& rng, int64_t hi) {
  const int64_t u = uniform(rng, 0, 9);
  if (u == 0) return 0;
  if (u == 1) return 1;
  return uniform(rng, 0, hi);
}

// Several groups with different P, N, R. With `long_first`, group 0 has a prompt and a response
// longer than one tile (128) and off the tile boundary, so tiles split.
inline Lens random_lens(std::mt19937_64& rng, int max_groups, int64_t max_p, int max_n,
                        int64_t max_r, bool long_first) {
  Lens l;
  const int G = int(uniform(rng, 1, max_groups));
  for (int g = 0; g < G; ++g) {
    l.prefix.push_back(edge_length(rng, max_p));
    std::vector<int64_t> r(size_t(uniform(rng, 0, max_n)));
    for (auto& x : r) x = edge_length(rng, max_r);
    l.responses.push_back(r);
  }
  if (long_first) {
    l.prefix[0] = uniform(rng, 129, std::max<int64_t>(max_p, 140));
    if (l.prefix[0] % 128 == 0) ++l.prefix[0];
    l.responses[0].push_back(uniform(rng, 129, std::max<int64_t>(max_r, 140)));
    if (l.responses[0].back() % 128 == 0) ++l.responses[0].back();
    l.responses[0].push_back(uniform(rng, 0, 1));  // a 0 or 1 token response
    std::shuffle(l.responses[0].begin(), l.responses[0].end(), rng);
  }
  return l;
}

// A forest in the user's terms (Layout::tree's arguments).
struct Forest {
  std::vector<int64_t> parents, lengths;
};

inline std::string describe(const Forest& f) {
  std::ostringstream os;
  for (size_t i = 0; i < f.parents.size(); ++i)
    os << (i ? " " : "") << f.parents[i] << ":" << f.lengths[i];
  return os.str();
}

// A random forest of up to max_segments segments, depth up to max_depth, lengths as edge_length
// (often 0 or 1) and, with `long_first`, a root longer than one tile. Parents are drawn among the
// earlier segments, so the order is rarely depth-first.
inline Forest random_forest(std::mt19937_64& rng, int max_segments, int max_depth, int64_t max_len,
                            bool long_first) {
  Forest f;
  std::vector<int> depth;
  const int n = int(uniform(rng, 1, max_segments));
  for (int i = 0; i < n; ++i) {
    int64_t p = uniform(rng, -1, i - 1);
    if (uniform(rng, 0, 5) == 0) p = -1;  // more trees
    if (p >= 0 && depth[size_t(p)] + 1 >= max_depth) p = -1;
    depth.push_back(p < 0 ? 0 : depth[size_t(p)] + 1);
    f.parents.push_back(p);
    f.lengths.push_back(edge_length(rng, max_len));
  }
  if (long_first) {
    f.lengths[0] = uniform(rng, 129, std::max<int64_t>(max_len, 140));
    if (f.lengths[0] % 128 == 0) ++f.lengths[0];
  }
  return f;
}

// The forest of a layout in the user's terms, brute force: every user segment's first packed
// token and logical position, and the ancestor relation by walking the user's parents.
struct UserForest {
  explicit UserForest(const Forest& f) : f(f) {
    int64_t at = 0;
    for (size_t i = 0; i < f.parents.size(); ++i) {
      start.push_back(at);
      pos0.push_back(
          f.parents[i] < 0 ? 0 : pos0[size_t(f.parents[i])] + f.lengths[size_t(f.parents[i])]);
      at += f.lengths[i];
      for (int64_t j = 0; j < f.lengths[i]; ++j) owner.push_back(int64_t(i));
    }
    const size_t n = f.parents.size();
    anc.assign(n * n, 0);
    for (size_t s = 0; s < n; ++s) {
      for (int64_t a = int64_t(s); a >= 0; a = f.parents[size_t(a)]) anc[size_t(a) * n + s] = 1;
    }
  }
  bool ancestor_or_self(int64_t a, int64_t s) const {
    return anc[size_t(a) * f.parents.size() + size_t(s)] != 0;
  }
  int64_t position(int64_t token) const {
    const int64_t i = owner[size_t(token)];
    return pos0[size_t(i)] + token - start[size_t(i)];
  }
  // DESIGN.md's rule: query token q may attend to key token k (packed indices).
  bool sees(int64_t q, int64_t k, const MaskRule& rule) const {
    return ancestor_or_self(owner[size_t(k)], owner[size_t(q)]) &&
           rule.allowed(int32_t(position(q)), int32_t(position(k)));
  }
  Forest f;
  std::vector<int64_t> start, pos0, owner;  // owner: user segment of each packed token
  std::vector<uint8_t> anc;                 // anc[a * n + s]: a is s or one of its ancestors
};

// A Layout together with the tables a backend reads.
struct LayoutTables {
  explicit LayoutTables(const Lens& l) : LayoutTables(Layout(l.prefix, l.responses)) {}
  explicit LayoutTables(const Forest& f) : LayoutTables(Layout::tree(f.parents, f.lengths)) {}
  explicit LayoutTables(Layout l)
      : layout(std::move(l)),
        segments(layout.segments()),
        query_tiles(layout.query_tiles()),
        key_tiles(layout.key_tiles()) {}
  LayoutView view() const {
    return {segments.data(),          query_tiles.data(),          key_tiles.data(),
            int32_t(segments.size()), int32_t(query_tiles.size()), int32_t(key_tiles.size()),
            layout.total_tokens()};
  }
  Layout layout;
  std::vector<Segment> segments;
  std::vector<Tile> query_tiles, key_tiles;
};

// ---- storage types --------------------------------------------------------------------------

template <class S>
struct StorageOf;
template <>
struct StorageOf<double> {
  static constexpr DType kType = DType::kFloat64;
};
template <>
struct StorageOf<float> {
  static constexpr DType kType = DType::kFloat32;
};
template <>
struct StorageOf<cpu::Half> {
  static constexpr DType kType = DType::kFloat16;
};
template <>
struct StorageOf<cpu::BFloat16> {
  static constexpr DType kType = DType::kBFloat16;
};

template <class S>
double to_double(S x) {
  if constexpr (std::is_same_v<S, double>) {
    return x;
  } else {
    return double(cpu::load<float>(x));
  }
}
template <class S>
S from_double(double x) {
  if constexpr (std::is_same_v<S, double>) {
    return x;
  } else {
    return cpu::store<S>(float(x));
  }
}
template <class S>
S nan_value() {
  return from_double<S>(std::numeric_limits<double>::quiet_NaN());
}
template <class S>
bool is_nan(S x) {
  return std::isnan(to_double(x));
}

// Rounds a double through S (the value an S tensor would hold).
template <class S>
double round_to(double x) {
  return to_double(from_double<S>(x));
}

// ---- the oracle ------------------------------------------------------------------------------

struct RefConfig {
  int T = 0, Hq = 0, Hkv = 0, D = 0;
  double scale = 1, softcap = 0;
  int64_t window = std::numeric_limits<int32_t>::max();
};

struct RefResult {
  std::vector<double> out, lse, dq, dk, dv;  // out/dq [T,Hq,D], lse [Hq,T], dk/dv [T,Hkv,D]
};

// Attention of queries `qi` (packed indices, logical positions qpos) over keys `ki`/`kpos` of
// one unshared row, plain causal + window on positions. Accumulates out/lse of the queries and
// their gradients into r. With rnd != nullptr every stage is rounded like a plain low-precision
// implementation (matmul outputs, softmax, elementwise ops, gradient accumulation).
inline void ref_row(const RefConfig& c, const std::vector<int>& qi, const std::vector<int>& qpos,
                    const std::vector<int>& ki, const std::vector<int>& kpos,
                    const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout,
                    const std::vector<double>* dlse, double (*rnd)(double), RefResult& r) {
  auto R = [&](double x) { return rnd ? rnd(x) : x; };
  const int nq = int(qi.size()), nk = int(ki.size()), D = c.D, group = c.Hq / c.Hkv;
  const size_t nks = static_cast<size_t>(nk);
  std::vector<double> s(nks), t(nks), p(nks), dp(nks);
  // Key gradients of this row, summed over its queries before being added to the totals.
  std::vector<double> dk_row(nks * D), dv_row(nks * D);
  for (int hk = 0; hk < c.Hkv; ++hk) {
    std::fill(dk_row.begin(), dk_row.end(), 0.0);
    std::fill(dv_row.begin(), dv_row.end(), 0.0);
    for (int h = hk * group; h < (hk + 1) * group; ++h) {
      for (int i = 0; i < nq; ++i) {
        const double* qv = &q[(size_t(qi[i]) * c.Hq + h) * D];
        double mx = -INFINITY;
        for (int j = 0; j < nk; ++j) {
          const int64_t diff = int64_t(qpos[i]) - kpos[j];
          if (diff < 0 || diff >= c.window) {
            s[size_t(j)] = -INFINITY;
            continue;
          }
          const double* kv = &k[(size_t(ki[j]) * c.Hkv + hk) * D];
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += qv[d] * kv[d];
          double x = R(R(acc) * c.scale);
          if (c.softcap > 0) {
            t[size_t(j)] = R(std::tanh(R(x / c.softcap)));
            x = R(c.softcap * t[size_t(j)]);
          }
          s[size_t(j)] = x;
          mx = std::max(mx, x);
        }
        double sum = 0;
        for (int j = 0; j < nk; ++j) {
          if (s[size_t(j)] != -INFINITY) sum += std::exp(s[size_t(j)] - mx);
        }
        const double lse = mx + std::log(sum);
        r.lse[size_t(h) * c.T + qi[i]] = lse;
        double* o = &r.out[(size_t(qi[i]) * c.Hq + h) * D];
        std::vector<double> oacc(size_t(D), 0.0);
        for (int j = 0; j < nk; ++j) {
          p[size_t(j)] = s[size_t(j)] == -INFINITY ? 0 : R(std::exp(s[size_t(j)] - lse));
          const double* vv = &v[(size_t(ki[j]) * c.Hkv + hk) * D];
          for (int d = 0; d < D; ++d) oacc[size_t(d)] += p[size_t(j)] * vv[d];
        }
        for (int d = 0; d < D; ++d) o[d] = R(oacc[size_t(d)]);
        // Backward of this query row.
        const double* g = &dout[(size_t(qi[i]) * c.Hq + h) * D];
        double pdp = 0;
        for (int j = 0; j < nk; ++j) {
          if (s[size_t(j)] == -INFINITY) {
            dp[size_t(j)] = 0;
            continue;
          }
          const double* vv = &v[(size_t(ki[j]) * c.Hkv + hk) * D];
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += g[d] * vv[d];
          dp[size_t(j)] = R(acc);
          pdp += p[size_t(j)] * dp[size_t(j)];
        }
        const double gl = dlse ? (*dlse)[size_t(h) * c.T + qi[i]] : 0.0;
        std::vector<double> dqacc(size_t(D), 0.0);
        for (int j = 0; j < nk; ++j) {
          if (s[size_t(j)] == -INFINITY) continue;
          // softmax backward, plus the lse gradient dlse * softmax
          double ds = R(p[size_t(j)] * (dp[size_t(j)] - pdp));
          if (dlse) ds = R(ds + R(gl * std::exp(s[size_t(j)] - lse)));
          if (c.softcap > 0) ds = R(ds * R(1 - t[size_t(j)] * t[size_t(j)]));
          ds = R(ds * c.scale);
          const double* kv = &k[(size_t(ki[j]) * c.Hkv + hk) * D];
          for (int d = 0; d < D; ++d) {
            dqacc[size_t(d)] += ds * kv[d];
            dk_row[size_t(j) * D + d] += ds * qv[d];
            dv_row[size_t(j) * D + d] += p[size_t(j)] * g[d];
          }
        }
        double* dq = &r.dq[(size_t(qi[i]) * c.Hq + h) * D];
        for (int d = 0; d < D; ++d) dq[d] = R(dqacc[size_t(d)]);
      }
    }
    for (int j = 0; j < nk; ++j) {
      for (int d = 0; d < D; ++d) {
        const size_t x = (size_t(ki[j]) * c.Hkv + hk) * D + d;
        r.dk[x] = R(r.dk[x] + R(dk_row[size_t(j) * D + d]));
        r.dv[x] = R(r.dv[x] + R(dv_row[size_t(j) * D + d]));
      }
    }
  }
}

// The depth-two layout as a forest: each prompt a root, its responses its children.
inline Forest forest_of(const Lens& l) {
  Forest f;
  for (size_t g = 0; g < l.prefix.size(); ++g) {
    const auto prompt = int64_t(f.parents.size());
    f.parents.push_back(-1);
    f.lengths.push_back(l.prefix[g]);
    for (int64_t r : l.responses[g]) {
      f.parents.push_back(prompt);
      f.lengths.push_back(r);
    }
  }
  return f;
}

// Ordinary causal attention over the unshared rows: each segment's queries in the row of its
// root-to-segment path (its ancestors' tokens, then its own). Key gradients are summed over the
// rows. (The depth-two layout: the prompt's own causal row, then [prompt | response i].)
inline RefResult reference(const Forest& f, const RefConfig& c, const std::vector<double>& q,
                           const std::vector<double>& k, const std::vector<double>& v,
                           const std::vector<double>& dout, const std::vector<double>* dlse,
                           double (*rnd)(double) = nullptr) {
  RefResult r;
  r.out.assign(size_t(c.T) * c.Hq * c.D, NAN);
  r.dq.assign(r.out.size(), NAN);
  r.lse.assign(size_t(c.Hq) * c.T, NAN);
  r.dk.assign(size_t(c.T) * c.Hkv * c.D, 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  // Packed tokens and logical positions of each segment's path, root first.
  std::vector<std::vector<int>> path_tokens(f.parents.size()), path_pos(f.parents.size());
  int start = 0;
  for (size_t i = 0; i < f.parents.size(); ++i) {
    std::vector<int> qi, qpos;
    std::vector<int> ki, kpos;
    if (f.parents[i] >= 0) {
      ki = path_tokens[size_t(f.parents[i])];
      kpos = path_pos[size_t(f.parents[i])];
    }
    const int pos0 = int(kpos.size());
    for (int j = 0; j < int(f.lengths[i]); ++j) {
      qi.push_back(start + j);
      qpos.push_back(pos0 + j);
      ki.push_back(start + j);
      kpos.push_back(pos0 + j);
    }
    if (!qi.empty()) ref_row(c, qi, qpos, ki, kpos, q, k, v, dout, dlse, rnd, r);
    path_tokens[i] = std::move(ki);
    path_pos[i] = std::move(kpos);
    start += int(f.lengths[i]);
  }
  return r;
}

}  // namespace dualkv::test
