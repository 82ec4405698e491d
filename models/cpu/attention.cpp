// models/cpu/attention.cpp -- causal grouped-query attention on packed sequences.
// Forward keeps lse[T,H]; backward recomputes probabilities from it (no T x T cache).
#include <tbb/parallel_for.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "models/cpu/cpu_backend.hpp"
#include "models/cpu/cpu_ops.hpp"
#include "models/cpu/fast_exp.hpp"
#include "quant/fp8.hpp"

namespace fp8rl::models {

namespace {
// y[0..n) = fma(a, x, y) elementwise; restrict lets the vectorizer drop alias checks.
[[gnu::always_inline]] inline void row_fma(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = std::fma(a, x[j], y[j]);
}

}  // namespace

namespace {
// x[0..n) = cpu_attn_round(x[j], r), one loop per rounding so that fp32 and bf16 vectorize; FP8
// through quant's array codecs (byte for byte e4m3_from_float / e4m3_to_float, AVX-512 where
// present: the scalar pair per element was ~10% of FP8-Q decode attention).
[[gnu::always_inline]] inline void attn_round_row(float* x, int64_t n, const attn_rounding& r) {
  if (r.scale > 0.0f) {
    constexpr int64_t kChunk = 256;
    float t[kChunk];
    uint8_t c[kChunk];
    for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
      const int64_t m = std::min(kChunk, n - j0);
      for (int64_t j = 0; j < m; ++j) t[j] = x[j0 + j] / r.scale;
      quant::e4m3_encode_array(t, m, c);
      quant::e4m3_decode_array(c, m, t);
      for (int64_t j = 0; j < m; ++j) x[j0 + j] = t[j] * r.scale;
    }
  } else if (r.operand == precision::bf16)
    for (int64_t j = 0; j < n; ++j) x[j] = quant::bf16_round(x[j]);
}

// out[d] = sum over j < n of p[j] v[j][d], a sequential fma chain from +0 held in registers.
template <int D>
[[gnu::always_inline]] inline void attn_pv(const float* p, int64_t n, const float* v, float* out) {
  float acc[D] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
#pragma GCC unroll 8
    for (int d = 0; d < D; ++d) acc[d] = std::fma(pj, v[j * D + d], acc[d]);
  }
  for (int d = 0; d < D; ++d) out[d] = acc[d];
}

// Softmax of n scores s in place (scaled, max-subtracted, exp, summed in 16 lanes), P rounded
// to the operand precision; returns the lse. The one definition cpu_attn_query, decode
// (cpu_attn_group) and the training forward use.
FP8RL_VECTOR_CLONES float cpu_attn_softmax(float* s, int64_t n, int64_t D, precision p_operand) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // max and sum in 16 lanes (lane j % 16), combined in lane order: a fixed order that vectorizes
  // (the max as a 16-lane vector: GCC left the unrolled lane loop scalar)
  using lanes16 = float __attribute__((vector_size(64)));
  lanes16 vm = {}, x;
  vm -= INFINITY;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    std::memcpy(&x, s + j, sizeof x);
    x *= scale;
    std::memcpy(s + j, &x, sizeof x);
    vm = vm < x ? x : vm;
  }
  float lm[16], ls[16] = {};
  std::memcpy(lm, &vm, sizeof lm);
  for (int l = 0; j < n; ++j, ++l) {
    s[j] = s[j] * scale;
    lm[l] = lm[l] < s[j] ? s[j] : lm[l];
  }
  float m = lm[0];
  for (int l = 1; l < 16; ++l) m = m < lm[l] ? lm[l] : m;
  j = 0;
  for (; j + 16 <= n; j += 16)
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) {
      s[j + l] = cpu_exp(s[j + l] - m);
      ls[l] += s[j + l];
    }
  for (int l = 0; j < n; ++j, ++l) {
    s[j] = cpu_exp(s[j] - m);
    ls[l] += s[j];
  }
  float sum = 0.0f;
  for (float l : ls) sum += l;
  for (j = 0; j < n; ++j) s[j] = s[j] / sum;
  attn_round_row(s, n, attn_rounding{p_operand, 0.0f});
  return m + std::log(sum);
}

// out[d] = sum_j p[j] v[j][d], sequential in j from +0, for any D.
FP8RL_VECTOR_CLONES void attn_pv_any(const float* p, int64_t n, const float* v, int64_t D, float* out) {
  switch (D) {
    case 32: attn_pv<32>(p, n, v, out); break;
    case 64: attn_pv<64>(p, n, v, out); break;
    case 128: attn_pv<128>(p, n, v, out); break;
    default:
      for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
      for (int64_t j = 0; j < n; ++j) row_fma(p[j], v + j * D, out, D);
  }
}

constexpr int kPvRows = 4;  // rows sharing each V row load in attn_pv_rows (4 x 64 floats: 16 zmm)

