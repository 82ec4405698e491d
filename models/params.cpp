// models/params.cpp -- parameter layout, init, and conversion to/from safetensors.
#include "models/params.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace fp8rl::models {

const param_info& param_layout::at(const std::string& name) const {
  auto it = index.find(name);
  if (it == index.end()) throw std::out_of_range("no parameter named '" + name + "'");
  return infos[it->second];
}

std::string layer_param_name(int64_t layer, const char* suffix) {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

param_layout model_param_layout(const model_config& c) {
  param_layout l;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool matrix) {
    param_info p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= d;
    p.offset = l.total;
    p.is_matrix = matrix;
    l.total += p.numel;
    l.index[p.name] = l.infos.size();
    l.infos.push_back(std::move(p));
  };
  const int64_t C = c.hidden_size, F = c.intermediate_size;
  add("model.embed_tokens.weight", {c.vocab_size, C}, true);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    add(layer_param_name(i, "input_layernorm.weight"), {C}, false);
    add(layer_param_name(i, "self_attn.q_proj.weight"), {c.q_dim(), C}, true);
    add(layer_param_name(i, "self_attn.k_proj.weight"), {c.kv_dim(), C}, true);
    add(layer_param_name(i, "self_attn.v_proj.weight"), {c.kv_dim(), C}, true);
    add(layer_param_name(i, "self_attn.o_proj.weight"), {C, c.q_dim()}, true);
    add(layer_param_name(i, "post_attention_layernorm.weight"), {C}, false);
    add(layer_param_name(i, "mlp.gate_proj.weight"), {F, C}, true);
    add(layer_param_name(i, "mlp.up_proj.weight"), {F, C}, true);
    add(layer_param_name(i, "mlp.down_proj.weight"), {C, F}, true);
  }
  add("model.norm.weight", {C}, false);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, C}, true);
  return l;
}

std::vector<layer_params> model_layer_params(const model_config& c, const param_layout& l) {
  std::vector<layer_params> out;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto o = [&](const char* s) { return l.at(layer_param_name(i, s)).offset; };
    out.push_back({o("input_layernorm.weight"), o("self_attn.q_proj.weight"), o("self_attn.k_proj.weight"),
                   o("self_attn.v_proj.weight"), o("self_attn.o_proj.weight"), o("post_attention_layernorm.weight"),
                   o("mlp.gate_proj.weight"), o("mlp.up_proj.weight"), o("mlp.down_proj.weight")});
  }
  return out;
}

uint64_t rng::next_u64() {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
double rng::uniform() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
double rng::normal() {
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

model_params model_params_init(const model_config& c, uint64_t seed) {
  c.validate();
  model_params p;
  p.cfg = c;
  p.layout = model_param_layout(c);
  p.data.assign(static_cast<size_t>(p.layout.total), 0.0f);
  rng g(seed);
  for (const auto& info : p.layout.infos) {
    float* w = p.data.data() + info.offset;
    for (int64_t i = 0; i < info.numel; ++i)
      w[i] = info.is_matrix ? static_cast<float>(g.normal() * c.initializer_range) : 1.0f;
  }
  return p;
}

model_params model_params_from_tensors(const model_config& c, const st_tensors& t, const std::string& source) {
  c.validate();
  model_params p;
  p.cfg = c;
  p.layout = model_param_layout(c);
  p.data.assign(static_cast<size_t>(p.layout.total), 0.0f);
  for (const auto& info : p.layout.infos) {
    auto it = t.find(info.name);
    if (it == t.end()) throw std::invalid_argument(source + ": tensor '" + info.name + "' is missing");
    if (it->second.shape != info.shape) {
      std::string want, got;
      for (auto d : info.shape) want += std::to_string(d) + ",";
      for (auto d : it->second.shape) got += std::to_string(d) + ",";
      throw std::invalid_argument(source + ": tensor '" + info.name + "' has shape [" + got + "], config needs [" + want + "]");
    }
    std::copy(it->second.data.begin(), it->second.data.end(), p.data.begin() + info.offset);
  }
  for (const auto& [name, tensor] : t) {
    if (p.layout.index.count(name)) continue;
    if (c.tie_word_embeddings && name == "lm_head.weight") continue;  // some tied checkpoints store it
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // buffer, not a weight
    throw std::invalid_argument(source + ": unexpected tensor '" + name + "' (not part of this config)");
  }
  return p;
}

st_tensors model_params_to_tensors(const model_params& p) {
  st_tensors t;
  for (const auto& info : p.layout.infos) {
    st_tensor s;
    s.shape = info.shape;
    s.data.assign(p.data.begin() + info.offset, p.data.begin() + info.offset + info.numel);
    t.emplace(info.name, std::move(s));
  }
  return t;
}

model_params model_load(const std::string& dir) {
  const auto cfg = model_config_load((std::filesystem::path(dir) / "config.json").string());
  return model_params_from_tensors(cfg, safetensors_load_dir(dir), dir);
}

void model_save(const std::string& dir, const model_params& p, st_dtype dtype) {
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(std::filesystem::path(dir) / "config.json");
    f << model_config_to_json(p.cfg) << "\n";
    if (!f) throw std::runtime_error(dir + "/config.json: write failed");
  }
  safetensors_write((std::filesystem::path(dir) / "model.safetensors").string(), model_params_to_tensors(p), dtype,
                    {{"format", "pt"}});
}

}  // namespace fp8rl::models
