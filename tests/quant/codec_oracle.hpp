// tests/quant/codec_oracle.hpp -- an independent FP8 encoder written from the spec's text
// (fp8-numerics.md §2.1): RNE on the value grid in double precision, then saturation. It shares
// no code with quant/fp8.cpp (which works on bit fields).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace fp8rl::test {

struct fp8_format {
  int mbits;        // mantissa bits
  int emin;         // exponent of the min normal (2^emin)
  double max;       // max normal
};
inline constexpr fp8_format kE4M3{3, -6, 448.0};
inline constexpr fp8_format kE5M2{2, -14, 57344.0};

// Expected *value* (signed, possibly -0.0) of encode(x) for finite x, or NaN for NaN input.
inline double oracle_value(float xf, const fp8_format& f) {
  double x = xf;
  if (std::isnan(x)) return std::numeric_limits<double>::quiet_NaN();
  if (std::isinf(x)) return std::copysign(f.max, x);
  double a = std::fabs(x), r;
  double min_normal = std::ldexp(1.0, f.emin);
  if (a < min_normal) {
    double step = std::ldexp(1.0, f.emin - f.mbits);   // subnormal grid k * step
    r = std::nearbyint(a / step) * step;                // a/step exact (power of two)
  } else {
    int e;
    std::frexp(a, &e);                                  // a = m * 2^e, m in [0.5, 1)
    double step = std::ldexp(1.0, e - 1 - f.mbits);     // grid spacing in [2^(e-1), 2^e)
    r = std::nearbyint(a / step) * step;
  }
  if (r > f.max) r = f.max;
  return std::copysign(r, x);
}

}  // namespace fp8rl::test
