// tools/bench/bench_quant.cpp -- build/bin/bench-quant: blockwise FP8 quantization throughput vs
// memcpy of the same bytes, side by side: each variant's rounds alternate a timed batch of memcpy
// calls with one of quantize calls, and "of_memcpy" is the median per-round ratio memcpy seconds /
// quantize seconds (1: as fast as copying the input). gbps = FP32 input bytes / median seconds
// (memcpy itself moves twice that: it reads and writes them). The input is an activation [M, K]
// (rows, cols); N = 0: quantization has no second operand.
//   {"bench":"quant","impl":...,"M":..,"N":0,"K":..,"rows":..,"cols":..,"threads":..,"median_s":..,
//    "gbps":..,"runs":..[,"memcpy_median_s":..,"of_memcpy":..]}
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cstring>

#include "quant/qtensor.hpp"
#include "tools/bench/bench_util.hpp"

using namespace fp8rl::bench;
using namespace fp8rl::quant;

int main(int argc, char** argv) {
  bench_args a = bench_parse(argc, argv);
  const int64_t rows = 8192, cols = 2048;  // 64 MiB of FP32 activations
  std::vector<float> x(size_t(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int64_t(i * 2654435761u % 20001) - 10000) * 1e-3f;
  std::vector<float> dst(x.size());
  const double bytes = double(x.size()) * 4;
  auto emit = [&](const std::string& impl, int t, double sec, const json_fields& more = {}) {
    json_fields f = {{"bench", jstr("quant")}, {"impl", jstr(impl)}, {"M", jnum(double(rows))}, {"N", jnum(0)},
                     {"K", jnum(double(cols))}, {"rows", jnum(double(rows))},
                     {"cols", jnum(double(cols))}, {"threads", jnum(t)}, {"median_s", jnum(sec)},
                     {"gbps", jnum(bytes / sec / 1e9)}, {"runs", jnum(a.reps)}};
    f.insert(f.end(), more.begin(), more.end());
    bench_emit(a, f);
  };
  const auto copy = [&] {
    const int64_t chunk = int64_t(x.size()) / 64;
    tbb::parallel_for(int64_t{0}, int64_t{64}, [&](int64_t c) {
      std::memcpy(dst.data() + c * chunk, x.data() + c * chunk, size_t(chunk) * 4);
    });
  };
  for (int t : a.threads) {
    tbb::task_arena arena(t);
    arena.execute([&] {
      if (bench_selected(a, "memcpy")) emit("memcpy", t, bench_median(a.reps, copy, 0.2));
      copy();
      const int calls = bench_calls_for(copy, 0.2);  // ~0.2 s of copying per round
      const std::pair<const char*, qlayout> layouts[] = {{"rowwise_1x128", qlayout::rowwise_1x128},
                                                         {"block_128x128", qlayout::block_128x128},
                                                         {"colwise_1x128", qlayout::colwise_1x128}};
      for (auto [name, l] : layouts)
        for (scale_mode m : {scale_mode::pow2, scale_mode::fp32}) {
          std::string impl = std::string(name) + "_" + std::string(scale_mode_name(m));
          if (!bench_selected(a, impl)) continue;
          qtensor q;
          q.name = "x";
          const auto quant = [&] { quantize_into(x.data(), rows, cols, l, m, q); };
          quant();  // warm-up (and q's buffers)
          const auto side = bench_side_by_side(a.reps, [&] { return bench_time_calls(copy, calls); },
                                               [&] { return bench_time_calls(quant, calls); });
          std::vector<double> of_memcpy;
          for (double r : side.ratio) of_memcpy.push_back(1.0 / r);
          emit(impl, t, bench_median_of(side.b),
               {{"memcpy_median_s", jnum(bench_median_of(side.a))}, {"of_memcpy", jnum(bench_median_of(of_memcpy))}});
        }
    });
  }
}
