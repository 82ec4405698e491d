// tests/tolerances.hpp -- every numeric tolerance of the test suite, named, with its reason.
// Bit-exact stages compare bytes (EXPECT_EQ on bits / memcmp); everything here is for stages
// that round differently by design. Tie each bound to a format (style.md practice 3).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace fp8rl::tol {

// E4M3 has 3 mantissa bits: RNE error <= 2^-4 relative to the element for normals.
inline constexpr double kE4M3RelHalfUlp = 1.0 / 16.0;
// E4M3 subnormal spacing is 2^-9 of the scale; half a spacing is the absolute error bound.
inline constexpr double kE4M3SubnormalHalfStep = 1.0 / 1024.0;
// FP32 GEMM vs FP64, normwise (calc_diff, which squares relative error): FP32 sums of K random-
// sign terms err ~sqrt(K)*2^-24 relative, i.e. calc_diff ~ K*2^-48 << 1e-9 for K <= 4096.
inline constexpr double kGemmF32VsF64Diff = 1e-9;
// BF16-input GEMM vs FP64 on the *same* BF16 inputs: products are exact, only FP32
// accumulation error remains, as above.
inline constexpr double kGemmBf16VsF64Diff = 1e-9;
// FP8 GEMM vs FP64 on the original (normal, outlier-free) data: each operand's E4M3 rounding
// has mean-square relative error 2^-8/3 * E[1/(1+f)^2] ~ 6.5e-4 (f: mantissa fraction), so two
// operands give calc_diff ~ 6.5e-4; DeepGEMM's FP8 bound (deep_gemm/testing/numeric.py) 0.001.
inline constexpr double kGemmFp8VsF64Diff = 1e-3;
// BF16 GEMM vs FP64 on the original FP32 data: each product carries two BF16 roundings (relative
// mean square <= 2^-16/3 each, kUnitRmsBF16^2), random-sign sums keep that relative mean square,
// and calc_diff is half of it: ~2^-16/3 ~ 5e-6. 4x: the spread of a few hundred outputs' sample.
inline constexpr double kGemmBf16VsF32DataDiff = 4.0 / 65536 / 3;

// FP32 model vs PyTorch FP32 (tools/make-golden.py): both round each op to FP32 but sum in
// different orders; a few ulps (2^-24 ~ 6e-8) per op over ~30 ops stay far below 1e-5.
inline constexpr double kGoldenF32Logits = 1e-5;
// Gradients pass through twice as many ops (and small-norm tensors amplify relative error).
inline constexpr double kGoldenF32Grads = 1e-4;
// Ten AdamW steps: the update divides by sqrt(v) ~ |g|, so tiny gradient differences move
// parameters by up to lr * relative error; losses stay within 1e-4 relative.
inline constexpr double kGoldenAdamLoss = 1e-4;

// The same FP32 terms summed in another order (shared-prefix gradients vs the unshared
// sequences'): each sum differs by a few roundings of 2^-24 relative; normwise far below 1e-5.
inline constexpr double kFp32SumOrder = 1e-5;

// BF16-operand attention vs an FP64 model rounding q, k, v and P at the kernels' points (T = 20,
// D <= 32): the kernels' FP32 sums and fast exp (a few 2^-24 roundings per value) and the rare P
// whose FP32 and FP64 values round to different BF16 neighbours (2^-8 on one term of ~10);
// normwise 1e-4. Measured 2e-8..1e-6; with one rounding point left out (P, or q in the backward)
// the same test fails (a missed point adds kUnitRmsBF16-scale error to every term it feeds).
inline constexpr double kAttnVsRoundedF64 = 1e-4;
// A step of 1e-3 in parameter space against the gradient changes a function by -eta |g|^2 to first
// order; its second-order terms (measured: 0.25% of it, the learner's FP32 GRPO loss) and FP32
// logprob rounding (~1e-7 of a change of ~3e-3) stay within 2% of it.
inline constexpr double kFirstOrderStep = 0.02;

