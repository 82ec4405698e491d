// tools/bench/bench_decode.cpp -- build/bin/bench-decode: rollout decode and prefill tokens/s for
// the TinyLlama-1.1B shape (hidden 2048, 22 layers, 32 heads / 4 KV heads, intermediate 5632,
// vocab 32000, random weights), weights fp32/bf16/fp8 x KV cache bf16/fp8, batch 1 and 16,
// context 512, 1 and 2 threads. Decode steps run at positions 512.. after the cache is filled
// with K/V (random values: a decode step's cost depends on the context length, not on values).
// KV fp8 is the fp8-kv policy's: an FP8 cache with FP8 attention. Prefill: batch 1 at 512-token
// prompts, batch 16 at 64-token ones (its "context": 16 x 512 would take 16 batch-1 prefills).
// Each line: {"bench":"decode","phase":"decode"|"prefill","weights":..,"kv":..,"batch":..,
//  "threads":..,"tokens_per_s":..,"bytes_per_token":..,"gbps":..,"bw_fraction":..,"runs":..}
// bytes_per_token (decode) = (weight bytes read per step + KV bytes read: codes, and the FP8
// cache's per-position K/V scales) / batch; bw_fraction
// compares the achieved bytes/s with a measured streaming-read bandwidth at the same threads.
// A last line per thread count, phase "decode_side_by_side" (--only=side_by_side alone), times fp8
// weights + fp8 KV against bf16 + bf16 at batch 1 (--batch=N: N) in alternating steps: its
// "speedup" is the median per-round ratio, the number to read on a shared machine (see
// run_decode_ratio); then one line per op (phase "ops": ms per step of each, and the GEMVs' GB/s)
// from the same rounds (medians), and their summary (phase "ops_summary": the speedup were the
// FP8 layer GEMVs streaming at the BF16 ones' bytes/s); with prefill on, "prefill_side_by_side":
// one 512-token prefill of each per round, the prefill target's ratio. The grid's lines above are
// measured one setting after another (minutes apart), not side by side.
// Phase "attention_codes" (--only=attention_codes alone): FP8-cache decode attention with and
// without subnormal codes against a BF16 cache (run_attention_codes). Every line carries phase,
// weights, kv, batch, threads and tokens_per_s: side by side and per op, the FP8 step's tokens/s;
// null where a line measures no model step (stream_read: no weights, KV, batch or tokens;
// attention_codes: one KV head's attention, no weights or tokens).
// Options: --json --quick (2 layers) --reps=N --threads=1,2 --only=SUBSTR --layers=N --prefill=0|1
//          --batch=N (side by side only)
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "models/cpu/cpu_backend.hpp"
#include "models/generate.hpp"
#include "quant/aligned.hpp"
#include "tools/bench/bench_util.hpp"

using namespace fp8rl;
using namespace fp8rl::bench;
using namespace fp8rl::models;

namespace {

model_config tinyllama(int64_t layers) {
  model_config c;
  c.hidden_size = 2048; c.intermediate_size = 5632; c.num_hidden_layers = layers; c.num_attention_heads = 32;
  c.num_key_value_heads = 4; c.head_dim = 64; c.vocab_size = 32000; c.max_position_embeddings = 2048;
  return c;
}

// Fast deterministic init (uniform, std 0.02); Box-Muller over 1.1B values would dominate the run.
model_params random_params(const model_config& c) {
  model_params p;
  p.cfg = c;
  p.layout = model_param_layout(c);
  p.data.resize(static_cast<size_t>(p.layout.total));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, p.layout.total, 1 << 20), [&](const auto& r) {
    uint64_t s = static_cast<uint64_t>(r.begin()) * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = r.begin(); i < r.end(); ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      p.data[i] = (static_cast<float>(s >> 40) / 16777216.0f - 0.5f) * 0.0693f;  // std 0.02
    }
  });
  for (const auto& info : p.layout.infos)
    if (!info.is_matrix) std::fill(p.data.begin() + info.offset, p.data.begin() + info.offset + info.numel, 1.0f);
  return p;
}

