"""Generate tokens with a small DeepSeek-V3.2-style decoder whose attention is jax-sparse-mla's sparse MLA.

    python examples/generate.py                                   # tiny preset, CPU, well under a minute
    python examples/generate.py --preset deepseek-v3.2 --batch 1 --context 65536  # TTFT, then decode
    python examples/generate.py --preset deepseek-v3.2 --batch 32 --context 65536 --fill-context
    python examples/generate.py --kv-cache-dtype fp8_ds_mla       # vLLM's production MLA cache layout
    python examples/generate.py --steps-per-call 4                # four decode steps per jitted call

Random weights from a seed and a toy vocabulary: the tokens mean nothing, the path is the real one.
Each request's prompt (the tiny preset: random lengths; the large presets: --context tokens) goes
through the model in chunks of --prefill-chunk tokens, as vLLM's chunked prefill runs it: each chunk one
jitted step over the cache written so far (static shapes: the last chunk is padded; caches donated).
The example prints the time to first token, then decodes with a jitted step from the prefilled caches,
driven as a serving loop should drive JAX: one dispatch per call and no host work or wait between calls
(make_decode_step); --steps-per-call N runs N decode steps per call (a lax.scan with on-device greedy
sampling), and the ms/step it prints is still per decode step.
--fill-context writes random latent rows for the large presets' context instead (fast, for decode
timings). The indexer is DeepSeek-V3.2's as vLLM runs it (fp8 keys in a uint8 index cache, the prefill
through the gathered-key logits, decode through the paged logits). Before generating, the example
checks one attention layer against dense MLA attention restricted to the indexer's selection, and exits
non-zero if they differ.

--implementation picks the kernels: "xla" runs everything in pure JAX, "auto" lets each op take a native
kernel where one fits the device, and "native" demands the native sparse-MLA kernel and the native
kernel of every indexer op that has one registered. Two indexer ops, indexer_k_quant_and_cache and
cp_gather_indexer_k_quant_cache, have no native kernel anywhere, so with "native" they run pure JAX
(the example says so when it starts); see indexer_implementations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sparse_mla as jsm
from jax_sparse_mla.flax import PRESETS, LayerCache, MLAConfig, MLASparseAttention, empty_layer_cache
from jax_sparse_mla.flax import hf_config
from jax_sparse_mla.flax.layers import INDEXER_OPS
from jax_sparse_mla.kernels import registry
from jax_sparse_mla.kernels.registry import IMPLEMENTATIONS, registered_op_kernels
from jax_sparse_mla.ops.ds_mla_workspace import use_bf16_workspace
from jax_sparse_mla.ops.kv_cache import dequantize_ds_mla_rows

BLOCK_SIZE = 64


def has_native_kernel(op: str) -> bool:
    """Whether a native kernel is registered for the indexer op `op` (registration only: whether it
    fits this device is the op's choice at trace time)."""
    return any(kernel.native for kernel in registered_op_kernels(op))


def indexer_implementations(flag: str) -> dict[str, str]:
    """The --implementation flag -> {indexer op in INDEXER_OPS: "auto" | "xla" | "native"}.

    "auto" and "xla" go to every op unchanged. "native" goes to the ops with a registered native
    kernel; the others get "xla", because "native" is strict in the ops (it raises where no native
    kernel fits) and indexer_k_quant_and_cache / cp_gather_indexer_k_quant_cache have only pure JAX.
    """
    if flag not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {flag!r}.")
    if flag != "native":
        return {op: flag for op in INDEXER_OPS}
    return {op: "native" if has_native_kernel(op) else "xla" for op in INDEXER_OPS}


def describe_indexer_implementations(flag: str) -> str:
    """One line: what the indexer ops run under --implementation flag (indexer_implementations(flag))."""
    if flag == "xla":
        return "indexer: every op runs pure JAX"
    pure = [op for op in INDEXER_OPS if not has_native_kernel(op)]
    native = [op for op in INDEXER_OPS if op not in pure]
    rest = ("run native" if flag == "native" else
            "run native where a kernel fits this device, else pure JAX")
    if not pure:
        return f"indexer: every op has a native kernel; they {rest}"
    if not native:
        return "indexer: no indexer op has a native kernel; they all run pure JAX"
    return (f"indexer: {', '.join(pure)} run pure JAX (no native kernel exists for them); "
            f"the other indexer ops ({', '.join(native)}) {rest}")


# --kv-cache-dtype -> (the kernel registry's cache layout, the query dtype the layer passes with it).
_ATTENTION_LAYOUTS = {"auto": ("bfloat16", "bfloat16"), "fp8": ("fp8_e4m3", "float8_e4m3fn"),
                      "fp8_ds_mla": ("fp8_ds_mla", "bfloat16")}


def describe_attention(config: MLAConfig, kv_cache_dtype: str, implementation: str, layout,
                       steps: Mapping[str, int]) -> str:
    """One line: the sparse-attention kernel each kind of step runs here ({"decode": tokens, ...}),
    as forward_mqa picks it (the registry's choice; an fp8_ds_mla prefill through the bf16 workspace)."""
    kv_layout, q_dtype = _ATTENTION_LAYOUTS[kv_cache_dtype]
    cache = jax.ShapeDtypeStruct((layout.num_blocks, BLOCK_SIZE, 656 if kv_layout == "fp8_ds_mla" else 576),
                                 jnp.uint8 if kv_layout == "fp8_ds_mla" else jnp.bfloat16)
    parts = []
    for step, tokens in steps.items():
        # A prefill chunk is a one-request view of the batch (chunk_metadata); a decode step all of it.
        table = jax.ShapeDtypeStruct((1 if step == "prefill" else layout.batch,
                                      layout.blocks_per_request), jnp.int32)
        workspace = use_bf16_workspace(cache, table,
                                       num_tokens=tokens, num_heads=config.num_heads,
                                       topk=config.index_topk, q_dtype=jnp.dtype(q_dtype),
                                       implementation=implementation)
        problem = registry.Problem(num_tokens=tokens, num_heads=config.num_heads,
                                   num_keys=config.index_topk, block_size=BLOCK_SIZE,
                                   kv_layout="bfloat16" if workspace else kv_layout, q_dtype=q_dtype)
        kernel = registry.select_kernel(problem.kv_layout, q_dtype, implementation, problem)
        name = "pure JAX" if not kernel.native else kernel.name
        parts.append(f"{step} steps of {tokens} tokens on {name}"
                     + (" over a bf16 workspace of the fp8_ds_mla rows" if workspace else ""))
    return "sparse attention: " + "; ".join(parts)


class DecoderBlock(nnx.Module):
    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, kv_cache_dtype: str, implementation: str,
                 indexer_implementation: Mapping[str, str] | str, shared_indexer: bool = False):
        d = config.hidden_size
        norm = lambda: nnx.RMSNorm(d, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.attn_norm, self.mlp_norm = norm(), norm()
        self.attn = MLASparseAttention(config, rngs=rngs, kv_cache_dtype=kv_cache_dtype,
                                       implementation=implementation,
                                       indexer_implementation=indexer_implementation,
                                       shared_indexer=shared_indexer)
        self.mlp_in = nnx.Linear(d, d, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.mlp_out = nnx.Linear(d, d, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x, positions, cache, metadata, topk=None):
        """topk: the previous full layer's selection, for a block whose attention shares it."""
        attn_out, cache, topk = self.attn(self.attn_norm(x), positions, cache, metadata, topk)
        x = x + attn_out
        return x + self.mlp_out(jax.nn.silu(self.mlp_in(self.mlp_norm(x)))), cache, topk


class Decoder(nnx.Module):
    def __init__(self, config: MLAConfig, num_layers: int, vocab_size: int, *, rngs: nnx.Rngs,
                 kv_cache_dtype: str = "auto", implementation: str = "auto",
                 indexer_implementation: Mapping[str, str] | str | None = None,
                 indexer_types: tuple[str, ...] | None = None):
        """implementation: the sparse attention's; indexer_implementation: the indexer ops' (None:
        indexer_implementations(implementation)); indexer_types: "full" or "shared" per layer
        (None: all full), as hf_config.indexer_types gives them."""
        if indexer_implementation is None:
            indexer_implementation = indexer_implementations(implementation)
        self.embed = nnx.Embed(vocab_size, config.hidden_size, dtype=jnp.bfloat16,
                               param_dtype=jnp.bfloat16, rngs=rngs)
        indexer_types = indexer_types or ("full",) * num_layers
        if len(indexer_types) != num_layers or indexer_types[0] != "full":
            raise ValueError(f"indexer_types must give {num_layers} layers, the first 'full': "
                             f"{indexer_types!r}")
        self.blocks = nnx.List([DecoderBlock(config, rngs=rngs, kv_cache_dtype=kv_cache_dtype,
                                             implementation=implementation,
                                             indexer_implementation=indexer_implementation,
                                             shared_indexer=kind == "shared")
                                for kind in indexer_types])
        self.final_norm = nnx.RMSNorm(config.hidden_size, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                      rngs=rngs)

    def __call__(self, tokens, positions, caches, metadata):
        """tokens, positions [T] int32 -> (logits [T, vocab] f32, new caches, top-k per layer)."""
        x = self.embed(tokens)
        new_caches, topks, topk = [], [], None
        for block, cache in zip(self.blocks, caches):
            # A shared layer takes the selection of the full layer before it.
            x, cache, topk = block(x, positions, cache, metadata,
                                   topk if block.attn.indexer is None else None)
            new_caches.append(cache)
            topks.append(topk)
        logits = self.embed.attend(self.final_norm(x)).astype(jnp.float32)
        return logits, tuple(new_caches), tuple(topks)


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Request r owns blocks 1 + r * W ... (block 0 is the null block): block_table [B, W] int32."""

    batch: int
    blocks_per_request: int

    @property
    def num_blocks(self) -> int:
        return 1 + self.batch * self.blocks_per_request

    @property
    def block_table(self) -> np.ndarray:
        table = 1 + np.arange(self.batch * self.blocks_per_request, dtype=np.int32)
        return table.reshape(self.batch, self.blocks_per_request)

    def slots(self, req_ids, positions):
        table = jnp.asarray(self.block_table)
        return table[req_ids, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def step_metadata(layout: PagedLayout, config: MLAConfig, req_ids, positions, query_lens_host):
    """Metadata for one step: tokens [T] of requests req_ids at positions (decodes or a prefill)."""
    qsl = np.concatenate([[0], np.cumsum(query_lens_host)]).astype(np.int32)
    common = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray(qsl), seq_lens=jnp.zeros(layout.batch, jnp.int32),
        block_table_tensor=jnp.asarray(layout.block_table),
        slot_mapping=layout.slots(req_ids, positions).astype(jnp.int32),
        num_reqs=layout.batch, num_actual_tokens=int(qsl[-1]), max_query_len=int(max(query_lens_host)),
        max_seq_len=layout.blocks_per_request * BLOCK_SIZE, query_start_loc_cpu=tuple(int(q) for q in qsl))
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=config.num_heads, block_size=BLOCK_SIZE,
                                                     topk_tokens=config.index_topk)
    metadata = builder.build(common)
    # seq_lens after this step (informational for the sparse path): last position + 1 per request.
    seq_lens = jnp.zeros(layout.batch, jnp.int32).at[req_ids].max(positions + 1)
    return dataclasses.replace(metadata, seq_lens=seq_lens)


def chunk_metadata(layout: PagedLayout, config: MLAConfig, request, start, num_real, chunk: int):
    """Metadata of one prefill chunk of `chunk` tokens: positions start ... start + num_real - 1 of
    request `request` (int32 scalars, traced), then padding (slot -1: nothing written; the last real
    position, so its selection stays causal; its outputs are dropped). The chunk is a batch of one
    request, that request's row of the block table, so every chunk of every request has the same
    static metadata: the prefill step compiles once. Returns (metadata, positions [chunk] int32)."""
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    positions = start + jnp.minimum(offsets, num_real - 1)
    table = jax.lax.dynamic_slice_in_dim(jnp.asarray(layout.block_table), request, 1)
    slots = table[0, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    common = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray([0, chunk], jnp.int32),
        seq_lens=jnp.reshape(start + num_real, (1,)).astype(jnp.int32), block_table_tensor=table,
        slot_mapping=jnp.where(offsets < num_real, slots, -1).astype(jnp.int32), num_reqs=1,
        num_actual_tokens=chunk, max_query_len=chunk, max_seq_len=layout.blocks_per_request * BLOCK_SIZE,
        query_start_loc_cpu=(0, chunk))
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=config.num_heads, block_size=BLOCK_SIZE,
                                                     topk_tokens=config.index_topk)
    return builder.build(common), positions


def chunk_forward(graphdef, layout: PagedLayout, config: MLAConfig, chunk: int):
    """(state, tokens [chunk] int32, request, start, num_real, caches) -> the model's (logits
    [chunk, vocab], caches, top-k per layer) over one prefill chunk (chunk_metadata); not jitted."""

    def forward(state, tokens, request, start, num_real, caches):
        metadata, positions = chunk_metadata(layout, config, request, start, num_real, chunk)
        return nnx.merge(graphdef, state)(tokens, positions, caches, metadata)

    return forward


def make_prefill_step(graphdef, layout: PagedLayout, config: MLAConfig, chunk: int):
    """A jitted step (state, tokens [chunk] int32, request, start, num_real, caches) -> (the greedy next
    token after position start + num_real - 1, the caches, donated): one prefill chunk through the model."""
    forward = chunk_forward(graphdef, layout, config, chunk)

    def step(state, tokens, request, start, num_real, caches):
        logits, caches, _ = forward(state, tokens, request, start, num_real, caches)
        return jnp.argmax(logits[num_real - 1]).astype(jnp.int32), caches

    return jax.jit(step, donate_argnums=5)


def prefill(prefill_step, state, caches, prompts: list[np.ndarray], chunk: int):
    """Runs each request's prompt through prefill_step in chunks of `chunk` tokens (the last one
    padded), request after request, as vLLM's chunked prefill schedules a prompt.
    Returns (first generated token per request [B] int32, caches, wall seconds of each chunk)."""
    first_tokens, chunk_seconds = [], []
    for request, prompt in enumerate(prompts):
        for start in range(0, len(prompt), chunk):
            num_real = min(chunk, len(prompt) - start)
            tokens = np.zeros(chunk, np.int32)
            tokens[:num_real] = prompt[start:start + num_real]
            began = time.perf_counter()
            token, caches = prefill_step(state, jnp.asarray(tokens), np.int32(request), np.int32(start),
                                         np.int32(num_real), caches)
            token.block_until_ready()
            chunk_seconds.append(time.perf_counter() - began)
        first_tokens.append(token)
    return jnp.stack(first_tokens), caches, chunk_seconds


def make_decode_step(graphdef, treedef, layout: PagedLayout, config: MLAConfig, steps: int = 1):
    """A jitted call (params, tokens [B] int32, positions [B] int32, caches) -> (the generated tokens
    [steps, B] int32, the last of them [B], the next positions [B], the caches (donated), the last
    step's top-k per layer): `steps` greedy decode steps of every request, each step's token and
    position fed to the next on the device (a lax.scan over the steps for steps > 1).

    params: the model state's leaves (jax.tree.flatten(state): (params, treedef)), flattened once.
    Passing the nnx.State itself costs a Python flatten of every Variable on each call (tens of us
    for a few layers), host time that a GPU waiting on the dispatch sees as idle. The call returns
    the next tokens and positions as outputs, so that the loop driving it dispatches nothing else:

        generated, tokens, positions, caches, _ = decode(params, tokens, positions, caches)
    """
    req_ids = np.arange(layout.batch, dtype=np.int32)
    query_lens = np.ones(layout.batch, np.int64)

    def one_step(model, tokens, positions, caches):
        metadata = step_metadata(layout, config, jnp.asarray(req_ids), positions, query_lens)
        logits, caches, topks = model(tokens, positions, caches, metadata)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), positions + 1, caches, topks

    def decode(params, tokens, positions, caches):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
        if steps == 1:
            tokens, positions, caches, topks = one_step(model, tokens, positions, caches)
            return tokens[None], tokens, positions, caches, topks

        def body(carry, _):
            tokens, positions, caches, _ = carry
            tokens, positions, caches, topks = one_step(model, tokens, positions, caches)
            return (tokens, positions, caches, topks), tokens

        # The carry holds the last step's top-k (the attention-share measurement reads it).
        topk_shapes = jax.eval_shape(lambda *a: one_step(model, *a)[3], tokens, positions, caches)
        topks = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), topk_shapes)
        (tokens, positions, caches, topks), generated = jax.lax.scan(
            body, (tokens, positions, caches, topks), length=steps)
        return generated, tokens, positions, caches, topks

    return jax.jit(decode, donate_argnums=3)


def dense_reference(attn: MLASparseAttention, x, positions, cache: LayerCache, req_ids, topk, layout,
                    tokens_to_check):
    """Un-absorbed dense MLA attention (per-head K = W_UK kv_c ++ k_pe, V = W_UV kv_c) over each token's
    selected keys, in float32, for the first tokens_to_check tokens. Returns y [n, D]."""
    c = attn.config
    n = tokens_to_check
    q_nope, q_pe, _ = attn.project_query(x[:n], positions[:n])
    w_uk, w_uv = (w.astype(jnp.float32) for w in attn.absorbed_weights())
    rows = cache.kv_cache.reshape(-1, cache.kv_cache.shape[-1])
    selected = topk[:n]
    valid = selected >= 0
    slots = layout.slots(req_ids[:n, None], jnp.maximum(selected, 0))
    if cache.kv_cache.dtype == jnp.uint8:  # fp8_ds_mla: fp8 tiles with fp32 scales, bf16 RoPE
        keys = dequantize_ds_mla_rows(rows[slots])
    else:
        keys = rows[slots].astype(jnp.float32)
    if cache.kv_cache.dtype == jnp.float8_e4m3fn:
        keys = keys * attn.scales._k_scale_float
    kv_c, k_pe = keys[..., : c.kv_lora_rank], keys[..., c.kv_lora_rank:]
    k_nope = jnp.einsum("tsl,lhp->tshp", kv_c, w_uk)
    values = jnp.einsum("tsl,lhv->tshv", kv_c, w_uv)
    logits = (jnp.einsum("thp,tshp->ths", q_nope.astype(jnp.float32), k_nope)
              + jnp.einsum("thr,tsr->ths", q_pe.astype(jnp.float32), k_pe)) * c.softmax_scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    heads = jnp.einsum("ths,tshv->thv", probs, values)
    return attn.wo(heads.reshape(n, -1).astype(jnp.bfloat16)).astype(jnp.float32)


def check_first_layer(model: Decoder, tokens, positions, req_ids, caches, metadata, layout, tokens_to_check):
    """Sparse layer 0 vs dense_reference over the indexer's selection. Returns (the relative max error,
    whether every token kept min(position + 1, top-k) keys: all causal keys when it has fewer)."""
    block = model.blocks[0]
    x = block.attn_norm(model.embed(tokens))
    y_sparse, cache, topk = block.attn(x, positions, caches[0], metadata)
    y_dense = dense_reference(block.attn, x, positions, cache, req_ids, topk, layout, tokens_to_check)
    counts_ok = jnp.all((topk >= 0).sum(-1) == jnp.minimum(positions + 1, block.attn.config.index_topk))
    error = jnp.abs(y_sparse[:tokens_to_check].astype(jnp.float32) - y_dense).max() / jnp.abs(y_dense).max()
    return error, counts_ok


def fill_context(caches, layout: PagedLayout, config: MLAConfig, context: int, seed: int,
                 kv_cache_dtype: str):
    """Writes random latent rows and indexer keys for positions [0, context) of every request."""
    req_ids = jnp.repeat(jnp.arange(layout.batch, dtype=jnp.int32), context)
    positions = jnp.tile(jnp.arange(context, dtype=jnp.int32), layout.batch)
    slots = layout.slots(req_ids, positions).astype(jnp.int32)
    filled = []
    for i, cache in enumerate(caches):
        key_c, key_pe, key_idx = jax.random.split(jax.random.key(seed + i), 3)
        n = slots.shape[0]
        kv_c = jax.random.normal(key_c, (n, config.kv_lora_rank), jnp.bfloat16)
        k_pe = jax.random.normal(key_pe, (n, config.qk_rope_head_dim), jnp.bfloat16)
        kv_cache = jsm.concat_and_cache_mla(kv_c, k_pe, cache.kv_cache, slots, kv_cache_dtype=kv_cache_dtype)
        if cache.index_cache is None:  # a layer that shares the previous layer's indexer
            filled.append(LayerCache(kv_cache, None))
            continue
        index_keys = jax.random.normal(key_idx, (n, config.index_head_dim), jnp.bfloat16)
        filled.append(LayerCache(kv_cache, jsm.indexer_k_quant_and_cache(index_keys, cache.index_cache, slots)))
    return tuple(filled)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (tiny: 2, large: 4)")
    parser.add_argument("--index-topk-freq", type=int, default=1,
                        help="GLM-5.2's shared-indexer pattern: layer i runs its own indexer iff "
                             "max(i - offset + 1, 0) %% freq == 0, the others reuse the previous "
                             "full layer's top-k (1: every layer runs its indexer)")
    parser.add_argument("--index-skip-topk-offset", type=int, default=2,
                        help="the pattern's offset (see --index-topk-freq)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192,
                        help="large presets: prompt tokens per request before decoding")
    parser.add_argument("--prefill-chunk", type=int, default=8192,
                        help="prompt tokens per prefill step (vLLM's max_num_batched_tokens); a "
                             "prompt goes through in chunks of this many, the last one padded")
    parser.add_argument("--fill-context", action="store_true",
                        help="large presets: instead of prefilling, write random latent rows and "
                             "indexer keys for the --context positions (fast; for decode timings)")
    parser.add_argument("--new-tokens", type=int, default=24,
                        help="decode steps: ceil(new_tokens / steps_per_call) calls, at least 2 (the "
                             "first compiles; the others are timed)")
    parser.add_argument("--steps-per-call", type=int, default=1,
                        help="decode steps per jitted call (a lax.scan over the steps, the greedy "
                             "token fed back on the device); ms/step is still per decode step")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_ds_mla"], default="auto",
                        help="attention cache: bf16, fp8 e4m3 with a per-tensor scale, or vLLM's "
                             "fp8_ds_mla rows (656 bytes: fp8 latent with tile scales + bf16 RoPE)")
    parser.add_argument("--implementation", choices=["auto", "xla", "native"], default="auto",
                        help="kernels of the sparse attention and of the indexer ops. xla: all pure "
                             "JAX; auto: native where a kernel fits the device; native: the native "
                             "sparse-MLA kernel and native indexer kernels (errors where none fits), "
                             "except indexer_k_quant_and_cache and cp_gather_indexer_k_quant_cache, "
                             "which have no native kernel and run pure JAX")
    parser.add_argument("--check-tokens", type=int, default=8, help="tokens checked against dense attention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", default=None,
                        help="after the timed steps, decode as many more under the JAX profiler "
                             "and write its trace here (the GPU's kernel times per step; "
                             "benchmarks/gpu_check.py and benchmarks/decode_gaps.py read it)")
    parser.add_argument("--prefill-trace-dir", default=None,
                        help="after the timed prefill, run request 0's last chunk again (the same rows "
                             "rewritten) under the JAX profiler and write its trace here "
                             "(benchmarks/bench_prefill.py reads it)")
    parser.add_argument("--json", default=None, help="write the run's numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be positive, got {args.prefill_chunk}")
    if args.steps_per_call < 1:
        parser.error(f"--steps-per-call must be positive, got {args.steps_per_call}")

    config = PRESETS[args.preset]
    tiny = args.preset == "tiny"
    num_layers = args.layers or (2 if tiny else 4)
    rng = np.random.default_rng(args.seed)
    if tiny:
        prompt_lens = rng.integers(40, 180, args.batch)  # some contexts exceed top-k=128, some don't
    else:
        prompt_lens = np.full(args.batch, args.context)
    # Decode calls of --steps-per-call steps: the first compiles, the others are timed; --trace-dir
    # decodes as many as were timed again under the profiler: room for them all.
    decode_calls = max(2, -(-args.new_tokens // args.steps_per_call))
    traced_steps = (decode_calls - 1) * args.steps_per_call if args.trace_dir else 0
    max_len = int(prompt_lens.max()) + decode_calls * args.steps_per_call + traced_steps + 1
    layout = PagedLayout(args.batch, -(-max_len // BLOCK_SIZE))
    indexer_types = hf_config.indexer_types(dict(
        num_hidden_layers=num_layers, index_topk_freq=args.index_topk_freq,
        index_skip_topk_offset=args.index_skip_topk_offset))
    print(f"{args.preset}: {num_layers} layers, {config.num_heads} heads, top-k {config.index_topk}, "
          f"batch {args.batch}, device {jax.devices()[0].device_kind}, kv cache {args.kv_cache_dtype}, "
          f"implementation {args.implementation}, indexers {''.join(t[0].upper() for t in indexer_types)} "
          "(F: own, S: shared)")
    indexer_implementation = indexer_implementations(args.implementation)
    print(describe_indexer_implementations(args.implementation))

    model = Decoder(config, num_layers, args.vocab, rngs=nnx.Rngs(args.seed),
                    kv_cache_dtype=args.kv_cache_dtype, implementation=args.implementation,
                    indexer_implementation=indexer_implementation, indexer_types=indexer_types)
    graphdef, state = nnx.split(model)
    caches = tuple(empty_layer_cache(config, layout.num_blocks, BLOCK_SIZE, args.kv_cache_dtype,
                                     shared_indexer=kind == "shared") for kind in indexer_types)

    prefill_stats = {}
    if args.fill_context and not tiny:
        caches = fill_context(caches, layout, config, args.context, args.seed, args.kv_cache_dtype)
        tokens = jnp.asarray(rng.integers(0, args.vocab, args.batch), jnp.int32)
        print(describe_attention(config, args.kv_cache_dtype, args.implementation, layout,
                                 {"decode": args.batch}))
        print(f"context: {args.context} random latent rows and indexer keys per request written with "
              "concat_and_cache_mla and indexer_k_quant_and_cache (no prefill)")
    else:
        prompts = [rng.integers(0, args.vocab, n).astype(np.int32) for n in prompt_lens]
        # No chunk longer than the longest prompt needs (whole blocks).
        chunk = min(args.prefill_chunk, -(-int(prompt_lens.max()) // BLOCK_SIZE) * BLOCK_SIZE)
        print(describe_attention(config, args.kv_cache_dtype, args.implementation, layout,
                                 {"prefill": chunk, "decode": args.batch}))
        began = time.perf_counter()
        scalar = np.int32(0)
        prefill_step = make_prefill_step(graphdef, layout, config, chunk).lower(
            state, jnp.zeros(chunk, jnp.int32), scalar, scalar, np.int32(1), caches).compile()
        compile_seconds = time.perf_counter() - began
        # One warm-up call, as a server makes at start: the first execution also loads the kernels
        # (tens of ms on an H100), which no request of a running server waits for. It writes request
        # 0's position 0, which the prefill rewrites.
        began = time.perf_counter()
        _, caches = prefill_step(state, jnp.zeros(chunk, jnp.int32), scalar, scalar, np.int32(1), caches)
        jax.block_until_ready(caches)
        warmup_seconds = time.perf_counter() - began
        tokens, caches, chunk_seconds = prefill(prefill_step, state, caches, prompts, chunk)
        ttft = sum(chunk_seconds)
        prompt_tokens = int(prompt_lens.sum())
        prefill_stats = dict(prefill_chunk=chunk, prompt_tokens=prompt_tokens, ttft_ms=ttft * 1e3,
                             prefill_tokens_per_s=prompt_tokens / ttft, warmup_ms=warmup_seconds * 1e3,
                             chunk_ms=[round(t * 1e3, 2) for t in chunk_seconds])
        if args.prefill_trace_dir:
            last_start = (len(prompts[0]) - 1) // chunk * chunk
            tokens0 = np.zeros(chunk, np.int32)
            tokens0[:len(prompts[0]) - last_start] = prompts[0][last_start:]
            with jax.profiler.trace(args.prefill_trace_dir, create_perfetto_trace=True):
                _, caches = prefill_step(state, jnp.asarray(tokens0), np.int32(0), np.int32(last_start),
                                         np.int32(len(prompts[0]) - last_start), caches)
                jax.block_until_ready(caches)
        memory = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in memory:
            prefill_stats["peak_bytes"] = int(memory["peak_bytes_in_use"])
        print(f"prefill: {args.batch} x {'/'.join(map(str, sorted(set(prompt_lens.tolist()))))} prompt "
              f"tokens in {len(chunk_seconds)} chunks of {chunk}: {ttft:.3f} s "
              f"({prompt_tokens / ttft:,.0f} tokens/s; chunks {chunk_seconds[0] * 1e3:.1f} -> "
              f"{chunk_seconds[-1] * 1e3:.1f} ms; compiled in {compile_seconds:.1f} s, warm-up call "
              f"{warmup_seconds * 1e3:.0f} ms)"
              + (f", peak device memory {prefill_stats['peak_bytes'] / 2**30:.2f} GiB"
                 if "peak_bytes" in prefill_stats else ""))
    positions = jnp.asarray(prompt_lens, jnp.int32)  # the next token's position
    decode_req_ids = jnp.arange(args.batch, dtype=jnp.int32)
    decode_lens = np.ones(args.batch, np.int64)

    check_tokens = min(args.check_tokens, args.batch)
    error, counts_ok = jax.jit(lambda state, tokens, positions, caches: check_first_layer(
        nnx.merge(graphdef, state), tokens, positions, decode_req_ids, caches,
        step_metadata(layout, config, decode_req_ids, positions, decode_lens), layout, check_tokens))(
        state, tokens, positions, caches)
    error = float(error)
    # An fp8 cache takes an e4m3 query: the absorbed query quantised with a per-tensor scale (relative
    # step 2^-4), which the un-absorbed float32 reference cannot reproduce; that alone costs about 3e-2
    # of the output (3e-3 with a bf16 query). bf16 and fp8_ds_mla caches take the bf16 query.
    tolerance = 6e-2 if args.kv_cache_dtype == "fp8" else 2e-2
    ok = error < tolerance and bool(counts_ok)
    print(f"check: layer 0 sparse attention vs dense MLA attention over the indexer's selection, "
          f"{check_tokens} tokens: max relative error {error:.2e} (tolerance {tolerance:.0e}), top-k counts "
          f"{'ok' if counts_ok else 'WRONG'} -> {'PASS' if ok else 'FAIL'}")

    # The decode loop as a serving loop drives JAX: each call is one dispatch of `steps_per_call`
    # steps (next tokens and positions come back as outputs, the caches are donated), nothing on the
    # host waits for the device until the end, and the parameters go in as a flat list of arrays.
    steps_per_call = args.steps_per_call
    params, treedef = jax.tree.flatten(state)
    decode_step = make_decode_step(graphdef, treedef, layout, config, steps_per_call)
    generated, tokens, positions, caches, topks = decode_step(params, tokens, positions, caches)  # compiles
    generated.block_until_ready()
    blocks = [generated]
    start = time.perf_counter()
    for _ in range(decode_calls - 1):
        generated, tokens, positions, caches, topks = decode_step(params, tokens, positions, caches)
        blocks.append(generated)
    tokens.block_until_ready()
    timed_steps = (decode_calls - 1) * steps_per_call
    step_seconds = (time.perf_counter() - start) / timed_steps
    if traced_steps:
        # As many steps again under the profiler (it slows dispatch, so the wall time above is
        # taken without it): the trace holds each kernel's device time.
        with jax.profiler.trace(args.trace_dir, create_perfetto_trace=True):
            for _ in range(decode_calls - 1):
                _, tokens, positions, caches, topks = decode_step(params, tokens, positions, caches)
            tokens.block_until_ready()
        print(f"trace: {traced_steps} decode steps ({decode_calls - 1} calls of {steps_per_call}) "
              f"traced into {args.trace_dir}")

    # The attention share: the sparse-MLA kernel alone, for every layer, on this step's shapes.
    metadata = step_metadata(layout, config, decode_req_ids, positions - 1, decode_lens)
    attn = model.blocks[0].attn
    mqa_q = jax.random.normal(jax.random.key(1), (args.batch, config.num_heads, 576), jnp.bfloat16)
    if args.kv_cache_dtype == "fp8":
        mqa_q = jsm.quantize_query_fp8(mqa_q, 1.0)
    kernel_only = jax.jit(lambda q, caches, topks: [attn.impl.forward_mqa(q, c.kv_cache, metadata, attn.scales,
                                                                       topk_indices=t)[0]
                                                  for c, t in zip(caches, topks)])
    jax.block_until_ready(kernel_only(mqa_q, caches, topks))
    start = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        result = kernel_only(mqa_q, caches, topks)
    jax.block_until_ready(result)
    attention_seconds = (time.perf_counter() - start) / repeats

    sample = np.concatenate([np.asarray(b) for b in blocks]).T  # [B, decode_calls * steps_per_call]
    print(f"request 0 generated: {sample[0][:16].tolist()}{' ...' if sample.shape[1] > 16 else ''}")
    tokens_per_second = args.batch / step_seconds
    print(f"decode: {step_seconds * 1e3:.2f} ms/step, {tokens_per_second:.1f} tokens/s "
          f"(batch {args.batch}; {timed_steps} steps in {decode_calls - 1} calls of {steps_per_call}); "
          f"sparse attention {attention_seconds * 1e3:.2f} ms/step = "
          f"{100 * attention_seconds / step_seconds:.0f}% of the step")
    if not ok:
        raise SystemExit("correctness check FAILED")
    result = dict(preset=args.preset, batch=args.batch, layers=num_layers, step_ms=step_seconds * 1e3,
                  tokens_per_second=tokens_per_second, attention_ms=attention_seconds * 1e3,
                  check_error=error, steps_per_call=steps_per_call, timed_steps=timed_steps,
                  traced_steps=traced_steps, **prefill_stats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
