// messages/wire.hpp -- every wire type of fp8rl as a plain struct with a CAF 0.17 `inspect`.
// defines: atoms, trace_ctx, work_msg, group_msg, batch_msg, params_msg, bundle_msg,
//          bundle_chunk, chunk_ack, step_report, adopted_msg, inspect for quant/models value types
//
// Large payloads travel as one raw byte run (std::vector<uint8_t>: CAF's memcpy path, ~10x the
// element-wise speed, caf-0.17.md §3); both ends must share endianness (x86-64 everywhere).
// In-process messages are never serialized: bundle_msg/params_msg carry shared_ptr<const ...>,
// so a local hand-off is zero-copy; across processes weight-sync sends bundle_chunk pieces far
// below CAF's 4 GiB frame limit (4 MiB), a window of 4 requests in flight (acks are the backpressure).
#pragma once
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "caf/all.hpp"
#include "models/rl/rl.hpp"
#include "quant/bundle.hpp"
#include "quant/qtensor.hpp"

namespace fp8rl::msg {

// ---- atoms (<= 10 chars) ----
using step_atom = caf::atom_constant<caf::atom("step")>;
using batch_atom = caf::atom_constant<caf::atom("batch")>;
using drain_atom = caf::atom_constant<caf::atom("drain")>;
using stop_atom = caf::atom_constant<caf::atom("stop")>;
using stopped_atom = caf::atom_constant<caf::atom("stopped")>;
using start_atom = caf::atom_constant<caf::atom("start")>;
using ping_atom = caf::atom_constant<caf::atom("ping")>;
using status_atom = caf::atom_constant<caf::atom("status")>;
using eval_atom = caf::atom_constant<caf::atom("eval")>;

// Per-message trace context (caf-0.17.md §7): Lamport clock of the sender.
struct trace_ctx {
  uint64_t trace_id = 0, span_id = 0, lamport = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, trace_ctx& x) {
  return f(caf::meta::type_name("trace_ctx"), x.trace_id, x.span_id, x.lamport);
}

// Raw byte views of POD vectors for serialization.
template <class T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}
template <class T>
bool from_bytes(const std::vector<uint8_t>& b, std::vector<T>& v) {
  if (b.size() % sizeof(T)) return false;
  v.resize(b.size() / sizeof(T));
  if (!b.empty()) std::memcpy(v.data(), b.data(), b.size());
  return true;
}

// A prompt group to generate (controller -> rollout).
struct work_msg {
  trace_ctx trace;
  uint64_t step = 0;        // the learner step this group belongs to
  uint64_t prompt_id = 0;   // global prompt index (request ids: prompt_id * G + j)
  std::string prompt, answer;
  int32_t group_size = 0;
  uint64_t seed = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, work_msg& x) {
  return f(caf::meta::type_name("work_msg"), x.trace, x.step, x.prompt_id, x.prompt, x.answer, x.group_size, x.seed);
}

// A sampled group (rollout -> reward -> buffer); rewards/advantages filled by the reward actor.
struct group_msg {
  trace_ctx trace;
  uint64_t step = 0, prompt_id = 0;
  std::string answer;
  std::string rollout;  // which rollout actor produced it (for accounting)
  std::string policy;   // fingerprint of the precision policy it was sampled under (the buffer checks it)
  std::vector<models::rl_sample> samples;
  std::vector<int64_t> kv_saturated;  // per layer: FP8 K/V elements the rollout saturated since its previous group
  std::vector<int64_t> q_saturated;   // per layer: FP8 query elements likewise (FP8 attention)
};

// A learner's shard of one step's batch (buffer -> learner).
struct batch_msg {
  trace_ctx trace;
  uint64_t step = 0;
  double n_global = 0;  // masked response tokens over the whole global batch
  std::vector<models::rl_sample> samples;
  std::map<std::string, double> buffer_metrics;  // admission / drops / staleness
  // several learners: rank 0 gets the whole step in global order (its metrics and the calibration
  // batch cover every shard, rl-algorithm.md §5/§6); every rank the global token offset of each
  // of its samples (where its c_t go in the gathered vector)
  std::vector<models::rl_sample> all_samples;
  std::vector<int64_t> offsets;
  // the run is stopping (a signal, architecture.md §4): no batch, train no further than `step`;
  // every rank gets it at the same step (the buffer's stop point), so none waits in an all-reduce
  bool stop = false;
};

