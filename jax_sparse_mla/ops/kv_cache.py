"""Paged MLA KV-cache writers and fp8 (de)quantisation, as vLLM's cache kernels define them.

A cache row is cat(kv_c [512], k_pe [64]) = 576 values, stored
  - as is for bf16 / f16 caches;
  - as e4m3(x / k_scale) for fp8 / fp8_e4m3 caches (per-tensor scale, round to nearest even, saturating);
  - packed in 656 bytes for fp8_ds_mla: 512 e4m3 values of kv_c / tile_scale (4 tiles of 128),
    4 float32 tile scales max(amax(|tile|) / 448, FLT_MIN), then k_pe as 64 bf16 (not quantised).

The writers are functional: they return the new cache. Under `jax.jit(..., donate_argnums=...)` XLA
updates the donated cache in place. Slots < 0 (vLLM's padding) are skipped; so are slots past the end of
the cache, which vLLM would write out of bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as v

FP8_E4M3_MAX = 448.0
_FLT_MIN = float(np.finfo(np.float32).tiny)
_TILE = 128
_NUM_TILES = v.MLA_V_DIM // _TILE


def _to_e4m3(values: jax.Array) -> jax.Array:
    """float32 -> float8_e4m3fn, saturating (a plain cast turns out-of-range values into NaN)."""
    return jnp.clip(values, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)


def _divide(values: jax.Array, divisor: jax.Array) -> jax.Array:
    """values / divisor rounded as IEEE division, like vLLM's kernels.

    XLA rewrites a division by a broadcast scalar into a multiplication by its reciprocal, which is off
    by one ulp often enough to flip fp8 roundings; the barrier keeps the broadcast a real operand.
    """
    return values / jax.lax.optimization_barrier(jnp.broadcast_to(divisor, values.shape))


def quantize_query_fp8(q: jax.Array, q_scale: float) -> jax.Array:
    """Static per-tensor fp8 query quantisation: e4m3(clamp(q * (1 / q_scale), -448, 448)).

    q: [..., 576] bf16 / f16 / f32 (the absorbed MLA query that sparse_mla_decode takes; leading axes
      may be empty). q_scale: a finite positive static number (not a bool, string or traced value).
    Returns float8_e4m3fn of the same shape; dequantise as q8 * q_scale.
    """
    q = v.as_array("q", q)
    v.check_dtype("q", q, (jnp.bfloat16, jnp.float16, jnp.float32))
    v.check_min_rank("q", q, 1)
    v.check_last_dim("q", q, v.MLA_HEAD_DIM)
    q_scale = v.check_finite_positive_float("q_scale", q_scale)
    return _to_e4m3(q.astype(jnp.float32) * (1.0 / q_scale))


def dequantize_ds_mla_rows(rows: jax.Array) -> jax.Array:
    """Unpacks fp8_ds_mla rows: uint8 [..., 656] -> float32 [..., 576] (kv_c * tile scale, then k_pe)."""
    lead = rows.shape[:-1]
    nope = jax.lax.bitcast_convert_type(rows[..., : v.MLA_V_DIM], jnp.float8_e4m3fn)
    scale_bytes = rows[..., v.MLA_V_DIM: v.MLA_V_DIM + 4 * _NUM_TILES].reshape(*lead, _NUM_TILES, 4)
    scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
    rope_bytes = rows[..., v.MLA_V_DIM + 4 * _NUM_TILES:].reshape(*lead, v.MLA_ROPE_DIM, 2)
    rope = jax.lax.bitcast_convert_type(rope_bytes, jnp.bfloat16).astype(jnp.float32)
    kv_c = nope.astype(jnp.float32).reshape(*lead, _NUM_TILES, _TILE) * scales[..., None]
    return jnp.concatenate([kv_c.reshape(*lead, v.MLA_V_DIM), rope], axis=-1)


def pack_ds_mla_rows(kv_c: jax.Array, k_pe: jax.Array) -> jax.Array:
    """Packs kv_c [T, 512] and k_pe [T, 64] (bf16) into fp8_ds_mla rows uint8 [T, 656]."""
    tiles = kv_c.astype(jnp.float32).reshape(-1, _NUM_TILES, _TILE)
    scales = jnp.maximum(_divide(jnp.abs(tiles).max(axis=-1), jnp.float32(FP8_E4M3_MAX)), _FLT_MIN)
    nope = _to_e4m3(_divide(tiles, scales[..., None])).reshape(-1, v.MLA_V_DIM)
    as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)
    return jnp.concatenate([as_bytes(nope), as_bytes(scales), as_bytes(k_pe.astype(jnp.bfloat16))],
                           axis=-1)


def _check_writer_inputs(kv_c, k_pe, kv_cache, slot_mapping, input_dtypes):
    kv_c, k_pe = v.as_array("kv_c", kv_c), v.as_array("k_pe", k_pe)
    kv_cache, slot_mapping = v.as_array("kv_cache", kv_cache), v.as_array("slot_mapping", slot_mapping)
    v.check_rank("kv_c", kv_c, 2)
    v.check_last_dim("kv_c", kv_c, v.MLA_V_DIM)
    v.check_dtype("kv_c", kv_c, input_dtypes)
    if k_pe.ndim == 3 and k_pe.shape[1] == 1:  # vLLM passes k_pe as [T, 1, 64]
        k_pe = k_pe[:, 0]
    v.check_rank("k_pe", k_pe, 2)
    v.check_last_dim("k_pe", k_pe, v.MLA_ROPE_DIM)
    if jnp.dtype(k_pe.dtype) != jnp.dtype(kv_c.dtype):
        raise TypeError(f"k_pe must have dtype {jnp.dtype(kv_c.dtype).name} to match kv_c; got "
                        f"{jnp.dtype(k_pe.dtype).name}.")
    v.check_rank("kv_cache", kv_cache, 3)
    v.check_nonempty_axes("kv_cache", kv_cache, {0: "block", 1: "slot per block"})
    v.check_rank("slot_mapping", slot_mapping, 1)
    v.check_dtype("slot_mapping", slot_mapping, (jnp.int32, jnp.int64))
    if not (kv_c.shape[0] == k_pe.shape[0] == slot_mapping.shape[0]):
        raise ValueError(
            f"kv_c, k_pe and slot_mapping must have the same number of tokens, got "
            f"{kv_c.shape[0]}, {k_pe.shape[0]} and {slot_mapping.shape[0]}."
        )
    return kv_c, k_pe, kv_cache, slot_mapping


def scatter_rows(kv_cache: jax.Array, slot_mapping: jax.Array, rows: jax.Array) -> jax.Array:
    """Writes rows [T, D] into a paged cache [num_blocks, block_size, D] at slot_mapping [T].

    Negative and past-the-end slots are dropped, never wrapped. Also writes the indexer's key cache.
    """
    num_blocks, block_size, row_width = kv_cache.shape
    num_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = kv_cache.reshape(num_slots, row_width).at[slots].set(rows, mode="drop")
    return flat.reshape(kv_cache.shape)


@jax.jit
def _write_ds_mla(kv_c, k_pe, kv_cache, slot_mapping):
    return scatter_rows(kv_cache, slot_mapping, pack_ds_mla_rows(kv_c, k_pe))


def concat_and_cache_ds_mla(
    kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Writes this step's latent KV into an fp8_ds_mla cache and returns the new cache.

    kv_c: [T, 512] bf16; k_pe: [T, 64] (or [T, 1, 64]) bf16; kv_cache: [num_blocks, block_size, 656]
    uint8; slot_mapping: [T] int32/int64 (block * block_size + offset; < 0 and past-the-end slots
    skipped). T = 0 returns the cache unchanged; a cache with zero blocks or zero block size is a
    ValueError.
    """
    kv_c, k_pe, kv_cache, slot_mapping = _check_writer_inputs(
        kv_c, k_pe, kv_cache, slot_mapping, (jnp.bfloat16,))
    v.check_dtype("kv_cache", kv_cache, (jnp.uint8,))
    v.check_last_dim("kv_cache", kv_cache, v.DS_MLA_ROW_BYTES)
    if kv_c.shape[0] == 0:  # an empty batch writes nothing (the packer cannot reshape 0 rows)
        return jnp.asarray(kv_cache)
    return _write_ds_mla(kv_c, k_pe, kv_cache, slot_mapping)


