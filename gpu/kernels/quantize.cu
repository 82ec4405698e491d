// gpu/kernels/quantize.cu -- blockwise E4M3 quantization, dequantization, the own FP8 GEMM.
// Compiled without --use_fast_math; every rounding step is explicit (__fdiv_rn, __fmul_rn,
// __fmaf_rn), so the bytes and sums equal quant/'s CPU reference.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <stdexcept>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/kernels/e4m3_device.cuh"
#include "gpu/ops.hpp"
#include "quant/fp8.hpp"
#include "quant/quantize_impl.hpp"

namespace fp8rl::gpu {
namespace {

__constant__ float c_e4m3[256];

// scale (multiplier) and scale_inv of a block, both modes (quant/scale.cpp)
__device__ __forceinline__ void block_scale(float amax, int mode, float* scale, float* scale_inv) {
  if (!(amax > 0.0f)) { *scale = 1.0f; *scale_inv = 1.0f; return; }
  if (mode == 0) {  // pow2
    const uint32_t u = __float_as_uint(amax);
    const int E = static_cast<int>((u >> 23) & 0xffu);
    int e = E == 0 ? -126 : (E - 127) - 8 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
    if (e < -126) e = -126;
    *scale = ldexpf(1.0f, -e);
    *scale_inv = ldexpf(1.0f, e);
    return;
  }
  float s = __fdiv_rn(448.0f, amax);
  if (isinf(s)) s = 3.402823466e38f;
  *scale = s;
  *scale_inv = __fdiv_rn(1.0f, s);
}

// One thread block per tile/block of the operand matrix [R][K] gathered from the source by
// (r, k) -> x[colwise ? k * cols + r : r * cols + k]; rstep = 1 (tiles) or 128 (blocks).
__global__ void quantize_kernel(const float* x, int64_t rows, int64_t cols, int colwise, int rstep, int mode, int64_t R,
                                int64_t K, int64_t KB, int64_t sld, uint8_t* out, float* scale_inv, int* bad) {
  const int64_t b = blockIdx.x, rb = b / KB, kb = b % KB;
  const int64_t r0 = rb * rstep, r1 = min(R, r0 + rstep), k0 = kb * 128, k1 = min(K, k0 + 128);
  const int64_t n = (r1 - r0) * (k1 - k0);
  __shared__ float s_max[256];
  __shared__ int s_bad[256];
  float m = 0.0f;
  int nb = 0;
  auto at = [&](int64_t i) {
    const int64_t r = r0 + i / (k1 - k0), k = k0 + i % (k1 - k0);
    return colwise ? x[k * cols + r] : x[r * cols + k];
  };
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const uint32_t a = __float_as_uint(at(i)) & 0x7fffffffu;
    if (a >= 0x7f800000u) ++nb;
    else m = fmaxf(m, __uint_as_float(a));
  }
  s_max[threadIdx.x] = m;
  s_bad[threadIdx.x] = nb;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      s_max[threadIdx.x] = fmaxf(s_max[threadIdx.x], s_max[threadIdx.x + s]);
      s_bad[threadIdx.x] += s_bad[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (s_bad[0]) {
    if (threadIdx.x == 0) bad[b] = s_bad[0];
    return;
  }
  float scale, sinv;
  block_scale(s_max[0], mode, &scale, &sinv);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t r = r0 + i / (k1 - k0), k = k0 + i % (k1 - k0);
    out[r * K + k] = e4m3_encode(__fmul_rn(at(i), scale));
  }
  if (threadIdx.x == 0) {
    if (rstep == 1) scale_inv[kb * sld + rb] = sinv;
    else scale_inv[rb * sld + kb] = sinv;
  }
}

__global__ void encode_kernel(const float* x, int64_t n, uint8_t* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = e4m3_encode(x[i]);
}

__global__ void dequantize_kernel(const uint8_t* q, const float* sinv, int64_t R, int64_t K, int64_t sld, int block,
                                  int colwise, int64_t cols, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= R * K) return;
  const int64_t r = i / K, k = i % K, kb = k / 128;
  const float s = block ? sinv[(r / 128) * sld + kb] : sinv[kb * sld + r];
  const float v = __fmul_rn(c_e4m3[q[i]], s);
  if (colwise) out[k * cols + r] = v;
  else out[r * cols + k] = v;
}

