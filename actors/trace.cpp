// actors/trace.cpp -- the process-wide JSONL trace writer.
#include "actors/trace.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <stdexcept>
#include <utility>

#include "models/log.hpp"

namespace fp8rl::actors {

int64_t trace_now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

trace_writer& trace_writer::process() {
  static trace_writer w;
  return w;
}

namespace {
// Appends s as a JSON string (quotes, backslashes and control characters escaped).
void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out += c;
    }
  }
  out += '"';
}
}  // namespace

void trace_writer::open(const std::string& path, const std::string& node, uint64_t max_bytes) {
  std::lock_guard<std::mutex> g(mu_);
  if (path.empty()) return;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  // a process killed mid-write (a resumed run appends to its file) left a torn last line: end it,
  // so this process's first event starts a line of its own
  bool torn = false;
  bytes_ = 0;
  if (std::ifstream prev(path, std::ios::binary | std::ios::ate); prev && prev.tellg() > 0) {
    bytes_ = static_cast<uint64_t>(prev.tellg());
    prev.seekg(-1, std::ios::end);
    torn = prev.get() != '\n';
  }
  out_.open(path, std::ios::app);
  if (!out_) throw std::runtime_error(path + ": cannot open for writing (--trace.enabled=false runs without traces)");
  path_ = path;
  if (torn) out_ << '\n', ++bytes_;
  prefix_ = "{\"node\":";
  json_string(prefix_, node);  // escaped once, not per event
  max_bytes_ = max_bytes;
  write_failed_ = false;
  enabled_ = static_cast<bool>(out_);
  check_cap();  // a resumed run's file may be there already
}

void trace_writer::close() {
  std::lock_guard<std::mutex> g(mu_);
  if (out_.is_open()) out_.close(), check_written();  // (some filesystems say ENOSPC only at the close)
  enabled_ = false;
}

void trace_writer::check_written() {
  if (out_ || write_failed_) return;  // (also after the cap: the close's flush of the last events)
  write_failed_ = true;
  enabled_ = false;
  log_get("trace")->warn("{}: writing trace events failed (disk full?); tracing stops here, the run goes on with its trace cut",
                         path_);
}

void trace_writer::check_cap() {
  if (max_bytes_ == 0 || bytes_ < max_bytes_ || !enabled_) return;
  enabled_ = false;
  log_get("trace")->warn("{}: {} bytes, its cap of {} bytes (trace.max_mb) reached; tracing stops here, the run goes on "
                         "(0: no cap)", path_, bytes_, max_bytes_);
}

uint64_t trace_writer::lamport_tick(const std::string& actor, uint64_t received) {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t& c = clocks_[actor];
  c = std::max(c, received) + 1;
  return c;
}

uint64_t trace_writer::next_message_id() {
  std::lock_guard<std::mutex> g(mu_);
  if (id_salt_ == 0) id_salt_ = (uint64_t(::getpid()) << 44) ^ (uint64_t(trace_now_us()) << 20);
  return id_salt_ + ++id_next_;
}

void trace_send(const std::string& actor, const char* type, msg::trace_ctx& ctx, int64_t wv, double bytes, int64_t sv,
                int64_t step) {
  auto& w = trace_writer::process();
  if (!w.enabled()) return;
  ctx.span_id = w.next_message_id();
  if (ctx.trace_id == 0) ctx.trace_id = ctx.span_id;
  ctx.lamport = w.lamport_tick(actor);
  w.event(actor, type, "send", trace_now_us(), 0, bytes, wv, sv, ctx.lamport, ctx.span_id, step);
}

void trace_recv(const std::string& actor, const char* type, const msg::trace_ctx& ctx, int64_t wv, double bytes,
                int64_t sv, int64_t step) {
  auto& w = trace_writer::process();
  if (!w.enabled() || ctx.span_id == 0) return;  // an untraced sender (or tracing off there)
  const uint64_t clock = w.lamport_tick(actor, ctx.lamport);
  w.event(actor, type, "recv", trace_now_us(), 0, bytes, wv, sv, clock, ctx.span_id, step);
}


