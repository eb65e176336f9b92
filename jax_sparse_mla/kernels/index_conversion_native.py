"""The top-k index conversion as CUDA kernels behind XLA FFI custom calls (ffi/common/index_conversion.cuh).

The same per-element rule as `ops.index_conversion._convert` (that module's docstring), bit for bit;
`convert` has `_convert`'s signature, so the public functions pick either. Compiled for every GPU
family the extension is built for (build_info()["common"]). Two kernels, each thread mapping 8 positions (two 16-byte vectors loaded before any is
converted), every lane gathering its table entry at a clamped block with no per-lane branch, and
the runtime divisors (block_size, dcp_size, interleave) applied as multiply-high and shift
(ffi/common/fast_divmod.h):

* tile kernel (in place, no counts): a CTA maps 2048 positions of one row, so small batches still
  fill the GPU;
* row kernel (counts and/or compaction): a CTA walks its row in tiles of 2048; a block-wide scan of
  the valid counts places the kept slots (a stable pack, no atomics), then -1 fills the tail.

Both are registered as command-buffer compatible (no host synchronisation, no allocation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry

__all__ = ["TARGET", "TARGET_COUNTS", "convert", "unavailable_reason"]

TARGET = "jax_sparse_mla_index_conversion"
TARGET_COUNTS = "jax_sparse_mla_index_conversion_counts"


def unavailable_reason() -> str | None:
    """None when the kernels can run on the default device, else why not."""
    capability = registry.current_device_capability()
    if capability is None:
        return "the default device is not a CUDA GPU"
    if not native.available():
        return native.missing_reason()
    if not (native.has_target(TARGET) and native.has_target(TARGET_COUNTS)):
        return "the extension was built without the index-conversion kernels"
    if not native.built_for("common", capability):
        return (f"the extension has no sm_{capability[0]}{capability[1]}a code for them "
                f"(built for {native.build_info().get('common', 'none')})")
    return None


@functools.partial(
    jax.jit, static_argnames=("block_size", "dcp_size", "interleave", "compact", "count"))
def convert(
    req_id: jax.Array, block_table: jax.Array, tok: jax.Array, dcp_rank: int | jax.Array,
    pref_ids: jax.Array | None, pref_starts: jax.Array | None, *,
    block_size: int, dcp_size: int, interleave: int, compact: bool, count: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """The CUDA twin of `index_conversion._convert` (arguments already checked there; the same
    arguments and results as `index_conversion_pallas.convert` without `interpret`): vals [T, K]
    int32, and counts [T] int32 or None when not `count`."""
    num_tokens, top_k = tok.shape
    if num_tokens == 0 or top_k == 0:  # nothing to read: the reference's answer, no launch
        vals = jnp.full((num_tokens, top_k), -1, jnp.int32)
        return vals, (jnp.zeros((num_tokens,), jnp.int32) if count else None)
    has_prefill = pref_ids is not None
    # Absent workspace inputs become one-element stand-ins the kernels never read.
    one = jnp.zeros((1,), jnp.int32)
    out_types = [jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)]
    if count:
        out_types.append(jax.ShapeDtypeStruct((num_tokens,), jnp.int32))
    call = jax.ffi.ffi_call(TARGET_COUNTS if count else TARGET, out_types,
                            vmap_method="sequential")
    outs = call(req_id, block_table, tok, jnp.asarray(dcp_rank, jnp.int32).reshape(1),
                pref_ids if has_prefill else one, pref_starts if has_prefill else one,
                block_size=np.int64(block_size), dcp_size=np.int64(dcp_size),
                interleave=np.int64(interleave), compact=np.bool_(compact),
                has_prefill=np.bool_(has_prefill))
    return outs[0], (outs[1] if count else None)
