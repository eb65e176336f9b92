// XLA FFI handler: sparse MLA decode on SM90 through FlashInfer's Hopper MLA kernel (mla_hopper.cuh).
//
// Included by one .cu per cache dtype (sm90_decode_bf16.cu, sm90_decode_fp8.cu) so that the two
// heavy kernel instantiations compile in parallel.
//
// Per call, on the XLA stream and with no host synchronisation or allocation:
//   1. LaunchSm90Prepare packs the valid slots of each token (in range, before its valid count)
//      and clamps the planned work items;
//   2. one cooperative launch of FlashInfer's kernel computes attention and merges KV splits
//      (LaunchHopperMla: FlashInfer's launch without its per-call attribute calls).
// Everything else (the schedule) was computed once per shape on the host and reaches the handler
// as a constant input buffer; scratch comes from XLA as extra results.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include <flashinfer/attention/mla_hopper.cuh>

#include "common/launch.h"
#include "sm90/sm90_prepare.h"
#include "sm90/sm90_schedule.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla {

namespace ffi = xla::ffi;

inline constexpr int64_t kHeadDim = 576;     // 512 latent (ckv) + 64 RoPE (kpe)
inline constexpr int64_t kLatentDim = 512;
inline constexpr int64_t kRopeDim = 64;

inline ffi::Error ShapeError(const std::string& what) {
  return ffi::Error::InvalidArgument("sparse_mla sm90 decode: " + what);
}

// FlashInfer's BatchMLAPageAttentionHopper<MaskMode::kNone, 512, 64> (mla_hopper.cuh of the pinned
// flashinfer-python, ffi/flashinfer_headers.py), repeated but for its per-call host work: on every
// call it reads the device's shared memory per SM (cudaGetDevice, cudaDeviceGetAttribute; the value
// is unused) and sets the kernel's dynamic shared-memory limit (cudaFuncSetAttribute). Here the
// limit is raised once per device (common/launch.h). Same kernel traits (non-causal, 2 stages,
// 64-query and 64-key tiles), same cooperative launch of (cluster_size, num_clusters) CTAs.
template <typename Params>
cudaError_t LaunchHopperMla(const Params& params, uint32_t cluster_size, uint32_t num_clusters,
                            cudaStream_t stream) {
  using KTraits = flashinfer::mla::hopper::HopperKernelTraits<
      /*CAUSAL_=*/false, /*NUM_STAGES_=*/2, static_cast<uint32_t>(kLatentDim),
      static_cast<uint32_t>(kRopeDim), static_cast<uint32_t>(kCtaTileQ),
      static_cast<uint32_t>(kKvTile), typename Params::DTypeQ, typename Params::DTypeKV,
      typename Params::DTypeO, typename Params::IdType>;
  constexpr auto kKernel =
      flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<KTraits, Params>;
  constexpr int kSmemBytes = static_cast<int>(sizeof(typename KTraits::SharedStorage));
  if (cudaError_t status = RaiseSharedMemoryLimit<kKernel, kSmemBytes>(); status != cudaSuccess) {
    return status;
  }
  void* args[] = {const_cast<Params*>(&params)};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kKernel),
                                     dim3(cluster_size, num_clusters), dim3(KTraits::NUM_THREADS),
                                     args, kSmemBytes, stream);
}

