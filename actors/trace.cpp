// actors/trace.cpp -- the process-wide JSONL trace writer.
#include "actors/trace.hpp"

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

void trace_writer::event(const std::string& actor, const std::string& name, const char* kind, int64_t ts_us,
                         int64_t dur_us, double bytes, int64_t wv, int64_t sv, uint64_t lamport) {
  if (!enabled_) return;
  nlohmann::json j = {{"node", node_}, {"actor", actor}, {"name", name}, {"kind", kind}, {"ts", ts_us}, {"dur", dur_us}};
  if (bytes > 0) j["bytes"] = bytes;
  if (wv >= 0) j["wv"] = wv;
  if (sv >= 0) j["sv"] = sv;
  if (lamport) j["lamport"] = lamport;
  std::lock_guard<std::mutex> g(mu_);
  out_ << j.dump() << '\n';
  if (++pending_ % 256 == 0) out_.flush();
}

}  // namespace fp8rl::actors
