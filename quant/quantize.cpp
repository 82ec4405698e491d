// quant/quantize.cpp -- blockwise quantization: scalar reference, dispatch, dequantization.
// Built with -ffp-contract=off: x * scale must be one IEEE multiply.
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <cmath>
#include <sstream>

#include "quant/cpu_isa.hpp"
#include "quant/gemm_impl.hpp"
#include "quant/fp8.hpp"
#include "quant/quantize_impl.hpp"
#include "quant/qtensor.hpp"

namespace fp8rl::quant {

int64_t qtensor::scale_count() const {
  if (layout == qlayout::block_128x128) return (op_rows() + kBlock - 1) / kBlock * scale_ld();
  return k_blocks() * scale_ld();
}

nonfinite_error::nonfinite_error(std::string t, int64_t br, int64_t bc, int64_t n,
                                 std::string what)
    : std::runtime_error(std::move(what)), tensor(std::move(t)), block_row(br), block_col(bc),
      count(n) {}

namespace detail {

[[noreturn]] void throw_nonfinite(const std::string& name, qlayout layout, int64_t br,
                                  int64_t bc, int64_t count) {
  std::ostringstream os;
  const char* kind = layout == qlayout::block_128x128   ? "128x128 block"
                     : layout == qlayout::rowwise_1x128 ? "1x128 tile (rowwise)"
                                                         : "128x1 tile (columnwise)";
  os << "tensor '" << name << "': " << kind << " (" << br << ", " << bc << ") holds " << count
     << " non-finite value" << (count == 1 ? "" : "s") << "; refusing to quantize";
  throw nonfinite_error(name, br, bc, count, os.str());
}

void qtensor_reset(qtensor& q, int64_t rows, int64_t cols, qlayout layout, scale_mode mode) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("tensor '" + q.name + "': negative shape");
  q.rows = rows;
  q.cols = cols;
  q.layout = layout;
  q.mode = mode;
  q.data.resize(static_cast<size_t>(rows * cols));
  q.scale_inv.assign(static_cast<size_t>(q.scale_count()), 0.0f);
}

qtensor qtensor_alloc(int64_t rows, int64_t cols, qlayout layout, scale_mode mode,
                      std::string name) {
  qtensor q;
  q.name = std::move(name);
  qtensor_reset(q, rows, cols, layout, mode);
  return q;
}

// One tile/block of the operand matrix: rows [r0, r1) x cols [k0, k1) of the *source*
// gathered by `at(r, k)` (operand coordinates). Returns false on non-finite (count in *bad).
template <class At>
inline bool block_amax(At at, int64_t r0, int64_t r1, int64_t k0, int64_t k1, float* amax,
                       int64_t* bad) {
  float m = 0.0f;
  int64_t n = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t k = k0; k < k1; ++k) {
      uint32_t u = float_bits(at(r, k)) & 0x7fffffffu;
      if (u >= 0x7f800000u) { ++n; continue; }
      float a = float_from_bits(u);
      if (a > m) m = a;
    }
  *amax = m;
  *bad = n;
  return n == 0;
}

qtensor quantize_scalar(const float* x, int64_t rows, int64_t cols, qlayout layout,
                        scale_mode mode, std::string name) {
  qtensor q = qtensor_alloc(rows, cols, layout, mode, std::move(name));
  const int64_t R = q.op_rows(), K = q.op_cols();
  // operand element (r, k) in source coordinates
  auto at = [&](int64_t r, int64_t k) {
    return layout == qlayout::colwise_1x128 ? x[k * cols + r] : x[r * cols + k];
  };
  const int64_t rstep = layout == qlayout::block_128x128 ? kBlock : 1;
  for (int64_t r0 = 0; r0 < R; r0 += rstep) {
    int64_t r1 = std::min(R, r0 + rstep);
    for (int64_t kb = 0; kb * kBlock < K; ++kb) {
      int64_t k0 = kb * kBlock, k1 = std::min(K, k0 + kBlock);
      float amax;
      int64_t bad;
      if (!block_amax(at, r0, r1, k0, k1, &amax, &bad)) throw_nonfinite(q.name, layout, r0 / rstep, kb, bad);
      block_scale s = scale_from_amax(amax, mode);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t k = k0; k < k1; ++k) q.data[r * K + k] = e4m3_from_float(at(r, k) * s.scale);
      if (layout == qlayout::block_128x128)
        q.scale_inv[(r0 / kBlock) * q.scale_ld() + kb] = s.scale_inv;
      else
        q.scale_inv[kb * q.scale_ld() + r0] = s.scale_inv;
    }
  }
  return q;
}

}  // namespace detail

