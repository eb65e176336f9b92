"""Decode context parallelism (DCP): KV-shard lengths and the LSE merge of per-rank partial attention.

Under DCP the KV cache of every request is sharded over N ranks (token at global position p lives on
rank `(p // I) % N`, I = `cp_kv_cache_interleave_size`). Every rank attends over its own shard for all
heads, giving a partial `out_r [B, H, D]` and `lse_r [B, H]`; the exact global result is

    out = sum_r exp(lse_r - g) * out_r,     g = logsumexp_r(lse_r)

Ports vLLM's target-era `vllm/v1/attention/ops/common.py` (`cp_lse_ag_out_rs`, `correct_attn_out`,
`_correct_attn_cp_out_kernel`), `_lse_weighted_combine` (its a2a-path reference) and
`vllm/v1/attention/backends/utils.py::get_dcp_local_seq_lens`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as v

__all__ = [
    "get_dcp_local_seq_lens",
    "correct_attn_out",
    "lse_weighted_combine",
    "cp_lse_ag_out_rs",
]

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_rank_value(name: str, value, size: int) -> int | jax.Array:
    """Returns a rank as a Python int (checked against [0, size)) or, when traced, as an int32 scalar.

    Inside `shard_map` the rank is `jax.lax.axis_index(...)`, a tracer: only its shape and dtype
    can be checked, at trace time. A traced rank outside [0, size) cannot raise; every op of this
    module then treats it as a rank that owns nothing (no local tokens, no slots, weight 0), and
    none indexes an array with it unclamped.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or an integer scalar array, got bool.")
    if isinstance(value, jax.core.Tracer):
        if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(
                f"{name} must be an integer scalar; got a traced {value.dtype} of shape "
                f"{tuple(value.shape)}."
            )
        return value.astype(jnp.int32)
    if not isinstance(value, (int, np.integer)):
        if not hasattr(value, "dtype") or not hasattr(value, "shape"):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
        if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(
                f"{name} must be an integer scalar; got {value.dtype} of shape {tuple(value.shape)}."
            )
    value = int(value)
    if not 0 <= value < size:
        raise ValueError(f"{name} must satisfy 0 <= {name} < {size}, got {value}.")
    return value


