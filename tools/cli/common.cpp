// tools/cli/common.cpp -- shared subcommand helpers.
#include "tools/cli/common.hpp"

#include <tbb/task_arena.h>

#include <climits>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "actors/run_dir.hpp"
#include "models/json_io.hpp"
#include "models/log.hpp"
#include "models/rl/loop.hpp"

namespace fp8rl::cli {

std::unique_ptr<models::tokenizer> tokenizer_of(const std::string& model_dir, int64_t vocab_size) {
  namespace fs = std::filesystem;
  if (!fs::exists(fs::path(model_dir) / "tokenizer.json") && !fs::exists(fs::path(model_dir) / "fp8rl-char-tokenizer.json"))
    return nullptr;
  auto tok = models::tokenizer_load(model_dir);
  models::tokenizer_vocab_check(*tok, vocab_size, model_dir);
  return tok;
}

void log_level_from_args(const args& a) {
  if (a.has("log-level")) log_set_level(a.get("log-level"));
}

namespace {
// A token id of JSON value t on line `where` (what: "token", "stop token"), in [0, vocab).
int32_t token_id(const nlohmann::json& t, int64_t vocab, const std::string& where, const std::string& what) {
  const std::string range = " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
  if (!t.is_number_integer()) throw std::invalid_argument(where + what + " " + t.dump() + " is not an integer");
  if (t.is_number_unsigned() && t.get<uint64_t>() > uint64_t(INT64_MAX)) throw std::invalid_argument(where + what + " " + t.dump() + range);
  const int64_t v = t.get<int64_t>();
  if (v < 0 || v >= vocab) throw std::invalid_argument(where + what + " " + std::to_string(v) + range);
  return static_cast<int32_t>(v);
}

// Line j's per-request settings (request_keys: generate's max_tokens and stop) into it; any other
// key but tokens/text is refused (a misspelt or unsupported setting would otherwise be ignored).
void read_request_keys(const nlohmann::json& j, bool request_keys, int64_t vocab, const std::string& where, jsonl_item& it) {
  for (const auto& [k, v] : j.items())
    if (k != "tokens" && k != "text" && !(request_keys && (k == "max_tokens" || k == "stop")))
      throw std::invalid_argument(where + "unknown key '" + k + "' (a line holds 'tokens' or 'text'" +
                                  (request_keys ? std::string(", and optionally 'max_tokens' and 'stop')") : std::string(")")));
  if (j.contains("max_tokens")) {
    const auto& m = j["max_tokens"];
    if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > INT32_MAX)
      throw std::invalid_argument(where + "'max_tokens' must be an integer in [1, " + std::to_string(INT32_MAX) + "], got " + m.dump());
    it.max_tokens = static_cast<int32_t>(m.get<int64_t>());
  }
  if (j.contains("stop")) {
    if (!j["stop"].is_array()) throw std::invalid_argument(where + "'stop' must be a list of token ids");
    it.stop.emplace();
    for (const auto& t : j["stop"]) it.stop->push_back(token_id(t, vocab, where, "stop token"));
  }
}
// One input line (not blank); `where` is "FILE:LINE: ".
jsonl_item token_line_read(const std::string& line, const std::string& where, int64_t vocab, const models::tokenizer* tok,
                           bool request_keys) {
  const nlohmann::json j = models::json_parse_strict(line, where.substr(0, where.size() - 2));
  jsonl_item it;
  if (j.is_object() && j.contains("text") && j.contains("tokens"))
    throw std::invalid_argument(where + "holds both 'text' and 'tokens': give one");
  if (j.is_object() && j.contains("text") && j["text"].is_string()) {
    if (!tok) throw std::invalid_argument(where + "'text' needs a tokenizer in the model directory; give 'tokens'");
    try {
      it.tokens = tok->encode(j["text"].get<std::string>(), true);
    } catch (const std::exception& e) {
      throw std::invalid_argument(where + e.what());
    }
    for (int32_t t : it.tokens)  // a tokenizer that does not belong to this model
      if (t < 0 || t >= vocab)
        throw std::invalid_argument(where + "the tokenizer gave token " + std::to_string(t) +
                                    ", outside the model's vocabulary [0, " + std::to_string(vocab) + ")");
  } else {
    if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array()) {
      std::string unknown;  // a misspelt 'tokens' or 'text' is named
      if (j.is_object())
        for (auto k = j.begin(); k != j.end() && unknown.empty(); ++k)
          if (k.key() != "tokens" && k.key() != "text" && !(request_keys && (k.key() == "max_tokens" || k.key() == "stop")))
            unknown = "; unknown key '" + k.key() + "'";
      throw std::invalid_argument(where + "expected an object with a list 'tokens' (or a string 'text')" + unknown);
    }
    for (const auto& t : j["tokens"]) it.tokens.push_back(token_id(t, vocab, where, "token"));
  }
  if (it.tokens.empty()) throw std::invalid_argument(where + (j.contains("text") ? "'text' encodes to no tokens" : "'tokens' is empty"));
  read_request_keys(j, request_keys, vocab, where, it);
  return it;
}
}  // namespace

