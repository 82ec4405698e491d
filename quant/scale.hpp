// quant/scale.hpp -- amax -> scale for the two scale modes (fp8-numerics.md §4).
// defines: scale_mode, block_scale, scale_from_amax, scale_mode_name, scale_mode_parse
//
// Convention: q = encode(x * scale), x_hat = decode(q) * scale_inv.
//   pow2 (default): scale_inv = 2^e with the integer exponent formula; scale = 2^-e exactly.
//   fp32 (TransformerEngine): scale = 448/amax (IEEE division), scale_inv = 1/scale.
// A zero block (amax == 0) gets scale = scale_inv = 1 in both modes.
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

namespace fp8rl::quant {

enum class scale_mode : uint8_t { pow2 = 0, fp32 = 1 };

struct block_scale {
  float scale = 1.0f;      // multiplier applied before encoding
  float scale_inv = 1.0f;  // dequantization multiplier stored with the bytes
};

// amax must be finite and >= 0 (quantizers reject non-finite blocks before calling this).
block_scale scale_from_amax(float amax, scale_mode mode);

// pow2 exponent e of scale_inv = 2^e for finite amax > 0 (§4.1), clamped to >= -126.
int pow2_exponent(float amax);

std::string_view scale_mode_name(scale_mode m);
std::optional<scale_mode> scale_mode_parse(std::string_view s);

}  // namespace fp8rl::quant
