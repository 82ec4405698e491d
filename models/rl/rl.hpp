// models/rl/rl.hpp -- the RL loop's plain functions (no actors): rollout requests and samples,
// rewards, the learner's GRPO gradient, SFT warm start and evaluation. The actors call exactly
// these; the synchronous loop in tests calls them directly.
// defines: rl_sample, rl_sample_check, group_requests, rl_sample_from_result, group_score, rollout_requests,
//          rollout_samples, learner_grpo, audit_sums, audit_weights, audit_count, audit_rescore, rl_batch_metrics,
//          example_encode, sft_config, sft_train, eval_result, evaluate
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "models/adamw.hpp"
#include "models/generate.hpp"
#include "models/rl/grpo.hpp"
#include "models/rl/task.hpp"
#include "models/tokenizer.hpp"

namespace fp8rl::models {

// One sampled response with everything the learner needs.
struct rl_sample {
  uint64_t prompt_id = 0;           // index of the prompt (groups share it)
  int32_t group_index = 0;          // 0..G-1 within its group
  std::vector<int32_t> prompt, response;
  std::vector<float> gen_logprobs;  // g_t per response token
  std::vector<uint64_t> weight_version, scale_version, oldest_kv_version, oldest_kv_scale_version;
  float reward = 0.0f;
  float advantage = 0.0f;
};

// The ids that end a response: every id of the model's eos_token_id (Llama 3.1 Instruct ends a
// turn with <|eot_id|>, Qwen2.5 Instruct with <|im_end|>, not the tokenizer's end-of-text), then
// the tokenizer's EOS if the model does not list it.
std::vector<int32_t> stop_ids(const model_config& cfg, const tokenizer& tok);
// A response without its final stop token: the text the verifier reads.
std::vector<int32_t> response_body(std::vector<int32_t> tokens, const std::vector<int32_t>& stops);

// One prompt's group (what a rollout actor runs per work item; rollout_requests per prompt):
// G requests with ids prompt_id * G + j (j < G), each of the prompt's tokens and stopping at any
// of `stops` (stop_ids).
std::vector<gen_request> group_requests(const std::vector<int32_t>& prompt, uint64_t prompt_id, int64_t G,
                                        const logit_processing& proc, int32_t max_tokens, uint64_t seed,
                                        const std::vector<int32_t>& stops);
// A result as the learner's sample (its arrays moved from r): prompt_id = id / G, group_index =
// id % G; reward and advantage not yet set.
rl_sample rl_sample_from_result(gen_result&& r, int64_t G);
// One group's rewards (each response without its stop token, decoded and verified against
// `answer`) and GRPO advantages over the group (the reward actor's step; rollout_samples' per group).
//   group: one prompt's samples in group_index order
void group_score(std::span<rl_sample> group, const std::string& answer, const tokenizer& tok,
                 const std::vector<int32_t>& stops, verifier_kind vk, const grpo_config& cfg);

// G requests per prompt (group_requests): prompt = BOS + tokens(prompt text).
std::vector<gen_request> rollout_requests(const std::vector<task_example>& prompts, uint64_t first_prompt_id,
                                          const tokenizer& tok, const std::vector<int32_t>& stops, int64_t G,
                                          const logit_processing& proc, int32_t max_tokens, uint64_t seed);
// Scores results (their stop token stripped before decoding) and fills advantages group-wise.
// Results must hold complete groups; `answers` maps prompt_id -> answer text.
std::vector<rl_sample> rollout_samples(const std::vector<gen_result>& results, const std::map<uint64_t, std::string>& answers,
                                       const tokenizer& tok, const std::vector<int32_t>& stops, verifier_kind vk,
                                       const grpo_config& cfg);

// The learner's token batch: sample i is prompt + response without its last token (a row whose
// output no loss reads: causal attention shows it to itself alone). With share_prompts,
// consecutive samples with the same prompt (a GRPO group) share it as a prefix sequence
// (token_batch): the prompt but its last token runs once, each sample continues with [last
// prompt token, response but its last]. Logprobs equal those of the full unshared sequences
// bit for bit; the prompt rows' gradients are summed once.
//   at[k]: the row predicting response token j of sample i, k running over (i, j) in order
//   targets[T]: the response token at those rows, -1 elsewhere (no logprob computed)
struct learner_batch {
  token_batch b;
  std::vector<int64_t> at;
  std::vector<int32_t> targets;
};
learner_batch learner_batch_build(const std::vector<rl_sample>& samples, bool share_prompts);

struct learner_out {
  std::vector<float> grads;  // dL/dθ (host, layout of model_params), this shard's share of the global sum
  loss_result loss;          // loss, dc, metrics (learner_metrics of this shard)
  token_batch_rl tokens;     // this shard's response tokens: g, c = p, ref, advantages, versions
};
// prompt + response of each sample: what the calibration runs on (the batch just trained).
std::vector<std::vector<int32_t>> rl_sequences(const std::vector<rl_sample>& samples);
// Sample i's per-token arrays (gen_logprobs, weight_version, scale_version) have one entry per
// response token and, with vocab > 0, its prompt and response are ids in [0, vocab); else
// std::invalid_argument naming the sample, its prompt and the array or token. Samples come over
// the wire: a short array was read past its end, a response token >= V read (in backward wrote)
// past its logits row, and -1 passed as "no target" with logp 0.
void rl_sample_check(const rl_sample& s, size_t i, int64_t vocab);
// The response tokens of `samples` in order (sample i, token j): g, advantage, mask 1, sequence
// index, behaviour version; c, p and ref are left to the caller. Checks each (rl_sample_check).
token_batch_rl rl_tokens(const std::vector<rl_sample>& samples);
// Every step metric of the learner on a token batch: policy_loss's (loss, KL, mismatch, clip
// fraction) and per-version / per-staleness token_mult_prob_error and gen_kl_error. With several
// learners, rank 0 computes it on the whole step's tokens (gathered c), so the metrics do not
// depend on how the batch was sharded.
metric_map learner_metrics(const token_batch_rl& rl, const grpo_config& cfg, double N_global, uint64_t learner_version);
// GRPO gradient on `samples` (one learner's shard) with the global token count N. Computes
// c_t with the training weights, sets p_t := c_t (one optimizer step per batch, rl-algorithm.md
// §4), IS weights from g_t, and per-version / per-staleness metrics (Δ = learner_version - v).
// ref: reference weights for the KL term (cfg.kl_beta > 0). sum_over_learners (several
// learners): the all-reduce that turns this shard's count of filtered tokens into the step's.
learner_out learner_grpo(model_runner& run, const model_weights& w, const std::vector<rl_sample>& samples,
                         const grpo_config& cfg, double N_global, uint64_t learner_version,
                         const model_weights* ref = nullptr, const logit_processing& proc = {},
                         const std::function<double(double)>& sum_over_learners = {});

// Audit mode's sums (rl-algorithm.md §4): per token the learner's c, the behaviour version's BF16
// re-score q, optionally its FP8-weight re-score q8 (NaN: not measured), and the rollout's g. Each
// KL is the k3 estimate in gen_kl_error's form, exp(d) - d - 1 with d = (learner side) - (rollout
// side): staleness d = c - q, precision d = q - g, weight quantization d = q - q8, kernels / FP8
// attention / KV cache d = q8 - g -- so precision_kl at staleness 0 reads on gen_kl_error's scale
// (§7: at or below BF16-vs-BF16 levels). A token with a non-finite logprob (top-k/top-p dropped it
// on one side) has no term: counted apart (audit/nonfinite_tokens), as in the step's metrics; one
// only the FP8 re-score dropped keeps its staleness and precision terms (audit/nonfinite_fp8_tokens).
// ql (nullopt: not measured) re-scores under the learner's own precision policy at the behaviour
// version: ql - g is what by_staleness/0 measures (c = ql there), for tokens of every staleness --
// audit/learner_token_mult_prob_error and audit/learner_gen_kl_error, which the health gates can
// read (health.source = audit); a token with ql or g non-finite counts in
// audit/nonfinite_learner_tokens, whatever c and q are. Unlike by_staleness/0 it keeps sequences
// grpo.seq_logprob_error_threshold drops (their worst tokens) and tokens whose IS weight overflows.
struct audit_sums {
  double stale_kl = 0, prec_kl = 0, prec_tmpe = 0, wq_kl = 0, kern_kl = 0, n = 0, n8 = 0, nonfinite = 0, nonfinite8 = 0;
  double learner_kl = 0, learner_tmpe = 0, nl = 0, nonfinitel = 0;
  void add(double c, double q, double q8, std::optional<double> ql, double g);
  void write(metric_map& out) const;  // audit/* (nothing where no token was audited)
};

// Audit mode's re-scoring of up to `want` trajectories, one of each prompt's group in turn: each
// token under the weights it was sampled under (a sequence sampled across adoptions under
// kv_policy recompute: every token's context was computed under its own version), all picked
// trajectories in one batch forwarded once per version met (rows never mix), with the re-score
// weights `at_version(v)` gives (q: BF16 linear weights; q8: FP8, or none), beside c under
// `current`, and ql under `learner` (the learner's precision policy; may be `current`'s, q's or
// q8's pointer, then not forwarded again), into `sums`. Skipped and counted: a trajectory with a
// token whose KV cache came from older weights (kv_policy keep after an adoption: no forward
// reproduces its context), and one with a version whose weights are no longer held (at_version's
// q is null).
struct audit_weights {
  const model_weights* q = nullptr;
  const model_weights* q8 = nullptr;
  const model_weights* learner = nullptr;
};
struct audit_count {
  int64_t trajectories = 0, spanning = 0, skipped_kept_kv = 0, skipped_not_held = 0;
  void write(metric_map& out) const;  // audit/trajectories, audit/trajectories_spanning, audit/skipped_*
};
audit_count audit_rescore(model_runner& run, const model_weights& current, const std::function<audit_weights(uint64_t)>& at_version,
                          const std::vector<rl_sample>& samples, int64_t want, const logit_processing& proc, audit_sums& sums);

// Reward mean/std, accuracy (reward > 0.5), response length, and token counts by staleness
// (staleness_hist/Δ, Δ = learner_version - weight_version; every bin 0..max_staleness, empty
// ones too) and by scale-version lag (scale_lag_hist/Δ).
void rl_batch_metrics(const std::vector<rl_sample>& samples, uint64_t learner_version, int64_t max_staleness,
                      metric_map& out);

struct sft_config {
  int64_t steps = 300, batch = 32;
  adamw_config opt;
  uint64_t seed = 1;
  precision_policy policy;  // training policy
};
// Supervised warm start on prompt -> answer demonstrations: sequences BOS prompt answer EOS,
// loss on answer + EOS. Returns the loss per step; `on_step(step, loss)` is called if set.
std::vector<double> sft_train(model_params& params, adamw_state& opt, const dataset& data, const tokenizer& tok,
                              const sft_config& cfg, const std::function<void(int64_t, double)>& on_step = {});

// Token ids of example i's prompt (BOS first) or answer; a tokenizer error names the example
// (example_where: its file and line).
std::vector<int32_t> example_encode(const dataset& d, size_t i, const tokenizer& tok, bool answer);

struct eval_result {
  double greedy_accuracy = 0, sampled_accuracy = 0;
  int64_t n = 0;
};
// Validation accuracy with the generation engine (its adopted weights): greedy pass@1 and one
// sampled (temperature 1) pass@1.
eval_result evaluate(generation_engine& eng, const dataset& data, const tokenizer& tok, verifier_kind vk,
                     int32_t max_tokens, uint64_t seed);

}  // namespace fp8rl::models
