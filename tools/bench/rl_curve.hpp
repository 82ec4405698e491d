// tools/bench/rl_curve.hpp -- a training run's validation curve, read from its metrics.jsonl rows:
// when it first held an accuracy (smoothed over a window of evaluations) and where it ended.
// Used by bench-rl's matched-reward comparison (anchors.md §3.8: async FP8 against the synchronous
// BF16 baseline at the same reward).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace fp8rl::bench {

struct eval_point {
  double step = 0, elapsed_s = 0, accuracy = 0;
};

// The evaluation rows of a run (those with `val_accuracy`: greedy validation accuracy), in order;
// a row's step must be past the one before (a run's rows, not several runs' concatenated).
inline std::vector<eval_point> curve_of(const std::vector<nlohmann::json>& rows) {
  std::vector<eval_point> c;
  for (const auto& r : rows) {
    if (!r.contains("val_accuracy")) continue;
    const eval_point p{r.at("step").get<double>(), r.at("elapsed_s").get<double>(), r.at("val_accuracy").get<double>()};
    if (!c.empty() && p.step <= c.back().step)
      throw std::runtime_error("metrics: evaluation at step " + nlohmann::json(p.step).dump() + " after step " +
                               nlohmann::json(c.back().step).dump());
    c.push_back(p);
  }
  return c;
}

// The first evaluation at which the mean accuracy of the last `window` evaluations (it the last)
// reaches `target`; none if no window does. Why a window: one evaluation of 200 examples near 0.9
// has a binomial std of ~0.02, so a single lucky evaluation would stop the clock early.
inline std::optional<eval_point> curve_reach(const std::vector<eval_point>& c, double target, size_t window) {
  if (window == 0) throw std::invalid_argument("curve_reach: window 0");
  double sum = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    sum += c[i].accuracy;
    if (i >= window) sum -= c[i - window].accuracy;
    // accuracies are counts / n: a tie with the target must not be lost to the sum's rounding (~1e-16)
    if (i + 1 >= window && sum / static_cast<double>(window) >= target - 1e-12) return c[i];
  }
  return std::nullopt;
}

// Mean accuracy of the last n evaluations (all of them when the run has fewer).
inline double curve_final(const std::vector<eval_point>& c, size_t n) {
  if (c.empty() || n == 0) throw std::invalid_argument("curve_final: no evaluation to average");
  const size_t from = c.size() > n ? c.size() - n : 0;
  double sum = 0;
  for (size_t i = from; i < c.size(); ++i) sum += c[i].accuracy;
  return sum / static_cast<double>(c.size() - from);
}

}  // namespace fp8rl::bench
