// tests/models/grpo_test.cpp -- GRPO pieces: advantages, the policy loss's gradient w.r.t. the
// current logprobs by finite differences for every IS mode (with dual clip and KL), each metric
// against a hand-computed example, and the async variant's reduction to the on-policy loss.
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "models/cpu/cpu_backend.hpp"
#include "models/params.hpp"
#include "models/rl/grpo.hpp"
#include "models/rl/health.hpp"
#include "models/rl/loop.hpp"
#include "models/rl/rl.hpp"
#include "models/rl/task.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;

namespace {
token_batch_rl random_batch(uint64_t seed, int64_t nseq, bool kl) {
  rng g(seed);
  token_batch_rl b;
  b.n_seqs = nseq;
  for (int64_t s = 0; s < nseq; ++s) {
    const float adv = static_cast<float>(g.normal());
    const int64_t len = 2 + static_cast<int64_t>(g.next_u64() % 5);
    for (int64_t t = 0; t < len; ++t) {
      const float p = static_cast<float>(-0.3 - 2.0 * g.uniform());
      b.p.push_back(p);
      b.g.push_back(p + static_cast<float>(0.6 * (g.uniform() - 0.5)));
      b.c.push_back(p + static_cast<float>(3.0 * (g.uniform() - 0.5)));  // r in [e^-1.5, e^1.5]: past both clips
      if (kl) b.ref.push_back(p + static_cast<float>(0.3 * (g.uniform() - 0.5)));
      b.adv.push_back(adv);
      b.mask.push_back(g.uniform() < 0.85 ? 1.0f : 0.0f);
      b.seq.push_back(static_cast<int32_t>(s));
    }
  }
  return b;
}

// Three tokens in the loss with g = -1 and A = 1; p = c as given; the sequences they belong to.
token_batch_rl three_tokens(std::vector<float> p, std::vector<int32_t> seq) {
  token_batch_rl b;
  b.g = {-1.0f, -1.0f, -1.0f};
  b.p = b.c = std::move(p);
  b.adv = {1, 1, 1};
  b.mask = {1, 1, 1};
  b.n_seqs = seq.back() + 1;
  b.seq = std::move(seq);
  return b;
}

// true if c_t sits within h of a kink of the clipped objective (r at a clip bound)
bool near_kink(const token_batch_rl& b, const grpo_config& cfg, int64_t t, double h) {
  const double r = std::exp(double(b.c[t]) - b.p[t]);
  const double lo = std::log(1.0 - cfg.clip_low), hi = std::log(1.0 + cfg.clip_high), d = std::log(r);
  if (std::fabs(d - lo) < 2 * h || std::fabs(d - hi) < 2 * h) return true;
  if (cfg.dual_clip > 1.0f && b.adv[t] < 0 && std::fabs(r - cfg.dual_clip) < 2 * h * r) return true;
  return false;
}
}  // namespace

TEST(Grpo, AdvantagesAreGroupNormalized) {
  auto a = grpo_advantages({1, 0, 0, 1, 1, 1, 1, 1}, 4, true, 0.0f);
  const double sd = std::sqrt(1.0 / 3.0);  // unbiased std of {1,0,0,1}: (4 * 0.25 / 3)^0.5, exact steps
  EXPECT_EQ(a[0], static_cast<float>(0.5 / sd));  // FP64, one rounding to FP32: the same bits
  EXPECT_EQ(a[1], static_cast<float>(-0.5 / sd));
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[i], 0.0f);  // identical rewards: no signal
  auto m = grpo_advantages({3, 1}, 2, false, 0.0f);
  EXPECT_EQ(m[0], 1.0f);  // 3 - mean 2, exact
  // eps joins the std in the denominator (every call above has eps = 0)
  EXPECT_EQ(grpo_advantages({1, 0}, 2, true, 0.5f)[0], static_cast<float>(0.5 / (std::sqrt(0.5) + 0.5)));
  EXPECT_THROW(grpo_advantages({1, 2, 3}, 2, true, 0.0f), std::invalid_argument);
  EXPECT_THROW(grpo_advantages({1, std::nanf(""), 0, 1}, 2, true, 0.0f), std::invalid_argument);  // a NaN group
}

// The leave-one-out baseline (NeMo RL's calculate_baseline_and_std_per_prompt): for {1, 0, 0, 1}
// reward 1's others {0, 0, 1} have mean 1/3 and population std sqrt(1/3 - 1/9) = sqrt(2/9), so
// A = (2/3) / sqrt(2/9) = sqrt(2); reward 0's others {1, 0, 1}: mean 2/3, the same std, A = -sqrt(2).
// Unnormalized: r - the others' mean. Identical rewards and a group of one: 0.
TEST(Grpo, LeaveOneOutAdvantagesByHand) {
  const auto a = grpo_advantages({1, 0, 0, 1, 2, 2, 2, 2}, 4, true, 0.0f, true);
  const double sd = std::sqrt(2.0 / 9.0);
  // FP64 sums of thirds in another order, rounded once to FP32: within one FP32 ulp of ours
  EXPECT_NEAR(a[0], (2.0 / 3.0) / sd, fp8rl::tol::fp32_ulps(std::sqrt(2.0), 1));
  EXPECT_NEAR(a[1], -(2.0 / 3.0) / sd, fp8rl::tol::fp32_ulps(std::sqrt(2.0), 1));
  EXPECT_EQ(a[0], a[3]);
  EXPECT_EQ(a[1], a[2]);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[i], 0.0f);
  const auto m = grpo_advantages({3, 1, 2}, 3, false, 0.0f, true);
  EXPECT_EQ(m[0], 1.5f);   // 3 - (1 + 2) / 2
  EXPECT_EQ(m[1], -1.5f);  // 1 - (3 + 2) / 2
  EXPECT_EQ(m[2], 0.0f);
  EXPECT_EQ(grpo_advantages({5}, 1, true, 0.0f, true)[0], 0.0f);
  // the others all equal (std 0): r - baseline undivided (NeMo divides where std > 0 only; d / eps
  // gave +-1e6 for "1 right of G", the common binary-reward group); eps joins a nonzero std
  const auto e = grpo_advantages({1, 0}, 2, true, 0.5f, true);
  EXPECT_EQ(e[0], 1.0f);
  EXPECT_EQ(e[1], -1.0f);
  const auto one_right = grpo_advantages({1, 0, 0, 0}, 4, true, 1e-6f, true);
  EXPECT_EQ(one_right[0], 1.0f);  // others {0, 0, 0}: std 0
  const double sd3 = std::sqrt(2.0 / 9.0);  // others {1, 0, 0}: mean 1/3, population std sqrt(2/9)
  const double want3 = -(1.0 / 3.0) / (sd3 + double(1e-6f));  // (eps as the FP32 the config holds)
  EXPECT_NEAR(one_right[1], want3, fp8rl::tol::fp32_ulps(want3, 1));  // as above
  EXPECT_EQ(grpo_advantages({1, 0}, 2, true, 0.5f, false)[0], static_cast<float>(0.5 / (std::sqrt(0.5) + 0.5)));
}

// The batch metrics by hand: 4 samples, rewards {1, 0, 0, 1} (population std 0.5), responses of
// 1, 2, 3 and 6 tokens sampled 1 behind the learner (no test read reward_std or response_length).
TEST(Grpo, BatchMetricsByHand) {
  std::vector<rl_sample> s(4);
  const float rewards[] = {1, 0, 0, 1};
  const size_t lengths[] = {1, 2, 3, 6};
  for (size_t i = 0; i < s.size(); ++i) {
    s[i].reward = rewards[i];
    s[i].response.assign(lengths[i], 5);
    s[i].weight_version.assign(lengths[i], 2);
    s[i].scale_version.assign(lengths[i], 1);
  }
  metric_map m;
  rl_batch_metrics(s, 3, 2, m);
  EXPECT_EQ(m.at("reward_mean"), 0.5);
  EXPECT_EQ(m.at("reward_std"), 0.5);
  EXPECT_EQ(m.at("accuracy"), 0.5);
  EXPECT_EQ(m.at("response_length"), 3.0);
  EXPECT_EQ(m.at("staleness_hist/0"), 0.0);
  EXPECT_EQ(m.at("staleness_hist/1"), 12.0);
  EXPECT_EQ(m.at("staleness_hist/2"), 0.0);
  EXPECT_EQ(m.at("scale_lag_hist/2"), 12.0);
}

