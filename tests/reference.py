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
