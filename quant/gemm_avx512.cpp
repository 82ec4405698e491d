// quant/gemm_avx512.cpp -- AVX-512 GEMM kernels (register-tiled, oneTBB over tiles).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vbmi -mavx512vbmi2
// -mgfni; VBMI/VBMI2/BF16/GFNI instructions appear only in the narrow kernels (cpu_isa avx512_bf16;
// checked in the objects GCC 12 makes: the wide kernels, run at `avx512`, use none).
//
// Micro-tile: MR rows of A x one 32-column panel of B (two zmm accumulators per row). Each
// output element keeps one accumulator and sees K in the order of its model (quant/gemm.hpp):
//  * wide kernels: VFMADD231PS on FP32 values; BF16/FP8 values are exact in FP32 and the pair
//    model is two fmas, odd element first (BF16 adds MXCSR DAZ|FTZ, which is VDPBF16PS's rule).
//  * narrow kernels: VDPBF16PS on BF16 pairs (the SDM accumulates element 2i+1, then 2i, each
//    rounded), with B read as BF16 pairs or as FP8 codes decoded in registers.
// Both give the same bits (tests/quant/gemm_test.cpp checks every kernel against *_ref).
#include <immintrin.h>
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <span>
#include <vector>

#include "quant/fp8.hpp"
#include "quant/fp8_avx512.hpp"
#include "quant/gemm_impl.hpp"

namespace fp8rl::quant::detail {
namespace {

constexpr int kMR = 8;         // rows per micro-tile
constexpr int64_t kMTB = 16;   // micro-tiles per L2 block of A (128 rows)

inline __mmask16 col_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}

// E4M3 -> BF16 in registers: two 128-entry byte tables (high and low byte of the BF16 value
// of codes 0..127, times 2^exp2), indexed by VPERMI2B (bit 7 ignored), sign OR-ed into the high byte.
struct e4m3_bf16_tables {
  __m512i hi0, hi1, lo0, lo1;
  explicit e4m3_bf16_tables(int exp2) {
    alignas(64) uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; ++c) {
      uint16_t b = bf16_from_float(std::ldexp(e4m3_to_float(static_cast<uint8_t>(c)), exp2));
      hi[c] = static_cast<uint8_t>(b >> 8);
      lo[c] = static_cast<uint8_t>(b & 0xff);
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
  }
  // 64 codes -> words of bytes {0-7,16-23,32-39,48-55} (w0) and {8-15,...,56-63} (w1): a narrow
  // pair step's two halves (fp8_step_byte), for every code (no patch: a table has no rare code)
  // raw stays in a register: VPERMI2B overwrites its index and GCC reloaded the 64 codes from
  // memory for each table, 3 loads of each line a step; one load (the permutes take copies) made the
  // DRAM GEMVs 0-4% faster (Zen 5, 2026-12-05, in-process A/B at TinyLlama shapes; in cache
  // unchanged at ~12.3 cycles a 4-panel step: the permutes and VDPBF16PS bind there).
  inline void decode(__m512i raw, __m512i* w0, __m512i* w1) const {
    asm("" : "+v"(raw));
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, raw, hi1), raw,
                                                _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // h | (raw & 0x80)
    const __m512i l = _mm512_permutex2var_epi8(lo0, raw, lo1);
    *w0 = _mm512_unpacklo_epi8(l, h);
    *w1 = _mm512_unpackhi_epi8(l, h);
  }
};

// The values, or (codes_a) the values times 2^kCodesAExp: the narrow FP8 kernels' A operand.
const e4m3_bf16_tables& tables(bool codes_a = false) {
  static const e4m3_bf16_tables plain(0), scaled(kCodesAExp);
  return codes_a ? scaled : plain;
}

// The values times 2^-kCodesAExp: the narrow FP8 kernels' B operand (decode_affine's words).
const e4m3_bf16_tables& codes_b_tables() {
  static const e4m3_bf16_tables t(-kCodesAExp);
  return t;
}

// Narrow FP8 pair steps (fp8_stream_pos): decoded word w of half 0 (1) comes from byte
// fp8_step_byte(0 (1), w), which a byte unpack (low byte, high byte) puts in word w. A code c =
// s|eeee|mmm with 1 <= e (NaN excepted) has the BF16 word s|0111eeee|mmm0000 = (1 + m/8) *
// 2^(e - 15) = E4M3(c) * 2^-8 (112 + e = 127 + (e - 15); E4M3's bias is 7). Each byte of that
// word is an affine map of c's bits over GF(2), one VGF2P8AFFINEQB each: high byte s|0111|e3e2e1
// (matrix rows s, 0, 0, 0, 0, e3, e2, e1 XOR 0x38), low byte e0|mmm|0000. Steps holding a code
// outside that range (fp8_rare bit) patch those words with values precomputed at packing
// (fp8_rare_patch, VPEXPANDW). The A operand carries its values times 2^8 (kCodesAExp, exact in
// BF16), so every product, and so every partial sum, is the §5.2 one exactly (nonzero ones >=
// 2^-18, far from FTZ): results are bit-identical without rescaling the block sum. On Zen 5 the
// two affine maps + two unpacks (4 ops, 2 of them in the 2-a-cycle class of VDPBF16PS) decode a
// step in fewer pipe slots than the tables (5 ops) or shifts (2 unpacks + 2 shifts + 2 ternlogs).

