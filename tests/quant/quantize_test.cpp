// tests/quant/quantize_test.cpp -- blockwise quantization: fast == reference bytes and scales,
// round-trip error bounds per mode, the pow2 formula, zero blocks, ragged shapes, NaN/Inf.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>

#include "quant/bundle.hpp"
#include "quant/cpu_isa.hpp"
#include "quant/fp8.hpp"
#include "quant/qtensor.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::quant;

namespace {
const qlayout kLayouts[] = {qlayout::rowwise_1x128, qlayout::colwise_1x128, qlayout::block_128x128};
const scale_mode kModes[] = {scale_mode::pow2, scale_mode::fp32};

void expect_same(const qtensor& a, const qtensor& b, const char* what) {
  ASSERT_EQ(a.data.size(), b.data.size()) << what;
  ASSERT_EQ(a.scale_inv.size(), b.scale_inv.size()) << what;
  for (size_t i = 0; i < a.data.size(); ++i) ASSERT_EQ(a.data[i], b.data[i]) << what << " byte " << i;
  for (size_t i = 0; i < a.scale_inv.size(); ++i)
    ASSERT_EQ(float_bits(a.scale_inv[i]), float_bits(b.scale_inv[i])) << what << " scale " << i;
}
}  // namespace

TEST(Quantize, FastEqualsReferenceOnRaggedShapes) {
  const int64_t shapes[][2] = {{1, 1}, {3, 127}, {5, 128}, {7, 129}, {128, 128}, {130, 300}, {257, 255}, {64, 1000}};
  uint64_t seed = 1;
  for (auto& s : shapes)
    for (qlayout l : kLayouts)
      for (scale_mode m : kModes) {
        auto x = fp8rl::test::randn(size_t(s[0] * s[1]), seed++, 3.0f);
        qtensor ref = quantize_ref(x.data(), s[0], s[1], l, m, "x");
        qtensor fast = quantize(x.data(), s[0], s[1], l, m, "x");
        expect_same(fast, ref, "fast vs ref");
        // each tile's and block's amax at its last column and row, full and ragged (random data
        // rarely puts it there: a fast amax skipping a block's last column went unseen)
        for (int64_t r = 0; r < s[0]; ++r)
          for (int64_t c = 0; c < s[1]; ++c) {
            const bool last_r = r % kBlock == kBlock - 1 || r == s[0] - 1, last_c = c % kBlock == kBlock - 1 || c == s[1] - 1;
            if (last_r || last_c) x[size_t(r * s[1] + c)] = last_r && last_c ? 40.0f : last_r ? 35.0f : 30.0f;
          }
        expect_same(quantize(x.data(), s[0], s[1], l, m, "x"), quantize_ref(x.data(), s[0], s[1], l, m, "x"), "edge amax");
      }
}

TEST(Quantize, RoundTripErrorBoundsPerMode) {
  for (qlayout l : kLayouts)
    for (scale_mode m : kModes) {
      auto x = fp8rl::test::randn(300 * 260, 11, 0.05f, 0.02f, 100.0f);
      qtensor q = quantize(x.data(), 300, 260, l, m, "x");
      std::vector<float> y(x.size());
      dequantize(q, y.data());
      for (int64_t r = 0; r < 300; ++r)
        for (int64_t c = 0; c < 260; ++c) {
          // operand coordinates of source element (r, c)
          const int64_t orow = l == qlayout::colwise_1x128 ? c : r;
          const int64_t ocol = l == qlayout::colwise_1x128 ? r : c;
          const double sinv = q.scale_at(orow, ocol / kBlock);
          // dequantization is one FP32 multiply of the decoded code by its scale (bit-exact, §0.5)
          ASSERT_EQ(float_bits(y[r * 260 + c]), float_bits(e4m3_to_float(q.data[size_t(orow * q.op_cols() + ocol)]) *
                                                           q.scale_at(orow, ocol / kBlock)))
              << "layout " << int(l) << " at " << r << "," << c;
          const double xv = x[r * 260 + c], err = std::fabs(y[r * 260 + c] - xv);
          // normal E4M3 range: half an ulp of 3 mantissa bits; subnormal range: half a step
          const double bound = std::max(fp8rl::tol::kE4M3RelHalfUlp * std::fabs(xv),
                                        fp8rl::tol::kE4M3SubnormalHalfStep * sinv);
          ASSERT_LE(err, bound) << "layout " << int(l) << " mode " << int(m) << " at " << r << "," << c;
        }
    }
}

