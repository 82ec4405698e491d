// actors/trace.hpp -- cheap per-process trace events (JSONL), merged offline by fp8rl-trace.
// defines: trace_writer, trace_span, trace_now_us, trace_send, trace_recv, trace_send_step, trace_recv_step,
//          trace_send_bundle, trace_recv_bundle, trace_send_group, trace_recv_group
//
// One line per event: {"node", "actor", "name", "ts" (µs since epoch), "dur" (µs), "bytes",
// "wv" (weight version), "sv" (scale version of a bundle, an adoption, a decode step), "step" (the
// learner step a message is for: work, groups, admissions, batches), "lamport", "msg" (message id, send/recv),
// "pid", "kind": "span"|"send"|"recv"}. Spans time what an actor does; send/recv pairs (one "msg" id,
// the sender's Lamport clock carried in the message's trace_ctx) give the causal order across
// processes, from which fp8rl-trace computes vector clocks (caf-0.17.md §7).
// Writes are buffered and flushed every few hundred events and at close; a disabled writer
// costs one branch per event. A file that cannot be opened is the start's error; one whose writes
// fail (a full disk), or that reaches its cap (trace.max_mb: ~50 KB a step of the default run, ~4.6
// GB an hour uncapped), stops tracing with a warning naming it -- the run goes on, its trace cut.
#pragma once
#include <atomic>
#include <cstdint>
#include <fstream>
#include <mutex>
#include <map>
#include <string>

#include "messages/wire.hpp"

namespace fp8rl::actors {

int64_t trace_now_us();

class trace_writer {
 public:
  trace_writer() = default;
  // path empty: disabled; throws std::runtime_error naming a path it cannot open. max_bytes: the
  // file's cap, what it held before (a resumed run appends) included (0: none)
  void open(const std::string& path, const std::string& node, uint64_t max_bytes = 0);
  void close();
  bool enabled() const { return enabled_; }
  void event(const std::string& actor, const std::string& name, const char* kind, int64_t ts_us, int64_t dur_us,
             double bytes = 0, int64_t wv = -1, int64_t sv = -1, uint64_t lamport = 0, uint64_t msg = 0, int64_t step = -1);
  // The Lamport clock of `actor` (per actor name in this process): tick for a send, or
  // max(own, received) + 1 for a receive; returns the new value.
  uint64_t lamport_tick(const std::string& actor, uint64_t received = 0);
  uint64_t next_message_id();  // unique across processes (pid and start time in the high bits)
  static trace_writer& process();  // the process-wide writer

 private:
  std::mutex mu_;
  std::ofstream out_;
  std::string path_, prefix_;  // prefix_: {"node":"<node, JSON-escaped>": every line starts with it
  std::atomic<bool> enabled_{false};
  void check_written();  // (mu_ held) a failed write: tracing off, said once
  void check_cap();      // (mu_ held) the cap reached: tracing off, said once
  int64_t pending_ = 0;
  uint64_t bytes_ = 0, max_bytes_ = 0;  // the file's size (what this process found and wrote), its cap
  bool write_failed_ = false;           // said once
  std::map<std::string, uint64_t> clocks_;
  uint64_t id_salt_ = 0, id_next_ = 0;
};

// Message events: trace_send stamps ctx (a fresh id, the sender's clock) and records the send;
// trace_recv records the receive of a message stamped so. No-ops while tracing is off.
// wv / sv: the weight / scale version the message is of (-1: none); step: the learner step it is
// for (-1: none) -- a step is not a version: step s's groups are sampled under versions s - k .. s.
void trace_send(const std::string& actor, const char* type, msg::trace_ctx& ctx, int64_t wv = -1, double bytes = 0,
                int64_t sv = -1, int64_t step = -1);
void trace_recv(const std::string& actor, const char* type, const msg::trace_ctx& ctx, int64_t wv = -1, double bytes = 0,
                int64_t sv = -1, int64_t step = -1);
// A message for a learner step (work, admissions, batches): its step, no version.
inline void trace_send_step(const std::string& actor, const char* type, msg::trace_ctx& ctx, uint64_t step) {
  trace_send(actor, type, ctx, -1, 0, -1, static_cast<int64_t>(step));
}
inline void trace_recv_step(const std::string& actor, const char* type, const msg::trace_ctx& ctx, uint64_t step) {
  trace_recv(actor, type, ctx, -1, 0, -1, static_cast<int64_t>(step));
}
// A group_msg's events: its step, and the oldest weight and scale versions its tokens were sampled under.
void trace_send_group(const std::string& actor, msg::group_msg& g);
void trace_recv_group(const std::string& actor, const msg::group_msg& g);

// A bundle_msg's events, with the bundle's weight and scale versions.
void trace_send_bundle(const std::string& actor, msg::bundle_msg& m);
void trace_recv_bundle(const std::string& actor, const msg::bundle_msg& m);

// RAII span: records [construction, destruction) as one event.
class trace_span {
 public:
  trace_span(std::string actor, std::string name, int64_t wv = -1, double bytes = 0, int64_t sv = -1)
      : actor_(std::move(actor)), name_(std::move(name)), wv_(wv), sv_(sv), bytes_(bytes), t0_(trace_now_us()) {}
  ~trace_span() {
    auto& w = trace_writer::process();
    if (w.enabled()) w.event(actor_, name_, "span", t0_, trace_now_us() - t0_, bytes_, wv_, sv_);
  }
  void set_versions(int64_t wv, int64_t sv) { wv_ = wv, sv_ = sv; }

 private:
  std::string actor_, name_;
  int64_t wv_, sv_;
  double bytes_;
  int64_t t0_;
};

}  // namespace fp8rl::actors