// GF(2) matrices (VGF2P8AFFINEQB: result bit i = parity(matrix byte 7-i & c) ^ imm bit i)
constexpr long long kAffineHi = 0x1020400000000080LL;  // bits 7, 2, 1, 0 <- c bits 7, 6, 5, 4
constexpr int kAffineHiXor = 0x38;                     // bits 5..3 set: exponent 0111....
constexpr long long kAffineLo = 0x0000000001020408LL;  // bits 7, 6, 5, 4 <- c bits 3, 2, 1, 0
static_assert(kCodesAExp == 15 - 7, "the A operand's 2^kCodesAExp undoes decode_affine's 2^(7 - 15)");
inline void decode_affine(__m512i raw, __m512i* w0, __m512i* w1) {
  const __m512i h = _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64(kAffineHi), kAffineHiXor);
  const __m512i l = _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64(kAffineLo), 0);
  *w0 = _mm512_unpacklo_epi8(l, h);
  *w1 = _mm512_unpackhi_epi8(l, h);
}

// The rare steps of one (panel, 128-K block): bit i of `bits` marks step i; their patches follow
// each other from `patch`.
struct rare_steps {
  uint64_t bits = 0;
  const uint16_t* patch = nullptr;
};

// Applies the patch at *r to a rare step's decoded words and moves *r to the next patch.
inline void patch_rare(const uint16_t** r, __m512i* w0, __m512i* w1) {
  uint32_t k[2];
  std::memcpy(k, *r, 8);
  const uint16_t* v = *r + 4;
  *w0 = _mm512_mask_expandloadu_epi16(*w0, _cvtu32_mask32(k[0]), v);
  v += __builtin_popcount(k[0]);
  *w1 = _mm512_mask_expandloadu_epi16(*w1, _cvtu32_mask32(k[1]), v);
  *r = v + __builtin_popcount(k[1]);
}

// Pair step i of a 128-K block of codes at q, decoded into w0/w1; bit i of rare_bits marks a
// patched step, *rp its next patch (moved past the one applied).
inline void decode_step(const uint8_t* q, int i, uint64_t rare_bits, const uint16_t** rp, __m512i* w0, __m512i* w1) {
  decode_affine(_mm512_load_si512(q + i * 64), w0, w1);
  if (__builtin_expect((rare_bits >> i) & 1, 0)) patch_rare(rp, w0, w1);
}

// Accumulators of a micro-tile: MR rows x PN panels x 2 zmm (32 columns per panel). Small MR
// takes several panels at once so enough independent FMA/VDPBF16PS chains are in flight
// (each output element still has exactly one chain, in its model's order).
template <int MR, int PN>
struct tile_acc {
  __m512 v[MR][2 * PN];
  void zero() {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2 * PN; ++j) v[r][j] = _mm512_setzero_ps();
  }
};

// ---- wide: FP32 FMA on panels P[p] ([Kp][32] floats), element k ----
template <int MR, int PN>
inline void fma_step(const float* A, int64_t lda, const float* const (&P)[PN], int64_t k,
                     tile_acc<MR, PN>& acc) {
  __m512 b[2 * PN];
  for (int p = 0; p < PN; ++p) {
    b[2 * p] = _mm512_load_ps(P[p] + k * 32);
    b[2 * p + 1] = _mm512_load_ps(P[p] + k * 32 + 16);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(A[r * lda + k]);
    for (int j = 0; j < 2 * PN; ++j) acc.v[r][j] = _mm512_fmadd_ps(a, b[j], acc.v[r][j]);
  }
}

// The accumulators live in locals for the loop (the tile_acc reference would keep GCC from
// holding all of them in registers: it reloaded row pointers and copied accumulators each step).
template <int MR, int PN, bool kPairs>
inline void dot_wide(const float* A, int64_t lda, const float* const (&P)[PN], int64_t k0, int64_t k1,
                     tile_acc<MR, PN>& acc) {
  tile_acc<MR, PN> v = acc;
  const float* a[MR];
  for (int r = 0; r < MR; ++r) a[r] = A + r * lda;
  const float* p[PN];
  for (int q = 0; q < PN; ++q) p[q] = P[q];
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m512 b[2 * PN];
    for (int q = 0; q < PN; ++q) {
      b[2 * q] = _mm512_load_ps(p[q] + k * 32);
      b[2 * q + 1] = _mm512_load_ps(p[q] + k * 32 + 16);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[r][k]);
      for (int j = 0; j < 2 * PN; ++j) v.v[r][j] = _mm512_fmadd_ps(x, b[j], v.v[r][j]);
    }
  };
  if constexpr (kPairs) {
    for (int64_t k = k0; k < k1; k += 2) {  // odd element first
      step(k + 1);
      step(k);
    }
  } else {
    for (int64_t k = k0; k < k1; ++k) step(k);
  }
  acc = v;
}

// Narrow tiles prefetch B ahead per panel (_MM_HINT_T0). 8-row tiles 2 KiB (32 pair steps of FP8
// codes, 16 of BF16 pairs): their first pass over a panel streams it while the hardware prefetcher
// alone kept one stream per core short of the compute (Zen 5, M = 16 from DRAM: 411 -> 530 GF/s;
// 2048^3 vs oneDNN +1-2%, the L2-resident passes pay one load slot a step). Decode-sized tiles
// (MR <= 2) stream B from memory with little work per byte: FP8 codes 1.5 KiB ahead (24 steps),
// BF16 pairs 1 KiB (8 steps). Zen 5, 2026-12-05, DRAM GEMVs at the TinyLlama shapes, 2 threads,
// in-process A/B against 2 KiB: codes 1-5% faster in each of 10 runs (no prefetch 15% slower, 0.5
// KiB 9%; an added T1 prefetch 3-6 KiB ahead 15-25% slower), pairs 1-7% faster in 6 of 7 (they
// need it less: 2-5% slower without).
template <int MR, bool kCodes>
constexpr int kPrefetchBytes = MR > 2 ? 2048 : kCodes ? 1536 : 1024;

