"""Chunked prefill at DeepSeek-V3.2's layer shapes on the GPU: examples/generate.py's decoder (2 layers,
128 heads, top-k 2048) prefills a 2600-token prompt in chunks of 1100 (they cut the 64-row blocks;
the prompt is longer than top-k, so the indexer selects) with the native kernels ("auto") and with pure
JAX ("xla"), over a bf16 and an fp8_ds_mla cache: the same selections on nearly every key and the same
logits within the bf16 floor. Chunks of 1100 tokens take the fp8_ds_mla cache through the bf16
workspace (ops/ds_mla_workspace.py, from 1024 tokens). A mixed step (two requests decode a token
each while a third prefills a chunk, vLLM's decode-first order) selects with the native kernels as the
same tokens do as a decode step and a chunk step apart, and as pure JAX does. The CPU tests of the
same loops: tests/flax/test_prefill.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("flax")

from jax_sparse_mla.flax import DEEPSEEK_V32  # noqa: E402
from decoder_example import assert_logits_close, build, chunk_logits, prefill_all  # noqa: E402
from decoder_example import example as load_example  # noqa: E402
from requirements import gpu_test_marks, sm90_skip_reason  # noqa: E402

pytestmark = gpu_test_marks(sm90_skip_reason(), "the prefill GPU tests")

PROMPT, CHUNK = 2600, 1100
DECODE_CONTEXTS = (2300, 2500)  # the mixed step's decoding requests, both past top-k


@functools.cache
def prefilled(implementation: str, kv_cache_dtype: str):
    prompt = np.random.default_rng(0).integers(0, 512, PROMPT).astype(np.int32)
    graphdef, state, layout, caches = build(DEEPSEEK_V32, 1, PROMPT, implementation=implementation,
                                            kv_cache_dtype=kv_cache_dtype)
    logits, topks, _ = prefill_all(DEEPSEEK_V32, graphdef, state, layout, caches, prompt, 0, CHUNK)
    return np.asarray(logits), [np.asarray(t) for t in topks]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla"])
def test_chunked_prefill_native_matches_pure_jax(kv_cache_dtype):
    logits, topks = prefilled("auto", kv_cache_dtype)
    logits_ref, topks_ref = prefilled("xla", kv_cache_dtype)
    assert not np.isnan(logits).any()
    counts = (topks[0] >= 0).sum(-1)
    np.testing.assert_array_equal(counts, np.minimum(np.arange(PROMPT) + 1, DEEPSEEK_V32.index_topk))
    for layer, reference in zip(topks, topks_ref):
        # Ascending positions, -1 padded: compare the sets row by row.
        overlap = np.mean([len(np.intersect1d(a[a >= 0], b[b >= 0])) / max((b >= 0).sum(), 1)
                           for a, b in zip(layer, reference)])
        assert overlap > 0.99, overlap
    assert_logits_close(logits, logits_ref, rtol=3e-2)


def test_fp8_ds_mla_chunks_take_the_bf16_workspace():
    """The chunks above are prefill-sized: on this GPU auto runs them through the bf16 workspace."""
    import jax
    import jax.numpy as jnp

    from jax_sparse_mla.ops.ds_mla_workspace import use_bf16_workspace

    blocks = -(-PROMPT // 64)
    cache = jax.ShapeDtypeStruct((1 + blocks, 64, 656), jnp.uint8)
    table = jax.ShapeDtypeStruct((1, blocks), jnp.int32)
    assert use_bf16_workspace(cache, table, num_tokens=CHUNK, num_heads=DEEPSEEK_V32.num_heads,
                              topk=DEEPSEEK_V32.index_topk, q_dtype=jnp.bfloat16,
                              implementation="auto")


@functools.cache
def mixed_and_apart(implementation: str):
    """Requests 0 and 1 (contexts of 2300 and 2500 tokens, past top-k) decode one token each while
    request 2 prefills its second chunk of 1100: (top-k per layer and logits of the mixed step, of the
    decode step apart and of the chunk step apart), over the same caches."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    example = load_example()
    rng = np.random.default_rng(1)
    graphdef, state, layout, caches = build(DEEPSEEK_V32, 3, PROMPT, implementation=implementation)
    prompts = [rng.integers(0, 512, n).astype(np.int32) for n in (*DECODE_CONTEXTS, PROMPT)]
    for request in (0, 1):
        *_, caches = prefill_all(DEEPSEEK_V32, graphdef, state, layout, caches, prompts[request],
                                 request, CHUNK)
    *_, caches = chunk_logits(DEEPSEEK_V32, graphdef, state, layout, caches, prompts[2], 2, 0, CHUNK,
                              CHUNK)
    decode_tokens = jnp.asarray(rng.integers(0, 512, 2), jnp.int32)
    decode_positions = jnp.asarray(DECODE_CONTEXTS, jnp.int32)
    chunk_positions = jnp.arange(CHUNK, 2 * CHUNK, dtype=jnp.int32)
    run = jax.jit(lambda state, tokens, positions, caches, metadata: nnx.merge(graphdef, state)(
        tokens, positions, caches, metadata))
    positions = jnp.concatenate([decode_positions, chunk_positions])
    mixed = example.step_metadata(layout, DEEPSEEK_V32, jnp.asarray([0, 1] + [2] * CHUNK, jnp.int32),
                                  positions, [1, 1, CHUNK])
    assert (mixed.leading_reqs, mixed.leading_query_len) == (2, 1)
    tokens = jnp.concatenate([decode_tokens, jnp.asarray(prompts[2][CHUNK:2 * CHUNK])])
    mixed_logits, _, mixed_topks = run(state, tokens, positions, caches, mixed)
    decode = example.step_metadata(layout, DEEPSEEK_V32, jnp.asarray([0, 1], jnp.int32),
                                   decode_positions, [1, 1, 0])
    decode_logits, apart, decode_topks = run(state, decode_tokens, decode_positions, caches, decode)
    chunk_out, chunk_topks, _ = chunk_logits(DEEPSEEK_V32, graphdef, state, layout, apart, prompts[2],
                                             2, CHUNK, CHUNK, CHUNK)
    as_numpy = lambda topks: [np.asarray(t) for t in topks]
    return ((as_numpy(mixed_topks), np.asarray(mixed_logits)),
            (as_numpy(decode_topks), np.asarray(decode_logits)),
            (as_numpy(chunk_topks), np.asarray(chunk_out)))


