// quant/fp8_scaled_avx512.cpp -- AVX-512 E4M3 decode fused with a per-row or per-column scale
// (the FP8 KV cache's slabs, widened for decode attention). Compiled with -mavx512*.
// Bit-identical to e4m3_to_float(code) * scale (tests/quant/fp8_codec_test.cpp).
//
// 16 codes sign-extended to 32 bits and shifted left by 20, masked to 0x87F00000, are FP32 bits
// s|0000eeee|mmm0...: the code's value times 2^-120 exactly (exponent field e = 0 makes the FP32
// denormal m * 2^-129 = m * 2^-9 * 2^-120). One multiply by scale * 2^120 (exact while scale <
// 2^8 in magnitude) then rounds the same real product e4m3_to_float(code) * scale does: 5 vector ops per 16
// values, where decoding to an array and scaling it in a second pass took about 3x the time.
// Where that does not hold -- a NaN code (0x7F/0xFF would read 480), a scale of magnitude >= 2^8
// or not finite, or MXCSR DAZ (denormal operands read as 0) -- the call takes the scalar
// expression. Uses AVX-512 F/BW/VL only (the `avx512` level it is dispatched at).
#include <immintrin.h>

#include <cmath>

#include "quant/quantize_impl.hpp"

namespace fp8rl::quant::detail {
namespace {

constexpr float kUp = 0x1p120f;      // undoes the 2^-120 of e4m3x16_down
constexpr float kMaxScale = 0x1p8f;  // |scale| * 2^120 stays finite (and exact) below this

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// n (<= 16) codes at p -> their values times 2^-120 (lanes past n: +0)
inline __m512 e4m3x16_down(const uint8_t* p, __mmask16 m) {
  const __m512i t = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)), 20);
  return _mm512_castsi512_ps(_mm512_and_si512(t, _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
}

// Whether the fused form is exact for these codes and scales (see the file comment).
bool fused_exact(const uint8_t* in, int64_t n, const float* scale, int64_t ns) {
  if (_mm_getcsr() & 0x0040u) return false;  // DAZ
  for (int64_t i = 0; i < ns; ++i)
    if (!(std::fabs(scale[i]) < kMaxScale)) return false;  // also NaN and +-inf
  const __m512i low7 = _mm512_set1_epi8(0x7f);
  __mmask64 nan = 0;
  for (int64_t i = 0; i < n; i += 64) {
    const __mmask64 m = n - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (n - i)) - 1;
    nan |= _mm512_mask_cmpeq_epi8_mask(m, _mm512_and_si512(_mm512_maskz_loadu_epi8(m, in + i), low7), low7);
  }
  return nan == 0;
}

}  // namespace

bool e4m3_decode_scale_cols_avx512(const uint8_t* in, int64_t rows, int64_t cols, const float* scale, float* out) {
  if (!fused_exact(in, rows * cols, scale, cols)) return false;
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const __mmask16 m = lanes(cols - c0);
    const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scale + c0), _mm512_set1_ps(kUp));
    for (int64_t r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(out + r * cols + c0, m, _mm512_mul_ps(e4m3x16_down(in + r * cols + c0, m), s));
  }
  return true;
}

bool e4m3_decode_scale_rows_avx512(const uint8_t* in, int64_t rows, int64_t cols, const float* scale, float* out) {
  if (!fused_exact(in, rows * cols, scale, rows)) return false;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r] * kUp);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 m = lanes(cols - c0);
      _mm512_mask_storeu_ps(out + r * cols + c0, m, _mm512_mul_ps(e4m3x16_down(in + r * cols + c0, m), s));
    }
  }
  return true;
}

}  // namespace fp8rl::quant::detail
