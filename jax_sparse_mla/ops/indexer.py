"""The lightning indexer's scores and top-k selection (DeepSeek-V3.2 DSA), with vLLM's contracts.

For a query row t (one token) and a key position s the indexer score is

    I[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q8[t, h, :] . k8[s, :])      (fp32 accumulation)

where q8 and k8 are fp8 e4m3 with power-of-two scales (`quantize_indexer_q`, the cache writer) and the
fp32 weights already hold weights_proj(x) * q_scale * 128^-0.5 * H^-0.5 (`fold_indexer_weights`; folding
q's scale into the weights is exact since relu(s a) = s relu(a) for s > 0). Decode scores the keys of
each request through its block table (`fp8_paged_mqa_logits`), prefill a gathered key buffer
(`fp8_mqa_logits`); `top_k_per_row_decode` / `top_k_per_row` then keep k positions per row.

Unlike DeepGEMM's kernels, which leave columns outside a row's range uninitialised unless asked to clean
them, both logits ops always write -inf there, so a full-width top-k over their output is safe.

Pure JAX everywhere (the reference); each function is registered in kernels/registry.py under its own
name so that a native kernel can take it over with `implementation="auto" | "native"`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as v
from ..kernels import registry
from .indexer_cache import (_check_block_ids, _check_cache, _check_eps, _check_groups, _dtype_names,
                            _ue8m0_quantize, split_block_bytes)

__all__ = [
    "fold_indexer_weights",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "quantize_indexer_q",
    "top_k_per_row",
    "top_k_per_row_decode",
]

_D = v.INDEXER_HEAD_DIM
Q_EPS = 1e-10  # vLLM's floor on a query head's amax (DeepSeek's reference uses 1e-4)
# The pure-JAX logits hold per-head dot products [rows, H, keys] in fp32 before the head sum; they are
# computed in chunks of keys (paged) or rows (ragged) of at most this many bytes (and at least one
# block / one row), so that memory stays near the size of the output.
SCORE_CHUNK_BYTES = 1 << 27
# The fp8 operands go into the dot products as float32: every e4m3 value (4 significant bits, exponents
# 2^-9 .. 2^8) is exact there and also in the TF32 / bf16 passes that GPUs and TPUs apply to float32
# dots by default, so the products are exact whatever the backend's default precision and only the
# fp32 accumulation rounds, as in DeepGEMM's kernels.
_DOT_DTYPE = jnp.float32


def quantize_indexer_q(q: jax.Array, *, eps: float = Q_EPS) -> tuple[jax.Array, jax.Array]:
    """Per-(token, head) fp8 query quantisation with power-of-two scales, as vLLM's indexer does it.

    q: [..., H, 128] bf16 / f16 / f32 (after RoPE), H >= 1 (the leading axes may be empty). Returns
    (q8 [..., H, 128] float8_e4m3fn, q_scale [..., H] float32), q ~= q8 * q_scale,
    q_scale = 2^ceil(log2(max(amax, eps) / 448)).
    eps: a static float; 1e-10 is vLLM's; DeepSeek's reference act_quant uses 1e-4. It must be finite
    with eps / 448 a normal float32.

    A non-array q, a wrong dtype or a non-number eps is a TypeError; rank below 2, a last dimension
    other than 128, zero heads or eps out of range a ValueError.
    """
    op = "quantize_indexer_q"
    q = v.as_array(f"{op}: q", q)
    v.check_dtype(f"{op}: q", q, (jnp.bfloat16, jnp.float16, jnp.float32))
    v.check_min_rank(f"{op}: q", q, 2)
    v.check_last_dim(f"{op}: q", q, _D)
    v.check_nonempty_axes(f"{op}: q", q, {q.ndim - 2: "head (H)"})
    eps = _check_eps(f"{op}: eps", eps)
    return _ue8m0_quantize(q, eps)


def fold_indexer_weights(weights: jax.Array, q_scale: jax.Array) -> jax.Array:
    """weights [..., H] (weights_proj(x), fp32) -> weights * q_scale * 128^-0.5 * H^-0.5, fp32 [..., H].

    The softmax scale is head_dim^-0.5 without YaRN's mscale (unlike MLA's); the logits ops take
    these folded weights. weights and q_scale (quantize_indexer_q's) are bf16 / f16 / f32 arrays of
    the same shape [..., H], H >= 1 (the leading axes may be empty): anything else is a TypeError
    (not an array, wrong dtype) or a ValueError (rank 0, zero heads, different shapes).
    """
    op = "fold_indexer_weights"
    weights = v.as_array(f"{op}: weights", weights)
    q_scale = v.as_array(f"{op}: q_scale", q_scale)
    floats = (jnp.bfloat16, jnp.float16, jnp.float32)
    v.check_dtype(f"{op}: weights", weights, floats)
    v.check_dtype(f"{op}: q_scale", q_scale, floats)
    v.check_min_rank(f"{op}: weights", weights, 1)
    v.check_nonempty_axes(f"{op}: weights", weights, {weights.ndim - 1: "head (H)"})
    v.check_shape(f"{op}: q_scale", q_scale, weights.shape, "(the shape of weights, [..., H])")
    num_heads = weights.shape[-1]
    factor = _D ** -0.5 * num_heads ** -0.5
    return weights.astype(jnp.float32) * q_scale.astype(jnp.float32) * jnp.float32(factor)


def _sum_relu_heads(dots: jax.Array, weights: jax.Array, head_axis: int) -> jax.Array:
    """sum_h weights[h] * relu(dots[h]) in fp32, as element-wise products and a sum rather than a
    dot, which a GPU may run in TF32."""
    return jnp.sum(jax.nn.relu(dots) * weights, axis=head_axis)


def _check_query(op: str, q, rank: int) -> None:
    v.check_rank(f"{op}: q", q, rank)
    v.check_dtype(f"{op}: q", q, (jnp.float8_e4m3fn,))
    v.check_last_dim(f"{op}: q", q, _D)
    if q.shape[-2] not in v.INDEXER_NUM_HEADS:
        raise ValueError(
            f"{op}: q must have {' or '.join(map(str, v.INDEXER_NUM_HEADS))} heads (dim {rank - 2}), "
            f"got shape {tuple(q.shape)}.")


def _check_f32(name: str, array, rank: int) -> None:
    v.check_rank(name, array, rank)
    v.check_dtype(name, array, (jnp.float32,))


# --- decode: paged logits -------------------------------------------------------------------------------

def _positions_in_cache(block_table, *, num_blocks, block_size, next_n, max_context_len):
    """[B * next_n, max_context_len] bool: whether key position s of row b * next_n + j lies in a block
    whose id block_table[b, s // block_size] is inside the cache, [0, num_blocks)."""
    needed = -(-max_context_len // block_size)
    ids = block_table[:, :needed]
    inside = (ids >= 0) & (ids < num_blocks)
    inside = jnp.repeat(inside, block_size, axis=1)[:, :max_context_len]
    return jnp.repeat(inside, next_n, axis=0)


@functools.partial(jax.jit, static_argnames=("max_context_len", "chunk_blocks"))
def _paged_logits_jit(q, index_cache, weights, context_lens, block_table, *, max_context_len,
                      chunk_blocks):
    batch, next_n, num_heads, _ = q.shape
    num_blocks, block_size, _ = index_cache.shape
    rows = batch * next_n
    limit = (context_lens[:, None] - next_n + 1 + jnp.arange(next_n, dtype=jnp.int32)).reshape(rows)
    valid = jnp.arange(max_context_len, dtype=jnp.int32)[None, :] < limit[:, None]
    if rows == 0 or num_blocks == 0:
        return jnp.full((rows, max_context_len), -jnp.inf, jnp.float32)
    # A block id outside the cache inside a context (a ValueError when called eagerly) is never read
    # (clamped below) and its positions are -inf.
    valid = valid & _positions_in_cache(block_table, num_blocks=num_blocks, block_size=block_size,
                                        next_n=next_n, max_context_len=max_context_len)
    needed = -(-max_context_len // block_size)
    num_chunks = -(-needed // chunk_blocks)
    table = block_table[:, :needed]
    table = jnp.pad(table, ((0, 0), (0, num_chunks * chunk_blocks - needed)))
    # Entries past a request's last block may hold anything, and entries inside it may lie outside the
    # cache under jit: clamp so the gather stays in bounds; the scores they produce are masked to -inf
    # below.
    table = jnp.clip(table, 0, num_blocks - 1).reshape(batch, num_chunks, chunk_blocks)
    pages = index_cache.reshape(num_blocks, -1)
    q = q.astype(_DOT_DTYPE)
    weights = weights.reshape(batch, next_n, num_heads, 1)

    def scores(blocks):  # [B, chunk_blocks] -> [B, next_n, chunk_blocks * block_size]
        values, scales = split_block_bytes(pages[blocks], block_size)
        keys = values.reshape(batch, -1, _D).astype(_DOT_DTYPE)
        dots = jnp.einsum("bjhd,bsd->bjhs", q, keys, preferred_element_type=jnp.float32)
        return _sum_relu_heads(dots, weights, 2) * scales.reshape(batch, 1, -1)

    if num_chunks == 1:
        out = scores(table[:, 0])
    else:
        out = jax.lax.map(scores, jnp.moveaxis(table, 1, 0))  # [chunks, B, next_n, C]
        out = jnp.moveaxis(out, 0, 2).reshape(batch, next_n, -1)
    out = out.reshape(rows, -1)[:, :max_context_len]
    return jnp.where(valid, out, -jnp.inf)


def _paged_logits_xla(q, index_cache, weights, context_lens, block_table, *, max_context_len):
    batch, next_n, num_heads, _ = q.shape
    block_size = index_cache.shape[1]
    needed = -(-max_context_len // block_size)
    per_block = max(batch * next_n * num_heads * block_size * 4, 1)
    chunk_blocks = max(1, min(needed, SCORE_CHUNK_BYTES // per_block))
    return _paged_logits_jit(q, index_cache, weights, context_lens, block_table,
                             max_context_len=max_context_len, chunk_blocks=chunk_blocks)


def fp8_paged_mqa_logits(
    q: jax.Array,
    index_cache: jax.Array,
    weights: jax.Array,
    context_lens: jax.Array,
    block_table: jax.Array,
    *,
    max_context_len: int,
    implementation: str = "auto",
) -> jax.Array:
    """Decode indexer scores of next_n query tokens per request against the request's cached keys.

    Args:
      q: [B, next_n, H, 128] float8_e4m3fn, H = 64 or 32 (the per-head scales are in weights).
      index_cache: uint8 [num_blocks, block_size, 132], written by indexer_k_quant_and_cache.
      weights: [B * next_n, H] float32, folded (fold_indexer_weights); row b * next_n + j.
      context_lens: [B] int32 full lengths L_b, this step's next_n tokens included.
      block_table: [B, W] int32 block ids; W * block_size must cover max_context_len.
      max_context_len: static Python int, the width of the result.
      implementation: "auto", "xla" (pure JAX) or "native".

    Returns:
      [B * next_n, max_context_len] float32: row b * next_n + j holds, for s < L_b - next_n + j + 1,
      k_scale[s] * sum_h weights[row, h] * relu(q[b, j, h] . k[s]), and -inf everywhere else (never
      uninitialised values; L_b <= 0 gives a row of -inf). Called eagerly, L_b > max_context_len is a
      ValueError; under `jax.jit` the row is cut at max_context_len.

    Block ids: the blocks a request reads, block_table[b, :ceil(L_b / block_size)] (L_b cut to
    [0, max_context_len]), must lie in [0, num_blocks); entries past them are never used and may hold
    anything. Called eagerly, an id outside the cache there is a ValueError naming block_table; under
    `jax.jit` (values unknown) it is never read outside the cache: pure JAX gives -inf at its
    block_size positions in every row of the request; the native kernels read the cache's last
    block in its place.

    Raises:
      TypeError: an argument that is not an array (None, a list, a scalar), a wrong dtype, or
        max_context_len that is not an int (a bool, float or string).
      ValueError: a wrong rank or shape, H not 32 or 64, next_n = 0, an index cache with no block
        or no token per block, max_context_len < 1 or more than W * block_size, and (eagerly) the
        value errors above. B = 0 requests are fine (an empty [0, max_context_len] result).
    """
    op = "fp8_paged_mqa_logits"
    q = v.as_array(f"{op}: q", q)
    index_cache = v.as_array(f"{op}: index_cache", index_cache)
    weights = v.as_array(f"{op}: weights", weights)
    context_lens = v.int32_array(f"{op}: context_lens", context_lens, 1)
    block_table = v.int32_array(f"{op}: block_table", block_table, 2)
    _check_query(op, q, 4)
    v.check_nonempty_axes(f"{op}: q", q, {1: "query token per request (next_n)"})
    _check_cache(f"{op}: index_cache", index_cache)
    batch, next_n, num_heads, _ = q.shape
    _check_f32(f"{op}: weights", weights, 2)
    v.check_shape(f"{op}: weights", weights, (batch * next_n, num_heads),
                  f"(B * next_n, H) for q of shape {tuple(q.shape)}")
    v.check_shape(f"{op}: context_lens", context_lens, (batch,), "(B,)")
    if block_table.shape[0] != batch:
        raise ValueError(f"{op}: block_table must have {batch} rows (B), got shape "
                         f"{tuple(block_table.shape)}.")
    max_context_len = v.check_static_size(f"{op}: max_context_len", max_context_len)
    num_blocks, block_size = index_cache.shape[:2]
    covered = block_table.shape[1] * block_size
    if max_context_len > covered:
        raise ValueError(
            f"{op}: max_context_len = {max_context_len} is more than block_table covers "
            f"({block_table.shape[1]} blocks x {block_size} = {covered}).")
    _check_lengths_within(op, context_lens, max_context_len, "max_context_len")
    lengths = v.host_values(context_lens)
    if lengths is not None:
        _check_block_ids(op, block_table, np.minimum(lengths, max_context_len), block_size, num_blocks,
                         "its context length in context_lens is")
    problem = registry.IndexerProblem(
        op, num_rows=batch * next_n, num_heads=num_heads, num_keys=max_context_len, batch=batch,
        next_n=next_n, block_size=block_size,
        dtypes=_dtype_names(q, index_cache, weights, context_lens, block_table))
    kernel = registry.select_op_kernel(op, implementation, problem)
    # No mask pass over a native kernel's output for ids outside the cache (they read the last block
    # in its place): an extra pass over [B * next_n, L] fp32 on every decode step would cost more
    # than a contract for invalid input is worth.
    return kernel.fn(q, index_cache, weights, context_lens, block_table,
                     max_context_len=max_context_len)


# --- prefill: ragged logits -----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("chunk_rows",))
def _mqa_logits_jit(q, k_fp8, k_scale, weights, row_starts, row_ends, *, chunk_rows):
    num_rows, num_heads, _ = q.shape
    num_keys = k_fp8.shape[0]
    if num_rows == 0 or num_keys == 0:
        return jnp.full((num_rows, num_keys), -jnp.inf, jnp.float32)
    keys = k_fp8.astype(_DOT_DTYPE)
    num_chunks = -(-num_rows // chunk_rows)
    pad = num_chunks * chunk_rows - num_rows
    q = jnp.pad(q.astype(_DOT_DTYPE), ((0, pad), (0, 0), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))

    def scores(chunk):  # q [rows, H, 128], weights [rows, H] -> [rows, N]
        q_chunk, w_chunk = chunk
        dots = jnp.einsum("mhd,nd->mhn", q_chunk, keys, preferred_element_type=jnp.float32)
        return _sum_relu_heads(dots, w_chunk[..., None], 1) * k_scale[None, :]

    if num_chunks == 1:
        out = scores((q, weights))
    else:
        out = jax.lax.map(scores, (q.reshape(num_chunks, chunk_rows, num_heads, _D),
                                   weights.reshape(num_chunks, chunk_rows, num_heads)))
        out = out.reshape(-1, num_keys)
    position = jnp.arange(num_keys, dtype=jnp.int32)[None, :]
    valid = (position >= row_starts[:, None]) & (position < row_ends[:, None])
    return jnp.where(valid, out[:num_rows], -jnp.inf)


def _mqa_logits_xla(q, k_fp8, k_scale, weights, row_starts, row_ends):
    num_rows, num_heads, _ = q.shape
    per_row = max(num_heads * k_fp8.shape[0] * 4, 1)
    chunk_rows = max(1, min(num_rows, SCORE_CHUNK_BYTES // per_row))
    return _mqa_logits_jit(q, k_fp8, k_scale, weights, row_starts, row_ends, chunk_rows=chunk_rows)


def _check_lengths_within(op: str, context_lens, limit: int, limit_name: str) -> None:
    """Eager calls: every context length fits `limit` (under jit the values are unknown; the ops
    then cut ranges to the width)."""
    lengths = v.host_values(context_lens)
    if lengths is not None and lengths.size and lengths.max() > limit:
        b = int(lengths.argmax())
        raise ValueError(f"{op}: context_lens[{b}] = {int(lengths[b])} exceeds {limit_name} = {limit}.")


def _check_row_range(op: str, row_starts, row_ends, width: int, width_name: str) -> None:
    """Eager calls only: starts >= 0 and ends <= the width (start >= end is an empty row)."""
    starts, ends = v.host_values(row_starts), v.host_values(row_ends)
    if starts is not None and starts.size and starts.min() < 0:
        i = int(starts.argmin())
        raise ValueError(f"{op}: row_starts[{i}] = {int(starts[i])} is negative.")
    if ends is not None and ends.size and ends.max() > width:
        i = int(ends.argmax())
        raise ValueError(f"{op}: row_ends[{i}] = {int(ends[i])} exceeds {width_name} = {width}.")


def fp8_mqa_logits(
    q: jax.Array,
    k_fp8: jax.Array,
    k_scale: jax.Array,
    weights: jax.Array,
    row_starts: jax.Array,
    row_ends: jax.Array,
    *,
    implementation: str = "auto",
) -> jax.Array:
    """Prefill indexer scores of M query tokens against a gathered key buffer, one key range per row.

    Args:
      q: [M, H, 128] float8_e4m3fn, H = 64 or 32.
      k_fp8: [N, 128] float8_e4m3fn and k_scale: [N] float32, e.g. from cp_gather_indexer_k_quant_cache.
      weights: [M, H] float32, folded (fold_indexer_weights).
      row_starts, row_ends: [M] int32: row i sees keys [row_starts[i], row_ends[i]) (empty when
        row_ends[i] <= row_starts[i]).
      implementation: "auto", "xla" (pure JAX) or "native".

    Returns:
      [M, N] float32: k_scale[s] * sum_h weights[i, h] * relu(q[i, h] . k[s]) inside each row's range,
      -inf outside it. Called eagerly, row_starts < 0 or row_ends > N is a ValueError; under
      `jax.jit` the range is cut to [0, N). M = 0 rows or N = 0 keys give the empty [M, N] result.

    Raises:
      TypeError: an argument that is not an array (None, a list, a scalar) or of the wrong dtype.
      ValueError: a wrong rank or shape, H not 32 or 64, and (eagerly) the range errors above.
    """
    op = "fp8_mqa_logits"
    q = v.as_array(f"{op}: q", q)
    k_fp8 = v.as_array(f"{op}: k_fp8", k_fp8)
    k_scale = v.as_array(f"{op}: k_scale", k_scale)
    weights = v.as_array(f"{op}: weights", weights)
    row_starts = v.int32_array(f"{op}: row_starts", row_starts, 1)
    row_ends = v.int32_array(f"{op}: row_ends", row_ends, 1)
    _check_query(op, q, 3)
    num_rows, num_heads, _ = q.shape
    v.check_rank(f"{op}: k_fp8", k_fp8, 2)
    v.check_dtype(f"{op}: k_fp8", k_fp8, (jnp.float8_e4m3fn,))
    v.check_last_dim(f"{op}: k_fp8", k_fp8, _D)
    num_keys = k_fp8.shape[0]
    _check_f32(f"{op}: k_scale", k_scale, 1)
    v.check_shape(f"{op}: k_scale", k_scale, (num_keys,), "(one scale per key of k_fp8)")
    _check_f32(f"{op}: weights", weights, 2)
    v.check_shape(f"{op}: weights", weights, (num_rows, num_heads),
                  f"(M, H) for q of shape {tuple(q.shape)}")
    v.check_shape(f"{op}: row_starts", row_starts, (num_rows,), "(M,)")
    v.check_shape(f"{op}: row_ends", row_ends, (num_rows,), "(M,)")
    _check_row_range(op, row_starts, row_ends, num_keys, "the number of keys N")
    problem = registry.IndexerProblem(
        op, num_rows=num_rows, num_heads=num_heads, num_keys=num_keys,
        dtypes=_dtype_names(q, k_fp8, k_scale, weights, row_starts, row_ends))
    kernel = registry.select_op_kernel(op, implementation, problem)
    return kernel.fn(q, k_fp8, k_scale, weights, row_starts, row_ends)


# --- top-k ----------------------------------------------------------------------------------------------

def _order_keys(logits: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the top-k order: NaN -> 1, every number above it in numeric order
    (-inf -> 0x007FFFFF ... +inf -> 0xFF800000), -0.0 equal to +0.0; 0 is left for "not in the row".

    Integer operations only: XLA on CPU treats subnormal floats as zero in comparisons.
    """
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(logits, u32)
    sign = u32(0x80000000)
    bits = jnp.where(bits == sign, u32(0), bits)
    key = jnp.where((bits & sign) != 0, ~bits, bits | sign)
    return jnp.where((bits & u32(0x7FFFFFFF)) > u32(0x7F800000), u32(1), key)


@functools.partial(jax.jit, static_argnames=("k",))
def _top_k_rows(logits, starts, ends, *, k):
    """The k best positions of logits[r, starts[r]:ends[r]], relative to starts[r], ascending, -1-padded.

    One `jax.lax.top_k` over int32 keys that order as `_order_keys` does (positions outside the row
    get the smallest key), then a sort of the k chosen positions. The tie rule needs no extra pass:
    lax.top_k's contract is that of equal elements the lower index comes first, on every backend, so
    its k results are the k best keys with ties to the lower position; a row of fewer than k
    positions has its out-of-row fillers, which rank last, masked to -1.
    """
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return jnp.full((num_rows, k), -1, jnp.int32)
    starts = jnp.clip(starts, 0, width)
    ends = jnp.clip(ends, starts, width)
    position = jnp.arange(width, dtype=jnp.int32)[None, :]
    in_row = (position >= starts[:, None]) & (position < ends[:, None])
    # uint32 key (0 = outside the row) -> int32 of the same order: flip the sign bit.
    key = jnp.where(in_row, _order_keys(logits), jnp.uint32(0)) ^ jnp.uint32(0x80000000)
    key = jax.lax.bitcast_convert_type(key, jnp.int32)
    outside = jnp.iinfo(jnp.int32).min
    if width < k:
        key = jnp.pad(key, ((0, 0), (0, k - width)), constant_values=outside)
    best, chosen = jax.lax.top_k(key, k)
    # Relative positions in ascending order; fillers sort last as `width` and become -1. The
    # positions are distinct and the fillers interchangeable, so an unstable sort gives the same
    # array (and XLA need not add an iota operand to make the sort stable).
    chosen = jnp.sort(jnp.where(best == outside, width, chosen - starts[:, None]), axis=1,
                      stable=False)
    return jnp.where(chosen >= width, -1, chosen)


@functools.partial(jax.jit, static_argnames=("next_n", "k"))
def _top_k_decode_xla(logits, context_lens, *, next_n, k):
    ends = context_lens[:, None] - next_n + 1 + jnp.arange(next_n, dtype=jnp.int32)
    ends = ends.reshape(-1)
    return _top_k_rows(logits, jnp.zeros_like(ends), ends, k=k)


def top_k_per_row(
    logits: jax.Array,
    row_starts: jax.Array,
    row_ends: jax.Array,
    *,
    k: int = 2048,
    implementation: str = "auto",
) -> jax.Array:
    """Top-k positions of each row over its range [row_starts[r], row_ends[r]) (the prefill top-k).

    Args:
      logits: [R, S] float32.
      row_starts, row_ends: [R] int32; a row with row_ends <= row_starts is empty.
      k: static Python int, the output width (2048 for DeepSeek-V3.2).
      implementation: "auto", "xla" (pure JAX) or "native".

    Returns:
      [R, k] int32 positions relative to row_starts[r] (request-local when the row covers one request's
      keys), -1 where there is none. Called eagerly, row_starts < 0 or row_ends > S is a ValueError;
      under `jax.jit` the range is cut to [0, S). R = 0 rows give an empty [0, k] result and S = 0
      columns rows of -1, on every path.

    Raises:
      TypeError: an argument that is not an array or of the wrong dtype, k not an int (a bool, float
        or string).
      ValueError: a wrong rank or shape, k < 1 or k >= 2^31, and (eagerly) the range errors above.

    The selection: the k largest of the row's values, where NaN ranks below every number (-inf
    included: -inf entries inside the range are candidates, as in vLLM, whose rows of at most k
    positions return every position whatever its value), -0.0 equals +0.0, and of equal values the
    lower position wins. A row with at most k positions in range returns all of them.

    The order (the same on every path; a native kernel must return the identical array): the chosen
    positions in ascending order, then -1 up to k. That is what vLLM returns for short rows
    (0, 1, ..., len - 1), needs no sort of the selection, and keeps sparse MLA's gather of the selected
    keys in address order.
    """
    op = "top_k_per_row"
    logits = v.as_array(f"{op}: logits", logits)
    row_starts = v.int32_array(f"{op}: row_starts", row_starts, 1)
    row_ends = v.int32_array(f"{op}: row_ends", row_ends, 1)
    _check_f32(f"{op}: logits", logits, 2)
    num_rows, width = logits.shape
    v.check_shape(f"{op}: row_starts", row_starts, (num_rows,), "(one per logits row)")
    v.check_shape(f"{op}: row_ends", row_ends, (num_rows,), "(one per logits row)")
    k = v.check_static_size(f"{op}: k", k)
    _check_row_range(op, row_starts, row_ends, width, "the logits width S")
    problem = registry.IndexerProblem(op, num_rows=num_rows, num_keys=width, top_k=k,
                                      dtypes=_dtype_names(logits, row_starts, row_ends))
    kernel = registry.select_op_kernel(op, implementation, problem)
    return kernel.fn(logits, row_starts, row_ends, k=k)


def top_k_per_row_decode(
    logits: jax.Array,
    context_lens: jax.Array,
    *,
    next_n: int = 1,
    k: int = 2048,
    implementation: str = "auto",
) -> jax.Array:
    """Top-k positions of each decode row: row b * next_n + j ranges over [0, L_b - next_n + j + 1).

    Args:
      logits: [B * next_n, S] float32 (fp8_paged_mqa_logits' output).
      context_lens: [B] int32 full lengths L_b, this step's tokens included; a row whose range is
        empty (L_b <= 0 for padding requests) gives -1 only.
      next_n: static Python int, query tokens per request.
      k: static Python int, the output width.
      implementation: "auto", "xla" (pure JAX) or "native".

    Returns:
      [B * next_n, k] int32 positions (request-local), -1 where there is none, chosen and ordered by
      top_k_per_row's rules (NaN below every number, ties to the lower position, ascending positions
      then -1). Called eagerly, L_b > S is a ValueError; under `jax.jit` the range is cut at S. B = 0
      requests give an empty [0, k] result and S = 0 columns rows of -1, on every path.

    Raises:
      TypeError: an argument that is not an array or of the wrong dtype, next_n or k not an int.
      ValueError: a wrong rank or shape (logits must have B * next_n rows), next_n or k below 1 (or
        2^31 and above), and (eagerly) L_b > S.
    """
    op = "top_k_per_row_decode"
    logits = v.as_array(f"{op}: logits", logits)
    context_lens = v.int32_array(f"{op}: context_lens", context_lens, 1)
    _check_f32(f"{op}: logits", logits, 2)
    next_n = v.check_static_size(f"{op}: next_n", next_n)
    k = v.check_static_size(f"{op}: k", k)
    num_rows, width = logits.shape
    batch = context_lens.shape[0]
    if num_rows != batch * next_n:
        raise ValueError(
            f"{op}: logits must have B * next_n = {batch} * {next_n} = {batch * next_n} rows for "
            f"context_lens of shape {tuple(context_lens.shape)}, got shape {tuple(logits.shape)}.")
    _check_lengths_within(op, context_lens, width, "the logits width S")
    problem = registry.IndexerProblem(op, num_rows=num_rows, num_keys=width, batch=batch,
                                      next_n=next_n, top_k=k,
                                      dtypes=_dtype_names(logits, context_lens))
    kernel = registry.select_op_kernel(op, implementation, problem)
    return kernel.fn(logits, context_lens, next_n=next_n, k=k)


for _op, _fn in (("fp8_paged_mqa_logits", _paged_logits_xla), ("fp8_mqa_logits", _mqa_logits_xla),
                 ("top_k_per_row", _top_k_rows), ("top_k_per_row_decode", _top_k_decode_xla)):
    registry.register_op_kernel(registry.OpKernel(op=_op, name="xla", native=False,
                                                  capability_majors=(), fn=_fn))
