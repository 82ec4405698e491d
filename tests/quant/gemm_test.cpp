// tests/quant/gemm_test.cpp -- CPU GEMMs: every fast path equals its scalar reference bit for
// bit (random and ragged shapes, every ISA level, thread counts), each path against FP64 with a
// named tolerance, and exact-integer FP8 inputs give exact results (fp8-numerics.md §6).
#include <gtest/gtest.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cfloat>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <limits>
#include <string>

#include "quant/fp8.hpp"
#include "quant/gemm.hpp"
#include "quant/gemm_impl.hpp"
#include "tests/quant/nonfinite_cases.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::quant;
using fp8rl::test::first_diff;
using fp8rl::test::nonfinite_text;
using fp8rl::test::randn;

namespace {
const cpu_isa kIsas[] = {cpu_isa::portable, cpu_isa::avx512, cpu_isa::avx512_bf16};
const gemm_kernel kKernels[] = {gemm_kernel::wide, gemm_kernel::narrow};

// Forces one kernel family for every M.
gemm_config force(cpu_isa isa, gemm_kernel k, gemm_decode dec = gemm_decode::automatic) { return {isa, 0, k, dec}; }
// both ways the narrow FP8 kernel can decode for batched decode (8 < M <= 32)
const gemm_decode kDecodes[] = {gemm_decode::once, gemm_decode::per_tile};

// The narrow FP8 kernel on B's codes pack pb and decoded pack pd, for each M (A random with
// seed + M, 1x128 tiles in `mode`) and each batched-decode mode: check(M, ref, fast, what) gets
// the reference's and the kernel's outputs; the runs stop at the first fatal failure.
template <class Check>
void narrow_fp8_runs(const qtensor& B, const gemm_packed_b& pb, const gemm_packed_b& pd, std::initializer_list<int64_t> Ms,
                     uint64_t seed, scale_mode mode, Check&& check) {
  for (int64_t M : Ms) {
    auto Af = randn(M * B.op_cols(), seed + M, 2.0f);
    qtensor A = quantize(Af.data(), M, B.op_cols(), qlayout::rowwise_1x128, mode, "A");
    std::vector<float> ref(M * B.op_rows()), fast(ref.size());
    gemm_fp8_ref(A, B, ref.data());
    for (const gemm_packed_b* p : {&pb, &pd})
      for (gemm_decode dec : kDecodes) {
        std::fill(fast.begin(), fast.end(), -1.0f);
        gemm_fp8(A, *p, fast.data(), force(cpu_isa::avx512_bf16, gemm_kernel::narrow, dec));
        check(M, ref, fast, "M=" + std::to_string(M) + " decode " + std::to_string(int(dec)) + (p == &pd ? " decoded form" : ""));
        if (::testing::Test::HasFatalFailure()) return;
      }
  }
}
const char* kernel_name(gemm_kernel k) { return k == gemm_kernel::narrow ? "narrow" : "wide"; }
// K = 2200: more than 16 K-blocks (the FP8 tiles make scale products 16 blocks at a time) in
// 4-panel tiles (M = 2, N = 128), 8 + 2-row tiles (M = 10; batched decode may decode once per
// block there) and per-tile rows past the batched-decode range (M = 40); decode-sized M reads
// panels g, g + Q, g + 2Q, g + 3Q at once (Q = panels / 4): with panels left over and a partial
// last panel (M = 1, N = 300: 10 panels) and a partial last panel inside a group (M = 2, N = 230)
const int64_t kShapes[][3] = {{1, 32, 128}, {1, 4096 / 8, 1024}, {3, 33, 129}, {8, 64, 256}, {9, 70, 300},
                              {17, 100, 127}, {64, 96, 384}, {130, 257, 250}, {5, 31, 1}, {10, 40, 2200},
                              {2, 128, 2200}, {40, 64, 2200}, {1, 300, 260}, {2, 230, 384}};

bool have(cpu_isa isa) { return cpu_isa_detected() >= isa; }

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_from_float(x[i]);
  return b;
}

// C = A·B^T in FP64 from float operands
std::vector<double> gemm_f64(const std::vector<float>& A, const std::vector<float>& B, int64_t M,
                             int64_t N, int64_t K) {
  std::vector<double> C(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(A[m * K + k]) * B[n * K + k];
      C[m * N + n] = s;
    }
  return C;
}
}  // namespace

// Every ISA-dependent test of the suite skips (or loops past) what cpu_isa_detected() says this
// CPU lacks, so a detection that misfires would pass them silently. Detection agrees with the
// kernel's flags in /proc/cpuinfo (AMX also needs the kernel's permission: flags without the
// level are reported, not failed), and FP8RL_REQUIRE_ISA=avx512|avx512_bf16|amx (CI sets it per
// machine) fails where the detected level is lower.
TEST(Gemm, IsaDetectionAgreesWithTheKernelsFlags) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line) && line.rfind("flags", 0) != 0) {}
  if (line.empty()) GTEST_SKIP() << "no flags line in /proc/cpuinfo";
  std::istringstream words(line.substr(line.find(':') + 1));
  std::set<std::string> flags{std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
  auto all = [&](std::initializer_list<const char*> names) {
    return std::all_of(names.begin(), names.end(), [&](const char* f) { return flags.count(f) > 0; });
  };
  const bool avx512 = all({"avx512f", "avx512bw", "avx512vl", "avx512dq"});
  const bool bf16 = avx512 && all({"avx512_bf16", "avx512vbmi", "avx512_vbmi2", "gfni"});
  const cpu_isa d = cpu_isa_detected();
  EXPECT_EQ(d >= cpu_isa::avx512, avx512) << cpu_isa_name(d);
  EXPECT_EQ(d >= cpu_isa::avx512_bf16, bf16) << cpu_isa_name(d);
  if (bf16 && all({"amx_tile", "amx_bf16"}) && d < cpu_isa::amx)
    std::printf("AMX flags present, tiles not granted by the kernel (ARCH_REQ_XCOMP_PERM)\n");
  EXPECT_FALSE(d >= cpu_isa::amx && !all({"amx_tile", "amx_bf16"})) << cpu_isa_name(d);
  if (const char* req = std::getenv("FP8RL_REQUIRE_ISA")) {
    const std::string r = req;
    const cpu_isa want = r == "amx" ? cpu_isa::amx : r == "avx512_bf16" ? cpu_isa::avx512_bf16 : r == "avx512" ? cpu_isa::avx512 : cpu_isa::portable;
    ASSERT_TRUE(want != cpu_isa::portable || r == "portable") << "FP8RL_REQUIRE_ISA='" << r << "' names no level";
    EXPECT_GE(d, want) << "FP8RL_REQUIRE_ISA=" << r << ", detected " << cpu_isa_name(d);
  }
}

