// tests/models/generate_test.cpp -- the generation engine: logprobs equal the training forward
// bit for bit (every policy with its matching KV cache), continuous batching equals running each
// request alone, adoption at step boundaries with version tags (recompute / keep), concurrent
// adoption, refused bundles and K/V scales, K/V scales adopted mid-generation, FP8 KV-cache
// mismatch measured; cached attention (all query rows of a KV head at once, K/V widened in
// registers, FP8 for every code) equals cpu_attn_query one row at a time, and the training forward's rows equal it.
// Sampling itself: tests/models/sampling_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <set>
#include <thread>

#include <tbb/global_control.h>
#include <tbb/task_arena.h>
#include <xmmintrin.h>

#include "models/cpu/cpu_backend.hpp"
#include "models/generate.hpp"
#include "models/rl/loop.hpp"
#include "quant/gemm.hpp"
#include "tests/models/gen_util.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;
using namespace fp8rl::models::test;

namespace {
model_config cfg() { return gen_cfg(); }
}  // namespace

class GenConsistency : public ::testing::TestWithParam<const char*> {};

TEST_P(GenConsistency, LogprobsEqualTrainingForwardBitForBit) {
  if (std::string(GetParam()).find("tiles") != std::string::npos && !fp8rl::quant::gemm_tiles_available())
    GTEST_SKIP() << "no AMX-BF16 here";
  const model_params p = model_params_init(cfg(), 3);
  auto be = make_cpu_backend();
  // with the FP8 KV cache (generation-only: the learner's policy drops it), the reference is the
  // same policy's forward with FP8 attention under the same scales: the cache's codes are what the
  // forward's per-head FP8 quantization makes, so the two still agree bit for bit
  const bool fp8_kv = precision_policy::named(GetParam()).kv == kv_dtype::fp8;
  const attn_fp8_scales sc = calibrated_scales(p, requests(6, 1.0f));
  for (logit_processing proc : {logit_processing{1.0f, 0, 1.0f}, logit_processing{0.7f, 0, 1.0f},
                                logit_processing{1.0f, 10, 0.9f}}) {
    generation_engine eng(*be, p.cfg, ecfg(GetParam(), 3));
    ASSERT_EQ(eng.adopt_params(p, 1, 1, fp8_kv ? &sc : nullptr), "");
    for (auto& r : requests(6, proc.temperature, proc.top_k, proc.top_p)) eng.submit(r);
    auto res = eng.run_to_completion();
    ASSERT_EQ(res.size(), 6u);
    auto lp = fp8_kv ? learner_forward(p, eng.config().policy, res, proc, &sc).logprobs
                     : learner_logprobs(p, eng.config().policy.training(), res, proc);
    for (size_t i = 0; i < res.size(); ++i)
      EXPECT_TRUE(same(res[i].logprobs, lp[i])) << GetParam() << " request " << i << " T=" << proc.temperature;
  }
}

// The tile policies too: their GEMM rows never mix, so decode (M = slots) and the training
// forward (M = all tokens) still agree bit for bit.
INSTANTIATE_TEST_SUITE_P(Policies, GenConsistency,
                         ::testing::Values("fp32", "bf16", "fp8", "fp8-kv", "bf16-tiles", "fp8-tiles", "fp8-kv-tiles"));

// Every policy (the FP8 KV cache too), sampled, greedy and truncated, with stop tokens ending
// some requests early (their slots taken by waiting ones), in 2 and 5 slots: each request's
// tokens, logprobs and finish equal running it alone.
TEST(Generate, ContinuousBatchingEqualsRunningAlone) {
  const model_params p = model_params_init(cfg(), 4);
  auto be = make_cpu_backend();
  const attn_fp8_scales sc = calibrated_scales(p, requests(8, 1.0f));
  int stopped = 0;
  for (const char* policy : {"fp32", "bf16", "fp8", "fp8-kv"})
    for (const logit_processing proc : {logit_processing{0.9f, 0, 1.0f}, logit_processing{0.0f, 0, 1.0f}, logit_processing{1.0f, 5, 0.8f}})
      for (const int64_t slots : {2, 5}) {
        const attn_fp8_scales* s8 = std::string(policy) == "fp8-kv" ? &sc : nullptr;
        auto reqs = requests(8, proc.temperature, proc.top_k, proc.top_p);
        for (size_t i = 0; i < reqs.size(); i += 2) reqs[i].stop_tokens = {7, 19, 23, 31, 42, 55};  // a few common ids
        generation_engine batched(*be, p.cfg, ecfg(policy, slots));
        ASSERT_EQ(batched.adopt_params(p, 1, 1, s8), "");
        for (auto& r : reqs) batched.submit(r);
        const auto all = batched.run_to_completion();
        ASSERT_EQ(all.size(), reqs.size());
        for (const auto& r : reqs) {
          generation_engine alone(*be, p.cfg, ecfg(policy, 1));
          ASSERT_EQ(alone.adopt_params(p, 1, 1, s8), "");
          alone.submit(r);
          const auto one = alone.run_to_completion();
          const auto& b = *std::find_if(all.begin(), all.end(), [&](const gen_result& x) { return x.id == r.id; });
          const std::string where = std::string(policy) + " T=" + std::to_string(proc.temperature) + " slots " +
                                    std::to_string(slots) + " request " + std::to_string(r.id);
          EXPECT_EQ(one[0].tokens, b.tokens) << where;
          EXPECT_TRUE(same(one[0].logprobs, b.logprobs)) << where;
          EXPECT_EQ(one[0].finish, b.finish) << where;
          stopped += b.finish == "stop";
        }
      }
  EXPECT_GT(stopped, 0);  // stop tokens did end some requests early
}

// A step whose slots bring more than max_step_tokens new tokens (fresh prompts; a recompute
// adoption re-reading every context) runs several forwards of whole slots: the same tokens and
// logprobs, bit for bit, as one forward (it was one forward of every context at once: activations
// scaling with slots x context).
TEST(Generate, ChunkedStepsEqualOneForward) {
  const model_params p1 = model_params_init(cfg(), 4), p2 = model_params_init(cfg(), 5);
  auto be = make_cpu_backend();
  for (const char* policy : {"fp32", "fp8", "fp8-kv"}) {
    auto run = [&](int64_t max_step_tokens) {
      engine_config ec = ecfg(policy, 3);
      ec.max_step_tokens = max_step_tokens;
      const int64_t L = p1.cfg.num_hidden_layers, H = p1.cfg.num_attention_heads, KV = p1.cfg.num_key_value_heads;
      // scales small enough that some queries and K/V saturate: the counts are compared, not 0 == 0
      const attn_fp8_scales sc{std::vector<float>(L * H, 2e-4f), std::vector<float>(L * KV, 2e-4f), std::vector<float>(L * KV, 2e-4f)};
      const bool kv8 = std::string(policy) == "fp8-kv";
      generation_engine e(*be, p1.cfg, ec);
      EXPECT_EQ(e.adopt_params(p1, 1, 1, kv8 ? &sc : nullptr), "");
      for (auto& r : requests(5, 0.9f)) e.submit(r);
      std::vector<gen_result> out;
      for (int i = 0; i < 3; ++i)
        for (auto& r : e.step()) out.push_back(std::move(r));
      EXPECT_EQ(e.adopt_params(p2, 2, 2, kv8 ? &sc : nullptr), "");  // recompute: every context again
      for (auto& r : e.run_to_completion()) out.push_back(std::move(r));
      std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
      return std::make_pair(out, e.stats());
    };
    const auto [one, one_stats] = run(1 << 20);
    const auto [chunked, chunked_stats] = run(5);  // under one prompt plus its generated tokens
    ASSERT_EQ(one.size(), chunked.size()) << policy;
    EXPECT_GT(one_stats.recomputed_tokens, 0) << policy;
    for (size_t i = 0; i < one.size(); ++i) {
      EXPECT_EQ(one[i].tokens, chunked[i].tokens) << policy << " " << i;
      EXPECT_TRUE(same(one[i].logprobs, chunked[i].logprobs)) << policy << " " << i;
    }
    EXPECT_EQ(one_stats.kv_saturated, chunked_stats.kv_saturated) << policy;
    EXPECT_EQ(one_stats.q_saturated, chunked_stats.q_saturated) << policy;
    if (std::string(policy) == "fp8-kv") {
      for (const auto* sat : {&one_stats.kv_saturated, &one_stats.q_saturated})
        EXPECT_GT(std::accumulate(sat->begin(), sat->end(), int64_t{0}), 0) << policy;
    }
  }
}

