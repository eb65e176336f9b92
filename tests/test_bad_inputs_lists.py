"""A Python list where an array belongs, in every array argument of every public entry point (the
functions of `jax_sparse_mla.__all__`, the builder, the impl and its forward_mqa, the Flax layers and
apply_rope): a TypeError naming the argument, within a second.

The list is the array's own `tolist()` (right shape, right values), so nothing but its type is wrong:
`sharded_concat_and_cache_mla` once took such a list to shard_map as a pytree of scalars, one
transfer per element, and did not return within a minute. Every other argument is valid, so the
error comes from the list and from nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_sparse_mla as jsm
import jax_sparse_mla.flax
from jax_sparse_mla import parallel as par
from jax_sparse_mla.flax import TINY, MLASparseAttention, apply_rope, empty_layer_cache

BF16, I32, F8 = jnp.bfloat16, jnp.int32, jnp.float8_e4m3fn
T, H, K, NB, BS = 2, 4, 128, 2, 16
SECOND = 1.0


def zeros(shape, dtype=BF16):
    return jnp.zeros(shape, dtype)


def common():
    return jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray([0, 1, 2], I32), seq_lens=jnp.asarray([2, 2], I32),
        block_table_tensor=jnp.asarray([[0], [1]], I32), slot_mapping=jnp.asarray([0, BS], I32),
        num_reqs=2, num_actual_tokens=T, max_query_len=1, max_seq_len=2)


@functools.lru_cache(maxsize=None)
def metadata():
    return jsm.FlashInferMLASparseMetadataBuilder(num_heads=H, block_size=BS,
                                                  topk_tokens=K).build(common())


def impl(**kw):
    return jsm.FlashInferMLASparseImpl(H, 576, 0.1, 1, None, None, "auto", None, "decoder", None, **kw)


@functools.lru_cache(maxsize=None)
def layer(shared=False):
    return MLASparseAttention(TINY, rngs=nnx.Rngs(0), implementation="xla", shared_indexer=shared)


def flax_metadata():
    c = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray([0, T], I32), seq_lens=jnp.asarray([T], I32),
        block_table_tensor=jnp.asarray([[0, 1]], I32), slot_mapping=jnp.arange(T, dtype=I32),
        num_reqs=1, num_actual_tokens=T, max_query_len=T, max_seq_len=T)
    return jsm.FlashInferMLASparseMetadataBuilder(num_heads=TINY.num_heads, block_size=BS,
                                                  topk_tokens=TINY.index_topk).build(c)


def flax_kwargs(shared=False, **kw):
    """A layer step's valid kwargs; builds the layer first, so that no timing below includes it."""
    layer(shared)
    return dict(x=zeros((T, TINY.hidden_size)), positions=jnp.arange(T, dtype=I32),
                metadata=flax_metadata(), **kw)


def mesh():
    return par.make_decode_mesh(1, 2)