TEST(Gemm, F32FastEqualsReference) {
  uint64_t seed = 100;
  for (auto& s : kShapes) {
    const gemm_desc d{s[0], s[1], s[2]};
    auto A = randn(d.M * d.K, seed++), B = randn(d.N * d.K, seed++);
    std::vector<float> ref(d.M * d.N), fast(d.M * d.N, -1.0f);
    gemm_f32_ref(d, A.data(), B.data(), ref.data());
    auto pb = gemm_pack_f32(B.data(), d.N, d.K);
    for (cpu_isa isa : kIsas) {
      if (!have(isa)) continue;
      gemm_f32(d, A.data(), pb, fast.data(), {isa});
      ASSERT_EQ(first_diff(fast, ref), -1) << d.str() << " isa " << cpu_isa_name(isa);
    }
    EXPECT_LT(fp8rl::tol::calc_diff(fp8rl::test::to_double(ref), gemm_f64(A, B, d.M, d.N, d.K)),
              fp8rl::tol::kGemmF32VsF64Diff) << d.str();
  }
}

TEST(Gemm, Bf16FastEqualsReference) {
  uint64_t seed = 200;
  for (auto& s : kShapes) {
    const gemm_desc d{s[0], s[1], s[2]};
    auto Af = randn(d.M * d.K, seed++), Bf = randn(d.N * d.K, seed++);
    auto A = to_bf16(Af), B = to_bf16(Bf);
    std::vector<float> ref(d.M * d.N), fast(d.M * d.N, -1.0f);
    gemm_bf16_ref(d, A.data(), B.data(), ref.data());
    auto pb = gemm_pack_bf16(B.data(), d.N, d.K);
    for (cpu_isa isa : kIsas)
      for (gemm_kernel k : kKernels) {
        if (!have(isa)) continue;
        gemm_bf16(d, A.data(), pb, fast.data(), force(isa, k));
        ASSERT_EQ(first_diff(fast, ref), -1) << d.str() << " isa " << cpu_isa_name(isa) << " " << kernel_name(k);
      }
    // same BF16 inputs in FP64: only FP32 accumulation error remains
    std::vector<float> Ar(A.size()), Br(B.size());
    for (size_t i = 0; i < A.size(); ++i) Ar[i] = bf16_to_float(A[i]);
    for (size_t i = 0; i < B.size(); ++i) Br[i] = bf16_to_float(B[i]);
    EXPECT_LT(fp8rl::tol::calc_diff(fp8rl::test::to_double(ref), gemm_f64(Ar, Br, d.M, d.N, d.K)),
              fp8rl::tol::kGemmBf16VsF64Diff);
    EXPECT_LT(fp8rl::tol::calc_diff(fp8rl::test::to_double(ref), gemm_f64(Af, Bf, d.M, d.N, d.K)),
              fp8rl::tol::kGemmBf16VsF32DataDiff);
  }
}

// VDPBF16PS treats denormal inputs as zero and flushes denormal results; the reference models it.
// The first case's denormal terms vanish beside normal ones; the second's decide the result: a
// product of normal inputs that is denormal (1e-20 x 1e-20, FTZ: 0), and a denormal input times
// 2^100 (2^-130 x 2^100 = 2^-30 without DAZ: 0 with it).
TEST(Gemm, Bf16DenormalsFollowTheDazFtzModel) {
  auto expect_every_kernel = [](const gemm_desc& d, const std::vector<uint16_t>& A, const std::vector<uint16_t>& B,
                                const std::vector<float>& ref, const char* what) {
    auto pb = gemm_pack_bf16(B.data(), d.N, d.K);
    std::vector<float> fast(ref.size());
    for (cpu_isa isa : kIsas)
      for (gemm_kernel k : kKernels) {
        if (!have(isa)) continue;
        std::fill(fast.begin(), fast.end(), -1.0f);
        gemm_bf16(d, A.data(), pb, fast.data(), force(isa, k));
        EXPECT_EQ(first_diff(fast, ref), -1) << what << ", " << cpu_isa_name(isa) << " " << kernel_name(k);
      }
  };
  {
    const gemm_desc d{2, 32, 2};
    const std::vector<float> Af = {1e-20f, 0.0f, std::ldexp(1.0f, -130), 0.0f};
    std::vector<float> Bf(32 * 2, 0.0f);
    for (int n = 0; n < 32; ++n) Bf[n * 2] = n % 2 ? 1e-20f : std::ldexp(1.0f, 100);
    auto A = to_bf16(Af), B = to_bf16(Bf);
    std::vector<float> ref(64);
    gemm_bf16_ref(d, A.data(), B.data(), ref.data());
    for (int n = 0; n < 32; n += 2) {
      EXPECT_EQ(ref[n + 1], 0.0f) << "FTZ, column " << n + 1;
      EXPECT_EQ(ref[32 + n], 0.0f) << "DAZ, column " << n;
      EXPECT_EQ(ref[n], bf16_to_float(A[0]) * std::ldexp(1.0f, 100)) << n;  // exact: a power of 2
    }
    expect_every_kernel(d, A, B, ref, "decisive case");
  }
  const gemm_desc d{2, 32, 4};
  std::vector<float> Af = {1e-39f, 1.0f, 1e-20f, 1e-20f, 2.0f, -1e-39f, 3.0f, 1e-19f};
  std::vector<float> Bf(32 * 4);
  for (int n = 0; n < 32; ++n) {
    Bf[n * 4 + 0] = 1.0f; Bf[n * 4 + 1] = 1e-30f * float(n + 1); Bf[n * 4 + 2] = 1e-20f; Bf[n * 4 + 3] = -1e-20f;
  }
  auto A = to_bf16(Af), B = to_bf16(Bf);
  std::vector<float> ref(64);
  gemm_bf16_ref(d, A.data(), B.data(), ref.data());
  expect_every_kernel(d, A, B, ref, "vanishing case");
}

