// The CPU backend against the naive fp64 oracle of the unshared layout (test_util.h), plus
// finite differences, determinism across thread counts, and argument validation.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dualkv/cpu.h"
#include "dualkv/error.h"
#include "test_util.h"

namespace dualkv::test {
namespace {

// ---- tensors ---------------------------------------------------------------------------------

// How a [T, H, D] input is laid out in memory (D always contiguous).
enum class Strides { kContiguous, kPadded, kHeadMajor };

// A storage-typed input and the exact values it holds, contiguous [T][H][D] in double.
template <class S>
struct Input {
  std::vector<S> data;
  TokenHeadStrides stride{};
  std::vector<double> values;
};

template <class S>
Input<S> random_input(std::mt19937_64& rng, int T, int H, int D, Strides kind, double sigma) {
  Input<S> x;
  switch (kind) {
    case Strides::kContiguous:
      x.stride = {int64_t(H) * D, D};
      break;
    case Strides::kPadded:
      x.stride = {int64_t(H) * (D + 5) + 7, D + 5};
      break;
    case Strides::kHeadMajor:
      x.stride = {D, int64_t(T) * D + 3};
      break;
  }
  const int64_t size = T == 0 ? 1 : (T - 1) * x.stride.token + (H - 1) * x.stride.head + D;
  // Gaps between rows hold NaN: reading one would poison the result.
  x.data.assign(size_t(size), nan_value<S>());
  x.values.resize(size_t(T) * H * D);
  std::normal_distribution<double> nd(0.0, sigma);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < D; ++d) {
        const S s = from_double<S>(nd(rng));
        x.data[size_t(t * x.stride.token + h * x.stride.head + d)] = s;
        x.values[(size_t(t) * H + h) * D + d] = to_double(s);
      }
    }
  }
  return x;
}

template <class S>
std::vector<double> as_double(const std::vector<S>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = to_double(x[i]);
  return y;
}

struct Err {
  double max_err = 0;  // max |got - ref|
  double max_ref = 0;  // max |ref|
  bool nan = false;
};

inline Err compare(const std::vector<double>& got, const std::vector<double>& ref) {
  Err e;
  EXPECT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (std::isnan(got[i]) || std::isnan(ref[i])) {
      e.nan = true;
      continue;
    }
    e.max_err = std::max(e.max_err, std::abs(got[i] - ref[i]));
    e.max_ref = std::max(e.max_ref, std::abs(ref[i]));
  }
  return e;
}

// ---- one forward + backward call ------------------------------------------------------------

struct Config {
  int Hq = 4, Hkv = 4, D = 64;
  bool window = false, softcap = false, dlse = false;
  Strides strides = Strides::kContiguous;
};

// lse and dlse are float64 (lse64, dlse64) for float64 inputs, float32 otherwise.
template <class S>
using LseOf = std::conditional_t<std::is_same_v<S, double>, double, float>;

template <class S>
struct Call {
  Input<S> q, k, v, dout;
  std::vector<LseOf<S>> dlse;  // empty when off
  std::vector<S> out, dq, dk, dv;
  std::vector<LseOf<S>> lse;
  RefConfig ref;
};

template <class S>
ForwardArgs forward_args(const LayoutTables& lt, Call<S>& r) {
  ForwardArgs a;
  a.dtype = StorageOf<S>::kType;
  a.shape = {r.ref.T, r.ref.Hq, r.ref.Hkv, r.ref.D};
  a.score.softmax_scale = r.ref.scale;
  a.score.softcap = r.ref.softcap;
  a.score.mask.window = int32_t(r.ref.window);
  a.layout = lt.view();
  a.q = r.q.data.data();
  a.k = r.k.data.data();
  a.v = r.v.data.data();
  a.q_stride = r.q.stride;
  a.k_stride = r.k.stride;
  a.v_stride = r.v.stride;
  a.out = r.out.data();
  if constexpr (std::is_same_v<S, double>) {
    a.lse64 = r.lse.data();
  } else {
    a.lse = r.lse.data();
  }
  return a;
}

