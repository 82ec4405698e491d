// quant/gemm.cpp -- GEMM dispatch: checks operands, prepares A, picks the kernel.
#include <tbb/parallel_for.h>

#include <stdexcept>

#include "quant/fp8.hpp"
#include "quant/gemm_impl.hpp"

namespace fp8rl::quant {
namespace {

cpu_isa effective_isa(const gemm_config& cfg) {
  cpu_isa a = cpu_isa_active();
  return a < cfg.max_isa ? a : cfg.max_isa;
}

void check_packed(const gemm_desc& d, const gemm_packed_b& B, gemm_dtype want, const char* fn) {
  d.check();
  if (B.dtype != want)
    throw std::invalid_argument(std::string(fn) + ": B '" + B.name + "' was packed for another dtype");
  if (B.N != d.N || B.K != d.K)
    throw std::invalid_argument(std::string(fn) + ": B '" + B.name + "' is [" + std::to_string(B.N) +
                                ", " + std::to_string(B.K) + "], problem is " + d.str());
}

}  // namespace

void gemm_f32(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C,
              const gemm_config& cfg) {
  check_packed(d, B, gemm_dtype::f32, "gemm_f32");
  if (d.M == 0 || d.N == 0) return;
  if (effective_isa(cfg) >= cpu_isa::avx512) detail::gemm_f32_avx512(d, A, B, C);
  else detail::gemm_f32_portable(d, A, B, C);
}

void gemm_bf16(const gemm_desc& d, const uint16_t* A, const gemm_packed_b& B, float* C,
               const gemm_config& cfg) {
  check_packed(d, B, gemm_dtype::bf16, "gemm_bf16");
  if (d.M == 0 || d.N == 0) return;
  avector<uint16_t> padded;
  const uint16_t* a = A;
  int64_t lda = d.K;
  if (d.K % 2) {  // odd K: zero-pad A to the packed pair count
    lda = B.Kp;
    padded.assign(static_cast<size_t>(d.M * lda), 0);
    for (int64_t m = 0; m < d.M; ++m)
      for (int64_t k = 0; k < d.K; ++k) padded[m * lda + k] = A[m * d.K + k];
    a = padded.data();
  }
  if (effective_isa(cfg) >= cpu_isa::avx512_bf16) detail::gemm_bf16_avx512(d.M, a, lda, B, C);
  else detail::gemm_bf16_portable(d.M, a, lda, B, C);
}

void gemm_fp8(const qtensor& A, const gemm_packed_b& B, float* C, const gemm_config& cfg) {
  if (A.layout == qlayout::block_128x128)
    throw std::invalid_argument("gemm_fp8: A '" + A.name +
                                "' uses 128x128 blocks; A needs 1x128 tiles (2Dx2D is rejected)");
  const gemm_desc d{A.op_rows(), B.N, A.op_cols()};
  check_packed(d, B, gemm_dtype::fp8, "gemm_fp8");
  if (A.mode != B.mode)
    throw std::invalid_argument("gemm_fp8: scale modes differ between '" + A.name + "' and '" + B.name + "'");
  if (d.M == 0 || d.N == 0) return;
  const cpu_isa isa = effective_isa(cfg);
  detail::fp8_a_operand a;
  a.M = d.M;
  a.Kp = B.Kp;
  a.KB = B.Kp / kBlock;
  a.bf16.assign(static_cast<size_t>(a.M * a.Kp), 0);
  a.scale_inv.assign(static_cast<size_t>(a.M * a.KB), 0.0f);
  tbb::parallel_for(int64_t{0}, a.M, [&](int64_t m) {
    const uint8_t* src = A.data.data() + m * d.K;
    uint16_t* dst = a.bf16.data() + m * a.Kp;
    if (isa >= cpu_isa::avx512_bf16) {
      detail::e4m3_to_bf16_avx512(src, d.K, dst);
    } else {
      const float* lut = e4m3_table();
      for (int64_t k = 0; k < d.K; ++k) dst[k] = bf16_from_float(lut[src[k]]);
    }
    for (int64_t kb = 0; kb < a.KB; ++kb) a.scale_inv[m * a.KB + kb] = A.scale_at(m, kb);
  });
  if (isa >= cpu_isa::avx512_bf16)
    detail::gemm_fp8_avx512(a, B, C, d.M <= cfg.fp8_stream_max_m);
  else
    detail::gemm_fp8_portable(a, B, C);
}

}  // namespace fp8rl::quant