// Same seed: the same tokens and logprobs for every request, in every policy; another seed
// another stream.
TEST(Generate, SeededSamplingIsReproducible) {
  const model_params p = model_params_init(cfg(), 5);
  auto be = make_cpu_backend();
  const attn_fp8_scales sc = calibrated_scales(p, requests(3, 1.0f));
  for (const char* policy : {"fp32", "fp8", "fp8-kv"}) {
    auto run = [&](uint64_t seed) {
      generation_engine e(*be, p.cfg, ecfg(policy, 2));
      EXPECT_EQ(e.adopt_params(p, 1, 1, std::string(policy) == "fp8-kv" ? &sc : nullptr), "");
      auto r = requests(3, 1.0f, 20, 0.95f);
      for (auto& q : r) { q.seed = seed; q.max_tokens = 12; e.submit(q); }
      auto res = e.run_to_completion();
      std::sort(res.begin(), res.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
      return res;
    };
    const auto a = run(7), b = run(7), c = run(8);
    ASSERT_EQ(a.size(), 3u);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].tokens, b[i].tokens) << policy << " " << i;
      EXPECT_TRUE(same(a[i].logprobs, b[i].logprobs)) << policy << " " << i;
      EXPECT_NE(a[i].tokens, c[i].tokens) << policy << " " << i;  // 12 draws over 20 tokens: the same stream is ~impossible
    }
  }
}

// The random stream is keyed by (seed, request id, token index): under a uniform distribution
// (lm_head zeroed) a stream ignoring the index draws one token over and over, and one ignoring
// the id gives a GRPO group -- one prompt, one seed, G ids -- G copies of one completion.
TEST(Generate, TheStreamDependsOnTheRequestAndTheTokenIndex) {
  model_params p = model_params_init(cfg(), 5);
  std::fill_n(p.get("lm_head.weight"), p.cfg.vocab_size * p.cfg.hidden_size, 0.0f);
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp32", 2));
  ASSERT_EQ(e.adopt_params(p, 1, 1), "");
  for (uint64_t id : {1, 2}) {
    gen_request q;
    q.id = id;
    q.prompt = {3, 4, 5};
    q.max_tokens = 12;
    q.seed = 9;
    e.submit(q);
  }
  auto res = e.run_to_completion();
  ASSERT_EQ(res.size(), 2u);
  for (const auto& r : res) {
    ASSERT_EQ(r.tokens.size(), 12u);
    EXPECT_NE(std::count(r.tokens.begin(), r.tokens.end(), r.tokens[0]), 12) << r.id;  // 61^-11 by chance
  }
  EXPECT_NE(res[0].tokens, res[1].tokens);
}

TEST(Generate, AdoptionAtStepBoundariesTagsTokens) {
  const model_params p1 = model_params_init(cfg(), 6), p2 = model_params_init(cfg(), 7);
  auto be = make_cpu_backend();
  for (kv_adopt_policy pol : {kv_adopt_policy::recompute, kv_adopt_policy::keep}) {
    engine_config ec = ecfg("fp8", 2);
    ec.on_adopt = pol;
    generation_engine e(*be, p1.cfg, ec);
    e.adopt_params(p1, 1, 1);
    auto r = requests(1, 1.0f);
    r[0].max_tokens = 10;
    e.submit(r[0]);
    for (int i = 0; i < 4; ++i) e.step();
    ASSERT_EQ(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(
                  bundle_from_params(p2, ec.policy, 2, 5, nullptr))), "");
    auto res = e.run_to_completion();
    ASSERT_EQ(res.size(), 1u);
    const auto& t = res[0];
    for (size_t i = 0; i < t.tokens.size(); ++i) {
      EXPECT_EQ(t.weight_version[i], i < 4 ? 1u : 2u) << i;
      EXPECT_EQ(t.scale_version[i], i < 4 ? 1u : 5u) << i;
      const uint64_t want_oldest = i < 4 ? 1 : (pol == kv_adopt_policy::recompute ? 2 : 1);
      EXPECT_EQ(t.oldest_kv_version[i], want_oldest) << i;
    }
    EXPECT_EQ(t.kv_policy, pol);
    if (pol == kv_adopt_policy::recompute) {  // after recompute, tokens are exactly v2's
      auto lp = learner_logprobs(p2, ec.policy.training(), res, {});
      for (size_t i = 4; i < t.tokens.size(); ++i) EXPECT_EQ(std::memcmp(&t.logprobs[i], &lp[0][i], 4), 0) << i;
    }
  }
}

TEST(Generate, ConcurrentAdopterNeverTearsAStep) {
  // oneTBB without worker threads: under TSan (libtbb is not instrumented) the only concurrency
  // left is the adopter thread against the stepping thread -- the handoff this test is about.
  tbb::global_control serial(tbb::global_control::max_allowed_parallelism, 1);
  const model_params base = model_params_init(cfg(), 8);
  std::vector<model_params> vers;
  for (int v = 0; v < 6; ++v) { vers.push_back(base); for (auto& x : vers.back().data) x *= 1.0f + 0.01f * v; }
  auto be = make_cpu_backend();
  engine_config ec = ecfg("fp8", 4);
  generation_engine e(*be, base.cfg, ec);
  e.adopt_params(vers[0], 1, 1);
  std::vector<std::shared_ptr<const fp8rl::quant::weight_bundle>> bundles;
  for (int v = 1; v < 6; ++v)
    bundles.push_back(std::make_shared<fp8rl::quant::weight_bundle>(bundle_from_params(vers[v], ec.policy, v + 1, v + 1, nullptr)));
  for (auto& r : requests(12, 1.0f)) { r.max_tokens = 20; e.submit(r); }
  // Each thread runs oneTBB in a one-slot arena: no TBB worker threads take part, so under TSan
  // (uninstrumented libtbb) the only concurrency is the adopter vs the stepping thread.
  // The adopter starts adopting bundle k once the stepping thread has finished step 2k+1, while
  // step 2k+2 runs; the stepper waits for that adoption before step 2k+3 (an adoption, which
  // unpacks a bundle, can outlast a step of this tiny model). So every adoption overlaps a
  // running step and lands mid-generation (12 x 20 tokens in 4 slots take 60 steps) -- forced,
  // not left to timing.
  std::atomic<int> steps{0}, adopted{0};
  const int n_bundles = static_cast<int>(bundles.size());
  std::thread adopter([&] {
    tbb::task_arena(1).execute([&] {
      for (int k = 0; k < n_bundles; ++k) {
        while (steps.load() < 2 * k + 1) std::this_thread::yield();
        EXPECT_EQ(e.adopt(bundles[static_cast<size_t>(k)]), "");
        adopted.store(k + 1);
      }
    });
  });
  std::vector<gen_result> res;
  tbb::task_arena(1).execute([&] {
    while (!e.idle()) {
      const int s = steps.load();  // steps done; the next is s + 1
      if (s >= 2 && (s - 2) % 2 == 0 && (s - 2) / 2 < n_bundles)
        while (adopted.load() < (s - 2) / 2 + 1) std::this_thread::yield();
      for (auto& r : e.step()) res.push_back(std::move(r));
      steps.fetch_add(1);
    }
  });
  adopter.join();
  ASSERT_EQ(res.size(), 12u);
  std::set<uint64_t> seen;
  int spanning = 0;  // requests whose tokens carry more than one version
  for (const auto& r : res) {
    seen.insert(r.weight_version.begin(), r.weight_version.end());
    spanning += r.weight_version.front() != r.weight_version.back();
    for (size_t i = 1; i < r.tokens.size(); ++i) {
      EXPECT_GE(r.weight_version[i], r.weight_version[i - 1]);
      EXPECT_EQ(r.weight_version[i], r.scale_version[i]);
      EXPECT_LE(r.oldest_kv_version[i], r.weight_version[i]);
    }
  }
  EXPECT_EQ(seen, (std::set<uint64_t>{1, 2, 3, 4, 5, 6}));  // every bundle was used by some token
  EXPECT_GT(spanning, 0);
  // each token was computed with the weights its tag names, whole: its logprob is the training
  // forward's under that version (recompute: its whole context too); a step that mixed bundles, or
  // ran bundle k's weights tagged k+1, fails here (the checks above see only the tags)
  size_t checked = 0;
  for (const auto& r : res)
    for (uint64_t v : std::set<uint64_t>(r.weight_version.begin(), r.weight_version.end())) {
      const auto lp = learner_logprobs(vers[v - 1], ec.policy.training(), {r}, {1.0f, 0, 1.0f});  // requests(12, 1.0f)
      for (size_t i = 0; i < r.tokens.size(); ++i)
        if (r.weight_version[i] == v) {
          EXPECT_EQ(std::memcmp(&r.logprobs[i], &lp[0][i], 4), 0) << "request " << r.id << " token " << i << " v" << v;
          ++checked;
        }
    }
  EXPECT_EQ(checked, 12u * 20u);
}

