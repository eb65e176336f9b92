// The XLA FFI handler of our own SM90 decode kernels (instantiated by sm90_fp8_decode.cu with its
// kernels' launch): argument checks, the kernel parameters, one launch of the decode kernel and,
// when the plan splits the slot list, one launch of the merge. No host synchronisation, no
// allocation (partials are XLA scratch).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/launch.h"
#include "sm90/sm90_fp8_kernel.cuh"
#include "sm90/sm90_merge_splits.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::fp8 {

namespace ffi = xla::ffi;

// One CTA of kThreadsPerCta threads per (group of kHeadsPerCta heads, split, token), in clusters
// of kClusterSize CTAs along the head groups. Head groups vary fastest: the CTAs of one token's
// splits gather the same rows close in time.
template <auto kKernel, int kHeadsPerCta, int kThreadsPerCta, int kSmemBytes, int kClusterSize = 1>
cudaError_t LaunchDecodeKernel(const DecodeParams& params, cudaStream_t stream) {
  if (cudaError_t status = RaiseSharedMemoryLimit<kKernel, kSmemBytes>();
      status != cudaSuccess) {
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

// Launches the decode kernel of `layout` for `heads_per_cta` (checked: 16 or 64).
using LaunchDecode = cudaError_t (*)(KvLayout layout, int heads_per_cta,
                                     const DecodeParams& params, cudaStream_t stream);

inline ffi::Error DecodeArgumentError(const std::string& what) {
  return ffi::Error::InvalidArgument("sparse_mla sm90 decode: " + what);
}

// The handler of our decode kernels, launched by kLaunch. kv_rows: [N, 576] float8_e4m3fn (kE4m3)
// or [N, 656] uint8 (kDsMla).
template <LaunchDecode kLaunch>
ffi::Error Decode(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_rows,
                  ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> valid_counts,
                  ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> lse,
                  ffi::ResultBuffer<ffi::F32> partial_out, ffi::ResultBuffer<ffi::F32> partial_lse,
                  int64_t layout_attribute, int64_t heads_per_cta, int64_t num_splits,
                  int64_t keys_per_split, float score_scale_log2, float out_scale,
                  bool lse_base_e) {
  if (layout_attribute != static_cast<int64_t>(KvLayout::kE4m3) &&
      layout_attribute != static_cast<int64_t>(KvLayout::kDsMla)) {
    return DecodeArgumentError("layout must be 0 (e4m3) or 1 (fp8_ds_mla)");
  }
  const auto layout = static_cast<KvLayout>(layout_attribute);
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_rows.dimensions();
  const auto index_dims = indices.dimensions();
  if (q_dims.size() != 3 || q_dims[2] != kQkDim) return DecodeArgumentError("q must be [T, H, 576]");
  const int64_t num_tokens = q_dims[0], num_heads = q_dims[1];
  int64_t row_values = kQkDim;
  ffi::DataType kv_type = ffi::DataType::F8E4M3FN;
  const char* kv_shape = "kv must be float8_e4m3fn [N, 576]";
  if (layout == KvLayout::kDsMla) {
    row_values = kRowBytes<KvLayout::kDsMla>;
    kv_type = ffi::DataType::U8;
    kv_shape = "kv must be uint8 [N, 656]";
  }
  if (kv_dims.size() != 2 || kv_dims[1] != row_values || kv_rows.element_type() != kv_type) {
    return DecodeArgumentError(kv_shape);
  }
  if (index_dims.size() != 2 || index_dims[0] != num_tokens) {
    return DecodeArgumentError("indices must be [T, K]");
  }
  if (valid_counts.dimensions().size() != 1 || valid_counts.dimensions()[0] != num_tokens) {
    return DecodeArgumentError("valid_counts must be [T]");
  }
  if (heads_per_cta != 16 && heads_per_cta != 64) {
    return DecodeArgumentError("heads_per_cta must be 16 or 64");
  }
  const int64_t num_keys = index_dims[1];
  if (num_splits < 1 || keys_per_split < 1 || keys_per_split > kMaxKeysPerSplit ||
      keys_per_split % kBlockN != 0 || num_splits * keys_per_split < num_keys ||
      num_splits > 65535) {
    return DecodeArgumentError("the split plan does not cover K (re-plan for this shape)");
  }
  if (out->element_count() != static_cast<size_t>(num_tokens * num_heads * kVDim) ||
      lse->element_count() != static_cast<size_t>(num_tokens * num_heads)) {
    return DecodeArgumentError("out must be [T, H, 512] and lse [T, H]");
  }
  if (num_splits > 1 &&
      (partial_out->element_count() !=
           static_cast<size_t>(num_splits * num_tokens * num_heads * kVDim) ||
       partial_lse->element_count() != static_cast<size_t>(num_splits * num_tokens * num_heads))) {
    return DecodeArgumentError("partials must be [num_splits, T, H, 512] and [num_splits, T, H]");
  }
  if (num_tokens == 0 || num_heads == 0) return ffi::Error::Success();
  if (num_tokens > 65535) return DecodeArgumentError("T must be at most 65535");

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

  cudaError_t status = kLaunch(layout, static_cast<int>(heads_per_cta), params, stream);
  if (status == cudaSuccess && num_splits > 1) status = LaunchMergeSplits(params, stream);
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("sm90 decode launch: ") + cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

// The arguments, results and attributes of Decode, for XLA_FFI_DEFINE_HANDLER_SYMBOL.
inline auto DecodeBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()  // q
      .Arg<ffi::AnyBuffer>()          // kv_rows
      .Arg<ffi::Buffer<ffi::S32>>()   // indices
      .Arg<ffi::Buffer<ffi::S32>>()   // valid_counts
      .Ret<ffi::Buffer<ffi::BF16>>()  // out
      .Ret<ffi::Buffer<ffi::F32>>()   // lse
      .Ret<ffi::Buffer<ffi::F32>>()   // partial_out
      .Ret<ffi::Buffer<ffi::F32>>()   // partial_lse
      .Attr<int64_t>("layout")
      .Attr<int64_t>("heads_per_cta")
      .Attr<int64_t>("num_splits")
      .Attr<int64_t>("keys_per_split")
      .Attr<float>("score_scale_log2")
      .Attr<float>("out_scale")
      .Attr<bool>("lse_base_e");
}

}  // namespace jax_sparse_mla::fp8
