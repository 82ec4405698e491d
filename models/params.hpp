// models/params.hpp -- model parameters as one flat FP32 array with named views (HF names).
// defines: param_info, param_layout, layer_params, model_params, model_params_init,
//          model_params_from_tensors, model_params_to_tensors, model_load, model_dir_check, model_save, rng
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/config.hpp"
#include "models/safetensors.hpp"

namespace fp8rl::models {

struct param_info {
  std::string name;              // Hugging Face tensor name
  std::vector<int64_t> shape;
  int64_t offset = 0, numel = 0;  // into the flat array
  bool is_matrix = false;         // linear / embedding weight (weight decay applies)
};

struct param_layout {
  std::vector<param_info> infos;  // canonical order
  std::unordered_map<std::string, size_t> index;
  int64_t total = 0;
  const param_info& at(const std::string& name) const;  // throws std::out_of_range naming it
};

// Offsets of one transformer block's tensors in the flat array.
struct layer_params {
  int64_t attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
};

param_layout model_param_layout(const model_config& c);
std::vector<layer_params> model_layer_params(const model_config& c, const param_layout& l);
std::string layer_param_name(int64_t layer, const char* suffix);  // "model.layers.{i}.{suffix}"

// Counter-based RNG (splitmix64 + Box-Muller): the same stream on every platform.
struct rng {
  uint64_t state;
  explicit rng(uint64_t seed) : state(seed) {}
  uint64_t next_u64();
  double uniform();  // [0, 1)
  double normal();
};

struct model_params {
  model_config cfg;
  param_layout layout;
  std::vector<float> data;  // flat FP32 master weights
  float* get(const std::string& name) { return data.data() + layout.at(name).offset; }
  const float* get(const std::string& name) const { return data.data() + layout.at(name).offset; }
};

// N(0, initializer_range) matrices, unit norms; deterministic in `seed`.
model_params model_params_init(const model_config& c, uint64_t seed);
// Checks every expected tensor is present with its shape and nothing unexpected is left;
// errors name the tensor and its file (file_of, when given), else `source`.
model_params model_params_from_tensors(const model_config& c, const st_tensors& t, const std::string& source,
                                       const std::map<std::string, std::string>* file_of = nullptr);
st_tensors model_params_to_tensors(const model_params& p);
// A Hugging Face model directory: config.json + model.safetensors (or sharded).
model_params model_load(const std::string& dir);
// What model_load refuses first, each named: no such directory, a file (a checkpoints/latest file:
// the checkpoint it names), a run directory (its newest checkpoint), a save cut midway (DIR.old).
void model_dir_check(const std::string& dir);
// Writes config.json and model.safetensors, or with max_shard_bytes > 0 the Hugging Face
// sharded form (model-0000i-of-0000n.safetensors, each up to that size, + the index json).
void model_save(const std::string& dir, const model_params& p, st_dtype dtype = st_dtype::f32, int64_t max_shard_bytes = 0);

}  // namespace fp8rl::models
