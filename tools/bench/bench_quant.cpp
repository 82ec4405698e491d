// tools/bench/bench_quant.cpp -- build/bin/bench-quant: blockwise FP8 quantization throughput vs
// memcpy of the same bytes, side by side. gbps = FP32 input bytes / median seconds. The input
// is an activation [M, K] (rows, cols); N = 0: quantization has no second operand.
//   {"bench":"quant","impl":...,"M":..,"N":0,"K":..,"rows":..,"cols":..,"threads":..,"median_s":..,
//    "gbps":..,"runs":..}
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
  auto emit = [&](const std::string& impl, int t, double sec) {
    bench_emit(a, {{"bench", jstr("quant")}, {"impl", jstr(impl)}, {"M", jnum(double(rows))}, {"N", jnum(0)},
                   {"K", jnum(double(cols))}, {"rows", jnum(double(rows))},
                   {"cols", jnum(double(cols))}, {"threads", jnum(t)}, {"median_s", jnum(sec)},
                   {"gbps", jnum(bytes / sec / 1e9)}, {"runs", jnum(a.reps)}});
  };
  for (int t : a.threads) {
    tbb::task_arena arena(t);
    arena.execute([&] {
      if (bench_selected(a, "memcpy"))
        emit("memcpy", t, bench_median(a.reps, [&] {
          const int64_t chunk = int64_t(x.size()) / 64;
          tbb::parallel_for(int64_t{0}, int64_t{64}, [&](int64_t c) {
            std::memcpy(dst.data() + c * chunk, x.data() + c * chunk, size_t(chunk) * 4);
          });
        }, 0.2));
      const std::pair<const char*, qlayout> layouts[] = {{"rowwise_1x128", qlayout::rowwise_1x128},
                                                         {"block_128x128", qlayout::block_128x128},
                                                         {"colwise_1x128", qlayout::colwise_1x128}};
      for (auto [name, l] : layouts)
        for (scale_mode m : {scale_mode::pow2, scale_mode::fp32}) {
          std::string impl = std::string(name) + "_" + std::string(scale_mode_name(m));
          if (!bench_selected(a, impl)) continue;
          qtensor q;
          q.name = "x";
          emit(impl, t, bench_median(a.reps, [&] { quantize_into(x.data(), rows, cols, l, m, q); }, 0.2));
        }
    });
  }
}
