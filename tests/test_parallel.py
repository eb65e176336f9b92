"""Multi-device decode (jax_sparse_mla.parallel) on the 8 host devices that conftest.py sets up.

The sharded result (heads over tp x dcp, KV over dcp, caches written per rank through the DCP slot
mapping) must equal the single-device result: FlashInferMLASparseImpl.forward_mqa without DCP over one
unsharded cache holding the same rows. The data has requests shorter than dcp * interleave (ranks that
own no key of a token), -1 holes inside top-k rows, a row with no valid index, and NaN in every cache
row nobody wrote.

Tolerance: atol = rtol = 2e-2 on outputs of magnitude up to ~4. Each rank's kernel rounds its partial
to bf16, the LSE rescale rounds it again, and the default reduce-scatter sums the bf16 partials (as vLLM's
NCCL reduce-scatter does), so the result may differ from the single-device one by about one bf16 ulp of
the value (measured: at most 0.031 at |out| ~ 4, i.e. 1 ulp). reduce_dtype=float32 only removes the
rounding of the sum; the kernel's bf16 partials dominate, so it gets the same tolerance. LSEs are float32
throughout (1e-5).
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jax_sparse_mla as jsm
from jax_sparse_mla import parallel as par

BS = 8  # block size
K = 128  # top-k width
H = 16  # heads: 16 / (tp * dcp) >= 2 per device for every mesh of 8 devices
SEQ_LENS = [1, 2, 3, 29, 70]  # 1..3: shorter than most dcp * interleave -> empty shards
REQ_OF_TOKEN = [0, 1, 2, 3, 4, 4, 3]  # the last tokens: a second query of requests 4 and 3
SCALE = 0.08
MAX_LEN = max(SEQ_LENS)

# 8 forced host devices on CPU (conftest.py); on a multi-GPU machine the GPUs, whatever their number.
NDEV = min(jax.device_count(), 8)
pytestmark = pytest.mark.skipif(NDEV < 2, reason="needs at least 2 devices")


def i32(x):
    return jnp.asarray(np.asarray(x), jnp.int32)


@functools.lru_cache(maxsize=None)
def world():
    """The batch: rows, top-k, queries, and the single-device reference (out, lse base e)."""
    rng = np.random.default_rng(0)
    num_reqs = len(SEQ_LENS)
    rows = rng.standard_normal((num_reqs, MAX_LEN, 576)).astype(np.float32)
    req_tok = np.repeat(np.arange(num_reqs), MAX_LEN)
    pos_tok = np.tile(np.arange(MAX_LEN), num_reqs)
    keep = pos_tok < np.asarray(SEQ_LENS)[req_tok]
    req_tok, pos_tok = req_tok[keep].astype(np.int32), pos_tok[keep].astype(np.int32)
    new_rows = jnp.asarray(rows[req_tok, pos_tok], jnp.bfloat16)

    topk = np.full((len(REQ_OF_TOKEN), K), -1, np.int32)
    for t, r in enumerate(REQ_OF_TOKEN):
        n = min(SEQ_LENS[r], 60)
        cols = np.sort(rng.choice(K, size=n, replace=False))  # -1 holes between the picks
        topk[t, cols] = rng.permutation(SEQ_LENS[r])[:n]
    topk[5] = -1  # a token with no valid index at all: out 0, lse -inf
    q = jnp.asarray(rng.standard_normal((len(REQ_OF_TOKEN), H, 576)), jnp.bfloat16)

    # Single device: one cache, one block table, plain (non-DCP) forward_mqa.
    width = -(-MAX_LEN // BS)
    table = (1 + rng.permutation(num_reqs * width)).reshape(num_reqs, width).astype(np.int32)
    cache = jnp.full((1 + num_reqs * width, BS, 576), jnp.nan, jnp.bfloat16)
    slots = par.dcp_slot_mapping(req_tok, pos_tok, i32(table), block_size=BS, dcp_size=1,
                                 dcp_rank=0)
    cache = jsm.concat_and_cache_mla(new_rows[:, :512], new_rows[:, 512:], cache, slots)
    # One token per request, the last request three: only req_id_per_token matters below, and it is
    # replaced by REQ_OF_TOKEN (whose order no query_start_loc can express).
    qsl = i32(list(range(len(SEQ_LENS))) + [len(REQ_OF_TOKEN)])
    common = jsm.CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=i32(SEQ_LENS), block_table_tensor=i32(table),
        slot_mapping=i32(np.full(len(REQ_OF_TOKEN), -1)), num_reqs=len(SEQ_LENS),
        num_actual_tokens=len(REQ_OF_TOKEN), max_query_len=len(REQ_OF_TOKEN) - len(SEQ_LENS) + 1,
        max_seq_len=MAX_LEN)
    metadata = jsm.FlashInferMLASparseMetadataBuilder(num_heads=H, block_size=BS, topk_tokens=K) \
        .build(common)
    metadata = type(metadata)(**{**metadata.__dict__, "req_id_per_token": i32(REQ_OF_TOKEN)})
    impl = _impl(dcp_world_size=1)
    ref_out, _ = impl.forward_mqa(q, cache, metadata, topk_indices=i32(topk))
    phys = jsm.convert_req_index_to_global_index(i32(REQ_OF_TOKEN), i32(table), i32(topk),
                                                 block_size=BS)
    _, ref_lse = jsm.sparse_mla_decode(q, cache, phys, scale=SCALE)
    return dict(rows=new_rows, req_tok=req_tok, pos_tok=pos_tok, topk=topk, q=q,
                ref_out=np.asarray(ref_out, np.float32), ref_lse=np.asarray(ref_lse))


def _impl(**kw):
    return jsm.FlashInferMLASparseImpl(
        num_heads=H, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
        kv_sharing_target_layer_name=None, **kw)


def sharded_caches(mesh, dcp, interleave, seed):
    """Per-rank block tables over local positions (random block ids, block 0 unused) and caches
    written through dcp_slot_mapping + sharded_concat_and_cache_mla; unwritten rows are NaN."""
    w = world()
    rng = np.random.default_rng(seed)
    num_reqs = len(SEQ_LENS)
    width = -(-MAX_LEN // (BS * dcp)) + 1  # one spare column
    tables = np.stack([(1 + rng.permutation(num_reqs * width)).reshape(num_reqs, width)
                       for _ in range(dcp)]).astype(np.int32)
    caches = jnp.full((dcp, 1 + num_reqs * width, BS, 576), jnp.nan, jnp.bfloat16)

    @jax.jit
    def write(caches, tables):
        slots = par.dcp_slot_mapping(w["req_tok"], w["pos_tok"], tables, block_size=BS,
                                     dcp_size=dcp, interleave=interleave)
        return par.sharded_concat_and_cache_mla(mesh, w["rows"][:, :512], w["rows"][:, 512:],
                                                caches, slots)

    return write(caches, i32(tables)), i32(tables)


def empty_shard_tokens(dcp, interleave):
    """How many (token, rank) pairs have no owned key: must be > 0 for the test to mean anything."""
    topk = world()["topk"]
    count = 0
    for t in range(topk.shape[0]):
        owners = {(int(p) // interleave) % dcp for p in topk[t] if p >= 0}
        count += dcp - len(owners)
    return count


# dcp x interleave over every dcp the devices allow; tp fills the remaining devices (tp = 1 for
# interleave 2, so that both tp = 1 and tp > 1 meshes run).
CASES = [(dcp, i, (NDEV // dcp) if i != 2 else 1)
         for dcp, i in itertools.product([d for d in (1, 2, 4, 8) if d <= NDEV], [1, 2, 4])]


@pytest.mark.parametrize("dcp,interleave,tp", CASES)
def test_sharded_decode_matches_single_device(dcp, interleave, tp):
    w = world()
    mesh = par.make_decode_mesh(tp, dcp)
    caches, tables = sharded_caches(mesh, dcp, interleave, seed=dcp * 10 + interleave)
    if dcp > 1:
        assert empty_shard_tokens(dcp, interleave) > 0

    f = jax.jit(functools.partial(par.sharded_sparse_mla_decode, mesh, scale=SCALE,
                                  interleave=interleave, return_lse=True))
    out, lse = f(w["q"], caches, tables, i32(w["topk"]), i32(REQ_OF_TOKEN))
    assert out.shape == (len(REQ_OF_TOKEN), H, 512) and out.dtype == jnp.bfloat16
    assert out.sharding.is_equivalent_to(par.head_sharding(mesh), out.ndim)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, w["ref_out"], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, w["ref_lse"], rtol=1e-5, atol=1e-5)
    assert (out[5] == 0).all() and (lse[5] == -np.inf).all()


def test_float32_reduce_and_explicit_mesh():
    """reduce_dtype=float32 (tighter), lse in base 2, and a mesh with Explicit axes."""
    w = world()
    dcp, interleave = min(4, NDEV), 2
    tp = min(2, NDEV // dcp)
    mesh = Mesh(np.asarray(jax.devices()[:tp * dcp], dtype=object).reshape(tp, dcp), ("tp", "dcp"),
                axis_types=(AxisType.Explicit, AxisType.Explicit))
    caches, tables = sharded_caches(par.make_decode_mesh(tp, dcp), dcp, interleave, seed=7)
    f = jax.jit(functools.partial(par.sharded_sparse_mla_decode, mesh, scale=SCALE,
                                  interleave=interleave, reduce_dtype=jnp.float32,
                                  return_lse=True, lse_base="2"))
    out, lse = f(w["q"], caches, tables, i32(w["topk"]), i32(REQ_OF_TOKEN))
    np.testing.assert_allclose(np.asarray(out, np.float32), w["ref_out"], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), w["ref_lse"] / np.log(2), rtol=1e-5, atol=1e-5)


def test_sharded_writer_matches_numpy():
    w = world()
    dcp, interleave = min(4, NDEV), 2
    mesh = par.make_decode_mesh(NDEV // dcp, dcp)
    caches, tables = sharded_caches(mesh, dcp, interleave, seed=3)
    caches, tables = np.asarray(caches, np.float32), np.asarray(tables)
    rows = np.asarray(w["rows"], np.float32)
    written = np.zeros(caches.shape[:3], bool)
    for j, (r, p) in enumerate(zip(w["req_tok"], w["pos_tok"])):
        rank = (p // interleave) % dcp
        local = (p // (dcp * interleave)) * interleave + p % interleave
        blk = tables[rank, r, local // BS]
        np.testing.assert_array_equal(caches[rank, blk, local % BS], rows[j])
        written[rank, blk, local % BS] = True
    assert np.isnan(caches[~written]).all()


def np_slot_mapping(req, pos, tables, bs, n, i):
    out = np.full((n, len(pos)), -1, np.int64)
    for rank in range(n):
        for t, (r, p) in enumerate(zip(req, pos)):
            if p < 0:
                continue
            vb, vo = p // (bs * n), p % (bs * n)
            if vb >= tables.shape[2] or (vo // i) % n != rank:
                continue
            out[rank, t] = tables[rank, r, vb] * bs + (vo // (i * n)) * i + vo % i
    return out


@pytest.mark.parametrize("n,i,bs", [(1, 1, 16), (2, 1, 16), (2, 4, 16), (4, 2, 8), (8, 1, 64),
                                    (8, 4, 32)])
def test_dcp_slot_mapping_matches_numpy(n, i, bs):
    rng = np.random.default_rng(n * 100 + i)
    num_reqs, width, t = 3, 5, 200
    tables = rng.integers(0, 1000, (n, num_reqs, width)).astype(np.int32)
    req = rng.integers(0, num_reqs, t).astype(np.int32)
    pos = rng.integers(-3, bs * n * (width + 1), t).astype(np.int32)  # padding and past-width too
    want = np_slot_mapping(req, pos, tables, bs, n, i)
    got = par.dcp_slot_mapping(req, pos, i32(tables), block_size=bs, dcp_size=n, interleave=i)
    np.testing.assert_array_equal(np.asarray(got), want)
    one = jax.jit(lambda tab, r: par.dcp_slot_mapping(req, pos, tab, block_size=bs, dcp_size=n,
                                                      dcp_rank=r, interleave=i))
    for rank in range(n):
        np.testing.assert_array_equal(np.asarray(one(i32(tables[rank]), rank)), want[rank])
    # Every valid in-width position is written by exactly one rank.
    live = (pos >= 0) & (pos // (bs * n) < width)
    np.testing.assert_array_equal((want >= 0).sum(0), live.astype(int))


def test_bad_inputs():
    w = world()
    q, topk, req = w["q"], i32(w["topk"]), i32(REQ_OF_TOKEN)
    caches = jnp.zeros((2, 3, BS, 576), jnp.bfloat16)
    tables = jnp.zeros((2, len(SEQ_LENS), 2), jnp.int32)
    call = functools.partial(par.sharded_sparse_mla_decode, scale=SCALE)
    mesh = par.make_decode_mesh(1, 2)
    with pytest.raises(ValueError, match=r"H=3 must be a multiple of tp \* dcp = 1 \* 2 = 2"):
        call(mesh, q[:, :3], caches, tables, topk, req)
    with pytest.raises(ValueError, match=r"block_size \(8\) must be a multiple of interleave \(3\)"):
        call(mesh, q, caches, tables, topk, req, interleave=3)
    bad_mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("model", "dcp"))
    with pytest.raises(ValueError, match="axis 'tp' is missing"):
        call(bad_mesh, q, caches, tables, topk, req)
    with pytest.raises(ValueError, match="leading axis 2"):
        call(mesh, q, caches[:1], tables, topk, req)
    with pytest.raises(ValueError, match="leading axis 2"):
        call(mesh, q, caches, tables[:1], topk, req)
    with pytest.raises(TypeError, match="block_table_shards must have dtype int32"):
        call(mesh, q, caches, tables.astype(jnp.float32), topk, req)
    with pytest.raises(ValueError, match="must have q's 7 tokens"):
        call(mesh, q, caches, tables, topk[:3], req)
    with pytest.raises(ValueError, match=f"needs {2 * jax.device_count()} devices"):
        par.make_decode_mesh(jax.device_count(), 2)
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        call("mesh", q, caches, tables, topk, req)
    for reduce_dtype in ("bogus", jnp.int32, "float64"):
        with pytest.raises(TypeError, match="reduce_dtype must be None or one of float32"):
            call(mesh, q, caches, tables, topk, req, reduce_dtype=reduce_dtype)
    rows, slots = jnp.zeros((2, 512), jnp.bfloat16), jnp.full((2, 2), -1, jnp.int32)
    for name, args in (("kv_c", ([[0.0] * 512] * 2, rows[:, :64], caches, slots)),
                       ("k_pe", (rows, [[0.0] * 64] * 2, caches, slots)),
                       ("kv_cache_shards", (rows, rows[:, :64], caches.tolist(), slots)),
                       ("slot_mapping_shards", (rows, rows[:, :64], caches, [[-1, -1]] * 2))):
        began = time.perf_counter()
        with pytest.raises(TypeError, match=f"{name} must be an array, got list"):
            par.sharded_concat_and_cache_mla(mesh, *args)
        assert time.perf_counter() - began < 1.0
    pos, r = i32([0, 1]), i32([0, 0])
    with pytest.raises(ValueError, match=r"block_size \(8\) must be a multiple of interleave \(3\)"):
        par.dcp_slot_mapping(r, pos, tables, block_size=8, dcp_size=2, interleave=3)
    with pytest.raises(ValueError, match=r"must be \[N=4, R, W\]"):
        par.dcp_slot_mapping(r, pos, tables, block_size=8, dcp_size=4)
    with pytest.raises(ValueError, match="dcp_rank < 4"):
        par.dcp_slot_mapping(r, pos, tables[0], block_size=8, dcp_size=4, dcp_rank=4)
    with pytest.raises(ValueError, match="same shape"):
        par.dcp_slot_mapping(r, pos[:1], tables[0], block_size=8, dcp_size=4, dcp_rank=0)
