// quant/quantize_avx512.cpp -- AVX-512 blockwise quantizer, oneTBB across rows.
// Bit-identical to quantize_scalar (tests/quant/quantize_test.cpp). Compiled with -mavx512*.
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "quant/aligned.hpp"
#include "quant/fp8.hpp"
#include "quant/fp8_avx512.hpp"
#include "quant/gemm_impl.hpp"
#include "quant/quantize_impl.hpp"
#include "quant/scale.hpp"

namespace fp8rl::quant::detail {
namespace {

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// Lowest (block_row, block_col) holding non-finite values, found by parallel tasks.
struct first_bad {
  std::mutex mu;
  bool any = false;
  int64_t br = 0, bc = 0, count = 0;
  void report(int64_t r, int64_t c, int64_t n) {
    std::lock_guard<std::mutex> g(mu);
    if (!any || r < br || (r == br && c < bc)) { any = true; br = r; bc = c; count = n; }
  }
};

// amax over a [nr x nk] region with row stride ld, as the maximum of |x|'s bits: non-negative
// floats order as their bits do and NaN/Inf lie above every finite value, so one integer max
// per vector finds both (the per-vector NaN/Inf count cost 2.5x the pass on Zen 5). Returns
// false, the number of NaN/Inf in *bad (a second pass, taken only then), if the region holds any.
// prefetch_ahead (floats, 0: none): each line's prefetch of x + that, in the same loop (a
// separate prefetch loop per row cost the rowwise quantizer 20% on Zen 5).
inline bool region_amax(const float* x, int64_t ld, int64_t nr, int64_t nk, float* amax,
                        int* bad, int64_t prefetch_ahead = 0) {
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t r = 0; r < nr; ++r) {
    const float* xr = x + r * ld;
    int64_t k = 0;
    for (; k + 16 <= nk; k += 16) {
      if (prefetch_ahead) _mm_prefetch(reinterpret_cast<const char*>(xr + k + prefetch_ahead), _MM_HINT_T0);
      acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_loadu_si512(xr + k), abs_bits));
    }
    if (k < nk) acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail_mask(nk - k), xr + k), abs_bits));
  }
  const uint32_t top = _mm512_reduce_max_epu32(acc);
  *bad = 0;
  if (top < 0x7f800000u) {
    std::memcpy(amax, &top, sizeof top);
    return true;
  }
  __m512 ignored = _mm512_setzero_ps();
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t k = 0; k < nk; k += 16) {
      const __mmask16 m = tail_mask(nk - k);
      ignored = abs_max_acc(ignored, _mm512_maskz_loadu_ps(m, x + r * ld + k), m, bad);
    }
  *amax = 0.0f;
  return false;
}

inline void encode_row(const float* x, int64_t nk, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t k = 0;
  for (; k + 16 <= nk; k += 16)  // narrow in a register, then a plain store
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(e4m3_encode16(_mm512_mul_ps(_mm512_loadu_ps(x + k), s))));
  if (k < nk) {
    const __mmask16 m = tail_mask(nk - k);
    _mm_mask_storeu_epi8(out + k, m, _mm512_cvtepi32_epi8(e4m3_encode16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), s))));
  }
}

// Three passes per row -- amax of every tile, scales, then encoding -- so the encoder's vector
// constants stay in registers (a scale_from_amax call between tiles clobbers them all). The
// amax pass is the DRAM stream: it prefetches the row kPrefetchRows ahead.
constexpr int64_t kPrefetchRows = 4;

