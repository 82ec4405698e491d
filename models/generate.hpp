// models/generate.hpp -- the generation engine a rollout actor runs: continuous batching over a
// fixed number of slots, KV cache (F32/BF16/FP8), seeded sampling with per-token logprobs and
// version tags, and bundle adoption at step boundaries.
// defines: gen_request, gen_result, kv_adopt_policy, engine_config, fp8_saturation, engine_stats,
//          forward_op, forward_profile, generation_engine
//
// One step: (1) adopt a pending bundle if any (KV policy `recompute` re-prefills every active
// sequence under the new weights; `keep` keeps cache entries, and tokens record the oldest
// weight and scale versions in their context); (2) admit waiting requests into free slots; (3) one
// forward over all new context tokens (prefill) and last tokens (decode) of active slots;
// (4) sample one token per slot. Every per-token computation is batch-invariant, so a request's
// tokens and logprobs do not depend on what else is in the batch, and equal the training
// forward's logprobs of the same sequence under the same policy.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "models/backend.hpp"
#include "models/bundle.hpp"
#include "models/transformer.hpp"

namespace fp8rl::models {

struct gen_request {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  int32_t max_tokens = 64;
  std::vector<int32_t> stop_tokens;
  logit_processing proc;   // temperature 0 = greedy
  uint64_t seed = 0;       // sampling stream: (seed, id, token index) -> uniform
};

enum class kv_adopt_policy : uint8_t { recompute = 0, keep = 1 };

struct gen_result {
  uint64_t id = 0;
  std::vector<int32_t> prompt, tokens;      // generated tokens
  std::vector<float> logprobs;              // g_t of each generated token (processed distribution)
  std::vector<uint64_t> weight_version;     // per token: versions it was sampled under
  std::vector<uint64_t> scale_version;
  std::vector<uint64_t> oldest_kv_version;  // per token: oldest weight version in its KV context
  std::vector<uint64_t> oldest_kv_scale_version;  // and the oldest scale version (a scale-only
                                                  // adoption under `keep` changes only this one)
  kv_adopt_policy kv_policy = kv_adopt_policy::recompute;
  std::string finish;                       // "stop" | "length"
};

struct engine_config {
  int64_t slots = 8;
  int64_t max_context = 512;
  kv_adopt_policy on_adopt = kv_adopt_policy::recompute;
  precision_policy policy;                  // generation policy (FP8 KV / attention allowed)
  // New tokens per forward pass: a step whose slots bring more (fresh prompts, a recompute
  // adoption re-reading every context) runs several forwards of whole slots, so its activations
  // stay bounded (one slot's tokens always go together). The results do not depend on it.
  int64_t max_step_tokens = 4096;
};

// The bytes of the KV cache an engine allocates up front (slots x max_context positions, K and V
// of every layer, in the policy's KV format), and this machine's memory (physical, or a cgroup's
// limit below it): the engine refuses a cache larger than it, and fp8rl train the sum of a
// host's engines.
double engine_kv_bytes(const model_config& m, const engine_config& ec);
double machine_memory_bytes();
// The walk behind it: `physical` lowered to the smallest limit found for the groups named in
// `proc_cgroup` (a /proc/PID/cgroup file) and their parents under `cgroup_root` (/sys/fs/cgroup).
double memory_limit_bytes(double physical, const std::filesystem::path& proc_cgroup,
                          const std::filesystem::path& cgroup_root);

// Per layer: elements FP8 saturation clipped (|x / scale| > 464) -- K/V written to an FP8 cache,
// queries of FP8 attention (policy fp8_attention).
struct fp8_saturation {
  std::vector<int64_t> kv, q;
  explicit fp8_saturation(int64_t layers = 0) : kv(static_cast<size_t>(layers), 0), q(kv) {}
};

struct engine_stats {
  int64_t steps = 0, prefill_tokens = 0, decode_tokens = 0, adoptions = 0, recomputed_tokens = 0;
  std::vector<int64_t> kv_saturated;  // per layer: FP8 KV elements that saturated
  std::vector<int64_t> q_saturated;   // per layer: FP8 query elements that saturated
};

// Where an engine forward spends its time: host wall seconds and calls per kind of op, summed
// over forwards. The q/k/v and gate/up groups count as one op each; `residual` is the two adds.
// Needs a synchronous backend (host memory, as the CPU one): an asynchronous one would time
// its launches, so engine_forward refuses a profile there.
enum class forward_op : uint8_t { embedding, norm, qkv, rope, kv_write, attention, o_proj, residual, gate_up,
                                  swiglu, down, lm_head, count };
struct forward_profile {
  static constexpr size_t kOps = static_cast<size_t>(forward_op::count);
  std::array<double, kOps> seconds{};
  std::array<int64_t, kOps> calls{};
  static const char* name(forward_op op);
};

// Attributes the time since the previous mark to an op (no clock read without a profile).
class forward_laps {
 public:
  explicit forward_laps(forward_profile* p) : p_(p) {
    if (p_) t_ = std::chrono::steady_clock::now();
  }
  void mark(forward_op op) {
    if (!p_) return;
    const auto t = std::chrono::steady_clock::now();
    p_->seconds[static_cast<size_t>(op)] += std::chrono::duration<double>(t - t_).count();
    ++p_->calls[static_cast<size_t>(op)];
    t_ = t;
  }

