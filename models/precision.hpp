// models/precision.hpp -- the precision policy: one object decides, per tensor, what runs in FP8.
// defines: precision, kv_dtype, precision_policy, precision_name, kv_dtype_name
//
// Generation and training are each given an object of this one type (a run's generation and
// training policies, recipe.cpp; architecture.md §6 names them fp8-gen / fp8-e2e / fp8-e2e-kv,
// here fp8 / fp8-kv); the generation-only part (FP8 KV cache and FP8 attention,
// fp8-numerics.md §8) is what `training()` strips, and the scale mode is run-wide. Rules:
// embeddings, norms and lm_head are never FP8; a linear layer runs FP8 only if both its
// dimensions are multiples of 128 (else BF16 on both sides, §3.3); layers can be kept BF16 by
// index (first/last N) or by name substring.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "models/config.hpp"
#include "quant/scale.hpp"

namespace fp8rl::models {

enum class precision : uint8_t { fp32 = 0, bf16 = 1, fp8 = 2 };
enum class kv_dtype : uint8_t { f32 = 0, bf16 = 1, fp8 = 2 };

std::string_view precision_name(precision p);
std::string_view kv_dtype_name(kv_dtype k);
std::optional<precision> precision_parse(std::string_view s);
std::optional<kv_dtype> kv_dtype_parse(std::string_view s);

struct precision_policy {
  std::string name = "fp32";
  precision linear = precision::fp32;     // q, k, v, o, gate, up, down projections
  precision head = precision::fp32;       // embedding, norms, lm_head weights: fp32 or bf16
  precision attention = precision::fp32;  // QK^T and PV operands: fp32 or bf16
  bool fp8_attention = false;             // generation: Q/K/V per-head FP8, P in `attention` (BF16;
                                          // FA3's E4M3 P is not modelled)
  kv_dtype kv = kv_dtype::f32;            // generation KV cache
  int64_t bf16_first = 0, bf16_last = 0;  // transformer layers kept BF16 when linear == fp8
  std::vector<std::string> bf16_names;    // tensor-name substrings kept BF16
  quant::scale_mode scales = quant::scale_mode::pow2;
  // BF16/FP8 linear GEMMs on the CPU's matrix engine (AMX tiles, quant/gemm.hpp `*_tiles`):
  // several times faster where AMX exists, tolerance-checked instead of bit-exact with the
  // exact kernels. Rows never mix, so generation and training under the same policy still
  // agree bit for bit. Needs AMX: preparing weights without it is an error, never a fallback.
  bool tiles = false;

  // Precision of one linear layer ("q_proj", "gate_proj", ...) of layer `layer`, shape [out, in].
  precision linear_for(const model_config& c, int64_t layer, std::string_view proj, int64_t out,
                       int64_t in) const;
  precision_policy training() const;  // without the generation-only FP8 attention / KV cache
  std::string fingerprint() const;    // canonical text; scale snapshots and bundles record it
  void validate() const;              // throws std::invalid_argument naming the field
  // The first of bf16_names that names no linear layer of c ("model.layers.L.PROJ" contains it
  // for no L and projection), "" if each does: a name that matches nothing kept nothing BF16.
  std::string bf16_name_unmatched(const model_config& c) const;

  // fp32, bf16, fp8 (FP8 linears, BF16 rest), fp8-kv (+ FP8 KV cache and attention);
  // a "-tiles" suffix on bf16/fp8/fp8-kv sets `tiles`
  static precision_policy named(std::string_view name);
};

}  // namespace fp8rl::models
