"""Bad arguments to the lightning-indexer ops (ops/indexer.py, ops/indexer_cache.py): each is refused
at the top of the public function with a TypeError (not an array, wrong dtype, a static int of the
wrong type) or a ValueError (wrong rank, size or value) that names the argument, before JAX sees it.

Property tests (hypothesis) perturb one argument of a valid call at a time; explicit tests cover the
zero-sized axes (empty calls that are legitimate, and those that are errors), the value checks that
only eager calls can make and what `jax.jit` does instead (block ids outside the cache: never read
outside the arrays; negative or decreasing cu_seq_lens: their documented reading), and that the
documented edge behaviour holds.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import registry
from jax_sparse_mla.ops import indexer as indexer_ops
from jax_sparse_mla.ops.indexer_cache import ue8m0_quantize

F8 = jnp.float8_e4m3fn
SETTINGS = settings(max_examples=40, deadline=None)

# --- strategies -----------------------------------------------------------------------------------------

NON_ARRAYS = st.one_of(
    st.none(), st.text(max_size=4), st.integers(-3, 3), st.floats(width=32), st.booleans(),
    st.lists(st.integers(0, 3), max_size=3), st.tuples(st.integers(0, 3), st.integers(0, 3)))
ALL_DTYPES = (np.float32, np.float16, jnp.bfloat16, np.float64, F8, jnp.float8_e5m2, np.uint8, np.int8,
              np.int32, np.int64, np.bool_, np.complex64)
BAD_STATIC_INTS = st.one_of(
    st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.integers(max_value=0),
    st.integers(min_value=2**31, max_value=2**40), st.just(np.float32(3.0)), st.just(np.bool_(True)),
    st.just(jnp.int32(3)), st.just([3]), st.just("2048"))
IMPLEMENTATIONS = st.one_of(st.text(max_size=6).filter(lambda s: s not in ("auto", "xla", "native")),
                            st.none(), st.integers(), st.just(["xla"]))


def _with_rank(shape, rank):
    return tuple(shape[:rank]) if rank <= len(shape) else tuple(shape) + (1,) * (rank - len(shape))


def bad_arrays(shape, dtypes, *, min_rank=None, axes=None):
    """Values that are wrong for an array argument of `shape` and one of `dtypes`: not arrays, other
    dtypes, other ranks (below min_rank when the rank may vary) and wrong sizes of `axes`
    ({axis: strategy of bad sizes})."""
    allowed = {np.dtype(d) for d in dtypes}
    good = dtypes[0]
    ranks = (st.integers(0, min_rank - 1) if min_rank is not None
             else st.integers(0, 5).filter(lambda r: r != len(shape)))
    options = [
        NON_ARRAYS,
        st.sampled_from([d for d in ALL_DTYPES if np.dtype(d) not in allowed]).map(
            lambda d: np.zeros(shape, d)),
        ranks.map(lambda r: np.zeros(_with_rank(shape, r), good)),
    ]
    for axis, sizes in (axes or {}).items():
        options.append(sizes.map(
            lambda n, axis=axis: np.zeros(shape[:axis] + (n,) + shape[axis + 1:], good)))
    return st.one_of(options)


def sizes_except(*good, max_value=300):
    return st.integers(0, max_value).filter(lambda n: n not in good)


def raises_naming(name):
    return pytest.raises((TypeError, ValueError), match=rf"\b{re.escape(name)}\b")


def cases(specs):
    """One (argument name, bad value) per draw, over every argument's strategy."""
    return st.one_of([st.tuples(st.just(name), strategy) for name, strategy in specs.items()])


# --- valid calls and their per-argument bad values ------------------------------------------------------

NB, BS, B, NN, H, W = 4, 16, 2, 1, 32, 2
MCL = W * BS


def paged_args():
    return dict(q=jnp.zeros((B, NN, H, 128), F8), index_cache=jnp.zeros((NB, BS, 132), jnp.uint8),
                weights=jnp.zeros((B * NN, H), jnp.float32), context_lens=jnp.asarray([3, 20], jnp.int32),
                block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32), max_context_len=MCL)


def _set(values, index, value):
    values = np.array(values)
    values[index] = value
    return values


PAGED_BAD = {
    "q": bad_arrays((B, NN, H, 128), (F8,), axes={1: st.just(0), 2: sizes_except(32, 64),
                                                  3: sizes_except(128)}),
    "index_cache": bad_arrays((NB, BS, 132), (np.uint8,), axes={0: st.just(0), 1: st.just(0),
                                                               2: sizes_except(132)}),
    "weights": bad_arrays((B * NN, H), (np.float32,), axes={0: sizes_except(B * NN), 1: sizes_except(H)}),
    "context_lens": st.one_of(
        bad_arrays((B,), (np.int32,), axes={0: sizes_except(B)}),
        st.tuples(st.integers(0, B - 1), st.integers(MCL + 1, 2**31 - 1)).map(
            lambda iv: _set(np.asarray([3, 20], np.int32), *iv))),
    "block_table": st.one_of(
        bad_arrays((B, W), (np.int32,), axes={0: sizes_except(B), 1: st.integers(0, W - 1)}),
        # an id outside the cache among the blocks a request reads (request 1 reads both of its own)
        st.tuples(st.sampled_from([(0, 0), (1, 0), (1, 1)]),
                  st.one_of(st.integers(-2**31, -1), st.integers(NB, 2**31 - 1))).map(
            lambda iv: _set(np.asarray([[0, 1], [2, 3]], np.int32), *iv))),
    "max_context_len": st.one_of(BAD_STATIC_INTS, st.integers(MCL + 1, 2**40)),
    "implementation": IMPLEMENTATIONS,
}


