// tests/quant/gemm_exact_ref_test.cpp -- fp8-numerics.md §5.4, the order-independent exact FP8
// GEMM model (gemm_fp8_exact_ref): per 128-K block the exactly rounded sum of the products, then
// §5.2's promotion. Checked against FP64 bit for bit where FP64 can predict every bit (one block),
// for independence of the products' order (which §5.2 lacks, measured here), and on NaN codes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "quant/fp8.hpp"
#include "quant/gemm.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::quant;
using fp8rl::test::first_diff;
using fp8rl::test::randn;

namespace {
// Wide dynamic range inside a block: normal data times 2^[-12, 12], so products span ~2^48 and
// FP32 sums of them round often (sequential §5.2 sums then differ from the exact rounding).
std::vector<float> wide_range(size_t n, uint64_t seed) {
  auto v = randn(n, seed);
  std::mt19937_64 g(seed + 1);
  for (auto& x : v) x = std::ldexp(x, int(g() % 25) - 12);
  return v;
}

// One operand element's value including its scale, in FP64 (exact: E4M3 value times a float).
double value(const qtensor& X, int64_t r, int64_t k) {
  return double(e4m3_table()[X.data[r * X.op_cols() + k]]);
}
}  // namespace

// With K <= 128 there is one block: out = fma(s, acc, 0) = RN(s * RN(exact sum)). FP64 holds the
// exact sum (< 2^43 units of 2^-18) and the product s * acc (24 + 24 bits) exactly, so a double ->
// float conversion after each gives every bit, independently of the int64 code under test.
TEST(GemmExactRef, OneBlockIsTheRoundedExactSum) {
  uint64_t seed = 10;
  for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32})
    for (qlayout bl : {qlayout::block_128x128, qlayout::rowwise_1x128})
      for (int64_t K : {128, 100, 1}) {
        const int64_t M = 5, N = 40;
        auto Af = wide_range(M * K, seed++), Bf = wide_range(N * K, seed++);
        qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, mode, "A");
        qtensor B = quantize(Bf.data(), N, K, bl, mode, "B");
        std::vector<float> got(M * N), want(M * N);
        gemm_fp8_exact_ref(A, B, got.data());
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double sum = 0;
            for (int64_t k = 0; k < K; ++k) sum += value(A, m, k) * value(B, n, k);
            const float acc = float(sum), s = A.scale_at(m, 0) * B.scale_at(n, 0);
            want[m * N + n] = float(double(s) * double(acc));
          }
        ASSERT_EQ(first_diff(got, want), -1) << "K=" << K << " mode " << int(mode) << " B layout " << int(bl);
      }
}

// Permuting the products inside each block (the same permutation of A's and B's columns) leaves
// every bit of §5.4 unchanged; §5.2's sequential FP32 sums change in many elements (so this data
// does exercise rounding, and the comparison could fail).
TEST(GemmExactRef, ProductOrderDoesNotMatter) {
  const int64_t M = 8, N = 64, K = 384;
  auto Af = wide_range(M * K, 50), Bf = wide_range(N * K, 51);
  qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  qtensor B = quantize(Bf.data(), N, K, qlayout::rowwise_1x128, scale_mode::pow2, "B");
  std::vector<int64_t> perm(K);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 g(7);
  for (int64_t kb = 0; kb < K; kb += kBlock) std::shuffle(perm.begin() + kb, perm.begin() + kb + kBlock, g);
  qtensor Ap = A, Bp = B;  // scales stay: the permutation keeps every element in its block
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k) Ap.data[r * K + k] = A.data[r * K + perm[k]];
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) Bp.data[r * K + k] = B.data[r * K + perm[k]];
  std::vector<float> e(M * N), ep(M * N), s(M * N), sp(M * N);
  gemm_fp8_exact_ref(A, B, e.data());
  gemm_fp8_exact_ref(Ap, Bp, ep.data());
  EXPECT_EQ(first_diff(e, ep), -1);
  gemm_fp8_ref(A, B, s.data());
  gemm_fp8_ref(Ap, Bp, sp.data());
  int changed = 0;
  for (int64_t i = 0; i < M * N; ++i) changed += std::memcmp(&s[i], &sp[i], 4) != 0;
  EXPECT_GT(changed, M * N / 4) << "the sequential model should be order-dependent on this data";
}

