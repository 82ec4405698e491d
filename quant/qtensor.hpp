// quant/qtensor.hpp -- blockwise FP8 (E4M3) quantization of row-major matrices.
// defines: qlayout, qtensor, nonfinite_error, quantize, quantize_ref, dequantize,
//          qtensor_transpose_blocks, qtensor_validate, flush_report, qtensor_flushed
//
// Legend: a source matrix X is row-major [rows, cols]. As a GEMM operand (C = A·B^T) an
// FP8 tensor is an "operand matrix" [R, K] whose rows are contiguous in `data`:
//   rowwise_1x128  tiles of 1 row x 128 cols      data [rows][cols]   R = rows, K = cols
//   colwise_1x128  tiles of 128 rows x 1 col      data [cols][rows]   R = cols, K = rows
//                  (stored transposed, as on Hopper; quantized from the source, never
//                  transposed from the rowwise copy)
//   block_128x128  blocks of 128 x 128            data [rows][cols]   R = rows, K = cols
// Scale arrays use the cuBLASLt layouts of fp8-numerics.md §7 so both backends move identical
// bytes: tiles -> VEC128_32F s[kb][r], shape [ceil(K/128)][roundup(R,4)];
//        blocks -> BLK128x128_32F s[rb][kb], shape [ceil(R/128)][roundup(ceil(K/128),4)].
// Padding entries of scale arrays are 0. Ragged edges: a partial tile/block takes its amax
// from valid elements only; no padding bytes are stored.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant/scale.hpp"

namespace fp8rl::quant {

enum class qlayout : uint8_t { rowwise_1x128 = 0, colwise_1x128 = 1, block_128x128 = 2 };
inline constexpr int64_t kBlock = 128;
// Shapes a received tensor may claim (qtensor_validate, bundle_validate): per side and in all,
// far past any model, and small enough that no size computed from them wraps.
inline constexpr int64_t kMaxTensorDim = int64_t{1} << 31, kMaxTensorElems = int64_t{1} << 40;

struct qtensor {
  std::string name;                 // tensor name, used in every error
  int64_t rows = 0, cols = 0;       // source shape [rows, cols]
  qlayout layout = qlayout::rowwise_1x128;
  scale_mode mode = scale_mode::pow2;
  std::vector<uint8_t> data;        // E4M3 codes, operand matrix [R][K]
  std::vector<float> scale_inv;     // cuBLASLt layout, see above

  int64_t op_rows() const { return layout == qlayout::colwise_1x128 ? cols : rows; }  // R
  int64_t op_cols() const { return layout == qlayout::colwise_1x128 ? rows : cols; }  // K
  int64_t k_blocks() const { return (op_cols() + kBlock - 1) / kBlock; }
  // leading dimension of the scale array
  int64_t scale_ld() const {
    return layout == qlayout::block_128x128 ? (k_blocks() + 3) / 4 * 4 : (op_rows() + 3) / 4 * 4;
  }
  int64_t scale_count() const;       // entries including padding
  // scale_inv of operand row r (0 <= r < R), K-block kb (inline: GEMM packing calls it per row)
  float scale_at(int64_t r, int64_t kb) const {
    return layout == qlayout::block_128x128 ? scale_inv[static_cast<size_t>((r / kBlock) * scale_ld() + kb)]
                                            : scale_inv[static_cast<size_t>(kb * scale_ld() + r)];
  }
};

// Raised when a tile or block holds NaN/Inf. Names the tensor, the block and the count.
struct nonfinite_error : std::runtime_error {
  nonfinite_error(std::string tensor, int64_t block_row, int64_t block_col, int64_t count,
                  std::string what);
  std::string tensor;
  int64_t block_row, block_col;  // index in the tile/block grid of the *operand* matrix
  int64_t count;                 // non-finite values in that block
};

// Quantize x [rows, cols] (row-major). Throws nonfinite_error; never encodes NaN/Inf.
// `quantize` dispatches to the fastest path (bit-identical to quantize_ref).
qtensor quantize(const float* x, int64_t rows, int64_t cols, qlayout layout, scale_mode mode,
                 std::string name);
qtensor quantize_ref(const float* x, int64_t rows, int64_t cols, qlayout layout,
                     scale_mode mode, std::string name);
// Same as quantize, reusing out's buffers (steady-state activations: no allocation, no page
// faults). out.name names the tensor in errors.
void quantize_into(const float* x, int64_t rows, int64_t cols, qlayout layout, scale_mode mode,
                   qtensor& out);

// out [rows, cols] row-major (source orientation) = decode(q) * scale_inv.
void dequantize(const qtensor& q, float* out);

// W [rows, cols] in 128x128 blocks -> W^T [cols, rows] in 128x128 blocks with the same block
// scales (fp8-numerics.md §3.2: the same blocks serve the transpose in dgrad). Exact.
qtensor qtensor_transpose_blocks(const qtensor& w);

// What quantization sent to zero: nonzero source values whose code is +-0 (|x * scale| <= 2^-10,
// fp8-numerics.md §2.1), which a block's outlier causes silently (its scale lifts the block's
// other values below E4M3's smallest subnormal). Over tensors, and the tile/block (operand grid,
// as in nonfinite_error) that lost the largest fraction of its nonzero values.
struct flush_report {
  int64_t flushed = 0, nonzero = 0;
  std::string worst_tensor;
  int64_t worst_block_row = -1, worst_block_col = -1;
  double worst_fraction = 0;  // flushed / nonzero of that block; 0 when nothing was flushed
  void merge(const flush_report& o);
  std::string worst_text() const;  // "tensor 'w': block (r, c) lost f of its nonzero values"
};
// q quantized from x [q.rows, q.cols] (row-major, as passed to quantize).
flush_report qtensor_flushed(const float* x, const qtensor& q);

// Checks sizes, scale finiteness/positivity and NaN codes; throws std::invalid_argument naming
// the tensor and what is wrong. Use on anything that crossed a process boundary.
void qtensor_validate(const qtensor& q);

}  // namespace fp8rl::quant
