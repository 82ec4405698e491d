// quant/gemm_avx512.cpp -- AVX-512 / AVX512_BF16 GEMM kernels (register-tiled, oneTBB).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vbmi.
//
// Micro-tile: MR rows of A x one 32-column panel of B (two zmm). Each output element keeps
// one accumulator and sees K in increasing order, exactly as the *_ref models: a VDPBF16PS
// lane computes acc = fma(a[2i+1]·b[2i+1], acc) then fma(a[2i]·b[2i]) (SDM pseudocode; verified
// against the model by tests/quant/gemm_test.cpp on the machine that runs the suite).
#include <immintrin.h>
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "quant/fp8.hpp"
#include "quant/gemm_impl.hpp"

namespace fp8rl::quant::detail {
namespace {

constexpr int kMR = 8;         // rows per micro-tile
constexpr int64_t kMTB = 16;   // micro-tiles per L2 block of A (128 rows)

inline __mmask16 col_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// E4M3 -> BF16 in registers: two 128-entry byte tables (high and low byte of the BF16 value
// of codes 0..127), indexed by VPERMI2B (bit 7 ignored), sign OR-ed into the high byte.
struct e4m3_bf16_tables {
  __m512i hi0, hi1, lo0, lo1;
  e4m3_bf16_tables() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; ++c) {
      uint16_t b = bf16_from_float(e4m3_to_float(static_cast<uint8_t>(c)));
      hi[c] = static_cast<uint8_t>(b >> 8);
      lo[c] = static_cast<uint8_t>(b & 0xff);
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
  }
  // 64 codes -> words of bytes {0-7,16-23,32-39,48-55} (w0) and {8-15,...,56-63} (w1)
  inline void decode(__m512i raw, __m512i* w0, __m512i* w1) const {
    __m512i h = _mm512_permutex2var_epi8(hi0, raw, hi1);
    h = _mm512_or_si512(h, _mm512_and_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80))));
    __m512i l = _mm512_permutex2var_epi8(lo0, raw, lo1);
    *w0 = _mm512_unpacklo_epi8(l, h);
    *w1 = _mm512_unpackhi_epi8(l, h);
  }
};

const e4m3_bf16_tables& tables() {
  static const e4m3_bf16_tables t;
  return t;
}

// acc[r] += A[r, 2*i0 : 2*i1] · panel pairs [i0, i1)   (BF16 panel in memory)
template <int MR>
inline void dot_bf16(const uint16_t* A, int64_t lda, const uint16_t* P, int64_t i0, int64_t i1,
                     __m512 (&acc)[MR][2]) {
  for (int64_t i = i0; i < i1; ++i) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(P + i * 64);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(P + i * 64 + 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = bcast_pair(A + r * lda + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
}

// Same, with the panel held as FP8 codes decoded in registers (GEMV / decode path).
template <int MR>
inline void dot_fp8_stream(const uint16_t* A, int64_t lda, const uint8_t* P, int64_t i0,
                           int64_t i1, const e4m3_bf16_tables& t, __m512 (&acc)[MR][2]) {
  for (int64_t i = i0; i < i1; ++i) {
    __m512i w0, w1;
    t.decode(_mm512_load_si512(P + i * 64), &w0, &w1);
    const __m512bh b0 = (__m512bh)w0, b1 = (__m512bh)w1;
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = bcast_pair(A + r * lda + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
}

template <int MR>
inline void zero(__m512 (&acc)[MR][2]) {
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
}

template <int MR>
inline void store_tile(const __m512 (&acc)[MR][2], float* C, int64_t ldc, int64_t ncols) {
  const __mmask16 m0 = col_mask(ncols), m1 = col_mask(ncols - 16);
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(C + r * ldc, m0, acc[r][0]);
    _mm512_mask_storeu_ps(C + r * ldc + 16, m1, acc[r][1]);
  }
}

// ---- f32: out = fma(a[k], b[k], out), k increasing ----
template <int MR>
void tile_f32(const float* A, int64_t K, const float* P, float* C, int64_t ldc, int64_t ncols) {
  __m512 acc[MR][2];
  zero(acc);
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_load_ps(P + k * 32), b1 = _mm512_load_ps(P + k * 32 + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  store_tile(acc, C, ldc, ncols);
}

// ---- bf16: one accumulator over all pairs ----
template <int MR>
void tile_bf16(const uint16_t* A, int64_t lda, const uint16_t* P, int64_t KH, float* C,
               int64_t ldc, int64_t ncols) {
  __m512 acc[MR][2];
  zero(acc);
  dot_bf16<MR>(A, lda, P, 0, KH, acc);
  store_tile(acc, C, ldc, ncols);
}

// ---- fp8: per 128-K block acc, then out = fma(sa*sb, acc, out) ----
template <int MR, bool kStream>
void tile_fp8(const uint16_t* A, int64_t lda, const float* sa, int64_t KB, const void* P,
              const float* sb, float* C, int64_t ldc, int64_t ncols) {
  alignas(64) float out[MR][32];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 32; ++j) out[r][j] = 0.0f;
  const e4m3_bf16_tables& t = tables();
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m512 acc[MR][2];
    zero(acc);
    if constexpr (kStream)
      dot_fp8_stream<MR>(A, lda, static_cast<const uint8_t*>(P), kb * 64, kb * 64 + 64, t, acc);
    else
      dot_bf16<MR>(A, lda, static_cast<const uint16_t*>(P), kb * 64, kb * 64 + 64, acc);
    const __m512 s0 = _mm512_load_ps(sb + kb * 32), s1 = _mm512_load_ps(sb + kb * 32 + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(sa[r * KB + kb]);
      // scale product rounded first, then one fused multiply-add (§5.2)
      _mm512_store_ps(out[r], _mm512_fmadd_ps(_mm512_mul_ps(a, s0), acc[r][0], _mm512_load_ps(out[r])));
      _mm512_store_ps(out[r] + 16, _mm512_fmadd_ps(_mm512_mul_ps(a, s1), acc[r][1], _mm512_load_ps(out[r] + 16)));
    }
  }
  const __mmask16 m0 = col_mask(ncols), m1 = col_mask(ncols - 16);
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(C + r * ldc, m0, _mm512_load_ps(out[r]));
    _mm512_mask_storeu_ps(C + r * ldc + 16, m1, _mm512_load_ps(out[r] + 16));
  }
}

// Runs tile(MR, row0, panel) over the (M x panels) grid: blocks of kMTB micro-tiles keep A in
// L2 while panels stream; tails use smaller MR instantiations.
template <class TileFn>
void for_each_tile(int64_t M, int64_t NP, TileFn&& tile) {
  const int64_t MT = (M + kMR - 1) / kMR;
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, MT, 4, 0, NP, 4), [&](const auto& rg) {
    for (int64_t mt0 = rg.rows().begin(); mt0 < rg.rows().end(); mt0 += kMTB) {
      const int64_t mt1 = std::min(rg.rows().end(), mt0 + kMTB);
      for (int64_t pn = rg.cols().begin(); pn < rg.cols().end(); ++pn)
        for (int64_t mt = mt0; mt < mt1; ++mt) {
          const int64_t m0 = mt * kMR;
          tile(static_cast<int>(std::min<int64_t>(kMR, M - m0)), m0, pn);
        }
    }
  });
}

