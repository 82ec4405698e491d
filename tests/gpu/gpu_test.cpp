// tests/gpu/gpu_test.cpp -- the cross-backend op test: every GPU op against the CPU backend on
// random inputs (bit-exact for quantization, dequantization, the own GEMM, the FP8 KV-cache
// codec, the embedding gather and AdamW; named tolerances for cuBLASLt and the float kernels; exact equality on the
// exact-integer GEMM inputs of fp8-numerics.md §6), plus a one-rank NCCL smoke test (a round
// trip between ranks needs two devices). GPU cases GTEST_SKIP without a device, naming the CUDA
// error; with FP8RL_REQUIRE_GPU=1 (tools/gpu-check) a missing device FAILS them instead, so a
// broken driver on a GPU machine cannot pass as a run of skips. The host-side cuBLASLt layout
// plan is tested everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <cuda_bf16.h>

#include "gpu/cublaslt_gemm.hpp"
#include "gpu/device.hpp"
#include "gpu/nccl_comm.hpp"
#include "gpu/ops.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/adamw.hpp"
#include "models/params.hpp"
#include "quant/fp8.hpp"
#include "quant/gemm.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl;
using fp8rl::test::randn;

namespace {
std::vector<double> dv(const std::vector<float>& v) { return {v.begin(), v.end()}; }

bool gpu_required() {
  const char* e = std::getenv("FP8RL_REQUIRE_GPU");
  return e && std::string(e) == "1";
}
}  // namespace

#define REQUIRE_GPU()                                                                            \
  do {                                                                                           \
    if (const auto dev_ = gpu::device_query(); dev_.count == 0) {                                \
      if (gpu_required()) {                                                                      \
        FAIL() << "FP8RL_REQUIRE_GPU=1 and no CUDA device: " << dev_.reason;                    \
      }                                                                                          \
      GTEST_SKIP() << "no CUDA device: " << dev_.reason;                                         \
    }                                                                                            \
  } while (0)

TEST(GpuPlan, CublasLtLayoutsMatchQuantScaleArrays) {
  for (int64_t M : {8, 64, 4096})
    for (int64_t N : {128, 4096, 14336})
      for (int64_t K : {128, 4096, 14336}) {
        const auto p = gpu::lt_plan({M, N, K, gpu::lt_dtype::e4m3, gpu::lt_dtype::bf16});
        EXPECT_TRUE(p.problems.empty()) << M << " " << N << " " << K;
        quant::qtensor w, x;
        w.rows = N; w.cols = K; w.layout = quant::qlayout::block_128x128;
        x.rows = M; x.cols = K; x.layout = quant::qlayout::rowwise_1x128;
        EXPECT_EQ(p.a_scale_count, w.scale_count());  // the bytes quant/ stores are what cuBLASLt reads
        EXPECT_EQ(p.b_scale_count, x.scale_count());
        EXPECT_EQ(p.a_ld, K);
        EXPECT_EQ(p.d_ld, N);
      }
  EXPECT_FALSE(gpu::lt_plan({8, 100, 128, gpu::lt_dtype::e4m3, gpu::lt_dtype::bf16}).problems.empty());
  EXPECT_FALSE(gpu::lt_plan({7, 128, 128, gpu::lt_dtype::e4m3, gpu::lt_dtype::bf16}).problems.empty());
  EXPECT_FALSE(gpu::lt_plan({8, 128, 100, gpu::lt_dtype::e4m3, gpu::lt_dtype::bf16}).problems.empty());
  EXPECT_TRUE(gpu::lt_plan({8, 136, 8, gpu::lt_dtype::bf16, gpu::lt_dtype::bf16}).problems.empty());
}

// Without a driver (CI) the query returns, with the runtime's reason; a count of 0 always carries
// one (a skip must say why), a positive count none.
TEST(GpuPlan, DeviceQueryGivesTheReasonForNoDevice) {
  const auto d = gpu::device_query();
  EXPECT_EQ(d.count == 0, !d.reason.empty()) << d.count << " devices, reason '" << d.reason << "'";
  EXPECT_EQ(gpu::device_count(), d.count);
  if (gpu_required()) {
    EXPECT_GT(d.count, 0) << "FP8RL_REQUIRE_GPU=1: " << d.reason;
  }
}

