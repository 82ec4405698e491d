// tools/trace/trace_tool.cpp -- build/bin/fp8rl-trace: one timeline of a whole run.
//   fp8rl-trace merge RUN_DIR     -> RUN_DIR/trace.json (Chrome trace / Perfetto: load it in
//                                   ui.perfetto.dev or chrome://tracing), one row per actor
//   fp8rl-trace summary RUN_DIR   -> busy/idle per actor, generation/training overlap, staleness
//                                   histogram, weight-sync latency, calibration time
// Input: RUN_DIR/traces/*.jsonl (actors/trace.hpp) and RUN_DIR/metrics.jsonl.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct event {
  std::string node, actor, name, kind;
  int64_t ts = 0, dur = 0;
  double bytes = 0;
  int64_t wv = -1;
};

std::vector<event> load_events(const fs::path& run) {
  std::vector<event> ev;
  const fs::path dir = run / "traces";
  if (!fs::exists(dir)) throw std::invalid_argument(dir.string() + ": no traces (run with trace.enabled=true)");
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".jsonl") continue;
    std::ifstream in(f.path());
    std::string line;
    int64_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      auto j = json::parse(line, nullptr, false);
      if (j.is_discarded()) {  // a process killed mid-write leaves a torn last line
        std::fprintf(stderr, "fp8rl-trace: %s:%ld: skipping unparsable line\n", f.path().c_str(), long(n));
        continue;
      }
      event e;
      e.node = j.value("node", "?");
      e.actor = j.value("actor", "?");
      e.name = j.value("name", "?");
      e.kind = j.value("kind", "span");
      e.ts = j.value("ts", int64_t{0});
      e.dur = j.value("dur", int64_t{0});
      e.bytes = j.value("bytes", 0.0);
      e.wv = j.value("wv", int64_t{-1});
      ev.push_back(e);
    }
  }
  std::sort(ev.begin(), ev.end(), [](const event& a, const event& b) { return a.ts < b.ts; });
  if (ev.empty()) throw std::invalid_argument(dir.string() + ": no events");
  return ev;
}

int merge(const fs::path& run) {
  const auto ev = load_events(run);
  std::map<std::string, int> pid, tid;
  json out = json::array();
  for (const auto& e : ev) {
    if (!pid.count(e.node)) {
      pid[e.node] = static_cast<int>(pid.size()) + 1;
      out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid[e.node]}, {"args", {{"name", e.node}}}});
    }
    const std::string key = e.node + "/" + e.actor;
    if (!tid.count(key)) {
      tid[key] = static_cast<int>(tid.size()) + 1;
      out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid[e.node]}, {"tid", tid[key]}, {"args", {{"name", e.actor}}}});
    }
    json args = json::object();
    if (e.wv >= 0) args["weight_version"] = e.wv;
    if (e.bytes > 0) args["bytes"] = e.bytes;
    out.push_back({{"name", e.name}, {"ph", "X"}, {"ts", e.ts - ev.front().ts}, {"dur", std::max<int64_t>(e.dur, 1)},
                   {"pid", pid[e.node]}, {"tid", tid[key]}, {"args", args}});
  }
  const fs::path p = run / "trace.json";
  std::ofstream(p) << json{{"traceEvents", out}, {"displayTimeUnit", "ms"}}.dump();
  std::printf("wrote %s (%zu events, %zu processes, %zu actors)\n", p.c_str(), ev.size(), pid.size(), tid.size());
  return 0;
}

// total length of the union of intervals
int64_t covered(std::vector<std::pair<int64_t, int64_t>> iv) {
  std::sort(iv.begin(), iv.end());
  int64_t total = 0, cur_b = 0, cur_e = -1;
  for (auto [b, e] : iv) {
    if (b > cur_e) { if (cur_e > cur_b) total += cur_e - cur_b; cur_b = b; cur_e = e; }
    else cur_e = std::max(cur_e, e);
  }
  if (cur_e > cur_b) total += cur_e - cur_b;
  return total;
}

int64_t overlap(std::vector<std::pair<int64_t, int64_t>> a, std::vector<std::pair<int64_t, int64_t>> b) {
  auto all = a;
  all.insert(all.end(), b.begin(), b.end());
  return covered(a) + covered(b) - covered(all);
}

int summary(const fs::path& run) {
  const auto ev = load_events(run);
  const int64_t t0 = ev.front().ts;
  int64_t t1 = t0;
  for (const auto& e : ev) t1 = std::max(t1, e.ts + e.dur);
  const double span = double(t1 - t0) / 1e6;
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> busy;
  std::vector<std::pair<int64_t, int64_t>> gen, train;
  std::vector<double> calib;
  for (const auto& e : ev) {
    if (e.name == "wait_batch") continue;  // waiting is idle time
    busy[e.node + "/" + e.actor].push_back({e.ts, e.ts + e.dur});
    if (e.name == "decode_step") gen.push_back({e.ts, e.ts + e.dur});
    if (e.name == "train_step") train.push_back({e.ts, e.ts + e.dur});
    if (e.name == "calibrate") calib.push_back(double(e.dur) / 1e6);
  }
  std::printf("run: %s   wall time covered by traces: %.2f s\n\n%-28s %10s %8s\n", run.c_str(), span, "actor", "busy s", "busy %");
  for (const auto& [a, iv] : busy) {
    const double b = double(covered(iv)) / 1e6;
    std::printf("%-28s %10.3f %7.1f%%\n", a.c_str(), b, 100.0 * b / span);
  }
  const double g = double(covered(gen)) / 1e6, t = double(covered(train)) / 1e6, o = double(overlap(gen, train)) / 1e6;
  std::printf("\ngeneration busy %.3f s, training busy %.3f s, both at once %.3f s (%.1f%% of training overlapped)\n", g, t, o,
              t > 0 ? 100.0 * o / t : 0.0);
  double csum = 0;
  for (double c : calib) csum += c;
  std::printf("calibration: %zu runs, mean %.4f s\n", calib.size(), calib.empty() ? 0.0 : csum / double(calib.size()));
  // staleness and sync latency from the metrics
  std::map<int64_t, double> hist;
  std::vector<double> sync;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key().rfind("staleness_hist/", 0) == 0 && it.value().is_number()) hist[std::stoll(it.key().substr(15))] += it.value().get<double>();
    }
    if (j.contains("sync_latency_s") && j["sync_latency_s"].is_number()) sync.push_back(j["sync_latency_s"].get<double>());
  }
  std::printf("staleness histogram (tokens by learner_version - weight_version):");
  for (const auto& [d, c] : hist) std::printf("  %ld: %.0f", long(d), c);
  std::sort(sync.begin(), sync.end());
  std::printf("\nweight-sync latency (publish -> adopted by every rollout): ");
  if (sync.empty()) std::printf("n/a\n");
  else std::printf("median %.4f s, max %.4f s over %zu versions\n", sync[sync.size() / 2], sync.back(), sync.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "merge" && std::string(argv[1]) != "summary")) {
    std::fprintf(stderr, "usage: fp8rl-trace merge|summary RUN_DIR\n");
    return 2;
  }
  try {
    return std::string(argv[1]) == "merge" ? merge(argv[2]) : summary(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8rl-trace: %s\n", e.what());
    return 2;
  }
}
