// tests/models/shared_prefix_test.cpp -- shared prefixes (token_batch::prefix). A sequence behind
// a shared prefix computes exactly the rows of the unshared sequence (attention forward and the
// sequence's own gradients bit for bit); the prefix's K/V gradients are the sum over everything
// behind it; the learner's GRPO step on shared prompts keeps its logprobs and loss bit for bit.
// (The finite-difference check of a shared layout is in gradcheck_test.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "models/cpu/cpu_backend.hpp"
#include "models/rl/rl.hpp"
#include "quant/gemm.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;
using fp8rl::test::randn;
using fp8rl::test::to_double;

namespace {

bool same_bits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, static_cast<size_t>(n) * 4) == 0; }

// A root of `root` tokens and the sequences behind it (`kids` tokens each; none: a plain sequence).
struct family {
  int64_t root;
  std::vector<int64_t> kids;
};

// The shared layout of `fams` and its unshared twin (each kid as root copy + kid rows; a family
// without kids as its root alone). umap[u]: the shared row of unshared row u; first[u]: u is a
// kid row or a row of the root's first copy (the rows whose outputs the shared loss sees once).
struct twin_layout {
  std::vector<int32_t> s_start = {0}, s_prefix, u_start = {0};
  std::vector<int64_t> umap;
  std::vector<bool> first;
  int64_t Ts = 0, Tu = 0;
};

twin_layout twin_make(const std::vector<family>& fams) {
  twin_layout L;
  auto add_seq = [](std::vector<int32_t>& start, int64_t n) { start.push_back(start.back() + static_cast<int32_t>(n)); };
  for (const family& f : fams) {
    const int32_t root_seq = static_cast<int32_t>(L.s_prefix.size());
    const int64_t r0 = L.Ts;
    add_seq(L.s_start, f.root);
    L.s_prefix.push_back(-1);
    L.Ts += f.root;
    if (f.kids.empty()) {
      add_seq(L.u_start, f.root);
      for (int64_t i = 0; i < f.root; ++i) L.umap.push_back(r0 + i), L.first.push_back(true);
    }
    for (size_t c = 0; c < f.kids.size(); ++c) {
      const int64_t k0 = L.Ts;
      add_seq(L.s_start, f.kids[c]);
      L.s_prefix.push_back(root_seq);
      L.Ts += f.kids[c];
      add_seq(L.u_start, f.root + f.kids[c]);
      for (int64_t i = 0; i < f.root; ++i) L.umap.push_back(r0 + i), L.first.push_back(c == 0);
      for (int64_t i = 0; i < f.kids[c]; ++i) L.umap.push_back(k0 + i), L.first.push_back(true);
    }
  }
  L.Tu = static_cast<int64_t>(L.umap.size());
  return L;
}

// rows [T][w] gathered through umap (unshared from shared)
std::vector<float> gather_rows(const std::vector<float>& x, const std::vector<int64_t>& umap, int64_t w) {
  std::vector<float> y(umap.size() * static_cast<size_t>(w));
  for (size_t u = 0; u < umap.size(); ++u) std::copy_n(x.data() + umap[u] * w, w, y.data() + u * w);
  return y;
}

}  // namespace

TEST(SharedPrefix, TokenBatchPositionsTargetsAndValidation) {
  token_batch b;
  b.add({1, 2, 3});
  b.add({4, 5}, 0);
  b.add({6}, 0);
  b.add({7, 8});
  EXPECT_EQ(b.prefix, (std::vector<int32_t>{-1, 0, 0, -1}));
  EXPECT_EQ(b.positions(), (std::vector<int32_t>{0, 1, 2, 3, 4, 3, 0, 1}));
  EXPECT_EQ(b.next_targets(), (std::vector<int32_t>{2, 3, -1, 5, -1, -1, 8, -1}));
  EXPECT_NO_THROW(b.validate(10, 5));
  EXPECT_THROW(b.validate(10, 4), std::invalid_argument);  // root + kid = 5 positions
  token_batch chain = b;
  chain.add({9}, 1);  // behind a sequence that has a prefix itself
  EXPECT_THROW(chain.validate(10, 8), std::invalid_argument);
  token_batch fwd = b;
  fwd.prefix[0] = 2;  // a later sequence
  EXPECT_THROW(fwd.validate(10, 8), std::invalid_argument);
  token_batch sz = b;
  sz.prefix.pop_back();
  EXPECT_THROW(sz.validate(10, 8), std::invalid_argument);
}