TEST(GpuOps, QuantizeAndDequantizeAreBitExact) {
  REQUIRE_GPU();
  for (auto layout : {quant::qlayout::rowwise_1x128, quant::qlayout::colwise_1x128, quant::qlayout::block_128x128})
    for (auto mode : {quant::scale_mode::pow2, quant::scale_mode::fp32}) {
      const int64_t R = 300, C = 260;
      auto x = randn(R * C, 3, 2.0f);
      auto dx = gpu::dbuf<float>::from(x);
      const auto g = gpu::gpu_quantize(dx.data(), R, C, layout, mode, "x");
      const auto c = quant::quantize_ref(x.data(), R, C, layout, mode, "x");
      EXPECT_EQ(g.data, c.data);
      EXPECT_EQ(g.scale_inv, c.scale_inv);
      gpu::dbuf<float> out(static_cast<size_t>(R * C));
      gpu::gpu_dequantize(g, out.data());
      std::vector<float> ref(x.size());
      quant::dequantize(c, ref.data());
      EXPECT_EQ(fp8rl::test::first_diff(out.to_host(), ref), -1);  // bits: -0 from code 0x80 included
    }
  std::vector<float> bad(256 * 256, 1.0f);
  bad[130 * 256 + 5] = NAN;
  auto db = gpu::dbuf<float>::from(bad);
  try {
    gpu::gpu_quantize(db.data(), 256, 256, quant::qlayout::block_128x128, quant::scale_mode::pow2, "w");
    FAIL();
  } catch (const quant::nonfinite_error& e) {
    EXPECT_EQ(e.block_row, 1);
    EXPECT_EQ(e.block_col, 0);
  }
}

TEST(GpuOps, EncoderMatchesCpuOnSampledFloatPatterns) {
  REQUIRE_GPU();
  std::vector<float> x(1 << 24);
  for (size_t i = 0; i < x.size(); ++i) x[i] = quant::float_from_bits(static_cast<uint32_t>(i * 256 + (i >> 16)));
  auto dx = gpu::dbuf<float>::from(x);
  gpu::dbuf<uint8_t> dq(x.size());
  gpu::gpu_e4m3_encode(dx.data(), static_cast<int64_t>(x.size()), dq.data());
  const auto q = dq.to_host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(q[i], quant::e4m3_from_float(x[i])) << std::hex << quant::float_bits(x[i]);
}

// fp8-numerics.md §10.1: the integer encoder (CPU and device alike, tested above) against the
// hardware's own SATFINITE conversion over every FP32 pattern (a second on an H100/H200).
TEST(GpuOps, EncoderMatchesTheHardwareConversionOnEveryFloat) {
  REQUIRE_GPU();
  uint32_t first = 0;
  uint64_t nan_ff = 0;
  const uint64_t bad = gpu::gpu_e4m3_encoder_sweep(&first, &nan_ff);
  EXPECT_EQ(bad, 0u) << "lowest disagreeing pattern 0x" << std::hex << first << " ("
                     << quant::float_from_bits(first) << "): hardware vs ours differ";
  RecordProperty("nan_inputs_hardware_encodes_0xff", std::to_string(nan_ff));  // §10.1's -NaN, reported
  std::printf("NaN inputs the hardware encodes 0xFF (ours: 0x7F): %llu\n", static_cast<unsigned long long>(nan_ff));
}

TEST(GpuOps, OwnFp8GemmIsBitExactWithTheCpuReference) {
  REQUIRE_GPU();
  // M x N x K; 65537 rows: more than grid.y's 65535 (the launch failed), rows past it step by the grid
  for (const auto& [M, N, K] : {std::array<int64_t, 3>{70, 200, 384}, std::array<int64_t, 3>{65537, 8, 128}}) {
    auto a = randn(M * K, 1), b = randn(N * K, 2);
    const auto A = quant::quantize(a.data(), M, K, quant::qlayout::rowwise_1x128, quant::scale_mode::pow2, "A");
    const auto B = quant::quantize(b.data(), N, K, quant::qlayout::block_128x128, quant::scale_mode::pow2, "B");
    std::vector<float> ref(M * N);
    quant::gemm_fp8_ref(A, B, ref.data());
    gpu::dbuf<float> c(static_cast<size_t>(M * N));
    gpu::gpu_gemm_fp8_own(A, B, c.data());
    EXPECT_EQ(fp8rl::test::first_diff(c.to_host(), ref), -1) << M << "x" << N << "x" << K;
  }
}

