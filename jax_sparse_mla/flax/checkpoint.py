"""Loading one attention layer's parameters from a Hugging Face safetensors checkpoint into
`MLASparseAttention` (needs `safetensors`: pip install "jax-sparse-mla[flax]").

DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) checkpoints name the tensors of layer i's
attention alike, under `model.layers.{i}.self_attn.`; bf16 checkpoints and block-fp8 ones (a
float8_e4m3fn weight with a float32 `weight_scale_inv` per block) load the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .layers import MLASparseAttention

INSTALL_HINT = 'pip install "jax-sparse-mla[flax]"'
DEFAULT_PREFIX = "model.layers.{layer_index}.self_attn."
# DeepSeek-V3 / V3.2's fp8 release (and GLM-5-FP8) quantise in 128 x 128 blocks; a config.json beside
# the weights may say otherwise (quantization_config.weight_block_size).
DEFAULT_WEIGHT_BLOCK_SIZE = (128, 128)

# Hugging Face name (after the prefix) -> the nnx.Param's attribute path in MLASparseAttention.
# A torch Linear keeps `weight` as [out, in], nnx.Linear its `kernel` as [in, out]: these are
# transposed, and are the tensors a block-fp8 checkpoint may quantise. The output rows are already
# in the order the layer reshapes them (as transformers' modeling_deepseek_v32 / glm_moe_dsa view
# them): q_b_proj [H, qk_nope | qk_rope], kv_a_proj_with_mqa [kv_c (kv_lora_rank) | k_pe (qk_rope)],
# indexer.wq_b [index_n_heads, index_head_dim], so no permutation.
LINEAR_WEIGHTS: dict[str, tuple[str, ...]] = {
    "q_a_proj.weight": ("wq_a", "kernel"),
    "q_b_proj.weight": ("wq_b", "kernel"),
    "kv_a_proj_with_mqa.weight": ("wkv_a", "kernel"),
    "o_proj.weight": ("wo", "kernel"),
    "indexer.wq_b.weight": ("indexer", "wq_b", "kernel"),
    "indexer.wk.weight": ("indexer", "wk", "kernel"),
    "indexer.weights_proj.weight": ("indexer", "weights_proj", "kernel"),
}
# kv_b_proj [H (qk_nope + v_head), kv_lora_rank], per head its k_nope rows then its v rows (as
# transformers views it), is the one Linear weight stored per head: split into the layer's
# w_uk [kv_lora_rank, H, qk_nope] and w_uv [kv_lora_rank, H, v_head] (vLLM's W_UK and W_UV).
KV_B_PROJ = "kv_b_proj.weight"
# Norm parameters: vectors, copied as stored (never quantised).
VECTORS: dict[str, tuple[str, ...]] = {
    "q_a_layernorm.weight": ("q_norm", "scale"),
    "kv_a_layernorm.weight": ("kv_norm", "scale"),
    "indexer.k_norm.weight": ("indexer", "k_norm", "scale"),
    "indexer.k_norm.bias": ("indexer", "k_norm", "bias"),
}

# Dtypes that safe_open(framework="numpy") returns (BF16 as ml_dtypes.bfloat16, which this
# module's import of ml_dtypes registers with numpy).
_NUMPY_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_FP8_DTYPE = "F8_E4M3"


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError("Loading checkpoint weights needs the `safetensors` package: "
                          f"{INSTALL_HINT}") from error
    return safe_open


class _Checkpoint:
    """A checkpoint's safetensors file(s): a single file, a folder with `model.safetensors`, or a
    folder with `model.safetensors.index.json` and its shards. A shard is opened the first time one
    of its tensors is needed, so loading one layer touches only the shards that hold it."""

    def __init__(self, checkpoint: str | os.PathLike, stack: contextlib.ExitStack) -> None:
        self._safe_open = _safe_open()
        self._stack = stack
        self._handles: dict[str, Any] = {}
        path = os.fspath(checkpoint)
        single = os.path.join(path, "model.safetensors")
        index = os.path.join(path, "model.safetensors.index.json")
        self._weight_map: dict[str, str] | None = None
        if os.path.isfile(path):
            self.folder, self.listing = os.path.dirname(path), path
        elif os.path.isfile(single):  # transformers' order too: the single file before an index
            self.folder, self.listing = path, single
        elif os.path.isfile(index):
            self.folder, self.listing = path, index
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object.")
            self._weight_map = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        else:
            raise FileNotFoundError(f"{path} is neither a .safetensors file nor a folder holding "
                                    "model.safetensors or model.safetensors.index.json.")

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(self._safe_open(file, framework="numpy"))
        return self._handles[file]

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """Every tensor name the checkpoint lists (the index's weight_map, or the single file's)."""
        if self._weight_map is not None:
            return frozenset(self._weight_map)
        return frozenset(self._handle(self.listing).keys())

    @functools.cached_property
    def block_size(self) -> tuple[int, int]:
        """The fp8 block size; config.json is read at most once, and only for an fp8 checkpoint."""
        return weight_block_size(self.folder)

    def file_of(self, name: str) -> str:
        """The file holding `name`; KeyError naming the tensor and where it was looked for."""
        if self._weight_map is None:
            if name not in self.names:
                raise KeyError(f"tensor {name!r} is not in {self.listing}")
            return self.listing
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the weight_map of {self.listing}")
        file = self._weight_map[name]
        if name not in self._handle(file).keys():
            raise KeyError(f"tensor {name!r} is not in {file}, the shard that {self.listing} "
                           "names for it")
        return file

    def info(self, name: str) -> tuple[str, tuple[int, ...], str]:
        """(safetensors dtype string such as "BF16" or "F8_E4M3", shape, file), from the header."""
        file = self.file_of(name)
        view = self._handle(file).get_slice(name)
        return view.get_dtype(), tuple(view.get_shape()), file

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored: a float numpy array, or ml_dtypes.float8_e4m3fn for F8_E4M3."""
        dtype, shape, file = self.info(name)
        if dtype in _NUMPY_FLOAT_DTYPES:
            return np.asarray(self._handle(file).get_tensor(name))
        if dtype == _FP8_DTYPE:
            return _read_raw(file, name, shape, np.dtype(ml_dtypes.float8_e4m3fn))
        raise ValueError(f"{name} in {file} is {dtype}; the loader reads {_NUMPY_FLOAT_DTYPES} and "
                         f"{_FP8_DTYPE} (block-scaled with weight_scale_inv).")