// One thread per output element; the exact §5.2 order. Rows m step by gridDim.y (at most 65535).
__global__ void gemm_fp8_own_kernel2(const uint8_t* A, const uint8_t* B, const float* sa, const float* sb, int64_t M,
                                     int64_t N, int64_t K, int64_t KB, float* C) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    float out = 0.0f;
    for (int64_t kb = 0; kb < KB; ++kb) {
      float acc = 0.0f;
      for (int64_t i = 0; i < 64; ++i) {
        const int64_t k = kb * 128 + 2 * i;
        const float a1 = k + 1 < K ? c_e4m3[A[m * K + k + 1]] : 0.0f, b1 = k + 1 < K ? c_e4m3[B[n * K + k + 1]] : 0.0f;
        const float a0 = k < K ? c_e4m3[A[m * K + k]] : 0.0f, b0 = k < K ? c_e4m3[B[n * K + k]] : 0.0f;
        acc = __fmaf_rn(a1, b1, acc);  // odd element first
        acc = __fmaf_rn(a0, b0, acc);
      }
      out = __fmaf_rn(__fmul_rn(sa[m * KB + kb], sb[n * KB + kb]), acc, out);
    }
    C[m * N + n] = out;
  }
}

// Constant memory is per device: the table goes to each device the first time a kernel there
// needs it (one flag for the process left a second device reading zeros), under a lock.
void upload_table() {
  static std::mutex m;
  static std::set<int> done;
  int dev = 0;
  FP8RL_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(m);
  if (done.count(dev)) return;
  FP8RL_CUDA_CHECK(cudaMemcpyToSymbol(c_e4m3, quant::e4m3_table(), 256 * sizeof(float)));
  done.insert(dev);
}

}  // namespace
}  // namespace fp8rl::gpu

