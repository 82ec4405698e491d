// quant/fp8.hpp -- scalar FP8 (OCP E4M3FN, E5M2) and BF16 codecs.
// defines: e4m3_from_float, e4m3_to_float, e5m2_from_float, e5m2_to_float,
//          bf16_from_float, bf16_to_float, float_bits, float_from_bits,
//          e4m3_encode_array, e4m3_decode_array, e4m3_is_subnormal, e4m3_any_subnormal
//
// Encoding is round-to-nearest-even with CUDA __NV_SATFINITE semantics
// (fp8-numerics.md §2.1): finite overflow and ±Inf saturate to ±max normal,
// NaN -> 0x7F, the sign of tiny values is kept (-2^-11 -> 0x80). Decoding is exact.
// These are the reference codecs; vectorized encoders elsewhere must match them byte for byte.
#pragma once
#include <cstdint>
#include <cstring>

namespace fp8rl::quant {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

uint8_t e4m3_from_float(float x);  // OCP E4M3FN, RNE, saturate to ±448, ±Inf -> ±448, NaN -> 0x7F
float e4m3_to_float(uint8_t b);    // exact; 0x7F/0xFF decode to NaN
uint8_t e5m2_from_float(float x);  // RNE, saturate to ±57344, ±Inf -> ±57344, NaN -> 0x7F
float e5m2_to_float(uint8_t b);    // exact

// Vectorized (AVX-512 when available) array encoder; byte-identical to e4m3_from_float.
void e4m3_encode_array(const float* x, int64_t n, uint8_t* out);
// ... and decoder: out[i] = e4m3_to_float(in[i]), bit for bit (AVX-512 where BF16 is present:
// 64 codes per table lookup).
void e4m3_decode_array(const uint8_t* in, int64_t n, float* out);
// x[n] -> BF16 bits, each exactly bf16_from_float (below); AVX-512 where present, oneTBB.
void bf16_encode_array(const float* x, int64_t n, uint16_t* out);
// out[cols][rows] = bf16_from_float(x[rows][cols]): the BF16 transpose in one pass.
void bf16_encode_transposed(const float* x, int64_t rows, int64_t cols, uint16_t* out);

// Whether an E4M3 code is subnormal (exponent field 0, mantissa non-zero: +-2^-9 .. +-7 * 2^-9),
// and whether any of codes[0..n) is: a vector widened through FP32 denormals is slow on
// x86 (a microcode assist), so the decode-attention cache flags where they occur.
inline constexpr bool e4m3_is_subnormal(uint8_t c) { return (c & 0x78) == 0 && (c & 0x07) != 0; }
inline bool e4m3_any_subnormal(const uint8_t* codes, int64_t n) {
  bool any = false;
  for (int64_t i = 0; i < n; ++i) any |= e4m3_is_subnormal(codes[i]);
  return any;
}

// The 256-entry decode tables (the reference decoders).
const float* e4m3_table();
const float* e5m2_table();

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// BF16 as raw uint16_t bits. bf16_from_float rounds to nearest even; NaN stays a quiet NaN.
inline uint16_t bf16_from_float(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t b) { return float_from_bits(static_cast<uint32_t>(b) << 16); }
inline float bf16_round(float x) { return bf16_to_float(bf16_from_float(x)); }

}  // namespace fp8rl::quant
