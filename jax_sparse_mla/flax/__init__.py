"""Flax NNX layers for DeepSeek-V3.2 / GLM-5 style sparse MLA attention (needs `flax`)."""

from .checkpoint import load_attention_weights
from .config import DEEPSEEK_V32, GLM5, PRESETS, TINY, MLAConfig
from .layers import Indexer, LayerCache, MLASparseAttention, empty_layer_cache
from .rope import apply_rope

__all__ = ["DEEPSEEK_V32", "GLM5", "PRESETS", "TINY", "Indexer", "LayerCache", "MLAConfig",
           "MLASparseAttention", "apply_rope", "empty_layer_cache", "load_attention_weights"]