// Calls f.template operator()<MR>() for MR = rows (1..kMR).
template <class F>
inline void with_mr(int rows, F&& f) {
  switch (rows) {
    case 8: f.template operator()<8>(); break;
    case 7: f.template operator()<7>(); break;
    case 6: f.template operator()<6>(); break;
    case 5: f.template operator()<5>(); break;
    case 4: f.template operator()<4>(); break;
    case 3: f.template operator()<3>(); break;
    case 2: f.template operator()<2>(); break;
    default: f.template operator()<1>(); break;
  }
}

}  // namespace

void gemm_f32_avx512(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C) {
  const int64_t K = d.K;
  for_each_tile(d.M, B.panels(), [&](int rows, int64_t m0, int64_t pn) {
    with_mr(rows, [&]<int MR>() {
      tile_f32<MR>(A + m0 * K, K, B.f32.data() + pn * K * 32, C + m0 * d.N + pn * 32, d.N,
                   d.N - pn * 32);
    });
  });
}

void gemm_bf16_avx512(int64_t M, const uint16_t* A, int64_t lda, const gemm_packed_b& B, float* C) {
  const int64_t KH = B.Kp / 2, N = B.N;
  for_each_tile(M, B.panels(), [&](int rows, int64_t m0, int64_t pn) {
    with_mr(rows, [&]<int MR>() {
      tile_bf16<MR>(A + m0 * lda, lda, B.bf16.data() + pn * KH * 64, KH, C + m0 * N + pn * 32,
                    N, N - pn * 32);
    });
  });
}

void gemm_fp8_avx512(const fp8_a_operand& A, const gemm_packed_b& B, float* C, bool stream) {
  const int64_t KH = B.Kp / 2, KB = B.Kp / kBlock, N = B.N;
  for_each_tile(A.M, B.panels(), [&](int rows, int64_t m0, int64_t pn) {
    with_mr(rows, [&]<int MR>() {
      const uint16_t* a = A.bf16.data() + m0 * A.Kp;
      const float* sa = A.scale_inv.data() + m0 * KB;
      const float* sb = B.scale_inv.data() + pn * KB * 32;
      float* c = C + m0 * N + pn * 32;
      if (stream)
        tile_fp8<MR, true>(a, A.Kp, sa, KB, B.fp8.data() + pn * KH * 64, sb, c, N, N - pn * 32);
      else
        tile_fp8<MR, false>(a, A.Kp, sa, KB, B.bf16.data() + pn * KH * 64, sb, c, N, N - pn * 32);
    });
  });
}

void e4m3_to_bf16_avx512(const uint8_t* src, int64_t n, uint16_t* dst) {
  const e4m3_bf16_tables& t = tables();
  // natural order from the unpacked halves: 128-bit lanes (lo.L0, hi.L0, lo.L1, hi.L1), ...
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i w0, w1;
    t.decode(_mm512_loadu_si512(src + i), &w0, &w1);
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi64(w0, first, w1));
    _mm512_storeu_si512(dst + i + 32, _mm512_permutex2var_epi64(w0, second, w1));
  }
  const float* lut = e4m3_table();
  for (; i < n; ++i) dst[i] = bf16_from_float(lut[src[i]]);
}

}  // namespace fp8rl::quant::detail
