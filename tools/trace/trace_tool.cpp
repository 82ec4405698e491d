// tools/trace/trace_tool.cpp -- build/bin/fp8rl-trace: one timeline of a whole run.
//   fp8rl-trace merge RUN_DIR     -> RUN_DIR/trace.json (Chrome trace / Perfetto: load it in
//                                   ui.perfetto.dev or chrome://tracing), one row per actor
//                                   with an arrow from each message's send to its receive
//   fp8rl-trace shiviz RUN_DIR    -> RUN_DIR/trace.shiviz.log: the messages' send/receive events
//                                   with vector clocks (recomputed from the Lamport clocks the
//                                   messages carried, as caf-vec did), for ShiViz
//   fp8rl-trace summary RUN_DIR   -> busy/idle per actor, generation/training overlap, staleness
//                                   histogram, weight-sync latency, calibration time, messages
// Input: RUN_DIR/traces/*.jsonl (actors/trace.hpp) and RUN_DIR/metrics.jsonl.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/checkpoint.hpp"
#include "models/rl/staleness_hist.hpp"
#include "tools/stdout_check.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct event {
  std::string node, actor, name, kind;
  int64_t ts = 0, dur = 0;
  double bytes = 0;
  int64_t wv = -1, sv = -1;  // weight / scale version (-1: none)
  int64_t step = -1;         // the learner step a message is for (-1: none)
  uint64_t lamport = 0, msg = 0;  // send/recv: Lamport clock, message id
  int64_t pid = 0;
  std::string who;    // actor@node, plus #pid where a node's file holds several processes (a resumed run)
  std::string where;  // file:line it came from
};

// One event line (what actors/trace.cpp writes): node, actor, name, kind (span | send | recv) and
// ts always; dur, pid, bytes, wv, sv, lamport, msg where they apply. A field missing or of
// another type is an error naming `where` (file:line): defaulted, a missing ts rebased the whole
// timeline to 0, and a wrong type stopped the tool with the JSON library's words only. Times are
// bounded by 2^53 us (285 years; ts + dur cannot overflow); ids and clocks are full 64-bit (the
// writer's message ids set bit 63 about half the time).
constexpr int64_t kMaxMicros = int64_t{1} << 53;
event event_from(const json& j, const std::string& where) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(where + what); };
  if (!j.is_object()) fail("not an event object");
  auto str = [&](const char* k) {
    if (!j.contains(k) || !j[k].is_string()) fail(std::string(k).insert(0, 1, '\'') + "' missing or not a string");
    return j[k].get<std::string>();
  };
  auto integer = [&](const char* k, bool required, int64_t lo, int64_t def, int64_t hi = INT64_MAX) {
    if (!j.contains(k)) {
      if (required) fail(std::string(k).insert(0, 1, '\'') + "' missing");
      return def;
    }
    if (!j[k].is_number_integer() || (j[k].is_number_unsigned() && j[k].get<uint64_t>() > uint64_t(hi)) ||
        j[k].get<int64_t>() < lo || j[k].get<int64_t>() > hi)
      fail(std::string(k).insert(0, 1, '\'') + "' is " + j[k].dump() + ", not an integer >= " + std::to_string(lo) +
           (hi < INT64_MAX ? " and <= " + std::to_string(hi) : std::string()));
    return j[k].get<int64_t>();
  };
  auto uinteger = [&](const char* k) -> uint64_t {  // 0 where missing
    if (!j.contains(k)) return 0;
    if (!j[k].is_number_unsigned()) fail(std::string(k).insert(0, 1, '\'') + "' is " + j[k].dump() + ", not an integer >= 0");
    return j[k].get<uint64_t>();
  };
  event e;
  e.node = str("node");
  e.actor = str("actor");
  e.name = str("name");
  e.kind = str("kind");
  if (e.kind != "span" && e.kind != "send" && e.kind != "recv") fail("kind '" + e.kind + "' is not span, send or recv");
  e.ts = integer("ts", true, 0, 0, kMaxMicros);
  e.dur = integer("dur", false, 0, 0, kMaxMicros);  // send/recv: instants
  e.pid = integer("pid", false, 0, 0);  // traces written before pids were: one process per file
  e.wv = integer("wv", false, -1, -1);
  e.sv = integer("sv", false, -1, -1);
  e.step = integer("step", false, -1, -1);
  e.lamport = uinteger("lamport");
  e.msg = uinteger("msg");
  if (j.contains("bytes") && !j["bytes"].is_number()) fail("'bytes' is not a number");
  e.bytes = j.value("bytes", 0.0);
  return e;
}

