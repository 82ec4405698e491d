// actors/preflight.cpp -- what a run's start checks before its warm start, its run directory and
// its actors: the task's prompts and answers against the model, the KV caches and the learners'
// state against the host's memory, a resumed run's training set and files (run_preflight).
#include "actors/preflight.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "actors/run_dir.hpp"
#include "models/bundle.hpp"
#include "models/checkpoint.hpp"
#include "models/generate.hpp"
#include "models/json_io.hpp"
#include "models/log.hpp"
#include "models/params.hpp"

namespace fp8rl::actors {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Every prompt of a split encodes and fits the context with its longest response (a rollout
// failing on one lost every rollout; a prompt leaving room for one token trained on reward 0,
// silently); every run ends with a validation, also with eval_every = 0.
void prompts_fit(const run_config& cfg, const models::dataset& d, const models::tokenizer& tok) {
  for (size_t i = 0; i < d.items.size(); ++i) {  // example_where names the split of a built-in task
    const std::vector<int32_t> ids = models::example_encode(d, i, tok, false);
    if (static_cast<int64_t>(ids.size()) + cfg.max_new_tokens > cfg.max_context)
      throw std::invalid_argument(models::example_where(d, i) + ": prompt of " + std::to_string(ids.size()) +
                                  " tokens + rollout.max_new_tokens " + std::to_string(cfg.max_new_tokens) +
                                  " do not fit model.max_context " + std::to_string(cfg.max_context));
  }
}

// The fewest tokens a response the verifier accepts for `answer` takes (each accepted form, also
// after a space: BPE vocabularies hold " 42"), 0 where the tokenizer encodes none of them.
size_t answer_tokens(const models::tokenizer& tok, models::verifier_kind vk, const std::string& answer) {
  size_t best = 0;
  for (const auto& f : models::answer_forms(vk, answer))
    for (const std::string& text : {f, " " + f}) {
      try {
        const size_t n = tok.encode(text, false).size();
        if (best == 0 || n < best) best = n;
      } catch (const std::invalid_argument&) {  // a character it lacks: not this form
      }
    }
  return best;
}

// Answers no response can be rewarded for -- under the numeric verifier no number; longer than
// rollout.max_new_tokens in every accepted form, or not encodable by the tokenizer -- each counted
// once, by its first reason: refused when that is every training answer (builtin:mul6 under
// the default 5 tokens trained on reward 0), else a warning with each reason's count and first
// example ('two' was counted by both checks, a too-long answer's length not shown).
void answers_fit(const run_config& cfg, const models::dataset& d, const models::tokenizer& tok, bool val) {
  const auto vk = recipe_rl_config(cfg).verifier;
  struct kind { size_t count = 0; std::string first; const char* fix; };
  kind kinds[2] = {{0, "", "use task.verifier = exact"}, {0, "", "raise rollout.max_new_tokens (and model.max_context with it)"}};
  for (size_t i = 0; i < d.items.size(); ++i) {
    const std::string& ans = d.items[i].answer;
    std::string why;
    int k = 0;
    if (vk == models::verifier_kind::numeric && !models::answer_is_number(ans)) {
      why = "not a number under task.verifier = numeric";
    } else {
      k = 1;
      const size_t n = answer_tokens(tok, vk, ans);
      if (n == 0) why = "not encodable by the tokenizer";
      else if (static_cast<int64_t>(n) > cfg.max_new_tokens)
        why = std::to_string(n) + " tokens, more than rollout.max_new_tokens " + std::to_string(cfg.max_new_tokens);
    }
    if (!why.empty() && kinds[k].count++ == 0) kinds[k].first = models::example_where(d, i) + ", '" + ans + "', " + why;
  }
  const size_t count = kinds[0].count + kinds[1].count;
  if (count == 0) return;
  std::string what = std::to_string(count) + " of " + std::to_string(d.items.size()) + (val ? " validation" : " training") +
                     " answers can never be rewarded";
  std::string fix;
  for (const auto& k : kinds) {
    if (!k.count) continue;
    what += fix.empty() ? (k.count == count ? " (" : ": " + std::to_string(k.count) + " (") : " and " + std::to_string(k.count) + " (";
    what += "the first: " + k.first + ")";
    fix += (fix.empty() ? "" : "; ") + std::string(k.fix);
  }
  if (!val && count == d.items.size()) throw std::invalid_argument(what + ": " + fix);
  log_get("train")->warn("{}", what);
}

// precision.bf16_names that keep nothing BF16 in `model` are refused, naming the model.
void bf16_names_check(const models::precision_policy& p, const models::model_config& model, const std::string& which) {
  if (const std::string n = p.bf16_name_unmatched(model); !n.empty())
    throw std::invalid_argument("precision.bf16_names: '" + n + "' names no linear layer of " + which + " (" +
                                std::to_string(model.num_hidden_layers) +
                                " layers; names are parts of model.layers.L.self_attn.{q,k,v,o}_proj / mlp.{gate,up,down}_proj)");
}

// The generation engines and learners of the nodes on one host: a host is its topology name,
// this machine's names (127/8, ::1, localhost, its hostname) one. Loopback names are the machine
// caf-run runs on (it starts those nodes itself, the others by ssh): this machine only for a node
// on loopback itself -- a remote node counted the controller's engines, left at 127.0.0.1, as its
// own. (A node that names the launcher by its hostname leaves out the loopback ones; their own
// check counts it.)
struct host_tally {
  std::string host, names;  // the host as named in messages; its nodes
  double rollouts = 0, learners = 0;
  bool rank0 = false;  // learner0 (validation engine, calibration snapshot, the audit) is here
};

host_tally host_tally_of(const topology& t, const std::string& node) {
  const std::string own = t.find(node)->host;
  host_tally h;
  h.host = host_is_loopback(own) ? "127.0.0.1" : own;
  auto host_of = [&](const std::string& name) -> std::string {
    if (host_is_loopback(name)) return host_is_loopback(own) ? h.host : "loopback (caf-run's machine)";
    return host_same_machine(name) ? h.host : name;
  };
  const auto idx = index_nodes(t);
  for (const auto& n : t.nodes)
    if (host_of(n.host) == h.host) {
      h.rollouts += double(n.rollouts.size());
      h.learners += double(n.learners.size());
      h.rank0 = h.rank0 || (!n.learners.empty() && idx.at(n.name).first_learner == 0);
      h.names += (h.names.empty() ? "" : ", ") + n.name;
    }
  return h;
}

// The parts of a host's need (bytes; see host_memory_check), and the engines counted.
struct host_need {
  double kv = 0, weights = 0, state = 0, held = 0, ref = 0, engines = 0, audited = 0;
  int64_t params = 0;    // the model's parameters
  bool at_eval = false;  // the peak is learner0's validation, not a step's gradients
  double total() const { return kv + weights + state + held + ref; }
};

host_need host_need_of(const run_config& cfg, const models::model_config& model, const host_tally& h, uint64_t start_version) {
  const auto ec = recipe_engine_config(cfg);
  host_need n;
  n.params = models::model_param_layout(model).total;
  const double copy = 4.0 * double(n.params);  // one FP32 copy of the weights
  const double kv1 = models::engine_kv_bytes(model, ec), w1 = models::bundle_bytes(model, ec.policy), r0 = h.rank0;
  const uint64_t left = static_cast<uint64_t>(cfg.steps) > start_version ? static_cast<uint64_t>(cfg.steps) - start_version : 0;
  n.audited = cfg.audit_every > 0 ? r0 * double(std::min(static_cast<uint64_t>(cfg.max_staleness), left)) : 0;
  const double step = h.learners * copy, eval = r0 * (kv1 + w1 + copy) + (cfg.eval_every > 0 ? (h.learners - r0) * copy : 0);
  n.at_eval = h.rank0 && eval >= step;
  n.engines = h.rollouts + (n.at_eval ? 1 : 0);
  n.kv = n.engines * kv1;
  n.weights = n.engines * w1;
  n.state = h.learners * 3 * copy + r0 * copy + (n.at_eval ? eval - kv1 - w1 : step);
  n.held = n.audited * copy;
  n.ref = cfg.kl_beta > 0 ? h.learners * copy : 0;
  return n;
}

}  // namespace

// What a host's memory must hold for a run, at the least and at its peak, named by the keys that
// size it: each rollout's generation engine (its KV cache, allocated up front, and its weights: at
// least the bundle's bytes under the generation policy); each learner rank's master weights and
// AdamW's two moments (FP32), the KL reference (grpo.kl_beta > 0); rank 0's copy of the weights
// for calibration and the audit's copies of the last async.max_staleness versions (audit.every >
// 0; as many as steps are left). On top, the larger of a step's gradients (one FP32 copy a rank)
// and learner0's validation -- its engine and a copy of the weights, after its step (its gradients
// freed), while with eval.every > 0 the other ranks may hold their next step's. Compute weights,
// activations and messages come on top. Each engine checked its own cache, and two that each fit
// were killed by the OOM killer; a learner ran out of memory only at its first steps. (Devices
// other than cpu are refused before: a GPU backend's state would not all be host memory.) Returns
// the need, itemized, for the start's log: from the host's first node, "" from the others and
// where nothing is counted.
std::string host_memory_check(const run_config& cfg, const models::model_config& model, const topology& t, const std::string& node,
                              uint64_t start_version) {
  const host_tally h = host_tally_of(t, node);
  const host_need n = host_need_of(cfg, model, h, start_version);
  const double need = n.total(), ram = models::machine_memory_bytes(), gib = double(1 << 30);
  auto text = [&](double bytes) {
    return bytes < gib / 10 ? fmt::format("{:.1f} MiB", bytes / (1 << 20)) : fmt::format("{:.1f} GiB", bytes / gib);
  };
  std::string parts, fixes;  // every part; the fixes of those that are a tenth of the need or more
  auto part = [&](double bytes, const std::string& what, const char* fix) {
    if (bytes <= 0) return;
    parts += fmt::format("{}{} {}", parts.empty() ? "" : "; ", what, text(bytes));
    if (bytes >= need / 10 && *fix) fixes += (fixes.empty() ? "" : "; ") + std::string(fix);
  };
  part(n.kv,
       fmt::format("rollout.slots {} x model.max_context {}: the KV caches of the {} generation engine(s) ({} rollout(s){})",
                   cfg.slots, cfg.max_context, n.engines, h.rollouts, n.at_eval ? ", learner0's validation" : ""),
       "lower rollout.slots or model.max_context");
  part(n.weights, fmt::format("the weights of the {} generation engine(s) under precision.generation {}", n.engines, cfg.generation),
       h.rollouts > 0 ? "place rollouts on other hosts" : "");
  const std::string transient = !n.at_eval                                         ? "gradients"
                                : cfg.eval_every > 0 && h.learners > double(h.rank0) ? "learner0's copy for validation, the other ranks' gradients"
                                                                                     : "learner0's copy for validation";
  part(n.state,
       fmt::format("the FP32 state of {} learner(s) ({} parameters: master weights, AdamW moments, {}{})", h.learners,
                   n.params, transient, h.rank0 ? ", rank 0's copy for calibration" : ""),
       "place learners on other hosts");
  part(n.held, fmt::format("audit.every {}: the audit's copies of {} version(s) (async.max_staleness {})", cfg.audit_every, n.audited,
                           cfg.max_staleness),
       "set audit.every = 0 or lower async.max_staleness");
  part(n.ref, "grpo.kl_beta: the reference weights of each learner", "set grpo.kl_beta = 0");
  if (ram <= 0 || need <= ram) {  // said by the host's first node (its other processes count the same)
    if (parts.empty() || h.names.substr(0, h.names.find(',')) != node) return "";
    return fmt::format("host {} (node(s) {}): at least {} of {} for the run: {}", h.host, h.names, text(need),
                       ram > 0 ? fmt::format("its {:.1f} GiB", ram / gib) : std::string("its memory (unknown)"), parts);
  }
  throw std::invalid_argument(fmt::format("host {} (node(s) {}) needs at least {}, more than its {:.1f} GiB: {}: {}", h.host, h.names,
                                          text(need), ram / gib, parts, fixes));
}

// The built-in model (model.init = tiny) of a run: its size, the built-in task's characters, and
// positions for the run's context.
models::model_config builtin_model_config(const run_config& cfg, const models::tokenizer& tok) {
  return models::model_config_builtin(cfg.size, tok.vocab_size(), std::max<int64_t>(64, cfg.max_context), tok.bos, tok.eos);
}

// Both splits' prompts and answers (a task file is both splits: its answers are counted once).
// Returns the training split (train_set_check's, read once).
models::dataset examples_fit_check(const run_config& cfg, const models::tokenizer& tok) {
  const auto task = models::task_spec_parse(cfg.task);
  models::dataset train;
  for (const bool val : {false, true}) {
    auto d = models::task_load(task, val, val ? cfg.val_size : cfg.train_size, static_cast<uint64_t>(cfg.seed));
    prompts_fit(cfg, d, tok);
    if (!val || task.builtin) answers_fit(cfg, d, tok, val);
    if (!val) train = std::move(d);
  }
  return train;
}

// What the built-in model's SFT warm start (seconds to minutes) would only be followed by a
// refusal of: the task's prompts and answers against the context and responses, and the KV
// caches and learners against the host's memory (run_preflight checks other models').
void warm_start_check(const run_config& cfg, const topology& t, const std::string& node) {
  const auto tok = models::char_tokenizer_make(models::arithmetic_alphabet());
  bf16_names_check(recipe_rl_config(cfg).gen_policy, builtin_model_config(cfg, *tok), "the built-in model");
  examples_fit_check(cfg, *tok);
  (void)host_memory_check(cfg, builtin_model_config(cfg, *tok), t, node, 0);  // (a fresh run; its start logs the need)
}

// A resumed run goes on at its checkpoint's prompt cursor: in another training set (a task file
// edited, its lines reordered) that is other prompts, and the run was no longer the one resumed.
// Checkpoints made before train_set was recorded are resumed with a warning.
//   now: the training split as loaded for this run
void train_set_check(const actor_env& env, const models::dataset& now) {
  const std::string sp = (fs::path(env.init_dir) / "state.json").string();
  const json state = models::json_file_read(sp);
  if (!state.contains("train_set")) {
    log_get("train")->warn("{}: no train_set recorded (a checkpoint of an earlier fp8rl); {} is not checked against it", sp,
                           env.cfg.task);
    return;
  }
  const json& t = state["train_set"];
  if (!t.is_object() || !t.contains("examples") || !t["examples"].is_number_unsigned() || !t.contains("fingerprint") ||
      !t["fingerprint"].is_string())
    throw std::invalid_argument(sp + ": key 'train_set' must be {\"examples\": N, \"fingerprint\": \"HEX\"}");
  const uint64_t n = t["examples"].get<uint64_t>();
  const std::string fp = t["fingerprint"].get<std::string>(), fp_now = models::dataset_fingerprint(now);
  if (n == now.items.size() && fp == fp_now) return;
  throw std::invalid_argument("--resume: the training set " + env.cfg.task + " is not the one " + env.init_dir +
                              " was trained on (" + std::to_string(n) + " examples, fingerprint " + fp + "; now " +
                              std::to_string(now.items.size()) + ", " + fp_now +
                              "): its prompt cursor would go on in other prompts. Restore it, or start a new run from "
                              "these weights: --model.init=" + env.init_dir);
}

// Reads here, on the main thread, what the actors would otherwise fail on inside their
// behaviors (an exception there is CAF's "unhandled exception", and a dataset error inside one
// left the run hanging): the start checkpoint (weights, optimizer, state), the tokenizer against
// the model's vocabulary, both task splits (resumed: the training set against the checkpoint's),
// and metrics.jsonl for appending (a resumed run drops a partial last line a crash left, with a
// warning; a restarted one -- resumed before its first checkpoint -- every line).
void run_preflight(const actor_env& env, bool resume, bool restart) {
  // a run starts from a training checkpoint or a model directory (a Hugging Face download); a
  // resumed one from its own checkpoint, a restarted one from its start
  const bool from_checkpoint = resume && !restart;
  const auto start = models::checkpoint_load(env.init_dir, from_checkpoint ? models::checkpoint_kind::training : models::checkpoint_kind::model_ok);
  if (env.cfg.max_context > env.model.max_position_embeddings)  // each rollout's engine refused it, and was restarted
    throw std::invalid_argument("model.max_context = " + std::to_string(env.cfg.max_context) + " exceeds " + env.init_dir +
                                "/config.json's max_position_embeddings " + std::to_string(env.model.max_position_embeddings));
  bf16_names_check(env.rl.gen_policy, env.model, env.init_dir + "/config.json");
  // layers kept BF16 beyond the model's: every rollout refused its bundle at the first step
  if (env.cfg.bf16_first > env.model.num_hidden_layers || env.cfg.bf16_last > env.model.num_hidden_layers)
    throw std::invalid_argument("precision.bf16_first/bf16_last (" + std::to_string(env.cfg.bf16_first) + ", " +
                                std::to_string(env.cfg.bf16_last) + ") exceed " + env.init_dir + "/config.json's " +
                                std::to_string(env.model.num_hidden_layers) + " layers");
  if (from_checkpoint)
    for (const auto& seq : calibration_batch_load(env.init_dir))
      for (int32_t t : seq)
        if (t >= env.model.vocab_size)
          throw std::invalid_argument(env.init_dir + "/calibration.jsonl: token id " + std::to_string(t) +
                                      " is outside the vocabulary (" + std::to_string(env.model.vocab_size) + ")");
  if (env.cfg.kl_beta > 0 && env.ref_dir != env.init_dir) {
    const auto ref = models::checkpoint_load(env.ref_dir, models::checkpoint_kind::model_ok);
    if (ref.params.data.size() != start.params.data.size())
      throw std::invalid_argument(env.ref_dir + ": the KL reference (grpo.kl_beta > 0) does not have the shape of " + env.init_dir);
  }
  models::tokenizer_vocab_check(*env.tok, env.model.vocab_size, env.init_dir);
  if (resume || env.cfg.init != "tiny") {  // train_main checked the tiny model's
    const auto train = examples_fit_check(env.cfg, *env.tok);
    if (from_checkpoint && env.start_version > 0) train_set_check(env, train);
  }
  const fs::path metrics = fs::path(env.run_dir) / "metrics.jsonl";
  if (fs::exists(metrics) && !fs::is_regular_file(metrics)) throw std::invalid_argument(metrics.string() + ": not a file");
  if (resume && fs::exists(metrics))
    if (const int64_t moved = metrics_trim_for_resume(metrics.string(), env.start_version); moved > 0)
      log_get("train")->warn("{}: {} line(s) {} moved to {}.discarded", metrics.string(), moved,
                             restart ? std::string("of the steps before the restart")
                                     : fmt::format("after checkpoint v{} (or cut by an interrupted run)", env.start_version),
                             metrics.string());
  // the controller reads the kept rows back (health gates): a line it cannot read is named here
  if (resume && env.start_version > 0 && fs::exists(metrics)) metrics_rows_each(metrics.string(), [](uint64_t, const auto&) {});
  std::ofstream probe(metrics, std::ios::app);
  if (!probe) throw std::invalid_argument(metrics.string() + ": cannot open for writing");
}

}  // namespace fp8rl::actors
