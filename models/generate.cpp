// models/generate.cpp -- generation engine: slots, KV cache, sampling, adoption.
#include "models/generate.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <utility>

#include <unistd.h>

#include "models/sampling.hpp"

namespace fp8rl::models {

struct generation_engine::state {
  std::unique_ptr<model_weights> weights;
  attn_fp8_scales attn;  // FP8 attention / KV scales ([L][H], [L][KV], [L][KV]); empty if unused
  uint64_t weight_version = 0, scale_version = 0;
};

struct generation_engine::slot {
  gen_request req;
  std::vector<int32_t> ctx;            // prompt + generated tokens
  int64_t fed = 0;                     // ctx[0, fed) have K/V in the cache
  // (weight, scale) versions that wrote each cached position: nondecreasing in write order (the
  // engine refuses older pairs), so the smallest pair holds the oldest weight version, and the
  // oldest scale version too while scale versions never fall as weight versions rise (bundles are
  // made with scale_version = weight_version: calibration after every step)
  std::vector<std::pair<uint64_t, uint64_t>> pos_version;
  gen_result res;
};

generation_engine::generation_engine(backend& be, const model_config& cfg, engine_config ec)
    : be_(be), cfg_(cfg), ec_(std::move(ec)) {
  cfg_.validate();
  ec_.policy.validate();
  if (ec_.max_step_tokens <= 0)
    throw std::invalid_argument("engine: max_step_tokens must be > 0, got " + std::to_string(ec_.max_step_tokens));
  if (ec_.slots <= 0 || ec_.max_context <= 1)
    throw std::invalid_argument("engine: slots must be > 0 and max_context > 1 (a prompt token and one generated), got " +
                                std::to_string(ec_.slots) + " and " + std::to_string(ec_.max_context));
  if (ec_.max_context > cfg_.max_position_embeddings)
    throw std::invalid_argument("engine: max_context exceeds max_position_embeddings");
  // The KV cache is allocated up front: refuse what this machine cannot hold, naming the knobs
  // (a typo in max_context otherwise ends in an allocation failure, or in swap).
  const double kv_bytes = engine_kv_bytes(cfg_, ec_), ram = machine_memory_bytes();
  if (ram > 0 && kv_bytes > ram)
    throw std::invalid_argument("engine: a KV cache of " + std::to_string(ec_.slots) + " slots x " +
                                std::to_string(ec_.max_context) + " positions needs " +
                                std::to_string(int64_t(kv_bytes / double(1 << 30))) + " GiB, more than this machine's " +
                                std::to_string(int64_t(ram / double(1 << 30))) + " GiB: lower slots or max_context");
  slots_.resize(static_cast<size_t>(ec_.slots));
  cache_ = be_.kv_cache_create(ec_.slots, cfg_.num_hidden_layers, cfg_.num_key_value_heads, cfg_.head_dim,
                               ec_.max_context, ec_.policy.kv);
  stats_.kv_saturated.assign(static_cast<size_t>(cfg_.num_hidden_layers), 0);
  stats_.q_saturated = stats_.kv_saturated;
}

generation_engine::~generation_engine() = default;

double engine_kv_bytes(const model_config& m, const engine_config& ec) {
  const double esize = ec.policy.kv == kv_dtype::fp8 ? 1 : ec.policy.kv == kv_dtype::bf16 ? 2 : 4;
  return double(ec.slots) * double(ec.max_context) * double(m.num_hidden_layers) * 2.0 * double(m.num_key_value_heads) *
         double(m.head_dim) * esize;
}

// Physical memory, or the smallest memory limit of this process's cgroup and those above it (v2
// memory.max, v1 memory.limit_in_bytes: a container's, a systemd MemoryMax): what the OOM killer
// measures against. "max" (v2's no limit) does not parse; v1's no limit is above physical memory.
double machine_memory_bytes() {
  return memory_limit_bytes(double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE)), "/proc/self/cgroup",
                            "/sys/fs/cgroup");
}

