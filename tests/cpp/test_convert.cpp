// The CPU backend's fp16/bf16 converters: exact loads, round-to-nearest-even stores, checked
// against the compiler's _Float16 and an exact double-precision rounding reference.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "convert.h"

namespace dualkv::cpu {
namespace {

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) ||
         std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}
bool same_half(uint16_t a, uint16_t b) {
  const bool na = (a & 0x7FFF) > 0x7C00, nb = (b & 0x7FFF) > 0x7C00;
  return (na && nb) || a == b;
}

// Floats around every representable 16-bit value: the value, the midpoints to its neighbours and
// one float ulp either side of them (where round-to-nearest-even decides), plus random floats
// of every magnitude and the special values.
std::vector<float> probe_floats(float (*to_float)(uint16_t)) {
  std::vector<float> xs = {
      0.f,      -0.f,          INFINITY, -INFINITY,       NAN,      65504.f,  65519.996f,
      65520.f,  0x1p-24f,      0x1p-25f, 0x1.000002p-25f, 0x1p-26f, 0x1p-14f, 3.3895314e38f,
      3.39e38f, 3.4028235e38f, 1e-45f,   -1e-45f};
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = to_float(uint16_t(b));
    const float g = to_float(uint16_t(b + 1));
    if (!std::isfinite(f)) continue;
    xs.push_back(f);
    if (std::isfinite(g) && std::signbit(f) == std::signbit(g)) {
      // Exact: 16-bit values have short mantissas.
      const float mid = float((double(f) + double(g)) / 2);
      xs.push_back(mid);
      xs.push_back(std::nextafter(mid, INFINITY));
      xs.push_back(std::nextafter(mid, -INFINITY));
    }
  }
  std::mt19937 rng(12345);
  for (int i = 0; i < 1 << 20; ++i) xs.push_back(std::bit_cast<float>(uint32_t(rng())));
  return xs;
}

TEST(Convert, HalfLoadIsExact) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const _Float16 h = std::bit_cast<_Float16>(uint16_t(b));
    ASSERT_TRUE(same_float(half_bits_to_float(uint16_t(b)), float(h))) << std::hex << b;
    if ((b & 0x7FFF) <= 0x7C00) {
      ASSERT_EQ(float_to_half_bits(half_bits_to_float(uint16_t(b))), b) << std::hex << b;
    }
  }
}

TEST(Convert, HalfStoreRoundsToNearestEven) {
  for (float x : probe_floats(&half_bits_to_float)) {
    const uint16_t want = std::bit_cast<uint16_t>(_Float16(x));
    ASSERT_TRUE(same_half(float_to_half_bits(x), want))
        << x << " (bits " << std::hex << std::bit_cast<uint32_t>(x) << ") -> "
        << float_to_half_bits(x) << ", expected " << want;
  }
}

// Exact RNE reference for bfloat16 through double arithmetic.
uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 16) & 0x8000;
  const uint32_t lo = (u & 0x7FFFFFFF) >> 16;  // truncation toward zero
  auto value = [](uint32_t b) {                // magnitude; the step past the max is 2^128
    return b == 0x7F80 ? std::ldexp(1.0, 128) : double(bf16_bits_to_float(uint16_t(b)));
  };
  if (lo >= 0x7F80) return uint16_t(sign | 0x7F80);  // inf stays inf
  const double a = std::abs(double(x)), d_lo = a - value(lo), d_hi = value(lo + 1) - a;
  const uint32_t r = d_lo < d_hi ? lo : d_hi < d_lo ? lo + 1 : (lo & 1 ? lo + 1 : lo);
  return uint16_t(sign | r);
}

TEST(Convert, BFloat16) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bf16_bits_to_float(uint16_t(b));
    ASSERT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    if ((b & 0x7FFF) <= 0x7F80) {
      ASSERT_EQ(float_to_bf16_bits(f), b) << std::hex << b;
    }
  }
  for (float x : probe_floats(&bf16_bits_to_float)) {
    const uint16_t got = float_to_bf16_bits(x), want = bf16_reference(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(bf16_bits_to_float(got)));
    } else {
      ASSERT_EQ(got, want) << x << " (bits " << std::hex << std::bit_cast<uint32_t>(x) << ")";
    }
  }
}

TEST(Convert, LoadStoreTemplates) {
  EXPECT_EQ(load<float>(Half{0x3C00}), 1.0f);
  EXPECT_EQ(load<double>(BFloat16{0xC000}), -2.0);
  EXPECT_EQ(store<Half>(1.0f + 0x1p-11f).bits, 0x3C00);             // tie: even mantissa stays
  EXPECT_EQ(store<Half>(1.0f + 0x1p-10f + 0x1p-11f).bits, 0x3C02);  // tie: rounds up to even
  EXPECT_EQ(store<BFloat16>(1.0f + 0x1p-8f).bits, 0x3F80);
  EXPECT_EQ(store<BFloat16>(1.0f + 0x1p-7f + 0x1p-8f).bits, 0x3F82);
  EXPECT_EQ(store<double>(0.1), 0.1);
  EXPECT_EQ(store<float>(0.5f), 0.5f);
}

}  // namespace
}  // namespace dualkv::cpu
