"""Bad inputs to MLAConfig, MLASparseAttention and Indexer: TypeError / ValueError naming the
argument (or config field), checked before any computation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import jax_sparse_mla as jsm
from jax_sparse_mla.flax import apply_rope
from jax_sparse_mla.flax.config import PRESETS, TINY, MLAConfig
from jax_sparse_mla.flax.layers import Indexer, LayerCache, MLASparseAttention, empty_layer_cache

SETTINGS = settings(max_examples=30, deadline=None)
BAD = (TypeError, ValueError)
BS, T = 16, 4
SIZES = ["hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
         "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim",
         "original_max_position_embeddings"]


@SETTINGS
@given(field=st.sampled_from(SIZES),
       value=st.one_of(st.integers(max_value=0), st.floats(0.1, 100.0), st.text(max_size=2),
                       st.none(), st.booleans()))
def test_config_sizes(field, value):
    with pytest.raises(BAD, match=field):
        dataclasses.replace(TINY, **{field: value})


@SETTINGS
@given(field=st.sampled_from(["rope_theta", "rope_factor", "rms_norm_eps"]),
       value=st.one_of(st.floats(max_value=0.0), st.just(float("nan")), st.just(float("inf")),
                       st.text(max_size=2), st.booleans()))
def test_config_positive_floats(field, value):
    with pytest.raises(BAD, match=field):
        dataclasses.replace(TINY, **{field: value})


def test_config_presets_and_named_defects():
    for config in PRESETS.values():
        assert dataclasses.replace(config) == config
    for field, value in [("rope_theta", 0), ("rope_factor", -1.0), ("rms_norm_eps", -1e-6),
                         ("num_heads", 2.5), ("index_hadamard", 1), ("beta_fast", -1.0)]:
        with pytest.raises(BAD, match=field):
            dataclasses.replace(TINY, **{field: value})


@functools.lru_cache(maxsize=None)
def layer(shared=False):
    return MLASparseAttention(TINY, rngs=nnx.Rngs(0), implementation="xla", shared_indexer=shared)


def metadata(num_tokens=T, block_size=BS):
    common = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray([0, num_tokens], jnp.int32),
        seq_lens=jnp.asarray([num_tokens], jnp.int32),
        block_table_tensor=jnp.asarray([[0, 1]], jnp.int32),
        slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32), num_reqs=1,
        num_actual_tokens=num_tokens, max_query_len=num_tokens, max_seq_len=num_tokens)
    return jsm.FlashInferMLASparseMetadataBuilder(
        num_heads=TINY.num_heads, block_size=block_size, topk_tokens=TINY.index_topk).build(common)


def inputs():
    x = jnp.zeros((T, TINY.hidden_size), jnp.bfloat16)
    positions = jnp.arange(T, dtype=jnp.int32)
    return x, positions, empty_layer_cache(TINY, 2, BS), metadata()


def test_good_call_runs():
    y, _, topk = layer()(*inputs())
    assert y.shape == (T, TINY.hidden_size) and topk.shape == (T, TINY.index_topk)


NOT_ARRAYS = st.sampled_from([None, [0, 1], "x", 3, 1.5])


@SETTINGS
@given(arg=st.sampled_from(["x", "positions"]),
       value=st.one_of(NOT_ARRAYS, st.sampled_from([
           jnp.zeros((T,), jnp.bfloat16), jnp.zeros((T, 7), jnp.bfloat16),
           jnp.zeros((T, TINY.hidden_size), jnp.int32), jnp.zeros((T + 1,), jnp.int32),
           jnp.zeros((T,), jnp.float32), jnp.zeros((T, 1), jnp.int32)])))
def test_attention_bad_x_positions(arg, value):
    x, positions, cache, md = inputs()
    kw = dict(x=x, positions=positions, cache=cache, metadata=md)
    kw[arg] = value
    with pytest.raises(BAD, match=arg):
        layer()(**kw)


@pytest.mark.parametrize("case,match", [
    ("kv_blocks", "index_cache"), ("kv_block_size", "block_size"), ("kv_width", "cache.kv_cache"),
    ("kv_dtype", "cache.kv_cache"), ("index_none", "index_cache"), ("cache_tuple", "cache"),
    ("md_block_size", "block_size"), ("md_slots", "slot_mapping"), ("md_slots_float", "slot_mapping"),
    ("md_tokens", "slot_mapping"), ("md_none", "metadata"), ("topk_full", "topk_indices must be None"),
])
def test_attention_cache_and_metadata(case, match):
    x, positions, cache, md = inputs()
    topk = None
    if case == "kv_blocks":
        cache = LayerCache(jnp.zeros((3, BS, 576), jnp.bfloat16), cache.index_cache)
    elif case == "kv_block_size":
        cache = empty_layer_cache(TINY, 2, 2 * BS)
    elif case == "kv_width":
        cache = LayerCache(cache.kv_cache[..., :512], cache.index_cache)
    elif case == "kv_dtype":
        cache = LayerCache(cache.kv_cache.astype(jnp.float32), cache.index_cache)
    elif case == "index_none":
        cache = LayerCache(cache.kv_cache, None)
    elif case == "cache_tuple":
        cache = (cache.kv_cache, cache.index_cache, None)
    elif case == "md_block_size":
        md = metadata(block_size=2 * BS)
    elif case == "md_slots":
        md = dataclasses.replace(md, slot_mapping=md.slot_mapping[:2])
    elif case == "md_slots_float":
        md = dataclasses.replace(md, slot_mapping=md.slot_mapping.astype(jnp.float32))
    elif case == "md_tokens":
        md = metadata(num_tokens=T - 1)
    elif case == "md_none":
        md = None
    elif case == "topk_full":
        topk = jnp.zeros((T, TINY.index_topk), jnp.int32)
    with pytest.raises(BAD, match=match):
        layer()(x, positions, cache, md, topk)


# Metadata fields a step reads, each set to a value that disagrees with x's T tokens or the caches:
# (field, value, what the error names). Static at trace time, so refused under jit as well.
_METADATA_DEFECTS = {
    "num_actual_tokens": (st.integers(T + 1, 64), "num_actual_tokens"),
    "slot_mapping": (st.integers(0, 8).filter(lambda n: n != T).map(
        lambda n: jnp.arange(n, dtype=jnp.int32)), "slot_mapping"),
    "block_size": (st.one_of(st.integers(1, 64).filter(lambda b: b != BS), st.just("16"),
                             st.just(16.0), st.none()), "block_size"),
    "num_reqs": (st.integers(2, 5), "block_table"),  # the table has one row
    "req_id_per_token": (st.integers(0, T - 1).map(lambda n: jnp.zeros((n,), jnp.int32)),
                         "req_id_per_token"),
    "block_table": (st.sampled_from([jnp.zeros((1, 2), jnp.float32), jnp.zeros((2,), jnp.int32),
                                     [[0, 1]]]), "block_table"),
}


@settings(max_examples=25, deadline=None)
@given(field=st.sampled_from(sorted(_METADATA_DEFECTS)), data=st.data(), jitted=st.booleans())
def test_attention_metadata_disagreeing_with_tokens_and_caches(field, data, jitted):
    strategy, match = _METADATA_DEFECTS[field]
    value = data.draw(strategy)
    x, positions, cache, md = inputs()
    if field == "num_reqs":  # qsl follows num_reqs, so only the table's rows disagree
        md = dataclasses.replace(md, num_reqs=value,
                                 query_start_loc=jnp.zeros((value + 1,), jnp.int32))
    else:
        md = dataclasses.replace(md, **{field: value})
    call = (lambda *a: nnx.jit(lambda m, *b: m(*b))(layer(), *a)) if jitted else layer()
    with pytest.raises(BAD, match=match):
        call(x, positions, cache, md)


def test_leading_requests_must_agree_with_query_start_loc():
    """The indexer scores metadata.leading_reqs requests as decodes: a count that does not fit the
    batch is refused (under jit too), one that disagrees with concrete query_start_loc values as
    well; the builder's own values pass."""
    x, positions, cache, md = inputs()
    assert (md.leading_reqs, md.leading_query_len) == (1, T)
    jitted = lambda *a: nnx.jit(lambda m, *b: m(*b))(layer(), *a)
    with pytest.raises(ValueError, match="leading_reqs=2 exceeds metadata.num_reqs=1"):
        jitted(x, positions, cache, dataclasses.replace(md, leading_reqs=2))
    with pytest.raises(ValueError, match="leading_query_len=1 disagree with metadata.query_start_loc"):
        layer()(x, positions, cache, dataclasses.replace(md, leading_query_len=1))
    with pytest.raises(TypeError, match="leading_reqs"):
        layer()(x, positions, cache, dataclasses.replace(md, leading_reqs="1"))