double memory_limit_bytes(double physical, const std::filesystem::path& proc_cgroup,
                          const std::filesystem::path& cgroup_root) {
  double m = physical;
  std::ifstream groups(proc_cgroup);
  for (std::string line; std::getline(groups, line);) {  // "0::/path" (v2), "N:memory:/path" (v1)
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string ctrl = line.substr(a + 1, b - a - 1);
    const bool v2 = ctrl.empty(), v1 = ctrl.find("memory") != std::string::npos;
    if (!v2 && !v1) continue;
    const std::filesystem::path base = v2 ? cgroup_root : cgroup_root / "memory";
    std::filesystem::path rel = std::filesystem::path(line.substr(b + 1)).relative_path();  // "/a/b" -> "a/b"
    for (bool more = true; more; rel = rel.parent_path()) {  // the group, its parents, the root
      more = !rel.empty();
      std::ifstream in(base / rel / (v2 ? "memory.max" : "memory.limit_in_bytes"));
      double limit = 0;
      if (in >> limit && limit > 0 && limit < m) m = limit;
    }
  }
  return m;
}

// Refuses weights or scales older than the newest the engine holds (either version lower):
// the pending bundle if one waits for the next step (else a late older bundle would replace it,
// and a caller told its newer one succeeded would see the weights go back), else the adopted one.
std::string generation_engine::install(std::shared_ptr<const state> s) {
  std::lock_guard<std::mutex> g(adopt_mu_);
  const state* newest = pending_ ? pending_.get() : current_.get();
  auto versions = [](const state& x) { return std::to_string(x.weight_version) + "/scales v" + std::to_string(x.scale_version); };
  // each version on its own: (5, 3) after (4, 4) put K/V of scale version 3 beside 4's while the
  // tokens' oldest-scale records said 4
  if (newest && (s->weight_version < newest->weight_version || s->scale_version < newest->scale_version))
    return "bundle v" + versions(*s) + " is older than the " + (pending_ ? "pending" : "adopted") + " v" + versions(*newest);
  pending_ = std::move(s);
  return "";
}

std::string generation_engine::adopt(std::shared_ptr<const quant::weight_bundle> b) {
  if (!b) return "null bundle";
  try {
    bundle_contents c = bundle_unpack(*b, cfg_, ec_.policy);
    auto s = std::make_shared<state>();
    s->weights = model_weights_build(be_, cfg_, ec_.policy, c.source(), false, true);
    s->attn = std::move(c.attn);
    s->weight_version = b->snapshot.weight_version;
    s->scale_version = b->snapshot.scale_version;
    return install(std::move(s));
  } catch (const std::exception& e) {
    return e.what();
  }
}

namespace {
// Why `a` cannot serve as the FP8 attention/KV scales ([L][H], [L][KV], [L][KV], each > 0 and
// finite) of a model with config c; empty when it can.
std::string attn_scales_problem(const model_config& c, const attn_fp8_scales& a) {
  const size_t L = static_cast<size_t>(c.num_hidden_layers), H = static_cast<size_t>(c.num_attention_heads),
               KV = static_cast<size_t>(c.num_key_value_heads);
  if (a.q.size() != L * H || a.k.size() != L * KV || a.v.size() != L * KV)
    return "FP8 attention/KV scales hold " + std::to_string(a.q.size()) + "/" + std::to_string(a.k.size()) + "/" +
           std::to_string(a.v.size()) + " Q/K/V entries, the model needs " + std::to_string(L * H) + "/" +
           std::to_string(L * KV) + "/" + std::to_string(L * KV);
  for (const auto* v : {&a.q, &a.k, &a.v})
    for (size_t i = 0; i < v->size(); ++i)
      if (!((*v)[i] > 0.0f) || !std::isfinite((*v)[i]))
        return std::string("FP8 attention/KV scale ") + (v == &a.q ? "Q" : v == &a.k ? "K" : "V") + "[" +
               std::to_string(i) + "] is not a positive finite number";
  return "";
}
}  // namespace

std::string generation_engine::adopt_params(const model_params& p, uint64_t weight_version, uint64_t scale_version,
                                            const attn_fp8_scales* attn) {
  try {
    // another model's params were read at this model's sizes (out of bounds when smaller)
    if (std::string why = model_config_mismatch(cfg_, p.cfg); !why.empty()) return "params of another model: " + why;
    if ((ec_.policy.kv == kv_dtype::fp8 || ec_.policy.fp8_attention) && !attn)
      return "policy '" + ec_.policy.name + "' needs FP8 attention/KV scales";
    if (attn)
      if (std::string why = attn_scales_problem(cfg_, *attn); !why.empty()) return why;
    auto s = std::make_shared<state>();
    s->weights = model_weights_build(be_, cfg_, ec_.policy, {&p, nullptr, nullptr}, false, true);
    if (attn) s->attn = *attn;
    s->weight_version = weight_version;
    s->scale_version = scale_version;
    return install(std::move(s));
  } catch (const std::exception& e) {
    return e.what();
  }
}

