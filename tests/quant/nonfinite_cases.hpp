// tests/quant/nonfinite_cases.hpp -- activations with NaN/Inf in known 1x128 tiles, and the error
// quantize gives for them: every path that quantizes straight from FP32 (tile-order and wide
// packers) must throw the same text.
#pragma once
#include <limits>
#include <string>
#include <vector>

#include "quant/qtensor.hpp"
#include "tests/test_util.hpp"

namespace fp8rl::test {

// The non-finite error text `fn` throws ("" if it throws none).
template <class Fn>
std::string nonfinite_text(Fn&& fn) {
  return thrown_text<quant::nonfinite_error>(fn);
}

struct nonfinite_case {
  std::vector<float> x;
  int64_t rows = 0, cols = 0;
  std::string want;  // quantize's error for x in the case's layout
};

// x [300][40] as columnwise tiles: Inf in column 30 (token block 1), NaN in column 35 (block 0).
inline nonfinite_case nonfinite_colwise(quant::scale_mode mode, const std::string& name) {
  nonfinite_case c{std::vector<float>(300 * 40, 1.0f), 300, 40, ""};
  c.x[200 * 40 + 30] = std::numeric_limits<float>::infinity();
  c.x[10 * 40 + 35] = std::numeric_limits<float>::quiet_NaN();
  c.want = nonfinite_text([&] { quant::quantize(c.x.data(), 300, 40, quant::qlayout::colwise_1x128, mode, name); });
  return c;
}

// x [40][300] as rowwise tiles: -Inf in row 30 (block 1), NaN in row 35 (block 0).
inline nonfinite_case nonfinite_rowwise(quant::scale_mode mode, const std::string& name) {
  nonfinite_case c{std::vector<float>(40 * 300, 1.0f), 40, 300, ""};
  c.x[30 * 300 + 200] = -std::numeric_limits<float>::infinity();
  c.x[35 * 300 + 5] = std::numeric_limits<float>::quiet_NaN();
  c.want = nonfinite_text([&] { quant::quantize(c.x.data(), 40, 300, quant::qlayout::rowwise_1x128, mode, name); });
  return c;
}

}  // namespace fp8rl::test
