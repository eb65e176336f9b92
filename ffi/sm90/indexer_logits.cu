// XLA FFI handlers of the lightning indexer's fp8 MQA logits on SM90 (indexer_logits.cuh): one
// kernel launch each, no host synchronisation, no allocation.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/driver_entry_point.h"
#include "common/host_cache.h"
#include "common/launch.h"
#include "sm90/indexer_logits.cuh"
#include "sm90/indexer_logits.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::indexer {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = 2147483647;
// The kernels index keys with int: (width + 63) / 64 tiles, t1 * 64 and `s += kThreads` in the -inf
// fills must not overflow, so the key count keeps 1024 below 2^31.
constexpr int64_t kMaxKeys = kMaxGridX - 1023;

ffi::Error ArgumentError(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("sparse_mla sm90 ") + op + ": " + what);
}

// The ragged kernel's TMA view of the keys [N, 128] e4m3 (its keys_map parameter). A tensor map
// holds the buffer's address and nothing else that varies, so it is a pure function of
// (address, N): each thread encodes a pair the first time it sees it and reuses the map for the
// next calls with the same buffer (the last 16 pairs: a model's layers each have their keys
// buffer, whose address XLA's buffer assignment keeps from one execution to the next). A command
// buffer records the map with the launch. The driver's encoder is resolved at first use
// (common/driver_entry_point.h).
ffi::Error EncodeKeysMap(const char* op, CUtensorMap* map, const void* keys, int64_t num_keys) {
  static const auto encode =
      ResolveDriverFunction<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  if (encode == nullptr) {
    return ffi::Error::Internal(std::string("sparse_mla sm90 ") + op +
                                ": the driver has no cuTensorMapEncodeTiled");
  }
  using Key = std::pair<const void*, int64_t>;
  thread_local RecentValues<Key, CUtensorMap, 16> recent;
  const CUresult status = recent.Get(
      Key{keys, num_keys}, CUDA_SUCCESS,
      [](const Key& key, CUtensorMap* encoded) {
        const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kHeadDim),
                                    static_cast<cuuint64_t>(key.second)};
        const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(kHeadDim)};  // bytes
        const cuuint32_t box[2] = {static_cast<cuuint32_t>(kHeadDim),
                                   static_cast<cuuint32_t>(kTileKeys)};
        const cuuint32_t element_strides[2] = {1, 1};
        return encode(encoded, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(key.first),
                      dims, row_stride, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      },
      map);
  if (status != CUDA_SUCCESS) {
    return ffi::Error::Internal(std::string("sparse_mla sm90 ") + op +
                                ": cuTensorMapEncodeTiled failed with CUresult " +
                                std::to_string(static_cast<int>(status)));
  }
  return ffi::Error::Success();
}

template <int kHeads, int kNextN>
cudaError_t LaunchPaged(const PagedParams& params, int64_t num_chunks, int64_t batch,
                        cudaStream_t stream) {
  using L = Layout<kHeads, kNextN>;
  constexpr auto kKernel = PagedMqaLogitsKernel<L>;
  constexpr int kBytes = kKernelSmemBytes<L>;
  // The CTAs per SM the kernel is compiled for must fit an SM's 227 KB (1 KB of each CTA's shared
  // memory is reserved by the system).
  static_assert(kMinCtasPerSm<L> * (kBytes + 1024) <= 227 * 1024);
  if (cudaError_t status = RaiseSharedMemoryLimit<kKernel, kBytes>(); status != cudaSuccess) {
    return status;
  }
  kKernel<<<dim3(static_cast<unsigned>(num_chunks), static_cast<unsigned>(batch)), L::kThreads,
            kBytes, stream>>>(params);
  return cudaGetLastError();
}

template <int kHeads, int kRows, int kGroupCols>
cudaError_t LaunchRagged(const RaggedParams& params, const CUtensorMap& keys_map,
                         int64_t num_row_blocks, int64_t num_chunks, cudaStream_t stream) {
  using L = Layout<kHeads, kRows, kGroupCols>;
  constexpr auto kKernel = RaggedMqaLogitsKernel<L>;
  constexpr int kBytes = kRaggedSmemBytes<L>;
  static_assert(kMinCtasPerSm<L> * (kBytes + 1024) <= 227 * 1024);  // as in LaunchPaged
  if (cudaError_t status = RaiseSharedMemoryLimit<kKernel, kBytes>(); status != cudaSuccess) {
    return status;
  }
  kKernel<<<dim3(static_cast<unsigned>(num_row_blocks), static_cast<unsigned>(num_chunks)),
            L::kThreads, kBytes, stream>>>(params, keys_map);
  return cudaGetLastError();
}

ffi::Error LaunchError(const char* op, cudaError_t status) {
  return ffi::Error::Internal(std::string("sparse_mla sm90 ") + op + " launch: " +
                              cudaGetErrorString(status));
}