TEST(Generate, RefusedBundlesKeepTheOldWeights) {
  const model_params p = model_params_init(cfg(), 9);
  auto be = make_cpu_backend();
  engine_config ec = ecfg("fp8", 2);
  generation_engine e(*be, p.cfg, ec);
  ASSERT_EQ(e.adopt_params(p, 3, 3), "");
  e.submit(requests(1, 1.0f)[0]);
  e.step();
  auto good = bundle_from_params(p, ec.policy, 4, 4, nullptr);
  auto missing = good;
  missing.snapshot.weight_scales.erase("model.layers.0.mlp.up_proj.weight");
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(missing)).find("model.layers.0.mlp.up_proj.weight"),
            std::string::npos);
  auto zero = good;
  zero.snapshot.weight_scales.begin()->second[0] = 0.0f;
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(zero)), "");
  {  // every block's scale is checked (the last row and column blocks too), infinite ones, one too
     // many; an FP8 NaN code; a snapshot made for other weights -- each named
    auto why = [&](const std::function<void(fp8rl::quant::weight_bundle&)>& edit) {
      auto b = good;
      edit(b);
      return e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(b));
    };
    // 2 x 2 and 1 x 2 blocks; scales row-major, rows padded to 4 (qtensor::scale_ld): (rb, kb) at 4 rb + kb
    const std::string up = "model.layers.0.mlp.up_proj.weight", k = "model.layers.1.self_attn.k_proj.weight";
    ASSERT_EQ(good.snapshot.weight_scales.count(up), 1u) << "the policy keeps " << up << " out of FP8";
    ASSERT_EQ(good.snapshot.weight_scales.count(k), 1u) << "the policy keeps " << k << " out of FP8";
    ASSERT_GE(good.snapshot.weight_scales.at(up).size(), 6u);
    EXPECT_NE(why([&](auto& b) { b.snapshot.weight_scales[up][5] = 0.0f; }).find("'" + up + "' block (1, 1) scale"), std::string::npos);
    EXPECT_NE(why([&](auto& b) { b.snapshot.weight_scales[k][1] = 0.0f; }).find("'" + k + "' block (0, 1) scale"), std::string::npos);
    EXPECT_NE(why([&](auto& b) { b.snapshot.weight_scales[up][0] = INFINITY; }).find("'" + up + "' block (0, 0) scale"), std::string::npos);
    EXPECT_NE(why([&](auto& b) { b.snapshot.weight_scales[up].push_back(1.0f); }).find("'" + up + "' has 9 block scales, needs 8"),
              std::string::npos);
    EXPECT_NE(why([&](auto& b) {
                for (auto& t : b.tensors)
                  if (t.name == up) t.bytes[7] = 0x7f;
              }).find("'" + up + "' holds a NaN code"),
              std::string::npos);
    EXPECT_NE(why([&](auto& b) { b.snapshot.weight_version = 3; }).find("snapshot weight_version differs"), std::string::npos);
    EXPECT_NE(why([&](auto& b) {  // the other NaN code (sign set)
                for (auto& t : b.tensors)
                  if (t.name == up) t.bytes[2] = 0xff;
              }).find("'" + up + "' holds a NaN code"),
              std::string::npos);
    EXPECT_NE(why([&](auto& b) {  // a 1-D FP8 tensor of the right size: its columns were read past the shape
                for (auto& t : b.tensors)
                  if (t.name == up) t.shape = {t.shape[0] * t.shape[1]};
              }).find("FP8 tensor '" + up + "' is not a matrix"),
              std::string::npos);
    EXPECT_NE(why([&](auto& b) {  // a product that wraps to 0 elements (0 bytes "fit")
                for (auto& t : b.tensors)
                  if (t.name == up) t.shape = {int64_t{1} << 22, int64_t{1} << 21, int64_t{1} << 21}, t.bytes.clear();
              }).find("'" + up + "' has a shape beyond any tensor"),
              std::string::npos);
    // a BF16 tensor (the policy's) declared F32 with bytes to match: refused, not read as F32
    const auto bf16 = std::find_if(good.tensors.begin(), good.tensors.end(),
                                   [](const auto& t) { return t.dtype == fp8rl::quant::bundle_dtype::bf16; });
    ASSERT_NE(bf16, good.tensors.end());
    const std::string bf16_name = bf16->name;
    EXPECT_NE(why([&](auto& b) {
                for (auto& t : b.tensors)
                  if (t.name == bf16_name) t.dtype = fp8rl::quant::bundle_dtype::f32, t.bytes.resize(t.bytes.size() * 2);
              }).find("tensor '" + bf16_name + "' is f32, the precision policy needs bf16"),
              std::string::npos);
  }
  auto other = bundle_from_params(p, precision_policy::named("bf16"), 4, 4, nullptr);
  const std::string other_why = e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(other));
  EXPECT_NE(other_why.find("made for precision policy '" + precision_policy::named("bf16").fingerprint() + "', this engine runs '" +
                           ec.policy.fingerprint() + "'"),
            std::string::npos)
      << other_why;
  {  // a policy that differs in no tensor's dtype (FP8 attention alone) is another policy all the same
    precision_policy attn = ec.policy;
    attn.fp8_attention = !attn.fp8_attention;
    ASSERT_NE(attn.fingerprint(), ec.policy.fingerprint());
    auto same_dtypes = good;
    same_dtypes.snapshot.policy = attn.fingerprint();
    EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(same_dtypes)).find("made for precision policy"), std::string::npos);
  }
  auto shape = good;
  shape.tensors[1].shape = {3};
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(shape)), "");
  {  // a transposed matrix (the bytes fit): both shapes named (it said "the wrong shape")
    auto transposed = good;
    auto t = std::find_if(transposed.tensors.begin(), transposed.tensors.end(),
                          [](const auto& x) { return x.shape.size() == 2 && x.shape[0] != x.shape[1]; });
    ASSERT_NE(t, transposed.tensors.end());
    const auto want = t->shape;
    std::swap(t->shape[0], t->shape[1]);
    const std::string why = e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(transposed));
    EXPECT_NE(why.find("'" + t->name + "' has shape [" + std::to_string(want[1]) + ", " + std::to_string(want[0]) +
                       "], the model's is [" + std::to_string(want[0]) + ", " + std::to_string(want[1]) + "]"),
              std::string::npos)
        << why;
  }
  shape.tensors[1].shape = {int64_t{1} << 39, int64_t{1} << 39};  // its element count wrapped to 0
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(shape)).find("has a shape beyond any tensor"), std::string::npos);
  auto older = bundle_from_params(p, ec.policy, 2, 2, nullptr);
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(older)).find("older"), std::string::npos);
  int non_fp8 = 0;
  for (auto& t : good.tensors)  // a NaN in a BF16/F32 tensor (a norm, the lm_head) is refused too
    if (t.dtype != fp8rl::quant::bundle_dtype::fp8) {
      ++non_fp8;
      auto nan = good;
      auto& u = *std::find_if(nan.tensors.begin(), nan.tensors.end(), [&](const auto& x) { return x.name == t.name; });
      const size_t es = u.dtype == fp8rl::quant::bundle_dtype::f32 ? 4 : 2;
      u.bytes[3 * es - 1] = 0x7f, u.bytes[3 * es - 2] = 0xc0;  // element 2: a quiet NaN's top bytes
      const std::string why = e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(nan));
      EXPECT_NE(why.find("'" + t.name + "' element 2 is not finite"), std::string::npos) << why;
    }
  EXPECT_GE(non_fp8, 3);  // embedding, norms, lm_head
  auto twice = good;  // a tensor twice (the later copy won) or one the model has no place for
  twice.tensors.push_back(twice.tensors[0]);
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(twice)).find("'" + good.tensors[0].name + "' twice"),
            std::string::npos);
  auto extra = good;
  extra.tensors.push_back(extra.tensors[0]);
  extra.tensors.back().name = "model.layers.9.extra";
  EXPECT_NE(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(extra)).find("'model.layers.9.extra', which"),
            std::string::npos);
  auto res = e.run_to_completion();
  for (uint64_t v : res[0].weight_version) EXPECT_EQ(v, 3u);
}

// Versions only move forward, measured against the newest weights the engine holds: a bundle
// still pending for the next step counts, so an older one arriving after it is refused (it would
// otherwise replace it, and the weights would go back to a version its caller did not ask for);
// a lower scale version of the same weights is older too.
TEST(Generate, AnOlderBundleNeverReplacesAPendingNewerOne) {
  const model_params p = model_params_init(cfg(), 9);
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp8", 2));
  ASSERT_EQ(e.adopt_params(p, 3, 3), "");
  e.submit(requests(1, 1.0f)[0]);
  e.step();
  EXPECT_EQ(e.weight_version(), 3u);
  ASSERT_EQ(e.adopt_params(p, 5, 5), "");  // pending until the next step
  const std::string why = e.adopt_params(p, 4, 4);
  EXPECT_NE(why.find("older than the pending v5"), std::string::npos) << why;
  EXPECT_NE(e.adopt_params(p, 5, 4).find("older"), std::string::npos);
  EXPECT_EQ(e.weight_version(), 3u);  // pending weights are not the adopted ones yet
  e.step();
  EXPECT_EQ(e.weight_version(), 5u);
  EXPECT_NE(e.adopt_params(p, 4, 9).find("older than the adopted v5"), std::string::npos);
  EXPECT_EQ(e.adopt_params(p, 5, 6), "");  // the same weights with newer scales
  e.step();
  // newer weights with older scales: K/V written under scale version 5 would sit beside 6's while
  // the tokens' oldest-scale records said 6 (it compared the pair, and took (7, 5) > (5, 6))
  const std::string back = e.adopt_params(p, 7, 5);
  EXPECT_NE(back.find("bundle v7/scales v5 is older than the adopted v5/scales v6"), std::string::npos) << back;
  EXPECT_EQ(e.adopt_params(p, 7, 6), "");
}

