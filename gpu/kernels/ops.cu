// gpu/kernels/ops.cu -- elementwise, normalization, attention, logprob, AdamW and FP8 KV-cache
// kernels (FP32 activations; compared with the CPU backend under named tolerances).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/kernels/e4m3_device.cuh"
#include "gpu/ops.hpp"

namespace fp8rl::gpu {
namespace {

unsigned blocks(int64_t n, int t = 256) { return static_cast<unsigned>((n + t - 1) / t); }

__global__ void rmsnorm_kernel(const float* x, const float* w, int64_t C, float eps, float* out, float* rstd) {
  const int64_t t = blockIdx.x;
  __shared__ double s[256];
  double acc = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) acc += double(x[t * C + c]) * x[t * C + c];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  const float r = static_cast<float>(1.0 / sqrt(s[0] / double(C) + eps));
  if (threadIdx.x == 0) rstd[t] = r;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[t * C + c] = w[c] * (x[t * C + c] * r);
}

__global__ void rope_kernel(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, float theta, int inverse) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x, half = D / 2;
  if (i >= T * nh * half) return;
  const int64_t t = i / (nh * half), h = (i / half) % nh, j = i % half;
  const float inv = 1.0f / powf(theta, float(2 * j) / float(D));
  const float ang = float(pos[t]) * inv, c = cosf(ang), s = inverse ? -sinf(ang) : sinf(ang);
  float* v = x + (t * nh + h) * D;
  const float a = v[j], b = v[j + half];
  v[j] = a * c - b * s;
  v[j + half] = b * c + a * s;
}

__global__ void swiglu_kernel(const float* g, const float* u, int64_t n, float* h) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

// first_bad: the lowest token index whose id is outside [0, V) (it read past the table)
__global__ void embedding_kernel(const float* wte, const int32_t* tok, int64_t T, int64_t C, int64_t V, float* out,
                                 unsigned long long* first_bad) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= T * C) return;
  const int64_t id = tok[i / C];
  if (id < 0 || id >= V) {
    atomicMin(first_bad, static_cast<unsigned long long>(i / C));
    return;
  }
  out[i] = wte[id * C + i % C];
}

// first_bad: the lowest row whose target is >= V (it read past the row)
__global__ void logprob_kernel(const float* logits, const int32_t* targets, int64_t V, float* logp,
                               unsigned long long* first_bad) {
  const int64_t t = blockIdx.x;
  if (targets[t] >= V) {
    if (threadIdx.x == 0) atomicMin(first_bad, static_cast<unsigned long long>(t));
    return;  // the whole block: no thread reaches the barriers below
  }
  __shared__ float sm[256];
  __shared__ double ss[256];
  const float* z = logits + t * V;
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, z[v]);
  sm[threadIdx.x] = m;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) sm[threadIdx.x] = fmaxf(sm[threadIdx.x], sm[threadIdx.x + k]);
    __syncthreads();
  }
  m = sm[0];
  double s = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += exp(double(z[v]) - m);
  ss[threadIdx.x] = s;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) ss[threadIdx.x] += ss[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) logp[t] = targets[t] < 0 ? 0.0f : static_cast<float>(z[targets[t]] - (m + log(ss[0])));
}

__global__ void adamw_kernel(float* p, float* g, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
                             float decay, float clip, float step_size, float bc2_sqrt) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i] * clip;
  g[i] = gi;
  p[i] *= decay;
  m[i] = m[i] * b1 + gi * (1.0f - b1);
  v[i] = v[i] * b2 + gi * gi * (1.0f - b2);
  p[i] -= step_size * (m[i] / (sqrtf(v[i]) / bc2_sqrt + eps));
}

// first_bad: the lowest index holding NaN/Inf (fp8-numerics §0.2: an error, never encoded silently)
__global__ void nonfinite_scan_kernel(const float* x, int64_t n, unsigned long long* first_bad) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && !isfinite(x[i])) atomicMin(first_bad, static_cast<unsigned long long>(i));
}

// saturated: elements beyond 464 after scaling, the CPU cache's rule (models/cpu/kv_cache.cpp)
__global__ void kv_write_kernel(const float* x, int64_t n, int64_t KV, int64_t D, const float* scale, uint8_t* codes,
                                unsigned long long* saturated) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float s = __fdiv_rn(x[i], scale[(i / D) % KV]);
  codes[i] = e4m3_encode(s);
  if (fabsf(s) > 464.0f) atomicAdd(saturated, 1ull);
}

__global__ void kv_read_kernel(const uint8_t* codes, int64_t n, int64_t KV, int64_t D, const float* scale, float* x) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = __fmul_rn(e4m3_decode(codes[i]), scale[(i / D) % KV]);
}

__device__ __forceinline__ float rnd(float x, bool bf16) { return bf16 ? __bfloat162float(__float2bfloat16_rn(x)) : x; }

// one thread per (query t, head h): scores, softmax and P·V over keys 0..t
__global__ void attention_kernel(const float* q, const float* k, const float* v, int64_t T, int64_t H, int64_t KV,
                                 int64_t D, int bf16, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= T * H) return;
  const int64_t t = i / H, h = i % H, g = h / (H / KV);
  const float scale = 1.0f / sqrtf(float(D));
  float m = -INFINITY;
  for (int64_t j = 0; j <= t; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s = __fmaf_rn(rnd(q[(t * H + h) * D + d], bf16), rnd(k[(j * KV + g) * D + d], bf16), s);
    m = fmaxf(m, s * scale);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j <= t; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s = __fmaf_rn(rnd(q[(t * H + h) * D + d], bf16), rnd(k[(j * KV + g) * D + d], bf16), s);
    sum += expf(s * scale - m);
  }
  for (int64_t d = 0; d < D; ++d) out[(t * H + h) * D + d] = 0.0f;
  for (int64_t j = 0; j <= t; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s = __fmaf_rn(rnd(q[(t * H + h) * D + d], bf16), rnd(k[(j * KV + g) * D + d], bf16), s);
    const float p = rnd(expf(s * scale - m) / sum, bf16);
    for (int64_t d = 0; d < D; ++d) out[(t * H + h) * D + d] = __fmaf_rn(p, rnd(v[(j * KV + g) * D + d], bf16), out[(t * H + h) * D + d]);
  }
}

