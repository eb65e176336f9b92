// Host-side schedule of FlashInfer's SM90 (Hopper, "fa3") MLA kernel for sparse decode.
//
// Sparse MLA decode maps onto FlashInfer's paged MLA kernel with page_size = 1: every query token is
// one "request" whose page table is its list of KV slots. FlashInfer's planner (MLAPlan, run on the
// host) splits the work into items, one per (token, query tile, KV chunk), and balances them over
// the SMs. We plan once per static shape, with every token's KV length at its upper bound
// `padded_keys`, and keep the plan as an int32 array that JAX embeds in the executable as a constant.
// Per call, a small kernel clamps each item's KV range to the token's valid count (sm90_prepare.h).
//
// The schedule array holds the arrays the kernel reads, packed back to back in this order (offsets
// in int32 elements, each array starting at a multiple of 4 elements):
//   per work item [num_works]:  q_indptr, kv_indptr, partial_indptr, q_len, kv_len, q_start,
//                               kv_start, kv_end (the planned, unclamped KV range)
//   per cluster [num_clusters + 1]: work_indptr (work items of cluster c: work_indptr[c] .. [c+1])
//   per CTA [num_sms]:          merge_packed_offset_start, merge_packed_offset_end,
//                               merge_partial_packed_offset_start, merge_partial_packed_offset_end,
//                               merge_partial_stride (the split-KV merge stage)
//   per token [num_tokens + 1]: token_work_indptr (CSR over token_work_ids)
//   [num_works]:                token_work_ids (work items of token t, for the per-call clamp)
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_sparse_mla {

// Queries per CTA tile and KV rows per pipeline stage of FlashInfer's SM90 MLA kernel
// (mla_hopper.cuh: CTA_TILE_Q = CTA_TILE_KV = 64). `padded_keys` must be a multiple of kKvTile.
inline constexpr int64_t kCtaTileQ = 64;
inline constexpr int64_t kKvTile = 64;
// MLAPlan reserves this many entries per work-item array (scheduler.cuh: max_total_num_works) and
// writes past them unchecked, so a plan must stay within it.
inline constexpr int64_t kMaxWorkItems = 16384;

// The most tokens one plan (one launch) may hold: `num_heads` heads over `padded_keys` slots on
// `num_sms` SMs. MLAPlan tiles each token's heads in clusters of 1 CTA (at most 64 heads) or 2 CTAs
// (more), gives each cluster tile one work item per KV split, and sets the split length at or above
// the mean KV per cluster, so the splits add at most one item per cluster: items <= tiles + clusters.
// The kernel also counts packed rows (token x padded_keys) in int32. Returns 0 when no token fits.
inline int64_t Sm90PlanTokenLimit(int64_t num_heads, int64_t padded_keys, int64_t num_sms) {
  if (num_heads < 1 || padded_keys < 1 || num_sms < 1) return 0;
  const int64_t cluster_size = num_heads > kCtaTileQ ? 2 : 1;
  const int64_t num_clusters = num_sms / cluster_size;
  const int64_t cluster_tile = cluster_size * kCtaTileQ;
  const int64_t tiles_per_token = (num_heads + cluster_tile - 1) / cluster_tile;
  const int64_t by_work_items = (kMaxWorkItems - num_clusters) / tiles_per_token;
  const int64_t by_rows = ((int64_t{1} << 31) - 1) / padded_keys;
  return std::max<int64_t>(0, std::min(by_work_items, by_rows));
}

struct ScheduleLayout {
  int64_t q_indptr, kv_indptr, partial_indptr, q_len, kv_len, q_start, kv_start, kv_end;
  int64_t work_indptr;
  int64_t merge_packed_offset_start, merge_packed_offset_end;
  int64_t merge_partial_packed_offset_start, merge_partial_packed_offset_end, merge_partial_stride;
  int64_t token_work_indptr, token_work_ids;
  int64_t size;  // total int32 elements
};

inline ScheduleLayout MakeScheduleLayout(int64_t num_tokens, int64_t num_works,
                                         int64_t num_clusters, int64_t num_sms) {
  int64_t next = 0;
  auto take = [&next](int64_t count) {
    const int64_t at = next;
    next += (count + 3) / 4 * 4;
    return at;
  };
  ScheduleLayout layout;
  layout.q_indptr = take(num_works);
  layout.kv_indptr = take(num_works);
  layout.partial_indptr = take(num_works);
  layout.q_len = take(num_works);
  layout.kv_len = take(num_works);
  layout.q_start = take(num_works);
  layout.kv_start = take(num_works);
  layout.kv_end = take(num_works);
  layout.work_indptr = take(num_clusters + 1);
  layout.merge_packed_offset_start = take(num_sms);
  layout.merge_packed_offset_end = take(num_sms);
  layout.merge_partial_packed_offset_start = take(num_sms);
  layout.merge_partial_packed_offset_end = take(num_sms);
  layout.merge_partial_stride = take(num_sms);
  layout.token_work_indptr = take(num_tokens + 1);
  layout.token_work_ids = take(num_works);
  layout.size = next;
  return layout;
}

struct Sm90Schedule {
  std::vector<int32_t> data;  // MakeScheduleLayout(num_tokens, num_works, num_clusters, num_sms)
  int64_t num_works = 0;
  int64_t cluster_size = 0;  // CTAs per cluster: the kernel's grid is (cluster_size, num_clusters)
  int64_t num_clusters = 0;
  int64_t num_sms = 0;
  // Byte offsets of the split-KV partial outputs (bf16 [rows, 512]) and partial LSEs (f32 [rows])
  // inside the float workspace, and the workspace's size in bytes.
  int64_t partial_o_offset = 0;
  int64_t partial_lse_offset = 0;
  int64_t float_workspace_bytes = 0;
};

// Plans decode of `num_tokens` tokens x `num_heads` heads, each over at most `padded_keys` KV
// rows, for the GPU `device_ordinal` (its SM count sets the grid). Returns "" on success, else
// the reason it cannot be planned. Runs on the host only; touches no device memory.
std::string PlanSm90Schedule(int64_t num_tokens, int64_t num_heads, int64_t padded_keys,
                             int device_ordinal, Sm90Schedule* schedule);

}  // namespace jax_sparse_mla
