// models/cpu/kv_cache.cpp -- the CPU KV cache (F32 / BF16 / FP8 storage) and cached attention.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>
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
  std::vector<float> kscale, vscale;  // FP8: [slot][layer][kv][max_ctx] scale each entry was written with
  int64_t esize() const { return dtype == kv_dtype::f32 ? 4 : dtype == kv_dtype::bf16 ? 2 : 1; }
  int64_t ctx_pad() const { return (max_ctx + kAttnSlab - 1) / kAttnSlab * kAttnSlab; }
  int64_t block() const { return head_dim * (ctx_pad() + max_ctx); }
  int64_t key_at(int64_t p, int64_t d) const { return (p / kAttnSlab * head_dim + d) * kAttnSlab + p % kAttnSlab; }
  int64_t value_at(int64_t p, int64_t d) const { return head_dim * ctx_pad() + p * head_dim + d; }
  int64_t base(int64_t slot, int64_t layer, int64_t g) const { return ((slot * layers + layer) * kv_heads + g) * block(); }
  int64_t sbase(int64_t slot, int64_t layer, int64_t g) const { return ((slot * layers + layer) * kv_heads + g) * max_ctx; }
  int64_t bytes() const override {
    return slots * layers * kv_heads * block() * esize() + static_cast<int64_t>((kscale.size() + vscale.size()) * 4);
  }
};

// One (slot, layer, KV head) of the cache, as cpu_attn_group reads it (the attn_kv_source context).
struct head_view {
  const cpu_kv_cache* c;
  int64_t b, sb;  // element offset of the head's key slabs, then V; offset of its scales
};

// One stored element widened: BF16 exactly, FP8 code times the scale its position was written with.
[[gnu::always_inline]] inline float widen1(float x, float) { return x; }
[[gnu::always_inline]] inline float widen1(uint16_t x, float) { return quant::bf16_to_float(x); }
[[gnu::always_inline]] inline float widen1(uint8_t x, float s) { return quant::e4m3_to_float_arith(x) * s; }

// The scale position j was written with (FP8); other dtypes have none (s is null, never read).
template <class T>
[[gnu::always_inline]] inline float scale_at(const float* s, int64_t j) {
  if constexpr (std::is_same_v<T, uint8_t>) return s[j];
  return 1.0f;
}

// out[i] = in[i] widened for i < n: one flat loop, so that the widening vectorizes (a 16-key row
// loop did not: GCC used 128-bit vectors and masks, and widening was half of decode attention's
// time). FP8 codes widen with their scales in one pass (quant::e4m3_decode_scale_cols / _rows:
// decoding to an array, then scaling it, took 41% of FP8-cache attention at batch 16, Zen 5).
[[gnu::always_inline]] inline void widen_array(const float* in, int64_t n, float* out) { std::copy_n(in, n, out); }
[[gnu::always_inline]] inline void widen_array(const uint16_t* in, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = quant::bf16_to_float(in[i]);
}

// kt[d][j] = key j0 + j (j < w; 0 past w) from the key slab at k ([D][kAttnSlab]); ks: per-position scales
template <class T>
[[gnu::always_inline]] inline void key_slab(const T* __restrict k, const float* __restrict ks, int64_t D, int64_t j0,
                                            int64_t w, float* __restrict kt) {
  if (w == kAttnSlab) {  // full slabs: the whole [D][16] block at once (FP8: times each column's scale)
    if constexpr (std::is_same_v<T, uint8_t>) quant::e4m3_decode_scale_cols(k, D, kAttnSlab, ks + j0, kt);
    else widen_array(k, D * kAttnSlab, kt);
    return;
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = 0; j < kAttnSlab; ++j)
      kt[d * kAttnSlab + j] = j < w ? widen1(k[d * kAttnSlab + j], scale_at<T>(ks, j0 + j)) : 0.0f;
}
// v[j][d] = value j0 + j (j < w; d < D, 0 up to ldv) from V [max_ctx][D] at v; vs: per-position scales
template <class T>
[[gnu::always_inline]] inline void value_slab(const T* __restrict v, const float* __restrict vs, int64_t D, int64_t j0,
                                              int64_t w, int64_t ldv, float* __restrict out) {
  // FP8: each row times its position's scale, in the decoder's pass
  const auto rows = [&](int64_t j, int64_t n, float* o) {
    if constexpr (std::is_same_v<T, uint8_t>) quant::e4m3_decode_scale_rows(v + (j0 + j) * D, n, D, vs + j0 + j, o);
    else widen_array(v + (j0 + j) * D, n * D, o);
  };
  if (ldv == D) rows(0, w, out);  // the rows are contiguous in both
  for (int64_t j = 0; j < w; ++j) {
    if (ldv != D) rows(j, 1, out + j * ldv);
    for (int64_t d = D; d < ldv; ++d) out[j * ldv + d] = 0.0f;
  }
}

