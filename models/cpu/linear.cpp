// models/cpu/linear.cpp -- linear layers under a precision: quant/ GEMMs on packed weights.
//   fp32  y = x · W^T                              (gemm_f32)
//   bf16  y = bf16(x) · bf16(W)^T, FP32 accumulate (gemm_bf16)
//   fp8   fprop  X 1x128 · W 128x128; dgrad dY 1x128 · W^T (same blocks); wgrad dY^T, X^T as
//         1x128 columnwise tiles (TransformerEngine Float8BlockScaling, fp8-numerics.md §3.2)
// With policy.tiles, bf16 and fp8 layers run all three GEMMs on the AMX tile kernels (same
// operands, tolerance-checked sums; rows never mix, so every row is batch-invariant).
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/cpu/cpu_ops.hpp"
#include "quant/fp8.hpp"
#include "quant/gemm.hpp"

namespace fp8rl::models {
namespace {

using namespace quant;

struct cpu_linear : prepared_linear {
  scale_mode mode = scale_mode::pow2;
  bool tiles = false;  // bf16/fp8 GEMMs on AMX tiles
  gemm_packed_b fwd;  // B = W [out, in]
  gemm_packed_b bwd;  // B = W^T [in, out] (dgrad), when prepared for backward
};

std::vector<uint16_t> to_bf16(const float* x, int64_t n) {
  std::vector<uint16_t> b(static_cast<size_t>(n));
  bf16_encode_array(x, n, b.data());
  return b;
}

// [cols, rows] BF16 of x[rows, cols]^T
std::vector<uint16_t> to_bf16_transposed(const float* x, int64_t rows, int64_t cols) {
  std::vector<uint16_t> b(static_cast<size_t>(rows * cols));
  bf16_encode_transposed(x, rows, cols, b.data());
  return b;
}

// t [cols, rows] = x^T, in 32x32 tiles (each task reads 32 rows' lines once, writes runs of 32).
std::vector<float> transpose(const float* x, int64_t rows, int64_t cols) {
  std::vector<float> t(static_cast<size_t>(rows * cols));
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, rows, 32, 0, cols, 32), [&](const tbb::blocked_range2d<int64_t>& b) {
    for (int64_t c = b.cols().begin(); c < b.cols().end(); ++c)
      for (int64_t r = b.rows().begin(); r < b.rows().end(); ++r) t[c * rows + r] = x[r * cols + c];
  });
  return t;
}

// The packed forms a layer's GEMMs read: the tile form alone, or what automatic dispatch needs.
gemm_pack_forms forms_for(bool tiles, bool small_m) {
  return tiles ? gemm_pack_forms{false, false, true} : gemm_forms_for(small_m);
}

// An activation A[M,K] as a GEMM's A operand in one precision: FP32 values as given, BF16
// rounded, or 1x128 FP8 tiles (for the tile GEMMs already in tile order). Layers reading the
// same activation share one.
struct act_operand {
  precision prec = precision::fp32;
  scale_mode mode = scale_mode::pow2;
  bool tiles = false;
  const float* f32 = nullptr;
  std::vector<uint16_t> bf16;
  qtensor fp8;
  gemm_wide_a fp8_wide;  // exact FP8 where large-M GEMMs run on the wide kernel (fp8_wide.M > 0)
  gemm_tiles_a fp8_tiles;
  int64_t M = 0, K = 0;
};

void act_prepare(act_operand& a, precision prec, scale_mode mode, bool tiles, const float* A, int64_t M, int64_t K,
                 const std::string& name) {
  a.prec = prec, a.mode = mode, a.tiles = tiles, a.M = M, a.K = K, a.f32 = A;
  if (prec == precision::bf16) a.bf16 = to_bf16(A, M * K);
  if (prec == precision::fp8 && tiles) a.fp8_tiles = gemm_tiles_a_fp8(A, M, K, mode, name);
  if (prec == precision::fp8 && !tiles && M > gemm_config{}.stream_max_m && gemm_fp8_wide_large_m()) {
    a.fp8_wide = gemm_wide_a_fp8(A, M, K, mode, name);  // no code array, no decode pass
  } else if (prec == precision::fp8 && !tiles) {
    a.fp8.name = name;
    quantize_into(A, M, K, qlayout::rowwise_1x128, mode, a.fp8);
  }
}

