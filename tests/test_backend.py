"""End-to-end decode through FlashInferMLASparseImpl.forward_mqa against float64 dense attention with
weight absorption (vLLM's test_sparse_backend_decode_correctness), plus the metadata builder and the
backend classes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from reference import BF16, assert_close

KV_LORA, NOPE, ROPE, V_DIM, TOPK = 512, 128, 64, 128, 128
MODEL_SCALE = 192 ** -0.5 * 1.2  # a YaRN-style model scale, not 576 ** -0.5

BATCHES = {
    "mixed_small": ([32, 40, 48, 56], [1, 1, 5, 5]),
    "small_prefill": ([32, 40], [8, 8]),
    "mixed_long": ([300, 130, 260], [1, 1, 4]),
}


def build_batch(rng, seq_lens, query_lens, num_heads, block_size, kv_cache_dtype, k_scale):
    """A paged cache (block 0 is the null block, unselected rows NaN) holding every sequence's context,
    with this step's tokens written by concat_and_cache_mla, and request-local top-k indices."""
    num_reqs = len(seq_lens)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    width = max(blocks_per_req)
    block_table = np.zeros((num_reqs, width), np.int32)
    next_block = 1
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = np.arange(next_block, next_block + n)
        next_block += n
    num_blocks = next_block
    kv_c = [rng.random((s, KV_LORA)).astype(BF16) for s in seq_lens]
    k_pe = [rng.random((s, ROPE)).astype(BF16) for s in seq_lens]
    slots = [block_table[r, np.arange(s) // block_size] * block_size + np.arange(s) % block_size
             for r, s in enumerate(seq_lens)]
    write = lambda c, a, b, s: jsm.concat_and_cache_mla(a, b, c, s, kv_cache_dtype=kv_cache_dtype,
                                                        k_scale=k_scale)
    if kv_cache_dtype == "fp8":
        cache = jnp.asarray(np.full((num_blocks, block_size, 576), 0x7F, np.uint8)).view(jnp.float8_e4m3fn)
    elif kv_cache_dtype == "fp8_ds_mla":  # 0xFF bytes: NaN values, scales and RoPE
        cache = jnp.full((num_blocks, block_size, 656), 0xFF, jnp.uint8)
        write = lambda c, a, b, s: jsm.concat_and_cache_ds_mla(a, b, c, s)
    else:
        cache = jnp.full((num_blocks, block_size, 576), jnp.nan, jnp.bfloat16)
    for r, (s, q_len) in enumerate(zip(seq_lens, query_lens)):
        ctx = s - q_len  # the context is in the cache already; the new tokens are written this step
        cache = write(cache, kv_c[r][:ctx], k_pe[r][:ctx], slots[r][:ctx].astype(np.int32))
    new = np.concatenate([slots[r][s - q:] for r, (s, q) in enumerate(zip(seq_lens, query_lens))])
    cache = write(cache, np.concatenate([kv_c[r][s - q:] for r, (s, q) in enumerate(zip(seq_lens, query_lens))]),
                  np.concatenate([k_pe[r][s - q:] for r, (s, q) in enumerate(zip(seq_lens, query_lens))]),
                  new.astype(np.int32))
    # Top-k rows: token at position p selects n = min(TOPK // 2, p + 1) of its causal keys, in a
    # shuffled order with the -1 holes scattered through the row.
    topk, positions, owners = [], [], []
    for r, (s, q_len) in enumerate(zip(seq_lens, query_lens)):
        for p in range(s - q_len, s):
            t = len(topk)
            n = min(TOPK // 2, p + 1)
            row = np.full(TOPK, -1, np.int32)
            row[:n] = (np.arange(n) + 7 * t) % (p + 1)
            topk.append(rng.permutation(row))
            positions.append(p)
            owners.append(r)
    topk = np.stack(topk)
    topk[1] = -1  # a token that selects nothing: out 0
    return dict(cache=cache, block_table=block_table, topk=topk, owners=owners, kv_c=kv_c, k_pe=k_pe,
                slot_mapping=new.astype(np.int32))


def dequantised_rows(batch, r, kv_cache_dtype, k_scale):
    rows = np.concatenate([batch["kv_c"][r], batch["k_pe"][r]], -1).astype(np.float64)
    if kv_cache_dtype == "fp8":
        rows = np.clip(rows / k_scale, -448, 448).astype(jnp.float8_e4m3fn).astype(np.float64) * k_scale
    return rows


# Every head count on the small batch; the larger batches at the extreme head counts (CI time).
GRID = [(batch, heads) for batch in BATCHES for heads in (128, 64, 32, 16, 3)
        if batch == "mixed_small" or heads in (128, 3)]


@pytest.mark.parametrize("batch_name,num_heads", GRID)
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("kv_cache_dtype,q_scale,k_scale", [("auto", 1.0, 1.0), ("fp8", 1.0, 1.0),
                                                            ("fp8", 2.0, 3.0)])
def test_forward_mqa_matches_dense_reference(batch_name, num_heads, block_size, kv_cache_dtype,
                                             q_scale, k_scale):
    seq_lens, query_lens = BATCHES[batch_name]
    rng = np.random.default_rng(num_heads + block_size)
    batch = build_batch(rng, seq_lens, query_lens, num_heads, block_size, kv_cache_dtype, k_scale)
    num_tokens = sum(query_lens)
    q_c = rng.random((num_tokens, num_heads, NOPE + ROPE)).astype(np.float32)
    w_uk = rng.random((KV_LORA, num_heads, NOPE)).astype(np.float32) / 8
    w_uv = rng.random((KV_LORA, num_heads, V_DIM)).astype(np.float32) / 8

    # The layer's half: absorb W_UK into the query, quantise for an fp8 cache.
    ql_nope = jnp.einsum("tnp,lnp->tnl", q_c[..., :NOPE], w_uk).astype(jnp.bfloat16)
    q = jnp.concatenate([ql_nope, jnp.asarray(q_c[..., NOPE:], jnp.bfloat16)], -1)
    if kv_cache_dtype == "fp8":
        q = jsm.quantize_query_fp8(q, q_scale)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    common = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens, jnp.int32),
        block_table_tensor=jnp.asarray(batch["block_table"]), slot_mapping=jnp.asarray(batch["slot_mapping"]),
        num_reqs=len(seq_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=tuple(qsl), seq_lens_cpu=tuple(seq_lens))
    metadata = jsm.FlashInferMLASparseMetadataBuilder(
        num_heads=num_heads, block_size=block_size, topk_tokens=TOPK).build(common)
    impl = jsm.FlashInferMLASparseImpl(num_heads, 576, MODEL_SCALE, 1, None, None, kv_cache_dtype, None,
                                       "decoder", None, implementation="xla")
    layer = jsm.LayerScales(_q_scale_float=q_scale, _k_scale_float=k_scale)
    step = jax.jit(lambda q, cache, md, topk: impl.forward_mqa(q, cache, md, layer, topk_indices=topk))
    attn_out, lse = step(q, batch["cache"], metadata, jnp.asarray(batch["topk"]))
    assert lse is None and attn_out.shape == (num_tokens, num_heads, 512)
    out = np.einsum("tnl,lnv->tnv", np.asarray(attn_out, np.float64), w_uv).reshape(num_tokens, -1)

    q_ref = np.asarray(q.astype(jnp.float32), np.float64) * (q_scale if kv_cache_dtype == "fp8" else 1)
    expected = np.zeros((num_tokens, num_heads, V_DIM))
    for t, r in enumerate(batch["owners"]):
        selected = batch["topk"][t][batch["topk"][t] >= 0]
        if selected.size == 0:
            continue
        keys = dequantised_rows(batch, r, kv_cache_dtype, k_scale)[selected]
        logits = np.einsum("nd,kd->nk", q_ref[t], keys) * MODEL_SCALE
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        latent = (weights / weights.sum(-1, keepdims=True)) @ keys[:, :KV_LORA]
        expected[t] = np.einsum("nl,lnv->nv", latent, w_uv)
    assert np.all(out[1] == 0)
    assert_close(out, expected.reshape(num_tokens, -1), atol=2e-2, rtol=1e-2, name="out")


def test_forward_mqa_returns_base2_lse_under_dcp_shape_rules():
    impl = jsm.FlashInferMLASparseImpl(4, 576, 0.1, 1, None, None, "auto", None, "decoder", None,
                                       dcp_world_size=2, dcp_rank=1)
    assert impl.need_to_return_lse_for_decode and not impl.lse_base_on_e
    block_table = jnp.asarray([[3, 4]], jnp.int32)
    md = jsm.FlashInferMLASparseMetadataBuilder(num_heads=4, block_size=4, topk_tokens=128).build(
        jsm.CommonAttentionMetadata(jnp.asarray([0, 1], jnp.int32), jnp.asarray([16], jnp.int32),
                                    block_table, jnp.zeros(1, jnp.int32), 1, 1, 1, 16))
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.random((6, 4, 576)), jnp.bfloat16)
    topk = np.full((1, 128), -1, np.int32)
    topk[0, :16] = np.arange(16)  # rank 1 owns odd positions: local 0..7 -> slots 12..19
    q = jnp.asarray(rng.random((1, 4, 576)), jnp.bfloat16)
    out, lse = impl.forward_mqa(q, cache, md, topk_indices=jnp.asarray(topk))
    owned = 12 + np.arange(8)
    ref_out, ref_lse = __import__("reference").attention_from_slots(
        np.asarray(q, np.float64), np.asarray(cache, np.float64).reshape(-1, 576), owned[None], 0.1)
    assert_close(lse, ref_lse / np.log(2), atol=1e-4, rtol=1e-5)
    assert_close(out, ref_out, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("num_heads,threshold", [(8, 128), (16, 128), (32, 128), (64, 256), (128, 1024),
                                                 (3, 1024), (256, 1024)])
def test_builder_reorder_threshold_by_heads(num_heads, threshold):
    assert jsm.FlashInferMLASparseMetadataBuilder(num_heads=num_heads).reorder_batch_threshold == threshold


def test_builder_spec_decode_raises_threshold():
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=16, max_decode_query_len=200)
    assert builder.reorder_batch_threshold == 200