// Params of another model are refused, naming the field (they were read at the engine's sizes:
// out of bounds for a smaller model, garbage tokens accepted with "").
TEST(Generate, AnotherModelsParamsAreRefused) {
  const model_params p = model_params_init(cfg(), 9);
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp8", 2));
  ASSERT_EQ(e.adopt_params(p, 1, 1), "");
  model_config small = cfg();
  small.vocab_size = 40;
  EXPECT_EQ(e.adopt_params(model_params_init(small, 9), 2, 2), "params of another model: vocab_size 40, expected 61");
  model_config narrow = cfg();
  narrow.intermediate_size = 128;
  EXPECT_EQ(e.adopt_params(model_params_init(narrow, 9), 2, 2), "params of another model: intermediate_size 128, expected 256");
  model_config theta = cfg();
  theta.rope_theta = 500000;  // the same layout, other math
  EXPECT_EQ(e.adopt_params(model_params_init(theta, 9), 2, 2), "params of another model: rope_theta 500000, expected 10000");
  e.submit(requests(1, 1.0f)[0]);
  const auto res = e.run_to_completion();
  for (uint64_t v : res[0].weight_version) EXPECT_EQ(v, 1u);  // the old weights kept
}

// An FP8 KV-cache engine refuses attention/KV scales that do not fit its model -- absent, for
// fewer layers or heads, of the wrong length, not positive -- before anything changes: it keeps
// generating under the weights and scales it had.
TEST(Generate, RefusedKvScalesKeepTheOldWeights) {
  const model_params p = model_params_init(cfg(), 9);
  auto be = make_cpu_backend();
  const engine_config kv = ecfg("fp8-kv", 2);
  const int64_t L = p.cfg.num_hidden_layers, H = p.cfg.num_attention_heads, KV = p.cfg.num_key_value_heads;
  const attn_fp8_scales sc{std::vector<float>(L * H, 0.02f), std::vector<float>(L * KV, 0.03f), std::vector<float>(L * KV, 0.02f)};
  generation_engine ek(*be, p.cfg, kv);
  ASSERT_EQ(ek.adopt_params(p, 3, 3, &sc), "");
  ek.submit(requests(1, 1.0f)[0]);
  ek.step();
  auto refused = [&](const fp8rl::quant::weight_bundle& b) { return ek.adopt(std::make_shared<fp8rl::quant::weight_bundle>(b)); };
  EXPECT_NE(refused(bundle_from_params(p, kv.policy, 4, 4, nullptr)).find("scales"), std::string::npos);
  const auto good = bundle_from_params(p, kv.policy, 4, 4, &sc);
  auto one_layer = good;  // self-consistent scales of a 1-layer model
  one_layer.snapshot.layers = 1;
  one_layer.snapshot.q_scale.resize(H);
  one_layer.snapshot.k_scale.resize(KV);
  one_layer.snapshot.v_scale.resize(KV);
  EXPECT_NE(refused(one_layer).find("1 layers"), std::string::npos);
  auto heads = good;  // the same number of values, read as 8 heads / 1 KV head
  heads.snapshot.heads = 8;
  heads.snapshot.kv_heads = 1;
  heads.snapshot.q_scale.resize(L * 8, 0.02f);
  heads.snapshot.k_scale.resize(L, 0.03f);
  heads.snapshot.v_scale.resize(L, 0.02f);
  EXPECT_NE(refused(heads).find("8 heads"), std::string::npos);
  auto zero_q = good;  // a zero scale: every value saturated
  zero_q.snapshot.q_scale[0] = 0.0f;
  EXPECT_NE(refused(zero_q).find("Q scale of layer 0 head 0 is missing or invalid"), std::string::npos) << refused(zero_q);
  auto short_v = good;  // which list and its size (it said "missing or have the wrong size")
  short_v.snapshot.v_scale.pop_back();
  const std::string why_v = refused(short_v);
  EXPECT_NE(why_v.find("V scales: " + std::to_string(L * KV - 1) + ", expected " + std::to_string(L) + " layers x " +
                       std::to_string(KV) + " heads"), std::string::npos) << why_v;
  auto negative = good;
  negative.snapshot.v_scale[1] = -0.02f;
  EXPECT_NE(refused(negative).find("V scale of layer 0 head 1"), std::string::npos);
  attn_fp8_scales short_k = sc;
  short_k.k.pop_back();
  EXPECT_NE(ek.adopt_params(p, 5, 5, &short_k).find("entries"), std::string::npos);
  attn_fp8_scales nan_q = sc;
  nan_q.q[3] = std::nanf("");
  EXPECT_NE(ek.adopt_params(p, 5, 5, &nan_q).find("Q[3]"), std::string::npos);
  attn_fp8_scales zero_k = sc;  // x / 0 saturates every element, and reads back as 0
  zero_k.k[1] = 0.0f;
  EXPECT_NE(ek.adopt_params(p, 5, 5, &zero_k).find("K[1] is not a positive finite number"), std::string::npos);
  const auto res = ek.run_to_completion();  // no refusal broke the engine
  ASSERT_EQ(res.size(), 1u);
  for (size_t i = 0; i < res[0].tokens.size(); ++i) {
    EXPECT_EQ(res[0].weight_version[i], 3u) << i;
    EXPECT_EQ(res[0].scale_version[i], 3u) << i;
  }
}

// New weights and new K/V scales adopted mid-generation by an FP8 KV-cache engine, greedily:
// with `recompute` every token after the adoption is what a fresh engine holding only the new
// bundle generates from the same context (the cache re-prefilled under the new scales); with
// `keep` the tokens carry the new versions while their context keeps the old cache entries.
TEST(Generate, Fp8KvScalesAdoptedMidGeneration) {
  const model_params p1 = model_params_init(cfg(), 6), p2 = model_params_init(cfg(), 7);
  auto be = make_cpu_backend();
  const int64_t L = p1.cfg.num_hidden_layers, H = p1.cfg.num_attention_heads, KV = p1.cfg.num_key_value_heads;
  const attn_fp8_scales s1{std::vector<float>(L * H, 0.02f), std::vector<float>(L * KV, 0.03f), std::vector<float>(L * KV, 0.02f)};
  const attn_fp8_scales s2{std::vector<float>(L * H, 0.015f), std::vector<float>(L * KV, 0.05f), std::vector<float>(L * KV, 0.01f)};
  const int before = 4;
  for (kv_adopt_policy pol : {kv_adopt_policy::recompute, kv_adopt_policy::keep}) {
    engine_config ec = ecfg("fp8-kv", 2);
    ec.on_adopt = pol;
    generation_engine e(*be, p1.cfg, ec);
    ASSERT_EQ(e.adopt_params(p1, 1, 1, &s1), "");
    auto r = requests(1, 0.0f)[0];
    r.max_tokens = 10;
    e.submit(r);
    for (int i = 0; i < before; ++i) e.step();
    ASSERT_EQ(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(bundle_from_params(p2, ec.policy, 2, 7, &s2))), "");
    const auto res = e.run_to_completion();
    ASSERT_EQ(res.size(), 1u);
    const auto& t = res[0];
    ASSERT_EQ(t.tokens.size(), 10u);
    for (size_t i = 0; i < t.tokens.size(); ++i) {
      EXPECT_EQ(t.weight_version[i], i < before ? 1u : 2u) << i;
      EXPECT_EQ(t.scale_version[i], i < before ? 1u : 7u) << i;
      EXPECT_EQ(t.oldest_kv_version[i], i < before || pol == kv_adopt_policy::keep ? 1u : 2u) << i;
      EXPECT_EQ(t.oldest_kv_scale_version[i], i < before || pol == kv_adopt_policy::keep ? 1u : 7u) << i;
    }
    if (pol != kv_adopt_policy::recompute) continue;
    generation_engine fresh(*be, p2.cfg, ec);
    ASSERT_EQ(fresh.adopt_params(p2, 2, 7, &s2), "");
    auto r2 = r;
    r2.prompt.insert(r2.prompt.end(), t.tokens.begin(), t.tokens.begin() + before);
    r2.max_tokens = 10 - before;
    fresh.submit(r2);
    const auto want = fresh.run_to_completion();
    ASSERT_EQ(want.size(), 1u);
    EXPECT_EQ(want[0].tokens, std::vector<int32_t>(t.tokens.begin() + before, t.tokens.end()));
    EXPECT_TRUE(same(want[0].logprobs, std::vector<float>(t.logprobs.begin() + before, t.logprobs.end())));
  }
}

