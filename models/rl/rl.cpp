// models/rl/rl.cpp -- rollout, learner gradient, SFT, evaluation.
#include "models/rl/rl.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

#include "models/cpu/cpu_backend.hpp"
#include "models/rl/staleness_hist.hpp"

namespace fp8rl::models {

std::vector<int32_t> stop_ids(const model_config& cfg, const tokenizer& tok) {
  std::vector<int32_t> s;
  for (int64_t id : cfg.eos_token_ids) s.push_back(static_cast<int32_t>(id));
  if (tok.eos >= 0 && std::find(s.begin(), s.end(), tok.eos) == s.end()) s.push_back(tok.eos);
  return s;
}

std::vector<int32_t> response_body(std::vector<int32_t> tokens, const std::vector<int32_t>& stops) {
  if (!tokens.empty() && std::find(stops.begin(), stops.end(), tokens.back()) != stops.end()) tokens.pop_back();
  return tokens;
}

std::vector<gen_request> group_requests(const std::vector<int32_t>& prompt, uint64_t prompt_id, int64_t G,
                                        const logit_processing& proc, int32_t max_tokens, uint64_t seed,
                                        const std::vector<int32_t>& stops) {
  std::vector<gen_request> out(static_cast<size_t>(G));
  for (int64_t j = 0; j < G; ++j) {
    gen_request& r = out[static_cast<size_t>(j)];
    r.id = prompt_id * static_cast<uint64_t>(G) + static_cast<uint64_t>(j);
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.proc = proc;
    r.seed = seed;
    r.stop_tokens = stops;
  }
  return out;
}

rl_sample rl_sample_from_result(gen_result&& r, int64_t G) {
  rl_sample x;
  x.prompt_id = r.id / static_cast<uint64_t>(G);
  x.group_index = static_cast<int32_t>(r.id % static_cast<uint64_t>(G));
  x.prompt = std::move(r.prompt);
  x.response = std::move(r.tokens);
  x.gen_logprobs = std::move(r.logprobs);
  x.weight_version = std::move(r.weight_version);
  x.scale_version = std::move(r.scale_version);
  x.oldest_kv_version = std::move(r.oldest_kv_version);
  x.oldest_kv_scale_version = std::move(r.oldest_kv_scale_version);
  return x;
}

void group_score(std::span<rl_sample> group, const std::string& answer, const tokenizer& tok,
                 const std::vector<int32_t>& stops, verifier_kind vk, const grpo_config& cfg) {
  std::vector<float> rewards;
  for (auto& x : group) {
    x.reward = verify(vk, tok.decode(response_body(x.response, stops), true), answer);
    rewards.push_back(x.reward);
  }
  const auto adv = grpo_advantages(rewards, static_cast<int64_t>(rewards.size()), cfg.normalize_std, cfg.adv_eps, cfg.leave_one_out);
  for (size_t i = 0; i < adv.size(); ++i) group[i].advantage = adv[i];
}

std::vector<gen_request> rollout_requests(const std::vector<task_example>& prompts, uint64_t first_prompt_id,
                                          const tokenizer& tok, const std::vector<int32_t>& stops, int64_t G,
                                          const logit_processing& proc,
                                          int32_t max_tokens, uint64_t seed) {
  std::vector<gen_request> out;
  for (size_t i = 0; i < prompts.size(); ++i)
    for (auto& r : group_requests(tok.encode(prompts[i].prompt, true), first_prompt_id + i, G, proc, max_tokens, seed, stops))
      out.push_back(std::move(r));
  return out;
}

std::vector<rl_sample> rollout_samples(const std::vector<gen_result>& results, const std::map<uint64_t, std::string>& answers,
                                       const tokenizer& tok, const std::vector<int32_t>& stops, verifier_kind vk,
                                       const grpo_config& cfg) {
  const int64_t G = cfg.group_size;
  if (G <= 0 || results.size() % static_cast<size_t>(G))
    throw std::invalid_argument("rollout_samples: " + std::to_string(results.size()) + " results are not groups of " +
                                std::to_string(G));
  std::vector<rl_sample> s;
  for (const auto& r : results) s.push_back(rl_sample_from_result(gen_result(r), G));
  std::sort(s.begin(), s.end(), [](const rl_sample& a, const rl_sample& b) {
    return a.prompt_id != b.prompt_id ? a.prompt_id < b.prompt_id : a.group_index < b.group_index;
  });
  for (size_t g0 = 0; g0 < s.size(); g0 += static_cast<size_t>(G)) {
    const uint64_t pid = s[g0].prompt_id;
    const std::span<rl_sample> group(s.data() + g0, static_cast<size_t>(G));  // scored in place
    for (int64_t j = 0; j < G; ++j)  // sorted: a group is indices 0..G-1 of one prompt, each once
      if (group[static_cast<size_t>(j)].prompt_id != pid || group[static_cast<size_t>(j)].group_index != j)
        throw std::invalid_argument("rollout_samples: the group of prompt " + std::to_string(pid) +
                                    " is incomplete or holds an index twice");
    auto it = answers.find(pid);
    if (it == answers.end()) throw std::invalid_argument("rollout_samples: no answer for prompt " + std::to_string(pid));
    group_score(group, it->second, tok, stops, vk, cfg);
  }
  return s;
}

learner_batch learner_batch_build(const std::vector<rl_sample>& samples, bool share_prompts) {
  learner_batch lb;
  auto shares = [&](size_t i, size_t j) {
    return share_prompts && j < samples.size() && samples[i].prompt.size() >= 2 && samples[i].prompt == samples[j].prompt;
  };
  int32_t root = -1;  // the prefix sequence of the current group, or -1
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    if (s.prompt.empty()) throw std::invalid_argument("learner batch: sample " + std::to_string(i) + " has an empty prompt");
    if (i == 0 || !shares(i - 1, i)) {  // a new prompt: a shared prefix if the next sample has it too
      root = -1;
      if (shares(i, i + 1)) {
        root = static_cast<int32_t>(lb.b.S());
        lb.b.add(std::vector<int32_t>(s.prompt.begin(), s.prompt.end() - 1));
      }
    }
    if (s.response.empty()) continue;  // nothing to predict
    std::vector<int32_t> seq;
    if (root >= 0) seq.assign(s.prompt.end() - 1, s.prompt.end());
    else seq = s.prompt;
    seq.insert(seq.end(), s.response.begin(), s.response.end() - 1);
    const int64_t first = lb.b.T() + static_cast<int64_t>(seq.size() - s.response.size());  // predicts response[0]
    lb.b.add(seq, root);
    for (size_t j = 0; j < s.response.size(); ++j) lb.at.push_back(first + static_cast<int64_t>(j));
  }
  lb.targets.assign(static_cast<size_t>(lb.b.T()), -1);
  size_t k = 0;
  for (const auto& s : samples)
    for (int32_t tok : s.response) lb.targets[static_cast<size_t>(lb.at[k++])] = tok;
  return lb;
}

