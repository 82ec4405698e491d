// tests/tools/cli_test.cpp -- the fp8rl subcommands as a user runs them, on a tiny saved model:
// good input gives one JSON line per item; bad input (options out of range or given twice,
// malformed or empty files, a directory for a file, a broken model directory) exits non-zero
// with a message naming what is wrong -- never a crash, a silent fallback or an empty success.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "models/params.hpp"
#include "models/tokenizer.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;

namespace {
const std::string kBin = FP8RL_BIN_DIR;

using result = fp8rl::test::command_result;

result run(const std::string& args) { return fp8rl::test::run_command(kBin + "/fp8rl " + args); }

class Cli : public ::testing::Test {
 protected:
  fs::path dir, model, prompts;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("fp8rl_cli_test_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    fp8rl::models::model_config c;
    c.hidden_size = 64; c.intermediate_size = 128; c.num_hidden_layers = 2; c.num_attention_heads = 4;
    c.num_key_value_heads = 2; c.head_dim = 16; c.vocab_size = 40; c.max_position_embeddings = 64;
    model = dir / "model";
    fp8rl::models::model_save(model.string(), fp8rl::models::model_params_init(c, 1));
    prompts = write("p.jsonl", "{\"tokens\": [1, 2, 3]}\n{\"tokens\": [4, 5, 6, 7]}\n");
  }
  void TearDown() override { fs::remove_all(dir); }
  fs::path write(const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return dir / name;
  }
  std::string m() const { return " --model " + model.string(); }
  // rc != 0 and the output names `what`
  void refused(const std::string& args, const std::string& what) {
    const result r = run(args);
    EXPECT_NE(r.rc, 0) << args << "\n" << r.out;
    EXPECT_LT(r.rc, 128) << "crashed: " << args << "\n" << r.out;
    EXPECT_NE(r.out.find(what), std::string::npos) << args << "\n" << r.out;
  }
};
}  // namespace

TEST_F(Cli, GoodInputGivesOneLinePerItem) {
  for (const std::string cmd : {"score --input ", "generate --max-tokens 3 --prompts "}) {
    const result r = run(cmd + prompts.string() + m());
    EXPECT_EQ(r.rc, 0) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
  }
  // score: a logprob per token after the first (3 and 4 tokens: 2 and 3), and a sequence of
  // exactly max_position_embeddings (64) tokens fits
  std::string full = "{\"tokens\": [1";
  for (int i = 1; i < 64; ++i) full += ", " + std::to_string(i % 40);
  const fs::path scored = write("s.jsonl", "{\"tokens\": [1, 2, 3]}\n{\"tokens\": [4, 5, 6, 7]}\n" + full + "]}\n");
  const result r = run("score --input " + scored.string() + m());
  ASSERT_EQ(r.rc, 0) << r.out;
  std::vector<size_t> counts;
  std::istringstream lines(r.out);
  for (std::string l; std::getline(lines, l);)
    if (l.rfind("{", 0) == 0) counts.push_back(nlohmann::json::parse(l)["logprobs"].size());
  EXPECT_EQ(counts, (std::vector<size_t>{2, 3, 63})) << r.out;
}

// Output that does not get out (standard output on a full disk) fails the command, saying so: the
// lines are its result (score and generate exited 0 with their lines cut); a benchmark's too.
TEST_F(Cli, AFullStandardOutputFailsTheCommand) {
  for (const std::string& cmd : {"score --input " + prompts.string() + m(), "generate --max-tokens 3 --prompts " + prompts.string() + m(),
                                std::string("--dump-config")}) {
    const result r = fp8rl::test::run_command("(" + kBin + "/fp8rl " + cmd + " > /dev/full)");
    EXPECT_EQ(r.rc, 1) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find(": error: writing standard output failed: No space left on device"), std::string::npos) << cmd << "\n" << r.out;
  }
  const result b = fp8rl::test::run_command("(" + kBin + "/bench-quant --quick --json > /dev/full)");
  EXPECT_EQ(b.rc, 1) << b.out;
  EXPECT_NE(b.out.find("bench: writing standard output failed: No space left on device"), std::string::npos) << b.out;
}