template <class S>
BackwardArgs backward_args(const LayoutTables& lt, Call<S>& r) {
  const ForwardArgs f = forward_args(lt, r);
  BackwardArgs a;
  a.dtype = f.dtype;
  a.shape = f.shape;
  a.score = f.score;
  a.layout = f.layout;
  a.q = f.q;
  a.k = f.k;
  a.v = f.v;
  a.q_stride = f.q_stride;
  a.k_stride = f.k_stride;
  a.v_stride = f.v_stride;
  a.out = r.out.data();
  a.dout = r.dout.data.data();
  if constexpr (std::is_same_v<S, double>) {
    a.lse64 = r.lse.data();
    a.dlse64 = r.dlse.empty() ? nullptr : r.dlse.data();
  } else {
    a.lse = r.lse.data();
    a.dlse = r.dlse.empty() ? nullptr : r.dlse.data();
  }
  a.dq = r.dq.data();
  a.dk = r.dk.data();
  a.dv = r.dv.data();
  return a;
}

// Draws inputs, poisons the outputs with NaN and runs forward then backward.
template <class S>
Call<S> run_attention(std::mt19937_64& rng, const LayoutTables& lt, const Config& c,
                      int64_t window) {
  Call<S> r;
  const int T = lt.layout.total_tokens();
  r.ref = {T, c.Hq, c.Hkv, c.D, 1.0 / std::sqrt(double(c.D)), c.softcap ? 3.0 : 0.0, window};
  // Larger q with softcap so that tanh saturates for some scores.
  r.q = random_input<S>(rng, T, c.Hq, c.D, c.strides, c.softcap ? 2.0 : 1.0);
  r.k = random_input<S>(rng, T, c.Hkv, c.D, c.strides, 1.0);
  r.v = random_input<S>(rng, T, c.Hkv, c.D, c.strides, 1.0);
  r.dout = random_input<S>(rng, T, c.Hq, c.D, Strides::kContiguous, 1.0);
  if (c.dlse) {
    std::normal_distribution<LseOf<S>> nd;
    r.dlse.resize(size_t(c.Hq) * T);
    for (auto& x : r.dlse) x = nd(rng);
  }
  r.out.assign(size_t(T) * c.Hq * c.D, nan_value<S>());
  r.lse.assign(size_t(c.Hq) * T, NAN);
  r.dq.assign(r.out.size(), nan_value<S>());
  r.dk.assign(size_t(T) * c.Hkv * c.D, nan_value<S>());
  r.dv.assign(r.dk.size(), nan_value<S>());
  cpu::attention_forward(forward_args(lt, r));
  cpu::attention_backward(backward_args(lt, r));
  return r;
}

template <class S>
RefResult reference_of(const Forest& forest, const Call<S>& r, double (*rnd)(double)) {
  std::vector<double> dlse(r.dlse.begin(), r.dlse.end());
  return reference(forest, r.ref, r.q.values, r.k.values, r.v.values, r.dout.values,
                   r.dlse.empty() ? nullptr : &dlse, rnd);
}

int64_t draw_window(std::mt19937_64& rng, bool on) {
  if (!on) return kNoWindow;
  return uniform(rng, 0, 9) == 0 ? 1 : uniform(rng, 2, 200);
}

// Compares every output with the oracle. fp32/fp64: a tolerance relative to the tensor's scale.
// fp16/bf16 (DESIGN.md): at most 2x (outputs) / 3x (gradients) the error of a plain
// low-precision implementation against the same oracle, plus a tiny absolute slack.
template <class S>
void check_against_reference(const Forest& forest, const Call<S>& r) {
  const RefResult ref = reference_of(forest, r, nullptr);
  struct Item {
    const char* name;
    std::vector<double> got;
    const std::vector<double>* ref;
    bool grad;
  };
  std::vector<double> lse(r.lse.begin(), r.lse.end());
  std::vector<Item> items = {{"out", as_double(r.out), &ref.out, false},
                             {"lse", lse, &ref.lse, false},
                             {"dq", as_double(r.dq), &ref.dq, true},
                             {"dk", as_double(r.dk), &ref.dk, true},
                             {"dv", as_double(r.dv), &ref.dv, true}};
  RefResult lp;
  constexpr bool kLow = sizeof(S) == 2;
  if constexpr (kLow) lp = reference_of(forest, r, &round_to<S>);
  const std::vector<double>* lp_of[] = {&lp.out, &lp.lse, &lp.dq, &lp.dk, &lp.dv};
  // The gradients' scale: a gradient that cancels to exactly 0 (dq, dk with a window of 1, where
  // dP = delta) still carries float32 rounding of the terms that cancel, which are of this size.
  double grad_scale = 0.0;
  for (const Item& it : items)
    if (it.grad) grad_scale = std::max(grad_scale, compare(it.got, *it.ref).max_ref);
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const Err e = compare(it.got, *it.ref);
    EXPECT_FALSE(e.nan) << it.name << " has NaN (unwritten or wrong)";
    double tol;
    if constexpr (kLow) {
      const Err e_lp = compare(*lp_of[i], *it.ref);
      const double scale = it.grad ? std::max(e.max_ref, grad_scale) : e.max_ref;
      tol = (it.grad ? 3.0 : 2.0) * e_lp.max_err + 1e-5 * std::max(1.0, scale);
    } else {
      const double rel = std::is_same_v<S, double> ? 1e-10 : it.grad ? 2e-5 : 1e-5;
      tol = rel * std::max(1.0, e.max_ref);
    }
    if (std::getenv("DUALKV_TEST_VERBOSE")) {
      std::printf("  %-4s max err %.3g  tolerance %.3g  (ratio %.3f)\n", it.name, e.max_err, tol,
                  e.max_err / tol);
    }
    EXPECT_LE(e.max_err, tol) << it.name << ": max |err| " << e.max_err << " vs tolerance " << tol
                              << " (max |ref| " << e.max_ref << ")";
  }
}

