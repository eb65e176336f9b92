// XLA FFI handler: sparse MLA decode over an fp8 cache on SM90 with our own kernel
// (sm90_fp8_kernel.cuh). One launch of the decode kernel and, when the plan splits the slot list,
// one launch of the merge; no host synchronisation, no allocation (partials are XLA scratch).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "sm90/sm90_fp8_kernel.cuh"
#include "sm90/sm90_fp8_wide_kernel.cuh"
#include "sm90/sm90_handlers.h"
#include "sm90/sm90_launch.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::fp8 {
namespace {

namespace ffi = xla::ffi;

ffi::Error ArgumentError(const std::string& what) {
  return ffi::Error::InvalidArgument("sparse_mla sm90 fp8 decode: " + what);
}

using sm90::RaiseSharedMemoryLimit;

// One CTA of kThreadsPerCta threads per (group of kHeadsPerCta heads, split, token), in clusters
// of kClusterSize CTAs along the head groups. Head groups vary fastest: the CTAs of one token's
// splits gather the same rows close in time.
template <auto kKernel, int kHeadsPerCta, int kThreadsPerCta, int kSmemBytes, int kClusterSize = 1>
cudaError_t Launch(const DecodeParams& params, cudaStream_t stream) {
  if (cudaError_t status = RaiseSharedMemoryLimit<kKernel, kSmemBytes>(); status != cudaSuccess) {
    return status;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((params.num_heads + kHeadsPerCta - 1) / kHeadsPerCta, params.num_splits,
                        params.num_tokens);
  config.blockDim = dim3(kThreadsPerCta);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kClusterSize;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = kClusterSize > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kKernel, params);
}

template <typename Config>
cudaError_t LaunchDecode(const DecodeParams& params, cudaStream_t stream) {
  return Launch<SparseMlaFp8DecodeKernel<Config>, Config::kHeads, kThreads, Config::kSmemBytes>(
      params, stream);
}

// Heads per CTA: 16 (the mma.sync kernel of sm90_fp8_kernel.cuh) or 64 (the warpgroup-MMA kernel
// of sm90_fp8_wide_kernel.cuh; for two head groups its paired form, one cluster per token and
// split).
template <KvLayout kLayout>
cudaError_t LaunchForHeads(int heads_per_cta, const DecodeParams& params, cudaStream_t stream) {
  if (heads_per_cta == 64 && (params.num_heads + wide::kHeads - 1) / wide::kHeads == 2) {
    return Launch<wide::SparseMlaFp8WideDecodeKernel<kLayout, true>, wide::kHeads,
                  wide::kThreads, sizeof(wide::Shared), 2>(params, stream);
  }
  if (heads_per_cta == 64) {
    return Launch<wide::SparseMlaFp8WideDecodeKernel<kLayout, false>, wide::kHeads,
                  wide::kThreads, sizeof(wide::Shared)>(params, stream);
  }
  return LaunchDecode<TileConfig<kLayout>>(params, stream);
}

ffi::Error Sm90Fp8Decode(cudaStream_t stream,
                         ffi::Buffer<ffi::BF16> q,             // [T, H, 576]
                         ffi::AnyBuffer kv_rows,               // [N, 576] e4m3 or [N, 656] u8
                         ffi::Buffer<ffi::S32> indices,        // [T, K]
                         ffi::Buffer<ffi::S32> valid_counts,   // [T]
                         ffi::ResultBuffer<ffi::BF16> out,     // [T, H, 512]
                         ffi::ResultBuffer<ffi::F32> lse,      // [T, H]
                         ffi::ResultBuffer<ffi::F32> partial_out,  // [S, T, H, 512] or [1]
                         ffi::ResultBuffer<ffi::F32> partial_lse,  // [S, T, H] or [1]
                         int64_t layout, int64_t heads_per_cta, int64_t num_splits,
                         int64_t keys_per_split, float score_scale_log2, float out_scale,
                         bool lse_base_e) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_rows.dimensions();
  const auto index_dims = indices.dimensions();
  if (q_dims.size() != 3 || q_dims[2] != kQkDim) return ArgumentError("q must be [T, H, 576]");
  const int64_t num_tokens = q_dims[0], num_heads = q_dims[1];
  if (layout != static_cast<int64_t>(KvLayout::kE4m3) &&
      layout != static_cast<int64_t>(KvLayout::kDsMla)) {
    return ArgumentError("layout must be 0 (e4m3) or 1 (fp8_ds_mla)");
  }
  const bool ds_mla = layout == static_cast<int64_t>(KvLayout::kDsMla);
  const int64_t row_bytes = ds_mla ? kRowBytes<KvLayout::kDsMla> : kRowBytes<KvLayout::kE4m3>;
  const ffi::DataType kv_type = ds_mla ? ffi::DataType::U8 : ffi::DataType::F8E4M3FN;
  if (kv_dims.size() != 2 || kv_dims[1] != row_bytes || kv_rows.element_type() != kv_type) {
    return ArgumentError(ds_mla ? "kv must be uint8 [N, 656]" : "kv must be float8_e4m3fn [N, 576]");
  }
  if (index_dims.size() != 2 || index_dims[0] != num_tokens) {
    return ArgumentError("indices must be [T, K]");
  }
  if (valid_counts.dimensions().size() != 1 || valid_counts.dimensions()[0] != num_tokens) {
    return ArgumentError("valid_counts must be [T]");
  }
  if (heads_per_cta != 16 && heads_per_cta != 64) {
    return ArgumentError("heads_per_cta must be 16 or 64");
  }
  const int64_t num_keys = index_dims[1];
  if (num_splits < 1 || keys_per_split < 1 || keys_per_split > kMaxKeysPerSplit ||
      keys_per_split % kBlockN != 0 ||
      num_splits * keys_per_split < num_keys || num_splits > 65535) {
    return ArgumentError("the split plan does not cover K (re-plan for this shape)");
  }
  if (out->element_count() != static_cast<size_t>(num_tokens * num_heads * kVDim) ||
      lse->element_count() != static_cast<size_t>(num_tokens * num_heads)) {
    return ArgumentError("out must be [T, H, 512] and lse [T, H]");
  }
  if (num_splits > 1 &&
      (partial_out->element_count() !=
           static_cast<size_t>(num_splits * num_tokens * num_heads * kVDim) ||
       partial_lse->element_count() != static_cast<size_t>(num_splits * num_tokens * num_heads))) {
    return ArgumentError("partials must be [num_splits, T, H, 512] and [num_splits, T, H]");
  }
  if (num_tokens == 0 || num_heads == 0) return ffi::Error::Success();
  if (num_tokens > 65535) return ArgumentError("T must be at most 65535");