// A batch whose arrays disagree, whose tokens name sequences it does not have (read and written
// past the per-sequence arrays), or whose loss tokens carry a non-finite advantage (the loss and
// every gradient went NaN) is refused naming the token.
TEST(Grpo, MalformedBatchesAreRefusedNamingTheToken) {
  const grpo_config cfg;
  auto why = [&](const token_batch_rl& b) {
    try {
      policy_loss(b, cfg, 10.0);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  token_batch_rl ok = random_batch(5, 3, false);
  EXPECT_EQ(why(ok), "");
  auto far = ok;
  far.seq.back() = 7;
  EXPECT_NE(why(far).find("names sequence 7 of 3"), std::string::npos) << why(far);
  auto next = ok;  // one past the last: the per-sequence arrays were written past their end
  next.seq.back() = 3;
  EXPECT_NE(why(next).find("names sequence 3 of 3"), std::string::npos) << why(next);
  auto short_seq = ok;
  short_seq.seq.pop_back();
  EXPECT_NE(why(short_seq).find("same length"), std::string::npos);
  auto nan = ok;
  const auto in_loss = std::find_if(nan.mask.begin(), nan.mask.end(), [](float m) { return m > 0; }) - nan.mask.begin();
  nan.adv[static_cast<size_t>(in_loss)] = std::nanf("");
  EXPECT_NE(why(nan).find("token " + std::to_string(in_loss) + " has advantage nan"), std::string::npos) << why(nan);
  auto out_of_loss = ok;  // a token outside the loss (mask 0) may carry any advantage
  const auto masked = std::find(out_of_loss.mask.begin(), out_of_loss.mask.end(), 0.0f) - out_of_loss.mask.begin();
  ASSERT_LT(static_cast<size_t>(masked), out_of_loss.mask.size());
  out_of_loss.adv[static_cast<size_t>(masked)] = std::nanf("");
  EXPECT_EQ(why(out_of_loss), "");
  // weights computed for another batch (the four-argument form takes them from the caller)
  is_result short_is = is_weights(ok, cfg);
  short_is.w.pop_back();
  EXPECT_THROW(policy_loss(ok, cfg, 10.0, short_is), std::invalid_argument);
  short_is = is_weights(ok, cfg);
  short_is.mask.push_back(1.0f);
  try {
    policy_loss(ok, cfg, 10.0, short_is);
    ADD_FAILURE() << "a mask of another batch was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("IS mask has " + std::to_string(ok.c.size() + 1) + " entries for " + std::to_string(ok.c.size())),
              std::string::npos) << e.what();
  }
  short_is = is_weights(ok, cfg);
  short_is.filtered.clear();  // none filtered: accepted
  EXPECT_NO_THROW(policy_loss(ok, cfg, 10.0, short_is));
  EXPECT_THROW(is_weights(far, cfg), std::invalid_argument);  // the learner's path calls it first
}

TEST(Grpo, LossGradientMatchesFiniteDifferencesForEveryIsMode) {
  for (is_mode mode : {is_mode::none, is_mode::tis, is_mode::icepop, is_mode::seq_mask_tis})
    for (bool kl : {false, true}) {
      grpo_config cfg;
      cfg.is = mode;
      cfg.is_lo = mode == is_mode::seq_mask_tis ? 0.9f : 0.5f;
      cfg.is_hi = mode == is_mode::seq_mask_tis ? 1.1f : 1.2f;
      cfg.dual_clip = 3.0f;
      cfg.kl_beta = kl ? 0.1f : 0.0f;
      token_batch_rl b = random_batch(17 + static_cast<uint64_t>(mode), 12, kl);
      const double N = 37.0;
      const loss_result lr = policy_loss(b, cfg, N);
      const double h = 1e-3;
      std::vector<double> num, ana;
      for (int64_t t = 0; t < b.size(); ++t) {
        if (near_kink(b, cfg, t, h)) continue;
        const float c0 = b.c[t];
        b.c[t] = static_cast<float>(c0 + h);
        const double fp = policy_loss(b, cfg, N).loss;
        b.c[t] = static_cast<float>(c0 - h);
        const double fm = policy_loss(b, cfg, N).loss;
        b.c[t] = c0;
        const double dh = (double(static_cast<float>(c0 + h)) - double(static_cast<float>(c0 - h)));
        num.push_back((fp - fm) / dh);
        ana.push_back(lr.dc[t]);
      }
      ASSERT_GT(num.size(), 20u);
      int dual = 0, clipped = 0;  // the data reaches the dual clip (A < 0, r > 3) and the PPO clip
      for (int64_t t = 0; t < b.size(); ++t) {
        const double r = std::exp(double(b.c[t]) - b.p[t]);
        dual += b.mask[t] > 0 && b.adv[t] < 0 && r > cfg.dual_clip;
        clipped += b.mask[t] > 0 && (r > 1.0 + cfg.clip_high || r < 1.0 - cfg.clip_low);
      }
      EXPECT_GT(dual, 0);
      EXPECT_GT(clipped, 5);
      EXPECT_LE(fp8rl::tol::rel_norm_err(ana, num), fp8rl::tol::kFiniteDiffLoss)
          << is_mode_name(mode) << " kl " << kl;
    }
}

TEST(Grpo, MetricsMatchTheSpecFormulasOnAHandExample) {
  token_batch_rl b;
  b.g = {-1.0f, -0.5f, -2.0f};
  b.p = {-1.1f, -0.5f, -1.5f};
  b.c = {-1.0f, -0.4f, -1.6f};
  b.adv = {1, 1, -1};
  b.mask = {1, 1, 1};
  b.seq = {0, 0, 1};
  b.n_seqs = 2;
  grpo_config cfg;  // tis, C = 2
  const loss_result r = policy_loss(b, cfg, 3.0);
  // rl-algorithm.md §6's formulas, written out here in FP64 over the same FP32 inputs (N = 3 tokens;
  // sequences {0, 1} and {2}; every weight exp(p - g) <= e^0.5 < C, so tis leaves it as it is)
  const double N = 3.0;
  double tmpe = 0, gkl = 0, pkl = 0, js = 0, sir = 0, ent = 0, sw = 0, sw2 = 0;
  auto k3 = [](double x) { return std::exp(x) - x - 1.0; };
  for (int t = 0; t < 3; ++t) {
    const double g = b.g[t], p = b.p[t], c = b.c[t], l = std::log(0.5 * std::exp(p) + 0.5 * std::exp(g));
    tmpe += std::exp(std::fabs(g - p)) / N;
    gkl += k3(p - g) / N;
    pkl += k3(g - p) / N;
    js += 0.5 * (k3(p - l) + k3(g - l)) / N;
    sir += double(static_cast<float>(std::exp(p - g))) / N;  // w~ is held in FP32
    sw += double(static_cast<float>(std::exp(p - g)));
    sw2 += std::pow(double(static_cast<float>(std::exp(p - g))), 2);
    ent += -std::exp(c - g) * c / N;
  }
  const double e0 = (std::exp(std::fabs(double(b.g[0]) - b.p[0])) + std::exp(std::fabs(double(b.g[1]) - b.p[1]))) / 2,
               e1 = std::exp(std::fabs(double(b.g[2]) - b.p[2]));
  const double tol = fp8rl::tol::kFp64FewTerms;  // the same FP64 formulas on the same inputs
  EXPECT_NEAR(r.metrics.at("token_mult_prob_error"), tmpe, tol);
  EXPECT_NEAR(r.metrics.at("gen_kl_error"), gkl, tol);
  EXPECT_NEAR(r.metrics.at("policy_kl_error"), pkl, tol);
  EXPECT_NEAR(r.metrics.at("js_divergence_error"), js, tol);
  EXPECT_NEAR(r.metrics.at("sampling_importance_ratio"), sir, tol);
  EXPECT_NEAR(r.metrics.at("approx_entropy"), ent, tol);
  EXPECT_NEAR(r.metrics.at("is_ess"), sw * sw / (N * sw2), tol);
  EXPECT_LT(r.metrics.at("is_ess"), 0.98);  // weights e^-0.1, 1, e^0.5: visibly unequal
  EXPECT_NEAR(r.metrics.at("seq_mult_prob_error_max"), std::max(e0, e1), tol);
  EXPECT_NEAR(r.metrics.at("seq_mult_prob_error_mean"), (e0 + e1) / 2, tol);
  EXPECT_NEAR(r.metrics.at("seq_mult_prob_error_min"), std::min(e0, e1), tol);
  {  // logprobs below -745 (exp underflows to 0): the JS term is the same as at p - g = 1 near 0
    token_batch_rl far = b;
    far.g = {-801.0f, -800.0f, -800.0f};
    far.p = far.c = {-800.0f, -800.0f, -800.0f};
    const double m = std::log(0.5 + 0.5 * std::exp(-1.0));  // l - p of token 0; 0 for the others
    const double want = 0.5 * (k3(-m) + k3(-1.0 - m)) / N;
    EXPECT_NEAR(policy_loss(far, cfg, 3.0).metrics.at("js_divergence_error"), want, tol);
  }
  // and two of the values by hand, so the loop above is checked too: exp|g - p| = e^0.1, 1, e^0.5
  EXPECT_NEAR(tmpe, (std::exp(0.1) + 1 + std::exp(0.5)) / 3, fp8rl::tol::kMetricFromFloatInputs);
  EXPECT_NEAR(e1, std::exp(0.5), fp8rl::tol::kMetricFromFloatInputs);
  EXPECT_EQ(r.metrics.at("is_oob_ratio"), 0.0);
  // one out-of-bounds token under tis with C = 1.2: w = exp(0.5) = 1.65 > 1.2
  cfg.is_hi = 1.2f;
  EXPECT_NEAR(policy_loss(b, cfg, 3.0).metrics.at("is_oob_ratio"), 1.0 / 3.0, fp8rl::tol::kFp64FewTerms);
}

// is_ess = (sum w~)^2 / (n sum w~^2) by hand: equal weights 1; icepop zeroing one of three
// (w~ = 1, 1, 0): 4 / 6; every weight zeroed: 0; tokens without a term (mask 0) are not among n
TEST(Grpo, IsEssByHand) {
  token_batch_rl b = three_tokens({-1.0f, -1.0f, -1.0f}, {0, 0, 1});
  grpo_config cfg;
  EXPECT_EQ(policy_loss(b, cfg, 3.0).metrics.at("is_ess"), 1.0);
  cfg.is = is_mode::icepop;  // [is_lo, is_hi] = [0, 2]: w = e^1.5 drops to 0
  b.p[2] = b.c[2] = 0.5f;
  EXPECT_NEAR(policy_loss(b, cfg, 3.0).metrics.at("is_ess"), 4.0 / 6.0, fp8rl::tol::kFp64FewTerms);
  b.mask[2] = 0;  // out of the loss: not a token of the ESS either (N, other ranks' tokens too, is not n)
  EXPECT_EQ(policy_loss(b, cfg, 3.0).metrics.at("is_ess"), 1.0);
  b.p = b.c = {0.5f, 0.5f, 0.5f};
  EXPECT_EQ(policy_loss(b, cfg, 2.0).metrics.at("is_ess"), 0.0);
}

// Each branch of the weights and the clipped objective on one-token cases computed by hand (the
// finite-difference test cannot see a wrong weight: w does not depend on c): the PPO clip, the
// dual clip, tis's clamp, icepop's cut, seq-mask-tis's sequence mask.
TEST(Grpo, EachWeightAndClipBranchByHand) {
  const double tol = fp8rl::tol::kLossFp32Roundings;
  auto one = [](float A, double log_r, double log_w) {  // c - p = log r, p - g = log w
    token_batch_rl b;
    b.p = {-1.0f};
    b.c = {static_cast<float>(-1.0 + log_r)};
    b.g = {static_cast<float>(-1.0 - log_w)};
    b.adv = {A};
    b.mask = {1};
    b.seq = {0};
    b.n_seqs = 1;
    return b;
  };
  auto r_of = [](const token_batch_rl& b) { return std::exp(double(b.c[0]) - b.p[0]); };
  auto w_of = [](const token_batch_rl& b) { return std::exp(double(b.p[0]) - b.g[0]); };
  grpo_config cfg;  // clip 0.2 / 0.2
  cfg.is = is_mode::none;
  // PPO clip, A > 0, r = 1.5: L = -A (1 + clip_high), no gradient, counted as clipped
  auto b = one(1.0f, std::log(1.5), 0.0);
  auto r = policy_loss(b, cfg, 1.0);
  EXPECT_NEAR(r.loss, -1.2, tol);
  EXPECT_EQ(r.dc[0], 0.0f);
  EXPECT_EQ(r.metrics.at("clip_fraction"), 1.0);
  // asymmetric bounds [1 - 0.1, 1 + 0.3] (each bound at its side: swapped, the symmetric case
  // above could not tell): A = 1, r = 1.5 -> -1.3; A = -1, r = 0.5 -> max(0.5, 0.9) = 0.9
  cfg.clip_low = 0.1f;
  cfg.clip_high = 0.3f;
  r = policy_loss(b, cfg, 1.0);
  EXPECT_NEAR(r.loss, -1.3, tol);
  EXPECT_EQ(r.dc[0], 0.0f);
  r = policy_loss(one(-1.0f, std::log(0.5), 0.0), cfg, 1.0);
  EXPECT_NEAR(r.loss, 0.9, tol);
  EXPECT_EQ(r.dc[0], 0.0f);
  cfg.clip_low = cfg.clip_high = 0.2f;
  // A < 0, r = 4: PPO keeps -A r = 4 (the unclipped term is larger); the dual clip caps it at
  // -dual_clip A = 3 with no gradient; without it, dL/dc = -A r
  b = one(-1.0f, std::log(4.0), 0.0);
  cfg.dual_clip = 0.0f;
  r = policy_loss(b, cfg, 1.0);
  EXPECT_NEAR(r.loss, r_of(b), tol);
  EXPECT_NEAR(r.dc[0], r_of(b), tol);
  cfg.dual_clip = 3.0f;
  r = policy_loss(b, cfg, 1.0);
  EXPECT_NEAR(r.loss, 3.0, tol);
  EXPECT_EQ(r.dc[0], 0.0f);
  // tis clamps w = 1.65 to is_hi = 1.2 (r = 1, A = 1: L = -w); w = 0.3 to is_lo = 0.5
  cfg.is = is_mode::tis;
  cfg.is_lo = 0.5f;
  cfg.is_hi = 1.2f;
  b = one(1.0f, 0.0, 0.5);
  r = policy_loss(b, cfg, 1.0);
  EXPECT_NEAR(r.loss, -1.2, tol);
  EXPECT_NEAR(r.dc[0], -1.2, tol);
  EXPECT_EQ(r.metrics.at("is_oob_ratio"), 1.0);
  r = policy_loss(one(1.0f, 0.0, std::log(0.3)), cfg, 1.0);
  EXPECT_NEAR(r.loss, -0.5, tol);
  EXPECT_EQ(r.metrics.at("is_oob_ratio"), 1.0);  // below is_lo counts too
  // icepop drops a token outside [is_lo, is_hi] and keeps w itself inside
  cfg.is = is_mode::icepop;
  r = policy_loss(b, cfg, 1.0);
  EXPECT_EQ(r.loss, 0.0);
  EXPECT_EQ(r.dc[0], 0.0f);
  b = one(1.0f, 0.0, std::log(1.1));
  EXPECT_NEAR(policy_loss(b, cfg, 1.0).loss, -w_of(b), tol);
  // seq-mask-tis: sequence 0 (p - g = 0.5 on both tokens: rho = e^0.5 > 1.2) is dropped whole;
  // sequence 1 (p - g = 0.05: rho = e^0.05) keeps its tokens' own w; is_oob_ratio = 1 of 2
  cfg.is = is_mode::seq_mask_tis;
  auto on_policy = [](std::vector<float> p, std::vector<float> g, std::vector<int32_t> seq) {  // c = p, A = 1
    token_batch_rl x;
    x.c = x.p = std::move(p);
    x.g = std::move(g);
    x.adv = x.mask = std::vector<float>(x.p.size(), 1.0f);
    x.n_seqs = seq.back() + 1;
    x.seq = std::move(seq);
    return x;
  };
  const token_batch_rl q = on_policy({-1.0f, -2.0f, -1.0f}, {-1.5f, -2.5f, -1.05f}, {0, 0, 1});
  const is_result is = is_weights(q, cfg);
  EXPECT_EQ(is.oob_seqs, 1);
  EXPECT_EQ(is.w[0], 0.0f);
  EXPECT_EQ(is.w[1], 0.0f);
  EXPECT_NEAR(is.w[2], std::exp(double(q.p[2]) - q.g[2]), tol);
  r = policy_loss(q, cfg, 3.0);
  EXPECT_NEAR(r.loss, -std::exp(double(q.p[2]) - q.g[2]) / 3.0, tol);
  EXPECT_EQ(r.metrics.at("is_oob_ratio"), 0.5);
  // rho is the geometric mean: 3 tokens of p - g = 0.08 give e^0.08 = 1.083 < is_hi = 1.1, kept
  // (the product e^0.24 = 1.27 would drop the sequence)
  cfg.is_hi = 1.1f;
  const token_batch_rl m3 = on_policy({-1.0f, -1.0f, -1.0f}, {-1.08f, -1.08f, -1.08f}, {0, 0, 0});
  const is_result kept = is_weights(m3, cfg);
  EXPECT_EQ(kept.oob_seqs, 0);
  for (int t = 0; t < 3; ++t) EXPECT_NEAR(kept.w[t], std::exp(double(m3.p[t]) - m3.g[t]), tol) << t;
  // icepop drops a token below is_lo too (w = 0.3 < 0.5)
  cfg.is = is_mode::icepop;
  EXPECT_EQ(policy_loss(one(1.0f, 0.0, std::log(0.3)), cfg, 1.0).loss, 0.0);
  // clip_fraction and is_oob_ratio are shares of the batch's tokens in the loss, not of N (the
  // count over every rank): token 0 clipped (r = 1.5) and below is_lo, token 1 neither; N = 10
  cfg.is = is_mode::tis;
  token_batch_rl two = one(1.0f, std::log(1.5), std::log(0.3));
  two.p.push_back(-1.0f), two.c.push_back(-1.0f), two.g.push_back(-1.0f);
  two.adv.push_back(1.0f), two.mask.push_back(1.0f), two.seq.push_back(0);
  r = policy_loss(two, cfg, 10.0);
  EXPECT_EQ(r.metrics.at("clip_fraction"), 0.5);
  EXPECT_EQ(r.metrics.at("is_oob_ratio"), 0.5);
}

TEST(Grpo, NonFiniteWeightsAreZeroedAndCounted) {
  token_batch_rl b;
  b.g = {-1.0f, -INFINITY, -0.5f};
  b.p = {-1.0f, -1.0f, NAN};
  b.c = b.p;
  b.c[2] = -0.5f;
  b.p[2] = NAN;
  b.adv = {1, 1, 1};
  b.mask = {1, 1, 1};
  b.seq = {0, 0, 0};
  b.n_seqs = 1;
  grpo_config cfg;
  cfg.is = is_mode::none;
  is_result is = is_weights(b, cfg);
  EXPECT_EQ(is.w[1], 0.0f);
  EXPECT_EQ(is.w[2], 0.0f);
  EXPECT_EQ(is.nonfinite, 2);
  EXPECT_EQ(is.mask, (std::vector<float>{1, 0, 0}));  // out of the actor term and the metrics
  // the learner's top-k/top-p no longer keeping a token sampled under older weights: c = p = -inf
  // (the loss was NaN and every mismatch metric Inf/NaN, with nothing counted)
  for (is_mode mode : {is_mode::none, is_mode::tis, is_mode::icepop, is_mode::seq_mask_tis}) {
    cfg.is = mode;
    cfg.is_lo = 0.5f;
    token_batch_rl k = b;
    k.g = {-1.0f, -0.7f, -0.5f};
    k.c = {-1.0f, -INFINITY, -0.5f};
    k.p = k.c;
    const loss_result r = policy_loss(k, cfg, 3.0);
    EXPECT_TRUE(std::isfinite(r.loss)) << is_mode_name(mode);
    for (const auto& [name, v] : r.metrics) EXPECT_TRUE(std::isfinite(v)) << name << " " << is_mode_name(mode);
    EXPECT_EQ(r.metrics.at("nonfinite_is_weights"), 1.0);
    EXPECT_EQ(r.dc[1], 0.0f);
    EXPECT_NEAR(r.loss, -(1.0 + 1.0) / 3.0, fp8rl::tol::kFp64FewTerms) << is_mode_name(mode);  // tokens 0 and 2: w = r = 1, A = 1
    // tokens 0 and 2 match exactly: their metrics say so (over N = 3 they read 2/3 and an entropy
    // of 0.5); the weight's mean keeps token 1's w~ = 0, as the loss does
    EXPECT_EQ(r.metrics.at("token_mult_prob_error"), 1.0) << is_mode_name(mode);
    EXPECT_EQ(r.metrics.at("gen_kl_error"), 0.0) << is_mode_name(mode);
    EXPECT_NEAR(r.metrics.at("approx_entropy"), (1.0 + 0.5) / 2, fp8rl::tol::kFp64FewTerms) << is_mode_name(mode);
    EXPECT_NEAR(r.metrics.at("sampling_importance_ratio"), 2.0 / 3, fp8rl::tol::kFp64FewTerms) << is_mode_name(mode);
    k.weight_version = k.oldest_kv_version = {4, 4, 4};
    const metric_map m = learner_metrics(k, cfg, 3.0, 5);
    EXPECT_EQ(m.at("by_version/4/token_mult_prob_error"), 1.0) << is_mode_name(mode);
    EXPECT_EQ(m.at("by_staleness/1/token_mult_prob_error"), 1.0) << is_mode_name(mode);
  }
  // p - g = 99.9: exp is finite in FP64 but +Inf as the FP32 weight (was kept as inf under none and
  // seq-mask-tis: loss and dL/dc NaN where A = 0, nothing counted)
  for (is_mode mode : {is_mode::none, is_mode::tis, is_mode::icepop, is_mode::seq_mask_tis}) {
    cfg.is = mode;
    token_batch_rl k = b;
    k.g = {-100.0f, -0.3f, -0.5f};
    k.c = {-0.1f, -0.2f, -0.5f};
    k.p = k.c;
    k.adv = {0, 1, 1};
    const loss_result r = policy_loss(k, cfg, 3.0);
    EXPECT_EQ(r.metrics.at("nonfinite_is_weights"), 1.0) << is_mode_name(mode);
    // tokens 1 and 2 keep w = e^0.1 and 1 in every mode (inside [0.5, 2]; seq-mask-tis: their
    // mean e^0.05), r = 1, A = 1; token 0 is out of the actor term, its w~ = 0 in the ratio
    const double w1 = static_cast<float>(std::exp(double(k.c[1]) - double(k.g[1])));
    EXPECT_NEAR(r.loss, -(w1 + 1.0) / 3.0, fp8rl::tol::kFp64FewTerms) << is_mode_name(mode);
    EXPECT_EQ(r.dc[0], 0.0f) << is_mode_name(mode);
    EXPECT_EQ(r.dc[1], static_cast<float>(-w1 / 3.0)) << is_mode_name(mode);
    EXPECT_EQ(r.dc[2], static_cast<float>(-1.0 / 3.0)) << is_mode_name(mode);
    EXPECT_NEAR(r.metrics.at("sampling_importance_ratio"), (w1 + 1.0) / 3.0, fp8rl::tol::kFp64FewTerms) << is_mode_name(mode);
  }
}

// rl-algorithm.md §6: sequences above seq_logprob_error_threshold are dropped before the step --
// they leave N, so the kept tokens' metrics are not diluted (52 of 64 sequences dropped used to
// report token_mult_prob_error 0.2). (seq-mask-tis's is_oob_ratio: EachWeightAndClipBranchByHand.)
TEST(Grpo, FilteredSequencesLeaveTheTokenCount) {
  token_batch_rl b;
  b.g = {-1.0f, -2.0f, -1.0f, -1.0f, -3.0f};
  b.p = {-1.0f, -2.0f, -1.0f, 1.0f, -1.0f};  // sequence 1 (tokens 2..4): e = (1 + e^2 + e^2) / 3
  b.c = b.p;
  b.adv = {1, 1, -1, -1, -1};
  b.mask = {1, 1, 1, 1, 1};
  b.seq = {0, 0, 1, 1, 1};
  b.n_seqs = 2;
  b.weight_version = b.oldest_kv_version = {3, 3, 3, 3, 3};
  grpo_config cfg;
  cfg.seq_logprob_error_threshold = 2.0f;
  const is_result is = is_weights(b, cfg);
  EXPECT_EQ(is.masked_seqs, 1);
  EXPECT_EQ(is.filtered_tokens, 3);
  EXPECT_EQ(is.filtered, (std::vector<uint8_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(is.valid_seqs, 1);
  const metric_map m = learner_metrics(b, cfg, 5.0, 3);
  EXPECT_EQ(m.at("token_mult_prob_error"), 1.0);  // g = p on the kept tokens, over N = 2
  EXPECT_EQ(m.at("sampling_importance_ratio"), 1.0);
  EXPECT_EQ(m.at("num_masked_seqs"), 1.0);
  EXPECT_EQ(m.at("by_version/3/tokens"), 2.0);
  EXPECT_EQ(m.at("by_version/3/token_mult_prob_error"), 1.0);
  EXPECT_NEAR(m.at("loss"), -(1.0 + 1.0) / 2.0, fp8rl::tol::kFp64FewTerms);  // two kept tokens, A = 1, r = w = 1
  // e_i before the filter (both sequences) and after it (sequence 0 alone)
  const double e1 = (1.0 + 2.0 * std::exp(2.0)) / 3.0;
  EXPECT_NEAR(m.at("seq_mult_prob_error_max"), e1, fp8rl::tol::kFp64FewTerms);
  EXPECT_NEAR(m.at("seq_mult_prob_error_mean"), (1.0 + e1) / 2.0, fp8rl::tol::kFp64FewTerms);
  EXPECT_EQ(m.at("seq_mult_prob_error_max_after_mask"), 1.0);
  EXPECT_EQ(m.count("masked_correct_pct"), 0u);  // no rewards given
  b.reward = {0.0f, 1.0f};                        // the dropped sequence was correct
  EXPECT_EQ(learner_metrics(b, cfg, 5.0, 3).at("masked_correct_pct"), 100.0);
  b.reward = {1.0f, 0.0f};  // the kept sequence was the correct one
  EXPECT_EQ(learner_metrics(b, cfg, 5.0, 3).at("masked_correct_pct"), 0.0);
  {  // a token of a dropped sequence already out of the loss (mask 0) is not counted again
    token_batch_rl u = b;
    u.mask[3] = 0.0f;
    EXPECT_EQ(is_weights(u, cfg).filtered_tokens, 2);
  }
  {  // the filter reads e_i as a mean: three tokens with g = p (e_i = 1) stay at threshold 2
    token_batch_rl three = b;
    three.seq = {0, 0, 0, 1, 1};
    three.p = three.g;
    EXPECT_EQ(is_weights(three, cfg).masked_seqs, 0);
  }
  {  // the KL penalty leaves with the sequence too: over the two kept tokens, over N = 2
    token_batch_rl k = b;
    k.ref = {-1.5f, -2.5f, -9.0f, -9.0f, -9.0f};
    grpo_config kc = cfg;
    kc.kl_beta = 0.1f;
    const loss_result r = policy_loss(k, kc, 2.0);
    auto k3 = [](double lr) { return std::exp(lr) - lr - 1.0; };
    const double lr0 = double(-1.5f) - double(-1.0f), lr1 = double(-2.5f) - double(-2.0f), beta = double(0.1f);
    EXPECT_NEAR(r.kl, beta * (k3(lr0) + k3(lr1)) / 2.0, fp8rl::tol::kFp64FewTerms);
    EXPECT_EQ(r.dc[2], 0.0f);
    EXPECT_EQ(r.dc[3], 0.0f);
    EXPECT_EQ(r.dc[4], 0.0f);
  }
  // a non-finite token leaves alone: its sequence's e_i is taken over the finite ones (it was
  // infinite, and the whole sequence was dropped)
  b.c[0] = b.p[0] = -INFINITY;
  const is_result nf = is_weights(b, cfg);
  EXPECT_EQ(nf.nonfinite, 1);
  EXPECT_EQ(nf.masked_seqs, 1);  // sequence 1 only
  EXPECT_EQ(nf.mask, (std::vector<float>{0, 1, 0, 0, 0}));
}

TEST(Grpo, AsyncVariantReducesToOnPolicyLoss) {
  // g = p = c: weights are 1, the ratio is 1, so loss = -sum m A / N and dL/dc = -m A / N
  token_batch_rl b = random_batch(5, 9, false);
  b.p = b.c;
  b.g = b.c;
  for (is_mode mode : {is_mode::none, is_mode::tis, is_mode::icepop, is_mode::seq_mask_tis}) {
    grpo_config cfg;
    cfg.is = mode;
    cfg.is_lo = 0.5f;
    cfg.is_hi = 2.0f;
    const double N = 20.0;
    const loss_result r = policy_loss(b, cfg, N);
    double want = 0;
    for (int64_t t = 0; t < b.size(); ++t) {
      want += -b.mask[t] * b.adv[t] / N;
      EXPECT_NEAR(r.dc[t], -b.mask[t] * b.adv[t] / N, fp8rl::tol::kLossFp32Roundings);
    }
    EXPECT_NEAR(r.loss, want, fp8rl::tol::kFp64FewTerms);
    double msum = 0;
    for (float m : b.mask) msum += m;
    EXPECT_NEAR(r.metrics.at("token_mult_prob_error"), msum / N, fp8rl::tol::kFp64FewTerms);  // g = p: exp(0) per masked-in token
    EXPECT_EQ(r.metrics.at("clip_fraction"), 0.0);
  }
}

TEST(Tasks, VerifiersAndDatasets) {
  EXPECT_EQ(verify(verifier_kind::exact, "  Paris. ", "paris"), 1.0f);
  EXPECT_EQ(verify(verifier_kind::exact, "Lyon", "paris"), 0.0f);
  EXPECT_EQ(verify(verifier_kind::numeric, "1,000", "1000"), 1.0f);
  EXPECT_EQ(verify(verifier_kind::numeric, "+46", "46.0"), 1.0f);
  EXPECT_EQ(verify(verifier_kind::numeric, "4x6", "46"), 0.0f);
  // the whole text is the number ("46x" was 46); answers below 1 compare absolutely, within 1e-6
  EXPECT_EQ(verify(verifier_kind::numeric, "46x", "46"), 0.0f);
  EXPECT_EQ(verify(verifier_kind::numeric, "1 000", "1000"), 0.0f);
  EXPECT_FALSE(answer_is_number("12 apples"));
  EXPECT_EQ(verify(verifier_kind::numeric, "0.0000005", "0"), 1.0f);
  EXPECT_EQ(verify(verifier_kind::numeric, "0.1000005", "0.1"), 1.0f);
  EXPECT_EQ(verify(verifier_kind::numeric, "0.000002", "0"), 0.0f);
  // exact: a run of spaces is one space, no space is none
  EXPECT_EQ(verify(verifier_kind::exact, "New   York", "new york"), 1.0f);
  EXPECT_EQ(verify(verifier_kind::exact, "newyork", "new york"), 0.0f);
  // operands: one digit is 0..9 (0 included), d digits [10^(d-1), 10^d)
  for (int digits : {1, 2, 3}) {
    const int64_t lo = digits == 1 ? 0 : digits == 2 ? 10 : 100, hi = digits == 1 ? 9 : digits == 2 ? 99 : 999;
    int64_t smallest = hi;
    for (const auto& x : arithmetic_dataset({'+', digits, 0.1}, false, 300, 5).items) {
      const auto plus = x.prompt.find('+');
      for (const int64_t v : {std::stoll(x.prompt.substr(0, plus)), std::stoll(x.prompt.substr(plus + 1))}) {
        EXPECT_GE(v, lo) << x.prompt;
        EXPECT_LE(v, hi) << x.prompt;
        smallest = std::min(smallest, v);
      }
    }
    if (digits == 1) {
      EXPECT_EQ(smallest, 0);  // 600 draws of 10 values
    }
  }
  const arithmetic_config c{'*', 2, 0.1};
  auto tr = arithmetic_dataset(c, false, 500, 3), va = arithmetic_dataset(c, true, 100, 3);
  std::set<std::string> train_prompts;
  for (const auto& e : tr.items) train_prompts.insert(e.prompt);
  for (const auto& e : va.items) EXPECT_EQ(train_prompts.count(e.prompt), 0u) << e.prompt;  // disjoint
  const auto& e = tr.items[0];
  const auto star = e.prompt.find('*');
  EXPECT_EQ(std::stol(e.answer), std::stol(e.prompt.substr(0, star)) * std::stol(e.prompt.substr(star + 1)));
  EXPECT_EQ(arithmetic_dataset(c, false, 50, 3).items[7].prompt, tr.items[7].prompt);  // deterministic
}

// The training set a checkpoint records: every example's text in order counts, its line numbers
// and source do not (a file moved keeps its training set).
TEST(Tasks, DatasetFingerprintSeesEveryExampleInOrder) {
  const dataset a{"a.jsonl", {{"1+1=", "2", 1}, {"2+2=", "4", 2}}};
  const std::string fa = dataset_fingerprint(a);
  EXPECT_EQ(fa.size(), 16u);
  EXPECT_EQ(fa, dataset_fingerprint(dataset{"b.jsonl", {{"1+1=", "2", 3}, {"2+2=", "4", 9}}}));
  EXPECT_NE(fa, dataset_fingerprint(dataset{"a.jsonl", {{"2+2=", "4", 1}, {"1+1=", "2", 2}}}));  // order
  EXPECT_NE(fa, dataset_fingerprint(dataset{"a.jsonl", {{"1+1=", "2", 1}, {"2+2=", "5", 2}}}));  // an answer
  EXPECT_NE(fa, dataset_fingerprint(dataset{"a.jsonl", {{"1+1=", "2", 1}}}));                    // one fewer
  EXPECT_NE(dataset_fingerprint(dataset{"", {{"ab", "c", 0}}}), dataset_fingerprint(dataset{"", {{"a", "bc", 0}}}));
  EXPECT_EQ(dataset_fingerprint(dataset{}), "cbf29ce484222325");  // FNV-1a 64's offset basis: nothing hashed
}

// What the answer-length check counts: responses each verifier accepts, as a model writes them
// (fixed notation: "1e+05" has characters the built-in tokenizer lacks, and train refused mul3).
TEST(Tasks, AcceptedResponseForms) {
  using v = std::vector<std::string>;
  EXPECT_EQ(answer_forms(verifier_kind::exact, "  Paris. "), (v{"Paris.", "paris"}));
  EXPECT_EQ(answer_forms(verifier_kind::numeric, "1,000.50"), v{"1000.5"});
  EXPECT_EQ(answer_forms(verifier_kind::numeric, "+46.0"), v{"46"});
  EXPECT_EQ(answer_forms(verifier_kind::numeric, "100000"), (v{"100000", "1e+05"}));
  EXPECT_EQ(answer_forms(verifier_kind::numeric, "120000000000000000000"), (v{"120000000000000000000", "1.2e+20"}));
  EXPECT_EQ(answer_forms(verifier_kind::numeric, " n/a"), v{"n/a"});
  for (const char* a : {"1,000.50", "+46.0", "100000", "120000000000000000000", "-0.25", "1e300"})  // each is accepted
    for (const auto& f : answer_forms(verifier_kind::numeric, a)) EXPECT_EQ(verify(verifier_kind::numeric, f, a), 1.0f) << a << " " << f;
  for (const char* a : {" Paris. ", "x"})
    for (const auto& f : answer_forms(verifier_kind::exact, a)) EXPECT_EQ(verify(verifier_kind::exact, f, a), 1.0f) << a << " " << f;
}

// A step's prompts wrap around the training set (a run of more prompts than the set has: epochs),
// from any cursor -- also one past several epochs, as a resumed run's.
TEST(Tasks, PromptsWrapAroundTheTrainingSet) {
  const dataset d{"d", {{"a", "1", 1}, {"b", "2", 2}, {"c", "3", 3}}};
  auto prompts = [&](uint64_t cursor, int64_t n) {
    std::string s;
    for (const auto& e : take_prompts(d, cursor, n)) s += e.prompt;
    return s;
  };
  EXPECT_EQ(prompts(0, 2), "ab");
  EXPECT_EQ(prompts(2, 3), "cab");
  EXPECT_EQ(prompts(7, 1), "b");
  EXPECT_EQ(prompts(1, 7), "bcabcab");
}

TEST(Tasks, MalformedDatasetLinesAreAllReported) {
  const auto path = std::filesystem::temp_directory_path() / ("fp8rl_ds_" + std::to_string(::getpid()) + ".jsonl");
  // also: a blank prompt, an answer empty once normalized (a completion saying nothing scored 1
  // under the exact verifier), a key twice (the last one won)
  std::ofstream(path) << "{\"prompt\": \"1+1=\", \"answer\": 2}\n\n{\"prompt\": 3}\nnot json\n{\"prompt\": \"x\", \"answer\": \"y\"}\n"
                         "{\"prompt\": \" \\t\", \"answer\": \"1\"}\n{\"prompt\": \"2+2=\", \"answer\": \".\"}\n"
                         "{\"prompt\": \"2+2=\", \"answer\": \"4\", \"answer\": \"5\"}\n";
  try {
    dataset_load_jsonl(path.string());
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find(":3: 'prompt' missing or not a string"), std::string::npos) << w;
    EXPECT_NE(w.find(":4: not valid JSON"), std::string::npos) << w;
    EXPECT_NE(w.find(":6: 'prompt' is empty or blank"), std::string::npos) << w;
    EXPECT_NE(w.find(":7: 'answer' \".\" is empty once normalized"), std::string::npos) << w;
    EXPECT_NE(w.find(":8: key 'answer' appears twice in one object"), std::string::npos) << w;
    EXPECT_NE(w.find("5 malformed"), std::string::npos) << w;
  }
  std::filesystem::remove(path);
  const std::string dir = fp8rl::test::thrown_text<std::invalid_argument>([] { dataset_load_jsonl(std::filesystem::temp_directory_path().string()); });
  EXPECT_NE(dir.find("is a directory, not a JSONL file"), std::string::npos) << dir;
}

namespace {
// A one-layer model for tokenizer tok, 16 positions.
model_params tiny_model(const tokenizer& tok) {
  model_config c;
  c.hidden_size = 32; c.intermediate_size = 64; c.num_hidden_layers = 1; c.num_attention_heads = 2;
  c.num_key_value_heads = 1; c.head_dim = 16; c.vocab_size = tok.vocab_size(); c.max_position_embeddings = 16;
  return model_params_init(c, 1);
}
}  // namespace

// SFT on a batch without one answer token (empty answers, a tokenizer without EOS) is refused
// before any forward, naming the step; its loss was -0/0 and NaN reached every gradient.
TEST(Grpo, SftRefusesABatchWithoutAnswerTokens) {
  auto tok = char_tokenizer_make("0123456789+=");
  tok->eos = -1;
  dataset data;
  data.items = {{"1+2=", ""}, {"3+4=", ""}};
  model_params p = tiny_model(*tok);
  const auto before = p.data;
  adamw_state opt;
  sft_config sc;
  sc.steps = 1;
  sc.batch = 2;
  const std::string what = fp8rl::test::thrown_text<std::invalid_argument>([&] { sft_train(p, opt, data, *tok, sc); });
  EXPECT_NE(what.find("step 0's batch of 2 examples has no answer token"), std::string::npos) << what;
  EXPECT_EQ(p.data, before);
  EXPECT_EQ(opt.step, 0);
}

// The SFT loss is the mean -log p over the answer's tokens and EOS, the first answer token (the
// row of the prompt's last token predicts it) included: computed here from the training forward
// on the same weights, before the step's update. The step is that loss's gradient (the prompt's
// rows masked out of it too) through AdamW: its weights equal the update computed here.
TEST(Grpo, SftLossCoversTheAnswerFromItsFirstToken) {
  auto tok = char_tokenizer_make("0123456789+=");
  dataset data;
  data.items = {{"1+2=", "3"}};
  model_params p = tiny_model(*tok);
  const model_params before = p;
  adamw_state opt;
  sft_config sc;
  sc.steps = 1;
  sc.batch = 1;
  const double loss = sft_train(p, opt, data, *tok, sc).at(0);
  std::vector<int32_t> seq = tok->encode("1+2=", true);  // BOS 1 + 2 =
  const size_t plen = seq.size();
  seq.push_back(tok->encode("3", false).at(0));
  seq.push_back(tok->eos);
  auto be = make_cpu_backend();
  model_runner run(*be);
  auto w = model_weights_build(*be, before.cfg, sc.policy.training(), {&before, nullptr, nullptr}, false);
  token_batch b;
  b.add(std::vector<int32_t>(seq.begin(), seq.end() - 1));
  run.forward(*w, b, false);
  const std::vector<int32_t> targets(seq.begin() + 1, seq.end());
  std::vector<float> lp(targets.size());
  run.logprobs(targets, {}, lp.data());
  const double want = -(double(lp[plen - 1]) + double(lp[plen])) / 2.0;  // rows of '=' (-> 3) and of 3 (-> EOS)
  EXPECT_EQ(loss, want);  // the same FP32 logprobs; two FP64 terms halved: exact either way
  auto wt = model_weights_build(*be, before.cfg, sc.policy.training(), {&before, nullptr, nullptr}, true);
  run.forward(*wt, b, true);
  run.logprobs(targets, {}, lp.data());
  std::vector<float> dl(targets.size(), 0.0f), grads(static_cast<size_t>(before.layout.total), 0.0f);
  dl[plen - 1] = dl[plen] = -0.5f;
  run.backward(*wt, targets, {}, dl.data(), grads.data());
  model_params stepped = before;
  adamw_state opt_here;
  adamw_step(sc.opt, stepped.layout, stepped.data.data(), grads.data(), opt_here);
  EXPECT_EQ(fp8rl::test::first_diff(p.data, stepped.data), -1);
  EXPECT_NE(p.data, before.data);
}

// An example the tokenizer cannot encode is named by its file and line in sft and eval (the char
// tokenizer's error named an offset in some prompt), and by index in a built-in task; SFT checks
// every example before its first step.
TEST(Tasks, ExamplesTheTokenizerCannotEncodeAreNamedByLine) {
  auto tok = char_tokenizer_make("0123456789+=");
  const auto path = std::filesystem::temp_directory_path() / ("fp8rl_enc_" + std::to_string(::getpid()) + ".jsonl");
  std::ofstream(path) << "{\"prompt\": \"1+2=\", \"answer\": 3}\n\n{\"prompt\": \"4+5=\", \"answer\": \"9!\"}\n"
                         "{\"prompt\": \"1@2=\", \"answer\": 3}\n";
  const dataset d = dataset_load_jsonl(path.string());
  std::filesystem::remove(path);
  model_params p = tiny_model(*tok);
  const auto before = p.data;
  adamw_state opt;
  sft_config sc;
  sc.steps = 1;
  const std::string sft = fp8rl::test::thrown_text<std::invalid_argument>([&] { sft_train(p, opt, d, *tok, sc); });
  EXPECT_NE(sft.find(path.string() + ":3: answer: char tokenizer: character '!'"), std::string::npos) << sft;
  EXPECT_EQ(p.data, before);
  auto be = make_cpu_backend();
  engine_config ec;
  ec.slots = 2;
  ec.max_context = 16;
  ec.policy = precision_policy::named("fp32");
  generation_engine eng(*be, p.cfg, ec);
  ASSERT_EQ(eng.adopt_params(p, 1, 1), "");
  const std::string eval = fp8rl::test::thrown_text<std::invalid_argument>([&] { evaluate(eng, d, *tok, verifier_kind::exact, 4, 1); });
  EXPECT_NE(eval.find(path.string() + ":4: prompt: char tokenizer: character '@'"), std::string::npos) << eval;
  EXPECT_TRUE(eng.idle());  // refused before any request ran
  const dataset b = arithmetic_dataset({'+', 2, 0.1}, false, 5, 1);
  EXPECT_EQ(example_where(b, 4), "builtin:add2 (train) example 4");
  // an example longer than the model's positions is named before the first step (it failed at the
  // step that drew it: "token batch: sequence 3 has 20 tokens", naming neither it nor the limit)
  dataset longer = b;
  longer.items[2].prompt = "1111111111+2222222=";
  const std::string too_long = fp8rl::test::thrown_text<std::invalid_argument>([&] { sft_train(p, opt, longer, *tok, sc); });
  EXPECT_NE(too_long.find("builtin:add2 (train) example 2: "), std::string::npos) << too_long;
  EXPECT_NE(too_long.find("more than the model's max_position_embeddings 16"), std::string::npos) << too_long;
}

// A response ends at any id of the model's eos_token_id (Llama 3.1 Instruct: <|eot_id|> among
// three), not only at the tokenizer's end-of-text: rollouts ran past the answer to max tokens and
// that text was rewarded. The verifier reads the response without whichever stop ended it.
TEST(Grpo, ResponsesStopAtEveryModelEosIdAndTheVerifierSkipsIt) {
  auto tok = char_tokenizer_make("0123456789+=");
  model_config c;
  c.eos_token_ids = {5, tok->eos, 7};
  EXPECT_EQ(stop_ids(c, *tok), (std::vector<int32_t>{5, tok->eos, 7}));
  c.eos_token_ids = {5, 7};
  const auto stops = stop_ids(c, *tok);
  EXPECT_EQ(stops, (std::vector<int32_t>{5, 7, tok->eos}));
  c.eos_token_ids = {};
  EXPECT_EQ(stop_ids(c, *tok), (std::vector<int32_t>{tok->eos}));
  const auto reqs = rollout_requests({{"1+2=", "3"}}, 4, *tok, stops, 2, {}, 8, 9);
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(reqs[1].id, 9u);
  EXPECT_EQ(reqs[1].stop_tokens, stops);
  const auto three = tok->encode("3", false);
  EXPECT_EQ(response_body({three[0], 7}, stops), three);
  EXPECT_EQ(response_body({three[0], 6}, stops), (std::vector<int32_t>{three[0], 6}));
  gen_result a, b;
  a.id = 8, a.tokens = {three[0], 7};  // "3" then the model's second end id: correct
  b.id = 9, b.tokens = {three[0], 6};  // "3" then a digit: not the answer
  grpo_config g;
  g.group_size = 2;
  const auto smp = rollout_samples({a, b}, {{4, "3"}}, *tok, stops, verifier_kind::numeric, g);
  ASSERT_EQ(smp.size(), 2u);
  EXPECT_EQ(smp[0].reward, 1.0f);
  EXPECT_EQ(smp[1].reward, 0.0f);
  EXPECT_EQ(smp[0].advantage, -smp[1].advantage);
  EXPECT_GT(smp[0].advantage, 0.0f);
  grpo_config plain = g;  // grpo.normalize_std = false: A = r - mean, rewards 1 and 0
  plain.normalize_std = false;
  const auto smp_plain = rollout_samples({a, b}, {{4, "3"}}, *tok, stops, verifier_kind::numeric, plain);
  EXPECT_EQ(smp_plain[0].advantage, 0.5f);
  EXPECT_EQ(smp_plain[1].advantage, -0.5f);
  // groups are scored as groups: two halves of different prompts were one group's advantages
  gen_result p5 = a, p6 = b;
  p5.id = 10, p6.id = 13;  // prompt 5 index 0, prompt 6 index 1
  auto why = [&](const std::vector<gen_result>& rs) {
    try {
      rollout_samples(rs, {{4, "3"}, {5, "3"}, {6, "3"}}, *tok, stops, verifier_kind::numeric, g);
    } catch (const std::invalid_argument& x) {
      return std::string(x.what());
    }
    return std::string();
  };
  EXPECT_EQ(why({a, b, p5, p6}), "rollout_samples: the group of prompt 5 is incomplete or holds an index twice");
  EXPECT_EQ(why({a, a}), "rollout_samples: the group of prompt 4 is incomplete or holds an index twice");  // index 0 twice
  EXPECT_EQ(why({a, b, p5}), "rollout_samples: 3 results are not groups of 2");
}

// Audit mode's KLs are k3 in gen_kl_error's form, d = learner side - rollout side (so precision_kl
// at staleness 0 reads on gen_kl_error's scale); q - g = 0.5 gives e^0.5 - 1.5 = 0.1487 (the other
// direction, e^-0.5 - 0.5, gave 0.1065). A token one side's top-k dropped has no term and is counted.
// The learner-policy re-score ql (the health gates' audit source) in the same form, d = ql - g.
TEST(Grpo, AuditKlsTakeGenKlErrorsFormAndCountNonFiniteTokens) {
  audit_sums a;
  // d: staleness 0.1, precision 0.5, weights 0.2, kernels 0.3, learner policy 0.4
  a.add(/*c=*/-0.9, /*q=*/-1.0, /*q8=*/-1.2, /*ql=*/-1.1, /*g=*/-1.5);
  a.add(-1.0, -1.0, std::nan(""), std::nullopt, -1.5);  // q8 and ql not measured: no split or learner term
  a.add(-1.0, -1.0, -INFINITY, -INFINITY, -1.5);        // the FP8 / learner re-scores' top-k dropped it: counted apart
  // the current weights' top-k no longer keeps it: no staleness/precision term, but the learner
  // policy's at its own version does (d = 0): the gates' term is ql's and g's alone
  a.add(-INFINITY, -1.0, -1.0, -1.0, -1.0);
  metric_map m;
  a.write(m);
  auto k3 = [](double d) { return std::exp(d) - d - 1.0; };
  const double tol = fp8rl::tol::kFp64FewTerms;
  EXPECT_EQ(m.at("audit/tokens"), 3.0);
  EXPECT_EQ(m.at("audit/nonfinite_tokens"), 1.0);
  EXPECT_EQ(m.at("audit/nonfinite_fp8_tokens"), 1.0);
  EXPECT_NEAR(m.at("audit/staleness_kl"), k3(-0.9 + 1.0) / 3, tol);  // e^0.1 - 1.1 (the other form: e^-0.1 - 0.9)
  EXPECT_NEAR(m.at("audit/precision_kl"), k3(0.5), tol);              // every token: q - g = 0.5
  EXPECT_NEAR(m.at("audit/precision_token_mult_prob_error"), std::exp(0.5), tol);
  EXPECT_NEAR(m.at("audit/weight_quant_kl"), k3(-1.0 + 1.2), tol);    // over the one token with q8
  EXPECT_NEAR(m.at("audit/kernel_kv_kl"), k3(-1.2 + 1.5), tol);
  EXPECT_EQ(m.at("audit/nonfinite_learner_tokens"), 1.0);
  EXPECT_NEAR(m.at("audit/learner_gen_kl_error"), k3(-1.1 + 1.5) / 2, tol);  // over the two tokens with ql and g finite
  EXPECT_NEAR(m.at("audit/learner_token_mult_prob_error"), (std::exp(0.4) + 1) / 2, tol);
  audit_sums unmeasured;  // no ql anywhere: no learner keys (the gates count no step)
  unmeasured.add(-1.0, -1.0, std::nan(""), std::nullopt, -1.5);
  unmeasured.add(-INFINITY, -1.0, std::nan(""), std::nullopt, -1.5);
  metric_map um;
  unmeasured.write(um);
  EXPECT_EQ(um.count("audit/learner_token_mult_prob_error") + um.count("audit/nonfinite_learner_tokens"), 0u);
  metric_map none;
  audit_sums().write(none);
  EXPECT_TRUE(none.empty());
}

// The KL penalty is not importance-weighted (rl-algorithm.md §3): a token whose weight is not
// finite leaves the actor term but keeps its KL term (it lost both: kl 0 and dL/dc 0 here).
TEST(Grpo, ANonFiniteWeightKeepsTheTokensKlTerm) {
  token_batch_rl b;
  b.g = {-100.0f, -0.5f, -0.5f};  // token 0: w = e^99.9, +Inf in FP32
  b.c = {-0.1f, -INFINITY, -INFINITY};  // tokens 1, 2: top-k drops them for the learner (2: and the reference)
  b.p = b.c;
  b.ref = {-2.0f, -1.0f, -INFINITY};
  b.adv = {1, 1, 1};
  b.mask = {1, 1, 1};
  b.seq = {0, 0, 0};
  b.n_seqs = 1;
  grpo_config cfg;
  cfg.kl_beta = 0.1f;
  const double N = 2.0;
  const loss_result r = policy_loss(b, cfg, N);
  EXPECT_EQ(r.metrics.at("nonfinite_is_weights"), 3.0);
  EXPECT_EQ(r.actor, 0.0);
  const double lr = -2.0 - double(-0.1f), beta = double(0.1f);
  const double k3_0 = std::exp(lr) - lr - 1.0;  // 1.0496
  const double k3_1 = 10.0;                      // clamp(e^20 - 21): ref - c = +inf, clamped to 20
  EXPECT_NEAR(r.kl, beta * (k3_0 + k3_1) / N, fp8rl::tol::kFp64FewTerms);  // token 2: -inf - -inf, no term
  EXPECT_EQ(r.dc[0], static_cast<float>(beta * (1.0 - std::exp(lr)) / N));  // the same double, rounded once
  EXPECT_EQ(r.dc[1], 0.0f);  // clamped: no gradient
  EXPECT_EQ(r.dc[2], 0.0f);
}

// The running median (two heaps, O(log n) a step) is the sorted counted values' middle one, or the
// mean of the middle two, after every step: ties, infinities (a NaN counts as +inf) and runs
// that rise, fall or jump between halves; steps without staleness-0 tokens leave it alone.
TEST(Health, RunningMedianIsTheSortedMiddle) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    health_config c;
    c.min_steps = 1000000;  // never judged: the median alone
    health_monitor h(c);
    std::vector<double> seen;
    const int n = 1 + static_cast<int>(rng() % 300);
    for (int i = 0; i < n; ++i) {
      const uint64_t kind = rng() % 10;
      double x = kind == 0 ? 1.0 : kind == 1 ? std::nan("") : kind == 2 ? INFINITY : kind < 6 ? double(i) : 0.5 + double(rng() % 1000) / 500;
      if (kind == 9) x = -x;
      h.add(uint64_t(i), {{"by_staleness/0/token_mult_prob_error", x}, {"by_staleness/0/gen_kl_error", 0.0}});
      if (rng() % 7 == 0) h.add(uint64_t(i), {{"by_staleness/1/token_mult_prob_error", 5.0}});
      seen.push_back(std::isnan(x) ? INFINITY : x);
      std::vector<double> s = seen;
      std::sort(s.begin(), s.end());
      const size_t m = s.size() / 2;
      const double want = s.size() % 2 ? s[m] : (s[m] + s[m - 1]) / 2;
      ASSERT_EQ(h.counted(), seen.size());
      ASSERT_EQ(h.tmpe_median(), want) << "trial " << trial << " step " << i;
    }
  }
}

