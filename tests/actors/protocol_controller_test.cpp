// tests/actors/protocol_controller_test.cpp -- the controller on CAF's deterministic test coordinator:
// the test is the peer of the actor under test and drives it one message at a time (the
// staleness window, reissued and lost work, restarts, stops, health gates, metrics lines).
#include "tests/actors/protocol_util.hpp"

using namespace fp8rl;
using namespace fp8rl::proto_test;

namespace {
struct issued_work {
  std::string to;
  msg::work_msg w;
};
// A stand-in peer: records the work it receives (rollouts), answers a stop with step 2 (the
// buffer), drops everything else.
caf::actor stand_in(caf::actor_system& sys, std::string name, std::vector<issued_work>* log) {
  return sys.spawn([](caf::event_based_actor* self, std::string name, std::vector<issued_work>* log) -> caf::behavior {
    // swallow the rest without a reply (caf::drop answers with an error, which kills the sender)
    self->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
    return {[=](msg::work_msg& w) { log->push_back({name, w}); }, [](msg::stop_atom) { return uint64_t{2}; }};
  }, std::move(name), log);  // spawn arguments, not captures: actors.hpp
}
// A step report with the step's staleness-0 mismatch (what the health gates read).
msg::step_report mismatch_report(uint64_t step, double tmpe, double kl) {
  return msg::step_report{{}, step, {{"tokens", 10.0}, {"by_staleness/0/token_mult_prob_error", tmpe},
                                     {"by_staleness/0/gen_kl_error", kl}}};
}
}  // namespace

// The controller on the test coordinator, wired to stand-in peers (rollout0, rollout1 record
// their work). TearDown stops every actor: under the test coordinator actors run only inside
// sched.run(), and the system's destructor waits for them (an ASSERT returning early would hang).
class ControllerOnTestCoordinator : public ::testing::Test, protected coordinated_system {
 protected:
  fs::path run_dir = fs::temp_directory_path() / ("fp8rl_ctrl_" + std::to_string(::getpid()));
  std::vector<issued_work> work;
  msg::peers_msg p;
  msg::controller_actor ctrl;
  caf::actor r0, r1;
  std::vector<caf::actor> extra;  // other actors a test spawns (stopped at teardown too)
  int done = -1;
  std::function<void(actors::controller_options&)> options;  // a test's changes, before the spawn
  caf::actor buffer;                                      // a test's own buffer, else a stand-in
  std::function<void()> before_peers;                     // runs between the spawn and the wiring
  std::string log_level = "off";                          // a test reading the controller's log raises it
  std::function<void(actors::run_config&)> recipe;        // a test's recipe changes

  // A controller for B = 3 prompts per step, group size 2, max_staleness 1, from `start`.
  void wire(actors::run_start start, bool progress = false) {
    fs::create_directories(run_dir);
    actors::run_config r;
    r.max_staleness = 1;
    r.prompts_per_step = 3;
    r.group_size = 2;
    r.steps = 10;
    r.audit_every = 0;  // the test's reports carry staleness-0 mismatch, no audit: the gates read it (health.source auto)
    r.log_level = log_level;
    if (recipe) recipe(r);
    actors::controller_options opts;
    opts.print_progress = progress;
    opts.on_done = [this](int code) { done = code; };
    if (options) options(opts);
    ctrl = actors::spawn_controller(sys, actors::env_make(r, "test", run_dir.string(), init_dir(), start), opts);
    p.controller = ctrl;
    p.buffer = caf::actor_cast<msg::buffer_actor>(buffer ? buffer : stand_in(sys, "buffer", &work));
    p.reward = caf::actor_cast<msg::reward_actor>(stand_in(sys, "reward", &work));
    p.weight_sync = caf::actor_cast<msg::weight_sync_actor>(stand_in(sys, "weight_sync", &work));
    p.calibration = caf::actor_cast<msg::calibration_actor>(stand_in(sys, "calibration", &work));
    p.learners = {caf::actor_cast<msg::learner_actor>(stand_in(sys, "learner0", &work))};
    r0 = stand_in(sys, "rollout0", &work);
    r1 = stand_in(sys, "rollout1", &work);
    p.rollouts = {caf::actor_cast<msg::rollout_actor>(r0), caf::actor_cast<msg::rollout_actor>(r1)};
    p.rollout_names = {"rollout0", "rollout1"};
    sched.run();
    if (before_peers) before_peers();
    self->send(ctrl, p, std::vector<caf::actor>{}, std::vector<std::string>{});
    sched.run();
  }
  // The step report of version v (step v - 1 trained), then its metrics line's rollout_idle_s.
  double idle_line(uint64_t v) {
    self->send(ctrl, msg::step_report{{}, v, {{"tokens", 10.0}}});
    sched.run();
    std::ifstream in(run_dir / "metrics.jsonl");
    nlohmann::json last;
    for (std::string l; std::getline(in, l);) last = nlohmann::json::parse(l);
    return last.value("rollout_idle_s", -1.0);
  }
  void admit(uint64_t step, std::initializer_list<uint64_t> prompts) {  // the buffer holds these groups
    for (uint64_t pid : prompts) self->send(ctrl, msg::admitted_msg{{}, step, pid, false, ""});
    sched.run();
  }
  void sync(uint64_t v) {  // every rollout has adopted version v
    self->send(ctrl, msg::sync_report{{}, v, 0.0, 0.0, false, 0.0});
    sched.run();
  }
  // What the controller logs while it takes the reports of `steps`, each with mismatch `tmpe`, KL 0.
  std::string log_of_reports(std::initializer_list<uint64_t> steps, double tmpe) {
    ::testing::internal::CaptureStderr();
    for (uint64_t v : steps) {
      self->send(ctrl, mismatch_report(v, tmpe, 0.0));
      sched.run();
    }
    return ::testing::internal::GetCapturedStderr();
  }
  // The steps of the work issued since entry `from`, which is sorted into prompt order.
  std::vector<uint64_t> steps_of(size_t from) {
    std::sort(work.begin() + static_cast<long>(from), work.end(),
              [](const issued_work& a, const issued_work& b) { return a.w.prompt_id < b.w.prompt_id; });
    std::vector<uint64_t> s;
    for (size_t i = from; i < work.size(); ++i) s.push_back(work[i].w.step);
    return s;
  }
  void TearDown() override {
    for (const caf::actor& a : {caf::actor_cast<caf::actor>(ctrl), caf::actor_cast<caf::actor>(p.buffer),
                                caf::actor_cast<caf::actor>(p.reward), caf::actor_cast<caf::actor>(p.weight_sync),
                                caf::actor_cast<caf::actor>(p.calibration), r0, r1})
      if (a) self->send_exit(a, caf::exit_reason::user_shutdown);
    for (const auto& a : extra) self->send_exit(a, caf::exit_reason::user_shutdown);
    for (const auto& l : p.learners) self->send_exit(l, caf::exit_reason::user_shutdown);
    sched.run();
    fs::remove_all(run_dir);
  }
};

