// XLA FFI handler: sparse MLA decode on SM120/SM121 through FlashInfer's sparse_mla_sm120 DSv3.2
// decode kernel (data/include/flashinfer/attention/sparse_mla_sm120/kernels/dsv32_fp8/decode.cuh)
// and its split-K merge kernel (execution/merge.cuh), launched as FlashInfer's
// launch_decode_dsv3_2_impl does (data/csrc/sparse_mla_sm120/dsv32_decode_dispatch.cu). That
// dispatch file and its binding are written against tvm-ffi, so the ~30 lines of launch code are
// repeated here rather than compiled from the wheel; the kernels are FlashInfer's, unchanged.
//
// Cache format: vLLM's fp8_ds_mla rows (656 bytes: 512 e4m3, 4 fp32 tile scales, 64 bf16 RoPE).
// The kernel is instantiated for ModelType::GLM_NSA, the same 656-byte layout with arbitrary fp32
// tile scales, because our cache writer (like vLLM's) stores amax / 448, not a power of two; the
// DSV3_2 instantiation would read only the scales' exponent bits (FlashInfer's "pow2_fp32").
//
// Invalid slots are -1 (holes anywhere): the kernel gathers a zero row and gives it logit -1e30.
// The per-token active length (topk_length) is left null: every row is scanned to K.
// Split-K scratch comes from XLA as extra results, sized by the host plan (sm120_plan.cc).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>

#include <flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h>
#include <flashinfer/attention/sparse_mla_sm120/execution/merge.cuh>
#include <flashinfer/attention/sparse_mla_sm120/kernels/dsv32_fp8/decode.cuh>
#include <flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh>

#include "common/launch.h"
#include "sm120/sm120_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla {
namespace {

namespace ffi = xla::ffi;
namespace smla = flashinfer::sparse_mla_sm120;

constexpr ::ModelType kModel = ::ModelType::GLM_NSA;
using KV = ::KVCacheTraits<kModel>;
static_assert(KV::BYTES_PER_TOKEN == 656 && KV::D_QK == 576 && KV::D_V == 512);
static_assert(smla::DSV32_CAND_WINDOW == kSm120ChunkKeys && ::HPB == kSm120HeadsPerBlock);

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_sparse_mla sm120 decode: " + what);
}

// dsv32_decode_dispatch.cu launch_decode_dsv3_2_impl, for one head-count instantiation.
template <int NUM_HEADS>
cudaError_t Launch(int num_heads, int top_k, const bf16* q, const uint8_t* kv_cache,
                   const int32_t* indices, bf16* mid_out, float* mid_lse, bf16* out, float* lse,
                   int num_tokens, int num_splits, int chunks_per_block, float sm_scale,
                   size_t stride_kv_block, int stride_kv_row, int page_size, float lse_scale,
                   cudaStream_t stream) {
  const int h_blocks = ((NUM_HEADS == 0 ? num_heads : NUM_HEADS) + ::HPB - 1) / ::HPB;
  const int q_heads = NUM_HEADS == 0 ? num_heads : NUM_HEADS;
  constexpr int kSmemBytes = smla::Dsv32DecodeSmem<kModel>::LAUNCH_BYTES;
  constexpr auto kernel = smla::sparse_mla_decode_dsv3_2_kernel<kModel, NUM_HEADS>;
  // FlashInfer sets the attribute on every call; once per device is enough (common/launch.h).
  if (cudaError_t status = RaiseSharedMemoryLimit<kernel, kSmemBytes>(); status != cudaSuccess) {
    return status;
  }
  kernel<<<dim3(num_tokens, h_blocks, num_splits), smla::DSV32_BLOCK_THREADS, kSmemBytes,
           stream>>>(q, kv_cache, indices, mid_out, mid_lse, /*topk_length=*/nullptr, num_tokens,
                     q_heads, top_k, num_splits, chunks_per_block, sm_scale, stride_kv_block,
                     /*stride_indices_token=*/static_cast<size_t>(top_k), stride_kv_row,
                     flashinfer::uint_fastdiv(static_cast<uint32_t>(page_size)));
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  // Also for one split (the plan's choice at prefill sizes): the merge then weighs the partial by
  // exp2(0) = 1, so it copies the bf16 partial exactly and scales its lse.
  constexpr int kMergeThreads = 64;
  auto merge = smla::sparse_mla_decode_dsv4_merge_kernel<NUM_HEADS, KV::D_V, kMergeThreads,
                                                         KV::D_V / kMergeThreads>;
  merge<<<dim3(num_tokens, q_heads), kMergeThreads, static_cast<size_t>(num_splits) * sizeof(float),
          stream>>>(mid_out, mid_lse, out, lse, /*attn_sink=*/nullptr, num_tokens, num_splits,
                    q_heads, h_blocks * ::HPB, /*stride_out_lse=*/static_cast<size_t>(q_heads),
                    lse_scale);
  return cudaGetLastError();
}

