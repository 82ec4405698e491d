// tests/models/sampling_test.cpp -- sampling as a user asks for it, checked against the training
// forward's logits with an FP64 reference written here (not models/sampling.cpp): greedy is the
// argmax; top-k / top-p sample only tokens of the kept set and report the logprob renormalized
// over it; inverse-CDF draws follow the distribution; stop tokens end a request; impossible
// settings are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>

#include "models/cpu/cpu_ops.hpp"
#include "models/sampling.hpp"
#include "tests/models/gen_util.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;
using namespace fp8rl::models::test;

namespace {

// What `p` keeps of one row of logits and the log-sum-exp over it, in FP64 from the FP32
// z = logits / T (T = 1 for greedy): top-k keeps z >= the k-th largest, then top-p the shortest
// prefix by descending probability (ties: lower id) whose mass reaches p.
struct kept {
  std::vector<bool> keep;
  std::vector<float> z;
  double lse = 0;
};

double lse_over(const kept& k) {
  double m = -std::numeric_limits<double>::infinity(), s = 0;
  for (size_t v = 0; v < k.z.size(); ++v)
    if (k.keep[v]) m = std::max(m, double(k.z[v]));
  for (size_t v = 0; v < k.z.size(); ++v)
    if (k.keep[v]) s += std::exp(double(k.z[v]) - m);
  return m + std::log(s);
}

kept reference_keep(const std::vector<float>& logits, const logit_processing& p) {
  const size_t V = logits.size();
  const float T = p.temperature == 0.0f ? 1.0f : p.temperature;
  kept k;
  k.keep.assign(V, true);
  for (float l : logits) k.z.push_back(T == 1.0f ? l : l / T);
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < V) {
    std::vector<float> s(k.z);
    std::sort(s.begin(), s.end(), std::greater<>());
    for (size_t v = 0; v < V; ++v) k.keep[v] = k.z[v] >= s[p.top_k - 1];
  }
  if (p.top_p < 1.0f) {
    const double lse = lse_over(k);
    std::vector<size_t> order;
    for (size_t v = 0; v < V; ++v)
      if (k.keep[v]) order.push_back(v);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return k.z[a] > k.z[b]; });
    double mass = 0;
    size_t n = 0;
    while (n < order.size() && mass < p.top_p) mass += std::exp(double(k.z[order[n++]]) - lse);
    for (size_t i = n; i < order.size(); ++i) k.keep[order[i]] = false;
  }
  k.lse = lse_over(k);
  return k;
}

std::vector<gen_result> generate(const model_params& p, const logit_processing& proc, int n, int max_tokens,
                                 const std::vector<int32_t>& stops = {}) {
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp32", 3));
  EXPECT_EQ(e.adopt_params(p, 1, 1), "");
  for (auto& r : requests(n, proc.temperature, proc.top_k, proc.top_p)) {
    r.max_tokens = max_tokens;
    r.stop_tokens = stops;
    e.submit(r);
  }
  return e.run_to_completion();
}

}  // namespace