// The controller's window: work for step s is issued only once every rollout has adopted version
// >= s - max_staleness (sync_report), round robin over the rollouts, prompt ids from the prompt
// cursor; a group the buffer drops as stale is re-issued; a lost rollout's groups in flight go to
// the live one; a trained step is no longer re-issued.
TEST_F(ControllerOnTestCoordinator, IssuesWithinTheStalenessWindow) {
  wire(0);
  EXPECT_TRUE(work.empty()) << "work issued before any rollout holds weights";
  sync(0);  // version 0 everywhere: steps 0 and 1
  ASSERT_EQ(steps_of(0), (std::vector<uint64_t>{0, 0, 0, 1, 1, 1}));
  for (size_t i = 0; i < work.size(); ++i) {
    EXPECT_EQ(work[i].to, i % 2 ? "rollout1" : "rollout0");  // round robin
    EXPECT_EQ(work[i].w.prompt_id, i);                      // the prompt cursor: step * 3 + i
    EXPECT_EQ(work[i].w.group_size, 2);
  }
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});  // step 0 trained; v1 not yet synced
  sched.run();
  EXPECT_EQ(work.size(), 6u) << "step 2 issued before version 1 reached the rollouts";
  sync(1);
  ASSERT_EQ(steps_of(6), (std::vector<uint64_t>{2, 2, 2}));
  EXPECT_EQ(work[6].w.prompt_id, 6u);
  // the buffer drops a step-2 group as stale: it is issued again, once
  self->send(ctrl, msg::admitted_msg{{}, 2, 7, true, "stale (test)"});
  sched.run();
  ASSERT_EQ(steps_of(9), (std::vector<uint64_t>{2}));
  EXPECT_EQ(work[9].w.prompt_id, 7u);
  // a step-0 group dropped as stale after step 0 was trained is not re-issued (nothing to redo)
  self->send(ctrl, msg::admitted_msg{{}, 0, 0, true, "stale (test)"});
  sched.run();
  EXPECT_EQ(work.size(), 10u);
  // rollout0 goes down: its groups in flight (not yet admitted) go to rollout1
  for (uint64_t pid : {0, 1, 2, 3, 5}) self->send(ctrl, msg::admitted_msg{{}, pid / 3, pid, false, ""});  // admitted ones
  sched.run();
  std::set<uint64_t> r0_open;  // rollout0 had the even prompt ids (round robin): 4, 6, 8 are open
  for (const auto& iw : work)
    if (iw.to == "rollout0" && iw.w.prompt_id > 3) r0_open.insert(iw.w.prompt_id);
  EXPECT_EQ(r0_open, (std::set<uint64_t>{4, 6, 8}));
  self->send_exit(r0, caf::exit_reason::kill);
  sched.run();
  std::set<uint64_t> moved;
  for (size_t i = 10; i < work.size(); ++i) {
    EXPECT_EQ(work[i].to, "rollout1");
    moved.insert(work[i].w.prompt_id);
  }
  EXPECT_EQ(moved, r0_open);
  EXPECT_EQ(done, -1);  // the run goes on with one rollout
}

