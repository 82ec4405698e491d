// models/config.cpp -- strict config.json reader/writer (nlohmann::json).
#include "models/config.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "models/json_io.hpp"

namespace fp8rl::models {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& source, const std::string& field, const std::string& why) {
  throw std::invalid_argument(source + ": field '" + field + "': " + why);
}

// Metadata that does not change the math (or whose values that would are refused below).
const std::set<std::string> kIgnored = {
    "_name_or_path", "architectures", "model_type", "torch_dtype", "transformers_version",
    "use_cache", "pad_token_id", "pretraining_tp", "attention_dropout", "mlp_bias",
    "attention_bias", "hidden_act", "rope_scaling", "bos_token_id", "eos_token_id",
    "initializer_range", "tie_word_embeddings", "head_dim", "dtype", "use_sliding_window",
    "sliding_window", "max_window_layers", "is_llama_config", "rope_interleaved"};  // the last two: SmolLM2

// Llama 3's rope_scaling; any other kind (linear, dynamic, yarn, longrope) is refused by name.
rope_llama3 rope_scaling_parse(const json& r, const std::string& source) {
  const std::string kind = r.is_object() ? r.value("rope_type", r.value("type", "")) : "";
  if (kind != "llama3") fail(source, "rope_scaling", "RoPE scaling " + r.dump() + " is not implemented (llama3 only)");
  rope_llama3 s;
  auto num = [&](const char* k, double& out) {
    if (!r.contains(k) || !r[k].is_number() || !(r[k].get<double>() > 0))
      fail(source, std::string("rope_scaling.") + k, "must be a number > 0, got " + (r.contains(k) ? r[k].dump() : "nothing"));
    out = r[k].get<double>();
  };
  num("factor", s.factor);
  num("low_freq_factor", s.low_freq_factor);
  num("high_freq_factor", s.high_freq_factor);
  if (!(s.high_freq_factor > s.low_freq_factor))
    fail(source, "rope_scaling.high_freq_factor", "must exceed low_freq_factor (the smoothing divides by their difference)");
  if (!r.contains("original_max_position_embeddings") || !r["original_max_position_embeddings"].is_number_integer() ||
      r["original_max_position_embeddings"].get<int64_t>() <= 0)
    fail(source, "rope_scaling.original_max_position_embeddings", "must be an integer > 0");
  s.original_max_position_embeddings = r["original_max_position_embeddings"].get<int64_t>();
  for (auto it = r.begin(); it != r.end(); ++it)
    if (it.key() != "rope_type" && it.key() != "type" && it.key() != "factor" && it.key() != "low_freq_factor" &&
        it.key() != "high_freq_factor" && it.key() != "original_max_position_embeddings")
      fail(source, "rope_scaling." + it.key(), "unknown field");
  return s;
}

}  // namespace

std::vector<float> rope_inv_freq(double theta, int64_t D, const rope_llama3& s) {
  const int64_t half = D / 2;
  std::vector<float> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)  // FP32 throughout, as transformers' torch code
    f[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(D));
  if (s.factor <= 0) return f;
  const float factor = static_cast<float>(s.factor), lo = static_cast<float>(s.low_freq_factor),
              hi = static_cast<float>(s.high_freq_factor), old = static_cast<float>(s.original_max_position_embeddings);
  const float lo_wavelen = old / lo, hi_wavelen = old / hi;
  for (auto& x : f) {
    const float wavelen = 2.0f * static_cast<float>(M_PI) / x;
    if (wavelen < hi_wavelen) continue;                 // high frequencies: kept
    if (wavelen > lo_wavelen) { x /= factor; continue; }  // low frequencies: divided by factor
    const float smooth = (old / wavelen - lo) / (hi - lo);  // in transformers' order of operations
    x = (1.0f - smooth) * x / factor + smooth * x;
  }
  return f;
}

std::vector<float> model_config::rope_inv_freq() const { return models::rope_inv_freq(rope_theta, head_dim, rope_scaling); }