// Every generated token lies in the set its processing keeps (greedy: the argmax, lowest id on
// ties) and carries log p renormalized over that set, against the learner's FP32 logits (the
// engine's, bit for bit, under the fp32 policy). Every filtered case drops tokens at every step,
// so a filter that kept too many would show within a few draws.
TEST(Sampling, TokensComeFromTheKeptSetWithRenormalizedLogprobs) {
  const model_params p = model_params_init(gen_cfg(), 21);
  const logit_processing cases[] = {{0.0f, 0, 1.0f}, {0.0f, 5, 0.5f}, {0.7f, 5, 1.0f}, {1.0f, 0, 0.6f},
                                    {1.3f, 10, 0.9f}, {1.0f, 1, 1.0f}};
  for (const auto& proc : cases) {
    const auto res = generate(p, proc, 6, 12);
    const auto lv = learner_forward(p, precision_policy::named("fp32"), res, proc);
    int64_t tokens = 0, narrow = 0;
    for (size_t i = 0; i < res.size(); ++i)
      for (size_t t = 0; t < res[i].tokens.size(); ++t) {
        const auto& row = lv.logits[i][t];
        const int32_t tok = res[i].tokens[t];
        const kept k = reference_keep(row, proc);
        const auto where = "T=" + std::to_string(proc.temperature) + " k=" + std::to_string(proc.top_k) +
                           " p=" + std::to_string(proc.top_p) + " request " + std::to_string(i) + " token " + std::to_string(t);
        if (proc.temperature == 0.0f) {
          EXPECT_EQ(tok, std::max_element(row.begin(), row.end()) - row.begin()) << where;  // first maximum
        }
        EXPECT_TRUE(k.keep[tok]) << where;
        EXPECT_NEAR(res[i].logprobs[t], double(k.z[tok]) - k.lse, fp8rl::tol::kLogprobVsF64) << where;
        EXPECT_EQ(std::memcmp(&res[i].logprobs[t], &lv.logprobs[i][t], 4), 0) << where;  // the learner's definition
        ++tokens;
        narrow += std::count(k.keep.begin(), k.keep.end(), true) < static_cast<int64_t>(row.size());
      }
    EXPECT_GE(tokens, 6 * 12 / 2);
    if (proc.top_k > 0 || proc.top_p < 1.0f) {
      EXPECT_EQ(narrow, tokens);  // the filters did drop tokens
    }
  }
}

// The entropy logprob_forward reports is the processed distribution's: ln V for uniform logits,
// ln k under top-k of k equal leaders, and 0 for a target-less row (no caller read it; untested).
TEST(Sampling, LogprobEntropyIsTheProcessedDistributions) {
  const int64_t V = 50;
  std::vector<float> logits(2 * V, 0.25f);
  for (int64_t v = 0; v < 3; ++v) logits[V + v] = 4.0f;  // row 1: three equal leaders
  const std::vector<int32_t> targets = {7, 1};
  float logp[2], ent[2];
  fp8rl::models::cpu_logprob_forward(logits.data(), targets.data(), 2, V, {1.0f, 0, 1.0f}, logp, ent);
  EXPECT_NEAR(ent[0], std::log(double(V)), fp8rl::tol::kEntropyVsF64);
  EXPECT_NEAR(logp[0], -std::log(double(V)), fp8rl::tol::kLogprobVsF64);
  fp8rl::models::cpu_logprob_forward(logits.data(), targets.data(), 2, V, {1.0f, 3, 1.0f}, logp, ent);
  EXPECT_NEAR(ent[1], std::log(3.0), fp8rl::tol::kEntropyVsF64);
  EXPECT_NEAR(logp[1], -std::log(3.0), fp8rl::tol::kLogprobVsF64);
  const std::vector<int32_t> none = {-1, 1};
  fp8rl::models::cpu_logprob_forward(logits.data(), none.data(), 2, V, {1.0f, 0, 1.0f}, logp, ent);
  EXPECT_EQ(ent[0], 0.0f);
  EXPECT_EQ(logp[0], 0.0f);
}

// The maximum is taken over every lane (16 lanes, then the tail): a row's largest logit at any
// position gives log-sum-exp ~ that logit, a -inf entry first included; greedy takes the lowest
// id of a tie.
TEST(Sampling, LogSumExpFindsTheMaximumInEveryLane) {
  const logit_processing plain{1.0f, 0, 1.0f};
  std::vector<int32_t> work;
  std::vector<float> z(40);
  for (int64_t at = 0; at < 40; ++at) {
    std::vector<float> logits(40, 0.0f);
    logits[static_cast<size_t>(at)] = 200.0f;
    // exact: the others' e^-200 is below FP32's least subnormal, so the sum is 1 and its log 0
    EXPECT_EQ(logits_process(logits.data(), 40, plain, z.data(), work), 200.0f) << at;
  }
  const float first_dropped[2] = {-INFINITY, 0.5f};
  EXPECT_NEAR(logits_process(first_dropped, 2, plain, z.data(), work), 0.5, fp8rl::tol::kLogprobVsF64);
  const float tie[4] = {1.0f, 3.0f, 3.0f, 2.0f};
  EXPECT_EQ(argmax_logits(tie, 4), 1);
}

