// tests/quant/gemm_tiles_test.cpp -- the AMX tile GEMMs (not bit-exact by design, quant/gemm.hpp):
// every element within the FP32 accumulation bound of the exact sum of the same products,
// exact-integer inputs exact, rows independent of the batch, clear errors. Skipped without AMX.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "quant/fp8.hpp"
#include "quant/gemm.hpp"
#include "tests/quant/nonfinite_cases.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::quant;
using fp8rl::test::first_diff;
using fp8rl::test::nonfinite_text;
using fp8rl::test::randn;

namespace {
const int64_t kShapes[][3] = {{1, 32, 128}, {3, 33, 129}, {17, 100, 127}, {33, 64, 256}, {70, 257, 300},
                              {130, 96, 384}, {5, 31, 1}, {64, 64, 1024}};

#define SKIP_WITHOUT_AMX() \
  if (!gemm_tiles_available()) GTEST_SKIP() << "no AMX-BF16 here (active ISA " << cpu_isa_name(cpu_isa_active()) << ")"

// Operand values (what the products are made of) for element (row, k).
std::vector<double> values_of(const qtensor& q) {
  const int64_t R = q.op_rows(), K = q.op_cols();
  std::vector<double> v(static_cast<size_t>(R * K));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) v[r * K + k] = double(e4m3_table()[q.data[r * K + k]]) * q.scale_at(r, k / kBlock);
  return v;
}
std::vector<double> values_of(const std::vector<uint16_t>& b) {
  std::vector<double> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_float(b[i]);
  return v;
}

// Every C[m][n] within gemm_tiles_bound(K) * sum|a b| of the exact (FP64) sum.
void expect_within_bound(const std::vector<float>& C, const std::vector<double>& A, const std::vector<double>& B,
                         int64_t M, int64_t N, int64_t K, const std::string& what) {
  const double g = fp8rl::tol::gemm_tiles_bound(K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, abs = 0;
      for (int64_t k = 0; k < K; ++k) {
        s += A[m * K + k] * B[n * K + k];
        abs += std::fabs(A[m * K + k] * B[n * K + k]);
      }
      ASSERT_LE(std::fabs(C[m * N + n] - s), g * abs) << what << " at " << m << "," << n;
    }
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_from_float(x[i]);
  return b;
}
// got's tile form and scales equal want's, element for element.
void expect_same_tile_form(const gemm_packed_b& got, const gemm_packed_b& want, const std::string& what) {
  ASSERT_EQ(got.N, want.N) << what;
  ASSERT_EQ(got.Kt, want.Kt) << what;
  ASSERT_EQ(got.Kp, want.Kp) << what;
  ASSERT_EQ(got.tiles.size(), want.tiles.size()) << what;
  for (size_t i = 0; i < want.tiles.size(); ++i) ASSERT_EQ(got.tiles[i], want.tiles[i]) << what << " tile word " << i;
  ASSERT_EQ(got.scale_inv.size(), want.scale_inv.size()) << what;
  for (size_t i = 0; i < want.scale_inv.size(); ++i) ASSERT_EQ(got.scale_inv[i], want.scale_inv[i]) << what << " scale " << i;
}

}  // namespace

TEST(GemmTiles, Bf16WithinAccumulationBound) {
  SKIP_WITHOUT_AMX();
  uint64_t seed = 500;
  for (auto& s : kShapes) {
    const gemm_desc d{s[0], s[1], s[2]};
    auto A = to_bf16(randn(d.M * d.K, seed++)), B = to_bf16(randn(d.N * d.K, seed++));
    std::vector<float> C(d.M * d.N, -1.0f);
    gemm_bf16_tiles(d, A.data(), gemm_pack_bf16(B.data(), d.N, d.K, "B", {false, false, true}), C.data());
    expect_within_bound(C, values_of(A), values_of(B), d.M, d.N, d.K, d.str());
  }
}

TEST(GemmTiles, Fp8WithinAccumulationBoundBothScaleModes) {
  SKIP_WITHOUT_AMX();
  uint64_t seed = 600;
  for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32})
    for (qlayout bl : {qlayout::block_128x128, qlayout::rowwise_1x128})
      for (auto& s : kShapes) {
        const int64_t M = s[0], N = s[1], K = s[2];
        qtensor A = quantize(randn(M * K, seed++, 2.0f).data(), M, K, qlayout::rowwise_1x128, mode, "A");
        qtensor B = quantize(randn(N * K, seed++, 0.5f).data(), N, K, bl, mode, "B");
        std::vector<float> C(M * N, -1.0f);
        gemm_fp8_tiles(A, gemm_pack_fp8(B, {false, false, true}), C.data());
        expect_within_bound(C, values_of(A), values_of(B), M, N, K,
                            "fp8 mode " + std::string(scale_mode_name(mode)) + " " + gemm_desc{M, N, K}.str());
      }
}

