// gpu/check.hpp -- one check-macro generator for CUDA, cuBLASLt and NCCL calls (ggml's
// CUDA_CHECK_GEN idea): a failing call throws gpu_error naming the statement, file:line, the
// device and the library's own error text. Always on (no NDEBUG dependence).
#pragma once
#include <stdexcept>
#include <string>

namespace fp8rl::gpu {

struct gpu_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void gpu_fail(const char* lib, const char* stmt, const char* file, int line, long code, const std::string& text);
int gpu_current_device();  // -1 when unknown

}  // namespace fp8rl::gpu

#define FP8RL_GPU_CHECK_GEN(lib, expr, ok, text_fn)                                                     \
  do {                                                                                                  \
    const auto fp8rl_rc_ = (expr);                                                                      \
    if (fp8rl_rc_ != (ok))                                                                              \
      ::fp8rl::gpu::gpu_fail(lib, #expr, __FILE__, __LINE__, static_cast<long>(fp8rl_rc_), text_fn(fp8rl_rc_)); \
  } while (0)

#define FP8RL_CUDA_CHECK(expr) FP8RL_GPU_CHECK_GEN("CUDA", expr, cudaSuccess, ::fp8rl::gpu::cuda_text)
#define FP8RL_CUBLAS_CHECK(expr) FP8RL_GPU_CHECK_GEN("cuBLASLt", expr, CUBLAS_STATUS_SUCCESS, ::fp8rl::gpu::cublas_text)
#define FP8RL_NCCL_CHECK(expr) FP8RL_GPU_CHECK_GEN("NCCL", expr, ncclSuccess, ::fp8rl::gpu::nccl_text)