// The events of one node file. A line that is not JSON is an error, except a process's last one: a
// process killed mid-write leaves a torn last line (skipped, said on stderr), also where a resumed
// run's process appended after it (the next event has another pid).
void load_file(const fs::path& p, std::vector<event>& ev) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) throw std::invalid_argument(p.string() + ": not a readable file");  // a directory, a dangling link
  std::ifstream in(p);
  if (!in) throw std::invalid_argument(p.string() + ": cannot read");
  std::string line;
  int64_t n = 0, torn = 0, last_pid = -1;
  auto skip_torn = [&] { std::fprintf(stderr, "fp8rl-trace: %s:%ld: skipping a torn last line\n", p.c_str(), long(torn)); };
  while (std::getline(in, line)) {
    ++n;
    auto j = json::parse(line, nullptr, false);
    if (torn && j.is_discarded()) throw std::invalid_argument(p.string() + ":" + std::to_string(torn) + ": not a JSON event line");
    if (j.is_discarded()) {
      torn = n;
      continue;
    }
    event e = event_from(j, p.string() + ":" + std::to_string(n) + ": ");
    if (torn) {  // a torn line is a process's last: the next event is another process's
      if (e.pid == last_pid) throw std::invalid_argument(p.string() + ":" + std::to_string(torn) + ": not a JSON event line");
      skip_torn();
      torn = 0;
    }
    last_pid = e.pid;
    e.where = p.string() + ":" + std::to_string(n);
    if ((e.kind == "send" || e.kind == "recv") && (e.msg == 0 || e.lamport == 0)) {
      std::fprintf(stderr, "fp8rl-trace: %s: %s event without msg/lamport; skipped\n", e.where.c_str(), e.kind.c_str());
      continue;
    }
    ev.push_back(std::move(e));
  }
  if (in.bad()) throw std::invalid_argument(p.string() + ": read error");
  if (torn) skip_torn();
}

// A message sent or received twice (a file copied into another, events duplicated) is an error
// naming both lines: matching kept the last of each, and every count doubled.
void refuse_duplicates(const std::vector<event>& ev) {
  std::map<std::pair<std::string, uint64_t>, const event*> seen;  // (kind, msg)
  for (const auto& e : ev) {
    if (e.kind == "span") continue;
    auto [it, fresh] = seen.try_emplace({e.kind, e.msg}, &e);
    if (!fresh)
      throw std::invalid_argument(e.where + ": " + e.kind + " of message " + std::to_string(e.msg) + " already at " + it->second->where);
  }
}

std::vector<event> load_events(const fs::path& run) {
  std::vector<event> ev;
  const fs::path dir = run / "traces";
  if (!fs::exists(run)) throw std::invalid_argument(run.string() + ": no such run directory");
  if (!fs::is_directory(run)) throw std::invalid_argument(run.string() + ": not a directory");
  if (!fs::exists(dir)) throw std::invalid_argument(dir.string() + ": no traces (run with trace.enabled=true)");
  if (!fs::is_directory(dir)) throw std::invalid_argument(dir.string() + ": not a directory");
  std::vector<fs::path> files;  // in name order: the same input gives the same output
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".jsonl") files.push_back(f.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) load_file(f, ev);
  std::stable_sort(ev.begin(), ev.end(), [](const event& a, const event& b) { return a.ts < b.ts; });
  if (ev.empty()) throw std::invalid_argument(dir.string() + ": no events");
  refuse_duplicates(ev);
  std::map<std::string, std::set<int64_t>> pids;
  for (const auto& e : ev) pids[e.node].insert(e.pid);
  for (auto& e : ev) {
    e.who = e.actor;
    e.who.append(1, '@').append(e.node);
    if (pids[e.node].size() > 1) e.who.append(1, '#').append(std::to_string(e.pid));
  }
  return ev;
}