def _common(query_lens, seq_lens, *, host=True, width=4, pad_tokens=0):
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + pad_tokens
    return jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens, jnp.int32),
        block_table_tensor=jnp.zeros((len(seq_lens), width), jnp.int32),
        slot_mapping=jnp.zeros(num_tokens, jnp.int32), num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(int(x) for x in qsl) if host else None,
        seq_lens_cpu=tuple(seq_lens) if host else None)


def test_builder_split_and_req_id_per_token():
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=16, block_size=64, topk_tokens=2048)
    # threshold 128: [1, 1, 100] are decodes (short extends count), [300, 2] starts the prefills.
    md = builder.build(_common([1, 1, 100, 300, 2], [10, 20, 200, 900, 50], pad_tokens=3))
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (3, 2, 102)
    assert md.prefill_max_seq_len == 900
    assert (md.leading_reqs, md.leading_query_len) == (2, 1)  # the indexer's decode-first run
    expected = np.concatenate([np.repeat(np.arange(5), [1, 1, 100, 300, 2]), [0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(md.req_id_per_token), expected)
    assert (md.block_size, md.topk_tokens, md.cp_kv_cache_interleave_size) == (64, 2048, 1)


def test_builder_skips_zero_length_requests_and_runs_under_jit():
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=128)
    md = jax.jit(builder.build)(_common([2, 0, 3], [5, 4, 9], host=False))
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (3, 0, 5)
    np.testing.assert_array_equal(np.asarray(md.req_id_per_token), [0, 0, 2, 2, 2])
    assert (md.leading_reqs, md.leading_query_len) == (0, 0)  # no host copy under jit
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert len(leaves) == 5  # the arrays; the ints are static aux data


def test_builder_traces_no_loop():
    """The request of each token is found by an unrolled search: a while loop would run outside
    the step's CUDA graph on a GPU, one launch and copy per iteration."""
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=128)
    common = _common([2, 0, 3, 1, 7], [5, 4, 9, 2, 20], host=False)
    text = jax.jit(builder.build).lower(common).as_text()
    assert "stablehlo.while" not in text


