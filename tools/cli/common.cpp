// tools/cli/common.cpp -- shared subcommand helpers.
#include "tools/cli/common.hpp"

#include <tbb/task_arena.h>

#include <climits>
#include <filesystem>
#include <fstream>

#include "models/log.hpp"
#include <nlohmann/json.hpp>

namespace fp8rl::cli {

std::unique_ptr<models::tokenizer> tokenizer_of(const std::string& model_dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(fs::path(model_dir) / "tokenizer.json") && !fs::exists(fs::path(model_dir) / "fp8rl-char-tokenizer.json"))
    return nullptr;
  return models::tokenizer_load(model_dir);
}

void log_level_from_args(const args& a) {
  if (a.has("log-level")) log_set_level(a.get("log-level"));
}

std::vector<jsonl_item> read_token_jsonl(const std::string& path, int64_t vocab, const models::tokenizer* tok) {
  if (std::filesystem::is_directory(path)) throw std::invalid_argument(path + ": is a directory, not a JSONL file");
  std::ifstream f(path);
  if (!f) throw std::invalid_argument(path + ": cannot open");
  std::vector<jsonl_item> out;
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(where + "not valid JSON (" + e.what() + ")");
    }
    jsonl_item it;
    it.line = n;
    if (j.is_object() && j.contains("text") && j.contains("tokens"))
      throw std::invalid_argument(where + "holds both 'text' and 'tokens': give one");
    if (j.is_object() && j.contains("text") && j["text"].is_string()) {
      if (!tok) throw std::invalid_argument(where + "'text' needs a tokenizer in the model directory; give 'tokens'");
      try {
        it.tokens = tok->encode(j["text"].get<std::string>(), true);
      } catch (const std::exception& e) {
        throw std::invalid_argument(where + e.what());
      }
      out.push_back(std::move(it));
      continue;
    }
    if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
      throw std::invalid_argument(where + "expected an object with a list 'tokens' (or a string 'text')");
    for (const auto& t : j["tokens"]) {
      if (!t.is_number_integer()) throw std::invalid_argument(where + "'tokens' holds a non-integer");
      if (t.is_number_unsigned() && t.get<uint64_t>() > uint64_t(INT64_MAX))
        throw std::invalid_argument(where + "token " + t.dump() + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
      const int64_t v = t.get<int64_t>();
      if (v < 0 || v >= vocab)
        throw std::invalid_argument(where + "token " + std::to_string(v) + " is outside the vocabulary [0, " +
                                    std::to_string(vocab) + ")");
      it.tokens.push_back(static_cast<int32_t>(v));
    }
    if (it.tokens.empty()) throw std::invalid_argument(where + "'tokens' is empty");
    out.push_back(std::move(it));
  }
  if (out.empty()) throw std::invalid_argument(path + ": holds no input lines");
  return out;
}

models::precision_policy policy_from_args(const args& a, const std::string& def) {
  models::precision_policy p = models::precision_policy::named(a.get("policy", def));
  if (a.has("bf16-layers")) {
    const std::string s = a.get("bf16-layers");
    const auto comma = s.find(',');
    const std::string first = s.substr(0, comma), last = comma == std::string::npos ? "0" : s.substr(comma + 1);
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

void with_threads(const args& a, const std::function<void()>& fn) {
  const long long n = a.get_int("threads", 0, 0, 4096);  // 0: all cores
  tbb::task_arena arena(n > 0 ? static_cast<int>(n) : tbb::task_arena::automatic);
  arena.execute(fn);
}

}  // namespace fp8rl::cli