std::vector<std::vector<int32_t>> rl_sequences(const std::vector<rl_sample>& samples) {
  std::vector<std::vector<int32_t>> out;
  out.reserve(samples.size());
  for (const auto& s : samples) {
    out.push_back(s.prompt);
    out.back().insert(out.back().end(), s.response.begin(), s.response.end());
  }
  return out;
}

void rl_sample_check(const rl_sample& s, size_t i, int64_t vocab) {
  const std::string at = "sample " + std::to_string(i) + " (prompt " + std::to_string(s.prompt_id) + ", group index " +
                         std::to_string(s.group_index) + ")";
  const size_t n = s.response.size();
  auto same = [&](size_t m, const char* what) {
    if (m != n)
      throw std::invalid_argument(at + ": " + what + " has " + std::to_string(m) + " entries for " + std::to_string(n) +
                                  " response tokens");
  };
  same(s.gen_logprobs.size(), "gen_logprobs");
  same(s.weight_version.size(), "weight_version");
  same(s.scale_version.size(), "scale_version");
  same(s.oldest_kv_version.size(), "oldest_kv_version");  // audit mode tells a kept KV cache by it
  same(s.oldest_kv_scale_version.size(), "oldest_kv_scale_version");
  if (vocab <= 0) return;
  auto ids = [&](const std::vector<int32_t>& v, const char* what) {
    for (size_t j = 0; j < v.size(); ++j)
      if (v[j] < 0 || v[j] >= vocab)
        throw std::invalid_argument(at + ": " + what + " token " + std::to_string(j) + " is " + std::to_string(v[j]) +
                                    ", not an id of the model's vocabulary of " + std::to_string(vocab));
  };
  ids(s.prompt, "prompt");
  ids(s.response, "response");
}

