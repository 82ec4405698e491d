// tools/bench/bench_train.cpp -- build/bin/bench-train: training tokens/s (forward + backward +
// AdamW) of a model with hidden 512, 8 layers, 8 heads (2 KV heads), intermediate 1536, vocab
// 4096, sequences of 256, under the fp32 / bf16 / fp8 policies at 1 and 2 threads; and, in the
// same run when Debian's python3-torch is installed, the same model and step in PyTorch CPU
// (tools/bench-train-torch.py: FP32 and bf16 autocast). Where the CPU has AMX, also the
// bf16-tiles / fp8-tiles policies (linear GEMMs on the tile kernels, as oneDNN does for torch).
//   {"bench":"train","impl":...,"threads":..,"tokens":..,"median_s":..,"tokens_per_s":..,"runs":..,
//    "weights_s":..,"forward_s":..,"backward_s":..,"optimizer_s":..}   (phase medians: weight
//    quantize/pack, forward + logprobs, backward, gradient norm + AdamW)
// plus, per thread count, fp8 against bf16 in alternating steps ("..._side_by_side": "speedup"
// is the median per-round ratio bf16 time / fp8 time; --only=side_by_side for these alone).
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "models/adamw.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/transformer.hpp"
#include "quant/gemm.hpp"
#include "tools/bench/bench_util.hpp"

using namespace fp8rl;
using namespace fp8rl::bench;

namespace {
// Seconds since construction or the previous lap.
struct phase_clock {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  double lap() {
    const auto n = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(n - t).count();
    t = n;
    return s;
  }
};

// One policy's training step on its own copy of the parameters (run inside the caller's arena).
struct train_step {
  const models::model_config& c;
  const models::token_batch& b;
  const std::vector<int32_t>& targets;
  std::unique_ptr<models::backend> be = models::make_cpu_backend();
  models::model_runner run{*be};
  models::adamw_state st;
  models::model_params q;
  models::precision_policy policy;
  std::vector<float> grads;
  train_step(const models::model_config& cfg, const models::token_batch& batch, const std::vector<int32_t>& tg,
             const models::model_params& p, const std::string& pol)
      : c(cfg), b(batch), targets(tg), q(p), policy(models::precision_policy::named(pol)),
        grads(static_cast<size_t>(q.layout.total), 0.0f) {}
  // seconds of each phase: weight quantize/pack, forward + logprobs, backward, gradient norm + AdamW
  std::array<double, 4> operator()() {
    std::array<double, 4> ph{};
    phase_clock pc;
    auto w = models::model_weights_build(*be, c, policy, {&q, nullptr, nullptr}, true);
    ph[0] = pc.lap();
    run.forward(*w, b, true);
    std::vector<float> lp(targets.size()), dl(targets.size());
    run.logprobs(targets, {}, lp.data());
    ph[1] = pc.lap();
    for (size_t i = 0; i < dl.size(); ++i) dl[i] = targets[i] >= 0 ? -1.0f / float(targets.size()) : 0.0f;
    std::fill(grads.begin(), grads.end(), 0.0f);  // a learner keeps its gradient buffer
    run.backward(*w, targets, {}, dl.data(), grads.data());
    ph[2] = pc.lap();
    models::adamw_step({}, q.layout, q.data.data(), grads.data(), st);
    ph[3] = pc.lap();
    return ph;
  }
};

// fp8 against bf16 (and fp8-tiles against bf16-tiles where AMX exists) in alternating steps,
// the order swapped every round: "speedup" is the median per-round ratio bf16 time / fp8 time,
// the number to read on a shared machine (both see the same neighbours).
void run_side_by_side(const bench_args& a, int t, const models::model_config& c, const models::token_batch& b,
                      const std::vector<int32_t>& targets, const models::model_params& p, const std::string& fp8,
                      const std::string& bf16) {
  tbb::task_arena arena(t);
  std::vector<double> tf, tb, ratio;
  arena.execute([&] {
    train_step f(c, b, targets, p, fp8), g(c, b, targets, p, bf16);
    auto secs = [](train_step& s) {
      const auto ph = s();
      return ph[0] + ph[1] + ph[2] + ph[3];
    };
    secs(f), secs(g), secs(f), secs(g);  // warm-up: scratch pools, first-touch pages
    const auto side = bench_side_by_side(a.reps, [&] { return secs(f); }, [&] { return secs(g); });
    tf = side.a, tb = side.b, ratio = side.ratio;
  });
  std::string impl = fp8 + "_vs_" + bf16 + "_side_by_side";
  std::replace(impl.begin(), impl.end(), '-', '_');
  bench_emit(a, {{"bench", jstr("train")}, {"impl", jstr(impl)}, {"threads", jnum(t)}, {"tokens", jnum(double(b.T()))},
                 {"fp8_tokens_per_s", jnum(double(b.T()) / bench_median_of(tf))},
                 {"bf16_tokens_per_s", jnum(double(b.T()) / bench_median_of(tb))},
                 {"speedup", jnum(bench_median_of(ratio))}, {"runs", jnum(double(ratio.size()))}});
}

}  // namespace

