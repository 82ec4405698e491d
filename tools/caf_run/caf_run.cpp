// tools/caf_run/caf_run.cpp -- build/bin/caf-run: launch every node of a topology as its own
// process (fork/exec on this host, ssh elsewhere), prefix their output, stop the group on the
// first failure, exit with a meaningful code.
//   caf-run --hostfile FILE --topology FILE [--wdir DIR] [--grace SECONDS] [--fail-fast] -- CMD ARGS...
// (kUsage below, printed by --help)
// Hostfile lines: "<host> [slots=N]" ('#' comments). Each topology node runs on the hostfile
// host equal to its "host" (127.0.0.1 and localhost are this machine), as
//   <command...> --topology FILE --node NAME [--scheduler.max-threads=N]
// Non-controller nodes start first (the controller retries its connections). Supervision:
//  - a node that fails before it is up (its "ready" line) stops the group: the run cannot start;
//  - once the run is up the controller judges whether it survives a lost node (a lost rollout's
//    work is re-queued; a lost learner is fatal), so a failing non-controller node is reported
//    and the group continues; --fail-fast stops the group on any node's failure;
//  - when the controller exits, the other nodes get --grace seconds to exit by themselves
//    (it told them to stop), then SIGTERM, then after --grace more SIGKILL;
//  - SIGINT/SIGTERM/SIGHUP to caf-run: SIGTERM to the controller node, which stops the run after
//    the step in progress, checkpointed, and every node with it (then --grace as above); a second
//    signal SIGKILLs every node (nodes run in their own process groups, so they would otherwise
//    outlive caf-run and keep training);
//  - a node failing as above stops the whole group: SIGTERM at once, SIGKILL --grace seconds later;
//  - its standard output that cannot be written (a full disk, a `| head` that ended) is a stop
//    request as a first signal (said on stderr; it is no signal: one after it is a first).
// --scheduler.max-threads=slots where a host's slots exceed fp8rl's default 8 CAF workers (fp8rl
// itself raises its default to a worker per learner and rollout plus two; a value passed here
// below that need is refused, so none is passed for slots <= 8).
// Exit codes: the controller's (or, with --fail-fast / at startup, the first failing node's)
// code (after a signal the controller's: 128+signal where it stopped the run at it), 128+signal if
// caf-run was signalled with no controller running; 2 for bad input.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "actors/topology.hpp"
#include "models/json_io.hpp"
#include "tools/stdout_check.hpp"

namespace {

using fp8rl::actors::host_canonical;  // 127.0.0.1, localhost, ::1: one host (topology.hpp)
using fp8rl::actors::host_is_local;

struct host_entry {
  std::string host;
  int slots = 0;
};

std::vector<host_entry> read_hostfile(const std::string& path) {
  if (std::filesystem::is_directory(path)) throw std::invalid_argument(path + ": is a directory, not a hostfile");
  std::ifstream f(path);
  if (!f) throw std::invalid_argument(fp8rl::models::open_failure(path));
  std::vector<host_entry> hosts;
  std::map<std::string, std::pair<int, std::string>> line_of;  // a host listed again (also as another local name) took the last entry's slots, silently
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (auto c = line.find('#'); c != std::string::npos) line.erase(c);
    std::istringstream is(line);
    host_entry h;
    if (!(is >> h.host)) continue;
    std::string tok;
    if (const auto [it, fresh] = line_of.emplace(host_canonical(h.host), std::pair(n, h.host)); !fresh)
      throw std::invalid_argument(path + ":" + std::to_string(n) + ": host '" + h.host + "' is already on line " +
                                  std::to_string(it->second.first) +
                                  (it->second.second != h.host ? " (as '" + it->second.second + "': the same machine)" : ""));
    bool slots_given = false;
    while (is >> tok) {
      if (tok.rfind("slots=", 0) != 0) throw std::invalid_argument(path + ":" + std::to_string(n) + ": unknown field '" + tok + "'");
      if (std::exchange(slots_given, true)) throw std::invalid_argument(path + ":" + std::to_string(n) + ": slots given twice");
      const std::string v = tok.substr(6);
      int slots = 0;
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), slots);
      if (ec != std::errc{} || end != v.data() + v.size() || slots <= 0 || slots > (1 << 20))  // all of it: "4x" was 4
        throw std::invalid_argument(path + ":" + std::to_string(n) + ": slots must be an integer in [1, 2^20], got '" + v + "'");
      h.slots = slots;
    }
    hosts.push_back(h);
  }
  if (hosts.empty()) throw std::invalid_argument(path + ": no hosts");
  return hosts;
}

