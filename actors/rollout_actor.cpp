// actors/rollout_actor.cpp -- a rollout actor: one generation engine on one device.
// It samples prompt groups with the newest adopted bundle; a bundle arriving while the engine
// runs is adopted between two engine steps (each step is one message to itself, so the mailbox
// orders adoption and decoding); every token carries (weight_version, scale_version).
#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <numeric>
#include <optional>

#include "actors/actors.hpp"
#include "actors/trace.hpp"
#include "models/log.hpp"

namespace fp8rl::actors {
namespace {

// Supervision tests: with FP8RL_FAULT_ROLLOUT_EXIT_AT_STEP=S in the environment, rollout0 of
// the process exits abnormally (once per process) when work of step S reaches it.
// A value that is not a step number is refused (it fired at step 0).
bool fault_exit_now(const std::string& name, uint64_t step) {
  static std::atomic<bool> fired{false};
  if (name != "rollout0") return false;
  static const auto at = fault_env_number("FP8RL_FAULT_ROLLOUT_EXIT_AT_STEP");  // read once (a refusal: at each call)
  return at && *at == step && !fired.exchange(true);
}

// Per-layer counts grown since `sent` (then `sent` = total).
std::vector<int64_t> since_sent(const std::vector<int64_t>& total, std::vector<int64_t>& sent) {
  std::vector<int64_t> d(total.size());
  sent.resize(total.size(), 0);
  for (size_t l = 0; l < total.size(); ++l) d[l] = total[l] - sent[l];
  sent = total;
  return d;
}

struct rollout_state {
  std::shared_ptr<const actor_env> env;
  std::string name;
  std::unique_ptr<models::backend> be;
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<models::generation_engine> eng;
  msg::peers_msg peers;
  std::map<uint64_t, msg::work_msg> work;                 // prompt_id -> group being generated
  std::map<uint64_t, std::vector<models::gen_result>> done;  // prompt_id -> finished completions
  bool step_scheduled = false;
  std::vector<uint8_t> chunks;                            // cross-process bundle being received
  uint64_t chunk_version = 0;
  int64_t tokens = 0, groups = 0;
  std::vector<int64_t> kv_sat_sent, q_sat_sent;           // engine's per-layer FP8 saturations already sent
  std::vector<msg::adopted_msg> unsent;                   // adoptions before the first peers_msg
  std::optional<msg::adopted_msg> staged;                 // in the engine, no step has run under it yet
};

}  // namespace

msg::rollout_actor spawn_rollout(caf::actor_system& sys, std::shared_ptr<const actor_env> env, std::string name,
                                 device_spec dev) {
  using self_t = msg::rollout_actor::stateful_pointer<rollout_state>;
  return sys.spawn([name, dev](self_t self, std::shared_ptr<const actor_env> env) -> msg::rollout_actor::behavior_type {
    actor_failures_named(self, name);
    auto& st = self->state;
    st.env = env;
    st.name = name;
    st.be = backend_for(dev);
    st.arena = arena_for(dev);
    st.eng = std::make_unique<models::generation_engine>(*st.be, env->model, recipe_engine_config(env->cfg));
    auto log = log_get("rollout");
    auto schedule = [self] {
      auto& s = self->state;
      if (!s.step_scheduled && s.eng->has_weights() && !s.eng->idle()) {
        s.step_scheduled = true;
        self->send(self, msg::step_atom::value);
      }
    };
    // An engine error is the run's error, named (an exception here was CAF's "unhandled
    // exception": the controller re-queued the same work onto the other rollouts until none
    // was left, and the cause only reached stderr).
    auto fatal = [self](const std::string& what) { actor_fail(self, self->state.name, what); };
    // A restarted rollout can get its weights before its peers_msg (weight-sync hears of it
    // first): a send to the unset handle would be dropped, and that version never reported.
    auto send_adopted = [self](msg::adopted_msg a) {
      auto& s = self->state;
      trace_send(s.name, "adopted_msg", a.trace, static_cast<int64_t>(a.weight_version), 0, static_cast<int64_t>(a.scale_version));
      self->send(s.peers.weight_sync, std::move(a));
    };
    auto tell_weight_sync = [self, send_adopted](msg::adopted_msg a) {
      if (self->state.peers.weight_sync) send_adopted(std::move(a));
      else self->state.unsent.push_back(std::move(a));
    };
    // The staged bundle is reported adopted once the engine runs under it (after the step that
    // took it); reporting at staging counted a bundle replaced before the next step as adopted,
    // and timed the adoption without the step in flight or a `recompute` re-prefill.
    auto report_taken = [self, tell_weight_sync] {
      auto& s = self->state;
      if (s.staged && s.eng->weight_version() == s.staged->weight_version && s.eng->scale_version() == s.staged->scale_version) {
        tell_weight_sync(std::move(*s.staged));
        s.staged.reset();
      }
    };
    auto adopt = [self, schedule, fatal, log, tell_weight_sync, report_taken](std::shared_ptr<const quant::weight_bundle> b) {
      auto& s = self->state;
      trace_span span(s.name, "adopt", static_cast<int64_t>(b->weight_version), static_cast<double>(b->bytes()),
                      static_cast<int64_t>(b->snapshot.scale_version));
      log->debug("{} adopting v{}", s.name, b->weight_version);
      std::string err;
      s.arena->execute([&] { err = s.eng->adopt(b); });
      if (!err.empty()) {
        log->error("{}: refused bundle v{}: {}", s.name, b->weight_version, err);
        return tell_weight_sync(msg::adopted_msg{{}, s.name, b->weight_version, b->snapshot.scale_version, err});
      }
      if (s.staged) {  // replaced before any step ran under it
        s.staged->superseded = true;
        tell_weight_sync(std::move(*s.staged));
      }
      s.staged = msg::adopted_msg{{}, s.name, b->weight_version, b->snapshot.scale_version, ""};
      if (s.eng->idle()) {  // no sequence to finish a step for: the engine takes it now (a step over no slots)
        try {
          s.arena->execute([&] { s.eng->step(); });
        } catch (const std::exception& e) {
          return fatal(std::string("taking bundle v") + std::to_string(b->weight_version) + ": " + e.what());
        }
        report_taken();
      }
      schedule();
    };
    return {
        [self, send_adopted](msg::peers_msg& p) {
          auto& s = self->state;
          trace_recv(s.name, "peers_msg", p.trace);
          s.peers = std::move(p);
          for (auto& a : s.unsent) send_adopted(std::move(a));
          s.unsent.clear();
        },
        [self, schedule, fatal](msg::work_msg& w) {
          auto& s = self->state;
          if (fault_exit_now(s.name, w.step)) return self->quit(caf::make_error(caf::sec::runtime_error, "fault injection"));
          trace_recv_step(s.name, "work_msg", w.trace, w.step);
          // a re-issue (a stale drop) of a group this rollout is generating: submitting its
          // requests again made a group with duplicate indices
          if (s.work.count(w.prompt_id)) {
            log_get("rollout")->debug("{}: prompt {} is already being generated", s.name, w.prompt_id);
            return;
          }
          // completions find their prompt by id / the run's group size: work of another size would
          // be filed under other prompts (and scored against their answers)
          if (w.group_size != s.env->cfg.group_size)
            return fatal("prompt " + std::to_string(w.prompt_id) + ": work for groups of " + std::to_string(w.group_size) +
                         ", the run's rollout.group_size is " + std::to_string(s.env->cfg.group_size));
          try {
            for (auto& r : models::group_requests(s.env->tok->encode(w.prompt, true), w.prompt_id, w.group_size,
                                                  s.env->rl.proc, s.env->rl.max_new_tokens, w.seed, s.env->stops))
              s.eng->submit(std::move(r));
          } catch (const std::exception& e) {
            return fatal("prompt " + std::to_string(w.prompt_id) + ": " + e.what());
          }
          s.work[w.prompt_id] = std::move(w);
          schedule();
        },
        [self, adopt](msg::bundle_msg& b) {
          trace_recv_bundle(self->state.name, b);
          adopt(b.bundle);
        },
        [self, tell_weight_sync](msg::bundle_chunk& c) -> caf::result<msg::chunk_ack> {
          auto& s = self->state;
          trace_recv(s.name, "bundle_chunk", c.trace, static_cast<int64_t>(c.version), double(c.bytes.size()));
          if (c.seq >= c.total)  // total 0 would never assemble; acked, weight sync would count it delivered
            return caf::make_error(caf::sec::invalid_argument, s.name + ": bundle v" + std::to_string(c.version) + " chunk " +
                                                                   std::to_string(c.seq) + " of " + std::to_string(c.total));
          if (c.seq == 0) {  // a newer version's first chunk supersedes a partly received older one
            s.chunks = std::move(c.bytes);
            // every chunk but the last is full-size; a total off the wire is a hint, not an allocation size
            s.chunks.reserve(std::min<size_t>(s.chunks.size() * c.total, size_t{1} << 30));
            s.chunk_version = c.version;
          } else if (c.version == s.chunk_version) {
            s.chunks.insert(s.chunks.end(), c.bytes.begin(), c.bytes.end());
          } else {  // the rest of a superseded version: weight-sync stops sending it (it was acked
                    // as received, then dropped, and the version never reported)
            msg::chunk_ack ack{{}, c.version, c.seq, true};
            trace_send(s.name, "chunk_ack", ack.trace, static_cast<int64_t>(c.version));
            return ack;
          }
          auto rp = self->make_response_promise<msg::chunk_ack>();
          msg::chunk_ack ack{{}, c.version, c.seq, false};
          trace_send(s.name, "chunk_ack", ack.trace, static_cast<int64_t>(c.version));
          rp.deliver(std::move(ack));  // acked on receipt: the ack means "bytes here"
          if (c.seq + 1 == c.total && c.version == s.chunk_version) {
            msg::bundle_wire w;
            caf::binary_deserializer src(self->system(), s.chunks);
            std::shared_ptr<quant::weight_bundle> b;
            if (auto err = src(w)) {
              tell_weight_sync(msg::adopted_msg{{}, s.name, c.version, 0, "bundle does not deserialize: " + self->system().render(err)});
            } else {
              try {
                b = std::make_shared<quant::weight_bundle>(msg::bundle_from_wire(std::move(w)));
              } catch (const std::exception& e) {
                tell_weight_sync(msg::adopted_msg{{}, s.name, c.version, 0, e.what()});
              }
            }
            s.chunks.clear();
            s.chunks.shrink_to_fit();
            // adopt in a message of its own: adoption happens between two engine steps (traced:
            // the timeline links the last chunk to the adoption)
            if (b) {
              msg::bundle_msg m{{}, std::move(b)};
              trace_send_bundle(s.name, m);
              self->send(self, std::move(m));
            }
          }
          return rp;
        },
        [self, schedule, fatal, report_taken](msg::step_atom) {
          auto& s = self->state;
          s.step_scheduled = false;
          if (!s.eng->has_weights() || s.eng->idle()) return;
          std::vector<models::gen_result> fin;
          try {
            trace_span span(s.name, "decode_step");
            s.arena->execute([&] { fin = s.eng->step(); });
            // the versions the step ran under (it switches to a staged bundle before its forward)
            span.set_versions(static_cast<int64_t>(s.eng->weight_version()), static_cast<int64_t>(s.eng->scale_version()));
          } catch (const std::exception& e) {
            return fatal(std::string("decode step: ") + e.what());
          }
          report_taken();
          for (auto& r : fin) {
            const uint64_t pid = r.id / static_cast<uint64_t>(s.env->cfg.group_size);
            s.tokens += static_cast<int64_t>(r.tokens.size());
            auto& d = s.done[pid];
            d.push_back(std::move(r));
            auto it = s.work.find(pid);
            if (it == s.work.end() || static_cast<int32_t>(d.size()) < it->second.group_size) continue;
            msg::group_msg g;
            g.step = it->second.step;
            g.prompt_id = pid;
            g.answer = it->second.answer;
            g.rollout = s.name;
            const auto& pol = s.eng->config().policy;
            g.policy = pol.fingerprint();
            // FP8 K/V (and queries) saturated since this rollout's last group
            if (pol.kv == models::kv_dtype::fp8) g.kv_saturated = since_sent(s.eng->stats().kv_saturated, s.kv_sat_sent);
            if (pol.fp8_attention) g.q_saturated = since_sent(s.eng->stats().q_saturated, s.q_sat_sent);
            for (auto& x : d) g.samples.push_back(models::rl_sample_from_result(std::move(x), it->second.group_size));
            std::sort(g.samples.begin(), g.samples.end(), [](const auto& a, const auto& b) { return a.group_index < b.group_index; });
            ++s.groups;
            trace_send_group(s.name, g);
            self->send(s.peers.reward, std::move(g));
            s.done.erase(pid);
            s.work.erase(it);
          }
          schedule();
        },
        [self](msg::status_atom) -> msg::metrics_t {
          auto& s = self->state;
          const auto& es = s.eng->stats();
          return {{"tokens", double(s.tokens)}, {"groups", double(s.groups)}, {"weight_version", double(s.eng->weight_version())},
                  {"adoptions", double(es.adoptions)}, {"recomputed_tokens", double(es.recomputed_tokens)},
                  {"kv_saturated", double(std::accumulate(es.kv_saturated.begin(), es.kv_saturated.end(), int64_t{0}))},
                  {"q_saturated", double(std::accumulate(es.q_saturated.begin(), es.q_saturated.end(), int64_t{0}))}};
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

}  // namespace fp8rl::actors
