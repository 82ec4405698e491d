// actors/reward_buffer.cpp -- the reward actor (verifier -> rewards, group advantages) and the
// trajectory buffer (admission by max_staleness, de-duplication, per-learner batch shards).
#include <map>
#include <optional>
#include <vector>

#include "actors/actors.hpp"
#include "actors/trace.hpp"
#include "models/log.hpp"

namespace fp8rl::actors {
namespace {

// Reward and buffer get their peers from the controller and their groups from other senders (CAF
// orders one sender's messages only): what they would send before the first peers_msg waits in
// `unsent` (a send to the unset handle was dropped in silence).
struct reward_state {
  std::shared_ptr<const actor_env> env;
  msg::peers_msg peers;
  std::vector<msg::group_msg> unsent;  // scored before the peers came
};

struct pending_batch {
  caf::typed_response_promise<msg::batch_msg> rp;
  int32_t rank = 0, world = 1;
};

struct buffer_state {
  std::shared_ptr<const actor_env> env;
  std::string policy;  // the run's generation policy fingerprint: every group's must be it
  msg::peers_msg peers;
  uint64_t learner_version = 0;
  std::map<uint64_t, std::map<uint64_t, msg::group_msg>> steps;  // step -> prompt_id -> group
  std::map<uint64_t, std::vector<pending_batch>> waiting;        // step -> learners waiting
  int64_t admitted = 0, dropped_stale = 0, dropped_dup = 0;
  std::vector<int64_t> kv_saturated;  // per layer, over every group received (FP8 KV caches)
  std::vector<int64_t> q_saturated;   // per layer, likewise (FP8 queries)
  uint64_t next_step = 0;              // the first step no learner was given yet
  std::optional<uint64_t> stop_at;     // set by a stop: steps from here on are answered `stop`
  std::vector<msg::admitted_msg> unsent;  // admissions before the peers came
};

// The answer to a shard request of `step` once the run stops there: no samples, `stop` set.
msg::batch_msg stop_batch(uint64_t step) {
  msg::batch_msg b;
  b.step = step;
  b.stop = true;
  trace_send_step("buffer", "batch_msg", b.trace, step);
  return b;
}

// total[l] += add[l], growing total to add's layers.
void add_per_layer(std::vector<int64_t>& total, const std::vector<int64_t>& add) {
  if (total.size() < add.size()) total.resize(add.size(), 0);
  for (size_t l = 0; l < add.size(); ++l) total[l] += add[l];
}
// metrics[name/layer<l>] and metrics[name] (their sum), where there are counts.
void metrics_per_layer(std::map<std::string, double>& m, const std::string& name, const std::vector<int64_t>& v) {
  if (v.empty()) return;
  int64_t all = 0;
  for (size_t l = 0; l < v.size(); ++l) {
    m[name + "/layer" + std::to_string(l)] = double(v[l]);
    all += v[l];
  }
  m[name] = double(all);
}

// Oldest weight version any token of the group was sampled under.
uint64_t oldest_version(const msg::group_msg& g) {
  uint64_t v = UINT64_MAX;
  for (const auto& s : g.samples)
    for (uint64_t x : s.weight_version) v = std::min(v, x);
  return v == UINT64_MAX ? 0 : v;
}

}  // namespace

msg::reward_actor spawn_reward(caf::actor_system& sys, std::shared_ptr<const actor_env> env) {
  using self_t = msg::reward_actor::stateful_pointer<reward_state>;
  return sys.spawn([](self_t self, std::shared_ptr<const actor_env> env) -> msg::reward_actor::behavior_type {
    actor_failures_named(self, "the reward actor");
    self->state.env = env;
    return {
        [self](msg::peers_msg& p) {
          auto& s = self->state;
          trace_recv("reward", "peers_msg", p.trace);
          s.peers = std::move(p);
          for (auto& g : s.unsent) {
            trace_send_group("reward", g);
            self->send(s.peers.buffer, std::move(g));
          }
          s.unsent.clear();
        },
        [self](msg::group_msg& g) {
          auto& s = self->state;
          trace_recv_group("reward", g);
          trace_span span("reward", "score", -1, double(g.samples.size()));
          models::group_score(g.samples, g.answer, *s.env->tok, s.env->stops, s.env->rl.verifier, s.env->rl.grpo);
          if (!s.peers.buffer) return s.unsent.push_back(std::move(g));
          trace_send_group("reward", g);
          self->send(s.peers.buffer, std::move(g));
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

msg::buffer_actor spawn_buffer(caf::actor_system& sys, std::shared_ptr<const actor_env> env) {
  using self_t = msg::buffer_actor::stateful_pointer<buffer_state>;
  return sys.spawn([](self_t self, std::shared_ptr<const actor_env> env) -> msg::buffer_actor::behavior_type {
    actor_failures_named(self, "the trajectory buffer");
    self->state.env = env;
    self->state.policy = env->rl.gen_policy.fingerprint();
    self->state.next_step = env->start_version;
    auto log = log_get("buffer");
    auto tell_controller = [self](msg::admitted_msg a) {
      if (!self->state.peers.controller) return self->state.unsent.push_back(std::move(a));
      trace_send_step("buffer", "admitted_msg", a.trace, a.step);
      self->send(self->state.peers.controller, std::move(a));
    };
    // Delivers step `step` to its waiting learners once all its groups are in and fresh.
    auto try_deliver = [self, log, tell_controller](uint64_t step) {
      auto& s = self->state;
      auto wt = s.waiting.find(step);
      // every learner rank takes its shard of the same batch: wait until all of them asked
      if (wt == s.waiting.end() || wt->second.empty() || static_cast<int32_t>(wt->second.size()) < wt->second.front().world) return;
      if (s.stop_at && step >= *s.stop_at) return;  // answered `stop` already
      auto& groups = s.steps[step];
      const int64_t need = s.env->cfg.prompts_per_step;
      // drop groups that became too stale for this learner version; the controller re-issues them
      for (auto it = groups.begin(); it != groups.end();) {
        const uint64_t v = oldest_version(it->second);
        if (s.learner_version > v && s.learner_version - v > static_cast<uint64_t>(s.env->cfg.max_staleness)) {
          ++s.dropped_stale;
          tell_controller(msg::admitted_msg{{}, step, it->first, true, "stale: weight_version " + std::to_string(v)});
          it = groups.erase(it);
        } else {
          ++it;
        }
      }
      if (static_cast<int64_t>(groups.size()) < need) return;
      double n = 0;
      for (const auto& [pid, g] : groups)
        for (const auto& x : g.samples) n += double(x.response.size());
      for (auto& pb : wt->second) {
        msg::batch_msg b;
        b.step = step;
        b.n_global = n;
        int64_t i = 0, offset = 0;
        for (const auto& [pid, g] : groups) {
          const bool mine = i++ % pb.world == pb.rank;
          for (const auto& x : g.samples) {
            if (pb.world > 1 && pb.rank == 0) b.all_samples.push_back(x);
            if (mine) {
              b.samples.push_back(x);
              if (pb.world > 1) b.offsets.push_back(offset);
            }
            offset += static_cast<int64_t>(x.response.size());
          }
        }
        b.buffer_metrics = {{"buffer/admitted_total", double(s.admitted)}, {"buffer/dropped_stale_total", double(s.dropped_stale)},
                            {"buffer/dropped_duplicate_total", double(s.dropped_dup)}};
        metrics_per_layer(b.buffer_metrics, "kv_saturated_total", s.kv_saturated);  // rl-algorithm.md: per-layer K/V saturation counts
        metrics_per_layer(b.buffer_metrics, "q_saturated_total", s.q_saturated);
        trace_send_step("buffer", "batch_msg", b.trace, step);
        pb.rp.deliver(std::move(b));
      }
      s.next_step = std::max(s.next_step, step + 1);
      s.waiting.erase(wt);
      s.steps.erase(step);
    };
    return {
        [self, tell_controller](msg::peers_msg& p) {
          auto& s = self->state;
          trace_recv("buffer", "peers_msg", p.trace);
          s.peers = std::move(p);
          auto unsent = std::move(s.unsent);
          s.unsent.clear();
          for (auto& a : unsent) tell_controller(std::move(a));
        },
        [self, try_deliver, tell_controller](msg::group_msg& g) {
          auto& s = self->state;
          trace_recv_group("buffer", g);
          // one policy for both sides (rl-algorithm.md section 10): a group sampled under another
          // (a node started with other settings) is refused, the run ended with both named
          if (g.policy != s.policy)
            return actor_fail(self, "the trajectory buffer",
                              "group (step " + std::to_string(g.step) + ", prompt " + std::to_string(g.prompt_id) + ") from " +
                                  g.rollout + " was sampled under precision policy '" + g.policy +
                                  "'; this run generates under '" + s.policy + "'");
          add_per_layer(s.kv_saturated, g.kv_saturated);  // duplicates too: work done
          add_per_layer(s.q_saturated, g.q_saturated);
          // re-issued work finished twice: its step went to the learners already (steps go out in
          // order, next_step the first not yet), or the group is here
          if (g.step < s.next_step || s.steps[g.step].count(g.prompt_id)) {
            ++s.dropped_dup;
            tell_controller(msg::admitted_msg{{}, g.step, g.prompt_id, true, "duplicate"});
            return;
          }
          ++s.admitted;
          const uint64_t step = g.step, pid = g.prompt_id;
          s.steps[step].emplace(pid, std::move(g));
          tell_controller(msg::admitted_msg{{}, step, pid, false, ""});
          try_deliver(step);
        },
        [self, try_deliver](msg::batch_atom, uint64_t step, int32_t rank, int32_t world, uint64_t learner_version) {
          auto& s = self->state;
          auto rp = self->make_response_promise<msg::batch_msg>();
          // a shard request the step cannot be cut into (world 0 divided by zero; a rank twice or
          // outside the world delivered the step with one shard's samples nobody's) is refused
          auto shard = [](int32_t r, int32_t w) { return "rank " + std::to_string(r) + " of world " + std::to_string(w); };
          std::string bad = world <= 0 || rank < 0 || rank >= world ? shard(rank, world) : "";
          if (auto it = s.waiting.find(step); bad.empty() && it != s.waiting.end())
            for (const auto& w : it->second)
              if (w.world != world || w.rank == rank) {
                bad = shard(rank, world) + " after " + shard(w.rank, w.world);
                break;
              }
          if (!bad.empty()) {
            rp.deliver(caf::make_error(caf::sec::invalid_argument, "trajectory buffer: step " + std::to_string(step) +
                                                                        " requested by " + bad));
            return rp;
          }
          if (s.stop_at && step >= *s.stop_at) {
            rp.deliver(stop_batch(step));
            return rp;
          }
          if (step != s.next_step) {  // every rank trains every step in turn: another step waited 30 minutes
            rp.deliver(caf::make_error(caf::sec::invalid_argument, "trajectory buffer: step " + std::to_string(step) + " requested by " +
                                                                        shard(rank, world) + ", the next step is " +
                                                                        std::to_string(s.next_step)));
            return rp;
          }
          // a refused request's version counts for nothing (a bogus one made every later group stale)
          s.learner_version = std::max(s.learner_version, learner_version);
          s.waiting[step].push_back({rp, rank, world});
          try_deliver(step);
          return rp;
        },
        // The run stops at the first step no rank was given: every rank trains up to it (those still
        // in the step before finish it), then each is answered `stop` at that same version.
        [self](msg::stop_atom) -> uint64_t {
          auto& s = self->state;
          if (!s.stop_at) s.stop_at = s.next_step;
          for (auto it = s.waiting.lower_bound(*s.stop_at); it != s.waiting.end(); it = s.waiting.erase(it))
            for (auto& pb : it->second) pb.rp.deliver(stop_batch(it->first));
          return *s.stop_at;
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

}  // namespace fp8rl::actors
