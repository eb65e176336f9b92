"""Top-k index conversion: request-relative token positions to physical KV-cache slots.

The sparse indexer picks, for every query token t, K positions inside t's request. The attention
kernel reads physical rows `slot = block * block_size + offset` of a paged cache, so each position
goes through the request's block table. Ports vLLM's target-era
`sparse_utils.py::triton_convert_req_index_to_global_index` and
`triton_filter_and_convert_dcp_index` as one vectorised [T, K] computation (no Triton tiling, so
no tile-order races: compaction is a stable pack). On a CUDA GPU the same public functions run GPU
kernels instead (same checks, same bits): the Pallas Triton kernels of `index_conversion_pallas` or
the CUDA kernels of `index_conversion_native` (`auto` runs the first kernel of `auto_order(...)`
that can run, else pure JAX; `implementation=` forces any).

Per element (N = dcp_size, I = interleave, r = dcp_rank; plain converter: N = 1, r = 0):

    owner = (tok // I) % N                 local = (tok // (N*I)) * I + tok % I
    blk, off = divmod(local, block_size)   phys  = block_table[req, blk] * block_size + off
    prefill workspace row (pref_id >= 0):  phys  = workspace_starts[pref_id] + tok
    invalid = tok < 0 | (not prefill & (blk >= W | owner != r))     -> -1

Positions past the request's seq_len but inside the table width are NOT rejected (they map through
the table's padding entry), and table entries are trusted, exactly as in vLLM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as v
from ..kernels import availability, index_conversion_native

try:  # Pallas' Triton backend is deprecated in JAX 0.11 and will be removed
    from ..kernels import index_conversion_pallas
except ImportError as _error:  # pragma: no cover (depends on the installed JAX)
    index_conversion_pallas = None
    _PALLAS_IMPORT_ERROR = f"{type(_error).__name__}: {_error}"
from .dcp import _check_dcp_size, _check_rank_value
from ..kernels.registry import current_device_capability

__all__ = ["convert_req_index_to_global_index", "filter_and_convert_dcp_index"]

# vLLM's Triton tile width along K; its kernels require K % BLOCK_N == 0, and so do we, so that
# callers sized for the CUDA path behave the same here.
BLOCK_N = 128

IMPLEMENTATIONS = ("auto", "xla", "pallas", "native")
# The GPU kernels `implementation=` can name.
GPU_KERNELS = ("pallas", "native")
# "auto" runs the CUDA row kernel ahead of Pallas for the compacting conversion with the DCP filter
# at every T, and without it from this many tokens up: there it measured at or under Pallas' time
# on an H100 (at T = 1 without DCP Pallas measured 0.1 µs faster; docs/kernels/index-conversion.md).
NATIVE_COMPACT_MIN_TOKENS = 128


def auto_order(num_tokens: int, compact: bool, dcp_size: int) -> tuple[str, ...]:
    """The GPU kernels "auto" tries in turn on a CUDA GPU for a call of `num_tokens` rows, before
    pure JAX: the fastest measured first. The CUDA kernels stand in where Pallas cannot lower only
    for compaction, where they are 3-4x faster than pure JAX; the in-place conversion falls back to
    pure JAX, which XLA fuses into one kernel as fast as ours."""
    if not compact:
        return ("pallas",)
    if dcp_size > 1 or num_tokens >= NATIVE_COMPACT_MIN_TOKENS:
        return ("native", "pallas")
    return ("pallas", "native")


def unavailable_reason(implementation: str) -> str | None:
    """None when the GPU kernels `implementation` ("pallas" or "native") can run on the default
    device, else why not."""
    if implementation not in GPU_KERNELS:
        raise ValueError(f"implementation must be one of {GPU_KERNELS}, got {implementation!r}.")
    if implementation == "native":
        return index_conversion_native.unavailable_reason()
    if current_device_capability() is None:
        return (f"needs a CUDA GPU (Pallas' Triton lowering); the default device is "
                f"{jax.devices()[0].platform!r}")
    if index_conversion_pallas is None:
        return f"JAX's Pallas Triton backend cannot be imported ({_PALLAS_IMPORT_ERROR})"
    return index_conversion_pallas.lowering_error()


def _select_core(implementation: str, *, num_tokens: int, compact: bool, dcp_size: int):
    """Returns the conversion core (`_convert`, or its Pallas or CUDA twin) that `implementation`
    names: "xla" pure JAX; "pallas" / "native" those kernels, or a ValueError saying why they cannot
    run here; "auto" the first of `auto_order(num_tokens, compact, dcp_size)` that can run, else
    pure JAX. Decided at trace time from the default device and the static shape, like the
    attention kernels (kernels/registry.py)."""
    v.check_str_option("implementation", implementation, IMPLEMENTATIONS)
    if implementation == "xla":
        return _convert
    names = (auto_order(num_tokens, compact, dcp_size) if implementation == "auto"
             else (implementation,))
    for name in names:
        reason = unavailable_reason(name)
        if reason is None:
            return (index_conversion_native if name == "native" else index_conversion_pallas).convert
        if implementation != "auto":
            raise ValueError(f"implementation={implementation!r} cannot run the index conversion: "
                             f"{reason}. Use 'xla' or 'auto'.")
    availability.warn_once()  # warns (once) when no native kernel can run on this NVIDIA GPU
    return _convert


def _check_common(req_id_per_token, block_table, token_indices, block_size):
    req_id_per_token = v.int32_array("req_id_per_token", req_id_per_token, 1)
    block_table = v.int32_array("block_table", block_table, 2)
    token_indices = v.int32_array("token_indices", token_indices, 2)
    if req_id_per_token.shape[0] != token_indices.shape[0]:
        # vLLM's regression guard (#47327): a longer req_id silently mis-assigned requests.
        raise ValueError(
            "req_id_per_token and token_indices must cover the same tokens: got "
            f"req_id_per_token of shape {tuple(req_id_per_token.shape)} and token_indices of "
            f"shape {tuple(token_indices.shape)}."
        )
    k = token_indices.shape[1]
    if k % BLOCK_N or k == 0:
        raise ValueError(
            f"token_indices.shape[1] (the top-k width K) must be a positive multiple of {BLOCK_N}, "
            f"got K={k}."
        )
    block_size = v.check_positive_int("block_size", block_size)
    return req_id_per_token, block_table, token_indices, block_size


def _check_request_ids(req_id_per_token, block_table, reads_table=None):
    """Eagerly, every token that reads the block table (all tokens, or those where `reads_table`, a
    host bool array, is True) must name one of its rows: a ValueError naming req_id_per_token otherwise.
    Under jax.jit the values are unknown: ids are clipped to the table (the documented rule), and with
    an empty table (R = 0) such tokens get only -1 (`_mask_rows`)."""
    ids = v.host_values(req_id_per_token)
    if ids is None:
        return
    num_reqs = block_table.shape[0]
    bad = (ids < 0) | (ids >= num_reqs)
    if reads_table is not None:
        bad &= reads_table
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"req_id_per_token must name a row of block_table (0 <= id < {num_reqs}, block_table has "
            f"shape {tuple(block_table.shape)}); got {int(ids[t])} for token {t} "
            f"({int(bad.sum())} token(s) out of range)."
        )


def _mask_rows(phys, counts, dead):
    """Rows where `dead` [T] bool is True become all -1 with a count of 0 (after any core)."""
    phys = jnp.where(dead[:, None], jnp.int32(-1), phys)
    if counts is not None:
        counts = jnp.where(dead, jnp.int32(0), counts)
    return phys, counts


def _stable_compact(vals: jax.Array, valid: jax.Array) -> jax.Array:
    """Packs the valid entries of each row to its front, in their original order; the tail is -1."""
    t, k = vals.shape
    dest = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    dest = jnp.where(valid, dest, k)  # invalid lanes aim past the row and are dropped
    rows = jnp.arange(t, dtype=jnp.int32)[:, None]
    return jnp.full((t, k), -1, jnp.int32).at[rows, dest].set(vals, mode="drop")


@functools.partial(
    jax.jit, static_argnames=("block_size", "dcp_size", "interleave", "compact", "count")
)
def _convert(
    req_id, block_table, tok, dcp_rank, pref_ids, pref_starts, *,
    block_size, dcp_size, interleave, compact, count,
):
    n, i = dcp_size, interleave
    num_reqs, width = block_table.shape
    # Clamp before arithmetic/gathers: negative tokens are masked below anyway, and the Triton
    # kernel's masked loads never read out of bounds, so neither may we.
    pos = jnp.maximum(tok, 0)
    if n == 1:
        local = pos  # (pos // I) * I + pos % I == pos
    else:
        local = (pos // (n * i)) * i + pos % i
    blk, off = local // block_size, local % block_size
    in_width = blk < width
    if num_reqs * width:
        # Request ids are trusted like table entries (padded tokens use 0); clip so a bad id can't
        # read outside the table.
        req = jnp.clip(req_id, 0, num_reqs - 1)[:, None]
        entry = block_table[req, jnp.minimum(blk, width - 1)]
    else:
        entry = jnp.zeros_like(tok)
    phys = entry * block_size + off
    rejected = ~in_width
    if n > 1:
        rejected = rejected | ((pos // i) % n != dcp_rank)
    if pref_ids is not None:
        # Target era: a prefill row reads the gathered workspace at start + tok, whatever its width.
        pid = pref_ids[:, None]
        is_pref = pid >= 0
        if pref_starts.shape[0]:
            start = pref_starts[jnp.clip(pid, 0, pref_starts.shape[0] - 1)]
        else:
            start = jnp.zeros_like(pid)
        phys = jnp.where(is_pref, start + tok, phys)
        rejected = rejected & ~is_pref
    valid = (tok >= 0) & ~rejected
    vals = jnp.where(valid, phys, -1).astype(jnp.int32)
    if compact:
        vals = _stable_compact(vals, valid)
    counts = jnp.sum(valid, axis=1, dtype=jnp.int32) if count else None
    return vals, counts


def convert_req_index_to_global_index(
    req_id_per_token: jax.Array,
    block_table: jax.Array,
    token_indices: jax.Array,
    *,
    block_size: int = 64,
    prefill_workspace_request_ids: jax.Array | None = None,
    prefill_workspace_starts: jax.Array | None = None,
    return_valid_counts: bool = False,
    compact: bool = False,
    implementation: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Maps each query token's top-k request positions to physical cache slots.

    Args:
      req_id_per_token: [T] int32, the request (block-table row) of every query token.
      block_table: [R, W] int32 physical block ids per request (entries are trusted).
      token_indices: [T, K] int32 top-k positions inside the token's request; any negative
        value is invalid. K must be a multiple of 128.
      block_size: tokens per cache block (positive int).
      prefill_workspace_request_ids: optional [T] int32; >= 0 marks a token whose keys were
        gathered into a contiguous prefill workspace, -1 a normal (paged) token.
      prefill_workspace_starts: optional [P] int32 start row of each workspace request. Given
        together with prefill_workspace_request_ids or not at all.
      return_valid_counts: also return the number of valid slots per token.
      compact: pack valid slots to the front of each row in their original order, -1 after;
        False keeps them in place (vLLM's target-era default), holes included.
      implementation: "auto" (on a CUDA GPU the first kernel of `auto_order` that can run,
        else pure JAX), "xla" (always pure JAX), "pallas" (the Pallas Triton kernels) or "native" (the CUDA
        kernels of the compiled extension); the last two raise a ValueError where they cannot run.
        Every choice gives the same result, bit for bit.

    Returns:
      phys [T, K] int32 slots (`block * block_size + offset`, or `start + tok` for workspace
      rows), -1 for negative positions and blocks at or past W; with return_valid_counts, also
      valid_counts [T] int32. T = 0 gives empty outputs.

    Ids outside their tables: called eagerly, a request id outside [0, R) of a token that reads the
    block table (a non-prefill token) is a ValueError naming req_id_per_token, and a workspace id
    >= P a ValueError naming prefill_workspace_request_ids. Under jax.jit (values unknown at trace
    time) request ids are clipped to the table as documented (docs/semantics.md); a token whose
    request id cannot be clipped (an empty table, R = 0) and a token whose workspace id is >= P are
    treated as invalid: its whole row is -1 and its count 0. Nothing outside the arrays is read.
    """
    req_id_per_token, block_table, token_indices, block_size = _check_common(
        req_id_per_token, block_table, token_indices, block_size
    )
    return_valid_counts = v.check_bool("return_valid_counts", return_valid_counts)
    compact = v.check_bool("compact", compact)
    if (prefill_workspace_request_ids is None) != (prefill_workspace_starts is None):
        raise ValueError(
            "prefill_workspace_request_ids and prefill_workspace_starts must be given together "
            "(or both left None)."
        )
    if prefill_workspace_request_ids is not None:
        pref_ids = v.int32_array("prefill_workspace_request_ids", prefill_workspace_request_ids, 1)
        pref_starts = v.int32_array("prefill_workspace_starts", prefill_workspace_starts, 1)
        if pref_ids.shape[0] != token_indices.shape[0]:
            raise ValueError(
                "prefill_workspace_request_ids must have one entry per token: got shape "
                f"{tuple(pref_ids.shape)} for token_indices of shape {tuple(token_indices.shape)}."
            )
    else:
        pref_ids = pref_starts = None
    core = _select_core(implementation, num_tokens=token_indices.shape[0], compact=compact,
                        dcp_size=1)
    num_reqs, num_starts = block_table.shape[0], None if pref_ids is None else pref_starts.shape[0]
    host_pref = None if pref_ids is None else v.host_values(pref_ids)
    if host_pref is not None and (host_pref >= num_starts).any():
        t = int(np.flatnonzero(host_pref >= num_starts)[0])
        raise ValueError(
            f"prefill_workspace_request_ids must be -1 or name one of the {num_starts} workspaces of "
            f"prefill_workspace_starts (0 <= id < {num_starts}); got {int(host_pref[t])} for token {t}."
        )
    if pref_ids is None:
        _check_request_ids(req_id_per_token, block_table)
    elif host_pref is not None:
        _check_request_ids(req_id_per_token, block_table, host_pref < 0)
    phys, counts = core(
        req_id_per_token, block_table, token_indices, 0, pref_ids, pref_starts,
        block_size=block_size, dcp_size=1, interleave=1, compact=compact,
        count=return_valid_counts,
    )
    # Under jit: the cases no clipping can make meaningful are invalid rows (eagerly they raised).
    dead = None
    if pref_ids is not None:
        dead = pref_ids >= num_starts
    if num_reqs == 0:
        paged = jnp.ones(token_indices.shape[:1], bool) if pref_ids is None else pref_ids < 0
        dead = paged if dead is None else dead | paged
    if dead is not None:
        phys, counts = _mask_rows(phys, counts, dead)
    return (phys, counts) if return_valid_counts else phys


