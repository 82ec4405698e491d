// tests/actors/e2e_test.cpp -- the whole system as users run it, one process: the embedded
// default for a few steps (+ --resume), bad input at a start refused, model directories, an
// interrupted --overwrite, a signal stopping a run at a checkpointed step, max_staleness = 0
// reproducing the synchronous loop's metrics bit for bit (with the KL penalty), the AMX tiles
// recipe. Several processes (caf-run, loopback nodes, supervision): e2e_processes_test.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "actors/recipe.hpp"
#include "models/checkpoint.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/params.hpp"
#include "models/rl/loop.hpp"
#include "quant/gemm.hpp"
#include "tests/actors/e2e_util.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::test::e2e;

TEST(E2E, EmbeddedDefaultRunsAndResumes) {
  const fs::path d = fresh_dir("default");
  const auto first = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + d.string() + kSmall);
  ASSERT_EQ(first.rc, 0) << first.out;
  EXPECT_NE(first.out.find("step    4/4  reward"), std::string::npos) << first.out;  // a progress line per step
  auto m = metrics(d);
  ASSERT_EQ(m.size(), 4u);
  for (size_t i = 0; i < m.size(); ++i) {
    EXPECT_EQ(m[i]["step"], i + 1);
    for (const char* k : {"token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
                          "sampling_importance_ratio", "is_oob_ratio", "is_ess", "rollout_idle_s", "reward_mean", "accuracy", "clip_fraction",
                          "staleness_hist/0", "staleness_hist/1", "seq_mult_prob_error_max_after_mask", "masked_correct_pct"})
      EXPECT_TRUE(m[i].contains(k)) << k;
  }
  EXPECT_EQ(m[0]["staleness_hist/1"], 0.0);  // every bin up to max_staleness, the empty ones too
  double lag = 0;
  for (const auto& [k, v] : m[1].items()) lag += k.rfind("scale_lag_hist/", 0) == 0 ? v.get<double>() : 0.0;
  EXPECT_EQ(lag, m[1]["tokens"].get<double>());  // every token counted by its scale-version lag
  EXPECT_TRUE(m[1].contains("val_accuracy"));
  EXPECT_TRUE(m[3].contains("val_accuracy"));
  // the calibration actor's calib_report: each calibrated version once, with its time
  std::set<double> calibrated;
  for (const auto& x : m)
    if (x.contains("calibration_version")) {
      EXPECT_TRUE(calibrated.insert(x["calibration_version"].get<double>()).second) << x.dump();
      EXPECT_GT(x["calibration_s"].get<double>(), 0.0) << x.dump();
      EXPECT_GE(x["fp8_weights_flushed"].get<double>(), 0.0) << x.dump();  // counts: tests/actors/protocol_sync_test.cpp
      EXPECT_LT(x["fp8_weights_flushed_worst_block"].get<double>(), fp8rl::models::kFlushWarnFraction) << x.dump();
    }
  EXPECT_GE(calibrated.size(), 2u);
  EXPECT_TRUE(fs::exists(d / "checkpoints" / "step_4" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(d / "checkpoints" / "step_4" / "optimizer.safetensors"));
  EXPECT_TRUE(fs::exists(d / "plots" / "reward.png"));
  EXPECT_TRUE(fs::exists(d / "traces" / "local.jsonl"));
  {  // a message for a step carries the step; a group also the oldest versions its tokens were sampled
     // under, within the staleness window (default 1) -- not the step in the version's place
    std::ifstream in(d / "traces" / "local.jsonl");
    int groups = 0, work = 0;
    for (std::string l; std::getline(in, l);) {
      const json e = json::parse(l);
      const std::string name = e["name"];
      if (name == "work_msg" || name == "batch_msg" || name == "admitted_msg") {
        EXPECT_TRUE(e.contains("step") && !e.contains("wv")) << l;
        work += name == "work_msg";
      }
      if (name != "group_msg") continue;
      ++groups;
      ASSERT_TRUE(e.contains("step") && e.contains("wv") && e.contains("sv")) << l;
      EXPECT_LE(e["wv"].get<int64_t>(), e["step"].get<int64_t>()) << l;
      EXPECT_GE(e["wv"].get<int64_t>(), e["step"].get<int64_t>() - 1) << l;
    }
    EXPECT_EQ(work, 2 * 4 * 8) << "a work_msg send and receive per group of the 4 steps";
    EXPECT_GT(groups, 0);
  }
  // --resume continues from checkpoints/latest (step 4) to step 6, and the prompt sequence from
  // the checkpoint's cursor (4 x 8 prompts) also with another prompts_per_step: 32 + 2 x 4
  auto cursor = [&](int step) {
    std::ifstream f(d / "checkpoints" / ("step_" + std::to_string(step)) / "state.json");
    return nlohmann::json::parse(f)["prompt_cursor"].get<int>();
  };
  EXPECT_EQ(cursor(4), 32);
  // the first part killed mid-write: a torn last line, which the resumed process ends before its
  // own events (its first event was glued to it), and the trace tool skips as the first part's last
  const std::string fragment = "{\"node\":\"local\",\"act";
  std::ofstream(d / "traces" / "local.jsonl", std::ios::app) << fragment;
  // progress lines are info: log_level warn keeps warnings and errors only (they printed at every level)
  const auto resumed = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string() + kSmall +
                                                " --run.steps=6 --rollout.prompts_per_step=4 --run.log_level=warn");
  ASSERT_EQ(resumed.rc, 0) << resumed.out;
  EXPECT_EQ(resumed.out.find("step    5/6"), std::string::npos) << resumed.out;
  {
    std::ifstream in(d / "traces" / "local.jsonl");
    bool alone = false;
    for (std::string l; std::getline(in, l);) alone = alone || l == fragment;
    EXPECT_TRUE(alone) << "the resumed process's first event was appended to the torn line";
  }
  const auto summary = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + d.string());
  EXPECT_EQ(summary.rc, 0) << summary.out;
  EXPECT_NE(summary.out.find("local.jsonl"), std::string::npos) << summary.out;
  EXPECT_NE(summary.out.find("skipping a torn last line"), std::string::npos) << summary.out;
  m = metrics(d);
  ASSERT_EQ(m.size(), 6u);
  EXPECT_EQ(m[4]["step"], 5);
  EXPECT_EQ(m[5]["step"], 6);
  // throughput counts this process's steps: 2 steps x 4 prompts x 8 completions since the resume
  // at 4 (the first part's: 4 x 8 x 8); rates recomputed from the row's own elapsed_s
  auto samples = [](const json& row) { return row["samples_per_s"].get<double>() * row["elapsed_s"].get<double>(); };
  EXPECT_NEAR(samples(m[3]), 256.0, fp8rl::tol::kFp64TwoRoundingsRel * 256.0);
  EXPECT_NEAR(samples(m[5]), 64.0, fp8rl::tol::kFp64TwoRoundingsRel * 64.0);
  EXPECT_EQ(cursor(6), 40);
  {  // the first part's recipe.conf stays; the resumed part's other batch is recorded beside it
    std::ifstream first(d / "recipe.conf"), second(d / "resumes" / "recipe-step4.conf");
    const std::string a((std::istreambuf_iterator<char>(first)), {}), b((std::istreambuf_iterator<char>(second)), {});
    EXPECT_EQ(a.find("prompts_per_step=4\n"), std::string::npos) << a;
    EXPECT_NE(b.find("prompts_per_step=4\n"), std::string::npos) << b;
  }
  // --resume with no recipe options continues with the run's own settings, the newest part's (the
  // first command's model.sft_steps and task.val_size were asked for again: "records another task,
  // model or seed"; the second part's prompts_per_step would have gone back to the default)
  const auto bare = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string() + " --run.steps=7");
  ASSERT_EQ(bare.rc, 0) << bare.out;
  EXPECT_EQ(bare.out.find("step    7/7"), std::string::npos) << bare.out;  // the part's log_level=warn, kept
  // --dump-config with --resume shows what a resume runs with (it showed the defaults)
  const auto shown = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string() + " --dump-config --run.steps=9");
  EXPECT_NE(shown.out.find("prompts_per_step=4\n"), std::string::npos) << shown.out;
  EXPECT_NE(shown.out.find("steps=9\n"), std::string::npos) << shown.out;
  ASSERT_EQ(metrics(d).size(), 7u);
  EXPECT_EQ(cursor(7), 44);  // 40 + 4: the second part's prompts_per_step
  EXPECT_NE(text_of(d / "resumes" / "recipe-step6.conf").find("steps=7\n"), std::string::npos);  // this part's, recorded
  // a resume at step 7 that failed left its settings (prompts_per_step=2): the next resume takes the
  // settings of the part that made step_7 (resumed at 6), and records its own over the failed one's
  std::string failed = text_of(d / "resumes" / "recipe-step6.conf");
  failed.replace(failed.find("prompts_per_step=4\n"), 19, "prompts_per_step=2\n");
  std::ofstream(d / "resumes" / "recipe-step7.conf") << failed;
  const auto again = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string() + " --run.steps=8 --run.log_level=info");
  ASSERT_EQ(again.rc, 0) << again.out;
  EXPECT_NE(again.out.find("run finished: 1 steps (8..8, resumed at 7) in "), std::string::npos) << again.out;  // it said "8 steps"
  EXPECT_EQ(cursor(8), 48);  // 44 + 4, not + 2
  EXPECT_NE(text_of(d / "resumes" / "recipe-step7.conf").find("prompts_per_step=4\n"), std::string::npos);
  fs::remove_all(d);
}

