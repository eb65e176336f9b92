"""Flax NNX layers for DeepSeek-V3.2 / GLM-5 style attention: MLA with the DSA lightning indexer.

The attention runs through FlashInferMLASparseImpl, so it uses the native kernel on a GPU that has one
and pure JAX elsewhere. Caches are explicit values (LayerCache) that the step returns updated, so a
jitted decode step can donate them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..backend import FlashInferMLASparseImpl, LayerScales
from ..ops.kv_cache import concat_and_cache_mla, quantize_query_fp8, scatter_rows
from ..ops.metadata import FlashInferMLASparseMetadata
from .config import MLAConfig
from .rope import apply_rope


class LayerCache(NamedTuple):
    """One layer's paged caches: kv_cache [num_blocks, block_size, 576] (bf16 or fp8) holds the latent
    rows cat(kv_c, k_pe); index_cache [num_blocks, block_size, index_head_dim] bf16 the indexer keys."""

    kv_cache: jax.Array
    index_cache: jax.Array


def empty_layer_cache(config: MLAConfig, num_blocks: int, block_size: int,
                      kv_cache_dtype: str = "auto") -> LayerCache:
    kv_dtype = jnp.float8_e4m3fn if kv_cache_dtype in ("fp8", "fp8_e4m3") else jnp.bfloat16
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return LayerCache(jnp.zeros((num_blocks, block_size, width), kv_dtype),
                      jnp.zeros((num_blocks, block_size, config.index_head_dim), jnp.bfloat16))


def _linear(in_features: int, out_features: int, rngs: nnx.Rngs, dtype) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=dtype,
                      rngs=rngs)


class Indexer(nnx.Module):
    """DeepSeek's lightning indexer: I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s]) over causal keys s.

    Its RoPE covers the first qk_rope_head_dim dims of each query/key (rope first, as in DeepSeek-V3.2).
    """

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16) -> None:
        self.config = config
        self.wq_b = _linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, rngs, dtype)
        self.wk = _linear(config.hidden_size, config.index_head_dim, rngs, dtype)
        self.k_norm = nnx.LayerNorm(config.index_head_dim, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.weights_proj = _linear(config.hidden_size, config.index_n_heads, rngs, dtype)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        rope = self.config.qk_rope_head_dim
        return jnp.concatenate([apply_rope(x[..., :rope], positions, self.config), x[..., rope:]], -1)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [T, D], positions [T] -> index keys [T, index_head_dim] bf16."""
        return self._rope(self.k_norm(self.wk(x)), positions).astype(jnp.bfloat16)

    def select(self, x: jax.Array, q_a: jax.Array, positions: jax.Array, index_cache: jax.Array,
               metadata: FlashInferMLASparseMetadata) -> jax.Array:
        """Top-k causal keys of every token: [T, index_topk] int32 request-local positions, -1 padded.

        x [T, D]; q_a [T, q_lora_rank] (the normalised query LoRA activations); positions [T] int32;
        index_cache already holds this step's keys. Each token scores every position its request's
        block table covers, so the cost is T x (table width x block size).
        """
        c = self.config
        num_tokens = x.shape[0]
        q = self._rope(self.wq_b(q_a).reshape(num_tokens, c.index_n_heads, c.index_head_dim), positions)
        weights = self.weights_proj(x).astype(jnp.float32) * (c.index_n_heads * c.index_head_dim) ** -0.5
        block_size = metadata.block_size
        tables = metadata.block_table[metadata.req_id_per_token[:num_tokens]]  # [T, W]
        key_positions = jnp.arange(tables.shape[1] * block_size, dtype=jnp.int32)
        slots = tables[:, key_positions // block_size] * block_size + key_positions % block_size
        keys = index_cache.reshape(-1, c.index_head_dim)[slots]  # [T, S, index_head_dim]
        per_head = jnp.einsum("thd,tsd->ths", q, keys, preferred_element_type=jnp.float32)
        scores = jnp.einsum("ths,th->ts", jax.nn.relu(per_head), weights)
        scores = jnp.where(key_positions[None, :] <= positions[:, None], scores, -jnp.inf)
        kept = min(c.index_topk, key_positions.shape[0])
        top_scores, top_positions = jax.lax.top_k(scores, kept)
        selected = jnp.where(top_scores > -jnp.inf, top_positions, -1).astype(jnp.int32)
        return jnp.pad(selected, ((0, 0), (0, c.index_topk - kept)), constant_values=-1)


class MLASparseAttention(nnx.Module):
    """Multi-head latent attention with DSA sparse top-k attention and weight absorption.

    Query: x -> wq_a -> RMSNorm -> wq_b -> [T, H, qk_nope + qk_rope] (RoPE on the rope part).
    Latent KV: x -> wkv_a -> (RMSNorm(kv_c [512]), RoPE(k_pe [64])) written to the paged cache.
    W_UK is absorbed into the query (attention runs in the 576-wide latent space: MQA with one KV
    head), and W_UV is applied to the 512-wide attention output before wo.
    """

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16,
                 kv_cache_dtype: str = "auto", q_scale: float = 1.0, k_scale: float = 1.0,
                 implementation: str = "auto") -> None:
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
        self.wkv_b = _linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), rngs, dtype)
        self.wo = _linear(c.num_heads * c.v_head_dim, c.hidden_size, rngs, dtype)
        self.indexer = Indexer(c, rngs=rngs, dtype=dtype)
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
        """(W_UK [kv_lora_rank, H, qk_nope], W_UV [kv_lora_rank, H, v_head_dim]) split from wkv_b."""
        c = self.config
        w = self.wkv_b.kernel[...].reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., : c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def __call__(self, x: jax.Array, positions: jax.Array, cache: LayerCache,
                 metadata: FlashInferMLASparseMetadata) -> tuple[jax.Array, LayerCache, jax.Array]:
        """x [T, D], positions [T] int32 -> (y [T, D], the updated cache, topk_indices [T, index_topk]).

        This step's tokens are written to the caches first, so a token can select itself.
        """
        c = self.config
        q_nope, q_pe, q_a = self.project_query(x, positions)
        kv_c, k_pe = self.project_latent_kv(x, positions)
        kv_cache = concat_and_cache_mla(kv_c, k_pe, cache.kv_cache, metadata.slot_mapping,
                                        kv_cache_dtype=self.kv_cache_dtype,
                                        k_scale=self.scales._k_scale_float)
        index_cache = scatter_rows(cache.index_cache, metadata.slot_mapping,
                                   self.indexer.keys(x, positions))
        topk_indices = self.indexer.select(x, q_a, positions, index_cache, metadata)
        w_uk, w_uv = self.absorbed_weights()
        ql_nope = jnp.einsum("thp,lhp->thl", q_nope, w_uk, preferred_element_type=jnp.float32)
        mqa_q = jnp.concatenate([ql_nope, q_pe.astype(jnp.float32)], -1).astype(jnp.bfloat16)
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            mqa_q = quantize_query_fp8(mqa_q, self.scales._q_scale_float)
        latent, _ = self.impl.forward_mqa(mqa_q, kv_cache, metadata, self.scales, topk_indices=topk_indices)
        heads = jnp.einsum("thl,lhv->thv", latent, w_uv, preferred_element_type=jnp.float32)
        y = self.wo(heads.reshape(x.shape[0], c.num_heads * c.v_head_dim).astype(x.dtype))
        return y, LayerCache(kv_cache, index_cache), topk_indices
