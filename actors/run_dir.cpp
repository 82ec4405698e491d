// actors/run_dir.cpp -- metrics.jsonl, plots, and which directory a run writes.
#include "actors/run_dir.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "actors/signals.hpp"
#include "models/json_io.hpp"
#include "models/log.hpp"

namespace fp8rl::actors {
namespace fs = std::filesystem;

std::vector<std::string> run_dir_outputs(const std::string& dir) {
  const fs::path d(dir);
  std::vector<std::string> found;
  std::error_code ec;
  if (fs::exists(d / "recipe.conf")) found.push_back("recipe.conf");  // written when a run starts
  if (fs::exists(d / "checkpoints" / "latest")) found.push_back("checkpoints/latest");
  if (fs::exists(d / "metrics.jsonl") && fs::file_size(d / "metrics.jsonl", ec) != 0) found.push_back("metrics.jsonl");
  if (fs::is_directory(d / "traces") && !fs::is_empty(d / "traces")) found.push_back("traces/");
  return found;
}

namespace {
std::string join_names(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& e : v) {
    if (!s.empty()) s += ", ";
    s += e;
  }
  return s;
}
// runs/NAME, runs/NAME-2, ...: the k-th candidate default directory (k >= 1).
std::string run_dir_default(const std::string& name, int k) {
  std::string d = "runs/";
  d += name;
  if (k > 1) d.append(1, '-').append(std::to_string(k));
  return d;
}
}  // namespace

namespace {
// what a run writes (the timeline files at its end: an --overwrite left the earlier run's beside the new traces)
const char* const kRunOutputs[] = {"recipe.conf", "resumes", "checkpoints",   "metrics.jsonl",   "traces",
                                   "plots",       "gloo",    "topology.json", "trace.json", "trace.shiviz.log"};
const char* const kStash = ".replaced";
}  // namespace

bool run_dir_recover(const std::string& dir) {
  const fs::path d(dir), st = d / kStash;
  std::error_code ec;
  if (!fs::is_directory(st, ec)) return false;
  for (const char* e : kRunOutputs) {
    if (!fs::exists(fs::symlink_status(st / e, ec))) continue;
    fs::remove_all(d / e);  // what the interrupted start wrote there
    fs::rename(st / e, d / e);
  }
  fs::remove(st, ec);  // only when empty: anything else stays visible there
  std::fprintf(stderr, "fp8rl: %s: restored the earlier run from %s (an --overwrite start was interrupted before it could run)\n",
               dir.c_str(), st.c_str());
  return true;
}

std::string run_dir_choose(const std::string& given, const std::string& name, bool resume, bool overwrite,
                           const std::string& keep) {
  if (resume && overwrite) throw std::invalid_argument("--resume continues a run and --overwrite replaces it: give one");
  auto candidate = [&](int k) {  // every directory considered gets an interrupted start's stash back
    std::string d = run_dir_default(name, k);
    run_dir_recover(d);
    return d;
  };
  std::string dir = given;
  if (!dir.empty()) run_dir_recover(dir);
  if (dir.empty() && resume) {  // the newest existing default directory
    for (int k = 1; fs::exists(run_dir_default(name, k)); ++k) dir = candidate(k);
    if (dir.empty()) throw std::invalid_argument(run_dir_default(name, 1) + ": --resume but no such run directory");
  }
  if (dir.empty() && !overwrite) {  // the first default directory without an earlier run
    int k = 1;
    while (!run_dir_outputs(candidate(k)).empty()) ++k;
    dir = run_dir_default(name, k);
  }
  if (dir.empty()) dir = candidate(1);
  if (resume) {
    if (!fs::is_directory(dir)) throw std::invalid_argument(dir + ": --resume but no such run directory");
    return dir;
  }
  if (fs::exists(dir) && !fs::is_directory(dir)) throw std::invalid_argument(dir + ": exists and is not a directory");
  const auto outputs = run_dir_outputs(dir);
  if (outputs.empty()) return dir;
  if (!overwrite)
    throw std::invalid_argument(dir + ": holds an earlier run (" + join_names(outputs) +
                                "); --resume continues it, --overwrite replaces it, or give another --run-dir");
  if (!keep.empty() && fs::exists(keep)) {
    const std::string d = fs::weakly_canonical(dir).string() + "/", k = fs::weakly_canonical(keep).string() + "/";
    if (k.rfind(d, 0) == 0)
      throw std::invalid_argument(dir + ": --overwrite would delete " + keep + ", which this run starts from; give another --run-dir");
  }
  return dir;
}