def test_builder_mixed_batch_under_jit_needs_host_copies():
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=16)
    with pytest.raises(ValueError, match="query_start_loc_cpu"):
        jax.jit(builder.build)(_common([1, 500], [10, 600], host=False))


def test_builder_prefill_under_jit_with_traced_seq_lens():
    """A chunked prefill's step: the query split on the host, seq_lens traced without a host copy;
    prefill_max_seq_len is then the static bound max_seq_len (with the copy, the longest prefill)."""
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=128)
    common = _common([4096], [10000], host=False)
    common = dataclasses.replace(common, query_start_loc_cpu=(0, 4096), max_seq_len=16384)
    md = jax.jit(builder.build)(common)
    assert (md.num_decodes, md.num_prefills, md.prefill_max_seq_len) == (0, 1, 16384)
    md = builder.build(dataclasses.replace(common, seq_lens_cpu=(10000,)))
    assert md.prefill_max_seq_len == 10000


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=0), "num_heads"),
    (dict(num_heads=8, block_size=6, cp_kv_cache_interleave_size=4), "multiple of"),
    (dict(num_heads=8, topk_tokens=-1), "topk_tokens"),
])
def test_builder_rejects_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jsm.FlashInferMLASparseMetadataBuilder(**kwargs)


def test_builder_rejects_bad_metadata():
    builder = jsm.FlashInferMLASparseMetadataBuilder(num_heads=8)
    common = _common([1, 1], [3, 4])
    with pytest.raises(TypeError, match="block_table_tensor must have dtype int32"):
        builder.build(common.__class__(**{**common.__dict__,
                                          "block_table_tensor": np.zeros((2, 4), np.int64)}))
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        builder.build(common.__class__(**{**common.__dict__, "num_reqs": 3}))


