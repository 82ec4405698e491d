// models/cpu/kv_cache.cpp -- the CPU KV cache (F32 / BF16 / FP8 storage) and cached attention.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "models/cpu/cpu_backend.hpp"
#include "models/cpu/cpu_ops.hpp"
#include "quant/fp8.hpp"

namespace fp8rl::models {
namespace {

struct cpu_kv_cache final : kv_cache {
  // storage per (slot, layer, kv head), in element units: K in key slabs [ctx_pad / 16][D][16]
  // (each slab of 16 positions one contiguous K^T block: decode reads it as one stream), then
  // V [max_ctx][D]; ctx_pad = max_ctx rounded up to kAttnSlab
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> fp8;
  std::vector<float> kscale, vscale;  // FP8: [slot][layer][kv][ctx_pad] scale each entry was written with (0 where never written)
  std::vector<uint8_t> subnormal;     // FP8: [slot][layer][kv][ctx_pad / 16] attn_kv_source::subnormal flags (only ever set)
  int64_t esize() const { return dtype == kv_dtype::f32 ? 4 : dtype == kv_dtype::bf16 ? 2 : 1; }
  int64_t ctx_pad() const { return (max_ctx + kAttnSlab - 1) / kAttnSlab * kAttnSlab; }
  int64_t block() const { return head_dim * (ctx_pad() + max_ctx); }
  int64_t key_at(int64_t p, int64_t d) const { return (p / kAttnSlab * head_dim + d) * kAttnSlab + p % kAttnSlab; }
  int64_t value_at(int64_t p, int64_t d) const { return head_dim * ctx_pad() + p * head_dim + d; }
  int64_t base(int64_t slot, int64_t layer, int64_t g) const { return ((slot * layers + layer) * kv_heads + g) * block(); }
  int64_t sbase(int64_t slot, int64_t layer, int64_t g) const { return ((slot * layers + layer) * kv_heads + g) * ctx_pad(); }
  int64_t bytes() const override {
    return slots * layers * kv_heads * block() * esize() + static_cast<int64_t>((kscale.size() + vscale.size()) * 4) +
           static_cast<int64_t>(subnormal.size());
  }
};

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
    c->kscale.assign(static_cast<size_t>(slots * layers * KV * c->ctx_pad()), 0.0f);
    c->vscale.assign(c->kscale.size(), 0.0f);
    c->subnormal.assign(c->kscale.size() / kAttnSlab, 0);
  }
  return c;
}

// Values (tokens x KV heads x D) from which cpu_kv_cache_write runs its heads in parallel.
constexpr int64_t kKvWriteParallelMin = 2048;

// Checks first (the first bad token, head and element in order, whatever the threads), then
// writes each KV head's tokens, a task per head from kKvWriteParallelMin values on: the heads'
// storage is disjoint, and a head's tokens keep their order. A batched step's writes scatter over
// 16-32 lines per token and head (the K slab's rows) that the weights streamed since have
// evicted; serial, they took ~1 us each (batch 16: 1.3-2.8 ms of a ~90 ms step on Zen 5). A
// decode step's few hundred values are written inline.
int64_t cpu_kv_cache_write(kv_cache& cache, int64_t layer, const kv_step& st, const float* k, const float* v,
                           const float* k_scale, const float* v_scale) {
  auto& c = static_cast<cpu_kv_cache&>(cache);
  const int64_t KV = c.kv_heads, D = c.head_dim, M = c.max_ctx;
  if (c.dtype == kv_dtype::fp8 && (!k_scale || !v_scale))
    throw std::invalid_argument("kv_cache_write: FP8 cache needs K/V scales (the snapshot has none)");
  for (int64_t t = 0; t < st.T; ++t) {
    const int64_t slot = st.slot[t], p = st.pos[t];
    if (slot < 0 || slot >= c.slots || p < 0 || p >= M) throw std::out_of_range("kv_cache_write: slot/pos outside the cache");
    if (c.dtype != kv_dtype::fp8) continue;
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t d = 0; d < 2 * D; ++d) {
        const float x = d < D ? k[(t * KV + g) * D + d] : v[(t * KV + g) * D + d - D];
        if (!std::isfinite(x))  // the encoder would store NaN as 0x7F, Inf as 448
          throw slot_error("kv_cache_write: layer " + std::to_string(layer) + ", KV head " + std::to_string(g) + ", slot " +
                               std::to_string(slot) + ", position " + std::to_string(p) + ": " + (d < D ? "K" : "V") + "[" +
                               std::to_string(d % D) + "] is " + std::to_string(x) + " (not finite; FP8 K/V cache)",
                           slot);
      }
  }
  std::vector<int64_t> saturated(static_cast<size_t>(KV), 0);
  const size_t per_head = c.dtype == kv_dtype::fp8 ? static_cast<size_t>(2 * D) : 0;
  std::vector<float> scaled_all(per_head * static_cast<size_t>(KV));  // FP8: head g's K then V / scale
  std::vector<uint8_t> codes_all(scaled_all.size());
  auto write_head = [&](int64_t g) {
    float* scaled = scaled_all.data() + g * per_head;
    uint8_t* codes = codes_all.data() + g * per_head;
    for (int64_t t = 0; t < st.T; ++t) {
      const int64_t slot = st.slot[t], p = st.pos[t];
      const float* kt = k + (t * KV + g) * D;
      const float* vt = v + (t * KV + g) * D;
      const int64_t b = c.base(slot, layer, g);
      if (c.dtype == kv_dtype::fp8) {  // x / scale, encoded by the array encoder (= e4m3_from_float, saturating)
        for (int64_t d = 0; d < D; ++d) {
          scaled[d] = kt[d] / k_scale[g];
          scaled[D + d] = vt[d] / v_scale[g];
        }
        // clipped by the saturation: beyond 464 (448 < |x| <= 464 rounds to 448 in any mode; OCP's
        // non-saturating encoders give NaN above it, fp8-numerics.md §2.2 and the §2.3 table)
        for (int64_t d = 0; d < 2 * D; ++d) saturated[g] += std::fabs(scaled[d]) > 464.0f;
        quant::e4m3_encode_array(scaled, 2 * D, codes);
        for (int64_t d = 0; d < D; ++d) {
          c.fp8[b + c.key_at(p, d)] = codes[d];
          c.fp8[b + c.value_at(p, d)] = codes[D + d];
        }
        c.kscale[c.sbase(slot, layer, g) + p] = k_scale[g];
        c.vscale[c.sbase(slot, layer, g) + p] = v_scale[g];
        const uint8_t flags = (quant::e4m3_any_subnormal(codes, D) ? kSubnormalK : 0) |
                              (quant::e4m3_any_subnormal(codes + D, D) ? kSubnormalV : 0);
        c.subnormal[(c.sbase(slot, layer, g) + p) / kAttnSlab] |= flags;
        continue;
      }
      for (int64_t d = 0; d < D; ++d) {
        const int64_t ki = b + c.key_at(p, d), vi = b + c.value_at(p, d);
        if (c.dtype == kv_dtype::f32) {
          c.f32[ki] = kt[d];
          c.f32[vi] = vt[d];
        } else {
          c.bf16[ki] = quant::bf16_from_float(kt[d]);
          c.bf16[vi] = quant::bf16_from_float(vt[d]);
        }
      }
    }
  };
  // a task per KV head where there is work for it (batched steps); a decode step's few hundred
  // values are written inline (the fork cost more than the write: 4-9 us per layer)
  if (st.T * KV * D >= kKvWriteParallelMin) tbb::parallel_for(int64_t{0}, KV, write_head);
  else for (int64_t g = 0; g < KV; ++g) write_head(g);
  int64_t total = 0;
  for (int64_t n : saturated) total += n;
  return total;
}