int main(int argc, char** argv) {
  bench_args a = bench_parse(argc, argv);
  models::model_config c;
  c.hidden_size = 512; c.intermediate_size = 1536; c.num_hidden_layers = 8; c.num_attention_heads = 8;
  c.num_key_value_heads = 2; c.head_dim = 64; c.vocab_size = 4096; c.max_position_embeddings = 256;
  const int64_t seq = 256, nseq = a.quick ? 2 : 4;
  models::model_params p = models::model_params_init(c, 1);
  models::token_batch b;
  models::rng g(5);
  for (int64_t s = 0; s < nseq; ++s) {
    std::vector<int32_t> t(static_cast<size_t>(seq));
    for (auto& x : t) x = static_cast<int32_t>(g.next_u64() % 4096);
    b.add(t);
  }
  const auto targets = b.next_targets();
  for (int t : a.threads)
    for (std::string pol : {"fp32", "bf16", "fp8", "bf16-tiles", "fp8-tiles"}) {
      std::string impl = "fp8rl_" + pol;
      std::replace(impl.begin(), impl.end(), '-', '_');
      if (!bench_selected(a, impl)) continue;
      if (pol.find("tiles") != std::string::npos && !quant::gemm_tiles_available()) continue;
      tbb::task_arena arena(t);
      double sec = 0, phase_s[4] = {};
      arena.execute([&] {
        train_step step(c, b, targets, p, pol);
        std::vector<double> ph[4];  // phase times of every run (bench_median makes 2 warm-up runs first)
        sec = bench_median(a.reps, [&] {
          const auto s = step();
          for (int i = 0; i < 4; ++i) ph[i].push_back(s[i]);
        }, 0.0);
        for (int i = 0; i < 4; ++i) phase_s[i] = bench_median_of(ph[i]);
      });
      bench_emit(a, {{"bench", jstr("train")}, {"impl", jstr(impl)}, {"threads", jnum(t)},
                     {"tokens", jnum(double(b.T()))}, {"median_s", jnum(sec)}, {"tokens_per_s", jnum(double(b.T()) / sec)},
                     {"runs", jnum(a.reps)}, {"weights_s", jnum(phase_s[0])}, {"forward_s", jnum(phase_s[1])},
                     {"backward_s", jnum(phase_s[2])}, {"optimizer_s", jnum(phase_s[3])}});
    }
  if (bench_selected(a, "side_by_side"))
    for (int t : a.threads) {
      run_side_by_side(a, t, c, b, targets, p, "fp8", "bf16");
      if (quant::gemm_tiles_available()) run_side_by_side(a, t, c, b, targets, p, "fp8-tiles", "bf16-tiles");
    }
  // PyTorch baseline in the same run
  const auto script = std::filesystem::path(__FILE__).parent_path().parent_path() / "bench-train-torch.py";
  if (bench_selected(a, "torch") && std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") == 0) {
    for (int t : a.threads) {
      const std::string cmd = "OMP_NUM_THREADS=" + std::to_string(t) + " OPENBLAS_NUM_THREADS=" + std::to_string(t) +
                              " MKL_NUM_THREADS=" + std::to_string(t) + " /usr/bin/python3 " + script.string() +
                              " --threads " + std::to_string(t) + " --seqs " + std::to_string(nseq) + " --reps " +
                              std::to_string(a.reps) + (a.json ? " --json" : "");
      std::fflush(stdout);
      if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "bench-train: the PyTorch baseline failed\n");
    }
  } else if (bench_selected(a, "torch")) {
    std::fprintf(stderr, "bench-train: /usr/bin/python3 has no torch (tools/setup --dev); PyTorch baseline skipped\n");
  }
}
