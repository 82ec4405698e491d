// models/cpu/attention.cpp -- causal grouped-query attention on packed sequences.
// Forward keeps lse[T,H]; backward recomputes probabilities from it (no T x T cache).
#include <tbb/parallel_for.h>

#include <algorithm>
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

namespace {
// y[0..n) = fma(a, x, y) elementwise; restrict lets the vectorizer drop alias checks.
[[gnu::always_inline]] inline void row_fma(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = std::fma(a, x[j], y[j]);
}

}  // namespace

FP8RL_VECTOR_CLONES float cpu_attn_query(const float* q, const attn_rounding& rq, const float* kt, int64_t ldk, const float* v,
                     int64_t n, int64_t D, precision p_operand, float* out, float* scratch) {
  float* s = scratch;      // [n] scores, then probabilities
  float* qr = scratch + n; // [D]
  for (int64_t d = 0; d < D; ++d) qr[d] = cpu_attn_round(q[d], rq);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) row_fma(qr[d], kt + d * ldk, s, n);  // s[j] = sum_d q[d] k[j][d], sequential in d
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
  for (int64_t j = 0; j < n; ++j) row_fma(s[j], v + j * D, out, D);  // out[d] = sum_j p[j] v[j][d], sequential in j
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

namespace {

// Rounded K and V of one sequence and KV head in both orientations: [D][n] feeds loops over
// keys j (vectorized across j), [n][D] feeds loops over d.
struct kv_both {
  kv_view t;                 // kt [D][n], v [n][D]
  std::vector<float> k, vt;  // k [n][D], vt [D][n]
};

constexpr int64_t kRowBlock = 8;  // query rows per block: K, V, dK, dV rows are read once per block

// Backward of query rows i0 .. i0+B-1 (row r sees keys 0..i0+r) of one head. Per output element
// the order is the unblocked one: scores are a sequential fma over d (as the forward computes
// them), dq sums keys in increasing j, and dK/dV add rows in increasing i.
//   q, dout, out, dq: row r at +r*ld; lse[r] at +r*ldl; s, dp: scratch [B][nk]
FP8RL_VECTOR_CLONES void attn_rows_backward(const float* qr, const float* dout, const float* Di, const float* lse,
                                           int64_t B, int64_t i0, float scale, const kv_both& kv, int64_t ldn,
                                           int64_t D, const attn_rounding& rp, float* s, float* dp, float* dq,
                                           int64_t ldq, float* dK, float* dV) {
  const int64_t nk = i0 + B;  // keys any row of the block sees
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j < nk; ++j) s[r * nk + j] = 0.0f, dp[r * nk + j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kv.t.kt.data() + d * ldn;
    const float* vd = kv.vt.data() + d * ldn;
    for (int64_t r = 0; r < B; ++r) {
      const float qd = qr[r * D + d], od = dout[r * ldq + d];
      row_fma(qd, kd, s + r * nk, nk);
      row_fma(od, vd, dp + r * nk, nk);
    }
  }
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j <= i0 + r; ++j) {
      const float prob = std::exp(s[r * nk + j] * scale - lse[r]);
      s[r * nk + j] = cpu_attn_round(prob, rp);              // the probability the forward used with V
      dp[r * nk + j] = prob * (dp[r * nk + j] - Di[r]) * scale;  // dS
    }
  for (int64_t r = 0; r < B; ++r)
    for (int64_t d = 0; d < D; ++d) dq[r * ldq + d] = 0.0f;
  for (int64_t j = 0; j < nk; ++j) {
    const float* kj = kv.k.data() + j * D;
    float* dkj = dK + j * D;
    float* dvj = dV + j * D;
    for (int64_t r = j > i0 ? j - i0 : 0; r < B; ++r) {  // rows that see key j
      const float dsj = dp[r * nk + j], pj = s[r * nk + j];
      row_fma(dsj, kj, dq + r * ldq, D);
      row_fma(dsj, qr + r * D, dkj, D);
      row_fma(pj, dout + r * ldq, dvj, D);
    }
  }
}

}  // namespace

void cpu_attention_backward(const attn_params& p, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv) {
  const int64_t H = p.H, KV = p.KV, D = p.D, G = p.H / p.KV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for_each_seq_group(p, [&](int64_t s, int64_t g) {
    const int64_t s0 = p.seq_start[s], n = p.seq_start[s + 1] - s0;
    if (n <= 0) return;
    kv_both kv;
    gather_kv(p, k, v, s0, n, g, kv.t);
    kv.k.resize(static_cast<size_t>(n * D));
    kv.vt.resize(static_cast<size_t>(D * n));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) {
        kv.k[j * D + d] = kv.t.kt[d * n + j];
        kv.vt[d * n + j] = kv.t.v[j * D + d];
      }
    std::vector<float> dK(static_cast<size_t>(n * D), 0.0f), dV(static_cast<size_t>(n * D), 0.0f);
    std::vector<float> qr(static_cast<size_t>(kRowBlock * D)), sc(static_cast<size_t>(kRowBlock * n)),
        dp(static_cast<size_t>(kRowBlock * n)), Di(kRowBlock), lr(kRowBlock);
    const attn_rounding rp{p.operand, 0.0f};
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const attn_rounding rq{p.operand, p.q_scale ? p.q_scale[h] : 0.0f};
      for (int64_t i0 = 0; i0 < n; i0 += kRowBlock) {
        const int64_t B = std::min(kRowBlock, n - i0);
        for (int64_t r = 0; r < B; ++r) {
          const int64_t t = s0 + i0 + r;
          const float* qi = q + (t * H + h) * D;
          const float* doi = dout + (t * H + h) * D;
          const float* oi = out + (t * H + h) * D;
          for (int64_t d = 0; d < D; ++d) qr[r * D + d] = cpu_attn_round(qi[d], rq);
          float di = 0.0f;
          for (int64_t d = 0; d < D; ++d) di += doi[d] * oi[d];
          Di[r] = di;
          lr[r] = lse[t * H + h];
        }
        const int64_t row0 = ((s0 + i0) * H + h) * D;
        attn_rows_backward(qr.data(), dout + row0, Di.data(), lr.data(), B, i0, scale, kv, n, D, rp, sc.data(),
                           dp.data(), dq + row0, H * D, dK.data(), dV.data());
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