 private:
  forward_profile* p_;
  std::chrono::steady_clock::time_point t_;
};

// One forward of the rollout model over tokens living in `cache` at (slot_of[t], pos[t]): writes
// their K/V, attends to each token's cached context, and returns logits of the `rows` [R, V]
// (host). attn: FP8 Q/K/V scales when the policy has an FP8 KV cache / attention. saturated
// (optional) accumulates the FP8 K/V and query elements clipped; profile (optional) accumulates
// op times. The engine's step and the decode benchmark both run this.
void engine_forward(backend& be, const model_weights& w, kv_cache& cache, const attn_fp8_scales& attn,
                    const std::vector<int32_t>& tokens, const std::vector<int32_t>& slot_of,
                    const std::vector<int32_t>& pos, const std::vector<int64_t>& rows, std::vector<float>& logits,
                    fp8_saturation* saturated, forward_profile* profile = nullptr);

class generation_engine {
 public:
  generation_engine(backend& be, const model_config& cfg, engine_config ec);
  ~generation_engine();

  // Validates and prepares a bundle on the caller's thread; it takes effect at the next step
  // boundary (never during a forward pass). Returns "" on success, else the reason it was
  // refused -- the engine then keeps its current weights. Thread-safe.
  std::string adopt(std::shared_ptr<const quant::weight_bundle> b);
  // Learner-side shortcut (tests, tools): weights straight from master params.
  std::string adopt_params(const model_params& p, uint64_t weight_version, uint64_t scale_version,
                           const attn_fp8_scales* attn = nullptr);

  // Throws std::invalid_argument naming the request: an empty or unfit prompt, a token outside
  // the vocabulary, max_tokens <= 0, bad sampling settings, an id already waiting or active.
  void submit(gen_request r);
  // One engine step; finished results. Throws std::runtime_error naming the request where its
  // logits are not finite (diverged weights or activations): the step is lost, drain() returns
  // the requests.
  std::vector<gen_result> step();
  std::vector<gen_result> run_to_completion();  // steps until nothing is waiting or active
  bool idle() const;
  bool has_weights() const;
  uint64_t weight_version() const;  // of the adopted weights (0: none yet); thread-safe
  uint64_t scale_version() const;   // of their scale snapshot (0: none yet); thread-safe
  const engine_stats& stats() const { return stats_; }
  const engine_config& config() const { return ec_; }
  const model_config& model() const { return cfg_; }
  // Requests not finished (waiting + active, with what they generated so far discarded), e.g.
  // to re-queue elsewhere when this engine is stopped.
  std::vector<gen_request> drain();

 private:
  struct state;       // adopted weights of one version
  struct slot;        // an active sequence
  struct step_batch;  // one step's packed tokens and the slots they feed
  struct sampled {    // a row's next token and its logprob
    int32_t tok;
    float lp;
  };
  backend& be_;
  model_config cfg_;
  engine_config ec_;
  mutable std::mutex adopt_mu_;
  std::shared_ptr<const state> pending_;  // guarded by adopt_mu_
  std::shared_ptr<const state> current_;
  std::deque<gen_request> waiting_;
  std::set<uint64_t> live_ids_;  // waiting or active: an id twice drew the same random stream
  std::vector<std::unique_ptr<slot>> slots_;
  std::unique_ptr<kv_cache> cache_;
  engine_stats stats_;
  std::string install(std::shared_ptr<const state> s);
  // step()'s phases: an adopted bundle takes effect, waiting requests fill free slots, every
  // active slot's unfed tokens are packed, one forward and sampling, then the slots change.
  void adopt_pending();
  void admit_waiting();
  step_batch pack_step();
  std::vector<sampled> sample_rows(const step_batch& b);
  std::vector<gen_result> commit_tokens(const step_batch& b, const std::vector<sampled>& out);
  void forward_chunked(const std::vector<int32_t>& tokens, const std::vector<int32_t>& slot_of, const std::vector<int32_t>& pos,
                       const std::vector<int64_t>& rows, std::vector<float>& logits, fp8_saturation& saturated);
};

}  // namespace fp8rl::models
