// XLA FFI handlers of the top-k index conversion (convert_req_index_to_global_index,
// filter_and_convert_dcp_index): one launch of a kernel in index_conversion.cuh; no host
// synchronisation, no allocation, no scratch, so XLA may record them in command buffers.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>

#include "common/fast_divmod.h"
#include "common/index_conversion.cuh"
#include "common/index_conversion.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::index_conversion {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

ffi::Error ArgumentError(const std::string& what) {
  return ffi::Error::InvalidArgument("sparse_mla index conversion: " + what);
}

bool IsVector(const ffi::Buffer<ffi::S32>& buffer, int64_t size) {
  return buffer.dimensions().size() == 1 && buffer.dimensions()[0] == size;
}

ffi::Error Convert(cudaStream_t stream, ffi::Buffer<ffi::S32> req_id,
                   ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> tokens,
                   ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> pref_ids,
                   ffi::Buffer<ffi::S32> pref_starts, ffi::Result<ffi::Buffer<ffi::S32>> out,
                   int32_t* counts, int64_t block_size, int64_t dcp_size, int64_t interleave,
                   bool compact, bool has_prefill) {
  const auto tok_dims = tokens.dimensions();
  const auto table_dims = block_table.dimensions();
  if (tok_dims.size() != 2 || table_dims.size() != 2) {
    return ArgumentError("tokens must be [T, K] and block_table [R, W]");
  }
  const int64_t num_tokens = tok_dims[0], top_k = tok_dims[1];
  if (out->dimensions().size() != 2 || out->dimensions()[0] != num_tokens ||
      out->dimensions()[1] != top_k) {
    return ArgumentError("the result must be [T, K] like tokens");
  }
  if (top_k % kVec != 0) return ArgumentError("K must be a multiple of 4");
  if (!IsVector(req_id, num_tokens) || !IsVector(rank, 1)) {
    return ArgumentError("req_id must be [T] and rank [1]");
  }
  if (has_prefill && !IsVector(pref_ids, num_tokens)) {
    return ArgumentError("prefill_workspace_request_ids must be [T]");
  }
  if (pref_starts.dimensions().size() != 1) return ArgumentError("workspace starts must be [P]");
  // Positions, blocks and table indices are int32 in the kernels, as in the pure-JAX version.
  if (num_tokens > kInt32Max || table_dims[0] > kInt32Max || table_dims[1] > kInt32Max ||
      pref_starts.dimensions()[0] > kInt32Max) {
    return ArgumentError("T, R, W and P must each be below 2^31");
  }
  if (block_size < 1 || block_size > kInt32Max || dcp_size < 1 || dcp_size > kInt32Max ||
      interleave < 1 || interleave > kInt32Max || dcp_size * interleave > kInt32Max) {
    return ArgumentError("block_size, dcp_size and interleave must be positive int32 values");
  }
  ConversionParams p;
  p.req_id = req_id.typed_data();
  p.block_table = block_table.typed_data();
  p.tokens = tokens.typed_data();
  p.rank = rank.typed_data();
  p.pref_ids = has_prefill ? pref_ids.typed_data() : nullptr;
  p.pref_starts = has_prefill ? pref_starts.typed_data() : nullptr;
  p.out = out->typed_data();
  p.counts = counts;
  p.top_k = top_k;
  p.num_reqs = static_cast<int32_t>(table_dims[0]);
  p.table_width = static_cast<int32_t>(table_dims[1]);
  p.num_starts = has_prefill ? static_cast<int32_t>(pref_starts.dimensions()[0]) : 0;
  p.block_size = FastDivmod::Make(static_cast<uint32_t>(block_size));
  p.dcp_size = FastDivmod::Make(static_cast<uint32_t>(dcp_size));
  p.interleave = FastDivmod::Make(static_cast<uint32_t>(interleave));
  if (num_tokens == 0) return ffi::Error::Success();
  if (top_k == 0) {
    if (counts != nullptr) cudaMemsetAsync(counts, 0, num_tokens * sizeof(int32_t), stream);
  } else if (compact) {
    ConvertRowKernel<true><<<static_cast<unsigned>(num_tokens), kThreads, 0, stream>>>(p);
  } else if (counts != nullptr) {
    ConvertRowKernel<false><<<static_cast<unsigned>(num_tokens), kThreads, 0, stream>>>(p);
  } else {
    const int64_t tiles_per_row = (top_k + kTileElems - 1) / kTileElems;
    if (tiles_per_row * num_tokens > kInt32Max) {
      // More tiles than the grid's x dimension holds: walk rows with the row kernel instead.
      ConvertRowKernel<false><<<static_cast<unsigned>(num_tokens), kThreads, 0, stream>>>(p);
    } else {
      ConvertTileKernel<<<static_cast<unsigned>(tiles_per_row * num_tokens), kThreads, 0,
                          stream>>>(p, FastDivmod::Make(static_cast<uint32_t>(tiles_per_row)));
    }
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_mla index conversion launch: ") +
                               cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

ffi::Error IndexConversion(cudaStream_t stream, ffi::Buffer<ffi::S32> req_id,
                           ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> tokens,
                           ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> pref_ids,
                           ffi::Buffer<ffi::S32> pref_starts, ffi::ResultBuffer<ffi::S32> out,
                           int64_t block_size, int64_t dcp_size, int64_t interleave, bool compact,
                           bool has_prefill) {
  return Convert(stream, req_id, block_table, tokens, rank, pref_ids, pref_starts, out, nullptr,
                 block_size, dcp_size, interleave, compact, has_prefill);
}

ffi::Error IndexConversionCounts(cudaStream_t stream, ffi::Buffer<ffi::S32> req_id,
                                 ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> tokens,
                                 ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> pref_ids,
                                 ffi::Buffer<ffi::S32> pref_starts, ffi::ResultBuffer<ffi::S32> out,
                                 ffi::ResultBuffer<ffi::S32> counts, int64_t block_size,
                                 int64_t dcp_size, int64_t interleave, bool compact,
                                 bool has_prefill) {
  if (!IsVector(*counts, tokens.dimensions().size() == 2 ? tokens.dimensions()[0] : -1)) {
    return ArgumentError("valid_counts must be [T]");
  }
  return Convert(stream, req_id, block_table, tokens, rank, pref_ids, pref_starts, out,
                 counts->typed_data(), block_size, dcp_size, interleave, compact, has_prefill);
}

}  // namespace
}  // namespace jax_sparse_mla::index_conversion

#define JAX_SPARSE_MLA_CONVERSION_ARGS                                     \
  xla::ffi::Ffi::Bind()                                                    \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                       \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* req_id [T] */           \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* block_table [R, W] */   \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* tokens [T, K] */        \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* rank [1] */             \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* pref_ids [T] or [1] */  \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* pref_starts [P] */      \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   /* slots [T, K] */

#define JAX_SPARSE_MLA_CONVERSION_ATTRS      \
  .Attr<int64_t>("block_size")               \
      .Attr<int64_t>("dcp_size")             \
      .Attr<int64_t>("interleave")           \
      .Attr<bool>("compact")                 \
      .Attr<bool>("has_prefill")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaIndexConversion,
                              jax_sparse_mla::index_conversion::IndexConversion,
                              JAX_SPARSE_MLA_CONVERSION_ARGS JAX_SPARSE_MLA_CONVERSION_ATTRS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaIndexConversionCounts,
                              jax_sparse_mla::index_conversion::IndexConversionCounts,
                              JAX_SPARSE_MLA_CONVERSION_ARGS
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // valid_counts [T]
                                  JAX_SPARSE_MLA_CONVERSION_ATTRS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