TEST_F(Cli, OptionsOutOfRangeOrRepeatedAreRefusedByName) {
  const std::string gen = "generate --prompts " + prompts.string() + m();
  refused(gen + " --threads 10000000", "--threads");  // was a segfault
  refused(gen + " --slots 99999999999", "--slots");   // was std::bad_alloc
  refused(gen + " --max-tokens 99999999999", "--max-tokens");  // wrapped to a small number
  refused(gen + " --max-context 100000", "--max-context");
  refused(gen + " --temperature -1", "temperature");
  refused(gen + " --top-p 1.5", "top_p");
  refused(gen + " --stop 1,", "--stop");
  refused(gen + " --stop=", "--stop");  // would have turned EOS off
  refused(gen + " --seed -1", "--seed");
  refused(gen + " --temperature 0.5x", "option --temperature: '0.5x' is not a number");  // trailing characters
  refused(gen + " --stop 40", "option --stop: '40' is not a token id in [0, 40)");      // the vocabulary's end
  refused(gen + " --bf16-layers 1x,2", "--bf16-layers");
  refused(gen + " --policy fp8 --bf16-layers 1", "expected FIRST,LAST");  // was taken as 1,0
  refused(gen + " --policy fp32 --bf16-layers 1,1", "runs no layer in FP8");  // was ignored
  refused("score --input " + prompts.string() + " --input " + prompts.string() + m(), "given twice");
  refused("eval --n 0" + m(), "--n");  // printed -nan accuracies with rc 0
  // an empty value: `sft --out=` trained every step, then failed to rename its .tmp into ""
  refused("sft --out= --steps 1 --batch 2", "option --out has an empty value");
  EXPECT_FALSE(fs::exists(".tmp"));
  refused("sft --out " + (dir / "o").string() + " --lr 1e-13", "outside [1e-12, 10]");  // printed [0.000000, 10.000000]
  // the benchmarks' numeric options: garbage, 0 and negatives are refused by name (a crash, a
  // silent 5 for "5x", inf in the JSON for --reps=0 before)
  for (const std::string bad : {"/bench-decode --layers=abc", "/bench-decode --batch=3abc", "/bench-quant --reps=0",
                                "/bench-quant --threads=1,,2", "/bench-gemm --shapes=64x-128x128",
                                "/bench-gemm --shapes=64x128x128abc", "/bench-gemm --shapes=64x128",
                                "/bench-rl --target=1.5", "/bench-rl --target=0.9x", "/bench-rl --target=", "/bench-rl --target=nan",
                                "/bench-rl --target=1", "/bench-rl --target=0"}) {  // 1: a race no run can win
    const result r = fp8rl::test::run_command(kBin + bad);
    EXPECT_EQ(r.rc, 2) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find("option --"), std::string::npos) << bad << "\n" << r.out;
  }
  {  // bench-rl away from the build tree finds no configs: said at once (each run failed in turn)
    const fs::path away = fs::temp_directory_path() / ("fp8rl_away_" + std::to_string(::getpid())) / "a" / "b";
    fs::create_directories(away);
    fs::copy_file(kBin + "/bench-rl", away / "bench-rl");
    const result r = fp8rl::test::run_command((away / "bench-rl").string() + " --only=staleness");
    EXPECT_EQ(r.rc, 2) << r.out;
    EXPECT_NE(r.out.find("run it from the build tree"), std::string::npos) << r.out;
    // a run that fails (here an fp8rl that exits 1) ends bench-rl with rc 1, its files kept, named
    fs::create_directories(away.parent_path().parent_path() / "configs" / "topologies");
    std::ofstream(away.parent_path().parent_path() / "configs" / "topologies" / "local.conf") << "[cluster]\n";
    std::ofstream(away / "fp8rl") << "#!/bin/sh\necho failing on purpose\nexit 1\n";
    fs::permissions(away / "fp8rl", fs::perms::owner_all);
    const result failed = fp8rl::test::run_command((away / "bench-rl").string() + " --only=staleness --reps=1");
    EXPECT_EQ(failed.rc, 1) << failed.out;
    const std::string kept = "its runs' files are kept in ";
    const size_t at = failed.out.find(kept);
    ASSERT_NE(at, std::string::npos) << failed.out;
    const std::string dir = failed.out.substr(at + kept.size(), failed.out.find('\n', at) - at - kept.size());
    EXPECT_TRUE(fs::is_directory(dir)) << dir;
    EXPECT_NE(failed.out.find("command failed"), std::string::npos) << failed.out;
    fs::remove_all(dir);
    fs::remove_all(away.parent_path().parent_path());
  }
  // options a benchmark does not read are refused, not ignored (bench-rl ran its default threads
  // for --threads=1 and capped --reps=9 at 5 without a word)
  for (const std::string bad : {"/bench-rl --threads=1", "/bench-rl --reps=9"}) {
    const result r = fp8rl::test::run_command(kBin + bad);
    EXPECT_EQ(r.rc, 2) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find(bad.substr(10, 6)), std::string::npos) << bad << "\n" << r.out;
  }
}

// `fp8rl --dump-config` is `fp8rl train --dump-config` with every option (it printed the defaults,
// dropping the rest without a word)
TEST_F(Cli, TopLevelDumpConfigTakesEveryOption) {
  const result top = run("--dump-config --rollout.group_size=3");
  const result sub = run("train --dump-config --rollout.group_size=3");
  EXPECT_EQ(top.rc, 0) << top.out;
  EXPECT_EQ(top.out, sub.out);
  EXPECT_NE(top.out, run("--dump-config").out);
}

