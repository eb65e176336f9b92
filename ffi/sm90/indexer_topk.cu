// XLA FFI handlers of the lightning indexer's top-k (top_k_per_row, top_k_per_row_decode), each in
// two forms: one CTA per row (indexer_topk.cuh) and one cluster per row (indexer_topk_cluster.cuh).
// One launch each; no host synchronisation, no allocation, no scratch.
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <limits>
#include <string>

#include "common/host_cache.h"
#include "common/launch.h"
#include "sm90/indexer_topk.cuh"
#include "sm90/indexer_topk.h"
#include "sm90/indexer_topk_cluster.cuh"
#include "sm90/indexer_topk_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla::indexer_topk {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

ffi::Error ArgumentError(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("sparse_mla sm90 ") + op + ": " + what);
}

// Checks the shapes shared by both ops and fills the common parameters; `op` names the op in
// messages.
ffi::Error CheckCommon(const char* op, const ffi::Buffer<ffi::F32>& logits,
                       ffi::Result<ffi::Buffer<ffi::S32>>& out, TopKParams* params,
                       int64_t* num_rows) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ArgumentError(op, "logits must be [R, S]");
  const auto out_dims = out->dimensions();
  if (out_dims.size() != 2 || out_dims[0] != dims[0]) {
    return ArgumentError(op, "the result must be [R, k] for logits [R, S]");
  }
  // Rows index the grid's x dimension; positions, k and the row width are int32 in the kernel.
  if (dims[0] > kInt32Max || dims[1] > kInt32Max || out_dims[1] > kInt32Max) {
    return ArgumentError(op, "R, S and k must each be below 2^31");
  }
  *num_rows = dims[0];
  params->logits = logits.typed_data();
  params->out = out->typed_data();
  params->row_starts = nullptr;
  params->row_ends = nullptr;
  params->context_lens = nullptr;
  params->next_n = 1;
  params->width = static_cast<int32_t>(dims[1]);
  params->k = static_cast<int32_t>(out_dims[1]);
  return ffi::Error::Success();
}

ffi::Error LaunchError(const char* op, cudaError_t status) {
  return ffi::Error::Internal(std::string("sparse_mla sm90 ") + op + " launch: " +
                              cudaGetErrorString(status));
}

template <bool kStream>
cudaError_t LaunchPerRowKernel(const TopKParams& params, int64_t num_rows, cudaStream_t stream) {
  constexpr auto kKernel = TopKPerRowKernel<kStream>;
  constexpr int kBytes = kKernelSmemBytes<kStream>;
  if (cudaError_t status = RaiseSharedMemoryLimit<kKernel, kBytes>(); status != cudaSuccess) {
    return status;
  }
  kKernel<<<static_cast<unsigned>(num_rows), kThreads, kBytes, stream>>>(params);
  return cudaGetLastError();
}

// One CTA per row: the register build (two CTAs per SM) or, with kStream, the streaming build (one
// CTA per SM, the row streamed through shared memory), each at every row count ("auto" picks the
// build per shape: kernels/sm90_indexer_topk.py).
template <bool kStream>
ffi::Error LaunchPerRow(const char* op, const TopKParams& params, int64_t num_rows,
                        cudaStream_t stream) {
  if (num_rows == 0 || params.k == 0) return ffi::Error::Success();
  const cudaError_t status = LaunchPerRowKernel<kStream>(params, num_rows, stream);
  return status == cudaSuccess ? ffi::Error::Success() : LaunchError(op, status);
}

// Fills `config`'s cluster attribute (`attribute`) for clusters of `ctas`.
void SetClusterSize(cudaLaunchConfig_t* config, cudaLaunchAttribute* attribute, int ctas) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = static_cast<unsigned>(ctas);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config->attrs = attribute;
  config->numAttrs = 1;
}

// The clusters of 1 .. kMaxFastClusterSize CTAs of TopKClusterKernel that this device runs at once,
// asked of the occupancy calculator once per device (the kernel's shared-memory limit raised and
// wide clusters allowed first); later calls read the answer without a lock. A size above the
// portable 8 that the device refuses counts 0: the plan never needs one.
cudaError_t MaxActiveClusters(ActiveClusters& active) {
  static PerDevice<std::array<int, kMaxFastClusterSize>> known;
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  std::array<int, kMaxFastClusterSize> counts{};
  const cudaError_t status = known.Get(
      device, cudaSuccess,
      [](int, std::array<int, kMaxFastClusterSize>* found) {
        for (int i = 0; i < kMaxFastClusterSize; ++i) {
          cudaLaunchConfig_t config = {};
          cudaLaunchAttribute attribute;
          config.gridDim = dim3(static_cast<unsigned>(i + 1));  // a multiple of the cluster
          config.blockDim = dim3(kThreads);
          config.dynamicSmemBytes = kMaxClusterDynamicBytes;
          SetClusterSize(&config, &attribute, i + 1);
          const cudaError_t status =
              cudaOccupancyMaxActiveClusters(&(*found)[i], TopKClusterKernel, &config);
          if (status != cudaSuccess && i + 1 > kMaxClusterSize) {
            (void)cudaGetLastError();  // not sticky: clear it, and take no cluster of this size
            (*found)[i] = 0;
          } else if (status != cudaSuccess) {
            return status;
          }
        }
        return cudaSuccess;
      },
      &counts);
  if (status != cudaSuccess) return status;
  for (int i = 0; i < kMaxFastClusterSize; ++i) active[i] = counts[i];
  return cudaSuccess;
}

