"""The Flax lightning indexer (DeepSeek-V3.2 as vLLM runs it) against an un-quantised float64 indexer
written here: top-k recall with the real fp8 quantisation, exact equality when the quantisation is
lossless, the decode and prefill paths, the Hadamard option and the prefill chunking."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from jax_sparse_mla.flax import TINY, Indexer, empty_layer_cache  # noqa: E402
from jax_sparse_mla.flax.layers import hadamard_rotate  # noqa: E402
from reference import BF16, rope_np, to_e4m3, top_k_np, yarn_frequencies_np  # noqa: E402

BLOCK_SIZE = 64
WIDTH = 5  # blocks per request: 320 positions
SEQ_LENS = (300, 211)  # both longer than index_topk = 128


def batch_metadata(seq_lens, query_lens, config=TINY):
    """Metadata of one step in which request r brings its last query_lens[r] tokens (the rest of its
    seq_lens[r] tokens are in the cache already). Request r owns blocks 1 + r * WIDTH, ...; returns
    (metadata, positions [T], slots [T] of this step's tokens, block_table)."""
    num_reqs = len(seq_lens)
    table = (1 + np.arange(num_reqs * WIDTH, dtype=np.int32)).reshape(num_reqs, WIDTH)
    req = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, query_lens)]).astype(np.int32)
    slots = (table[req, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    common = jsm.CommonAttentionMetadata(
        jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(table), jnp.asarray(slots),
        num_reqs, int(qsl[-1]), int(max(query_lens)), int(max(seq_lens)), tuple(qsl.tolist()),
        tuple(int(s) for s in seq_lens))
    metadata = jsm.FlashInferMLASparseMetadataBuilder(
        num_heads=config.num_heads, block_size=BLOCK_SIZE, topk_tokens=config.index_topk).build(common)
    return metadata, jnp.asarray(positions), slots, table


def empty_cache():
    return empty_layer_cache(TINY, 1 + len(SEQ_LENS) * WIDTH, BLOCK_SIZE).index_cache


def float64_indexer(indexer, x, q_a, positions):
    """The indexer without quantisation, in float64 from the layer's parameters: (q [T, H, 128],
    k [T, 128], weights [T, H] with 128^-0.5 * H^-0.5 folded in)."""
    c = indexer.config
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    x, q_a = f64(x), f64(q_a)
    q = (q_a @ f64(indexer.wq_b.kernel[...])).reshape(len(x), c.index_n_heads, c.index_head_dim)
    k = x @ f64(indexer.wk.kernel[...])
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * f64(indexer.k_norm.scale[...]) + f64(indexer.k_norm.bias[...])
    weights = x @ f64(indexer.weights_proj.kernel[...]) * c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5
    assert c.mscale == c.mscale_all_dim  # RoPE's attention factor is 1
    freq = yarn_frequencies_np(c.qk_rope_head_dim, c.rope_theta, c.rope_factor,
                               c.original_max_position_embeddings, c.beta_fast, c.beta_slow)
    rope = lambda a: np.concatenate([rope_np(a[..., : c.qk_rope_head_dim], np.asarray(positions), freq,
                                             interleaved=False), a[..., c.qk_rope_head_dim:]], -1)
    return rope(q), rope(k), weights


def reference_topk(q, k, weights, seq_lens, query_lens, rows_positions, k_top):
    """float64 top-k rows of the step's tokens: token t of request r at position p scores keys [0, p]
    of its request; keys come in request order (k holds every request's tokens 0..seq_len - 1)."""
    starts = np.concatenate([[0], np.cumsum(seq_lens)])
    out = []
    t = 0
    for r, (s, n) in enumerate(zip(seq_lens, query_lens)):
        keys = k[starts[r]:starts[r] + s]
        for p in rows_positions[t:t + n]:
            scores = (np.maximum(np.einsum("hd,sd->hs", q[t], keys[: p + 1]), 0) * weights[t][:, None]).sum(0)
            out.append(top_k_np(scores, 0, p + 1, k_top))
            t += 1
    return np.stack(out)


def recall(actual, expected):
    """Mean over rows with more candidates than k of |actual ∩ expected| / |expected|."""
    values = [len(np.intersect1d(a[a >= 0], e[e >= 0])) / (e >= 0).sum()
              for a, e in zip(actual, expected) if (e >= 0).sum() == TINY.index_topk]
    return float(np.mean(values)), len(values)


@pytest.fixture(scope="module")
def indexer():
    return Indexer(TINY, rngs=nnx.Rngs(0), implementation="xla")


@pytest.fixture(scope="module")
def inputs():
    total = sum(SEQ_LENS)
    x = jax.random.normal(jax.random.key(1), (total, TINY.hidden_size), jnp.bfloat16)
    q_a = jax.random.normal(jax.random.key(2), (total, TINY.q_lora_rank), jnp.bfloat16)
    return x, q_a


run = jax.jit(lambda module, *args: module(*args))
select = jax.jit(lambda module, *args: module.select(*args))


def test_prefill_and_decode_recall_against_the_float64_indexer(indexer, inputs):
    """All tokens through the prefill path, then the last 2 tokens of each request again as a decode
    step (next_n = 2) over a cache holding the others; both against float64 without quantisation."""
    x, q_a = inputs
    metadata, positions, _, _ = batch_metadata(SEQ_LENS, SEQ_LENS)
    topk, cache = run(indexer, x, q_a, positions, empty_cache(), metadata)
    q, k, weights = float64_indexer(indexer, x, q_a, positions)
    expected = reference_topk(q, k, weights, SEQ_LENS, SEQ_LENS, np.asarray(positions), TINY.index_topk)
    topk = np.asarray(topk)
    assert topk.shape == (sum(SEQ_LENS), TINY.index_topk)
    # Short rows keep every causal key, in order; every row keeps min(p + 1, k) positions.
    short = np.asarray(positions) < TINY.index_topk
    np.testing.assert_array_equal(topk[short], expected[short])
    np.testing.assert_array_equal((topk >= 0).sum(1), np.minimum(np.asarray(positions) + 1, TINY.index_topk))
    prefill_recall, rows = recall(topk, expected)
    print(f"\nprefill top-{TINY.index_topk} recall vs float64 un-quantised: {prefill_recall:.4f} "
          f"over {rows} rows")
    assert prefill_recall > 0.9

    # Decode: the context (all but the last 2 tokens of each request) is cached already.
    context = [s - 2 for s in SEQ_LENS]
    prefix = np.concatenate([np.arange(o, o + n) for o, n in zip(np.cumsum((0,) + SEQ_LENS[:-1]), context)])
    md_prefix, pos_prefix, _, _ = batch_metadata(context, context)
    _, cache = run(indexer, x[prefix], q_a[prefix], pos_prefix, empty_cache(), md_prefix)
    last = np.setdiff1d(np.arange(sum(SEQ_LENS)), prefix)
    md_decode, pos_decode, _, _ = batch_metadata(SEQ_LENS, (2, 2))
    topk_decode, _ = run(indexer, x[last], q_a[last], pos_decode, cache, md_decode)
    np.testing.assert_array_equal(np.asarray(topk_decode), topk[last])  # same tokens, same selection
    decode_recall, _ = recall(np.asarray(topk_decode), expected[last])
    print(f"decode (next_n = 2) recall: {decode_recall:.4f}")
    assert decode_recall > 0.9


def fp8_exact(rng, shape, exponents):
    """bf16 values e4m3 x 2^e: the indexer's power-of-two quantisation reproduces them exactly."""
    values = to_e4m3(rng.standard_normal(shape) * 100).astype(np.float64)
    return (values * 2.0 ** exponents).astype(BF16)


@pytest.mark.parametrize("path", ["prefill", "decode", "mixed", "idle_first"])
def test_lossless_quantisation_gives_the_float64_selection(indexer, path):
    rng = np.random.default_rng(0)
    total, heads = sum(SEQ_LENS), TINY.index_n_heads
    q = fp8_exact(rng, (total, heads, 128), rng.integers(-8, 4, (total, heads, 1)))
    k = fp8_exact(rng, (total, 128), rng.integers(-6, 6, (total, 1)))
    weights = rng.standard_normal((total, heads)).astype(np.float32)
    metadata, positions, slots, _ = batch_metadata(SEQ_LENS, SEQ_LENS)
    cache = empty_cache()
    if path == "prefill":
        rows = np.arange(total)
    elif path == "mixed":  # request 0 decodes its last token while request 1 prefills all of its own
        rows = np.concatenate([[SEQ_LENS[0] - 1], np.arange(SEQ_LENS[0], total)])
        cache = jsm.indexer_k_quant_and_cache(k[: SEQ_LENS[0] - 1], cache, slots[: SEQ_LENS[0] - 1])
        metadata, positions, _, _ = batch_metadata(SEQ_LENS, (1, SEQ_LENS[1]))
        assert (metadata.leading_reqs, metadata.leading_query_len) == (1, 1)
    elif path == "idle_first":  # request 0 brings no tokens (its keys are not gathered), request 1 all
        rows = np.arange(SEQ_LENS[0], total)
        metadata, positions, _, _ = batch_metadata(SEQ_LENS, (0, SEQ_LENS[1]))
        assert (metadata.leading_reqs, metadata.leading_query_len) == (1, 0)
    else:  # write the context's keys, then a decode step of the last 2 tokens of each request
        ends = np.cumsum(SEQ_LENS)
        rows = np.concatenate([[e - 2, e - 1] for e in ends])
        context = np.setdiff1d(np.arange(total), rows)
        cache = jsm.indexer_k_quant_and_cache(k[context], cache, slots[context])
        metadata, positions, _, _ = batch_metadata(SEQ_LENS, (2, 2))
    topk, _ = select(indexer, jnp.asarray(q[rows]), jnp.asarray(k[rows]), jnp.asarray(weights[rows]),
                     positions, cache, metadata)
    folded = weights.astype(np.float64) * 128 ** -0.5 * heads ** -0.5
    expected = reference_topk(q.astype(np.float64), k.astype(np.float64), folded, SEQ_LENS, SEQ_LENS,
                              np.concatenate([np.arange(s) for s in SEQ_LENS]), TINY.index_topk)
    np.testing.assert_array_equal(np.asarray(topk), expected[rows])


def test_hadamard_option(inputs):
    """The Sylvester-ordered Walsh-Hadamard rotation, and the indexer with it: exact scores are
    unchanged by the rotation, so the float64 reference is the same; only fp8 rounding moves."""
    sylvester = np.array([[1.0]])
    while sylvester.shape[0] < 128:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    x = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(hadamard_rotate(jnp.asarray(x))), x @ sylvester.T / np.sqrt(128),
                               atol=1e-5)
    config = TINY.__class__(**{**TINY.__dict__, "index_hadamard": True})
    rotated = Indexer(config, rngs=nnx.Rngs(0), implementation="xla")
    x, q_a = inputs
    n = SEQ_LENS[0]
    metadata, positions, _, _ = batch_metadata((n,), (n,))
    topk, _ = run(rotated, x[:n], q_a[:n], positions, empty_cache(), metadata)
    q, k, weights = float64_indexer(rotated, x[:n], q_a[:n], positions)
    expected = reference_topk(q, k, weights, (n,), (n,), np.asarray(positions), TINY.index_topk)
    hadamard_recall, rows = recall(np.asarray(topk), expected)
    print(f"\nwith the Hadamard rotation: recall {hadamard_recall:.4f} over {rows} rows")
    assert hadamard_recall > 0.9


def _axis_sizes(jaxpr) -> set[int]:
    sizes = set()
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            sizes.update(getattr(var.aval, "shape", ()))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sizes |= _axis_sizes(sub)
    return sizes


def test_mixed_step_gathers_the_prefill_requests_keys_only(indexer, inputs):
    """A decode-first mixed step (request 0 decodes one token, request 1 prefills): the decode token
    goes through the paged logits and the gather holds request 1's keys alone (max_seq_len = 300
    rows), not N = 2 x 300; without the leading-request split the same step gathers all 600. The
    selections are the same."""
    import dataclasses

    x, q_a = inputs
    rows = np.concatenate([[SEQ_LENS[0] - 1], np.arange(SEQ_LENS[0], sum(SEQ_LENS))])
    metadata, positions, _, _ = batch_metadata(SEQ_LENS, (1, SEQ_LENS[1]))
    generic = dataclasses.replace(metadata, leading_reqs=0, leading_query_len=0)
    args = (x[rows], q_a[rows], positions, empty_cache())
    split_sizes = _axis_sizes(jax.make_jaxpr(lambda *a: indexer(*a, metadata))(*args).jaxpr)
    generic_sizes = _axis_sizes(jax.make_jaxpr(lambda *a: indexer(*a, generic))(*args).jaxpr)
    capacity = len(SEQ_LENS) * max(SEQ_LENS)
    assert capacity in generic_sizes and capacity not in split_sizes
    assert max(SEQ_LENS) in split_sizes
    a, cache_a = run(indexer, *args, metadata)
    b, cache_b = run(indexer, *args, generic)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(cache_a), np.asarray(cache_b))


