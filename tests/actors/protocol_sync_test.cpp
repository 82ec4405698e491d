// tests/actors/protocol_sync_test.cpp -- the weight-sync actor (in-process fan-out, adoption
// accounting, the bundles it keeps, versions in order, refusals, restarted rollouts, chunked
// transfers to a rollout in another actor system over loopback, failed and superseded transfers)
// and the calibration actor (weights before its peers, KV-cache scales from the batch it is sent).
#include "tests/actors/protocol_util.hpp"

using namespace fp8rl;
using namespace fp8rl::proto_test;

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

namespace {
// Two actor systems in this process with their middlemen: `remote` holds a stand-in rollout that
// `sys` reaches over loopback (remote_rollout).
struct two_systems {
  test_config cfg1, cfg2;
  caf::actor_system sys{cfg1.load<caf::io::middleman>()}, remote{cfg2.load<caf::io::middleman>()};
};
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
  two_systems both;
  caf::actor_system &sys = both.sys, &remote = both.remote;
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
  two_systems both;
  caf::actor_system &sys = both.sys, &remote = both.remote;
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
  two_systems both;
  caf::actor_system &sys = both.sys, &remote = both.remote;
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
