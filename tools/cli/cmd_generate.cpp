// tools/cli/cmd_generate.cpp -- `fp8rl generate`: batched generation with the rollout engine
// (options: kUsage below, printed by --help).
#include <fmt/ranges.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "models/cpu/cpu_backend.hpp"
#include "models/checkpoint.hpp"
#include "models/generate.hpp"
#include "models/log.hpp"
#include "models/rl/loop.hpp"
#include "models/sampling.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/common.hpp"

namespace fp8rl::cli {
namespace {
const char* const kUsage =
    "usage: fp8rl generate --model DIR --prompts FILE.jsonl [options]\n"
    "Batched generation with the rollout engine. Input lines {\"tokens\": [ids...]} or {\"text\": \"...\"}\n"
    "(a model directory with a tokenizer), each optionally with its own \"max_tokens\": N and \"stop\": [ids...]\n"
    "(instead of --max-tokens / --stop); output one JSON line per prompt, in input order:\n"
    "  {\"tokens\": [...], \"logprobs\": [...], \"weight_version\": [...], \"scale_version\": [...],\n"
    "   \"finish\": \"stop\"|\"length\", \"text\": \"...\" (with a tokenizer: the tokens decoded, special ones left out)}\n"
    "logprobs are log p(token) under the distribution sampled from (after temperature, top-k, top-p;\n"
    "greedy -- temperature 0 -- reports temperature-1 logprobs after top-k/top-p). With an FP8 KV\n"
    "cache the Q/K/V scales (amax * 1.05 / 448; forward passes of at most 2048 tokens) come from\n"
    "--calibration, else the checkpoint's calibration.jsonl (fp8rl train's), else the prompts -- then a\n"
    "prompt's tokens depend on the other prompts in the file; the K/V and query elements that\n"
    "saturated (|x / scale| > 464, where 448 is the largest code) are logged per layer at the end.\n"
    "  --model DIR              checkpoint or Hugging Face model directory\n"
    "  --prompts FILE.jsonl     prompts\n"
    "  --policy P               fp32 (default) | bf16 | fp8 | fp8-kv, each also as P-tiles (AMX)\n"
    "  --bf16-layers F,L        keep the first F and last L layers BF16 (fp8 policies)\n"
    "  --scale-mode M           pow2 (default) | fp32\n"
    "  --kv K                   KV cache f32 | bf16 | fp8 (default: the policy's; fp8 adds FP8 attention)\n"
    "  --attention A            bf16 | fp8 (FP8 Q/K/V per head, with --kv fp8; default: the policy's, fp8\n"
    "                           with --kv fp8): --kv fp8 --attention bf16 is the FP8 cache alone\n"
    "  --calibration FILE.jsonl prompts ({\"tokens\"} or {\"text\"} lines) for the FP8 KV cache's scales\n"
    "  --max-tokens N           per prompt (default 64, or what the context leaves: a prompt given more\n"
    "                           than that room is cut short with a warning)\n"
    "  --temperature T          0 = greedy (default 1)\n"
    "  --top-k K                0 = off (default)\n"
    "  --top-p P                in (0, 1] (default 1)\n"
    "  --seed S                 sampling seed of every request (default 0); a prompt's random stream is\n"
    "                           (S, its place among the prompts), whatever the other prompts are\n"
    "  --stop ID,ID             stop tokens (default: every id of the model's eos_token_id, and the\n"
    "                           tokenizer's end-of-text: what ends an fp8rl train rollout)\n"
    "  --slots N                continuous-batching slots (default 8)\n"
    "  --max-context N          tokens per slot (default: min(max_position_embeddings, 2048))\n"
    "  --threads N              oneTBB threads (default 0: all cores)\n"
    "  --log-level L            trace | debug | info (default) | warn | error | off\n";

}  // namespace

int cmd_generate(int argc, char** argv) {
  const args a = args_parse(argc, argv, 2,
                            {"model", "prompts", "policy", "bf16-layers", "scale-mode", "kv", "max-tokens",
                             "temperature", "top-k", "top-p", "seed", "slots", "max-context", "stop", "threads", "log-level",
                             "calibration", "attention"},
                            {}, kUsage);
  log_level_from_args(a);
  const auto params = models::model_load(a.need("model"));
  models::engine_config ec;
  ec.policy = policy_from_args(a, "fp32");
  if (a.has("kv")) {
    auto k = models::kv_dtype_parse(a.get("kv"));
    if (!k) throw std::invalid_argument("option --kv: expected f32, bf16 or fp8");
    ec.policy.kv = *k;
    ec.policy.fp8_attention = *k == models::kv_dtype::fp8;
  }
  if (a.has("attention")) {
    const std::string at = a.get("attention");
    if (at != "bf16" && at != "fp8") throw std::invalid_argument("option --attention: expected bf16 or fp8, got '" + at + "'");
    if (at == "fp8" && ec.policy.kv != models::kv_dtype::fp8)
      throw std::invalid_argument("option --attention fp8: needs an FP8 KV cache (--kv fp8 or --policy fp8-kv)");
    ec.policy.fp8_attention = at == "fp8";
  }
  ec.policy.validate();
  const bool fp8_kv = ec.policy.kv == models::kv_dtype::fp8;
  if (a.has("calibration") && !fp8_kv)
    throw std::invalid_argument("option --calibration: only with an FP8 KV cache (--kv fp8, --policy fp8-kv)");
  ec.slots = a.get_int("slots", 8, 1, 4096);
  ec.max_context = a.get_int("max-context", std::min<int64_t>(params.cfg.max_position_embeddings, 2048), 2,
                                params.cfg.max_position_embeddings);
  const auto tok = tokenizer_of(a.need("model"), params.cfg.vocab_size);  // null: the model directory has none
  const auto items = read_token_jsonl(a.need("prompts"), params.cfg.vocab_size, tok.get(), true);
  std::vector<int32_t> stops;
  if (a.has("stop")) {
    const std::string list = a.get("stop");
    if (list.empty() || list.back() == ',')
      throw std::invalid_argument("option --stop: expected token ids separated by commas, got '" + list + "'");
    std::stringstream ss(list);
    std::string t;
    while (std::getline(ss, t, ',')) {
      const auto v = int_of(t);
      if (!v || *v < 0 || *v >= params.cfg.vocab_size)
        throw std::invalid_argument("option --stop: '" + t + "' is not a token id in [0, " +
                                    std::to_string(params.cfg.vocab_size) + ")");
      stops.push_back(static_cast<int32_t>(*v));
    }
  } else if (tok) {
    stops = models::stop_ids(params.cfg, *tok);  // what ends a rollout's response too
  } else {
    for (int64_t id : params.cfg.eos_token_ids) stops.push_back(static_cast<int32_t>(id));
  }
  models::logit_processing proc;
  proc.temperature = static_cast<float>(a.get_num("temperature", 1.0));
  proc.top_k = static_cast<int32_t>(a.get_int("top-k", 0, 0, INT32_MAX));
  proc.top_p = static_cast<float>(a.get_num("top-p", 1.0));
  if (std::string why = models::logit_processing_problem(proc); !why.empty())
    throw std::invalid_argument("options --temperature/--top-k/--top-p: " + why);
  const auto max_tokens = static_cast<int32_t>(a.get_int("max-tokens", 64, 1, INT32_MAX));
  const auto seed = static_cast<uint64_t>(a.get_int("seed", 0, 0));
  with_threads(a, [&] {
    auto be = models::make_cpu_backend();
    models::generation_engine eng(*be, params.cfg, ec);
    for (size_t i = 0; i < items.size(); ++i) {  // every prompt checked before any work
      models::gen_request r;
      r.id = i;
      r.prompt = items[i].tokens;
      r.max_tokens = items[i].max_tokens > 0 ? items[i].max_tokens : max_tokens;
      r.proc = proc;
      r.seed = seed;
      r.stop_tokens = items[i].stop ? *items[i].stop : stops;
      const bool asked = a.has("max-tokens") || items[i].max_tokens > 0;  // the default takes what the context leaves
      if (const int64_t room = ec.max_context - static_cast<int64_t>(r.prompt.size()); asked && room < r.max_tokens && room > 0)
        log_get("generate")->warn("{}:{}: a prompt of {} tokens leaves room for {} of its {} tokens (max context {})",
                                  a.get("prompts"), items[i].line, r.prompt.size(), room, r.max_tokens, ec.max_context);
      try {
        eng.submit(std::move(r));
      } catch (const std::invalid_argument& e) {  // name the input line, not the request id
        throw std::invalid_argument(a.get("prompts") + ":" + std::to_string(items[i].line) + ": " + e.what());
      }
    }
    models::attn_fp8_scales sc;
    if (fp8_kv) {
      kv_calibration calib{{}, a.get("calibration"), false, {}};
      if (a.has("calibration")) {
        for (const auto& it : read_token_jsonl(calib.source, params.cfg.vocab_size, tok.get())) {
          calib.prompts.push_back(it.tokens);
          calib.lines.push_back(it.line);
        }
      } else {
        std::vector<std::vector<int32_t>> prompts;
        for (const auto& it : items) prompts.push_back(it.tokens);
        calib = kv_calibration_prompts(a.get("model"), std::move(prompts), "the prompts");
        if (!calib.from_checkpoint)
          log_get("generate")->warn("FP8 K/V scales from the prompts: each prompt's tokens depend on the others in {} "
                                    "(--calibration FILE gives scales of their own)", a.get("prompts"));
      }
      sc = calibrate_kv(*be, params, ec.policy, calib);
    }
    // tokens carry the checkpoint's weight version (0 for an SFT or HF model); the K/V scales
    // are computed here from those weights, so they are of the same version
    const uint64_t version = models::checkpoint_weight_version(a.get("model"));
    const std::string err = eng.adopt_params(params, version, version, fp8_kv ? &sc : nullptr);
    if (!err.empty()) throw std::runtime_error(err);
    for (const auto& r : eng.run_to_completion()) {
      nlohmann::json out = {{"tokens", r.tokens}, {"logprobs", r.logprobs}, {"weight_version", r.weight_version},
                            {"scale_version", r.scale_version}, {"finish", r.finish}};
      if (tok) out["text"] = tok->decode(r.tokens, true);  // special tokens (the stop token) left out
      std::printf("%s\n", out.dump().c_str());
    }
    auto report = [](const char* what, const std::vector<int64_t>& sat) {  // fp8-numerics.md §8: per layer
      log_get("generate")->info("{} elements saturated: {} (per layer: [{}])", what,
                                std::accumulate(sat.begin(), sat.end(), int64_t{0}), fmt::join(sat, ", "));
    };
    if (ec.policy.kv == models::kv_dtype::fp8) report("FP8 KV cache: K/V", eng.stats().kv_saturated);
    if (ec.policy.fp8_attention) report("FP8 attention: query", eng.stats().q_saturated);
  });
  return 0;
}

}  // namespace fp8rl::cli
