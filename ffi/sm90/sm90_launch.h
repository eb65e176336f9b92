// Host-side launch helpers shared by the SM90 handlers.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

namespace jax_sparse_mla::sm90 {

// Raises `kKernel`'s dynamic shared-memory limit to kSmemBytes (more than the default 48 KB) once
// per device (the attribute belongs to the device's context); a host-side call that stream capture
// allows.
template <auto kKernel, int kSmemBytes>
cudaError_t RaiseSharedMemoryLimit() {
  static std::atomic<uint64_t> raised_on{0};  // bit d: done on device d (d < 64)
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if ((raised_on.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const cudaError_t status =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (status == cudaSuccess) raised_on.fetch_or(bit, std::memory_order_relaxed);
  return status;
}

}  // namespace jax_sparse_mla::sm90