qtensor quantize_ref(const float* x, int64_t rows, int64_t cols, qlayout layout,
                     scale_mode mode, std::string name) {
  return detail::quantize_scalar(x, rows, cols, layout, mode, std::move(name));
}

void quantize_into(const float* x, int64_t rows, int64_t cols, qlayout layout, scale_mode mode,
                   qtensor& out) {
  if (cpu_isa_active() >= cpu_isa::avx512) return detail::quantize_avx512(x, rows, cols, layout, mode, out);
  out = detail::quantize_scalar(x, rows, cols, layout, mode, out.name);  // a copy: an error keeps the name
}

qtensor quantize(const float* x, int64_t rows, int64_t cols, qlayout layout, scale_mode mode,
                 std::string name) {
  qtensor q;
  q.name = std::move(name);
  quantize_into(x, rows, cols, layout, mode, q);
  return q;
}

void e4m3_encode_array(const float* x, int64_t n, uint8_t* out) {
  if (cpu_isa_active() >= cpu_isa::avx512) return detail::e4m3_encode_array_avx512(x, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = e4m3_from_float(x[i]);
}

void e4m3_decode_array(const uint8_t* in, int64_t n, float* out) {
  if (cpu_isa_active() >= cpu_isa::avx512_bf16) return detail::e4m3_to_f32_avx512(in, n, out);
  const float* lut = e4m3_table();
  for (int64_t i = 0; i < n; ++i) out[i] = lut[in[i]];
}

void bf16_encode_array(const float* x, int64_t n, uint16_t* out) {
  if (cpu_isa_active() >= cpu_isa::avx512) return detail::bf16_from_float_avx512(x, n, out);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) out[i] = bf16_from_float(x[i]);
  });
}

void bf16_encode_transposed(const float* x, int64_t rows, int64_t cols, uint16_t* out) {
  if (cpu_isa_active() >= cpu_isa::avx512) return detail::bf16_from_float_transposed_avx512(x, rows, cols, out);
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, rows, 32, 0, cols, 32), [&](const tbb::blocked_range2d<int64_t>& b) {
    for (int64_t c = b.cols().begin(); c < b.cols().end(); ++c)
      for (int64_t r = b.rows().begin(); r < b.rows().end(); ++r) out[c * rows + r] = bf16_from_float(x[r * cols + c]);
  });
}

void dequantize(const qtensor& q, float* out) {
  const int64_t K = q.op_cols();
  const float* lut = e4m3_table();
  for (int64_t r = 0; r < q.op_rows(); ++r)
    for (int64_t k = 0; k < K; ++k) {
      float v = lut[q.data[r * K + k]] * q.scale_at(r, k / kBlock);
      if (q.layout == qlayout::colwise_1x128) out[k * q.cols + r] = v;
      else out[r * q.cols + k] = v;
    }
}

qtensor qtensor_transpose_blocks(const qtensor& w) {
  if (w.layout != qlayout::block_128x128)
    throw std::invalid_argument("tensor '" + w.name + "': transpose needs 128x128 blocks");
  qtensor t = detail::qtensor_alloc(w.cols, w.rows, qlayout::block_128x128, w.mode, w.name + ".T");
  const int64_t R = w.rows, C = w.cols;
  if (cpu_isa_active() >= cpu_isa::avx512) {
    detail::transpose_bytes_avx512(w.data.data(), R, C, t.data.data());
  } else {
    // 64x64 byte tiles in parallel: each task writes its tile's output rows sequentially
    tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, R, 64, 0, C, 64), [&](const tbb::blocked_range2d<int64_t>& b) {
      for (int64_t c = b.cols().begin(); c < b.cols().end(); ++c)
        for (int64_t r = b.rows().begin(); r < b.rows().end(); ++r) t.data[c * R + r] = w.data[r * C + c];
    });
  }
  for (int64_t rb = 0; rb * kBlock < w.rows; ++rb)
    for (int64_t cb = 0; cb * kBlock < w.cols; ++cb)
      t.scale_inv[cb * t.scale_ld() + rb] = w.scale_inv[rb * w.scale_ld() + cb];
  return t;
}

void flush_report::merge(const flush_report& o) {
  flushed += o.flushed;
  nonzero += o.nonzero;
  if (o.worst_fraction > worst_fraction) {
    worst_tensor = o.worst_tensor;
    worst_block_row = o.worst_block_row;
    worst_block_col = o.worst_block_col;
    worst_fraction = o.worst_fraction;
  }
}

