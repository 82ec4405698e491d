// gpu/cublaslt_plan.cpp -- host-side cuBLASLt layout plan (no CUDA calls; unit-tested on CPU).
#include <sstream>

#include "gpu/cublaslt_gemm.hpp"

namespace fp8rl::gpu {

std::string lt_gemm_desc::str() const {
  std::ostringstream os;
  os << "[M=" << M << " N=" << N << " K=" << K << " in=" << (in == lt_dtype::e4m3 ? "e4m3" : "bf16")
     << " out=" << (out == lt_dtype::f32 ? "f32" : "bf16") << "]";
  return os.str();
}

lt_layout_plan lt_plan(const lt_gemm_desc& d) {
  lt_layout_plan p;
  p.a_rows = d.K; p.a_cols = d.N; p.a_ld = d.K;
  p.b_rows = d.K; p.b_cols = d.M; p.b_ld = d.K;
  p.d_rows = d.N; p.d_cols = d.M; p.d_ld = d.N;
  const int64_t esize = d.in == lt_dtype::e4m3 ? 1 : 2, osize = d.out == lt_dtype::f32 ? 4 : 2;
  if (d.M <= 0 || d.N <= 0 || d.K <= 0) p.problems.push_back("dimensions must be positive");
  if ((p.a_ld * esize) % 16 || (p.b_ld * esize) % 16) p.problems.push_back("lda/ldb must be 16-byte multiples");
  if ((p.d_ld * osize) % 16) p.problems.push_back("ldd must be a 16-byte multiple");
  if (d.in == lt_dtype::e4m3) {
    if (d.K % 128) p.problems.push_back("K must be a multiple of 128 for block scaling");
    if (d.N % 128) p.problems.push_back("N (weight rows) must be a multiple of 128 for 128x128 blocks");
    if (d.M % 8) p.problems.push_back("M must be a multiple of 8");
    const int64_t kb = (d.K + 127) / 128;
    p.a_scale_count = (d.N + 127) / 128 * ((kb + 3) / 4 * 4);  // BLK128x128_32F s[nb][kb]
    p.b_scale_count = kb * ((d.M + 3) / 4 * 4);               // VEC128_32F s[kb][m]
  }
  return p;
}

}  // namespace fp8rl::gpu