namespace {
// FP8 operands for the cuBLASLt tests: every 1x128 tile of X and 128x128 block of W gets its own
// power-of-two scale (its values times 2^s(tile), its first element at the tile's amax), so a
// scale read from the wrong place (s[kb][nb] for s[nb][kb], KB for its padded leading dimension:
// K = 640 has KB = 5, padded to 8) moves results; `integers`: values in [-8, 8], so every block
// sum of codes is an integer <= 128 * 64 = 2^13 and exact in any order (fp8-numerics.md §6).
struct lt_case {
  int64_t M = 256, N = 512, K = 640;
  quant::qtensor X, W;
  std::vector<float> ref;
  explicit lt_case(bool integers) {
    std::vector<float> x(M * K), w(N * K);
    fp8rl::models::rng g(7);
    auto fill = [&](std::vector<float>& v, int64_t rows, int64_t row_block, int mul) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) {
          const int64_t kb = k / 128, rb = r / row_block;
          const float s = std::ldexp(1.0f, static_cast<int>((mul * rb + 3 * kb) % 7) - 3);
          const float e = k % 128 == 0 && r % row_block == 0 ? 8.0f
                          : integers ? float(int(g.next_u64() % 17) - 8) : std::clamp(float(g.normal()), -7.5f, 7.5f);
          v[r * K + k] = e * s;
        }
    };
    fill(x, M, 1, 1);    // rowwise 1x128 tiles: one scale per (row, kb)
    fill(w, N, 128, 5);  // 128x128 blocks: one scale per (nb, kb)
    X = quant::quantize(x.data(), M, K, quant::qlayout::rowwise_1x128, quant::scale_mode::pow2, "X");
    W = quant::quantize(w.data(), N, K, quant::qlayout::block_128x128, quant::scale_mode::pow2, "W");
    ref.resize(static_cast<size_t>(M * N));
    quant::gemm_fp8_exact_ref(X, W, ref.data());  // §5.4: the tensor cores' order is undocumented
  }
  std::vector<float> run(const gpu::lt_gemm_config& cfg) const {
    gpu::lt_gemm lt(cfg);
    auto dx = gpu::dbuf<uint8_t>::from(X.data), dw = gpu::dbuf<uint8_t>::from(W.data);
    auto sx = gpu::dbuf<float>::from(X.scale_inv), sw = gpu::dbuf<float>::from(W.scale_inv);
    gpu::dbuf<float> y(static_cast<size_t>(M * N));
    lt.run({M, N, K, gpu::lt_dtype::e4m3, gpu::lt_dtype::f32}, dw.data(), sw.data(), dx.data(), sx.data(), y.data());
    FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
    return y.to_host();
  }
};
}  // namespace

TEST(GpuOps, CublasLtFp8GemmExactOnIntegersAndCloseOtherwise) {
  REQUIRE_GPU();
  const lt_case exact(true), normal(false);
  EXPECT_EQ(fp8rl::test::first_diff(exact.run({}), exact.ref), -1);
  EXPECT_LT(tol::calc_diff(dv(normal.run({})), dv(normal.ref)), tol::kGemmFp8TensorCoreVsRef);
}

// fp8-numerics.md §6: exact integers agree with FAST_ACCUM 1 as well (never used for training;
// TE asserts split accumulation with block scaling, so cuBLASLt may have no algorithm for it:
// then the test skips saying so; any other error fails it).
TEST(GpuOps, CublasLtFp8GemmFastAccumOnIntegers) {
  REQUIRE_GPU();
  const lt_case exact(true);
  try {
    EXPECT_EQ(fp8rl::test::first_diff(exact.run({.fast_accum = true}), exact.ref), -1);
  } catch (const gpu::gpu_error& e) {
    // the library offering no such algorithm is its limit, not a wrong result: said, as a skip
    if (std::string(e.what()).find("has no algorithm") != std::string::npos) GTEST_SKIP() << "FAST_ACCUM 1 with block scaling: " << e.what();
    FAIL() << "FAST_ACCUM 1 with block scaling: " << e.what();
  }
}

