// tests/models/gradcheck_test.cpp -- finite-difference checks of every layer's backward (FP32
// central differences of L = sum(r * y) for random r), and of the whole model on sampled
// parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "models/cpu/cpu_backend.hpp"
#include "models/transformer.hpp"
#include "tests/test_util.hpp"
#include "tests/tolerances.hpp"

using namespace fp8rl::models;
using fp8rl::test::randn;

namespace {

// Checks analytic gradient `g` of f at x on `probes` coordinates (all if probes >= n).
void expect_grad(const char* what, std::vector<float>& x, const std::vector<float>& g,
                 const std::function<double()>& f, int probes = 64, float h = 1e-2f) {
  std::vector<double> num, ana;
  const size_t n = x.size();
  const size_t stride = std::max<size_t>(1, n / static_cast<size_t>(probes));
  for (size_t j = 0; j < n; j += stride) {
    const float x0 = x[j];
    x[j] = x0 + h;
    const double fp = f();
    x[j] = x0 - h;
    const double fm = f();
    x[j] = x0;
    num.push_back((fp - fm) / (2.0 * h));
    ana.push_back(g[j]);
  }
  EXPECT_LE(fp8rl::tol::rel_norm_err(ana, num), fp8rl::tol::kFiniteDiffF32) << what;
}

double dot(const std::vector<float>& r, const std::vector<float>& y) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += double(r[i]) * y[i];
  return s;
}

struct fixture {
  std::unique_ptr<backend> be = make_cpu_backend();
};

}  // namespace

TEST(GradCheck, RmsNorm) {
  fixture F;
  const int64_t T = 5, C = 24;
  auto x = randn(T * C, 1), w = randn(C, 2), r = randn(T * C, 3);
  std::vector<float> y(T * C), rstd(T), dx(T * C, 0.0f), dw(C, 0.0f);
  auto f = [&] { F.be->rmsnorm_forward(x.data(), w.data(), T, C, 1e-5f, y.data(), rstd.data()); return dot(r, y); };
  f();
  F.be->rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), T, C, dx.data(), dw.data());
  expect_grad("rmsnorm dx", x, dx, f);
  expect_grad("rmsnorm dw", w, dw, f);
}

TEST(GradCheck, RopeIsOrthogonal) {
  fixture F;
  const int64_t T = 6, nh = 3, D = 8;
  auto x = randn(T * nh * D, 4), r = randn(T * nh * D, 5);
  std::vector<int32_t> pos = {0, 1, 2, 7, 100, 3};
  auto f = [&] { auto y = x; F.be->rope(y.data(), pos.data(), T, nh, D, rope_inv_freq(10000.0, D), false); return dot(r, y); };
  auto g = r;
  F.be->rope(g.data(), pos.data(), T, nh, D, rope_inv_freq(10000.0, D), true);  // backward = inverse rotation of dout
  expect_grad("rope dx", x, g, f);
}

// The backend's cached cos/sin table gives exactly the per-element HF formula (FP32 inv_freq,
// FP32 angle, rotate_half), also for positions that make the table grow and for a second theta.
TEST(GradCheck, RopeEqualsTheHfFormulaAcrossTableGrowth) {
  fixture F;
  const int64_t nh = 2, D = 16, half = D / 2;
  for (double theta : {10000.0, 500000.0})
    for (std::vector<int32_t> pos : {std::vector<int32_t>{0, 5, 255}, std::vector<int32_t>{3, 4000, 1}}) {
      const int64_t T = static_cast<int64_t>(pos.size());
      const auto x = randn(T * nh * D, 11);
      for (bool inverse : {false, true}) {
        auto y = x;
        F.be->rope(y.data(), pos.data(), T, nh, D, rope_inv_freq(theta, D), inverse);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < nh; ++h)
            for (int64_t i = 0; i < half; ++i) {
              const float f = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(D));
              const float a = static_cast<float>(pos[t]) * f, c = std::cos(a), sn = inverse ? -std::sin(a) : std::sin(a);
              const float* v = x.data() + (t * nh + h) * D;
              ASSERT_EQ(y[(t * nh + h) * D + i], v[i] * c - v[i + half] * sn) << "pos " << pos[t] << " i " << i;
              ASSERT_EQ(y[(t * nh + h) * D + i + half], v[i + half] * c + v[i] * sn) << "pos " << pos[t] << " i " << i;
            }
      }
    }
  std::vector<int32_t> bad = {-1};
  auto y = randn(nh * D, 12);
  EXPECT_THROW(F.be->rope(y.data(), bad.data(), 1, nh, D, rope_inv_freq(10000.0, D), false), std::invalid_argument);
}

TEST(GradCheck, SwiGLU) {
  fixture F;
  const int64_t n = 50;
  auto gt = randn(n, 6), up = randn(n, 7), r = randn(n, 8);
  std::vector<float> h(n), dg(n), du(n);
  auto f = [&] { F.be->swiglu_forward(gt.data(), up.data(), n, h.data()); return dot(r, h); };
  F.be->swiglu_backward(r.data(), gt.data(), up.data(), n, dg.data(), du.data());
  expect_grad("swiglu dgate", gt, dg, f, 1000);
  expect_grad("swiglu dup", up, du, f, 1000);
}

