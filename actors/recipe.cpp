// actors/recipe.cpp -- the key table, file/CLI application, validation, dump.
#include "actors/recipe.hpp"

#include "models/log.hpp"
#include "models/json_io.hpp"
#include "models/sampling.hpp"

#include <caf/actor_system_config.hpp>
#include <caf/config_value.hpp>

#include <algorithm>
#include <charconv>
#include <climits>
#include <map>
#include <fstream>
#include <filesystem>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

namespace fp8rl::actors {

std::vector<recipe_key> recipe_keys(run_config& r) {
  return {
      {"run", "name", &r.name, "run name (the run directory runs/NAME, checkpoints' state.json)"},
      {"run", "seed", &r.seed, "seed of data order, init and sampling"},
      {"run", "steps", &r.steps, "optimizer steps (GRPO steps) to run"},
      {"run", "eval_every", &r.eval_every, "validation accuracy every N steps (0: only at the end)"},
      {"run", "checkpoint_every", &r.checkpoint_every, "checkpoint every N steps (0: only at the end); also at the step where a signal stops the run"},
      {"run", "keep_checkpoints", &r.keep_checkpoints, "checkpoints kept: the newest N (by step) in checkpoints/, older ones removed after each save (0: all)"},
      {"run", "collective_timeout_s", &r.collective_timeout_s,
       "seconds a learner rank waits for the others in an all-reduce within a step (several learners: a rank whose shard took "
       "longer, a large model's step on CPUs); once connected, a rank whose process ended fails the others at once"},
      {"run", "log_level", &r.log_level, "trace, debug, info, warn, error, off"},
      {"model", "init", &r.init, "'tiny' (built-in model + SFT warm start) or a Hugging Face model directory"},
      {"model", "size", &r.size, "built-in model size for init = tiny: tiny (hidden 128, 2 layers) or small (hidden 512, 8 layers)"},
      {"model", "sft_steps", &r.sft_steps, "SFT warm-start steps for model.init = tiny"},
      {"model", "sft_batch", &r.sft_batch, "SFT batch (sequences)"},
      {"model", "sft_lr", &r.sft_lr, "SFT learning rate"},
      {"model", "max_context", &r.max_context, "rollout KV-cache context per sequence (tokens)"},
      {"task", "name", &r.task, "builtin:add1..6 / builtin:mul1..6, or a JSONL file {prompt, answer}"},
      {"task", "verifier", &r.verifier, "exact or numeric"},
      {"task", "val_size", &r.val_size, "validation examples (built-in tasks)"},
      {"task", "train_size", &r.train_size, "training examples (built-in tasks)"},
      {"rollout", "prompts_per_step", &r.prompts_per_step, "prompts per optimizer step"},
      {"rollout", "group_size", &r.group_size, "completions per prompt (G)"},
      {"rollout", "max_new_tokens", &r.max_new_tokens, "generation length limit"},
      {"rollout", "temperature", &r.temperature, "sampling temperature (g_t is taken after it)"},
      {"rollout", "top_k", &r.top_k, "top-k (0: off)"},
      {"rollout", "top_p", &r.top_p, "top-p (1: off)"},
      {"rollout", "slots", &r.slots, "continuous-batching slots per rollout actor"},
      {"rollout", "kv_policy", &r.kv_policy, "KV cache on weight adoption: recompute or keep"},
      {"precision", "generation", &r.generation, "generation policy: fp32, bf16, fp8, fp8-kv (bf16/fp8/fp8-kv + -tiles: AMX tile GEMMs)"},
      {"precision", "training", &r.training, "training policy: fp32, bf16, fp8 (bf16/fp8 + -tiles: AMX tile GEMMs)"},
      {"precision", "scale_mode", &r.scale_mode, "pow2 or fp32 (run-wide)"},
      {"precision", "bf16_first", &r.bf16_first, "first N transformer layers kept BF16 (both sides)"},
      {"precision", "bf16_last", &r.bf16_last, "last N transformer layers kept BF16 (both sides)"},
      {"precision", "bf16_names", &r.bf16_names, "linear layers kept BF16 by name (both sides; NeMo RL's "
       "quantization_ignored_layer_kws): comma-separated substrings of 'model.layers.L.PROJ', e.g. \"mlp.down_proj,layers.0.\""},
      {"grpo", "normalize_std", &r.normalize_std, "divide advantages by the group std"},
      {"grpo", "leave_one_out", &r.leave_one_out, "baseline and std of the group's other rewards (NeMo RL's "
       "use_leave_one_out_baseline; its std is their population std)"},
      {"grpo", "share_prompts", &r.share_prompts, "learner runs a group's common prompt once (logprobs unchanged bit for bit)"},
      {"grpo", "clip_low", &r.clip_low, "PPO clip epsilon below (binds only when r = exp(c - p) moves from 1: fp8rl takes one optimizer step per batch with p = c, rl-algorithm.md section 4, so r = 1 and the clip never binds; clip_fraction reads 0)"},
      {"grpo", "clip_high", &r.clip_high, "PPO clip epsilon above (as clip_low: inert while r = 1)"},
      {"grpo", "dual_clip", &r.dual_clip, "dual clip c (> 1 enables; as clip_low: inert while r = 1)"},
      {"grpo", "is_mode", &r.is_mode, "importance sampling: none, tis, icepop, seq-mask-tis"},
      {"grpo", "is_lo", &r.is_lo, "lower IS bound (>= 0; icepop and seq-mask-tis given neither bound take [0.5, 5] and [0.999, 1.002])"},
      {"grpo", "is_hi", &r.is_hi, "upper IS bound C (> 0)"},
      {"grpo", "kl_beta", &r.kl_beta, "k3 KL penalty to the initial policy (0: off)"},
      {"grpo", "seq_logprob_error_threshold", &r.seq_logprob_error_threshold, "drop sequences whose error e_i is above (0: off; else >= 1)"},
      {"optim", "lr", &r.lr, "AdamW learning rate"},
      {"optim", "beta1", &r.beta1, "AdamW beta1"},
      {"optim", "beta2", &r.beta2, "AdamW beta2"},
      {"optim", "eps", &r.eps, "AdamW epsilon"},
      {"optim", "weight_decay", &r.weight_decay, "decoupled weight decay (matrices)"},
      {"optim", "grad_clip", &r.grad_clip, "global-norm clip (0: off)"},
      {"async", "max_staleness", &r.max_staleness, "max learner_version - weight_version admitted (0 = synchronous)"},
      {"calibration", "percentile", &r.percentile, "Q/K/V amax percentile over calibration forwards"},
      {"calibration", "margin", &r.margin, "scale = amax * margin / 448"},
      {"audit", "every", &r.audit_every, "re-score sampled trajectories at their behaviour version every N steps (0: off): audit/staleness_kl, "
       "audit/precision_kl, and with FP8 generation audit/weight_quant_kl and audit/kernel_kv_kl (its two parts; "
       "KL estimates of parts, not additive), and audit/learner_token_mult_prob_error and audit/learner_gen_kl_error "
       "(under the learner's own policy: what the health gates read); each token at the version it was sampled under "
       "(one trajectory of each prompt's group in turn, one batched forward per version; learner0 keeps a copy of the last "
       "max_staleness versions' master weights); a trajectory whose KV cache was kept across an adoption, or with a version no longer held, is "
       "skipped, counted (audit/skipped_kept_kv, audit/skipped_not_held)"},
      {"audit", "samples", &r.audit_samples, "trajectories per audit"},
      {"trace", "enabled", &r.trace, "write per-process trace events (runs/<dir>/traces)"},
      {"trace", "max_mb", &r.trace_max_mb, "a process's trace file stops at this size (MiB; ~50 KB a step of the default run), one warning says so (0: no cap)"},
      {"health", "gates", &r.health_gates, "generation-vs-training mismatch gates (rl-algorithm.md section 7) on precision and "
       "kernels alone (health.source): fail (the run stops, named), warn, or off"},
      {"health", "source", &r.health_source, "what the gates read: trained (by_staleness/0/*: the tokens sampled under the "
       "trained weights; an asynchronous run has them in few steps), audit (audit/learner_*: audited tokens of every "
       "staleness re-scored under the learner's policy at their own version; needs audit.every, and every = 1 judges every "
       "step), or auto (audit where audit.every is set and async.max_staleness > 0, else trained)"},
      {"health", "min_steps", &r.health_min_steps, "the gates judge a run once it has this many steps counted (steps with what "
       "health.source reads)"},
      {"health", "tmpe_median_max", &r.tmpe_median_max, "median token_mult_prob_error limit (0: 1.1, or 2.0 with an FP8 KV cache)"},
      {"health", "tmpe_steps_above_max", &r.tmpe_steps_above_max, "fraction of steps allowed a token_mult_prob_error above 1.1 "
       "(not with an FP8 KV cache)"},
      {"health", "gen_kl_mean_max", &r.gen_kl_mean_max, "mean gen_kl_error limit over the first min_steps steps (not with an FP8 KV cache)"},
  };
}

namespace {

// "a,b" -> {"a", "b"}; "" -> {} (empty pieces kept: recipe_validate refuses them)
std::vector<std::string> bf16_names_split(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  for (size_t b = 0;;) {
    const size_t e = s.find(',', b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

std::string type_name(const recipe_key& k) {
  switch (k.ptr.index()) {
    case 0: return "an integer";
    case 1: return "a number";
    case 2: return "true or false";
    default: return "a string";
  }
}

std::string fmt15(double x) {
  char b[64];
  std::snprintf(b, sizeof b, "%.15g", x);
  return b;
}

void set_from_config_value(const recipe_key& k, const caf::config_value& v, const std::string& where) {
  const std::string key = std::string(k.section) + "." + k.name;
  auto bad = [&] { throw std::invalid_argument(where + ": key '" + key + "' must be " + type_name(k) + ", got " + caf::to_string(v)); };
  std::visit([&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_same_v<T, int64_t>) {
      auto x = caf::get_if<int64_t>(&v);
      if (!x) bad();
      *p = *x;
    } else if constexpr (std::is_same_v<T, double>) {
      // CAF 0.17's number parser can be an ulp off ("0.999" -> 0.9990000000000001): recover the
      // written decimal by rounding to 15 significant digits.
      if (auto x = caf::get_if<double>(&v)) *p = std::strtod(fmt15(*x).c_str(), nullptr);
      else if (auto y = caf::get_if<int64_t>(&v)) *p = static_cast<double>(*y);
      else bad();
    } else if constexpr (std::is_same_v<T, bool>) {
      auto x = caf::get_if<bool>(&v);
      if (!x) bad();
      *p = *x;
    } else {
      if (auto x = caf::get_if<std::string>(&v)) *p = *x;
      else if (auto a = caf::get_if<caf::atom_value>(&v)) *p = caf::to_string(*a);
      else bad();
    }
  }, k.ptr);
}

}  // namespace

void config_file_precheck(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::exists(path)) throw std::invalid_argument(path + ": no such file");
  if (!fs::is_regular_file(path)) throw std::invalid_argument(path + ": not a file");
  std::ifstream f(path);
  if (!f) throw std::invalid_argument(models::open_failure(path));
  std::vector<std::pair<char, int>> open;  // unclosed '[' / '{' and their lines
  std::map<std::string, int> seen;         // "section.key" -> line
  std::map<std::string, int> groups;       // "name { ... }" groups -> line
  std::set<std::string> headers;           // [section] names
  std::vector<std::set<std::string>> brace_keys;  // keys seen in each open { ... }
  auto trim = [](std::string t) {
    t.erase(0, t.find_first_not_of(" \t"));
    t.erase(t.find_last_not_of(" \t") + 1);
    return t;
  };
  // a section written both as [name] and as name { ... }, or as two groups: CAF merged them, the
  // last value of a key silently winning (the key check below sees only [section] lines)
  auto section_again = [&](const std::string& name, int n) {
    if (groups.count(name))
      throw std::invalid_argument(path + ":" + std::to_string(n) + ": section '" + name + "' given again (as '" + name +
                                  " { ... }' on line " + std::to_string(groups[name]) + ")");
  };
  std::string section, line;
  for (int n = 1; std::getline(f, line); ++n) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos) continue;
    if (open.empty() && line[first] == '[' && line.find('=') == std::string::npos) {  // [section]
      const size_t close = line.find(']', first);
      section = trim(line.substr(first + 1, close == std::string::npos ? std::string::npos : close - first - 1));
      section_again(section, n);
      headers.insert(section);
      continue;
    }
    if (open.empty() && line[first] != ';' && line[first] != '#') {
      const size_t eq = line.find('=', first);
      if (eq != std::string::npos) {
        std::string key = line.substr(first, eq - first);
        key.erase(key.find_last_not_of(" \t") + 1);
        const auto [it, fresh] = seen.emplace(section + "." + key, n);
        if (!fresh)
          throw std::invalid_argument(path + ":" + std::to_string(n) + ": key '" + it->first + "' set again (first on line " +
                                      std::to_string(it->second) + ")");
      }
    }
    bool quoted = false;
    size_t item = first;  // where the current "key = value" item of a { ... } starts on this line
    for (size_t i = first; i < line.size(); ++i) {
      const char c = line[i];
      if (quoted) {
        if (c == '\\') ++i;
        else if (c == '"') quoted = false;
      } else if (c == '"') {
        quoted = true;
      } else if (c == ';' || c == '#') {
        break;  // comment
      } else if (c == ',') {
        item = i + 1;
      } else if (c == '=' && !open.empty() && open.back().first == '{') {  // a key inside braces (a topology node)
        const std::string key = trim(line.substr(item, i - item));
        if (!key.empty() && !brace_keys.back().insert(key).second)
          throw std::invalid_argument(path + ":" + std::to_string(n) + ": key '" + key + "' given twice in one { ... }");
      } else if (c == '[' || c == '{') {
        if (c == '{' && open.empty()) {  // "name {" opens a group (after '=', a key's map value)
          const std::string before = trim(line.substr(0, i));
          if (!before.empty() && before.back() != '=' && before.find_first_of("= \t,") == std::string::npos) {
            section_again(before, n);
            if (headers.count(before))
              throw std::invalid_argument(path + ":" + std::to_string(n) + ": section '" + before + "' given again (also as [" +
                                          before + "])");
            groups[before] = n;
          }
        }
        open.emplace_back(c, n);
        if (c == '{') brace_keys.emplace_back();
        item = i + 1;
      } else if (c == ']' || c == '}') {
        if (open.empty() || (open.back().first == '[') != (c == ']'))
          throw std::invalid_argument(path + ":" + std::to_string(n) + ": unbalanced '" + std::string(1, c) + "'");
        if (c == '}') brace_keys.pop_back();
        open.pop_back();
      }
    }
    if (quoted)  // CAF read it up to the end of the file, or cut it at the end of the line
      throw std::invalid_argument(path + ":" + std::to_string(n) + ": a string is never closed (missing '\"')");
  }
  if (!open.empty())
    throw std::invalid_argument(path + ":" + std::to_string(open.back().second) + ": '" + std::string(1, open.back().first) +
                                "' is never closed");
}

