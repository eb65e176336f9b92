"""jax-sparse-mla: DeepSeek-V3.2-style sparse MLA attention (DSA) for JAX.

A port of vLLM's FlashInfer sparse-MLA backend. The package is laid out by role:

    ops/        the public pure-JAX semantics (the reference, on any backend): attention, index
                conversion, DCP combination, cache writers, metadata
    kernels/    the kernel registry and one binding module per native kernel family
    backend.py  the classes that mirror vLLM's FlashInfer sparse-MLA backend
    parallel.py DCP / TP decode under jax.shard_map
    flax/       the Flax NNX DeepSeek-V3.2 / GLM-5 attention layer

`python -m jax_sparse_mla` prints what this installation holds and what each op would run here.
"""

from . import kernels  # registers the native kernel families with the registry
from .kernels.availability import NativeKernelsUnavailableWarning
from .ops.attention import sparse_mla_decode
from .backend import (
    DeviceCapability,
    FlashInferMLASparseImpl,
    FlashInferMLASparseSM90Backend,
    FlashInferMLASparseSM120Backend,
    FlashInferMLASparseTRTLLMBackend,
    LayerScales,
)
from .ops.dcp import correct_attn_out, cp_lse_ag_out_rs, get_dcp_local_seq_lens, lse_weighted_combine
from .ops.index_conversion import convert_req_index_to_global_index, filter_and_convert_dcp_index
from .ops.indexer import fp8_mqa_logits, fp8_paged_mqa_logits, top_k_per_row, top_k_per_row_decode
from .ops.indexer_cache import cp_gather_indexer_k_quant_cache, indexer_k_quant_and_cache
from .ops.kv_cache import concat_and_cache_ds_mla, concat_and_cache_mla, quantize_query_fp8
from .ops.metadata import (
    CommonAttentionMetadata,
    FlashInferMLASparseMetadata,
    FlashInferMLASparseMetadataBuilder,
)
from .parallel import (
    dcp_slot_mapping,
    make_decode_mesh,
    sharded_concat_and_cache_mla,
    sharded_sparse_mla_decode,
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
    "NativeKernelsUnavailableWarning",
    "concat_and_cache_ds_mla",
    "concat_and_cache_mla",
    "convert_req_index_to_global_index",
    "correct_attn_out",
    "cp_gather_indexer_k_quant_cache",
    "cp_lse_ag_out_rs",
    "dcp_slot_mapping",
    "filter_and_convert_dcp_index",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_dcp_local_seq_lens",
    "indexer_k_quant_and_cache",
    "lse_weighted_combine",
    "make_decode_mesh",
    "quantize_query_fp8",
    "sharded_concat_and_cache_mla",
    "sharded_sparse_mla_decode",
    "sparse_mla_decode",
    "top_k_per_row",
    "top_k_per_row_decode",
]
