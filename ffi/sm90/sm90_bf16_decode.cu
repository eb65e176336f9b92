// XLA FFI handler: sparse MLA decode over a bf16 cache on SM90 with our own kernel
// (sm90_bf16_kernel.cuh: rows copied by cp.async, no pack kernel, no conversion); the handler is
// sm90_own_decode.cuh's, with this kernel's launch. FlashInfer's kernel for the same caches is
// sm90_decode_bf16.cu.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "sm90/sm90_bf16_kernel.cuh"
#include "sm90/sm90_handlers.h"
#include "sm90/sm90_own_decode.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::fp8 {
namespace {

// Every head group on its own CTA (cp.async cannot fill a paired CTA's buffers).
cudaError_t LaunchBf16(KvLayout /*layout: kBf16*/, int /*heads_per_cta: 64*/,
                       const DecodeParams& params, cudaStream_t stream) {
  return LaunchDecodeKernel<bf16::SparseMlaBf16DecodeKernel, bf16::kHeads, bf16::kThreads,
                            sizeof(bf16::Shared)>(params, stream);
}

}  // namespace
}  // namespace jax_sparse_mla::fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSparseMlaSm90Bf16Decode,
    (jax_sparse_mla::fp8::Decode<jax_sparse_mla::fp8::LaunchBf16,
                                 jax_sparse_mla::fp8::RowsLayouts::kBf16>),
    jax_sparse_mla::fp8::DecodeBinding(), {xla::ffi::Traits::kCmdBufferCompatible});
