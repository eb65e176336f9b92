// SM90 sparse MLA decode handler for a bf16 cache (sm90_decode.cuh).
#include "sm90/sm90_decode.cuh"
#include "sm90/sm90_handlers.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxSparseMlaSm90DecodeBf16,
    (jax_sparse_mla::Sm90Decode<nv_bfloat16, xla::ffi::BF16>),
    jax_sparse_mla::Sm90DecodeBinding<xla::ffi::BF16>(),
    {xla::ffi::Traits::kCmdBufferCompatible});
