"""KV-cache writers and fp8 query quantisation against byte-level NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from reference import BF16, E4M3, pack_ds_mla, to_e4m3, unpack_ds_mla


def inputs(rng, num_tokens=42, num_blocks=8, block_size=16, dtype=BF16, magnitude=1.0):
    kv_c = (rng.standard_normal((num_tokens, 512)) * magnitude).astype(dtype)
    k_pe = (rng.standard_normal((num_tokens, 64)) * magnitude).astype(dtype)
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int32)
    return kv_c, k_pe, slots


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_concat_and_cache_mla_16bit_is_exact_and_skips_negative_slots(dtype):
    rng = np.random.default_rng(0)
    kv_c, k_pe, slots = inputs(rng, dtype=dtype)
    slots[[3, 9]] = [-1, -5]
    cache = np.full((8, 16, 576), 7, dtype)
    new = np.asarray(jsm.concat_and_cache_mla(kv_c, k_pe[:, None], cache, slots)).reshape(-1, 576)
    expected = cache.reshape(-1, 576).copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[slot] = np.concatenate([kv_c[t], k_pe[t]])
    np.testing.assert_array_equal(new.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("as_uint8", [False, True])
def test_concat_and_cache_mla_fp8_per_tensor(as_uint8):
    rng = np.random.default_rng(1)
    kv_c, k_pe, slots = inputs(rng, magnitude=30.0)  # some values saturate at 448 * k_scale
    k_scale = 0.05
    cache = np.zeros((8, 16, 576), np.uint8 if as_uint8 else E4M3)
    new = jsm.concat_and_cache_mla(kv_c, k_pe, cache, slots.astype(np.int64), kv_cache_dtype="fp8",
                                   k_scale=k_scale)
    assert new.dtype == cache.dtype
    rows = np.asarray(new).reshape(-1, 576)[slots]
    rows = rows.view(E4M3) if as_uint8 else rows
    expected = to_e4m3(np.concatenate([kv_c, k_pe], -1).astype(np.float32) / np.float32(k_scale))
    np.testing.assert_array_equal(rows.view(np.uint8), expected.view(np.uint8))
    assert not np.isnan(rows.astype(np.float32)).any()


def test_concat_and_cache_ds_mla_bytes_match_vllm_layout():
    """vLLM's test_concat_and_cache_ds_mla: 42 tokens, block 16, 8 blocks, bf16."""
    rng = np.random.default_rng(0)
    kv_c, k_pe, slots = inputs(rng)
    cache = np.zeros((8, 16, 656), np.uint8)
    new = np.asarray(jsm.concat_and_cache_ds_mla(kv_c, k_pe, cache, slots)).reshape(-1, 656)
    expected = pack_ds_mla(kv_c, k_pe)
    np.testing.assert_array_equal(new[slots, :512], expected[:, :512])  # fp8 tiles
    np.testing.assert_array_equal(new[slots, 512:528], expected[:, 512:528])  # fp32 tile scales
    np.testing.assert_array_equal(new[slots, 528:], expected[:, 528:])  # bf16 RoPE untouched
    untouched = np.setdiff1d(np.arange(128), slots)
    assert not new[untouched].any()
    # Round trip: dequantised rows are within fp8 precision of the inputs.
    restored = unpack_ds_mla(new[slots])
    np.testing.assert_allclose(restored[:, :512], kv_c.astype(np.float64), rtol=0.07, atol=1e-3)
    np.testing.assert_array_equal(restored[:, 512:], k_pe.astype(np.float64))


def test_ds_mla_all_zero_tile_uses_flt_min_scale():
    kv_c = np.zeros((1, 512), BF16)
    k_pe = np.ones((1, 64), BF16)
    new = np.asarray(jsm.concat_and_cache_ds_mla(kv_c, k_pe, np.zeros((1, 4, 656), np.uint8),
                                                 np.array([2], np.int32)))
    scales = new[0, 2, 512:528].copy().view("<f4")
    np.testing.assert_array_equal(scales, np.full(4, np.finfo(np.float32).tiny, np.float32))