// Bad input fails before any actor starts, naming the file, and changes nothing: a task file with
// a broken line (it used to hang the run), a state.json that is not JSON or contradicts its step
// directory, settings the start checkpoint cannot run, another task on --resume.
TEST(E2E, BadInputAtAStartIsRefusedAndChangesNothing) {
  const fs::path d = fresh_dir("bad_start");
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + d.string() + kSmall), 0);
  ASSERT_EQ(run(kBin + "/fp8rl train --resume --run-dir " + d.string() + kSmall + " --run.steps=6"), 0);
  const std::string recipe = text_of(d / "recipe.conf"), before = text_of(d / "metrics.jsonl");
  std::ofstream(d / "bad.jsonl") << "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{bad\n";
  fails_naming("--run-dir " + (d / "other").string() + " --task.name=" + (d / "bad.jsonl").string() + " --model.init=" +
                   (d / "checkpoints" / "step_6").string() + kSmall,
               "bad.jsonl:2");
  // a context the start checkpoint's positions do not cover: each rollout's engine refused it and
  // was restarted until none was left
  fails_naming("--run-dir " + (d / "other").string() + " --model.init=" + (d / "checkpoints" / "step_6").string() + kSmall +
                   " --model.max_context=65",
               "model.max_context = 65 exceeds");  // the tiny model's positions: 64, which is accepted
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "ctx64").string() + " --model.init=" + (d / "checkpoints" / "step_6").string() +
                " --model.max_context=64 --run.steps=1 --run.eval_every=0 --model.sft_steps=0"),
            0);
  // layers kept BF16 beyond the model's (every rollout refused its bundle at the first step)
  fails_naming("--run-dir " + (d / "other").string() + " --model.init=" + (d / "checkpoints" / "step_6").string() + kSmall +
                   " --precision.bf16_first=5",
               "precision.bf16_first/bf16_last (5, 0) exceed " + (d / "checkpoints" / "step_6").string() + "/config.json's 2 layers");
  // a resumed run's changed settings are checked against its task again
  fails_naming("--resume --run-dir " + d.string() + " --run.steps=9 --rollout.max_new_tokens=40", "do not fit model.max_context 32");
  EXPECT_EQ(text_of(d / "metrics.jsonl"), before);
  {  // the checkpoint's calibration batch with a token id one past the vocabulary (its embedding row)
    std::string step = text_of(d / "checkpoints" / "latest");
    step.erase(step.find_last_not_of('\n') + 1);
    const fs::path ck = d / "checkpoints" / step, calib = ck / "calibration.jsonl";
    const std::string kept = text_of(calib);
    const int64_t vocab = json::parse(text_of(ck / "config.json"))["vocab_size"].get<int64_t>();
    std::ofstream(calib) << json{{"tokens", {1, vocab}}}.dump() << "\n";
    fails_naming("--resume --run-dir " + d.string() + " --run.steps=9",
                 "calibration.jsonl: token id " + std::to_string(vocab) + " is outside the vocabulary (" + std::to_string(vocab) + ")");
    std::ofstream(calib) << kept;
    EXPECT_EQ(text_of(d / "metrics.jsonl"), before);
  }
  fails_naming("--run-dir " + (d / "other").string() + " --model.init=" + (d / "checkpoints" / "step_6").string() + kSmall +
                   " --precision.bf16_last=5",
               "precision.bf16_first/bf16_last (0, 5) exceed " + (d / "checkpoints" / "step_6").string() + "/config.json's 2 layers");
  // --overwrite whose new run fails its preflight: the earlier run is moved back (it was deleted first)
  const fs::path init = d.string() + "-init";
  fs::copy(d / "checkpoints" / "step_6", init, fs::copy_options::recursive);
  fails_naming("--overwrite --run-dir " + d.string() + " --task.name=" + (d / "bad.jsonl").string() +
                   " --model.init=" + init.string() + kSmall,
               "bad.jsonl:2");
  EXPECT_TRUE(fs::exists(d / "checkpoints" / "step_4" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(d / ".replaced"));
  // ... and one that passes its preflight but fails at its first step (a weight of 3e38 overflows
  // the activations): the earlier run is kept until the new one records a step (it was deleted
  // once the preflight passed)
  {
    auto p = fp8rl::models::checkpoint_load(init.string()).params;
    p.get("model.layers.1.mlp.up_proj.weight")[0] = 3e38f;
    fp8rl::models::model_save(init.string(), p);
  }
  const std::string earlier = text_of(d / "metrics.jsonl");
  const auto first_step = fp8rl::test::run_command(kBin + "/fp8rl train --overwrite --run-dir " + d.string() +
                                                   " --model.init=" + init.string() + kSmall);
  EXPECT_EQ(first_step.rc, 1) << first_step.out;
  EXPECT_NE(first_step.out.find("the new run did not record a step; the earlier run in " + d.string() + " is back"),
            std::string::npos) << first_step.out;
  EXPECT_EQ(text_of(d / "metrics.jsonl"), earlier);
  EXPECT_TRUE(fs::exists(d / "checkpoints" / "step_6" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(d / ".replaced"));
  fs::remove_all(init);
  // checkpoints/latest naming a path out of the run, or a checkpoint that is not there
  std::ofstream(d / "checkpoints" / "latest") << "../../elsewhere/step_1\n";
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "latest names '../../elsewhere/step_1', not a checkpoint");
  std::ofstream(d / "checkpoints" / "latest") << "step_6 junk\n";
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "latest holds more than one checkpoint name ('step_6', 'junk')");
  std::ofstream(d / "checkpoints" / "latest") << "step_9\n";
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "latest names 'step_9', which is not a checkpoint directory in");
  std::ofstream(d / "checkpoints" / "latest") << "step_6\n";
  const fs::path state = d / "checkpoints" / "step_6" / "state.json";
  std::ofstream(state) << "{bad";
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "state.json: not valid JSON");
  std::ofstream(state) << nlohmann::json{{"weight_version", 5}}.dump();
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "contradicts its directory step_6");
  std::ofstream(state) << nlohmann::json{{"weight_version", 6}}.dump();
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "state.json: key 'prompt_cursor'");
  fails_naming("--run-dir " + d.string() + kSmall, "holds an earlier run");  // a new run truncated metrics.jsonl
  std::ofstream(state) << nlohmann::json{{"weight_version", 6}, {"prompt_cursor", 40}}.dump();
  // another task on resume trained on it from the old task's prompt cursor, and rewrote recipe.conf
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8 --task.name=builtin:add1",
               "records another task, model, seed or run name (give the run's own):\n  task.name: \"builtin:add2\" -> \"builtin:add1\"");
  EXPECT_EQ(text_of(d / "recipe.conf"), recipe);  // a failed resume rewrote it with this invocation's recipe
  EXPECT_EQ(text_of(d / "metrics.jsonl"), before);
  const std::string refused = "records another task, model, seed or run name (give the run's own):\n  ";
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8 --run.seed=7", refused + "run.seed: 1 -> 7");  // the seed too
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8 --model.max_context=48", refused + "model.max_context: 32 -> 48");
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8 --run.name=renamed", refused + "run.name: ");
  {  // a kept metrics row the controller cannot read back (health gates): named, nothing changed
    const std::string kept = text_of(d / "metrics.jsonl"), kept_state = text_of(state);
    std::ofstream(state) << nlohmann::json{{"weight_version", 6}, {"prompt_cursor", 40}, {"adam_step", 6}}.dump();
    std::ofstream(d / "metrics.jsonl") << "{\"step\":-1}\n" << kept.substr(kept.find('\n') + 1);
    const std::string bad_rows = text_of(d / "metrics.jsonl");
    fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8", "metrics.jsonl:1: not a metrics row");
    EXPECT_EQ(text_of(d / "metrics.jsonl"), bad_rows);
    EXPECT_FALSE(fs::exists(d / "resumes" / "recipe-step6.conf"));  // refused before the start (the controller would fail it later)
    std::ofstream(d / "metrics.jsonl") << kept;
    std::ofstream(state) << kept_state;
  }
  // a resume to the step the run is at has nothing to do: said, rc 0, nothing written
  const auto at_end = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string() + kSmall + " --run.steps=6");
  EXPECT_EQ(at_end.rc, 0) << at_end.out;
  EXPECT_NE(at_end.out.find("is already at step 6 of 6"), std::string::npos) << at_end.out;
  EXPECT_EQ(text_of(d / "metrics.jsonl"), before);
  // no checkpoints/latest: the refusal names the newest step directory (by number: step_10 > step_6)
  fs::rename(d / "checkpoints" / "latest", d / "latest.away");
  fs::create_directory(d / "checkpoints" / "step_10");
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=12",
               "no checkpoints/latest (yet " + (d / "checkpoints" / "step_10").string() + " is there");
  fs::remove(d / "checkpoints" / "step_10");
  fs::rename(d / "latest.away", d / "checkpoints" / "latest");
  // without recipe.conf nothing checks the task, model and seed: the resume trained another task
  // from this one's cursor and recorded it as the run's recipe
  fs::rename(d / "recipe.conf", d / "recipe.conf.away");
  fails_naming("--resume --run-dir " + d.string() + kSmall + " --run.steps=8 --task.name=builtin:add1",
               "recipe.conf is missing: the run's task, model and seed cannot be checked");
  EXPECT_FALSE(fs::exists(d / "recipe.conf"));
  EXPECT_EQ(text_of(d / "metrics.jsonl"), before);
  fs::remove_all(d);
}

