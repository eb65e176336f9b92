"""Decode context parallelism: local lengths, the LSE merge, and sharded attention equal to global
attention. Ports vLLM's test_dcp_sparse_indexer.py and the `_lse_weighted_combine` checks; the
collective path runs under `jax.shard_map` on the 8 host devices that conftest.py sets up."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_sparse_mla.ops.dcp import (
    correct_attn_out,
    cp_lse_ag_out_rs,
    get_dcp_local_seq_lens,
    lse_weighted_combine,
)
from jax_sparse_mla.ops.index_conversion import (
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)


# ----------------------------------------------------------------------------- references


def naive_local_len(seq_len, world, rank, interleave):
    return sum(1 for p in range(seq_len) if (p // interleave) % world == rank)


def np_merge(outputs, lses, base_e=True):
    """Exact float64 merge: only ranks with a finite LSE contribute; no finite LSE -> (0, -inf)."""
    outputs, lses = np.asarray(outputs, np.float64), np.asarray(lses, np.float64)
    n, b, h, d = outputs.shape
    out = np.zeros((b, h, d))
    lse = np.full((b, h), -np.inf)
    base = np.e if base_e else 2.0
    for i in range(b):
        for j in range(h):
            live = [r for r in range(n) if np.isfinite(lses[r, i, j])]
            if not live:
                continue
            m = max(lses[r, i, j] for r in live)
            total = sum(base ** (lses[r, i, j] - m) for r in live)
            g = m + np.log(total) / np.log(base)
            lse[i, j] = g
            for r in live:
                out[i, j] += base ** (lses[r, i, j] - g) * outputs[r, i, j]
    return out, lse


def np_correct(out, lses, rank, base_e=True):
    """One rank's share: out * base**(lse_rank - g), 0 where that rank (or every rank) has no keys."""
    out, lses = np.asarray(out, np.float64), np.asarray(lses, np.float64)
    _, g = np_merge(np.zeros(lses.shape + (1,)), lses, base_e)
    base = np.e if base_e else 2.0
    res = np.zeros_like(out)
    for i, j in np.ndindex(*g.shape):
        own = lses[rank, i, j]
        if np.isfinite(own) and np.isfinite(g[i, j]):
            res[i, j] = out[i, j] * base ** (own - g[i, j])
    return res, g


def np_attention(q, rows, slots, scale):
    """Masked softmax attention of q [Q, H, d] over rows[slots[t]] (slots < 0 skipped), float64.

    K = V = the row. Empty rows give out 0 and lse -inf (natural log)."""
    q, rows, slots = np.asarray(q, np.float64), np.asarray(rows, np.float64), np.asarray(slots)
    nq, h, d = q.shape
    out = np.zeros((nq, h, d))
    lse = np.full((nq, h), -np.inf)
    for t in range(nq):
        sel = [s for s in slots[t] if s >= 0]
        if not sel:
            continue
        kv = rows[sel]  # [n, d]
        s = q[t] @ kv.T * scale  # [H, n]
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        out[t] = (p / p.sum(-1, keepdims=True)) @ kv
        lse[t] = np.log(p.sum(-1)) + m[:, 0]
    return out, lse


def jnp_attention(q, rows, slots, scale):
    """The same attention in float32 JAX, for use inside shard_map (rank-local step of the pipeline)."""
    valid = slots >= 0
    kv = rows[jnp.maximum(slots, 0)]  # [Q, K, d]
    kv = jnp.where(valid[..., None], kv, 0.0)  # unselected rows may be NaN
    s = jnp.einsum("qhd,qkd->qhk", q, kv) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = p.sum(-1)
    out = jnp.einsum("qhk,qkd->qhd", p, kv) / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, jnp.log(denom) + m[..., 0], -jnp.inf)
    return out, lse