// FP32 central differences with h in [1e-3, 1e-2]: truncation ~h^2 |f'''| <= 1e-4 and rounding
// ~2^-24 |L| / h <= 6e-5 relative; 5e-3 normwise leaves room for curvature of exp/softmax.
inline constexpr double kFiniteDiffF32 = 5e-3;
// models/cpu/fast_exp.hpp vs exact exp: 2 ulp of FP32 (Cephes expf's bound is ~1 ulp; one more
// for the rounding of x * log2(e) near half-integers); as a relative bound (2 ulp at the bottom
// of a binade, the loosest place) for the tolerances derived from it, fp32_ulps per value.
inline constexpr double kFastExpRel = 2.0 / (1 << 23);
// n FP32 ulps of the value `want` (its binade's spacing 2^(ilogb(want) - 23)).
inline double fp32_ulps(double want, double n) { return n * std::ldexp(1.0, std::ilogb(want) - 23); }

// Relative RMS error of one RNE rounding to a format with m explicit mantissa bits: the half-ulp
// 2^-(m+1) relative at the bottom of a binade, uniform, so 2^-(m+1)/sqrt(3).
inline constexpr double kSqrt3 = 1.7320508075688772;
inline constexpr double kUnitRmsBF16 = 1.0 / 256 / kSqrt3;  // m = 7: 2^-8 / sqrt(3)
inline constexpr double kUnitRmsE4M3 = 1.0 / 16 / kSqrt3;   // m = 3: 2^-4 / sqrt(3)
// Whole-model logits vs FP32 (3 layers, random init): ~13 GEMM stages round their operands;
// errors add in quadrature (sqrt(13) ~ 3.6) and the network's gain is ~2, so allow 8 units.
inline constexpr double kModelBf16VsF32 = 8 * kUnitRmsBF16;   // 0.018
inline constexpr double kModelFp8VsF32 = 8 * kUnitRmsE4M3;    // 0.29
// Gradients cross every GEMM twice more (dgrad, wgrad): allow 12 units.
inline constexpr double kModelBf16VsF32Grad = 12 * kUnitRmsBF16;
inline constexpr double kModelFp8VsF32Grad = 12 * kUnitRmsE4M3;
// The shared-prefix layout rounds the same kinds of operands as the unshared one, on another token
// set (each prompt's rows once, their gradients summed): errors of one distribution, measured
// within 1% of each other; 1.25x allows for a different draw, and fails a systematic loss.
inline constexpr double kSharedVsUnsharedErr = 1.25;
// FP8 Q/K/V (per-head scales, amax*1.05/448) vs BF16 attention: 3 layers x 3 operands rounded
// (sqrt(9) = 3) with gain ~1.3: 4 units of E4M3.
inline constexpr double kFp8AttentionVsBf16 = 4 * kUnitRmsE4M3;

// A sampled token's logprob (FP32, log-sum-exp over cpu_exp terms summed in FP64) vs the same
// quantity in FP64 from the same FP32 logits: the terms' 2-ulp error (kFastExpRel) moves the
// log-sum-exp by <= 2^-22, and the FP32 result adds half an ulp of |logp| < 16 (2^-20).
inline constexpr double kLogprobVsF64 = 4e-6;
// An entropy -sum p ln p (FP64 sum over V terms of the same processed logits, stored FP32) vs the
// exact value: each term's p carries the log-sum-exp's 2^-22 (kLogprobVsF64's), the sum of p is 1,
// so the entropy moves by <= 2^-22 (1 + |ln p|max) plus half an FP32 ulp of H < 16: < 1e-5.
inline constexpr double kEntropyVsF64 = 1e-5;