// sample_processed draws by inverse CDF: 400k draws over 8 tokens (one dropped by -inf) match
// the probabilities within 5 standard deviations of a binomial count.
TEST(Sampling, DrawsFollowTheDistribution) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> z = {0.5f, -1.0f, 2.0f, ninf, 0.0f, 1.25f, -3.0f, 0.75f};
  double m = 2.0, s = 0;
  for (float x : z) s += x == ninf ? 0.0 : std::exp(double(x) - m);
  const double lse = m + std::log(s);
  std::mt19937_64 g(5);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const int n = 400000;
  std::vector<int> count(z.size(), 0);
  for (int i = 0; i < n; ++i) ++count[sample_processed(z.data(), static_cast<int64_t>(z.size()), lse, u(g))];
  for (size_t v = 0; v < z.size(); ++v) {
    const double pv = z[v] == ninf ? 0.0 : std::exp(double(z[v]) - lse);
    const double sd = std::sqrt(n * pv * (1 - pv));
    EXPECT_LE(std::fabs(count[v] - n * pv), fp8rl::tol::kBinomialSigmas * sd + 0.5) << "token " << v << " p " << pv;
  }
  EXPECT_EQ(count[3], 0);
  // the ends of u: 0 takes the first kept token; u just below 1, on a row whose last entries are
  // dropped, takes the last kept one (also when the rounded mass falls short of u)
  EXPECT_EQ(sample_processed(z.data(), static_cast<int64_t>(z.size()), lse, 0.0), 0);
  std::vector<float> tail = {0.5f, -1.0f, 2.0f, 0.0f, ninf, ninf};
  double st = 0;
  for (float x : tail) st += x == ninf ? 0.0 : std::exp(double(x) - 2.0);
  const double lt = 2.0 + std::log(st);
  EXPECT_EQ(sample_processed(tail.data(), 6, lt, std::nextafter(1.0, 0.0)), 3);
  EXPECT_EQ(sample_processed(tail.data(), 6, lt + 1e-9, std::nextafter(1.0, 0.0)), 3);  // mass < u: fallback
}

// A stop token ends its request at its first occurrence ("stop"); without one it runs to
// max_tokens ("length").
TEST(Sampling, StopTokensEndARequest) {
  const model_params p = model_params_init(gen_cfg(), 22);
  const logit_processing greedy{0.0f, 0, 1.0f};
  const auto free_run = generate(p, greedy, 2, 12);
  ASSERT_EQ(free_run.size(), 2u);
  const auto& g = free_run[0].tokens;
  ASSERT_EQ(g.size(), 12u);
  EXPECT_EQ(free_run[0].finish, "length");
  const int32_t stop = g[3];
  const size_t first = std::find(g.begin(), g.end(), stop) - g.begin();
  const auto stopped = generate(p, greedy, 1, 12, {stop});
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(stopped[0].finish, "stop");
  EXPECT_EQ(stopped[0].tokens, std::vector<int32_t>(g.begin(), g.begin() + first + 1));
  // a stop token that is also the last token allowed ended the request on the stop
  const auto both = generate(p, greedy, 1, static_cast<int>(first) + 1, {stop});
  ASSERT_EQ(both.size(), 1u);
  EXPECT_EQ(both[0].finish, "stop");
  EXPECT_EQ(both[0].tokens, stopped[0].tokens);
}