# name -> (call(**kwargs), valid kwargs, {argument path: the name the error must carry}). A path
# "a.b" is field b of argument a (a dataclass or NamedTuple), "a[i]" entry i of the tuple a.
ENTRY_POINTS = {
    "sparse_mla_decode": (
        functools.partial(jsm.sparse_mla_decode, scale=0.1),
        lambda: dict(q=zeros((T, H, 576)), kv_cache=zeros((NB, BS, 576)),
                     topk_indices=zeros((T, K), I32), valid_counts=zeros((T,), I32)),
        ["q", "kv_cache", "topk_indices", "valid_counts"]),
    "concat_and_cache_mla": (
        jsm.concat_and_cache_mla,
        lambda: dict(kv_c=zeros((T, 512)), k_pe=zeros((T, 64)), kv_cache=zeros((NB, BS, 576)),
                     slot_mapping=zeros((T,), I32)),
        ["kv_c", "k_pe", "kv_cache", "slot_mapping"]),
    "concat_and_cache_ds_mla": (
        jsm.concat_and_cache_ds_mla,
        lambda: dict(kv_c=zeros((T, 512)), k_pe=zeros((T, 64)),
                     kv_cache=zeros((NB, BS, 656), jnp.uint8), slot_mapping=zeros((T,), I32)),
        ["kv_c", "k_pe", "kv_cache", "slot_mapping"]),
    "quantize_query_fp8": (
        jsm.quantize_query_fp8, lambda: dict(q=zeros((T, H, 576)), q_scale=1.0), ["q"]),
    "convert_req_index_to_global_index": (
        functools.partial(jsm.convert_req_index_to_global_index, block_size=BS),
        lambda: dict(req_id_per_token=zeros((T,), I32), block_table=zeros((T, 2), I32),
                     token_indices=zeros((T, K), I32),
                     prefill_workspace_request_ids=jnp.full((T,), -1, I32),
                     prefill_workspace_starts=zeros((1,), I32)),
        ["req_id_per_token", "block_table", "token_indices", "prefill_workspace_request_ids",
         "prefill_workspace_starts"]),
    "filter_and_convert_dcp_index": (
        functools.partial(jsm.filter_and_convert_dcp_index, dcp_size=2, block_size=BS),
        lambda: dict(req_id_per_token=zeros((T,), I32), block_table=zeros((T, 2), I32),
                     token_indices=zeros((T, K), I32), dcp_rank=jnp.int32(0)),
        ["req_id_per_token", "block_table", "token_indices", "dcp_rank"]),
    "get_dcp_local_seq_lens": (
        functools.partial(jsm.get_dcp_local_seq_lens, dcp_size=2),
        lambda: dict(seq_lens=zeros((T,), I32), dcp_rank=jnp.int32(0)), ["seq_lens", "dcp_rank"]),
    "correct_attn_out": (
        jsm.correct_attn_out,
        lambda: dict(out=zeros((T, H, 8), jnp.float32), lses=zeros((2, T, H), jnp.float32),
                     cp_rank=jnp.int32(0)),
        ["out", "lses", "cp_rank"]),
    "lse_weighted_combine": (
        jsm.lse_weighted_combine,
        lambda: dict(outputs=zeros((2, T, H, 8), jnp.float32), lses=zeros((2, T, H), jnp.float32)),
        ["outputs", "lses"]),
    "cp_lse_ag_out_rs": (
        functools.partial(jsm.cp_lse_ag_out_rs, axis_name="dcp"),
        lambda: dict(cp_attn_out=zeros((T, H, 8), jnp.float32),
                     cp_attn_lse=zeros((T, H), jnp.float32)),
        ["cp_attn_out", "cp_attn_lse"]),
    "fp8_mqa_logits": (
        jsm.fp8_mqa_logits,
        lambda: dict(q=zeros((T, 32, 128), F8), k_fp8=zeros((8, 128), F8),
                     k_scale=zeros((8,), jnp.float32), weights=zeros((T, 32), jnp.float32),
                     row_starts=zeros((T,), I32), row_ends=jnp.full((T,), 8, I32)),
        ["q", "k_fp8", "k_scale", "weights", "row_starts", "row_ends"]),
    "fp8_paged_mqa_logits": (
        functools.partial(jsm.fp8_paged_mqa_logits, max_context_len=2 * BS),
        lambda: dict(q=zeros((T, 1, 32, 128), F8), index_cache=zeros((NB, BS, 132), jnp.uint8),
                     weights=zeros((T, 32), jnp.float32), context_lens=jnp.full((T,), 3, I32),
                     block_table=zeros((T, 2), I32)),
        ["q", "index_cache", "weights", "context_lens", "block_table"]),
    "top_k_per_row": (
        functools.partial(jsm.top_k_per_row, k=4),
        lambda: dict(logits=zeros((T, 16), jnp.float32), row_starts=zeros((T,), I32),
                     row_ends=jnp.full((T,), 16, I32)),
        ["logits", "row_starts", "row_ends"]),
    "top_k_per_row_decode": (
        functools.partial(jsm.top_k_per_row_decode, k=4),
        lambda: dict(logits=zeros((T, 16), jnp.float32), context_lens=jnp.full((T,), 16, I32)),
        ["logits", "context_lens"]),
    "indexer_k_quant_and_cache": (
        jsm.indexer_k_quant_and_cache,
        lambda: dict(k=zeros((T, 128)), index_cache=zeros((NB, BS, 132), jnp.uint8),
                     slot_mapping=zeros((T,), I32)),
        ["k", "index_cache", "slot_mapping"]),
    "cp_gather_indexer_k_quant_cache": (
        functools.partial(jsm.cp_gather_indexer_k_quant_cache, num_tokens=8),
        lambda: dict(index_cache=zeros((NB, BS, 132), jnp.uint8), block_table=zeros((T, 1), I32),
                     cu_seq_lens=jnp.asarray([0, 2, 4], I32)),
        ["index_cache", "block_table", "cu_seq_lens"]),
    "dcp_slot_mapping": (
        functools.partial(jsm.dcp_slot_mapping, block_size=BS, dcp_size=2),
        lambda: dict(req_id_per_token=zeros((T,), I32), positions=zeros((T,), I32),
                     block_table=zeros((T, 2), I32), dcp_rank=jnp.int32(0)),
        ["req_id_per_token", "positions", "block_table", "dcp_rank"]),
    "sharded_concat_and_cache_mla": (
        lambda **kw: jsm.sharded_concat_and_cache_mla(mesh(), **kw),
        lambda: dict(kv_c=zeros((T, 512)), k_pe=zeros((T, 64)),
                     kv_cache_shards=zeros((2, NB, BS, 576)),
                     slot_mapping_shards=jnp.full((2, T), -1, I32)),
        ["kv_c", "k_pe", "kv_cache_shards", "slot_mapping_shards"]),
    "sharded_sparse_mla_decode": (
        lambda **kw: jsm.sharded_sparse_mla_decode(mesh(), scale=0.1, **kw),
        lambda: dict(q=zeros((T, H, 576)), kv_cache_shards=zeros((2, NB, BS, 576)),
                     block_table_shards=zeros((2, T, 2), I32), topk_indices=zeros((T, K), I32),
                     req_id_per_token=zeros((T,), I32)),
        ["q", "kv_cache_shards", "block_table_shards", "topk_indices", "req_id_per_token"]),
    "FlashInferMLASparseMetadataBuilder.build": (
        jsm.FlashInferMLASparseMetadataBuilder(num_heads=H, block_size=BS, topk_tokens=K).build,
        lambda: dict(common=common()),
        ["common.query_start_loc", "common.seq_lens", "common.block_table_tensor",
         "common.slot_mapping"]),
    "FlashInferMLASparseImpl": (
        impl, lambda: dict(topk_indices_buffer=zeros((T, K), I32)), ["topk_indices_buffer"]),
    "FlashInferMLASparseImpl.forward_mqa": (
        lambda **kw: impl().forward_mqa(**kw),
        lambda: dict(q=zeros((T, H, 576)), kv_c_and_k_pe_cache=zeros((NB, BS, 576)),
                     attn_metadata=metadata(), topk_indices=zeros((T, K), I32)),
        ["q", "kv_c_and_k_pe_cache", "topk_indices", "attn_metadata.req_id_per_token",
         "attn_metadata.block_table"]),
    "FlashInferMLASparseImpl.forward_mqa (q tuple)": (
        lambda **kw: impl().forward_mqa(**kw),
        lambda: dict(q=(zeros((T, H, 512)), zeros((T, H, 64))),
                     kv_c_and_k_pe_cache=zeros((NB, BS, 576)), attn_metadata=metadata(),
                     topk_indices=zeros((T, K), I32)),
        ["q[0]", "q[1]"]),
    "MLASparseAttention": (
        lambda **kw: layer()(**kw),
        lambda: flax_kwargs(cache=empty_layer_cache(TINY, NB, BS)),
        ["x", "positions", "cache.kv_cache", "cache.index_cache", "metadata.slot_mapping",
         "metadata.req_id_per_token", "metadata.block_table", "metadata.seq_lens",
         "metadata.query_start_loc"]),
    "MLASparseAttention (shared indexer)": (
        lambda **kw: layer(True)(**kw),
        lambda: flax_kwargs(True, cache=empty_layer_cache(TINY, NB, BS, shared_indexer=True),
                            topk_indices=zeros((T, TINY.index_topk), I32)),
        ["topk_indices"]),
    "Indexer": (
        lambda **kw: layer().indexer(**kw),
        lambda: flax_kwargs(q_a=zeros((T, TINY.q_lora_rank)),
                            index_cache=zeros((NB, BS, 132), jnp.uint8)),
        ["x", "q_a", "positions", "index_cache", "metadata.slot_mapping", "metadata.block_table"]),
    "apply_rope": (
        functools.partial(apply_rope, config=TINY),
        lambda: dict(x=zeros((T, H, 64), jnp.float32), positions=jnp.arange(T, dtype=I32)),
        ["x", "positions"]),
}