@jax.jit
def _write_mla(kv_c, k_pe, kv_cache, slot_mapping, k_scale):
    rows = jnp.concatenate([kv_c, k_pe], axis=-1)
    if kv_cache.dtype == jnp.uint8:
        rows = jax.lax.bitcast_convert_type(_to_e4m3(_divide(rows.astype(jnp.float32), k_scale)),
                                            jnp.uint8)
    elif v.is_fp8_e4m3(kv_cache.dtype):
        rows = _to_e4m3(_divide(rows.astype(jnp.float32), k_scale))
    return scatter_rows(kv_cache, slot_mapping, rows.astype(kv_cache.dtype))


def concat_and_cache_mla(
    kv_c: jax.Array,
    k_pe: jax.Array,
    kv_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
) -> jax.Array:
    """Writes this step's latent KV rows cat(kv_c, k_pe) into the paged cache; returns the new cache.

    kv_c: [T, 512] and k_pe: [T, 64] (or [T, 1, 64]), both bf16 or both f16.
    kv_cache: [num_blocks, block_size, 576]: the inputs' dtype for kv_cache_dtype "auto" / "bfloat16" /
      "float16"; float8_e4m3fn (or its uint8 view) for "fp8" / "fp8_e4m3", storing e4m3(x / k_scale).
      [num_blocks, block_size, 656] uint8 for "fp8_ds_mla" (same as concat_and_cache_ds_mla).
    slot_mapping: [T] int32/int64 physical slots; slots < 0 (and past the end) are skipped.
    kv_cache_dtype: "auto", "bfloat16", "float16", "fp8", "fp8_e4m3" or "fp8_ds_mla" (a str).
    k_scale: a finite positive static number; other than 1.0 only for "fp8" / "fp8_e4m3".
    T = 0 returns the cache unchanged; a cache with zero blocks or zero block size is a ValueError.
    """
    v.check_str_option("kv_cache_dtype", kv_cache_dtype, v.KV_CACHE_DTYPES)
    k_scale = v.check_finite_positive_float("k_scale", k_scale)
    if kv_cache_dtype == "fp8_ds_mla":
        if k_scale != 1.0:
            raise ValueError("k_scale is not used by fp8_ds_mla caches (rows carry tile scales).")
        return concat_and_cache_ds_mla(kv_c, k_pe, kv_cache, slot_mapping)
    kv_c, k_pe, kv_cache, slot_mapping = _check_writer_inputs(
        kv_c, k_pe, kv_cache, slot_mapping, (jnp.bfloat16, jnp.float16))
    v.check_last_dim("kv_cache", kv_cache, v.MLA_HEAD_DIM)
    if kv_cache_dtype in v.FP8_PER_TENSOR_DTYPES:
        v.check_dtype("kv_cache", kv_cache, (jnp.float8_e4m3fn, jnp.uint8))
    else:
        expected = kv_c.dtype if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)
        v.check_dtype("kv_cache", kv_cache, (expected,))
        if k_scale != 1.0:
            raise ValueError(f"k_scale={k_scale} applies only to fp8 caches.")
        if jnp.dtype(kv_c.dtype) != jnp.dtype(kv_cache.dtype):
            raise TypeError(f"kv_c is {kv_c.dtype} but the {kv_cache_dtype} cache is {kv_cache.dtype}.")
    return _write_mla(kv_c, k_pe, kv_cache, slot_mapping, jnp.float32(k_scale))
