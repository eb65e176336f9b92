"""Rotary position embedding with DeepSeek's YaRN frequency interpolation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as _v
from .config import MLAConfig, check_config


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


def apply_rope(x: jax.Array, positions: jax.Array, config: MLAConfig, *,
               interleaved: bool = True) -> jax.Array:
    """Rotates x [T, ..., R] by positions [T] int32; pair i (i < R/2) turns by the angle p * f_i.

    interleaved=True pairs (x[2i], x[2i+1]): DeepSeek's MLA (its reference views the RoPE dims as
    complex numbers, vLLM's MLA RoPE has is_neox_style=False). interleaved=False pairs (x[i], x[i + R/2])
    (NeoX style): DeepSeek-V3.2's indexer since the fix in vLLM PR #28968.

    Checked first (TypeError / ValueError naming the argument): x a bf16 / f16 / f32 array of rank
    >= 2 with an even last dim R, positions int32 [T] for x's T, config an MLAConfig, interleaved a
    bool.
    """
    x = _v.as_array("x", x)
    _v.check_min_rank("x", x, 2)
    _v.check_dtype("x", x, (jnp.bfloat16, jnp.float16, jnp.float32))
    if x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension (RoPE pairs), got shape "
                         f"{tuple(x.shape)}.")
    positions = _v.int32_array("positions", positions, 1)
    _v.check_shape("positions", positions, (x.shape[0],), "to match x's tokens")
    check_config(config)
    interleaved = _v.check_bool("interleaved", interleaved)
    rotary_dim = x.shape[-1]
    inv_freq = jnp.asarray(inverse_frequencies(config, rotary_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    attention_factor = _yarn_mscale(config.rope_factor, config.mscale) / _yarn_mscale(
        config.rope_factor, config.mscale_all_dim)
    cos = (jnp.cos(angles) * attention_factor).reshape(angles.shape[0], *([1] * (x.ndim - 2)), -1)
    sin = (jnp.sin(angles) * attention_factor).reshape(cos.shape)
    x32 = x.astype(jnp.float32)
    if interleaved:
        pairs = x32.reshape(*x.shape[:-1], rotary_dim // 2, 2)
        first, second = pairs[..., 0], pairs[..., 1]
    else:
        first, second = x32[..., : rotary_dim // 2], x32[..., rotary_dim // 2:]
    rotated = (first * cos - second * sin, first * sin + second * cos)
    if interleaved:
        return jnp.stack(rotated, axis=-1).reshape(x.shape).astype(x.dtype)
    return jnp.concatenate(rotated, axis=-1).astype(x.dtype)
