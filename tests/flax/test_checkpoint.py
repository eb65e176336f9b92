"""load_attention_weights: Hugging Face safetensors (bf16 and block-fp8) into MLASparseAttention."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from flax import nnx  # noqa: E402

from jax_sparse_mla.flax import TINY, MLASparseAttention, load_attention_weights  # noqa: E402

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
# hidden_size 320 is no multiple of 128, so the fp8 tests have partial last blocks in the columns of
# q_a_proj, kv_a_proj_with_mqa, wk and weights_proj and in the rows of o_proj; kv_a_proj_with_mqa's
# 576 rows end in a partial block too.
CONFIG = dataclasses.replace(TINY, hidden_size=320)

# Written out here rather than taken from the module, so that a wrong name or target there fails:
# HF name after the prefix -> (the nnx parameter's path, whether it is a Linear weight [out, in]).
# kv_b_proj is held per head as two parameters, w_uk and w_uv ("w_uk|w_uv": see `value`).
EXPECTED = {
    "q_a_proj.weight": ("wq_a.kernel", True),
    "q_a_layernorm.weight": ("q_norm.scale", False),
    "q_b_proj.weight": ("wq_b.kernel", True),
    "kv_a_proj_with_mqa.weight": ("wkv_a.kernel", True),
    "kv_a_layernorm.weight": ("kv_norm.scale", False),
    "kv_b_proj.weight": ("w_uk|w_uv", True),
    "o_proj.weight": ("wo.kernel", True),
    "indexer.wq_b.weight": ("indexer.wq_b.kernel", True),
    "indexer.wk.weight": ("indexer.wk.kernel", True),
    "indexer.k_norm.weight": ("indexer.k_norm.scale", False),
    "indexer.k_norm.bias": ("indexer.k_norm.bias", False),
    "indexer.weights_proj.weight": ("indexer.weights_proj.kernel", True),
}
# The Linear weights a block-fp8 release quantises (weights_proj stays bf16, as in GLM-5-FP8).
QUANTISED = [name for name, (_, linear) in EXPECTED.items()
             if linear and name != "indexer.weights_proj.weight"]


def hf_shapes(c):
    """The checkpoint shapes, from the config (torch Linear weights are [out, in])."""
    return {
        "q_a_proj.weight": (c.q_lora_rank, c.hidden_size),
        "q_a_layernorm.weight": (c.q_lora_rank,),
        "q_b_proj.weight": (c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
        "kv_a_layernorm.weight": (c.kv_lora_rank,),
        "kv_b_proj.weight": (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        "o_proj.weight": (c.hidden_size, c.num_heads * c.v_head_dim),
        "indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        "indexer.wk.weight": (c.index_head_dim, c.hidden_size),
        "indexer.k_norm.weight": (c.index_head_dim,),
        "indexer.k_norm.bias": (c.index_head_dim,),
        "indexer.weights_proj.weight": (c.index_n_heads, c.hidden_size),
    }


def prefix(layer_index):
    return f"model.layers.{layer_index}.self_attn."


def random_layer_tensors(layer_index, seed):
    """HF tensors of one layer: bf16 as the releases store them, the k_norm pair in float32."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for suffix, shape in hf_shapes(CONFIG).items():
        value = rng.normal(size=shape).astype(np.float32) * (0.1 if len(shape) == 2 else 1.0)
        tensors[prefix(layer_index) + suffix] = value if "k_norm" in suffix else value.astype(BF16)
    return tensors


def checkpoint_tensors():
    """Layers 0 and 1 with different values (so loading the wrong layer fails), plus a non-attention
    tensor as a real checkpoint has."""
    tensors = {**random_layer_tensors(0, seed=0), **random_layer_tensors(1, seed=1)}
    tensors["model.embed_tokens.weight"] = np.ones((8, CONFIG.hidden_size), BF16)
    return tensors


def new_layer():
    return MLASparseAttention(CONFIG, rngs=nnx.Rngs(0), implementation="xla")


def param(layer, path):
    node = layer
    for attribute in path.split("."):
        node = getattr(node, attribute)
    return node


def value(layer, path):
    """The parameter at `path`; for "w_uk|w_uv" the [kv_lora_rank, H (qk_nope + v_head)] kernel that
    a Linear kv_b_proj would have: per head, W_UK's columns then W_UV's."""
    if path == "w_uk|w_uv":
        w_uk, w_uv = layer.w_uk[...], layer.w_uv[...]
        return jnp.concatenate([w_uk, w_uv], -1).reshape(w_uk.shape[0], -1)
    return param(layer, path)[...]


