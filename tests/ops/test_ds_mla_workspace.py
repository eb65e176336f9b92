"""The fp8_ds_mla prefill route through a bf16 workspace (ops/ds_mla_workspace.py): the workspace and
its indices against the float64 reference, the wiring in FlashInferMLASparseImpl.forward_mqa, and the
static rule that picks it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import backend
from jax_sparse_mla.kernels import registry
from jax_sparse_mla.ops import ds_mla_workspace
from reference import BF16, assert_close, attention_from_slots, pack_ds_mla, unpack_ds_mla

SCALE = 192 ** -0.5
BLOCK = 16


def make_case(rng, num_tokens=6, num_heads=16, topk=128, num_blocks=20, width=4):
    """Two requests over a shuffled block table (request 1's last entry points past the cache), an
    fp8_ds_mla cache whose rows no token may read are NaN bytes, and request-local top-k positions
    with holes, positions past the table and positions in the bad block."""
    kv = rng.uniform(-1, 1, (num_blocks * BLOCK, 576)).astype(np.float32)
    rows = pack_ds_mla(kv.astype(BF16), kv[:, 512:].astype(BF16))
    table = rng.permutation(np.arange(1, num_blocks))[:2 * width].reshape(2, width).astype(np.int32)
    table[1, -1] = num_blocks + 5
    req_ids = np.array([0] * (num_tokens // 2) + [1] * (num_tokens - num_tokens // 2), np.int32)
    local = rng.integers(0, width * BLOCK, (num_tokens, topk)).astype(np.int32)
    local[rng.random(local.shape) < 0.2] = -1
    local[0, :3] = [width * BLOCK, width * BLOCK + 7, -5]
    physical = np.asarray(jsm.convert_req_index_to_global_index(
        jnp.asarray(req_ids), jnp.asarray(table), jnp.asarray(local), block_size=BLOCK))
    readable = np.zeros(num_blocks * BLOCK, bool)
    readable[physical[(physical >= 0) & (physical < num_blocks * BLOCK)]] = True
    rows[~readable] = 0xFF  # e4m3 NaN and NaN scales: any read of them poisons the row's output
    q = rng.uniform(-1, 1, (num_tokens, num_heads, 576)).astype(BF16)
    return q, rows.reshape(num_blocks, BLOCK, 656), table, req_ids, local, physical


def test_workspace_attention_matches_float64():
    rng = np.random.default_rng(0)
    q, cache, table, req_ids, local, physical = make_case(rng)
    workspace, indices = jax.jit(ds_mla_workspace.bf16_workspace)(
        jnp.asarray(cache), jnp.asarray(table), jnp.asarray(req_ids), jnp.asarray(local),
        jnp.asarray(physical))
    assert workspace.shape == (2 * 4, BLOCK, 576) and workspace.dtype == jnp.bfloat16
    valid = (physical >= 0) & (physical < cache.shape[0] * BLOCK)
    np.testing.assert_array_equal(np.asarray(indices) >= 0, valid)
    # Every valid index reads the row its physical slot holds, rounded to bf16.
    flat = unpack_ds_mla(cache.reshape(-1, 656))
    np.testing.assert_array_equal(
        np.asarray(workspace.reshape(-1, 576)[np.asarray(indices)[valid]], np.float64),
        flat[physical[valid]].astype(BF16).astype(np.float64))
    out, lse = jsm.sparse_mla_decode(jnp.asarray(q), workspace, indices, scale=SCALE,
                                     implementation="xla")
    ref_out, ref_lse = attention_from_slots(q, flat, physical, SCALE)
    assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3, name="lse")


def _impl_and_metadata(req_ids, table, num_tokens):
    impl = jsm.FlashInferMLASparseImpl(16, 576, SCALE, 1, None, None, "fp8_ds_mla", None, "decoder",
                                       None, implementation="xla")
    counts = np.bincount(req_ids, minlength=table.shape[0])
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    common = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray(qsl), seq_lens=jnp.full(table.shape[0], 64, jnp.int32),
        block_table_tensor=jnp.asarray(table), slot_mapping=jnp.zeros(num_tokens, jnp.int32),
        num_reqs=table.shape[0], num_actual_tokens=num_tokens, max_query_len=int(counts.max()),
        max_seq_len=table.shape[1] * BLOCK, query_start_loc_cpu=tuple(int(x) for x in qsl))
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=16, block_size=BLOCK, topk_tokens=128)
    return impl, builder.build(common)


def test_forward_mqa_through_the_workspace_equals_the_fp8_path(monkeypatch):
    """The impl's wiring: forced onto the route, forward_mqa gives the fp8 path's result."""
    rng = np.random.default_rng(1)
    q, cache, table, req_ids, local, physical = make_case(rng)
    impl, metadata = _impl_and_metadata(req_ids, table, len(req_ids))
    direct, _ = impl.forward_mqa(jnp.asarray(q), jnp.asarray(cache), metadata,
                                 topk_indices=jnp.asarray(local))
    taken = []
    monkeypatch.setattr(backend, "use_bf16_workspace", lambda *a, **k: taken.append(1) or True)
    routed, _ = impl.forward_mqa(jnp.asarray(q), jnp.asarray(cache), metadata,
                                 topk_indices=jnp.asarray(local))
    assert taken
    ref_out, _ = attention_from_slots(q, unpack_ds_mla(cache.reshape(-1, 656)), physical, SCALE)
    assert_close(routed, ref_out, atol=1e-2, rtol=2e-2, name="routed")
    assert_close(routed, np.asarray(direct, np.float64), atol=1e-2, rtol=2e-2, name="routed vs fp8")


@pytest.fixture
def native_kernels(monkeypatch):
    """select_kernel as on an SM90 GPU: a native kernel for every layout."""
    fake = dataclasses.replace(registry.select_kernel("bfloat16", "bfloat16", "xla"), native=True)
    monkeypatch.setattr(registry, "select_kernel", lambda *args, **kwargs: fake)


def _use(num_tokens=8192, num_reqs=1, rows_per_request=131072, num_heads=128, topk=2048,
         q_dtype=jnp.bfloat16, implementation="auto", cache_dtype=jnp.uint8, row=656):
    cache = jax.ShapeDtypeStruct((4096, 64, row), cache_dtype)
    table = jax.ShapeDtypeStruct((num_reqs, rows_per_request // 64), jnp.int32)
    return ds_mla_workspace.use_bf16_workspace(cache, table, num_tokens=num_tokens,
                                               num_heads=num_heads, topk=topk, q_dtype=q_dtype,
                                               implementation=implementation)


def test_rule_takes_prefill_chunks(native_kernels):
    assert _use()
    assert _use(num_tokens=ds_mla_workspace.MIN_TOKENS, rows_per_request=65536)


@pytest.mark.parametrize("override", [
    dict(implementation="native"), dict(implementation="xla"), dict(q_dtype=jnp.float16),
    dict(cache_dtype=jnp.bfloat16, row=576),
    dict(num_tokens=ds_mla_workspace.MIN_TOKENS - 1),
    dict(num_reqs=33),  # a mixed step's decode requests: the workspace passes 1 GiB
    dict(num_tokens=1024, rows_per_request=600064),  # fewer than 4 selections per workspace row
])
def test_rule_keeps_the_fp8_kernel(native_kernels, override):
    assert not _use(**override)


def test_rule_needs_native_kernels():
    """On a machine without the native kernels (this CPU) the route is never taken."""
    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU's choice")
    assert not _use()
