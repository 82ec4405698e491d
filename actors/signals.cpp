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
// The first signal, packed so one CAS records all of it (two threads, or a nested handler, may take
// two signals at once): 0 = none; else signal | from_parent << 8 | (CLOCK_MONOTONIC ms + 1) << 9.
std::atomic<uint64_t> g_first{0};
std::atomic<bool> g_immediate{false};  // while the run is wired: a signal's own action at once
static_assert(std::atomic<uint64_t>::is_always_lock_free, "used in a signal handler");
constexpr uint64_t kPassedOnMs = 2000;  // caf-run passes its signal on within ms; 2 s is generous

uint64_t monotonic_ms() {  // async-signal-safe
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000 + uint64_t(t.tv_nsec) / 1'000'000;
}

void say(const char* msg) {  // async-signal-safe
  size_t n = 0;
  while (msg[n]) ++n;
  [[maybe_unused]] const ssize_t w = ::write(2, msg, n);
}

[[noreturn]] void die_now(int sig) {  // async-signal-safe
  ::signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  ::sigprocmask(SIG_UNBLOCK, &one, nullptr);  // inside its own handler the signal is blocked
  ::raise(sig);
  ::_exit(128 + sig);
}

// Records the first signal; true if this one is it.
bool record_first(int sig, bool from_parent, uint64_t now) {
  uint64_t none = 0;
  return g_first.compare_exchange_strong(none, uint64_t(sig) | uint64_t(from_parent) << 8 | (now + 1) << 9);
}

extern "C" void stop_signal_caught(int sig, siginfo_t* info, void*) {
  const bool from_parent = info && info->si_code == SI_USER && info->si_pid == ::getppid();
  const uint64_t now = monotonic_ms();
  if (g_immediate) {
    say("fp8rl: a signal while the run's actors are wired: stopping at once (nothing was trained yet)\n");
    die_now(sig);
  }
  if (!record_first(sig, from_parent, now)) {
    // caf-run passes a signal on to the controller node; where the whole group got one as well
    // (systemd, scancel) the controller has two, and they are one stop, not the second signal
    const uint64_t first = g_first;
    if (signal_same_stop((first >> 9) - 1, first >> 8 & 1, now, from_parent)) return;
    say("fp8rl: a second signal: stopping at once (steps after the last checkpoint are redone on --resume)\n");
    die_now(sig);
  }
  say(sig == SIGINT    ? "fp8rl: SIGINT: stopping (a run after the step in progress, checkpointed there); a second signal stops at once\n"
      : sig == SIGTERM ? "fp8rl: SIGTERM: stopping (a run after the step in progress, checkpointed there); a second signal stops at once\n"
                       : "fp8rl: SIGHUP: stopping (a run after the step in progress, checkpointed there); a second signal stops at once\n");
}

// A write to a pipe or socket nobody reads: under caf-run over ssh the launcher is gone (its
// signal reached the local ssh client only), under `| tee` the reader. A stop request like the
// first signal, never a second one (a run stopping writes on).
extern "C" void stop_pipe_caught(int) {
  if (record_first(SIGPIPE, false, monotonic_ms()))
    say("fp8rl: SIGPIPE (the output's reader is gone): stopping (a run after the step in progress, checkpointed there)\n");
}

}  // namespace

bool signal_same_stop(uint64_t first_ms, bool first_from_parent, uint64_t now_ms, bool from_parent) {
  // async-signal-safe; the unsigned now - first wrapped where this handler read the clock first
  // (a repeat taken for a second signal: the node died at once, unsaved)
  const uint64_t apart = now_ms > first_ms ? now_ms - first_ms : first_ms - now_ms;
  return (from_parent || first_from_parent) && apart < kPassedOnMs;
}

stop_signals::stop_signals() {
  g_first = 0;
  g_immediate = false;
  struct sigaction sa {};
  sa.sa_sigaction = stop_signal_caught;
  sa.sa_flags = SA_RESTART | SA_SIGINFO;  // fewer EINTRs in other threads (epoll/poll/sleeps return it anyway; CAF retries them)
  sigemptyset(&sa.sa_mask);
  static_assert(std::size(kStopSignals) == 3, "previous_ holds three");
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    sigaction(kStopSignals[i], nullptr, &previous_[i]);
    if (previous_[i].sa_handler != SIG_IGN) sigaction(kStopSignals[i], &sa, nullptr);  // nohup: stays ignored
  }
  struct sigaction pipe {};
  pipe.sa_handler = stop_pipe_caught;
  pipe.sa_flags = SA_RESTART;
  sigemptyset(&pipe.sa_mask);
  sigaction(SIGPIPE, &pipe, &previous_pipe_);
}

stop_signals::~stop_signals() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &previous_[i], nullptr);
  sigaction(SIGPIPE, &previous_pipe_, nullptr);
}

int stop_signals::pending() { return static_cast<int>(g_first & 0xff); }

void stop_signals::immediate(bool on) { g_immediate = on; }

std::string stop_signals::name(int sig) { return std::string("SIG") + sigabbrev_np(sig); }

void stop_signals::interruption_point(const std::string& where) {
  if (const int sig = pending()) throw interrupted(sig, name(sig) + " " + where);
}

void stop_signals::die(int sig) { die_now(sig); }

}  // namespace fp8rl::actors
