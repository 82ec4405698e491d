// gpu/cublaslt_gemm.hpp -- cuBLASLt GEMMs: BF16, and blockwise FP8 with VEC128_32F (activations)
// x BLK128x128_32F (weights) scales, TN layout, FAST_ACCUM off (fp8-numerics.md §7).
// defines: lt_gemm_desc, lt_gemm_config, lt_layout_plan, lt_plan, lt_gemm
//
// Problem (lt_gemm_desc) and tuning (lt_gemm_config) are separate; lt_plan is the host-side
// layout computation (testable without a GPU): fprop Y[M,N] = X[M,K]·W[N,K]^T is issued as
// D(N x M, col-major) = op(A=W)^T · B=X with A: K x N (ld K), B: K x M (ld K), D: N x M (ld N).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fp8rl::gpu {

enum class lt_dtype : uint8_t { e4m3, bf16, f32 };

struct lt_gemm_desc {  // the problem
  int64_t M = 0, N = 0, K = 0;
  lt_dtype in = lt_dtype::e4m3;   // operand type (both)
  lt_dtype out = lt_dtype::bf16;  // D type (bf16 or f32)
  std::string str() const;
};

struct lt_gemm_config {  // tuning only
  size_t workspace_bytes = size_t{32} << 20;  // cuBLASLt on Hopper wants 32 MiB
  bool fast_accum = false;                    // never on for training numerics
  bool deterministic_reduction = true;        // REDUCTION_SCHEME_NONE
};

struct lt_layout_plan {
  int64_t a_rows = 0, a_cols = 0, a_ld = 0;  // A = W
  int64_t b_rows = 0, b_cols = 0, b_ld = 0;  // B = X
  int64_t d_rows = 0, d_cols = 0, d_ld = 0;  // D = Y^T
  int64_t a_scale_count = 0, b_scale_count = 0;  // BLK128x128 for W, VEC128 for X (fp8 only)
  std::vector<std::string> problems;             // requirements the shape violates (empty: ok)
};
lt_layout_plan lt_plan(const lt_gemm_desc& d);

// A cuBLASLt handle + workspace; run() issues one GEMM (device pointers, default stream).
class lt_gemm {
 public:
  explicit lt_gemm(lt_gemm_config cfg = {});
  ~lt_gemm();
  lt_gemm(const lt_gemm&) = delete;
  lt_gemm& operator=(const lt_gemm&) = delete;
  // FP8: w/x are E4M3 codes with scale arrays in quant/'s cuBLASLt layouts; BF16: scales null.
  // Throws gpu_error when cuBLASLt has no algorithm for the problem (names the shape). The
  // descriptors and the heuristic's algorithm are made once per problem and kept (a decode step
  // issues the same few shapes hundreds of times; the query cost more than an M = 8 GEMM).
  void run(const lt_gemm_desc& d, const void* w, const float* w_sinv, const void* x, const float* x_sinv, void* y);

 private:
  struct plan;  // descriptors + algorithm of one problem (cublaslt_gemm.cpp)
  plan& plan_for(const lt_gemm_desc& d);
  lt_gemm_config cfg_;
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<std::string, std::unique_ptr<plan>> plans_;  // by lt_gemm_desc::str()
};

}  // namespace fp8rl::gpu