// Causal rows of a block: out[r][d] = sum over j <= i0 + r of p[r][j] v[j][d] for r < B, each the
// attn_pv order (a sequential fma chain in j from +0), kPvRows rows at a time over the keys they
// all see, then each row's own last keys.
//   p: [B][ldp]; v: [>= i0 + B][D]; out: row r at out + r * ldo
template <int D>
FP8RL_VECTOR_CLONES void attn_pv_rows(const float* p, int64_t ldp, int64_t B, int64_t i0, const float* v, float* out,
                                      int64_t ldo) {
  int64_t r = 0;
  for (; r + kPvRows <= B; r += kPvRows) {
    float acc[kPvRows][D] = {};
    const int64_t n0 = i0 + r + 1;  // keys every row of the group sees
    for (int64_t j = 0; j < n0; ++j) {
      const float* vj = v + j * D;
      float pj[kPvRows];
      for (int q = 0; q < kPvRows; ++q) pj[q] = p[(r + q) * ldp + j];
#pragma GCC unroll 16
      for (int d = 0; d < D; ++d)
        for (int q = 0; q < kPvRows; ++q) acc[q][d] = std::fma(pj[q], vj[d], acc[q][d]);
    }
    for (int q = 1; q < kPvRows; ++q)
      for (int64_t j = n0; j < n0 + q; ++j)
        for (int d = 0; d < D; ++d) acc[q][d] = std::fma(p[(r + q) * ldp + j], v[j * D + d], acc[q][d]);
    for (int q = 0; q < kPvRows; ++q)
      for (int d = 0; d < D; ++d) out[(r + q) * ldo + d] = acc[q][d];
  }
  for (; r < B; ++r) attn_pv<D>(p + r * ldp, i0 + r + 1, v, out + r * ldo);
}

// attn_pv_rows for any D (the generic D falls back to one row at a time, same order).
void attn_pv_rows_any(const float* p, int64_t ldp, int64_t B, int64_t i0, const float* v, int64_t D, float* out,
                      int64_t ldo) {
  switch (D) {
    case 32: attn_pv_rows<32>(p, ldp, B, i0, v, out, ldo); break;
    case 64: attn_pv_rows<64>(p, ldp, B, i0, v, out, ldo); break;
    case 128: attn_pv_rows<128>(p, ldp, B, i0, v, out, ldo); break;
    default:
      for (int64_t r = 0; r < B; ++r) attn_pv_any(p + r * ldp, i0 + r + 1, v, D, out + r * ldo);
  }
}
}  // namespace

FP8RL_VECTOR_CLONES float cpu_attn_query(const float* q, const attn_rounding& rq, const float* kt, int64_t ldk, const float* v,
                     int64_t n, int64_t D, precision p_operand, float* out, float* scratch) {
  float* s = scratch;      // [n] scores, then probabilities
  float* qr = scratch + n; // [D]
  for (int64_t d = 0; d < D; ++d) qr[d] = cpu_attn_round(q[d], rq);
  for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) row_fma(qr[d], kt + d * ldk, s, n);  // s[j] = sum_d q[d] k[j][d], sequential in d
  const float lse = cpu_attn_softmax(s, n, D, p_operand);
  attn_pv_any(s, n, v, D, out);
  return lse;
}