// A model directory (a Hugging Face download: no state.json, no optimizer) starts a run; one with
// optimizer moments but no state.json is refused, naming it (the run said "not a training
// checkpoint" for both). A resume checks what it reads besides its checkpoint: the task file (the
// training set it records), the KL reference (its shape); answers no verifier can reward are refused.
TEST(E2E, ModelDirectoryStartsARunAndResumesCheckWhatTheyRead) {
  const fs::path d = fresh_dir("model_dir"), hf = d / "hf";
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "run").string() + kSmall), 0);
  fs::copy(d / "run" / "checkpoints" / "step_4", hf, fs::copy_options::recursive);
  fs::remove(hf / "state.json");
  fails_naming("--run-dir " + (d / "hf-run").string() + " --model.init=" + hf.string() + kSmall,
               (hf / "state.json").string() + ": missing (not a training checkpoint, yet optimizer.safetensors is there)");
  fs::remove(hf / "optimizer.safetensors");
  fs::remove(hf / "calibration.jsonl");
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "hf-run").string() + " --model.init=" + hf.string() + kSmall +
                " --run.steps=2"), 0);
  EXPECT_EQ(metrics(d / "hf-run").size(), 2u);
  EXPECT_TRUE(fs::exists(d / "hf-run" / "checkpoints" / "step_2" / "optimizer.safetensors"));
  // a task file changed under a run: --resume went on at the checkpoint's prompt cursor in other
  // prompts; the checkpoint records its training set and the resume is refused naming both (from
  // step 1: the first checkpoint that has one)
  const fs::path task = d / "task.jsonl", tr = d / "task-run";
  auto task_write = [&](int first) {
    std::ofstream t(task);
    for (int i = 0; i < 64; ++i) t << "{\"prompt\": \"" << first + i << "+1=\", \"answer\": \"" << first + i + 1 << "\"}\n";
  };
  task_write(10);
  const std::string task_args = " --run-dir " + tr.string() + " --model.init=" + hf.string() + kSmall + " --task.name=" + task.string();
  ASSERT_EQ(run(kBin + "/fp8rl train" + task_args + " --run.steps=1"), 0);
  task_write(11);  // one line fewer of the old, one new: same count, other prompts
  fails_naming("--resume" + task_args + " --run.steps=3",
               "--resume: the training set " + task.string() + " is not the one " + (tr / "checkpoints" / "step_1").string() +
                   " was trained on (64 examples, fingerprint ");
  task_write(10);
  ASSERT_EQ(run(kBin + "/fp8rl train --resume" + task_args + " --run.steps=3"), 0);
  EXPECT_EQ(metrics(tr).size(), 3u);
  // the KL reference (grpo.kl_beta > 0: the run's model.init) replaced by a model of another
  // shape under a run: the resume is refused before any actor starts, naming it
  const fs::path ref = d / "kl-ref";
  fs::copy(hf, ref, fs::copy_options::recursive);
  const std::string kl_args = " --run-dir " + (d / "kl-run").string() + " --model.init=" + ref.string() + kSmall + " --grpo.kl_beta=0.05";
  ASSERT_EQ(run(kBin + "/fp8rl train" + kl_args + " --run.steps=1"), 0);
  {
    auto c = fp8rl::models::model_config_load((ref / "config.json").string());
    c.num_hidden_layers = 1;
    fp8rl::models::model_save(ref.string(), fp8rl::models::model_params_init(c, 1));
  }
  fails_naming("--resume" + kl_args + " --run.steps=2",
               ref.string() + ": the KL reference (grpo.kl_beta > 0) does not have the shape of " + (d / "kl-run" / "checkpoints" / "step_1").string());
  // answers the numeric verifier reads as no number: none rewarded (they trained on reward 0)
  std::ofstream(d / "words.jsonl") << "{\"prompt\": \"1+1=\", \"answer\": \"two\"}\n{\"prompt\": \"2+2=\", \"answer\": \"four\"}\n";
  fails_naming("--run-dir " + (d / "words-run").string() + " --model.init=" + hf.string() + kSmall + " --task.name=" +
                   (d / "words.jsonl").string(),
               "2 of 2 training answers can never be rewarded (the first: " + (d / "words.jsonl").string() +
                   ":1, 'two', not a number under task.verifier = numeric): use task.verifier = exact");
  std::ofstream(tr / "checkpoints" / "step_2" / "state.json")
      << nlohmann::json{{"weight_version", 2}, {"prompt_cursor", 16}, {"adam_step", 2}, {"train_set", 64}}.dump();
  std::ofstream(tr / "checkpoints" / "latest") << "step_2\n";
  fails_naming("--resume" + task_args + " --run.steps=3", "state.json: key 'train_set' must be {\"examples\": N");
  std::ofstream(tr / "checkpoints" / "step_2" / "state.json")
      << nlohmann::json{{"weight_version", 2}, {"prompt_cursor", 16}, {"adam_step", 2},
                        {"train_set", {{"examples", "x"}, {"fingerprint", "ab"}}}}.dump();
  fails_naming("--resume" + task_args + " --run.steps=3", "state.json: key 'train_set' must be {\"examples\": N");
  // a model directory whose tokenizer has more tokens than the model's vocabulary, and BF16
  // names that match no layer of it: refused before the run, naming the directory
  const fs::path wide = d / "wide-tok";
  fs::copy(hf, wide, fs::copy_options::recursive);
  std::ofstream(wide / "fp8rl-char-tokenizer.json") << "{\"alphabet\":\"0123456789+*=abcd\",\"type\":\"fp8rl-char\"}";
  fails_naming("--run-dir " + (d / "wide-run").string() + " --model.init=" + wide.string() + kSmall,
               wide.string() + ": the tokenizer has 20 tokens, the model's vocab_size (config.json) is 16");
  fails_naming("--run-dir " + (d / "names-run").string() + " --model.init=" + hf.string() + kSmall + " --precision.bf16_names=layers.5.",
               "precision.bf16_names: 'layers.5.' names no linear layer of " + hf.string() + "/config.json");
  fs::remove_all(d);
}

