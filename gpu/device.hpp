// gpu/device.hpp -- device discovery, RAII device memory, error texts.
// defines: device_query, device_count, has_device, device_name, dbuf, cuda_text, cublas_text, nccl_text
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "gpu/check.hpp"

namespace fp8rl::gpu {

std::string cuda_text(cudaError_t e);
std::string cublas_text(cublasStatus_t s);
std::string nccl_text(ncclResult_t r);

// What the runtime says about devices: count > 0 with an empty reason, or count 0 with the CUDA
// error that explains it ("no CUDA-capable device", a driver older than the runtime, ...). Never throws.
struct device_info {
  int count = 0;
  std::string reason;  // empty when count > 0
};
device_info device_query();
int device_count();  // device_query().count
bool has_device();
std::string device_name(int dev);

// Owning device allocation of n elements of T (plain cudaMalloc, never managed memory).
template <class T>
class dbuf {
 public:
  dbuf() = default;
  explicit dbuf(size_t n) : n_(n) { if (n) FP8RL_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T))); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  dbuf(dbuf&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  dbuf& operator=(dbuf&& o) noexcept { if (this != &o) { release(); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; } return *this; }
  ~dbuf() { release(); }
  static dbuf from(const std::vector<T>& h) {
    dbuf d(h.size());
    if (!h.empty()) FP8RL_CUDA_CHECK(cudaMemcpy(d.p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    if (n_) FP8RL_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void release() { if (p_) cudaFree(p_); p_ = nullptr; }
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace fp8rl::gpu