// ---- narrow: VDPBF16PS on BF16 pairs i of panels P[p] (BF16 pairs or FP8 codes) ----
inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// One BF16 pair step of a panel (32 columns x 2, 128 B) into b[0..1], prefetching ahead.
template <int kAhead>
inline void load_pairs(const uint16_t* q, __m512bh* b) {
  _mm_prefetch(reinterpret_cast<const char*>(q) + kAhead, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(q) + kAhead + 64, _MM_HINT_T0);
  b[0] = (__m512bh)_mm512_load_si512(q);
  b[1] = (__m512bh)_mm512_load_si512(q + 32);
}

template <int MR, int PN>
inline void dot_narrow(const uint16_t* A, int64_t lda, const void* const (&P)[PN], int64_t i0,
                       int64_t i1, tile_acc<MR, PN>& acc) {
  for (int64_t i = i0; i < i1; ++i) {
    __m512bh b[2 * PN];
    for (int p = 0; p < PN; ++p) {
      load_pairs<kPrefetchBytes<MR, false>>(static_cast<const uint16_t*>(P[p]) + i * 64, &b[2 * p]);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = bcast_pair(A + r * lda + 2 * i);
      for (int j = 0; j < 2 * PN; ++j) acc.v[r][j] = _mm512_dpbf16_ps(acc.v[r][j], a, b[j]);
    }
  }
}

// How a narrow block's pair steps come to registers: BF16 pairs loaded; FP8 codes decoded by
// affine maps, with no rare step in the block (no check) or with rare steps patched (rare[p]);
// or decoded by tables (no patch; 5 vector ops a step to the affine maps' 4 plus a check). Where
// B streams from memory (decode-sized tiles) the patched steps' mispredicts cost the GEMV ~4% on
// Zen 5 (2026-12-05: affine + patches decode the in-cache GEMV in 9.3-9.8 cycles per 4-panel step
// against the tables' 12.0, yet the DRAM GEMV ratio fell from 1.78-1.84x to 1.71-1.75x), so those
// tiles take the tables; compute-bound tiles take the affine maps, whose checks their rows amortize.
enum class steps : uint8_t { pairs, affine, affine_rare, table };

template <int MR>
constexpr bool codes_by_table = MR <= 2;  // decode-sized tiles

// One 128-K block (64 pairs) with a constant trip count: the compiler unrolls it and the
// block boundary costs no loop-exit mispredict. affine: about half of 128x128 blocks of normal
// data on one panel have no rare step (the check and its mispredicts cost the 2048^3 GEMM ~2%).
template <int MR, int PN, steps kSteps>
inline void dot_narrow_block(const uint16_t* A, int64_t lda, const void* const (&P)[PN], int64_t i0,
                             const rare_steps (&rare)[PN], const e4m3_bf16_tables& tables_b,
                             tile_acc<MR, PN>& acc) {
  constexpr bool kCodes = kSteps != steps::pairs;
  tile_acc<MR, PN> v = acc;  // in registers for the block (dot_wide): through the reference, the
                             // 4-row tiles' patched steps stored all 16 accumulators every step
  const e4m3_bf16_tables tb = tables_b;  // in registers for the block
  const void* Q[PN];
  for (int p = 0; p < PN; ++p)
    Q[p] = static_cast<const uint8_t*>(P[p]) + i0 * 64 * (kCodes ? 1 : 2);
  const uint16_t* a0 = A + 2 * i0;
  const uint16_t* rp[PN];  // the next rare step's patch, per panel
  for (int p = 0; p < PN; ++p) rp[p] = rare[p].patch;
#pragma GCC unroll 4
  for (int i = 0; i < kBlock / 2; ++i) {
    __m512bh b[2 * PN];
    for (int p = 0; p < PN; ++p) {
      if constexpr (kCodes) {
        __m512i w0, w1;
        _mm_prefetch(static_cast<const char*>(Q[p]) + i * 64 + kPrefetchBytes<MR, true>, _MM_HINT_T0);
        const __m512i raw = _mm512_load_si512(static_cast<const uint8_t*>(Q[p]) + i * 64);
        if constexpr (kSteps == steps::table) {
          tb.decode(raw, &w0, &w1);
        } else {
          decode_affine(raw, &w0, &w1);
          if constexpr (kSteps == steps::affine_rare)
            if (__builtin_expect((rare[p].bits >> i) & 1, 0)) patch_rare(&rp[p], &w0, &w1);
        }
        b[2 * p] = (__m512bh)w0;
        b[2 * p + 1] = (__m512bh)w1;
      } else {
        load_pairs<kPrefetchBytes<MR, false>>(static_cast<const uint16_t*>(Q[p]) + i * 64, &b[2 * p]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = bcast_pair(a0 + r * lda + 2 * i);
      for (int j = 0; j < 2 * PN; ++j) v.v[r][j] = _mm512_dpbf16_ps(v.v[r][j], a, b[j]);
    }
  }
  acc = v;
}

// ---- tile driver: MR rows x PN panels pn, pn + ps, ..., pn + (PN - 1) * ps (ps = 1: consecutive) ----
enum class bsrc : uint8_t { wide, pairs, codes };  // which packed form of B the kernel reads

// The FP8 promotion's scale products sa[m0 + r][kb] * sb[pn + p * ps][kb] (§5.2: the product rounded
// first) of blocks [kb0, kb0 + nb) (nb <= 16; fewer at the end of K) for MR rows x PN panels whose
// columns share each block's scale (panel_scales): sp[p][r][kb - kb0], up to 16 blocks per VMULPS.
template <int MR, int PN>
inline void scale_products(const gemm_a_operand& A, int64_t m0, int64_t KB, const float* panel_scales, int64_t pn,
                           int64_t ps, int64_t kb0, float (*sp)[MR][16], int64_t nb = 16) {
  const __mmask16 m = col_mask(std::min(nb, KB - kb0));
  for (int p = 0; p < PN; ++p) {
    const __m512 sb = _mm512_maskz_loadu_ps(m, panel_scales + (pn + p * ps) * KB + kb0);
    for (int r = 0; r < MR; ++r)
      _mm512_store_ps(sp[p][r], _mm512_mul_ps(_mm512_maskz_loadu_ps(m, A.scale_inv + (m0 + r) * KB + kb0), sb));
  }
}

// The lines scale_products<MR, PN>(..., kb0, ...) will read (a row's 16 floats may straddle two;
// the second address is formed as an integer: past a row's end it must not be a pointer, and a
// prefetch of it is harmless).
template <int MR, int PN>
inline void prefetch_scales(const gemm_a_operand& A, int64_t m0, int64_t KB, const float* panel_scales, int64_t pn,
                            int64_t ps, int64_t kb0) {
  auto fetch = [](const float* row) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(row);
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(at + 15 * sizeof(float)), _MM_HINT_T0);
  };
  for (int p = 0; p < PN; ++p) fetch(panel_scales + (pn + p * ps) * KB + kb0);
  for (int r = 0; r < MR; ++r) fetch(A.scale_inv + (m0 + r) * KB + kb0);
}

