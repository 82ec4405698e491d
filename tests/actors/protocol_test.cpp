// tests/actors/protocol_test.cpp -- message serialization round trips, the trajectory
// buffer (admission by max_staleness, de-duplication, learner shards, refused shard requests, one
// stop step for every rank), reward and buffer before their peers, and the node agents (lost
// actors named by node, started actors checked against the topology, a silent peer). The other
// actors' protocols: protocol_sync_test.cpp (weight-sync, calibration),
// protocol_learner_rollout_test.cpp, protocol_controller_test.cpp (CAF's test coordinator).
#include "tests/actors/protocol_util.hpp"

using namespace fp8rl;
using namespace fp8rl::proto_test;

namespace {

template <class T>
T round_trip(caf::actor_system& sys, const T& x) {
  std::vector<char> buf;
  caf::binary_serializer sink(sys, buf);
  T in = x;
  EXPECT_FALSE(sink(in));
  T out;
  caf::binary_deserializer src(sys, buf);
  EXPECT_FALSE(src(out));
  return out;
}

}  // namespace

TEST(Messages, EveryWireTypeRoundTrips) {
  test_config cfg;
  caf::actor_system sys{cfg};
  msg::work_msg w{{1, 2, 3}, 7, 70, "12+34=", "46", 8, 99};
  auto w2 = round_trip(sys, w);
  EXPECT_EQ(w2.prompt, "12+34=");
  EXPECT_EQ(w2.seed, 99u);
  EXPECT_EQ(w2.trace.lamport, 3u);
  auto g = group(3, 5, 2);
  g.kv_saturated = {0, 7, 1};
  g.q_saturated = {2, 0, 9};
  auto g2 = round_trip(sys, g);
  EXPECT_EQ(g2.policy, g.policy);
  EXPECT_EQ(g2.kv_saturated, g.kv_saturated);
  EXPECT_EQ(g2.q_saturated, g.q_saturated);
  ASSERT_EQ(g2.samples.size(), 2u);
  EXPECT_EQ(g2.samples[1].gen_logprobs, g.samples[1].gen_logprobs);
  EXPECT_EQ(g2.samples[1].weight_version, g.samples[1].weight_version);
  EXPECT_EQ(g2.samples[1].oldest_kv_scale_version, g.samples[1].oldest_kv_scale_version);
  msg::batch_msg b{{}, 4, 123.0, g.samples, {{"x", 1.5}}, g.samples, {0, 7}, true};
  const auto b2 = round_trip(sys, b);
  EXPECT_TRUE(b2.stop);
  EXPECT_EQ(b2.buffer_metrics.at("x"), 1.5);
  ASSERT_EQ(b2.all_samples.size(), 2u);
  EXPECT_EQ(b2.all_samples[1].response, g.samples[1].response);
  EXPECT_EQ(b2.offsets, b.offsets);
  msg::params_msg pm;
  pm.version = 5;
  pm.params = std::make_shared<const std::vector<float>>(std::vector<float>{1.0f, -2.5f, 3.25f});
  pm.calib = {{1, 2}, {3}};
  auto pm2 = round_trip(sys, pm);
  EXPECT_EQ(*pm2.params, *pm.params);
  EXPECT_EQ(pm2.calib, pm.calib);
  // bundle: FP8 bytes, BF16 bytes and the scale snapshot survive byte for byte
  const auto params = models::model_load(init_dir());
  msg::bundle_msg bm;
  models::attn_fp8_scales sc{std::vector<float>(4, 0.01f), std::vector<float>(2, 0.02f), std::vector<float>(2, 0.03f)};
  bm.bundle = std::make_shared<quant::weight_bundle>(
      models::bundle_from_params(params, models::precision_policy::named("fp8-kv"), 3, 4, &sc));
  auto bm2 = round_trip(sys, bm);
  ASSERT_TRUE(bm2.bundle);
  const quant::scale_snapshot &got = bm2.bundle->snapshot, &sent = bm.bundle->snapshot;
  EXPECT_EQ(bm2.bundle->weight_version, 3u);
  EXPECT_EQ(got.weight_version, 3u);
  EXPECT_EQ(got.scale_version, 4u);  // every field: a bundle across processes arrived at scale version 0 unnoticed
  EXPECT_EQ(got.mode, sent.mode);
  EXPECT_EQ(got.policy, sent.policy);
  EXPECT_EQ(got.weight_scales, sent.weight_scales);
  EXPECT_EQ(std::make_tuple(got.layers, got.heads, got.kv_heads), std::make_tuple(sent.layers, sent.heads, sent.kv_heads));
  EXPECT_EQ(got.q_scale, sent.q_scale);
  EXPECT_EQ(got.k_scale, sent.k_scale);
  EXPECT_EQ(got.v_scale, sent.v_scale);
  ASSERT_EQ(bm2.bundle->tensors.size(), bm.bundle->tensors.size());
  for (size_t i = 0; i < bm.bundle->tensors.size(); ++i) {
    const auto &a = bm2.bundle->tensors[i], &b = bm.bundle->tensors[i];
    EXPECT_EQ(std::tie(a.name, a.dtype, a.shape, a.bytes), std::tie(b.name, b.dtype, b.shape, b.bytes)) << b.name;
  }
  std::set<quant::bundle_dtype> dtypes;  // every dtype travels; one past the last is refused by name
  for (const auto& t : bm.bundle->tensors) dtypes.insert(t.dtype);
  EXPECT_GE(dtypes.size(), 2u);
  msg::bundle_wire bad = msg::bundle_to_wire(*bm.bundle);
  bad.dtypes.at(1) = 3;
  try {
    msg::bundle_from_wire(std::move(bad));
    ADD_FAILURE() << "dtype 3 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor '" + bm.bundle->tensors[1].name + "' has unknown dtype"), std::string::npos) << e.what();
  }
  // a quantized tensor: codes, scales, shape, layout and mode survive; a short scale array or an
  // unknown layout does not deserialize
  std::vector<float> x(200 * 300);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.01f * float(i)) * 3.0f;
  for (auto layout : {quant::qlayout::rowwise_1x128, quant::qlayout::colwise_1x128, quant::qlayout::block_128x128}) {
    const auto q = quant::quantize(x.data(), 200, 300, layout, quant::scale_mode::fp32, "w");
    const auto q2 = round_trip(sys, q);
    EXPECT_EQ(q2.name, "w");
    EXPECT_EQ(q2.rows, 200);
    EXPECT_EQ(q2.cols, 300);
    EXPECT_EQ(q2.layout, layout);
    EXPECT_EQ(q2.mode, quant::scale_mode::fp32);
    EXPECT_EQ(q2.data, q.data);
    EXPECT_EQ(q2.scale_inv, q.scale_inv);
  }
  auto deserialize = [&](std::vector<char> buf) {  // "" if it deserializes (render says "none" then)
    quant::qtensor out;
    caf::binary_deserializer src(sys, buf);
    const caf::error err = src(out);
    return err ? sys.render(err) : std::string();
  };
  quant::qtensor qw = quant::quantize(x.data(), 200, 300, quant::qlayout::block_128x128, quant::scale_mode::pow2, "w");
  std::vector<char> buf;
  caf::binary_serializer sink(sys, buf);
  EXPECT_FALSE(sink(qw));
  EXPECT_NE(deserialize(std::vector<char>(buf.begin(), buf.end() - 4)), "");  // truncated
  qw.scale_inv.pop_back();
  std::vector<char> short_buf;
  caf::binary_serializer short_sink(sys, short_buf);
  EXPECT_FALSE(short_sink(qw));
  EXPECT_NE(deserialize(short_buf).find("'w'"), std::string::npos);  // qtensor_validate names the tensor
  msg::bundle_chunk c{{7, 8, 5}, 9, 1, 3, {1, 2, 3}};
  EXPECT_EQ(round_trip(sys, c).bytes, c.bytes);
  EXPECT_EQ(round_trip(sys, c).trace.lamport, 5u);  // the trace context crosses processes
  EXPECT_EQ(round_trip(sys, msg::adopted_msg{{}, "rollout3", 4, 4, "bad"}).error, "bad");
  EXPECT_TRUE(round_trip(sys, msg::adopted_msg{{}, "rollout3", 4, 4, "", true}).superseded);
  msg::node_start ns;  // the node protocol: typed fields, not a JSON string and positional handles
  ns.recipe_json = "{}";
  ns.node = "n1";
  ns.start_version = 3;
  ns.start_cursor = 17;
  const auto ns2 = round_trip(sys, ns);
  EXPECT_EQ(ns2.node, "n1");
  EXPECT_EQ(ns2.start_cursor, 17u);
  msg::node_actors na;
  na.rollout_names = {"rollout2"};
  const auto na2 = round_trip(sys, na);
  EXPECT_EQ(na2.rollout_names, na.rollout_names);
  EXPECT_FALSE(na2.buffer);
  msg::step_report sr{{}, 4, {{"reward_mean", 0.5}}};
  EXPECT_EQ(round_trip(sys, sr).metrics, sr.metrics);
  EXPECT_EQ(round_trip(sys, msg::admitted_msg{{}, 1, 2, true, "stale"}).reason, "stale");
  EXPECT_EQ(round_trip(sys, msg::sync_report{{}, 3, 0.25, 100, true}).bytes, 100);
  const auto cr = round_trip(sys, msg::calib_report{{}, 3, 0.5, 77, 0.25});
  EXPECT_EQ(cr.version, 3u);
  EXPECT_EQ(cr.seconds, 0.5);
  EXPECT_EQ(cr.weights_flushed, 77);
  EXPECT_EQ(cr.worst_block_flushed, 0.25);
}

