// actors/signals.hpp -- SIGINT, SIGTERM and SIGHUP while `fp8rl train` runs.
// defines: stop_signals, interrupted, signal_same_stop
//
// The first one is recorded and said on stderr: a start unwinds at its next interruption point
// (an --overwrite start gives the earlier run back first); a running run stops after the step in
// progress, checkpointed there (the main thread sends the controller a stop). A second one takes
// the signal's own action at once. Signals ignored on entry (nohup) stay ignored. SIGPIPE (the
// output's reader is gone: a `| tee` that Ctrl-C ended too, or caf-run's ssh client) is a stop
// request like a first signal and never a second one (it killed the run unsaved). A second one that comes within 2 s of the first, one of them from the parent
// process, is the same stop: caf-run passes its signal on to the controller node, which systemd or
// scancel may have signalled too.
#pragma once
#include <csignal>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fp8rl::actors {

// A start given up at an interruption point; `sig` is the signal (the process exits 128 + sig).
struct interrupted : std::runtime_error {
  int sig;
  interrupted(int s, const std::string& what) : std::runtime_error(what), sig(s) {}
};

// Whether a later signal (at now_ms, from the parent or not) is the first one again (recorded at
// first_ms): one of the two came from the parent, within 2 s of each other -- either way round:
// two threads take the two signals at once, and the later recorded can have read the clock first.
bool signal_same_stop(uint64_t first_ms, bool first_from_parent, uint64_t now_ms, bool from_parent);

class stop_signals {  // one at a time; the previous dispositions come back at its end
 public:
  stop_signals();
  ~stop_signals();
  stop_signals(const stop_signals&) = delete;
  stop_signals& operator=(const stop_signals&) = delete;
  static int pending();  // the first signal that came, 0 if none
  static std::string name(int sig);  // "SIGINT"
  // Throws interrupted ("SIGINT <where>") once a signal came.
  static void interruption_point(const std::string& where);
  // The signal's own action now (its handler reset to the default first).
  [[noreturn]] static void die(int sig);
  // While on (the run's actors being wired: a remote spawn or a node's start can take a minute), a
  // signal takes its own action at once: nothing was trained, and the main thread cannot act on it.
  static void immediate(bool on);

 private:
  struct sigaction previous_[3], previous_pipe_;
};

}  // namespace fp8rl::actors