// Whether `a` is the operand a layer with (prec, mode, tiles) would have made of the same activation.
bool act_serves(const act_operand& a, precision prec, scale_mode mode, bool tiles) {
  return a.prec == prec && (prec == precision::fp32 || a.tiles == tiles) && (prec != precision::fp8 || a.mode == mode);
}

// C[M,N] = A · B^T with B packed in a's precision.
void act_matmul(const act_operand& a, const gemm_packed_b& B, float* C) {
  const gemm_desc d{a.M, B.N, a.K};
  switch (a.prec) {
    case precision::fp32: gemm_f32(d, a.f32, B, C); break;
    case precision::bf16:
      if (a.tiles) gemm_bf16_tiles(d, a.bf16.data(), B, C);
      else gemm_bf16(d, a.bf16.data(), B, C);
      break;
    case precision::fp8:
      if (a.tiles) gemm_fp8_tiles(a.fp8_tiles, B, C);
      else if (a.fp8_wide.M > 0) gemm_fp8(a.fp8_wide, B, C);
      else gemm_fp8(a.fp8, B, C);
      break;
  }
}

// C[M,N] = A[M,K] · B^T in `prec`, A given as FP32 values; B packed in the same precision.
void matmul(precision prec, scale_mode mode, bool tiles, const float* A, int64_t M, int64_t K, const gemm_packed_b& B,
            float* C, const std::string& name) {
  act_operand a;
  act_prepare(a, prec, mode, tiles, A, M, K, name);
  act_matmul(a, B, C);
}

gemm_packed_b pack(precision prec, scale_mode mode, const float* B, int64_t N, int64_t K, const std::string& name,
                   gemm_pack_forms forms) {
  switch (prec) {
    case precision::fp32: return gemm_pack_f32(B, N, K, name);
    case precision::bf16: {
      auto b = to_bf16(B, N * K);
      return gemm_pack_bf16(b.data(), N, K, name, forms);
    }
    case precision::fp8:
      return gemm_pack_fp8(quantize(B, N, K, qlayout::block_128x128, mode, name), forms);
  }
  throw std::logic_error("bad precision");
}

}  // namespace

std::unique_ptr<prepared_linear> cpu_linear_prepare(const linear_source& w, bool for_backward) {
  auto p = std::make_unique<cpu_linear>();
  p->name = w.name;
  p->out = w.out;
  p->in = w.in;
  p->prec = w.prec;
  p->mode = w.mode;
  p->tiles = w.tiles && w.prec != precision::fp32;
  if (p->tiles && !gemm_tiles_available())
    throw std::runtime_error("linear '" + w.name + "': the precision policy asks for tile GEMMs (tiles) and this CPU has no "
                             "AMX-BF16 (active ISA: " + std::string(cpu_isa_name(cpu_isa_active())) + ")");
  // training runs large-M GEMMs only; generation also needs the narrow (decode) form
  const gemm_pack_forms bwd_forms = forms_for(p->tiles, false);
  gemm_pack_forms forms = forms_for(p->tiles, !for_backward);
  forms.huge_pages = w.long_lived;  // every decode step streams them (quant/aligned.hpp)
  if (w.fp8) {
    if (w.prec != precision::fp8) throw std::invalid_argument("linear '" + w.name + "': FP8 bytes for a non-FP8 layer");
    if (w.fp8->rows != w.out || w.fp8->cols != w.in || w.fp8->layout != qlayout::block_128x128)
      throw std::invalid_argument("linear '" + w.name + "': FP8 weight has the wrong shape or layout");
    p->mode = w.fp8->mode;
    p->fwd = gemm_pack_fp8(*w.fp8, forms);
    if (for_backward) p->bwd = gemm_pack_fp8(qtensor_transpose_blocks(*w.fp8), bwd_forms);
    return p;
  }
  if (!w.f32) throw std::invalid_argument("linear '" + w.name + "': no weight values");
  if (w.prec == precision::fp8 && p->tiles) {  // straight into the tile forms
    gemm_pack_fp8_blocks_tiles(w.f32, w.out, w.in, w.mode, w.name, &p->fwd, for_backward ? &p->bwd : nullptr);
    return p;
  }
  if (w.prec == precision::fp8) {
    qtensor q = quantize(w.f32, w.out, w.in, qlayout::block_128x128, w.mode, w.name);
    p->fwd = gemm_pack_fp8(q, forms);
    if (for_backward) p->bwd = gemm_pack_fp8(qtensor_transpose_blocks(q), bwd_forms);
    return p;
  }
  p->fwd = pack(w.prec, w.mode, w.f32, w.out, w.in, w.name, forms);
  if (for_backward) {
    auto wt = transpose(w.f32, w.out, w.in);
    p->bwd = pack(w.prec, w.mode, wt.data(), w.in, w.out, w.name + ".T", bwd_forms);
  }
  return p;
}

