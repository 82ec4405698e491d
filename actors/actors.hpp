// actors/actors.hpp -- spawn functions of every fp8rl actor (behaviors live in actors/*.cpp).
// defines: spawn_rollout, spawn_reward, spawn_buffer, spawn_learner, spawn_calibration,
//          spawn_weight_sync, spawn_controller, controller_options, node_actors_all,
//          node_actors_problem, node_name_of, node_connect
//
// Actors do no math themselves: they call models/ (engine, learner_grpo, AdamW, calibration)
// inside a oneTBB arena sized by their device, and exchange the typed messages of messages/.
// Each behavior function takes `env` as a spawn argument rather than a capture: CAF 0.17's
// init_fun_factory stores no argument tuple when there are none and still dereferences it
// (`*args_` on a null shared_ptr: undefined behavior that UBSan stops the sanitizer build on).
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "actors/env.hpp"
#include "actors/topology.hpp"
#include "messages/interfaces.hpp"

namespace fp8rl::actors {

msg::rollout_actor spawn_rollout(caf::actor_system& sys, std::shared_ptr<const actor_env> env, std::string name,
                                 device_spec dev);
msg::reward_actor spawn_reward(caf::actor_system& sys, std::shared_ptr<const actor_env> env);
msg::buffer_actor spawn_buffer(caf::actor_system& sys, std::shared_ptr<const actor_env> env);
msg::learner_actor spawn_learner(caf::actor_system& sys, std::shared_ptr<const actor_env> env, int32_t rank,
                                 int32_t world, device_spec dev);
msg::calibration_actor spawn_calibration(caf::actor_system& sys, std::shared_ptr<const actor_env> env, device_spec dev);
// A remote rollout gets a bundle's bytes in chunks of chunk_bytes (4 MiB: far below CAF's 4 GiB
// frame limit), kBundleWindow requests in flight.
inline constexpr size_t kBundleChunkBytes = size_t{4} << 20;
inline constexpr uint32_t kBundleWindow = 4;
msg::weight_sync_actor spawn_weight_sync(caf::actor_system& sys, std::shared_ptr<const actor_env> env,
                                         size_t chunk_bytes = kBundleChunkBytes);

// The controller: issues prompt groups within the staleness window, writes metrics.jsonl,
// supervises every actor (monitors; re-queues a lost rollout's work and restarts a rollout of
// its own process), and shuts the run down.
struct controller_options {
  std::function<void(int)> on_done;  // called once with the exit code when the run ends
  std::function<void()> on_first_step;  // called once, from the controller, when the first metrics row is written
  bool print_progress = true;
  // A new rollout actor with this name on this process's device for it; an invalid handle if
  // the name is not one of this process's rollouts (a lost process cannot be restarted here).
  std::function<msg::rollout_actor(caf::actor_system&, const std::string& name)> respawn_rollout;
  int max_restarts = 3;  // per rollout name: an actor that keeps dying is a failed run
};
// Every valid handle of a node's (or, for peers_msg, the run's) actors: to monitor or stop them.
std::vector<caf::actor> node_actors_all(const msg::node_actors& x);
// "" if a node's answer holds exactly the actors its topology entry names (valid handles, rollouts
// named rollout<first_rollout + i>), else what differs (another fp8rl build could answer otherwise).
std::string node_actors_problem(const node_spec& n, const msg::node_actors& x, int32_t first_rollout);
// The topology node of an actor on node n: "" for own (this process), agent_nodes[i] where
// agent_ids[i] (the node agent's process) is n, else "another process".
std::string node_name_of(const std::vector<caf::node_id>& agent_ids, const std::vector<std::string>& agent_nodes,
                         const caf::node_id& own, const caf::node_id& n);
msg::controller_actor spawn_controller(caf::actor_system& sys, std::shared_ptr<const actor_env> env,
                                       controller_options opts);
// Connects this process to the CAF node at host:port, waiting at most `timeout` (an error then).
// middleman().connect waits without a limit: a peer that accepted the TCP connection and never
// answered (stopped, hung) held the controller for good (caf-0.17.md section 4, CAF #1240). A try
// again joins the middleman's pending handshake with that peer rather than dialing anew.
caf::expected<caf::node_id> node_connect(caf::actor_system& sys, const std::string& host, uint16_t port, caf::timespan timeout);

}  // namespace fp8rl::actors
