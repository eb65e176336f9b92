"""Flax NNX layers for DeepSeek-V3.2 / GLM-5 style attention: MLA with the DSA lightning indexer.

The attention runs through FlashInferMLASparseImpl, so it uses the native kernel on a GPU that has one
and pure JAX elsewhere. Caches are explicit values (LayerCache) that the step returns updated, so a
jitted decode step can donate them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import _validation as _v
from .._validation import (DS_MLA_ROW_BYTES, FP8_PER_TENSOR_DTYPES, INDEXER_CACHE_ROW_BYTES,
                           INDEXER_HEAD_DIM, INDEXER_NUM_HEADS)
from ..backend import FlashInferMLASparseImpl, LayerScales
from ..kernels.registry import IMPLEMENTATIONS
from ..ops.indexer import (fold_indexer_weights, fp8_mqa_logits, fp8_paged_mqa_logits, quantize_indexer_q,
                           top_k_per_row, top_k_per_row_decode)
from ..ops.indexer_cache import cp_gather_indexer_k_quant_cache, indexer_k_quant_and_cache
from ..ops.kv_cache import concat_and_cache_mla, quantize_query_fp8
from ..ops.metadata import FlashInferMLASparseMetadata, leading_uniform_requests
from .config import MLAConfig, check_config
from .rope import apply_rope


# The indexer ops that Indexer calls, in the order a step reaches them (the prefill path calls the
# first two and the last two, a decode the first and the middle two). A per-op `implementation`
# mapping is checked against, and completed from, this tuple.
INDEXER_OPS: tuple[str, ...] = (
    "indexer_k_quant_and_cache",
    "cp_gather_indexer_k_quant_cache",
    "fp8_paged_mqa_logits",
    "top_k_per_row_decode",
    "fp8_mqa_logits",
    "top_k_per_row",
)

# What Indexer(implementation=...) and MLASparseAttention(indexer_implementation=...) take: one of
# "auto" | "xla" | "native" for every indexer op, or {op name in INDEXER_OPS: one of those}.
IndexerImplementation = Union[str, Mapping[str, str]]


def indexer_op_implementations(implementation: IndexerImplementation, *,
                               argument: str = "implementation") -> tuple[tuple[str, str], ...]:
    """The implementation of each indexer op: ((op, "auto" | "xla" | "native"), ...) in INDEXER_OPS
    order.

    implementation: one string applied to every op, or a mapping from op name to string; ops missing
    from the mapping get "auto". Raises TypeError (not a string or a mapping, or a non-string entry)
    or ValueError (an op name outside INDEXER_OPS, a value outside IMPLEMENTATIONS), naming
    `argument` (the caller's parameter name) so the message points at what the user wrote.
    The result is a tuple, not a dict, because it becomes a static attribute of an nnx.Module, and
    the module's graphdef must stay hashable (jit caches on it).
    """
    if isinstance(implementation, str):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"{argument} must be one of {IMPLEMENTATIONS} or a mapping from indexer op "
                             f"name to one of them, got {implementation!r}.")
        return tuple((op, implementation) for op in INDEXER_OPS)
    if not isinstance(implementation, Mapping):
        raise TypeError(f"{argument} must be a string {IMPLEMENTATIONS} or a mapping from indexer op "
                        f"name to one of them, got {type(implementation).__name__}: {implementation!r}.")
    unknown = [op for op in implementation if op not in INDEXER_OPS]
    if unknown:
        raise ValueError(f"{argument} names unknown indexer op(s) {unknown}; the indexer ops are "
                         f"{list(INDEXER_OPS)}.")
    for op, value in implementation.items():
        if not isinstance(value, str):
            raise TypeError(f"{argument}[{op!r}] must be a string, one of {IMPLEMENTATIONS}, got "
                            f"{type(value).__name__}: {value!r}.")
        if value not in IMPLEMENTATIONS:
            raise ValueError(f"{argument}[{op!r}] must be one of {IMPLEMENTATIONS}, got {value!r}.")
    return tuple((op, implementation.get(op, "auto")) for op in INDEXER_OPS)


class LayerCache(NamedTuple):
    """One layer's paged caches.

    kv_cache: the latent rows cat(kv_c, k_pe): [num_blocks, block_size, 576] bf16 or float8_e4m3fn
      (per-tensor scale), or uint8 [num_blocks, block_size, 656] for fp8_ds_mla.
    index_cache: the indexer's fp8 keys, uint8 [num_blocks, block_size, 132] in vLLM's byte layout
      (ops/indexer_cache.py); None for a layer that shares the indexer of the layer before it.
    """

    kv_cache: jax.Array
    index_cache: jax.Array | None


def empty_layer_cache(config: MLAConfig, num_blocks: int, block_size: int,
                      kv_cache_dtype: str = "auto", *, shared_indexer: bool = False) -> LayerCache:
    """Zeroed caches; kv_cache_dtype "auto" / "bfloat16", "fp8" / "fp8_e4m3" or "fp8_ds_mla".
    shared_indexer: the layer reuses the previous layer's top-k and keeps no index cache (None).
    num_blocks and block_size are positive ints (TypeError / ValueError naming them otherwise)."""
    check_config(config)
    num_blocks = _v.check_static_size("num_blocks", num_blocks)
    block_size = _v.check_static_size("block_size", block_size)
    _v.check_kv_cache_dtype(kv_cache_dtype)
    shared_indexer = _v.check_bool("shared_indexer", shared_indexer)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    if kv_cache_dtype == "fp8_ds_mla":
        kv_cache = jnp.zeros((num_blocks, block_size, DS_MLA_ROW_BYTES), jnp.uint8)
    else:
        kv_dtype = jnp.float8_e4m3fn if kv_cache_dtype in FP8_PER_TENSOR_DTYPES else jnp.bfloat16
        kv_cache = jnp.zeros((num_blocks, block_size, width), kv_dtype)
    index_cache = None if shared_indexer else jnp.zeros(
        (num_blocks, block_size, INDEXER_CACHE_ROW_BYTES), jnp.uint8)
    return LayerCache(kv_cache, index_cache)


_ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_construction(rngs, dtype) -> None:
    """A layer's rngs and parameter dtype, checked before flax draws any parameter."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}: {rngs!r}.")
    try:
        valid = jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in _ACTIVATION_DTYPES)
    except TypeError:
        valid = False
    if not valid:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}.")