std::vector<jsonl_item> read_token_jsonl(const std::string& path, int64_t vocab, const models::tokenizer* tok,
                                         bool request_keys) {
  if (std::filesystem::is_directory(path)) throw std::invalid_argument(path + ": is a directory, not a JSONL file");
  std::ifstream f(path);
  if (!f) throw std::invalid_argument(models::open_failure(path));
  std::vector<jsonl_item> out;
  std::string line;
  models::jsonl_errors errors(path);
  int64_t n = 0;
  while (std::getline(f, line)) {  // every bad line named, up to 20 (as the datasets' reader does)
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      out.push_back(token_line_read(line, path + ":" + std::to_string(n) + ": ", vocab, tok, request_keys));
      out.back().line = n;
    } catch (const std::invalid_argument& e) {
      errors.add(e.what());
    }
  }
  errors.throw_if_any(/*one_plain=*/true);
  if (out.empty()) throw std::invalid_argument(path + ": holds no input lines");
  return out;
}

models::precision_policy policy_from_args(const args& a, const std::string& def) {
  models::precision_policy p = models::precision_policy::named(a.get("policy", def));
  if (a.has("bf16-layers")) {
    const std::string s = a.get("bf16-layers");
    const auto comma = s.find(',');
    // both counts, as the usage says (a lone "1" was taken as 1,0); only where layers run FP8 (it
    // was accepted and ignored under fp32/bf16 policies)
    if (comma == std::string::npos)
      throw std::invalid_argument("option --bf16-layers: expected FIRST,LAST (two layer counts >= 0), got '" + s + "'");
    if (p.linear != models::precision::fp8)
      throw std::invalid_argument("option --bf16-layers: policy " + p.name + " runs no layer in FP8");
    const std::string first = s.substr(0, comma), last = s.substr(comma + 1);
    auto count = [&](const std::string& t) {
      const auto v = int_of(t);
      if (!v || *v < 0)
        throw std::invalid_argument("option --bf16-layers: expected FIRST,LAST (two layer counts >= 0), got '" + s + "'");
      return *v;
    };
    p.bf16_first = count(first);
    p.bf16_last = count(last);
  }
  if (a.has("scale-mode")) {
    auto m = quant::scale_mode_parse(a.get("scale-mode"));
    if (!m) throw std::invalid_argument("option --scale-mode: expected pow2 or fp32");
    p.scales = *m;
  }
  p.validate();
  return p;
}

models::precision_policy training_policy_from_args(const args& a, const std::string& def) {
  const models::precision_policy p = policy_from_args(a, def);
  if (p.fp8_attention || p.kv == models::kv_dtype::fp8)  // .training() dropped them: fp8-kv ran as fp8
    throw std::invalid_argument("option --policy " + p.name +
                                ": FP8 attention and the FP8 KV cache are generation-only; the training forward takes "
                                "the linear layers' policy (fp8, fp8-tiles)");
  return p;
}

void with_threads(const args& a, const std::function<void()>& fn) {
  const long long n = a.get_int("threads", 0, 0, 4096);  // 0: all cores
  tbb::task_arena arena(n > 0 ? static_cast<int>(n) : tbb::task_arena::automatic);
  arena.execute(fn);
}

constexpr size_t kCalibTokens = 2048;  // tokens per calibration pass (bounded activations and logits)

kv_calibration kv_calibration_prompts(const std::string& model_dir, std::vector<std::vector<int32_t>> fallback,
                                      const std::string& fallback_name) {
  auto batch = actors::calibration_batch_load(model_dir);
  if (!batch.empty()) return {std::move(batch), "the checkpoint's calibration batch", true, {}};
  return {std::move(fallback), fallback_name, false, {}};
}

models::attn_fp8_scales calibrate_kv(models::backend& be, const models::model_params& params,
                                     const models::precision_policy& policy, const kv_calibration& calib) {
  const auto& prompts = calib.prompts;
  const std::string& source = calib.source;
  std::vector<models::token_batch> passes;
  size_t n = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    if (static_cast<int64_t>(p.size()) > params.cfg.max_position_embeddings)
      throw std::invalid_argument(source + (i < calib.lines.size() ? ":" + std::to_string(calib.lines[i]) : " sequence " + std::to_string(i)) +
                                  ": a calibration prompt of " + std::to_string(p.size()) +
                                  " tokens, more than the model's max_position_embeddings " +
                                  std::to_string(params.cfg.max_position_embeddings));
    if (passes.empty() || n + p.size() > kCalibTokens) passes.emplace_back(), n = 0;
    passes.back().add(p);
    n += p.size();
  }
  auto w = models::model_weights_build(be, params.cfg, policy.training(), {&params, nullptr, nullptr}, false);
  models::model_runner run(be);
  log_get("calibrate")->info("FP8 K/V scales from {}: {} prompt(s) in {} pass(es) of at most {} tokens", source, prompts.size(),
                             passes.size(), kCalibTokens);
  return models::calibrate_attention(run, *w, passes, 1.0, 1.05f);
}

}  // namespace fp8rl::cli
