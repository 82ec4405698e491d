// actors/recipe.hpp -- the run configuration ("recipe"): every key of a training run, read from
// files in CAF's config syntax and from `--section.key=value` flags, strictly validated.
// defines: run_config, recipe_key, recipe_keys, recipe_load_file, recipe_apply_cli,
//          recipe_dump, recipe_to_json, recipe_from_json, recipe_finalize, recipe_validate, recipe_learning_problems,
//          recipe_rl_config, recipe_health_config, recipe_engine_config,
//          config_file_precheck, config_file_parse
//
// Every key, its type, default and meaning is listed once, in recipe_keys() (recipe.cpp), and
// documented in configs/default.conf. Unknown keys and ill-typed values are errors naming the
// file (or flag) and the key; CAF's own parser accepts unknown file keys silently
// (caf-0.17.md §6), so fp8rl walks the parsed settings itself.
#pragma once
#include <caf/settings.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "models/generate.hpp"
#include "models/rl/health.hpp"
#include "models/rl/loop.hpp"

namespace fp8rl::actors {

struct run_config {
  // [run]
  std::string name = "fp8rl";
  int64_t seed = 1, steps = 200, eval_every = 25, checkpoint_every = 50, keep_checkpoints = 5;
  int64_t collective_timeout_s = 1800;  // a learner rank's wait for the others in an all-reduce
  std::string log_level = "info";
  // [model]
  std::string init = "tiny";  // "tiny" (built-in, SFT warm start) or a HF model directory
  std::string size = "tiny";  // built-in model size: tiny (128x2) or small (512x8, benchmarks)
  int64_t sft_steps = 450, sft_batch = 64;
  double sft_lr = 2e-3;
  int64_t max_context = 32;
  // [task]
  std::string task = "builtin:add2", verifier = "numeric";
  int64_t val_size = 200, train_size = 4000;
  // [rollout]
  int64_t prompts_per_step = 32, group_size = 8, max_new_tokens = 5, top_k = 0, slots = 256;
  double temperature = 1.0, top_p = 1.0;
  std::string kv_policy = "recompute";
  // [precision]
  std::string generation = "fp8", training = "fp8", scale_mode = "pow2";
  int64_t bf16_first = 0, bf16_last = 0;
  std::string bf16_names;  // comma-separated substrings of linear-layer names kept BF16 (both sides)
  // [grpo]
  bool normalize_std = true;
  bool leave_one_out = false;
  bool share_prompts = true;
  double clip_low = 0.2, clip_high = 0.2, dual_clip = 0.0, is_lo = 0.0, is_hi = 2.0, kl_beta = 0.0,
         seq_logprob_error_threshold = 0.0;
  std::string is_mode = "tis";
  // [optim]
  double lr = 5e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, grad_clip = 1.0;
  // [async]
  int64_t max_staleness = 1;
  // [calibration]
  double percentile = 0.999, margin = 1.05;
  // [audit]
  int64_t audit_every = 1, audit_samples = 16;
  // [trace]
  bool trace = true;
  int64_t trace_max_mb = 1024;
  // [health] (rl-algorithm.md section 7, models/rl/health.hpp)
  std::string health_gates = "fail", health_source = "auto";
  int64_t health_min_steps = 20;
  double tmpe_median_max = 0.0, tmpe_steps_above_max = 0.1, gen_kl_mean_max = 0.003;
  // "section.key" -> where its value came from: a recipe file's path or "--section.key=value"
  // (recipe_validate names it; a value out of range named neither file nor option)
  std::map<std::string, std::string> set_by;
};

struct recipe_key {
  const char* section;
  const char* name;
  std::variant<int64_t*, double*, bool*, std::string*> ptr;
  const char* help;
};
std::vector<recipe_key> recipe_keys(run_config& r);

// What CAF 0.17's config parser lets through, checked first (recipes and topologies): the path
// is a regular file, every '[' / '{' closes (an unclosed list made CAF drop the key silently),
// no string runs past its line, and no key is set twice in a section (CAF kept the first).
// Throws naming file and line.
void config_file_precheck(const std::string& path);
// config_file_precheck, then CAF's parser; a parse error names the file and the line at fault
// (CAF reports an unexpected end of line at column 1 of the next line).
caf::settings config_file_parse(const std::string& path);
// Applies a recipe file (CAF config syntax) over r. Throws std::invalid_argument naming the file
// and key (unknown section/key, wrong type).
void recipe_load_file(run_config& r, const std::string& path);
// Applies "--section.key=value" (value typed per key). Throws std::invalid_argument naming it.
void recipe_apply_cli(run_config& r, const std::string& arg);
// Checks values (enums, ranges, policy names); throws std::invalid_argument naming the key.
void recipe_validate(const run_config& r);
// After the files and flags, before recipe_validate: icepop and seq-mask-tis without either IS
// bound take their reference bounds (rl-algorithm.md section 3: [0.5, 5] and [0.999, 1.002];
// tis's [0, 2] made seq-mask-tis nearly a no-op), each said through `say`. `stored`: a resumed
// run's recipe file, whose keys count as not given (a mode given on resume takes its bounds too).
void recipe_finalize(run_config& r, const std::function<void(const std::string&)>& say, const std::string& stored = "");
// Valid settings under which the policy loss has no gradient or ignores the sampled tokens (a
// group of one, greedy groups, IS bounds excluding 1): one line each, naming the keys; train
// warns with them.
std::vector<std::string> recipe_learning_problems(const run_config& r);
// The effective configuration in CAF config syntax (what `fp8rl train --dump-config` prints).
std::string recipe_dump(const run_config& r);
std::string recipe_to_json(const run_config& r);
// Then recipe_validate: a node checks what the controller sent (and, as everywhere, applies its
// run.log_level: a node logs at the controller's level). Throws std::invalid_argument.
run_config recipe_from_json(const std::string& json);

// The derived objects the RL functions take.
models::rl_run_config recipe_rl_config(const run_config& r);
models::health_config recipe_health_config(const run_config& r);
// A rollout's generation engine (also learner0's validation engine and the memory check's).
models::engine_config recipe_engine_config(const run_config& r);

}  // namespace fp8rl::actors
