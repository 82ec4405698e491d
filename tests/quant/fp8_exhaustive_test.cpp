// tests/quant/fp8_exhaustive_test.cpp -- every one of the 2^32 float32 bit patterns through
// e4m3_from_float / e5m2_from_float (and the AVX-512 encoder), against the independent oracle
// (tests/quant/codec_oracle.hpp). ctest label: exhaustive (about a minute on 2 cores).
#include <gtest/gtest.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <cmath>

#include "quant/cpu_isa.hpp"
#include "quant/fp8.hpp"
#include "quant/qtensor.hpp"
#include "quant/quantize_impl.hpp"
#include "tests/quant/codec_oracle.hpp"

using namespace fp8rl::quant;
using fp8rl::test::oracle_value;

namespace {
// Checks one code against the oracle's value; returns true if it matches.
bool matches(uint8_t code, double want, float (*dec)(uint8_t)) {
  if (std::isnan(want)) return code == 0x7F;
  const float got = dec(code);
  return double(got) == want && std::signbit(got) == std::signbit(want);
}

template <class Enc>
void sweep(const char* name, Enc enc, float (*dec)(uint8_t), const fp8rl::test::fp8_format& f) {
  std::atomic<uint64_t> bad{0}, first{~0ull};
  tbb::parallel_for(uint32_t{0}, uint32_t{1u << 16}, [&](uint32_t hi) {
    uint64_t local = 0;
    for (uint32_t lo = 0; lo < (1u << 16); ++lo) {
      const uint32_t u = (hi << 16) | lo;
      if (!matches(enc(float_from_bits(u)), oracle_value(float_from_bits(u), f), dec)) {
        if (!local) {
          uint64_t cur = first.load();
          while (u < cur && !first.compare_exchange_weak(cur, u)) {}
        }
        ++local;
      }
    }
    bad += local;
  });
  EXPECT_EQ(bad.load(), 0u) << name << ": first mismatch at bits 0x" << std::hex << first.load();
}
}  // namespace

TEST(Fp8Exhaustive, E4M3AllFloatPatterns) { sweep("e4m3", e4m3_from_float, e4m3_to_float, fp8rl::test::kE4M3); }

TEST(Fp8Exhaustive, E5M2AllFloatPatterns) { sweep("e5m2", e5m2_from_float, e5m2_to_float, fp8rl::test::kE5M2); }

// The vectorized encoder (quantizers, KV-cache writes) equals the scalar codec on all 2^32.
TEST(Fp8Exhaustive, VectorEncoderAllFloatPatterns) {
  if (cpu_isa_detected() < cpu_isa::avx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::atomic<uint64_t> bad{0};
  tbb::parallel_for(uint32_t{0}, uint32_t{1u << 16}, [&](uint32_t hi) {
    std::vector<float> x(1u << 16);
    std::vector<uint8_t> q(x.size());
    for (uint32_t lo = 0; lo < (1u << 16); ++lo) x[lo] = float_from_bits((hi << 16) | lo);
    e4m3_encode_array(x.data(), static_cast<int64_t>(x.size()), q.data());
    uint64_t local = 0;
    for (size_t i = 0; i < x.size(); ++i) local += q[i] != e4m3_from_float(x[i]);
    bad += local;
  });
  EXPECT_EQ(bad.load(), 0u);
}

// The E4M3 grid rounding that packs wgrad operands straight into tile form (e4m3_grid16) gives
// e4m3_to_float(e4m3_from_float(x)) bit for bit on every non-NaN float pattern.
TEST(Fp8Exhaustive, GridRoundingAllFloatPatterns) {
  if (cpu_isa_detected() < cpu_isa::avx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::atomic<uint64_t> bad{0};
  tbb::parallel_for(uint32_t{0}, uint32_t{1u << 16}, [&](uint32_t hi) {
    std::vector<float> x(1u << 16), y(x.size());
    for (uint32_t lo = 0; lo < (1u << 16); ++lo) x[lo] = float_from_bits((hi << 16) | lo);
    fp8rl::quant::detail::e4m3_grid_array_avx512(x.data(), static_cast<int64_t>(x.size()), y.data());
    uint64_t local = 0;
    for (size_t i = 0; i < x.size(); ++i)
      if (!std::isnan(x[i])) local += float_bits(y[i]) != float_bits(e4m3_to_float(e4m3_from_float(x[i])));
    bad += local;
  });
  EXPECT_EQ(bad.load(), 0u);
}
