// quant/bundle.hpp -- weight bundles and scale snapshots: the immutable, versioned artifacts
// that weight sync moves from the learner to rollout engines (architecture.md §3).
// defines: bundle_dtype, bundle_tensor, scale_snapshot, weight_bundle, bundle_validate
//
// A bundle = FP8 weight bytes + tensors that stay BF16/FP32 (embeddings, norms, lm_head,
// BF16-kept layers) + one scale snapshot identified by (weight_version, scale_version). The
// snapshot holds the 128x128 block scales of every FP8 tensor (cuBLASLt BLK128x128 layout, see
// qtensor.hpp) and, for FP8 KV cache / attention, per-layer per-head Q/K/V scales. A snapshot
// with any missing scale is invalid: refused, never patched with 1.0.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "quant/scale.hpp"

namespace fp8rl::quant {

enum class bundle_dtype : uint8_t { f32 = 0, bf16 = 1, fp8 = 2 };

struct bundle_tensor {
  std::string name;
  bundle_dtype dtype = bundle_dtype::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian FP32 / BF16 values, or E4M3 codes (row-major)
  int64_t numel() const;
};

struct scale_snapshot {
  uint64_t weight_version = 0, scale_version = 0;
  scale_mode mode = scale_mode::pow2;
  std::string policy;  // precision-policy fingerprint the snapshot was made for
  std::map<std::string, std::vector<float>> weight_scales;  // FP8 tensor -> block scale_inv
  int32_t layers = 0, heads = 0, kv_heads = 0;
  std::vector<float> q_scale, k_scale, v_scale;  // [L][H], [L][KV], [L][KV] scale_inv; empty if unused
  bool has_attention_scales() const { return !q_scale.empty(); }
};

struct weight_bundle {
  uint64_t weight_version = 0;
  scale_snapshot snapshot;
  std::vector<bundle_tensor> tensors;
  int64_t bytes() const;  // payload bytes (tensor bytes + scales)
};

// Checks a snapshot against the bundle's FP8 tensors: every FP8 tensor has a block-scale array
// of the right size with finite positive entries (padding excepted), attention scales (if
// needed) have [L][H]/[L][KV] finite positive entries. Throws std::invalid_argument naming the
// tensor / layer at fault.
void bundle_validate(const weight_bundle& b, bool needs_attention_scales);

}  // namespace fp8rl::quant
