// models/rl/loop.hpp -- one synchronous GRPO step as plain functions: the reference loop that the
// actor system reproduces exactly with max_staleness = 0, and Q/K/V calibration.
// defines: rl_run_config, rl_state, calibrate_attention, make_bundle, rl_sync_step
#pragma once
#include <memory>

#include "models/rl/rl.hpp"

namespace fp8rl::models {

struct rl_run_config {
  grpo_config grpo;
  adamw_config opt;
  int64_t prompts_per_step = 16;
  int32_t max_new_tokens = 8;
  logit_processing proc;             // sampling (temperature 1 by default)
  precision_policy gen_policy, train_policy;
  verifier_kind verifier = verifier_kind::numeric;
  uint64_t seed = 1;
  float kv_margin = 1.05f;           // calibration: scale = amax_p * margin / 448
  double kv_percentile = 0.999;
};

struct rl_state {
  model_params params;
  adamw_state opt;
  uint64_t version = 0;        // weight_version of params
  uint64_t prompt_cursor = 0;  // next prompt of the training set
  std::vector<std::vector<int32_t>> last_trained;  // sequences of the last step (calibration batch)
  std::shared_ptr<const model_params> ref;  // KL reference policy (grpo.kl_beta > 0): the initial weights
};

// Per-layer, per-head Q/K/V scales from forward passes over `batches` with the given weights
// (rl-algorithm.md §5): per head, the sorted amax sample number round(p * (n - 1)) over the
// batches, then scale = amax * margin / 448 (floored at a tiny positive value so an all-zero
// head is still a valid snapshot entry).
attn_fp8_scales calibrate_attention(model_runner& run, const model_weights& w, const std::vector<token_batch>& batches,
                                    double percentile, float margin);

// The bundle the rollout adopts for `st.params` (FP8 attention scales calibrated on `calib`
// when the generation policy needs them); flushed (optional): what its FP8 weights lost to zero.
std::shared_ptr<quant::weight_bundle> make_bundle(const rl_state& st, const rl_run_config& cfg,
                                                  const std::vector<token_batch>& calib, uint64_t scale_version,
                                                  quant::flush_report* flushed = nullptr);

// A block losing this share of its nonzero FP8 weights to zero is an outlier's doing (its scale
// lifts the rest below 2^-10 of it): Gaussian blocks lose ~1e-5 (amax ~4.5 sigma, and the
// threshold 2^-10 scale_inv is 2.2-4.4e-6 amax under either scale mode).
inline constexpr double kFlushWarnFraction = 0.01;
// A bundle's flush metrics into m: fp8_weights_flushed (nonzero FP8 weights sent to zero) and
// fp8_weights_flushed_worst_block (the largest share of its nonzero weights one block lost).
void flush_metrics_add(int64_t flushed, double worst_block, metric_map& m);
// Warns naming the tensor and block when a block's share passes kFlushWarnFraction; true if so.
bool flush_warn(const quant::flush_report& f, uint64_t version);

// Prompts [cursor, cursor + n) of the dataset (wrapping), as (prompt_id -> example).
std::vector<task_example> take_prompts(const dataset& d, uint64_t cursor, int64_t n);

// One synchronous step: rollout under st.version, rewards, GRPO gradient, AdamW; version += 1.
// The bundle of st.version is calibrated on the batch just trained (rl-algorithm.md §5), or on
// this step's prompts before the first step -- exactly what the calibration actor does, so the
// actor system with max_staleness = 0 reproduces this loop's metrics.
metric_map rl_sync_step(rl_state& st, generation_engine& eng, const dataset& train, const tokenizer& tok,
                        const rl_run_config& cfg);

}  // namespace fp8rl::models