// A sequence never exceeds max_context (prompt + generated), a prompt must leave room for one
// token, and the engine feeds every token but each request's last exactly once (a token fed
// twice was recomputed each step and counted twice; under `keep` its position was rewritten).
TEST(Sampling, ContextLimitsAndTokenCounts) {
  const model_params p = model_params_init(gen_cfg(), 24);
  auto be = make_cpu_backend();
  engine_config ec = ecfg("fp32", 2);
  ec.max_context = 8;
  generation_engine e(*be, p.cfg, ec);
  ASSERT_EQ(e.adopt_params(p, 1, 1), "");
  gen_request r = requests(1, 1.0f)[0];
  r.prompt = {1, 2, 3};
  r.max_tokens = 100;
  e.submit(r);
  gen_request full = r;
  full.id = 200;
  full.prompt.assign(8, 5);  // max_context tokens: no room for one more
  EXPECT_NE(fp8rl::test::thrown_text<std::invalid_argument>([&] { e.submit(full); }).find("does not fit max_context 8"),
            std::string::npos);
  full.prompt.pop_back();  // 7: one token to generate
  e.submit(full);
  const auto res = e.run_to_completion();
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(res[0].tokens.size(), 5u);
  EXPECT_EQ(res[0].finish, "length");
  EXPECT_EQ(res[1].tokens.size(), 1u);
  EXPECT_EQ(res[1].finish, "length");
  int64_t fed = 0;
  for (const auto& x : res) fed += static_cast<int64_t>(x.prompt.size() + x.tokens.size()) - 1;
  EXPECT_EQ(e.stats().prefill_tokens + e.stats().decode_tokens, fed);
  EXPECT_EQ(e.stats().prefill_tokens, 3 + 7);
}

// Settings no distribution answers to are refused when submitted, naming the setting; an engine
// whose KV cache cannot fit in memory is refused when made.
TEST(Sampling, ImpossibleSettingsAreRefusedByName) {
  const model_params p = model_params_init(gen_cfg(), 23);
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp32", 1));
  ASSERT_EQ(e.adopt_params(p, 1, 1), "");
  auto refused = [&](gen_request r) -> std::string {
    try {
      e.submit(std::move(r));
    } catch (const std::invalid_argument& x) {
      return x.what();
    }
    return "";
  };
  const gen_request base = requests(1, 1.0f)[0];
  auto with = [&](auto f) { gen_request r = base; f(r); return refused(r); };
  EXPECT_NE(with([](gen_request& r) { r.proc.temperature = -1.0f; }).find("temperature"), std::string::npos);
  EXPECT_NE(with([](gen_request& r) { r.proc.temperature = std::nanf(""); }).find("temperature"), std::string::npos);
  EXPECT_NE(with([](gen_request& r) { r.proc.temperature = INFINITY; }).find("temperature inf is not a finite number"),
            std::string::npos);  // (every logit / T was 0: a uniform draw)
  // so small that a sane logit / T overflows: admitted, it failed every step of its batch
  EXPECT_NE(with([](gen_request& r) { r.proc.temperature = 1e-30f; }).find("temperature 1e-30 is below 1e-05 (0: greedy)"),
            std::string::npos);
  EXPECT_EQ(with([](gen_request& r) { r.proc.temperature = kMinTemperature, r.id += 100; }), "");
  EXPECT_NE(with([](gen_request& r) { r.proc.top_k = -4; }).find("top_k"), std::string::npos);
  EXPECT_NE(with([](gen_request& r) { r.proc.top_p = 0.0f; }).find("top_p"), std::string::npos);
  EXPECT_NE(with([](gen_request& r) { r.proc.top_p = 1.5f; }).find("top_p"), std::string::npos);
  EXPECT_NE(with([](gen_request& r) { r.stop_tokens = {3, 61}; }).find("stop token 61"), std::string::npos);
  EXPECT_EQ(refused(base), "");
  EXPECT_FALSE(e.idle());
  // an id already waiting or generating: both drew one random stream, and results sorted by id
  // came in either order
  EXPECT_NE(refused(base).find("request " + std::to_string(base.id) + ": an unfinished request has this id"), std::string::npos);
  e.run_to_completion();
  EXPECT_EQ(refused(base), "");  // finished: the id is free again
  e.drain();
  EXPECT_EQ(refused(base), "");  // drained: free again
  // max_context 1 leaves no room for a generated token; the values are named
  engine_config one = ecfg("fp32", 1);
  one.max_context = 1;
  try {
    generation_engine g(*be, p.cfg, one);
    ADD_FAILURE() << "max_context 1 was accepted";
  } catch (const std::invalid_argument& x) {
    EXPECT_NE(std::string(x.what()).find("max_context > 1 (a prompt token and one generated), got 1 and 1"), std::string::npos) << x.what();
  }
  // a KV cache beyond the machine's memory is refused before it is allocated, naming the knobs
  engine_config huge = ecfg("fp32", int64_t{1} << 22);  // 4M slots x 64 positions x 2 KiB: 512 GiB
  try {
    generation_engine g(*be, p.cfg, huge);
    ADD_FAILURE() << "a 512 GiB KV cache was accepted";
  } catch (const std::invalid_argument& x) {
    EXPECT_NE(std::string(x.what()).find("lower slots or max_context"), std::string::npos) << x.what();
  }
}

