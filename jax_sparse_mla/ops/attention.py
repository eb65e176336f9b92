"""The public sparse-MLA decode op: argument checks, scale folding, kernel dispatch.

Each query token attends to its own list of K physical KV slots (DeepSeek-V3.2 DSA top-k). The math,
per token t and head h, over the valid slots j of row t:

    s_j      = bmm1_scale * <q[t, h, :576], kv[slot_j, :576]>        bmm1_scale = scale * q_scale * k_scale
    out[t,h] = bmm2_scale * sum_j softmax(s)_j * kv[slot_j, :512]   bmm2_scale = k_scale
    lse[t,h] = log(sum_j exp(s_j))                                   (base 2 on request)

which is what vLLM's FlashInfer sparse backend computes (the seed's bmm1/bmm2 scales).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import _validation as v
from ..kernels import registry
from .kv_cache import dequantize_ds_mla_rows

LSE_BASES = ("e", "2")
# The pure-JAX kernel gathers at most about _XLA_GATHER_ROWS cache rows (151 MB of bf16) per
# online-softmax step, in chunks of at least _XLA_MIN_CHUNK keys: small decode batches take all K keys
# in one step (a scan step costs several kernel launches), T=512 x K=2048 takes 8 steps of 256.
_XLA_GATHER_ROWS = 1 << 17
_XLA_MIN_CHUNK = 256


def _kv_layout(kv_cache, kv_cache_dtype: str) -> str:
    """Resolves kv_cache_dtype against the cache array: "bfloat16", "float16", "fp8_e4m3" or "fp8_ds_mla".

    Checks the cache's rank first: its error messages read kv_cache.shape[-1]."""
    v.check_str_option("kv_cache_dtype", kv_cache_dtype, v.KV_CACHE_DTYPES)
    v.check_rank("kv_cache", kv_cache, 3)
    dtype = jnp.dtype(kv_cache.dtype)
    if kv_cache_dtype == "auto":
        if dtype == jnp.bfloat16:
            kv_cache_dtype = "bfloat16"
        elif dtype == jnp.float16:
            kv_cache_dtype = "float16"
        elif v.is_fp8_e4m3(dtype):
            kv_cache_dtype = "fp8"
        elif dtype == jnp.uint8 and kv_cache.shape[-1] == v.DS_MLA_ROW_BYTES:
            kv_cache_dtype = "fp8_ds_mla"
        else:
            raise TypeError(
                f"kv_cache_dtype='auto' cannot infer the layout of kv_cache (dtype {dtype.name}, last "
                f"dimension {kv_cache.shape[-1]}): expected bfloat16, float16 or float8_e4m3fn with "
                f"last dimension {v.MLA_HEAD_DIM}, or uint8 with {v.DS_MLA_ROW_BYTES}; or pass "
                "kv_cache_dtype explicitly."
            )
    if kv_cache_dtype in ("bfloat16", "float16"):
        v.check_dtype("kv_cache", kv_cache, (kv_cache_dtype,))
        v.check_last_dim("kv_cache", kv_cache, v.MLA_HEAD_DIM)
        return kv_cache_dtype
    if kv_cache_dtype in v.FP8_PER_TENSOR_DTYPES:
        v.check_dtype("kv_cache", kv_cache, (jnp.float8_e4m3fn, jnp.uint8))
        v.check_last_dim("kv_cache", kv_cache, v.MLA_HEAD_DIM)
        return "fp8_e4m3"
    v.check_dtype("kv_cache", kv_cache, (jnp.uint8,))
    v.check_last_dim("kv_cache", kv_cache, v.DS_MLA_ROW_BYTES)
    return "fp8_ds_mla"