// Passes 1 and 2 for row r (xr, K values): scale[kb] and its inverse into
// scale_inv[kb * inv_stride]; false (the bad tiles reported) when a tile holds NaN/Inf.
struct row_scales {
  std::vector<float> amax, scale;
  std::vector<int> bad;
  explicit row_scales(int64_t KB) : amax(static_cast<size_t>(KB)), scale(static_cast<size_t>(KB)), bad(static_cast<size_t>(KB)) {}
  bool compute(const float* xr, int64_t K, int64_t r, scale_mode mode, first_bad& fb, float* scale_inv,
               int64_t inv_stride) {
    const int64_t KB = static_cast<int64_t>(amax.size());
    bool ok = true;
    for (int64_t kb = 0; kb < KB; ++kb)
      ok &= region_amax(xr + kb * kBlock, K, 1, std::clamp<int64_t>(K - kb * kBlock, 0, kBlock), &amax[kb], &bad[kb],
                        kPrefetchRows * K);
    if (!ok) {
      for (int64_t kb = 0; kb < KB; ++kb)
        if (bad[kb]) fb.report(r, kb, bad[kb]);
      return false;
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      const block_scale s = scale_from_amax(amax[kb], mode);
      scale[kb] = s.scale;
      scale_inv[kb * inv_stride] = s.scale_inv;
    }
    return true;
  }
};

void quantize_rows(const float* x, qtensor& q, first_bad& fb) {
  const int64_t R = q.rows, K = q.cols, ld = q.scale_ld(), KB = q.k_blocks();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, R, 16), [&](const auto& rr) {
    row_scales rs(KB);
    for (int64_t r = rr.begin(); r < rr.end(); ++r) {
      const float* xr = x + r * K;
      if (!rs.compute(xr, K, r, q.mode, fb, q.scale_inv.data() + r, ld)) continue;
      for (int64_t kb = 0; kb < KB; ++kb)
        encode_row(xr + kb * kBlock, std::min(kBlock, K - kb * kBlock), rs.scale[kb], q.data.data() + r * K + kb * kBlock);
    }
  });
}

void quantize_blocks(const float* x, qtensor& q, first_bad& fb) {
  const int64_t R = q.rows, K = q.cols, ld = q.scale_ld();
  const int64_t RB = (R + kBlock - 1) / kBlock, KB = q.k_blocks();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, RB * KB), [&](const auto& br) {
    for (int64_t b = br.begin(); b < br.end(); ++b) {
      const int64_t rb = b / KB, kb = b % KB;
      const int64_t r0 = rb * kBlock, k0 = kb * kBlock;
      const int64_t nr = std::min(kBlock, R - r0), nk = std::min(kBlock, K - k0);
      float amax;
      int bad;
      if (!region_amax(x + r0 * K + k0, K, nr, nk, &amax, &bad)) { fb.report(rb, kb, bad); continue; }
      block_scale s = scale_from_amax(amax, q.mode);
      for (int64_t r = r0; r < r0 + nr; ++r)
        encode_row(x + r * K + k0, nk, s.scale, q.data.data() + r * K + k0);
      q.scale_inv[rb * ld + kb] = s.scale_inv;
    }
  });
}

// Columnwise: operand row c = source column c, tiles of 128 source rows. A task takes 128 rows x
// 64 columns: the amax pass reads each row's 256-byte run (prefetch-friendly runs instead of one
// line per row; 128 and 256 columns measured the same), then per 16 columns the codes of 16
// rows are transposed in registers and stored as 16-byte runs of each column.
constexpr int64_t kColGroups = 4;  // 16-column groups per task