namespace {
constexpr int64_t kGroupRows = 8;  // most query rows per register block in cpu_attn_group

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr unsigned kMxcsrDaz = 0x0040u;  // MXCSR bit 6: denormal operands read as zero

// 16 stored K/V elements widened to FP32, exactly: FP32 as is, BF16 by a shift, an E4M3 code
// s|eeee|mmm (never NaN: the FP8 cache refuses non-finite K/V) without touching a denormal:
// f = the FP32 with exponent e + 120 and mantissa mmm is the value (1 + m/8) 2^(e - 7) of a
// normal code; for e = 0 it is 2^-7 + m 2^-10, and 2f - 2^-6 = m 2^-9 is the subnormal code's
// value (exact: 2f is exact and the difference representable). min(f, 2f - 2^-6) picks the right
// one in every lane (f >= 2^-6 exactly when e >= 1), then the sign bit. The former form, the code's
// bits << 20 as an FP32 denormal times 2^120, took a microcode assist per vector holding a
// subnormal code: decode attention over every finite code (14 in 256 subnormal) took 2.0-2.2x
// BF16's time, 1.06x without them; this form 1.23x either way. Slabs the cache flags free of
// subnormal codes keep the shorter form (widen16_clean, which then meets no denormal): 1.03x
// (Zen 5, 2026-12-06, bench-decode --only=attention_codes). Plain loops over 16 lanes: one vector
// each in the x86-64-v4 clone.
using f32x16 = float __attribute__((vector_size(64)));  // GCC vectors: one zmm in the v4 clone
using u32x16 = uint32_t __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
using u32x4 = uint32_t __attribute__((vector_size(16)));
// (GCC 12 lowers __builtin_convertvector from 8- or 16-bit lanes to 16 dwords one lane at a time;
// a dword permute + per-lane shift is VPERMD + VPSLLVD.)
[[gnu::always_inline]] inline void widen16(const float* p, float* out) { std::memcpy(out, p, 64); }
[[gnu::always_inline]] inline void widen16(const uint16_t* p, float* out) {
  u32x8 w;
  std::memcpy(&w, p, sizeof w);
  constexpr u32x16 sh = {16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0};
  const u32x16 u = (__builtin_shufflevector(w, w, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7) << sh) & 0xFFFF0000u;
  std::memcpy(out, &u, 64);
}
// 16 E4M3 codes, each sign-extended and << 20 in its lane (s...s|s|eeee|mmm|0...0), into *u (an
// out-parameter: a 64-byte vector return value changes the ABI outside the v4 clone).
[[gnu::always_inline]] inline void e4m3_lanes(const uint8_t* p, u32x16* u) {
  u32x4 w;
  std::memcpy(&w, p, sizeof w);
  const u32x8 w8 = __builtin_shufflevector(w, w, 0, 1, 2, 3, 0, 1, 2, 3);
  constexpr u32x16 sh = {24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0};  // code j to the top byte
  const u32x16 top = __builtin_shufflevector(w8, w8, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3) << sh;
  *u = reinterpret_cast<u32x16>(reinterpret_cast<i32x16>(top) >> 4);
}
[[gnu::always_inline]] inline void widen16(const uint8_t* p, float* out) {
  u32x16 u;
  e4m3_lanes(p, &u);
  const f32x16 f = reinterpret_cast<f32x16>((u & 0x07F00000u) + (120u << 23));
  const f32x16 g = f * 2.0f - 0x1p-6f;
  const f32x16 r = f < g ? f : g;
  const u32x16 bits = reinterpret_cast<u32x16>(r) | (u & 0x80000000u);
  std::memcpy(out, &bits, 64);
}
// The same for 16 codes known to hold no subnormal one (the cache's per-slab flags): the shorter
// form -- the code's bits << 20 as an FP32, a normal number for every such code, times 2^120.
[[gnu::always_inline]] inline void widen16_clean(const uint8_t* p, float* out) {
  u32x16 u;
  e4m3_lanes(p, &u);
  const f32x16 f = reinterpret_cast<f32x16>(u & 0x87F00000u) * 0x1p120f;
  std::memcpy(out, &f, 64);
}
// widen16, or widen16_clean for FP8 codes where kClean
template <bool kClean, class T>
[[gnu::always_inline]] inline void widen16_as(const T* p, float* out) {
  if constexpr (kClean && std::is_same_v<T, uint8_t>) widen16_clean(p, out);
  else widen16(p, out);
}
// The first n < 16 of them (lanes past n: +0): a value row's last chunk where D % 16 != 0.
template <class T>
[[gnu::always_inline]] inline void widen16_tail(const T* p, int64_t n, float* out) {
  T e[16] = {};
  for (int64_t j = 0; j < n; ++j) e[j] = p[j];
  widen16(e, out);
}

template <class T>
constexpr bool kScaled = std::is_same_v<T, uint8_t>;  // FP8: each position times its scale

// The lines of n stored elements from p, for the cache hierarchy (the slab two ahead: the K/V of
// earlier layers were evicted by the weights streamed since, and the hardware prefetcher starts late).
template <class T>
[[gnu::always_inline]] inline void prefetch_elems(const T* p, int64_t n) {
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + o);
}