// One 128-K block's FP8 promotion into the tile's outputs (in memory: MR x 32 * PN floats):
// o = fma(sa * sb, acc, o). sp: scale_products of the chunk holding kb, at index i; null where B has 32
// column scales per panel (those products are made here). The outputs stay in memory: in registers
// they took 16 of the 32 beside the 8-row tile's 16 accumulators, and GCC's spills of them cost more
// than a load and a store per accumulator per block.
template <int MR, int PN>
inline void promote_block(const tile_acc<MR, PN>& acc, const gemm_a_operand& A, int64_t m0, const gemm_packed_b& B,
                          int64_t pn, int64_t ps, int64_t kb, const float (*sp)[MR][16], int i, float (*o)[32 * PN]) {
  const int64_t KB = B.Kp / kBlock;
  for (int p = 0; p < PN; ++p)
    for (int r = 0; r < MR; ++r) {
      __m512 s[2];
      if (sp) {
        s[0] = s[1] = _mm512_set1_ps(sp[p][r][i]);
      } else {
        const float* sb = B.scale_inv.data() + ((pn + p * ps) * KB + kb) * 32;
        const __m512 a = _mm512_set1_ps(A.scale_inv[(m0 + r) * KB + kb]);
        s[0] = _mm512_mul_ps(a, _mm512_load_ps(sb));
        s[1] = _mm512_mul_ps(a, _mm512_load_ps(sb + 16));
      }
      for (int h = 0; h < 2; ++h) {
        float* q = o[r] + 32 * p + 16 * h;
        _mm512_store_ps(q, _mm512_fmadd_ps(s[h], acc.v[r][2 * p + h], _mm512_load_ps(q)));
      }
    }
}

// Row m of panel pn's 32 outputs (o, 64-byte aligned) into C, masked at N.
inline void store_panel_row(const float* o, const gemm_packed_b& B, int64_t m, int64_t pn, float* C) {
  const int64_t ncols = B.N - pn * 32;
  float* c = C + m * B.N + pn * 32;
  _mm512_mask_storeu_ps(c, col_mask(ncols), _mm512_load_ps(o));
  _mm512_mask_storeu_ps(c + 16, col_mask(ncols - 16), _mm512_load_ps(o + 16));
}

