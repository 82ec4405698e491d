// tests/models/precision_test.cpp -- BF16 and FP8 policies: linear layers are bit-identical to
// "quantize with quant/, then the quant/ reference GEMM"; whole-model logits and gradients stay
// within format-derived tolerances of FP32; BF16-kept layers; FP8 attention.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "models/bundle.hpp"
#include "models/cpu/cpu_backend.hpp"
#include "models/cpu/fast_exp.hpp"
#include "models/transformer.hpp"
#include "quant/fp8.hpp"
#include "quant/gemm.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;
using namespace fp8rl::quant;
using fp8rl::test::first_diff;
using fp8rl::test::randn;

namespace {
model_config small_config() {
  model_config c;
  c.hidden_size = 256; c.intermediate_size = 384; c.num_hidden_layers = 3; c.num_attention_heads = 4;
  c.num_key_value_heads = 2; c.head_dim = 64; c.vocab_size = 97; c.max_position_embeddings = 256;
  c.initializer_range = 0.05;
  return c;
}

std::vector<uint16_t> bf16v(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_from_float(x[i]);
  return b;
}

std::vector<float> transpose(const std::vector<float>& x, int64_t r, int64_t c) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = x[i * c + j];
  return t;
}
}  // namespace

TEST(Precision, Fp8LinearIsQuantizeThenReferenceGemm) {
  auto be = make_cpu_backend();
  const int64_t T = 150, out = 256, in = 384;
  auto x = randn(T * in, 1), w = randn(out * in, 2, 0.05f), dy = randn(T * out, 3);
  auto pl = be->linear_prepare({"w", out, in, precision::fp8, scale_mode::pow2, w.data(), nullptr}, true);
  std::vector<float> y(T * out), dx(T * in), dw(out * in, 0.0f), ref_y(T * out), ref_dx(T * in), ref_dw(out * in);
  be->linear_forward(*pl, x.data(), T, y.data());
  be->linear_backward(*pl, x.data(), dy.data(), T, dx.data(), dw.data());
  qtensor wq = quantize_ref(w.data(), out, in, qlayout::block_128x128, scale_mode::pow2, "w");
  gemm_fp8_ref(quantize_ref(x.data(), T, in, qlayout::rowwise_1x128, scale_mode::pow2, "x"), wq, ref_y.data());
  gemm_fp8_ref(quantize_ref(dy.data(), T, out, qlayout::rowwise_1x128, scale_mode::pow2, "dy"),
               qtensor_transpose_blocks(wq), ref_dx.data());
  gemm_fp8_ref(quantize_ref(dy.data(), T, out, qlayout::colwise_1x128, scale_mode::pow2, "dyT"),
               quantize_ref(x.data(), T, in, qlayout::colwise_1x128, scale_mode::pow2, "xT"), ref_dw.data());
  EXPECT_EQ(first_diff(y, ref_y), -1) << "fprop";
  EXPECT_EQ(first_diff(dx, ref_dx), -1) << "dgrad";
  EXPECT_EQ(first_diff(dw, ref_dw), -1) << "wgrad";
  // linear_backward adds into dw (gradient accumulation): dw0 + the wgrad, one FP32 addition each
  const auto dw0 = randn(out * in, 7);
  dw = dw0;
  be->linear_backward(*pl, x.data(), dy.data(), T, dx.data(), dw.data());
  std::vector<float> sum(out * in);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = dw0[i] + ref_dw[i];
  EXPECT_EQ(first_diff(dw, sum), -1) << "wgrad accumulates";
}