// Forward rows bit for bit; backward: dq everywhere and dK/dV of rows behind a prefix bit for
// bit, the prefix's dK/dV the sum over its copies. FP32, BF16 and FP8 (per-head scales) operands;
// D = 8 (generic loops), 32 and 64 (register-blocked); roots and kids span 8-row blocks.
TEST(SharedPrefix, AttentionRowsEqualTheUnsharedSequences) {
  auto be = make_cpu_backend();
  const twin_layout L = twin_make({{11, {1, 9, 20}}, {5, {}}, {3, {4}}, {0, {6}}});
  const int64_t H = 4, KV = 2;
  for (int64_t D : {8, 32, 64}) {
    for (int mode = 0; mode < 3; ++mode) {
      const std::vector<float> qs = {0.011f, 0.013f, 0.009f, 0.012f}, ks = {0.01f, 0.012f}, vs = {0.008f, 0.01f};
      attn_params ps, pu;
      for (attn_params* p : {&ps, &pu}) {
        p->H = H; p->KV = KV; p->D = D;
        p->operand = mode == 0 ? precision::fp32 : precision::bf16;
        if (mode == 2) p->q_scale = qs.data(), p->k_scale = ks.data(), p->v_scale = vs.data();
      }
      ps.T = L.Ts; ps.seq_start = L.s_start.data(); ps.S = static_cast<int64_t>(L.s_prefix.size()); ps.prefix = L.s_prefix.data();
      pu.T = L.Tu; pu.seq_start = L.u_start.data(); pu.S = static_cast<int64_t>(L.u_start.size()) - 1;
      const std::string what = " D=" + std::to_string(D) + " mode=" + std::to_string(mode);
      const auto q = randn(L.Ts * H * D, 31), k = randn(L.Ts * KV * D, 32), v = randn(L.Ts * KV * D, 33),
                 r = randn(L.Ts * H * D, 34);
      const auto qu = gather_rows(q, L.umap, H * D), ku = gather_rows(k, L.umap, KV * D), vu = gather_rows(v, L.umap, KV * D);
      std::vector<float> os(q.size()), ls(L.Ts * H), ou(qu.size()), lu(L.Tu * H);
      be->attention_forward(ps, q.data(), k.data(), v.data(), os.data(), ls.data());
      be->attention_forward(pu, qu.data(), ku.data(), vu.data(), ou.data(), lu.data());
      for (int64_t u = 0; u < L.Tu; ++u) {
        ASSERT_TRUE(same_bits(ou.data() + u * H * D, os.data() + L.umap[u] * H * D, H * D)) << "out row " << u << what;
        ASSERT_TRUE(same_bits(lu.data() + u * H, ls.data() + L.umap[u] * H, H)) << "lse row " << u << what;
      }
      // the unshared loss sees each shared output once: root copies after the first get r = 0
      std::vector<float> ru = gather_rows(r, L.umap, H * D);
      for (int64_t u = 0; u < L.Tu; ++u)
        if (!L.first[u]) std::fill_n(ru.begin() + u * H * D, H * D, 0.0f);
      std::vector<float> dqs(q.size()), dks(k.size()), dvs(v.size()), dqu(qu.size()), dku(ku.size()), dvu(vu.size());
      be->attention_backward(ps, q.data(), k.data(), v.data(), os.data(), ls.data(), r.data(), dqs.data(), dks.data(), dvs.data());
      be->attention_backward(pu, qu.data(), ku.data(), vu.data(), ou.data(), lu.data(), ru.data(), dqu.data(), dku.data(),
                             dvu.data());
      std::vector<double> dk_sum(k.size(), 0.0), dv_sum(v.size(), 0.0);
      std::vector<bool> is_root_row(static_cast<size_t>(L.Ts), false);
      for (int64_t s = 0; s + 1 < static_cast<int64_t>(L.s_start.size()); ++s)
        if (L.s_prefix[s] < 0)
          for (int32_t t = L.s_start[s]; t < L.s_start[s + 1]; ++t) is_root_row[t] = true;
      for (int64_t u = 0; u < L.Tu; ++u) {
        const int64_t t = L.umap[u];
        if (L.first[u]) {
          ASSERT_TRUE(same_bits(dqu.data() + u * H * D, dqs.data() + t * H * D, H * D)) << "dq row " << u << what;
        }
        if (!is_root_row[t]) {
          ASSERT_TRUE(same_bits(dku.data() + u * KV * D, dks.data() + t * KV * D, KV * D)) << "dk row " << u << what;
          ASSERT_TRUE(same_bits(dvu.data() + u * KV * D, dvs.data() + t * KV * D, KV * D)) << "dv row " << u << what;
        }
        for (int64_t i = 0; i < KV * D; ++i) {
          dk_sum[t * KV * D + i] += dku[u * KV * D + i];
          dv_sum[t * KV * D + i] += dvu[u * KV * D + i];
        }
      }
      EXPECT_LE(fp8rl::tol::rel_norm_err(to_double(dks), dk_sum), fp8rl::tol::kFp32SumOrder) << what;
      EXPECT_LE(fp8rl::tol::rel_norm_err(to_double(dvs), dv_sum), fp8rl::tol::kFp32SumOrder) << what;
    }
  }
  // a prefix chain (sequence 2 behind sequence 1, itself behind 0) is refused, not misread
  const std::vector<int32_t> starts = {0, 2, 4, 6}, chain = {-1, 0, 1};
  attn_params bad;
  bad.T = 6; bad.H = 2; bad.KV = 1; bad.D = 8; bad.seq_start = starts.data(); bad.S = 3; bad.prefix = chain.data();
  std::vector<float> x(6 * 2 * 8, 0.5f), o(x.size()), l(12);
  EXPECT_THROW(be->attention_forward(bad, x.data(), x.data(), x.data(), o.data(), l.data()), std::invalid_argument);
}

