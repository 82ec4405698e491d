// quant/gemm_portable.cpp -- plain C++ kernel on the wide (FP32) panels, for CPUs without
// AVX-512. Same per-element order as the references (explicit std::fma; DAZ/FTZ for the BF16
// pair model), so results are bit-identical to them; oneTBB over panels.
#include <tbb/parallel_for.h>

#include <cfloat>
#include <cmath>

#include "quant/gemm_impl.hpp"

namespace fp8rl::quant::detail {
namespace {
inline float flush(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }
}  // namespace

void gemm_wide_portable(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C) {
  const int64_t N = B.N, Kp = B.Kp, KB = Kp / kBlock;
  const bool daz = model == gemm_model::pairs;
  auto step = [&](float a, const float* b, float* acc) {
    if (daz) {
      a = flush(a);
      for (int j = 0; j < 32; ++j) acc[j] = flush(std::fma(a, flush(b[j]), acc[j]));
    } else {
      for (int j = 0; j < 32; ++j) acc[j] = std::fma(a, b[j], acc[j]);
    }
  };
  tbb::parallel_for(int64_t{0}, B.panels(), [&](int64_t pn) {
    const float* P = B.wide.data() + pn * Kp * 32;
    const int64_t nc = std::min<int64_t>(32, N - pn * 32);
    for (int64_t m = 0; m < A.M; ++m) {
      const float* a = A.f32 + m * A.lda;
      float out[32] = {};
      auto dot = [&](int64_t k0, int64_t k1, float* acc) {
        if (model == gemm_model::seq) {
          for (int64_t k = k0; k < k1; ++k) step(a[k], P + k * 32, acc);
        } else {
          for (int64_t k = k0; k < k1; k += 2) {
            step(a[k + 1], P + (k + 1) * 32, acc);  // odd element first
            step(a[k], P + k * 32, acc);
          }
        }
      };
      if (model != gemm_model::fp8) {
        dot(0, Kp, out);
      } else {
        for (int64_t kb = 0; kb < KB; ++kb) {
          float acc[32] = {};
          dot(kb * kBlock, (kb + 1) * kBlock, acc);
          const float sa = A.scale_inv[m * KB + kb];
          const float* sb = B.scale_inv.data() + (pn * KB + kb) * 32;
          for (int j = 0; j < 32; ++j) out[j] = std::fma(sa * sb[j], acc[j], out[j]);
        }
      }
      for (int64_t j = 0; j < nc; ++j) C[m * N + pn * 32 + j] = out[j];
    }
  });
}

}  // namespace fp8rl::quant::detail
