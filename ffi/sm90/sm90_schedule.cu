// Runs FlashInfer's host-side MLA planner once per static shape (see sm90_schedule.h).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <flashinfer/attention/scheduler.cuh>

#include "sm90/sm90_schedule.h"

namespace jax_sparse_mla {
namespace {

// MLAPlan writes its arrays into a host "page-locked" staging buffer at offsets it chooses; it only
// ever dereferences that buffer, so ordinary host memory serves. 10 work-item arrays of
// kMaxWorkItems entries plus 5 per-SM arrays, with room to spare for alignment.
constexpr size_t kStagingBytes = 2u << 20;
constexpr size_t kStagingAlign = 256;
// The float workspace is only laid out (offsets), never touched, so any large bound does.
constexpr size_t kFloatSpaceBound = size_t{1} << 34;

// Restores the calling thread's current CUDA device on scope exit (MLAPlan reads the SM count of
// the current device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    ok_ = cudaGetDevice(&previous_) == cudaSuccess && cudaSetDevice(device) == cudaSuccess;
  }
  ~ScopedDevice() {
    if (ok_) cudaSetDevice(previous_);
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = 0;
  bool ok_ = false;
};

}  // namespace

std::string PlanSm90Schedule(int64_t num_tokens, int64_t num_heads, int64_t padded_keys,
                             int device_ordinal, Sm90Schedule* schedule) {
  // Messages are built with std::to_string, not ostringstream: numeric stream insertion crashed
  // (SIGSEGV in num_put) in a build whose C++ runtime was linked statically into the module.
  if (num_tokens < 1 || num_heads < 1 || padded_keys < kKvTile || padded_keys % kKvTile != 0) {
    return "sm90 schedule: need num_tokens >= 1, num_heads >= 1 and padded_keys a positive "
           "multiple of " + std::to_string(kKvTile) + "; got " + std::to_string(num_tokens) +
           ", " + std::to_string(num_heads) + ", " + std::to_string(padded_keys);
  }
  ScopedDevice device(device_ordinal);
  int num_sms = 0;
  if (!device.ok() ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device_ordinal) !=
          cudaSuccess) {
    return "sm90 schedule: cannot select CUDA device " + std::to_string(device_ordinal);
  }
  const int64_t token_limit = Sm90PlanTokenLimit(num_heads, padded_keys, num_sms);
  if (num_tokens > token_limit) {
    return "sm90 schedule: " + std::to_string(num_tokens) + " tokens x " +
           std::to_string(num_heads) + " heads over " + std::to_string(padded_keys) +
           " slots exceed one plan (at most " + std::to_string(token_limit) +
           " tokens on this GPU: FlashInfer's " + std::to_string(kMaxWorkItems) +
           " work items, int32 rows); split the tokens";
  }

  std::vector<int32_t> qo_indptr(num_tokens + 1), kv_indptr(num_tokens + 1);
  std::vector<int32_t> kv_len(num_tokens, static_cast<int32_t>(padded_keys));
  for (int64_t t = 0; t <= num_tokens; ++t) {
    qo_indptr[t] = static_cast<int32_t>(t);
    kv_indptr[t] = static_cast<int32_t>(t * padded_keys);
  }
  std::vector<uint8_t> staging(kStagingBytes + kStagingAlign);
  void* base = staging.data() + (kStagingAlign - reinterpret_cast<uintptr_t>(staging.data()) %
                                                     kStagingAlign);
  flashinfer::MLAPlanInfo info;
  size_t staged_bytes = 0;
  try {
    const cudaError_t status = flashinfer::MLAPlan<int32_t>(
        /*float_buffer=*/base, kFloatSpaceBound, /*int_buffer=*/base,
        /*page_locked_int_buffer=*/base, kStagingBytes, info, staged_bytes, qo_indptr.data(),
        kv_indptr.data(), kv_len.data(), static_cast<uint32_t>(num_tokens),
        static_cast<uint32_t>(num_heads), /*head_dim_o=*/512, /*causal=*/false,
        /*stream=*/nullptr);
    if (status != cudaSuccess) {
      return std::string("sm90 schedule: MLAPlan failed: ") + cudaGetErrorString(status);
    }
  } catch (const std::exception& error) {
    return std::string("sm90 schedule: MLAPlan failed: ") + error.what();
  }

  auto planned = [base](int64_t byte_offset) {
    return reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(base) + byte_offset);
  };
  const int64_t num_clusters = info.num_blks_y;
  const int64_t num_works = planned(info.work_indptr_offset)[num_clusters];
  if (num_works > kMaxWorkItems) {
    return "sm90 schedule: MLAPlan produced more work items than it reserves room for";
  }
  const ScheduleLayout layout = MakeScheduleLayout(num_tokens, num_works, num_clusters, num_sms);
  std::vector<int32_t> data(layout.size, 0);
  auto copy = [&](int64_t byte_offset, int64_t count, int64_t to) {
    const int32_t* from = planned(byte_offset);
    std::copy(from, from + count, data.begin() + to);
  };
  copy(info.q_indptr_offset, num_works, layout.q_indptr);
  copy(info.kv_indptr_offset, num_works, layout.kv_indptr);
  copy(info.partial_indptr_offset, num_works, layout.partial_indptr);
  copy(info.q_len_offset, num_works, layout.q_len);
  copy(info.kv_len_offset, num_works, layout.kv_len);
  copy(info.q_start_offset, num_works, layout.q_start);
  copy(info.kv_start_offset, num_works, layout.kv_start);
  copy(info.kv_end_offset, num_works, layout.kv_end);
  copy(info.work_indptr_offset, num_clusters + 1, layout.work_indptr);
  copy(info.merge_packed_offset_start_offset, num_sms, layout.merge_packed_offset_start);
  copy(info.merge_packed_offset_end_offset, num_sms, layout.merge_packed_offset_end);
  copy(info.merge_partial_packed_offset_start_offset, num_sms,
       layout.merge_partial_packed_offset_start);
  copy(info.merge_partial_packed_offset_end_offset, num_sms,
       layout.merge_partial_packed_offset_end);
  copy(info.merge_partial_stride_offset, num_sms, layout.merge_partial_stride);

  // Invert work item -> token (qo_indptr is the identity, so q_indptr[w] is the token) into a CSR
  // list, so that the per-call clamp kernel visits each token's items from that token's block.
  int32_t* token_indptr = data.data() + layout.token_work_indptr;
  int32_t* token_ids = data.data() + layout.token_work_ids;
  const int32_t* work_token = data.data() + layout.q_indptr;
  for (int64_t w = 0; w < num_works; ++w) ++token_indptr[work_token[w] + 1];
  for (int64_t t = 0; t < num_tokens; ++t) token_indptr[t + 1] += token_indptr[t];
  std::vector<int32_t> fill(token_indptr, token_indptr + num_tokens);
  for (int64_t w = 0; w < num_works; ++w) token_ids[fill[work_token[w]]++] = static_cast<int32_t>(w);

  const int64_t cluster_tile_q = info.num_blks_x * kCtaTileQ;
  schedule->data = std::move(data);
  schedule->num_works = num_works;
  schedule->cluster_size = info.num_blks_x;
  schedule->num_clusters = num_clusters;
  schedule->num_sms = num_sms;
  schedule->partial_o_offset = info.partial_o_offset;
  schedule->partial_lse_offset = info.partial_lse_offset;
  schedule->float_workspace_bytes =
      info.partial_lse_offset + 2 * num_clusters * cluster_tile_q * int64_t{sizeof(float)};
  return "";
}

}  // namespace jax_sparse_mla
