// actors/topology.cpp -- topology files and the placement plan.
#include "actors/topology.hpp"
#include "actors/recipe.hpp"

#include <caf/actor_system_config.hpp>
#include <caf/config_value.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

namespace fp8rl::actors {

namespace {
const std::set<std::string> kRoles = {"controller", "buffer", "reward", "weight_sync", "calibration"};
constexpr int64_t kMaxDeviceIndex = 65535;  // cpu:N threads or cuda:K ordinal
}

device_spec device_spec::parse(const std::string& s, const std::string& where) {
  const auto colon = s.find(':');
  device_spec d;
  d.kind = s.substr(0, colon);
  if (d.kind != "cpu" && d.kind != "cuda") throw std::invalid_argument(where + ": device '" + s + "' must be cpu:N or cuda:K");
  if (colon != std::string::npos) {
    try {
      size_t pos = 0;
      d.index = std::stoll(s.substr(colon + 1), &pos);
      // bounded: cpu:2147483648 became an arena of INT_MIN threads (TBB's automatic), 2^32 + 1 one thread
      if (pos != s.size() - colon - 1 || d.index < 0 || d.index > kMaxDeviceIndex) throw std::invalid_argument("");
    } catch (const std::exception&) {
      throw std::invalid_argument(where + ": device '" + s + "' has a bad index (an integer in [0, " +
                                  std::to_string(kMaxDeviceIndex) + "])");
    }
  } else if (d.kind == "cuda") {
    throw std::invalid_argument(where + ": device '" + s + "' needs a GPU index (cuda:K)");
  }
  return d;
}

bool node_spec::has(const std::string& role) const { return std::find(roles.begin(), roles.end(), role) != roles.end(); }

const node_spec& topology::controller_node() const {
  for (const auto& n : nodes) if (n.has("controller")) return n;
  throw std::invalid_argument(source + ": no node has the controller role");
}

const node_spec* topology::find(const std::string& name) const {
  for (const auto& n : nodes) if (n.name == name) return &n;
  return nullptr;
}

topology topology_load(const std::string& path) {
  auto parsed = config_file_parse(path);
  topology t;
  t.source = path;
  for (const auto& [section, v] : parsed)
    if (section != "cluster") {  // a recipe given as a topology was "unknown section [async]", naming no way out
      run_config r;
      const auto keys = recipe_keys(r);
      const bool recipe = std::any_of(keys.begin(), keys.end(), [&](const recipe_key& k) { return section == k.section; });
      throw std::invalid_argument(path + ": unknown section [" + section + "] (a topology holds [cluster] only" +
                                  (recipe ? "; this looks like a recipe: give it with --recipe)" : ")"));
    }
  auto cit = parsed.find("cluster");
  auto cluster = cit == parsed.end() ? nullptr : caf::get_if<caf::config_value::dictionary>(&cit->second);
  if (!cluster) throw std::invalid_argument(path + ": [cluster] missing");
  for (const auto& [k, v] : *cluster)
    if (k != "nodes") throw std::invalid_argument(path + ": unknown key 'cluster." + k + "'");
  auto it = cluster->find("nodes");
  auto list = it == cluster->end() ? nullptr : caf::get_if<caf::config_value::list>(&it->second);
  if (!list) throw std::invalid_argument(path + ": key 'cluster.nodes' missing or not a list");
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = path + ": cluster.nodes[" + std::to_string(i) + "]";
    auto d = caf::get_if<caf::config_value::dictionary>(&(*list)[i]);
    if (!d) throw std::invalid_argument(where + " is not a dictionary");
    node_spec n;
    auto str = [&](const std::string& key, const caf::config_value& v) -> std::string {
      if (auto s = caf::get_if<std::string>(&v)) return *s;
      if (auto a = caf::get_if<caf::atom_value>(&v)) return caf::to_string(*a);
      throw std::invalid_argument(where + ": key '" + key + "' must be a string");
    };
    auto strs = [&](const std::string& key, const caf::config_value& v) {
      auto l = caf::get_if<caf::config_value::list>(&v);
      if (!l) throw std::invalid_argument(where + ": key '" + key + "' must be a list");
      std::vector<std::string> out;
      for (const auto& e : *l) out.push_back(str(key, e));
      return out;
    };
    for (const auto& [k, v] : *d) {
      if (k == "name") n.name = str(k, v);
      else if (k == "host") n.host = str(k, v);
      else if (k == "port") {
        auto p = caf::get_if<int64_t>(&v);
        if (!p || *p < 0 || *p > 65535) throw std::invalid_argument(where + ": key 'port' must be an integer in [0, 65535]");
        n.port = *p;
      } else if (k == "roles") n.roles = strs(k, v);
      else if (k == "learners") for (const auto& s : strs(k, v)) n.learners.push_back(device_spec::parse(s, where + ".learners"));
      else if (k == "rollouts") for (const auto& s : strs(k, v)) n.rollouts.push_back(device_spec::parse(s, where + ".rollouts"));
      else throw std::invalid_argument(where + ": unknown key '" + k + "'");
    }
    if (n.name.empty()) throw std::invalid_argument(where + ": key 'name' missing");
    t.nodes.push_back(std::move(n));
  }
  topology_validate(t);
  return t;
}

