// models/rl/grpo.hpp -- GRPO: group advantages, importance sampling with truncation, the PPO
// clipped policy loss with its gradient, and the mismatch metrics (rl-algorithm.md §1, §3, §6).
// defines: is_mode, grpo_config, grpo_advantages, token_batch_rl, is_weights, policy_loss,
//          loss_result, metric_map
//
// Per response token t: mask m_t, generation logprob g_t (rollout), proximal p_t (learner before
// the update; p_t := c_t detached in async mode), current c_t (learner, with gradient), ref_t
// (reference policy, only for KL). N = sum m_t over the global batch, given by the caller.
#pragma once
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl::models {

enum class is_mode : uint8_t { none = 0, tis = 1, icepop = 2, seq_mask_tis = 3 };
std::optional<is_mode> is_mode_parse(std::string_view s);
std::string_view is_mode_name(is_mode m);

struct grpo_config {
  int64_t group_size = 8;
  bool normalize_std = true;   // A = (r - mean) / (std + eps); false: r - mean
  bool leave_one_out = false;  // NeMo RL's leave-one-out baseline (grpo_advantages)
  float adv_eps = 1e-6f;
  float clip_low = 0.2f, clip_high = 0.2f;
  float dual_clip = 0.0f;      // c > 1 enables the dual clip for A < 0
  is_mode is = is_mode::tis;
  float is_lo = 0.0f, is_hi = 2.0f;
  float kl_beta = 0.0f;        // > 0: k3 KL to the reference policy (not IS-weighted)
  float seq_logprob_error_threshold = 0.0f;  // > 0: drop sequences with e_i above it
  bool share_prompts = true;  // learner: a group's common prompt runs once (learner_batch_build)
};

// Advantages for rewards laid out as consecutive groups of `group_size` (rl-algorithm.md section 1):
// A_i = (r_i - mean) / (std + eps), std the sample (G - 1) std as torch.std; with leave_one_out
// NeMo RL's calculate_baseline_and_std_per_prompt: the mean and the population std of the group's
// other rewards, sqrt(mean_{j!=i} r_j^2 - mean_{j!=i}^2) (RLOO's baseline). A reward equal to its
// baseline has A = 0; a group of one has A = 0; where the std is 0 (under leave-one-out: the
// others all equal) A = r - baseline, undivided, as NeMo RL's std > 0 guard.
std::vector<float> grpo_advantages(const std::vector<float>& rewards, int64_t group_size, bool normalize_std, float eps,
                                   bool leave_one_out = false);

// Flattened response tokens of a global batch.
struct token_batch_rl {
  std::vector<float> c, p, g, ref;   // logprobs [n]; ref empty unless kl_beta > 0
  std::vector<float> adv, mask;      // [n]
  std::vector<int32_t> seq;          // [n] sequence index, non-decreasing
  std::vector<uint64_t> weight_version;  // [n] optional: per-token behaviour version
  // [n] optional: the oldest weights the token's context (KV cache) was computed under: older than
  // weight_version after an adoption under kv_policy keep; the staleness breakdown's version
  std::vector<uint64_t> oldest_kv_version;
  std::vector<float> reward;             // [n_seqs] optional: masked_correct_pct (reward > 0.5 correct)
  int64_t n_seqs = 0;
  int64_t size() const { return static_cast<int64_t>(c.size()); }
};

using metric_map = std::map<std::string, double>;

// The k3 estimator's term e^d - d - 1 (>= 0) of a log-ratio d: the KL penalty's, the mismatch
// KLs' (gen_kl_error: d = p - g) and audit mode's.
inline double k3(double d) { return std::exp(d) - d - 1.0; }

// Truncated IS weights w~ (no gradient) and the masks after seq-mask-tis / the sequence
// logprob-error filter. Non-finite raw weights become 0 and are counted in metrics.
struct is_result {
  std::vector<float> w;     // w~ [n]
  std::vector<float> mask;  // the actor term's mask [n]: sequence filter applied, non-finite tokens removed
  int64_t nonfinite = 0, oob = 0, oob_seqs = 0, masked_seqs = 0;
  std::vector<uint8_t> filtered;  // [n] 1: a token of a sequence the e_i filter dropped
  int64_t filtered_tokens = 0;    // masked-in tokens of those sequences: they leave N
  int64_t valid_seqs = 0;       // sequences with a token left in the step (seq-mask-tis's is_oob_ratio)
};
is_result is_weights(const token_batch_rl& b, const grpo_config& cfg);

struct loss_result {
  double loss = 0, actor = 0, kl = 0;
  std::vector<float> dc;  // dL/dc_t [n]
  metric_map metrics;
};
// loss = sum_t m_t w~_t L_t / N + beta sum_t m_t k3_t / N, and its gradient w.r.t. c. N: the
// step's masked-in tokens over all learners once the e_i filter has dropped its sequences
// (is_result::filtered_tokens, summed over ranks); tokens with zeroed weights stay in N. The
// actor term's m_t is is_result::mask; the KL's (not importance-weighted) is the token's mask
// less the filtered sequences, so a token with a non-finite weight keeps its KL term.
loss_result policy_loss(const token_batch_rl& b, const grpo_config& cfg, double N);
// The same with is = is_weights(b, cfg) already computed (the learner needs it for N first).
loss_result policy_loss(const token_batch_rl& b, const grpo_config& cfg, double N, const is_result& is);

// The mismatch metrics of rl-algorithm.md §6 (token and sequence level), with `prefix` prepended
// to each name. Uses g, p, c, w~ and the effective mask. Tokens left out for a non-finite logprob
// or weight have no term: the token metrics divide by N less them (sampling_importance_ratio,
// where their w~ = 0 is a term, by N); where no token has a term they read 0 (rl-algorithm.md §6
// divides by N: fp8rl's departure, so that a perfect match reads 1 with such tokens present).
// Beyond §6: is_ess, (sum w~)^2 / (n sum w~^2) over the n tokens with a term.
void mismatch_metrics(const token_batch_rl& b, const is_result& is, const grpo_config& cfg, double N,
                      const std::string& prefix, metric_map& out);

}  // namespace fp8rl::models
