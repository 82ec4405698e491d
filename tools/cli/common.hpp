// tools/cli/common.hpp -- helpers shared by the non-actor subcommands: JSONL token input with
// line-numbered errors, precision-policy flags, thread arena.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/precision.hpp"
#include "models/tokenizer.hpp"
#include "tools/cli/args.hpp"

namespace fp8rl::cli {

// Reads lines {"tokens": [ids...]} or {"text": "..."} (encoded with `tok`, BOS added, when the
// model directory has a tokenizer); with request_keys (generate) a line may also hold its own
// "max_tokens": N and "stop": [ids...]. Any other key, and ids outside [0, vocab), are refused:
// errors name file:line and what is wrong.
struct jsonl_item {
  std::vector<int32_t> tokens;
  int64_t line = 0;
  int32_t max_tokens = 0;                       // 0: not given
  std::optional<std::vector<int32_t>> stop;     // not given: the command's
};
std::vector<jsonl_item> read_token_jsonl(const std::string& path, int64_t vocab, const models::tokenizer* tok = nullptr,
                                         bool request_keys = false);
// The tokenizer of a model directory, or null if it has none.
std::unique_ptr<models::tokenizer> tokenizer_of(const std::string& model_dir);
// --log-level LEVEL (every subcommand)
void log_level_from_args(const args& a);

// --policy NAME [--bf16-layers FIRST,LAST] [--scale-mode pow2|fp32]
models::precision_policy policy_from_args(const args& a, const std::string& def = "fp32");

// Runs fn in a oneTBB arena of --threads N (default: all cores).
void with_threads(const args& a, const std::function<void()>& fn);

}  // namespace fp8rl::cli
