// tools/bench/bench_gpu.cu -- build/bin/bench-gpu (CUDA builds): the H200 table of tools/gpu-check.
//  * cuBLASLt FP8 (VEC128 x BLK128x128 block scales) vs BF16 TFLOP/s, M = 4096, N,K in {4096, 14336}
//  * 1x128 quantization of a 64 MiB FP32 activation vs a device-to-device memcpy (GB/s)
//  * decode proxy: the TinyLlama-1.1B linear layers of one decode step (22 x q,k,v,o,gate,up,down;
//    no lm_head) at batch 8 with FP8 vs BF16 weights (tokens/s; attention and norms excluded).
//    Operands are timing fill (byte patterns; BF16 outputs may be inf): speed only, no values.
// Medians of repetitions timed with CUDA events; one JSON line per result with --json.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "gpu/cublaslt_gemm.hpp"
#include "gpu/device.hpp"
#include "gpu/ops.hpp"
#include "tools/bench/bench_util.hpp"

using namespace fp8rl;
using namespace fp8rl::bench;

namespace {

double time_ms(int reps, const std::function<void()>& f) {
  f();
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  FP8RL_CUDA_CHECK(cudaEventCreate(&a));
  FP8RL_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> v;
  for (int r = 0; r < reps; ++r) {
    FP8RL_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < 10; ++i) f();
    FP8RL_CUDA_CHECK(cudaEventRecord(b));
    FP8RL_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FP8RL_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    v.push_back(ms / 10);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

__global__ void fill(uint8_t* p, size_t n) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = static_cast<uint8_t>((i * 2654435761u) >> 24) & 0x77;  // finite E4M3 / BF16 bytes
}
__global__ void fillf(float* p, size_t n, float v) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = v * float(int(i % 1999) - 999);
}

template <class T>
gpu::dbuf<T> filled(size_t n) {
  gpu::dbuf<T> d(n);
  fill<<<static_cast<unsigned>((n * sizeof(T) + 255) / 256), 256>>>(reinterpret_cast<uint8_t*>(d.data()), n * sizeof(T));
  FP8RL_CUDA_CHECK(cudaGetLastError());
  return d;
}