namespace {

// The tiny built-in shape with the precision test's init scale (0.05), so its gradient bounds
// (derived for 3 layers at that scale) apply to these 2 layers.
model_config learner_cfg() {
  model_config c;
  c.hidden_size = 128; c.intermediate_size = 256; c.num_hidden_layers = 2; c.num_attention_heads = 4;
  c.num_key_value_heads = 2; c.head_dim = 32; c.vocab_size = 24; c.max_position_embeddings = 32;
  c.initializer_range = 0.05;
  return c;
}

// Groups of one prompt (sharing), a lone sample, a 1-token prompt (never shared), responses of
// 1..6 tokens; gen_logprobs near the policy's, advantages of both signs.
std::vector<rl_sample> learner_samples() {
  const std::vector<std::pair<std::vector<int32_t>, int>> groups = {
      {{1, 5, 6, 7, 8, 9, 10, 11, 12}, 4}, {{1, 9}, 3}, {{1, 3, 4}, 1}, {{1}, 2}, {{1, 5, 6, 7, 8, 9, 10, 11, 12}, 2}};
  std::vector<rl_sample> out;
  auto noise = randn(64, 41);
  uint64_t id = 0;
  int n = 0;
  for (const auto& [prompt, G] : groups) {
    for (int j = 0; j < G; ++j, ++n) {
      rl_sample s;
      s.prompt_id = id;
      s.group_index = j;
      s.prompt = prompt;
      const int len = 1 + (n * 5) % 6;
      for (int i = 0; i < len; ++i) {
        s.response.push_back(static_cast<int32_t>(2 + (n * 7 + i * 3) % 21));
        s.gen_logprobs.push_back(-3.2f + 0.05f * noise[(n * 6 + i) % 64]);
        s.weight_version.push_back(4);
        s.scale_version.push_back(4);
        s.oldest_kv_version.push_back(4);
        s.oldest_kv_scale_version.push_back(4);
      }
      s.advantage = 0.5f * noise[n % 64];
      out.push_back(s);
    }
    ++id;
  }
  return out;
}

// A tiny model, its parameters and runner, and learner_samples().
struct learner_fixture {
  model_config c = learner_cfg();
  model_params p = model_params_init(c, 5);
  std::unique_ptr<backend> be = make_cpu_backend();
  model_runner run{*be};
  std::vector<rl_sample> samples = learner_samples();
};

}  // namespace