def ragged_args():
    return dict(q=jnp.zeros((3, H, 128), F8), k_fp8=jnp.zeros((10, 128), F8), k_scale=jnp.ones(10, jnp.float32),
                weights=jnp.zeros((3, H), jnp.float32), row_starts=jnp.zeros(3, jnp.int32),
                row_ends=jnp.full(3, 10, jnp.int32))


RAGGED_BAD = {
    "q": bad_arrays((3, H, 128), (F8,), axes={1: sizes_except(32, 64), 2: sizes_except(128)}),
    "k_fp8": bad_arrays((10, 128), (F8,), axes={1: sizes_except(128)}),
    "k_scale": bad_arrays((10,), (np.float32,), axes={0: sizes_except(10)}),
    "weights": bad_arrays((3, H), (np.float32,), axes={0: sizes_except(3), 1: sizes_except(H)}),
    "row_starts": st.one_of(
        bad_arrays((3,), (np.int32,), axes={0: sizes_except(3)}),
        st.tuples(st.integers(0, 2), st.integers(-2**31, -1)).map(lambda iv: _set(np.zeros(3, np.int32), *iv))),
    "row_ends": st.one_of(
        bad_arrays((3,), (np.int32,), axes={0: sizes_except(3)}),
        st.tuples(st.integers(0, 2), st.integers(11, 2**31 - 1)).map(
            lambda iv: _set(np.full(3, 10, np.int32), *iv))),
    "implementation": IMPLEMENTATIONS,
}


def top_k_args():
    return dict(logits=jnp.zeros((4, 50), jnp.float32), row_starts=jnp.zeros(4, jnp.int32),
                row_ends=jnp.full(4, 50, jnp.int32), k=8)


TOP_K_BAD = {
    "logits": bad_arrays((4, 50), (np.float32,), axes={0: sizes_except(4)}),
    "row_starts": st.one_of(
        bad_arrays((4,), (np.int32,), axes={0: sizes_except(4)}),
        st.tuples(st.integers(0, 3), st.integers(-2**31, -1)).map(lambda iv: _set(np.zeros(4, np.int32), *iv))),
    "row_ends": st.one_of(
        bad_arrays((4,), (np.int32,), axes={0: sizes_except(4)}),
        st.tuples(st.integers(0, 3), st.integers(51, 2**31 - 1)).map(
            lambda iv: _set(np.full(4, 50, np.int32), *iv))),
    "k": BAD_STATIC_INTS,
    "implementation": IMPLEMENTATIONS,
}


def decode_top_k_args():
    return dict(logits=jnp.zeros((4, 50), jnp.float32), context_lens=jnp.asarray([10, 50], jnp.int32),
                next_n=2, k=8)


DECODE_TOP_K_BAD = {
    "logits": bad_arrays((4, 50), (np.float32,), axes={0: sizes_except(4)}),
    "context_lens": st.one_of(
        bad_arrays((2,), (np.int32,), axes={0: sizes_except(2)}),
        st.tuples(st.integers(0, 1), st.integers(51, 2**31 - 1)).map(
            lambda iv: _set(np.asarray([10, 50], np.int32), *iv))),
    "next_n": st.one_of(BAD_STATIC_INTS, st.integers(1, 100).filter(lambda n: n != 2)),
    "k": BAD_STATIC_INTS,
    "implementation": IMPLEMENTATIONS,
}


def writer_args():
    return dict(k=jnp.zeros((4, 128), jnp.bfloat16), index_cache=jnp.zeros((NB, BS, 132), jnp.uint8),
                slot_mapping=jnp.arange(4, dtype=jnp.int32))


WRITER_BAD = {
    "k": bad_arrays((4, 128), (jnp.bfloat16, np.float16, np.float32), axes={1: sizes_except(128)}),
    "index_cache": bad_arrays((NB, BS, 132), (np.uint8,), axes={0: st.just(0), 1: st.just(0),
                                                               2: sizes_except(132)}),
    "slot_mapping": bad_arrays((4,), (np.int32, np.int64), axes={0: sizes_except(4)}),
    "implementation": IMPLEMENTATIONS,
}


def gather_args():
    return dict(index_cache=jnp.zeros((NB, BS, 132), jnp.uint8),
                block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32),
                cu_seq_lens=jnp.asarray([0, 20, 30], jnp.int32), num_tokens=40)


def _bad_cu(draw_values):
    a, b, c = draw_values
    return np.asarray([a, b, c], np.int32)


