// tests/tools/trace_test.cpp -- fp8rl-trace on hand-written per-process traces whose causal
// order is known: vector clocks (ShiViz log), send -> receive arrows in the Perfetto timeline,
// receives without their send counted; and malformed input refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
const std::string kBin = FP8RL_BIN_DIR;

std::string text_of(const fs::path& f) {
  std::ifstream in(f);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::string line(const std::string& node, const std::string& actor, const char* kind, const char* name, int64_t ts,
                 uint64_t lamport, uint64_t msg) {
  return json{{"node", node}, {"actor", actor}, {"kind", kind}, {"name", name}, {"ts", ts}, {"dur", 0},
              {"lamport", lamport}, {"msg", msg}}.dump() + "\n";
}
}  // namespace

// controller@A --m1--> rollout@B --m2--> controller@A, and rollout@B receives m9 whose send is
// in no file. Wall clocks disagree across processes (B's run 1 s behind): only Lamport order counts.
TEST(Trace, VectorClocksFollowTheMessages) {
  const fs::path run = fs::temp_directory_path() / ("fp8rl_trace_test_" + std::to_string(::getpid()));
  fs::remove_all(run);
  fs::create_directories(run / "traces");
  std::ofstream(run / "traces" / "A.jsonl") << line("A", "controller", "send", "work_msg", 2000000, 1, 11)
                                            << json{{"node", "A"}, {"actor", "controller"}, {"kind", "span"}, {"name", "issue"},
                                                    {"ts", 2000001}, {"dur", 5}}.dump() << "\n"
                                            << line("A", "controller", "recv", "group_msg", 2000900, 4, 12);
  std::ofstream(run / "traces" / "B.jsonl") << line("B", "rollout", "recv", "work_msg", 1000100, 2, 11)
                                            << line("B", "rollout", "send", "group_msg", 1000800, 3, 12)
                                            << line("B", "rollout", "recv", "bundle_msg", 1000900, 5, 99);
  const auto r = fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + run.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("2 messages matched, 1 receives without their send"), std::string::npos) << r.out;
  std::ifstream in(run / "trace.shiviz.log");
  std::string regex, blank, l;
  std::getline(in, regex);
  std::getline(in, blank);
  EXPECT_EQ(regex, "(?<host>\\S+) (?<clock>\\{.*?\\}) (?<event>.*)");
  EXPECT_EQ(blank, "");
  std::map<std::string, json> clock_of;  // "host kind name" -> vector clock
  while (std::getline(in, l)) {
    const size_t a = l.find(' '), b = l.find("} ");
    ASSERT_NE(b, std::string::npos) << l;
    const std::string host = l.substr(0, a), rest = l.substr(b + 2);
    clock_of[host + " " + rest.substr(0, rest.find(" msg="))] = json::parse(l.substr(a + 1, b + 1 - a));
  }
  EXPECT_EQ(clock_of.at("controller@A send work_msg"), (json{{"controller@A", 1}}));
  EXPECT_EQ(clock_of.at("rollout@B recv work_msg"), (json{{"controller@A", 1}, {"rollout@B", 1}}));
  EXPECT_EQ(clock_of.at("rollout@B send group_msg"), (json{{"controller@A", 1}, {"rollout@B", 2}}));
  EXPECT_EQ(clock_of.at("controller@A recv group_msg"), (json{{"controller@A", 2}, {"rollout@B", 2}}));
  EXPECT_EQ(clock_of.at("rollout@B recv bundle_msg"), (json{{"controller@A", 1}, {"rollout@B", 3}}));  // no send: no merge
  // the timeline: one arrow per matched message, from the sender's row to the receiver's
  ASSERT_EQ(fp8rl::test::run_command(kBin + "/fp8rl-trace merge " + run.string()).rc, 0);
  const json t = json::parse(std::ifstream(run / "trace.json"));
  int starts = 0, finishes = 0;
  std::map<std::pair<int, int>, std::string> row;  // (pid, tid) -> "actor@node" from the metadata
  std::map<int, std::string> process;
  for (const auto& e : t["traceEvents"])
    if (e["name"] == "process_name") process[e["pid"]] = e["args"]["name"];
  for (const auto& e : t["traceEvents"])
    if (e["name"] == "thread_name") row[{e["pid"], e["tid"]}] = e["args"]["name"].get<std::string>() + "@" + process[e["pid"]];
  int64_t first_ts = INT64_MAX;
  std::map<std::string, int64_t> arrow_ts;  // "work_msg s" -> its ts
  for (const auto& e : t["traceEvents"]) {
    starts += e["ph"] == "s";
    finishes += e["ph"] == "f";
    if (e["ph"] == "s" || e["ph"] == "f") arrow_ts[e["name"].get<std::string>() + " " + e["ph"].get<std::string>()] = e["ts"];
    if (e["ph"] == "X") first_ts = std::min(first_ts, e["ts"].get<int64_t>());
    // each arrow starts on its sender's row and ends on its receiver's
    if (e["ph"] != "s" && e["ph"] != "f") continue;
    const bool work = e["name"] == "work_msg", from = e["ph"] == "s";
    const std::string on = row[std::make_pair(e["pid"].get<int>(), e["tid"].get<int>())];
    EXPECT_EQ(on, work == from ? "controller@A" : "rollout@B") << e.dump();
  }
  EXPECT_EQ(starts, 2);
  EXPECT_EQ(finishes, 2);
  EXPECT_EQ(first_ts, 0);  // times from the earliest event of any process (B's clock is behind A's)
  // each arrow starts at its send and ends at its receive, on that time line (B's recv is first)
  EXPECT_EQ(arrow_ts, (std::map<std::string, int64_t>{
                          {"work_msg s", 2000000 - 1000100}, {"work_msg f", 0}, {"group_msg s", 700}, {"group_msg f", 2000900 - 1000100}}));
  const auto s = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + run.string());
  EXPECT_NE(s.out.find("messages: 2 matched, 1 receives without their send, 0 sends not received"), std::string::npos) << s.out;
  EXPECT_EQ(s.out.find("not received, by type"), std::string::npos) << s.out;
  // work_msg was received "before" it was sent by the wall clocks (B's is 1 s behind): said
  EXPECT_NE(s.out.find("  1 received before their send by the wall clocks"), std::string::npos) << s.out;
  // sends nobody received (work issued past a stop, in flight at the end) are counted by type
  std::ofstream(run / "traces" / "D.jsonl") << line("D", "controller", "send", "work_msg", 2000950, 6, 21)
                                            << line("D", "controller", "send", "work_msg", 2000960, 7, 22)
                                            << line("D", "controller", "send", "bundle_msg", 2000970, 8, 23);
  const auto u = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + run.string());
  EXPECT_NE(u.out.find("messages: 2 matched, 1 receives without their send, 3 sends not received"), std::string::npos) << u.out;
  EXPECT_NE(u.out.find("receiver gone): bundle_msg 1 work_msg 2\n"), std::string::npos) << u.out;
  fs::remove(run / "traces" / "D.jsonl");
  // a send/recv line without its message id is named and skipped, not matched to anything
  std::ofstream(run / "traces" / "C.jsonl") << json{{"node", "C"}, {"actor", "x"}, {"kind", "recv"}, {"name", "m"}, {"ts", 1}}.dump()
                                            << "\n";
  const auto c = fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + run.string());
  EXPECT_NE(c.out.find("C.jsonl:1: recv event without msg/lamport; skipped"), std::string::npos) << c.out;
  EXPECT_NE(fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + (run / "nope").string()).rc, 0);
  // an output that cannot be written fails by name, exit 1 (it printed "wrote" and exited 0): a
  // directory in its place, a full disk (ulimit -f 0) -- where an earlier output stays as it was
  // (written in place, it was left empty) -- and a full standard output
  for (const char* cmd : {"merge", "shiviz"}) {
    const fs::path out = run / (std::string(cmd) == "merge" ? "trace.json" : "trace.shiviz.log");
    fs::remove_all(out);
    fs::create_directories(out / "a-directory");
    const auto w = fp8rl::test::run_command(kBin + "/fp8rl-trace " + cmd + " " + run.string());
    EXPECT_EQ(w.rc, 1) << w.out;
    EXPECT_NE(w.out.find("fp8rl-trace: error: "), std::string::npos) << w.out;
    EXPECT_NE(w.out.find(out.string()), std::string::npos) << w.out;
    fs::remove_all(out);
    ASSERT_EQ(fp8rl::test::run_command(kBin + "/fp8rl-trace " + cmd + " " + run.string()).rc, 0);
    const std::string earlier = text_of(out);
    // (its output through a pipe: the file-size limit holds for every file it writes, a log too)
    const auto full = fp8rl::test::run_command("(trap '' XFSZ; ulimit -f 0; " + kBin + "/fp8rl-trace " + cmd + " " + run.string() +
                                               "; echo rc=$?) 2>&1 | cat");
    EXPECT_NE(full.out.find("rc=1\n"), std::string::npos) << full.out;
    EXPECT_NE(full.out.find("fp8rl-trace: error: " + out.string() + ".tmp: write failed: File too large (" + out.string() +
                            " left as it was)"), std::string::npos) << full.out;
    EXPECT_EQ(text_of(out), earlier);
    EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
  }
  const auto cut = fp8rl::test::run_command("(" + kBin + "/fp8rl-trace summary " + run.string() + " > /dev/full)");
  EXPECT_EQ(cut.rc, 1) << cut.out;
  EXPECT_NE(cut.out.find("fp8rl-trace summary: error: writing standard output failed: No space left on device"), std::string::npos)
      << cut.out;
  // a line missing ts, of a wrong type, of an unknown kind, or not an object is named by file and
  // line (defaulted, a missing ts rebased the timeline to 0; a wrong type gave the JSON library's
  // words only); a metrics line with a bin that is not a number names its key
  for (const auto& [bad, what] : std::vector<std::pair<json, std::string>>{
           {json{{"node", "C"}, {"actor", "x"}, {"kind", "span"}, {"name", "m"}}, "C.jsonl:1: 'ts' missing"},
           {json{{"node", "C"}, {"actor", "x"}, {"kind", "span"}, {"name", "m"}, {"ts", "abc"}}, "C.jsonl:1: 'ts' is \"abc\", not an integer"},
           {json{{"node", "C"}, {"actor", "x"}, {"kind", "bogus"}, {"name", "m"}, {"ts", 1}}, "C.jsonl:1: kind 'bogus' is not span"},
           {json{{"node", "C"}, {"actor", "x"}, {"kind", "send"}, {"name", "m"}, {"ts", 1}, {"lamport", -1}, {"msg", 3}},
            "C.jsonl:1: 'lamport' is -1, not an integer >= 0"},
           {json{{"node", "C"}, {"actor", "x"}, {"kind", "span"}, {"name", "m"}, {"ts", 1}, {"sv", "2"}},
            "C.jsonl:1: 'sv' is \"2\", not an integer >= -1"},
           {json{{"node", "C"}, {"actor", "x"}, {"kind", "send"}, {"name", "m"}, {"ts", 1}, {"step", 1.5}},
            "C.jsonl:1: 'step' is 1.5, not an integer >= -1"},
           {json::array({1, 2, 3}), "C.jsonl:1: not an event object"}}) {
    std::ofstream(run / "traces" / "C.jsonl") << bad.dump() << "\n";
    for (const char* cmd : {"merge", "summary", "shiviz"}) {
      const auto b = fp8rl::test::run_command(kBin + "/fp8rl-trace " + cmd + " " + run.string());
      EXPECT_NE(b.rc, 0) << cmd << " " << bad.dump();
      EXPECT_NE(b.out.find(what), std::string::npos) << cmd << "\n" << b.out;
    }
  }
  fs::remove(run / "traces" / "C.jsonl");
  std::ofstream(run / "metrics.jsonl") << "{\"staleness_hist/0\": 3}\n{\"staleness_hist/x\": 3}\n";
  const auto m = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + run.string());
  EXPECT_NE(m.out.find("metrics.jsonl:2: key 'staleness_hist/x': the staleness bin is not an integer"), std::string::npos) << m.out;
  fs::remove(run / "metrics.jsonl");
  // a resumed run appends to the same node file with its clocks starting again: each process
  // is its own host, so the two runs' events are not merged into one timeline of one actor
  fs::remove(run / "traces" / "C.jsonl");
  json again = json::parse(line("A", "controller", "send", "work_msg", 3000000, 1, 21));
  again["pid"] = 777;
  std::ofstream(run / "traces" / "A.jsonl", std::ios::app) << again.dump() << "\n";
  ASSERT_EQ(fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + run.string()).rc, 0);
  std::ifstream in2(run / "trace.shiviz.log");
  const std::string text((std::istreambuf_iterator<char>(in2)), {});
  EXPECT_NE(text.find("controller@A#777 {\"controller@A#777\":1} send work_msg"), std::string::npos) << text;
  EXPECT_NE(text.find("controller@A#0 {\"controller@A#0\":1} send work_msg"), std::string::npos) << text;
  fs::remove_all(run);
}