TEST(Gemm, Fp8FastEqualsReference) {
  uint64_t seed = 300;
  int per_column_scales = 0;  // packs whose narrow kernel reads 32 scales per (panel, block)
  for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32})
    for (qlayout bl : {qlayout::block_128x128, qlayout::rowwise_1x128})
      for (auto& s : kShapes) {
        const int64_t M = s[0], N = s[1], K = s[2];
        auto Af = randn(M * K, seed++, 2.0f), Bf = randn(N * K, seed++, 0.5f);
        qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, mode, "A");
        qtensor B = quantize(Bf.data(), N, K, bl, mode, "B");
        std::vector<float> ref(M * N), fast(M * N, -1.0f);
        gemm_fp8_ref(A, B, ref.data());
        auto pb = gemm_pack_fp8(B);
        if (bl == qlayout::block_128x128) {
          ASSERT_FALSE(pb.scale_panel.empty()) << "128x128 blocks: one scale per panel";
        }
        per_column_scales += pb.scale_panel.empty();
        for (cpu_isa isa : kIsas) {
          if (!have(isa)) continue;
          for (gemm_kernel k : kKernels) {
            gemm_fp8(A, pb, fast.data(), force(isa, k));
            ASSERT_EQ(first_diff(fast, ref), -1)
                << "M=" << M << " N=" << N << " K=" << K << " isa " << cpu_isa_name(isa) << " "
                << kernel_name(k) << " mode " << int(mode) << " B layout " << int(bl);
          }
        }
      }
  EXPECT_GT(per_column_scales, 0) << "no case took the per-column scales";
}

// 1x128 weight scales equal in a panel's first 31 columns and not in its last: the panel keeps
// per-column scales (one per panel would scale column 31 by the others' scale).
TEST(Gemm, Fp8PanelScaleNeedsEveryColumnEqual) {
  const int64_t M = 3, N = 32, K = 128;
  std::vector<float> Bf(N * K, 0.5f);
  std::fill(Bf.begin() + 31 * K, Bf.end(), 50.0f);
  const auto Af = randn(M * K, 7);
  const qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  const qtensor B = quantize(Bf.data(), N, K, qlayout::rowwise_1x128, scale_mode::pow2, "B");
  std::vector<float> ref(M * N), fast(M * N, -1.0f);
  gemm_fp8_ref(A, B, ref.data());
  const auto pb = gemm_pack_fp8(B);
  EXPECT_TRUE(pb.scale_panel.empty());
  for (cpu_isa isa : kIsas) {
    if (!have(isa)) continue;
    for (gemm_kernel k : kKernels) {
      std::fill(fast.begin(), fast.end(), -1.0f);
      gemm_fp8(A, pb, fast.data(), force(isa, k));
      EXPECT_EQ(first_diff(fast, ref), -1) << cpu_isa_name(isa) << " " << kernel_name(k);
    }
  }
}

// Random shapes (seeded): M in [1, 48] (decode, batched decode, short prefill tiles), N in
// [1, 300], K in [1, 700], ragged in every dimension; each ISA and kernel equals the reference.
TEST(Gemm, Fp8RandomShapesEqualTheReference) {
  std::mt19937 g(77);
  for (int i = 0; i < 24; ++i) {
    const int64_t M = 1 + g() % 48, N = 1 + g() % 300, K = 1 + g() % 700;
    auto Af = randn(M * K, 1000 + i, 1.5f), Bf = randn(N * K, 2000 + i, 0.3f);
    qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
    qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
    std::vector<float> ref(M * N), fast(M * N);
    gemm_fp8_ref(A, B, ref.data());
    const auto pb = gemm_pack_fp8(B);
    for (cpu_isa isa : kIsas) {
      if (!have(isa)) continue;
      for (gemm_kernel k : kKernels)
        for (gemm_decode dec : kDecodes) {
          std::fill(fast.begin(), fast.end(), -1.0f);
          gemm_fp8(A, pb, fast.data(), force(isa, k, dec));
          ASSERT_EQ(first_diff(fast, ref), -1) << "M=" << M << " N=" << N << " K=" << K << " isa " << cpu_isa_name(isa)
                                               << " " << kernel_name(k) << " decode " << int(dec);
        }
    }
  }
}

// The narrow FP8 kernel decodes codes by affine bit maps and patches pair steps holding ±0,
// subnormal codes (or NaN) with values precomputed at packing; both kinds of step, next to each other in one
// block, in every row of a panel, give the reference's bits. Every non-NaN code appears.
TEST(Gemm, Fp8NarrowKernelTakesEveryCodeBitExactly) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16: no narrow kernel";
  const int64_t N = 70, K = 384;
  for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {
    auto Bf = randn(N * K, 41, 1.0f, 0.0f);
    qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, mode, "B");
    uint8_t code = 0;
    for (int64_t n = 0; n < N; ++n)  // codes 0x00..0xfe except NaN in every third pair step
      for (int64_t k = 0; k < K; k += 6) {
        if (((code + 1) & 0x7f) == 0) ++code;  // skip 0x7f and 0xff (NaN), so the next is 0x80 or 0x00
        B.data[n * K + k + (n % 2)] = code++;
      }
    gemm_pack_forms decoded{false, true, false};
    decoded.decoded = true;
    const gemm_packed_b pb = gemm_pack_fp8(B, {false, true, false}), pd = gemm_pack_fp8(B, decoded);
    ASSERT_EQ(pd.bf16.size(), pd.fp8.size());
    int64_t rare = 0;
    for (uint64_t bits : pb.fp8_rare) rare += __builtin_popcountll(bits);
    ASSERT_GT(rare, 0);
    ASSERT_LT(rare, int64_t(pb.fp8.size() / 64)) << "some steps must take the affine decoder";
    // 1: the table decode; 20: batched decode, each block decoded once for 3 row tiles, or (pd)
    // the decoded form
    narrow_fp8_runs(B, pb, pd, {1, 3, 8, 20, 40}, 42, mode, [&](int64_t, const auto& ref, const auto& fast, const std::string& what) {
      ASSERT_EQ(first_diff(fast, ref), -1) << what << " mode " << int(mode);
    });
    if (HasFatalFailure()) return;
  }
}

// NaN codes (0x7f, 0xff: the quantizer never writes them, a loaded tensor may hold them) reach
// every narrow path as NaN -- the affine decoder's patches, the tables, the decoded form -- and
// only in their own column: every other output keeps the reference's bits.
TEST(Gemm, Fp8NarrowKernelPropagatesNanCodesToTheirColumnOnly) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16: no narrow kernel";
  const int64_t N = 70, K = 256;
  auto Bf = randn(N * K, 61, 1.0f, 0.0f);
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  const int64_t nan_col[2] = {3, 40};
  B.data[nan_col[0] * K + 5] = 0x7f;
  B.data[nan_col[1] * K + 200] = 0xff;
  gemm_pack_forms decoded{false, true, false};
  decoded.decoded = true;
  const gemm_packed_b pb = gemm_pack_fp8(B, {false, true, false}), pd = gemm_pack_fp8(B, decoded);
  // tables (M <= 2), affine maps + patches, batched, decoded form
  narrow_fp8_runs(B, pb, pd, {1, 2, 8, 20}, 62, scale_mode::pow2, [&](int64_t M, const auto& ref, const auto& fast, const std::string& what) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const bool nan_here = n == nan_col[0] || n == nan_col[1];
        ASSERT_EQ(std::isnan(ref[m * N + n]), nan_here) << "reference m=" << m << " n=" << n;
        if (nan_here) ASSERT_TRUE(std::isnan(fast[m * N + n])) << what << " m=" << m << " n=" << n;
        else ASSERT_EQ(std::bit_cast<uint32_t>(fast[m * N + n]), std::bit_cast<uint32_t>(ref[m * N + n]))
            << what << " m=" << m << " n=" << n;
      }
  });
}