// --overwrite killed between moving the earlier run aside and passing its preflight (here: in
// its warm start) runs no destructor: the earlier run sits in RUN_DIR/.replaced. The next run
// that looks at the directory moves it back, so --resume continues it. SIGINT/SIGTERM are caught
// there and move it back at once.
TEST(E2E, KilledOverwriteStartGivesTheEarlierRunBack) {
  const fs::path d = fresh_dir("killed_overwrite");
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + d.string() + kSmall), 0);
  const std::string before = text_of(d / "metrics.jsonl");
  // an --overwrite start caught in its warm start by `sig`; returns its wait status
  auto interrupted_start = [&](int sig) {
    const std::string cmd = "exec " + kBin + "/fp8rl train --overwrite --run-dir " + d.string() + kSmall +
                            " --model.sft_steps=1000000 > /dev/null 2>&1";
    const pid_t pid = ::fork();
    if (pid == 0) exec_shell(cmd);
    // the stash moves recipe.conf, checkpoints, metrics.jsonl, traces, plots in that order; then the
    // warm start runs its 10^6 steps: a signal after plots/ has moved lands between stash and preflight
    for (int i = 0; i < 1200 && !fs::exists(d / ".replaced" / "plots"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ::kill(pid, sig);
    int st = 0;
    ::waitpid(pid, &st, 0);
    return st;
  };
  interrupted_start(SIGKILL);
  ASSERT_TRUE(fs::exists(d / ".replaced" / "metrics.jsonl")) << "the start was not caught between stash and preflight";
  EXPECT_FALSE(fs::exists(d / "metrics.jsonl"));
  ASSERT_EQ(run(kBin + "/fp8rl train --resume --run-dir " + d.string() + kSmall + " --run.steps=6"), 0);
  EXPECT_FALSE(fs::exists(d / ".replaced"));
  const std::string after = text_of(d / "metrics.jsonl");
  EXPECT_EQ(after.substr(0, before.size()), before);  // the earlier run's 4 steps, then 2 more
  EXPECT_EQ(metrics(d).size(), 6u);
  // Ctrl-C or SIGTERM (caught) gives the earlier run back at once, then ends the start with
  // 128 + signal, as a start without --overwrite does; it used to stay in .replaced/ until the
  // next train there, eval and generate failing meanwhile
  for (const int sig : {SIGTERM, SIGINT}) {
    const int st = interrupted_start(sig);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 128 + sig) << "wait status " << st;
    EXPECT_FALSE(fs::exists(d / ".replaced")) << sig;
    EXPECT_EQ(text_of(d / "metrics.jsonl"), after) << sig;
  }
  fs::remove_all(d);
}

