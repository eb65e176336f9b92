// Host-side launch helpers shared by the handlers of every family.
#pragma once

#include <cuda_runtime_api.h>

#include "common/host_cache.h"

namespace jax_sparse_mla {

// Raises `kKernel`'s dynamic shared-memory limit to kSmemBytes (more than the default 48 KB) once
// per device: the attribute belongs to the device's context and stays set, so per call this is one
// cudaGetDevice and one atomic load, not a cudaFuncSetAttribute (a runtime call that takes the
// runtime's locks, about a microsecond: docs/kernels/host-work.md). A host-side call that stream
// capture allows, on the first call too.
template <auto kKernel, int kSmemBytes>
cudaError_t RaiseSharedMemoryLimit() {
  static PerDeviceOnce raised;
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  return raised.Once(device, cudaSuccess, [](int) {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  });
}

}  // namespace jax_sparse_mla