def as_f32(array):
    return np.asarray(jnp.asarray(array, jnp.float32))


def save_sharded(folder, tensors, shards):
    """tensors split over the named shard files, with a model.safetensors.index.json."""
    weight_map = {}
    for shard, names in shards.items():
        safetensors_numpy.save_file({name: tensors[name] for name in names}, folder / shard)
        weight_map.update({name: shard for name in names})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def assert_loaded_exactly(layer, expected_hf):
    """Every parameter equals its HF tensor (Linear weights transposed) cast to the param's dtype."""
    for suffix, (path, linear) in EXPECTED.items():
        loaded = value(layer, path)
        source = np.asarray(expected_hf[suffix])
        source = source.T if linear else source
        assert loaded.shape == source.shape, path
        np.testing.assert_array_equal(as_f32(loaded), source.astype(loaded.dtype).astype(np.float32),
                                      err_msg=path)


@pytest.mark.parametrize("given", ["folder", "file"])
def test_single_file_loads_every_param_exactly(tmp_path, given):
    tensors = checkpoint_tensors()
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    layer = new_layer()
    load_attention_weights(layer, tmp_path if given == "folder" else tmp_path / "model.safetensors", 1)
    assert_loaded_exactly(layer, {s: tensors[prefix(1) + s] for s in EXPECTED})
    # The dtypes stay the layer's: bf16, and float32 for the indexer's k_norm and weights_proj.
    assert param(layer, "wq_b.kernel")[...].dtype == jnp.bfloat16
    assert param(layer, "indexer.weights_proj.kernel")[...].dtype == jnp.float32
    assert param(layer, "indexer.k_norm.bias")[...].dtype == jnp.float32


def test_sharded_checkpoint_opens_only_the_shards_it_needs(tmp_path):
    tensors = checkpoint_tensors()
    names = sorted(tensors)
    layer2 = prefix(1)
    # Layer 1 is split over two shards; layer 0 and the embedding live in a third, which is not a
    # valid safetensors file: opening it would raise.
    first = [n for n in names if n.startswith(layer2) and ("indexer" in n or "q_" in n)]
    second = [n for n in names if n.startswith(layer2) and n not in first]
    third = [n for n in names if not n.startswith(layer2)]
    assert first and second and third
    save_sharded(tmp_path, tensors, {"model-00001-of-00003.safetensors": first,
                                     "model-00002-of-00003.safetensors": second,
                                     "model-00003-of-00003.safetensors": third})
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"not a safetensors file")
    layer = new_layer()
    load_attention_weights(layer, tmp_path, 1)
    assert_loaded_exactly(layer, {s: tensors[layer2 + s] for s in EXPECTED})


def test_custom_prefix(tmp_path):
    tensors = {name.replace("model.layers.0.self_attn.", "model.mtp.0.attn."): value
               for name, value in random_layer_tensors(0, seed=3).items()}
    safetensors_numpy.save_file(tensors, tmp_path / "w.safetensors")
    layer = new_layer()
    load_attention_weights(layer, tmp_path / "w.safetensors", 0, prefix="model.mtp.{layer_index}.attn.")
    assert_loaded_exactly(layer, {s: tensors["model.mtp.0.attn." + s] for s in EXPECTED})


