// models/rl/loop.cpp -- the synchronous GRPO step and calibration.
#include "models/rl/loop.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "models/cpu/cpu_backend.hpp"
#include "models/log.hpp"

namespace fp8rl::models {

attn_fp8_scales calibrate_attention(model_runner& run, const model_weights& w, const std::vector<token_batch>& batches,
                                    double percentile, float margin) {
  if (batches.empty()) throw std::invalid_argument("calibrate_attention: no batches");
  std::vector<qkv_stats> samples;
  for (const auto& b : batches) {
    qkv_stats st;
    run.forward(w, b, false, nullptr, &st);
    samples.push_back(std::move(st));
  }
  const int64_t L = w.cfg.num_hidden_layers;
  auto pick = [&](auto member, const char* tensor) {
    const size_t n = (samples[0].*member).size();
    const size_t heads = n / static_cast<size_t>(L);
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> v;
      for (const auto& s : samples) {
        const float a = (s.*member)[i];
        if (!std::isfinite(a))  // fp8-numerics §3.3: never a scale from non-finite data
          throw std::invalid_argument("calibrate_attention: layer " + std::to_string(i / heads) + ", " + tensor + " head " +
                                      std::to_string(i % heads) + ": amax is " + std::to_string(a) +
                                      " (non-finite activations in the calibration forward)");
        v.push_back(a);
      }
      std::sort(v.begin(), v.end());
      const float amax = v[static_cast<size_t>(std::llround(percentile * double(v.size() - 1)))];
      out[i] = std::max(amax, 1e-6f) * margin / 448.0f;
    }
    return out;
  };
  return {pick(&qkv_stats::q, "Q"), pick(&qkv_stats::k, "K"), pick(&qkv_stats::v, "V")};
}

std::shared_ptr<quant::weight_bundle> make_bundle(const rl_state& st, const rl_run_config& cfg,
                                                  const std::vector<token_batch>& calib, uint64_t scale_version,
                                                  quant::flush_report* flushed) {
  attn_fp8_scales sc;
  const bool need = cfg.gen_policy.kv == kv_dtype::fp8 || cfg.gen_policy.fp8_attention;
  if (need) {
    auto be = make_cpu_backend();
    model_runner run(*be);
    auto w = model_weights_build(*be, st.params.cfg, cfg.gen_policy.training(), {&st.params, nullptr, nullptr}, false);
    sc = calibrate_attention(run, *w, calib, cfg.kv_percentile, cfg.kv_margin);
  }
  return std::make_shared<quant::weight_bundle>(
      bundle_from_params(st.params, cfg.gen_policy, st.version, scale_version, need ? &sc : nullptr, flushed));
}

void flush_metrics_add(int64_t flushed, double worst_block, metric_map& m) {
  m["fp8_weights_flushed"] = double(flushed);
  m["fp8_weights_flushed_worst_block"] = worst_block;
}

bool flush_warn(const quant::flush_report& f, uint64_t version) {
  if (!(f.worst_fraction > kFlushWarnFraction)) return false;
  log_get("calibration")->warn("weights v{}: {} (an outlier's scale; {} of {} nonzero FP8 weights flushed in all)", version,
                               f.worst_text(), f.flushed, f.nonzero);
  return true;
}

std::vector<task_example> take_prompts(const dataset& d, uint64_t cursor, int64_t n) {
  std::vector<task_example> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(d.items[(cursor + static_cast<uint64_t>(i)) % d.items.size()]);
  return out;
}

metric_map rl_sync_step(rl_state& st, generation_engine& eng, const dataset& train, const tokenizer& tok,
                        const rl_run_config& cfg) {
  using clk = std::chrono::steady_clock;
  const auto t0 = clk::now();
  const auto prompts = take_prompts(train, st.prompt_cursor, cfg.prompts_per_step);
  token_batch calib;
  if (st.last_trained.empty())
    for (const auto& p : prompts) calib.add(tok.encode(p.prompt, true));
  else
    for (const auto& q : st.last_trained) calib.add(q);
  quant::flush_report flushed;
  const std::string err = eng.adopt(make_bundle(st, cfg, {calib}, st.version, &flushed));
  if (!err.empty()) throw std::runtime_error("rl_sync_step: adoption refused: " + err);
  const auto stops = stop_ids(st.params.cfg, tok);
  for (auto& r : rollout_requests(prompts, st.prompt_cursor, tok, stops, cfg.grpo.group_size, cfg.proc, cfg.max_new_tokens,
                                  cfg.seed + st.version))
    eng.submit(std::move(r));
  const auto results = eng.run_to_completion();
  std::map<uint64_t, std::string> answers;
  for (size_t i = 0; i < prompts.size(); ++i) answers[st.prompt_cursor + i] = prompts[i].answer;
  const auto samples = rollout_samples(results, answers, tok, stops, cfg.verifier, cfg.grpo);
  const auto t1 = clk::now();
  double N = 0;
  for (const auto& s : samples) N += double(s.response.size());
  auto be = make_cpu_backend();
  model_runner run(*be);
  auto w = model_weights_build(*be, st.params.cfg, cfg.train_policy.training(), {&st.params, nullptr, nullptr}, true);
  std::unique_ptr<model_weights> ref;
  if (cfg.grpo.kl_beta > 0) {
    if (!st.ref) throw std::invalid_argument("rl_sync_step: grpo.kl_beta > 0 needs the reference weights (rl_state::ref)");
    ref = model_weights_build(*be, st.ref->cfg, cfg.train_policy.training(), {st.ref.get(), nullptr, nullptr}, false);
  }
  learner_out lo = learner_grpo(run, *w, samples, cfg.grpo, N, st.version, ref.get(), cfg.proc);
  const double gnorm = adamw_step(cfg.opt, st.params.layout, st.params.data.data(), lo.grads.data(), st.opt);
  metric_map m = lo.loss.metrics;
  rl_batch_metrics(samples, st.version, 0, m);
  m["grad_norm"] = gnorm;
  flush_warn(flushed, st.version);
  flush_metrics_add(flushed.flushed, flushed.worst_fraction, m);
  m["weight_version"] = double(st.version);
  m["generation_s"] = std::chrono::duration<double>(t1 - t0).count();
  m["training_s"] = std::chrono::duration<double>(clk::now() - t1).count();
  m["tokens"] = N;
  st.version += 1;
  st.prompt_cursor += static_cast<uint64_t>(cfg.prompts_per_step);
  st.last_trained = rl_sequences(samples);
  return m;
}

}  // namespace fp8rl::models
