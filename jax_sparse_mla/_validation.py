"""Argument checks shared by every public function (pure-JAX and native paths alike).

All checks run at trace time on static shapes and dtypes, so they cost nothing under `jax.jit`.
User errors raise `TypeError` (wrong dtype) or `ValueError` (wrong rank, shape or value).
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

MLA_HEAD_DIM = 576  # kv_lora_rank (512) + qk_rope_head_dim (64)
MLA_V_DIM = 512  # the latent part of a row; attention's V
MLA_ROPE_DIM = 64
DS_MLA_ROW_BYTES = 656  # fp8_ds_mla: 512 e4m3 + 4 fp32 tile scales + 64 bf16 RoPE

# The lightning indexer (DeepSeek-V3.2 DSA): one 128-wide key head, 64 (or 32) query heads, and vLLM's
# index-cache record of 128 e4m3 values + one fp32 scale per token.
INDEXER_HEAD_DIM = 128
INDEXER_CACHE_ROW_BYTES = INDEXER_HEAD_DIM + 4
INDEXER_NUM_HEADS = (32, 64)

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_ds_mla")
FP8_PER_TENSOR_DTYPES = ("fp8", "fp8_e4m3")


def as_array(name: str, value) -> jnp.ndarray:
    """Returns `value` as an array, with a clear error for things that are not arrays."""
    if isinstance(value, (list, tuple)) or value is None:
        raise TypeError(f"{name} must be an array, got {type(value).__name__}.")
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        value = np.asarray(value)
    return value


def check_rank(name: str, array, ranks: int | Iterable[int]) -> None:
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if array.ndim not in allowed:
        want = " or ".join(str(r) for r in allowed)
        raise ValueError(f"{name} must have rank {want}, got shape {tuple(array.shape)}.")


def check_dtype(name: str, array, dtypes: Iterable) -> None:
    allowed = tuple(jnp.dtype(d) for d in dtypes)
    if jnp.dtype(array.dtype) not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{name} must have dtype {names}; got {jnp.dtype(array.dtype).name}.")


def check_int32(name: str, array) -> None:
    check_dtype(name, array, (jnp.int32,))


def int32_array(name: str, value, rank: int):
    """`value` as an array, checked to be int32 of the given rank."""
    array = as_array(name, value)
    check_int32(name, array)
    check_rank(name, array, rank)
    return array


def check_last_dim(name: str, array, size: int) -> None:
    if array.shape[-1] != size:
        raise ValueError(
            f"{name} must have last dimension {size}, got shape {tuple(array.shape)}."
        )


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}."
        )


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def check_finite_positive_float(name: str, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}.") from None
    if not np.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite positive float, got {value!r}.")
    return value


def is_fp8_e4m3(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def check_shape(name: str, array, shape: tuple, why: str = "") -> None:
    """array.shape must equal `shape`; `why` says what the shape follows from ("to match q ...")."""
    if tuple(array.shape) != tuple(shape):
        why = f" {why}" if why else ""
        raise ValueError(f"{name} must have shape {tuple(shape)}{why}, got {tuple(array.shape)}.")


def check_int_dtype(name: str, array) -> None:
    """int32, or int64 (vLLM's slot mappings; JAX without x64 stores them as int32)."""
    check_dtype(name, array, (jnp.int32, jnp.int64))


def host_values(array) -> np.ndarray | None:
    """The values of `array` when they are known at trace time (a concrete array), else None (a tracer).

    Lets an op check lengths against static sizes with a clear error when it is called eagerly; under
    `jax.jit` the values are unknown and the op's documented clamping applies instead.
    """
    try:
        return np.asarray(array)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None