ffi::Error Sm120Decode(cudaStream_t stream,
                       ffi::Buffer<ffi::BF16> q,             // [T, H, 576]
                       ffi::Buffer<ffi::U8> kv_cache,        // [num_blocks, block_size, 656]
                       ffi::Buffer<ffi::S32> indices,        // [T, K], -1 = invalid
                       ffi::ResultBuffer<ffi::BF16> out,     // [T, H, 512]
                       ffi::ResultBuffer<ffi::F32> lse,      // [T, H]
                       ffi::ResultBuffer<ffi::BF16> mid_out, // [T, scratch_heads, splits, 512]
                       ffi::ResultBuffer<ffi::F32> mid_lse,  // [T, scratch_heads, splits]
                       float sm_scale, bool lse_base_e, int64_t num_splits,
                       int64_t chunks_per_block) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_cache.dimensions();
  const auto index_dims = indices.dimensions();
  if (q_dims.size() != 3 || q_dims[2] != KV::D_QK) return Invalid("q must be [T, H, 576]");
  const int64_t num_tokens = q_dims[0], num_heads = q_dims[1];
  if (kv_dims.size() != 3 || kv_dims[2] != KV::BYTES_PER_TOKEN) {
    return Invalid("kv_cache must be uint8 [num_blocks, block_size, 656]");
  }
  const int64_t page_size = kv_dims[1];
  if (index_dims.size() != 2 || index_dims[0] != num_tokens) return Invalid("indices must be [T, K]");
  const int64_t top_k = index_dims[1];
  if (num_tokens == 0) return ffi::Error::Success();
  if (num_heads <= 0 || num_heads > kSm120MaxHeads) return Invalid("num_heads must be in [1, 128]");
  if (top_k <= 0 || page_size <= 0) return Invalid("K and block_size must be positive");
  const int64_t chunks = (top_k + kSm120ChunkKeys - 1) / kSm120ChunkKeys;
  if (num_splits <= 0 || chunks_per_block <= 0 || num_splits * chunks_per_block < chunks) {
    return Invalid("num_splits * chunks_per_block must cover ceil(K / 64) chunks");
  }
  const int64_t scratch_heads = num_heads == 8 ? 8 : (num_heads + 15) / 16 * 16;
  if (mid_out->element_count() < static_cast<size_t>(num_tokens * scratch_heads * num_splits *
                                                     KV::D_V) ||
      mid_lse->element_count() < static_cast<size_t>(num_tokens * scratch_heads * num_splits)) {
    return Invalid("split-K scratch is smaller than the plan needs");
  }
  if (reinterpret_cast<std::uintptr_t>(q.untyped_data()) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(kv_cache.untyped_data()) % 16 != 0) {
    return Invalid("q and kv_cache must be 16-byte aligned");
  }
  // FlashInfer returns LSE in base 2 and scales the final value by lse_scale.
  const float lse_scale = lse_base_e ? static_cast<float>(M_LN2) : 1.0f;
  const size_t stride_kv_block = static_cast<size_t>(page_size) * KV::BYTES_PER_TOKEN;
  cudaError_t status = smla::execution::visit_decode_heads<kModel>(
      static_cast<int>(num_heads), [&](auto heads) {
        return Launch<decltype(heads)::value>(
            static_cast<int>(num_heads), static_cast<int>(top_k),
            reinterpret_cast<const bf16*>(q.untyped_data()), kv_cache.typed_data(),
            indices.typed_data(), reinterpret_cast<bf16*>(mid_out->untyped_data()),
            mid_lse->typed_data(), reinterpret_cast<bf16*>(out->untyped_data()), lse->typed_data(),
            static_cast<int>(num_tokens), static_cast<int>(num_splits),
            static_cast<int>(chunks_per_block), sm_scale, stride_kv_block, KV::BYTES_PER_TOKEN,
            static_cast<int>(page_size), lse_scale, stream);
      });
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("sm120 decode launch: ") + cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm120Decode, jax_sparse_mla::Sm120Decode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // kv_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // indices
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // lse
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // mid_out (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // mid_lse (scratch)
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("lse_base_e")
                                  .Attr<int64_t>("num_splits")
                                  .Attr<int64_t>("chunks_per_block"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