// Patches at their largest: pair steps whose every code is ±0 or subnormal (all 64 words of
// both decoder outputs patched), a whole 128-K block of them, then such steps alternating with
// plain ones, in a full and a partial panel.
TEST(Gemm, Fp8NarrowKernelPatchesStepsOfOnlyRareCodes) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16: no narrow kernel";
  const int64_t N = 40, K = 256;
  auto Bf = randn(N * K, 51, 1.0f, 0.0f);
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      if (k < 128 || (k / 2) % 2 == 0) {
        const int c = static_cast<int>((n * 7 + k) % 16);  // 0x00-0x07 and 0x80-0x87
        B.data[n * K + k] = static_cast<uint8_t>((c & 8) << 4 | (c & 7));
      }
  const gemm_packed_b pb = gemm_pack_fp8(B, {false, true, false});
  const int64_t KB = K / 128;
  for (int64_t pn = 0; pn < 2; ++pn) {
    ASSERT_EQ(pb.fp8_rare[pn * KB], ~uint64_t{0}) << "block 0 of panel " << pn << ": every step rare";
    ASSERT_EQ(pb.fp8_rare[pn * KB + 1], 0x5555555555555555ull) << "block 1 of panel " << pn << ": every other step";
  }
  EXPECT_EQ(pb.fp8_rare_at[1] - pb.fp8_rare_at[0], 64u * (4 + 64)) << "full panel: 64 steps of 64 patched words";
  gemm_pack_forms decoded{false, true, false};
  decoded.decoded = true;
  const gemm_packed_b pd = gemm_pack_fp8(B, decoded);
  // 1, 2: the table decode; 32: batched decode (four full row tiles per decoded block), or (pd)
  // the decoded form, its patched words written at packing
  narrow_fp8_runs(B, pb, pd, {1, 2, 5, 32}, 52, scale_mode::pow2, [&](int64_t, const auto& ref, const auto& fast, const std::string& what) {
    ASSERT_EQ(first_diff(fast, ref), -1) << what;
  });
}

// The register panel packer writes every code where fp8_stream_pos puts it (narrow) and its exact
// FP32 value (wide), for all 256 codes, leaving the K % 16 tail to the scalar loop.
TEST(Gemm, Fp8PanelPackerPlacesEveryCode) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16+VBMI: scalar packing only";
  const int64_t K = 100, Kp = 128;
  std::vector<uint8_t> src(32 * K);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + i / 256);
  fp8rl::avector<float> wide(Kp * 32, -1.0f);
  fp8rl::avector<uint8_t> narrow(Kp * 32, 0xAA);
  const int64_t done = fp8rl::quant::detail::fp8_pack_panel_avx512(src.data(), K, wide.data(), narrow.data());
  ASSERT_EQ(done, 96);
  for (int64_t j = 0; j < 32; ++j)
    for (int64_t k = 0; k < done; ++k) {
      const uint8_t c = src[j * K + k];
      const float want = e4m3_to_float(c), got = wide[k * 32 + j];
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(got)) << j << "," << k;
      else ASSERT_EQ(float_bits(got), float_bits(want)) << "column " << j << " k " << k;
      ASSERT_EQ(narrow[(k / 2) * 64 + fp8rl::quant::detail::fp8_stream_pos(int(j), int(k & 1))], c) << j << "," << k;
    }
  EXPECT_EQ(wide[done * 32], -1.0f);  // the tail is untouched
  EXPECT_EQ(narrow[done / 2 * 64], 0xAA);
}

// Against FP64 on the original data. Outlier-free normal data, as DeepGEMM's bound assumes
// (outlier blocks push small values toward E4M3 subnormals, which the bound does not cover).
TEST(Gemm, Fp8CloseToFp64OnNormalData) {
  uint64_t seed = 400;
  for (auto& s : kShapes) {
    const int64_t M = s[0], N = s[1], K = s[2];
    if (M * N < 256) continue;  // too few outputs for a normwise statistic
    auto Af = randn(M * K, seed++, 1.0f, 0.0f), Bf = randn(N * K, seed++, 1.0f, 0.0f);
    qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
    qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
    std::vector<float> C(M * N);
    gemm_fp8(A, gemm_pack_fp8(B), C.data());
    EXPECT_LT(fp8rl::tol::calc_diff(fp8rl::test::to_double(C), gemm_f64(Af, Bf, M, N, K)),
              fp8rl::tol::kGemmFp8VsF64Diff) << M << "x" << N << "x" << K;
  }
}

TEST(Gemm, Fp8WgradOperandsColumnwise) {
  // dW[out,in] = dY^T · X: A = dY columnwise (operand [out][T]), B = X columnwise ([in][T])
  const int64_t T = 300, out = 96, in = 160;
  auto dY = randn(T * out, 1, 1.0f, 0.0f), X = randn(T * in, 2, 1.0f, 0.0f);  // outlier-free: kGemmFp8VsF64Diff's premise
  qtensor A = quantize(dY.data(), T, out, qlayout::colwise_1x128, scale_mode::pow2, "dY");
  qtensor B = quantize(X.data(), T, in, qlayout::colwise_1x128, scale_mode::pow2, "X");
  std::vector<float> ref(out * in), fast(out * in);
  gemm_fp8_ref(A, B, ref.data());
  gemm_fp8(A, gemm_pack_fp8(B), fast.data());
  EXPECT_EQ(first_diff(fast, ref), -1);
  std::vector<double> want(out * in, 0.0);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t t = 0; t < T; ++t) want[o * in + i] += double(dY[t * out + o]) * X[t * in + i];
  EXPECT_LT(fp8rl::tol::calc_diff(fp8rl::test::to_double(ref), want), fp8rl::tol::kGemmFp8VsF64Diff);
}

