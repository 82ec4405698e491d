// models/rl/grpo.cpp -- advantages, importance weights, policy loss, metrics.
#include "models/rl/grpo.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace fp8rl::models {

std::optional<is_mode> is_mode_parse(std::string_view s) {
  if (s == "none") return is_mode::none;
  if (s == "tis") return is_mode::tis;
  if (s == "icepop") return is_mode::icepop;
  if (s == "seq-mask-tis") return is_mode::seq_mask_tis;
  return std::nullopt;
}

std::string_view is_mode_name(is_mode m) {
  switch (m) {
    case is_mode::none: return "none";
    case is_mode::tis: return "tis";
    case is_mode::icepop: return "icepop";
    case is_mode::seq_mask_tis: return "seq-mask-tis";
  }
  return "?";
}

std::vector<float> grpo_advantages(const std::vector<float>& r, int64_t G, bool normalize_std, float eps, bool leave_one_out) {
  if (G <= 0 || r.size() % static_cast<size_t>(G))
    throw std::invalid_argument("grpo_advantages: " + std::to_string(r.size()) + " rewards are not groups of " + std::to_string(G));
  std::vector<float> a(r.size());
  for (size_t g0 = 0; g0 < r.size(); g0 += static_cast<size_t>(G)) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < G; ++i) {
      if (!std::isfinite(r[g0 + i]))  // its whole group's advantages would be NaN
        throw std::invalid_argument("grpo_advantages: reward " + std::to_string(g0 + i) + " is " + std::to_string(r[g0 + i]));
      mean += r[g0 + i];
    }
    const double sum = mean;
    mean /= double(G);
    for (int64_t i = 0; i < G; ++i) var += (r[g0 + i] - mean) * (r[g0 + i] - mean);
    const double sd = G > 1 ? std::sqrt(var / double(G - 1)) : 0.0;  // unbiased, as torch.std
    for (int64_t i = 0; i < G; ++i) {
      double base = mean, s = sd;
      if (leave_one_out && G > 1) {  // the others' mean and population std
        base = (sum - r[g0 + i]) / double(G - 1);
        double sq = 0;
        for (int64_t j = 0; j < G; ++j)
          if (j != i) sq += (r[g0 + j] - base) * (r[g0 + j] - base);
        s = std::sqrt(sq / double(G - 1));
      }
      const double d = G > 1 ? r[g0 + i] - base : 0.0;  // identical rewards: A = 0 (also when eps = 0)
      // the others all equal (std 0; "1 right of G" under leave-one-out): r - baseline, as NeMo RL
      // divides only where std > 0 (d / eps made it +-1e6)
      a[g0 + i] = static_cast<float>(!normalize_std || d == 0.0 || s == 0.0 ? d : d / (s + eps));
    }
  }
  return a;
}

namespace {
// The batch's arrays agree, every token names a sequence of the batch, and the advantage of every
// token in the loss is finite: a short array or a sequence index out of range was read (or written)
// past its end, and a NaN advantage made the loss and every gradient NaN without a word.
void batch_check(const token_batch_rl& b) {
  const size_t n = b.c.size();
  if (b.p.size() != n || b.g.size() != n || b.adv.size() != n || b.mask.size() != n || b.seq.size() != n)
    throw std::invalid_argument("policy_loss: c, p, g, adv, mask, seq must have the same length");
  for (size_t t = 0; t < n; ++t) {
    if (b.seq[t] < 0 || b.seq[t] >= b.n_seqs)
      throw std::invalid_argument("policy_loss: token " + std::to_string(t) + " names sequence " + std::to_string(b.seq[t]) +
                                  " of " + std::to_string(b.n_seqs));
    if (b.mask[t] > 0 && !std::isfinite(b.adv[t]))
      throw std::invalid_argument("policy_loss: token " + std::to_string(t) + " has advantage " + std::to_string(b.adv[t]));
  }
}
}  // namespace