// Updated master weights after a step (learner -> calibration); shared in-process.
struct params_msg {
  trace_ctx trace;
  uint64_t version = 0;
  std::shared_ptr<const std::vector<float>> params;
  std::vector<std::vector<int32_t>> calib;  // sequences just trained (calibration batch)
};

// A published weight bundle; in-process zero-copy (shared_ptr), serialized across processes.
struct bundle_msg {
  trace_ctx trace;
  std::shared_ptr<const quant::weight_bundle> bundle;
};

// One piece of a serialized bundle (weight-sync -> remote rollout), answered by chunk_ack.
struct bundle_chunk {
  trace_ctx trace;
  uint64_t version = 0;
  uint32_t seq = 0, total = 0;
  std::vector<uint8_t> bytes;
};
struct chunk_ack {
  trace_ctx trace;
  uint64_t version = 0;
  uint32_t seq = 0;
  bool superseded = false;  // the rollout took a newer version's chunks: it will not assemble this one
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, bundle_chunk& x) {
  return f(caf::meta::type_name("bundle_chunk"), x.trace, x.version, x.seq, x.total, x.bytes);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, chunk_ack& x) {
  return f(caf::meta::type_name("chunk_ack"), x.trace, x.version, x.seq, x.superseded);
}

// A rollout adopted a bundle (rollout -> weight-sync): sent when a step first runs under it (the
// engine takes a staged bundle at its next step boundary; an idle rollout's at once), so the
// latency includes the step in flight and a `recompute` re-prefill. A bundle a newer one replaced
// before any step ran under it comes back with `superseded` (not adopted, not an error).
// Publish -> adoption is timed by weight-sync on its own clock (a rollout on another host has
// another clock: the difference of two hosts' clocks put their skew into the latency).
struct adopted_msg {
  trace_ctx trace;
  std::string rollout;
  uint64_t weight_version = 0, scale_version = 0;
  std::string error;  // non-empty: refused (the rollout keeps its previous weights)
  bool superseded = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, adopted_msg& x) {
  return f(caf::meta::type_name("adopted_msg"), x.trace, x.rollout, x.weight_version, x.scale_version, x.error,
           x.superseded);
}

// Learner -> controller after each optimizer step.
struct step_report {
  trace_ctx trace;
  uint64_t version = 0;  // weight_version after the step
  std::map<std::string, double> metrics;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_report& x) {
  return f(caf::meta::type_name("step_report"), x.trace, x.version, x.metrics);
}

// ---- serialization of the value types carried inside messages ----
template <class Inspector>
typename Inspector::result_type inspect_sample(Inspector& f, models::rl_sample& x) {
  return f(caf::meta::type_name("rl_sample"), x.prompt_id, x.group_index, x.prompt, x.response, x.gen_logprobs,
           x.weight_version, x.scale_version, x.oldest_kv_version, x.oldest_kv_scale_version, x.reward, x.advantage);
}

}  // namespace fp8rl::msg

namespace fp8rl::models {
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rl_sample& x) {
  return msg::inspect_sample(f, x);
}
}  // namespace fp8rl::models

// A quantized tensor (codes + scales + shape + layout + mode) as one record; a received one is
// checked with qtensor_validate, so a short scale array or an unknown layout is a
// deserialization error naming the tensor, never a tensor that reads past its scales.
namespace fp8rl::quant {
template <class Inspector>
typename std::enable_if<Inspector::reads_state, typename Inspector::result_type>::type inspect(Inspector& f, qtensor& x) {
  uint8_t layout = static_cast<uint8_t>(x.layout), mode = static_cast<uint8_t>(x.mode);
  return f(caf::meta::type_name("qtensor"), x.name, x.rows, x.cols, layout, mode, x.data, x.scale_inv);
}
template <class Inspector>
typename std::enable_if<Inspector::writes_state, typename Inspector::result_type>::type inspect(Inspector& f, qtensor& x) {
  uint8_t layout = 0, mode = 0;
  auto fin = caf::meta::load_callback([&]() -> caf::error {
    if (layout > 2 || mode > 1)
      return caf::make_error(caf::sec::invalid_argument, "qtensor '" + x.name + "': unknown layout or scale mode");
    x.layout = static_cast<qlayout>(layout);
    x.mode = static_cast<scale_mode>(mode);
    try {
      qtensor_validate(x);
    } catch (const std::exception& e) {
      return caf::make_error(caf::sec::invalid_argument, e.what());
    }
    return caf::none;
  });
  return f(caf::meta::type_name("qtensor"), x.name, x.rows, x.cols, layout, mode, x.data, x.scale_inv, fin);
}
}  // namespace fp8rl::quant