// ---- parametrised comparison with the oracle ----------------------------------------------

struct Case {
  DType dtype;
  Config config;
  std::string name;
};

// Keeps ctest's test names readable (gtest would print the raw bytes).
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string case_name(DType t, const Config& c) {
  std::string s = std::string(dtype_name(t)) + "_Hq" + std::to_string(c.Hq) + "_Hkv" +
                  std::to_string(c.Hkv) + "_D" + std::to_string(c.D);
  if (c.window) s += "_window";
  if (c.softcap) s += "_softcap";
  if (c.dlse) s += "_dlse";
  if (c.strides == Strides::kPadded) s += "_padded";
  if (c.strides == Strides::kHeadMajor) s += "_headmajor";
  return s;
}

std::vector<Case> all_cases() {
  // {Hq, Hkv, D, window, softcap, dlse, strides}: GQA 1:1, 4:1, MQA (8:1), window and softcap
  // on/off, dlse on/off, strided inputs, head dims 64 and 128.
  const std::vector<Config> base = {
      {4, 4, 64, false, false, true, Strides::kContiguous},
      {8, 2, 128, true, true, false, Strides::kPadded},
      {4, 1, 64, true, false, true, Strides::kHeadMajor},
      {2, 2, 128, false, true, true, Strides::kContiguous},
  };
  std::vector<Case> cases;
  for (DType t : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const Config& c : base) cases.push_back({t, c, case_name(t, c)});
  }
  for (const Config& c : {Config{8, 1, 128, true, true, true, Strides::kPadded},
                          Config{8, 2, 64, false, false, false, Strides::kHeadMajor}}) {
    cases.push_back({DType::kFloat32, c, case_name(DType::kFloat32, c)});
  }
  return cases;
}

class AttentionVsReference : public ::testing::TestWithParam<Case> {};

template <class S>
void run_case(const Config& c) {
  DUALKV_SEEDED_RNG(rng);
  const Lens lens = random_lens(rng, 3, 200, 3, 150, /*long_first=*/true);
  const int64_t window = draw_window(rng, c.window);
  SCOPED_TRACE("layout " + describe(lens) + " window " +
               (c.window ? std::to_string(window) : std::string("off")));
  const LayoutTables lt(lens);
  const Call<S> r = run_attention<S>(rng, lt, c, window);
  check_against_reference(forest_of(lens), r);
}

TEST_P(AttentionVsReference, OutputsAndGradients) {
  const Case& p = GetParam();
  switch (p.dtype) {
    case DType::kFloat64:
      return run_case<double>(p.config);
    case DType::kFloat32:
      return run_case<float>(p.config);
    case DType::kBFloat16:
      return run_case<cpu::BFloat16>(p.config);
    case DType::kFloat16:
      return run_case<cpu::Half>(p.config);
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionVsReference, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return info.param.name; });

// Prefix trees: random forests (depth up to 5, often empty or one-token segments, a root longer
// than one tile, parents in any earlier position) against the oracle of their root-to-leaf rows.
class TreeAttentionVsReference : public ::testing::TestWithParam<Case> {};