def _check_query(q, layout: str) -> None:
    v.check_rank("q", q, (3, 4))
    v.check_last_dim("q", q, v.MLA_HEAD_DIM)
    v.check_nonempty_axes("q", q, {q.ndim - 2: "head"})
    if layout in ("bfloat16", "float16"):
        allowed = (layout,)
    elif layout == "fp8_e4m3":
        allowed = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
    else:
        allowed = (jnp.bfloat16, jnp.float16)
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(q.dtype) not in allowed:
        # The query and the cache are a pair: say which cache fixed the query's dtype.
        raise TypeError(
            f"q must have dtype {', '.join(d.name for d in allowed)} to go with a {layout} kv_cache; "
            f"got {jnp.dtype(q.dtype).name}."
        )


def sparse_mla_decode(
    q: jax.Array,
    kv_cache: jax.Array,
    topk_indices: jax.Array,
    *,
    scale: float,
    valid_counts: jax.Array | None = None,
    kv_cache_dtype: str = "auto",
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    lse_base: str = "e",
    implementation: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Sparse MLA decode attention over per-token top-k KV slots.

    Args:
      q: [T, H, 576] (or [B, q_len, H, 576]) query after W_UK absorption: 512 latent + 64 RoPE.
        bf16 / f16, or float8_e4m3fn (raw fp8 values, dequantised as q * q_scale) with an fp8 cache.
      kv_cache: [num_blocks, block_size, 576] bf16 / f16, or float8_e4m3fn (uint8 view accepted) with
        per-tensor k_scale; or uint8 [num_blocks, block_size, 656] for kv_cache_dtype="fp8_ds_mla".
      topk_indices: [T, K] (or [B, q_len, K]) int32 physical slots, block * block_size + offset.
        Negative entries and entries >= num_blocks * block_size are invalid and never read; holes may
        sit anywhere in a row.
      scale: the model's softmax scale (DeepSeek-V3.2: 192**-0.5 * mscale**2), not 576**-0.5.
      valid_counts: optional [T] (or [B, q_len]) int32: row t uses only its first valid_counts[t]
        entries (FlashMLA's topk_length); invalid entries inside that prefix stay invalid.
      kv_cache_dtype: "auto" (inferred from the cache), "bfloat16", "float16", "fp8", "fp8_e4m3" or
        "fp8_ds_mla".
      q_scale: per-tensor scale of an fp8 query (must be 1.0 for a 16-bit query).
      k_scale: per-tensor scale of an fp8 / fp8_e4m3 cache (must be 1.0 otherwise; fp8_ds_mla rows
        carry their own tile scales).
      lse_base: "e" (natural log) or "2".
      implementation: "auto" (the validated native kernel for this GPU when there is one, unless it
        measured slower than pure JAX at this shape; else pure JAX), "xla" (pure JAX) or "native"
        (a native kernel, validated or not; error if none fits).

    Returns:
      out: [T, H, 512] (or [B, q_len, H, 512]), bf16 (f16 for an f16 query).
      lse: [T, H] (or [B, q_len, H]) float32. Rows without a valid index: out = 0, lse = -inf. A NaN or
        infinite query value makes its row non-finite (pure JAX and the SM90 fp8 kernel).
        T = 0 (an empty batch) gives empty outputs of these shapes and dtypes.

    Raises:
      TypeError for a non-array (None, list, scalar, string) where an array belongs, a wrong dtype, or a
        non-number / non-string option; ValueError for a wrong rank or size, zero heads, zero top-k
        width K, an empty cache (zero blocks or zero block size) or an out-of-range option.
    """
    q = v.as_array("q", q)
    kv_cache = v.as_array("kv_cache", kv_cache)
    topk_indices = v.as_array("topk_indices", topk_indices)
    v.check_str_option("lse_base", lse_base, LSE_BASES)
    v.check_str_option("implementation", implementation, registry.IMPLEMENTATIONS)
    layout = _kv_layout(kv_cache, kv_cache_dtype)
    _check_query(q, layout)
    v.check_nonempty_axes("kv_cache", kv_cache, {0: "block", 1: "slot per block"})
    leading = q.shape[:-2]
    v.check_int32("topk_indices", topk_indices)
    if topk_indices.ndim != len(leading) + 1 or topk_indices.shape[:-1] != leading:
        raise ValueError(
            f"topk_indices must have shape {(*leading, 'K')} to match q {tuple(q.shape)}, "
            f"got {tuple(topk_indices.shape)}."
        )
    v.check_nonempty_axes("topk_indices", topk_indices, {topk_indices.ndim - 1: "top-k entry"})
    if valid_counts is not None:
        valid_counts = v.as_array("valid_counts", valid_counts)
        v.check_int32("valid_counts", valid_counts)
        if tuple(valid_counts.shape) != tuple(leading):
            raise ValueError(
                f"valid_counts must have shape {tuple(leading)}, got {tuple(valid_counts.shape)}."
            )
    scale = v.check_finite_positive_float("scale", scale)
    q_scale = v.check_finite_positive_float("q_scale", q_scale)
    k_scale = v.check_finite_positive_float("k_scale", k_scale)
    if q_scale != 1.0 and not v.is_fp8_e4m3(q.dtype):
        raise ValueError(f"q_scale={q_scale} applies only to a float8_e4m3fn query; q is {q.dtype}.")
    if k_scale != 1.0 and layout != "fp8_e4m3":
        raise ValueError(
            f"k_scale={k_scale} applies only to an fp8 / fp8_e4m3 cache; this cache is {layout}."
        )
    problem = registry.Problem(
        num_tokens=math.prod(leading), num_heads=q.shape[-2], num_keys=topk_indices.shape[-1],
        block_size=kv_cache.shape[1], kv_layout=layout, q_dtype=jnp.dtype(q.dtype).name,
    )
    kernel = registry.select_kernel(layout, problem.q_dtype, implementation, problem)
    if problem.num_tokens == 0:  # an empty batch: nothing to read, on any kernel
        num_heads = q.shape[-2]
        return (jnp.zeros((*leading, num_heads, v.MLA_V_DIM), output_dtype(q.dtype)),
                jnp.zeros((*leading, num_heads), jnp.float32))
    return _decode(
        q, kv_cache, topk_indices, valid_counts,
        kernel=kernel, bmm1_scale=scale * q_scale * k_scale, bmm2_scale=k_scale, lse_base=lse_base,
    )


@functools.partial(jax.jit, static_argnames=("kernel", "bmm1_scale", "bmm2_scale", "lse_base"))
def _decode(q, kv_cache, topk_indices, valid_counts, *, kernel, bmm1_scale, bmm2_scale, lse_base):
    leading = q.shape[:-2]
    num_heads = q.shape[-2]
    q = q.reshape(-1, num_heads, v.MLA_HEAD_DIM)
    topk_indices = topk_indices.reshape(q.shape[0], topk_indices.shape[-1])
    if valid_counts is not None:
        valid_counts = valid_counts.reshape(-1)
    if kv_cache.dtype == jnp.uint8 and kv_cache.shape[-1] == v.MLA_HEAD_DIM:
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, jnp.float8_e4m3fn)
    out, lse = kernel.fn(
        q, kv_cache, topk_indices, valid_counts,
        bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, lse_base=lse_base,
    )
    return out.reshape(*leading, num_heads, v.MLA_V_DIM), lse.reshape(*leading, num_heads)


def output_dtype(q_dtype) -> jnp.dtype:
    """bf16 for bf16 and fp8 queries, f16 for f16 queries (FlashInfer's rule: out dtype = q dtype)."""
    return jnp.dtype(jnp.float16) if jnp.dtype(q_dtype) == jnp.float16 else jnp.dtype(jnp.bfloat16)


def _gather_rows(kv_rows: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gathers [T, C] slots (-1 = invalid) into (k [T, C, 576], valid [T, C]).

    k is in the dot-product dtype: bf16 / f16 for 16-bit and fp8 caches (fp8 -> bf16 is exact), float32
    for fp8_ds_mla (fp8 times an fp32 tile scale). Invalid rows are zeroed so that whatever sits at
    the clamped gather address (NaN included) never reaches the result.
    """
    valid = slots >= 0
    rows = kv_rows[jnp.maximum(slots, 0)]
    if rows.dtype == jnp.uint8:
        rows = dequantize_ds_mla_rows(rows)
    elif v.is_fp8_e4m3(rows.dtype):
        rows = rows.astype(jnp.bfloat16)
    return jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype)), valid


def _xla_kernel(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base):
    """Pure-JAX kernel: chunked gather + online softmax (the contract is in kernels/registry.py)."""
    num_tokens, num_heads, _ = q.shape
    out_dtype = output_dtype(q.dtype)
    if num_tokens == 0:
        return (jnp.zeros((0, num_heads, v.MLA_V_DIM), out_dtype),
                jnp.zeros((0, num_heads), jnp.float32))
    kv_rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    indices = registry.sanitize_indices(indices, kv_rows.shape[0], valid_counts)
    compute_dtype = jnp.float32 if kv_rows.dtype == jnp.uint8 else (
        jnp.float16 if q.dtype == jnp.float16 else jnp.bfloat16)
    q = q.astype(compute_dtype)  # fp8 -> bf16 is exact; q_scale lives in bmm1_scale
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    num_keys = indices.shape[1]
    chunk = min(max(_XLA_GATHER_ROWS // num_tokens, _XLA_MIN_CHUNK), max(num_keys, 1))
    num_chunks = -(-num_keys // chunk)
    padded = jnp.pad(indices, ((0, 0), (0, num_chunks * chunk - num_keys)), constant_values=-1)
    chunks = padded.reshape(num_tokens, num_chunks, chunk).transpose(1, 0, 2)

    def step(carry, slots):
        running_max, denom, acc = carry
        keys, valid = _gather_rows(kv_rows, slots)
        scores = jnp.einsum("thd,tcd->thc", q, keys, preferred_element_type=jnp.float32,
                            precision=precision) * bmm1_scale
        scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        # A row that has seen no valid key keeps max = -inf; shift by 0 there to avoid inf - inf.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        correction = jnp.exp(running_max - shift)
        probs = jnp.exp(scores - shift[..., None])
        denom = denom * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "thc,tcd->thd", probs.astype(compute_dtype), keys[..., : v.MLA_V_DIM],
            preferred_element_type=jnp.float32, precision=precision)
        return (new_max, denom, acc), None

    init = (jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_heads), jnp.float32),
            jnp.zeros((num_tokens, num_heads, v.MLA_V_DIM), jnp.float32))
    # The first chunk runs outside the scan: its carry then varies over the same shard_map axes as the
    # body's output (a scan under shard_map(check_vma=True) rejects a constant initial carry), and a
    # single-chunk call needs no scan at all.
    carry, _ = step(init, chunks[0])
    if num_chunks > 1:
        carry, _ = jax.lax.scan(step, carry, chunks[1:])
    running_max, denom, acc = carry
    # denom is 0 exactly when no valid key contributed; a NaN (a NaN or infinite query) stays NaN in
    # out and lse instead of reading as an empty row.
    has_keys = denom != 0
    out = jnp.where(has_keys[..., None], acc / jnp.where(has_keys, denom, 1.0)[..., None], 0.0)
    lse = jnp.where(has_keys, jnp.log(jnp.where(has_keys, denom, 1.0)) + running_max, -jnp.inf)
    if lse_base == "2":
        lse = lse / math.log(2.0)
    return (out * bmm2_scale).astype(out_dtype), lse


registry.register_kernel(registry.SparseMLAKernel(
    name="xla",
    native=False,
    capability_majors=(),
    kv_layouts=("bfloat16", "float16", "fp8_e4m3", "fp8_ds_mla"),
    q_dtypes=("bfloat16", "float16", "float8_e4m3fn"),
    fn=_xla_kernel,
))
