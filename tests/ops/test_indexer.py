"""The indexer's logits and top-k against float64 NumPy (reference.py): upstream's logits criterion
(identical -inf masks, calc_diff < 1e-3) and exact equality of the top-k arrays, whose order is defined."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import registry
from jax_sparse_mla.ops import indexer as indexer_ops
from reference import (BF16, calc_diff, indexer_scores_np, read_index_slot_np, to_e4m3,
                       top_k_np, ue8m0_quant_np, write_index_cache_np)


def random_e4m3(rng, shape, scale=1.0):
    return to_e4m3(rng.standard_normal(shape) * scale)


def assert_logits_match(actual, expected):
    """Upstream's criterion, plus a per-row bound: the fp32 sums of exact fp8 products are close."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert not np.isnan(actual).any()
    np.testing.assert_array_equal(actual == -np.inf, expected == -np.inf)
    finite = np.isfinite(expected)
    assert calc_diff(actual[finite], expected[finite]) < 1e-3
    actual, expected = np.where(finite, actual, 0), np.where(finite, expected, 0)
    row_scale = np.abs(expected).max(axis=1, keepdims=True) + 1e-30
    assert (np.abs(actual - expected) <= 1e-5 * row_scale).all()


# --- fp8_paged_mqa_logits -----------------------------------------------------------------------------------

