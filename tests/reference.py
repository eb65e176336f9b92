"""Independent float64 NumPy references for the tests. Written from the semantics notes, not from the
package: loops over tokens and explicit byte layouts, so a bug in the package cannot hide here too."""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def attention_from_slots(q, kv_rows, slots, scale, valid_counts=None, bmm2_scale=1.0):
    """Sparse MLA attention in float64.

    q: [T, H, 576]; kv_rows: [N, 576] (dequantised values); slots: [T, K] ints; a slot is attended when
    0 <= slot < N and (valid_counts is None or position < valid_counts[t]).
    Returns out [T, H, 512] and natural-log lse [T, H] (0 and -inf for rows without a valid slot).
    """
    q = np.asarray(q, np.float64)
    kv_rows = np.asarray(kv_rows, np.float64)
    num_tokens, num_heads, _ = q.shape
    out = np.zeros((num_tokens, num_heads, 512))
    lse = np.full((num_tokens, num_heads), -np.inf)
    for t in range(num_tokens):
        row = [int(s) for j, s in enumerate(slots[t])
               if 0 <= s < kv_rows.shape[0] and (valid_counts is None or j < valid_counts[t])]
        if not row:
            continue
        keys = kv_rows[row]
        logits = q[t] @ keys.T * scale  # [H, n]
        peak = logits.max(axis=-1, keepdims=True)
        weights = np.exp(logits - peak)
        total = weights.sum(axis=-1, keepdims=True)
        out[t] = (weights / total) @ keys[:, :512] * bmm2_scale
        lse[t] = (np.log(total) + peak)[:, 0]
    return out, lse


def to_e4m3(values):
    """Saturating float -> e4m3 (vLLM's scaled_convert)."""
    return np.clip(np.asarray(values, np.float32), -448.0, 448.0).astype(E4M3)


def pack_ds_mla(kv_c, k_pe):
    """fp8_ds_mla rows [T, 656] uint8, byte by byte as vLLM's concat_and_cache_ds_mla writes them."""
    kv_c = np.asarray(kv_c, np.float32)
    rows = np.zeros((kv_c.shape[0], 656), np.uint8)
    for t in range(kv_c.shape[0]):
        for tile in range(4):
            values = kv_c[t, tile * 128:(tile + 1) * 128]
            tile_scale = np.float32(max(np.abs(values).max() / 448.0, np.finfo(np.float32).tiny))
            rows[t, tile * 128:(tile + 1) * 128] = to_e4m3(values / tile_scale).view(np.uint8)
            rows[t, 512 + 4 * tile:512 + 4 * tile + 4] = np.array([tile_scale], "<f4").view(np.uint8)
        rows[t, 528:656] = np.asarray(k_pe[t], BF16).view(np.uint8)
    return rows


def unpack_ds_mla(rows):
    """[T, 656] uint8 -> float64 [T, 576]."""
    rows = np.asarray(rows, np.uint8)
    out = np.zeros((rows.shape[0], 576))
    for t in range(rows.shape[0]):
        scales = rows[t, 512:528].copy().view("<f4")
        nope = rows[t, :512].copy().view(E4M3).astype(np.float64)
        out[t, :512] = nope * np.repeat(scales.astype(np.float64), 128)
        out[t, 512:] = rows[t, 528:656].copy().view(BF16).astype(np.float64)
    return out


