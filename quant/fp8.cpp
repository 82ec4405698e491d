// quant/fp8.cpp -- scalar FP8 codecs (the reference for every vectorized encoder).
#include "quant/fp8.hpp"

#include <array>
#include <cmath>
#include <limits>

namespace fp8rl::quant {
namespace {

// Rounds the integer `mant` (implicit bit included) right by `shift` bits, ties to even.
inline uint32_t shift_rne(uint32_t mant, uint32_t shift) {
  if (shift >= 32) return 0;
  uint32_t k = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (k & 1u))) ++k;
  return k;
}

// Generic saturating RNE encoder for a format with `mbits` mantissa bits and exponent `bias`.
// max_bits: float bits of the max normal; min_normal_bits: float bits of 2^(1-bias);
// sat_code: the max-normal code (without sign).
inline uint8_t fp8_encode(float x, int mbits, int bias, uint32_t max_bits,
                          uint32_t min_normal_bits, uint8_t sat_code) {
  uint32_t u = float_bits(x);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;               // NaN (SATFINITE: 0x7F, sign dropped)
  if (a >= max_bits) return sign | sat_code;      // [max, Inf]: ties and overflow saturate
  uint32_t drop = 23u - static_cast<uint32_t>(mbits);
  if (a >= min_normal_bits) {                     // normal: RNE on the exponent|mantissa field
    uint32_t r = (a + ((1u << (drop - 1u)) - 1u) + ((a >> drop) & 1u)) >> drop;
    uint32_t rebias = static_cast<uint32_t>(127 - bias) << mbits;
    return sign | static_cast<uint8_t>(r - rebias);
  }
  uint32_t e = a >> 23;                           // subnormal target: k units of 2^(1-bias-mbits)
  if (e == 0) return sign;                        // float subnormals are far below the grid
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;    // value = mant * 2^(e-150)
  // k = value / 2^(1-bias-mbits) = mant >> shift with shift = 150 - e - (bias - 1 + mbits)
  uint32_t shift = static_cast<uint32_t>(150 - static_cast<int>(e) - (bias - 1 + mbits));
  return sign | static_cast<uint8_t>(shift_rne(mant, shift));
}

std::array<float, 256> make_table(int mbits, int bias, bool e4m3) {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    int s = b >> 7;
    int e = (b & 0x7f) >> mbits;
    int m = b & ((1 << mbits) - 1);
    int emax = (1 << (7 - mbits)) - 1;
    float v;
    if (e4m3 && e == emax && m == (1 << mbits) - 1) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (!e4m3 && e == emax) {
      v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = std::ldexp(static_cast<float>(m), 1 - bias - mbits);
    } else {
      v = std::ldexp(1.0f + static_cast<float>(m) / static_cast<float>(1 << mbits), e - bias);
    }
    t[b] = s ? -v : v;
  }
  return t;
}

const std::array<float, 256> kE4M3Table = make_table(3, 7, true);
const std::array<float, 256> kE5M2Table = make_table(2, 15, false);

}  // namespace

uint8_t e4m3_from_float(float x) {
  // max 448 = 0x43E00000, min normal 2^-6 = 0x3C800000
  return fp8_encode(x, 3, 7, 0x43e00000u, 0x3c800000u, 0x7e);
}
float e4m3_to_float(uint8_t b) { return kE4M3Table[b]; }

uint8_t e5m2_from_float(float x) {
  // max 57344 = 0x47600000, min normal 2^-14 = 0x38800000
  return fp8_encode(x, 2, 15, 0x47600000u, 0x38800000u, 0x7b);
}
float e5m2_to_float(uint8_t b) { return kE5M2Table[b]; }

const float* e4m3_table() { return kE4M3Table.data(); }
const float* e5m2_table() { return kE5M2Table.data(); }

}  // namespace fp8rl::quant
