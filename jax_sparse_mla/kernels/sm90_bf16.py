"""The SM90 (H100 / H200) bf16 kernel of our own: sparse MLA decode over bf16 caches without a pack
kernel.

FlashInfer's Hopper kernel (`sm90.py`) needs every token's slots packed to the front first (a kernel
of its own per call) and runs S and the softmax on one warpgroup. Our kernel
(`ffi/sm90/sm90_bf16_kernel.cuh`, on the operand layout of the 64-head fp8 kernel) has a producer
warpgroup copy each tile's 64 rows with 16-byte `cp.async` straight into the wgmma operand layout
(an invalid slot, by the op's index rule, becomes a zero row and a cleared valid bit; nothing is
read for it), in half tiles with barriers of their own. Its two consumer warpgroups take alternate
tiles for S and the softmax, share one running max per row, and each adds P V of both tiles to its
half of the output, so neither idles through the other's softmax. Every head count runs on it, in
groups of 64 heads (a 16-head call computes 64 rows, 48 of them zero); the plan (splits of whole
tile pairs) and the split merge are the fp8 path's (`sm90_fp8.plan`).

On an H100 it computes the right outputs but compute-sanitizer racecheck reports races in it
(docs/kernels/sm90-bf16.md) and it is slower than FlashInfer's kernel, so neither implementation
picks it: it is registered with the lowest precedence, so "native" prefers FlashInfer's kernel for
bf16 caches, and with validated=False, which "auto" passes over. The GPU tests and benchmarks run it
by name.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from . import native, registry, sm90_fp8

TARGET = "jax_sparse_mla_sm90_bf16_decode"
LAYOUT = 2  # KvLayout::kBf16 of ffi/sm90/sm90_fp8_kernel.cuh


def _sm90_bf16_kernel(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base):
    """Kernel contract in kernels/registry.py; q bf16 [T, H, 576], cache bf16 [.., .., 576]
    (bmm2_scale is 1.0 for a bf16 cache)."""
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return sm90_fp8.empty_result(num_heads)
    p = sm90_fp8.plan(num_tokens, num_heads, indices.shape[1], registry.device_sm_count(),
                      bf16_rows=True)
    return sm90_fp8.call_decode(
        TARGET, q, kv_cache.reshape(-1, kv_cache.shape[-1]), indices, valid_counts, p,
        lse_base=lse_base, layout=np.int64(LAYOUT),
        score_scale_log2=np.float32(bmm1_scale * math.log2(math.e)), out_scale=np.float32(1.0),
    )


registry.register_kernel(registry.SparseMLAKernel(
    name="sm90_bf16",
    native=True,
    capability_majors=(9,),
    kv_layouts=("bfloat16",),
    q_dtypes=("bfloat16",),
    fn=_sm90_bf16_kernel,
    available=lambda: native.has_target(TARGET),
    validated=False,
), lowest_precedence=True)
