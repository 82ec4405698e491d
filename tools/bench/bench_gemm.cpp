// tools/bench/bench_gemm.cpp -- build/bin/bench-gemm: our FP8/BF16/FP32 GEMMs vs OpenBLAS sgemm
// and oneDNN bf16 (default ISA, plus a child run limited to AVX512_CORE_BF16, the instruction
// our exact kernels use), side by side in one run, medians of repetitions. `fp8_tiles` and
// `bf16_tiles` are the AMX tile GEMMs (tolerance-checked, not bit-exact; only where AMX exists).
// `fp8_decoded` (M > 16): the exact FP8 GEMM on a pack with gemm_pack_forms::decoded.
// One JSON line per result:
//   {"bench":"gemm","impl":...,"M":..,"N":..,"K":..,"threads":..,"median_s":..,"gflops":..,"runs":..}
// plus two lines about the machine, not GEMM results: {"bench":"gemm_peak","impl":"vdpbf16ps",
// "threads":..,"gflops":..} (the instruction's measured peak) and {"bench":"gemm_dispatch",...}
// (which large-M kernel the rate probe chose). Side by side (alternating rounds, median per-round
// ratio): fp8_vs_onednn_bf16, fp8_vs_openblas_sgemm and fp8_decoded_vs_onednn_bf16 (M >= 512;
// --only=side_by_side), gemv_dram_side_by_side
// (--only=gemv_dram); gemv_call_cost_fp8/_bf16: a decode GEMV's fixed cost per call and streaming rate.
// Usage: bench-gemm [--json] [--quick] [--threads=1,2] [--reps=N] [--only=IMPL]
#include <cblas.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <dnnl.hpp>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "quant/fp8.hpp"
#include "quant/gemm.hpp"
#include "quant/gemm_impl.hpp"
#include "tools/bench/bench_util.hpp"

extern "C" void omp_set_num_threads(int);
extern "C" void openblas_set_num_threads(int);

namespace fp8rl::bench {
double vdpbf16ps_peak_gflops(int threads);  // bench_peak_avx512.cpp
}

using namespace fp8rl;
using namespace fp8rl::bench;
using namespace fp8rl::quant;

namespace {

struct shape { int64_t M, N, K; };

// Standard normal values, like initialized or trained weights. (Multiples of 0.001 in [-1, 1]
// before: 1 value in 2001 was exactly 0, so 3.1% of the FP8 decode kernel's pair steps took the
// patch path; Gaussian 128x128 blocks have ~1% of such steps, printed with each run.)
std::vector<float> rnd(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (auto& x : v) x = normal(gen);
  return v;
}

struct onednn_bf16 {  // matmul with weights reordered once ("packed"), like our packed B
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream st{eng};
  dnnl::memory a, b, c;
  std::unique_ptr<dnnl::matmul> mm;
  std::string isa;
  onednn_bf16(const shape& s, const std::vector<uint16_t>& A, const std::vector<uint16_t>& B) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    dnnl::memory::desc ad({s.M, s.K}, dt::bf16, tag::ab), bd({s.K, s.N}, dt::bf16, tag::any),
        bplain({s.K, s.N}, dt::bf16, tag::ba), cd({s.M, s.N}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), eng);
    isa = pd.impl_info_str();
    a = dnnl::memory(ad, eng, const_cast<uint16_t*>(A.data()));
    dnnl::memory bp(bplain, eng, const_cast<uint16_t*>(B.data()));
    b = dnnl::memory(pd.weights_desc(), eng);
    dnnl::reorder(bp, b).execute(st, bp, b);
    c = dnnl::memory(cd, eng);
    mm = std::make_unique<dnnl::matmul>(pd);
    st.wait();
  }
  void run() {
    mm->execute(st, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    st.wait();
  }
};