// Ctrl-C (SIGINT) stops a run after the step in progress: learner0 checkpoints that step, the
// process exits 130 naming the checkpoint, and --resume goes on from it with no step lost or done
// twice (the signal's default action killed the run: the steps since the last checkpoint were
// redone). Two signals at once: the first asks for the stop, the second ends the process by its
// own action -- unless one came from the parent (caf-run passing on a signal the node also got).
TEST(E2E, SignalStopsTheRunAtACheckpointedStep) {
  const fs::path d = fresh_dir("sigstop");
  const std::string train = kBin + "/fp8rl train --run-dir " + (d / "run").string() +
                            " --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=20";
  // the stop's line naming the checkpoint is a warning: run.log_level=warn keeps it (it was info)
  const pid_t pid = start_until_two_steps(train + " --run.steps=100000 --run.log_level=warn", d);
  ASSERT_GT(pid, 0) << "the run did not start";
  ::kill(pid, SIGINT);
  const int st = wait_exit(pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 130) << st;
  const size_t n = metrics(d / "run").size();
  const std::string log = text_of(d / "log"), step = "step_" + std::to_string(n);
  EXPECT_EQ(text_of(d / "run" / "checkpoints" / "latest"), step + "\n") << log;
  EXPECT_NE(log.find("SIGINT, at step " + std::to_string(n) + " of 100000: " + (d / "run" / "checkpoints" / step).string() +
                     " is the latest checkpoint"),
            std::string::npos)
      << log;
  ASSERT_EQ(run(train + " --resume --run.steps=" + std::to_string(n + 2)), 0);
  const auto m = metrics(d / "run");
  ASSERT_EQ(m.size(), n + 2);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m[i]["step"], i + 1);
  const pid_t again = spawn_logged(train + " --resume --run.steps=100000", d);
  for (int i = 0; i < 600 && metrics_rows_so_far(d / "run") < n + 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(again, SIGSTOP);  // both signals pending together: neither is handled before the other is sent
  auto state = [&] { std::string f; std::ifstream(fs::path("/proc") / std::to_string(again) / "stat") >> f >> f >> f; return f; };
  for (int i = 0; i < 500 && state() != "T"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (metrics_rows_so_far(d / "run") < n + 4 || state() != "T") {  // not running yet, or not stopped: no test
    ::kill(again, SIGKILL);
    ::waitpid(again, nullptr, 0);
    FAIL() << "the resumed run did not get 2 steps in within 60 s, or did not stop";
  }
  // sent by a shell, not by this process (its parent): a parent's repeat within 2 s is one stop (caf-run's)
  ASSERT_EQ(std::system(("kill -s INT " + std::to_string(again) + " && kill -s TERM " + std::to_string(again)).c_str()), 0);
  ::kill(again, SIGCONT);
  const int st2 = wait_exit(again);
  EXPECT_TRUE(WIFSIGNALED(st2) && (WTERMSIG(st2) == SIGINT || WTERMSIG(st2) == SIGTERM)) << st2;
  EXPECT_NE(text_of(d / "log").find("a second signal: stopping at once"), std::string::npos) << text_of(d / "log");
  // output into a pipe whose reader goes: with a SIGINT first (`fp8rl train 2>&1 | tee log`, Ctrl-C
  // ends tee too), and alone (caf-run's ssh client gone): the run stops at a checkpointed step (the
  // next line written raised SIGPIPE and ended the run unsaved)
  auto piped_run = [&](int sig) {  // the wait status
    int pfd[2];
    if (::pipe(pfd) != 0) return -1;
    const std::string piped = "exec " + train + " --resume --run.steps=100000 --run.log_level=info";  // progress lines: the writes
    const pid_t teed = ::fork();
    if (teed == 0) {
      ::dup2(pfd[1], 1);
      ::dup2(pfd[1], 2);
      ::close(pfd[0]);
      ::close(pfd[1]);
      exec_shell(piped);
    }
    ::close(pfd[1]);
    ::fcntl(pfd[0], F_SETFL, O_NONBLOCK);
    const size_t rows = metrics_rows_so_far(d / "run");
    char drain[4096];
    for (int i = 0; i < 600 && metrics_rows_so_far(d / "run") < rows + 2; ++i) {
      while (::read(pfd[0], drain, sizeof drain) > 0) {}
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (sig) ::kill(teed, sig);
    ::close(pfd[0]);
    return wait_exit(teed);
  };
  for (const int sig : {SIGINT, 0}) {
    const int piped_st = piped_run(sig);
    EXPECT_TRUE(WIFEXITED(piped_st) && WEXITSTATUS(piped_st) == 128 + (sig ? sig : SIGPIPE)) << sig << ": " << piped_st;
    EXPECT_EQ(text_of(d / "run" / "checkpoints" / "latest"), "step_" + std::to_string(metrics(d / "run").size()) + "\n") << sig;
  }
  // a signal during the SFT warm start: the start is given up, said, with the signal's code (it died
  // in silence); nothing is left that would pass for an earlier run
  const fs::path sft = d / "sft";
  fs::create_directories(sft);
  const pid_t warm = spawn_logged(kBin + "/fp8rl train --run-dir " + (sft / "run").string() + " --model.sft_steps=100000000", sft);
  for (int i = 0; i < 600 && text_of(sft / "log").find("SFT warm start") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(warm, SIGTERM);
  const int warm_st = wait_exit(warm);
  EXPECT_TRUE(WIFEXITED(warm_st) && WEXITSTATUS(warm_st) == 143) << warm_st;
  EXPECT_NE(text_of(sft / "log").find("SIGTERM during the SFT warm start; nothing was trained or saved"), std::string::npos)
      << text_of(sft / "log");
  EXPECT_FALSE(fs::exists(sft / "run" / "recipe.conf"));
  // killed before its first checkpoint (SIGKILL, or a second signal): --resume starts the run
  // again from step 0 with its own settings (it was refused, "no checkpoints/latest", and only
  // --overwrite went on)
  const fs::path early = d / "early";
  fs::create_directories(early);
  const std::string resume_early = kBin + "/fp8rl train --resume --run-dir " + (early / "run").string();
  const pid_t killed = start_until_two_steps(kBin + "/fp8rl train --run-dir " + (early / "run").string() +
                                                 " --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=20"
                                                 " --rollout.prompts_per_step=4 --run.steps=100000",
                                             early);
  ASSERT_GT(killed, 0) << "the run did not start";
  ::kill(killed, SIGKILL);
  wait_exit(killed);
  ASSERT_FALSE(fs::exists(early / "run" / "checkpoints" / "latest"));
  const size_t done = metrics(early / "run").size();
  EXPECT_NE(fp8rl::test::run_command(resume_early + " --dump-config").out.find("prompts_per_step=4\n"), std::string::npos);
  // a save the kill cut (step_N.tmp) is no checkpoint; a warm start gone is done again (the seed's)
  fs::create_directories(early / "run" / "checkpoints" / "step_1.tmp");
  fs::remove_all(early / "run" / "checkpoints" / "init");
  // ... after the checks a fresh start makes before its warm start (the refusal came after it)
  const auto refused = fp8rl::test::run_command(resume_early + " --run.steps=3 --rollout.max_new_tokens=1");
  EXPECT_EQ(refused.rc, 2) << refused.out;
  EXPECT_NE(refused.out.find("training answers can never be rewarded"), std::string::npos) << refused.out;
  EXPECT_EQ(refused.out.find("SFT warm start"), std::string::npos) << refused.out;
  const auto restarted = fp8rl::test::run_command(resume_early + " --run.steps=3");
  ASSERT_EQ(restarted.rc, 0) << restarted.out;
  EXPECT_NE(restarted.out.find(" has no checkpoint (stopped before its first): the run starts again from step 0"), std::string::npos)
      << restarted.out;
  EXPECT_NE(restarted.out.find("SFT warm start: 20 steps"), std::string::npos) << restarted.out;
  const auto m3 = metrics(early / "run");
  ASSERT_EQ(m3.size(), 3u);
  for (size_t i = 0; i < m3.size(); ++i) EXPECT_EQ(m3[i]["step"], i + 1);
  const std::string discarded = text_of(early / "run" / "metrics.jsonl.discarded");  // the killed part's steps
  EXPECT_EQ(std::count(discarded.begin(), discarded.end(), '\n'), static_cast<long>(done));
  EXPECT_EQ(nlohmann::json::parse(text_of(early / "run" / "checkpoints" / "step_3" / "state.json"))["prompt_cursor"], 12);
  fs::remove_all(d);
}

// A resumed run continues exactly where the uninterrupted one would be, FP8 K/V cache included:
// the checkpoint keeps the batch its K/V scales are calibrated on (calibration.jsonl); the
// resumed run calibrated on the next step's prompts and its metrics differed from step 3 on. The
// uninterrupted run checkpoints every step and keeps the newest 2 (run.keep_checkpoints); the
// resumed part keeps 1 from its resume on (a key a resume may change); init (the SFT warm start) stays.
TEST(E2E, ResumeReproducesTheUninterruptedRun) {
  const fs::path d = fresh_dir("resume");
  const std::string f = " --run.eval_every=0 --run.checkpoint_every=2 --model.sft_steps=60 --rollout.prompts_per_step=8"
                        " --async.max_staleness=0 --precision.generation=fp8-kv";
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "full").string() + f +
                " --run.steps=4 --run.checkpoint_every=1 --run.keep_checkpoints=2"),
            0);
  auto entries = [](const fs::path& dir) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    return names;
  };
  EXPECT_EQ(entries(d / "full" / "checkpoints"), (std::set<std::string>{"init", "latest", "step_3", "step_4"}));
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "part").string() + f + " --run.steps=2"), 0);
  ASSERT_TRUE(fs::exists(d / "part" / "checkpoints" / "step_2" / "calibration.jsonl"));
  ASSERT_EQ(run(kBin + "/fp8rl train --resume --run-dir " + (d / "part").string() + f + " --run.steps=4 --run.keep_checkpoints=1"), 0);
  EXPECT_EQ(entries(d / "part" / "checkpoints"), (std::set<std::string>{"init", "latest", "step_4"}));
  const auto a = metrics(d / "full"), b = metrics(d / "part");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 2; i < 4; ++i)
    for (const char* k : {"loss", "token_mult_prob_error", "gen_kl_error", "grad_norm", "reward_mean"})
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << "step " << i + 1 << " " << k;
  std::ofstream(d / "part" / "checkpoints" / "step_4" / "calibration.jsonl") << "{\"tokens\": [1, 2]}\n{\"tokens\": \"x\"}\n";
  const auto r = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + (d / "part").string() + f + " --run.steps=6");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("step_4/calibration.jsonl:2: expected {\"tokens\": [ids...]}"), std::string::npos) << r.out;
  fs::remove_all(d);
}

