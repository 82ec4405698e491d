// quant/gemm_ref.cpp -- scalar reference GEMMs: the definition of every result bit.
// Built with -ffp-contract=off; every fused operation is an explicit std::fma.
#include <algorithm>
#include <cmath>
#include <cfloat>
#include <sstream>
#include <stdexcept>

#include "quant/fp8.hpp"
#include "quant/gemm.hpp"

namespace fp8rl::quant {

void gemm_desc::check() const {
  auto bad = [&](const char* dim, int64_t v) {
    throw std::invalid_argument("gemm " + str() + ": " + dim + " = " + std::to_string(v) +
                                " must be >= 0");
  };
  if (M < 0) bad("M", M);
  if (N < 0) bad("N", N);
  if (K < 0) bad("K", K);
}

std::string gemm_desc::str() const {
  std::ostringstream os;
  os << "[M=" << M << " N=" << N << " K=" << K << "]";
  return os.str();
}

namespace {
// VDPBF16PS: "input denormals are treated as zero", "output denormals are flushed to zero".
inline float daz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }
inline float ftz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

void check_fp8_operands(const qtensor& A, const qtensor& B) {
  if (A.layout == qlayout::block_128x128)
    throw std::invalid_argument("gemm_fp8: A '" + A.name +
                                "' uses 128x128 blocks; A needs 1x128 tiles (2Dx2D is rejected)");
  if (A.op_cols() != B.op_cols())
    throw std::invalid_argument("gemm_fp8: K mismatch: A '" + A.name + "' has K=" +
                                std::to_string(A.op_cols()) + ", B '" + B.name + "' has K=" +
                                std::to_string(B.op_cols()));
  if (A.mode != B.mode)
    throw std::invalid_argument("gemm_fp8: scale modes differ between '" + A.name + "' and '" +
                                B.name + "'");
}
}  // namespace

void gemm_f32_ref(const gemm_desc& d, const float* A, const float* B, float* C) {
  d.check();
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) {
      float out = 0.0f;
      for (int64_t k = 0; k < d.K; ++k) out = std::fma(A[m * d.K + k], B[n * d.K + k], out);
      C[m * d.N + n] = out;
    }
}

void gemm_bf16_ref(const gemm_desc& d, const uint16_t* A, const uint16_t* B, float* C) {
  d.check();
  auto at = [&](const uint16_t* X, int64_t r, int64_t k) {
    return k < d.K ? daz(bf16_to_float(X[r * d.K + k])) : 0.0f;
  };
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < d.K; k += 2) {
        acc = ftz(std::fma(at(A, m, k + 1), at(B, n, k + 1), acc));  // odd element first
        acc = ftz(std::fma(at(A, m, k), at(B, n, k), acc));
      }
      C[m * d.N + n] = acc;
    }
}

void gemm_fp8_ref(const qtensor& A, const qtensor& B, float* C) {
  check_fp8_operands(A, B);
  const int64_t M = A.op_rows(), N = B.op_rows(), K = A.op_cols();
  const float* lut = e4m3_table();
  auto at = [&](const qtensor& X, int64_t r, int64_t k) {
    return k < K ? lut[X.data[r * K + k]] : 0.0f;
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float out = 0.0f;
      for (int64_t kb = 0; kb * kBlock < K; ++kb) {
        float acc = 0.0f;
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          const int64_t k = kb * kBlock + 2 * i;
          acc = std::fma(at(A, m, k + 1), at(B, n, k + 1), acc);  // odd element first
          acc = std::fma(at(A, m, k), at(B, n, k), acc);
        }
        const float s = A.scale_at(m, kb) * B.scale_at(n, kb);  // rounded before the FMA
        out = std::fma(s, acc, out);
      }
      C[m * N + n] = out;
    }
}

void gemm_fp8_exact_ref(const qtensor& A, const qtensor& B, float* C) {
  check_fp8_operands(A, B);
  const int64_t M = A.op_rows(), N = B.op_rows(), K = A.op_cols();
  // q * 2^9 is an integer for every finite E4M3 value (|q * 2^9| <= 448 * 512 < 2^18), so a
  // product is an integer number of 2^-18 and a 128-term sum stays below 2^43: exact in int64.
  // The NaN codes (0x7F, 0xFF) never come out of quant/'s encoders; a block that holds one
  // gives NaN, as in gemm_fp8_ref.
  int32_t units[256];
  for (int c = 0; c < 256; ++c)
    units[c] = (c & 0x7F) == 0x7F ? 0 : static_cast<int32_t>(std::ldexp(e4m3_table()[c], 9));
  auto is_nan = [](uint8_t c) { return (c & 0x7F) == 0x7F; };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float out = 0.0f;
      for (int64_t kb = 0; kb * kBlock < K; ++kb) {
        int64_t sum = 0;
        bool nan = false;
        for (int64_t k = kb * kBlock; k < std::min(K, (kb + 1) * kBlock); ++k) {
          const uint8_t a = A.data[m * K + k], b = B.data[n * K + k];
          sum += int64_t(units[a]) * units[b];
          nan |= is_nan(a) || is_nan(b);
        }
        // int64 -> float rounds to nearest even (the default mode); the 2^-18 scaling is exact
        // (a nonzero |sum| >= 1 unit stays a normal float).
        const float acc = nan ? std::nanf("") : std::ldexp(static_cast<float>(sum), -18);
        const float s = A.scale_at(m, kb) * B.scale_at(n, kb);  // rounded before the FMA
        out = std::fma(s, acc, out);
      }
      C[m * N + n] = out;
    }
}

}  // namespace fp8rl::quant
