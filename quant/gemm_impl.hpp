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

// The accumulation model of a kernel (quant/gemm.hpp): sequential FP32, BF16 pairs (odd element
// first, DAZ/FTZ), or FP8 (pairs per 128-K block, then the scaled promotion).
enum class gemm_model : uint8_t { seq, pairs, fp8 };

// A operand prepared for a kernel: values zero-padded to lda = Kp, as FP32 (wide kernels) or
// BF16 (narrow kernels); FP8 scales [M][KB].
struct gemm_a_operand {
  int64_t M = 0, lda = 0;
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const float* scale_inv = nullptr;
};

void gemm_wide_avx512(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C);
void gemm_narrow_avx512(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C);
void gemm_wide_portable(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C);
void e4m3_to_bf16_avx512(const uint8_t* src, int64_t n, uint16_t* dst);

}  // namespace fp8rl::quant::detail