// A group of a step not yet trained that the buffer drops as stale is issued again (the step
// report before it trained only the steps before it).
TEST_F(ControllerOnTestCoordinator, AStaleGroupOfTheNextStepIsReissued) {
  wire(0);
  sync(0);
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});  // step 0 trained, step 1 not
  self->send(ctrl, msg::admitted_msg{{}, 1, 5, true, "stale (test)"});
  sched.run();
  ASSERT_EQ(work.size(), 7u);
  EXPECT_EQ(work[6].w.prompt_id, 5u);
  EXPECT_EQ(work[6].w.step, 1u);
}

// What a lost rollout leaves to redo is only its groups the buffer holds nothing of: not a
// trained step's (their stale drops and unanswered groups once the step is trained), not a group
// the buffer dropped as a duplicate (it holds one). Trained steps' groups were re-issued, and
// counted in in_flight_groups, for the rest of the run.
TEST_F(ControllerOnTestCoordinator, ALostRolloutRedoesOnlyGroupsTheBufferLacks) {
  wire(0);
  sync(0);  // steps 0 and 1: rollout0 has prompts 0, 2 (step 0) and 4 (step 1)
  ASSERT_EQ(work.size(), 6u);
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});  // step 0 trained
  self->send(ctrl, msg::admitted_msg{{}, 1, 4, true, "duplicate"});
  sched.run();
  EXPECT_EQ(work.size(), 6u) << "a duplicate was re-issued";
  self->send(ctrl, msg::admitted_msg{{}, 0, 0, true, "stale (test)"});
  sched.run();
  EXPECT_EQ(work.size(), 6u) << "a trained step's stale group was re-issued";
  sync(1);  // step 2: prompts 6 and 8 to rollout0, 7 to rollout1
  ASSERT_EQ(steps_of(6), (std::vector<uint64_t>{2, 2, 2}));
  self->send_exit(r0, caf::exit_reason::kill);
  sched.run();
  std::set<std::pair<uint64_t, uint64_t>> redone;
  for (size_t i = 9; i < work.size(); ++i) redone.insert({work[i].w.step, work[i].w.prompt_id});
  EXPECT_EQ(redone, (std::set<std::pair<uint64_t, uint64_t>>{{2, 6}, {2, 8}}));
  // step 1 trained: left in flight are step 2's three groups (rollout1's 3 and 5 were never admitted)
  self->send(ctrl, msg::step_report{{}, 2, {{"tokens", 10.0}}});
  sched.run();
  std::ifstream m(run_dir / "metrics.jsonl");
  std::string line, last;
  while (std::getline(m, line)) last = line;
  EXPECT_EQ(nlohmann::json::parse(last).at("in_flight_groups"), 3.0) << last;
  EXPECT_EQ(done, -1);
}

// A metrics line that cannot be written (a full disk: /dev/full) fails the run, not a silent gap.
TEST_F(ControllerOnTestCoordinator, AMetricsLineThatCannotBeWrittenFailsTheRun) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  fs::create_directories(run_dir);
  fs::create_symlink("/dev/full", run_dir / "metrics.jsonl");
  log_level = "error";
  wire(0);
  sync(0);
  EXPECT_EQ(done, -1);
  ::testing::internal::CaptureStderr();
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});
  sched.run();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(done, 1);
  EXPECT_NE(log.find("metrics.jsonl: writing step 1 failed"), std::string::npos) << log;
}

// Every rollout lost outside a stop fails the run (it would wait forever for samples), but through
// the stop path: the buffer names the step (2), learner0 checkpoints it, then exit 1 with the
// failure and the checkpoint to resume from named. It ended the run at once before, and a run of
// 29 steps kept only checkpoints/init (checkpoint_every 50).
TEST_F(ControllerOnTestCoordinator, EveryRolloutLostFailsTheRunAfterTheLearnersCheckpoint) {
  log_level = "warn";
  wire(0);
  sync(0);
  self->send_exit(r0, caf::exit_reason::kill);
  sched.run();
  EXPECT_EQ(done, -1);
  ::testing::internal::CaptureStderr();
  self->send_exit(r1, caf::exit_reason::kill);
  sched.run();
  EXPECT_EQ(done, -1) << "the run ended before the learners stopped";
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});
  sync(1);
  self->send(ctrl, msg::stopped_atom::value, uint64_t{2}, (run_dir / "checkpoints" / "step_2").string());
  sched.run();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(done, 1);
  EXPECT_NE(log.find("every rollout actor is gone"), std::string::npos) << log;
  EXPECT_NE(log.find("step_2 is the latest checkpoint; to continue"), std::string::npos) << log;
}

