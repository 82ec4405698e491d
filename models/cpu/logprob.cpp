// models/cpu/logprob.cpp -- per-token log-probabilities of targets under processed logits,
// and their gradient. d logp_t / d z_v = 1[v = target] - softmax(z)_v over kept tokens.
#include <tbb/parallel_for.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/clones.hpp"
#include "models/cpu/cpu_ops.hpp"
#include "models/cpu/fast_exp.hpp"
#include "models/sampling.hpp"

namespace fp8rl::models {

namespace {
// g[v] = dlogp * (1[v = target] - p_v) * inv_temp, p_v = e^(z[v] - lse) (cpu_exp; 0 where dropped)
FP8RL_VECTOR_CLONES void logprob_grad_row(const float* __restrict z, int64_t V, double lse, int32_t target,
                                          float dlogp, float inv_temp, float* __restrict g) {
  const float ninf = -std::numeric_limits<float>::infinity();
  // two vectorizing passes: p_v into g, then the gradient in place (the target's term after)
  for (int64_t v = 0; v < V; ++v) {
    const float e = cpu_exp(static_cast<float>(static_cast<double>(z[v]) - lse));
    g[v] = z[v] == ninf ? 0.0f : e;
  }
  for (int64_t v = 0; v < V; ++v) g[v] = static_cast<float>(dlogp * (0.0 - static_cast<double>(g[v])) * inv_temp);
  const float e = cpu_exp(static_cast<float>(static_cast<double>(z[target]) - lse));
  const double pt = static_cast<double>(z[target] == ninf ? 0.0f : e);
  g[target] = static_cast<float>(dlogp * (1.0 - pt) * inv_temp);
}

// logits_process of row t, its errors naming the row's token position.
double process_row(const float* logits, int64_t t, int64_t V, const logit_processing& proc, float* z,
                   std::vector<int32_t>& work) {
  try {
    return logits_process(logits + t * V, V, proc, z, work);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("logprob of token position " + std::to_string(t) + ": " + e.what());
  }
}
}  // namespace

void cpu_logprob_forward(const float* logits, const int32_t* targets, int64_t T, int64_t V, const logit_processing& proc,
                         float* logp, float* entropy) {
  tbb::parallel_for(int64_t{0}, T, [&](int64_t t) {
    std::vector<float> z(static_cast<size_t>(V));
    std::vector<int32_t> work;
    if (targets[t] < 0) {
      logp[t] = 0.0f;
      if (entropy) entropy[t] = 0.0f;
      return;
    }
    const double lse = process_row(logits, t, V, proc, z.data(), work);
    const float zt = z[targets[t]];
    logp[t] = std::isinf(zt) ? -std::numeric_limits<float>::infinity() : static_cast<float>(zt - lse);
    if (entropy) {
      double h = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        if (std::isinf(z[v])) continue;
        const double lp = z[v] - lse;
        h -= std::exp(lp) * lp;
      }
      entropy[t] = static_cast<float>(h);
    }
  });
}

void cpu_logprob_backward(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                          const logit_processing& proc, const float* dlogp, float* dlogits) {
  const float inv_temp = (proc.temperature != 1.0f && proc.temperature != 0.0f) ? 1.0f / proc.temperature : 1.0f;
  tbb::parallel_for(int64_t{0}, T, [&](int64_t t) {
    float* g = dlogits + t * V;
    if (targets[t] < 0 || dlogp[t] == 0.0f) {
      std::fill(g, g + V, 0.0f);
      return;
    }
    std::vector<float> z(static_cast<size_t>(V));
    std::vector<int32_t> work;
    const double lse = process_row(logits, t, V, proc, z.data(), work);
    logprob_grad_row(z.data(), V, lse, targets[t], dlogp[t], inv_temp, g);
  });
}

}  // namespace fp8rl::models