gpu::dbuf<float> scales(size_t n) {
  gpu::dbuf<float> d(n);
  fillf<<<static_cast<unsigned>((n + 255) / 256), 256>>>(d.data(), n, 0.0f);
  FP8RL_CUDA_CHECK(cudaGetLastError());
  std::vector<float> one(n, 1.0f / 64.0f);
  FP8RL_CUDA_CHECK(cudaMemcpy(d.data(), one.data(), n * 4, cudaMemcpyHostToDevice));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  bench_common common;  // (C++17 here: no designated initializers)
  common.threads = false;
  bench_args a = bench_parse(argc, argv, {}, common);
  if (const auto dev = gpu::device_query(); dev.count == 0) {
    std::fprintf(stderr, "bench-gpu: no CUDA device (%s)\n", dev.reason.c_str());
    return 2;
  }
  std::fprintf(stderr, "device: %s, cuBLASLt %zu (built against %d)\n", gpu::device_name(0).c_str(), cublasLtGetVersion(),
               CUBLAS_VERSION);
  gpu::lt_gemm lt;
  // 1. GEMMs
  for (int64_t N : {4096, 14336})
    for (int64_t K : {4096, 14336}) {
      const int64_t M = 4096;
      for (auto in : {gpu::lt_dtype::e4m3, gpu::lt_dtype::bf16}) {
        const bool fp8 = in == gpu::lt_dtype::e4m3;
        auto w = filled<uint8_t>(static_cast<size_t>(N * K * (fp8 ? 1 : 2)));
        auto x = filled<uint8_t>(static_cast<size_t>(M * K * (fp8 ? 1 : 2)));
        const auto plan = gpu::lt_plan({M, N, K, in, gpu::lt_dtype::bf16});
        auto sw = scales(static_cast<size_t>(std::max<int64_t>(plan.a_scale_count, 1)));
        auto sx = scales(static_cast<size_t>(std::max<int64_t>(plan.b_scale_count, 1)));
        gpu::dbuf<__nv_bfloat16> y(static_cast<size_t>(M * N));
        const gpu::lt_gemm_desc d{M, N, K, in, gpu::lt_dtype::bf16};
        double ms = -1;
        std::string err;
        try {
          ms = time_ms(a.reps, [&] { lt.run(d, w.data(), fp8 ? sw.data() : nullptr, x.data(), fp8 ? sx.data() : nullptr, y.data()); });
        } catch (const std::exception& e) {
          err = e.what();
        }
        std::vector<std::pair<std::string, std::string>> f = {
            {"bench", jstr("gpu_gemm")}, {"impl", jstr(fp8 ? "cublaslt_fp8_block" : "cublaslt_bf16")}, {"M", jnum(double(M))},
            {"N", jnum(double(N))}, {"K", jnum(double(K))}, {"median_ms", jnum(ms)},
            {"tflops", jnum(ms > 0 ? 2.0 * M * N * K / (ms * 1e-3) / 1e12 : 0.0)}};
        if (!err.empty()) f.push_back({"error", jstr(err)});
        bench_emit(a, f);
      }
    }
  // 2. quantization vs memcpy
  {
    const int64_t R = 8192, C = 2048;  // 64 MiB FP32
    gpu::dbuf<float> x(static_cast<size_t>(R * C)), x2(static_cast<size_t>(R * C));
    fillf<<<static_cast<unsigned>((R * C + 255) / 256), 256>>>(x.data(), static_cast<size_t>(R * C), 1e-3f);
    FP8RL_CUDA_CHECK(cudaGetLastError());
    gpu::dbuf<uint8_t> q(static_cast<size_t>(R * C));
    quant::qtensor shape;
    shape.rows = R; shape.cols = C; shape.layout = quant::qlayout::rowwise_1x128;
    gpu::dbuf<float> s(static_cast<size_t>(shape.scale_count()));
    gpu::dbuf<int> bad(static_cast<size_t>(R * shape.k_blocks()));
    const double mq = time_ms(a.reps, [&] {
      gpu::gpu_quantize_device(x.data(), R, C, quant::qlayout::rowwise_1x128, quant::scale_mode::pow2, q.data(), s.data(), bad.data());
    });
    const double mm = time_ms(a.reps, [&] { FP8RL_CUDA_CHECK(cudaMemcpyAsync(x2.data(), x.data(), size_t(R * C) * 4, cudaMemcpyDeviceToDevice)); });
    const double gb = double(R * C) * 4 / 1e9;
    bench_emit(a, {{"bench", jstr("gpu_quant")}, {"impl", jstr("rowwise_1x128_pow2")}, {"gbps", jnum(gb / (mq * 1e-3))},
                   {"memcpy_gbps", jnum(gb / (mm * 1e-3))}, {"ratio", jnum(mm / mq)}});
  }
  // 3. decode proxy (TinyLlama linear layers, batch 8)
  {
    struct lin { int64_t n, k; };
    std::vector<lin> layers;
    for (int l = 0; l < 22; ++l)
      for (lin x : {lin{2048, 2048}, lin{256, 2048}, lin{256, 2048}, lin{2048, 2048}, lin{5632, 2048}, lin{5632, 2048}, lin{2048, 5632}})
        layers.push_back(x);
    const int64_t M = 8;
    for (auto in : {gpu::lt_dtype::e4m3, gpu::lt_dtype::bf16}) {
      const bool fp8 = in == gpu::lt_dtype::e4m3;
      std::vector<gpu::dbuf<uint8_t>> ws;
      std::vector<gpu::dbuf<float>> ss;
      for (const auto& l : layers) {
        ws.push_back(filled<uint8_t>(static_cast<size_t>(l.n * l.k * (fp8 ? 1 : 2))));
        ss.push_back(scales(static_cast<size_t>(std::max<int64_t>(gpu::lt_plan({M, l.n, l.k, in, gpu::lt_dtype::bf16}).a_scale_count, 1))));
      }
      auto x = filled<uint8_t>(static_cast<size_t>(M * 5632 * 2));
      auto sx = scales(static_cast<size_t>(M * 64));
      gpu::dbuf<__nv_bfloat16> y(static_cast<size_t>(M * 5632));
      std::string err;
      double ms = -1;
      try {
        ms = time_ms(a.reps, [&] {
          for (size_t i = 0; i < layers.size(); ++i)
            lt.run({M, layers[i].n, layers[i].k, in, gpu::lt_dtype::bf16}, ws[i].data(), fp8 ? ss[i].data() : nullptr,
                   x.data(), fp8 ? sx.data() : nullptr, y.data());
        });
      } catch (const std::exception& e) {
        err = e.what();
      }
      std::vector<std::pair<std::string, std::string>> f = {
          {"bench", jstr("gpu_decode_proxy")}, {"weights", jstr(fp8 ? "fp8" : "bf16")}, {"batch", jnum(double(M))},
          {"median_ms_per_step", jnum(ms)}, {"tokens_per_s", jnum(ms > 0 ? double(M) / (ms * 1e-3) : 0.0)},
          {"note", jstr("TinyLlama linear layers only (no attention, norms, lm_head)")}};
      if (!err.empty()) f.push_back({"error", jstr(err)});
      bench_emit(a, f);
    }
  }
  return 0;
}