TEST_F(Cli, BadFilesAreRefusedByName) {
  const std::string score = "score" + m() + " --input ";
  refused(score + dir.string(), "is a directory");  // was rc 0 and no output
  refused(score + write("empty.jsonl", "\n \n").string(), "no input lines");
  refused(score + write("both.jsonl", "{\"tokens\": [1], \"text\": \"1\"}\n").string(), "both.jsonl:1: holds both");
  refused(score + write("big.jsonl", "{\"tokens\": [1, 18446744073709551615]}\n").string(), "big.jsonl:1");
  refused("sft --steps 1 --out " + prompts.string(), "--out");  // would replace a file with a directory
  std::string long_line = "{\"tokens\": [1";
  for (int i = 0; i < 70; ++i) long_line += ", 2";
  const fs::path too_long = write("long.jsonl", "{\"tokens\": [1]}\n" + long_line + "]}\n");
  refused(score + too_long.string(), "long.jsonl:2: 71 tokens");
  refused("generate --prompts " + too_long.string() + m(), "long.jsonl:2:");
  refused(score + prompts.string() + " --policy fp8 --bf16-layers 5,0", "bf16_first");  // the model has 2 layers
  // a model directory whose weights file is a directory
  const fs::path broken = dir / "broken";
  fs::create_directories(broken / "model.safetensors");
  fs::copy_file(model / "config.json", broken / "config.json");
  refused("score --model " + broken.string() + " --input " + prompts.string(), "not a file");
}

namespace {
// The JSON lines of a command's output (its log lines start otherwise).
std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> v;
  std::stringstream ss(out);
  for (std::string l; std::getline(ss, l);)
    if (!l.empty() && l[0] == '{') v.push_back(nlohmann::json::parse(l));
  return v;
}
}  // namespace

// Every bench-decode --json line carries the fields issue 4 names (phase, weights, kv, batch,
// threads, tokens_per_s; null where a line measures no model step): the side-by-side, per-op,
// summary, bandwidth and attention lines lacked some.
TEST(Bench, DecodeJsonLinesCarryTheNamedFields) {
  std::set<std::string> phases;
  for (const char* only : {"side_by_side", "attention_codes"}) {
    const result r = fp8rl::test::run_command(kBin + "/bench-decode --json --quick --reps=1 --threads=1 --prefill=0 --layers=1 --only=" + only);
    ASSERT_EQ(r.rc, 0) << r.out;
    for (const auto& j : json_lines(r.out)) {
      phases.insert(j.value("phase", ""));
      for (const char* k : {"phase", "weights", "kv", "batch", "threads", "tokens_per_s"}) EXPECT_TRUE(j.contains(k)) << k << ": " << j.dump();
    }
  }
  EXPECT_EQ(phases, (std::set<std::string>{"decode_side_by_side", "ops", "ops_summary", "stream_read", "attention_codes"}));
}

// A tokenizer whose ids reach past the model's vocabulary is refused by every subcommand that
// reads one (train refused it; generate, score and eval encoded into ids no embedding row has).
TEST_F(Cli, ATokenizerLargerThanTheVocabularyIsRefused) {
  std::ofstream(model / "fp8rl-char-tokenizer.json") << R"({"type": "fp8rl-char", "alphabet": "0123456789+*=abcdefghijklmnopqrstuvwxy"})";
  const std::string what = model.string() + ": the tokenizer has 41 tokens, the model's vocab_size (config.json) is 40";
  refused("generate --max-tokens 2 --prompts " + prompts.string() + m(), what);
  refused("score --input " + prompts.string() + m(), what);
  refused("eval --n 4" + m(), what);
  refused("sft --steps 1 --out " + (dir / "sft-out").string() + m(), what);
  std::ofstream(model / "fp8rl-char-tokenizer.json") << R"({"type": "fp8rl-char", "alphabet": "0123456789+*=abcdefghijklmnopqrstuvwx"})";
  EXPECT_EQ(run("generate --max-tokens 2 --prompts " + prompts.string() + m()).rc, 0);  // 40 tokens: every id has a row
}

// Inputs too long for the model are named by file and line (they said "token batch: sequence 0"
// and "request 0").
TEST_F(Cli, TooLongInputsAreNamedByLine) {
  std::string longer = "{\"tokens\": [";
  for (int i = 0; i < 70; ++i) longer += (i ? ", " : "") + std::to_string(i % 30 + 3);
  const fs::path cal = write("cal.jsonl", "{\"tokens\": [1, 2]}\n" + longer + "]}\n");
  refused("generate --kv fp8 --max-tokens 2 --calibration " + cal.string() + " --prompts " + prompts.string() + m(),
          cal.string() + ":2: a calibration prompt of 70 tokens, more than the model's max_position_embeddings 64");
  std::ofstream(model / "fp8rl-char-tokenizer.json") << R"({"type": "fp8rl-char", "alphabet": "0123456789+*="})";
  const fs::path task = write("long.jsonl", "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"" + std::string(70, '7') +
                                                "+1=\", \"answer\": \"2\"}\n");
  refused("eval --task " + task.string() + m(), task.string() + ":2: request 1: prompt of ");
}

