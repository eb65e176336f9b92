"""The Flax MLA + DSA layer against dense multi-head MLA attention written here in float64 NumPy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from reference import rope_np, yarn_frequencies_np  # noqa: E402
from jax_sparse_mla.flax import TINY, MLASparseAttention, apply_rope, empty_layer_cache  # noqa: E402

BLOCK_SIZE = 64


def prefill_one_request(layer, num_tokens, seed=0):
    """One request prefilling num_tokens tokens into a fresh cache (blocks 1.. of the table)."""
    width = -(-num_tokens // BLOCK_SIZE)
    block_table = np.arange(1, width + 1, dtype=np.int32)[None]
    positions = np.arange(num_tokens, dtype=np.int32)
    slots = block_table[0, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    common = jsm.CommonAttentionMetadata(
        jnp.asarray([0, num_tokens], jnp.int32), jnp.asarray([num_tokens], jnp.int32),
        jnp.asarray(block_table), jnp.asarray(slots, jnp.int32), 1, num_tokens, num_tokens, num_tokens)
    metadata = jsm.FlashInferMLASparseMetadataBuilder(
        num_heads=TINY.num_heads, block_size=BLOCK_SIZE, topk_tokens=TINY.index_topk).build(common)
    x = jax.random.normal(jax.random.key(seed), (num_tokens, TINY.hidden_size), jnp.bfloat16)
    cache = empty_layer_cache(TINY, width + 1, BLOCK_SIZE)
    y, cache, topk = jax.jit(lambda x, p, c, m: layer(x, p, c, m))(x, jnp.asarray(positions), cache, metadata)
    return x, jnp.asarray(positions), y, cache, np.asarray(topk), slots


def dense_mla_numpy(layer, x, positions, cache, slots, selection):
    """Dense un-absorbed MLA in float64: K_h = [W_UK_h kv_c ; k_pe], V_h = W_UV_h kv_c, softmax over the
    keys in selection[t] (request positions), then wo."""
    c = layer.config
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    q_nope, q_pe, _ = layer.project_query(x, positions)
    q_nope, q_pe = f64(q_nope), f64(q_pe)
    rows = f64(cache.kv_cache).reshape(-1, 576)[slots]  # [S, 576] in position order
    kv_c, k_pe = rows[:, :512], rows[:, 512:]
    w_uk, w_uv = f64(layer.w_uk[...]), f64(layer.w_uv[...])
    heads = np.zeros((x.shape[0], c.num_heads, c.v_head_dim))
    for t, keys in enumerate(selection):
        for h in range(c.num_heads):
            k = np.concatenate([kv_c[keys] @ w_uk[:, h], k_pe[keys]], axis=-1)
            logits = k @ np.concatenate([q_nope[t, h], q_pe[t, h]]) * c.softmax_scale
            p = np.exp(logits - logits.max())
            heads[t, h] = (p / p.sum()) @ (kv_c[keys] @ w_uv[:, h])
    return heads.reshape(x.shape[0], -1) @ f64(layer.wo.kernel[...])


@pytest.fixture(scope="module")
def layer():
    return MLASparseAttention(TINY, rngs=nnx.Rngs(0), implementation="xla")


def relative_error(actual, expected):
    return np.abs(np.asarray(jnp.asarray(actual, jnp.float32), np.float64) - expected).max() / np.abs(expected).max()


def test_topk_covering_the_context_equals_dense_causal_attention(layer):
    num_tokens = 100  # < index_topk = 128: every token keeps all its causal keys
    x, positions, y, cache, topk, slots = prefill_one_request(layer, num_tokens)
    for t in range(num_tokens):
        assert sorted(topk[t][topk[t] >= 0]) == list(range(t + 1))
    expected = dense_mla_numpy(layer, x, positions, cache, slots, [np.arange(t + 1) for t in range(num_tokens)])
    assert relative_error(y, expected) < 1e-2


def test_topk_below_the_context_equals_dense_attention_over_the_selection(layer):
    num_tokens = 200
    x, positions, y, cache, topk, slots = prefill_one_request(layer, num_tokens, seed=1)
    selection = [np.sort(row[row >= 0]) for row in topk]
    assert [len(s) for s in selection] == [min(t + 1, TINY.index_topk) for t in range(num_tokens)]
    assert all(s.max() <= t for t, s in enumerate(selection))
    expected = dense_mla_numpy(layer, x, positions, cache, slots, selection)
    assert relative_error(y, expected) < 1e-2
    # A different selection (the most recent keys) gives a different answer: the check can fail.
    recent = [np.arange(max(0, t + 1 - TINY.index_topk), t + 1) for t in range(num_tokens)]
    assert relative_error(y, dense_mla_numpy(layer, x, positions, cache, slots, recent)) > 1e-2


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_matches_the_yarn_formula(interleaved):
    """Both pairings against their formulas: interleaved is DeepSeek's MLA (complex pairs, vLLM's
    is_neox_style=False), non-interleaved the V3.2 indexer's (NeoX)."""
    x = np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32)
    positions = np.array([0, 5, 1000])
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), TINY,
                                interleaved=interleaved))
    freq = yarn_frequencies_np(64, TINY.rope_theta, TINY.rope_factor, TINY.original_max_position_embeddings,
                               TINY.beta_fast, TINY.beta_slow)
    np.testing.assert_allclose(out, rope_np(x, positions, freq, interleaved=interleaved), atol=5e-4)
    factor = TINY.rope_factor
    assert factor > 1 and TINY.softmax_scale == pytest.approx(
        TINY.qk_head_dim ** -0.5 * (0.1 * math.log(factor) + 1) ** 2)