TEST(GpuOps, FloatKernelsMatchTheCpuBackend) {
  REQUIRE_GPU();
  auto be = models::make_cpu_backend();
  const int64_t T = 37, C = 96, H = 4, KV = 2, D = 24, V = 50;
  auto x = randn(T * C, 1), w = randn(C, 2);
  std::vector<float> out(T * C), rstd(T);
  be->rmsnorm_forward(x.data(), w.data(), T, C, 1e-5f, out.data(), rstd.data());
  auto dx = gpu::dbuf<float>::from(x), dw = gpu::dbuf<float>::from(w);
  gpu::dbuf<float> dout(x.size()), drstd(T);
  gpu::gpu_rmsnorm_forward(dx.data(), dw.data(), T, C, 1e-5f, dout.data(), drstd.data());
  EXPECT_LT(tol::rel_norm_err(dv(dout.to_host()), dv(out)), tol::kGpuFloatKernel);
  // attention, one sequence, BF16 operands
  auto q = randn(T * H * D, 3), k = randn(T * KV * D, 4), v = randn(T * KV * D, 5);
  std::vector<int32_t> starts = {0, int32_t(T)};
  models::attn_params p;
  p.T = T; p.H = H; p.KV = KV; p.D = D; p.seq_start = starts.data(); p.S = 1; p.operand = models::precision::bf16;
  std::vector<float> att(T * H * D), lse(T * H);
  be->attention_forward(p, q.data(), k.data(), v.data(), att.data(), lse.data());
  auto dq = gpu::dbuf<float>::from(q), dk = gpu::dbuf<float>::from(k), dvv = gpu::dbuf<float>::from(v);
  gpu::dbuf<float> datt(att.size());
  gpu::gpu_attention_forward(dq.data(), dk.data(), dvv.data(), T, H, KV, D, true, datt.data());
  EXPECT_LT(tol::rel_norm_err(dv(datt.to_host()), dv(att)), tol::kGpuBf16OperandKernel);
  // log-probabilities
  auto logits = randn(T * V, 6);
  std::vector<int32_t> tg(T);
  for (int64_t t = 0; t < T; ++t) tg[t] = static_cast<int32_t>((t * 7) % V);
  std::vector<float> lp(T);
  be->logprob_forward(logits.data(), tg.data(), T, V, {}, lp.data(), nullptr);
  auto dl = gpu::dbuf<float>::from(logits);
  auto dt = gpu::dbuf<int32_t>::from(tg);
  gpu::dbuf<float> dlp(T);
  gpu::gpu_logprob_forward(dl.data(), dt.data(), T, V, dlp.data());
  EXPECT_LT(tol::rel_norm_err(dv(dlp.to_host()), dv(lp)), tol::kGpuFloatKernel);
  // a target past the row is an error naming the row (it read the next row's logits)
  tg[3] = static_cast<int32_t>(V);
  auto dbad = gpu::dbuf<int32_t>::from(tg);
  const std::string lp_err =
      fp8rl::test::thrown_text<std::invalid_argument>([&] { gpu::gpu_logprob_forward(dl.data(), dbad.data(), T, V, dlp.data()); });
  EXPECT_NE(lp_err.find("row 3: target " + std::to_string(V) + " is outside the vocabulary"), std::string::npos) << lp_err;
  // query heads that do not group over the KV heads (H < KV divided by zero in the kernel)
  const std::string h_err = fp8rl::test::thrown_text<std::invalid_argument>(
      [&] { gpu::gpu_attention_forward(dq.data(), dk.data(), dvv.data(), T, 1, 2, D, true, datt.data()); });
  EXPECT_NE(h_err.find("1 query heads do not group over 2 KV heads"), std::string::npos) << h_err;
}

