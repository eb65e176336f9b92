"""A NumPy model of the SM90 bf16 kernel's softmax protocol (ffi/sm90/sm90_bf16_kernel.cuh), run on
CPU against the float64 reference.

The kernel's two consumer warpgroups take alternate 64-key tiles (warpgroup 0 tile 2i, warpgroup 1
tile 2i + 1), keep one half of the output columns each and share one running max per row: warpgroup
0's max (previous pairs and its tile) goes first, warpgroup 1 takes the larger of that and its own
and hands it back, and warpgroup 0 moves its P, output and row sum to it before sharing P. The model
runs those steps in the kernel's order with its roundings (float32 scores and sums, P as bf16, base 0
while a row has seen no valid key), so a flaw in the protocol (a missed rescale, a NaN from -inf
minus -inf, a row sum under the wrong max, an empty second tile) shows here as a wrong result. It
says nothing of the CUDA code's addresses or synchronisation, which the GPU tests check.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import BF16, assert_close, attention_from_slots

TILE_KEYS = 64
HEADS = 64
HALF = 256  # output columns per warpgroup


def bf16(values):
    return np.asarray(values, np.float32).astype(BF16).astype(np.float32)


def exponent_base(row_max):
    """ExponentBase: the max, or 0 while the row has seen only invalid keys."""
    return np.where(row_max == -np.inf, np.float32(0), row_max).astype(np.float32)


def masked_scores(q, keys, valid, score_scale):
    """MaskedScores: S of one tile, scaled (base 2), -inf at invalid keys; and its max per row."""
    score = (q @ keys.T).astype(np.float32) * score_scale
    score = np.where(valid[None, :], score, np.float32(-np.inf)).astype(np.float32)
    return score, score.max(axis=1)


def kernel_model(q, rows, valid, score_scale):
    """One CTA over one split: q [64, 576] bf16 values; rows [K, 576] bf16 values; valid [K] bool.

    Returns out [64, 512] and the base-2 lse [64], as the kernel's epilogue writes them."""
    num_tiles = -(-len(rows) // TILE_KEYS)
    num_pairs = -(-num_tiles // 2)
    padded = 2 * num_pairs * TILE_KEYS  # the empty second tile of an odd count: zero rows, invalid
    keys = np.zeros((padded, 576), np.float32)
    keys[:len(rows)] = rows
    key_valid = np.zeros(padded, bool)
    key_valid[:len(rows)] = valid
    out = [np.zeros((HEADS, HALF), np.float32) for _ in range(2)]  # each warpgroup's columns
    row_max = [np.full(HEADS, -np.inf, np.float32) for _ in range(2)]
    row_sum = [np.zeros(HEADS, np.float32) for _ in range(2)]

    def softmax(w, score, new_max):
        """Warpgroup w's online-softmax step: its row max and sum move to new_max; returns P and
        the factor on its output."""
        base = exponent_base(new_max)
        rescale = np.exp2(row_max[w] - base)
        row_max[w] = new_max
        probs = np.exp2(score - base[:, None])
        row_sum[w] = row_sum[w] * rescale + probs.sum(axis=1, dtype=np.float32)
        return probs, rescale

    for pair in range(num_pairs):
        tile = [slice((2 * pair + w) * TILE_KEYS, (2 * pair + w + 1) * TILE_KEYS) for w in range(2)]
        values = [keys[tile[w], :512] for w in range(2)]
        scores = [masked_scores(q, keys[tile[w]], key_valid[tile[w]], score_scale) for w in range(2)]
        # Warpgroup 0: softmax of tile 2i against the previous pairs' max.
        first_max = np.maximum(row_max[0], scores[0][1])
        p0, rescale0 = softmax(0, scores[0][0], first_max)
        out[0] = out[0] * rescale0[:, None] + bf16(p0) @ values[0][:, :HALF]
        # Warpgroup 1: the pair's max from warpgroup 0's and its tile's.
        pair_max = np.maximum(first_max, scores[1][1])
        p1, rescale1 = softmax(1, scores[1][0], pair_max)
        out[1] = out[1] * rescale1[:, None] + bf16(p1) @ values[1][:, HALF:]
        # Warpgroup 0 moves to the pair's max and shares its P; both add the other's tile.
        factor = np.exp2(row_max[0] - exponent_base(pair_max))
        row_max[0] = pair_max
        row_sum[0] = row_sum[0] * factor
        out[1] = out[1] + bf16(p0 * factor[:, None]) @ values[0][:, HALF:]
        out[0] = out[0] * factor[:, None] + bf16(p1) @ values[1][:, :HALF]

    total = row_sum[0] + row_sum[1]
    empty = total == 0
    inverse = np.where(empty, 0, 1 / np.where(empty, 1, total))
    lse = np.where(empty, -np.inf, row_max[0] + np.log2(np.where(empty, 1, total)))
    return np.concatenate(out, axis=1) * inverse[:, None], lse


def problem(num_keys, rng, *, invalid_fraction=0.0, valid_tiles=None, peaks=None):
    """Q, rows and a valid mask; `valid_tiles` keeps only those tiles valid; `peaks` adds a large
    score to one key of each listed tile, in order, so the row max moves between the warpgroups."""
    q = bf16(rng.standard_normal((HEADS, 576)))
    rows = bf16(rng.standard_normal((num_keys, 576)) * 0.1)
    valid = rng.random(num_keys) >= invalid_fraction
    if valid_tiles is not None:
        in_tiles = np.zeros(num_keys, bool)
        for tile in valid_tiles:
            in_tiles[tile * TILE_KEYS:(tile + 1) * TILE_KEYS] = True
        valid &= in_tiles
    for rank, tile in enumerate(peaks or []):
        key = tile * TILE_KEYS + 5
        rows[key] = bf16(q[0] * (0.02 * (rank + 1)))  # head 0's score grows tile after tile
        valid[key] = True
    return q, rows, valid


def check(q, rows, valid, scale=0.0625):
    score_scale = np.float32(scale * np.log2(np.e))
    out, lse = kernel_model(q, rows, valid, score_scale)
    slots = np.where(valid, np.arange(len(rows)), -1)[None, :]
    out_ref, lse_ref = attention_from_slots(q[None], rows, slots, scale)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert_close(lse, lse_ref[0] / np.log(2), atol=2e-4, rtol=0, name="lse (base 2)")
    empty = np.isneginf(lse_ref[0])
    assert np.all(out[empty] == 0)
    error = np.linalg.norm(out - out_ref[0]) / max(np.linalg.norm(out_ref[0]), 1e-30)
    assert error < 1e-2, error  # P rounded to bf16 (8 bits) against float64


@pytest.mark.parametrize("num_keys", [64, 128, 130, 192, 2048])
def test_every_key_valid(num_keys):
    check(*problem(num_keys, np.random.default_rng(num_keys)))


@pytest.mark.parametrize("num_keys", [100, 640, 2048])
def test_holes(num_keys):
    check(*problem(num_keys, np.random.default_rng(1 + num_keys), invalid_fraction=0.4))


@pytest.mark.parametrize("valid_tiles", [[3], [2], [5], [0], [1, 4]])
def test_rows_that_see_valid_keys_late(valid_tiles):
    """The max stays -inf through whole pairs, in one warpgroup's tiles or the other's."""
    check(*problem(6 * TILE_KEYS, np.random.default_rng(7), valid_tiles=valid_tiles))


def test_no_valid_key():
    q, rows, valid = problem(256, np.random.default_rng(3), valid_tiles=[])
    out, lse = kernel_model(q, rows, valid, np.float32(0.09))
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("peaks", [[0, 1, 2, 3], [1, 0, 3, 2], [1, 3, 5], [0, 2, 4], [4, 1]])
def test_max_moving_between_warpgroups(peaks):
    """Head 0's max moves to a later tile, alternately of warpgroup 0 and 1, or jumps back: every
    rescale (warpgroup 0's two, warpgroup 1's one) must be applied to the right output half."""
    check(*problem(6 * TILE_KEYS, np.random.default_rng(11), peaks=peaks), scale=1.0)