CC = jsm.DeviceCapability


def test_backend_names_and_capabilities():
    trtllm, sm120, sm90 = (jsm.FlashInferMLASparseTRTLLMBackend, jsm.FlashInferMLASparseSM120Backend,
                           jsm.FlashInferMLASparseSM90Backend)
    assert trtllm.get_name() == "FLASHINFER_MLA_SPARSE"
    assert sm120.get_name() == "FLASHINFER_MLA_SPARSE_SM120"
    assert sm90.get_name() == "FLASHINFER_MLA_SPARSE_SM90"
    assert [b.supports_compute_capability(CC(10, 0)) for b in (trtllm, sm120, sm90)] == [True, False, False]
    assert [b.supports_compute_capability(CC(12, 0)) for b in (trtllm, sm120, sm90)] == [False, True, False]
    assert [b.supports_compute_capability(CC(9, 0)) for b in (trtllm, sm120, sm90)] == [False, False, True]
    assert trtllm.get_supported_kernel_block_sizes() == [32, 64]
    assert sm120.get_supported_kernel_block_sizes() == [64, 256]
    assert trtllm.supported_kv_cache_dtypes == ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
    assert sm120.supported_kv_cache_dtypes == ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
    assert trtllm.get_supported_head_sizes() == [576] and trtllm.is_mla() and trtllm.is_sparse()
    assert trtllm.get_kv_cache_shape(10, 64, 1, 576, "fp8") == (10, 64, 576)
    assert sm120.get_kv_cache_shape(10, 64, 1, 576, "fp8") == (10, 64, 656)
    assert sm120.get_kv_cache_shape(10, 64, 1, 576, "bfloat16") == (10, 64, 576)
    assert trtllm.get_required_kv_cache_layout() == "HND" and sm120.get_required_kv_cache_layout() is None
    assert trtllm.get_builder_cls() is jsm.FlashInferMLASparseMetadataBuilder
    assert trtllm.get_impl_cls() is jsm.FlashInferMLASparseImpl


def _combination(backend, kv_cache_dtype="auto", dtype=jnp.bfloat16, model_config=None, cc=CC(10, 0)):
    return backend.supports_combination(576, dtype, kv_cache_dtype, 64, True, False, True, False, cc,
                                        model_config=model_config)


def test_trtllm_supports_combination_messages():
    b = jsm.FlashInferMLASparseTRTLLMBackend
    assert _combination(b) is None
    assert _combination(b, "fp8_ds_mla") == (
        "FLASHINFER_MLA_SPARSE SM10 does not support fp8_ds_mla kv-cache dtype")
    assert _combination(b, model_config={"qk_nope_head_dim": 64, "index_topk": 2048}) == (
        "FlashInfer MLA Sparse kernel requires qk_nope_head_dim in [128, 192], but got 64")
    assert _combination(b, model_config={"qk_nope_head_dim": 192}) == (
        "FlashInfer MLA Sparse requires model with index_topk config")
    assert _combination(b, model_config={"qk_nope_head_dim": 128, "index_topk": 2048}) is None


