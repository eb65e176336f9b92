#include "sm120/sm120_plan.h"

#include <climits>

namespace jax_sparse_mla {
namespace {

// attention_resolve.cu resolve_wave_cpb (requested_cpb = 0): the chunks-per-CTA that fills whole
// waves best, at most 3 waves.
//
// One deviation from FlashInfer: when the tokens' CTAs alone (one split) take more than 3 waves, no
// candidate fits and FlashInfer keeps cpb = 1, the most splits (32 at K = 2048), whose split-K
// scratch is 32 times the output (64 GiB at T = 16384, H = 128). Splitting K only helps while the
// tokens leave SMs idle, and FlashInfer already takes one split (cpb = chunks) from 1.5 waves of
// tokens up to 3, where only that candidate fits; so this takes one split above 3 waves too.
int ResolveWaveCpb(int64_t tokens, int64_t head_blocks, int chunks, int64_t sm_count) {
  const int64_t per_token_head = tokens * head_blocks;
  if (per_token_head > 3 * sm_count) return chunks;
  int cpb = 1;
  float best_gap = 2.0f;
  for (int candidate = 1; candidate <= chunks; ++candidate) {
    const int eff = (chunks + candidate - 1) / candidate;
    const int64_t active = per_token_head * eff;
    const int64_t ceil_w = (active + sm_count - 1) / sm_count;
    if (ceil_w > 3) continue;
    const float waves = static_cast<float>(active) / static_cast<float>(sm_count);
    const float gap = static_cast<float>(ceil_w) - waves;
    if (gap < best_gap - 1e-6f || (gap < best_gap + 1e-6f && candidate > cpb)) {
      best_gap = gap;
      cpb = candidate;
    }
  }
  return cpb;
}

}  // namespace

std::string PlanSm120Decode(int64_t num_tokens, int64_t num_heads, int64_t top_k,
                            int64_t sm_count, Sm120Plan* plan) {
  if (num_tokens <= 0 || num_tokens > INT_MAX / 8) return "num_tokens must be in [1, INT_MAX / 8]";
  if (num_heads <= 0 || num_heads > kSm120MaxHeads) return "num_heads must be in [1, 128]";
  if (top_k <= 0 || top_k > INT_MAX - 64) return "top_k must be positive";
  if (sm_count <= 0) return "sm_count must be positive";
  const int64_t chunks = (top_k + kSm120ChunkKeys - 1) / kSm120ChunkKeys;
  const int64_t head_blocks = (num_heads + kSm120HeadsPerBlock - 1) / kSm120HeadsPerBlock;
  plan->chunks = chunks;
  plan->chunks_per_block =
      ResolveWaveCpb(num_tokens, head_blocks, static_cast<int>(chunks), sm_count);
  plan->num_splits = (chunks + plan->chunks_per_block - 1) / plan->chunks_per_block;
  plan->scratch_heads = num_heads == 8 ? 8 : (num_heads + 15) / 16 * 16;
  return "";
}

}  // namespace jax_sparse_mla