int64_t cpu_attention_cached(const kv_cache& cache, int64_t layer, const kv_step& st, const float* q, int64_t H,
                             precision operand, const float* q_scale, float* out) {
  const auto& c = static_cast<const cpu_kv_cache&>(cache);
  const int64_t KV = c.kv_heads, D = c.head_dim, G = H / KV;
  int64_t saturated = 0;  // FP8 query elements clipped (cpu_kv_cache_write's rule)
  if (q_scale)  // FP8 queries: the encoder would saturate Inf to 448 and store NaN as 0x7F
    for (int64_t row = 0; row < st.T * H; ++row) {  // branch-free per row (it vectorizes), then the check
      const float* qr = q + row * D;
      const float s = q_scale[row % H];
      int64_t clipped = 0, bad = 0;
      for (int64_t d = 0; d < D; ++d) {
        clipped += std::fabs(qr[d] / s) > 464.0f;
        bad += !std::isfinite(qr[d]);
      }
      saturated += clipped;
      const int64_t t = row / H;
      for (int64_t d = 0; bad && d < D; ++d)
        if (!std::isfinite(qr[d]))
          throw slot_error("attention: layer " + std::to_string(layer) + ", head " + std::to_string(row % H) + ", slot " +
                               std::to_string(st.slot[t]) + ", position " + std::to_string(st.pos[t]) + ": Q[" +
                               std::to_string(d) + "] is " + std::to_string(qr[d]) + " (not finite; FP8 attention)",
                           st.slot[t]);
    }
  std::vector<attn_rounding> rq(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h) rq[h] = {operand, q_scale ? q_scale[h] : 0.0f};
  tbb::parallel_for(int64_t{0}, st.T * KV, [&](int64_t i) {
    const int64_t t = i / KV, g = i % KV, slot = st.slot[t], n = st.pos[t] + 1;
    const int64_t b = c.base(slot, layer, g), sb = c.sbase(slot, layer, g);
    attn_kv_source kv;
    kv.dtype = c.dtype;
    auto head = [&](const auto* storage) {  // the head's key slabs, then its values
      kv.keys = storage + b;
      kv.values = storage + b + c.value_at(0, 0);
    };
    switch (c.dtype) {
      case kv_dtype::f32: head(c.f32.data()); break;
      case kv_dtype::bf16: head(c.bf16.data()); break;
      case kv_dtype::fp8:
        head(c.fp8.data());
        kv.kscale = c.kscale.data() + sb;
        kv.vscale = c.vscale.data() + sb;
        kv.subnormal = c.subnormal.data() + sb / kAttnSlab;
        break;
    }
    // per-thread scratch, grown not reallocated (a fresh vector per (token, head) costs a memset)
    thread_local std::vector<float> scratch;
    const int64_t need = cpu_attn_group_scratch(n, D);
    if (scratch.size() < static_cast<size_t>(need)) scratch.resize(static_cast<size_t>(need));
    cpu_attn_group(q + (t * H + g * G) * D, D, rq.data() + g * G, G, kv, n, D, operand, out + (t * H + g * G) * D, D,
                   scratch.data());
  });
  return saturated;
}

}  // namespace fp8rl::models