namespace fp8rl::gpu {

void gpu_quantize_device(const float* x, int64_t rows, int64_t cols, quant::qlayout layout, quant::scale_mode mode,
                         uint8_t* out, float* scale_inv, int* bad) {
  quant::qtensor shape;
  shape.rows = rows;
  shape.cols = cols;
  shape.layout = layout;
  const int64_t R = shape.op_rows(), K = shape.op_cols(), KB = shape.k_blocks();
  const int rstep = layout == quant::qlayout::block_128x128 ? 128 : 1;
  const int64_t nblocks = ((R + rstep - 1) / rstep) * KB;
  if (nblocks == 0) return;
  quantize_kernel<<<static_cast<unsigned>(nblocks), 256>>>(x, rows, cols, layout == quant::qlayout::colwise_1x128, rstep,
                                                           mode == quant::scale_mode::pow2 ? 0 : 1, R, K, KB,
                                                           shape.scale_ld(), out, scale_inv, bad);
  FP8RL_CUDA_CHECK(cudaGetLastError());
}

quant::qtensor gpu_quantize(const float* x, int64_t rows, int64_t cols, quant::qlayout layout, quant::scale_mode mode,
                            const std::string& name) {
  quant::qtensor q = quant::detail::qtensor_alloc(rows, cols, layout, mode, name);
  const int64_t R = q.op_rows(), K = q.op_cols(), KB = q.k_blocks();
  const int rstep = layout == quant::qlayout::block_128x128 ? 128 : 1;
  const int64_t nblocks = ((R + rstep - 1) / rstep) * KB;
  if (nblocks == 0) return q;
  dbuf<uint8_t> out(static_cast<size_t>(R * K));
  dbuf<float> sinv = dbuf<float>::from(q.scale_inv);
  dbuf<int> bad = dbuf<int>::from(std::vector<int>(static_cast<size_t>(nblocks), 0));
  gpu_quantize_device(x, rows, cols, layout, mode, out.data(), sinv.data(), bad.data());
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
  const auto nb = bad.to_host();
  for (int64_t b = 0; b < nblocks; ++b)
    if (nb[b]) quant::detail::throw_nonfinite(name, layout, b / KB, b % KB, nb[b]);
  q.data = out.to_host();
  q.scale_inv = sinv.to_host();
  return q;
}

void gpu_e4m3_encode(const float* x, int64_t n, uint8_t* out) {
  if (n == 0) return;
  encode_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(x, n, out);
  FP8RL_CUDA_CHECK(cudaGetLastError());
}

namespace {
// Pattern i of 2^32: e4m3_encode against the hardware's SATFINITE conversion (cuda_fp8.h's
// __nv_cvt_float_to_fp8, the cvt.rn.satfinite.e4m3x2.f32 instruction on sm_89 and later). A NaN
// input agrees if the hardware gives either NaN code (ours is 0x7F, fp8-numerics.md §2.1); the
// NaN inputs it gives 0xFF (§10.1: watch -NaN) are counted apart, in count[1].
__global__ void encoder_sweep_kernel(unsigned long long* count, unsigned long long* first) {
  const uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
  const float x = __uint_as_float(static_cast<uint32_t>(i));
  const uint8_t hw = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  const uint8_t ours = e4m3_encode(x);
  const bool agree = isnan(x) ? (hw & 0x7f) == 0x7f && ours == 0x7f : hw == ours;
  if (isnan(x) && hw == 0xff) atomicAdd(count + 1, 1ull);
  if (!agree) {
    atomicAdd(count, 1ull);
    atomicMin(first, static_cast<unsigned long long>(i));
  }
}
}  // namespace

uint64_t gpu_e4m3_encoder_sweep(uint32_t* first_mismatch, uint64_t* nan_as_0xff) {
  dbuf<unsigned long long> d(3);  // mismatches, NaN inputs the hardware gave 0xFF, the lowest mismatch
  const std::vector<unsigned long long> init = {0ull, 0ull, ~0ull};
  FP8RL_CUDA_CHECK(cudaMemcpy(d.data(), init.data(), sizeof(unsigned long long) * 3, cudaMemcpyHostToDevice));
  encoder_sweep_kernel<<<1u << 24, 256>>>(d.data(), d.data() + 2);  // 2^24 x 256 = every pattern
  FP8RL_CUDA_CHECK(cudaGetLastError());
  const auto h = d.to_host();
  if (first_mismatch) *first_mismatch = static_cast<uint32_t>(h[0] ? h[2] : 0);
  if (nan_as_0xff) *nan_as_0xff = h[1];
  return h[0];
}

void gpu_dequantize(const quant::qtensor& q, float* out) {
  upload_table();
  const int64_t R = q.op_rows(), K = q.op_cols();
  if (R * K == 0) return;
  auto d = dbuf<uint8_t>::from(q.data);
  auto s = dbuf<float>::from(q.scale_inv);
  dequantize_kernel<<<static_cast<unsigned>((R * K + 255) / 256), 256>>>(
      d.data(), s.data(), R, K, q.scale_ld(), q.layout == quant::qlayout::block_128x128,
      q.layout == quant::qlayout::colwise_1x128, q.cols, out);
  FP8RL_CUDA_CHECK(cudaGetLastError());
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
}

void gpu_gemm_fp8_own(const quant::qtensor& A, const quant::qtensor& B, float* C) {
  upload_table();
  if (A.layout == quant::qlayout::block_128x128) throw std::invalid_argument("gpu_gemm_fp8_own: A needs 1x128 tiles");
  if (A.op_cols() != B.op_cols()) throw std::invalid_argument("gpu_gemm_fp8_own: K mismatch");
  const int64_t M = A.op_rows(), N = B.op_rows(), K = A.op_cols(), KB = A.k_blocks();
  std::vector<float> sa(static_cast<size_t>(M * KB)), sb(static_cast<size_t>(N * KB));
  for (int64_t m = 0; m < M; ++m) for (int64_t kb = 0; kb < KB; ++kb) sa[m * KB + kb] = A.scale_at(m, kb);
  for (int64_t n = 0; n < N; ++n) for (int64_t kb = 0; kb < KB; ++kb) sb[n * KB + kb] = B.scale_at(n, kb);
  auto a = dbuf<uint8_t>::from(A.data), b = dbuf<uint8_t>::from(B.data);
  auto dsa = dbuf<float>::from(sa), dsb = dbuf<float>::from(sb);
  if (M == 0 || N == 0) return;
  const dim3 grid(static_cast<unsigned>((N + 127) / 128), static_cast<unsigned>(std::min<int64_t>(M, 65535)));  // grid.y's limit
  gemm_fp8_own_kernel2<<<grid, 128>>>(a.data(), b.data(), dsa.data(), dsb.data(), M, N, K, KB, C);
  FP8RL_CUDA_CHECK(cudaGetLastError());
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace fp8rl::gpu