// rl-algorithm.md §5: per head, the amax samples of the calibration forwards sorted, sample
// round(p * (n - 1)) taken, times margin / 448; a non-finite amax is refused naming layer and
// head (std::max skipped NaN: a diverged head got a valid-looking scale).
TEST(Generate, CalibrationTakesThePercentileSampleAndRefusesNonFinite) {
  model_params p = model_params_init(cfg(), 10);
  auto be = make_cpu_backend();
  model_runner run(*be);
  auto w = model_weights_build(*be, p.cfg, precision_policy::named("fp32"), {&p, nullptr, nullptr}, false);
  std::vector<token_batch> batches(3);
  std::vector<qkv_stats> st(3);
  const auto reqs = requests(6, 1.0f);
  for (size_t i = 0; i < 3; ++i) {
    for (size_t r = 2 * i; r < 2 * i + 2; ++r) batches[i].add(reqs[r].prompt);
    run.forward(*w, batches[i], false, nullptr, &st[i]);
  }
  for (const double pct : {0.999, 0.5, 0.0}) {
    const size_t pick = static_cast<size_t>(std::llround(pct * 2.0));  // of 3 sorted samples
    const attn_fp8_scales sc = calibrate_attention(run, *w, batches, pct, 1.05f);
    const std::pair<const std::vector<float>*, std::vector<float> qkv_stats::*> parts[] = {
        {&sc.q, &qkv_stats::q}, {&sc.k, &qkv_stats::k}, {&sc.v, &qkv_stats::v}};
    for (const auto& [got, amax] : parts) {  // Q, K and V: a swapped or wrong percentile fails
      ASSERT_EQ(got->size(), (st[0].*amax).size());
      for (size_t h = 0; h < got->size(); ++h) {
        std::vector<float> v = {(st[0].*amax)[h], (st[1].*amax)[h], (st[2].*amax)[h]};
        std::sort(v.begin(), v.end());
        EXPECT_EQ((*got)[h], v[pick] * 1.05f / 448.0f) << "head " << h << " of part " << (amax == &qkv_stats::q ? "Q" : amax == &qkv_stats::k ? "K" : "V") << " p " << pct;
      }
    }
  }
  {  // a head whose keys are all zero (its k_proj rows zero) gets the floor's scale, not 0, and
     // the bundle holding it is adopted (a zero scale is refused)
    model_params z = p;
    const int64_t D = z.cfg.head_dim, C = z.cfg.hidden_size;
    float* wk = z.get("model.layers.0.self_attn.k_proj.weight");  // [KV*D, C]: KV head 1's rows D..2D
    std::fill(wk + D * C, wk + 2 * D * C, 0.0f);
    auto wz = model_weights_build(*be, z.cfg, precision_policy::named("fp32"), {&z, nullptr, nullptr}, false);
    const attn_fp8_scales sc = calibrate_attention(run, *wz, batches, 0.999, 1.05f);
    EXPECT_EQ(sc.k[1], 1e-6f * 1.05f / 448.0f);
    EXPECT_GT(sc.k[0], sc.k[1]);
    generation_engine e(*be, z.cfg, ecfg("fp8-kv", 1));
    EXPECT_EQ(e.adopt(std::make_shared<fp8rl::quant::weight_bundle>(bundle_from_params(z, e.config().policy, 1, 1, &sc))), "");
  }
  std::fill(p.data.begin(), p.data.end(), std::nanf(""));
  auto bad = model_weights_build(*be, p.cfg, precision_policy::named("fp32"), {&p, nullptr, nullptr}, false);
  try {
    calibrate_attention(run, *bad, batches, 0.999, 1.05f);
    ADD_FAILURE() << "calibrated on NaN activations";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0, Q head 0: amax is nan"), std::string::npos) << e.what();
  }
}

// An FP8 KV cache under plain (BF16-operand) attention -- `fp8rl generate --kv fp8` without
// `--attention fp8` -- still needs K/V scales: make_bundle calibrates whenever the cache is FP8,
// and an engine on that policy adopts the bundle and generates.
TEST(Generate, MakeBundleScalesAnFp8KvCacheWithoutFp8Attention) {
  rl_state st;
  st.params = model_params_init(cfg(), 12);
  st.version = 3;
  rl_run_config rc;
  rc.gen_policy = precision_policy::named("fp8");
  rc.gen_policy.kv = kv_dtype::fp8;
  ASSERT_FALSE(rc.gen_policy.fp8_attention);
  std::vector<token_batch> calib(1);
  for (const auto& r : requests(2, 1.0f)) calib[0].add(r.prompt);
  const auto bundle = make_bundle(st, rc, calib, 3);
  const int64_t L = st.params.cfg.num_hidden_layers, KV = st.params.cfg.num_key_value_heads;
  ASSERT_EQ(bundle->snapshot.k_scale.size(), static_cast<size_t>(L * KV));
  ASSERT_EQ(bundle->snapshot.v_scale.size(), static_cast<size_t>(L * KV));
  for (size_t i = 0; i < bundle->snapshot.k_scale.size(); ++i) {
    EXPECT_GT(bundle->snapshot.k_scale[i], 0.0f) << i;
    EXPECT_GT(bundle->snapshot.v_scale[i], 0.0f) << i;
  }
  auto be = make_cpu_backend();
  engine_config ec = ecfg("fp8", 1);
  ec.policy = rc.gen_policy;
  generation_engine e(*be, st.params.cfg, ec);
  auto bad = std::make_shared<fp8rl::quant::weight_bundle>(*bundle);  // its K/V scales are checked too
  bad->snapshot.k_scale[0] = 0.0f;
  EXPECT_NE(e.adopt(bad).find("K scale of layer 0 head 0 is missing or invalid"), std::string::npos);
  ASSERT_EQ(e.adopt(bundle), "");
  e.submit(requests(1, 1.0f)[0]);
  EXPECT_EQ(e.run_to_completion().size(), 1u);
}

// The largest sample (percentile 1) over passes that split the prompts is the amax of one pass
// over them all, bit for bit, in every precision: `fp8rl generate --kv fp8` calibrates in bounded
// passes on that ground (a token's activations do not depend on its batch).
TEST(Generate, CalibrationPassesGiveTheOnePassAmax) {
  const model_params p = model_params_init(cfg(), 11);
  auto be = make_cpu_backend();
  model_runner run(*be);
  const auto reqs = requests(5, 1.0f);
  for (const char* pol : {"fp32", "bf16", "fp8"}) {
    auto w = model_weights_build(*be, p.cfg, precision_policy::named(pol), {&p, nullptr, nullptr}, false);
    std::vector<token_batch> one(1), passes(3);
    for (size_t r = 0; r < reqs.size(); ++r) {
      one[0].add(reqs[r].prompt);
      passes[r * 3 / reqs.size()].add(reqs[r].prompt);
    }
    const attn_fp8_scales a = calibrate_attention(run, *w, one, 1.0, 1.05f);
    const attn_fp8_scales b = calibrate_attention(run, *w, passes, 1.0, 1.05f);
    EXPECT_TRUE(same(a.q, b.q) && same(a.k, b.k) && same(a.v, b.v)) << pol;
  }
}

// FP8 KV cache + FP8 attention vs the BF16 learner: the mismatch is measured, not asserted away.
TEST(Generate, Fp8KvCacheMismatchIsMeasured) {
  const model_params p = model_params_init(cfg(), 10);
  auto be = make_cpu_backend();
  const attn_fp8_scales sc = calibrated_scales(p, requests(6, 1.0f));  // amax * 1.05 / 448 on the prompts
  // token_mult_prob_error (rl-algorithm.md §6) of the engine vs the learner (BF16 attention, no
  // cache): the FP8 KV cache alone (BF16 attention over the widened codes), then with FP8
  // attention too (the fp8-kv policy) -- each reported, not asserted away
  auto tmpe_of = [&](bool fp8_attention) {
    engine_config ec = ecfg("fp8-kv", 3);
    ec.policy.fp8_attention = fp8_attention;
    generation_engine e(*be, p.cfg, ec);
    EXPECT_EQ(e.adopt_params(p, 1, 1, &sc), "");
    for (auto& r : requests(6, 1.0f)) e.submit(r);
    auto res = e.run_to_completion();
    const learner_view lv = learner_forward(p, e.config().policy.training(), res, {});
    const auto& lp = lv.logprobs;
    double n = 0, err = 0, zz = 0, zn = 0;
    for (size_t i = 0; i < res.size(); ++i)
      for (size_t t = 0; t < res[i].logprobs.size(); ++t) {
        err += std::exp(std::fabs(res[i].logprobs[t] - lp[i][t]));
        n += 1;
        const auto& z = lv.logits[i][t];  // centred: log-softmax ignores a row's shift
        const double mean = std::accumulate(z.begin(), z.end(), 0.0) / double(z.size());
        for (float v : z) zz += (v - mean) * (v - mean);
        zn += double(z.size());
      }
    std::printf("fp8 KV cache%s vs bf16 learner: token_mult_prob_error = %.5f over %.0f tokens (logit RMS %.3f)\n",
                fp8_attention ? " + FP8 attention" : " (BF16 attention)", err / n, n, std::sqrt(zz / zn));
    return std::pair{err / n, std::sqrt(zz / zn)};
  };
  const auto [kv_only, logit_rms] = tmpe_of(false);
  const double kv_attn = tmpe_of(true).first;
  RecordProperty("token_mult_prob_error_fp8_kv_cache", std::to_string(kv_only));
  RecordProperty("token_mult_prob_error_fp8_kv_attention", std::to_string(kv_attn));
  // and bounded: FP8 K/V (and queries) move the logits by at most kFp8AttentionVsBf16 of their RMS
  // (attention's error, which the residual stream only dilutes), and a logprob moves by its token's
  // logit error less the softmax-weighted mean of the row's: |dlogp| <= 2 x that, so
  // log(token_mult_prob_error) = log mean exp|dlogp| <= 2 kFp8AttentionVsBf16 logit_rms
  for (double tmpe : {kv_only, kv_attn}) {
    EXPECT_TRUE(std::isfinite(tmpe));
    EXPECT_GT(tmpe, 1.0);  // FP8 K/V differ from BF16: the error is real, and reported
    EXPECT_LE(std::log(tmpe), 2 * fp8rl::tol::kFp8AttentionVsBf16 * logit_rms);
  }
  EXPECT_NE(kv_only, kv_attn);  // two paths: FP8 queries change the scores again
}