TEST(E2E, BadRecipeKeyFailsWithItsName) {
  const fs::path d = fresh_dir("bad");
  std::ofstream(d / "r.conf") << "[rollout]\nslotz=3\n";
  const auto r = fp8rl::test::run_command(kBin + "/fp8rl train --recipe " + (d / "r.conf").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("rollout.slotz"), std::string::npos) << r.out;
  // CAF's own options: an unknown atom made CAF fall back to its default silently
  for (const auto& [arg, what] : std::vector<std::pair<std::string, std::string>>{
           {"--scheduler.policy=shareing", "--scheduler.policy=shareing: must be one of stealing, sharing"},
           {"--logger.console-verbosity=loud", "--logger.console-verbosity=loud: must be one of quiet"},
           {"--scheduler.nope=1", "CAF option --scheduler.nope=1: no such option"},  // CAF's parser_error(not_an_option, ...)
           {"--scheduler.max-threads=abc", "CAF option --scheduler.max-threads=abc: cannot parse its value"},
           // a prompt longer than the context: every rollout failed in turn, the cause on stderr; one
           // leaving less room than the longest response: trained on reward 0, silently
           {"--model.max_context=8 --model.sft_steps=5",
            "builtin:add2 (train) example 0: prompt of 7 tokens + rollout.max_new_tokens 5 do not fit model.max_context 8"},
           // KV caches beyond any machine's memory, named by the keys that size them, before the warm
           // start (each engine checked its own; two that each fit were killed by the OOM killer)
           {"--model.max_context=1048576 --rollout.slots=65536",
            "rollout.slots 65536 x model.max_context 1048576: the KV caches of the 2 generation engine(s) (1 rollout(s), "
            "learner0's validation) "},
           // ... adding up the processes of one host (each process checked its own)
           {"--topology configs/topologies/two-process.conf --model.max_context=1048576 --rollout.slots=65536",
            "the KV caches of the 3 generation engine(s) (2 rollout(s), learner0's validation)"},
           // no training answer fits the responses: trained on reward 0 (mul6 answers have 11-12 digits)
           {"--task.name=builtin:mul6 --model.sft_steps=5",
            "4000 of 4000 training answers can never be rewarded (the first: builtin:mul6 (train) example 0, "},
           // a layer name that matches none of the built-in model's layers kept nothing BF16
           {"--precision.bf16_names=layers.5.", "precision.bf16_names: 'layers.5.' names no linear layer of the built-in model (2 layers"},
           // a second recipe or topology silently replaced the first
           {"--recipe " + (d / "r.conf").string() + " --config-file " + (d / "r.conf").string(), "option --config-file given twice"},
           {"--topology a.conf --topology=b.conf", "option --topology given twice ('a.conf', 'b.conf')"},
           // a recipe key's value as the next argument (it read "unknown option '3'", no more)
           {"--run.steps 3", "unknown option '3' after --run.steps: --section.key options take their value after '=' (--run.steps=3)"}}) {
    const auto c = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + (d / "run").string() + " " + arg);
    EXPECT_NE(c.rc, 0) << arg;
    EXPECT_NE(c.out.find(what), std::string::npos) << arg << "\n" << c.out;
    EXPECT_EQ(c.out.find("SFT warm start"), std::string::npos) << arg << "\n" << c.out;  // refused before it (seconds to minutes)
  }
  EXPECT_FALSE(fs::exists(d / "run" / "recipe.conf"));  // refused before the run starts
  // a bad caf-application.ini (CAF reads it from the working directory) is named, not the first
  // CAF option given, which is fine
  fs::create_directories(d / "ini");
  std::ofstream(d / "ini" / "caf-application.ini") << "[scheduler]\nmax-threads=\n";
  const auto ini = fp8rl::test::run_command("cd " + (d / "ini").string() + " && " + kBin + "/fp8rl train --run-dir " +
                                            (d / "run").string() + " --scheduler.policy=sharing");
  EXPECT_EQ(ini.rc, 2) << ini.out;
  EXPECT_NE(ini.out.find((d / "ini" / "caf-application.ini").string() + " (CAF reads it from the working directory)"),
            std::string::npos) << ini.out;
  EXPECT_EQ(ini.out.find("CAF option --scheduler.policy"), std::string::npos) << ini.out;
  // the built-in model's prompts are checked before its SFT warm start (refused after it, leaving
  // checkpoints/init behind)
  const auto late = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + (d / "late").string() + " --rollout.max_new_tokens=40");
  EXPECT_EQ(late.rc, 2) << late.out;
  EXPECT_NE(late.out.find("prompt of 7 tokens + rollout.max_new_tokens 40 do not fit model.max_context 32"), std::string::npos)
      << late.out;
  EXPECT_EQ(late.out.find("SFT warm start"), std::string::npos) << late.out;
  EXPECT_FALSE(fs::exists(d / "late")) << late.out;
  // some answers longer than the responses (mul3's 6-digit products): the run goes on, warned with
  // their count (with seed 2 one answer is 100000, which the check wrote "1e+05" and refused the
  // run for an 'e' the built-in tokenizer lacks)
  const auto some = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + (d / "mul3").string() +
                                             " --task.name=builtin:mul3 --run.seed=2 --model.sft_steps=2 --run.steps=1 --task.val_size=50");
  EXPECT_EQ(some.rc, 0) << some.out;
  EXPECT_NE(some.out.find(" of 4000 training answers can never be rewarded (the first: builtin:mul3 (train) example 0, '461416', "
                          "6 tokens, more than rollout.max_new_tokens 5)"),
            std::string::npos) << some.out;
  EXPECT_EQ(some.out.find("of 4000 training answers can never be rewarded", some.out.find("training answers can never") + 1),
            std::string::npos) << some.out;  // one line per split
  EXPECT_NE(some.out.find(" of 50 validation answers can never be rewarded"), std::string::npos) << some.out;
  // a start refused before it wrote anything leaves no empty run directory behind
  const auto nothing = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + (d / "never").string() +
                                                " --task.name=" + (d / "no-such.jsonl").string());
  EXPECT_NE(nothing.rc, 0) << nothing.out;
  EXPECT_FALSE(fs::exists(d / "never")) << nothing.out;
  // a topology placing actors on GPUs is refused before anything is written (after the warm start, it was)
  const auto g = fp8rl::test::run_command(kBin + "/fp8rl train --topology configs/topologies/llama-8gpu.conf --run-dir " +
                                          (d / "gpu").string());
  EXPECT_NE(g.rc, 0);
  EXPECT_NE(g.out.find("llama-8gpu.conf: node 'gpu-host': device 'cuda:0': this build has no CUDA backend"), std::string::npos)
      << g.out;
  EXPECT_FALSE(fs::exists(d / "gpu"));
  // ... on another node than the one starting too: every node's devices are checked at each start
  const fs::path remote_gpu = d / "remote-gpu.conf";
  std::ofstream(remote_gpu) << "[cluster]\nnodes=[{name=\"main\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\", "
                               "\"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]},\n{name=\"b\", port=47611, "
                               "rollouts=[\"cuda:0\"]}]\n";
  const auto rg = fp8rl::test::run_command(kBin + "/fp8rl train --topology " + remote_gpu.string() + " --run-dir " + (d / "rgpu").string());
  EXPECT_NE(rg.rc, 0);
  EXPECT_NE(rg.out.find("remote-gpu.conf: node 'b': device 'cuda:0': this build has no CUDA backend"), std::string::npos) << rg.out;
  EXPECT_FALSE(fs::exists(d / "rgpu"));
  fs::remove_all(d);
}

