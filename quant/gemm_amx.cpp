// quant/gemm_amx.cpp -- the AMX tile kernel behind gemm_{bf16,fp8}_tiles (model: quant/gemm.hpp).
//
// Register blocking: a 32x32 C block in four 16x16 FP32 tiles (0-3), two A tiles (4-5: 16 rows x
// 32 BF16) and two B tiles (6-7: 16 k-pairs x 16 columns x 2). One k-step (32 K) is four
// TDPBF16PS. A is packed in tile order, so every tile load reads 1 KiB of consecutive memory
// (row-major A with a 4 KiB stride maps all 16 rows to one L1 set).
// Cache blocking: 64-row chunks of A against each 32-column panel of B; measured on a 2-core
// Xeon with AMX at 2048^3, packed A + 64-row chunks reached 1.1 TFLOP/s vs 0.8 row-major.
// Built with -mamx-tile -mamx-bf16 (quant/CMakeLists.txt); called only when cpu_isa >= amx.
#include <immintrin.h>
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "quant/fp8_avx512.hpp"
#include "quant/gemm_impl.hpp"

namespace fp8rl::quant::detail {
namespace {

struct alignas(64) tile_config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile state is per thread: every task loads the configuration (all eight tiles 16 x 64 B).
void tiles_configure() {
  tile_config c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// Adds the four tiles' partial sums into acc [32][32]: the first block stores, later blocks
// promote with out = fma(sa[m][kb] * sb[n][kb], part, out) (the fp8 fp32-scale model).
void tiles_accumulate(const tiles_problem& p, int64_t m0, int64_t pn, int64_t kb, float (*acc)[32]) {
  alignas(64) float part[4][16][16];
  _tile_stored(0, part[0], 64);
  _tile_stored(1, part[1], 64);
  _tile_stored(2, part[2], 64);
  _tile_stored(3, part[3], 64);
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 16; ++r) {
      const int row = (t >> 1) * 16 + r, col = (t & 1) * 16;
      __m512 v = _mm512_load_ps(part[t][r]);
      if (p.sa) {
        const __m512 sb = _mm512_loadu_ps(p.b->scale_inv.data() + (pn * p.KB + kb) * 32 + col);
        const __m512 s = _mm512_mul_ps(_mm512_set1_ps(p.sa[(m0 + row) * p.KB + kb]), sb);
        v = kb == 0 ? _mm512_mul_ps(s, v) : _mm512_fmadd_ps(s, v, _mm512_loadu_ps(acc[row] + col));
      }
      _mm512_storeu_ps(acc[row] + col, v);
    }
}

// Tile loads wait on L2 unless their lines are requested ahead: prefetching the A and B tiles of
// the k-step two ahead (64 lines per step) took bench-gemm's fp8_tiles from 1378-1736 to
// 1880-2302 GF/s on the training/prefill shapes (4 steps ahead measured the same). Prefetches
// past the end of a panel touch nothing (they never fault).
constexpr int64_t kPrefetchSteps = 2;

// C rows m0..m0+31 (clipped to M), columns of panel pn (clipped to N).
void tiles_block(const tiles_problem& p, int64_t m0, int64_t pn, float* C) {
  const int64_t KS = p.KS, kspb = p.sa ? kBlock / 32 : KS, blocks = p.sa ? p.KB : 1;
  const uint16_t* a0 = p.a + (m0 / 16) * KS * 512;
  const uint16_t* a1 = a0 + KS * 512;
  const uint16_t* b = p.b->tiles.data() + pn * KS * 1024;
  const bool full = m0 + 32 <= p.M && pn * 32 + 32 <= p.N;
  alignas(64) float acc[32][32];
  for (int64_t kb = 0; kb < blocks; ++kb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = kb * kspb; ks < std::min(KS, (kb + 1) * kspb); ++ks) {
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(a0 + (ks + kPrefetchSteps) * 512) + 64 * l, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a1 + (ks + kPrefetchSteps) * 512) + 64 * l, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b + (ks + kPrefetchSteps) * 1024) + 64 * l, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b + (ks + kPrefetchSteps) * 1024 + 512) + 64 * l, _MM_HINT_T0);
      }
      _tile_loadd(4, a0 + ks * 512, 64);
      _tile_loadd(5, a1 + ks * 512, 64);
      _tile_loadd(6, b + ks * 1024, 64);
      _tile_loadd(7, b + ks * 1024 + 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (!p.sa && full && p.accumulate) {  // C += the four tiles
      alignas(64) float part[4][16][16];
      _tile_stored(0, part[0], 64);
      _tile_stored(1, part[1], 64);
      _tile_stored(2, part[2], 64);
      _tile_stored(3, part[3], 64);
      for (int r = 0; r < 32; ++r) {
        float* c = C + (m0 + r) * p.N + pn * 32;
        const int t = (r >> 4) * 2;
        _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), _mm512_load_ps(part[t][r & 15])));
        _mm512_storeu_ps(c + 16, _mm512_add_ps(_mm512_loadu_ps(c + 16), _mm512_load_ps(part[t + 1][r & 15])));
      }
      return;
    }
    if (!p.sa && full) {  // straight into C
      float* c = C + m0 * p.N + pn * 32;
      const int64_t ld = p.N * 4;
      _tile_stored(0, c, ld);
      _tile_stored(1, c + 16, ld);
      _tile_stored(2, c + 16 * p.N, ld);
      _tile_stored(3, c + 16 * p.N + 16, ld);
      return;
    }
    tiles_accumulate(p, m0, pn, kb, acc);
  }
  const int64_t rows = std::min<int64_t>(32, p.M - m0), cols = std::min<int64_t>(32, p.N - pn * 32);
  if (p.accumulate) {
    for (int64_t r = 0; r < rows; ++r) {
      float* c = C + (m0 + r) * p.N + pn * 32;
      for (int64_t h = 0; h < cols; h += 16) {
        const __mmask16 k = cols - h >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (cols - h)) - 1u);
        _mm512_mask_storeu_ps(c + h, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, c + h), _mm512_loadu_ps(acc[r] + h)));
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(C + (m0 + r) * p.N + pn * 32, acc[r], static_cast<size_t>(cols) * 4);
}

