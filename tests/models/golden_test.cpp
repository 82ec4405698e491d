// tests/models/golden_test.cpp -- the FP32 model against PyTorch (tools/make-golden.py):
// logits, per-token logprobs and loss, every gradient, and ten AdamW-step losses.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/adamw.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/transformer.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;

namespace {
const char* kDir = "tests/models/golden";

struct golden {
  model_params params;
  st_tensors expected;
  token_batch batch;
  std::vector<float> mask;
};

golden load() {
  golden g;
  g.params = model_load(kDir);
  g.expected = safetensors_read(std::string(kDir) + "/expected.safetensors");
  // metadata is not exposed by safetensors_read; tokens/starts are re-derived from the header
  std::ifstream f(std::string(kDir) + "/expected.safetensors", std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string h(n, ' ');
  f.read(h.data(), static_cast<std::streamsize>(n));
  auto meta = nlohmann::json::parse(h)["__metadata__"];
  auto toks = nlohmann::json::parse(meta["tokens"].get<std::string>()).get<std::vector<int32_t>>();
  auto starts = nlohmann::json::parse(meta["seq_start"].get<std::string>()).get<std::vector<int32_t>>();
  g.batch.tokens = toks;
  g.batch.seq_start = starts;
  g.mask = g.expected.at("mask").data;
  return g;
}

std::vector<double> dv(const float* p, size_t n) { return std::vector<double>(p, p + n); }
std::vector<double> dv(const std::vector<float>& v) { return dv(v.data(), v.size()); }

// CE loss and gradient through model_runner; returns loss, fills grads
double ce_step(backend& be, model_runner& run, const model_params& p, const golden& g, std::vector<float>& grads,
               std::vector<float>* logp_out = nullptr) {
  auto w = model_weights_build(be, p.cfg, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
  run.forward(*w, g.batch, true);
  auto targets = g.batch.next_targets();
  std::vector<float> logp(targets.size());
  run.logprobs(targets, {}, logp.data());
  double n = 0, loss = 0;
  for (size_t t = 0; t < targets.size(); ++t) n += g.mask[t];
  std::vector<float> dlogp(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) {
    loss -= g.mask[t] * logp[t] / n;
    dlogp[t] = static_cast<float>(-g.mask[t] / n);
  }
  grads.assign(static_cast<size_t>(p.layout.total), 0.0f);
  run.backward(*w, targets, {}, dlogp.data(), grads.data());
  if (logp_out) *logp_out = logp;
  return loss;
}
}  // namespace

TEST(Golden, LogitsLossAndGradientsMatchPyTorch) {
  golden g = load();
  auto be = make_cpu_backend();
  model_runner run(*be);
  std::vector<float> grads, logp;
  const double loss = ce_step(*be, run, g.params, g, grads, &logp);
  const auto& want_logits = g.expected.at("logits").data;
  std::vector<float> logits(want_logits.size());
  be->to_host(logits.data(), run.logits(), logits.size() * 4);
  EXPECT_LE(fp8rl::tol::rel_norm_err(dv(logits), dv(want_logits)), fp8rl::tol::kGoldenF32Logits);
  const auto& want_lp = g.expected.at("logprobs").data;
  for (size_t t = 0; t < logp.size(); ++t) if (g.batch.next_targets()[t] < 0) logp[t] = 0.0f;
  EXPECT_LE(fp8rl::tol::rel_norm_err(dv(logp), dv(want_lp)), fp8rl::tol::kGoldenF32Logits);
  EXPECT_LE(std::fabs(loss - g.expected.at("loss").data[0]) / std::fabs(g.expected.at("loss").data[0]),
            fp8rl::tol::kGoldenF32Logits);
  for (const auto& info : g.params.layout.infos) {
    const auto& want = g.expected.at("grad." + info.name).data;
    EXPECT_LE(fp8rl::tol::rel_norm_err(dv(grads.data() + info.offset, static_cast<size_t>(info.numel)), dv(want)),
              fp8rl::tol::kGoldenF32Grads)
        << info.name;
  }
}

TEST(Golden, TenAdamWStepsMatchPyTorch) {
  golden g = load();
  auto be = make_cpu_backend();
  model_runner run(*be);
  model_params p = g.params;
  adamw_config cfg;
  cfg.lr = 3e-3f;
  cfg.weight_decay = 0.1f;
  cfg.grad_clip = 1.0f;
  adamw_state st;
  const auto& want = g.expected.at("adamw_losses").data;
  for (int step = 0; step < 10; ++step) {
    std::vector<float> grads;
    const double loss = ce_step(*be, run, p, g, grads);
    EXPECT_LE(std::fabs(loss - want[step]) / std::fabs(want[step]), fp8rl::tol::kGoldenAdamLoss) << "step " << step;
    adamw_step(cfg, p.layout, p.data.data(), grads.data(), st);
  }
}
