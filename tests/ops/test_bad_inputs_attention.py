"""Bad arguments to sparse_mla_decode, the KV-cache writers, quantize_query_fp8 and the index
conversion: every one is a TypeError or ValueError naming the argument, raised before JAX sees it,
never an error from inside JAX and never a silent result. Plus the defects a sweep found (a 0-d
cache, zero-sized axes, strings taken for numbers and flags, unchecked query widths, ids past their
tables) and the documented edge behaviour that must survive the checks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_sparse_mla as jsm
from jax_sparse_mla.ops.index_conversion import (
    convert_req_index_to_global_index as convert,
    filter_and_convert_dcp_index as dcp_filter,
)
from reference import BF16, E4M3

SCALE = 192 ** -0.5
SETTINGS = settings(max_examples=60, deadline=None)
ALL_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.float16,
              BF16, np.float32, np.float64, E4M3, np.complex64)


def named(name):
    """pytest.raises' match for an error that names `name` as a word (so "kv_cache" does not match
    "kv_cache_dtype" and "q" does not match "q_scale")."""
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def i32(x):
    return np.asarray(x, np.int32)


# ----------------------------------------------------------------------------- strategies

NON_ARRAYS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=4),
    st.lists(st.integers(0, 3), max_size=3), st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
NOT_NUMBERS = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4), st.just("0.1"), st.just("1"),
    st.lists(st.floats(0.1, 1.0), min_size=1, max_size=2), st.just(np.ones(2, np.float32)),
)
BAD_POSITIVE_NUMBERS = st.one_of(
    st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.integers(max_value=0),
)
NOT_BOOLS = st.one_of(st.none(), st.integers(0, 1), st.floats(0, 1), st.sampled_from(["False", "no", ""]),
                      st.lists(st.booleans(), max_size=2))


def not_option(options):
    return st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.lists(st.text(max_size=2), max_size=2),
                     st.text(max_size=6).filter(lambda s: s not in options))


def bad_dtype(shape, allowed):
    bad = [d for d in ALL_DTYPES if np.dtype(d) not in {np.dtype(a) for a in allowed}]
    return st.sampled_from(bad).map(lambda d: np.zeros(shape, d))


def bad_rank(dtype, ranks_ok, side=st.integers(1, 3)):
    """Arrays of `dtype` whose rank is not in ranks_ok (shapes kept tiny)."""
    ranks = [r for r in range(6) if r not in ranks_ok]
    return st.sampled_from(ranks).flatmap(
        lambda r: st.lists(side, min_size=r, max_size=r)).map(lambda s: np.zeros(tuple(s), dtype))


def resized(shape, dtype, axis, sizes):
    """`shape` with `axis` set to each of `sizes` (all of them wrong)."""
    def make(n):
        s = list(shape)
        s[axis] = n
        return np.zeros(tuple(s), dtype)
    return st.sampled_from(sizes).map(make)


def bad_ints(minimum=1):
    return st.one_of(st.integers(max_value=minimum - 1), st.floats(allow_nan=True), st.none(),
                     st.booleans(), st.text(max_size=3))


# ----------------------------------------------------------------------------- sparse_mla_decode

T, H, K, NB, BS = 2, 4, 8, 3, 16


def decode_args():
    return dict(q=np.zeros((T, H, 576), BF16), kv_cache=np.zeros((NB, BS, 576), BF16),
                topk_indices=i32(np.zeros((T, K))), scale=SCALE)


DECODE_BAD = {
    "q": st.one_of(
        NON_ARRAYS, bad_dtype((T, H, 576), [BF16]), bad_rank(BF16, (3, 4)),
        resized((T, H, 576), BF16, 2, [0, 1, 512, 575, 577, 656]),
        resized((T, H, 576), BF16, 1, [0]),  # zero heads
        resized((T, H, 576), BF16, 0, [0, 1, 3]),  # T disagreeing with topk_indices
    ),
    "kv_cache": st.one_of(
        NON_ARRAYS, bad_dtype((NB, BS, 576), [BF16, E4M3]), bad_rank(BF16, (3,)),
        resized((NB, BS, 576), BF16, 2, [0, 1, 512, 577, 656]),
        resized((NB, BS, 576), BF16, 0, [0]), resized((NB, BS, 576), BF16, 1, [0]),
        st.just(np.zeros((), BF16)),
    ),
    "topk_indices": st.one_of(
        NON_ARRAYS, bad_dtype((T, K), [np.int32]), bad_rank(np.int32, (2,)),
        resized((T, K), np.int32, 1, [0]), resized((T, K), np.int32, 0, [0, 1, 3]),
    ),
    "valid_counts": st.one_of(
        NON_ARRAYS.filter(lambda x: x is not None), bad_dtype((T,), [np.int32]),
        bad_rank(np.int32, (1,)), resized((T,), np.int32, 0, [0, 1, 3]),
    ),
    "scale": st.one_of(NOT_NUMBERS, BAD_POSITIVE_NUMBERS),
    "q_scale": st.one_of(NOT_NUMBERS, BAD_POSITIVE_NUMBERS, st.floats(1.5, 4.0)),
    "k_scale": st.one_of(NOT_NUMBERS, BAD_POSITIVE_NUMBERS, st.floats(1.5, 4.0)),
    "kv_cache_dtype": not_option(("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_ds_mla")),
    "lse_base": not_option(("e", "2")),
    "implementation": not_option(("auto", "xla", "native")),
}


def call_decode(args):
    args = dict(args)
    return jsm.sparse_mla_decode(args.pop("q"), args.pop("kv_cache"), args.pop("topk_indices"), **args)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(DECODE_BAD)))
def test_decode_rejects_bad_argument(data, name):
    args = decode_args()
    args[name] = data.draw(DECODE_BAD[name], label=name)
    with pytest.raises((TypeError, ValueError), match=named(name)):
        call_decode(args)


def test_decode_zero_dim_kv_cache_is_a_rank_error():
    """The layout helper used to raise IndexError building its own message (kv_cache.shape[-1])."""
    for dtype_name in ("auto", "bfloat16", "fp8", "fp8_ds_mla"):
        args = decode_args()
        args.update(kv_cache=np.zeros((), BF16), kv_cache_dtype=dtype_name)
        with pytest.raises(ValueError, match="kv_cache must have rank 3"):
            call_decode(args)
    with pytest.raises(ValueError, match="kv_cache must have rank 3"):
        jax.jit(lambda q, kv, ix: jsm.sparse_mla_decode(q, kv, ix, scale=SCALE))(
            jnp.zeros((T, H, 576), jnp.bfloat16), jnp.zeros((), jnp.bfloat16), jnp.zeros((T, K), jnp.int32))


@pytest.mark.parametrize("name, shape, message", [
    ("q", (T, 0, 576), "at least one head"),
    ("kv_cache", (0, BS, 576), "at least one block"),
    ("kv_cache", (NB, 0, 576), "at least one slot per block"),
    ("topk_indices", (T, 0), "at least one top-k entry"),
])
@pytest.mark.parametrize("jit", [False, True])
def test_decode_rejects_zero_sized_axes(name, shape, message, jit):
    args = decode_args()
    args[name] = np.zeros(shape, args[name].dtype)
    arrays = {k: args.pop(k) for k in ("q", "kv_cache", "topk_indices")}
    fn = lambda q, kv, ix: jsm.sparse_mla_decode(q, kv, ix, **args)  # noqa: E731
    with pytest.raises(ValueError, match=f"{name} must have {message}"):
        (jax.jit(fn) if jit else fn)(arrays["q"], arrays["kv_cache"], arrays["topk_indices"])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("q_shape, k_shape", [((0, H, 576), (0, K)), ((0, 3, H, 576), (0, 3, K)),
                                              ((2, 0, H, 576), (2, 0, K))])
def test_decode_empty_batch_gives_empty_outputs(jit, q_shape, k_shape):
    fn = lambda q, kv, ix: jsm.sparse_mla_decode(q, kv, ix, scale=SCALE)  # noqa: E731
    for dtype, out_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16)):
        out, lse = (jax.jit(fn) if jit else fn)(
            jnp.zeros(q_shape, dtype), jnp.zeros((NB, BS, 576), dtype), jnp.zeros(k_shape, jnp.int32))
        assert out.shape == (*q_shape[:-1], 512) and out.dtype == out_dtype
        assert lse.shape == q_shape[:-1] and lse.dtype == jnp.float32


@pytest.mark.parametrize("kwargs, name, error", [
    (dict(scale="0.1"), "scale", TypeError),
    (dict(scale=True), "scale", TypeError),
    (dict(scale=None), "scale", TypeError),
    (dict(scale=float("nan")), "scale", ValueError),
    (dict(q_scale="1"), "q_scale", TypeError),
    (dict(k_scale="1.0"), "k_scale", TypeError),
    (dict(lse_base=2), "lse_base", TypeError),
    (dict(kv_cache_dtype=None), "kv_cache_dtype", TypeError),
    (dict(implementation=None), "implementation", TypeError),
])
def test_decode_numbers_and_options_are_type_checked(kwargs, name, error):
    args = decode_args()
    args.update(kwargs)
    with pytest.raises(error, match=named(name)):
        call_decode(args)


def test_decode_traced_scale_is_refused():
    args = decode_args()
    with pytest.raises(TypeError, match="scale must be a static"):
        jax.jit(lambda s: call_decode({**args, "scale": s}))(jnp.float32(0.1))


def test_decode_documented_edge_behaviour_holds():
    """Invalid indices (negative, past the end, anywhere in a row) are masked, an all-invalid row gives
    out = 0 / lse = -inf, valid_counts outside [0, K] act as clamped, NaN in unselected rows never
    reaches the result: eagerly and under jit."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.uniform(-1, 1, (3, H, 576)), jnp.bfloat16)
    kv = np.full((NB * BS, 576), np.nan, np.float32)
    kv[[1, 5, 7]] = rng.uniform(-1, 1, (3, 576))
    kv = jnp.asarray(kv.reshape(NB, BS, 576), jnp.bfloat16)
    idx = i32([[1, -1, 5, NB * BS + 2, 7, -9, 1, 5], [-1] * K, [7, 5, NB * BS, -1, 1, 1, 1, 1]])
    jitted = jax.jit(lambda q, kv, ix, vc: call_decode(dict(q=q, kv_cache=kv, topk_indices=ix,
                                                            valid_counts=vc, scale=SCALE)))
    for fn in (call_decode, lambda a: jitted(a["q"], a["kv_cache"], a["topk_indices"],
                                             a.get("valid_counts"))):
        base = dict(q=q, kv_cache=kv, topk_indices=idx, scale=SCALE)
        out, lse = fn(base)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert (np.asarray(out[1], np.float32) == 0).all() and np.isneginf(np.asarray(lse[1])).all()
        assert np.isfinite(np.asarray(lse)[[0, 2]]).all()
        clamped = fn({**base, "valid_counts": i32([-3, 0, K + 5])})
        explicit = fn({**base, "valid_counts": i32([0, 0, K])})
        for a, b in zip(clamped, explicit):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert np.isneginf(np.asarray(clamped[1][0])).all()  # a count of -3 is an empty row


