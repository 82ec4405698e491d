// models/sampling.cpp -- the one definition of the sampled distribution.
#include "models/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#include "models/clones.hpp"
#include "models/cpu/fast_exp.hpp"

namespace fp8rl::models {

namespace {
// max of z[0..n) in 16 lanes (NaN never replaces a lane, as std::max(m, z) keeps m); -inf if n = 0.
FP8RL_VECTOR_CLONES float max_of(const float* __restrict z, int64_t n) {
  float lane[16];
  for (float& l : lane) l = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
  for (; v + 16 <= n; v += 16)
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) lane[l] = lane[l] < z[v + l] ? z[v + l] : lane[l];
  for (int l = 0; v < n; ++v, ++l) lane[l] = lane[l] < z[v] ? z[v] : lane[l];
  float m = lane[0];
  for (int l = 1; l < 16; ++l) m = m < lane[l] ? lane[l] : m;
  return m;
}

// sum over v of e^(z[v] - m), each term cpu_exp in FP32 (-inf entries: exactly 0), summed in
// double in 8 lanes (lane v % 8) added in lane order: one fixed order. The terms go through a
// small buffer first: the exp loop and the lane sums vectorize separately (fused, GCC does not).
FP8RL_VECTOR_CLONES double sum_exp(const float* __restrict z, int64_t n, float m) {
  const float ninf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kChunk = 256;  // a multiple of 8: chunks keep the lane of every v
  alignas(64) float e[kChunk];
  double lane[8] = {};
  for (int64_t v0 = 0; v0 < n; v0 += kChunk) {
    const int64_t w = std::min(kChunk, n - v0);
    for (int64_t i = 0; i < w; ++i) {
      const float x = cpu_exp(z[v0 + i] - m);
      e[i] = z[v0 + i] == ninf ? 0.0f : x;
    }
    int64_t i = 0;
    for (; i + 8 <= w; i += 8)
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(e[i + l]);
    for (int l = 0; i < w; ++i, ++l) lane[l] += static_cast<double>(e[i]);
  }
  double s = 0.0;
  for (double x : lane) s += x;
  return s;
}

// Whether some z[v] is NaN or +inf (-inf, a dropped token, is not), in one pass that vectorizes.
FP8RL_VECTOR_CLONES bool any_nan_or_pos_inf(const float* __restrict z, int64_t n) {
  int bad = 0;
  for (int64_t v = 0; v < n; ++v) bad |= !(z[v] <= std::numeric_limits<float>::max());
  return bad != 0;
}

// Refuses logits no distribution comes from (a NaN or +inf logit or logit / T: diverged weights or
// activations, or a temperature small enough to overflow FP32; or no finite logit at all): the
// sampler would otherwise return the last token with a NaN logprob.
void check_processed(const float* logits, const float* z, int64_t V, bool scaled, float temperature, float m) {
  if (any_nan_or_pos_inf(z, V)) {
    int64_t v = 0;
    while (z[v] <= std::numeric_limits<float>::max()) ++v;
    char t[64];
    std::snprintf(t, sizeof t, " (%g at temperature %g)", double(z[v]), double(temperature));
    throw std::invalid_argument("logit of token " + std::to_string(v) + " is " + std::to_string(logits[v]) +
                                (scaled ? std::string(t) : std::string()) +
                                ": not a finite number to sample from");
  }
  if (m == -std::numeric_limits<float>::infinity()) throw std::invalid_argument("no token has a finite logit");
}
}  // namespace

double logits_process(const float* logits, int64_t V, const logit_processing& p, float* z,
                      std::vector<int32_t>& work) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool scale = p.temperature != 1.0f && p.temperature != 0.0f;
  for (int64_t v = 0; v < V; ++v) z[v] = scale ? logits[v] / p.temperature : logits[v];
  const float m = max_of(z, V);  // top-k keeps every z >= its threshold, so the max too
  check_processed(logits, z, V, scale, p.temperature, m);
  if (p.top_k > 0 && p.top_k < V) {
    work.resize(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) work[v] = static_cast<int32_t>(v);
    std::nth_element(work.begin(), work.begin() + (p.top_k - 1), work.end(),
                     [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    const float thr = z[work[p.top_k - 1]];
    for (int64_t v = 0; v < V; ++v)
      if (z[v] < thr) z[v] = ninf;
  }
  double lse = m + std::log(sum_exp(z, V, m));
  if (p.top_p < 1.0f) {
    work.resize(static_cast<size_t>(V));
    int64_t n = 0;
    for (int64_t v = 0; v < V; ++v)
      if (z[v] != ninf) work[n++] = static_cast<int32_t>(v);
    std::sort(work.begin(), work.begin() + n, [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    double cum = 0.0;
    int64_t keep = n;
    for (int64_t i = 0; i < n; ++i) {
      cum += std::exp(static_cast<double>(z[work[i]]) - lse);
      if (cum >= p.top_p) { keep = i + 1; break; }
    }
    for (int64_t i = keep; i < n; ++i) z[work[i]] = ninf;
    lse = m + std::log(sum_exp(z, V, m));
  }
  return lse;
}

int32_t sample_processed(const float* z, int64_t V, double lse, double u) {
  double cum = 0.0;
  int32_t last = -1;
  for (int64_t v = 0; v < V; ++v) {
    if (std::isinf(z[v]) && z[v] < 0) continue;
    last = static_cast<int32_t>(v);
    cum += std::exp(static_cast<double>(z[v]) - lse);
    if (u < cum) return last;
  }
  return last;  // u rounding past the total mass: the last kept token
}

int32_t argmax_logits(const float* logits, int64_t V) {
  int32_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (logits[v] > logits[best]) best = static_cast<int32_t>(v);
  return best;
}

std::string logit_processing_problem(const logit_processing& p) {
  char t[32];
  std::snprintf(t, sizeof t, "%g", double(p.temperature));  // (std::to_string printed 1e-40 as 0.000000)
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
    return "temperature " + std::string(t) + " is not a finite number >= 0";
  // below it, logit / T overflows FP32 for logits of a sane model (|logit| < 3e33): one such request
  // failed every step of the batch it shared (vLLM samples greedily below the same 1e-5)
  if (p.temperature > 0.0f && p.temperature < kMinTemperature) return "temperature " + std::string(t) + " is below 1e-05 (0: greedy)";
  if (p.top_k < 0) return "top_k " + std::to_string(p.top_k) + " is negative (0 keeps every token)";
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return "top_p " + std::to_string(p.top_p) + " is outside (0, 1]";
  return "";
}

}  // namespace fp8rl::models
