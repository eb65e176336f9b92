"""The SM100/SM103 native kernel: FlashInfer's TRTLLM-gen sparse MLA decode behind an XLA FFI call.

This is the kernel the seed (vLLM's FlashInferMLASparseImpl) calls through
`trtllm_batch_decode_with_kv_cache_mla(..., sparse_mla_top_k=K)`. The handler in
`ffi/trtllm_gen_decode.cu` fills FlashInfer's TllmGenFmhaRunnerParams as FlashInfer's launcher does and
runs its runner on the XLA stream; the kernels are FlashInfer's cubins, read from disk by a C++ callback
(`ffi/common/cubin_loader.cc`: $FLASHINFER_CUBIN_DIR, the flashinfer-cubin package, ~/.cache/flashinfer/
cubins; sha256-checked against the kernel table, never downloaded).

The handler is compiled against flashinfer-python 0.6.13's launcher headers and the kernel table of
flashinfer-cubin 0.6.13, the newest release of that package (ffi/sm100/trtllm_gen_table.py); the cubins
must come from flashinfer-cubin of that version (build_info()["trtllm_gen_flashinfer_version"]).
`_jax_sparse_mla_native.trtllm_gen_select_kernel` runs the handler's set-up and FlashInfer's kernel
selection on the host up to the launch, without a GPU (tests/kernels/test_sm100_kernel_table.py).

Per call, as vLLM does it: one "request" per token (q_len = 1), block_tables = the token's physical slots,
seq_lens = its number of valid slots, max_seq_len = sparse_mla_top_k = K. The kernel reads the first
seq_lens[t] entries of a row and its behaviour on -1 inside that prefix is not documented, so the valid
slots are first compacted to the front (stable, in XLA), with -1 after them as vLLM passes. A token
with no valid slot gets seq_lens = 0 (vLLM does the same) and its output is then forced to out = 0,
lse = -inf, as vLLM's impl does. The kernel's LSE is base 2; it is converted here. One request per
token makes the batch T, and FlashInfer launches the requests along the grid's z dimension, so a call
of more than MAX_TOKENS_PER_LAUNCH tokens runs as several launches (`registry.in_token_pieces`).

Not run on SM100 hardware here: compiled for sm_100a/sm_103a; kernel selection, cubin lookup and launch
set-up checked on CPU only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry
from .. import _validation as v

TARGET = "jax_sparse_mla_trtllm_gen_decode"
# The multi-CTA scratch: vLLM gives FlashInfer a 128 MiB workspace (vLLM source; the launcher lets the
# scratch take whatever remains after the softmax-stats carve-out).
SCRATCH_BYTES = 128 << 20
# launcher.cu: softmax stats are [H, B, round_up(q_len, 256)] float2 plus a 1 MiB guard.
_SOFTMAX_STATS_GUARD = 1 << 20
# An upper bound on any GPU's SM count, for the counter buffer's size (the handler checks the real one).
_MAX_SM_COUNT = 1024
PAGE_SIZES = (32, 64)
# Requests (here tokens) are the launch grid's z dimension (fmhaKernels.cuh: numCtasZ = mBatchSize),
# which CUDA bounds at 65535; the handler rejects more (kMaxBatch in trtllm_gen_decode.cu).
MAX_TOKENS_PER_LAUNCH = 65535
# vLLM's rule for this kernel: the query has the cache's dtype (an fp8 cache needs an fp8 query).
QUERY_DTYPE_FOR_LAYOUT = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp8_e4m3": "float8_e4m3fn",
}
# Cache dtypes FlashInfer 0.6.13's TRTLLM-gen kernel table has sparse MLA kernels for (it has none
# for float16: the launcher answers "Missing TRTLLM-GEN kernel (decode)" for every f16 shape).
TABLE_KV_LAYOUTS = ("bfloat16", "fp8_e4m3")


def heads_in_table(num_heads: int) -> bool:
    """Whether FlashInfer's sparse MLA kernel selection finds a kernel for H heads (one KV head).

    fmhaKernels.cuh (0.6.13) picks SwapsMmaAb kernels with tileSizeQ = H or H/2 for H <= 32 (the table
    has tiles 8, 16, 32; other H fail its power-of-2 check) and KeepsMmaAb kernels with 64-head tiles
    above (H <= 64 fits one tile; more heads need a multiple of 64). Proven against the table by
    tests/kernels/test_sm100_kernel_table.py for H = 1..520.
    """
    if num_heads <= 32:
        return num_heads in (8, 16, 32)
    return num_heads <= 64 or num_heads % 64 == 0


def check_problem(problem: registry.Problem, capability: tuple[int, int] | None = None) -> str | None:
    """None when the TRTLLM-gen sparse kernel takes this problem, else why not.

    FlashInfer's rules (mla/_core.py, kernelParams.h): page size 32 or 64; not 64 < H < 128; K a positive
    multiple of 4 (16-byte index loads); q of the cache's dtype; and what its kernel table holds: bf16
    or fp8 e4m3, H as in heads_in_table. With a capability, also that the extension holds machine code
    for it and a TRTLLM-gen kernel table.
    """
    want_q = QUERY_DTYPE_FOR_LAYOUT.get(problem.kv_layout)
    if want_q is None:
        return f"kv layout {problem.kv_layout!r} is not one of {tuple(QUERY_DTYPE_FOR_LAYOUT)}"
    if problem.q_dtype != want_q:
        return (f"a {problem.kv_layout} cache needs a {want_q} query (trtllm-gen does not mix query and "
                f"cache dtypes), got {problem.q_dtype}")
    if problem.block_size not in PAGE_SIZES:
        return f"block_size must be 32 or 64, got {problem.block_size}"
    if 64 < problem.num_heads < 128:
        return f"64 < num_heads < 128 is not supported, got num_heads={problem.num_heads}"
    if problem.num_heads <= 0:
        return f"num_heads must be positive, got {problem.num_heads}"
    if problem.num_keys <= 0 or problem.num_keys % 4:
        return f"the top-k width K must be a positive multiple of 4, got K={problem.num_keys}"
    if problem.kv_layout not in TABLE_KV_LAYOUTS:
        return (f"Missing TRTLLM-GEN kernel (decode): FlashInfer's TRTLLM-gen kernel table has no "
                f"sparse MLA kernel for a {problem.kv_layout} query and cache (only bfloat16, fp8_e4m3)")
    if not heads_in_table(problem.num_heads):
        return (f"FlashInfer's TRTLLM-gen sparse MLA kernels take 8, 16, 32, 33..64 or a multiple of "
                f"64 heads, got num_heads={problem.num_heads}")
    if capability is not None:
        if not native.built_for("sm100", capability):
            return (f"the extension has no sm_{capability[0]}{capability[1]}a code "
                    f"(built for {native.build_info().get('sm100', 'none')})")
        if not native.build_info().get("trtllm_gen_num_kernels"):
            return ("the extension was built without FlashInfer's TRTLLM-gen kernel table "
                    "(flashInferMetaInfo.h of flashinfer-cubin; ffi/sm100/trtllm_gen_table.py)")
    return None


def compact_slots(indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Moves each row's valid (>= 0) slots to the front, keeping their order; -1 after them.

    indices: [T, K] int32 with -1 holes anywhere. Returns (compacted [T, K] int32, counts [T] int32).
    """
    num_tokens, num_keys = indices.shape
    valid = indices >= 0
    counts = valid.sum(axis=1, dtype=jnp.int32)
    positions = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    target = jnp.where(valid, positions, num_keys)  # invalid entries go to a dropped column
    rows = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], indices.shape)
    compacted = jnp.full((num_tokens, num_keys + 1), -1, jnp.int32).at[rows, target].set(indices)
    return compacted[:, :num_keys], counts