void model_config::validate() const {
  auto pos = [&](const char* f, int64_t v) {
    if (v <= 0) fail("model_config", f, "must be > 0, got " + std::to_string(v));
  };
  pos("hidden_size", hidden_size);
  pos("intermediate_size", intermediate_size);
  pos("num_hidden_layers", num_hidden_layers);
  pos("num_attention_heads", num_attention_heads);
  pos("num_key_value_heads", num_key_value_heads);
  pos("head_dim", head_dim);
  pos("vocab_size", vocab_size);
  pos("max_position_embeddings", max_position_embeddings);
  // sizes no model of this family comes near; beyond them a typo would allocate terabytes
  auto at_most = [&](const char* f, int64_t v, int64_t hi) {
    if (v > hi) fail("model_config", f, std::to_string(v) + " is beyond the supported " + std::to_string(hi));
  };
  at_most("hidden_size", hidden_size, int64_t{1} << 16);
  at_most("intermediate_size", intermediate_size, int64_t{1} << 18);
  at_most("num_hidden_layers", num_hidden_layers, 1024);
  at_most("num_attention_heads", num_attention_heads, 1024);
  at_most("head_dim", head_dim, 1024);
  at_most("vocab_size", vocab_size, int64_t{1} << 22);
  at_most("max_position_embeddings", max_position_embeddings, int64_t{1} << 22);
  auto token = [&](const std::string& f, int64_t v) {
    if (v < 0 || v >= vocab_size)
      fail("model_config", f, std::to_string(v) + " is not a token of the vocabulary [0, " + std::to_string(vocab_size) + ")");
  };
  if (bos_token_id != -1) token("bos_token_id", bos_token_id);
  for (size_t i = 0; i < eos_token_ids.size(); ++i)
    token(eos_token_ids.size() > 1 ? "eos_token_id[" + std::to_string(i) + "]" : "eos_token_id", eos_token_ids[i]);
  if (num_attention_heads % num_key_value_heads)
    fail("model_config", "num_key_value_heads", "must divide num_attention_heads");
  if (head_dim % 2) fail("model_config", "head_dim", "must be even for RoPE");
  if (!(rms_norm_eps > 0)) fail("model_config", "rms_norm_eps", "must be > 0");
  if (!(rope_theta > 0)) fail("model_config", "rope_theta", "must be > 0");
}

std::string model_config_mismatch(const model_config& want, const model_config& got) {
  const auto& w = want.rope_scaling;
  const auto& g = got.rope_scaling;
  const struct { const char* name; double got, want; } fields[] = {
      {"hidden_size", double(got.hidden_size), double(want.hidden_size)},
      {"intermediate_size", double(got.intermediate_size), double(want.intermediate_size)},
      {"num_hidden_layers", double(got.num_hidden_layers), double(want.num_hidden_layers)},
      {"num_attention_heads", double(got.num_attention_heads), double(want.num_attention_heads)},
      {"num_key_value_heads", double(got.num_key_value_heads), double(want.num_key_value_heads)},
      {"head_dim", double(got.head_dim), double(want.head_dim)},
      {"vocab_size", double(got.vocab_size), double(want.vocab_size)},
      {"tie_word_embeddings", double(got.tie_word_embeddings), double(want.tie_word_embeddings)},
      {"rms_norm_eps", got.rms_norm_eps, want.rms_norm_eps},
      {"rope_theta", got.rope_theta, want.rope_theta},
      {"rope_scaling.factor", g.factor, w.factor},
      {"rope_scaling.low_freq_factor", g.low_freq_factor, w.low_freq_factor},
      {"rope_scaling.high_freq_factor", g.high_freq_factor, w.high_freq_factor},
      {"rope_scaling.original_max_position_embeddings", double(g.original_max_position_embeddings),
       double(w.original_max_position_embeddings)}};
  for (const auto& f : fields)
    if (f.got != f.want) {
      char b[80];
      std::snprintf(b, sizeof b, " %.17g, expected %.17g", f.got, f.want);  // every digit: values differing past the 9th
      return f.name + std::string(b);
    }
  return "";
}

namespace {
model_config model_config_from_json(const json& j, const std::string& source);
}  // namespace

model_config model_config_parse(const std::string& text, const std::string& source) {
  return model_config_from_json(json_parse_strict(text, source), source);
}

model_config model_config_load(const std::string& path) { return model_config_from_json(json_file_read(path), path); }