// s[r][j] = sum_d qr[r][d] k[j][d] for all R rows and the slab's 16 keys, each a sequential fma
// over d from +0 (cpu_attn_query's order), in registers; lanes of positions past n hold whatever
// the slab holds there (stale data, never read).
//   qr: [R][D]; ks: the slab [D][kAttnSlab]; sc: FP8 scales of its 16 positions; s: row r at s + r * lds
template <int R, bool kClean, class T>
[[gnu::always_inline]] inline void group_scores_slab(const float* qr, const T* ks, const float* sc, int64_t D, float* s,
                                                     int64_t lds) {
  float acc[R][kAttnSlab] = {};
  for (int64_t d = 0; d < D; ++d) {
    float k[kAttnSlab];
    widen16_as<kClean>(ks + d * kAttnSlab, k);
    if constexpr (kScaled<T>)
      for (int j = 0; j < kAttnSlab; ++j) k[j] *= sc[j];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = qr[r * D + d];
#pragma GCC unroll 16
      for (int j = 0; j < kAttnSlab; ++j) acc[r][j] = std::fma(a, k[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kAttnSlab; ++j) s[r * lds + j] = acc[r][j];
}

// acc[r][d0 .. d0 + 16) = fma(p[r][j], v[j][d], acc[r][d]) for j < w in order (attn_pv's chain,
// continued across slabs), in registers; kFull: d0 + 16 <= D, else the lanes past D stay +0.
//   p: row r at p + r * ldp; v: [w][D] stored; sc: FP8 scales of the w positions; acc: [R][ldacc]
template <int R, bool kFull, bool kClean, class T>
[[gnu::always_inline]] inline void group_pv_chunk(const float* p, int64_t ldp, const T* v, const float* sc, int64_t w,
                                                  int64_t D, int64_t d0, float* acc, int64_t ldacc) {
  float a[R][16];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 16; ++l) a[r][l] = acc[r * ldacc + d0 + l];
  for (int64_t j = 0; j < w; ++j) {
    float x[16];
    if constexpr (kFull) widen16_as<kClean>(v + j * D + d0, x);
    else widen16_tail(v + j * D + d0, D - d0, x);
    if constexpr (kScaled<T>)
      for (int l = 0; l < 16; ++l) x[l] *= sc[j];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float pj = p[r * ldp + j];
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) a[r][l] = std::fma(pj, x[l], a[r][l]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 16; ++l) acc[r * ldacc + d0 + l] = a[r][l];
}

// cpu_attn_group in blocks of R rows (rows of the last block past G are zero and not stored), the
// cache's elements of type T read in place.
template <int R, class T>
[[gnu::always_inline]] inline void attn_group_blocks(const float* q, int64_t ldq, const attn_rounding* rq, int64_t G,
                                                     const attn_kv_source& kv, int64_t n, int64_t D, precision p_operand,
                                                     float* out, int64_t ldo, float* scratch) {
  const int64_t ns = round_up(n, kAttnSlab), Dp = round_up(D, 16), slab = D * kAttnSlab;
  const T* keys = static_cast<const T*>(kv.keys);
  const T* values = static_cast<const T*>(kv.values);
  // FP8 slabs flagged free of subnormal codes take the shorter widen (never for other types)
  auto clean = [&](int64_t j0, uint8_t bit) {
    return kScaled<T> && kv.subnormal && !(kv.subnormal[j0 / kAttnSlab] & bit);
  };
  float* qr = scratch;             // [R][D] rounded queries (zero rows past G)
  float* s = qr + kGroupRows * D;  // [R][ns] scores, then probabilities
  float* acc = s + kGroupRows * ns;  // [R][Dp] P.V accumulators
  for (int64_t r0 = 0; r0 < G; r0 += R) {
    const int64_t B = std::min<int64_t>(R, G - r0);
    for (int64_t r = 0; r < R; ++r) {
      float* row = qr + r * D;
      if (r >= B) {
        std::fill_n(row, D, 0.0f);
        continue;
      }
      std::copy_n(q + (r0 + r) * ldq, D, row);
      attn_round_row(row, D, rq[r0 + r]);
    }
    for (int64_t j0 = 0; j0 < n; j0 += kAttnSlab) {
      const T* ks = keys + j0 / kAttnSlab * slab;
      if (j0 + 2 * kAttnSlab < n) prefetch_elems(ks + 2 * slab, slab);
      if (clean(j0, kSubnormalK)) group_scores_slab<R, true>(qr, ks, kv.kscale + j0, D, s + j0, ns);
      else group_scores_slab<R, false>(qr, ks, kScaled<T> ? kv.kscale + j0 : nullptr, D, s + j0, ns);
    }
    for (int64_t r = 0; r < B; ++r) cpu_attn_softmax(s + r * ns, n, D, p_operand);
    for (int64_t i = B * ns; i < R * ns; ++i) s[i] = 0.0f;  // rows past G add +0 to unused accumulators
    for (int64_t i = 0; i < R * Dp; ++i) acc[i] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += kAttnSlab) {
      const int64_t w = std::min(kAttnSlab, n - j0);
      const T* v = values + j0 * D;
      if (j0 + 2 * kAttnSlab < n) prefetch_elems(v + 2 * slab, slab);
      const float* sc = kScaled<T> ? kv.vscale + j0 : nullptr;
      int64_t d0 = 0;
      if (clean(j0, kSubnormalV))
        for (; d0 + 16 <= D; d0 += 16) group_pv_chunk<R, true, true>(s + j0, ns, v, sc, w, D, d0, acc, Dp);
      else
        for (; d0 + 16 <= D; d0 += 16) group_pv_chunk<R, true, false>(s + j0, ns, v, sc, w, D, d0, acc, Dp);
      if (d0 < D) group_pv_chunk<R, false, false>(s + j0, ns, v, sc, w, D, d0, acc, Dp);
    }
    for (int64_t r = 0; r < B; ++r)
      for (int64_t d = 0; d < D; ++d) out[(r0 + r) * ldo + d] = acc[r * Dp + d];
  }
}

template <class T>
[[gnu::always_inline]] inline void attn_group_typed(const float* q, int64_t ldq, const attn_rounding* rq, int64_t G,
                                                    const attn_kv_source& kv, int64_t n, int64_t D, precision p_operand,
                                                    float* out, int64_t ldo, float* scratch) {
  if (G >= 5) attn_group_blocks<8, T>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch);
  else if (G >= 3) attn_group_blocks<4, T>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch);
  else if (G == 2) attn_group_blocks<2, T>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch);
  else attn_group_blocks<1, T>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch);
}
}  // namespace

int64_t cpu_attn_group_scratch(int64_t n, int64_t D) {
  return kGroupRows * D + kGroupRows * round_up(n, kAttnSlab) + kGroupRows * round_up(D, 16);
}

