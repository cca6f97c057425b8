// Log-probs of labels under the softmax of a row of vocabulary logits, their entropy, and the
// gradient of both w.r.t. the logits: the one definition of that math, shared by the CPU backend
// and the CUDA kernels (dualkv.response_logprobs runs them on each chunk of tokens, so no float32
// [tokens x vocab] tensor is ever materialised). Per row, with z the logits:
//
//   x_v   = f(z_v) = c_v / temperature,  c_v = softcap > 0 ? softcap * tanh(z_v / softcap) : z_v
//   lse   = log sum_v exp(x_v)                          logp = x_label - lse
//   p_v   = exp(x_v - lse)                              H    = lse - sum_v p_v x_v
//   dL/dz_v = f'(z_v) * (g_logp * ([v == label] - p_v) - g_H * p_v * (x_v - (lse - H)))
//   f'(z) = (softcap > 0 ? 1 - (c / softcap)^2 : 1) / temperature
//
// Accumulation is in float (double for float64 logits). A label outside [0, vocab) gives a NaN
// log-prob (the CPU entry points reject it instead).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "dualkv/error.h"
#include "dualkv/hd.h"
#include "dualkv/params.h"

namespace dualkv {

// One chunk of rows. `logits` is [rows, vocab] with unit column stride and row stride
// `row_stride` (>= vocab) elements, of `dtype`; per-row vectors are contiguous, of the
// accumulation type (float; double for kFloat64).
struct LogitStatsArgs {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, vocab = 0, row_stride = 0;
  const void* logits = nullptr;
  const int64_t* labels = nullptr;  // [rows]
  double temperature = 1.0;         // > 0
  double softcap = 0.0;             // >= 0; 0: none
  void* logp = nullptr;             // [rows] out
  void* lse = nullptr;              // [rows] out
  void* entropy = nullptr;          // [rows] out, or null: not computed
};

// Overwrites the logits with dL/dz (rounded to their dtype) given the stats of the forward.
struct LogitGradArgs {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, vocab = 0, row_stride = 0;
  void* logits = nullptr;  // in: logits, out: gradient
  const int64_t* labels = nullptr;
  double temperature = 1.0;
  double softcap = 0.0;
  const void* lse = nullptr;        // [rows]
  const void* g_logp = nullptr;     // [rows] dL/dlogp
  const void* g_entropy = nullptr;  // [rows] dL/dH, or null (then entropy is not read)
  const void* entropy = nullptr;    // [rows] H, needed with g_entropy
};

namespace logits {

DUALKV_HD float exp_(float x) { return expf(x); }
DUALKV_HD double exp_(double x) { return exp(x); }
DUALKV_HD float log_(float x) { return logf(x); }
DUALKV_HD double log_(double x) { return log(x); }
DUALKV_HD float tanh_(float x) { return tanhf(x); }
DUALKV_HD double tanh_(double x) { return tanh(x); }

// f and f' of the header comment.
template <class A>
struct LogitMap {
  A temperature, softcap;

  DUALKV_HD A value(A z) const {
    const A c = softcap > A(0) ? softcap * tanh_(z / softcap) : z;
    return temperature == A(1) ? c : c / temperature;  // c / 1 == c: skip the division
  }
  // f(z) and f'(z) together (one tanh).
  DUALKV_HD A value_and_slope(A z, A& slope) const {
    if (softcap > A(0)) {
      const A c = softcap * tanh_(z / softcap);
      const A r = c / softcap;
      slope = (A(1) - r * r) / temperature;
      return c / temperature;
    }
    slope = A(1) / temperature;
    return temperature == A(1) ? z : z / temperature;
  }
};

// Online softmax statistics of a sequence of values x: max m, s = sum exp(x - m) and
// t = sum exp(x - m) * x. Partial statistics merge exactly, in any fixed order.
template <class A>
struct SoftmaxStats {
  A m = -std::numeric_limits<A>::infinity();
  A s = A(0);
  A t = A(0);