GATHER_BAD = {
    "index_cache": bad_arrays((NB, BS, 132), (np.uint8,), axes={0: st.just(0), 1: st.just(0),
                                                               2: sizes_except(132)}),
    "block_table": st.one_of(
        bad_arrays((2, W), (np.int32,)),
        st.tuples(st.sampled_from([(0, 0), (0, 1), (1, 0)]),
                  st.one_of(st.integers(-2**31, -1), st.integers(NB, 2**31 - 1))).map(
            lambda iv: _set(np.asarray([[0, 1], [2, 3]], np.int32), *iv))),
    "cu_seq_lens": st.one_of(
        bad_arrays((3,), (np.int32,), axes={0: sizes_except(3)}),
        # negative start or a decrease somewhere (every length fits the table and num_tokens)
        st.tuples(st.integers(-32, -1), st.integers(0, 0), st.integers(0, 0)).map(
            lambda t: np.asarray([t[0], t[0] + 5, t[0] + 10], np.int32)),
        st.tuples(st.integers(1, 32), st.integers(0, 31)).filter(lambda t: t[1] < t[0]).map(
            lambda t: np.asarray([0, t[0], t[1]], np.int32)),
        st.integers(41, 64).map(lambda n: np.asarray([0, 32, n], np.int32)),  # cu[R] > num_tokens
        st.integers(33, 40).map(lambda n: np.asarray([0, n, n], np.int32))),  # longer than its table row
    "num_tokens": st.one_of(BAD_STATIC_INTS, st.integers(1, 29)),  # < cu[R] = 30
    "implementation": IMPLEMENTATIONS,
}


def _call(fn, args, name, value):
    args = dict(args)
    args[name] = value
    with raises_naming(name):
        fn(**args)


@SETTINGS
@given(cases(PAGED_BAD))
def test_paged_logits_refuse_each_bad_argument(case):
    _call(jsm.fp8_paged_mqa_logits, paged_args(), *case)


@SETTINGS
@given(cases(RAGGED_BAD))
def test_ragged_logits_refuse_each_bad_argument(case):
    _call(jsm.fp8_mqa_logits, ragged_args(), *case)


@SETTINGS
@given(cases(TOP_K_BAD))
def test_top_k_refuses_each_bad_argument(case):
    _call(jsm.top_k_per_row, top_k_args(), *case)


@SETTINGS
@given(cases(DECODE_TOP_K_BAD))
def test_decode_top_k_refuses_each_bad_argument(case):
    _call(jsm.top_k_per_row_decode, decode_top_k_args(), *case)


@SETTINGS
@given(cases(WRITER_BAD))
def test_writer_refuses_each_bad_argument(case):
    _call(jsm.indexer_k_quant_and_cache, writer_args(), *case)


@SETTINGS
@given(cases(GATHER_BAD))
def test_gather_refuses_each_bad_argument(case):
    _call(jsm.cp_gather_indexer_k_quant_cache, gather_args(), *case)


BAD_EPS = st.one_of(st.none(), st.text(max_size=3), st.booleans(), st.just([1e-4]), st.just(jnp.ones(2)),
                    st.floats(max_value=0.0), st.just(float("inf")), st.just(float("nan")),
                    st.floats(min_value=1e-45, max_value=5e-36), st.floats(min_value=3.5e38, max_value=1e300))


@SETTINGS
@given(cases({
    "q": bad_arrays((3, H, 128), (jnp.bfloat16, np.float16, np.float32), min_rank=2,
                    axes={1: st.just(0), 2: sizes_except(128)}),
    "eps": BAD_EPS,
}))
def test_query_quantisation_refuses_each_bad_argument(case):
    _call(indexer_ops.quantize_indexer_q, dict(q=jnp.zeros((3, H, 128), jnp.bfloat16), eps=1e-10), *case)


@SETTINGS
@given(cases({
    "x": bad_arrays((3, 128), (jnp.bfloat16, np.float16, np.float32), min_rank=1, axes={1: sizes_except(128)}),
    "eps": BAD_EPS,
}))
def test_ue8m0_quantize_refuses_each_bad_argument(case):
    _call(ue8m0_quantize, dict(x=jnp.zeros((3, 128), jnp.float32), eps=1e-4), *case)


@SETTINGS
@given(cases({
    "weights": bad_arrays((3, H), (jnp.bfloat16, np.float16, np.float32), min_rank=1, axes={1: st.just(0)}),
    "q_scale": bad_arrays((3, H), (jnp.bfloat16, np.float16, np.float32),
                          axes={0: sizes_except(3), 1: sizes_except(H)}),
}))
def test_weight_folding_refuses_each_bad_argument(case):
    _call(indexer_ops.fold_indexer_weights,
          dict(weights=jnp.zeros((3, H), jnp.float32), q_scale=jnp.ones((3, H), jnp.float32)), *case)