TEST(Precision, Bf16LinearIsRoundThenReferenceGemm) {
  auto be = make_cpu_backend();
  const int64_t T = 33, out = 40, in = 70;
  auto x = randn(T * in, 4), w = randn(out * in, 5), dy = randn(T * out, 6);
  auto pl = be->linear_prepare({"w", out, in, precision::bf16, scale_mode::pow2, w.data(), nullptr}, true);
  std::vector<float> y(T * out), dx(T * in), dw(out * in, 0.0f), ry(T * out), rdx(T * in), rdw(out * in);
  be->linear_forward(*pl, x.data(), T, y.data());
  be->linear_backward(*pl, x.data(), dy.data(), T, dx.data(), dw.data());
  auto xb = bf16v(x), wb = bf16v(w), dyb = bf16v(dy);
  gemm_bf16_ref({T, out, in}, xb.data(), wb.data(), ry.data());
  auto wtb = bf16v(transpose(w, out, in));
  gemm_bf16_ref({T, in, out}, dyb.data(), wtb.data(), rdx.data());
  auto dytb = bf16v(transpose(dy, T, out)), xtb = bf16v(transpose(x, T, in));
  gemm_bf16_ref({out, in, T}, dytb.data(), xtb.data(), rdw.data());
  EXPECT_EQ(first_diff(y, ry), -1);
  EXPECT_EQ(first_diff(dx, rdx), -1);
  EXPECT_EQ(first_diff(dw, rdw), -1);
  const auto dw0 = randn(out * in, 8);  // adds into dw, as the FP8 path
  dw = dw0;
  be->linear_backward(*pl, x.data(), dy.data(), T, dx.data(), dw.data());
  for (size_t i = 0; i < rdw.size(); ++i) rdw[i] += dw0[i];
  EXPECT_EQ(first_diff(dw, rdw), -1) << "wgrad accumulates";
}

// A group of layers reading one input (q/k/v, gate/up) shares the input's quantized/rounded
// operands where precisions agree; every output equals the separate calls bit for bit, also
// when members differ in precision or scale mode (the operand is then rebuilt), and the
// backward's dx is the first dgrad plus the others in order.
TEST(Precision, LinearGroupEqualsSeparateCalls) {
  auto be = make_cpu_backend();
  const int64_t T = 140, in = 256;
  struct member { int64_t out; precision prec; scale_mode mode; };
  const std::vector<member> ms = {{256, precision::fp8, scale_mode::pow2}, {128, precision::fp8, scale_mode::pow2},
                                  {130, precision::bf16, scale_mode::pow2}, {128, precision::fp8, scale_mode::fp32},
                                  {64, precision::fp32, scale_mode::pow2}, {128, precision::fp8, scale_mode::fp32}};
  auto x = randn(T * in, 21);
  std::vector<std::vector<float>> w, dy;
  std::vector<std::unique_ptr<prepared_linear>> pl;
  for (size_t i = 0; i < ms.size(); ++i) {
    w.push_back(randn(ms[i].out * in, 22 + i, 0.05f));
    dy.push_back(randn(T * ms[i].out, 40 + i));
    pl.push_back(be->linear_prepare({"w" + std::to_string(i), ms[i].out, in, ms[i].prec, ms[i].mode, w[i].data(), nullptr}, true));
  }
  std::vector<const prepared_linear*> ws;
  std::vector<std::vector<float>> y(ms.size()), ry(ms.size()), dw(ms.size()), rdw(ms.size());
  std::vector<float*> yp, dwp;
  std::vector<const float*> dyp;
  for (size_t i = 0; i < ms.size(); ++i) {
    ws.push_back(pl[i].get());
    y[i].assign(T * ms[i].out, 0.0f), ry[i] = y[i];
    dw[i].assign(ms[i].out * in, 0.5f), rdw[i] = dw[i];  // += into existing gradients
    yp.push_back(y[i].data()), dwp.push_back(dw[i].data()), dyp.push_back(dy[i].data());
  }
  be->linear_forward_group(ws, x.data(), T, yp);
  std::vector<float> dx(T * in), tmp(T * in), rdx(T * in), rtmp(T * in);
  be->linear_backward_group(ws, x.data(), dyp, T, dx.data(), tmp.data(), dwp);
  for (size_t i = 0; i < ms.size(); ++i) {
    be->linear_forward(*pl[i], x.data(), T, ry[i].data());
    be->linear_backward(*pl[i], x.data(), dy[i].data(), T, i == 0 ? rdx.data() : rtmp.data(), rdw[i].data());
    if (i > 0) be->add_inplace(rdx.data(), rtmp.data(), T * in);
    EXPECT_EQ(first_diff(y[i], ry[i]), -1) << "member " << i << " forward";
    EXPECT_EQ(first_diff(dw[i], rdw[i]), -1) << "member " << i << " wgrad";
  }
  EXPECT_EQ(first_diff(dx, rdx), -1) << "dgrad sum";
  // no dx and a member without weight gradient: the rest as separate calls
  std::vector<float> dw0(dw[0].size(), 0.0f), rdw0(dw0.size(), 0.0f), dw2(dw[2].size(), 0.0f), rdw2(dw2.size(), 0.0f);
  float* some[] = {dw0.data(), nullptr, dw2.data(), nullptr, nullptr, nullptr};  // one per member of ms
  ASSERT_EQ(std::size(some), ms.size());
  be->linear_backward_group(ws, x.data(), dyp, T, nullptr, tmp.data(), some);
  be->linear_backward(*pl[0], x.data(), dy[0].data(), T, nullptr, rdw0.data());
  be->linear_backward(*pl[2], x.data(), dy[2].data(), T, nullptr, rdw2.data());
  EXPECT_EQ(first_diff(dw0, rdw0), -1) << "member 0 without dx";
  EXPECT_EQ(first_diff(dw2, rdw2), -1) << "member 2 without dx";
}

