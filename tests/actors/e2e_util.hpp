// tests/actors/e2e_util.hpp -- what the end-to-end tests share: fresh run directories (removed
// after a passing test, kept after a failing one), free loopback ports, running fp8rl and its
// tools as child processes, reading metrics.jsonl, and the small recipe (kSmall) they run.
// defines: kBin, fresh_dir, free_port, run, fails_naming, metrics, metrics_rows_so_far,
//          two_process_topology, exec_shell, spawn_logged, start_until_two_steps, wait_exit,
//          node_pids, text_of, kSmall
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test_util.hpp"

namespace fp8rl::test::e2e {
namespace fs = std::filesystem;
using json = nlohmann::json;

inline const std::string kBin = FP8RL_BIN_DIR;

// Every test's directory (and a sibling d-init) is removed after the test, also when an
// assertion ended it early (each test case runs as its own process: the environment's TearDown);
// a failed test's are kept for a look, and named.
inline std::vector<fs::path>& dirs_made() {
  static std::vector<fs::path> d;
  return d;
}
struct remove_dirs_after : ::testing::Environment {
  void TearDown() override {
    const bool passed = ::testing::UnitTest::GetInstance()->Passed();
    for (const auto& d : dirs_made())
      if (passed) fs::remove_all(d), fs::remove_all(d.string() + "-init");
      else std::printf("kept for a look: %s\n", d.c_str());
  }
};
inline ::testing::Environment* const kRemoveDirs = ::testing::AddGlobalTestEnvironment(new remove_dirs_after);

inline fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("fp8rl_e2e_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  dirs_made().push_back(d);
  return d;
}

// A loopback port free at the time of the call (the kernel's pick for port 0): fixed ports derived
// from the pid collided between test processes running at once and with other listeners. It is
// free again until the node binds it, so another process could take it meanwhile (an ephemeral
// port: rare); the node then fails to start, naming the port.
inline int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = s >= 0 && ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (s >= 0) ::close(s);
  if (!ok) throw std::runtime_error("free_port: no loopback port");
  return ntohs(a.sin_port);
}

inline int run(const std::string& cmd) {
  const int rc = std::system((cmd + " > /dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

inline std::vector<json> metrics(const fs::path& run_dir) {
  std::vector<json> out;
  std::ifstream f(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) out.push_back(json::parse(line));
  return out;
}

// Rows of a run still writing its metrics (a poll from a helper thread): a line being written is
// not a row yet, and nothing throws there (an exception in a std::thread ends the test process
// and leaves its nodes running).
inline size_t metrics_rows_so_far(const fs::path& run_dir) {
  std::ifstream f(run_dir / "metrics.jsonl");
  std::string line;
  size_t n = 0;
  while (std::getline(f, line)) n += !json::parse(line, nullptr, false).is_discarded();
  return n;
}

inline std::string two_process_topology(const fs::path& dir, int port, bool main_rollout = true) {  // false: rollout1's only
  const fs::path p = dir / "two-process.conf";
  std::ofstream(p) << "[cluster]\nnodes=[{name=\"main\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", "
                      "\"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=["
                   << (main_rollout ? "\"cpu:1\"" : "") << "]},\n"
                      "{name=\"rollout1\", host=\"127.0.0.1\", port=" << port << ", roles=[], learners=[], rollouts=[\"cpu:1\"]}]\n";
  std::ofstream(dir / "hosts") << "127.0.0.1 slots=2\n";
  return p.string();
}

// In a forked child: runs a shell line with SIGINT, SIGTERM and SIGHUP at their default actions
// (a test started as a shell's background job inherits SIGINT ignored, and fp8rl keeps an ignored
// signal ignored, as under nohup: the signals these tests send did nothing).
[[noreturn]] inline void exec_shell(const std::string& line) {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_DFL);
  ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
  ::_exit(127);
}
// Runs cmd as a child of this process (not a shell's background job), its output in dir/log; its pid.
inline pid_t spawn_logged(const std::string& cmd, const fs::path& dir) {
  const pid_t pid = ::fork();
  if (pid == 0) exec_shell("exec " + cmd + " > " + (dir / "log").string() + " 2>&1");
  return pid;
}
// spawn_logged, and its pid once dir/run has 2 metrics rows (0 if it did not get there within 60 s:
// it is then stopped -- nothing may outlive a test).
inline pid_t start_until_two_steps(const std::string& cmd, const fs::path& dir) {
  const pid_t pid = spawn_logged(cmd, dir);
  for (int i = 0; pid > 0 && i < 600 && metrics_rows_so_far(dir / "run") < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (pid > 0 && metrics_rows_so_far(dir / "run") < 2) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return 0;
  }
  return pid;
}
// Waits up to 30 s for the child pid to exit (then SIGKILL); its wait status.
inline int wait_exit(pid_t pid) {
  int st = 0;
  for (int i = 0; i < 300; ++i) {
    if (::waitpid(pid, &st, WNOHANG) == pid) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &st, 0);
  return st;
}
// The node pids caf-run's start lines name ("caf-run: started NODE (pid N) on HOST"); each node
// leads its own process group.
inline std::vector<pid_t> node_pids(const std::string& caf_run_log) {
  std::vector<pid_t> pids;
  for (size_t at = caf_run_log.find("(pid "); at != std::string::npos; at = caf_run_log.find("(pid ", at + 1))
    pids.push_back(static_cast<pid_t>(std::stol(caf_run_log.substr(at + 5))));
  return pids;
}
inline std::string text_of(const fs::path& f) {
  std::ifstream in(f);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

inline const char* const kSmall = " --run.steps=4 --run.eval_every=2 --run.checkpoint_every=2 --model.sft_steps=60"
                     " --rollout.prompts_per_step=8 --task.val_size=50";

// `fp8rl train ARGS` fails, its output naming what.
inline void fails_naming(const std::string& args, const std::string& what) {
  const auto r = fp8rl::test::run_command(kBin + "/fp8rl train " + args);
  EXPECT_NE(r.rc, 0) << args;
  EXPECT_NE(r.out.find(what), std::string::npos) << args << "\n" << r.out;
}
}  // namespace fp8rl::test::e2e
