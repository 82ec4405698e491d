// quant/quantize_impl.hpp -- internal: shared helpers of the quantizer implementations.
#pragma once
#include <string>

#include "quant/qtensor.hpp"

namespace fp8rl::quant::detail {

[[noreturn]] void throw_nonfinite(const std::string& name, qlayout layout, int64_t br,
                                  int64_t bc, int64_t count);
qtensor qtensor_alloc(int64_t rows, int64_t cols, qlayout layout, scale_mode mode,
                      std::string name);
// Shapes q for (rows, cols, layout, mode) reusing its capacity; bytes are left for the
// quantizer to overwrite, scale padding is zeroed.
void qtensor_reset(qtensor& q, int64_t rows, int64_t cols, qlayout layout, scale_mode mode);
qtensor quantize_scalar(const float* x, int64_t rows, int64_t cols, qlayout layout,
                        scale_mode mode, std::string name);
void e4m3_encode_array_avx512(const float* x, int64_t n, uint8_t* out);
// dst[C][R] = src[R][C] bytes, 16x16 register transposes, oneTBB over 64x64 tiles.
void transpose_bytes_avx512(const uint8_t* src, int64_t R, int64_t C, uint8_t* dst);
void bf16_from_float_avx512(const float* x, int64_t n, uint16_t* out);
void bf16_from_float_transposed_avx512(const float* x, int64_t rows, int64_t cols, uint16_t* out);
void quantize_avx512(const float* x, int64_t rows, int64_t cols, qlayout layout,
                     scale_mode mode, qtensor& q);

}  // namespace fp8rl::quant::detail
