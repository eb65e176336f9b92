"""Multi-device sparse-MLA decode: decode context parallelism (DCP) and tensor parallelism (TP).

Built on JAX's own distribution only: a `jax.sharding.Mesh` with axes ("tp", "dcp"), `jax.shard_map`
and the `jax.lax` collectives (no communication layer of our own). The layout is vLLM's (target era,
AG+RS flavour of DCP; see vLLM's `MLACommonImpl.forward_impl` / `cp_lse_ag_out_rs`):

- **heads** are split over tp * dcp devices (vLLM's TP group of size tp * dcp; DCP reuses TP ranks, so the
  DCP groups are the `dcp` rows of consecutive devices). A device holds H / (tp * dcp) query heads.
- **the KV cache** is split over `dcp` and replicated over `tp`: the token at global position p lives on
  DCP rank `(p // I) % N` at local position `(p // (N * I)) * I + p % I` (I = interleave). Every rank
  has its own paged cache and its own block table over local positions: block k of a request covers the
  global positions [k * BS * N, (k + 1) * BS * N).
- **per step**: the query heads are all-gathered over `dcp` (rank-major heads, H / tp per device); each
  rank runs `FlashInferMLASparseImpl.forward_mqa` over its own shard (it keeps the top-k positions it
  owns, compacts them and calls the kernel `sparse_mla_decode` picks for the device: the native one on
  an H100/H200); `cp_lse_ag_out_rs` all-gathers the LSEs, rescales each partial and reduce-scatters the
  output back to H / (tp * dcp) heads. W_UV (and o_proj) then run on the local heads without
  communication before o_proj's all-reduce.

Several hosts: call `jax.distributed.initialize()` in every process first; `jax.devices()` then lists
the devices of all processes and `make_decode_mesh` spans them (dcp is the minor axis, so a DCP group
stays inside one host while dcp <= devices per host). Inputs must then be global `jax.Array`s (e.g. built
with `jax.make_array_from_process_local_data` or inside a jitted function with `out_shardings`).
Nothing else changes.

Public functions: `make_decode_mesh`, `dcp_slot_mapping`, `sharded_concat_and_cache_mla`,
`sharded_sparse_mla_decode`, and the `head_sharding` / `kv_sharding` helpers.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from . import _validation as v
from .backend import DECODER, FlashInferMLASparseImpl, LayerScales
from .ops.dcp import _check_dcp_size, _check_rank_value, cp_lse_ag_out_rs
from .ops.kv_cache import concat_and_cache_mla
from .ops.metadata import FlashInferMLASparseMetadata

__all__ = [
    "TP_AXIS",
    "DCP_AXIS",
    "make_decode_mesh",
    "head_sharding",
    "kv_sharding",
    "dcp_slot_mapping",
    "sharded_concat_and_cache_mla",
    "sharded_sparse_mla_decode",
]

TP_AXIS = "tp"
DCP_AXIS = "dcp"
_HEADS = (TP_AXIS, DCP_AXIS)  # heads split tp-major, dcp-minor: vLLM's TP rank = tp_index * dcp + dcp_rank
_LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- mesh


def make_decode_mesh(tp: int = 1, dcp: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("tp", "dcp") mesh over the first tp * dcp devices (default `jax.devices()`, all processes).

    dcp is the minor axis: the DCP group of tp index t is devices [t * dcp, (t + 1) * dcp), consecutive
    devices as in vLLM. Both axes are `AxisType.Auto`, so jitted code may pass arrays of any sharding
    (they are resharded to the specs below on entry).

    devices: a sequence (list, tuple, array) of distinct jax.Device; a string, a non-device entry
    (TypeError) or a device listed twice (ValueError) names `devices`.
    """
    tp = v.check_positive_int("tp", tp)
    dcp = v.check_positive_int("dcp", dcp)
    if devices is None:
        devices = jax.devices()
    elif isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices must be a sequence of jax.Device, got {type(devices).__name__}: "
                        f"{v._short(devices)}.")
    devices = list(np.asarray(devices, dtype=object).ravel()) if isinstance(devices, np.ndarray) \
        else list(devices)
    for d in devices:
        if not isinstance(d, jax.Device):
            raise TypeError(f"devices must hold jax.Device entries, got {type(d).__name__}: "
                            f"{v._short(d)}.")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices must be distinct; {len(devices) - len(set(devices))} "
                         "device(s) appear more than once.")
    if len(devices) < tp * dcp:
        raise ValueError(
            f"a tp={tp} x dcp={dcp} mesh needs {tp * dcp} devices; only {len(devices)} are available."
        )
    grid = np.asarray(devices[: tp * dcp], dtype=object).reshape(tp, dcp)
    return Mesh(grid, (TP_AXIS, DCP_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def _check_mesh(mesh) -> tuple[int, int]:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    missing = [a for a in _HEADS if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"mesh must have the axes {_HEADS} (see make_decode_mesh); axis {missing[0]!r} is missing "
            f"from {tuple(mesh.axis_names)}."
        )
    return int(mesh.shape[TP_AXIS]), int(mesh.shape[DCP_AXIS])


def head_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of [T, H, ...] per-head arrays (q, out): heads split over ("tp", "dcp")."""
    _check_mesh(mesh)
    return NamedSharding(mesh, P(None, _HEADS))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of the per-rank stacks [N, ...] (caches, block tables, slot mappings): split over dcp,
    replicated over tp."""
    _check_mesh(mesh)
    return NamedSharding(mesh, P(DCP_AXIS))


def _maybe_reshard(mesh: Mesh, x: jax.Array, spec: P) -> jax.Array:
    # With Explicit axes shard_map wants inputs already in its in_specs; Auto axes reshard by themselves.
    if any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return x


# ----------------------------------------------------------------------------- KV writes


def dcp_slot_mapping(
    req_id_per_token: jax.Array,
    positions: jax.Array,
    block_table: jax.Array,
    *,
    block_size: int,
    dcp_size: int,
    dcp_rank: int | jax.Array | None = None,
    interleave: int = 1,
) -> jax.Array:
    """Cache slots for writing new tokens under DCP (vLLM's `_compute_slot_mappings_kernel`).

    Args:
      req_id_per_token: [T] int32, the request of every new token (padding may use any valid request).
      positions: [T] int32 global positions of the new tokens in their requests; negative = padding.
      block_table: this rank's [R, W] int32 block table over local positions, or, with
        dcp_rank=None, every rank's table stacked as [N, R, W].
      block_size: BS, tokens per cache block (static int, a multiple of interleave).
      dcp_size: N (static int). dcp_rank: int in [0, N), a traced int scalar (`jax.lax.axis_index`
        inside shard_map), or None for all ranks at once.
      interleave: I, vLLM's cp_kv_cache_interleave_size.

    Returns:
      int32 slots `block_table[req, vb] * BS + local_offset` where vb = p // (BS * N) and the token is
      owned by this rank (`((p % (BS*N)) // I) % N == rank`), else -1 (vLLM's PAD_SLOT_ID, which
      `concat_and_cache_mla` skips). Also -1 for p < 0 and for vb >= W. Shape [T], or [N, T] for
      dcp_rank=None.

    Errors: R = 0 or W = 0 in block_table is a ValueError naming block_table (T = 0 gives an empty
    result). A dcp_rank outside [0, N) is a ValueError when it is an int or concrete; a traced one
    (under jit) owns no token: every slot is -1, and block_table is only read at clamped indices.
    """
    req = v.int32_array("req_id_per_token", req_id_per_token, 1)
    pos = v.int32_array("positions", positions, 1)
    table = v.as_array("block_table", block_table)
    v.check_int32("block_table", table)
    if req.shape != pos.shape:
        raise ValueError(
            f"req_id_per_token {tuple(req.shape)} and positions {tuple(pos.shape)} must have the same "
            "shape [T]."
        )
    n = _check_dcp_size(dcp_size)
    bs = v.check_positive_int("block_size", block_size)
    i = v.check_positive_int("interleave", interleave)
    if bs % i:
        raise ValueError(f"block_size ({bs}) must be a multiple of interleave ({i}).")
    if dcp_rank is None:
        v.check_rank("block_table", table, 3)
        if table.shape[0] != n:
            raise ValueError(
                f"with dcp_rank=None block_table must be [N={n}, R, W], got {tuple(table.shape)}."
            )
        v.check_nonempty_axes("block_table", table, {1: "request (R)", 2: "block (W)"})
        ranks = jnp.arange(n, dtype=jnp.int32)
        return jax.vmap(lambda t, r: _slots(req, pos, t, r, bs, n, i))(table, ranks)
    v.check_rank("block_table", table, 2)
    v.check_nonempty_axes("block_table", table, {0: "request (R)", 1: "block (W)"})
    rank = _check_rank_value("dcp_rank", dcp_rank, n)
    return _slots(req, pos, table, jnp.asarray(rank, jnp.int32), bs, n, i)


def _slots(req, pos, table, rank, bs, n, i):
    width = table.shape[1]
    virtual = bs * n
    vb = pos // virtual
    vo = pos % virtual
    local = ((vo // i) % n) == rank
    local_off = (vo // (i * n)) * i + vo % i
    ok = (pos >= 0) & (vb < width) & local
    block = table[jnp.clip(req, 0, table.shape[0] - 1), jnp.clip(vb, 0, width - 1)]
    return jnp.where(ok, block * bs + local_off, -1).astype(jnp.int32)


def sharded_concat_and_cache_mla(
    mesh: Mesh,
    kv_c: jax.Array,
    k_pe: jax.Array,
    kv_cache_shards: jax.Array,
    slot_mapping_shards: jax.Array,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
) -> jax.Array:
    """Writes new tokens into every DCP rank's cache (`concat_and_cache_mla` once per rank).

    Args:
      mesh: a mesh with axes ("tp", "dcp") (make_decode_mesh).
      kv_c: [T, 512], k_pe: [T, 64] bf16/f16 rows of the new tokens (replicated).
      kv_cache_shards: [N, num_blocks, block_size, 576] (or 656 uint8 for fp8_ds_mla), sharded over dcp
        (kv_sharding(mesh)); N = the dcp axis size.
      slot_mapping_shards: [N, T] int32, `dcp_slot_mapping(..., dcp_rank=None)`: -1 where a rank does
        not own the token.

    Returns the new cache stack (same shape, dtype and sharding). Donate kv_cache_shards under jit to
    update it in place.
    """
    _, n = _check_mesh(mesh)
    # Every array first: a Python list would reach jax.sharding.reshard / shard_map as a pytree of
    # scalars (one transfer per element), which took minutes instead of failing.
    kv_c = v.as_array("kv_c", kv_c)
    k_pe = v.as_array("k_pe", k_pe)
    kv_cache_shards = v.as_array("kv_cache_shards", kv_cache_shards)
    slots = v.as_array("slot_mapping_shards", slot_mapping_shards)
    v.check_rank("kv_cache_shards", kv_cache_shards, 4)
    v.check_rank("slot_mapping_shards", slots, 2)
    v.check_nonempty_axes("kv_cache_shards", kv_cache_shards, {1: "block", 2: "row per block"})
    for name, x in (("kv_cache_shards", kv_cache_shards), ("slot_mapping_shards", slots)):
        if x.shape[0] != n:
            raise ValueError(f"{name} must have the dcp size {n} as its leading axis, got "
                             f"{tuple(x.shape)}.")

    def body(kv_c, k_pe, cache, slot):
        new = concat_and_cache_mla(kv_c, k_pe, cache[0], slot[0], kv_cache_dtype=kv_cache_dtype,
                                   k_scale=k_scale)
        return new[None]

    args = [_maybe_reshard(mesh, x, s) for x, s in
            ((kv_c, P()), (k_pe, P()), (kv_cache_shards, P(DCP_AXIS)), (slots, P(DCP_AXIS)))]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(DCP_AXIS), P(DCP_AXIS)),
                      out_specs=P(DCP_AXIS))
    return f(*args)


# ----------------------------------------------------------------------------- decode


_REDUCE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _reduce_dtype(value) -> jnp.dtype:
    """sharded_sparse_mla_decode's reduce_dtype as a floating dtype, with an error naming it."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in tuple(jnp.dtype(d) for d in _REDUCE_DTYPES):
        raise TypeError(f"reduce_dtype must be None or one of float32, bfloat16, float16, got "
                        f"{value!r}.")
    return dtype


def sharded_sparse_mla_decode(
    mesh: Mesh,
    q: jax.Array,
    kv_cache_shards: jax.Array,
    block_table_shards: jax.Array,
    topk_indices: jax.Array,
    req_id_per_token: jax.Array,
    *,
    scale: float,
    interleave: int = 1,
    kv_cache_dtype: str = "auto",
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    reduce_dtype=None,
    return_lse: bool = False,
    lse_base: str = "e",
    implementation: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Sparse MLA decode over a KV cache sharded by DCP, heads sharded by TP x DCP. Jittable.

    Args:
      mesh: a Mesh with axes "tp" and "dcp" (make_decode_mesh); other axes, if any, replicate.
      q: [T, H, 576] absorbed query (512 latent + 64 RoPE), bf16 / f16, or float8_e4m3fn with an fp8
        cache (dequantised with q_scale). H must be a multiple of tp * dcp. Laid out (or resharded to)
        head_sharding(mesh).
      kv_cache_shards: [N, num_blocks, block_size, 576] (656 uint8 for fp8_ds_mla), rank r's paged cache
        of LOCAL positions at [r]; kv_sharding(mesh). N = dcp; block_size % interleave == 0.
      block_table_shards: [N, R, W] int32, rank r's block table over local positions at [r]: block k of
        request j covers the global positions [k * BS * N, (k + 1) * BS * N).
      topk_indices: [T, K] int32 GLOBAL request positions (identical for every rank, as vLLM's indexer
        produces them after its DCP merge), negative = none; K % 128 == 0. Replicated.
      req_id_per_token: [T] int32 request of every query token. Replicated.
      scale: the model's softmax scale (DeepSeek-V3.2: 192**-0.5 * mscale**2).
      interleave: I, vLLM's cp_kv_cache_interleave_size (the layout the caches were written with).
      kv_cache_dtype, q_scale, k_scale, implementation: as in sparse_mla_decode (q_scale is read for an
        fp8 query, k_scale for an fp8 cache).
      reduce_dtype: dtype of the reduce-scatter that sums the rescaled partial outputs. None (default)
        sums in the output dtype (bf16), as vLLM's NCCL reduce-scatter does; jnp.float32 sums in fp32
        (twice the bytes on the wire) and rounds once at the end.
      return_lse: also return the global LSE of every head.
      lse_base: "e" or "2", the base of the returned LSE.

    Returns:
      out [T, H, 512] (bf16; f16 for an f16 query), sharded like q (head_sharding), equal to the
      single-device result over the unsharded cache up to the rounding of the partial sums; with
      return_lse also lse [T, H] float32 (same sharding). Rows with no valid key anywhere: out 0,
      lse -inf.

    Every argument is checked before use (TypeError / ValueError naming it): q_scale / k_scale as
    sparse_mla_decode checks them (v.check_per_tensor_scales: k_scale != 1 with a 16-bit cache is a
    ValueError, never ignored); zero-sized axes (H, num_blocks, block_size, R, W, K) are
    ValueErrors; T = 0 is allowed: empty outputs of these shapes, dtypes and shardings, eager or
    jitted (the arguments are checked as for T > 0).
    """
    tp, n = _check_mesh(mesh)
    q = v.as_array("q", q)
    kv_cache_shards = v.as_array("kv_cache_shards", kv_cache_shards)
    tables = v.as_array("block_table_shards", block_table_shards)
    topk = v.as_array("topk_indices", topk_indices)
    req = v.as_array("req_id_per_token", req_id_per_token)
    v.check_rank("q", q, 3)
    v.check_rank("kv_cache_shards", kv_cache_shards, 4)
    v.check_rank("block_table_shards", tables, 3)
    v.check_rank("topk_indices", topk, 2)
    v.check_rank("req_id_per_token", req, 1)
    v.check_int32("block_table_shards", tables)
    v.check_int32("topk_indices", topk)
    v.check_int32("req_id_per_token", req)
    v.check_last_dim("q", q, v.MLA_HEAD_DIM)
    v.check_nonempty_axes("q", q, {1: "head (H)"})
    v.check_nonempty_axes("kv_cache_shards", kv_cache_shards, {1: "block", 2: "row per block"})
    v.check_nonempty_axes("block_table_shards", tables, {1: "request (R)", 2: "block (W)"})
    v.check_nonempty_axes("topk_indices", topk, {1: "index per token (K)"})
    v.check_kv_cache_dtype(kv_cache_dtype)
    q_scale, k_scale = v.check_per_tensor_scales(q.dtype, kv_cache_dtype, kv_cache_shards.dtype,
                                                 q_scale, k_scale)
    scale = v.check_finite_positive_float("scale", scale)
    return_lse = v.check_bool("return_lse", return_lse)
    if kv_cache_dtype == "auto" and v.is_fp8_e4m3(kv_cache_shards.dtype):
        kv_cache_dtype = "fp8"  # so that forward_mqa applies k_scale, as sparse_mla_decode does
    num_tokens, heads = q.shape[:2]
    if heads % (tp * n):
        raise ValueError(
            f"the head count H={heads} must be a multiple of tp * dcp = {tp} * {n} = {tp * n}."
        )
    for name, x in (("kv_cache_shards", kv_cache_shards), ("block_table_shards", tables)):
        if x.shape[0] != n:
            raise ValueError(
                f"{name} must stack one entry per DCP rank (leading axis {n}), got {tuple(x.shape)}."
            )
    if topk.shape[0] != num_tokens or req.shape[0] != num_tokens:
        raise ValueError(
            f"topk_indices {tuple(topk.shape)} and req_id_per_token {tuple(req.shape)} must have "
            f"q's {num_tokens} tokens."
        )
    block_size = int(kv_cache_shards.shape[2])
    interleave = v.check_positive_int("interleave", interleave)
    if block_size % interleave:
        raise ValueError(
            f"block_size ({block_size}) must be a multiple of interleave ({interleave})."
        )
    if lse_base not in ("e", "2"):
        raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}.")
    reduce_dtype = None if reduce_dtype is None else _reduce_dtype(reduce_dtype)
    scales = LayerScales(_q_scale_float=float(q_scale), _k_scale_float=float(k_scale))
    num_reqs = int(tables.shape[1])

    def body(q_loc, cache, table, topk, req):
        rank = jax.lax.axis_index(DCP_AXIS)
        # [T, H/(tp*N), 576] -> [T, H/tp, 576], rank-major heads (vLLM's dcp_group.all_gather(dim=1)).
        q_grp = jax.lax.all_gather(q_loc, DCP_AXIS, axis=1, tiled=True)
        impl = FlashInferMLASparseImpl(
            num_heads=heads // (tp * n), head_size=v.MLA_HEAD_DIM, scale=scale, num_kv_heads=1,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=None, attn_type=DECODER, kv_sharing_target_layer_name=None,
            dcp_world_size=n, dcp_rank=rank, implementation=implementation)
        impl.need_to_return_lse_for_decode = True  # n == 1 too, for return_lse
        metadata = _rank_metadata(table[0], req, num_tokens, num_reqs, block_size, interleave)
        out, lse = impl.forward_mqa(q_grp, cache[0], metadata, scales, topk_indices=topk)
        out_dtype = out.dtype
        if reduce_dtype is not None:
            out = out.astype(reduce_dtype)
        out, lse = cp_lse_ag_out_rs(out, lse, DCP_AXIS, return_lse=True,
                                    is_lse_base_on_e=impl.lse_base_on_e)
        out = out.astype(out_dtype)
        base_e = impl.lse_base_on_e
        if lse_base == "e" and not base_e:
            lse = lse * _LN2
        elif lse_base == "2" and base_e:
            lse = lse / _LN2
        return out, lse.astype(jnp.float32)

    head_spec, kv_spec = P(None, _HEADS), P(DCP_AXIS)
    in_specs = (head_spec, kv_spec, kv_spec, P(), P())
    args = [_maybe_reshard(mesh, x, s) for x, s in
            zip((q, kv_cache_shards, tables, topk, req), in_specs)]
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(head_spec, head_spec))
    if num_tokens == 0:
        # An eager shard_map assembles zero-size outputs with shards that disagree with their
        # sharding (seen with JAX 0.10.2: the result fails when read). Jitted, the body still checks
        # every argument at trace time and its empty outputs read fine; they are then placed as
        # documented.
        out, lse = (jax.device_put(x, head_sharding(mesh)) for x in jax.jit(f)(*args))
    else:
        out, lse = f(*args)
    return (out, lse) if return_lse else out


def _rank_metadata(block_table, req_id_per_token, num_tokens, num_reqs, block_size, interleave):
    """The metadata forward_mqa reads on one rank: its block table and req_id_per_token (and the static
    block_size / interleave). The batch-layout fields are not read by forward_mqa; they describe an
    all-decode batch of `num_tokens` tokens."""
    zeros = jnp.zeros((num_reqs,), jnp.int32)
    return FlashInferMLASparseMetadata(
        query_start_loc=jnp.zeros((num_reqs + 1,), jnp.int32),
        slot_mapping=jnp.full((num_tokens,), -1, jnp.int32),
        block_table=block_table,
        req_id_per_token=req_id_per_token,
        seq_lens=zeros,
        num_reqs=num_reqs,
        max_query_len=1,
        max_seq_len=0,
        num_actual_tokens=num_tokens,
        num_decodes=num_reqs,
        num_prefills=0,
        num_decode_tokens=num_tokens,
        block_size=block_size,
        cp_kv_cache_interleave_size=interleave,
    )