template <class S>
void run_tree_case(const Config& c) {
  DUALKV_SEEDED_RNG(rng);
  for (int iter = 0; iter < 2; ++iter) {
    const Forest forest = random_forest(rng, 10, 5, 100, /*long_first=*/iter == 0);
    const int64_t window = draw_window(rng, c.window);
    SCOPED_TRACE("forest " + describe(forest) + " window " +
                 (c.window ? std::to_string(window) : std::string("off")));
    const LayoutTables lt(forest);
    const Call<S> r = run_attention<S>(rng, lt, c, window);
    check_against_reference(forest, r);
  }
}

TEST_P(TreeAttentionVsReference, OutputsAndGradients) {
  const Case& p = GetParam();
  switch (p.dtype) {
    case DType::kFloat64:
      return run_tree_case<double>(p.config);
    case DType::kFloat32:
      return run_tree_case<float>(p.config);
    case DType::kBFloat16:
      return run_tree_case<cpu::BFloat16>(p.config);
    case DType::kFloat16:
      return run_tree_case<cpu::Half>(p.config);
  }
}

std::vector<Case> tree_cases() {
  std::vector<Case> cases;
  const std::pair<DType, Config> list[] = {
      {DType::kFloat64, {4, 4, 64, false, false, true, Strides::kContiguous}},
      {DType::kFloat64, {4, 1, 64, true, true, true, Strides::kHeadMajor}},
      {DType::kFloat32, {8, 2, 128, true, true, false, Strides::kPadded}},
      {DType::kBFloat16, {4, 1, 64, true, false, true, Strides::kContiguous}},
      {DType::kFloat16, {2, 2, 128, false, true, true, Strides::kContiguous}},
  };
  for (const auto& [t, c] : list) cases.push_back({t, c, case_name(t, c)});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cpu, TreeAttentionVsReference, ::testing::ValuesIn(tree_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- special layouts and inputs -------------------------------------------------------------

// Groups with N = 0, P = 0, empty responses and single tokens only, in fp64.
TEST(AttentionCpu, EdgeLayouts) {
  DUALKV_SEEDED_RNG(rng);
  const std::vector<Lens> layouts = {
      {{5}, {{}}},                        // prompt only
      {{0}, {{3, 1}}},                    // no prompt
      {{1}, {{1}}},                       // one token each
      {{0, 4, 0}, {{}, {0, 2, 0}, {1}}},  // empty groups and responses
      {{130}, {{0, 0}}},                  // prompt longer than a tile, empty responses
  };
  for (const Lens& lens : layouts) {
    SCOPED_TRACE("layout " + describe(lens));
    const LayoutTables lt(lens);
    for (bool window : {false, true}) {
      const Config c{4, 2, 64, window, !window, true, Strides::kContiguous};
      const Call<double> r = run_attention<double>(rng, lt, c, window ? 2 : kNoWindow);
      check_against_reference(forest_of(lens), r);
    }
  }
}

// With window 1 every query sees only itself: out = v, lse = scale q.k.
TEST(AttentionCpu, WindowOneIsIdentityOnV) {
  DUALKV_SEEDED_RNG(rng);
  const Lens lens{{3, 0}, {{2, 0, 4}, {1}}};
  const LayoutTables lt(lens);
  const Call<double> r = run_attention<double>(rng, lt, {2, 1, 64}, 1);
  const int T = lt.layout.total_tokens();
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < 64; ++d) {
        ASSERT_EQ(r.out[(size_t(t) * 2 + h) * 64 + d], r.v.values[size_t(t) * 64 + d]);
      }
    }
  }
}

// Scores far apart (|s| in the hundreds): the softmax must stay exact where exp underflows.
TEST(AttentionCpu, LargeScores) {
  DUALKV_SEEDED_RNG(rng);
  const Lens lens = random_lens(rng, 2, 150, 2, 150, true);
  SCOPED_TRACE("layout " + describe(lens));
  const LayoutTables lt(lens);
  Config c{2, 1, 64, false, false, true, Strides::kContiguous};
  Call<float> r = run_attention<float>(rng, lt, c, kNoWindow);
  r.ref.scale = 40.0 / std::sqrt(64.0);  // rerun with a huge scale
  for (auto& x : r.out) x = NAN;
  for (auto& x : r.lse) x = NAN;
  cpu::attention_forward(forward_args(lt, r));
  cpu::attention_backward(backward_args(lt, r));
  const RefResult ref = reference_of(forest_of(lens), r, nullptr);
  const Err e = compare(as_double(r.out), ref.out);
  EXPECT_FALSE(e.nan);
  EXPECT_LE(e.max_err, 1e-4 * std::max(1.0, e.max_ref));
  std::vector<double> lse(r.lse.begin(), r.lse.end());
  const Err el = compare(lse, ref.lse);
  EXPECT_FALSE(el.nan);
  EXPECT_LE(el.max_err, 1e-5 * std::max(1.0, el.max_ref));
  for (auto* g : {&r.dq, &r.dk, &r.dv}) {
    for (float x : *g) ASSERT_FALSE(std::isnan(x));
  }
}