def workspace_bytes(num_tokens: int, num_heads: int) -> int:
    softmax_stats = 8 * num_heads * num_tokens * 256 + _SOFTMAX_STATS_GUARD
    return softmax_stats + SCRATCH_BYTES + 256  # + alignment slack for the two carve-outs


def counter_bytes(num_tokens: int, num_heads: int) -> int:
    slots = max(num_tokens * num_heads, _MAX_SM_COUNT)
    return -(-slots // 8) * 8 * 4


def _out_dtype(q: jax.Array) -> jnp.dtype:
    """The contract's output dtype: f16 for an f16 query, else bf16 (the kernel writes bf16)."""
    return jnp.dtype(jnp.float16 if q.dtype == jnp.float16 else jnp.bfloat16)


def _trtllm_gen_kernel(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base):
    """TRTLLM-gen kernel (contract in kernels/registry.py): q and cache both bf16, both f16 or both fp8
    e4m3. More than MAX_TOKENS_PER_LAUNCH tokens run as several launches."""
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return (jnp.zeros((0, num_heads, v.MLA_V_DIM), _out_dtype(q)),
                jnp.zeros((0, num_heads), jnp.float32))
    piece = functools.partial(_trtllm_gen_launch, kv_cache=kv_cache, bmm1_scale=bmm1_scale,
                              bmm2_scale=bmm2_scale, lse_base=lse_base)
    return registry.in_token_pieces(piece, MAX_TOKENS_PER_LAUNCH, q, indices, valid_counts)


def _trtllm_gen_launch(q: jax.Array, indices: jax.Array, valid_counts: jax.Array | None, *,
                       kv_cache: jax.Array, bmm1_scale: float, bmm2_scale: float,
                       lse_base: str) -> tuple[jax.Array, jax.Array]:
    """One custom call over 1 to MAX_TOKENS_PER_LAUNCH tokens: q [T, H, 576], indices [T, K],
    valid_counts [T] or None -> (out [T, H, 512], lse [T, H]); the workspace follows this T."""
    num_tokens, num_heads, _ = q.shape
    num_keys = indices.shape[1]
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    slots, counts = compact_slots(registry.sanitize_indices(indices, num_slots, valid_counts))
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((num_tokens, 1, num_heads, v.MLA_V_DIM), jnp.bfloat16),  # out
            jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32),  # lse, base 2
            jax.ShapeDtypeStruct((workspace_bytes(num_tokens, num_heads),), jnp.uint8),  # scratch
            jax.ShapeDtypeStruct((counter_bytes(num_tokens, num_heads),), jnp.uint8),  # scratch
        ),
        vmap_method="sequential",
    )
    out, lse, _workspace, _counter = call(
        q[:, None],  # [T, q_len = 1, H, 576]: one request per token, as vLLM calls it
        kv_cache,
        slots[:, None],  # [T, 1, K]
        counts,  # seq_lens [T]
        bmm1_scale=np.float32(bmm1_scale),
        bmm2_scale=np.float32(bmm2_scale),
        sparse_mla_top_k=np.int64(num_keys),
    )
    out = out[:, 0]
    if lse_base == "e":
        lse = lse * np.float32(math.log(2.0))
    out, lse = registry.mask_empty_rows(out, lse, counts == 0)
    return out.astype(_out_dtype(q)), lse


registry.register_kernel(registry.SparseMLAKernel(
    name="sm100_flashinfer_trtllm_gen",
    native=True,
    capability_majors=(10,),
    kv_layouts=tuple(QUERY_DTYPE_FOR_LAYOUT),
    q_dtypes=tuple(QUERY_DTYPE_FOR_LAYOUT.values()),
    fn=_trtllm_gen_kernel,
    available=lambda: native.has_target(TARGET),
    check=check_problem,
))