def selection_overlap(topks, reference) -> float:
    """The smallest share, over rows, of a reference row's selected positions that `topks` also
    selects (rows ascending, -1 padded)."""
    return min(len(np.intersect1d(a[a >= 0], b[b >= 0])) / max((b >= 0).sum(), 1)
               for a, b in zip(topks, reference))


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| over the whole array, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def test_mixed_step_selects_as_decode_and_chunk_apart():
    """Layer 0's selection depends on the embeddings alone: the mixed step's decode rows select what
    the decode step selects and its chunk rows what the chunk step selects (the decode tokens through
    the paged logits, the chunk over its own request's keys in both). Not bit for bit: the
    projections are GEMMs over 1102 tokens in one step and 2 or 1100 in the others, which cuBLAS
    rounds differently, so a near tie at the 2048th score can fall either way (on an H100 one position
    of a decode row did); every row keeps 99% of its positions. The logits agree within 3%: the same
    rounding moves the decode rows' logits by 0.8% in pure JAX on a CPU (3 of 2048 positions of
    layer 1's selection flipped), by 1.7% with the native kernels on an H100; a row routed wrong
    (another request's context, the chunk's keys) moves them by their whole size. The chunk rows
    (GEMMs over 1102 and 1100 tokens) agree within 1%, and did on the H100."""
    (mixed_topks, mixed_logits), (decode_topks, decode_logits), (chunk_topks, chunk_logits_apart) = (
        mixed_and_apart("auto"))
    assert selection_overlap(mixed_topks[0][:2], decode_topks[0]) > 0.99
    assert selection_overlap(mixed_topks[0][2:], chunk_topks[0]) > 0.99
    assert relative_error(mixed_logits[:2], decode_logits) < 3e-2
    assert relative_error(mixed_logits[2:], chunk_logits_apart) < 1e-2


def test_mixed_step_native_matches_pure_jax():
    """The native kernels against pure JAX on the same mixed step, each after its own prefills: the
    caches differ by what each implementation wrote, so the logits are compared as a whole (on an
    H100 some value of the 1102 x 512 missed an elementwise bound of 3% of the largest logit); the
    selections nearly everywhere the same."""
    (topks, logits), *_ = mixed_and_apart("auto")
    (topks_ref, logits_ref), *_ = mixed_and_apart("xla")
    for layer, reference in zip(topks, topks_ref):
        overlap = np.mean([len(np.intersect1d(a[a >= 0], b[b >= 0])) / max((b >= 0).sum(), 1)
                           for a, b in zip(layer, reference)])
        assert overlap > 0.99, overlap
    assert relative_error(logits, logits_ref) < 5e-2
