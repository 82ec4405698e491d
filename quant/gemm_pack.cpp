// quant/gemm_pack.cpp -- packs B operands into 32-column panels (layouts: quant/gemm.hpp).
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "quant/fp8.hpp"
#include "quant/gemm_impl.hpp"
#include "quant/quantize_impl.hpp"

namespace fp8rl::quant {
namespace {

// The large forms' buffers take the huge-page policy before the packer sizes them.
void use_huge_pages(gemm_packed_b& p) {
  p.wide = avector_uninit<float>(aligned_uninit_allocator<float>(true));
  p.bf16 = avector<uint16_t>(aligned_allocator<uint16_t>(true));
  p.fp8 = avector<uint8_t>(aligned_allocator<uint8_t>(true));
  p.tiles = avector_uninit<uint16_t>(aligned_uninit_allocator<uint16_t>(true));
}

// The narrow forms need AVX512_BF16 kernels; without them packing always builds `wide`.
// The tile form serves only the tile GEMMs, which need AMX: without it, it is not built.
gemm_pack_forms usable(gemm_pack_forms f) {
  if (cpu_isa_active() < cpu_isa::amx) f.tiles = false;
  if (cpu_isa_active() < cpu_isa::avx512_bf16) f.wide = true;
  if (!f.wide && !f.narrow && !f.tiles) f.wide = true;
  return f;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Calls fn(panel, column j in panel, n) for every real column, panels in parallel.
template <class Fn>
void for_each_column(int64_t N, Fn&& fn) {
  tbb::parallel_for(int64_t{0}, (N + 31) / 32, [&](int64_t pn) {
    for (int64_t j = 0; j < 32 && pn * 32 + j < N; ++j) fn(pn, j, pn * 32 + j);
  });
}

// The narrow FP8 kernel decodes codes by affine bit maps (quant/gemm_avx512.cpp); a pair step
// marked in fp8_rare gets a patch here for the codes those maps cannot take: which words of the
// decoder's two outputs (word w of w0 / w1 from byte fp8_step_byte(0 / 1, w)) and their BF16
// values (E4M3 * 2^-8, the affine decoder's scale). A patch is ~12 bytes where the step's values were 128.
void pack_rare_steps(gemm_packed_b& p) {
  const int64_t KB = p.Kp / kBlock;
  const auto step_codes = [&](size_t b, int i) {
    return p.fp8.data() + ((static_cast<int64_t>(b) / KB) * p.Kp / 2 + (static_cast<int64_t>(b) % KB) * 64 + i) * 64;
  };
  p.fp8_rare_at.assign(p.fp8_rare.size() + 1, 0);
  uint32_t n = 0;
  for (size_t b = 0; b < p.fp8_rare.size(); ++b) {
    p.fp8_rare_at[b] = n;
    for (uint64_t bits = p.fp8_rare[b]; bits; bits &= bits - 1) {
      const uint8_t* step = step_codes(b, __builtin_ctzll(bits));
      n += 4 + static_cast<uint32_t>(std::count_if(step, step + 64, detail::fp8_code_rare));
    }
  }
  p.fp8_rare_at.back() = n;
  p.fp8_rare_patch.assign(n, 0);
  const float* lut = e4m3_table();
  uint16_t* out = p.fp8_rare_patch.data();
  for (size_t b = 0; b < p.fp8_rare.size(); ++b)
    for (uint64_t bits = p.fp8_rare[b]; bits; bits &= bits - 1) {
      const uint8_t* step = step_codes(b, __builtin_ctzll(bits));
      uint32_t k[2] = {0, 0};
      uint16_t* v = out + 4;
      for (int half = 0; half < 2; ++half)
        for (int w = 0; w < 32; ++w)
          if (const uint8_t c = step[detail::fp8_step_byte(half, w)]; detail::fp8_code_rare(c)) {
            k[half] |= uint32_t{1} << w;
            *v++ = bf16_from_float(std::ldexp(lut[c], -8));
          }
      std::memcpy(out, k, 8);
      out = v;
    }
}

// Where every panel's columns share each block's scale (128x128 weight blocks: a 32-column panel
// lies in one block row), the narrow kernel reads one scale per (panel, block) instead of 32: a
// GEMV from DRAM then streams 4 bytes of scales per 4 KiB of codes, not 128.
void pack_panel_scales(gemm_packed_b& p) {
  const int64_t NP = p.panels(), KB = p.Kp / kBlock;
  for (int64_t pn = 0; pn < NP; ++pn) {
    const int64_t ncols = std::min<int64_t>(32, p.N - pn * 32);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float* s = p.scale_inv.data() + (pn * KB + kb) * 32;
      if (std::any_of(s + 1, s + ncols, [&](float x) { return x != s[0]; })) return;  // per-column scales
    }
  }
  p.scale_panel.resize(static_cast<size_t>(NP * KB));
  for (int64_t b = 0; b < NP * KB; ++b) p.scale_panel[b] = p.scale_inv[b * 32];
}

}  // namespace

int64_t gemm_packed_b::bytes() const {
  return static_cast<int64_t>(wide.size() * 4 + bf16.size() * 2 + fp8.size() + fp8_rare.size() * 8 +
                              fp8_rare_at.size() * 4 + fp8_rare_patch.size() * 2 + scale_inv.size() * 4 +
                              scale_panel.size() * 4 +
                              tiles.size() * 2);
}

gemm_packed_b gemm_pack_f32(const float* B, int64_t N, int64_t K, std::string name) {
  gemm_desc{0, N, K}.check();
  gemm_packed_b p;
  p.dtype = gemm_dtype::f32;
  p.name = std::move(name);
  p.N = N;
  p.K = p.Kp = K;
  p.wide.assign(static_cast<size_t>(p.panels() * K * 32), 0.0f);
  for_each_column(N, [&](int64_t pn, int64_t j, int64_t n) {
    float* dst = p.wide.data() + pn * K * 32 + j;
    for (int64_t k = 0; k < K; ++k) dst[k * 32] = B[n * K + k];
  });
  return p;
}

gemm_packed_b gemm_pack_bf16(const uint16_t* B, int64_t N, int64_t K, std::string name,
                             gemm_pack_forms forms) {
  gemm_desc{0, N, K}.check();
  forms = usable(forms);
  gemm_packed_b p;
  if (forms.huge_pages) use_huge_pages(p);
  p.dtype = gemm_dtype::bf16;
  p.name = std::move(name);
  p.N = N;
  p.K = K;
  p.Kp = (K + 1) / 2 * 2;
  const int64_t NP = p.panels(), Kp = p.Kp;
  if (forms.wide) p.wide.assign(static_cast<size_t>(NP * Kp * 32), 0.0f);
  if (forms.narrow) p.bf16.assign(static_cast<size_t>(NP * Kp * 32), 0);
  p.Kt = round_up(K, 32);
  if (forms.tiles) p.tiles.resize(static_cast<size_t>(NP * p.Kt * 32));  // tiles_put_panel writes all
  if (forms.wide || forms.narrow) for_each_column(N, [&](int64_t pn, int64_t j, int64_t n) {
    const uint16_t* src = B + n * K;
    for (int64_t k = 0; k < K; ++k) {
      if (forms.wide) p.wide[(pn * Kp + k) * 32 + j] = bf16_to_float(src[k]);
      if (forms.narrow) p.bf16[(pn * Kp / 2 + k / 2) * 64 + 2 * j + (k & 1)] = src[k];
    }
  });
  if (forms.tiles)
    tbb::parallel_for(int64_t{0}, NP, [&](int64_t pn) {
      avector<uint16_t> cols(static_cast<size_t>(32 * p.Kt), 0);  // [32][Kt]
      for (int64_t j = 0; j < 32 && pn * 32 + j < N; ++j)
        std::memcpy(cols.data() + j * p.Kt, B + (pn * 32 + j) * K, static_cast<size_t>(K) * 2);
      detail::tiles_put_panel(p.tiles.data() + pn * p.Kt * 32, p.Kt, cols.data());  // tiles imply AMX
    });
  return p;
}

gemm_packed_b gemm_pack_fp8(const qtensor& B, gemm_pack_forms forms) {
  forms = usable(forms);
  gemm_packed_b p;
  if (forms.huge_pages) use_huge_pages(p);
  p.dtype = gemm_dtype::fp8;
  p.mode = B.mode;
  p.name = B.name;
  p.N = B.op_rows();
  p.K = B.op_cols();
  p.Kp = (p.K + kBlock - 1) / kBlock * kBlock;
  const int64_t NP = p.panels(), Kp = p.Kp, KB = p.Kp / kBlock, K = p.K;
  if (forms.wide) p.wide.assign(static_cast<size_t>(NP * Kp * 32), 0.0f);
  // narrow padding is the code of 1.0: it meets zero-padded A (K) or discarded columns (N), and
  // keeps padded pair steps off the patch path (a zero code is rare, quant/gemm_impl.hpp)
  if (forms.narrow) p.fp8.assign(static_cast<size_t>(NP * Kp * 32), 0x38);
  if (forms.narrow) p.fp8_rare.assign(static_cast<size_t>(NP * KB), 0);
  p.scale_inv.assign(static_cast<size_t>(NP * KB * 32), 0.0f);
  p.Kt = Kp;
  if (forms.tiles) p.tiles.resize(static_cast<size_t>(NP * Kp * 32));  // tiles_put_panel writes all
  const bool fold = B.mode == scale_mode::pow2;  // q * 2^e is exact in BF16 (normal: quant/gemm.hpp)
  const float* lut = e4m3_table();
  int pos[32][2];  // codes form: byte position of (column j, pair half h) in a 64-byte step
  for (int j = 0; j < 32; ++j)
    for (int h = 0; h < 2; ++h) pos[j][h] = detail::fp8_stream_pos(j, h);
  const bool vector_pack = cpu_isa_active() >= cpu_isa::avx512_bf16;
  // Panel-major: k outer, the panel's columns inner, so every form is written sequentially.
  tbb::parallel_for(int64_t{0}, NP, [&](int64_t pn) {
    const int64_t ncols = std::min<int64_t>(32, p.N - pn * 32);
    const uint8_t* src = B.data.data() + pn * 32 * K;  // row j of the panel at src + j * K
    int64_t k_done = 0;  // full panels: 16-k rounds in registers
    if (vector_pack && ncols == 32 && (forms.wide || forms.narrow))
      k_done = detail::fp8_pack_panel_avx512(src, K, forms.wide ? p.wide.data() + pn * Kp * 32 : nullptr,
                                             forms.narrow ? p.fp8.data() + pn * Kp * 32 : nullptr);
    for (int64_t k = k_done; k < K && (forms.wide || forms.narrow); ++k) {
      const int64_t i = pn * Kp / 2 + k / 2;  // pair step
      const int h = static_cast<int>(k & 1);
      for (int64_t j = 0; j < ncols; ++j) {
        const uint8_t c = src[j * K + k];
        if (forms.wide) p.wide[(pn * Kp + k) * 32 + j] = lut[c];
        if (forms.narrow) p.fp8[i * 64 + pos[j][h]] = c;
      }
    }
    if (forms.narrow && vector_pack)  // rare-code bits per pair step
      detail::fp8_rare_steps_avx512(p.fp8.data() + pn * Kp / 2 * 64, Kp / 2, p.fp8_rare.data() + pn * KB);
    for (int64_t i = 0; forms.narrow && !vector_pack && i < Kp / 2; ++i) {
      const uint8_t* step = p.fp8.data() + (pn * Kp / 2 + i) * 64;
      if (std::any_of(step, step + 64, detail::fp8_code_rare)) p.fp8_rare[pn * KB + i / 64] |= uint64_t{1} << (i % 64);
    }
    avector_uninit<uint16_t> cols(forms.tiles ? static_cast<size_t>(32 * Kp) : 0);  // [32][Kp] BF16 values
    for (int64_t j = 0; j < ncols; ++j) {
      uint16_t* col = cols.data() + j * Kp;
      const int64_t n = pn * 32 + j;
      for (int64_t kb = 0; kb < KB; ++kb) p.scale_inv[(pn * KB + kb) * 32 + j] = B.scale_at(n, kb);
      if (!forms.tiles) continue;
      detail::e4m3_to_bf16_avx512(src + j * K, K, col);  // tiles imply AMX, hence AVX-512
      std::fill(col + K, col + Kp, uint16_t{0});
      if (fold)  // q * 2^e is exact in BF16 (while normal: quant/gemm.hpp)
        for (int64_t kb = 0; kb < KB; ++kb)
          detail::tiles_scale_row(col + kb * kBlock, std::min(kBlock, K - kb * kBlock), p.scale_inv[(pn * KB + kb) * 32 + j]);
    }
    if (forms.tiles) {
      std::fill(cols.begin() + ncols * Kp, cols.end(), uint16_t{0});  // columns past N
      detail::tiles_put_panel(p.tiles.data() + pn * Kp * 32, Kp, cols.data());
    }
  });
  if (forms.narrow) {
    pack_rare_steps(p);
    pack_panel_scales(p);
  }
  if (forms.narrow && forms.decoded && vector_pack) {
    p.bf16.resize(static_cast<size_t>(NP * Kp * 32));  // every word written
    detail::fp8_decode_pack_avx512(p);
  }
  return p;
}

namespace {
// The header of wgrad's X^T (x [T][C], 1x128 columnwise) as an FP8 B: N = C, K = T, and the
// scales [NP][Kp/128][32] sized for the quantizer to fill.
gemm_packed_b colwise_b_header(int64_t T, int64_t C, scale_mode mode, std::string name) {
  gemm_desc{0, C, T}.check();
  gemm_packed_b p;
  p.dtype = gemm_dtype::fp8;
  p.mode = mode;
  p.name = std::move(name);
  p.N = C;
  p.K = T;
  p.Kp = round_up(T, kBlock);
  p.Kt = p.Kp;
  p.scale_inv.resize(static_cast<size_t>(p.panels() * p.Kp / kBlock * 32));
  return p;
}
}  // namespace

gemm_packed_b gemm_pack_fp8_colwise_tiles(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name) {
  if (cpu_isa_active() < cpu_isa::amx)
    throw std::runtime_error("gemm_pack_fp8_colwise_tiles: the tile form needs AMX (tensor '" + name + "')");
  gemm_packed_b p = colwise_b_header(T, C, mode, std::move(name));
  const int64_t NP = p.panels();
  p.tiles.resize(static_cast<size_t>(NP * p.Kt * 32));  // every element written below
  int64_t col = 0, block = 0, count = 0;
  if (!detail::quantize_colwise_tiles_avx512(x, T, C, mode, mode == scale_mode::pow2, p.Kt, p.tiles.data(),
                                              p.scale_inv.data(), &col, &block, &count))
    detail::throw_nonfinite(p.name, qlayout::colwise_1x128, col, block, count);
  return p;
}

gemm_packed_b gemm_pack_fp8_colwise_wide(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name) {
  if (cpu_isa_active() < cpu_isa::avx512)  // the portable path: quantize, then pack the codes
    return gemm_pack_fp8(quantize(x, T, C, qlayout::colwise_1x128, mode, std::move(name)), {true, false, false});
  gemm_packed_b p = colwise_b_header(T, C, mode, std::move(name));
  p.wide.resize(static_cast<size_t>(p.panels() * p.Kp * 32));  // every element written below
  int64_t col = 0, block = 0, count = 0;
  if (!detail::quantize_colwise_wide_avx512(x, T, C, mode, p.Kp, p.wide.data(), p.scale_inv.data(), &col, &block, &count))
    detail::throw_nonfinite(p.name, qlayout::colwise_1x128, col, block, count);
  return p;
}

void gemm_pack_fp8_blocks_tiles(const float* w, int64_t N, int64_t K, scale_mode mode, const std::string& name,
                                gemm_packed_b* fwd, gemm_packed_b* bwd) {
  gemm_desc{0, N, K}.check();
  if (cpu_isa_active() < cpu_isa::amx)
    throw std::runtime_error("gemm_pack_fp8_blocks_tiles: the tile form needs AMX (tensor '" + name + "')");
  auto shape = [&](gemm_packed_b& p, std::string pname, int64_t n, int64_t k) {
    p = gemm_packed_b{};
    p.dtype = gemm_dtype::fp8;
    p.mode = mode;
    p.name = std::move(pname);
    p.N = n, p.K = k, p.Kp = round_up(k, kBlock), p.Kt = p.Kp;
    p.tiles.resize(static_cast<size_t>(p.panels() * p.Kt * 32));  // every element written
    p.scale_inv.resize(static_cast<size_t>(p.panels() * p.Kt / kBlock * 32));
  };
  if (fwd) shape(*fwd, name, N, K);
  if (bwd) shape(*bwd, name + ".T", K, N);
  int64_t rb = 0, cb = 0, count = 0;
  if (!detail::quantize_blocks_tiles_avx512(w, N, K, mode, mode == scale_mode::pow2, fwd ? fwd->tiles.data() : nullptr,
                                             fwd ? fwd->scale_inv.data() : nullptr, bwd ? bwd->tiles.data() : nullptr,
                                             bwd ? bwd->scale_inv.data() : nullptr, &rb, &cb, &count))
    detail::throw_nonfinite(name, qlayout::block_128x128, rb, cb, count);
}

}  // namespace fp8rl::quant