std::string flush_report::worst_text() const {
  if (worst_fraction == 0) return "no value was flushed to zero";
  std::ostringstream os;
  os << "tensor '" << worst_tensor << "': block (" << worst_block_row << ", " << worst_block_col << ") lost "
     << worst_fraction << " of its nonzero values to zero";
  return os.str();
}

flush_report qtensor_flushed(const float* x, const qtensor& q) {
  const int64_t R = q.op_rows(), K = q.op_cols(), KB = q.k_blocks();
  const int64_t rstep = q.layout == qlayout::block_128x128 ? kBlock : 1, RB = (R + rstep - 1) / rstep;
  const bool colwise = q.layout == qlayout::colwise_1x128;
  std::vector<int64_t> flushed(static_cast<size_t>(RB * KB)), nonzero(flushed.size());  // [RB][KB]
  // each task counts whole operand rows into its block row's entries (rows of a 128x128 block
  // row stay in one task: no two tasks write one entry)
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, RB), [&](const tbb::blocked_range<int64_t>& br) {
    for (int64_t rb = br.begin(); rb < br.end(); ++rb)
      for (int64_t r = rb * rstep; r < std::min(R, (rb + 1) * rstep); ++r)
        for (int64_t kb = 0; kb < KB; ++kb) {
          int32_t f = 0, n = 0;
          const uint8_t* c = q.data.data() + r * K;
          const int64_t k0 = kb * kBlock, k1 = std::min(K, k0 + kBlock);
          if (colwise) {
            for (int64_t k = k0; k < k1; ++k) {
              n += x[k * q.cols + r] != 0.0f;
              f += (x[k * q.cols + r] != 0.0f) & ((c[k] & 0x7f) == 0);
            }
          } else {
            const float* xr = x + r * q.cols;  // vectorized: contiguous in both
            for (int64_t k = k0; k < k1; ++k) {
              n += xr[k] != 0.0f;
              f += (xr[k] != 0.0f) & ((c[k] & 0x7f) == 0);
            }
          }
          flushed[static_cast<size_t>(rb * KB + kb)] += f;
          nonzero[static_cast<size_t>(rb * KB + kb)] += n;
        }
  });
  flush_report out;
  out.worst_tensor = q.name;
  for (int64_t b = 0; b < RB * KB; ++b) {
    const int64_t f = flushed[static_cast<size_t>(b)], n = nonzero[static_cast<size_t>(b)];
    out.flushed += f;
    out.nonzero += n;
    const double share = n ? double(f) / double(n) : 0.0;
    if (share > out.worst_fraction) {
      out.worst_fraction = share;
      out.worst_block_row = b / KB;
      out.worst_block_col = b % KB;
    }
  }
  return out;
}

void qtensor_validate(const qtensor& q) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("tensor '" + q.name + "': " + what);
  };
  if (q.rows < 0 || q.cols < 0) fail("negative shape");
  // bounded first: rows * cols (and the scale count) of a received shape could wrap to the sizes
  // held, pass, and the scale loop read past an empty array
  if (q.rows > kMaxTensorDim || q.cols > kMaxTensorDim || q.rows * q.cols > kMaxTensorElems)
    fail("shape " + std::to_string(q.rows) + " x " + std::to_string(q.cols) + " is beyond any tensor (at most 2^31 per side, 2^40 in all)");
  if (static_cast<int64_t>(q.data.size()) != q.rows * q.cols)
    fail("holds " + std::to_string(q.data.size()) + " bytes, shape needs " +
         std::to_string(q.rows * q.cols));
  if (static_cast<int64_t>(q.scale_inv.size()) != q.scale_count())
    fail("holds " + std::to_string(q.scale_inv.size()) + " scales, layout needs " +
         std::to_string(q.scale_count()));
  const int64_t rstep = q.layout == qlayout::block_128x128 ? kBlock : 1;
  for (int64_t r = 0; r < q.op_rows(); r += rstep)
    for (int64_t kb = 0; kb < q.k_blocks(); ++kb) {
      float s = q.scale_at(r, kb);
      if (!(s > 0.0f) || !std::isfinite(s))
        fail("scale of block (" + std::to_string(r / rstep) + ", " + std::to_string(kb) +
             ") is " + std::to_string(s) + " (missing or invalid)");
    }
  for (size_t i = 0; i < q.data.size(); ++i)
    if ((q.data[i] & 0x7f) == 0x7f) fail("NaN code at byte " + std::to_string(i));
}

}  // namespace fp8rl::quant
