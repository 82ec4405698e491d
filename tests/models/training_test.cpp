// tests/models/training_test.cpp -- the tiny model learns a synthetic reverse task under every
// precision policy; save -> load -> continue reproduces the uninterrupted losses bit for bit;
// losses do not depend on the thread count.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>

#include "models/checkpoint.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/safetensors.hpp"
#include "models/transformer.hpp"
#include "quant/gemm.hpp"
#include "tests/test_util.hpp"

using namespace fp8rl::models;

namespace {
// Reverse task: BOS x1..xn SEP xn..x1; the loss covers the tokens after SEP.
constexpr int32_t kBos = 1, kSep = 2, kFirstSym = 3, kVocab = 16;
// Guessing uniformly over the 13 symbols costs ln 13 = 2.56 nats per token; below 0.5 the model
// reverses most tokens correctly (exp(-0.5) = 0.6 mean probability on the right symbol).
constexpr double kLearnedLoss = 0.5;
// A fresh model's loss is near that uniform guess (2.56); above 2 says the first step saw it untrained.
constexpr double kUntrainedLoss = 2.0;

model_config task_config() {
  model_config c;
  c.hidden_size = 128; c.intermediate_size = 256; c.num_hidden_layers = 2; c.num_attention_heads = 4;
  c.num_key_value_heads = 2; c.head_dim = 32; c.vocab_size = kVocab; c.max_position_embeddings = 64;
  c.initializer_range = 0.05;
  return c;
}

struct task_batch {
  token_batch b;
  std::vector<float> mask;  // per target position
};

task_batch make_batch(rng& g, int nseq) {
  task_batch tb;
  for (int s = 0; s < nseq; ++s) {
    const int n = 3 + static_cast<int>(g.next_u64() % 4);
    std::vector<int32_t> x(n);
    for (auto& v : x) v = kFirstSym + static_cast<int32_t>(g.next_u64() % (kVocab - kFirstSym));
    std::vector<int32_t> seq = {kBos};
    seq.insert(seq.end(), x.begin(), x.end());
    seq.push_back(kSep);
    seq.insert(seq.end(), x.rbegin(), x.rend());
    const size_t start = tb.b.tokens.size();
    tb.b.add(seq);
    // target at position t is token t+1: count targets after SEP
    for (size_t i = 0; i < seq.size(); ++i) tb.mask.push_back(i + 1 < seq.size() && i >= static_cast<size_t>(n + 1) ? 1.0f : 0.0f);
    (void)start;
  }
  return tb;
}

struct trainer {
  std::unique_ptr<backend> be = make_cpu_backend();
  model_runner run{*be};
  checkpoint ck;
  adamw_config opt;
  precision_policy policy;
  trainer(const model_config& c, const char* pol, uint64_t seed) : policy(precision_policy::named(pol)) {
    ck.params = model_params_init(c, seed);
    opt.lr = 3e-3f;
    opt.weight_decay = 0.01f;
  }
  double step(const task_batch& tb) {
    auto w = model_weights_build(*be, ck.params.cfg, policy.training(), {&ck.params, nullptr, nullptr}, true);
    run.forward(*w, tb.b, true);
    auto targets = tb.b.next_targets();
    std::vector<float> logp(targets.size()), dlogp(targets.size());
    run.logprobs(targets, {}, logp.data());
    double n = 0, loss = 0;
    for (float m : tb.mask) n += m;
    for (size_t t = 0; t < targets.size(); ++t) {
      loss -= tb.mask[t] * logp[t] / n;
      dlogp[t] = static_cast<float>(-tb.mask[t] / n);
    }
    std::vector<float> grads(static_cast<size_t>(ck.params.layout.total), 0.0f);
    run.backward(*w, targets, {}, dlogp.data(), grads.data());
    adamw_step(opt, ck.params.layout, ck.params.data.data(), grads.data(), ck.opt);
    return loss;
  }
};

std::vector<double> train(trainer& tr, uint64_t data_seed, int steps, int skip = 0) {
  rng g(data_seed);
  std::vector<double> losses;
  for (int s = 0; s < skip + steps; ++s) {
    task_batch tb = make_batch(g, 16);
    if (s >= skip) losses.push_back(tr.step(tb));
  }
  return losses;
}
}  // namespace