namespace {
// Builds run with the AVX-512 quantizers (when present) and with the portable path.
template <class Fn>
void for_each_build_isa(Fn&& fn) {
  for (cpu_isa limit : {cpu_isa::amx, cpu_isa::portable}) {
    fp8rl::test::isa_limit_scope scope(limit);
    fn(limit);
  }
}

// The wide A's K padding [K, Kp) of every row is +-0 (the buffer is uninitialised memory): B's
// padding is 0 too, so any finite garbage there vanishes, but a NaN/Inf bit pattern left by an
// earlier user of the memory would turn its row of C into NaN.
void expect_zero_k_padding(const gemm_wide_a& A, const std::string& what) {
  for (int64_t m = 0; m < A.M; ++m)
    for (int64_t k = A.K; k < A.Kp; ++k)
      if (A.values[size_t(m * A.Kp + k)] != 0.0f) {
        ADD_FAILURE() << what << ": A '" << A.name << "' row " << m << " k " << k << " (K " << A.K << ", Kp " << A.Kp
                      << ") holds " << A.values[size_t(m * A.Kp + k)];
        return;
      }
}
}  // namespace

// The wide kernel's operands made straight from FP32 (rowwise A, columnwise A = dY^T, columnwise
// B = X^T) give the reference's bits on every kernel and ISA, in both scale modes and ragged
// shapes (the narrow kernels convert them), and equal quantize + pack array for array; a
// non-finite tile is quantize's error; A's K padding is zero.
TEST(Gemm, Fp8WideOperandsFromActivationsEqualTheReference) {
  uint64_t seed = 1400;
  for_each_build_isa([&](cpu_isa build) {
    const std::string b = " built " + std::string(cpu_isa_name(build));
    for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32})
      for (auto& s : kShapes) {
        const int64_t M = s[0], N = s[1], K = s[2];
        auto Af = randn(M * K, seed++, 2.0f), Bf = randn(N * K, seed++, 0.5f);
        for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) Af[k] = 0.0f;  // an all-zero tile
        const qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, mode, "B");
        std::vector<float> ref(M * N), fast(M * N, -1.0f);
        gemm_fp8_ref(quantize(Af.data(), M, K, qlayout::rowwise_1x128, mode, "A"), B, ref.data());
        const gemm_wide_a A = gemm_wide_a_fp8(Af.data(), M, K, mode, "A");
        expect_zero_k_padding(A, gemm_desc{M, N, K}.str() + b);
        const auto pb = gemm_pack_fp8(B);
        for (cpu_isa isa : kIsas)
          for (gemm_kernel k : kKernels) {
            if (!have(isa)) continue;
            gemm_fp8(A, pb, fast.data(), force(isa, k));
            ASSERT_EQ(first_diff(fast, ref), -1) << gemm_desc{M, N, K}.str() << " isa " << cpu_isa_name(isa) << " "
                                                 << kernel_name(k) << " mode " << int(mode) << b;
          }
      }
    for (auto [T, C] : {std::pair<int64_t, int64_t>{256, 64}, {300, 70}, {129, 33}, {5, 17}, {1024, 96}})
      for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {  // wgrad: dW = dY^T X
        auto dy = randn(T * C, seed++, 2.0f), x = randn(T * 40, seed++);
        for (int64_t t = 0; t < T; ++t) dy[t * C + 3] = 0.0f, x[t * 40 + 39] = 0.0f;  // all-zero columns
        const qtensor qa = quantize(dy.data(), T, C, qlayout::colwise_1x128, mode, "dy^T");
        const qtensor qb = quantize(x.data(), T, 40, qlayout::colwise_1x128, mode, "x^T");
        const auto want_b = gemm_pack_fp8(qb, {true, false, false});
        const auto got_b = gemm_pack_fp8_colwise_wide(x.data(), T, 40, mode, "x^T");
        const std::string what = "T " + std::to_string(T) + " C " + std::to_string(C) + " mode " + std::to_string(int(mode)) + b;
        ASSERT_EQ(got_b.wide.size(), want_b.wide.size()) << what;
        ASSERT_EQ(first_diff(std::vector<float>(got_b.wide.begin(), got_b.wide.end()),
                             std::vector<float>(want_b.wide.begin(), want_b.wide.end())), -1) << "x^T wide " << what;
        ASSERT_EQ(first_diff(std::vector<float>(got_b.scale_inv.begin(), got_b.scale_inv.end()),
                             std::vector<float>(want_b.scale_inv.begin(), want_b.scale_inv.end())), -1) << "x^T scales " << what;
        std::vector<float> ref(C * 40), fast(C * 40, -1.0f);
        gemm_fp8_ref(qa, qb, ref.data());
        const gemm_wide_a got_a = gemm_wide_a_fp8_colwise(dy.data(), T, C, mode, "dy^T");
        expect_zero_k_padding(got_a, what);
        gemm_fp8(got_a, got_b, fast.data());
        ASSERT_EQ(first_diff(fast, ref), -1) << "dW " << what;
      }
    const auto col = fp8rl::test::nonfinite_colwise(scale_mode::pow2, "x^T");
    EXPECT_FALSE(col.want.empty());
    EXPECT_EQ(nonfinite_text([&] { gemm_pack_fp8_colwise_wide(col.x.data(), 300, 40, scale_mode::pow2, "x^T"); }), col.want) << b;
    EXPECT_EQ(nonfinite_text([&] { gemm_wide_a_fp8_colwise(col.x.data(), 300, 40, scale_mode::pow2, "x^T"); }), col.want) << b;
    const auto row = fp8rl::test::nonfinite_rowwise(scale_mode::fp32, "h");
    EXPECT_FALSE(row.want.empty());
    EXPECT_EQ(nonfinite_text([&] { gemm_wide_a_fp8(row.x.data(), 40, 300, scale_mode::fp32, "h"); }), row.want) << b;
  });
}