TEST(SharedPrefix, LearnerBatchSharesGroupPromptsAndPredictsTheResponses) {
  const auto samples = learner_samples();
  for (bool share : {false, true}) {
    const learner_batch lb = learner_batch_build(samples, share);
    const auto next = lb.b.next_targets();
    ASSERT_EQ(lb.targets.size(), static_cast<size_t>(lb.b.T()));
    size_t k = 0, rows = 0;
    for (size_t i = 0; i < samples.size(); ++i) {
      const auto& s = samples[i];
      const bool in_group = i < 7 || i >= 10;  // the three shared groups (learner_samples)
      rows += s.response.size() - 1 + (share && in_group ? 1 : s.prompt.size());  // last response token: no row
      for (size_t j = 0; j < s.response.size(); ++j) {
        ASSERT_LT(k, lb.at.size());
        const auto t = static_cast<size_t>(lb.at[k++]);
        EXPECT_EQ(lb.targets[t], s.response[j]) << "share=" << share << " token " << k - 1;
        if (j + 1 < s.response.size()) {
          EXPECT_EQ(next[t], s.response[j]);  // the row's own next token
        }
      }
    }
    EXPECT_EQ(k, lb.at.size());
    if (!share) {
      EXPECT_EQ(lb.b.T(), static_cast<int64_t>(rows));
    }
    EXPECT_EQ(std::count_if(lb.targets.begin(), lb.targets.end(), [](int32_t x) { return x >= 0; }),
              static_cast<int64_t>(k));
    EXPECT_NO_THROW(lb.b.validate(24, 32));
    if (!share) {
      EXPECT_TRUE(lb.b.prefix.empty());
      EXPECT_EQ(lb.b.S(), static_cast<int64_t>(samples.size()));
    } else {
      // 3 shared groups (4, 3 and 2 samples), the lone sample and the 1-token prompt unshared
      int roots = 0, kids = 0;
      for (int64_t s = 0; s < lb.b.S(); ++s) (lb.b.prefix[s] < 0 ? roots : kids) += 1;
      EXPECT_EQ(kids, 9);
      EXPECT_EQ(roots, 3 + 1 + 2);
      int64_t prompt_rows = 0;  // each shared group's prompt but its last token, once
      for (int64_t s = 0; s < lb.b.S(); ++s)
        if (lb.b.prefix[s] < 0 && s + 1 < lb.b.S() && lb.b.prefix[s + 1] == s) prompt_rows += lb.b.seq_start[s + 1] - lb.b.seq_start[s];
      EXPECT_EQ(prompt_rows, 8 + 1 + 8);
      EXPECT_EQ(lb.b.T(), static_cast<int64_t>(rows) + prompt_rows);
    }
  }
  auto bad = samples;
  bad[1].prompt.clear();
  EXPECT_THROW(learner_batch_build(bad, true), std::invalid_argument);
}

// The learner's rows (shared prompts, no last-token rows) give the logprobs of the full
// unshared sequences (prompt + response, as the generation check compares them) bit for bit.
TEST(SharedPrefix, LearnerBatchLogprobsEqualFullSequences) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  token_batch full;
  std::vector<int64_t> full_at;
  for (const auto& s : samples) {
    auto seq = s.prompt;
    seq.insert(seq.end(), s.response.begin(), s.response.end());
    for (size_t j = 0; j < s.response.size(); ++j) full_at.push_back(full.T() + static_cast<int64_t>(s.prompt.size() + j) - 1);
    full.add(seq);
  }
  for (const char* pol : {"fp32", "fp8"}) {
    auto w = model_weights_build(*be, c, precision_policy::named(pol), {&p, nullptr, nullptr}, true);
    run.forward(*w, full, false);
    const auto ft = full.next_targets();
    std::vector<float> lf(ft.size());
    run.logprobs(ft, {}, lf.data());
    for (bool share : {false, true}) {
      const learner_batch lb = learner_batch_build(samples, share);
      run.forward(*w, lb.b, false);
      std::vector<float> ll(lb.targets.size());
      run.logprobs(lb.targets, {}, ll.data());
      ASSERT_EQ(lb.at.size(), full_at.size());
      for (size_t k = 0; k < full_at.size(); ++k)
        ASSERT_TRUE(same_bits(&ll[static_cast<size_t>(lb.at[k])], &lf[static_cast<size_t>(full_at[k])], 1))
            << pol << " share=" << share << " token " << k;
    }
  }
}

