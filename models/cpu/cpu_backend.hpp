// models/cpu/cpu_backend.hpp -- the CPU backend: quant/ GEMMs + oneTBB kernels on host memory.
// defines: make_cpu_backend, cpu_attn_query, cpu_attn_round, cpu_attn_group, attn_kv_source
//
// Every op gives the same bits for the same inputs whatever the thread count, and per-token ops
// give the same bits whatever the batch: each output element has one fixed computation order.
#pragma once
#include <memory>

#include "models/backend.hpp"
#include "models/clones.hpp"
#include "quant/fp8.hpp"

namespace fp8rl::models {

std::unique_ptr<backend> make_cpu_backend();

// How attention operands are rounded before use (shared by training and the decode cache).
struct attn_rounding {
  precision operand = precision::fp32;  // fp32 | bf16
  float scale = 0.0f;                   // > 0: FP8 per-head scale_inv (code = e4m3(x / s))
};
// x rounded as an attention operand would be (BF16 RNE, or FP8 quantize-dequantize).
inline float cpu_attn_round(float x, const attn_rounding& r) {
  if (r.scale > 0.0f) return quant::e4m3_to_float(quant::e4m3_from_float(x / r.scale)) * r.scale;
  if (r.operand == precision::bf16) return quant::bf16_round(x);
  return x;
}

// One query row of causal attention over n keys -- the reference computation: the training
// forward's block kernels and decode's cpu_attn_group equal it bit for bit (tests). q[D] (unrounded; rounded here per rq), kt[D][ldk] keys transposed and
// already rounded, v[n][D] values already rounded. Writes out[D], returns lse of scaled scores.
// scratch: >= n + D floats.
float cpu_attn_query(const float* q, const attn_rounding& rq, const float* kt, int64_t ldk, const float* v,
                     int64_t n, int64_t D, precision p_operand, float* out, float* scratch);

// One KV head of the decode cache as cpu_attn_group reads it (models/cpu/kv_cache.cpp's layout),
// elements of `dtype` stored already rounded (FP8: E4M3 codes times the scale each position was
// written with; never a NaN code, since kv_cache_write refuses non-finite K/V and saturates):
// keys in slabs of kAttnSlab positions, each [D][kAttnSlab] (one row of 16 keys per component),
// values [positions][D]. The kernel widens them to FP32 in registers as it reads them.
constexpr int64_t kAttnSlab = 16;
struct attn_kv_source {
  kv_dtype dtype = kv_dtype::f32;
  const void* keys = nullptr;      // slab s (positions 16 s ...): D * kAttnSlab elements from s * D * kAttnSlab
  const void* values = nullptr;    // position j: D elements from j * D
  const float* kscale = nullptr;   // FP8: kscale[j], vscale[j] = position j's scales, readable up to n
  const float* vscale = nullptr;   //   rounded up to kAttnSlab (the rest of a slab is never used)
  // FP8, optional: per slab s, kSubnormalK set if any of its K codes (all 16 lanes, stale ones
  // too) ever was a subnormal E4M3 code, kSubnormalV likewise for its positions' V codes. A slab
  // with its bit clear is widened by the shorter form (no denormal arises); null: every slab may
  // hold one. Only speed depends on it: both forms give the same bits.
  const uint8_t* subnormal = nullptr;
};
constexpr uint8_t kSubnormalK = 1, kSubnormalV = 2;
// G query rows that share one KV head (grouped-query attention at decode), each exactly
// cpu_attn_query's computation (same roundings, same fma orders, the same softmax), with every
// key and value widened once per 8 rows (once for all of them at G <= 8), not once per row.
// Rows are computed in register blocks of 8, or of 1, 2 or 4 where G is that small. With an FP8
// cache the call runs with MXCSR DAZ clear (IEEE mode, as the reference computes).
//   q: row r at q + r * ldq (unrounded; rounded per rq[r]); out: row r at out + r * ldo
//   scratch: >= cpu_attn_group_scratch(n, D) floats
void cpu_attn_group(const float* q, int64_t ldq, const attn_rounding* rq, int64_t G, const attn_kv_source& kv,
                    int64_t n, int64_t D, precision p_operand, float* out, int64_t ldo, float* scratch);
int64_t cpu_attn_group_scratch(int64_t n, int64_t D);

}  // namespace fp8rl::models
