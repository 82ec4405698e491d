// quant/bundle.cpp -- bundle validation.
#include "quant/bundle.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <tuple>

#include "quant/qtensor.hpp"

namespace fp8rl::quant {

int64_t bundle_tensor::numel() const {  // -1 for a shape beyond any tensor (a product that could wrap)
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || d > kMaxTensorDim || (d > 0 && n > kMaxTensorElems / d)) return -1;  // n * d itself could wrap
    n *= d;
  }
  return n;
}

int64_t weight_bundle::bytes() const {
  int64_t n = 0;
  for (const auto& t : tensors) n += static_cast<int64_t>(t.bytes.size());
  for (const auto& [name, s] : snapshot.weight_scales) n += static_cast<int64_t>(s.size() * 4);
  n += static_cast<int64_t>((snapshot.q_scale.size() + snapshot.k_scale.size() + snapshot.v_scale.size()) * 4);
  return n;
}

void bundle_validate(const weight_bundle& b, bool needs_attention_scales) {
  const scale_snapshot& s = b.snapshot;
  const std::string tag = "bundle v" + std::to_string(b.weight_version) + " (snapshot " +
                          std::to_string(s.weight_version) + "," + std::to_string(s.scale_version) + "): ";
  if (s.weight_version != b.weight_version)
    throw std::invalid_argument(tag + "snapshot weight_version differs from the bundle's");
  for (const auto& t : b.tensors) {
    if (t.numel() < 0) throw std::invalid_argument(tag + "tensor '" + t.name + "' has a shape beyond any tensor");
    const int64_t esize = t.dtype == bundle_dtype::f32 ? 4 : t.dtype == bundle_dtype::bf16 ? 2 : 1;
    if (static_cast<int64_t>(t.bytes.size()) != t.numel() * esize)
      throw std::invalid_argument(tag + "tensor '" + t.name + "' holds " + std::to_string(t.bytes.size()) +
                                  " bytes, its shape needs " + std::to_string(t.numel() * esize));
    if (t.dtype != bundle_dtype::fp8) {  // never a weight from non-finite values (fp8-numerics §3.3)
      for (int64_t i = 0, n = t.numel(); i < n; ++i) {
        uint32_t u = 0;
        std::memcpy(reinterpret_cast<char*>(&u) + (esize == 2 ? 2 : 0), t.bytes.data() + i * esize, static_cast<size_t>(esize));
        if ((u & 0x7f800000u) == 0x7f800000u)
          throw std::invalid_argument(tag + "tensor '" + t.name + "' element " + std::to_string(i) + " is not finite");
      }
      continue;
    }
    if (t.shape.size() != 2) throw std::invalid_argument(tag + "FP8 tensor '" + t.name + "' is not a matrix");
    auto it = s.weight_scales.find(t.name);
    if (it == s.weight_scales.end()) throw std::invalid_argument(tag + "scale of FP8 tensor '" + t.name + "' is missing");
    qtensor shape_only;
    shape_only.rows = t.shape[0];
    shape_only.cols = t.shape[1];
    shape_only.layout = qlayout::block_128x128;
    if (static_cast<int64_t>(it->second.size()) != shape_only.scale_count())
      throw std::invalid_argument(tag + "FP8 tensor '" + t.name + "' has " + std::to_string(it->second.size()) +
                                  " block scales, needs " + std::to_string(shape_only.scale_count()));
    for (int64_t rb = 0; rb * kBlock < t.shape[0]; ++rb)
      for (int64_t kb = 0; kb < shape_only.k_blocks(); ++kb) {
        const float v = it->second[rb * shape_only.scale_ld() + kb];
        if (!(v > 0.0f) || !std::isfinite(v))
          throw std::invalid_argument(tag + "FP8 tensor '" + t.name + "' block (" + std::to_string(rb) + ", " +
                                      std::to_string(kb) + ") scale is missing or invalid");
      }
    for (uint8_t c : t.bytes)
      if ((c & 0x7f) == 0x7f) throw std::invalid_argument(tag + "FP8 tensor '" + t.name + "' holds a NaN code");
  }
  if (!needs_attention_scales) return;
  const size_t L = static_cast<size_t>(s.layers);
  if (s.layers <= 0) throw std::invalid_argument(tag + "FP8 attention/KV-cache scales are missing (layers " + std::to_string(s.layers) + ")");
  for (const auto& [v, what, per] : {std::tuple{&s.q_scale, "Q", s.heads}, {&s.k_scale, "K", s.kv_heads}, {&s.v_scale, "V", s.kv_heads}})
    if (v->size() != L * static_cast<size_t>(per))
      throw std::invalid_argument(tag + "FP8 attention/KV-cache " + what + " scales: " + std::to_string(v->size()) + ", expected " +
                                  std::to_string(s.layers) + " layers x " + std::to_string(per) + " heads");
  auto check = [&](const std::vector<float>& v, const char* what, int32_t per) {
    for (size_t i = 0; i < v.size(); ++i)
      if (!(v[i] > 0.0f) || !std::isfinite(v[i]))
        throw std::invalid_argument(tag + what + " scale of layer " + std::to_string(i / per) + " head " +
                                    std::to_string(i % per) + " is missing or invalid");
  };
  check(s.q_scale, "Q", s.heads);
  check(s.k_scale, "K", s.kv_heads);
  check(s.v_scale, "V", s.kv_heads);
}

}  // namespace fp8rl::quant