template <int MR, int PN, bsrc kSrc>
void tile(gemm_model model, const gemm_a_operand& A, int64_t m0, const gemm_packed_b& B,
          int64_t pn, float* C, int64_t ps = 1) {
  constexpr bool kWide = kSrc == bsrc::wide;
  const int64_t Kp = B.Kp, lda = A.lda, KB = Kp / kBlock;
  tile_acc<MR, PN> acc;
  const float* pw[PN];
  const void* pnw[PN];
  for (int p = 0; p < PN; ++p) {
    const int64_t off = (pn + p * ps) * Kp * 32;
    pw[p] = kWide ? B.wide.data() + off : nullptr;
    pnw[p] = kWide ? nullptr
             : kSrc == bsrc::codes ? static_cast<const void*>(B.fp8.data() + off)
                                   : static_cast<const void*>(B.bf16.data() + off);
  }
  auto dot = [&](int64_t k0, int64_t k1) {
    if constexpr (kWide) {
      if (model == gemm_model::seq) dot_wide<MR, PN, false>(A.f32 + m0 * lda, lda, pw, k0, k1, acc);
      else dot_wide<MR, PN, true>(A.f32 + m0 * lda, lda, pw, k0, k1, acc);
    } else {
      dot_narrow<MR, PN>(A.bf16 + m0 * lda, lda, pnw, k0 / 2, k1 / 2, acc);
    }
  };
  alignas(64) float out[MR][32 * PN];
  const e4m3_bf16_tables& tb = codes_b_tables();
  if (model != gemm_model::fp8) {
    acc.zero();
    dot(0, Kp);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2 * PN; ++j) _mm512_store_ps(out[r] + 16 * j, acc.v[r][j]);
  } else {
    // the codes form's one scale per (panel, block), where the pack has it (else 32 per panel)
    const float* panel_scales = kSrc != bsrc::wide && !B.scale_panel.empty() ? B.scale_panel.data() : nullptr;
    alignas(64) float sp[PN][MR][16];
    for (int r = 0; r < MR; ++r)  // FP32 outputs, promoted once per 128-K block
      for (int j = 0; j < 2 * PN; ++j) _mm512_store_ps(out[r] + 16 * j, _mm512_setzero_ps());
    for (int64_t kb = 0; kb < KB; ++kb) {
      // a chunk's scales are first needed at its first block's promotion: fetched now, used after the
      // dot (a cold scale line loaded before the dot held the tile's first steps behind a DRAM miss)
      const bool chunk_start = panel_scales && kb % 16 == 0;
      if (chunk_start) prefetch_scales<MR, PN>(A, m0, KB, panel_scales, pn, ps, kb);
      acc.zero();
      if constexpr (kWide) {
        dot(kb * kBlock, (kb + 1) * kBlock);
      } else {
        rare_steps rare[PN] = {};
        if constexpr (kSrc == bsrc::codes && !codes_by_table<MR>)
          for (int p = 0; p < PN; ++p) {
            const int64_t b = (pn + p * ps) * KB + kb;
            rare[p] = {B.fp8_rare[b], B.fp8_rare_patch.data() + B.fp8_rare_at[b]};
            // the block's patches are a second stream: a miss in the middle of the block stalled
            // the decode (GEMV from DRAM ~7%); fetch them now
            const char* q = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(rare[p].patch) & ~uintptr_t{63});
            for (const char* e = reinterpret_cast<const char*>(B.fp8_rare_patch.data() + B.fp8_rare_at[b + 1]); q < e; q += 64)
              _mm_prefetch(q, _MM_HINT_T0);
          }
        const uint16_t* a = A.bf16 + m0 * lda;
        const int64_t i0 = kb * kBlock / 2;
        if constexpr (kSrc == bsrc::codes && codes_by_table<MR>) {
          dot_narrow_block<MR, PN, steps::table>(a, lda, pnw, i0, rare, tb, acc);
        } else if constexpr (kSrc == bsrc::codes) {
          uint64_t any_rare = 0;
          for (int p = 0; p < PN; ++p) any_rare |= rare[p].bits;
          if (any_rare == 0) dot_narrow_block<MR, PN, steps::affine>(a, lda, pnw, i0, rare, tb, acc);
          else dot_narrow_block<MR, PN, steps::affine_rare>(a, lda, pnw, i0, rare, tb, acc);
        } else {
          dot_narrow_block<MR, PN, steps::pairs>(a, lda, pnw, i0, rare, tb, acc);
        }
      }
      if (chunk_start) scale_products<MR, PN>(A, m0, KB, panel_scales, pn, ps, kb, sp);
      promote_block<MR, PN>(acc, A, m0, B, pn, ps, kb, panel_scales ? sp : nullptr, static_cast<int>(kb % 16), out);
    }
  }
  for (int p = 0; p < PN; ++p)
    for (int r = 0; r < MR; ++r) store_panel_row(out[r] + 32 * p, B, m0 + r, pn + p * ps, C);
}

// Row count -> (MR, PN) instantiation: full tiles 8x1; short tiles take 2 or 4 panels (4-panel
// tiles: pn, pn + ps, pn + 2ps, pn + 3ps). Returns the panels taken.
template <bsrc kSrc>
int tile_dispatch(int rows, int npan, gemm_model model, const gemm_a_operand& A, int64_t m0,
                  const gemm_packed_b& B, int64_t pn, float* C, int64_t ps = 1) {
  if (npan >= 4 && rows <= 2) {
    if (rows == 2) tile<2, 4, kSrc>(model, A, m0, B, pn, C, ps);
    else tile<1, 4, kSrc>(model, A, m0, B, pn, C, ps);
    return 4;
  }
  if (npan >= 2 && rows <= 4) {
    switch (rows) {
      case 4: tile<4, 2, kSrc>(model, A, m0, B, pn, C); break;
      case 3: tile<3, 2, kSrc>(model, A, m0, B, pn, C); break;
      case 2: tile<2, 2, kSrc>(model, A, m0, B, pn, C); break;
      default: tile<1, 2, kSrc>(model, A, m0, B, pn, C); break;
    }
    return 2;
  }
  switch (rows) {
    case 8: tile<8, 1, kSrc>(model, A, m0, B, pn, C); break;
    case 7: tile<7, 1, kSrc>(model, A, m0, B, pn, C); break;
    case 6: tile<6, 1, kSrc>(model, A, m0, B, pn, C); break;
    case 5: tile<5, 1, kSrc>(model, A, m0, B, pn, C); break;
    case 4: tile<4, 1, kSrc>(model, A, m0, B, pn, C); break;
    case 3: tile<3, 1, kSrc>(model, A, m0, B, pn, C); break;
    case 2: tile<2, 1, kSrc>(model, A, m0, B, pn, C); break;
    default: tile<1, 1, kSrc>(model, A, m0, B, pn, C); break;
  }
  return 1;
}

// ---- FP8 codes, several row tiles at once: one decode per (panel, 128-K block) ----
// Batched decode (8 < M <= 32) ran the codes micro-kernel once per 8-row tile, so each pair step
// was decoded again for every tile, and the first tile's pass over weights streamed from DRAM
// ran at one tile's compute (TinyLlama step at batch 16: 0.71x of BF16 pairs; with B cached the
// cost hid). Here a panel's block is decoded once into BF16 pair steps in L1 (8 KiB: the words
// the in-register decode makes, patches applied) and every row tile's pairs micro-kernel reads
// them (1.12x on the Xeon): the same products in the same order, so bit-identical to
// tile<.., codes>. Where VDPBF16PS runs at the FMA rate (Zen 5) the in-register decode per tile
// is the faster one (1.1-1.5x): gemm_decode chooses.
constexpr int64_t kMultiRows = 4 * kMR;  // rows sharing one decoded block (their outputs: 4 KiB)