void generation_engine::submit(gen_request r) {
  if (r.prompt.empty()) throw std::invalid_argument("request " + std::to_string(r.id) + ": empty prompt");
  if (static_cast<int64_t>(r.prompt.size()) >= ec_.max_context)
    throw std::invalid_argument("request " + std::to_string(r.id) + ": prompt of " + std::to_string(r.prompt.size()) +
                                " tokens does not fit max_context " + std::to_string(ec_.max_context));
  for (int32_t t : r.prompt)
    if (t < 0 || t >= cfg_.vocab_size)
      throw std::invalid_argument("request " + std::to_string(r.id) + ": token " + std::to_string(t) + " outside the vocabulary");
  if (r.max_tokens <= 0) throw std::invalid_argument("request " + std::to_string(r.id) + ": max_tokens must be > 0");
  if (std::string why = logit_processing_problem(r.proc); !why.empty())
    throw std::invalid_argument("request " + std::to_string(r.id) + ": " + why);
  for (int32_t t : r.stop_tokens)
    if (t < 0 || t >= cfg_.vocab_size)
      throw std::invalid_argument("request " + std::to_string(r.id) + ": stop token " + std::to_string(t) +
                                  " outside the vocabulary");
  if (!live_ids_.insert(r.id).second)
    throw std::invalid_argument("request " + std::to_string(r.id) + ": an unfinished request has this id (each id draws its own random stream)");
  waiting_.push_back(std::move(r));
}

bool generation_engine::idle() const {
  return waiting_.empty() && std::none_of(slots_.begin(), slots_.end(), [](const auto& s) { return s != nullptr; });
}

bool generation_engine::has_weights() const {
  std::lock_guard<std::mutex> g(adopt_mu_);
  return current_ != nullptr || pending_ != nullptr;  // pending weights are adopted by the next step
}
uint64_t generation_engine::weight_version() const {
  std::lock_guard<std::mutex> g(adopt_mu_);  // step() swaps current_ under it
  return current_ ? current_->weight_version : 0;
}

// Whole slots per forward, at most max_step_tokens new tokens each (a slot with more goes alone);
// rows are the slots' last tokens, in order, and logits come back [slots, V] as from one forward.
void generation_engine::forward_chunked(const std::vector<int32_t>& tokens, const std::vector<int32_t>& slot_of,
                                        const std::vector<int32_t>& pos, const std::vector<int64_t>& rows,
                                        std::vector<float>& logits, fp8_saturation& saturated) {
  if (static_cast<int64_t>(tokens.size()) <= ec_.max_step_tokens) {
    engine_forward(be_, *current_->weights, *cache_, current_->attn, tokens, slot_of, pos, rows, logits, &saturated);
    return;
  }
  logits.clear();
  std::vector<float> part;
  for (size_t first = 0; first < rows.size();) {
    const int64_t b = first == 0 ? 0 : rows[first - 1] + 1;  // the group's first token
    size_t last = first;
    while (last + 1 < rows.size() && rows[last + 1] + 1 - b <= ec_.max_step_tokens) ++last;
    const int64_t e = rows[last] + 1;
    auto cut = [&](const std::vector<int32_t>& v) { return std::vector<int32_t>(v.begin() + b, v.begin() + e); };
    std::vector<int64_t> r(rows.begin() + static_cast<long>(first), rows.begin() + static_cast<long>(last) + 1);
    for (auto& x : r) x -= b;
    engine_forward(be_, *current_->weights, *cache_, current_->attn, cut(tokens), cut(slot_of), cut(pos), r, part, &saturated);
    logits.insert(logits.end(), part.begin(), part.end());
    first = last + 1;
  }
}

uint64_t generation_engine::scale_version() const {
  std::lock_guard<std::mutex> g(adopt_mu_);
  return current_ ? current_->scale_version : 0;
}

std::vector<gen_request> generation_engine::drain() {
  std::vector<gen_request> out(waiting_.begin(), waiting_.end());
  waiting_.clear();
  live_ids_.clear();
  for (auto& s : slots_)
    if (s) {
      out.push_back(s->req);
      s.reset();
    }
  return out;
}