// The memory the KV check measures against: physical memory lowered by the smallest limit of the
// process's cgroup or a parent (v2 memory.max, v1 memory.limit_in_bytes), on a fake tree: "max"
// and v1's huge no-limit value leave it, a missing file is no limit, other controllers are ignored.
TEST(Sampling, MemoryLimitWalksTheCgroupAndItsParents) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("fp8rl_cgroup_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto put = [](const fs::path& f, const std::string& text) {
    fs::create_directories(f.parent_path());
    std::ofstream(f) << text;
  };
  const fs::path proc = root / "proc_cgroup", sys = root / "sys";
  const double phys = 64e9;
  put(proc, "0::/a/b/c\n");
  EXPECT_EQ(memory_limit_bytes(phys, proc, sys), phys);  // no files: no limit
  put(sys / "a/b/c/memory.max", "max\n");
  put(sys / "a/memory.max", "8000000000\n");  // a parent's limit binds its children
  put(sys / "memory.max", "16000000000\n");
  EXPECT_EQ(memory_limit_bytes(phys, proc, sys), 8e9);
  put(sys / "a/b/memory.max", "2000000000\n");  // the smallest on the path wins
  EXPECT_EQ(memory_limit_bytes(phys, proc, sys), 2e9);
  EXPECT_EQ(memory_limit_bytes(1e9, proc, sys), 1e9);  // never above physical memory
  // v1: the memory controller's line only, its hierarchy under memory/; no limit is a huge number
  put(proc, "5:cpu,cpuacct:/x\n4:memory:/x/y\n");
  put(sys / "cpu,cpuacct/x/memory.limit_in_bytes", "1000");
  put(sys / "memory/x/y/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(memory_limit_bytes(phys, proc, sys), phys);
  put(sys / "memory/x/memory.limit_in_bytes", "4000000000\n");
  EXPECT_EQ(memory_limit_bytes(phys, proc, sys), 4e9);
  // no such /proc file (not Linux's layout): physical memory
  EXPECT_EQ(memory_limit_bytes(phys, root / "absent", sys), phys);
  fs::remove_all(root);
}

// Logits no distribution comes from -- a NaN or +inf logit, a logit / T that overflows FP32 at a
// tiny temperature, none finite -- are refused naming the token (the sampler returned the last
// token with a NaN logprob); -inf logits are dropped tokens, as top-k makes them. In the engine
// the error names the request, and drain() gives the requests back.
TEST(Sampling, NonFiniteLogitsAreRefusedNamingTheToken) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = {0.5f, -1.0f, 2.0f, -inf, 1.0f}, z(5);
  std::vector<int32_t> work;
  auto why = [&](const logit_processing& p) {
    return fp8rl::test::thrown_text<std::invalid_argument>([&] { logits_process(logits.data(), 5, p, z.data(), work); });
  };
  EXPECT_EQ(why({1.0f, 0, 1.0f}), "");  // -inf: a dropped token
  EXPECT_NE(why({5e-39f, 0, 1.0f}).find("logit of token 2 is 2.000000 (inf at temperature"), std::string::npos)
      << why({5e-39f, 0, 1.0f});  // 2 / 5e-39 overflows, 1 / 5e-39 does not
  logits[3] = std::nanf("");
  EXPECT_NE(why({1.0f, 0, 1.0f}).find("logit of token 3 is nan"), std::string::npos) << why({1.0f, 0, 1.0f});
  logits = {-inf, -inf, -inf, -inf, -inf};
  EXPECT_NE(why({1.0f, 0, 0.9f}).find("no token has a finite logit"), std::string::npos);

  model_params p = model_params_init(gen_cfg(), 23);
  p.get("lm_head.weight")[5] = std::nanf("");  // a weight of token 0's lm_head row: its logit is NaN
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp32", 2));
  ASSERT_EQ(e.adopt_params(p, 1, 1), "");
  for (auto& r : requests(2, 1.0f)) e.submit(r);
  const std::string msg = fp8rl::test::thrown_text<std::runtime_error>([&] { e.step(); });
  EXPECT_NE(msg.find("request " + std::to_string(requests(1, 1.0f)[0].id) + ", generated token 0: logit of token 0 is nan:"),
            std::string::npos) << msg;
  EXPECT_EQ(e.drain().size(), 2u);
}