def _bound_axis_size(axis_name) -> int:
    """The size of the mesh axis `axis_name`, with a ValueError naming it when it is not bound."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(f"axis_name must be a mesh axis name (a string, or a tuple of them), got "
                        f"{type(axis_name).__name__}: {v._short(axis_name)}.")
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"axis_name {axis_name!r} is not bound here: call cp_lse_ag_out_rs inside jax.shard_map "
            "(or another context) over a mesh that has that axis.") from None


def _check_dcp_size(dcp_size) -> int:
    # The world size fixes shapes (ownership modulus, head split), so it must be a static int.
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, (int, np.integer)) or dcp_size < 1:
        raise ValueError(f"dcp_size must be an int >= 1, got {dcp_size!r}.")
    return int(dcp_size)


def get_dcp_local_seq_lens(
    seq_lens: jax.Array,
    dcp_size: int,
    dcp_rank: int | jax.Array | None,
    cp_kv_cache_interleave_size: int = 1,
) -> jax.Array:
    """How many KV tokens of each sequence rank `dcp_rank` holds.

    Args:
      seq_lens: [...] int32 sequence lengths (any shape; the shape is preserved).
      dcp_size: N >= 1, the DCP world size (a Python int).
      dcp_rank: int in [0, N) or a traced int scalar (e.g. `jax.lax.axis_index` inside `shard_map`).
        None returns every rank's length as a trailing axis, like vLLM's `dcp_rank=None`.
      cp_kv_cache_interleave_size: I >= 1; runs of I consecutive tokens go to the same rank.

    Returns:
      int32 local lengths, shape `seq_lens.shape` (or `seq_lens.shape + (N,)` when dcp_rank is None):
      the count of positions p < seq_len with `(p // I) % N == dcp_rank`.

    Errors: a negative length is a ValueError when seq_lens is concrete (eager); under jax.jit it
    counts as 0 (lengths are clamped at 0, so no count is ever negative). A dcp_rank outside [0, N)
    is a ValueError when it is a Python int or concrete; a traced one owns nothing (0 tokens).
    """
    seq_lens = v.as_array("seq_lens", seq_lens)
    v.check_int32("seq_lens", seq_lens)
    concrete = v.host_values(seq_lens)
    if concrete is not None and np.any(concrete < 0):
        raise ValueError(f"seq_lens must be >= 0, got {concrete.min()} among {v._short(concrete.tolist())}.")
    n = _check_dcp_size(dcp_size)
    i = v.check_positive_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size)
    seq_lens = jnp.maximum(jnp.asarray(seq_lens), 0)
    if dcp_rank is None:
        rank = jnp.arange(n, dtype=jnp.int32)
        seq_lens = seq_lens[..., None]
    else:
        rank = _check_rank_value("dcp_rank", dcp_rank, n)
    # Each full round of N*I tokens gives every rank I; the tail round fills ranks in order, I at a time.
    base = seq_lens // i // n * i
    rem = seq_lens - base * n
    local = base + jnp.clip(rem - rank * i, 0, i)
    if isinstance(rank, jax.Array):  # traced: a rank outside [0, N) owns nothing
        local = jnp.where((rank >= 0) & (rank < n), local, 0)
    return local.astype(jnp.int32)


def _float_out_and_lse(out_name: str, out, out_ranks: int | tuple[int, ...], lse_name: str, lse,
                       lse_ranks: int | tuple[int, ...]):
    """An attention output and its lse as arrays, each of a float dtype and an accepted rank."""
    out = v.as_array(out_name, out)
    lse = v.as_array(lse_name, lse)
    v.check_dtype(out_name, out, _FLOAT_DTYPES)
    v.check_dtype(lse_name, lse, _FLOAT_DTYPES)
    v.check_rank(out_name, out, out_ranks)
    v.check_rank(lse_name, lse, lse_ranks)
    return out, lse


def _squeeze_out_and_lses(out, lses):
    """vLLM's accepted layouts: out [B,H,D] or [B,1,H,D]; lses [N,B,H], [N,B,H,1] or [N,B,1,H]."""
    out, lses = _float_out_and_lse("out", out, (3, 4), "lses", lses, (3, 4))
    if out.ndim == 4:
        if out.shape[1] != 1:
            raise ValueError(f"out must be [B, H, D] or [B, 1, H, D], got shape {tuple(out.shape)}.")
        out = out[:, 0]
    if lses.ndim == 4:
        if lses.shape[-1] == 1:
            lses = lses[..., 0]
        elif lses.shape[2] == 1:
            lses = lses[:, :, 0]
        else:
            raise ValueError(
                f"lses must be [N, B, H], [N, B, H, 1] or [N, B, 1, H], got shape {tuple(lses.shape)}."
            )
    if lses.shape[1:] != out.shape[:2]:
        raise ValueError(
            f"lses [N, B, H] must match out [B, H, D] in B and H; got lses {tuple(lses.shape)} "
            f"and out {tuple(out.shape)}."
        )
    if lses.shape[0] < 1:
        raise ValueError("lses must hold at least one rank (N >= 1).")
    return out, lses


def _sanitize(x: jax.Array) -> jax.Array:
    """NaN and +inf become -inf: a partial without a finite LSE has weight 0."""
    return jnp.where(jnp.isnan(x) | (x == jnp.inf), -jnp.inf, x)


def _global_lse(lses: jax.Array, base_e: bool):
    """Stable logsumexp over axis 0 of sanitised LSEs; returns (g, m). All -inf gives g = -inf."""
    m = jnp.max(lses, axis=0)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # keeps L - m finite-or--inf instead of NaN
    if base_e:
        return jnp.log(jnp.sum(jnp.exp(lses - m), axis=0)) + m, m
    return jnp.log2(jnp.sum(jnp.exp2(lses - m), axis=0)) + m, m