def test_the_valid_calls_above_are_valid():
    """The property tests perturb these calls: unperturbed, each runs."""
    assert jsm.fp8_paged_mqa_logits(**paged_args()).shape == (B * NN, MCL)
    assert jsm.fp8_mqa_logits(**ragged_args()).shape == (3, 10)
    assert jsm.top_k_per_row(**top_k_args()).shape == (4, 8)
    assert jsm.top_k_per_row_decode(**decode_top_k_args()).shape == (4, 8)
    assert jsm.indexer_k_quant_and_cache(**writer_args()).shape == (NB, BS, 132)
    assert jsm.cp_gather_indexer_k_quant_cache(**gather_args())[0].shape == (40, 128)
    assert indexer_ops.quantize_indexer_q(jnp.zeros((3, H, 128), jnp.bfloat16))[1].shape == (3, H)
    assert ue8m0_quantize(jnp.zeros((3, 128), jnp.float32), 1e-4)[1].shape == (3,)
    assert indexer_ops.fold_indexer_weights(jnp.zeros((3, H)), jnp.ones((3, H))).shape == (3, H)


# --- static ints and types ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, False, np.bool_(True), 32.0, "32", None, jnp.int32(32), [32]])
def test_static_sizes_must_be_ints_not_bools_floats_or_strings(value):
    with pytest.raises(TypeError, match="max_context_len must be a positive int"):
        jsm.fp8_paged_mqa_logits(**{**paged_args(), "max_context_len": value})
    with pytest.raises(TypeError, match="top_k_per_row: k must be a positive int"):
        jsm.top_k_per_row(**{**top_k_args(), "k": value})
    with pytest.raises(TypeError, match="top_k_per_row_decode: next_n must be a positive int"):
        jsm.top_k_per_row_decode(**{**decode_top_k_args(), "next_n": value})
    with pytest.raises(TypeError, match="top_k_per_row_decode: k must be a positive int"):
        jsm.top_k_per_row_decode(**{**decode_top_k_args(), "k": value})
    with pytest.raises(TypeError, match="num_tokens must be a positive int"):
        jsm.cp_gather_indexer_k_quant_cache(**{**gather_args(), "num_tokens": value})


def test_static_sizes_in_range_and_numpy_ints_accepted():
    with pytest.raises(ValueError, match="top_k_per_row: k must be at most 2147483647"):
        jsm.top_k_per_row(**{**top_k_args(), "k": 2**31})
    with pytest.raises(ValueError, match="num_tokens must be at most 2147483647"):
        jsm.cp_gather_indexer_k_quant_cache(**{**gather_args(), "num_tokens": 2**31})
    with pytest.raises(ValueError, match=r"max_context_len = 33 is more than block_table covers \(2 blocks x 16"):
        jsm.fp8_paged_mqa_logits(**{**paged_args(), "max_context_len": MCL + 1})
    with pytest.raises(ValueError, match="max_context_len must be a positive int, got -1"):
        jsm.fp8_paged_mqa_logits(**{**paged_args(), "max_context_len": -1})
    assert jsm.top_k_per_row(**{**top_k_args(), "k": np.int64(8)}).shape == (4, 8)
    assert jsm.fp8_paged_mqa_logits(**{**paged_args(), "max_context_len": np.int32(MCL)}).shape == (2, MCL)


# --- zero-sized axes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_zero_rows_are_empty_calls(implementation):
    """No request, token or row: the ops return the empty shape (no error, no JAX failure)."""
    impl = dict(implementation=implementation)
    out = jsm.fp8_paged_mqa_logits(jnp.zeros((0, 2, 64, 128), F8), jnp.zeros((NB, BS, 132), jnp.uint8),
                                   jnp.zeros((0, 64), jnp.float32), jnp.zeros(0, jnp.int32),
                                   jnp.zeros((0, W), jnp.int32), max_context_len=MCL, **impl)
    assert out.shape == (0, MCL) and out.dtype == jnp.float32
    out = jsm.fp8_mqa_logits(jnp.zeros((0, 32, 128), F8), jnp.zeros((10, 128), F8), jnp.ones(10, jnp.float32),
                             jnp.zeros((0, 32), jnp.float32), jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32),
                             **impl)
    assert out.shape == (0, 10)
    # no keys: every row's range is empty
    out = jsm.fp8_mqa_logits(jnp.zeros((3, 32, 128), F8), jnp.zeros((0, 128), F8), jnp.ones(0, jnp.float32),
                             jnp.zeros((3, 32), jnp.float32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32),
                             **impl)
    assert out.shape == (3, 0)
    for fn in (jsm.top_k_per_row, jax.jit(jsm.top_k_per_row, static_argnames=("k", "implementation"))):
        out = fn(jnp.zeros((0, 50), jnp.float32), jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32), k=8, **impl)
        assert out.shape == (0, 8) and out.dtype == jnp.int32
        out = fn(jnp.zeros((3, 0), jnp.float32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), k=8, **impl)
        np.testing.assert_array_equal(out, np.full((3, 8), -1))
    out = jsm.top_k_per_row_decode(jnp.zeros((0, 50), jnp.float32), jnp.zeros(0, jnp.int32), next_n=2, k=8,
                                   **impl)
    assert out.shape == (0, 8)
    out = jsm.top_k_per_row_decode(jnp.zeros((4, 0), jnp.float32), jnp.zeros(2, jnp.int32), next_n=2, k=8,
                                   **impl)
    np.testing.assert_array_equal(out, np.full((4, 8), -1))
    cache = jnp.asarray(np.random.default_rng(0).integers(0, 256, (NB, BS, 132), dtype=np.uint8))
    out = jsm.indexer_k_quant_and_cache(jnp.zeros((0, 128), jnp.bfloat16), cache, jnp.zeros(0, jnp.int32),
                                        **impl)
    np.testing.assert_array_equal(out, cache)
    k_fp8, k_scale = jsm.cp_gather_indexer_k_quant_cache(cache, jnp.zeros((0, W), jnp.int32),
                                                         jnp.zeros(1, jnp.int32), num_tokens=5, **impl)
    assert k_fp8.shape == (5, 128) and not np.asarray(k_scale).any()
    k_fp8, k_scale = jsm.cp_gather_indexer_k_quant_cache(cache, jnp.zeros((2, 0), jnp.int32),
                                                         jnp.zeros(3, jnp.int32), num_tokens=5, **impl)
    assert not np.asarray(k_fp8.view(jnp.uint8)).any() and not np.asarray(k_scale).any()
    q8, scale = indexer_ops.quantize_indexer_q(jnp.zeros((0, 64, 128), jnp.bfloat16))
    assert q8.shape == (0, 64, 128) and scale.shape == (0, 64)
    assert indexer_ops.fold_indexer_weights(jnp.zeros((0, 64)), jnp.zeros((0, 64))).shape == (0, 64)


