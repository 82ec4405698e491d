// actors/controller_actor.cpp -- the controller: work issue within the staleness window, metrics,
// progress, supervision, shutdown.
//
// Work for learner step s (prompt groups s*B .. s*B+B-1, sampling seed = seed + s) is issued
// once every live rollout has adopted weight_version >= s - max_staleness (weight-sync's
// sync_report), so its tokens cannot be too stale when the learner reaches step s. With
// max_staleness = 0 generation of step s starts only after step s-1 was trained and v = s is
// everywhere (the synchronous loop); with k > 0 rollouts run up to k steps ahead. Every group is tracked until the buffer admits it; a rollout that goes down
// (monitor; remote peers via middleman heartbeats) has its groups re-issued to live rollouts,
// and the buffer drops the duplicate if the lost one shows up after all. A lost rollout of the
// controller's own process is restarted (at most opts.max_restarts times per name; weight sync
// sends it the newest bundle); one in a lost process is not (the process is gone). A failure the
// learners outlive (the last rollout, the reward, calibration or weight-sync actor) fails the run
// through the stop path: learner0 checkpoints the step it is at first (fail_saved).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "actors/actors.hpp"
#include "actors/run_dir.hpp"
#include "actors/trace.hpp"
#include "models/log.hpp"
#include "models/rl/health.hpp"
#include "models/rl/staleness_hist.hpp"

