"""Backend classes and FlashInferMLASparseImpl, mirroring vLLM's FlashInfer sparse-MLA backend.

The classes keep vLLM's names, capability rules and `supports_combination` messages so that code written
against vLLM's backend selection ports over. The impl's forward_mqa converts request-local top-k indices
to physical slots, folds the fp8 scales and calls the kernel that the registry picks for the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from . import _validation as v
from .kernels import registry
from .ops.attention import sparse_mla_decode
from .ops.ds_mla_workspace import bf16_workspace, use_bf16_workspace
from .ops.index_conversion import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .ops.metadata import FlashInferMLASparseMetadata, FlashInferMLASparseMetadataBuilder

DECODER = "decoder"
_Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)


class DeviceCapability(NamedTuple):
    major: int
    minor: int


def _model_attr(model_config: Any, name: str, default: Any = None) -> Any:
    """Reads a model-config attribute from an object or a dict (vLLM reads hf_text_config)."""
    if isinstance(model_config, dict):
        return model_config.get(name, default)
    return getattr(model_config, name, default)


def _has_model_attr(model_config: Any, name: str) -> bool:
    return name in model_config if isinstance(model_config, dict) else hasattr(model_config, name)


def _check_capability(name: str, capability) -> DeviceCapability:
    """A DeviceCapability(major, minor) of ints (a plain tuple is refused: it says nothing of which
    number is which)."""
    if not isinstance(capability, DeviceCapability):
        raise TypeError(f"{name} must be a DeviceCapability(major, minor), got "
                        f"{type(capability).__name__}: {v._short(capability)}.")
    v.check_int(f"{name}.major", capability.major, minimum=0)
    v.check_int(f"{name}.minor", capability.minor, minimum=0)
    return capability


def _check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size,
                               cache_dtype_str) -> tuple[int, int, int]:
    num_blocks = v.check_int("num_blocks", num_blocks, minimum=1)
    block_size = v.check_int("block_size", block_size, minimum=1)
    v.check_int("num_kv_heads", num_kv_heads, minimum=1)
    head_size = v.check_int("head_size", head_size, minimum=1)
    if not isinstance(cache_dtype_str, str):
        raise TypeError(f"cache_dtype_str must be a string, got {type(cache_dtype_str).__name__}: "
                        f"{v._short(cache_dtype_str)}.")
    if cache_dtype_str not in v.KV_CACHE_DTYPES:
        raise ValueError(f"cache_dtype_str must be one of {v.KV_CACHE_DTYPES}, got "
                         f"{cache_dtype_str!r}.")
    return num_blocks, block_size, head_size


def _check_dtype_arg(name: str, dtype):
    """A dtype-like (jnp.bfloat16, "bfloat16", np.dtype): TypeError for anything else."""
    if dtype is None or isinstance(dtype, bool):
        raise TypeError(f"{name} must be a dtype, got {dtype!r}.")
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a dtype, got {type(dtype).__name__}: "
                        f"{v._short(dtype)}.") from None


def _check_topk_buffer(name: str, buffer):
    """A topk_indices_buffer: None, or an int32 [T_max, K] array with K >= 1."""
    if buffer is None:
        return None
    buffer = v.int32_array(name, buffer, 2)
    v.check_nonempty_axes(name, buffer, {1: "index per token (K)"})
    return buffer


def _native_kernel_available(capability_major: int, kv_layout: str) -> bool:
    return any(
        k.native and capability_major in k.capability_majors and kv_layout in k.kv_layouts
        and k.available()
        for k in registry.registered_kernels()
    )


class _FlashInferMLASparseBackendBase:
    """What every FlashInfer sparse-MLA backend shares."""

    supported_dtypes: ClassVar[tuple] = ()
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA_SPARSE"

    @staticmethod
    def get_builder_cls() -> type[FlashInferMLASparseMetadataBuilder]:
        return FlashInferMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["FlashInferMLASparseImpl"]:
        return FlashInferMLASparseImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [v.MLA_HEAD_DIM]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """(num_blocks, block_size, head_size). Sizes must be ints >= 1 and cache_dtype_str one of
        KV_CACHE_DTYPES (ValueError / TypeError naming the argument otherwise)."""
        num_blocks, block_size, head_size = _check_kv_cache_shape_args(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
        return (num_blocks, block_size, head_size)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        raise NotImplementedError

    @classmethod
    def get_required_kv_cache_layout(cls) -> str | None:
        return None

    @classmethod
    def supports_combination(cls, head_size: int, dtype, kv_cache_dtype: str | None,
                             block_size: int | None, use_mla: bool, has_sink: bool,
                             use_sparse: bool, use_mm_prefix: bool,
                             device_capability: DeviceCapability,
                             model_config: Any = None) -> str | None:
        """None when the combination is supported, else the reason (vLLM's messages).

        Folds in vLLM's `validate_configuration` checks, with its messages, for what the backend
        class declares: "head_size not supported" (only 576), "dtype not supported"
        (supported_dtypes: fp16/bf16 for TRTLLM, bf16 for SM120/SM90; never float32), "block_size
        not supported" (get_supported_kernel_block_sizes; None skips it), "non-MLA not supported",
        "sink setting not supported", "non-sparse not supported", "partial multimodal token full
        attention not supported" and "compute capability not supported"; then the backend's own
        reasons, then "kv_cache_dtype not supported" (supported_kv_cache_dtypes; None = "auto").
        Arguments of the wrong type raise TypeError naming them (device_capability must be a
        DeviceCapability; head_size and block_size ints; the flags bools; kv_cache_dtype a string or
        None); an unknown kv_cache_dtype string raises ValueError.

        model_config: the model's HF text config (object or dict) for the qk_nope_head_dim and
        index_topk checks; None skips them, as vLLM does without a model config.
        """
        head_size = v.check_int("head_size", head_size)
        dtype = _check_dtype_arg("dtype", dtype)
        if kv_cache_dtype is not None:
            if not isinstance(kv_cache_dtype, str):
                raise TypeError(f"kv_cache_dtype must be a string or None, got "
                                f"{type(kv_cache_dtype).__name__}: {v._short(kv_cache_dtype)}.")
            v.check_kv_cache_dtype(kv_cache_dtype)
        if block_size is not None:
            block_size = v.check_int("block_size", block_size)
        use_mla = v.check_bool("use_mla", use_mla)
        has_sink = v.check_bool("has_sink", has_sink)
        use_sparse = v.check_bool("use_sparse", use_sparse)
        use_mm_prefix = v.check_bool("use_mm_prefix", use_mm_prefix)
        device_capability = _check_capability("device_capability", device_capability)
        if head_size not in cls.get_supported_head_sizes():
            return "head_size not supported"
        if dtype not in tuple(jnp.dtype(d) for d in cls.supported_dtypes):
            return "dtype not supported"
        if block_size is not None and block_size not in cls.get_supported_kernel_block_sizes():
            return "block_size not supported"
        if not use_mla:
            return "non-MLA not supported"
        if has_sink:
            return "sink setting not supported"
        if not use_sparse:
            return "non-sparse not supported"
        if use_mm_prefix:
            return "partial multimodal token full attention not supported"
        if not cls.supports_compute_capability(device_capability):
            return "compute capability not supported"
        reason = cls._unsupported_reason(dtype, kv_cache_dtype, model_config)
        if reason is not None:
            return reason
        if kv_cache_dtype is not None and kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            return "kv_cache_dtype not supported"
        return None

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        raise NotImplementedError

    @classmethod
    def _unsupported_reason(cls, dtype, kv_cache_dtype: str | None, model_config: Any) -> str | None:
        raise NotImplementedError


class FlashInferMLASparseTRTLLMBackend(_FlashInferMLASparseBackendBase):
    """SM100/SM103: FlashInfer's TRTLLM-gen sparse MLA kernel (the seed's backend)."""

    supported_dtypes = (jnp.float16, jnp.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [32, 64]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return _check_capability("capability", capability).major == 10

    @classmethod
    def _unsupported_reason(cls, dtype, kv_cache_dtype: str | None, model_config: Any) -> str | None:
        if kv_cache_dtype == "fp8_ds_mla":
            return "FLASHINFER_MLA_SPARSE SM10 does not support fp8_ds_mla kv-cache dtype"
        if model_config is not None:
            qk_nope_head_dim = _model_attr(model_config, "qk_nope_head_dim", 1)
            if qk_nope_head_dim not in [128, 192]:
                return (
                    "FlashInfer MLA Sparse kernel requires qk_nope_head_dim "
                    f"in [128, 192], but got {qk_nope_head_dim}"
                )
            if not _has_model_attr(model_config, "index_topk"):
                return "FlashInfer MLA Sparse requires model with index_topk config"
        return None

    @classmethod
    def get_required_kv_cache_layout(cls) -> str | None:
        return "HND"


class FlashInferMLASparseSM120Backend(_FlashInferMLASparseBackendBase):
    """SM120/SM121: FlashInfer's sparse_mla_sm120 kernels over packed fp8_ds_mla rows."""

    supported_dtypes = (jnp.bfloat16,)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA_SPARSE_SM120"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [64, 256]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return _check_capability("capability", capability).major == 12

    @classmethod
    def _unsupported_reason(cls, dtype, kv_cache_dtype: str | None, model_config: Any) -> str | None:
        if not _native_kernel_available(12, "fp8_ds_mla"):
            return "FLASHINFER_MLA_SPARSE_SM120 requires FlashInfer's sparse MLA decode API"
        if jnp.dtype(dtype) != jnp.bfloat16:
            return "dtype not supported"
        if kv_cache_dtype not in (None, "auto", "fp8", "fp8_e4m3", "fp8_ds_mla"):
            return "kv_cache_dtype not supported"
        if model_config is not None:
            index_topk = _model_attr(model_config, "index_topk")
            if index_topk is None:
                return "FLASHINFER_MLA_SPARSE_SM120 requires a model with index_topk config"
            if int(index_topk) != 2048:
                return f"FLASHINFER_MLA_SPARSE_SM120 requires index_topk=2048; got {index_topk}"
        return None

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        num_blocks, block_size, head_size = _check_kv_cache_shape_args(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
        if cache_dtype_str in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"):
            return (num_blocks, block_size, v.DS_MLA_ROW_BYTES)
        return (num_blocks, block_size, head_size)


class FlashInferMLASparseSM90Backend(_FlashInferMLASparseBackendBase):
    """SM90 (H100/H200): FlashInfer's Hopper MLA kernel used as a top-k kernel (page_size = 1) for bf16
    caches, and our own fp8 kernels (sm90_fp8.py) for per-tensor e4m3 and fp8_ds_mla caches.

    Not in vLLM's target era; modelled on vLLM 0.34's FLASHINFER_MLA_SPARSE_SM90. bf16 query.
    """

    supported_dtypes = (jnp.bfloat16,)
    supported_kv_cache_dtypes = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA_SPARSE_SM90"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [32, 64]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return _check_capability("capability", capability).major == 9

    @classmethod
    def _unsupported_reason(cls, dtype, kv_cache_dtype: str | None, model_config: Any) -> str | None:
        if jnp.dtype(dtype) != jnp.bfloat16:
            return "dtype not supported"
        if kv_cache_dtype == "fp8_ds_mla":
            layout = "fp8_ds_mla"
        else:
            layout = "fp8_e4m3" if kv_cache_dtype in v.FP8_PER_TENSOR_DTYPES else "bfloat16"
        if not _native_kernel_available(9, layout):
            return "FLASHINFER_MLA_SPARSE_SM90 requires the jax_sparse_mla native extension"
        if model_config is not None and not _has_model_attr(model_config, "index_topk"):
            return "FlashInfer MLA Sparse requires model with index_topk config"
        return None

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        num_blocks, block_size, head_size = _check_kv_cache_shape_args(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
        if cache_dtype_str == "fp8_ds_mla":
            return (num_blocks, block_size, v.DS_MLA_ROW_BYTES)
        return (num_blocks, block_size, head_size)


@dataclasses.dataclass(frozen=True)
class LayerScales:
    """The per-tensor fp8 scales forward_mqa reads from the layer (vLLM's layer._q_scale_float etc.)."""

    _q_scale_float: float = 1.0
    _k_scale_float: float = 1.0


class FlashInferMLASparseImpl:
    """Sparse MLA decode (the MQA half of MLA attention) with FlashInfer-style kernels.

    Args mirror vLLM's impl; alibi_slopes, sliding_window and logits_soft_cap must be None and attn_type
    "decoder". topk_indices_buffer: optional [T_max, K] int32 request-local top-k positions that
    forward_mqa reads when it is not given topk_indices (an indexer, when given, supplies its
    topk_indices_buffer instead); checked here, a list or a float array is a TypeError naming it.
    MLA dims come as keywords.
    dcp_world_size / dcp_rank: decode context parallelism; dcp_rank may be `jax.lax.axis_index(...)`
    inside shard_map. implementation: "auto", "xla" or "native" (see sparse_mla_decode).
    """

    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = False  # like FlashInfer's TRTLLM-gen kernel, LSE in base 2
    supports_quant_query_input: bool = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: Any, kv_cache_dtype: str,
                 logits_soft_cap: Any, attn_type: str, kv_sharing_target_layer_name: str | None,
                 topk_indices_buffer: jax.Array | None = None, indexer: Any = None, *,
                 kv_lora_rank: int = 512, qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64,
                 v_head_dim: int = 128, dcp_world_size: int = 1, dcp_rank: Any = 0,
                 implementation: str = "auto") -> None:
        if any(x is not None and x is not False for x in (alibi_slopes, sliding_window,
                                                          logits_soft_cap)):
            raise NotImplementedError(
                "FlashInferMLASparseImpl does not support one of the following: "
                "alibi_slopes, sliding_window, logits_soft_cap"
            )
        if attn_type != DECODER:
            raise NotImplementedError(
                "Encoder self-attention and encoder/decoder cross-attention are not implemented "
                "for FlashInferMLASparseImpl"
            )
        if head_size != kv_lora_rank + qk_rope_head_dim or head_size != v.MLA_HEAD_DIM:
            raise ValueError(
                f"head_size must be kv_lora_rank + qk_rope_head_dim = {v.MLA_HEAD_DIM}, got "
                f"head_size={head_size}, kv_lora_rank={kv_lora_rank}, "
                f"qk_rope_head_dim={qk_rope_head_dim}."
            )
        if num_kv_heads != 1:
            raise ValueError(f"MLA has one latent KV head, got num_kv_heads={num_kv_heads}.")
        v.check_kv_cache_dtype(kv_cache_dtype)
        self.num_heads = v.check_positive_int("num_heads", num_heads)
        self.head_size = head_size
        self.scale = v.check_finite_positive_float("scale", scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        if indexer is not None:
            if not hasattr(indexer, "topk_indices_buffer"):
                raise TypeError(f"indexer must have a topk_indices_buffer (vLLM's Indexer), got "
                                f"{type(indexer).__name__}: {v._short(indexer)}.")
            self.topk_indices_buffer = _check_topk_buffer("indexer.topk_indices_buffer",
                                                          indexer.topk_indices_buffer)
        else:
            self.topk_indices_buffer = _check_topk_buffer("topk_indices_buffer",
                                                          topk_indices_buffer)
        self.dcp_world_size = v.check_positive_int("dcp_world_size", dcp_world_size)
        self.dcp_rank = dcp_rank
        self.implementation = implementation
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode)

    def _scales(self, q: jax.Array, layer: Any) -> tuple[float, float]:
        """(q_scale, k_scale) as the kernel needs them: a 16-bit query or cache has scale 1.

        An fp8 query or per-tensor fp8 cache needs its scale from `layer` (vLLM's
        layer._q_scale_float / _k_scale_float): layer=None, or a layer without that attribute, is a
        ValueError naming `layer` rather than a silent scale of 1.0."""
        def read(attr: str) -> float:
            if layer is None or not hasattr(layer, attr):
                raise ValueError(
                    f"layer must provide {attr} for an fp8 query or fp8 cache (kv_cache_dtype="
                    f"{self.kv_cache_dtype!r}, q {jnp.dtype(q.dtype).name}); got "
                    f"{'None' if layer is None else type(layer).__name__}. Pass "
                    "LayerScales(_q_scale_float=..., _k_scale_float=...).")
            return v.check_finite_positive_float(f"layer.{attr}", getattr(layer, attr))

        q_scale = read("_q_scale_float") if v.is_fp8_e4m3(q.dtype) else 1.0
        k_scale = (read("_k_scale_float")
                   if self.kv_cache_dtype in v.FP8_PER_TENSOR_DTYPES else 1.0)
        return q_scale, k_scale

    def _check_forward_args(self, q, kv_c_and_k_pe_cache, attn_metadata, topk_indices):
        """forward_mqa's checks, before any use of its arguments. Returns (q, cache, topk)."""
        if isinstance(q, tuple):
            if len(q) != 2:
                raise ValueError(f"q as a tuple must be (ql_nope, q_pe), got {len(q)} entries.")
            ql_nope = v.as_array("q[0] (ql_nope)", q[0])
            q_pe = v.as_array("q[1] (q_pe)", q[1])
            v.check_rank("q[0] (ql_nope)", ql_nope, 3)
            v.check_rank("q[1] (q_pe)", q_pe, 3)
            v.check_last_dim("q[0] (ql_nope)", ql_nope, v.MLA_V_DIM)
            v.check_last_dim("q[1] (q_pe)", q_pe, v.MLA_ROPE_DIM)
            v.check_dtype("q[0] (ql_nope)", ql_nope, _Q_DTYPES)
            v.check_dtype("q[1] (q_pe)", q_pe, (ql_nope.dtype,))
            if ql_nope.shape[:2] != q_pe.shape[:2]:
                raise ValueError(f"q[0] (ql_nope) {tuple(ql_nope.shape)} and q[1] (q_pe) "
                                 f"{tuple(q_pe.shape)} must have the same [T, H].")
            q = jnp.concatenate((ql_nope, q_pe), axis=-1)
        else:
            q = v.as_array("q", q)
            v.check_rank("q", q, 3)
            v.check_last_dim("q", q, v.MLA_HEAD_DIM)
            v.check_dtype("q", q, _Q_DTYPES)
        num_tokens, heads = int(q.shape[0]), int(q.shape[1])
        allowed = sorted({self.num_heads, self.num_heads * self.dcp_world_size})
        if heads not in allowed:
            raise ValueError(
                f"q must have num_heads={self.num_heads} heads"
                + (f" (or num_heads * dcp_world_size = {allowed[-1]}, the DCP-gathered query)"
                   if len(allowed) > 1 else "") + f", got shape {tuple(q.shape)}.")
        cache = v.as_array("kv_c_and_k_pe_cache", kv_c_and_k_pe_cache)
        v.check_rank("kv_c_and_k_pe_cache", cache, 3)
        v.check_nonempty_axes("kv_c_and_k_pe_cache", cache, {0: "block", 1: "row per block"})
        if not isinstance(attn_metadata, FlashInferMLASparseMetadata):
            raise TypeError(f"attn_metadata must be a FlashInferMLASparseMetadata, got "
                            f"{type(attn_metadata).__name__}.")
        block_size = v.check_int("attn_metadata.block_size", attn_metadata.block_size, minimum=1)
        if block_size != cache.shape[1]:
            raise ValueError(
                f"attn_metadata.block_size={block_size} differs from the block size of "
                f"kv_c_and_k_pe_cache {tuple(cache.shape)} (axis 1: {cache.shape[1]}).")
        v.check_int("attn_metadata.cp_kv_cache_interleave_size",
                    attn_metadata.cp_kv_cache_interleave_size, minimum=1)
        req = v.int32_array("attn_metadata.req_id_per_token", attn_metadata.req_id_per_token, 1)
        if req.shape[0] < num_tokens:
            raise ValueError(
                f"attn_metadata.req_id_per_token has {req.shape[0]} entries for q's {num_tokens} "
                "tokens.")
        table = v.int32_array("attn_metadata.block_table", attn_metadata.block_table, 2)
        v.check_nonempty_axes("attn_metadata.block_table", table, {0: "request", 1: "block"})
        if topk_indices is None:
            if self.topk_indices_buffer is None:
                raise ValueError("forward_mqa needs topk_indices or a topk_indices_buffer.")
            buffer = _check_topk_buffer("topk_indices_buffer", self.topk_indices_buffer)
            if buffer.shape[0] < num_tokens:
                raise ValueError(f"topk_indices_buffer has {buffer.shape[0]} rows for q's "
                                 f"{num_tokens} tokens.")
            topk = buffer[:num_tokens]
        else:
            topk = v.int32_array("topk_indices", topk_indices, 2)
            if topk.shape[0] != num_tokens:
                raise ValueError(f"topk_indices must have q's {num_tokens} rows, got shape "
                                 f"{tuple(topk.shape)}.")
        v.check_nonempty_axes("topk_indices", topk, {1: "index per token"})
        return q, cache, req, table, topk

    def forward_mqa(
        self,
        q: jax.Array | tuple[jax.Array, jax.Array],
        kv_c_and_k_pe_cache: jax.Array,
        attn_metadata: FlashInferMLASparseMetadata,
        layer: Any = LayerScales(),
        topk_indices: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Sparse MQA over the absorbed query.

        q: [T, H, 576] (or the tuple (ql_nope [T, H, 512], q_pe [T, H, 64])), bf16 / f16, or
          float8_e4m3fn with an fp8 cache (dequantised with layer._q_scale_float).
        kv_c_and_k_pe_cache: [num_blocks, block_size, 576] (656 uint8 for fp8_ds_mla).
        topk_indices: [T, K] int32 request-local top-k positions (global under DCP), -1 = none;
          defaults to topk_indices_buffer[:T].
        Returns (out [T, H, 512], lse [T, H] float32 base 2 or None): lse only when DCP needs it.
        Rows with no valid index give out = 0 and lse = -inf.

        Every argument is checked first (TypeError / ValueError naming it): q [T, H, 576] with H =
        num_heads (or num_heads * dcp_world_size, the DCP-gathered query); a [num_blocks,
        block_size, ...] cache whose block_size equals attn_metadata.block_size; req_id_per_token
        [>= T] and block_table [R, W] int32; topk_indices [T, K] int32; layer=None (or a layer
        without the scale) with an fp8 query or per-tensor fp8 cache is a ValueError naming `layer`.
        The default LayerScales() deliberately means scale 1.0.
        """
        q, kv_c_and_k_pe_cache, req_ids, block_table, topk_indices = self._check_forward_args(
            q, kv_c_and_k_pe_cache, attn_metadata, topk_indices)
        q_scale, k_scale = self._scales(q, layer)
        num_tokens = q.shape[0]
        req_ids = req_ids[:num_tokens]
        if self.dcp_world_size > 1:
            physical, valid_counts = filter_and_convert_dcp_index(
                req_ids, block_table, topk_indices,
                dcp_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=attn_metadata.cp_kv_cache_interleave_size,
                block_size=attn_metadata.block_size, return_valid_counts=True, compact=True)
        else:
            # In place (vLLM's target era): holes stay where they are and the kernel skips them.
            physical = convert_req_index_to_global_index(
                req_ids, block_table, topk_indices,
                block_size=attn_metadata.block_size)
            valid_counts = None
        cache, kv_cache_dtype = kv_c_and_k_pe_cache, self.kv_cache_dtype
        if self.dcp_world_size == 1 and use_bf16_workspace(
                cache, block_table, num_tokens=num_tokens, num_heads=q.shape[1],
                topk=topk_indices.shape[1], q_dtype=q.dtype, implementation=self.implementation):
            cache, physical = bf16_workspace(cache, block_table, req_ids, topk_indices, physical)
            kv_cache_dtype = "bfloat16"
        out, lse = sparse_mla_decode(
            q, cache, physical, scale=self.scale, valid_counts=valid_counts,
            kv_cache_dtype=kv_cache_dtype, q_scale=q_scale, k_scale=k_scale,
            lse_base="e" if self.lse_base_on_e else "2", implementation=self.implementation)
        # Every registered kernel already returns out = 0, lse = -inf for rows with no valid index (the
        # seed masks after its kernel because TRTLLM-gen leaves such rows undefined).
        return out, (lse if self.need_to_return_lse_for_decode else None)
