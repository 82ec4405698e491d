// models/cpu/cpu_ops.hpp -- internal: CPU kernels behind cpu_backend (shapes: models/backend.hpp).
#pragma once
#include <span>

#include "models/backend.hpp"

namespace fp8rl::models {

void cpu_embedding_forward(const float* wte, const int32_t* tokens, int64_t T, int64_t C, float* out);
void cpu_embedding_backward(const float* dout, const int32_t* tokens, int64_t T, int64_t C, float* dwte);
void cpu_rmsnorm_forward(const float* x, const float* w, int64_t T, int64_t C, float eps, float* out, float* rstd);
void cpu_rmsnorm_backward(const float* dout, const float* x, const float* w, const float* rstd, int64_t T, int64_t C,
                          float* dx, float* dw);
void cpu_rope(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, const std::vector<float>& inv_freq, bool inverse);
void cpu_add_inplace(float* y, const float* x, int64_t n);  // y[n] += x[n]
void cpu_swiglu_forward(const float* gate, const float* up, int64_t n, float* h);
void cpu_swiglu_backward(const float* dh, const float* gate, const float* up, int64_t n, float* dgate, float* dup);

std::unique_ptr<prepared_linear> cpu_linear_prepare(const linear_source& w, bool for_backward);
void cpu_linear_forward(const prepared_linear& w, const float* x, int64_t T, float* y);
void cpu_linear_backward(const prepared_linear& w, const float* x, const float* dy, int64_t T, float* dx, float* dw);
void cpu_linear_forward_group(std::span<const prepared_linear* const> ws, const float* x, int64_t T,
                              std::span<float* const> ys);
void cpu_linear_backward_group(std::span<const prepared_linear* const> ws, const float* x,
                               std::span<const float* const> dys, int64_t T, float* dx, float* dtmp,
                               std::span<float* const> dws);

void cpu_attention_forward(const attn_params& p, const float* q, const float* k, const float* v, float* out, float* lse);
void cpu_attention_backward(const attn_params& p, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv);

std::unique_ptr<kv_cache> cpu_kv_cache_create(int64_t slots, int64_t layers, int64_t KV, int64_t D, int64_t max_ctx,
                                              kv_dtype dtype);
int64_t cpu_kv_cache_write(kv_cache& c, int64_t layer, const kv_step& st, const float* k, const float* v,
                           const float* k_scale, const float* v_scale);
int64_t cpu_attention_cached(const kv_cache& c, int64_t layer, const kv_step& st, const float* q, int64_t H,
                             precision operand, const float* q_scale, float* out);

void cpu_logprob_forward(const float* logits, const int32_t* targets, int64_t T, int64_t V, const logit_processing& proc,
                         float* logp, float* entropy);
void cpu_logprob_backward(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                          const logit_processing& proc, const float* dlogp, float* dlogits);

}  // namespace fp8rl::models