ffi::Error PagedMqaLogits(cudaStream_t stream,
                          ffi::AnyBuffer q,                     // [B, next_n, H, 128] e4m3
                          ffi::Buffer<ffi::U8> index_cache,     // [num_blocks, 64, 132]
                          ffi::Buffer<ffi::F32> weights,        // [B * next_n, H]
                          ffi::Buffer<ffi::S32> context_lens,   // [B]
                          ffi::Buffer<ffi::S32> block_table,    // [B, W]
                          ffi::ResultBuffer<ffi::F32> out,      // [B * next_n, max_context_len]
                          int64_t tiles_per_cta) {
  constexpr const char* kOp = "fp8_paged_mqa_logits";
  const auto q_dims = q.dimensions();
  const auto cache_dims = index_cache.dimensions();
  const auto table_dims = block_table.dimensions();
  const auto out_dims = out->dimensions();
  if (q_dims.size() != 4 || q_dims[3] != kHeadDim || q.element_type() != ffi::DataType::F8E4M3FN) {
    return ArgumentError(kOp, "q must be float8_e4m3fn [B, next_n, H, 128]");
  }
  const int64_t batch = q_dims[0], next_n = q_dims[1], num_heads = q_dims[2];
  if (!((num_heads == 64 || num_heads == 32) && (next_n == 1 || next_n == 2))) {
    return ArgumentError(kOp, "needs H = 32 or 64 and next_n = 1 or 2");
  }
  if (cache_dims.size() != 3 || cache_dims[1] != kTileKeys || cache_dims[2] != kHeadDim + 4) {
    return ArgumentError(kOp, "index_cache must be uint8 [num_blocks, 64, 132]");
  }
  if (weights.dimensions().size() != 2 || weights.dimensions()[0] != batch * next_n ||
      weights.dimensions()[1] != num_heads) {
    return ArgumentError(kOp, "weights must be [B * next_n, H]");
  }
  if (context_lens.dimensions().size() != 1 || context_lens.dimensions()[0] != batch) {
    return ArgumentError(kOp, "context_lens must be [B]");
  }
  if (table_dims.size() != 2 || table_dims[0] != batch) {
    return ArgumentError(kOp, "block_table must be [B, W]");
  }
  if (out_dims.size() != 2 || out_dims[0] != batch * next_n) {
    return ArgumentError(kOp, "out must be [B * next_n, max_context_len]");
  }
  const int64_t width = out_dims[1], num_blocks = cache_dims[0];
  if (width > table_dims[1] * kTileKeys || width > kMaxKeys) {
    return ArgumentError(kOp, "max_context_len must be at most block_table's width x 64 and "
                              "2^31 - 1024");
  }
  if (tiles_per_cta < 1 || tiles_per_cta > (int64_t{1} << 20)) {
    return ArgumentError(kOp, "tiles_per_cta must be in [1, 2^20]");
  }
  if (batch > kMaxGridY) return ArgumentError(kOp, "B must be at most 65535");
  if (batch == 0 || width == 0) return ffi::Error::Success();
  // An empty cache has nothing to read: the binding fills -inf without calling the kernel.
  if (num_blocks == 0) return ArgumentError(kOp, "index_cache has no block");

  PagedParams params;
  params.q = static_cast<const uint8_t*>(q.untyped_data());
  params.cache = index_cache.typed_data();
  params.weights = weights.typed_data();
  params.context_lens = context_lens.typed_data();
  params.block_table = block_table.typed_data();
  params.out = out->typed_data();
  params.num_blocks = num_blocks;
  params.table_width = static_cast<int>(table_dims[1]);
  params.width = static_cast<int>(width);
  params.tiles_per_cta = static_cast<int>(tiles_per_cta);
  const int64_t num_tiles = (width + kTileKeys - 1) / kTileKeys;
  const int64_t num_chunks = (num_tiles + tiles_per_cta - 1) / tiles_per_cta;

  cudaError_t status;
  if (num_heads == 64) {
    status = next_n == 1 ? LaunchPaged<64, 1>(params, num_chunks, batch, stream)
                         : LaunchPaged<64, 2>(params, num_chunks, batch, stream);
  } else {
    status = next_n == 1 ? LaunchPaged<32, 1>(params, num_chunks, batch, stream)
                         : LaunchPaged<32, 2>(params, num_chunks, batch, stream);
  }
  if (status != cudaSuccess) return LaunchError(kOp, status);
  return ffi::Error::Success();
}