// The same for the reward, calibration and weight-sync actors, lost or naming their own failure;
// a learner's or the buffer's loss, or a learner's failure, ends the run at once (the stop path
// needs them); a failure during a stop makes its exit code 1.
TEST_F(ControllerOnTestCoordinator, AFailureTheLearnersOutliveStopsThemCheckpointedFirst) {
  const auto stopped = [&] {
    self->send(ctrl, msg::stopped_atom::value, uint64_t{2}, (run_dir / "checkpoints" / "step_2").string());
    sched.run();
  };
  log_level = "error";
  for (const std::string lose : {"reward", "weight_sync", "calibration", "learner0", "buffer"}) {
    SCOPED_TRACE(lose);
    done = -1;
    wire(0);
    sync(0);
    const caf::actor who = lose == "reward" ? caf::actor_cast<caf::actor>(p.reward)
                           : lose == "weight_sync" ? caf::actor_cast<caf::actor>(p.weight_sync)
                           : lose == "calibration" ? caf::actor_cast<caf::actor>(p.calibration)
                           : lose == "learner0" ? caf::actor_cast<caf::actor>(p.learners[0])
                                                : caf::actor_cast<caf::actor>(p.buffer);
    ::testing::internal::CaptureStderr();
    self->send_exit(who, caf::exit_reason::kill);
    sched.run();
    const std::string log = ::testing::internal::GetCapturedStderr();
    if (lose == "buffer") {  // named as lost, not as a stop request it could not answer
      EXPECT_NE(log.find("run failed: the trajectory buffer went down"), std::string::npos) << log;
    }
    const bool at_once = lose == "learner0" || lose == "buffer";
    EXPECT_EQ(done, at_once ? 1 : -1);
    if (!at_once) stopped();
    EXPECT_EQ(done, 1);
    TearDown();
  }
  for (const std::string who : {"weight_sync", "learner0", "the trajectory buffer"}) {  // (who, what) errors
    SCOPED_TRACE(who);
    done = -1;
    wire(0);
    sync(0);
    self->send(ctrl, who, std::string("transfer failed"));
    sched.run();
    EXPECT_EQ(done, who == "weight_sync" ? -1 : 1);
    stopped();
    EXPECT_EQ(done, 1);
    TearDown();
  }
  {  // learners that never stop: the run fails at the deadline all the same; a second failure
     // (a lost node: several actors) is one more warning, not a second error and deadline
    done = -1;
    log_level = "warn";
    wire(0);
    sync(0);
    ::testing::internal::CaptureStderr();
    self->send(ctrl, std::string("calibration"), std::string("NaN in a scale"));
    sched.run();
    self->send(ctrl, std::string("reward"), std::string("verifier crashed"));
    sched.run();
    EXPECT_EQ(done, -1);
    sched.trigger_timeouts();
    sched.run();
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(done, 1);
    EXPECT_NE(log.find("the learners did not stop within 600 s of: calibration: NaN in a scale"), std::string::npos) << log;
    const size_t first = log.find("the run fails once the learners have stopped");
    EXPECT_NE(first, std::string::npos) << log;
    EXPECT_EQ(log.find("the run fails once the learners have stopped", first + 1), std::string::npos) << log;
    EXPECT_NE(log.find("also: reward: verifier crashed"), std::string::npos) << log;
    EXPECT_EQ(log.find("did not stop within 600 s of: reward"), std::string::npos) << log;
    TearDown();
    log_level = "error";
  }
  {  // a failure during the last step: the step ends the run, and it fails (it exited 0) -- as a
     // stop with the failure named (its summary line and plots), not a bare "run failed"
    recipe = [](actors::run_config& r) { r.steps = 2; };
    log_level = "warn";
    done = -1;
    wire(0);
    sync(0);
    ::testing::internal::CaptureStderr();
    self->send(ctrl, std::string("weight_sync"), std::string("transfer failed"));
    sched.run();
    for (uint64_t v : {1, 2}) self->send(ctrl, msg::step_report{{}, v, {{"tokens", 10.0}}});
    sched.run();
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(done, 1);
    EXPECT_NE(log.find("run stopped: 2 steps"), std::string::npos) << log;
    EXPECT_NE(log.find("; weight_sync: transfer failed"), std::string::npos) << log;
    EXPECT_EQ(log.find("run failed:"), std::string::npos) << log;
    TearDown();
    recipe = nullptr;
    log_level = "error";
  }
  done = -1;
  wire(0);  // a signal's stop, then a failure: the stop goes on, its exit code 1
  sync(0);
  self->send(ctrl, msg::stop_atom::value, std::string("SIGINT"), int32_t{130});
  sched.run();
  self->send(ctrl, std::string("calibration"), std::string("NaN in a scale"));
  sched.run();
  EXPECT_EQ(done, -1);
  stopped();
  EXPECT_EQ(done, 1);
}

// A lost rollout is restarted at most max_restarts times per name (its groups re-issued round
// robin, the replacement among the rollouts); after that it is dropped and its work goes to the
// others.
TEST_F(ControllerOnTestCoordinator, ARolloutIsRestartedAtMostMaxRestartsTimes) {
  auto respawned_count = std::make_shared<int>(0);  // the controller holds the function until teardown
  const int& respawned = *respawned_count;
  options = [this, respawned_count](actors::controller_options& o) {
    o.max_restarts = 1;
    o.respawn_rollout = [this, respawned_count](caf::actor_system& s, const std::string& name) {
      ++*respawned_count;
      extra.push_back(stand_in(s, name + "'", &work));
      return caf::actor_cast<msg::rollout_actor>(extra.back());
    };
  };
  wire(0);
  sync(0);
  self->send_exit(r0, caf::exit_reason::kill);
  sched.run();
  ASSERT_EQ(respawned, 1);
  ASSERT_EQ(extra.size(), 1u);
  std::set<std::string> to;
  for (size_t i = 6; i < work.size(); ++i) to.insert(work[i].to);
  EXPECT_EQ(to.count("rollout0'"), 1u) << "the replacement takes rollout0's place in the rotation";
  const size_t before = work.size();
  self->send_exit(extra[0], caf::exit_reason::kill);
  sched.run();
  EXPECT_EQ(respawned, 1) << "restarted past max_restarts";
  for (size_t i = before; i < work.size(); ++i) EXPECT_EQ(work[i].to, "rollout1");
  EXPECT_GT(work.size(), before) << "the replacement's groups were not moved to rollout1";
  EXPECT_EQ(done, -1);
}