// A generate prompt line may carry its own max_tokens and stop; any other key is refused by
// name (a misspelt setting was silently ignored), as are such settings where they mean nothing
// (score) and stop ids outside the vocabulary.
TEST_F(Cli, GeneratePromptLinesCarryTheirOwnSettings) {
  const fs::path own = write("own.jsonl", "{\"tokens\": [1, 2], \"max_tokens\": 2}\n{\"tokens\": [3], \"max_tokens\": 5}\n"
                                          "{\"tokens\": [4]}\n");
  const std::string greedy = "generate --temperature 0 --max-tokens 4 --log-level warn --prompts ";
  const result r = run(greedy + own.string() + m());  // the model has no EOS: no stop
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto out = json_lines(r.out);
  ASSERT_EQ(out.size(), 3u) << r.out;
  EXPECT_EQ(out[0]["tokens"].size(), 2u);
  EXPECT_EQ(out[1]["tokens"].size(), 5u);
  EXPECT_EQ(out[2]["tokens"].size(), 4u);  // --max-tokens
  for (const auto& o : out) EXPECT_EQ(o["finish"], "length");
  // the same prompt, told to stop at the token it generates first (greedy), stops there
  const int first = out[1]["tokens"][0].get<int>();
  const fs::path stop = write("stop.jsonl", "{\"tokens\": [3], \"max_tokens\": 5, \"stop\": [" + std::to_string(first) + "]}\n");
  const auto stopped = json_lines(run(greedy + stop.string() + m()).out);
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(stopped[0]["tokens"], nlohmann::json::array({first}));
  EXPECT_EQ(stopped[0]["finish"], "stop");
  const std::string gen = "generate" + m() + " --prompts ";
  refused(gen + write("typo.jsonl", "{\"tokens\": [1], \"max_token\": 2}\n").string(), "typo.jsonl:1: unknown key 'max_token'");
  refused("score" + m() + " --input " + write("req.jsonl", "{\"tokens\": [1], \"stop\": [2]}\n").string(),
          "req.jsonl:1: unknown key 'stop'");
  refused(gen + write("far.jsonl", "{\"tokens\": [1]}\n{\"tokens\": [1], \"stop\": [2, 40]}\n").string(),
          "far.jsonl:2: stop token 40 is outside the vocabulary");
  refused(gen + write("zero.jsonl", "{\"tokens\": [1], \"max_tokens\": 0}\n").string(), "zero.jsonl:1: 'max_tokens' must be");
  // a misspelt 'tokens' or 'text' is named; every bad line is listed, not only the first
  refused(gen + write("txt.jsonl", "{\"txt\": \"1+1=\"}\n").string(),
          "txt.jsonl:1: expected an object with a list 'tokens' (or a string 'text'); unknown key 'txt'");
  const fs::path two = write("two.jsonl", "{\"tokens\": [1], \"max_token\": 2}\n{\"tokens\": [1]}\n{\"tokenz\": [1]}\n");
  refused(gen + two.string(), two.string() + ": 2 malformed line(s):\n  " + two.string() + ":1: unknown key 'max_token'");
  refused(gen + two.string(), "\n  " + two.string() + ":3: expected an object with a list 'tokens' (or a string 'text'); unknown key 'tokenz'");
}

// Without --stop, generate stops at every id of the config's eos_token_id list (it took none from
// fp8rl's own checkpoints, whose config had no eos_token_id), and tags tokens with the weight
// version the checkpoint's state.json records (they said 0 for a learner's step_200).
TEST_F(Cli, GenerateStopsAtTheConfigsEosAndTagsTheCheckpointsVersion) {
  const std::string greedy = "generate --temperature 0 --max-tokens 5 --log-level warn --prompts ";
  const fs::path one = write("one.jsonl", "{\"tokens\": [3]}\n");
  const auto free_run = json_lines(run(greedy + one.string() + m()).out);
  ASSERT_EQ(free_run.size(), 1u);
  const int first = free_run[0]["tokens"][0].get<int>();
  auto cfg = fp8rl::models::model_load(model.string());
  cfg.cfg.eos_token_ids = {39, first};
  const fs::path ck = dir / "step_200";
  fp8rl::models::model_save(ck.string(), cfg);
  std::ofstream(ck / "state.json") << "{\"weight_version\": 200, \"adam_step\": 200}\n";
  const auto out = json_lines(run(greedy + one.string() + " --model " + ck.string()).out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0]["tokens"], nlohmann::json::array({first}));
  EXPECT_EQ(out[0]["finish"], "stop");
  EXPECT_EQ(out[0]["weight_version"], nlohmann::json::array({200}));
  EXPECT_EQ(out[0]["scale_version"], nlohmann::json::array({200}));
  refused(greedy + one.string() + " --model " + (dir / "p.jsonl").string(), "p.jsonl: not a directory");
}