void run_dir_stash::interruption_point() {
  stop_signals::interruption_point("during the start; the earlier run is moved back");
}

run_dir_stash::run_dir_stash(std::string dir) : dir_(std::move(dir)) {
  const fs::path d(dir_), st = d / kStash;
  if (fs::exists(st))  // run_dir_choose recovers an interrupted start's stash first
    throw std::runtime_error(st.string() + ": holds an earlier run moved aside by an interrupted --overwrite; move it back or delete it");
  try {
    fs::create_directories(st);
    for (const char* e : kRunOutputs) {
      if (!fs::exists(fs::symlink_status(d / e))) continue;
      std::error_code ec;
      fs::rename(d / e, st / e, ec);
      if (ec) throw std::runtime_error((d / e).string() + ": --overwrite cannot move it aside: " + ec.message());
      moved_.emplace_back(e);
    }
  } catch (...) {  // the destructor does not run for a half-built stash; nothing new was written:
    restore(false);  // the entries not yet moved are the earlier run's (they were deleted with the rest)
    throw;
  }
}

void run_dir_stash::drop() {
  interruption_point();  // a signal since the last point: the start is undone, not the earlier run
  drop_now();
}

void run_dir_stash::drop_now() noexcept {
  if (dropped_.exchange(true)) return;  // from here on the new run owns the directory, whatever the deletion does
  std::error_code ec;
  fs::remove_all(fs::path(dir_) / kStash, ec);
  if (ec) std::fprintf(stderr, "fp8rl: could not delete the replaced run in %s/%s: %s\n", dir_.c_str(), kStash, ec.message().c_str());
}

void run_dir_stash::restore(bool start_wrote) noexcept {
  const fs::path d(dir_), st = d / kStash;
  std::error_code ec;
  if (start_wrote)
    for (const char* e : kRunOutputs) fs::remove_all(d / e, ec);  // whatever the failed start wrote
  for (const auto& e : moved_) {
    fs::rename(st / e, d / e, ec);
    if (ec) std::fprintf(stderr, "fp8rl: could not move %s back to %s: %s\n", (st / e).c_str(), (d / e).c_str(), ec.message().c_str());
  }
  fs::remove(st, ec);  // only when empty: anything not moved back stays visible there
}

run_dir_stash::~run_dir_stash() {
  if (dropped_) return;
  restore(true);
  const int sig = stop_signals::pending();
  if (!sig || run_started_) {  // a run that stopped on a signal before its first step ended by the stop
    std::fprintf(stderr, "fp8rl: the new run did not record a step; the earlier run in %s is back\n", dir_.c_str());
    return;
  }
  std::fprintf(stderr, "fp8rl: %s during the start; the earlier run in %s is back\n", stop_signals::name(sig).c_str(), dir_.c_str());
  if (std::uncaught_exceptions() > unwinding_) return;  // the caller says it and ends the start (header)
  stop_signals::die(sig);  // the earlier run is back: the signal's own action now
}

void calibration_batch_save(const std::string& checkpoint_dir, const std::vector<std::vector<int32_t>>& seqs) {
  const fs::path p = fs::path(checkpoint_dir) / "calibration.jsonl";
  std::ofstream out(p);
  for (const auto& s : seqs) out << nlohmann::json{{"tokens", s}}.dump() << '\n';
  models::write_close_checked(out, p.string());
}

std::vector<std::vector<int32_t>> calibration_batch_load(const std::string& checkpoint_dir) {
  const fs::path p = fs::path(checkpoint_dir) / "calibration.jsonl";
  std::vector<std::vector<int32_t>> seqs;
  if (!fs::exists(p)) return seqs;
  if (!fs::is_regular_file(p)) throw std::invalid_argument(p.string() + ": not a file");  // (read as none: "an older checkpoint")
  std::ifstream in(p);
  if (!in) throw std::invalid_argument(models::open_failure(p.string()));
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const auto j = models::json_parse_strict(line, p.string() + ":" + std::to_string(n));
    if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array() || j["tokens"].empty())
      throw std::invalid_argument(p.string() + ":" + std::to_string(n) + ": expected {\"tokens\": [ids...]}");
    std::vector<int32_t> s;
    for (const auto& t : j["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
        throw std::invalid_argument(p.string() + ":" + std::to_string(n) + ": token ids must be integers >= 0");
      s.push_back(t.get<int32_t>());
    }
    seqs.push_back(std::move(s));
  }
  if (seqs.empty()) throw std::invalid_argument(p.string() + ": no sequences");
  return seqs;
}

