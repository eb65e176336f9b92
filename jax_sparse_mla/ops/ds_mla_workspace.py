"""Prefill over an fp8_ds_mla cache through a bf16 workspace: the step's requests' rows dequantised
once, then the bf16 kernel (vLLM's FlashMLA-sparse backend prefills an fp8_ds_mla cache the same way).

The fp8 kernels dequantise every selected row for every token: T x K rows per step. At prefill sizes
the same rows are selected by thousands of tokens, and dequantising each request's block-table rows
once (R x W x block_size rows of 656 bytes read, 1152 written) and running the bf16 kernel costs
less: on an H100 the workspace and FlashInfer's bf16 kernel took 8.9 ms where the fp8 kernel took
10.0 at T = 8192, H = 128 (docs/kernels/sm90-fp8.md, "Prefill over fp8_ds_mla").
`implementation="auto"` takes this route when the static shapes say it pays (`use_bf16_workspace`);
"native" and "xla" never do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import _validation as v
from ..kernels import registry
from .kv_cache import dequantize_ds_mla_rows

# The workspace's largest size (vLLM bounds its prefill workspace near 0.9 GB the same way).
WORKSPACE_MAX_BYTES = 1 << 30
# The route pays only when the kernel would dequantise each workspace row this many times or more
# (T x K selected rows against R x W x block_size rows upconverted), and from this many query tokens.
MIN_SELECTIONS_PER_ROW = 4
MIN_TOKENS = 1024


def use_bf16_workspace(kv_cache: jax.Array, block_table: jax.Array, *, num_tokens: int,
                       num_heads: int, topk: int, q_dtype, implementation: str) -> bool:
    """Whether this call (its static shapes) runs the bf16 kernel over a dequantised workspace.

    kv_cache: [num_blocks, block_size, row]; block_table: [R, W]; the query [num_tokens, num_heads,
    576] of q_dtype; topk: K."""
    ds_mla = kv_cache.dtype == jnp.uint8 and kv_cache.shape[-1] == v.DS_MLA_ROW_BYTES
    if implementation != "auto" or not ds_mla or jnp.dtype(q_dtype) != jnp.bfloat16:
        return False
    block_size = kv_cache.shape[1]
    rows = block_table.shape[0] * block_table.shape[1] * block_size
    if (num_tokens < MIN_TOKENS or rows * v.MLA_HEAD_DIM * 2 > WORKSPACE_MAX_BYTES
            or num_tokens * topk < MIN_SELECTIONS_PER_ROW * rows):
        return False
    problem = registry.Problem(num_tokens=num_tokens, num_heads=num_heads, num_keys=topk,
                               block_size=block_size, kv_layout="bfloat16", q_dtype="bfloat16")
    bf16 = registry.select_kernel("bfloat16", "bfloat16", "auto", problem)
    fp8 = registry.select_kernel("fp8_ds_mla", "bfloat16", "auto",
                                 dataclasses.replace(problem, kv_layout="fp8_ds_mla"))
    return bf16.native and fp8.native


def bf16_workspace(kv_cache: jax.Array, block_table: jax.Array, req_ids: jax.Array,
                   topk_indices: jax.Array, physical: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The requests' rows dequantised, and the selection re-pointed at them.

    kv_cache: [num_blocks, block_size, 656] uint8 (fp8_ds_mla); block_table: [R, W] int32;
    req_ids: [T] int32; topk_indices: [T, K] int32 request-local positions; physical: [T, K] int32,
    the same selection as physical slots (convert_req_index_to_global_index).
    Returns (workspace [R * W, block_size, 576] bf16, where request r's position p is row
    r * W * block_size + p; indices [T, K] int32 into it, -1 wherever `physical` is invalid (negative
    or past the cache), so the bf16 kernel reads exactly the rows the fp8 kernel would)."""
    num_blocks, block_size = kv_cache.shape[:2]
    num_reqs, width = block_table.shape
    blocks = kv_cache[jnp.clip(block_table, 0, num_blocks - 1)]  # [R, W, block_size, 656]
    workspace = dequantize_ds_mla_rows(blocks).astype(jnp.bfloat16)
    valid = (physical >= 0) & (physical < num_blocks * block_size)
    indices = jnp.where(valid, req_ids[:, None] * (width * block_size) + topk_indices, -1)
    return workspace.reshape(num_reqs * width, block_size, v.MLA_HEAD_DIM), indices.astype(jnp.int32)