// Integer inputs in [-8, 8] (K = 512, a ragged M and N): every sum is an integer, exact in FP32 in
// any order, so every path -- references, each ISA and kernel family -- gives the exact int64
// value. FP8 with pow2 scales: amax 8 -> scale_inv 2^-5, codes are the integers times 32 (exact
// in E4M3), block sums are integers below 128 * 256^2 = 2^23 (exact), and the promotion's
// scale product 2^-10 is exact. BF16 and FP32: sums below 512 * 64 = 2^15.
TEST(Gemm, ExactIntegerInputsGiveExactResultsOnEveryPath) {
  const int64_t M = 37, N = 70, K = 512;
  std::mt19937 g(4);
  std::vector<float> Af(M * K), Bf(N * K);
  for (auto& v : Af) v = float(int(g() % 17) - 8);
  for (auto& v : Bf) v = float(int(g() % 17) - 8);
  Af[0] = 8.0f; Bf[0] = 8.0f;  // make sure amax = 8 in the first block
  std::vector<double> exact(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t e = 0;
      for (int64_t k = 0; k < K; ++k) e += int64_t(Af[m * K + k]) * int64_t(Bf[n * K + k]);
      exact[m * N + n] = double(e);
    }
  auto check = [&](const std::vector<float>& c, const std::string& what) {
    for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(double(c[i]), exact[i]) << what << " at " << i / N << "," << i % N;
  };
  const gemm_desc d{M, N, K};
  std::vector<float> c(M * N);
  qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  gemm_fp8_ref(A, B, c.data());
  check(c, "fp8 reference");
  gemm_fp8_exact_ref(A, B, c.data());
  check(c, "fp8 exact reference (5.4)");
  const auto A16 = to_bf16(Af), B16 = to_bf16(Bf);
  gemm_bf16_ref(d, A16.data(), B16.data(), c.data());
  check(c, "bf16 reference");
  gemm_f32_ref(d, Af.data(), Bf.data(), c.data());
  check(c, "f32 reference");
  const auto p8 = gemm_pack_fp8(B), p16 = gemm_pack_bf16(B16.data(), N, K), p32 = gemm_pack_f32(Bf.data(), N, K);
  for (cpu_isa isa : kIsas) {
    if (!have(isa)) continue;
    for (gemm_kernel k : kKernels) {
      const std::string where = std::string(" isa ") + std::string(cpu_isa_name(isa)) + " " + kernel_name(k);
      std::fill(c.begin(), c.end(), -1.0f);
      gemm_fp8(A, p8, c.data(), force(isa, k));
      check(c, "fp8" + where);
      std::fill(c.begin(), c.end(), -1.0f);
      gemm_bf16(d, A16.data(), p16, c.data(), force(isa, k));
      check(c, "bf16" + where);
    }
    std::fill(c.begin(), c.end(), -1.0f);
    gemm_f32(d, Af.data(), p32, c.data(), {isa});
    check(c, "f32 isa " + std::string(cpu_isa_name(isa)));
  }
}

TEST(Gemm, ResultsDoNotDependOnThreadCountOrBatch) {
  const int64_t M = 64, N = 200, K = 640;
  auto Af = randn(M * K, 8), Bf = randn(N * K, 9);
  qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  auto pb = gemm_pack_fp8(quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B"));
  std::vector<float> c1(M * N), c2(M * N);
  tbb::task_arena(1).execute([&] { gemm_fp8(A, pb, c1.data()); });
  tbb::task_arena(2).execute([&] { gemm_fp8(A, pb, c2.data()); });
  EXPECT_EQ(first_diff(c1, c2), -1);
  // one row at a time (decode) equals the batched rows (prefill/training)
  for (int64_t m = 0; m < M; m += 13) {
    qtensor row = quantize(Af.data() + m * K, 1, K, qlayout::rowwise_1x128, scale_mode::pow2, "row");
    std::vector<float> c(N);
    gemm_fp8(row, pb, c.data());
    for (int64_t n = 0; n < N; ++n) ASSERT_EQ(float_bits(c[n]), float_bits(c1[m * N + n])) << m;
  }
}

// Decode-sized GEMVs of a group (one A, three B: N 300, 40, 72, partial last panels) give the
// reference's bits in arenas of 1, 3 and 5 threads (more than this machine's cores), called from
// inside another parallel loop, over short panels (K = 260: strided groups), BF16 panels over 128
// KiB (K = 2200) and FP8 ones (K = 4224: 132 KiB), at M = 1, 2 and 5 (one row tile).
TEST(Gemm, DecodeGroupsGiveTheReferenceBitsAtAnyThreadCount) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16: no narrow kernels";
  const int64_t Ns[] = {300, 40, 72};
  const gemm_config cfg = force(cpu_isa::avx512_bf16, gemm_kernel::narrow);
  for (int64_t K : {260, 2200, 4224})
    for (int64_t M : {1, 2, 5}) {
      const auto Af = randn(M * K, 70 + M);
      const qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
      const auto Ab = to_bf16(Af);
      std::vector<gemm_packed_b> p8, p16;
      std::vector<std::vector<float>> ref8(3), ref16(3);
      for (int i = 0; i < 3; ++i) {
        const auto Bf = randn(Ns[i] * K, 80 + i);
        const qtensor Bq = quantize(Bf.data(), Ns[i], K, qlayout::block_128x128, scale_mode::pow2, "B");
        const auto Bb = to_bf16(Bf);
        p8.push_back(gemm_pack_fp8(Bq, gemm_pack_forms{false, true, false}));
        p16.push_back(gemm_pack_bf16(Bb.data(), Ns[i], K, "B", gemm_pack_forms{false, true, false}));
        ref8[i].resize(M * Ns[i]), ref16[i].resize(M * Ns[i]);
        gemm_fp8_ref(A, Bq, ref8[i].data());
        gemm_bf16_ref({M, Ns[i], K}, Ab.data(), Bb.data(), ref16[i].data());
      }
      for (int threads : {1, 3, 5}) {
        std::vector<std::vector<float>> c8(6), c16(6);  // [call j][output i] at 3 * j + i
        tbb::task_arena(threads).execute([&] {
          tbb::parallel_for(0, 2, [&](int j) {
            std::vector<const gemm_packed_b*> B8, B16;
            std::vector<float*> C8, C16;
            for (int i = 0; i < 3; ++i) {
              c8[3 * j + i].assign(M * Ns[i], -1.0f), c16[3 * j + i].assign(M * Ns[i], -1.0f);
              B8.push_back(&p8[i]), B16.push_back(&p16[i]);
              C8.push_back(c8[3 * j + i].data()), C16.push_back(c16[3 * j + i].data());
            }
            gemm_fp8_group(A, B8, C8, cfg);
            gemm_bf16_group(Ab.data(), M, K, B16, C16, cfg);
          });
        });
        for (int j = 0; j < 2; ++j)
          for (int i = 0; i < 3; ++i) {
            const std::string what = "M=" + std::to_string(M) + " K=" + std::to_string(K) + " B" + std::to_string(i) +
                                     " threads " + std::to_string(threads) + " call " + std::to_string(j);
            ASSERT_EQ(first_diff(c8[3 * j + i], ref8[i]), -1) << "fp8 " << what;
            ASSERT_EQ(first_diff(c16[3 * j + i], ref16[i]), -1) << "bf16 " << what;
          }
      }
    }
}