def correct_attn_out(
    out: jax.Array,
    lses: jax.Array,
    cp_rank: int | jax.Array,
    *,
    is_lse_base_on_e: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Scales this rank's partial attention by its share of the global softmax mass.

    Args:
      out: [B, H, D] (or [B, 1, H, D]) float32/bfloat16/float16, this rank's partial output.
      lses: [N, B, H] (or [N, B, H, 1] / [N, B, 1, H]) float, every rank's partial LSE.
      cp_rank: int in [0, N) or a traced int scalar: which row of `lses` belongs to `out`.
      is_lse_base_on_e: natural-log LSEs (True) or base 2 (False, FlashInfer's).

    Returns:
      (out, lse): out `exp(lses[cp_rank] - g) * out` in out's shape and dtype (computed in float32;
      entries whose factor is 0 are exactly 0, even when the partial was NaN), and lse = g [B, H], the
      global LSE in lses' dtype (-inf where every rank's LSE is -inf/NaN). A traced cp_rank outside
      [0, N) gets weight 0 (out all 0); an out-of-range int or concrete rank is a ValueError.
    """
    in_shape = v.as_array("out", out).shape
    is_lse_base_on_e = v.check_bool("is_lse_base_on_e", is_lse_base_on_e)
    out, lses = _squeeze_out_and_lses(out, lses)
    rank = _check_rank_value("cp_rank", cp_rank, lses.shape[0])
    lses32 = lses.astype(jnp.float32)
    g, _ = _global_lse(_sanitize(lses32), is_lse_base_on_e)
    if isinstance(rank, jax.Array):  # traced: never index with an out-of-range rank
        in_range = (rank >= 0) & (rank < lses.shape[0])
        rank = jnp.clip(rank, 0, lses.shape[0] - 1)
    else:
        in_range = True
    own = jax.lax.dynamic_index_in_dim(lses32, rank, axis=0, keepdims=False)
    x = _sanitize(own - g)  # -inf - -inf = NaN on empty rows: weight 0
    x = jnp.where(in_range, x, -jnp.inf)
    f = (jnp.exp(x) if is_lse_base_on_e else jnp.exp2(x))[..., None]
    corrected = jnp.where(f == 0, 0.0, out.astype(jnp.float32) * f)
    return corrected.astype(out.dtype).reshape(in_shape), g.astype(lses.dtype)


def lse_weighted_combine(
    outputs: jax.Array,
    lses: jax.Array,
    *,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Merges N partial attentions into the global one (vLLM's `_lse_weighted_combine`).

    Args:
      outputs: [N, B, H, D] float32/bfloat16/float16 partial outputs.
      lses: [N, B, H] float partial LSEs; NaN and +-inf count as "no keys" (weight 0).
      return_lse: also return the global LSE.
      is_lse_base_on_e: natural-log LSEs (True) or base 2.

    Returns:
      out [B, H, D] in outputs' dtype (accumulated in float32), and with return_lse the global
      lse [B, H] float32 (-inf for rows where no rank has keys; their out is 0).
      N must be >= 1 (ValueError naming outputs); B, H or D of 0 give empty results.
    """
    outputs, lses = _float_out_and_lse("outputs", outputs, 4, "lses", lses, 3)
    v.check_nonempty_axes("outputs", outputs, {0: "rank (N)"})
    return_lse = v.check_bool("return_lse", return_lse)
    is_lse_base_on_e = v.check_bool("is_lse_base_on_e", is_lse_base_on_e)
    if lses.shape != outputs.shape[:3]:
        raise ValueError(
            f"lses [N, B, H] must match outputs [N, B, H, D]; got lses {tuple(lses.shape)} and "
            f"outputs {tuple(outputs.shape)}."
        )
    lses32 = _sanitize(lses.astype(jnp.float32))
    m = jnp.max(lses32, axis=0)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lses32 - m) if is_lse_base_on_e else jnp.exp2(lses32 - m)
    w_sum = jnp.sum(w, axis=0)
    w = (w / jnp.maximum(w_sum, 1e-10))[..., None]
    # A weight-0 partial may be garbage (NaN from an empty shard): drop it instead of 0 * NaN.
    parts = jnp.where(w == 0, 0.0, outputs.astype(jnp.float32) * w)
    result = jnp.sum(parts, axis=0).astype(outputs.dtype)
    if not return_lse:
        return result
    lse = (jnp.log(w_sum) if is_lse_base_on_e else jnp.log2(w_sum)) + m
    return result, lse


