// tests/models/gen_util.hpp -- what the generation tests share: a tiny model config, request
// sets, engine configs, and the training forward's view of generated sequences (logprobs and
// logits of each generated token), the reference the engine must match.
#pragma once
#include <cstring>
#include <vector>

#include "models/cpu/cpu_backend.hpp"
#include "models/generate.hpp"

namespace fp8rl::models::test {

inline model_config gen_cfg() {
  model_config c;
  c.hidden_size = 256; c.intermediate_size = 256; c.num_hidden_layers = 2; c.num_attention_heads = 4;
  c.num_key_value_heads = 2; c.head_dim = 64; c.vocab_size = 61; c.max_position_embeddings = 128;
  c.initializer_range = 0.08;
  return c;
}

inline std::vector<gen_request> requests(int n, float temp, int top_k = 0, float top_p = 1.0f) {
  std::vector<gen_request> r;
  for (int i = 0; i < n; ++i) {
    gen_request q;
    q.id = 100 + i;
    for (int j = 0; j < 3 + (i * 5) % 11; ++j) q.prompt.push_back((7 * i + 13 * j + 1) % 61);
    q.max_tokens = 4 + (i * 3) % 9;
    q.proc = {temp, top_k, top_p};
    q.seed = 42 + i;
    r.push_back(q);
  }
  return r;
}

inline engine_config ecfg(const char* policy, int64_t slots) {
  engine_config e;
  e.slots = slots;
  e.max_context = 64;
  e.policy = precision_policy::named(policy);
  return e;
}

// The training forward over each result's prompt + generated tokens (one sequence each):
// logprobs[i][t] of generated token t under `proc`, and logits[i][t] [V], the row it was
// sampled from.
struct learner_view {
  std::vector<std::vector<float>> logprobs;
  std::vector<std::vector<std::vector<float>>> logits;
};

// `fp8` (a policy with FP8 attention): the forward's Q/K/V per-head FP8 under these scales.
inline learner_view learner_forward(const model_params& p, const precision_policy& pol, const std::vector<gen_result>& res,
                                    const logit_processing& proc, const attn_fp8_scales* fp8 = nullptr) {
  auto be = make_cpu_backend();
  auto w = model_weights_build(*be, p.cfg, pol, {&p, nullptr, nullptr}, false);
  model_runner run(*be);
  token_batch b;
  for (const auto& r : res) {
    auto seq = r.prompt;
    seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
    b.add(seq);
  }
  run.forward(*w, b, false, fp8);
  auto targets = b.next_targets();
  std::vector<float> lp(targets.size());
  run.logprobs(targets, proc, lp.data());
  const int64_t V = p.cfg.vocab_size;
  learner_view out;
  for (size_t i = 0; i < res.size(); ++i) {
    const int64_t first = b.seq_start[i] + static_cast<int64_t>(res[i].prompt.size()) - 1;  // row predicting token 0
    const int64_t n = static_cast<int64_t>(res[i].tokens.size());
    out.logprobs.emplace_back(lp.begin() + first, lp.begin() + first + n);
    out.logits.emplace_back();
    for (int64_t t = 0; t < n; ++t)
      out.logits.back().emplace_back(run.logits() + (first + t) * V, run.logits() + (first + t + 1) * V);
  }
  return out;
}

inline std::vector<std::vector<float>> learner_logprobs(const model_params& p, const precision_policy& pol,
                                                        const std::vector<gen_result>& res, const logit_processing& proc) {
  return learner_forward(p, pol, res, proc).logprobs;
}

// Q/K/V scales for the FP8 KV cache / attention from the prompts' amax (amax * 1.05 / 448), as
// fp8rl generate calibrates them.
inline attn_fp8_scales calibrated_scales(const model_params& p, const std::vector<gen_request>& reqs) {
  auto be = make_cpu_backend();
  model_runner run(*be);
  auto w = model_weights_build(*be, p.cfg, precision_policy::named("fp8"), {&p, nullptr, nullptr}, false);
  token_batch b;
  for (const auto& r : reqs) b.add(r.prompt);
  qkv_stats st;
  run.forward(*w, b, false, nullptr, &st);
  attn_fp8_scales sc;
  for (float a : st.q) sc.q.push_back(a * 1.05f / 448.0f);
  for (float a : st.k) sc.k.push_back(a * 1.05f / 448.0f);
  for (float a : st.v) sc.v.push_back(a * 1.05f / 448.0f);
  return sc;
}

inline bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace fp8rl::models::test
