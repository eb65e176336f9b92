// Host-side planning of FlashInfer's sparse_mla_sm120 DSv3.2 decode, shared by the XLA FFI handler
// (sm120_decode.cu) and Python (through the nanobind module, so that scratch sizes are static).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/api.h"

// Sparse MLA decode over packed 656-byte fp8_ds_mla rows (sm120_decode.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm120Decode);

namespace jax_sparse_mla {

inline constexpr int kSm120MaxHeads = 128;     // execution::DecodeMaxHeads
inline constexpr int kSm120ChunkKeys = 64;     // DSV32_CAND_WINDOW: keys per split chunk
inline constexpr int kSm120HeadsPerBlock = 16; // HPB

struct Sm120Plan {
  int64_t chunks;            // ceil(K / 64)
  int64_t chunks_per_block;  // chunks one CTA walks
  int64_t num_splits;        // split-K partials per (token, head), ceil(chunks / chunks_per_block)
  int64_t scratch_heads;     // heads of the split-K scratch (execution::decode_scratch_heads)
};

// FlashInfer's resolve_attention for a variant-0 (decode) DSv3.2 problem without a dual cache
// (csrc/sparse_mla_sm120/attention_resolve.cu: resolve_wave_cpb and the decode branch), except that
// a problem whose tokens alone take more than 3 waves gets one split instead of FlashInfer's most
// (sm120_plan.cc says why). Returns "" and fills *plan, or an error message.
std::string PlanSm120Decode(int64_t num_tokens, int64_t num_heads, int64_t top_k,
                            int64_t sm_count, Sm120Plan* plan);

}  // namespace jax_sparse_mla