void check() {
  FP8RL_CUDA_CHECK(cudaGetLastError());
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
}

constexpr unsigned long long kNone = ~0ull;  // a first_bad no kernel lowered
dbuf<unsigned long long> none_found() { return dbuf<unsigned long long>::from(std::vector<unsigned long long>{kNone}); }

}  // namespace

void gpu_rmsnorm_forward(const float* x, const float* w, int64_t T, int64_t C, float eps, float* out, float* rstd) {
  if (T) rmsnorm_kernel<<<static_cast<unsigned>(T), 256>>>(x, w, C, eps, out, rstd);
  check();
}
void gpu_rope(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, double theta, bool inverse) {
  const int64_t n = T * nh * (D / 2);
  if (n) rope_kernel<<<blocks(n), 256>>>(x, pos, T, nh, D, static_cast<float>(theta), inverse);
  check();
}
void gpu_swiglu_forward(const float* g, const float* u, int64_t n, float* h) {
  if (n) swiglu_kernel<<<blocks(n), 256>>>(g, u, n, h);
  check();
}
namespace {
// The id at device position i of ids (for an error message).
int32_t id_at(const int32_t* ids, unsigned long long i) {
  int32_t id = 0;
  FP8RL_CUDA_CHECK(cudaMemcpy(&id, ids + i, sizeof id, cudaMemcpyDeviceToHost));
  return id;
}
}  // namespace
void gpu_embedding_forward(const float* wte, const int32_t* tok, int64_t T, int64_t C, int64_t V, float* out) {
  if (T <= 0 || C <= 0) return;
  auto first_bad = none_found();
  embedding_kernel<<<blocks(T * C), 256>>>(wte, tok, T, C, V, out, first_bad.data());
  check();
  if (const unsigned long long t = first_bad.to_host()[0]; t != kNone)
    throw std::invalid_argument("gpu_embedding_forward: token " + std::to_string(t) + ": id " + std::to_string(id_at(tok, t)) +
                                " is outside the vocabulary (" + std::to_string(V) + ")");
}
void gpu_logprob_forward(const float* logits, const int32_t* targets, int64_t T, int64_t V, float* logp) {
  if (T <= 0) return;
  auto first_bad = none_found();
  logprob_kernel<<<static_cast<unsigned>(T), 256>>>(logits, targets, V, logp, first_bad.data());
  check();
  if (const unsigned long long t = first_bad.to_host()[0]; t != kNone)
    throw std::invalid_argument("gpu_logprob_forward: row " + std::to_string(t) + ": target " +
                                std::to_string(id_at(targets, t)) + " is outside the vocabulary (" + std::to_string(V) + ")");
}
void gpu_adamw_step(float* p, float* g, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
                    float decay, float clip, int64_t step) {
  const float bc1 = 1.0f - powf(b1, float(step)), bc2 = 1.0f - powf(b2, float(step));
  if (n) adamw_kernel<<<blocks(n), 256>>>(p, g, m, v, n, lr, b1, b2, eps, decay, clip, lr / bc1, sqrtf(bc2));
  check();
}
// Scans first, writes only clean input: a refused write leaves the cache as it was (an earlier
// version wrote the finite elements' codes before the error, over what the cache held).
int64_t gpu_kv_write_fp8(const float* x, int64_t T, int64_t KV, int64_t D, const float* scale, uint8_t* codes) {
  if (T * KV * D == 0) return 0;
  auto first_bad = none_found();
  nonfinite_scan_kernel<<<blocks(T * KV * D), 256>>>(x, T * KV * D, first_bad.data());
  check();
  if (const unsigned long long i = first_bad.to_host()[0]; i != kNone)
    throw std::invalid_argument("gpu_kv_write_fp8: token " + std::to_string(i / (KV * D)) + ", KV head " +
                                std::to_string(i / D % KV) + ", element " + std::to_string(i % D) +
                                ": not finite (FP8 K/V cache)");
  auto saturated = dbuf<unsigned long long>::from(std::vector<unsigned long long>{0});
  kv_write_kernel<<<blocks(T * KV * D), 256>>>(x, T * KV * D, KV, D, scale, codes, saturated.data());
  check();
  return static_cast<int64_t>(saturated.to_host()[0]);
}
void gpu_kv_read_fp8(const uint8_t* codes, int64_t T, int64_t KV, int64_t D, const float* scale, float* x) {
  if (T > 0 && KV > 0 && D > 0) kv_read_kernel<<<blocks(T * KV * D), 256>>>(codes, T * KV * D, KV, D, scale, x);
  check();
}
void gpu_attention_forward(const float* q, const float* k, const float* v, int64_t T, int64_t H, int64_t KV, int64_t D,
                           bool bf16, float* out) {
  if (KV <= 0 || H % KV != 0)  // a query head's KV head is h / (H / KV): H < KV divided by zero
    throw std::invalid_argument("gpu_attention_forward: " + std::to_string(H) + " query heads do not group over " +
                                std::to_string(KV) + " KV heads");
  if (T > 0 && H > 0) attention_kernel<<<blocks(T * H, 64), 64>>>(q, k, v, T, H, KV, D, bf16, out);
  check();
}

}  // namespace fp8rl::gpu
