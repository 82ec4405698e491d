// models/checkpoint.hpp -- training checkpoints: model (HF layout) + optimizer state + run state.
// defines: checkpoint, checkpoint_save, checkpoint_load
//
// Layout of a checkpoint directory:
//   config.json, model.safetensors   the model, loadable by any HF-compatible tool
//   optimizer.safetensors            AdamW moments as "m.<name>", "v.<name>" (F32)
//   state.json                       {"step", "weight_version", "adam_step", ...run state}
// Saving writes into DIR.tmp and renames, so a crash leaves the previous checkpoint intact.
#pragma once
#include <string>

#include "models/adamw.hpp"
#include "models/params.hpp"

namespace fp8rl::models {

struct checkpoint {
  model_params params;
  adamw_state opt;
  std::string state_json = "{}";  // caller's run state (step, versions, rng, data cursor)
};

void checkpoint_save(const std::string& dir, const checkpoint& c);
checkpoint checkpoint_load(const std::string& dir);

}  // namespace fp8rl::models