// Each message's send and receive (indices into ev); receives whose send is missing (a process
// without traces, a torn file) are counted, not matched. A receive whose Lamport clock is not
// above its send's is an error (the vector clocks would break causality).
struct message_pairs {
  std::map<uint64_t, std::pair<size_t, size_t>> pairs;  // msg -> (send, recv)
  size_t unmatched_recv = 0, unmatched_send = 0;
  std::map<std::string, size_t> unreceived_by_type;  // sends without a receive, by message name
};
message_pairs match_messages(const std::vector<event>& ev) {
  message_pairs m;
  std::map<uint64_t, size_t> send_of;
  for (size_t i = 0; i < ev.size(); ++i)
    if (ev[i].kind == "send") send_of[ev[i].msg] = i;
  for (size_t i = 0; i < ev.size(); ++i) {
    if (ev[i].kind != "recv") continue;
    auto it = send_of.find(ev[i].msg);
    if (it == send_of.end()) { ++m.unmatched_recv; continue; }
    const event &s = ev[it->second], &r = ev[i];
    if (r.lamport <= s.lamport)
      throw std::invalid_argument(r.where + ": receive of message " + std::to_string(r.msg) + " has Lamport clock " +
                                  std::to_string(r.lamport) + ", not above its send's " + std::to_string(s.lamport) + " (" +
                                  s.where + ")");
    m.pairs[ev[i].msg] = {it->second, i};
  }
  m.unmatched_send = send_of.size() - m.pairs.size();
  for (const auto& [msg, i] : send_of)
    if (!m.pairs.count(msg)) ++m.unreceived_by_type[ev[i].name];
  return m;
}

// Vector clocks of the send/recv events, in Lamport order (a send's clock is below its
// receive's, and each actor's clock rises with every event): an event ticks its actor's own
// entry; a receive first takes the entry-wise max with the clock its send had.
std::map<size_t, std::map<std::string, uint64_t>> vector_clocks(const std::vector<event>& ev, const message_pairs& mp) {
  std::vector<size_t> order;
  for (size_t i = 0; i < ev.size(); ++i)
    if (ev[i].kind == "send" || ev[i].kind == "recv") order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ev[a].lamport < ev[b].lamport; });
  std::map<std::string, std::map<std::string, uint64_t>> now;  // per actor
  std::map<size_t, std::map<std::string, uint64_t>> at;        // per event
  for (size_t i : order) {
    const event& e = ev[i];
    auto& vc = now[e.who];
    if (e.kind == "recv") {
      auto p = mp.pairs.find(e.msg);
      if (p != mp.pairs.end() && at.count(p->second.first))
        for (const auto& [k, v] : at[p->second.first]) vc[k] = std::max(vc[k], v);
    }
    ++vc[e.who];
    at[i] = vc;
  }
  return at;
}

// An output that could not be written (exit 1; bad input exits 2).
struct output_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An output file, replaced whole through p.tmp (written in place, a full disk left an earlier good
// one empty); throws output_error naming it and why, p.tmp removed.
void output_write(const fs::path& p, const std::string& text) {
  try {
    fp8rl::models::file_replace_durably(p.string(), text, p.string() + " left as it was");
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove(p.string() + ".tmp", ec);
    throw output_error(e.what());
  }
}

int shiviz(const fs::path& run) {
  const auto ev = load_events(run);
  const auto mp = match_messages(ev);
  const auto vc = vector_clocks(ev, mp);
  std::vector<size_t> order;
  for (const auto& [i, c] : vc) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ev[a].lamport < ev[b].lamport; });
  const fs::path p = run / "trace.shiviz.log";
  std::ostringstream out;
  out << "(?<host>\\S+) (?<clock>\\{.*?\\}) (?<event>.*)\n\n";  // ShiViz: the parser regex, a blank line, events
  for (size_t i : order) {
    const event& e = ev[i];
    out << e.who << ' ' << json(vc.at(i)).dump() << ' ' << e.kind << ' ' << e.name;
    if (e.wv >= 0) out << " v" << e.wv;
    if (e.sv >= 0) out << " s" << e.sv;
    if (e.step >= 0) out << " step " << e.step;
    out << " msg=" << e.msg << " ts=" << e.ts << '\n';
  }
  output_write(p, out.str());
  std::printf("wrote %s (%zu events, %zu messages matched, %zu receives without their send)\n", p.c_str(), order.size(),
              mp.pairs.size(), mp.unmatched_recv);
  return 0;
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
    if (e.sv >= 0) args["scale_version"] = e.sv;
    if (e.step >= 0) args["step"] = e.step;
    if (e.bytes > 0) args["bytes"] = e.bytes;
    out.push_back({{"name", e.name}, {"ph", "X"}, {"ts", e.ts - ev.front().ts}, {"dur", std::max<int64_t>(e.dur, 1)},
                   {"pid", pid[e.node]}, {"tid", tid[key]}, {"args", args}});
  }
  // an arrow (flow) from each message's send slice to its receive slice
  const auto mp = match_messages(ev);
  int64_t flow = 0;
  for (const auto& [m, sr] : mp.pairs) {
    const event& s = ev[sr.first];
    const event& r = ev[sr.second];
    ++flow;
    out.push_back({{"name", s.name}, {"cat", "message"}, {"ph", "s"}, {"id", flow}, {"ts", s.ts - ev.front().ts},
                   {"pid", pid[s.node]}, {"tid", tid[s.node + "/" + s.actor]}});
    out.push_back({{"name", s.name}, {"cat", "message"}, {"ph", "f"}, {"bp", "e"}, {"id", flow}, {"ts", r.ts - ev.front().ts},
                   {"pid", pid[r.node]}, {"tid", tid[r.node + "/" + r.actor]}});
  }
  const fs::path p = run / "trace.json";
  output_write(p, json{{"traceEvents", out}, {"displayTimeUnit", "ms"}}.dump());
  std::printf("wrote %s (%zu events, %zu nodes, %zu actors, %zu messages)\n", p.c_str(), ev.size(), pid.size(), tid.size(),
              mp.pairs.size());
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

