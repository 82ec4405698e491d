// models/bundle.hpp -- converting between model parameters and weight bundles.
// defines: bundle_from_params, bundle_contents, bundle_unpack
//
// The learner side quantizes/rounds FP32 master weights under the generation policy into an
// immutable bundle (quant/bundle.hpp); the rollout side unpacks a bundle into the compute weights
// model_weights_build takes. Both sides then prepare exactly the same bytes.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "models/params.hpp"
#include "models/precision.hpp"
#include "models/transformer.hpp"
#include "quant/bundle.hpp"
#include "quant/qtensor.hpp"

namespace fp8rl::models {

// attn (optional): FP8 attention / KV-cache scales (scale_inv [L][H], [L][KV], [L][KV]).
// flushed (optional): what the FP8 tensors' quantization sent to zero (quant::qtensor_flushed).
quant::weight_bundle bundle_from_params(const model_params& p, const precision_policy& policy, uint64_t weight_version,
                                        uint64_t scale_version, const attn_fp8_scales* attn,
                                        quant::flush_report* flushed = nullptr);

struct bundle_contents {
  std::map<std::string, std::vector<float>> values;  // non-FP8 tensors as FP32 values
  std::map<std::string, quant::qtensor> fp8;         // FP8 tensors with their block scales
  attn_fp8_scales attn;                              // empty unless the snapshot carries them
  weight_source source() const { return {nullptr, &values, &fp8}; }
};

// Validates the bundle against the config and policy (fingerprint, every tensor present with the
// dtype the policy implies, shapes, scales) and unpacks it. Throws std::invalid_argument naming
// the tensor at fault; nothing is patched.
bundle_contents bundle_unpack(const quant::weight_bundle& b, const model_config& cfg, const precision_policy& policy);

}  // namespace fp8rl::models