// Integer inputs: every partial sum is an integer far below 2^24, exact in FP32 in any order.
TEST(GemmTiles, ExactIntegerInputsGiveExactResults) {
  SKIP_WITHOUT_AMX();
  const int64_t M = 37, N = 70, K = 512;
  std::mt19937 g(4);
  std::vector<float> Af(M * K), Bf(N * K);
  for (auto& v : Af) v = float(int(g() % 17) - 8);
  for (auto& v : Bf) v = float(int(g() % 17) - 8);
  Af[0] = Bf[0] = 8.0f;
  auto A16 = to_bf16(Af), B16 = to_bf16(Bf);
  std::vector<float> c16(M * N), c8(M * N);
  gemm_bf16_tiles({M, N, K}, A16.data(), gemm_pack_bf16(B16.data(), N, K, "B", {false, false, true}), c16.data());
  qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  qtensor B = quantize(Bf.data(), N, K, qlayout::block_128x128, scale_mode::pow2, "B");
  gemm_fp8_tiles(A, gemm_pack_fp8(B, {false, false, true}), c8.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t exact = 0;
      for (int64_t k = 0; k < K; ++k) exact += int64_t(Af[m * K + k]) * int64_t(Bf[n * K + k]);
      ASSERT_EQ(double(c16[m * N + n]), double(exact)) << "bf16 " << m << "," << n;
      ASSERT_EQ(double(c8[m * N + n]), double(exact)) << "fp8 " << m << "," << n;
    }
}

// Rows never mix in a tile product: a row computed alone equals the same row in a batch.
TEST(GemmTiles, RowsDoNotDependOnTheBatch) {
  SKIP_WITHOUT_AMX();
  const int64_t M = 70, N = 200, K = 640;
  auto Af = randn(M * K, 8), Bf = randn(N * K, 9);
  for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {
    qtensor A = quantize(Af.data(), M, K, qlayout::rowwise_1x128, mode, "A");
    auto pb = gemm_pack_fp8(quantize(Bf.data(), N, K, qlayout::block_128x128, mode, "B"), {false, false, true});
    std::vector<float> all(M * N);
    gemm_fp8_tiles(A, pb, all.data());
    for (int64_t m = 0; m < M; m += 13) {
      qtensor row = quantize(Af.data() + m * K, 1, K, qlayout::rowwise_1x128, mode, "row");
      std::vector<float> c(N), want(all.begin() + m * N, all.begin() + (m + 1) * N);
      gemm_fp8_tiles(row, pb, c.data());
      ASSERT_EQ(first_diff(c, want), -1) << "row " << m;
    }
  }
}

// accumulate = true adds the overwriting call's result into C: bit-identical to C0 + result.
TEST(GemmTiles, AccumulateAddsTheOverwriteResult) {
  SKIP_WITHOUT_AMX();
  uint64_t seed = 900;
  for (auto& s : kShapes) {
    const int64_t M = s[0], N = s[1], K = s[2];
    const auto c0 = randn(M * N, seed++);
    auto check = [&](const std::vector<float>& over, const std::vector<float>& acc, const std::string& what) {
      std::vector<float> want(M * N);
      for (int64_t i = 0; i < M * N; ++i) want[i] = c0[i] + over[i];
      EXPECT_EQ(first_diff(acc, want), -1) << what << " " << gemm_desc{M, N, K}.str();
    };
    for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {
      qtensor A = quantize(randn(M * K, seed++, 2.0f).data(), M, K, qlayout::rowwise_1x128, mode, "A");
      const auto B = gemm_pack_fp8(quantize(randn(N * K, seed++).data(), N, K, qlayout::block_128x128, mode, "B"),
                                   {false, false, true});
      std::vector<float> over(M * N), acc = c0;
      gemm_fp8_tiles(A, B, over.data());
      gemm_fp8_tiles(A, B, acc.data(), true);
      check(over, acc, "fp8 " + std::string(scale_mode_name(mode)));
    }
    std::vector<uint16_t> a(M * K), b(N * K);
    const auto af = randn(M * K, seed++), bf = randn(N * K, seed++);
    for (int64_t i = 0; i < M * K; ++i) a[i] = bf16_from_float(af[i]);
    for (int64_t i = 0; i < N * K; ++i) b[i] = bf16_from_float(bf[i]);
    const auto B = gemm_pack_bf16(b.data(), N, K, "B", {false, false, true});
    std::vector<float> over(M * N), acc = c0;
    gemm_bf16_tiles({M, N, K}, a.data(), B, over.data());
    gemm_bf16_tiles({M, N, K}, a.data(), B, acc.data(), true);
    check(over, acc, "bf16");
  }
}