void metrics_writer::open(const std::string& run_dir, bool append) {
  fs::create_directories(run_dir);
  path_ = (fs::path(run_dir) / "metrics.jsonl").string();
  out_.open(path_, append ? std::ios::app : std::ios::trunc);
  struct ::stat st {};
  if (!out_ || ::stat(path_.c_str(), &st) != 0) throw std::runtime_error(path_ + ": cannot open for writing");
  dev_ = st.st_dev, ino_ = st.st_ino;
}

void metrics_writer::write(uint64_t step, const std::map<std::string, double>& m) {
  nlohmann::json j;
  j["step"] = step;
  for (const auto& [k, v] : m) j[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  out_ << j.dump() << '\n';
  out_.flush();
  if (!out_) throw std::runtime_error(path_ + ": writing step " + std::to_string(step) + " failed (disk full?)");
  struct ::stat st {};
  const bool seen = ::stat(path_.c_str(), &st) == 0;
  if (!seen && errno != ENOENT && errno != ENOTDIR)
    throw std::runtime_error(path_ + ": cannot stat it after writing step " + std::to_string(step) + ": " + std::strerror(errno));
  if (!seen || st.st_dev != dev_ || st.st_ino != ino_)
    throw std::runtime_error(path_ + ": removed or replaced during the run (the run directory deleted?): step " + std::to_string(step) +
                             "'s row went into the file this run opened, which is no longer there");
}

void metrics_rows_each(const std::string& metrics_path,
                       const std::function<void(uint64_t step, const std::map<std::string, double>& metrics)>& row) {
  std::ifstream in(metrics_path, std::ios::binary);
  if (!in) throw std::runtime_error(metrics_path + ": cannot open");
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // a blank line (resume's trim keeps it)
    const auto j = nlohmann::json::parse(line, nullptr, false);
    const std::string where = metrics_path + ":" + std::to_string(n);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_unsigned())
      throw std::runtime_error(where + ": not a metrics row (an object with an unsigned \"step\")");
    std::map<std::string, double> m;
    for (const auto& [k, v] : j.items()) {
      if (k == "step") continue;
      if (!v.is_number() && !v.is_null()) throw std::runtime_error(where + ": metric '" + k + "' is not a number");
      m[k] = v.is_null() ? std::nan("") : v.get<double>();
    }
    row(j["step"].get<uint64_t>(), m);
  }
}

int64_t metrics_trim_for_resume(const std::string& metrics_path, uint64_t version) {
  std::ifstream in(metrics_path, std::ios::binary);
  if (!in) throw std::runtime_error(metrics_path + ": cannot open");
  std::string keep, drop, line;
  int64_t moved = 0;
  while (std::getline(in, line)) {
    const bool whole = !in.eof();  // the last line without its newline: cut by an interrupted run
    const auto j = nlohmann::json::parse(line, nullptr, false);
    const bool later = j.is_object() && j.contains("step") && j["step"].is_number_unsigned() && j["step"].get<uint64_t>() > version;
    if (whole && !later) {
      keep += line + '\n';
    } else {
      drop += line + '\n';
      ++moved;
    }
  }
  if (moved == 0) return 0;
  const std::string side = metrics_path + ".discarded";
  std::ofstream out(side, std::ios::app | std::ios::binary);
  out << drop;
  models::write_close_checked(out, side, metrics_path + " left as it was");
  const std::string tmp = metrics_path + ".tmp";
  models::file_write_checked(tmp, keep, metrics_path + " left as it was");
  fs::rename(tmp, metrics_path);
  return moved;
}

