// gpu/device.cpp -- device discovery and error reporting.
#include "gpu/device.hpp"

#include <sstream>

namespace fp8rl::gpu {

std::string cuda_text(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }
std::string cublas_text(cublasStatus_t s) { return std::string(cublasLtGetStatusName(s)) + ": " + cublasLtGetStatusString(s); }
std::string nccl_text(ncclResult_t r) { return ncclGetErrorString(r); }

int gpu_current_device() {
  int d = -1;
  return cudaGetDevice(&d) == cudaSuccess ? d : -1;
}

void gpu_fail(const char* lib, const char* stmt, const char* file, int line, long code, const std::string& text) {
  std::ostringstream os;
  os << lib << " error " << code << " (" << text << ") in '" << stmt << "' at " << file << ":" << line << " on device "
     << gpu_current_device();
  throw gpu_error(os.str());
}

device_info device_query() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return {0, cuda_text(e)};
  }
  if (n <= 0) return {0, "the CUDA runtime reports no device"};
  return {n, ""};
}

int device_count() { return device_query().count; }

bool has_device() { return device_count() > 0; }

std::string device_name(int dev) {
  cudaDeviceProp p{};
  FP8RL_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

}  // namespace fp8rl::gpu
