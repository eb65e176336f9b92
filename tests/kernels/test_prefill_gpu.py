"""Chunked prefill at DeepSeek-V3.2's layer shapes on the GPU: examples/generate.py's decoder (2 layers,
128 heads, top-k 2048) prefills a 2600-token prompt in chunks of 1100 (they cut the 64-row blocks;
the prompt is longer than top-k, so the indexer selects) with the native kernels ("auto") and with pure
JAX ("xla"), over a bf16 and an fp8_ds_mla cache: the same selections on nearly every key and the same
logits within the bf16 floor. Chunks of 1100 tokens take the fp8_ds_mla cache through the bf16
workspace (ops/ds_mla_workspace.py, from 1024 tokens). The CPU tests of the same loop:
tests/flax/test_prefill.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("flax")

from jax_sparse_mla.flax import DEEPSEEK_V32  # noqa: E402
from decoder_example import assert_logits_close, build, prefill_all  # noqa: E402
from requirements import gpu_test_marks, sm90_skip_reason  # noqa: E402

pytestmark = gpu_test_marks(sm90_skip_reason(), "the prefill GPU tests")

PROMPT, CHUNK = 2600, 1100


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
