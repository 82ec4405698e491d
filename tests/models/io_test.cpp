// tests/models/io_test.cpp -- config.json strictness, safetensors round trips, sharded loading,
// and a mutation fuzzer over the safetensors parser (every corrupt image is an error, never a crash).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "models/params.hpp"
#include "quant/fp8.hpp"

using namespace fp8rl::models;
namespace fs = std::filesystem;

namespace {
const char* kGoodConfig = R"({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": false,
  "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "hidden_act": "silu"})";

std::string error_of(const std::function<void()>& fn) {
  try { fn(); } catch (const std::exception& e) { return e.what(); }
  return "";
}

fs::path tmpdir(const char* name) {
  fs::path p = fs::temp_directory_path() / ("fp8rl_io_" + std::string(name) + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::vector<uint8_t> bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
}  // namespace

TEST(Config, ParsesHuggingFaceFields) {
  model_config c = model_config_parse(kGoodConfig, "config.json");
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  model_config r = model_config_parse(model_config_to_json(c), "roundtrip");
  EXPECT_EQ(r.intermediate_size, c.intermediate_size);
}

TEST(Config, ErrorsNameTheField) {
  auto with = [](const std::string& key, const std::string& val) {
    std::string s = kGoodConfig;
    s.insert(1, "\"" + key + "\": " + val + ", ");
    return s;
  };
  EXPECT_NE(error_of([&] { model_config_parse(with("rope_scaling", R"({"type": "yarn"})"), "c.json"); }).find("rope_scaling"), std::string::npos);
  EXPECT_NE(error_of([&] { model_config_parse(with("attention_bias", "true"), "c.json"); }).find("attention_bias"), std::string::npos);
  EXPECT_NE(error_of([&] { model_config_parse(with("frobnicate", "1"), "c.json"); }).find("frobnicate"), std::string::npos);
  std::string gelu = kGoodConfig;
  gelu.replace(gelu.find("\"silu\""), 6, "\"gelu\"");
  EXPECT_NE(error_of([&] { model_config_parse(gelu, "c.json"); }).find("hidden_act"), std::string::npos);
  std::string missing = kGoodConfig;
  missing.replace(missing.find("\"vocab_size\": 50,"), 17, "");
  EXPECT_NE(error_of([&] { model_config_parse(missing, "c.json"); }).find("vocab_size"), std::string::npos);
  std::string badkv = kGoodConfig;
  badkv.replace(badkv.find("\"num_key_value_heads\": 2"), 24, "\"num_key_value_heads\": 3");
  EXPECT_NE(error_of([&] { model_config_parse(badkv, "c.json"); }).find("num_key_value_heads"), std::string::npos);
  EXPECT_NE(error_of([&] { model_config_parse("{", "c.json"); }).find("c.json"), std::string::npos);
}

TEST(Safetensors, RoundTripF32AndBf16) {
  fs::path d = tmpdir("rt");
  model_config c = model_config_parse(kGoodConfig, "c");
  model_params p = model_params_init(c, 3);
  model_save(d.string(), p);
  model_params q = model_load(d.string());
  EXPECT_EQ(p.data, q.data);
  safetensors_write((d / "bf16.safetensors").string(), model_params_to_tensors(p), st_dtype::bf16);
  auto t = safetensors_read((d / "bf16.safetensors").string());
  const auto& e = t.at("model.embed_tokens.weight");
  for (size_t i = 0; i < e.data.size(); ++i)
    ASSERT_EQ(e.data[i], fp8rl::quant::bf16_round(p.data[i]));
  fs::remove_all(d);
}

TEST(Safetensors, ShardedWithIndex) {
  fs::path d = tmpdir("shard");
  model_config c = model_config_parse(kGoodConfig, "c");
  model_params p = model_params_init(c, 4);
  auto all = model_params_to_tensors(p);
  st_tensors a, b;
  std::string map;
  int i = 0;
  for (auto& [n, t] : all) {
    const bool first = (i++ % 2) == 0;
    (first ? a : b).emplace(n, t);
    map += (map.empty() ? "" : ",") + ("\"" + n + "\": \"model-0000" + std::string(first ? "1" : "2") + "-of-00002.safetensors\"");
  }
  safetensors_write((d / "model-00001-of-00002.safetensors").string(), a);
  safetensors_write((d / "model-00002-of-00002.safetensors").string(), b);
  std::ofstream(d / "model.safetensors.index.json") << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  std::ofstream(d / "config.json") << kGoodConfig;
  EXPECT_EQ(model_load(d.string()).data, p.data);
  fs::remove(d / "model-00002-of-00002.safetensors");
  EXPECT_NE(error_of([&] { model_load(d.string()); }).find("model-00002-of-00002.safetensors"), std::string::npos);
  fs::remove_all(d);
}

TEST(Safetensors, MissingAndMisshapenTensorsAreNamed) {
  model_config c = model_config_parse(kGoodConfig, "c");
  auto t = model_params_to_tensors(model_params_init(c, 5));
  auto no_q = t;
  no_q.erase("model.layers.1.self_attn.q_proj.weight");
  EXPECT_NE(error_of([&] { model_params_from_tensors(c, no_q, "ckpt"); }).find("model.layers.1.self_attn.q_proj.weight"), std::string::npos);
  auto bad = t;
  bad["model.norm.weight"].shape = {63};
  bad["model.norm.weight"].data.resize(63);
  EXPECT_NE(error_of([&] { model_params_from_tensors(c, bad, "ckpt"); }).find("model.norm.weight"), std::string::npos);
  auto extra = t;
  extra["model.layers.9.mlp.up_proj.weight"] = t.at("model.norm.weight");
  EXPECT_NE(error_of([&] { model_params_from_tensors(c, extra, "ckpt"); }).find("layers.9"), std::string::npos);
}

TEST(Safetensors, CorruptFilesAreErrors) {
  fs::path d = tmpdir("corrupt");
  st_tensors t;
  t["a"] = {{2, 3}, {1, 2, 3, 4, 5, 6}};
  t["b"] = {{4}, {7, 8, 9, 10}};
  safetensors_write((d / "x.safetensors").string(), t);
  auto good = bytes_of(d / "x.safetensors");
  EXPECT_NO_THROW(safetensors_parse(good, "x"));
  auto truncated = good;
  truncated.resize(good.size() - 3);
  EXPECT_NE(error_of([&] { safetensors_parse(truncated, "x.safetensors"); }).find("tensor '"), std::string::npos);
  EXPECT_THROW(safetensors_parse({1, 2, 3}, "x"), st_error);
  auto huge = good;
  huge[7] = 0x7f;  // header length far beyond the file
  EXPECT_NE(error_of([&] { safetensors_parse(huge, "x.safetensors"); }).find("header length"), std::string::npos);
  std::string hdr = R"({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})";
  std::vector<uint8_t> img(8 + hdr.size() + 8, 0);
  img[0] = static_cast<uint8_t>(hdr.size());
  std::copy(hdr.begin(), hdr.end(), img.begin() + 8);
  EXPECT_NE(error_of([&] { safetensors_parse(img, "x"); }).find("unsupported dtype 'I64'"), std::string::npos);
  std::string ov = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  std::vector<uint8_t> img2(8 + ov.size() + 12, 0);
  img2[0] = static_cast<uint8_t>(ov.size());
  std::copy(ov.begin(), ov.end(), img2.begin() + 8);
  EXPECT_NE(error_of([&] { safetensors_parse(img2, "x"); }).find("overlap"), std::string::npos);
  fs::remove_all(d);
}

// Random byte flips, insertions, truncations and header edits: parse must throw st_error or
// succeed, never crash (also run under ASan+UBSan in the sanitizer build).
TEST(Safetensors, FuzzedImagesNeverCrash) {
  fs::path d = tmpdir("fuzz");
  st_tensors t;
  t["model.embed_tokens.weight"] = {{3, 4}, std::vector<float>(12, 0.5f)};
  t["model.norm.weight"] = {{4}, {1, 2, 3, 4}};
  safetensors_write((d / "x.safetensors").string(), t, st_dtype::bf16);
  const auto good = bytes_of(d / "x.safetensors");
  std::mt19937 g(42);
  int errors = 0, ok = 0;
  for (int it = 0; it < 20000; ++it) {
    auto img = good;
    const int edits = 1 + static_cast<int>(g() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (g() % 4) {
        case 0: if (!img.empty()) img[g() % img.size()] ^= static_cast<uint8_t>(1u << (g() % 8)); break;
        case 1: if (!img.empty()) img.resize(g() % img.size()); break;
        case 2: img.insert(img.begin() + static_cast<long>(g() % (img.size() + 1)), static_cast<uint8_t>(g())); break;
        case 3: if (img.size() > 16) img[8 + g() % std::min<size_t>(img.size() - 8, 120)] = "{}[]\":,0123456789-e"[g() % 19]; break;
      }
    }
    try { safetensors_parse(img, "fuzz"); ++ok; } catch (const st_error&) { ++errors; }
  }
  EXPECT_GT(errors, 1000);
  fs::remove_all(d);
}