namespace {
// A scale s and a value x with x / s exactly `at` in FP32 and x * (1 / s) above it: where
// dividing by the scale (fp8-numerics.md §4) and multiplying by its reciprocal part.
std::pair<float, float> division_matters(float at) {
  for (int i = 0; i < 4000; ++i) {
    const float s = 0.01f + 0.000137f * float(i);
    float x = std::nextafter(at * s, 0.0f);
    for (int u = 0; u < 4; ++u, x = std::nextafter(x, INFINITY))
      if (x / s == at && x * (1.0f / s) > at) return {s, x};
  }
  return {0.0f, 0.0f};
}
}  // namespace

// The FP8 K/V cache and FP8 attention divide by the scale (fp8-numerics.md §4), as the
// calibrated formats are defined: a value whose quotient is exactly 464 is no saturation (K and
// V), one whose quotient is exactly 1.0625 (an E4M3 tie) is stored as 1.0 -- read back through
// attention over that one key (P = 1) and through the training forward's FP8 rounding of V.
// Multiplying by the reciprocal lands above both (465-ish saturates, 1.125 is stored).
TEST(Generate, Fp8KvAndAttentionDivideByTheScale) {
  const auto [s_sat, x_sat] = division_matters(464.0f);
  const auto [s_tie, x_tie] = division_matters(1.0625f);
  ASSERT_GT(s_sat, 0.0f) << "no value found where division and the reciprocal differ at 464";
  ASSERT_GT(s_tie, 0.0f) << "no value found where division and the reciprocal differ at 1.0625";
  auto be = make_cpu_backend();
  const int64_t D = 32;
  const int32_t slot = 0, pos = 0;
  auto cache = be->kv_cache_create(1, 1, 1, D, 4, kv_dtype::fp8);
  std::vector<float> a(static_cast<size_t>(D), 0.5f), b = a;
  a[3] = x_sat;
  EXPECT_EQ(be->kv_cache_write(*cache, 0, {1, &slot, &pos}, a.data(), b.data(), &s_sat, &s_sat), 0) << "K";
  EXPECT_EQ(be->kv_cache_write(*cache, 0, {1, &slot, &pos}, b.data(), a.data(), &s_sat, &s_sat), 0) << "V";
  const std::vector<float> v(static_cast<size_t>(D), x_tie), q = fp8rl::test::randn(D, 5);
  EXPECT_EQ(be->kv_cache_write(*cache, 0, {1, &slot, &pos}, b.data(), v.data(), &s_tie, &s_tie), 0);
  std::vector<float> out(static_cast<size_t>(D));
  be->attention_cached(*cache, 0, {1, &slot, &pos}, q.data(), 1, precision::bf16, nullptr, out.data());
  const float want = fp8rl::quant::e4m3_to_float(fp8rl::quant::e4m3_from_float(1.0625f)) * s_tie;  // 1.0 * s
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[d], want) << "cached attention, V[" << d << "]";
  const int32_t seq_start[2] = {0, 1};
  attn_params p;
  p.T = 1; p.H = 1; p.KV = 1; p.D = D; p.seq_start = seq_start; p.S = 1; p.operand = precision::bf16;
  const float qs = 0.01f;
  p.q_scale = &qs, p.k_scale = &s_tie, p.v_scale = &s_tie;
  float lse = 0.0f;
  be->attention_forward(p, q.data(), b.data(), v.data(), out.data(), &lse);
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[d], want) << "training forward, V[" << d << "]";
}

// fp8-numerics §0.2: NaN/Inf reaching the FP8 K/V cache is an error naming layer, head and
// position (the encoder stored NaN as code 0x7F and Inf as 448 * scale, counted as saturation);
// FP8 queries the same, naming the head.
TEST(Generate, NonFiniteKvAndFp8QueriesAreRefused) {
  auto be = make_cpu_backend();
  const int64_t KV = 2, D = 64;
  auto cache = be->kv_cache_create(1, 2, KV, D, 8, kv_dtype::fp8);
  const std::vector<float> scale(static_cast<size_t>(KV), 1.0f / 64);
  const int32_t slot = 0, pos = 3;
  for (const float bad : {std::nanf(""), INFINITY}) {
    std::vector<float> k(static_cast<size_t>(KV * D), 0.5f), v(k);
    v[static_cast<size_t>(D + 5)] = bad;  // KV head 1, V[5]
    try {
      be->kv_cache_write(*cache, 1, {1, &slot, &pos}, k.data(), v.data(), scale.data(), scale.data());
      ADD_FAILURE() << "accepted " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("layer 1, KV head 1, slot 0, position 3: V[5]"), std::string::npos) << e.what();
    }
  }
  std::vector<float> k(static_cast<size_t>(KV * D), 0.5f);
  EXPECT_EQ(be->kv_cache_write(*cache, 1, {1, &slot, &pos}, k.data(), k.data(), scale.data(), scale.data()), 0);
  // saturation counts what it clipped: 448 < |x / scale| <= 464 rounds to 448 in any mode
  k[7] = 460.0f / 64, k[8] = -464.0f / 64;
  EXPECT_EQ(be->kv_cache_write(*cache, 1, {1, &slot, &pos}, k.data(), k.data(), scale.data(), scale.data()), 0);
  k[9] = 470.0f / 64;
  EXPECT_EQ(be->kv_cache_write(*cache, 1, {1, &slot, &pos}, k.data(), k.data(), scale.data(), scale.data()), 2);  // as K and as V
  k[10] = -470.0f / 64;  // below -448 too
  EXPECT_EQ(be->kv_cache_write(*cache, 1, {1, &slot, &pos}, k.data(), k.data(), scale.data(), scale.data()), 4);
  k[7] = k[8] = k[9] = k[10] = 0.5f;
  // a slot or position outside the cache (max_ctx 8, 1 slot) is refused, not written into the
  // next head's block
  for (const auto& [s, q] : std::vector<std::pair<int32_t, int32_t>>{{0, 8}, {1, 0}, {0, -1}})
    EXPECT_THROW(be->kv_cache_write(*cache, 1, {1, &s, &q}, k.data(), k.data(), scale.data(), scale.data()), std::out_of_range)
        << s << " " << q;
  // FP8 queries likewise (fp8-numerics.md §0.2: never encoded): +Inf was saturated to 448 * scale
  const int64_t H = 4;
  const std::vector<float> q_scale = {0.05f, 0.05f, 0.05f, 0.1f};  // [H]: head 3's own
  std::vector<float> out(static_cast<size_t>(H * D));
  const int32_t slots2[] = {0, 0}, pos2[] = {3, 4};
  std::vector<float> out2(static_cast<size_t>(2 * H * D));
  for (const float bad : {std::nanf(""), INFINITY}) {
    std::vector<float> q(static_cast<size_t>(2 * H * D), 0.25f);
    q[static_cast<size_t>((H + 2) * D + 7)] = bad;  // the second token (position 4), head 2, Q[7]
    try {
      be->attention_cached(*cache, 1, {2, slots2, pos2}, q.data(), H, precision::fp8, q_scale.data(), out2.data());
      ADD_FAILURE() << "accepted " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("layer 1, head 2, slot 0, position 4: Q[7]"), std::string::npos) << e.what();
    }
  }
  std::vector<float> q(static_cast<size_t>(H * D), 0.25f);
  EXPECT_EQ(be->attention_cached(*cache, 1, {1, &slot, &pos}, q.data(), H, precision::fp8, q_scale.data(), out.data()), 0);
  for (float o : out) EXPECT_TRUE(std::isfinite(o));
  // clipped queries are counted as K/V are, each by its head's scale: 460 rounds to 448 anyway,
  // -470 and 20000 are clipped, 30 / 0.05 would be (600) but head 3's scale is 0.1 (300); queries
  // of BF16 attention are not encoded
  q[static_cast<size_t>(3 * D + 1)] = 460.0f * 0.1f, q[static_cast<size_t>(3 * D + 2)] = -470.0f * 0.1f;
  q[static_cast<size_t>(3 * D + 3)] = 30.0f;
  q[static_cast<size_t>(5)] = 1000.0f;
  EXPECT_EQ(be->attention_cached(*cache, 1, {1, &slot, &pos}, q.data(), H, precision::fp8, q_scale.data(), out.data()), 2);
  EXPECT_EQ(be->attention_cached(*cache, 1, {1, &slot, &pos}, q.data(), H, precision::bf16, nullptr, out.data()), 0);
  // in the engine the error says whose slot it is (a slot alone named no request): layer 0's K
  // overflows (its input norm scaled by 1e38)
  model_params p = model_params_init(cfg(), 9);
  float* n0 = p.get("model.layers.0.input_layernorm.weight");
  for (int64_t c = 0; c < p.cfg.hidden_size; ++c) n0[c] *= 1e38f;
  const int64_t L = p.cfg.num_hidden_layers, Hm = p.cfg.num_attention_heads, KVm = p.cfg.num_key_value_heads;
  const attn_fp8_scales sc{std::vector<float>(L * Hm, 0.02f), std::vector<float>(L * KVm, 0.03f), std::vector<float>(L * KVm, 0.02f)};
  generation_engine e(*be, p.cfg, ecfg("fp8-kv", 2));
  ASSERT_EQ(e.adopt_params(p, 1, 1, &sc), "");
  auto rq = requests(1, 1.0f)[0];
  rq.id = 77;
  e.submit(rq);
  const std::string why = fp8rl::test::thrown_text<std::runtime_error>([&] { e.step(); });
  EXPECT_NE(why.find("slot 0, position 0"), std::string::npos) << why;
  EXPECT_NE(why.find("(request 77)"), std::string::npos) << why;
}