// Panel pn's block kb as pair steps, decoded as the codes kernel does (values * 2^-8):
// buf [kBlock / 2 steps][64 words]
inline void decode_block(const gemm_packed_b& B, int64_t pn, int64_t kb, uint16_t* buf) {
  const int64_t b = pn * (B.Kp / kBlock) + kb;
  const uint8_t* q = B.fp8.data() + pn * B.Kp * 32 + kb * kBlock * 32;
  const uint64_t bits = B.fp8_rare[b];
  const uint16_t* rp = B.fp8_rare_patch.data() + B.fp8_rare_at[b];
  for (int i = 0; i < kBlock / 2; ++i) {
    __m512i w0, w1;
    decode_step(q, i, bits, &rp, &w0, &w1);
    _mm512_store_si512(buf + i * 64, w0);
    _mm512_store_si512(buf + i * 64 + 32, w1);
  }
}

// MR rows from m0 against the decoded block kb; their outputs o[r] (in memory) promoted.
template <int MR>
void rows_block(const gemm_a_operand& A, int64_t m0, const gemm_packed_b& B, int64_t pn, int64_t kb,
                const uint16_t* buf, const float* panel_scales, float (*o)[32]) {
  tile_acc<MR, 1> acc;
  acc.zero();
  const void* const P[1] = {buf};
  dot_narrow<MR, 1>(A.bf16 + m0 * A.lda + kb * kBlock, A.lda, P, 0, kBlock / 2, acc);
  alignas(64) float sp[1][MR][16];
  if (panel_scales) scale_products<MR, 1>(A, m0, B.Kp / kBlock, panel_scales, pn, 1, kb, sp, 1);  // this block's only
  promote_block<MR, 1>(acc, A, m0, B, pn, 1, kb, panel_scales ? sp : nullptr, 0, o);
}

// Rows [m0, m1) (at most kMultiRows) x panel pn.
void tile_codes_rows(const gemm_a_operand& A, int64_t m0, int64_t m1, const gemm_packed_b& B, int64_t pn, float* C) {
  const float* panel_scales = B.scale_panel.empty() ? nullptr : B.scale_panel.data();
  alignas(64) uint16_t buf[kBlock / 2 * 64];
  alignas(64) float o[kMultiRows][32] = {};
  for (int64_t kb = 0; kb < B.Kp / kBlock; ++kb) {
    decode_block(B, pn, kb, buf);
    for (int64_t r0 = m0; r0 < m1; r0 += kMR) {
      float(*orow)[32] = o + (r0 - m0);
      switch (std::min<int64_t>(kMR, m1 - r0)) {
        case 8: rows_block<8>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        case 7: rows_block<7>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        case 6: rows_block<6>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        case 5: rows_block<5>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        case 4: rows_block<4>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        case 3: rows_block<3>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        case 2: rows_block<2>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
        default: rows_block<1>(A, r0, B, pn, kb, buf, panel_scales, orow); break;
      }
    }
  }
  for (int64_t m = m0; m < m1; ++m) store_panel_row(o[m - m0], B, m, pn, C);
}

// Panels [pn0, pn1) of B against the row tile at m0, as many at once as its rows allow.
template <bsrc kSrc>
void tile_panels(int rows, gemm_model model, const gemm_a_operand& A, int64_t m0, const gemm_packed_b& B, int64_t pn0,
                 int64_t pn1, float* C) {
  for (int64_t pn = pn0; pn < pn1;)
    pn += tile_dispatch<kSrc>(rows, static_cast<int>(std::min<int64_t>(4, pn1 - pn)), model, A, m0, B, pn, C);
}