// The weight and scale versions an event carries reach the ShiViz log (v<wv> s<sv>) and the
// timeline's arguments; an event without them shows neither.
TEST(Trace, WeightAndScaleVersionsReachTheTimeline) {
  const fs::path run = fs::temp_directory_path() / ("fp8rl_trace_versions_" + std::to_string(::getpid()));
  fs::remove_all(run);
  fs::create_directories(run / "traces");
  json send = json::parse(line("A", "weight_sync", "send", "bundle_msg", 100, 1, 5)), recv = json::parse(line("A", "rollout0", "recv", "bundle_msg", 110, 2, 5));
  send["wv"] = recv["wv"] = 3;
  send["sv"] = recv["sv"] = 2;
  json group = json::parse(line("A", "rollout0", "send", "group_msg", 130, 3, 7));
  group["wv"] = 3, group["sv"] = 2, group["step"] = 4;  // step 4's group, sampled under version 3
  std::ofstream(run / "traces" / "A.jsonl") << send.dump() << "\n" << recv.dump() << "\n" << line("A", "controller", "send", "peers_msg", 120, 1, 6)
                                            << group.dump() << "\n";
  ASSERT_EQ(fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + run.string()).rc, 0);
  std::ifstream in(run / "trace.shiviz.log");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("send bundle_msg v3 s2 msg=5"), std::string::npos) << text;
  EXPECT_NE(text.find("recv bundle_msg v3 s2 msg=5"), std::string::npos) << text;
  EXPECT_NE(text.find("send peers_msg msg=6"), std::string::npos) << text;
  EXPECT_NE(text.find("send group_msg v3 s2 step 4 msg=7"), std::string::npos) << text;
  ASSERT_EQ(fp8rl::test::run_command(kBin + "/fp8rl-trace merge " + run.string()).rc, 0);
  const json t = json::parse(std::ifstream(run / "trace.json"));
  int versioned = 0, bare = 0, stepped = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["name"] == "bundle_msg") versioned += e["args"] == json{{"weight_version", 3}, {"scale_version", 2}};
    if (e["name"] == "peers_msg") bare += e["args"] == json::object();
    if (e["name"] == "group_msg") stepped += e["args"] == json{{"weight_version", 3}, {"scale_version", 2}, {"step", 4}};
  }
  EXPECT_EQ(versioned, 2);
  EXPECT_EQ(bare, 1);
  EXPECT_EQ(stepped, 1);
  fs::remove_all(run);
}

