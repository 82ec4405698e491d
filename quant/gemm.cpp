// quant/gemm.cpp -- GEMM dispatch: checks operands, prepares A, picks the kernel and form.
// Every choice made here changes speed only, never a bit of the result.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include <stdexcept>

#include "quant/fp8.hpp"
#include "quant/gemm_impl.hpp"
#include "quant/quantize_impl.hpp"

namespace fp8rl::quant {
namespace {

using detail::gemm_a_operand;
using detail::gemm_model;

cpu_isa effective_isa(const gemm_config& cfg) {
  cpu_isa a = cpu_isa_active();
  return a < cfg.max_isa ? a : cfg.max_isa;
}

void check_packed(const gemm_desc& d, const gemm_packed_b& B, gemm_dtype want, const char* fn) {
  d.check();
  if (B.dtype != want)
    throw std::invalid_argument(std::string(fn) + ": B '" + B.name + "' was packed for another dtype");
  if (B.N != d.N || B.K != d.K)
    throw std::invalid_argument(std::string(fn) + ": B '" + B.name + "' is [" + std::to_string(B.N) +
                                ", " + std::to_string(B.K) + "], problem is " + d.str());
}

// Narrow (VDPBF16PS) kernels for small M or when only the narrow form exists.
bool use_narrow(const gemm_packed_b& B, bool has_narrow, int64_t M, cpu_isa isa, const gemm_config& cfg) {
  if (isa < cpu_isa::avx512_bf16 || !has_narrow) return false;
  if (M <= cfg.stream_max_m || B.wide.empty()) return true;
  if (cfg.large_m == gemm_kernel::automatic) return gemm_narrow_preferred();
  return cfg.large_m == gemm_kernel::narrow;
}

// Large M reads an FP8 pack's decoded form where it has one; small M streams the codes.
bool read_decoded(const gemm_packed_b& B, int64_t M, const gemm_config& cfg) {
  return !B.bf16.empty() && M > cfg.stream_max_m;
}

// Batched decode's FP8 codes decoded once per block for all row tiles (gemm_decode).
bool decode_once(const gemm_config& cfg) {
  if (cfg.batched_decode == gemm_decode::automatic) return !gemm_narrow_preferred();
  return cfg.batched_decode == gemm_decode::once;
}

void check_tiles(const gemm_packed_b& B, const char* fn) {
  if (!gemm_tiles_available())
    throw std::runtime_error(std::string(fn) + ": needs AMX-BF16 tiles, and this CPU (or its kernel) offers only " +
                             std::string(cpu_isa_name(cpu_isa_active())));
  if (B.tiles.empty())
    throw std::invalid_argument(std::string(fn) + ": B '" + B.name + "' has no tile form (pack it with forms.tiles)");
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A-operand scratch reused across calls: a fresh multi-megabyte buffer per call means fresh
// pages, and their faults cost about 10% of a 2048^3 FP8 GEMM. A lease takes a pooled buffer
// (or a new one) and returns it when destroyed; concurrent or nested calls each hold their own.
// Contents are unspecified: callers write every element they read (padding included).
class scratch_lease {
 public:
  explicit scratch_lease(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(pool_mutex());
      auto& pool = pool_buffers();
      if (!pool.empty()) {
        buf_ = std::move(pool.back());
        pool.pop_back();
      }
    }
    if (buf_.size() < bytes) buf_.resize(bytes);
  }
  ~scratch_lease() {
    std::lock_guard<std::mutex> lock(pool_mutex());
    auto& pool = pool_buffers();
    if (pool.size() < kMaxPooled) pool.push_back(std::move(buf_));
  }
  scratch_lease(const scratch_lease&) = delete;
  scratch_lease& operator=(const scratch_lease&) = delete;
  template <class T>
  T* as() { return reinterpret_cast<T*>(buf_.data()); }

 private:
  static constexpr size_t kMaxPooled = 4;
  static std::mutex& pool_mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<avector<uint8_t>>& pool_buffers() {
    static std::vector<avector<uint8_t>> p;
    return p;
  }
  avector<uint8_t> buf_;
};

void run_wide(gemm_model model, const gemm_a_operand& A, const gemm_packed_b& B, float* C, cpu_isa isa) {
  if (B.wide.empty())
    throw std::logic_error("gemm: B '" + B.name + "' has no FP32 form and this CPU path needs it");
  if (isa >= cpu_isa::avx512) detail::gemm_wide_avx512(model, A, B, C);
  else detail::gemm_wide_portable(model, A, B, C);
}

}  // namespace

void gemm_f32(const gemm_desc& d, const float* A, const gemm_packed_b& B, float* C,
              const gemm_config& cfg) {
  check_packed(d, B, gemm_dtype::f32, "gemm_f32");
  if (d.M == 0 || d.N == 0) return;
  run_wide(gemm_model::seq, {d.M, d.K, A, nullptr, nullptr}, B, C, effective_isa(cfg));
}

void gemm_bf16(const gemm_desc& d, const uint16_t* A, const gemm_packed_b& B, float* C,
               const gemm_config& cfg) {
  check_packed(d, B, gemm_dtype::bf16, "gemm_bf16");
  if (d.M == 0 || d.N == 0) return;
  const cpu_isa isa = effective_isa(cfg);
  const int64_t lda = B.Kp;
  if (use_narrow(B, !B.bf16.empty(), d.M, isa, cfg)) {
    avector<uint16_t> padded;
    const uint16_t* a = A;
    if (d.K != lda) {  // odd K: zero-pad to the packed pair count
      padded.assign(static_cast<size_t>(d.M * lda), 0);
      for (int64_t m = 0; m < d.M; ++m) std::copy(A + m * d.K, A + (m + 1) * d.K, padded.data() + m * lda);
      a = padded.data();
    }
    detail::gemm_narrow_avx512(gemm_model::pairs, {d.M, lda, nullptr, a, nullptr}, B, C);
    return;
  }
  scratch_lease values(static_cast<size_t>(d.M * lda) * sizeof(float));
  float* af = values.as<float>();  // FP32 values [M][lda]
  tbb::parallel_for(int64_t{0}, d.M, [&](int64_t m) {
    for (int64_t k = 0; k < d.K; ++k) af[m * lda + k] = bf16_to_float(A[m * d.K + k]);
    std::fill(af + m * lda + d.K, af + (m + 1) * lda, 0.0f);
  });
  run_wide(gemm_model::pairs, {d.M, lda, af, nullptr, nullptr}, B, C, isa);
}

namespace {
// The (B_i, C_i) of a grouped GEMM; a count mismatch names the function.
std::vector<detail::gemm_out> group_outs(std::span<const gemm_packed_b* const> Bs, std::span<float* const> Cs,
                                         const char* fn) {
  if (Bs.size() != Cs.size())
    throw std::invalid_argument(std::string(fn) + ": " + std::to_string(Bs.size()) + " weights for " +
                                std::to_string(Cs.size()) + " outputs");
  std::vector<detail::gemm_out> outs;
  for (size_t i = 0; i < Bs.size(); ++i) outs.push_back({Bs[i], Cs[i]});
  return outs;
}
}  // namespace

void gemm_bf16_group(const uint16_t* A, int64_t M, int64_t K, std::span<const gemm_packed_b* const> Bs,
                     std::span<float* const> Cs, const gemm_config& cfg) {
  const std::vector<detail::gemm_out> outs = group_outs(Bs, Cs, "gemm_bf16_group");
  if (outs.empty()) return;
  const cpu_isa isa = effective_isa(cfg);
  bool together = M > 0;  // one region where every B takes the narrow kernel on A as given
  for (const gemm_packed_b* B : Bs) {
    check_packed({M, B->N, K}, *B, gemm_dtype::bf16, "gemm_bf16_group");
    together = together && B->N > 0 && B->Kp == K && use_narrow(*B, !B->bf16.empty(), M, isa, cfg);
  }
  if (!together) {
    for (const auto& o : outs) gemm_bf16({M, o.B->N, K}, A, *o.B, o.C, cfg);
    return;
  }
  detail::gemm_narrow_avx512(gemm_model::pairs, {M, K, nullptr, A, nullptr}, outs);
}

namespace {
gemm_desc check_fp8(const qtensor& A, const gemm_packed_b& B, const char* fn) {
  if (A.layout == qlayout::block_128x128)
    throw std::invalid_argument(std::string(fn) + ": A '" + A.name +
                                "' uses 128x128 blocks; A needs 1x128 tiles (2Dx2D is rejected)");
  const gemm_desc d{A.op_rows(), B.N, A.op_cols()};
  check_packed(d, B, gemm_dtype::fp8, fn);
  if (A.mode != B.mode)
    throw std::invalid_argument(std::string(fn) + ": scale modes differ between '" + A.name + "' and '" + B.name + "'");
  return d;
}
}  // namespace

// Decode-sized A (a few rows of K codes: well under a microsecond) converts on the calling
// thread: a parallel_for per GEMV call cost the FP8 decode step ~2 us per call.
constexpr int64_t kConvertInlineRows = 4;

namespace {
// For (m) rows of A, in parallel unless decode-sized.
template <class Fn>
void for_rows(int64_t M, Fn&& fn) {
  if (M <= kConvertInlineRows) for (int64_t m = 0; m < M; ++m) fn(m);
  else tbb::parallel_for(int64_t{0}, M, fn);
}

// A's scales [M][KB] as the kernels read them.
avector<float> fp8_a_scales(const qtensor& A, int64_t M, int64_t KB) {
  avector<float> sa(static_cast<size_t>(M * KB), 0.0f);
  for_rows(M, [&](int64_t m) {
    for (int64_t kb = 0; kb < KB; ++kb) sa[m * KB + kb] = A.scale_at(m, kb);
  });
  return sa;
}

// The narrow FP8 kernel over outs (each B read alike: codes, or decoded where read_decoded), A's
// codes converted once: BF16 values [M][lda] (times 2^kCodesAExp), zero past K.
void fp8_narrow(const qtensor& A, const gemm_desc& d, int64_t lda, std::span<const detail::gemm_out> outs,
                bool decoded, const gemm_config& cfg) {
  const avector<float> sa = fp8_a_scales(A, d.M, lda / kBlock);
  scratch_lease values(static_cast<size_t>(d.M * lda) * sizeof(uint16_t));
  uint16_t* ab = values.as<uint16_t>();
  for_rows(d.M, [&](int64_t m) {
    detail::e4m3_to_bf16_avx512(A.data.data() + m * d.K, d.K, ab + m * lda, true);
    std::fill(ab + m * lda + d.K, ab + (m + 1) * lda, uint16_t{0});
  });
  detail::gemm_narrow_avx512(gemm_model::fp8, {d.M, lda, nullptr, ab, sa.data()}, outs, decode_once(cfg), decoded);
}
}  // namespace

void gemm_fp8(const qtensor& A, const gemm_packed_b& B, float* C, const gemm_config& cfg) {
  const gemm_desc d = check_fp8(A, B, "gemm_fp8");
  if (d.M == 0 || d.N == 0) return;
  const cpu_isa isa = effective_isa(cfg);
  const int64_t lda = B.Kp;
  if (use_narrow(B, !B.fp8.empty(), d.M, isa, cfg)) {
    const detail::gemm_out out{&B, C};
    fp8_narrow(A, d, lda, {&out, 1}, read_decoded(B, d.M, cfg), cfg);
    return;
  }
  const avector<float> sa = fp8_a_scales(A, d.M, lda / kBlock);
  scratch_lease values(static_cast<size_t>(d.M * lda) * sizeof(float));
  float* af = values.as<float>();  // FP32 values [M][lda]
  const float* lut = e4m3_table();
  for_rows(d.M, [&](int64_t m) {
    const uint8_t* src = A.data.data() + m * d.K;
    if (isa >= cpu_isa::avx512_bf16) detail::e4m3_to_f32_avx512(src, d.K, af + m * lda);
    else for (int64_t k = 0; k < d.K; ++k) af[m * lda + k] = lut[src[k]];
    std::fill(af + m * lda + d.K, af + (m + 1) * lda, 0.0f);
  });
  run_wide(gemm_model::fp8, {d.M, lda, af, nullptr, sa.data()}, B, C, isa);
}

void gemm_fp8_group(const qtensor& A, std::span<const gemm_packed_b* const> Bs, std::span<float* const> Cs,
                    const gemm_config& cfg) {
  const std::vector<detail::gemm_out> outs = group_outs(Bs, Cs, "gemm_fp8_group");
  if (outs.empty()) return;
  const cpu_isa isa = effective_isa(cfg);
  const gemm_packed_b& B0 = *outs[0].B;
  bool together = true;  // one region where every B takes the narrow kernel the same way
  gemm_desc d{};  // M and K are A's: the same for every B
  for (const auto& o : outs) {
    d = check_fp8(A, *o.B, "gemm_fp8_group");
    together = together && d.M > 0 && d.N > 0 && o.B->Kp == B0.Kp && use_narrow(*o.B, !o.B->fp8.empty(), d.M, isa, cfg) &&
               read_decoded(*o.B, d.M, cfg) == read_decoded(B0, d.M, cfg);
  }
  if (!together) {
    for (const auto& o : outs) gemm_fp8(A, *o.B, o.C, cfg);
    return;
  }
  fp8_narrow(A, d, B0.Kp, outs, read_decoded(B0, d.M, cfg), cfg);
}

bool gemm_narrow_preferred() {
  // ratio of multiply-add rates (VDPBF16PS / FMA): measured 0.5 on a Sapphire Rapids-class
  // Xeon and 2.0 on Zen 5; 1.0 splits them with the widest margin against a noisy probe
  static const bool preferred = cpu_isa_detected() >= cpu_isa::avx512_bf16 && detail::dpbf16_fma_rate_ratio() > 1.0;
  return preferred;
}

gemm_pack_forms gemm_forms_for(bool small_m) {
  const bool narrow_large = cpu_isa_active() >= cpu_isa::avx512_bf16 && gemm_narrow_preferred();
  return {!narrow_large, small_m || narrow_large, false};
}

bool gemm_tiles_available() { return cpu_isa_active() >= cpu_isa::amx; }

void gemm_bf16_tiles(const gemm_desc& d, const uint16_t* A, const gemm_packed_b& B, float* C, bool accumulate) {
  check_packed(d, B, gemm_dtype::bf16, "gemm_bf16_tiles");
  check_tiles(B, "gemm_bf16_tiles");
  if (d.M == 0 || d.N == 0) return;
  const int64_t Mp = round_up(d.M, 32), KS = B.Kt / 32;
  scratch_lease lease(static_cast<size_t>(Mp * B.Kt) * 2);  // every element written below
  uint16_t* a = lease.as<uint16_t>();
  tbb::parallel_for(int64_t{0}, Mp, [&](int64_t m) {
    if (m < d.M) detail::tiles_put_row(a, KS, m, A + m * d.K, d.K);
    else detail::tiles_put_row(a, KS, m, nullptr, 0);
  });
  detail::gemm_tiles_amx({d.M, Mp, d.N, KS, a, &B, nullptr, 1, accumulate}, C);
}

void gemm_fp8_tiles(const qtensor& A, const gemm_packed_b& B, float* C, bool accumulate) {
  const gemm_desc d = check_fp8(A, B, "gemm_fp8_tiles");
  check_tiles(B, "gemm_fp8_tiles");
  if (d.M == 0 || d.N == 0) return;
  const bool fold = A.mode == scale_mode::pow2;  // else: promotion per 128-K block
  const int64_t Mp = round_up(d.M, 32), KS = B.Kt / 32, KB = B.Kp / kBlock;
  scratch_lease lease(static_cast<size_t>(Mp * B.Kt) * 2);  // every element written below
  uint16_t* a = lease.as<uint16_t>();
  avector<float> sa(fold ? 0 : static_cast<size_t>(Mp * KB), 0.0f);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, Mp, 16), [&](const tbb::blocked_range<int64_t>& r) {
    std::vector<float> scale(static_cast<size_t>(KB));
    for (int64_t m = r.begin(); m < r.end(); ++m) {
      if (m >= d.M) {
        detail::tiles_put_row(a, KS, m, nullptr, 0);
        continue;
      }
      for (int64_t kb = 0; kb < KB; ++kb) (fold ? scale[kb] : sa[m * KB + kb]) = A.scale_at(m, kb);
      detail::tiles_put_fp8_row(a, KS, m, A.data.data() + m * d.K, d.K, fold ? scale.data() : nullptr);
    }
  });
  detail::gemm_tiles_amx({d.M, Mp, d.N, KS, a, &B, fold ? nullptr : sa.data(), KB, accumulate}, C);
}

