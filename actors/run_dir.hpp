// actors/run_dir.hpp -- the run directory: metrics.jsonl, progress lines, gnuplot plots.
// defines: metrics_writer, metrics_rows_each, metrics_trim_for_resume, checkpoint_step_of, checkpoints_prune, plots_write, run_dir_outputs, run_dir_choose, run_dir_stash,
//          run_dir_recover
//
//   RUN_DIR/metrics.jsonl      one JSON object per learner step: "step", every metric (spec names)
//   RUN_DIR/checkpoints/...    step_N/ (safetensors + optimizer + state.json + calibration.jsonl), "latest"
//   RUN_DIR/traces/NODE.jsonl  trace events of each process (fp8rl-trace merges them)
//   RUN_DIR/plots/*.png        reward/accuracy and mismatch curves (gnuplot)
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fp8rl::actors {

class metrics_writer {
 public:
  void open(const std::string& run_dir, bool append);
  void write(uint64_t step, const std::map<std::string, double>& m);
  const std::string& path() const { return path_; }

 private:
  std::ofstream out_;
  std::string path_;
  uint64_t dev_ = 0, ino_ = 0;  // the file opened: one removed or replaced took the rows after it in silence
};

// Calls row(step, metrics) for each row of metrics.jsonl as written (null, a non-finite value, reads
// NaN), one row in memory at a time (a day's run writes millions; all of them held at once took
// ~10 KB a row at a resume); a resumed run's controller replays them into the health gates (they
// count the steps before the resume). Throws naming file and line for a row that is not an object
// with an unsigned "step" and numbers.
void metrics_rows_each(const std::string& metrics_path,
                       const std::function<void(uint64_t step, const std::map<std::string, double>& metrics)>& row);

// --resume from the checkpoint of version K: metrics rows of steps after K (trained after that
// checkpoint, then lost with the process; the resumed run writes them again) and a partial last
// line move to metrics.jsonl.discarded (appended, nothing deleted). Returns how many lines moved.
int64_t metrics_trim_for_resume(const std::string& metrics_path, uint64_t version);

// N for a checkpoint directory's name "step_<N>" (1 to 19 digits), else none (a save's step_N.tmp,
// latest, init).
std::optional<uint64_t> checkpoint_step_of(const std::string& name);
// After the save of step `current`: removes the step_<N> directories of CHECKPOINTS_DIR with N <=
// current but the `keep` highest (keep 0: none removed), each named in the log; steps past current
// (a branch a resume from an older checkpoint left) and other entries (latest, init, a save's
// .tmp/.old) stay. Returns "" or what could not be removed and why (the caller warns: the run goes on).
std::string checkpoints_prune(const std::string& checkpoints_dir, int64_t keep, uint64_t current);

// Writes RUN_DIR/plots/{reward,mismatch}.png from metrics.jsonl with gnuplot; returns "" or why not.
std::string plots_write(const std::string& run_dir);

// CHECKPOINT/calibration.jsonl: the sequences (prompt + response token ids, one {"tokens": [...]}
// per line) of the step that produced the checkpoint -- the batch its FP8 K/V/Q scales are
// calibrated on (rl-algorithm.md §5), so a resumed run calibrates as the uninterrupted one did.
void calibration_batch_save(const std::string& checkpoint_dir, const std::vector<std::vector<int32_t>>& seqs);
// The saved batch; empty if the checkpoint has none (older runs). Throws naming file and line.
std::vector<std::vector<int32_t>> calibration_batch_load(const std::string& checkpoint_dir);

// What shows that DIR holds an earlier run that started (recipe.conf, checkpoints/latest, a
// non-empty metrics.jsonl, trace files); empty when a new run may write there (a run refused
// by its preflight leaves at most checkpoints/init, which the next one rebuilds).
std::vector<std::string> run_dir_outputs(const std::string& dir);

// Where `fp8rl train` writes. `given` is --run-dir ("" when absent: the default is
// runs/NAME, and while that holds an earlier run, the first of runs/NAME-2, -3, ... that does
// not). A fresh run never writes into a directory holding an earlier run unless `overwrite`
// (then the caller moves the earlier run aside with run_dir_stash and drops it only once the
// new run can start); an explicit --run-dir holding one is refused with the way out. `resume` continues `given`, or by default the newest existing of runs/NAME,
// runs/NAME-2, ...; it must exist (train_main restarts one without a checkpoint from step 0).
// Throws std::invalid_argument naming the directory.
// `keep`: a path the run reads (model.init) -- --overwrite is refused when it lies inside DIR.
std::string run_dir_choose(const std::string& given, const std::string& name, bool resume, bool overwrite,
                           const std::string& keep = "");

// --overwrite without losing the earlier run when the new one cannot start: the constructor
// renames what runs write (recipe.conf, checkpoints/, metrics.jsonl, traces/, plots/, gloo/) into
// DIR/.replaced/; `fp8rl train` drops them once the new run has recorded its first step (it did
// once the preflight passed: a run failing at its first step -- a bundle refused, memory -- lost
// the earlier run); without a drop, the destructor removes what the failed start wrote under
// those names and moves the earlier run's files back. Throws std::runtime_error naming the path
// it cannot move. A start killed in between (no destructor runs) leaves DIR/.replaced/:
// run_dir_recover moves it back.
//
// run_dir_recover: if DIR/.replaced/ exists, moves the earlier run back (replacing what the
// interrupted start wrote), says so on stderr and returns true. run_dir_choose calls it for
// every directory it considers, so a killed --overwrite never hides or loses a run.
bool run_dir_recover(const std::string& dir);
class run_dir_stash {
 public:
  explicit run_dir_stash(std::string dir);
  ~run_dir_stash();
  run_dir_stash(const run_dir_stash&) = delete;
  run_dir_stash& operator=(const run_dir_stash&) = delete;
  void drop();  // at an interruption point (below): a signal since the last one undoes the start
  // Deletes the earlier run now, from any thread (the controller's, at the new run's first step);
  // the destructor then leaves the directory to the new run.
  void drop_now() noexcept;
  // The run's actors are up and a signal stops the run (signals.hpp): the destructor no longer
  // takes a pending signal's own action after giving the earlier run back.
  void run_started() { run_started_ = true; }
  // Under a stop_signals (signals.hpp; `fp8rl train` holds one), SIGINT/SIGTERM/SIGHUP are caught
  // rather than fatal (their default action killed the start with the earlier run hidden in
  // DIR/.replaced/ until the next train): interruption_point() throws once one came, the start
  // unwinds, the destructor moves the earlier run back and says so. An exception on its way out
  // (`interrupted`, or an error that came with the signal pending) then ends the start as the
  // caller reports it (exit 128+signal for `interrupted`); with none, the signal takes its course
  // (dying here hid the error that was unwinding).
  static void interruption_point();

 private:
  void restore(bool start_wrote) noexcept;  // start_wrote: remove the run outputs in DIR first
  std::string dir_;
  std::vector<std::string> moved_;  // entry names now under DIR/.replaced/
  std::atomic<bool> dropped_{false};
  bool run_started_ = false;
  int unwinding_ = std::uncaught_exceptions();  // at construction: more in the destructor = an exception on its way out
};

}  // namespace fp8rl::actors