void quantize_cols(const float* x, qtensor& q, first_bad& fb) {
  const int64_t rows = q.rows, cols = q.cols, ld = q.scale_ld();
  const int64_t CG = (cols + 16 * kColGroups - 1) / (16 * kColGroups), TB = q.k_blocks();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, CG * TB), [&](const auto& br) {
    alignas(64) uint8_t tmp[16][16];  // codes of the last < 16 rows
    for (int64_t g = br.begin(); g < br.end(); ++g) {
      const int64_t tb = g / CG, cg0 = (g % CG) * 16 * kColGroups;  // row-block major: neighbouring tasks share pages
      const int64_t r0 = tb * kBlock, nr = std::min(kBlock, rows - r0);
      const int64_t ng = std::min<int64_t>(kColGroups, (cols - cg0 + 15) / 16);
      __mmask16 m[kColGroups];
      __m512i acc[kColGroups];  // per column: the largest |x| bits (NaN/Inf above all finite; see region_amax)
      for (int64_t h = 0; h < kColGroups; ++h) {
        m[h] = h < ng ? tail_mask(cols - cg0 - 16 * h) : 0;
        acc[h] = _mm512_setzero_si512();
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t h = 0; h < ng; ++h)
          acc[h] = _mm512_max_epu32(acc[h], _mm512_and_si512(_mm512_maskz_loadu_epi32(m[h], x + (r0 + r) * cols + cg0 + 16 * h),
                                                             _mm512_set1_epi32(0x7fffffff)));
      for (int64_t h = 0; h < ng; ++h) {
        const int64_t c0 = cg0 + 16 * h, nc = std::min<int64_t>(16, cols - c0);
        alignas(64) uint32_t top16[16];
        alignas(64) float sc[16];
        _mm512_store_si512(top16, acc[h]);
        bool ok = true;
        for (int64_t j = 0; j < nc; ++j) {
          if (top16[j] >= 0x7f800000u) {  // NaN/Inf in this column's tile: count them (the error says how many)
            int64_t n = 0;
            for (int64_t r = 0; r < nr; ++r) n += !std::isfinite(x[(r0 + r) * cols + c0 + j]);
            fb.report(c0 + j, tb, n);
            ok = false;
            continue;
          }
          float amax;
          std::memcpy(&amax, &top16[j], sizeof amax);
          block_scale s = scale_from_amax(amax, q.mode);
          sc[j] = s.scale;
          q.scale_inv[tb * ld + c0 + j] = s.scale_inv;
        }
        if (!ok) continue;
        for (int64_t j = nc; j < 16; ++j) sc[j] = 1.0f;
        const __m512 s = _mm512_load_ps(sc);
        const __mmask16 mh = m[h];
        auto encode = [&](int64_t r) {
          return _mm512_cvtepi32_epi8(e4m3_encode16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mh, x + (r0 + r) * cols + c0), s)));
        };
        int64_t r = 0;
        for (; r + 16 <= nr; r += 16) {
          __m128i rowc[16], colc[16];
          for (int i = 0; i < 16; ++i) rowc[i] = encode(r + i);
          transpose_16x16_u8(rowc, colc);
          for (int64_t j = 0; j < nc; ++j)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data.data() + (c0 + j) * rows + r0 + r), colc[j]);
        }
        for (int64_t i = r; i < nr; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(&tmp[i - r][0]), encode(i));
        for (int64_t j = 0; j < nc; ++j) {
          uint8_t* dst = q.data.data() + (c0 + j) * rows + r0;
          for (int64_t i = r; i < nr; ++i) dst[i] = tmp[i - r][j];
        }
      }
    }
  });
}

}  // namespace

void transpose_bytes_avx512(const uint8_t* src, int64_t R, int64_t C, uint8_t* dst) {
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, R, 64, 0, C, 64), [&](const tbb::blocked_range2d<int64_t>& b) {
    const int64_t r0 = b.rows().begin(), r1 = b.rows().end(), c0 = b.cols().begin(), c1 = b.cols().end();
    int64_t rf = r0, cf = c0;  // [r0, rf) x [c0, cf): whole 16x16 tiles
    for (; rf + 16 <= r1; rf += 16) {
      for (cf = c0; cf + 16 <= c1; cf += 16) {
        __m128i in[16], out[16];
        for (int i = 0; i < 16; ++i) in[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (rf + i) * C + cf));
        transpose_16x16_u8(in, out);
        for (int j = 0; j < 16; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (cf + j) * R + rf), out[j]);
      }
    }
    // ragged edges: the columns past cf for the whole-tile rows, then every column of the rows past rf
    for (int64_t c = cf; c < c1; ++c)
      for (int64_t r = r0; r < rf; ++r) dst[c * R + r] = src[r * C + c];
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = rf; r < r1; ++r) dst[c * R + r] = src[r * C + c];
  });
}

