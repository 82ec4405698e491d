// models/transformer.cpp -- forward and backward of the Llama-family transformer.
#include "models/transformer.hpp"

#include "quant/fp8.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>
#include <limits>
#include <stdexcept>

namespace fp8rl::models {

// ---------------------------------------------------------------- token_batch
int64_t token_batch::prefix_len(int64_t s) const {
  const int32_t p = prefix_of(s);
  return p < 0 ? 0 : seq_start[p + 1] - seq_start[p];
}

std::vector<int32_t> token_batch::positions() const {
  std::vector<int32_t> p(tokens.size());
  for (int64_t s = 0; s < S(); ++s) {
    const int32_t off = static_cast<int32_t>(prefix_len(s));
    for (int32_t t = seq_start[s]; t < seq_start[s + 1]; ++t) p[t] = off + t - seq_start[s];
  }
  return p;
}

std::vector<int32_t> token_batch::next_targets() const {
  std::vector<int32_t> y(tokens.size(), -1);
  for (int64_t s = 0; s < S(); ++s)
    for (int32_t t = seq_start[s]; t + 1 < seq_start[s + 1]; ++t) y[t] = tokens[t + 1];
  return y;
}

void token_batch::add(const std::vector<int32_t>& seq, int32_t prefix_seq) {
  if (prefix_seq >= 0 && prefix.empty()) prefix.assign(static_cast<size_t>(S()), -1);
  if (!prefix.empty()) prefix.push_back(prefix_seq);
  tokens.insert(tokens.end(), seq.begin(), seq.end());
  seq_start.push_back(static_cast<int32_t>(tokens.size()));
}

token_batch token_batch::pack(const std::vector<std::vector<int32_t>>& seqs) {
  token_batch b;
  for (const auto& s : seqs) b.add(s);
  return b;
}

void token_batch::validate(int64_t vocab, int64_t max_pos) const {
  if (seq_start.empty() || seq_start.front() != 0 || seq_start.back() != T())
    throw std::invalid_argument("token batch: seq_start must run from 0 to T");
  if (!prefix.empty() && static_cast<int64_t>(prefix.size()) != S())
    throw std::invalid_argument("token batch: prefix has " + std::to_string(prefix.size()) + " entries for " +
                                std::to_string(S()) + " sequences");
  for (int64_t s = 0; s < S(); ++s) {
    if (seq_start[s + 1] < seq_start[s]) throw std::invalid_argument("token batch: seq_start not increasing");
    if (!prefix.empty()) {
      const int32_t p = prefix[s];
      if (p >= s || p < -1 || (p >= 0 && prefix[p] != -1))
        throw std::invalid_argument("token batch: sequence " + std::to_string(s) + " has prefix " + std::to_string(p) +
                                    " (need -1 or an earlier sequence without a prefix of its own)");
    }
    if (prefix_len(s) + seq_start[s + 1] - seq_start[s] > max_pos)
      throw std::invalid_argument("token batch: sequence " + std::to_string(s) + " has " +
                                  std::to_string(prefix_len(s) + seq_start[s + 1] - seq_start[s]) +
                                  " tokens, more than max_position_embeddings = " + std::to_string(max_pos));
  }
  for (int64_t t = 0; t < T(); ++t)
    if (tokens[t] < 0 || tokens[t] >= vocab)
      throw std::invalid_argument("token batch: token " + std::to_string(tokens[t]) + " at index " +
                                  std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

// ---------------------------------------------------------------- weights
namespace {

buffer<float> upload(backend& be, const std::vector<float>& v) {
  buffer<float> b(be, static_cast<int64_t>(v.size()));
  be.to_device(b.data(), v.data(), v.size() * 4);
  return b;
}

// FP32 compute values of a non-FP8 tensor: rounded from master, or taken from a bundle.
std::vector<float> values_of(const weight_source& src, const model_config& cfg, const std::string& name,
                             precision prec) {
  std::vector<float> v;
  if (src.master) {
    const param_info& info = src.master->layout.at(name);
    const float* p = src.master->data.data() + info.offset;
    v.assign(p, p + info.numel);
    if (prec == precision::bf16)
      for (auto& x : v) x = quant::bf16_round(x);
    return v;
  }
  auto it = src.values->find(name);
  if (it == src.values->end()) throw std::invalid_argument("weights: tensor '" + name + "' is missing from the bundle");
  const param_layout layout = model_param_layout(cfg);
  const param_info& info = layout.at(name);
  if (static_cast<int64_t>(it->second.size()) != info.numel)
    throw std::invalid_argument("weights: tensor '" + name + "' has " + std::to_string(it->second.size()) +
                                " values, needs " + std::to_string(info.numel));
  return it->second;
}

}  // namespace

std::unique_ptr<model_weights> model_weights_build(backend& be, const model_config& cfg, const precision_policy& policy,
                                                   const weight_source& src, bool for_backward, bool long_lived) {
  policy.validate();
  if (policy.bf16_first > cfg.num_hidden_layers || policy.bf16_last > cfg.num_hidden_layers)
    throw std::invalid_argument("precision policy '" + policy.name + "': bf16_first/bf16_last (" +
                                std::to_string(policy.bf16_first) + ", " + std::to_string(policy.bf16_last) +
                                ") exceed the model's " + std::to_string(cfg.num_hidden_layers) + " layers");
  if (!src.master && (!src.values || !src.fp8)) throw std::invalid_argument("weights: no source");
  auto w = std::make_unique<model_weights>();
  w->cfg = cfg;
  w->policy = policy;
  w->rope_inv_freq = cfg.rope_inv_freq();
  const precision hp = policy.head;
  const int64_t C = cfg.hidden_size, F = cfg.intermediate_size;
  std::vector<float> wte = values_of(src, cfg, "model.embed_tokens.weight", hp);
  w->wte = upload(be, wte);
  w->final_norm = upload(be, values_of(src, cfg, "model.norm.weight", hp));
  auto linear = [&](int64_t layer, const std::string& name, const char* proj, int64_t out, int64_t in) {
    linear_source ls;
    ls.name = name;
    ls.out = out;
    ls.in = in;
    ls.prec = layer < 0 ? hp : policy.linear_for(cfg, layer, proj, out, in);
    ls.mode = policy.scales;
    ls.tiles = policy.tiles;
    ls.long_lived = long_lived;
    std::vector<float> vals;
    if (ls.prec == precision::fp8 && !src.master) {
      auto it = src.fp8->find(name);
      if (it == src.fp8->end()) throw std::invalid_argument("weights: FP8 tensor '" + name + "' is missing from the bundle");
      ls.fp8 = &it->second;
    } else if (src.master) {
      ls.f32 = src.master->get(name);
    } else {
      vals = values_of(src, cfg, name, ls.prec);
      ls.f32 = vals.data();
    }
    return be.linear_prepare(ls, for_backward);
  };
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    model_weights::layer l;
    auto n = [&](const char* s) { return layer_param_name(i, s); };
    l.attn_norm = upload(be, values_of(src, cfg, n("input_layernorm.weight"), hp));
    l.mlp_norm = upload(be, values_of(src, cfg, n("post_attention_layernorm.weight"), hp));
    l.q = linear(i, n("self_attn.q_proj.weight"), "self_attn.q_proj", cfg.q_dim(), C);
    l.k = linear(i, n("self_attn.k_proj.weight"), "self_attn.k_proj", cfg.kv_dim(), C);
    l.v = linear(i, n("self_attn.v_proj.weight"), "self_attn.v_proj", cfg.kv_dim(), C);
    l.o = linear(i, n("self_attn.o_proj.weight"), "self_attn.o_proj", C, cfg.q_dim());
    l.gate = linear(i, n("mlp.gate_proj.weight"), "mlp.gate_proj", F, C);
    l.up = linear(i, n("mlp.up_proj.weight"), "mlp.up_proj", F, C);
    l.down = linear(i, n("mlp.down_proj.weight"), "mlp.down_proj", C, F);
    w->layers.push_back(std::move(l));
  }
  if (cfg.tie_word_embeddings) {
    linear_source ls{"lm_head.weight", cfg.vocab_size, C, hp, policy.scales, wte.data(), nullptr, policy.tiles, long_lived};
    w->lm_head = be.linear_prepare(ls, for_backward);
  } else {
    w->lm_head = linear(-1, "lm_head.weight", "lm_head", cfg.vocab_size, C);
  }
  return w;
}

// ---------------------------------------------------------------- runner
void model_runner::ensure(const model_config& c, int64_t T) {
  const int64_t C = c.hidden_size, F = c.intermediate_size, QD = c.q_dim(), KD = c.kv_dim(), H = c.num_attention_heads;
  a_.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (auto& l : a_.layers) {
    l.x.ensure(be_, T * C); l.xn1.ensure(be_, T * C); l.rstd1.ensure(be_, T);
    l.q.ensure(be_, T * QD); l.k.ensure(be_, T * KD); l.v.ensure(be_, T * KD);
    l.att.ensure(be_, T * QD); l.lse.ensure(be_, T * H); l.xmid.ensure(be_, T * C);
    l.xn2.ensure(be_, T * C); l.rstd2.ensure(be_, T);
    l.gate.ensure(be_, T * F); l.up.ensure(be_, T * F); l.h.ensure(be_, T * F);
  }
  a_.xfinal.ensure(be_, T * C); a_.xnf.ensure(be_, T * C); a_.rstdf.ensure(be_, T);
  a_.logits.ensure(be_, T * c.vocab_size);
  a_.tmp.ensure(be_, T * std::max(C, QD));
  a_.T = T;
}

attn_params model_runner::attn(const model_weights& w, int64_t layer) const {
  attn_params p;
  p.T = batch_.T();
  p.H = w.cfg.num_attention_heads;
  p.KV = w.cfg.num_key_value_heads;
  p.D = w.cfg.head_dim;
  p.seq_start = batch_.seq_start.data();
  p.S = batch_.S();
  p.prefix = batch_.prefix.empty() ? nullptr : batch_.prefix.data();
  p.operand = w.policy.attention;
  if (fwd_scales_) {
    p.q_scale = fwd_scales_->q.data() + layer * p.H;
    p.k_scale = fwd_scales_->k.data() + layer * p.KV;
    p.v_scale = fwd_scales_->v.data() + layer * p.KV;
  }
  return p;
}

namespace {
// max |x| per head of x[T, nh, D] (host copy); NaN for a head holding a NaN (std::max skipped
// it, so calibration turned a diverged head into a valid-looking scale)
void head_amax(backend& be, const float* x, int64_t T, int64_t nh, int64_t D, float* out) {
  std::vector<float> h(static_cast<size_t>(T * nh * D));
  be.to_host(h.data(), x, h.size() * 4);
  for (int64_t i = 0; i < nh; ++i) out[i] = 0.0f;
  std::vector<char> nan(static_cast<size_t>(nh), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < nh; ++i)
      for (int64_t d = 0; d < D; ++d) {
        const float a = std::fabs(h[(t * nh + i) * D + d]);
        nan[i] |= std::isnan(a);
        out[i] = std::max(out[i], a);
      }
  for (int64_t i = 0; i < nh; ++i)
    if (nan[i]) out[i] = std::numeric_limits<float>::quiet_NaN();
}
}  // namespace

void model_runner::forward(const model_weights& w, const token_batch& b, bool train, const attn_fp8_scales* fp8_scales,
                           qkv_stats* stats) {
  const model_config& c = w.cfg;
  const std::vector<float>& inv_freq = w.rope_inv_freq;  // [D/2]
  b.validate(c.vocab_size, c.max_position_embeddings);
  if (fp8_scales) {
    if (!w.policy.fp8_attention) throw std::invalid_argument("forward: FP8 attention scales given, policy has fp8_attention off");
    const size_t L = static_cast<size_t>(c.num_hidden_layers);
    if (fp8_scales->q.size() != L * c.num_attention_heads || fp8_scales->k.size() != L * c.num_key_value_heads ||
        fp8_scales->v.size() != L * c.num_key_value_heads)
      throw std::invalid_argument("forward: FP8 attention scales have the wrong size (need [L][H], [L][KV], [L][KV])");
  }
  batch_ = b;
  pos_ = b.positions();
  fwd_weights_ = &w;
  fwd_scales_ = fp8_scales;
  trained_forward_ = train;
  const int64_t T = b.T(), C = c.hidden_size, F = c.intermediate_size, H = c.num_attention_heads,
                KV = c.num_key_value_heads, D = c.head_dim;
  ensure(c, T);
  if (stats) {
    stats->q.assign(static_cast<size_t>(c.num_hidden_layers * H), 0.0f);
    stats->k.assign(static_cast<size_t>(c.num_hidden_layers * KV), 0.0f);
    stats->v.assign(static_cast<size_t>(c.num_hidden_layers * KV), 0.0f);
  }
  be_.embedding_forward(w.wte.data(), b.tokens.data(), T, C, a_.layers[0].x.data());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const auto& lw = w.layers[i];
    auto& l = a_.layers[i];
    const float eps = static_cast<float>(c.rms_norm_eps);
    be_.rmsnorm_forward(l.x.data(), lw.attn_norm.data(), T, C, eps, l.xn1.data(), l.rstd1.data());
    const prepared_linear* qkv[] = {lw.q.get(), lw.k.get(), lw.v.get()};
    float* qkv_out[] = {l.q.data(), l.k.data(), l.v.data()};  // [T, H*D], [T, KV*D], [T, KV*D]
    be_.linear_forward_group(qkv, l.xn1.data(), T, qkv_out);
    be_.rope(l.q.data(), pos_.data(), T, H, D, inv_freq, false);
    be_.rope(l.k.data(), pos_.data(), T, KV, D, inv_freq, false);
    if (stats) {
      head_amax(be_, l.q.data(), T, H, D, stats->q.data() + i * H);
      head_amax(be_, l.k.data(), T, KV, D, stats->k.data() + i * KV);
      head_amax(be_, l.v.data(), T, KV, D, stats->v.data() + i * KV);
    }
    be_.attention_forward(attn(w, i), l.q.data(), l.k.data(), l.v.data(), l.att.data(), l.lse.data());
    be_.linear_forward(*lw.o, l.att.data(), T, a_.tmp.data());  // [T, C]
    be_.copy(l.xmid.data(), l.x.data(), T * C);
    be_.add_inplace(l.xmid.data(), a_.tmp.data(), T * C);
    be_.rmsnorm_forward(l.xmid.data(), lw.mlp_norm.data(), T, C, eps, l.xn2.data(), l.rstd2.data());
    const prepared_linear* gate_up[] = {lw.gate.get(), lw.up.get()};
    float* gate_up_out[] = {l.gate.data(), l.up.data()};  // [T, F] each
    be_.linear_forward_group(gate_up, l.xn2.data(), T, gate_up_out);
    be_.swiglu_forward(l.gate.data(), l.up.data(), T * F, l.h.data());
    be_.linear_forward(*lw.down, l.h.data(), T, a_.tmp.data());    // [T, C]
    float* next = i + 1 < c.num_hidden_layers ? a_.layers[i + 1].x.data() : a_.xfinal.data();
    be_.copy(next, l.xmid.data(), T * C);
    be_.add_inplace(next, a_.tmp.data(), T * C);
  }
  be_.rmsnorm_forward(a_.xfinal.data(), w.final_norm.data(), T, C, static_cast<float>(c.rms_norm_eps), a_.xnf.data(),
                      a_.rstdf.data());
  be_.linear_forward(*w.lm_head, a_.xnf.data(), T, a_.logits.data());  // [T, V]
}

namespace {
// One target per token of the batch, each a vocabulary id or -1 (no target): a target >= V was
// read past its logits row (and in backward written into another row), a -1 taken for padding.
void targets_check(const std::vector<int32_t>& targets, int64_t T, int64_t V, const char* where) {
  if (static_cast<int64_t>(targets.size()) != T)
    throw std::invalid_argument(std::string(where) + ": " + std::to_string(targets.size()) + " targets for " +
                                std::to_string(T) + " tokens");
  for (size_t t = 0; t < targets.size(); ++t)
    if (targets[t] < -1 || targets[t] >= V)
      throw std::invalid_argument(std::string(where) + ": the target of token " + std::to_string(t) + " is " +
                                  std::to_string(targets[t]) + ", not -1 or an id below the vocabulary size " +
                                  std::to_string(V));
}
}  // namespace

void model_runner::logprobs(const std::vector<int32_t>& targets, const logit_processing& proc, float* logp,
                            float* entropy) {
  if (!fwd_weights_) throw std::logic_error("logprobs: no forward pass");
  targets_check(targets, batch_.T(), fwd_weights_->cfg.vocab_size, "logprobs");
  be_.logprob_forward(a_.logits.data(), targets.data(), batch_.T(), fwd_weights_->cfg.vocab_size, proc, logp, entropy);
}

void model_runner::backward(const model_weights& w, const std::vector<int32_t>& targets, const logit_processing& proc,
                            const float* dlogp, float* grads) {
  if (fwd_weights_ != &w || !trained_forward_) throw std::logic_error("backward: needs a training forward with these weights");
  const model_config& c = w.cfg;
  const std::vector<float>& inv_freq = w.rope_inv_freq;  // [D/2]
  targets_check(targets, batch_.T(), c.vocab_size, "backward");
  const int64_t T = batch_.T(), C = c.hidden_size, F = c.intermediate_size, H = c.num_attention_heads,
                KV = c.num_key_value_heads, D = c.head_dim, V = c.vocab_size, QD = c.q_dim(), KD = c.kv_dim();
  const param_layout layout = model_param_layout(c);
  const auto lp = model_layer_params(c, layout);
  g_.dres.ensure(be_, T * C); g_.dxn.ensure(be_, T * C); g_.dtmp.ensure(be_, T * std::max(C, QD));
  g_.datt.ensure(be_, T * QD); g_.dq.ensure(be_, T * QD); g_.dk.ensure(be_, T * KD); g_.dv.ensure(be_, T * KD);
  g_.dh.ensure(be_, T * F); g_.dgate.ensure(be_, T * F); g_.dup.ensure(be_, T * F); g_.dlogits.ensure(be_, T * V);
  // every op below adds (+=) into gp: on host memory that is the caller's buffer itself
  const bool direct = be_.host_memory();
  float* gp = grads;
  if (!direct) {
    g_.flat.ensure(be_, layout.total);
    be_.zero(g_.flat.data(), static_cast<size_t>(layout.total) * 4);
    gp = g_.flat.data();
  }

  // lm_head and final norm
  be_.logprob_backward(a_.logits.data(), targets.data(), T, V, proc, dlogp, g_.dlogits.data());
  float* dlm = gp + layout.at(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight").offset;
  be_.linear_backward(*w.lm_head, a_.xnf.data(), g_.dlogits.data(), T, g_.dxn.data(), dlm);
  be_.zero(g_.dres.data(), static_cast<size_t>(T * C) * 4);
  be_.rmsnorm_backward(g_.dxn.data(), a_.xfinal.data(), w.final_norm.data(), a_.rstdf.data(), T, C, g_.dres.data(),
                       gp + layout.at("model.norm.weight").offset);
  for (int64_t i = c.num_hidden_layers - 1; i >= 0; --i) {
    const auto& lw = w.layers[i];
    auto& l = a_.layers[i];
    const layer_params& o = lp[i];
    // MLP: x_next = xmid + down(silu(gate(xn2)) * up(xn2))
    be_.linear_backward(*lw.down, l.h.data(), g_.dres.data(), T, g_.dh.data(), gp + o.w_down);
    be_.swiglu_backward(g_.dh.data(), l.gate.data(), l.up.data(), T * F, g_.dgate.data(), g_.dup.data());
    const prepared_linear* gate_up[] = {lw.gate.get(), lw.up.get()};
    const float* d_gate_up[] = {g_.dgate.data(), g_.dup.data()};
    float* dw_gate_up[] = {gp + o.w_gate, gp + o.w_up};
    be_.linear_backward_group(gate_up, l.xn2.data(), d_gate_up, T, g_.dxn.data(), g_.dtmp.data(), dw_gate_up);
    be_.rmsnorm_backward(g_.dxn.data(), l.xmid.data(), lw.mlp_norm.data(), l.rstd2.data(), T, C, g_.dres.data(),
                         gp + o.mlp_norm);
    // attention: xmid = x + o(attn(rope(q(xn1)), rope(k(xn1)), v(xn1)))
    be_.linear_backward(*lw.o, l.att.data(), g_.dres.data(), T, g_.datt.data(), gp + o.wo);
    be_.attention_backward(attn(w, i), l.q.data(), l.k.data(), l.v.data(), l.att.data(), l.lse.data(), g_.datt.data(),
                           g_.dq.data(), g_.dk.data(), g_.dv.data());
    be_.rope(g_.dq.data(), pos_.data(), T, H, D, inv_freq, true);
    be_.rope(g_.dk.data(), pos_.data(), T, KV, D, inv_freq, true);
    const prepared_linear* qkv[] = {lw.q.get(), lw.k.get(), lw.v.get()};
    const float* d_qkv[] = {g_.dq.data(), g_.dk.data(), g_.dv.data()};
    float* dw_qkv[] = {gp + o.wq, gp + o.wk, gp + o.wv};
    be_.linear_backward_group(qkv, l.xn1.data(), d_qkv, T, g_.dxn.data(), g_.dtmp.data(), dw_qkv);
    be_.rmsnorm_backward(g_.dxn.data(), l.x.data(), lw.attn_norm.data(), l.rstd1.data(), T, C, g_.dres.data(),
                         gp + o.attn_norm);
  }
  be_.embedding_backward(g_.dres.data(), batch_.tokens.data(), T, C, gp + layout.at("model.embed_tokens.weight").offset);
  if (direct) return;
  std::vector<float>& host = g_.host;
  host.resize(static_cast<size_t>(layout.total));
  be_.to_host(host.data(), gp, host.size() * 4);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, host.size(), size_t{1} << 16), [&](const auto& r) {
    for (size_t j = r.begin(); j < r.end(); ++j) grads[j] += host[j];
  });
}

}  // namespace fp8rl::models