// rl-algorithm.md section 7's gates (models/rl/health.hpp): judged from min_steps counted steps on
// (steps without staleness-0 tokens are not counted); the median limit 1.1 (2.0 with an FP8 KV
// cache), the median of an even count the mean of the middle two; fewer than 10% of steps above
// 1.1; the first min_steps steps' mean gen_kl_error below 0.003, judged once; a non-finite value
// fails; off judges nothing.
TEST(Health, GatesJudgeTheStalenessZeroMismatch) {
  auto step = [](double tmpe, double kl) {
    return std::map<std::string, double>{{"by_staleness/0/token_mult_prob_error", tmpe}, {"by_staleness/0/gen_kl_error", kl}};
  };
  auto gates = [](const std::vector<health_failure>& f) {
    std::vector<std::string> g;
    for (const auto& x : f) g.push_back(x.gate);
    return g;
  };
  using names = std::vector<std::string>;
  health_config c;
  c.min_steps = 3;
  {
    health_monitor h(c);
    EXPECT_TRUE(h.add(1, step(1.5, 0.1)).empty());
    EXPECT_TRUE(h.add(2, {{"by_staleness/1/token_mult_prob_error", 9.0}, {"by_staleness/1/gen_kl_error", 9.0}}).empty());
    EXPECT_EQ(h.counted(), 1u);  // a step without staleness-0 tokens is not counted
    EXPECT_TRUE(h.add(3, step(1.5, 0.1)).empty());
    const auto f = h.add(4, step(1.0, 0.1));  // median 1.5 of 3, 2 of 3 above 1.1, mean KL 0.1
    EXPECT_EQ(gates(f), (names{"tmpe_median_max", "tmpe_steps_above_max", "gen_kl_mean_max"}));
    ASSERT_EQ(f.size(), 3u);
    EXPECT_EQ(f[0].text, "median token_mult_prob_error (staleness 0) 1.5000 is not below 1.1 over 3 step(s) 1..4 with tokens "
                         "sampled under the trained weights (health.tmpe_median_max)");
    EXPECT_NE(f[2].text.find("mean gen_kl_error (staleness 0) 0.10000 over the first 3 step(s) 1..4"), std::string::npos) << f[2].text;
    // the KL gate's mean is the first 3 steps' (0.1), failed at every later step too (a resumed
    // run replays its rows: judged once, the replay went past it)
    EXPECT_EQ(gates(h.add(5, step(1.0, 0.0))), (names{"tmpe_median_max", "tmpe_steps_above_max", "gen_kl_mean_max"}));
  }
  {  // the median of an even count: (1.0 + 1.15) / 2 = 1.075 passes, (1.0 + 1.25) / 2 fails
    health_config k = c;
    k.min_steps = 2, k.fp8_kv = true, k.tmpe_median_max = 1.1;
    health_monitor a(k), b(k);
    a.add(1, step(1.0, 0.5));
    b.add(1, step(1.0, 0.5));
    EXPECT_TRUE(a.add(2, step(1.15, 0.5)).empty());  // with an FP8 KV cache: the median only
    EXPECT_EQ(gates(b.add(2, step(1.25, 0.5))), (names{"tmpe_median_max"}));
  }
  {  // an FP8 KV cache's limit is 2.0
    health_config k = c;
    k.fp8_kv = true;
    health_monitor h(k);
    for (uint64_t s = 1; s <= 2; ++s) h.add(s, step(1.9, 0.0));
    EXPECT_TRUE(h.add(3, step(1.9, 0.0)).empty());
    EXPECT_EQ(gates(h.add(4, step(2.5, 0.0))), names{});  // median of 1.9, 1.9, 1.9, 2.5: 1.9
    EXPECT_EQ(gates(h.add(5, step(2.5, 0.0))), names{});
    EXPECT_EQ(gates(h.add(6, step(2.5, 0.0))), (names{"tmpe_median_max"}));  // (1.9 + 2.5) / 2
  }
  {  // 10% of steps above 1.1 is not fewer than 10%: 1 of 10 fails, 1 of 11 passes
    health_config k = c;
    k.min_steps = 10;
    health_monitor h(k);
    for (uint64_t s = 1; s < 10; ++s) EXPECT_TRUE(h.add(s, step(1.0, 0.0)).empty());
    EXPECT_EQ(gates(h.add(10, step(1.2, 0.0))), (names{"tmpe_steps_above_max"}));
    EXPECT_TRUE(h.add(11, step(1.0, 0.0)).empty());
  }
  {  // mean KL 0.0029 passes, 0.003 fails
    health_monitor a(c), b(c);
    for (uint64_t s = 1; s <= 3; ++s) {
      EXPECT_TRUE(a.add(s, step(1.0, 0.0029)).empty());
      if (s < 3) b.add(s, step(1.0, 0.003));
    }
    EXPECT_EQ(gates(b.add(3, step(1.0, 0.003))), (names{"gen_kl_mean_max"}));
    EXPECT_TRUE(a.add(4, step(1.0, 0.5)).empty());  // the first 3 steps' mean only
  }
  {  // a median exactly at the limit fails (not below it)
    health_config k = c;
    k.min_steps = 1, k.fp8_kv = true;
    health_monitor h(k);
    EXPECT_EQ(gates(h.add(1, step(2.0, 0.0))), (names{"tmpe_median_max"}));
  }
  {  // a NaN fails the median (as +inf), not the ordering
    health_config k = c;
    k.min_steps = 5;
    health_monitor h(k);
    for (double x : {1.0, 1.0, double(NAN), double(NAN)}) h.add(1, step(x, 0.0));
    const auto f = h.add(5, step(NAN, 0.0));
    EXPECT_EQ(gates(f), (names{"tmpe_median_max", "tmpe_steps_above_max"}));
    ASSERT_FALSE(f.empty());
    EXPECT_NE(f[0].text.find("(staleness 0) inf is not below 1.1"), std::string::npos) << f[0].text;
  }
  {
    health_config off = c;
    off.mode = health_mode::off;
    health_monitor h(off);
    for (uint64_t s = 1; s <= 5; ++s) EXPECT_TRUE(h.add(s, step(9.0, 9.0)).empty());
  }
  EXPECT_EQ(health_mode_parse("warn"), health_mode::warn);
  EXPECT_FALSE(health_mode_parse("Fail").has_value());
}

