// tools/cli/common.hpp -- helpers shared by the non-actor subcommands: JSONL token input with
// line-numbered errors, precision-policy flags, FP8 KV calibration, thread arena.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/precision.hpp"
#include "models/transformer.hpp"
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
// The tokenizer of a model directory, or null if it has none; refused when its ids reach past
// the model's vocabulary (vocab_size).
std::unique_ptr<models::tokenizer> tokenizer_of(const std::string& model_dir, int64_t vocab_size);
// --log-level LEVEL (every subcommand)
void log_level_from_args(const args& a);

// --policy NAME [--bf16-layers FIRST,LAST] [--scale-mode pow2|fp32]
models::precision_policy policy_from_args(const args& a, const std::string& def = "fp32");
// The same for a training forward (sft, score): a generation-only policy (FP8 attention, FP8 KV
// cache: fp8-kv) is refused naming the option.
models::precision_policy training_policy_from_args(const args& a, const std::string& def = "fp32");

// The prompts an FP8 KV cache's scales come from for the checkpoint in model_dir: its
// calibration.jsonl (fp8rl train's checkpoints: the batch its rollouts' scales came from) if it has
// one, else `fallback` (named fallback_name).
struct kv_calibration {
  std::vector<std::vector<int32_t>> prompts;
  std::string source;  // what they are, for the log
  bool from_checkpoint = false;
  std::vector<int64_t> lines;  // each prompt's line in `source` (a file), or none: named by index
};
kv_calibration kv_calibration_prompts(const std::string& model_dir, std::vector<std::vector<int32_t>> fallback,
                                      const std::string& fallback_name);
// FP8 KV cache (policy kv fp8): Q/K/V scales per layer and head (amax * 1.05 / 448,
// calibrate_attention's largest sample) from the training forward over these prompts, in passes of
// at most 2048 tokens (or one prompt): amax is a max over tokens and a token's activations do not
// depend on its batch, so the passes give the scales one pass over every prompt would. `source`
// names the prompts in the one log line, and with their lines one longer than the model's positions.
models::attn_fp8_scales calibrate_kv(models::backend& be, const models::model_params& params,
                                     const models::precision_policy& policy, const kv_calibration& calib);

// Runs fn in a oneTBB arena of --threads N (default: all cores).
void with_threads(const args& a, const std::function<void()>& fn);

}  // namespace fp8rl::cli
