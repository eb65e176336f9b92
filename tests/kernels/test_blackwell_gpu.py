"""GPU tests of the Blackwell native kernels: FlashInfer's TRTLLM-gen sparse decode (SM100/SM103) and
its sparse_mla_sm120 DSv3.2 decode (SM120/SM121), each behind an XLA FFI call.

Each case compares implementation="native" with the pure-JAX kernel (implementation="xla") on the same
inputs: random slots with -1 holes and out-of-range slots anywhere, rows that select nothing, optional
valid_counts, both LSE bases. Skipped, with the reason, on any other device (the H200 here: these
kernels have not been run on SM100 or SM120 hardware). JAX_SPARSE_MLA_REQUIRE_GPU=1 turns the skip of
the family matching the device into a failure.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import native, registry
from reference import assert_native_matches

SCALE = 192 ** -0.5 * 1.2
K_SCALE = 0.75


def _skip_reason(majors: tuple[int, ...], family: str, target: str) -> str:
    capability = registry.current_device_capability()
    if capability is None:
        return f"needs an {family} GPU (the default device is {jax.devices()[0].platform})"
    if capability[0] not in majors:
        return f"needs an {family} GPU (found compute capability {capability[0]}.{capability[1]})"
    if not native.available():
        return native.missing_reason()
    if not native.has_target(target):
        return f"the native extension was built without {target}"
    return ""


@functools.cache
def sm100_skip_reason() -> str:
    return _skip_reason((10,), "SM100/SM103", "jax_sparse_mla_trtllm_gen_decode")


@functools.cache
def sm120_skip_reason() -> str:
    return _skip_reason((12,), "SM120/SM121", "jax_sparse_mla_sm120_decode")


if os.environ.get("JAX_SPARSE_MLA_REQUIRE_GPU") == "1":
    capability = registry.current_device_capability()
    for majors, reason in (((10,), sm100_skip_reason()), ((12,), sm120_skip_reason())):
        if capability is not None and capability[0] in majors and reason:
            raise RuntimeError(f"JAX_SPARSE_MLA_REQUIRE_GPU=1 but the tests cannot run: {reason}")

needs_sm100 = pytest.mark.skipif(bool(sm100_skip_reason()), reason=sm100_skip_reason() or "-")
needs_sm120 = pytest.mark.skipif(bool(sm120_skip_reason()), reason=sm120_skip_reason() or "-")
pytestmark = pytest.mark.gpu


def make_indices(rng, num_tokens, num_keys, num_slots):
    indices = rng.integers(0, num_slots, (num_tokens, num_keys)).astype(np.int32)
    holes = rng.random(indices.shape)
    indices[holes < 0.15] = -1
    indices[holes > 0.95] = num_slots + 3
    indices[num_tokens // 2] = -1  # selects nothing
    return jnp.asarray(indices)


def assert_matches(native, reference, *, out_rtol):
    assert_native_matches(native, reference, out_rtol=out_rtol, lse_atol=2e-2)


def run_both(q, cache, indices, **kwargs):
    native = jsm.sparse_mla_decode(q, cache, indices, scale=SCALE, implementation="native", **kwargs)
    reference = jsm.sparse_mla_decode(q, cache, indices, scale=SCALE, implementation="xla", **kwargs)
    assert native[0].shape == reference[0].shape and native[0].dtype == reference[0].dtype
    return native, reference


# --- SM100 / SM103: TRTLLM-gen ---------------------------------------------------------------------------

@needs_sm100
@pytest.mark.parametrize("num_tokens,num_heads,num_keys,block_size", [
    (1, 16, 2048, 64), (7, 128, 2048, 64), (128, 64, 512, 32), (512, 128, 2048, 64), (3, 8, 128, 32),
])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16", "fp8"])
def test_trtllm_gen_matches_pure_jax(num_tokens, num_heads, num_keys, block_size, cache_dtype):
    rng = np.random.default_rng(num_tokens * 131 + num_heads + num_keys)
    num_blocks = 1024
    values = rng.standard_normal((num_blocks, block_size, 576), np.float32)
    q = rng.standard_normal((num_tokens, num_heads, 576), np.float32)
    kwargs = dict(lse_base="e" if num_tokens % 2 else "2",
                  valid_counts=jnp.asarray(rng.integers(0, num_keys + 1, num_tokens), jnp.int32))
    if cache_dtype == "fp8":
        cache = jnp.asarray((values / K_SCALE).astype(ml_dtypes.float8_e4m3fn))
        q = jsm.quantize_query_fp8(jnp.asarray(q), 0.5)
        kwargs.update(q_scale=0.5, k_scale=K_SCALE)
        out_rtol = 3e-2
    else:
        dtype = jnp.dtype(cache_dtype)
        cache, q, out_rtol = jnp.asarray(values, dtype), jnp.asarray(q, dtype), 1.5e-2
    indices = make_indices(rng, num_tokens, num_keys, num_blocks * block_size)
    assert_matches(*run_both(q, cache, indices, **kwargs), out_rtol=out_rtol)


# --- SM120 / SM121: sparse_mla_sm120 over fp8_ds_mla --------------------------------------------------------

@functools.cache
def ds_mla_cache(num_blocks=512, block_size=64):
    rng = np.random.default_rng(5)
    num_slots = num_blocks * block_size
    kv_c = jnp.asarray(rng.standard_normal((num_slots, 512), np.float32), jnp.bfloat16)
    k_pe = jnp.asarray(rng.standard_normal((num_slots, 64), np.float32), jnp.bfloat16)
    empty = jnp.zeros((num_blocks, block_size, 656), jnp.uint8)
    return jsm.concat_and_cache_ds_mla(kv_c, k_pe, empty, jnp.arange(num_slots, dtype=jnp.int32))


@needs_sm120
@pytest.mark.parametrize("num_tokens,num_heads,num_keys", [
    (1, 128, 2048), (4, 8, 2048), (32, 16, 2048), (7, 100, 512), (256, 64, 2048), (3, 128, 100),
])
def test_sm120_matches_pure_jax(num_tokens, num_heads, num_keys):
    cache = ds_mla_cache()
    rng = np.random.default_rng(num_tokens * 17 + num_heads + num_keys)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, 576), np.float32), jnp.bfloat16)
    indices = make_indices(rng, num_tokens, num_keys, cache.shape[0] * cache.shape[1])
    kwargs = dict(lse_base="e" if num_tokens % 2 else "2")
    if num_tokens > 4:
        kwargs["valid_counts"] = jnp.asarray(rng.integers(0, num_keys + 1, num_tokens), jnp.int32)
    # The kernel quantises q and P to fp8 for its block-scaled MMAs; the reference stays in float32.
    assert_matches(*run_both(q, cache, indices, **kwargs), out_rtol=6e-2)