TEST(Precision, PolicyPicksFp8OnlyWhereAllowed) {
  model_config c = small_config();
  precision_policy p = precision_policy::named("fp8");
  EXPECT_EQ(p.linear_for(c, 1, "mlp.up_proj", 384, 256), precision::fp8);
  p.bf16_first = 1;
  p.bf16_last = 1;
  EXPECT_EQ(p.linear_for(c, 0, "mlp.up_proj", 384, 256), precision::bf16);
  EXPECT_EQ(p.linear_for(c, 2, "mlp.up_proj", 384, 256), precision::bf16);
  EXPECT_EQ(p.linear_for(c, 1, "mlp.up_proj", 384, 256), precision::fp8);
  EXPECT_EQ(p.linear_for(c, 1, "mlp.up_proj", 100, 256), precision::bf16);  // not a 128-multiple
  EXPECT_EQ(p.linear_for(c, 1, "mlp.up_proj", 256, 192), precision::bf16);  // in: 64-multiple, not 128
  p.bf16_names = {"self_attn.o_proj"};
  EXPECT_EQ(p.linear_for(c, 1, "self_attn.o_proj", 256, 256), precision::bf16);
  EXPECT_EQ(p.bf16_name_unmatched(c), "");
  // a name that is part of no layer's projection keeps nothing BF16: named (c has 3 layers)
  precision_policy q = p;
  q.bf16_names = {"mlp.down_proj", "layers.2.", "layers.3.", "self_attn"};
  EXPECT_EQ(q.bf16_name_unmatched(c), "layers.3.");
  q.bf16_names = {"o_proj.weight"};
  EXPECT_EQ(q.bf16_name_unmatched(c), "o_proj.weight");
  auto be = make_cpu_backend();
  model_params mp = model_params_init(c, 1);
  auto w = model_weights_build(*be, c, p, {&mp, nullptr, nullptr}, false);
  EXPECT_EQ(w->layers[0].up->prec, precision::bf16);
  EXPECT_EQ(w->layers[1].up->prec, precision::fp8);
  EXPECT_EQ(w->layers[1].o->prec, precision::bf16);
  EXPECT_EQ(w->lm_head->prec, precision::bf16);  // never FP8
  precision_policy bad = precision_policy::named("fp8");
  bad.head = precision::fp8;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  EXPECT_THROW(bundle_from_params(mp, bad, 1, 1, nullptr), std::invalid_argument);  // a bundle checks its policy
  bad = precision_policy::named("fp8");
  bad.fp8_attention = true;  // FP8 attention reads an FP8 KV cache; this policy's is BF16
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  bad = precision_policy::named("fp8");
  bad.bf16_last = -1;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  // the fingerprint (what a bundle is checked against) tells every field apart
  precision_policy last = precision_policy::named("fp8");
  last.bf16_last = 1;
  EXPECT_NE(last.fingerprint(), precision_policy::named("fp8").fingerprint());
}