// The learner's step with and without shared prompts: logprobs (hence loss, dL/dc and every
// metric) bit for bit under each policy; FP32 gradients equal up to summation order.
class LearnerStepSharing : public ::testing::TestWithParam<const char*> {};
TEST_P(LearnerStepSharing, KeepsLogprobsAndLoss) {
  if (std::string(GetParam()).find("tiles") != std::string::npos && !fp8rl::quant::gemm_tiles_available())
    GTEST_SKIP() << "no AMX-BF16 here";
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  grpo_config on, off;
  off.share_prompts = false;
  const char* pol = GetParam();
  auto w = model_weights_build(*be, c, precision_policy::named(pol), {&p, nullptr, nullptr}, true);
  const learner_out a = learner_grpo(run, *w, samples, on, 40.0, 5);
  const learner_out b = learner_grpo(run, *w, samples, off, 40.0, 5);
  EXPECT_EQ(a.loss.loss, b.loss.loss) << pol;
  EXPECT_EQ(a.loss.dc, b.loss.dc) << pol;
  EXPECT_EQ(a.loss.metrics, b.loss.metrics) << pol;
  EXPECT_EQ(a.tokens.c, b.tokens.c) << pol;  // the learner logprobs themselves
  EXPECT_FALSE(a.tokens.c.empty()) << pol;
  const double e = fp8rl::tol::rel_norm_err(to_double(a.grads), to_double(b.grads));
  std::printf("%s: shared vs unshared learner gradient rel err %.3g\n", pol, e);
  // FP32: summation order only; the others: each layout within its policy's bound of FP32 (the
  // next test), so within twice that of each other
  const std::string name = pol;
  const double bound = name == "fp32"   ? fp8rl::tol::kFp32SumOrder
                       : name == "bf16" ? 2 * fp8rl::tol::kModelBf16VsF32Grad
                                        : 2 * fp8rl::tol::kModelFp8VsF32Grad;
  EXPECT_LE(e, bound) << pol;
}
INSTANTIATE_TEST_SUITE_P(Policies, LearnerStepSharing, ::testing::Values("fp32", "bf16", "fp8", "fp8-tiles"),
                         [](const auto& info) { return std::string(info.param) == "fp8-tiles" ? std::string("fp8_tiles") : std::string(info.param); });

// The model's gradient for one dlogp on the shared layout meets the bound its unshared layout
// meets against FP32 (the Precision.ModelLogitsAndGradientsNearFp32 bounds): the FP8 wgrad then
// quantizes a different token set (the prompt rows once, their gradients summed), no worse.
TEST(SharedPrefix, ModelGradientsOnSharedLayoutsMeetThePolicyBounds) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  const learner_batch ls = learner_batch_build(samples, true), lu = learner_batch_build(samples, false);
  const auto dl = randn(ls.at.size(), 43);
  auto grads = [&](const char* pol, const learner_batch& lb) {
    auto w = model_weights_build(*be, c, precision_policy::named(pol), {&p, nullptr, nullptr}, true);
    run.forward(*w, lb.b, true);
    const auto& targets = lb.targets;
    std::vector<float> lp(targets.size()), dlogp(targets.size(), 0.0f), g(static_cast<size_t>(p.layout.total), 0.0f);
    run.logprobs(targets, {}, lp.data());
    for (size_t k = 0; k < lb.at.size(); ++k) dlogp[static_cast<size_t>(lb.at[k])] = dl[k];
    run.backward(*w, targets, {}, dlogp.data(), g.data());
    return to_double(g);
  };
  const auto ref = grads("fp32", lu);
  EXPECT_LE(fp8rl::tol::rel_norm_err(grads("fp32", ls), ref), fp8rl::tol::kFp32SumOrder);
  for (const char* pol : {"bf16", "fp8"}) {
    const double bound = std::string(pol) == "bf16" ? fp8rl::tol::kModelBf16VsF32Grad : fp8rl::tol::kModelFp8VsF32Grad;
    const double es = fp8rl::tol::rel_norm_err(grads(pol, ls), ref), eu = fp8rl::tol::rel_norm_err(grads(pol, lu), ref);
    std::printf("%s vs fp32 gradient: shared %.3g, unshared %.3g (bound %.3g)\n", pol, es, eu, bound);
    EXPECT_LE(es, bound) << pol;
    EXPECT_LE(eu, bound) << pol;
    EXPECT_LE(es, eu * fp8rl::tol::kSharedVsUnsharedErr) << pol << ": the shared layout loses accuracy";
  }
}