namespace fp8rl::actors {
namespace {

struct controller_state {
  std::shared_ptr<const actor_env> env;
  controller_options opts;
  msg::peers_msg peers;
  std::vector<caf::actor> agents;
  std::vector<std::string> agent_nodes;  // agents[i] runs topology node agent_nodes[i]
  models::dataset train;
  metrics_writer metrics;
  uint64_t learner_version = 0, next_step = 0, end = 0;
  int64_t synced_version = -1;  // newest version every live rollout has adopted
  std::map<std::pair<uint64_t, uint64_t>, msg::work_msg> issued;  // until its step is trained
  size_t rr = 0;  // round-robin over live rollouts
  std::map<std::pair<uint64_t, uint64_t>, std::pair<std::string, msg::work_msg>> in_flight;
  std::map<std::string, int64_t> in_flight_n;  // groups in flight per rollout name
  // live rollouts without a group in flight, since when; idle rollout-seconds since the last line,
  // and the rollouts lost since then (they count in the line's mean)
  std::map<std::string, std::chrono::steady_clock::time_point> idle_since;
  double idle_s = 0;
  size_t idle_lost = 0;
  std::string failed;  // the first failure the learners outlived (fail_saved): the run exits 1
  // calibration reports not yet in a line, oldest first: one per line (two arriving within one
  // step overwrote each other, and a version's calibration record was lost)
  std::deque<std::map<std::string, double>> calib_pending;
  // weight-sync reports not yet in a line, oldest first: one per line (two arriving within one
  // step -- at a checkpoint, an eval -- overwrote each other, and a version's record was lost)
  std::deque<std::map<std::string, double>> sync_pending;
  int64_t reissued = 0, rollouts_lost = 0, rollouts_restarted = 0;
  std::map<std::string, int> restarts;  // per rollout name
  bool stopping = false;
  // a stop (a signal, `fp8rl train` or a node): no work from stop_step on, learner0 checkpoints it
  bool stop_asked = false;
  int32_t stop_code = 0;
  std::string stop_why;
  uint64_t stop_step = UINT64_MAX;
  bool shut_down = false;  // exits sent and on_done called: once, by finish or the exception handler
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double tokens = 0;
  std::optional<models::health_monitor> health;  // rl-algorithm.md section 7's gates
  std::set<std::string> health_warned;           // gates already warned about (health.gates = warn)
  std::string health_failed;                      // the first gate failed under health.gates = fail
};

// The staleness of a "staleness_hist/<versions>" metric; throws naming the key if it is not one.
double staleness_bucket(const std::string& key) {
  const auto d = models::staleness_hist_bin(key);
  if (!d) throw std::invalid_argument("step_report metric '" + key + "': not a staleness bucket (a version count)");
  return double(*d);
}

// The topology node of an actor on node n ("" for this process's own actors).
std::string node_of(const controller_state& s, const caf::node_id& own, const caf::node_id& n) {
  std::vector<caf::node_id> ids;
  for (const auto& a : s.agents) ids.push_back(a.node());
  return node_name_of(ids, s.agent_nodes, own, n);
}

// A lost actor other than a rollout, for the run's error: its role and, where a whole node is
// lost, every actor that went with it (the first down message named one: a learner node's loss
// read "the calibration actor went down").
std::string lost_actor_named(const controller_state& s, const caf::node_id& own, const caf::actor_addr& lost) {
  std::vector<std::pair<caf::actor_addr, std::string>> roles;
  for (size_t i = 0; i < s.peers.learners.size(); ++i) roles.emplace_back(s.peers.learners[i].address(), "learner" + std::to_string(i));
  roles.emplace_back(s.peers.buffer.address(), "the trajectory buffer");
  roles.emplace_back(s.peers.reward.address(), "the reward actor");
  roles.emplace_back(s.peers.weight_sync.address(), "the weight-sync actor");
  roles.emplace_back(s.peers.calibration.address(), "the calibration actor");
  std::string who = "an actor", with;
  for (const auto& [addr, name] : roles) {
    if (addr == lost) who = name;
    else if (addr && lost.node() != own && addr.node() == lost.node()) with += (with.empty() ? "" : ", ") + name;
  }
  const std::string node = node_of(s, own, lost.node());
  return who + (node.empty() ? "" : " (node '" + node + "'" + (with.empty() ? "" : ", which also runs " + with) + ")");
}

// Work in flight, with each rollout's count and idle time (no group in flight: waiting for the
// weights the staleness window needs, or for the run's end). In flight = issued until the buffer
// admits it (reward scoring included); a duplicate admitted while a re-issued copy is still being
// generated ends both (the copy is waste).
using clk = std::chrono::steady_clock;
// How long a failed run waits for its learners to stop, checkpointed (a step and a save of a large model)
constexpr std::chrono::seconds kFailedStopWait{600};
bool rollout_live(const controller_state& s, const std::string& name) {
  return std::find(s.peers.rollout_names.begin(), s.peers.rollout_names.end(), name) != s.peers.rollout_names.end();
}
// Rollout `name`'s idle time, if it was idle, counted up to `now` and ended.
void idle_end(controller_state& s, const std::string& name, clk::time_point now) {
  if (const auto i = s.idle_since.find(name); i != s.idle_since.end()) {
    s.idle_s += std::chrono::duration<double>(now - i->second).count();
    s.idle_since.erase(i);
  }
}
void in_flight_dec(controller_state& s, const std::string& name, clk::time_point now) {
  if (--s.in_flight_n[name] == 0 && rollout_live(s, name)) s.idle_since.emplace(name, now);
}
void in_flight_put(controller_state& s, std::pair<uint64_t, uint64_t> key, const std::string& name, const msg::work_msg& w) {
  const auto now = clk::now();
  auto [it, fresh] = s.in_flight.try_emplace(key);
  if (!fresh) in_flight_dec(s, it->second.first, now);  // re-issued: the earlier rollout owes it no more
  it->second = {name, w};
  if (s.in_flight_n[name]++ == 0) idle_end(s, name, now);
}
// Erases in-flight entry `it`; the next one.
auto in_flight_erase(controller_state& s, decltype(controller_state::in_flight)::iterator it, clk::time_point now) {
  in_flight_dec(s, it->second.first, now);
  return s.in_flight.erase(it);
}
template <class Pred>
void in_flight_erase_if(controller_state& s, Pred pred, clk::time_point now) {
  for (auto it = s.in_flight.begin(); it != s.in_flight.end();) it = pred(*it) ? in_flight_erase(s, it, now) : std::next(it);
}
// Every live rollout without work idle from now (the wiring: none has any yet).
void idle_start(controller_state& s) {
  const auto now = clk::now();
  for (const auto& name : s.peers.rollout_names)
    if (s.in_flight_n[name] == 0) s.idle_since.emplace(name, now);
}
// A rollout no longer live: its idle time so far counted, and it in the next line's mean.
void idle_gone(controller_state& s, const std::string& name) {
  idle_end(s, name, clk::now());
  ++s.idle_lost;
}

// The controller's part of a step's metrics line: the calibration and sync reports not yet
// written (each once, in the next line, with the version it is of: kept until then they were
// repeated in every later line as if that step's), work in flight and lost, throughput.
void step_metrics_add(controller_state& s, msg::step_report& r, clk::time_point now) {
  const double elapsed_s = std::chrono::duration<double>(now - s.t0).count();
  for (auto* pending : {&s.calib_pending, &s.sync_pending})
    if (!pending->empty()) {
      for (const auto& [k, v] : pending->front()) r.metrics.emplace(k, v);
      pending->pop_front();
    }
  r.metrics["in_flight_groups"] = double(s.in_flight.size());
  // generation's wait: mean seconds a rollout had no group in flight since the previous line
  // (brief: generation never waits for training; max_staleness 0 waits the whole learner step)
  for (auto& [name, since] : s.idle_since) s.idle_s += std::chrono::duration<double>(now - std::exchange(since, now)).count();
  const size_t n = s.peers.rollout_names.size() + s.idle_lost;
  r.metrics["rollout_idle_s"] = n ? s.idle_s / double(n) : 0.0;
  s.idle_s = 0;
  s.idle_lost = 0;
  r.metrics["reissued_groups_total"] = double(s.reissued);
  r.metrics["rollouts_lost_total"] = double(s.rollouts_lost);
  r.metrics["rollouts_restarted_total"] = double(s.rollouts_restarted);
  r.metrics["rollouts_live"] = double(s.peers.rollouts.size());
  s.tokens += r.metrics.count("tokens") ? r.metrics["tokens"] : 0.0;
  r.metrics["elapsed_s"] = elapsed_s;
  r.metrics["samples_per_s"] =
      double((r.version - s.env->start_version) * s.env->cfg.prompts_per_step * s.env->cfg.group_size) / elapsed_s;
}

// Section 7's gates on a step: under health.gates = fail, the first gate failed ("" if none);
// under warn each failed gate is logged once.
std::string health_judge(controller_state& s, const msg::step_report& r) {
  std::string stop;
  for (const auto& f : s.health->add(r.version, r.metrics)) {
    if (s.health->config().mode == models::health_mode::fail) {
      if (stop.empty()) stop = f.text;
    } else if (s.health_warned.insert(f.gate).second) {
      log_get("controller")->warn("health gate (rl-algorithm.md section 7): {}", f.text);
    }
  }
  return stop;
}

// At a run's end: what the gates judged and their verdict (a failure under fail was said when it
// stopped the run), or that too few steps were counted.
void health_verdict_log(const controller_state& s) {
  const auto& h = s.health->config();
  const auto log = log_get("controller");
  if (h.mode == models::health_mode::off) return;
  if (s.health->counted() < static_cast<size_t>(h.min_steps))
    return log->info("health gates not judged: {} of health.min_steps {} steps {}", s.health->counted(), h.min_steps,
                     h.source == models::health_source::audit
                         ? "had audited tokens (audit.every; a trajectory on a KV cache kept across an adoption is "
                           "skipped, audit/skipped_kept_kv)"
                         : "had tokens sampled under the weights being trained (only those measure the precision mismatch "
                           "alone; asynchronous runs have few: health.source=audit with audit.every=1 judges every step)");
  if (s.health_failed.empty() && s.health_warned.empty()) log->info("health gates passed ({})", s.health->summary());
  else if (!s.health_warned.empty()) log->warn("health gates failed (health.gates=warn, said above): {}", s.health->summary());
}

// A step's progress line on stderr (reward, accuracy, staleness, token_mult_prob_error, ETA).
void progress_print(const controller_state& s, msg::step_report& r, double elapsed_s) {
  double stale = 0, cnt = 0;
  for (const auto& [k, v] : r.metrics)
    if (k.rfind(models::kStalenessHistPrefix, 0) == 0) {
      stale += staleness_bucket(k) * v;
      cnt += v;
    }
  const double done = double(r.version - s.env->start_version), left = double(s.end - r.version);
  std::string val = r.metrics.count("val_accuracy") ? "  val_acc " + std::to_string(r.metrics["val_accuracy"]).substr(0, 5) : "";
  std::fprintf(stderr, "step %4lu/%lu  reward %.3f  acc %.3f%s  staleness %.2f  tmpe %.4f  tok/s %.0f  ETA %.0fs\n",
               static_cast<unsigned long>(r.version), static_cast<unsigned long>(s.end), r.metrics["reward_mean"],
               r.metrics["accuracy"], val.c_str(), cnt > 0 ? stale / cnt : 0.0, r.metrics["token_mult_prob_error"],
               s.tokens / elapsed_s, done > 0 ? elapsed_s / done * left : 0.0);
}

}  // namespace

std::string node_actors_problem(const node_spec& n, const msg::node_actors& x, int32_t first_rollout) {
  std::string why;
  auto check = [&](const char* role, bool has) {
    if (has != n.has(role)) why.append(why.empty() ? "" : "; ").append(role).append(has ? " not in its topology entry" : " missing");
  };
  check("buffer", bool(x.buffer));
  check("reward", bool(x.reward));
  check("weight_sync", bool(x.weight_sync));
  check("calibration", bool(x.calibration));
  if (x.learners.size() != n.learners.size() || x.rollouts.size() != n.rollouts.size() ||
      x.rollout_names.size() != x.rollouts.size())
    why.append(why.empty() ? "" : "; ").append(std::to_string(x.learners.size()) + " learners and " +
                                               std::to_string(x.rollouts.size()) + " rollouts, its topology entry has " +
                                               std::to_string(n.learners.size()) + " and " + std::to_string(n.rollouts.size()));
  if (!why.empty()) return why;
  for (const auto& l : x.learners)
    if (!l) return "an invalid learner handle";
  for (size_t i = 0; i < x.rollouts.size(); ++i) {
    const std::string want = rollout_name(first_rollout + static_cast<int64_t>(i));
    if (!x.rollouts[i]) return "an invalid handle for " + want;
    if (x.rollout_names[i] != want) return "rollout '" + x.rollout_names[i] + "' where " + want + " belongs";
  }
  return "";
}

std::string node_name_of(const std::vector<caf::node_id>& agent_ids, const std::vector<std::string>& agent_nodes,
                         const caf::node_id& own, const caf::node_id& n) {
  if (n == own) return "";
  for (size_t i = 0; i < agent_ids.size() && i < agent_nodes.size(); ++i)
    if (agent_ids[i] == n) return agent_nodes[i];
  return "another process";
}

std::vector<caf::actor> node_actors_all(const msg::node_actors& x) {
  std::vector<caf::actor> v;
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(x.buffer), caf::actor_cast<caf::actor>(x.reward),
                              caf::actor_cast<caf::actor>(x.weight_sync), caf::actor_cast<caf::actor>(x.calibration)})
    if (a) v.push_back(a);
  for (const auto& l : x.learners) v.push_back(caf::actor_cast<caf::actor>(l));
  for (const auto& r : x.rollouts) v.push_back(caf::actor_cast<caf::actor>(r));
  return v;
}

