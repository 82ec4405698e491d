// models/bundle.cpp -- params <-> bundles.
#include "models/bundle.hpp"

#include <cstring>
#include <stdexcept>

#include "quant/fp8.hpp"

namespace fp8rl::models {
namespace {

using quant::bundle_dtype;

// dtype of each tensor under the policy (linears per layer; head tensors fp32/bf16)
bundle_dtype dtype_for(const model_config& c, const precision_policy& pol, const param_info& info) {
  const std::string& n = info.name;
  const auto dot = n.find(".layers.");
  if (dot != std::string::npos && info.shape.size() == 2) {
    const int64_t layer = std::stoll(n.substr(dot + 8));
    const std::string proj = n.substr(n.find('.', dot + 8) + 1, n.rfind(".weight") - n.find('.', dot + 8) - 1);
    switch (pol.linear_for(c, layer, proj, info.shape[0], info.shape[1])) {
      case precision::fp8: return bundle_dtype::fp8;
      case precision::bf16: return bundle_dtype::bf16;
      case precision::fp32: return bundle_dtype::f32;
    }
  }
  return pol.head == precision::bf16 ? bundle_dtype::bf16 : bundle_dtype::f32;
}

}  // namespace

quant::weight_bundle bundle_from_params(const model_params& p, const precision_policy& policy, uint64_t weight_version,
                                        uint64_t scale_version, const attn_fp8_scales* attn, quant::flush_report* flushed) {
  policy.validate();
  quant::weight_bundle b;
  b.weight_version = weight_version;
  auto& s = b.snapshot;
  s.weight_version = weight_version;
  s.scale_version = scale_version;
  s.mode = policy.scales;
  s.policy = policy.fingerprint();
  s.layers = static_cast<int32_t>(p.cfg.num_hidden_layers);
  s.heads = static_cast<int32_t>(p.cfg.num_attention_heads);
  s.kv_heads = static_cast<int32_t>(p.cfg.num_key_value_heads);
  if (attn) {
    s.q_scale = attn->q;
    s.k_scale = attn->k;
    s.v_scale = attn->v;
  }
  for (const auto& info : p.layout.infos) {
    quant::bundle_tensor t;
    t.name = info.name;
    t.shape = info.shape;
    t.dtype = dtype_for(p.cfg, policy, info);
    const float* src = p.data.data() + info.offset;
    switch (t.dtype) {
      case bundle_dtype::f32:
        t.bytes.resize(static_cast<size_t>(info.numel * 4));
        std::memcpy(t.bytes.data(), src, t.bytes.size());
        break;
      case bundle_dtype::bf16:
        t.bytes.resize(static_cast<size_t>(info.numel * 2));
        for (int64_t i = 0; i < info.numel; ++i) {
          const uint16_t v = quant::bf16_from_float(src[i]);
          std::memcpy(t.bytes.data() + 2 * i, &v, 2);
        }
        break;
      case bundle_dtype::fp8: {
        quant::qtensor q = quant::quantize(src, info.shape[0], info.shape[1], quant::qlayout::block_128x128,
                                           policy.scales, info.name);
        if (flushed) flushed->merge(quant::qtensor_flushed(src, q));
        t.bytes = std::move(q.data);
        s.weight_scales[info.name] = std::move(q.scale_inv);
        break;
      }
    }
    b.tensors.push_back(std::move(t));
  }
  return b;
}

double bundle_bytes(const model_config& c, const precision_policy& policy) {
  double n = 0;
  for (const auto& info : model_param_layout(c).infos) {
    switch (dtype_for(c, policy, info)) {
      case bundle_dtype::f32: n += 4.0 * double(info.numel); break;
      case bundle_dtype::bf16: n += 2.0 * double(info.numel); break;
      case bundle_dtype::fp8: {  // the codes and the block scales in their padded layout
        quant::qtensor q;
        q.rows = info.shape[0], q.cols = info.shape[1], q.layout = quant::qlayout::block_128x128;
        n += double(info.numel) + 4.0 * double(q.scale_count());
        break;
      }
    }
  }
  if (policy.kv == kv_dtype::fp8 || policy.fp8_attention)  // Q, K, V scales [L][H], [L][KV], [L][KV]
    n += 4.0 * double(c.num_hidden_layers) * double(c.num_attention_heads + 2 * c.num_key_value_heads);
  return n;
}

bundle_contents bundle_unpack(const quant::weight_bundle& b, const model_config& cfg, const precision_policy& policy) {
  const std::string tag = "bundle v" + std::to_string(b.weight_version) + ": ";
  if (b.snapshot.policy != policy.fingerprint())
    throw std::invalid_argument(tag + "made for precision policy '" + b.snapshot.policy + "', this engine runs '" +
                                policy.fingerprint() + "'");
  if (b.snapshot.mode != policy.scales) throw std::invalid_argument(tag + "scale mode differs from the policy's");
  const bool attention_scales = policy.kv == kv_dtype::fp8 || policy.fp8_attention;
  quant::bundle_validate(b, attention_scales);
  const auto& s = b.snapshot;
  if (attention_scales && (s.layers != cfg.num_hidden_layers || s.heads != cfg.num_attention_heads ||
                           s.kv_heads != cfg.num_key_value_heads))
    throw std::invalid_argument(tag + "FP8 attention/KV-cache scales are for " + std::to_string(s.layers) + " layers x " +
                                std::to_string(s.heads) + " heads / " + std::to_string(s.kv_heads) +
                                " KV heads, the model has " + std::to_string(cfg.num_hidden_layers) + " x " +
                                std::to_string(cfg.num_attention_heads) + " / " + std::to_string(cfg.num_key_value_heads));
  const param_layout layout = model_param_layout(cfg);
  std::map<std::string, const quant::bundle_tensor*> by_name;
  for (const auto& t : b.tensors)
    if (!by_name.emplace(t.name, &t).second) throw std::invalid_argument(tag + "holds tensor '" + t.name + "' twice");
  bundle_contents out;
  for (const auto& info : layout.infos) {
    auto it = by_name.find(info.name);
    if (it == by_name.end()) throw std::invalid_argument(tag + "tensor '" + info.name + "' is missing");
    const quant::bundle_tensor& t = *it->second;
    auto dims = [](const std::vector<int64_t>& s) {
      std::string o = "[";
      for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
      return o + "]";
    };
    if (t.shape != info.shape)
      throw std::invalid_argument(tag + "tensor '" + info.name + "' has shape " + dims(t.shape) + ", the model's is " + dims(info.shape));
    const bundle_dtype want = dtype_for(cfg, policy, info);
    auto dtype_name = [](bundle_dtype d) { return d == bundle_dtype::fp8 ? "fp8" : d == bundle_dtype::bf16 ? "bf16" : "f32"; };
    if (t.dtype != want)
      throw std::invalid_argument(tag + "tensor '" + info.name + "' is " + dtype_name(t.dtype) + ", the precision policy needs " +
                                  dtype_name(want));
    if (t.dtype == bundle_dtype::fp8) {
      quant::qtensor q;
      q.name = t.name;
      q.rows = t.shape[0];
      q.cols = t.shape[1];
      q.layout = quant::qlayout::block_128x128;
      q.mode = b.snapshot.mode;
      q.data = t.bytes;
      q.scale_inv = b.snapshot.weight_scales.at(t.name);
      out.fp8.emplace(t.name, std::move(q));
      continue;
    }
    std::vector<float> v(static_cast<size_t>(info.numel));
    if (t.dtype == bundle_dtype::f32) {
      std::memcpy(v.data(), t.bytes.data(), v.size() * 4);
    } else {
      for (int64_t i = 0; i < info.numel; ++i) {
        uint16_t x;
        std::memcpy(&x, t.bytes.data() + 2 * i, 2);
        v[i] = quant::bf16_to_float(x);
      }
    }
    out.values.emplace(t.name, std::move(v));
  }
  for (const auto& info : layout.infos) by_name.erase(info.name);  // what is left has no place in the model
  if (!by_name.empty())
    throw std::invalid_argument(tag + "holds tensor '" + by_name.begin()->first + "', which this config does not have");
  if (b.snapshot.has_attention_scales()) out.attn = {b.snapshot.q_scale, b.snapshot.k_scale, b.snapshot.v_scale};
  return out;
}

}  // namespace fp8rl::models