// Why the local nodes could not exec `prog` from `wdir` (execvp's lookup after their chdir: a name
// without '/' on PATH -- glibc's default path where PATH is unset -- its relative entries and any
// path with '/' relative to wdir); empty when they can.
std::string exec_problem(const std::string& prog, const std::string& wdir) {
  auto problem = [](const std::filesystem::path& p) -> std::string {
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) return p.string() + ": no such file";
    if (!std::filesystem::is_regular_file(p, ec)) return p.string() + ": not a regular file";
    if (access(p.c_str(), X_OK) != 0) return p.string() + ": " + std::strerror(errno);
    return "";
  };
  auto from_wdir = [&](const std::filesystem::path& p) { return p.is_absolute() ? p : std::filesystem::path(wdir) / p; };
  if (prog.find('/') != std::string::npos) return problem(from_wdir(prog));
  std::string path;
  if (const char* env = std::getenv("PATH")) {
    path = env;
  } else if (const size_t n = confstr(_CS_PATH, nullptr, 0); n > 0) {
    path.resize(n);
    confstr(_CS_PATH, path.data(), n);
    path.pop_back();  // the NUL
  }
  std::istringstream dirs(path);
  for (std::string d; std::getline(dirs, d, ':');)
    if (problem(from_wdir(d.empty() ? "." : d) / prog).empty()) return "";
  return prog + ": not found on PATH";
}

std::string shell_quote(const std::string& s) {
  std::string o = "'";
  for (char c : s) o += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return o + "'";
}

struct child {
  std::string name;
  pid_t pid = -1;
  int fd = -1;  // merged stdout/stderr
  std::string partial;
  bool done = false, ready = false;  // ready: printed "fp8rl node NAME ready on ..."
  int code = 0;
};

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
volatile sig_atomic_t g_signal = 0, g_signals = 0;  // the first signal, how many came
volatile sig_atomic_t g_first_from_parent = 0;
timespec g_first_at{};  // CLOCK_MONOTONIC; written before g_signals counts the first
// A repeat within 2 s that came, as the first, from the parent process is the same signal: a
// wrapper (`timeout`) signals caf-run and its process group at once, and a second signal SIGKILLs
// every node. (The three stop signals are blocked while this runs: no nesting.)
void on_signal(int sig, siginfo_t* info, void*) {
  const bool from_parent = info && info->si_code == SI_USER && info->si_pid == getppid();
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (!g_signal) {
    g_signal = sig;
    g_first_from_parent = from_parent;
    g_first_at = now;
  } else if (from_parent && g_first_from_parent &&
             (now.tv_sec - g_first_at.tv_sec) * 1000 + (now.tv_nsec - g_first_at.tv_nsec) / 1000000 < 2000) {
    return;
  }
  g_signals = g_signals + 1;
}

// Standard output that cannot be written (a full disk; a closed pipe: SIGPIPE is ignored here) is
// a stop request, as fp8rl train takes SIGPIPE, said once on stderr: every node's lines were lost
// in silence and the run went on to its end, exit 0. It counts as no signal: one signal after it
// is a first (the stop signals are held off while it is recorded, so none is lost or counted twice).
bool g_output_failed = false, g_output_stop = false;  // g_output_stop: the failure was the first stop request
void output_checked() {
  if (g_output_failed) return;
  const int err = fp8rl::tools::stdout_failure();
  if (err == 0) return;
  g_output_failed = true;
  std::fprintf(stderr, "caf-run: writing standard output failed%s; stopping the run as on a signal\n", fp8rl::tools::stdout_failure_why(err).c_str());
  sigset_t stop, old;
  sigemptyset(&stop);
  for (int sig : kStopSignals) sigaddset(&stop, sig);
  sigprocmask(SIG_BLOCK, &stop, &old);
  if (!g_signal) {
    g_signal = SIGPIPE;
    g_output_stop = true;
  }
  sigprocmask(SIG_SETMASK, &old, nullptr);
}

