// tools/bench/bench_rl.cpp -- build/bin/bench-rl: the RL system end to end, side by side.
//  * samples/s of the default recipe with max_staleness 0, 1, 2 (rollout and learner each own
//    one core: topology configs/topologies/local.conf), steady state (60 steps, after 5 warm-up
//    steps, before the final evaluation) and over the whole run, in repetitions that alternate
//    k = 0, 1, 2; calibration time as % of the learner step; the seconds per step a rollout sat
//    without work (generation waiting for weights); for staleness > 0 the speedup over
//    the synchronous run of the same repetition (median, min, max) and the bound perfect overlap
//    would give, (rest + train) / max(rest, train) from the synchronous step's parts
//  * matched reward (anchors.md §3.8): FP8 end to end + async against the synchronous BF16
//    baseline -- wall time until greedy validation accuracy holds a target, and where each ends
//  * bundle sync: publish -> adopted latency and MB/s, in process and across processes (two
//    processes on loopback via caf-run), for FP8 and BF16 bundles of the "small" built-in model
// Runs build/bin/fp8rl (and caf-run) as users do and reads each run's metrics.jsonl; medians
// over steps. One JSON line per result with --json.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "models/json_io.hpp"
#include "tools/bench/rl_curve.hpp"
#include "tools/bench/bench_util.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace fp8rl::bench;

