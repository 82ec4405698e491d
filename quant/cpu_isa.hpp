// quant/cpu_isa.hpp -- run-time CPU dispatch for the fast paths.
// defines: cpu_isa, cpu_isa_detected, cpu_isa_active, cpu_isa_set_limit, cpu_isa_name
//
// Levels are cumulative. `portable` is plain C++ and always available; `avx512` needs
// AVX-512 F/BW/VL/DQ; `avx512_bf16` adds AVX512_BF16, AVX512_VBMI/VBMI2 and GFNI (VDPBF16PS,
// VPERMI2B, VPEXPANDW, VGF2P8AFFINEQB: every CPU with the first three has GFNI);
// `amx` adds AMX-TILE + AMX-BF16 with the kernel's permission for tile data (arch_prctl), used
// only by the tile GEMMs (quant/gemm.hpp), which are tolerance-checked, not bit-exact.
// cpu_isa_set_limit lets tests and benchmarks run every path on one machine.
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

namespace fp8rl::quant {

enum class cpu_isa : uint8_t { portable = 0, avx512 = 1, avx512_bf16 = 2, amx = 3 };

cpu_isa cpu_isa_detected();
cpu_isa cpu_isa_active();            // min(detected, limit)
void cpu_isa_set_limit(cpu_isa max);  // process-wide; default: no limit
std::string_view cpu_isa_name(cpu_isa isa);
std::optional<cpu_isa> cpu_isa_parse(std::string_view s);

}  // namespace fp8rl::quant