def rank_cache(kv, world, rank, interleave, block_size, block_ids, num_rows):
    """This rank's paged cache (NaN where nothing was written) and its block table, built by hand."""
    cache = np.full((num_rows, kv.shape[1]), np.nan, np.float32)
    for p in range(kv.shape[0]):
        if (p // interleave) % world != rank:
            continue
        local = (p // (world * interleave)) * interleave + p % interleave
        cache[block_ids[local // block_size] * block_size + local % block_size] = kv[p]
    return cache


def mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("dcp",))


def i32(x):
    return jnp.asarray(np.asarray(x), dtype=jnp.int32)


def f32(x):
    return jnp.asarray(np.asarray(x), dtype=jnp.float32)


# ----------------------------------------------------------------------------- local lengths


@pytest.mark.parametrize("world, interleave", list(itertools.product([1, 2, 4], [1, 2, 4])))
def test_get_dcp_local_seq_lens_matches_naive(world, interleave):
    seq = np.arange(33)
    for rank in range(world):
        got = get_dcp_local_seq_lens(i32(seq), world, rank, interleave)
        want = [naive_local_len(s, world, rank, interleave) for s in seq]
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.dtype == jnp.int32
    every = get_dcp_local_seq_lens(i32(seq), world, None, interleave)
    assert every.shape == (33, world)
    assert (np.asarray(every).sum(-1) == seq).all()


def test_get_dcp_local_seq_lens_examples():
    seq = [0, 1, 2, 3, 4, 7, 8, 17]
    for rank in range(4):
        got = get_dcp_local_seq_lens(i32(seq), 4, rank, 2)
        np.testing.assert_array_equal(np.asarray(got), [naive_local_len(s, 4, rank, 2) for s in seq])
    two_d = get_dcp_local_seq_lens(i32([[8, 9, 10], [11, 12, 13]]), 2, 1)
    assert two_d.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(two_d), [[4, 4, 5], [5, 6, 6]])
    np.testing.assert_array_equal(np.asarray(get_dcp_local_seq_lens(i32([8, 9, 10]), 2, 1)), [4, 4, 5])


def test_get_dcp_local_seq_lens_traced_rank():
    f = jax.jit(lambda s, r: get_dcp_local_seq_lens(s, 4, r, 2))
    seq = np.arange(40)
    for rank in range(4):
        want = [naive_local_len(s, 4, rank, 2) for s in seq]
        np.testing.assert_array_equal(np.asarray(f(i32(seq), jnp.int32(rank))), want)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((jnp.zeros(3, jnp.float32), 2, 0), TypeError, "int32"),
        ((np.zeros(3, np.int64), 2, 0), TypeError, "int32"),
        ((i32([1, 2]), 0, 0), ValueError, "dcp_size"),
        ((i32([1, 2]), 2, 2), ValueError, "dcp_rank"),
        ((i32([1, 2]), 2, -1), ValueError, "dcp_rank"),
        ((i32([1, 2]), 2, 0, 0), ValueError, "interleave"),
        (([1, 2], 2, 0), TypeError, "must be an array"),
    ],
)
def test_get_dcp_local_seq_lens_rejects_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        get_dcp_local_seq_lens(*args)


# ----------------------------------------------------------------------------- correct / combine


@pytest.mark.parametrize("base_e", [True, False])
def test_correct_attn_out_zeroes_empty_nan_partial(base_e):
    out = jnp.full((1, 1, 4), jnp.nan, jnp.float32)
    lses = f32([[[0.0]], [[-np.inf]]])
    corrected, lse = correct_attn_out(out, lses, 1, is_lse_base_on_e=base_e)
    np.testing.assert_array_equal(np.asarray(corrected), np.zeros((1, 1, 4)))
    np.testing.assert_array_equal(np.asarray(lse), [[0.0]])


def _partials(rng, n, b, h, d):
    """Random partials with every corner: empty shards (NaN out), NaN/+inf LSEs, an all-empty row."""
    outs = rng.standard_normal((n, b, h, d)).astype(np.float32)
    lses = (3 * rng.standard_normal((n, b, h))).astype(np.float32)
    empty = rng.random((n, b, h)) < 0.25
    lses[empty] = -np.inf
    outs[empty] = np.nan
    lses[0, 0, 0] = np.nan
    outs[0, 0, 0] = np.nan
    if n > 1:
        lses[1, 0, 1] = np.inf
        outs[1, 0, 1] = np.nan
    lses[:, -1, -1] = -np.inf  # no rank has keys for this (b, h)
    outs[:, -1, -1] = np.nan
    return outs, lses