def filter_and_convert_dcp_index(
    req_id_per_token: jax.Array,
    block_table: jax.Array,
    token_indices: jax.Array,
    *,
    dcp_size: int,
    dcp_rank: int | jax.Array,
    cp_kv_cache_interleave_size: int = 1,
    block_size: int = 64,
    return_valid_counts: bool = False,
    compact: bool = True,
    implementation: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Keeps the top-k positions this DCP rank owns and maps them to its local cache slots.

    Top-k indices are GLOBAL request positions, identical on every rank; position p lives on rank
    `(p // I) % N` at local position `(p // (N*I)) * I + p % I`, which this rank's block table
    (over local positions) maps to a slot.

    Args:
      req_id_per_token: [T] int32, the request of every query token.
      block_table: [R, W] int32, this rank's block table over local positions.
      token_indices: [T, K] int32 global top-k positions; negative = invalid; K % 128 == 0.
      dcp_size: N >= 1, the DCP world size (Python int).
      dcp_rank: this rank, an int in [0, N) or a traced int scalar (`jax.lax.axis_index`).
      cp_kv_cache_interleave_size: I >= 1 with block_size % I == 0.
      block_size: tokens per cache block (positive int).
      return_valid_counts: also return the number of owned, valid slots per token.
      compact: pack the owned slots to the front of each row (stable order), -1 after; False
        leaves each at its original column.
      implementation: "auto" (on a CUDA GPU the first kernel of `auto_order` that can run,
        else pure JAX), "xla" (always pure JAX), "pallas" (the Pallas Triton kernels) or "native" (the CUDA
        kernels of the compiled extension); the last two raise a ValueError where they cannot run.
        Every choice gives the same result, bit for bit.

    Returns:
      phys [T, K] int32 local slots, -1 for invalid, out-of-width or remote positions; with
      return_valid_counts, also valid_counts [T] int32. T = 0 gives empty outputs.

    Request ids outside [0, R): eagerly a ValueError naming req_id_per_token; under jax.jit clipped
    to the table as documented (docs/semantics.md), except with an empty table (R = 0), where every
    row is treated as invalid (all -1, count 0). Nothing outside the arrays is read.
    """
    req_id_per_token, block_table, token_indices, block_size = _check_common(
        req_id_per_token, block_table, token_indices, block_size
    )
    return_valid_counts = v.check_bool("return_valid_counts", return_valid_counts)
    compact = v.check_bool("compact", compact)
    n = _check_dcp_size(dcp_size)
    rank = _check_rank_value("dcp_rank", dcp_rank, n)
    interleave = v.check_positive_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size)
    if block_size % interleave:
        raise ValueError(
            f"block_size ({block_size}) must be a multiple of cp_kv_cache_interleave_size "
            f"({interleave})."
        )
    core = _select_core(implementation, num_tokens=token_indices.shape[0], compact=compact,
                        dcp_size=n)
    _check_request_ids(req_id_per_token, block_table)
    phys, counts = core(
        req_id_per_token, block_table, token_indices, rank, None, None,
        block_size=block_size, dcp_size=n, interleave=interleave, compact=compact,
        count=return_valid_counts,
    )
    if block_table.shape[0] == 0:  # under jit (eagerly it raised): no row to clip to
        phys, counts = _mask_rows(phys, counts, jnp.ones(token_indices.shape[:1], bool))
    return (phys, counts) if return_valid_counts else phys
