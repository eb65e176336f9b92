// SM90 sparse MLA decode handler for a float8_e4m3fn cache with a per-tensor scale (sm90_decode.cuh).
#include "sm90/sm90_decode.cuh"
#include "sm90/sm90_handlers.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSparseMlaSm90DecodeFp8,
    (jax_sparse_mla::Sm90Decode<__nv_fp8_e4m3, xla::ffi::F8E4M3FN>),
    jax_sparse_mla::Sm90DecodeBinding<xla::ffi::F8E4M3FN>(),
    {xla::ffi::Traits::kCmdBufferCompatible});
