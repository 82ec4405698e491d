// tests/actors/protocol_learner_rollout_test.cpp -- the learners' stop (one checkpoint over ranks,
// the scheduled one kept, a failed one named, a run directory gone) with explicit message
// ordering, and the rollout actor: its failures named, chunks of a superseded version, and on CAF's
// test coordinator its adoptions, KV saturation reports and groups.
#include "tests/actors/protocol_util.hpp"

using namespace fp8rl;
using namespace fp8rl::proto_test;

// A run that stops before its learner's first step (the buffer answers `stop` at once) checkpoints
// nothing: at a resume from step 2 the learner names the checkpoint it started from, on a fresh run
// none ("": nothing to resume; a step_0 that does not exist was named).
TEST(Protocol, ALearnerStoppedBeforeItsFirstStepNamesTheCheckpointItStartedFrom) {
  test_config cfg;
  caf::actor_system sys{cfg};
  const fs::path run = fs::temp_directory_path() / ("fp8rl_proto_stop_" + std::to_string(::getpid()));
  for (const uint64_t start : {uint64_t{2}, uint64_t{0}}) {
    fs::remove_all(run);
    fs::create_directories(run);
    actors::run_config r;
    r.prompts_per_step = 2, r.group_size = 2, r.log_level = "off";
    const auto env = actors::env_make(r, "test", run.string(), init_dir(), start);
    caf::scoped_actor ctl{sys}, buf{sys}, cal{sys};
    auto learner = actors::spawn_learner(sys, env, 0, 1, actors::device_spec::parse("cpu:1", "test"));
    msg::peers_msg p;
    p.controller = caf::actor_cast<msg::controller_actor>(ctl);
    p.buffer = caf::actor_cast<msg::buffer_actor>(buf);
    p.calibration = caf::actor_cast<msg::calibration_actor>(cal);
    ctl->send(learner, p);
    ctl->send(learner, msg::start_atom::value, uint64_t{0});
    cal->receive([&](msg::params_msg& pm) { EXPECT_EQ(pm.version, start); },
                 caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no starting weights"; });
    buf->receive([&](msg::batch_atom, uint64_t step, int32_t, int32_t, uint64_t) -> msg::batch_msg {
      EXPECT_EQ(step, start);
      msg::batch_msg b;
      b.step = step;
      b.stop = true;
      return b;
    }, caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no batch request"; });
    ctl->receive([&](msg::stopped_atom, uint64_t v, std::string& dir) {
      EXPECT_EQ(v, start);
      EXPECT_EQ(dir, start > 0 ? init_dir() : std::string()) << start;
    }, caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no stopped"; });
    EXPECT_FALSE(fs::exists(run / "checkpoints")) << "a checkpoint of a version nothing trained, start " << start;
    ctl->send_exit(learner, caf::exit_reason::user_shutdown);
  }
  fs::remove_all(run);
}

namespace {
// A buffer stand-in that relays the learners' batch requests to `real` and tells `watch` (rank) of
// each `stop` answer it relays: a test knows when a rank has been told.
msg::buffer_actor stop_telling_buffer(caf::actor_system& sys, const msg::buffer_actor& real, const caf::actor& watch) {
  auto relay = sys.spawn([](caf::event_based_actor* self, msg::buffer_actor real, caf::actor watch) -> caf::behavior {
    return {[=](msg::batch_atom a, uint64_t step, int32_t rank, int32_t world, uint64_t v) {
      auto rp = self->make_response_promise<msg::batch_msg>();
      self->request(real, caf::infinite, a, step, rank, world, v).then([=](msg::batch_msg& b) mutable {
        if (b.stop) self->send(watch, rank);
        rp.deliver(std::move(b));
      });
      return rp;
    }};
  }, real, watch);
  return caf::actor_cast<msg::buffer_actor>(relay);
}

// Learners rank 0..world-1 of one run (its directory `run`, 2 prompts of 2 per step, no
// evaluation, a checkpoint every `every` steps) with a real trajectory buffer (through
// stop_telling_buffer: `told` hears of each rank answered `stop`); the test is their controller
// (ctl) and calibration (cal). one_step() feeds step 0 and waits for rank 0's report.
struct learner_ranks {
  fs::path run;
  std::shared_ptr<const actors::actor_env> env;
  caf::scoped_actor ctl, cal, told;
  msg::buffer_actor buf, relay;
  std::vector<msg::learner_actor> learners;
  learner_ranks(caf::actor_system& sys, const std::string& name, int32_t world, int64_t every, const std::string& init = init_dir())
      : run(fs::temp_directory_path() / ("fp8rl_proto_" + name + "_" + std::to_string(::getpid()))), ctl(sys), cal(sys), told(sys) {
    fs::remove_all(run);
    fs::create_directories(run);
    actors::run_config r;
    r.prompts_per_step = 2, r.group_size = 2, r.log_level = "off", r.eval_every = 0, r.checkpoint_every = every;
    env = actors::env_make(r, "test", run.string(), init, 0, name);
    buf = actors::spawn_buffer(sys, env);
    msg::peers_msg bp;
    bp.controller = caf::actor_cast<msg::controller_actor>(ctl);
    ctl->send(buf, bp);
    relay = stop_telling_buffer(sys, buf, caf::actor_cast<caf::actor>(told));
    for (int32_t rank = 0; rank < world; ++rank) {
      learners.push_back(actors::spawn_learner(sys, env, rank, world, actors::device_spec::parse("cpu:1", "test")));
      msg::peers_msg p = bp;
      p.buffer = relay;
      p.calibration = caf::actor_cast<msg::calibration_actor>(cal);
      ctl->send(learners.back(), p);
      ctl->send(learners.back(), msg::start_atom::value, uint64_t{0});
    }
  }
  ~learner_ranks() {
    for (auto& l : learners) ctl->send_exit(l, caf::exit_reason::user_shutdown);
    ctl->send_exit(buf, caf::exit_reason::user_shutdown);
    ctl->send_exit(relay, caf::exit_reason::user_shutdown);
    std::error_code ec;
    fs::remove_all(run, ec);
  }
  void one_step() {
    ctl->send(buf, group(0, 0, 0));
    ctl->send(buf, group(0, 1, 0));
    ctl->receive([](msg::step_report& rep) { EXPECT_EQ(rep.version, 1u); },
                 [](std::string& who, std::string& what) { FAIL() << who << ": " << what; },
                 caf::after(std::chrono::seconds(120)) >> [] { FAIL() << "no step report"; });
  }
  uint64_t stop() {  // as a signal does: the buffer's stop step, which every rank is answered
    uint64_t at = 99;
    ctl->request(buf, std::chrono::seconds(5), msg::stop_atom::value)
        .receive([&](uint64_t x) { at = x; }, [&](caf::error& e) { ADD_FAILURE() << caf::to_string(e); });
    return at;
  }
};
}  // namespace

// Two learners stop at one step: rank 0 alone reports `stopped` and saves (rank 1 saving too raced
// rank 0 over checkpoints/), and a stop right after the version's scheduled checkpoint leaves that
// checkpoint as it was -- not replaced by a second save of the same version.
TEST(Protocol, TwoLearnerRanksStopWithOneCheckpointTheScheduledOne) {
  test_config cfg;
  cfg.set("scheduler.max-threads", size_t{4});  // each rank blocks a worker in Gloo's all-reduce
  caf::actor_system sys{cfg};
  learner_ranks t(sys, "ranks", 2, 1);
  t.one_step();
  const fs::path ck = t.run / "checkpoints" / "step_1";
  ASSERT_TRUE(fs::exists(ck / "state.json"));  // scheduled (checkpoint_every 1), saved before the report
  struct ::stat before {}, after {};
  ASSERT_EQ(::stat(ck.c_str(), &before), 0);
  const auto state_time = fs::last_write_time(ck / "state.json");
  EXPECT_EQ(t.stop(), 1u);
  t.ctl->receive([&](msg::stopped_atom, uint64_t v, std::string& dir) {
    EXPECT_EQ(v, 1u);
    EXPECT_EQ(dir, ck.string());
  }, [](std::string& who, std::string& what) { FAIL() << who << ": " << what; },
     caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no stopped"; });
  std::set<int32_t> told;
  for (int i = 0; i < 2; ++i)
    t.told->receive([&](int32_t rank) { told.insert(rank); }, caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "a rank not told to stop"; });
  EXPECT_EQ(told, (std::set<int32_t>{0, 1}));
  // rank 1 has been answered `stop`: in the 2 s it would save and report (a mutant that lets it did)
  t.ctl->receive([](msg::stopped_atom, uint64_t v, std::string&) { ADD_FAILURE() << "a second `stopped`, v" << v; },
                 caf::after(std::chrono::seconds(2)) >> [] {});
  ASSERT_EQ(::stat(ck.c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "step_1 was saved again at the stop";
  EXPECT_EQ(fs::last_write_time(ck / "state.json"), state_time);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(t.run / "checkpoints")) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"latest", "step_1"}));
}

// Every checkpoint carries the run's tokenizer, read at the start: the start directory's file
// deleted during the run (a disk cleaned up) left the later checkpoints without one (each save
// copied it, skipped when missing), and the run unusable for eval or --resume, exiting 0.
TEST(Protocol, CheckpointsCarryTheTokenizerReadAtTheStart) {
  test_config cfg;
  caf::actor_system sys{cfg};
  const fs::path init = fs::temp_directory_path() / ("fp8rl_proto_tok_init_" + std::to_string(::getpid()));
  fs::remove_all(init);
  fs::copy(init_dir(), init, fs::copy_options::recursive);
  {
    learner_ranks t(sys, "tok", 1, 1, init.string());
    ASSERT_TRUE(fs::remove(init / "fp8rl-char-tokenizer.json"));
    t.one_step();
    const auto tok = models::tokenizer_load((t.run / "checkpoints" / "step_1").string());
    EXPECT_EQ(tok->encode("12+3=", false), t.env->tok->encode("12+3=", false));
  }
  fs::remove_all(init);
}

// A run directory deleted during the run fails the learner's next checkpoint naming it (a save
// recreated it holding checkpoints/ alone, and the run ended "finished", exit 0).
TEST(Protocol, ALearnerFailsWhereItsRunDirectoryIsGone) {
  test_config cfg;
  caf::actor_system sys{cfg};
  learner_ranks t(sys, "gone", 1, 1);
  t.cal->receive([](msg::params_msg&) {}, caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no start"; });  // started
  fs::remove_all(t.run);
  t.ctl->send(t.buf, group(0, 0, 0));
  t.ctl->send(t.buf, group(0, 1, 0));
  t.ctl->receive([&](std::string& who, std::string& what) {
    EXPECT_EQ(who, "learner0");
    EXPECT_EQ(what, "step failed: " + t.run.string() + ": the run directory is gone (deleted during the run?); step 1's checkpoint is "
                                                        "not written");
  }, [](msg::step_report& r) { FAIL() << "step " << r.version << " reported"; },
     caf::after(std::chrono::seconds(120)) >> [] { FAIL() << "no failure"; });
  EXPECT_FALSE(fs::exists(t.run));
}

// A checkpoint at the stop that cannot be recorded (a directory where checkpoints/latest.tmp goes:
// it cannot be opened) fails the run naming the file and why, with no `stopped`: `latest` still
// names the checkpoint it named, and the stop's own checkpoint directory is complete beside it.
TEST(Protocol, ALearnerWhoseStopCheckpointCannotBeRecordedFailsNamingIt) {
  test_config cfg;
  caf::actor_system sys{cfg};
  learner_ranks t(sys, "latest_fails", 1, 0);  // only at the end: none at step 1
  t.one_step();
  const fs::path ck = t.run / "checkpoints";
  ASSERT_FALSE(fs::exists(ck / "step_1"));
  fs::create_directories(ck / "latest.tmp");
  std::ofstream(ck / "latest") << "step_0\n";
  EXPECT_EQ(t.stop(), 1u);
  t.ctl->receive([&](std::string& who, std::string& what) {
    EXPECT_EQ(who, "learner0");
    EXPECT_NE(what.find("checkpoint at the stop failed: " + (ck / "latest.tmp").string() + ": cannot open for writing: Is a directory (" +
                        (ck / "latest").string() + " still names the previous checkpoint)"), std::string::npos) << what;
  }, [](msg::stopped_atom, uint64_t v, std::string& dir) { FAIL() << "stopped at v" << v << ": " << dir; },
     caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "the failure was not reported"; });
  std::ifstream latest(ck / "latest");
  std::string named;
  std::getline(latest, named);
  EXPECT_EQ(named, "step_0");
  EXPECT_EQ(models::checkpoint_weight_version((ck / "step_1").string()), 1u);
}

namespace {
// A rollout (the run's group size 2) whose controller is ctl, monitored by it.
msg::rollout_actor rollout_for(caf::actor_system& sys, caf::scoped_actor& ctl) {
  auto ro = actors::spawn_rollout(sys, env_with(1, 2), "rollout0", actors::device_spec::parse("cpu:1", "test"));
  ctl->monitor(ro);
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  ctl->send(ro, p);
  return ro;
}
// Sends w and expects the rollout's error report holding `what`, then its exit.
void expect_work_refused(caf::scoped_actor& ctl, const msg::rollout_actor& ro, const msg::work_msg& w, const std::string& what) {
  ctl->send(ro, w);
  ctl->receive([&](std::string& who, std::string& why) {
    EXPECT_EQ(who, "rollout0");
    EXPECT_NE(why.find(what), std::string::npos) << why;
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no error report"; });
  ctl->receive([&](caf::down_msg& d) { EXPECT_TRUE(d.reason); },
               caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "the rollout did not stop"; });
}
}  // namespace

// A rollout's failures are named. An engine error is the run's error: the rollout reports it to
// the controller and stops (it was CAF's "unhandled exception"; the controller re-queued the
// same prompt onto the other rollouts until none was left, the cause only on stderr). So is
// work whose group size is not the run's: completions find their prompt by id /
// rollout.group_size, so groups of 3 under a run's 2 were filed under other prompts and scored
// against their answers. A chunk numbered past its total (total 0 never assembled, yet was
// acked) is answered with an error. An exception (an engine refusing its KV cache at start) is
// the actor's exit reason with its name and text, which the controller reports; CAF's default
// reason was a bare system_error(runtime_error).
TEST(Protocol, RolloutFailuresAreNamed) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys};
  msg::work_msg w;
  w.prompt_id = 7;
  w.prompt = "12+3@=";  // '@' is not in the built-in alphabet
  w.group_size = 2;
  expect_work_refused(ctl, rollout_for(sys, ctl), w, "prompt 7: char tokenizer: character '@'");
  auto ro = rollout_for(sys, ctl);
  msg::bundle_chunk c;
  c.version = 4;
  c.total = 0;
  ctl->request(ro, std::chrono::seconds(5), c).receive(
      [&](msg::chunk_ack&) { FAIL() << "a chunk 0 of 0 was acked"; },
      [&](caf::error& e) { EXPECT_NE(sys.render(e).find("rollout0: bundle v4 chunk 0 of 0"), std::string::npos) << sys.render(e); });
  w.prompt_id = 3;
  w.prompt = "12+3=";
  w.group_size = 3;  // the run's is 2
  expect_work_refused(ctl, ro, w, "prompt 3: work for groups of 3, the run's rollout.group_size is 2");
  w.group_size = 1;  // smaller too: its completions would be filed under other prompts' groups
  expect_work_refused(ctl, rollout_for(sys, ctl), w, "prompt 3: work for groups of 1, the run's rollout.group_size is 2");
  actors::run_config r;
  r.slots = 100000000;
  r.log_level = "off";
  ctl->monitor(actors::spawn_rollout(sys, actors::env_make(r, "test", fs::temp_directory_path().string(), init_dir(), 0),
                                     "rollout0", actors::device_spec::parse("cpu:1", "test")));
  ctl->receive([&](caf::down_msg& d) {
    const std::string why = sys.render(d.reason);
    EXPECT_NE(why.find("rollout0: engine: a KV cache of 100000000 slots"), std::string::npos) << why;
  }, caf::after(std::chrono::seconds(10)) >> [] { FAIL() << "the rollout did not go down"; });
}

