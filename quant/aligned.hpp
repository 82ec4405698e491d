// quant/aligned.hpp -- 64-byte aligned std::vector (for packed GEMM operands).
// defines: aligned_allocator, avector, avector_uninit
#pragma once
#include <cstddef>
#include <new>
#include <utility>
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

// The same, but resize(n) leaves new elements default-initialized (indeterminate for scalars):
// for buffers that a packer overwrites completely, where zero-filling is a wasted pass.
template <class T>
struct aligned_uninit_allocator : aligned_allocator<T> {
  template <class U>
  struct rebind {
    using other = aligned_uninit_allocator<U>;
  };
  aligned_uninit_allocator() noexcept = default;
  template <class U>
  aligned_uninit_allocator(const aligned_uninit_allocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using avector_uninit = std::vector<T, aligned_uninit_allocator<T>>;

}  // namespace fp8rl