TEST(E2E, StalenessZeroReproducesTheSynchronousLoop) {
  const fs::path d = fresh_dir("sync");
  const std::string flags = " --run.steps=3 --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=60"
                            " --rollout.prompts_per_step=8 --async.max_staleness=0 --grpo.kl_beta=0.05";
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + d.string() + flags), 0);
  const auto m = metrics(d);
  ASSERT_EQ(m.size(), 3u);
  // the same recipe, as plain functions
  fp8rl::actors::run_config cfg;
  std::stringstream ss(flags);
  std::string f;
  while (ss >> f) fp8rl::actors::recipe_apply_cli(cfg, f);
  const auto rc = fp8rl::actors::recipe_rl_config(cfg);
  fp8rl::models::rl_state st;
  st.params = fp8rl::models::checkpoint_load((d / "checkpoints" / "init").string()).params;
  st.ref = std::make_shared<const fp8rl::models::model_params>(st.params);  // the KL reference: the initial policy
  auto tok = fp8rl::models::tokenizer_load((d / "checkpoints" / "init").string());
  const auto train = fp8rl::models::task_load(fp8rl::models::task_spec_parse(cfg.task), false, cfg.train_size,
                                              static_cast<uint64_t>(cfg.seed));
  auto be = fp8rl::models::make_cpu_backend();
  fp8rl::models::engine_config ec;
  ec.slots = cfg.slots;
  ec.max_context = cfg.max_context;
  ec.policy = rc.gen_policy;
  fp8rl::models::generation_engine eng(*be, st.params.cfg, ec);
  for (int s = 0; s < 3; ++s) {
    auto want = fp8rl::models::rl_sync_step(st, eng, train, *tok, rc);
    for (const char* k : {"reward_mean", "loss", "token_mult_prob_error", "gen_kl_error", "grad_norm", "tokens",
                          "sampling_importance_ratio", "approx_entropy", "kl_penalty"})
      EXPECT_EQ(m[s][k].get<double>(), want[k]) << "step " << s + 1 << " " << k;
  }
  // the KL term to the initial policy: 0 exactly while the policy is the initial one, then > 0
  // (grpo.kl_beta > 0 used to fail every step: the learner had no reference weights)
  EXPECT_EQ(m[0]["kl_penalty"].get<double>(), 0.0);
  EXPECT_GT(m[1]["kl_penalty"].get<double>(), 0.0);
  EXPECT_GT(m[2]["kl_penalty"].get<double>(), 0.0);
  fs::remove_all(d);
}