void emit(const bench_args& a, const std::string& impl, const shape& s, int t, double sec,
          const std::string& note = "") {
  std::vector<std::pair<std::string, std::string>> f = {
      {"bench", jstr("gemm")}, {"impl", jstr(impl)}, {"M", jnum(double(s.M))}, {"N", jnum(double(s.N))},
      {"K", jnum(double(s.K))}, {"threads", jnum(t)}, {"median_s", jnum(sec)},
      {"gflops", jnum(2.0 * s.M * s.N * s.K / sec / 1e9)}, {"runs", jnum(a.reps)}};
  if (!note.empty()) f.push_back({"note", jstr(note)});
  bench_emit(a, f);
}

// Our FP8 GEMM against oneDNN bf16 (default ISA) and OpenBLAS sgemm in alternating rounds of
// ~0.1 s each, the order swapped every round and 50 ms idle before each (OpenMP's, OpenBLAS's and
// oneTBB's threads spin a while after their work; without the pause that spinning lands in the
// other's round): "speedup" is the median per-round ratio baseline time / FP8 time. Every side
// takes A in its own input format, converted beforehand: FP8 codes + scales, BF16, FP32.
void run_fp8_side_by_side(const bench_args& a, const shape& s, int t, const std::vector<float>& Af,
                          const std::vector<float>& Bf, const std::vector<uint16_t>& Ab, const std::vector<uint16_t>& Bb) {
  std::vector<float> C(size_t(s.M * s.N)), Cb(C.size());
  tbb::task_arena arena(t);
  omp_set_num_threads(t);
  openblas_set_num_threads(t);
  onednn_bf16 o(s, Ab, Bb);
  const qtensor qa = quantize(Af.data(), s.M, s.K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  auto round_s = [](const std::function<void()>& fn, int n) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the other pool's spinning threads go idle
    return bench_time_calls(fn, n);
  };
  const struct { const char* name; std::function<void()> run; std::string note; } baselines[] = {
      {"onednn_bf16", [&] { o.run(); }, o.isa},
      {"openblas_sgemm",
       [&] {
         cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s.M), int(s.N), int(s.K), 1.0f, Af.data(), int(s.K),
                     Bf.data(), int(s.K), 0.0f, Cb.data(), int(s.N));
       },
       "fp32"}};
  // B as the models pack it (codes decoded in registers), then with the decoded form
  // (gemm_pack_forms::decoded: BF16 pairs decoded once at packing) against oneDNN
  for (bool decoded : {false, true}) {
    gemm_pack_forms forms;
    forms.decoded = decoded;
    const auto pb = gemm_pack_fp8(quantize(Bf.data(), s.N, s.K, qlayout::block_128x128, scale_mode::pow2, "B"), forms);
    auto fp8 = [&] { arena.execute([&] { gemm_fp8(qa, pb, C.data()); }); };
    const int n = std::max(1, static_cast<int>(0.1 / std::max(round_s(fp8, 1), 1e-6)));  // calls per round
    for (const auto& b : baselines) {
      if (decoded && std::string(b.name) != "onednn_bf16") continue;
      round_s(fp8, n);  // warm-up rounds: scratch pools, pages, both thread pools started
      round_s(b.run, n);
      const auto ratio = bench_side_by_side(a.reps, [&] { return round_s(fp8, n); }, [&] { return round_s(b.run, n); }).ratio;
      bench_emit(a, {{"bench", jstr("gemm")},
                     {"impl", jstr(std::string(decoded ? "fp8_decoded_vs_" : "fp8_vs_") + b.name + "_side_by_side")},
                     {"M", jnum(double(s.M))}, {"N", jnum(double(s.N))}, {"K", jnum(double(s.K))}, {"threads", jnum(t)},
                     {"speedup", jnum(bench_median_of(ratio))}, {"runs", jnum(double(ratio.size()))}, {"note", jstr(b.note)}});
    }
  }
}