// Head dims that are not a multiple of the vector width (zero padding) or above one register
// chunk (64 floats / 32 doubles).
TEST(AttentionCpu, OtherHeadDims) {
  for (int D : {8, 40, 200}) {
    SCOPED_TRACE("D " + std::to_string(D));
    run_case<double>({2, 1, D, true, true, true, Strides::kPadded});
    run_case<float>({2, 2, D, false, false, true, Strides::kContiguous});
  }
}

// A NaN in the input must show up as NaN in the outputs that depend on it, never be masked.
TEST(AttentionCpu, NanInputPropagates) {
  DUALKV_SEEDED_RNG(rng);
  const Lens lens{{140}, {{3, 130}}};
  const LayoutTables lt(lens);
  Call<float> r = run_attention<float>(rng, lt, {2, 1, 64}, kNoWindow);
  const int T = lt.layout.total_tokens();
  const int t = int(uniform(rng, 0, T - 1));  // NaN in q of token t, head 1
  r.q.data[size_t(t * r.q.stride.token + 1 * r.q.stride.head + 5)] = NAN;
  std::fill(r.out.begin(), r.out.end(), 0.0f);
  std::fill(r.lse.begin(), r.lse.end(), 0.0f);
  cpu::attention_forward(forward_args(lt, r));
  for (int x = 0; x < T; ++x) {
    for (int h = 0; h < 2; ++h) {
      const bool want_nan = x == t && h == 1;
      EXPECT_EQ(std::isnan(r.lse[size_t(h) * T + x]), want_nan) << "token " << x << " head " << h;
      EXPECT_EQ(std::isnan(r.out[(size_t(x) * 2 + h) * 64]), want_nan);
    }
  }
  cpu::attention_backward(backward_args(lt, r));
  EXPECT_TRUE(std::isnan(r.dq[(size_t(t) * 2 + 1) * 64]));
  EXPECT_TRUE(std::any_of(r.dk.begin(), r.dk.end(), [](float x) { return std::isnan(x); }));
}

// The generic (non-AVX2) kernels, selected by DUALKV_CPU_NO_AVX2, agree with the oracle too.
TEST(AttentionCpu, GenericKernels) {
  ::setenv("DUALKV_CPU_NO_AVX2", "1", 1);
  run_case<double>({4, 2, 64, true, true, true, Strides::kPadded});
  run_case<float>({4, 1, 128, false, false, true, Strides::kContiguous});
  run_case<cpu::BFloat16>({2, 2, 64, true, false, false, Strides::kContiguous});
  ::unsetenv("DUALKV_CPU_NO_AVX2");
}

// ---- finite differences ---------------------------------------------------------------------

// Gradients of L = sum(out * W) + sum(lse * U) in fp64 against central differences.
TEST(AttentionCpu, FiniteDifferences) {
  DUALKV_SEEDED_RNG(rng);
  const Lens lens{{3, 2}, {{2, 3}, {0, 1}}};
  const LayoutTables lt(lens);
  for (int variant = 0; variant < 3; ++variant) {
    const bool with_lse = variant == 2;
    const Config c{2, 1, 4, variant == 1, variant != 0, with_lse, Strides::kContiguous};
    const int64_t window = variant == 1 ? 2 : kNoWindow;
    SCOPED_TRACE("variant " + std::to_string(variant));
    Call<double> r = run_attention<double>(rng, lt, c, window);
    auto loss = [&]() {
      std::vector<double> out(r.out.size()), lse(r.lse.size());
      ForwardArgs f = forward_args(lt, r);
      f.out = out.data();
      f.lse64 = lse.data();
      cpu::attention_forward(f);
      double L = 0;
      for (size_t i = 0; i < out.size(); ++i) L += out[i] * r.dout.values[i];
      for (size_t i = 0; i < r.dlse.size(); ++i) L += lse[i] * r.dlse[i];
      return L;
    };
    const double eps = 1e-6, tol = 1e-7;
    struct Target {
      const char* name;
      Input<double>* x;
      const std::vector<double>* grad;
    };
    for (const Target& tg :
         {Target{"q", &r.q, &r.dq}, Target{"k", &r.k, &r.dk}, Target{"v", &r.v, &r.dv}}) {
      for (size_t i = 0; i < tg.x->data.size(); ++i) {
        const double x0 = tg.x->data[i];
        tg.x->data[i] = x0 + eps;
        const double lp = loss();
        tg.x->data[i] = x0 - eps;
        const double lm = loss();
        tg.x->data[i] = x0;
        const double fd = (lp - lm) / (2 * eps);
        EXPECT_NEAR((*tg.grad)[i], fd, tol * std::max(1.0, std::abs(fd)))
            << "d" << tg.name << "[" << i << "]";
      }
    }
  }
}