// The shipped AMX recipe: where tiles exist, staleness 0 shows generation and training agreeing
// exactly (token_mult_prob_error 1); elsewhere the run is refused with a message naming tiles.
TEST(E2E, TilesRecipeRunsWithAmxAndIsRefusedWithout) {
  const fs::path d = fresh_dir("tiles");
  const std::string out = (d / "out.txt").string();
  const int rc = std::system((kBin + "/fp8rl train --recipe configs/recipes/fp8-e2e-tiles.conf --run-dir " +
                              (d / "run").string() + " --run.steps=2 --run.eval_every=0 --run.checkpoint_every=0" +
                              " --model.sft_steps=30 --rollout.prompts_per_step=8 --async.max_staleness=0 > " + out +
                              " 2>&1").c_str());
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), {});
  if (fp8rl::quant::gemm_tiles_available()) {
    ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << text;
    const auto m = metrics(d / "run");
    ASSERT_EQ(m.size(), 2u);
    for (const auto& step : m) EXPECT_EQ(step["token_mult_prob_error"].get<double>(), 1.0);
  } else {
    // refused as bad input before the SFT warm start and before anything is written
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 2) << rc;
    EXPECT_NE(text.find("precision.generation = fp8-tiles asks for tile GEMMs and this CPU has no AMX-BF16"), std::string::npos)
        << text;
    EXPECT_EQ(text.find("SFT warm start"), std::string::npos) << text;
    EXPECT_FALSE(fs::exists(d / "run"));
  }
  fs::remove_all(d);
}

// rl-algorithm.md section 7's gates in a real run: synchronous (every step's tokens at staleness
// 0), FP8 KV cache generation against FP8 training (a real mismatch, ~1.03), a median limit just
// above 1: the run stops at a checkpointed step with exit 1 and the gate named; resumed with the
// same settings it stops again; with --health.gates=warn it goes on, warned.
TEST(E2E, AFailedHealthGateStopsTheRunAndItsResume) {
  const fs::path d = fresh_dir("health");
  const std::string flags = " --run.steps=3 --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=60"
                            " --rollout.prompts_per_step=8 --async.max_staleness=0 --precision.generation=fp8-kv"
                            " --health.min_steps=1 --health.tmpe_median_max=1.000001 --health.source=trained";
  const auto first = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + d.string() + flags);
  EXPECT_EQ(first.rc, 1) << first.out;
  EXPECT_NE(first.out.find("health gate (rl-algorithm.md section 7): median token_mult_prob_error (staleness 0) "),
            std::string::npos) << first.out;
  EXPECT_NE(first.out.find("is not below 1.000001 over 1 step(s) 1..1"), std::string::npos) << first.out;
  const auto m = metrics(d);
  ASSERT_GE(m.size(), 1u);
  EXPECT_GT(m[0]["by_staleness/0/token_mult_prob_error"].get<double>(), 1.000001);
  ASSERT_TRUE(fs::exists(d / "checkpoints" / "latest")) << first.out;
  const auto again = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string());
  EXPECT_EQ(again.rc, 1) << again.out;
  EXPECT_NE(again.out.find("health gate (rl-algorithm.md section 7): median token_mult_prob_error (staleness 0) "), std::string::npos)
      << again.out;  // replayed from metrics.jsonl
  const auto warned = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + d.string() + " --health.gates=warn");
  EXPECT_EQ(warned.rc, 0) << warned.out;
  EXPECT_NE(warned.out.find("[warning] health gate (rl-algorithm.md section 7): median token_mult_prob_error"), std::string::npos)
      << warned.out;
  EXPECT_EQ(metrics(d).size(), 3u);
  fs::remove_all(d);
}

// health.source = audit: audit mode re-scores each token under the learner's policy at the version
// it was sampled under. Synchronous, every trajectory audited: audit/learner_* are the staleness-0
// metrics (the same quantity over the same tokens, each term bit for bit; the sums in another order,
// one of each prompt's group in turn) -- with top-p too, where the BF16 re-score or the current
// weights drop tokens the learner's policy keeps. Asynchronous: the gates read the
// audit at every audited step, Δ > 0 tokens included -- a median limit just above 1 fails at
// health.min_steps = 3 over steps 1..3, each counted.
TEST(E2E, TheAuditSourceJudgesEveryAuditedStep) {
  const fs::path d = fresh_dir("health-audit");
  const std::string flags = " --run.steps=3 --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=60"
                            " --rollout.prompts_per_step=8 --precision.generation=fp8-kv --audit.every=1 --health.source=audit";
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "sync").string() + flags +
                " --async.max_staleness=0 --audit.samples=64 --health.gates=warn --rollout.top_p=0.5"),
            0);
  const auto m = metrics(d / "sync");
  ASSERT_EQ(m.size(), 3u);
  double bf16_only_drops = 0;  // tokens top-p dropped under the BF16 re-score alone (step 1: 3)
  for (const auto& x : m) {
    EXPECT_EQ(x["audit/nonfinite_learner_tokens"], x["nonfinite_is_weights"]) << x.dump();
    bf16_only_drops += x["audit/nonfinite_tokens"].get<double>() - x["audit/nonfinite_learner_tokens"].get<double>();
    ASSERT_EQ(x.value("audit/trajectories", 0.0), 64.0) << x.dump();  // 8 prompts x 8: all of them
    EXPECT_GT(x["audit/learner_token_mult_prob_error"].get<double>(), 1.0) << x.dump();  // the FP8 KV cache's mismatch
    for (const char* k : {"token_mult_prob_error", "gen_kl_error"})
      EXPECT_NEAR(x[std::string("audit/learner_") + k].get<double>(), x[std::string("by_staleness/0/") + k].get<double>(),
                  fp8rl::tol::kFp64FewTerms) << k << " " << x.dump();
  }
  EXPECT_GT(bf16_only_drops, 0.0) << "the case the learner term must not skip did not occur";
  const auto async = fp8rl::test::run_command(kBin + "/fp8rl train --run-dir " + (d / "async").string() + flags +
                                              " --async.max_staleness=1 --health.min_steps=3 --health.tmpe_median_max=1.000001");
  EXPECT_EQ(async.rc, 1) << async.out;
  EXPECT_NE(async.out.find("health gate (rl-algorithm.md section 7): median token_mult_prob_error (audit, every staleness) "),
            std::string::npos) << async.out;
  EXPECT_NE(async.out.find("is not below 1.000001 over 3 step(s) 1..3 audited"), std::string::npos) << async.out;
  size_t stale_audited = 0;  // the learner holds every version a trajectory was sampled under (max_staleness of them)
  for (const auto& x : metrics(d / "async")) {
    EXPECT_EQ(x.value("audit/skipped_not_held", -1.0), 0.0) << x.dump();
    stale_audited += x.value("staleness_hist/1", 0.0) > 0;
  }
  EXPECT_GT(stale_audited, 0u) << "no step had stale tokens to audit";
  fs::remove_all(d);
}
