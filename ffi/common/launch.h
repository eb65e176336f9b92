// Host-side launch helpers shared by the handlers of every family.
#pragma once

#include <cuda_runtime_api.h>

#include "common/host_cache.h"

namespace jax_sparse_mla {

// Sets `kKernel`'s function attribute kAttribute to kValue once per device: the attribute belongs
// to the device's context and stays set, so per call this is one cudaGetDevice and one atomic load,
// not a cudaFuncSetAttribute (a runtime call that takes the runtime's locks, about a microsecond:
// docs/kernels/host-work.md). A host-side call that stream capture allows, on the first call too.
template <auto kKernel, cudaFuncAttribute kAttribute, int kValue>
cudaError_t SetKernelAttributeOnce() {
  static PerDeviceOnce set;
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  return set.Once(device, cudaSuccess,
                  [](int) { return cudaFuncSetAttribute(kKernel, kAttribute, kValue); });
}

// Raises `kKernel`'s dynamic shared-memory limit to kSmemBytes (more than the default 48 KB).
template <auto kKernel, int kSmemBytes>
cudaError_t RaiseSharedMemoryLimit() {
  return SetKernelAttributeOnce<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes>();
}

// Lets `kKernel` launch clusters above the portable 8 CTAs (SM90 runs up to 16 where the occupancy
// calculator says it can).
template <auto kKernel>
cudaError_t AllowNonPortableClusters() {
  return SetKernelAttributeOnce<kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1>();
}

}  // namespace jax_sparse_mla