// D = 8 runs the generic backward, 32 and 64 the register-blocked ones; the 24-token sequence
// spans several 8-row blocks and 16-key chunks. The second layout shares prefixes: sequences 1
// and 2 continue sequence 0 (11 tokens), sequence 4 continues sequence 3.
TEST(GradCheck, AttentionPackedGQA) {
  fixture F;
  const std::vector<int32_t> prefix = {-1, 0, 0, -1, 3};
  for (int64_t D : {8, 32, 64})
  for (bool shared : {false, true}) {
    const int64_t H = 4, KV = 2;
    const std::vector<int32_t> starts = shared ? std::vector<int32_t>{0, 11, 20, 21, 26, 37} : std::vector<int32_t>{0, 5, 6, 13, 37};
    const int64_t T = 37;
    attn_params p;
    p.T = T; p.H = H; p.KV = KV; p.D = D; p.seq_start = starts.data(); p.S = static_cast<int64_t>(starts.size()) - 1;
    if (shared) p.prefix = prefix.data();
    auto q = randn(T * H * D, 9), k = randn(T * KV * D, 10), v = randn(T * KV * D, 11), r = randn(T * H * D, 12);
    std::vector<float> out(T * H * D), lse(T * H), dq(q.size()), dk(k.size()), dv(v.size());
    auto f = [&] { F.be->attention_forward(p, q.data(), k.data(), v.data(), out.data(), lse.data()); return dot(r, out); };
    f();
    F.be->attention_backward(p, q.data(), k.data(), v.data(), out.data(), lse.data(), r.data(), dq.data(), dk.data(), dv.data());
    const std::string d = " D=" + std::to_string(D) + (shared ? " shared" : "");
    expect_grad(("attention dq" + d).c_str(), q, dq, f, 200);
    expect_grad(("attention dk" + d).c_str(), k, dk, f, 200);
    expect_grad(("attention dv" + d).c_str(), v, dv, f, 200);
  }
}

TEST(GradCheck, LinearFp32) {
  fixture F;
  const int64_t T = 7, out = 20, in = 33;
  auto x = randn(T * in, 13), w = randn(out * in, 14), r = randn(T * out, 15);
  std::vector<float> y(T * out), dx(T * in), dw(out * in, 0.0f);
  auto f = [&] {
    auto pl = F.be->linear_prepare({"w", out, in, precision::fp32, fp8rl::quant::scale_mode::pow2, w.data(), nullptr}, true);
    F.be->linear_forward(*pl, x.data(), T, y.data());
    return dot(r, y);
  };
  f();
  auto pl = F.be->linear_prepare({"w", out, in, precision::fp32, fp8rl::quant::scale_mode::pow2, w.data(), nullptr}, true);
  F.be->linear_backward(*pl, x.data(), r.data(), T, dx.data(), dw.data());
  expect_grad("linear dx", x, dx, f);
  expect_grad("linear dw", w, dw, f);
}

TEST(GradCheck, LogprobWithTemperatureAndTopK) {
  fixture F;
  const int64_t T = 4, V = 30;
  auto logits = randn(T * V, 16, 2.0f);
  std::vector<int32_t> targets = {3, -1, 7, 29};
  auto r = randn(T, 17);
  for (logit_processing proc : {logit_processing{1.0f, 0, 1.0f}, logit_processing{0.7f, 0, 1.0f}, logit_processing{1.3f, 12, 1.0f}}) {
    // keep the targets inside the top-k set so the function is smooth around x
    for (int64_t t = 0; t < T; ++t) if (targets[t] >= 0) logits[t * V + targets[t]] = 6.0f;
    std::vector<float> lp(T), dl(T * V);
    auto f = [&] { F.be->logprob_forward(logits.data(), targets.data(), T, V, proc, lp.data(), nullptr); return dot(r, lp); };
    F.be->logprob_backward(logits.data(), targets.data(), T, V, proc, r.data(), dl.data());
    expect_grad("logprob dlogits", logits, dl, f, 120, 1e-3f);  // small h: logits of 2-sigma scale, sharp softmax
  }
}

TEST(GradCheck, EmbeddingScatter) {
  fixture F;
  const int64_t V = 6, C = 5, T = 7;
  auto wte = randn(V * C, 18), r = randn(T * C, 19);
  std::vector<int32_t> tok = {1, 3, 1, 0, 5, 5, 1};
  std::vector<float> y(T * C), dw(V * C, 0.0f);
  auto f = [&] { F.be->embedding_forward(wte.data(), tok.data(), T, C, y.data()); return dot(r, y); };
  F.be->embedding_backward(r.data(), tok.data(), T, C, dw.data());
  expect_grad("embedding dwte", wte, dw, f, 1000);
}

TEST(GradCheck, WholeModelSampledParameters) {
  model_config c;
  c.hidden_size = 32; c.intermediate_size = 48; c.num_hidden_layers = 2; c.num_attention_heads = 4;
  c.num_key_value_heads = 2; c.head_dim = 8; c.vocab_size = 40; c.max_position_embeddings = 64;
  c.initializer_range = 0.3;
  for (bool tied : {false, true}) {
    c.tie_word_embeddings = tied;
    model_params p = model_params_init(c, 21);
    auto be = make_cpu_backend();
    model_runner run(*be);
    token_batch b = token_batch::pack({{1, 2, 3, 4, 5, 6}, {7, 8, 9}, {10, 11, 12, 13}});
    auto targets = b.next_targets();
    std::vector<float> r = randn(b.T(), 22);
    auto loss = [&]() {
      auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
      run.forward(*w, b, true);
      std::vector<float> lp(b.T());
      run.logprobs(targets, {}, lp.data());
      return dot(r, lp);
    };
    auto w = model_weights_build(*be, c, precision_policy::named("fp32"), {&p, nullptr, nullptr}, true);
    run.forward(*w, b, true);
    std::vector<float> grads(p.layout.total, 0.0f);
    run.backward(*w, targets, {}, r.data(), grads.data());
    expect_grad(tied ? "model (tied)" : "model", p.data, grads, loss, 300, 1e-2f);
  }
}
