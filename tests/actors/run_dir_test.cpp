// tests/actors/run_dir_test.cpp -- the run directory `fp8rl train` writes: an earlier run is never
// overwritten unasked (what counts as one, a start's error not hidden by a pending signal, signals
// passed on by a parent), plots and metrics that cannot be written, calibration batch files, a
// resume moving the rows after its checkpoint aside, and a trace writer that cannot write.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <thread>
#include <nlohmann/json.hpp>

#include "actors/env.hpp"
#include "actors/recipe.hpp"
#include "actors/run_dir.hpp"
#include "actors/signals.hpp"
#include "actors/trace.hpp"
#include "models/log.hpp"
#include "tests/test_util.hpp"

using namespace fp8rl::actors;
using fp8rl::test::error_of;
namespace fs = std::filesystem;

TEST(RunDir, AnEarlierRunIsNeverOverwrittenUnasked) {
  const fs::path root = fs::temp_directory_path() / ("fp8rl_rundir_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path cwd = fs::current_path();
  fs::current_path(root);  // the default directories are relative: runs/NAME
  auto started = [](const std::string& d) {  // what a run that started leaves
    fs::create_directories(fs::path(d) / "checkpoints");
    std::ofstream(fs::path(d) / "recipe.conf") << "[run]\n";
    std::ofstream(fs::path(d) / "metrics.jsonl") << "{\"step\":1}\n";
  };
  EXPECT_EQ(run_dir_choose("", "x", false, false), "runs/x");
  EXPECT_NE(error_of([] { run_dir_choose("", "x", true, false); }).find("runs/x: --resume but no such run directory"),
            std::string::npos);
  // a run refused by its preflight leaves only checkpoints/init: the next run may use the dir
  fs::create_directories("runs/x/checkpoints/init");
  EXPECT_TRUE(run_dir_outputs("runs/x").empty());
  started("runs/x");
  EXPECT_EQ(run_dir_outputs("runs/x"), (std::vector<std::string>{"recipe.conf", "metrics.jsonl"}));
  EXPECT_EQ(run_dir_choose("", "x", false, false), "runs/x-2");  // the default moves on
  started("runs/x-2");
  EXPECT_EQ(run_dir_choose("", "x", false, false), "runs/x-3");
  EXPECT_EQ(run_dir_choose("", "x", true, false), "runs/x-2");  // --resume: the newest
  // an explicit directory holding a run is refused, naming it and the way out, and kept
  const std::string err = error_of([] { run_dir_choose("runs/x", "x", false, false); });
  EXPECT_NE(err.find("runs/x: holds an earlier run (recipe.conf, metrics.jsonl)"), std::string::npos) << err;
  EXPECT_NE(err.find("--overwrite"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists("runs/x/metrics.jsonl"));
  EXPECT_EQ(run_dir_choose("runs/x", "x", true, false), "runs/x");
  EXPECT_NE(error_of([] { run_dir_choose("runs/x", "x", true, true); }).find("give one"), std::string::npos);
  // a directory holding only a node's traces (another node of the run, its recipe.conf gone) is
  // an earlier run too
  fs::create_directories("runs/t/traces");
  std::ofstream("runs/t/traces/rollout1.jsonl") << "{}\n";
  EXPECT_EQ(run_dir_outputs("runs/t"), (std::vector<std::string>{"traces/"}));
  EXPECT_NE(error_of([] { run_dir_choose("runs/t", "t", false, false); }).find("holds an earlier run (traces/)"), std::string::npos);
  // --overwrite refuses to delete the model it starts from, but a sibling sharing a name prefix
  // (runs/x-2 beside runs/x) is not inside it
  EXPECT_EQ(run_dir_choose("runs/x", "x", false, true, "runs/x-2/checkpoints"), "runs/x");
  EXPECT_NE(error_of([] { run_dir_choose("runs/x", "x", false, true, "runs/x/checkpoints"); }).find("--overwrite would delete"),
            std::string::npos);
  // --overwrite accepts the directory and deletes nothing yet
  std::ofstream("runs/x/notes.txt") << "mine\n";
  EXPECT_EQ(run_dir_choose("runs/x", "x", false, true), "runs/x");
  EXPECT_TRUE(fs::exists("runs/x/metrics.jsonl"));
  auto text = [](const char* p) { std::ifstream f(p); return std::string(std::istreambuf_iterator<char>(f), {}); };
  std::ofstream("runs/x/topology.json") << "earlier\n";  // the placement a later --resume compares with
  {  // a start that fails after the stash (its preflight) gets the earlier run back, byte for byte
    run_dir_stash st("runs/x");
    EXPECT_FALSE(fs::exists("runs/x/metrics.jsonl"));
    EXPECT_FALSE(fs::exists("runs/x/checkpoints"));
    EXPECT_FALSE(fs::exists("runs/x/topology.json"));
    EXPECT_TRUE(fs::exists("runs/x/notes.txt"));
    fs::create_directories("runs/x/checkpoints/step_0");  // what the failed start wrote
    std::ofstream("runs/x/metrics.jsonl") << "new\n";
    std::ofstream("runs/x/topology.json") << "new\n";
  }
  EXPECT_EQ(text("runs/x/metrics.jsonl"), "{\"step\":1}\n");
  EXPECT_EQ(text("runs/x/topology.json"), "earlier\n");
  EXPECT_EQ(text("runs/x/recipe.conf"), "[run]\n");
  EXPECT_FALSE(fs::exists("runs/x/checkpoints/step_0"));
  EXPECT_TRUE(fs::exists("runs/x/checkpoints/init"));  // the earlier run's, moved back
  EXPECT_FALSE(fs::exists("runs/x/.replaced"));
  std::ofstream("runs/x/trace.json") << "{}";  // the earlier run's timeline (it stayed beside the new run's traces)
  std::ofstream("runs/x/trace.shiviz.log") << "";
  {  // a start that passes drops what runs write, and only that
    run_dir_stash st("runs/x");
    st.drop();
  }
  EXPECT_FALSE(fs::exists("runs/x/trace.json"));
  EXPECT_FALSE(fs::exists("runs/x/trace.shiviz.log"));
  EXPECT_FALSE(fs::exists("runs/x/topology.json"));
  EXPECT_FALSE(fs::exists("runs/x/metrics.jsonl"));
  EXPECT_FALSE(fs::exists("runs/x/checkpoints"));
  EXPECT_FALSE(fs::exists("runs/x/.replaced"));
  EXPECT_TRUE(fs::exists("runs/x/notes.txt"));
  // a stash that cannot be made (here a dangling link named .replaced: run_dir_recover sees no
  // stash) deletes nothing: its clean-up removed every run output, unmoved ones too -- the
  // earlier run it was to keep
  started("runs/s");
  fs::create_symlink("nowhere", "runs/s/.replaced");
  EXPECT_THROW(run_dir_stash("runs/s"), std::exception);
  EXPECT_EQ(text("runs/s/metrics.jsonl"), "{\"step\":1}\n");
  EXPECT_EQ(text("runs/s/recipe.conf"), "[run]\n");
  // a start that passes keeps what it wrote after the drop (the run's own outputs now)
  {
    run_dir_stash st("runs/x");
    st.drop();
    std::ofstream("runs/x/metrics.jsonl") << "the new run\n";
  }
  EXPECT_EQ(text("runs/x/metrics.jsonl"), "the new run\n");
  fs::remove("runs/x/metrics.jsonl");
  // --overwrite never deletes what the run starts from (model.init inside the directory)
  started("runs/x");
  fs::create_directories("runs/x/checkpoints/step_1");
  EXPECT_NE(error_of([] { run_dir_choose("runs/x", "x", false, true, "runs/x/checkpoints/step_1"); }).find("would delete"),
            std::string::npos);
  EXPECT_TRUE(fs::exists("runs/x/checkpoints/step_1"));
  // a start killed between its stash and its preflight leaves DIR/.replaced (no destructor ran):
  // the next run that looks at DIR moves the earlier run back, replacing what the killed start wrote
  started("runs/k");
  fs::create_directories("runs/k/checkpoints/step_3");
  fs::create_directories("runs/k/.replaced");
  for (const char* e : {"recipe.conf", "metrics.jsonl", "checkpoints"}) fs::rename(fs::path("runs/k") / e, fs::path("runs/k/.replaced") / e);
  fs::create_directories("runs/k/checkpoints/init");  // the killed start's warm start
  EXPECT_TRUE(run_dir_outputs("runs/k").empty());     // it looks empty ...
  EXPECT_NE(error_of([] { run_dir_choose("runs/k", "x", false, false); }).find("holds an earlier run"), std::string::npos);
  EXPECT_TRUE(fs::exists("runs/k/checkpoints/step_3"));  // ... but the earlier run is back and kept
  EXPECT_FALSE(fs::exists("runs/k/checkpoints/init"));
  EXPECT_FALSE(fs::exists("runs/k/.replaced"));
  EXPECT_EQ(text("runs/k/metrics.jsonl"), "{\"step\":1}\n");
  std::ofstream("runs/file") << "";
  EXPECT_NE(error_of([] { run_dir_choose("runs/file", "x", false, false); }).find("runs/file: exists and is not a directory"),
            std::string::npos);
  fs::current_path(cwd);
  fs::remove_all(root);
}

// What counts as an earlier run, and the edges of choosing a directory: an empty metrics.jsonl
// (a preflight's probe) is none, checkpoints/latest alone is one; --resume of a directory that is
// not there is refused; --overwrite never deletes the directory a run starts from, nor goes on
// over a stash of an earlier start; a signal before the drop gives the earlier run back.
TEST(RunDir, WhatCountsAsAnEarlierRun) {
  const fs::path root = fs::temp_directory_path() / ("fp8rl_earlier_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "runs" / "x" / "checkpoints");
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  std::ofstream("runs/x/metrics.jsonl") << "";
  EXPECT_TRUE(run_dir_outputs("runs/x").empty());
  EXPECT_EQ(run_dir_choose("", "x", false, false), "runs/x");
  std::ofstream("runs/x/checkpoints/latest") << "step_2\n";
  EXPECT_EQ(run_dir_outputs("runs/x"), (std::vector<std::string>{"checkpoints/latest"}));
  EXPECT_EQ(run_dir_choose("", "x", false, false), "runs/x-2");
  EXPECT_EQ(error_of([] { run_dir_choose("runs/nope", "x", true, false); }), "runs/nope: --resume but no such run directory");
  EXPECT_NE(error_of([] { run_dir_choose("runs/x", "x", false, true, "runs/x"); }).find("--overwrite would delete runs/x"),
            std::string::npos);
  fs::create_directories("runs/x/.replaced/other");  // an earlier start's stash run_dir_recover did not take (not a run output)
  EXPECT_NE(error_of([] { run_dir_stash st("runs/x"); }).find("runs/x/.replaced: holds an earlier run moved aside"), std::string::npos);
  EXPECT_TRUE(fs::exists("runs/x/checkpoints/latest"));
  fs::remove_all("runs/x/.replaced");
  EXPECT_EXIT(
      {
        stop_signals signals;
        try {
          run_dir_stash st("runs/x");
          std::raise(SIGTERM);
          st.drop();
        } catch (const interrupted& e) {
          std::exit(fs::exists("runs/x/checkpoints/latest") ? 3 : 4);
        }
        std::exit(5);
      },
      ::testing::ExitedWithCode(3), "SIGTERM during the start; the earlier run in runs/x is back");
  fs::current_path(cwd);
  fs::remove_all(root);
}

// A start that fails with a signal pending: the stash gives the earlier run back and lets the
// error reach the caller, who reports it; its destructor died by the signal, and the error that
// was unwinding (a preflight's, naming the file at fault) was never said. With no exception on its
// way out the signal still takes its own action once the earlier run is back.
TEST(RunDir, AStartsErrorIsNotHiddenByAPendingSignal) {
  const fs::path root = fs::temp_directory_path() / ("fp8rl_stash_sig_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "run" / "checkpoints");
  std::ofstream(root / "run" / "metrics.jsonl") << "{\"step\":1}\n";
  const std::string dir = (root / "run").string();
  auto start = [&](bool fails) {
    stop_signals signals;
    std::raise(SIGINT);  // recorded, not fatal
    try {
      run_dir_stash st(dir);
      std::ofstream(root / "run" / "metrics.jsonl") << "new\n";
      if (fails) throw std::runtime_error("data/prompts.jsonl:3: not a JSON object");
    } catch (const std::exception& e) {
      std::ifstream f(root / "run" / "metrics.jsonl");
      const std::string back(std::istreambuf_iterator<char>(f), {});
      std::fprintf(stderr, "caught: %s; metrics %s\n", e.what(), back == "{\"step\":1}\n" ? "back" : "lost");
      std::exit(3);
    }
    std::exit(4);  // not reached: the destructor's signal
  };
  EXPECT_EXIT(start(true), ::testing::ExitedWithCode(3),
              "SIGINT during the start; the earlier run in .*run is back\n(.|\n)*caught: data/prompts.jsonl:3: not a JSON object; metrics back");
  EXPECT_EXIT(start(false), ::testing::KilledBySignal(SIGINT), "SIGINT during the start; the earlier run in .*run is back");
  fs::remove_all(root);
}

// A signal ignored when the run starts (nohup's SIGHUP) stays ignored: no stop is recorded, and
// the previous disposition is back after the run; one at its default action is caught.
TEST(RunDir, ASignalIgnoredOnEntryStaysIgnored) {
  EXPECT_EXIT(
      {
        std::signal(SIGHUP, SIG_IGN);
        {
          stop_signals signals;
          std::raise(SIGHUP);
          if (stop_signals::pending() != 0) std::exit(5);
          std::raise(SIGTERM);  // at its default action on entry: recorded
          if (stop_signals::pending() != SIGTERM) std::exit(6);
        }
        struct sigaction now {};
        ::sigaction(SIGHUP, nullptr, &now);
        std::exit(now.sa_handler == SIG_IGN ? 0 : 7);
      },
      ::testing::ExitedWithCode(0), "");
}

// A repeat of the first signal (caf-run passing on what the group got) is one stop: one of the
// two from the parent, within 2 s either way round -- the later recorded may have read the clock
// first (two threads; the unsigned difference wrapped and the node died unsaved).
TEST(Signals, ASignalPassedOnByTheParentIsTheSameStop) {
  EXPECT_TRUE(signal_same_stop(10'000, false, 10'500, true));
  EXPECT_TRUE(signal_same_stop(10'000, true, 10'500, false));
  EXPECT_TRUE(signal_same_stop(10'000, true, 9'999, false));   // this handler read the clock first
  EXPECT_TRUE(signal_same_stop(10'000, false, 8'001, true));
  EXPECT_FALSE(signal_same_stop(10'000, false, 10'500, false));  // two of the user's own: a second signal
  EXPECT_FALSE(signal_same_stop(10'000, true, 12'000, false));   // 2 s on: a second signal
  EXPECT_FALSE(signal_same_stop(10'000, false, 8'000, true));
}

// While the actors are being wired a signal takes its own action at once, saying so.
TEST(Signals, ASignalWhileWiringStopsAtOnce) {
  EXPECT_EXIT(
      {
        stop_signals signals;
        stop_signals::immediate(true);
        std::raise(SIGINT);
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGINT), "a signal while the run's actors are wired: stopping at once");
}

// plots_write reports what it cannot do and never throws: a plots path that is a file threw out
// of the controller at the end of a run (the process then waited forever), and a metrics row
// whose step is not an integer threw nlohmann's type_error naming neither file nor line.
TEST(RunDir, PlotsReportWhatTheyCannotWrite) {
  const fs::path d = fs::temp_directory_path() / ("fp8rl_plots_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  std::ofstream(d / "plots") << "a file\n";
  std::ofstream(d / "metrics.jsonl") << "{\"step\":1}\n";
  std::string err;
  EXPECT_NO_THROW(err = plots_write(d.string()));
  EXPECT_NE(err.find((d / "plots").string()), std::string::npos) << err;
  fs::remove(d / "plots");
  std::ofstream(d / "metrics.jsonl") << "{\"step\":1}\n{\"step\":\"oops\"}\n";
  EXPECT_NO_THROW(err = plots_write(d.string()));
  EXPECT_NE(err.find((d / "metrics.jsonl").string() + ":2: not a metrics row"), std::string::npos) << err;
  fs::remove_all(d);
  // a run directory whose name holds a quote and a command: the plots are drawn, nothing is run
  // (the path went into a shell command line and the script between quotes)
  const std::string pwned = "fp8rl_plots_pwned_" + std::to_string(::getpid());  // in the shell's directory: ours
  const fs::path q = fs::temp_directory_path() / ("fp8rl_plots_q'$(touch " + pwned + ")'_" + std::to_string(::getpid()));
  fs::remove_all(q);
  fs::create_directories(q);
  for (int step : {1, 2})
    std::ofstream(q / "metrics.jsonl", std::ios::app) << nlohmann::json{{"step", step}, {"reward_mean", 0.5}, {"val_accuracy", 0.25},
                                                                         {"token_mult_prob_error", 0.01}, {"gen_kl_error", 1e-4}}.dump() << "\n";
  err = plots_write(q.string());
  EXPECT_FALSE(fs::exists(pwned));
  if (err.find("not installed") == std::string::npos) {  // the suite runs where tools/setup installed gnuplot
    EXPECT_EQ(err, "");
    EXPECT_TRUE(fs::exists(q / "plots" / "reward.png"));
    EXPECT_TRUE(fs::exists(q / "plots" / "mismatch.png"));
  }
  fs::remove_all(q);
  fs::remove(pwned);
  // without gnuplot on PATH: said so (glibc gives ENOENT for the exec; status 127 never came)
  const std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  ::setenv("PATH", "/nonexistent", 1);
  fs::create_directories(q);
  std::ofstream(q / "metrics.jsonl") << "{\"step\":1}\n";
  err = plots_write(q.string());
  ::setenv("PATH", path.c_str(), 1);
  EXPECT_EQ(err, "gnuplot is not installed (tools/setup installs gnuplot-nox)");
  // gnuplot runs in a process group of its own: a signal to the run's group (Ctrl-C at the
  // terminal, caf-run stopping a node) does not kill the plots of a run stopping at its last step.
  // A fake gnuplot signals its whole group; the caller, in a group of its own here, survives.
  const fs::path bin = q / "bin";
  fs::create_directories(bin);
  std::ofstream(bin / "gnuplot") << "#!/bin/sh\nkill -TERM 0\nsleep 5\n";
  fs::permissions(bin / "gnuplot", fs::perms::owner_all);
  std::ofstream(q / "metrics.jsonl") << "{\"step\":1}\n";
  EXPECT_EXIT(
      {
        ::setpgid(0, 0);
        ::setenv("PATH", bin.c_str(), 1);
        const std::string why = plots_write(q.string());
        std::fprintf(stderr, "%s\n", why.c_str());
        std::exit(why == "gnuplot was killed by signal 15 (Terminated)" ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "killed by signal 15");
  fs::remove_all(q);
}

// A checkpoint's calibration batch (calibration.jsonl) comes back as saved; a line that is not
// {"tokens": [ids >= 0]} is refused naming the file and line (a negative id reached the
// embedding lookup), and so is a file without sequences. No file: an older checkpoint, none.
TEST(RunDir, CalibrationBatchFilesAreChecked) {
  const fs::path d = fs::temp_directory_path() / ("fp8rl_calib_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  EXPECT_TRUE(calibration_batch_load(d.string()).empty());
  const std::vector<std::vector<int32_t>> seqs = {{1, 2, 3}, {0}, {INT32_MAX}};
  calibration_batch_save(d.string(), seqs);
  EXPECT_EQ(calibration_batch_load(d.string()), seqs);
  const std::string f = (d / "calibration.jsonl").string();
  for (const auto& [line, why] : std::vector<std::pair<std::string, std::string>>{
           {"{\"tokens\": [1, -1]}", ":2: token ids must be integers >= 0"},
           {"{\"tokens\": [2.5]}", ":2: token ids must be integers >= 0"},
           {"{\"tokens\": [2147483648]}", ":2: token ids must be integers >= 0"},
           {"{\"tokens\": []}", ":2: expected {\"tokens\": [ids...]}"},
           {"[1, 2]", ":2: expected {\"tokens\": [ids...]}"}}) {
    std::ofstream(f) << "{\"tokens\": [4]}\n" << line << "\n";
    EXPECT_EQ(error_of([&] { calibration_batch_load(d.string()); }), f + why) << line;
  }
  std::ofstream(f) << "";
  EXPECT_EQ(error_of([&] { calibration_batch_load(d.string()); }), f + ": no sequences");
  fs::remove(f);
  fs::create_directories(f);  // unreadable as a file: named (it read as no batch, "an older checkpoint")
  EXPECT_EQ(error_of([&] { calibration_batch_load(d.string()); }), f + ": not a file");
  fs::remove_all(d);
}

// --resume from the checkpoint of v2 after a crash that followed step 3's metrics row: the row
// stayed and the resumed run wrote step 3 again (steps 1, 2, 3, 3 in the file and the plots).
// Rows after the checkpoint and a partial last line move aside; nothing is deleted.
// metrics.jsonl removed or replaced during the run (its directory deleted) fails the next row's
// write naming it: the rows went into the unlinked file, and the run said "metrics in ..." at its end.
TEST(RunDir, MetricsWriterNamesAFileRemovedDuringTheRun) {
  const fs::path d = fs::temp_directory_path() / ("fp8rl_metrics_gone_" + std::to_string(::getpid()));
  fs::remove_all(d);
  for (const bool replace : {false, true}) {
    metrics_writer w;
    w.open(d.string(), false);
    w.write(1, {{"x", 1.0}});
    fs::remove_all(d);
    if (replace) fs::create_directories(d), std::ofstream(d / "metrics.jsonl") << "{\"step\":1}\n";
    EXPECT_EQ(error_of([&] { w.write(2, {{"x", 2.0}}); }),
              (d / "metrics.jsonl").string() + ": removed or replaced during the run (the run directory deleted?): step 2's row "
                                               "went into the file this run opened, which is no longer there") << replace;
  }
  fs::remove_all(d);
}

TEST(RunDir, ResumeMovesRowsAfterTheCheckpointAside) {
  const fs::path m = fs::temp_directory_path() / ("fp8rl_trim_" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(m.string() + ".discarded");
  std::ofstream(m) << "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4,\"lo";
  EXPECT_EQ(metrics_trim_for_resume(m.string(), 2), 2);
  auto text = [](const fs::path& p) {
    std::ifstream in(p);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  EXPECT_EQ(text(m), "{\"step\":1}\n{\"step\":2}\n");
  EXPECT_EQ(text(m.string() + ".discarded"), "{\"step\":3}\n{\"step\":4,\"lo\n");
  EXPECT_EQ(metrics_trim_for_resume(m.string(), 2), 0);  // nothing left to move
  // the kept rows read back (the health gates count them): a null (a non-finite value) reads NaN,
  // a blank line is skipped, a row that is not one is named with its line
  std::ofstream(m) << "{\"step\":1,\"a\":null,\"b\":0.5}\n\n{\"step\":2}\n";
  std::vector<std::pair<uint64_t, std::map<std::string, double>>> rows;
  metrics_rows_each(m.string(), [&](uint64_t step, const auto& x) { rows.emplace_back(step, x); });
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].first, 1u);
  EXPECT_TRUE(std::isnan(rows[0].second.at("a")));
  EXPECT_EQ(rows[0].second.at("b"), 0.5);
  EXPECT_EQ(rows[1].first, 2u);
  std::ofstream(m) << "{\"step\":1}\n{\"step\":-1}\n";
  EXPECT_EQ(error_of([&] { metrics_rows_each(m.string(), [](uint64_t, const auto&) {}); }), m.string() + ":2: not a metrics row (an object with an unsigned \"step\")");
  std::ofstream(m) << "{\"step\":1,\"x\":\"text\"}\n";
  EXPECT_EQ(error_of([&] { metrics_rows_each(m.string(), [](uint64_t, const auto&) {}); }), m.string() + ":1: metric 'x' is not a number");
  fs::remove(m);
  fs::remove(m.string() + ".discarded");
}

// Pruning keeps the newest `keep` step_N by number (step_10 is newer than step_9) up to the step just
// saved; steps past it (a branch left by a resume from an older checkpoint), `latest`, a save's
// step_N.tmp and other names stay; keep 0 removes none.
TEST(RunDir, CheckpointsPruneKeepsTheNewestByStep) {
  const fs::path d = fs::temp_directory_path() / ("fp8rl_prune_" + std::to_string(::getpid()));
  fs::remove_all(d);
  for (const char* n : {"step_1", "step_2", "step_9", "step_10", "step_7.tmp", "step_x", "step_"}) fs::create_directories(d / n);
  std::ofstream(d / "latest") << "step_10\n";
  std::ofstream(d / "step_3");  // a file, not a checkpoint
  auto names = [&] {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(d)) out.insert(e.path().filename().string());
    return out;
  };
  EXPECT_EQ(checkpoints_prune(d.string(), 0, 10), "");
  EXPECT_EQ(names().size(), 9u);
  EXPECT_EQ(checkpoints_prune(d.string(), 1, 2), "");  // resumed from step_1: step_9 and step_10 are another branch
  EXPECT_EQ(names(), (std::set<std::string>{"latest", "step_2", "step_10", "step_9", "step_7.tmp", "step_x", "step_", "step_3"}));
  fs::create_directories(d / "step_1");
  EXPECT_EQ(checkpoints_prune(d.string(), 2, 10), "");
  EXPECT_EQ(names(), (std::set<std::string>{"latest", "step_10", "step_9", "step_7.tmp", "step_x", "step_", "step_3"}));
  EXPECT_EQ(checkpoints_prune(d.string(), 1, 10), "");
  EXPECT_EQ(names(), (std::set<std::string>{"latest", "step_10", "step_7.tmp", "step_x", "step_", "step_3"}));
  EXPECT_EQ(checkpoint_step_of("step_0"), 0u);
  EXPECT_EQ(checkpoint_step_of("step_9999999999999999999"), 9999999999999999999ull);
  EXPECT_FALSE(checkpoint_step_of("step_99999999999999999999"));  // 20 digits: past 2^64
  EXPECT_FALSE(checkpoint_step_of("step_1.tmp"));
  fs::remove_all(d);
  EXPECT_EQ(checkpoints_prune(d.string(), 1, 10), d.string() + ": cannot list it (No such file or directory)");
}

// An old checkpoint that cannot be removed is named in the warning the learner logs, and pruning
// goes on with the others: step_2 holds an immutable file, step_1 is removed after it.
TEST(RunDir, CheckpointsPruneNamesACheckpointItCannotRemoveAndGoesOn) {
  const fs::path d = fs::temp_directory_path() / ("fp8rl_prune_fail_" + std::to_string(::getpid()));
  fs::remove_all(d);
  for (const char* n : {"step_1", "step_2", "step_3"}) fs::create_directories(d / n);
  const fs::path stuck = d / "step_2" / "model.safetensors";
  std::ofstream(stuck) << "x";
  if (!fp8rl::test::immutable_set(stuck, true)) {
    fs::remove_all(d);
    GTEST_SKIP() << "the immutable flag cannot be set in " << d << " (file system or capabilities)";
  }
  const std::string err = checkpoints_prune(d.string(), 1, 3);
  fp8rl::test::immutable_set(stuck, false);
  EXPECT_EQ(err.rfind("could not remove an old checkpoint (run.keep_checkpoints): " + (d / "step_2").string() + ": ", 0), 0u) << err;
  EXPECT_NE(err.find("Operation not permitted"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(d / "step_1"));  // removed after step_2's failure
  EXPECT_TRUE(fs::exists(d / "step_3"));
  fs::remove_all(d);
}

// A group's events carry its step and the OLDEST weight and scale versions of its tokens (the e2e
// run's window [step - 1, step] holds the newest too); a span has no step.
TEST(Trace, AGroupsEventsCarryItsStepAndOldestVersions) {
  const fs::path p = fs::temp_directory_path() / ("fp8rl_trace_group_" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(p);
  trace_writer& w = trace_writer::process();
  ASSERT_FALSE(w.enabled());
  w.open(p.string(), "n");
  fp8rl::msg::group_msg g;
  g.step = 9;
  g.samples.resize(2);
  g.samples[0].weight_version = {4, 5};
  g.samples[0].scale_version = {7, 8};
  g.samples[1].weight_version = {3};
  g.samples[1].scale_version = {6};
  trace_send_group("rollout0", g);
  trace_recv_group("buffer", g);
  w.event("learner0", "train", "span", 1, 2);
  w.close();
  std::ifstream in(p);
  std::vector<nlohmann::json> ev;
  for (std::string l; std::getline(in, l);) ev.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(ev.size(), 3u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ev[i].value("wv", -1), 3) << ev[i].dump();
    EXPECT_EQ(ev[i].value("sv", -1), 6) << ev[i].dump();
    EXPECT_EQ(ev[i].value("step", -1), 9) << ev[i].dump();
  }
  EXPECT_FALSE(ev[2].contains("step")) << ev[2].dump();
  fs::remove(p);
}

// A trace file that cannot be opened is the start's error naming it; one whose writes fail (a full
// disk: /dev/full) stops tracing with one warning naming it, and events after it cost nothing.
TEST(Trace, AWriterThatCannotWriteSaysSoOnce) {
  trace_writer w;
  const fs::path d = fs::temp_directory_path() / ("fp8rl_trace_" + std::to_string(::getpid()));
  fs::create_directories(d / "n.jsonl");  // a directory where the file goes
  EXPECT_EQ(error_of([&] { w.open((d / "n.jsonl").string(), "n"); }), (d / "n.jsonl").string() + ": cannot open for writing (--trace.enabled=false runs without traces)");
  EXPECT_FALSE(w.enabled());
  fs::remove_all(d);
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  w.open("/dev/full", "n");
  ASSERT_TRUE(w.enabled());
  fp8rl::log_set_level("info");
  testing::internal::CaptureStderr();
  for (int i = 0; i < 1024; ++i) w.event("a", "e", "span", 0, 0);  // a flush every 256
  EXPECT_FALSE(w.enabled());  // at the first failed flush, not only at the close
  w.close();
  const std::string err = testing::internal::GetCapturedStderr();
  const std::string said = "/dev/full: writing trace events failed (disk full?); tracing stops here";
  const size_t at = err.find(said);
  EXPECT_NE(at, std::string::npos) << err;
  EXPECT_EQ(err.find(said, at + 1), std::string::npos) << "said twice: " << err;
}

// A trace file stops at its cap (trace.max_mb), what it held before included: the last event is
// whole and ends past the cap by less than one line; one warning says so; a resumed run finding
// the file at its cap writes nothing and says so at the open.
TEST(Trace, AWriterStopsAtItsCapAndSaysSoOnce) {
  const fs::path p = fs::temp_directory_path() / ("fp8rl_trace_cap_" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(p);
  std::ofstream(p) << "{\"node\":\"n\",\"torn";  // a killed run's cut last line: ended by the next open
  const uint64_t cap = 4096;
  fp8rl::log_set_level("info");
  testing::internal::CaptureStderr();
  {
    trace_writer w;
    w.open(p.string(), "n", cap);
    int events = 0;
    while (w.enabled() && events < 1000) w.event("actor", "e", "span", 1, 2), ++events;
    EXPECT_LT(events, 1000);
    w.close();
  }
  std::string err = testing::internal::GetCapturedStderr();
  const std::string said = p.string() + ": ";
  EXPECT_NE(err.find("its cap of 4096 bytes (trace.max_mb) reached; tracing stops here, the run goes on (0: no cap)"), std::string::npos) << err;
  EXPECT_EQ(err.find(said, err.find(said) + 1), std::string::npos) << "said twice: " << err;
  const std::string text = [&] { std::ifstream in(p); return std::string(std::istreambuf_iterator<char>(in), {}); }();
  EXPECT_GE(text.size(), cap);
  const size_t last = text.rfind('\n', text.size() - 2);
  EXPECT_LT(text.size() - cap, text.size() - last) << "past the cap by more than its last line";
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(text.find("{\"node\":\"n\",\"torn\n{\"node\":\"n\",\"actor\""), 0u) << text.substr(0, 80);
  testing::internal::CaptureStderr();
  {
    trace_writer w;
    w.open(p.string(), "n", cap);
    EXPECT_FALSE(w.enabled());
    w.event("actor", "e", "span", 1, 2);
    w.close();
  }
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(said + std::to_string(text.size()) + " bytes, its cap"), std::string::npos) << err;
  EXPECT_EQ(fs::file_size(p), text.size());
  fs::remove(p);
}

// Events from several threads at once (actors on CAF's workers, TBB's kernels' spans): the cap is
// counted under the writer's lock, so the file holds whole lines only, ends within one line past
// the cap, and the warning is said once.
TEST(Trace, ThreadsReachingTheCapTogetherLeaveWholeLines) {
  const fs::path p = fs::temp_directory_path() / ("fp8rl_trace_mt_" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(p);
  const uint64_t cap = 64 * 1024;
  fp8rl::log_set_level("info");
  testing::internal::CaptureStderr();
  {
    trace_writer w;
    w.open(p.string(), "n", cap);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&w, t] {
        for (int i = 0; i < 5000 && w.enabled(); ++i) w.event("actor" + std::to_string(t), "e", "span", i, 1);
      });
    for (auto& th : threads) th.join();
    EXPECT_FALSE(w.enabled());
    w.close();
  }
  const std::string err = testing::internal::GetCapturedStderr();
  const std::string said = "its cap of 65536 bytes (trace.max_mb) reached";
  EXPECT_NE(err.find(said), std::string::npos) << err;
  EXPECT_EQ(err.find(said, err.find(said) + 1), std::string::npos) << "said twice: " << err;
  std::ifstream in(p);
  std::string line;
  uint64_t bytes = 0, longest = 0;
  while (std::getline(in, line)) {
    bytes += line.size() + 1;
    longest = std::max<uint64_t>(longest, line.size() + 1);
    ASSERT_TRUE(nlohmann::json::parse(line, nullptr, false).is_object()) << line;
  }
  EXPECT_EQ(bytes, fs::file_size(p));
  EXPECT_GE(bytes, cap);
  EXPECT_LT(bytes, cap + longest);
  fs::remove(p);
}