// ---- determinism ----------------------------------------------------------------------------

template <class S>
void expect_bitwise_equal(const std::vector<S>& a, const std::vector<S>& b, const char* name) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(S)), 0) << name << " differs";
}

// Forward and backward give bitwise identical results with 1, 2 and 3 threads and on repeats.
template <class S>
void check_deterministic(const Config& c) {
  DUALKV_SEEDED_RNG(rng);
  const Lens lens = random_lens(rng, 3, 300, 4, 200, true);
  SCOPED_TRACE("layout " + describe(lens));
  const LayoutTables lt(lens);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  Call<S> base = run_attention<S>(rng, lt, c, kNoWindow);
  for (int threads : {2, 3, 2, 2}) {
    omp_set_num_threads(threads);
    Call<S> r = base;
    for (auto* x : {&r.out, &r.dq, &r.dk, &r.dv}) std::fill(x->begin(), x->end(), nan_value<S>());
    std::fill(r.lse.begin(), r.lse.end(), NAN);
    cpu::attention_forward(forward_args(lt, r));
    cpu::attention_backward(backward_args(lt, r));
    expect_bitwise_equal(r.out, base.out, "out");
    expect_bitwise_equal(r.lse, base.lse, "lse");
    expect_bitwise_equal(r.dq, base.dq, "dq");
    expect_bitwise_equal(r.dk, base.dk, "dk");
    expect_bitwise_equal(r.dv, base.dv, "dv");
  }
  omp_set_num_threads(saved);
}

TEST(AttentionCpu, DeterministicAcrossThreadCountsFp32) {
  check_deterministic<float>({8, 2, 64, false, false, true, Strides::kContiguous});
}
TEST(AttentionCpu, DeterministicAcrossThreadCountsBf16) {
  check_deterministic<cpu::BFloat16>({4, 1, 128, false, true, false, Strides::kPadded});
}

// ---- argument validation --------------------------------------------------------------------