void relay(child& c, bool flush_all) {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(c.fd, buf, sizeof buf);
    if (n <= 0) break;
    c.partial.append(buf, static_cast<size_t>(n));
    if (!flush_all && n < static_cast<ssize_t>(sizeof buf)) break;
  }
  size_t p;
  while ((p = c.partial.find('\n')) != std::string::npos) {
    const std::string tag = "fp8rl node " + c.name + " ready on ";
    if (p >= tag.size() && c.partial.compare(0, tag.size(), tag) == 0) c.ready = true;
    std::printf("[%s] %s\n", c.name.c_str(), c.partial.substr(0, p).c_str());
    c.partial.erase(0, p + 1);
  }
  if (flush_all && !c.partial.empty()) { std::printf("[%s] %s\n", c.name.c_str(), c.partial.c_str()); c.partial.clear(); }
  output_checked();
}

// 128 + SIGHUP/SIGINT/SIGTERM/SIGPIPE: how fp8rl train exits after a stop on a signal (checkpointed)
bool stopped_on_signal(int code) {
  return code == 128 + SIGHUP || code == 128 + SIGINT || code == 128 + SIGTERM || code == 128 + SIGPIPE;
}

const char* const kUsage =
    "usage: caf-run --hostfile FILE --topology FILE [options] -- CMD ARGS...\n"
    "Starts one process per topology node (fork/exec here, ssh to other hosts) running\n"
    "  CMD ARGS... --topology FILE --node NAME [--scheduler.max-threads=N]\n"
    "with its output prefixed by the node's name. CMD is the fp8rl program as every host sees it\n"
    "(a path: caf-run does not search the build directory), e.g. $PWD/build/bin/fp8rl train ...\n"
    "  --hostfile FILE     lines \"<host> [slots=N]\"; a node runs on the host equal to its \"host\";\n"
    "                      slots above 8 (fp8rl's default CAF workers) become --scheduler.max-threads=N\n"
    "                      for every node on that host (each node's own need is a worker per learner\n"
    "                      and rollout plus two: fp8rl raises its default to that)\n"
    "  --topology FILE     the topology (configs/topologies/); the nodes get its absolute path\n"
    "  --wdir DIR          working directory of every process (default: the current one): CMD's\n"
    "                      relative paths are relative to it\n"
    "  --grace SECONDS     after the controller exits: wait SECONDS, SIGTERM, SECONDS, SIGKILL;\n"
    "                      when a node fails: SIGTERM at once, SIGKILL SECONDS later (default 5)\n"
    "  --fail-fast         any node's failure stops the group (default: only before the run is up,\n"
    "                      or the controller's; afterwards the controller decides)\n"
    "Ctrl-C (SIGINT, SIGTERM, SIGHUP): the controller node stops the run after the step in progress,\n"
    "checkpointed, and the other nodes with it; a second one SIGKILLs every node. Its standard output\n"
    "failing (a full disk, a | head that ended) stops the run alike (no signal; said on stderr).\n"
    "Exit code: the controller's (or the first failing node's; under a signal the controller's own,\n"
    "128+signal where it stopped at it), 128+signal when caf-run was signalled with no controller\n"
    "running, 2 for bad input.\n";
struct run_options {
  std::string hostfile, topofile, wdir;
  int grace = 5;
  bool fail_fast = false;
  std::vector<std::string> cmd;
};

// The command line; nullopt after --help. Throws std::invalid_argument naming the option.
std::optional<run_options> options_parse(int argc, char** argv) {
  run_options o;
  auto& [hostfile, topofile, wdir, grace, fail_fast, cmd] = o;
  std::set<std::string> seen;  // an option given twice is an error, as in fp8rl (the last one won)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::optional<std::string> inline_val;  // --key=value as well as --key value
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos && eq > 2) {
      inline_val = a.substr(eq + 1);
      a = a.substr(0, eq);
      if (inline_val->empty()) throw std::invalid_argument("option " + a + " has an empty value");
    }
    auto val = [&] {
      if (inline_val) return *inline_val;
      if (i + 1 >= argc) throw std::invalid_argument("option " + a + " needs a value");
      return std::string(argv[++i]);
    };
    if (a == "--") { for (++i; i < argc; ++i) cmd.push_back(argv[i]); break; }
    if (a == "--help" || a == "-h") { std::fputs(kUsage, stdout); return std::nullopt; }
    if (!seen.insert(a).second) throw std::invalid_argument("option " + a + " given twice");
    if (a == "--fail-fast" && inline_val) throw std::invalid_argument("option --fail-fast takes no value");
    if (a == "--hostfile") hostfile = val();
    else if (a == "--topology") topofile = val();
    else if (a == "--wdir") wdir = val();
    else if (a == "--grace") {
      const std::string v = val();
      char* end = nullptr;
      const long g = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || g < 0 || g > 3600) throw std::invalid_argument("--grace '" + v + "': seconds in [0, 3600]");
      grace = static_cast<int>(g);
    }
    else if (a == "--fail-fast") fail_fast = true;
    else if (a.rfind("-", 0) != 0 && std::find(argv + i, argv + argc, std::string("--")) == argv + argc)  // no -- follows
      throw std::invalid_argument("unknown option '" + a + "': the command to run goes after -- (caf-run ... -- " + a + " ...)");
    else throw std::invalid_argument("unknown option '" + a + "' (caf-run --help lists the options)");
  }
  if (hostfile.empty() || topofile.empty() || cmd.empty())
    throw std::invalid_argument("--hostfile, --topology and -- CMD are required (caf-run --help)");
  return o;
}