void bf16_from_float_avx512(const float* x, int64_t n, uint16_t* out) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14), [&](const auto& r) {
    int64_t i = r.begin();
    for (; i + 16 <= r.end(); i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_encode16(_mm512_loadu_si512(x + i)));
    for (; i < r.end(); ++i) out[i] = bf16_from_float(x[i]);
  });
}

void bf16_from_float_transposed_avx512(const float* x, int64_t R, int64_t C, uint16_t* out) {
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, R, 64, 0, C, 64), [&](const tbb::blocked_range2d<int64_t>& b) {
    const int64_t r0 = b.rows().begin(), r1 = b.rows().end(), c0 = b.cols().begin(), c1 = b.cols().end();
    int64_t rf = r0, cf = c0;  // [r0, rf) x [c0, cf): whole 16x16 tiles
    for (; rf + 16 <= r1; rf += 16)
      for (cf = c0; cf + 16 <= c1; cf += 16) {
        __m512i v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(x + (rf + i) * C + cf);
        transpose_16x16_u32(v);  // v[j]: column cf + j of rows rf..rf+15
        for (int j = 0; j < 16; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (cf + j) * R + rf), bf16_encode16(v[j]));
      }
    for (int64_t c = cf; c < c1; ++c)
      for (int64_t r = r0; r < rf; ++r) out[c * R + r] = bf16_from_float(x[r * C + c]);
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = rf; r < r1; ++r) out[c * R + r] = bf16_from_float(x[r * C + c]);
  });
}