namespace fp8rl::msg {

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, group_msg& x) {
  return f(caf::meta::type_name("group_msg"), x.trace, x.step, x.prompt_id, x.answer, x.rollout, x.policy, x.samples,
           x.kv_saturated, x.q_saturated);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, batch_msg& x) {
  return f(caf::meta::type_name("batch_msg"), x.trace, x.step, x.n_global, x.samples, x.buffer_metrics, x.all_samples,
           x.offsets, x.stop);
}

// weight_bundle as one record of raw byte runs
struct bundle_wire {
  uint64_t weight_version = 0, scale_version = 0;
  uint8_t mode = 0;
  std::string policy;
  std::vector<std::string> scale_names;
  std::vector<std::vector<uint8_t>> scale_bytes;
  int32_t layers = 0, heads = 0, kv_heads = 0;
  std::vector<uint8_t> q, k, v;
  std::vector<std::string> names;
  std::vector<uint8_t> dtypes;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<uint8_t>> tensors;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, bundle_wire& x) {
  return f(caf::meta::type_name("bundle_wire"), x.weight_version, x.scale_version, x.mode, x.policy, x.scale_names,
           x.scale_bytes, x.layers, x.heads, x.kv_heads, x.q, x.k, x.v, x.names, x.dtypes, x.shapes, x.tensors);
}
bundle_wire bundle_to_wire(const quant::weight_bundle& b);
quant::weight_bundle bundle_from_wire(bundle_wire&& w);  // throws std::invalid_argument

template <class Inspector>
typename std::enable_if<Inspector::reads_state, typename Inspector::result_type>::type inspect(Inspector& f, bundle_msg& x) {
  bundle_wire w;
  if (x.bundle) w = bundle_to_wire(*x.bundle);
  return f(caf::meta::type_name("bundle_msg"), x.trace, w);
}
template <class Inspector>
typename std::enable_if<Inspector::writes_state, typename Inspector::result_type>::type inspect(Inspector& f, bundle_msg& x) {
  bundle_wire w;
  auto fin = caf::meta::load_callback([&]() -> caf::error {
    try {
      x.bundle = std::make_shared<quant::weight_bundle>(bundle_from_wire(std::move(w)));
    } catch (const std::exception& e) {
      return caf::make_error(caf::sec::invalid_argument, e.what());
    }
    return caf::none;
  });
  return f(caf::meta::type_name("bundle_msg"), x.trace, w, fin);
}

template <class Inspector>
typename std::enable_if<Inspector::reads_state, typename Inspector::result_type>::type inspect(Inspector& f, params_msg& x) {
  std::vector<uint8_t> raw = x.params ? to_bytes(*x.params) : std::vector<uint8_t>{};
  return f(caf::meta::type_name("params_msg"), x.trace, x.version, raw, x.calib);
}
template <class Inspector>
typename std::enable_if<Inspector::writes_state, typename Inspector::result_type>::type inspect(Inspector& f, params_msg& x) {
  std::vector<uint8_t> raw;
  auto fin = caf::meta::load_callback([&]() -> caf::error {
    auto p = std::make_shared<std::vector<float>>();
    if (!from_bytes(raw, *p)) return caf::make_error(caf::sec::invalid_argument, "params_msg: byte count not a multiple of 4");
    x.params = std::move(p);
    return caf::none;
  });
  return f(caf::meta::type_name("params_msg"), x.trace, x.version, raw, x.calib, fin);
}

}  // namespace fp8rl::msg
