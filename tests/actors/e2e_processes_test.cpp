// tests/actors/e2e_processes_test.cpp -- the whole system across processes on loopback: caf-run
// with one and two nodes (FP8 KV cache), killing the remote rollout process mid-run (the run
// finishes, every group is counted once), a failed local rollout restarted, caf-run's supervision
// of its group, lost nodes named, two learners all-reducing. One process: e2e_test.cpp.
#include <gtest/gtest.h>

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "actors/actors.hpp"
#include "models/checkpoint.hpp"
#include "tests/actors/e2e_util.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::test::e2e;

// caf-run with the shipped one-node topology runs the job, and says nothing of "every other
// node" (it said they had all exited as soon as the only node started). With no checkpoints
// scheduled the last step is checkpointed all the same, with the batch its scales came from.
TEST(E2E, CafRunWithOneNode) {
  const fs::path d = fresh_dir("one_node");
  std::ofstream(d / "hosts") << "127.0.0.1 slots=2\n";
  const auto r = fp8rl::test::run_command("cd " + d.string() + " && " + kBin + "/caf-run --hostfile hosts --topology " +
                                          fs::absolute("configs/topologies/local.conf").string() + " -- " + kBin +
                                          "/fp8rl train --run-dir " + (d / "run").string() + kSmall +
                                          " --run.steps=3 --run.checkpoint_every=0");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(metrics(d / "run").size(), 3u);
  EXPECT_EQ(r.out.find("every other node"), std::string::npos) << r.out;
  EXPECT_EQ(text_of(d / "run" / "checkpoints" / "latest"), "step_3\n");
  EXPECT_FALSE(fs::exists(d / "run" / "checkpoints" / "step_2"));
  EXPECT_NE(text_of(d / "run" / "checkpoints" / "step_3" / "calibration.jsonl").find("{\"tokens\":["), std::string::npos);
  fs::remove_all(d);
}

// With the FP8 KV cache: its Q/K/V scales travel in the bundles, and every layer's count of
// saturated K/V elements reaches the metrics from both processes' rollouts. The topology is given
// relative to caf-run's directory and the nodes run in another (--wdir) holding a file of the same
// name: they read the one caf-run checked (they were given the relative name).
TEST(E2E, TwoProcessesOnLoopbackViaCafRun) {
  const fs::path d = fresh_dir("two");
  two_process_topology(d, free_port());
  fs::create_directories(d / "wd");
  std::ofstream(d / "wd" / "two-process.conf") << "[cluster]\nnodes=[]\n";
  ASSERT_EQ(run("cd " + d.string() + " && " + kBin + "/caf-run --hostfile hosts --topology two-process.conf --wdir " +
                (d / "wd").string() + " -- " + kBin + "/fp8rl train --run-dir " + (d / "run").string() + kSmall +
                " --precision.generation=fp8-kv"),
            0);
  const auto m = metrics(d / "run");
  ASSERT_EQ(m.size(), 4u);
  // bundles crossed the process boundary; each version's sync reported once, naming the version
  std::set<double> synced;
  for (const auto& x : m)
    if (x.contains("sync_version")) {
      EXPECT_TRUE(synced.insert(x["sync_version"].get<double>()).second) << "v" << x["sync_version"] << " reported twice";
      EXPECT_EQ(x["sync_cross_process"], 1.0);
    }
  EXPECT_GE(synced.size(), 2u);
  // in version order with none lost (two reports within one step overwrote each other: 0, 1, 2, 4)
  EXPECT_EQ(*synced.rbegin(), double(synced.size() - 1)) << "a version's sync record is missing";
  EXPECT_EQ(m.back()["rollouts_live"], 2.0);
  const auto layers = fp8rl::models::checkpoint_load((d / "run" / "checkpoints" / "init").string()).params.cfg.num_hidden_layers;
  double per_layer = 0;
  for (int64_t l = 0; l < layers; ++l) {
    ASSERT_TRUE(m.back().contains("kv_saturated_total/layer" + std::to_string(l))) << l;
    per_layer += m.back()["kv_saturated_total/layer" + std::to_string(l)].get<double>();
  }
  EXPECT_EQ(m.back()["kv_saturated_total"], per_layer);
  // one timeline of both processes: every receive has its send, every message type that
  // crosses the process boundary does so in the trace, and the vector clocks order them
  // (fp8rl-trace, caf-0.17.md §7); adoptions carry the scale version
  const auto sv = fp8rl::test::run_command(kBin + "/fp8rl-trace shiviz " + (d / "run").string());
  ASSERT_EQ(sv.rc, 0) << sv.out;
  EXPECT_NE(sv.out.find(" 0 receives without their send"), std::string::npos) << sv.out;
  std::ifstream log(d / "run" / "trace.shiviz.log");
  std::string l;
  // (receiver, message, sender whose clock the receive must hold)
  const std::vector<std::array<std::string, 3>> across = {
      {"rollout1@rollout1", "recv bundle_chunk", "weight_sync@main"}, {"rollout1@rollout1", "recv work_msg", "controller@main"},
      {"rollout1@rollout1", "recv peers_msg", "controller@main"},     {"weight_sync@main", "recv chunk_ack", "rollout1@rollout1"},
      {"weight_sync@main", "recv adopted_msg", "rollout1@rollout1"},  {"reward@main", "recv group_msg", "rollout1@rollout1"}};
  std::set<size_t> seen;
  bool adopted_versions = false, sync_reported = false, calibration_reported = false;
  while (std::getline(log, l)) {
    for (size_t i = 0; i < across.size(); ++i)
      if (l.rfind(across[i][0] + " ", 0) == 0 && l.find(across[i][1] + " ") != std::string::npos &&
          l.find("\"" + across[i][2] + "\"") != std::string::npos)
        seen.insert(i);
    if (const size_t at = l.find(" recv adopted_msg v"); l.rfind("weight_sync@main ", 0) == 0 && at != std::string::npos) {
      std::istringstream rest(l.substr(at + 19));  // "<wv> s<sv> msg=..." (no std::regex: GCC 12 warns inside it under ASan)
      uint64_t wv = 0, sv = 0;
      char s_char = 0;
      adopted_versions |= static_cast<bool>(rest >> wv >> s_char >> sv) && s_char == 's';
    }
    sync_reported |= l.rfind("controller@main ", 0) == 0 && l.find("recv sync_report") != std::string::npos;
    calibration_reported |= l.rfind("controller@main ", 0) == 0 && l.find("recv calib_report") != std::string::npos &&
                            l.find("\"calibration@main\"") != std::string::npos;
  }
  for (size_t i = 0; i < across.size(); ++i) EXPECT_TRUE(seen.count(i)) << across[i][0] << " " << across[i][1];
  EXPECT_TRUE(adopted_versions);
  EXPECT_TRUE(sync_reported);
  EXPECT_TRUE(calibration_reported);
  fs::remove_all(d);
}

