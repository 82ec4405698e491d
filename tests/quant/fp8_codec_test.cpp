// tests/quant/fp8_codec_test.cpp -- E4M3/E5M2 codec: the spec's edge-case tables (§2.3, §2.4)
// byte for byte, decode of all 256 codes, BF16 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "quant/cpu_isa.hpp"
#include "quant/fp8.hpp"
#include "quant/quantize_impl.hpp"
#include "tests/test_util.hpp"
#include "tests/quant/codec_oracle.hpp"

using namespace fp8rl::quant;

namespace {
float fb(uint32_t u) { return float_from_bits(u); }

struct enc_case { float x; uint8_t code; const char* what; };

// fp8-numerics.md §2.3's E4M3 table and the cases around its edges.
std::vector<enc_case> e4m3_spec_cases() {
  const float inf = std::numeric_limits<float>::infinity();
  return {
      {0.0f, 0x00, "+0"}, {-0.0f, 0x80, "-0"}, {1.0f, 0x38, "1"}, {-1.0f, 0xB8, "-1"},
      {std::ldexp(1.0f, -6), 0x08, "min normal"}, {7 * std::ldexp(1.0f, -9), 0x07, "max subnormal"},
      {std::ldexp(1.0f, -9), 0x01, "min subnormal"}, {std::ldexp(1.0f, -10), 0x00, "2^-10 ties to 0"},
      {fb(0x3A800001), 0x01, "just above 2^-10"}, {-std::ldexp(1.0f, -10), 0x80, "-2^-10"},
      {3 * std::ldexp(1.0f, -10), 0x02, "3*2^-10 ties to 2"}, {5 * std::ldexp(1.0f, -10), 0x02, "5*2^-10 ties to 2"},
      {1.0625f, 0x38, "1.0625 ties to 1"}, {1.1875f, 0x3A, "1.1875 ties to 1.25"},
      {432.0f, 0x7E, "432 ties to 448"}, {448.0f, 0x7E, "448"}, {449.0f, 0x7E, "449"},
      {463.99f, 0x7E, "463.99"}, {464.0f, 0x7E, "464 ties to 448"}, {fb(0x43E80001), 0x7E, "just above 464"},
      {480.0f, 0x7E, "480"}, {1e30f, 0x7E, "1e30"}, {FLT_MAX, 0x7E, "FLT_MAX"}, {-500.0f, 0xFE, "-500"},
      {inf, 0x7E, "+Inf"}, {-inf, 0xFE, "-Inf"}, {fb(0x7FC00000), 0x7F, "+qNaN"},
      {fb(0xFFC00000), 0x7F, "-qNaN"}, {fb(0x7F800001), 0x7F, "sNaN"},
      {bf16_to_float(0x43E8), 0x7E, "bf16 464"}, {bf16_to_float(0x43E9), 0x7E, "bf16 466"},
  };
}
}  // namespace

TEST(Fp8Codec, E4M3SpecTable) {
  for (const auto& c : e4m3_spec_cases()) EXPECT_EQ(e4m3_from_float(c.x), c.code) << c.what;
}

namespace {
// The spec table's inputs and exact ties at every normal exponent (1 + 1/16 to even: down,
// 1 + 3/16: up; both signs), a count that leaves a masked tail after whole 16-lane vectors.
std::vector<float> spec_and_ties() {
  std::vector<float> x;
  for (const auto& c : e4m3_spec_cases()) x.push_back(c.x);
  for (int e = -6; e <= 8; ++e)
    for (float m : {1.0625f, 1.1875f, -1.0625f, -1.1875f}) x.push_back(std::ldexp(m, e));
  return x;
}
}  // namespace

// The array encoder (the FP8 KV cache writes through it) on the table and the ties, whole vectors
// and a masked tail, on each ISA path; the exhaustive test sweeps every float, this one runs in
// every build.
TEST(Fp8Codec, ArrayEncoderFollowsTheSpecTable) {
  const std::vector<float> x = spec_and_ties();
  ASSERT_NE(x.size() % 16, 0u) << "the masked tail goes untested";
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa_detected()}) {
    fp8rl::test::isa_limit_scope limit(isa);
    std::vector<uint8_t> codes(x.size() + 1, 0xAA);
    e4m3_encode_array(x.data(), static_cast<int64_t>(x.size()), codes.data());
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_EQ(codes[i], e4m3_from_float(x[i])) << cpu_isa_name(isa) << " x " << x[i] << " (" << i << ")";
    EXPECT_EQ(codes[x.size()], 0xAA) << "wrote past n";
  }
}

// The AVX-512 grid (quantize's value-only path): e4m3_to_float(e4m3_from_float(x)) on the same values.
TEST(Fp8Codec, Avx512GridFollowsTheSpecTable) {
  if (cpu_isa_detected() < cpu_isa::avx512) GTEST_SKIP() << "no AVX-512: the grid is AVX-512 only";
  const std::vector<float> x = spec_and_ties();
  std::vector<float> grid(x.size());
  fp8rl::quant::detail::e4m3_grid_array_avx512(x.data(), static_cast<int64_t>(x.size()), grid.data());
  for (size_t i = 0; i < x.size(); ++i)
    if (!std::isnan(x[i])) {
      EXPECT_EQ(float_bits(grid[i]), float_bits(e4m3_to_float(e4m3_from_float(x[i])))) << "x " << x[i] << " (" << i << ")";
    }
}