@pytest.mark.parametrize("native_available", [False, True])
def test_sm120_supports_combination_messages(monkeypatch, native_available):
    from jax_sparse_mla.kernels import native

    targets = native.targets | {"jax_sparse_mla_sm120_decode"} if native_available else frozenset()
    monkeypatch.setattr(native, "targets", targets)
    b = jsm.FlashInferMLASparseSM120Backend
    if not native_available:
        # Without the SM120 native kernel, vLLM's "API missing" answer comes first.
        assert _combination(b, cc=CC(12, 0)) == (
            "FLASHINFER_MLA_SPARSE_SM120 requires FlashInfer's sparse MLA decode API")
        return
    assert _combination(b, "fp8_ds_mla", cc=CC(12, 0)) is None
    assert _combination(b, "fp8_ds_mla", dtype=jnp.float16, cc=CC(12, 0)) == "dtype not supported"
    assert _combination(b, "bfloat16", cc=CC(12, 0)) == "kv_cache_dtype not supported"
    assert _combination(b, "fp8_ds_mla", cc=CC(12, 0), model_config={"index_topk": 1024}) == (
        "FLASHINFER_MLA_SPARSE_SM120 requires index_topk=2048; got 1024")


@pytest.mark.parametrize("native_available", [False, True])
def test_sm90_supports_combination_messages(monkeypatch, native_available):
    from jax_sparse_mla.kernels import native

    targets = (native.targets | {"jax_sparse_mla_sm90_decode_bf16", "jax_sparse_mla_sm90_decode_fp8",
                                  "jax_sparse_mla_sm90_fp8_decode"}) if native_available else frozenset()
    monkeypatch.setattr(native, "targets", targets)
    b = jsm.FlashInferMLASparseSM90Backend
    assert b.supported_kv_cache_dtypes == ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")
    assert b.get_kv_cache_shape(10, 64, 1, 576, "fp8_ds_mla") == (10, 64, 656)
    assert b.get_kv_cache_shape(10, 64, 1, 576, "fp8") == (10, 64, 576)
    assert _combination(b, dtype=jnp.float16, cc=CC(9, 0)) == "dtype not supported"
    for kv_cache_dtype in ("auto", "fp8", "fp8_ds_mla"):
        expected = None if native_available else (
            "FLASHINFER_MLA_SPARSE_SM90 requires the jax_sparse_mla native extension")
        assert _combination(b, kv_cache_dtype, cc=CC(9, 0)) == expected


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(alibi_slopes=[1.0]), NotImplementedError, "alibi_slopes, sliding_window, logits_soft_cap"),
    (dict(logits_soft_cap=30.0), NotImplementedError, "alibi_slopes"),
    (dict(attn_type="encoder"), NotImplementedError, "Encoder self-attention"),
    (dict(head_size=512), ValueError, "head_size must be"),
    (dict(num_kv_heads=2), ValueError, "one latent KV head"),
    (dict(kv_cache_dtype="int4"), ValueError, "kv_cache_dtype must be one of"),
    (dict(scale=-1.0), ValueError, "scale"),
])
def test_impl_rejects_bad_config(kwargs, error, message):
    args = dict(num_heads=8, head_size=576, scale=0.1, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                kv_sharing_target_layer_name=None)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        jsm.FlashInferMLASparseImpl(**args)


def test_forward_mqa_without_indices_is_a_clear_error():
    impl = jsm.FlashInferMLASparseImpl(4, 576, 0.1, 1, None, None, "auto", None, "decoder", None)
    md = jsm.FlashInferMLASparseMetadataBuilder(num_heads=4).build(_common([1], [3]))
    with pytest.raises(ValueError, match="topk_indices"):
        impl.forward_mqa(jnp.zeros((1, 4, 576), jnp.bfloat16), jnp.zeros((1, 64, 576), jnp.bfloat16), md)