CASES = [(name, path) for name, (_, _, paths) in ENTRY_POINTS.items() for path in paths]


def as_list(array) -> list:
    """The array as a (nested) Python list; a 0-d one (a rank) as a list of its one value."""
    value = np.asarray(array).tolist()
    return value if isinstance(value, list) else [value]


def _with_list(kwargs: dict, path: str) -> tuple[dict, str]:
    """kwargs with the array at `path` replaced by as_list(it); and the name the error must carry."""
    if "[" in path:  # q[0]: an entry of a tuple argument
        arg, index = path[:-1].split("[")
        entries = list(kwargs[arg])
        entries[int(index)] = as_list(entries[int(index)])
        return {**kwargs, arg: tuple(entries)}, path
    if "." not in path:
        return {**kwargs, path: as_list(kwargs[path])}, path
    arg, field = path.split(".")
    holder = kwargs[arg]
    listed = as_list(getattr(holder, field))
    holder = (holder._replace(**{field: listed}) if hasattr(holder, "_replace")
              else dataclasses.replace(holder, **{field: listed}))
    # The builder names CommonAttentionMetadata's fields bare, the layers a cache's index_cache bare.
    name = field if arg == "common" or field == "index_cache" else path
    return {**kwargs, arg: holder}, name


# Public names whose arguments hold no array (classes of static values, config, mesh and
# checkpoint helpers) or whose arrays are checked by the entry points above (metadata dataclasses).
TAKES_NO_ARRAY = {
    "DeviceCapability", "LayerScales", "CommonAttentionMetadata", "FlashInferMLASparseMetadata",
    "FlashInferMLASparseSM90Backend", "FlashInferMLASparseSM120Backend",
    "FlashInferMLASparseTRTLLMBackend", "NativeKernelsUnavailableWarning", "make_decode_mesh",
    "DEEPSEEK_V32", "GLM5", "PRESETS", "TINY", "MLAConfig", "LayerCache", "empty_layer_cache",
    "load_attention_weights"}


