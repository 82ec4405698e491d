// actors/calib_sync.cpp -- the calibration actor (requantizes weights and recomputes Q/K/V scales
// after every step, off the learner's critical path, publishing an immutable bundle) and the
// weight-sync actor (bundle registry, zero-copy hand-off in process, chunked raw-byte transfer
// across processes with a window of kBundleWindow chunk requests in flight, adoption acks, sync
// latency).
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <set>

#include "actors/actors.hpp"
#include "actors/trace.hpp"
#include "models/log.hpp"

namespace fp8rl::actors {
namespace {

// weight-sync's own clock for latencies (steady: a wall-clock step moved them)
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct calibration_state {
  std::shared_ptr<const actor_env> env;
  msg::peers_msg peers;
  std::optional<msg::params_msg> early;  // weights that came before the first peers_msg (another sender)
  std::unique_ptr<tbb::task_arena> arena;
  models::rl_state st;  // kept between versions: the weights copy reuses its buffer
};

struct sync_version {
  std::shared_ptr<const quant::weight_bundle> bundle;
  double published_at = 0, max_latency = 0;  // this actor's clock: publish -> the adoptions heard
  std::set<std::string> waiting;  // rollouts that have not adopted it, nor taken a newer one first
  int adopted = 0;
  bool cross = false, reported = false;
  double transfer_s = 0;          // slowest chunked transfer (cross-process)
};

struct sync_state {
  std::shared_ptr<const actor_env> env;
  msg::peers_msg peers;
  std::map<uint64_t, sync_version> versions;  // registry: the last max_staleness + 1 bundles
  int64_t refused = 0;
};

// A bundle as the bytes its chunks carry across processes; null and *err set on failure.
std::shared_ptr<const std::vector<char>> bundle_bytes(caf::actor_system& sys, const quant::weight_bundle& b, std::string* err) {
  auto buf = std::make_shared<std::vector<char>>();
  caf::binary_serializer sink(sys, *buf);
  auto w = msg::bundle_to_wire(b);
  if (auto e = sink(w)) {
    *err = "cannot serialize bundle v" + std::to_string(b.weight_version) + ": " + sys.render(e);
    return nullptr;
  }
  return buf;
}

}  // namespace

msg::calibration_actor spawn_calibration(caf::actor_system& sys, std::shared_ptr<const actor_env> env, device_spec dev) {
  using self_t = msg::calibration_actor::stateful_pointer<calibration_state>;
  return sys.spawn([dev](self_t self, std::shared_ptr<const actor_env> env) -> msg::calibration_actor::behavior_type {
    actor_failures_named(self, "the calibration actor");
    self->state.env = env;
    self->state.arena = arena_for(dev);
    auto calibrate = [self](msg::params_msg& pm) {
      log_get("calibration")->debug("calibrating v{}", pm.version);
      auto& s = self->state;
      const auto t0 = std::chrono::steady_clock::now();
      std::shared_ptr<quant::weight_bundle> b;
      quant::flush_report flushed;
      try {
        trace_span span("calibration", "calibrate", static_cast<int64_t>(pm.version));
        auto& st = s.st;
        st.params.cfg = s.env->model;
        st.params.layout = models::model_param_layout(s.env->model);
        st.params.data = *pm.params;  // same size every version: no reallocation
        st.version = pm.version;
        std::vector<models::token_batch> calib(1);
        for (const auto& q : pm.calib) calib[0].add(q);
        s.arena->execute([&] { b = models::make_bundle(st, s.env->rl, calib, pm.version, &flushed); });
      } catch (const std::exception& e) {
        self->send(s.peers.controller, std::string("calibration"), std::string(e.what()));
        return;
      }
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      models::flush_warn(flushed, pm.version);  // here, where the weights were quantized
      msg::calib_report rep{{}, pm.version, sec, flushed.flushed, flushed.worst_fraction};
      trace_send("calibration", "calib_report", rep.trace, static_cast<int64_t>(pm.version));
      self->send(s.peers.controller, std::move(rep));
      msg::bundle_msg out{{}, std::move(b)};
      trace_send_bundle("calibration", out);
      self->send(s.peers.weight_sync, std::move(out));
    };
    return {
        [self, calibrate](msg::peers_msg& p) {
          trace_recv("calibration", "peers_msg", p.trace);
          self->state.peers = std::move(p);
          if (auto pm = std::move(self->state.early)) {
            self->state.early.reset();
            calibrate(*pm);
          }
        },
        [self, calibrate](msg::params_msg& pm) {
          trace_recv("calibration", "params_msg", pm.trace, static_cast<int64_t>(pm.version));
          // CAF orders messages per sender only: learner 0's weights can overtake the
          // controller's peers_msg, and sends to its unset handles are dropped silently
          if (!self->state.peers.controller) self->state.early = std::move(pm);
          else calibrate(pm);
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

msg::weight_sync_actor spawn_weight_sync(caf::actor_system& sys, std::shared_ptr<const actor_env> env, size_t chunk_bytes) {
  using self_t = msg::weight_sync_actor::stateful_pointer<sync_state>;
  if (chunk_bytes == 0) throw std::invalid_argument("spawn_weight_sync: chunk_bytes must be > 0");
  return sys.spawn([chunk = chunk_bytes](self_t self, std::shared_ptr<const actor_env> env) -> msg::weight_sync_actor::behavior_type {
    actor_failures_named(self, "the weight-sync actor");
    self->state.env = env;
    auto log = log_get("weight_sync");
    // Version v is reported once no live rollout is pending on it (the controller's staleness gate
    // waits for it), with the latency of its last adoption -- NaN (null in metrics.jsonl) where no
    // rollout adopted it: every one took a newer version first, or left.
    auto report_if_done = [self](uint64_t v, sync_version& sv) {
      if (!sv.waiting.empty() || !sv.bundle || sv.reported) return;
      sv.reported = true;
      const double latency = sv.adopted > 0 ? sv.max_latency : std::nan("");
      msg::sync_report r{{}, v, latency, static_cast<double>(sv.bundle->bytes()), sv.cross, sv.transfer_s};
      trace_send("weight_sync", "sync_report", r.trace, static_cast<int64_t>(v));
      self->send(self->state.peers.controller, std::move(r));
    };
    // Rollout `name` is done with version v: adopted it, or (adopted false) took a newer one first --
    // before v's chunks were all there, or before a step ran under v (adopted_msg `superseded`).
    auto heard = [self, report_if_done](const std::string& name, uint64_t v, bool adopted) {
      auto it = self->state.versions.find(v);
      if (it == self->state.versions.end()) return;
      auto& sv = it->second;
      sv.waiting.erase(name);
      if (adopted) sv.adopted += 1, sv.max_latency = std::max(sv.max_latency, now_s() - sv.published_at);
      report_if_done(v, sv);
    };
    // Sends a bundle to one remote rollout as raw-byte chunks with a window of kBundleWindow requests
    // in flight (the acks are the backpressure; CAF keeps per-sender order, so the rollout
    // appends chunks in sequence).
    auto send_chunks = [self, log, heard, chunk](msg::rollout_actor r, std::string name, std::shared_ptr<const std::vector<char>> bytes,
                                   uint64_t version) {
      const uint32_t total = static_cast<uint32_t>(std::max<size_t>(1, (bytes->size() + chunk - 1) / chunk));
      struct progress { uint32_t sent = 0, acked = 0; bool failed = false; };
      auto pr = std::make_shared<progress>();
      // the pending requests' handlers own send_one; it holds itself weakly (a strong self-capture
      // kept the closure and the serialized bundle alive when weight-sync exited mid-transfer)
      auto send_one = std::make_shared<std::function<void()>>();
      const std::weak_ptr<std::function<void()>> weak_send = send_one;
      const double t_start = now_s();
      *send_one = [self, r, name, bytes, version, total, pr, weak_send, log, t_start, heard, chunk] {
        auto send_one = weak_send.lock();
        if (!send_one) return;
        msg::bundle_chunk c;
        c.version = version;
        c.seq = pr->sent++;
        c.total = total;
        const size_t b = size_t(c.seq) * chunk, e = std::min(bytes->size(), b + chunk);
        c.bytes.assign(bytes->begin() + static_cast<long>(b), bytes->begin() + static_cast<long>(e));
        trace_send("weight_sync", "bundle_chunk", c.trace, static_cast<int64_t>(version), double(c.bytes.size()));
        self->request(r, std::chrono::seconds(60), std::move(c)).then(
            [self, pr, send_one, total, version, t_start, name, log, heard](msg::chunk_ack& ack) {
              trace_recv("weight_sync", "chunk_ack", ack.trace, static_cast<int64_t>(version));
              if (pr->failed) return;
              if (ack.superseded) {  // the rollout took a newer version's chunks: stop sending this one
                pr->failed = true;
                *send_one = nullptr;
                log->debug("bundle v{} to {}: superseded by a newer one", version, name);
                heard(name, version, false);
                return;
              }
              if (++pr->acked == total) {
                auto it = self->state.versions.find(version);
                if (it != self->state.versions.end()) it->second.transfer_s = std::max(it->second.transfer_s, now_s() - t_start);
                *send_one = nullptr;  // done: the closure (and the bytes) go now
              } else if (pr->sent < total) {
                (*send_one)();
              }
            },
            [self, name, pr, send_one, log, version](caf::error& err) {
              if (pr->failed) return;
              pr->failed = true;
              *send_one = nullptr;
              const auto& live = self->state.peers.rollout_names;
              const bool gone = err == caf::sec::request_receiver_down || std::find(live.begin(), live.end(), name) == live.end();
              if (gone) {  // the controller sees the rollout's down message and re-queues its work
                log->warn("bundle v{} to {} failed: {} (the rollout is gone)", version, name, self->system().render(err));
                return;
              }
              // a live rollout that cannot take its weights would wait for them forever (the run
              // hung until the learner's 30-minute batch request timed out)
              self->send(self->state.peers.controller, std::string("weight_sync"),
                         "bundle v" + std::to_string(version) + " to " + name + " failed: " + self->system().render(err));
            });
      };
      for (uint32_t i = 0; i < std::min(kBundleWindow, total); ++i) (*send_one)();
    };
    // One rollout's copy of version v: the bundle itself in this process, chunks of its bytes
    // across processes (`bytes` caches them: serialized once per publish). False when the
    // bundle cannot be serialized (reported to the controller).
    auto send_bundle = [self, send_chunks](const msg::rollout_actor& r, const std::string& name, uint64_t v,
                                           const sync_version& sv, std::shared_ptr<const std::vector<char>>& bytes) {
      if (r.node() == self->node()) {
        msg::bundle_msg out{{}, sv.bundle};
        trace_send_bundle("weight_sync", out);
        self->send(r, std::move(out));
        return true;
      }
      if (!bytes) {
        std::string err;
        bytes = bundle_bytes(self->system(), *sv.bundle, &err);
        if (!bytes) {
          self->send(self->state.peers.controller, std::string("weight_sync"), err);
          return false;
        }
      }
      send_chunks(r, name, bytes, v);
      return true;
    };
    return {
        [self, send_bundle, report_if_done](msg::peers_msg& p) {
          auto& s = self->state;
          trace_recv("weight_sync", "peers_msg", p.trace);
          std::set<caf::actor_addr> known;
          for (const auto& r : s.peers.rollouts) known.insert(r.address());
          s.peers = std::move(p);
          // a rollout that joined gets the newest bundle: a restarted one has no weights yet, and
          // a bundle can come before the first peers_msg (CAF orders per sender only), when it
          // went to no rollout; the joiner holds up that version's report until it adopts it, and
          // no older one's (a restart under the old name kept them waiting for the lost actor)
          if (!s.versions.empty() && s.versions.rbegin()->second.bundle) {
            auto& [v, sv] = *s.versions.rbegin();
            std::shared_ptr<const std::vector<char>> bytes;  // serialized once for every remote joiner
            for (size_t i = 0; i < s.peers.rollouts.size(); ++i) {
              const auto& r = s.peers.rollouts[i];
              if (known.count(r.address())) continue;
              for (auto& [older, osv] : s.versions)
                if (older < v) osv.waiting.erase(s.peers.rollout_names[i]);
              log_get("weight_sync")->info("sending v{} to {} (joined)", v, s.peers.rollout_names[i]);
              if (!sv.reported) sv.waiting.insert(s.peers.rollout_names[i]);
              sv.cross |= r.node() != self->node();
              if (!send_bundle(r, s.peers.rollout_names[i], v, sv, bytes)) return;
            }
          }
          // rollouts that left no longer hold up adoption accounting
          std::set<std::string> live(s.peers.rollout_names.begin(), s.peers.rollout_names.end());
          for (auto& [v, sv] : s.versions) {
            for (auto it = sv.waiting.begin(); it != sv.waiting.end();) it = live.count(*it) ? std::next(it) : sv.waiting.erase(it);
            report_if_done(v, sv);
          }
        },
        [self, send_bundle](msg::bundle_msg& bm) {
          auto& s = self->state;
          const uint64_t v = bm.bundle->weight_version;
          trace_recv_bundle("weight_sync", bm);
          // one bundle per version, in order (one calibration actor, one learner publishing): a
          // version again replaced the bundle its rollouts may hold and was never reported again
          if (!s.versions.empty() && v <= s.versions.rbegin()->first) {
            self->send(s.peers.controller, std::string("weight_sync"),
                       "bundle v" + std::to_string(v) + " arrived after v" + std::to_string(s.versions.rbegin()->first) +
                           ": each version is published once, in order (not sent to the rollouts)");
            return;
          }
          log_get("weight_sync")->debug("publishing v{} to {} rollouts", v, s.peers.rollouts.size());
          trace_span span("weight_sync", "publish", static_cast<int64_t>(v), static_cast<double>(bm.bundle->bytes()),
                          static_cast<int64_t>(bm.bundle->snapshot.scale_version));
          auto& sv = s.versions[v];
          sv.bundle = bm.bundle;
          sv.published_at = now_s();
          std::shared_ptr<const std::vector<char>> bytes;
          for (size_t i = 0; i < s.peers.rollouts.size(); ++i) {
            const auto& r = s.peers.rollouts[i];
            sv.waiting.insert(s.peers.rollout_names[i]);
            sv.cross |= r.node() != self->node();
            if (!send_bundle(r, s.peers.rollout_names[i], v, sv, bytes)) return;
          }
          while (s.versions.size() > static_cast<size_t>(s.env->cfg.max_staleness + 1)) s.versions.erase(s.versions.begin());
        },
        [self, log, heard](msg::adopted_msg& a) {
          auto& s = self->state;
          trace_recv("weight_sync", "adopted_msg", a.trace, static_cast<int64_t>(a.weight_version), 0,
                     static_cast<int64_t>(a.scale_version));
          if (!a.error.empty()) {
            ++s.refused;
            log->error("{} refused bundle v{}: {}", a.rollout, a.weight_version, a.error);
            self->send(s.peers.controller, std::string(a.rollout), "refused bundle v" + std::to_string(a.weight_version) + ": " + a.error);
            return;
          }
          if (a.superseded) log->debug("{}: bundle v{} superseded before a step ran under it", a.rollout, a.weight_version);
          heard(a.rollout, a.weight_version, !a.superseded);
        },
        [self](msg::status_atom) -> msg::metrics_t {
          return {{"versions_held", double(self->state.versions.size())}, {"refused", double(self->state.refused)}};
        },
    };
  }, env);  // env as a spawn argument: actors.hpp
}

}  // namespace fp8rl::actors