def _read_raw(file: str, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """One tensor's bytes, found through the file's header.

    safetensors hands F8_E4M3 to every framework but torch as `<framework module>.float8_e4m3fn`,
    which numpy lacks (safetensors issue #682), so safe_open(framework="numpy" or "flax") cannot
    return it. The format is simple: an 8-byte little-endian header length, a JSON header giving
    each tensor's [begin, end) byte offsets from the end of the header, then the data.
    """
    with open(file, "rb") as f:
        (header_length,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(header_length))[name]["data_offsets"]
        f.seek(8 + header_length + begin)
        data = f.read(end - begin)
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{name} in {file}: {len(data)} bytes for shape {shape} of {dtype}.")
    return np.frombuffer(data, dtype).reshape(shape)


def weight_block_size(folder: str) -> tuple[int, int]:
    """quantization_config.weight_block_size of the config.json in `folder`, else (128, 128)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return DEFAULT_WEIGHT_BLOCK_SIZE
    with open(path) as f:
        quantization = json.load(f).get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if block is None:
        return DEFAULT_WEIGHT_BLOCK_SIZE
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        raise ValueError(f"{path}: quantization_config.weight_block_size must be two positive "
                         f"integers, got {block!r}.")
    return int(block[0]), int(block[1])


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block_size: tuple[int, int]) -> np.ndarray:
    """weight float8_e4m3fn [out, in], scale_inv [ceil(out / b0), ceil(in / b1)] -> float32 [out, in]
    with w[r, c] * scale_inv[r // b0, c // b1] (the last row and column of blocks may be partial)."""
    rows, cols = weight.shape
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), block_size[0], axis=0),
                       block_size[1], axis=1)[:rows, :cols]
    return weight.astype(np.float32) * scales