// The decode kernel reads each KV head's keys and values once for its G query rows, widening the
// cache's elements in registers; each output row must equal cpu_attn_query on the stored values
// (decoded by the table, scaled per position) bit for bit: every dtype, G across the 8-row block,
// n across the 16-key slabs, D = 24 (not a multiple of 16), 32, 64, 128, a context not a multiple
// of 16, FP8 and BF16 operands, FP8 scales changing mid-sequence. Two tokens of two slots in one
// call (different n: per-thread scratch reused); the positions past each token's own hold stale
// large values and layer 0 other values, so a read past n or of the wrong layer changes the result.
TEST(Generate, CachedAttentionEqualsOneQueryAtATime) {
  auto be = make_cpu_backend();
  uint32_t seed = 12345;
  auto rnd = [&] { seed = seed * 1664525u + 1013904223u; return static_cast<float>(seed >> 8) / 16777216.0f - 0.5f; };
  for (kv_dtype dt : {kv_dtype::f32, kv_dtype::bf16, kv_dtype::fp8})
    for (int64_t G : {1, 3, 8, 10})
      for (int64_t D : {24, 32, 64, 128})
        for (int64_t n0 : {1, 16, 17, 40}) {
          const int64_t KV = 2, H = KV * G, M = 50, S = 2, L = 2;
          const int64_t n_of[S] = {n0, std::min<int64_t>(M, n0 + 9)};  // token t reads slot t's positions < n_of[t]
          const precision op = dt == kv_dtype::f32 ? precision::fp32 : precision::bf16;
          const bool fp8q = dt == kv_dtype::fp8;
          auto cache = be->kv_cache_create(S, L, KV, D, M, dt);
          std::vector<float> ks(static_cast<size_t>(KV)), vs(ks.size()), qs(static_cast<size_t>(H));
          for (size_t g = 0; g < ks.size(); ++g) { ks[g] = 1.5f / 448 * (1 + 0.1f * g); vs[g] = 1.0f / 448 * (1 + 0.2f * g); }
          for (size_t h = 0; h < qs.size(); ++h) qs[h] = 0.5f / 448 * (1 + 0.05f * h);
          std::vector<float> ks2(ks), vs2(vs);  // positions from n/2 on: a later snapshot (FP8: other scales)
          for (float& x : ks2) x *= 1.3f;
          for (float& x : vs2) x *= 0.7f;
          std::vector<float> k(static_cast<size_t>(S * M * KV * D)), v(k.size()), q(static_cast<size_t>(S * H * D));
          for (int64_t sl = 0; sl < S; ++sl)
            for (int64_t j = 0; j < M; ++j)
              for (int64_t i = 0; i < KV * D; ++i) {
                const size_t at = static_cast<size_t>((sl * M + j) * KV * D + i);
                const bool live = j < n_of[sl];
                k[at] = live ? 3.0f * rnd() : (i % 2 ? 40.0f : -40.0f);
                v[at] = live ? 2.0f * rnd() : (i % 3 ? 40.0f : -40.0f);
              }
          for (float& x : q) x = rnd();
          std::vector<int32_t> slot(static_cast<size_t>(M)), pos(static_cast<size_t>(M));
          for (int64_t j = 0; j < M; ++j) pos[j] = static_cast<int32_t>(j);
          std::vector<float> other(static_cast<size_t>(M * KV * D), 7.0f);
          for (int64_t sl = 0; sl < S; ++sl) {
            std::fill(slot.begin(), slot.end(), static_cast<int32_t>(sl));
            const int64_t n1 = n_of[sl] / 2;
            const float* ksl = k.data() + sl * M * KV * D;
            const float* vsl = v.data() + sl * M * KV * D;
            be->kv_cache_write(*cache, 0, {M, slot.data(), pos.data()}, other.data(), other.data(), fp8q ? ks.data() : nullptr,
                               fp8q ? vs.data() : nullptr);
            be->kv_cache_write(*cache, 1, {n1, slot.data(), pos.data()}, ksl, vsl, fp8q ? ks.data() : nullptr,
                               fp8q ? vs.data() : nullptr);
            be->kv_cache_write(*cache, 1, {M - n1, slot.data() + n1, pos.data() + n1}, ksl + n1 * KV * D,
                               vsl + n1 * KV * D, fp8q ? ks2.data() : nullptr, fp8q ? vs2.data() : nullptr);
          }
          const int32_t qslot[S] = {0, 1}, qpos[S] = {static_cast<int32_t>(n_of[0] - 1), static_cast<int32_t>(n_of[1] - 1)};
          std::vector<float> got(static_cast<size_t>(S * H * D));
          be->attention_cached(*cache, 1, {S, qslot, qpos}, q.data(), H, op, fp8q ? qs.data() : nullptr, got.data());
          // the stored values, as the cache holds them
          auto stored = [&](float x, float sc) {
            if (dt == kv_dtype::bf16) return fp8rl::quant::bf16_round(x);
            if (dt == kv_dtype::fp8) return fp8rl::quant::e4m3_to_float(fp8rl::quant::e4m3_from_float(x / sc)) * sc;
            return x;
          };
          for (int64_t t = 0; t < S; ++t) {
            const int64_t n = n_of[t], n1 = n / 2;
            std::vector<float> kt(static_cast<size_t>(D * n)), vv(static_cast<size_t>(n * D)), want(static_cast<size_t>(D)),
                scratch(static_cast<size_t>(n + D));
            for (int64_t g = 0; g < KV; ++g) {
              for (int64_t j = 0; j < n; ++j)
                for (int64_t d = 0; d < D; ++d) {
                  const size_t at = static_cast<size_t>(((t * M + j) * KV + g) * D + d);
                  kt[d * n + j] = stored(k[at], (j < n1 ? ks : ks2)[g]);
                  vv[j * D + d] = stored(v[at], (j < n1 ? vs : vs2)[g]);
                }
              for (int64_t h = g * G; h < (g + 1) * G; ++h) {
                cpu_attn_query(q.data() + (t * H + h) * D, {op, fp8q ? qs[h] : 0.0f}, kt.data(), n, vv.data(), n, D, op,
                               want.data(), scratch.data());
                for (int64_t d = 0; d < D; ++d)
                  ASSERT_EQ(std::bit_cast<uint32_t>(got[(t * H + h) * D + d]), std::bit_cast<uint32_t>(want[d]))
                      << "dtype " << int(dt) << " G " << G << " D " << D << " n " << n << " token " << t << " head " << h
                      << " d " << d;
              }
            }
          }
        }
}

