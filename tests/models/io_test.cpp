// tests/models/io_test.cpp -- config.json strictness, safetensors round trips (F32, BF16, F16),
// sharded saving and loading, errors that name the file and tensor, and a mutation fuzzer over
// the safetensors parser (every corrupt image is an error, never a crash).
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include <sys/resource.h>
#include <unistd.h>

#include "models/checkpoint.hpp"
#include "models/json_io.hpp"
#include "models/params.hpp"
#include "models/rl/task.hpp"
#include "models/tokenizer.hpp"
#include "quant/fp8.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;
using fp8rl::test::error_of;
namespace fs = std::filesystem;

namespace {
const char* kGoodConfig = R"({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": false,
  "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "hidden_act": "silu"})";


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
  EXPECT_EQ(r.rms_norm_eps, 1e-5);
  std::string no_eps = kGoodConfig;  // absent, it is transformers' default (1e-6), not ours
  no_eps.replace(no_eps.find("\"rms_norm_eps\": 1e-5,"), 21, "");
  EXPECT_EQ(model_config_parse(no_eps, "config.json").rms_norm_eps, 1e-6);
  // eos_token_id as a list (Llama 3.1 Instruct: [128001, 128008, 128009]) keeps every id, also
  // through a save (the first alone was kept and written: generation ran past the others)
  std::string listed = kGoodConfig;
  listed.replace(listed.find("\"hidden_act\""), 0, "\"eos_token_id\": [2, 5, 7], \"bos_token_id\": 1, ");
  const model_config l = model_config_parse(listed, "config.json");
  EXPECT_EQ(l.eos_token_ids, (std::vector<int64_t>{2, 5, 7}));
  EXPECT_EQ(l.bos_token_id, 1);
  EXPECT_EQ(model_config_parse(model_config_to_json(l), "roundtrip").eos_token_ids, l.eos_token_ids);
  listed.replace(listed.find("[2, 5, 7]"), 9, "[2, 50]");  // each id of the list is checked against the vocabulary
  EXPECT_NE(error_of([&] { model_config_parse(listed, "config.json"); }).find("eos_token_id[1]"), std::string::npos)
      << error_of([&] { model_config_parse(listed, "config.json"); });
}

// SmolLM2-135M's published config.json (the docs' example model) carries two fields of its own
// (nanotron's export): they were "unknown field"; rope_interleaved true would change the math.
TEST(Config, AcceptsSmolLM2sPublishedFields) {
  const std::string smol = R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": true, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true, "vocab_size": 49152})";
  const model_config c = model_config_parse(smol, "config.json");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_TRUE(c.tie_word_embeddings);
  std::string interleaved = smol;
  interleaved.replace(interleaved.find("\"rope_interleaved\": false"), 25, "\"rope_interleaved\": true");
  EXPECT_NE(error_of([&] { model_config_parse(interleaved, "config.json"); }).find("field 'rope_interleaved': interleaved RoPE"),
            std::string::npos);
}

