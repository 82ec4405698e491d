// models/lanes.hpp -- fixed-order double sums that vectorize: 8 partial sums (lane i % 8 from the
// start of the range) added in lane order at the end. Inline, so each ISA clone of a caller gets
// its own vector code for the same order (gradient norm, RMSNorm forward and backward).
// defines: lanes_sum_squares, lanes_sum_product3
#pragma once
#include <cstdint>

namespace fp8rl::models {

// sum over i < n of x[i]^2, in double
[[gnu::always_inline]] inline double lanes_sum_squares(const float* __restrict x, int64_t n) {
  double lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(x[i + l]) * x[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += static_cast<double>(x[i]) * x[i];
  double s = 0.0;
  for (double v : lane) s += v;
  return s;
}

// sum over i < n of x[i] * y[i] * z[i], in double
[[gnu::always_inline]] inline double lanes_sum_product3(const float* __restrict x, const float* __restrict y,
                                                        const float* __restrict z, int64_t n) {
  double lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(x[i + l]) * y[i + l] * z[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += static_cast<double>(x[i]) * y[i] * z[i];
  double s = 0.0;
  for (double v : lane) s += v;
  return s;
}

}  // namespace fp8rl::models
