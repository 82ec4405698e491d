// models/params.cpp -- parameter layout, init, and conversion to/from safetensors.
#include "models/params.hpp"
#include "models/json_io.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
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

model_params model_params_from_tensors(const model_config& c, const st_tensors& t, const std::string& source,
                                       const std::map<std::string, std::string>* file_of) {
  auto file = [&](const std::string& name) {
    if (!file_of) return source;
    auto it = file_of->find(name);
    return it == file_of->end() ? source : it->second;
  };
  c.validate();
  model_params p;
  p.cfg = c;
  p.layout = model_param_layout(c);
  // names and shapes first: the flat array is then no larger than the tensors read (a config's
  // sizes alone can ask for TiBs, which ended in std::bad_alloc naming no file)
  for (const auto& info : p.layout.infos) {
    auto it = t.find(info.name);
    if (it == t.end()) throw std::invalid_argument(source + ": tensor '" + info.name + "' is missing");
    if (it->second.shape != info.shape) {
      std::string want, got;
      for (auto d : info.shape) want += std::to_string(d) + ",";
      for (auto d : it->second.shape) got += std::to_string(d) + ",";
      throw std::invalid_argument(file(info.name) + ": tensor '" + info.name + "' has shape [" + got + "], config needs [" +
                                  want + "]");
    }
  }
  p.data.assign(static_cast<size_t>(p.layout.total), 0.0f);
  for (const auto& info : p.layout.infos) {
    const auto& d = t.find(info.name)->second.data;
    const auto bad = std::find_if(d.begin(), d.end(), [](float x) { return !std::isfinite(x); });
    if (bad != d.end())  // caught here, the error names the weight; later it named a gradient's tile
      throw std::invalid_argument(file(info.name) + ": tensor '" + info.name + "' holds a non-finite value (" +
                                  std::to_string(*bad) + ") at index " + std::to_string(bad - d.begin()));
    std::copy(d.begin(), d.end(), p.data.begin() + info.offset);
  }
  for (const auto& [name, tensor] : t) {
    if (p.layout.index.count(name)) continue;
    if (c.tie_word_embeddings && name == "lm_head.weight") {  // some tied checkpoints store it: it must be the embedding
      auto e = t.find("model.embed_tokens.weight");
      if (e != t.end() && e->second.shape == tensor.shape && e->second.data == tensor.data) continue;
      throw std::invalid_argument(file(name) + ": tensor 'lm_head.weight' differs from model.embed_tokens.weight, but "
                                  "config.json says tie_word_embeddings");
    }
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // buffer, not a weight
    throw std::invalid_argument(file(name) + ": unexpected tensor '" + name + "' (not part of this config)");
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

namespace {
// The newest checkpoint a `latest` file names ("" if f is not one): its one line, a directory beside it.
std::string latest_names(const std::filesystem::path& f) {
  std::ifstream in(f);
  std::string name, rest;
  if (!in || !std::getline(in, name) || std::getline(in, rest) || name.empty() || name.find('/') != std::string::npos) return "";
  return std::filesystem::is_directory(f.parent_path() / name) ? (f.parent_path() / name).string() : "";
}
}  // namespace

void model_dir_check(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(dir) && !fs::is_directory(dir)) {  // e.g. checkpoints/latest, the file naming the newest
    const std::string newest = latest_names(dir);
    throw std::invalid_argument(dir + ": not a directory (a model directory holds config.json and *.safetensors)" +
                                (newest.empty() ? "" : "; this file names the newest checkpoint: give " + newest));
  }
  if (!fs::exists(dir) && fs::exists(dir + ".old"))  // checkpoint_save's two-rename path was cut between them
    throw std::invalid_argument(dir + ": missing; a checkpoint save that was replacing it stopped midway and left the "
                                "previous checkpoint at " + dir + ".old (rename it back)");
  if (!fs::exists(dir)) throw std::invalid_argument(dir + ": no such model directory");
  if (!fs::exists(fs::path(dir) / "config.json") && fs::exists(fs::path(dir) / "checkpoints" / "latest")) {  // a run directory
    const std::string newest = latest_names(fs::path(dir) / "checkpoints" / "latest");
    throw std::invalid_argument(dir + ": a run directory, not a model directory" +
                                (newest.empty() ? std::string(": give one of its checkpoints/step_N") : "; its newest checkpoint is " + newest));
  }
}

model_params model_load(const std::string& dir) {
  namespace fs = std::filesystem;
  model_dir_check(dir);
  const auto cfg = model_config_load((fs::path(dir) / "config.json").string());
  std::map<std::string, std::string> file_of;
  st_tensors t = safetensors_load_dir(dir, &file_of);
  // a tensor that is not there is missing from the single file, or from the index's weight map
  const fs::path single = fs::path(dir) / "model.safetensors";
  const std::string source = (fs::exists(single) ? single : fs::path(dir) / "model.safetensors.index.json").string();
  return model_params_from_tensors(cfg, t, source, &file_of);
}

namespace {
// Writes `text` to path via path.tmp + rename.
void write_text(const std::filesystem::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  file_write_checked(tmp, text);
  std::filesystem::rename(tmp, path);
}
}  // namespace

void model_save(const std::string& dir, const model_params& p, st_dtype dtype, int64_t max_shard_bytes) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  write_text(fs::path(dir) / "config.json", model_config_to_json(p.cfg) + "\n");
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (max_shard_bytes <= 0) {
    safetensors_write(single.string(), model_params_to_tensors(p), dtype, meta);
    fs::remove(index);  // a stale index would describe other files
    return;
  }
  // shards in layout order, each up to max_shard_bytes (a larger tensor gets one of its own)
  const int64_t esize = dtype == st_dtype::f32 ? 4 : 2;
  st_tensors all = model_params_to_tensors(p);
  std::vector<st_tensors> shards(1);
  int64_t bytes = 0, total = 0;
  for (const auto& info : p.layout.infos) {
    if (bytes > 0 && bytes + info.numel * esize > max_shard_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().insert(all.extract(info.name));
    bytes += info.numel * esize;
    total += info.numel * esize;
  }
  nlohmann::json map = nlohmann::json::object();
  const size_t n = shards.size();
  for (size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    safetensors_write((fs::path(dir) / name).string(), shards[i], dtype, meta);
    for (const auto& [tensor, x] : shards[i]) map[tensor] = name;
  }
  write_text(index, nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", map}}.dump(2) + "\n");
  fs::remove(single);  // model_load prefers a single file: a stale one would shadow the shards
}

}  // namespace fp8rl::models