// A buffer that does not answer the stop request fails the run, named, at the request's timeout.
TEST_F(ControllerOnTestCoordinator, AStopTheBufferDoesNotAnswerFailsTheRun) {
  auto pending = std::make_shared<std::vector<caf::response_promise>>();
  buffer = sys.spawn([](caf::event_based_actor* b, std::shared_ptr<std::vector<caf::response_promise>> keep) -> caf::behavior {
    b->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
    return {[=](msg::stop_atom) { keep->push_back(b->make_response_promise()); }};
  }, pending);
  extra.push_back(buffer);
  wire(0);
  sync(0);
  self->send(ctrl, msg::stop_atom::value, std::string("SIGINT"), int32_t{130});
  sched.run();
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ(done, -1);
  sched.trigger_timeouts();
  sched.run();
  EXPECT_EQ(done, 1);
}

// A stop that comes before the wiring (a signal during the start) is asked of the buffer at the
// wiring: no work past its step, and the run ends with the stop's code.
TEST_F(ControllerOnTestCoordinator, AStopBeforeTheWiringIsAskedAtTheWiring) {
  before_peers = [&] {
    self->send(ctrl, msg::stop_atom::value, std::string("SIGTERM"), int32_t{143});
    sched.run();
  };
  wire(0);
  sync(3);  // the window would allow steps 0..4; the buffer's stop step is 2
  EXPECT_EQ(steps_of(0), (std::vector<uint64_t>{0, 0, 0, 1, 1, 1}));
  self->send(ctrl, msg::step_report{{}, 2, {{"tokens", 10.0}}});
  self->send(ctrl, msg::stopped_atom::value, uint64_t{2}, (run_dir / "checkpoints" / "step_2").string());
  sched.run();
  EXPECT_EQ(done, 143);
}

// A resumed run (checkpoint at version 2 whose prompt_cursor is 17) issues step 2's groups from
// prompt 17 on -- the prompts the checkpoint says come next, not step * prompts_per_step.
TEST_F(ControllerOnTestCoordinator, ResumedRunIssuesFromTheCheckpointsPromptCursor) {
  wire(actors::run_start{2, 17});
  sync(2);  // steps 2 and 3
  ASSERT_EQ(steps_of(0), (std::vector<uint64_t>{2, 2, 2, 3, 3, 3}));
  const auto train = models::task_load(models::task_spec_parse("builtin:add2"), false, actors::run_config{}.train_size, 1);
  const auto want = models::take_prompts(train, 17, 6);
  for (size_t i = 0; i < work.size(); ++i) {
    EXPECT_EQ(work[i].w.prompt_id, 17 + i);
    EXPECT_EQ(work[i].w.prompt, want[i].prompt) << i;
    EXPECT_EQ(work[i].w.answer, want[i].answer) << i;
  }
}

// An exception in the controller fails the run, named, and stops every actor: it used to take the
// controller down silently, on_done was never called and `fp8rl train` waited forever (a plots
// directory that was a file did it at the end of a run). Here a step report whose staleness
// histogram key is not a version count.
TEST_F(ControllerOnTestCoordinator, AnExceptionFailsTheRunByName) {
  wire(0, true);
  sync(0);
  self->monitor(ctrl);
  self->send(ctrl, msg::step_report{{}, 1, {{"staleness_hist/x", 1.0}}});
  sched.run();
  EXPECT_EQ(done, 1);
  self->receive([&](caf::down_msg& d) {
    const std::string why = sys.render(d.reason);
    EXPECT_NE(why.find("controller: step_report metric 'staleness_hist/x': not a staleness bucket"), std::string::npos) << why;
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "the controller did not stop"; });
}

// The progress line (print_progress) shows the step's numbers: the staleness is the mean version
// lag of its tokens from the histogram (3 tokens at lag 0, 1 at lag 1: 0.25), the validation
// accuracy where the step has one.
TEST_F(ControllerOnTestCoordinator, ProgressLineShowsTheStepsNumbers) {
  wire(0, true);
  sync(0);
  ::testing::internal::CaptureStderr();
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 4.0}, {"reward_mean", 0.5}, {"accuracy", 0.25}, {"val_accuracy", 0.75},
                                            {"staleness_hist/0", 3.0}, {"staleness_hist/1", 1.0}, {"token_mult_prob_error", 1.0625}}});
  sched.run();
  const std::string line = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(line.find("step    1/10  reward 0.500  acc 0.250  val_acc 0.750  staleness 0.25  tmpe 1.0625"), std::string::npos) << line;
}