// attn_kv_source callbacks per storage dtype (an F32 or BF16 cache has no scales: ks, vs unused)
template <class T>
const T* stored(const head_view& h);
template <>
const float* stored<float>(const head_view& h) { return h.c->f32.data() + h.b; }
template <>
const uint16_t* stored<uint16_t>(const head_view& h) { return h.c->bf16.data() + h.b; }
template <>
const uint8_t* stored<uint8_t>(const head_view& h) { return h.c->fp8.data() + h.b; }
const float* scales(const std::vector<float>& s, const head_view& h) { return s.empty() ? nullptr : s.data() + h.sb; }

// Touches the bytes [p, p + n) for the cache hierarchy (a slab two ahead: the K/V of earlier
// layers were evicted by the weights streamed since, and the hardware prefetcher starts late).
inline void prefetch_bytes(const void* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

template <class T>
FP8RL_VECTOR_CLONES void keys_of(const void* p, int64_t j0, int64_t w, float* kt) {
  const auto& h = *static_cast<const head_view*>(p);
  const int64_t D = h.c->head_dim, slab = D * kAttnSlab;
  const T* k = stored<T>(h) + h.c->key_at(j0, 0);
  if (j0 + 3 * kAttnSlab <= h.c->ctx_pad()) prefetch_bytes(k + 2 * slab, slab * static_cast<int64_t>(sizeof(T)));
  key_slab(k, scales(h.c->kscale, h), D, j0, w, kt);
}
template <class T>
FP8RL_VECTOR_CLONES void values_of(const void* p, int64_t j0, int64_t w, int64_t ldv, float* v) {
  const auto& h = *static_cast<const head_view*>(p);
  const int64_t D = h.c->head_dim, slab = D * kAttnSlab;
  const T* v0 = stored<T>(h) + h.c->value_at(0, 0);
  if (j0 + 3 * kAttnSlab <= h.c->max_ctx) prefetch_bytes(v0 + (j0 + 2 * kAttnSlab) * D, slab * static_cast<int64_t>(sizeof(T)));
  value_slab(v0, scales(h.c->vscale, h), D, j0, w, ldv, v);
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
          throw std::invalid_argument("kv_cache_write: layer " + std::to_string(layer) + ", KV head " + std::to_string(g) +
                                      ", position " + std::to_string(p) + ": " + (d < D ? "K" : "V") + "[" +
                                      std::to_string(d % D) + "] is " + std::to_string(x) + " (not finite; FP8 K/V cache)");
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
        for (int64_t d = 0; d < 2 * D; ++d) saturated[g] += std::fabs(scaled[d]) > 448.0f;
        quant::e4m3_encode_array(scaled, 2 * D, codes);
        for (int64_t d = 0; d < D; ++d) {
          c.fp8[b + c.key_at(p, d)] = codes[d];
          c.fp8[b + c.value_at(p, d)] = codes[D + d];
        }
        c.kscale[c.sbase(slot, layer, g) + p] = k_scale[g];
        c.vscale[c.sbase(slot, layer, g) + p] = v_scale[g];
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

void cpu_attention_cached(const kv_cache& cache, int64_t layer, const kv_step& st, const float* q, int64_t H,
                          precision operand, const float* q_scale, float* out) {
  const auto& c = static_cast<const cpu_kv_cache&>(cache);
  const int64_t KV = c.kv_heads, D = c.head_dim, G = H / KV;
  std::vector<attn_rounding> rq(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h) rq[h] = {operand, q_scale ? q_scale[h] : 0.0f};
  attn_kv_source src;
  switch (c.dtype) {
    case kv_dtype::f32: src.keys = keys_of<float>; src.values = values_of<float>; break;
    case kv_dtype::bf16: src.keys = keys_of<uint16_t>; src.values = values_of<uint16_t>; break;
    case kv_dtype::fp8: src.keys = keys_of<uint8_t>; src.values = values_of<uint8_t>; break;
  }
  tbb::parallel_for(int64_t{0}, st.T * KV, [&](int64_t i) {
    const int64_t t = i / KV, g = i % KV, slot = st.slot[t], n = st.pos[t] + 1;
    const head_view hv{&c, c.base(slot, layer, g), c.sbase(slot, layer, g)};
    attn_kv_source kv = src;
    kv.ctx = &hv;
    // per-thread scratch, grown not reallocated (a fresh vector per (token, head) costs a memset)
    thread_local std::vector<float> scratch;
    const int64_t need = cpu_attn_group_scratch(n, D);
    if (scratch.size() < static_cast<size_t>(need)) scratch.resize(static_cast<size_t>(need));
    cpu_attn_group(q + (t * H + g * G) * D, D, rq.data() + g * G, G, kv, n, D, operand, out + (t * H + g * G) * D, D,
                   scratch.data());
  });
}

}  // namespace fp8rl::models