// The machine's streaming-read bandwidth at `threads`, the best of 5 reads of 1 GiB (the peak the
// fraction is of; a median came out below the decode GEMVs' bytes/s, fractions above 1) on huge
// pages, as generation keeps its weights (4 KiB pages read slower and raised bw_fraction): 64 tasks, each
// reading its 16 MiB as 4 concurrent streams in 64-byte vectors (integer OR) with a software
// prefetch 1.5 KiB ahead, as the decode GEMVs read their weights. One plain stream per task
// measured ~48 GB/s on the Zen 5 where this reads ~79 and the GEMVs 66-73 (2026-12-05): a core's
// outstanding misses, not DRAM, bounded it, so bw_fraction came out above 1.
double stream_read_gbps(int threads) {
  typedef uint64_t v8 __attribute__((vector_size(64)));
  static const fp8rl::avector<float> big(size_t(1) << 28, 1.0f, fp8rl::aligned_allocator<float>(true));  // 1 GiB
  constexpr int kTasks = 64, kStreams = 4;
  const size_t per_task = big.size() / kTasks, per_stream = per_task / kStreams;  // floats
  tbb::task_arena arena(threads);
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    std::vector<uint64_t> part(kTasks, 0);
    auto t0 = std::chrono::steady_clock::now();
    arena.execute([&] {
      tbb::parallel_for(0, kTasks, [&](int c) {
        const float* base = big.data() + c * per_task;
        v8 acc = {};
        for (size_t i = 0; i < per_stream; i += 16)
          for (int s = 0; s < kStreams; ++s) {
            const float* p = base + s * per_stream + i;
            __builtin_prefetch(p + 384);
            v8 x;
            std::memcpy(&x, p, sizeof x);
            acc |= x;
          }
        for (int j = 0; j < 8; ++j) part[c] |= acc[j];
      });
    });
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(big.size()) * 4 / sec / 1e9);
  }
  return best;
}

precision_policy bench_policy(const std::string& wname, const std::string& kvname) {
  precision_policy pol = precision_policy::named(wname == "fp32" ? "bf16" : wname);
  if (wname == "fp32") { pol.linear = precision::fp32; pol.head = precision::fp32; }
  pol.name = wname + "/" + kvname;
  pol.kv = *kv_dtype_parse(kvname);
  pol.fp8_attention = pol.kv == kv_dtype::fp8;
  return pol;
}

// One model's decode at `batch` slots: every slot's cache holds `ctx` positions of random K/V
// (run inside the arena that times it); step() decodes one token per slot at positions ctx..
struct decode_runner {
  backend& be;
  const model_weights& w;
  std::unique_ptr<kv_cache> cache;
  attn_fp8_scales sc;
  int64_t batch, ctx, steps, step_no = 0;
  std::vector<float> logits;
  std::vector<int32_t> tok, sl, ps;
  std::vector<int64_t> rows;

  decode_runner(backend& b, const model_weights& w_, int64_t batch_, int64_t ctx_, int64_t steps_)
      : be(b), w(w_), batch(batch_), ctx(ctx_), steps(steps_) {
    const int64_t layers = w.cfg.num_hidden_layers;
    sc.q.assign(static_cast<size_t>(layers * 32), 0.01f);
    sc.k.assign(static_cast<size_t>(layers * 4), 0.01f);
    sc.v.assign(static_cast<size_t>(layers * 4), 0.01f);
    cache = be.kv_cache_create(batch, layers, 4, 64, ctx + steps + 1, w.policy.kv);
    tok.resize(static_cast<size_t>(batch)); sl.resize(tok.size()); ps.resize(tok.size()); rows.resize(tok.size());
    for (int64_t s = 0; s < batch; ++s) { tok[s] = static_cast<int32_t>(s + 7); sl[s] = static_cast<int32_t>(s); rows[s] = s; }
  }
  void fill() {
    std::vector<float> kv(static_cast<size_t>(ctx * 4 * 64));
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = float(int64_t(i * 2654435761u % 2001) - 1000) * 1e-3f;
    std::vector<int32_t> slot(static_cast<size_t>(ctx)), pos(static_cast<size_t>(ctx));
    for (int64_t s = 0; s < batch; ++s) {
      std::fill(slot.begin(), slot.end(), static_cast<int32_t>(s));
      std::iota(pos.begin(), pos.end(), 0);
      for (int64_t l = 0; l < w.cfg.num_hidden_layers; ++l)
        be.kv_cache_write(*cache, l, {ctx, slot.data(), pos.data()}, kv.data(), kv.data(), sc.k.data(), sc.v.data());
    }
  }
  void step(forward_profile* prof = nullptr) {
    for (int64_t s = 0; s < batch; ++s) ps[s] = static_cast<int32_t>(ctx + (step_no % steps));
    ++step_no;
    engine_forward(be, w, *cache, sc, tok, sl, ps, rows, logits, nullptr, prof);
  }
};

