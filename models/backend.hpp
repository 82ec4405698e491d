// models/backend.hpp -- the compute backend interface: every op the transformer runs.
// defines: backend, prepared_linear, linear_source, attn_params, logit_processing, buffer
//
// Pointers to activations and weights live in the backend's memory (host for the CPU backend,
// device for CUDA); small per-batch metadata (token ids, positions, sequence offsets, per-token
// scalars) is passed as host pointers. Shapes are in comments; legend in models/config.hpp.
// Ops are stateless except prepared weights, which are built once per weight version.
// Implementations: models/cpu/cpu_backend.cpp (always), gpu/ (when CUDA is present).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>

#include "models/precision.hpp"
#include "quant/qtensor.hpp"

namespace fp8rl::models {

// A value one slot's K/V write or FP8 query refused (not finite): carries the slot, so the engine
// can name the request it holds.
struct slot_error : std::invalid_argument {
  int64_t slot;
  slot_error(const std::string& what, int64_t s) : std::invalid_argument(what), slot(s) {}
};

// The compute form of one linear weight W [out, in], from which a backend prepares its own.
struct linear_source {
  std::string name;
  int64_t out = 0, in = 0;
  precision prec = precision::fp32;
  quant::scale_mode mode = quant::scale_mode::pow2;
  const float* f32 = nullptr;            // host FP32 values (quantized / rounded per prec)
  const quant::qtensor* fp8 = nullptr;   // or: already-quantized 128x128 blocks (bundles)
  bool tiles = false;                    // precision_policy::tiles (bf16/fp8 layers only)
  bool long_lived = false;               // kept for many forward calls (model_weights_build)
};

struct prepared_linear {
  virtual ~prepared_linear() = default;
  std::string name;
  int64_t out = 0, in = 0;
  precision prec = precision::fp32;
};

// Logit processing that defines the sampled distribution; the learner's logprobs apply the
// same (rl-algorithm.md §2: g_t is the logprob after processing). top_k = 0 and top_p = 1 mean
// off. Temperature 0 means greedy sampling; logprobs are then taken at temperature 1.
struct logit_processing {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  bool identity() const { return (temperature == 1.0f || temperature == 0.0f) && top_k == 0 && top_p >= 1.0f; }
};

struct attn_params {
  int64_t T = 0, H = 0, KV = 0, D = 0;
  const int32_t* seq_start = nullptr;  // host [S+1]: packed sequence offsets; causal within each
  int64_t S = 0;
  const int32_t* prefix = nullptr;     // host [S] or null: sequence s also attends to all of
                                       //   sequence prefix[s] (>= 0) first (token_batch)
  precision operand = precision::fp32;  // fp32, or bf16 (Q, K, V, P rounded to BF16)
  const float* q_scale = nullptr;       // FP8 attention: host [H], [KV], [KV] scale_inv per head
  const float* k_scale = nullptr;       //   (null: not FP8)
  const float* v_scale = nullptr;
};

// A KV cache on a backend: per slot, layer and KV head, the keys and values of max_ctx positions
// in `dtype` (the layout is the backend's); FP8 entries keep the scale they were written with (per position), so entries
// written under an older scale snapshot stay decodable (KV policy `keep`).
struct kv_cache {
  virtual ~kv_cache() = default;
  int64_t slots = 0, layers = 0, kv_heads = 0, head_dim = 0, max_ctx = 0;
  kv_dtype dtype = kv_dtype::f32;
  virtual int64_t bytes() const = 0;
};

// Where each token of an engine step lives in the cache.
struct kv_step {
  int64_t T = 0;
  const int32_t* slot = nullptr;  // host [T]
  const int32_t* pos = nullptr;   // host [T]; token t attends to positions 0..pos[t] of its slot
};

class backend {
 public:
  virtual ~backend() = default;
  virtual std::string name() const = 0;

  // ---- memory ----
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // True when buffers are plain host memory (the CPU backend): model_runner::backward then adds
  // gradients straight into the caller's host buffer instead of a zeroed device copy.
  virtual bool host_memory() const { return false; }

  // ---- elementwise / normalization ----
  // out[T,C] = wte[tokens[t], :]
  virtual void embedding_forward(const float* wte, const int32_t* tokens, int64_t T, int64_t C, float* out) = 0;
  // dwte[V,C] += scatter of dout[T,C] by token (deterministic order)
  virtual void embedding_backward(const float* dout, const int32_t* tokens, int64_t T, int64_t C, float* dwte) = 0;
  // out[T,C] = x / rms(x) * w, rstd[T] kept for backward
  virtual void rmsnorm_forward(const float* x, const float* w, int64_t T, int64_t C, float eps, float* out, float* rstd) = 0;
  // dx[T,C] += ..., dw[C] += ...
  virtual void rmsnorm_backward(const float* dout, const float* x, const float* w, const float* rstd, int64_t T,
                                int64_t C, float* dx, float* dw) = 0;
  // x[T, nh, D] rotated in place by positions pos[T] (HF rotate_half convention), angles
  // pos * inv_freq[i] (inv_freq [D/2]: model_config::rope_inv_freq); inverse=true applies the
  // transpose rotation (backward).
  virtual void rope(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, const std::vector<float>& inv_freq,
                    bool inverse) = 0;
  // h[T,F] = silu(gate) * up
  virtual void swiglu_forward(const float* gate, const float* up, int64_t n, float* h) = 0;
  virtual void swiglu_backward(const float* dh, const float* gate, const float* up, int64_t n, float* dgate, float* dup) = 0;
  // y[n] += x[n]
  virtual void add_inplace(float* y, const float* x, int64_t n) = 0;
  // y[n] = x[n]
  virtual void copy(float* y, const float* x, int64_t n) = 0;