topology topology_local(int64_t rollout_cores, int64_t learner_cores) {
  topology t;
  node_spec n;
  n.name = "local";
  n.roles = {"controller", "buffer", "reward", "weight_sync", "calibration"};
  n.learners = {{"cpu", learner_cores}};
  n.rollouts = {{"cpu", rollout_cores}};
  t.nodes.push_back(n);
  return t;
}

bool host_is_local(const std::string& h) { return h == "127.0.0.1" || h == "localhost" || h == "::1"; }
std::string host_canonical(const std::string& h) { return host_is_local(h) ? "localhost" : h; }
bool host_is_loopback(const std::string& h) { return h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0; }
bool host_same_machine(const std::string& h) {
  char self[256] = {};
  ::gethostname(self, sizeof self - 1);
  return host_is_loopback(h) || h == self;
}

std::string topology_to_json(const topology& t) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& n : t.nodes) {
    nlohmann::json l = nlohmann::json::array(), r = nlohmann::json::array();
    for (const auto& d : n.learners) l.push_back(d.str());
    for (const auto& d : n.rollouts) r.push_back(d.str());
    j.push_back({{"name", n.name}, {"host", n.host}, {"port", n.port}, {"roles", n.roles}, {"learners", l}, {"rollouts", r}});
  }
  return j.dump();
}