bool gemm_fp8_wide_large_m() { return cpu_isa_active() >= cpu_isa::avx512 && !gemm_narrow_preferred(); }

namespace {
// A of the wide kernel from x, filled by `fill(A, &bad_row, &bad_block, &count)` (an AVX-512
// quantize_*_wide kernel); without AVX-512 the codes are quantized and decoded instead.
template <class Fill>
gemm_wide_a wide_a_build(const float* x, int64_t M, int64_t K, scale_mode mode, std::string name, qlayout layout,
                         Fill&& fill) {
  gemm_desc{M, 0, K}.check();
  gemm_wide_a A;
  A.name = std::move(name);
  A.mode = mode;
  A.M = M, A.K = K, A.Kp = round_up(K, kBlock);
  const int64_t Mp = round_up(M, 32), KB = A.Kp / kBlock;  // colwise writes whole 32-column panels
  A.values.resize(static_cast<size_t>(Mp * A.Kp));
  A.sa.resize(static_cast<size_t>(Mp * KB));
  if (cpu_isa_active() >= cpu_isa::avx512) {
    int64_t row = 0, block = 0, count = 0;
    if (!fill(A, &row, &block, &count)) detail::throw_nonfinite(A.name, layout, row, block, count);
    return A;
  }
  const qtensor q = layout == qlayout::rowwise_1x128 ? quantize(x, M, K, layout, mode, A.name)
                                                     : quantize(x, K, M, layout, mode, A.name);
  const float* lut = e4m3_table();
  std::fill(A.values.begin(), A.values.end(), 0.0f);
  std::fill(A.sa.begin(), A.sa.end(), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) A.values[m * A.Kp + k] = lut[q.data[m * K + k]];
    for (int64_t kb = 0; kb < KB; ++kb) A.sa[m * KB + kb] = q.scale_at(m, kb);
  }
  return A;
}
}  // namespace