void trace_send_bundle(const std::string& actor, msg::bundle_msg& m) {
  trace_send(actor, "bundle_msg", m.trace, static_cast<int64_t>(m.bundle->weight_version), 0,
             static_cast<int64_t>(m.bundle->snapshot.scale_version));
}

void trace_recv_bundle(const std::string& actor, const msg::bundle_msg& m) {
  trace_recv(actor, "bundle_msg", m.trace, static_cast<int64_t>(m.bundle->weight_version), 0,
             static_cast<int64_t>(m.bundle->snapshot.scale_version));
}

namespace {
// The oldest weight and scale versions of a group's tokens (-1: no token)
std::pair<int64_t, int64_t> group_oldest_versions(const msg::group_msg& g) {
  int64_t wv = -1, sv = -1;
  auto oldest = [](int64_t& at, uint64_t v) { at = at < 0 ? static_cast<int64_t>(v) : std::min(at, static_cast<int64_t>(v)); };
  for (const auto& s : g.samples) {
    for (uint64_t v : s.weight_version) oldest(wv, v);
    for (uint64_t v : s.scale_version) oldest(sv, v);
  }
  return {wv, sv};
}
}  // namespace

void trace_send_group(const std::string& actor, msg::group_msg& g) {
  if (!trace_writer::process().enabled()) return;
  const auto [wv, sv] = group_oldest_versions(g);
  trace_send(actor, "group_msg", g.trace, wv, 0, sv, static_cast<int64_t>(g.step));
}

void trace_recv_group(const std::string& actor, const msg::group_msg& g) {
  if (!trace_writer::process().enabled()) return;
  const auto [wv, sv] = group_oldest_versions(g);
  trace_recv(actor, "group_msg", g.trace, wv, 0, sv, static_cast<int64_t>(g.step));
}

// Formatted by hand, not through nlohmann::json: ~300 events per step of the default run, and
// building a json object per event took ~5% off the asynchronous run's samples/s.
void trace_writer::event(const std::string& actor, const std::string& name, const char* kind, int64_t ts_us,
                         int64_t dur_us, double bytes, int64_t wv, int64_t sv, uint64_t lamport, uint64_t msg, int64_t step) {
  if (!enabled_) return;
  static const long pid = ::getpid();
  thread_local std::string line;
  line.clear();
  line += prefix_;
  line += ",\"actor\":";
  json_string(line, actor);
  line += ",\"name\":";
  json_string(line, name);
  char b[256];
  int n = std::snprintf(b, sizeof b, ",\"kind\":\"%s\",\"ts\":%lld,\"dur\":%lld,\"pid\":%ld", kind, static_cast<long long>(ts_us),
                        static_cast<long long>(dur_us), pid);
  line.append(b, static_cast<size_t>(n));
  if (bytes > 0) line.append(b, static_cast<size_t>(std::snprintf(b, sizeof b, ",\"bytes\":%.17g", bytes)));
  if (wv >= 0) line.append(b, static_cast<size_t>(std::snprintf(b, sizeof b, ",\"wv\":%lld", static_cast<long long>(wv))));
  if (sv >= 0) line.append(b, static_cast<size_t>(std::snprintf(b, sizeof b, ",\"sv\":%lld", static_cast<long long>(sv))));
  if (step >= 0) line.append(b, static_cast<size_t>(std::snprintf(b, sizeof b, ",\"step\":%lld", static_cast<long long>(step))));
  if (lamport) line.append(b, static_cast<size_t>(std::snprintf(b, sizeof b, ",\"lamport\":%llu", static_cast<unsigned long long>(lamport))));
  if (msg) line.append(b, static_cast<size_t>(std::snprintf(b, sizeof b, ",\"msg\":%llu", static_cast<unsigned long long>(msg))));
  line += "}\n";
  std::lock_guard<std::mutex> g(mu_);
  if (!enabled_) return;  // (another thread's event may have reached the cap)
  out_ << line;
  bytes_ += line.size();
  if (++pending_ % 256 == 0) out_.flush(), check_written();
  check_cap();
}

}  // namespace fp8rl::actors