// Row blocks of 8, or of the smallest power of two holding G below that (G = 2 would otherwise
// pay for 8 rows of arithmetic). With an FP8 cache, DAZ is cleared for the call and restored
// after: the scaled K/V and the products of tiny scales may be denormal, and the reference
// (cpu_attn_query on e4m3_to_float(code) * scale) computes them in IEEE mode.
FP8RL_VECTOR_CLONES void cpu_attn_group(const float* q, int64_t ldq, const attn_rounding* rq, int64_t G,
                                        const attn_kv_source& kv, int64_t n, int64_t D, precision p_operand, float* out,
                                        int64_t ldo, float* scratch) {
  switch (kv.dtype) {
    case kv_dtype::f32: attn_group_typed<float>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch); break;
    case kv_dtype::bf16: attn_group_typed<uint16_t>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch); break;
    case kv_dtype::fp8: {
      const unsigned csr = _mm_getcsr();
      if (csr & kMxcsrDaz) _mm_setcsr(csr & ~kMxcsrDaz);
      attn_group_typed<uint8_t>(q, ldq, rq, G, kv, n, D, p_operand, out, ldo, scratch);
      if (csr & kMxcsrDaz) _mm_setcsr(csr);
      break;
    }
  }
}

namespace {

constexpr int64_t kKeyChunk = 16;  // keys per register block in the backward's score kernel

struct kv_view {  // rounded K^T [D][ld] (ld = n rounded up to kKeyChunk, zero-padded), K [n][D] and V [n][D]
  std::vector<float> kt, k, v;
  int64_t ld = 0;
};

// The keys one sequence's queries see, in order: its prefix sequence's rows [p0, p0 + np), then
// its own rows [s0, s0 + n). Query row i of the sequence (token s0 + i) sees keys 0 .. np + i.
struct key_rows {
  int64_t p0 = 0, np = 0, s0 = 0, n = 0;
  int64_t total() const { return np + n; }
  int64_t row(int64_t j) const { return j < np ? p0 + j : s0 + j - np; }  // token of key j
};

FP8RL_VECTOR_CLONES void gather_kv(const attn_params& p, const float* k, const float* v, const key_rows& kr, int64_t g,
                                   kv_view& out) {
  const int64_t D = p.D, KV = p.KV, n = kr.total();
  const attn_rounding rk{p.operand, p.k_scale ? p.k_scale[g] : 0.0f};
  const attn_rounding rv{p.operand, p.v_scale ? p.v_scale[g] : 0.0f};
  out.ld = (n + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  out.k.resize(static_cast<size_t>(n * D));
  out.v.resize(static_cast<size_t>(n * D));
  for (int64_t j = 0; j < n; ++j) {
    std::copy_n(k + (kr.row(j) * KV + g) * D, D, out.k.data() + j * D);
    std::copy_n(v + (kr.row(j) * KV + g) * D, D, out.v.data() + j * D);
  }
  attn_round_row(out.k.data(), n * D, rk);
  attn_round_row(out.v.data(), n * D, rv);
  out.kt.assign(static_cast<size_t>(D * out.ld), 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) out.kt[d * out.ld + j] = out.k[j * D + d];
}

// Calls fn(kv head g, {root sequence, then the sequences it prefixes, in order}) for every root
// sequence (no prefix of its own) and KV head, in parallel: a family's tasks share the root's
// dK/dV, so one task owns them (a fixed order of accumulation).
template <class Fn>
void for_each_family_group(const attn_params& p, Fn&& fn) {
  std::vector<std::vector<int64_t>> fam;
  std::vector<int64_t> root_of(static_cast<size_t>(p.S), -1);
  for (int64_t s = 0; s < p.S; ++s) {
    const int32_t pre = p.prefix ? p.prefix[s] : -1;
    if (pre < 0) {
      root_of[s] = static_cast<int64_t>(fam.size());
      fam.push_back({s});
    } else {
      if (pre >= s || root_of[pre] < 0)
        throw std::invalid_argument("attention: sequence " + std::to_string(s) + " has prefix " + std::to_string(pre) +
                                    " (need an earlier sequence without a prefix of its own)");
      fam[static_cast<size_t>(root_of[pre])].push_back(s);
    }
  }
  const int64_t F = static_cast<int64_t>(fam.size());
  tbb::parallel_for(int64_t{0}, F * p.KV, [&](int64_t i) { fn(i % p.KV, fam[static_cast<size_t>(i / p.KV)]); });
}

// The key rows of family member s (fam[0] is the root).
key_rows family_keys(const attn_params& p, const std::vector<int64_t>& fam, int64_t s) {
  key_rows kr;
  kr.s0 = p.seq_start[s];
  kr.n = p.seq_start[s + 1] - kr.s0;
  if (s != fam[0]) {
    kr.p0 = p.seq_start[fam[0]];
    kr.np = p.seq_start[fam[0] + 1] - kr.p0;
  }
  return kr;
}

// Rounded K and V of one sequence and KV head in both orientations: [D][ld] feeds loops over
// keys j (vectorized across j), [n][D] feeds loops over d.
struct kv_both {
  kv_view t;              // kt [D][ld], k [n][D], v [n][D]
  std::vector<float> vt;  // vt [D][ld] (zero-padded like kt)
};

constexpr int64_t kRowBlock = 8;  // query rows per block: K, V, dK, dV rows are read once per block

// acc[r][j] = fma(a[r * lda], b[j], acc[r][j]) for the whole register block (one d step).
[[gnu::always_inline]] inline void rank1_block(const float* a, int64_t lda, const float* b,
                                               float (&acc)[kRowBlock][kKeyChunk]) {
#pragma GCC unroll 8
  for (int r = 0; r < kRowBlock; ++r) {
    const float ar = a[r * lda];
#pragma GCC unroll 16
    for (int j = 0; j < kKeyChunk; ++j) acc[r][j] = std::fma(ar, b[j], acc[r][j]);
  }
}

// s[r][j] = sum_d q[r][d] k[j][d] and dp[r][j] = sum_d dout[r][d] v[j][d] for all kRowBlock rows
// (rows >= B have zero operands and are not stored) and keys j < nk, each a sequential fma over d
// from +0, in registers: 8 rows x 16 keys of both, one K^T and one V^T load per 16 fmas.
//   qb, ob: [kRowBlock][D]; kt, vt: [D][ld] zero-padded; s, dp: [B][nk]
// kDp = false computes s only (the forward; ob, vt and dp unused).
template <bool kDp>
FP8RL_VECTOR_CLONES void attn_scores_block(const float* qb, const float* ob, int64_t B, const float* kt, const float* vt,
                                           int64_t ld, int64_t nk, int64_t D, float* s, float* dp) {
  for (int64_t jc = 0; jc < nk; jc += kKeyChunk) {
    float as[kRowBlock][kKeyChunk] = {}, ap[kRowBlock][kKeyChunk] = {};
    for (int64_t d = 0; d < D; ++d) {
      rank1_block(qb + d, D, kt + d * ld + jc, as);
      if constexpr (kDp) rank1_block(ob + d, D, vt + d * ld + jc, ap);
    }
    const int64_t w = std::min(kKeyChunk, nk - jc);
    for (int64_t r = 0; r < B; ++r)
      for (int64_t j = 0; j < w; ++j) {
        s[r * nk + jc + j] = as[r][j];
        if constexpr (kDp) dp[r * nk + jc + j] = ap[r][j];
      }
  }
}

// dq[r] = sum over keys j <= i0+r (increasing) of dS[r][j] k[j]; dK[j] += dS[r][j] q[r] and
// dV[j] += P[r][j] dout[r] over the rows r that see key j (increasing): accumulators in registers.
template <int D>
FP8RL_VECTOR_CLONES void attn_grads_block(const float* qb, const float* ob, int64_t B, int64_t i0, const float* k,
                                          const float* s, const float* dp, int64_t nk, float* dq, int64_t ldq,
                                          float* dK, float* dV) {
  attn_pv_rows<D>(dp, nk, B, i0, k, dq, ldq);  // dq[r] = sum_j dS[r][j] k[j]: the P.V order
  for (int64_t j = 0; j < nk; ++j) {
    float ak[D], av[D];
    for (int d = 0; d < D; ++d) ak[d] = dK[j * D + d], av[d] = dV[j * D + d];
    for (int64_t r = j > i0 ? j - i0 : 0; r < B; ++r) {
      const float ds = dp[r * nk + j], pj = s[r * nk + j];
#pragma GCC unroll 8
      for (int d = 0; d < D; ++d) {
        ak[d] = std::fma(ds, qb[r * D + d], ak[d]);
        av[d] = std::fma(pj, ob[r * D + d], av[d]);
      }
    }
    for (int d = 0; d < D; ++d) dK[j * D + d] = ak[d], dV[j * D + d] = av[d];
  }
}

// The same sums for any D, memory-resident (row_fma), in the same per-element order.
FP8RL_VECTOR_CLONES void attn_grads_block_any(const float* qb, const float* ob, int64_t B, int64_t i0, const float* k,
                                              const float* s, const float* dp, int64_t nk, int64_t D, float* dq,
                                              int64_t ldq, float* dK, float* dV) {
  for (int64_t r = 0; r < B; ++r)
    for (int64_t d = 0; d < D; ++d) dq[r * ldq + d] = 0.0f;
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t r = j > i0 ? j - i0 : 0; r < B; ++r) {
      const float dsj = dp[r * nk + j], pj = s[r * nk + j];
      row_fma(dsj, k + j * D, dq + r * ldq, D);
      row_fma(dsj, qb + r * D, dK + j * D, D);
      row_fma(pj, ob + r * D, dV + j * D, D);
    }
}

// One query row of the backward: qb = rounded q, ob = dout, Di = sum_d dout[d] * out[d] (16
// lanes, lane d % 16, added in lane order: a fixed order; the forward/decode never computes it).
FP8RL_VECTOR_CLONES void attn_backward_row_prep(const float* __restrict q, const float* __restrict dout,
                                                const float* __restrict out, int64_t D, const attn_rounding& rq,
                                                float* __restrict qb, float* __restrict ob, float* Di) {
  for (int64_t d = 0; d < D; ++d) qb[d] = q[d], ob[d] = dout[d];
  attn_round_row(qb, D, rq);
  float lane[16] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) lane[l] += dout[d + l] * out[d + l];
  for (int l = 0; d < D; ++d, ++l) lane[l] += dout[d] * out[d];
  float s = 0.0f;
  for (float x : lane) s += x;
  *Di = s;
}