token_batch_rl rl_tokens(const std::vector<rl_sample>& samples) {
  token_batch_rl rl;
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    rl_sample_check(s, i, 0);
    for (size_t j = 0; j < s.response.size(); ++j) {
      rl.g.push_back(s.gen_logprobs[j]);
      rl.adv.push_back(s.advantage);
      rl.mask.push_back(1.0f);
      rl.seq.push_back(static_cast<int32_t>(i));
      rl.weight_version.push_back(s.weight_version[j]);
      rl.oldest_kv_version.push_back(s.oldest_kv_version[j]);
    }
    rl.reward.push_back(s.reward);
  }
  rl.n_seqs = static_cast<int64_t>(samples.size());
  return rl;
}

namespace {
// The mismatch of the tokens `idx` into out as PREFIX/token_mult_prob_error and PREFIX/gen_kl_error
// (PREFIX/tokens too if `count`).
void subset_metrics(const token_batch_rl& rl, const is_result& is, const grpo_config& cfg, const std::vector<int64_t>& idx,
                    const std::string& prefix, bool count, metric_map& out) {
  token_batch_rl sub;
  is_result sis;
  sub.n_seqs = rl.n_seqs;
  for (int64_t t : idx) {
    sub.c.push_back(rl.c[t]); sub.p.push_back(rl.p[t]); sub.g.push_back(rl.g[t]);
    sub.adv.push_back(rl.adv[t]); sub.mask.push_back(rl.mask[t]); sub.seq.push_back(rl.seq[t]);
    sis.w.push_back(is.w[t]); sis.mask.push_back(is.mask[t]); sis.filtered.push_back(is.filtered[t]);
  }
  double n = 0;  // the subset's tokens left in the step
  for (int64_t t : idx) n += rl.mask[t] > 0 && !is.filtered[t];
  if (count) out[prefix + "/tokens"] = n;
  // every sequence of this subset filtered out, or no token with a finite term: no value (a
  // mean over no term read 0, better than a perfect 1)
  if (n == 0 || std::none_of(sis.mask.begin(), sis.mask.end(), [](float x) { return x > 0; })) return;
  metric_map m;
  mismatch_metrics(sub, sis, cfg, n, "", m);
  out[prefix + "/token_mult_prob_error"] = m["token_mult_prob_error"];
  out[prefix + "/gen_kl_error"] = m["gen_kl_error"];
}

// Per-version (by_version/v: the weights a token was sampled under) and per-staleness mismatch
// (by_staleness/Δ, Δ = learner_version - the oldest weights its context came from: a token sampled
// under the trained weights on a KV cache kept from older ones is not a precision-only token --
// the health gates read Δ = 0) into out.
void version_metrics(const token_batch_rl& rl, const is_result& is, const grpo_config& cfg, uint64_t learner_version,
                     metric_map& out) {
  const size_t n = static_cast<size_t>(rl.size());
  if (rl.weight_version.size() != n || rl.oldest_kv_version.size() != n)  // (rl_tokens fills both)
    throw std::invalid_argument("version_metrics: " + std::to_string(n) + " tokens, " + std::to_string(rl.weight_version.size()) +
                                " weight versions, " + std::to_string(rl.oldest_kv_version.size()) + " oldest KV versions");
  std::map<uint64_t, std::vector<int64_t>> by_v, by_kv;
  for (size_t t = 0; t < n; ++t) {
    by_v[rl.weight_version[t]].push_back(static_cast<int64_t>(t));
    by_kv[rl.oldest_kv_version[t]].push_back(static_cast<int64_t>(t));
  }
  for (const auto& [v, idx] : by_v) subset_metrics(rl, is, cfg, idx, "by_version/" + std::to_string(v), true, out);
  for (const auto& [v, idx] : by_kv) {
    const std::string to = "by_staleness/" + std::to_string(learner_version >= v ? learner_version - v : 0);
    const auto same = by_v.find(v);
    if (same == by_v.end() || same->second != idx) {
      subset_metrics(rl, is, cfg, idx, to, false, out);
      continue;
    }
    // the version's own tokens (kv_policy recompute: every version): its by_version values, not computed again
    for (const char* k : {"/token_mult_prob_error", "/gen_kl_error"})
      if (const auto it = out.find("by_version/" + std::to_string(v) + k); it != out.end()) out[to + k] = it->second;
  }
}
}  // namespace

