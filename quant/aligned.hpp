// quant/aligned.hpp -- 64-byte aligned std::vector (for packed GEMM operands); on request, large
// buffers on transparent huge pages.
// defines: aligned_allocator, avector, avector_uninit, kHugeAllocMin, kHugePage, huge_alloc, huge_free
#pragma once
#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace fp8rl {

// An allocator with `huge` set puts buffers of at least kHugeAllocMin bytes in their own anonymous
// mappings, 2 MiB aligned, rounded up to 2 MiB and advised onto transparent huge pages
// (MADV_HUGEPAGE; a no-op where THP is off). For long-lived data streamed from DRAM, like the
// packed weights of generation: two cores streaming FP8 weights on 4 KiB pages read at 22-46 GB/s
// against 53-62 on 2 MiB pages (Zen 5, 4096^2 GEMV). Their own mappings, not malloc's heap: the
// advice must not stay on heap ranges that later serve ordinary allocations. Not the default:
// fresh huge pages cost a 2 MiB clear and, with THP's defrag on madvise, compaction at the first
// touch, so a training step that allocates its temporaries anew ran 12-35% slower with every
// large buffer huge.
inline constexpr std::size_t kHugeAllocMin = std::size_t{4} << 20;
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;
void* huge_alloc(std::size_t bytes);                // throws std::bad_alloc (quant/aligned.cpp)
void huge_free(void* p, std::size_t bytes) noexcept;  // bytes as given to huge_alloc

template <class T>
struct aligned_allocator {
  using value_type = T;
  // containers carry the policy along: copies of huge-page data stay huge-page data
  using propagate_on_container_copy_assignment = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  bool huge = false;
  aligned_allocator() noexcept = default;
  explicit aligned_allocator(bool huge_pages) noexcept : huge(huge_pages) {}
  template <class U>
  aligned_allocator(const aligned_allocator<U>& o) noexcept : huge(o.huge) {}
  bool huge_for(std::size_t n) const noexcept { return huge && n * sizeof(T) >= kHugeAllocMin; }
  T* allocate(std::size_t n) {
    if (huge_for(n)) return static_cast<T*>(huge_alloc(n * sizeof(T)));
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (huge_for(n)) huge_free(p, n * sizeof(T));
    else ::operator delete(p, std::align_val_t{64});
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
  explicit aligned_uninit_allocator(bool huge_pages) noexcept : aligned_allocator<T>(huge_pages) {}
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

}  // namespace fp8rl