gemm_wide_a gemm_wide_a_fp8(const float* x, int64_t M, int64_t K, scale_mode mode, std::string name) {
  return wide_a_build(x, M, K, mode, std::move(name), qlayout::rowwise_1x128,
                      [&](gemm_wide_a& A, int64_t* r, int64_t* b, int64_t* n) {
                        return detail::quantize_rowwise_wide_avx512(x, M, K, mode, A.Kp, A.values.data(), A.sa.data(),
                                                                    r, b, n);
                      });
}

gemm_wide_a gemm_wide_a_fp8_colwise(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name) {
  return wide_a_build(x, C, T, mode, std::move(name), qlayout::colwise_1x128,
                      [&](gemm_wide_a& A, int64_t* c, int64_t* b, int64_t* n) {
                        return detail::quantize_colwise_wide_a_avx512(x, T, C, mode, A.Kp, A.values.data(),
                                                                      A.sa.data(), c, b, n);
                      });
}

void gemm_fp8(const gemm_wide_a& A, const gemm_packed_b& B, float* C, const gemm_config& cfg) {
  const gemm_desc d{A.M, B.N, A.K};
  check_packed(d, B, gemm_dtype::fp8, "gemm_fp8");
  if (A.mode != B.mode)
    throw std::invalid_argument("gemm_fp8: scale modes differ between '" + A.name + "' and '" + B.name + "'");
  if (A.Kp != B.Kp) throw std::logic_error("gemm_fp8: A '" + A.name + "' and B '" + B.name + "' pad K differently");
  if (d.M == 0 || d.N == 0) return;
  const cpu_isa isa = effective_isa(cfg);
  if (!use_narrow(B, !B.fp8.empty(), d.M, isa, cfg)) {
    run_wide(gemm_model::fp8, {d.M, A.Kp, A.values.data(), nullptr, A.sa.data()}, B, C, isa);
    return;
  }
  // the narrow kernel reads BF16 values times 2^kCodesAExp: E4M3 values so scaled are exact in BF16
  avector<uint16_t> ab(static_cast<size_t>(d.M * A.Kp));
  for (int64_t i = 0; i < d.M * A.Kp; ++i) ab[i] = bf16_from_float(A.values[i] * detail::kCodesAScale);
  detail::gemm_narrow_avx512(gemm_model::fp8, {d.M, A.Kp, nullptr, ab.data(), A.sa.data()}, B, C, decode_once(cfg),
                             read_decoded(B, d.M, cfg));
}

