// models/bundle.hpp -- converting between model parameters and weight bundles.
// defines: bundle_from_params, bundle_bytes, bundle_contents, bundle_unpack
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

// The payload bytes (weight_bundle::bytes) of c's bundle under policy: FP8 tensors 1 byte a weight
// and a 4-byte scale per 128x128 block (the layout's padding too), BF16 2, FP32 4, the FP8 attention scales where the policy
// needs them. Also the least a generation engine's prepared weights take (host_memory_check).
double bundle_bytes(const model_config& c, const precision_policy& policy);

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