@pytest.mark.parametrize("base_e", [True, False])
def test_correct_attn_out_matches_reference(base_e):
    rng = np.random.default_rng(0)
    n, b, h, d = 4, 3, 5, 8
    outs, lses = _partials(rng, n, b, h, d)
    total = np.zeros((b, h, d))
    for rank in range(n):
        got, g = correct_attn_out(f32(outs[rank]), f32(lses), rank, is_lse_base_on_e=base_e)
        want, want_g = np_correct(outs[rank], lses, rank, base_e)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-6)
        total += np.asarray(got)
    np.testing.assert_allclose(total, np_merge(outs, lses, base_e)[0], rtol=1e-5, atol=1e-5)


def test_correct_attn_out_layouts_dtype_and_traced_rank():
    rng = np.random.default_rng(1)
    n, b, h, d = 3, 2, 4, 8
    outs, lses = _partials(rng, n, b, h, d)
    want, want_g = np_correct(outs[2], lses, 2)
    # [B, 1, H, D] out with [N, B, H, 1] / [N, B, 1, H] lses, as vLLM accepts; the out shape is kept.
    for l4 in (f32(lses)[..., None], f32(lses)[:, :, None, :]):
        got, g = correct_attn_out(f32(outs[2])[:, None], l4, 2)
        assert got.shape == (b, 1, h, d)
        np.testing.assert_allclose(np.asarray(got)[:, 0], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5)
    # bf16 partials: fp32 math, bf16 result.
    got, _ = correct_attn_out(jnp.asarray(outs[2], jnp.bfloat16), f32(lses), 2)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
    # Traced rank under jit.
    f = jax.jit(lambda o, l, r: correct_attn_out(o, l, r))
    got, g = f(f32(outs[2]), f32(lses), jnp.int32(2))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "out, lses, rank, exc, match",
    [
        (jnp.zeros((2, 4, 8), jnp.int32), jnp.zeros((2, 2, 4)), 0, TypeError, "out"),
        (jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 4), jnp.int32), 0, TypeError, "lses"),
        (jnp.zeros((2, 4)), jnp.zeros((2, 2, 4)), 0, ValueError, "out must have rank"),
        (jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 2, 4)), 0, ValueError, r"\[B, 1, H, D\]"),
        (jnp.zeros((2, 4, 8)), jnp.zeros((2, 8)), 0, ValueError, "lses must have rank"),
        (jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 2, 4)), 0, ValueError, r"\[N, B, 1, H\]"),
        (jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 5)), 0, ValueError, "must match out"),
        (jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 4)), 2, ValueError, "cp_rank"),
        (jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 4)), 0.5, TypeError, "cp_rank"),
    ],
)
def test_correct_attn_out_rejects_bad_input(out, lses, rank, exc, match):
    with pytest.raises(exc, match=match):
        correct_attn_out(out, lses, rank)


@pytest.mark.parametrize("flag", [None, "False", 0, 1.0])
def test_correct_attn_out_flag_must_be_a_bool(flag):
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool"):
        correct_attn_out(jnp.zeros((2, 4, 8)), jnp.zeros((2, 2, 4)), 0, is_lse_base_on_e=flag)


@pytest.mark.parametrize("base_e", [True, False])
def test_lse_weighted_combine_matches_float64(base_e):
    rng = np.random.default_rng(2)
    outs, lses = _partials(rng, 5, 4, 6, 16)
    lses[2, 1, 2] = -np.inf
    lses[3, 1, 3] = np.inf  # +inf counts as "no keys" here too
    out, lse = lse_weighted_combine(f32(outs), f32(lses), return_lse=True, is_lse_base_on_e=base_e)
    want, want_lse = np_merge(outs, lses, base_e)
    assert out.shape == (4, 6, 16) and lse.shape == (4, 6)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-6)
    assert (np.asarray(out)[-1, -1] == 0).all() and np.asarray(lse)[-1, -1] == -np.inf
    only = lse_weighted_combine(f32(outs), f32(lses), is_lse_base_on_e=base_e)
    np.testing.assert_array_equal(np.asarray(only), np.asarray(out))
    jitted = jax.jit(lambda o, l: lse_weighted_combine(o, l, is_lse_base_on_e=base_e))
    np.testing.assert_allclose(np.asarray(jitted(f32(outs), f32(lses))), want, rtol=1e-5, atol=1e-6)
    bf = lse_weighted_combine(jnp.asarray(outs, jnp.bfloat16), f32(lses), is_lse_base_on_e=base_e)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf, np.float32), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(
    "outs, lses, exc, match",
    [
        (jnp.zeros((2, 3, 4, 8), jnp.int32), jnp.zeros((2, 3, 4)), TypeError, "outputs"),
        (jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 3, 4), jnp.int32), TypeError, "lses"),
        (jnp.zeros((3, 4, 8)), jnp.zeros((2, 3, 4)), ValueError, "rank 4"),
        (jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 12)), ValueError, "rank 3"),
        (jnp.zeros((2, 3, 4, 8)), jnp.zeros((3, 3, 4)), ValueError, "must match outputs"),
    ],
)
def test_lse_weighted_combine_rejects_bad_input(outs, lses, exc, match):
    with pytest.raises(exc, match=match):
        lse_weighted_combine(outs, lses)