def test_every_public_entry_point_is_listed():
    listed = {name.split(" ")[0].split(".")[0] for name in ENTRY_POINTS}
    public = set(jsm.__all__) | set(jsm.flax.__all__)
    missing = public - listed - TAKES_NO_ARRAY
    assert not missing, f"public entry points without a list test: {sorted(missing)}"


@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}:{p}" for n, p in CASES])
def test_a_list_in_an_array_argument_is_refused_within_a_second(name, path):
    call, make_kwargs, _ = ENTRY_POINTS[name]
    kwargs, expected = _with_list(make_kwargs(), path)
    began = time.perf_counter()
    # "name must be an array, got list" (an op may prefix "op: "; q[0] reads "q[0] (ql_nope)");
    # a rank argument, which may also be an int, "must be an int, got list".
    with pytest.raises(TypeError, match=rf"(^|[\s:]){re.escape(expected)}( \(\w+\))? must be an "
                                        rf"(array|int), got list"):
        call(**kwargs)
    assert time.perf_counter() - began < SECOND, f"{name}({path}=list) took too long to refuse"


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_the_valid_call_runs(name):
    """The kwargs each case perturbs make a valid call, so the list alone is what is refused."""
    call, make_kwargs, _ = ENTRY_POINTS[name]
    kwargs = make_kwargs()
    if name == "cp_lse_ag_out_rs":  # needs its axis bound: run it inside a jitted shard_map
        spec = jax.sharding.PartitionSpec(None, "dcp")
        body = jax.shard_map(lambda a, b: call(cp_attn_out=a, cp_attn_lse=b), mesh=mesh(),
                             in_specs=(spec, spec), out_specs=spec)
        jax.jit(body)(kwargs["cp_attn_out"], kwargs["cp_attn_lse"])
    else:
        call(**kwargs)