// With an FP8 KV cache the Q/K/V scales are calibrated on the prompts before generating: every
// prompt is checked first (an unfit line is named, as without FP8), and the calibration runs in
// bounded passes (it was one forward over every prompt: activations and logits of the whole file).
TEST_F(Cli, Fp8KvGenerateChecksEveryPromptFirstAndCalibratesInPasses) {
  std::string long_line = "{\"tokens\": [1";
  for (int i = 0; i < 70; ++i) long_line += ", 2";
  refused("generate --kv fp8 --prompts " + write("long.jsonl", "{\"tokens\": [1]}\n" + long_line + "]}\n").string() + m(),
          "long.jsonl:2:");
  std::string many;  // 40 prompts of 60 tokens: more than one calibration pass of 2048 tokens
  for (int p = 0; p < 40; ++p) {
    many += "{\"tokens\": [" + std::to_string(1 + p % 30);
    for (int i = 1; i < 60; ++i) many += ", " + std::to_string((p * 7 + i) % 40);
    many += "]}\n";
  }
  const fs::path out = dir / "out.jsonl", log = dir / "calibration.log";  // apart: the log interleaved with the lines
  const int rc = std::system((kBin + "/fp8rl generate --kv fp8 --max-tokens 2 --log-level info --prompts " +
                              write("many.jsonl", many).string() + m() + " > " + out.string() + " 2> " + log.string()).c_str());
  auto text_of = [](const fs::path& f) {
    std::ifstream in(f);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  const std::string text = text_of(log);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_EQ(json_lines(text_of(out)).size(), 40u);
  // 34 prompts fill the first pass (2040 tokens), 6 the second
  EXPECT_NE(text.find("FP8 K/V scales from the prompts: 40 prompt(s) in 2 pass(es) of at most 2048 tokens"), std::string::npos)
      << text;
  EXPECT_NE(text.find("each prompt's tokens depend on the others in"), std::string::npos) << text;
  // scales from --calibration: a prompt's tokens no longer depend on the other prompts in the file
  // (calibrated on the whole file, the first five prompts' tokens changed when five more followed)
  const fs::path calib = write("calib.jsonl", "{\"tokens\": [1, 5, 6, 7, 8, 9, 10]}\n{\"tokens\": [1, 20, 21, 22]}\n");
  std::string first5, all10;
  for (int p = 0; p < 10; ++p) (p < 5 ? first5 : all10) += "{\"tokens\": [1, " + std::to_string(3 + p) + ", 9, 12]}\n";
  all10.insert(0, first5);
  auto generated = [&](const std::string& name, const std::string& body) {
    const fs::path o = dir / (name + ".out");
    const int r = std::system((kBin + "/fp8rl generate --kv fp8 --max-tokens 6 --seed 5 --calibration " + calib.string() + " --prompts " +
                               write(name + ".jsonl", body).string() + m() + " > " + o.string() + " 2>/dev/null").c_str());
    EXPECT_EQ(r, 0) << name;
    return json_lines(text_of(o));
  };
  const auto five = generated("five", first5), ten = generated("ten", all10);
  ASSERT_EQ(five.size(), 5u);
  ASSERT_EQ(ten.size(), 10u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(five[i], ten[i]) << i;
  refused("generate --calibration " + calib.string() + " --prompts " + write("one.jsonl", "{\"tokens\": [1]}\n").string() + m(),
          "option --calibration: only with an FP8 KV cache");
  // the FP8 cache alone, with BF16 attention over its widened codes (--kv fp8 brought FP8 queries
  // too: the cache's own mismatch was out of reach); FP8 attention needs the FP8 cache
  const std::string one = " --prompts " + (dir / "one.jsonl").string() + m();
  const result alone = run("generate --kv fp8 --attention bf16 --max-tokens 3 --log-level info --calibration " + calib.string() + one);
  ASSERT_EQ(alone.rc, 0) << alone.out;
  EXPECT_NE(alone.out.find("FP8 KV cache"), std::string::npos) << alone.out;
  EXPECT_EQ(alone.out.find("FP8 attention: query"), std::string::npos) << alone.out;
  refused("generate --attention fp8" + one, "option --attention fp8: needs an FP8 KV cache");
  refused("generate --kv fp8 --attention fp16" + one, "option --attention: expected bf16 or fp8, got 'fp16'");
}

// The default --max-tokens takes what the context leaves without a word (it warned for every
// prompt of fp8rl's own models, whose context is 64); an explicit one cut short is said.
TEST_F(Cli, GenerateWarnsOnlyWhenAnAskedLengthDoesNotFit) {
  const std::string gen = "generate --temperature 0 --max-context 8 --log-level warn --prompts " +
                          write("short.jsonl", "{\"tokens\": [1, 2, 3]}\n").string() + m();
  const result quiet = run(gen);
  ASSERT_EQ(quiet.rc, 0) << quiet.out;
  EXPECT_EQ(quiet.out.find("leaves room"), std::string::npos) << quiet.out;
  const result said = run(gen + " --max-tokens 10");
  ASSERT_EQ(said.rc, 0) << said.out;
  EXPECT_NE(said.out.find("short.jsonl:1: a prompt of 3 tokens leaves room for 5 of its 10 tokens (max context 8)"),
            std::string::npos) << said.out;
}

// fp8-kv (FP8 attention and KV cache) is a generation policy: eval calibrates its Q/K/V scales on
// the validation prompts (it failed every time: no scales); sft and score, training forwards,
// refuse it by name (they ran it as plain fp8 without a word).
TEST_F(Cli, Fp8KvIsAGenerationPolicyOnly) {
  const fs::path ck = dir / "ck";
  ASSERT_EQ(run("sft --steps 1 --batch 2 --out " + ck.string()).rc, 0);
  const std::string eval = "eval --n 8 --max-tokens 4 --policy fp8-kv --log-level info --model " + ck.string();
  const result e = run(eval);
  ASSERT_EQ(e.rc, 0) << e.out;
  EXPECT_NE(e.out.find("FP8 K/V scales from the validation prompts"), std::string::npos) << e.out;  // sft wrote no batch
  std::ofstream(ck / "calibration.jsonl") << "{\"tokens\": [1, 5, 6, 7, 8]}\n";  // as fp8rl train's checkpoints hold
  const result c = run(eval);
  ASSERT_EQ(c.rc, 0) << c.out;
  EXPECT_NE(c.out.find("FP8 K/V scales from the checkpoint's calibration batch"), std::string::npos) << c.out;
  // --n on a file task evaluates its first N lines (all of them were evaluated)
  const fs::path task = write("task.jsonl", "{\"prompt\": \"1+1=\", \"answer\": 2}\n{\"prompt\": \"2+2=\", \"answer\": 4}\n"
                                            "{\"prompt\": \"3+3=\", \"answer\": 6}\n");
  const result n2 = run("eval --n 2 --max-tokens 2 --task " + task.string() + " --model " + ck.string());
  ASSERT_EQ(n2.rc, 0) << n2.out;
  EXPECT_NE(n2.out.find("\"n\": 2}"), std::string::npos) << n2.out;
  // without --n a file task is evaluated whole, also past the built-in tasks' default of 400
  std::string many;
  for (int i = 0; i < 401; ++i) many += "{\"prompt\": \"1+1=\", \"answer\": 2}\n";
  const result all = run("eval --max-tokens 1 --task " + write("many.jsonl", many).string() + " --model " + ck.string());
  ASSERT_EQ(all.rc, 0) << all.out;
  EXPECT_NE(all.out.find("\"n\": 401}"), std::string::npos) << all.out;
  refused("sft --steps 1 --batch 2 --policy fp8-kv --out " + (dir / "ck3").string(), "--policy fp8-kv: FP8 attention");
  EXPECT_FALSE(fs::exists(dir / "ck3"));
  refused("score --policy fp8-kv --input " + prompts.string() + m(), "--policy fp8-kv: FP8 attention");
}

// sft writes --out by replacing the directory: it refuses where that would delete what is not an
// earlier checkpoint of ours (any existing directory went, contents and all), and with
// --overwrite it replaces a checkpoint, never the model it reads.
TEST_F(Cli, SftNeverDeletesWhatIsNotItsCheckpoint) {
  const fs::path mine = dir / "mine";
  fs::create_directories(mine / "sub");
  std::ofstream(mine / "notes.txt") << "keep me\n";
  const std::string sft = "sft --steps 1 --batch 2 --out ";
  refused(sft + mine.string(), "exists (--overwrite replaces");
  refused(sft + mine.string() + " --overwrite", "not an fp8rl checkpoint");
  EXPECT_TRUE(fs::exists(mine / "notes.txt"));
  // where its save cannot go (under a file; a read-only filesystem alike; a DIR.tmp not a save's
  // own), refused before training (the save failed after it), nothing made
  refused(sft + (mine / "notes.txt" / "m").string(), "option --out: " + (mine / "notes.txt" / "m").string() + ": " +
                                                          (mine / "notes.txt").string() + " is not a directory (nothing can be saved under it)");
  fs::create_directories(dir / "other.tmp");
  refused(sft + (dir / "other").string(), "option --out: " + (dir / "other.tmp").string() +
                                              ": exists and is not a checkpoint save's own (move it away; nothing was done)");
  EXPECT_FALSE(fs::exists(dir / "other"));
  const fs::path ck = dir / "ck";
  ASSERT_EQ(run(sft + ck.string()).rc, 0);
  ASSERT_TRUE(fs::exists(ck / "state.json"));
  // the built-in model's config names its tokenizer's <eos> (2), which generate stops on by default
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(ck / "config.json")).value("eos_token_id", -1), 2);
  refused(sft + ck.string() + " --overwrite --model " + ck.string(), "holds the --model this run reads");
  refused(sft + ck.string() + " --overwrite --model " + (ck / "sub").string(), "holds the --model this run reads");  // inside it
  EXPECT_EQ(run(sft + ck.string() + " --overwrite").rc, 0);
  // a backslash in the task's path made state.json invalid JSON, after training
  std::string demos;
  for (int i = 0; i < 8; ++i) demos += "{\"prompt\": \"" + std::to_string(i) + "+1=\", \"answer\": \"" + std::to_string(i + 1) + "\"}\n";
  const fs::path task = write("ta\\sk.jsonl", demos);
  const result r = run(sft + (dir / "ck2").string() + " --model " + ck.string() + " --task '" + task.string() + "'");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(fs::exists(dir / "ck2" / "state.json")) << r.out;
  // the character tokenizer keeps its own name however it is given (given by its file, it was
  // written as tokenizer.json, which Hugging Face tools read as theirs)
  for (const fs::path& t : {ck, ck / "fp8rl-char-tokenizer.json"}) {
    const fs::path out = dir / ("ck3" + std::to_string(t == ck));
    const result c = run(sft + out.string() + " --tokenizer " + t.string() + " --task '" + task.string() + "'");
    ASSERT_EQ(c.rc, 0) << c.out;
    EXPECT_TRUE(fs::exists(out / "fp8rl-char-tokenizer.json")) << t;
    EXPECT_FALSE(fs::exists(out / "tokenizer.json")) << t;
  }
  // a fresh model's context is an option (it was 64, fixed: a real dataset's prompts did not fit,
  // nor a train run's model.max_context); it shapes only a fresh model; --log-level off is quiet
  const result wide = run(sft + (dir / "wide").string() + " --max-context 96 --log-level off");
  ASSERT_EQ(wide.rc, 0) << wide.out;
  EXPECT_EQ(wide.out, "");  // the progress lines printed whatever the level
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir / "wide" / "config.json")).value("max_position_embeddings", -1), 96);
  refused(sft + (dir / "narrow").string() + " --max-context 4", "--max-context");
  refused(sft + (dir / "both").string() + " --max-context 96 --model " + ck.string(), "options --max-context and --model");
}