namespace {
struct model_output {
  std::vector<float> logits, grads;
};

// Logits and gradients of a small model on three packed sequences under a named policy.
model_output run_policy(const char* name) {
  model_config c = small_config();
  model_params p = model_params_init(c, 7);
  auto be = make_cpu_backend();
  token_batch b;
  fp8rl::models::rng g(3);
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> seq(60 + 17 * s);
    for (auto& t : seq) t = static_cast<int32_t>(g.next_u64() % 97);
    b.add(seq);
  }
  auto targets = b.next_targets();
  model_output o;
  model_runner run(*be);
  auto w = model_weights_build(*be, c, precision_policy::named(name), {&p, nullptr, nullptr}, true);
  run.forward(*w, b, true);
  o.logits.resize(static_cast<size_t>(b.T() * c.vocab_size));
  be->to_host(o.logits.data(), run.logits(), o.logits.size() * 4);
  std::vector<float> dlogp(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) dlogp[t] = targets[t] >= 0 ? -1.0f / float(b.T()) : 0.0f;
  o.grads.assign(static_cast<size_t>(p.layout.total), 0.0f);
  run.backward(*w, targets, {}, dlogp.data(), o.grads.data());
  return o;
}

double logits_err(const model_output& x, const model_output& ref) {
  return fp8rl::tol::rel_norm_err(fp8rl::test::to_double(x.logits), fp8rl::test::to_double(ref.logits));
}
double grads_err(const model_output& x, const model_output& ref) {
  return fp8rl::tol::rel_norm_err(fp8rl::test::to_double(x.grads), fp8rl::test::to_double(ref.grads));
}
}  // namespace

// bundle_bytes (what host_memory_check counts per generation engine) is the payload of the bundle
// bundle_from_params makes, for every policy kind: FP32/BF16 tensors, FP8 ones with their block
// scales, layers kept BF16 by index and name, the FP8 attention scales of fp8-kv.
TEST(Precision, BundleBytesIsTheBundlesPayload) {
  const model_config c = small_config();
  const model_params mp = model_params_init(c, 1);
  precision_policy kept = precision_policy::named("fp8");
  kept.bf16_first = 1, kept.bf16_names = {"self_attn.o_proj"};
  attn_fp8_scales sc;
  sc.q.assign(static_cast<size_t>(c.num_hidden_layers * c.num_attention_heads), 0.01f);
  sc.k.assign(static_cast<size_t>(c.num_hidden_layers * c.num_key_value_heads), 0.01f);
  sc.v = sc.k;
  for (const precision_policy& p : {precision_policy::named("fp32"), precision_policy::named("bf16"), precision_policy::named("fp8"),
                                    kept, precision_policy::named("fp8-kv")}) {
    const bool attn = p.kv == kv_dtype::fp8;  // (validate() ties fp8_attention to the FP8 KV cache)
    EXPECT_EQ(bundle_bytes(c, p), double(bundle_from_params(mp, p, 1, 1, attn ? &sc : nullptr).bytes())) << p.fingerprint();
  }
  EXPECT_LT(bundle_bytes(c, precision_policy::named("fp8")), bundle_bytes(c, kept));  // (the kept layers count 2 bytes a weight)
}

TEST(Precision, ModelLogitsAndGradientsNearFp32) {
  const model_output o32 = run_policy("fp32"), o16 = run_policy("bf16"), o8 = run_policy("fp8");
  const double e16 = logits_err(o16, o32), e8 = logits_err(o8, o32);
  const double ge16 = grads_err(o16, o32), ge8 = grads_err(o8, o32);
  EXPECT_LT(e16, fp8rl::tol::kModelBf16VsF32);
  EXPECT_LT(e8, fp8rl::tol::kModelFp8VsF32);
  EXPECT_LT(ge16, fp8rl::tol::kModelBf16VsF32Grad);
  EXPECT_LT(ge8, fp8rl::tol::kModelFp8VsF32Grad);
  EXPECT_GT(e8, e16) << "FP8 should be measurably coarser than BF16";
  RecordProperty("logits_rel_err_bf16", std::to_string(e16));
  RecordProperty("logits_rel_err_fp8", std::to_string(e8));
  std::printf("logits rel err: bf16 %.3g fp8 %.3g; grads: bf16 %.3g fp8 %.3g\n", e16, e8, ge16, ge8);
}

