// actors/topology.hpp -- where actors run: nodes (processes), their roles and devices.
// defines: device_spec, node_spec, topology, topology_load, topology_local, topology_validate,
//          host_is_local, host_canonical, host_same_machine, host_is_loopback, topology_to_json, topology_from_json,
//          placement, topology_plan, node_indices, index_nodes, learner_world, rollout_name,
//          node_scheduler_threads
//
// A topology file (CAF config syntax, read with CAF's parser, validated here key by key):
//   [cluster]
//   nodes=[{name="main", host="127.0.0.1", port=0, roles=["controller", "buffer", "reward",
//           "weight_sync", "calibration"], learners=["cpu:1"], rollouts=["cpu:1"]}]
// Roles are the singleton actors; learners/rollouts list one device per actor: "cpu:N" (a
// oneTBB arena of N cores; 0 = all) or "cuda:K" (GPU K: parsed and planned, but no build runs
// actors on it yet -- env.hpp device_problem refuses it before a run starts). Exactly one node holds
// each singleton role; calibration runs on the node of learner 0 (the first node with learners).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fp8rl::actors {

struct device_spec {
  std::string kind = "cpu";  // cpu | cuda
  int64_t index = 0;         // cores (cpu) or GPU id (cuda)
  static device_spec parse(const std::string& s, const std::string& where);
  std::string str() const { return kind + ":" + std::to_string(index); }
};

struct node_spec {
  std::string name, host = "127.0.0.1";
  int64_t port = 0;
  std::vector<std::string> roles;
  std::vector<device_spec> learners, rollouts;
  bool has(const std::string& role) const;
};

struct topology {
  std::string source = "(embedded local)";
  std::vector<node_spec> nodes;
  const node_spec& controller_node() const;
  const node_spec* find(const std::string& name) const;
};

topology topology_load(const std::string& path);  // throws std::invalid_argument naming file/key
// The names a topology's nodes on this machine are usually written with (127.0.0.1, localhost,
// ::1) are one host for the port-reuse check and caf-run's hostfile: "localhost"; others as given
// (127.0.0.2:P is another socket; IPv4 and IPv6 loopback are kept one, to be safe).
bool host_is_local(const std::string& h);
std::string host_canonical(const std::string& h);
// Every name of this machine (127/8, ::1, localhost, its hostname): one host's memory, which the
// KV caches of its nodes' engines share -- broader than host_is_local, which names one address.
bool host_same_machine(const std::string& h);
// The loopback names among them (127/8, ::1, localhost): the machine caf-run starts its nodes on.
bool host_is_loopback(const std::string& h);
// The canonical JSON form a topology travels in (controller -> node agent); from_json validates.
std::string topology_to_json(const topology& t);
topology topology_from_json(const std::string& json);  // throws std::invalid_argument
topology topology_local(int64_t rollout_cores, int64_t learner_cores);
void topology_validate(const topology& t);        // throws std::invalid_argument naming the node

struct placement {
  std::string actor;   // "rollout0", "learner1", "buffer", ...
  std::string node;
  std::string device;  // "cpu:1", "cuda:3", "" for singletons
};
std::vector<placement> topology_plan(const topology& t);

// Learner and rollout numbering: node n's first learner rank and first rollout index (nodes in
// file order), and the number of learners (the all-reduce's world).
struct node_indices {
  int32_t first_learner = 0, first_rollout = 0;
};
std::map<std::string, node_indices> index_nodes(const topology& t);
int32_t learner_world(const topology& t);

// CAF scheduler workers node n needs: one per learner and rollout (each blocks its worker while it
// computes, a learner also in the all-reduce until every rank joins) plus two for the others. Given
// have workers: have where it fits; else the need, unless the user chose have, which is refused
// naming --scheduler.max-threads (two learners on one worker froze until Gloo's timeout).
enum class workers_from { default_value, user };
size_t node_scheduler_threads(const node_spec& n, size_t have, workers_from origin);

// The name of the run's k-th rollout actor (numbered across nodes in topology order).
inline std::string rollout_name(int64_t k) { return "rollout" + std::to_string(k); }

}  // namespace fp8rl::actors
