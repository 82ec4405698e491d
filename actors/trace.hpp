// actors/trace.hpp -- cheap per-process trace events (JSONL), merged offline by fp8rl-trace.
// defines: trace_writer, trace_span, trace_now_us
//
// One line per event: {"node", "actor", "name", "ts" (µs since epoch), "dur" (µs), "bytes",
// "wv" (weight version), "sv" (scale version), "lamport", "kind": "span"|"send"|"recv"}.
// Writes are buffered and flushed every few hundred events and at close; a disabled writer
// costs one branch per event.
#pragma once
#include <cstdint>
#include <fstream>
#include <mutex>
#include <string>

namespace fp8rl::actors {

int64_t trace_now_us();

class trace_writer {
 public:
  trace_writer() = default;
  // path empty: disabled
  void open(const std::string& path, const std::string& node);
  void close();
  bool enabled() const { return enabled_; }
  void event(const std::string& actor, const std::string& name, const char* kind, int64_t ts_us, int64_t dur_us,
             double bytes = 0, int64_t wv = -1, int64_t sv = -1, uint64_t lamport = 0);
  static trace_writer& process();  // the process-wide writer

 private:
  std::mutex mu_;
  std::ofstream out_;
  std::string node_;
  bool enabled_ = false;
  int64_t pending_ = 0;
};

// RAII span: records [construction, destruction) as one event.
class trace_span {
 public:
  trace_span(std::string actor, std::string name, int64_t wv = -1, double bytes = 0)
      : actor_(std::move(actor)), name_(std::move(name)), wv_(wv), bytes_(bytes), t0_(trace_now_us()) {}
  ~trace_span() {
    auto& w = trace_writer::process();
    if (w.enabled()) w.event(actor_, name_, "span", t0_, trace_now_us() - t0_, bytes_, wv_);
  }
  void set_version(int64_t wv) { wv_ = wv; }
  void set_bytes(double b) { bytes_ = b; }

 private:
  std::string actor_, name_;
  int64_t wv_;
  double bytes_;
  int64_t t0_;
};

}  // namespace fp8rl::actors
