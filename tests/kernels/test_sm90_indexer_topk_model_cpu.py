"""A NumPy model of the one-CTA SM90 top-k (ffi/sm90/indexer_topk.cuh, kernel name "sm90_topk"),
step for step, against the float64 NumPy rule (tests/reference.py), before and beside its GPU
tests: the radix passes over the row, the gather of the keys that can still be kept once they
number at most kGatherMaxCandidates (each of the 16 warps from its own slice of the float4 groups
into its own list of 512, in position order; a slice with more fails the whole gather), the passes
and the compaction over the gathered lists, and the rereading path when no gather succeeds. The
grid covers every path (gathered after the first, second or third pass, or never), which the test
asserts, on adversarial rows for every lead.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from reference import top_k_np
from test_sm90_indexer_topk_cluster_cpu import BINS, PASSES, adversarial_row, order_keys

# ffi/sm90/indexer_topk.cuh: kWarps, kCandidatesPerWarp, kGatherMaxCandidates, kSpeculateMinLen,
# kThreads * kSampleGroupsPerThread.
WARPS = 16
LIST = 512
GATHER_MAX = WARPS * LIST // 4 * 3
SPECULATE_MIN_LEN = 98304
SAMPLE_GROUPS = 2048


def choose_bin(hist: np.ndarray, remaining: int) -> tuple[int, int]:
    """ChooseThresholdBin: the bin where the count of higher keys crosses `remaining`; (bin, keys
    in higher bins)."""
    above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0]])
    chosen = int(np.flatnonzero((above < remaining) & (above + hist >= remaining))[0])
    return chosen, int(above[chosen])


def estimate_gather_key(keys: np.ndarray, lead: int, k: int) -> int:
    """EstimateGatherKey: the first-digit bin where the count of higher keys of the sample (groups
    evenly spaced over the row) crosses 1.5 x the k largest's expected share plus 32; its lowest
    key."""
    length = len(keys)
    groups = -(-(length + lead) // 4)
    sample_groups = np.arange(SAMPLE_GROUPS, dtype=np.int64) * groups // SAMPLE_GROUPS
    positions = (sample_groups[:, None] * 4 - lead + np.arange(4)).ravel()
    sample = keys[positions[(positions >= 0) & (positions < length)]]
    expected = -(-k * len(sample) // length)
    target = min(len(sample), expected + expected // 2 + 32)
    hist = np.bincount(sample >> PASSES[0][0], minlength=BINS)
    chosen, _ = choose_bin(hist, target)
    return chosen << PASSES[0][0]


def gather(keys: np.ndarray, lead: int, min_key: int) -> np.ndarray | None:
    """GatherCandidates: the positions with key >= min_key, warp slice by warp slice (the lists in
    warp order), or None when a slice holds more than LIST."""
    length = len(keys)
    groups = -(-(length + lead) // 4)
    per_warp = -(-groups // WARPS)
    lists = []
    for warp in range(WARPS):
        g_begin = min(groups, warp * per_warp)
        g_end = min(groups, g_begin + per_warp)
        lo, hi = max(0, g_begin * 4 - lead), max(0, min(length, g_end * 4 - lead))
        slice_positions = np.arange(lo, hi)
        kept = slice_positions[keys[lo:hi] >= min_key]
        if len(kept) > LIST:
            return None
        lists.append(kept)
    return np.concatenate(lists)


def one_cta_model(row: np.ndarray, lead: int, k: int, paths: collections.Counter) -> np.ndarray:
    """One row through TopKPerRowKernel; int64 [k]. paths counts which path the row took."""
    length = len(row)
    if length <= k:
        paths["whole row"] += 1
        return np.concatenate([np.arange(length), np.full(k - length, -1)])
    keys = order_keys(row)
    prefix = mask = 0
    remaining = k
    candidates = None
    pass_index = 0
    decided = False

    def radix_pass(source_keys):
        nonlocal prefix, mask, remaining, decided, pass_index
        shift, digit_mask = PASSES[pass_index]
        matching = source_keys[(source_keys & mask) == prefix]
        hist = np.bincount((matching >> shift) & digit_mask, minlength=BINS)
        chosen, above = choose_bin(hist, remaining)
        remaining -= above
        prefix |= chosen << shift
        mask |= digit_mask << shift
        decided = int(hist[chosen]) == remaining
        pass_index += 1
        return int(hist[chosen])

    def gather_if_few(bin_count):
        if k - remaining + bin_count <= GATHER_MAX:
            return gather(keys, lead, prefix)
        return None

    speculated = False
    if length >= SPECULATE_MIN_LEN:
        min_key = estimate_gather_key(keys, lead, k)
        speculative = gather(keys, lead, min_key)  # made in the first pass's read
        bin_count = radix_pass(keys)
        if speculative is not None and prefix >= min_key:
            candidates, speculated = speculative, True
        else:
            candidates = gather_if_few(bin_count)
    while candidates is None and pass_index < len(PASSES) and not decided:
        candidates = gather_if_few(radix_pass(keys))
    if candidates is not None:
        paths["speculative gather" if speculated else f"gathered after pass {pass_index}"] += 1
        while pass_index < len(PASSES) and not decided:
            radix_pass(keys[candidates])
        order = candidates  # the lists in warp order: ascending positions
    else:
        paths["reread"] += 1
        order = np.arange(length)
    masked = keys[order] & mask
    is_above = masked > prefix
    is_tie = masked == prefix
    above_before = np.cumsum(is_above) - is_above
    ties_before = np.cumsum(is_tie) - is_tie
    kept = is_above | (is_tie & (ties_before < remaining))
    slots = above_before + np.minimum(ties_before, remaining)
    assert kept.sum() == k and len(np.unique(slots[kept])) == k and (slots[kept] < k).all()
    out = np.full(k, -1, np.int64)
    out[slots[kept]] = order[kept]
    return out


NUM_CASES = 14


def model_row(rng: np.random.Generator, case: int, width: int) -> np.ndarray:
    """adversarial_row's cases 0-9, and the GPU tests' four cases for the gather: ties inside the
    threshold bin, a run of equal top values longer than one list, values in one exponent, large
    values where the sample looks (fewer than k of them in the row, far more in the sample)."""
    if case < 10:
        return adversarial_row(rng, case, width)
    row = rng.standard_normal(width).astype(np.float32)
    if case == 10:
        row[:] = np.round(row * 8) / 8
    elif case == 11:
        first = rng.integers(0, max(1, width - 600))
        row[first:first + 600] = 5.0
    elif case == 12:
        row[:] = 3 + row * np.float32(0.1)
    else:  # 2000 large values on the first 500 sampled groups (lead 0): the sample overestimates
        row[(np.arange(500)[:, None] * (width // 512) + np.arange(4)).ravel() % width] = 10.0
    return row


def check_rows(lead: int, width: int, k: int, paths: collections.Counter) -> None:
    rng = np.random.default_rng(lead * 100 + width + k)
    for case in range(NUM_CASES):
        row = model_row(rng, case, width)
        np.testing.assert_array_equal(one_cta_model(row, lead, k, paths),
                                      top_k_np(row, 0, width, k), err_msg=f"case {case}")


@pytest.mark.parametrize("lead", [0, 1, 3])
@pytest.mark.parametrize("width,k", [(131072, 2048), (65536, 2048), (20001, 2048), (5000, 2048),
                                     (2049, 2048), (8192, 4096), (100, 2048), (37, 5), (9, 1)])
def test_model_matches_the_rule(lead, width, k):
    check_rows(lead, width, k, collections.Counter())


def test_the_grid_takes_every_path():
    """Rows of the grid above take every path of the kernel."""
    paths = collections.Counter()
    for width in (131072, 20001, 100):
        check_rows(0, width, 2048, paths)
    for path in ("speculative gather", "gathered after pass 1", "gathered after pass 2",
                 "gathered after pass 3", "reread", "whole row"):
        assert paths[path] > 0, (path, dict(paths))
