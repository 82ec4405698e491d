// quant/aligned.hpp -- 64-byte aligned std::vector (for packed GEMM operands).
// defines: aligned_allocator, avector
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace fp8rl {

template <class T>
struct aligned_allocator {
  using value_type = T;
  aligned_allocator() noexcept = default;
  template <class U>
  aligned_allocator(const aligned_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const aligned_allocator<U>&) const noexcept { return true; }
};

template <class T>
using avector = std::vector<T, aligned_allocator<T>>;

}  // namespace fp8rl