void run_shape(const bench_args& a, const shape& s, int t) {
  auto Af = rnd(size_t(s.M * s.K), 1), Bf = rnd(size_t(s.N * s.K), 2);
  std::vector<uint16_t> Ab(Af.size()), Bb(Bf.size());
  for (size_t i = 0; i < Af.size(); ++i) Ab[i] = bf16_from_float(Af[i]);
  for (size_t i = 0; i < Bf.size(); ++i) Bb[i] = bf16_from_float(Bf[i]);
  std::vector<float> C(size_t(s.M * s.N));
  const bool child = a.extra.count("onednn-isa") > 0;
  tbb::task_arena arena(t);
  if (!child) {
    arena.execute([&] {
      const gemm_desc d{s.M, s.N, s.K};
      if (bench_selected(a, "fp8")) {
        qtensor qa = quantize(Af.data(), s.M, s.K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
        auto pb = gemm_pack_fp8(quantize(Bf.data(), s.N, s.K, qlayout::block_128x128, scale_mode::pow2, "B"));
        int64_t rare = 0;  // pair steps the narrow kernel patches (quant/gemm_avx512.cpp)
        for (uint64_t bits : pb.fp8_rare) rare += __builtin_popcountll(bits);
        emit(a, "fp8", s, t, bench_median(a.reps, [&] { gemm_fp8(qa, pb, C.data()); }),
             pb.fp8_rare.empty() ? "" : "patched (±0/subnormal) pair steps " + std::to_string(100.0 * double(rare) / double(pb.fp8.size() / 64)) + "%");
        emit(a, "fp8+quantA", s, t, bench_median(a.reps, [&] {
          qtensor q = quantize(Af.data(), s.M, s.K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
          gemm_fp8(q, pb, C.data());
        }));
        if (s.M > gemm_config{}.stream_max_m && cpu_isa_active() >= cpu_isa::avx512_bf16)  // both families, forced
          for (gemm_kernel k : {gemm_kernel::wide, gemm_kernel::narrow})
            emit(a, k == gemm_kernel::wide ? "fp8_wide" : "fp8_narrow", s, t, bench_median(a.reps, [&] {
              gemm_config cfg;
              cfg.large_m = k;
              gemm_fp8(qa, pb, C.data(), cfg);
            }));
        if (s.M > gemm_config{}.stream_max_m && cpu_isa_active() >= cpu_isa::avx512_bf16) {
          gemm_pack_forms forms;
          forms.decoded = true;  // BF16 pairs decoded once at packing
          const auto pd = gemm_pack_fp8(quantize(Bf.data(), s.N, s.K, qlayout::block_128x128, scale_mode::pow2, "B"), forms);
          emit(a, "fp8_decoded", s, t, bench_median(a.reps, [&] { gemm_fp8(qa, pd, C.data()); }));
        }
      }
      if (bench_selected(a, "fp8_tiles") && gemm_tiles_available()) {
        qtensor qa = quantize(Af.data(), s.M, s.K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
        auto pb = gemm_pack_fp8(quantize(Bf.data(), s.N, s.K, qlayout::block_128x128, scale_mode::pow2, "B"),
                                {false, false, true});
        emit(a, "fp8_tiles", s, t, bench_median(a.reps, [&] { gemm_fp8_tiles(qa, pb, C.data()); }));
      }
      if (bench_selected(a, "bf16")) {
        auto pb = gemm_pack_bf16(Bb.data(), s.N, s.K);
        emit(a, "bf16", s, t, bench_median(a.reps, [&] { gemm_bf16(d, Ab.data(), pb, C.data()); }));
      }
      if (bench_selected(a, "bf16_tiles") && gemm_tiles_available()) {
        auto pb = gemm_pack_bf16(Bb.data(), s.N, s.K, "B", {false, false, true});
        emit(a, "bf16_tiles", s, t, bench_median(a.reps, [&] { gemm_bf16_tiles(d, Ab.data(), pb, C.data()); }));
      }
      if (bench_selected(a, "f32")) {
        auto pb = gemm_pack_f32(Bf.data(), s.N, s.K);
        emit(a, "f32", s, t, bench_median(a.reps, [&] { gemm_f32(d, Af.data(), pb, C.data()); }));
      }
    });
    if (bench_selected(a, "openblas_sgemm")) {
      openblas_set_num_threads(t);
      emit(a, "openblas_sgemm", s, t, bench_median(a.reps, [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s.M), int(s.N), int(s.K), 1.0f, Af.data(),
                    int(s.K), Bf.data(), int(s.K), 0.0f, C.data(), int(s.N));
      }));
    }
  }
  if (bench_selected(a, "onednn_bf16")) {
    omp_set_num_threads(t);
    onednn_bf16 o(s, Ab, Bb);
    const std::string impl = child ? "onednn_bf16_" + a.extra.at("onednn-isa") : "onednn_bf16";
    emit(a, impl, s, t, bench_median(a.reps, [&] { o.run(); }), o.isa);
  }
  if (!child && s.M >= 512 && bench_selected(a, "side_by_side")) run_fp8_side_by_side(a, s, t, Af, Bf, Ab, Bb);
}

// One decode GEMV (M = 1) with B streamed from DRAM, in both formats: copy_bytes of copies of B per
// format (the decode form only, on huge pages, as generation keeps it), so that no call finds its B
// cached. Built inside the arena that will time it; the constructor's warm-up calls every copy once
// (threads and scratch pools started, each copy read once): first passes over fresh pages ran
// 10-17% slower (Zen 5, both formats), and FP8, with ~2x the copies, would take more of them.
struct dram_gemv {
  int64_t N, K;
  std::vector<uint16_t> Ab;
  qtensor qa;
  std::vector<float> C;
  std::vector<gemm_packed_b> c8, c16;
  size_t n8 = 0, n16 = 0;
  dram_gemv(int64_t n, int64_t k, int64_t copy_bytes) : N(n), K(k), C(size_t(n)) {
    const auto Af = rnd(size_t(K), 1), Bf = rnd(size_t(N * K), 2);
    std::vector<uint16_t> Bb(Bf.size());
    for (float x : Af) Ab.push_back(bf16_from_float(x));
    for (size_t i = 0; i < Bf.size(); ++i) Bb[i] = bf16_from_float(Bf[i]);
    qa = quantize(Af.data(), 1, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
    const gemm_pack_forms narrow{false, true, false, true};
    const auto pf = gemm_pack_fp8(quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B"), narrow);
    const auto pb = gemm_pack_bf16(Bb.data(), N, K, "B", narrow);
    c8.assign(size_t(copy_bytes / pf.bytes() + 1), pf);
    c16.assign(size_t(copy_bytes / pb.bytes() + 1), pb);
    for (size_t i = 0; i < c8.size(); ++i) fp8_call();
    for (size_t i = 0; i < c16.size(); ++i) bf16_call();
  }
  void fp8_call() { gemm_fp8(qa, c8[n8++ % c8.size()], C.data()); }
  void bf16_call() { gemm_bf16({1, N, K}, Ab.data(), c16[n16++ % c16.size()], C.data()); }
  double fp8_seconds(int calls) { return bench_time_calls([this] { fp8_call(); }, calls); }
  double bf16_seconds(int calls) { return bench_time_calls([this] { bf16_call(); }, calls); }
};

// GEMV with B streamed from DRAM (1.5 GiB of copies per format). FP8 and BF16 calls alternate
// (order swapped every round) so both see the same memory traffic of a shared machine; each
// format's line is its median over the rounds and "gemv_dram_side_by_side" the median of the
// per-round ratios bf16 time / fp8 time.
void run_gemv_dram(const bench_args& a, int t) {
  constexpr int64_t kStreamBytes = int64_t{3} << 29;  // 1.5 GiB per format
  constexpr int kCallsPerRound = 16;                  // per round: 256 MiB of FP8 codes, 512 MiB of BF16
  const shape s{1, 4096, 4096};
  tbb::task_arena arena(t);
  arena.execute([&] {
    dram_gemv g(s.N, s.K, kStreamBytes);
    const auto side = bench_side_by_side(a.reps, [&] { return g.fp8_seconds(kCallsPerRound); },
                                         [&] { return g.bf16_seconds(kCallsPerRound); });
    emit(a, "gemv_dram_fp8", s, t, bench_median_of(side.a), std::to_string(g.c8.size()) + " copies of B (huge pages)");
    emit(a, "gemv_dram_bf16", s, t, bench_median_of(side.b), std::to_string(g.c16.size()) + " copies of B (huge pages)");
    bench_emit(a, {{"bench", jstr("gemm")}, {"impl", jstr("gemv_dram_side_by_side")}, {"M", jnum(double(s.M))},
                   {"N", jnum(double(s.N))}, {"K", jnum(double(s.K))}, {"threads", jnum(t)},
                   {"speedup", jnum(bench_median_of(side.ratio))}, {"runs", jnum(double(side.ratio.size()))}});
  });
}

// The least-squares line y = at0 + slope * x through (x[i], y[i]).
struct line {
  double at0 = 0, slope = 0;
};
line line_fit(const std::vector<double>& x, const std::vector<double>& y) {
  double mx = 0, my = 0, sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += x[i] / double(x.size()), my += y[i] / double(x.size());
  for (size_t i = 0; i < x.size(); ++i) sxy += (x[i] - mx) * (y[i] - my), sxx += (x[i] - mx) * (x[i] - mx);
  return {my - sxy / sxx * mx, sxy / sxx};
}

// What a decode GEMV costs apart from its bytes: time per call at K = 2048 for N = 512 ... 8192, B
// streamed from DRAM (128 MiB of copies per format and N), FP8 and BF16 calls alternating (which
// goes first swaps every round); a least-squares line through each format's per-N medians gives
// its fixed microseconds per call (fork/join, the threads' start and uneven finish, the streams'
// ramp-up) and its streaming rate. At equal rates the fixed part is what holds the decode step
// under its bytes ratio: it weighs twice against FP8's half-length calls.
void run_gemv_call_cost(const bench_args& a, int t) {
  constexpr int64_t K = 2048, kCopyBytes = int64_t{1} << 27;
  constexpr int kCallsPerRound = 8;
  const std::vector<int64_t> Ns{512, 1024, 2048, 4096, 8192};
  tbb::task_arena arena(t);
  arena.execute([&] {
    std::vector<std::unique_ptr<dram_gemv>> g;
    for (int64_t N : Ns) g.push_back(std::make_unique<dram_gemv>(N, K, kCopyBytes));
    const int rounds = 4 * std::max(a.reps, 1);
    std::vector<std::vector<double>> t8(Ns.size()), t16(Ns.size());
    for (int r = 0; r < rounds; ++r)
      for (size_t i = 0; i < Ns.size(); ++i) {
        auto fp8_calls = [&] { t8[i].push_back(g[i]->fp8_seconds(kCallsPerRound)); };
        auto bf16_calls = [&] { t16[i].push_back(g[i]->bf16_seconds(kCallsPerRound)); };
        if ((r + int(i)) % 2) fp8_calls(), bf16_calls();
        else bf16_calls(), fp8_calls();
      }
    for (int f = 0; f < 2; ++f) {
      std::vector<double> x, us;
      std::string at;
      for (size_t i = 0; i < Ns.size(); ++i) {
        x.push_back(double(Ns[i]));
        us.push_back(bench_median_of(f ? t16[i] : t8[i]) * 1e6);
        at += (i ? " " : "") + std::to_string(Ns[i]) + ":" + jnum(us.back());
      }
      const line l = line_fit(x, us);  // us = l.at0 + l.slope * N
      const double bytes_per_row = double(K) * (f ? 2 : 1);
      bench_emit(a, {{"bench", jstr("gemm")}, {"impl", jstr(f ? "gemv_call_cost_bf16" : "gemv_call_cost_fp8")},
                     {"K", jnum(double(K))}, {"threads", jnum(t)}, {"fixed_us", jnum(l.at0)},
                     {"stream_gbps", jnum(bytes_per_row / l.slope / 1e3)}, {"us_at_N", jstr(at)}, {"runs", jnum(rounds)}});
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  bench_args a = bench_parse(argc, argv, {{"shapes", "MxNxK,MxNxK,...: only these GEMM shapes"},
                                          {"onednn-isa", "internal: the child run of oneDNN limited to avx512_core_bf16"}});
  if (a.extra.count("onednn-isa")) {  // child: oneDNN limited to one ISA (must precede any use)
    if (a.extra["onednn-isa"] != "avx512_core_bf16") { std::fprintf(stderr, "unsupported isa\n"); return 2; }
    dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);
  }
  std::vector<shape> shapes;
  for (int64_t n : a.quick ? std::vector<int64_t>{1024, 2048} : std::vector<int64_t>{1024, 2048, 4096})
    shapes.push_back({n, n, n});
  for (int64_t m : {1, 8, 64, 512})
    for (auto nk : {std::pair<int64_t, int64_t>{2048, 2048}, {5632, 2048}, {2048, 5632}})
      shapes.push_back({m, nk.first, nk.second});
  shapes.push_back({1, 4096, 4096});  // GEMV (decode; B stays cached: see gemv_dram)
  if (a.extra.count("shapes")) {       // --shapes=MxNxK,MxNxK: only these
    shapes.clear();
    std::stringstream ss(a.extra["shapes"]);
    std::string item;
    while (std::getline(ss, item, ',')) {
      std::vector<int64_t> d;  // M, N, K: positive integers joined by 'x'
      for (size_t p = 0; p <= item.size();) {
        const size_t q = std::min(item.find('x', p), item.size());
        d.push_back(bench_positive("--shapes (" + item + ")", item.substr(p, q - p), 1 << 20));
        p = q + 1;
      }
      if (d.size() != 3) { std::fprintf(stderr, "option --shapes: '%s' is not MxNxK\n", item.c_str()); return 2; }
      shapes.push_back({d[0], d[1], d[2]});
    }
  }
  if (!a.extra.count("onednn-isa") && bench_selected(a, "peak"))
    for (int t : a.threads)
      bench_emit(a, {{"bench", jstr("gemm_peak")}, {"impl", jstr("vdpbf16ps")}, {"threads", jnum(t)},
                     {"gflops", jnum(vdpbf16ps_peak_gflops(t))}, {"runs", jnum(a.reps)}});
  if (!a.extra.count("onednn-isa") && cpu_isa_active() >= cpu_isa::avx512_bf16)
    bench_emit(a, {{"bench", jstr("gemm_dispatch")}, {"impl", jstr("rate_probe")},
                   {"large_m_kernel", jstr(gemm_narrow_preferred() ? "narrow" : "wide")},
                   {"dpbf16_fma_rate_ratio", jnum(fp8rl::quant::detail::dpbf16_fma_rate_ratio())}});
  for (const auto& s : shapes)
    for (int t : a.threads) run_shape(a, s, t);
  for (const char* dram : {"gemv_dram", "gemv_call_cost"}) {  // each streams GiBs: not in a --quick run, said so
    if (a.extra.count("onednn-isa") || !bench_selected(a, dram)) continue;
    if (a.quick) std::fprintf(stderr, "bench-gemm: %s skipped under --quick\n", dram);
    else for (int t : a.threads) (std::string(dram) == "gemv_dram" ? run_gemv_dram : run_gemv_call_cost)(a, t);
  }
  // the oneDNN AVX512_CORE_BF16 baseline runs in a child process (set_max_cpu_isa is once per process)
  if (!a.extra.count("onednn-isa") && bench_selected(a, "onednn_bf16")) {
    std::string cmd = std::string(argv[0]) + " --onednn-isa=avx512_core_bf16";
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]).rfind("--only=", 0) != 0) cmd += std::string(" ") + argv[i];
    cmd += " --only=onednn_bf16";
    std::fflush(stdout);
    return std::system(cmd.c_str()) == 0 ? 0 : 1;
  }
  return 0;
}
