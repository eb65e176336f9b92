"""Chunked prefill through examples/generate.py's decoder (the tiny preset, pure JAX on the CPU):

- a prompt longer than index_topk prefilled in chunks that cut blocks gives the same selections, the
  same caches and, within the bf16 floor, the same logits as the prompt in one step;
- a mixed step, as vLLM schedules it (decode tokens of other requests first, then a prefill chunk),
  gives what the same tokens give as a decode step and a chunk step apart;
- the chunk step's memory is bounded by the chunk and the cache, not the prompt: no intermediate has a
  prompt-sized axis, and XLA's temporary buffers grow linearly with the cache, not quadratically.

The same decoder on the GPU, native kernels against pure JAX at DeepSeek-V3.2's shapes:
tests/kernels/test_prefill_gpu.py.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_sparse_mla.flax import TINY  # noqa: E402

from decoder_example import VOCAB, assert_logits_close, build, chunk_logits, prefill_all  # noqa: E402
from decoder_example import example as load_example  # noqa: E402


@pytest.fixture(scope="module")
def example():
    return load_example()


# 300 tokens > index_topk = 128, so the indexer really selects; chunks of 80 and 112 cut the 64-row
# blocks, and the last chunk of each is padded.
@pytest.mark.parametrize("chunk", [80, 112])
def test_chunked_prefill_equals_one_step(example, chunk):
    prompt = np.random.default_rng(0).integers(0, VOCAB, 300).astype(np.int32)
    graphdef, state, layout, caches = build(TINY, 2, 320)
    whole_logits, whole_topks, whole_caches = prefill_all(TINY, graphdef, state, layout, caches,
                                                          prompt, 1, len(prompt))
    logits, topks, chunked_caches = prefill_all(TINY, graphdef, state, layout, caches, prompt, 1,
                                                chunk)
    assert whole_topks[0].shape == (300, TINY.index_topk)
    selected = np.asarray((whole_topks[0] >= 0).sum(-1))
    np.testing.assert_array_equal(selected, np.minimum(np.arange(300) + 1, TINY.index_topk))
    # Layer 0's selection depends on the embeddings alone: exactly the same. Deeper layers see the
    # first layer's bf16 output, computed over other shapes; they agree on nearly every key.
    np.testing.assert_array_equal(np.asarray(topks[0]), np.asarray(whole_topks[0]))
    for layer, whole in zip(topks[1:], whole_topks[1:]):
        assert np.mean(np.asarray(layer) == np.asarray(whole)) > 0.99
    assert_logits_close(logits, whole_logits)
    # Layer 0's cache rows are the embeddings' projections: the same bits. Deeper layers' rows within
    # the bf16 floor.
    for name in ("kv_cache", "index_cache"):
        np.testing.assert_array_equal(np.asarray(getattr(chunked_caches[0], name)),
                                      np.asarray(getattr(whole_caches[0], name)))
    for cache, whole in zip(chunked_caches[1:], whole_caches[1:]):
        assert_logits_close(cache.kv_cache.astype(jnp.float32), whole.kv_cache.astype(jnp.float32))


def test_mixed_step_equals_decode_and_chunk_apart(example):
    """Requests 0 and 1 decode one token each while request 2's prompt is in its second chunk: one
    step (decode tokens first, vLLM's order) against a decode step and a chunk step."""
    rng = np.random.default_rng(1)
    graphdef, state, layout, caches = build(TINY, 3, 400)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (150, 200, 300)]
    for request in (0, 1):
        *_, caches = prefill_all(TINY, graphdef, state, layout, caches, prompts[request], request, 96)
    *_, caches = chunk_logits(TINY, graphdef, state, layout, caches, prompts[2], 2, 0, 96, 96)
    decode_tokens = jnp.asarray(rng.integers(0, VOCAB, 2), jnp.int32)
    decode_positions = jnp.asarray([150, 200], jnp.int32)
    chunk_tokens = jnp.asarray(prompts[2][96:192])
    chunk_positions = jnp.arange(96, 192, dtype=jnp.int32)
    run = jax.jit(lambda state, tokens, positions, caches, metadata: nnx.merge(graphdef, state)(
        tokens, positions, caches, metadata))

    mixed = example.step_metadata(layout, TINY, jnp.asarray([0, 1] + [2] * 96, jnp.int32),
                                  jnp.concatenate([decode_positions, chunk_positions]), [1, 1, 96])
    mixed_logits, mixed_caches, mixed_topks = run(
        state, jnp.concatenate([decode_tokens, chunk_tokens]),
        jnp.concatenate([decode_positions, chunk_positions]), caches, mixed)

    decode = example.step_metadata(layout, TINY, jnp.asarray([0, 1], jnp.int32), decode_positions,
                                   [1, 1, 0])
    decode_logits, apart_caches, decode_topks = run(state, decode_tokens, decode_positions, caches,
                                                    decode)
    chunk_out, chunk_topks, apart_caches = chunk_logits(TINY, graphdef, state, layout, apart_caches,
                                                        prompts[2], 2, 96, 96, 96)
    np.testing.assert_array_equal(np.asarray(mixed_topks[0][:2]), np.asarray(decode_topks[0]))
    np.testing.assert_array_equal(np.asarray(mixed_topks[0][2:]), np.asarray(chunk_topks[0]))
    assert_logits_close(mixed_logits[:2], decode_logits)
    assert_logits_close(mixed_logits[2:], chunk_out)
    np.testing.assert_array_equal(np.asarray(mixed_caches[0].kv_cache),
                                  np.asarray(apart_caches[0].kv_cache))
    np.testing.assert_array_equal(np.asarray(mixed_caches[0].index_cache),
                                  np.asarray(apart_caches[0].index_cache))


def _intermediate_shapes(jaxpr) -> list[tuple[int, ...]]:
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _intermediate_shapes(sub)
    return shapes


def _prefill_step_memory(example, prompt_len: int, chunk: int):
    graphdef, state, layout, caches = build(TINY, 1, prompt_len + 1)
    step = example.make_prefill_step(graphdef, layout, TINY, chunk)
    args = (state, jnp.zeros(chunk, jnp.int32), np.int32(0), np.int32(0), np.int32(chunk), caches)
    jaxpr = jax.make_jaxpr(step)(*args)
    temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return _intermediate_shapes(jaxpr.jaxpr), temp, layout.num_blocks * example.BLOCK_SIZE


def test_chunk_step_memory_is_bounded_by_the_chunk_and_the_cache(example):
    """A 4000-token prompt's chunk step: no intermediate has an axis of the prompt's length or two
    cache-sized axes (no [prompt, prompt] scores, no [prompt, H, 576] query), and XLA's temporary
    buffers grow with the cache linearly (the gathered index keys, the chunk's logits rows), not as its
    square."""
    shapes, temp_long, capacity = _prefill_step_memory(example, 4000, 128)
    assert not any(4000 in shape for shape in shapes)
    assert not any(sum(d >= capacity for d in shape) >= 2 for shape in shapes)
    assert max(int(np.prod(shape)) for shape in shapes) <= 128 * capacity * TINY.index_n_heads
    _, temp_short, capacity_short = _prefill_step_memory(example, 1000, 128)
    assert capacity / capacity_short > 3.5
    assert temp_long <= 1.2 * temp_short * capacity / capacity_short