// DTypeKV: nv_bfloat16 or __nv_fp8_e4m3; kKvType: the matching XLA element type, checked at run
// time because the FFI header defines no typed buffer for fp8.
template <typename DTypeKV, ffi::DataType kKvType>
ffi::Error Sm90Decode(cudaStream_t stream,
                      ffi::Buffer<ffi::BF16> q,           // [T, H, 576]
                      ffi::AnyBuffer kv_rows,             // [N, 576] of kKvType
                      ffi::Buffer<ffi::S32> indices,      // [T, K]
                      ffi::Buffer<ffi::S32> valid_counts, // [T]
                      ffi::Buffer<ffi::S32> schedule,     // sm90_schedule.h layout
                      ffi::ResultBuffer<ffi::BF16> out,   // [T, H, 512]
                      ffi::ResultBuffer<ffi::F32> lse,    // [T, H]
                      ffi::ResultBuffer<ffi::S32> packed,          // [T, padded_keys] scratch
                      ffi::ResultBuffer<ffi::S32> work_kv_ranges,  // [2, num_works] scratch
                      ffi::ResultBuffer<ffi::U8> float_workspace,  // [bytes] scratch
                      float sm_scale, float kv_scale, bool lse_base_e, int64_t num_works,
                      int64_t cluster_size, int64_t num_clusters, int64_t num_sms,
                      int64_t partial_o_offset, int64_t partial_lse_offset) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_rows.dimensions();
  const auto index_dims = indices.dimensions();
  const auto packed_dims = packed->dimensions();
  if (q_dims.size() != 3 || q_dims[2] != kHeadDim) return ShapeError("q must be [T, H, 576]");
  const int64_t num_tokens = q_dims[0];
  const int64_t num_heads = q_dims[1];
  if (kv_dims.size() != 2 || kv_dims[1] != kHeadDim) return ShapeError("kv must be [N, 576]");
  if (kv_rows.element_type() != kKvType) return ShapeError("kv dtype does not match the target");
  if (index_dims.size() != 2 || index_dims[0] != num_tokens) {
    return ShapeError("indices must be [T, K]");
  }
  if (valid_counts.dimensions().size() != 1 || valid_counts.dimensions()[0] != num_tokens) {
    return ShapeError("valid_counts must be [T]");
  }
  if (packed_dims.size() != 2 || packed_dims[0] != num_tokens || packed_dims[1] % kKvTile != 0 ||
      packed_dims[1] < index_dims[1]) {
    return ShapeError("packed scratch must be [T, K rounded up to a multiple of 64]");
  }
  const ScheduleLayout layout = MakeScheduleLayout(num_tokens, num_works, num_clusters, num_sms);
  if (static_cast<int64_t>(schedule.element_count()) != layout.size ||
      static_cast<int64_t>(work_kv_ranges->element_count()) != 2 * num_works ||
      cluster_size * num_clusters > num_sms) {
    return ShapeError("the schedule does not match the attributes (re-plan for this shape)");
  }
  if (static_cast<int64_t>(float_workspace->size_bytes()) <
      partial_lse_offset + 2 * num_clusters * cluster_size * kCtaTileQ * int64_t{sizeof(float)}) {
    return ShapeError("float workspace too small for the schedule");
  }
  if (out->element_count() != static_cast<size_t>(num_tokens * num_heads * kLatentDim) ||
      lse->element_count() != static_cast<size_t>(num_tokens * num_heads)) {
    return ShapeError("out must be [T, H, 512] and lse [T, H]");
  }

  int32_t* plan = schedule.typed_data();
  int32_t* kv_start = work_kv_ranges->typed_data();
  int32_t* kv_end = kv_start + num_works;
  const PrepareArgs prepare{indices.typed_data(),
                            valid_counts.typed_data(),
                            num_tokens,
                            index_dims[1],
                            kv_dims[0],
                            packed->typed_data(),
                            packed_dims[1],
                            plan + layout.token_work_indptr,
                            plan + layout.token_work_ids,
                            plan + layout.kv_start,
                            plan + layout.kv_end,
                            kv_start,
                            kv_end};
  if (cudaError_t status = LaunchSm90Prepare(prepare, stream); status != cudaSuccess) {
    return ffi::Error::Internal(std::string("sm90 prepare launch: ") + cudaGetErrorString(status));
  }

  using Params = flashinfer::MLAParams<nv_bfloat16, DTypeKV, nv_bfloat16, int32_t>;
  Params params;
  auto* q_data = reinterpret_cast<nv_bfloat16*>(q.typed_data());
  auto* kv_data = reinterpret_cast<DTypeKV*>(kv_rows.untyped_data());
  auto* workspace = static_cast<uint8_t*>(float_workspace->untyped_data());
  // q and the cache are read as two strided views each: latent [.., :512] and RoPE [.., 512:].
  params.q_nope = q_data;
  params.q_pe = q_data + kLatentDim;
  params.ckv = kv_data;
  params.kpe = kv_data + kLatentDim;
  params.partial_o = reinterpret_cast<nv_bfloat16*>(workspace + partial_o_offset);
  params.partial_lse = reinterpret_cast<float*>(workspace + partial_lse_offset);
  params.final_o = reinterpret_cast<nv_bfloat16*>(out->typed_data());
  params.final_lse = lse->typed_data();
  params.q_indptr = plan + layout.q_indptr;
  params.kv_indptr = plan + layout.kv_indptr;
  params.partial_indptr = plan + layout.partial_indptr;
  params.merge_packed_offset_start = plan + layout.merge_packed_offset_start;
  params.merge_packed_offset_end = plan + layout.merge_packed_offset_end;
  params.merge_partial_packed_offset_start = plan + layout.merge_partial_packed_offset_start;
  params.merge_partial_packed_offset_end = plan + layout.merge_partial_packed_offset_end;
  params.merge_partial_stride = plan + layout.merge_partial_stride;
  params.kv_indices = packed->typed_data();
  params.q_len = plan + layout.q_len;
  // kv_len stays at the planned padded_keys: it bounds the rows a tile may load, and every
  // packed entry below it is a selected row (sm90_prepare.h). Only the KV ranges are per call.
  params.kv_len = plan + layout.kv_len;
  params.q_start = plan + layout.q_start;
  params.kv_start = kv_start;
  params.kv_end = kv_end;
  params.work_indptr = plan + layout.work_indptr;
  params.num_heads = flashinfer::uint_fastdiv(static_cast<uint32_t>(num_heads));
  params.block_size = flashinfer::uint_fastdiv(1);  // page_size = 1: a page is one slot
  params.q_nope_stride_n = static_cast<uint32_t>(num_heads * kHeadDim);
  params.q_nope_stride_h = kHeadDim;
  params.q_pe_stride_n = static_cast<uint32_t>(num_heads * kHeadDim);
  params.q_pe_stride_h = kHeadDim;
  params.ckv_stride_page = kHeadDim;
  params.ckv_stride_n = kHeadDim;
  params.kpe_stride_page = kHeadDim;
  params.kpe_stride_n = kHeadDim;
  params.o_stride_n = static_cast<uint32_t>(num_heads * kLatentDim);
  params.o_stride_h = kLatentDim;
  params.sm_scale = sm_scale;
  // Read only on the fp8 path, which dequantises kv as kv_scale * kv in bf16 before each WGMMA.
  params.ckv_scale = kv_scale;
  params.kpe_scale = kv_scale;
  params.ckv_scale_arr = nullptr;
  params.return_lse_base_on_e = lse_base_e;

  const cudaError_t status = LaunchHopperMla(params, static_cast<uint32_t>(cluster_size),
                                             static_cast<uint32_t>(num_clusters), stream);
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("sm90 MLA launch: ") + cudaGetErrorString(status));
  }
  if (cudaError_t last = cudaGetLastError(); last != cudaSuccess) {
    return ffi::Error::Internal(std::string("sm90 MLA launch: ") + cudaGetErrorString(last));
  }
  return ffi::Error::Success();
}

