// tools/cli/cmd_score.cpp -- `fp8rl score`: per-token log-probabilities of given sequences
// (options: kUsage below, printed by --help).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "models/cpu/cpu_backend.hpp"
#include "models/transformer.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/common.hpp"

namespace fp8rl::cli {
namespace {
const char* const kUsage =
    "usage: fp8rl score --model DIR --input FILE.jsonl [options]\n"
    "Per-token log-probabilities of given sequences. Input lines {\"tokens\": [ids...]} or {\"text\": \"...\"}\n"
    "(a model directory with a tokenizer); output one line per input, {\"logprobs\": [...]} with n-1\n"
    "entries: log p(token i | tokens < i) for i = 1..n-1, under the chosen precision policy.\n"
    "  --model DIR              checkpoint or Hugging Face model directory\n"
    "  --input FILE.jsonl       sequences\n"
    "  --policy P               fp32 (default) | bf16 | fp8, each also as P-tiles (AMX)\n"
    "  --bf16-layers F,L        keep the first F and last L layers BF16 (fp8 policies)\n"
    "  --scale-mode M           pow2 (default) | fp32\n"
    "  --max-batch-tokens N     tokens per forward batch (default 4096)\n"
    "  --threads N              oneTBB threads (default 0: all cores)\n"
    "  --log-level L            trace | debug | info (default) | warn | error | off\n";
}  // namespace

int cmd_score(int argc, char** argv) {
  const args a = args_parse(argc, argv, 2, {"model", "input", "policy", "bf16-layers", "scale-mode", "threads",
                                            "max-batch-tokens", "log-level"}, {}, kUsage);
  log_level_from_args(a);
  const auto params = models::model_load(a.need("model"));
  const auto policy = training_policy_from_args(a).training();
  const auto items = read_token_jsonl(a.need("input"), params.cfg.vocab_size, tokenizer_of(a.need("model"), params.cfg.vocab_size).get());
  const int64_t max_tokens = a.get_int("max-batch-tokens", 4096, 1, INT32_MAX);
  for (const auto& it : items)
    if (static_cast<int64_t>(it.tokens.size()) > params.cfg.max_position_embeddings)
      throw std::invalid_argument(a.get("input") + ":" + std::to_string(it.line) + ": " + std::to_string(it.tokens.size()) +
                                  " tokens, beyond the model's max_position_embeddings " +
                                  std::to_string(params.cfg.max_position_embeddings));
  with_threads(a, [&] {
    auto be = models::make_cpu_backend();
    auto w = models::model_weights_build(*be, params.cfg, policy, {&params, nullptr, nullptr}, false);
    models::model_runner run(*be);
    size_t i = 0;
    while (i < items.size()) {
      models::token_batch b;
      const size_t first = i;
      while (i < items.size() && (b.T() == 0 || b.T() + static_cast<int64_t>(items[i].tokens.size()) <= max_tokens))
        b.add(items[i++].tokens);
      run.forward(*w, b, false);
      auto targets = b.next_targets();
      std::vector<float> lp(targets.size());
      run.logprobs(targets, {}, lp.data());
      for (size_t k = first; k < i; ++k) {
        const int32_t s0 = b.seq_start[k - first], s1 = b.seq_start[k - first + 1];
        nlohmann::json out = {{"logprobs", std::vector<float>(lp.begin() + s0, lp.begin() + s1 - 1)}};
        std::printf("%s\n", out.dump().c_str());
      }
    }
  });
  return 0;
}

}  // namespace fp8rl::cli