// A tied lm_head (the embedding read as the head) is the head of the policy's head precision, as
// an untied one holding the same values: the same logits bit for bit under every policy (tied
// models were tested under fp32 only).
TEST(Precision, TiedHeadIsAnUntiedHeadOfTheSameValues) {
  model_config untied = small_config(), tied = small_config();
  tied.tie_word_embeddings = true;
  model_params pu = model_params_init(untied, 7);
  std::copy_n(pu.get("model.embed_tokens.weight"), untied.vocab_size * untied.hidden_size, pu.get("lm_head.weight"));
  const model_params pt = model_params_from_tensors(tied, model_params_to_tensors(pu), "tied");
  auto be = make_cpu_backend();
  token_batch b;
  b.add({5, 17, 33, 2, 90, 41, 7});
  auto logits = [&](const model_params& p, const char* policy) {
    model_runner run(*be);
    auto w = model_weights_build(*be, p.cfg, precision_policy::named(policy), {&p, nullptr, nullptr}, false);
    run.forward(*w, b, false);
    std::vector<float> out(static_cast<size_t>(b.T() * p.cfg.vocab_size));
    be->to_host(out.data(), run.logits(), out.size() * 4);
    return out;
  };
  for (const char* policy : {"fp32", "bf16", "fp8"})
    EXPECT_EQ(logits(pt, policy), logits(pu, policy)) << policy;
}

// The tile (AMX) policies change only the FP32 summation order inside the GEMMs, so they must
// meet the same format-derived bounds against FP32 as the exact kernels (and differ from them).
TEST(Precision, TilePoliciesMeetTheExactPoliciesBounds) {
  if (!gemm_tiles_available()) GTEST_SKIP() << "no AMX-BF16 here (active ISA " << cpu_isa_name(cpu_isa_active()) << ")";
  const model_output o32 = run_policy("fp32"), t16 = run_policy("bf16-tiles"), t8 = run_policy("fp8-tiles");
  EXPECT_LT(logits_err(t16, o32), fp8rl::tol::kModelBf16VsF32);
  EXPECT_LT(logits_err(t8, o32), fp8rl::tol::kModelFp8VsF32);
  EXPECT_LT(grads_err(t16, o32), fp8rl::tol::kModelBf16VsF32Grad);
  EXPECT_LT(grads_err(t8, o32), fp8rl::tol::kModelFp8VsF32Grad);
  EXPECT_NE(first_diff(t8.logits, run_policy("fp8").logits), -1) << "tile policy should not run the exact kernels";
  std::printf("tiles vs fp32: logits bf16 %.3g fp8 %.3g; grads bf16 %.3g fp8 %.3g\n", logits_err(t16, o32),
              logits_err(t8, o32), grads_err(t16, o32), grads_err(t8, o32));
}

