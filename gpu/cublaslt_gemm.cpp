// gpu/cublaslt_gemm.cpp -- cuBLASLt matmul descriptors, heuristic query and launch.
#include "gpu/cublaslt_gemm.hpp"

#include <cublasLt.h>

#include "gpu/device.hpp"

namespace fp8rl::gpu {

lt_gemm::lt_gemm(lt_gemm_config cfg) : cfg_(cfg) {
  cublasLtHandle_t h;
  FP8RL_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  FP8RL_CUDA_CHECK(cudaMalloc(&workspace_, cfg_.workspace_bytes));
}

lt_gemm::~lt_gemm() {
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

void lt_gemm::run(const lt_gemm_desc& d, const void* w, const float* w_sinv, const void* x, const float* x_sinv, void* y) {
  const lt_layout_plan p = lt_plan(d);
  if (!p.problems.empty()) throw gpu_error("cuBLASLt GEMM " + d.str() + ": " + p.problems.front());
  const bool fp8 = d.in == lt_dtype::e4m3;
  const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, out = d.out == lt_dtype::f32 ? CUDA_R_32F : CUDA_R_16BF;
  cublasLtMatmulDesc_t op;
  FP8RL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (fp8) {
    const int8_t fast = cfg_.fast_accum ? 1 : 0;
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    const int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_sinv, sizeof w_sinv));
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_sinv, sizeof x_sinv));
  }
  cublasLtMatrixLayout_t A, B, D;
  FP8RL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&A, in, static_cast<uint64_t>(p.a_rows), static_cast<uint64_t>(p.a_cols), p.a_ld));
  FP8RL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&B, in, static_cast<uint64_t>(p.b_rows), static_cast<uint64_t>(p.b_cols), p.b_ld));
  FP8RL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&D, out, static_cast<uint64_t>(p.d_rows), static_cast<uint64_t>(p.d_cols), p.d_ld));
  cublasLtMatmulPreference_t pref;
  FP8RL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FP8RL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &cfg_.workspace_bytes, sizeof cfg_.workspace_bytes));
  if (cfg_.deterministic_reduction) {
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE;
    FP8RL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask));
  }
  cublasLtMatmulHeuristicResult_t res{};
  int n = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), op, A, B, D, D, pref, 1, &res, &n);
  if (hs != CUBLAS_STATUS_SUCCESS || n == 0) {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(A); cublasLtMatrixLayoutDestroy(B); cublasLtMatrixLayoutDestroy(D);
    cublasLtMatmulDescDestroy(op);
    throw gpu_error("cuBLASLt has no algorithm for " + d.str() + (fp8 ? " with VEC128_32F x BLK128x128_32F scales" : "") +
                    " on this GPU (block scaling needs cuBLAS >= 12.9 and sm_90): " + cublas_text(hs));
  }
  const float alpha = 1.0f, beta = 0.0f;
  FP8RL_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), op, &alpha, w, A, x, B, &beta, y, D, y, D, &res.algo,
                                    workspace_, cfg_.workspace_bytes, nullptr));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(A);
  cublasLtMatrixLayoutDestroy(B);
  cublasLtMatrixLayoutDestroy(D);
  cublasLtMatmulDescDestroy(op);
}

}  // namespace fp8rl::gpu