// Samples come over the wire: a response token past the vocabulary (read past its logits row in
// the forward, written into another row in the backward), a -1 (taken for "no target": logp 0)
// and per-token arrays shorter than the response (read past their ends) are refused naming the
// sample; the runner's logprobs and backward refuse such targets themselves as well.
TEST(SharedPrefix, LearnerRefusesSamplesItCannotRead) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
  using fp8rl::test::thrown_text;
  auto refused = [&](std::vector<rl_sample> s) {
    return thrown_text<std::invalid_argument>([&] { learner_grpo(run, *w, s, grpo_config{}, 40.0, 5); });
  };
  auto bad = samples;
  bad[3].response.back() = static_cast<int32_t>(c.vocab_size) + 40;
  EXPECT_NE(refused(bad).find("sample 3"), std::string::npos) << refused(bad);
  EXPECT_NE(refused(bad).find("response token"), std::string::npos) << refused(bad);
  bad = samples;
  bad[2].response.back() = -1;
  EXPECT_NE(refused(bad).find("sample 2"), std::string::npos) << refused(bad);
  bad = samples;
  bad[1].gen_logprobs.pop_back();
  EXPECT_NE(refused(bad).find("gen_logprobs"), std::string::npos) << refused(bad);
  EXPECT_NE(thrown_text<std::invalid_argument>([&] { rl_tokens(bad); }).find("sample 1"), std::string::npos);
  bad = samples;
  bad[0].weight_version.clear();
  EXPECT_NE(refused(bad).find("weight_version"), std::string::npos) << refused(bad);
  bad = samples;
  bad[0].oldest_kv_version.pop_back();  // audit mode reads it beside weight_version
  EXPECT_NE(refused(bad).find("oldest_kv_version"), std::string::npos) << refused(bad);
  bad = samples;
  bad[1].oldest_kv_scale_version.pop_back();
  EXPECT_NE(refused(bad).find("oldest_kv_scale_version"), std::string::npos) << refused(bad);
  bad = samples;
  bad[0].scale_version.push_back(0);
  EXPECT_NE(refused(bad).find("scale_version has"), std::string::npos) << refused(bad);
  EXPECT_EQ(refused(samples), "");
  // the runner itself: one target per token, each -1 or an id
  const learner_batch lb = learner_batch_build(samples, true);
  run.forward(*w, lb.b, true);
  std::vector<float> lp(lb.targets.size());
  auto targets = lb.targets;
  targets[2] = static_cast<int32_t>(c.vocab_size);
  EXPECT_NE(thrown_text<std::invalid_argument>([&] { run.logprobs(targets, {}, lp.data()); }).find("token 2"),
            std::string::npos);
  std::vector<float> dlogp(targets.size(), 0.0f), grads(static_cast<size_t>(p.layout.total), 0.0f);
  EXPECT_NE(thrown_text<std::invalid_argument>([&] { run.backward(*w, targets, {}, dlogp.data(), grads.data()); })
                .find("token 2"),
            std::string::npos);
  targets.pop_back();
  EXPECT_THROW(run.backward(*w, targets, {}, dlogp.data(), grads.data()), std::invalid_argument);
}

// A shard whose samples carry no response token (only hand-built or wire samples: generation
// refuses max_tokens <= 0) is an empty shard: zero gradients, and it still joins the filter's
// all-reduce. Its backward over no tokens threw (a K = 0 wgrad operand had no FP32 form).
TEST(SharedPrefix, ASampleWithoutResponseTokensIsAnEmptyShard) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  std::vector<rl_sample> empty(1, samples[0]);  // one sample: no shared prompt row either
  for (auto& s : empty) s.response.clear(), s.gen_logprobs.clear(), s.weight_version.clear(), s.scale_version.clear(),
                        s.oldest_kv_version.clear(), s.oldest_kv_scale_version.clear();
  grpo_config cfg;
  cfg.seq_logprob_error_threshold = 2.0f;
  int joined = 0;
  for (const char* policy : {"fp32", "fp8"}) {
    auto w = model_weights_build(*be, c, precision_policy::named(policy), {&p, nullptr, nullptr}, true);
    const learner_out o = learner_grpo(run, *w, empty, cfg, 40.0, 5, nullptr, {}, [&](double x) { ++joined; return x; });
    EXPECT_EQ(o.grads, std::vector<float>(static_cast<size_t>(p.layout.total), 0.0f)) << policy;
    EXPECT_EQ(o.tokens.size(), 0) << policy;
  }
  EXPECT_EQ(joined, 2);
}