// A resumed run: the node's file holds two processes, 100 s apart. Wall time is while some process
// was alive (2 s), not first to last event (101 s: every actor looked ~1% busy).
TEST(Trace, SummaryWallTimeLeavesOutTheGapOfAResume) {
  const fs::path run = fs::temp_directory_path() / ("fp8rl_trace_resume_" + std::to_string(::getpid()));
  fs::remove_all(run);
  fs::create_directories(run / "traces");
  auto span = [](int64_t pid, int64_t ts, int64_t dur) {
    return json{{"node", "A"}, {"actor", "learner0"}, {"kind", "span"}, {"name", "train_step"}, {"ts", ts}, {"dur", dur},
                {"pid", pid}}.dump() + "\n";
  };
  std::ofstream(run / "traces" / "A.jsonl") << span(1, 0, 500000) << span(1, 999000, 1000) << span(2, 100000000, 500000)
                                            << span(2, 100999000, 1000);
  const auto s = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + run.string());
  ASSERT_EQ(s.rc, 0) << s.out;
  EXPECT_NE(s.out.find("wall time covered by traces: 2.00 s (2 processes)"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("A/learner0                        1.002    50.1%"), std::string::npos) << s.out;
  // a process is alive until its latest end (a long span started before a short one ends after
  // it); waiting for a batch is idle time
  auto b_span = [](const char* actor, const char* name, int64_t ts, int64_t dur) {
    return json{{"node", "B"}, {"actor", actor}, {"kind", "span"}, {"name", name}, {"ts", ts}, {"dur", dur}, {"pid", 3}}.dump() + "\n";
  };
  std::ofstream(run / "traces" / "B.jsonl") << b_span("rollout0", "generate", 200000000, 3000000)
                                            << b_span("rollout0", "adopt", 200000010, 10)
                                            << b_span("learner1", "wait_batch", 200000000, 2000000);
  const auto b = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + run.string());
  EXPECT_NE(b.out.find("wall time covered by traces: 5.00 s (3 processes)"), std::string::npos) << b.out;
  EXPECT_EQ(b.out.find("B/learner1"), std::string::npos) << b.out;
  fs::remove(run / "traces" / "B.jsonl");
  // weight-sync latency from the metrics: the median of an even count is the middle two's mean
  std::ofstream(run / "metrics.jsonl") << "{\"step\":1,\"sync_latency_s\":0.1}\n{\"step\":2,\"sync_latency_s\":0.4}\n"
                                          "{\"step\":3,\"sync_latency_s\":0.2}\n{\"step\":4,\"sync_latency_s\":0.3}\n";
  const auto m = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + run.string());
  EXPECT_NE(m.out.find("median 0.2500 s, max 0.4000 s over 4 versions"), std::string::npos) << m.out;  // it said 0.3000
  const auto none = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + (run / "nope").string());
  EXPECT_NE(none.out.find((run / "nope").string() + ": no such run directory"), std::string::npos) << none.out;
  fs::remove_all(run);
}

