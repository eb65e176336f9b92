// XLA FFI handler: sparse MLA decode over a bf16 cache on SM90 with our own kernel, the 64-head
// warpgroup-MMA kernel of sm90_fp8_wide_kernel.cuh over rows copied by cp.async (no pack kernel,
// no conversion); the handler is sm90_own_decode.cuh's, with this kernel's launch. FlashInfer's
// kernel for the same caches is sm90_decode_bf16.cu.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "sm90/sm90_fp8_wide_kernel.cuh"
#include "sm90/sm90_handlers.h"
#include "sm90/sm90_own_decode.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::fp8 {
namespace {

// Every head group on its own CTA (cp.async cannot fill a paired CTA's buffers).
cudaError_t LaunchBf16(KvLayout /*layout: kBf16*/, int /*heads_per_cta: 64*/,
                       const DecodeParams& params, cudaStream_t stream) {
  return LaunchDecodeKernel<wide::SparseMlaFp8WideDecodeKernel<KvLayout::kBf16, false>,
                            wide::kHeads, wide::kThreads, sizeof(wide::Shared)>(params, stream);
}

}  // namespace
}  // namespace jax_sparse_mla::fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSparseMlaSm90Bf16Decode,
    (jax_sparse_mla::fp8::Decode<jax_sparse_mla::fp8::LaunchBf16,
                                 jax_sparse_mla::fp8::RowsLayouts::kBf16>),
    jax_sparse_mla::fp8::DecodeBinding(), {xla::ffi::Traits::kCmdBufferCompatible});