// The learner's gradient is the gradient of its loss through the logprobs: a small step against
// it changes the logprobs c_k by dc_k-weighted amounts whose sum is -eta |g|^2 to first order
// (dL/dc from the loss, chained through the runner's backward). A flipped sign, a lost IS weight
// or a token's dc sent to the wrong row moves the sum off -eta |g|^2 (or its sign).
TEST(SharedPrefix, LearnerGradientIsTheLossGradientThroughTheLogprobs) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  for (bool share : {false, true}) {
    grpo_config cfg;
    cfg.share_prompts = share;
    auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
    const learner_out a = learner_grpo(run, *w, samples, cfg, 40.0, 5);
    double g2 = 0;
    for (float g : a.grads) g2 += double(g) * g;
    ASSERT_GT(g2, 0.0);
    const double eta = 1e-3 / std::sqrt(g2);  // a step of 1e-3 in parameter space
    model_params q = p;
    for (size_t i = 0; i < q.data.size(); ++i) q.data[i] -= static_cast<float>(eta * a.grads[i]);
    auto wq = model_weights_build(*be, c, precision_policy::named("fp32"), {&q, nullptr, nullptr}, true);
    const learner_out b = learner_grpo(run, *wq, samples, cfg, 40.0, 5);
    ASSERT_EQ(a.tokens.c.size(), b.tokens.c.size());
    double change = 0;
    for (size_t k = 0; k < a.loss.dc.size(); ++k) change += double(a.loss.dc[k]) * (double(b.tokens.c[k]) - a.tokens.c[k]);
    std::printf("share=%d: change %.6g, -eta |g|^2 %.6g\n", int(share), change, -eta * g2);
    EXPECT_NEAR(change / (-eta * g2), 1.0, fp8rl::tol::kFirstOrderStep) << "share=" << share;
  }
}

// Data-parallel learners sum their shards' gradients (rl-algorithm.md section 3): each shard's
// loss is divided by the global N, so shard A's gradient plus shard B's is the whole batch's (FP32:
// up to summation order), and so are the losses; a learner dividing by its own count -- or
// learners averaging -- is off by the shards' token shares.
TEST(SharedPrefix, ShardGradientsSumToTheBatchGradient) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  grpo_config cfg;
  auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
  double N = 0;
  for (const auto& s : samples) N += double(s.response.size());
  const size_t cut = 7;  // whole groups on each side (learner_samples: groups of 4 and 3 | 1, 2 and 2)
  const std::vector<rl_sample> a(samples.begin(), samples.begin() + cut), b(samples.begin() + cut, samples.end());
  const learner_out whole = learner_grpo(run, *w, samples, cfg, N, 5);
  const learner_out sa = learner_grpo(run, *w, a, cfg, N, 5), sb = learner_grpo(run, *w, b, cfg, N, 5);
  std::vector<double> sum(whole.grads.size());
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = double(sa.grads[i]) + double(sb.grads[i]);
  const double e = fp8rl::tol::rel_norm_err(to_double(whole.grads), sum);
  std::printf("shard A + shard B vs whole batch gradient rel err %.3g\n", e);
  EXPECT_LE(e, fp8rl::tol::kFp32SumOrder);
  EXPECT_NEAR(sa.loss.loss + sb.loss.loss, whole.loss.loss, fp8rl::tol::kFp32SumOrder * std::fabs(whole.loss.loss));
  ASSERT_GT(fp8rl::tol::rel_norm_err(to_double(whole.grads), to_double(sa.grads)), 0.1) << "shard B adds nothing: the test tests nothing";
}