namespace {

fs::path self_dir() {
  char b[4096];
  const ssize_t n = readlink("/proc/self/exe", b, sizeof b - 1);
  if (n <= 0) throw std::runtime_error("cannot find my own path");
  b[n] = 0;
  return fs::path(b).parent_path();
}

std::vector<json> run_train(const std::string& cmd, const fs::path& run_dir) {
  fs::remove_all(run_dir);
  // audit mode off: the runs measure the training system (the health gates then read staleness 0),
  // as the numbers recorded before audit mode was on by default did
  const int rc = std::system((cmd + " --audit.every=0 --run-dir " + run_dir.string() + " > " + (run_dir.string() + ".log") +
                              " 2>&1").c_str());
  if (rc != 0) throw std::runtime_error("command failed (" + std::to_string(rc) + "): " + cmd + " (log: " + run_dir.string() + ".log)");
  std::vector<json> m;
  std::ifstream f(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) m.push_back(json::parse(line));
  return m;
}

double median_of(const std::vector<json>& m, const char* key, size_t skip) {
  std::vector<double> v;
  for (size_t i = skip; i < m.size(); ++i)
    if (m[i].contains(key) && m[i][key].is_number()) v.push_back(m[i][key].get<double>());
  return bench_median_of(std::move(v));
}

// Steady-state samples/s: samples done between report `skip` (warm-up and pipeline fill before
// it) and the second-to-last report (the last step also runs the final evaluation and checkpoint),
// over the wall time between them. Cumulative samples at report i = samples_per_s * elapsed_s.
double steady_samples_per_s(const std::vector<json>& m, size_t skip) {
  if (m.size() < skip + 3) throw std::runtime_error("too few steps for a steady-state rate");
  auto done = [&](size_t i) { return m[i]["samples_per_s"].get<double>() * m[i]["elapsed_s"].get<double>(); };
  const size_t e = m.size() - 2;
  return (done(e) - done(skip)) / (m[e]["elapsed_s"].get<double>() - m[skip]["elapsed_s"].get<double>());
}

void system_checked(const std::string& cmd) {
  if (const int rc = std::system(cmd.c_str()); rc != 0) throw std::runtime_error("command failed (" + std::to_string(rc) + "): " + cmd);
}

// --target: an accuracy in (0, 1); anything else ends the program with status 2
double target_parse(const bench_args& a) {
  const auto it = a.extra.find("target");
  if (it == a.extra.end()) return 0.9;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (it->second.empty() || used != it->second.size() || !(v > 0 && v < 1)) {
    std::fprintf(stderr, "option --target: '%s' is not an accuracy in (0, 1)\n", it->second.c_str());
    std::exit(2);
  }
  return v;
}

std::string jnum_or_null(const std::vector<double>& v) { return v.empty() ? "null" : jnum(bench_median_of(v)); }

// 4. anchors.md §3.8 (no peer reports FP8 rollout + FP8 training + async against a synchronous
//    BF16 baseline at matched reward): bf16 and fp8-e2e, each synchronous (max_staleness 0) and
//    asynchronous (1), from one SFT checkpoint (BF16 training), repetition r's four runs with seed
//    r + 1 (with one seed the synchronous runs repeat one trajectory: medians of one). Per run: the wall
//    time (evaluations included, the same cadence in all) until greedy validation accuracy
//    averaged over 3 consecutive evaluations reaches `target`, and the accuracy it ends at (mean
//    of its last 5 evaluations). Repetitions rotate the order of the four runs; each speedup is
//    the median of per-repetition ratios to that repetition's BF16 synchronous run.
void matched_reward(const bench_args& a, double target, const fs::path& bin, const fs::path& src, const fs::path& work) {
  const int reps = a.quick ? 1 : a.reps;
  const size_t window = 3, last = 5;
  const fs::path init = work / "init";
  fs::remove_all(init);
  system_checked((bin / "fp8rl").string() + " sft --out " + init.string() + " --policy bf16 --log-level warn > " +
                 (work / "sft.log").string() + " 2>&1");
  const std::string eval_out = (work / "start_eval.json").string();
  system_checked((bin / "fp8rl").string() + " eval --model " + init.string() + " --n 200 --policy bf16 > " + eval_out);
  const double start_acc = fp8rl::models::json_file_read(eval_out).at("greedy_accuracy").get<double>();
  if (start_acc >= target)  // every run "reaches" it at its third evaluation: a race of nothing
    std::fprintf(stderr, "bench-rl: matched_reward: the SFT checkpoint already has accuracy %.3f >= --target=%g\n", start_acc, target);
  struct config {
    const char* recipe;
    int staleness;
  };
  const config cfgs[] = {{"bf16", 0}, {"bf16", 1}, {"fp8-e2e", 0}, {"fp8-e2e", 1}};  // [0]: the baseline
  std::vector<double> t[4], steps[4], fin[4], sps[4], speed[4], thr[4], dacc[4];
  for (int r = 0; r < reps; ++r) {
    std::optional<double> rep_t[4];
    double rep_sps[4] = {}, rep_fin[4] = {};
    for (int i = 0; i < 4; ++i) {
      const int c = (r + i) % 4;
      const std::string cmd = (bin / "fp8rl").string() + " train --recipe " + (src / "configs/recipes").string() + "/" + cfgs[c].recipe +
                              ".conf --topology " + (src / "configs/topologies/local.conf").string() + " --model.init=" + init.string() +
                              " --run.steps=" + (a.quick ? "60" : "200") + " --run.eval_every=10 --run.checkpoint_every=0" +
                              " --trace.enabled=false --async.max_staleness=" + std::to_string(cfgs[c].staleness) +
                              " --run.seed=" + std::to_string(r + 1);  // a seed per repetition, the same for its four runs
      const auto m = run_train(cmd, work / ("matched_" + std::to_string(c)));
      const auto curve = curve_of(m);
      rep_fin[c] = curve_final(curve, last);
      fin[c].push_back(rep_fin[c]);
      rep_sps[c] = m.back()["samples_per_s"].get<double>();
      sps[c].push_back(rep_sps[c]);
      if (const auto p = curve_reach(curve, target, window)) {
        rep_t[c] = p->elapsed_s;
        t[c].push_back(p->elapsed_s);
        steps[c].push_back(p->step);
      }
    }
    for (int c = 0; c < 4; ++c) {
      if (rep_t[0] && rep_t[c]) speed[c].push_back(*rep_t[0] / *rep_t[c]);
      thr[c].push_back(rep_sps[c] / rep_sps[0]);
      dacc[c].push_back(rep_fin[c] - rep_fin[0]);
    }
  }
  for (int c = 0; c < 4; ++c)
    bench_emit(a, {{"bench", jstr("rl")}, {"impl", jstr("matched_reward")}, {"recipe", jstr(cfgs[c].recipe)},
                   {"max_staleness", jnum(cfgs[c].staleness)}, {"target_accuracy", jnum(target)}, {"start_accuracy", jnum(start_acc)},
                   {"runs", jnum(reps)}, {"runs_reaching_target", jnum(double(t[c].size()))},
                   {"time_to_target_s", jnum_or_null(t[c])}, {"steps_to_target", jnum_or_null(steps[c])},
                   {"speedup_to_target_vs_bf16_sync", jnum_or_null(speed[c])},  // over repetitions where both reached it
                   {"speedup_runs", jnum(double(speed[c].size()))},
                   {"speedup_min", speed[c].empty() ? "null" : jnum(*std::min_element(speed[c].begin(), speed[c].end()))},
                   {"speedup_max", speed[c].empty() ? "null" : jnum(*std::max_element(speed[c].begin(), speed[c].end()))},
                   {"final_accuracy", jnum(bench_median_of(fin[c]))},
                   {"final_accuracy_delta_vs_bf16_sync", jnum(bench_median_of(dacc[c]))},  // per repetition, as the speedups
                   {"samples_per_s_whole_run", jnum(bench_median_of(sps[c]))},
                   {"throughput_vs_bf16_sync", jnum(bench_median_of(thr[c]))}});
}

// Every selected part; throws (a run that failed names its log in `work`).
void bench_run(const bench_args& a, double target, const fs::path& bin, const fs::path& src, const fs::path& work) {
  // 60 steps, the first 5 skipped: 30-step runs (25 measured steps, ~1 s) swung 1.56-1.81x
  // on this shared machine, a transient of ~40 ms in one run moving the ratio by 4%
  const std::string steps = a.quick ? "10" : "60";
  const size_t skip = a.quick ? 2 : 5;
  // Tracing off for the loop's own speed: the message-level trace records ~40k events/s at this
  // tiny model's rate (~1 us each), a cost of its own, measured in part 3 (trace_cost).
  const std::string base = " --run.steps=" + steps + " --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=100";
  const std::string common = base + " --trace.enabled=false";
  // 1. samples/s vs staleness, each repetition one run of k = 0, 1, 2 (the order rotating from one
  //    repetition to the next, so no k always runs first) so that each ratio compares runs minutes
  //    apart at most; medians over repetitions
  if (bench_selected(a, "staleness")) {
    const int reps = a.quick ? 1 : a.reps;
    std::map<int, std::vector<double>> sps, ratio, calib, train, whole, idle;
    std::vector<double> bound;
    for (int r = 0; r < reps; ++r) {
      for (int i = 0; i < 3; ++i) {
        const int k = (r + i) % 3;
        const auto m = run_train((bin / "fp8rl").string() + " train --topology " + (src / "configs/topologies/local.conf").string() +
                                     common + " --async.max_staleness=" + std::to_string(k),
                                 work / ("staleness" + std::to_string(k)));
        sps[k].push_back(steady_samples_per_s(m, skip));
        whole[k].push_back(m.back()["samples_per_s"].get<double>());
        calib[k].push_back(median_of(m, "calibration_s", skip));
        train[k].push_back(median_of(m, "train_s", skip));
        idle[k].push_back(median_of(m, "rollout_idle_s", skip));
        if (k == 0) {  // a synchronous step = the learner's step + the rest (generation, sync, ...)
          const json& last = m.back();
          const double per_step = last["samples_per_s"].get<double>() * last["elapsed_s"].get<double>() / last["step"].get<double>();
          const double step_s = per_step / sps[0].back();
          bound.push_back(step_s / std::max(train[0].back(), step_s - train[0].back()));  // (rest + train) / max(rest, train)
        }
      }
      for (int k : {1, 2}) ratio[k].push_back(sps[k].back() / sps[0].back());  // this repetition's runs
    }
    for (int k : {0, 1, 2}) {
      const double c = bench_median_of(calib[k]), t = bench_median_of(train[k]);
      std::vector<std::pair<std::string, std::string>> f = {
          {"bench", jstr("rl")}, {"impl", jstr("staleness")}, {"max_staleness", jnum(k)},
          {"samples_per_s", jnum(bench_median_of(sps[k]))}, {"samples_per_s_whole_run", jnum(bench_median_of(whole[k]))},
          {"steps", jnum(std::stod(steps))}, {"runs", jnum(reps)}, {"calibration_s", jnum(c)}, {"learner_step_s", jnum(t)},
          {"calibration_pct_of_step", jnum(t > 0 ? 100.0 * c / t : 0.0)},
          {"rollout_idle_s", jnum(bench_median_of(idle[k]))}};  // generation's wait per step
      if (k > 0) {  // the gain over synchronous (median of per-repetition ratios, and their range),
                    // and what perfect overlap would give
        const auto [lo, hi] = std::minmax_element(ratio[k].begin(), ratio[k].end());
        f.push_back({"speedup_vs_sync", jnum(bench_median_of(ratio[k]))});
        f.push_back({"speedup_min", jnum(*lo)});
        f.push_back({"speedup_max", jnum(*hi)});
        f.push_back({"overlap_bound", jnum(bench_median_of(bound))});
      }
      bench_emit(a, f);
    }
  }
  // 3. what tracing costs the asynchronous run (max_staleness 1): on/off alternated, medians
  if (bench_selected(a, "trace_cost")) {
    const int reps = a.quick ? 1 : a.reps;
    std::vector<double> on, off, ratio;
    for (int r = 0; r < reps; ++r) {
      for (bool tr : {false, true}) {
        const std::string cmd = (bin / "fp8rl").string() + " train --topology " + (src / "configs/topologies/local.conf").string() +
                                base + " --async.max_staleness=1 --trace.enabled=" + (tr ? "true" : "false");
        const auto m = run_train(cmd, work / (tr ? "trace_on" : "trace_off"));
        (tr ? on : off).push_back(steady_samples_per_s(m, skip));
      }
      ratio.push_back(on.back() / off.back());
    }
    bench_emit(a, {{"bench", jstr("rl")}, {"impl", jstr("trace_cost")}, {"max_staleness", jnum(1)},
                   {"samples_per_s_trace_on", jnum(bench_median_of(on))}, {"samples_per_s_trace_off", jnum(bench_median_of(off))},
                   {"on_over_off", jnum(bench_median_of(ratio))}, {"runs", jnum(reps)}});
  }
  if (bench_selected(a, "matched_reward")) matched_reward(a, target, bin, src, work);
  // 2. bundle sync latency and MB/s, FP8 vs BF16, in process and across processes
  if (bench_selected(a, "sync")) {
    const int port = 43000 + ::getpid() % 5000;
    fp8rl::models::file_write_checked(
        (work / "two.conf").string(),
        "[cluster]\nnodes=[{name=\"main\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", \"reward\", "
        "\"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[]},\n{name=\"gen\", host=\"127.0.0.1\", port=" +
            std::to_string(port) + ", roles=[], learners=[], rollouts=[\"cpu:1\"]}]\n");
    fp8rl::models::file_write_checked((work / "hosts").string(), "127.0.0.1 slots=2\n");
    const std::string small = " --model.size=small --model.sft_steps=0 --run.steps=6 --run.eval_every=0"
                              " --run.checkpoint_every=0 --rollout.prompts_per_step=4 --rollout.group_size=2"
                              " --task.train_size=200";
    for (const char* prec : {"fp8", "bf16"}) {
      for (bool cross : {false, true}) {
        const std::string pol = std::string(" --precision.generation=") + prec + " --precision.training=" + prec;
        const std::string cmd = cross ? (bin / "caf-run").string() + " --hostfile " + (work / "hosts").string() + " --topology " +
                                            (work / "two.conf").string() + " -- " + (bin / "fp8rl").string() + " train" + small + pol
                                      : (bin / "fp8rl").string() + " train" + small + pol;
        const auto m = run_train(cmd, work / (std::string("sync_") + prec + (cross ? "_cross" : "_local")));
        const double lat = median_of(m, "sync_latency_s", 1), bytes = median_of(m, "sync_bytes", 1);
        const double xfer = cross ? median_of(m, "sync_transfer_s", 1) : 0.0;
        std::vector<std::pair<std::string, std::string>> f = {
            {"bench", jstr("rl")}, {"impl", jstr("bundle_sync")}, {"bundle", jstr(prec)},
            {"transport", jstr(cross ? "cross_process" : "in_process")}, {"bytes", jnum(bytes)},
            {"median_latency_s", jnum(lat)}, {"mb_per_s", jnum(lat > 0 ? bytes / lat / 1e6 : 0.0)}};
        if (cross) {
          f.push_back({"median_transfer_s", jnum(xfer)});
          f.push_back({"transfer_mb_per_s", jnum(xfer > 0 ? bytes / xfer / 1e6 : 0.0)});
        }
        f.push_back({"note", jstr("latency = publish -> adopted (transfer + deserialize + engine prepare); transfer = chunks only")});
        bench_emit(a, f);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench_args a = bench_parse(argc, argv, {{"target", "matched_reward's greedy validation accuracy to reach (default 0.9)"}},
                             {.threads = false, .max_reps = 5});  // a repetition: whole runs
  const double target = target_parse(a);  // before any run (a typo found minutes in)
  const fs::path bin = self_dir(), work = fs::temp_directory_path() / ("fp8rl_bench_rl_" + std::to_string(::getpid()));
  const fs::path src = bin.parent_path().parent_path();  // repository root (build/bin/..)
  if (!fs::exists(src / "configs/topologies/local.conf")) {  // a copied binary: its runs would fail one by one
    std::fprintf(stderr, "bench-rl: %s not found: run it from the build tree (build/bin/bench-rl)\n",
                 (src / "configs/topologies/local.conf").c_str());
    return 2;
  }
  fs::create_directories(work);
  try {
    bench_run(a, target, bin, src, work);
  } catch (const std::exception& e) {  // (an uncaught one aborted, leaving the directory unnamed)
    std::fprintf(stderr, "bench-rl: %s; its runs' files are kept in %s\n", e.what(), work.c_str());
    return 1;
  }
  fs::remove_all(work);
  return 0;
}