void e4m3_grid_array_avx512(const float* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, e4m3_grid16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, e4m3_grid16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

// One task: a token block (128 tokens, 4 k-steps) x up to 8 panels (256 columns). The amax pass
// streams the block's rows (256 contiguous floats each; a pass per 16 columns would stride C
// floats per row, which prefetchers follow badly and which maps to few L1 sets); the value pass
// then reads each 16-column group from L2 (128 KiB per task) and writes every tile row (16
// columns x a token pair) as one vector: (BF16 of token t+1) << 16 | BF16 of token t.
constexpr int64_t kPanelsPerTask = 8;

// Where colwise_quantize puts the values. tiles_b: the tile B order above. tiles_a: the tile A
// order (rows = columns of x, wgrad's dY^T): per k-step the 16 pair vectors are transposed in
// registers into the 16 rows' 64-byte tile rows; scales to scale_inv [Mp][KB] (fp32 mode) or
// nowhere (null). wide_b: FP32 E4M3 values (unscaled) as gemm_pack_fp8's wide panels
// [NP][Kt][32], scales [NP][KB][32]. wide_a: FP32 values (unscaled) as the wide kernel's A rows
// [C rounded to 32][Kt] (16x16 register transposes), scales [C rounded to 32][KB].
enum class col_out { tiles_b, tiles_a, wide_b, wide_a };

template <col_out kOut>
bool colwise_quantize(const float* x, int64_t T, int64_t C, scale_mode mode, bool fold, int64_t Kt, void* out,
                      float* scale_inv, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count) {
  constexpr bool kAOrder = kOut == col_out::tiles_a || kOut == col_out::wide_a;
  constexpr bool kWide = kOut == col_out::wide_a || kOut == col_out::wide_b;
  if constexpr (kWide) fold = false;  // wide values are stored unscaled
  uint16_t* const tiles = kWide ? nullptr : static_cast<uint16_t*>(out);
  float* const wide = kWide ? static_cast<float*>(out) : nullptr;
  const int64_t NP = (C + 31) / 32, KB = Kt / kBlock, NPT = (NP + kPanelsPerTask - 1) / kPanelsPerTask;
  constexpr int64_t kGroups = 2 * kPanelsPerTask;  // 16-column groups per task
  first_bad fb;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, KB * NPT), [&](const auto& br) {
    for (int64_t task = br.begin(); task < br.end(); ++task) {
      const int64_t tb = task / NPT, p0 = (task % NPT) * kPanelsPerTask, t0 = tb * kBlock;
      const int64_t nt = std::clamp<int64_t>(T - t0, 0, kBlock), cbase = p0 * 32;
      const int64_t ngrp = std::min<int64_t>(kGroups, 2 * (NP - p0));  // groups of whole panels (padding included)
      __mmask16 m[kGroups];
      __m512 acc[kGroups];
      __m512i nbad[kGroups];
      for (int64_t q = 0; q < kGroups; ++q) {
        const int64_t nc = std::clamp<int64_t>(C - cbase - 16 * q, 0, 16);
        m[q] = nc > 0 ? tail_mask(nc) : static_cast<__mmask16>(0);
        acc[q] = _mm512_setzero_ps();
        nbad[q] = _mm512_setzero_si512();
      }
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t q = 0; q < ngrp; ++q) {
          const __m512i a = _mm512_and_si512(
              _mm512_castps_si512(_mm512_maskz_loadu_ps(m[q], x + (t0 + t) * C + cbase + 16 * q)),
              _mm512_set1_epi32(0x7fffffff));
          const __mmask16 b = _mm512_mask_cmpge_epu32_mask(m[q], a, _mm512_set1_epi32(0x7f800000));
          nbad[q] = _mm512_mask_add_epi32(nbad[q], b, nbad[q], _mm512_set1_epi32(1));
          acc[q] = _mm512_mask_max_ps(acc[q], m[q] & static_cast<__mmask16>(~b), acc[q], _mm512_castsi512_ps(a));
        }
      for (int64_t q = 0; q < ngrp; ++q) {
        const int64_t pn = p0 + q / 2, h = q % 2, c0 = cbase + 16 * q, nc = std::clamp<int64_t>(C - c0, 0, 16);
        uint16_t* panel = kWide ? nullptr : tiles + pn * Kt * 32;
        auto put_scale = [&](int64_t j, float v) {  // B order [NP][KB][32]; A order [Mp][KB] (null: folded)
          if constexpr (!kAOrder) scale_inv[(pn * KB + tb) * 32 + h * 16 + j] = v;
          else if (scale_inv) scale_inv[(c0 + j) * KB + tb] = v;
        };
        alignas(64) float amax[16], sc[16], si[16];
        alignas(64) int32_t bad[16];
        _mm512_store_ps(amax, acc[q]);
        _mm512_store_si512(bad, nbad[q]);
        bool ok = true;
        for (int64_t j = 0; j < 16; ++j) {
          sc[j] = 1.0f, si[j] = 1.0f;
          if (j >= nc) { put_scale(j, 0.0f); continue; }
          if (bad[j]) { fb.report(c0 + j, tb, bad[j]); ok = false; continue; }
          const block_scale s = scale_from_amax(amax[j], mode);
          sc[j] = s.scale;
          si[j] = fold ? s.scale_inv : 1.0f;
          put_scale(j, s.scale_inv);
        }
        if (!ok) continue;
        const __m512 vs = _mm512_load_ps(sc), vf = _mm512_load_ps(si);
        const __mmask16 mq = m[q];
        auto value = [&](int64_t t) {  // token t0 + t of the 16 columns: E4M3 value (x scale_inv when fold)
          const __m512 v = _mm512_maskz_loadu_ps(t < nt ? mq : static_cast<__mmask16>(0), x + (t0 + t) * C + c0);
          return _mm512_mul_ps(e4m3_grid16(_mm512_mul_ps(v, vs)), vf);
        };
        if constexpr (kOut == col_out::wide_b) {
          float* dst = wide + (pn * Kt + t0) * 32 + h * 16;
          for (int64_t t = 0; t < kBlock; ++t) _mm512_store_ps(dst + t * 32, value(t));
          continue;
        } else if constexpr (kOut == col_out::wide_a) {
          for (int64_t t16 = 0; t16 < kBlock; t16 += 16) {
            __m512i v[16];
            for (int64_t i = 0; i < 16; ++i) v[i] = _mm512_castps_si512(value(t16 + i));
            transpose_16x16_u32(v);  // v[j]: the 16 tokens of column c0 + j
            for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(wide + (c0 + j) * Kt + t0 + t16, v[j]);
          }
          continue;
        }
        for (int64_t ks = 0; ks < kBlock / 32; ++ks) {
          __m512i pairs[16];
          for (int64_t pp = 0; pp < 16; ++pp) {
            const int64_t t = ks * 32 + 2 * pp;
            pairs[pp] = bf16_pairs16(value(t), value(t + 1));
            if constexpr (!kAOrder) _mm512_storeu_si512(panel + ((((tb * 4 + ks) * 2 + h) * 16 + pp) * 16) * 2, pairs[pp]);
          }
          if constexpr (kAOrder) {
            transpose_16x16_u32(pairs);  // pairs[j]: the 32 tokens of column c0 + j
            uint16_t* a = tiles + (c0 / 16) * (Kt / 32) * 512 + (tb * 4 + ks) * 512;
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(a + j * 32, pairs[j]);
          }
        }
      }
    }
  });
  if (fb.any) *bad_col = fb.br, *bad_block = fb.bc, *bad_count = fb.count;
  return !fb.any;
}

