// quant/scale.cpp -- amax -> scale (fp8-numerics.md §4). Built with -ffp-contract=off.
#include "quant/scale.hpp"

#include <cfloat>
#include <cmath>

#include "quant/fp8.hpp"

namespace fp8rl::quant {

int pow2_exponent(float amax) {
  uint32_t u = float_bits(amax);
  int E = static_cast<int>((u >> 23) & 0xffu);
  uint32_t M = u & 0x7fffffu;
  if (E == 0) return -126;                     // subnormal amax: smallest UE8M0 code
  int e = (E - 127) - 8 + (M > 0x600000u ? 1 : 0);  // 0x600000 = mantissa of 1.75; 448 = 1.75*2^8
  return e < -126 ? -126 : e;
}

block_scale scale_from_amax(float amax, scale_mode mode) {
  if (!(amax > 0.0f)) return {1.0f, 1.0f};     // zero block (TE rule)
  if (mode == scale_mode::pow2) {
    const int e = pow2_exponent(amax);  // in [-126, 120]: 2^e and 2^-e are normal floats
    auto pow2 = [](int k) { return float_from_bits(static_cast<uint32_t>(k + 127) << 23); };
    return {pow2(-e), pow2(e)};
  }
  float scale = kE4M3Max / amax;               // IEEE RNE division
  if (std::isinf(scale)) scale = FLT_MAX;
  return {scale, 1.0f / scale};
}

std::string_view scale_mode_name(scale_mode m) { return m == scale_mode::pow2 ? "pow2" : "fp32"; }

std::optional<scale_mode> scale_mode_parse(std::string_view s) {
  if (s == "pow2") return scale_mode::pow2;
  if (s == "fp32") return scale_mode::fp32;
  return std::nullopt;
}

}  // namespace fp8rl::quant
