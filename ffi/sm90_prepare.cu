// Per-call index packing and work-item clamping for the SM90 MLA kernel (see sm90_prepare.h).
#include "sm90_prepare.h"

namespace jax_sparse_mla {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) PackAndClamp(const PrepareArgs args) {
  __shared__ int warp_totals[kWarps];
  const int64_t token = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int32_t* row = args.indices + token * args.num_keys;
  int32_t* packed = args.packed + token * args.padded_keys;

  // Stable compaction, kThreads keys at a time: a key's destination is the number of valid keys
  // before it (earlier chunks + earlier warps of this chunk + earlier lanes of this warp).
  int count = 0;  // valid keys in the chunks done so far; the same in every thread
  for (int64_t start = 0; start < args.num_keys; start += kThreads) {
    const int64_t position = start + threadIdx.x;
    const int32_t slot = position < args.num_keys ? row[position] : -1;
    const bool valid = slot >= 0 && slot < args.num_rows;
    const unsigned ballot = __ballot_sync(0xffffffffu, valid);
    if (lane == 0) warp_totals[warp] = __popc(ballot);
    __syncthreads();
    int before = count;
    int chunk_total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_totals[w] : 0;
      chunk_total += warp_totals[w];
    }
    if (valid) packed[before + __popc(ballot & ((1u << lane) - 1u))] = slot;
    count += chunk_total;
    __syncthreads();  // warp_totals is rewritten by the next chunk; packed[0] is read below
  }

  const int32_t filler = count > 0 ? packed[0] : 0;
  for (int64_t i = count + threadIdx.x; i < args.padded_keys; i += kThreads) packed[i] = filler;

  const int32_t first_item = args.token_work_indptr[token];
  const int32_t end_item = args.token_work_indptr[token + 1];
  for (int32_t j = first_item + threadIdx.x; j < end_item; j += kThreads) {
    const int32_t w = args.token_work_ids[j];
    int32_t start = args.planned_kv_start[w];
    int32_t end = min(args.planned_kv_end[w], count);
    if (end <= start) start = end = 0;
    args.kv_start[w] = start;
    args.kv_end[w] = end;
  }
}

}  // namespace

cudaError_t LaunchSm90Prepare(const PrepareArgs& args, cudaStream_t stream) {
  PackAndClamp<<<static_cast<unsigned>(args.num_tokens), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_sparse_mla