namespace {
// A [M][K] of the FP8 tile GEMM from x, filled by `fill(fold, a, sa, &bad_row, &bad_block, &count)`
// (one of the quantize_*_tiles kernels); a non-finite tile throws as quantize would for `layout`.
template <class Fill>
gemm_tiles_a tiles_a_build(int64_t M, int64_t K, scale_mode mode, std::string name, qlayout layout, Fill&& fill) {
  gemm_desc{M, 0, K}.check();
  if (!gemm_tiles_available()) throw std::runtime_error("gemm_tiles_a: tile GEMMs need AMX (tensor '" + name + "')");
  gemm_tiles_a A;
  A.name = std::move(name);
  A.mode = mode;
  A.M = M, A.K = K, A.Mp = round_up(M, 32), A.Kt = round_up(K, kBlock);
  const bool fold = mode == scale_mode::pow2;
  A.a.resize(static_cast<size_t>(A.Mp * A.Kt));  // every element written
  if (!fold) A.sa.resize(static_cast<size_t>(A.Mp * (A.Kt / kBlock)));
  int64_t row = 0, block = 0, count = 0;
  if (!fill(A, fold, &row, &block, &count)) detail::throw_nonfinite(A.name, layout, row, block, count);
  return A;
}
}  // namespace

gemm_tiles_a gemm_tiles_a_fp8(const float* x, int64_t M, int64_t K, scale_mode mode, std::string name) {
  return tiles_a_build(M, K, mode, std::move(name), qlayout::rowwise_1x128,
                       [&](gemm_tiles_a& A, bool fold, int64_t* r, int64_t* b, int64_t* n) {
                         return detail::quantize_rowwise_tiles_avx512(x, M, K, mode, fold, A.Mp, A.Kt, A.a.data(),
                                                                      fold ? nullptr : A.sa.data(), r, b, n);
                       });
}