TEST(Fp8Codec, E5M2SpecTable) {
  const float inf = std::numeric_limits<float>::infinity();
  const enc_case cases[] = {
      {57344.0f, 0x7B, "57344"}, {61439.0f, 0x7B, "61439"}, {61440.0f, 0x7B, "61440 (tie) saturates"},
      {65504.0f, 0x7B, "65504"}, {inf, 0x7B, "+Inf"}, {-inf, 0xFB, "-Inf"},
      {std::numeric_limits<float>::quiet_NaN(), 0x7F, "NaN"},
      {std::ldexp(1.0f, -16), 0x01, "2^-16"}, {std::ldexp(1.0f, -17), 0x00, "2^-17 ties to 0"},
      {1.0f, 0x3C, "1"}, {-0.0f, 0x80, "-0"},
  };
  for (const auto& c : cases) EXPECT_EQ(e5m2_from_float(c.x), c.code) << c.what;
}

TEST(Fp8Codec, DecodeAll256) {
  for (int b = 0; b < 256; ++b) {
    const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    const float v4 = e4m3_to_float(static_cast<uint8_t>(b));
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(v4)) << b;
    } else {
      double want = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(double(m), -9);
      EXPECT_EQ(double(v4), s ? -want : want) << b;
      EXPECT_EQ(std::signbit(v4), s == 1) << b;
      EXPECT_EQ(e4m3_from_float(v4), b) << "round trip " << b;  // every code is a fixed point
    }
    const int e5 = (b >> 2) & 31, m5 = b & 3;
    const float v5 = e5m2_to_float(static_cast<uint8_t>(b));
    if (e5 == 31) {
      EXPECT_TRUE(m5 == 0 ? std::isinf(v5) : std::isnan(v5)) << b;
    } else {
      double want = e5 ? std::ldexp(1.0 + m5 / 4.0, e5 - 15) : std::ldexp(double(m5), -16);
      EXPECT_EQ(double(v5), s ? -want : want) << b;
      EXPECT_EQ(e5m2_from_float(v5), b) << "round trip " << b;
    }
  }
}

// The array decoder (AVX-512 64 codes at a time, then a tail) gives e4m3_to_float's bits (NaNs
// too) for every code, at every offset of a vector and in the tail, on every ISA level.
TEST(Fp8Codec, DecodeArrayEqualsTheScalarDecoder) {
  std::vector<uint8_t> codes(3 * 256 + 37);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 97 + i / 256);
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa_detected()}) {
    fp8rl::test::isa_limit_scope limit(isa);
    for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{64}, int64_t{200}, static_cast<int64_t>(codes.size())}) {
      std::vector<float> out(static_cast<size_t>(n) + 1, -7.0f);
      e4m3_decode_array(codes.data(), n, out.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(e4m3_to_float(codes[i])))
            << cpu_isa_name(isa) << " n " << n << " i " << i << " code " << int(codes[i]);
      EXPECT_EQ(out[n], -7.0f) << "wrote past n = " << n;
    }
  }
}

TEST(Fp8Codec, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(fb(0x3F808000)), 0x3F80);  // tie -> even
  EXPECT_EQ(bf16_from_float(fb(0x3F818000)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(bf16_from_float(fb(0x3F808001)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_from_float(-0.0f), 0x8000);
}

TEST(Fp8Codec, OracleAgreesOnSampledPatterns) {
  // cheap smoke version of the exhaustive test (which runs under the "exhaustive" label)
  for (uint64_t i = 0; i < (1ull << 32); i += 65521) {
    const float x = fb(static_cast<uint32_t>(i));
    const double w4 = fp8rl::test::oracle_value(x, fp8rl::test::kE4M3);
    const uint8_t c4 = e4m3_from_float(x);
    if (std::isnan(w4)) { EXPECT_EQ(c4, 0x7F); continue; }
    ASSERT_EQ(double(e4m3_to_float(c4)), w4) << std::hex << i;
    ASSERT_EQ(std::signbit(e4m3_to_float(c4)), std::signbit(w4)) << std::hex << i;
  }
}

// e4m3_is_subnormal over every code: exactly the finite non-zero codes below the smallest normal
// (2^-6); e4m3_any_subnormal finds one anywhere in an array and nothing in an array without one.
TEST(Fp8Codec, SubnormalCodesAreExactlyThoseBelowTheSmallestNormal) {
  std::vector<uint8_t> normal, all;
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    const bool want = !std::isnan(v) && v != 0.0f && std::fabs(v) < 0x1p-6f;
    EXPECT_EQ(e4m3_is_subnormal(static_cast<uint8_t>(c)), want) << "code " << c;
    all.push_back(static_cast<uint8_t>(c));
    if (!want) normal.push_back(static_cast<uint8_t>(c));
  }
  EXPECT_FALSE(e4m3_any_subnormal(normal.data(), static_cast<int64_t>(normal.size())));
  EXPECT_TRUE(e4m3_any_subnormal(all.data(), static_cast<int64_t>(all.size())));
  EXPECT_FALSE(e4m3_any_subnormal(all.data(), 1));  // code 0 alone
  EXPECT_TRUE(e4m3_any_subnormal(all.data() + 135, 1));  // 0x87 = -7 * 2^-9
}