# ----------------------------------------------------------------------------- KV-cache writers

WT = 3


def writer_args():
    return dict(kv_c=np.zeros((WT, 512), BF16), k_pe=np.zeros((WT, 64), BF16),
                kv_cache=np.zeros((2, 4, 576), BF16), slot_mapping=i32(np.arange(WT)))


def writer_bad(row_bytes, cache_dtypes):
    return {
        "kv_c": st.one_of(NON_ARRAYS, bad_dtype((WT, 512), [BF16]), bad_rank(BF16, (2,)),
                          resized((WT, 512), BF16, 1, [0, 1, 64, 576]),
                          resized((WT, 512), BF16, 0, [0, 1, 4])),
        "k_pe": st.one_of(NON_ARRAYS, bad_dtype((WT, 64), [BF16]), bad_rank(BF16, (2, 3)),
                          resized((WT, 64), BF16, 1, [0, 1, 63, 512]),
                          resized((WT, 64), BF16, 0, [0, 2]),
                          st.sampled_from([np.zeros((WT, 2, 64), BF16), np.zeros((WT, 0, 64), BF16)])),
        "kv_cache": st.one_of(NON_ARRAYS, bad_dtype((2, 4, row_bytes), cache_dtypes),
                              bad_rank(cache_dtypes[0], (3,)),
                              resized((2, 4, row_bytes), cache_dtypes[0], 2, [0, 1, 575, 577, 1024]),
                              resized((2, 4, row_bytes), cache_dtypes[0], 0, [0]),
                              resized((2, 4, row_bytes), cache_dtypes[0], 1, [0])),
        "slot_mapping": st.one_of(NON_ARRAYS, bad_dtype((WT,), [np.int32, np.int64]),
                                  bad_rank(np.int32, (1,)), resized((WT,), np.int32, 0, [0, 2, 4])),
    }


