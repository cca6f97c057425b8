// The log-prob statistics (include/dualkv/logits.h) and the CPU backend's logit_stats /
// logit_grad: online statistics against a two-pass fp64 computation, the gradient against
// central finite differences, -inf / NaN logits and the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "dualkv/cpu.h"
#include "dualkv/error.h"
#include "dualkv/logits.h"
#include "test_util.h"

namespace dualkv {
namespace {

using logits::LogitMap;
using logits::SoftmaxStats;

// Two passes in long double: lse, logp of label, entropy of softmax(f(z)).
struct Exact {
  double lse, logp, entropy;
};
Exact exact(const std::vector<double>& z, int64_t label, double temperature, double softcap) {
  std::vector<long double> x(z.size());
  long double m = -INFINITY;
  for (size_t v = 0; v < z.size(); ++v) {
    long double c = softcap > 0 ? softcap * std::tanh((long double)z[v] / softcap) : z[v];
    x[v] = c / temperature;
    m = std::max(m, x[v]);
  }
  long double s = 0, t = 0;
  for (long double xv : x) s += std::exp(xv - m), t += std::exp(xv - m) * xv;
  const long double lse = m + std::log(s);
  return {double(lse), double(x[size_t(label)] - lse), double(lse - t / s)};
}

TEST(Logits, StatsMergeInAnyFixedSplitMatchesTwoPass) {
  DUALKV_SEEDED_RNG(rng);
  std::normal_distribution<double> normal(0.0, 4.0);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t n = test::uniform(rng, 1, 3000);
    std::vector<double> z(static_cast<size_t>(n));
    for (double& v : z) v = normal(rng);
    // Split into a random number of consecutive parts, each accumulated alone, then merged.
    const int64_t parts = test::uniform(rng, 1, 9);
    std::vector<SoftmaxStats<double>> acc(static_cast<size_t>(parts));
    for (int64_t v = 0; v < n; ++v) acc[size_t(v * parts / n)].add(z[size_t(v)]);
    SoftmaxStats<double> all;
    for (const auto& p : acc) all.merge(p);
    const Exact want = exact(z, 0, 1.0, 0.0);
    EXPECT_NEAR(all.lse(), want.lse, 1e-12 * std::abs(want.lse) + 1e-12);
    EXPECT_NEAR(all.lse() - all.mean(), want.entropy, 1e-10);
  }
}

TEST(Logits, StatsSkipMinusInfinityAndPropagateNaN) {
  SoftmaxStats<float> a;
  a.add(-INFINITY);
  a.add(1.f);
  a.add(-INFINITY);
  EXPECT_FLOAT_EQ(a.lse(), 1.f);
  EXPECT_FLOAT_EQ(a.lse() - a.mean(), 0.f);  // one finite logit: entropy 0, not NaN
  SoftmaxStats<float> empty, b;
  b.merge(empty);
  EXPECT_EQ(b.s, 0.f);
  b.merge(a);
  EXPECT_FLOAT_EQ(b.lse(), 1.f);
  a.add(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(a.lse()));
  SoftmaxStats<float> c;
  c.add(3.f);
  c.merge(a);
  EXPECT_TRUE(std::isnan(c.lse()));
}

struct Case {
  double temperature, softcap;
  bool entropy;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "temperature " << c.temperature << ", softcap " << c.softcap << ", entropy " << c.entropy;
}

class LogitsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(LogitsCpu, Fp64StatsExactAndGradientMatchesFiniteDifferences) {
  const Case cs = GetParam();
  DUALKV_SEEDED_RNG(rng);
  std::normal_distribution<double> normal(0.0, 2.0);
  const int64_t rows = 5, vocab = 37, stride = 41;
  std::vector<double> z(size_t(rows * stride), std::nan(""));  // padding must not be read
  std::vector<int64_t> labels(rows);
  std::vector<double> g(rows), ge(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) z[size_t(r * stride + v)] = normal(rng);
    labels[size_t(r)] = test::uniform(rng, 0, vocab - 1);
    g[size_t(r)] = normal(rng), ge[size_t(r)] = normal(rng);
  }
  auto stats = [&](const std::vector<double>& zz, std::vector<double>& logp,
                   std::vector<double>& lse, std::vector<double>& ent) {
    LogitStatsArgs a;
    a.dtype = DType::kFloat64, a.rows = rows, a.vocab = vocab, a.row_stride = stride;
    a.logits = zz.data(), a.labels = labels.data();
    a.temperature = cs.temperature, a.softcap = cs.softcap;
    logp.assign(rows, 0), lse.assign(rows, 0), ent.assign(rows, 0);
    a.logp = logp.data(), a.lse = lse.data(), a.entropy = ent.data();
    cpu::logit_stats(a);
  };
  std::vector<double> logp, lse, ent;
  stats(z, logp, lse, ent);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> row(z.begin() + r * stride, z.begin() + r * stride + vocab);
    const Exact want = exact(row, labels[size_t(r)], cs.temperature, cs.softcap);
    EXPECT_NEAR(lse[size_t(r)], want.lse, 1e-12);
    EXPECT_NEAR(logp[size_t(r)], want.logp, 1e-12);
    EXPECT_NEAR(ent[size_t(r)], want.entropy, 1e-12);
  }
  // L = sum_r g_r logp_r (+ ge_r H_r); dL/dz by central differences.
  std::vector<double> grad = z;
  LogitGradArgs b;
  b.dtype = DType::kFloat64, b.rows = rows, b.vocab = vocab, b.row_stride = stride;
  b.logits = grad.data(), b.labels = labels.data();
  b.temperature = cs.temperature, b.softcap = cs.softcap;
  b.lse = lse.data(), b.g_logp = g.data();
  if (cs.entropy) b.g_entropy = ge.data(), b.entropy = ent.data();
  cpu::logit_grad(b);
  auto loss = [&](const std::vector<double>& zz) {
    std::vector<double> lp, ls, en;
    stats(zz, lp, ls, en);
    double l = 0;
    for (int64_t r = 0; r < rows; ++r) {
      l += g[size_t(r)] * lp[size_t(r)] + (cs.entropy ? ge[size_t(r)] * en[size_t(r)] : 0.0);
    }
    return l;
  };
  const double h = 1e-6;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) {
      const size_t i = size_t(r * stride + v);
      std::vector<double> zp = z, zm = z;
      zp[i] += h, zm[i] -= h;
      EXPECT_NEAR(grad[i], (loss(zp) - loss(zm)) / (2 * h), 1e-7) << "row " << r << " v " << v;
    }
    EXPECT_TRUE(std::isnan(grad[size_t(r * stride + vocab)]));  // padding left alone
  }
}