const char* forward_profile::name(forward_op op) {
  static constexpr const char* kNames[kOps] = {"embedding", "norm", "qkv", "rope", "kv_write", "attention", "o_proj",
                                               "residual", "gate_up", "swiglu", "down", "lm_head"};
  return kNames[static_cast<size_t>(op)];
}

void engine_forward(backend& be, const model_weights& w, kv_cache& cache, const attn_fp8_scales& a,
                    const std::vector<int32_t>& tokens, const std::vector<int32_t>& slot_of,
                    const std::vector<int32_t>& pos, const std::vector<int64_t>& rows, std::vector<float>& logits,
                    fp8_saturation* saturated, forward_profile* profile) {
  const model_config& c = w.cfg;
  const std::vector<float>& inv_freq = w.rope_inv_freq;  // [D/2]
  const int64_t T = static_cast<int64_t>(tokens.size()), C = c.hidden_size, F = c.intermediate_size,
                H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim, R = static_cast<int64_t>(rows.size());
  buffer<float> x(be, T * C), xn(be, T * C);                                   // [T, C] residual stream, normed
  buffer<float> q(be, T * H * D), k(be, T * KV * D), v(be, T * KV * D);         // [T, H*D], [T, KV*D], [T, KV*D]
  buffer<float> att(be, T * H * D), tmp(be, T * std::max(C, H * D));            // [T, H*D], [T, max(C, H*D)]
  buffer<float> gate(be, T * F), up(be, T * F), rstd(be, T);                   // [T, F], [T, F], [T]
  buffer<float> xr(be, R * C), lg(be, R * c.vocab_size);                        // [R, C] the rows sampled, [R, V]
  const kv_step st{T, slot_of.data(), pos.data()};
  const bool fp8q = w.policy.fp8_attention, fp8kv = w.policy.kv == kv_dtype::fp8;
  if ((fp8q || fp8kv) && (a.q.size() != static_cast<size_t>(c.num_hidden_layers * H) ||
                          a.k.size() != static_cast<size_t>(c.num_hidden_layers * KV) ||
                          a.v.size() != static_cast<size_t>(c.num_hidden_layers * KV)))
    throw std::invalid_argument("engine forward: FP8 attention/KV scales missing");
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (profile && !be.host_memory())
    throw std::invalid_argument("engine forward: an op profile needs a synchronous backend ('" + be.name() + "' is not)");
  forward_laps lap(profile);
  be.embedding_forward(w.wte.data(), tokens.data(), T, C, x.data());
  lap.mark(forward_op::embedding);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const auto& lw = w.layers[i];
    be.rmsnorm_forward(x.data(), lw.attn_norm.data(), T, C, eps, xn.data(), rstd.data());
    lap.mark(forward_op::norm);
    const prepared_linear* qkv[] = {lw.q.get(), lw.k.get(), lw.v.get()};
    float* qkv_out[] = {q.data(), k.data(), v.data()};
    be.linear_forward_group(qkv, xn.data(), T, qkv_out);
    lap.mark(forward_op::qkv);
    be.rope(q.data(), pos.data(), T, H, D, inv_freq, false);
    be.rope(k.data(), pos.data(), T, KV, D, inv_freq, false);
    lap.mark(forward_op::rope);
    const int64_t sat = be.kv_cache_write(cache, i, st, k.data(), v.data(), fp8kv ? a.k.data() + i * KV : nullptr,
                                           fp8kv ? a.v.data() + i * KV : nullptr);
    if (saturated) saturated->kv.at(static_cast<size_t>(i)) += sat;
    lap.mark(forward_op::kv_write);
    const int64_t qsat =
        be.attention_cached(cache, i, st, q.data(), H, w.policy.attention, fp8q ? a.q.data() + i * H : nullptr, att.data());
    if (saturated) saturated->q.at(static_cast<size_t>(i)) += qsat;
    lap.mark(forward_op::attention);
    be.linear_forward(*lw.o, att.data(), T, tmp.data());
    lap.mark(forward_op::o_proj);
    be.add_inplace(x.data(), tmp.data(), T * C);
    lap.mark(forward_op::residual);
    be.rmsnorm_forward(x.data(), lw.mlp_norm.data(), T, C, eps, xn.data(), rstd.data());
    lap.mark(forward_op::norm);
    const prepared_linear* gate_up[] = {lw.gate.get(), lw.up.get()};
    float* gate_up_out[] = {gate.data(), up.data()};
    be.linear_forward_group(gate_up, xn.data(), T, gate_up_out);
    lap.mark(forward_op::gate_up);
    be.swiglu_forward(gate.data(), up.data(), T * F, gate.data());
    lap.mark(forward_op::swiglu);
    be.linear_forward(*lw.down, gate.data(), T, tmp.data());
    lap.mark(forward_op::down);
    be.add_inplace(x.data(), tmp.data(), T * C);
    lap.mark(forward_op::residual);
  }
  be.rmsnorm_forward(x.data(), w.final_norm.data(), T, C, eps, xn.data(), rstd.data());
  lap.mark(forward_op::norm);
  for (int64_t r = 0; r < R; ++r) be.copy(xr.data() + r * C, xn.data() + rows[r] * C, C);
  be.linear_forward(*w.lm_head, xr.data(), R, lg.data());
  lap.mark(forward_op::lm_head);
  logits.resize(static_cast<size_t>(R * c.vocab_size));
  be.to_host(logits.data(), lg.data(), logits.size() * 4);
}