// Every program answers --help with its options and exit code 0 (the subcommands' help used to be
// "unknown option --help"); the subcommands' parsers refuse to run when their help text lacks an
// option they accept (args_parse checks it), so a run of each also checks the text is complete.
TEST_F(Cli, EveryProgramHasHelp) {
  const std::pair<std::string, std::vector<std::string>> progs[] = {
      {"/fp8rl score --help", {"--model", "--input", "--max-batch-tokens", "--log-level"}},
      {"/fp8rl generate --help", {"--prompts", "--kv", "--top-p", "--stop", "--bf16-layers", "--scale-mode"}},
      {"/fp8rl sft --help", {"--out", "--tokenizer", "--size", "--bf16-layers"}},
      {"/fp8rl eval --help", {"--verifier", "--n", "--max-tokens"}},
      {"/fp8rl train --help", {"--overwrite", "--logger.", "--config-file"}},
      {"/fp8rl --help", {"fp8rl <command> --help"}},
      {"/caf-run --help", {"--hostfile", "--grace", "--fail-fast", "--wdir"}},
      {"/fp8rl-trace --help", {"merge", "shiviz", "summary"}},
      {"/fp8rl-trace merge --help", {"merge", "shiviz", "summary"}},  // it was "--help: no such run directory"
      {"/bench-gemm --help", {"--shapes"}},
      {"/bench-decode --help", {"--layers", "--prefill"}}};
  for (const auto& [cmd, opts] : progs) {
    const result r = fp8rl::test::run_command(kBin + cmd);
    EXPECT_EQ(r.rc, 0) << cmd << "\n" << r.out;
    for (const auto& o : opts) EXPECT_NE(r.out.find(o), std::string::npos) << cmd << " lacks " << o << "\n" << r.out;
  }
  refused("score --bogus 1" + m(), "unknown option --bogus (--help lists the options)");
  // fp8rl-trace says what is wrong before its usage (a mistyped subcommand only reprinted it)
  for (const auto& [args, what] : std::vector<std::pair<std::string, std::string>>{
           {"", "a subcommand and a run directory are needed"}, {" sumary runs/x", "unknown subcommand 'sumary'"},
           {" merge", "the run directory is missing"}, {" merge a b", "one run directory, no more arguments"}}) {
    const result t = fp8rl::test::run_command(kBin + "/fp8rl-trace" + args);
    EXPECT_EQ(t.rc, 2) << args << "\n" << t.out;
    EXPECT_EQ(t.out.rfind("fp8rl-trace: " + what + "\nusage: fp8rl-trace", 0), 0u) << args << "\n" << t.out;
  }
  // caf-run: a command given without the -- before it is told where it goes
  const result c = fp8rl::test::run_command(kBin + "/caf-run --hostfile h --topology t.conf " + kBin + "/fp8rl train");
  EXPECT_EQ(c.rc, 2) << c.out;
  EXPECT_NE(c.out.find("the command to run goes after -- (caf-run ... -- " + kBin + "/fp8rl ...)"), std::string::npos) << c.out;
  const result stray = fp8rl::test::run_command(kBin + "/caf-run --hostfile h --topology t.conf --grace 5 10 -- true");
  EXPECT_EQ(stray.rc, 2) << stray.out;  // a stray word before the --: no hint about it
  EXPECT_NE(stray.out.find("unknown option '10' (caf-run --help lists the options)"), std::string::npos) << stray.out;
  const result g = fp8rl::test::run_command(kBin + "/caf-run --hostfile h --topology t.conf --grace 3601 -- true");
  EXPECT_EQ(g.rc, 2) << g.out;
  EXPECT_NE(g.out.find("--grace '3601': seconds in [0, 3600]"), std::string::npos) << g.out;
  const result b = fp8rl::test::run_command(kBin + "/bench-decode --layerz=2");
  EXPECT_EQ(b.rc, 2) << b.out;  // a mistyped benchmark option was stored and ignored
}