// Both models against FP64 on several ragged blocks: within the bound of any FP32 summation order
// (tests/tolerances.hpp gemm_tiles_bound); the exact model, which rounds once per block, lies
// closer to FP64 than the sequential one in the normwise sense.
TEST(GemmExactRef, CloserToFp64ThanTheSequentialModel) {
  const int64_t M = 6, N = 50, K = 700;
  auto Af = wide_range(M * K, 80), Bf = wide_range(N * K, 81);
  qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::fp32, "A");
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::fp32, "B");
  std::vector<float> e(M * N), s(M * N);
  gemm_fp8_exact_ref(A, B, e.data());
  gemm_fp8_ref(A, B, s.data());
  std::vector<double> f64(M * N);
  const double g = fp8rl::tol::gemm_tiles_bound(K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = value(A, m, k) * A.scale_at(m, k / kBlock) * value(B, n, k) * B.scale_at(n, k / kBlock);
        sum += p;
        mag += std::fabs(p);
      }
      f64[m * N + n] = sum;
      EXPECT_LE(std::fabs(e[m * N + n] - sum), g * mag) << m << "," << n;
      EXPECT_LE(std::fabs(s[m * N + n] - sum), g * mag) << m << "," << n;
    }
  const auto de = fp8rl::test::to_double(e), ds = fp8rl::test::to_double(s);
  EXPECT_LT(fp8rl::tol::rel_norm_err(de, f64), fp8rl::tol::rel_norm_err(ds, f64));
}

// A NaN code (never produced by quant/'s encoders, but a qtensor is a plain value) makes its
// output element NaN, as in the sequential model; malformed operands are the same errors.
TEST(GemmExactRef, NanCodesAndBadOperands) {
  const int64_t M = 2, N = 3, K = 256;
  auto Af = randn(M * K, 90), Bf = randn(N * K, 91);
  qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  A.data[1 * K + 200] = 0xFF;  // row 1, second block
  std::vector<float> e(M * N), s(M * N);
  gemm_fp8_exact_ref(A, B, e.data());
  gemm_fp8_ref(A, B, s.data());
  for (int64_t i = 0; i < M * N; ++i) EXPECT_EQ(std::isnan(e[i]), i / N == 1) << i;
  for (int64_t i = 0; i < M * N; ++i) EXPECT_EQ(std::isnan(e[i]), std::isnan(s[i])) << i;
  A.data[1 * K + 200] = 0x10;  // finite again; now B's row 2 (output column 2) holds 0x7F
  B.data[2 * K + 7] = 0x7F;
  gemm_fp8_exact_ref(A, B, e.data());
  for (int64_t i = 0; i < M * N; ++i) EXPECT_EQ(std::isnan(e[i]), i % N == 2) << i;
  EXPECT_THROW(gemm_fp8_exact_ref(B, A, e.data()), std::invalid_argument);  // 128x128 blocks as A
  qtensor Ak = quantize(Af.data(), M * 2, K / 2, qlayout::rowwise_1x128, scale_mode::pow2, "Ak");
  EXPECT_THROW(gemm_fp8_exact_ref(Ak, B, e.data()), std::invalid_argument);  // K mismatch
}

// The sequential references follow §5.2's order, pinned by a case worked out by hand (the fast
// paths are checked against the references bit for bit in gemm_test, so this pins them too):
// products p0..p3 = 2^-8, 2^16, 2^-8, -2^16 (values 2^-4 and 2^8, exact in E4M3 at scale 1 and
// in BF16). Odd element first: 2^16, + 2^-8 ties to 2^16 (half an ulp of 2^16 is 2^-8), - 2^16
// = 0, + 2^-8 = 2^-8. Even first would give 0; the exact sum (§5.4) is 2^-7.
TEST(GemmExactRef, SequentialReferencesSumOddElementFirst) {
  const float a[4] = {0.0625f, 256.0f, 0.0625f, -256.0f}, b[4] = {0.0625f, 256.0f, 0.0625f, 256.0f};
  qtensor A = quantize(a, 1, 4, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  qtensor B = quantize(b, 1, 4, qlayout::block_128x128, scale_mode::pow2, "B");
  ASSERT_EQ(A.scale_at(0, 0), 1.0f);  // amax 256 lies in (224, 448]: scale 2^0, every value exact
  ASSERT_EQ(B.scale_at(0, 0), 1.0f);
  float seq = -1, exact = -1, bf = -1;
  gemm_fp8_ref(A, B, &seq);
  gemm_fp8_exact_ref(A, B, &exact);
  EXPECT_EQ(seq, std::ldexp(1.0f, -8));
  EXPECT_EQ(exact, std::ldexp(1.0f, -7));
  uint16_t a16[4], b16[4];
  for (int i = 0; i < 4; ++i) a16[i] = bf16_from_float(a[i]), b16[i] = bf16_from_float(b[i]);
  gemm_bf16_ref({1, 1, 4}, a16, b16, &bf);
  EXPECT_EQ(bf, std::ldexp(1.0f, -8));
}