class LearnReverse : public ::testing::TestWithParam<const char*> {};

TEST_P(LearnReverse, LossFallsBelowBound) {
  if (std::string(GetParam()).find("tiles") != std::string::npos && !fp8rl::quant::gemm_tiles_available())
    GTEST_SKIP() << "no AMX-BF16 here";
  trainer tr(task_config(), GetParam(), 11);
  auto losses = train(tr, 5, 600);
  double tail = 0;
  for (size_t i = losses.size() - 10; i < losses.size(); ++i) tail += losses[i] / 10;
  std::printf("%s: loss %.3f -> %.3f\n", GetParam(), losses.front(), tail);
  EXPECT_GT(losses.front(), kUntrainedLoss);
  EXPECT_LT(tail, kLearnedLoss) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Policies, LearnReverse, ::testing::Values("fp32", "bf16", "fp8", "fp8-tiles"));

TEST(Training, SaveLoadContinueIsBitIdentical) {
  const auto dir = std::filesystem::temp_directory_path() / ("fp8rl_ckpt_" + std::to_string(::getpid()));
  for (const char* pol : {"fp32", "fp8"}) {
    trainer a(task_config(), pol, 12);
    auto full = train(a, 6, 10);
    trainer b(task_config(), pol, 12);
    train(b, 6, 5);
    checkpoint_save(dir.string(), b.ck);
    trainer c(task_config(), pol, 99);  // different init, replaced by the checkpoint
    c.ck = checkpoint_load(dir.string());
    auto rest = train(c, 6, 5, /*skip=*/5);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(std::memcmp(&full[5 + i], &rest[i], 8), 0) << pol << " step " << 5 + i;
  }
  // optimizer moments are checked as the weights are: a NaN or a negative second moment would
  // reach the weights at the next update
  for (const char* moment : {"m.", "v."}) {
    trainer b(task_config(), "fp32", 12);
    train(b, 6, 1);
    const std::string name = b.ck.params.layout.infos[1].name;
    auto& vals = moment[0] == 'm' ? b.ck.opt.m : b.ck.opt.v;
    vals[static_cast<size_t>(b.ck.params.layout.infos[1].offset) + 2] = moment[0] == 'm' ? std::nanf("") : -1.0f;
    checkpoint_save(dir.string(), b.ck);
    std::string err;
    try {
      checkpoint_load(dir.string());
    } catch (const std::invalid_argument& e) {
      err = e.what();
    }
    EXPECT_NE(err.find("optimizer.safetensors: tensor '" + std::string(moment) + name + "' holds "), std::string::npos) << err;
    EXPECT_NE(err.find("at index 2"), std::string::npos) << err;
  }
  // a checkpoint missing one of its parts is refused by name: a step count without moments (they
  // would load as zeros: the first updates ~3x too large), moments without state.json (loaded as
  // a fresh model they were dropped), a weight version below 0 (read as 2^64 - 1)
  auto load_error = [&](checkpoint_kind what) {
    try {
      checkpoint_load(dir.string(), what);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  trainer t(task_config(), "fp32", 12);
  train(t, 6, 2);
  checkpoint_save(dir.string(), t.ck);
  EXPECT_EQ(load_error(checkpoint_kind::training), "");
  try {  // a save flushes what it wrote to the device; what cannot be flushed is named
    fsync_path((dir / "no-such-file").string());
    ADD_FAILURE() << "a missing file was flushed";
  } catch (const std::system_error& e) {
    EXPECT_NE(std::string(e.what()).find("fsync: opening " + (dir / "no-such-file").string()), std::string::npos) << e.what();
  }
  std::filesystem::rename(dir / "optimizer.safetensors", dir / "optimizer.away");
  EXPECT_NE(load_error(checkpoint_kind::training).find("optimizer.safetensors: missing, but state.json says adam_step = 2"),
            std::string::npos) << load_error(checkpoint_kind::training);
  std::filesystem::rename(dir / "optimizer.away", dir / "optimizer.safetensors");
  std::filesystem::rename(dir / "state.json", dir / "state.away");
  EXPECT_NE(load_error(checkpoint_kind::model_ok).find("state.json: missing (not a training checkpoint, yet optimizer.safetensors is there)"),
            std::string::npos) << load_error(checkpoint_kind::model_ok);
  std::filesystem::remove(dir / "optimizer.safetensors");
  EXPECT_EQ(load_error(checkpoint_kind::model_ok), "");  // a model directory: a fresh start
  // ... but not where a training checkpoint is asked for (a --resume would restart its optimizer)
  EXPECT_NE(load_error(checkpoint_kind::training).find("state.json: missing (not a training checkpoint)"), std::string::npos)
      << load_error(checkpoint_kind::training);
  std::ofstream(dir / "state.json") << "[]";
  try {  // a state.json that is not an object read as weight version 0
    checkpoint_weight_version(dir.string());
    ADD_FAILURE() << "state.json [] was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("state.json: not a JSON object"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "state.json") << R"({"adam_step": 0, "weight_version": -1})";
  try {
    checkpoint_weight_version(dir.string());
    ADD_FAILURE() << "weight_version -1 was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("state.json: key 'weight_version' is not an integer >= 0"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// Replacing a checkpoint never leaves its directory without a whole one: the new one (with the
// caller's extra files) takes the old one's place in one exchange, nothing left beside it; a save
// cut between the fallback's two renames is named with where the previous checkpoint is (it was
// deleted first, and nothing recovered DIR.tmp). A step count past 2^62 in state.json is refused
// (2^64 - 1 read as -1 turned every weight into NaN at the next update).
TEST(Training, CheckpointReplacementKeepsAWholeCheckpoint) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_replace_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  trainer a(task_config(), "fp32", 12);
  checkpoint_save(dir.string(), a.ck, [](const std::string& tmp) { std::ofstream(fs::path(tmp) / "extra.txt") << "first\n"; });
  trainer b(task_config(), "fp32", 13);
  train(b, 6, 2);
  checkpoint_save(dir.string(), b.ck, [](const std::string& tmp) { std::ofstream(fs::path(tmp) / "extra.txt") << "second\n"; });
  const checkpoint c = checkpoint_load(dir.string());
  EXPECT_EQ(c.opt.step, b.ck.opt.step);
  EXPECT_EQ(c.params.data, b.ck.params.data);
  std::ifstream extra(dir / "extra.txt");
  std::string word;
  extra >> word;
  EXPECT_EQ(word, "second");
  EXPECT_FALSE(fs::exists(dir.string() + ".tmp"));
  EXPECT_FALSE(fs::exists(dir.string() + ".old"));
  // "DIR/" names DIR: a new one and a replacement (DIR/.tmp inside DIR failed to rename into itself
  // after a whole `sft --out DIR/` had trained)
  for (int i = 0; i < 2; ++i) checkpoint_save(dir.string() + "-slash/", b.ck);
  EXPECT_EQ(checkpoint_load(dir.string() + "-slash").params.data, b.ck.params.data);
  EXPECT_FALSE(fs::exists(dir.string() + "-slash/.tmp"));
  EXPECT_FALSE(fs::exists(dir.string() + "-slash.tmp"));
  fs::remove_all(dir.string() + "-slash");
  auto error_of = [&](const fs::path& d) {
    try {
      checkpoint_load(d.string());
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  {  // moments of tensors this model does not have: refused by name (ignored, the file passed as this model's)
    const fs::path op = dir / "optimizer.safetensors";
    auto t = safetensors_read(op.string());
    t["m.model.layers.99.extra"] = {{1}, {0.0f}};
    safetensors_write(op.string(), t);
    const std::string err = error_of(dir);
    EXPECT_NE(err.find("tensor 'm.model.layers.99.extra' is no moment of this model's parameters"), std::string::npos) << err;
    t.erase("m.model.layers.99.extra");
    // a moment of the right element count in another shape (transposed): refused, both shapes named
    const auto& info = *std::find_if(a.ck.params.layout.infos.begin(), a.ck.params.layout.infos.end(),
                                     [](const auto& i) { return i.shape.size() == 2 && i.shape[0] != i.shape[1]; });
    const auto want = info.shape;
    t["v." + info.name].shape = {want[1], want[0]};
    safetensors_write(op.string(), t);
    const std::string shape_err = error_of(dir);
    EXPECT_NE(shape_err.find("tensor 'v." + info.name + "' has shape [" + std::to_string(want[1]) + ", " + std::to_string(want[0]) +
                             "], the model's is [" + std::to_string(want[0]) + ", " + std::to_string(want[1]) + "]"),
              std::string::npos) << shape_err;
    t["v." + info.name].shape = want;
    safetensors_write(op.string(), t);
  }
  {  // state.json's step count
    nlohmann::json st = nlohmann::json::parse(std::ifstream(dir / "state.json"));
    st["adam_step"] = std::numeric_limits<uint64_t>::max();
    std::ofstream(dir / "state.json") << st.dump();
    const std::string err = error_of(dir);
    EXPECT_NE(err.find("state.json: key 'adam_step' = 18446744073709551615 is not a step count"), std::string::npos) << err;
  }
  fs::rename(dir, dir.string() + ".old");  // what a save cut between the fallback's renames leaves
  const std::string err = error_of(dir);
  EXPECT_NE(err.find("left the previous checkpoint at " + dir.string() + ".old"), std::string::npos) << err;
  fs::remove_all(dir.string() + ".old");
  // DIR.tmp: a save cut short leaves it marked, and the next save replaces it; one the user keeps
  // there (unmarked) is refused by name and kept (a save deleted it with whatever it held)
  const fs::path tmp = dir.string() + ".tmp";
  fs::create_directories(tmp);
  std::ofstream(tmp / "notes.txt") << "precious\n";
  const std::string refused = fp8rl::test::thrown_text<std::invalid_argument>([&] { checkpoint_save(dir.string(), a.ck); });
  EXPECT_NE(refused.find(tmp.string() + ": exists and is not a checkpoint save's own"), std::string::npos) << refused;
  EXPECT_TRUE(fs::exists(tmp / "notes.txt"));
  EXPECT_FALSE(fs::exists(dir));
  fs::remove_all(tmp);
  struct cut {};
  EXPECT_THROW(checkpoint_save(dir.string(), a.ck, [](const std::string&) { throw cut{}; }), cut);  // a save cut short
  ASSERT_TRUE(fs::exists(tmp));
  checkpoint_save(dir.string(), a.ck);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(checkpoint_load(dir.string()).params.data, a.ck.params.data);
  // a save cut after its exchange, while deleting the previous checkpoint (now at DIR.tmp, marked
  // before the delete) or after the exchange left it whole: the next save still takes it as its own
  fs::create_directories(tmp);
  std::ofstream(tmp / ".fp8rl-unfinished-checkpoint") << "";
  std::ofstream(tmp / "model.safetensors") << "half deleted";
  checkpoint_save(dir.string(), a.ck);
  fs::copy(dir, tmp, fs::copy_options::recursive);  // a whole previous checkpoint, unmarked
  checkpoint_save(dir.string(), a.ck);
  EXPECT_FALSE(fs::exists(tmp));
  for (const auto& f : fs::directory_iterator(dir)) EXPECT_EQ(f.path().filename().string().find(".fp8rl"), std::string::npos) << f.path();
  fs::remove_all(dir);
}

// A save where nothing can be written is refused before any work (the SFT command checks its
// --out first): the nearest existing directory above DIR is named with why (an immutable
// directory: even root cannot write in it).
TEST(Training, ACheckpointSaveCheckNamesADirectoryItCannotWriteIn) {
  namespace fs = std::filesystem;
  const fs::path d = fs::temp_directory_path() / ("fp8rl_save_check_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  EXPECT_NO_THROW(checkpoint_save_check((d / "a" / "ck").string()));
  if (!fp8rl::test::immutable_set(d, true)) {
    fs::remove_all(d);
    GTEST_SKIP() << "the immutable flag cannot be set on " << d << " (file system or capabilities)";
  }
  std::string err;
  try {
    checkpoint_save_check((d / "a" / "ck").string());
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  fp8rl::test::immutable_set(d, false);
  EXPECT_EQ(err, (d / "a" / "ck").string() + ": cannot write in " + d.string() + " (Operation not permitted)");
  fs::remove_all(d);
}

// A disk that fills while a checkpoint is written fails the save naming the file, and the previous
// checkpoint stays whole. RLIMIT_FSIZE one byte short of model.safetensors makes the failure come
// at the stream's final flush, in its close (a check before the close saw nothing; the cut file
// was renamed into place and the checkpoint exchanged as whole).
TEST(Training, ACheckpointSaveOnAFullDiskFailsNamingTheFileAndKeepsThePrevious) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_full_disk_" + std::to_string(::getpid()));
  trainer a(task_config(), "fp32", 12), b(task_config(), "fp32", 13);
  train(b, 2, 2);
  fs::remove_all(dir);
  checkpoint_save(dir.string(), a.ck);
  const auto size = fs::file_size(dir / "model.safetensors");  // b's is as large: the same shapes
  {
    fp8rl::test::rlimit_scope full(RLIMIT_FSIZE, size - 1);
    EXPECT_EQ(fp8rl::test::thrown_text<std::runtime_error>([&] { checkpoint_save(dir.string(), b.ck); }),
              dir.string() + ".tmp/model.safetensors.tmp: write failed: File too large");
  }
  EXPECT_EQ(checkpoint_load(dir.string()).params.data, a.ck.params.data);
  checkpoint_save(dir.string(), b.ck);  // the next save takes over what the failed one left
  EXPECT_EQ(checkpoint_load(dir.string()).params.data, b.ck.params.data);
  EXPECT_FALSE(fs::exists(dir.string() + ".tmp"));
  fs::remove_all(dir);
}

// Filesystems without RENAME_EXCHANGE take the two-rename path: the same result, nothing left over.
TEST(Training, CheckpointReplacementByRenamesKeepsNothingElse) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fp8rl_ck_renames_" + std::to_string(::getpid()));
  const std::string tmp = dir.string() + ".tmp";
  fs::remove_all(dir), fs::remove_all(tmp);
  for (const std::string word : {"first", "second"}) {
    fs::create_directories(tmp);
    std::ofstream(fs::path(tmp) / "state.json") << word << "\n";
    if (word == "first") std::ofstream(fs::path(tmp) / "only_in_first.txt") << "x\n";
    checkpoint_dir_replace(tmp, dir.string(), dir_swap::renames);
  }
  std::string word;
  std::ifstream(dir / "state.json") >> word;
  EXPECT_EQ(word, "second");
  EXPECT_FALSE(fs::exists(dir / "only_in_first.txt"));  // the directory was replaced, not merged
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(dir.string() + ".old"));
  // a DIR.old that is no checkpoint (no config.json) is refused by name and kept, not deleted
  const fs::path old = dir.string() + ".old";
  fs::create_directories(old), fs::create_directories(tmp);
  std::ofstream(old / "notes.txt") << "precious\n";
  const std::string err = fp8rl::test::thrown_text<std::invalid_argument>([&] { checkpoint_dir_replace(tmp, dir.string(), dir_swap::renames); });
  EXPECT_NE(err.find(old.string() + ": exists and is not a checkpoint save's own"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(old / "notes.txt"));
  EXPECT_TRUE(fs::exists(dir / "state.json"));
  fs::remove_all(old), fs::remove_all(tmp);
  fs::remove_all(dir);
}

TEST(Training, LossesDoNotDependOnThreadCount) {
  std::vector<double> one, two;
  tbb::task_arena(1).execute([&] { trainer t(task_config(), "fp8", 13); one = train(t, 7, 4); });
  tbb::task_arena(2).execute([&] { trainer t(task_config(), "fp8", 13); two = train(t, 7, 4); });
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_EQ(std::memcmp(&one[i], &two[i], 8), 0) << i;
}

// Clipping scales the gradient in place by grad_clip / (norm + 1e-6) when the norm is larger (the
// first Adam step normalizes the update, so the scaled gradient is what shows it); grad_clip = 0
// leaves it as it is (and still updates every parameter).
TEST(Training, AdamwClipsGradientsInPlaceAndZeroDisablesIt) {
  trainer tr(task_config(), "fp32", 3);
  const auto& layout = tr.ck.params.layout;
  const float g0 = static_cast<float>(10.0 / std::sqrt(double(layout.total)));  // global norm ~10
  const std::vector<float> grads0(static_cast<size_t>(layout.total), g0);
  auto grads = grads0;
  const double norm = adamw_step(tr.opt, layout, tr.ck.params.data.data(), grads.data(), tr.ck.opt);
  ASSERT_EQ(tr.opt.grad_clip, 1.0f);
  const float clip = static_cast<float>(1.0 / (norm + 1e-6));
  for (size_t i = 0; i < grads.size(); i += 997) ASSERT_EQ(grads[i], g0 * clip) << i;
  adamw_config off = tr.opt;
  off.grad_clip = 0.0f;
  grads = grads0;
  const auto before = tr.ck.params.data;
  adamw_step(off, layout, tr.ck.params.data.data(), grads.data(), tr.ck.opt);
  EXPECT_EQ(grads, grads0);
  for (size_t i = 0; i < before.size(); i += 997) EXPECT_NE(tr.ck.params.data[i], before[i]) << i;
}

// A NaN or Inf gradient is refused naming the tensor, before any parameter, moment or the step
// count changes (an Inf norm had clipped every other gradient to 0 and written NaN into that
// element's moments; a NaN norm skipped clipping and put NaN into every parameter).
TEST(Training, AdamwRefusesANonFiniteGradientBeforeAnyChange) {
  trainer tr(task_config(), "fp32", 3);
  rng g(4);
  tr.step(make_batch(g, 4));  // moments exist
  const auto& layout = tr.ck.params.layout;
  const auto params = tr.ck.params.data;
  const auto m = tr.ck.opt.m, v = tr.ck.opt.v;
  const int64_t step = tr.ck.opt.step;
  const auto& info = layout.infos[3];
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    std::vector<float> grads(static_cast<size_t>(layout.total), 1e-3f);
    grads[static_cast<size_t>(info.offset + 5)] = bad;
    std::string what;
    try {
      adamw_step(tr.opt, layout, tr.ck.params.data.data(), grads.data(), tr.ck.opt);
    } catch (const std::invalid_argument& e) {
      what = e.what();
    }
    EXPECT_NE(what.find(info.name), std::string::npos) << what;
    EXPECT_NE(what.find("element 5"), std::string::npos) << what;
    EXPECT_EQ(tr.ck.params.data, params);
    EXPECT_EQ(tr.ck.opt.m, m);
    EXPECT_EQ(tr.ck.opt.v, v);
    EXPECT_EQ(tr.ck.opt.step, step);
  }
}
