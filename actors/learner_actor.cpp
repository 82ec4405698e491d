// actors/learner_actor.cpp -- a learner actor: FP32 master weights + AdamW on one device.
// Per step: pull this rank's shard of the step's batch from the buffer, GRPO gradient with the
// global token count (rl-algorithm.md §3), all-reduce (sum) across learners with Gloo, AdamW,
// weight_version += 1; rank 0 hands the new master weights and the batch just trained to the
// calibration actor, reports metrics, evaluates and checkpoints on schedule, and (audit mode)
// re-scores trajectories under the exact weights that produced them.
#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>
#include <nlohmann/json.hpp>

#include "actors/actors.hpp"
#include "actors/run_dir.hpp"
#include "actors/trace.hpp"
#include "models/checkpoint.hpp"
#include "models/log.hpp"

namespace fp8rl::actors {
namespace {

namespace fs = std::filesystem;

// A weight version audit mode may re-score under (rank 0): its master weights (a past version's;
// the current one's are s.ck.params) and its re-score weights, each built once and kept while the
// version is held -- this step's builds serve the next max_staleness steps' audits too.
struct audit_version {
  std::vector<float> data;
  std::unique_ptr<models::model_weights> q, q8, learner;
};

struct learner_state {
  std::shared_ptr<const actor_env> env;
  std::shared_ptr<std::vector<float>> snapshot;  // master weights last sent to calibration
  int32_t rank = 0, world = 1;
  msg::peers_msg peers;
  std::unique_ptr<models::backend> be;
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<models::model_runner> run;
  models::checkpoint ck;
  uint64_t version = 0, end_version = 0;
  uint64_t checkpointed = 0;                          // the version of the newest checkpoint (rank 0)
  bool run_dir_was_there = false;                     // at the start (a node of its own may have none yet)
  std::vector<std::vector<int32_t>> calib;            // the batch that produced `version` (rank 0: its checkpoint's)
  models::dataset train, val;
  std::shared_ptr<gloo::Context> gloo;
  std::map<uint64_t, audit_version> audit_held;  // (rank 0) this version's and the last max_staleness versions'
  std::optional<std::pair<uint64_t, uint64_t>> fault_sleep;  // (fault tests) rank 0's step and ms, learner_fault_sleep
  models::model_params ref;                                  // KL reference (grpo.kl_beta > 0) and
  std::unique_ptr<models::model_weights> ref_w;              // its compute weights, built once
};

// Fault tests: FP8RL_FAULT_RANK0_SLEEP_MS=T and FP8RL_FAULT_RANK0_SLEEP_AT_STEP=S make rank 0's
// step S take T ms more before the gradients' all-reduce (a larger shard) while the other ranks
// wait for it there -- at the run's first step in Gloo's rendezvous, unless
// grpo.seq_logprob_error_threshold > 0 met them inside learner_grpo before. One without the other
// is refused; read once, at the learner's start.
std::optional<std::pair<uint64_t, uint64_t>> learner_fault_sleep() {
  const auto ms = fault_env_number("FP8RL_FAULT_RANK0_SLEEP_MS"), at = fault_env_number("FP8RL_FAULT_RANK0_SLEEP_AT_STEP");
  if (ms.has_value() != at.has_value())
    throw std::invalid_argument("FP8RL_FAULT_RANK0_SLEEP_MS and FP8RL_FAULT_RANK0_SLEEP_AT_STEP go together");
  if (!ms) return std::nullopt;
  return std::pair{*at, *ms};
}

using clk = std::chrono::steady_clock;
double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

constexpr size_t kAllreducePiece = size_t{1} << 30;  // elements per Gloo all-reduce call

// A store whose waits take the run's timeout: Gloo's rendezvous waits for the other ranks' keys
// with the store's default, 30 s (the ranks 30 s ahead of another at the first all-reduce failed the run).
class timed_store : public gloo::rendezvous::Store {
 public:
  timed_store(gloo::rendezvous::Store& inner, std::chrono::milliseconds timeout) : inner_(inner), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override { inner_.set(key, data); }
  std::vector<char> get(const std::string& key) override {
    inner_.wait({key}, timeout_);
    return inner_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { inner_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override { inner_.wait(keys, timeout); }

 private:
  gloo::rendezvous::Store& inner_;
  std::chrono::milliseconds timeout_;
};

template <class T>
void allreduce_gloo(learner_state& s, std::vector<T>& g) {
  if (!s.gloo) {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    const fs::path dir = fs::path(s.env->run_dir) / "gloo";
    fs::create_directories(dir);
    gloo::rendezvous::FileStore store(dir.string());
    gloo::rendezvous::PrefixStore prefix(s.env->run_id, store);  // unique per launch
    const std::chrono::milliseconds timeout = std::chrono::seconds(s.env->cfg.collective_timeout_s);
    timed_store timed(prefix, timeout);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(s.rank, s.world);
    ctx->setTimeout(timeout);  // every all-reduce's wait
    ctx->connectFullMesh(timed, dev);
    s.gloo = ctx;
  }
  // Gloo counts elements in an int: past 2^31 parameters one call reduced a prefix only, or
  // allocated a negative size; a run of pieces reduces every element
  for (size_t at = 0; at < g.size(); at += kAllreducePiece) {
    std::vector<T*> ptrs{g.data() + at};
    gloo::AllreduceRing<T> ar(s.gloo, ptrs, static_cast<int>(std::min(kAllreducePiece, g.size() - at)));
    ar.run();
  }
}

// Sums g over the learner ranks (Gloo, ring). A rank waits up to run.collective_timeout_s for the
// others -- with Gloo's own 30 s a rank whose shard took 30 s less than another's failed the run
// (a large model's step on CPUs; between steps the ranks meet at the trajectory buffer instead) --
// and a failure is named: rank, Gloo's reason, the timeout where it ran out. Once connected, a
// rank whose process ended fails the others at once; in the first meeting (the run's first
// all-reduce) the others wait out the timeout, and a rank arriving after one gave up waits it
// again for that one's key. Throws.
template <class T>
void allreduce(learner_state& s, std::vector<T>& g) {
  if (s.world == 1) return;
  try {
    allreduce_gloo(s, g);
  } catch (const std::exception& e) {  // Gloo's IoException, EnforceNotMet (its store, device), system_error
    const std::string what = e.what();
    const bool timed_out = what.find("imeout") != std::string::npos || what.find("imed out") != std::string::npos;
    throw std::runtime_error(fmt::format("learner rank {} of {}: the all-reduce with the other rank(s) failed{}: {}", s.rank, s.world,
                                         timed_out ? fmt::format(" (each waits up to run.collective_timeout_s = {} s for the others)",
                                                                 s.env->cfg.collective_timeout_s)
                                                   : "",
                                         what));
  }
}

// Several learners: each rank's c_t (and reference logprobs) go to their places in the step's
// token vector (a sum all-reduce of zeros elsewhere: exact), and rank 0 recomputes the step
// metrics on all of it; its own shard's metrics covered half the tokens with the global N
// (token_mult_prob_error ~0.5 with two learners).
void gather_metrics(learner_state& s, const msg::batch_msg& b, models::learner_out& lo) {
  const size_t n = static_cast<size_t>(b.n_global);
  const bool kl = !lo.tokens.ref.empty() || s.ref_w;
  std::vector<float> c(n, 0.0f), ref(kl ? n : 0, 0.0f);
  size_t k = 0;
  for (size_t i = 0; i < b.samples.size(); ++i)
    for (size_t j = 0; j < b.samples[i].response.size(); ++j, ++k) {
      const size_t at = static_cast<size_t>(b.offsets.at(i)) + j;
      if (at >= n) throw std::runtime_error("gather_metrics: token offset past the step's " + std::to_string(n) + " tokens");
      c[at] = lo.tokens.c[k];
      if (kl) ref[at] = lo.tokens.ref[k];
    }
  allreduce(s, c);
  if (kl) allreduce(s, ref);
  if (s.rank != 0) return;
  models::token_batch_rl all = models::rl_tokens(b.all_samples);
  if (all.g.size() != n) throw std::runtime_error("gather_metrics: rank 0 got " + std::to_string(all.g.size()) + " of " + std::to_string(n) + " tokens");
  all.c = c;
  all.p = std::move(c);
  all.ref = std::move(ref);
  lo.loss.metrics = models::learner_metrics(all, s.env->rl.grpo, b.n_global, s.version);
}

// A copy of the master weights for calibration. The previous snapshot's buffer is reused once
// nobody else holds it (calibration done; only this actor hands out references), so steady-state
// steps copy into memory that is already mapped instead of faulting in a fresh buffer.
// (TSan does not model fences, and GCC refuses one under -fsanitize=thread: the TSan build
// allocates a fresh snapshot every step instead.)
std::shared_ptr<const std::vector<float>> snapshot_params(learner_state& s) {
#if !defined(__SANITIZE_THREAD__)
  if (s.snapshot && s.snapshot.use_count() == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);  // pairs with the last holder's release
    *s.snapshot = s.ck.params.data;
    return s.snapshot;
  }
#endif
  s.snapshot = std::make_shared<std::vector<float>>(s.ck.params.data);
  return s.snapshot;
}

// token_batch of BOS+prompt for the prompts of `step` (calibration before anything was trained)
std::vector<std::vector<int32_t>> step_prompts(const learner_state& s, uint64_t step) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& p : models::take_prompts(s.train, s.env->prompt_cursor(step),
                                            s.env->cfg.prompts_per_step))
    out.push_back(s.env->tok->encode(p.prompt, true));
  return out;
}

void evaluate_into(learner_state& s, msg::metrics_t& m) {
  const auto t0 = clk::now();
  models::generation_engine eng(*s.be, s.env->model, recipe_engine_config(s.env->cfg));
  models::rl_state st;
  st.params = s.ck.params;
  st.version = s.version;
  models::token_batch calib;
  for (const auto& q : step_prompts(s, s.version)) calib.add(q);
  const std::string err = eng.adopt(models::make_bundle(st, s.env->rl, {calib}, s.version));
  if (!err.empty()) throw std::runtime_error("evaluation: " + err);
  const auto r = models::evaluate(eng, s.val, *s.env->tok, s.env->rl.verifier, s.env->rl.max_new_tokens,
                                  static_cast<uint64_t>(s.env->cfg.seed));
  m["val_accuracy"] = r.greedy_accuracy;
  m["val_accuracy_sampled"] = r.sampled_accuracy;
  m["eval_s"] = secs(t0);
}

fs::path checkpoint_dir(const learner_state& s) { return fs::path(s.env->run_dir) / "checkpoints" / ("step_" + std::to_string(s.version)); }

// checkpoints/step_<version> with the batch that produced it (s.calib) and the next prompt; `latest` names it.
void checkpoint(learner_state& s) {
  const fs::path dir = checkpoint_dir(s);
  std::error_code ec;
  if (s.run_dir_was_there && !fs::is_directory(s.env->run_dir, ec))  // (a save recreated it holding checkpoints/ alone, exit 0)
    throw std::runtime_error(s.env->run_dir + (ec && ec != std::errc::no_such_file_or_directory
                                                   ? ": cannot stat the run directory (" + ec.message() + ")"
                                                   : std::string(": the run directory is gone (deleted during the run?)")) +
                             "; step " + std::to_string(s.version) + "'s checkpoint is not written");
  nlohmann::json j = {{"weight_version", s.version},
                      {"prompt_cursor", s.env->prompt_cursor(s.version)},
                      {"run", s.env->cfg.name},
                      {"train_set", {{"examples", s.train.items.size()}, {"fingerprint", models::dataset_fingerprint(s.train)}}}};
  s.ck.state_json = j.dump();
  models::checkpoint_save(dir.string(), s.ck, [&](const std::string& tmp) {  // they arrive with the checkpoint
    calibration_batch_save(tmp, s.calib);
    models::tokenizer_file_write(s.env->tok_file, tmp);
  });
  // latest is replaced atomically: rewritten in place, a crash or a full disk left it empty or
  // cut, and --resume failed although every checkpoint was intact
  const fs::path latest = fs::path(s.env->run_dir) / "checkpoints" / "latest";
  models::file_replace_durably(latest.string(), dir.filename().string() + "\n", latest.string() + " still names the previous checkpoint");
  s.checkpointed = s.version;
  if (const std::string err = checkpoints_prune(latest.parent_path().string(), s.env->cfg.keep_checkpoints, s.version); !err.empty())
    log_get("learner")->warn("{}", err);
}

// Re-scores sampled trajectories at their behaviour version in BF16 (q_t): log w = (c - q) + (q - g),
// with c_t the learner's logprob inside this step (the weights before its update). When generation
// runs FP8 linear layers, also under the generation policy's FP8 weights in the training forward
// (q8_t; rl-algorithm.md "re-scoring with the FP8 bundle itself"), which splits q - g into weight
// quantization (q - q8) and kernel / FP8 attention / KV-cache effects (q8 - g). The log-ratios
// add up; their k3 KL estimates do not (each is >= 0 and convex), so the two parts are reported
// beside precision_kl, not as its decomposition. And under the learner's own policy (ql_t: c_t
// had the learner been at the token's version; the health gates' quantity for tokens of every
// staleness, health.source = audit), sharing q's or q8's weights where the policy is the same.
// Up to audit.samples trajectories (every shard's on rank 0), one of each prompt's group in turn,
// each sampled under versions still held. w: the training weights of this step (c, and ql at it).
void audit_into(learner_state& s, const models::model_weights& w, const std::vector<models::rl_sample>& samples,
                msg::metrics_t& m) {
  models::precision_policy g8 = s.env->rl.gen_policy.training();  // FP8 weights, dense attention
  const bool split_fp8 = s.env->rl.gen_policy.linear == models::precision::fp8;
  // q: BF16 linear weights; with the split, otherwise the generation policy's (its kernels: -tiles),
  // so that q and q8 differ in the linear weights' precision only
  models::precision_policy bf = models::precision_policy::named("bf16");
  if (split_fp8) {
    bf = g8;
    bf.linear = models::precision::bf16;
    bf.bf16_first = bf.bf16_last = 0;
  }
  models::audit_sums sums;
  const models::precision_policy lp = s.env->rl.train_policy.training();
  const bool l_is_q = lp.fingerprint() == bf.fingerprint(), l_is_q8 = split_fp8 && lp.fingerprint() == g8.fingerprint();
  // BF16, FP8 and learner-policy weights of each behaviour version held (this step's, built once
  // into s.audit_held, and the last max_staleness); at this step's version the learner's are w
  auto at_version = [&](uint64_t v) -> models::audit_weights {
    if (v != s.version && !s.audit_held.count(v)) return {};
    audit_version& av = s.audit_held[v];
    const bool build_q = !av.q, build_l = v != s.version && !l_is_q && !l_is_q8 && !av.learner;
    models::model_params held;  // a past version's master weights with this model's layout
    const models::model_params* p = &s.ck.params;
    if ((build_q || build_l) && v != s.version) {
      held = {s.ck.params.cfg, s.ck.params.layout, av.data};
      p = &held;
    }
    if (build_q) {
      av.q = models::model_weights_build(*s.be, p->cfg, bf, {p, nullptr, nullptr}, false);
      if (split_fp8) av.q8 = models::model_weights_build(*s.be, p->cfg, g8, {p, nullptr, nullptr}, false);
    }
    if (build_l) av.learner = models::model_weights_build(*s.be, p->cfg, lp, {p, nullptr, nullptr}, false);
    const models::model_weights* l = v == s.version ? &w : l_is_q ? av.q.get() : l_is_q8 ? av.q8.get() : av.learner.get();
    return {av.q.get(), av.q8.get(), l};
  };
  const auto n = models::audit_rescore(*s.run, w, at_version, samples, s.env->cfg.audit_samples, s.env->rl.proc, sums);
  sums.write(m);
  n.write(m);
}

// The whole step's samples: every rank's shard on rank 0 of several learners, else this rank's.
const std::vector<models::rl_sample>& batch_samples(const msg::batch_msg& b) {
  return b.all_samples.empty() ? b.samples : b.all_samples;
}

// One GRPO step on batch b (this rank's shard): the loss and gradients, all-reduced over the
// learners, then AdamW on the master weights; s.version becomes the new weight version. Returns
// the step's metrics (several learners: rank 0's are the whole step's, gather_metrics). Throws.
//   t_wait: when this learner asked the buffer for b
msg::metrics_t learner_train_step(learner_state& s, const msg::batch_msg& b, clk::time_point t_wait) {
  const auto t_train = clk::now();
  models::learner_out lo;
  msg::metrics_t audit;
  double gnorm = 0;
  s.arena->execute([&] {
    auto w = models::model_weights_build(*s.be, s.ck.params.cfg, s.env->rl.train_policy.training(),
                                         {&s.ck.params, nullptr, nullptr}, true);
    auto sum_over_learners = [&s](double x) {
      std::vector<double> v{x};
      allreduce(s, v);
      return v[0];
    };
    lo = models::learner_grpo(*s.run, *w, b.samples, s.env->rl.grpo, b.n_global, s.version, s.ref_w.get(), s.env->rl.proc,
                              sum_over_learners);
    if (s.rank == 0 && s.fault_sleep && s.fault_sleep->first == s.version + 1)  // (fault tests, learner_fault_sleep)
      std::this_thread::sleep_for(std::chrono::milliseconds(s.fault_sleep->second));
    allreduce(s, lo.grads);
    if (s.world > 1) gather_metrics(s, b, lo);
    if (s.rank == 0 && s.env->cfg.audit_every > 0) {  // (rank 0 audits every shard's trajectories)
      if ((s.version + 1) % static_cast<uint64_t>(s.env->cfg.audit_every) == 0) {
        const auto t_audit = clk::now();
        audit_into(s, *w, batch_samples(b), audit);  // before the update: s.ck.params is version s.version
        audit["audit_s"] = secs(t_audit);  // (inside train_s)
      }
      // this version kept for the next max_staleness steps' audits (their trajectories may hold its
      // tokens), its builds too; this version itself is s.ck.params until the update
      const auto keep = static_cast<uint64_t>(s.env->cfg.max_staleness);
      if (keep > 0) s.audit_held[s.version].data = s.ck.params.data;
      std::erase_if(s.audit_held, [&](const auto& e) { return e.first + keep <= s.version; });
    }
    gnorm = models::adamw_step(s.env->rl.opt, s.ck.params.layout, s.ck.params.data.data(), lo.grads.data(), s.ck.opt);
  });
  msg::metrics_t m = lo.loss.metrics;
  if (const auto nf = m.find("nonfinite_is_weights"); nf != m.end() && nf->second > 0)  // counted and raised
    log_get("learner")->warn("step {}: {} tokens left the loss with a non-finite logprob or IS weight (e.g. "  // (rl-algorithm.md §10)
                             "top-k/top-p no longer keeping a token sampled under older weights)",
                             s.version + 1, nf->second);
  models::rl_batch_metrics(batch_samples(b), s.version, s.env->cfg.max_staleness, m);
  for (const auto& [k, v] : b.buffer_metrics) m[k] = v;
  for (const auto& [k, v] : audit) m[k] = v;
  m["grad_norm"] = gnorm;
  m["tokens"] = b.n_global;
  m["wait_batch_s"] = std::chrono::duration<double>(t_train - t_wait).count();
  m["train_s"] = secs(t_train);
  s.version += 1;
  return m;
}

}  // namespace