caf::settings config_file_parse(const std::string& path) {
  config_file_precheck(path);
  auto parsed = caf::actor_system_config::parse_config_file(path.c_str());
  if (parsed) return std::move(*parsed);
  const caf::error& err = parsed.error();
  const caf::message& ctx = err.context();
  if (err.category() != caf::atom("parser") || ctx.size() != 1 || !ctx.match_element<caf::settings>(0))
    throw std::invalid_argument(path + ": " + caf::to_string(err));
  const auto& where = ctx.get_as<caf::settings>(0);
  int64_t line = caf::get_or(where, "line", int64_t{0}), column = caf::get_or(where, "column", int64_t{0});
  const auto code = static_cast<caf::pec>(err.code());
  std::string what = caf::to_string(code);
  if (code == caf::pec::unexpected_newline || code == caf::pec::unexpected_eof) {
    what = "the line ends where a value or closing character was expected";
    if (column == 1 && line > 1) --line;  // CAF counts the newline it stopped at as the next line
    column = 0;
  } else if (code == caf::pec::unexpected_character) {
    what = "unexpected character";
  }
  throw std::invalid_argument(path + ":" + std::to_string(line) + (column > 0 ? ":" + std::to_string(column) : std::string()) +
                              ": " + what + " (CAF config syntax: key=value, [section], strings in quotes: name=\"x\", booleans "
                              "true or false, [list])");
}

