"""Pallas (Triton-lowered) GPU kernels for the top-k index conversion.

The same per-element rule as `index_conversion._convert` (see that module's docstring), written as
Pallas kernels that lower through Pallas' Triton backend, so they run inside `jax.jit` on CUDA
GPUs, and on any backend with `interpret=True` (how the CPU tests exercise them). Results are bit
for bit those of the pure-JAX version; `convert` has the same signature as `_convert`, so the
public functions can pick either. Pallas rather than jax-triton's `triton_call`: it ships with
jax (no extra dependency, no torch-side Triton), and its interpreter lets CPU CI run the kernels.

Two kernels:

* tile kernel (in place, no counts): grid (T, cdiv(K, w)), w = min(TILE, next_pow2(K)); each
  program maps one w-wide slice of one row, so small batches still fill the GPU.
* row kernel (counts and/or compaction): grid (T,); one program walks its row left to right in
  tiles of ROW_TILE = min(next_pow2(K), 4096) columns (vLLM 0.34's single-tile width; rows wider
  than 4096 take several tiles). With compaction, a tile's valid lanes land at
  `running count + inclusive cumsum - 1`, so the pack is stable without atomics, and a second pass
  writes -1 over the tail [count, K). The scatter and the tail touch disjoint columns, so the
  threads of a program never race.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

__all__ = ["convert"]

# In-place tile width: 1024 int32 lanes on 4 warps are 8 per thread, two 16-byte vectors, enough
# in flight per thread to stream at copy speed.
TILE = 1024
# vLLM 0.34 handles a row in one program when next_pow2(K) <= 4096; wider rows loop over tiles.
MAX_ROW_TILE = 4096


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(width: int) -> int:
    """Warps for a program that maps `width` lanes: 8 from 2048 lanes up, so each thread keeps
    a handful of elements (more warps would only add scan and reduction steps)."""
    return 8 if width >= 2048 else 4


def _tile_values(
    tok_ref, bt_ref, row, col0: int | jax.Array, width: int, req, rank, is_pref, start, *,
    top_k: int, block_size: int, dcp_size: int, interleave: int, table_width: int,
    has_table: bool, has_prefill: bool,
):
    """Converts columns [col0, col0 + width) of one row (col0 a multiple of width).

    Returns (cols, in_row, vals, valid): [width] int32 column numbers; [width] bool lanes before K,
    or None when every tile lies inside the row (K % width == 0: no mask, so Triton vectorises
    freely); [width] int32 slots (-1 where invalid); [width] bool (lanes at or past K invalid).
    """
    cols = col0 + lax.broadcasted_iota(jnp.int32, (width,), 0)
    in_row = cols < top_k if top_k % width else None
    # Columns as an index vector, not a static `pl.ds`: the last tile of a row may hang past K
    # (masked), which a static slice rejects; Triton still sees a contiguous, aligned range.
    tok_cols = tok_ref.at[row, cols]
    tok = plt.load(tok_cols) if in_row is None else plt.load(tok_cols, mask=in_row, other=-1)
    # Non-negative from here on, so truncating division is floor division, as in the pure version.
    pos = jnp.maximum(tok, 0)
    if dcp_size == 1:
        local = pos
    else:
        local = lax.div(pos, dcp_size * interleave) * interleave + lax.rem(pos, interleave)
    blk, off = lax.div(local, block_size), lax.rem(local, block_size)
    rejected = blk >= table_width
    if dcp_size > 1:
        rejected = rejected | (lax.rem(lax.div(pos, interleave), dcp_size) != rank)
    if has_prefill:
        rejected = rejected & ~is_pref
    valid = (tok >= 0) & ~rejected
    if has_table:
        # Only lanes that use a table entry read one (masked lanes issue no memory access); the
        # clamp keeps the interpreter's unmasked gather inside the table too.
        reads_table = valid & ~is_pref if has_prefill else valid
        blk_in_table = jnp.minimum(blk, table_width - 1)
        entry = plt.load(bt_ref.at[req, blk_in_table], mask=reads_table, other=0)
    else:
        entry = jnp.zeros_like(tok)
    phys = entry * block_size + off
    if has_prefill:
        phys = jnp.where(is_pref, start + tok, phys)
    return cols, in_row, jnp.where(valid, phys, -1), valid


def _row_scalars(req_ref, rank_ref, pref_ids_ref, starts_ref, row, *,
                 num_reqs: int, num_starts: int, has_prefill: bool):
    """Per-row scalars: the clipped request, this rank, is-prefill flag and workspace start."""
    # Request ids are trusted but clipped, exactly as the pure version does (bad ids can't read
    # outside the table).
    req = jnp.clip(req_ref[row], 0, max(num_reqs - 1, 0))
    rank = rank_ref[0]
    if not has_prefill:
        return req, rank, None, None
    pref_id = pref_ids_ref[row]
    start = starts_ref[jnp.clip(pref_id, 0, num_starts - 1)] if num_starts else jnp.int32(0)
    return req, rank, pref_id >= 0, start


def _tile_kernel(req_ref, tok_ref, bt_ref, rank_ref, pref_ids_ref, starts_ref, out_ref, *,
                 width: int, num_reqs: int, num_starts: int, **static):
    row, col0 = pl.program_id(0), pl.program_id(1) * width
    req, rank, is_pref, start = _row_scalars(
        req_ref, rank_ref, pref_ids_ref, starts_ref, row,
        num_reqs=num_reqs, num_starts=num_starts, has_prefill=static["has_prefill"],
    )
    cols, in_row, vals, _ = _tile_values(tok_ref, bt_ref, row, col0, width, req, rank, is_pref,
                                         start, **static)
    plt.store(out_ref.at[row, cols], vals, mask=in_row)


def _row_kernel(req_ref, tok_ref, bt_ref, rank_ref, pref_ids_ref, starts_ref, out_ref,
                *count_ref, width: int, num_reqs: int, num_starts: int, compact: bool, **static):
    row = pl.program_id(0)
    top_k = static["top_k"]
    req, rank, is_pref, start = _row_scalars(
        req_ref, rank_ref, pref_ids_ref, starts_ref, row,
        num_reqs=num_reqs, num_starts=num_starts, has_prefill=static["has_prefill"],
    )
    count = jnp.int32(0)
    for col0 in range(0, top_k, width):  # static and short: K <= 4096 is a single tile
        cols, in_row, vals, valid = _tile_values(tok_ref, bt_ref, row, col0, width, req, rank,
                                                 is_pref, start, **static)
        valid_i32 = valid.astype(jnp.int32)
        if compact:
            dest = count + lax.cumsum(valid_i32, axis=0) - 1
            # Invalid lanes aim past the row: masked on the GPU, and never aliasing a valid lane's
            # destination in interpret mode (which scatters every lane, old value where masked).
            dest = jnp.where(valid, dest, top_k + cols)
            plt.store(out_ref.at[row, dest], vals, mask=valid)
        else:
            plt.store(out_ref.at[row, cols], vals, mask=in_row)
        count = count + jnp.sum(valid_i32)
    if compact:
        for col0 in range(0, top_k, width):
            cols = col0 + lax.broadcasted_iota(jnp.int32, (width,), 0)
            plt.store(out_ref.at[row, cols], jnp.full((width,), -1, jnp.int32),
                      mask=(cols >= count) & (cols < top_k))
    if count_ref:
        count_ref[0][row] = count


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "dcp_size", "interleave", "compact", "count", "interpret"),
)
def convert(
    req_id: jax.Array, block_table: jax.Array, tok: jax.Array, dcp_rank: int | jax.Array,
    pref_ids: jax.Array | None, pref_starts: jax.Array | None, *,
    block_size: int, dcp_size: int, interleave: int, compact: bool, count: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """The Pallas twin of `index_conversion._convert` (arguments already checked there).

    Args:
      req_id: [T] int32 request per token.
      block_table: [R, W] int32.
      tok: [T, K] int32 request positions (negative = invalid).
      dcp_rank: int or int32 scalar (ignored when dcp_size == 1).
      pref_ids: [T] int32 workspace request per token (-1 = paged) or None.
      pref_starts: [P] int32 workspace starts, or None (with pref_ids).
      block_size, dcp_size, interleave: static ints.
      compact: stable-pack valid slots to the row front, -1 after.
      count: also return valid counts.
      interpret: run the kernels in Pallas' interpreter (any backend) instead of through Triton.

    Returns:
      vals [T, K] int32 and counts [T] int32 (or None when not `count`).
    """
    num_tokens, top_k = tok.shape
    num_reqs, table_width = block_table.shape
    if num_tokens == 0 or top_k == 0:
        vals = jnp.full((num_tokens, top_k), -1, jnp.int32)
        return vals, (jnp.zeros((num_tokens,), jnp.int32) if count else None)
    has_table = num_reqs * table_width > 0
    has_prefill = pref_ids is not None
    num_starts = pref_starts.shape[0] if has_prefill else 0
    # Absent inputs become one-element stand-ins that the kernel never reads (static flags), so
    # both kernels keep one argument list.
    one = jnp.zeros((1,), jnp.int32)
    inputs = (
        req_id,
        tok,
        block_table if has_table else one.reshape(1, 1),
        jnp.asarray(dcp_rank, jnp.int32).reshape(1),
        pref_ids if has_prefill else one,
        pref_starts if num_starts else one,
    )
    static = dict(
        top_k=top_k, block_size=block_size, dcp_size=dcp_size, interleave=interleave,
        table_width=table_width, has_table=has_table, has_prefill=has_prefill,
        num_reqs=num_reqs, num_starts=num_starts,
    )
    vals_shape = jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)
    if not (compact or count):
        width = min(TILE, _next_pow2(top_k))
        vals = pl.pallas_call(
            functools.partial(_tile_kernel, width=width, **static),
            out_shape=vals_shape,
            grid=(num_tokens, pl.cdiv(top_k, width)),
            compiler_params=plt.CompilerParams(num_warps=_num_warps(width), num_stages=1),
            interpret=interpret,
        )(*inputs)
        return vals, None
    width = min(MAX_ROW_TILE, _next_pow2(top_k))
    out_shape = [vals_shape]
    if count:
        out_shape.append(jax.ShapeDtypeStruct((num_tokens,), jnp.int32))
    outs = pl.pallas_call(
        functools.partial(_row_kernel, width=width, compact=compact, **static),
        out_shape=out_shape,
        grid=(num_tokens,),
        compiler_params=plt.CompilerParams(num_warps=_num_warps(width), num_stages=1),
        interpret=interpret,
    )(*inputs)
    return outs[0], (outs[1] if count else None)


@functools.cache
def lowering_error() -> str | None:
    """None when both kernels lower for CUDA with this JAX (Pallas -> Triton IR, no GPU needed),
    else the error: checked once per process, so that a JAX whose Pallas Triton backend changed or
    went away makes the public functions fall back instead of breaking the caller's jit."""
    spec = jax.ShapeDtypeStruct
    args = (spec((2,), jnp.int32), spec((2, 4), jnp.int32), spec((2, 128), jnp.int32), 0, None,
            None)
    try:
        for compact in (False, True):
            jax.jit(functools.partial(convert, block_size=16, dcp_size=1, interleave=1,
                                      compact=compact, count=compact)).trace(*args).lower(
                lowering_platforms=("cuda",))
    except Exception as error:  # noqa: BLE001  (any failure means: do not use these kernels)
        return f"the Pallas Triton kernels do not lower with jax {jax.__version__}: {error!r}"[:500]
    return None