// A step that throws happens for no slot: a result finished earlier in the same step was dropped
// (drain() gave back only the failing request), and the slots stayed fed past what the cache
// held, so the next step read logits row -1. Logits ~1e34 (the final norm's weights scaled up)
// are finite at T = 1 and overflow at T = 1e-5: request A (T = 1, one token) finishes in the
// step where B (T = 1e-5) fails.
TEST(Sampling, AFailedStepChangesNoSlot) {
  model_params p = model_params_init(gen_cfg(), 23);
  float* norm = p.get("model.norm.weight");
  for (int64_t c = 0; c < p.cfg.hidden_size; ++c) norm[c] *= 1e34f;
  auto be = make_cpu_backend();
  generation_engine e(*be, p.cfg, ecfg("fp32", 2));
  ASSERT_EQ(e.adopt_params(p, 1, 1), "");
  auto rq = requests(2, 1.0f);
  rq[0].max_tokens = 1;
  rq[1].proc.temperature = kMinTemperature;
  for (auto& r : rq) e.submit(r);
  const std::string first = fp8rl::test::thrown_text<std::runtime_error>([&] { e.step(); });
  EXPECT_NE(first.find("request " + std::to_string(rq[1].id) + ", generated token 0:"), std::string::npos) << first;
  EXPECT_EQ(fp8rl::test::thrown_text<std::runtime_error>([&] { e.step(); }), first);  // the same step again
  std::set<uint64_t> back;
  for (const auto& r : e.drain()) back.insert(r.id);
  EXPECT_EQ(back, (std::set<uint64_t>{rq[0].id, rq[1].id}));
  // with an FP8 KV cache, the K/V a failed step wrote (saturating every element: scales 1e-6) are
  // not counted: the retry writes them again (each try counted them); its FP8 queries likewise
  generation_engine f(*be, p.cfg, ecfg("fp8-kv", 2));
  const int64_t L = p.cfg.num_hidden_layers, H = p.cfg.num_attention_heads, KV = p.cfg.num_key_value_heads;
  const attn_fp8_scales tiny{std::vector<float>(L * H, 1e-6f), std::vector<float>(L * KV, 1e-6f), std::vector<float>(L * KV, 1e-6f)};
  ASSERT_EQ(f.adopt_params(p, 1, 1, &tiny), "");
  for (auto& r : rq) f.submit(r);
  EXPECT_THROW(f.step(), std::runtime_error);
  EXPECT_THROW(f.step(), std::runtime_error);
  ASSERT_EQ(f.stats().kv_saturated.size(), static_cast<size_t>(L));  // one count per layer: the loops below check each
  ASSERT_EQ(f.stats().q_saturated.size(), static_cast<size_t>(L));
  for (int64_t n : f.stats().kv_saturated) EXPECT_EQ(n, 0);
  for (int64_t n : f.stats().q_saturated) EXPECT_EQ(n, 0);
  f.drain();
  f.submit(rq[0]);
  f.step();  // request A alone: the step holds and counts its writes
  for (int64_t n : f.stats().kv_saturated) EXPECT_GT(n, 0);
  for (int64_t n : f.stats().q_saturated) EXPECT_GT(n, 0);
}
