// tools/bench/bench_peak_avx512.cpp -- measured VDPBF16PS peak: 24 independent accumulator
// chains per thread, registers only (the stretch target of bench-gemm is a fraction of this).
#include <immintrin.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>

namespace fp8rl::bench {

double vdpbf16ps_peak_gflops(int threads) {
  const int64_t iters = 20'000'000;
  std::atomic<float> sink{0};
  tbb::task_arena arena(threads);
  auto t0 = std::chrono::steady_clock::now();
  arena.execute([&] {
    tbb::parallel_for(0, threads, [&](int) {
      __m512 acc[24];
      for (auto& x : acc) x = _mm512_setzero_ps();
      const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
      for (int64_t i = 0; i < iters; ++i)
        for (auto& x : acc) x = _mm512_dpbf16_ps(x, a, b);
      alignas(64) float lanes[16];
      float s = 0;
      for (auto& x : acc) {
        _mm512_store_ps(lanes, x);
        s += lanes[0];
      }
      sink = sink + s;
    }, tbb::static_partitioner());
  });
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(threads) * iters * 24 * 64 / sec / 1e9;  // 16 lanes x 2 pairs x 2 flops
}

}  // namespace fp8rl::bench