MLA_BAD = {**writer_bad(576, [BF16]),
           "k_scale": st.one_of(NOT_NUMBERS, BAD_POSITIVE_NUMBERS, st.floats(1.5, 4.0)),
           "kv_cache_dtype": not_option(("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_ds_mla"))}
DS_MLA_BAD = writer_bad(656, [np.uint8])


def call_writer(fn, args):
    args = dict(args)
    return fn(args.pop("kv_c"), args.pop("k_pe"), args.pop("kv_cache"), args.pop("slot_mapping"), **args)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(MLA_BAD)))
def test_concat_and_cache_mla_rejects_bad_argument(data, name):
    args = writer_args()
    args[name] = data.draw(MLA_BAD[name], label=name)
    with pytest.raises((TypeError, ValueError), match=named(name)):
        call_writer(jsm.concat_and_cache_mla, args)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(DS_MLA_BAD)))
def test_concat_and_cache_ds_mla_rejects_bad_argument(data, name):
    args = writer_args()
    args["kv_cache"] = np.zeros((2, 4, 656), np.uint8)
    args[name] = data.draw(DS_MLA_BAD[name], label=name)
    with pytest.raises((TypeError, ValueError), match=named(name)):
        call_writer(jsm.concat_and_cache_ds_mla, args)


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
@pytest.mark.parametrize("layout", ["bfloat16", "fp8_ds_mla"])
def test_writers_reject_empty_caches(shape, layout):
    row, dtype = (656, np.uint8) if layout == "fp8_ds_mla" else (576, BF16)
    args = writer_args()
    args["kv_cache"] = np.zeros((*shape, row), dtype)
    for fn in (jsm.concat_and_cache_mla, jax.jit(jsm.concat_and_cache_mla, static_argnames="kv_cache_dtype")):
        with pytest.raises(ValueError, match="kv_cache must have at least one"):
            call_writer(fn, {**args, "kv_cache_dtype": layout})


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("layout", ["bfloat16", "fp8", "fp8_ds_mla"])
def test_writers_empty_batch_returns_the_cache(jit, layout):
    row, dtype = (656, jnp.uint8) if layout == "fp8_ds_mla" else (
        (576, jnp.float8_e4m3fn) if layout == "fp8" else (576, jnp.bfloat16))
    cache = jnp.asarray(np.random.default_rng(1).uniform(-2, 2, (2, 4, row))).astype(dtype)
    fn = lambda a, b, c, d: jsm.concat_and_cache_mla(a, b, c, d, kv_cache_dtype=layout)  # noqa: E731
    new = (jax.jit(fn) if jit else fn)(jnp.zeros((0, 512), jnp.bfloat16), jnp.zeros((0, 1, 64), jnp.bfloat16),
                                       cache, jnp.zeros((0,), jnp.int32))
    assert new.shape == cache.shape and new.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(new).view(np.uint8), np.asarray(cache).view(np.uint8))


