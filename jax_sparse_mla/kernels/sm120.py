"""The SM120/SM121 native kernel: FlashInfer's sparse_mla_sm120 DSv3.2 decode behind an XLA FFI call.

The handler in `ffi/sm120/sm120_decode.cu` launches FlashInfer's split-K decode kernel over packed 656-byte
fp8_ds_mla rows (512 e4m3 latent values, 4 fp32 tile scales, 64 bf16 RoPE values) and its merge kernel,
on the XLA stream, as FlashInfer's dsv32 dispatch does. The split-K plan (chunks per CTA, number of
splits) is FlashInfer's resolve_attention, computed once per static shape on the host
(`sm120_plan`) so that the scratch buffers are static extra results of the call. It deviates in one
case: where the tokens alone fill more than 3 waves of CTAs (prefill sizes), FlashInfer's rule falls
back to the most splits (32 at K = 2048, a scratch 32 times the output); the plan takes one split,
so the scratch [T, scratch_heads, 1, 512] is the output's size.

The kernel takes -1 holes anywhere (a zero row with logit -1e30) and scans each row to K, so the
sanitised indices go in unchanged. It is instantiated with arbitrary fp32 tile scales (FlashInfer's
GLM_NSA format, the same 656-byte rows), which is exact for the amax/448 scales our and vLLM's cache
writers store; FlashInfer's "pow2_fp32" DSv3.2 instantiation would keep only the scales' exponents.
Rows without a valid slot are forced to out = 0, lse = -inf.

Not run on SM120 hardware here: compiled for sm_120a/sm_121a and checked on CPU only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry
from .. import _validation as v

TARGET = "jax_sparse_mla_sm120_decode"
MAX_HEADS = 128


def check_problem(problem: registry.Problem, capability: tuple[int, int] | None = None) -> str | None:
    """None when the SM120 kernel takes this problem, else why not (bf16 query, fp8_ds_mla, H <= 128)."""
    if problem.kv_layout != "fp8_ds_mla":
        return f"needs an fp8_ds_mla cache, got {problem.kv_layout!r}"
    if problem.q_dtype != "bfloat16":
        return f"needs a bfloat16 query, got {problem.q_dtype}"
    if not 1 <= problem.num_heads <= MAX_HEADS:
        return f"num_heads must be in [1, {MAX_HEADS}], got {problem.num_heads}"
    if problem.num_keys <= 0:
        return f"the top-k width K must be positive, got K={problem.num_keys}"
    if problem.block_size <= 0:
        return f"block_size must be positive, got {problem.block_size}"
    if capability is not None and not native.built_for("sm120", capability):
        return (f"the extension has no sm_{capability[0]}{capability[1]}a code "
                f"(built for {native.build_info().get('sm120', 'none')})")
    return None


@functools.lru_cache(maxsize=512)
def plan(num_tokens: int, num_heads: int, num_keys: int, sm_count: int) -> dict:
    """FlashInfer's split-K plan for a static shape, with one split at prefill sizes
    (ffi/sm120/sm120_plan.cc): dict of chunks, chunks_per_block, num_splits, scratch_heads."""
    return dict(native.module.sm120_plan(num_tokens, num_heads, num_keys, sm_count))


def _sm120_kernel(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base):
    """SM120 kernel (contract in kernels/registry.py): bf16 q [T, H, 576], uint8 fp8_ds_mla cache [.., .., 656]."""
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return (jnp.zeros((0, num_heads, v.MLA_V_DIM), jnp.bfloat16),
                jnp.zeros((0, num_heads), jnp.float32))
    if bmm2_scale != 1.0:
        raise ValueError(f"the SM120 kernel takes no output scale (fp8_ds_mla); got {bmm2_scale}.")
    num_keys = indices.shape[1]
    indices = registry.sanitize_indices(indices, kv_cache.shape[0] * kv_cache.shape[1], valid_counts)
    p = plan(num_tokens, num_heads, num_keys, registry.device_sm_count())
    splits, scratch_heads = p["num_splits"], p["scratch_heads"]
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((num_tokens, num_heads, v.MLA_V_DIM), jnp.bfloat16),  # out
            jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32),  # lse
            jax.ShapeDtypeStruct((num_tokens, scratch_heads, splits, v.MLA_V_DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_tokens, scratch_heads, splits), jnp.float32),
        ),
        vmap_method="sequential",
    )
    out, lse, _mid_out, _mid_lse = call(
        q,
        kv_cache,
        indices,
        sm_scale=np.float32(bmm1_scale),
        lse_base_e=np.bool_(lse_base == "e"),
        num_splits=np.int64(splits),
        chunks_per_block=np.int64(p["chunks_per_block"]),
    )
    return registry.mask_empty_rows(out, lse, (indices < 0).all(axis=1))


registry.register_kernel(registry.SparseMLAKernel(
    name="sm120_flashinfer_sparse_mla",
    native=True,
    capability_majors=(12,),
    kv_layouts=("fp8_ds_mla",),
    q_dtypes=("bfloat16",),
    fn=_sm120_kernel,
    available=lambda: native.has_target(TARGET),
    check=check_problem,
))