// Backward of query rows i0 .. i0+B-1 (row r sees keys 0..i0+r) of one head. Per output element
// the order is the unblocked one: scores are a sequential fma over d (as the forward computes
// them), dq sums keys in increasing j, and dK/dV add rows in increasing i.
//   qb, ob: rounded q and dout rows [kRowBlock][D] (rows >= B zero); dq: row r at +r*ldq;
//   lse[r]; s, dp: scratch [B][nk]
FP8RL_VECTOR_CLONES void attn_rows_backward(const float* qb, const float* ob, const float* Di, const float* lse, int64_t B, int64_t i0,
                        float scale, const kv_both& kv, int64_t D, const attn_rounding& rp, float* s, float* dp,
                        float* dq, int64_t ldq, float* dK, float* dV) {
  const int64_t nk = i0 + B;  // keys any row of the block sees
  attn_scores_block<true>(qb, ob, B, kv.t.kt.data(), kv.vt.data(), kv.t.ld, nk, D, s, dp);
  for (int64_t r = 0; r < B; ++r) {
    float* sr = s + r * nk;
    float* dr = dp + r * nk;
    const float lr = lse[r], di = Di[r];
    for (int64_t j = 0; j <= i0 + r; ++j) {
      const float prob = cpu_exp(sr[j] * scale - lr);
      sr[j] = prob;
      dr[j] = prob * (dr[j] - di) * scale;  // dS
    }
    attn_round_row(sr, i0 + r + 1, rp);  // the probability the forward used with V
  }
  const float* k = kv.t.k.data();
  switch (D) {
    case 32: attn_grads_block<32>(qb, ob, B, i0, k, s, dp, nk, dq, ldq, dK, dV); break;
    case 64: attn_grads_block<64>(qb, ob, B, i0, k, s, dp, nk, dq, ldq, dK, dV); break;
    case 128: attn_grads_block<128>(qb, ob, B, i0, k, s, dp, nk, dq, ldq, dK, dV); break;
    default: attn_grads_block_any(qb, ob, B, i0, k, s, dp, nk, D, dq, ldq, dK, dV);
  }
}

}  // namespace

