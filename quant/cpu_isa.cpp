// quant/cpu_isa.cpp -- CPUID-based detection (GCC __builtin_cpu_supports).
#include "quant/cpu_isa.hpp"

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>

namespace fp8rl::quant {
namespace {
std::atomic<uint8_t> g_limit{static_cast<uint8_t>(cpu_isa::amx)};

// Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

cpu_isa detect() {
  __builtin_cpu_init();
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx512) return cpu_isa::portable;
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vbmi") ||
      !__builtin_cpu_supports("avx512vbmi2") || !__builtin_cpu_supports("gfni"))
    return cpu_isa::avx512;
  if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted()) return cpu_isa::amx;
  return cpu_isa::avx512_bf16;
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
    case cpu_isa::amx: return "amx";
  }
  return "unknown";
}

std::optional<cpu_isa> cpu_isa_parse(std::string_view s) {
  if (s == "portable") return cpu_isa::portable;
  if (s == "avx512") return cpu_isa::avx512;
  if (s == "avx512_bf16") return cpu_isa::avx512_bf16;
  if (s == "amx") return cpu_isa::amx;
  return std::nullopt;
}

}  // namespace fp8rl::quant
