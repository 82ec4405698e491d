// models/rl/health.cpp -- section 7's gates over the step metrics (health.hpp).
#include "models/rl/health.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

namespace fp8rl::models {

std::optional<health_mode> health_mode_parse(std::string_view s) {
  if (s == "fail") return health_mode::fail;
  if (s == "warn") return health_mode::warn;
  if (s == "off") return health_mode::off;
  return std::nullopt;
}

namespace {
constexpr double kTmpeStepLimit = 1.1;  // NeMo RL's FP8 nightlies: steps above it counted

double median_of(std::vector<double> v) {  // v non-empty; the mean of the middle two for even sizes
  const size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + h, v.end());
  if (v.size() % 2) return v[h];
  return (v[h] + *std::max_element(v.begin(), v.begin() + h)) / 2;
}
}  // namespace

std::vector<health_failure> health_monitor::add(uint64_t step, const std::map<std::string, double>& m) {
  std::vector<health_failure> out;
  const auto tmpe = m.find("by_staleness/0/token_mult_prob_error"), kl = m.find("by_staleness/0/gen_kl_error");
  if (c_.mode == health_mode::off || tmpe == m.end() || kl == m.end()) return out;
  if (tmpe_.empty()) first_step_ = step;
  auto finite_or_inf = [](double x) { return std::isfinite(x) ? x : INFINITY; };  // NaN would break the ordering
  tmpe_.push_back(finite_or_inf(tmpe->second));
  gen_kl_.push_back(finite_or_inf(kl->second));
  const size_t n = tmpe_.size(), min_n = static_cast<size_t>(std::max<int64_t>(1, c_.min_steps));
  if (n < min_n) return out;
  const std::string span = fmt::format("{} step(s) {}..{} with tokens sampled under the trained weights", n, first_step_, step);
  const double limit = c_.tmpe_median_max > 0 ? c_.tmpe_median_max : (c_.fp8_kv ? 2.0 : kTmpeStepLimit);
  // NaN compares false: a non-finite median fails the gate
  if (const double med = median_of(tmpe_); !(med < limit))
    out.push_back({"tmpe_median_max", fmt::format("median token_mult_prob_error (staleness 0) {:.4f} is not below {} over {} "
                                                  "(health.tmpe_median_max)", med, limit, span)});
  if (!c_.fp8_kv) {
    const auto above = std::count_if(tmpe_.begin(), tmpe_.end(), [](double x) { return !(x <= kTmpeStepLimit); });
    if (!(double(above) < c_.tmpe_steps_above_max * double(n)))
      out.push_back({"tmpe_steps_above_max", fmt::format("{} of {} have token_mult_prob_error (staleness 0) above {}: not fewer "
                                                         "than {:.0f}% (health.tmpe_steps_above_max)",
                                                         above, span, kTmpeStepLimit, 100 * c_.tmpe_steps_above_max)});
    if (n == min_n) {  // the first min_steps steps' mean, fixed from here on
      double sum = 0;
      for (double x : gen_kl_) sum += x;
      kl_first_mean_ = sum / double(n);
      kl_first_span_ = span;
    }
    // failed from then on at every step (judged once, a resumed run replaying its rows went past it)
    if (!(kl_first_mean_ < c_.gen_kl_mean_max))
      out.push_back({"gen_kl_mean_max", fmt::format("mean gen_kl_error (staleness 0) {:.5f} over the first {} is not below {} "
                                                    "(health.gen_kl_mean_max)", kl_first_mean_, kl_first_span_, c_.gen_kl_mean_max)});
  }
  return out;
}

}  // namespace fp8rl::models