def quantise_blocks(weight, block):
    """weight float32 [out, in] -> (e4m3 [out, in], float32 scale_inv [ceil(out/b0), ceil(in/b1)]),
    each block scaled by its own amax / 448 times a random factor, so the blocks' scales differ."""
    rows, cols = weight.shape
    b0, b1 = block
    scale = np.zeros((-(-rows // b0), -(-cols // b1)), np.float32)
    quantised = np.zeros(weight.shape, E4M3)
    rng = np.random.default_rng(rows * cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            scale[i, j] = np.abs(tile).max() / 448.0 * rng.uniform(1.0, 4.0)
            quantised[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (tile / scale[i, j]).astype(E4M3)
    return quantised, scale


def dequantise_reference(quantised, scale, block):
    """Element by element: w[r, c] = q[r, c] * scale[r // b0, c // b1], in float64."""
    rows, cols = quantised.shape
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return quantised.astype(np.float64) * scale.astype(np.float64)[r // block[0], c // block[1]]


@pytest.mark.parametrize("block", [None, (64, 96)])
def test_fp8_weights_are_dequantised_by_block(tmp_path, block):
    """block None: no config.json, the default 128 x 128; else config.json's weight_block_size."""
    tensors = random_layer_tensors(0, seed=4)
    used_block = block or (128, 128)
    expected = {s: tensors[prefix(0) + s] for s in EXPECTED}
    for suffix in QUANTISED:
        name = prefix(0) + suffix
        quantised, scale = quantise_blocks(np.asarray(tensors[name], np.float32), used_block)
        tensors[name], tensors[name + "_scale_inv"] = quantised, scale
        expected[suffix] = dequantise_reference(quantised, scale, used_block).astype(np.float32)
    if block is not None:
        (tmp_path / "config.json").write_text(json.dumps(
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}))
    # Some shapes must end in partial blocks, or the ceil / edge handling is not exercised.
    assert any(dim % b for s in QUANTISED for dim, b in zip(hf_shapes(CONFIG)[s], used_block))
    names = sorted(tensors)
    save_sharded(tmp_path, tensors, {"model-00001-of-00002.safetensors": names[::2],
                                     "model-00002-of-00002.safetensors": names[1::2]})
    layer = new_layer()
    load_attention_weights(layer, tmp_path, 0)
    assert_loaded_exactly(layer, expected)
    # Ignoring the scales would load something else.
    raw = np.asarray(tensors[prefix(0) + "kv_a_proj_with_mqa.weight"], np.float32).T
    assert not np.allclose(as_f32(layer.wkv_a.kernel[...]), raw)


def test_loaded_layer_computes_the_checkpoint_projections(tmp_path):
    """The layer's projections equal the HF module's, evaluated here from the source weights in
    NumPy (x @ W.T, outputs viewed as transformers views them): a transpose or a reordering of
    q_b_proj's [H, nope | rope], kv_a_proj_with_mqa's [kv_c | k_pe] or kv_b_proj's [H, nope | v]
    rows that the layer does not expect would fail here."""
    c = CONFIG
    tensors = random_layer_tensors(0, seed=5)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    layer = new_layer()
    load_attention_weights(layer, tmp_path, 0)
    w = {s: np.asarray(tensors[prefix(0) + s], np.float64) for s in EXPECTED}
    tokens = 5
    x = jax.random.normal(jax.random.key(0), (tokens, c.hidden_size), jnp.bfloat16)
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)

    def rms_norm(v, weight):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_norm_eps) * weight

    def close(actual, expected, tolerance=2e-2):
        error = np.abs(as_f32(actual) - expected).max() / np.abs(expected).max()
        assert error < tolerance, error

    close(layer.wq_a(x), x64 @ w["q_a_proj.weight"].T)
    q_resid = rms_norm(x64 @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])
    q = (q_resid @ w["q_b_proj.weight"].T).reshape(tokens, c.num_heads, c.qk_head_dim)
    q_nope, _, q_a = layer.project_query(x, jnp.zeros(tokens, jnp.int32))
    close(q_a, q_resid)
    close(q_nope, q[..., : c.qk_nope_head_dim])
    # At position 0 RoPE is the identity (up to the YaRN attention factor, 1 for TINY's mscales).
    _, q_pe, _ = layer.project_query(x, jnp.zeros(tokens, jnp.int32))
    close(q_pe, q[..., c.qk_nope_head_dim:])

    latent = x64 @ w["kv_a_proj_with_mqa.weight"].T
    kv_c, k_pe = layer.project_latent_kv(x, jnp.zeros(tokens, jnp.int32))
    close(kv_c, rms_norm(latent[:, : c.kv_lora_rank], w["kv_a_layernorm.weight"]))
    close(k_pe, latent[:, c.kv_lora_rank:])

    # kv_b_proj's output per head h is [k_nope (qk_nope) | v (v_head)].
    kv_b = w["kv_b_proj.weight"].reshape(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = layer.absorbed_weights()
    close(w_uk, kv_b[:, : c.qk_nope_head_dim].transpose(2, 0, 1), 1e-6)
    close(w_uv, kv_b[:, c.qk_nope_head_dim:].transpose(2, 0, 1), 1e-6)

    heads = jax.random.normal(jax.random.key(1), (tokens, c.num_heads * c.v_head_dim), jnp.bfloat16)
    close(layer.wo(heads), np.asarray(jnp.asarray(heads, jnp.float32), np.float64) @ w["o_proj.weight"].T)

    q_index, k_index, weights = layer.indexer.project(x, jnp.asarray(q_resid, jnp.bfloat16),
                                                      jnp.zeros(tokens, jnp.int32))
    expected_q = (q_resid @ w["indexer.wq_b.weight"].T).reshape(tokens, c.index_n_heads, c.index_head_dim)
    close(q_index, expected_q)
    k = x64 @ w["indexer.wk.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    close(k_index, k * w["indexer.k_norm.weight"] + w["indexer.k_norm.bias"])
    close(weights, x64 @ w["indexer.weights_proj.weight"].T)


@pytest.mark.parametrize("sharded", [False, True])
def test_missing_tensor_names_it_and_the_file(tmp_path, sharded):
    tensors = random_layer_tensors(0, seed=6)
    missing = prefix(0) + "indexer.wk.weight"
    del tensors[missing]
    names = sorted(tensors)
    if sharded:
        save_sharded(tmp_path, tensors, {"a.safetensors": names[:5], "b.safetensors": names[5:]})
        looked_in = "model.safetensors.index.json"
    else:
        safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
        looked_in = "model.safetensors"
    with pytest.raises(KeyError, match=rf"{missing}.*{tmp_path}.*{looked_in}"):
        load_attention_weights(new_layer(), tmp_path, 0)


def test_wrong_shape_names_the_tensor_and_leaves_the_layer_unchanged(tmp_path):
    tensors = random_layer_tensors(0, seed=7)
    name = prefix(0) + "kv_b_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # [in, out]: a transpose too many
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    layer = new_layer()
    before = {path: as_f32(value(layer, path)) for path, _ in EXPECTED.values()}
    shape, expected = tensors[name].shape, tensors[name].shape[::-1]
    with pytest.raises(ValueError, match=rf"{name}.*{shape}.*expected {expected}".replace("(", r"\(")
                       .replace(")", r"\)")):
        load_attention_weights(layer, tmp_path, 0)
    # Every other tensor was read fine, yet nothing was set.
    for path, unchanged in before.items():
        np.testing.assert_array_equal(as_f32(value(layer, path)), unchanged, err_msg=path)


def test_wrong_norm_shape(tmp_path):
    tensors = random_layer_tensors(0, seed=8)
    name = prefix(0) + "indexer.k_norm.bias"
    tensors[name] = np.zeros(CONFIG.index_head_dim + 1, np.float32)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}.*\(129,\).*expected \(128,\)"):
        load_attention_weights(new_layer(), tmp_path, 0)


def test_fp8_weight_without_its_scale(tmp_path):
    tensors = random_layer_tensors(0, seed=9)
    name = prefix(0) + "q_b_proj.weight"
    tensors[name], _ = quantise_blocks(np.asarray(tensors[name], np.float32), (128, 128))
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=rf"{name}_scale_inv.*{tmp_path}"):
        load_attention_weights(new_layer(), tmp_path, 0)


def test_fp8_scale_of_the_wrong_shape(tmp_path):
    tensors = random_layer_tensors(0, seed=10)
    name = prefix(0) + "kv_a_proj_with_mqa.weight"  # [576, 320]: 5 x 3 blocks of 128
    tensors[name], scale = quantise_blocks(np.asarray(tensors[name], np.float32), (128, 128))
    tensors[name + "_scale_inv"] = scale[:4]  # floor instead of ceil
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}_scale_inv.*\(4, 3\).*expected \(5, 3\)"):
        load_attention_weights(new_layer(), tmp_path, 0)


def test_linear_bias_is_rejected(tmp_path):
    tensors = random_layer_tensors(0, seed=11)
    tensors[prefix(0) + "o_proj.bias"] = np.zeros(CONFIG.hidden_size, BF16)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"o_proj\.bias"):
        load_attention_weights(new_layer(), tmp_path, 0)


