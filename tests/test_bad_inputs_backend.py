"""Bad inputs to the metadata builder, the backend classes and impl, the DCP ops and parallel.py:
each is a TypeError or ValueError naming the argument, before any other use (never an
AttributeError / IndexError or an error from inside JAX), and the documented edge behaviour."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import jax_sparse_mla as jsm
from jax_sparse_mla import parallel as par
from jax_sparse_mla.ops import dcp

SETTINGS = settings(max_examples=30, deadline=None)
BAD = (TypeError, ValueError)
NOT_ARRAYS = st.sampled_from([None, [0, 1], (0, 1), "abc", 3, 2.5, True])
CC = jsm.DeviceCapability


def i32(x):
    return jnp.asarray(np.asarray(x), jnp.int32)


def common(**kw):
    base = dict(query_start_loc=i32([0, 1, 2]), seq_lens=i32([3, 4]),
                block_table_tensor=jnp.zeros((2, 4), jnp.int32), slot_mapping=i32([0, 1]),
                num_reqs=2, num_actual_tokens=2, max_query_len=1, max_seq_len=4)
    base.update(kw)
    return jsm.CommonAttentionMetadata(**base)


BUILDER = jsm.FlashInferMLASparseMetadataBuilder(num_heads=4, block_size=4, topk_tokens=128)


# ----------------------------------------------------------------------------- metadata builder

@SETTINGS
@given(field=st.sampled_from(["query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"]),
       value=NOT_ARRAYS)
def test_build_refuses_non_arrays(field, value):
    with pytest.raises(BAD, match=field):
        BUILDER.build(common(**{field: value}))


@SETTINGS
@given(field=st.sampled_from(["num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"]),
       value=st.one_of(st.integers(max_value=-1), st.floats(allow_nan=True), st.text(max_size=3),
                       st.none(), st.booleans()))
def test_build_refuses_bad_sizes(field, value):
    with pytest.raises(BAD, match=field):
        BUILDER.build(common(**{field: value}))


@pytest.mark.parametrize("field,value", [
    ("seq_lens", i32([3, 4, 5])),  # 3 requests against 2 block-table rows
    ("seq_lens", i32([[3, 4]])),
    ("block_table_tensor", jnp.zeros((3, 4), jnp.int32)),
    ("block_table_tensor", jnp.zeros((2,), jnp.int32)),
    ("slot_mapping", jnp.asarray([0.0, 1.0])),
    ("slot_mapping", jnp.asarray([True, False])),
    ("slot_mapping", i32([0])),
    ("query_start_loc", i32([0, 2, 1])),  # decreasing
    ("query_start_loc", i32([0, 1, 5])),  # past num_actual_tokens
    ("seq_lens", i32([3, -1])),
    ("query_start_loc_cpu", [0, 1, 2.0]),
    ("query_start_loc_cpu", (0, 1)),
    ("query_start_loc_cpu", (0, 2, 1)),
    ("seq_lens_cpu", (3,)),
])
def test_build_defects(field, value):
    with pytest.raises(BAD, match=field):
        BUILDER.build(common(**{field: value}))


@SETTINGS
@given(num_reqs=st.integers(0, 5), rows=st.integers(0, 5), jitted=st.booleans())
def test_build_table_rows_cover_num_reqs(num_reqs, rows, jitted):
    """R rows of seq_lens / block_table_tensor must cover num_reqs (padding may add rows): a static
    check, jitted too."""
    kw = dict(query_start_loc=i32(np.arange(num_reqs + 1)), seq_lens=i32(np.ones(rows)),
              block_table_tensor=jnp.zeros((rows, 4), jnp.int32), num_reqs=num_reqs,
              num_actual_tokens=num_reqs, slot_mapping=i32(np.arange(num_reqs)), max_seq_len=1)
    build = (lambda: jax.jit(lambda: BUILDER.build(common(**kw)).req_id_per_token)()) if jitted \
        else (lambda: BUILDER.build(common(**kw)).req_id_per_token)
    if rows < num_reqs:
        with pytest.raises(ValueError, match=r"block_table_tensor has \d+ rows for \d+ requests"):
            build()
    else:
        assert build().shape == (num_reqs,)


@SETTINGS
@given(seq=st.lists(st.integers(0, 20), min_size=2, max_size=2), max_seq_len=st.integers(0, 20),
       host_copy=st.booleans())
def test_build_seq_lens_within_max_seq_len(seq, max_seq_len, host_copy):
    """Concrete seq_lens (or their host copy) past max_seq_len are a ValueError: the Flax layers'
    prefill gathers at most max_seq_len keys of a request. Traced, they are not checked."""
    kw = dict(seq_lens=i32(seq), max_seq_len=max_seq_len,
              seq_lens_cpu=tuple(seq) if host_copy else None)
    if max(seq) > max_seq_len:
        with pytest.raises(ValueError, match="max_seq_len"):
            BUILDER.build(common(**kw))
        if not host_copy:
            jax.jit(lambda s: BUILDER.build(common(**{**kw, "seq_lens": s})).seq_lens)(i32(seq))
    else:
        assert BUILDER.build(common(**kw)).max_seq_len == max_seq_len


def test_build_refuses_non_metadata_and_jit_keeps_shape_checks():
    with pytest.raises(TypeError, match="common"):
        BUILDER.build({"num_reqs": 2})
    with pytest.raises(BAD, match="seq_lens"):
        jax.jit(lambda s: BUILDER.build(common(seq_lens=s)).seq_lens)(i32([3, 4, 5]))
    # Under jit the values are unknown: a decreasing query_start_loc is not checked (documented).
    md = jax.jit(lambda q: BUILDER.build(common(query_start_loc=q)).req_id_per_token)(i32([0, 1, 2]))
    np.testing.assert_array_equal(np.asarray(md), [0, 1])


def test_build_edge_behaviour_kept():
    md = BUILDER.build(common(query_start_loc=i32([0, 1, 1]), num_actual_tokens=3,
                              slot_mapping=i32([0, 1, 2])))  # padding token and an empty request
    np.testing.assert_array_equal(np.asarray(md.req_id_per_token), [0, 0, 0])
    md = BUILDER.build(common(slot_mapping=np.asarray([0, -1], np.int64)))
    assert md.slot_mapping.shape == (2,)


# ----------------------------------------------------------------------------- backend classes

BACKENDS = [jsm.FlashInferMLASparseTRTLLMBackend, jsm.FlashInferMLASparseSM120Backend,
            jsm.FlashInferMLASparseSM90Backend]


@SETTINGS
@given(backend=st.sampled_from(BACKENDS), arg=st.integers(0, 3),
       value=st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=3), st.none()))
def test_kv_cache_shape_refuses_bad_sizes(backend, arg, value):
    args = [10, 64, 1, 576]
    args[arg] = value
    name = ["num_blocks", "block_size", "num_kv_heads", "head_size"][arg]
    with pytest.raises(BAD, match=name):
        backend.get_kv_cache_shape(*args, "auto")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_shape_refuses_unknown_dtype(backend):
    with pytest.raises(ValueError, match="cache_dtype_str"):
        backend.get_kv_cache_shape(10, 64, 1, 576, "int4")
    with pytest.raises(TypeError, match="cache_dtype_str"):
        backend.get_kv_cache_shape(10, 64, 1, 576, None)


@SETTINGS
@given(backend=st.sampled_from(BACKENDS),
       value=st.one_of(st.text(max_size=12).filter(lambda t: t not in jsm._validation.KV_CACHE_DTYPES),
                       st.none(), st.integers(), st.just(jnp.bfloat16), st.just(["auto"])))
def test_kv_cache_shape_refuses_unknown_cache_dtypes(backend, value):
    with pytest.raises(BAD, match="cache_dtype_str"):
        backend.get_kv_cache_shape(10, 64, 1, 576, value)


@SETTINGS
@given(backend=st.sampled_from(BACKENDS),
       value=st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 3)),
                       st.lists(st.integers(0, 12), max_size=2), st.integers(0, 12),
                       st.floats(0, 12), st.text(max_size=4), st.just({"major": 10, "minor": 0})))
def test_compute_capability_refuses_non_device_capability(backend, value):
    with pytest.raises(TypeError, match="capability must be a DeviceCapability"):
        backend.supports_compute_capability(value)
    with pytest.raises(TypeError, match="device_capability must be a DeviceCapability"):
        combo(backend, cc=value)


# vLLM's validate_configuration: supported_dtypes (TRTLLM [float16, bfloat16]; SM120 / SM90
# bfloat16) and get_supported_head_sizes ([576]), with its messages.
_VLLM_DTYPES = {jsm.FlashInferMLASparseTRTLLMBackend: (jnp.float16, jnp.bfloat16),
                jsm.FlashInferMLASparseSM120Backend: (jnp.bfloat16,),
                jsm.FlashInferMLASparseSM90Backend: (jnp.bfloat16,)}
_CC = {jsm.FlashInferMLASparseTRTLLMBackend: CC(10, 0), jsm.FlashInferMLASparseSM120Backend: CC(12, 0),
       jsm.FlashInferMLASparseSM90Backend: CC(9, 0)}


@SETTINGS
@given(backend=st.sampled_from(BACKENDS), head_size=st.sampled_from([576, 512, 64, 128, 192, 656, 1]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64, jnp.float8_e4m3fn,
                              jnp.int8]))
def test_supports_combination_dtypes_and_head_sizes_as_vllm(backend, head_size, dtype):
    reason = combo(backend, head_size=head_size, dtype=dtype, cc=_CC[backend])
    if head_size != 576:
        assert reason == "head_size not supported"
    elif jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in _VLLM_DTYPES[backend]):
        assert reason == "dtype not supported"
    else:
        assert reason is None or "requires" in reason  # only the native-kernel availability is left


def combo(backend, head_size=576, dtype=jnp.bfloat16, kv="auto", block=64, cc=CC(10, 0)):
    return backend.supports_combination(head_size, dtype, kv, block, True, False, True, False, cc)


def test_supports_combination_follows_vllm_dtypes_and_head_sizes():
    b = jsm.FlashInferMLASparseTRTLLMBackend
    assert combo(b) is None and combo(b, dtype=jnp.float16) is None
    assert combo(b, dtype=jnp.float32) == "dtype not supported"
    assert combo(b, head_size=512) == "head_size not supported"
    assert combo(b, block=16) == "block_size not supported"
    assert combo(b, cc=CC(9, 0)) == "compute capability not supported"
    assert combo(b, kv="float16") is None
    assert b.supports_combination(576, jnp.bfloat16, None, None, False, False, True, False,
                                  CC(10, 0)) == "non-MLA not supported"
    assert combo(jsm.FlashInferMLASparseSM90Backend, dtype=jnp.float32, cc=CC(9, 0)) == (
        "dtype not supported")


@SETTINGS
@given(arg=st.sampled_from(["head_size", "dtype", "kv_cache_dtype", "block_size", "use_mla",
                            "device_capability"]),
       value=st.sampled_from(["x", 1.5, object(), (10, 0), [10, 0], "int4"]))
def test_supports_combination_refuses_bad_types(arg, value):
    kw = dict(head_size=576, dtype=jnp.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=True,
              has_sink=False, use_sparse=True, use_mm_prefix=False, device_capability=CC(10, 0))
    kw[arg] = value
    try:
        jnp.dtype(value)
        if arg == "dtype":
            return  # a valid dtype spelling
    except Exception:
        pass
    with pytest.raises(BAD, match=arg):
        jsm.FlashInferMLASparseTRTLLMBackend.supports_combination(**kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capability_must_be_device_capability(backend):
    with pytest.raises(TypeError, match="capability"):
        backend.supports_compute_capability((10, 0))


# ----------------------------------------------------------------------------- impl.forward_mqa

def impl(kv="auto", heads=4, **kw):
    return jsm.FlashInferMLASparseImpl(heads, 576, 0.1, 1, None, None, kv, None, "decoder", None,
                                       **kw)


@SETTINGS
@given(value=st.one_of(NOT_ARRAYS.filter(lambda x: x is not None), st.sampled_from([
    jnp.zeros((4, 128), jnp.float32), jnp.zeros((4, 128), jnp.int16),
    jnp.zeros((128,), jnp.int32), jnp.zeros((2, 4, 128), jnp.int32), jnp.zeros((4, 0), jnp.int32),
    [[0] * 128] * 4, np.zeros((4, 128), np.float64)])),
       via_indexer=st.booleans())
def test_impl_checks_topk_indices_buffer(value, via_indexer):
    """Checked where it is given (the constructor): an int32 [T_max, K >= 1] array or None."""
    class Indexer:
        topk_indices_buffer = value
    kw = dict(indexer=Indexer()) if via_indexer else dict(topk_indices_buffer=value)
    name = "indexer.topk_indices_buffer" if via_indexer else "topk_indices_buffer"
    with pytest.raises(BAD, match=name):
        impl(**kw)


def test_impl_topk_indices_buffer_good_and_indexer_without_one():
    buffer = jnp.zeros((4, 128), jnp.int32)
    assert impl(topk_indices_buffer=buffer).topk_indices_buffer is buffer
    assert impl().topk_indices_buffer is None
    with pytest.raises(TypeError, match="indexer must have a topk_indices_buffer"):
        impl(indexer=object())


def mqa_inputs(cache_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, heads=4):
    md = BUILDER.build(common())
    cache = jnp.zeros((3, 4, 576), cache_dtype)
    q = jnp.zeros((2, heads, 576), q_dtype)
    topk = jnp.full((2, 128), -1, jnp.int32).at[:, 0].set(0)
    return q, cache, md, topk


@SETTINGS
@given(arg=st.sampled_from(["q", "kv_c_and_k_pe_cache", "topk_indices"]), value=NOT_ARRAYS)
def test_forward_mqa_refuses_non_arrays(arg, value):
    q, cache, md, topk = mqa_inputs()
    kw = dict(q=q, kv_c_and_k_pe_cache=cache, attn_metadata=md, topk_indices=topk)
    if value is None and arg == "topk_indices":
        return  # None means "use topk_indices_buffer"
    kw[arg] = value
    with pytest.raises(BAD, match=arg):
        impl().forward_mqa(**kw)


@pytest.mark.parametrize("case,match", [
    ("heads", "num_heads"), ("block_size", "block_size"), ("req", "req_id_per_token"),
    ("metadata", "attn_metadata"), ("q_rank", "q"), ("q_dim", "q"), ("q_f32", "q"),
    ("topk_rows", "topk_indices"), ("topk_dtype", "topk_indices"), ("no_topk", "topk_indices"),
])
def test_forward_mqa_defects(case, match):
    q, cache, md, topk = mqa_inputs()
    if case == "heads":
        q = jnp.zeros((2, 8, 576), jnp.bfloat16)  # more heads than num_heads=4
    elif case == "block_size":
        cache = jnp.zeros((3, 8, 576), jnp.bfloat16)  # metadata says 4
    elif case == "req":
        md = dataclasses.replace(md, req_id_per_token=None)
    elif case == "metadata":
        md = None
    elif case == "q_rank":
        q = q[0]
    elif case == "q_dim":
        q = q[..., :512]
    elif case == "q_f32":
        q = q.astype(jnp.float32)
    elif case == "topk_rows":
        topk = topk[:1]
    elif case == "topk_dtype":
        topk = topk.astype(jnp.float32)
    elif case == "no_topk":
        topk = None
    with pytest.raises(BAD, match=match):
        impl().forward_mqa(q, cache, md, topk_indices=topk)
    if case in ("heads", "block_size", "topk_rows"):  # under jit too (static shapes)
        with pytest.raises(BAD, match=match):
            jax.jit(lambda a, b, c: impl().forward_mqa(a, b, md, topk_indices=c))(q, cache, topk)


@pytest.mark.parametrize("kv,q_dtype,cache_dtype", [
    ("fp8", jnp.float8_e4m3fn, jnp.float8_e4m3fn), ("fp8", jnp.bfloat16, jnp.float8_e4m3fn)])
def test_forward_mqa_layer_none_with_fp8_is_an_error(kv, q_dtype, cache_dtype):
    q, cache, md, topk = mqa_inputs(cache_dtype, q_dtype)
    with pytest.raises(ValueError, match="layer"):
        impl(kv).forward_mqa(q, cache, md, None, topk_indices=topk)
    with pytest.raises(ValueError, match="layer"):
        impl(kv).forward_mqa(q, cache, md, object(), topk_indices=topk)
    # The documented default LayerScales() is scale 1.0, and bf16 with layer=None needs no scale.
    out, _ = impl(kv).forward_mqa(q, cache, md, topk_indices=topk)
    assert out.shape == (2, 4, 512)
    q, cache, md, topk = mqa_inputs()
    out, _ = impl().forward_mqa(q, cache, md, None, topk_indices=topk)
    assert out.shape == (2, 4, 512)


def test_forward_mqa_accepts_tuple_and_dcp_gathered_heads():
    q, cache, md, topk = mqa_inputs()
    out, _ = impl().forward_mqa((q[..., :512], q[..., 512:]), cache, md, topk_indices=topk)
    assert out.shape == (2, 4, 512)
    with pytest.raises(BAD, match="q_pe"):
        impl().forward_mqa((q[..., :512], q[..., 500:]), cache, md, topk_indices=topk)
    q8 = jnp.zeros((2, 8, 576), jnp.bfloat16)  # num_heads * dcp_world_size heads under DCP
    out, lse = impl(dcp_world_size=2, dcp_rank=0).forward_mqa(q8, cache, md, topk_indices=topk)
    assert out.shape == (2, 8, 512) and lse.shape == (2, 8)


# ----------------------------------------------------------------------------- DCP ops

def test_lse_weighted_combine_zero_ranks_and_empty_axes():
    with pytest.raises(ValueError, match="outputs"):
        dcp.lse_weighted_combine(jnp.zeros((0, 2, 2, 4)), jnp.zeros((0, 2, 2)))
    assert dcp.lse_weighted_combine(jnp.zeros((2, 0, 2, 4)), jnp.zeros((2, 0, 2))).shape == (0, 2, 4)


@SETTINGS
@given(arg=st.sampled_from(["outputs", "lses"]), value=NOT_ARRAYS)
def test_lse_weighted_combine_refuses_non_arrays(arg, value):
    kw = dict(outputs=jnp.zeros((2, 1, 2, 4)), lses=jnp.zeros((2, 1, 2)))
    kw[arg] = value
    with pytest.raises(BAD, match=arg):
        dcp.lse_weighted_combine(**kw)


@SETTINGS
@given(seq=st.lists(st.integers(-50, 50), min_size=1, max_size=6), n=st.integers(1, 4),
       i=st.integers(1, 3))
def test_local_seq_lens_negative_eager_error_jit_clamps(seq, n, i):
    seq_lens = i32(seq)
    if min(seq) < 0:
        with pytest.raises(ValueError, match="seq_lens"):
            dcp.get_dcp_local_seq_lens(seq_lens, n, 0, i)
    got = jax.jit(lambda s: dcp.get_dcp_local_seq_lens(s, n, None, i))(seq_lens)
    assert (np.asarray(got) >= 0).all()
    want = dcp.get_dcp_local_seq_lens(i32(np.maximum(seq, 0)), n, None, i)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(np.asarray(got).sum()) == int(np.maximum(seq, 0).sum())


def _local_len_rule(seq_len, world, rank, interleave):
    """docs/semantics.md: a rank outside [0, world) owns nothing, a negative length counts as 0."""
    if not 0 <= rank < world:
        return 0
    return sum(1 for p in range(max(seq_len, 0)) if (p // interleave) % world == rank)


@SETTINGS
@given(seq=st.lists(st.integers(-40, 40), min_size=1, max_size=5), n=st.integers(1, 4),
       i=st.integers(1, 3), rank=st.integers(-6, 8))
def test_local_seq_lens_traced_rank_and_negative_lengths_follow_the_rule(seq, n, i, rank):
    got = jax.jit(lambda s, r: dcp.get_dcp_local_seq_lens(s, n, r, i))(i32(seq), jnp.int32(rank))
    np.testing.assert_array_equal(np.asarray(got), [_local_len_rule(x, n, rank, i) for x in seq])
    if not 0 <= rank < n:
        with pytest.raises(ValueError, match="dcp_rank"):
            dcp.get_dcp_local_seq_lens(i32(np.maximum(seq, 0)), n, rank, i)


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_traced_rank_out_of_range_owns_nothing(rank):
    seq_lens = i32([5, 9])
    with pytest.raises(ValueError, match="dcp_rank"):
        dcp.get_dcp_local_seq_lens(seq_lens, 2, rank)
    got = jax.jit(lambda r: dcp.get_dcp_local_seq_lens(seq_lens, 2, r))(jnp.int32(rank))
    np.testing.assert_array_equal(np.asarray(got), [0, 0])
    table = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    slots = jax.jit(lambda r: par.dcp_slot_mapping(i32([0, 1]), i32([0, 1]), table, block_size=4,
                                                   dcp_size=2, dcp_rank=r))(jnp.int32(rank))
    np.testing.assert_array_equal(np.asarray(slots), [-1, -1])
    out = jnp.ones((1, 2, 4))
    lses = jnp.zeros((2, 1, 2))
    with pytest.raises(ValueError, match="cp_rank"):
        dcp.correct_attn_out(out, lses, rank)
    got, _ = jax.jit(lambda r: dcp.correct_attn_out(out, lses, r))(jnp.int32(rank))
    np.testing.assert_array_equal(np.asarray(got), 0)


def test_dcp_slot_mapping_zero_axes():
    r, p = i32([0]), i32([0])
    for table in (jnp.zeros((0, 3), jnp.int32), jnp.zeros((2, 0), jnp.int32)):
        with pytest.raises(ValueError, match="block_table"):
            par.dcp_slot_mapping(r, p, table, block_size=4, dcp_size=2, dcp_rank=0)
        with pytest.raises(ValueError, match="block_table"):
            par.dcp_slot_mapping(r, p, jnp.stack([table, table]), block_size=4, dcp_size=2)
    empty = par.dcp_slot_mapping(i32([]), i32([]), jnp.zeros((2, 3), jnp.int32), block_size=4,
                                 dcp_size=2, dcp_rank=0)
    assert empty.shape == (0,)


def _shard(f, mesh, *args):
    g = jax.shard_map(lambda *a: f(*(x[0] for x in a))[None], mesh=mesh,
                      in_specs=(P("dcp"),) * len(args), out_specs=P("dcp"))
    return g(*args)


def test_cp_lse_ag_out_rs_axis_name_and_zero_heads():
    out, lse = jnp.zeros((2, 4, 8)), jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="axis_name"):
        dcp.cp_lse_ag_out_rs(out, lse, "dcp")
    with pytest.raises(ValueError, match="axis_name"):
        jax.jit(lambda a, b: dcp.cp_lse_ag_out_rs(a, b, "nope"))(out, lse)
    with pytest.raises(TypeError, match="axis_name"):
        dcp.cp_lse_ag_out_rs(out, lse, 3)
    mesh = par.make_decode_mesh(1, 2)
    with pytest.raises(ValueError, match="axis_name"):
        _shard(lambda a, b: dcp.cp_lse_ag_out_rs(a, b, "tpx"), mesh,
               jnp.zeros((2, 2, 4, 8)), jnp.zeros((2, 2, 4)))
    with pytest.raises(ValueError, match="cp_attn_out"):
        _shard(lambda a, b: dcp.cp_lse_ag_out_rs(a, b, "dcp"), mesh,
               jnp.zeros((2, 2, 0, 8)), jnp.zeros((2, 2, 0)))



@pytest.mark.parametrize("tp,n", [(1, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("shape", [(0, 8, 16), (3, 8, 0), (0, 8, 0)])
def test_cp_lse_ag_out_rs_zero_size(tp, n, shape):
    """B = 0 or D = 0: inside an eager shard_map a ValueError naming cp_attn_out (JAX assembles the
    zero-size outputs of an eager shard_map with shards that disagree with their sharding, so any
    result would fail when read); jitted, the documented empty result, readable."""
    mesh = par.make_decode_mesh(tp, n)
    spec = P(None, ("tp", "dcp"))
    f = jax.shard_map(lambda a, b: dcp.cp_lse_ag_out_rs(a, b, "dcp", return_lse=True), mesh=mesh,
                      in_specs=(spec, spec), out_specs=(spec, spec))
    out, lse = jnp.zeros(shape, jnp.float32), jnp.zeros(shape[:2], jnp.float32)
    with pytest.raises(ValueError, match=r"cp_attn_out .* eager jax.shard_map"):
        f(out, lse)
    got, got_lse = jax.jit(f)(out, lse)
    want = (shape[0], shape[1] // n, shape[2])  # each rank keeps H / n heads of its H
    assert np.asarray(got).shape == want and np.asarray(got_lse).shape == want[:2]


# ----------------------------------------------------------------------------- parallel

def test_make_decode_mesh_devices():
    devs = jax.devices()
    with pytest.raises(TypeError, match="devices"):
        par.make_decode_mesh(1, 2, devices="cpu:0,cpu:1")
    with pytest.raises(TypeError, match="devices"):
        par.make_decode_mesh(1, 2, devices=[0, 1])
    with pytest.raises(ValueError, match="devices"):
        par.make_decode_mesh(1, 2, devices=[devs[0], devs[0]])
    assert par.make_decode_mesh(1, 2, devices=tuple(devs[:2])).shape["dcp"] == 2


def sharded_inputs(n=2, heads=4, t=2):
    q = jnp.zeros((t, heads, 576), jnp.bfloat16)
    caches = jnp.zeros((n, 3, 4, 576), jnp.bfloat16)
    tables = jnp.zeros((n, 2, 2), jnp.int32)
    topk = jnp.full((t, 128), -1, jnp.int32)
    req = jnp.zeros((t,), jnp.int32)
    return q, caches, tables, topk, req


def test_sharded_decode_k_scale_with_bf16_cache_matches_sparse_mla_decode():
    mesh = par.make_decode_mesh(1, 2)
    q, caches, tables, topk, req = sharded_inputs()
    with pytest.raises(ValueError, match="k_scale") as single:
        jsm.sparse_mla_decode(q, caches[0], topk, scale=0.1, k_scale=2.0)
    with pytest.raises(ValueError, match="k_scale") as sharded:
        par.sharded_sparse_mla_decode(mesh, q, caches, tables, topk, req, scale=0.1, k_scale=2.0)
    assert "applies only to an fp8 / fp8_e4m3 cache" in str(single.value)
    assert "applies only to an fp8 / fp8_e4m3 cache" in str(sharded.value)
    with pytest.raises(ValueError, match="q_scale"):
        par.sharded_sparse_mla_decode(mesh, q, caches, tables, topk, req, scale=0.1, q_scale=2.0)


@pytest.mark.parametrize("arg,index,shape", [
    ("q", 0, (2, 0, 576)), ("kv_cache_shards", 1, (2, 0, 4, 576)),
    ("kv_cache_shards", 1, (2, 3, 0, 576)), ("block_table_shards", 2, (2, 0, 2)),
    ("block_table_shards", 2, (2, 2, 0)), ("topk_indices", 3, (2, 0)),
])
def test_sharded_decode_zero_axes(arg, index, shape):
    mesh = par.make_decode_mesh(1, 2)
    args = list(sharded_inputs())
    args[index] = jnp.zeros(shape, args[index].dtype)
    with pytest.raises(ValueError, match=arg):
        par.sharded_sparse_mla_decode(mesh, *args, scale=0.1)


@settings(max_examples=8, deadline=None)
@given(mesh_shape=st.sampled_from([(1, 1), (1, 2), (2, 2), (1, 4)]), return_lse=st.booleans(),
       q_dtype=st.sampled_from([jnp.bfloat16, jnp.float16]), jitted=st.booleans())
def test_sharded_decode_no_tokens_gives_readable_empty_results(mesh_shape, return_lse, q_dtype,
                                                               jitted):
    """T = 0 (eager or jitted): the documented empty outputs, readable, with head_sharding. Eagerly
    they came from an eager shard_map, whose zero-size outputs failed when read."""
    tp, n = mesh_shape
    mesh = par.make_decode_mesh(tp, n)
    q, caches, tables, topk, req = sharded_inputs(n=n, heads=8, t=0)
    q, caches = q.astype(q_dtype), caches.astype(q_dtype)
    call = functools.partial(par.sharded_sparse_mla_decode, mesh, scale=0.1, return_lse=return_lse)
    got = (jax.jit(call) if jitted else call)(q, caches, tables, topk, req)
    out, lse = got if return_lse else (got, None)
    assert np.asarray(out).shape == (0, 8, 512) and out.dtype == q_dtype
    if lse is not None:
        assert np.asarray(lse).shape == (0, 8) and lse.dtype == jnp.float32
    if not jitted:
        assert out.sharding.is_equivalent_to(par.head_sharding(mesh), 3)


def test_sharded_concat_no_tokens_and_empty_caches():
    mesh = par.make_decode_mesh(1, 2)
    rows, slots = jnp.zeros((0, 512), jnp.bfloat16), jnp.zeros((2, 0), jnp.int32)
    caches = jnp.ones((2, 3, 4, 576), jnp.bfloat16)
    np.testing.assert_array_equal(  # T = 0: the caches unchanged, readable
        np.asarray(par.sharded_concat_and_cache_mla(mesh, rows, rows[:, :64], caches, slots)),
        np.asarray(caches))
    for empty in (jnp.zeros((2, 0, 4, 576), jnp.bfloat16), jnp.zeros((2, 3, 0, 576), jnp.bfloat16)):
        with pytest.raises(ValueError, match="kv_cache_shards must have at least one"):
            par.sharded_concat_and_cache_mla(mesh, rows, rows[:, :64], empty, slots)


def test_sharded_decode_no_tokens_checks_the_arguments_as_with_tokens():
    mesh = par.make_decode_mesh(1, 2)
    q, caches, tables, topk, req = sharded_inputs(t=0)
    with pytest.raises(BAD, match="implementation"):
        par.sharded_sparse_mla_decode(mesh, q, caches, tables, topk, req, scale=0.1,
                                      implementation="bogus")
    with pytest.raises(BAD, match="q must have dtype"):
        par.sharded_sparse_mla_decode(mesh, q.astype(jnp.float16), caches, tables, topk, req,
                                      scale=0.1)


@SETTINGS
@given(index=st.integers(0, 4), value=NOT_ARRAYS)
def test_sharded_decode_refuses_non_arrays(index, value):
    mesh = par.make_decode_mesh(1, 2)
    args = list(sharded_inputs())
    args[index] = value
    name = ["q", "kv_cache_shards", "block_table_shards", "topk_indices", "req_id_per_token"][index]
    with pytest.raises(BAD, match=name):
        par.sharded_sparse_mla_decode(mesh, *args, scale=0.1)
