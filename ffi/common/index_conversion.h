// C symbols of the index-conversion XLA FFI handlers (ffi/common/index_conversion.cu), for the
// nanobind module (which includes no CUDA code).
#pragma once

#include "xla/ffi/api/api.h"

// req_id s32 [T], block_table s32 [R, W], tokens s32 [T, K], rank s32 [1], pref_ids s32 [T or 1],
// pref_starts s32 [P or 1] -> slots s32 [T, K]; attributes block_size, dcp_size, interleave,
// compact, has_prefill, num_starts.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaIndexConversion);
// The same, also returning valid_counts s32 [T].
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaIndexConversionCounts);