// caf-run's handler for the stop signals (on_signal); SIGPIPE ignored. Returns the signals it
// caught: nohup's ignored SIGHUP stays ignored, here and in the nodes.
std::vector<int> stop_signals_install() {
  signal(SIGPIPE, SIG_IGN);
  std::vector<int> caught;
  struct sigaction sa {};
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;  // (an interrupted write of the relay failed with EINTR: output_checked)
  sigemptyset(&sa.sa_mask);
  for (int sig : kStopSignals) sigaddset(&sa.sa_mask, sig);
  for (int sig : kStopSignals) {
    struct sigaction old {};
    sigaction(sig, nullptr, &old);
    if (old.sa_handler == SIG_IGN) continue;
    sigaction(sig, &sa, nullptr);
    caught.push_back(sig);
  }
  return caught;
}

// Starts node n (fork/exec here, ssh on another host) in its own process group, its output on a
// pipe; `caught`: the stop signals whose default the child takes back.
child node_spawn(const fp8rl::actors::node_spec* n, const host_entry* h, const run_options& o, const std::vector<int>& caught) {
  std::vector<std::string> args = o.cmd;
  args.push_back("--topology");
  args.push_back(std::filesystem::absolute(o.topofile).string());  // the file checked here, also from --wdir
  args.push_back("--node");
  args.push_back(n->name);
  if (h->slots > 8) args.push_back("--scheduler.max-threads=" + std::to_string(h->slots));
  if (!host_is_local(n->host)) {
    std::string remote = "cd " + shell_quote(o.wdir) + " && exec";
    for (const auto& x : args) {  // (not `" " + shell_quote(x)`: GCC 12's -Wrestrict false positive there)
      remote += ' ';
      remote += shell_quote(x);
    }
    args = {"ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=10", n->host, remote};
  }
  int pfd[2];
  if (pipe(pfd) != 0) throw std::runtime_error("pipe failed");
  // the stop signals wait across fork: between fork and exec the child ran caf-run's handler,
  // which set a flag in its own copy, and the node ignored a SIGTERM; the child takes their
  // default actions before anything can arrive, the parent's handler sees what came meanwhile
  sigset_t stop, before;
  sigemptyset(&stop);
  for (int sig : kStopSignals) sigaddset(&stop, sig);
  sigprocmask(SIG_BLOCK, &stop, &before);
  const pid_t pid = fork();
  if (pid == 0) {
    for (int sig : caught) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &before, nullptr);
    setpgid(0, 0);
    dup2(pfd[1], 1);
    dup2(pfd[1], 2);
    close(pfd[0]);
    close(pfd[1]);
    if (host_is_local(n->host) && chdir(o.wdir.c_str()) != 0) {
      std::fprintf(stderr, "caf-run: cannot enter %s: %s\n", o.wdir.c_str(), std::strerror(errno));
      _exit(126);
    }
    std::vector<char*> av;
    for (auto& x : args) av.push_back(x.data());
    av.push_back(nullptr);
    execvp(av[0], av.data());
    std::fprintf(stderr, "caf-run: cannot execute %s: %s\n", av[0], std::strerror(errno));
    _exit(127);
  }
  sigprocmask(SIG_SETMASK, &before, nullptr);
  setpgid(pid, pid);  // also here: a signal before the child's own setpgid must still reach its group
  close(pfd[1]);
  fcntl(pfd[0], F_SETFL, O_NONBLOCK);
  child k;
  k.name = n->name;
  k.pid = pid;
  k.fd = pfd[0];
  std::printf("caf-run: started %s (pid %d) on %s\n", n->name.c_str(), pid, n->host.c_str());
  output_checked();
  return k;
}

