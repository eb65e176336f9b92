"""examples/generate.py's decoder as the prefill tests drive it: the example loaded as a module, a
decoder with empty caches, and prompts run through it chunk by chunk with every token's logits kept."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"
VOCAB = 512


@functools.cache
def example():
    spec = importlib.util.spec_from_file_location("generate_example_decoder", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the example's dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def build(config, batch: int, max_len: int, layers: int = 2, *, implementation: str = "xla",
          kv_cache_dtype: str = "auto"):
    """(graphdef, state, layout, caches) of the example's decoder with `layers` layers of `config`,
    room for `batch` requests of max_len tokens, empty caches."""
    from flax import nnx
    from jax_sparse_mla.flax import empty_layer_cache

    ex = example()
    model = ex.Decoder(config, layers, VOCAB, rngs=nnx.Rngs(0), kv_cache_dtype=kv_cache_dtype,
                       implementation=implementation)
    layout = ex.PagedLayout(batch, -(-max_len // ex.BLOCK_SIZE))
    caches = tuple(empty_layer_cache(config, layout.num_blocks, ex.BLOCK_SIZE, kv_cache_dtype)
                   for _ in range(layers))
    graphdef, state = nnx.split(model)
    return graphdef, state, layout, caches


@functools.cache
def _chunk_step(config, graphdef, layout, chunk: int):
    """The example's chunk forward pass, jitted once per decoder and chunk size."""
    return jax.jit(example().chunk_forward(graphdef, layout, config, chunk))


def chunk_logits(config, graphdef, state, layout, caches, prompt, request, start, num_real, chunk):
    """One chunk through the model: (logits [num_real, vocab], top-k per layer [num_real, k], caches)."""
    tokens = np.zeros(chunk, np.int32)
    tokens[:num_real] = prompt[start:start + num_real]
    logits, caches, topks = _chunk_step(config, graphdef, layout, chunk)(
        state, jnp.asarray(tokens), np.int32(request), np.int32(start), np.int32(num_real), caches)
    return logits[:num_real], [t[:num_real] for t in topks], caches


def prefill_all(config, graphdef, state, layout, caches, prompt, request, chunk):
    """The whole prompt in chunks of `chunk`: (logits [P, vocab], top-k per layer [P, k], caches)."""
    logits, topks = [], []
    for start in range(0, len(prompt), chunk):
        num_real = min(chunk, len(prompt) - start)
        out, tk, caches = chunk_logits(config, graphdef, state, layout, caches, prompt, request, start,
                                       num_real, chunk)
        logits.append(out)
        topks.append(tk)
    return jnp.concatenate(logits), [jnp.concatenate(layer) for layer in zip(*topks)], caches


def assert_logits_close(actual, expected, rtol: float = 2e-2):
    """max |actual - expected| <= rtol * max |expected| (the bf16 floor of a decoder's outputs)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.abs(actual - expected).max() <= rtol * np.abs(expected).max()
