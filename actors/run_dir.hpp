// actors/run_dir.hpp -- the run directory: metrics.jsonl, progress lines, gnuplot plots.
// defines: metrics_writer, plots_write, progress_line
//
//   RUN_DIR/metrics.jsonl      one JSON object per learner step: "step", every metric (spec names)
//   RUN_DIR/checkpoints/...    step_N/ (safetensors + optimizer + state.json), "latest"
//   RUN_DIR/traces/NODE.jsonl  trace events of each process (fp8rl-trace merges them)
//   RUN_DIR/plots/*.png        reward/accuracy and mismatch curves (gnuplot)
#pragma once
#include <fstream>
#include <map>
#include <string>

namespace fp8rl::actors {

class metrics_writer {
 public:
  void open(const std::string& run_dir, bool append);
  void write(uint64_t step, const std::map<std::string, double>& m);
  const std::string& path() const { return path_; }

 private:
  std::ofstream out_;
  std::string path_;
};

// Writes RUN_DIR/plots/{reward,mismatch}.png from metrics.jsonl with gnuplot; returns "" or why not.
std::string plots_write(const std::string& run_dir);

}  // namespace fp8rl::actors