@pytest.mark.parametrize("kwargs, name, error", [
    (dict(k_scale="1"), "k_scale", TypeError),
    (dict(k_scale=True), "k_scale", TypeError),
    (dict(k_scale=0.0), "k_scale", ValueError),
    (dict(kv_cache_dtype=None), "kv_cache_dtype", TypeError),
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype", ValueError),
])
def test_concat_and_cache_mla_options_are_type_checked(kwargs, name, error):
    with pytest.raises(error, match=named(name)):
        call_writer(jsm.concat_and_cache_mla, {**writer_args(), **kwargs})


@pytest.mark.parametrize("jit", [False, True])
def test_writer_still_skips_negative_and_past_the_end_slots(jit):
    rng = np.random.default_rng(2)
    kv_c = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    k_pe = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    cache = jnp.zeros((2, 4, 576), jnp.bfloat16)
    fn = jax.jit(jsm.concat_and_cache_mla) if jit else jsm.concat_and_cache_mla
    new = np.asarray(fn(kv_c, k_pe, cache, i32([3, -1, 8, 100])), np.float32).reshape(8, 576)
    np.testing.assert_array_equal(new[3], np.concatenate([np.asarray(kv_c[0], np.float32),
                                                          np.asarray(k_pe[0], np.float32)]))
    assert (np.delete(new, 3, axis=0) == 0).all()


