// The merge of split partials for our SM90 decode kernels: when a plan splits each token's slot
// list, every CTA writes a normalised fp32 partial and its base-2 lse, and this combines them into
// out / lse.
#pragma once

#include <cuda_runtime_api.h>

#include "sm90/sm90_fp8_kernel.cuh"

namespace jax_sparse_mla::fp8 {

// One launch over every (token, head) row of `params` (num_splits > 1).
cudaError_t LaunchMergeSplits(const DecodeParams& params, cudaStream_t stream);

}  // namespace jax_sparse_mla::fp8
