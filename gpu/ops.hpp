// gpu/ops.hpp -- CUDA kernels behind launchers of the same name (device pointers, default stream).
// defines: gpu_quantize, gpu_dequantize, gpu_gemm_fp8_own, gpu_rmsnorm_forward, gpu_rope,
//          gpu_swiglu_forward, gpu_embedding_forward, gpu_logprob_forward, gpu_adamw_step,
//          gpu_kv_write_fp8, gpu_kv_read_fp8, gpu_attention_forward, gpu_e4m3_encode, gpu_e4m3_encoder_sweep
//
// Bit-exact with quant/ on the CPU: quantize/dequantize (same integer E4M3 encoder, pow2
// exponent formula, IEEE __fdiv_rn/__fmul_rn for fp32 scales, never fast-math) and the own
// CUDA-core FP8 GEMM (the §5.2 FMA order with __fmaf_rn). The other kernels are compared with the
// CPU backend under named tolerances (tests/gpu/gpu_test.cpp, target gpu_ops_test).
#pragma once
#include <cstdint>

#include "quant/qtensor.hpp"

namespace fp8rl::gpu {

// x [rows, cols] (device) -> q (host-visible value type: bytes and scales copied back). Throws
// quant::nonfinite_error naming the tensor and the first bad block, like quant::quantize.
quant::qtensor gpu_quantize(const float* x, int64_t rows, int64_t cols, quant::qlayout layout, quant::scale_mode mode,
                            const std::string& name);
// Device-only quantization (no host copies; the benchmark's path): out [R][K] codes, scale_inv
// sized q.scale_count(), bad per block (non-zero: that block held NaN/Inf).
void gpu_quantize_device(const float* x, int64_t rows, int64_t cols, quant::qlayout layout, quant::scale_mode mode,
                         uint8_t* out, float* scale_inv, int* bad);
// E4M3 codes of n floats (device in, device out), the SATFINITE encoder of quant/fp8.cpp.
void gpu_e4m3_encode(const float* x, int64_t n, uint8_t* out);
// fp8-numerics.md §10.1: all 2^32 FP32 patterns through that encoder and through the hardware's
// cvt.rn.satfinite (cuda_fp8.h); returns how many disagree and, if any, the lowest such pattern;
// nan_as_0xff: how many NaN inputs the hardware encoded 0xFF (-NaN; ours is 0x7F: both NaN, agreeing).
uint64_t gpu_e4m3_encoder_sweep(uint32_t* first_mismatch, uint64_t* nan_as_0xff = nullptr);
void gpu_dequantize(const quant::qtensor& q, float* out /* device [rows, cols] */);
// C[M,N] = A·B^T with the CPU reference's FMA order (A 1x128 tiles, B any layout); C device.
void gpu_gemm_fp8_own(const quant::qtensor& A, const quant::qtensor& B, float* C);

void gpu_rmsnorm_forward(const float* x, const float* w, int64_t T, int64_t C, float eps, float* out, float* rstd);
void gpu_rope(float* x, const int32_t* pos, int64_t T, int64_t nh, int64_t D, double theta, bool inverse);
void gpu_swiglu_forward(const float* gate, const float* up, int64_t n, float* h);
// out[t] = wte[tokens[t]] for wte [V, C]; an id outside [0, V) is an error naming the token
// (std::invalid_argument).
void gpu_embedding_forward(const float* wte, const int32_t* tokens, int64_t T, int64_t C, int64_t V, float* out);
// logp[t] = log softmax(logits[t])[targets[t]] (targets < 0 -> 0; >= V an error naming the row);
// all device pointers.
void gpu_logprob_forward(const float* logits, const int32_t* targets, int64_t T, int64_t V, float* logp);
void gpu_adamw_step(float* p, float* g, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
                    float decay, float clip, int64_t step);
// FP8 KV cache entries: code = e4m3(x / scale[h]) for x [T, KV, D]; read back dec(code) * scale.
// A NaN/Inf in x is an error naming token, KV head and element (std::invalid_argument), and
// nothing is written. Returns the elements the saturation clipped (|x / scale| > 464, as the CPU
// cache counts them).
int64_t gpu_kv_write_fp8(const float* x, int64_t T, int64_t KV, int64_t D, const float* scale, uint8_t* codes);
void gpu_kv_read_fp8(const uint8_t* codes, int64_t T, int64_t KV, int64_t D, const float* scale, float* x);
// Causal GQA attention over one sequence: q [T,H,D], k/v [T,KV,D] -> out [T,H,D]; BF16 operand
// rounding when bf16 is set (the CPU policy), FP32 softmax. H must be a multiple of KV.
void gpu_attention_forward(const float* q, const float* k, const float* v, int64_t T, int64_t H, int64_t KV, int64_t D,
                           bool bf16, float* out);

}  // namespace fp8rl::gpu