// wgrad's X^T packed straight from activations equals quantize-colwise-then-pack, array for
// array (both scale modes, ragged tokens and columns), and a non-finite tile is the same error.
TEST(GemmTiles, ColwisePackFromActivationsEqualsQuantizeThenPack) {
  SKIP_WITHOUT_AMX();
  uint64_t seed = 950;
  for (auto [T, C] : {std::pair<int64_t, int64_t>{256, 64}, {300, 70}, {129, 33}, {5, 17}, {1024, 128}})
    for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {
      auto x = randn(T * C, seed++, 3.0f);
      for (int64_t c = 0; c < C; c += 7) x[(c % T) * C + c] = 0.0f;  // zeros (and an all-zero column)
      for (int64_t t = 0; t < T; ++t) x[t * C + C - 1] = 0.0f;
      const auto want = gemm_pack_fp8(quantize(x.data(), T, C, qlayout::colwise_1x128, mode, "x^T"), {false, false, true});
      const auto got = gemm_pack_fp8_colwise_tiles(x.data(), T, C, mode, "x^T");
      expect_same_tile_form(got, want, std::to_string(T) + "x" + std::to_string(C) + " " + std::string(scale_mode_name(mode)));
    }
  const auto bad = fp8rl::test::nonfinite_colwise(scale_mode::pow2, "x^T");
  EXPECT_FALSE(bad.want.empty());
  EXPECT_EQ(nonfinite_text([&] { gemm_pack_fp8_colwise_tiles(bad.x.data(), 300, 40, scale_mode::pow2, "x^T"); }), bad.want);
}

// A prepared straight from activations (rowwise tiles in tile order) gives the same C as
// quantize-then-GEMM, bit for bit, in both scale modes and with accumulate; reused for a second
// B; a non-finite tile is the same error.
TEST(GemmTiles, PreparedAFromActivationsEqualsQuantizeThenGemm) {
  SKIP_WITHOUT_AMX();
  uint64_t seed = 1000;
  for (auto& s : kShapes) {
    const int64_t M = s[0], N = s[1], K = s[2];
    for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {
      auto x = randn(M * K, seed++, 2.0f);
      for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) x[k] = 0.0f;  // an all-zero tile
      const qtensor q = quantize(x.data(), M, K, qlayout::rowwise_1x128, mode, "x");
      const gemm_tiles_a a = gemm_tiles_a_fp8(x.data(), M, K, mode, "x");
      for (int b = 0; b < 2; ++b) {
        const auto B = gemm_pack_fp8(quantize(randn(N * K, seed++).data(), N, K, qlayout::block_128x128, mode, "B"),
                                     {false, false, true});
        std::vector<float> want(M * N), got(M * N), want_acc(M * N, 0.25f), got_acc(M * N, 0.25f);
        gemm_fp8_tiles(q, B, want.data());
        gemm_fp8_tiles(a, B, got.data());
        gemm_fp8_tiles(q, B, want_acc.data(), true);
        gemm_fp8_tiles(a, B, got_acc.data(), true);
        EXPECT_EQ(first_diff(got, want), -1) << scale_mode_name(mode) << " " << gemm_desc{M, N, K}.str();
        EXPECT_EQ(first_diff(got_acc, want_acc), -1) << "accumulate " << gemm_desc{M, N, K}.str();
      }
    }
  }
  for (auto [T, C] : {std::pair<int64_t, int64_t>{256, 64}, {300, 70}, {129, 33}, {5, 17}})
    for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {  // wgrad's dY^T: columnwise
      auto x = randn(T * C, seed++, 2.0f);
      for (int64_t t = 0; t < T; ++t) x[t * C + 3] = 0.0f;  // an all-zero column
      const qtensor q = quantize(x.data(), T, C, qlayout::colwise_1x128, mode, "dy^T");
      const gemm_tiles_a a = gemm_tiles_a_fp8_colwise(x.data(), T, C, mode, "dy^T");
      const int64_t N = 45;
      const auto B = gemm_pack_fp8(quantize(randn(N * T, seed++).data(), N, T, qlayout::block_128x128, mode, "x^T"),
                                   {false, false, true});
      std::vector<float> want(C * N), got(C * N);
      gemm_fp8_tiles(q, B, want.data());
      gemm_fp8_tiles(a, B, got.data());
      EXPECT_EQ(first_diff(got, want), -1) << "colwise " << scale_mode_name(mode) << " T " << T << " C " << C;
    }
  const auto col = fp8rl::test::nonfinite_colwise(scale_mode::pow2, "dy^T");
  EXPECT_FALSE(col.want.empty());
  EXPECT_EQ(nonfinite_text([&] { gemm_tiles_a_fp8_colwise(col.x.data(), 300, 40, scale_mode::pow2, "dy^T"); }), col.want);
  const auto row = fp8rl::test::nonfinite_rowwise(scale_mode::fp32, "h");
  EXPECT_FALSE(row.want.empty());
  EXPECT_EQ(nonfinite_text([&] { gemm_tiles_a_fp8(row.x.data(), 40, 300, scale_mode::fp32, "h"); }), row.want);
}

