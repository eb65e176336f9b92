// The merge of split partials (sm90_merge_splits.h), compiled once for both decode handlers.
#include "sm90/sm90_merge_splits.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_sparse_mla::fp8 {
namespace {

// Combines the splits of each (token, head): weights 2^(lse_s - max) over the splits that saw a
// valid slot. One block of 128 threads per row, 4 columns per thread.
__global__ void __launch_bounds__(128) MergeSplitsKernel(const DecodeParams p) {
  const int64_t row = blockIdx.x;  // token * num_heads + head
  const int64_t rows = int64_t{p.num_tokens} * p.num_heads;
  // The largest lse, NaN if any is (fmaxf would drop it and the row could read as empty).
  float max_lse = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse = p.partial_lse[s * rows + row];
    max_lse = (lse > max_lse || isnan(lse)) ? lse : max_lse;
  }
  float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
  float weight_sum = 0.0f;
  if (max_lse != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float weight = exp2f(p.partial_lse[s * rows + row] - max_lse);
      if (weight == 0.0f) continue;  // an empty split: its partial is 0, its lse -inf
      const float4 part =
          reinterpret_cast<const float4*>(p.partial_out + (s * rows + row) * kVDim)[threadIdx.x];
      total.x += weight * part.x;
      total.y += weight * part.y;
      total.z += weight * part.z;
      total.w += weight * part.w;
      weight_sum += weight;
    }
  }
  const float scale = weight_sum != 0.0f ? p.out_scale / weight_sum : 0.0f;
  uint2 packed;
  packed.x = PackBf16(total.x * scale, total.y * scale);
  packed.y = PackBf16(total.z * scale, total.w * scale);
  reinterpret_cast<uint2*>(p.out + row * kVDim)[threadIdx.x] = packed;
  if (threadIdx.x == 0) {
    const float lse_log2 = weight_sum != 0.0f ? max_lse + log2f(weight_sum) : -INFINITY;
    p.lse[row] = p.lse_base_e ? lse_log2 * 0.6931471805599453f : lse_log2;
  }
}

}  // namespace

cudaError_t LaunchMergeSplits(const DecodeParams& params, cudaStream_t stream) {
  const int64_t rows = int64_t{params.num_tokens} * params.num_heads;
  MergeSplitsKernel<<<static_cast<unsigned>(rows), kVDim / 4, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace jax_sparse_mla::fp8
