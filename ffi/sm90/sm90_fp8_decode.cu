// XLA FFI handler: sparse MLA decode over an fp8 cache on SM90 with our own kernels (the 16-head
// kernel of sm90_fp8_kernel.cuh, the 64-head kernel of sm90_fp8_wide_kernel.cuh); the handler is
// sm90_own_decode.cuh's, with these kernels' launch.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "sm90/sm90_fp8_kernel.cuh"
#include "sm90/sm90_fp8_wide_kernel.cuh"
#include "sm90/sm90_handlers.h"
#include "sm90/sm90_own_decode.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::fp8 {
namespace {

// Heads per CTA: 16 (the mma.sync kernel of sm90_fp8_kernel.cuh) or 64 (the warpgroup-MMA kernel
// of sm90_fp8_wide_kernel.cuh; for two head groups its paired form, one cluster per token and
// split).
template <KvLayout kLayout>
cudaError_t LaunchForHeads(int heads_per_cta, const DecodeParams& params, cudaStream_t stream) {
  if (heads_per_cta == 64 && (params.num_heads + wide::kHeads - 1) / wide::kHeads == 2) {
    return LaunchDecodeKernel<wide::SparseMlaFp8WideDecodeKernel<kLayout, true>, wide::kHeads,
                              wide::kThreads, sizeof(wide::Shared), 2>(params, stream);
  }
  if (heads_per_cta == 64) {
    return LaunchDecodeKernel<wide::SparseMlaFp8WideDecodeKernel<kLayout, false>, wide::kHeads,
                              wide::kThreads, sizeof(wide::Shared)>(params, stream);
  }
  using Config = TileConfig<kLayout>;
  return LaunchDecodeKernel<SparseMlaFp8DecodeKernel<Config>, Config::kHeads, kThreads,
                            Config::kSmemBytes>(params, stream);
}

cudaError_t LaunchFp8(KvLayout layout, int heads_per_cta, const DecodeParams& params,
                      cudaStream_t stream) {
  return layout == KvLayout::kDsMla
             ? LaunchForHeads<KvLayout::kDsMla>(heads_per_cta, params, stream)
             : LaunchForHeads<KvLayout::kE4m3>(heads_per_cta, params, stream);
}

}  // namespace
}  // namespace jax_sparse_mla::fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSparseMlaSm90Fp8Decode,
    jax_sparse_mla::fp8::Decode<jax_sparse_mla::fp8::LaunchFp8>,
    jax_sparse_mla::fp8::DecodeBinding(), {xla::ffi::Traits::kCmdBufferCompatible});