// Busy time per actor over the wall time the run's processes were alive, generation/training
// overlap, calibration time.
void summary_busy(const fs::path& run, const std::vector<event>& ev) {
  // wall time: while some process of the run was alive (first to last event of each node process):
  // a resumed run's gap between its parts counted as idle time of every actor
  std::map<std::pair<std::string, int64_t>, std::pair<int64_t, int64_t>> life;
  for (const auto& e : ev) {
    auto [it, fresh] = life.try_emplace({e.node, e.pid}, e.ts, e.ts + e.dur);
    if (!fresh) it->second = {std::min(it->second.first, e.ts), std::max(it->second.second, e.ts + e.dur)};
  }
  std::vector<std::pair<int64_t, int64_t>> alive;
  for (const auto& [k, iv] : life) alive.push_back(iv);
  const double span = double(covered(alive)) / 1e6;
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
  std::printf("run: %s   wall time covered by traces: %.2f s (%zu processes)\n\n%-28s %10s %8s\n", run.c_str(), span,
              life.size(), "actor", "busy s", "busy %");
  for (const auto& [a, iv] : busy) {
    const double b = double(covered(iv)) / 1e6;
    std::printf("%-28s %10.3f %7.1f%%\n", a.c_str(), b, span > 0 ? 100.0 * b / span : 0.0);  // one instant: 0 s covered
  }
  const double g = double(covered(gen)) / 1e6, t = double(covered(train)) / 1e6, o = double(overlap(gen, train)) / 1e6;
  std::printf("\ngeneration busy %.3f s, training busy %.3f s, both at once %.3f s (%.1f%% of training overlapped)\n", g, t, o,
              t > 0 ? 100.0 * o / t : 0.0);
  double csum = 0;
  for (double c : calib) csum += c;
  std::printf("calibration: %zu runs, mean %.4f s\n", calib.size(), calib.empty() ? 0.0 : csum / double(calib.size()));
}

// Messages matched, received without their send, sent and never received; mean latency by type.
void summary_messages(const std::vector<event>& ev) {
  const auto mp = match_messages(ev);
  std::map<std::string, std::pair<size_t, double>> by_type;  // count, send -> receive µs
  size_t backwards = 0;  // received before sent by the wall clocks: hosts' clocks disagree
  for (const auto& [m, sr] : mp.pairs) {
    auto& t = by_type[ev[sr.first].name];
    ++t.first;
    t.second += double(ev[sr.second].ts - ev[sr.first].ts);
    backwards += ev[sr.second].ts < ev[sr.first].ts;
  }
  std::printf("messages: %zu matched, %zu receives without their send, %zu sends not received\n", mp.pairs.size(),
              mp.unmatched_recv, mp.unmatched_send);
  if (mp.unmatched_send) {  // in flight when the run ended or stopped, or the receiver was gone
    std::printf("  not received, by type (in flight at the end or a stop, or the receiver gone):");
    for (const auto& [t, c] : mp.unreceived_by_type) std::printf(" %s %zu", t.c_str(), c);
    std::printf("\n");
  }
  if (backwards)
    std::printf("  %zu received before their send by the wall clocks: the hosts' clocks disagree (latencies below include the skew)\n",
                backwards);
  for (const auto& [t, c] : by_type) std::printf("  %-14s %6zu   mean send->receive %.1f us\n", t.c_str(), c.first, c.second / double(c.first));
}