template <ffi::DataType kKvType>
constexpr auto Sm90DecodeBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()   // q
      .template Arg<ffi::AnyBuffer>()           // kv_rows (XLA's fp8 types have no typed Buffer)
      .template Arg<ffi::Buffer<ffi::S32>>()    // indices
      .template Arg<ffi::Buffer<ffi::S32>>()    // valid_counts
      .template Arg<ffi::Buffer<ffi::S32>>()    // schedule
      .template Ret<ffi::Buffer<ffi::BF16>>()   // out
      .template Ret<ffi::Buffer<ffi::F32>>()    // lse
      .template Ret<ffi::Buffer<ffi::S32>>()    // packed
      .template Ret<ffi::Buffer<ffi::S32>>()    // work_kv_ranges
      .template Ret<ffi::Buffer<ffi::U8>>()     // float_workspace
      .template Attr<float>("sm_scale")
      .template Attr<float>("kv_scale")
      .template Attr<bool>("lse_base_e")
      .template Attr<int64_t>("num_works")
      .template Attr<int64_t>("cluster_size")
      .template Attr<int64_t>("num_clusters")
      .template Attr<int64_t>("num_sms")
      .template Attr<int64_t>("partial_o_offset")
      .template Attr<int64_t>("partial_lse_offset");
}

}  // namespace jax_sparse_mla