// Runs every (row tile, panel group) of every output: blocks of kMTB micro-tiles keep A in L2
// while panels stream. Panels are grouped by 4 so short tiles can use several at once; the groups
// of several outputs (one A, B_i, C_i: a layer's q/k/v) are one range, so one parallel region
// streams all their weights.
// Decode-sized A (one tile of <= 2 rows, narrow kernels) over short panels (<= 128 KiB) groups them
// strided: with Q = NP / 4, group g < Q takes panels g, g + Q, g + 2Q, g + 3Q (the NP % 4 left over
// are one more group), so a thread's consecutive groups read 4 streams that run on from panel to
// panel instead of starting 4 new ones every group. Zen 5, 2026-12-05, 2 threads, from DRAM: a raw
// 4-panel FP8 loop at K = 2048 (64 KiB panels) 67.6-68.7 GB/s strided vs 61.0-61.1 consecutive;
// the library's GEMVs, in-process A/B: FP8 at K = 2048, 3072, 4096 2.5-7% faster (BF16 pairs,
// 128 KiB panels at K = 2048, 1-2.5%), at K = 5632 (176 KiB) 1-4% slower in 4 of 4, at 8192 ~1%
// faster. The same products per output column: the same bits.
template <bsrc kSrc>
void run_tiles(gemm_model model, const gemm_a_operand& A, std::span<const gemm_out> outs, bool decode_once = false) {
  const int64_t MT = (A.M + kMR - 1) / kMR;
  const int64_t panel_bytes = outs.empty() ? 0 : outs[0].B->Kp * 32 * (kSrc == bsrc::codes ? 1 : 2);
  const bool strided = kSrc != bsrc::wide && A.M <= 2 && panel_bytes <= 128 * 1024;
  // output i's panel groups: [first[i], first[i + 1]), ceil(panels / 4) of them either way
  std::vector<int64_t> first(outs.size() + 1, 0);
  for (size_t i = 0; i < outs.size(); ++i) first[i + 1] = first[i] + (outs[i].B->panels() + 3) / 4;
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, MT, 4, 0, first.back(), 1), [&](const auto& rg) {
    const int64_t mb = rg.rows().begin() * kMR, me = std::min(A.M, rg.rows().end() * kMR);
    const bool once = kSrc == bsrc::codes && decode_once && A.M <= kMultiRows && me - mb > kMR;  // batched decode
    // BF16 on FMA units follows VDPBF16PS's denormal rule: DAZ|FTZ for this task.
    const unsigned csr = _mm_getcsr();
    if (kSrc == bsrc::wide && model == gemm_model::pairs) _mm_setcsr(csr | 0x8040u);
    for (int64_t mt0 = rg.rows().begin(); mt0 < rg.rows().end(); mt0 += kMTB) {
      const int64_t mt1 = std::min(rg.rows().end(), mt0 + kMTB);
      size_t i = 0;
      for (int64_t gg = rg.cols().begin(); gg < rg.cols().end(); ++gg) {
        while (gg >= first[i + 1]) ++i;
        const gemm_packed_b& B = *outs[i].B;
        float* C = outs[i].C;
        const int64_t g = gg - first[i], NP = B.panels();
        if (once) {
          for (int64_t pn = g * 4; pn < std::min(NP, g * 4 + 4); ++pn) tile_codes_rows(A, mb, me, B, pn, C);
          continue;
        }
        for (int64_t mt = mt0; mt < mt1; ++mt) {
          const int64_t m0 = mt * kMR;
          const int rows = static_cast<int>(std::min<int64_t>(kMR, A.M - m0));
          const int64_t Q = NP / 4;  // strided: group g < Q is one 4-panel tile, group Q the rest
          if (!strided) tile_panels<kSrc>(rows, model, A, m0, B, g * 4, std::min(NP, g * 4 + 4), C);
          else if (g == Q) tile_panels<kSrc>(rows, model, A, m0, B, 4 * Q, NP, C);
          else tile_dispatch<kSrc>(rows, 4, model, A, m0, B, g, C, Q);
        }
      }
      if (once) break;  // all its rows at once
    }
    _mm_setcsr(csr);
  });
}

}  // namespace

void gemm_wide_avx512(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C) {
  const gemm_out out{&B, C};
  run_tiles<bsrc::wide>(model, A, {&out, 1});
}

void gemm_narrow_avx512(gemm_model model, const gemm_a_operand& A, std::span<const gemm_out> outs, bool decode_once,
                        bool decoded_b) {
  if (model == gemm_model::fp8 && !decoded_b) run_tiles<bsrc::codes>(model, A, outs, decode_once);
  else run_tiles<bsrc::pairs>(model, A, outs);
}

void fp8_decode_pack_avx512(gemm_packed_b& B) {
  const int64_t KB = B.Kp / kBlock;
  tbb::parallel_for(int64_t{0}, B.panels() * KB, [&](int64_t b) {
    decode_block(B, b / KB, b % KB, B.bf16.data() + b * kBlock * 32);
  });
}

namespace {
// Seconds for `iters` rounds of 24 independent chains of one instruction (throughput-bound).
template <bool kDp>
double chain_seconds(int64_t iters) {
  __m512 acc[24];
  for (auto& x : acc) x = _mm512_setzero_ps();
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0x1p-30f);
  const __m512bh ah = (__m512bh)_mm512_set1_epi16(0x3f80), bh = (__m512bh)_mm512_set1_epi16(0x3000);
  const auto t0 = std::chrono::steady_clock::now();
  // Fully unrolled so the 24 accumulators live in registers (a compiler barrier per chain kept
  // them in memory: the probe then timed store forwarding, not the two instructions). The
  // compiler cannot fold the chains: FP adds do not reassociate without -ffast-math.
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) {
      if constexpr (kDp) acc[j] = _mm512_dpbf16_ps(acc[j], ah, bh);
      else acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  alignas(64) float lanes[16];
  float sink = 0;
  for (auto& x : acc) {
    _mm512_store_ps(lanes, x);
    sink += lanes[0];
  }
  __asm__ volatile("" : : "x"(sink));
  return s;
}
}  // namespace

double dpbf16_fma_rate_ratio() {
  constexpr int64_t kIters = 4000;  // 96k instructions per run, well under a millisecond
  double dp = 1e30, fma = 1e30;
  for (int rep = 0; rep < 21; ++rep) {  // interleaved, best of each: noise only slows a run
    dp = std::min(dp, chain_seconds<true>(kIters));
    fma = std::min(fma, chain_seconds<false>(kIters));
  }
  return (32.0 / dp) / (16.0 / fma);  // 32 multiply-adds per VDPBF16PS, 16 per FMA
}

namespace {
// 64 codes -> their BF16 values in natural order (two vectors of 32 words)
inline void e4m3_bf16_natural(const uint8_t* src, __m512i* first32, __m512i* last32,
                              const e4m3_bf16_tables& t = tables()) {
  // natural order from the unpacked halves: 128-bit lanes (w0.L0, w1.L0, w0.L1, w1.L1), ...
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  __m512i w0, w1;
  t.decode(_mm512_loadu_si512(src), &w0, &w1);
  *first32 = _mm512_permutex2var_epi64(w0, first, w1);
  *last32 = _mm512_permutex2var_epi64(w0, second, w1);
}

// 32 BF16 words -> 32 floats (exact: BF16 is the upper half of FP32)
inline void bf16_store_f32(__m512i w, float* dst) {
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16)));
  _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16)));
}
}  // namespace