// score's logprob of token t depends on tokens up to t only (a causal model; rows never mix in
// the GEMMs): a sequence and its extension agree bit for bit on the shared part, and every value
// is a log-probability (a shift by one token went unseen: only the count was checked).
TEST_F(Cli, ScoreValuesArePrefixConsistent) {
  const result r = run("score --input " + write("pre.jsonl", "{\"tokens\": [1, 2, 3]}\n{\"tokens\": [1, 2, 3, 4]}\n").string() + m());
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto out = json_lines(r.out);
  ASSERT_EQ(out.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(out[0]["logprobs"][i].get<double>(), out[1]["logprobs"][i].get<double>()) << i;
  for (const auto& o : out) for (const auto& v : o["logprobs"]) EXPECT_LT(v.get<double>(), 0.0);
}

// Option edges: a real option's upper bound, a switch given a value, a last option without its
// value, an empty token list.
TEST_F(Cli, OptionEdgesAreRefusedNamed) {
  refused("sft --out " + (dir / "o").string() + " --lr 11", "outside [1e-12, 10]");
  refused("sft --out " + (dir / "o").string() + " --overwrite=1", "option --overwrite takes no value");
  refused("score" + m() + " --input", "option --input needs a value");
  refused("score" + m() + " --input " + write("e.jsonl", "{\"tokens\": []}\n").string(), "e.jsonl:1: 'tokens' is empty");
}

// generate --kv fp8 also runs FP8 attention (its query saturation is logged).
TEST_F(Cli, GenerateKvFp8BringsFp8Attention) {
  const fs::path calib = write("c.jsonl", "{\"tokens\": [1, 5, 6, 7]}\n");
  const result r = run("generate --kv fp8 --max-tokens 2 --log-level info --calibration " + calib.string() + " --prompts " + prompts.string() + m());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("FP8 attention: query"), std::string::npos) << r.out;
}

