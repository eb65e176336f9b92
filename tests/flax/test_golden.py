"""Our Flax layer against `transformers`' DeepSeek-V3.2 and GLM-5 attention layers, on golden data that
tests/golden/make_golden.py wrote with torch and transformers (neither is needed here): a random
checkpoint in Hugging Face naming, read through MLAConfig.from_hf_config and load_attention_weights,
and the reference layer's outputs and selections for one causal sequence of 292 tokens, run here as
a prefill of 256, an extend of 32 and 4 decode steps over the paged caches.

- float32 math: the layer's projections, norms, RoPE and weight absorption, with attention over the
  reference's selection computed here in float64: within 1e-5 of the reference.
- the bf16 layer (pure JAX), attending over the reference's selection (shared_indexer=True):
  within 6e-3 per step, the bf16 floor on this data (measured 4.1e-3 to 5.6e-3; 2.9e-3 to 4.8e-3
  with float32 parameters, the rest being the bf16 queries, cache rows and outputs that the
  kernels' contract takes).
- the layer's own fp8 indexer against the reference's unquantised one: mean top-k overlap >= 0.98.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("safetensors")
from flax import nnx  # noqa: E402

from jax_sparse_mla.flax import MLAConfig, MLASparseAttention, apply_rope, empty_layer_cache  # noqa: E402
from jax_sparse_mla.flax import load_attention_weights  # noqa: E402
from test_flax_indexer import BLOCK_SIZE, WIDTH, batch_metadata  # noqa: E402

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# (first, end) token of each step: a prefill, an extend, four decodes.
STEPS = ((0, 256), (256, 288), (288, 289), (289, 290), (290, 291), (291, 292))


def golden(model_type: str, *, shared_indexer: bool, dtype=jnp.bfloat16, **config_changes):
    folder = GOLDEN / model_type
    config = dataclasses.replace(MLAConfig.from_hf_config(folder), **config_changes)
    layer = MLASparseAttention(config, rngs=nnx.Rngs(0), dtype=dtype, implementation="xla",
                               shared_indexer=shared_indexer)
    load_attention_weights(layer, folder, 0)
    return layer, dict(np.load(folder / "reference.npz"))


def reference_selection(topk: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The reference's top-k rows [T, k] in our form: positions past the token (its -inf fillers)
    dropped, the rest ascending, -1 after."""
    out = np.full_like(topk, -1)
    for row, (keys, position) in enumerate(zip(topk, positions)):
        keys = np.sort(keys[keys <= position])
        out[row, : len(keys)] = keys
    return out


def relative_error(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def run_steps(layer, ref, selection=None):
    """The layer over STEPS with its own caches: (y [N, hidden] f32, topk [N, k] int32)."""
    config = layer.config
    cache = empty_layer_cache(config, 1 + WIDTH, BLOCK_SIZE, shared_indexer=layer.indexer is None)
    call = jax.jit(lambda *args: layer(*args))
    ys, topks = [], []
    for first, end in STEPS:
        metadata, positions, _, _ = batch_metadata([end], [end - first], config)
        x = jnp.asarray(ref["x"][first:end], jnp.bfloat16)
        given = None if selection is None else jnp.asarray(selection[first:end])
        y, cache, topk = call(x, positions, cache, metadata, given)
        ys.append(np.asarray(jnp.asarray(y, jnp.float32)))
        topks.append(np.asarray(topk))
    return np.concatenate(ys), np.concatenate(topks)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_float32_math_matches_the_reference(model_type):
    # transformers builds q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever the config says
    # (GLM-5's says 1e-5, which vLLM and SGLang use and from_hf_config reads): match its builder here.
    layer, ref = golden(model_type, shared_indexer=True, dtype=jnp.float32, rms_norm_eps=1e-6)
    c = layer.config
    x = jnp.asarray(ref["x"])
    positions = jnp.arange(len(x), dtype=jnp.int32)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    q_nope, q_pe, _ = layer.project_query(x, positions)
    kv_a = layer.wkv_a(x)
    kv_c = f64(layer.kv_norm(kv_a[:, : c.kv_lora_rank]))
    k_pe = f64(apply_rope(kv_a[:, c.kv_lora_rank:], positions, c))
    w_uk, w_uv = (f64(w) for w in layer.absorbed_weights())
    absorbed = np.einsum("thp,lhp->thl", f64(q_nope), w_uk)  # the query in the latent space
    logits = (np.einsum("thl,sl->ths", absorbed, kv_c)
              + np.einsum("thr,sr->ths", f64(q_pe), k_pe)) * c.softmax_scale
    selection = reference_selection(ref["topk"], np.arange(len(x)))
    selected = np.zeros((len(x), len(x)), bool)
    for t, keys in enumerate(selection):
        selected[t, keys[keys >= 0]] = True
    logits = np.where(selected[:, None, :], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    latent = np.einsum("ths,sl->thl", p / p.sum(-1, keepdims=True), kv_c)
    heads = np.einsum("thl,lhv->thv", latent, w_uv).reshape(len(x), -1)
    y = heads @ f64(layer.wo.kernel[...])
    error = relative_error(y, ref["y"].astype(np.float64))
    assert error < 1e-5, error


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_bf16_layer_over_the_reference_selection(model_type):
    layer, ref = golden(model_type, shared_indexer=True)
    selection = reference_selection(ref["topk"], np.arange(len(ref["x"])))
    y, topk = run_steps(layer, ref, selection)
    np.testing.assert_array_equal(topk, selection)
    for first, end in STEPS:
        assert relative_error(y[first:end], ref["y"][first:end].astype(np.float64)) < 6e-3, (first, end)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fp8_indexer_selects_what_the_reference_selects(model_type):
    layer, ref = golden(model_type, shared_indexer=False)
    _, topk = run_steps(layer, ref)
    k = layer.config.index_topk
    rows = range(k, len(topk))  # rows that see more than k keys: a real choice
    overlap = [len(np.intersect1d(topk[t], ref["topk"][t])) / k for t in rows]
    assert np.mean(overlap) >= 0.98, np.mean(overlap)
    # Rows with at most k visible keys select all of them, on both sides.
    for t in range(k):
        np.testing.assert_array_equal(topk[t][: t + 1], np.arange(t + 1))
