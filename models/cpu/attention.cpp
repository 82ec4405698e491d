// models/cpu/attention.cpp -- causal grouped-query attention on packed sequences.
// Forward keeps lse[T,H]; backward recomputes probabilities from it (no T x T cache).
#include <tbb/parallel_for.h>

#include <cmath>
#include <vector>

#include "models/cpu/cpu_backend.hpp"
#include "models/cpu/cpu_ops.hpp"
#include "quant/fp8.hpp"

namespace fp8rl::models {

float cpu_attn_round(float x, const attn_rounding& r) {
  if (r.scale > 0.0f) return quant::e4m3_to_float(quant::e4m3_from_float(x / r.scale)) * r.scale;
  if (r.operand == precision::bf16) return quant::bf16_round(x);
  return x;
}

FP8RL_VECTOR_CLONES float cpu_attn_query(const float* q, const attn_rounding& rq, const float* kt, int64_t ldk, const float* v,
                     int64_t n, int64_t D, precision p_operand, float* out, float* scratch) {
  float* s = scratch;      // [n] scores, then probabilities
  float* qr = scratch + n; // [D]
  for (int64_t d = 0; d < D; ++d) qr[d] = cpu_attn_round(q[d], rq);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {  // s[j] = sum_d q[d] k[j][d], sequential in d for every j
    const float qd = qr[d];
    const float* kd = kt + d * ldk;
    for (int64_t j = 0; j < n; ++j) s[j] = std::fma(qd, kd[j], s[j]);
  }
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = s[j] * scale;
    m = std::max(m, s[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  const attn_rounding rp{p_operand, 0.0f};
  for (int64_t j = 0; j < n; ++j) s[j] = cpu_attn_round(s[j] / sum, rp);
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {  // out[d] = sum_j p[j] v[j][d], sequential in j for every d
    const float pj = s[j];
    const float* vj = v + j * D;
    for (int64_t d = 0; d < D; ++d) out[d] = std::fma(pj, vj[d], out[d]);
  }
  return m + std::log(sum);
}

namespace {

struct kv_view {  // rounded K^T [D][n] and V [n][D] of one sequence and KV head
  std::vector<float> kt, v;
};

void gather_kv(const attn_params& p, const float* k, const float* v, int64_t s0, int64_t n, int64_t g, kv_view& out) {
  const int64_t D = p.D, KV = p.KV;
  const attn_rounding rk{p.operand, p.k_scale ? p.k_scale[g] : 0.0f};
  const attn_rounding rv{p.operand, p.v_scale ? p.v_scale[g] : 0.0f};
  out.kt.resize(static_cast<size_t>(D * n));
  out.v.resize(static_cast<size_t>(n * D));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) {
      out.kt[d * n + j] = cpu_attn_round(k[((s0 + j) * KV + g) * D + d], rk);
      out.v[j * D + d] = cpu_attn_round(v[((s0 + j) * KV + g) * D + d], rv);
    }
}

// Calls fn(seq s, kv head g) for every pair, in parallel.
template <class Fn>
void for_each_seq_group(const attn_params& p, Fn&& fn) {
  tbb::parallel_for(int64_t{0}, p.S * p.KV, [&](int64_t i) { fn(i / p.KV, i % p.KV); });
}

}  // namespace

void cpu_attention_forward(const attn_params& p, const float* q, const float* k, const float* v, float* out, float* lse) {
  const int64_t H = p.H, D = p.D, G = p.H / p.KV;
  for_each_seq_group(p, [&](int64_t s, int64_t g) {
    const int64_t s0 = p.seq_start[s], n = p.seq_start[s + 1] - s0;
    if (n <= 0) return;
    kv_view kv;
    gather_kv(p, k, v, s0, n, g, kv);
    std::vector<float> scratch(static_cast<size_t>(n + D));
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const attn_rounding rq{p.operand, p.q_scale ? p.q_scale[h] : 0.0f};
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = s0 + i;
        lse[t * H + h] = cpu_attn_query(q + (t * H + h) * D, rq, kv.kt.data(), n, kv.v.data(), i + 1, D,
                                        p.operand, out + (t * H + h) * D, scratch.data());
      }
    }
  });
}

void cpu_attention_backward(const attn_params& p, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv) {
  const int64_t H = p.H, KV = p.KV, D = p.D, G = p.H / p.KV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for_each_seq_group(p, [&](int64_t s, int64_t g) {
    const int64_t s0 = p.seq_start[s], n = p.seq_start[s + 1] - s0;
    if (n <= 0) return;
    kv_view kv;
    gather_kv(p, k, v, s0, n, g, kv);
    std::vector<float> dK(static_cast<size_t>(n * D), 0.0f), dV(static_cast<size_t>(n * D), 0.0f);
    std::vector<float> qr(static_cast<size_t>(D)), prob(static_cast<size_t>(n)), ds(static_cast<size_t>(n));
    const attn_rounding rp{p.operand, 0.0f};
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const attn_rounding rq{p.operand, p.q_scale ? p.q_scale[h] : 0.0f};
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = s0 + i;
        const float* qi = q + (t * H + h) * D;
        const float* doi = dout + (t * H + h) * D;
        const float* oi = out + (t * H + h) * D;
        for (int64_t d = 0; d < D; ++d) qr[d] = cpu_attn_round(qi[d], rq);
        float Di = 0.0f;
        for (int64_t d = 0; d < D; ++d) Di += doi[d] * oi[d];
        for (int64_t j = 0; j <= i; ++j) {
          float sc = 0.0f;
          for (int64_t d = 0; d < D; ++d) sc = std::fma(qr[d], kv.kt[d * n + j], sc);
          prob[j] = std::exp(sc * scale - lse[t * H + h]);
          float dp = 0.0f;
          for (int64_t d = 0; d < D; ++d) dp += doi[d] * kv.v[j * D + d];
          ds[j] = prob[j] * (dp - Di) * scale;
        }
        float* dqi = dq + (t * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0.0f;
          for (int64_t j = 0; j <= i; ++j) acc += ds[j] * kv.kt[d * n + j];
          dqi[d] = acc;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const float pj = cpu_attn_round(prob[j], rp);
          for (int64_t d = 0; d < D; ++d) {
            dK[j * D + d] += ds[j] * qr[d];
            dV[j * D + d] += pj * doi[d];
          }
        }
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) {
        dk[((s0 + j) * KV + g) * D + d] = dK[j * D + d];
        dv[((s0 + j) * KV + g) * D + d] = dV[j * D + d];
      }
  });
}

}  // namespace fp8rl::models
