"""The lightning indexer's key cache: vLLM's fp8 writer and prefill gather, over vLLM's byte layout.

A cache is uint8 [num_blocks, block_size, 132] (block_size 64 in vLLM), but [block_size, 132] is only a
byte container for one block of P = block_size * 132 bytes, laid out as (o = the token's in-block offset):

    bytes [0, 128 * block_size)            e4m3 values, token-major: token o at [128 o, 128 o + 128)
    bytes [128 * block_size, P)            fp32 scales, little-endian: token o at 128 * block_size + 4 o

so index_cache[b, o, :] is not token o's record (for o = 0 its last 4 bytes belong to token 1). A slot is
block * block_size + offset, as for the MLA cache.

One key (128 values) is quantised as vLLM's `indexer_k_quant_and_cache` does with scale_fmt "ue8m0":

    amax = max |k|,   s = 2^ceil(log2(max(amax, 1e-4) / 448)),   k8 = e4m3(k / s)

with a true division (s is a power of two, so k / s is exact unless it underflows), round-to-nearest-even
and saturation. The scale is stored as a full fp32 value. NaN inputs are ignored by amax (CUDA's fmaxf
drops NaN operands) and stay NaN; keys with infinite values have unspecified bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as v
from ..kernels import registry
from .kv_cache import FP8_E4M3_MAX, _divide, _to_e4m3

__all__ = ["cp_gather_indexer_k_quant_cache", "indexer_k_quant_and_cache", "ue8m0_quantize"]

K_EPS = 1e-4  # vLLM's cache writer (and DeepSeek's reference act_quant) floor on amax
_D = v.INDEXER_HEAD_DIM
_ROW = v.INDEXER_CACHE_ROW_BYTES


# The smallest eps for which eps / 448 is a normal float32 (the scale's bit trick needs that).
_MIN_EPS = float(FP8_E4M3_MAX) * float(np.finfo(np.float32).tiny)


def _check_eps(name: str, eps) -> float:
    """eps: a static finite float with eps / 448 a normal float32 (about 5.3e-36 up to float32's max)."""
    eps = v.check_finite_positive_float(name, eps)
    if not _MIN_EPS <= eps <= float(np.finfo(np.float32).max):
        raise ValueError(f"{name} must be in [{_MIN_EPS:.3g}, {float(np.finfo(np.float32).max):.3g}] "
                         f"(eps / 448 a normal float32), got {eps!r}.")
    return eps


def _check_groups(name: str, x) -> None:
    """x: [..., 128] bf16 / f16 / f32, at least rank 1."""
    v.check_dtype(name, x, (jnp.bfloat16, jnp.float16, jnp.float32))
    v.check_min_rank(name, x, 1)
    v.check_last_dim(name, x, _D)


def ue8m0_quantize(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """Quantises groups of 128 with power-of-two ("ue8m0") scales.

    x: [..., 128] bf16 / f16 / f32 (leading axes may be empty). Returns (x8 [..., 128]
    float8_e4m3fn, scale [...] float32) with x ~= x8 * scale and
    scale = 2^ceil(log2(max(amax, eps) / 448)), computed exactly: the division is a true IEEE division
    (not a multiplication by 1/448, which can land one ulp above a power of two and double the scale)
    and the ceil(log2) is read from the float's bits. eps: a static float, finite, with eps / 448 a
    normal float32. A non-array x, a wrong dtype or a non-number eps is a TypeError; a wrong rank or
    last dimension, or eps out of range, a ValueError.
    """
    x = v.as_array("ue8m0_quantize: x", x)
    _check_groups("ue8m0_quantize: x", x)
    eps = _check_eps("ue8m0_quantize: eps", eps)
    return _ue8m0_quantize(x, eps)


def _ue8m0_quantize(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """ue8m0_quantize without the checks (the callers have made them)."""
    x = x.astype(jnp.float32)
    magnitude = jnp.abs(x)
    amax = jnp.max(jnp.where(jnp.isnan(magnitude), 0.0, magnitude), axis=-1)
    s = _divide(jnp.maximum(amax, jnp.float32(eps)), jnp.float32(FP8_E4M3_MAX))
    # s is positive and normal (eps / 448 > 2^-126): 2^ceil(log2 s) is 2^exponent when the mantissa
    # is zero (s is a power of two) and 2^(exponent + 1) otherwise.
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    scale = jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)
    return _to_e4m3(_divide(x, scale[..., None])), scale


def _as_bytes(x: jax.Array) -> jax.Array:
    """[T, n] (e4m3) or [T] (f32) -> uint8 [T, n * itemsize], in memory order (little-endian)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)


def split_block_bytes(blocks: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Unpacks whole cache blocks: uint8 [..., block_size * 132] -> (values [..., block_size, 128]
    float8_e4m3fn, scales [..., block_size] float32)."""
    lead = blocks.shape[:-1]
    values = blocks[..., : block_size * _D].reshape(*lead, block_size, _D)
    scales = blocks[..., block_size * _D:].reshape(*lead, block_size, 4)
    return (jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn),
            jax.lax.bitcast_convert_type(scales, jnp.float32))


@jax.jit
def _write_xla(k, index_cache, slot_mapping):
    """Pure-JAX writer: one scatter of every token's 132 bytes into the block-major byte view."""
    num_blocks, block_size, _ = index_cache.shape
    if k.shape[0] == 0 or num_blocks == 0:
        return index_cache
    values, scales = _ue8m0_quantize(k, K_EPS)
    record = jnp.concatenate([_as_bytes(values), _as_bytes(scales)], axis=1)  # [T, 132]
    slot = slot_mapping
    # Negative slots (padding) aim at block num_blocks, which the scatter drops; so do slots past the
    # cache, which vLLM would write out of bounds. (A negative index would otherwise wrap.)
    block = jnp.where(slot < 0, num_blocks, slot // block_size)
    offset = (slot % block_size)[:, None]
    byte = jnp.concatenate([offset * _D + jnp.arange(_D), block_size * _D + 4 * offset + jnp.arange(4)],
                           axis=1)
    pages = index_cache.reshape(num_blocks, block_size * _ROW)
    pages = pages.at[block[:, None], byte].set(record, mode="drop")
    return pages.reshape(index_cache.shape)


def _check_cache(name: str, index_cache) -> None:
    """uint8 [num_blocks, block_size, 132] with at least one block of at least one token: a cache
    without a slot can hold no key (every id into it would be out of range)."""
    v.check_rank(name, index_cache, 3)
    v.check_dtype(name, index_cache, (jnp.uint8,))
    v.check_last_dim(name, index_cache, _ROW)
    v.check_nonempty_axes(name, index_cache, {0: "block (num_blocks)", 1: "token per block (block_size)"})


def _check_block_ids(op: str, block_table, lengths, block_size: int, num_blocks: int,
                     what: str) -> None:
    """Eager calls: every block id that a request's tokens read must lie in [0, num_blocks).

    block_table [R, W] int32; lengths: the concrete tokens per request (NumPy [R], values <= 0 read no
    block) or None under `jax.jit`, where nothing is checked and the op's documented masking applies.
    Entries past a request's last block are not read and may hold anything (vLLM pads with junk).
    """
    if lengths is None:
        return
    table = v.host_values(block_table)
    if table is None or table.size == 0:
        return
    width = table.shape[1]
    used = np.minimum(-(-np.maximum(lengths.astype(np.int64), 0) // block_size), width)
    read = np.arange(width)[None, :] < used[:, None]
    bad = read & ((table < 0) | (table >= num_blocks))
    if bad.any():
        r, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"{op}: block_table[{r}, {i}] = {int(table[r, i])} is outside the index cache's "
            f"{num_blocks} blocks [0, {num_blocks}), but request {r} reads it ({what} "
            f"{int(lengths[r])}, blocks 0..{int(used[r]) - 1} of its row of block_table).")


def _dtype_names(*arrays) -> tuple[str, ...]:
    return tuple(jnp.dtype(a.dtype).name for a in arrays)


def indexer_k_quant_and_cache(
    k: jax.Array,
    index_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    implementation: str = "auto",
) -> jax.Array:
    """Quantises this step's indexer keys to fp8 and writes them into the paged index cache.

    Args:
      k: [T, 128] bf16 (f16 and f32 accepted) keys after LayerNorm and RoPE.
      index_cache: uint8 [num_blocks, block_size, 132] in vLLM's byte layout (module docstring).
      slot_mapping: [T] int32 / int64 slots block * block_size + offset. Slots < 0 (padding) are
        skipped, and so are slots past the cache (vLLM would write out of bounds).
      implementation: "auto", "xla" (pure JAX) or "native", as for sparse_mla_decode.

    Returns:
      The new cache (same shape and dtype). Functional: donate the cache under `jax.jit` to update it
      in place. Token t's record is e4m3(k[t] / s_t) and s_t = 2^ceil(log2(max(amax_t, 1e-4) / 448)).
      Two tokens with the same slot leave one of the two records, unspecified which. T = 0 keys
      return the cache unchanged.

    Raises:
      TypeError: an argument that is not an array (None, a list, a scalar), or of the wrong dtype.
      ValueError: wrong rank or shape, or an index cache with no block or no token per block.
    """
    op = "indexer_k_quant_and_cache"
    k = v.as_array(f"{op}: k", k)
    index_cache = v.as_array(f"{op}: index_cache", index_cache)
    slot_mapping = v.as_array(f"{op}: slot_mapping", slot_mapping)
    v.check_rank(f"{op}: k", k, 2)
    v.check_dtype(f"{op}: k", k, (jnp.bfloat16, jnp.float16, jnp.float32))
    v.check_last_dim(f"{op}: k", k, _D)
    _check_cache(f"{op}: index_cache", index_cache)
    v.check_rank(f"{op}: slot_mapping", slot_mapping, 1)
    v.check_int_dtype(f"{op}: slot_mapping", slot_mapping)
    v.check_shape(f"{op}: slot_mapping", slot_mapping, (k.shape[0],), "(one slot per key)")
    problem = registry.IndexerProblem(
        op, num_rows=k.shape[0], num_keys=index_cache.shape[0] * index_cache.shape[1],
        block_size=index_cache.shape[1], dtypes=_dtype_names(k, index_cache, slot_mapping))
    kernel = registry.select_op_kernel(op, implementation, problem)
    return kernel.fn(k, index_cache, slot_mapping)


def _read_slots(pages: jax.Array, block: jax.Array, offset: jax.Array, block_size: int):
    """Reads the records of slots (block [N], offset [N]) from the byte pages [num_blocks, P]:
    (values [N, 128] e4m3, scales [N] f32). A vmapped dynamic_slice is a gather of N windows, not of
    N * 132 single bytes. Block ids must be in range (dynamic_slice clamps, it never faults)."""
    def record(b, o):
        values = jax.lax.dynamic_slice(pages, (b, o * _D), (1, _D))[0]
        scale = jax.lax.dynamic_slice(pages, (b, block_size * _D + 4 * o), (1, 4))[0]
        return values, scale

    values, scales = jax.vmap(record)(block, offset)
    return (jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn),
            jax.lax.bitcast_convert_type(scales, jnp.float32))


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def _gather_xla(index_cache, block_table, cu_seq_lens, *, num_tokens):
    """Pure-JAX gather: each row finds its request by binary search over cu_seq_lens."""
    num_blocks, block_size, _ = index_cache.shape
    num_reqs, width = block_table.shape
    zeros = (jnp.zeros((num_tokens, _D), jnp.float8_e4m3fn), jnp.zeros((num_tokens,), jnp.float32))
    if num_reqs == 0 or width == 0 or num_blocks == 0 or num_tokens == 0:
        return zeros
    # The documented reading of a negative or decreasing cu_seq_lens (only reachable under jit): its
    # running maximum, clamped at 0. A sorted, non-negative cu_seq_lens is unchanged.
    cu_seq_lens = jax.lax.cummax(jnp.maximum(cu_seq_lens, 0), axis=0)
    row = jnp.arange(num_tokens, dtype=jnp.int32)
    # Row n belongs to the first request r with cu[r + 1] > n (empty requests are skipped); the
    # unrolled search keeps the gather free of a while loop (see metadata.req_id_per_token).
    req = jnp.searchsorted(cu_seq_lens[1:], row, side="right", method="scan_unrolled").astype(jnp.int32)
    req_c = jnp.minimum(req, num_reqs - 1)
    token = row - cu_seq_lens[req_c]
    block_index = token // block_size
    block = block_table[req_c, jnp.clip(block_index, 0, width - 1)]
    valid = ((row >= cu_seq_lens[0]) & (req < num_reqs) & (token >= 0) & (block_index < width)
             & (block >= 0) & (block < num_blocks))
    pages = index_cache.reshape(num_blocks, block_size * _ROW)
    values, scales = _read_slots(pages, jnp.clip(block, 0, num_blocks - 1), token % block_size,
                                 block_size)
    return (jnp.where(valid[:, None], values, zeros[0]), jnp.where(valid, scales, 0.0))


def cp_gather_indexer_k_quant_cache(
    index_cache: jax.Array,
    block_table: jax.Array,
    cu_seq_lens: jax.Array,
    *,
    num_tokens: int,
    implementation: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Gathers the cached keys of R requests into one contiguous buffer (the prefill path's input).

    Args:
      index_cache: uint8 [num_blocks, block_size, 132] (vLLM's layout, see the module docstring).
      block_table: [R, W] int32 block ids per request.
      cu_seq_lens: [R + 1] int32 cumulative sequence lengths (cu[0] is usually 0): request r owns rows
        [cu[r], cu[r + 1]) of the result, and row cu[r] + i is its token i, read through
        block_table[r, i // block_size].
      num_tokens: static Python int, the number of rows; an upper bound on cu[R] is fine.
      implementation: "auto", "xla" (pure JAX) or "native".

    Returns:
      (k_fp8 [num_tokens, 128] float8_e4m3fn, k_scale [num_tokens] float32). Rows that belong to no
      request (before cu[0], from cu[R] on) are 0 with scale 0. Called eagerly, a request longer than
      W * block_size, cu[R] > num_tokens, a negative or decreasing cu_seq_lens, or a block id outside
      [0, num_blocks) among the blocks a request reads (block_table[r, :ceil(len_r / block_size)]) is
      a ValueError naming the argument. Under `jax.jit` the values are unknown and none of this is
      checked: rows past the table or past num_tokens are dropped (0) and block ids outside
      [0, num_blocks) read as 0 (scale 0); cu_seq_lens is read as its running maximum clamped at 0,
      cu'[r] = max(0, cu[0], ..., cu[r]) (no change to a valid one), so a negative length counts as
      0 and a request whose entries fall below an earlier one keeps only the rows past them:
      request r owns rows [cu'[r], cu'[r + 1]) and row cu'[r] + i is its token i. Nothing is ever
      read outside the cache or the table.

    Raises:
      TypeError: an argument that is not an array, or of the wrong dtype; num_tokens not an int.
      ValueError: wrong rank or shape, an index cache with no block (num_blocks = 0) or no token per
        block (block_size = 0), num_tokens < 1, and (eagerly) the value errors above. R = 0 requests
        or W = 0 table columns (with every length 0) are fine: all rows are 0.
    """
    op = "cp_gather_indexer_k_quant_cache"
    index_cache = v.as_array(f"{op}: index_cache", index_cache)
    block_table = v.int32_array(f"{op}: block_table", block_table, 2)
    cu_seq_lens = v.int32_array(f"{op}: cu_seq_lens", cu_seq_lens, 1)
    _check_cache(f"{op}: index_cache", index_cache)
    num_tokens = v.check_static_size(f"{op}: num_tokens", num_tokens)
    num_reqs, width = block_table.shape
    v.check_shape(f"{op}: cu_seq_lens", cu_seq_lens, (num_reqs + 1,),
                  f"for block_table of shape {tuple(block_table.shape)}")
    block_size = index_cache.shape[1]
    cu = v.host_values(cu_seq_lens)
    if cu is not None:
        lengths = np.diff(cu)
        if cu[0] < 0 or (lengths < 0).any():
            raise ValueError(f"{op}: cu_seq_lens must be non-negative and non-decreasing, got {cu.tolist()}.")
        if num_reqs and lengths.max() > width * block_size:
            r = int(lengths.argmax())
            raise ValueError(
                f"{op}: request {r} has {int(lengths[r])} tokens but block_table covers "
                f"{width} blocks x {block_size} = {width * block_size} (cu_seq_lens[{r + 1}] - "
                f"cu_seq_lens[{r}]).")
        if cu[-1] > num_tokens:
            raise ValueError(
                f"{op}: cu_seq_lens[-1] = {int(cu[-1])} rows do not fit num_tokens = {num_tokens}.")
        _check_block_ids(op, block_table, lengths, block_size, index_cache.shape[0],
                         "its length in cu_seq_lens is")
    problem = registry.IndexerProblem(
        op, num_rows=num_tokens, num_keys=num_tokens, batch=num_reqs, block_size=block_size,
        dtypes=_dtype_names(index_cache, block_table, cu_seq_lens))
    kernel = registry.select_op_kernel(op, implementation, problem)
    return kernel.fn(index_cache, block_table, cu_seq_lens, num_tokens=num_tokens)


registry.register_op_kernel(registry.OpKernel(
    op="indexer_k_quant_and_cache", name="xla", native=False, capability_majors=(), fn=_write_xla))
registry.register_op_kernel(registry.OpKernel(
    op="cp_gather_indexer_k_quant_cache", name="xla", native=False, capability_majors=(),
    fn=_gather_xla))