def test_missing_checkpoint_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_attention_weights(new_layer(), tmp_path, 0)


def test_without_safetensors_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # makes `import safetensors` fail
    with pytest.raises(ImportError, match=r'pip install "jax-sparse-mla\[flax\]"'):
        load_attention_weights(new_layer(), tmp_path, 0)


@pytest.mark.parametrize("with_indexer_tensors", [True, False])
def test_shared_indexer_layer_reads_no_indexer_tensors(tmp_path, with_indexer_tensors):
    """A layer without an indexer (shared_indexer=True) loads the rest, whether or not the checkpoint
    has indexer tensors for it."""
    tensors = random_layer_tensors(0, seed=12)
    if not with_indexer_tensors:
        tensors = {name: value for name, value in tensors.items() if ".indexer." not in name}
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    layer = MLASparseAttention(CONFIG, rngs=nnx.Rngs(0), implementation="xla", shared_indexer=True)
    load_attention_weights(layer, tmp_path, 0)
    for suffix, (path, linear) in EXPECTED.items():
        if suffix.startswith("indexer."):
            continue
        source = np.asarray(tensors[prefix(0) + suffix])
        np.testing.assert_array_equal(as_f32(value(layer, path)),
                                      (source.T if linear else source).astype(np.float32), err_msg=path)