TEST(Quantize, Pow2ExponentMatchesDirectDefinition) {
  std::mt19937 g(3);
  for (int i = 0; i < 200000; ++i) {
    // amax over every normal binade (biased exponents 1..254, the top one included)
    const uint32_t u = (g() % 254u + 1u) << 23 | (g() & 0x7fffffu);
    const float amax = float_from_bits(u);
    const int e = pow2_exponent(amax);
    const double ratio = double(amax) / 448.0;
    const int direct = static_cast<int>(std::ceil(std::log2(ratio)));  // DeepGEMM ceil_to_ue8m0
    if (direct < -126) { EXPECT_EQ(e, -126); continue; }
    ASSERT_EQ(e, direct) << "amax " << amax;
    const double q = double(amax) / std::ldexp(1.0, e);
    ASSERT_GT(q, 224.0);
    ASSERT_LE(q, 448.0);
  }
  EXPECT_EQ(pow2_exponent(448.0f), 0);
  EXPECT_EQ(pow2_exponent(std::nextafter(448.0f, 1e9f)), 1);
  EXPECT_EQ(pow2_exponent(224.0f), -1);
  EXPECT_EQ(pow2_exponent(float_from_bits(1)), -126);  // subnormal amax -> UE8M0 code 1
  EXPECT_EQ(pow2_exponent(std::numeric_limits<float>::max()), 120);  // the largest finite amax
}

TEST(Quantize, Fp32ModeIsTransformerEngineFormula) {
  for (float amax : {1.0f, 3.0f, 448.0f, 1e-30f, 7.77e5f}) {
    block_scale s = scale_from_amax(amax, scale_mode::fp32);
    float want = 448.0f / amax;
    if (std::isinf(want)) want = FLT_MAX;
    EXPECT_EQ(float_bits(s.scale), float_bits(want));
    EXPECT_EQ(float_bits(s.scale_inv), float_bits(1.0f / want));
  }
  block_scale tiny = scale_from_amax(float_from_bits(1), scale_mode::fp32);  // 448/denormal = inf
  EXPECT_EQ(tiny.scale, FLT_MAX);
}

TEST(Quantize, ZeroBlocksGetUnitScaleAndZeroBytes) {
  for (qlayout l : kLayouts)
    for (scale_mode m : kModes) {
      std::vector<float> x(130 * 140, 0.0f);
      x[5] = -0.0f;
      qtensor q = quantize(x.data(), 130, 140, l, m, "zeros");
      for (size_t i = 0; i < q.data.size(); ++i) EXPECT_TRUE(q.data[i] == 0x00 || q.data[i] == 0x80);
      const int64_t rstep = l == qlayout::block_128x128 ? kBlock : 1;
      for (int64_t r = 0; r < q.op_rows(); r += rstep)
        for (int64_t kb = 0; kb < q.k_blocks(); ++kb) EXPECT_EQ(q.scale_at(r, kb), 1.0f);
      if (l != qlayout::colwise_1x128) { EXPECT_EQ(q.data[5], 0x80); }  // -0 keeps its sign
    }
}