def _check_tokens(config: MLAConfig, x, positions) -> tuple[jax.Array, jax.Array, int]:
    """x [T, hidden_size] float and positions [T] int32; returns them and T."""
    x = _v.as_array("x", x)
    _v.check_rank("x", x, 2)
    _v.check_last_dim("x", x, config.hidden_size)
    _v.check_dtype("x", x, _ACTIVATION_DTYPES)
    num_tokens = int(x.shape[0])
    positions = _v.int32_array("positions", positions, 1)
    _v.check_shape("positions", positions, (num_tokens,), "to match x's tokens")
    return x, positions, num_tokens


def _check_metadata(metadata, num_tokens: int, block_size: int, cache_name: str) -> None:
    """The metadata a layer step reads, against T and the cache's block size: its static sizes and
    array shapes at trace time (jitted too), and seq_lens <= max_seq_len when concrete (under jit
    the prefill path gathers at most max_seq_len keys of a request)."""
    if not isinstance(metadata, FlashInferMLASparseMetadata):
        raise TypeError(f"metadata must be a FlashInferMLASparseMetadata, got "
                        f"{type(metadata).__name__}.")
    metadata_block_size = _v.check_int("metadata.block_size", metadata.block_size, minimum=1)
    if metadata_block_size != block_size:
        raise ValueError(f"metadata.block_size={metadata_block_size} differs from the block size "
                         f"{block_size} of {cache_name} (axis 1).")
    slots = _v.as_array("metadata.slot_mapping", metadata.slot_mapping)
    _v.check_int_dtype("metadata.slot_mapping", slots)
    _v.check_shape("metadata.slot_mapping", slots, (num_tokens,), "to match x's tokens")
    req = _v.int32_array("metadata.req_id_per_token", metadata.req_id_per_token, 1)
    if req.shape[0] < num_tokens:
        raise ValueError(f"metadata.req_id_per_token has {req.shape[0]} entries for x's "
                         f"{num_tokens} tokens.")
    num_actual = _v.check_int("metadata.num_actual_tokens", metadata.num_actual_tokens, minimum=0)
    if num_actual > num_tokens:
        raise ValueError(f"metadata.num_actual_tokens={num_actual} exceeds x's {num_tokens} tokens.")
    table = _v.int32_array("metadata.block_table", metadata.block_table, 2)
    seq_lens = _v.int32_array("metadata.seq_lens", metadata.seq_lens, 1)
    if seq_lens.shape[0] != table.shape[0]:
        raise ValueError(f"metadata.seq_lens {tuple(seq_lens.shape)} and metadata.block_table "
                         f"{tuple(table.shape)} must have the same number of requests.")
    num_reqs = _v.check_int("metadata.num_reqs", metadata.num_reqs, minimum=0)
    _v.check_rows_cover("metadata.block_table", table, num_reqs, "requests (metadata.num_reqs)")
    _v.check_shape("metadata.query_start_loc",
                   _v.as_array("metadata.query_start_loc", metadata.query_start_loc),
                   (num_reqs + 1,), f"for num_reqs={num_reqs}")
    max_seq_len = _v.check_int("metadata.max_seq_len", metadata.max_seq_len, minimum=0)
    _v.check_values_at_most("metadata.seq_lens", seq_lens, max_seq_len, "metadata.max_seq_len")
    # The leading requests the indexer scores as decodes: a wrong count would give tokens another
    # request's selection, so they must agree with query_start_loc where its values are known.
    leading = _v.check_int("metadata.leading_reqs", metadata.leading_reqs, minimum=0)
    leading_len = _v.check_int("metadata.leading_query_len", metadata.leading_query_len, minimum=0)
    if leading > num_reqs:
        raise ValueError(f"metadata.leading_reqs={leading} exceeds metadata.num_reqs={num_reqs}.")
    qsl = _v.host_values(metadata.query_start_loc)
    if leading and qsl is not None and leading_uniform_requests(qsl) != (leading, leading_len):
        raise ValueError(f"metadata.leading_reqs={leading} and leading_query_len={leading_len} "
                         f"disagree with metadata.query_start_loc {qsl.tolist()}.")