INSTANTIATE_TEST_SUITE_P(Maps, LogitsCpu,
                         ::testing::Values(Case{1.0, 0.0, false}, Case{0.6, 0.0, true},
                                           Case{1.4, 3.0, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return std::string(c.softcap > 0 ? "softcap" : "plain") +
                                  (c.temperature != 1.0 ? "_temperature" : "") +
                                  (c.entropy ? "_entropy" : "");
                         });

TEST(Logits, CpuArgumentChecks) {
  std::vector<float> z(6, 0.f), out(2);
  std::vector<int64_t> labels = {0, 3};
  LogitStatsArgs a;
  a.dtype = DType::kFloat32, a.rows = 2, a.vocab = 3, a.row_stride = 3;
  a.logits = z.data(), a.labels = labels.data(), a.logp = out.data(), a.lse = out.data();
  EXPECT_THROW(cpu::logit_stats(a), Error);  // label 3 outside [0, 3)
  labels[1] = 2;
  a.temperature = 0.0;
  EXPECT_THROW(cpu::logit_stats(a), Error);
  a.temperature = 1.0, a.row_stride = 2;
  EXPECT_THROW(cpu::logit_stats(a), Error);
  a.row_stride = 3;
  EXPECT_NO_THROW(cpu::logit_stats(a));
  LogitGradArgs b;
  b.dtype = DType::kFloat32, b.rows = 2, b.vocab = 3, b.row_stride = 3;
  b.logits = z.data(), b.labels = labels.data(), b.lse = out.data(), b.g_logp = out.data();
  b.g_entropy = out.data();  // without the entropy
  EXPECT_THROW(cpu::logit_grad(b), Error);
}

}  // namespace
}  // namespace dualkv