// The staleness histogram and weight-sync latency from RUN_DIR/metrics.jsonl.
void summary_metrics(const fs::path& run) {
  std::map<int64_t, double> hist;
  std::vector<double> sync;
  const fs::path metrics = run / "metrics.jsonl";
  if (!fs::is_regular_file(metrics)) std::printf("(no %s: no staleness or weight-sync numbers)\n", metrics.c_str());
  std::ifstream in(metrics);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    const std::string where = metrics.string() + ":" + std::to_string(n) + ": ";
    auto j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {  // a run killed mid-write leaves a torn last line
      std::fprintf(stderr, "fp8rl-trace: %sskipping a line that is not a JSON object\n", where.c_str());
      continue;
    }
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key().rfind(fp8rl::models::kStalenessHistPrefix, 0) != 0 || !it.value().is_number()) continue;
      const auto d = fp8rl::models::staleness_hist_bin(it.key());
      if (!d) throw std::invalid_argument(where + "key '" + it.key() + "': the staleness bin is not an integer");
      hist[*d] += it.value().get<double>();
    }
    if (j.contains("sync_latency_s") && j["sync_latency_s"].is_number()) sync.push_back(j["sync_latency_s"].get<double>());
  }
  std::printf("staleness histogram (tokens by learner_version - weight_version):");
  for (const auto& [d, c] : hist) std::printf("  %ld: %.0f", long(d), c);
  std::sort(sync.begin(), sync.end());
  std::printf("\nweight-sync latency (publish -> adopted by every rollout): ");
  if (sync.empty()) std::printf("n/a\n");
  else {  // an even count: the mean of the two middle values
    const size_t n = sync.size();
    const double median = n % 2 ? sync[n / 2] : 0.5 * (sync[n / 2 - 1] + sync[n / 2]);
    std::printf("median %.4f s, max %.4f s over %zu versions\n", median, sync.back(), n);
  }
}

int summary(const fs::path& run) {
  const auto ev = load_events(run);
  summary_busy(run, ev);
  summary_messages(ev);
  summary_metrics(run);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* const usage =
      "usage: fp8rl-trace merge|shiviz|summary RUN_DIR\n"
      "  merge    RUN_DIR/traces/*.jsonl -> RUN_DIR/trace.json (ui.perfetto.dev, chrome://tracing):\n"
      "           one row per actor, an arrow from each message's send to its receive\n"
      "  shiviz   -> RUN_DIR/trace.shiviz.log: send/receive events with vector clocks (ShiViz)\n"
      "  summary  busy/idle per actor, overlap, staleness, weight-sync latency, message latencies\n";
  auto help = [](const char* a) { return !std::strcmp(a, "--help") || !std::strcmp(a, "-h"); };
  if ((argc == 2 && help(argv[1])) || (argc == 3 && help(argv[2]))) {  // `fp8rl-trace merge --help` too
    std::fputs(usage, stdout);
    return fp8rl::tools::stdout_checked("fp8rl-trace --help", 0);
  }
  const std::string cmd = argc >= 2 ? argv[1] : "";
  // what is wrong, then the usage (a mistyped subcommand only reprinted the usage)
  std::string wrong;
  if (argc < 2) wrong = "a subcommand and a run directory are needed";
  else if (cmd != "merge" && cmd != "summary" && cmd != "shiviz") wrong = "unknown subcommand '" + cmd + "'";
  else if (argc == 2) wrong = "the run directory is missing";
  else if (argc > 3) wrong = "one run directory, no more arguments";
  if (!wrong.empty()) {
    std::fprintf(stderr, "fp8rl-trace: %s\n%s", wrong.c_str(), usage);
    return 2;
  }
  int rc = 0;
  try {
    rc = cmd == "shiviz" ? shiviz(argv[2]) : cmd == "merge" ? merge(argv[2]) : summary(argv[2]);
  } catch (const output_error& e) {
    std::fprintf(stderr, "fp8rl-trace: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // bad input (a run directory it cannot read too)
    std::fprintf(stderr, "fp8rl-trace: %s\n", e.what());
    return 2;
  }
  return fp8rl::tools::stdout_checked("fp8rl-trace " + cmd, rc);
}
