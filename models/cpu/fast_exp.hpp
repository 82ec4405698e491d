// models/cpu/fast_exp.hpp -- exp for float that vectorizes: the CPU backend's softmax and SiLU.
// defines: cpu_exp
//
// libm's expf is a call per element (no vector form without -ffast-math). This is Cephes' expf:
// Cody-Waite reduction x = n ln2 + r (|r| <= ln2/2, two-part ln2), a degree-6 polynomial for e^r,
// and 2^n put into the exponent bits. Every step is an IEEE operation or an exact fma, so all
// ISA clones and every caller (training and decode) get the same bits. Accuracy: within
// tests/tolerances.hpp kFastExpRel (2 ulp) of the exact value over [-87.3, 88]; inputs below
// clamp to e^-87.3 (1.2e-38, negligible against any softmax sum >= 1 or 1 + e^-x), above to
// e^88 (1.7e38); NaN propagates.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8rl::models {

[[gnu::always_inline]] inline float cpu_exp(float x) {
  x = x < -87.33654f ? -87.33654f : x;  // keeps n in [-126, 127]: 2^n a normal float;
  x = x > 88.0f ? 88.0f : x;              // comparisons (not fmin/fmax) so that NaN stays NaN
  // round to nearest integer by the 1.5 * 2^23 shift (two exact-order adds; vectorizes on any ISA)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = std::fma(n, -0.693359375f, x);                   // ln2 = 0.693359375 - 2.12194440e-4
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;  // e^r = 1 + r + r^2 (1/2 + r/6 + ...)
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace fp8rl::models