def _check_index_cache(index_cache, num_blocks: int | None = None, block_size: int | None = None):
    index_cache = _v.as_array("index_cache", index_cache)
    _v.check_rank("index_cache", index_cache, 3)
    _v.check_dtype("index_cache", index_cache, (jnp.uint8,))
    _v.check_last_dim("index_cache", index_cache, INDEXER_CACHE_ROW_BYTES)
    _v.check_nonempty_axes("index_cache", index_cache, {0: "block", 1: "row per block"})
    if num_blocks is not None and tuple(index_cache.shape[:2]) != (num_blocks, block_size):
        raise ValueError(f"index_cache {tuple(index_cache.shape)} must have kv_cache's "
                         f"[num_blocks, block_size] = [{num_blocks}, {block_size}].")
    return index_cache


def _linear(in_features: int, out_features: int, rngs: nnx.Rngs, dtype) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=dtype,
                      rngs=rngs)


def _absorbed(kv_lora_rank: int, num_heads: int, head_dim: int, rngs: nnx.Rngs, dtype) -> nnx.Param:
    """[kv_lora_rank, H, head_dim], initialised as a Linear of kv_lora_rank inputs would be."""
    init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
    return nnx.Param(init(rngs.params(), (kv_lora_rank, num_heads, head_dim), dtype))


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """DeepSeek's reference `rotate_activation`: x [..., 128] -> (H_128 x) / sqrt(128), H the Sylvester
    (natural-order) Walsh-Hadamard matrix, H[i, j] = (-1)^popcount(i & j). Orthonormal, so exact dot
    products are unchanged; only the fp8 rounding of q and k differs. Computed in fp32 (the reference's
    fast_hadamard_transform runs in bf16), returned in x's dtype."""
    n = x.shape[-1]
    index = np.arange(n)
    signs = 1 - 2 * (np.vectorize(lambda v: bin(v).count("1"))(index[:, None] & index[None, :]) % 2)
    matrix = jnp.asarray(signs * n ** -0.5, jnp.float32)
    rotated = jnp.einsum("...d,ed->...e", x.astype(jnp.float32), matrix,
                         precision=jax.lax.Precision.HIGHEST)
    return rotated.astype(x.dtype)