// health.source = audit: the gates read audit mode's learner-policy re-score (every staleness)
// and count the audited steps; the staleness-0 keys are not theirs then (and the reverse).
TEST(Health, AuditSourceReadsTheLearnerPolicyRescore) {
  health_config c;
  c.min_steps = 2;
  c.source = health_source::audit;
  health_monitor h(c), t(health_config{});
  const std::map<std::string, double> stale0{{"by_staleness/0/token_mult_prob_error", 1.5}, {"by_staleness/0/gen_kl_error", 0.1}};
  const std::map<std::string, double> audited{{"audit/learner_token_mult_prob_error", 1.5}, {"audit/learner_gen_kl_error", 0.1}};
  EXPECT_TRUE(h.add(1, stale0).empty());
  EXPECT_EQ(h.counted(), 0u);  // not audited: not counted
  EXPECT_TRUE(t.add(1, audited).empty());
  EXPECT_EQ(t.counted(), 0u);  // the default source reads staleness 0 only
  EXPECT_TRUE(h.add(2, audited).empty());
  const auto f = h.add(3, audited);
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(f[0].text, "median token_mult_prob_error (audit, every staleness) 1.5000 is not below 1.1 over 2 step(s) 2..3 "
                       "audited (health.tmpe_median_max)");
  EXPECT_EQ(health_source_parse("audit"), health_source::audit);
  EXPECT_EQ(health_source_parse("trained"), health_source::trained);
  EXPECT_FALSE(health_source_parse("Audit").has_value());
}

