// gpu/kernels/e4m3_device.cuh -- the E4M3 codec on the device: the same integer SATFINITE RNE
// encoder as quant/fp8.cpp (byte for byte, tested against it) and an exact decoder.
#pragma once
#include <cstdint>

namespace fp8rl::gpu {

__device__ __forceinline__ uint8_t e4m3_encode(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;                 // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;         // [448, Inf] saturates
  if (a >= 0x3c800000u)                             // normal: RNE on exponent|mantissa, rebias
    return sign | static_cast<uint8_t>(((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - 960u);
  const uint32_t e = a >> 23;                       // subnormal: k units of 2^-9
  if (e == 0) return sign;
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u, shift = 141u - e;
  if (shift >= 32u) return sign;
  uint32_t k = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (k & 1u))) ++k;
  return sign | static_cast<uint8_t>(k);
}

__device__ __forceinline__ float e4m3_decode(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return __int_as_float(0x7fc00000);  // 0x7F / 0xFF: NaN (fp8-numerics §1), not +-480
  const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(float(m), -9);
  return s ? -v : v;
}

}  // namespace fp8rl::gpu
