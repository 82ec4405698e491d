// messages/interfaces.hpp -- the typed actor interfaces of fp8rl (CAF 0.17 `replies_to` form) and
// the wiring message that tells every actor its peers.
// defines: rollout_actor, reward_actor, buffer_actor, learner_actor, calibration_actor,
//          weight_sync_actor, controller_actor, node_start, node_actors, node_agent_actor, peers_msg,
//          admitted_msg, sync_report, calib_report
//
// Data flow (architecture.md §1): controller -work-> rollout -group-> reward -group-> buffer
// <-batch- learner -params-> calibration -bundle-> weight_sync -bundle-> rollout -adopted->
// weight_sync; learner -step_report-> controller; calibration -calib_report-> controller;
// weight_sync -sync_report-> controller; buffer -admitted-> controller.
#pragma once
#include "messages/wire.hpp"

namespace fp8rl::msg {

struct peers_msg;

// A group reached the buffer (accounting: the controller stops tracking it as in flight).
struct admitted_msg {
  trace_ctx trace;
  uint64_t step = 0, prompt_id = 0;
  bool dropped = false;  // too stale or duplicate
  std::string reason;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, admitted_msg& x) {
  return f(caf::meta::type_name("admitted_msg"), x.trace, x.step, x.prompt_id, x.dropped, x.reason);
}

// A bundle was adopted by every live rollout (weight-sync -> controller), for timing.
struct sync_report {
  trace_ctx trace;
  uint64_t version = 0;
  double latency_s = 0, bytes = 0;  // publish -> adopted by every live rollout; payload bytes
  bool cross_process = false;
  double transfer_s = 0;  // cross-process: first chunk sent -> last chunk acked (slowest rollout)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sync_report& x) {
  return f(caf::meta::type_name("sync_report"), x.trace, x.version, x.latency_s, x.bytes, x.cross_process, x.transfer_s);
}

// A bundle was calibrated (calibration -> controller): the next metrics line carries
// calibration_s, calibration_version and the flush metrics (models::flush_metrics_add).
struct calib_report {
  trace_ctx trace;
  uint64_t version = 0;  // the weight_version calibrated
  double seconds = 0;    // params received -> bundle made
  int64_t weights_flushed = 0;        // nonzero FP8 weights quantization sent to zero
  double worst_block_flushed = 0;     // the largest share of its nonzero weights one block lost
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, calib_report& x) {
  return f(caf::meta::type_name("calib_report"), x.trace, x.version, x.seconds, x.weights_flushed, x.worst_block_flushed);
}

using metrics_t = std::map<std::string, double>;

using rollout_actor = caf::typed_actor<
    caf::reacts_to<peers_msg>,
    caf::reacts_to<work_msg>,                                   // a prompt group to sample
    caf::reacts_to<bundle_msg>,                                 // weights (adopted between steps)
    caf::replies_to<bundle_chunk>::with<chunk_ack>,             // cross-process bundle piece
    caf::reacts_to<step_atom>,                                  // internal: one engine step
    caf::replies_to<status_atom>::with<metrics_t>>;

using reward_actor = caf::typed_actor<caf::reacts_to<peers_msg>, caf::reacts_to<group_msg>>;

using buffer_actor = caf::typed_actor<
    caf::reacts_to<peers_msg>,
    caf::reacts_to<group_msg>,
    // (step, rank, world, learner_version) -> this learner's shard of the step's batch
    caf::replies_to<batch_atom, uint64_t, int32_t, int32_t, uint64_t>::with<batch_msg>,
    // stop handing out batches -> the stop step: the first step no rank was given; requests for it
    // and later ones are answered with a batch_msg whose `stop` is set
    caf::replies_to<stop_atom>::with<uint64_t>>;

using learner_actor = caf::typed_actor<caf::reacts_to<peers_msg>, caf::reacts_to<start_atom, uint64_t>>;

using calibration_actor = caf::typed_actor<caf::reacts_to<peers_msg>, caf::reacts_to<params_msg>>;

using weight_sync_actor = caf::typed_actor<
    caf::reacts_to<peers_msg>,
    caf::reacts_to<bundle_msg>,
    caf::reacts_to<adopted_msg>,
    caf::replies_to<status_atom>::with<metrics_t>>;

using controller_actor = caf::typed_actor<
    caf::reacts_to<peers_msg, std::vector<caf::actor>, std::vector<std::string>>,  // wiring + remote node agents and their node names: go
    caf::reacts_to<step_report>,
    caf::reacts_to<admitted_msg>,
    caf::reacts_to<sync_report>,
    caf::reacts_to<calib_report>,
    caf::reacts_to<std::string, std::string>,   // (component, fatal error) from any actor
    caf::reacts_to<stop_atom, std::string, int32_t>,  // (why, exit code): stop after the step in progress
    caf::reacts_to<stopped_atom, uint64_t, std::string>>;  // learner0 stopped at (version, checkpoint written or "")

// What a node needs to start its actors (controller -> node agent). The recipe and the topology
// travel in their canonical JSON forms (actors/recipe.hpp recipe_to_json, actors/topology.hpp
// topology_to_json) and are validated again on the node (their from_json forms validate).
struct node_start {
  std::string recipe_json, topology_json, node, run_dir, init_dir, run_id;
  uint64_t start_version = 0, start_cursor = 0;  // actors/env.hpp run_start
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_start& x) {
  return f(caf::meta::type_name("node_start"), x.recipe_json, x.topology_json, x.node, x.run_dir, x.init_dir, x.run_id,
           x.start_version, x.start_cursor);
}

// The actors one node spawned, by role (a node agent's answer; the controller's node builds one
// too). Handles of singleton roles the node does not hold are invalid.
struct node_actors {
  buffer_actor buffer;
  reward_actor reward;
  weight_sync_actor weight_sync;
  calibration_actor calibration;
  std::vector<learner_actor> learners;
  std::vector<rollout_actor> rollouts;
  std::vector<std::string> rollout_names;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_actors& x) {
  return f(caf::meta::type_name("node_actors"), x.buffer, x.reward, x.weight_sync, x.calibration, x.learners, x.rollouts,
           x.rollout_names);
}

// The per-process agent a controller spawns on every remote node: it spawns that node's actors
// and answers their handles, and stops them when told or when the controller dies.
using node_agent_actor = caf::typed_actor<
    // (what to start, the controller to watch) -> the node's actors
    caf::replies_to<start_atom, node_start, controller_actor>::with<node_actors>,
    caf::reacts_to<stop_atom>>;

// Every actor of the run (all nodes' actors merged) and the controller: the wiring message.
struct peers_msg : node_actors {
  controller_actor controller;
  trace_ctx trace;  // stamped per recipient
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, peers_msg& x) {
  return f(caf::meta::type_name("peers_msg"), x.trace, x.controller, static_cast<node_actors&>(x));
}

// The one registration point: every process calls it on its config.
void messages_register(caf::actor_system_config& cfg);

}  // namespace fp8rl::msg