is_result is_weights(const token_batch_rl& b, const grpo_config& cfg) {
  batch_check(b);
  const int64_t n = b.size();
  is_result out;
  out.w.assign(static_cast<size_t>(n), 0.0f);
  out.mask = b.mask;
  out.filtered.assign(static_cast<size_t>(n), 0);
  // a non-finite logprob leaves the actor term and the mismatch metrics, counted (it stays in N and
  // keeps its KL term): c = p = -inf where the learner's top-k/top-p no longer keeps a token
  // sampled under older weights (its true weight pi_train/pi_inf is 0)
  for (int64_t t = 0; t < n; ++t)
    if (out.mask[t] > 0 && !(std::isfinite(b.c[t]) && std::isfinite(b.p[t]) && std::isfinite(b.g[t]))) {
      ++out.nonfinite;
      out.mask[t] = 0.0f;
    }
  // optional sequence filter on e_i = mean_t exp(|g - p|)
  if (cfg.seq_logprob_error_threshold > 0.0f) {
    std::vector<double> e(static_cast<size_t>(b.n_seqs), 0.0), cnt(static_cast<size_t>(b.n_seqs), 0.0);
    for (int64_t t = 0; t < n; ++t)
      if (out.mask[t] > 0) { e[b.seq[t]] += std::exp(std::fabs(double(b.g[t]) - b.p[t])); cnt[b.seq[t]] += 1; }
    for (int64_t s = 0; s < b.n_seqs; ++s)
      if (cnt[s] > 0 && e[s] / cnt[s] > cfg.seq_logprob_error_threshold) {
        ++out.masked_seqs;
        for (int64_t t = 0; t < n; ++t)
          if (b.seq[t] == s) {
            out.filtered[t] = 1;
            out.filtered_tokens += b.mask[t] > 0;  // non-finite ones too: the whole sequence leaves N
            out.mask[t] = 0.0f;
          }
      }
  }
  std::vector<double> seq_sum(static_cast<size_t>(b.n_seqs), 0.0), seq_cnt(static_cast<size_t>(b.n_seqs), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    double w = std::exp(static_cast<double>(b.p[t]) - b.g[t]);
    if (!std::isfinite(static_cast<float>(w))) {  // NaN, or past FP32 (p - g > 88.7): out of the step, counted
      if (out.mask[t] > 0) ++out.nonfinite;
      out.mask[t] = 0.0f;
      w = 0.0;
    }
    float wt = static_cast<float>(w);
    if (out.mask[t] > 0 && (cfg.is == is_mode::tis || cfg.is == is_mode::icepop) && (w > cfg.is_hi || w < cfg.is_lo)) ++out.oob;
    switch (cfg.is) {
      case is_mode::none: break;
      case is_mode::tis: wt = std::clamp(wt, cfg.is_lo, cfg.is_hi); break;
      case is_mode::icepop: if (w < cfg.is_lo || w > cfg.is_hi) wt = 0.0f; break;
      case is_mode::seq_mask_tis:
        if (out.mask[t] > 0 && std::isfinite(b.p[t] - b.g[t])) { seq_sum[b.seq[t]] += double(b.p[t]) - b.g[t]; seq_cnt[b.seq[t]] += 1; }
        break;
    }
    out.w[t] = wt;
  }
  std::vector<char> alive(static_cast<size_t>(b.n_seqs), 0);
  for (int64_t t = 0; t < n; ++t) if (out.mask[t] > 0) alive[b.seq[t]] = 1;
  for (char a : alive) out.valid_seqs += a;
  if (cfg.is == is_mode::seq_mask_tis)
    for (int64_t s = 0; s < b.n_seqs; ++s) {
      if (seq_cnt[s] == 0) continue;
      const double rho = std::exp(seq_sum[s] / seq_cnt[s]);
      if (rho < cfg.is_lo || rho > cfg.is_hi) {
        ++out.oob_seqs;
        for (int64_t t = 0; t < n; ++t) if (b.seq[t] == s) out.w[t] = 0.0f;
      }
    }
  return out;
}

namespace {
void policy_loss_check(const token_batch_rl& b, const grpo_config& cfg, double N) {
  batch_check(b);
  if (cfg.kl_beta > 0 && b.ref.size() != b.c.size()) throw std::invalid_argument("policy_loss: kl_beta > 0 needs ref logprobs");
  if (!(N > 0)) throw std::invalid_argument("policy_loss: N (global token count) must be > 0");
}
}  // namespace

loss_result policy_loss(const token_batch_rl& b, const grpo_config& cfg, double N) {
  policy_loss_check(b, cfg, N);  // before is_weights reads the arrays
  return policy_loss(b, cfg, N, is_weights(b, cfg));
}

