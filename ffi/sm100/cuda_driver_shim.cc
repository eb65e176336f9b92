// The CUDA driver API functions FlashInfer's TRTLLM-gen runner calls (fmhaKernels.cuh,
// kernelParams.h: cubin loading, TMA descriptors, cluster launches), resolved at first use through
// the runtime's cudaGetDriverEntryPointByVersion instead of linking libcuda.so.
//
// Linking libcuda would make the extension fail to import on machines without an NVIDIA driver
// (CI, CPU hosts), where the package must still import and run its pure-JAX kernels. The runtime
// (cudart_static) already loads the driver lazily, so these forwarders do the same. They have
// hidden visibility: they never interpose on the real driver for other libraries in the process.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "common/driver_entry_point.h"
#include "sm100/driver_dry_run.h"

namespace jax_sparse_mla {

DriverDryRun*& CurrentDriverDryRun() {
  thread_local DriverDryRun* recorder = nullptr;
  return recorder;
}

}  // namespace jax_sparse_mla

namespace {

using jax_sparse_mla::CurrentDriverDryRun;
using jax_sparse_mla::DriverDryRun;

// Stand-in handles returned in dry-run mode (never dereferenced: nothing reaches the driver).
int dry_run_handle;

}  // namespace

// `name` is expanded by cuda.h's versioning macros in the definition (cuModuleGetGlobal ->
// cuModuleGetGlobal_v2, as at the call sites) but not in #name, the driver's entry-point name.
// The block after `args` runs instead of the driver call while a DriverDryRun recorder is set
// (driver_dry_run.h); it sees the recorder as `dry_run` and returns a CUresult.
#define JAX_SPARSE_MLA_FORWARD(name, params, args, ...)                             \
  extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI name params {   \
    if (DriverDryRun* dry_run = CurrentDriverDryRun()) {                             \
      (void)dry_run;                                                                 \
      __VA_ARGS__                                                                    \
    }                                                                                \
    using Fn = CUresult(CUDAAPI*) params;                                            \
    static const Fn fn = jax_sparse_mla::ResolveDriverFunction<Fn>(#name);           \
    return fn ? fn args : CUDA_ERROR_NOT_FOUND;                                      \
  }

JAX_SPARSE_MLA_FORWARD(cuCtxGetDevice, (CUdevice * device), (device), {
  *device = 0;
  return CUDA_SUCCESS;
})
JAX_SPARSE_MLA_FORWARD(cuDeviceGetAttribute, (int* value, CUdevice_attribute attrib, CUdevice dev),
                       (value, attrib, dev), {
                         *value = 0;
                         return CUDA_SUCCESS;
                       })
JAX_SPARSE_MLA_FORWARD(cuFuncSetAttribute, (CUfunction func, CUfunction_attribute attrib, int value),
                       (func, attrib, value), { return CUDA_SUCCESS; })
JAX_SPARSE_MLA_FORWARD(cuGetErrorName, (CUresult error, const char** name), (error, name), {
  *name = "CUDA_ERROR (driver dry run)";
  return CUDA_SUCCESS;
})
JAX_SPARSE_MLA_FORWARD(cuGetErrorString, (CUresult error, const char** text), (error, text), {
  *text = "driver dry run";
  return CUDA_SUCCESS;
})
JAX_SPARSE_MLA_FORWARD(cuLaunchKernelEx,
                       (const CUlaunchConfig* config, CUfunction f, void** params, void** extra),
                       (config, f, params, extra), {
                         dry_run->launched = true;
                         dry_run->grid[0] = config->gridDimX;
                         dry_run->grid[1] = config->gridDimY;
                         dry_run->grid[2] = config->gridDimZ;
                         dry_run->block[0] = config->blockDimX;
                         dry_run->block[1] = config->blockDimY;
                         dry_run->block[2] = config->blockDimZ;
                         dry_run->shared_mem_bytes = config->sharedMemBytes;
                         for (unsigned i = 0; i < config->numAttrs; ++i) {
                           if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
                             dry_run->cluster[0] = config->attrs[i].value.clusterDim.x;
                             dry_run->cluster[1] = config->attrs[i].value.clusterDim.y;
                             dry_run->cluster[2] = config->attrs[i].value.clusterDim.z;
                           }
                         }
                         throw jax_sparse_mla::DriverDryRunLaunch{};
                       })
JAX_SPARSE_MLA_FORWARD(cuModuleGetFunction, (CUfunction * func, CUmodule mod, const char* name),
                       (func, mod, name), {
                         dry_run->function_name = name;
                         *func = reinterpret_cast<CUfunction>(&dry_run_handle);
                         return CUDA_SUCCESS;
                       })
JAX_SPARSE_MLA_FORWARD(cuModuleGetGlobal,
                       (CUdeviceptr * ptr, size_t* bytes, CUmodule mod, const char* name),
                       (ptr, bytes, mod, name), {
                         *ptr = 0;
                         if (bytes) *bytes = 0;
                         return CUDA_SUCCESS;
                       })
JAX_SPARSE_MLA_FORWARD(cuModuleLoadData, (CUmodule * module, const void* image), (module, image), {
  ++dry_run->modules_loaded;
  *module = reinterpret_cast<CUmodule>(&dry_run_handle);
  return CUDA_SUCCESS;
})
JAX_SPARSE_MLA_FORWARD(cuOccupancyMaxActiveClusters,
                       (int* num_clusters, CUfunction func, const CUlaunchConfig* config),
                       (num_clusters, func, config), {
                         // Unknown without a GPU: report room for every cluster (no fallback).
                         ++dry_run->occupancy_queries;
                         *num_clusters = 1 << 20;
                         return CUDA_SUCCESS;
                       })
JAX_SPARSE_MLA_FORWARD(cuTensorMapEncodeTiled,
                       (CUtensorMap * tensor_map, CUtensorMapDataType data_type, cuuint32_t rank,
                        void* global_address, const cuuint64_t* global_dim,
                        const cuuint64_t* global_strides, const cuuint32_t* box_dim,
                        const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                        CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
                        CUtensorMapFloatOOBfill oob_fill),
                       (tensor_map, data_type, rank, global_address, global_dim, global_strides,
                        box_dim, element_strides, interleave, swizzle, l2_promotion, oob_fill),
                       {
                         ++dry_run->tensor_maps;
                         return CUDA_SUCCESS;
                       })