TEST(Precision, TilePolicyNamesAndRefusalWithoutAmx) {
  const precision_policy t = precision_policy::named("fp8-kv-tiles");
  EXPECT_TRUE(t.tiles);
  EXPECT_TRUE(t.fp8_attention);
  EXPECT_NE(t.fingerprint(), precision_policy::named("fp8-kv").fingerprint());
  EXPECT_TRUE(t.training().tiles);
  for (const char* bad : {"fp32-tiles", "fp8-tiles-tiles", "-tiles", "tiles"})
    EXPECT_THROW(precision_policy::named(bad), std::invalid_argument) << bad;
  precision_policy f = precision_policy::named("fp32");
  f.tiles = true;
  EXPECT_THROW(f.validate(), std::invalid_argument);
  // Without AMX, building tile weights is an error naming the layer, never a silent fallback.
  fp8rl::test::isa_limit_scope no_amx(cpu_isa::avx512_bf16);
  model_config c = small_config();
  model_params p = model_params_init(c, 1);
  auto be = make_cpu_backend();
  try {
    model_weights_build(*be, c, precision_policy::named("bf16-tiles"), {&p, nullptr, nullptr}, false);
    ADD_FAILURE() << "tile weights were built without AMX";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("q_proj"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tiles"), std::string::npos) << e.what();
  }
}

TEST(Precision, Fp8AttentionNearBf16Attention) {
  model_config c = small_config();
  model_params p = model_params_init(c, 8);
  auto be = make_cpu_backend();
  token_batch b;
  std::vector<int32_t> seq(90);
  for (size_t i = 0; i < seq.size(); ++i) seq[i] = static_cast<int32_t>((i * 37 + 5) % 97);
  b.add(seq);
  // calibrate per-head scales on this batch (amax * 1.05 / 448), as the calibration actor does
  model_runner run(*be);
  auto w8 = model_weights_build(*be, c, precision_policy::named("fp8"), {&p, nullptr, nullptr}, false);
  qkv_stats st;
  run.forward(*w8, b, false, nullptr, &st);
  std::vector<float> base(static_cast<size_t>(b.T() * c.vocab_size)), fp8a(base.size());
  be->to_host(base.data(), run.logits(), base.size() * 4);
  attn_fp8_scales sc;
  for (float a : st.q) sc.q.push_back(a * 1.05f / 448.0f);
  for (float a : st.k) sc.k.push_back(a * 1.05f / 448.0f);
  for (float a : st.v) sc.v.push_back(a * 1.05f / 448.0f);
  auto wkv = model_weights_build(*be, c, precision_policy::named("fp8-kv"), {&p, nullptr, nullptr}, false);
  run.forward(*wkv, b, false, &sc);
  be->to_host(fp8a.data(), run.logits(), fp8a.size() * 4);
  const double e = fp8rl::tol::rel_norm_err(fp8rl::test::to_double(fp8a), fp8rl::test::to_double(base));
  EXPECT_GT(e, 0.0);
  EXPECT_LT(e, fp8rl::tol::kFp8AttentionVsBf16);
  std::printf("fp8 attention vs bf16 attention logits rel err %.3g\n", e);
  EXPECT_THROW(run.forward(*w8, b, false, &sc), std::invalid_argument);  // policy without fp8_attention
}

// Calibration's Q/K amax is taken after RoPE (rl-algorithm.md §5: the values the FP8 attention
// quantizes): layer 0's per-head amax equals the rotated projections' computed here step by step
// (embedding, norm, projection, rope), and differs from the unrotated ones' (positions past 0:
// RoPE is the identity at position 0).
TEST(Precision, QkvStatsAreTheAmaxOfTheRotatedProjections) {
  model_config c = small_config();
  model_params p = model_params_init(c, 8);
  auto be = make_cpu_backend();
  token_batch b;
  const std::vector<int32_t> seq = {3, 17, 5, 40, 9, 22, 61, 8};
  b.add(seq);
  model_runner run(*be);
  auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, false);
  qkv_stats st;
  run.forward(*w, b, false, nullptr, &st);
  const int64_t T = b.T(), C = c.hidden_size, H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
  buffer<float> x(*be, T * C), xn(*be, T * C), rstd(*be, T);
  be->embedding_forward(w->wte.data(), b.tokens.data(), T, C, x.data());
  be->rmsnorm_forward(x.data(), w->layers[0].attn_norm.data(), T, C, static_cast<float>(c.rms_norm_eps), xn.data(), rstd.data());
  const auto pos = b.positions();
  const struct { const prepared_linear* lin; int64_t nh; const std::vector<float>* amax; const char* what; } parts[] = {
      {w->layers[0].q.get(), H, &st.q, "Q"}, {w->layers[0].k.get(), KV, &st.k, "K"}};
  for (const auto& part : parts) {
    buffer<float> y(*be, T * part.nh * D);
    be->linear_forward(*part.lin, xn.data(), T, y.data());
    std::vector<float> before(static_cast<size_t>(T * part.nh * D)), after(before.size());
    be->to_host(before.data(), y.data(), before.size() * sizeof(float));
    be->rope(y.data(), pos.data(), T, part.nh, D, w->rope_inv_freq, false);
    be->to_host(after.data(), y.data(), after.size() * sizeof(float));
    bool rope_mattered = false;
    for (int64_t h = 0; h < part.nh; ++h) {
      float amax = 0.0f, amax_unrotated = 0.0f;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) {
          amax = std::max(amax, std::fabs(after[static_cast<size_t>((t * part.nh + h) * D + d)]));
          amax_unrotated = std::max(amax_unrotated, std::fabs(before[static_cast<size_t>((t * part.nh + h) * D + d)]));
        }
      EXPECT_EQ((*part.amax)[static_cast<size_t>(h)], amax) << part.what << " head " << h;
      rope_mattered |= amax != amax_unrotated;
    }
    EXPECT_TRUE(rope_mattered) << part.what << ": no head's amax moves under RoPE; the test cannot tell the order";
  }
}

