// gpu/cublaslt_gemm.cpp -- cuBLASLt matmul descriptors, heuristic query and launch.
#include "gpu/cublaslt_gemm.hpp"

#include <cublasLt.h>

#include "gpu/device.hpp"

namespace fp8rl::gpu {

struct lt_gemm::plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t A = nullptr, B = nullptr, D = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fp8 = false;
  plan() = default;
  plan(const plan&) = delete;
  plan& operator=(const plan&) = delete;
  ~plan() {
    if (D) cublasLtMatrixLayoutDestroy(D);
    if (B) cublasLtMatrixLayoutDestroy(B);
    if (A) cublasLtMatrixLayoutDestroy(A);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

namespace {
struct preference {  // RAII for the heuristic's preference object
  cublasLtMatmulPreference_t p = nullptr;
  preference() { FP8RL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~preference() { cublasLtMatmulPreferenceDestroy(p); }
  preference(const preference&) = delete;
  preference& operator=(const preference&) = delete;
};
}  // namespace

lt_gemm::lt_gemm(lt_gemm_config cfg) : cfg_(cfg) {
  cublasLtHandle_t h;
  FP8RL_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (const cudaError_t e = cudaMalloc(&workspace_, cfg_.workspace_bytes); e != cudaSuccess) {
    cublasLtDestroy(h);  // the destructor does not run for a constructor that throws
    handle_ = nullptr;
    FP8RL_CUDA_CHECK(e);
  }
}

lt_gemm::~lt_gemm() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

lt_gemm::plan& lt_gemm::plan_for(const lt_gemm_desc& d) {
  const std::string key = d.str();
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  const lt_layout_plan p = lt_plan(d);
  if (!p.problems.empty()) throw gpu_error("cuBLASLt GEMM " + d.str() + ": " + p.problems.front());
  auto pl = std::make_unique<plan>();  // frees what was made if a call below throws
  pl->fp8 = d.in == lt_dtype::e4m3;
  const cudaDataType_t in = pl->fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, out = d.out == lt_dtype::f32 ? CUDA_R_32F : CUDA_R_16BF;
  FP8RL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&pl->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (pl->fp8) {
    const int8_t fast = cfg_.fast_accum ? 1 : 0;
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    const int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
  }
  FP8RL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&pl->A, in, static_cast<uint64_t>(p.a_rows), static_cast<uint64_t>(p.a_cols), p.a_ld));
  FP8RL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&pl->B, in, static_cast<uint64_t>(p.b_rows), static_cast<uint64_t>(p.b_cols), p.b_ld));
  FP8RL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&pl->D, out, static_cast<uint64_t>(p.d_rows), static_cast<uint64_t>(p.d_cols), p.d_ld));
  preference pref;
  FP8RL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &cfg_.workspace_bytes, sizeof cfg_.workspace_bytes));
  if (cfg_.deterministic_reduction) {
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE;
    FP8RL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask));
  }
  cublasLtMatmulHeuristicResult_t res{};
  int n = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), pl->op, pl->A, pl->B, pl->D, pl->D, pref.p, 1, &res, &n);
  if (hs != CUBLAS_STATUS_SUCCESS || n == 0)
    throw gpu_error("cuBLASLt has no algorithm for " + d.str() + (pl->fp8 ? " with VEC128_32F x BLK128x128_32F scales" : "") +
                    " on this GPU (block scaling needs cuBLAS >= 12.9 and sm_90): " + cublas_text(hs));
  pl->algo = res.algo;
  return *plans_.emplace(key, std::move(pl)).first->second;
}

void lt_gemm::run(const lt_gemm_desc& d, const void* w, const float* w_sinv, const void* x, const float* x_sinv, void* y) {
  plan& pl = plan_for(d);
  if (pl.fp8) {  // this call's scale arrays
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_sinv, sizeof w_sinv));
    FP8RL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_sinv, sizeof x_sinv));
  }
  const float alpha = 1.0f, beta = 0.0f;
  FP8RL_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), pl.op, &alpha, w, pl.A, x, pl.B, &beta, y, pl.D, y,
                                    pl.D, &pl.algo, workspace_, cfg_.workspace_bytes, nullptr));
}

}  // namespace fp8rl::gpu