// The learner sets p := c (rl-algorithm.md section 4) with g from the rollouts unchanged: at g != c
// the IS weight is exp(c - g) (tis: clamped to [0, 2]) and gen_kl_error is k3 of c - g, over the
// step's tokens -- a learner taking p from g (weight 1, KL 0) or keeping a stale p fails it.
TEST(SharedPrefix, TheLearnersWeightsAndMismatchUseItsOwnLogprobs) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  grpo_config cfg;  // tis, [0, 2]
  auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
  double N = 0;
  for (const auto& s : samples) N += double(s.response.size());
  const learner_out o = learner_grpo(run, *w, samples, cfg, N, 5);
  ASSERT_EQ(o.tokens.c, o.tokens.p);
  double w_sum = 0, kl = 0, n = 0, above = 0;
  size_t k = 0;
  for (const auto& s : samples)
    for (float g : s.gen_logprobs) {
      const double d = double(o.tokens.c[k++]) - g;  // p - g with p = c
      w_sum += std::clamp(std::exp(d), 0.0, 2.0);
      kl += std::exp(d) - d - 1;
      above += std::exp(d) > 2;
      n += 1;
    }
  ASSERT_EQ(k, o.tokens.c.size());
  ASSERT_GT(kl / n, 1e-3) << "g is c: the test tests nothing";
  ASSERT_GT(above, 0) << "no weight clamped: the truncation goes untested";
  EXPECT_NEAR(o.loss.metrics.at("sampling_importance_ratio"), w_sum / n, fp8rl::tol::kMetricFromFloatInputs);
  EXPECT_NEAR(o.loss.metrics.at("gen_kl_error"), kl / n, fp8rl::tol::kMetricFromFloatInputs);
}

// The e_i filter's token count with one learner: summing it over learners (a one-learner
// all-reduce) or not gives the same N, so the same loss, gradients and metrics.
TEST(SharedPrefix, FilteredTokensLeaveNTheSameWithOrWithoutTheLearnersSum) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  grpo_config cfg;
  cfg.seq_logprob_error_threshold = 1.5f;
  auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
  const learner_out alone = learner_grpo(run, *w, samples, cfg, 40.0, 5);
  int called = 0;
  const learner_out summed = learner_grpo(run, *w, samples, cfg, 40.0, 5, nullptr, {}, [&](double x) { ++called; return x; });
  EXPECT_EQ(called, 1);
  ASSERT_GT(alone.loss.metrics.at("num_masked_seqs"), 0.0) << "the threshold filters nothing: the test tests nothing";
  ASSERT_LT(alone.loss.metrics.at("num_masked_seqs"), double(samples.size())) << "everything filtered: N = 0";
  EXPECT_EQ(alone.loss.loss, summed.loss.loss);
  EXPECT_EQ(alone.loss.dc, summed.loss.dc);
  EXPECT_EQ(alone.grads, summed.grads);
  EXPECT_EQ(alone.loss.metrics, summed.loss.metrics);
}

// backward adds into the gradient buffer (micro-batches and learners' shards accumulate there):
// a second backward of the same batch into the first's gradients doubles them, in every policy's
// kernels (the weight gradients' FP8/BF16 GEMMs write into it too).
TEST(SharedPrefix, BackwardAddsIntoTheGradientBuffer) {
  learner_fixture F;
  auto& [c, p, be, run, samples] = F;
  const learner_batch lb = learner_batch_build(samples, true);
  const auto noise = randn(lb.targets.size(), 77);
  std::vector<float> dlogp(lb.targets.size(), 0.0f);
  for (size_t t = 0; t < dlogp.size(); ++t)
    if (lb.targets[t] >= 0) dlogp[t] = noise[t];
  for (const char* pol : {"fp32", "bf16", "fp8"}) {
    auto w = model_weights_build(*be, c, precision_policy::named(pol), {&p, nullptr, nullptr}, true);
    std::vector<float> once(static_cast<size_t>(p.layout.total), 0.0f);
    run.forward(*w, lb.b, true);
    run.backward(*w, lb.targets, {}, dlogp.data(), once.data());
    std::vector<float> twice = once;
    run.forward(*w, lb.b, true);
    run.backward(*w, lb.targets, {}, dlogp.data(), twice.data());
    std::vector<double> doubled(once.size());
    for (size_t i = 0; i < once.size(); ++i) doubled[i] = 2.0 * once[i];
    // the same products added twice: exact where a parameter takes one contribution per call, a
    // sum's rounding where it takes several (tied embeddings, norms over rows)
    EXPECT_LE(fp8rl::tol::rel_norm_err(to_double(twice), doubled), fp8rl::tol::kFp32SumOrder) << pol;
    for (const param_info& info : p.layout.infos) {  // every tensor, not only the norm over all
      const auto at = [&](const auto& v) { return std::vector<double>(v.begin() + info.offset, v.begin() + info.offset + info.numel); };
      EXPECT_LE(fp8rl::tol::rel_norm_err(at(to_double(twice)), at(doubled)), fp8rl::tol::kFp32SumOrder) << pol << " " << info.name;
    }
  }
}