// RMSNorm as Hugging Face's LlamaRMSNorm orders it: r = 1 / sqrt(mean(x^2) + eps), out = w * (x * r)
// bit for bit (x * r first, then the weight; (w * x) * r differs in the last bit of ~1/3 of the
// values), r within one FP32 ulp of the FP64 value (the kernel sums the squares in lanes, in FP64).
TEST(Precision, RmsnormIsWeightTimesNormalizedX) {
  auto be = make_cpu_backend();
  const int64_t T = 3, C = 200;  // 200: whole 16-lane blocks and a tail
  const auto x = randn(T * C, 81), w = randn(C, 82);
  std::vector<float> out(x.size()), rstd(static_cast<size_t>(T));
  be->rmsnorm_forward(x.data(), w.data(), T, C, 1e-5f, out.data(), rstd.data());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += double(x[t * C + c]) * x[t * C + c];
    const double r = 1.0 / std::sqrt(ss / double(C) + double(1e-5f));
    EXPECT_LE(std::fabs(rstd[t] - r), fp8rl::tol::fp32_ulps(r, 1)) << "row " << t;
    for (int64_t c = 0; c < C; ++c)
      ASSERT_EQ(float_bits(out[t * C + c]), float_bits(w[c] * (x[t * C + c] * rstd[t]))) << "row " << t << " col " << c;
  }
}

