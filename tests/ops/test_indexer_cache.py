"""The indexer's key cache: indexer_k_quant_and_cache and cp_gather_indexer_k_quant_cache, byte for
byte against the NumPy rendering of vLLM's rule in reference.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.ops.indexer_cache import ue8m0_quantize
from reference import BF16, E4M3, gather_index_cache_np, ue8m0_quant_np, write_index_cache_np


def keys_with_every_magnitude(rng, num_tokens=40):
    """bf16 keys [T, 128]: random rows at several scales plus the edge cases of the scale rule."""
    k = rng.standard_normal((num_tokens, 128)) * 10.0 ** rng.integers(-3, 4, (num_tokens, 1))
    k[0] = 0.0  # amax 0: the 1e-4 floor sets the scale, every value is +0
    k[1] = -0.0
    k[2] *= 1e-30  # tiny: below the floor, every value rounds to (signed) zero
    k[3] = rng.standard_normal(128) * 1e-5  # below the floor, some values survive as e4m3 subnormals
    k[4] = rng.standard_normal(128) * 1e36  # huge, near bf16's top
    k[5, :] = 1.0
    k[5, 7] = 448.0 * 2.0 ** -3  # amax / 448 exactly a power of two: scale 2^-3, not 2^-2
    k[6, 9] = -448.0 * 2.0 ** 5 * (1 + 2.0 ** -7)  # one bf16 ulp above: the scale doubles
    k[7] = rng.standard_normal(128) * 1e-4  # amax around the floor
    k[8, :64] = 3e38  # bf16 max region: scale 2^120
    return k.astype(BF16)


def test_quantisation_rule_edges():
    k = keys_with_every_magnitude(np.random.default_rng(0))
    values, scales = jax.jit(lambda x: ue8m0_quantize(x, 1e-4))(jnp.asarray(k))
    for t in range(k.shape[0]):
        expected_values, expected_scale = ue8m0_quant_np(k[t], 1e-4)
        assert np.float32(scales[t]) == expected_scale, t
        np.testing.assert_array_equal(np.asarray(values[t]).view(np.uint8), expected_values.view(np.uint8))
    assert scales[5] == 2.0 ** -3 and scales[6] == 2.0 ** 6 and scales[8] == 2.0 ** 120
    assert scales[0] == 2.0 ** -22  # 1e-4 / 448 = 2.2e-7 rounds up to 2^-22
    np.testing.assert_array_equal(np.asarray(values[1]).view(np.uint8), 0x80)  # -0.0 stays -0
    assert (np.asarray(values[3]).view(np.uint8) & 0x7F).any()  # e4m3 subnormals survive


@pytest.mark.parametrize("block_size", [64, 16])
def test_writer_is_byte_exact_and_skips_negative_slots(block_size):
    rng = np.random.default_rng(block_size)
    num_blocks, num_tokens = 6, 40
    k = keys_with_every_magnitude(rng, num_tokens)
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int64)
    slots[[10, 11]] = [-1, -7]  # padding tokens
    slots[12] = num_blocks * block_size + 3  # past the cache: dropped, not wrapped
    cache = rng.integers(0, 256, (num_blocks, block_size, 132), dtype=np.uint8)  # old bytes stay
    expected = write_index_cache_np(cache, k, slots)
    new = jsm.indexer_k_quant_and_cache(jnp.asarray(k), jnp.asarray(cache), slots)
    assert new.shape == cache.shape and new.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(new), expected)
    # Under jit with the cache donated: the same bytes (int32 slots here).
    write = jax.jit(jsm.indexer_k_quant_and_cache, donate_argnums=1)
    np.testing.assert_array_equal(np.asarray(write(jnp.asarray(k), jnp.asarray(cache),
                                                   jnp.asarray(slots, jnp.int32))), expected)


def test_writer_float32_keys_and_layout_offsets():
    """A float32 key lands at the documented byte offsets: values at 128 o, the scale at 64 * 128 + 4 o."""
    k = np.zeros((1, 128), np.float32)
    k[0, :] = np.arange(128) / 127.0 * 448.0 * 4  # amax 1792 -> scale 4, values arange * 448 / 127
    cache = np.zeros((3, 64, 132), np.uint8)
    new = np.asarray(jsm.indexer_k_quant_and_cache(k, cache, np.array([64 + 5], np.int32)))
    page = new[1].reshape(-1)
    assert not new[0].any() and not new[2].any()
    np.testing.assert_array_equal(page[5 * 128: 6 * 128].view(E4M3),
                                  np.clip(k[0] / 4, -448, 448).astype(E4M3))
    assert page[64 * 128 + 20: 64 * 128 + 24].view("<f4")[0] == 4.0
    assert np.count_nonzero(page[6 * 128:64 * 128]) == 0


def test_gather_is_byte_exact():
    rng = np.random.default_rng(3)
    block_size, num_blocks = 64, 12
    seq_lens = [70, 0, 5, 130]  # a zero-length request in the middle
    width = 3
    block_table = rng.permutation(num_blocks)[: len(seq_lens) * width].reshape(-1, width).astype(np.int32)
    cache = np.zeros((num_blocks, block_size, 132), np.uint8)
    for r, n in enumerate(seq_lens):
        positions = np.arange(n)
        slots = block_table[r, positions // block_size] * block_size + positions % block_size
        k = (rng.standard_normal((n, 128)) * rng.uniform(0.01, 100)).astype(BF16)
        cache = np.asarray(jsm.indexer_k_quant_and_cache(k, cache, slots.astype(np.int32)))
    cu = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    num_tokens = int(cu[-1]) + 9  # an upper bound: the tail rows are 0
    k_fp8, k_scale = jsm.cp_gather_indexer_k_quant_cache(cache, block_table, cu, num_tokens=num_tokens)
    assert k_fp8.shape == (num_tokens, 128) and k_fp8.dtype == jnp.float8_e4m3fn
    assert k_scale.shape == (num_tokens,) and k_scale.dtype == jnp.float32
    values, scales = gather_index_cache_np(cache, block_table, cu, num_tokens)
    np.testing.assert_array_equal(np.asarray(k_fp8).view(np.uint8), values)
    np.testing.assert_array_equal(np.asarray(k_scale).view(np.uint8).reshape(-1, 4), scales)
    assert (np.asarray(k_scale)[: cu[-1]] > 0).all() and not np.asarray(k_scale)[cu[-1]:].any()
    jitted = jax.jit(jsm.cp_gather_indexer_k_quant_cache, static_argnames="num_tokens")
    k_fp8_jit, k_scale_jit = jitted(cache, block_table, cu, num_tokens=num_tokens)
    np.testing.assert_array_equal(np.asarray(k_fp8_jit).view(np.uint8), values)
    np.testing.assert_array_equal(np.asarray(k_scale_jit), np.asarray(k_scale))


def test_write_then_gather_round_trip_dequantises_close():
    rng = np.random.default_rng(4)
    k = rng.standard_normal((100, 128)).astype(BF16)
    positions = np.arange(100)
    block_table = np.array([[2, 0]], np.int32)
    slots = (block_table[0, positions // 64] * 64 + positions % 64).astype(np.int32)
    cache = jsm.indexer_k_quant_and_cache(k, jnp.zeros((3, 64, 132), jnp.uint8), slots)
    k_fp8, k_scale = jsm.cp_gather_indexer_k_quant_cache(cache, block_table, np.array([0, 100], np.int32),
                                                         num_tokens=100)
    restored = np.asarray(k_fp8, np.float32) * np.asarray(k_scale)[:, None]
    np.testing.assert_allclose(restored, k.astype(np.float32), rtol=0.07, atol=0.0)


# --- argument checks ---------------------------------------------------------------------------------------

def _writer_args():
    return (jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((2, 64, 132), jnp.uint8), jnp.zeros(4, jnp.int32))


@pytest.mark.parametrize("index,value,error,message", [
    (0, jnp.zeros((4, 128), jnp.int32), TypeError, "indexer_k_quant_and_cache: k must have dtype"),
    (0, jnp.zeros((4, 64), jnp.bfloat16), ValueError, "k must have last dimension 128"),
    (0, jnp.zeros((4, 1, 128), jnp.bfloat16), ValueError, "k must have rank 2"),
    (1, jnp.zeros((2, 64, 656), jnp.uint8), ValueError, "index_cache must have last dimension 132"),
    (1, jnp.zeros((2, 64, 132), jnp.bfloat16), TypeError, "index_cache must have dtype uint8"),
    (1, jnp.zeros((128, 132), jnp.uint8), ValueError, "index_cache must have rank 3"),
    (2, jnp.zeros(4, jnp.float32), TypeError, "slot_mapping must have dtype int32, int64"),
    (2, jnp.zeros(5, jnp.int32), ValueError, "slot_mapping must have shape (4,) (one slot per key)"),
    (2, [0, 1, 2, 3], TypeError, "slot_mapping must be an array"),
])
def test_writer_rejects_bad_arguments(index, value, error, message):
    args = list(_writer_args())
    args[index] = value
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        jsm.indexer_k_quant_and_cache(*args)


def test_gather_rejects_bad_arguments():
    cache = jnp.zeros((4, 64, 132), jnp.uint8)
    table = jnp.zeros((2, 2), jnp.int32)
    gather = jsm.cp_gather_indexer_k_quant_cache
    with pytest.raises(ValueError, match="request 1 has 129 tokens but block_table covers 2 blocks x 64 = 128"):
        gather(cache, table, jnp.asarray([0, 10, 139], jnp.int32), num_tokens=200)
    with pytest.raises(ValueError, match="cu_seq_lens\\[-1\\] = 139 rows do not fit num_tokens = 100"):
        gather(cache, table, jnp.asarray([0, 11, 139], jnp.int32), num_tokens=100)
    with pytest.raises(ValueError, match="non-decreasing"):
        gather(cache, table, jnp.asarray([0, 11, 5], jnp.int32), num_tokens=100)
    with pytest.raises(ValueError, match="cu_seq_lens must have shape \\(3,\\)"):
        gather(cache, table, jnp.asarray([0, 11], jnp.int32), num_tokens=100)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        gather(cache, table.astype(jnp.float32), jnp.asarray([0, 1, 2], jnp.int32), num_tokens=100)
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        gather(cache, table, jnp.asarray([0, 1, 2], jnp.int32), num_tokens=0)
    with pytest.raises(TypeError, match="positional"):
        gather(cache, table, jnp.asarray([0, 1, 2], jnp.int32), 100)  # keyword-only


def test_native_without_a_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="for indexer_k_quant_and_cache but no native kernel fits: "
                                         "no native kernel is registered"):
        jsm.indexer_k_quant_and_cache(*_writer_args(), implementation="native")
    with pytest.raises(ValueError, match="implementation must be one of"):
        jsm.indexer_k_quant_and_cache(*_writer_args(), implementation="cuda")
