// Host-side view of the TRTLLM-gen (SM100/SM103) handler for the nanobind module, which includes no
// CUDA code: the handler symbol and what the build knows about FlashInfer's kernel table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/api.h"

// Sparse MLA decode through FlashInfer's TRTLLM-gen kernels (trtllm_gen_decode.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaTrtllmGenDecode);

namespace jax_sparse_mla {

struct TrtllmGenBuildInfo {
  int64_t num_kernels;       // entries of the kernel table compiled in (0 with the stand-in)
  std::string cubin_path;    // FlashInfer's artifact path of the cubins, relative to a cubin folder
  std::string metainfo_hash; // sha256 of the flashInferMetaInfo.h compiled in ("" for the stand-in)
  std::string flashinfer_version;  // the flashinfer-python/-cubin release of headers and table
};

// One configuration for SelectTrtllmGenKernel.
struct TrtllmGenQuery {
  std::string q_dtype, kv_dtype;  // "bfloat16", "float16" or "float8_e4m3fn"
  int64_t batch = 1, q_len = 1, num_heads = 128, page_size = 64, num_pages = 1024, top_k = 2048;
  int sm = 100;          // 100 (B200) or 103 (B300)
  int sm_count = 148;    // the GPU's SM count (FlashInfer's selection depends on it)
  bool read_cubins = true;  // false: check the table only, answer cubin requests with a placeholder
};

// What FlashInfer's launcher selected for it, run on the host up to the kernel launch.
struct TrtllmGenSelection {
  std::string error;          // "" when a kernel was selected, its cubin loaded and launch reached
  std::string info;           // FlashInfer's kernel traits of the first selection (its message)
  int64_t candidate_kernels = 0;  // table entries for these dtypes and SM
  std::string function_name;  // the function the launch would run (cuModuleGetFunction)
  std::string cubin_path;     // as requested from the loader: <artifact>//<function>.cubin
  std::string cubin_sha256;   // the sha256 the table lists for it (the loader checked the file)
  int64_t cubin_bytes = 0;    // size of the cubin file read (0 with read_cubins = false)
  std::vector<std::string> requested_cubins;  // every cubin the selection passes loaded, in order
  bool launched = false;      // cuLaunchKernelEx was reached
  int64_t modules_loaded = 0, tensor_maps = 0;
  int64_t grid[3] = {0, 0, 0}, block[3] = {0, 0, 0}, cluster[3] = {1, 1, 1};
  int64_t shared_mem_bytes = 0;
  int64_t table_index = -1;   // the table entry of function_name
  std::string table_sha256;
  int64_t table_sm = 0, table_shared_mem_bytes = 0, table_threads = 0, multi_ctas_kv_mode = 0;
};

// Runs the handler's parameter set-up and FlashInfer's TllmGenFmhaKernel selection, cubin request
// (through the same loader as the handler) and launch set-up for `query` without a GPU, stopping at
// cuLaunchKernelEx (cuda_driver_shim.cc records driver calls instead of making them). Rejections
// carry the handler's message.
TrtllmGenSelection SelectTrtllmGenKernel(const TrtllmGenQuery& query);

TrtllmGenBuildInfo GetTrtllmGenBuildInfo();

// Bytes of the multi-CTA counter buffer FlashInfer's launcher requires
// (getTrtllmGenMultiCtasKvCounterBytes in trtllm_fmha_kernel_launcher.cu).
int64_t TrtllmGenCounterBytes(int64_t batch_size, int64_t num_heads, int64_t sm_count);

// Installs our C++ cubin callback into FlashInfer's loader (idempotent).
void InstallTrtllmGenCubinCallback();

}  // namespace jax_sparse_mla