namespace {
// A trajectory buffer (max_staleness 1, 2 prompts per step) whose controller is ctl.
msg::buffer_actor buffer_for(caf::actor_system& sys, caf::scoped_actor& ctl) {
  auto buf = actors::spawn_buffer(sys, env_with(1, 2));
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  ctl->send(buf, p);
  return buf;
}
}  // namespace

TEST(Protocol, BufferAdmitsDedupsShardsAndDropsStale) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto buf = buffer_for(sys, self);
  auto expect_admitted = [&](uint64_t step, uint64_t pid, bool dropped) {
    self->receive([&](msg::admitted_msg& a) {
      EXPECT_EQ(a.step, step);
      EXPECT_EQ(a.prompt_id, pid);
      EXPECT_EQ(a.dropped, dropped) << a.reason;
    }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no admitted_msg"; });
  };
  auto g00 = group(0, 0, 0);
  g00.kv_saturated = {1, 2};  // per-layer FP8 K/V saturations since the rollout's previous group
  self->send(buf, g00);
  expect_admitted(0, 0, false);
  auto again = group(0, 0, 0);  // the same group again (re-issued work finished twice): its
  again.kv_saturated = {0, 2};    // saturations count all the same (work done)
  self->send(buf, again);
  expect_admitted(0, 0, true);
  auto g01 = group(0, 1, 0);
  g01.kv_saturated = {0, 5};
  g01.q_saturated = {3, 0};  // FP8 queries likewise
  self->send(buf, g01);
  expect_admitted(0, 1, false);
  // two learners ask for their shards of step 0: one group each, N over the whole batch, and the
  // step's samples (rank 0: metrics, calibration) and the token offsets of each shard
  caf::scoped_actor l0{sys}, l1{sys};  // both ranks ask before either is served
  l0->send(buf, msg::batch_atom::value, uint64_t{0}, int32_t{0}, int32_t{2}, uint64_t{0});
  l1->send(buf, msg::batch_atom::value, uint64_t{0}, int32_t{1}, int32_t{2}, uint64_t{0});
  int32_t rank = 0;
  for (auto* l : {&l0, &l1}) {
    (*l)->receive([&](msg::batch_msg& b) {
      EXPECT_EQ(b.samples.size(), 2u);
      EXPECT_EQ(b.samples[0].prompt_id, static_cast<uint64_t>(rank));
      EXPECT_EQ(b.n_global, 12.0);
      EXPECT_EQ(b.buffer_metrics.at("kv_saturated_total/layer0"), 1.0);  // summed over the rollouts' groups
      EXPECT_EQ(b.buffer_metrics.at("kv_saturated_total/layer1"), 9.0);
      EXPECT_EQ(b.buffer_metrics.at("kv_saturated_total"), 10.0);
      EXPECT_EQ(b.buffer_metrics.at("q_saturated_total/layer0"), 3.0);
      EXPECT_EQ(b.buffer_metrics.at("q_saturated_total"), 3.0);
      // rank 0 gets the whole step (metrics, calibration batch); each rank where its tokens go
      EXPECT_EQ(b.all_samples.size(), rank == 0 ? 4u : 0u);
      ASSERT_EQ(b.offsets.size(), 2u);
      EXPECT_EQ(b.offsets[0], rank == 0 ? 0 : 6);  // groups of 2 samples x 3 tokens: rank 1's starts at 6
      EXPECT_EQ(b.offsets[1], rank == 0 ? 3 : 9);
    }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no shard"; });
    ++rank;
  }
  // a group of step 0 finishing again after the step was delivered: a duplicate, not step 0's anew
  self->send(buf, group(0, 0, 0));
  self->receive([&](msg::admitted_msg& a) {
    EXPECT_EQ(a.step, 0u);
    EXPECT_TRUE(a.dropped);
    EXPECT_EQ(a.reason, "duplicate");
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no admitted_msg"; });
  // step 1 with the learner at version 2: a group whose oldest token was sampled under v0 (the
  // second sample's second token; the rest under v2) is 2 versions stale (> 1)
  auto g14 = group(1, 4, 2);
  g14.samples[1].weight_version = {2, 0, 2};
  self->send(buf, g14);
  expect_admitted(1, 4, false);
  self->send(buf, group(1, 5, 1));
  expect_admitted(1, 5, false);
  caf::scoped_actor learner{sys};  // waits for step 1 while the buffer drops the stale group
  // steps go out in order: step 0 again or step 2 before 1 is refused (each waited 30 minutes)
  for (const uint64_t wrong : {uint64_t{0}, uint64_t{2}})
    learner->request(buf, std::chrono::seconds(5), msg::batch_atom::value, wrong, int32_t{0}, int32_t{1}, uint64_t{2})
        .receive([](msg::batch_msg&) { FAIL() << "a step out of turn was served"; },
                 [&](caf::error& e) { EXPECT_NE(sys.render(e).find(", the next step is 1"), std::string::npos) << sys.render(e); });
  learner->send(buf, msg::batch_atom::value, uint64_t{1}, int32_t{0}, int32_t{1}, uint64_t{2});
  self->receive([&](msg::admitted_msg& a) {  // dropped as stale; the controller re-issues it
    EXPECT_EQ(a.prompt_id, 4u);
    EXPECT_TRUE(a.dropped);
    EXPECT_EQ(a.reason, "stale: weight_version 0");
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no admitted_msg"; });
  self->send(buf, group(1, 4, 2));  // regenerated under v2
  expect_admitted(1, 4, false);
  learner->receive([&](msg::batch_msg& b) {
    ASSERT_EQ(b.samples.size(), 4u);
    for (const auto& s : b.samples) EXPECT_GE(s.weight_version.front(), 1u);
    EXPECT_TRUE(b.all_samples.empty());  // one learner: its samples are the step's
    EXPECT_EQ(b.buffer_metrics.at("buffer/admitted_total"), 5.0);
    EXPECT_EQ(b.buffer_metrics.at("buffer/dropped_duplicate_total"), 2.0);
    EXPECT_EQ(b.buffer_metrics.at("buffer/dropped_stale_total"), 1.0);
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no batch"; });
  self->send_exit(buf, caf::exit_reason::user_shutdown);
}

// A rollout's group can reach the reward actor, and the reward actor's the buffer, before the
// controller's peers_msg (CAF orders one sender's messages only): the scored group and the
// admission went to unset handles, dropped in silence; now they wait for the peers.
TEST(Protocol, RewardAndBufferKeepWhatCameBeforeTheirPeers) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys}, ro{sys}, buffer_stand_in{sys};
  auto reward = actors::spawn_reward(sys, env_with(1, 2));
  ro->send(reward, group(0, 4, 0));  // before the peers, from another sender
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  p.buffer = caf::actor_cast<msg::buffer_actor>(buffer_stand_in);
  ctl->send(reward, p);
  buffer_stand_in->receive([](msg::group_msg& g) { EXPECT_EQ(g.prompt_id, 4u); },
                           caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "the scored group was lost"; });
  auto buf = actors::spawn_buffer(sys, env_with(1, 2));
  ro->send(buf, group(0, 5, 0));
  ctl->send(buf, p);
  ctl->receive([](msg::admitted_msg& a) { EXPECT_EQ(a.prompt_id, 5u); EXPECT_FALSE(a.dropped) << a.reason; },
               caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "the admission was lost"; });
  ctl->send_exit(reward, caf::exit_reason::user_shutdown);
  ctl->send_exit(buf, caf::exit_reason::user_shutdown);
}

// A shard request the step cannot be cut into is refused and the step stays whole: world 0 was a
// division by zero (SIGFPE took the process); a rank outside its world, or one asked twice,
// delivered the step with one shard's samples in nobody's batch.
TEST(Protocol, BufferRefusesShardRequestsItCannotServe) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto buf = buffer_for(sys, self);
  auto refused = [&](int32_t rank, int32_t world, const std::string& what) {
    // (at learner version 9: a refused request's version counts for nothing -- the groups below, of
    // v0, would be stale)
    self->request(buf, std::chrono::seconds(5), msg::batch_atom::value, uint64_t{0}, rank, world, uint64_t{9}).receive(
        [&](msg::batch_msg&) { ADD_FAILURE() << "served rank " << rank << " of world " << world; },
        [&](caf::error& e) { EXPECT_NE(sys.render(e).find(what), std::string::npos) << sys.render(e); });
  };
  refused(0, 0, "trajectory buffer: step 0 requested by rank 0 of world 0");
  refused(2, 2, "requested by rank 2 of world 2");
  refused(-1, 2, "requested by rank -1 of world 2");
  caf::scoped_actor l0{sys}, l1{sys};
  l0->send(buf, msg::batch_atom::value, uint64_t{0}, int32_t{0}, int32_t{2}, uint64_t{0});  // waits for the groups
  refused(0, 2, "requested by rank 0 of world 2 after rank 0 of world 2");
  refused(1, 3, "requested by rank 1 of world 3 after rank 0 of world 2");
  l1->send(buf, msg::batch_atom::value, uint64_t{0}, int32_t{1}, int32_t{2}, uint64_t{0});
  self->send(buf, group(0, 0, 0));
  self->send(buf, group(0, 1, 0));
  for (auto* l : {&l0, &l1})
    (*l)->receive([&](msg::batch_msg& b) { EXPECT_EQ(b.samples.size(), 2u); },
                  caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no shard"; });
  self->send_exit(buf, caf::exit_reason::user_shutdown);
}

// A group sampled under another precision policy (a node started with other settings) is
// refused: the buffer ends the run naming the group, its rollout and both policies, and admits
// nothing (rl-algorithm.md section 10: the learner refuses trajectories of another policy).
TEST(Protocol, BufferRefusesAGroupOfAnotherPolicy) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto buf = buffer_for(sys, self);
  auto g = group(0, 1, 0);
  g.policy = actors::recipe_rl_config([] {
               actors::run_config r;
               r.generation = "bf16";
               return r;
             }()).gen_policy.fingerprint();
  self->send(buf, g);
  self->receive([&](std::string& who, std::string& what) {
    EXPECT_EQ(who, "the trajectory buffer");
    EXPECT_NE(what.find("group (step 0, prompt 1) from rollout0 was sampled under precision policy '" + g.policy +
                        "'; this run generates under '" + group(0, 1, 0).policy + "'"), std::string::npos) << what;
  }, [&](msg::admitted_msg& a) { ADD_FAILURE() << "admitted: " << a.reason; },
     caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no failure named"; });
  EXPECT_NE(g.policy, group(0, 1, 0).policy);
}

// A stop (a signal to `fp8rl train`): the buffer answers the first step no rank was given, and
// every rank asking for it -- one already waiting, one still in the step before -- gets `stop` at
// that step, so no learner waits in an all-reduce its peer never joins; its groups are not served.
TEST(Protocol, BufferStopsEveryRankAtTheSameStep) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto stop_step = [&](msg::buffer_actor& b) {
    uint64_t at = 99;
    self->request(b, std::chrono::seconds(5), msg::stop_atom::value)
        .receive([&](uint64_t x) { at = x; }, [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    return at;
  };
  auto fresh = buffer_for(sys, self);
  EXPECT_EQ(stop_step(fresh), 0u);  // before any batch: the learners stop where they started
  self->send_exit(fresh, caf::exit_reason::user_shutdown);
  auto resumed = actors::spawn_buffer(sys, env_with(1, 2, 3));  // ... which is the resumed version
  EXPECT_EQ(stop_step(resumed), 3u);
  self->send_exit(resumed, caf::exit_reason::user_shutdown);
  auto buf = buffer_for(sys, self);
  caf::scoped_actor l0{sys}, l1{sys};
  auto ask = [&](caf::scoped_actor& l, uint64_t step, int32_t rank) {
    l->send(buf, msg::batch_atom::value, step, rank, int32_t{2}, step);
  };
  auto answer = [&](caf::scoped_actor& l, uint64_t step, bool stop) {
    l->receive([&](msg::batch_msg& b) {
      EXPECT_EQ(b.step, step);
      EXPECT_EQ(b.stop, stop);
      EXPECT_EQ(b.samples.empty(), stop);
    }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no answer"; });
  };
  self->send(buf, group(0, 0, 0));
  self->send(buf, group(0, 1, 0));
  ask(l0, 0, 0);
  ask(l1, 0, 1);
  answer(l0, 0, false);
  answer(l1, 0, false);
  ask(l0, 1, 0);  // rank 0 waits for step 1; rank 1 is still training step 0
  EXPECT_EQ(stop_step(buf), 1u);
  answer(l0, 1, true);  // the waiting rank is answered at once
  self->send(buf, group(1, 2, 0));
  self->send(buf, group(1, 3, 0));  // step 1 complete: not served after the stop
  ask(l1, 1, 1);
  answer(l1, 1, true);
  EXPECT_EQ(stop_step(buf), 1u);  // a second stop keeps the first's step
  ask(l0, 2, 0);
  answer(l0, 2, true);
  self->send_exit(buf, caf::exit_reason::user_shutdown);
}

// A lost actor's node is named by the node agent running in its process: with two remote nodes
// each is told apart (not the first agent's name for both), this process's is "", one without an
// agent "another process".
TEST(Protocol, ALostActorsNodeIsNamedByItsAgent) {
  auto id = [](uint32_t pid, char h) { return *caf::make_node_id(pid, std::string(40, h)); };
  const std::vector<caf::node_id> agents = {id(11, 'b'), id(12, 'c')};
  const std::vector<std::string> names = {"b", "c"};
  EXPECT_EQ(actors::node_name_of(agents, names, id(10, 'a'), id(12, 'c')), "c");
  EXPECT_EQ(actors::node_name_of(agents, names, id(10, 'a'), id(11, 'b')), "b");
  EXPECT_EQ(actors::node_name_of(agents, names, id(10, 'a'), id(10, 'a')), "");
  EXPECT_EQ(actors::node_name_of(agents, names, id(10, 'a'), id(12, 'b')), "another process");  // same pid, other host
}

// A node's answer (node_actors) is checked against its topology entry: every role it runs and no
// other, as many learners and rollouts, valid handles, rollouts named in the run's order.
TEST(Protocol, NodeActorsAreCheckedAgainstTheTopologyEntry) {
  coordinated_system cs;
  auto& [cfg, sys, sched, self] = cs;
  // a spawn argument: CAF 0.17's init_fun_factory dereferences a null empty-argument tuple (UBSan)
  auto any = sys.spawn([](caf::event_based_actor*, int32_t) -> caf::behavior { return {[](int32_t) {}}; }, 0);
  actors::node_spec n;
  n.name = "b", n.roles = {"reward"};
  n.learners = {actors::device_spec::parse("cpu:1", "test")};
  n.rollouts = {actors::device_spec::parse("cpu:1", "test"), actors::device_spec::parse("cpu:1", "test")};
  msg::node_actors x;
  x.reward = caf::actor_cast<msg::reward_actor>(any);
  x.learners = {caf::actor_cast<msg::learner_actor>(any)};
  x.rollouts = {caf::actor_cast<msg::rollout_actor>(any), caf::actor_cast<msg::rollout_actor>(any)};
  x.rollout_names = {"rollout2", "rollout3"};
  EXPECT_EQ(actors::node_actors_problem(n, x, 2), "");
  EXPECT_EQ(actors::node_actors_problem(n, x, 1), "rollout 'rollout2' where rollout1 belongs");
  auto with = [&](auto f) { msg::node_actors y = x; f(y); return actors::node_actors_problem(n, y, 2); };
  EXPECT_EQ(with([](msg::node_actors& y) { y.reward = msg::reward_actor{}; }), "reward missing");
  EXPECT_EQ(with([&](msg::node_actors& y) { y.buffer = caf::actor_cast<msg::buffer_actor>(any); }), "buffer not in its topology entry");
  EXPECT_EQ(with([](msg::node_actors& y) { y.rollouts.pop_back(); }), "1 learners and 1 rollouts, its topology entry has 1 and 2");
  EXPECT_EQ(with([](msg::node_actors& y) { y.rollout_names.pop_back(); }), "1 learners and 2 rollouts, its topology entry has 1 and 2");
  EXPECT_EQ(with([](msg::node_actors& y) { y.learners[0] = msg::learner_actor{}; }), "an invalid learner handle");
  EXPECT_EQ(with([](msg::node_actors& y) { y.rollouts[1] = msg::rollout_actor{}; }), "an invalid handle for rollout3");
  self->send_exit(any, caf::exit_reason::user_shutdown);
  sched.run();
}

// Connecting to a peer that accepted the TCP connection and never answers (a stopped or hung
// node) ends in an error after the timeout given: middleman().connect waited for good (CAF
// #1240), and the controller with it. A node that answers is connected to, by its id.
TEST(Protocol, NodeConnectGivesUpOnASilentPeer) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);  // listens, never accepts: the kernel's backlog
  ASSERT_GE(fd, 0);                                  // completes the TCP handshake, nobody answers
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  test_config cfg1, cfg2;
  cfg1.load<caf::io::middleman>();
  cfg2.load<caf::io::middleman>();
  caf::actor_system sys{cfg1}, peer{cfg2};
  const auto t0 = std::chrono::steady_clock::now();
  const auto silent = actors::node_connect(sys, "127.0.0.1", ntohs(a.sin_port), std::chrono::seconds(1));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);  // resets the waiting connection
  ASSERT_FALSE(silent);
  EXPECT_EQ(silent.error(), caf::sec::request_timeout) << sys.render(silent.error());
  EXPECT_LT(waited, 10.0);  // the 1 s asked, with room for a loaded machine
  const auto port = peer.middleman().open(0, "127.0.0.1");
  ASSERT_TRUE(port) << peer.render(port.error());
  const auto nid = actors::node_connect(sys, "127.0.0.1", *port, std::chrono::seconds(20));
  ASSERT_TRUE(nid) << sys.render(nid.error());
  EXPECT_EQ(*nid, peer.node());
}