def assert_close(actual, expected, *, atol, rtol, name=""):
    """Like np.testing.assert_allclose, plus: -inf / NaN positions must agree exactly."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert not np.isnan(actual).any(), f"{name}: NaN in result"
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected), err_msg=f"{name}: inf positions")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], atol=atol, rtol=rtol, err_msg=name)


def assert_native_matches(native, reference, *, out_rtol, lse_atol):
    """A native kernel's (out, lse) against the pure-JAX kernel's: no NaN, the same -inf rows with out 0
    there, lse within lse_atol, and out within out_rtol in relative Frobenius norm."""
    (out, lse), (out_ref, lse_ref) = native, reference
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    out_ref, lse_ref = np.asarray(out_ref, np.float64), np.asarray(lse_ref, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN in the native result"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg="-inf lse rows")
    empty = np.isneginf(lse_ref)
    assert np.all(out[empty] == 0.0), "rows without a valid slot must give out = 0"
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], atol=lse_atol, rtol=0, err_msg="lse")
    error = np.linalg.norm(out - out_ref) / max(np.linalg.norm(out_ref), 1e-30)
    assert error < out_rtol, f"relative error of out {error:.2e} >= {out_rtol}"


# --- the lightning indexer (DeepSeek-V3.2 DSA) -----------------------------------------------------------

INDEX_RECORD = 132  # 128 e4m3 values + one fp32 scale per token


def ue8m0_quant_np(x, eps):
    """One group of 128 values, as vLLM's indexer writer (and its fused q quantiser) compute it:
    s = max(amax, eps) / 448 in float32, rounded up to a power of two, values e4m3(x / s)."""
    x = np.asarray(x, np.float32)
    amax = np.float32(np.abs(x).max())
    s = np.float32(max(amax, np.float32(eps))) / np.float32(448.0)  # float32 IEEE division
    mantissa, exponent = np.frexp(np.float64(s))  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    scale = np.float32(2.0 ** (exponent - 1 if mantissa == 0.5 else exponent))
    return to_e4m3(x / scale), scale


def write_index_cache_np(cache, k, slots):
    """vLLM's indexer_k_quant_and_cache, byte by byte: block b is bytes [b * P, (b + 1) * P) of the
    cache, P = block_size * 132; token o of the block has its 128 values at o * 128 and its fp32 scale
    at block_size * 128 + 4 * o. Negative slots are skipped (and so are slots past the cache)."""
    cache = np.array(cache, np.uint8)
    num_blocks, block_size, _ = cache.shape
    flat = cache.reshape(-1)
    page = block_size * INDEX_RECORD
    for t, slot in enumerate(np.asarray(slots).tolist()):
        if slot < 0 or slot >= num_blocks * block_size:
            continue
        block, o = divmod(slot, block_size)
        values, scale = ue8m0_quant_np(k[t], 1e-4)
        base = block * page
        flat[base + o * 128: base + o * 128 + 128] = values.view(np.uint8)
        flat[base + block_size * 128 + 4 * o: base + block_size * 128 + 4 * o + 4] = (
            np.array([scale], "<f4").view(np.uint8))
    return cache


def read_index_slot_np(cache, slot):
    """(values float64 [128], scale float64) of one slot, from the byte layout above."""
    cache = np.asarray(cache, np.uint8)
    block_size = cache.shape[1]
    block, o = divmod(int(slot), block_size)
    page = cache[block].reshape(-1)
    values = page[o * 128: o * 128 + 128].copy().view(E4M3).astype(np.float64)
    scale = page[block_size * 128 + 4 * o: block_size * 128 + 4 * o + 4].copy().view("<f4")[0]
    return values, np.float64(scale)


def gather_index_cache_np(cache, block_table, cu_seq_lens, num_tokens):
    """vLLM's cp_gather_indexer_k_quant_cache: row cu[r] + i is token i of request r; other rows 0.
    Returns (values uint8 [N, 128] (e4m3 bytes), scales uint8 [N, 4] (fp32 bytes))."""
    cache = np.asarray(cache, np.uint8)
    block_size = cache.shape[1]
    page = block_size * INDEX_RECORD
    values = np.zeros((num_tokens, 128), np.uint8)
    scales = np.zeros((num_tokens, 4), np.uint8)
    for r in range(len(cu_seq_lens) - 1):
        for i in range(int(cu_seq_lens[r + 1] - cu_seq_lens[r])):
            block = int(block_table[r, i // block_size])
            o = i % block_size
            flat = cache[block].reshape(-1)
            values[cu_seq_lens[r] + i] = flat[o * 128: o * 128 + 128]
            scales[cu_seq_lens[r] + i] = flat[block_size * 128 + 4 * o: block_size * 128 + 4 * o + 4]
    assert page == cache[0].size
    return values, scales


def indexer_scores_np(q, keys, key_scales, weights):
    """float64 I[s] = key_scales[s] * sum_h weights[h] * relu(q[h] . keys[s]); q [H, D], keys [S, D]."""
    dots = np.asarray(q, np.float64) @ np.asarray(keys, np.float64).T  # [H, S]
    return np.asarray(key_scales, np.float64) * (
        np.maximum(dots, 0.0) * np.asarray(weights, np.float64)[:, None]).sum(0)


def calc_diff(x, y):
    """DeepGEMM's logits criterion: 1 - 2 sum(x y) / sum(x^2 + y^2), in float64 (0 when equal)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else 1.0 - 2.0 * (x * y).sum() / denominator


def top_k_np(values, start, end, k):
    """The top-k rule, one row, by a plain sort: rank by (NaN last, value descending, position
    ascending) over positions [start, end), keep min(k, len), return them relative to start in
    ascending order, padded with -1 to k."""
    values = np.asarray(values, np.float64)
    positions = np.arange(max(start, 0), min(end, len(values)), dtype=np.int64)
    row = values[positions]
    nan = np.isnan(row)
    # np.lexsort sorts by its last key first; -0.0 and +0.0 compare equal, so their tie goes to the
    # position.
    ranked = positions[np.lexsort((positions, -np.where(nan, 0.0, row), nan))]
    kept = np.sort(ranked[:k])
    return np.concatenate([kept - start, np.full(k - len(kept), -1, np.int64)])


def yarn_frequencies_np(dim, base, factor, original_max_positions, beta_fast, beta_slow):
    """DeepSeek's precompute_freqs_cis frequencies [dim // 2] in float64: base^(-2i/dim), and with YaRN
    (factor > 1) freq / factor * ramp + freq * (1 - ramp) over the correction range."""
    freq = base ** -(np.arange(0, dim, 2) / dim)
    if factor <= 1:
        return freq
    turns = lambda b: dim * np.log(original_max_positions / (b * 2 * np.pi)) / (2 * np.log(base))
    low, high = max(np.floor(turns(beta_fast)), 0), min(np.ceil(turns(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    return freq / factor * ramp + freq * (1 - ramp)


def rope_np(x, positions, freq, *, interleaved):
    """RoPE in float64 over the last dim of x [T, ..., R]. Interleaved: DeepSeek's MLA, the pairs
    (x[2i], x[2i+1]) as complex numbers times e^(i p f_i). Non-interleaved (NeoX):
    y[i] = x[i] cos - x[i + R/2] sin, y[i + R/2] = x[i] sin + x[i + R/2] cos."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    angle = np.asarray(positions, np.float64).reshape(-1, *([1] * (x.ndim - 1))) * freq
    if interleaved:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                           first * np.sin(angle) + second * np.cos(angle)], axis=-1)
