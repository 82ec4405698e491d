// tests/actors/protocol_util.hpp -- what the actor protocol tests share (protocol_*_test.cpp): the
// actor system configs (threaded, and CAF's deterministic test coordinator), the tiny model
// checkpoint actors load their env from, a run's env, a rollout's peers, a work item and a group.
// defines: test_config, coordinated_config, coordinated_system, init_dir, env_with, rollout_peers, work_12_plus_3, group
#pragma once
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

namespace fp8rl::proto_test {
namespace fs = std::filesystem;

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
inline std::string init_dir() {
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
inline std::shared_ptr<const actors::actor_env> env_with(int64_t staleness, int64_t prompts, uint64_t start = 0,
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
inline msg::work_msg work_12_plus_3(const actors::actor_env& env) {
  msg::work_msg w;
  w.step = 1;
  w.prompt_id = 3;
  w.prompt = "12+3=";
  w.answer = "15";
  w.group_size = static_cast<int32_t>(env.cfg.group_size);
  return w;
}

// A group sampled under the default recipe's generation policy.
inline msg::group_msg group(uint64_t step, uint64_t pid, uint64_t version) {
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
// An actor system on the test coordinator, its scheduler (sched.run() runs what is queued) and the
// test's own actor in it (hidden: no actor of the run waits for it).
struct coordinated_system {
  coordinated_config cfg;
  caf::actor_system sys{cfg};
  caf::scheduler::test_coordinator& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());
  caf::scoped_actor self{sys, true};
};

}  // namespace fp8rl::proto_test
