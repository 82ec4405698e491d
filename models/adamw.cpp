// models/adamw.cpp -- AdamW step (PyTorch's single-tensor formula), oneTBB over chunks.
#include "models/adamw.hpp"

#include "models/clones.hpp"
#include "models/lanes.hpp"

#include <tbb/parallel_for.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace fp8rl::models {

namespace {
// sum of g[i]^2 in double over [i0, i1), lanes from i0 (models/lanes.hpp)
FP8RL_VECTOR_CLONES double sum_squares(const float* __restrict g, int64_t i0, int64_t i1) {
  return lanes_sum_squares(g + i0, i1 - i0);
}
}  // namespace

double grad_global_norm(const float* g, int64_t n) {
  const int64_t chunk = 1 << 16, nc = (n + chunk - 1) / chunk;
  std::vector<double> part(static_cast<size_t>(nc), 0.0);
  tbb::parallel_for(int64_t{0}, nc, [&](int64_t c) { part[c] = sum_squares(g, c * chunk, std::min(n, (c + 1) * chunk)); });
  double s = 0.0;
  for (double p : part) s += p;  // fixed order
  return std::sqrt(s);
}

namespace {
struct adamw_coefs {
  float clip, beta1, beta2, eps, step_size, bc2_sqrt, decay;
};

// Elements [i0, i1): restrict pointers and no errno from sqrt (adamw.cpp is built with
// -fno-math-errno) let this vectorize; every operation is the same IEEE operation as the scalar
// formula (no contraction: -ffp-contract=off), so the result does not depend on the ISA clone.
FP8RL_VECTOR_CLONES void adamw_range(const adamw_coefs& k, int64_t i0, int64_t i1, float* __restrict params,
                                     float* __restrict grads, float* __restrict m, float* __restrict v) {
  const float clip = k.clip, b1 = k.beta1, b2 = k.beta2, eps = k.eps, step = k.step_size, bc2 = k.bc2_sqrt,
              decay = k.decay, c1 = 1.0f - b1, c2 = 1.0f - b2;
  for (int64_t i = i0; i < i1; ++i) {
    const float g = grads[i] * clip;
    grads[i] = g;
    const float p = params[i] * decay;
    const float mi = m[i] * b1 + g * c1;
    const float vi = v[i] * b2 + g * g * c2;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2 + eps;
    params[i] = p - step * (mi / denom);
  }
}
}  // namespace

namespace {
// The first non-finite gradient element, named by tensor and index (a finite FP32 squared in FP64
// cannot overflow, so a non-finite norm means such an element exists).
[[noreturn]] void nonfinite_grad(const param_layout& layout, const float* grads) {
  for (const auto& info : layout.infos)
    for (int64_t i = 0; i < info.numel; ++i)
      if (!std::isfinite(grads[info.offset + i]))
        throw std::invalid_argument("adamw_step: the gradient of " + info.name + " is " +
                                    std::to_string(grads[info.offset + i]) + " at element " + std::to_string(i) +
                                    "; no parameter or moment was updated");
  throw std::invalid_argument("adamw_step: the gradient norm is not finite; no parameter or moment was updated");
}
}  // namespace

double adamw_step(const adamw_config& cfg, const param_layout& layout, float* params, float* grads, adamw_state& st) {
  const int64_t n = layout.total;
  // a NaN/Inf gradient would clip every other one to 0 (Inf norm) or pass NaN into every parameter
  // and both moments (NaN norm) without a word: refused before any state changes
  const double norm = grad_global_norm(grads, n);
  if (!std::isfinite(norm)) nonfinite_grad(layout, grads);
  if (st.m.size() != static_cast<size_t>(n)) {
    st.m.assign(static_cast<size_t>(n), 0.0f);
    st.v.assign(static_cast<size_t>(n), 0.0f);
  }
  float clip = 1.0f;
  if (cfg.grad_clip > 0.0f) {
    const double coef = cfg.grad_clip / (norm + 1e-6);
    if (coef < 1.0) clip = static_cast<float>(coef);
  }
  st.step += 1;
  const float bc1 = 1.0f - std::pow(cfg.beta1, static_cast<float>(st.step));
  const float bc2 = 1.0f - std::pow(cfg.beta2, static_cast<float>(st.step));
  const float step_size = cfg.lr / bc1, bc2_sqrt = std::sqrt(bc2);
  const adamw_coefs k{clip, cfg.beta1, cfg.beta2, cfg.eps, step_size, bc2_sqrt, 1.0f};
  for (const auto& info : layout.infos) {
    adamw_coefs ki = k;
    ki.decay = info.is_matrix ? 1.0f - cfg.lr * cfg.weight_decay : 1.0f;
    tbb::parallel_for(tbb::blocked_range<int64_t>(info.offset, info.offset + info.numel, 1 << 14), [&](const auto& r) {
      adamw_range(ki, r.begin(), r.end(), params, grads, st.m.data(), st.v.data());
    });
  }
  return norm;
}

}  // namespace fp8rl::models