// The slots' unfed tokens packed into one forward (prefill and decode rows alike).
struct generation_engine::step_batch {
  std::vector<int32_t> tokens, slot_of, pos;  // [T]: token, its slot, its position
  std::vector<int64_t> rows;                  // [R]: each active slot's last packed token (its logits row)
  std::vector<int64_t> fed_before;            // [R]: the slot's fed count before this step
  std::vector<size_t> active;                 // [R]: the slot index
};

void generation_engine::adopt_pending() {
  {
    std::lock_guard<std::mutex> g(adopt_mu_);
    if (!pending_) return;
    current_ = std::move(pending_);
    pending_.reset();
  }
  ++stats_.adoptions;
  if (ec_.on_adopt == kv_adopt_policy::recompute)
    for (auto& s : slots_)
      if (s && s->fed > 0) {
        stats_.recomputed_tokens += s->fed;
        s->fed = 0;
      }
}

void generation_engine::admit_waiting() {
  for (auto& s : slots_) {
    if (s || waiting_.empty()) continue;
    s = std::make_unique<slot>();
    s->req = std::move(waiting_.front());
    waiting_.pop_front();
    s->ctx = s->req.prompt;
    s->pos_version.assign(static_cast<size_t>(ec_.max_context), {0, 0});
    s->res.id = s->req.id;
    s->res.prompt = s->req.prompt;
    s->res.kv_policy = ec_.on_adopt;
  }
}

// Marks every packed position fed, written under the current versions (sample_rows' caller
// restores fed_before when the step fails).
generation_engine::step_batch generation_engine::pack_step() {
  step_batch b;
  for (size_t i = 0; i < slots_.size(); ++i) {
    slot* s = slots_[i].get();
    if (!s) continue;
    b.active.push_back(i);
    b.fed_before.push_back(s->fed);
    const int64_t n = static_cast<int64_t>(s->ctx.size());
    for (int64_t p = s->fed; p < n; ++p) {
      b.tokens.push_back(s->ctx[p]);
      b.slot_of.push_back(static_cast<int32_t>(i));
      b.pos.push_back(static_cast<int32_t>(p));
      s->pos_version[p] = {current_->weight_version, current_->scale_version};
    }
    if (s->fed == 0) stats_.prefill_tokens += n; else stats_.decode_tokens += n - s->fed;
    s->fed = n;
    b.rows.push_back(static_cast<int64_t>(b.tokens.size()) - 1);
  }
  return b;
}