namespace {

// Per-task scratch of the row kernels, kept across a family's sequences (no allocation per
// sequence: a GRPO family has one per sample, of a few rows each).
struct attn_scratch {
  std::vector<float> qb, ob, sc, dp, Di, lr;
  void fit(int64_t D, int64_t nt) {  // kRowBlock rows of D; kRowBlock rows of nt keys
    for (auto* v : {&qb, &ob}) v->resize(static_cast<size_t>(kRowBlock * D));
    for (auto* v : {&sc, &dp}) v->resize(static_cast<size_t>(kRowBlock * nt));
    for (auto* v : {&Di, &lr}) v->resize(kRowBlock);
  }
};

// Forward of one sequence's query rows (key_rows kr, kv = its gathered keys) for the heads of
// KV group g: out and lse at the rows' tokens.
void attn_forward_seq(const attn_params& p, const float* q, const kv_view& kv, const key_rows& kr, int64_t g, float* out,
                      float* lse, attn_scratch& ws) {
  const int64_t H = p.H, D = p.D, G = p.H / p.KV;
  ws.fit(D, kr.total());
  std::vector<float>& qb = ws.qb;
  float* sc = ws.sc.data();
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    const attn_rounding rq{p.operand, p.q_scale ? p.q_scale[h] : 0.0f};
    for (int64_t i = 0; i < kr.n; i += kRowBlock) {
      const int64_t B = std::min(kRowBlock, kr.n - i), i0 = kr.np + i, nk = i0 + B;  // row r sees keys 0..i0+r
      std::fill(qb.begin() + B * D, qb.end(), 0.0f);
      for (int64_t r = 0; r < B; ++r) std::copy_n(q + ((kr.s0 + i + r) * H + h) * D, D, qb.begin() + r * D);
      attn_round_row(qb.data(), B * D, rq);
      attn_scores_block<false>(qb.data(), nullptr, B, kv.kt.data(), nullptr, kv.ld, nk, D, sc, nullptr);
      for (int64_t r = 0; r < B; ++r)
        lse[(kr.s0 + i + r) * H + h] = cpu_attn_softmax(sc + r * nk, i0 + r + 1, D, p.operand);
      attn_pv_rows_any(sc, nk, B, i0, kv.v.data(), D, out + ((kr.s0 + i) * H + h) * D, H * D);
    }
  }
}

