// quant/gemm_impl.hpp -- internal: kernels behind quant/gemm.hpp's dispatch.
// Panel layouts are documented on gemm_packed_b. Kernels write C[M][N] (ldc = N).
#pragma once
#include <span>
#include "quant/gemm.hpp"

namespace fp8rl::quant::detail {

// Byte of a 64-byte FP8 pair step that decoded word w (0..31) of half `half` comes from: the
// unpack order -- 128-bit lane w / 8 holds half 0's words in its low 8 bytes and half 1's in its
// high 8, so byte unpacks (VPUNPCKL/HBW) put both halves in VDPBF16PS pair order.
inline int fp8_step_byte(int half, int w) { return (w / 8) * 16 + half * 8 + w % 8; }
// Byte position of B element (column j in panel 0..31, pair half h): word 2 * (j % 16) + h of
// half j / 16 (a decoded half holds 16 columns' BF16 pairs).
inline int fp8_stream_pos(int j, int h) { return fp8_step_byte(j >= 16 ? 1 : 0, 2 * (j & 15) + h); }

// Codes outside the affine decoder's range: exponent field zero (±0, subnormals) or NaN.
inline bool fp8_code_rare(uint8_t c) { return (c & 0x78) == 0 || (c & 0x7f) == 0x7f; }

// The accumulation model of a kernel (quant/gemm.hpp): sequential FP32, BF16 pairs (odd element
// first, DAZ/FTZ), or FP8 (pairs per 128-K block, then the scaled promotion).
enum class gemm_model : uint8_t { seq, pairs, fp8 };

// The narrow FP8 kernels decode B's codes to their values times 2^-8 (quant/gemm_avx512.cpp) and
// read A's values times 2^8 (exact in BF16: |value| <= 448 * 2^8), so each product is exact.
inline constexpr int kCodesAExp = 8;
inline constexpr float kCodesAScale = 1 << kCodesAExp;  // 2^kCodesAExp

// A operand prepared for a kernel: values zero-padded to lda = Kp, as FP32 (wide kernels) or
// BF16 (narrow kernels; the fp8 model's times 2^kCodesAExp); FP8 scales [M][KB].
struct gemm_a_operand {
  int64_t M = 0, lda = 0;
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const float* scale_inv = nullptr;
};

void gemm_wide_avx512(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C);
// C_i = A B_i^T for each output (same K, same forms), in one parallel region.
// fp8 model: reads B.fp8 (E4M3 codes, decoded in registers), or with decoded_b the decoded
// form B.bf16; else B.bf16 (BF16 pairs). decode_once: FP8 codes at 8 < M <= 32 decoded once per
// block for all row tiles (gemm_decode)
struct gemm_out {
  const gemm_packed_b* B;
  float* C;
};
void gemm_narrow_avx512(gemm_model model, const gemm_a_operand& A, std::span<const gemm_out> outs,
                        bool decode_once = false, bool decoded_b = false);
inline void gemm_narrow_avx512(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C,
                               bool decode_once = false, bool decoded_b = false) {
  const gemm_out out{&B, C};
  gemm_narrow_avx512(model, A, {&out, 1}, decode_once, decoded_b);
}
// Fills B.bf16 (sized [NP][Kp/2][64]) with the decoded form of B.fp8: the words the codes
// kernel decodes in registers, rare steps patched.
void fp8_decode_pack_avx512(gemm_packed_b& B);
void gemm_wide_portable(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C);
// VDPBF16PS multiply-adds per second over FP32 FMA multiply-adds per second on this core
// (best of a few short runs of independent chains; needs AVX512_BF16).
double dpbf16_fma_rate_ratio();
// BF16 values of n E4M3 codes; codes_a: times 2^kCodesAExp (a narrow fp8 kernel's A operand)
void e4m3_to_bf16_avx512(const uint8_t* src, int64_t n, uint16_t* dst, bool codes_a = false);
void e4m3_to_f32_avx512(const uint8_t* src, int64_t n, float* dst);
// Row m of the tile-ordered A array ([Mp/16][KS][16][32], as tiles_put_row) from K E4M3 codes:
// their BF16 values, times scale[k / 128] when scale is given (power-of-two scales: exact),
// zero past K. One pass: decode, scale and store per 64 codes.
void tiles_put_fp8_row(uint16_t* tiles, int64_t KS, int64_t m, const uint8_t* src, int64_t K, const float* scale);
// Packs k < (returned) of a full 32-column FP8 panel (rows at src + j * K) into the wide and/or
// narrow forms (null: skip), exactly as gemm_pack_fp8's scalar loop; needs AVX512_BF16+VBMI.
int64_t fp8_pack_panel_avx512(const uint8_t* src, int64_t K, float* wide, uint8_t* narrow);
// OR-s bit i % 64 of bits[i / 64] for each of `steps` 64-byte pair steps at codes (64-byte
// aligned) holding a code fp8_code_rare takes; as the scalar scan, needs AVX-512 BW.
void fp8_rare_steps_avx512(const uint8_t* codes, int64_t steps, uint64_t* bits);

// Tile GEMM problem (quant/gemm_amx.cpp). A in tile order [Mp/16][KS][16][32] BF16 (Mp: M
// zero-padded to 32); with sa (1x128 scales of A, [Mp][KB]) the sum is promoted per 128-K block with
// B's per-block scales, else one tile sum over all of K (pow2 scales folded into the values).
struct tiles_problem {
  int64_t M = 0, Mp = 0, N = 0, KS = 0;
  const uint16_t* a = nullptr;
  const gemm_packed_b* b = nullptr;
  const float* sa = nullptr;  // [Mp][KB] or null (no promotion: one block over all of K)
  int64_t KB = 1;
  bool accumulate = false;    // C += result (one add per element) instead of C = result
};
void gemm_tiles_amx(const tiles_problem& p, float* C);
// One row of A in tile order: dst at row m of the [Mp/16][KS][16][32] array; src row of n
// BF16 values (n <= 32 * KS), the rest of the row's KS steps written as zeros (with src = null
// and n = 0: a zero padding row).
void tiles_put_row(uint16_t* tiles, int64_t KS, int64_t m, const uint16_t* src, int64_t n);
// One panel of B's tile form (gemm_packed_b::tiles) from its columns: cols [32][Kt] BF16 values,
// zero-padded -> panel [Kt/32][2 halves][16 k-pairs][16 columns][2]: per 1 KiB tile a 16x16
// register transpose of 32-bit pairs, written sequentially.
void tiles_put_panel(uint16_t* panel, int64_t Kt, const uint16_t* cols);
// row[0..n) *= s in place, for BF16 values whose product is exact (s a power of two): the
// fp8 pow2 fold. Truncation back to BF16 is then exact.
void tiles_scale_row(uint16_t* row, int64_t n, float s);

}  // namespace fp8rl::quant::detail