TEST(Quantize, PartialBlockAmaxUsesValidElementsOnly) {
  // one 128x128 block over a 3x5 matrix: amax = 7 -> pow2 e = (2-127... ) scale_inv 2^-6
  std::vector<float> x(15, 1.0f);
  x[7] = 7.0f;
  qtensor q = quantize(x.data(), 3, 5, qlayout::block_128x128, scale_mode::pow2, "tiny");
  EXPECT_EQ(q.scale_inv[0], std::ldexp(1.0f, pow2_exponent(7.0f)));
  EXPECT_EQ(q.scale_ld(), 4);            // roundup(ceil(5/128), 4)
  EXPECT_EQ(q.scale_count(), 4);
  qtensor r = quantize(x.data(), 3, 5, qlayout::rowwise_1x128, scale_mode::pow2, "tiny");
  EXPECT_EQ(r.scale_ld(), 4);            // VEC128: [ceil(K/128)][roundup(R,4)]
  EXPECT_EQ(r.scale_inv[1], std::ldexp(1.0f, pow2_exponent(7.0f)));  // row 1 holds x[7]
  EXPECT_EQ(r.scale_inv[3], 0.0f);       // padding entry
}

TEST(Quantize, ColumnwiseEqualsRowwiseOfTranspose) {
  const int64_t R = 300, C = 200;
  auto x = fp8rl::test::randn(R * C, 5);
  std::vector<float> xt(R * C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) xt[c * R + r] = x[r * C + c];
  qtensor col = quantize(x.data(), R, C, qlayout::colwise_1x128, scale_mode::pow2, "x");
  qtensor row = quantize(xt.data(), C, R, qlayout::rowwise_1x128, scale_mode::pow2, "xt");
  EXPECT_EQ(col.data, row.data);
  EXPECT_EQ(col.scale_inv, row.scale_inv);
}

// Shapes with whole 16x16 register tiles, 64-byte task edges and ragged remainders of both.
TEST(Quantize, TransposeBlocksIsExact) {
  for (auto [R, C] : {std::pair<int64_t, int64_t>{260, 130}, {512, 1536}, {77, 200}, {5, 3}}) {
    auto w = fp8rl::test::randn(R * C, 9);
    qtensor q = quantize(w.data(), R, C, qlayout::block_128x128, scale_mode::fp32, "w");
    qtensor t = qtensor_transpose_blocks(q);
    ASSERT_EQ(t.rows, C);
    ASSERT_EQ(t.cols, R);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) ASSERT_EQ(q.data[r * C + c], t.data[c * R + r]) << R << "x" << C << " at " << r << "," << c;
    std::vector<float> a(R * C), b(R * C);
    dequantize(q, a.data());
    dequantize(t, b.data());
    std::vector<float> bt(R * C);  // b transposed back: the same bits as a
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) bt[r * C + c] = b[c * R + r];
    ASSERT_EQ(fp8rl::test::first_diff(a, bt), -1) << R << "x" << C;
  }
}

// The array and transposing BF16 encoders give bf16_from_float's bits for every value class
// (ties, denormals that VCVTNEPS2BF16 would flush, ±Inf, NaN payloads) and ragged shapes.
TEST(Quantize, Bf16EncodersEqualTheScalarCodec) {
  std::vector<uint32_t> special = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u,
                                   0x3f80ffffu, 0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00001u, 0xff800001u,
                                   0x7f800100u, 0x00018000u, 0x3f7fffffu};
  for (auto [R, C] : {std::pair<int64_t, int64_t>{37, 53}, {64, 128}, {130, 17}, {1, 1}}) {
    auto x = fp8rl::test::randn(R * C, 31);
    for (size_t i = 0; i < special.size() && i < x.size(); ++i) x[(i * 7) % x.size()] = float_from_bits(special[i]);
    std::vector<uint16_t> a(R * C), t(R * C);
    bf16_encode_array(x.data(), R * C, a.data());
    bf16_encode_transposed(x.data(), R, C, t.data());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const uint16_t want = bf16_from_float(x[r * C + c]);
        ASSERT_EQ(a[r * C + c], want) << "array " << r << "," << c << " bits " << float_bits(x[r * C + c]);
        ASSERT_EQ(t[c * R + r], want) << "transposed " << R << "x" << C << " at " << r << "," << c;
      }
  }
}

