"""The SM90 (H100 / H200) fp8 kernel: our own sparse MLA decode over fp8 caches.

FlashInfer's Hopper MLA kernel runs an fp8 cache about 3x slower than a bf16 one. This kernel
(`ffi/sm90/sm90_fp8_kernel.cuh`, up to 16 heads) reads either fp8 layout directly: per-tensor e4m3 rows of
576 bytes and fp8_ds_mla rows of 656 bytes (512 e4m3, 4 fp32 tile scales, 64 bf16 RoPE). Producer
warps gather each tile of 64 top-k rows with bulk copies (one per row, completing on an mbarrier);
consumer warps feed the fp8 bytes to tensor-core MMAs with fp32 accumulation: for S = Q K^T, f16
MMAs on keys converted exactly by conversion instructions and Q held as f16 after a power-of-two row
scale; for P V, f16 MMAs on values converted the same way with P as f16 (e4m3), or bf16 MMAs on
values widened exactly with integer operations with P times the tile scales as bf16 (fp8_ds_mla).
The consumers split each tile by keys and dims so that every value is converted once per CTA. The
per-tensor k_scale multiplies the scores and the output; fp8_ds_mla's tile scales multiply the
128-dim partial dot products and, for P V, the probabilities.

With more than 16 heads, a second kernel (`ffi/sm90/sm90_fp8_wide_kernel.cuh`) runs 64 heads per CTA on
warpgroup MMAs (wgmma): a producer warpgroup converts each tile's rows once into shared memory (e4m3
exactly to f16; fp8_ds_mla dequantised to bf16, value times tile scale rounded once, next to its
bf16 RoPE dims), one consumer warpgroup computes S, the softmax and half of P V, the other the other
half. With two head groups (65 to 128 heads) the two CTAs of a token run as a 2-CTA cluster whose
producers each convert half of every tile into both CTAs' shared memory. Rounding fp8_ds_mla's
dequantised values to bf16 (FlashMLA's Hopper kernel does the same) costs accuracy that the first
kernel, which applies the tile scales in float32, does not: up to 2^-9 relative per key value,
which on the GPU tests' data moves lse by up to ~0.04 from the pure-JAX path (which dequantises in
float32); e4m3 values convert exactly in both kernels.

Work split: one CTA per (token, group of 16 or 64 heads, split of the top-k list). A static plan
per shape (T, H, K, SM count) adds splits when the tokens alone would leave SMs idle; a merge kernel
combines them. The bf16 path stays on FlashInfer's kernel (`sm90.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry
from .. import _validation as v

TARGET = "jax_sparse_mla_sm90_fp8_decode"
_LAYOUTS = {"fp8_e4m3": 0, "fp8_ds_mla": 1}
# Must match ffi/sm90/sm90_fp8_kernel.cuh: slots a split may cover, slots per tile.
MAX_KEYS_PER_SPLIT = 2048
TILE_KEYS = 64
# Tokens are the launch grid's z dimension (sm90_own_decode.cuh), which CUDA bounds at 65535.
MAX_TOKENS_PER_LAUNCH = 65535


@dataclasses.dataclass(frozen=True)
class Plan:
    """heads_per_cta: 16 or 64; the top-k list splits into num_splits ranges of
    keys_per_split."""

    heads_per_cta: int
    num_splits: int
    keys_per_split: int


@functools.lru_cache(maxsize=512)
def plan(num_tokens: int, num_heads: int, num_keys: int, sm_count: int) -> Plan:
    """Static work split for T tokens x H heads over K slots on a GPU with `sm_count` SMs.

    Splits only when T x head groups is below one CTA per SM, keeping at least two tiles per split
    (each CTA also loads its queries), and always enough to keep a split within MAX_KEYS_PER_SPLIT.
    """
    # More than 16 heads: the 64-head warpgroup-MMA kernel (sm90_fp8_wide_kernel.cuh). At 32 heads
    # it took 93.3 / 96.1 us (e4m3 / fp8_ds_mla, H200 kernel time, T=128) where a 32-head mma.sync
    # CTA took 92.2 / 117.2.
    heads_per_cta = 16 if num_heads <= 16 else 64
    tiles = max(1, -(-num_keys // TILE_KEYS))
    ctas = num_tokens * -(-num_heads // heads_per_cta)
    splits = max(1, min(tiles // 2, sm_count // max(ctas, 1)))
    splits = max(splits, -(-tiles * TILE_KEYS // MAX_KEYS_PER_SPLIT))
    tiles_per_split = -(-tiles // splits)
    return Plan(heads_per_cta=heads_per_cta, num_splits=-(-tiles // tiles_per_split),
                keys_per_split=tiles_per_split * TILE_KEYS)


def _sm90_fp8_kernel(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base):
    """Kernel contract in kernels/registry.py; q bf16 or fp8 [T, H, 576], cache fp8 e4m3 [.., .., 576] or
    uint8 fp8_ds_mla [.., .., 656]. More than MAX_TOKENS_PER_LAUNCH tokens run as several launches."""
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return (jnp.zeros((0, num_heads, v.MLA_V_DIM), jnp.bfloat16),
                jnp.zeros((0, num_heads), jnp.float32))
    piece = functools.partial(_sm90_fp8_launch, kv_rows=kv_cache.reshape(-1, kv_cache.shape[-1]),
                              bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, lse_base=lse_base)
    return registry.in_token_pieces(piece, MAX_TOKENS_PER_LAUNCH, q, indices, valid_counts)


def _sm90_fp8_launch(q, indices, valid_counts, *, kv_rows, bmm1_scale, bmm2_scale, lse_base):
    """One custom call over at most MAX_TOKENS_PER_LAUNCH tokens."""
    num_tokens, num_heads, _ = q.shape
    ds_mla = kv_rows.dtype == jnp.uint8
    num_keys = indices.shape[1]
    if valid_counts is None:  # a constant of the executable
        valid_counts = jnp.full((num_tokens,), num_keys, jnp.int32)
    p = plan(num_tokens, num_heads, num_keys, registry.device_sm_count())
    split_rows = (p.num_splits, num_tokens, num_heads) if p.num_splits > 1 else (1,)
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((num_tokens, num_heads, v.MLA_V_DIM), jnp.bfloat16),  # out
            jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32),  # lse
            # split partials (scratch): normalised outputs and their base-2 lse
            jax.ShapeDtypeStruct(split_rows + ((v.MLA_V_DIM,) if p.num_splits > 1 else ()),
                                 jnp.float32),
            jax.ShapeDtypeStruct(split_rows, jnp.float32),
        ),
        # The handler takes one [T, ...] problem; a batch of them runs one call per element.
        vmap_method="sequential",
    )
    out, lse, _partial_out, _partial_lse = call(
        q.astype(jnp.bfloat16),  # exact for an fp8 query; its q_scale is already in bmm1_scale
        kv_rows,
        indices,
        valid_counts,
        layout=np.int64(_LAYOUTS["fp8_ds_mla" if ds_mla else "fp8_e4m3"]),
        heads_per_cta=np.int64(p.heads_per_cta),
        num_splits=np.int64(p.num_splits),
        keys_per_split=np.int64(p.keys_per_split),
        score_scale_log2=np.float32(bmm1_scale * math.log2(math.e)),
        out_scale=np.float32(bmm2_scale),
        lse_base_e=np.bool_(lse_base == "e"),
    )
    return out, lse


def slower_than_pure_jax(problem: registry.Problem) -> str | None:
    """One token over an e4m3 cache: in a jitted loop of 200 single-token decodes on an H100
    (benchmarks/results/sm90_h100.json, decode_loop), pure JAX took 18.85 / 24.04 us per step at 16 /
    128 heads where this kernel and its merge took 48.82 / 42.48; their kernel times were about the
    same (15.27 / 20.88 against 15.5 / 22.3 us). Over fp8_ds_mla this kernel keeps one token: its
    kernels took 16.71 / 22.1 us against pure JAX's 28.62 / 41.4 (the steps 47.3 / 45.2 against
    31.1 / 45.3: the loop's launch gaps around the custom call, docs/kernels/sm90-fp8.md); on another
    H100 host, with shorter gaps, its steps were faster too: 25.5 / 25.6 against 31.1 / 45.1 us
    (docs/benchmarks.md, H100 section)."""
    if problem.num_tokens == 1 and problem.kv_layout == "fp8_e4m3":
        return ("pure JAX measured faster with one token over an e4m3 cache (H100 decode loop: "
                "18.9 / 24.0 against 48.8 / 42.5 us per step at 16 / 128 heads)")
    return None


registry.register_kernel(registry.SparseMLAKernel(
    name="sm90_fp8",
    native=True,
    capability_majors=(9,),
    kv_layouts=("fp8_e4m3", "fp8_ds_mla"),
    q_dtypes=("bfloat16", "float8_e4m3fn"),
    fn=_sm90_fp8_kernel,
    available=lambda: native.has_target(TARGET),
    slower_than_pure_jax=slower_than_pure_jax,
))
