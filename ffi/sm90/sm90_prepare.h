// Per-call preparation for the SM90 MLA kernel: pack each token's valid slots and clamp the
// planned work items to them (the plan in sm90_schedule.h assumes every token has padded_keys).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_sparse_mla {

struct PrepareArgs {
  const int32_t* indices;  // [num_tokens, num_keys] slots; < 0 or >= num_rows means "skip"
  const int32_t* valid_counts;  // [num_tokens]: only the first valid_counts[t] entries (clamped
                                // to [0, num_keys]) of row t may be selected
  int64_t num_tokens;
  int64_t num_keys;
  int64_t num_rows;        // rows in the KV cache
  int32_t* packed;         // [num_tokens, padded_keys] out: valid slots first, in their order
  int64_t padded_keys;
  const int32_t* token_work_indptr;  // [num_tokens + 1] (schedule)
  const int32_t* token_work_ids;     // [num_works] (schedule)
  const int32_t* planned_kv_start;   // [num_works] (schedule)
  const int32_t* planned_kv_end;     // [num_works] (schedule)
  int32_t* kv_start;                 // [num_works] out: this call's KV range of each work item
  int32_t* kv_end;                   // [num_works] out
};

// Launches one block per token on `stream`. After it, packed[t, :n_t] holds token t's valid slots
// (n_t of them) and packed[t, n_t:] repeats the first valid slot, so that every row the MLA kernel
// may load (it reads whole 64-row tiles and masks positions >= kv_end) is a row the caller
// selected, never an unselected one that may hold NaN. A work item whose range lies wholly past
// n_t becomes the empty range [0, 0): the kernel then loads nothing and writes out = 0 and
// lse = -inf for it, which the split-KV merge ignores.
cudaError_t LaunchSm90Prepare(const PrepareArgs& args, cudaStream_t stream);

}  // namespace jax_sparse_mla