# ----------------------------------------------------------------------------- quantize_query_fp8

QUANT_BAD = {
    "q": st.one_of(NON_ARRAYS, bad_dtype((2, 576), [BF16, np.float16, np.float32]),
                   st.just(np.zeros((), BF16)),
                   st.sampled_from([0, 1, 64, 100, 512, 575, 577, 1152]).flatmap(
                       lambda d: st.lists(st.integers(0, 3), max_size=3).map(
                           lambda lead: np.zeros((*lead, d), BF16)))),
    "q_scale": st.one_of(NOT_NUMBERS, BAD_POSITIVE_NUMBERS),
}


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(QUANT_BAD)))
def test_quantize_query_fp8_rejects_bad_argument(data, name):
    args = dict(q=np.zeros((2, 576), BF16), q_scale=0.5)
    args[name] = data.draw(QUANT_BAD[name], label=name)
    with pytest.raises((TypeError, ValueError), match=named(name)):
        jsm.quantize_query_fp8(args["q"], args["q_scale"])


@pytest.mark.parametrize("width", [0, 1, 100, 577])
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_query_fp8_needs_576_columns(width, jit):
    fn = jax.jit(jsm.quantize_query_fp8, static_argnums=1) if jit else jsm.quantize_query_fp8
    with pytest.raises(ValueError, match="q must have last dimension 576"):
        fn(jnp.zeros((2, width), jnp.bfloat16), 1.0)


@pytest.mark.parametrize("q_scale, error", [("1", TypeError), (None, TypeError), (True, TypeError),
                                            (0.0, ValueError), (-1.0, ValueError),
                                            (float("inf"), ValueError), (float("nan"), ValueError)])
def test_quantize_query_fp8_q_scale_is_a_finite_positive_number(q_scale, error):
    with pytest.raises(error, match="q_scale"):
        jsm.quantize_query_fp8(jnp.zeros((2, 576), jnp.bfloat16), q_scale)
    with pytest.raises(TypeError, match="q_scale must be a static"):
        jax.jit(jsm.quantize_query_fp8)(jnp.zeros((2, 576), jnp.bfloat16), jnp.float32(1.0))


def test_quantize_query_fp8_empty_and_batched_queries():
    assert jsm.quantize_query_fp8(jnp.zeros((0, 576), jnp.bfloat16), 1.0).shape == (0, 576)
    assert jsm.quantize_query_fp8(jnp.zeros((2, 3, 576), jnp.float32), np.float32(2.0)).shape == (2, 3, 576)


# ----------------------------------------------------------------------------- index conversion

CT, CK = 2, 128


def convert_args():
    return dict(req_id_per_token=i32([0, 1]), block_table=i32(np.zeros((2, 4))),
                token_indices=i32(np.zeros((CT, CK))))


COMMON_BAD = {
    "req_id_per_token": st.one_of(
        NON_ARRAYS, bad_dtype((CT,), [np.int32]), bad_rank(np.int32, (1,)),
        resized((CT,), np.int32, 0, [0, 1, 3]),
        # Outside the table, eagerly (token 0 reads the table; token 1 may be a prefill token).
        st.sampled_from([i32([2, 0]), i32([-1, 0]), i32([1000, 1])]),
    ),
    "block_table": st.one_of(NON_ARRAYS, bad_dtype((2, 4), [np.int32]), bad_rank(np.int32, (2,)),
                             st.just(i32(np.zeros((0, 4))))),  # an empty table: every id is outside
    "token_indices": st.one_of(
        NON_ARRAYS, bad_dtype((CT, CK), [np.int32]), bad_rank(np.int32, (2,)),
        resized((CT, CK), np.int32, 1, [0, 1, 64, 100, 129, 200]),
        resized((CT, CK), np.int32, 0, [0, 1, 3]),
    ),
    "block_size": bad_ints(),
    "return_valid_counts": NOT_BOOLS,
    "compact": NOT_BOOLS,
    "implementation": not_option(("auto", "xla", "pallas", "native")),
}
PLAIN_BAD = {
    **COMMON_BAD,
    "prefill_workspace_request_ids": st.one_of(
        NON_ARRAYS.filter(lambda x: x is not None), bad_dtype((CT,), [np.int32]),
        bad_rank(np.int32, (1,)), resized((CT,), np.int32, 0, [0, 1, 3]),
        st.sampled_from([i32([0, 2]), i32([-1, 5])]),  # past the last workspace, eagerly
    ),
    "prefill_workspace_starts": st.one_of(
        NON_ARRAYS.filter(lambda x: x is not None), bad_dtype((2,), [np.int32]), bad_rank(np.int32, (1,)),
    ),
}
DCP_BAD = {
    **COMMON_BAD,
    "dcp_size": bad_ints(),
    "dcp_rank": st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(),
                          st.integers(max_value=-1), st.integers(min_value=2),
                          st.just(np.zeros(2, np.int32)), st.just(np.float32(0))),
    "cp_kv_cache_interleave_size": st.one_of(bad_ints(), st.sampled_from([3, 5, 32])),
}


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(PLAIN_BAD)))
def test_convert_rejects_bad_argument(data, name):
    args = convert_args()
    args.update(prefill_workspace_request_ids=i32([-1, 0]), prefill_workspace_starts=i32([10, 20]))
    args[name] = data.draw(PLAIN_BAD[name], label=name)
    with pytest.raises((TypeError, ValueError), match=named(name)):
        convert(args.pop("req_id_per_token"), args.pop("block_table"), args.pop("token_indices"), **args)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(sorted(DCP_BAD)))
