"""Top-k index conversion: ports of vLLM's converter tests (test_sparse_mla_backends.py and
test_dcp_sparse_indexer.py) against NumPy loop references written here."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.ops.index_conversion import (
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)


# ----------------------------------------------------------------------------- references


def ref_convert(req_id, block_table, token_indices, block_size, pref_ids=None, pref_starts=None):
    """vLLM's `_triton_convert_reference_impl` (target era), element by element, in place."""
    req_id, block_table, token_indices = map(np.asarray, (req_id, block_table, token_indices))
    t_count, k = token_indices.shape
    width = block_table.shape[1]
    out = np.full((t_count, k), -1, np.int64)
    for t in range(t_count):
        for j in range(k):
            tok = int(token_indices[t, j])
            if tok < 0:
                continue
            if pref_ids is not None and pref_ids[t] >= 0:
                out[t, j] = pref_starts[pref_ids[t]] + tok  # even when tok is past the table width
                continue
            blk = tok // block_size
            if blk >= width:
                continue
            out[t, j] = block_table[req_id[t], blk] * block_size + tok % block_size
    return out


def ref_dcp(req_id, block_table, token_indices, block_size, n, rank, interleave):
    """Per-element DCP filter, in place: owned positions map through the rank-local table."""
    req_id, block_table, token_indices = map(np.asarray, (req_id, block_table, token_indices))
    t_count, k = token_indices.shape
    width = block_table.shape[1]
    out = np.full((t_count, k), -1, np.int64)
    for t in range(t_count):
        for j in range(k):
            p = int(token_indices[t, j])
            if p < 0 or (p // interleave) % n != rank:
                continue
            local = (p // (n * interleave)) * interleave + p % interleave
            blk = local // block_size
            if blk >= width:
                continue
            out[t, j] = block_table[req_id[t], blk] * block_size + local % block_size
    return out


def ref_compact(inplace):
    """Stable pack of the non-negative entries of each row; -1 tail."""
    out = np.full_like(inplace, -1)
    for t, row in enumerate(inplace):
        kept = row[row >= 0]
        out[t, : kept.size] = kept
    return out


def i32(x):
    return jnp.asarray(np.asarray(x), dtype=jnp.int32)


# ----------------------------------------------------------------------------- plain converter


@pytest.mark.parametrize("block_size, k", list(itertools.product([16, 64, 128], [128, 256, 512])))
def test_decode_only_matches_reference(block_size, k):
    rng = np.random.default_rng(0)
    t_count, num_reqs, width = 8, 4, 10
    req_id = rng.integers(0, num_reqs, t_count)
    block_table = rng.integers(0, 100, (num_reqs, width))
    tok = rng.integers(0, block_size * width, (t_count, k))
    tok[0, :10] = -1
    tok[3, 50:60] = -1
    tok[2, 100:110] = width * block_size  # first position past the table width
    tok[6, 150:160] = width * block_size
    tok[5, 20:25] = -7  # any negative is invalid, not only -1
    got = convert_req_index_to_global_index(
        i32(req_id), i32(block_table), i32(tok), block_size=block_size
    )
    assert got.dtype == jnp.int32 and got.shape == (t_count, k)
    np.testing.assert_array_equal(np.asarray(got), ref_convert(req_id, block_table, tok, block_size))


def test_prefill_workspace_matches_reference():
    rng = np.random.default_rng(1)
    block_size, width, k = 16, 8, 128
    req_id = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    pref_ids = np.array([-1] * 6 + [0, 0, 0, 1, 1, 1])
    starts = np.array([0, 100])
    block_table = rng.integers(0, 100, (4, width))
    tok = rng.integers(0, block_size * width, (12, k))
    tok[0, :10] = -1
    tok[3, 50:60] = -1
    tok[2, 100:110] = width * block_size
    tok[6, 150:160] = width * block_size  # prefill row: start + tok, not -1 (target era)
    tok[7, 0:4] = -1
    got = convert_req_index_to_global_index(
        i32(req_id), i32(block_table), i32(tok), block_size=block_size,
        prefill_workspace_request_ids=i32(pref_ids), prefill_workspace_starts=i32(starts),
    )
    want = ref_convert(req_id, block_table, tok, block_size, pref_ids, starts)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (np.asarray(got)[6, 150:160] == width * block_size).all()
    assert (np.asarray(got)[7, 0:4] == -1).all()


def test_rejects_req_id_longer_than_token_indices():
    with pytest.raises(ValueError, match="must cover the same tokens"):
        convert_req_index_to_global_index(
            i32(np.zeros(12)), i32(np.zeros((1, 4))), i32(np.zeros((2, 128)))
        )


@pytest.mark.parametrize("k", [128, 2176, 4224])
@pytest.mark.parametrize("compact", [False, True])
def test_returns_valid_counts(k, compact):
    block_size = 64
    block_table = np.arange(20).reshape(2, 10)
    req_id = np.array([0] * 4 + [1] * 4)
    lens = [k // 2, k // 4, k, 0] * 2
    tok = np.full((8, k), -1)
    for r, n in enumerate(lens):
        tok[r, :n] = np.arange(n) % 640  # 640 = the table's width in tokens
    inplace = ref_convert(req_id, block_table, tok, block_size)
    phys, counts = convert_req_index_to_global_index(
        i32(req_id), i32(block_table), i32(tok), block_size=block_size,
        return_valid_counts=True, compact=compact,
    )
    phys, counts = np.asarray(phys), np.asarray(counts)
    assert counts.dtype == np.int32
    np.testing.assert_array_equal(counts, lens)
    if not compact:
        np.testing.assert_array_equal(phys, inplace)
    for r, n in enumerate(lens):
        np.testing.assert_array_equal(np.sort(phys[r, :n]), np.sort(inplace[r][inplace[r] >= 0]))
        if compact:
            assert (phys[r, n:] == -1).all()


def test_compaction_is_a_stable_pack_with_holes():
    rng = np.random.default_rng(2)
    t_count, k, block_size, width = 6, 256, 16, 12
    req_id = rng.integers(0, 3, t_count)
    block_table = rng.integers(0, 50, (3, width))
    tok = rng.integers(-3, block_size * (width + 2), (t_count, k))  # holes, negatives and OOB mixed
    tok[4] = -1  # a row with nothing valid
    inplace = ref_convert(req_id, block_table, tok, block_size)
    phys, counts = convert_req_index_to_global_index(
        i32(req_id), i32(block_table), i32(tok), block_size=block_size,
        return_valid_counts=True, compact=True,
    )
    np.testing.assert_array_equal(np.asarray(phys), ref_compact(inplace))
    np.testing.assert_array_equal(np.asarray(counts), (inplace >= 0).sum(1))
    assert int(counts[4]) == 0


def test_empty_batch():
    phys, counts = convert_req_index_to_global_index(
        i32(np.zeros(0)), i32(np.zeros((2, 4))), i32(np.zeros((0, 128))),
        return_valid_counts=True, compact=True,
    )
    assert phys.shape == (0, 128) and counts.shape == (0,)


def test_works_under_jit():
    rng = np.random.default_rng(3)
    block_size = 16
    req_id = rng.integers(0, 2, 5)
    block_table = rng.integers(0, 30, (2, 6))
    tok = rng.integers(-1, block_size * 7, (5, 128))
    pref_ids = np.array([-1, 0, -1, 1, -1])
    starts = np.array([1000, 2000])

    @jax.jit
    def f(req_id, block_table, tok, pref_ids, starts):
        return convert_req_index_to_global_index(
            req_id, block_table, tok, block_size=block_size, return_valid_counts=True,
            compact=True, prefill_workspace_request_ids=pref_ids, prefill_workspace_starts=starts,
        )

    phys, counts = f(i32(req_id), i32(block_table), i32(tok), i32(pref_ids), i32(starts))
    inplace = ref_convert(req_id, block_table, tok, block_size, pref_ids, starts)
    np.testing.assert_array_equal(np.asarray(phys), ref_compact(inplace))
    np.testing.assert_array_equal(np.asarray(counts), (inplace >= 0).sum(1))


# ----------------------------------------------------------------------------- DCP filter


def test_dcp_filter_compacts_valid_slots_for_sparse_kernel():
    tok = np.full((1, 128), -1)
    tok[0, :8] = np.arange(8)
    phys, counts = filter_and_convert_dcp_index(
        i32([0]), i32([[10]]), i32(tok), dcp_size=2, dcp_rank=0, block_size=4,
        return_valid_counts=True,
    )
    phys = np.asarray(phys)
    assert int(counts[0]) == 4
    assert set(phys[0, :4].tolist()) == {40, 41, 42, 43}
    assert (phys[0, 4:] == -1).all()


@pytest.mark.parametrize("interleave, rank", list(itertools.product([1, 2], [0, 1])))
def test_dcp_filter_compaction_matches_reference(interleave, rank):
    rng = np.random.default_rng(10 * interleave + rank)
    n, block_size, k, rows, width = 2, 8, 1024, 5, 64
    block_table = rng.integers(0, 1000, (3, width))
    req_id = rng.integers(0, 3, rows)
    tok = np.full((rows, k), -1)
    for r in range(rows):
        m = int(rng.integers(200, 513))  # distinct positions of a 512-token request
        tok[r, :m] = rng.permutation(512)[:m]
    inplace = ref_dcp(req_id, block_table, tok, block_size, n, rank, interleave)
    owned = (inplace >= 0).sum(1)
    phys, counts = filter_and_convert_dcp_index(
        i32(req_id), i32(block_table), i32(tok), dcp_size=n, dcp_rank=rank,
        cp_kv_cache_interleave_size=interleave, block_size=block_size, return_valid_counts=True,
    )
    phys, counts = np.asarray(phys), np.asarray(counts)
    np.testing.assert_array_equal(counts, owned)
    for r in range(rows):
        c = owned[r]
        assert (phys[r, :c] >= 0).all() and (phys[r, c:] == -1).all()
        assert set(phys[r, :c].tolist()) == set(inplace[r][inplace[r] >= 0].tolist())
    np.testing.assert_array_equal(phys, ref_compact(inplace))  # stable order, exactly


@pytest.mark.parametrize("n, interleave", [(2, 1), (4, 2), (3, 4)])
def test_dcp_filter_in_place_matches_reference(n, interleave):
    rng = np.random.default_rng(n)
    block_size, width, k = 8, 5, 256
    block_table = rng.integers(0, 40, (2, width))
    req_id = rng.integers(0, 2, 4)
    tok = rng.integers(-2, block_size * width * n + 16, (4, k))  # includes past-width positions
    for rank in range(n):
        got = filter_and_convert_dcp_index(
            i32(req_id), i32(block_table), i32(tok), dcp_size=n, dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave, block_size=block_size, compact=False,
        )
        np.testing.assert_array_equal(
            np.asarray(got), ref_dcp(req_id, block_table, tok, block_size, n, rank, interleave)
        )


def test_dcp_size_one_equals_plain_converter():
    rng = np.random.default_rng(4)
    req_id = rng.integers(0, 2, 3)
    block_table = rng.integers(0, 40, (2, 4))
    tok = rng.integers(-1, 80, (3, 128))
    plain = convert_req_index_to_global_index(i32(req_id), i32(block_table), i32(tok), block_size=16)
    dcp = filter_and_convert_dcp_index(
        i32(req_id), i32(block_table), i32(tok), dcp_size=1, dcp_rank=0, block_size=16,
        compact=False,
    )
    np.testing.assert_array_equal(np.asarray(dcp), np.asarray(plain))


def test_dcp_filter_traced_rank_under_jit():
    rng = np.random.default_rng(5)
    n, interleave, block_size = 4, 2, 8
    req_id = rng.integers(0, 2, 3)
    block_table = rng.integers(0, 40, (2, 6))
    tok = rng.integers(-1, 200, (3, 128))
    f = jax.jit(
        lambda rank: filter_and_convert_dcp_index(
            i32(req_id), i32(block_table), i32(tok), dcp_size=n, dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave, block_size=block_size,
            return_valid_counts=True,
        )
    )
    for rank in range(n):
        phys, counts = f(jnp.int32(rank))
        inplace = ref_dcp(req_id, block_table, tok, block_size, n, rank, interleave)
        np.testing.assert_array_equal(np.asarray(phys), ref_compact(inplace))
        np.testing.assert_array_equal(np.asarray(counts), (inplace >= 0).sum(1))


# ----------------------------------------------------------------------------- bad input


def _good():
    return dict(
        req_id_per_token=i32(np.zeros(2)),
        block_table=i32(np.zeros((1, 4))),
        token_indices=i32(np.zeros((2, 128))),
    )


_BAD_COMMON = [
    ("req_id_per_token", np.zeros(2, np.int64), TypeError, "int32"),
    ("block_table", jnp.zeros((1, 4), jnp.float32), TypeError, "int32"),
    ("token_indices", np.zeros((2, 128), np.int16), TypeError, "int32"),
    ("req_id_per_token", i32(np.zeros((2, 1))), ValueError, "rank 1"),
    ("block_table", i32(np.zeros(4)), ValueError, "rank 2"),
    ("token_indices", i32(np.zeros(256)), ValueError, "rank 2"),
    ("token_indices", i32(np.zeros((2, 100))), ValueError, "multiple of 128"),
    ("req_id_per_token", i32(np.zeros(3)), ValueError, "must cover the same tokens"),
    ("token_indices", [[0] * 128] * 2, TypeError, "must be an array"),
]


@pytest.mark.parametrize("fn", ["plain", "dcp"])
@pytest.mark.parametrize("name, value, exc, match", _BAD_COMMON)
def test_rejects_bad_index_arrays(fn, name, value, exc, match):
    args = _good()
    args[name] = value
    call = (
        convert_req_index_to_global_index
        if fn == "plain"
        else lambda *a, **kw: filter_and_convert_dcp_index(*a, dcp_size=2, dcp_rank=0, **kw)
    )
    with pytest.raises(exc, match=match):
        call(args["req_id_per_token"], args["block_table"], args["token_indices"])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=16.0), ValueError, "block_size"),
        (dict(prefill_workspace_request_ids=i32(np.zeros(2))), ValueError, "together"),
        (dict(prefill_workspace_starts=i32(np.zeros(2))), ValueError, "together"),
        (
            dict(prefill_workspace_request_ids=i32(np.zeros(3)), prefill_workspace_starts=i32([0])),
            ValueError,
            "one entry per token",
        ),
        (
            dict(prefill_workspace_request_ids=i32(np.zeros(2)),
                 prefill_workspace_starts=jnp.zeros(1, jnp.float32)),
            TypeError,
            "int32",
        ),
        (
            dict(prefill_workspace_request_ids=i32(np.zeros(2)),
                 prefill_workspace_starts=i32(np.zeros((1, 1)))),
            ValueError,
            "rank 1",
        ),
    ],
)
def test_plain_converter_rejects_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        convert_req_index_to_global_index(*_good().values(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dcp_size=0, dcp_rank=0), ValueError, "dcp_size"),
        (dict(dcp_size=2.0, dcp_rank=0), ValueError, "dcp_size"),
        (dict(dcp_size=2, dcp_rank=2), ValueError, "dcp_rank"),
        (dict(dcp_size=2, dcp_rank=-1), ValueError, "dcp_rank"),
        (dict(dcp_size=2, dcp_rank=jnp.int32(5)), ValueError, "dcp_rank"),
        (dict(dcp_size=2, dcp_rank=jnp.zeros(2, jnp.int32)), TypeError, "dcp_rank"),
        (dict(dcp_size=2, dcp_rank=0.0), TypeError, "dcp_rank"),
        (dict(dcp_size=2, dcp_rank=0, cp_kv_cache_interleave_size=0), ValueError, "interleave"),
        (dict(dcp_size=2, dcp_rank=0, cp_kv_cache_interleave_size=3, block_size=16), ValueError,
         "multiple of cp_kv_cache_interleave_size"),
        (dict(dcp_size=2, dcp_rank=0, block_size=-4), ValueError, "block_size"),
    ],
)
def test_dcp_filter_rejects_bad_dcp_args(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        filter_and_convert_dcp_index(*_good().values(), **kwargs)


def test_dcp_filter_rejects_traced_non_integer_rank():
    f = jax.jit(
        lambda rank: filter_and_convert_dcp_index(*_good().values(), dcp_size=2, dcp_rank=rank)
    )
    with pytest.raises(TypeError, match="dcp_rank"):
        f(jnp.float32(0))