def test_mla_rope_is_interleaved(layer):
    """The layer's k_pe uses DeepSeek MLA's interleaved pairing (and its q_pe the same function)."""
    x = jax.random.normal(jax.random.key(3), (5, TINY.hidden_size), jnp.bfloat16)
    positions = jnp.asarray([0, 1, 7, 100, 4000], jnp.int32)
    _, k_pe = layer.project_latent_kv(x, positions)
    raw = np.asarray(layer.wkv_a(x).astype(jnp.float32))[:, TINY.kv_lora_rank:]
    freq = yarn_frequencies_np(64, TINY.rope_theta, TINY.rope_factor, TINY.original_max_position_embeddings,
                               TINY.beta_fast, TINY.beta_slow)
    expected = rope_np(raw, np.asarray(positions), freq, interleaved=True)
    np.testing.assert_allclose(np.asarray(k_pe, np.float32), expected, atol=3e-2 * np.abs(expected).max())


def test_shared_indexer_layer_attends_over_the_given_selection(layer):
    """A shared layer with the full layer's attention weights, fed the full layer's top-k, gives the
    full layer's output; it has no indexer and keeps no index cache."""
    shared = MLASparseAttention(TINY, rngs=nnx.Rngs(0), implementation="xla", shared_indexer=True)
    assert shared.indexer is None
    for name in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wo"):
        nnx.update(getattr(shared, name), nnx.state(getattr(layer, name)))
    shared.w_uk[...], shared.w_uv[...] = layer.absorbed_weights()
    num_tokens = 300  # more than top-k 128: the selection matters
    x, positions, y_full, cache_full, topk, slots = prefill_one_request(layer, num_tokens, seed=3)
    width = -(-num_tokens // BLOCK_SIZE)
    cache = empty_layer_cache(TINY, width + 1, BLOCK_SIZE, shared_indexer=True)
    assert cache.index_cache is None
    common = jsm.CommonAttentionMetadata(
        jnp.asarray([0, num_tokens], jnp.int32), jnp.asarray([num_tokens], jnp.int32),
        jnp.asarray(np.arange(1, width + 1, dtype=np.int32)[None]), jnp.asarray(slots, jnp.int32), 1,
        num_tokens, num_tokens, num_tokens)
    metadata = jsm.FlashInferMLASparseMetadataBuilder(
        num_heads=TINY.num_heads, block_size=BLOCK_SIZE, topk_tokens=TINY.index_topk).build(common)
    y, new_cache, topk_out = jax.jit(lambda *a: shared(*a))(x, positions, cache, metadata,
                                                          jnp.asarray(topk))
    assert new_cache.index_cache is None
    np.testing.assert_array_equal(np.asarray(topk_out), topk)
    np.testing.assert_array_equal(np.asarray(new_cache.kv_cache), np.asarray(cache_full.kv_cache))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_full, np.float32))
    # And against dense attention over that selection, independently of the full layer.
    selection = [row[row >= 0] for row in topk]
    expected = dense_mla_numpy(shared, x, positions, new_cache, slots, selection)
    assert relative_error(y, expected) < 2e-2


def test_shared_indexer_layer_needs_a_selection_and_a_full_one_refuses_one(layer):
    shared = MLASparseAttention(TINY, rngs=nnx.Rngs(0), implementation="xla", shared_indexer=True)
    x = jnp.zeros((4, TINY.hidden_size), jnp.bfloat16)
    positions = jnp.arange(4, dtype=jnp.int32)
    cache = empty_layer_cache(TINY, 2, BLOCK_SIZE, shared_indexer=True)
    with pytest.raises(ValueError, match="pass that layer's topk_indices"):
        shared(x, positions, cache, None)
    with pytest.raises(ValueError, match="topk_indices must be None"):
        layer(x, positions, empty_layer_cache(TINY, 2, BLOCK_SIZE), None,
              jnp.zeros((4, TINY.index_topk), jnp.int32))
    with pytest.raises(TypeError, match="shared_indexer"):
        MLASparseAttention(TINY, rngs=nnx.Rngs(0), shared_indexer="yes")
