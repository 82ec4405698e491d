// models/rl/health.hpp -- rl-algorithm.md section 7's gates: NeMo RL's nightly limits on the
// generation-vs-training mismatch, as hard failures (or warnings) of a long run.
// defines: health_mode, health_mode_parse, health_source, health_source_parse, health_config, health_monitor
//
// The gates read the mismatch of tokens sampled under the weights being trained, their KV cache
// computed under them too (by_staleness/0/...: precision and kernel mismatch alone -- a cache kept
// across an adoption, kv_policy keep, counts at its oldest weights; staleness has its own metrics and
// would trip a precision gate in an asynchronous run); a step without such tokens is not counted.
// An asynchronous run has them in few of its steps (7-10 of the default run's 200); with
// source = audit the gates read audit mode's re-score instead (audit/learner_*: every audited token
// under the learner's policy at the version it was sampled under -- the same quantity at every
// staleness, on a sample of audit.samples trajectories a step), so that with audit.every = 1
// every step is judged (the default for asynchronous runs: health.source auto).
//   - median token_mult_prob_error < tmpe_median_max (1.1; 2.0 with an FP8 KV cache, NeMo RL's
//     KV-cache nightly), judged from min_steps counted steps on;
//   - fewer than tmpe_steps_above_max of the counted steps above 1.1 (not with an FP8 KV cache:
//     that nightly asks the median only), from min_steps on;
//   - mean gen_kl_error over the first min_steps counted steps < gen_kl_mean_max (0.003; not with
//     an FP8 KV cache), fixed at the min_steps-th and reported failed at every step from there.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl::models {

enum class health_mode { fail, warn, off };
std::optional<health_mode> health_mode_parse(std::string_view s);
enum class health_source { trained, audit };  // by_staleness/0/*, or audit/learner_*
std::optional<health_source> health_source_parse(std::string_view s);

struct health_config {
  health_mode mode = health_mode::fail;
  health_source source = health_source::trained;
  int64_t min_steps = 20;
  double tmpe_median_max = 0;  // 0: 1.1, or 2.0 with an FP8 KV cache
  double tmpe_steps_above_max = 0.1;
  double gen_kl_mean_max = 0.003;
  bool fp8_kv = false;  // the generation policy has an FP8 KV cache
};

struct health_failure {
  std::string gate;  // its limit's key: tmpe_median_max, tmpe_steps_above_max, gen_kl_mean_max
  std::string text;  // the metric, its value, the limit and the steps it covers
};

class health_monitor {
 public:
  explicit health_monitor(health_config c) : c_(c) {}
  // Adds step `step`'s metrics; returns the gates failed so far (empty: healthy, or not yet judged).
  std::vector<health_failure> add(uint64_t step, const std::map<std::string, double>& metrics);
  size_t counted() const { return low_.size() + high_.size(); }
  const health_config& config() const { return c_; }
  double tmpe_median() const;  // of the counted steps (the mean of the middle two for an even count); counted() > 0
  // What the gates judged, in one line (the source, the median, the steps above 1.1 and the first
  // steps' mean KL where those gates apply); "" before min_steps counted steps.
  std::string summary() const;

 private:
  health_config c_;
  // the counted steps' token_mult_prob_error as a running median: low_ a max-heap of the smaller
  // half (one more for an odd count), high_ a min-heap of the rest -- O(log n) a step (the whole
  // vector copied and partitioned at every step made a resume replaying 60k rows spend 20% there)
  std::priority_queue<double> low_;
  std::priority_queue<double, std::vector<double>, std::greater<>> high_;
  size_t above_ = 0;           // counted steps with token_mult_prob_error above 1.1
  double kl_first_sum_ = 0;    // gen_kl_error summed over the first min_steps counted steps
  uint64_t first_step_ = 0;
  double kl_first_mean_ = 0;  // mean gen_kl_error of the first min_steps counted steps, once there
  std::string kl_first_span_;
};

}  // namespace fp8rl::models