def cp_lse_ag_out_rs(
    cp_attn_out: jax.Array,
    cp_attn_lse: jax.Array,
    axis_name,
    *,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """DCP merge over a named mesh axis: all-gather the LSEs, correct, reduce-scatter over heads.

    Call inside `jax.shard_map` (or any context binding `axis_name`), once per rank.

    Args:
      cp_attn_out: [B, H, D] float, this rank's partial attention for all H heads.
      cp_attn_lse: [B, H] float, its LSE (-inf for rows with no local keys).
      axis_name: the DCP mesh axis (size N; H must be a multiple of N).
      return_lse: also return this rank's slice of the global LSE.
      is_lse_base_on_e: natural-log LSEs (True) or base 2.

    Returns:
      out [B, H/N, D] in cp_attn_out's dtype: the global result for heads [r*H/N, (r+1)*H/N) of rank
      r (the sum runs in out's dtype, like vLLM's NCCL reduce-scatter); with return_lse also
      lse [B, H/N]. With N == 1 the inputs are returned unchanged, as in vLLM.

    Errors: H = 0 is a ValueError naming cp_attn_out; B = 0 or D = 0 give empty results under
    jax.jit, and are a ValueError naming cp_attn_out inside an eager (not jitted) shard_map, whose
    zero-size outputs JAX assembles with shards that disagree with their sharding (the result
    fails when read); an axis_name that is not bound where the function runs (outside shard_map,
    or a name the mesh lacks) is a ValueError naming axis_name.
    """
    cp_attn_out, cp_attn_lse = _float_out_and_lse("cp_attn_out", cp_attn_out, 3,
                                                  "cp_attn_lse", cp_attn_lse, 2)
    v.check_nonempty_axes("cp_attn_out", cp_attn_out, {1: "head (H)"})
    return_lse = v.check_bool("return_lse", return_lse)
    is_lse_base_on_e = v.check_bool("is_lse_base_on_e", is_lse_base_on_e)
    n = _bound_axis_size(axis_name)
    if cp_attn_lse.shape != cp_attn_out.shape[:2]:
        raise ValueError(
            f"cp_attn_lse [B, H] must match cp_attn_out [B, H, D]; got {tuple(cp_attn_lse.shape)} "
            f"and {tuple(cp_attn_out.shape)}."
        )
    if cp_attn_out.size == 0 and v.in_eager_shard_map(cp_attn_out):
        raise ValueError(
            f"cp_attn_out {tuple(cp_attn_out.shape)} has no elements inside an eager jax.shard_map, "
            "whose zero-size outputs JAX assembles with shards that disagree with their sharding "
            "(reading them fails): jit the shard_map (B = 0 or D = 0 then give empty results) or "
            "skip the call for an empty batch.")
    if n == 1:
        return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out
    heads = cp_attn_out.shape[1]
    if heads % n:
        raise ValueError(
            f"the head count H={heads} must be a multiple of the size {n} of axis {axis_name!r}."
        )
    lses = jax.lax.all_gather(cp_attn_lse, axis_name)  # [N, B, H], rank-major
    rank = jax.lax.axis_index(axis_name)
    out, lse = correct_attn_out(cp_attn_out, lses, rank, is_lse_base_on_e=is_lse_base_on_e)
    out = jax.lax.psum_scatter(out, axis_name, scatter_dimension=1, tiled=True)
    if not return_lse:
        return out
    per_rank = heads // n
    return out, jax.lax.dynamic_slice_in_dim(lse, rank * per_rank, per_rank, axis=1)