TEST(Quantize, NonFiniteIsAnErrorNamingTensorAndBlock) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (float v : bad)
    for (qlayout l : kLayouts) {
      std::vector<float> x(300 * 400, 1.0f);
      x[200 * 400 + 300] = v;  // row 200, col 300
      x[200 * 400 + 301] = v;
      x[290 * 400 + 10] = v;   // a later block
      for (int path = 0; path < 2; ++path) {
        try {
          if (path) quantize(x.data(), 300, 400, l, scale_mode::pow2, "layer3.up");
          else quantize_ref(x.data(), 300, 400, l, scale_mode::pow2, "layer3.up");
          FAIL() << "no error";
        } catch (const nonfinite_error& e) {
          EXPECT_EQ(e.tensor, "layer3.up");
          EXPECT_NE(std::string(e.what()).find("layer3.up"), std::string::npos);
          if (l == qlayout::block_128x128) {
            EXPECT_EQ(e.block_row, 1); EXPECT_EQ(e.block_col, 2); EXPECT_EQ(e.count, 2);
          } else if (l == qlayout::rowwise_1x128) {
            EXPECT_EQ(e.block_row, 200); EXPECT_EQ(e.block_col, 2); EXPECT_EQ(e.count, 2);
          } else {  // operand row = column 10 sorts first
            EXPECT_EQ(e.block_row, 10); EXPECT_EQ(e.block_col, 2); EXPECT_EQ(e.count, 1);
          }
        }
      }
    }
}

// The fast amax finds NaN/Inf as the largest |x| bits, then counts them in a second pass: a
// ragged last tile (44 values, a masked tail vector; columnwise: 3-row tiles) with the largest
// finite float beside them.
TEST(Quantize, NonFiniteInARaggedTailIsCountedExactly) {
  for (qlayout l : {qlayout::rowwise_1x128, qlayout::block_128x128, qlayout::colwise_1x128}) {
    std::vector<float> x(3 * 300, 0.5f);
    x[1 * 300 + 290] = std::numeric_limits<float>::quiet_NaN();
    x[1 * 300 + 299] = -std::numeric_limits<float>::infinity();  // the tail vector's last lane
    x[1 * 300 + 298] = std::numeric_limits<float>::max();
    for (int path = 0; path < 2; ++path) {
      try {
        if (path) quantize(x.data(), 3, 300, l, scale_mode::fp32, "tail");
        else quantize_ref(x.data(), 3, 300, l, scale_mode::fp32, "tail");
        FAIL() << "no error";
      } catch (const nonfinite_error& e) {
        if (l == qlayout::colwise_1x128) {  // operand rows are source columns: 290 sorts first, one each
          EXPECT_EQ(e.block_row, 290) << path;
          EXPECT_EQ(e.block_col, 0) << path;
          EXPECT_EQ(e.count, 1) << path;
          continue;
        }
        EXPECT_EQ(e.block_row, l == qlayout::rowwise_1x128 ? 1 : 0) << path;
        EXPECT_EQ(e.block_col, 2) << path;
        EXPECT_EQ(e.count, 2) << path;
      }
    }
    x[1 * 300 + 290] = x[1 * 300 + 299] = 1.0f;  // finite again: the largest float sets the scale
    EXPECT_EQ(quantize(x.data(), 3, 300, l, scale_mode::fp32, "tail").scale_inv,
              quantize_ref(x.data(), 3, 300, l, scale_mode::fp32, "tail").scale_inv);
  }
}

