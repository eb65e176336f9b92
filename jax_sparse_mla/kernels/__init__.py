"""Native kernels: the registry (`registry`), the compiled extension (`native`), whether any native
kernel can run in this process and why not (`availability`), and one binding module per kernel
family, each of which registers its kernels when imported:

    sm90                  FlashInfer's Hopper MLA kernel (bf16 caches; fp8 through fa3)   ffi/sm90/
    sm90_fp8              our SM90 fp8 kernels (per-tensor e4m3 and fp8_ds_mla caches)   ffi/sm90/
    sm90_indexer_topk     our SM90 indexer top-k (top_k_per_row, top_k_per_row_decode)   ffi/sm90/
    sm90_indexer_logits   our SM90 indexer logits (fp8_paged_mqa_logits, fp8_mqa_logits) ffi/sm90/
    sm100_trtllm_gen      FlashInfer's TRTLLM-gen sparse decode (SM100/SM103)            ffi/sm100/
    sm120                 FlashInfer's sparse_mla_sm120 decode (SM120/SM121)             ffi/sm120/
    index_conversion_pallas  the index conversions as Pallas (Triton) kernels
    index_conversion_native  the index conversions as CUDA kernels (every family)          ffi/common/

Kernels registered later take precedence on their devices, so sm90_fp8 is imported after sm90.
"""

from . import registry
from . import sm90
from . import sm90_fp8
from . import sm90_indexer_logits
from . import sm90_indexer_topk
from . import sm120
from . import sm100_trtllm_gen
