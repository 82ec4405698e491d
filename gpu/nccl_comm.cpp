// gpu/nccl_comm.cpp -- NCCL bootstrap and collectives.
#include "gpu/nccl_comm.hpp"

#include <cstdlib>
#include <cstring>

#include "gpu/device.hpp"

namespace fp8rl::gpu {

nccl_id nccl_make_id() {
  ncclUniqueId u;
  FP8RL_NCCL_CHECK(ncclGetUniqueId(&u));
  nccl_id id;
  static_assert(sizeof(u.internal) == 128);
  std::memcpy(id.data(), u.internal, 128);
  return id;
}

nccl_comm::nccl_comm(int nranks, int rank, const nccl_id& id, int device) : rank_(rank), device_(device) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLS changes reduction results (nccl#1497)
  setenv("NCCL_ALGO", "Ring", 0);
  setenv("NCCL_PROTO", "Simple", 0);
  FP8RL_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId u;
  std::memcpy(u.internal, id.data(), 128);
  ncclComm_t c;
  FP8RL_NCCL_CHECK(ncclCommInitRank(&c, nranks, u, rank));
  comm_ = c;
}

nccl_comm::~nccl_comm() {
  if (comm_) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

void nccl_comm::broadcast_bytes(void* buf, size_t n, int root) {
  FP8RL_CUDA_CHECK(cudaSetDevice(device_));
  FP8RL_NCCL_CHECK(ncclBroadcast(buf, buf, n, ncclUint8, root, static_cast<ncclComm_t>(comm_), nullptr));
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());  // adoptable only once the transfer completed
}

void nccl_comm::broadcast_floats(float* buf, size_t n, int root) {
  FP8RL_CUDA_CHECK(cudaSetDevice(device_));
  FP8RL_NCCL_CHECK(ncclBroadcast(buf, buf, n, ncclFloat32, root, static_cast<ncclComm_t>(comm_), nullptr));
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
}

void nccl_comm::allreduce_sum(float* buf, size_t n) {
  FP8RL_CUDA_CHECK(cudaSetDevice(device_));
  FP8RL_NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, static_cast<ncclComm_t>(comm_), nullptr));
  FP8RL_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace fp8rl::gpu