void e4m3_to_bf16_avx512(const uint8_t* src, int64_t n, uint16_t* dst, bool codes_a) {
  const e4m3_bf16_tables& t = tables(codes_a);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i a, b;
    e4m3_bf16_natural(src + i, &a, &b, t);
    _mm512_storeu_si512(dst + i, a);
    _mm512_storeu_si512(dst + i + 32, b);
  }
  const float* lut = e4m3_table();
  const float times = codes_a ? kCodesAScale : 1.0f;
  for (; i < n; ++i) dst[i] = bf16_from_float(lut[src[i]] * times);
}

namespace {
// 32 BF16 words times s (exact for the power-of-two fold), back to BF16 by truncation.
inline __m512i bf16x32_scale(__m512i w, __m512 s) {
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
  const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
  const __m256i l = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(lo, s)), 16));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(hi, s)), 16));
  return _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
}
}  // namespace

void tiles_put_fp8_row(uint16_t* tiles, int64_t KS, int64_t m, const uint8_t* src, int64_t K, const float* scale) {
  uint16_t* base = tiles + (m / 16) * KS * 512 + (m % 16) * 32;
  int64_t ks = 0;
  for (int64_t k = 0; k < K; k += 64, ks += 2) {  // 64 codes: k-steps ks and ks + 1 (KS * 32 >= K rounded to 128)
    __m512i a, b;
    if (k + 64 <= K) {
      e4m3_bf16_natural(src + k, &a, &b);
    } else {
      alignas(64) uint8_t tail[64] = {};  // code 0 is +0: the zero padding
      std::memcpy(tail, src + k, static_cast<size_t>(K - k));
      e4m3_bf16_natural(tail, &a, &b);
    }
    if (scale) {
      const __m512 s = _mm512_set1_ps(scale[k / kBlock]);
      a = bf16x32_scale(a, s);
      b = bf16x32_scale(b, s);
    }
    _mm512_storeu_si512(base + ks * 512, a);
    _mm512_storeu_si512(base + (ks + 1) * 512, b);
  }
  for (; ks < KS; ++ks) _mm512_storeu_si512(base + ks * 512, _mm512_setzero_si512());
}

void e4m3_to_f32_avx512(const uint8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i a, b;
    e4m3_bf16_natural(src + i, &a, &b);
    bf16_store_f32(a, dst + i);
    bf16_store_f32(b, dst + i + 32);
  }
  const float* lut = e4m3_table();
  for (; i < n; ++i) dst[i] = lut[src[i]];
}

void fp8_rare_steps_avx512(const uint8_t* codes, int64_t steps, uint64_t* bits) {
  const __m512i exp = _mm512_set1_epi8(0x78), nan = _mm512_set1_epi8(0x7f);
  for (int64_t i = 0; i < steps; ++i) {
    const __m512i v = _mm512_load_si512(codes + i * 64);  // ±0/subnormal: exponent 0; NaN: 0x7f/0xff
    if (_mm512_testn_epi8_mask(v, exp) | _mm512_cmpeq_epi8_mask(_mm512_and_si512(v, nan), nan))
      bits[i / 64] |= uint64_t{1} << (i % 64);
  }
}

// 16 k x 32 columns of a full panel per round: two 16x16 byte transposes give each k's codes
// of columns 0-15 and 16-31; wide stores their FP32 values ([Kp][32]), narrow interleaves two
// k into the pair-step byte order of fp8_stream_pos. K % 16 tail columns are left to the caller.
int64_t fp8_pack_panel_avx512(const uint8_t* src, int64_t K, float* wide, uint8_t* narrow) {
  int64_t k0 = 0;
  for (; k0 + 16 <= K; k0 += 16) {
    __m128i col[2][16];  // [column half][k - k0]: codes of 16 columns
    for (int h = 0; h < 2; ++h) {
      __m128i rows[16];
      for (int r = 0; r < 16; ++r) rows[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (16 * h + r) * K + k0));
      transpose_16x16_u8(rows, col[h]);
    }
    if (wide)
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 16; t += 4) {
          alignas(64) uint8_t codes[64];
          for (int u = 0; u < 4; ++u) _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16 * u), col[h][t + u]);
          __m512i v[2];
          e4m3_bf16_natural(codes, &v[0], &v[1]);
          for (int u = 0; u < 4; ++u) {
            const __m256i w = u % 2 ? _mm512_extracti64x4_epi64(v[u / 2], 1) : _mm512_castsi512_si256(v[u / 2]);
            _mm512_store_ps(wide + (k0 + t + u) * 32 + 16 * h,
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16)));
          }
        }
    if (narrow)
      for (int t = 0; t < 16; t += 2) {
        // words w = 2j + (k odd) of columns j (half 0) and 16 + j (half 1); lane L holds half 0's
        // words 8L..8L+7, then half 1's (fp8_step_byte)
        const __m128i lo0 = _mm_unpacklo_epi8(col[0][t], col[0][t + 1]), lo1 = _mm_unpackhi_epi8(col[0][t], col[0][t + 1]);
        const __m128i hi0 = _mm_unpacklo_epi8(col[1][t], col[1][t + 1]), hi1 = _mm_unpackhi_epi8(col[1][t], col[1][t + 1]);
        __m128i* out = reinterpret_cast<__m128i*>(narrow + (k0 + t) / 2 * 64);
        _mm_store_si128(out, _mm_unpacklo_epi64(lo0, hi0));
        _mm_store_si128(out + 1, _mm_unpackhi_epi64(lo0, hi0));
        _mm_store_si128(out + 2, _mm_unpacklo_epi64(lo1, hi1));
        _mm_store_si128(out + 3, _mm_unpackhi_epi64(lo1, hi1));
      }
  }
  return k0;
}

}  // namespace fp8rl::quant::detail