gemm_tiles_a gemm_tiles_a_fp8_colwise(const float* x, int64_t T, int64_t C, scale_mode mode, std::string name) {
  return tiles_a_build(C, T, mode, std::move(name), qlayout::colwise_1x128,
                       [&](gemm_tiles_a& A, bool fold, int64_t* c, int64_t* b, int64_t* n) {
                         return detail::quantize_colwise_tiles_a_avx512(x, T, C, mode, fold, A.Kt, A.a.data(),
                                                                        fold ? nullptr : A.sa.data(), c, b, n);
                       });
}

void gemm_fp8_tiles(const gemm_tiles_a& A, const gemm_packed_b& B, float* C, bool accumulate) {
  const gemm_desc d{A.M, B.N, A.K};
  check_packed(d, B, gemm_dtype::fp8, "gemm_fp8_tiles");
  check_tiles(B, "gemm_fp8_tiles");
  if (A.mode != B.mode)
    throw std::invalid_argument("gemm_fp8_tiles: scale modes differ between '" + A.name + "' and '" + B.name + "'");
  if (A.Kt != B.Kt) throw std::logic_error("gemm_fp8_tiles: A '" + A.name + "' and B '" + B.name + "' pad K differently");
  if (d.M == 0 || d.N == 0) return;
  const bool fold = A.mode == scale_mode::pow2;
  detail::gemm_tiles_amx({d.M, A.Mp, d.N, B.Kt / 32, A.a.data(), &B, fold ? nullptr : A.sa.data(), B.Kp / kBlock, accumulate}, C);
}

}  // namespace fp8rl::quant
