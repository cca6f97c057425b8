// Bit-exact conversions between float and the 16-bit storage types (IEEE binary16 and bfloat16).
// Loads are exact; stores round to nearest, ties to even, like a hardware cast. NaN stays NaN.
// Also the dtype dispatch of the CPU backend's entry points.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "dualkv/params.h"

namespace dualkv::cpu {

// Storage-only 16-bit types: the CPU backend computes in float and converts at the edges.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  const float f = float(mant) * 0x1p-24f;  // zero or subnormal: mant * 2^-24 is exact in float
  return sign ? -f : f;
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // quiet NaN
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 (half-way past 65504): inf
  if (a >= 0x38800000u) {                                 // normal half (>= 2^-14)
    const uint32_t m = a - 0x38000000u;                   // rebias the exponent 127 -> 15
    return uint16_t(sign | ((m + 0xFFFu + ((m >> 13) & 1u)) >> 13));  // RNE; carries into exp
  }
  const uint32_t e = a >> 23;
  if (e < 102) return uint16_t(sign);  // below 2^-25: rounds to zero (2^-25 itself is a tie)
  // Subnormal half: round (1.mant * 2^(e-127)) / 2^-24 = mant24 >> (126 - e) to nearest even.
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // may carry into the smallest normal
  return uint16_t(sign | r);
}

inline float bf16_bits_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // RNE; overflow lands on inf
}

// load<A>(x) widens a storage value to the accumulation type A; store<S>(a) rounds it back.
template <class A, class S>
inline A load(S x) {
  if constexpr (std::is_same_v<S, Half>) {
    return A(half_bits_to_float(x.bits));
  } else if constexpr (std::is_same_v<S, BFloat16>) {
    return A(bf16_bits_to_float(x.bits));
  } else {
    return A(x);
  }
}

template <class S, class A>
inline S store(A x) {
  if constexpr (std::is_same_v<S, Half>) {
    return Half{float_to_half_bits(float(x))};
  } else if constexpr (std::is_same_v<S, BFloat16>) {
    return BFloat16{float_to_bf16_bits(float(x))};
  } else {
    return S(x);
  }
}

// Runs Fn<S, A>::run(args) for args.dtype: S the storage type, A the accumulation type (fp32,
// fp64 for fp64 inputs).
template <template <class, class> class Fn, class Args>
void dispatch(const Args& args) {
  switch (args.dtype) {
    case DType::kFloat16:
      return Fn<Half, float>::run(args);
    case DType::kBFloat16:
      return Fn<BFloat16, float>::run(args);
    case DType::kFloat32:
      return Fn<float, float>::run(args);
    case DType::kFloat64:
      return Fn<double, double>::run(args);
  }
}

}  // namespace dualkv::cpu