def test_dcp_filter_rejects_bad_argument(data, name):
    args = dict(convert_args(), dcp_size=2, dcp_rank=1, cp_kv_cache_interleave_size=2, block_size=16)
    args[name] = data.draw(DCP_BAD[name], label=name)
    with pytest.raises((TypeError, ValueError), match=named(name)):
        dcp_filter(args.pop("req_id_per_token"), args.pop("block_table"), args.pop("token_indices"), **args)


@pytest.mark.parametrize("kwargs, name", [
    (dict(compact="False"), "compact"), (dict(compact=0), "compact"),
    (dict(return_valid_counts="no"), "return_valid_counts"), (dict(return_valid_counts=1), "return_valid_counts"),
    (dict(implementation=None), "implementation"),
])
@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_conversion_flags_must_be_bools(kwargs, name, fn):
    call = convert if fn == "plain" else lambda *a, **kw: dcp_filter(*a, dcp_size=2, dcp_rank=0, **kw)
    with pytest.raises(TypeError, match=named(name)):
        call(*convert_args().values(), **kwargs)


def test_conversion_accepts_numpy_bools():
    phys, counts = convert(*convert_args().values(), compact=np.bool_(True), return_valid_counts=np.bool_(True))
    assert phys.shape == (CT, CK) and counts.shape == (CT,)


@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_conversion_rejects_zero_topk_width(fn):
    call = convert if fn == "plain" else lambda *a, **kw: dcp_filter(*a, dcp_size=2, dcp_rank=0, **kw)
    args = convert_args()
    args["token_indices"] = i32(np.zeros((CT, 0)))
    with pytest.raises(ValueError, match="token_indices"):
        call(*args.values())


@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_conversion_empty_batch(fn):
    call = convert if fn == "plain" else lambda *a, **kw: dcp_filter(*a, dcp_size=2, dcp_rank=0, **kw)
    for table in (i32(np.zeros((2, 4))), i32(np.zeros((0, 4)))):
        for f in (call, jax.jit(lambda r, b, t: call(r, b, t, return_valid_counts=True))):
            out = f(i32(np.zeros(0)), table, i32(np.zeros((0, CK))))
            phys, counts = out if isinstance(out, tuple) else (out, None)
            assert phys.shape == (0, CK) and phys.dtype == jnp.int32
            assert counts is None or counts.shape == (0,)


def _tokens():
    tok = np.full((CT, CK), -1)
    tok[:, :8] = np.arange(8)
    return i32(tok)


@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_request_ids_past_an_empty_block_table(fn):
    """Eagerly a ValueError naming req_id_per_token; under jit (values unknown) every row is invalid:
    -1 everywhere, count 0, never a slot computed from a table that has no rows."""
    call = convert if fn == "plain" else lambda *a, **kw: dcp_filter(*a, dcp_size=2, dcp_rank=0, **kw)
    args = (i32([0, 0]), i32(np.zeros((0, 4))), _tokens())
    with pytest.raises(ValueError, match="req_id_per_token"):
        call(*args)
    for compact in (False, True):
        phys, counts = jax.jit(lambda r, b, t: call(r, b, t, block_size=4, return_valid_counts=True,
                                                    compact=compact))(*args)
        assert (np.asarray(phys) == -1).all() and (np.asarray(counts) == 0).all()