namespace {
model_config model_config_from_json(const json& j, const std::string& source) {
  if (!j.is_object()) throw std::invalid_argument(source + ": top level must be a JSON object");
  model_config c;
  auto get_int = [&](const char* f, int64_t& out, bool required) {
    if (!j.contains(f)) {
      if (required) fail(source, f, "missing");
      return;
    }
    // 1e30 said "must be an integer" only; 2^63 wrapped to a negative "must be > 0, got -9223372036854775808"
    if (!j[f].is_number_integer() || (j[f].is_number_unsigned() && j[f].get<uint64_t>() > uint64_t(INT64_MAX)))
      fail(source, f, "must be an integer in int64's range, got " + j[f].dump());
    out = j[f].get<int64_t>();
  };
  auto get_num = [&](const char* f, double& out) {
    if (!j.contains(f)) return;
    if (!j[f].is_number()) fail(source, f, "must be a number");
    out = j[f].get<double>();
  };
  get_int("hidden_size", c.hidden_size, true);
  get_int("intermediate_size", c.intermediate_size, true);
  get_int("num_hidden_layers", c.num_hidden_layers, true);
  get_int("num_attention_heads", c.num_attention_heads, true);
  c.num_key_value_heads = c.num_attention_heads;
  get_int("num_key_value_heads", c.num_key_value_heads, false);
  get_int("vocab_size", c.vocab_size, true);
  get_int("max_position_embeddings", c.max_position_embeddings, false);
  c.rms_norm_eps = 1e-6;  // absent: transformers' default for Llama, Qwen2 and Mistral (the struct's 1e-5 is ours)
  get_num("rms_norm_eps", c.rms_norm_eps);
  get_num("rope_theta", c.rope_theta);
  get_num("initializer_range", c.initializer_range);
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    get_int("head_dim", c.head_dim, false);
    if (c.head_dim <= 0) fail(source, "head_dim", "must be > 0 (or null), got " + std::to_string(c.head_dim));
  }
  if (c.head_dim == 0 && c.num_attention_heads > 0) c.head_dim = c.hidden_size / c.num_attention_heads;
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean()) fail(source, "tie_word_embeddings", "must be true or false");
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  for (const char* f : {"bos_token_id", "eos_token_id"}) {  // an id, a list of ids (HF), or null
    if (!j.contains(f) || j[f].is_null()) continue;
    std::vector<int64_t> ids;
    for (const auto& v : j[f].is_array() ? j[f] : nlohmann::json::array({j[f]})) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) fail(source, f, "must be a token id >= 0, a list of them, or null; got " + j[f].dump());
      ids.push_back(v.get<int64_t>());
    }
    if (ids.empty()) continue;
    if (std::string(f) == "eos_token_id") c.eos_token_ids = ids;  // every one of them ends a sequence
    else if (ids.size() == 1) c.bos_token_id = ids[0];
    else fail(source, f, "one sequence start, got " + j[f].dump());
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) c.rope_scaling = rope_scaling_parse(j["rope_scaling"], source);
  // unsupported values of known fields
  for (const char* f : {"attention_bias", "mlp_bias"})
    if (j.contains(f) && !(j[f].is_boolean() && !j[f].get<bool>())) fail(source, f, "biases are not supported");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    fail(source, "hidden_act", "only 'silu' (SwiGLU) is supported, got " + j["hidden_act"].dump());
  if (j.contains("pretraining_tp") && j["pretraining_tp"] != 1) fail(source, "pretraining_tp", "must be 1");
  if (j.contains("rope_interleaved") && j["rope_interleaved"] != false)
    fail(source, "rope_interleaved", "interleaved RoPE is not supported (false: rotate halves, as HF Llama), got " + j["rope_interleaved"].dump());
  if (j.contains("use_sliding_window") && j["use_sliding_window"] == true)
    fail(source, "use_sliding_window", "sliding-window attention is not supported");
  // Mistral applies sliding_window without a switch (Qwen2 only with use_sliding_window true)
  if (!j.contains("use_sliding_window") && j.contains("sliding_window") && !j["sliding_window"].is_null() &&
      !(j["sliding_window"].is_number() && j["sliding_window"].get<double>() >= double(c.max_position_embeddings)))
    fail(source, "sliding_window", "sliding-window attention (window " + j["sliding_window"].dump() +
                                       " < max_position_embeddings) is not supported");
  if (j.contains("attention_dropout") && !(j["attention_dropout"].is_number() && j["attention_dropout"].get<double>() == 0.0))
    fail(source, "attention_dropout", "attention dropout is not implemented, got " + j["attention_dropout"].dump());
  if (j.contains("model_type") &&
      !(j["model_type"] == "llama" || j["model_type"] == "qwen2" || j["model_type"] == "mistral"))
    fail(source, "model_type", "unsupported model type " + j["model_type"].dump() + " (llama, qwen2, mistral)");
  if (j.contains("architectures")) {
    for (const auto& a : j["architectures"])
      if (a != "LlamaForCausalLM" && a != "Qwen2ForCausalLM" && a != "MistralForCausalLM")
        fail(source, "architectures", "unsupported architecture " + a.dump());
  }
  static const std::set<std::string> known = {
      "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!known.count(it.key()) && !kIgnored.count(it.key())) fail(source, it.key(), "unknown field");
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(source + ": " + e.what());
  }
  return c;
}
}  // namespace

model_config model_config_builtin(const std::string& size, int64_t vocab, int64_t max_positions, int64_t bos, int64_t eos) {
  model_config c;
  if (size == "tiny") {
    c.hidden_size = 128; c.intermediate_size = 256; c.num_hidden_layers = 2; c.num_attention_heads = 4;
    c.num_key_value_heads = 2; c.head_dim = 32;
  } else if (size == "small") {
    c.hidden_size = 512; c.intermediate_size = 1536; c.num_hidden_layers = 8; c.num_attention_heads = 8;
    c.num_key_value_heads = 2; c.head_dim = 64;
  } else {
    throw std::invalid_argument("built-in model size '" + size + "' is not tiny or small");
  }
  c.vocab_size = vocab;
  c.max_position_embeddings = max_positions;
  c.initializer_range = 0.05;
  c.bos_token_id = bos;
  if (eos >= 0) c.eos_token_ids = {eos};
  return c;
}


std::string model_config_to_json(const model_config& c) {
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"head_dim", c.head_dim},
            {"vocab_size", c.vocab_size},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"max_position_embeddings", c.max_position_embeddings},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"initializer_range", c.initializer_range},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"torch_dtype", "float32"}};
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) j["eos_token_id"] = c.eos_token_ids;
  if (c.rope_scaling.factor > 0)
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor}, {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  return j.dump(2);
}

}  // namespace fp8rl::models