// Chunks of a version a newer one superseded (its chunk 0 came first: weight-sync starts v+1 while
// v is in flight) are answered "superseded", so weight-sync stops sending them and waits no more
// for v there; they were acked as received, dropped, and v never reported. The newer version's
// chunks keep going to the same buffer.
TEST(Protocol, RolloutAnswersChunksOfASupersededVersion) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys};
  auto ro = rollout_for(sys, ctl);
  auto chunk = [&](uint64_t v, uint32_t seq) {
    msg::bundle_chunk c;
    c.version = v, c.seq = seq, c.total = 3, c.bytes = {1, 2, 3};
    msg::chunk_ack got;
    ctl->request(ro, std::chrono::seconds(5), c).receive([&](msg::chunk_ack& a) { got = a; },
                                                         [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    EXPECT_EQ(got.version, v);
    EXPECT_EQ(got.seq, seq);
    return got.superseded;
  };
  EXPECT_FALSE(chunk(1, 0));
  EXPECT_FALSE(chunk(1, 1));
  EXPECT_FALSE(chunk(2, 0));  // v2 supersedes the partly received v1
  EXPECT_TRUE(chunk(1, 2));
  EXPECT_FALSE(chunk(2, 1));
}

// A rollout (rollout0 of env_with(1, 2)) on the test coordinator, whose peers are one recorder of
// the adoptions and groups it sends; bundle(v) is the initial weights as version v.
class RolloutOnTestCoordinator : public ::testing::Test, protected coordinated_system {
 protected:
  std::vector<msg::adopted_msg> adopted;
  std::vector<msg::group_msg> groups;
  caf::actor peer = sys.spawn([](caf::event_based_actor* a, std::vector<msg::adopted_msg>* ad, std::vector<msg::group_msg>* gs) -> caf::behavior {
    a->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
    return {[=](msg::adopted_msg& m) { ad->push_back(m); }, [=](msg::group_msg& g) { gs->push_back(g); }};
  }, &adopted, &groups);
  const std::shared_ptr<const actors::actor_env> env = env_with(1, 2);
  msg::rollout_actor ro = actors::spawn_rollout(sys, env, "rollout0", actors::device_spec::parse("cpu:1", "test"));
  const models::model_params params = models::model_load(init_dir());
  std::vector<caf::actor> extra;  // other rollouts a test spawns (stopped at teardown too)

  void SetUp() override { self->send(ro, rollout_peers(peer, peer, peer)); }
  msg::bundle_msg bundle(uint64_t v) {
    return msg::bundle_msg{{}, std::make_shared<const quant::weight_bundle>(models::bundle_from_params(params, env->rl.gen_policy, v, v, nullptr))};
  }
  void TearDown() override {
    for (const caf::actor& a : {caf::actor_cast<caf::actor>(ro), peer}) self->send_exit(a, caf::exit_reason::user_shutdown);
    for (const auto& a : extra) self->send_exit(a, caf::exit_reason::user_shutdown);
    sched.run();
  }
};

// A bundle adopted before the rollout knows its peers (weight-sync's first bundle can come before
// the controller's wiring) is reported once the peers come, not lost: weight-sync would wait on it.
TEST_F(RolloutOnTestCoordinator, AnAdoptionBeforeThePeersIsReportedWhenTheyCome) {
  msg::rollout_actor early = actors::spawn_rollout(sys, env, "rollout1", actors::device_spec::parse("cpu:1", "test"));
  extra.push_back(caf::actor_cast<caf::actor>(early));
  self->send(early, bundle(1));  // idle: adopted at once, with nobody to tell
  sched.run();
  EXPECT_TRUE(adopted.empty());
  self->send(early, rollout_peers(peer, peer, peer));
  sched.run();
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(adopted[0].rollout, "rollout1");
  EXPECT_EQ(adopted[0].weight_version, 1u);
  EXPECT_TRUE(adopted[0].error.empty());
}

// An FP8 KV cache's saturation counts travel with the groups as increases: the groups' counts add
// up to the engine's total (a count sent again with each group overcounted the buffer's totals).
// K/V scales of 1e-4 (448 x 1e-4 = 0.045 the largest value stored) saturate most values.
TEST_F(RolloutOnTestCoordinator, KvSaturationTravelsAsIncreases) {
  const auto env8 = env_with(1, 2, 0, "fp8-kv");
  msg::rollout_actor kv = actors::spawn_rollout(sys, env8, "rollout1", actors::device_spec::parse("cpu:1", "test"));
  extra.push_back(caf::actor_cast<caf::actor>(kv));
  self->send(kv, rollout_peers(peer, peer, peer));
  const int64_t L = params.cfg.num_hidden_layers, H = params.cfg.num_attention_heads, KV = params.cfg.num_key_value_heads;
  const models::attn_fp8_scales sc{std::vector<float>(L * H, 1e-4f), std::vector<float>(L * KV, 1e-4f), std::vector<float>(L * KV, 1e-4f)};
  self->send(kv, msg::bundle_msg{{}, std::make_shared<const quant::weight_bundle>(models::bundle_from_params(params, env8->rl.gen_policy, 1, 1, &sc))});
  msg::work_msg w = work_12_plus_3(*env8);
  self->send(kv, w);
  sched.run();
  w.prompt_id = 4;
  w.prompt = "2+30=";
  self->send(kv, w);
  sched.run();
  ASSERT_EQ(groups.size(), 2u);
  int64_t sum = 0;
  for (const auto& g : groups) {
    const int64_t n = std::accumulate(g.kv_saturated.begin(), g.kv_saturated.end(), int64_t{0});
    EXPECT_GT(n, 0) << "prompt " << g.prompt_id;
    sum += n;
  }
  self->send(kv, msg::status_atom::value);
  sched.run();
  self->receive([&](msg::metrics_t& m) { EXPECT_EQ(m.at("kv_saturated"), double(sum)); },
                caf::after(std::chrono::seconds(1)) >> [] { ADD_FAILURE() << "no status"; });
}

// A group's samples go out in group_index order whatever order its sequences finish in (here
// some groups' second sequence finishes first: the checked mutant, unsorted, fails).
TEST_F(RolloutOnTestCoordinator, GroupSamplesAreInGroupIndexOrder) {
  self->send(ro, bundle(1));
  for (uint64_t pid = 10; pid < 18; ++pid) {
    msg::work_msg w = work_12_plus_3(*env);
    w.prompt_id = pid;
    w.prompt = std::to_string(pid) + "+" + std::to_string(pid * 7 % 13) + "=";
    self->send(ro, w);
  }
  sched.run();
  ASSERT_EQ(groups.size(), 8u);
  EXPECT_TRUE(std::any_of(groups.begin(), groups.end(), [](const msg::group_msg& g) {
    return g.samples.size() == 2 && g.samples[1].response.size() < g.samples[0].response.size();
  })) << "no group's second sequence finished first: the test tests nothing";
  for (const auto& g : groups) {
    ASSERT_EQ(g.samples.size(), 2u);
    EXPECT_EQ(g.samples[0].group_index, 0) << "prompt " << g.prompt_id;
    EXPECT_EQ(g.samples[1].group_index, 1) << "prompt " << g.prompt_id;
  }
}

// A refused bundle (an older scale version than the engine's) is reported refused once and
// never staged: the next bundle is adopted without a `superseded` report of the refused one.
TEST_F(RolloutOnTestCoordinator, ARefusedBundleIsReportedOnceAndNotStaged) {
  self->send(ro, bundle(3));  // idle: adopted at once
  sched.run();
  self->send(ro, bundle(2));
  sched.run();
  self->send(ro, bundle(4));
  sched.run();
  ASSERT_EQ(adopted.size(), 3u);
  EXPECT_EQ(std::make_tuple(adopted[0].weight_version, adopted[0].error.empty(), adopted[0].superseded), std::make_tuple(3u, true, false));
  EXPECT_EQ(adopted[1].weight_version, 2u);
  EXPECT_NE(adopted[1].error.find("bundle v2/scales v2 is older than the adopted v3/scales v3"), std::string::npos) << adopted[1].error;
  EXPECT_EQ(std::make_tuple(adopted[2].weight_version, adopted[2].error.empty(), adopted[2].superseded), std::make_tuple(4u, true, false));
}

// A rollout reports a bundle adopted when a step first runs under it, on the test coordinator (the
// mailbox order is the test's): work waits for weights; v1 and v2 arrive before the engine's next
// step -- v1 is answered `superseded` (no token was sampled under it; it was reported adopted at
// staging), v2 adopted after the step that took it, and every token carries v2. A bundle reaching
// an idle rollout is taken at once (an idle engine has no step to wait for; the controller's
// staleness window waits for the report).
TEST_F(RolloutOnTestCoordinator, ReportsAdoptionWhenAStepRunsUnderIt) {
  self->send(ro, work_12_plus_3(*env));
  self->send(ro, bundle(1));
  self->send(ro, bundle(2));
  sched.run();
  ASSERT_EQ(groups.size(), 1u);
  for (const auto& smp : groups[0].samples)
    for (uint64_t v : smp.weight_version) EXPECT_EQ(v, 2u);
  ASSERT_EQ(adopted.size(), 2u);
  EXPECT_EQ(adopted[0].weight_version, 1u);
  EXPECT_TRUE(adopted[0].superseded);
  EXPECT_EQ(adopted[1].weight_version, 2u);
  EXPECT_FALSE(adopted[1].superseded);
  EXPECT_TRUE(adopted[1].error.empty());
  self->send(ro, bundle(3));  // idle now
  sched.run();
  ASSERT_EQ(adopted.size(), 3u);
  EXPECT_EQ(adopted[2].weight_version, 3u);
  EXPECT_FALSE(adopted[2].superseded);
  self->send(ro, msg::status_atom::value);  // the reply comes back as a message (a blocking request would never run it)
  sched.run();
  self->receive([&](msg::metrics_t& m) { EXPECT_EQ(m.at("weight_version"), 3.0); EXPECT_EQ(m.at("adoptions"), 2.0); },
                caf::after(std::chrono::seconds(1)) >> [] { ADD_FAILURE() << "no status"; });
  msg::work_msg w = work_12_plus_3(*env);  // another group, no new bundle: still two adoptions
  w.prompt_id = 4;
  self->send(ro, w);
  sched.run();
  ASSERT_EQ(groups.size(), 2u);
  self->send(ro, msg::status_atom::value);
  sched.run();
  self->receive([&](msg::metrics_t& m) { EXPECT_EQ(m.at("adoptions"), 2.0); },
                caf::after(std::chrono::seconds(1)) >> [] { ADD_FAILURE() << "no status"; });
}

// The controller re-issues a stale-dropped group round-robin, possibly to the rollout already
// generating it: the second work_msg submitted its requests again -- twice the generation, the
// copies' completions kept forever, and, where lengths differ, a group with duplicate indices. The
// rollout now ignores a prompt it is generating: one group, each index once, generated once (on
// the test coordinator: every message the rollout would ever handle has run when sched.run() ends).
TEST_F(RolloutOnTestCoordinator, IgnoresAGroupItIsAlreadyGenerating) {
  const msg::work_msg w = work_12_plus_3(*env);
  self->send(ro, w);
  self->send(ro, w);  // before any weights: both wait in the engine
  self->send(ro, bundle(1));
  sched.run();
  ASSERT_EQ(groups.size(), 1u);
  ASSERT_EQ(groups[0].samples.size(), static_cast<size_t>(w.group_size));
  double tokens = 0;
  for (int32_t i = 0; i < w.group_size; ++i) EXPECT_EQ(groups[0].samples[static_cast<size_t>(i)].group_index, i);
  for (const auto& smp : groups[0].samples) tokens += static_cast<double>(smp.response.size());
  // nothing was generated twice (the copies' completions were generated, then never sent)
  self->send(ro, msg::status_atom::value);
  sched.run();
  self->receive([&](msg::metrics_t& m) { EXPECT_EQ(m.at("tokens"), tokens); },
                caf::after(std::chrono::seconds(1)) >> [] { ADD_FAILURE() << "no status"; });
}