topology topology_from_json(const std::string& s) {
  topology t;
  t.source = "(from controller)";
  try {
    for (const auto& x : nlohmann::json::parse(s)) {
      node_spec n;
      n.name = x.at("name");
      n.host = x.at("host");
      n.port = x.at("port");
      n.roles = x.at("roles").get<std::vector<std::string>>();
      for (const auto& d : x.at("learners")) n.learners.push_back(device_spec::parse(d.get<std::string>(), "json"));
      for (const auto& d : x.at("rollouts")) n.rollouts.push_back(device_spec::parse(d.get<std::string>(), "json"));
      t.nodes.push_back(n);
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(t.source + ": malformed topology json: " + e.what());
  }
  topology_validate(t);
  return t;
}

void topology_validate(const topology& t) {
  if (t.nodes.empty()) throw std::invalid_argument(t.source + ": no nodes");
  std::map<std::string, std::string> role_node;
  std::set<std::string> names;
  std::set<std::pair<std::string, int64_t>> ports;
  int64_t learners = 0, rollouts = 0;
  if (std::none_of(t.nodes.begin(), t.nodes.end(), [](const node_spec& n) { return n.has("controller"); }))
    throw std::invalid_argument(t.source + ": no node has the role 'controller'");
  // before the per-node checks: without learners "calibration must run on the node of learner 0" blamed calibration
  if (std::all_of(t.nodes.begin(), t.nodes.end(), [](const node_spec& n) { return n.learners.empty(); }))
    throw std::invalid_argument(t.source + ": no learner (no node lists learners)");
  for (const auto& n : t.nodes) {
    const std::string where = t.source + ": node '" + n.name + "'";
    // the name becomes a file name (traces/NAME.jsonl): "../../x" wrote outside the run directory
    if (n.name.empty() || n.name[0] == '.' ||
        n.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos)
      throw std::invalid_argument(where + ": the name must be letters, digits, '.', '_' or '-', not starting with '.'");
    if (n.host.empty()) throw std::invalid_argument(where + ": key 'host' is empty");
    if (n.port < 0 || n.port > 65535) throw std::invalid_argument(where + ": port " + std::to_string(n.port) + " is not in [0, 65535]");
    if (!names.insert(n.name).second) throw std::invalid_argument(where + ": duplicate name");
    // keyed by the machine: 127.0.0.1:P and localhost:P clashed only when the second node opened P
    if (n.port && !ports.insert({host_canonical(n.host), n.port}).second)
      throw std::invalid_argument(where + ": port " + std::to_string(n.port) + " reused on host " + n.host);
    for (const auto& r : n.roles) {
      if (!kRoles.count(r)) throw std::invalid_argument(where + ": unknown role '" + r + "' (roles: controller, buffer, reward, weight_sync, calibration)");
      if (role_node.count(r)) throw std::invalid_argument(where + ": role '" + r + "' is already on node '" + role_node[r] + "'");
      role_node[r] = n.name;
    }
    // learner 0 (the first node's with learners) hands calibration the FP32 master weights in one
    // message: in-process, since CAF 0.17 truncates frames past 4 GiB (a 1.07B-parameter model)
    const bool first_learners = !n.learners.empty() && learners == 0;
    if (n.has("calibration") && !first_learners)
      throw std::invalid_argument(where + ": calibration must run on the node of learner 0 (the first node with learners): "
                                          "learner 0 hands it the FP32 weights in one message, which must not cross processes");
    if (!n.has("controller") && n.port == 0) throw std::invalid_argument(where + ": a remote node needs a port");
    learners += static_cast<int64_t>(n.learners.size());
    rollouts += static_cast<int64_t>(n.rollouts.size());
  }
  for (const auto& r : kRoles)
    if (!role_node.count(r)) throw std::invalid_argument(t.source + ": no node has the role '" + r + "'");
  if (!rollouts) throw std::invalid_argument(t.source + ": no rollout");
  // calibration hands weight-sync each bundle in one message; CAF 0.17 truncates one past 4 GiB
  // in silence (caf-0.17.md section 4): only weight-sync's own sends cross processes, in chunks
  if (role_node["weight_sync"] != role_node["calibration"])
    throw std::invalid_argument(t.source + ": node '" + role_node["weight_sync"] + "': weight_sync must run on the node of calibration ('" +
                                role_node["calibration"] + "'): calibration hands it each bundle in one message, which must not "
                                "cross processes (weight-sync sends bundles to other processes in chunks)");
  // the learners' Gloo all-reduce meets through a file store in the run directory and listens on
  // 127.0.0.1: learners on two machines would wait for each other until Gloo's timeout
  std::string learner_host;
  for (const auto& n : t.nodes) {
    if (n.learners.empty()) continue;
    if (learner_host.empty()) learner_host = n.host;
    else if (!(host_is_loopback(n.host) && host_is_loopback(learner_host)) && host_canonical(n.host) != host_canonical(learner_host))
      throw std::invalid_argument(t.source + ": node '" + n.name + "': learners on host " + n.host + " and on host " + learner_host +
                                  ": every learner must run on one host (their Gloo all-reduce meets through the run directory "
                                  "and 127.0.0.1)");
  }
}

std::map<std::string, node_indices> index_nodes(const topology& t) {
  std::map<std::string, node_indices> m;
  int32_t l = 0, r = 0;
  for (const auto& n : t.nodes) {
    m[n.name] = {l, r};
    l += static_cast<int32_t>(n.learners.size());
    r += static_cast<int32_t>(n.rollouts.size());
  }
  return m;
}

int32_t learner_world(const topology& t) {
  int32_t w = 0;
  for (const auto& n : t.nodes) w += static_cast<int32_t>(n.learners.size());
  return w;
}

std::vector<placement> topology_plan(const topology& t) {
  topology_validate(t);
  std::vector<placement> plan;
  for (const auto& n : t.nodes)
    for (const auto& r : n.roles) plan.push_back({r, n.name, ""});
  int64_t li = 0, ri = 0;
  for (const auto& n : t.nodes) {
    std::set<std::string> gpus;
    for (const auto& d : n.learners) {
      if (d.kind == "cuda" && !gpus.insert(d.str()).second) throw std::invalid_argument(t.source + ": node '" + n.name + "': " + d.str() + " used twice");
      plan.push_back({"learner" + std::to_string(li++), n.name, d.str()});
    }
    for (const auto& d : n.rollouts) {
      if (d.kind == "cuda" && !gpus.insert(d.str()).second) throw std::invalid_argument(t.source + ": node '" + n.name + "': " + d.str() + " used twice");
      plan.push_back({rollout_name(ri++), n.name, d.str()});
    }
  }
  return plan;
}

size_t node_scheduler_threads(const node_spec& n, size_t have, workers_from origin) {
  const size_t need = n.learners.size() + n.rollouts.size() + 2;
  if (have >= need) return have;
  if (origin == workers_from::user)
    throw std::invalid_argument("--scheduler.max-threads=" + std::to_string(have) + ": node '" + n.name + "' runs " +
                                std::to_string(n.learners.size()) + " learner(s) and " + std::to_string(n.rollouts.size()) +
                                " rollout(s), each blocking a worker while it computes; give at least " + std::to_string(need));
  return need;
}

}  // namespace fp8rl::actors
