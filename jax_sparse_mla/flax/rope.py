"""Rotary position embedding with DeepSeek's YaRN frequency interpolation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import MLAConfig


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(config: MLAConfig, rotary_dim: int) -> np.ndarray:
    """[rotary_dim // 2] float32: RoPE frequencies, YaRN-blended between interpolated and original.

    Low frequencies (long wavelengths) are divided by rope_factor, high ones kept, with a linear ramp
    between the dims that complete beta_fast and beta_slow turns over the original context.
    """
    base = config.rope_theta
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if config.rope_factor <= 1.0:
        return inv_freq.astype(np.float32)

    def correction_dim(turns: float) -> float:
        return rotary_dim * math.log(config.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), rotary_dim - 1)
    ramp = np.clip((np.arange(rotary_dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 where the original frequency is kept
    blended = inv_freq / config.rope_factor * (1.0 - keep) + inv_freq * keep
    return blended.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, config: MLAConfig) -> jax.Array:
    """Rotates interleaved pairs (x[2i], x[2i+1]) of x [T, ..., R] by positions [T] int32."""
    rotary_dim = x.shape[-1]
    inv_freq = jnp.asarray(inverse_frequencies(config, rotary_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    attention_factor = _yarn_mscale(config.rope_factor, config.mscale) / _yarn_mscale(
        config.rope_factor, config.mscale_all_dim)
    cos = (jnp.cos(angles) * attention_factor).reshape(angles.shape[0], *([1] * (x.ndim - 2)), -1)
    sin = (jnp.sin(angles) * attention_factor).reshape(cos.shape)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], rotary_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