// `batch` prompts of `plen` tokens in one prefill forward (rows: the last token of each).
struct prefill_batch {
  std::vector<int32_t> tok, slot, pos;
  std::vector<int64_t> rows;
};
prefill_batch prefill_make(int64_t batch, int64_t plen) {
  prefill_batch p;
  for (int64_t i = 0; i < batch * plen; ++i) {
    p.tok.push_back(static_cast<int32_t>((i * 7919) % 32000));
    p.slot.push_back(static_cast<int32_t>(i / plen));
    p.pos.push_back(static_cast<int32_t>(i % plen));
  }
  for (int64_t b = 0; b < batch; ++b) p.rows.push_back((b + 1) * plen - 1);
  return p;
}
// Seconds of one prefill of p on run's weights and cache.
double prefill_seconds(decode_runner& run, const prefill_batch& p) {
  const auto t0 = std::chrono::steady_clock::now();
  engine_forward(run.be, run.w, *run.cache, run.sc, p.tok, p.slot, p.pos, p.rows, run.logits, nullptr);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Weight bytes one decode step's op reads at `esize` bytes per layer weight (0: not a GEMV);
// the lm_head is BF16 under the FP8 and BF16 policies, FP32 under FP32.
double op_weight_bytes(const model_config& c, forward_op op, double esize) {
  const double C = double(c.hidden_size), F = double(c.intermediate_size), L = double(c.num_hidden_layers),
               HD = double(c.num_attention_heads * c.head_dim), KD = double(c.num_key_value_heads * c.head_dim);
  switch (op) {
    case forward_op::qkv: return L * (HD + 2 * KD) * C * esize;
    case forward_op::o_proj: return L * C * HD * esize;
    case forward_op::gate_up: return L * 2 * F * C * esize;
    case forward_op::down: return L * C * F * esize;
    case forward_op::lm_head: return double(c.vocab_size) * C * std::max(esize, 2.0);
    default: return 0;
  }
}

// A line of the side-by-side step's phases: bench and phase, the step's fields (weights, kv,
// batch, threads, tokens_per_s -- the whole FP8 step's, also on a per-op line), then the rest.
json_fields step_line(const char* phase, const json_fields& step, const json_fields& rest) {
  json_fields f = {{"bench", jstr("decode")}, {"phase", jstr(phase)}};
  f.insert(f.end(), step.begin(), step.end());
  f.insert(f.end(), rest.begin(), rest.end());
  return f;
}

// Per op of the side-by-side rounds (phase "ops"): the median over rounds of each op's ms per
// step, their ratio, and for the GEMVs the bytes/s they streamed -- where the two steps' times
// differ and where they do not. Then (phase "ops_summary") the layers' GEMVs against the rest of
// each step (lm_head, attention, norms: the same work in both): per round the FP8 layer GEMVs'
// bytes/s over the BF16 ones', the rest's ms, and the speedup the round would show were its FP8
// layer GEMVs streaming at the BF16 ones' bytes/s -- medians over rounds, as the speedup's.
void emit_op_profile(const bench_args& a, const model_config& cfg, const std::vector<forward_profile>& p8,
                     const std::vector<forward_profile>& p16, const json_fields& step) {
  auto median = [](const std::vector<forward_profile>& p, auto&& value) {
    std::vector<double> v;
    for (const auto& x : p) v.push_back(value(x));
    return bench_median_of(v);
  };
  for (size_t i = 0; i < forward_profile::kOps; ++i) {
    const auto op = static_cast<forward_op>(i);
    const auto sec = [i](const forward_profile& x) { return x.seconds[i]; };
    const double s8 = median(p8, sec), s16 = median(p16, sec);
    auto f = step_line("ops", step, {{"op", jstr(forward_profile::name(op))}, {"fp8_ms_per_step", jnum(s8 * 1e3)},
                                     {"bf16_ms_per_step", jnum(s16 * 1e3)}, {"bf16_over_fp8", jnum(s8 > 0 ? s16 / s8 : 0)}});
    if (const double b = op_weight_bytes(cfg, op, 1.0); b > 0) {
      f.push_back({"fp8_gbps", jnum(b / s8 / 1e9)});
      f.push_back({"bf16_gbps", jnum(op_weight_bytes(cfg, op, 2.0) / s16 / 1e9)});
    }
    bench_emit(a, f);
  }
  auto layer_gemv = [&](const forward_profile& x) {  // seconds of the layers' GEMVs in a step
    double sec = 0;
    for (size_t i = 0; i < forward_profile::kOps; ++i)
      if (const auto op = static_cast<forward_op>(i); op != forward_op::lm_head && op_weight_bytes(cfg, op, 1.0) > 0)
        sec += x.seconds[i];
    return sec;
  };
  auto total = [](const forward_profile& x) { return std::accumulate(x.seconds.begin(), x.seconds.end(), 0.0); };
  std::vector<double> rate, rest8, rest16, at_bf16;
  for (size_t r = 0; r < p8.size(); ++r) {
    const double l8 = layer_gemv(p8[r]), l16 = layer_gemv(p16[r]);
    if (l8 <= 0 || l16 <= 0) return;
    rate.push_back(l16 / (2 * l8));  // FP8 bytes/s over BF16's: the BF16 layers are twice the bytes
    rest8.push_back(total(p8[r]) - l8), rest16.push_back(total(p16[r]) - l16);
    at_bf16.push_back(total(p16[r]) / (rest8.back() + l16 / 2));
  }
  bench_emit(a, step_line("ops_summary", step,
                          {{"fp8_over_bf16_gemv_gbps", jnum(bench_median_of(rate))},
                           {"fp8_other_ms", jnum(bench_median_of(rest8) * 1e3)},
                           {"bf16_other_ms", jnum(bench_median_of(rest16) * 1e3)},
                           {"speedup_at_bf16_gemv_gbps", jnum(bench_median_of(at_bf16))}}));
}

// fp8 weights + fp8 KV against bf16 + bf16, `batch` sequences, side by side: rounds alternate one step of
// each, bf16 first in odd rounds (a shared machine's bandwidth drifts over minutes; both models
// see the same moments, neither always second), and the line reports the median over rounds of
// the two step times' ratio. With prefill on, a "prefill_side_by_side" line likewise times one
// 512-token prefill of each per round.
void run_decode_ratio(const bench_args& a, backend& be, const model_config& cfg, const model_params& params,
                      int64_t batch, int64_t ctx, int64_t steps, int t, bool prefill) {
  // long-lived (huge pages), as the generation engine keeps its weights (models/generate.cpp)
  const auto w8 = model_weights_build(be, cfg, bench_policy("fp8", "fp8"), {&params, nullptr, nullptr}, false, true);
  const auto w16 = model_weights_build(be, cfg, bench_policy("bf16", "bf16"), {&params, nullptr, nullptr}, false, true);
  decode_runner fp8(be, *w8, batch, ctx, steps), bf16(be, *w16, batch, ctx, steps);
  tbb::task_arena arena(t);
  arena.execute([&] {
    fp8.fill();
    bf16.fill();
    for (int i = 0; i < 2; ++i) { fp8.step(); bf16.step(); }  // warm-up
    std::vector<double> tf, tb, ratio;
    const int rounds = std::max(5, a.reps * 3);
    // per round; a clock read per op: well under a microsecond of ~100 per layer
    std::vector<forward_profile> prof8(static_cast<size_t>(rounds)), prof16(prof8.size());
    auto timed = [](decode_runner& run, forward_profile& prof) {
      const auto t0 = std::chrono::steady_clock::now();
      run.step(&prof);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    size_t i8 = 0, i16 = 0;  // each model's round
    const bench_pair_times pt =
        bench_side_by_side(rounds, [&] { return timed(fp8, prof8[i8++]); }, [&] { return timed(bf16, prof16[i16++]); });
    tf = pt.a, tb = pt.b, ratio = pt.ratio;
    // what the side-by-side line and the per-op lines share: the step they time (tokens_per_s: the FP8 step's)
    const std::string fp8_tps = jnum(double(batch) / bench_median_of(tf));
    const json_fields step = {{"weights", jstr("fp8 vs bf16")}, {"kv", jstr("fp8 vs bf16")}, {"batch", jnum(double(batch))},
                              {"threads", jnum(t)}, {"tokens_per_s", fp8_tps}};
    bench_emit(a, step_line("decode_side_by_side", step,
                            {{"context", jnum(double(ctx))}, {"layers", jnum(double(cfg.num_hidden_layers))},
                             {"fp8_tokens_per_s", fp8_tps}, {"bf16_tokens_per_s", jnum(double(batch) / bench_median_of(tb))},
                             {"speedup", jnum(bench_median_of(ratio))}, {"runs", jnum(rounds)}}));
    emit_op_profile(a, cfg, prof8, prof16, step);
    if (!prefill) return;
    const prefill_batch p = prefill_make(1, ctx);
    prefill_seconds(fp8, p), prefill_seconds(bf16, p);  // warm-up
    const bench_pair_times pp = bench_side_by_side(std::max(3, a.reps), [&] { return prefill_seconds(fp8, p); },
                                                   [&] { return prefill_seconds(bf16, p); });
    const std::string fp8_pps = jnum(double(ctx) / bench_median_of(pp.a));
    bench_emit(a, step_line("prefill_side_by_side",
                            {{"weights", jstr("fp8 vs bf16")}, {"kv", jstr("fp8 vs bf16")}, {"batch", jnum(1)}, {"threads", jnum(t)},
                             {"tokens_per_s", fp8_pps}},
                            {{"context", jnum(double(ctx))}, {"layers", jnum(double(cfg.num_hidden_layers))},
                             {"fp8_tokens_per_s", fp8_pps}, {"bf16_tokens_per_s", jnum(double(ctx) / bench_median_of(pp.b))},
                             {"speedup", jnum(bench_median_of(pp.ratio))}, {"runs", jnum(double(pp.ratio.size()))}}));
  });
}



// FP8-cache decode attention with and without subnormal codes (phase "attention_codes"): one KV
// head's G = 8 query rows over n = 512 cached positions (D = 64), K/V in L1/L2, one thread, against
// the same call on a BF16 cache. Codes "all": every finite code (16 in 256 with exponent field 0:
// +-0 and 14 subnormals); "normal": those moved to exponent field 1. Flags "cache": the per-slab
// subnormal flags the KV cache keeps (clean slabs take the shorter widen); "none": every slab
// widened the way that never meets a denormal. The widening must not slow down on subnormal codes
// (a denormal-operand microcode assist per vector did: ~2x on Zen 5).
void run_attention_codes(const bench_args& a) {
  const int64_t G = 8, n = 512, D = 64;
  std::vector<float> q(G * D), out(G * D), scratch(static_cast<size_t>(cpu_attn_group_scratch(n, D)));
  for (size_t i = 0; i < q.size(); ++i) q[i] = float((i * 37) % 17) / 17.0f - 0.5f;
  std::vector<uint16_t> k16(n * D), v16(n * D);
  for (size_t i = 0; i < k16.size(); ++i) {
    k16[i] = quant::bf16_from_float(float((i * 13) % 29) / 29.0f - 0.5f);
    v16[i] = quant::bf16_from_float(float((i * 7) % 31) / 31.0f - 0.5f);
  }
  const std::vector<float> ks(n + kAttnSlab, 0.01f), vs(n + kAttnSlab, 0.02f);
  const std::vector<attn_rounding> rq8(G, attn_rounding{precision::bf16, 0.05f}), rq16(G, attn_rounding{precision::bf16, 0.0f});
  const attn_kv_source a16{kv_dtype::bf16, k16.data(), v16.data(), nullptr, nullptr};
  tbb::task_arena one(1);
  for (const char* codes : {"normal", "all"}) {
    std::vector<uint8_t> k8(n * D), v8(n * D);
    auto code = [&](size_t i, size_t mul, size_t add) {  // every code but the NaNs (0x7F, 0xFF -> +-448)
      uint8_t c = static_cast<uint8_t>((i * mul + add) % 256);
      if ((c & 0x7F) == 0x7F) c ^= 1;
      if (codes[0] == 'n' && (c & 0x78) == 0) c |= 0x08;  // "normal": exponent field 0 -> 1
      return c;
    };
    for (size_t i = 0; i < k8.size(); ++i) k8[i] = code(i, 131, 7), v8[i] = code(i, 71, 3);
    // the cache's per-slab flags, as kv_cache_write sets them; "unflagged": none given (every slab
    // may hold a subnormal code: the widen that never meets a denormal)
    std::vector<uint8_t> flags(static_cast<size_t>(n / kAttnSlab), 0);
    for (int64_t j = 0; j < n; ++j) {
      std::vector<uint8_t> kj(static_cast<size_t>(D));
      for (int64_t d = 0; d < D; ++d) kj[d] = k8[(j / kAttnSlab * D + d) * kAttnSlab + j % kAttnSlab];
      flags[j / kAttnSlab] |= (quant::e4m3_any_subnormal(kj.data(), D) ? kSubnormalK : 0) |
                              (quant::e4m3_any_subnormal(v8.data() + j * D, D) ? kSubnormalV : 0);
    }
    auto call = [&](const attn_kv_source& s, const attn_rounding* rq) {
      return [&, s, rq] { cpu_attn_group(q.data(), D, rq, G, s, n, D, precision::bf16, out.data(), D, scratch.data()); };
    };
    for (const bool flagged : {true, false}) {
      const attn_kv_source a8{kv_dtype::fp8, k8.data(), v8.data(), ks.data(), vs.data(), flagged ? flags.data() : nullptr};
      double us8 = 0, us16 = 0;
      one.execute([&] {
        us8 = bench_median(a.reps, call(a8, rq8.data())) * 1e6;
        us16 = bench_median(a.reps, call(a16, rq16.data())) * 1e6;
      });
      int64_t clean = 0;
      for (uint8_t f : flags) clean += flagged && f == 0;
      bench_emit(a, {{"bench", jstr("decode")}, {"phase", jstr("attention_codes")}, {"weights", "null"},
                     {"kv", jstr("fp8 vs bf16")}, {"batch", jnum(1)}, {"tokens_per_s", "null"}, {"codes", jstr(codes)},
                     {"flags", jstr(flagged ? "cache" : "none")}, {"clean_slabs", jnum(double(clean))},
                     {"slabs", jnum(double(flags.size()))}, {"threads", jnum(1)}, {"context", jnum(double(n))},
                     {"fp8_us_per_kv_head", jnum(us8)}, {"bf16_us_per_kv_head", jnum(us16)}, {"fp8_over_bf16", jnum(us8 / us16)}});
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench_args a = bench_parse(argc, argv, {{"layers", "model layers (default 22, TinyLlama; 2 with --quick)"},
                                          {"prefill", "0: decode only (default 1)"},
                                          {"batch", "sequences of the side-by-side steps (default 1)"}});
  const int64_t layers = a.extra.count("layers") ? bench_positive("--layers", a.extra["layers"], 1 << 10) : (a.quick ? 2 : 22);
  const bool do_prefill = !a.extra.count("prefill") || a.extra["prefill"] != "0";
  const int64_t side_batch = a.extra.count("batch") ? bench_positive("--batch", a.extra["batch"], 1 << 10) : 1;
  if (bench_selected(a, "attention_codes")) run_attention_codes(a);
  if (a.only == "attention_codes") return 0;
  const model_config cfg = tinyllama(layers);
  const int64_t ctx = 512, decode_steps = a.quick ? 4 : 8;
  const model_params params = random_params(cfg);
  std::map<int, double> bw;
  for (int t : a.threads) bw[t] = stream_read_gbps(t);
  auto be = make_cpu_backend();
  for (const char* wname : {"fp32", "bf16", "fp8"}) {
    for (const char* kvname : {"bf16", "fp8"}) {
      const std::string tag = std::string(wname) + "/" + kvname;
      if (!bench_selected(a, tag)) continue;
      const precision_policy pol = bench_policy(wname, kvname);
      // bytes of weights a decode step reads (narrow forms: FP8 codes, BF16, or FP32 values)
      const double esize = std::string(wname) == "fp8" ? 1.0 : std::string(wname) == "bf16" ? 2.0 : 4.0;
      double wbytes = 0;
      for (size_t i = 0; i < forward_profile::kOps; ++i) wbytes += op_weight_bytes(cfg, static_cast<forward_op>(i), esize);
      const double kv_esize = pol.kv == kv_dtype::fp8 ? 1.0 : 2.0;
      const auto w = model_weights_build(*be, cfg, pol, {&params, nullptr, nullptr}, false, true);  // as generation
      for (int64_t batch : {int64_t{1}, int64_t{16}}) {
        decode_runner run(*be, *w, batch, ctx, decode_steps);
        for (int t : a.threads) {
          tbb::task_arena arena(t);
          arena.execute([&] {
            run.fill();
            const double sec = bench_median(a.reps, [&] { run.step(); }, 0.0);
            // K and V codes of every position read, plus the FP8 cache's per-position K and V scales
            const double kvbytes = double(batch) * layers * double(cfg.num_key_value_heads) * double(ctx + 1) *
                                   (2.0 * double(cfg.head_dim) * kv_esize + (pol.kv == kv_dtype::fp8 ? 8.0 : 0.0));
            const double bpt = (wbytes + kvbytes) / double(batch);
            bench_emit(a, {{"bench", jstr("decode")}, {"phase", jstr("decode")}, {"weights", jstr(wname)},
                           {"kv", jstr(kvname)}, {"batch", jnum(double(batch))}, {"threads", jnum(t)},
                           {"context", jnum(double(ctx))}, {"layers", jnum(double(layers))},
                           {"tokens_per_s", jnum(double(batch) / sec)}, {"bytes_per_token", jnum(bpt)},
                           {"gbps", jnum(bpt * double(batch) / sec / 1e9)},
                           {"bw_fraction", jnum(bpt * double(batch) / sec / 1e9 / bw[t])}, {"runs", jnum(a.reps)}});
            if (!do_prefill) return;
            // prefill: `batch` prompts in one forward (rows: the last token of each); batch 16 uses
            // 64-token prompts so the run stays in minutes on 2 cores (prefill is compute-bound:
            // tokens/s hardly depends on the prompt length at these sizes)
            const int64_t plen = batch > 1 ? 64 : ctx;
            const int64_t T = batch * plen;
            const prefill_batch p = prefill_make(batch, plen);
            const double psec = bench_median(std::min(a.reps, batch > 1 ? 1 : 3), [&] { prefill_seconds(run, p); }, 0.0);
            bench_emit(a, {{"bench", jstr("decode")}, {"phase", jstr("prefill")}, {"weights", jstr(wname)},
                           {"kv", jstr(kvname)}, {"batch", jnum(double(batch))}, {"threads", jnum(t)},
                           {"context", jnum(double(plen))}, {"layers", jnum(double(layers))},
                           {"tokens_per_s", jnum(double(T) / psec)}, {"runs", jnum(std::min(a.reps, batch > 1 ? 1 : 3))}});
          });
        }
      }
    }
  }
  if (bench_selected(a, "side_by_side"))
    for (int t : a.threads) run_decode_ratio(a, *be, cfg, params, side_batch, ctx, decode_steps, t, do_prefill);
  for (int t : a.threads)
    bench_emit(a, {{"bench", jstr("decode")}, {"phase", jstr("stream_read")}, {"weights", "null"}, {"kv", "null"},
                   {"batch", "null"}, {"threads", jnum(t)}, {"tokens_per_s", "null"}, {"gbps", jnum(bw[t])}});
}