// Calibration and sync reports go into the next metrics lines, one report per line, oldest first:
// two calibrations within one step (a busy machine) overwrote each other, and a version's
// calibration record was lost (a later line had none).
TEST_F(ControllerOnTestCoordinator, EachCalibrationAndSyncReportHasItsOwnMetricsLine) {
  wire(0);
  sync(0);
  for (uint64_t v : {1, 2}) {
    self->send(ctrl, msg::calib_report{{}, v, 0.5 * double(v), 0, 0.0});
    self->send(ctrl, msg::sync_report{{}, v, 0.25 * double(v), 100.0, false, 0.0});
  }
  sched.run();
  for (uint64_t v : {1, 2, 3}) self->send(ctrl, msg::step_report{{}, v, {{"tokens", 10.0}}});
  sched.run();
  std::ifstream in(run_dir / "metrics.jsonl");
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 3u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(rows[i].value("calibration_version", -1.0), double(i + 1)) << rows[i].dump();
    EXPECT_EQ(rows[i].value("calibration_s", -1.0), 0.5 * double(i + 1)) << rows[i].dump();
  }
  EXPECT_FALSE(rows[2].contains("calibration_version")) << rows[2].dump();
  for (size_t i = 0; i < 3; ++i) {  // v0's (the wiring's sync) first, then v1's and v2's
    EXPECT_EQ(rows[i].value("sync_version", -1.0), double(i)) << rows[i].dump();
    EXPECT_EQ(rows[i].value("sync_latency_s", -1.0), 0.25 * double(i)) << rows[i].dump();
  }
}