loss_result policy_loss(const token_batch_rl& b, const grpo_config& cfg, double N, const is_result& is) {
  policy_loss_check(b, cfg, N);
  for (const auto& [name, size] : {std::pair<const char*, size_t>{"w", is.w.size()}, {"mask", is.mask.size()},
                                    {"filtered", is.filtered.empty() ? b.c.size() : is.filtered.size()}})
    if (size != b.c.size())
      throw std::invalid_argument(std::string("policy_loss: IS ") + name + " has " + std::to_string(size) + " entries for " +
                                  std::to_string(b.c.size()) + " tokens (weights of another batch)");
  const int64_t n = b.size();
  loss_result out;
  out.dc.assign(static_cast<size_t>(n), 0.0f);
  double clipped = 0;
  for (int64_t t = 0; t < n; ++t) {
    // the KL's mask: every token in N -- it is not importance-weighted, so a token whose weight
    // was not finite keeps its KL term (c = -inf: the clamps make it 10 with no gradient)
    const double mk = is.filtered.empty() || !is.filtered[t] ? b.mask[t] : 0.0;
    if (mk == 0.0) continue;
    const double m = is.mask[t];  // the actor's: 0 where the weight or a logprob was not finite
    double g = 0.0;
    if (m != 0.0) {
      const double A = b.adv[t], r = std::exp(static_cast<double>(b.c[t]) - b.p[t]);
      const double rc = std::clamp(r, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
      const double u = -A * r, v = -A * rc;
      double L, dL;  // dL/dc
      if (u >= v) { L = u; dL = -A * r; }
      else { L = v; dL = (r == rc) ? -A * r : 0.0; ++clipped; }
      if (cfg.dual_clip > 1.0f && A < 0 && -cfg.dual_clip * A < L) { L = -cfg.dual_clip * A; dL = 0.0; }
      const double w = is.w[t];
      out.actor += m * w * L / N;
      g = m * w * dL / N;
    }
    const double lr_raw = cfg.kl_beta > 0 ? static_cast<double>(b.ref[t]) - b.c[t] : NAN;
    if (!std::isnan(lr_raw)) {  // NaN: both logprobs -inf (or one NaN), no term
      const double lr = std::clamp(lr_raw, -20.0, 20.0);
      const double k3_raw = k3(lr), k3_clamped = std::clamp(k3_raw, -10.0, 10.0);
      out.kl += cfg.kl_beta * mk * k3_clamped / N;
      if (lr == lr_raw && k3_clamped == k3_raw) g += cfg.kl_beta * mk * (1.0 - std::exp(lr)) / N;
    }
    out.dc[t] = static_cast<float>(g);
  }
  out.loss = out.actor + out.kl;
  mismatch_metrics(b, is, cfg, N, "", out.metrics);
  double nm = 0;
  for (int64_t t = 0; t < n; ++t) nm += is.mask[t];
  out.metrics["clip_fraction"] = nm > 0 ? clipped / nm : 0.0;
  out.metrics["loss"] = out.loss;
  out.metrics["kl_penalty"] = out.kl;
  return out;
}

void mismatch_metrics(const token_batch_rl& b, const is_result& is, const grpo_config& cfg, double N,
                      const std::string& prefix, metric_map& out) {
  const int64_t n = b.size();
  double tmpe = 0, gkl = 0, pkl = 0, js = 0, sir = 0, sir2 = 0, ent = 0, ntok = 0;
  // N counts the tokens whose logprob or weight was not finite (the loss keeps them, w~ = 0), but
  // they have no mismatch term: over N they read a perfect match as 1 - their share.
  double nonfinite_in_n = 0;
  // e_i over each sequence's finite tokens before the filter, and over those left after it
  const size_t S = static_cast<size_t>(b.n_seqs);
  std::vector<double> e(S, 0.0), cnt(S, 0.0), e_all(S, 0.0), cnt_all(S, 0.0);
  for (int64_t t = 0; t < n; ++t)
    if (b.mask[t] > 0 && std::isfinite(b.g[t] - b.p[t])) {
      e_all[b.seq[t]] += std::exp(std::fabs(double(b.g[t]) - b.p[t]));
      cnt_all[b.seq[t]] += 1;
    }
  for (int64_t t = 0; t < n; ++t) {
    const double m = is.mask[t];
    if (m == 0.0) {  // out of the metrics: filtered (out of N too), or not finite (in N)
      nonfinite_in_n += b.mask[t] > 0 && !(is.filtered.size() && is.filtered[t]);
      continue;
    }
    const double g = b.g[t], p = b.p[t], d = p - g;
    tmpe += m * std::exp(std::fabs(g - p));
    gkl += m * k3(d);
    pkl += m * k3(-d);
    // the log of the mixture 0.5 e^p + 0.5 e^g, shifted by the larger: finite below -745 (it was -inf)
    const double hi = std::max(p, g), l = hi + std::log(0.5 * std::exp(p - hi) + 0.5 * std::exp(g - hi));
    js += m * 0.5 * (k3(p - l) + k3(g - l));
    sir += m * is.w[t];
    sir2 += m * double(is.w[t]) * is.w[t];
    ent += -m * std::exp(static_cast<double>(b.c[t]) - g) * b.c[t];
    ntok += m;
    e[b.seq[t]] += std::exp(std::fabs(g - p));
    cnt[b.seq[t]] += 1;
  }
  const double Nm = N - nonfinite_in_n;
  auto per_token = [&](double sum) { return Nm > 0 ? sum / Nm : 0.0; };
  out[prefix + "token_mult_prob_error"] = per_token(tmpe);
  out[prefix + "gen_kl_error"] = per_token(gkl);
  out[prefix + "policy_kl_error"] = per_token(pkl);
  out[prefix + "js_divergence_error"] = per_token(js);
  out[prefix + "sampling_importance_ratio"] = sir / N;  // w~ = 0 is their weight: over N, as the loss
  out[prefix + "approx_entropy"] = per_token(ent);
  // Kish's effective sample size of the weights the loss uses, as a share of the tokens with a
  // term: 1 when all are equal (on policy), 1/n when one token carries the step (PipelineRL logs
  // its ratio sums for this); 0 when no weight is left
  out[prefix + "is_ess"] = sir2 > 0 ? sir * sir / (ntok * sir2) : 0.0;
  auto seq_stats = [&](const std::vector<double>& es_sum, const std::vector<double>& es_cnt, const std::string& suffix) {
    double emax = 0, emin = 0, esum = 0, nseq = 0;
    for (size_t s = 0; s < S; ++s) {
      if (es_cnt[s] == 0) continue;
      const double es = es_sum[s] / es_cnt[s];
      emax = nseq == 0 ? es : std::max(emax, es);
      emin = nseq == 0 ? es : std::min(emin, es);
      esum += es;
      nseq += 1;
    }
    out[prefix + "seq_mult_prob_error_max" + suffix] = emax;
    out[prefix + "seq_mult_prob_error_mean" + suffix] = nseq > 0 ? esum / nseq : 0.0;
    out[prefix + "seq_mult_prob_error_min" + suffix] = emin;
  };
  seq_stats(e_all, cnt_all, "");
  seq_stats(e, cnt, "_after_mask");
  if (b.reward.size() == S) {  // of the sequences the e_i filter dropped, the percentage that were correct
    std::vector<char> dropped(S, 0);
    for (int64_t t = 0; t < n; ++t) dropped[b.seq[t]] |= !is.filtered.empty() && is.filtered[t];
    double masked = 0, correct = 0;
    for (size_t s = 0; s < S; ++s) {
      masked += dropped[s];
      correct += dropped[s] && b.reward[s] > 0.5f;
    }
    out[prefix + "masked_correct_pct"] = masked > 0 ? 100.0 * correct / masked : 0.0;
  }
  out[prefix + "is_oob_ratio"] = cfg.is == is_mode::seq_mask_tis ? (is.valid_seqs > 0 ? double(is.oob_seqs) / double(is.valid_seqs) : 0.0)
                                                                   : (ntok > 0 ? double(is.oob) / ntok : 0.0);
  out[prefix + "nonfinite_is_weights"] = static_cast<double>(is.nonfinite);
  out[prefix + "num_masked_seqs"] = static_cast<double>(is.masked_seqs);
}

}  // namespace fp8rl::models
