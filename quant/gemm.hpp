// quant/gemm.hpp -- CPU GEMMs C[M,N] = A[M,K] · B[N,K]^T (row-major; lda = ldb = K, ldc = N).
// defines: gemm_desc, gemm_config, gemm_packed_b, gemm_pack_{f32,bf16,fp8},
//          gemm_{f32,bf16,fp8}, gemm_{bf16,fp8}_group, gemm_{f32,bf16,fp8}_ref, gemm_fp8_exact_ref, gemm_tiles_available,
//          gemm_{bf16,fp8}_tiles
//
// Each precision has a scalar reference (`*_ref`, built with -ffp-contract=off) that defines
// the result bit for bit, and a fast path that must equal it exactly:
//   f32   out = fma(a[k], b[k], out) for k = 0..K-1 (sequential)
//   bf16  acc over pairs i = 0..K/2-1: acc = fma(a[2i+1], b[2i+1], acc);
//         acc = fma(a[2i], b[2i], acc), inputs DAZ, each result FTZ (the VDPBF16PS model)
//   fp8   fp8-numerics.md §5.2: per 128-K block the bf16 pair model on decoded (unscaled)
//         E4M3 values, then out = fma(sa[m][kb] * sb[n][kb], acc, out)
// Every output element has one fixed accumulation order that depends on neither M, the
// thread count nor the tiling: results are batch-invariant (generation and training agree).
// A ragged K is zero-padded (padding contributes exactly nothing to these models).
//
// The tile GEMMs (`*_tiles`, AMX TDPBF16PS) are the CPU's tensor-core path and, like cuBLASLt,
// are NOT bit-exact: the order inside one TDPBF16PS is undocumented. They compute the same
// exact products in FP32 (BF16 inputs; E4M3 values are exact in BF16) and are checked against
// FP64 under the FP32 accumulation bound (tests/tolerances.hpp gemm_tiles_bound):
//   bf16        C = sum over k of a[k]*b[k], FP32 tile accumulation over all of K
//   fp8, pow2   the same on (q_a * sa) and (q_b * sb): power-of-two scales fold into the
//               BF16 values exactly, so no promotion is needed -- as long as the folded value
//               is a normal number: TDPBF16PS reads BF16 subnormals as 0, so in a block whose
//               scale_inv is below 2^-117 (amax below ~1e-33) the smallest codes count as 0
//   fp8, fp32   per 128-K block the tile sum of q_a * q_b, then out = fma(sa * sb, acc, out)
// Row results do not depend on M (rows never mix), so they are batch-invariant among
// themselves, but they differ from the exact kernels in the last bits.
#pragma once
#include <cstdint>
#include <span>
#include <string>

#include "quant/aligned.hpp"
#include "quant/cpu_isa.hpp"
#include "quant/qtensor.hpp"