// Generation's wait, rollout_idle_s: the mean seconds a rollout had no group in flight since the
// previous line -- 0 when both held work throughout; at least the time both sat without work
// (their groups trained, the staleness window closed until the next sync) otherwise.
TEST_F(ControllerOnTestCoordinator, RolloutIdleTimeIsTheTimeWithoutWorkInFlight) {
  wire(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // idle from the wiring to the first sync
  sync(0);  // steps 0 and 1 issued round robin: both rollouts hold groups of each
  EXPECT_GE(idle_line(1), 0.03);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(idle_line(2), 0.0);  // step 1's groups in flight on both until this line trained them
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_GE(idle_line(3), 0.05);  // nothing issued since: version 1 was never synced
}

// The bounds below are the test's own clock readings around the messages (the controller reads
// its clock inside them), so they hold on a slow machine. Admission ends work in flight: both
// rollouts idle from their last group's admission to the line (at least the time between); the
// next line counts only the time since this one.
namespace {
double secs_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace
TEST_F(ControllerOnTestCoordinator, RolloutIdleTimeStartsAtAdmissionAndIsCountedOnce) {
  using sclk = std::chrono::steady_clock;
  wire(0);
  sync(0);
  idle_line(1);  // step 0 trained: rollout0 holds prompt 4, rollout1 prompts 3 and 5 (step 1)
  admit(1, {3, 4, 5});
  const auto t_admitted = sclk::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  const auto t_line = sclk::now();
  EXPECT_GE(idle_line(2), secs_between(t_admitted, t_line));
  const double again = idle_line(3);
  EXPECT_LE(again, secs_between(t_line, sclk::now())) << "idle time before the previous line counted again";
}

// A stale group re-issued to another rollout is no longer the first one's: rollout1 (prompts 3
// and 5) loses 5 to rollout0, is idle once 3 is admitted; both idle until the line.
TEST_F(ControllerOnTestCoordinator, AReissuedGroupLeavesItsFirstRolloutIdle) {
  using sclk = std::chrono::steady_clock;
  wire(0);
  sync(0);
  idle_line(1);
  self->send(ctrl, msg::admitted_msg{{}, 1, 5, true, "stale (test)"});
  sched.run();
  ASSERT_EQ(work.size(), 7u);
  ASSERT_EQ(work.back().to, "rollout0");  // round robin's next
  ASSERT_EQ(work.back().w.prompt_id, 5u);
  admit(1, {3, 4, 5});
  const auto t_admitted = sclk::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  const auto t_line = sclk::now();
  EXPECT_GE(idle_line(2), secs_between(t_admitted, t_line));
}

// A lost rollout: its idle time until the loss counts, it counts in the line's mean once, and it
// is never idle after (its groups moved to the live one).
TEST_F(ControllerOnTestCoordinator, ALostRolloutsIdleTimeEndsWithIt) {
  using sclk = std::chrono::steady_clock;
  wire(0);
  sync(0);
  idle_line(1);  // rollout0 holds prompt 4, rollout1 3 and 5
  const auto t_admit0 = sclk::now();
  admit(1, {4});  // rollout0 idle from here
  const auto t_admit1 = sclk::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto t_kill0 = sclk::now();
  self->send_exit(r0, caf::exit_reason::kill);
  sched.run();
  const auto t_kill1 = sclk::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto t_line0 = sclk::now();
  const double idle = idle_line(2);  // trains step 1: rollout1 idle from here, ~0 in this line
  const auto t_line1 = sclk::now();
  // rollout0's idle time (admission to loss) over 2 rollouts: the live one and the lost one
  EXPECT_GE(idle, secs_between(t_admit1, t_kill0) / 2);
  EXPECT_LE(idle, (secs_between(t_admit0, t_kill1) + secs_between(t_line0, t_line1)) / 2);
}
TEST_F(ControllerOnTestCoordinator, ALostRolloutWithWorkIsNeverIdle) {
  using sclk = std::chrono::steady_clock;
  wire(0);
  sync(0);
  idle_line(1);
  self->send_exit(r0, caf::exit_reason::kill);  // prompt 4 goes to rollout1
  sched.run();
  ASSERT_EQ(work.back().to, "rollout1");
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto t_line0 = sclk::now();
  const double idle = idle_line(2);  // rollout1 busy until this line trained step 1
  EXPECT_LE(idle, secs_between(t_line0, sclk::now()) / 2) << "the lost rollout counted idle after its loss";
}

// rl-algorithm.md section 7's gates on the steps' staleness-0 mismatch (health.min_steps = 2):
// under health.gates = fail a median token_mult_prob_error at 1.1 stops the run where the buffer
// says (step 2), checkpointed, with code 1 and the gate named; under warn the run goes on, the gate
// logged once; a resumed run counts the steps its metrics.jsonl holds.
TEST_F(ControllerOnTestCoordinator, AFailedHealthGateStopsTheRunNamed) {
  recipe = [](actors::run_config& r) { r.health_min_steps = 2; };
  log_level = "warn";
  wire(0);
  sync(0);
  EXPECT_EQ(log_of_reports({1}, 1.2), "");  // one step counted: not judged yet
  ::testing::internal::CaptureStderr();
  self->send(ctrl, mismatch_report(2, 1.0, 0.0));  // median (1.2 + 1.0) / 2 = 1.1: not below 1.1
  sched.run();
  sync(2);
  EXPECT_EQ(work.size(), 6u) << "work issued past the stop step";
  self->send(ctrl, msg::stopped_atom::value, uint64_t{2}, (run_dir / "checkpoints" / "step_2").string());
  sched.run();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(done, 1);
  EXPECT_NE(log.find("health gate (rl-algorithm.md section 7): median token_mult_prob_error (staleness 0) 1.1000 is not below "
                     "1.1 over 2 step(s) 1..2"), std::string::npos) << log;
  EXPECT_NE(log.find("run stopped: 2 steps"), std::string::npos) << log;
  EXPECT_NE(log.find("; health gate: median token_mult_prob_error"), std::string::npos) << log;
  EXPECT_NE(log.find("--health.gates=warn or off goes on"), std::string::npos) << log;
  EXPECT_NE(log.find("checkpoints/step_2 is the latest checkpoint"), std::string::npos) << log;
  const size_t first = log.find("; the run stops");
  EXPECT_EQ(log.find("; the run stops", first + 1), std::string::npos) << "the gate logged again: " << log;
}

// A gate failing at the last step fails the run (it ended "finished", exit 0); the first gate is
// logged once, not at every later report.
TEST_F(ControllerOnTestCoordinator, AHealthGateFailingAtTheLastStepFailsTheRun) {
  recipe = [](actors::run_config& r) { r.health_min_steps = 2, r.steps = 2; };
  log_level = "info";
  wire(0);
  sync(0);
  const std::string log = log_of_reports({1, 2}, 1.5);
  EXPECT_EQ(done, 1);
  EXPECT_NE(log.find("run stopped: 2 steps"), std::string::npos) << log;
  EXPECT_NE(log.find("; health gate: median token_mult_prob_error (staleness 0) 1.5000"), std::string::npos) << log;
  EXPECT_EQ(log.find("health gates not judged"), std::string::npos) << log;
}

// A resumed run replays its metrics rows: a gate they fail (the first steps' mean gen_kl_error,
// fixed once reached) stops the resumed run at its first step under health.gates = fail (the
// replay went past it, and the run finished); a run too short to judge says so at its end.
TEST_F(ControllerOnTestCoordinator, AResumedRunStopsOnAGateItsEarlierStepsFailed) {
  recipe = [](actors::run_config& r) { r.health_min_steps = 1; };
  log_level = "info";
  fs::create_directories(run_dir);
  std::ofstream(run_dir / "metrics.jsonl")
      << "{\"step\":1,\"by_staleness/0/token_mult_prob_error\":1.0,\"by_staleness/0/gen_kl_error\":0.1}\n";
  wire(actors::run_start{1, 3});
  sync(1);
  ::testing::internal::CaptureStderr();
  self->send(ctrl, mismatch_report(2, 1.0, 0.0));
  sched.run();
  self->send(ctrl, msg::stopped_atom::value, uint64_t{2}, (run_dir / "checkpoints" / "step_2").string());
  sched.run();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(done, 1);
  EXPECT_NE(log.find("mean gen_kl_error (staleness 0) 0.10000 over the first 1 step(s) 1..1"), std::string::npos) << log;
}

// A failure while the controller starts (a metrics row it cannot read back) fails the run, named:
// it was CAF's "unhandled exception" with no handler set yet, and the process waited for good.
TEST_F(ControllerOnTestCoordinator, AControllerThatCannotStartFailsTheRun) {
  log_level = "error";
  fs::create_directories(run_dir);
  std::ofstream(run_dir / "metrics.jsonl") << "{\"step\":-1}\n";
  ::testing::internal::CaptureStderr();
  wire(actors::run_start{1, 3});
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(done, 1);
  EXPECT_NE(log.find("run failed: "), std::string::npos) << log;
  EXPECT_NE(log.find("metrics.jsonl:1: not a metrics row"), std::string::npos) << log;
}

TEST_F(ControllerOnTestCoordinator, ARunTooShortForTheGatesSaysSo) {
  recipe = [](actors::run_config& r) { r.steps = 1; };
  log_level = "info";
  wire(0);
  sync(0);
  ::testing::internal::CaptureStderr();
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});
  sched.run();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(done, 0);
  EXPECT_NE(log.find("health gates not judged: 0 of health.min_steps 20 steps had tokens sampled under the weights being trained"),
            std::string::npos) << log;
}