// Rank 0 after a step: the new weights to calibration (calibrated on the batch that produced
// them), validation and a checkpoint when due, then the step's report to the controller. Throws.
template <class Self>
void learner_publish(Self self, const msg::batch_msg& b, msg::metrics_t m) {
  auto& s = self->state;
  msg::params_msg pm;
  pm.version = s.version;
  pm.params = snapshot_params(s);
  pm.calib = models::rl_sequences(batch_samples(b));  // every rank's shard
  s.calib = pm.calib;  // for this version's checkpoint, scheduled or at a stop (token ids: ~4 MB at 512 x 2048, small beside a step)
  const bool last = s.version >= s.end_version;
  const bool ckpt = last || (s.env->cfg.checkpoint_every > 0 && s.version % static_cast<uint64_t>(s.env->cfg.checkpoint_every) == 0);
  trace_send("learner0", "params_msg", pm.trace, static_cast<int64_t>(pm.version));
  self->send(s.peers.calibration, std::move(pm));
  if (last || (s.env->cfg.eval_every > 0 && s.version % static_cast<uint64_t>(s.env->cfg.eval_every) == 0))
    s.arena->execute([&] { evaluate_into(s, m); });
  if (ckpt) checkpoint(s);
  msg::step_report rep{{}, s.version, std::move(m)};
  trace_send("learner0", "step_report", rep.trace, static_cast<int64_t>(s.version));
  self->send(s.peers.controller, std::move(rep));
}

