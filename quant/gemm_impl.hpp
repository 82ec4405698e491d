// quant/gemm_impl.hpp -- internal: kernels behind quant/gemm.hpp's dispatch.
// Panel layouts are documented on gemm_packed_b. Kernels write C[M][N] (ldc = N).
#pragma once
#include "quant/gemm.hpp"

namespace fp8rl::quant::detail {

// Byte position of B element (column j in panel 0..31, pair half h) inside a 64-byte FP8
// pair step, chosen so that VPUNPCK{L,H}BW of the decoded bytes yields columns 0-15 and 16-31
// in VDPBF16PS pair order.
inline int fp8_stream_pos(int j, int h) {
  int w = 2 * (j & 15) + h;
  return 16 * (w / 8) + (j >= 16 ? 8 : 0) + (w % 8);
}

// A operand of the FP8 kernels: decoded (unscaled) codes [M][Kp] as BF16 and scales [M][KB].
struct fp8_a_operand {
  int64_t M = 0, Kp = 0, KB = 0;
  avector<uint16_t> bf16;
  avector<float> scale_inv;
};

void gemm_f32_avx512(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C);
void gemm_bf16_avx512(int64_t M, const uint16_t* A, int64_t lda, const gemm_packed_b& B, float* C);
void gemm_fp8_avx512(const fp8_a_operand& A, const gemm_packed_b& B, float* C, bool stream);
void e4m3_to_bf16_avx512(const uint8_t* src, int64_t n, uint16_t* dst);

void gemm_f32_portable(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C);
void gemm_bf16_portable(int64_t M, const uint16_t* A, int64_t lda, const gemm_packed_b& B, float* C);
void gemm_fp8_portable(const fp8_a_operand& A, const gemm_packed_b& B, float* C);

}  // namespace fp8rl::quant::detail
