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
    "concat_and_cache_ds_mla",
    "concat_and_cache_mla",
    "convert_req_index_to_global_index",
    "correct_attn_out",
    "cp_lse_ag_out_rs",
    "dcp_slot_mapping",
    "filter_and_convert_dcp_index",
    "get_dcp_local_seq_lens",
    "lse_weighted_combine",
    "make_decode_mesh",
    "quantize_query_fp8",
    "sharded_concat_and_cache_mla",
    "sharded_sparse_mla_decode",
    "sparse_mla_decode",
]

# native kernels register themselves here
from . import sm90  # registers the SM90 native kernel
from . import sm90_fp8  # registers the SM90 fp8 kernel (takes precedence over sm90 for fp8 caches)
from . import sm120  # registers the SM120/SM121 native kernel
from . import trtllm_gen  # registers the SM100/SM103 native kernel