# ----------------------------------------------------------------------------- collectives


def _ag_rs(n, outs, lses, base_e, return_lse):
    def body(o, l):
        return cp_lse_ag_out_rs(o[0], l[0], "dcp", return_lse=return_lse, is_lse_base_on_e=base_e)

    out_specs = (P(None, "dcp"), P(None, "dcp")) if return_lse else P(None, "dcp")
    f = jax.shard_map(body, mesh=mesh(n), in_specs=(P("dcp"), P("dcp")), out_specs=out_specs)
    return jax.jit(f)(outs, lses)


@pytest.mark.parametrize("base_e", [True, False])
def test_cp_lse_ag_out_rs_on_8_devices_matches_global(base_e):
    assert jax.device_count() >= 8, "conftest.py must force 8 host devices"
    rng = np.random.default_rng(3)
    n, b, h, d = 8, 3, 16, 8
    outs, lses = _partials(rng, n, b, h, d)
    want, want_lse = np_merge(outs, lses, base_e)
    out, lse = _ag_rs(n, f32(outs), f32(lses), base_e, True)
    assert out.shape == (b, h, d) and lse.shape == (b, h)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-6)
    # The single-device combine agrees too.
    single = lse_weighted_combine(f32(outs), f32(lses), is_lse_base_on_e=base_e)
    np.testing.assert_allclose(np.asarray(out), np.asarray(single), rtol=1e-5, atol=1e-5)
    only = _ag_rs(n, f32(outs), f32(lses), base_e, False)
    np.testing.assert_array_equal(np.asarray(only), np.asarray(out))


def test_cp_lse_ag_out_rs_bf16_and_world_one():
    rng = np.random.default_rng(4)
    outs, lses = _partials(rng, 4, 2, 8, 16)
    out = _ag_rs(4, jnp.asarray(outs, jnp.bfloat16), f32(lses), True, False)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np_merge(outs, lses)[0], rtol=3e-2, atol=3e-2)
    # World size 1: returned unchanged, as in vLLM.
    one_out, one_lse = _ag_rs(1, f32(outs[:1]), f32(lses[:1]), True, True)
    np.testing.assert_array_equal(np.asarray(one_out), outs[0])
    np.testing.assert_array_equal(np.asarray(one_lse), lses[0])


@pytest.mark.parametrize(
    "shape_o, shape_l, dtype, exc, match",
    [
        ((1, 2, 6, 4), (1, 2, 6), jnp.float32, ValueError, "multiple of the size"),
        ((1, 2, 8, 4), (1, 2, 6), jnp.float32, ValueError, "must match cp_attn_out"),
        ((1, 2, 8, 4), (1, 2, 8), jnp.int32, TypeError, "cp_attn_out"),
    ],
)
def test_cp_lse_ag_out_rs_rejects_bad_input(shape_o, shape_l, dtype, exc, match):
    outs = jnp.zeros((4,) + shape_o[1:], dtype)
    lses = jnp.zeros((4,) + shape_l[1:], jnp.float32)
    with pytest.raises(exc, match=match):
        _ag_rs(4, outs, lses, True, False)


# ----------------------------------------------------------------------------- DCP attention