  DUALKV_HD void add(A x) {
    if (x == -std::numeric_limits<A>::infinity()) return;  // p = 0, and 0 * -inf is not 0
    if (x > m) {
      const A r = exp_(m - x);
      s = s * r + A(1);
      t = t * r + x;
      m = x;
    } else {  // also NaN: it propagates through s and t
      const A e = exp_(x - m);
      s += e;
      t += e * x;
    }
  }
  DUALKV_HD void merge(const SoftmaxStats& o) {
    if (o.m == -std::numeric_limits<A>::infinity() && o.s == A(0)) return;  // empty
    if (m == -std::numeric_limits<A>::infinity() && s == A(0)) {
      *this = o;
      return;
    }
    if (o.m > m) {
      const A r = exp_(m - o.m);
      s = s * r + o.s;
      t = t * r + o.t;
      m = o.m;
    } else {
      const A r = exp_(o.m - m);
      s += o.s * r;
      t += o.t * r;
    }
  }
  DUALKV_HD A lse() const { return m + log_(s); }
  // lse - H = E_p[x].
  DUALKV_HD A mean() const { return t / s; }
};

// dL/dz of one logit. `mean` = lse - H; g_ent = 0 when the entropy has no gradient.
template <class A>
DUALKV_HD A logit_grad(const LogitMap<A>& f, A z, bool is_label, A lse, A g_logp, A g_ent, A mean) {
  A slope;
  const A x = f.value_and_slope(z, slope);
  const A p = exp_(x - lse);
  A g = p * (-g_logp);
  if (g_ent != A(0) && p != A(0)) g -= g_ent * p * (x - mean);
  if (is_label) g += g_logp;
  return g * slope;
}

// The checks both argument structs share (rows, vocab, row_stride, temperature, softcap).
template <class Args>
void check_rows(const Args& a, const char* fn) {
  DUALKV_CHECK(a.rows >= 0 && a.vocab >= 1, fn, ": need rows >= 0 and vocab >= 1, got ", a.rows,
               ", ", a.vocab);
  DUALKV_CHECK(a.row_stride >= a.vocab, fn, ": row_stride (", a.row_stride, ") must be >= vocab (",
               a.vocab, ")");
  DUALKV_CHECK(a.temperature > 0 && std::isfinite(a.temperature), fn,
               ": temperature must be finite and > 0, got ", a.temperature);
  DUALKV_CHECK(a.softcap >= 0 && std::isfinite(a.softcap), fn,
               ": softcap must be finite and >= 0, got ", a.softcap);
  if (a.dtype != DType::kFloat64) {
    // Accumulated in float: a value float rounds to 0 or inf would drop the softcap silently or
    // turn every log-prob into NaN.
    constexpr double lo = std::numeric_limits<float>::min(), hi = std::numeric_limits<float>::max();
    DUALKV_CHECK(a.temperature >= lo && a.temperature <= hi, fn, ": temperature=", a.temperature,
                 " is outside float32's range for 16/32-bit logits: [", lo, ", ", hi, "]");
    DUALKV_CHECK(
        a.softcap == 0 || (a.softcap >= lo && a.softcap <= hi), fn, ": softcap=", a.softcap,
        " is outside float32's range for 16/32-bit logits: use 0 (no softcap) or a value in [", lo,
        ", ", hi, "]");
  }
}

inline void check(const LogitStatsArgs& a, const char* fn) {
  check_rows(a, fn);
  DUALKV_CHECK(a.rows == 0 || (a.logits && a.labels && a.logp && a.lse), fn,
               ": logits, labels, logp and lse must not be null");
}

inline void check(const LogitGradArgs& a, const char* fn) {
  check_rows(a, fn);
  DUALKV_CHECK(a.rows == 0 || (a.logits && a.labels && a.lse && a.g_logp), fn,
               ": logits, labels, lse and g_logp must not be null");
  DUALKV_CHECK(!a.g_entropy || a.entropy, fn, ": g_entropy needs the forward's entropy");
}

}  // namespace logits
}  // namespace dualkv
