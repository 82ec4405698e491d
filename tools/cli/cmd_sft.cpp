// tools/cli/cmd_sft.cpp -- `fp8rl sft` (supervised warm start on task demonstrations) and
// `fp8rl eval` (validation accuracy); options: kSftUsage and kEvalUsage below, printed by --help.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "actors/run_dir.hpp"
#include "models/checkpoint.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/log.hpp"
#include "models/rl/rl.hpp"
#include "tools/cli/commands.hpp"
#include "tools/cli/common.hpp"

namespace fp8rl::cli {
namespace {
const char* const kSftUsage =
    "usage: fp8rl sft --out DIR [options]\n"
    "Supervised warm start on a task's demonstrations. Without --model a tiny model is initialized\n"
    "from the seed (built-in character tokenizer for built-in tasks; --tokenizer PATH for your own).\n"
    "Writes a checkpoint directory (config.json, model.safetensors, optimizer state, the tokenizer)\n"
    "that score, generate, eval and train load.\n"
    "  --out DIR                the checkpoint to write; refused if DIR exists (without --overwrite)\n"
    "  --overwrite              replace DIR if it is an fp8rl checkpoint (it has state.json) and not\n"
    "                           --model or --tokenizer\n"
    "  --task T                 builtin:add2 (default) | builtin:add1..add6, mul1..mul6 | FILE.jsonl ({\"prompt\", \"answer\"} lines)\n"
    "  --model DIR              start from this checkpoint instead of a fresh tiny model\n"
    "  --size S                 the fresh model's size: tiny (default) | small\n"
    "  --max-context N          the fresh model's max_position_embeddings (default 64); fp8rl train's\n"
    "                           model.max_context cannot exceed it\n"
    "  --tokenizer PATH         tokenizer.json or a directory holding one (dataset tasks without --model)\n"
    "  --steps N                optimizer steps (default 450)\n"
    "  --batch N                sequences per step (default 64)\n"
    "  --lr X                   AdamW learning rate (default 2e-3)\n"
    "  --policy P               training precision: fp8 (default) | fp32 | bf16, each also as P-tiles\n"
    "  --bf16-layers F,L        keep the first F and last L layers BF16 (fp8 policies)\n"
    "  --scale-mode M           pow2 (default) | fp32\n"
    "  --seed S                 initialization and data order (default 1)\n"
    "  --threads N              oneTBB threads (default 0: all cores)\n"
    "  --log-level L            trace | debug | info (default) | warn | error | off (also the progress lines)\n";
const char* const kEvalUsage =
    "usage: fp8rl eval --model DIR [options]\n"
    "Validation accuracy of a checkpoint: greedy and sampled pass@1 on the task's validation split,\n"
    "printed as one JSON line {\"greedy_accuracy\", \"sampled_accuracy\", \"n\"}.\n"
    "  --model DIR              checkpoint with a tokenizer\n"
    "  --task T                 builtin:add2 (default) | builtin:add1..add6, mul1..mul6 | FILE.jsonl\n"
    "  --verifier V             numeric (default for built-in tasks) | exact (default for files)\n"
    "  --n N                    validation items (default 400; a file task: its first N lines, default all)\n"
    "  --max-tokens N           per answer (default 16)\n"
    "  --policy P               generation precision: fp8 (default) | fp32 | bf16 | fp8-kv, each also as P-tiles;\n"
    "                           fp8-kv's K/V scales: from the checkpoint's calibration batch (fp8rl train's\n"
    "                           checkpoints), else from the validation prompts\n"
    "  --bf16-layers F,L        keep the first F and last L layers BF16 (fp8 policies)\n"
    "  --scale-mode M           pow2 (default) | fp32\n"
    "  --seed S                 validation split and sampling seed (default 1)\n"
    "  --threads N              oneTBB threads (default 0: all cores)\n"
    "  --log-level L            trace | debug | info (default) | warn | error | off\n";

// --out is written by replacing the directory (models/checkpoint.cpp): refused where that would
// delete something that is not an earlier checkpoint of ours -- a file, any directory without
// --overwrite, a directory without state.json, or the model or tokenizer this run reads.
void out_check(const std::string& out, const args& a) {
  namespace fs = std::filesystem;
  if (!fs::exists(out)) return;
  if (!fs::is_directory(out)) throw std::invalid_argument("option --out: " + out + " exists and is not a directory");
  if (!a.flags.count("overwrite"))
    throw std::invalid_argument("option --out: " + out + " exists (--overwrite replaces an fp8rl checkpoint)");
  if (!fs::exists(fs::path(out) / "state.json"))
    throw std::invalid_argument("option --out: " + out + " is not an fp8rl checkpoint (no state.json): not replaced");
  const fs::path dir = fs::weakly_canonical(out);
  for (const char* src : {"model", "tokenizer"})
    if (a.has(src))
      for (fs::path p = fs::weakly_canonical(a.get(src)); !p.empty() && p != p.root_path(); p = p.parent_path())
        if (p == dir) throw std::invalid_argument("option --out: " + out + " holds the --" + src + " this run reads: not replaced");
}
}  // namespace

int cmd_sft(int argc, char** argv) {
  const args a = args_parse(argc, argv, 2,
                            {"out", "task", "model", "tokenizer", "steps", "batch", "lr", "policy", "bf16-layers",
                             "scale-mode", "seed", "threads", "size", "max-context", "log-level"},
                            {"overwrite"}, kSftUsage);
  log_level_from_args(a);
  const std::string out = a.need("out");
  out_check(out, a);  // before training, not after

  for (const char* fresh : {"size", "max-context"})
    if (a.has(fresh) && a.has("model"))
      throw std::invalid_argument(std::string("options --") + fresh + " and --model: --" + fresh + " shapes a fresh model");
  const auto task = models::task_spec_parse(a.get("task", "builtin:add2"));
  const uint64_t seed = static_cast<uint64_t>(a.get_int("seed", 1, 0));
  std::unique_ptr<models::tokenizer> tok;
  std::string alphabet;
  if (a.has("tokenizer")) tok = models::tokenizer_load(a.get("tokenizer"));
  else if (a.has("model")) tok = models::tokenizer_load(a.get("model"));
  else if (task.builtin) tok = models::char_tokenizer_make(alphabet = models::arithmetic_alphabet());
  else throw std::invalid_argument("a dataset task needs --tokenizer (or --model with a tokenizer)");
  models::checkpoint ck;
  if (a.has("model")) {
    ck.params = models::model_load(a.get("model"));
  } else {
    ck.params = models::model_params_init(
        models::model_config_builtin(a.get("size", "tiny"), tok->vocab_size(), a.get_int("max-context", 64, 8, 1 << 20),
                                     tok->bos, tok->eos),
        seed);
  }
  models::tokenizer_vocab_check(*tok, ck.params.cfg.vocab_size, a.get("tokenizer", a.get("model", "the built-in tokenizer")));
  const models::dataset data = models::task_load(task, false, 4000, seed);
  models::sft_config sc;
  sc.steps = a.get_int("steps", 450, 1, INT32_MAX);
  sc.batch = a.get_int("batch", 64, 1, 1 << 20);
  sc.opt.lr = static_cast<float>(a.get_num("lr", 2e-3, 1e-12, 10.0));
  sc.seed = seed;
  sc.policy = training_policy_from_args(a, "fp8");
  try {  // where the save cannot go (a read-only filesystem), before training: it failed after it
    models::checkpoint_save_check(out);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("option --out: ") + e.what());
  }
  with_threads(a, [&] {
    models::sft_train(ck.params, ck.opt, data, *tok, sc, [&](int64_t step, double loss) {
      if (step % 50 == 0 || step + 1 == sc.steps) log_get("sft")->info("sft step {}/{} loss {:.4f}", step + 1, sc.steps, loss);
    });
  });
  ck.state_json = nlohmann::json{{"phase", "sft"}, {"task", a.get("task", "builtin:add2")}}.dump();
  // the tokenizer goes into the checkpoint before it replaces `out` (which may be its source)
  models::checkpoint_save(out, ck, [&](const std::string& tmp) {
    if (!alphabet.empty()) return models::char_tokenizer_save(tmp, alphabet);
    if (a.has("tokenizer") || a.has("model")) models::tokenizer_copy(a.has("tokenizer") ? a.get("tokenizer") : a.get("model"), tmp);
  });
  log_get("sft")->info("wrote {}", out);
  return 0;
}

