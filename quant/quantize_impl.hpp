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
// out[i] = e4m3_to_float(e4m3_from_float(x[i])) (e4m3_grid16; for the exhaustive test).
void e4m3_grid_array_avx512(const float* x, int64_t n, float* out);
// x [T][C] quantized as 1x128 columnwise tiles (wgrad's X^T: operand row c, token blocks) straight
// into the tile GEMM's B form: tiles [NP][Kt/32][2][16 k-pairs][16][2] BF16 (E4M3 values, times
// scale_inv when fold), scale_inv [NP][Kt/128][32]; both fully written (padding zero). Returns
// false with the lowest bad (column, token block) and its count when a tile holds NaN/Inf.
bool quantize_colwise_tiles_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, bool fold, int64_t Kt,
                                   uint16_t* tiles, float* scale_inv, int64_t* bad_col, int64_t* bad_block,
                                   int64_t* bad_count);
// The same quantization laid out as the tile GEMM's A (rows = columns of x: wgrad's dY^T):
// a [Mp/16][Kt/32][16][32] with Mp = C rounded to 32 (rows past C are written only up to C
// rounded to 32: the caller's Mp); sa [Mp][Kt/128] scale_inv when not fold, else null.
bool quantize_colwise_tiles_a_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, bool fold, int64_t Kt,
                                     uint16_t* a, float* sa, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count);
// W [N][K] quantized in 128x128 blocks straight into the tile B forms of W (fwd: panels of 32
// rows of W) and of W^T (bwd: panels of 32 columns), each optional (null): tiles of Kt = K
// (fwd) / N (bwd) rounded to 128 and scale_inv [NP][Kt/128][32] as gemm_pack_fp8 lays them out.
// Returns false with the lowest bad block (row block, column block) and its count.
bool quantize_blocks_tiles_avx512(const float* w, int64_t N, int64_t K, scale_mode mode, bool fold, uint16_t* fwd_tiles,
                                  float* fwd_scale_inv, uint16_t* bwd_tiles, float* bwd_scale_inv, int64_t* bad_rb,
                                  int64_t* bad_cb, int64_t* bad_count);
// x [M][K] quantized as 1x128 rowwise tiles into the tile A order [Mp/16][Kt/32][16][32] (BF16
// E4M3 values, times scale_inv when fold; zero padding rows and columns); sa [Mp][Kt/128] gets
// scale_inv when not fold. Returns false with the lowest bad (row, block) as quantize would.
bool quantize_rowwise_tiles_avx512(const float* x, int64_t M, int64_t K, scale_mode mode, bool fold, int64_t Mp,
                                   int64_t Kt, uint16_t* a, float* sa, int64_t* bad_row, int64_t* bad_block,
                                   int64_t* bad_count);
// The wide (FP32 FMA) kernel's FP8 operands, straight from FP32 (E4M3 values unscaled, padding
// zero), bit-identical to quantize + decode/pack; false with the lowest bad tile as quantize:
// x [T][C] as 1x128 columnwise tiles into gemm_pack_fp8's wide panels [NP][Kp][32] and scales
// [NP][Kp/128][32] (wgrad's X^T) ...
bool quantize_colwise_wide_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, int64_t Kp, float* wide,
                                  float* scale_inv, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count);
// ... or into A rows [C rounded to 32][Kp] and scales [C rounded to 32][Kp/128] (wgrad's dY^T);
bool quantize_colwise_wide_a_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, int64_t Kp, float* a,
                                    float* sa, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count);
// x [M][K] as 1x128 rowwise tiles into A rows [M][Kp] and scales [M][Kp/128].
bool quantize_rowwise_wide_avx512(const float* x, int64_t M, int64_t K, scale_mode mode, int64_t Kp, float* a,
                                  float* sa, int64_t* bad_row, int64_t* bad_block, int64_t* bad_count);
void quantize_avx512(const float* x, int64_t rows, int64_t cols, qlayout layout,
                     scale_mode mode, qtensor& q);

}  // namespace fp8rl::quant::detail
