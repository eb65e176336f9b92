"""SM90 (H100 / H200) kernels of the lightning indexer's top-k: `top_k_per_row` and
`top_k_per_row_decode` (ops/indexer.py) as XLA FFI custom calls (`ffi/sm90/indexer_topk.cu`).

The kernel returns the pure-JAX reference's array bit for bit (the rule is in docs/indexer.md):
one CTA of 512 threads per row. A row of at most k positions writes 0 .. len - 1 and then -1
without reading its logits. A longer row maps every value to an order-preserving uint32 key (NaN
below -inf, -0.0 equal to +0.0, as `_order_keys`), finds the k-th largest key exactly with three
histogram passes over the row (11, 11 and 10 bits, each restricted to the keys that match the
digits chosen so far; 2048 bins in shared memory, a block-wide prefix sum to find the threshold
bin; no candidate buffer, so heavy ties cannot truncate the selection), then makes one pass in
position order that keeps every key above the threshold and the lowest-positioned ties, writing
each kept position at its prefix-sum rank: ascending positions, deterministic, no sort. Rows are
read as aligned float4 groups whatever the row start.

Both kernels passed their GPU tests on an H200 (tests/kernels/test_sm90_indexer_topk_gpu.py,
memcheck and command buffers included): implementation="auto" runs them on SM90.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry

TARGET = "jax_sparse_mla_sm90_top_k_per_row"
TARGET_DECODE = "jax_sparse_mla_sm90_top_k_per_row_decode"
# The kernel indexes rows with the grid's x dimension and holds positions, the width S and k as
# int32 (the handler rejects anything larger).
MAX_DIM = 2**31 - 1


def check_problem(problem: registry.IndexerProblem,
                  capability: tuple[int, int] | None = None) -> str | None:
    """None when the kernel takes this top-k call, else why not.

    problem: the op's IndexerProblem (num_rows R, num_keys S, top_k k, dtypes in signature order).
    """
    if problem.dtypes and problem.dtypes[0] != "float32":
        return f"needs float32 logits, got {problem.dtypes[0]}"
    if any(d != "int32" for d in problem.dtypes[1:]):
        return f"needs int32 row ranges, got {problem.dtypes[1:]}"
    for name, value in (("R (rows)", problem.num_rows), ("S (logits width)", problem.num_keys),
                        ("k", problem.top_k)):
        if value > MAX_DIM:
            return f"{name} must be below 2^31, got {value}"
    if problem.top_k < 1:
        return f"k must be positive, got {problem.top_k}"
    if problem.next_n < 1:
        return f"next_n must be positive, got {problem.next_n}"
    if capability is not None and not native.built_for("sm90", capability):
        return (f"the extension has no sm_{capability[0]}{capability[1]}a code "
                f"(built for {native.build_info().get('sm90', 'none')})")
    return None


def _empty(num_rows: int, k: int) -> jax.Array:
    return jnp.full((num_rows, k), -1, jnp.int32)


def _top_k_per_row(logits: jax.Array, row_starts: jax.Array, row_ends: jax.Array, *,
                   k: int) -> jax.Array:
    """logits f32 [R, S], row_starts / row_ends int32 [R] -> int32 [R, k] (contract:
    ops.indexer.top_k_per_row)."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:  # nothing to read; the reference's answer, no launch
        return _empty(num_rows, k)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                            vmap_method="sequential")
    return call(logits, row_starts, row_ends)


def _top_k_per_row_decode(logits: jax.Array, context_lens: jax.Array, *, next_n: int,
                          k: int) -> jax.Array:
    """logits f32 [B * next_n, S], context_lens int32 [B] -> int32 [B * next_n, k] (contract:
    ops.indexer.top_k_per_row_decode)."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return _empty(num_rows, k)
    call = jax.ffi.ffi_call(TARGET_DECODE, jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                            vmap_method="sequential")
    return call(logits, context_lens, next_n=np.int64(next_n))


registry.register_op_kernel(registry.OpKernel(
    op="top_k_per_row",
    name="sm90_topk",
    native=True,
    capability_majors=(9,),
    fn=_top_k_per_row,
    available=lambda: native.has_target(TARGET),
    check=check_problem,
))
registry.register_op_kernel(registry.OpKernel(
    op="top_k_per_row_decode",
    name="sm90_topk",
    native=True,
    capability_majors=(9,),
    fn=_top_k_per_row_decode,
    available=lambda: native.has_target(TARGET_DECODE),
    check=check_problem,
))
