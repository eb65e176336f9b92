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
    """Returns `value` as an array, with a clear error for things that are not arrays (None, lists,
    tuples, strings, Python scalars: a scalar where an array belongs is a mistake, not a 0-d array)."""
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}: {_short(value)}.")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """`value` as a Python int: an int or NumPy integer (never a bool, float or string), at least
    `minimum` when given (check_static_size's rules, without its int32 bound)."""
    return check_static_size(name, value, minimum=minimum, maximum=None)


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def check_bool(name: str, value) -> bool:
    """A flag must be a bool (True / False, or a NumPy bool): "False" or 0 are mistakes."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {_short(value)}.")
    return bool(value)


def check_number(name: str, value) -> float:
    """A static real number, returned as a float: a Python or NumPy int or float, or a concrete 0-d
    array of a real dtype; never a bool, a string or a traced value (the ops fold these into their
    kernels at trace time)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python float, got a bool: {value!r}.")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    dtype = getattr(value, "dtype", None)
    if (getattr(value, "shape", None) == () and dtype is not None
            and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))):
        concrete = host_values(value)
        if concrete is None:
            raise TypeError(f"{name} must be a static Python float, got a traced array: it is "
                            "folded into the kernel at trace time.")
        return float(concrete)
    raise TypeError(f"{name} must be a Python float, got {type(value).__name__}: {_short(value)}.")


def check_finite_positive_float(name: str, value) -> float:
    value = check_number(name, value)
    if not np.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite positive float, got {value!r}.")
    return value


def check_nonempty_axes(name: str, array, axes: dict[int, str]) -> None:
    """Each axis of `array` named in `axes` ({axis: what it counts}) must not be zero-sized."""
    for axis, what in axes.items():
        if array.shape[axis] == 0:
            raise ValueError(f"{name} must have at least one {what} (axis {axis}), got shape "
                             f"{tuple(array.shape)}.")


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


def check_rows_cover(name: str, array, count: int, what: str) -> None:
    """array's leading axis must hold at least `count` rows, one per `what` (a padded batch may
    hold more rows than it uses, never fewer)."""
    if array.shape[0] < count:
        raise ValueError(f"{name} has {array.shape[0]} rows for {count} {what}, got shape "
                         f"{tuple(array.shape)}: a padded batch may have more rows, never fewer.")


def check_values_at_most(name: str, array, bound: int, bound_name: str) -> None:
    """Every value of `array` must be <= `bound` (a static bound such as max_seq_len) when the values
    are concrete (an eager call); traced values are not checked (host_values' rule)."""
    values = host_values(array)
    if values is not None and values.size and values.max() > bound:
        raise ValueError(f"{name} holds {int(values.max())}, past {bound_name}={bound}: "
                         f"{_short(values.tolist())}.")


def in_eager_shard_map(array) -> bool:
    """Whether `array` is a value of an eager (not jitted) `jax.shard_map` body.

    JAX's eager shard_map returns zero-size outputs whose per-device shards disagree with their
    sharding: the result has the right shape but fails when read (seen with JAX 0.10.2; a jitted
    shard_map is fine). JAX has no public test for an eager shard_map, so this reads the tracer's
    class name: a JAX that renames it turns the check off (the JAX behaviour comes back) and
    tests/test_bad_inputs_backend.py fails."""
    return isinstance(array, jax.core.Tracer) and type(array).__name__ == "ShardMapTracer"


def check_str_option(name: str, value, options: Iterable[str]) -> str:
    """`value` must be a str among `options` (TypeError for a non-string, ValueError for another str)."""
    options = tuple(options)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {options}; got {type(value).__name__}: "
                        f"{_short(value)}.")
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}.")
    return value


def check_min_rank(name: str, array, minimum: int) -> None:
    """array.ndim must be at least `minimum` (for arguments of shape [..., D])."""
    if array.ndim < minimum:
        raise ValueError(f"{name} must have rank at least {minimum}, got shape {tuple(array.shape)}.")


INT32_MAX = 2**31 - 1


class StaticSizeTypeError(TypeError, ValueError):
    """A static size or count of the wrong type (a bool, float, string, array, None): a TypeError, and
    also a ValueError, which check_positive_int has always raised for such values."""


def check_static_size(name: str, value, *, minimum: int | None = 1,
                      maximum: int | None = INT32_MAX) -> int:
    """A static size (a shape, a count, k): a Python or NumPy int, never a bool, float or string
    (StaticSizeTypeError), within [minimum, maximum] (ValueError; None: unbounded). Returned as a
    Python int."""
    what = ("an int" if minimum is None else "a positive int" if minimum == 1
            else f"an int of at least {minimum}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise StaticSizeTypeError(f"{name} must be {what} (not a bool, float or string), got "
                                  f"{type(value).__name__}: {_short(value)}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {what}, got {int(value)!r}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {int(value)!r}.")
    return int(value)


def check_per_tensor_scales(q_dtype, kv_cache_dtype: str, cache_dtype, q_scale, k_scale
                            ) -> tuple[float, float]:
    """The per-tensor fp8 scales of a sparse-MLA decode, checked as sparse_mla_decode checks them:
    finite positive floats; q_scale != 1 only for a float8_e4m3fn query, k_scale != 1 only for a
    per-tensor fp8 cache (kv_cache_dtype "fp8" / "fp8_e4m3", or "auto" over a float8_e4m3fn cache).
    Shared by the ops that take the scales as arguments and pass them on (sharded decode)."""
    q_scale = check_finite_positive_float("q_scale", q_scale)
    k_scale = check_finite_positive_float("k_scale", k_scale)
    fp8_cache = kv_cache_dtype in FP8_PER_TENSOR_DTYPES or (
        kv_cache_dtype == "auto" and is_fp8_e4m3(cache_dtype))
    if q_scale != 1.0 and not is_fp8_e4m3(q_dtype):
        raise ValueError(f"q_scale={q_scale} applies only to a float8_e4m3fn query; q is "
                         f"{jnp.dtype(q_dtype).name}.")
    if k_scale != 1.0 and not fp8_cache:
        raise ValueError(f"k_scale={k_scale} applies only to an fp8 / fp8_e4m3 cache; this cache is "
                         f"{kv_cache_dtype!r} over {jnp.dtype(cache_dtype).name}.")
    return q_scale, k_scale