msg::controller_actor spawn_controller(caf::actor_system& sys, std::shared_ptr<const actor_env> env, controller_options opts) {
  using self_t = msg::controller_actor::stateful_pointer<controller_state>;
  return sys.spawn([opts](self_t self, std::shared_ptr<const actor_env> env) -> msg::controller_actor::behavior_type {
    auto& st = self->state;
    st.env = env;
    st.opts = opts;
    auto log = log_get("controller");
    auto all_actors = [self] { return node_actors_all(self->state.peers); };
    auto shut_down = [self, all_actors](int code) {  // every actor and node agent stopped, the code reported
      auto& s = self->state;
      if (s.shut_down) return;
      s.shut_down = true;
      for (auto& a : all_actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
      for (auto& a : s.agents) self->send(caf::actor_cast<msg::node_agent_actor>(a), msg::stop_atom::value);
      if (s.opts.on_done) s.opts.on_done(code);
    };
    // An exception in a handler fails the run, named, instead of leaving the process waiting on a
    // controller that is gone (on_done was called only by finish, and the other actors ran on).
    self->set_exception_handler([self, shut_down, log](caf::scheduled_actor*, std::exception_ptr& e) {
      caf::error err = actor_exception_error("controller", e);
      self->state.stopping = true;
      log->error("run failed: {}", self->system().render(err));
      shut_down(1);
      return err;
    });
    // what can throw comes after the handler: a throw from here on was CAF's "unhandled exception"
    // and the process waited for good (a metrics row it could not read back, a task file)
    st.learner_version = env->start_version;
    st.next_step = env->start_version;
    st.end = static_cast<uint64_t>(env->cfg.steps);
    st.train = models::task_load(models::task_spec_parse(env->cfg.task), false, env->cfg.train_size,
                                 static_cast<uint64_t>(env->cfg.seed));
    st.metrics.open(env->run_dir, env->start_version > 0);
    st.health.emplace(recipe_health_config(env->cfg));
    if (env->start_version > 0)  // a resumed run's gates count its earlier steps too (judged then)
      metrics_rows_each(st.metrics.path(), [&st](uint64_t step, const auto& m) { st.health->add(step, m); });
    // code 0: the last step is done; `stopped`: a stop request ended the run (why: where it is saved)
    auto finish = [self, shut_down, log](int code, const std::string& why, bool stopped = false) {
      auto& s = self->state;
      if (s.stopping) return;
      s.stopping = true;
      if (code == 0 || stopped) {
        const std::string perr = plots_write(s.env->run_dir);
        if (!perr.empty()) log->warn("plots: {}", perr);
        health_verdict_log(s);
        // this process's steps (a resumed run's earlier ones took their own time); a stop's line
        // names the checkpoint to resume from: a warning, kept by run.log_level=warn
        const uint64_t from = s.env->start_version;
        log->log(stopped ? spdlog::level::warn : spdlog::level::info, "run {}: {} steps{} in {:.1f} s; metrics in {}{}{}",
                 stopped ? "stopped" : "finished", s.learner_version - from,
                 from > 0 ? fmt::format(" ({}..{}, resumed at {})", from + 1, s.learner_version, from) : std::string(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - s.t0).count(), s.metrics.path(),
                 s.rollouts_lost ? fmt::format(" ({} rollout(s) lost, {} restarted, {} group(s) re-issued)", s.rollouts_lost,
                                               s.rollouts_restarted, s.reissued)
                                 : std::string(),
                 why.empty() ? "" : "; " + why);
      } else {
        log->error("run failed: {}", why);
      }
      shut_down(code);
      self->quit();
    };
    auto issue = [self](msg::work_msg w) {
      auto& s = self->state;
      if (s.peers.rollouts.empty()) return;
      const size_t i = s.rr++ % s.peers.rollouts.size();
      trace_send_step("controller", "work_msg", w.trace, w.step);
      s.issued[{w.step, w.prompt_id}] = w;
      in_flight_put(s, {w.step, w.prompt_id}, s.peers.rollout_names[i], w);
      self->send(s.peers.rollouts[i], std::move(w));
    };
    auto issue_ready = [self, issue] {
      auto& s = self->state;
      const uint64_t B = static_cast<uint64_t>(s.env->cfg.prompts_per_step);
      while (s.next_step < std::min(s.end, s.stop_step) && s.synced_version >= 0 &&
             s.next_step <= static_cast<uint64_t>(s.synced_version) + static_cast<uint64_t>(s.env->cfg.max_staleness)) {
        const uint64_t step = s.next_step++;
        const uint64_t cursor = s.env->prompt_cursor(step);
        const auto prompts = models::take_prompts(s.train, cursor, static_cast<int64_t>(B));
        for (uint64_t i = 0; i < B; ++i) {
          msg::work_msg w;
          w.step = step;
          w.prompt_id = cursor + i;
          w.prompt = prompts[i].prompt;
          w.answer = prompts[i].answer;
          w.group_size = static_cast<int32_t>(s.env->cfg.group_size);
          w.seed = static_cast<uint64_t>(s.env->cfg.seed) + step;
          issue(std::move(w));
        }
      }
    };
    auto broadcast_peers = [self] {
      const auto& p = self->state.peers;
      auto tell = [self, &p](const auto& to) {  // a copy per recipient: each send is one traced message
        msg::peers_msg m = p;
        trace_send("controller", "peers_msg", m.trace);
        self->send(to, std::move(m));
      };
      tell(p.buffer);
      tell(p.reward);
      tell(p.weight_sync);
      tell(p.calibration);
      for (const auto& l : p.learners) tell(l);
      for (const auto& r : p.rollouts) tell(r);
    };
    // Asks the buffer where the run stops (the first step no learner was given); learner0 answers
    // with stopped_atom once it is there and checkpointed.
    auto request_stop = [self, finish, log] {
      auto& s = self->state;
      self->request(s.peers.buffer, std::chrono::seconds(30), msg::stop_atom::value)
          .then(
              [self, log](uint64_t at) {
                auto& s = self->state;
                s.stop_step = at;
                if (at >= s.end) log->info("stop ({}): step {} is the run's last; it ends there as planned", s.stop_why, s.end);
                else if (at == s.env->start_version) log->info("stop ({}): the learners stop before their first step", s.stop_why);
                else log->info("stop ({}): the learners finish step {} and it is checkpointed; work for later steps is not issued",
                               s.stop_why, at);
              },
              [self, finish](caf::error& e) {
                finish(1, "stop (" + self->state.stop_why + "): the trajectory buffer did not answer: " + self->system().render(e));
              });
    };
    // A stop asked (a signal, a node, a health gate): once; the buffer names the step it ends at.
    auto stop_for = [self, request_stop](std::string why, int32_t code) {
      auto& s = self->state;
      if (s.stopping || s.stop_asked) return;  // under caf-run every node is signalled and asks
      s.stop_asked = true;
      s.stop_why = std::move(why);
      s.stop_code = code;
      if (s.peers.buffer) request_stop();
    };
    // A failure the learners outlive (every rollout gone; the reward, calibration or weight-sync
    // actor lost or failing): the run fails with exit 1, but through the stop path, so that
    // learner0 checkpoints the step it is at (up to checkpoint_every - 1 trained steps were lost
    // otherwise); during a stop already under way it makes that stop's exit code 1.
    auto fail_saved = [self, stop_for, log](const std::string& why) {
      auto& s = self->state;
      if (s.stopping) return;
      if (!s.failed.empty()) return log->warn("also: {}", why);  // one error line (a lost node: several actors)
      s.failed = why;
      log->error("{}; the run fails once the learners have stopped at their step, checkpointed", why);
      // learners that never stop (a collective wedged on a live peer) do not hold the run for good
      self->delayed_send(self, kFailedStopWait, std::string("controller"),
                         "the learners did not stop within " + std::to_string(kFailedStopWait.count()) + " s of: " + why);
      if (s.stop_asked) s.stop_code = 1;
      else stop_for(why, 1);
    };
    self->set_down_handler([self, finish, fail_saved, issue, broadcast_peers, log](caf::down_msg& dm) {
      auto& s = self->state;
      if (s.stopping) return;
      for (size_t i = 0; i < s.peers.rollouts.size(); ++i) {
        if (s.peers.rollouts[i].address() != dm.source) continue;
        const std::string name = s.peers.rollout_names[i];
        ++s.rollouts_lost;
        // while the run stops, none is needed: every step before the buffer's stop step is with the learners
        if (s.stop_asked) log->warn("{} is down ({}) while the run stops; not replaced", name, self->system().render(dm.reason));
        else log->warn("{} is down ({}); re-queueing its work", name, self->system().render(dm.reason));
        msg::rollout_actor fresh;  // architecture.md §4: a failed rollout is restarted, its prompts re-queued
        if (!s.stop_asked && s.opts.respawn_rollout && s.restarts[name] < s.opts.max_restarts)
          fresh = s.opts.respawn_rollout(self->system(), name);
        if (fresh) {
          ++s.restarts[name];
          ++s.rollouts_restarted;
          log->warn("{} restarted ({} of at most {})", name, s.restarts[name], s.opts.max_restarts);
          self->monitor(fresh);
          s.peers.rollouts[i] = fresh;  // weight sync sends it the newest bundle when it sees the new peers
        } else {
          s.peers.rollouts.erase(s.peers.rollouts.begin() + static_cast<long>(i));
          s.peers.rollout_names.erase(s.peers.rollout_names.begin() + static_cast<long>(i));
          idle_gone(s, name);
        }
        if (s.stop_asked) return;
        if (s.peers.rollouts.empty())
          return fail_saved("every rollout actor is gone (the last, " + name + ": " + self->system().render(dm.reason) + ")");
        broadcast_peers();
        std::vector<msg::work_msg> redo;
        for (auto& [key, v] : s.in_flight) if (v.first == name) redo.push_back(v.second);
        for (auto& w : redo) { ++s.reissued; issue(std::move(w)); }
        return;
      }
      for (const auto& a : s.agents)
        if (a.address() == dm.source) {  // a node process is gone; its actors' own down messages decide
          log->warn("node '{}' is down ({})", node_of(s, self->node(), dm.source.node()), self->system().render(dm.reason));
          return;
        }
      const std::string lost = lost_actor_named(s, self->node(), dm.source) + " went down: " + self->system().render(dm.reason);
      const auto& l = s.peers.learners;
      const bool learner = std::any_of(l.begin(), l.end(), [&](const auto& a) { return a.address() == dm.source; });
      if (learner || dm.source == s.peers.buffer.address()) return finish(1, lost);  // the stop path needs both
      fail_saved(lost);
    });
    return {
        [self, all_actors, issue_ready, broadcast_peers, request_stop](msg::peers_msg& p, std::vector<caf::actor>& agents,
                                                                       std::vector<std::string>& agent_nodes) {
          auto& s = self->state;
          trace_recv("controller", "peers_msg", p.trace);
          s.peers = std::move(p);
          s.agents = std::move(agents);
          s.agent_nodes = std::move(agent_nodes);
          log_get("controller")->debug("wired: {} learners, {} rollouts", s.peers.learners.size(), s.peers.rollouts.size());
          for (auto& a : all_actors()) self->monitor(a);
          for (auto& a : s.agents) self->monitor(a);
          idle_start(s);
          broadcast_peers();
          for (auto& l : s.peers.learners) self->send(l, msg::start_atom::value, s.learner_version);
          if (s.stop_asked) return request_stop();  // a stop before the wiring: the learners stop at their start
          issue_ready();
        },
        [self, finish, issue_ready, stop_for](msg::step_report& r) {
          auto& s = self->state;
          trace_recv("controller", "step_report", r.trace, static_cast<int64_t>(r.version));
          s.learner_version = std::max(s.learner_version, r.version);
          const auto trained = [&](const auto& e) { return e.first.first < s.learner_version; };
          std::erase_if(s.issued, trained);  // trained steps need no re-issue,
          const auto now = clk::now();  // one instant: the trained groups' rollouts idle from the line on
          in_flight_erase_if(s, trained, now);  // nor a lost rollout's groups of them
          const double el = std::chrono::duration<double>(now - s.t0).count();
          step_metrics_add(s, r, now);
          try {
            s.metrics.write(r.version, r.metrics);
            if (s.opts.on_first_step) std::exchange(s.opts.on_first_step, nullptr)();  // the new run holds a step
          } catch (const std::exception& e) {
            return finish(1, e.what());  // metrics that cannot be written are a failed run, not a silent gap
          }
          if (s.opts.print_progress && log_get("controller")->should_log(spdlog::level::info))  // progress is info
            progress_print(s, r, el);
          if (const std::string why = health_judge(s, r); !why.empty() && s.health_failed.empty()) {
            log_get("controller")->error("health gate (rl-algorithm.md section 7): {}; the run stops", why);
            s.health_failed = "health gate: " + why + " (--health.gates=warn or off goes on)";
            stop_for(s.health_failed, 1);
          }
          // a gate failed at (or within the staleness window of) the last step fails the run too
          if (r.version >= s.end) {
            const std::string& bad = s.failed.empty() ? s.health_failed : s.failed;
            return bad.empty() ? finish(0, "") : finish(1, bad, true);
          }
          issue_ready();
        },
        [self, issue](msg::admitted_msg& a) {
          auto& s = self->state;
          trace_recv_step("controller", "admitted_msg", a.trace, a.step);
          const auto key = std::make_pair(a.step, a.prompt_id);
          if (a.dropped && a.reason.rfind("stale", 0) == 0) {  // regenerate with newer weights, unless trained
            if (auto it = s.issued.find(key); it != s.issued.end()) {
              ++s.reissued;
              issue(it->second);
            }
            return;
          }
          // admitted or a duplicate: the buffer holds the group, a lost rollout owes none
          if (const auto it = s.in_flight.find(key); it != s.in_flight.end()) in_flight_erase(s, it, clk::now());
        },
        [self, issue_ready](msg::sync_report& r) {
          auto& s = self->state;
          trace_recv("controller", "sync_report", r.trace, static_cast<int64_t>(r.version));
          s.synced_version = std::max<int64_t>(s.synced_version, static_cast<int64_t>(r.version));
          issue_ready();
          auto& x = s.sync_pending.emplace_back();
          x["sync_version"] = double(r.version);
          x["sync_latency_s"] = r.latency_s;
          x["sync_bytes"] = r.bytes;
          x["sync_cross_process"] = r.cross_process ? 1.0 : 0.0;
          if (r.cross_process) x["sync_transfer_s"] = r.transfer_s;
        },
        [self](msg::calib_report& r) {
          auto& s = self->state;
          trace_recv("controller", "calib_report", r.trace, static_cast<int64_t>(r.version));
          auto& x = s.calib_pending.emplace_back();
          x["calibration_s"] = r.seconds;
          x["calibration_version"] = double(r.version);
          models::flush_metrics_add(r.weights_flushed, r.worst_block_flushed, x);
        },
        [finish, fail_saved](std::string& who, std::string& what) {
          if (who == "controller") return finish(1, what);  // fail_saved's deadline
          // a learner's or the buffer's own failure ends it at once: the stop path needs both
          if (who.rfind("learner", 0) == 0 || who == "the trajectory buffer") return finish(1, who + ": " + what);
          fail_saved(who + ": " + what);
        },
        [stop_for](msg::stop_atom, std::string& why, int32_t code) { stop_for(std::move(why), code); },
        [self, finish](msg::stopped_atom, uint64_t version, std::string& dir) {
          auto& s = self->state;
          const std::string where = s.env->run_dir;
          finish(s.stop_code,
                 s.stop_why + ", at step " + std::to_string(version) + " of " + std::to_string(s.end) + ": " +
                     (dir.empty() ? "no step was trained, nothing to resume"
                                  : dir + " is the latest checkpoint; to continue, run the command again with --resume --run-dir " + where +
                                        " in place of any --run-dir or --overwrite (recipe options may be left out: the run's own settings are the default)"),
                 true);
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

}  // namespace fp8rl::actors
