// actors/run_dir.cpp -- metrics.jsonl and plots.
#include "actors/run_dir.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace fp8rl::actors {
namespace fs = std::filesystem;

void metrics_writer::open(const std::string& run_dir, bool append) {
  fs::create_directories(run_dir);
  path_ = (fs::path(run_dir) / "metrics.jsonl").string();
  out_.open(path_, append ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::runtime_error(path_ + ": cannot open for writing");
}

void metrics_writer::write(uint64_t step, const std::map<std::string, double>& m) {
  nlohmann::json j;
  j["step"] = step;
  for (const auto& [k, v] : m) j[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  out_ << j.dump() << '\n';
  out_.flush();
}

std::string plots_write(const std::string& run_dir) {
  const fs::path dir = fs::path(run_dir) / "plots";
  fs::create_directories(dir);
  std::ifstream in(fs::path(run_dir) / "metrics.jsonl");
  std::ofstream dat(dir / "metrics.dat");
  dat << "# step reward_mean val_accuracy token_mult_prob_error gen_kl_error\n";
  std::string line;
  auto num = [](const nlohmann::json& j, const char* k) -> std::string {
    return j.contains(k) && j[k].is_number() ? std::to_string(j[k].get<double>()) : "NaN";
  };
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step")) continue;
    dat << j["step"].get<int64_t>() << ' ' << num(j, "reward_mean") << ' ' << num(j, "val_accuracy") << ' '
        << num(j, "token_mult_prob_error") << ' ' << num(j, "gen_kl_error") << '\n';
  }
  dat.close();
  std::ofstream gp(dir / "plots.gp");
  gp << "set terminal pngcairo size 900,500\nset datafile missing 'NaN'\nset grid\nset xlabel 'step'\n"
     << "set output '" << (dir / "reward.png").string() << "'\nset title 'reward and validation accuracy'\n"
     << "plot '" << (dir / "metrics.dat").string() << "' using 1:2 with lines title 'reward mean', "
     << "'' using 1:3 with linespoints title 'val accuracy'\n"
     << "set output '" << (dir / "mismatch.png").string() << "'\nset title 'generation vs training mismatch'\n"
     << "set y2tics\nplot '" << (dir / "metrics.dat").string() << "' using 1:4 with lines title 'token_mult_prob_error', "
     << "'' using 1:5 axes x1y2 with lines title 'gen_kl_error (right)'\n";
  gp.close();
  const std::string cmd = "gnuplot '" + (dir / "plots.gp").string() + "' 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) return "gnuplot failed or is not installed (tools/setup installs gnuplot-nox)";
  return "";
}

}  // namespace fp8rl::actors
