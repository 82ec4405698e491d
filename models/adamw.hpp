// models/adamw.hpp -- AdamW with FP32 master weights and global-norm gradient clipping.
// defines: adamw_config, adamw_state, adamw_step, grad_global_norm
//
// The update is PyTorch's AdamW (decoupled decay: p *= 1 - lr*wd, then
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)); clipping is clip_grad_norm_
// (scale by max_norm / (norm + 1e-6) when that is < 1). Deterministic for any thread count.
#pragma once
#include <cstdint>
#include <vector>

#include "models/params.hpp"

namespace fp8rl::models {

struct adamw_config {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.0f;  // applied to matrices (linears, embeddings), not norms
  float grad_clip = 1.0f;     // max global L2 norm; 0 disables clipping
};

struct adamw_state {
  std::vector<float> m, v;  // first/second moments, layout of model_params
  int64_t step = 0;
};

// Global L2 norm of grads[n] (FP64 sum over fixed chunks).
double grad_global_norm(const float* grads, int64_t n);
// Clips grads in place, updates params; returns the pre-clip global norm. A NaN/Inf gradient is
// refused (std::invalid_argument naming the tensor and element) before any state changes.
double adamw_step(const adamw_config& cfg, const param_layout& layout, float* params, float* grads, adamw_state& st);

}  // namespace fp8rl::models
