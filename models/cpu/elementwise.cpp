// models/cpu/elementwise.cpp -- embedding, RMSNorm, RoPE, SwiGLU on the CPU (oneTBB over rows).
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/cpu/cpu_backend.hpp"
#include "models/cpu/cpu_ops.hpp"
#include "models/clones.hpp"
#include "models/lanes.hpp"
#include "models/cpu/fast_exp.hpp"

namespace fp8rl::models {

void cpu_add_inplace(float* y, const float* x, int64_t n) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14), [&](const auto& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) y[i] += x[i];
  });
}

void cpu_embedding_forward(const float* wte, const int32_t* tokens, int64_t T, int64_t C, float* out) {
  tbb::parallel_for(int64_t{0}, T, [&](int64_t t) {
    const float* src = wte + static_cast<int64_t>(tokens[t]) * C;
    std::copy(src, src + C, out + t * C);
  });
}

void cpu_embedding_backward(const float* dout, const int32_t* tokens, int64_t T, int64_t C, float* dwte) {
  // columns in parallel, tokens in order: the same sums whatever the thread count
  const int64_t chunk = 64;
  tbb::parallel_for(int64_t{0}, (C + chunk - 1) / chunk, [&](int64_t b) {
    const int64_t c0 = b * chunk, c1 = std::min(C, c0 + chunk);
    for (int64_t t = 0; t < T; ++t) {
      float* dst = dwte + static_cast<int64_t>(tokens[t]) * C;
      for (int64_t c = c0; c < c1; ++c) dst[c] += dout[t * C + c];
    }
  });
}

namespace {
// One row: r = 1 / sqrt(mean(x^2) + eps) (double; the sum in models/lanes.hpp's fixed order,
// shared by training and decode), out = w * (x * r).
FP8RL_VECTOR_CLONES float rmsnorm_row(const float* __restrict x, const float* __restrict w, int64_t C, float eps,
                                      float* __restrict out) {
  const float r = static_cast<float>(1.0 / std::sqrt(lanes_sum_squares(x, C) / static_cast<double>(C) + eps));
  for (int64_t c = 0; c < C; ++c) out[c] = w[c] * (x[c] * r);
  return r;
}

// One row's dx += dout * w * r - x * k, k = mean(dout * w * x) * r^3.
FP8RL_VECTOR_CLONES void rmsnorm_row_backward(const float* __restrict dt, const float* __restrict x,
                                              const float* __restrict w, float r, int64_t C, float* __restrict dx) {
  const float k = static_cast<float>(lanes_sum_product3(dt, w, x, C) / static_cast<double>(C)) * r * r * r;
  for (int64_t c = 0; c < C; ++c) dx[c] += dt[c] * w[c] * r - x[c] * k;
}

// dw[c0, c1) += sum over rows t (in order) of dout * x * rstd[t].
FP8RL_VECTOR_CLONES void rmsnorm_dw_columns(const float* __restrict dout, const float* __restrict x,
                                            const float* __restrict rstd, int64_t T, int64_t C, int64_t c0, int64_t c1,
                                            float* __restrict dw) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = c0; c < c1; ++c) dw[c] += dout[t * C + c] * x[t * C + c] * rstd[t];
}
}  // namespace

void cpu_rmsnorm_forward(const float* x, const float* w, int64_t T, int64_t C, float eps, float* out, float* rstd) {
  tbb::parallel_for(int64_t{0}, T, [&](int64_t t) { rstd[t] = rmsnorm_row(x + t * C, w, C, eps, out + t * C); });
}

void cpu_rmsnorm_backward(const float* dout, const float* x, const float* w, const float* rstd, int64_t T, int64_t C,
                          float* dx, float* dw) {
  // dx: rows in parallel
  tbb::parallel_for(int64_t{0}, T,
                    [&](int64_t t) { rmsnorm_row_backward(dout + t * C, x + t * C, w, rstd[t], C, dx + t * C); });
  // dw: columns in parallel, rows in order
  const int64_t chunk = 64;
  tbb::parallel_for(int64_t{0}, (C + chunk - 1) / chunk, [&](int64_t b) {
    rmsnorm_dw_columns(dout, x, rstd, T, C, b * chunk, std::min(C, b * chunk + chunk), dw);
  });
}