def test_writer_is_donation_friendly_under_jit():
    rng = np.random.default_rng(2)
    kv_c, k_pe, slots = inputs(rng, num_tokens=4)
    write = jax.jit(lambda c, a, b, s: jsm.concat_and_cache_mla(a, b, c, s), donate_argnums=0)
    cache = jnp.zeros((8, 16, 576), jnp.bfloat16)
    cache = write(cache, kv_c, k_pe, slots)
    np.testing.assert_array_equal(np.asarray(cache).reshape(-1, 576)[slots[0], :512].view(np.uint16),
                                  kv_c[0].view(np.uint16))


def test_quantize_query_fp8():
    q = np.linspace(-500, 500, 2 * 3 * 576, dtype=np.float32).reshape(2, 3, 576)
    q8 = jsm.quantize_query_fp8(jnp.asarray(q, jnp.bfloat16), 0.5)
    assert q8.dtype == jnp.float8_e4m3fn
    expected = to_e4m3(q.astype(BF16).astype(np.float32) * np.float32(2.0))
    np.testing.assert_array_equal(np.asarray(q8).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("call,error,message", [
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), np.float32), np.zeros((2, 64), np.float32),
                                      np.zeros((1, 4, 576), np.float32), np.zeros(2, np.int32)),
     TypeError, "kv_c must have dtype"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 256), BF16), np.zeros((2, 64), BF16),
                                      np.zeros((1, 4, 576), BF16), np.zeros(2, np.int32)),
     ValueError, "kv_c must have last dimension 512"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), BF16), np.zeros((3, 64), BF16),
                                      np.zeros((1, 4, 576), BF16), np.zeros(2, np.int32)),
     ValueError, "same number of tokens"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), BF16), np.zeros((2, 64), BF16),
                                      np.zeros((1, 4, 576), BF16), np.zeros(2, np.float32)),
     TypeError, "slot_mapping must have dtype"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), BF16), np.zeros((2, 64), BF16),
                                      np.zeros((1, 4, 576), np.float16), np.zeros(2, np.int32)),
     TypeError, "kv_cache must have dtype"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), BF16), np.zeros((2, 64), BF16),
                                      np.zeros((1, 4, 576), BF16), np.zeros(2, np.int32), k_scale=2.0),
     ValueError, "applies only to fp8"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), BF16), np.zeros((2, 64), BF16),
                                      np.zeros((1, 4, 576), BF16), np.zeros(2, np.int32),
                                      kv_cache_dtype="fp8"),
     TypeError, "kv_cache must have dtype"),
    (lambda: jsm.concat_and_cache_ds_mla(np.zeros((2, 512), np.float16), np.zeros((2, 64), np.float16),
                                         np.zeros((1, 4, 656), np.uint8), np.zeros(2, np.int32)),
     TypeError, "kv_c must have dtype bfloat16"),
    (lambda: jsm.concat_and_cache_ds_mla(np.zeros((2, 512), BF16), np.zeros((2, 64), BF16),
                                         np.zeros((1, 4, 576), np.uint8), np.zeros(2, np.int32)),
     ValueError, "last dimension 656"),
    (lambda: jsm.concat_and_cache_mla(np.zeros((2, 512), BF16), np.zeros((2, 64), BF16),
                                      np.zeros((1, 4, 656), np.uint8), np.zeros(2, np.int32),
                                      kv_cache_dtype="fp8_ds_mla", k_scale=3.0),
     ValueError, "not used by fp8_ds_mla"),
    (lambda: jsm.quantize_query_fp8(np.zeros((2, 576), np.int32), 1.0), TypeError, "q must have dtype"),
    (lambda: jsm.quantize_query_fp8(np.zeros((2, 576), BF16), -1.0), ValueError, "q_scale"),
])
def test_rejects_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