namespace {
grpo_config seq_mask_tis_config(float lo, float hi) {
  grpo_config cfg;
  cfg.is = is_mode::seq_mask_tis;
  cfg.is_lo = lo;
  cfg.is_hi = hi;
  return cfg;
}
}  // namespace

// seq-mask-tis drops a sequence whose geometric-mean weight is below lo, as one above C.
TEST(Grpo, SeqMaskTisDropsASequenceBelowLo) {
  const grpo_config cfg = seq_mask_tis_config(0.9f, 1.1f);
  token_batch_rl b;
  b.c = b.p = {-1.0f, -1.0f};
  b.g = {-0.5f, -0.5f};  // p - g = -0.5: rho = e^-0.5 = 0.61 < 0.9
  b.adv = b.mask = {1.0f, 1.0f};
  b.seq = {0, 0};
  b.n_seqs = 1;
  const is_result is = is_weights(b, cfg);
  EXPECT_EQ(is.oob_seqs, 1);
  EXPECT_EQ(is.w[0], 0.0f);
  EXPECT_EQ(is.w[1], 0.0f);
}

// The KL term (rl-algorithm.md section 3): the log-ratio x = ref - c clamped to [-20, 20], then
// k3 = e^x - 1 - x to [-10, 10], with no gradient through either clamp. k3 passes 10 near x = -11,
// so for finite x the -20 bound never shows (k3 is clamped first; a -12 bound passes this test
// too); what shows: at x = -14 k3 clamped to 10, no gradient; at x = -10.5 k3 = 9.50003 with its
// gradient beta (1 - e^x) (a bound at -10 changed both); at x = +inf (the learner gives the sampled
// token no mass, c = -inf) the bound's k3, clamped to 10, where k3(inf) = inf - inf was NaN.
TEST(Grpo, KlLogRatioAndK3Clamps) {
  grpo_config cfg;
  cfg.kl_beta = 0.1f;
  auto kl_of = [&](float c, float ref) {
    token_batch_rl b;
    b.c = b.p = b.g = {c};
    b.ref = {ref};
    b.adv = {0.0f};  // no actor gradient: dc is the KL term's
    b.mask = {1.0f};
    b.seq = {0};
    b.n_seqs = 1;
    return policy_loss(b, cfg, 1.0);
  };
  const double beta = cfg.kl_beta;
  const loss_result far = kl_of(-1.0f, -15.0f);  // x = -14: k3 = e^-14 + 13
  EXPECT_NEAR(far.kl, beta * 10.0, fp8rl::tol::kFp64FewTerms);
  EXPECT_EQ(far.dc[0], 0.0f);
  const loss_result near = kl_of(-1.0f, -11.5f);  // x = -10.5
  EXPECT_NEAR(near.kl, beta * (std::exp(-10.5) + 9.5), fp8rl::tol::kFp64FewTerms);
  const double g = beta * (1.0 - std::exp(-10.5));
  EXPECT_NEAR(near.dc[0], g, fp8rl::tol::fp32_ulps(g, 1));  // an FP64 value rounded once to FP32
  const loss_result inf = kl_of(-std::numeric_limits<float>::infinity(), -1.0f);
  EXPECT_NEAR(inf.kl, beta * 10.0, fp8rl::tol::kFp64FewTerms);
  EXPECT_EQ(inf.dc[0], 0.0f);
}