metric_map learner_metrics(const token_batch_rl& rl, const grpo_config& cfg, double N_global, uint64_t learner_version) {
  const is_result is = is_weights(rl, cfg);
  const double N = N_global - double(is.filtered_tokens);
  metric_map out = policy_loss(rl, cfg, N > 0 ? N : 1.0, is).metrics;
  version_metrics(rl, is, cfg, learner_version, out);
  return out;
}

learner_out learner_grpo(model_runner& run, const model_weights& w, const std::vector<rl_sample>& samples,
                         const grpo_config& cfg, double N_global, uint64_t learner_version, const model_weights* ref,
                         const logit_processing& proc, const std::function<double(double)>& sum_over_learners) {
  learner_out out;
  out.grads.assign(static_cast<size_t>(model_param_layout(w.cfg).total), 0.0f);
  for (size_t i = 0; i < samples.size(); ++i) rl_sample_check(samples[i], i, w.cfg.vocab_size);
  const bool no_tokens = std::all_of(samples.begin(), samples.end(), [](const rl_sample& x) { return x.response.empty(); });
  if (no_tokens) {  // an empty shard still takes part in every collective the others run
    if (cfg.seq_logprob_error_threshold > 0 && sum_over_learners) sum_over_learners(0.0);
    return out;  // (a backward over no tokens packed a K = 0 wgrad operand and threw)
  }
  const learner_batch lb = learner_batch_build(samples, cfg.share_prompts);
  const token_batch& b = lb.b;
  const std::vector<int64_t>& at = lb.at;
  const std::vector<int32_t>& targets = lb.targets;
  token_batch_rl& rl = out.tokens;
  rl = rl_tokens(samples);
  std::vector<float> all(targets.size());
  // ref and c under the same logit processing as g (rl-algorithm.md section 2): the KL term is
  // between the processed distributions (NeMo RL takes it on unfiltered logprobs; with top-k/top-p
  // a token the learner's filter drops has c = -inf and only its clamped k3, no gradient)
  if (ref) {
    run.forward(*ref, b, false);
    run.logprobs(targets, proc, all.data());
    for (int64_t t : at) rl.ref.push_back(all[t]);
  }
  run.forward(w, b, true);
  run.logprobs(targets, proc, all.data());
  for (int64_t t : at) rl.c.push_back(all[t]);
  rl.p = rl.c;  // p := sg(c): one optimizer step per batch
  const is_result is = is_weights(rl, cfg);
  double N = N_global;  // less the tokens of sequences the e_i filter dropped, on every learner
  if (cfg.seq_logprob_error_threshold > 0) {
    const double filtered = double(is.filtered_tokens);
    N -= sum_over_learners ? sum_over_learners(filtered) : filtered;
  }
  out.loss = policy_loss(rl, cfg, N > 0 ? N : 1.0, is);  // N = 0: every token dropped, the loss is 0
  version_metrics(rl, is, cfg, learner_version, out.loss.metrics);  // = learner_metrics with one learner
  std::vector<float> dlogp(targets.size(), 0.0f);
  for (size_t k = 0; k < at.size(); ++k) dlogp[at[k]] = out.loss.dc[k];
  run.backward(w, targets, proc, dlogp.data(), out.grads.data());
  return out;
}