def test_leading_uniform_requests():
    from jax_sparse_mla.ops.metadata import leading_uniform_requests

    assert leading_uniform_requests(np.array([0, 1, 2, 3, 99])) == (3, 1)
    assert leading_uniform_requests(np.array([0, 2, 4, 6])) == (3, 2)
    assert leading_uniform_requests(np.array([0, 7, 8])) == (1, 7)
    assert leading_uniform_requests(np.array([0, 0, 0, 5])) == (2, 0)  # requests without tokens
    assert leading_uniform_requests(np.array([2, 3, 4])) == (0, 0)  # tokens not starting at 0
    assert leading_uniform_requests(np.array([0])) == (0, 0)
    assert leading_uniform_requests(None) == (0, 0)


def test_prefill_chunks_bound_the_logits(inputs):
    """A logits budget of 40 rows x N per chunk: a scan over 13 chunks, the same selection."""
    x, q_a = inputs
    metadata, positions, _, _ = batch_metadata(SEQ_LENS, SEQ_LENS)
    whole = Indexer(TINY, rngs=nnx.Rngs(0), implementation="xla")
    capacity = len(SEQ_LENS) * max(SEQ_LENS)  # num_reqs * min(max_seq_len, W * block_size)
    chunked = Indexer(TINY, rngs=nnx.Rngs(0), implementation="xla", max_logits_bytes=40 * 4 * capacity)
    a, cache_a = run(whole, x, q_a, positions, empty_cache(), metadata)
    b, cache_b = run(chunked, x, q_a, positions, empty_cache(), metadata)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(cache_a), np.asarray(cache_b))


@pytest.mark.parametrize("kv_cache_dtype,kv_shape,kv_dtype", [
    ("auto", (3, 64, 576), jnp.bfloat16), ("fp8", (3, 64, 576), jnp.float8_e4m3fn),
    ("fp8_ds_mla", (3, 64, 656), jnp.uint8)])
def test_layer_cache_layouts(kv_cache_dtype, kv_shape, kv_dtype):
    cache = empty_layer_cache(TINY, 3, 64, kv_cache_dtype)
    assert cache.kv_cache.shape == kv_shape and cache.kv_cache.dtype == kv_dtype
    assert cache.index_cache.shape == (3, 64, 132) and cache.index_cache.dtype == jnp.uint8


def test_indexer_needs_the_ops_head_shape():
    with pytest.raises(ValueError, match="the indexer ops take 32 or 64 heads of 128"):
        Indexer(TINY.__class__(**{**TINY.__dict__, "index_n_heads": 4}), rngs=nnx.Rngs(0))