TEST_F(ControllerOnTestCoordinator, AHealthGateUnderWarnIsLoggedOnceAndTheRunGoesOn) {
  recipe = [](actors::run_config& r) { r.health_min_steps = 2, r.health_gates = "warn"; };
  log_level = "warn";
  fs::create_directories(run_dir);  // a resumed run (from step 1) whose step 1 had a bad mismatch
  std::ofstream(run_dir / "metrics.jsonl")
      << "{\"step\":1,\"by_staleness/0/token_mult_prob_error\":1.5,\"by_staleness/0/gen_kl_error\":0.0}\n";
  wire(actors::run_start{1, 3});
  sync(1);
  const std::string log = log_of_reports({2, 3}, 1.5);
  EXPECT_EQ(done, -1);  // the run goes on
  const std::string gate = "health gate (rl-algorithm.md section 7): median token_mult_prob_error (staleness 0) 1.5000 is not "
                           "below 1.1 over 2 step(s) 1..2";  // step 1 from metrics.jsonl: judged at step 2
  ASSERT_NE(log.find(gate), std::string::npos) << log;
  EXPECT_EQ(log.find("median token_mult_prob_error", log.find(gate) + gate.size()), std::string::npos) << "warned twice: " << log;
  EXPECT_NE(log.find("2 of 2 step(s) 1..2 with tokens sampled under the trained weights have token_mult_prob_error (staleness 0) "
                     "above 1.1"), std::string::npos) << log;
  // the last step: the run's summary says so again (step 1, from metrics.jsonl, counted too)
  const std::string end = log_of_reports({4, 5, 6, 7, 8, 9, 10}, 1.5);
  EXPECT_EQ(done, 0);
  EXPECT_NE(end.find("health gates failed (health.gates=warn, said above): staleness 0: median token_mult_prob_error 1.5000 over 10 "
                     "step(s), 10 above 1.1, mean gen_kl_error of the first 2 0.00000"), std::string::npos) << end;
}

// A judged run that no gate failed says so at its end, with what the gates read.
TEST_F(ControllerOnTestCoordinator, AJudgedRunSaysItsGatesPassed) {
  recipe = [](actors::run_config& r) { r.health_min_steps = 2, r.steps = 3; };
  log_level = "info";
  wire(0);
  sync(0);
  const std::string log = log_of_reports({1, 2, 3}, 1.02);
  EXPECT_EQ(done, 0);
  EXPECT_NE(log.find("health gates passed (staleness 0: median token_mult_prob_error 1.0200 over 3 step(s), 0 above 1.1, mean "
                     "gen_kl_error of the first 2 0.00000)"), std::string::npos) << log;
  EXPECT_EQ(log.find("not judged"), std::string::npos) << log;
}

// A stop (a signal): the controller asks the buffer where the run stops (step 2 here), issues no
// work from there on although the staleness window would allow it, loses every rollout without
// failing, and ends the run with the stop's exit code when learner0 says it stopped there; a second
// stop request changes nothing.
TEST_F(ControllerOnTestCoordinator, AStopEndsTheRunAtTheBuffersStep) {
  wire(0);
  sync(0);  // steps 0 and 1 issued
  ASSERT_EQ(work.size(), 6u);
  self->send(ctrl, msg::stop_atom::value, std::string("SIGINT"), int32_t{130});
  self->send(ctrl, msg::stop_atom::value, std::string("node 'n1' got SIGTERM"), int32_t{143});
  sched.run();
  self->send(ctrl, msg::step_report{{}, 1, {{"tokens", 10.0}}});
  sync(1);  // step 2 would be issued now without the stop
  EXPECT_EQ(work.size(), 6u) << "work issued past the stop step";
  self->send_exit(r0, caf::exit_reason::kill);  // every rollout lost meanwhile (a preempted machine):
  self->send_exit(r1, caf::exit_reason::kill);  // the stop needs none ("every rollout actor is gone" failed it)
  sched.run();
  EXPECT_EQ(work.size(), 6u) << "work re-issued while the run stops";
  EXPECT_EQ(done, -1);  // the run waits for learner0
  self->send(ctrl, msg::step_report{{}, 2, {{"tokens", 10.0}}});
  self->send(ctrl, msg::stopped_atom::value, uint64_t{2}, (run_dir / "checkpoints" / "step_2").string());
  sched.run();
  EXPECT_EQ(done, 130);  // the first stop's code
  EXPECT_EQ(work.size(), 6u);
}