// The run stops at this learner's version (the buffer answered `stop`): rank 0 checkpoints it unless
// a checkpoint of it exists, and tells the controller, which ends the run. No further batch is asked.
template <class Self, class Fail>
void stop_at_version(Self self, const Fail& fail) {
  auto& s = self->state;
  if (s.rank != 0) return;
  std::string dir;
  try {
    if (s.version > s.checkpointed) checkpoint(s);
    if (s.version > s.env->start_version) dir = checkpoint_dir(s).string();
    else if (s.version > 0) dir = s.env->init_dir;  // nothing trained since the resume: the checkpoint it started from
  } catch (const std::exception& e) {
    return fail(std::string("checkpoint at the stop failed: ") + e.what());
  }
  self->send(s.peers.controller, msg::stopped_atom::value, s.version, dir);
}

msg::learner_actor spawn_learner(caf::actor_system& sys, std::shared_ptr<const actor_env> env, int32_t rank,
                                 int32_t world, device_spec dev) {
  using self_t = msg::learner_actor::stateful_pointer<learner_state>;
  return sys.spawn([rank, world, dev](self_t self, std::shared_ptr<const actor_env> env) -> msg::learner_actor::behavior_type {
    actor_failures_named(self, "learner" + std::to_string(rank));
    auto& st = self->state;
    st.env = env;
    st.rank = rank;
    st.world = world;
    st.be = backend_for(dev);
    st.arena = arena_for(dev);
    st.run = std::make_unique<models::model_runner>(*st.be);
    st.ck = models::checkpoint_load(env->init_dir, models::checkpoint_kind::model_ok);  // run_preflight checked which kind
    st.version = env->start_version;
    st.checkpointed = env->start_version;  // a resume starts from its checkpoint; a fresh run has none to redo
    st.run_dir_was_there = fs::is_directory(env->run_dir);
    if (env->cfg.kl_beta > 0) {
      st.ref = models::checkpoint_load(env->ref_dir, models::checkpoint_kind::model_ok).params;
      st.ref_w = models::model_weights_build(*st.be, st.ref.cfg, env->rl.train_policy.training(), {&st.ref, nullptr, nullptr}, false);
    }
    st.end_version = static_cast<uint64_t>(env->cfg.steps);
    st.fault_sleep = learner_fault_sleep();
    const auto task = models::task_spec_parse(env->cfg.task);
    st.train = models::task_load(task, false, env->cfg.train_size, static_cast<uint64_t>(env->cfg.seed));
    st.val = models::task_load(task, true, env->cfg.val_size, static_cast<uint64_t>(env->cfg.seed));
    auto log = log_get("learner");
    auto fail = [self](const std::string& what) { actor_fail(self, "learner" + std::to_string(self->state.rank), what); };
    // The behavior below owns request_batch; the function refers to itself weakly (a strong
    // self-capture is a reference cycle: it and its captures outlived the actor, LeakSanitizer).
    auto request_batch = std::make_shared<std::function<void()>>();
    *request_batch = [self, fail, again = std::weak_ptr<std::function<void()>>(request_batch), log] {
      auto request_batch = again.lock();
      if (!request_batch) return;
      auto& s = self->state;
      if (s.version >= s.end_version) return;
      const auto t_wait = clk::now();
      const int64_t t0 = trace_now_us();
      self->request(s.peers.buffer, std::chrono::minutes(30), msg::batch_atom::value, s.version, s.rank, s.world, s.version)
          .then(
              [self, fail, request_batch, t_wait, t0](msg::batch_msg& b) {
                auto& s = self->state;
                trace_recv_step("learner" + std::to_string(s.rank), "batch_msg", b.trace, b.step);
                trace_writer::process().event("learner" + std::to_string(s.rank), "wait_batch", "span", t0, trace_now_us() - t0);
                if (b.stop) return stop_at_version(self, fail);  // the run is stopping: no further step
                try {  // the step's span covers rank 0's publishing too (its validation and checkpoint)
                  trace_span span("learner" + std::to_string(s.rank), "train_step", static_cast<int64_t>(s.version));
                  msg::metrics_t m = learner_train_step(s, b, t_wait);
                  if (s.rank == 0) learner_publish(self, b, std::move(m));
                } catch (const std::exception& e) {
                  fail(std::string("step failed: ") + e.what());
                  return;
                }
                (*request_batch)();
              },
              [fail](caf::error& err) { fail("batch request failed: " + caf::to_string(err)); });
    };
    return {
        [self](msg::peers_msg& p) {
          trace_recv("learner" + std::to_string(self->state.rank), "peers_msg", p.trace);
          self->state.peers = std::move(p);
        },
        [self, request_batch, fail](msg::start_atom, uint64_t) {
          log_get("learner")->debug("learner{} start at v{}", self->state.rank, self->state.version);
          auto& s = self->state;
          if (s.rank == 0) {  // the bundle of the starting version, calibrated on its first prompts, or
                              // (resume) on the batch that produced it, as the uninterrupted run did
            msg::params_msg pm;
            pm.version = s.version;
            pm.params = snapshot_params(s);
            try {
              if (s.version > 0) pm.calib = calibration_batch_load(s.env->init_dir);  // the controller's preflight read it too
            } catch (const std::exception& e) {
              return fail(e.what());  // rank 0 on another node: its own copy of the run directory
            }
            if (pm.calib.empty()) {
              if (s.version > 0)
                log_get("learner")->warn("{}: no calibration.jsonl (an older checkpoint): v{} is calibrated on its step's prompts, "
                                         "not on the batch that produced it", s.env->init_dir, s.version);
              pm.calib = step_prompts(s, s.version);
            }
            trace_send("learner0", "params_msg", pm.trace, static_cast<int64_t>(pm.version));
            self->send(s.peers.calibration, std::move(pm));
          }
          (*request_batch)();
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

}  // namespace fp8rl::actors