// The fast paths find a bad tile's count and the first bad tile on their own loops: NaN in the
// first vector of a tile (the recount's first 16 lanes), in the last row of a columnwise tile
// (full and ragged), and two bad tiles in one operand row (the lower block is named, in the
// message too).
TEST(Quantize, NonFiniteCountsAndFirstBlockOnEveryLoop) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto first_error = [](const std::vector<float>& x, int64_t rows, int64_t cols, qlayout l, int path) {
    try {
      if (path) quantize(x.data(), rows, cols, l, scale_mode::pow2, "t");
      else quantize_ref(x.data(), rows, cols, l, scale_mode::pow2, "t");
    } catch (const nonfinite_error& e) { return e; }
    ADD_FAILURE() << "no error, layout " << int(l) << " path " << path;
    return nonfinite_error("t", -1, -1, -1, "");
  };
  for (int path = 0; path < 2; ++path) {
    std::vector<float> x(40 * 300, 1.0f);
    x[3 * 300 + 130] = x[3 * 300 + 131] = nan;  // row 3, tile 1, lanes 2 and 3
    for (qlayout l : {qlayout::rowwise_1x128, qlayout::block_128x128}) {
      const auto e = first_error(x, 40, 300, l, path);
      EXPECT_EQ(e.count, 2) << int(l) << " path " << path;
      EXPECT_EQ(e.block_col, 1) << int(l) << " path " << path;
    }
    for (int64_t row : {int64_t{299}, int64_t{127}}) {  // the last row of a ragged and of a full tile
      std::vector<float> c(300 * 40, 1.0f);
      c[row * 40 + 5] = nan;
      const auto e = first_error(c, 300, 40, qlayout::colwise_1x128, path);
      EXPECT_EQ(e.block_row, 5) << row << " path " << path;
      EXPECT_EQ(e.block_col, row / 128) << row << " path " << path;
      EXPECT_EQ(e.count, 1) << row << " path " << path;
    }
    std::vector<float> two(40 * 300, 1.0f);
    two[5 * 300 + 290] = two[5 * 300 + 10] = nan;  // row 5: tiles 2 and 0
    const auto e = first_error(two, 40, 300, qlayout::rowwise_1x128, path);
    EXPECT_EQ(e.block_row, 5) << path;
    EXPECT_EQ(e.block_col, 0) << path;
    EXPECT_NE(std::string(e.what()).find("(5, 0)"), std::string::npos) << e.what();
  }
}

// An outlier's scale sends its block's small values to zero; the report counts them (checked
// against the dequantized values: a nonzero x whose value came back 0) and names the block that
// lost the largest share, in every layout's operand grid. Zeros in x are not counted.
TEST(Quantize, FlushedValuesAreCountedAndTheWorstBlockNamed) {
  for (qlayout l : kLayouts) {
    auto x = fp8rl::test::randn(300 * 400, 5, 1.0f);
    x[7] = 0.0f;                         // a zero stays zero: neither nonzero nor flushed
    x[200 * 400 + 300] = 1e30f;          // row 200, col 300: its tile/block's scale ~2^-91
    qtensor q = quantize(x.data(), 300, 400, l, scale_mode::pow2, "layers.3.up");
    const flush_report f = qtensor_flushed(x.data(), q);
    std::vector<float> back(x.size());
    dequantize(q, back.data());
    int64_t flushed = 0, nonzero = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      nonzero += x[i] != 0.0f;
      flushed += x[i] != 0.0f && back[i] == 0.0f;
    }
    EXPECT_EQ(f.nonzero, nonzero);
    EXPECT_EQ(f.flushed, flushed);
    // the outlier's tile/block: every other value (|x| < 2^10, far below 2^-10 * 2^91) is flushed
    const int64_t others = l == qlayout::block_128x128 ? 128 * 128 - 1 : 127;
    EXPECT_GE(f.flushed, others) << int(l);  // and the odd Gaussian value within ~1e-5 of 0 elsewhere
    EXPECT_EQ(f.worst_tensor, "layers.3.up");
    const int64_t row = l == qlayout::block_128x128 ? 1 : l == qlayout::rowwise_1x128 ? 200 : 300;
    const int64_t col = l == qlayout::block_128x128 ? 2 : l == qlayout::rowwise_1x128 ? 2 : 1;
    EXPECT_EQ(f.worst_block_row, row) << int(l);
    EXPECT_EQ(f.worst_block_col, col) << int(l);
    EXPECT_DOUBLE_EQ(f.worst_fraction, double(others) / double(others + 1));
    EXPECT_NE(f.worst_text().find("tensor 'layers.3.up': block (" + std::to_string(row) + ", " + std::to_string(col) + ")"),
              std::string::npos) << f.worst_text();
    // merging keeps the larger worst block and adds the counts
    const auto y = fp8rl::test::randn(300 * 400, 6, 1.0f);
    flush_report sum = qtensor_flushed(y.data(), quantize(y.data(), 300, 400, l, scale_mode::pow2, "other"));
    const flush_report y_alone = sum;
    sum.merge(f);
    EXPECT_EQ(sum.worst_tensor, "layers.3.up");
    EXPECT_EQ(sum.worst_fraction, f.worst_fraction);
    EXPECT_EQ(sum.nonzero, y_alone.nonzero + f.nonzero);
    EXPECT_EQ(sum.flushed, y_alone.flushed + f.flushed);
  }
  // Gaussian data: a value is flushed below 2^-10 * scale_inv <= 2^-10 amax / 224 ~ 4.4e-6 amax,
  // P(|x| < 4.4e-6 * ~4.5 sigma) ~ 1.6e-5 per value: a block of 16384 expects ~0.26 (well under
  // the 1% at which training warns, models::kFlushWarnFraction, which a test here cannot include)
  auto g = fp8rl::test::randn(256 * 256, 9, 1.0f);
  const flush_report f = qtensor_flushed(g.data(), quantize(g.data(), 256, 256, qlayout::block_128x128, scale_mode::pow2, "g"));
  constexpr double kGaussianBlockFlushed = 5.0 / 16384;  // 5 values of a block: P(Poisson(0.26) >= 5) ~ 1e-5
  EXPECT_LE(f.worst_fraction, kGaussianBlockFlushed);
  EXPECT_EQ(flush_report{}.worst_text(), "no value was flushed to zero");
}