// is_oob_ratio and clip_fraction count the tokens in the loss only (mask 1): a masked-out token
// with a weight past C is neither.
TEST(Grpo, OobAndClipFractionCountOnlyLossTokens) {
  grpo_config cfg;  // tis, C = 2
  token_batch_rl b;
  b.p = {-1.0f, -1.0f, -1.0f};
  b.c = {-1.0f + std::log(1.5f), -1.0f, -1.0f};  // token 0 clipped
  b.g = {-1.0f, -1.0f, -3.0f};                   // token 2 (masked out): w = e^2 > C
  b.adv = {1.0f, 1.0f, 1.0f};
  b.mask = {1.0f, 1.0f, 0.0f};
  b.seq = {0, 0, 0};
  b.n_seqs = 1;
  const loss_result r = policy_loss(b, cfg, 2.0);
  EXPECT_EQ(r.metrics.at("is_oob_ratio"), 0.0);
  EXPECT_EQ(r.metrics.at("clip_fraction"), 0.5);
}

// seq-mask-tis's is_oob_ratio is over the sequences with a token in the loss (section 6).
TEST(Grpo, SeqOobRatioIsOverValidSequences) {
  const grpo_config cfg = seq_mask_tis_config(0.9f, 1.1f);
  token_batch_rl b;
  b.c = b.p = {-1.0f, -1.0f, -1.0f};
  b.g = {-1.5f, -1.0f, -1.0f};  // sequence 0 out (rho = e^0.5); sequence 1 in; sequence 2 all masked out
  b.adv = {1.0f, 1.0f, 1.0f};
  b.mask = {1.0f, 1.0f, 0.0f};
  b.seq = {0, 1, 2};
  b.n_seqs = 3;
  EXPECT_EQ(policy_loss(b, cfg, 2.0).metrics.at("is_oob_ratio"), 0.5);
}