// The remaining elementwise kernels against the CPU backend: the embedding gather and AdamW (the
// same IEEE operations in the same order: -fmad=false, IEEE sqrt and division; clip 1, no decay,
// as adamw_step with grad_clip 0 and weight_decay 0) bit for bit; RoPE and SwiGLU (CUDA's
// cosf/sinf/powf/expf vs libm and cpu_exp) under the FP32 kernel bound.
TEST(GpuOps, EmbeddingRopeSwigluAndAdamwMatchTheCpuBackend) {
  REQUIRE_GPU();
  auto be = models::make_cpu_backend();
  const int64_t T = 29, C = 64, V = 50, nh = 4, D = 16;
  auto wte = randn(V * C, 11);
  std::vector<int32_t> tok(T), pos(T);
  for (int64_t t = 0; t < T; ++t) tok[t] = static_cast<int32_t>((t * 13) % V), pos[t] = static_cast<int32_t>(t * 37 % 1000);
  std::vector<float> emb(T * C);
  be->embedding_forward(wte.data(), tok.data(), T, C, emb.data());
  auto dwte = gpu::dbuf<float>::from(wte);
  auto dtok = gpu::dbuf<int32_t>::from(tok), dpos = gpu::dbuf<int32_t>::from(pos);
  gpu::dbuf<float> demb(emb.size());
  gpu::gpu_embedding_forward(dwte.data(), dtok.data(), T, C, V, demb.data());
  EXPECT_EQ(fp8rl::test::first_diff(demb.to_host(), emb), -1);
  // an id outside the table is an error naming the token (it read past wte)
  auto bad_tok = tok;
  bad_tok[5] = static_cast<int32_t>(V), bad_tok[9] = -1;
  auto dbad_tok = gpu::dbuf<int32_t>::from(bad_tok);
  const std::string emb_err = fp8rl::test::thrown_text<std::invalid_argument>(
      [&] { gpu::gpu_embedding_forward(dwte.data(), dbad_tok.data(), T, C, V, demb.data()); });
  EXPECT_NE(emb_err.find("token 5: id 50 is outside the vocabulary (50)"), std::string::npos) << emb_err;
  for (bool inverse : {false, true}) {
    auto x = randn(T * nh * D, 12);
    auto dx = gpu::dbuf<float>::from(x);
    be->rope(x.data(), pos.data(), T, nh, D, models::rope_inv_freq(10000.0, D), inverse);
    gpu::gpu_rope(dx.data(), dpos.data(), T, nh, D, 10000.0, inverse);
    EXPECT_LT(tol::rel_norm_err(dv(dx.to_host()), dv(x)), tol::kGpuFloatKernel) << "inverse " << inverse;
  }
  auto g = randn(T * C, 13, 3.0f), u = randn(T * C, 14);
  std::vector<float> h(g.size());
  be->swiglu_forward(g.data(), u.data(), T * C, h.data());
  auto dg = gpu::dbuf<float>::from(g), du = gpu::dbuf<float>::from(u);
  gpu::dbuf<float> dh(h.size());
  gpu::gpu_swiglu_forward(dg.data(), du.data(), T * C, dh.data());
  EXPECT_LT(tol::rel_norm_err(dv(dh.to_host()), dv(h)), tol::kGpuFloatKernel);
  // AdamW: two steps on one vector tensor
  const int64_t n = 5000;
  models::param_layout layout;
  layout.infos.push_back({"w", {n}, 0, n, false});
  layout.index["w"] = 0;
  layout.total = n;
  models::adamw_config cfg;
  cfg.grad_clip = 0.0f;
  auto p = randn(n, 15);
  const std::vector<float> zeros(static_cast<size_t>(n), 0.0f);
  auto dp = gpu::dbuf<float>::from(p), dm = gpu::dbuf<float>::from(zeros), dvv = gpu::dbuf<float>::from(zeros);
  models::adamw_state st;
  for (int64_t step = 1; step <= 2; ++step) {
    auto grad = randn(n, 16 + static_cast<uint64_t>(step));
    auto dgrad = gpu::dbuf<float>::from(grad);
    models::adamw_step(cfg, layout, p.data(), grad.data(), st);
    gpu::gpu_adamw_step(dp.data(), dgrad.data(), dm.data(), dvv.data(), n, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, 1.0f, 1.0f, step);
  }
  EXPECT_EQ(fp8rl::test::first_diff(dp.to_host(), p), -1);
  EXPECT_EQ(fp8rl::test::first_diff(dm.to_host(), st.m), -1);
  EXPECT_EQ(fp8rl::test::first_diff(dvv.to_host(), st.v), -1);
}