int cmd_eval(int argc, char** argv) {
  const args a = args_parse(argc, argv, 2,
                            {"model", "task", "verifier", "policy", "bf16-layers", "scale-mode", "max-tokens", "seed",
                             "threads", "n", "log-level"},
                            {}, kEvalUsage);
  log_level_from_args(a);
  const uint64_t seed = static_cast<uint64_t>(a.get_int("seed", 1, 0));  // options first, then files
  const int64_t n = a.get_int("n", 400, 1, 1 << 24);
  const auto max_tokens = static_cast<int32_t>(a.get_int("max-tokens", 16, 1, 1 << 20));
  const auto params = models::model_load(a.need("model"));
  const auto tok = models::tokenizer_load(a.need("model"));
  models::tokenizer_vocab_check(*tok, params.cfg.vocab_size, a.need("model"));
  const auto task = models::task_spec_parse(a.get("task", "builtin:add2"));
  models::dataset val = models::task_load(task, true, n, seed);
  if (!task.builtin && a.has("n") && static_cast<int64_t>(val.items.size()) > n) val.items.resize(static_cast<size_t>(n));  // it read all
  const auto vk = models::verifier_parse(a.get("verifier", task.builtin ? "numeric" : "exact"));
  if (!vk) throw std::invalid_argument("option --verifier: expected exact or numeric");
  models::eval_result r;
  with_threads(a, [&] {
    auto be = models::make_cpu_backend();
    models::engine_config ec;
    ec.slots = 64;
    ec.max_context = params.cfg.max_position_embeddings;
    ec.policy = policy_from_args(a, "fp8");
    models::generation_engine eng(*be, params.cfg, ec);
    // FP8 KV: Q/K/V scales from the batch the run calibrated this checkpoint on (a train
    // checkpoint's calibration.jsonl: the scales its rollouts had); else from the validation prompts
    const bool fp8_kv = ec.policy.kv == models::kv_dtype::fp8;
    models::attn_fp8_scales sc;
    if (fp8_kv) {
      std::vector<std::vector<int32_t>> val_prompts;
      for (const auto& item : val.items) val_prompts.push_back(tok->encode(item.prompt, true));
      const auto calib = kv_calibration_prompts(a.get("model"), std::move(val_prompts), "the validation prompts");
      sc = calibrate_kv(*be, params, ec.policy, calib);
    }
    const std::string err = eng.adopt_params(params, 0, 0, fp8_kv ? &sc : nullptr);
    if (!err.empty()) throw std::runtime_error(err);
    r = models::evaluate(eng, val, *tok, *vk, max_tokens, seed);
  });
  std::printf("{\"greedy_accuracy\": %.6f, \"sampled_accuracy\": %.6f, \"n\": %ld}\n", r.greedy_accuracy,
              r.sampled_accuracy, long(r.n));
  return 0;
}

}  // namespace fp8rl::cli
