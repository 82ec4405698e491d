// quant/aligned.hpp -- 64-byte aligned std::vector (for packed GEMM operands); large buffers on
// transparent huge pages.
// defines: aligned_allocator, avector, avector_uninit, kHugeAllocMin
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace fp8rl {

// Buffers of at least this many bytes are 2 MiB aligned, rounded up to 2 MiB and advised onto
// transparent huge pages (MADV_HUGEPAGE; a no-op where THP is off). Weights streamed from DRAM
// by two cores on 4 KiB pages read at 26-46 GB/s in FP8 against 58-62 on 2 MiB pages (Zen 5,
// decode-shaped GEMV, the same rounds side by side); smaller buffers are not worth the rounding.
inline constexpr std::size_t kHugeAllocMin = std::size_t{4} << 20;
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

template <class T>
struct aligned_allocator {
  using value_type = T;
  aligned_allocator() noexcept = default;
  template <class U>
  aligned_allocator(const aligned_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kHugeAllocMin) return static_cast<T*>(::operator new(bytes, std::align_val_t{64}));
    const std::size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = ::operator new(rounded, std::align_val_t{kHugePage});
    ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n * sizeof(T) < kHugeAllocMin) ::operator delete(p, std::align_val_t{64});
    else ::operator delete(p, std::align_val_t{kHugePage});
  }
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