namespace {
// cos/sin of pos * inv_freq[i] for positions [0, npos) and i < D/2, computed once per inv_freq
// and grown on demand: the same FP32 values the per-call computation gave (std::cos/std::sin of
// the same float angle), without 2 libm calls per position, pair and call.
//   cs, sn: [npos][D/2]
struct rope_table {
  std::vector<float> inv_freq;
  int64_t npos = 0;
  std::vector<float> cs, sn;
};

std::shared_ptr<const rope_table> rope_table_build(const std::vector<float>& inv_freq, int64_t npos) {
  auto t = std::make_shared<rope_table>();
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  t->inv_freq = inv_freq, t->npos = npos;
  t->cs.resize(static_cast<size_t>(npos * half));
  t->sn.resize(static_cast<size_t>(npos * half));
  // HF Llama: angle = pos * inv_freq (FP32)
  tbb::parallel_for(int64_t{0}, npos, [&](int64_t p) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(p) * inv_freq[i];
      t->cs[p * half + i] = std::cos(a);
      t->sn[p * half + i] = std::sin(a);
    }
  });
  return t;
}

// The table for inv_freq covering positions [0, npos); a few live frequency sets per process.
std::shared_ptr<const rope_table> rope_table_get(const std::vector<float>& inv_freq, int64_t npos) {
  static std::mutex mu;
  static std::vector<std::shared_ptr<const rope_table>> tables;
  std::lock_guard lock(mu);
  for (auto& t : tables)
    if (t->inv_freq == inv_freq) {
      if (t->npos < npos) t = rope_table_build(inv_freq, std::max(npos, 2 * t->npos));
      return t;
    }
  tables.push_back(rope_table_build(inv_freq, std::max<int64_t>(npos, 256)));
  return tables.back();
}

// x[nh][D] of one token rotated by (cs, sn)[half] (rotate_half); inverse uses -sin.
FP8RL_VECTOR_CLONES void rope_token(float* __restrict x, const float* __restrict cs, const float* __restrict sn,
                                    int64_t nh, int64_t half, bool inverse) {
  for (int64_t h = 0; h < nh; ++h) {
    float* v = x + h * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half], s = inverse ? -sn[i] : sn[i];
      v[i] = a * cs[i] - b * s;
      v[i + half] = b * cs[i] + a * s;
    }
  }
}
}  // namespace

void cpu_rope(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, const std::vector<float>& inv_freq, bool inverse) {
  const int64_t half = D / 2;
  if (static_cast<int64_t>(inv_freq.size()) != half)
    throw std::invalid_argument("rope: " + std::to_string(inv_freq.size()) + " frequencies for head_dim " + std::to_string(D));
  int64_t npos = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (pos[t] < 0) throw std::invalid_argument("rope: negative position " + std::to_string(pos[t]));
    npos = std::max<int64_t>(npos, int64_t{pos[t]} + 1);
  }
  if (T == 0) return;
  const auto tab = rope_table_get(inv_freq, npos);
  tbb::parallel_for(int64_t{0}, T, [&](int64_t t) {
    const int64_t p = pos[t];
    rope_token(x + t * nh * D, tab->cs.data() + p * half, tab->sn.data() + p * half, nh, half, inverse);
  });
}

namespace {
FP8RL_VECTOR_CLONES void swiglu_forward_range(const float* __restrict gate, const float* __restrict up, int64_t i0,
                                              int64_t i1, float* __restrict h) {
  for (int64_t i = i0; i < i1; ++i) {
    const float g = gate[i];
    h[i] = g / (1.0f + cpu_exp(-g)) * up[i];
  }
}

FP8RL_VECTOR_CLONES void swiglu_backward_range(const float* __restrict dh, const float* __restrict gate,
                                               const float* __restrict up, int64_t i0, int64_t i1,
                                               float* __restrict dgate, float* __restrict dup) {
  for (int64_t i = i0; i < i1; ++i) {
    const float g = gate[i], s = 1.0f / (1.0f + cpu_exp(-g)), silu = g * s;
    dup[i] = dh[i] * silu;
    dgate[i] = dh[i] * up[i] * s * (1.0f + g * (1.0f - s));
  }
}
}  // namespace

// Grain 16384 values (chunks of 8192-16384): a decode step's few thousand run on the calling thread
// (with grain 4096 one token's 5632 split into two forked tasks: 4.4 us per layer; inline ~1).
constexpr int64_t kSwigluGrain = 1 << 14;

void cpu_swiglu_forward(const float* gate, const float* up, int64_t n, float* h) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kSwigluGrain),
                    [&](const auto& r) { swiglu_forward_range(gate, up, r.begin(), r.end(), h); });
}

void cpu_swiglu_backward(const float* dh, const float* gate, const float* up, int64_t n, float* dgate, float* dup) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kSwigluGrain),
                    [&](const auto& r) { swiglu_backward_range(dh, gate, up, r.begin(), r.end(), dgate, dup); });
}

}  // namespace fp8rl::models