// Llama 3.1's rope_scaling (the shipped Llama-3.1-8B recipe's model): parsed, written back, and
// applied to RoPE's frequencies as transformers' _compute_llama3_parameters -- high frequencies
// kept bit for bit, low ones divided by the factor exactly, the band between them smoothly (checked
// against the formula in double within 2 FP32 ulp). Other scalings are still refused by name.
TEST(Config, Llama3RopeScaling) {
  std::string llama = kGoodConfig;
  llama.insert(1, R"("rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"}, )");
  const model_config c = model_config_parse(llama, "config.json");
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(model_config_parse(model_config_to_json(c), "again").rope_scaling.factor, 8.0);
  rope_llama3 s;
  s.factor = 8, s.low_freq_factor = 1, s.high_freq_factor = 4, s.original_max_position_embeddings = 8192;
  const int64_t D = 128;
  const auto plain = rope_inv_freq(500000.0, D), scaled = rope_inv_freq(500000.0, D, s);
  ASSERT_EQ(scaled.size(), 64u);
  int kept = 0, divided = 0, smoothed = 0;
  for (size_t i = 0; i < scaled.size(); ++i) {
    const double wavelen = 2 * M_PI / plain[i];
    if (wavelen < 8192.0 / 4) {
      ++kept;
      EXPECT_EQ(scaled[i], plain[i]) << i;
    } else if (wavelen > 8192.0 / 1) {
      ++divided;
      EXPECT_EQ(scaled[i], plain[i] / 8) << i;
    } else {
      ++smoothed;
      const double sm = (8192.0 / wavelen - 1) / (4 - 1), want = (1 - sm) * plain[i] / 8 + sm * plain[i];
      EXPECT_NEAR(scaled[i], want, fp8rl::tol::fp32_ulps(want, 2)) << i;  // 2 FP32 ulp: FP32 ops vs double
    }
    if (i > 0) {
      EXPECT_LE(scaled[i], scaled[i - 1]) << i;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
  EXPECT_EQ(c.rope_inv_freq(), rope_inv_freq(c.rope_theta, c.head_dim, c.rope_scaling));
  std::string yarn = kGoodConfig;
  yarn.insert(1, R"("rope_scaling": {"type": "yarn", "factor": 4.0}, )");
  EXPECT_NE(error_of([&] { model_config_parse(yarn, "c.json"); }).find("rope_scaling"), std::string::npos);
  std::string equal = llama;
  equal.replace(equal.find("\"high_freq_factor\": 4.0"), 23, "\"high_freq_factor\": 1.0");
  EXPECT_NE(error_of([&] { model_config_parse(equal, "c.json"); }).find("rope_scaling.high_freq_factor"), std::string::npos);
}

TEST(Config, ErrorsNameTheField) {
  auto with = [](const std::string& key, const std::string& val) {
    std::string s = kGoodConfig;
    s.insert(1, "\"" + key + "\": " + val + ", ");
    return s;
  };
  // a value beyond int64 wrapped to a negative number, a huge float said "must be an integer" only
  std::string big = kGoodConfig;
  big.replace(big.find("\"vocab_size\": 50"), 16, "\"vocab_size\": 9223372036854775808");
  EXPECT_NE(error_of([&] { model_config_parse(big, "c.json"); }).find("'vocab_size': must be an integer in int64's range, got 9223372036854775808"),
            std::string::npos) << error_of([&] { model_config_parse(big, "c.json"); });
  std::string fl = kGoodConfig;
  fl.replace(fl.find("\"intermediate_size\": 96"), 23, "\"intermediate_size\": 1e30");
  EXPECT_NE(error_of([&] { model_config_parse(fl, "c.json"); }).find("'intermediate_size': must be an integer in int64's range, got 1e+30"),
            std::string::npos) << error_of([&] { model_config_parse(fl, "c.json"); });
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
  // values of ignored fields that would change the math
  EXPECT_NE(error_of([&] { model_config_parse(with("attention_dropout", "0.3"), "c.json"); }).find("attention_dropout"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { model_config_parse(with("attention_dropout", "0.0"), "c.json"); }), "");
  EXPECT_NE(error_of([&] { model_config_parse(with("sliding_window", "16"), "c.json"); }).find("sliding_window"),
            std::string::npos);  // Mistral: a window without a switch is on
  EXPECT_EQ(error_of([&] { model_config_parse(with("sliding_window", "null"), "c.json"); }), "");
  EXPECT_EQ(error_of([&] { model_config_parse(with("sliding_window", "16, \"use_sliding_window\": false"), "c.json"); }),
            "");  // Qwen2: off unless use_sliding_window
  EXPECT_NE(error_of([&] { model_config_parse(with("use_sliding_window", "true"), "c.json"); }).find("use_sliding_window"),
            std::string::npos);
  // values that would allocate terabytes, or name no token, or another model family
  for (const auto& [key, val] : {std::pair{"head_dim", "0"}, std::pair{"eos_token_id", "-5"}, std::pair{"eos_token_id", "99"},
                                 std::pair{"model_type", "\"gpt2\""}})
    EXPECT_NE(error_of([&] { model_config_parse(with(key, val), "c.json"); }).find(key), std::string::npos) << key << val;
  // each field's own message (a check dropped, or a message naming another field, went unseen)
  auto replaced = [](const std::string& from, const std::string& to) {
    std::string s = kGoodConfig;
    return s.replace(s.find(from), from.size(), to);
  };
  for (const auto& [text, what] :
       {std::pair{with("head_dim", "15"), "field 'head_dim': must be even for RoPE"},
        std::pair{with("pretraining_tp", "2"), "field 'pretraining_tp': must be 1"},
        std::pair{replaced("\"tie_word_embeddings\": false", "\"tie_word_embeddings\": 1"), "field 'tie_word_embeddings': must be true or false"},
        std::pair{replaced("LlamaForCausalLM", "GPT2LMHeadModel"), "field 'architectures': unsupported architecture \"GPT2LMHeadModel\""}})
    EXPECT_NE(error_of([&] { model_config_parse(text, "c.json"); }).find(what), std::string::npos)
        << what << ": " << error_of([&] { model_config_parse(text, "c.json"); });
  std::string huge = kGoodConfig;
  huge.replace(huge.find("\"vocab_size\": 50"), 16, "\"vocab_size\": 1099511627776");
  EXPECT_NE(error_of([&] { model_config_parse(huge, "c.json"); }).find("vocab_size"), std::string::npos);
}

// A key twice in one object is refused by name (nlohmann keeps the last silently: a duplicated
// rope_theta changed the model, a second safetensors entry replaced a tensor); the same key in
// sibling or nested objects is fine. A directory where a JSON file belongs is named as such (it
// read as "basic_filebuf::underflow", or as an empty file).
TEST(Json, DuplicateKeysAndDirectoriesAreRefusedByName) {
  EXPECT_EQ(json_parse_strict(R"([{"a": 1}, {"a": 2, "b": {"a": 3}}])", "x")[1]["b"]["a"], 3);
  EXPECT_EQ(error_of([] { json_parse_strict(R"({"a": {"b": 1, "c": 2, "b": 3}})", "x.json"); }),
            "x.json: key 'b' appears twice in one object");
  EXPECT_EQ(error_of([] { json_parse_strict(R"({"a": 1})", ""); }), "");
  EXPECT_NE(error_of([] { json_parse_strict("{", "x.json"); }).find("x.json: not valid JSON"), std::string::npos);
  std::string twice = kGoodConfig;
  twice.insert(1, "\"rope_theta\": 500000.0, ");
  EXPECT_EQ(error_of([&] { model_config_parse(twice, "c.json"); }), "c.json: key 'rope_theta' appears twice in one object");
  // a safetensors header naming a tensor twice
  const fs::path d = tmpdir("dup");
  model_params p = model_params_init(model_config_parse(kGoodConfig, "c"), 3);
  model_save(d.string(), p);
  std::ifstream in(d / "model.safetensors", std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | bytes[size_t(i)];
  std::string header(bytes.begin() + 8, bytes.begin() + 8 + long(hlen));
  const size_t at = header.find("\"model.norm.weight\"");
  ASSERT_NE(at, std::string::npos);
  const std::string entry = header.substr(at, header.find('}', at) + 1 - at);
  header.insert(1, entry + ",");
  std::string image;
  for (int i = 0; i < 8; ++i) image += char(uint8_t(header.size() >> (8 * i)));
  image += header;
  image.append(bytes.begin() + 8 + long(hlen), bytes.end());
  const std::vector<uint8_t> dup(image.begin(), image.end());
  EXPECT_NE(error_of([&] { safetensors_parse(dup, "m.safetensors"); }).find("m.safetensors: header: key 'model.norm.weight' appears twice"),
            std::string::npos)
      << error_of([&] { safetensors_parse(dup, "m.safetensors"); });
  // directories where the files belong
  fs::rename(d / "config.json", d / "config.away");
  fs::create_directories(d / "config.json");
  EXPECT_EQ(error_of([&] { model_load(d.string()); }), (d / "config.json").string() + ": not a file");
  fs::remove_all(d / "config.json");
  fs::rename(d / "config.away", d / "config.json");
  fs::create_directories(d / "state.json");
  EXPECT_EQ(error_of([&] { checkpoint_load(d.string()); }), (d / "state.json").string() + ": not a file");
  fs::create_directories(d / "tokenizer.json");
  EXPECT_EQ(error_of([&] { tokenizer_load(d.string()); }), (d / "tokenizer.json").string() + ": not a file");
  // a file that cannot be opened is named with what it is ("cannot open" said neither what nor why)
  EXPECT_EQ(open_failure((d / "nope.jsonl").string()), (d / "nope.jsonl").string() + ": no such file");
  EXPECT_EQ(open_failure(d.string()), d.string() + ": is a directory, not a file");
  EXPECT_EQ(error_of([&] { dataset_load_jsonl((d / "nope.jsonl").string()); }), (d / "nope.jsonl").string() + ": no such file");
  errno = EACCES;  // an existing file that would not open: errno's reason, as after a failed open
  EXPECT_EQ(open_failure((d / "config.json").string()), (d / "config.json").string() + ": cannot open (Permission denied)");
  fs::remove_all(d);
}

// A failed write names its file and why: failing at the close's final flush (a small write to a
// full disk, /dev/full) or before it (a write larger than the stream's buffer goes through at once,
// and its error was gone by the close).
TEST(Json, AFailedWriteNamesTheFileAndWhy) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  for (const size_t n : {size_t{10}, size_t{1} << 20}) {
    std::ofstream f("/dev/full");
    f << std::string(n, 'x');
    EXPECT_EQ(error_of([&] { write_close_checked(f, "/dev/full", "the previous one is kept"); }),
              "/dev/full: write failed: No space left on device (the previous one is kept)") << n << " bytes";
  }
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

// F16 save/load: every value comes back rounded to 11 significant bits (nearest even; quantum
// 2^-24 below 2^-14), computed here with frexp/nearbyint; beyond F16's range is an error.
TEST(Safetensors, RoundTripF16) {
  fs::path d = tmpdir("f16");
  model_config c = model_config_parse(kGoodConfig, "c");
  model_params p = model_params_init(c, 6);
  const float edge[] = {65504.0f, -65504.0f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 0x1p-24f, 0x1p-25f, 3 * 0x1p-26f, 6.1e-5f};
  std::copy(std::begin(edge), std::end(edge), p.data.begin());  // the start of the embedding
  auto f16_ref = [](float x) {
    if (x == 0.0f) return x;
    int e;
    std::frexp(x, &e);
    const int q = std::max(e - 11, -24);
    return static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(double(x), -q)), q));
  };
  model_save(d.string(), p, st_dtype::f16);
  const model_params q = model_load(d.string());
  for (size_t i = 0; i < p.data.size(); ++i) ASSERT_EQ(q.data[i], f16_ref(p.data[i])) << i << " " << p.data[i];
  EXPECT_EQ(q.data[2], 1.0f);                 // a tie goes to the even neighbour
  EXPECT_EQ(q.data[3], 1.0f + 4 * 0x1p-11f);  // and up when that one is even
  p.data[5] = 70000.0f;
  EXPECT_NE(error_of([&] { model_save(d.string(), p, st_dtype::f16); }).find("model.embed_tokens.weight"), std::string::npos);
  fs::remove_all(d);
}

