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
from .ops.index_conversion import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .ops.metadata import FlashInferMLASparseMetadata, FlashInferMLASparseMetadataBuilder

DECODER = "decoder"


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
        return (num_blocks, block_size, head_size)

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

        model_config: the model's HF text config (object or dict) for the qk_nope_head_dim and
        index_topk checks; None skips them, as vLLM does without a model config.
        """
        return cls._unsupported_reason(dtype, kv_cache_dtype, model_config)

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
        return capability.major == 10

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
        return capability.major == 12

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
        if cache_dtype_str in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"):
            return (num_blocks, block_size, v.DS_MLA_ROW_BYTES)
        return (num_blocks, block_size, head_size)


class FlashInferMLASparseSM90Backend(_FlashInferMLASparseBackendBase):
    """SM90 (H100/H200): FlashInfer's Hopper MLA kernel used as a top-k kernel (page_size = 1) for bf16
    caches (our own bf16 kernel, sm90_bf16.py, with implementation="native"), and our own fp8 kernels
    (sm90_fp8.py) for per-tensor e4m3 and fp8_ds_mla caches.

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
        return capability.major == 9

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
    forward_mqa reads when it is not given topk_indices. MLA dims come as keywords.
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
        self.topk_indices_buffer = (
            indexer.topk_indices_buffer if indexer is not None else topk_indices_buffer)
        self.dcp_world_size = v.check_positive_int("dcp_world_size", dcp_world_size)
        self.dcp_rank = dcp_rank
        self.implementation = implementation
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode)

    def _scales(self, q: jax.Array, layer: Any) -> tuple[float, float]:
        """(q_scale, k_scale) as the kernel needs them: a 16-bit query or cache has scale 1."""
        q_scale = getattr(layer, "_q_scale_float", 1.0) if v.is_fp8_e4m3(q.dtype) else 1.0
        k_scale = (getattr(layer, "_k_scale_float", 1.0)
                   if self.kv_cache_dtype in v.FP8_PER_TENSOR_DTYPES else 1.0)
        return q_scale, k_scale

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
        """
        if isinstance(q, tuple):
            q = jnp.concatenate(q, axis=-1)
        num_tokens = q.shape[0]
        if topk_indices is None:
            if self.topk_indices_buffer is None:
                raise ValueError("forward_mqa needs topk_indices or a topk_indices_buffer.")
            topk_indices = self.topk_indices_buffer[:num_tokens]
        req_ids = attn_metadata.req_id_per_token[:num_tokens]
        if self.dcp_world_size > 1:
            physical, valid_counts = filter_and_convert_dcp_index(
                req_ids, attn_metadata.block_table, topk_indices,
                dcp_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=attn_metadata.cp_kv_cache_interleave_size,
                block_size=attn_metadata.block_size, return_valid_counts=True, compact=True)
        else:
            # In place (vLLM's target era): holes stay where they are and the kernel skips them.
            physical = convert_req_index_to_global_index(
                req_ids, attn_metadata.block_table, topk_indices,
                block_size=attn_metadata.block_size)
            valid_counts = None
        q_scale, k_scale = self._scales(q, layer)
        out, lse = sparse_mla_decode(
            q, kv_c_and_k_pe_cache, physical, scale=self.scale, valid_counts=valid_counts,
            kv_cache_dtype=self.kv_cache_dtype, q_scale=q_scale, k_scale=k_scale,
            lse_base="e" if self.lse_base_on_e else "2", implementation=self.implementation)
        # Every registered kernel already returns out = 0, lse = -inf for rows with no valid index (the
        # seed masks after its kernel because TRTLLM-gen leaves such rows undefined).
        return out, (lse if self.need_to_return_lse_for_decode else None)