namespace {
// `gnuplot plots.gp` in dir, spawned without a shell; its output goes to dir/gnuplot.log. In a
// process group of its own: the signal that stops a run reaches the run's group (a terminal's
// Ctrl-C, caf-run's SIGTERM to a node's group) and killed the plots of a stop at the last step.
std::string plots_run_gnuplot(const fs::path& dir) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addchdir_np(&fa, dir.c_str());
  posix_spawn_file_actions_addopen(&fa, 1, "gnuplot.log", O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  char arg0[] = "gnuplot", arg1[] = "plots.gp";
  char* argv[] = {arg0, arg1, nullptr};
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "gnuplot", &fa, &attr, argv, environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&fa);
  // glibc reports a failed exec (and a failed file action) as the return value, not as status 127
  if (rc == ENOENT && fs::is_directory(dir)) return "gnuplot is not installed (tools/setup installs gnuplot-nox)";
  if (rc != 0) return "cannot run gnuplot in " + dir.string() + ": " + std::strerror(rc);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFSIGNALED(status)) return std::string("gnuplot was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "gnuplot failed: see " + (dir / "gnuplot.log").string();
  return "";
}
}  // namespace

std::optional<uint64_t> checkpoint_step_of(const std::string& name) {
  if (name.size() <= 5 || name.size() > 5 + 19 || name.compare(0, 5, "step_") != 0 ||
      name.find_first_not_of("0123456789", 5) != std::string::npos)
    return std::nullopt;
  return std::stoull(name.substr(5));  // 19 digits fit: < 10^19 < 2^64
}

std::string checkpoints_prune(const std::string& checkpoints_dir, int64_t keep, uint64_t current) {
  if (keep <= 0) return "";
  std::vector<std::pair<uint64_t, fs::path>> steps;  // this branch's step_<N>: N <= current
  std::error_code ec;
  for (fs::directory_iterator it(checkpoints_dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code dir_ec;
    const auto n = checkpoint_step_of(it->path().filename().string());
    if (n && *n <= current && it->is_directory(dir_ec)) steps.emplace_back(*n, it->path());
  }
  if (ec) return checkpoints_dir + ": cannot list it (" + ec.message() + ")";
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string failed;
  for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i) {
    if (steps[i].first == current) continue;  // (keep >= 1: it is the first)
    fs::remove_all(steps[i].second, ec);
    if (ec) failed += (failed.empty() ? "" : "; ") + steps[i].second.string() + ": " + ec.message();
    else log_get("learner")->info("removed {} (run.keep_checkpoints = {})", steps[i].second.string(), keep);
  }
  return failed.empty() ? "" : "could not remove an old checkpoint (run.keep_checkpoints): " + failed;
}

std::string plots_write(const std::string& run_dir) {
  const fs::path dir = fs::path(run_dir) / "plots", metrics = fs::path(run_dir) / "metrics.jsonl";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return dir.string() + ": " + ec.message();
  std::ifstream in(metrics);
  if (!in) return metrics.string() + ": cannot open";
  std::ofstream dat(dir / "metrics.dat");
  dat << "# step reward_mean val_accuracy token_mult_prob_error gen_kl_error\n";
  std::string line;
  auto num = [](const nlohmann::json& j, const char* k) -> std::string {
    return j.contains(k) && j[k].is_number() ? std::to_string(j[k].get<double>()) : "NaN";
  };
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // as metrics_rows_each
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
      return metrics.string() + ":" + std::to_string(n) + ": not a metrics row (an object with an integer \"step\")";
    dat << j["step"].get<int64_t>() << ' ' << num(j, "reward_mean") << ' ' << num(j, "val_accuracy") << ' '
        << num(j, "token_mult_prob_error") << ' ' << num(j, "gen_kl_error") << '\n';
  }
  dat.close();
  if (!dat) return (dir / "metrics.dat").string() + ": writing failed";
  // names without a path: gnuplot runs in the plots directory (a run directory with a quote in its
  // name broke the script, and a shell command line built from it ran what followed the quote)
  std::ofstream gp(dir / "plots.gp");
  gp << "set terminal pngcairo noenhanced size 900,500\nset datafile missing 'NaN'\nset grid\nset xlabel 'step'\n"
     << "set output 'reward.png'\nset title 'reward and validation accuracy'\n"
     << "plot 'metrics.dat' using 1:2 with lines title 'reward mean', '' using 1:3 with linespoints title 'val accuracy'\n"
     << "set output 'mismatch.png'\nset title 'generation vs training mismatch'\n"
     << "set y2tics\nplot 'metrics.dat' using 1:4 with lines title 'token_mult_prob_error', "
     << "'' using 1:5 axes x1y2 with lines title 'gen_kl_error (right)'\n";
  gp.close();
  if (!gp) return (dir / "plots.gp").string() + ": writing failed";
  return plots_run_gnuplot(dir);
}

}  // namespace fp8rl::actors