// A group's results given out of order come back in group-index order, each rewarded.
TEST(Grpo, RolloutSamplesSortAGroupGivenOutOfOrder) {
  auto tok = char_tokenizer_make("0123456789+=");
  const std::vector<int32_t> stops = {tok->eos};
  gen_result a, b;
  a.id = 8, a.tokens = tok->encode("3", false);
  b.id = 9, b.tokens = tok->encode("4", false);
  grpo_config g;
  g.group_size = 2;
  const auto smp = rollout_samples({b, a}, {{4, "3"}}, *tok, stops, verifier_kind::numeric, g);
  ASSERT_EQ(smp.size(), 2u);
  EXPECT_EQ(smp[0].group_index, 0);
  EXPECT_EQ(smp[0].reward, 1.0f);
  EXPECT_EQ(smp[1].group_index, 1);
  EXPECT_EQ(smp[1].reward, 0.0f);
}

// SFT takes an example whose fed rows exactly fill the model's positions.
TEST(Grpo, SftTakesAnExampleThatExactlyFillsTheContext) {
  auto tok = char_tokenizer_make("0123456789+=");
  model_config c;
  c.hidden_size = 32; c.intermediate_size = 64; c.num_hidden_layers = 1; c.num_attention_heads = 2;
  c.num_key_value_heads = 1; c.head_dim = 16; c.vocab_size = tok->vocab_size(); c.max_position_embeddings = 8;
  model_params p = model_params_init(c, 1);
  dataset d;
  d.items = {{"12+34=", "4"}};  // BOS + 6 + 1 + EOS = 9 tokens: rows fed = 8 = max_position_embeddings
  adamw_state opt;
  sft_config sc;
  sc.steps = 1;
  sc.batch = 1;
  EXPECT_NO_THROW(sft_train(p, opt, d, *tok, sc));
}

// The rollouts' groups take their advantages with the run's baseline: leave_one_out reaches
// group scoring (rollout_samples -> group_score).
TEST(Grpo, GroupScoringTakesTheLeaveOneOutBaseline) {
  auto tok = char_tokenizer_make("0123456789+=");
  const std::vector<int32_t> stops = {tok->eos};
  std::vector<gen_result> rs(3);
  for (uint64_t j = 0; j < 3; ++j) rs[j].id = 12 + j, rs[j].tokens = tok->encode(j == 0 ? "3" : "4", false);
  for (bool loo : {false, true}) {
    grpo_config g;
    g.group_size = 3;
    g.leave_one_out = loo;
    const auto smp = rollout_samples(rs, {{4, "3"}}, *tok, stops, verifier_kind::numeric, g);
    ASSERT_EQ(smp.size(), 3u);
    const auto want = grpo_advantages({1, 0, 0}, 3, true, g.adv_eps, loo);
    for (size_t j = 0; j < 3; ++j) EXPECT_EQ(smp[j].advantage, want[j]) << "leave_one_out " << loo << " sample " << j;
  }
  const float eps = grpo_config{}.adv_eps;  // (the premise: the two baselines differ here)
  EXPECT_NE(grpo_advantages({1, 0, 0}, 3, true, eps, true)[1], grpo_advantages({1, 0, 0}, 3, true, eps, false)[1]);
}