ZERO_AXIS_ERRORS = [
    ("heads", lambda: jsm.fp8_paged_mqa_logits(**{**paged_args(), "q": jnp.zeros((B, NN, 0, 128), F8)}),
     r"fp8_paged_mqa_logits: q must have 32 or 64 heads"),
    ("next_n axis", lambda: jsm.fp8_paged_mqa_logits(**{**paged_args(), "q": jnp.zeros((B, 0, H, 128), F8),
                                                         "weights": jnp.zeros((0, H), jnp.float32)}),
     r"fp8_paged_mqa_logits: q must have at least one query token per request \(next_n\)"),
    ("num_blocks", lambda: jsm.fp8_paged_mqa_logits(
        **{**paged_args(), "index_cache": jnp.zeros((0, BS, 132), jnp.uint8)}),
     r"fp8_paged_mqa_logits: index_cache must have at least one block \(num_blocks\)"),
    ("block_size", lambda: jsm.fp8_paged_mqa_logits(
        **{**paged_args(), "index_cache": jnp.zeros((NB, 0, 132), jnp.uint8)}),
     r"fp8_paged_mqa_logits: index_cache must have at least one token per block \(block_size\)"),
    ("W", lambda: jsm.fp8_paged_mqa_logits(**{**paged_args(), "block_table": jnp.zeros((B, 0), jnp.int32)}),
     r"max_context_len = 32 is more than block_table covers \(0 blocks"),
    ("max_context_len", lambda: jsm.fp8_paged_mqa_logits(**{**paged_args(), "max_context_len": 0}),
     "fp8_paged_mqa_logits: max_context_len must be a positive int, got 0"),
    ("ragged heads", lambda: jsm.fp8_mqa_logits(**{**ragged_args(), "q": jnp.zeros((3, 0, 128), F8),
                                                   "weights": jnp.zeros((3, 0), jnp.float32)}),
     "fp8_mqa_logits: q must have 32 or 64 heads"),
    ("k", lambda: jsm.top_k_per_row(**{**top_k_args(), "k": 0}), "top_k_per_row: k must be a positive int"),
    ("decode k", lambda: jsm.top_k_per_row_decode(**{**decode_top_k_args(), "k": 0}),
     "top_k_per_row_decode: k must be a positive int"),
    ("next_n", lambda: jsm.top_k_per_row_decode(jnp.zeros((0, 50), jnp.float32), jnp.zeros(0, jnp.int32),
                                                next_n=0, k=8),
     "top_k_per_row_decode: next_n must be a positive int"),
    ("writer num_blocks", lambda: jsm.indexer_k_quant_and_cache(
        **{**writer_args(), "index_cache": jnp.zeros((0, BS, 132), jnp.uint8)}),
     r"indexer_k_quant_and_cache: index_cache must have at least one block"),
    ("writer block_size", lambda: jsm.indexer_k_quant_and_cache(
        **{**writer_args(), "index_cache": jnp.zeros((NB, 0, 132), jnp.uint8)}),
     r"indexer_k_quant_and_cache: index_cache must have at least one token per block"),
    ("gather num_blocks", lambda: jsm.cp_gather_indexer_k_quant_cache(
        **{**gather_args(), "index_cache": jnp.zeros((0, BS, 132), jnp.uint8)}),
     r"cp_gather_indexer_k_quant_cache: index_cache must have at least one block"),
    ("gather block_size", lambda: jsm.cp_gather_indexer_k_quant_cache(
        **{**gather_args(), "index_cache": jnp.zeros((NB, 0, 132), jnp.uint8)}),
     r"cp_gather_indexer_k_quant_cache: index_cache must have at least one token per block"),
    ("num_tokens", lambda: jsm.cp_gather_indexer_k_quant_cache(**{**gather_args(), "num_tokens": 0}),
     "cp_gather_indexer_k_quant_cache: num_tokens must be a positive int"),
    ("gather W with tokens", lambda: jsm.cp_gather_indexer_k_quant_cache(
        **{**gather_args(), "block_table": jnp.zeros((2, 0), jnp.int32)}),
     r"request 0 has 20 tokens but block_table covers 0 blocks"),
    ("query heads", lambda: indexer_ops.quantize_indexer_q(jnp.zeros((3, 0, 128), jnp.bfloat16)),
     r"quantize_indexer_q: q must have at least one head \(H\)"),
    ("weight heads", lambda: indexer_ops.fold_indexer_weights(jnp.zeros((3, 0)), jnp.zeros((3, 0))),
     r"fold_indexer_weights: weights must have at least one head \(H\)"),
]


