// quant/aligned.cpp -- the huge-page mappings behind aligned_allocator's `huge` policy.
#include "quant/aligned.hpp"

#include <sys/mman.h>

#include <cstdint>

namespace fp8rl {
namespace {
std::size_t huge_round(std::size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }
}  // namespace

void* huge_alloc(std::size_t bytes) {
  const std::size_t size = huge_round(bytes), span = size + kHugePage;  // room to align
  void* m = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  char* base = static_cast<char*>(m);
  char* p = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(base) + kHugePage - 1) & ~(kHugePage - 1));
  if (p > base) ::munmap(base, static_cast<std::size_t>(p - base));  // trim to the aligned span
  if (base + span > p + size) ::munmap(p + size, static_cast<std::size_t>(base + span - (p + size)));
  ::madvise(p, size, MADV_HUGEPAGE);  // advice only: where refused, 4 KiB pages
  return p;
}

void huge_free(void* p, std::size_t bytes) noexcept { ::munmap(p, huge_round(bytes)); }

}  // namespace fp8rl