bool quantize_colwise_tiles_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, bool fold, int64_t Kt,
                                   uint16_t* tiles, float* scale_inv, int64_t* bad_col, int64_t* bad_block,
                                   int64_t* bad_count) {
  return colwise_quantize<col_out::tiles_b>(x, T, C, mode, fold, Kt, tiles, scale_inv, bad_col, bad_block, bad_count);
}

bool quantize_colwise_tiles_a_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, bool fold, int64_t Kt,
                                     uint16_t* a, float* sa, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count) {
  return colwise_quantize<col_out::tiles_a>(x, T, C, mode, fold, Kt, a, sa, bad_col, bad_block, bad_count);
}

bool quantize_colwise_wide_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, int64_t Kp, float* wide,
                                  float* scale_inv, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count) {
  return colwise_quantize<col_out::wide_b>(x, T, C, mode, false, Kp, wide, scale_inv, bad_col, bad_block, bad_count);
}

bool quantize_colwise_wide_a_avx512(const float* x, int64_t T, int64_t C, scale_mode mode, int64_t Kp, float* a,
                                    float* sa, int64_t* bad_col, int64_t* bad_block, int64_t* bad_count) {
  return colwise_quantize<col_out::wide_a>(x, T, C, mode, false, Kp, a, sa, bad_col, bad_block, bad_count);
}