TEST(Quantize, ValidateRejectsMissingScaleAndNaNCodes) {
  auto x = fp8rl::test::randn(130 * 130, 2);
  qtensor q = quantize(x.data(), 130, 130, qlayout::block_128x128, scale_mode::pow2, "w");
  EXPECT_NO_THROW(qtensor_validate(q));
  qtensor missing = q;
  missing.scale_inv[1] = 0.0f;
  EXPECT_THROW(qtensor_validate(missing), std::invalid_argument);
  qtensor inf = q;
  inf.scale_inv[0] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(qtensor_validate(inf), std::invalid_argument);
  for (uint8_t code : {uint8_t{0xFF}, uint8_t{0x7F}}) {  // E4M3's two NaN codes
    qtensor nan = q;
    nan.data[17] = code;
    try { qtensor_validate(nan); FAIL() << int(code); } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("byte 17"), std::string::npos);
    }
  }
  qtensor rows = quantize(x.data(), 130, 130, qlayout::rowwise_1x128, scale_mode::pow2, "r");
  rows.scale_inv[static_cast<size_t>(1 * rows.scale_ld() + 129)] = 0.0f;  // the last operand row's last tile
  EXPECT_THROW(qtensor_validate(rows), std::invalid_argument);
  qtensor short_data = q;
  short_data.data.pop_back();
  EXPECT_THROW(qtensor_validate(short_data), std::invalid_argument);
  // a received shape of 2^36 x 2^36 with nothing in it: rows * cols and the scale count wrapped
  // to 0, the sizes matched, and the scale loop read past the empty array
  qtensor wrap;
  wrap.name = "w";
  wrap.rows = wrap.cols = int64_t{1} << 36;
  try { qtensor_validate(wrap); FAIL(); } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w': shape 68719476736 x 68719476736 is beyond any tensor"), std::string::npos)
        << e.what();
  }
  // a bundle tensor's element count: 2^31 x 512 x 2^31 overflowed inside the guard (n * d, UB) and
  // came out 0, so a tensor of 2^71 elements with no bytes validated
  bundle_tensor t;
  t.shape = {int64_t{1} << 31, 512, int64_t{1} << 31};
  EXPECT_EQ(t.numel(), -1);
  t.shape = {int64_t{1} << 20, int64_t{1} << 20};
  EXPECT_EQ(t.numel(), int64_t{1} << 40);  // the largest tensor
  t.shape = {(int64_t{1} << 20) + 1, int64_t{1} << 20};
  EXPECT_EQ(t.numel(), -1);
}
