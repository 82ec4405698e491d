// actors/preflight.hpp -- the checks of a run's start: what would otherwise fail only after the
// SFT warm start, or inside an actor's behavior (CAF's "unhandled exception", a run left hanging).
// defines: builtin_model_config, host_memory_check, examples_fit_check, warm_start_check,
//          train_set_check, run_preflight
#pragma once
#include <string>

#include "actors/env.hpp"
#include "actors/recipe.hpp"
#include "actors/topology.hpp"
#include "models/config.hpp"
#include "models/rl/task.hpp"
#include "models/tokenizer.hpp"

namespace fp8rl::actors {

// The built-in tiny model's config (model.init = tiny) for a recipe and its tokenizer.
models::model_config builtin_model_config(const run_config& cfg, const models::tokenizer& tok);
// The generation engines' KV caches and weights and the learners' FP32 state on node's host (every
// node of the topology there), a run starting at start_version, within the host's memory; throws
// std::invalid_argument naming the keys that size each part (rollout.slots, model.max_context,
// precision.generation, audit.every, async.max_staleness, grpo.kl_beta). Returns the need, itemized
// (from the host's first node; "" from the others).
[[nodiscard]] std::string host_memory_check(const run_config& cfg, const models::model_config& model, const topology& t,
                                            const std::string& node, uint64_t start_version);
// Both task splits' prompts fit the context with a response; some training answer can be
// rewarded (none: refused; some not: warned). Returns the training split. Throws naming the example.
models::dataset examples_fit_check(const run_config& cfg, const models::tokenizer& tok);
// What the built-in model's warm start would be followed by a refusal of (tasks, host memory).
void warm_start_check(const run_config& cfg, const topology& t, const std::string& node);
// A resumed run's training set (now) is the one its checkpoint recorded.
void train_set_check(const actor_env& env, const models::dataset& now);
// Every file the actors will read or write, read or opened here first (see preflight.cpp).
void run_preflight(const actor_env& env, bool resume, bool restart);

}  // namespace fp8rl::actors
