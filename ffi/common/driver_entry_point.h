// A CUDA driver API function resolved through the runtime's entry-point query
// (cudaGetDriverEntryPointByVersion) instead of linking libcuda.so: the extension must import on
// machines without an NVIDIA driver (CI, CPU hosts), where its pure-JAX kernels still run, and the
// runtime (cudart_static) already loads the driver lazily. Used by the SM90 indexer's tensor-map
// encoding and the SM100 driver forwarders (sm100/cuda_driver_shim.cc).
#pragma once

#include <cuda_runtime_api.h>

namespace jax_sparse_mla {

// The function `name` of the driver's CUDA 12.0 ABI (the signatures of cuda.h's PFN_*_v12000
// typedefs), or nullptr where the driver lacks it.
template <typename Fn>
Fn ResolveDriverFunction(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace jax_sparse_mla