namespace {
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> d(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) d[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = d[0];
    d[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = d[j];
      d[j] = std::min({d[j] + 1, d[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return d[b.size()];
}

// " (did you mean 'run.steps'?)" for the closest known key within 2 edits, or the same key name
// in another section; "" for none.
std::string key_suggestion(const std::string& key, const std::vector<recipe_key>& keys) {
  std::string best;
  size_t best_d = 3;
  for (const auto& k : keys) {
    const std::string full = std::string(k.section) + "." + k.name;
    const size_t d = key.substr(key.find('.') + 1) == k.name ? 1 : edit_distance(key, full);
    if (d < best_d) best_d = d, best = full;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

// The line of `section.name = ...` in the file at path ("" if not found, e.g. in a { } group).
std::string key_line(const std::string& path, const std::string& section, const std::string& name) {
  std::ifstream f(path);
  std::string line, at;
  for (int n = 1; std::getline(f, line); ++n) {
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    if (line[b] == '[') {
      const size_t e = line.find(']', b);
      at = e == std::string::npos ? "" : line.substr(b + 1, e - b - 1);
      at.erase(0, at.find_first_not_of(" \t"));
      at.erase(at.find_last_not_of(" \t") + 1);
    } else if (at == section && line.compare(b, name.size(), name) == 0) {
      const size_t eq = line.find_first_not_of(" \t", b + name.size());  // "name =", not "names="
      if (eq != std::string::npos && line[eq] == '=') return ":" + std::to_string(n);
    }
  }
  return "";
}
}  // namespace

void recipe_load_file(run_config& r, const std::string& path) {
  const caf::settings parsed = config_file_parse(path);
  auto keys = recipe_keys(r);
  for (const auto& [section, value] : parsed) {
    auto dict = caf::get_if<caf::config_value::dictionary>(&value);
    if (!dict) throw std::invalid_argument(path + ": '" + section + "' is not a [section]");
    bool known_section = false;
    for (const auto& k : keys) known_section |= section == k.section;
    if (!known_section)
      throw std::invalid_argument(path + ": unknown section [" + section + "]" +
                                  (section == "cluster" ? " (a topology's section: give a topology with --topology)" : ""));
    for (const auto& [name, v] : *dict) {
      auto it = std::find_if(keys.begin(), keys.end(), [&](const recipe_key& k) { return section == k.section && name == k.name; });
      if (it == keys.end())
        throw std::invalid_argument(path + key_line(path, section, name) + ": unknown key '" + section + "." + name + "'" +
                                    key_suggestion(section + "." + name, keys));
      set_from_config_value(*it, v, path);
      r.set_by[section + "." + name] = path;
    }
  }
}

void recipe_apply_cli(run_config& r, const std::string& arg) {
  if (arg.rfind("--", 0) != 0 || arg.find('=') == std::string::npos)
    throw std::invalid_argument("option '" + arg + "': expected --section.key=value");
  const std::string key = arg.substr(2, arg.find('=') - 2), val = arg.substr(arg.find('=') + 1);
  for (const auto& k : recipe_keys(r)) {
    if (key != std::string(k.section) + "." + k.name) continue;
    bool ok = true;
    std::visit([&](auto* p) {
      using T = std::remove_pointer_t<decltype(p)>;
      try {
        size_t pos = 0;
        if constexpr (std::is_same_v<T, int64_t>) { *p = std::stoll(val, &pos); ok = pos == val.size(); }
        else if constexpr (std::is_same_v<T, double>) {  // 15 significant digits, as a recipe file's (recipe.conf:
          *p = std::strtod(fmt15(std::stod(val, &pos)).c_str(), nullptr);  // a resume reads the value this run had)
          ok = pos == val.size();
        }
        else if constexpr (std::is_same_v<T, bool>) {
          ok = val == "true" || val == "false";
          *p = val == "true";
        } else {
          *p = val.size() >= 2 && val.front() == '"' && val.back() == '"' ? val.substr(1, val.size() - 2) : val;
        }
      } catch (const std::exception&) {
        ok = false;
      }
    }, k.ptr);
    if (!ok) throw std::invalid_argument("option --" + key + ": '" + val + "' is not " + type_name(k));
    r.set_by[key] = arg;
    return;
  }
  throw std::invalid_argument("unknown option --" + key + key_suggestion(key, recipe_keys(r)));
}

void recipe_validate(const run_config& r) {
  auto fail = [&r](const std::string& key, const std::string& why) {
    const auto by = r.set_by.find(key);
    throw std::invalid_argument("recipe key '" + key + "'" + (by == r.set_by.end() ? "" : " (" + by->second + ")") + ": " + why);
  };
  auto positive = [&](const char* key, int64_t v) { if (v <= 0) fail(key, "must be > 0"); };
  {  // every number finite (grpo.dual_clip = inf ran, and its recipe.conf held "inf.0": no resume)
    run_config c = r;
    for (const auto& k : recipe_keys(c))
      if (double* const* d = std::get_if<double*>(&k.ptr); d && !std::isfinite(**d))
        fail(std::string(k.section) + "." + k.name, "must be a finite number");
  }
  if (r.name.empty() || r.name[0] == '.' ||
      r.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos)
    fail("run.name", "'" + r.name + "' must be letters, digits, '.', '_' or '-', not starting with '.' (it names runs/NAME)");
  positive("run.steps", r.steps);
  if (r.init.empty()) fail("model.init", "is empty (tiny, or a model directory)");  // it read ./config.json
  // sizes whose vectors are allocated up front: a typo (1e12) grew memory until bad_alloc, which
  // named no key, after the run's directory was written
  auto at_most = [&](const char* key, int64_t v, int64_t hi) {
    if (v > hi) fail(key, std::to_string(v) + " is beyond " + std::to_string(hi));
  };
  at_most("task.train_size", r.train_size, int64_t{1} << 26);
  at_most("task.val_size", r.val_size, int64_t{1} << 24);
  at_most("rollout.prompts_per_step", r.prompts_per_step, int64_t{1} << 20);
  at_most("rollout.slots", r.slots, int64_t{1} << 16);
  at_most("model.max_context", r.max_context, int64_t{1} << 20);
  at_most("rollout.group_size", r.group_size, int64_t{1} << 16);  // (work carries it as int32: 2^32 + 2 became 2)
  at_most("model.sft_batch", r.sft_batch, int64_t{1} << 16);
  at_most("audit.samples", r.audit_samples, int64_t{1} << 16);
  positive("rollout.prompts_per_step", r.prompts_per_step);
  positive("rollout.group_size", r.group_size);
  if (r.prompts_per_step * r.group_size > (int64_t{1} << 22))  // (both bounded above: no overflow)
    fail("rollout.group_size", std::to_string(r.prompts_per_step) + " prompts x " + std::to_string(r.group_size) +
                                   " = " + std::to_string(r.prompts_per_step * r.group_size) + " samples a step is beyond " +
                                   std::to_string(int64_t{1} << 22));
  positive("rollout.max_new_tokens", r.max_new_tokens);
  if (r.max_new_tokens > INT32_MAX) fail("rollout.max_new_tokens", "is too large (2^32 + 1 became 1)");
  positive("rollout.slots", r.slots);
  positive("model.max_context", r.max_context);
  if (r.max_staleness < 0) fail("async.max_staleness", "must be >= 0");
  // (the precision policy's own check named no recipe key, and ran after the SFT warm start)
  if (r.bf16_first < 0) fail("precision.bf16_first", "must be >= 0");
  if (r.bf16_last < 0) fail("precision.bf16_last", "must be >= 0");
  for (const auto& n : bf16_names_split(r.bf16_names))
    if (n.empty() || n.find_first_of(" \t") != std::string::npos)  // "a, b": " b" matched nothing
      fail("precision.bf16_names", "'" + r.bf16_names + "': names are comma-separated, none empty, without spaces");
  if (r.eval_every < 0) fail("run.eval_every", "must be >= 0");
  if (r.checkpoint_every < 0) fail("run.checkpoint_every", "must be >= 0");
  if (r.trace_max_mb < 0 || r.trace_max_mb > (int64_t(1) << 40)) fail("trace.max_mb", "must be in [0, 2^40] (0: no cap)");
  if (r.keep_checkpoints < 0) fail("run.keep_checkpoints", "must be >= 0 (0 keeps all)");
  if (r.collective_timeout_s < 1 || r.collective_timeout_s > 604800) fail("run.collective_timeout_s", "must be in [1, 604800] (a week)");
  if (r.val_size <= 0) fail("task.val_size", "must be > 0 (the run ends with a validation)");
  if (r.train_size <= 0) fail("task.train_size", "must be > 0");
  positive("model.sft_batch", r.sft_batch);
  if (r.sft_steps < 0) fail("model.sft_steps", "must be >= 0");
  if (!(r.sft_lr > 0 && std::isfinite(r.sft_lr))) fail("model.sft_lr", "must be a finite number > 0");
  if (!(r.lr > 0 && std::isfinite(r.lr))) fail("optim.lr", "must be a finite number > 0");
  if (!(r.beta1 >= 0 && r.beta1 < 1)) fail("optim.beta1", "must be in [0, 1)");
  if (!(r.beta2 >= 0 && r.beta2 < 1)) fail("optim.beta2", "must be in [0, 1)");
  if (!(r.eps > 0 && std::isfinite(r.eps))) fail("optim.eps", "must be a finite number > 0");
  if (!(r.weight_decay >= 0 && std::isfinite(r.weight_decay))) fail("optim.weight_decay", "must be a finite number >= 0");
  if (!(r.grad_clip >= 0 && std::isfinite(r.grad_clip))) fail("optim.grad_clip", "must be a finite number >= 0 (0: off)");
  if (!(r.clip_low >= 0 && r.clip_low < 1)) fail("grpo.clip_low", "must be in [0, 1)");
  if (!(r.clip_high >= 0 && std::isfinite(r.clip_high))) fail("grpo.clip_high", "must be a finite number >= 0");
  if (!(r.dual_clip == 0 || r.dual_clip > 1)) fail("grpo.dual_clip", "must be 0 (off) or > 1");
  if (!(r.kl_beta >= 0 && std::isfinite(r.kl_beta))) fail("grpo.kl_beta", "must be a finite number >= 0");
  if (!(r.seq_logprob_error_threshold == 0 || r.seq_logprob_error_threshold >= 1))  // e_i, a mean of exp(|g - p|), is >= 1
    fail("grpo.seq_logprob_error_threshold", "must be 0 (off) or >= 1: a sequence's error e_i is a mean of exp(|g - p|) >= 1, "
                                             "so a threshold below 1 drops every sequence");
  if (r.audit_every < 0) fail("audit.every", "must be >= 0");
  positive("audit.samples", r.audit_samples);
  if (!(r.margin >= 1 && std::isfinite(r.margin))) fail("calibration.margin", "must be a finite number >= 1");
  if (r.kv_policy != "recompute" && r.kv_policy != "keep") fail("rollout.kv_policy", "must be recompute or keep");
  if (r.size != "tiny" && r.size != "small") fail("model.size", "must be tiny or small");
  if (!models::is_mode_parse(r.is_mode)) fail("grpo.is_mode", "must be none, tis, icepop or seq-mask-tis");
  if (!models::verifier_parse(r.verifier)) fail("task.verifier", "must be exact or numeric");
  if (!quant::scale_mode_parse(r.scale_mode)) fail("precision.scale_mode", "must be pow2 or fp32");
  if (!(r.is_lo <= r.is_hi)) fail("grpo.is_lo", "must be <= grpo.is_hi (" + fmt15(r.is_lo) + " > " + fmt15(r.is_hi) + ")");
  // a negative bound made tis clamp weights below 0, turning the policy gradient around
  if (r.is_lo < 0) fail("grpo.is_lo", "must be >= 0 (an importance weight is a ratio of probabilities)");
  if (r.is_mode != "none" && !(r.is_hi > 0 && std::isfinite(r.is_hi)))  // tis clamped every weight to 0
    fail("grpo.is_hi", "must be a finite number > 0 (grpo.is_mode = " + r.is_mode + ")");
  if (r.top_k > INT32_MAX) fail("rollout.top_k", std::to_string(r.top_k) + " is too large");  // cast first: "-1294967296 is negative"
  if (std::string why = models::logit_processing_problem({static_cast<float>(r.temperature), static_cast<int32_t>(r.top_k),
                                                         static_cast<float>(r.top_p)});
      !why.empty())
    fail("rollout." + why.substr(0, why.find(' ')), why);  // the message starts with the key's name
  if (!(r.percentile > 0 && r.percentile <= 1)) fail("calibration.percentile", "must be in (0, 1]");  // NaN indexed nowhere
  if (!models::health_mode_parse(r.health_gates)) fail("health.gates", "must be fail, warn or off");
  if (r.health_source != "auto" && !models::health_source_parse(r.health_source))
    fail("health.source", "must be auto, trained or audit");
  if (r.health_source == "audit" && r.audit_every == 0 && r.health_gates != "off")
    fail("health.source", "audit reads audit mode's re-score: set audit.every (1 judges every step)");
  positive("health.min_steps", r.health_min_steps);
  // token_mult_prob_error is >= 1 (a mean of exp(|g - p|)): a limit at or below 1 fails every run
  if (!(r.tmpe_median_max == 0 || (r.tmpe_median_max > 1 && std::isfinite(r.tmpe_median_max))))
    fail("health.tmpe_median_max", "must be 0 (the spec's limit) or a finite number > 1");
  if (!(r.tmpe_steps_above_max > 0 && r.tmpe_steps_above_max <= 1)) fail("health.tmpe_steps_above_max", "must be in (0, 1]");
  if (!(r.gen_kl_mean_max > 0 && std::isfinite(r.gen_kl_mean_max))) fail("health.gen_kl_mean_max", "must be a finite number > 0");
  auto check = [&](const char* key, auto&& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      fail(key, e.what());
    }
  };
  check("task.name", [&] { models::task_spec_parse(r.task); });
  check("precision.generation", [&] { models::precision_policy::named(r.generation).validate(); });
  check("precision.training", [&] { models::precision_policy::named(r.training).validate(); });
  if (models::precision_policy::named(r.training).fp8_attention) fail("precision.training", "FP8 attention is generation-only");
  try {
    fp8rl::log_set_level(r.log_level);
  } catch (const std::invalid_argument& e) {
    fail("run.log_level", e.what());
  }
}

void recipe_finalize(run_config& r, const std::function<void(const std::string&)>& say, const std::string& stored) {
  auto given = [&](const char* k) {  // by this command: a resumed run's stored recipe.conf sets every key
    const auto it = r.set_by.find(k);
    return it != r.set_by.end() && it->second != stored;
  };
  const struct { const char* mode; double lo, hi; } refs[] = {{"icepop", 0.5, 5.0}, {"seq-mask-tis", 0.999, 1.002}};
  for (const auto& m : refs)
    if (r.is_mode == m.mode && given("grpo.is_mode") && !given("grpo.is_lo") && !given("grpo.is_hi")) {
      r.is_lo = m.lo, r.is_hi = m.hi;
      say(fmt::format("grpo.is_mode = {}: IS bounds [{}, {}], the mode's reference bounds (rl-algorithm.md section 3; "
                      "set grpo.is_lo and grpo.is_hi to choose others)",
                      m.mode, m.lo, m.hi));
    }
}

std::vector<std::string> recipe_learning_problems(const run_config& r) {
  std::vector<std::string> out;
  const std::string none = r.kl_beta > 0 ? "the policy-gradient term is 0 (only grpo.kl_beta's KL term trains)"
                                         : "the policy loss has no gradient";
  if (r.group_size == 1)
    out.push_back("rollout.group_size = 1: each completion is its own group, its advantage (reward - group mean) is 0: " + none);
  else if (r.temperature == 0 || r.top_k == 1)
    out.push_back(std::string(r.temperature == 0 ? "rollout.temperature = 0" : "rollout.top_k = 1") + ": greedy rollouts give a group " +
                  std::to_string(r.group_size) + " copies of one completion, whose advantages are 0: " + none);
  // one policy for both sides (rl-algorithm.md section 10); FP8 generation with BF16 training
  // (fp8-gen) is the one asymmetric baseline
  const auto gen = models::precision_policy::named(r.generation), train = models::precision_policy::named(r.training);
  const bool fp8_gen = gen.linear == models::precision::fp8 && train.linear == models::precision::bf16;
  if ((gen.linear != train.linear || gen.head != train.head) && !fp8_gen)
    out.push_back("precision.generation = " + r.generation + " and precision.training = " + r.training +
                  " compute their layers in different precisions: the mismatch metrics measure that gap, not FP8's "
                  "(fp8 generation with bf16 training is the one asymmetric baseline, recipes/fp8-gen.conf)");
  if (r.is_mode != "none" && !(r.is_lo <= 1 && 1 <= r.is_hi)) {
    const std::string range = "grpo.is_lo/is_hi = [" + fmt::format("{}", r.is_lo) + ", " + fmt::format("{}", r.is_hi) + "]";
    out.push_back(range + " excludes 1, the weight of a token its sampler and learner agree on: " +
                  (r.is_mode == "tis" ? "tis clamps each such token's weight to the bound" : r.is_mode + " drops every such token"));
  }
  return out;
}

namespace {
// The shortest text of the double, with a '.' where it would read as an integer ("3.0"): a recipe
// value has at most 15 significant digits (files and options are rounded to them), which this
// text keeps and the reader's rounding gives back exactly; 10 digits rounded longer values on
// resume, and "1e+20" became "1e+20.0".
std::string double_text(double v) {
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  std::string t(buf, res.ptr);
  if (t.find_first_of(".e") == std::string::npos) t += ".0";
  return t;
}
}  // namespace

std::string recipe_dump(const run_config& r0) {
  run_config r = r0;
  std::ostringstream os;
  std::string section;
  for (const auto& k : recipe_keys(r)) {
    if (section != k.section) {
      os << (section.empty() ? "" : "\n") << "[" << k.section << "]\n";
      section = k.section;
    }
    os << "; " << k.help << "\n" << k.name << "=";
    std::visit([&](auto* p) {
      using T = std::remove_pointer_t<decltype(p)>;
      if constexpr (std::is_same_v<T, std::string>) os << std::quoted(*p);
      else if constexpr (std::is_same_v<T, bool>) os << (*p ? "true" : "false");
      else if constexpr (std::is_same_v<T, double>) os << double_text(*p);
      else os << *p;
    }, k.ptr);
    os << "\n";
  }
  return os.str();
}

std::string recipe_to_json(const run_config& r0) {
  run_config r = r0;
  nlohmann::json j;
  for (const auto& k : recipe_keys(r))
    std::visit([&](auto* p) { j[std::string(k.section) + "." + k.name] = *p; }, k.ptr);
  return j.dump();
}

run_config recipe_from_json(const std::string& s) {
  run_config r;
  try {
    const auto j = nlohmann::json::parse(s);
    for (const auto& k : recipe_keys(r)) {
      const std::string key = std::string(k.section) + "." + k.name;
      if (!j.contains(key)) throw std::invalid_argument("recipe json: key '" + key + "' missing");
      std::visit([&](auto* p) { *p = j[key].get<std::remove_pointer_t<decltype(p)>>(); }, k.ptr);
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("recipe json: ") + e.what());
  }
  recipe_validate(r);
  return r;
}

models::health_config recipe_health_config(const run_config& r) {
  models::health_config h;
  h.mode = *models::health_mode_parse(r.health_gates);
  // auto: a synchronous run's every token is a staleness-0 one (the whole batch, not the audit's sample)
  const bool audit = r.health_source == "auto" ? r.audit_every > 0 && r.max_staleness > 0 : r.health_source == "audit";
  h.source = audit ? models::health_source::audit : models::health_source::trained;
  h.min_steps = r.health_min_steps;
  h.tmpe_median_max = r.tmpe_median_max;
  h.tmpe_steps_above_max = r.tmpe_steps_above_max;
  h.gen_kl_mean_max = r.gen_kl_mean_max;
  h.fp8_kv = models::precision_policy::named(r.generation).kv == models::kv_dtype::fp8;
  return h;
}

models::engine_config recipe_engine_config(const run_config& r) {
  models::engine_config ec;
  ec.slots = r.slots;
  ec.max_context = r.max_context;
  ec.on_adopt = r.kv_policy == "keep" ? models::kv_adopt_policy::keep : models::kv_adopt_policy::recompute;
  ec.policy = recipe_rl_config(r).gen_policy;
  return ec;
}

models::rl_run_config recipe_rl_config(const run_config& r) {
  models::rl_run_config c;
  c.grpo.group_size = r.group_size;
  c.grpo.normalize_std = r.normalize_std;
  c.grpo.leave_one_out = r.leave_one_out;
  c.grpo.share_prompts = r.share_prompts;
  c.grpo.clip_low = static_cast<float>(r.clip_low);
  c.grpo.clip_high = static_cast<float>(r.clip_high);
  c.grpo.dual_clip = static_cast<float>(r.dual_clip);
  c.grpo.is = *models::is_mode_parse(r.is_mode);
  c.grpo.is_lo = static_cast<float>(r.is_lo);
  c.grpo.is_hi = static_cast<float>(r.is_hi);
  c.grpo.kl_beta = static_cast<float>(r.kl_beta);
  c.grpo.seq_logprob_error_threshold = static_cast<float>(r.seq_logprob_error_threshold);
  c.opt.lr = static_cast<float>(r.lr);
  c.opt.beta1 = static_cast<float>(r.beta1);
  c.opt.beta2 = static_cast<float>(r.beta2);
  c.opt.eps = static_cast<float>(r.eps);
  c.opt.weight_decay = static_cast<float>(r.weight_decay);
  c.opt.grad_clip = static_cast<float>(r.grad_clip);
  c.prompts_per_step = r.prompts_per_step;
  c.max_new_tokens = static_cast<int32_t>(r.max_new_tokens);
  c.proc = {static_cast<float>(r.temperature), static_cast<int32_t>(r.top_k), static_cast<float>(r.top_p)};
  for (auto* p : {&c.gen_policy, &c.train_policy}) {
    *p = models::precision_policy::named(p == &c.gen_policy ? r.generation : r.training);
    p->bf16_first = r.bf16_first;
    p->bf16_last = r.bf16_last;
    p->bf16_names = bf16_names_split(r.bf16_names);
    p->scales = *quant::scale_mode_parse(r.scale_mode);
  }
  c.verifier = *models::verifier_parse(r.verifier);
  c.seed = static_cast<uint64_t>(r.seed);
  c.kv_margin = static_cast<float>(r.margin);
  c.kv_percentile = r.percentile;
  return c;
}

}  // namespace fp8rl::actors
