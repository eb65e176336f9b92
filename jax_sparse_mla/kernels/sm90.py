"""The SM90 (H100 / H200) native kernel: FlashInfer's Hopper MLA kernel behind an XLA FFI custom call.

FlashInfer's paged MLA kernel (`mla_hopper.cuh`, the "fa3" backend of `BatchMLAPagedAttentionWrapper`)
computes exact sparse MLA when each query token is one request whose page table is its list of top-k
slots, with page_size = 1. The handler in `ffi/sm90/sm90_decode.cuh` runs it on the XLA stream:

  * once per static shape (T, H, K, device), FlashInfer's host planner (MLAPlan) splits the work
    assuming every token keeps all K slots; the plan becomes a constant of the executable;
  * per call, a small kernel packs each token's valid slots to the front (holes may sit anywhere;
    slots out of range or past the token's valid count are dropped: the op's index rule, applied
    here instead of in a separate pass) and clamps every planned work item to the packed count, then one cooperative launch runs the
    attention and merges the KV splits. No host synchronisation, no allocation: scratch buffers are
    extra results of the custom call, which the handler declares command-buffer compatible.

The kernel contract (arguments, scales, empty rows) is in `kernels/registry.py`. For fp8 caches the SM90 fp8
kernel (`sm90_fp8.py`, registered later) takes precedence; FlashInfer's fp8 instantiation stays
registered as "sm90_flashinfer_fa3" for the benchmark's side-by-side comparison. With one token over
a bf16 cache "auto" runs pure JAX, which measured faster there (`slower_than_pure_jax`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry
from .. import _validation as v

_TARGETS = {
    "bfloat16": "jax_sparse_mla_sm90_decode_bf16",
    "fp8_e4m3": "jax_sparse_mla_sm90_decode_fp8",
}
# The kernel loads KV in tiles of 64 rows; the plan covers K rounded up to whole tiles.
_KV_TILE = 64


@dataclasses.dataclass(frozen=True)
class Schedule:
    """FlashInfer's MLA plan for one static shape (layout: ffi/sm90/sm90_schedule.h).

    schedule: int32 [n] work lists the kernel reads; the other fields are handler attributes.
    """

    schedule: np.ndarray
    num_works: int
    cluster_size: int
    num_clusters: int
    num_sms: int
    partial_o_offset: int
    partial_lse_offset: int
    float_workspace_bytes: int


@functools.lru_cache(maxsize=512)
def plan_schedule(num_tokens: int, num_heads: int, padded_keys: int, device_ordinal: int) -> Schedule:
    """Runs FlashInfer's planner on the host for `num_tokens` x `num_heads` over `padded_keys` slots."""
    raw = native.module.sm90_schedule(num_tokens, num_heads, padded_keys, device_ordinal)
    schedule = np.frombuffer(raw.pop("schedule"), dtype=np.int32).copy()
    schedule.flags.writeable = False
    return Schedule(schedule=schedule, **raw)


def _device_ordinal() -> int:
    """CUDA ordinal of the device JAX computes on by default (the one the registry checked)."""
    device = jax.devices()[0]
    ordinal = getattr(device, "local_hardware_id", None)
    return int(device.id if ordinal is None else ordinal)


