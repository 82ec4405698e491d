// tests/actors/config_test.cpp -- recipes and topologies: strict validation naming file and key,
// CLI overrides, dump -> reload, every shipped file, the Llama-3.1-8B 8-GPU placement plan, and
// the start's preflight checks. The run directory `fp8rl train` writes: run_dir_test.cpp.
#include <gtest/gtest.h>
#include <unistd.h>


#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "actors/env.hpp"
#include "actors/preflight.hpp"
#include "actors/recipe.hpp"
#include "actors/topology.hpp"
#include "models/generate.hpp"
#include "models/log.hpp"
#include "models/params.hpp"
#include "models/rl/task.hpp"
#include "models/tokenizer.hpp"
#include "quant/gemm.hpp"
#include "tests/test_util.hpp"

using namespace fp8rl::actors;
using fp8rl::test::error_of;
namespace fs = std::filesystem;

namespace {
std::string write_tmp(const std::string& name, const std::string& body) {
  const fs::path p = fs::temp_directory_path() / ("fp8rl_cfg_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p) << body;
  return p.string();
}
}  // namespace

TEST(Recipe, UnknownAndIllTypedKeysNameFileAndKey) {
  run_config r;
  // an unknown key names its line and the closest key (within two edits, or its name in another
  // section); a topology's section says where a topology goes
  const auto f1 = write_tmp("a.conf", "[rollout]\ntop_k=2\n  slotz = 4\n");
  EXPECT_EQ(error_of([&] { recipe_load_file(r, f1); }), f1 + ":3: unknown key 'rollout.slotz' (did you mean 'rollout.slots'?)");
  EXPECT_EQ(error_of([&] { recipe_apply_cli(r, "--run.step=5"); }), "unknown option --run.step (did you mean 'run.steps'?)");
  EXPECT_EQ(error_of([&] { recipe_apply_cli(r, "--run.lr=5"); }), "unknown option --run.lr (did you mean 'optim.lr'?)");
  EXPECT_EQ(error_of([&] { recipe_apply_cli(r, "--grpo.zzzzzz=5"); }), "unknown option --grpo.zzzzzz");
  EXPECT_EQ(error_of([&] { recipe_apply_cli(r, "--run.stpes=5"); }), "unknown option --run.stpes (did you mean 'run.steps'?)");  // 2 edits
  EXPECT_EQ(error_of([&] { recipe_apply_cli(r, "--run.stqqs=5"); }), "unknown option --run.stqqs (did you mean 'run.steps'?)");  // 2 substitutions
  EXPECT_EQ(error_of([&] { recipe_apply_cli(r, "--run.sxxxs=5"); }), "unknown option --run.sxxxs");  // 3 edits: none
  // the line named is the key's own: "steps=" does not match "step", nor a key of another section
  const auto lines = write_tmp("lines.conf", "[run]\nsteps=3\nstep=5\n");
  EXPECT_EQ(error_of([&] { recipe_load_file(r, lines); }).rfind(lines + ":3: unknown key 'run.step'", 0), 0u)
      << error_of([&] { recipe_load_file(r, lines); });
  const auto sections = write_tmp("sections.conf", "[rollout]\nslots=4\n[model]\nslots=1\n");
  EXPECT_EQ(error_of([&] { recipe_load_file(r, sections); }).rfind(sections + ":4: unknown key 'model.slots'", 0), 0u)
      << error_of([&] { recipe_load_file(r, sections); });
  for (const auto& f : {lines, sections}) fs::remove(f);
  const auto topo = write_tmp("topo.conf", "[cluster]\nnodes=[]\n");
  EXPECT_EQ(error_of([&] { recipe_load_file(r, topo); }),
            topo + ": unknown section [cluster] (a topology's section: give a topology with --topology)");
  fs::remove(topo);
  const auto f2 = write_tmp("b.conf", "[rollout]\nslots=\"many\"\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, f2); }).find("'rollout.slots' must be an integer"), std::string::npos);
  const auto f3 = write_tmp("c.conf", "[rolout]\nslots=4\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, f3); }).find("unknown section [rolout]"), std::string::npos);
  EXPECT_NE(error_of([&] { recipe_apply_cli(r, "--grpo.is_hi=abc"); }).find("grpo.is_hi"), std::string::npos);
  EXPECT_NE(error_of([&] { recipe_apply_cli(r, "--grpo.nope=1"); }).find("unknown option --grpo.nope"), std::string::npos);
  run_config bad;
  bad.is_mode = "sometimes";
  EXPECT_NE(error_of([&] { recipe_validate(bad); }).find("grpo.is_mode"), std::string::npos);
  run_config bad2;
  bad2.training = "fp8-kv";
  EXPECT_NE(error_of([&] { recipe_validate(bad2); }).find("precision.training"), std::string::npos);
  for (const auto& f : {f1, f2, f3}) fs::remove(f);
}

// What CAF's parser lets through is caught first: an unclosed list (CAF dropped the key), a key
// set twice (CAF kept the first), a directory; values out of range name their own key.
TEST(Recipe, MalformedFilesAndOutOfRangeValuesNameTheirKey) {
  run_config r;
  const auto open = write_tmp("open.conf", "[run]\nsteps=[1\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, open); }).find(open + ":2: '[' is never closed"), std::string::npos);
  const auto twice = write_tmp("twice.conf", "[run]\nsteps=1\nsteps=2\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, twice); }).find("key 'run.steps' set again"), std::string::npos);
  EXPECT_NE(error_of([&] { recipe_load_file(r, fs::temp_directory_path().string()); }).find("not a file"), std::string::npos);
  EXPECT_EQ(error_of([&] { recipe_load_file(r, "no/such.conf"); }), "no/such.conf: no such file");  // it said "not a file"
  // a section again under another spelling or form: CAF merged them, the last value winning
  const auto spaced = write_tmp("spaced.conf", "[run]\nsteps=3\n[ run ]\nsteps=9\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, spaced); }).find(spaced + ":4: key 'run.steps' set again (first on line 2)"),
            std::string::npos) << error_of([&] { recipe_load_file(r, spaced); });
  const auto braces = write_tmp("braces.conf", "run{steps=5}\n[run]\nsteps=9\n");
  EXPECT_EQ(error_of([&] { recipe_load_file(r, braces); }), braces + ":2: section 'run' given again (as 'run { ... }' on line 1)");
  const auto header_then_braces = write_tmp("hb.conf", "[run]\nsteps=3\nrun{steps=9}\n");
  EXPECT_EQ(error_of([&] { recipe_load_file(r, header_then_braces); }), header_then_braces + ":3: section 'run' given again (also as [run])");
  fs::remove(header_then_braces);
  const auto fine = write_tmp("fine.conf", "[run]\nsteps=3 ; a comment with [ and {\n[rollout]\nsteps_note=\"]\"\n");
  EXPECT_EQ(error_of([&] { config_file_precheck(fine); }), "");  // brackets in comments and strings do not count
  // (flag, the key named, its rule's text: a message naming the key for another reason passed)
  for (const auto& [arg, key, rule] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--optim.lr=-1", "optim.lr", "must be a finite number > 0"},
           {"--optim.beta1=2", "optim.beta1", "must be in [0, 1)"},
           {"--optim.eps=0", "optim.eps", "must be a finite number > 0"},
           {"--optim.weight_decay=-5", "optim.weight_decay", "must be a finite number >= 0"},
           {"--grpo.kl_beta=-1", "grpo.kl_beta", "must be a finite number >= 0"},
           {"--grpo.clip_low=-1", "grpo.clip_low", "must be in [0, 1)"},
           {"--grpo.dual_clip=0.5", "grpo.dual_clip", "must be 0 (off) or > 1"},
           {"--audit.every=-1", "audit.every", "must be >= 0"},
           {"--calibration.margin=0.5", "calibration.margin", "must be a finite number >= 1"},
           {"--rollout.top_p=2", "rollout.top_p", "top_p 2.000000 is outside (0, 1]"},
           {"--rollout.top_k=-1", "rollout.top_k", "top_k -1 is negative (0 keeps every token)"},
           {"--rollout.temperature=-1", "rollout.temperature", "temperature -1 is not a finite number >= 0"},
           {"--run.checkpoint_every=-1", "run.checkpoint_every", "must be >= 0"},
           {"--run.keep_checkpoints=-1", "run.keep_checkpoints", "must be >= 0 (0 keeps all)"},
           {"--trace.max_mb=-1", "trace.max_mb", "must be in [0, 2^40] (0: no cap)"},
           {"--run.collective_timeout_s=0", "run.collective_timeout_s", "must be in [1, 604800] (a week)"},
           {"--run.collective_timeout_s=604801", "run.collective_timeout_s", "must be in [1, 604800] (a week)"},
           {"--precision.generation=fp9", "precision.generation", "unknown precision policy 'fp9' (fp32, bf16,"},
           {"--task.name=builtin:add9", "task.name", "task 'builtin:add9': built-in tasks are"},
           {"--model.sft_batch=0", "model.sft_batch", "must be > 0"},
           // NaN passed comparisons written as "bad if x <= 0 || x > 1"; a wide length wrapped to int32;
           // no validation set left the run's last validation reporting -nan
           {"--calibration.percentile=nan", "calibration.percentile", "must be a finite number"},
           {"--grpo.is_lo=nan", "grpo.is_lo", "must be a finite number"},
           {"--grpo.is_hi=nan", "grpo.is_hi", "must be a finite number"},
           {"--rollout.max_new_tokens=4294967297", "rollout.max_new_tokens", "is too large (2^32 + 1 became 1)"},
           {"--task.val_size=0", "task.val_size", "must be > 0 (the run ends with a validation)"},
           {"--rollout.group_size=4294967298", "rollout.group_size", "4294967298 is beyond 65536"},
           {"--model.sft_batch=1000000000", "model.sft_batch", "1000000000 is beyond 65536"},
           {"--audit.samples=100000", "audit.samples", "100000 is beyond 65536"},
           {"--precision.bf16_first=-1", "precision.bf16_first", "must be >= 0"},
           {"--precision.bf16_last=-2", "precision.bf16_last", "must be >= 0"},
           // sizes allocated up front grew memory to bad_alloc, naming no key; an empty init read
           // ./config.json; a top_k past int32 was "-1294967296 is negative"
           {"--task.train_size=1000000000000", "task.train_size", "1000000000000 is beyond 67108864"},
           {"--task.val_size=1000000000000", "task.val_size", "1000000000000 is beyond 16777216"},
           {"--rollout.prompts_per_step=1000000000000", "rollout.prompts_per_step", "1000000000000 is beyond 1048576"},
           {"--rollout.slots=100000000000", "rollout.slots", "100000000000 is beyond 65536"},
           {"--model.max_context=1000000000000", "model.max_context", "1000000000000 is beyond 1048576"},
           {"--model.init=", "model.init", "is empty (tiny, or a model directory)"},
           {"--rollout.top_k=3000000000", "rollout.top_k", "3000000000 is too large"},
           // beta2 = 1: the second moment never moves; no audited sample is no audit
           {"--optim.beta2=1", "optim.beta2", "must be in [0, 1)"},
           {"--audit.samples=0", "audit.samples", "must be > 0"},
           // a negative bound made tis clamp weights below 0 (the gradient turned around); a
           // threshold below 1 dropped every sequence (e_i >= 1)
           {"--grpo.is_lo=-1", "grpo.is_lo", "must be >= 0 (an importance weight is a ratio"},
           {"--grpo.is_hi=0", "grpo.is_hi", "must be a finite number > 0 (grpo.is_mode = tis)"},
           {"--grpo.is_hi=-0.5", "grpo.is_lo", "must be <= grpo.is_hi (0 > -0.5)"},
           {"--grpo.seq_logprob_error_threshold=0.5", "grpo.seq_logprob_error_threshold", "must be 0 (off) or >= 1: a sequence's error e_i"},
           {"--precision.bf16_names=a,,b", "precision.bf16_names", "'a,,b': names are comma-separated, none empty,"},
           {"--precision.bf16_names=a,", "precision.bf16_names", "'a,': names are comma-separated, none empty,"},
           {"--precision.bf16_names=mlp.down_proj, layers.0.", "precision.bf16_names", "'mlp.down_proj, layers.0.': names are"},
           // token_mult_prob_error >= 1: a median limit at 1 failed every run
           {"--health.gates=maybe", "health.gates", "must be fail, warn or off"},
           {"--health.min_steps=0", "health.min_steps", "must be > 0"},
           {"--health.tmpe_median_max=1", "health.tmpe_median_max", "must be 0 (the spec's limit) or a finite number"},
           {"--health.tmpe_steps_above_max=0", "health.tmpe_steps_above_max", "must be in (0, 1]"},
           {"--health.tmpe_steps_above_max=1.5", "health.tmpe_steps_above_max", "must be in (0, 1]"},
           {"--health.gen_kl_mean_max=0", "health.gen_kl_mean_max", "must be a finite number > 0"},
           {"--health.source=audited", "health.source", "must be auto, trained or audit"},
           // each bound of its own (a mutation audit found these unasserted)
           {"--async.max_staleness=-1", "async.max_staleness", "must be >= 0"},
           {"--run.eval_every=-1", "run.eval_every", "must be >= 0"},
           {"--task.train_size=0", "task.train_size", "must be > 0"},
           {"--model.sft_steps=-1", "model.sft_steps", "must be >= 0"},
           {"--model.sft_lr=0", "model.sft_lr", "must be a finite number > 0"},
           {"--optim.beta1=1", "optim.beta1", "must be in [0, 1)"},
           {"--optim.grad_clip=-1", "optim.grad_clip", "must be a finite number >= 0 (0: off)"},
           {"--grpo.clip_high=-1", "grpo.clip_high", "must be a finite number >= 0"},
           {"--rollout.kv_policy=drop", "rollout.kv_policy", "must be recompute or keep"},
           {"--model.size=huge", "model.size", "must be tiny or small"},
           {"--task.verifier=fuzzy", "task.verifier", "must be exact or numeric"},
           {"--precision.scale_mode=e8m0", "precision.scale_mode", "must be pow2 or fp32"},
           {"--grpo.dual_clip=1", "grpo.dual_clip", "must be 0 (off) or > 1"}}) {
    run_config x;
    recipe_apply_cli(x, arg);
    const std::string e = error_of([&] { recipe_validate(x); });
    EXPECT_EQ(e.rfind("recipe key '" + key + "'", 0), 0u) << arg << ": " << e;
    EXPECT_NE(e.find(": " + rule), std::string::npos) << arg << ": " << e;
  }
  {  // samples a step, each bound kept: allocated until bad_alloc, which named no key
    run_config x;
    recipe_apply_cli(x, "--rollout.prompts_per_step=1048576");
    recipe_apply_cli(x, "--rollout.group_size=5");
    EXPECT_EQ(error_of([&] { recipe_validate(x); }), "recipe key 'rollout.group_size' (--rollout.group_size=5): 1048576 prompts x 5 = "
                                                     "5242880 samples a step is beyond 4194304");
  }
  {  // an IS mode needs an upper bound > 0 (tis clamped every weight to 0)
    run_config x;
    recipe_apply_cli(x, "--grpo.is_mode=icepop");
    recipe_apply_cli(x, "--grpo.is_hi=0");
    EXPECT_EQ(error_of([&] { recipe_validate(x); }),
              "recipe key 'grpo.is_hi' (--grpo.is_hi=0): must be a finite number > 0 (grpo.is_mode = icepop)");
  }
  {  // the edges that stay valid: a threshold of 1 (e_i >= 1), IS bounds [0, C] with no IS, the
     // 100th percentile (the amax); the audit source with audit mode on, or with the gates off
    run_config x;
    recipe_apply_cli(x, "--health.source=audit");
    recipe_apply_cli(x, "--audit.every=0");
    EXPECT_EQ(error_of([&] { recipe_validate(x); }),
              "recipe key 'health.source' (--health.source=audit): audit reads audit mode's re-score: set audit.every (1 judges "
              "every step)");
    recipe_apply_cli(x, "--health.gates=off");  // judges nothing: no audit needed
    EXPECT_EQ(error_of([&] { recipe_validate(x); }), "");
    recipe_apply_cli(x, "--health.gates=fail");
    recipe_apply_cli(x, "--audit.every=3");
    EXPECT_EQ(error_of([&] { recipe_validate(x); }), "");
    recipe_apply_cli(x, "--grpo.seq_logprob_error_threshold=1");
    recipe_apply_cli(x, "--calibration.percentile=1");
    EXPECT_EQ(error_of([&] { recipe_validate(x); }), "");
    recipe_apply_cli(x, "--grpo.is_mode=none");
    recipe_apply_cli(x, "--grpo.is_hi=0");
    EXPECT_EQ(error_of([&] { recipe_validate(x); }), "");
  }
  // a number with trailing characters is no number, for integer keys as for real ones; a switch is
  // true or false; a string option may be quoted (the shell left the quotes in)
  for (const char* arg : {"--run.steps=3x", "--optim.lr=1e-3x"}) {
    run_config x;
    EXPECT_NE(error_of([&] { recipe_apply_cli(x, arg); }).find("' is not "), std::string::npos) << arg;
  }
  {
    run_config x;
    EXPECT_EQ(error_of([&] { recipe_apply_cli(x, "--grpo.normalize_std=yes"); }), "option --grpo.normalize_std: 'yes' is not true or false");
    recipe_apply_cli(x, "--task.name=\"builtin:add1\"");
    EXPECT_EQ(x.task, "builtin:add1");
  }
  // a value out of range names where it was set: the file (it named neither) or the option
  const auto range = write_tmp("range.conf", "[rollout]\ntemperature=-1\n");
  run_config f;
  recipe_load_file(f, range);
  EXPECT_EQ(error_of([&] { recipe_validate(f); }),
            "recipe key 'rollout.temperature' (" + range + "): temperature -1 is not a finite number >= 0");
  recipe_apply_cli(f, "--rollout.temperature=-2");  // the option given last decides, and is named
  EXPECT_EQ(error_of([&] { recipe_validate(f); }),
            "recipe key 'rollout.temperature' (--rollout.temperature=-2): temperature -2 is not a finite number >= 0");
  fs::remove(range);
  // CAF's parse errors name the line at fault (CAF counts an unexpected end of line as the next
  // line's column 1); a string left open ran to the end of the file
  const auto empty_value = write_tmp("empty.conf", "[run]\nsteps=3\nname=\n[rollout]\nslots=4\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, empty_value); }).find(empty_value + ":3: the line ends"), std::string::npos)
      << error_of([&] { recipe_load_file(r, empty_value); });
  const auto escape = write_tmp("escape.conf", "[run]\nsteps=4\nname=\"a\\q\"\n");
  EXPECT_NE(error_of([&] { recipe_load_file(r, escape); }).find(escape + ":3:10: illegal_escape_sequence"), std::string::npos);
  const auto unclosed = write_tmp("unclosed.conf", "[run]\nsteps=4\nname=\"abc");
  EXPECT_NE(error_of([&] { recipe_load_file(r, unclosed); }).find(unclosed + ":3: a string is never closed"), std::string::npos);
  for (const auto& f : {open, twice, spaced, braces, fine, empty_value, escape, unclosed}) fs::remove(f);
}

TEST(Recipe, CliOverridesAndDumpRoundTrip) {
  run_config r;
  recipe_apply_cli(r, "--rollout.group_size=4");
  recipe_apply_cli(r, "--grpo.clip_high=0.28");
  recipe_apply_cli(r, "--precision.generation=fp8-kv");
  recipe_apply_cli(r, "--grpo.normalize_std=false");
  EXPECT_EQ(r.group_size, 4);
  EXPECT_EQ(r.clip_high, 0.28);  // strtod is correctly rounded: the literal's double exactly
  // digits past 10 and exponents come back as they were (10 digits rounded them; "1e+20.0"); an
  // option keeps 15 significant digits, as a file does (the run and its resume had two values)
  recipe_apply_cli(r, "--optim.weight_decay=0.3333333333333333");
  EXPECT_EQ(r.weight_decay, 0.333333333333333);
  recipe_apply_cli(r, "--optim.lr=1.2345678912345e-05");
  recipe_apply_cli(r, "--grpo.dual_clip=1e20");
  recipe_apply_cli(r, "--grpo.seq_logprob_error_threshold=3");
  recipe_validate(r);
  const auto f = write_tmp("dump.conf", recipe_dump(r));
  run_config q;
  recipe_load_file(q, f);
  EXPECT_EQ(recipe_to_json(q), recipe_to_json(r));
  EXPECT_EQ(q.lr, 1.2345678912345e-05);
  EXPECT_EQ(q.dual_clip, 1e20);
  EXPECT_NE(recipe_dump(r).find("\nseq_logprob_error_threshold=3.0\n"), std::string::npos);
  // a number that no recipe.conf can hold is refused by its key (inf ran, and its resume failed)
  for (const char* o : {"--grpo.dual_clip=inf", "--grpo.seq_logprob_error_threshold=inf", "--grpo.is_hi=inf"}) {
    run_config bad;
    recipe_apply_cli(bad, o);
    const std::string key = std::string(o).substr(2, std::string(o).find('=') - 2);
    EXPECT_EQ(error_of([&] { recipe_validate(bad); }), "recipe key '" + key + "' (" + o + "): must be a finite number") << o;
  }
  EXPECT_EQ(recipe_to_json(recipe_from_json(recipe_to_json(r))), recipe_to_json(r));
  fs::remove(f);
}

// Every recipe key that the learner, rollouts and calibration read reaches its field of the
// run's rl config, each from its own key: all set to distinct non-default values (the e2e tests
// build their references through the same function, so a swap there -- clip_low for clip_high --
// cancelled out).
TEST(Recipe, RlConfigTakesEachKeyToItsField) {
  run_config r;
  for (const char* o : {"--rollout.group_size=3", "--grpo.normalize_std=false", "--grpo.leave_one_out=true", "--grpo.share_prompts=false", "--grpo.clip_low=0.11",
                        "--grpo.clip_high=0.31", "--grpo.dual_clip=3.5", "--grpo.is_mode=icepop", "--grpo.is_lo=0.4",
                        "--grpo.is_hi=1.7", "--grpo.kl_beta=0.05", "--grpo.seq_logprob_error_threshold=1.6", "--optim.lr=0.001",
                        "--optim.beta1=0.8", "--optim.beta2=0.95", "--optim.eps=1e-06", "--optim.weight_decay=0.01",
                        "--optim.grad_clip=0.5", "--rollout.prompts_per_step=7", "--rollout.max_new_tokens=9",
                        "--rollout.temperature=0.7", "--rollout.top_k=5", "--rollout.top_p=0.9", "--precision.generation=fp8-kv",
                        "--precision.training=bf16", "--precision.scale_mode=fp32", "--precision.bf16_first=1",
                        "--precision.bf16_last=2", "--precision.bf16_names=mlp.down_proj,layers.0.", "--task.verifier=exact", "--run.seed=7", "--calibration.margin=1.2",
                        "--calibration.percentile=0.99", "--health.gates=warn", "--health.min_steps=7",
                        "--health.tmpe_median_max=1.3", "--health.tmpe_steps_above_max=0.2", "--health.gen_kl_mean_max=0.01",
                        "--health.source=audit", "--audit.every=1"})
    recipe_apply_cli(r, o);
  const auto h = recipe_health_config(r);
  EXPECT_EQ(h.mode, fp8rl::models::health_mode::warn);
  EXPECT_EQ(h.source, fp8rl::models::health_source::audit);
  run_config dflt, no_audit;  // auto: the audit where audit mode is on (the default), else staleness 0
  no_audit.audit_every = 0;
  EXPECT_EQ(recipe_health_config(dflt).source, fp8rl::models::health_source::audit);
  run_config sync_run;  // synchronous: every token a staleness-0 one, the whole batch read
  sync_run.max_staleness = 0;
  EXPECT_EQ(recipe_health_config(sync_run).source, fp8rl::models::health_source::trained);
  EXPECT_EQ(recipe_health_config(no_audit).source, fp8rl::models::health_source::trained);
  no_audit.health_source = "audit";
  EXPECT_EQ(recipe_health_config(no_audit).source, fp8rl::models::health_source::audit);  // named: as named
  EXPECT_EQ(h.min_steps, 7);
  EXPECT_EQ(h.tmpe_median_max, 1.3);
  EXPECT_EQ(h.tmpe_steps_above_max, 0.2);
  EXPECT_EQ(h.gen_kl_mean_max, 0.01);
  EXPECT_TRUE(h.fp8_kv);  // precision.generation = fp8-kv
  EXPECT_FALSE(recipe_health_config(run_config{}).fp8_kv);
  const auto c = recipe_rl_config(r);
  EXPECT_EQ(c.grpo.group_size, 3);
  EXPECT_FALSE(c.grpo.normalize_std);
  EXPECT_TRUE(c.grpo.leave_one_out);
  EXPECT_FALSE(c.grpo.share_prompts);
  EXPECT_EQ(c.grpo.clip_low, 0.11f);
  EXPECT_EQ(c.grpo.clip_high, 0.31f);
  EXPECT_EQ(c.grpo.dual_clip, 3.5f);
  EXPECT_EQ(c.grpo.is, fp8rl::models::is_mode::icepop);
  EXPECT_EQ(c.grpo.is_lo, 0.4f);
  EXPECT_EQ(c.grpo.is_hi, 1.7f);
  EXPECT_EQ(c.grpo.kl_beta, 0.05f);
  EXPECT_EQ(c.grpo.seq_logprob_error_threshold, 1.6f);
  EXPECT_EQ(c.opt.lr, 0.001f);
  EXPECT_EQ(c.opt.beta1, 0.8f);
  EXPECT_EQ(c.opt.beta2, 0.95f);
  EXPECT_EQ(c.opt.eps, 1e-6f);
  EXPECT_EQ(c.opt.weight_decay, 0.01f);
  EXPECT_EQ(c.opt.grad_clip, 0.5f);
  EXPECT_EQ(c.prompts_per_step, 7);
  EXPECT_EQ(c.max_new_tokens, 9);
  EXPECT_EQ(c.proc.temperature, 0.7f);
  EXPECT_EQ(c.proc.top_k, 5);
  EXPECT_EQ(c.proc.top_p, 0.9f);
  EXPECT_EQ(c.gen_policy.name, "fp8-kv");
  EXPECT_EQ(c.train_policy.name, "bf16");
  for (const auto* p : {&c.gen_policy, &c.train_policy}) {
    EXPECT_EQ(p->scales, fp8rl::quant::scale_mode::fp32);
    EXPECT_EQ(p->bf16_first, 1);
    EXPECT_EQ(p->bf16_last, 2);
    EXPECT_EQ(p->bf16_names, (std::vector<std::string>{"mlp.down_proj", "layers.0."}));
  }
  EXPECT_EQ(c.verifier, fp8rl::models::verifier_kind::exact);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.kv_margin, 1.2f);
  EXPECT_EQ(c.kv_percentile, 0.99);
}

// Settings that are valid but leave the policy loss without a gradient (or blind to the sampled
// tokens) are named; the defaults and settings that learn are not.
TEST(Recipe, SettingsThatCannotLearnAreNamed) {
  auto problems = [](std::vector<const char*> opts) {
    run_config r;
    for (const char* o : opts) recipe_apply_cli(r, o);
    recipe_validate(r);
    return recipe_learning_problems(r);
  };
  EXPECT_TRUE(problems({}).empty());
  EXPECT_TRUE(problems({"--rollout.temperature=0.5", "--grpo.is_mode=icepop", "--grpo.is_lo=0.5", "--grpo.is_hi=1.5"}).empty());
  EXPECT_TRUE(problems({"--grpo.is_mode=none", "--grpo.is_hi=0"}).empty());  // no IS: the bounds are not used
  auto one = [&](std::vector<const char*> opts, const std::string& what) {
    const auto p = problems(opts);
    ASSERT_EQ(p.size(), 1u) << what;
    EXPECT_NE(p[0].find(what), std::string::npos) << p[0];
  };
  one({"--rollout.group_size=1"}, "rollout.group_size = 1: each completion is its own group");
  one({"--rollout.temperature=0"}, "rollout.temperature = 0: greedy rollouts give a group 8 copies of one completion");
  one({"--grpo.is_hi=0.5"}, "grpo.is_lo/is_hi = [0, 0.5] excludes 1, the weight of a token its sampler and learner agree on: tis clamps");
  one({"--grpo.is_mode=icepop", "--grpo.is_lo=1.2", "--grpo.is_hi=2"}, "[1.2, 2] excludes 1, the weight of a token its sampler and learner agree on: icepop drops every such token");
  EXPECT_EQ(problems({"--rollout.group_size=1", "--grpo.is_hi=0.5"}).size(), 2u);
  // generation and training in different precisions, but for FP8 generation with BF16 training
  one({"--precision.generation=bf16"}, "precision.generation = bf16 and precision.training = fp8 compute their layers in "
                                       "different precisions");
  one({"--precision.generation=fp32", "--precision.training=bf16"}, "different precisions");
  EXPECT_TRUE(problems({"--precision.training=bf16"}).empty());  // fp8-gen: the asymmetric baseline
  EXPECT_TRUE(problems({"--precision.generation=fp8-kv"}).empty());  // fp8-e2e-kv: the cache is generation's alone
  EXPECT_TRUE(problems({"--precision.generation=bf16", "--precision.training=bf16"}).empty());
  one({"--rollout.top_k=1"}, "rollout.top_k = 1: greedy rollouts give a group 8 copies of one completion, whose advantages are 0: "
                             "the policy loss has no gradient");
  one({"--rollout.group_size=1", "--grpo.kl_beta=0.1"}, "is 0: the policy-gradient term is 0 (only grpo.kl_beta's KL term trains)");
}

// icepop and seq-mask-tis given without IS bounds take the spec's reference bounds (tis's [0, 2]
// left seq-mask-tis nearly a no-op), and say so; bounds given, or another mode, are kept.
TEST(Recipe, IsModesWithoutBoundsTakeTheirReferenceBounds) {
  auto finalized = [](std::vector<const char*> opts, std::vector<std::string>* said) {
    run_config r;
    for (const char* o : opts) recipe_apply_cli(r, o);
    recipe_finalize(r, [&](const std::string& m) { said->push_back(m); });
    recipe_validate(r);
    return std::make_pair(r.is_lo, r.is_hi);
  };
  std::vector<std::string> said;
  EXPECT_EQ(finalized({"--grpo.is_mode=icepop"}, &said), std::make_pair(0.5, 5.0));
  EXPECT_EQ(finalized({"--grpo.is_mode=seq-mask-tis"}, &said), std::make_pair(0.999, 1.002));
  ASSERT_EQ(said.size(), 2u);
  EXPECT_NE(said[0].find("grpo.is_mode = icepop: IS bounds [0.5, 5]"), std::string::npos) << said[0];
  EXPECT_NE(said[1].find("grpo.is_mode = seq-mask-tis: IS bounds [0.999, 1.002]"), std::string::npos) << said[1];
  said.clear();
  EXPECT_EQ(finalized({"--grpo.is_mode=icepop", "--grpo.is_hi=3"}, &said), std::make_pair(0.0, 3.0));
  EXPECT_EQ(finalized({"--grpo.is_mode=seq-mask-tis", "--grpo.is_lo=0.9"}, &said), std::make_pair(0.9, 2.0));
  EXPECT_EQ(finalized({}, &said), std::make_pair(0.0, 2.0));  // tis: C = 2, lo = 0
  EXPECT_TRUE(said.empty());
  // a resume: its stored recipe sets every key; a mode given on the command takes its bounds, a
  // stored mode keeps its stored bounds
  const auto stored = write_tmp("stored.conf", "[grpo]\nis_mode=\"tis\"\nis_lo=0.0\nis_hi=2.0\n");
  for (const bool cli_mode : {true, false}) {
    run_config r;
    recipe_load_file(r, stored);
    if (cli_mode) recipe_apply_cli(r, "--grpo.is_mode=icepop");
    else r.is_mode = "icepop", r.set_by["grpo.is_mode"] = stored;
    recipe_finalize(r, [](const std::string&) {}, stored);
    EXPECT_EQ(std::make_pair(r.is_lo, r.is_hi), cli_mode ? std::make_pair(0.5, 5.0) : std::make_pair(0.0, 2.0)) << cli_mode;
  }
  fs::remove(stored);
}

// run.log_level reaches every component logger, those made before and after; a bad level is
// an error naming the key.
TEST(Recipe, LogLevelReachesTheComponentLoggers) {
  auto before = fp8rl::log_get("recipe_test_before");
  run_config r;
  recipe_apply_cli(r, "--run.log_level=warn");
  recipe_validate(r);
  EXPECT_EQ(before->level(), spdlog::level::warn);
  EXPECT_EQ(fp8rl::log_get("recipe_test_after")->level(), spdlog::level::warn);
  recipe_apply_cli(r, "--run.log_level=debug");
  recipe_validate(r);
  EXPECT_EQ(before->level(), spdlog::level::debug);
  recipe_apply_cli(r, "--run.log_level=loud");
  try {
    recipe_validate(r);
    ADD_FAILURE() << "no error for log level 'loud'";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("run.log_level"), std::string::npos) << e.what();
  }
  fp8rl::log_set_level("info");
}

TEST(Recipe, ShippedRecipesAndTopologiesValidate) {
  int recipes = 0, topologies = 0;
  for (const auto& e : fs::directory_iterator("configs/recipes")) {
    ++recipes;
    run_config r;
    EXPECT_NO_THROW(recipe_load_file(r, e.path().string())) << e.path();
    // the 8-GPU recipe names a checkpoint under /models that no test machine has (validation
    // opens it); its refusal before a run starts is E2E's and the README's
    if (e.path().filename() != "llama-3.1-8b-instruct.conf") { EXPECT_NO_THROW(recipe_validate(r)) << e.path(); }
  }
  run_config d;
  EXPECT_NO_THROW(recipe_load_file(d, "configs/default.conf"));
  EXPECT_EQ(recipe_to_json(d), recipe_to_json(run_config{}));  // default.conf documents the defaults
  for (const auto& e : fs::directory_iterator("configs/topologies")) {
    ++topologies;
    EXPECT_NO_THROW(topology_plan(topology_load(e.path().string()))) << e.path();
  }
  EXPECT_GE(recipes, 6);  // run from the repository root (ctest's WORKING_DIRECTORY): the shipped files were read
  EXPECT_GE(topologies, 4);
}

TEST(Topology, Llama8BOnEightGpusPlan) {
  run_config r;
  recipe_load_file(r, "configs/recipes/llama-3.1-8b-instruct.conf");
  EXPECT_EQ(r.prompts_per_step, 64);
  EXPECT_EQ(r.group_size, 32);
  EXPECT_EQ(r.generation, "fp8");
  EXPECT_EQ(r.training, "fp8");
  EXPECT_EQ(r.is_mode, "tis");
  const auto rl = recipe_rl_config(r);
  EXPECT_EQ(rl.gen_policy.fingerprint(), rl.train_policy.fingerprint());  // one policy, both sides
  const auto plan = topology_plan(topology_load("configs/topologies/llama-8gpu.conf"));
  std::set<std::string> gpus;
  int learners = 0, rollouts = 0;
  for (const auto& p : plan) {
    if (p.actor.rfind("learner", 0) == 0) ++learners;
    if (p.actor.rfind("rollout", 0) == 0) ++rollouts;
    if (p.device.rfind("cuda:", 0) == 0) { EXPECT_TRUE(gpus.insert(p.device).second) << p.device; }
  }
  EXPECT_EQ(learners, 4);
  EXPECT_EQ(rollouts, 4);
  EXPECT_EQ(gpus.size(), 8u);
}

TEST(Topology, BadFilesNameNodeAndKey) {
  const auto f1 = write_tmp("t1.conf", "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"tpu:0\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f1); }).find("tpu:0"), std::string::npos);
  for (const char* dev : {"cpu:2147483648", "cpu:4294967297", "cpu:-1", "cpu:2x"})  // INT_MIN threads, 1 thread
    EXPECT_NE(error_of([&] { device_spec::parse(dev, "cluster.nodes[0].learners"); })
                  .find(std::string("cluster.nodes[0].learners: device '") + dev + "' has a bad index"),
              std::string::npos)
        << dev;
  const auto f2 = write_tmp("t2.conf", "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f2); }).find("calibration"), std::string::npos);
  const auto f3 = write_tmp("t3.conf", "[cluster]\nnodes=[{name=\"a\", colour=\"red\"}]\n");
  EXPECT_NE(error_of([&] { topology_load(f3); }).find("unknown key 'colour'"), std::string::npos);
  const auto f4 = write_tmp("t4.conf", "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\", \"calibration\"], learners=[\"cuda:0\"], rollouts=[\"cuda:0\"]}]\n");
  EXPECT_NE(error_of([&] { topology_plan(topology_load(f4)); }).find("cuda:0 used twice"), std::string::npos);
  const auto f5 = write_tmp("t5.conf", "[cluster]\nnodes=[{name=\"a\", roles=[\"buffer\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f5); }).find("no node has the role 'controller'"), std::string::npos);
  // a recipe given as a topology is said to be one
  const auto rec = write_tmp("rec.conf", "[async]\nmax_staleness=1\n");
  EXPECT_EQ(error_of([&] { topology_load(rec); }),
            rec + ": unknown section [async] (a topology holds [cluster] only; this looks like a recipe: give it with --recipe)");
  fs::remove(rec);
  // no learner anywhere is said so (it blamed calibration: "must run on the node of learner 0")
  const auto f5b = write_tmp("t5b.conf", "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\", \"calibration\"], learners=[], rollouts=[\"cpu:1\"]}]\n");
  EXPECT_EQ(error_of([&] { topology_load(f5b); }), f5b + ": no learner (no node lists learners)");
  fs::remove(f5b);
  // calibration beside learner 1 only: learner 0's one-message FP32 weights would cross processes
  const auto f7 = write_tmp("t7.conf",
                            "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\"], "
                            "learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]},\n{name=\"b\", port=47301, roles=[\"calibration\"], "
                            "learners=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f7); }).find("node 'b': calibration must run on the node of learner 0"), std::string::npos)
      << error_of([&] { topology_load(f7); });
  // weight-sync away from calibration: each bundle would cross processes in one message (CAF 0.17
  // truncates one past 4 GiB in silence); the shipped four-process topology keeps them together
  const auto f7w = write_tmp("t7w.conf",
                             "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\"], "
                             "rollouts=[\"cpu:1\"]},\n{name=\"b\", port=47301, roles=[\"calibration\"], learners=[\"cpu:1\"]}]\n");
  EXPECT_EQ(error_of([&] { topology_load(f7w); }),
            f7w + ": node 'a': weight_sync must run on the node of calibration ('b'): calibration hands it each bundle in one "
                  "message, which must not cross processes (weight-sync sends bundles to other processes in chunks)");
  EXPECT_NO_THROW(topology_load("configs/topologies/four-process.conf"));
  // learners on two machines: their Gloo all-reduce meets through the run directory on 127.0.0.1
  const auto f7h = write_tmp("t7h.conf",
                             "[cluster]\nnodes=[{name=\"a\", host=\"10.0.0.1\", roles=[\"controller\", \"buffer\", \"reward\", "
                             "\"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]},\n"
                             "{name=\"b\", host=\"10.0.0.2\", port=47301, learners=[\"cpu:1\"]}]\n");
  EXPECT_EQ(error_of([&] { topology_load(f7h); }),
            f7h + ": node 'b': learners on host 10.0.0.2 and on host 10.0.0.1: every learner must run on one host (their Gloo "
                  "all-reduce meets through the run directory and 127.0.0.1)");
  // on one machine under two loopback names they may
  const auto f7l = write_tmp("t7l.conf",
                             "[cluster]\nnodes=[{name=\"a\", host=\"127.0.0.1\", roles=[\"controller\", \"buffer\", \"reward\", "
                             "\"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]},\n"
                             "{name=\"b\", host=\"localhost\", port=47301, learners=[\"cpu:1\"]}]\n");
  EXPECT_NO_THROW(topology_load(f7l));
  for (const auto& f : {f7w, f7h, f7l}) fs::remove(f);
  // a key twice in one node: CAF kept the last ("main" was planned as "other")
  const auto f8 = write_tmp("t8.conf", "[cluster]\nnodes=[{name=\"main\", name=\"other\", roles=[\"controller\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f8); }).find("t8.conf:2: key 'name' given twice in one { ... }"), std::string::npos)
      << error_of([&] { topology_load(f8); });
  const auto f6 = write_tmp("t6.conf", "[cluster]\nnodes=[{name=\"a\", roles=[\"controller\"]}\n");  // never closed
  EXPECT_NE(error_of([&] { topology_load(f6); }).find("is never closed"), std::string::npos);
  // a node's name becomes traces/NAME.jsonl ("../../evil" wrote outside the run directory); an
  // empty host was accepted
  const auto f9 = write_tmp("t9.conf", "[cluster]\nnodes=[{name=\"../../evil\", roles=[\"controller\", \"buffer\", \"reward\", "
                                        "\"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f9); }).find("node '../../evil': the name must be letters, digits"), std::string::npos)
      << error_of([&] { topology_load(f9); });
  const auto f10 = write_tmp("t10.conf", "[cluster]\nnodes=[{name=\"a\", host=\"\", roles=[\"controller\", \"buffer\", \"reward\", "
                                          "\"weight_sync\", \"calibration\"], learners=[\"cpu:1\"], rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f10); }).find("node 'a': key 'host' is empty"), std::string::npos)
      << error_of([&] { topology_load(f10); });
  // one port under two names of this machine: accepted, the second node failed to open it at run time
  const auto f11 = write_tmp("t11.conf", "[cluster]\nnodes=[{name=\"a\", host=\"127.0.0.1\", port=47211, roles=[\"controller\", "
                                          "\"buffer\", \"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"]},\n"
                                          "{name=\"b\", host=\"localhost\", port=47211, rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f11); }).find("node 'b': port 47211 reused on host localhost"), std::string::npos)
      << error_of([&] { topology_load(f11); });
  // ports are 16 bits; a name starting with '.' is refused (traces/.NAME.jsonl is hidden); a
  // node other than the controller's is reached at its port, so it must have one
  const std::string roles = "roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"]";
  const auto f12 = write_tmp("t12.conf", "[cluster]\nnodes=[{name=\"a\", port=65536, " + roles + ", rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f12); }).find("key 'port' must be an integer in [0, 65535]"), std::string::npos)
      << error_of([&] { topology_load(f12); });
  const auto f13 = write_tmp("t13.conf", "[cluster]\nnodes=[{name=\".hidden\", " + roles + ", rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f13); }).find("not starting with '.'"), std::string::npos) << error_of([&] { topology_load(f13); });
  const auto f14 = write_tmp("t14.conf", "[cluster]\nnodes=[{name=\"a\", " + roles + "},\n{name=\"b\", rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f14); }).find("node 'b': a remote node needs a port"), std::string::npos)
      << error_of([&] { topology_load(f14); });
  const auto f15 = write_tmp("t15.conf", "[cluster]\nnodes=[{name=\"a\", port=47500, " + roles + "},\n"
                                          "{name=\"a\", port=47501, rollouts=[\"cpu:1\"]}]\n");
  EXPECT_NE(error_of([&] { topology_load(f15); }).find("node 'a': duplicate name"), std::string::npos)
      << error_of([&] { topology_load(f15); });
  for (const auto& f : {f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15}) fs::remove(f);
}

// What a node agent is sent (the recipe and topology in their JSON forms) round-trips, and the
// node refuses what the controller's checks refuse (it parsed them unchecked): the host set
// that shares one machine's memory is every name of this machine.
TEST(Topology, JsonFormsRoundTripAndAreValidatedOnTheNode) {
  const auto f = write_tmp("tj.conf", "[cluster]\nnodes=[{name=\"a\", host=\"127.0.0.1\", roles=[\"controller\", \"buffer\", "
                                      "\"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:2\"]},\n"
                                      "{name=\"b\", host=\"10.1.2.3\", port=47400, rollouts=[\"cpu:1\", \"cuda:3\"]}]\n");
  const topology t = topology_load(f);
  const std::string j = topology_to_json(t);
  EXPECT_EQ(topology_to_json(topology_from_json(j)), j);
  const topology back = topology_from_json(j);  // field by field: a name written for the host round-trips too
  ASSERT_EQ(back.nodes.size(), 2u);
  EXPECT_EQ(back.nodes.at(1).name, "b");
  EXPECT_EQ(back.nodes.at(1).host, "10.1.2.3");
  EXPECT_EQ(back.nodes.at(1).port, 47400);
  EXPECT_EQ(back.nodes.at(0).roles, t.nodes.at(0).roles);
  EXPECT_EQ(back.nodes.at(0).learners.at(0).str(), "cpu:2");
  EXPECT_EQ(topology_from_json(j).nodes.at(1).rollouts.at(1).str(), "cuda:3");
  auto dup = nlohmann::json::parse(j);
  dup[1]["name"] = "a";
  EXPECT_NE(error_of([&] { topology_from_json(dup.dump()); }).find("(from controller): node 'a': duplicate name"), std::string::npos)
      << error_of([&] { topology_from_json(dup.dump()); });
  auto no_port = nlohmann::json::parse(j);
  no_port[1].erase("port");
  EXPECT_NE(error_of([&] { topology_from_json(no_port.dump()); }).find("malformed topology json"), std::string::npos);
  auto far_port = nlohmann::json::parse(j);
  far_port[1]["port"] = 70000;
  EXPECT_NE(error_of([&] { topology_from_json(far_port.dump()); }).find("node 'b': port 70000 is not in [0, 65535]"), std::string::npos)
      << error_of([&] { topology_from_json(far_port.dump()); });
  for (int port : {65536, -1}) {  // the bounds themselves
    far_port[1]["port"] = port;
    EXPECT_NE(error_of([&] { topology_from_json(far_port.dump()); }).find("port " + std::to_string(port) + " is not in [0, 65535]"),
              std::string::npos) << port;
  }
  far_port[1]["port"] = 65535;
  EXPECT_EQ(error_of([&] { topology_from_json(far_port.dump()); }), "");
  EXPECT_NE(error_of([&] { recipe_from_json("{\"run.steps\": "); }).find("recipe json: "), std::string::npos);
  {  // a key the node's build knows and the controller's did not send is named, not defaulted
    auto j = nlohmann::json::parse(recipe_to_json(run_config{}));
    j.erase("run.seed");
    EXPECT_EQ(error_of([&] { recipe_from_json(j.dump()); }), "recipe json: key 'run.seed' missing");
  }
  run_config r;
  r.steps = 0;  // recipe_to_json does not check; the node does
  EXPECT_NE(error_of([&] { recipe_from_json(recipe_to_json(r)); }).find("recipe key 'run.steps': must be > 0"), std::string::npos)
      << error_of([&] { recipe_from_json(recipe_to_json(r)); });
  for (const char* h : {"127.0.0.1", "127.0.1.1", "localhost", "::1"}) EXPECT_TRUE(host_same_machine(h)) << h;
  EXPECT_FALSE(host_same_machine("10.1.2.3"));
  char self[256] = {};
  ASSERT_EQ(::gethostname(self, sizeof self - 1), 0);
  EXPECT_TRUE(host_same_machine(self));  // this machine by its own name
  EXPECT_FALSE(host_is_local("127.0.1.1"));  // one address per name for the port check
  for (const char* h : {"127.0.0.1", "localhost", "::1"}) EXPECT_EQ(host_canonical(h), "localhost") << h;
  fs::remove(f);
}

// More malformed topologies, each refused with the file, the node or key, and what is wrong.
TEST(Topology, MoreBadFilesAreNamed) {
  const std::string all = "roles=[\"controller\", \"buffer\", \"reward\", \"weight_sync\", \"calibration\"], learners=[\"cpu:1\"]";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[cluster]\ncolour=1\nnodes=[{name=\"a\", " + all + ", rollouts=[\"cpu:1\"]}]\n", ": unknown key 'cluster.colour'"},
      {"[cluster]\nnodes=[{" + all + ", rollouts=[\"cpu:1\"]}]\n", ": cluster.nodes[0]: key 'name' missing"},
      {"[cluster]\nnodes=[{name=\"a\", " + all + ", rollouts=[\"cpu:1\"]},\n{name=\"b\", port=47301, rollouts=[\"tpu:0\"]}]\n",
       ": cluster.nodes[1].rollouts: device 'tpu:0' must be cpu:N or cuda:K"},
      {"[cluster]\nnodes=[{name=\"a\", " + all + ", rollouts=[\"cpu:1\"]},\n{name=\"b\", port=47301, roles=[\"buffer\"]}]\n",
       ": node 'b': role 'buffer' is already on node 'a'"},
      {"[cluster]\nnodes=[{name=\"a\", " + all + "}]\n", ": no rollout"},
      {"[cluster]\nnodes=[{name=\"a\", " + all + ", rollouts=[\"cpu:65536\"]}]\n",
       ": cluster.nodes[0].rollouts: device 'cpu:65536' has a bad index (an integer in [0, 65535])"},
      {"[cluster]\nnodes=[{name=\"a\", " + all + ", rollouts=[\"cuda\"]}]\n",
       ": cluster.nodes[0].rollouts: device 'cuda' needs a GPU index (cuda:K)"}};
  for (const auto& [text, why] : cases) {
    const auto f = write_tmp("more.conf", text);
    EXPECT_EQ(error_of([&] { topology_load(f); }), f + why) << text;
    fs::remove(f);
  }
  EXPECT_EQ(device_spec::parse("cpu:65535", "x").index, 65535);
}

// A cpu:K past the CPUs oneTBB may use on the node's machine is refused, named (its arena got
// fewer threads, with only TBB's own warning); cpu:0 (all) and devices that fit are fine.
TEST(Topology, CpuDevicesPastThisMachinesCpusAreRefused) {
  auto dev = [](const char* s) { return device_spec::parse(s, "test"); };
  EXPECT_EQ(device_capacity_problem(dev("cpu:3"), 2),
            "device 'cpu:3' asks for 3 threads and this machine runs 2 (the CPUs oneTBB may use here): give it cpu:2 or fewer");
  EXPECT_EQ(device_capacity_problem(dev("cpu:2"), 2), "");
  EXPECT_EQ(device_capacity_problem(dev("cpu:0"), 2), "");
  EXPECT_EQ(device_capacity_problem(dev("cpu:1")), "");
}

// Tile GEMMs (AMX) are asked of the CPU only where a node runs them: a rollout-only node takes
// precision.generation's, learners, calibration and the warm start both (every process of a run
// was refused for either); where AMX exists nothing is refused.
TEST(Topology, TilePoliciesAreCheckedWhereANodeRunsThem) {
  run_config r;
  r.training = "bf16-tiles";
  node_spec rollout_only, learner, controller_only;
  rollout_only.rollouts.assign(1, device_spec{});
  learner.learners.assign(1, device_spec{});
  controller_only.roles = {"controller", "buffer", "reward", "weight_sync"};
  const bool amx = fp8rl::quant::gemm_tiles_available();
  const std::string no_amx = "precision.training = bf16-tiles asks for tile GEMMs and this CPU has no AMX-BF16";
  EXPECT_EQ(node_tiles_problem(r, rollout_only, false), "");
  EXPECT_EQ(node_tiles_problem(r, controller_only, false), "");
  EXPECT_EQ(node_tiles_problem(r, learner, false).rfind(amx ? "" : no_amx, 0), 0u) << node_tiles_problem(r, learner, false);
  EXPECT_EQ(node_tiles_problem(r, controller_only, true).rfind(amx ? "" : no_amx, 0), 0u);  // its SFT warm start
  node_spec calibration_only;  // calibration quantizes under the training policy too
  calibration_only.roles = {"calibration"};
  EXPECT_EQ(node_tiles_problem(r, calibration_only, false).rfind(amx ? "" : no_amx, 0), 0u);
  r.training = "fp8";
  r.generation = "fp8-tiles";
  EXPECT_EQ(node_tiles_problem(r, rollout_only, false).rfind(amx ? "" : "precision.generation = fp8-tiles asks", 0), 0u);
  EXPECT_EQ(node_tiles_problem(r, controller_only, false), "");
  EXPECT_EQ(node_tiles_problem(r, learner, false).rfind(amx ? "" : "precision.generation = fp8-tiles asks", 0), 0u);
}

// A node's CAF workers: the default grows to a worker per learner and rollout plus two; a value
// the user gave below that is refused by name; enough is kept as given.
TEST(Topology, SchedulerWorkersFitTheNodesComputingActors) {
  node_spec n;
  n.name = "big";
  n.learners.assign(3, device_spec{});
  n.rollouts.assign(5, device_spec{});
  EXPECT_EQ(node_scheduler_threads(n, 8, workers_from::default_value), 10u);
  EXPECT_EQ(node_scheduler_threads(n, 12, workers_from::user), 12u);
  EXPECT_EQ(node_scheduler_threads(n, 10, workers_from::user), 10u);
  try {
    node_scheduler_threads(n, 9, workers_from::user);
    ADD_FAILURE() << "9 workers for 8 computing actors accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--scheduler.max-threads=9: node 'big' runs 3 learner(s) and 5 rollout(s), each blocking a "
                           "worker while it computes; give at least 10");
  }
  EXPECT_EQ(node_scheduler_threads(topology_local(1, 1).nodes[0], 8, workers_from::user), 8u);  // the embedded default
}

TEST(Recipe, RunNameMustBeAPlainDirectoryName) {
  for (const char* bad : {"", "../up", ".hidden", "a/b", "a b"}) {
    run_config r;
    r.name = bad;
    EXPECT_NE(error_of([&] { recipe_validate(r); }).find("recipe key 'run.name'"), std::string::npos) << bad;
  }
  run_config ok;
  ok.name = "exp-1.2_b";
  EXPECT_EQ(error_of([&] { recipe_validate(ok); }), "");
}

namespace {
node_spec node_of(const std::string& name, const std::string& host, int64_t port, std::vector<std::string> roles,
                  std::vector<std::string> learners, std::vector<std::string> rollouts) {
  node_spec n;
  n.name = name, n.host = host, n.port = port, n.roles = std::move(roles);
  for (const auto& d : learners) n.learners.push_back(device_spec::parse(d, "test"));
  for (const auto& d : rollouts) n.rollouts.push_back(device_spec::parse(d, "test"));
  return n;
}
}  // namespace

// The KV-memory check counts the engines of every node on the checking node's machine: loopback
// aliases together, this machine's hostname with them, learner0's validation engine once; a
// remote node (its own hostname) leaves out the loopback nodes, which are caf-run's machine.
TEST(Preflight, KvMemoryCountsTheEnginesOfThisMachinesNodes) {
  const auto tok = fp8rl::models::char_tokenizer_make(fp8rl::models::arithmetic_alphabet());
  char self[256] = {};
  ASSERT_EQ(::gethostname(self, sizeof self - 1), 0);
  topology t;
  t.nodes = {node_of("a", "127.0.0.1", 0, {"controller", "buffer", "reward", "weight_sync", "calibration"}, {"cpu:1"}, {"cpu:1"}),
             node_of("b", "localhost", 47500, {}, {}, {"cpu:1"}),
             node_of("c", self, 47501, {}, {"cpu:1"}, {"cpu:1"}),  // learner rank 1: no validation engine
             node_of("d", "10.9.9.9", 47502, {}, {}, {"cpu:1", "cpu:1"})};  // another machine: in neither count
  run_config huge;
  huge.slots = 65536, huge.max_context = 1048576;
  const auto model = builtin_model_config(huge, *tok);
  auto why = [&](const run_config& cfg, const topology& top, const std::string& node) {
    return error_of([&] { (void)host_memory_check(cfg, model, top, node, 0); });
  };
  EXPECT_NE(why(huge, t, "a").find("host 127.0.0.1 (node(s) a, b, c) needs at least "), std::string::npos) << why(huge, t, "a");
  EXPECT_NE(why(huge, t, "a").find("the KV caches of the 4 generation engine(s) (3 rollout(s), learner0's validation)"),
            std::string::npos) << why(huge, t, "a");
  EXPECT_NE(why(huge, t, "a").find("the FP32 state of 2 learner(s) ("), std::string::npos) << why(huge, t, "a");
  EXPECT_NE(why(huge, t, "c").find("host " + std::string(self) + " (node(s) c) needs at least "), std::string::npos) << why(huge, t, "c");
  EXPECT_NE(why(huge, t, "c").find("the KV caches of the 1 generation engine(s) (1 rollout(s))"), std::string::npos) << why(huge, t, "c");
  EXPECT_NE(why(huge, t, "c").find("the FP32 state of 1 learner(s) ("), std::string::npos) << why(huge, t, "c");
  // rank 1's host: its gradients; neither validation, calibration's copy nor the audit
  EXPECT_NE(why(huge, t, "c").find("master weights, AdamW moments, gradients)"), std::string::npos) << why(huge, t, "c");
  EXPECT_EQ(why(huge, t, "c").find("audit"), std::string::npos) << why(huge, t, "c");
  // the sum is what is checked: one engine at 3/4 of the memory fits, a rollout and learner0's
  // validation engine (topology_local) do not; two at 2/5 each do
  run_config one = huge;
  one.slots = 1;
  const double slot = fp8rl::models::engine_kv_bytes(model, recipe_engine_config(one)), ram = fp8rl::models::machine_memory_bytes();
  one.slots = static_cast<int64_t>(0.75 * ram / slot);
  EXPECT_NE(why(one, topology_local(1, 1), "local").find("2 generation engine(s)"), std::string::npos) << why(one, topology_local(1, 1), "local");
  one.slots = static_cast<int64_t>(0.4 * ram / slot);
  EXPECT_EQ(why(one, topology_local(1, 1), "local"), "");
}

// The engines' weights and the learners' FP32 state count against the host too. With the built-in
// model's vocabulary grown until one FP32 copy of its weights is `copies_fit` times less than the
// memory (the vocabulary: nearly all of it), in copies: each engine's FP8 bundle ~1/2 (the
// embedding and lm_head BF16; FP32 generation 1); each rank's master weights and AdamW moments 3,
// a step's gradients 1 a rank, or instead learner0's validation (its engine and a copy of the
// weights, beside the other ranks' gradients with eval.every > 0); rank 0's copy for calibration 1
// and the audit's copies 1 a held version; each rank's grpo.kl_beta reference 1.
TEST(Preflight, HostMemoryCountsTheEnginesWeightsTheLearnersAndTheAuditsCopies) {
  const auto tok = fp8rl::models::char_tokenizer_make(fp8rl::models::arithmetic_alphabet());
  run_config cfg;
  cfg.slots = 1;  // the KV caches: a few MiB beside the weights
  cfg.steps = 200, cfg.eval_every = 25, cfg.audit_every = 1;
  const double ram = fp8rl::models::machine_memory_bytes();
  auto model_at = [&](double copies_fit) {
    auto m = builtin_model_config(cfg, *tok);
    auto copy_bytes = [&] { return 4.0 * double(fp8rl::models::model_param_layout(m).total); };
    const double base = copy_bytes();
    m.vocab_size += 1;
    const double per_token = copy_bytes() - base;  // the embedding's and lm_head's row
    m.vocab_size += static_cast<int64_t>((ram / copies_fit - copy_bytes()) / per_token);
    EXPECT_NEAR(copy_bytes() / ram, 1 / copies_fit, 1e-4);
    return m;
  };
  auto why = [&](const run_config& c, const fp8rl::models::model_config& m, const topology& top, uint64_t start = 0) {
    return error_of([&] { (void)host_memory_check(c, m, top, "local", start); });
  };
  const topology local = topology_local(1, 1);
  // one learner: 1 (two engines' weights) + 5 (3 + validation's 1 + calibration's 1) + the audit's
  const auto model = model_at(8.5);
  for (const int64_t staleness : {1, 2}) {  // 7, 8 copies
    cfg.max_staleness = staleness;
    EXPECT_EQ(why(cfg, model, local), "") << staleness;
  }
  const std::string fits = host_memory_check(cfg, model, local, "local", 0);  // for the start's log: the same parts
  EXPECT_EQ(fits.rfind("host 127.0.0.1 (node(s) local): at least ", 0), 0u) << fits;
  EXPECT_NE(fits.find("audit.every 1: the audit's copies of 2 version(s) (async.max_staleness 2)"), std::string::npos) << fits;
  topology nodes;  // two processes on this machine: the line is the host's, said by its first node only
  nodes.nodes = {node_of("a", "127.0.0.1", 0, {"controller", "buffer", "reward", "weight_sync", "calibration"}, {"cpu:1"}, {"cpu:1"}),
                 node_of("b", "localhost", 47500, {}, {}, {"cpu:1"})};
  const auto tiny = builtin_model_config(cfg, *tok);
  EXPECT_EQ(host_memory_check(cfg, tiny, nodes, "a", 0).rfind("host 127.0.0.1 (node(s) a, b): at least ", 0), 0u);
  EXPECT_EQ(host_memory_check(cfg, tiny, nodes, "b", 0), "");
  cfg.max_staleness = 3;  // 9
  const std::string three = why(cfg, model, local);
  EXPECT_NE(three.find("the FP32 state of 1 learner(s) (" + std::to_string(fp8rl::models::model_param_layout(model).total) +
                       " parameters: master weights, AdamW moments, learner0's copy for validation, rank 0's copy for calibration)"),
            std::string::npos) << three;
  EXPECT_NE(three.find("the weights of the 2 generation engine(s) under precision.generation fp8"), std::string::npos) << three;
  EXPECT_NE(three.find("audit.every 1: the audit's copies of 3 version(s) (async.max_staleness 3)"), std::string::npos) << three;
  EXPECT_NE(three.find("set audit.every = 0 or lower async.max_staleness"), std::string::npos) << three;
  EXPECT_EQ(three.find("grpo.kl_beta"), std::string::npos) << three;
  EXPECT_EQ(three.find("lower rollout.slots"), std::string::npos) << three;  // the KV caches' fix: under a tenth of the need
  EXPECT_EQ(why(cfg, model, local, 198), "");  // two steps left: two copies held at most (8)
  EXPECT_NE(why(cfg, model, local, 197), "");
  cfg.audit_every = 0;  // 6
  EXPECT_EQ(why(cfg, model, local), "");
  cfg.audit_every = 2, cfg.max_staleness = 2, cfg.kl_beta = 0.01;  // 9
  EXPECT_NE(why(cfg, model, local).find("grpo.kl_beta: the reference weights of each learner"), std::string::npos)
      << why(cfg, model, local);
  cfg.kl_beta = 0, cfg.generation = "fp32";  // 9
  EXPECT_NE(why(cfg, model, local).find("the weights of the 2 generation engine(s) under precision.generation fp32"), std::string::npos)
      << why(cfg, model, local);
  // two learners, one audited version: 1 + 9 (6 + validation's 1 + the other rank's gradients 1 +
  // calibration's 1) + 1 = 11 fit in 11.5 (a copy more -- calibration's or the audit's on each
  // rank -- would not); the KL references, one a rank (13), not in 12.5; without validations
  // between steps (eval.every 0) the gradients of both ranks instead: 10.5 fit in 10.75, 11 not
  cfg.generation = "fp8", cfg.max_staleness = 1;
  topology two = local;
  two.nodes[0].learners.push_back(two.nodes[0].learners[0]);
  EXPECT_EQ(why(cfg, model_at(11.5), two), "");
  cfg.kl_beta = 0.01;
  EXPECT_NE(why(cfg, model_at(12.5), two).find("the FP32 state of 2 learner(s) ("), std::string::npos) << why(cfg, model_at(12.5), two);
  cfg.kl_beta = 0;
  EXPECT_NE(why(cfg, model_at(10.75), two).find("learner0's copy for validation, the other ranks' gradients"), std::string::npos)
      << why(cfg, model_at(10.75), two);
  cfg.eval_every = 0;
  EXPECT_EQ(why(cfg, model_at(10.75), two), "");
  EXPECT_NE(why(cfg, model_at(10.25), two).find("master weights, AdamW moments, gradients, rank 0's copy for calibration"),
            std::string::npos) << why(cfg, model_at(10.25), two);
  // ... unless the final validation is the larger: FP32 generation's engines (2), 6 + calibration's
  // 1 + validation's 1 (the other rank stopped) + the audit's 1 = 11, in 11.5
  cfg.generation = "fp32";
  EXPECT_EQ(why(cfg, model_at(11.5), two), "");
}

// Prompts must leave room for the longest response: builtin:add2's longest prompt ("99+99=" after
// BOS... 7 tokens) with rollout.max_new_tokens 5 fits model.max_context 12 exactly, not 11.
TEST(Preflight, PromptsFitTheContextWithTheLongestResponse) {
  const auto tok = fp8rl::models::char_tokenizer_make(fp8rl::models::arithmetic_alphabet());
  run_config r;
  r.max_context = 12;
  EXPECT_EQ(error_of([&] { examples_fit_check(r, *tok); }), "");
  r.max_context = 11;
  EXPECT_NE(error_of([&] { examples_fit_check(r, *tok); }).find("prompt of 7 tokens + rollout.max_new_tokens 5 do not fit model.max_context 11"),
            std::string::npos) << error_of([&] { examples_fit_check(r, *tok); });
}

// An answer counts as rewardable by its shortest accepted form: under the numeric verifier
// "100000" is also "1e+05" (5 tokens with this alphabet, fitting rollout.max_new_tokens 5), and
// the longest, " 100000" (7), is never the one compared.
TEST(Preflight, AnswersFitByTheirShortestAcceptedForm) {
  const auto tok = fp8rl::models::char_tokenizer_make("0123456789e+= ");
  const auto f = write_tmp("big.jsonl", "{\"prompt\": \"1e5=\", \"answer\": \"100000\"}\n");
  run_config r;
  r.task = f;
  EXPECT_EQ(error_of([&] { examples_fit_check(r, *tok); }), "");
  r.max_new_tokens = 4;  // no form fits now: refused, naming the example and its shortest form
  EXPECT_NE(error_of([&] { examples_fit_check(r, *tok); }).find("1 of 1 training answers can never be rewarded"), std::string::npos)
      << error_of([&] { examples_fit_check(r, *tok); });
  EXPECT_NE(error_of([&] { examples_fit_check(r, *tok); }).find("'100000', 5 tokens, more than rollout.max_new_tokens 4"), std::string::npos)
      << error_of([&] { examples_fit_check(r, *tok); });
  fs::remove(f);
  // each answer is counted once, by its first reason, and each reason shows its first example
  // ('two' was counted as no number and again as not encodable; a long answer's length unshown)
  const auto mix = write_tmp("mix.jsonl", "{\"prompt\": \"1+1=\", \"answer\": \"two\"}\n"
                                          "{\"prompt\": \"1+1=\", \"answer\": 123456789}\n");
  run_config m;
  m.task = mix;
  EXPECT_EQ(error_of([&] { examples_fit_check(m, *tok); }),
            "2 of 2 training answers can never be rewarded: 1 (the first: " + mix + ":1, 'two', not a number under "
            "task.verifier = numeric) and 1 (the first: " + mix + ":2, '123456789', 9 tokens, more than rollout.max_new_tokens 5): "
            "use task.verifier = exact; raise rollout.max_new_tokens (and model.max_context with it)");
  fs::remove(mix);
}