namespace {
// kill -9 of the rollout1 process of `topo` once `run` has 3 metrics lines (rows: how many it had,
// pkill_rc: pkill's status)
std::thread rollout1_killer(const fs::path& run, const std::string& topo, size_t& rows, int& pkill_rc) {
  return std::thread([&rows, &pkill_rc, run, topo] {
    for (int i = 0; i < 600 && rows < 3; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      rows = metrics_rows_so_far(run);
    }
    // "[r]ollout1": the pattern must not match the shell running pkill (that was killed too)
    const int st = std::system(("pkill -9 -f -- '" + topo + " --node [r]ollout1'").c_str());
    pkill_rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  });
}
// A quiet system with the middleman, to connect to a node as its controller would.
struct remote_config : caf::actor_system_config {
  remote_config();
};
// GCC 12 under -fsanitize=address reads CAF 0.17's config_value variant in set() as maybe
// uninitialized once inlined into a test body (a false positive: the same set() is clean in the
// Release build and in tests/actors/protocol_util.hpp): out of line, that one warning off here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
[[gnu::noinline]] remote_config::remote_config() {
  fp8rl::msg::messages_register(*this);
  load<caf::io::middleman>();
  set("logger.console", caf::atom("none"));
}
#pragma GCC diagnostic pop
std::string cafrun_train(const fs::path& d, const std::string& topo, int steps) {
  return kBin + "/caf-run --hostfile " + (d / "hosts").string() + " --topology " + topo + " -- " + kBin + "/fp8rl train --run-dir " +
         (d / "run").string() + " --run.steps=" + std::to_string(steps) +
         " --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=60 --rollout.prompts_per_step=8";
}
}  // namespace

TEST(E2E, KillingTheRemoteRolloutMidRunIsSurvived) {
  const fs::path d = fresh_dir("kill");
  const std::string topo = two_process_topology(d, free_port());
  const int steps = 60;  // the kill lands after step 3, with room to spare on a busy machine
  int pkill_rc = -1;
  size_t killed_after = 0;
  std::thread killer = rollout1_killer(d / "run", topo, killed_after, pkill_rc);
  const auto r = fp8rl::test::run_command(cafrun_train(d, topo, steps));
  killer.join();
  EXPECT_EQ(r.rc, 0) << r.out;
  // the peer that disappeared is reported, and the group goes on
  EXPECT_NE(r.out.find("caf-run: rollout1 failed (exit 137); the controller decides whether the run goes on"), std::string::npos)
      << r.out;
  ASSERT_EQ(pkill_rc, 0) << "no rollout1 process was killed";
  ASSERT_LT(killed_after, static_cast<size_t>(steps)) << "the run ended before the kill";
  const auto m = metrics(d / "run");
  ASSERT_EQ(m.size(), static_cast<size_t>(steps));
  EXPECT_EQ(m.back()["rollouts_lost_total"], 1.0);
  EXPECT_EQ(m.back()["rollouts_live"], 1.0);
  EXPECT_EQ(m.back()["buffer/admitted_total"], steps * 8.0);  // every group counted exactly once
  fs::remove_all(d);
}

// The only rollout's process killed: the run fails (exit 1), but learner0 checkpoints the step it
// is at first, and --resume goes on from there (the run ended at once, and only checkpoints/init
// was left with checkpoint_every = 0).
TEST(E2E, LosingEveryRolloutFailsTheRunCheckpointed) {
  const fs::path d = fresh_dir("kill_all");
  const std::string topo = two_process_topology(d, free_port(), false);
  const int steps = 60;
  int pkill_rc = -1;
  size_t killed_after = 0;
  std::thread killer = rollout1_killer(d / "run", topo, killed_after, pkill_rc);
  const auto r = fp8rl::test::run_command(cafrun_train(d, topo, steps));
  killer.join();
  ASSERT_EQ(pkill_rc, 0) << "no rollout1 process was killed";
  ASSERT_LT(killed_after, static_cast<size_t>(steps)) << "the run ended before the kill";
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("every rollout actor is gone"), std::string::npos) << r.out;
  const auto m = metrics(d / "run");
  ASSERT_GE(m.size(), killed_after);
  const std::string at = "step_" + std::to_string(m.size());
  EXPECT_EQ(text_of(d / "run" / "checkpoints" / "latest"), at + "\n") << r.out;
  EXPECT_NE(r.out.find(at + " is the latest checkpoint; to continue"), std::string::npos) << r.out;
  const auto again = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts").string() + " --topology " + topo +
                                              " -- " + kBin + "/fp8rl train --resume --run-dir " + (d / "run").string());
  EXPECT_EQ(again.rc, 0) << again.out;
  EXPECT_EQ(metrics(d / "run").size(), static_cast<size_t>(steps));
  fs::remove_all(d);
}

// architecture.md §4: a failed rollout actor is restarted with its in-flight prompts re-queued
// (it was dropped: the run went on with one rollout fewer). Fault injected in the rollout.
TEST(E2E, FailedRolloutIsRestartedAndItsWorkRequeued) {
  const fs::path d = fresh_dir("restart");
  const int steps = 5;
  ASSERT_EQ(run("FP8RL_FAULT_ROLLOUT_EXIT_AT_STEP=2 " + kBin + "/fp8rl train --run-dir " + (d / "run").string() +
                " --run.steps=" + std::to_string(steps) + " --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=40"
                " --rollout.prompts_per_step=8"),
            0);
  const auto m = metrics(d / "run");
  ASSERT_EQ(m.size(), static_cast<size_t>(steps));
  EXPECT_EQ(m.back()["rollouts_lost_total"], 1.0);
  EXPECT_EQ(m.back()["rollouts_restarted_total"], 1.0);
  EXPECT_EQ(m.back()["rollouts_live"], 1.0);
  EXPECT_GE(m.back()["reissued_groups_total"].get<double>(), 1.0);
  EXPECT_EQ(m.back()["buffer/admitted_total"], steps * 8.0);  // every group counted exactly once
  // eval_every = 0 validates the last step only (every run ends with a validation)
  EXPECT_TRUE(m.back().contains("val_accuracy")) << m.back().dump();
  EXPECT_FALSE(m.front().contains("val_accuracy")) << m.front().dump();
  // the hook's value is a step number or refused, named (strtoull made "2x" step 2 and "x" step 0)
  const auto bad = fp8rl::test::run_command("FP8RL_FAULT_ROLLOUT_EXIT_AT_STEP=2x " + kBin + "/fp8rl train --run-dir " +
                                            (d / "bad").string() + " --run.steps=1 --model.sft_steps=2 --rollout.prompts_per_step=2");
  EXPECT_NE(bad.rc, 0) << bad.out;
  EXPECT_NE(bad.out.find("FP8RL_FAULT_ROLLOUT_EXIT_AT_STEP='2x': not a whole number"), std::string::npos) << bad.out;
  fs::remove_all(d);
}