class Indexer(nnx.Module):
    """DeepSeek-V3.2's lightning indexer as vLLM runs it: picks index_topk causal keys per token.

    Per token (x [D] the attention input, q_a the normalised query LoRA activations, p its position):

        q = wq_b(q_a) [H, 128]    k = LayerNorm(wk(x)) [128] (fp32, eps 1e-6)    w = weights_proj(x) [H] (fp32)
        RoPE on dims [0, qk_rope_head_dim) of q and k, NeoX pairing (config.indexer_rope_interleave),
        rounded to bf16; optionally the Hadamard rotation (config.index_hadamard)
        k -> indexer_k_quant_and_cache (fp8, power-of-two scale per token)
        q -> fp8 with a power-of-two scale per (token, head); w' = w * q_scale * 128^-0.5 * H^-0.5
        I[s] = k_scale[s] * sum_h w'[h] relu(q8[h] . k8[s]) over the causal keys s <= p; top-k of I.

    A step whose requests all bring the same number next_n <= max_decode_next_n of tokens is a decode:
    fp8_paged_mqa_logits + top_k_per_row_decode, with the metadata's seq_lens as context lengths.
    In a decode-first mixed step (metadata.leading_reqs requests of leading_query_len <=
    max_decode_next_n tokens each, then others, as vLLM orders a batch) the leading requests' tokens
    take the decode path and the rest the prefill path over the other requests alone. The prefill
    path: the keys of its R' requests are gathered once (cp_gather_indexer_k_quant_cache into
    N = R' * min(max_seq_len, W * block_size) rows, a static bound), then the tokens are scored in chunks of
    rows = max(1, max_logits_bytes // (4 N)) tokens (fp8_mqa_logits + top_k_per_row, one chunk per
    step of a scan), so that the [rows, N] fp32 logits stay within max(max_logits_bytes, 4 N) bytes.
    Token t of request r sees rows [cu[r], cu[r] + p_t + 1) of the gathered keys.

    implementation picks each indexer op's kernel: one string ("auto", "xla" or "native") for every op
    in INDEXER_OPS, or a mapping {op name: string} whose missing ops get "auto". A mapping lets
    "native" go to the ops that have a native kernel while the others (indexer_k_quant_and_cache and
    cp_gather_indexer_k_quant_cache have only pure JAX) run "xla" or "auto": "native" stays strict in
    the ops and raises where no native kernel fits. Unknown op names and values raise at construction.
    The resolved choice is `implementations` ((op, implementation) pairs in INDEXER_OPS order) and
    `implementation_for(op)`.
    """

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16,
                 max_decode_next_n: int = 2, max_logits_bytes: int = 512 << 20,
                 implementation: IndexerImplementation = "auto") -> None:
        # Checked before anything else so a bad value fails here, not at the first traced call.
        check_config(config)
        _check_construction(rngs, dtype)
        _v.check_int("max_decode_next_n", max_decode_next_n, minimum=1)
        _v.check_int("max_logits_bytes", max_logits_bytes, minimum=1)
        self.implementations = indexer_op_implementations(implementation)
        if config.index_head_dim != INDEXER_HEAD_DIM or config.index_n_heads not in INDEXER_NUM_HEADS:
            raise ValueError(
                f"the indexer ops take {' or '.join(map(str, INDEXER_NUM_HEADS))} heads of "
                f"{INDEXER_HEAD_DIM}; config has index_n_heads={config.index_n_heads}, "
                f"index_head_dim={config.index_head_dim}.")
        self.config = config
        self.max_decode_next_n = max_decode_next_n
        self.max_logits_bytes = max_logits_bytes
        self.wq_b = _linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, rngs, dtype)
        self.wk = _linear(config.hidden_size, config.index_head_dim, rngs, dtype)
        self.k_norm = nnx.LayerNorm(config.index_head_dim, epsilon=1e-6, dtype=jnp.float32,
                                    param_dtype=jnp.float32, rngs=rngs)
        self.weights_proj = _linear(config.hidden_size, config.index_n_heads, rngs, jnp.float32)

    def implementation_for(self, op: str) -> str:
        """The implementation ("auto" | "xla" | "native") this indexer passes to the op `op`, a name in
        INDEXER_OPS."""
        return dict(self.implementations)[op]

    def _position_encode(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the first qk_rope_head_dim dims, bf16, then the optional Hadamard rotation."""
        c = self.config
        rope = apply_rope(x[..., : c.qk_rope_head_dim].astype(jnp.float32), positions, c,
                          interleaved=c.indexer_rope_interleave)
        x = jnp.concatenate([rope, x[..., c.qk_rope_head_dim:].astype(jnp.float32)], -1)
        x = x.astype(jnp.bfloat16)
        return hadamard_rotate(x) if c.index_hadamard else x

    def project(self, x: jax.Array, q_a: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D], q_a [T, q_lora_rank], positions [T] -> (q [T, H, 128] bf16, k [T, 128] bf16,
        weights [T, H] fp32 (weights_proj(x), not yet folded))."""
        c = self.config
        q = self.wq_b(q_a).reshape(x.shape[0], c.index_n_heads, c.index_head_dim)
        k = self.k_norm(self.wk(x).astype(jnp.float32)).astype(jnp.bfloat16)
        weights = self.weights_proj(x.astype(jnp.float32))
        return self._position_encode(q, positions), self._position_encode(k, positions), weights

    def select(self, q: jax.Array, k: jax.Array, weights: jax.Array, positions: jax.Array,
               index_cache: jax.Array,
               metadata: FlashInferMLASparseMetadata) -> tuple[jax.Array, jax.Array]:
        """Writes k, scores and selects: -> (topk [T, index_topk] int32 request-local positions, -1
        padded (ascending positions, top_k_per_row's order), the new index cache).

        q [T, H, 128], k [T, 128] bf16 and weights [T, H] fp32 as `project` returns them; this step's
        keys are written before scoring, so a token sees itself.
        """
        num_tokens = q.shape[0]
        slots = metadata.slot_mapping[:num_tokens]
        index_cache = indexer_k_quant_and_cache(k[: slots.shape[0]], index_cache, slots,
                                                implementation=self.implementation_for(
                                                    "indexer_k_quant_and_cache"))
        q8, q_scale = quantize_indexer_q(q)
        weights = fold_indexer_weights(weights, q_scale)
        num_reqs = metadata.num_reqs
        next_n = metadata.max_query_len
        if (1 <= next_n <= self.max_decode_next_n and num_tokens == num_reqs * next_n
                and metadata.num_actual_tokens == num_tokens):
            return self._decode(q8, weights, index_cache, metadata, 0, num_reqs, next_n), index_cache
        decodes, decode_len = metadata.leading_reqs, metadata.leading_query_len
        if (0 < decodes < num_reqs and decode_len <= self.max_decode_next_n and num_tokens > 0
                and decodes * decode_len <= metadata.num_actual_tokens):
            # Tokens [0, split) are the leading requests' (all real: query_start_loc[decodes] = split);
            # leading requests without tokens are left out of the gather.
            split = decodes * decode_len
            if split == metadata.num_actual_tokens:  # the other requests bring no tokens
                head = self._decode(q8[:split], weights[:split], index_cache, metadata, 0, decodes,
                                    decode_len)
                padding = jnp.full((num_tokens - split, self.config.index_topk), -1, head.dtype)
                return jnp.concatenate([head, padding]), index_cache
            tail = self._prefill(q8[split:], weights[split:], positions[split:], index_cache,
                                 metadata, decodes, split)
            if split == 0:
                return tail, index_cache
            head = self._decode(q8[:split], weights[:split], index_cache, metadata, 0, decodes,
                                decode_len)
            return jnp.concatenate([head, tail]), index_cache
        return self._prefill(q8, weights, positions, index_cache, metadata, 0, 0), index_cache

    def _decode(self, q8, weights, index_cache, metadata, first_req, num_reqs, next_n):
        """Requests [first_req, first_req + num_reqs), next_n tokens each (q8 / weights: theirs)."""
        c = self.config
        table = metadata.block_table[first_req:first_req + num_reqs]
        context_lens = metadata.seq_lens[first_req:first_req + num_reqs]
        logits = fp8_paged_mqa_logits(
            q8.reshape(num_reqs, next_n, c.index_n_heads, c.index_head_dim), index_cache, weights,
            context_lens, table, max_context_len=table.shape[1] * index_cache.shape[1],
            implementation=self.implementation_for("fp8_paged_mqa_logits"))
        return top_k_per_row_decode(logits, context_lens, next_n=next_n, k=c.index_topk,
                                    implementation=self.implementation_for("top_k_per_row_decode"))

    def _prefill(self, q8, weights, positions, index_cache, metadata, first_req, first_token):
        """The step's tokens from first_token on (q8 / weights / positions: theirs), all of requests
        first_req .. num_reqs - 1: only those requests' keys are gathered."""
        c = self.config
        num_tokens = q8.shape[0]
        num_reqs = metadata.num_reqs - first_req
        table = metadata.block_table[first_req:metadata.num_reqs]
        covered = table.shape[1] * index_cache.shape[1]
        per_request = min(metadata.max_seq_len, covered) if metadata.max_seq_len > 0 else covered
        capacity = max(num_reqs * per_request, 1)
        seq_lens = metadata.seq_lens[first_req:metadata.num_reqs].astype(jnp.int32)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(seq_lens, dtype=jnp.int32)])
        k_fp8, k_scale = cp_gather_indexer_k_quant_cache(
            index_cache, table, cu, num_tokens=capacity,
            implementation=self.implementation_for("cp_gather_indexer_k_quant_cache"))
        # Rows past the batch's real tokens (padding) get an empty range and select nothing.
        num_real = metadata.num_actual_tokens - first_token
        real = jnp.arange(num_tokens) < num_real
        req = jnp.pad(metadata.req_id_per_token[first_token:], (0, max(num_tokens - num_real, 0)))
        req = jnp.where(real, req[:num_tokens] - first_req, 0)
        starts = jnp.where(real, cu[req], 0)
        ends = jnp.where(real, jnp.minimum(cu[req] + positions.astype(jnp.int32) + 1, cu[req + 1]), 0)

        rows = max(1, min(num_tokens, self.max_logits_bytes // (4 * capacity)))
        num_chunks = -(-num_tokens // rows)
        pad = num_chunks * rows - num_tokens

        def chunk(args):
            q_chunk, w_chunk, s_chunk, e_chunk = args
            logits = fp8_mqa_logits(q_chunk, k_fp8, k_scale, w_chunk, s_chunk, e_chunk,
                                    implementation=self.implementation_for("fp8_mqa_logits"))
            return top_k_per_row(logits, s_chunk, e_chunk, k=c.index_topk,
                                 implementation=self.implementation_for("top_k_per_row"))

        args = tuple(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
                     for a in (q8, weights, starts, ends))
        if num_chunks == 1:
            return chunk(args)
        args = tuple(a.reshape(num_chunks, rows, *a.shape[1:]) for a in args)
        return jax.lax.map(chunk, args).reshape(-1, c.index_topk)[:num_tokens]

    def __call__(self, x: jax.Array, q_a: jax.Array, positions: jax.Array, index_cache: jax.Array,
                 metadata: FlashInferMLASparseMetadata) -> tuple[jax.Array, jax.Array]:
        """x [T, D], q_a [T, q_lora_rank], positions [T] int32 -> (topk [T, index_topk] int32, the new
        index cache).

        Checked first (TypeError / ValueError naming the argument): x [T, hidden_size] and q_a [T,
        q_lora_rank] float, positions [T] int32, index_cache uint8 [num_blocks, block_size, 132]
        with metadata.block_size == block_size, metadata.slot_mapping [T], num_actual_tokens <= T,
        at least num_reqs rows in metadata.block_table (these under jit too), and concrete
        metadata.seq_lens <= metadata.max_seq_len."""
        c = self.config
        x, positions, num_tokens = _check_tokens(c, x, positions)
        q_a = _v.as_array("q_a", q_a)
        _v.check_rank("q_a", q_a, 2)
        _v.check_dtype("q_a", q_a, _ACTIVATION_DTYPES)
        _v.check_shape("q_a", q_a, (num_tokens, c.q_lora_rank), "([T, q_lora_rank])")
        index_cache = _check_index_cache(index_cache)
        _check_metadata(metadata, num_tokens, int(index_cache.shape[1]), "index_cache")
        q, k, weights = self.project(x, q_a, positions)
        return self.select(q, k, weights, positions, index_cache, metadata)


class MLASparseAttention(nnx.Module):
    """Multi-head latent attention with DSA sparse top-k attention and weight absorption.

    Query: x -> wq_a -> RMSNorm -> wq_b -> [T, H, qk_nope + qk_rope] (RoPE on the rope part).
    Latent KV: x -> wkv_a -> (RMSNorm(kv_c [512]), RoPE(k_pe [64])) written to the paged cache.
    W_UK is absorbed into the query (attention runs in the 576-wide latent space: MQA with one KV
    head), and W_UV is applied to the 512-wide attention output before wo.

    implementation picks the sparse-MLA kernel ("auto", "xla" or "native"); indexer_implementation the
    indexer ops' kernels, as Indexer's `implementation` takes it: one string for every op in
    INDEXER_OPS, or a mapping {op name: "auto" | "xla" | "native"} whose missing ops get "auto". They
    are apart so that "native" attention keeps working where some indexer ops have no native kernel
    (indexer_k_quant_and_cache and cp_gather_indexer_k_quant_cache have none anywhere), e.g.
    indexer_implementation={"fp8_paged_mqa_logits": "native", "top_k_per_row_decode": "native",
    "fp8_mqa_logits": "native", "top_k_per_row": "native"}. Bad values raise at construction.

    shared_indexer=True builds a layer without an indexer (no indexer weights, no index cache:
    empty_layer_cache(..., shared_indexer=True)) that attends over the top-k of the previous full
    layer, passed to __call__: GLM-5.2's "shared" layers (hf_config.indexer_types). At long context
    an indexer layer's select costs more than its sparse attention (docs/benchmarks.md), so such
    layers decode faster.
    """

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16,
                 kv_cache_dtype: str = "auto", q_scale: float = 1.0, k_scale: float = 1.0,
                 implementation: str = "auto",
                 indexer_implementation: IndexerImplementation = "auto",
                 shared_indexer: bool = False) -> None:
        check_config(config)
        _check_construction(rngs, dtype)
        _v.check_kv_cache_dtype(kv_cache_dtype)
        q_scale = _v.check_finite_positive_float("q_scale", q_scale)
        k_scale = _v.check_finite_positive_float("k_scale", k_scale)
        # Resolved here too so that an error names this layer's parameter, not the Indexer's.
        indexer_implementation = dict(indexer_op_implementations(
            indexer_implementation, argument="indexer_implementation"))
        if not isinstance(shared_indexer, bool):
            raise TypeError(f"shared_indexer must be a bool, got {shared_indexer!r}.")
        c = config
        self.config = config
        self.kv_cache_dtype = kv_cache_dtype
        self.scales = LayerScales(_q_scale_float=q_scale, _k_scale_float=k_scale)
        self.wq_a = _linear(c.hidden_size, c.q_lora_rank, rngs, dtype)
        self.q_norm = nnx.RMSNorm(c.q_lora_rank, epsilon=c.rms_norm_eps, dtype=dtype, param_dtype=dtype,
                                  rngs=rngs)
        self.wq_b = _linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, rngs, dtype)
        self.wkv_a = _linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, rngs, dtype)
        self.kv_norm = nnx.RMSNorm(c.kv_lora_rank, epsilon=c.rms_norm_eps, dtype=dtype,
                                   param_dtype=dtype, rngs=rngs)
        # kv_b_proj held as vLLM holds it after loading: W_UK and W_UV, each its own parameter in the
        # layout its einsum reads. Sliced per step out of one [kv_lora_rank, H (qk_nope + v_head)]
        # kernel, they were copied out by XLA in every step (2 x 16 MB per layer at DeepSeek-V3.2's
        # shapes, 19 us on an H100).
        self.w_uk = _absorbed(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim, rngs, dtype)
        self.w_uv = _absorbed(c.kv_lora_rank, c.num_heads, c.v_head_dim, rngs, dtype)
        self.wo = _linear(c.num_heads * c.v_head_dim, c.hidden_size, rngs, dtype)
        self.indexer = None if shared_indexer else Indexer(c, rngs=rngs, dtype=dtype,
                                                             implementation=indexer_implementation)
        self.impl = FlashInferMLASparseImpl(
            c.num_heads, c.kv_lora_rank + c.qk_rope_head_dim, c.softmax_scale, 1, None, None,
            kv_cache_dtype, None, "decoder", None, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim, implementation=implementation)

    def project_query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> (q_nope [T, H, qk_nope], q_pe [T, H, qk_rope] with RoPE, q_a [T, q_lora_rank])."""
        c = self.config
        q_a = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_a).reshape(x.shape[0], c.num_heads, c.qk_head_dim)
        return q[..., : c.qk_nope_head_dim], apply_rope(q[..., c.qk_nope_head_dim:], positions, c), q_a

    def project_latent_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (kv_c [T, kv_lora_rank], k_pe [T, qk_rope] with RoPE), both bf16."""
        c = self.config
        kv_a = self.wkv_a(x)
        kv_c = self.kv_norm(kv_a[:, : c.kv_lora_rank])
        k_pe = apply_rope(kv_a[:, c.kv_lora_rank:], positions, c)
        return kv_c.astype(jnp.bfloat16), k_pe.astype(jnp.bfloat16)

    def absorbed_weights(self) -> tuple[jax.Array, jax.Array]:
        """(W_UK [kv_lora_rank, H, qk_nope], W_UV [kv_lora_rank, H, v_head_dim]): kv_b_proj per head."""
        return self.w_uk[...], self.w_uv[...]

    def __call__(self, x: jax.Array, positions: jax.Array, cache: LayerCache,
                 metadata: FlashInferMLASparseMetadata,
                 topk_indices: jax.Array | None = None) -> tuple[jax.Array, LayerCache, jax.Array]:
        """x [T, D], positions [T] int32 -> (y [T, D], the updated cache, topk_indices [T, index_topk]).

        This step's tokens are written to the caches first, so a token can select itself. A layer
        built with shared_indexer=True runs no indexer and attends over `topk_indices` [T,
        index_topk] int32, the selection the previous full layer returned (GLM-5.2's shared layers),
        and returns it unchanged; a full layer computes its own and takes none.

        Checked first, as Indexer.__call__ checks its arguments, and cache.kv_cache against
        kv_cache_dtype, cache.index_cache against kv_cache's [num_blocks, block_size] (under jit
        too: the shapes are static).
        """
        c = self.config
        x, positions, num_tokens = _check_tokens(c, x, positions)
        if not isinstance(cache, LayerCache):
            raise TypeError(f"cache must be a LayerCache, got {type(cache).__name__}.")
        kv = _v.as_array("cache.kv_cache", cache.kv_cache)
        _v.check_rank("cache.kv_cache", kv, 3)
        _v.check_nonempty_axes("cache.kv_cache", kv, {0: "block", 1: "row per block"})
        if self.kv_cache_dtype == "fp8_ds_mla":
            _v.check_dtype("cache.kv_cache", kv, (jnp.uint8,))
            _v.check_last_dim("cache.kv_cache", kv, DS_MLA_ROW_BYTES)
        else:
            _v.check_dtype("cache.kv_cache", kv, (jnp.float8_e4m3fn,)
                           if self.kv_cache_dtype in FP8_PER_TENSOR_DTYPES
                           else (jnp.bfloat16, jnp.float16))
            _v.check_last_dim("cache.kv_cache", kv, c.kv_lora_rank + c.qk_rope_head_dim)
        if self.indexer is None:
            if cache.index_cache is not None:
                _check_index_cache(cache.index_cache, kv.shape[0], kv.shape[1])
        else:
            if cache.index_cache is None:
                raise ValueError("cache.index_cache is None, but this layer runs its own indexer: "
                                 "build the cache with empty_layer_cache(..., shared_indexer=False).")
            _check_index_cache(cache.index_cache, kv.shape[0], kv.shape[1])
        if self.indexer is None and topk_indices is None:
            raise ValueError("this layer shares the indexer of the layer before it "
                             "(shared_indexer=True): pass that layer's topk_indices.")
        if self.indexer is not None and topk_indices is not None:
            raise ValueError("this layer runs its own indexer: topk_indices must be None (build it "
                             "with shared_indexer=True to reuse another layer's selection).")
        if topk_indices is not None:
            topk = _v.int32_array("topk_indices", topk_indices, 2)
            _v.check_shape("topk_indices", topk, (num_tokens, c.index_topk), "([T, index_topk])")
        _check_metadata(metadata, num_tokens, int(kv.shape[1]), "cache.kv_cache")
        q_nope, q_pe, q_a = self.project_query(x, positions)
        kv_c, k_pe = self.project_latent_kv(x, positions)
        kv_cache = concat_and_cache_mla(kv_c, k_pe, cache.kv_cache, metadata.slot_mapping,
                                        kv_cache_dtype=self.kv_cache_dtype,
                                        k_scale=self.scales._k_scale_float)
        if self.indexer is None:
            index_cache = cache.index_cache
        else:
            topk_indices, index_cache = self.indexer(x, q_a, positions, cache.index_cache, metadata)
        w_uk, w_uv = self.absorbed_weights()
        ql_nope = jnp.einsum("thp,lhp->thl", q_nope, w_uk, preferred_element_type=jnp.float32)
        mqa_q = jnp.concatenate([ql_nope, q_pe.astype(jnp.float32)], -1).astype(jnp.bfloat16)
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            mqa_q = quantize_query_fp8(mqa_q, self.scales._q_scale_float)
        latent, _ = self.impl.forward_mqa(mqa_q, kv_cache, metadata, self.scales, topk_indices=topk_indices)
        heads = jnp.einsum("thl,lhv->thv", latent, w_uv, preferred_element_type=jnp.float32)
        y = self.wo(heads.reshape(x.shape[0], c.num_heads * c.v_head_dim).astype(x.dtype))
        return y, LayerCache(kv_cache, index_cache), topk_indices
