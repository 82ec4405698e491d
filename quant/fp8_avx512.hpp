// quant/fp8_avx512.hpp -- internal: 16-lane E4M3 and BF16 encoders, 16x16 byte and dword
// transposes (AVX-512 F/BW).
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

// a[r] byte j -> out[j] byte r (16x16 bytes): four unpack stages (8-, 16-, 32-, 64-bit); after
// them column j = 8h + 4g + 2s + t sits in out[j].
inline void transpose_16x16_u8(const __m128i (&a)[16], __m128i (&out)[16]) {
  __m128i b[8][2], c[4][2][2], d[2][2][2][2];
  for (int p = 0; p < 8; ++p) {
    b[p][0] = _mm_unpacklo_epi8(a[2 * p], a[2 * p + 1]);
    b[p][1] = _mm_unpackhi_epi8(a[2 * p], a[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q)
    for (int h = 0; h < 2; ++h) {
      c[q][h][0] = _mm_unpacklo_epi16(b[2 * q][h], b[2 * q + 1][h]);
      c[q][h][1] = _mm_unpackhi_epi16(b[2 * q][h], b[2 * q + 1][h]);
    }
  for (int u = 0; u < 2; ++u)
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 2; ++g) {
        d[u][h][g][0] = _mm_unpacklo_epi32(c[2 * u][h][g], c[2 * u + 1][h][g]);
        d[u][h][g][1] = _mm_unpackhi_epi32(c[2 * u][h][g], c[2 * u + 1][h][g]);
      }
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 2; ++g)
      for (int t = 0; t < 2; ++t) {
        out[8 * h + 4 * g + 2 * t] = _mm_unpacklo_epi64(d[0][h][g][t], d[1][h][g][t]);
        out[8 * h + 4 * g + 2 * t + 1] = _mm_unpackhi_epi64(d[0][h][g][t], d[1][h][g][t]);
      }
}

// 16 floats -> their E4M3 values as floats: e4m3_to_float(e4m3_from_float(x)) for every non-NaN
// x (RNE to 3 mantissa bits, multiples of 2^-9 below 2^-6, saturation at ±448; the sign of
// values rounding to zero kept). Tested exhaustively against the scalar codecs.
inline __m512 e4m3_grid16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), lsb)),
                               _mm512_set1_epi32(static_cast<int>(0xfff00000u)));
  r = _mm512_min_epu32(r, _mm512_set1_epi32(0x43e00000));  // 448
  const __m512 k = _mm512_cvt_roundepi32_ps(
      _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // |k| <= 8: exact
  const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(k, _mm512_set1_ps(1.0f / 512.0f)));
  r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000)), r, sub);  // < 2^-6
  return _mm512_castsi512_ps(_mm512_or_si512(r, _mm512_andnot_si512(_mm512_set1_epi32(0x7fffffff), u)));
}

// The BF16 words of 16 floats that BF16 holds exactly (E4M3 values, times powers of two): the
// upper halves, no rounding step.
inline __m256i bf16_exact16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)); }

// 16 BF16 pairs (lo[j], hi[j]) as dwords, the low word from lo: (hi & 0xffff0000) | (lo >> 16)
// for floats BF16 holds exactly. The tile forms' k-pair layout.
inline __m512i bf16_pairs16(__m512 lo, __m512 hi) {
  return _mm512_ternarylogic_epi32(_mm512_castps_si512(hi), _mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                   _mm512_set1_epi32(static_cast<int>(0xffff0000u)), 0xE4);
}

// r[i] lane j -> r[j] lane i for 16 vectors of 16 32-bit lanes (unpack 32, unpack 64, two
// 128-bit lane shuffles). GCC 12's unmasked unpack intrinsics start from an `undefined` vector
// (`__Y = __Y`) that -Wuninitialized flags at -O1 (the sanitizer builds): silenced here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
inline void transpose_16x16_u32(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}
#pragma GCC diagnostic pop

// 16 floats (as bits) -> 16 BF16 words, exactly bf16_from_float (RNE on the bits; NaN -> quiet
// NaN; denormals kept, unlike VCVTNEPS2BF16, which flushes them).
inline __m256i bf16_encode16(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

}  // namespace fp8rl::quant::detail