bool quantize_blocks_tiles_avx512(const float* w, int64_t N, int64_t K, scale_mode mode, bool fold, uint16_t* fwd_tiles,
                                  float* fwd_scale_inv, uint16_t* bwd_tiles, float* bwd_scale_inv, int64_t* bad_rb,
                                  int64_t* bad_cb, int64_t* bad_count) {
  const int64_t RB = (N + kBlock - 1) / kBlock, CB = (K + kBlock - 1) / kBlock;
  // 1. block scales (scale and what the tiles multiply by: scale_inv when fold, else 1)
  std::vector<float> sc(static_cast<size_t>(RB * CB)), si(sc.size()), sf(sc.size());
  first_bad fb;
  tbb::parallel_for(int64_t{0}, RB * CB, [&](int64_t b) {
    const int64_t rb = b / CB, cb = b % CB, r0 = rb * kBlock, k0 = cb * kBlock;
    float amax;
    int bad;
    if (!region_amax(w + r0 * K + k0, K, std::min(kBlock, N - r0), std::min(kBlock, K - k0), &amax, &bad)) {
      fb.report(rb, cb, bad);
      return;
    }
    const block_scale s = scale_from_amax(amax, mode);
    sc[b] = s.scale, si[b] = s.scale_inv, sf[b] = fold ? s.scale_inv : 1.0f;
  });
  if (fb.any) {
    *bad_rb = fb.br, *bad_cb = fb.bc, *bad_count = fb.count;
    return false;
  }
  // E4M3 value (times scale_inv when fold) of w[r][c0..c0+15] (masked to K, zero past N), as floats
  auto value16 = [&](int64_t r, int64_t c0) {
    const __mmask16 m = r < N && c0 < K ? tail_mask(K - c0) : static_cast<__mmask16>(0);
    const int64_t b = (std::min(r, N - 1) / kBlock) * CB + std::min(c0, K - 1) / kBlock;
    return _mm512_mul_ps(e4m3_grid16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + r * K + c0), _mm512_set1_ps(sc[b]))),
                         _mm512_set1_ps(sf[b]));
  };
  // 2. fwd: B = W, panels of 32 rows; each row's BF16 values into a [32][Kp] column buffer, then
  //    tiles_put_panel
  const int64_t Kp = CB * kBlock, Np = RB * kBlock;
  if (fwd_tiles)
    tbb::parallel_for(int64_t{0}, (N + 31) / 32, [&](int64_t pn) {
      avector_uninit<uint16_t> cols(static_cast<size_t>(32 * Kp));
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t n = pn * 32 + j;
        for (int64_t k = 0; k < Kp; k += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(cols.data() + j * Kp + k), bf16_exact16(value16(n, k)));
        for (int64_t kb = 0; kb < CB; ++kb)
          fwd_scale_inv[(pn * CB + kb) * 32 + j] = n < N ? si[(n / kBlock) * CB + kb] : 0.0f;
      }
      tiles_put_panel(fwd_tiles + pn * Kp * 32, Kp, cols.data());
    });
  // 3. bwd: B = W^T, panels of 32 columns of W; k-pairs are pairs of W's rows, so each tile row
  //    (16 columns x rows t, t+1) is one vector: (BF16 of row t+1) << 16 | BF16 of row t
  //    Tasks of 64 rows x 8 panels: each row pair's 1 KiB runs are read contiguously.
  if (bwd_tiles) {
    const int64_t NPb = (K + 31) / 32, PT = (NPb + 7) / 8;
    tbb::parallel_for(int64_t{0}, (Np / 64) * PT, [&](int64_t task) {
      const int64_t t0 = task / PT * 64, p0 = task % PT * 8, p1 = std::min(NPb, p0 + 8);
      for (int64_t t = t0; t < t0 + 64; t += 2)
        for (int64_t pn = p0; pn < p1; ++pn)
          for (int64_t h = 0; h < 2; ++h) {
            const int64_t c0 = pn * 32 + h * 16;
            const int64_t ks = t / 32, pp = (t % 32) / 2;
            _mm512_storeu_si512(bwd_tiles + pn * Np * 32 + (((ks * 2 + h) * 16 + pp) * 16) * 2,
                                bf16_pairs16(value16(t, c0), value16(t + 1, c0)));
          }
    });
    for (int64_t pn = 0; pn < NPb; ++pn)
      for (int64_t rb = 0; rb < RB; ++rb)
        for (int64_t j = 0; j < 32; ++j)
          bwd_scale_inv[(pn * RB + rb) * 32 + j] = pn * 32 + j < K ? si[rb * CB + (pn * 32 + j) / kBlock] : 0.0f;
  }
  return true;
}