// One cluster per row.
ffi::Error LaunchCluster(const char* op, const TopKParams& params, int64_t num_rows,
                         cudaStream_t stream) {
  if (num_rows == 0 || params.k == 0) return ffi::Error::Success();
  if (cudaError_t status = RaiseSharedMemoryLimit<TopKClusterKernel, kMaxClusterDynamicBytes>();
      status != cudaSuccess) {
    return LaunchError(op, status);
  }
  // Clusters above 8 CTAs (kMaxFastClusterSize), before the occupancy calculator is asked of them.
  if (cudaError_t status = AllowNonPortableClusters<TopKClusterKernel>(); status != cudaSuccess) {
    return LaunchError(op, status);
  }
  ActiveClusters active;
  if (cudaError_t status = MaxActiveClusters(active); status != cudaSuccess) {
    return LaunchError(op, status);
  }
  ClusterPlan plan;
  if (!PlanCluster(num_rows, params.width, active, &plan)) {
    return ArgumentError(op, "rows of " + std::to_string(params.width) +
                                 " positions do not fit one cluster's shared memory");
  }
  if (num_rows * plan.ctas > kInt32Max) {
    return ArgumentError(op, "R x cluster size must be below 2^31");
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(num_rows * plan.ctas));
  config.blockDim = dim3(kThreads);
  // The leader's candidate lists after the keys (TopKClusterKernel's GatherToLeader), where they fit.
  const int64_t key_bytes = plan.groups_capacity * static_cast<int64_t>(sizeof(uint4));
  config.dynamicSmemBytes = static_cast<size_t>(
      key_bytes + (key_bytes + kCandidateBytes <= kMaxClusterDynamicBytes ? kCandidateBytes : 0));
  config.stream = stream;
  cudaLaunchAttribute cluster;
  SetClusterSize(&config, &cluster, plan.ctas);
  const cudaError_t status = cudaLaunchKernelEx(&config, TopKClusterKernel, params);
  return status == cudaSuccess ? ffi::Error::Success() : LaunchError(op, status);
}

using Launcher = ffi::Error (*)(const char*, const TopKParams&, int64_t, cudaStream_t);

template <Launcher kLaunch>
ffi::Error TopKPerRow(cudaStream_t stream, ffi::Buffer<ffi::F32> logits,  // [R, S]
                      ffi::Buffer<ffi::S32> row_starts,                   // [R]
                      ffi::Buffer<ffi::S32> row_ends,                     // [R]
                      ffi::ResultBuffer<ffi::S32> out) {                  // [R, k]
  constexpr const char* kOp = "top_k_per_row";
  TopKParams params;
  int64_t num_rows = 0;
  if (ffi::Error error = CheckCommon(kOp, logits, out, &params, &num_rows); error.failure()) {
    return error;
  }
  if (row_starts.dimensions().size() != 1 || row_starts.dimensions()[0] != num_rows ||
      row_ends.dimensions().size() != 1 || row_ends.dimensions()[0] != num_rows) {
    return ArgumentError(kOp, "row_starts and row_ends must be [R] for logits [R, S]");
  }
  params.row_starts = row_starts.typed_data();
  params.row_ends = row_ends.typed_data();
  return kLaunch(kOp, params, num_rows, stream);
}

template <Launcher kLaunch>
ffi::Error TopKPerRowDecode(cudaStream_t stream, ffi::Buffer<ffi::F32> logits,  // [B * next_n, S]
                            ffi::Buffer<ffi::S32> context_lens,                 // [B]
                            ffi::ResultBuffer<ffi::S32> out,                    // [B * next_n, k]
                            int64_t next_n) {
  constexpr const char* kOp = "top_k_per_row_decode";
  TopKParams params;
  int64_t num_rows = 0;
  if (ffi::Error error = CheckCommon(kOp, logits, out, &params, &num_rows); error.failure()) {
    return error;
  }
  if (next_n < 1 || next_n > kInt32Max) return ArgumentError(kOp, "next_n must be in [1, 2^31)");
  if (context_lens.dimensions().size() != 1 || num_rows % next_n != 0 ||
      context_lens.dimensions()[0] != num_rows / next_n) {
    return ArgumentError(kOp, "context_lens must be [B] for logits [B * next_n, S]");
  }
  params.context_lens = context_lens.typed_data();
  params.next_n = static_cast<int32_t>(next_n);
  return kLaunch(kOp, params, num_rows, stream);
}

}  // namespace
}  // namespace jax_sparse_mla::indexer_topk

#define JAX_SPARSE_MLA_TOPK_PER_ROW_BINDING                             \
  xla::ffi::Ffi::Bind()                                                 \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                    \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   /* logits */            \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* row_starts */        \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* row_ends */          \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   /* out */

#define JAX_SPARSE_MLA_TOPK_DECODE_BINDING                              \
  xla::ffi::Ffi::Bind()                                                 \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                    \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   /* logits */            \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   /* context_lens */      \
      .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   /* out */               \
      .Attr<int64_t>("next_n")

namespace topk = jax_sparse_mla::indexer_topk;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRow,
                              topk::TopKPerRow<topk::LaunchPerRow<false>>,
                              JAX_SPARSE_MLA_TOPK_PER_ROW_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowDecode,
                              topk::TopKPerRowDecode<topk::LaunchPerRow<false>>,
                              JAX_SPARSE_MLA_TOPK_DECODE_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowCluster,
                              topk::TopKPerRow<topk::LaunchCluster>,
                              JAX_SPARSE_MLA_TOPK_PER_ROW_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowDecodeCluster,
                              topk::TopKPerRowDecode<topk::LaunchCluster>,
                              JAX_SPARSE_MLA_TOPK_DECODE_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowStream,
                              topk::TopKPerRow<topk::LaunchPerRow<true>>,
                              JAX_SPARSE_MLA_TOPK_PER_ROW_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowDecodeStream,
                              topk::TopKPerRowDecode<topk::LaunchPerRow<true>>,
                              JAX_SPARSE_MLA_TOPK_DECODE_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