// A group of B sharing A (q/k/v-like: one long, two short; N not a multiple of 32) gives each
// output the bits of its own call, for decode and batched-decode M, both batched-decode modes,
// the codes and the decoded forms, 1 and 2 threads, and where the forms would be read
// differently (one call per weight); a count mismatch is refused.
TEST(Gemm, GroupEqualsOneCallPerWeight) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16: a group is one call per weight";
  const int64_t K = 384, Ns[] = {160, 40, 40};
  std::vector<qtensor> Bq;
  std::vector<gemm_packed_b> codes, decoded, bf;
  for (int i = 0; i < 3; ++i) {
    auto Bf = randn(Ns[i] * K, 31 + i);
    Bq.push_back(quantize(Bf.data(), Ns[i], K, qlayout::block_128x128, scale_mode::pow2, "B" + std::to_string(i)));
    gemm_pack_forms narrow{false, true, false}, with_decoded = narrow;
    with_decoded.decoded = true;
    codes.push_back(gemm_pack_fp8(Bq.back(), narrow));
    decoded.push_back(gemm_pack_fp8(Bq.back(), with_decoded));
    bf.push_back(gemm_pack_bf16(to_bf16(Bf).data(), Ns[i], K, "B" + std::to_string(i), gemm_pack_forms{false, true, false}));
  }
  for (int threads : {1, 2})
    for (int64_t M : {1, 2, 16, 20})
      for (gemm_decode dec : kDecodes)
        for (bool use_decoded : {false, true}) {
          auto Af = randn(M * K, 40 + M);
          const qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
          const auto Ab = to_bf16(Af);
          const gemm_config cfg{cpu_isa::amx, 16, gemm_kernel::automatic, dec};
          const auto& packs = use_decoded ? decoded : codes;
          std::vector<std::vector<float>> one(3), grouped(3), one16(3), grouped16(3);
          std::vector<const gemm_packed_b*> Bs, Bb;
          std::vector<float*> Cs, Cb;
          for (int i = 0; i < 3; ++i) {
            one[i].assign(M * Ns[i], -1.0f), grouped[i].assign(M * Ns[i], -2.0f);
            one16[i].assign(M * Ns[i], -1.0f), grouped16[i].assign(M * Ns[i], -2.0f);
            Bs.push_back(&packs[i]), Cs.push_back(grouped[i].data());
            Bb.push_back(&bf[i]), Cb.push_back(grouped16[i].data());
          }
          tbb::task_arena(threads).execute([&] {
            for (int i = 0; i < 3; ++i) {
              gemm_fp8(A, packs[i], one[i].data(), cfg);
              gemm_bf16({M, Ns[i], K}, Ab.data(), bf[i], one16[i].data(), cfg);
            }
            gemm_fp8_group(A, Bs, Cs, cfg);
            gemm_bf16_group(Ab.data(), M, K, Bb, Cb, cfg);
          });
          for (int i = 0; i < 3; ++i) {
            ASSERT_EQ(first_diff(grouped[i], one[i]), -1) << "fp8 B" << i << " M=" << M << " decode " << int(dec)
                                                          << (use_decoded ? " decoded" : "") << " threads " << threads;
            ASSERT_EQ(first_diff(grouped16[i], one16[i]), -1) << "bf16 B" << i << " M=" << M << " threads " << threads;
          }
        }
  // forms read differently (M = 20: the decoded form where present) run one call per weight,
  // whichever comes first (one group read as its first weight's form: the codes-only weight
  // read as decoded crashed)
  for (int first_decoded = 0; first_decoded < 2; ++first_decoded) {
    const int64_t M = 20;
    auto Af = randn(M * K, 60);
    const qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
    std::vector<std::vector<float>> one(3), grouped(3);
    const gemm_packed_b* Bs[] = {first_decoded ? &decoded[0] : &codes[0], first_decoded ? &codes[1] : &decoded[1], &codes[2]};
    std::vector<float*> Cs;
    for (int i = 0; i < 3; ++i) {
      one[i].assign(M * Ns[i], -1.0f), grouped[i].assign(M * Ns[i], -2.0f);
      gemm_fp8(A, *Bs[i], one[i].data());
      Cs.push_back(grouped[i].data());
    }
    gemm_fp8_group(A, Bs, Cs);
    for (int i = 0; i < 3; ++i) ASSERT_EQ(first_diff(grouped[i], one[i]), -1) << "mixed forms, B" << i << " first decoded " << first_decoded;
  }
  const auto Af = randn(K, 50);
  const qtensor A = quantize(Af.data(), 1, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  std::vector<float> c(Ns[0]);
  const gemm_packed_b* one_b[] = {&codes[0]};
  float* two_c[] = {c.data(), c.data()};
  EXPECT_THROW(gemm_fp8_group(A, one_b, two_c), std::invalid_argument);
}

// The forms packed for this CPU's automatic dispatch (wide or narrow for large M, plus narrow
// for decode) serve every M, with the reference's bits.
TEST(Gemm, FormsForThisCpuServeEveryM) {
  const int64_t N = 96, K = 384;
  auto Bf = randn(N * K, 21);
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  for (bool small_m : {false, true}) {
    const gemm_pack_forms f = gemm_forms_for(small_m);
    EXPECT_TRUE(f.wide || f.narrow);  // a large-M form
    if (small_m && cpu_isa_active() >= cpu_isa::avx512_bf16) {
      EXPECT_TRUE(f.narrow);
    }
    auto pb = gemm_pack_fp8(B, f);
    for (int64_t M : {1, 5, 64}) {
      auto Af = randn(M * K, 22 + M);
      qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
      std::vector<float> ref(M * N), fast(M * N, -1.0f);
      gemm_fp8_ref(A, B, ref.data());
      gemm_fp8(A, pb, fast.data());
      ASSERT_EQ(first_diff(fast, ref), -1) << "M=" << M << " small_m " << small_m;
    }
  }
}