void audit_sums::add(double c, double q, double q8, std::optional<double> ql, double g) {
  // the learner policy's term on ql and g alone (the staleness-0 metrics' rule: c = ql there): a
  // token only the BF16 re-score or the current weights dropped is still the gates'
  if (ql && std::isfinite(*ql) && std::isfinite(g)) {
    learner_kl += k3(*ql - g);
    learner_tmpe += std::exp(std::fabs(*ql - g));
    nl += 1;
  } else if (ql) {
    nonfinitel += 1;
  }
  if (!(std::isfinite(c) && std::isfinite(q) && std::isfinite(g))) {
    nonfinite += 1;
    return;
  }
  stale_kl += k3(c - q);
  prec_kl += k3(q - g);
  prec_tmpe += std::exp(std::fabs(q - g));
  n += 1;
  if (std::isnan(q8)) return;  // not measured
  if (std::isinf(q8)) {        // the FP8 re-score's top-k dropped it: no split terms, counted
    nonfinite8 += 1;
    return;
  }
  wq_kl += k3(q - q8);
  kern_kl += k3(q8 - g);
  n8 += 1;
}

void audit_sums::write(metric_map& out) const {
  if (nl + nonfinitel > 0) out["audit/nonfinite_learner_tokens"] = nonfinitel;
  if (nl > 0) {
    out["audit/learner_token_mult_prob_error"] = learner_tmpe / nl;
    out["audit/learner_gen_kl_error"] = learner_kl / nl;
  }
  if (n + nonfinite == 0) return;
  out["audit/tokens"] = n;
  out["audit/nonfinite_tokens"] = nonfinite;
  if (n8 + nonfinite8 > 0) out["audit/nonfinite_fp8_tokens"] = nonfinite8;
  if (n == 0) return;
  out["audit/staleness_kl"] = stale_kl / n;
  out["audit/precision_kl"] = prec_kl / n;
  out["audit/precision_token_mult_prob_error"] = prec_tmpe / n;
  if (n8 == 0) return;
  out["audit/weight_quant_kl"] = wq_kl / n8;
  out["audit/kernel_kv_kl"] = kern_kl / n8;
}

void audit_count::write(metric_map& out) const {
  out["audit/trajectories"] = double(trajectories);
  out["audit/trajectories_spanning"] = double(spanning);
  out["audit/skipped_kept_kv"] = double(skipped_kept_kv);
  out["audit/skipped_not_held"] = double(skipped_not_held);
}

namespace {
// Sample indices taking one trajectory of each prompt's group in turn (first appearance order):
// the first `want` in batch order were the first few prompts' groups -- correlated tokens, a noisy
// per-step reading for the health gates.
std::vector<size_t> prompts_in_turn(const std::vector<rl_sample>& samples) {
  std::map<uint64_t, std::vector<size_t>> of;
  std::vector<uint64_t> prompts;
  for (size_t i = 0; i < samples.size(); ++i) {
    auto& g = of[samples[i].prompt_id];
    if (g.empty()) prompts.push_back(samples[i].prompt_id);
    g.push_back(i);
  }
  std::vector<size_t> order;
  order.reserve(samples.size());
  for (size_t k = 0; order.size() < samples.size(); ++k)
    for (uint64_t id : prompts)
      if (k < of[id].size()) order.push_back(of[id][k]);
  return order;
}
}  // namespace