@pytest.mark.parametrize("what,call,message", ZERO_AXIS_ERRORS, ids=[c[0] for c in ZERO_AXIS_ERRORS])
def test_zero_sized_axes_that_are_errors(what, call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- block ids outside the cache in fp8_paged_mqa_logits -------------------------------------------------

def _paged_problem(rng, batch=2, next_n=2, num_heads=32, num_blocks=6, block_size=16, width=4):
    """A fully written cache and random queries / weights (values that make every score finite)."""
    keys = (rng.standard_normal((num_blocks * block_size, 128)) * 3).astype(jnp.bfloat16)
    cache = jsm.indexer_k_quant_and_cache(jnp.asarray(keys), jnp.zeros((num_blocks, block_size, 132), jnp.uint8),
                                          jnp.arange(num_blocks * block_size, dtype=jnp.int32))
    q = jnp.asarray(rng.standard_normal((batch, next_n, num_heads, 128)), F8)
    weights = jnp.asarray(rng.standard_normal((batch * next_n, num_heads)), jnp.float32)
    return cache, q, weights


def test_paged_block_id_outside_the_cache_is_an_eager_error():
    rng = np.random.default_rng(1)
    cache, q, weights = _paged_problem(rng)
    lens = jnp.asarray([40, 17], jnp.int32)  # request 0 reads entries 0..2, request 1 entries 0..1
    good = np.asarray([[0, 1, 2, 99], [3, 4, -5, 77]], np.int32)  # junk only past the contexts
    fn = jsm.fp8_paged_mqa_logits
    out = fn(q, cache, weights, lens, jnp.asarray(good), max_context_len=64)
    clean = fn(q, cache, weights, lens, jnp.asarray([[0, 1, 2, 5], [3, 4, 0, 1]], jnp.int32), max_context_len=64)
    np.testing.assert_array_equal(out, clean)  # entries past a context are never used
    for index, bad in (((1, 1), -5), ((0, 2), 6), ((0, 0), 2**31 - 1), ((1, 0), -1)):
        with pytest.raises(ValueError, match=rf"fp8_paged_mqa_logits: block_table\[{index[0]}, {index[1]}\] = "
                                             rf"{bad} is outside the index cache's 6 blocks"):
            fn(q, cache, weights, lens, jnp.asarray(_set(good, index, bad)), max_context_len=64)
    # lengths past max_context_len are reported as such, before any block id
    with pytest.raises(ValueError, match="context_lens\\[0\\] = 65 exceeds max_context_len = 64"):
        fn(q, cache, weights, jnp.asarray([65, 17], jnp.int32), jnp.asarray(good), max_context_len=64)
    # padding requests (length <= 0) read no block
    out = fn(q, cache, weights, jnp.asarray([0, -3], jnp.int32), jnp.full((2, 4), -1, jnp.int32),
             max_context_len=64)
    assert (np.asarray(out) == -np.inf).all()


@pytest.mark.parametrize("small_chunks", [False, True])
def test_paged_block_id_outside_the_cache_under_jit_is_minus_inf(small_chunks, monkeypatch):
    """Under jit the ids are unknown: a bad one is never read (it would be clamped to the last block)
    and its block_size positions are -inf in every row of its request; other positions are unchanged."""
    if small_chunks:
        monkeypatch.setattr(indexer_ops, "SCORE_CHUNK_BYTES", 1)
    rng = np.random.default_rng(2)
    cache, q, weights = _paged_problem(rng)
    lens = jnp.asarray([64, 40], jnp.int32)
    good = np.asarray([[0, 1, 2, 3], [4, 5, 0, 1]], np.int32)
    bad = good.copy()
    bad[0, 1], bad[1, 0], bad[1, 2] = 6, -1, 2**31 - 1
    paged = jax.jit(jsm.fp8_paged_mqa_logits, static_argnames=("max_context_len", "implementation"))
    want = np.asarray(paged(q, cache, weights, lens, jnp.asarray(good), max_context_len=64))
    got = np.asarray(paged(q, cache, weights, lens, jnp.asarray(bad), max_context_len=64))
    assert np.isfinite(want[:, :39]).all()
    expect = want.copy()
    expect[0:2, 16:32] = -np.inf  # request 0, block entry 1
    expect[2:4, 0:16] = -np.inf  # request 1, entry 0
    expect[2:4, 32:48] = -np.inf  # request 1, entry 2 (its rows end at 39 and 40 anyway)
    np.testing.assert_array_equal(got, expect)


def test_native_paged_kernels_get_the_checks_and_their_own_output(monkeypatch):
    """A native kernel gets the same eager check; under jit its output is passed through unchanged
    (ours read the cache's last block for an id outside it: no extra pass over the logits)."""
    calls = []

    def fake_paged(q, index_cache, weights, context_lens, block_table, *, max_context_len):
        calls.append(max_context_len)
        return jnp.zeros((q.shape[0] * q.shape[1], max_context_len), jnp.float32)

    kernels = {op: [k for k in ks if not k.native] for op, ks in registry._OP_KERNELS.items()}
    monkeypatch.setattr(registry, "_OP_KERNELS", kernels)
    registry.register_op_kernel(registry.OpKernel(op="fp8_paged_mqa_logits", name="sm90_fake", native=True,
                                                  capability_majors=(9,), fn=fake_paged))
    monkeypatch.setattr(registry, "current_device_capability", lambda: (9, 0))
    args = paged_args()
    args["block_table"] = jnp.asarray([[0, 9], [-4, 3]], jnp.int32)
    out = jax.jit(lambda table: jsm.fp8_paged_mqa_logits(**{**args, "block_table": table},
                                                         implementation="native"))(args["block_table"])
    np.testing.assert_array_equal(out, np.zeros((2, MCL), np.float32))
    assert calls == [MCL]
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -4 is outside"):  # eagerly: refused
        jsm.fp8_paged_mqa_logits(**args, implementation="native")


# --- cu_seq_lens and block ids of cp_gather_indexer_k_quant_cache -----------------------------------------

def _distinct_cache(num_blocks=NB, block_size=BS):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((num_blocks * block_size, 128)).astype(jnp.bfloat16)
    keys[:, 0] += 10 * np.arange(num_blocks * block_size)  # every record differs
    return jsm.indexer_k_quant_and_cache(jnp.asarray(keys), jnp.zeros((num_blocks, block_size, 132), jnp.uint8),
                                         jnp.arange(num_blocks * block_size, dtype=jnp.int32))


def _gather_rule_np(cache, table, cu, num_tokens):
    """docs/semantics.md's reading of any cu_seq_lens under jit: its running maximum clamped at 0;
    request r owns rows [cu'[r], cu'[r + 1]), row cu'[r] + i is its token i, rows past its table row
    or past num_tokens are dropped. (values uint8 [N, 128], scales float32 [N])."""
    cu = np.maximum.accumulate(np.maximum(np.asarray(cu, np.int64), 0))
    cache = np.asarray(cache, np.uint8)
    block_size = cache.shape[1]
    values, scales = np.zeros((num_tokens, 128), np.uint8), np.zeros(num_tokens, np.float32)
    for r in range(len(cu) - 1):
        for i in range(min(int(cu[r + 1] - cu[r]), table.shape[1] * block_size)):
            if cu[r] + i < num_tokens:
                flat = cache[table[r, i // block_size]].reshape(-1)
                o = i % block_size
                values[cu[r] + i] = flat[o * 128: o * 128 + 128]
                scales[cu[r] + i] = flat[block_size * 128 + 4 * o: block_size * 128 + 4 * o + 4].view("<f4")[0]
    return values, scales


@pytest.mark.parametrize("cu", [[0, 20, 10], [-3, 10, 20], [0, 0, -1], [5, 3, 1]])
def test_gather_negative_or_decreasing_cu_seq_lens(cu):
    cache = _distinct_cache()
    table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    gather = jsm.cp_gather_indexer_k_quant_cache
    with pytest.raises(ValueError, match=r"cu_seq_lens must be non-negative and non-decreasing"):
        gather(cache, table, jnp.asarray(cu, jnp.int32), num_tokens=40)


_GATHER_JIT = {}


@SETTINGS
@given(cu=st.lists(st.integers(-40, 80), min_size=3, max_size=3), num_tokens=st.sampled_from([1, 40, 80]))
def test_gather_any_cu_seq_lens_under_jit_follows_the_rule(cu, num_tokens):
    """Under jit every cu_seq_lens has the documented result (docs/semantics.md): negative or
    decreasing entries read as the running maximum clamped at 0; eagerly they are ValueErrors."""
    if "cache" not in _GATHER_JIT:
        _GATHER_JIT["cache"] = _distinct_cache()
    cache = _GATHER_JIT["cache"]
    table = np.asarray([[0, 1], [2, 3]], np.int32)
    gather = jax.jit(jsm.cp_gather_indexer_k_quant_cache, static_argnames="num_tokens")
    k_fp8, k_scale = gather(cache, jnp.asarray(table), jnp.asarray(cu, jnp.int32), num_tokens=num_tokens)
    want_values, want_scales = _gather_rule_np(cache, table, cu, num_tokens)
    np.testing.assert_array_equal(np.asarray(k_fp8).view(np.uint8), want_values)
    np.testing.assert_array_equal(np.asarray(k_scale), want_scales)
    if cu[0] < 0 or np.any(np.diff(cu) < 0):
        with pytest.raises(ValueError, match="cu_seq_lens must be non-negative and non-decreasing"):
            jsm.cp_gather_indexer_k_quant_cache(cache, jnp.asarray(table), jnp.asarray(cu, jnp.int32),
                                                num_tokens=num_tokens)


def test_gather_block_id_outside_the_cache():
    cache = _distinct_cache()
    gather = jsm.cp_gather_indexer_k_quant_cache
    cu = jnp.asarray([0, 20, 30], jnp.int32)  # request 0 reads entries 0, 1; request 1 entry 0
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 4 is outside the index cache's 4 blocks"):
        gather(cache, jnp.asarray([[0, 4], [2, 3]], jnp.int32), cu, num_tokens=40)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1 is outside"):
        gather(cache, jnp.asarray([[0, 1], [-1, 3]], jnp.int32), cu, num_tokens=40)
    junk = jnp.asarray([[0, 1], [2, -7]], jnp.int32)  # past request 1's last block: never read
    want = gather(cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32), cu, num_tokens=40)
    got = gather(cache, junk, cu, num_tokens=40)
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))
    # under jit, as documented: ids outside the cache read as 0 with scale 0
    k_fp8, k_scale = jax.jit(lambda t: gather(cache, t, cu, num_tokens=40))(jnp.asarray([[0, 4], [2, 3]], jnp.int32))
    assert not np.asarray(k_fp8[16:20]).view(np.uint8).any() and not np.asarray(k_scale[16:20]).any()
    np.testing.assert_array_equal(np.asarray(k_fp8[:16]).view(np.uint8), np.asarray(want[0][:16]).view(np.uint8))


