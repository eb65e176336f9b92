// C symbols of the lightning indexer's top-k XLA FFI handlers (ffi/sm90/indexer_topk.cu), for the
// nanobind module (which includes no CUDA code).
#pragma once

#include "xla/ffi/api/api.h"

// top_k_per_row: logits f32 [R, S], row_starts / row_ends s32 [R] -> s32 [R, k].
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRow);
// top_k_per_row_decode: logits f32 [B * next_n, S], context_lens s32 [B] -> s32 [B * next_n, k].
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowDecode);
// The same two ops with one thread-block cluster per row (rows of up to 360445 positions).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowCluster);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowDecodeCluster);
// The same two ops on the one-CTA kernel's streaming build (one CTA per SM, the row streamed
// through shared memory by the copy engine).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90TopKPerRowDecodeStream);
