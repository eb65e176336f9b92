"""jax-sparse-mla: DeepSeek-V3.2-style sparse MLA attention (DSA) for JAX.

A port of vLLM's FlashInfer sparse-MLA backend: pure-JAX implementations of every piece (the reference,
on any backend) plus native GPU kernels registered per compute capability.
"""

from .attention import sparse_mla_decode
from .backend import (
    DeviceCapability,
    FlashInferMLASparseImpl,
    FlashInferMLASparseSM90Backend,
    FlashInferMLASparseSM120Backend,
    FlashInferMLASparseTRTLLMBackend,
    LayerScales,
)
from .dcp import correct_attn_out, cp_lse_ag_out_rs, get_dcp_local_seq_lens, lse_weighted_combine
from .index_conversion import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .kv_cache import concat_and_cache_ds_mla, concat_and_cache_mla, quantize_query_fp8
from .metadata import (
    CommonAttentionMetadata,
    FlashInferMLASparseMetadata,
    FlashInferMLASparseMetadataBuilder,
)

__version__ = "0.1.0"

__all__ = [
    "CommonAttentionMetadata",
    "DeviceCapability",
    "FlashInferMLASparseImpl",
    "FlashInferMLASparseMetadata",
    "FlashInferMLASparseMetadataBuilder",
    "FlashInferMLASparseSM90Backend",
    "FlashInferMLASparseSM120Backend",
    "FlashInferMLASparseTRTLLMBackend",
    "LayerScales",
    "concat_and_cache_ds_mla",
    "concat_and_cache_mla",
    "convert_req_index_to_global_index",
    "correct_attn_out",
    "cp_lse_ag_out_rs",
    "filter_and_convert_dcp_index",
    "get_dcp_local_seq_lens",
    "lse_weighted_combine",
    "quantize_query_fp8",
    "sparse_mla_decode",
]

# native kernels register themselves here
from . import sm90  # registers the SM90 native kernel
