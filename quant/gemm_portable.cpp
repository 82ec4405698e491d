// quant/gemm_portable.cpp -- plain C++ kernels on the packed panels, for CPUs without
// AVX512_BF16. Same per-element order as the references (explicit std::fma, DAZ/FTZ where the
// model has it), so results are bit-identical to them; oneTBB over panels.
#include <tbb/parallel_for.h>

#include <cfloat>
#include <cmath>

#include "quant/fp8.hpp"
#include "quant/gemm_impl.hpp"

namespace fp8rl::quant::detail {
namespace {
inline float daz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }
inline float ftz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }
}  // namespace

void gemm_f32_portable(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C) {
  const int64_t K = d.K, N = d.N;
  tbb::parallel_for(int64_t{0}, B.panels(), [&](int64_t pn) {
    const float* P = B.f32.data() + pn * K * 32;
    const int64_t nc = std::min<int64_t>(32, N - pn * 32);
    for (int64_t m = 0; m < d.M; ++m) {
      float acc[32] = {};
      for (int64_t k = 0; k < K; ++k) {
        const float a = A[m * K + k];
        for (int j = 0; j < 32; ++j) acc[j] = std::fma(a, P[k * 32 + j], acc[j]);
      }
      for (int64_t j = 0; j < nc; ++j) C[m * N + pn * 32 + j] = acc[j];
    }
  });
}

void gemm_bf16_portable(int64_t M, const uint16_t* A, int64_t lda, const gemm_packed_b& B, float* C) {
  const int64_t KH = B.Kp / 2, N = B.N;
  tbb::parallel_for(int64_t{0}, B.panels(), [&](int64_t pn) {
    const uint16_t* P = B.bf16.data() + pn * KH * 64;
    const int64_t nc = std::min<int64_t>(32, N - pn * 32);
    for (int64_t m = 0; m < M; ++m) {
      float acc[32] = {};
      for (int64_t i = 0; i < KH; ++i) {
        const float a1 = daz(bf16_to_float(A[m * lda + 2 * i + 1]));
        const float a0 = daz(bf16_to_float(A[m * lda + 2 * i]));
        for (int j = 0; j < 32; ++j) {
          acc[j] = ftz(std::fma(a1, daz(bf16_to_float(P[i * 64 + 2 * j + 1])), acc[j]));
          acc[j] = ftz(std::fma(a0, daz(bf16_to_float(P[i * 64 + 2 * j])), acc[j]));
        }
      }
      for (int64_t j = 0; j < nc; ++j) C[m * N + pn * 32 + j] = acc[j];
    }
  });
}

void gemm_fp8_portable(const fp8_a_operand& A, const gemm_packed_b& B, float* C) {
  const int64_t KH = B.Kp / 2, KB = B.Kp / kBlock, N = B.N;
  tbb::parallel_for(int64_t{0}, B.panels(), [&](int64_t pn) {
    const uint16_t* P = B.bf16.data() + pn * KH * 64;
    const float* sb = B.scale_inv.data() + pn * KB * 32;
    const int64_t nc = std::min<int64_t>(32, N - pn * 32);
    for (int64_t m = 0; m < A.M; ++m) {
      float out[32] = {};
      for (int64_t kb = 0; kb < KB; ++kb) {
        float acc[32] = {};
        for (int64_t i = kb * 64; i < kb * 64 + 64; ++i) {
          const float a1 = bf16_to_float(A.bf16[m * A.Kp + 2 * i + 1]);
          const float a0 = bf16_to_float(A.bf16[m * A.Kp + 2 * i]);
          for (int j = 0; j < 32; ++j) {
            acc[j] = std::fma(a1, bf16_to_float(P[i * 64 + 2 * j + 1]), acc[j]);
            acc[j] = std::fma(a0, bf16_to_float(P[i * 64 + 2 * j]), acc[j]);
          }
        }
        const float sa = A.scale_inv[m * KB + kb];
        for (int j = 0; j < 32; ++j) out[j] = std::fma(sa * sb[kb * 32 + j], acc[j], out[j]);
      }
      for (int64_t j = 0; j < nc; ++j) C[m * N + pn * 32 + j] = out[j];
    }
  });
}

}  // namespace fp8rl::quant::detail