// Input the tool used to take silently: message ids past 2^63 (the writer's ids set bit 63 about
// half the time: such runs were refused whole) are read; a message sent or received twice (a file
// copied into another: every count doubled, matching kept the last), a receive whose Lamport clock
// is not above its send's (its vector clock did not dominate the send's), a line that is not JSON
// before the last (only a torn last line is a killed writer's), a .jsonl that is a directory
// (skipped: the timeline lacked that node) and times past 2^53 us (ts + dur overflowed) are
// errors naming the file and line; a run directory that is a file is named as such.
TEST(Trace, BadInputIsRefusedByFileAndLine) {
  const fs::path run = fs::temp_directory_path() / ("fp8rl_trace_bad_" + std::to_string(::getpid()));
  fs::remove_all(run);
  fs::create_directories(run / "traces");
  const uint64_t big = (uint64_t{1} << 63) + 7;
  auto write = [&](const std::string& text) { std::ofstream(run / "traces" / "A.jsonl") << text; };
  auto shiviz = [&] { return fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + run.string()); };
  const std::string good = line("A", "x", "send", "m", 10, 1, big) + line("A", "y", "recv", "m", 20, 2, big);
  write(good);
  const auto ok = shiviz();
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_NE(ok.out.find("1 messages matched"), std::string::npos) << ok.out;
  write(good + "{\"torn");
  const auto torn = shiviz();
  EXPECT_EQ(torn.rc, 0) << torn.out;
  EXPECT_NE(torn.out.find("A.jsonl:3: skipping a torn last line"), std::string::npos) << torn.out;
  // a torn line followed by another process's events (a resumed run appended after a killed one)
  json later = json::parse(line("A", "x", "span", "s", 30, 0, 0));
  later["pid"] = 9;
  write(good + "{\"torn\n" + later.dump() + "\n");
  const auto resumed = shiviz();
  EXPECT_EQ(resumed.rc, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("A.jsonl:3: skipping a torn last line"), std::string::npos) << resumed.out;
  json huge = json::parse(line("A", "x", "span", "s", 10, 0, 0));
  huge["ts"] = int64_t{1} << 60;
  for (const auto& [text, what] : std::vector<std::pair<std::string, std::string>>{
           {good + line("A", "y", "recv", "m", 30, 3, big), "A.jsonl:3: recv of message " + std::to_string(big) + " already at "},
           {good + good, "A.jsonl:3: send of message " + std::to_string(big) + " already at "},
           {line("A", "x", "send", "m", 10, 5, 4) + line("A", "y", "recv", "m", 20, 2, 4),
            "A.jsonl:2: receive of message 4 has Lamport clock 2, not above its send's 5"},
           {line("A", "x", "send", "m", 10, 5, 4) + line("A", "y", "recv", "m", 20, 5, 4),  // equal: no merge either
            "A.jsonl:2: receive of message 4 has Lamport clock 5, not above its send's 5"},
           {line("A", "x", "send", "m", 10, 1, 4) + "hello world\n" + line("A", "y", "recv", "m", 20, 2, 4),
            "A.jsonl:2: not a JSON event line"},
           {good + "hello\nworld\n", "A.jsonl:3: not a JSON event line"},  // only one last line is torn
           {huge.dump() + "\n", "A.jsonl:1: 'ts' is 1152921504606846976, not an integer >= 0 and <= 9007199254740992"}}) {
    write(text);
    for (const char* cmd : {"merge", "summary", "shiviz"}) {
      const auto b = fp8rl::test::run_command(kBin + "/fp8rl-trace " + cmd + " " + run.string());
      EXPECT_EQ(b.rc, 2) << cmd << "\n" << b.out;
      EXPECT_NE(b.out.find(what), std::string::npos) << cmd << "\n" << b.out;
    }
  }
  write(good);
  fs::create_directories(run / "traces" / "B.jsonl");
  const auto dir = shiviz();
  EXPECT_EQ(dir.rc, 2);
  EXPECT_NE(dir.out.find("B.jsonl: not a readable file"), std::string::npos) << dir.out;
  fs::remove_all(run / "traces" / "B.jsonl");
  const auto file = fp8rl::test::run_command(kBin + "/fp8rl-trace summary " + (run / "traces" / "A.jsonl").string());
  EXPECT_NE(file.out.find("A.jsonl: not a directory"), std::string::npos) << file.out;
  fs::remove_all(run);
}
