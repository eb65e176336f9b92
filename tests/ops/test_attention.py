"""sparse_mla_decode (pure-JAX path) against the float64 NumPy reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from reference import BF16, assert_close, attention_from_slots, pack_ds_mla, to_e4m3, unpack_ds_mla

SCALE = 192 ** -0.5 * 1.3  # a model scale, deliberately not 576 ** -0.5


def make_case(rng, num_tokens, num_heads, num_keys, *, num_blocks=12, block_size=16,
              hole_fraction=0.3, empty_rows=(), oob=True):
    """Random query, a cache whose unselected rows are NaN, and top-k slots with holes."""
    num_slots = num_blocks * block_size
    q = rng.uniform(-1, 1, (num_tokens, num_heads, 576)).astype(np.float32)
    kv = rng.uniform(-1, 1, (num_slots, 576)).astype(np.float32)
    slots = np.stack([rng.choice(num_slots, num_keys, replace=num_keys > num_slots)
                      for _ in range(num_tokens)]).astype(np.int32)
    holes = rng.random(slots.shape) < hole_fraction
    slots[holes] = rng.choice([-1, -7], holes.sum())
    if oob and num_tokens and num_keys > 1:
        slots[0, 1] = num_slots + 3  # past the end: invalid, never read
    for t in empty_rows:
        slots[t] = -1
    selected = np.zeros(num_slots, bool)
    selected[slots[(slots >= 0) & (slots < num_slots)]] = True
    kv[~selected] = np.nan
    return q, kv, slots, (num_blocks, block_size)


def run(q, kv_cache, slots, **kwargs):
    return jax.jit(lambda a, b, c: jsm.sparse_mla_decode(a, b, c, **kwargs))(q, kv_cache, slots)


@pytest.mark.parametrize("num_tokens,num_heads,num_keys", [
    (1, 1, 1), (3, 3, 5), (5, 16, 128), (4, 16, 300), (2, 128, 600), (7, 32, 256)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_cache_matches_float64(num_tokens, num_heads, num_keys, dtype):
    rng = np.random.default_rng(num_tokens * 100 + num_heads + num_keys)
    q, kv, slots, (nb, bs) = make_case(rng, num_tokens, num_heads, num_keys, empty_rows=(num_tokens - 1,)
                                       if num_tokens > 2 else ())
    q16, kv16 = q.astype(dtype), kv.astype(dtype)
    out, lse = run(jnp.asarray(q16), jnp.asarray(kv16).reshape(nb, bs, 576), slots, scale=SCALE)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert out.shape == (num_tokens, num_heads, 512) and lse.shape == (num_tokens, num_heads)
    ref_out, ref_lse = attention_from_slots(np.asarray(q16, np.float64), np.asarray(kv16, np.float64),
                                            slots, SCALE)
    assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5, name="lse")


def test_valid_counts_and_base2_lse():
    rng = np.random.default_rng(1)
    q, kv, slots, (nb, bs) = make_case(rng, 6, 8, 64)
    counts = np.array([0, 1, 17, 64, 100, -3], np.int32)  # beyond K and negative act as clamped
    q16, kv16 = q.astype(BF16), kv.astype(BF16)
    out, lse = run(jnp.asarray(q16), jnp.asarray(kv16).reshape(nb, bs, 576), slots, scale=SCALE,
                   valid_counts=jnp.asarray(counts), lse_base="2")
    ref_out, ref_lse = attention_from_slots(q16, kv16, slots, SCALE, valid_counts=np.clip(counts, 0, 64))
    assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse, ref_lse / math.log(2), atol=3e-5, rtol=2e-5, name="lse2")
    assert np.all(np.asarray(out)[[0, 5]] == 0)


@pytest.mark.parametrize("query_fp8", [False, True])
@pytest.mark.parametrize("kv_cache_dtype,as_uint8", [("fp8", False), ("fp8_e4m3", True)])
def test_fp8_cache_matches_dequantised_reference(query_fp8, kv_cache_dtype, as_uint8):
    rng = np.random.default_rng(2)
    q, kv, slots, (nb, bs) = make_case(rng, 5, 16, 128)
    k_scale, q_scale = 0.02, 0.5
    kv8 = to_e4m3(np.nan_to_num(kv, nan=1e30) / k_scale)  # NaN rows saturate: still never read
    kv8[np.isnan(kv)] = np.nan
    cache = kv8.view(np.uint8) if as_uint8 else kv8
    if query_fp8:
        q_in = to_e4m3(q / q_scale)
        q_ref = q_in.astype(np.float64) * q_scale
        kwargs = dict(q_scale=q_scale)
    else:
        q_in = q.astype(BF16)
        q_ref = q_in.astype(np.float64)
        kwargs = {}
    out, lse = run(jnp.asarray(q_in), jnp.asarray(cache).reshape(nb, bs, 576), slots, scale=SCALE,
                   kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, **kwargs)
    assert out.dtype == jnp.bfloat16
    ref_out, ref_lse = attention_from_slots(q_ref, kv8.astype(np.float64) * k_scale, slots, SCALE)
    assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4, name="lse")


def test_fp8_ds_mla_cache_matches_dequantised_reference():
    rng = np.random.default_rng(3)
    q, kv, slots, (nb, bs) = make_case(rng, 4, 16, 96)
    rows = pack_ds_mla(np.nan_to_num(kv).astype(BF16), np.nan_to_num(kv[:, 512:]).astype(BF16))
    rows[np.isnan(kv[:, 0])] = 0xFF  # unselected rows: NaN bytes everywhere (0xFF is e4m3 NaN)
    q16 = q.astype(BF16)
    out, lse = run(jnp.asarray(q16), jnp.asarray(rows).reshape(nb, bs, 656), slots, scale=SCALE)
    ref_out, ref_lse = attention_from_slots(q16, unpack_ds_mla(rows), slots, SCALE)
    assert_close(out, ref_out, atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5, name="lse")


def test_batched_query_shape():
    rng = np.random.default_rng(4)
    q, kv, slots, (nb, bs) = make_case(rng, 6, 4, 32)
    q16, kv16 = q.astype(BF16), kv.astype(BF16)
    out, lse = run(jnp.asarray(q16).reshape(2, 3, 4, 576), jnp.asarray(kv16).reshape(nb, bs, 576),
                   jnp.asarray(slots).reshape(2, 3, 32), scale=SCALE)
    assert out.shape == (2, 3, 4, 512) and lse.shape == (2, 3, 4)
    ref_out, ref_lse = attention_from_slots(q16, kv16, slots, SCALE)
    assert_close(np.asarray(out).reshape(6, 4, 512), ref_out, atol=1e-2, rtol=2e-2)
    assert_close(np.asarray(lse).reshape(6, 4), ref_lse, atol=2e-5, rtol=2e-5)


def test_zero_tokens():
    out, lse = jsm.sparse_mla_decode(jnp.zeros((0, 4, 576), jnp.bfloat16),
                                     jnp.zeros((2, 16, 576), jnp.bfloat16),
                                     jnp.zeros((0, 128), jnp.int32), scale=SCALE)
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)


def test_large_problem_memory_is_bounded():
    """T=512, H=128, K=2048 must compile to a bounded working set.

    On the CPU backend the chunked kernel needs ~1.0 GiB of temporaries (the output accumulators alone
    are 0.25 GiB); gathering all 2048 keys at once needs ~2.6 GiB."""
    q = jax.ShapeDtypeStruct((512, 128, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((4096, 64, 576), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((512, 2048), jnp.int32)
    compiled = jax.jit(lambda a, b, c: jsm.sparse_mla_decode(a, b, c, scale=SCALE)).lower(
        q, cache, slots).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    assert analysis.temp_size_in_bytes < 1.5 * 2 ** 30, analysis.temp_size_in_bytes


BAD_INPUTS = [
    (dict(q=np.zeros((2, 4, 576), np.float32)), TypeError, "q must have dtype"),
    (dict(q=np.zeros((4, 576), BF16)), ValueError, "q must have rank"),
    (dict(q=np.zeros((2, 4, 512), BF16)), ValueError, "last dimension 576"),
    (dict(kv_cache=np.zeros((3, 16, 512), BF16)), ValueError, "kv_cache must have last dimension"),
    (dict(kv_cache=np.zeros((48, 576), BF16)), ValueError, "kv_cache must have rank 3"),
    (dict(kv_cache=np.zeros((3, 16, 576), np.float32)), TypeError, "cannot infer"),
    (dict(topk_indices=np.zeros((2, 8), np.int64)), TypeError, "topk_indices must have dtype int32"),
    (dict(topk_indices=np.zeros((3, 8), np.int32)), ValueError, "topk_indices must have shape"),
    (dict(valid_counts=np.zeros((3,), np.int32)), ValueError, "valid_counts must have shape"),
    (dict(valid_counts=np.zeros((2,), np.float32)), TypeError, "valid_counts must have dtype"),
    (dict(scale=0.0), ValueError, "scale must be"),
    (dict(q_scale=2.0), ValueError, "q_scale=2.0 applies only"),
    (dict(k_scale=2.0), ValueError, "k_scale=2.0 applies only"),
    (dict(lse_base="10"), ValueError, "lse_base"),
    (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="fp8_ds_mla"), TypeError, "kv_cache must have dtype uint8"),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
]


@pytest.mark.parametrize("override,error,message", BAD_INPUTS)
def test_rejects_bad_input(override, error, message):
    args = dict(q=np.zeros((2, 4, 576), BF16), kv_cache=np.zeros((3, 16, 576), BF16),
                topk_indices=np.zeros((2, 8), np.int32), scale=SCALE)
    args.update(override)
    with pytest.raises(error, match=message):
        jsm.sparse_mla_decode(args.pop("q"), args.pop("kv_cache"), args.pop("topk_indices"), **args)


def test_native_request_without_native_kernel_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU message")
    with pytest.raises(ValueError, match="no native kernel fits"):
        jsm.sparse_mla_decode(jnp.zeros((1, 4, 576), jnp.bfloat16), jnp.zeros((1, 16, 576), jnp.bfloat16),
                              jnp.zeros((1, 128), jnp.int32), scale=SCALE, implementation="native")


def test_mask_empty_rows_sets_the_contract_values_over_nan():
    out = jnp.full((3, 2, 4), jnp.nan, jnp.bfloat16)
    lse = jnp.full((3, 2), jnp.nan, jnp.float32)
    masked_out, masked_lse = jsm.kernels.registry.mask_empty_rows(out, lse, jnp.array([True, False, True]))
    assert masked_out.dtype == jnp.bfloat16
    assert np.all(np.asarray(masked_out)[[0, 2]] == 0) and np.isnan(np.asarray(masked_out)[1]).all()
    assert np.all(np.isneginf(np.asarray(masked_lse)[[0, 2]])) and np.isnan(np.asarray(masked_lse)[1]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_query_gives_non_finite_rows(value):
    """A NaN or infinite query value makes its row's out and lse non-finite (never the out 0 /
    lse -inf of an empty row); the other rows match the float64 reference."""
    rng = np.random.default_rng(3)
    q, kv, slots, (nb, bs) = make_case(rng, 3, 4, 64, hole_fraction=0.0, oob=False)
    q[1, 2, 100] = value
    out, lse = run(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16).reshape(nb, bs, 576),
                   slots, scale=SCALE)
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    bad = np.zeros((3, 4), bool)
    bad[1, 2] = True
    assert not np.isfinite(out[bad]).any() and not np.isfinite(lse[bad]).any()
    q16 = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)
    ref_out, ref_lse = attention_from_slots(np.where(bad[..., None], 0.0, q16),
                                            np.asarray(jnp.asarray(kv, jnp.bfloat16), np.float64),
                                            slots, SCALE)
    assert_close(out[~bad], ref_out[~bad], atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse[~bad], ref_lse[~bad], atol=2e-5, rtol=2e-5, name="lse")