// model_save's sharded form loads back exactly; errors about a tensor name the shard that holds
// it, or the index that should list it.
TEST(Safetensors, ShardedSaveAndErrorsNameTheFile) {
  fs::path d = tmpdir("shardsave");
  model_config c = model_config_parse(kGoodConfig, "c");
  model_params p = model_params_init(c, 7);
  model_save(d.string(), p, st_dtype::f32, 40000);
  EXPECT_FALSE(fs::exists(d / "model.safetensors"));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(d)) shards += e.path().extension() == ".safetensors";
  EXPECT_GE(shards, 3);
  EXPECT_EQ(model_load(d.string()).data, p.data);
  // a misshapen tensor: its shard is named
  std::ifstream idx(d / "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(idx);
  const std::string shard = index["weight_map"]["model.norm.weight"].get<std::string>();
  auto t = safetensors_read((d / shard).string());
  t["model.norm.weight"].shape = {63};
  t["model.norm.weight"].data.resize(63);
  safetensors_write((d / shard).string(), t);
  const std::string bad = error_of([&] { model_load(d.string()); });
  EXPECT_NE(bad.find(shard), std::string::npos) << bad;
  EXPECT_NE(bad.find("model.norm.weight"), std::string::npos) << bad;
  // a tensor the index does not list: the index is named
  model_save(d.string(), p, st_dtype::f32, 40000);
  auto j = index;
  j["weight_map"].erase("model.layers.1.mlp.up_proj.weight");
  std::ofstream(d / "model.safetensors.index.json") << j.dump();
  const std::string missing = error_of([&] { model_load(d.string()); });
  EXPECT_NE(missing.find("model.safetensors.index.json"), std::string::npos) << missing;
  EXPECT_NE(missing.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << missing;
  // saving the single file again retires the index
  model_save(d.string(), p);
  EXPECT_FALSE(fs::exists(d / "model.safetensors.index.json"));
  EXPECT_EQ(model_load(d.string()).data, p.data);
  fs::remove_all(d);
}

TEST(Safetensors, ShardedWithIndex) {
  fs::path d = tmpdir("shard");
  model_config c = model_config_parse(kGoodConfig, "c");
  model_params p = model_params_init(c, 4);
  auto all = model_params_to_tensors(p);
  st_tensors a, b;
  nlohmann::json map = nlohmann::json::object();
  int i = 0;
  for (auto& [n, t] : all) {
    const bool first = (i++ % 2) == 0;
    (first ? a : b).emplace(n, t);
    map[n] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  safetensors_write((d / "model-00001-of-00002.safetensors").string(), a);
  safetensors_write((d / "model-00002-of-00002.safetensors").string(), b);
  std::ofstream(d / "model.safetensors.index.json") << nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", map}}.dump();
  std::ofstream(d / "config.json") << kGoodConfig;
  EXPECT_EQ(model_load(d.string()).data, p.data);
  // a shard holding a tensor the index does not list (a shard of another save, a stale index)
  {
    nlohmann::json stale = map;
    const std::string dropped = stale.begin().key();
    stale.erase(dropped);
    std::ofstream(d / "model.safetensors.index.json") << nlohmann::json{{"weight_map", stale}}.dump();
    EXPECT_NE(error_of([&] { model_load(d.string()); })
                  .find("model-00001-of-00002.safetensors: tensor '" + dropped + "' is not in " +
                        (d / "model.safetensors.index.json").string() + "'s weight_map"),
              std::string::npos);
    std::ofstream(d / "model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  }
  // an index naming a file in another directory (a path with '/' or '..') is refused, not read
  for (const char* outside : {"../model-00001-of-00002.safetensors", "sub/model-00001-of-00002.safetensors"}) {
    nlohmann::json away = map;
    away[map.begin().key()] = outside;
    std::ofstream(d / "model.safetensors.index.json") << nlohmann::json{{"weight_map", away}}.dump();
    EXPECT_NE(error_of([&] { model_load(d.string()); }).find("names a path outside the directory"), std::string::npos) << outside;
  }
  {  // a shard fills to max_shard_bytes exactly: the first two tensors (layout order) share one
    const auto& infos = p.layout.infos;
    const fs::path s = tmpdir("shard_exact");
    model_save(s.string(), p, st_dtype::f32, (infos[0].numel + infos[1].numel) * 4);
    const auto where = nlohmann::json::parse(std::ifstream(s / "model.safetensors.index.json"))["weight_map"];
    EXPECT_EQ(where[infos[0].name], where[infos[1].name]);
    EXPECT_NE(where[infos[1].name], where[infos[2].name]);
    EXPECT_EQ(model_load(s.string()).data, p.data);
    fs::remove_all(s);
  }
  std::ofstream(d / "model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
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
  // a config whose sizes (each within its cap) ask for ~2 TiB of parameters, against no tensors:
  // the missing tensor is named before anything that size is allocated (was std::bad_alloc)
  model_config huge = c;
  huge.vocab_size = int64_t{1} << 22;
  huge.hidden_size = int64_t{1} << 16;
  huge.num_attention_heads = 512;
  huge.head_dim = 128;
  EXPECT_NE(error_of([&] { model_params_from_tensors(huge, {}, "ckpt"); }).find("ckpt: tensor 'model.embed_tokens.weight' is missing"),
            std::string::npos);
  auto bad = t;
  bad["model.norm.weight"].shape = {63};
  bad["model.norm.weight"].data.resize(63);
  EXPECT_NE(error_of([&] { model_params_from_tensors(c, bad, "ckpt"); }).find("model.norm.weight"), std::string::npos);
  auto nan = t;
  nan["model.norm.weight"].data[7] = std::nanf("");
  EXPECT_NE(error_of([&] { model_params_from_tensors(c, nan, "ckpt"); }).find("'model.norm.weight' holds a non-finite value"),
            std::string::npos);
  auto extra = t;
  extra["model.layers.9.mlp.up_proj.weight"] = t.at("model.norm.weight");
  EXPECT_NE(error_of([&] { model_params_from_tensors(c, extra, "ckpt"); }).find("layers.9"), std::string::npos);
  auto inv_freq = t;  // RoPE's frequencies, which some published checkpoints store: derived, not read
  inv_freq["model.layers.0.self_attn.rotary_emb.inv_freq"] = {{c.head_dim / 2}, std::vector<float>(static_cast<size_t>(c.head_dim / 2), 1.0f)};
  EXPECT_EQ(error_of([&] { model_params_from_tensors(c, inv_freq, "ckpt"); }), "");
  {  // heads x head_dim other than hidden (Qwen2-style): q_proj [H d, hidden], o_proj [hidden, H d]
    model_config wide = c;
    wide.head_dim = 2 * c.hidden_size / c.num_attention_heads;
    const int64_t q = wide.num_attention_heads * wide.head_dim;
    std::map<std::string, std::vector<int64_t>> shape;
    for (const auto& info : model_param_layout(wide).infos) shape[info.name] = info.shape;
    EXPECT_EQ(shape.at("model.layers.0.self_attn.q_proj.weight"), (std::vector<int64_t>{q, wide.hidden_size}));
    EXPECT_EQ(shape.at("model.layers.0.self_attn.o_proj.weight"), (std::vector<int64_t>{wide.hidden_size, q}));
  }
  // tied embeddings: a stored lm_head must be the embedding, else the checkpoint contradicts its config
  model_config tied = c;
  tied.tie_word_embeddings = true;
  auto t2 = model_params_to_tensors(model_params_init(tied, 5));
  t2["lm_head.weight"] = t2.at("model.embed_tokens.weight");
  EXPECT_EQ(error_of([&] { model_params_from_tensors(tied, t2, "ckpt"); }), "");
  t2["lm_head.weight"].data[3] += 1.0f;
  EXPECT_NE(error_of([&] { model_params_from_tensors(tied, t2, "ckpt"); }).find("lm_head.weight"), std::string::npos);
}

// A file, or a tensor's FP32 values, past the memory a process may take is an error naming the
// file (and the tensor), not a bare std::bad_alloc. Under an address space capped (RLIMIT_AS) 48 MiB
// above what is in use: the file (32 MiB of BF16) fits, its values (64 MiB) do not; then, 16 MiB
// above, the file itself does not. (The sanitizers' allocators abort where malloc fails.)
TEST(Safetensors, WhatDoesNotFitInMemoryIsNamed) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's allocator aborts on a failed allocation";
#endif
  const fs::path d = tmpdir("memory");
  const std::string f = (d / "big.safetensors").string();
  st_tensors t;
  t["big.weight"] = {{4096, 4096}, std::vector<float>(size_t{4096} * 4096, 1.0f)};
  safetensors_write(f, t, st_dtype::bf16);
  t.clear();
  const auto header = bytes_of(f).size() - (size_t{32} << 20);  // (read while memory is not capped)
  auto read_capped = [&](size_t above) {
    size_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;  // the address space in use, in pages
    fp8rl::test::rlimit_scope cap(RLIMIT_AS, pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE)) + above);
    return error_of([&] { safetensors_read(f); });
  };
  EXPECT_EQ(read_capped(size_t{48} << 20), f + ": tensor 'big.weight': its 16777216 values as FP32 (67108864 bytes) do not fit in memory");
  EXPECT_EQ(read_capped(size_t{16} << 20), f + ": its " + std::to_string((size_t{32} << 20) + header) + " bytes do not fit in memory");
  fs::remove_all(d);
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
  // the tensors tile the data section: bytes after the last one (a file appended to) or between
  // two (a tensor the header lost) are refused, as by the format's reference implementation
  auto appended = good;
  appended.push_back(0);
  EXPECT_NE(error_of([&] { safetensors_parse(appended, "x.safetensors"); })
                .find("x.safetensors: 1 byte(s) after the last tensor's data (the data section has 41, its tensors end at 40)"),
            std::string::npos);
  std::string gap = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})";
  std::vector<uint8_t> img4(8 + gap.size() + 12, 0);
  img4[0] = static_cast<uint8_t>(gap.size());
  std::copy(gap.begin(), gap.end(), img4.begin() + 8);
  EXPECT_NE(error_of([&] { safetensors_parse(img4, "x"); }).find("bytes [4, 8) of the data section belong to no tensor (between 'a' and 'b')"),
            std::string::npos);
  // __metadata__ is a str -> str object by the format (a number was accepted)
  std::string md = R"({"__metadata__": 5, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
  std::vector<uint8_t> img3(8 + md.size() + 4, 0);
  img3[0] = static_cast<uint8_t>(md.size());
  std::copy(md.begin(), md.end(), img3.begin() + 8);
  EXPECT_NE(error_of([&] { safetensors_parse(img3, "x"); }).find("__metadata__ is 5, not an object"), std::string::npos);
  // a shape whose element count wraps 64 bits (2^32 x 2^32 = 0) against no data is refused
  std::string wrap = R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})";
  std::vector<uint8_t> img5(8 + wrap.size(), 0);
  img5[0] = static_cast<uint8_t>(wrap.size());
  std::copy(wrap.begin(), wrap.end(), img5.begin() + 8);
  EXPECT_NE(error_of([&] { safetensors_parse(img5, "x"); }).find("shape is too large"), std::string::npos)
      << error_of([&] { safetensors_parse(img5, "x"); });
  // a corrupt file is bad input: fp8rl exits 2 on it, as on a missing tensor (it exited 1)
  EXPECT_THROW(safetensors_parse({1, 2, 3}, "x"), std::invalid_argument);
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
