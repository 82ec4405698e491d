// models/cpu/kv_cache.cpp -- the CPU KV cache (F32 / BF16 / FP8 storage) and cached attention.
#include <tbb/parallel_for.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "models/cpu/cpu_backend.hpp"
#include "models/cpu/cpu_ops.hpp"
#include "quant/fp8.hpp"

namespace fp8rl::models {
namespace {

struct cpu_kv_cache final : kv_cache {
  // storage per (slot, layer, kv head): K^T [D][max_ctx] then V [max_ctx][D], in element units
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> fp8;
  std::vector<float> kscale, vscale;  // FP8: [slot][layer][kv][max_ctx] scale each entry was written with
  int64_t esize() const { return dtype == kv_dtype::f32 ? 4 : dtype == kv_dtype::bf16 ? 2 : 1; }
  int64_t block() const { return 2 * head_dim * max_ctx; }
  int64_t base(int64_t slot, int64_t layer, int64_t g) const { return ((slot * layers + layer) * kv_heads + g) * block(); }
  int64_t sbase(int64_t slot, int64_t layer, int64_t g) const { return ((slot * layers + layer) * kv_heads + g) * max_ctx; }
  int64_t bytes() const override {
    return slots * layers * kv_heads * block() * esize() + static_cast<int64_t>((kscale.size() + vscale.size()) * 4);
  }
};

// K^T [D][n] and V [n][D] of positions 0..n-1 widened to FP32 (BF16 exact; FP8 times the scale
// each position was written with).
FP8RL_VECTOR_CLONES void widen(const cpu_kv_cache& c, int64_t b, int64_t sb, int64_t n, float* kt, float* vv) {
  const int64_t D = c.head_dim, M = c.max_ctx;
  if (c.dtype == kv_dtype::bf16) {
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < n; ++j) kt[d * n + j] = quant::bf16_to_float(c.bf16[b + d * M + j]);
    for (int64_t j = 0; j < n * D; ++j) vv[j] = quant::bf16_to_float(c.bf16[b + D * M + j]);
    return;
  }
  const float* ks = c.kscale.data() + sb;
  const float* vs = c.vscale.data() + sb;
  for (int64_t d = 0; d < D; ++d) {  // codes decoded 64 at a time (the per-element table lookup
    float* row = kt + d * n;          // was ~4% of an FP8 decode step), then scaled
    quant::e4m3_decode_array(c.fp8.data() + b + d * M, n, row);
    for (int64_t j = 0; j < n; ++j) row[j] *= ks[j];
  }
  quant::e4m3_decode_array(c.fp8.data() + b + D * M, n * D, vv);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) vv[j * D + d] *= vs[j];
}

}  // namespace

std::unique_ptr<kv_cache> cpu_kv_cache_create(int64_t slots, int64_t layers, int64_t KV, int64_t D, int64_t max_ctx,
                                              kv_dtype dtype) {
  auto c = std::make_unique<cpu_kv_cache>();
  c->slots = slots; c->layers = layers; c->kv_heads = KV; c->head_dim = D; c->max_ctx = max_ctx; c->dtype = dtype;
  const size_t n = static_cast<size_t>(slots * layers * KV * c->block());
  if (dtype == kv_dtype::f32) c->f32.assign(n, 0.0f);
  if (dtype == kv_dtype::bf16) c->bf16.assign(n, 0);
  if (dtype == kv_dtype::fp8) {
    c->fp8.assign(n, 0);
    c->kscale.assign(static_cast<size_t>(slots * layers * KV * max_ctx), 0.0f);
    c->vscale.assign(c->kscale.size(), 0.0f);
  }
  return c;
}

int64_t cpu_kv_cache_write(kv_cache& cache, int64_t layer, const kv_step& st, const float* k, const float* v,
                           const float* k_scale, const float* v_scale) {
  auto& c = static_cast<cpu_kv_cache&>(cache);
  const int64_t KV = c.kv_heads, D = c.head_dim, M = c.max_ctx;
  if (c.dtype == kv_dtype::fp8 && (!k_scale || !v_scale))
    throw std::invalid_argument("kv_cache_write: FP8 cache needs K/V scales (the snapshot has none)");
  int64_t saturated = 0;
  for (int64_t t = 0; t < st.T; ++t) {
    const int64_t slot = st.slot[t], p = st.pos[t];
    if (slot < 0 || slot >= c.slots || p < 0 || p >= M) throw std::out_of_range("kv_cache_write: slot/pos outside the cache");
    for (int64_t g = 0; g < KV; ++g) {
      const float* kt = k + (t * KV + g) * D;
      const float* vt = v + (t * KV + g) * D;
      const int64_t b = c.base(slot, layer, g);
      for (int64_t d = 0; d < D; ++d) {
        const int64_t ki = b + d * M + p, vi = b + D * M + p * D + d;
        switch (c.dtype) {
          case kv_dtype::f32: c.f32[ki] = kt[d]; c.f32[vi] = vt[d]; break;
          case kv_dtype::bf16: c.bf16[ki] = quant::bf16_from_float(kt[d]); c.bf16[vi] = quant::bf16_from_float(vt[d]); break;
          case kv_dtype::fp8: {
            const float ks = kt[d] / k_scale[g], vs = vt[d] / v_scale[g];
            saturated += (std::fabs(ks) > 448.0f) + (std::fabs(vs) > 448.0f);
            c.fp8[ki] = quant::e4m3_from_float(ks);
            c.fp8[vi] = quant::e4m3_from_float(vs);
            break;
          }
        }
      }
      if (c.dtype == kv_dtype::fp8) {
        c.kscale[c.sbase(slot, layer, g) + p] = k_scale[g];
        c.vscale[c.sbase(slot, layer, g) + p] = v_scale[g];
      }
    }
  }
  return saturated;
}

void cpu_attention_cached(const kv_cache& cache, int64_t layer, const kv_step& st, const float* q, int64_t H,
                          precision operand, const float* q_scale, float* out) {
  const auto& c = static_cast<const cpu_kv_cache&>(cache);
  const int64_t KV = c.kv_heads, D = c.head_dim, M = c.max_ctx, G = H / KV;
  tbb::parallel_for(int64_t{0}, st.T * KV, [&](int64_t i) {
    const int64_t t = i / KV, g = i % KV, slot = st.slot[t], n = st.pos[t] + 1;
    const int64_t b = c.base(slot, layer, g);
    // per-thread buffers, grown not reallocated: fresh zero-filled vectors per (token, head)
    // cost a memset of 2 x D x n floats each, every decode step
    thread_local std::vector<float> kt, vv, scratch;
    const auto reserve = [](std::vector<float>& b, int64_t need) {
      if (b.size() < static_cast<size_t>(need)) b.resize(static_cast<size_t>(need));
    };
    reserve(scratch, n + D);
    const float* kp;
    const float* vp;
    int64_t ldk;
    if (c.dtype == kv_dtype::f32) {
      kp = c.f32.data() + b;
      vp = c.f32.data() + b + D * M;
      ldk = M;
    } else {  // widen the used range: K^T [D][n], V [n][D]
      reserve(kt, D * n);
      reserve(vv, n * D);
      widen(c, b, c.sbase(slot, layer, g), n, kt.data(), vv.data());
      kp = kt.data();
      vp = vv.data();
      ldk = n;
    }
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      const attn_rounding rq{operand, q_scale ? q_scale[h] : 0.0f};
      cpu_attn_query(q + (t * H + h) * D, rq, kp, ldk, vp, n, D, operand, out + (t * H + h) * D, scratch.data());
    }
  });
}

}  // namespace fp8rl::models
