// Per-call index packing and work-item clamping for the SM90 MLA kernel (see sm90_prepare.h).
#include <cub/block/block_scan.cuh>

#include "sm90/sm90_prepare.h"

namespace jax_sparse_mla {
namespace {

constexpr int kThreads = 256;
// Keys per thread per round: a 2048-wide row is one round, so every load of a row is issued
// before the first one is waited on (the kernel is latency-bound, not bandwidth-bound).
constexpr int kItems = 8;
using BlockScan = cub::BlockScan<int, kThreads>;

__global__ void __launch_bounds__(kThreads) PackAndClamp(const PrepareArgs args) {
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int64_t token = blockIdx.x;
  const int32_t* row = args.indices + token * args.num_keys;
  int32_t* packed = args.packed + token * args.padded_keys;
  const int64_t row_keys =
      min(max(static_cast<int64_t>(args.valid_counts[token]), int64_t{0}), args.num_keys);

  // Stable compaction: thread i owns keys [i * kItems, (i + 1) * kItems) of each round, so a
  // key's destination is the valid keys of earlier rounds + an exclusive scan over the threads.
  int count = 0;  // valid keys in the rounds done so far; the same in every thread
  for (int64_t base = 0; base < row_keys; base += int64_t{kThreads} * kItems) {
    const int64_t first = base + int64_t{threadIdx.x} * kItems;
    int32_t slots[kItems];
    int valid = 0;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      slots[i] = first + i < row_keys ? row[first + i] : -1;
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) valid += slots[i] >= 0 && slots[i] < args.num_rows;
    int offset, round_total;
    BlockScan(scan_storage).ExclusiveSum(valid, offset, round_total);
    int32_t* destination = packed + count + offset;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (slots[i] >= 0 && slots[i] < args.num_rows) *destination++ = slots[i];
    }
    count += round_total;
    __syncthreads();  // scan_storage is reused by the next round; packed[0] is read below
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
