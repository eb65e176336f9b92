// A recording mode of the CUDA driver forwarders in cuda_driver_shim.cc, for running FlashInfer's
// TRTLLM-gen launcher on the host up to the kernel launch without a GPU or a driver.
//
// While CurrentDriverDryRun() points at a recorder (on the calling thread only), the forwarders do
// not call the driver: module loads and function look-ups return stand-in handles and are recorded,
// attribute and TMA-descriptor calls succeed, and cuLaunchKernelEx records its configuration and
// throws DriverDryRunLaunch, which ends the launcher's run() at the point where the kernel would
// start. The real handler never sets a recorder, so its calls go to the driver unchanged.
#pragma once

#include <cstdint>
#include <string>

namespace jax_sparse_mla {

struct DriverDryRun {
  int64_t modules_loaded = 0;       // cuModuleLoadData calls
  std::string function_name;        // the last cuModuleGetFunction name
  int64_t tensor_maps = 0;          // cuTensorMapEncodeTiled calls
  int64_t occupancy_queries = 0;    // cuOccupancyMaxActiveClusters calls
  bool launched = false;            // cuLaunchKernelEx was reached
  uint32_t grid[3] = {0, 0, 0};
  uint32_t block[3] = {0, 0, 0};
  uint32_t cluster[3] = {1, 1, 1};
  uint32_t shared_mem_bytes = 0;
};

// The calling thread's recorder (nullptr: forward to the driver).
DriverDryRun*& CurrentDriverDryRun();

// Thrown by cuLaunchKernelEx in dry-run mode after recording the launch.
struct DriverDryRunLaunch {};

}  // namespace jax_sparse_mla