def padded_num_keys(num_keys: int) -> int:
    return max(_KV_TILE, -(-num_keys // _KV_TILE) * _KV_TILE)


def plan_token_limit(num_heads: int, padded_keys: int, sm_count: int) -> int:
    """The most tokens one plan holds (FlashInfer's fixed work-item arrays, int32 packed rows):
    ffi/sm90/sm90_schedule.h, Sm90PlanTokenLimit. 0 when not even one token fits."""
    return int(native.module.sm90_plan_token_limit(num_heads, padded_keys, sm_count))


def _sm90_kernel(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base):
    """SM90 kernel (contract in kernels/registry.py); q bf16 or fp8, cache bf16 or fp8 e4m3 [.., .., 576].

    More tokens than one plan holds (about 16k at K = 2048) run as several launches of at most that many.
    """
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return (jnp.zeros((0, num_heads, v.MLA_V_DIM), jnp.bfloat16),
                jnp.zeros((0, num_heads), jnp.float32))
    padded_keys = padded_num_keys(indices.shape[1])
    max_tokens = plan_token_limit(num_heads, padded_keys, registry.device_sm_count())
    if max_tokens < 1:
        raise ValueError(f"the SM90 bf16 kernel cannot plan {indices.shape[1]} slots per token "
                         f"(the packed rows of one token overflow int32)")
    piece = functools.partial(_sm90_launch, kv_rows=kv_cache.reshape(-1, v.MLA_HEAD_DIM),
                              bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, lse_base=lse_base)
    return registry.in_token_pieces(piece, max_tokens, q, indices, valid_counts)


def _sm90_launch(q, indices, valid_counts, *, kv_rows, bmm1_scale, bmm2_scale, lse_base):
    """One custom call over T tokens that one plan holds."""
    num_tokens, num_heads, _ = q.shape
    fp8_cache = v.is_fp8_e4m3(kv_rows.dtype)
    num_keys = indices.shape[1]
    padded_keys = padded_num_keys(num_keys)
    if valid_counts is None:  # a constant of the executable: no extra kernel
        valid_counts = jnp.full((num_tokens,), num_keys, jnp.int32)
    plan = plan_schedule(num_tokens, num_heads, padded_keys, _device_ordinal())
    # FlashInfer's fp8 path dequantises the cache as kv_scale * kv (bf16) before the matmuls, so the
    # softmax scale it applies must leave out the k_scale that bmm1_scale already holds.
    kv_scale = bmm2_scale if fp8_cache else 1.0
    call = jax.ffi.ffi_call(
        _TARGETS["fp8_e4m3" if fp8_cache else "bfloat16"],
        (
            jax.ShapeDtypeStruct((num_tokens, num_heads, v.MLA_V_DIM), jnp.bfloat16),  # out
            jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32),  # lse
            jax.ShapeDtypeStruct((num_tokens, padded_keys), jnp.int32),  # packed slots (scratch)
            jax.ShapeDtypeStruct((2, plan.num_works), jnp.int32),  # per-call KV ranges (scratch)
            jax.ShapeDtypeStruct((plan.float_workspace_bytes,), jnp.uint8),  # split-KV partials
        ),
        # The handler takes one [T, ...] problem; a batch of them runs one call per element.
        vmap_method="sequential",
    )
    out, lse, *_scratch = call(
        q.astype(jnp.bfloat16),  # exact for an fp8 query; its q_scale is already in bmm1_scale
        kv_rows,
        indices,
        valid_counts,
        jnp.asarray(plan.schedule),
        sm_scale=np.float32(bmm1_scale / kv_scale),
        kv_scale=np.float32(kv_scale),
        lse_base_e=np.bool_(lse_base == "e"),
        num_works=np.int64(plan.num_works),
        cluster_size=np.int64(plan.cluster_size),
        num_clusters=np.int64(plan.num_clusters),
        num_sms=np.int64(plan.num_sms),
        partial_o_offset=np.int64(plan.partial_o_offset),
        partial_lse_offset=np.int64(plan.partial_lse_offset),
    )
    return out, lse


def slower_than_pure_jax(problem: registry.Problem) -> str | None:
    """One token over a bf16 cache: in a jitted loop of 200 single-token decodes on the H200, pure JAX
    took 16.02 / 21.91 us per step at 16 / 128 heads where this kernel (pack kernel + FlashInfer's
    cooperative kernel, about 21 us on its own) took 27.66 / 25.63 (docs/benchmarks.md, run bf16).
    One token over an e4m3 cache: in the same loop on an H100 (benchmarks/results/sm90_h100.json,
    decode_loop), pure JAX took 18.85 / 24.04 us per step (15.27 / 20.88 us of kernels) where this
    kernel took 45.70 / 43.42 (32.78 / 37.18)."""
    if problem.num_tokens != 1:
        return None
    if problem.kv_layout == "bfloat16":
        return ("pure JAX measured faster with one token over a bf16 cache (H200 decode loop: "
                "16.0 / 21.9 against 27.7 / 25.6 us per step at 16 / 128 heads)")
    if problem.kv_layout == "fp8_e4m3":
        return ("pure JAX measured faster with one token over an e4m3 cache (H100 decode loop: "
                "18.9 / 24.0 against 45.7 / 43.4 us per step at 16 / 128 heads)")
    return None


registry.register_kernel(registry.SparseMLAKernel(
    name="sm90_flashinfer_fa3",
    native=True,
    capability_majors=(9,),
    kv_layouts=("bfloat16", "fp8_e4m3"),
    q_dtypes=("bfloat16", "float8_e4m3fn"),
    fn=_sm90_kernel,
    available=lambda: all(native.has_target(t) for t in _TARGETS.values()),
    slower_than_pure_jax=slower_than_pure_jax,
))
