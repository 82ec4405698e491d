// models/adamw.cpp -- AdamW step (PyTorch's single-tensor formula), oneTBB over chunks.
#include "models/adamw.hpp"

#include <tbb/parallel_for.h>

#include <cmath>

namespace fp8rl::models {

double grad_global_norm(const float* g, int64_t n) {
  const int64_t chunk = 1 << 16, nc = (n + chunk - 1) / chunk;
  std::vector<double> part(static_cast<size_t>(nc), 0.0);
  tbb::parallel_for(int64_t{0}, nc, [&](int64_t c) {
    double s = 0.0;
    for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) s += static_cast<double>(g[i]) * g[i];
    part[c] = s;
  });
  double s = 0.0;
  for (double p : part) s += p;  // fixed order
  return std::sqrt(s);
}

double adamw_step(const adamw_config& cfg, const param_layout& layout, float* params, float* grads, adamw_state& st) {
  const int64_t n = layout.total;
  if (st.m.size() != static_cast<size_t>(n)) {
    st.m.assign(static_cast<size_t>(n), 0.0f);
    st.v.assign(static_cast<size_t>(n), 0.0f);
  }
  const double norm = grad_global_norm(grads, n);
  float clip = 1.0f;
  if (cfg.grad_clip > 0.0f) {
    const double coef = cfg.grad_clip / (norm + 1e-6);
    if (coef < 1.0) clip = static_cast<float>(coef);
  }
  st.step += 1;
  const float bc1 = 1.0f - std::pow(cfg.beta1, static_cast<float>(st.step));
  const float bc2 = 1.0f - std::pow(cfg.beta2, static_cast<float>(st.step));
  const float step_size = cfg.lr / bc1, bc2_sqrt = std::sqrt(bc2);
  for (const auto& info : layout.infos) {
    const float decay = info.is_matrix ? 1.0f - cfg.lr * cfg.weight_decay : 1.0f;
    tbb::parallel_for(tbb::blocked_range<int64_t>(info.offset, info.offset + info.numel, 1 << 14), [&](const auto& r) {
      for (int64_t i = r.begin(); i < r.end(); ++i) {
        const float g = grads[i] * clip;
        grads[i] = g;
        params[i] *= decay;
        st.m[i] = st.m[i] * cfg.beta1 + g * (1.0f - cfg.beta1);
        st.v[i] = st.v[i] * cfg.beta2 + g * g * (1.0f - cfg.beta2);
        const float denom = std::sqrt(st.v[i]) / bc2_sqrt + cfg.eps;
        params[i] -= step_size * (st.m[i] / denom);
      }
    });
  }
  return norm;
}

}  // namespace fp8rl::models