def _param(layer: MLASparseAttention, path: tuple[str, ...]):
    node: Any = layer
    for attribute in path:
        node = getattr(node, attribute)
    return node


def _linear_weight(source: _Checkpoint, name: str, expected: tuple[int, ...]) -> np.ndarray:
    """`name` as a float array [out, in] (fp8 dequantised in float32), its shape checked."""
    dtype, shape, file = source.info(name)
    if shape != expected:
        raise ValueError(f"{name} in {file} has shape {shape}, expected {expected} ([out, in]).")
    weight = source.read(name)
    if dtype != _FP8_DTYPE:
        # A scale beside an unquantised weight is left alone, as vLLM does: only fp8 is scaled.
        return weight
    scale_name = name + "_scale_inv"
    if scale_name not in source.names:
        raise KeyError(f"{name} is float8_e4m3fn but its scale {scale_name!r} is not in "
                       f"{source.listing}")
    b0, b1 = source.block_size
    scale_dtype, scale_shape, scale_file = source.info(scale_name)
    expected_scale = (-(-expected[0] // b0), -(-expected[1] // b1))
    if scale_shape != expected_scale:
        raise ValueError(f"{scale_name} in {scale_file} has shape {scale_shape}, expected "
                         f"{expected_scale} (blocks of {b0} x {b1} over {expected}).")
    if scale_dtype not in _NUMPY_FLOAT_DTYPES:
        raise ValueError(f"{scale_name} in {scale_file} is {scale_dtype}; block scales must be "
                         f"one of {_NUMPY_FLOAT_DTYPES}.")
    return dequantize_fp8_blocks(weight, source.read(scale_name), (b0, b1))


def load_attention_weights(layer: MLASparseAttention, checkpoint: str | os.PathLike, layer_index: int,
                           *, prefix: str = DEFAULT_PREFIX) -> None:
    """Sets `layer`'s parameters, in place, from layer `layer_index` of a Hugging Face checkpoint.

    checkpoint: a folder holding `model.safetensors`, or shards with `model.safetensors.index.json`
      (only the shards that hold this layer's tensors are opened), or one `.safetensors` file.
    prefix: the layer's tensor-name prefix; `{layer_index}` is filled in.

    Tensors read, with c the layer's MLAConfig (torch Linear weights are [out, in]):
      q_a_proj.weight [q_lora_rank, D] -> wq_a.kernel [D, q_lora_rank]
      q_a_layernorm.weight [q_lora_rank] -> q_norm.scale
      q_b_proj.weight [H (qk_nope + qk_rope), q_lora_rank] -> wq_b.kernel (transposed)
      kv_a_proj_with_mqa.weight [kv_lora_rank + qk_rope, D] -> wkv_a.kernel (transposed)
      kv_a_layernorm.weight [kv_lora_rank] -> kv_norm.scale
      kv_b_proj.weight [H (qk_nope + v_head), kv_lora_rank] -> w_uk [kv_lora_rank, H, qk_nope] and
        w_uv [kv_lora_rank, H, v_head] (each head's first qk_nope rows, then its v_head rows)
      o_proj.weight [D, H v_head] -> wo.kernel (transposed)
      indexer.wq_b.weight [index_n_heads index_head_dim, q_lora_rank] -> indexer.wq_b.kernel (transposed)
      indexer.wk.weight [index_head_dim, D] -> indexer.wk.kernel (transposed)
      indexer.k_norm.weight, indexer.k_norm.bias [index_head_dim] -> indexer.k_norm.scale, .bias
      indexer.weights_proj.weight [index_n_heads, D] -> indexer.weights_proj.kernel (transposed)
    Stored dtypes F32 / F16 / BF16 / F64 are cast to each parameter's dtype (bf16 for the layer's
    `dtype`, float32 for indexer.k_norm and indexer.weights_proj). A Linear weight stored as
    float8_e4m3fn needs `<name>_scale_inv` [ceil(out / b0), ceil(in / b1)] (float32, or bf16 / f16)
    and is dequantised as w[r, c] * scale_inv[r // b0, c // b1] in float32, then cast; (b0, b1) is
    quantization_config.weight_block_size of a config.json beside the weights, else (128, 128).

    Raises KeyError for a missing tensor or fp8 scale (naming it and the file or index looked in),
    ValueError for a wrong shape (naming the tensor, its shape and the expected one), an unsupported
    dtype, or Linear biases the layer does not have; ImportError without `safetensors`. Every tensor
    is read and checked before any parameter is set, so a failed load leaves the layer unchanged.
    Parameters keep their sharding (the new values are placed like the old ones). A layer built
    with shared_indexer=True has no indexer: the indexer.* tensors are then neither needed nor read.
    """
    prefix = prefix.format(layer_index=layer_index)
    values: dict[tuple[str, ...], np.ndarray] = {}
    with contextlib.ExitStack() as stack:
        source = _Checkpoint(checkpoint, stack)
        # Our Linears have no bias (DeepSeek-V3.2 and GLM-5 have attention_bias false); a
        # checkpoint with biases would load wrong silently if they were skipped.
        biases = sorted(name for name in (prefix + suffix.removesuffix("weight") + "bias"
                                          for suffix in (*LINEAR_WEIGHTS, KV_B_PROJ))
                        if name in source.names)
        if biases:
            raise ValueError(f"{source.listing} has Linear biases {biases}, which MLASparseAttention "
                             "does not have (attention_bias must be false).")
        # A shared-indexer layer (MLASparseAttention(shared_indexer=True), GLM-5.2's "shared" layers)
        # has no indexer: its indexer tensors, if the checkpoint has any, are not read.
        has_indexer = layer.indexer is not None
        for suffix, path in LINEAR_WEIGHTS.items():
            if path[0] == "indexer" and not has_indexer:
                continue
            kernel = _param(layer, path)[...]
            weight = _linear_weight(source, prefix + suffix, tuple(kernel.shape[::-1]))
            values[path] = weight.astype(kernel.dtype).T
        w_uk, w_uv = layer.w_uk[...], layer.w_uv[...]
        kv_lora_rank, num_heads, qk_nope = w_uk.shape
        weight = _linear_weight(source, prefix + KV_B_PROJ,
                                (num_heads * (qk_nope + w_uv.shape[-1]), kv_lora_rank))
        per_head = weight.reshape(num_heads, -1, kv_lora_rank).transpose(2, 0, 1)
        values[("w_uk",)] = per_head[..., :qk_nope].astype(w_uk.dtype)
        values[("w_uv",)] = per_head[..., qk_nope:].astype(w_uv.dtype)
        for suffix, path in VECTORS.items():
            if path[0] == "indexer" and not has_indexer:
                continue
            name = prefix + suffix
            vector = _param(layer, path)[...]
            dtype, shape, file = source.info(name)
            if shape != tuple(vector.shape):
                raise ValueError(f"{name} in {file} has shape {shape}, expected {tuple(vector.shape)}.")
            if dtype not in _NUMPY_FLOAT_DTYPES:
                raise ValueError(f"{name} in {file} is {dtype}; norm parameters are read unquantised "
                                 f"({_NUMPY_FLOAT_DTYPES}).")
            values[path] = source.read(name).astype(vector.dtype)
    for path, value in values.items():
        param = _param(layer, path)
        param[...] = jax.device_put(value, param[...].sharding)