namespace fp8rl::quant {

struct gemm_desc {  // the problem
  int64_t M = 0, N = 0, K = 0;
  void check() const;  // throws std::invalid_argument naming the bad dimension
  std::string str() const;
};

// Which kernel family runs a large-M problem. Both give the same bits; which is faster depends on
// the core: VDPBF16PS does 32 MACs per instruction, FP32 FMA 16, and their issue rates differ by
// CPU (measured: Sapphire Rapids-class Xeon 0.5 vs 2 per cycle, so `wide` wins; Zen 5 EPYC runs
// VDPBF16PS at the FMA rate, so `narrow` wins by 2x). `automatic` asks gemm_narrow_preferred().
enum class gemm_kernel : uint8_t { automatic, wide, narrow };

// How the narrow FP8 kernel decodes codes for batched decode (8 < M <= 32, several row tiles):
// each 128-K block `once` into L1 for all row tiles, or in registers `per_tile`. Same bits.
// `automatic`: once where VDPBF16PS is slower than FMA (Xeon: 1.12x the per-tile decode), per
// tile where it runs at the FMA rate (Zen 5: 1.1-1.5x the L1 pass, M = 16 and 32).
enum class gemm_decode : uint8_t { automatic, once, per_tile };

struct gemm_config {  // tuning only; never changes a result
  cpu_isa max_isa = cpu_isa::amx;  // further limited by cpu_isa_active()
  int64_t stream_max_m = 16;  // M <= this: stream the narrow form (GEMV/decode: bytes matter)
  gemm_kernel large_m = gemm_kernel::automatic;  // M > stream_max_m
  gemm_decode batched_decode = gemm_decode::automatic;
};

// True when this CPU's VDPBF16PS outruns FP32 FMA per multiply-add (a one-time
// probe of both instruction streams on the calling thread, about a millisecond, cached).
bool gemm_narrow_preferred();

// Which packed forms of B to build. Every kernel gives the same bits; forms trade memory for
// speed: `wide` (FP32 values) feeds FMA kernels, `narrow` (BF16 pairs, or for FP8 the E4M3
// codes, decoded to BF16 pairs in registers) feeds VDPBF16PS kernels. `decoded` (fp8, with
// `narrow`, AVX512_BF16) adds the codes decoded once to BF16 pairs, which large-M narrow GEMMs
// read instead of decoding each pair step for every 8-row tile (2048^3 on Zen 5: ~3% faster);
// small M still streams the 1-byte codes. 2 more bytes per weight and a pass at packing: for
// weights many large-M calls read, not for training's per-step packs (measured no faster there),
// so gemm_forms_for does not ask for it.
// Whatever is asked, packing adds the form the active CPU needs.
// `tiles` (BF16 in AMX's VNNI tile order) feeds only the tile GEMMs.
struct gemm_pack_forms {
  bool wide = true;
  bool narrow = true;
  bool tiles = false;
  // large forms on transparent huge pages (quant/aligned.hpp), for weights kept for many calls
  // and streamed from DRAM (generation); copies of the pack stay there
  bool huge_pages = false;
  bool decoded = false;
};
// The forms automatic dispatch uses on this CPU: the large-M form (wide, or narrow where
// gemm_narrow_preferred), plus the narrow form when small-M (decode) calls will come.
gemm_pack_forms gemm_forms_for(bool small_m);

enum class gemm_dtype : uint8_t { f32, bf16, fp8 };

// B packed into 32-column panels (NP = ceil(N/32) panels, zero-padded). Weights are packed
// once per weight version; activations used as B (wgrad) are packed per call.
struct gemm_packed_b {
  gemm_dtype dtype = gemm_dtype::f32;
  scale_mode mode = scale_mode::pow2;  // fp8 only
  std::string name;
  int64_t N = 0, K = 0, Kp = 0;   // Kp: K zero-padded (f32: K, bf16: even, fp8: 128-multiple)
  avector_uninit<float> wide;     // [NP][Kp][32] values as FP32 (bf16/fp8: exact, unscaled); packers write all
  avector<uint16_t> bf16;         // bf16 narrow: [NP][Kp/2][32][2]; fp8 decoded: [NP][Kp/2][64] the
                                  // BF16 words * 2^-8 of the codes below, in the decoder's order
  avector<uint8_t> fp8;           // fp8 narrow: [NP][Kp/2][64] codes in decoder order (1.0 padding)
  avector<uint64_t> fp8_rare;     // fp8 narrow: [NP][Kp/128], bit i: pair step i of the block holds a
                                  // code the affine decoder cannot take (±0, subnormal, NaN) ...
  avector<uint32_t> fp8_rare_at;  // ... [NP][Kp/128 + 1] offset of the block's first such step in ...
  avector<uint16_t> fp8_rare_patch;  // ... patches, one per step: [k0 (2 words), k1 (2 words),
                                  // BF16 values * 2^-8 of the words k0 marks, then k1's]; k0 (k1)
                                  // marks the words of w0 (w1) it cannot take (fp8_step_byte)
  avector<float> scale_inv;       // fp8: [NP][Kp/128][32]
  avector<float> scale_panel;     // fp8 narrow, when each panel's columns share every block's scale
                                  // (128x128 blocks): [NP][Kp/128]; else empty
  // tiles: [NP][Kt/32][2 halves of 16 columns][16 k-pairs][16 columns][2]; fp8 pow2 values are
  // stored scaled (q * scale_inv, exact), fp8 fp32 unscaled; Kt = K zero-padded to 32 (fp8: Kp)
  avector_uninit<uint16_t> tiles;  // every element written by the packer
  int64_t Kt = 0;
  int64_t panels() const { return (N + 31) / 32; }
  int64_t bytes() const;
};

gemm_packed_b gemm_pack_f32(const float* B, int64_t N, int64_t K, std::string name = "B");
gemm_packed_b gemm_pack_bf16(const uint16_t* B, int64_t N, int64_t K, std::string name = "B",
                             gemm_pack_forms forms = {});
// B: any layout (block_128x128 weights, or 1x128 tiles as operand rows, e.g. wgrad's X^T).
gemm_packed_b gemm_pack_fp8(const qtensor& B, gemm_pack_forms forms = {});

// A of the FP8 tile GEMM, prepared once and usable by several GEMMs (layers reading one input):
// x [M][K] quantized as 1x128 rowwise tiles straight into tile order. A GEMM with it is
// bit-identical to gemm_fp8_tiles(quantize(x, M, K, rowwise_1x128, mode, name), B, C); a
// non-finite tile is the same error. Needs AMX.
struct gemm_tiles_a {
  std::string name;
  scale_mode mode = scale_mode::pow2;
  int64_t M = 0, Mp = 0, K = 0, Kt = 0;  // Mp: M rounded to 32; Kt: K rounded to 128
  avector_uninit<uint16_t> a;            // [Mp/16][Kt/32][16][32] BF16 values (pow2: scaled)
  avector<float> sa;                     // fp32 mode: scale_inv [Mp][Kt/128] (0 in padding rows)
};
gemm_tiles_a gemm_tiles_a_fp8(const float* x, int64_t M, int64_t K, scale_mode mode, std::string name);
// A = x^T for x [T][C] (wgrad's dY^T: M = C, K = T) as 1x128 columnwise tiles: equal to
// gemm_fp8_tiles(quantize(x, T, C, colwise_1x128, mode, name), B, C) in the same way.
gemm_tiles_a gemm_tiles_a_fp8_colwise(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name);
void gemm_fp8_tiles(const gemm_tiles_a& A, const gemm_packed_b& B, float* C, bool accumulate = false);

// wgrad's B operand straight from activations: x [T][C] quantized as 1x128 columnwise tiles
// (B = X^T, operand rows = columns of x) and laid out in the tile form only. Bit-identical to
// gemm_pack_fp8(quantize(x, T, C, colwise_1x128, mode, name), {false, false, true}) without the
// code array or a transpose; a non-finite tile is the same error. Needs AMX (tile GEMMs).
gemm_packed_b gemm_pack_fp8_colwise_tiles(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name);

// A weight W [N][K] quantized in 128x128 blocks straight into the tile forms (no code array, no
// transpose): *fwd = the B of x · W^T, *bwd = the B of dy · W (W^T, named name + ".T"); either
// may be null. Bit-identical to gemm_pack_fp8(quantize(W, N, K, block_128x128, mode, name),
// {false, false, true}) and to the same of qtensor_transpose_blocks(...); a non-finite block is
// the same error. Needs AMX.
void gemm_pack_fp8_blocks_tiles(const float* w, int64_t N, int64_t K, scale_mode mode, const std::string& name,
                                gemm_packed_b* fwd, gemm_packed_b* bwd);

// The wide (FP32 FMA) kernel's FP8 operands straight from FP32, for CPUs whose large-M FP8
// GEMMs run there (gemm_fp8_wide_large_m()): no code array, no decode pass, no transpose of
// codes. Each is bit-identical to quantizing and packing/decoding the codes, and a non-finite
// tile is the same error as quantize's.
// True when large-M FP8 GEMMs take the wide kernel on this CPU (AVX-512, FMA outrunning
// VDPBF16PS): only then do these forms save work (elsewhere the GEMM converts them).
bool gemm_fp8_wide_large_m();
// A: E4M3 values (unscaled) [M][Kp] and scale_inv [M][Kp/128] (rows padded to 32).
struct gemm_wide_a {
  std::string name;
  scale_mode mode = scale_mode::pow2;
  int64_t M = 0, K = 0, Kp = 0;
  avector_uninit<float> values;  // [Mp][Kp], Mp = M rounded to 32 (rows past M: scratch)
  avector_uninit<float> sa;      // [Mp][Kp/128]
};
// x [M][K] as 1x128 rowwise tiles: gemm_fp8(A, B, C) == gemm_fp8(quantize(x, M, K, rowwise_1x128,
// mode, name), B, C).
gemm_wide_a gemm_wide_a_fp8(const float* x, int64_t M, int64_t K, scale_mode mode, std::string name);
// A = x^T for x [T][C] (wgrad's dY^T: M = C, K = T) as 1x128 columnwise tiles: equal to
// gemm_fp8(quantize(x, T, C, colwise_1x128, mode, name), B, C) in the same way.
gemm_wide_a gemm_wide_a_fp8_colwise(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name);
void gemm_fp8(const gemm_wide_a& A, const gemm_packed_b& B, float* C, const gemm_config& cfg = {});
// wgrad's B = X^T for x [T][C] in the wide form only: equal to gemm_pack_fp8(quantize(x, T, C,
// colwise_1x128, mode, name), {true, false, false}).
gemm_packed_b gemm_pack_fp8_colwise_wide(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name);

// References (the definition of each result).
void gemm_f32_ref(const gemm_desc& d, const float* A, const float* B, float* C);
void gemm_bf16_ref(const gemm_desc& d, const uint16_t* A, const uint16_t* B, float* C);
// A: 1x128 tiles (rowwise, or colwise as its transposed operand). B: any layout.
void gemm_fp8_ref(const qtensor& A, const qtensor& B, float* C);
// fp8-numerics.md §5.4, the order-independent exact model: each 128-K block sum of q_a * q_b in
// int64 (units of 2^-18: every E4M3 value is a multiple of 2^-9), one RNE to FP32 per block, then
// the §5.2 promotion out = fma(sa * sb, acc, out). Its block sums do not depend on the order of
// the products, so it is the yardstick for kernels whose order is undocumented (tensor cores,
// AMX tiles). Same operands and errors as gemm_fp8_ref.
void gemm_fp8_exact_ref(const qtensor& A, const qtensor& B, float* C);

// Fast paths (oneTBB inside; the calling arena's threads).
void gemm_f32(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C,
              const gemm_config& cfg = {});
void gemm_bf16(const gemm_desc& d, const uint16_t* A, const gemm_packed_b& B, float* C,
               const gemm_config& cfg = {});
void gemm_fp8(const qtensor& A, const gemm_packed_b& B, float* C, const gemm_config& cfg = {});
// C_i = A · B_i^T for several B_i sharing A (a layer's q/k/v or gate/up at decode), bit for bit
// one gemm_bf16 / gemm_fp8 per B_i. Where the narrow kernel takes every B_i alike, they run as one
// parallel region: one thread-pool round trip, and a short B_i (k/v: 8 panels) streams as part of
// one range instead of as its own call. The C_i must not overlap; Bs.size() != Cs.size() throws
// std::invalid_argument.
void gemm_bf16_group(const uint16_t* A, int64_t M, int64_t K, std::span<const gemm_packed_b* const> Bs,
                     std::span<float* const> Cs, const gemm_config& cfg = {});
void gemm_fp8_group(const qtensor& A, std::span<const gemm_packed_b* const> Bs, std::span<float* const> Cs,
                    const gemm_config& cfg = {});

// Tile (AMX) paths; throw std::runtime_error without AMX or without B's tile form.
bool gemm_tiles_available();  // cpu_isa_active() >= amx
// accumulate = true: C += A · B^T, each element C + (the result the overwriting call gives),
// one rounding: what a caller adding a separate result would get, without the buffer and pass.
void gemm_bf16_tiles(const gemm_desc& d, const uint16_t* A, const gemm_packed_b& B, float* C, bool accumulate = false);
void gemm_fp8_tiles(const qtensor& A, const gemm_packed_b& B, float* C, bool accumulate = false);

}  // namespace fp8rl::quant