// by_version/v groups tokens by the weights they were sampled under; by_staleness/Δ by the oldest
// weights their KV cache came from: two tokens sampled under the trained version 5 on a KV cache
// kept from version 4 (kv_policy keep) are not Δ = 0's precision-only tokens the health gates
// read. Token 0 matches exactly (Δ = 0: 1); tokens 1, 2 are off by 0.5 (e^0.5 at Δ = 1).
TEST(Grpo, StalenessBinsTakeTheOldestWeightsOfATokensContext) {
  token_batch_rl b = three_tokens({-1.0f, -0.5f, -0.5f}, {0, 0, 0});
  b.weight_version = {5, 5, 5};
  b.oldest_kv_version = {5, 4, 4};
  grpo_config cfg;
  const metric_map m = learner_metrics(b, cfg, 3.0, 5);
  EXPECT_EQ(m.at("by_version/5/tokens"), 3.0);
  EXPECT_EQ(m.at("by_staleness/0/token_mult_prob_error"), 1.0);
  EXPECT_NEAR(m.at("by_staleness/1/token_mult_prob_error"), std::exp(0.5), fp8rl::tol::kMetricFromFloatInputs);
  b.oldest_kv_version.pop_back();  // the breakdown needs both per token
  EXPECT_NE(fp8rl::test::error_of([&] { (void)learner_metrics(b, cfg, 3.0, 5); }).find("oldest KV versions"), std::string::npos);
  // rl_tokens takes each token's oldest KV version from its sample (the weight version in its
  // place put kept-cache tokens back into the staleness-0 bin the health gates read)
  rl_sample s;
  s.prompt = {1};
  s.response = {2, 3, 4};
  s.gen_logprobs = {-1.0f, -1.0f, -1.0f};
  s.weight_version = s.scale_version = s.oldest_kv_scale_version = {5, 5, 5};
  s.oldest_kv_version = {5, 4, 4};
  const token_batch_rl r = rl_tokens({s});
  EXPECT_EQ(r.weight_version, (std::vector<uint64_t>{5, 5, 5}));
  EXPECT_EQ(r.oldest_kv_version, (std::vector<uint64_t>{5, 4, 4}));
}

// by_staleness takes by_version's values only where a version's tokens are exactly its oldest-KV
// tokens: with three versions under kv_policy keep, version 4 has as many sampled tokens as it
// has oldest-KV tokens, but other ones -- its bins are computed on their own tokens.
TEST(Grpo, StalenessBinsReuseAVersionsValuesOnlyForTheSameTokens) {
  token_batch_rl b = three_tokens({-1.0f, -0.5f, -0.2f}, {0, 0, 0});
  b.weight_version = {5, 4, 3};
  b.oldest_kv_version = {4, 3, 3};  // KV 4: token 0 (sampled under 5); version 4: token 1
  grpo_config cfg;
  const metric_map m = learner_metrics(b, cfg, 3.0, 5);
  const double tol = fp8rl::tol::kMetricFromFloatInputs;
  EXPECT_NEAR(m.at("by_version/4/token_mult_prob_error"), std::exp(0.5), tol);   // token 1: p - g = 0.5
  EXPECT_NEAR(m.at("by_staleness/1/token_mult_prob_error"), std::exp(0.0), tol);  // token 0: p - g = 0
  EXPECT_NEAR(m.at("by_staleness/2/token_mult_prob_error"), (std::exp(0.5) + std::exp(0.8)) / 2, tol);  // tokens 1, 2
  EXPECT_EQ(m.count("by_staleness/0/token_mult_prob_error"), 0u);  // no token's context is all version 5
}

// Audit mode re-scores each token under the weights it was sampled under: a trajectory spanning
// versions 1 and 2 (an adoption mid-sequence, kv_policy recompute) whose g are exactly each
// version's logprobs reads precision_kl 0 (one version for all tokens made it > 0, and such
// trajectories were skipped before); staleness_kl is nonzero for version 1's token only. A token
// whose KV came from older weights (keep), or a version no longer held, skips its trajectory, counted.
TEST(Grpo, AuditRescoresEachTokenUnderItsOwnVersion) {
  model_config c;
  c.hidden_size = 32; c.intermediate_size = 64; c.num_hidden_layers = 1; c.num_attention_heads = 2;
  c.num_key_value_heads = 1; c.head_dim = 16; c.vocab_size = 20; c.max_position_embeddings = 16;
  model_params v1 = model_params_init(c, 1), v2 = model_params_init(c, 2);  // [P] each
  auto be = make_cpu_backend();
  model_runner run(*be);
  const precision_policy fp32 = precision_policy::named("fp32");
  auto w1 = model_weights_build(*be, c, fp32.training(), {&v1, nullptr, nullptr}, false);
  auto w2 = model_weights_build(*be, c, fp32.training(), {&v2, nullptr, nullptr}, false);
  const logit_processing proc;
  rl_sample s;
  s.prompt = {1, 5, 7};
  s.response = {3, 9, 4};
  s.weight_version = s.oldest_kv_version = {1, 2, 2};
  s.scale_version = s.oldest_kv_scale_version = s.weight_version;
  // each response token's logprob under its own version's weights (x1: version 1, x2: version 2;
  // the targets of rows 2..4 are the response)
  auto own_versions = [&](const model_weights& x1, const model_weights& x2) {
    token_batch b;
    b.add({1, 5, 7, 3, 9, 4});
    const auto targets = b.next_targets();  // [T = 6]
    std::vector<float> l1(targets.size()), l2(targets.size());
    run.forward(x1, b, false);
    run.logprobs(targets, proc, l1.data());
    run.forward(x2, b, false);
    run.logprobs(targets, proc, l2.data());
    return std::vector<float>{l1[2], l2[3], l2[4]};
  };
  s.gen_logprobs = own_versions(*w1, *w2);  // g
  auto at = [&](uint64_t v) { return v == 1 ? audit_weights{w1.get()} : v == 2 ? audit_weights{w2.get()} : audit_weights{}; };
  audit_sums sums;
  const audit_count n = audit_rescore(run, *w2, at, {s}, 4, proc, sums);
  EXPECT_EQ(n.trajectories, 1);
  EXPECT_EQ(n.spanning, 1);
  metric_map m;
  sums.write(m);
  EXPECT_EQ(m.at("audit/tokens"), 3.0);
  EXPECT_EQ(m.at("audit/precision_kl"), 0.0);  // the same forward, the same bits
  EXPECT_GT(m.at("audit/staleness_kl"), 0.0);  // token 0: current (v2) vs its version (v1)
  // kept KV after the adoption (token 1's context from v1), a version not held, and `want`
  rl_sample kept = s, gone = s;
  kept.oldest_kv_version = {1, 1, 2};
  gone.weight_version = gone.oldest_kv_version = {0, 2, 2};
  audit_sums other;
  const audit_count k = audit_rescore(run, *w2, at, {kept, gone, s, s}, 1, proc, other);
  EXPECT_EQ(k.skipped_kept_kv, 1);
  EXPECT_EQ(k.skipped_not_held, 1);
  EXPECT_EQ(k.trajectories, 1) << "want = 1";
  metric_map km;
  k.write(km);
  EXPECT_EQ(km.at("audit/skipped_kept_kv"), 1.0);
  EXPECT_EQ(km.at("audit/trajectories_spanning"), 1.0);
  {  // each count its own (all 1 above): an empty response neither counts nor uses up `want`;
     // 2 kept, 3 not held, 2 re-scored of which 1 spans two versions
    rl_sample empty = s, single = s;
    empty.response.clear();
    empty.gen_logprobs.clear();
    empty.weight_version = empty.scale_version = empty.oldest_kv_version = empty.oldest_kv_scale_version = {};
    single.weight_version = single.oldest_kv_version = {2, 2, 2};
    audit_sums sums7;
    const audit_count c7 = audit_rescore(run, *w2, at, {empty, kept, gone, gone, kept, gone, single, s}, 9, proc, sums7);
    metric_map m7;
    c7.write(m7);
    sums7.write(m7);
    EXPECT_EQ(m7.at("audit/skipped_kept_kv"), 2.0);
    EXPECT_EQ(m7.at("audit/skipped_not_held"), 3.0);
    EXPECT_EQ(m7.at("audit/trajectories"), 2.0);
    EXPECT_EQ(m7.at("audit/trajectories_spanning"), 1.0);
    EXPECT_EQ(m7.at("audit/tokens"), 6.0);
    audit_sums sums1;
    EXPECT_EQ(audit_rescore(run, *w2, at, {empty, single}, 1, proc, sums1).trajectories, 1) << "the empty one used up want = 1";
    // one of each prompt's group in turn: with want = 2 prompt 0's first (3 tokens) and prompt 1's
    // first (2 tokens), not prompt 0's two
    rl_sample b0 = single, b1 = single;
    b0.prompt_id = b1.prompt_id = 1;
    b0.response.pop_back();
    b0.gen_logprobs.pop_back();
    for (auto* v : {&b0.weight_version, &b0.scale_version, &b0.oldest_kv_version, &b0.oldest_kv_scale_version}) v->pop_back();
    audit_sums turn;
    EXPECT_EQ(audit_rescore(run, *w2, at, {single, single, b0, b1}, 2, proc, turn).trajectories, 2);
    metric_map tm;
    turn.write(tm);
    EXPECT_EQ(tm.at("audit/tokens"), 5.0);
  }
  // the learner policy's re-score, at each token's own version: BF16 weights here (its own
  // forward), by hand from each version's BF16 logprobs; the FP32 weights' pointer shares q's
  // forward and reads 0 exactly
  const precision_policy bf16 = precision_policy::named("bf16");
  auto b1 = model_weights_build(*be, c, bf16.training(), {&v1, nullptr, nullptr}, false);
  auto b2 = model_weights_build(*be, c, bf16.training(), {&v2, nullptr, nullptr}, false);
  double want_kl = 0, want_tmpe = 0;
  const std::vector<float> ql = own_versions(*b1, *b2);
  for (size_t j = 0; j < 3; ++j) {
    const double d = double(ql[j]) - s.gen_logprobs[j];
    want_kl += (std::exp(d) - d - 1) / 3;
    want_tmpe += std::exp(std::fabs(d)) / 3;
  }
  ASSERT_GT(want_kl, 0.0);  // BF16 differs from FP32 here: the check can tell the versions apart
  auto at_l = [&](uint64_t v) {
    return v == 1 ? audit_weights{w1.get(), nullptr, b1.get()} : v == 2 ? audit_weights{w2.get(), nullptr, b2.get()} : audit_weights{};
  };
  audit_sums ls;
  audit_rescore(run, *w2, at_l, {s}, 4, proc, ls);
  metric_map lm;
  ls.write(lm);
  EXPECT_NEAR(lm.at("audit/learner_gen_kl_error"), want_kl, fp8rl::tol::kFp64FewTerms);
  EXPECT_NEAR(lm.at("audit/learner_token_mult_prob_error"), want_tmpe, fp8rl::tol::kFp64FewTerms);
  auto at_q = [&](uint64_t v) {  // (at the current version 2 the current weights' pointer: c's forward)
    return v == 1 ? audit_weights{w1.get(), nullptr, w1.get()} : v == 2 ? audit_weights{w2.get(), nullptr, w2.get()} : audit_weights{};
  };
  audit_sums qs;
  audit_rescore(run, *w2, at_q, {s}, 4, proc, qs);
  metric_map qm;
  qs.write(qm);
  EXPECT_EQ(qm.at("audit/learner_gen_kl_error"), 0.0);
  EXPECT_EQ(qm.at("audit/learner_token_mult_prob_error"), 1.0);
}
