// tests/actors/protocol_test.cpp -- message serialization round trips, and the protocols of the
// buffer (admission by max_staleness, de-duplication, learner shards) and of weight-sync
// (in-process fan-out, adoption accounting, a failed cross-process transfer), the learners' stop (one
// checkpoint over ranks, a failed one named) with explicit message ordering, and
// the controller's staleness window on CAF's deterministic test coordinator: the test is the
// peer of the actor under test and drives it one message at a time.
#include <gtest/gtest.h>

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "actors/actors.hpp"
#include "models/checkpoint.hpp"
#include "models/generate.hpp"
#include "models/rl/loop.hpp"

using namespace fp8rl;
namespace fs = std::filesystem;

namespace {

struct test_config : caf::actor_system_config {
  test_config() { msg::messages_register(*this); set("logger.console", caf::atom("none")); }
};

// A tiny model checkpoint with the built-in tokenizer (what actors load their env from), removed
// when the process exits.
struct temp_dir_remover {
  fs::path dir;
  ~temp_dir_remover() {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
};
std::string init_dir() {
  static temp_dir_remover remover;
  static const std::string dir = [] {
    const fs::path d = fs::temp_directory_path() / ("fp8rl_proto_" + std::to_string(::getpid()));
    remover.dir = d;
    auto tok = models::char_tokenizer_make(models::arithmetic_alphabet());
    models::model_config c;
    c.hidden_size = 128; c.intermediate_size = 256; c.num_hidden_layers = 1; c.num_attention_heads = 4;
    c.num_key_value_heads = 2; c.head_dim = 32; c.vocab_size = tok->vocab_size(); c.max_position_embeddings = 32;
    models::checkpoint ck;
    ck.params = models::model_params_init(c, 1);
    models::checkpoint_save(d.string(), ck);
    models::char_tokenizer_save(d.string(), models::arithmetic_alphabet());
    return d.string();
  }();
  return dir;
}

// A run's env (groups of 2) starting at weight version `start` (a resume), generation under `generation`.
std::shared_ptr<const actors::actor_env> env_with(int64_t staleness, int64_t prompts, uint64_t start = 0,
                                                  const std::string& generation = actors::run_config{}.generation) {
  actors::run_config r;
  r.max_staleness = staleness;
  r.prompts_per_step = prompts;
  r.group_size = 2;
  r.log_level = "off";
  r.generation = generation;
  return actors::env_make(r, "test", fs::temp_directory_path().string(), init_dir(), start);
}

// A rollout's peers: controller, weight-sync and reward (test stand-ins of any actor handle type).
template <class Ctl, class Ws, class Reward>
msg::peers_msg rollout_peers(const Ctl& ctl, const Ws& ws, const Reward& reward) {
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  p.weight_sync = caf::actor_cast<msg::weight_sync_actor>(ws);
  p.reward = caf::actor_cast<msg::reward_actor>(reward);
  return p;
}
// Step 1's prompt 3, "12+3=" (answer 15), in groups of the env's size.
msg::work_msg work_12_plus_3(const actors::actor_env& env) {
  msg::work_msg w;
  w.step = 1;
  w.prompt_id = 3;
  w.prompt = "12+3=";
  w.answer = "15";
  w.group_size = static_cast<int32_t>(env.cfg.group_size);
  return w;
}

// A group sampled under the default recipe's generation policy.
msg::group_msg group(uint64_t step, uint64_t pid, uint64_t version) {
  msg::group_msg g;
  g.step = step;
  g.prompt_id = pid;
  g.rollout = "rollout0";
  g.policy = actors::recipe_rl_config(actors::run_config{}).gen_policy.fingerprint();
  for (int j = 0; j < 2; ++j) {
    models::rl_sample s;
    s.prompt_id = pid;
    s.group_index = j;
    s.prompt = {1, 4, 5};
    s.response = {6, 7, 2};
    s.gen_logprobs = {-0.5f, -0.25f, -0.125f};
    s.weight_version = {version, version, version};
    s.scale_version = s.weight_version;
    s.oldest_kv_version = s.weight_version;
    s.oldest_kv_scale_version = s.weight_version;
    g.samples.push_back(s);
  }
  return g;
}

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

namespace {
// peers naming the controller and two rollouts "rollout0", "rollout1" (scoped actors standing in)
msg::peers_msg two_rollout_peers(caf::scoped_actor& ctl, caf::scoped_actor& r0, caf::scoped_actor& r1) {
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  p.rollouts = {caf::actor_cast<msg::rollout_actor>(r0), caf::actor_cast<msg::rollout_actor>(r1)};
  p.rollout_names = {"rollout0", "rollout1"};
  return p;
}
// the test model's fp8 bundle, weight and scale version 1
std::shared_ptr<const quant::weight_bundle> fp8_bundle_v1() {
  return std::make_shared<const quant::weight_bundle>(
      models::bundle_from_params(models::model_load(init_dir()), models::precision_policy::named("fp8"), 1, 1, nullptr));
}

// Weight-sync told of two rollouts (scoped actors r0, r1 standing in) and its controller ctl.
class WeightSyncWithTwoRollouts : public ::testing::Test {
 protected:
  void SetUp() override { ctl->send(ws, two_rollout_peers(ctl, r0, r1)); }
  void TearDown() override { ctl->send_exit(ws, caf::exit_reason::user_shutdown); }
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys}, r0{sys}, r1{sys};
  msg::weight_sync_actor ws = actors::spawn_weight_sync(sys, env_with(1, 2));
};
}  // namespace

TEST_F(WeightSyncWithTwoRollouts, FansOutInProcessAndReportsFullAdoption) {
  auto b = fp8_bundle_v1();
  ctl->send(ws, msg::bundle_msg{{}, b});
  for (auto* r : {&r0, &r1})
    (*r)->receive([&](msg::bundle_msg& m) { EXPECT_EQ(m.bundle.get(), b.get()); },  // zero copy: the same object
                  caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no bundle"; });
  ctl->send(ws, msg::adopted_msg{{}, "rollout0", 1, 1, ""});
  // one adoption is not the version synced: the controller's staleness gate counts on every live
  // rollout holding it (a status answered after the adoption: a report it caused would be here)
  ctl->request(ws, std::chrono::seconds(5), msg::status_atom::value)
      .receive([](msg::metrics_t&) {}, [&](caf::error& e) { FAIL() << sys.render(e); });
  ctl->receive([&](msg::sync_report&) { FAIL() << "reported before rollout1 adopted"; },
               caf::after(std::chrono::seconds(0)) >> [] {});
  ctl->send(ws, msg::adopted_msg{{}, "rollout1", 1, 1, ""});
  ctl->receive([&](msg::sync_report& s) {
    EXPECT_EQ(s.version, 1u);
    EXPECT_GE(s.latency_s, 0.0);  // publish -> the last adoption heard, on weight-sync's clock
    // within the two receives above (5 s each at most): not a time since the epoch (~1.8e9 s)
    // nor from an unset publish time
    EXPECT_LT(s.latency_s, 10.0);
    EXPECT_FALSE(s.cross_process);
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no sync_report"; });
}

// The registry holds the last max_staleness + 1 bundles (a rollout may still ask for them), not
// every one published (each is a whole model's weights).
TEST_F(WeightSyncWithTwoRollouts, KeepsTheLastMaxStalenessPlusOneBundles) {
  const auto params = models::model_load(init_dir());
  for (uint64_t v = 1; v <= 4; ++v)
    ctl->send(ws, msg::bundle_msg{{}, std::make_shared<const quant::weight_bundle>(models::bundle_from_params(
                                          params, models::precision_policy::named("fp8"), v, v, nullptr))});
  ctl->request(ws, std::chrono::seconds(5), msg::status_atom::value)
      .receive([](msg::metrics_t& m) { EXPECT_EQ(m.at("versions_held"), 2.0); }, [&](caf::error& e) { FAIL() << sys.render(e); });
}

// Each version is published once, in order: a bundle for v1 again, or for an older version, is
// a fault told to the controller (it fails the run naming it) and goes to no rollout; the
// bundle the rollouts hold stays v2's.
TEST_F(WeightSyncWithTwoRollouts, RefusesAVersionPublishedAgainOrOutOfOrder) {
  const auto b1 = fp8_bundle_v1();
  auto b2 = std::make_shared<quant::weight_bundle>(*b1);
  b2->weight_version = b2->snapshot.weight_version = 2;
  b2->snapshot.scale_version = 2;
  ctl->send(ws, msg::bundle_msg{{}, b1});
  ctl->send(ws, msg::bundle_msg{{}, b1});
  ctl->receive([](std::string& who, std::string& why) {
    EXPECT_EQ(who, "weight_sync");
    EXPECT_EQ(why, "bundle v1 arrived after v1: each version is published once, in order (not sent to the rollouts)");
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "v1 published twice was not told"; });
  ctl->send(ws, msg::bundle_msg{{}, b2});
  ctl->send(ws, msg::bundle_msg{{}, b1});
  ctl->receive([](std::string&, std::string& why) {
    EXPECT_EQ(why, "bundle v1 arrived after v2: each version is published once, in order (not sent to the rollouts)");
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "v1 after v2 was not told"; });
  for (auto* r : {&r0, &r1}) {
    std::vector<uint64_t> got;
    for (int i = 0; i < 3; ++i)
      (*r)->receive([&](msg::bundle_msg& m) { got.push_back(m.bundle->weight_version); }, caf::after(std::chrono::milliseconds(200)) >> [] {});
    EXPECT_EQ(got, (std::vector<uint64_t>{1, 2}));
  }
}

// A rollout refusing a bundle is told to the controller, naming the rollout and why (its run
// waits on that version's report otherwise); a second peers_msg reports nothing twice; a rollout
// that left (the peers no longer name it) holds up no version's report; the latency is the time
// from publishing to the last adoption.
TEST_F(WeightSyncWithTwoRollouts, ReportsRefusalsOnceAndForgetsRolloutsThatLeft) {
  ctl->send(ws, msg::bundle_msg{{}, fp8_bundle_v1()});
  ctl->send(ws, msg::adopted_msg{{}, "rollout1", 1, 1, "a scale is missing"});
  ctl->receive([](std::string& who, std::string& why) {
    EXPECT_EQ(who, "rollout1");
    EXPECT_EQ(why, "refused bundle v1: a scale is missing");
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "the refusal was not told"; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ctl->send(ws, msg::adopted_msg{{}, "rollout0", 1, 1, ""});
  msg::peers_msg only0 = two_rollout_peers(ctl, r0, r1);
  only0.rollouts.pop_back(), only0.rollout_names.pop_back();  // rollout1 left
  ctl->send(ws, only0);
  ctl->receive([&](msg::sync_report& s) {
    EXPECT_EQ(s.version, 1u);
    EXPECT_GE(s.latency_s, 0.02);  // published before the 20 ms wait, adopted after it
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "v1 waited on a rollout that left"; });
  ctl->send(ws, only0);  // the same peers again: v1 is not reported twice
  ctl->request(ws, std::chrono::seconds(5), msg::status_atom::value)
      .receive([](msg::metrics_t& m) { EXPECT_EQ(m.at("refused"), 1.0); }, [&](caf::error& e) { FAIL() << sys.render(e); });
  ctl->receive([&](msg::sync_report& s) { FAIL() << "v" << s.version << " reported twice"; },
               caf::after(std::chrono::seconds(0)) >> [] {});
}

// A bundle each rollout replaced before a step ran under it (adopted_msg `superseded`) is done with
// there, not adopted: v1 is reported with no adoption latency (NaN); it counted as adopted.
TEST_F(WeightSyncWithTwoRollouts, CountsASupersededBundleAsNotAdopted) {
  ctl->send(ws, msg::bundle_msg{{}, fp8_bundle_v1()});
  for (const char* r : {"rollout0", "rollout1"}) {
    msg::adopted_msg a{{}, r, 1, 1, ""};
    a.superseded = true;
    ctl->send(ws, a);
  }
  ctl->receive([&](msg::sync_report& s) {
    EXPECT_EQ(s.version, 1u);
    EXPECT_TRUE(std::isnan(s.latency_s)) << s.latency_s;
  }, caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no sync_report"; });
}

// A rollout restarted under its old name (one peers_msg names the new actor) gets only the newest
// version: it is no longer waited for on the older ones, which are reported; v1 waited for the old
// rollout0 forever and was never reported.
TEST_F(WeightSyncWithTwoRollouts, StopsWaitingOnOlderVersionsForARestartedRollout) {
  caf::scoped_actor r0_again{sys};
  const auto b1 = fp8_bundle_v1();
  auto b2 = std::make_shared<quant::weight_bundle>(*b1);
  b2->weight_version = b2->snapshot.weight_version = 2;
  b2->snapshot.scale_version = 2;
  ctl->send(ws, msg::bundle_msg{{}, b1});
  ctl->send(ws, msg::bundle_msg{{}, b2});
  for (uint64_t v : {1, 2}) ctl->send(ws, msg::adopted_msg{{}, "rollout1", v, v, ""});
  ctl->send(ws, two_rollout_peers(ctl, r0_again, r1));  // rollout0 restarted before it adopted anything
  r0_again->receive([&](msg::bundle_msg& m) { EXPECT_EQ(m.bundle->weight_version, 2u); },
                    caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no bundle for the restarted rollout"; });
  ctl->send(ws, msg::adopted_msg{{}, "rollout0", 2, 2, ""});
  std::map<uint64_t, double> latency;
  for (int i = 0; i < 2; ++i)
    ctl->receive([&](msg::sync_report& s) { latency[s.version] = s.latency_s; },
                 caf::after(std::chrono::seconds(5)) >> [] { ADD_FAILURE() << "a version was never reported"; });
  ASSERT_EQ(latency.size(), 2u);
  EXPECT_FALSE(std::isnan(latency.at(1)));  // rollout1 adopted it
  EXPECT_FALSE(std::isnan(latency.at(2)));
}

// CAF orders messages per sender only: a bundle (from calibration) can reach weight-sync before
// the controller's first peers_msg. It went to no rollout and was reported synced at once (the
// run then waited on rollouts without weights); now the rollouts it names get it, and the
// version is reported once both adopted it.
TEST(Protocol, WeightSyncSendsABundleThatCameBeforeItsPeers) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys}, r0{sys}, r1{sys};
  auto ws = actors::spawn_weight_sync(sys, env_with(1, 2));
  auto b = fp8_bundle_v1();
  ctl->send(ws, msg::bundle_msg{{}, b});
  ctl->send(ws, two_rollout_peers(ctl, r0, r1));
  for (auto* r : {&r0, &r1})
    (*r)->receive([&](msg::bundle_msg& m) { EXPECT_EQ(m.bundle.get(), b.get()); },
                  caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no bundle"; });
  ctl->send(ws, msg::adopted_msg{{}, "rollout0", 1, 1, ""});
  // weight-sync handles its messages in order and CAF keeps one sender's messages in order: once
  // it has answered a status request sent after the adoption, a report that adoption caused is
  // already in ctl's mailbox (deterministic; a 200 ms wait could miss a slow one)
  ctl->request(ws, std::chrono::seconds(5), msg::status_atom::value)
      .receive([](msg::metrics_t&) {}, [&](caf::error& e) { FAIL() << sys.render(e); });
  ctl->receive([&](msg::sync_report&) { FAIL() << "reported before rollout1 adopted"; },
               caf::after(std::chrono::seconds(0)) >> [] {});
  ctl->send(ws, msg::adopted_msg{{}, "rollout1", 1, 1, ""});
  ctl->receive([&](msg::sync_report& s) { EXPECT_EQ(s.version, 1u); },
               caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no sync_report"; });
  ctl->send_exit(ws, caf::exit_reason::user_shutdown);
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

// Learner 0's weights can reach calibration before the controller's first peers_msg: the bundle
// and the step report went to unset handles (CAF drops those sends) and no weights ever existed;
// now the weights wait for the peers.
TEST(Protocol, CalibrationKeepsWeightsThatCameBeforeItsPeers) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys}, ws{sys};
  auto cal = actors::spawn_calibration(sys, env_with(1, 2), actors::device_spec::parse("cpu:1", "test"));
  const auto params = models::model_load(init_dir());
  msg::params_msg pm;
  pm.version = 1;
  pm.params = std::make_shared<const std::vector<float>>(params.data);
  pm.calib = {{1, 2, 3, 4}, {5, 6, 7}};
  ctl->send(cal, pm);
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  p.weight_sync = caf::actor_cast<msg::weight_sync_actor>(ws);
  ctl->send(cal, p);
  ws->receive([&](msg::bundle_msg& m) {
    EXPECT_EQ(m.bundle->weight_version, 1u);
    EXPECT_EQ(m.bundle->snapshot.weight_version, 1u);
    EXPECT_EQ(m.bundle->snapshot.scale_version, 1u);  // the scales calibrated for these weights
  },
              caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no bundle"; });
  ctl->receive([&](msg::calib_report& r) {
    EXPECT_EQ(r.version, 1u);
    EXPECT_GT(r.seconds, 0.0);
    EXPECT_LT(r.worst_block_flushed, models::kFlushWarnFraction);  // initial weights: no outlier
  },
               caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no calib_report"; });
  // an outlier weight: its block's scale sends the block's other weights to zero, and the report
  // says so (the calibration actor also warns naming the block: models::flush_warn)
  models::model_params with = params;
  with.get("model.layers.0.mlp.down_proj.weight")[0] = 1e6f;
  pm.version = 2;
  pm.params = std::make_shared<const std::vector<float>>(with.data);
  ctl->send(cal, pm);
  ws->receive([](msg::bundle_msg& m) { EXPECT_EQ(m.bundle->weight_version, 2u); },
              caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no bundle v2"; });
  ctl->receive([&](msg::calib_report& r) {
    EXPECT_EQ(r.version, 2u);
    EXPECT_GT(r.worst_block_flushed, 0.9);  // weights ~0.02 against a 2^-10 * 1e6 / 448 threshold
    EXPECT_GT(r.weights_flushed, 100);
  },
               caf::after(std::chrono::seconds(5)) >> [] { FAIL() << "no calib_report v2"; });
  // weights that cannot be quantized (a NaN) end the run naming why, and no bundle goes out (the
  // run waited for a version that never came)
  with.get("model.layers.0.mlp.up_proj.weight")[3] = std::nanf("");
  pm.version = 3;
  pm.params = std::make_shared<const std::vector<float>>(with.data);
  ctl->send(cal, pm);
  ctl->receive([&](std::string& who, std::string& what) {
    EXPECT_EQ(who, "calibration");
    EXPECT_NE(what.find("tensor 'model.layers.0.mlp.up_proj.weight': 128x128 block (0, 0) holds 1 non-finite value; refusing to quantize"),
              std::string::npos) << what;
  }, caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "the failed calibration was not told"; });
  // the next weights' bundle is the next to reach weight-sync (calibration's sends to it keep their
  // order): none of v3 went out before it
  with.get("model.layers.0.mlp.up_proj.weight")[3] = 0.0f;
  pm.version = 4;
  pm.params = std::make_shared<const std::vector<float>>(with.data);
  ctl->send(cal, pm);
  ws->receive([](msg::bundle_msg& m) { EXPECT_EQ(m.bundle->weight_version, 4u) << "a bundle of the failed v3 went out"; },
              caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no bundle v4"; });
  ctl->send_exit(cal, caf::exit_reason::user_shutdown);
}

// With an FP8 KV cache, a bundle's Q/K/V scales are calibrated on the batch its params_msg carries
// (make_bundle's for that batch: another batch gives other scales).
TEST(Protocol, CalibrationScalesTheKvCacheOnTheBatchItIsSent) {
  test_config cfg;
  caf::actor_system sys{cfg};
  caf::scoped_actor ctl{sys}, ws{sys};
  const auto env = env_with(1, 2, 0, "fp8-kv");
  auto cal = actors::spawn_calibration(sys, env, actors::device_spec::parse("cpu:1", "test"));
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  p.weight_sync = caf::actor_cast<msg::weight_sync_actor>(ws);
  ctl->send(cal, p);
  models::rl_state st;
  st.params = models::model_load(init_dir());
  const std::vector<std::vector<int32_t>> batches[2] = {{{1, 4, 5, 13, 6, 15}, {1, 9, 9, 14, 7, 15}},
                                                        {{1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3}}};
  std::vector<float> k_scale[2];
  for (uint64_t v : {1, 2}) {
    msg::params_msg pm;
    pm.version = v;
    pm.params = std::make_shared<const std::vector<float>>(st.params.data);
    pm.calib = batches[v - 1];
    ctl->send(cal, pm);
    std::vector<models::token_batch> calib(1);
    for (const auto& q : pm.calib) calib[0].add(q);
    st.version = v;
    const auto want = models::make_bundle(st, env->rl, calib, v);
    ASSERT_TRUE(want->snapshot.has_attention_scales());
    ws->receive([&](msg::bundle_msg& m) {
      EXPECT_EQ(m.bundle->snapshot.q_scale, want->snapshot.q_scale) << "v" << v;
      EXPECT_EQ(m.bundle->snapshot.k_scale, want->snapshot.k_scale) << "v" << v;
      EXPECT_EQ(m.bundle->snapshot.v_scale, want->snapshot.v_scale) << "v" << v;
      k_scale[v - 1] = m.bundle->snapshot.k_scale;
    }, caf::after(std::chrono::seconds(30)) >> [] { FAIL() << "no bundle"; });
  }
  EXPECT_NE(k_scale[0], k_scale[1]);
  ctl->send_exit(cal, caf::exit_reason::user_shutdown);
}

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

namespace {
// `fake`, spawned in `remote`, as a rollout of another node: published on a loopback port and
// reached from `sys` through its middleman, so weight-sync sends it bundles as chunks.
msg::rollout_actor remote_rollout(caf::actor_system& sys, caf::actor_system& remote, const caf::actor& fake) {
  auto port = remote.middleman().publish(fake, 0, "127.0.0.1");
  if (!port) throw std::runtime_error(remote.render(port.error()));
  auto proxy = sys.middleman().remote_actor("127.0.0.1", *port);
  if (!proxy) throw std::runtime_error(sys.render(proxy.error()));
  return caf::actor_cast<msg::rollout_actor>(*proxy);
}
// Peers of weight-sync: the controller ctl and one rollout, "rollout0".
msg::peers_msg one_rollout_peers(caf::scoped_actor& ctl, const msg::rollout_actor& r) {
  msg::peers_msg p;
  p.controller = caf::actor_cast<msg::controller_actor>(ctl);
  p.rollouts = {r};
  p.rollout_names = {"rollout0"};
  return p;
}
}  // namespace

// A live rollout in another process that cannot take its weights (a chunk answered with an
// error) would wait for them forever: weight-sync reports the failure to the controller, naming
// the version, the rollout and the cause. Two actor systems in this process, joined over
// loopback, make the rollout remote, so the bundle travels as chunks.
TEST(Protocol, WeightSyncReportsAFailedTransferToALiveRollout) {
  test_config cfg1, cfg2;
  cfg1.load<caf::io::middleman>();
  cfg2.load<caf::io::middleman>();
  caf::actor_system sys{cfg1}, remote{cfg2};
  // (an argument for the spawn: CAF 0.17 dereferences a missing argument tuple; actors.hpp)
  auto fake = remote.spawn([](caf::event_based_actor*, std::string why) -> caf::behavior {
    return {[why](msg::bundle_chunk& c) -> caf::result<msg::chunk_ack> {
      return caf::make_error(caf::sec::runtime_error, why + std::to_string(c.seq));
    }};
  }, std::string("no space left for chunk "));
  const msg::rollout_actor ro = remote_rollout(sys, remote, fake);
  ASSERT_NE(ro.node(), sys.node());
  caf::scoped_actor ctl{sys};
  auto ws = actors::spawn_weight_sync(sys, env_with(1, 2));
  ctl->send(ws, one_rollout_peers(ctl, ro));
  const auto params = models::model_load(init_dir());
  auto b = std::make_shared<const quant::weight_bundle>(models::bundle_from_params(params, models::precision_policy::named("fp8"), 1, 1, nullptr));
  ctl->send(ws, msg::bundle_msg{{}, b});
  ctl->receive([&](std::string& who, std::string& what) {
    EXPECT_EQ(who, "weight_sync");
    EXPECT_NE(what.find("bundle v1 to rollout0 failed"), std::string::npos) << what;
    EXPECT_NE(what.find("no space left for chunk 0"), std::string::npos) << what;
  }, caf::after(std::chrono::seconds(20)) >> [] { FAIL() << "the failed transfer was not reported"; });
  ctl->send_exit(ws, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(fake, caf::exit_reason::user_shutdown);
}

// A bundle larger than a chunk reaches a remote rollout whole: chunks in order, each within the
// total (one past it was sent under a mutant), the window of requests refilled as acks come, the
// bytes deserializing to the bundle sent; its report is cross-process with the transfer's time
// (the rollout acks its last chunk before it says it adopted, as a real one does).
TEST(Protocol, WeightSyncSendsALargeBundleInOrderedChunks) {
  test_config cfg1, cfg2;
  cfg1.load<caf::io::middleman>();
  cfg2.load<caf::io::middleman>();
  caf::actor_system sys{cfg1}, remote{cfg2};
  const auto params = models::model_load(init_dir());
  auto b = std::make_shared<const quant::weight_bundle>(models::bundle_from_params(params, models::precision_policy::named("fp8"), 1, 1, nullptr));
  std::vector<char> wire;
  caf::binary_serializer sink(sys, wire);
  auto w = msg::bundle_to_wire(*b);
  ASSERT_FALSE(sink(w));
  const size_t chunk = wire.size() / 10 + 1;  // 10 chunks, the last short: beyond the window of 4
  const uint32_t total = static_cast<uint32_t>((wire.size() + chunk - 1) / chunk);
  ASSERT_GT(total, actors::kBundleWindow + 1);
  auto fake = remote.spawn([](caf::event_based_actor* self, uint32_t total) -> caf::behavior {
    auto got = std::make_shared<std::vector<char>>();
    auto next = std::make_shared<uint32_t>(0);
    auto ws = std::make_shared<msg::weight_sync_actor>();
    return {
        [ws](msg::peers_msg& p) { *ws = p.weight_sync; },
        [self, total, got, next, ws](msg::bundle_chunk& c) -> caf::result<msg::chunk_ack> {
          if (c.seq != *next || c.total != total || c.seq >= c.total)
            return caf::make_error(caf::sec::invalid_argument, "chunk " + std::to_string(c.seq) + " of " + std::to_string(c.total) +
                                                                   " where " + std::to_string(*next) + " of " + std::to_string(total) + " was due");
          ++*next;
          got->insert(got->end(), c.bytes.begin(), c.bytes.end());
          auto rp = self->make_response_promise<msg::chunk_ack>();
          rp.deliver(msg::chunk_ack{{}, c.version, c.seq, false});
          if (c.seq + 1 == total) {
            msg::bundle_wire w;
            caf::binary_deserializer src(self->system(), *got);
            std::string error = src(w) ? "does not deserialize" : "";
            if (error.empty() && msg::bundle_from_wire(std::move(w)).weight_version != c.version) error = "another version";
            self->send(*ws, msg::adopted_msg{{}, "rollout0", c.version, c.version, error});
          }
          return rp;
        }};
  }, total);
  const msg::rollout_actor ro = remote_rollout(sys, remote, fake);
  caf::scoped_actor ctl{sys};
  auto ws = actors::spawn_weight_sync(sys, env_with(1, 2), chunk);
  ctl->send(ws, one_rollout_peers(ctl, ro));
  msg::peers_msg to_fake;
  to_fake.weight_sync = ws;
  ctl->send(ro, to_fake);
  ctl->send(ws, msg::bundle_msg{{}, b});
  ctl->receive([&](msg::sync_report& r) {
    EXPECT_EQ(r.version, 1u);
    EXPECT_TRUE(r.cross_process);
    EXPECT_GT(r.transfer_s, 0.0);
    EXPECT_GE(r.latency_s, r.transfer_s);  // adopted after its last chunk was acked
  },
               [&](std::string& who, std::string& what) { FAIL() << who << ": " << what; },
               caf::after(std::chrono::seconds(20)) >> [] { FAIL() << "no sync_report"; });
  ctl->send_exit(ws, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(fake, caf::exit_reason::user_shutdown);
}

// A version a remote rollout answers "superseded" (it took a newer one first) is neither a failure
// nor waited for: weight-sync stops sending it and reports it without a latency (NaN: no rollout
// adopted it), and the version the rollout adopted with one.
TEST(Protocol, WeightSyncStopsASupersededTransfer) {
  test_config cfg1, cfg2;
  cfg1.load<caf::io::middleman>();
  cfg2.load<caf::io::middleman>();
  caf::actor_system sys{cfg1}, remote{cfg2};
  auto fake = remote.spawn([](caf::event_based_actor*, uint64_t superseded) -> caf::behavior {
    return {[superseded](msg::bundle_chunk& c) { return msg::chunk_ack{{}, c.version, c.seq, c.version == superseded}; }};
  }, uint64_t{1});
  caf::scoped_actor ctl{sys};
  auto ws = actors::spawn_weight_sync(sys, env_with(1, 2));
  ctl->send(ws, one_rollout_peers(ctl, remote_rollout(sys, remote, fake)));
  const auto params = models::model_load(init_dir());
  for (uint64_t v : {1, 2})
    ctl->send(ws, msg::bundle_msg{{}, std::make_shared<const quant::weight_bundle>(models::bundle_from_params(
                                          params, models::precision_policy::named("fp8"), v, v, nullptr))});
  ctl->send(ws, msg::adopted_msg{{}, "rollout0", 2, 2, ""});
  std::map<uint64_t, double> latency;  // the reports, in either order (v1's answers cross loopback)
  for (int i = 0; i < 2; ++i)
    ctl->receive([&](msg::sync_report& r) {
                   EXPECT_TRUE(latency.emplace(r.version, r.latency_s).second) << r.version;
                   EXPECT_TRUE(r.cross_process);
                 },
                 [&](std::string& who, std::string& what) { FAIL() << who << ": " << what; },
                 caf::after(std::chrono::seconds(20)) >> [] { FAIL() << "a sync_report missing"; });
  ASSERT_EQ(latency.size(), 2u);
  EXPECT_TRUE(std::isnan(latency.at(1)));
  EXPECT_GE(latency.at(2), 0.0);
  ctl->send_exit(ws, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(fake, caf::exit_reason::user_shutdown);
}

namespace {
// An actor system on CAF's deterministic test coordinator: every message runs on this thread,
// in an order the test drives (sched.run()), with no timing involved.
struct coordinated_config : caf::actor_system_config {
  coordinated_config() {
    msg::messages_register(*this);
    set("scheduler.policy", caf::atom("testing"));
    set("logger.console", caf::atom("none"));
    set("logger.file-verbosity", caf::atom("quiet"));
  }
};
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
class ControllerOnTestCoordinator : public ::testing::Test {
 protected:
  coordinated_config cfg;
  caf::actor_system sys{cfg};
  caf::scheduler::test_coordinator& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());
  caf::scoped_actor self{sys, true};
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

// Every rollout lost outside a stop fails the run (it would wait forever for samples).
TEST_F(ControllerOnTestCoordinator, EveryRolloutLostFailsTheRun) {
  wire(0);
  sync(0);
  self->send_exit(r0, caf::exit_reason::kill);
  sched.run();
  EXPECT_EQ(done, -1);
  self->send_exit(r1, caf::exit_reason::kill);
  sched.run();
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

// A rollout (rollout0 of env_with(1, 2)) on the test coordinator, whose peers are one recorder of
// the adoptions and groups it sends; bundle(v) is the initial weights as version v.
class RolloutOnTestCoordinator : public ::testing::Test {
 protected:
  coordinated_config cfg;
  caf::actor_system sys{cfg};
  caf::scheduler::test_coordinator& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());
  caf::scoped_actor self{sys, true};
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
  coordinated_config cfg;
  caf::actor_system sys{cfg};
  auto& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());
  caf::scoped_actor self{sys, true};
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