# --- documented edge behaviour still holds --------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_top_k_edge_rules_unchanged(implementation):
    """NaN below every number (-inf included), ties to the lower position, ascending positions then -1;
    eager ranges past the width are errors, under jit they are cut."""
    row = jnp.asarray([[np.nan, 1.0, 1.0, -np.inf, 2.0, -0.0, 0.0]], jnp.float32)
    starts, ends = jnp.zeros(1, jnp.int32), jnp.full(1, 7, jnp.int32)
    top = lambda k, e=ends: np.asarray(jsm.top_k_per_row(row, starts, e, k=k, implementation=implementation))
    np.testing.assert_array_equal(top(3), [[1, 2, 4]])
    np.testing.assert_array_equal(top(4), [[1, 2, 4, 5]])  # -0.0 == +0.0: the lower position
    np.testing.assert_array_equal(top(6), [[1, 2, 3, 4, 5, 6]])  # -inf above NaN
    np.testing.assert_array_equal(top(9), [[0, 1, 2, 3, 4, 5, 6, -1, -1]])
    with pytest.raises(ValueError, match=r"row_ends\[0\] = 9 exceeds the logits width S = 7"):
        top(3, jnp.full(1, 9, jnp.int32))
    cut = jax.jit(lambda e: jsm.top_k_per_row(row, starts, e, k=9, implementation=implementation))
    np.testing.assert_array_equal(cut(jnp.full(1, 9, jnp.int32)), top(9))
    decode = jax.jit(lambda lens: jsm.top_k_per_row_decode(row, lens, k=9, implementation=implementation))
    np.testing.assert_array_equal(decode(jnp.full(1, 100, jnp.int32)), top(9))