audit_count audit_rescore(model_runner& run, const model_weights& current, const std::function<audit_weights(uint64_t)>& at_version,
                          const std::vector<rl_sample>& samples, int64_t want, const logit_processing& proc, audit_sums& sums) {
  audit_count n;
  std::map<uint64_t, audit_weights> held;  // at_version's answer for every version met
  std::vector<const rl_sample*> picked;
  std::set<uint64_t> used;  // the versions of the picked trajectories' tokens
  for (size_t i : prompts_in_turn(samples)) {
    const rl_sample& smp = samples[i];
    if (n.trajectories >= want) break;
    if (smp.response.empty()) continue;
    if (smp.oldest_kv_version != smp.weight_version) {
      ++n.skipped_kept_kv;
      continue;
    }
    const std::set<uint64_t> mine(smp.weight_version.begin(), smp.weight_version.end());
    bool all_held = true;
    for (uint64_t v : mine) {
      auto it = held.find(v);
      if (it == held.end()) it = held.emplace(v, at_version(v)).first;
      all_held = all_held && it->second.q != nullptr;
    }
    if (!all_held) {
      ++n.skipped_not_held;
      continue;
    }
    picked.push_back(&smp);
    used.insert(mine.begin(), mine.end());
    ++n.trajectories;
    n.spanning += mine.size() > 1;
  }
  if (picked.empty()) return n;
  // one batch of every picked trajectory (rows never mix: each token's logprob is what a forward
  // of its sequence alone gives), one forward per weight set: the current weights, then each
  // version's re-score weights
  token_batch b;  // [T = each picked trajectory's prompt + response]
  std::vector<size_t> at;  // the row whose target is picked trajectory k's first response token
  for (const rl_sample* smp : picked) {
    auto seq = smp->prompt;
    seq.insert(seq.end(), smp->response.begin(), smp->response.end());
    at.push_back(static_cast<size_t>(b.T()) + smp->prompt.size() - 1);
    b.add(seq);
  }
  const auto targets = b.next_targets();
  const size_t T = targets.size();
  std::vector<float> c(T), q(T), q8(T), ql(T);
  run.forward(current, b, false);
  run.logprobs(targets, proc, c.data());
  for (uint64_t v : used) {
    const audit_weights& wv = held.at(v);
    run.forward(*wv.q, b, false);
    run.logprobs(targets, proc, q.data());
    if (wv.q8) {
      run.forward(*wv.q8, b, false);
      run.logprobs(targets, proc, q8.data());
    }
    // the learner policy's re-score: c's, q's or q8's where those are its weights, else its own forward
    const float* l = !wv.learner               ? nullptr
                     : wv.learner == &current ? c.data()
                     : wv.learner == wv.q     ? q.data()
                     : wv.learner == wv.q8    ? q8.data()
                                              : ql.data();
    if (l == ql.data()) {
      run.forward(*wv.learner, b, false);
      run.logprobs(targets, proc, ql.data());
    }
    for (size_t k = 0; k < picked.size(); ++k) {
      const rl_sample& smp = *picked[k];
      for (size_t j = 0; j < smp.response.size(); ++j) {
        if (smp.weight_version[j] != v) continue;
        const size_t t = at[k] + j;  // the target of row t is response token j
        sums.add(c[t], q[t], wv.q8 ? double(q8[t]) : std::nan(""), l ? std::optional<double>(l[t]) : std::nullopt,
                 smp.gen_logprobs[j]);
      }
    }
  }
  return n;
}

void rl_batch_metrics(const std::vector<rl_sample>& s, uint64_t learner_version, int64_t max_staleness, metric_map& out) {
  if (s.empty()) return;
  double sum = 0, sq = 0, acc = 0, len = 0;
  std::map<uint64_t, double> hist, scale_hist;
  for (int64_t d = 0; d <= max_staleness; ++d) hist[static_cast<uint64_t>(d)] = 0;  // every bin, also empty ones
  for (const auto& x : s) {
    sum += x.reward;
    sq += double(x.reward) * x.reward;
    acc += x.reward > 0.5f;
    len += double(x.response.size());
    for (uint64_t v : x.weight_version) hist[learner_version >= v ? learner_version - v : 0] += 1;
    for (uint64_t v : x.scale_version) scale_hist[learner_version >= v ? learner_version - v : 0] += 1;
  }
  for (const auto& [d, c] : scale_hist) out["scale_lag_hist/" + std::to_string(d)] = c;
  const double n = double(s.size()), mean = sum / n;
  out["reward_mean"] = mean;
  out["reward_std"] = std::sqrt(std::max(0.0, sq / n - mean * mean));
  out["accuracy"] = acc / n;
  out["response_length"] = len / n;
  for (const auto& [d, c] : hist) out[std::string(kStalenessHistPrefix) + std::to_string(d)] = c;
}

std::vector<int32_t> example_encode(const dataset& d, size_t i, const tokenizer& tok, bool answer) {
  try {
    return answer ? tok.encode(d.items.at(i).answer, false) : tok.encode(d.items.at(i).prompt, true);
  } catch (const std::exception& e) {
    throw std::invalid_argument(example_where(d, i) + (answer ? ": answer: " : ": prompt: ") + e.what());
  }
}

