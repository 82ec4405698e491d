// models/cpu/cpu_backend.cpp -- backend implementation on host memory.
#include "models/cpu/cpu_backend.hpp"

#include <tbb/parallel_for.h>

#include <malloc.h>

#include <cstring>
#include <mutex>
#include <new>

#include "models/cpu/cpu_ops.hpp"
#include "models/log.hpp"

namespace fp8rl::models {
namespace {

class cpu_backend final : public backend {
 public:
  std::string name() const override { return "cpu"; }
  void* alloc(size_t bytes) override { return ::operator new(bytes ? bytes : 1, std::align_val_t{64}); }
  void release(void* p) override { ::operator delete(p, std::align_val_t{64}); }
  void to_device(void* dst, const void* src, size_t n) override { if (n) std::memcpy(dst, src, n); }
  void to_host(void* dst, const void* src, size_t n) override { if (n) std::memcpy(dst, src, n); }
  void zero(void* p, size_t n) override { if (n) std::memset(p, 0, n); }
  bool host_memory() const override { return true; }

  void embedding_forward(const float* wte, const int32_t* tok, int64_t T, int64_t C, float* out) override {
    cpu_embedding_forward(wte, tok, T, C, out);
  }
  void embedding_backward(const float* dout, const int32_t* tok, int64_t T, int64_t C, float* dwte) override {
    cpu_embedding_backward(dout, tok, T, C, dwte);
  }
  void rmsnorm_forward(const float* x, const float* w, int64_t T, int64_t C, float eps, float* out, float* rstd) override {
    cpu_rmsnorm_forward(x, w, T, C, eps, out, rstd);
  }
  void rmsnorm_backward(const float* dout, const float* x, const float* w, const float* rstd, int64_t T, int64_t C,
                        float* dx, float* dw) override {
    cpu_rmsnorm_backward(dout, x, w, rstd, T, C, dx, dw);
  }
  void rope(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, const std::vector<float>& inv_freq,
            bool inverse) override {
    cpu_rope(x, pos, T, nh, D, inv_freq, inverse);
  }
  void swiglu_forward(const float* g, const float* u, int64_t n, float* h) override { cpu_swiglu_forward(g, u, n, h); }
  void swiglu_backward(const float* dh, const float* g, const float* u, int64_t n, float* dg, float* du) override {
    cpu_swiglu_backward(dh, g, u, n, dg, du);
  }
  void add_inplace(float* y, const float* x, int64_t n) override { cpu_add_inplace(y, x, n); }
  void copy(float* y, const float* x, int64_t n) override { if (n) std::memcpy(y, x, static_cast<size_t>(n) * 4); }

  std::unique_ptr<prepared_linear> linear_prepare(const linear_source& w, bool for_backward) override {
    return cpu_linear_prepare(w, for_backward);
  }
  void linear_forward(const prepared_linear& w, const float* x, int64_t T, float* y) override {
    cpu_linear_forward(w, x, T, y);
  }
  void linear_backward(const prepared_linear& w, const float* x, const float* dy, int64_t T, float* dx,
                       float* dw) override {
    cpu_linear_backward(w, x, dy, T, dx, dw);
  }
  void linear_forward_group(std::span<const prepared_linear* const> ws, const float* x, int64_t T,
                            std::span<float* const> ys) override {
    cpu_linear_forward_group(ws, x, T, ys);
  }
  void linear_backward_group(std::span<const prepared_linear* const> ws, const float* x,
                             std::span<const float* const> dys, int64_t T, float* dx, float* dtmp,
                             std::span<float* const> dws) override {
    cpu_linear_backward_group(ws, x, dys, T, dx, dtmp, dws);
  }
  void attention_forward(const attn_params& p, const float* q, const float* k, const float* v, float* out,
                         float* lse) override {
    cpu_attention_forward(p, q, k, v, out, lse);
  }
  void attention_backward(const attn_params& p, const float* q, const float* k, const float* v, const float* out,
                          const float* lse, const float* dout, float* dq, float* dk, float* dv) override {
    cpu_attention_backward(p, q, k, v, out, lse, dout, dq, dk, dv);
  }
  std::unique_ptr<kv_cache> kv_cache_create(int64_t slots, int64_t layers, int64_t KV, int64_t D, int64_t max_ctx,
                                            kv_dtype dtype) override {
    return cpu_kv_cache_create(slots, layers, KV, D, max_ctx, dtype);
  }
  int64_t kv_cache_write(kv_cache& c, int64_t layer, const kv_step& st, const float* k, const float* v,
                         const float* ks, const float* vs) override {
    return cpu_kv_cache_write(c, layer, st, k, v, ks, vs);
  }
  int64_t attention_cached(const kv_cache& c, int64_t layer, const kv_step& st, const float* q, int64_t H,
                           precision operand, const float* q_scale, float* out) override {
    return cpu_attention_cached(c, layer, st, q, H, operand, q_scale, out);
  }
  void logprob_forward(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                       const logit_processing& proc, float* logp, float* entropy) override {
    cpu_logprob_forward(logits, targets, T, V, proc, logp, entropy);
  }
  void logprob_backward(const float* logits, const int32_t* targets, int64_t T, int64_t V,
                        const logit_processing& proc, const float* dlogp, float* dlogits) override {
    cpu_logprob_backward(logits, targets, T, V, proc, dlogp, dlogits);
  }
};

}  // namespace

// Keeps freed buffers in glibc's heap instead of returning them to the OS. A training step
// allocates and frees several MB per op (quantized operands, packed activations and weights);
// glibc's adaptive thresholds hand some of them back each step, and the next step page-faults
// them in again, zeroed by the kernel (bench-train fp8-tiles: ~4,000 faults per step, none with
// this). Allocations above 32 MiB (glibc's own adaptive ceiling) stay mmapped: served from the
// 64 MiB per-thread arenas, a 1 GiB threshold made the actor threads' 24-48 MB bundle buffers
// cycle through arena heaps (bench-rl: 55 s of system time, BF16 bundle sync 0.45 -> 3 s).
// Process-wide, set once by the first CPU backend.
void cpu_allocator_keep_freed_memory() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return;  // the sanitizers bring their own allocator
#endif
  static std::once_flag once;
  std::call_once(once, [] {
    constexpr int kMmap = 32 << 20, kTrim = 1 << 30;
    if (mallopt(M_MMAP_THRESHOLD, kMmap) != 1 || mallopt(M_TRIM_THRESHOLD, kTrim) != 1)
      log_get("model")->warn("mallopt refused the heap settings: per-step buffers will page-fault");
  });
}

std::unique_ptr<backend> make_cpu_backend() {
  cpu_allocator_keep_freed_memory();
  return std::make_unique<cpu_backend>();
}

}  // namespace fp8rl::models