// Relays the nodes' output and supervises them until every one has exited (see the header:
// failures, signals, --grace); returns caf-run's exit code.
int group_supervise(std::vector<child>& kids, const std::string& controller_name, const run_options& opts) {
  const int grace = opts.grace;
  const bool fail_fast = opts.fail_fast;
  int first_failure = 0;
  std::string failed;
  using clk = std::chrono::steady_clock;
  clk::time_point term_at = clk::time_point::max(), kill_at = clk::time_point::max();
  auto stop_group = [&](clk::time_point when) {  // SIGTERM at `when`, SIGKILL grace seconds later
    if (when < term_at) {
      term_at = when;
      kill_at = when + std::chrono::seconds(grace);
    }
  };
  bool term_sent = false, kill_sent = false, controller_done = false, waiting_said = false, signalled = false;
  while (true) {
    std::vector<pollfd> fds;
    for (auto& k : kids) if (k.fd >= 0) fds.push_back({k.fd, POLLIN, 0});
    if (!fds.empty()) poll(fds.data(), fds.size(), 200);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (auto& k : kids) if (k.fd >= 0) relay(k, false);
    if (g_signal && !signalled) {
      signalled = true;
      const auto ctl = std::find_if(kids.begin(), kids.end(), [&](const child& k) { return k.name == controller_name && !k.done; });
      if (ctl != kids.end() && first_failure == 0) {  // the exit code is the controller's
        // the controller stops the run (after the step in progress, checkpointed) and every node with
        // it; its exit gives the others --grace as always. They get no signal from here: one is a stop
        // request of their own, and a second (systemd or scancel signal the whole group) kills at once
        std::printf("caf-run: SIG%s; the controller node %s stops the run after the step in progress, checkpointed, and "
                    "the other nodes with it (a second signal SIGKILLs every node)\n", sigabbrev_np(g_signal), controller_name.c_str());
        kill(-ctl->pid, SIGTERM);
      } else {  // no controller to stop the run, or the group stops already
        if (first_failure == 0 && !controller_done) {
          first_failure = 128 + g_signal;
          failed = "caf-run";
        }
        std::printf("caf-run: SIG%s; stopping the group (SIGKILL in %d s or at a second signal)\n", sigabbrev_np(g_signal), grace);
        stop_group(clk::now());
      }
      output_checked();
    }
    if (g_signals >= 2 && !kill_sent && kill_at > clk::now()) {
      std::printf("caf-run: a second signal; SIGKILL now\n");
      term_sent = true;  // no SIGTERM first (it said "stopping X (SIGTERM)" for nodes it then killed)
      kill_at = clk::now();
    }
    bool all_done = true;
    for (auto& k : kids) {
      if (k.done) continue;
      int st = 0;
      if (waitpid(k.pid, &st, WNOHANG) == k.pid) {
        k.done = true;
        relay(k, true);
        close(k.fd);
        k.fd = -1;
        k.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        // 128 + N also when the node exits with it itself: the signal is named where there was one
        const char* sig = WIFSIGNALED(st) ? sigabbrev_np(WTERMSIG(st)) : nullptr;
        std::printf("caf-run: %s exited with %d%s%s%s\n", k.name.c_str(), k.code, sig ? " (killed by SIG" : "", sig ? sig : "",
                    sig ? ")" : "");
        output_checked();
        const bool is_controller = k.name == controller_name;
        // not up yet: the run cannot start; after the controller, the others only follow it
        const bool decisive = !controller_done && (fail_fast || is_controller || !k.ready);
        // not while the group stops (caf-run's own signals or kills ended it), nor for a node that
        // ended on a stop signal (fp8rl passes it to the controller as a stop request)
        if (k.code != 0 && !decisive && !controller_done && first_failure == 0 && !signalled && !term_sent &&
            !stopped_on_signal(k.code))
          std::printf("caf-run: %s failed (exit %d); the controller decides whether the run goes on\n", k.name.c_str(), k.code);
        if (k.code != 0 && decisive && first_failure == 0) {
          first_failure = k.code;
          failed = k.name;
          // a controller that stopped the run on a signal told the others: they get --grace below
          if (!(signalled && is_controller)) stop_group(clk::now());
        }
        if (is_controller) {
          controller_done = true;
          stop_group(clk::now() + std::chrono::seconds(grace));  // the rest should follow it
        }
      } else {
        all_done = false;
      }
    }
    if (all_done) break;
    // the others have all exited and the controller has not: say whom caf-run waits for (a
    // stopped or stuck controller kept it waiting without a word)
    if (!waiting_said && kids.size() > 1 &&  // a single node has no others to have exited
        std::all_of(kids.begin(), kids.end(), [&](const child& k) { return k.done || k.name == controller_name; })) {
      waiting_said = true;
      std::printf("caf-run: every other node has exited; waiting for the controller node %s (Ctrl-C stops it)\n",
                  controller_name.c_str());
      output_checked();
    }
    const auto now = clk::now();
    if (!term_sent && now >= term_at) {
      term_sent = true;
      for (auto& o : kids)
        if (!o.done) {
          std::printf("caf-run: stopping %s (SIGTERM)\n", o.name.c_str());
          kill(-o.pid, SIGTERM);
        }
      output_checked();
    }
    if (!kill_sent && now >= kill_at) {
      kill_sent = true;
      for (auto& o : kids)
        if (!o.done) {
          if (g_signals >= 2) std::printf("caf-run: %s killed (SIGKILL)\n", o.name.c_str());
          else std::printf("caf-run: %s did not exit within %d s of SIGTERM (SIGKILL)\n", o.name.c_str(), grace);
          kill(-o.pid, SIGKILL);
        }
      output_checked();
    }
  }
  if (signalled)
    std::fprintf(stderr, "caf-run: stopped by %s; every node was stopped%s\n", g_output_stop ? "its failed output" : "a signal",
                 first_failure && failed != "caf-run" ? (" (node " + failed + " exited with " + std::to_string(first_failure) + ")").c_str() : "");
  else if (first_failure && failed == controller_name && stopped_on_signal(first_failure))  // a node's signal, passed on
    std::fprintf(stderr, "caf-run: the controller node %s stopped the run on a signal (exit %d); the group was stopped\n",
                 failed.c_str(), first_failure);
  else if (first_failure)
    std::fprintf(stderr, "caf-run: node %s failed (exit %d); the group was stopped\n", failed.c_str(), first_failure);
  return first_failure;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto opts = options_parse(argc, argv);
    if (!opts) return 0;
    run_options o = *opts;
    const auto hosts = read_hostfile(o.hostfile);
    const auto topo = fp8rl::actors::topology_load(o.topofile);
    if (o.wdir.empty()) {
      char b[4096];
      o.wdir = getcwd(b, sizeof b) ? b : ".";
    }
    // the local nodes chdir there: a missing directory made each of them _exit(126) without a word
    bool any_local = false;
    for (const auto& n : topo.nodes) any_local = any_local || host_is_local(n.host);
    if (any_local && !std::filesystem::is_directory(o.wdir))
      throw std::invalid_argument("--wdir " + o.wdir + ": not a directory on this host");
    // the program too, before any node starts: each local node said "cannot execute" itself (exit
    // 127), a line lost when another node failed first and the group was stopped
    if (const std::string why = any_local ? exec_problem(o.cmd[0], o.wdir) : ""; !why.empty())
      throw std::invalid_argument("cannot execute CMD: " + why);
    // order: remote-role nodes first, controller last
    std::vector<const fp8rl::actors::node_spec*> order;
    for (const auto& n : topo.nodes) if (!n.has("controller")) order.push_back(&n);
    for (const auto& n : topo.nodes) if (n.has("controller")) order.push_back(&n);
    std::vector<child> kids;
    std::string controller_name = topo.controller_node().name;
    const std::vector<int> caught = stop_signals_install();
    // every node's host entry before the first fork: a node left out stopped caf-run with the
    // earlier nodes started, in their own process groups, never stopped
    std::vector<const host_entry*> entry;
    for (const auto* n : order) {
      const host_entry* h = nullptr;
      for (const auto& e : hosts)
        if (host_canonical(e.host) == host_canonical(n->host)) h = &e;
      if (!h) throw std::invalid_argument(o.hostfile + ": no host entry for node '" + n->name + "' (host " + n->host + ")");
      entry.push_back(h);
    }
    for (size_t i = 0; i < order.size(); ++i) kids.push_back(node_spawn(order[i], entry[i], o, caught));
    return group_supervise(kids, controller_name, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "caf-run: %s\n", e.what());
    return 2;
  }
}
