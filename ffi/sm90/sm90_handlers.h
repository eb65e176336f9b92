// C symbols of the SM90 XLA FFI handlers, for the nanobind module (which includes no CUDA code).
#pragma once

#include "xla/ffi/api/api.h"

// Sparse MLA decode, bf16 query, bf16 [N, 576] cache.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90DecodeBf16);
// Sparse MLA decode, bf16 query, float8_e4m3fn [N, 576] cache with a per-tensor scale.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90DecodeFp8);
// Sparse MLA decode, bf16 query, fp8 cache (per-tensor e4m3 [N, 576] or fp8_ds_mla uint8 [N, 656]),
// our own kernel (sm90_fp8_kernel.cuh).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxSparseMlaSm90Fp8Decode);