def test_attention_padding_tokens_and_seq_lens_bound():
    x, positions, cache, md = inputs()
    y, _, topk = layer()(x, positions, cache, dataclasses.replace(md, num_actual_tokens=T - 2))
    assert (np.asarray(topk[T - 2:]) == -1).all()  # padding tokens select nothing
    short = dataclasses.replace(md, max_seq_len=1)  # seq_lens [4] past the static bound
    with pytest.raises(ValueError, match=r"metadata.seq_lens holds 4, past metadata.max_seq_len=1"):
        layer()(x, positions, cache, short)
    nnx.jit(lambda m, *a: m(*a))(layer(), x, positions, cache, short)  # traced: not checked


@pytest.mark.parametrize("shared", [False, True])
def test_index_cache_blocks_must_match_kv_cache_under_jit(shared):
    x, positions, cache, md = inputs()
    bad = LayerCache(cache.kv_cache, jnp.zeros((3, BS, 132), jnp.uint8))
    topk = jnp.zeros((T, TINY.index_topk), jnp.int32) if shared else None
    with pytest.raises(ValueError, match=r"index_cache \(3, 16, 132\) must have kv_cache's"):
        nnx.jit(lambda m, *a: m(*a))(layer(shared), x, positions, bad, md, topk)


@pytest.mark.parametrize("topk", [jnp.zeros((T, 64), jnp.int32), jnp.zeros((T + 1, 128), jnp.int32),
                                  jnp.zeros((T, 128), jnp.float32), [[0] * 128] * T])
