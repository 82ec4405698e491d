// gpu/nccl_comm.hpp -- NCCL communicators for weight sync and gradients (fp8-numerics.md §9).
// defines: nccl_id, nccl_make_id, nccl_comm
// The root's 128-byte unique id travels out of band (a CAF message); every rank builds the
// communicator on its device. Bundles broadcast as ncclUint8 (bit-exact), scales as
// ncclFloat32; gradients all-reduce in FP32 with ncclSum. Determinism: NCCL_ALGO/NCCL_PROTO are
// pinned and NVLS is off unless the environment already says otherwise.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

namespace fp8rl::gpu {

using nccl_id = std::array<uint8_t, 128>;
nccl_id nccl_make_id();

class nccl_comm {
 public:
  nccl_comm(int nranks, int rank, const nccl_id& id, int device);
  ~nccl_comm();
  nccl_comm(const nccl_comm&) = delete;
  nccl_comm& operator=(const nccl_comm&) = delete;
  void broadcast_bytes(void* buf, size_t n, int root);   // ncclUint8, synchronous
  void broadcast_floats(float* buf, size_t n, int root); // ncclFloat32
  void allreduce_sum(float* buf, size_t n);              // ncclFloat32, ncclSum
  int rank() const { return rank_; }

 private:
  void* comm_ = nullptr;
  int rank_ = 0, device_ = 0;
};

}  // namespace fp8rl::gpu
