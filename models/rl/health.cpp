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

std::optional<health_source> health_source_parse(std::string_view s) {
  if (s == "trained") return health_source::trained;
  if (s == "audit") return health_source::audit;
  return std::nullopt;
}

namespace {
constexpr double kTmpeStepLimit = 1.1;  // NeMo RL's FP8 nightlies: steps above it counted
const char* source_label(health_source s) { return s == health_source::audit ? "audit, every staleness" : "staleness 0"; }
size_t min_counted(const health_config& c) { return static_cast<size_t>(std::max<int64_t>(1, c.min_steps)); }
}  // namespace

std::string health_monitor::summary() const {
  const size_t n = counted();
  if (n < min_counted(c_)) return "";
  std::string s = fmt::format("{}: median token_mult_prob_error {:.4f} over {} step(s)", source_label(c_.source), tmpe_median(), n);
  if (!c_.fp8_kv)
    s += fmt::format(", {} above {}, mean gen_kl_error of the first {} {:.5f}", above_, kTmpeStepLimit, min_counted(c_), kl_first_mean_);
  return s;
}

double health_monitor::tmpe_median() const {
  return low_.size() > high_.size() ? low_.top() : (low_.top() + high_.top()) / 2;
}

std::vector<health_failure> health_monitor::add(uint64_t step, const std::map<std::string, double>& m) {
  std::vector<health_failure> out;
  const bool audit = c_.source == health_source::audit;
  const auto tmpe = m.find(audit ? "audit/learner_token_mult_prob_error" : "by_staleness/0/token_mult_prob_error");
  const auto kl = m.find(audit ? "audit/learner_gen_kl_error" : "by_staleness/0/gen_kl_error");
  if (c_.mode == health_mode::off || tmpe == m.end() || kl == m.end()) return out;
  if (counted() == 0) first_step_ = step;
  auto finite_or_inf = [](double x) { return std::isfinite(x) ? x : INFINITY; };  // NaN would break the ordering
  const double t = finite_or_inf(tmpe->second);
  // into the half it belongs to, then the halves rebalanced (low_ holds ceil(n / 2))
  if (low_.empty() || t <= low_.top()) low_.push(t);
  else high_.push(t);
  if (low_.size() > high_.size() + 1) high_.push(low_.top()), low_.pop();
  else if (high_.size() > low_.size()) low_.push(high_.top()), high_.pop();
  above_ += !(t <= kTmpeStepLimit);
  const size_t n = counted(), min_n = min_counted(c_);
  if (n <= min_n) kl_first_sum_ += finite_or_inf(kl->second);
  if (n < min_n) return out;
  const std::string span = fmt::format("{} step(s) {}..{} {}", n, first_step_, step,
                                       audit ? "audited" : "with tokens sampled under the trained weights");
  const char* which = source_label(c_.source);
  const double limit = c_.tmpe_median_max > 0 ? c_.tmpe_median_max : (c_.fp8_kv ? 2.0 : kTmpeStepLimit);
  // NaN compares false: a non-finite median fails the gate
  if (const double med = tmpe_median(); !(med < limit))
    out.push_back({"tmpe_median_max", fmt::format("median token_mult_prob_error ({}) {:.4f} is not below {} over {} "
                                                  "(health.tmpe_median_max)", which, med, limit, span)});
  if (!c_.fp8_kv) {
    if (!(double(above_) < c_.tmpe_steps_above_max * double(n)))
      out.push_back({"tmpe_steps_above_max", fmt::format("{} of {} have token_mult_prob_error ({}) above {}: not fewer "
                                                         "than {:.0f}% (health.tmpe_steps_above_max)",
                                                         above_, span, which, kTmpeStepLimit, 100 * c_.tmpe_steps_above_max)});
    if (n == min_n) {  // the first min_steps steps' mean, fixed from here on
      kl_first_mean_ = kl_first_sum_ / double(n);
      kl_first_span_ = span;
    }
    // failed from then on at every step (judged once, a resumed run replaying its rows went past it)
    if (!(kl_first_mean_ < c_.gen_kl_mean_max))
      out.push_back({"gen_kl_mean_max", fmt::format("mean gen_kl_error ({}) {:.5f} over the first {} is not below {} "
                                                    "(health.gen_kl_mean_max)", which, kl_first_mean_, kl_first_span_, c_.gen_kl_mean_max)});
  }
  return out;
}

}  // namespace fp8rl::models
