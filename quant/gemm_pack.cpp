// quant/gemm_pack.cpp -- packs B operands into 32-column panels (layouts: quant/gemm.hpp).
#include <tbb/parallel_for.h>

#include <stdexcept>

#include "quant/fp8.hpp"
#include "quant/gemm_impl.hpp"

namespace fp8rl::quant {

int64_t gemm_packed_b::bytes() const {
  return static_cast<int64_t>(f32.size() * 4 + bf16.size() * 2 + fp8.size() + scale_inv.size() * 4);
}

gemm_packed_b gemm_pack_f32(const float* B, int64_t N, int64_t K, std::string name) {
  gemm_desc{0, N, K}.check();
  gemm_packed_b p;
  p.dtype = gemm_dtype::f32;
  p.name = std::move(name);
  p.N = N;
  p.K = p.Kp = K;
  const int64_t NP = p.panels();
  p.f32.assign(static_cast<size_t>(NP * K * 32), 0.0f);
  tbb::parallel_for(int64_t{0}, NP, [&](int64_t pn) {
    float* dst = p.f32.data() + pn * K * 32;
    for (int64_t j = 0; j < 32 && pn * 32 + j < N; ++j) {
      const float* src = B + (pn * 32 + j) * K;
      for (int64_t k = 0; k < K; ++k) dst[k * 32 + j] = src[k];
    }
  });
  return p;
}

gemm_packed_b gemm_pack_bf16(const uint16_t* B, int64_t N, int64_t K, std::string name) {
  gemm_desc{0, N, K}.check();
  gemm_packed_b p;
  p.dtype = gemm_dtype::bf16;
  p.name = std::move(name);
  p.N = N;
  p.K = K;
  p.Kp = (K + 1) / 2 * 2;
  const int64_t NP = p.panels(), KH = p.Kp / 2;
  p.bf16.assign(static_cast<size_t>(NP * KH * 64), 0);
  tbb::parallel_for(int64_t{0}, NP, [&](int64_t pn) {
    uint16_t* dst = p.bf16.data() + pn * KH * 64;
    for (int64_t j = 0; j < 32 && pn * 32 + j < N; ++j) {
      const uint16_t* src = B + (pn * 32 + j) * K;
      for (int64_t k = 0; k < K; ++k) dst[(k / 2) * 64 + 2 * j + (k & 1)] = src[k];
    }
  });
  return p;
}

gemm_packed_b gemm_pack_fp8(const qtensor& B) {
  gemm_packed_b p;
  p.dtype = gemm_dtype::fp8;
  p.mode = B.mode;
  p.name = B.name;
  p.N = B.op_rows();
  p.K = B.op_cols();
  p.Kp = (p.K + kBlock - 1) / kBlock * kBlock;
  const int64_t NP = p.panels(), KH = p.Kp / 2, KB = p.Kp / kBlock, N = p.N, K = p.K;
  p.bf16.assign(static_cast<size_t>(NP * KH * 64), 0);
  p.fp8.assign(static_cast<size_t>(NP * KH * 64), 0);
  p.scale_inv.assign(static_cast<size_t>(NP * KB * 32), 0.0f);
  const float* lut = e4m3_table();
  tbb::parallel_for(int64_t{0}, NP, [&](int64_t pn) {
    uint16_t* wide = p.bf16.data() + pn * KH * 64;
    uint8_t* narrow = p.fp8.data() + pn * KH * 64;
    float* sc = p.scale_inv.data() + pn * KB * 32;
    for (int64_t j = 0; j < 32 && pn * 32 + j < N; ++j) {
      const int64_t n = pn * 32 + j;
      const uint8_t* src = B.data.data() + n * K;
      for (int64_t k = 0; k < K; ++k) {
        const int h = static_cast<int>(k & 1);
        wide[(k / 2) * 64 + 2 * j + h] = bf16_from_float(lut[src[k]]);  // exact
        narrow[(k / 2) * 64 + detail::fp8_stream_pos(static_cast<int>(j), h)] = src[k];
      }
      for (int64_t kb = 0; kb < KB; ++kb) sc[kb * 32 + j] = B.scale_at(n, kb);
    }
  });
  return p;
}

}  // namespace fp8rl::quant
