"""MLA + DSA layer configurations: DeepSeek-V3.2, GLM-5, and a tiny preset that runs on CPU."""

from __future__ import annotations

import dataclasses
import math

from .. import _validation as _v
from . import hf_config


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Shapes of one multi-head latent attention layer with the DeepSeek sparse-attention indexer.

    hidden_size: model width D; num_heads: query heads H; q_lora_rank / kv_lora_rank: the low-rank
    query and latent KV widths (kv_lora_rank + qk_rope_head_dim = 576 is what the kernels take);
    qk_nope_head_dim / qk_rope_head_dim / v_head_dim: per-head dims; index_topk: keys each token keeps;
    index_n_heads x index_head_dim: the lightning indexer (the indexer ops take 64 or 32 heads of 128);
    indexer_rope_interleave: the indexer's RoPE pairing, False for DeepSeek-V3.2's fixed non-interleaved
    (NeoX) pairing (HF config key of the same name); index_hadamard: rotate the indexer's q and k by
    the 128-point Walsh-Hadamard transform before quantising, as DeepSeek's reference does (vLLM's
    V3.2 does not); rope_theta and the YaRN fields scale RoPE for long contexts (rope_factor 1 turns
    YaRN off).
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    indexer_rope_interleave: bool = False
    index_hadamard: bool = False
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        """Checks every field (TypeError / ValueError naming it): the sizes positive ints (no bools,
        floats or strings), the flags bools, rope_theta, rope_factor and rms_norm_eps finite positive
        numbers, beta_fast / beta_slow / mscale / mscale_all_dim finite numbers >= 0."""
        for name in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads",
                     "index_head_dim", "original_max_position_embeddings"):
            _v.check_int(name, getattr(self, name), minimum=1)
        for name in ("indexer_rope_interleave", "index_hadamard"):
            _v.check_bool(name, getattr(self, name))
        for name in ("rope_theta", "rope_factor", "rms_norm_eps"):
            _v.check_finite_positive_float(name, getattr(self, name))
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            value = _v.check_number(name, getattr(self, name))
            if not math.isfinite(value) or value < 0.0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")

    @classmethod
    def from_hf_config(cls, config: hf_config.HFConfig) -> "MLAConfig":
        """The attention layer of a Hugging Face config (a config.json path, its folder, or the parsed
        dict) of model_type "deepseek_v32" or "glm_moe_dsa": head counts and dims, LoRA ranks, the
        indexer's fields, RoPE (`rope_theta`, `rope_scaling` / `rope_parameters`: default or YaRN
        with its factor, original length, betas and mscales) and `rms_norm_eps`. A field the layer
        cannot run raises a ValueError naming it. Which layers share an indexer:
        `hf_config.indexer_types(config)`."""
        return cls(**hf_config.attention_fields(config))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5 times the YaRN attention mscale squared (DeepSeek-V3.2's scale)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_factor > 1.0:
            mscale = 0.1 * self.mscale_all_dim * math.log(self.rope_factor) + 1.0
            scale *= mscale * mscale
        return scale


def check_config(config) -> MLAConfig:
    """`config` must be an MLAConfig (its fields are checked when it is built)."""
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}.")
    return config


# The published configs' values (tests/flax/test_hf_config.py holds those configs and pins these).
DEEPSEEK_V32 = MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536)
# GLM-5: 32 indexer heads with interleaved RoPE pairs, plain RoPE with theta 1e6 (no YaRN, so the
# softmax scale is qk_head_dim**-0.5 = 1/16), and rms_norm_eps 1e-5, which vLLM and SGLang pass to
# q_a_layernorm and kv_a_layernorm (transformers' glm_moe_dsa builds those two with 1e-6).
GLM5 = MLAConfig(hidden_size=6144, num_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256,
                 index_n_heads=32, indexer_rope_interleave=True, rope_theta=1e6, rope_factor=1.0,
                 rms_norm_eps=1e-5)
# Tiny but structurally identical: the kernels still see 576-wide rows and the indexer ops their
# 128-wide heads (32 of them, the smallest count they take); top-k 128 (vLLM's K % 128).
TINY = MLAConfig(hidden_size=256, num_heads=4, q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32,
                 index_topk=128, index_n_heads=32, index_head_dim=128, rope_factor=4.0,
                 original_max_position_embeddings=128)

PRESETS = {"deepseek-v3.2": DEEPSEEK_V32, "glm-5": GLM5, "tiny": TINY}
