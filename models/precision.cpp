// models/precision.cpp -- precision policy rules.
#include "models/precision.hpp"

#include <sstream>
#include <stdexcept>

namespace fp8rl::models {

std::string_view precision_name(precision p) {
  switch (p) {
    case precision::fp32: return "fp32";
    case precision::bf16: return "bf16";
    case precision::fp8: return "fp8";
  }
  return "?";
}
std::string_view kv_dtype_name(kv_dtype k) {
  switch (k) {
    case kv_dtype::f32: return "f32";
    case kv_dtype::bf16: return "bf16";
    case kv_dtype::fp8: return "fp8";
  }
  return "?";
}
std::optional<precision> precision_parse(std::string_view s) {
  if (s == "fp32") return precision::fp32;
  if (s == "bf16") return precision::bf16;
  if (s == "fp8") return precision::fp8;
  return std::nullopt;
}
std::optional<kv_dtype> kv_dtype_parse(std::string_view s) {
  if (s == "f32" || s == "fp32") return kv_dtype::f32;
  if (s == "bf16") return kv_dtype::bf16;
  if (s == "fp8") return kv_dtype::fp8;
  return std::nullopt;
}

precision precision_policy::linear_for(const model_config& c, int64_t layer, std::string_view proj,
                                       int64_t out, int64_t in) const {
  if (linear != precision::fp8) return linear;
  if (layer < bf16_first || layer >= c.num_hidden_layers - bf16_last) return precision::bf16;
  const std::string full = "model.layers." + std::to_string(layer) + "." + std::string(proj);
  for (const auto& n : bf16_names)
    if (full.find(n) != std::string::npos) return precision::bf16;
  if (out % 128 || in % 128) return precision::bf16;  // blockwise FP8 needs 128-multiples
  return precision::fp8;
}

std::string precision_policy::bf16_name_unmatched(const model_config& c) const {
  static const char* const kProjs[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                       "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
  for (const auto& n : bf16_names) {
    bool hit = false;
    for (int64_t l = 0; l < c.num_hidden_layers && !hit; ++l)
      for (const char* p : kProjs) hit = hit || ("model.layers." + std::to_string(l) + "." + p).find(n) != std::string::npos;
    if (!hit) return n;
  }
  return "";
}

precision_policy precision_policy::training() const {
  precision_policy t = *this;
  t.fp8_attention = false;
  t.kv = t.attention == precision::fp32 ? kv_dtype::f32 : kv_dtype::bf16;
  return t;
}

std::string precision_policy::fingerprint() const {
  std::ostringstream os;
  os << "linear=" << precision_name(linear) << ";head=" << precision_name(head)
     << ";attention=" << precision_name(attention) << ";fp8_attention=" << fp8_attention
     << ";kv=" << kv_dtype_name(kv) << ";bf16_first=" << bf16_first << ";bf16_last=" << bf16_last
     << ";scales=" << quant::scale_mode_name(scales) << ";tiles=" << tiles << ";bf16_names=";
  for (const auto& n : bf16_names) os << n << ",";
  return os.str();
}

void precision_policy::validate() const {
  auto bad = [&](const char* f, const std::string& why) {
    throw std::invalid_argument("precision policy '" + name + "': " + f + ": " + why);
  };
  if (head == precision::fp8) bad("head", "embeddings, norms and lm_head are never FP8");
  if (attention == precision::fp8) bad("attention", "use fp8_attention (generation only) instead");
  if (bf16_first < 0 || bf16_last < 0) bad("bf16_first/bf16_last", "must be >= 0");
  if (fp8_attention && kv != kv_dtype::fp8) bad("fp8_attention", "needs kv = fp8");
  if (tiles && linear == precision::fp32 && head == precision::fp32)
    bad("tiles", "tile GEMMs run BF16 or FP8 linear layers; this policy has none");
}

precision_policy precision_policy::named(std::string_view n) {
  constexpr std::string_view kTiles = "-tiles";
  auto has_tiles = [&](std::string_view s) {
    return s.size() > kTiles.size() && s.substr(s.size() - kTiles.size()) == kTiles;
  };
  const std::string_view base = has_tiles(n) ? n.substr(0, n.size() - kTiles.size()) : n;
  if (has_tiles(n) && base != "fp32" && !has_tiles(base)) {
    precision_policy p = named(base);
    p.name = std::string(n);
    p.tiles = true;
    return p;
  }
  precision_policy p;
  p.name = std::string(n);
  if (n == "fp32") return p;
  p.head = p.attention = precision::bf16;
  p.kv = kv_dtype::bf16;
  if (n == "bf16") { p.linear = precision::bf16; return p; }
  p.linear = precision::fp8;
  if (n == "fp8") return p;
  if (n == "fp8-kv") {
    p.kv = kv_dtype::fp8;
    p.fp8_attention = true;
    return p;
  }
  throw std::invalid_argument("unknown precision policy '" + std::string(n) + "' (fp32, bf16, fp8, fp8-kv; bf16/fp8/fp8-kv with a -tiles suffix)");
}

}  // namespace fp8rl::models