def paged_batch(rng, context_lens, num_heads, next_n, width, block_size=64):
    """A paged index cache whose unwritten bytes are 0xFF (NaN values and scales), a shuffled block
    table whose entries past each request's context are junk ids, q, folded-style weights."""
    batch = len(context_lens)
    num_blocks = batch * width + 3
    table = rng.permutation(num_blocks)[: batch * width].reshape(batch, width).astype(np.int32)
    cache = np.full((num_blocks, block_size, 132), 0xFF, np.uint8)
    for b, n in enumerate(context_lens):
        used = -(-max(n, 0) // block_size)
        table[b, used:] = rng.choice([-5, 0, 10 ** 6], width - used)
        positions = np.arange(max(n, 0))
        slots = table[b, positions // block_size] * block_size + positions % block_size
        keys = (rng.standard_normal((len(positions), 128)) * rng.uniform(0.1, 10)).astype(BF16)
        cache = write_index_cache_np(cache, keys, slots)
    q = random_e4m3(rng, (batch, next_n, num_heads, 128), 20.0)
    weights = rng.standard_normal((batch * next_n, num_heads)).astype(np.float32) / 100
    return cache, table, q, weights


def paged_logits_np(cache, table, q, weights, context_lens, max_context_len):
    batch, next_n = q.shape[:2]
    block_size = cache.shape[1]
    out = np.full((batch * next_n, max_context_len), -np.inf)
    for b, length in enumerate(context_lens):
        for j in range(next_n):
            limit = min(length - next_n + j + 1, max_context_len)
            if limit <= 0:
                continue
            records = [read_index_slot_np(cache, table[b, s // block_size] * block_size + s % block_size)
                       for s in range(limit)]
            keys = np.stack([r[0] for r in records])
            scales = np.array([r[1] for r in records])
            out[b * next_n + j, :limit] = indexer_scores_np(q[b, j].astype(np.float64), keys, scales,
                                                           weights[b * next_n + j])
    return out


@pytest.mark.parametrize("num_heads,next_n", [(64, 1), (64, 2), (32, 2), (32, 3)])
def test_paged_logits_match_float64(num_heads, next_n):
    rng = np.random.default_rng(num_heads + next_n)
    # A padding request (0), one shorter than next_n, one mid-block, one filling max_context_len.
    context_lens = [0, 1, 130, 300]
    cache, table, q, weights = paged_batch(rng, context_lens, num_heads, next_n, width=5)
    logits = jax.jit(jsm.fp8_paged_mqa_logits, static_argnames="max_context_len")(
        q, cache, weights, np.array(context_lens, np.int32), table, max_context_len=300)
    assert logits.shape == (4 * next_n, 300) and logits.dtype == jnp.float32
    expected = paged_logits_np(cache, table, q, weights, context_lens, 300)
    assert_logits_match(logits, expected)
    assert (np.asarray(logits)[:next_n] == -np.inf).all()  # L = 0: rows of -inf


def test_paged_logits_in_chunks(monkeypatch):
    """A tiny chunk budget (one block of keys per step) gives the same logits."""
    rng = np.random.default_rng(7)
    context_lens = [200, 75]
    cache, table, q, weights = paged_batch(rng, context_lens, 32, 2, width=4)
    whole = jsm.fp8_paged_mqa_logits(q, cache, weights, np.array(context_lens, np.int32), table,
                                     max_context_len=256)
    monkeypatch.setattr(indexer_ops, "SCORE_CHUNK_BYTES", 1)
    chunked = jsm.fp8_paged_mqa_logits(q, cache, weights, np.array(context_lens, np.int32), table,
                                       max_context_len=256)
    assert_logits_match(chunked, paged_logits_np(cache, table, q, weights, context_lens, 256))
    assert_logits_match(chunked, whole)


# --- fp8_mqa_logits ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_heads", [64, 32])
@pytest.mark.parametrize("small_chunks", [False, True])
def test_ragged_logits_match_float64(num_heads, small_chunks, monkeypatch):
    if small_chunks:
        monkeypatch.setattr(indexer_ops, "SCORE_CHUNK_BYTES", 3 * num_heads * 300 * 4)  # 3 rows a step
    rng = np.random.default_rng(num_heads)
    num_rows, num_keys = 20, 300
    q = random_e4m3(rng, (num_rows, num_heads, 128), 10.0)
    k_fp8 = random_e4m3(rng, (num_keys, 128), 50.0)
    k_scale = (2.0 ** rng.integers(-12, 4, num_keys)).astype(np.float32)
    weights = rng.standard_normal((num_rows, num_heads)).astype(np.float32)
    starts = rng.integers(0, num_keys, num_rows).astype(np.int32)
    ends = np.minimum(starts + rng.integers(1, 200, num_rows), num_keys).astype(np.int32)
    starts[:4], ends[:4] = [0, 0, 150, 300], [300, 0, 100, 300]  # full, empty, reversed, empty at N
    logits = jax.jit(jsm.fp8_mqa_logits)(q, k_fp8, k_scale, weights, starts, ends)
    expected = np.full((num_rows, num_keys), -np.inf)
    for i in range(num_rows):
        if ends[i] > starts[i]:
            expected[i, starts[i]:ends[i]] = indexer_scores_np(
                q[i].astype(np.float64), k_fp8[starts[i]:ends[i]].astype(np.float64),
                k_scale[starts[i]:ends[i]], weights[i])
    assert_logits_match(logits, expected)


# --- top-k ----------------------------------------------------------------------------------------------------

def hard_rows(rng, num_rows, width):
    """float32 logits with every case of the rule, one case per row (cycling)."""
    logits = rng.standard_normal((num_rows, width)).astype(np.float32)
    for r in range(num_rows):
        case = r % 9
        row = logits[r]
        if case == 1:  # heavy ties
            row[:] = rng.integers(0, 4, width)
        elif case == 2:  # NaN among numbers
            row[rng.random(width) < 0.3] = np.nan
        elif case == 3:  # -inf among numbers: candidates, above NaN
            row[rng.random(width) < 0.5] = -np.inf
            row[rng.random(width) < 0.2] = np.nan
        elif case == 4:  # only NaN and -inf
            row[:] = np.where(rng.random(width) < 0.5, np.nan, -np.inf)
        elif case == 5:  # +inf and huge values
            row[rng.random(width) < 0.05] = np.inf
            row[rng.random(width) < 0.05] = -3e38
        elif case == 6:  # vLLM's "10LSBits": the top 22 bits fixed, ties and the last radix bits matter
            row[:] = (np.uint32(0x3F900000) | rng.integers(0, 1 << 10, width).astype(np.uint32)).view(np.float32)
            row[rng.random(width) < 0.5] = row[0]
        elif case == 7:  # signed zeros tie
            row[:] = np.where(rng.random(width) < 0.5, -0.0, 0.0)
            row[rng.random(width) < 0.1] = -1.0
        elif case == 8:  # subnormals (XLA on CPU flushes them in float comparisons)
            row[:] = rng.integers(-5, 6, width).astype(np.float32) * np.float32(1e-45)
    return logits


@pytest.mark.parametrize("k", [1, 7, 64])
def test_top_k_per_row_matches_numpy(k):
    rng = np.random.default_rng(k)
    num_rows, width = 36, 150
    logits = hard_rows(rng, num_rows, width)
    starts = rng.integers(0, width, num_rows).astype(np.int32)
    ends = np.minimum(starts + rng.integers(0, 2 * k + 10, num_rows), width).astype(np.int32)
    starts[:3], ends[:3] = [0, 40, 90], [width, 40, 30]  # full row, empty row, end < start
    ends[3], starts[4], ends[4] = k, 5, 5 + k  # exactly k in range
    out = jax.jit(jsm.top_k_per_row, static_argnames="k")(logits, starts, ends, k=k)
    assert out.shape == (num_rows, k) and out.dtype == jnp.int32
    expected = np.stack([top_k_np(logits[r], starts[r], ends[r], k) for r in range(num_rows)])
    np.testing.assert_array_equal(np.asarray(out), expected)
    # Eager gives the same array, and so does a second run.
    np.testing.assert_array_equal(np.asarray(jsm.top_k_per_row(logits, starts, ends, k=k)), expected)


@pytest.mark.parametrize("next_n", [1, 2])
def test_top_k_per_row_decode_matches_numpy(next_n):
    rng = np.random.default_rng(10 + next_n)
    width, k = 120, 32
    context_lens = np.array([0, 1, 2, 20, 33, 34, 100, 120, 5], np.int32)
    logits = hard_rows(rng, len(context_lens) * next_n, width)
    out = jax.jit(jsm.top_k_per_row_decode, static_argnames=("next_n", "k"))(
        logits, context_lens, next_n=next_n, k=k)
    expected = np.stack([top_k_np(logits[b * next_n + j], 0, context_lens[b] - next_n + j + 1, k)
                         for b in range(len(context_lens)) for j in range(next_n)])
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert (np.asarray(out)[:next_n] == -1).all()  # L = 0


def test_top_k_2048_over_thousands_of_positions():
    """DeepSeek's k over a few thousand positions, values on a coarse grid so that the 2048th value is
    tied many times: the lower positions of the tie must be the ones kept."""
    rng = np.random.default_rng(2048)
    width, next_n = 5000, 2
    logits = (np.round(rng.standard_normal((4, width)) * 8) / 8).astype(np.float32)
    logits[1, rng.random(width) < 0.1] = np.nan
    context_lens = np.array([4999, 2050], np.int32)
    out = np.asarray(jsm.top_k_per_row_decode(logits, context_lens, next_n=next_n, k=2048))
    expected = np.stack([top_k_np(logits[b * 2 + j], 0, context_lens[b] - 2 + j + 1, 2048)
                         for b in range(2) for j in range(2)])
    np.testing.assert_array_equal(out, expected)
    starts = np.array([0, 100, 1000, 4000], np.int32)
    ends = np.array([5000, 3000, 3048, 5000], np.int32)
    out = np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048))
    np.testing.assert_array_equal(out, np.stack([top_k_np(logits[r], starts[r], ends[r], 2048)
                                                 for r in range(4)]))


def test_top_k_wide_rows_with_heavy_ties():
    """Rows of 65536 positions in every hard case (ties on a few values, NaN, -inf, signed zeros,
    subnormals), full and partial ranges, k = 2048: the same array as the NumPy rule."""
    rng = np.random.default_rng(65536)
    num_rows, width = 18, 65536
    logits = hard_rows(rng, num_rows, width)
    starts = np.where(np.arange(num_rows) % 2 == 0, 0, rng.integers(1, 9, num_rows)).astype(np.int32)
    ends = np.where(np.arange(num_rows) % 3 == 0, width,
                    rng.integers(2000, width, num_rows)).astype(np.int32)
    out = np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048))
    np.testing.assert_array_equal(out, np.stack([top_k_np(logits[r], starts[r], ends[r], 2048)
                                                 for r in range(num_rows)]))