void tiles_range(const tiles_problem& p, int64_t mb0, int64_t mb1, int64_t p0, int64_t p1, float* C) {
  tiles_configure();
  constexpr int64_t kChunk = 2;  // 32-row blocks per A chunk (64 rows)
  for (int64_t mc = mb0; mc < mb1; mc += kChunk)
    for (int64_t pn = p0; pn < p1; ++pn)
      for (int64_t mb = mc; mb < std::min(mb1, mc + kChunk); ++mb) tiles_block(p, mb * 32, pn, C);
  _tile_release();
}

}  // namespace

void gemm_tiles_amx(const tiles_problem& p, float* C) {
  const int64_t MB = p.Mp / 32, NP = p.b->panels();
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, MB, 2, 0, NP, 4), [&](const tbb::blocked_range2d<int64_t>& r) {
    tiles_range(p, r.rows().begin(), r.rows().end(), r.cols().begin(), r.cols().end(), C);
  });
}

void tiles_put_panel(uint16_t* panel, int64_t Kt, const uint16_t* cols) {
  const int64_t KS = Kt / 32, P = Kt / 2;  // k-steps; pairs per column
  for (int64_t ks = 0; ks < KS; ++ks)
    for (int64_t h = 0; h < 2; ++h) {
      __m512i r[16];  // r[c]: the 16 pairs of column h*16+c in this k-step
      for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_si512(cols + ((h * 16 + c) * P + ks * 16) * 2);
      transpose_16x16_u32(r);  // r[pp]: pair pp of the 16 columns
      for (int pp = 0; pp < 16; ++pp) _mm512_storeu_si512(panel + (((ks * 2 + h) * 16 + pp) * 16) * 2, r[pp]);
    }
}

void tiles_scale_row(uint16_t* row, int64_t n, float s) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i))), 16);
    w = _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(w), vs)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i), _mm512_cvtepi32_epi16(w));
  }
  for (; i < n; ++i) {
    uint32_t u = uint32_t{row[i]} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    f *= s;
    std::memcpy(&u, &f, 4);
    row[i] = static_cast<uint16_t>(u >> 16);
  }
}

void tiles_put_row(uint16_t* tiles, int64_t KS, int64_t m, const uint16_t* src, int64_t n) {
  uint16_t* base = tiles + (m / 16) * KS * 512 + (m % 16) * 32;
  for (int64_t ks = 0; ks < KS; ++ks) {  // every 64-byte step of the row, zero past n
    const int64_t w = std::clamp<int64_t>(n - ks * 32, 0, 32);
    if (w == 0) {
      _mm512_storeu_si512(base + ks * 512, _mm512_setzero_si512());
      continue;
    }
    const __mmask32 k = w == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << w) - 1u);
    _mm512_storeu_si512(base + ks * 512, _mm512_maskz_loadu_epi16(k, src + ks * 32));
  }
}

}  // namespace fp8rl::quant::detail