@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_request_ids_outside_the_table(fn):
    """Eagerly a ValueError naming req_id_per_token; under jit clipped to the table (documented)."""
    call = convert if fn == "plain" else lambda *a, **kw: dcp_filter(*a, dcp_size=2, dcp_rank=0, **kw)
    table = i32([[3, 4], [7, 8]])
    for bad in ([0, 2], [-1, 1], [0, 99]):
        with pytest.raises(ValueError, match="req_id_per_token"):
            call(i32(bad), table, _tokens(), block_size=4)
    f = jax.jit(lambda r: call(r, table, _tokens(), block_size=4))
    np.testing.assert_array_equal(np.asarray(f(i32([-5, 9]))), np.asarray(f(i32([0, 1]))))


def test_prefill_tokens_need_no_table_row():
    """A prefill-workspace token reads no block-table row, so its request id is not checked."""
    phys = convert(i32([0, 7]), i32(np.zeros((1, 4))), _tokens(), block_size=4,
                   prefill_workspace_request_ids=i32([-1, 0]), prefill_workspace_starts=i32([100]))
    np.testing.assert_array_equal(np.asarray(phys)[1, :8], 100 + np.arange(8))
    phys = convert(i32([0, 0]), i32(np.zeros((0, 4))), _tokens(), block_size=4,
                   prefill_workspace_request_ids=i32([0, 0]), prefill_workspace_starts=i32([100]))
    np.testing.assert_array_equal(np.asarray(phys)[:, :8], 100 + np.tile(np.arange(8), (2, 1)))


@pytest.mark.parametrize("starts", [[100], []])
def test_prefill_workspace_ids_past_the_last_workspace(starts):
    """Eagerly a ValueError naming prefill_workspace_request_ids; under jit the token's row is invalid
    (all -1, count 0) while the other rows are unchanged."""
    table = i32([[3, 4], [7, 8]])
    pref = i32([-1, len(starts)])
    with pytest.raises(ValueError, match="prefill_workspace_request_ids"):
        convert(i32([0, 1]), table, _tokens(), block_size=4, prefill_workspace_request_ids=pref,
                prefill_workspace_starts=i32(starts))
    for compact in (False, True):
        phys, counts = jax.jit(lambda p, s: convert(
            i32([0, 1]), table, _tokens(), block_size=4, prefill_workspace_request_ids=p,
            prefill_workspace_starts=s, return_valid_counts=True, compact=compact))(pref, i32(starts))
        phys = np.asarray(phys)
        assert (phys[1] == -1).all() and int(counts[1]) == 0
        np.testing.assert_array_equal(phys[0, :8], [12, 13, 14, 15, 16, 17, 18, 19])
        assert int(counts[0]) == 8


def test_conversion_documented_edge_behaviour_holds():
    """Negative positions and blocks at or past W give -1, a prefill row maps to start + position even
    past the table width, compaction is a stable pack and counts count the valid slots."""
    tok = np.full((CT, CK), -1)
    tok[0, :4] = [0, 9, -3, 5]   # 9 is block 2: at W = 2, so -1
    tok[1, :3] = [2, 50, 1]      # prefill row
    args = (i32([0, 1]), i32([[3, 4], [7, 8]]), i32(tok))
    kw = dict(block_size=4, prefill_workspace_request_ids=i32([-1, 0]), prefill_workspace_starts=i32([100]),
              return_valid_counts=True)
    for f in (convert, jax.jit(convert, static_argnames=("block_size", "return_valid_counts", "compact"))):
        phys, counts = f(*args, **kw)
        np.testing.assert_array_equal(np.asarray(phys)[:, :4], [[12, -1, -1, 17], [102, 150, 101, -1]])
        np.testing.assert_array_equal(np.asarray(counts), [2, 3])
        phys, _ = f(*args, **kw, compact=True)
        np.testing.assert_array_equal(np.asarray(phys)[:, :4], [[12, 17, -1, -1], [102, 150, 101, -1]])
