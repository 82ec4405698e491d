// models/transformer.hpp -- the Llama-family forward and backward pass on a backend.
// defines: token_batch, model_weights, model_weights_build, qkv_stats, attn_fp8_scales,
//          model_runner
//
// Reading order: model_weights_build (compute weights of one weight version, per the precision
// policy) -> model_runner::forward (embedding, L x [RMSNorm, q/k/v, RoPE, GQA attention, o,
// RMSNorm, SwiGLU MLP], final RMSNorm, lm_head) -> logprobs -> backward (from d logp).
// Legend: models/config.hpp. Activations are FP32; linear layers run in the policy's precision.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/backend.hpp"
#include "models/params.hpp"
#include "models/precision.hpp"

namespace fp8rl::models {

// Token sequences packed into one row of T tokens; attention is causal within each sequence.
// Shared prefixes: a sequence s with prefix[s] = p >= 0 continues sequence p (an earlier one
// with no prefix of its own): its tokens sit at positions |p| + i and attend to all of p's
// tokens, then causally to its own. Every row computes exactly what it would in the unshared
// sequence p + s, so G completions of one prompt run the prompt's rows once (the learner).
struct token_batch {
  std::vector<int32_t> tokens;           // [T]
  std::vector<int32_t> seq_start = {0};  // [S+1]; seq_start[S] == T
  std::vector<int32_t> prefix;           // [S] or empty (no shared prefixes): sequence p, or -1
  int64_t T() const { return static_cast<int64_t>(tokens.size()); }
  int64_t S() const { return static_cast<int64_t>(seq_start.size()) - 1; }
  int32_t prefix_of(int64_t s) const { return prefix.empty() ? -1 : prefix[s]; }
  int64_t prefix_len(int64_t s) const;        // tokens of s's prefix sequence (0 if none)
  std::vector<int32_t> positions() const;     // [T] position within its (unshared) sequence
  std::vector<int32_t> next_targets() const;  // [T] token t+1 of the same sequence, else -1
  void add(const std::vector<int32_t>& seq, int32_t prefix_seq = -1);
  void validate(int64_t vocab, int64_t max_pos) const;  // throws std::invalid_argument
  static token_batch pack(const std::vector<std::vector<int32_t>>& seqs);
};

// Compute weights of one weight version on one backend (immutable once built).
struct model_weights {
  model_config cfg;
  precision_policy policy;
  std::vector<float> rope_inv_freq;  // [D/2] cfg.rope_inv_freq(), computed once
  buffer<float> wte;         // [V,C]   (BF16-rounded values when policy.head == bf16)
  buffer<float> final_norm;  // [C]
  struct layer {
    buffer<float> attn_norm, mlp_norm;  // [C]
    std::unique_ptr<prepared_linear> q, k, v, o, gate, up, down;
  };
  std::vector<layer> layers;
  std::unique_ptr<prepared_linear> lm_head;  // [V,C]; tied: prepared from wte's values
};

// Named FP32 compute values of every non-FP8 tensor, and quantized blocks of FP8 linears.
// model_weights_build takes either master params (learner: rounding/quantizing here) or
// bundle contents (rollout: bytes exactly as the learner produced them).
struct weight_source {
  const model_params* master = nullptr;
  // bundle form: name -> values (already rounded) / name -> FP8 blocks
  const std::map<std::string, std::vector<float>>* values = nullptr;
  const std::map<std::string, quant::qtensor>* fp8 = nullptr;
};
// long_lived: weights kept for many forward calls that stream them from memory (the generation
// engine's); the backend may place them for that (CPU: huge pages, quant/aligned.hpp).
std::unique_ptr<model_weights> model_weights_build(backend& be, const model_config& cfg, const precision_policy& policy,
                                                   const weight_source& src, bool for_backward, bool long_lived = false);

// Per-layer, per-head max |q|, |k|, |v| after RoPE, for calibration (rl-algorithm.md §5).
struct qkv_stats {
  std::vector<float> q, k, v;  // [L][H], [L][KV], [L][KV]
};

// FP8 attention scales (scale_inv per head), from a scale snapshot: [L][H], [L][KV], [L][KV].
struct attn_fp8_scales {
  std::vector<float> q, k, v;
};

// Runs forward/backward passes; owns the activation workspace (reused across calls).
class model_runner {
 public:
  explicit model_runner(backend& be) : be_(be) {}
  // Forward over a batch; keeps activations for backward if `train`. fp8_scales enables FP8
  // attention (requires policy.fp8_attention); stats (optional) collects q/k/v amax.
  void forward(const model_weights& w, const token_batch& b, bool train, const attn_fp8_scales* fp8_scales = nullptr,
               qkv_stats* stats = nullptr);
  // logp[T] (host) of `targets` under `proc`; entropy[T] optional.
  void logprobs(const std::vector<int32_t>& targets, const logit_processing& proc, float* logp, float* entropy = nullptr);
  // Backward from dlogp[T] (host); adds gradients into grads[P] (host, layout of model_params).
  void backward(const model_weights& w, const std::vector<int32_t>& targets, const logit_processing& proc,
                const float* dlogp, float* grads);
  const float* logits() const { return a_.logits.data(); }  // backend memory [T,V]
  backend& be() { return be_; }

 private:
  struct layer_acts {
    buffer<float> x, xn1, rstd1, q, k, v, att, lse, xmid, xn2, rstd2, gate, up, h;
  };
  struct acts {
    std::vector<layer_acts> layers;
    buffer<float> xfinal, xnf, rstdf, logits, tmp;
    int64_t T = 0;
  };
  backend& be_;
  acts a_;
  token_batch batch_;
  std::vector<int32_t> pos_;
  const model_weights* fwd_weights_ = nullptr;
  const attn_fp8_scales* fwd_scales_ = nullptr;
  bool trained_forward_ = false;
  struct grads_ws {
    buffer<float> dres, dxn, dtmp, datt, dq, dk, dv, dh, dgate, dup, dlogits, flat;
    std::vector<float> host;  // flat gradients copied to the host (kept: no page faults per step)
  } g_;
  void ensure(const model_config& c, int64_t T);
  attn_params attn(const model_weights& w, int64_t layer) const;
};

}  // namespace fp8rl::models
