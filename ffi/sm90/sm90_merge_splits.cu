// The merge of split partials (sm90_merge_splits.h), compiled once for both decode handlers.
#include "sm90/sm90_merge_splits.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_sparse_mla::fp8 {
namespace {

constexpr int kMergeThreads = kVDim / 4;  // 4 columns per thread
constexpr int kMergeWarps = kMergeThreads / 32;
// Splits whose partials a thread loads before it weighs any: the loads of one (token, head) are
// independent, and issuing them together rather than one round trip per split is what the merge's
// time is at small T (16 splits of one token).
constexpr int kMergeUnroll = 8;

// The larger of two lse values, NaN if either is (fmaxf would drop it and the row could read as
// empty).
__device__ __forceinline__ float MaxLse(float a, float b) { return (b > a || isnan(b)) ? b : a; }

// Combines the splits of each (token, head): weights 2^(lse_s - max) over the splits that saw a
// valid slot. One block of kMergeThreads threads per row, 4 columns per thread; the splits' lse
// are read in parallel (strided over the threads, then in chunks of kMergeThreads through shared
// memory).
__global__ void __launch_bounds__(kMergeThreads) MergeSplitsKernel(const DecodeParams p) {
  __shared__ float chunk_lse[kMergeThreads];
  __shared__ float warp_max[kMergeWarps];
  const int64_t row = blockIdx.x;  // token * num_heads + head
  const int64_t rows = int64_t{p.num_tokens} * p.num_heads;
  const int lane = threadIdx.x & 31;
  float max_lse = -INFINITY;
  for (int s = threadIdx.x; s < p.num_splits; s += kMergeThreads) {
    max_lse = MaxLse(max_lse, p.partial_lse[s * rows + row]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    max_lse = MaxLse(max_lse, __shfl_xor_sync(0xFFFFFFFFu, max_lse, offset));
  }
  if (lane == 0) warp_max[threadIdx.x >> 5] = max_lse;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) max_lse = MaxLse(max_lse, warp_max[w]);

  float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
  float weight_sum = 0.0f;
  if (max_lse != -INFINITY) {  // block-uniform
    for (int base = 0; base < p.num_splits; base += kMergeThreads) {
      const int s = base + threadIdx.x;
      chunk_lse[threadIdx.x] = s < p.num_splits ? p.partial_lse[s * rows + row] : -INFINITY;
      __syncthreads();
      const int count = min(kMergeThreads, p.num_splits - base);
      for (int first = 0; first < count; first += kMergeUnroll) {
        float4 parts[kMergeUnroll];
#pragma unroll
        for (int u = 0; u < kMergeUnroll; ++u) {
          const int i = min(first + u, count - 1);  // in bounds; repeats are weighed 0 below
          parts[u] = reinterpret_cast<const float4*>(
              p.partial_out + ((base + i) * rows + row) * kVDim)[threadIdx.x];
        }
#pragma unroll
        for (int u = 0; u < kMergeUnroll; ++u) {
          const float weight =
              first + u < count ? exp2f(chunk_lse[first + u] - max_lse) : 0.0f;
          if (weight != 0.0f) {  // an empty split: its partial is 0, its lse -inf
            total.x += weight * parts[u].x;
            total.y += weight * parts[u].y;
            total.z += weight * parts[u].z;
            total.w += weight * parts[u].w;
            weight_sum += weight;
          }
        }
      }
      __syncthreads();  // the next chunk overwrites chunk_lse
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
  MergeSplitsKernel<<<static_cast<unsigned>(rows), kMergeThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace jax_sparse_mla::fp8
