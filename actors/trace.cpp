// actors/trace.cpp -- the process-wide JSONL trace writer.
#include "actors/trace.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace fp8rl::actors {

int64_t trace_now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

trace_writer& trace_writer::process() {
  static trace_writer w;
  return w;
}

void trace_writer::open(const std::string& path, const std::string& node) {
  std::lock_guard<std::mutex> g(mu_);
  if (path.empty()) return;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  out_.open(path, std::ios::app);
  node_ = node;
  enabled_ = static_cast<bool>(out_);
}

void trace_writer::close() {
  std::lock_guard<std::mutex> g(mu_);
  if (out_.is_open()) out_.flush(), out_.close();
  enabled_ = false;
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

void trace_send(const std::string& actor, const char* type, msg::trace_ctx& ctx, int64_t wv, double bytes) {
  auto& w = trace_writer::process();
  if (!w.enabled()) return;
  ctx.span_id = w.next_message_id();
  if (ctx.trace_id == 0) ctx.trace_id = ctx.span_id;
  ctx.lamport = w.lamport_tick(actor);
  w.event(actor, type, "send", trace_now_us(), 0, bytes, wv, -1, ctx.lamport, ctx.span_id);
}

void trace_recv(const std::string& actor, const char* type, const msg::trace_ctx& ctx, int64_t wv, double bytes) {
  auto& w = trace_writer::process();
  if (!w.enabled() || ctx.span_id == 0) return;  // an untraced sender (or tracing off there)
  const uint64_t clock = w.lamport_tick(actor, ctx.lamport);
  w.event(actor, type, "recv", trace_now_us(), 0, bytes, wv, -1, clock, ctx.span_id);
}

void trace_writer::event(const std::string& actor, const std::string& name, const char* kind, int64_t ts_us,
                         int64_t dur_us, double bytes, int64_t wv, int64_t sv, uint64_t lamport, uint64_t msg) {
  if (!enabled_) return;
  nlohmann::json j = {{"node", node_}, {"actor", actor}, {"name", name}, {"kind", kind}, {"ts", ts_us}, {"dur", dur_us}};
  if (bytes > 0) j["bytes"] = bytes;
  if (wv >= 0) j["wv"] = wv;
  if (sv >= 0) j["sv"] = sv;
  if (lamport) j["lamport"] = lamport;
  if (msg) j["msg"] = msg;
  static const int64_t pid = ::getpid();
  j["pid"] = pid;  // a resumed run appends to the same file: its clocks start again
  std::lock_guard<std::mutex> g(mu_);
  out_ << j.dump() << '\n';
  if (++pending_ % 256 == 0) out_.flush();
}

}  // namespace fp8rl::actors