def test_shared_layer_topk_indices(topk):
    x, positions, _, md = inputs()
    with pytest.raises(BAD, match="topk_indices"):
        layer(True)(x, positions, empty_layer_cache(TINY, 2, BS, shared_indexer=True), md, topk)


@pytest.mark.parametrize("arg,value", [
    ("q_a", jnp.zeros((T, 7), jnp.bfloat16)), ("q_a", None), ("x", jnp.zeros((T,), jnp.bfloat16)),
    ("positions", jnp.zeros((T,), jnp.float32)),
    ("index_cache", jnp.zeros((2, BS, 132), jnp.int8)), ("index_cache", jnp.zeros((2, BS, 128), jnp.uint8)),
    ("metadata", None),
])
def test_indexer_call(arg, value):
    x, positions, cache, md = inputs()
    indexer = layer().indexer
    kw = dict(x=x, q_a=jnp.zeros((T, TINY.q_lora_rank), jnp.bfloat16), positions=positions,
              index_cache=cache.index_cache, metadata=md)
    kw[arg] = value
    with pytest.raises(BAD, match=arg):
        indexer(**kw)


def test_indexer_block_size_mismatch_and_constructor_checks():
    x, positions, cache, _ = inputs()
    with pytest.raises(ValueError, match="block_size"):
        layer().indexer(x, jnp.zeros((T, TINY.q_lora_rank), jnp.bfloat16), positions,
                        cache.index_cache, metadata(block_size=2 * BS))
    with pytest.raises(BAD, match="max_decode_next_n"):
        Indexer(TINY, rngs=nnx.Rngs(0), max_decode_next_n=0)
    with pytest.raises(BAD, match="config"):
        Indexer({"hidden_size": 8}, rngs=nnx.Rngs(0))
    with pytest.raises(BAD, match="k_scale"):
        MLASparseAttention(TINY, rngs=nnx.Rngs(0), k_scale=-1.0)
    with pytest.raises(BAD, match="kv_cache_dtype"):
        MLASparseAttention(TINY, rngs=nnx.Rngs(0), kv_cache_dtype="int4")


@pytest.mark.parametrize("cls", [Indexer, MLASparseAttention])
@pytest.mark.parametrize("kwargs,match", [
    (dict(rngs=None), "rngs must be a flax.nnx.Rngs"),
    (dict(rngs=0), "rngs must be a flax.nnx.Rngs"),
    (dict(dtype=jnp.int32), "dtype must be bfloat16, float16 or float32"),
    (dict(dtype="bogus"), "dtype must be bfloat16, float16 or float32"),
])
def test_constructors_check_rngs_and_dtype(cls, kwargs, match):
    with pytest.raises(TypeError, match=match):
        cls(TINY, **dict(dict(rngs=nnx.Rngs(0)), **kwargs))


@SETTINGS
@given(arg=st.sampled_from(["x", "positions", "config", "interleaved"]), data=st.data())
def test_apply_rope_checks_its_arguments(arg, data):
    kw = dict(x=jnp.zeros((T, 2, 64), jnp.float32), positions=jnp.arange(T, dtype=jnp.int32),
              config=TINY, interleaved=True)
    bad = {
        "x": st.one_of(NOT_ARRAYS, st.sampled_from([jnp.zeros((T,), jnp.float32),
                                                     jnp.zeros((T, 63), jnp.float32),
                                                     jnp.zeros((T, 64), jnp.int32),
                                                     np.zeros((T, 2, 64)).tolist()])),
        "positions": st.one_of(NOT_ARRAYS, st.sampled_from([jnp.arange(T, dtype=jnp.float32),
                                                            jnp.arange(T + 1, dtype=jnp.int32),
                                                            jnp.zeros((T, 1), jnp.int32)])),
        "config": st.sampled_from([None, {"rope_theta": 1e4}, "tiny"]),
        "interleaved": st.sampled_from([None, 1, "False"]),
    }[arg]
    kw[arg] = data.draw(bad)
    with pytest.raises(BAD, match=arg):
        apply_rope(**kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(config=None), "config"), (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=2.0), "num_blocks"), (dict(block_size=-1), "block_size"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype"), (dict(shared_indexer="no"), "shared_indexer"),
])
def test_empty_layer_cache_checks_its_arguments(kwargs, match):
    with pytest.raises(BAD, match=match):
        empty_layer_cache(**{**dict(config=TINY, num_blocks=2, block_size=BS), **kwargs})