// BF16 attention operands round where the kernels say (models/cpu/attention.cpp): q, k and v
// to BF16, the probabilities P to BF16 before P.V (forward) and for dV (backward); dS from the
// unrounded P, dK from the rounded q, dQ from the rounded k. Checked against an FP64 model that
// rounds at exactly those points: only FP32 accumulation separates them, where a missed
// rounding point moves the results by ~2^-9 of a term (D = 32: the templated kernels; 24: the
// generic loops).
TEST(Precision, Bf16AttentionRoundsAtItsOperandPoints) {
  auto be = make_cpu_backend();
  const int64_t T = 20, H = 4, KV = 2, G = H / KV;
  for (int64_t D : {int64_t{24}, int64_t{32}}) {
    const auto q = randn(T * H * D, 61), k = randn(T * KV * D, 62), v = randn(T * KV * D, 63), dout = randn(T * H * D, 64);
    const int32_t seq_start[2] = {0, static_cast<int32_t>(T)};
    attn_params p;
    p.T = T; p.H = H; p.KV = KV; p.D = D; p.seq_start = seq_start; p.S = 1; p.operand = precision::bf16;
    std::vector<float> out(q.size()), lse(static_cast<size_t>(T * H)), dq(q.size()), dk(k.size()), dv(v.size());
    be->attention_forward(p, q.data(), k.data(), v.data(), out.data(), lse.data());
    be->attention_backward(p, q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(), dv.data());
    auto r = [](float x) { return double(bf16_round(x)); };
    std::vector<double> o(q.size()), gq(q.size(), 0.0), gk(k.size(), 0.0), gv(v.size(), 0.0);
    const double scale = 1.0 / std::sqrt(double(D));
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / G;
      for (int64_t i = 0; i < T; ++i) {
        const float* qi = q.data() + (i * H + h) * D;
        const float* di = dout.data() + (i * H + h) * D;
        std::vector<double> s(static_cast<size_t>(i + 1)), P(s.size()), Pr(s.size());
        double m = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += r(qi[d]) * r(k[(j * KV + g) * D + d]);
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
        for (int64_t j = 0; j <= i; ++j) P[j] = std::exp(s[j] - m) / sum, Pr[j] = r(static_cast<float>(P[j]));
        double Di = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j <= i; ++j) acc += Pr[j] * r(v[(j * KV + g) * D + d]);
          o[(i * H + h) * D + d] = acc;
          Di += double(di[d]) * acc;
        }
        for (int64_t j = 0; j <= i; ++j) {
          double dp = 0.0;
          for (int64_t d = 0; d < D; ++d) dp += double(di[d]) * r(v[(j * KV + g) * D + d]);
          const double dS = P[j] * (dp - Di) * scale;
          for (int64_t d = 0; d < D; ++d) {
            gq[(i * H + h) * D + d] += dS * r(k[(j * KV + g) * D + d]);
            gk[(j * KV + g) * D + d] += dS * r(qi[d]);
            gv[(j * KV + g) * D + d] += Pr[j] * di[d];
          }
        }
      }
    }
    const struct { const std::vector<float>* got; const std::vector<double>* want; const char* what; } parts[] = {
        {&out, &o, "out"}, {&dq, &gq, "dQ"}, {&dk, &gk, "dK"}, {&dv, &gv, "dV"}};
    for (const auto& part : parts) {
      const double e = fp8rl::tol::rel_norm_err(fp8rl::test::to_double(*part.got), *part.want);
      EXPECT_LE(e, fp8rl::tol::kAttnVsRoundedF64) << part.what << " D " << D;
      std::printf("D %ld %s: rel err vs the rounded FP64 model %.3g\n", static_cast<long>(D), part.what, e);
    }
  }
}

// The CPU backend's exp (softmax, SiLU): within 2 ulp of exact over its range, clamped outside,
// NaN kept.
TEST(CpuExp, WithinTwoUlpOfExactAndNaNPropagates) {
  double worst = 0;
  for (float x = -87.3f; x <= 88.0f; x = std::nextafter(x, 100.0f) + 1e-4f) {
    const double want = std::exp(static_cast<double>(x));
    const double err = std::fabs(static_cast<double>(cpu_exp(x)) - want);
    worst = std::max(worst, err / fp8rl::tol::fp32_ulps(want, 1));
    ASSERT_LE(err, fp8rl::tol::fp32_ulps(want, 2)) << "x = " << x;
  }
  for (float x : {-1e-30f, 0.0f, 1e-30f, -0.5f, 0.5f, 1.0f}) {  // near zero: e^x = 1 + x
    const double want = std::exp(static_cast<double>(x));
    EXPECT_LE(std::fabs(cpu_exp(x) - want), fp8rl::tol::fp32_ulps(want, 2)) << x;
  }
  EXPECT_EQ(cpu_exp(0.0f), 1.0f);
  // inputs below -87.33654 clamp there (fast_exp.hpp): e^-87.33654 ~ FLT_MIN, never 0
  EXPECT_EQ(cpu_exp(-1000.0f), cpu_exp(-87.33654f));
  EXPECT_LE(std::fabs(cpu_exp(-1000.0f) / std::exp(static_cast<double>(-87.33654f)) - 1.0), fp8rl::tol::kFastExpRel);
  // above 88 they clamp there: e^88 ~ 1.65e38, finite (an overflow to +Inf made softmax NaN)
  EXPECT_EQ(cpu_exp(1000.0f), cpu_exp(88.0f));
  EXPECT_LE(std::fabs(cpu_exp(88.0f) / std::exp(88.0) - 1.0), fp8rl::tol::kFastExpRel);
  EXPECT_TRUE(std::isnan(cpu_exp(std::numeric_limits<float>::quiet_NaN())));
  std::printf("cpu_exp worst error %.2f ulp\n", worst);
}