  // ---- linear layers: y[T,out] = x[T,in] · W^T ----
  virtual std::unique_ptr<prepared_linear> linear_prepare(const linear_source& w, bool for_backward) = 0;
  virtual void linear_forward(const prepared_linear& w, const float* x, int64_t T, float* y) = 0;
  // dx[T,in] = dy · W (overwritten; skipped if null); dw[out,in] += dy^T · x (skipped if null)
  virtual void linear_backward(const prepared_linear& w, const float* x, const float* dy, int64_t T, float* dx,
                               float* dw) = 0;
  // Layers reading one input x (q/k/v, gate/up): ys[i][T,out_i] = x · W_i^T. A backend may
  // prepare x once for all of them (the CPU backend quantizes or rounds it once); results equal
  // the separate calls. The default makes the separate calls.
  virtual void linear_forward_group(std::span<const prepared_linear* const> ws, const float* x, int64_t T,
                                    std::span<float* const> ys) {
    for (size_t i = 0; i < ws.size(); ++i) linear_forward(*ws[i], x, T, ys[i]);
  }
  // Their backward: dx[T,in] = dy_0 · W_0, then dy_i · W_i added in order (through dtmp[T,in],
  // the same bits as separate calls and add_inplace); dws[i] += dy_i^T · x. Null dx or dws[i]
  // skip that part, as in linear_backward.
  virtual void linear_backward_group(std::span<const prepared_linear* const> ws, const float* x,
                                     std::span<const float* const> dys, int64_t T, float* dx, float* dtmp,
                                     std::span<float* const> dws) {
    for (size_t i = 0; i < ws.size(); ++i) {
      linear_backward(*ws[i], x, dys[i], T, !dx ? nullptr : i == 0 ? dx : dtmp, dws[i]);
      if (dx && i > 0) add_inplace(dx, dtmp, T * ws[i]->in);
    }
  }

  // ---- attention (grouped-query, causal within packed sequences) ----
  // q[T,H,D], k/v[T,KV,D] (post-RoPE) -> out[T,H,D], lse[T,H] (log-sum-exp of scaled scores)
  virtual void attention_forward(const attn_params& p, const float* q, const float* k, const float* v, float* out,
                                 float* lse) = 0;
  // dq[T,H,D], dk/dv[T,KV,D] overwritten
  virtual void attention_backward(const attn_params& p, const float* q, const float* k, const float* v,
                                  const float* out, const float* lse, const float* dout, float* dq, float* dk,
                                  float* dv) = 0;

  // ---- KV cache (generation) ----
  virtual std::unique_ptr<kv_cache> kv_cache_create(int64_t slots, int64_t layers, int64_t KV, int64_t D,
                                                    int64_t max_ctx, kv_dtype dtype) = 0;
  // Writes k, v [T,KV,D] (post-RoPE) of `layer` at (slot[t], pos[t]). BF16 rounds to nearest
  // even; FP8 stores e4m3(x / scale) with saturation, k_scale/v_scale [KV]. Returns how many
  // elements the saturation clipped (|x / scale| > 464: up to 464 rounds to 448 anyway).
  virtual int64_t kv_cache_write(kv_cache& c, int64_t layer, const kv_step& st, const float* k, const float* v,
                                 const float* k_scale, const float* v_scale) = 0;
  // out[T,H,D]: token t's query q[t] attends to its slot's positions 0..pos[t] (the same
  // per-query arithmetic as attention_forward). q_scale [H] enables FP8 queries; returns how many
  // query elements their saturation clipped (|q / q_scale| > 464, as kv_cache_write; 0 without).
  virtual int64_t attention_cached(const kv_cache& c, int64_t layer, const kv_step& st, const float* q, int64_t H,
                                precision operand, const float* q_scale, float* out) = 0;

  // ---- output head ----
  // logp[t] (host) = log p(targets[t]) under `proc` applied to logits[t, :V]; targets[t] < 0 -> 0.
  // entropy (host, optional) = entropy of the processed distribution.
  virtual void logprob_forward(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                               const logit_processing& proc, float* logp, float* entropy) = 0;
  // dlogits[T,V] = dlogp[t] * d logp[t] / d logits (overwritten)
  virtual void logprob_backward(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                                const logit_processing& proc, const float* dlogp, float* dlogits) = 0;
};

// Owning backend buffer of n elements of T.
template <class T>
class buffer {
 public:
  buffer() = default;
  buffer(backend& b, int64_t n) : b_(&b), n_(n) {
    p_ = static_cast<T*>(b.alloc(static_cast<size_t>(n) * sizeof(T)));
    b.zero(p_, static_cast<size_t>(n) * sizeof(T));
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&& o) noexcept : b_(o.b_), p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  buffer& operator=(buffer&& o) noexcept {
    if (this != &o) { reset(); b_ = o.b_; p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  ~buffer() { reset(); }
  void reset() { if (p_) b_->release(p_); p_ = nullptr; n_ = 0; }
  // grows (and zeroes) only when needed
  void ensure(backend& b, int64_t n) { if (n > n_ || b_ != &b) *this = buffer(b, n); }
  T* data() { return p_; }
  const T* data() const { return p_; }
  int64_t size() const { return n_; }

 private:
  backend* b_ = nullptr;
  T* p_ = nullptr;
  int64_t n_ = 0;
};

}  // namespace fp8rl::models
