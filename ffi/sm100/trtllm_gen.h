// Host-side view of the TRTLLM-gen (SM100/SM103) handler for the nanobind module, which includes no
// CUDA code: the handler symbol and what the build knows about FlashInfer's kernel table.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/api.h"

// Sparse MLA decode through FlashInfer's TRTLLM-gen kernels (trtllm_gen_decode.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaTrtllmGenDecode);

namespace jax_sparse_mla {

struct TrtllmGenBuildInfo {
  int64_t num_kernels;       // entries of the kernel table compiled in (0 with the stand-in)
  std::string cubin_path;    // FlashInfer's artifact path of the cubins, relative to a cubin folder
  std::string metainfo_hash; // sha256 of the flashInferMetaInfo.h compiled in ("" for the stand-in)
};

TrtllmGenBuildInfo GetTrtllmGenBuildInfo();

// Bytes of the multi-CTA counter buffer FlashInfer's launcher requires
// (getTrtllmGenMultiCtasKvCounterBytes in trtllm_fmha_kernel_launcher.cu).
int64_t TrtllmGenCounterBytes(int64_t batch_size, int64_t num_heads, int64_t sm_count);

// Installs our C++ cubin callback into FlashInfer's loader (idempotent).
void InstallTrtllmGenCubinCallback();

}  // namespace jax_sparse_mla
