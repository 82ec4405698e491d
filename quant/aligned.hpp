// quant/aligned.hpp -- 64-byte aligned std::vector (for packed GEMM operands); on request, large
// buffers on transparent huge pages.
// defines: aligned_allocator, avector, avector_uninit, kHugeAllocMin, kHugePage, on_huge_pages
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace fp8rl {

// An allocator with `huge` set puts buffers of at least kHugeAllocMin bytes on 2 MiB boundaries,
// rounded up to 2 MiB and advised onto transparent huge pages (MADV_HUGEPAGE; a no-op where THP
// is off). For long-lived data streamed from DRAM, like the packed weights of generation: two
// cores streaming FP8 weights on 4 KiB pages read at 22-46 GB/s against 53-62 on 2 MiB pages
// (Zen 5, 4096^2 GEMV). Not the default: fresh huge pages cost a 2 MiB clear and, with THP's
// defrag on madvise, compaction at the first touch, so a training step that allocates its
// temporaries anew ran 12-35% slower with every large buffer huge.
inline constexpr std::size_t kHugeAllocMin = std::size_t{4} << 20;
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

template <class T>
struct aligned_allocator {
  using value_type = T;
  // containers carry the policy along: copies of huge-page data stay huge-page data
  using propagate_on_container_copy_assignment = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  bool huge = false;
  aligned_allocator() noexcept = default;
  explicit aligned_allocator(bool on_huge_pages) noexcept : huge(on_huge_pages) {}
  template <class U>
  aligned_allocator(const aligned_allocator<U>& o) noexcept : huge(o.huge) {}
  bool huge_for(std::size_t n) const noexcept { return huge && n * sizeof(T) >= kHugeAllocMin; }
  T* allocate(std::size_t n) {
    if (!huge_for(n)) return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
    const std::size_t rounded = (n * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
    void* p = ::operator new(rounded, std::align_val_t{kHugePage});
    ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    ::operator delete(p, std::align_val_t{huge_for(n) ? kHugePage : 64});
  }
  template <class U>
  bool operator==(const aligned_allocator<U>& o) const noexcept { return huge == o.huge; }
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
  explicit aligned_uninit_allocator(bool on_huge_pages) noexcept : aligned_allocator<T>(on_huge_pages) {}
  template <class U>
  aligned_uninit_allocator(const aligned_uninit_allocator<U>& o) noexcept : aligned_allocator<T>(o.huge) {}
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

// v's contents moved into a buffer whose allocator has `huge` set (one copy; no-op if it has).
template <class V>
void on_huge_pages(V& v) {
  if (v.get_allocator().huge) return;
  V h(typename V::allocator_type(true));
  h.reserve(v.size());
  h.insert(h.end(), v.begin(), v.end());
  v = std::move(h);  // the allocator propagates
}

}  // namespace fp8rl