// The FP8 cache's in-register widening (codes -> FP32 by exponent re-bias, subnormal codes by
// min(f, 2f - 2^-6); in slabs flagged free of subnormal codes, bits << 20 times 2^120; then times
// the position's scale; both flag states run here) gives e4m3_to_float(code) * scale for every code the cache can hold (all but
// the NaNs: +-0 and the subnormals among them), with MXCSR DAZ set on the calling thread or not.
// V: under uniform probabilities (K all zero: p = 1/16 exactly) with one nonzero V row per
// component, each output is one widened code / 16 -- every code's value, bit for bit (+-0 aside:
// the chains start from +0). K: row h scores component h % G only (FP32 operands, one-hot
// queries), so a code widened wrong at all (a subnormal flushed, a neighbour code's value) moves
// the probabilities; a last-bit error of the K-only scale product can vanish in exp and the
// division, and is left to the test above (its scales change mid-sequence). Scales are not
// powers of two (the product rounds).
TEST(Generate, Fp8CacheWidensEveryCodeExactly) {
  for (bool subnormals : {true, false}) {  // false: the slabs are flagged clean (the shorter widen)
  SCOPED_TRACE(subnormals ? "every code" : "every code but the subnormal ones");
  auto be = make_cpu_backend();
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7F) != 0x7F && (subnormals || !fp8rl::quant::e4m3_is_subnormal(static_cast<uint8_t>(c))))
      codes.push_back(static_cast<uint8_t>(c));
  const int64_t NC = static_cast<int64_t>(codes.size()), D = 64, KV = 4, G = 8, H = KV * G;
  const std::vector<float> ks = {0.37f / 448, 0.52f / 448, 1.1f / 448, 2.9f / 448}, vs = {1.9f / 448, 0.7f / 448, 0.3f / 448, 3.3f / 448};
  // code(g, j, d) of K or V -> the cache's contents and the reference's widened operands
  auto check = [&](const char* what, int64_t n, auto k_code, auto v_code, const std::vector<float>& q) {
    std::vector<float> k(static_cast<size_t>(n * KV * D)), v(k.size());
    std::vector<std::vector<float>> kt(KV, std::vector<float>(static_cast<size_t>(D * n))), vv(kt);
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) {
          const float kw = fp8rl::quant::e4m3_to_float(k_code(g, j, d)) * ks[g];
          const float vw = fp8rl::quant::e4m3_to_float(v_code(g, j, d)) * vs[g];
          k[(j * KV + g) * D + d] = kw;  // written as this value, it encodes back to the same code
          v[(j * KV + g) * D + d] = vw;
          kt[g][d * n + j] = kw;
          vv[g][j * D + d] = vw;
        }
    auto cache = be->kv_cache_create(1, 1, KV, D, n, kv_dtype::fp8);
    std::vector<int32_t> slot(static_cast<size_t>(n), 0), pos(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) pos[j] = static_cast<int32_t>(j);
    be->kv_cache_write(*cache, 0, {n, slot.data(), pos.data()}, k.data(), v.data(), ks.data(), vs.data());  // (448 s / s may exceed 448: saturates to 448)
    std::vector<float> want(static_cast<size_t>(H * D)), scratch(static_cast<size_t>(n + D));
    for (int64_t h = 0; h < H; ++h)
      cpu_attn_query(q.data() + h * D, {}, kt[h / G].data(), n, vv[h / G].data(), n, D, precision::fp32,
                     want.data() + h * D, scratch.data());
    const int32_t qslot = 0, qpos = static_cast<int32_t>(n - 1);
    for (bool daz : {false, true}) {
      std::vector<float> got(want.size());
      const unsigned csr = _mm_getcsr();
      if (daz) _mm_setcsr(csr | 0x0040u);
      unsigned after = 0;
      {  // one thread (this one) runs the heads; an arena made now captures this MXCSR for its tasks
        tbb::task_arena one(1);
        one.execute([&] {
          be->attention_cached(*cache, 0, {1, &qslot, &qpos}, q.data(), H, precision::fp32, nullptr, got.data());
          after = _mm_getcsr();
        });
      }
      _mm_setcsr(csr);
      EXPECT_EQ(after & 0x0040u, daz ? 0x0040u : 0u) << "the caller's DAZ was not restored";
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
            << what << ", DAZ " << daz << ", head " << i / D << ", d " << i % D;
    }
  };
  const auto code = [&](int64_t i) { return codes[static_cast<size_t>(i % NC)]; };
  // V: head g's component d holds code 64 g + d at position d % 16 only
  std::vector<float> q(static_cast<size_t>(H * D));
  for (float& x : q) x = 0.25f;
  check("V", 16, [](int64_t, int64_t, int64_t) { return uint8_t{0}; },
        [&](int64_t g, int64_t j, int64_t d) { return j == d % 16 ? code(64 * g + d) : uint8_t{0}; }, q);
  // K: row h of head g scores component h % G only, whose 32 positions hold codes 32 (h % G) + j
  std::fill(q.begin(), q.end(), 0.0f);
  for (int64_t h = 0; h < H; ++h) q[h * D + h % G] = 1.0f + 0.125f * (h / G);
  check("K", 32, [&](int64_t, int64_t j, int64_t d) { return d < G ? code(32 * d + j) : uint8_t{0x38}; },
        [&](int64_t g, int64_t j, int64_t d) { return code(7 * j + 3 * d + g); }, q);
  }
}

// The training forward's attention rows (attn_pv_rows: several query rows share each V row, the
// group size depends on D) equal the cached attention of each token alone, bit for bit: FP32
// operands on an FP32 cache, BF16 on a BF16 cache, FP8 attention (per-head Q/K/V scales, BF16 P)
// on an FP8 cache -- the forward rounds a head's K and V (T x D values, in chunks) with the array
// codecs, the cache encodes them at its writes; D = 24 (generic loops), 32, 64 and 128.
TEST(Generate, ForwardAttentionRowsEqualCachedAttention) {
  auto be = make_cpu_backend();
  const int64_t T = 37, H = 4, KV = 2;  // 37 rows: full row groups and tails
  const std::vector<float> qs = {0.011f, 0.013f, 0.009f, 0.012f}, ks = {0.01f, 0.012f}, vs = {0.008f, 0.01f};
  for (int64_t D : {24, 32, 64, 128})
    for (kv_dtype dt : {kv_dtype::f32, kv_dtype::bf16, kv_dtype::fp8}) {
      const precision op = dt == kv_dtype::f32 ? precision::fp32 : precision::bf16;
      const bool fp8 = dt == kv_dtype::fp8;
      const auto q = fp8rl::test::randn(T * H * D, 41), k = fp8rl::test::randn(T * KV * D, 42),
                 v = fp8rl::test::randn(T * KV * D, 43);
      const int32_t seq_start[2] = {0, static_cast<int32_t>(T)};
      attn_params p;
      p.T = T; p.H = H; p.KV = KV; p.D = D; p.seq_start = seq_start; p.S = 1; p.operand = op;
      if (fp8) p.q_scale = qs.data(), p.k_scale = ks.data(), p.v_scale = vs.data();
      std::vector<float> out(q.size()), lse(static_cast<size_t>(T * H)), got(q.size());
      be->attention_forward(p, q.data(), k.data(), v.data(), out.data(), lse.data());
      auto cache = be->kv_cache_create(1, 1, KV, D, T, dt);
      std::vector<int32_t> slot(static_cast<size_t>(T), 0), pos(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
      be->kv_cache_write(*cache, 0, {T, slot.data(), pos.data()}, k.data(), v.data(), fp8 ? ks.data() : nullptr,
                         fp8 ? vs.data() : nullptr);
      be->attention_cached(*cache, 0, {T, slot.data(), pos.data()}, q.data(), H, op, fp8 ? qs.data() : nullptr, got.data());
      for (int64_t t = 0; t < T; ++t)
        ASSERT_EQ(std::memcmp(got.data() + t * H * D, out.data() + t * H * D, static_cast<size_t>(H * D) * 4), 0)
            << "D " << D << " dtype " << int(dt) << " row " << t;
    }
}

// The op profile of engine_forward: every op of every layer is counted, the op times add up to
// at most the forward's wall time, and profiling changes no logit.
TEST(Generate, ForwardProfileCountsEveryOpAndChangesNothing) {
  const model_params p = model_params_init(cfg(), 3);
  auto be = make_cpu_backend();
  const int64_t L = p.cfg.num_hidden_layers, KV = p.cfg.num_key_value_heads, D = p.cfg.head_dim;
  const auto w = model_weights_build(*be, p.cfg, precision_policy::named("fp8"), {&p, nullptr, nullptr}, false, true);
  const std::vector<int32_t> tokens = {3, 17, 29, 5}, slot = {0, 0, 0, 0}, pos = {0, 1, 2, 3};
  const std::vector<int64_t> rows = {3};
  std::vector<float> plain, profiled;
  forward_profile prof;
  double wall = 0;
  for (bool with : {false, true}) {
    auto cache = be->kv_cache_create(1, L, KV, D, 16, kv_dtype::bf16);
    const auto t0 = std::chrono::steady_clock::now();
    engine_forward(*be, *w, *cache, {}, tokens, slot, pos, rows, with ? profiled : plain, nullptr, with ? &prof : nullptr);
    if (with) wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  EXPECT_EQ(plain, profiled);
  const auto calls = [&](forward_op op) { return prof.calls[static_cast<size_t>(op)]; };
  EXPECT_EQ(calls(forward_op::embedding), 1);
  EXPECT_EQ(calls(forward_op::norm), 2 * L + 1);  // two per layer and the final one
  EXPECT_EQ(calls(forward_op::residual), 2 * L);
  EXPECT_EQ(calls(forward_op::lm_head), 1);
  for (forward_op op : {forward_op::qkv, forward_op::rope, forward_op::kv_write, forward_op::attention, forward_op::o_proj,
                        forward_op::gate_up, forward_op::swiglu, forward_op::down})
    EXPECT_EQ(calls(op), L) << forward_profile::name(op);
  double sum = 0;
  for (size_t i = 0; i < forward_profile::kOps; ++i) {
    EXPECT_GE(prof.seconds[i], 0.0) << forward_profile::name(static_cast<forward_op>(i));
    sum += prof.seconds[i];
  }
  EXPECT_GT(sum, 0.0);
  EXPECT_LE(sum, wall);
  EXPECT_STREQ(forward_profile::name(forward_op::gate_up), "gate_up");
}