// An FP64 value summed from a few dozen FP64 terms in another order, or exp() of exact inputs:
// a few ulps (2^-52) of magnitudes <= 100.
inline constexpr double kFp64FewTerms = 1e-12;
// (a / b) * b against a in FP64 (a rate times its own time): two roundings of 2^-53 relative.
inline constexpr double kFp64TwoRoundingsRel = 1e-15;
// A hand-computed loss value vs policy_loss: the clip bounds (0.2f), the IS weights and dL/dc are
// FP32, one rounding each (2^-24 relative); at magnitudes <= 4 that is < 3e-7 absolute.
inline constexpr double kLossFp32Roundings = 3e-7;
// Seeded draws vs their probabilities: a count within 5 binomial standard deviations (two-sided
// p ~ 6e-7 per token for a correct sampler), plus half a count for rounding.
inline constexpr double kBinomialSigmas = 5.0;
// Policy-loss finite differences: the loss is computed in FP64 from FP32 logprobs, h = 1e-3;
// truncation ~h^2 |L'''| on exp(c - p) terms is ~1e-6 relative.
inline constexpr double kFiniteDiffLoss = 1e-4;
// Metrics from FP32 logprob inputs vs hand-computed FP64 values: inputs like -1.1f carry a
// representation error ~1e-7, which exp() propagates at that scale.
inline constexpr double kMetricFromFloatInputs = 1e-6;

// Tensor-core FP8 GEMM (cuBLASLt, undocumented order) vs the §5.4 exact model on the SAME
// quantized operands: only the accumulation differs -- partial sums of ~14 significant bits
// (u = 2^-13) inside each 128-K block, promoted to FP32 per block. Worst case, every one of the
// 128 partials of a random-sign N(0,s^2) block rounded the same way: u * sum_i sqrt(i) s over a
// block sum ~sqrt(128) s = 85u ~ 1.0e-2 relative, calc_diff ~ rel^2 / 2 ~ 5e-5 (random-sign
// rounding: ~5e-7). Not DeepGEMM's 1e-3, which also covers rounding the operands to E4M3.
inline constexpr double kGemmFp8TensorCoreVsRef = 1e-4;
// GPU float kernels vs the CPU backend on FP32 operands (different summation orders and libm): a
// few FP32 ulps per element, amplified by exp/log in softmax; 1e-5 relative normwise.
inline constexpr double kGpuFloatKernel = 1e-5;
// GPU vs CPU attention with BF16 operands: q, k, v (the same inputs) round the same on both
// sides, but P is rounded to BF16 after exp() (CUDA expf vs cpu_exp, ~2 FP32 ulps apart), so a
// P element can round one BF16 ulp (2^-7 of it) the other way: per element ~2^-14 likely, ~0.2
// of the 2812 of GpuOps.FloatKernelsMatchTheCpuBackend expected to flip. One flip moves its output
// row by 2^-7 p |v|, ~6e-5 of that test's output norm: FP32's 1e-5 fails on one flip; 1e-3 allows
// ~16, and a wrong mask, head mapping or scale moves the output by O(1).
inline constexpr double kGpuBf16OperandKernel = 1e-3;

// Tile (AMX) GEMMs vs the exact sum of the same (exact) products, per element: any summation
// order with one rounding per addition errs by at most gamma_n * sum|a_k b_k| (Higham, Thm 3.1),
// n = K additions + 2 per 128-K promotion. u = 2^-23 covers a truncating adder as well as RNE
// (the AMX adder's rounding is not documented).
inline double gemm_tiles_bound(int64_t K) {
  const double n = double(K) + 2.0 * double((K + 127) / 128) + 2.0, u = std::ldexp(1.0, -23);
  return n * u / (1.0 - n * u);
}

// DeepGEMM's normwise, scale-invariant difference: 1 - 2Σxy / Σ(x²+y²).
inline double calc_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double xy = 0, xx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    xy += x[i] * y[i];
    xx += x[i] * x[i] + y[i] * y[i];
  }
  return xx == 0 ? 0.0 : 1.0 - 2.0 * xy / xx;
}

// Relative normwise error ||x - y|| / ||y||.
inline double rel_norm_err(const std::vector<double>& x, const std::vector<double>& y) {
  double d = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    d += (x[i] - y[i]) * (x[i] - y[i]);
    n += y[i] * y[i];
  }
  return n == 0 ? std::sqrt(d) : std::sqrt(d / n);
}

}  // namespace fp8rl::tol