void cpu_linear_forward(const prepared_linear& w, const float* x, int64_t T, float* y) {
  const auto& l = static_cast<const cpu_linear&>(w);
  matmul(l.prec, l.mode, l.tiles, x, T, l.in, l.fwd, y, l.name + ".x");
}

// Layers reading one operand run as one grouped GEMM where their precision has one (BF16 and the
// FP8 code operand: quant runs them in one parallel region where its narrow kernel takes them).
void cpu_linear_forward_group(std::span<const prepared_linear* const> ws, const float* x, int64_t T,
                              std::span<float* const> ys) {
  act_operand a;
  bool have = false;
  for (size_t i = 0; i < ws.size();) {
    const auto& l = static_cast<const cpu_linear&>(*ws[i]);
    if (l.in != ws[0]->in) throw std::logic_error("linear group: '" + l.name + "' reads another input width");
    if (!have || !act_serves(a, l.prec, l.mode, l.tiles)) act_prepare(a, l.prec, l.mode, l.tiles, x, T, l.in, l.name + ".x");
    have = true;
    size_t j = i + 1;  // layers i..j-1 share a
    while (j < ws.size() && ws[j]->in == l.in) {
      const auto& n = static_cast<const cpu_linear&>(*ws[j]);
      if (!act_serves(a, n.prec, n.mode, n.tiles)) break;
      ++j;
    }
    const bool grouped = j - i > 1 && !a.tiles &&
                         (a.prec == precision::bf16 || (a.prec == precision::fp8 && a.fp8_wide.M == 0));
    if (!grouped) {
      act_matmul(a, l.fwd, ys[i]);
      ++i;
      continue;
    }
    std::vector<const gemm_packed_b*> Bs;
    for (size_t k = i; k < j; ++k) Bs.push_back(&static_cast<const cpu_linear&>(*ws[k]).fwd);
    const std::span<float* const> Cs = ys.subspan(i, j - i);
    if (a.prec == precision::bf16) gemm_bf16_group(a.bf16.data(), a.M, a.K, Bs, Cs);
    else gemm_fp8_group(a.fp8, Bs, Cs);
    i = j;
  }
}

