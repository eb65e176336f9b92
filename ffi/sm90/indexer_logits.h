// C symbols of the SM90 lightning-indexer logits handlers (indexer_logits.cu), for the nanobind
// module (which includes no CUDA code).
#pragma once

#include "xla/ffi/api/api.h"

// fp8_paged_mqa_logits (decode): q [B, next_n, H, 128] e4m3, index cache uint8 [num_blocks, 64,
// 132], weights [B * next_n, H] f32, context_lens [B] i32, block_table [B, W] i32 -> logits
// [B * next_n, max_context_len] f32 (-inf outside each row's range). next_n 1 or 2, H 32 or 64.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90PagedMqaLogits);
// fp8_mqa_logits (prefill): q [M, H, 128] e4m3, keys [N, 128] e4m3, key scales [N] f32, weights
// [M, H] f32, row_starts / row_ends [M] i32 -> logits [M, N] f32 (-inf outside [start, end)).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90MqaLogits);
