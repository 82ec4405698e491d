// actors/env.hpp -- what every actor of a process shares: the recipe, the run directory, the
// policy model's config and tokenizer, and the initial checkpoint every learner starts from.
// defines: run_start, actor_env, env_make, backend_for, arena_for, actor_exception_error, actor_failures_named,
//          actor_fail, device_problem, device_capacity_problem, node_tiles_problem, fault_env_number
#pragma once
#include <caf/error.hpp>
#include <caf/scheduled_actor.hpp>
#include <caf/sec.hpp>
#include <tbb/task_arena.h>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/recipe.hpp"
#include "actors/topology.hpp"
#include "models/backend.hpp"
#include "models/tokenizer.hpp"

namespace fp8rl::actors {

// Where a run starts: the weight version of its first checkpoint and the next training prompt
// (state.json's weight_version and prompt_cursor on --resume; both 0 for a fresh run). restart:
// a --resume of a run stopped before its first checkpoint, which starts again from step 0.
struct run_start {
  uint64_t version = 0, prompt_cursor = 0;
  bool restart = false;
  run_start(uint64_t v = 0, uint64_t cursor = 0) : version(v), prompt_cursor(cursor) {}  // NOLINT: 0 reads as "fresh"
};

struct actor_env {
  run_config cfg;
  models::rl_run_config rl;
  std::string node, run_dir, init_dir;  // init_dir: checkpoint the run starts from
  std::string ref_dir;                  // the KL reference policy (grpo.kl_beta > 0): the run's first
                                        // weights, model.init or RUN_DIR/checkpoints/init, also on resume
  uint64_t start_version = 0;           // resume: weight_version of init_dir
  uint64_t start_cursor = 0;            // resume: prompt_cursor of init_dir (the next training prompt)
  std::string run_id;                   // unique per launch (rendezvous keys, e.g. Gloo)
  models::model_config model;
  std::shared_ptr<const models::tokenizer> tok;
  models::tokenizer_file tok_file;  // its file, which every checkpoint of the run carries
  std::vector<int32_t> stops;  // what ends a response: models::stop_ids(model, *tok)

  // The first training prompt of `step` (>= start_version): a resumed run continues the prompt
  // sequence where its checkpoint stopped, also when it runs with another prompts_per_step.
  uint64_t prompt_cursor(uint64_t step) const {
    return start_cursor + (step - start_version) * static_cast<uint64_t>(cfg.prompts_per_step);
  }
};

// Loads the model config and tokenizer from init_dir; throws std::invalid_argument.
std::shared_ptr<const actor_env> env_make(const run_config& cfg, const std::string& node, const std::string& run_dir,
                                          const std::string& init_dir, run_start start, const std::string& run_id = "");

// An exception escaping an actor (its start or a handler) as its exit reason: runtime_error with
// "who: what". CAF 0.17's default reason is a bare system_error(runtime_error), so down messages,
// and the controller's report of a lost actor, said nothing of the cause.
caf::error actor_exception_error(const std::string& who, std::exception_ptr& e);
template <class Self>
void actor_failures_named(Self self, std::string who) {
  self->set_exception_handler(
      [who](caf::scheduled_actor*, std::exception_ptr& e) { return actor_exception_error(who, e); });
}
// A compute actor's fatal error: named to the controller as (who, what), which ends the run with
// it, and the actor's exit reason.
template <class Self>
void actor_fail(Self self, const std::string& who, const std::string& what) {
  self->send(self->state.peers.controller, who, what);
  self->quit(caf::make_error(caf::sec::runtime_error, what));
}

// The compute backend for a device: "cpu:N" only (no actor runs on "cuda:K" yet: gpu/ has kernels,
// not a models::backend).
std::unique_ptr<models::backend> backend_for(const device_spec& d);
// The oneTBB arena a compute actor runs its kernels in: "cpu:N" N threads, "cpu:0" all.
std::unique_ptr<tbb::task_arena> arena_for(const device_spec& d);
// "" if this build's actors can run on d, else why not (checked for every node of a topology
// before a run writes anything: a cuda device failed only once the warm start was done).
std::string device_problem(const device_spec& d);
// Why this machine cannot run device d as asked ("" if it can): a cpu:K past the CPUs oneTBB may
// use here (its default concurrency: the affinity mask) got fewer threads, with only TBB's own
// warning. Checked on the node that runs d (another machine may have more).
std::string device_capacity_problem(const device_spec& d, int cpus = tbb::info::default_concurrency());
// "" if this CPU can run the tile GEMMs (AMX) that node n's work asks for, else why not, naming
// the precision key: rollouts run precision.generation; learners, the calibration actor and the
// built-in model's SFT warm start (`warm_start`) precision.training and precision.generation. A
// node without them needs no AMX (a rollout-only node was refused for a tiles training policy).
std::string node_tiles_problem(const run_config& cfg, const node_spec& n, bool warm_start);
// A fault test's setting: environment variable `name` as a whole number, nullopt when unset; a
// value that is not one (a sign, a space, past 2^64) is refused: std::invalid_argument naming it.
std::optional<uint64_t> fault_env_number(const char* name);

}  // namespace fp8rl::actors