// Backward of one sequence's query rows for the heads of KV group g: dq at the rows' tokens;
// adds into dK, dV [kr.total()][D] (the gathered keys' order).
void attn_backward_seq(const attn_params& p, const float* q, const float* out, const float* lse, const float* dout,
                       const kv_both& kv, const key_rows& kr, int64_t g, float* dq, float* dK, float* dV,
                       attn_scratch& ws) {
  const int64_t H = p.H, D = p.D, G = p.H / p.KV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  ws.fit(D, kr.total());
  std::vector<float>&qb = ws.qb, &ob = ws.ob, &sc = ws.sc, &dp = ws.dp, &Di = ws.Di, &lr = ws.lr;
  const attn_rounding rp{p.operand, 0.0f};
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    const attn_rounding rq{p.operand, p.q_scale ? p.q_scale[h] : 0.0f};
    for (int64_t i = 0; i < kr.n; i += kRowBlock) {
      const int64_t B = std::min(kRowBlock, kr.n - i);
      std::fill(qb.begin() + B * D, qb.end(), 0.0f);  // rows past the block: zero operands
      std::fill(ob.begin() + B * D, ob.end(), 0.0f);
      for (int64_t r = 0; r < B; ++r) {
        const int64_t t = kr.s0 + i + r;
        attn_backward_row_prep(q + (t * H + h) * D, dout + (t * H + h) * D, out + (t * H + h) * D, D, rq,
                               qb.data() + r * D, ob.data() + r * D, &Di[r]);
        lr[r] = lse[t * H + h];
      }
      attn_rows_backward(qb.data(), ob.data(), Di.data(), lr.data(), B, kr.np + i, scale, kv, D, rp, sc.data(),
                         dp.data(), dq + ((kr.s0 + i) * H + h) * D, H * D, dK, dV);
    }
  }
}

// dst rows [s0, s0 + n) of a [T, KV, D] tensor, head g, from src [n][D].
void store_head_rows(const float* src, int64_t n, int64_t s0, int64_t KV, int64_t D, int64_t g, float* dst) {
  for (int64_t j = 0; j < n; ++j) std::copy_n(src + j * D, D, dst + ((s0 + j) * KV + g) * D);
}

}  // namespace

// Training/prefill forward: per block of kRowBlock query rows the scores in registers (the
// same sequential fma over d as cpu_attn_query), per row cpu_attn_softmax, then P.V in the
// attn_pv order: every value equals what the decode path computes for that row, and a row
// behind a shared prefix equals the same row of the unshared sequence.
void cpu_attention_forward(const attn_params& p, const float* q, const float* k, const float* v, float* out, float* lse) {
  for_each_family_group(p, [&](int64_t g, const std::vector<int64_t>& fam) {
    kv_view kv;
    attn_scratch ws;
    for (int64_t s : fam) {
      const key_rows kr = family_keys(p, fam, s);
      if (kr.n <= 0) continue;
      gather_kv(p, k, v, kr, g, kv);
      attn_forward_seq(p, q, kv, kr, g, out, lse, ws);
    }
  });
}

// Per family and KV group: the root's rows, then each prefixed sequence's rows in order; a
// prefix's dK/dV collect its own rows' terms, then each sequence's behind it (a fixed order).
void cpu_attention_backward(const attn_params& p, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv) {
  const int64_t KV = p.KV, D = p.D;
  for_each_family_group(p, [&](int64_t g, const std::vector<int64_t>& fam) {
    kv_both kv;
    attn_scratch ws;
    std::vector<float> dK, dV;  // [root rows + current sequence's rows][D]
    int64_t nroot = 0;
    for (int64_t s : fam) {
      const key_rows kr = family_keys(p, fam, s);
      if (s == fam[0]) nroot = kr.n;
      if (kr.n <= 0) continue;
      gather_kv(p, k, v, kr, g, kv.t);
      const int64_t ld = kv.t.ld, nt = kr.total();
      kv.vt.assign(static_cast<size_t>(D * ld), 0.0f);
      for (int64_t j = 0; j < nt; ++j)
        for (int64_t d = 0; d < D; ++d) kv.vt[d * ld + j] = kv.t.v[j * D + d];
      dK.resize(static_cast<size_t>(nt * D));  // the root's rows keep their sums; the own rows start at 0
      dV.resize(static_cast<size_t>(nt * D));
      std::fill(dK.begin() + kr.np * D, dK.end(), 0.0f);
      std::fill(dV.begin() + kr.np * D, dV.end(), 0.0f);
      attn_backward_seq(p, q, out, lse, dout, kv, kr, g, dq, dK.data(), dV.data(), ws);
      if (s != fam[0]) {
        store_head_rows(dK.data() + kr.np * D, kr.n, kr.s0, KV, D, g, dk);
        store_head_rows(dV.data() + kr.np * D, kr.n, kr.s0, KV, D, g, dv);
      }
    }
    if (nroot > 0) {
      store_head_rows(dK.data(), nroot, p.seq_start[fam[0]], KV, D, g, dk);
      store_head_rows(dV.data(), nroot, p.seq_start[fam[0]], KV, D, g, dv);
    }
  });
}

}  // namespace fp8rl::models