namespace {
// dx[T,in] = dy · W (dgrad)
void linear_dgrad(const cpu_linear& l, const float* dy, int64_t T, float* dx) {
  if (l.bwd.N != l.in) throw std::logic_error("linear '" + l.name + "' was not prepared for backward");
  matmul(l.prec, l.mode, l.tiles, dy, T, l.out, l.bwd, dx, l.name + ".dy");
}

// x[T,in] as wgrad's B operand (x^T packed in l's precision: 1x128 columnwise tiles for FP8).
gemm_packed_b wgrad_x_operand(const cpu_linear& l, const float* x, int64_t T) {
  const gemm_pack_forms forms = forms_for(l.tiles, false);
  if (l.prec == precision::fp8 && l.tiles)  // straight into the tile form, no code array
    return gemm_pack_fp8_colwise_tiles(x, T, l.in, l.mode, l.name + ".x^T");
  if (l.prec == precision::fp8 && gemm_fp8_wide_large_m())  // straight into the wide form
    return gemm_pack_fp8_colwise_wide(x, T, l.in, l.mode, l.name + ".x^T");
  if (l.prec == precision::fp8)
    return gemm_pack_fp8(quantize(x, T, l.in, qlayout::colwise_1x128, l.mode, l.name + ".x^T"), forms);
  if (l.prec == precision::bf16) {
    auto xtb = to_bf16_transposed(x, T, l.in);  // [in, T]
    return gemm_pack_bf16(xtb.data(), l.in, T, l.name + ".x^T", forms);
  }
  auto xt = transpose(x, T, l.in);  // [in, T]
  return pack(l.prec, l.mode, xt.data(), l.in, T, l.name + ".x^T", forms);
}

// dw[out,in] += dy^T · x, x given as its wgrad operand xb
void linear_wgrad(const cpu_linear& l, const float* dy, int64_t T, const gemm_packed_b& xb, float* dw) {
  if (l.tiles) {  // the tile GEMMs add into dw themselves (the same bits as dw += a separate result)
    if (l.prec == precision::fp8) {
      gemm_fp8_tiles(gemm_tiles_a_fp8_colwise(dy, T, l.out, l.mode, l.name + ".dy^T"), xb, dw, true);
    } else {
      const auto dyt = to_bf16_transposed(dy, T, l.out);  // [out, T]
      gemm_bf16_tiles({l.out, l.in, T}, dyt.data(), xb, dw, true);
    }
    return;
  }
  auto g_buf = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(l.out * l.in));  // the GEMM writes all of it
  float* g = g_buf.get();
  if (l.prec == precision::fp8 && gemm_fp8_wide_large_m()) {
    // dW[out,in] = dY^T · X with both operands tiled 1x128 along tokens (columnwise)
    gemm_fp8(gemm_wide_a_fp8_colwise(dy, T, l.out, l.mode, l.name + ".dy^T"), xb, g);
  } else if (l.prec == precision::fp8) {
    gemm_fp8(quantize(dy, T, l.out, qlayout::colwise_1x128, l.mode, l.name + ".dy^T"), xb, g);
  } else if (l.prec == precision::bf16) {
    act_operand a;
    a.prec = precision::bf16, a.tiles = l.tiles, a.M = l.out, a.K = T;
    a.bf16 = to_bf16_transposed(dy, T, l.out);  // [out, T]
    act_matmul(a, xb, g);
  } else {
    auto dyt = transpose(dy, T, l.out);  // [out, T]
    matmul(l.prec, l.mode, l.tiles, dyt.data(), l.out, T, xb, g, l.name + ".dy^T");
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, l.out * l.in, 1 << 14), [&](const auto& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) dw[i] += g[i];
  });
}

// Whether a wgrad operand packed for layer a serves layer b (same input, same packing).
bool wgrad_operand_serves(const cpu_linear& a, const cpu_linear& b) {
  return a.prec == b.prec && a.tiles == b.tiles && (a.prec != precision::fp8 || a.mode == b.mode);
}
}  // namespace

void cpu_linear_backward(const prepared_linear& w, const float* x, const float* dy, int64_t T, float* dx, float* dw) {
  const auto& l = static_cast<const cpu_linear&>(w);
  if (dx) linear_dgrad(l, dy, T, dx);
  if (dw) linear_wgrad(l, dy, T, wgrad_x_operand(l, x, T), dw);
}

void cpu_linear_backward_group(std::span<const prepared_linear* const> ws, const float* x,
                               std::span<const float* const> dys, int64_t T, float* dx, float* dtmp,
                               std::span<float* const> dws) {
  const cpu_linear* xb_for = nullptr;  // the layer whose wgrad operand xb is
  gemm_packed_b xb;
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto& l = static_cast<const cpu_linear&>(*ws[i]);
    if (l.in != ws[0]->in) throw std::logic_error("linear group: '" + l.name + "' reads another input width");
    if (dx) {
      linear_dgrad(l, dys[i], T, i == 0 ? dx : dtmp);
      if (i > 0) cpu_add_inplace(dx, dtmp, T * l.in);  // the backend's add_inplace: separate calls' bits
    }
    if (!dws[i]) continue;
    if (!xb_for || !wgrad_operand_serves(*xb_for, l)) xb = wgrad_x_operand(l, x, T), xb_for = &l;
    linear_wgrad(l, dys[i], T, xb, dws[i]);
  }
}

}  // namespace fp8rl::models