std::vector<double> sft_train(model_params& params, adamw_state& opt, const dataset& data, const tokenizer& tok,
                              const sft_config& cfg, const std::function<void(int64_t, double)>& on_step) {
  if (data.items.empty()) throw std::invalid_argument("sft: empty dataset");
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> enc;  // (prompt, answer) ids of every example, checked first
  for (size_t i = 0; i < data.items.size(); ++i) {
    auto prompt = example_encode(data, i, tok, false);  // the prompt's error first
    auto answer = example_encode(data, i, tok, true);
    // the row fed: BOS prompt answer EOS without its last token (a long example failed at the step
    // that drew it, naming neither it nor the limit)
    const size_t fed = prompt.size() + answer.size() + (tok.eos >= 0 ? 1 : 0) - 1;
    if (static_cast<int64_t>(fed) > params.cfg.max_position_embeddings)
      throw std::invalid_argument(example_where(data, i) + ": " + std::to_string(fed) +
                                  " tokens (prompt and answer), more than the model's max_position_embeddings " +
                                  std::to_string(params.cfg.max_position_embeddings));
    enc.emplace_back(std::move(prompt), std::move(answer));
  }
  auto be = make_cpu_backend();
  model_runner run(*be);
  rng g(cfg.seed);
  std::vector<double> losses;
  for (int64_t step = 0; step < cfg.steps; ++step) {
    token_batch b;  // rows: BOS prompt answer EOS without the EOS (its row predicts nothing)
    std::vector<float> mask;
    std::vector<int32_t> targets;  // row t predicts token t + 1
    for (int64_t i = 0; i < cfg.batch; ++i) {
      const auto& [p, answer] = enc[g.next_u64() % enc.size()];
      auto a = answer;
      if (tok.eos >= 0) a.push_back(tok.eos);
      std::vector<int32_t> seq = p;
      seq.insert(seq.end(), a.begin(), a.end());
      b.add(std::vector<int32_t>(seq.begin(), seq.end() - 1));
      for (size_t t = 0; t + 1 < seq.size(); ++t) {
        targets.push_back(seq[t + 1]);
        mask.push_back(t + 1 >= p.size() ? 1.0f : 0.0f);  // loss on the answer and EOS
      }
    }
    double n = 0, loss = 0;
    for (float m : mask) n += m;
    if (n == 0)  // the loss would be -0/0: NaN into every gradient
      throw std::invalid_argument("sft: step " + std::to_string(step) + "'s batch of " + std::to_string(cfg.batch) +
                                  " examples has no answer token to learn (empty answers and no EOS token)");
    auto w = model_weights_build(*be, params.cfg, cfg.policy.training(), {&params, nullptr, nullptr}, true);
    run.forward(*w, b, true);
    std::vector<float> lp(targets.size()), dl(targets.size());
    run.logprobs(targets, {}, lp.data());
    for (size_t t = 0; t < targets.size(); ++t) {
      loss -= mask[t] * lp[t] / n;
      dl[t] = static_cast<float>(-mask[t] / n);
    }
    std::vector<float> grads(static_cast<size_t>(params.layout.total), 0.0f);
    run.backward(*w, targets, {}, dl.data(), grads.data());
    adamw_step(cfg.opt, params.layout, params.data.data(), grads.data(), opt);
    losses.push_back(loss);
    if (on_step) on_step(step, loss);
  }
  return losses;
}

eval_result evaluate(generation_engine& eng, const dataset& data, const tokenizer& tok, verifier_kind vk,
                     int32_t max_tokens, uint64_t seed) {
  eval_result r;
  r.n = static_cast<int64_t>(data.items.size());
  for (size_t i = 0; i < data.items.size(); ++i) example_encode(data, i, tok, false);  // every prompt, named, before any runs
  const auto stops = stop_ids(eng.model(), tok);
  for (float temp : {0.0f, 1.0f}) {
    auto reqs = rollout_requests(data.items, 0, tok, stops, 1, {temp, 0, 1.0f}, max_tokens, seed);
    for (auto& q : reqs) {
      const uint64_t id = q.id;  // the example's index: its file and line name it
      try {
        eng.submit(std::move(q));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(example_where(data, id) + ": " + e.what());
      }
    }
    double correct = 0;
    for (const auto& res : eng.run_to_completion())
      correct += verify(vk, tok.decode(response_body(res.tokens, stops), true), data.items[res.id].answer);
    (temp == 0.0f ? r.greedy_accuracy : r.sampled_accuracy) = correct / double(r.n);
  }
  return r;
}

}  // namespace fp8rl::models