@pytest.mark.parametrize("interleave", [1, 2])
def test_sparse_dcp_attention_matches_global_topk_attention(interleave):
    rng = np.random.default_rng(interleave)
    world, topk, seq, d, h, block_size, k = 2, 3, 13, 8, 2, 4, 128
    seq_lens = [6, 8, 11, 13]  # query t sees positions < seq_lens[t]
    kv = rng.standard_normal((seq, d)).astype(np.float32)
    q = rng.standard_normal((len(seq_lens), h, d)).astype(np.float32)
    scale = d**-0.5
    # A GLOBAL top-k (identical on every rank), padded with -1 to the converter's width.
    tok = np.full((len(seq_lens), k), -1)
    for t, s in enumerate(seq_lens):
        scores = rng.standard_normal(s)
        tok[t, :topk] = np.argsort(-scores, kind="stable")[:topk]
    want, want_lse = np_attention(q, kv, tok, scale)

    req = i32(np.zeros(len(seq_lens)))
    outs, lses = [], []
    for rank in range(world):
        block_ids = [rank * 10 + 1, rank * 10 + 2]
        cache = rank_cache(kv, world, rank, interleave, block_size, block_ids, 64)
        slots = filter_and_convert_dcp_index(
            req, i32([block_ids]), i32(tok), dcp_size=world, dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave, block_size=block_size,
        )
        o, l = np_attention(q, cache, np.asarray(slots), scale)  # NaN if a slot missed
        o[~np.isfinite(l)] = np.nan  # an empty shard's kernel output is garbage; the merge drops it
        outs.append(o)
        lses.append(l)
    out, lse = lse_weighted_combine(f32(outs), f32(lses), return_lse=True)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
    summed = sum(np.asarray(correct_attn_out(f32(outs[r]), f32(lses), r)[0]) for r in range(world))
    np.testing.assert_allclose(summed, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleave", [1, 2, 4])
def test_dcp_global_topk_physical_attention_matches_non_dcp(interleave):
    rng = np.random.default_rng(10 + interleave)
    world, block_size, k, valid, seq, d, h, nq = 2, 4, 128, 8, 16, 16, 4, 3
    kv = rng.standard_normal((seq, d)).astype(np.float32)
    q = rng.standard_normal((nq, h, d)).astype(np.float32)
    scale = d**-0.5
    tok = np.full((nq, k), -1)
    for t in range(nq):
        tok[t, :valid] = rng.permutation(seq)[:valid]
    tok[2, :valid] = np.arange(0, 2 * valid, 2)[:valid] // interleave * interleave  # skewed to few ranks
    req = i32(np.zeros(nq))

    # Non-DCP: one paged cache holding the whole request.
    global_blocks = [5, 6, 7, 8]
    global_cache = rank_cache(kv, 1, 0, 1, block_size, global_blocks, 64)
    phys = convert_req_index_to_global_index(req, i32([global_blocks]), i32(tok), block_size=block_size)
    want, want_lse = np_attention(q, global_cache, np.asarray(phys), scale)

    # DCP: each rank filters the same global indices to its own shard.
    tables, caches = [], []
    for rank in range(world):
        block_ids = [rank * 10 + 1, rank * 10 + 2]
        tables.append([block_ids])
        caches.append(rank_cache(kv, world, rank, interleave, block_size, block_ids, 64))
        slots, counts = filter_and_convert_dcp_index(
            req, i32([block_ids]), i32(tok), dcp_size=world, dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave, block_size=block_size, return_valid_counts=True,
        )
        slots, counts = np.asarray(slots), np.asarray(counts)
        for row in range(nq):
            assert slots[row, counts[row]] == -1
            assert (slots[row, : counts[row]] >= 0).all()

    # The whole rank-local pipeline under shard_map: traced rank, attention, LSE merge.
    def body(table, cache, q, tok):
        rank = jax.lax.axis_index("dcp")
        slots = filter_and_convert_dcp_index(
            req, table[0], tok, dcp_size=world, dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave, block_size=block_size,
        )
        o, l = jnp_attention(q, cache[0], slots, scale)
        return cp_lse_ag_out_rs(o, l, "dcp", return_lse=True)

    f = jax.shard_map(
        body, mesh=mesh(world), in_specs=(P("dcp"), P("dcp"), P(), P()),
        out_specs=(P(None, "dcp"), P(None, "dcp")),
    )
    out, lse = jax.jit(f)(i32(tables), f32(caches), f32(q), i32(tok))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
