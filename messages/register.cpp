// messages/register.cpp -- type registration (same names on every node) and bundle wire format.
#include <stdexcept>

#include "messages/interfaces.hpp"

namespace fp8rl::msg {

bundle_wire bundle_to_wire(const quant::weight_bundle& b) {
  bundle_wire w;
  w.weight_version = b.weight_version;
  w.scale_version = b.snapshot.scale_version;
  w.mode = static_cast<uint8_t>(b.snapshot.mode);
  w.policy = b.snapshot.policy;
  for (const auto& [name, s] : b.snapshot.weight_scales) {
    w.scale_names.push_back(name);
    w.scale_bytes.push_back(to_bytes(s));
  }
  w.layers = b.snapshot.layers;
  w.heads = b.snapshot.heads;
  w.kv_heads = b.snapshot.kv_heads;
  w.q = to_bytes(b.snapshot.q_scale);
  w.k = to_bytes(b.snapshot.k_scale);
  w.v = to_bytes(b.snapshot.v_scale);
  for (const auto& t : b.tensors) {
    w.names.push_back(t.name);
    w.dtypes.push_back(static_cast<uint8_t>(t.dtype));
    w.shapes.push_back(t.shape);
    w.tensors.push_back(t.bytes);
  }
  return w;
}

quant::weight_bundle bundle_from_wire(bundle_wire&& w) {
  quant::weight_bundle b;
  b.weight_version = w.weight_version;
  auto& s = b.snapshot;
  s.weight_version = w.weight_version;
  s.scale_version = w.scale_version;
  if (w.mode > 1) throw std::invalid_argument("bundle: unknown scale mode " + std::to_string(w.mode));
  s.mode = static_cast<quant::scale_mode>(w.mode);
  s.policy = std::move(w.policy);
  if (w.scale_names.size() != w.scale_bytes.size()) throw std::invalid_argument("bundle: scale names/bytes mismatch");
  for (size_t i = 0; i < w.scale_names.size(); ++i)
    if (!from_bytes(w.scale_bytes[i], s.weight_scales[w.scale_names[i]]))
      throw std::invalid_argument("bundle: scales of '" + w.scale_names[i] + "' are not FP32");
  s.layers = w.layers;
  s.heads = w.heads;
  s.kv_heads = w.kv_heads;
  if (!from_bytes(w.q, s.q_scale) || !from_bytes(w.k, s.k_scale) || !from_bytes(w.v, s.v_scale))
    throw std::invalid_argument("bundle: attention scales are not FP32");
  const size_t n = w.names.size();
  if (w.dtypes.size() != n || w.shapes.size() != n || w.tensors.size() != n)
    throw std::invalid_argument("bundle: tensor fields have different counts");
  for (size_t i = 0; i < n; ++i) {
    if (w.dtypes[i] > 2) throw std::invalid_argument("bundle: tensor '" + w.names[i] + "' has unknown dtype");
    b.tensors.push_back({std::move(w.names[i]), static_cast<quant::bundle_dtype>(w.dtypes[i]), std::move(w.shapes[i]),
                         std::move(w.tensors[i])});
  }
  return b;
}

void messages_register(caf::actor_system_config& cfg) {
  cfg.add_message_type<trace_ctx>("fp8rl.trace_ctx")
      .add_message_type<work_msg>("fp8rl.work_msg")
      .add_message_type<models::rl_sample>("fp8rl.rl_sample")
      .add_message_type<quant::qtensor>("fp8rl.qtensor")
      .add_message_type<group_msg>("fp8rl.group_msg")
      .add_message_type<batch_msg>("fp8rl.batch_msg")
      .add_message_type<params_msg>("fp8rl.params_msg")
      .add_message_type<bundle_msg>("fp8rl.bundle_msg")
      .add_message_type<bundle_chunk>("fp8rl.bundle_chunk")
      .add_message_type<chunk_ack>("fp8rl.chunk_ack")
      .add_message_type<adopted_msg>("fp8rl.adopted_msg")
      .add_message_type<step_report>("fp8rl.step_report")
      .add_message_type<admitted_msg>("fp8rl.admitted_msg")
      .add_message_type<sync_report>("fp8rl.sync_report")
      .add_message_type<calib_report>("fp8rl.calib_report")
      .add_message_type<peers_msg>("fp8rl.peers_msg")
      .add_message_type<node_start>("fp8rl.node_start")
      .add_message_type<node_actors>("fp8rl.node_actors")
      .add_message_type<metrics_t>("fp8rl.metrics")
      .add_message_type<std::vector<caf::actor>>("fp8rl.actor_list")
      .add_message_type<std::vector<std::vector<int32_t>>>("fp8rl.token_lists")
      .add_message_type<rollout_actor>("fp8rl.rollout_actor")
      .add_message_type<reward_actor>("fp8rl.reward_actor")
      .add_message_type<buffer_actor>("fp8rl.buffer_actor")
      .add_message_type<learner_actor>("fp8rl.learner_actor")
      .add_message_type<calibration_actor>("fp8rl.calibration_actor")
      .add_message_type<weight_sync_actor>("fp8rl.weight_sync_actor")
      .add_message_type<controller_actor>("fp8rl.controller_actor")
      .add_message_type<node_agent_actor>("fp8rl.node_agent_actor");
}

}  // namespace fp8rl::msg