// caf-run supervises its group: SIGTERM to caf-run stops every node (they run in their own
// process groups and kept training after caf-run was gone), and a node that fails before it
// is up stops the group at once (the controller retried its connection for 60 s).
TEST(E2E, CafRunStopsItsGroup) {
  const fs::path d = fresh_dir("cafrun");
  // the group with its topology, run and log in dir/, rollout1 on `port` (each run gets one of its
  // own: a port freed between runs could go to another test process's free_port()); a long
  // --grace: the nodes stop by themselves (a step, a checkpoint), not by its SIGKILL
  auto cafrun_in = [&](const fs::path& dir, int port, int grace = 30) {
    fs::create_directories(dir);
    return kBin + "/caf-run --grace " + std::to_string(grace) + " --hostfile " + (dir / "hosts").string() + " --topology " +
           two_process_topology(dir, port) + " -- " + kBin + "/fp8rl train --run-dir " + (dir / "run").string() +
           " --run.steps=100000 --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=20";
  };
  const int port = free_port();
  const std::string cafrun = cafrun_in(d, port), topo = (d / "two-process.conf").string();
  const pid_t pid = start_until_two_steps(cafrun, d);
  ASSERT_GT(pid, 0) << "the run did not start";
  ::kill(pid, SIGTERM);
  const int st = wait_exit(pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 143) << st;
  const std::string text = text_of(d / "log");
  EXPECT_NE(text.find("caf-run: stopped by a signal; every node was stopped"), std::string::npos) << text;
  // the nodes stop the run at a step, checkpointed: the controller exits with the signal's code, the
  // rollout node when the controller tells it (the SIGTERM killed both)
  EXPECT_NE(text.find("main exited with 143\n"), std::string::npos) << text;
  EXPECT_NE(text.find("rollout1 exited with 0\n"), std::string::npos) << text;
  EXPECT_EQ(text_of(d / "run" / "checkpoints" / "latest"), "step_" + std::to_string(metrics(d / "run").size()) + "\n") << text;
  // the whole group signalled at once (systemd, scancel): caf-run and every node get SIGTERM; a node's
  // own is a stop request, caf-run adds no second one (it killed every node at once, unsaved)
  auto start_in = [&](const fs::path& sub) { return start_until_two_steps(cafrun_in(sub, free_port()), sub); };
  const fs::path g = d / "group";
  const pid_t group = start_in(g);
  ASSERT_GT(group, 0) << "the second run did not start";
  const std::string started = text_of(g / "log");
  for (const pid_t node : node_pids(started)) ::kill(-node, SIGTERM);  // each node's process group
  ::kill(group, SIGTERM);
  ::kill(group, SIGINT);  // twice from its parent, as `timeout` does (to it and to its group): one signal
  const int group_st = wait_exit(group);
  const std::string group_log = text_of(g / "log");
  EXPECT_TRUE(WIFEXITED(group_st) && WEXITSTATUS(group_st) == 143) << group_log;
  EXPECT_EQ(group_log.find("a second signal: stopping at once"), std::string::npos) << group_log;
  EXPECT_EQ(group_log.find("caf-run: a second signal; SIGKILL now"), std::string::npos) << group_log;
  EXPECT_NE(group_log.find("rollout1 exited with 143\n"), std::string::npos) << group_log;  // signalled itself: 128 + SIGTERM
  EXPECT_EQ(text_of(g / "run" / "checkpoints" / "latest"), "step_" + std::to_string(metrics(g / "run").size()) + "\n") << group_log;
  // one node preempted (SIGTERM to it alone): the run stops checkpointed, and caf-run says so
  // rather than "node main failed (exit 143)"
  const fs::path pre = d / "preempt";
  const pid_t pgroup = start_in(pre);
  ASSERT_GT(pgroup, 0) << "the preemption run did not start";
  ASSERT_EQ(node_pids(text_of(pre / "log")).size(), 2u);
  ::kill(-node_pids(text_of(pre / "log"))[1], SIGTERM);  // rollout1's process group
  const int pre_st = wait_exit(pgroup);
  const std::string pre_log = text_of(pre / "log");
  EXPECT_TRUE(WIFEXITED(pre_st) && WEXITSTATUS(pre_st) == 143) << pre_log;
  EXPECT_NE(pre_log.find("caf-run: the controller node main stopped the run on a signal (exit 143)"), std::string::npos) << pre_log;
  EXPECT_EQ(pre_log.find("failed (exit"), std::string::npos) << pre_log;
  for (const pid_t node : node_pids(text))
    EXPECT_FALSE(fs::exists("/proc/" + std::to_string(node))) << "node pid " << node << " outlived caf-run";
  EXPECT_EQ(node_pids(text).size(), 2u) << text;  // caf-run's start lines name each node's pid
  // the rollout node cannot open its port (held here from the start: bound to port 0, then read)
  const int busy = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(busy, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(busy, 1), 0);
  ASSERT_EQ(::getsockname(busy, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int held = ntohs(a.sin_port);
  // bounded: a caf-run that let the controller run on would otherwise train its 100000 steps (the
  // test hung); timeout's SIGTERM makes it stop the group, exit 143, and the check below fail
  const auto r = fp8rl::test::run_command("timeout 120 " + cafrun_in(d / "busy", held));
  ::close(busy);
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("node rollout1 failed (exit 1); the group was stopped"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cannot open port " + std::to_string(held) + " on 127.0.0.1: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("-- the port is in use (another run or program listens there)"), std::string::npos) << r.out;
  // its standard output cannot be written (a full disk): a stop request, said on stderr (the nodes'
  // lines were lost in silence and the run went on to its end, exit 0); stopped in its start, the
  // rollout node waits for a controller until caf-run's --grace is over
  const auto full = fp8rl::test::run_command("(timeout 120 " + cafrun_in(d / "full", free_port(), 2) + " > /dev/full)");
  EXPECT_EQ(full.rc, 143) << full.out;  // the controller's, stopped as by a signal
  EXPECT_NE(full.out.find("caf-run: writing standard output failed: No space left on device; stopping the run as on a signal"),
            std::string::npos) << full.out;
  EXPECT_NE(full.out.find("caf-run: stopped by its failed output; every node was stopped"), std::string::npos) << full.out;
  // a node without a host entry after one with it: refused before any node starts (the earlier
  // node was started and left running); a slots value that is not all a number is refused
  const fs::path three = d / "three.conf";
  std::ofstream(three) << "[cluster]\nnodes=[{name=\"main\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", "
                          "\"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]},\n"
                          "{name=\"near\", host=\"127.0.0.1\", port=" << port << ", rollouts=[\"cpu:1\"]},\n"
                          "{name=\"far\", host=\"192.0.2.7\", port=" << port + 1 << ", rollouts=[\"cpu:1\"]}]\n";
  const std::string tail = " -- " + kBin + "/fp8rl train --run-dir " + (d / "run3").string();
  const auto r3 = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts").string() + " --topology " + three.string() + tail);
  EXPECT_NE(r3.out.find("no host entry for node 'far'"), std::string::npos) << r3.out;
  EXPECT_EQ(r3.out.find("caf-run: started"), std::string::npos) << r3.out;
  EXPECT_FALSE(fs::exists(d / "run3"));
  std::ofstream(d / "hosts4x") << "127.0.0.1 slots=4x\n";
  const auto r4 = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts4x").string() + " --topology " + topo + tail);
  EXPECT_NE(r4.out.find("hosts4x:1: slots must be an integer in [1, 2^20], got '4x'"), std::string::npos) << r4.out;
  // a host listed twice, or slots given twice, took the last value silently
  std::ofstream(d / "hosts2") << "127.0.0.1 slots=2\n# comment\n127.0.0.1 slots=8\n";
  const auto r8 = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts2").string() + " --topology " + topo + tail);
  EXPECT_NE(r8.out.find("hosts2:3: host '127.0.0.1' is already on line 1"), std::string::npos) << r8.out;
  // also under another name of this machine (the last local entry won, over an exact match)
  std::ofstream(d / "hosts2") << "127.0.0.1 slots=2\nlocalhost slots=16\n";
  const auto r10 = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts2").string() + " --topology " + topo + tail);
  EXPECT_NE(r10.out.find("hosts2:2: host 'localhost' is already on line 1 (as '127.0.0.1': the same machine)"), std::string::npos)
      << r10.out;
  // a program the local nodes cannot execute, before any starts (each said so itself, exit 127)
  const auto r11 = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts").string() + " --topology " + topo + " -- " +
                                            (d / "no-such-program").string() + " train");
  EXPECT_EQ(r11.rc, 2) << r11.out;
  EXPECT_NE(r11.out.find("cannot execute CMD: " + (d / "no-such-program").string() + ": no such file"), std::string::npos) << r11.out;
  EXPECT_EQ(r11.out.find("caf-run: started"), std::string::npos) << r11.out;
  // ... looked up as execvp does after the nodes' chdir: PATH's relative entries from --wdir, and
  // glibc's default path where PATH is unset (both were refused: "not found on PATH")
  fs::create_directories(d / "w" / "bin");
  std::ofstream(d / "w" / "bin" / "ok") << "#!/bin/sh\nexit 0\n";
  fs::permissions(d / "w" / "bin" / "ok", fs::perms::owner_all);
  const std::string hostfile = " --hostfile " + (d / "hosts").string();
  for (const std::string& c : {"PATH=bin:$PATH " + kBin + "/caf-run --wdir " + (d / "w").string() + hostfile + " --topology " + topo + " -- ok",
                               "env -i " + kBin + "/caf-run" + hostfile + " --topology " + topo + " -- true"}) {
    const auto r12 = fp8rl::test::run_command(c);
    EXPECT_EQ(r12.rc, 0) << c << "\n" << r12.out;
    EXPECT_NE(r12.out.find("main exited with 0"), std::string::npos) << c << "\n" << r12.out;
  }
  // under nohup the nodes keep SIGHUP ignored (caf-run caught it and reset it to the default in them)
  std::ofstream(d / "w" / "bin" / "sigign") << "#!/bin/sh\ngrep SigIgn /proc/$$/status\n";
  fs::permissions(d / "w" / "bin" / "sigign", fs::perms::owner_all);
  const auto r13 = fp8rl::test::run_command("nohup " + kBin + "/caf-run" + hostfile + " --topology " + topo + " -- " + (d / "w" / "bin" / "sigign").string());
  const size_t ign = r13.out.find("[main] SigIgn:");
  ASSERT_NE(ign, std::string::npos) << r13.out;
  const std::string mask = r13.out.substr(ign + 14, r13.out.find('\n', ign) - ign - 14);
  EXPECT_EQ(std::stoull(mask, nullptr, 16) & 1, 1u) << "SIGHUP not ignored in the node: " << r13.out;  // bit 0: signal 1
  std::ofstream(d / "hosts2") << "127.0.0.1 slots=2 slots=8\n";
  const auto r9 = fp8rl::test::run_command(kBin + "/caf-run --hostfile " + (d / "hosts2").string() + " --topology " + topo + tail);
  EXPECT_NE(r9.out.find("hosts2:1: slots given twice"), std::string::npos) << r9.out;
  // a --wdir that does not exist (each local node exited 126 without a word), an option given twice
  // (the last won), and the --key=value form (refused as unknown)
  const std::string hosts = " --hostfile " + (d / "hosts").string();
  const auto r5 = fp8rl::test::run_command(kBin + "/caf-run --wdir " + (d / "nowhere").string() + hosts + " --topology " + topo + tail);
  EXPECT_EQ(r5.rc, 2) << r5.out;
  EXPECT_NE(r5.out.find("nowhere: not a directory"), std::string::npos) << r5.out;
  const auto r6 = fp8rl::test::run_command(kBin + "/caf-run --hostfile /nonexistent" + hosts + " --topology " + topo + tail);
  EXPECT_NE(r6.out.find("option --hostfile given twice"), std::string::npos) << r6.out;
  const auto r7 = fp8rl::test::run_command(kBin + "/caf-run --grace=x" + hosts + " --topology " + topo + tail);
  EXPECT_NE(r7.out.find("--grace 'x'"), std::string::npos) << r7.out;
  EXPECT_FALSE(fs::exists(d / "run3"));
  // a second signal kills the group at once (here nodes that ignore SIGTERM, under a long --grace)
  std::ofstream(d / "w" / "bin" / "deaf") << "#!/bin/sh\ntrap '' TERM\necho deaf\nwhile :; do sleep 1; done\n";
  fs::permissions(d / "w" / "bin" / "deaf", fs::perms::owner_all);
  const pid_t deaf = spawn_logged(kBin + "/caf-run --grace 600" + hostfile + " --topology " + topo + " -- " + (d / "w" / "bin" / "deaf").string(), d / "w");
  auto deaf_nodes = [&] {  // both scripts past their trap
    const std::string t = text_of(d / "w" / "log");
    return t.find("[main] deaf") != std::string::npos && t.find("[rollout1] deaf") != std::string::npos;
  };
  for (int i = 0; i < 100 && !deaf_nodes(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(deaf, SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(::waitpid(deaf, nullptr, WNOHANG), 0) << "caf-run did not wait for --grace";
  // from a shell, not this process (its parent: a parent's repeat within 2 s is the same signal)
  ASSERT_EQ(std::system(("kill -s INT " + std::to_string(deaf)).c_str()), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const int deaf_st = wait_exit(deaf);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_TRUE(WIFEXITED(deaf_st) && WEXITSTATUS(deaf_st) == 137) << deaf_st;  // the controller's: killed
  const std::string deaf_log = text_of(d / "w" / "log");
  for (const pid_t node : node_pids(deaf_log)) ::kill(-node, SIGKILL);  // nothing outlives a failed check
  EXPECT_NE(deaf_log.find("caf-run: a second signal; SIGKILL now"), std::string::npos) << deaf_log;
  EXPECT_NE(deaf_log.find("main exited with 137 (killed by SIGKILL)"), std::string::npos) << deaf_log;
  // killed, not first told to stop, and not blamed on a node (it said "stopping X (SIGTERM)" for
  // the nodes it then killed, and "X failed (exit 137); the controller decides ...")
  EXPECT_EQ(deaf_log.find("(SIGTERM)", deaf_log.find("a second signal")), std::string::npos) << deaf_log;
  EXPECT_NE(deaf_log.find("rollout1 killed (SIGKILL)"), std::string::npos) << deaf_log;
  EXPECT_EQ(deaf_log.find("the controller decides"), std::string::npos) << deaf_log;
  fs::remove_all(d);
}

// caf-run with script nodes: the nodes follow the controller node's exit (SIGTERM); slots past 8
// give a node that many CAF workers; a hostfile names this machine by any of its names; slots=0 is
// refused.
TEST(E2E, CafRunWithScriptNodes) {
  const fs::path d = fresh_dir("cafrun_scripts");
  const std::string topo = two_process_topology(d, free_port());
  const fs::path node = d / "node.sh";
  std::ofstream(node) << "#!/bin/sh\necho \"args: $*\"\ncase \"$*\" in *'--node main'*) exit 0;; esac\nwhile :; do sleep 1; done\n";
  fs::permissions(node, fs::perms::owner_all);
  auto cafrun = [&](const std::string& hosts_line) {
    std::ofstream(d / "h") << hosts_line << "\n";
    return fp8rl::test::run_command("timeout 60 " + kBin + "/caf-run --grace 2 --hostfile " + (d / "h").string() + " --topology " +
                                    topo + " -- " + node.string());
  };
  const auto nine = cafrun("localhost slots=9");  // the topology says 127.0.0.1
  EXPECT_EQ(nine.rc, 0) << nine.out;
  EXPECT_NE(nine.out.find("--node main --scheduler.max-threads=9"), std::string::npos) << nine.out;
  EXPECT_NE(nine.out.find("caf-run: stopping rollout1 (SIGTERM)"), std::string::npos) << nine.out;
  EXPECT_NE(nine.out.find("caf-run: rollout1 exited with 143 (killed by SIGTERM)"), std::string::npos) << nine.out;
  const auto eight = cafrun("127.0.0.1 slots=8");
  EXPECT_EQ(eight.rc, 0) << eight.out;
  EXPECT_NE(eight.out.find("--node main\n"), std::string::npos) << eight.out;
  EXPECT_EQ(eight.out.find("--scheduler.max-threads"), std::string::npos) << eight.out;
  const auto zero = cafrun("127.0.0.1 slots=0");
  EXPECT_EQ(zero.rc, 2) << zero.out;
  EXPECT_NE(zero.out.find("h:1: slots must be an integer in [1, 2^20], got '0'"), std::string::npos) << zero.out;
  fs::remove_all(d);
}

// A node process holding learner0, calibration and weight-sync killed -9: the run fails naming the
// node by its topology name and the actors lost with it (it said "the calibration actor (in another
// process) went down", whichever down message came first), and caf-run names the signal.
TEST(E2E, ALostNodeIsNamedWithItsActors) {
  const fs::path d = fresh_dir("lostnode");
  const fs::path topo = d / "split.conf";
  std::ofstream(topo) << "[cluster]\nnodes=[{name=\"ctl\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", "
                         "\"reward\"], learners=[], rollouts=[\"cpu:1\"]},\n"
                         "{name=\"learn\", host=\"127.0.0.1\", port=" << free_port() << ", roles=[\"calibration\", \"weight_sync\"], "
                         "learners=[\"cpu:1\"], rollouts=[]}]\n";
  std::ofstream(d / "hosts") << "127.0.0.1 slots=2\n";
  const std::string cafrun = kBin + "/caf-run --grace 2 --hostfile " + (d / "hosts").string() + " --topology " + topo.string() +
                             " -- " + kBin + "/fp8rl train --run-dir " + (d / "run").string() +
                             " --run.steps=100000 --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=20";
  const pid_t pid = start_until_two_steps(cafrun, d);
  auto log_text = [&] { std::ifstream log(d / "log"); return std::string((std::istreambuf_iterator<char>(log)), {}); };
  const std::string before = log_text();
  ASSERT_GT(pid, 0) << "the run did not start\n" << before;
  const size_t at = before.find("started learn (pid ");
  if (at == std::string::npos) ::kill(pid, SIGTERM);
  ASSERT_NE(at, std::string::npos) << before;
  ::kill(static_cast<pid_t>(std::stol(before.substr(at + 19))), SIGKILL);
  wait_exit(pid);
  const std::string text = log_text();
  // whichever of the three down messages comes first names the node and the other two
  const char* const lines[] = {"the calibration actor (node 'learn', which also runs learner0, the weight-sync actor) went down",
                               "learner0 (node 'learn', which also runs the weight-sync actor, the calibration actor) went down",
                               "the weight-sync actor (node 'learn', which also runs learner0, the calibration actor) went down"};
  EXPECT_TRUE(std::any_of(std::begin(lines), std::end(lines), [&](const char* l) { return text.find(l) != std::string::npos; })) << text;
  EXPECT_NE(text.find("learn exited with 137 (killed by SIGKILL)"), std::string::npos) << text;
  EXPECT_NE(text.find("caf-run: node ctl failed (exit 1)"), std::string::npos) << text;
  fs::remove_all(d);
}

// A node whose controller disappears stops its actors and exits 1 saying so (it exited 0 in
// silence).
TEST(E2E, NodeSaysWhenItsControllerDisappears) {
  const fs::path d = fresh_dir("lostctl");
  const std::string topo = two_process_topology(d, free_port());
  fp8rl::test::command_result r;
  std::thread node([&] { r = fp8rl::test::run_command(kBin + "/fp8rl train --topology " + topo + " --node rollout1"); });
  // the controller, killed -9 once the run is under way (2 steps)
  const pid_t main = start_until_two_steps(kBin + "/fp8rl train --topology " + topo + " --node main --run-dir " +
                                               (d / "run").string() +
                                               " --run.steps=100000 --run.eval_every=0 --run.checkpoint_every=0 --model.sft_steps=20",
                                           d);
  if (main > 0) ::kill(main, SIGKILL), ::waitpid(main, nullptr, 0);
  node.join();
  ASSERT_GT(main, 0) << "the run did not reach 2 steps: " << text_of(d / "log");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("fp8rl node rollout1: lost the controller ("), std::string::npos) << r.out;
  fs::remove_all(d);
}

// A controller that reaches another node process than it meant (a host/port mix-up between
// topology files) is refused by that node's agent, naming both nodes, and the run fails at
// startup (the node used to start whatever actors the controller asked for).
TEST(E2E, NodeRefusesAControllerAskingForAnotherNode) {
  const fs::path d = fresh_dir("wrongnode");
  const int port = free_port();
  const std::string topo = two_process_topology(d, port);
  const fs::path other = d / "other.conf";  // the same port, the node called rolloutX
  std::ofstream(other) << "[cluster]\nnodes=[{name=\"main\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", "
                          "\"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]},\n"
                          "{name=\"rolloutX\", host=\"127.0.0.1\", port=" << port << ", roles=[], learners=[], rollouts=[\"cpu:1\"]}]\n";
  const pid_t node = spawn_logged(kBin + "/fp8rl train --topology " + other.string() + " --node rolloutX", d);
  const auto r = fp8rl::test::run_command(kBin + "/fp8rl train --topology " + topo + " --node main --run-dir " +
                                          (d / "run").string() + kSmall);
  ::kill(node, SIGTERM);  // (it stops by itself once its controller is gone)
  wait_exit(node);
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("this process runs node 'rolloutX', the controller asked for node 'rollout1'"), std::string::npos) << r.out;
  fs::remove_all(d);
}

// A node whose answer names other actors than its topology entry (another fp8rl build there:
// here the test hook misnames its rollout) fails the run at startup, naming the node and what
// differs; the run used to go on with whatever the node said it runs.
TEST(E2E, ANodeAnsweringWithOtherActorsFailsTheStart) {
  const fs::path d = fresh_dir("node_answer");
  const std::string topo = two_process_topology(d, free_port());
  const pid_t node = spawn_logged("env FP8RL_FAULT_NODE_ANSWER=rename " + kBin + "/fp8rl train --topology " + topo + " --node rollout1", d);
  // (a bound: a run that took the answer waited for work from a rollout named nowhere)
  const auto r = fp8rl::test::run_command("timeout 120 " + kBin + "/fp8rl train --topology " + topo + " --node main --run-dir " +
                                          (d / "run").string() + kSmall);
  ::kill(node, SIGTERM);
  wait_exit(node);
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("node 'rollout1' started other actors than its topology entry names: rollout 'rollout1-renamed' "
                       "where rollout1 belongs (another fp8rl build there?)"),
            std::string::npos) << r.out;
  EXPECT_EQ(metrics(d / "run").size(), 0u);  // no step ran
  fs::remove_all(d);
}

// A node gives up on its controller after --node-wait: one that never connects, and one that
// connects, spawns the node's agent and is gone before starting it (nothing monitored that
// controller yet: the node waited for good).
TEST(E2E, ANodeGivesUpOnAControllerThatNeverStartsIt) {
  const fs::path d = fresh_dir("node_wait");
  const int port = free_port();
  const std::string topo = two_process_topology(d, port);
  const std::string node = kBin + "/fp8rl train --topology " + topo + " --node rollout1";
  const auto alone = fp8rl::test::run_command("timeout 60 " + node + " --node-wait 1");
  EXPECT_EQ(alone.rc, 1) << alone.out;
  EXPECT_NE(alone.out.find("fp8rl node rollout1: no controller connected within 1 s (--node-wait)"), std::string::npos) << alone.out;
  const pid_t pid = spawn_logged(node + " --node-wait 10", d);  // room to connect and spawn on a loaded machine
  {
    remote_config cfg;
    caf::actor_system sys{cfg};
    caf::expected<caf::node_id> nid = caf::sec::cannot_connect_to_node;
    for (int i = 0; i < 60 && !nid; ++i) {  // the node may still be opening its port
      nid = fp8rl::actors::node_connect(sys, "127.0.0.1", static_cast<uint16_t>(port), std::chrono::seconds(5));
      if (!nid) std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    ASSERT_TRUE(nid) << sys.render(nid.error());
    auto agent = sys.middleman().remote_spawn<fp8rl::msg::node_agent_actor>(*nid, "node_agent", caf::make_message(),
                                                                            std::chrono::seconds(30));
    ASSERT_TRUE(agent) << sys.render(agent.error());
  }  // gone without a start
  const int st = wait_exit(pid);
  const std::string log = text_of(d / "log");
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << st << "\n" << log;
  EXPECT_NE(log.find("fp8rl node rollout1: the controller connected and did not start this node within 10 s (it exited or "
                     "stalled; --node-wait)"), std::string::npos) << log;
  const auto bad = fp8rl::test::run_command(node + " --node-wait 0");
  EXPECT_NE(bad.rc, 0) << bad.out;
  EXPECT_NE(bad.out.find("option --node-wait: '0' is not a whole number of seconds in [1, 86400]"), std::string::npos) << bad.out;
  fs::remove_all(d);
}

// Learner ranks wait for each other in an all-reduce up to run.collective_timeout_s: rank 0's
// step made 5 s longer (a larger shard) fails a run that allows 2 s (Gloo's store counts whole
// seconds: its wait ends at ~3 s), naming the rank, the key and Gloo's reason -- at the first step
// in the rendezvous (Gloo's store waited its own 30 s whatever the setting: such a run went on),
// at the second in the gradients' all-reduce (after step 1's metrics) -- and a run that allows 30 s
// trains through a 2.5 s wait. A sleep without its step is refused.
TEST(E2E, LearnerRanksWaitForEachOtherUpToTheCollectiveTimeout) {
  const fs::path d = fresh_dir("collective");
  const fs::path topo = d / "two-learners.conf";
  std::ofstream(topo) << "[cluster]\nnodes=[{name=\"main\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", "
                         "\"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\", \"cpu:1\"], rollouts=[\"cpu:1\"]}]\n";
  auto train = [&](const std::string& fault, int timeout_s, const std::string& dir) {
    return fp8rl::test::run_command(fault + " " + kBin + "/fp8rl train --topology " + topo.string() + " --run-dir " + (d / dir).string() +
                                    " --run.steps=3 --run.eval_every=0 --model.sft_steps=60 --run.collective_timeout_s=" +
                                    std::to_string(timeout_s));
  };
  const std::string named = "learner1: step failed: learner rank 1 of 2: the all-reduce with the other rank(s) failed (each waits up "
                            "to run.collective_timeout_s = 2 s for the others): ";
  for (const auto& [at_step, why] : std::vector<std::pair<int, std::string>>{{1, "Wait timeout for key(s)"}, {2, "Read timeout"}}) {
    const std::string dir = "fails" + std::to_string(at_step);
    const auto r = train("FP8RL_FAULT_RANK0_SLEEP_MS=5000 FP8RL_FAULT_RANK0_SLEEP_AT_STEP=" + std::to_string(at_step), 2, dir);
    EXPECT_EQ(r.rc, 1) << r.out;
    EXPECT_NE(r.out.find(named), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(why, r.out.find(named)), std::string::npos) << r.out;
    EXPECT_EQ(metrics(d / dir).size(), size_t(at_step - 1)) << r.out;
  }
  const auto ok = train("FP8RL_FAULT_RANK0_SLEEP_MS=2500 FP8RL_FAULT_RANK0_SLEEP_AT_STEP=2", 30, "waits");
  ASSERT_EQ(ok.rc, 0) << ok.out;
  EXPECT_EQ(metrics(d / "waits").size(), 3u);
  const auto half = train("FP8RL_FAULT_RANK0_SLEEP_MS=10", 30, "half");
  EXPECT_NE(half.rc, 0) << half.out;
  EXPECT_NE(half.out.find("FP8RL_FAULT_RANK0_SLEEP_MS and FP8RL_FAULT_RANK0_SLEEP_AT_STEP go together"), std::string::npos) << half.out;
  fs::remove_all(d);
}

TEST(E2E, TwoLearnersAllReduceAndAuditMode) {
  const fs::path d = fresh_dir("learners");
  const fs::path topo = d / "two-learners.conf";
  std::ofstream(topo) << "[cluster]\nnodes=[{name=\"main\", host=\"127.0.0.1\", port=0, roles=[\"controller\", \"buffer\", "
                         "\"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\", \"cpu:1\"], rollouts=[\"cpu:1\"]}]\n";
  ASSERT_EQ(run(kBin + "/fp8rl train --topology " + topo.string() + " --run-dir " + (d / "run").string() + kSmall +
                " --audit.every=1 --audit.samples=4"),
            0);
  const auto m = metrics(d / "run");
  ASSERT_EQ(m.size(), 4u);
  EXPECT_TRUE(fs::exists(d / "run" / "gloo"));  // the learners met through Gloo's file store
  bool audited = false;
  double weight_quant = 0;
  for (const auto& x : m) {
    // every step audited: trajectories sampled across an adoption too (re-scored per version; all
    // of a step's were skipped before), none with a kept KV cache (kv_policy recompute)
    EXPECT_GE(x.value("audit/trajectories", 0.0), 1.0) << x.dump();
    EXPECT_EQ(x.value("audit/skipped_kept_kv", -1.0), 0.0) << x.dump();
    audited |= x.contains("audit/precision_kl") && x.contains("audit/staleness_kl");
    if (!x.contains("audit/kernel_kv_kl")) continue;
    EXPECT_GE(x["audit/trajectories"].get<double>(), 1.0);
    EXPECT_LE(x["audit/trajectories"].get<double>(), 4.0) << "audit.samples counts trajectories";
    // FP8 generation without an FP8 KV cache: the engine's logprobs are the training forward's under
    // the same FP8 weights bit for bit, so the whole precision mismatch is weight quantization
    EXPECT_EQ(x["audit/kernel_kv_kl"].get<double>(), 0.0) << x.dump();
    // the learner's policy is the generation's FP8 one: its re-score is q8's, no mismatch
    EXPECT_EQ(x["audit/learner_gen_kl_error"].get<double>(), 0.0) << x.dump();
    EXPECT_EQ(x["audit/learner_token_mult_prob_error"].get<double>(), 1.0) << x.dump();
    EXPECT_EQ(x["audit/weight_quant_kl"].get<double>(), x["audit/precision_kl"].get<double>()) << x.dump();
    weight_quant += x["audit/weight_quant_kl"].get<double>();
  }
  EXPECT_TRUE(audited);
  EXPECT_GT(weight_quant, 0.0);
  // kv_policy keep: the run goes on; a trajectory on a cache kept across an adoption is not
  // re-scored (no forward reproduces its context), counted
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "keep").string() + kSmall +
                " --audit.every=1 --audit.samples=4 --run.steps=3 --run.eval_every=0 --rollout.kv_policy=keep"),
            0);
  for (const auto& x : metrics(d / "keep")) {
    EXPECT_TRUE(x.contains("audit/skipped_kept_kv")) << x.dump();
    EXPECT_GE(x.value("audit/trajectories", 0.0) + x.value("audit/skipped_kept_kv", 0.0), 1.0) << x.dump();
  }
  // with the FP8 KV cache and attention the kernel/KV part is no longer 0
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "kv").string() + kSmall +
                " --audit.every=2 --audit.samples=4 --run.steps=2 --run.eval_every=0 --precision.generation=fp8-kv"),
            0);
  const auto kv = metrics(d / "kv");
  ASSERT_EQ(kv.size(), 2u);
  EXPECT_FALSE(kv[0].contains("audit/kernel_kv_kl")) << "audit.every=2 audits steps 2, 4, ...: " << kv[0].dump();
  EXPECT_GT(kv[1].value("audit/kernel_kv_kl", 0.0), 0.0) << kv[1].dump();
  EXPECT_EQ(kv[1].value("audit/learner_gen_kl_error", -1.0), kv[1].value("audit/kernel_kv_kl", 0.0)) << kv[1].dump();
  // the step metrics cover the whole step whatever the sharding: one learner and two, staleness 0,
  // agree exactly at step 1 (same rollouts from the same weights; rank 0 reported its own shard:
  // token_mult_prob_error ~0.5, half the staleness histogram)
  const std::string sync = kSmall + std::string(" --async.max_staleness=0 --run.steps=2 --run.eval_every=0");
  ASSERT_EQ(run(kBin + "/fp8rl train --topology " + topo.string() + " --run-dir " + (d / "two").string() + sync), 0);
  // fewer CAF workers than the actors that block one while they compute: one learner waited in
  // Gloo's all-reduce for a rank that never got a worker, until Gloo's store timed out (30 s)
  const auto starved = fp8rl::test::run_command(kBin + "/fp8rl train --topology " + topo.string() + " --run-dir " +
                                                (d / "starved").string() + sync + " --scheduler.max-threads=3");
  EXPECT_EQ(starved.rc, 2) << starved.out;
  EXPECT_NE(starved.out.find("--scheduler.max-threads=3: node 'main' runs 2 learner(s) and 1 rollout(s), each blocking a "
                             "worker while it computes; give at least 5"),
            std::string::npos)
      << starved.out;
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "one").string() + sync), 0);
  const auto two = metrics(d / "two"), one = metrics(d / "one");
  ASSERT_EQ(two.size(), 2u);
  ASSERT_EQ(one.size(), 2u);
  for (const char* k : {"token_mult_prob_error", "gen_kl_error", "policy_kl_error", "sampling_importance_ratio", "loss",
                        "approx_entropy", "clip_fraction", "reward_mean", "accuracy", "staleness_hist/0",
                        "by_version/0/tokens", "by_staleness/0/token_mult_prob_error", "seq_mult_prob_error_max"}) {
    ASSERT_TRUE(one[0].contains(k)) << k;
    EXPECT_EQ(two[0][k].get<double>(), one[0][k].get<double>()) << k;
  }
  // the norm of the all-reduced gradient is the whole batch's at every step: the two shards' FP32
  // gradients summed in another order than one learner's (measured 6e-9 and 3e-8 relative). Step 2
  // is the telling one: step 1's only rewarded sample falls in rank 0's shard, and without the
  // all-reduce step 2 reported 0.186 against 0.453. Step 2 ran the same rollouts in both (its loss
  // is equal: the FP8 weights of version 1 did not tell the two runs' tiny differences apart).
  for (const char* k : {"tokens", "reward_mean", "loss"})  // the precondition, not the all-reduce
    EXPECT_EQ(two[1][k].get<double>(), one[1][k].get<double>()) << k << ": step 2 ran other rollouts in the two runs (a "
                                                                << "rounding of version 1's weights told them apart?)";
  for (size_t i = 0; i < 2; ++i) {
    const double g1 = one[i]["grad_norm"].get<double>(), g2 = two[i]["grad_norm"].get<double>();
    EXPECT_GT(g1, 0.0) << "step " << i + 1;
    EXPECT_LE(std::abs(g2 - g1), fp8rl::tol::kFp32SumOrder * g1) << "step " << i + 1 << ": " << g2 << " vs " << g1;
  }
  // a resume placed otherwise than the run's last part is said (without --topology the embedded
  // one-learner default runs); one placed as the last part is not
  const auto moved = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + (d / "two").string() + sync + " --run.steps=3");
  EXPECT_EQ(moved.rc, 0) << moved.out;
  EXPECT_NE(moved.out.find("resuming on another placement than the run's last part (" + (d / "two" / "topology.json").string() +
                           "): was main: learners cpu:1 cpu:1, rollouts cpu:1; now local: learners cpu:1, rollouts cpu:1, from "
                           "(embedded local) (--topology FILE runs it as before)"),
            std::string::npos)
      << moved.out;
  const auto same = fp8rl::test::run_command(kBin + "/fp8rl train --resume --run-dir " + (d / "two").string() + sync + " --run.steps=4");
  EXPECT_EQ(same.rc, 0) << same.out;
  EXPECT_EQ(same.out.find("another placement"), std::string::npos) << same.out;
  // BF16 on both sides, staleness 0: the staleness part of the split is 0 exactly at every step
  // (the audit used the weights after the update, 1.29 at step 1; with max_staleness 0 it
  // reported nothing)
  ASSERT_EQ(run(kBin + "/fp8rl train --run-dir " + (d / "bf16").string() + kSmall +
                " --audit.every=1 --audit.samples=4 --async.max_staleness=0 --precision.training=bf16"
                " --precision.generation=bf16"),
            0);
  const auto b = metrics(d / "bf16");
  ASSERT_EQ(b.size(), 4u);
  for (const auto& x : b) {
    ASSERT_TRUE(x.contains("audit/staleness_kl")) << x.dump();
    EXPECT_EQ(x["audit/staleness_kl"].get<double>(), 0.0) << x.dump();
    EXPECT_GT(x["audit/tokens"].get<double>(), 0.0);
    EXPECT_FALSE(x.contains("audit/kernel_kv_kl")) << "no FP8 weights to split off";
  }
  fs::remove_all(d);
}