ffi::Error MqaLogits(cudaStream_t stream,
                     ffi::AnyBuffer q,                    // [M, H, 128] e4m3
                     ffi::AnyBuffer keys,                 // [N, 128] e4m3
                     ffi::Buffer<ffi::F32> key_scale,     // [N]
                     ffi::Buffer<ffi::F32> weights,       // [M, H]
                     ffi::Buffer<ffi::S32> row_starts,    // [M]
                     ffi::Buffer<ffi::S32> row_ends,      // [M]
                     ffi::ResultBuffer<ffi::F32> out,     // [M, N]
                     int64_t tiles_per_cta) {
  constexpr const char* kOp = "fp8_mqa_logits";
  const auto q_dims = q.dimensions();
  const auto key_dims = keys.dimensions();
  if (q_dims.size() != 3 || q_dims[2] != kHeadDim || q.element_type() != ffi::DataType::F8E4M3FN) {
    return ArgumentError(kOp, "q must be float8_e4m3fn [M, H, 128]");
  }
  const int64_t num_rows = q_dims[0], num_heads = q_dims[1];
  if (num_heads != 64 && num_heads != 32) return ArgumentError(kOp, "needs H = 32 or 64");
  if (key_dims.size() != 2 || key_dims[1] != kHeadDim ||
      keys.element_type() != ffi::DataType::F8E4M3FN) {
    return ArgumentError(kOp, "k_fp8 must be float8_e4m3fn [N, 128]");
  }
  const int64_t num_keys = key_dims[0];
  if (key_scale.dimensions().size() != 1 || key_scale.dimensions()[0] != num_keys) {
    return ArgumentError(kOp, "k_scale must be [N]");
  }
  if (weights.dimensions().size() != 2 || weights.dimensions()[0] != num_rows ||
      weights.dimensions()[1] != num_heads) {
    return ArgumentError(kOp, "weights must be [M, H]");
  }
  if (row_starts.dimensions().size() != 1 || row_starts.dimensions()[0] != num_rows ||
      row_ends.dimensions().size() != 1 || row_ends.dimensions()[0] != num_rows) {
    return ArgumentError(kOp, "row_starts and row_ends must be [M]");
  }
  if (out->dimensions().size() != 2 || out->dimensions()[0] != num_rows ||
      out->dimensions()[1] != num_keys) {
    return ArgumentError(kOp, "out must be [M, N]");
  }
  if (num_rows > kMaxGridX || num_keys > kMaxKeys) {
    return ArgumentError(kOp, "M must be below 2^31 and N at most 2^31 - 1024");
  }
  if (tiles_per_cta < 1 || tiles_per_cta > (int64_t{1} << 20)) {
    return ArgumentError(kOp, "tiles_per_cta must be in [1, 2^20]");
  }
  if (num_rows == 0 || num_keys == 0) return ffi::Error::Success();
  const int64_t num_tiles = (num_keys + kTileKeys - 1) / kTileKeys;
  const int64_t num_chunks = (num_tiles + tiles_per_cta - 1) / tiles_per_cta;
  if (num_chunks > kMaxGridY) {
    return ArgumentError(kOp, "tiles_per_cta leaves more than 65535 key chunks");
  }

  CUtensorMap keys_map;
  if (ffi::Error error = EncodeKeysMap(kOp, &keys_map, keys.untyped_data(), num_keys);
      error.failure()) {
    return error;
  }
  RaggedParams params;
  params.q = static_cast<const uint8_t*>(q.untyped_data());
  params.key_scale = key_scale.typed_data();
  params.weights = weights.typed_data();
  params.starts = row_starts.typed_data();
  params.ends = row_ends.typed_data();
  params.out = out->typed_data();
  params.num_rows = static_cast<int>(num_rows);
  params.num_keys = static_cast<int>(num_keys);
  params.tiles_per_cta = static_cast<int>(tiles_per_cta);

  // kRaggedColumns query columns per CTA: at 64 heads two groups of two rows (wgmma N = 128, each
  // key fragment loaded once for two rows), at 32 heads four groups of two rows (N = 64).
  constexpr int kRows64 = kRaggedColumns / 64, kRows32 = kRaggedColumns / 32;
  cudaError_t status;
  if (num_heads == 64) {
    status = LaunchRagged<64, kRows64, 128>(params, keys_map, (num_rows + kRows64 - 1) / kRows64,
                                            num_chunks, stream);
  } else {
    status = LaunchRagged<32, kRows32, 64>(params, keys_map, (num_rows + kRows32 - 1) / kRows32,
                                           num_chunks, stream);
  }
  if (status != cudaSuccess) return LaunchError(kOp, status);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_sparse_mla::indexer

#define JAX_SPARSE_MLA_PAGED_LOGITS_BINDING                                         \
  xla::ffi::Ffi::Bind()                                                             \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                \
      .Arg<xla::ffi::AnyBuffer>()                   /* q */                         \
      .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        /* index_cache */               \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()       /* weights */                   \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()       /* context_lens */              \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()       /* block_table */               \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()       /* logits */                    \
      .Attr<int64_t>("tiles_per_cta")

#define JAX_SPARSE_MLA_RAGGED_LOGITS_BINDING                                        \
  xla::ffi::Ffi::Bind()                                                             \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                \
      .Arg<xla::ffi::AnyBuffer>()                   /* q */                         \
      .Arg<xla::ffi::AnyBuffer>()                   /* k_fp8 */                     \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()       /* k_scale */                   \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()       /* weights */                   \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()       /* row_starts */                \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()       /* row_ends */                  \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()       /* logits */                    \
      .Attr<int64_t>("tiles_per_cta")

namespace logits = jax_sparse_mla::indexer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90PagedMqaLogits, logits::PagedMqaLogits,
                              JAX_SPARSE_MLA_PAGED_LOGITS_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90MqaLogits, logits::MqaLogits,
                              JAX_SPARSE_MLA_RAGGED_LOGITS_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
