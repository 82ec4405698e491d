// quant/fp8_avx512.hpp -- internal: 16-lane E4M3 encoder/decoder (AVX-512 F/BW).
// Include only from translation units compiled with AVX-512 flags. Byte-identical to
// e4m3_from_float (quant/fp8.cpp); tested exhaustively against it.
#pragma once
#include <immintrin.h>

namespace fp8rl::quant::detail {

// 16 floats -> 16 E4M3 codes in the low byte of each dword (SATFINITE, RNE).
inline __m512i e4m3_encode16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  // normal range: RNE on the exponent|mantissa field, then rebias (127-7)<<3 = 960
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i rn = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), lsb));
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(rn, 20), _mm512_set1_epi32(960));
  // subnormal range (|x| < 2^-6): k = RNE(|x| * 2^9), exact multiply
  __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f));
  __m512i ks = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000)),
                                 code, ks);
  code = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x43e00000)),
                                 code, _mm512_set1_epi32(0x7e));
  code = _mm512_or_si512(code, sign);
  return _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)),
                                 code, _mm512_set1_epi32(0x7f));
}

// Counts lanes whose exponent is all ones (NaN/Inf) among `m` and returns max |x| of the rest.
inline __m512 abs_max_acc(__m512 acc, __m512 x, __mmask16 m, int* nonfinite) {
  __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  __mmask16 bad = _mm512_mask_cmpge_epu32_mask(m, a, _mm512_set1_epi32(0x7f800000));
  *nonfinite += __builtin_popcount(bad);
  return _mm512_mask_max_ps(acc, m & static_cast<__mmask16>(~bad), acc, _mm512_castsi512_ps(a));
}

}  // namespace fp8rl::quant::detail