TEST(GpuOps, Fp8KvCacheCodecIsBitExact) {
  REQUIRE_GPU();
  const int64_t T = 19, KV = 2, D = 32;
  auto x = randn(T * KV * D, 9, 3.0f);
  const std::vector<float> scale = {0.02f, 0.005f};  // the second saturates some elements
  auto dx = gpu::dbuf<float>::from(x), ds = gpu::dbuf<float>::from(scale);
  gpu::dbuf<uint8_t> codes(x.size());
  const int64_t saturated = gpu::gpu_kv_write_fp8(dx.data(), T, KV, D, ds.data(), codes.data());
  const auto c = codes.to_host();
  int64_t want_saturated = 0;  // the CPU cache's rule (models/cpu/kv_cache.cpp)
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(c[i], quant::e4m3_from_float(x[i] / scale[(i / D) % KV])) << i;
    want_saturated += std::fabs(x[i] / scale[(i / D) % KV]) > 464.0f;
  }
  EXPECT_GT(want_saturated, 0);  // the case has clipped elements
  EXPECT_EQ(saturated, want_saturated);
  gpu::dbuf<float> back(x.size());
  gpu::gpu_kv_read_fp8(codes.data(), T, KV, D, ds.data(), back.data());
  const auto b = back.to_host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(b[i], quant::e4m3_to_float(c[i]) * scale[(i / D) % KV]) << i;
  // a NaN/Inf key or value is refused, naming where (fp8-numerics §0.2)
  auto bad = x;
  bad[static_cast<size_t>(2 * KV * D + D + 5)] = std::nanf("");  // token 2, KV head 1, element 5
  auto dbad = gpu::dbuf<float>::from(bad);
  try {
    gpu::gpu_kv_write_fp8(dbad.data(), T, KV, D, ds.data(), codes.data());
    ADD_FAILURE() << "NaN encoded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("token 2, KV head 1, element 5: not finite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(codes.to_host(), c);  // the refused write changed nothing (its finite elements were encoded)
  // every one of the 256 codes decodes as the CPU does (0x7F / 0xFF: NaN, not +-480)
  std::vector<uint8_t> all(256 * KV * D / 256 * 8);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i);
  auto dall = gpu::dbuf<uint8_t>::from(all);
  gpu::dbuf<float> dec(all.size());
  gpu::gpu_kv_read_fp8(dall.data(), static_cast<int64_t>(all.size() / (KV * D)), KV, D, ds.data(), dec.data());
  const auto d = dec.to_host();
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = quant::e4m3_to_float(all[i]) * scale[(i / D) % KV];
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(d[i])) << "code " << int(all[i]);
    else ASSERT_EQ(d[i], want) << "code " << int(all[i]);
  }
}

// A smoke test of the communicator's set-up and calls, not of a round trip: with one rank,
// broadcast and all-reduce leave the buffer as it was, so only an NCCL error (or a call that
// writes the buffer) fails it. Two ranks need two devices (NCCL refuses two ranks on one GPU);
// this task's machines have at most one, so fp8-numerics.md §10.4's round trip is untested.
TEST(GpuOps, NcclSingleRankCallsComplete) {
  REQUIRE_GPU();
  gpu::nccl_comm comm(1, 0, gpu::nccl_make_id(), 0);
  std::vector<uint8_t> bytes(1 << 20);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 31);
  auto d = gpu::dbuf<uint8_t>::from(bytes);
  comm.broadcast_bytes(d.data(), bytes.size(), 0);
  EXPECT_EQ(d.to_host(), bytes);
  std::vector<float> g(1000, 0.5f);
  auto dg = gpu::dbuf<float>::from(g);
  comm.allreduce_sum(dg.data(), g.size());
  EXPECT_EQ(dg.to_host(), g);  // one rank: the sum is the input
}