// Tasks of 16 rows (one tile-row group); per row and 128-block: amax, scale, then each k-step's
// 32 values (two vectors of E4M3 values on the grid) narrowed to BF16 and stored as one 64-byte
// tile row.
bool quantize_rowwise_tiles_avx512(const float* x, int64_t M, int64_t K, scale_mode mode, bool fold, int64_t Mp,
                                   int64_t Kt, uint16_t* a, float* sa, int64_t* bad_row, int64_t* bad_block,
                                   int64_t* bad_count) {
  const int64_t KS = Kt / 32, KB = Kt / kBlock;
  first_bad fb;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, Mp / 16), [&](const auto& br) {
    for (int64_t mg = br.begin(); mg < br.end(); ++mg)
      for (int64_t m = mg * 16; m < mg * 16 + 16; ++m) {
        uint16_t* row = a + mg * KS * 512 + (m % 16) * 32;  // k-step ks at row + ks * 512
        if (m >= M) {
          for (int64_t ks = 0; ks < KS; ++ks) _mm512_storeu_si512(row + ks * 512, _mm512_setzero_si512());
          if (!fold)
            for (int64_t kb = 0; kb < KB; ++kb) sa[m * KB + kb] = 0.0f;
          continue;
        }
        const float* xr = x + m * K;
        for (int64_t kb = 0; kb < KB; ++kb) {
          const int64_t k0 = kb * kBlock, nk = std::clamp<int64_t>(K - k0, 0, kBlock);
          float amax = 0.0f;
          int bad = 0;
          if (nk > 0 && !region_amax(xr + k0, K, 1, nk, &amax, &bad)) {
            fb.report(m, kb, bad);
            continue;
          }
          const block_scale s = scale_from_amax(amax, mode);
          if (!fold) sa[m * KB + kb] = s.scale_inv;
          const __m512 vs = _mm512_set1_ps(s.scale), vf = _mm512_set1_ps(fold ? s.scale_inv : 1.0f);
          for (int64_t k = 0; k < kBlock; k += 32) {
            __m256i half[2];
            for (int i = 0; i < 2; ++i) {
              const int64_t kk = k + 16 * i;
              const __mmask16 mk = kk < nk ? tail_mask(nk - kk) : static_cast<__mmask16>(0);
              const __m512 v = _mm512_mul_ps(e4m3_grid16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + k0 + kk), vs)), vf);
              half[i] = bf16_exact16(v);
            }
            _mm512_storeu_si512(row + (k0 + k) / 32 * 512, _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1));
          }
        }
      }
  });
  if (fb.any) *bad_row = fb.br, *bad_block = fb.bc, *bad_count = fb.count;
  return !fb.any;
}

// Tasks of 16 rows; per row: amax of every 128-block, scales, then the blocks' E4M3 values as
// FP32 (unscaled; zero padding to Kp).
bool quantize_rowwise_wide_avx512(const float* x, int64_t M, int64_t K, scale_mode mode, int64_t Kp, float* a,
                                  float* sa, int64_t* bad_row, int64_t* bad_block, int64_t* bad_count) {
  const int64_t KB = Kp / kBlock;
  first_bad fb;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, M, 16), [&](const auto& rr) {
    row_scales rs(KB);
    for (int64_t r = rr.begin(); r < rr.end(); ++r) {
      const float* xr = x + r * K;
      if (!rs.compute(xr, K, r, mode, fb, sa + r * KB, 1)) continue;
      float* ar = a + r * Kp;
      for (int64_t kb = 0; kb < KB; ++kb) {
        const __m512 vs = _mm512_set1_ps(rs.scale[kb]);
        for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; k += 16) {
          const __mmask16 mk = k < K ? tail_mask(K - k) : static_cast<__mmask16>(0);
          _mm512_store_ps(ar + k, e4m3_grid16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + k), vs)));
        }
      }
    }
  });
  if (fb.any) *bad_row = fb.br, *bad_block = fb.bc, *bad_count = fb.count;
  return !fb.any;
}

void e4m3_encode_array_avx512(const float* x, int64_t n, uint8_t* out) { encode_row(x, n, 1.0f, out); }

void quantize_avx512(const float* x, int64_t rows, int64_t cols, qlayout layout,
                     scale_mode mode, qtensor& q) {
  qtensor_reset(q, rows, cols, layout, mode);
  first_bad fb;
  switch (layout) {
    case qlayout::rowwise_1x128: quantize_rows(x, q, fb); break;
    case qlayout::block_128x128: quantize_blocks(x, q, fb); break;
    case qlayout::colwise_1x128: quantize_cols(x, q, fb); break;
  }
  if (fb.any) throw_nonfinite(q.name, layout, fb.br, fb.bc, fb.count);
}

}  // namespace fp8rl::quant::detail