// Large M reads the decoded form (so a pack must keep it equal to its codes), small M the codes:
// a changed decoded word changes large-M results only.
TEST(Gemm, Fp8LargeMReadsTheDecodedFormSmallMTheCodes) {
  if (!have(cpu_isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16: no narrow kernel";
  const int64_t N = 64, K = 256;
  auto Bf = randn(N * K, 61);
  gemm_pack_forms forms{false, true, false};
  forms.decoded = true;
  gemm_packed_b pb = gemm_pack_fp8(quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B"), forms);
  ASSERT_EQ(pb.bf16.size(), size_t(N * K));
  const gemm_config cfg;  // automatic: M <= stream_max_m streams the codes
  for (int64_t M : {cfg.stream_max_m, cfg.stream_max_m + 1}) {
    auto Af = randn(M * K, 62 + M);
    qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
    std::vector<float> before(M * N), after(M * N);
    gemm_packed_b changed = pb;
    changed.bf16[0] ^= 0x0100;  // pair step 0, column 0: another BF16 value
    gemm_fp8(A, pb, before.data(), cfg);
    gemm_fp8(A, changed, after.data(), cfg);
    if (M > cfg.stream_max_m) EXPECT_NE(first_diff(after, before), -1) << "M=" << M << " must read the decoded form";
    else EXPECT_EQ(first_diff(after, before), -1) << "M=" << M << " must stream the codes";
  }
}

TEST(Gemm, BadOperandsAreErrors) {
  auto x = randn(128 * 256, 1);
  qtensor A = quantize(x.data(), 128, 256, qlayout::block_128x128, scale_mode::pow2, "A2d");
  qtensor B = quantize(x.data(), 256, 128, qlayout::block_128x128, scale_mode::pow2, "Bk");
  std::vector<float> C(128 * 256);
  EXPECT_THROW(gemm_fp8_ref(A, A, C.data()), std::invalid_argument);  // 2Dx2D
  qtensor Ar = quantize(x.data(), 128, 256, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  EXPECT_THROW(gemm_fp8(Ar, gemm_pack_fp8(B), C.data()), std::invalid_argument);  // K mismatch
  qtensor Af = quantize(x.data(), 128, 256, qlayout::rowwise_1x128, scale_mode::fp32, "Afp32");
  qtensor Bw = quantize(x.data(), 128, 256, qlayout::block_128x128, scale_mode::pow2, "W");
  EXPECT_THROW(gemm_fp8(Af, gemm_pack_fp8(Bw), C.data()), std::invalid_argument);  // modes differ
  const auto Awide = gemm_wide_a_fp8(x.data(), 128, 256, scale_mode::fp32, "Awide");
  EXPECT_THROW(gemm_fp8(Awide, gemm_pack_fp8(Bw), C.data()), std::invalid_argument);  // modes differ (wide A)
  EXPECT_THROW(gemm_desc({-1, 2, 3}).check(), std::invalid_argument);
}

namespace {
bool aligned_to(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Whether the mapping holding p carries MADV_HUGEPAGE ("hg" in /proc/self/smaps' VmFlags).
bool advised_huge(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto a = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) inside = a >= lo && a < hi;
    else if (inside && line.rfind("VmFlags:", 0) == 0) return line.find(" hg") != std::string::npos;
  }
  return false;
}
}  // namespace

// On request (generation's packed weights) large buffers get their own 2 MiB-aligned mappings
// advised onto transparent huge pages; the policy travels with copies, assignment, swap and
// rebinding, and growth keeps the contents. Default buffers stay 64-byte aligned heap memory.
TEST(AlignedBuffers, HugePagePolicyAlignsAdvisesAndTravels) {
  const size_t big = fp8rl::kHugeAllocMin + 12345;
  fp8rl::avector<uint8_t> plain(big, 1);
  EXPECT_FALSE(plain.get_allocator().huge);
  EXPECT_TRUE(aligned_to(plain.data(), 64));
  fp8rl::avector<uint8_t> a{fp8rl::aligned_allocator<uint8_t>(true)};
  a.resize(big);
  for (size_t i = 0; i < big; ++i) a[i] = static_cast<uint8_t>(i * 7);
  EXPECT_TRUE(aligned_to(a.data(), fp8rl::kHugePage));
  if (std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {  // a kernel with THP takes the advice
    EXPECT_TRUE(advised_huge(a.data()));
    EXPECT_FALSE(advised_huge(plain.data()));
  }
  fp8rl::avector<uint8_t> b = a;  // copy construction
  EXPECT_TRUE(b.get_allocator().huge);
  b.resize(2 * big, 1);  // growth: a larger huge buffer with the contents
  EXPECT_TRUE(aligned_to(b.data(), fp8rl::kHugePage));
  for (size_t i = 0; i < big; ++i) ASSERT_EQ(b[i], static_cast<uint8_t>(i * 7)) << "byte " << i;
  EXPECT_EQ(b[2 * big - 1], 1);
  fp8rl::avector<uint8_t> c(10, 2);
  c = a;  // copy assignment takes the policy
  EXPECT_TRUE(c.get_allocator().huge);
  EXPECT_TRUE(aligned_to(c.data(), fp8rl::kHugePage));
  EXPECT_EQ(c[big - 1], static_cast<uint8_t>((big - 1) * 7));
  c.swap(plain);  // swap exchanges the policies with the buffers
  EXPECT_FALSE(c.get_allocator().huge);
  EXPECT_TRUE(plain.get_allocator().huge);
  EXPECT_EQ(c[0], 1);
  const fp8rl::aligned_uninit_allocator<float> rebound(fp8rl::aligned_uninit_allocator<uint8_t>(true));
  EXPECT_TRUE(rebound.huge);
  fp8rl::avector_uninit<float> f{rebound};
  f.resize(10);  // small: heap, 64-byte aligned; past the threshold: huge
  EXPECT_TRUE(aligned_to(f.data(), 64));
  f.resize(fp8rl::kHugeAllocMin / 4);
  EXPECT_TRUE(aligned_to(f.data(), fp8rl::kHugePage));
}

// A pack on huge pages (the decode form the DRAM GEMV streams) gives the reference's bits.
TEST(Gemm, PackOnHugePagesEqualsTheReference) {
  const int64_t M = 3, N = 2048, K = 2048;  // 4 MiB of codes
  auto a = randn(size_t(M * K), 1), b = randn(size_t(N * K), 2);
  const qtensor qa = quantize(a.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  const qtensor qb = quantize(b.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  gemm_pack_forms forms = gemm_forms_for(true);
  forms.huge_pages = true;
  const gemm_packed_b pb = gemm_pack_fp8(qb, forms);
  if (!pb.fp8.empty()) {  // the forms this CPU builds
    EXPECT_TRUE(pb.fp8.get_allocator().huge);
    EXPECT_TRUE(aligned_to(pb.fp8.data(), fp8rl::kHugePage));
  }
  if (!pb.wide.empty()) {
    EXPECT_TRUE(aligned_to(pb.wide.data(), fp8rl::kHugePage));
  }
  std::vector<float> ref(size_t(M * N)), got(ref.size());
  gemm_fp8_ref(qa, qb, ref.data());
  gemm_fp8(qa, pb, got.data());
  EXPECT_EQ(got, ref);
}