  DecodeParams params;
  params.q = reinterpret_cast<const __nv_bfloat16*>(q.typed_data());
  params.kv = static_cast<const uint8_t*>(kv_rows.untyped_data());
  params.indices = indices.typed_data();
  params.valid_counts = valid_counts.typed_data();
  params.out = reinterpret_cast<__nv_bfloat16*>(out->typed_data());
  params.lse = lse->typed_data();
  params.partial_out = partial_out->typed_data();
  params.partial_lse = partial_lse->typed_data();
  params.num_slots = kv_dims[0];
  params.num_tokens = static_cast<int>(num_tokens);
  params.num_heads = static_cast<int>(num_heads);
  params.num_keys = static_cast<int>(num_keys);
  params.num_splits = static_cast<int>(num_splits);
  params.keys_per_split = static_cast<int>(keys_per_split);
  params.score_scale_log2 = score_scale_log2;
  params.out_scale = out_scale;
  params.lse_base_e = lse_base_e;

  cudaError_t status = ds_mla ? LaunchForHeads<KvLayout::kDsMla>(heads_per_cta, params, stream)
                              : LaunchForHeads<KvLayout::kE4m3>(heads_per_cta, params, stream);
  if (status == cudaSuccess && num_splits > 1) {
    MergeSplitsKernel<<<static_cast<unsigned>(num_tokens * num_heads), kVDim / 4, 0, stream>>>(
        params);
    status = cudaGetLastError();
  }
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("sm90 fp8 decode launch: ") +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sparse_mla::fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90Fp8Decode, jax_sparse_mla::fp8::Sm90Fp8Decode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()               // kv_rows
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // indices
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // valid_counts
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // lse
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // partial_out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // partial_lse
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("heads_per_cta")
                                  .Attr<int64_t>("num_splits")
                                  .Attr<int64_t>("keys_per_split")
                                  .Attr<float>("score_scale_log2")
                                  .Attr<float>("out_scale")
                                  .Attr<bool>("lse_base_e"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