class BadArgs : public ::testing::Test {
 protected:
  BadArgs() : lt(Lens{{3}, {{2, 2}}}) {
    std::mt19937_64 rng(1);
    r = run_attention<float>(rng, lt, {4, 2, 64}, kNoWindow);
  }
  // Expects `mutate(args)` to make both entry points throw an Error mentioning `what`.
  void expect_error(const std::function<void(ForwardArgs&)>& fmut,
                    const std::function<void(BackwardArgs&)>& bmut, const std::string& what) {
    ForwardArgs f = forward_args(lt, r);
    fmut(f);
    try {
      cpu::attention_forward(f);
      ADD_FAILURE() << "forward accepted bad args (" << what << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    BackwardArgs b = backward_args(lt, r);
    bmut(b);
    try {
      cpu::attention_backward(b);
      ADD_FAILURE() << "backward accepted bad args (" << what << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  template <class F>
  void expect_error_both(F mut, const std::string& what) {
    expect_error([&](ForwardArgs& a) { mut(a); }, [&](BackwardArgs& a) { mut(a); }, what);
  }
  LayoutTables lt;
  Call<float> r;
};

TEST_F(BadArgs, Shape) {
  expect_error_both([](auto& a) { a.shape.num_kv_heads = 3; }, "multiple of shape.num_kv_heads");
  expect_error_both([](auto& a) { a.shape.num_kv_heads = 0; }, "num_kv_heads");
  expect_error_both([](auto& a) { a.shape.num_q_heads = 0; }, "num_q_heads");
  expect_error_both([](auto& a) { a.shape.head_dim = 0; }, "head_dim");
  expect_error_both([](auto& a) { a.shape.tokens = 6; }, "layout.total_tokens");
  expect_error_both([](auto& a) { a.shape.tokens = -1; }, "shape.tokens");
  expect_error_both([](auto& a) { a.dtype = DType(17); }, "dtype");
}

TEST_F(BadArgs, ScoreParams) {
  expect_error_both([](auto& a) { a.score.mask.window = 0; }, "window");
  expect_error_both([](auto& a) { a.score.softcap = -1.f; }, "softcap");
  expect_error_both([](auto& a) { a.score.softcap = INFINITY; }, "softcap");
  expect_error_both([](auto& a) { a.score.softcap = NAN; }, "softcap");
  expect_error_both([](auto& a) { a.score.softmax_scale = NAN; }, "softmax_scale");
  expect_error_both([](auto& a) { a.score.softmax_scale = INFINITY; }, "softmax_scale");
}

TEST_F(BadArgs, NullPointers) {
  expect_error_both([](auto& a) { a.q = nullptr; }, "q, k and v");
  expect_error_both([](auto& a) { a.v = nullptr; }, "q, k and v");
  expect_error_both([](auto& a) { a.lse = nullptr; }, "lse");
  expect_error_both([](auto& a) { a.layout.segments = nullptr; }, "layout.segments");
  expect_error([](ForwardArgs& a) { a.out = nullptr; }, [](BackwardArgs& a) { a.dout = nullptr; },
               "out");
  expect_error([](ForwardArgs& a) { a.out = nullptr; }, [](BackwardArgs& a) { a.dk = nullptr; },
               "d");
}

TEST_F(BadArgs, LayoutTables) {
  std::vector<Tile> tiles = lt.query_tiles;
  tiles.push_back(tiles.back());  // one token range twice
  expect_error_both(
      [&](auto& a) {
        a.layout.query_tiles = tiles.data();
        a.layout.num_query_tiles = int32_t(tiles.size());
      },
      "twice");
  expect_error_both([](auto& a) { a.layout.num_key_tiles -= 1; }, "key_tiles covers");
  std::vector<Segment> segs = lt.segments;
  segs[1].len += 5;  // past the end of the tokens
  expect_error_both([&](auto& a) { a.layout.segments = segs.data(); }, "segments[1]");
  segs = lt.segments;
  segs[2].root_len = 2;  // a response whose region A is not its tree's root
  expect_error_both([&](auto& a) { a.layout.segments = segs.data(); }, "segments[2]");
}

TEST(AttentionCpu, Float64NeedsLse64) {
  const LayoutTables lt(Lens{{3}, {{2}}});
  std::mt19937_64 rng(2);
  Call<double> r = run_attention<double>(rng, lt, {2, 1, 8}, kNoWindow);
  std::vector<float> lse32(r.lse.size());
  ForwardArgs f = forward_args(lt, r);
  f.lse64 = nullptr;
  f.lse = lse32.data();
  EXPECT_THROW(cpu::attention_forward(f), Error);
  BackwardArgs b = backward_args(lt, r);
  b.lse64 = nullptr;
  b.lse = lse32.data();
  EXPECT_THROW(cpu::attention_backward(b), Error);
  // An fp32 lse passed alongside lse64 is filled too.
  f = forward_args(lt, r);
  f.lse = lse32.data();
  cpu::attention_forward(f);
  for (size_t i = 0; i < lse32.size(); ++i) EXPECT_EQ(lse32[i], float(r.lse[i]));
}

TEST(AttentionCpu, EmptyLayoutIsNoOp) {
  const LayoutTables lt(Lens{{0, 0}, {{}, {0}}});
  ForwardArgs f;
  f.dtype = DType::kFloat32;
  f.shape = {0, 4, 2, 64};
  f.layout = lt.view();
  EXPECT_NO_THROW(cpu::attention_forward(f));
  BackwardArgs b;
  b.dtype = DType::kFloat32;
  b.shape = f.shape;
  b.layout = f.layout;
  EXPECT_NO_THROW(cpu::attention_backward(b));
  f.shape.num_kv_heads = 3;  // still validated
  EXPECT_THROW(cpu::attention_forward(f), Error);
}

}  // namespace
}  // namespace dualkv::test