def test_logits_are_minus_inf_outside_ranges_and_cut_under_jit():
    rng = np.random.default_rng(4)
    cache, q, weights = _paged_problem(rng, batch=2, next_n=1, width=4)
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 0, 1]], jnp.int32)
    out = np.asarray(jsm.fp8_paged_mqa_logits(q, cache, weights, jnp.asarray([20, 0], jnp.int32), table,
                                              max_context_len=64))
    assert np.isfinite(out[0, :20]).all() and (out[0, 20:] == -np.inf).all() and (out[1] == -np.inf).all()
    cut = jax.jit(lambda lens: jsm.fp8_paged_mqa_logits(q, cache, weights, lens, table, max_context_len=64))
    full = np.asarray(cut(jnp.asarray([1000, 64], jnp.int32)))
    assert np.isfinite(full).all()
    ragged = np.asarray(jsm.fp8_mqa_logits(q[:, 0], jnp.zeros((10, 128), F8), jnp.ones(10, jnp.float32),
                                           weights, jnp.asarray([2, 5], jnp.int32), jnp.asarray([4, 5], jnp.int32)))
    assert (ragged[0, [0, 1, 4, 5]] == -np.inf).all() and (ragged[0, 2:4] == 0).all()
    assert (ragged[1] == -np.inf).all()