def test_top_k_ignores_what_lies_outside_the_range():
    """Values outside a row's range (vLLM's uninitialised logits) never change the result."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 80)).astype(np.float32)
    context_lens = np.array([10, 50, 80], np.int32)
    garbage = logits.copy()
    for r, length in enumerate(np.repeat(context_lens, 2) - 1 + np.tile([0, 1], 3)):
        garbage[r, length:] = rng.choice([np.nan, np.inf, 1e30], 80 - length)
    a = jsm.top_k_per_row_decode(logits, context_lens, next_n=2, k=16)
    b = jsm.top_k_per_row_decode(garbage, context_lens, next_n=2, k=16)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_under_jit_lengths_past_the_width_are_cut_not_errors():
    """The eager ValueErrors need the lengths' values; traced, the documented clamping applies."""
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    too_long = np.array([70, 20], np.int32)
    out = jax.jit(lambda l, c: jsm.top_k_per_row_decode(l, c, next_n=2, k=64))(logits, too_long)
    expected = np.stack([top_k_np(logits[r], 0, min(int(too_long[r // 2]) - 1 + r % 2, 50), 64)
                         for r in range(4)])
    np.testing.assert_array_equal(np.asarray(out), expected)
    cache, table, q, weights = paged_batch(rng, [64, 10], 32, 1, width=2)
    paged = jax.jit(lambda c: jsm.fp8_paged_mqa_logits(q, cache, weights, c, table, max_context_len=64))
    np.testing.assert_array_equal(np.asarray(paged(np.array([64, 10], np.int32))),
                                  np.asarray(paged(np.array([100, 10], np.int32))))


# --- the query quantiser and the weights ---------------------------------------------------------------------

def test_query_quantisation_and_weight_folding():
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((5, 64, 128)) * 10.0 ** rng.integers(-12, 3, (5, 64, 1))).astype(BF16)
    q[0, 0] = 0.0
    q8, q_scale = indexer_ops.quantize_indexer_q(jnp.asarray(q))
    assert q8.dtype == jnp.float8_e4m3fn and q_scale.shape == (5, 64)
    for t in range(5):
        for h in range(64):
            values, scale = ue8m0_quant_np(q[t, h], 1e-10)
            assert np.float32(q_scale[t, h]) == scale
            np.testing.assert_array_equal(np.asarray(q8[t, h]).view(np.uint8), values.view(np.uint8))
    weights = rng.standard_normal((5, 64)).astype(np.float32)
    folded = indexer_ops.fold_indexer_weights(jnp.asarray(weights), q_scale)
    np.testing.assert_allclose(np.asarray(folded), weights * np.asarray(q_scale) / np.sqrt(128) / 8,
                               rtol=1e-6)


# --- argument checks ------------------------------------------------------------------------------------

def _paged_args():
    return dict(q=jnp.zeros((2, 1, 64, 128), jnp.float8_e4m3fn), index_cache=jnp.zeros((4, 64, 132), jnp.uint8),
                weights=jnp.zeros((2, 64), jnp.float32), context_lens=jnp.asarray([3, 5], jnp.int32),
                block_table=jnp.zeros((2, 2), jnp.int32))


@pytest.mark.parametrize("name,value,error,message", [
    ("q", jnp.zeros((2, 1, 64, 128), jnp.bfloat16), TypeError,
     "fp8_paged_mqa_logits: q must have dtype float8_e4m3fn"),
    ("q", jnp.zeros((2, 64, 128), jnp.float8_e4m3fn), ValueError, "q must have rank 4"),
    ("q", jnp.zeros((2, 1, 64, 64), jnp.float8_e4m3fn), ValueError, "q must have last dimension 128"),
    ("q", jnp.zeros((2, 1, 16, 128), jnp.float8_e4m3fn), ValueError, "q must have 32 or 64 heads"),
    ("weights", jnp.zeros((2, 64), jnp.bfloat16), TypeError, "weights must have dtype float32"),
    ("weights", jnp.zeros((2, 32), jnp.float32), ValueError,
     r"weights must have shape \(2, 64\) \(B \* next_n, H\)"),
    ("context_lens", jnp.asarray([3, 5, 1], jnp.int32), ValueError, r"context_lens must have shape \(2,\)"),
    ("context_lens", jnp.asarray([3.0, 5.0]), TypeError, "context_lens must have dtype int32"),
    ("context_lens", jnp.asarray([3, 129], jnp.int32), ValueError,
     "context_lens\\[1\\] = 129 exceeds max_context_len = 128"),
    ("block_table", jnp.zeros((3, 2), jnp.int32), ValueError, "block_table must have 2 rows"),
    ("block_table", jnp.zeros((2, 1), jnp.int32), ValueError,
     r"max_context_len = 128 is more than block_table covers \(1 blocks x 64 = 64\)"),
    ("index_cache", jnp.zeros((4, 64, 128), jnp.uint8), ValueError, "index_cache must have last dimension 132"),
    ("index_cache", jnp.zeros((4, 64, 132), jnp.int8), TypeError, "index_cache must have dtype uint8"),
])
def test_paged_logits_reject_bad_arguments(name, value, error, message):
    args = _paged_args()
    args[name] = value
    with pytest.raises(error, match=message):
        jsm.fp8_paged_mqa_logits(**args, max_context_len=128)


def test_paged_logits_check_static_sizes():
    with pytest.raises(ValueError, match="max_context_len must be a positive int"):
        jsm.fp8_paged_mqa_logits(**_paged_args(), max_context_len=0)
    with pytest.raises(ValueError, match="max_context_len must be a positive int"):
        jsm.fp8_paged_mqa_logits(**_paged_args(), max_context_len=64.0)


def _ragged_args():
    return [jnp.zeros((3, 32, 128), jnp.float8_e4m3fn), jnp.zeros((10, 128), jnp.float8_e4m3fn),
            jnp.ones(10, jnp.float32), jnp.zeros((3, 32), jnp.float32), jnp.zeros(3, jnp.int32),
            jnp.full(3, 10, jnp.int32)]


@pytest.mark.parametrize("index,value,error,message", [
    (0, jnp.zeros((3, 32, 128), jnp.float32), TypeError, "fp8_mqa_logits: q must have dtype float8_e4m3fn"),
    (0, jnp.zeros((3, 48, 128), jnp.float8_e4m3fn), ValueError, "q must have 32 or 64 heads"),
    (1, jnp.zeros((10, 132), jnp.float8_e4m3fn), ValueError, "k_fp8 must have last dimension 128"),
    (1, jnp.zeros((10, 128), jnp.uint8), TypeError, "k_fp8 must have dtype float8_e4m3fn"),
    (2, jnp.ones((10, 4), jnp.uint8), ValueError, "k_scale must have rank 1"),
    (2, jnp.ones(9, jnp.float32), ValueError, r"k_scale must have shape \(10,\)"),
    (3, jnp.zeros((3, 64), jnp.float32), ValueError, r"weights must have shape \(3, 32\)"),
    (4, jnp.asarray([0, -1, 0], jnp.int32), ValueError, "row_starts\\[1\\] = -1 is negative"),
    (5, jnp.asarray([10, 11, 10], jnp.int32), ValueError,
     "row_ends\\[1\\] = 11 exceeds the number of keys N = 10"),
    (5, jnp.zeros(4, jnp.int32), ValueError, r"row_ends must have shape \(3,\)"),
])
def test_ragged_logits_reject_bad_arguments(index, value, error, message):
    args = _ragged_args()
    args[index] = value
    with pytest.raises(error, match=message):
        jsm.fp8_mqa_logits(*args)


def test_top_k_rejects_bad_arguments():
    logits = jnp.zeros((4, 50), jnp.float32)
    lens = jnp.asarray([10, 20], jnp.int32)
    with pytest.raises(TypeError, match="top_k_per_row: logits must have dtype float32"):
        jsm.top_k_per_row(logits.astype(jnp.bfloat16), jnp.zeros(4, jnp.int32), lens.repeat(2), k=8)
    with pytest.raises(ValueError, match="top_k_per_row: row_ends\\[0\\] = 51 exceeds the logits width S = 50"):
        jsm.top_k_per_row(logits, jnp.zeros(4, jnp.int32), jnp.full(4, 51, jnp.int32), k=8)
    with pytest.raises(ValueError, match="k must be a positive int"):
        jsm.top_k_per_row(logits, jnp.zeros(4, jnp.int32), lens.repeat(2), k=0)
    with pytest.raises(ValueError, match="row_starts must have shape \\(4,\\)"):
        jsm.top_k_per_row(logits, jnp.zeros(3, jnp.int32), lens.repeat(2), k=8)
    with pytest.raises(ValueError, match="must have B \\* next_n = 2 \\* 1 = 2 rows"):
        jsm.top_k_per_row_decode(logits, lens, k=8)
    with pytest.raises(ValueError, match="context_lens\\[1\\] = 60 exceeds the logits width S = 50"):
        jsm.top_k_per_row_decode(logits, jnp.asarray([10, 60], jnp.int32), next_n=2, k=8)
    with pytest.raises(ValueError, match="next_n must be a positive int"):
        jsm.top_k_per_row_decode(logits, lens, next_n=0, k=8)
    with pytest.raises(ValueError, match="logits must have rank 2"):
        jsm.top_k_per_row_decode(logits[None], lens, next_n=2, k=8)


# --- dispatch -------------------------------------------------------------------------------------------

OPS = ["indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache", "fp8_paged_mqa_logits",
       "fp8_mqa_logits", "top_k_per_row", "top_k_per_row_decode"]


@pytest.mark.parametrize("op", OPS)
def test_every_op_is_registered_with_its_pure_jax_kernel(op, monkeypatch):
    monkeypatch.setattr(registry, "current_device_capability", lambda: None)  # as on a CPU or TPU
    kernels = registry.registered_op_kernels(op)
    assert [k.name for k in kernels if not k.native] == ["xla"]
    assert registry.select_op_kernel(op, "auto").name == "xla"
    assert registry.select_op_kernel(op, "xla").name == "xla"
    natives = [k.name for k in kernels if k.native]
    none_fits = f"for {op} but no native kernel fits: "
    if not natives:
        with pytest.raises(ValueError, match=none_fits + "no native kernel is registered"):
            registry.select_op_kernel(op, "native")
    else:  # a native kernel (e.g. sm90_topk), no GPU
        with pytest.raises(ValueError, match=none_fits + f"{natives[-1]}: the default device is not"):
            registry.select_op_kernel(op, "native")


def test_a_registered_native_kernel_takes_over_where_it_fits(monkeypatch):
    calls = []

    def fake_top_k(logits, row_starts, row_ends, *, k):
        calls.append(k)
        return jnp.full((logits.shape[0], k), -7, jnp.int32)

    def check(problem, capability):
        return None if problem.top_k == 2048 else f"k must be 2048, got {problem.top_k}"

    # Only the pure-JAX kernels: the fake below must be the only native candidate.
    kernels = {op: [k for k in ks if not k.native] for op, ks in registry._OP_KERNELS.items()}
    monkeypatch.setattr(registry, "_OP_KERNELS", kernels)
    registry.register_op_kernel(registry.OpKernel(op="top_k_per_row", name="sm90_test", native=True,
                                                  capability_majors=(9,), fn=fake_top_k, check=check))
    monkeypatch.setattr(registry, "current_device_capability", lambda: None)  # as on a CPU or TPU
    logits = jnp.zeros((2, 3000), jnp.float32)
    starts, ends = jnp.zeros(2, jnp.int32), jnp.full(2, 3000, jnp.int32)
    with pytest.raises(ValueError, match="sm90_test: the default device is not a CUDA GPU"):
        jsm.top_k_per_row(logits, starts, ends, k=2048, implementation="native")
    assert (np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048)) != -7).all()  # auto: pure JAX here
    monkeypatch.setattr(registry, "current_device_capability", lambda: (9, 0))
    assert (np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048)) == -7).all()
    assert (np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048, implementation="xla")) != -7).all()
    with pytest.raises(ValueError, match="sm90_test: k must be 2048, got 64"):
        jsm.top_k_per_row(logits, starts, ends, k=64, implementation="native")
    monkeypatch.setattr(registry, "current_device_capability", lambda: (10, 0))
    with pytest.raises(ValueError, match=r"sm90_test: needs compute capability major \(9,\), device has 10.0"):
        jsm.top_k_per_row(logits, starts, ends, k=2048, implementation="native")
    assert calls == [2048]
    with pytest.raises(ValueError, match="already registered"):
        registry.register_op_kernel(registry.OpKernel(op="top_k_per_row", name="sm90_test", native=True,
                                                      capability_majors=(9,), fn=fake_top_k))


def test_an_unvalidated_native_kernel_runs_only_when_asked_for(monkeypatch):
    def fake_top_k(logits, row_starts, row_ends, *, k):
        return jnp.full((logits.shape[0], k), -7, jnp.int32)

    # Only the pure-JAX kernels: the fake below must be the only native candidate.
    kernels = {op: [k for k in ks if not k.native] for op, ks in registry._OP_KERNELS.items()}
    monkeypatch.setattr(registry, "_OP_KERNELS", kernels)
    monkeypatch.setattr(registry, "current_device_capability", lambda: (9, 0))
    registry.register_op_kernel(registry.OpKernel(op="top_k_per_row", name="sm90_new", native=True,
                                                  capability_majors=(9,), fn=fake_top_k,
                                                  validated=False))
    logits = jnp.zeros((2, 3000), jnp.float32)
    starts, ends = jnp.zeros(2, jnp.int32), jnp.full(2, 3000, jnp.int32)
    assert (np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048)) != -7).all()  # auto: pure JAX
    assert (np.asarray(jsm.top_k_per_row(logits, starts, ends, k=2048, implementation="native")) == -7).all()