// Weights packed straight into both tile forms equal quantize -> pack and quantize -> transpose
// -> pack, array for array, in both scale modes and ragged shapes; a non-finite block is the
// same error.
TEST(GemmTiles, WeightBlocksPackedStraightEqualQuantizeThenPack) {
  SKIP_WITHOUT_AMX();
  uint64_t seed = 1100;
  for (auto [N, K] : {std::pair<int64_t, int64_t>{256, 128}, {300, 130}, {64, 512}, {33, 17}, {129, 257}})
    for (scale_mode mode : {scale_mode::pow2, scale_mode::fp32}) {
      auto w = randn(N * K, seed++, 0.05f);
      for (int64_t r = 0; r < std::min<int64_t>(N, 128); ++r)
        for (int64_t c = 0; c < std::min<int64_t>(K, 128); ++c) w[r * K + c] = 0.0f;  // an all-zero block
      const qtensor q = quantize(w.data(), N, K, qlayout::block_128x128, mode, "w");
      const auto want_f = gemm_pack_fp8(q, {false, false, true});
      const auto want_b = gemm_pack_fp8(qtensor_transpose_blocks(q), {false, false, true});
      gemm_packed_b f, b;
      gemm_pack_fp8_blocks_tiles(w.data(), N, K, mode, "w", &f, &b);
      const std::string what = std::to_string(N) + "x" + std::to_string(K) + " " + std::string(scale_mode_name(mode));
      expect_same_tile_form(f, want_f, what + " fwd");
      expect_same_tile_form(b, want_b, what + " bwd");
      EXPECT_EQ(b.name, want_b.name);
    }
  std::vector<float> w(300 * 300, 0.01f);
  w[290 * 300 + 10] = std::numeric_limits<float>::quiet_NaN();  // block (2, 0)
  w[140 * 300 + 200] = std::numeric_limits<float>::infinity();  // block (1, 1)
  const std::string want = nonfinite_text([&] { quantize(w.data(), 300, 300, qlayout::block_128x128, scale_mode::pow2, "w"); });
  EXPECT_FALSE(want.empty());
  gemm_packed_b f;
  EXPECT_EQ(nonfinite_text([&] { gemm_pack_fp8_blocks_tiles(w.data(), 300, 300, scale_mode::pow2, "w", &f, nullptr); }), want);
}

TEST(GemmTiles, MissingTileFormIsAnError) {
  SKIP_WITHOUT_AMX();
  auto x = randn(128 * 256, 1);
  qtensor A = quantize(x.data(), 128, 256, qlayout::rowwise_1x128, scale_mode::pow2, "A");
  auto pb = gemm_pack_fp8(quantize(x.data(), 128, 256, qlayout::block_128x128, scale_mode::pow2, "W.q"));
  std::vector<float> C(128 * 128);
  try {
    gemm_fp8_tiles(A, pb, C.data());
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("W.q"), std::string::npos) << e.what();
  }
}
