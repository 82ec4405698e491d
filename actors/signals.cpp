// actors/signals.cpp -- see signals.hpp.
#include "actors/signals.hpp"

#include <signal.h>
#include <string.h>  // sigabbrev_np
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <ctime>
#include <cstdlib>
#include <iterator>

namespace fp8rl::actors {
namespace {

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
std::atomic<int> g_signal{0};  // lock-free: two threads may take two signals at once
std::atomic<int64_t> g_first_ns{0};            // when the first came (CLOCK_MONOTONIC)
std::atomic<bool> g_first_from_parent{false};  // ... and whether the parent process sent it
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free, "used in a signal handler");
constexpr int64_t kPassedOnNs = 2'000'000'000;  // caf-run passes its signal on within ms; 2 s is generous

int64_t monotonic_ns() {  // async-signal-safe
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

void say(const char* msg) {  // async-signal-safe
  size_t n = 0;
  while (msg[n]) ++n;
  [[maybe_unused]] const ssize_t w = ::write(2, msg, n);
}

extern "C" void stop_signal_caught(int sig, siginfo_t* info, void*) {
  const bool from_parent = info && info->si_code == SI_USER && info->si_pid == ::getppid();
  const int64_t now = monotonic_ns();
  if (int none = 0; !g_signal.compare_exchange_strong(none, sig)) {
    // caf-run passes a signal on to the controller node; where the whole group got one as well
    // (systemd, scancel) the controller has two, and they are one stop, not the second signal
    if ((from_parent || g_first_from_parent) && now - g_first_ns < kPassedOnNs) return;
    say("fp8rl: a second signal: stopping at once (steps after the last checkpoint are redone on --resume)\n");
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_first_ns = now;
  g_first_from_parent = from_parent;
  say(sig == SIGINT    ? "fp8rl: SIGINT: stopping (a run after the step in progress, checkpointed there); a second signal stops at once\n"
      : sig == SIGTERM ? "fp8rl: SIGTERM: stopping (a run after the step in progress, checkpointed there); a second signal stops at once\n"
                       : "fp8rl: SIGHUP: stopping (a run after the step in progress, checkpointed there); a second signal stops at once\n");
}

}  // namespace

stop_signals::stop_signals() {
  g_signal = 0;
  struct sigaction sa {};
  sa.sa_sigaction = stop_signal_caught;
  sa.sa_flags = SA_RESTART | SA_SIGINFO;  // fewer EINTRs in other threads (epoll/poll/sleeps return it anyway; CAF retries them)
  sigemptyset(&sa.sa_mask);
  static_assert(std::size(kStopSignals) == 3, "previous_ holds three");
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    sigaction(kStopSignals[i], nullptr, &previous_[i]);
    if (!(previous_[i].sa_flags & SA_SIGINFO) && previous_[i].sa_handler == SIG_IGN) continue;  // nohup: stays ignored
    sigaction(kStopSignals[i], &sa, nullptr);
  }
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &previous_pipe_);
}

stop_signals::~stop_signals() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &previous_[i], nullptr);
  sigaction(SIGPIPE, &previous_pipe_, nullptr);
}

int stop_signals::pending() { return g_signal; }

std::string stop_signals::name(int sig) { return std::string("SIG") + sigabbrev_np(sig); }

void stop_signals::interruption_point(const std::string& where) {
  if (const int sig = g_signal) throw interrupted(sig, name(sig) + " " + where);
}

void stop_signals::die(int sig) {
  ::signal(sig, SIG_DFL);
  ::raise(sig);
  std::_Exit(128 + sig);  // a signal blocked or ignored: the same code
}

}  // namespace fp8rl::actors
