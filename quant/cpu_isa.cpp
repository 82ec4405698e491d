// quant/cpu_isa.cpp -- CPUID-based detection (GCC __builtin_cpu_supports).
#include "quant/cpu_isa.hpp"

#include <atomic>

namespace fp8rl::quant {
namespace {
std::atomic<uint8_t> g_limit{static_cast<uint8_t>(cpu_isa::avx512_bf16)};

cpu_isa detect() {
  __builtin_cpu_init();
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx512) return cpu_isa::portable;
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi"))
    return cpu_isa::avx512_bf16;
  return cpu_isa::avx512;
}
}  // namespace

cpu_isa cpu_isa_detected() {
  static const cpu_isa isa = detect();
  return isa;
}

cpu_isa cpu_isa_active() {
  uint8_t d = static_cast<uint8_t>(cpu_isa_detected());
  uint8_t l = g_limit.load(std::memory_order_relaxed);
  return static_cast<cpu_isa>(d < l ? d : l);
}

void cpu_isa_set_limit(cpu_isa max) { g_limit.store(static_cast<uint8_t>(max)); }

std::string_view cpu_isa_name(cpu_isa isa) {
  switch (isa) {
    case cpu_isa::portable: return "portable";
    case cpu_isa::avx512: return "avx512";
    case cpu_isa::avx512_bf16: return "avx512_bf16";
  }
  return "unknown";
}

std::optional<cpu_isa> cpu_isa_parse(std::string_view s) {
  if (s == "portable") return cpu_isa::portable;
  if (s == "avx512") return cpu_isa::avx512;
  if (s == "avx512_bf16") return cpu_isa::avx512_bf16;
  return std::nullopt;
}

}  // namespace fp8rl::quant