// The forward of the packed tokens and each row's sample (seeded by request, seed and token
// index); saturation counted once the whole step holds. Throws with no stats changed.
std::vector<generation_engine::sampled> generation_engine::sample_rows(const step_batch& b) {
  std::vector<sampled> out(b.active.size());
  fp8_saturation saturated(cfg_.num_hidden_layers);  // counted once the step holds (a retry wrote them again)
  std::vector<float> logits;                         // [R, V]
  try {
    forward_chunked(b.tokens, b.slot_of, b.pos, b.rows, logits, saturated);
  } catch (const slot_error& e) {  // a K/V or query refused names its slot: say whose request it holds
    const auto& s = slots_.at(static_cast<size_t>(e.slot));
    throw std::runtime_error(std::string(e.what()) + (s ? " (request " + std::to_string(s->req.id) + ")" : std::string()));
  }
  const int64_t V = cfg_.vocab_size;
  std::vector<float> z(static_cast<size_t>(V));  // [V] processed logits of one row
  std::vector<int32_t> work;
  for (size_t r = 0; r < b.active.size(); ++r) {
    const slot& s = *slots_[b.active[r]];
    const float* lg = logits.data() + r * V;
    const size_t index = s.res.tokens.size();
    double lse;
    try {
      lse = logits_process(lg, V, s.req.proc, z.data(), work);
    } catch (const std::invalid_argument& e) {  // diverged: the step is lost, drain() gives the requests back
      throw std::runtime_error("request " + std::to_string(s.req.id) + ", generated token " + std::to_string(index) + ": " +
                               e.what());
    }
    if (s.req.proc.temperature == 0.0f) {
      // greedy: the argmax of the raw logits (kept by any top-k/top-p); its logprob under the
      // request's processing at temperature 1, which is what the learner computes for it
      out[r].tok = argmax_logits(lg, V);
    } else {
      rng g(s.req.seed * 0x9e3779b97f4a7c15ull ^ (s.req.id + 1) * 0xc2b2ae3d27d4eb4full ^ (index + 1) * 0x165667b19e3779f9ull);
      out[r].tok = sample_processed(z.data(), V, lse, g.uniform());
    }
    out[r].lp = static_cast<float>(z[out[r].tok] - lse);
  }
  ++stats_.steps;
  for (size_t l = 0; l < saturated.kv.size(); ++l) {
    stats_.kv_saturated[l] += saturated.kv[l];
    stats_.q_saturated[l] += saturated.q[l];
  }
  return out;
}

// Each row's token appended with its logprob and versions; finished requests leave their slots.
std::vector<gen_result> generation_engine::commit_tokens(const step_batch& b, const std::vector<sampled>& out) {
  std::vector<gen_result> done;
  for (size_t r = 0; r < b.active.size(); ++r) {
    auto& sp = slots_[b.active[r]];
    slot& s = *sp;
    const int32_t tok = out[r].tok;
    const auto oldest = *std::min_element(s.pos_version.begin(), s.pos_version.begin() + s.fed);  // both rise (install)
    s.res.tokens.push_back(tok);
    s.res.logprobs.push_back(out[r].lp);
    s.res.weight_version.push_back(current_->weight_version);
    s.res.scale_version.push_back(current_->scale_version);
    s.res.oldest_kv_version.push_back(oldest.first);
    s.res.oldest_kv_scale_version.push_back(oldest.second);
    s.ctx.push_back(tok);
    const bool stop = std::find(s.req.stop_tokens.begin(), s.req.stop_tokens.end(), tok) != s.req.stop_tokens.end();
    const bool full = static_cast<int64_t>(s.res.tokens.size()) >= s.req.max_tokens ||
                      static_cast<int64_t>(s.ctx.size()) >= ec_.max_context;
    if (stop || full) {
      s.res.finish = stop ? "stop" : "length";
      live_ids_.erase(s.res.id);
      done.push_back(std::move(s.res));
      sp.reset();
    }
  }
  return done;
}

std::vector<gen_result> generation_engine::step() {
  adopt_pending();
  if (!current_) throw std::logic_error("generation engine: no weights adopted");
  admit_waiting();
  const step_batch b = pack_step();
  if (b.active.empty()) return {};
  // The step either happens for every slot or for none: a throw (non-finite logits, a K/V write
  // refused) used to leave slots fed past what the cache holds (the next step read row -1) and
  // dropped results finished earlier in the same step. Sampling first, then the slots change.
  std::vector<sampled> out;
  try {
    out = sample_rows(b);
  } catch (...) {
    for (size_t r = 0; r < b.active.size(); ++r) slots_[b.active[r]]->fed = b.fed_before[r];  // fed again by a retry
    throw;
  }
  return commit_tokens(b, out);
}

std::vector<gen_result> generation_engine::run_to_completion() {
  std::vector<gen_result> all;
  while (!idle()) {
    auto d = step();
    for (auto& r : d) all.push_back(std::move(r));
  }
  std::sort(all.begin(), all.end(), [](const gen_result& a, const gen_result& b) { return a.id < b.id; });
  return all;
}

}  // namespace fp8rl::models