// A prompt plus --max-tokens that exactly fill --max-context is not warned about.
TEST_F(Cli, GenerateDoesNotWarnWhenTheAskedLengthExactlyFits) {
  const result r = run("generate --temperature 0 --max-context 8 --max-tokens 5 --log-level warn --prompts " +
                       write("s5.jsonl", "{\"tokens\": [1, 2, 3]}\n").string() + m());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.find("leaves room"), std::string::npos) << r.out;
}

// A --model / model.init that is not a model directory is named for what it is: missing, a run
// directory (its newest checkpoint given), the checkpoints/latest file (the checkpoint it names);
// train refuses it before choosing a run directory (it said "this run writes ...", then failed).
TEST_F(Cli, AModelPathThatIsNoModelDirectoryIsNamed) {
  const fs::path run = dir / "run", ck = run / "checkpoints";
  fs::create_directories(ck / "step_2");
  std::ofstream(ck / "latest") << "step_2\n";
  refused("eval --model " + (dir / "nodir").string(), (dir / "nodir").string() + ": no such model directory");
  refused("eval --model " + run.string(),
          run.string() + ": a run directory, not a model directory; its newest checkpoint is " + (ck / "step_2").string());
  refused("generate --prompts " + prompts.string() + " --model " + (ck / "latest").string(),
          "this file names the newest checkpoint: give " + (ck / "step_2").string());
  refused("train --model.init=" + run.string() + " --run-dir " + (dir / "t").string(), "model.init: " + run.string() + ": a run directory");
  EXPECT_FALSE(fs::exists(dir / "t"));
}

// train --node names a node of the topology; another name is refused with the topology's nodes.
TEST_F(Cli, AnUnknownNodeIsRefusedWithTheTopologysNodes) {
  refused("train --topology configs/topologies/two-process.conf --node rollout2",
          "configs/topologies/two-process.conf: no node named 'rollout2' (its nodes: main, rollout1)");
  // started without --node (not by caf-run), the controller says at once that the other nodes are
  // the user's to start (it said nothing until the connection timed out after the warm start)
  const result r = fp8rl::test::run_command("timeout -s INT 3 " + kBin + "/fp8rl train --topology configs/topologies/two-process.conf "
                                            "--run-dir " + (dir / "alone").string());
  EXPECT_NE(r.out.find("configs/topologies/two-process.conf: this process runs node 'main'; its other 1 node(s) must be started "
                       "too (caf-run starts them all"), std::string::npos) << r.out;
}

// generate prints each response's text, decoded without special tokens, where the model directory
// has a tokenizer (the output held token ids only, even for {"text": ...} prompts); without one,
// no "text".
TEST_F(Cli, GeneratePrintsTheDecodedTextWithATokenizer) {
  const fs::path ck = dir / "ck";
  ASSERT_EQ(run("sft --steps 1 --batch 2 --out " + ck.string()).rc, 0);
  const std::string gen = "generate --temperature 0 --max-tokens 4 --log-level warn --prompts " +
                          write("t.jsonl", "{\"text\": \"12+3=\"}\n").string();
  const auto out = json_lines(run(gen + " --model " + ck.string()).out);
  ASSERT_EQ(out.size(), 1u);
  const auto tok = fp8rl::models::tokenizer_load(ck.string());
  EXPECT_EQ(out[0].value("text", std::string("(none)")), tok->decode(out[0]["tokens"].get<std::vector<int32_t>>(), true));
  const auto plain = json_lines(run("generate --temperature 0 --max-tokens 2 --prompts " + write("i.jsonl", "{\"tokens\": [3]}\n").string() + m()).out);
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_FALSE(plain[0].contains("text"));
}
