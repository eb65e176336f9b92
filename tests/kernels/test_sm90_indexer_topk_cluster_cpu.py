"""CPU tests of the cluster form of the SM90 top-k (ffi/sm90/indexer_topk_cluster.cuh, kernel name
"sm90_topk_cluster"), before and beside its GPU tests:

* a NumPy model of the kernel's algorithm, step for step (the float4 groups with the row start's
  lead, the split into C chunks, the per-CTA histograms summed over the cluster, the threshold bin
  of each pass and the early exit, the per-CTA counts that place each CTA's output, the ordered
  compaction; after the first pass, the candidates' counts from the histograms, their layout in
  the leader's lists and the leader's refinement), against the float64 NumPy rule
  (tests/reference.py) on adversarial rows for every cluster size and lead, with and without the
  leader;
* the host plan (ffi/sm90/indexer_topk_plan.h, compiled from that header as host C++): every row
  fits the chunks it is given, the grid grows only within one wave, and it accepts exactly the
  widths the Python check accepts;
* the registration: not validated (so "auto" passes it over), preferred by "native" where it fits,
  the check's limits, and the custom calls it lowers to on a faked SM90 device.
"""

from __future__ import annotations

import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import native, registry, sm90_indexer_topk as topk
from reference import top_k_np
from requirements import compile_host_program, require_native
from test_sm90_indexer_topk_cpu import problem
BINS, PASSES = 2048, ((21, 0x7FF), (10, 0x7FF), (0, 0x3FF))


# --- the NumPy model of the kernel -----------------------------------------------------------------

def order_keys(values: np.ndarray) -> np.ndarray:
    """OrderKey: float32 -> uint32 in the selection order (NaN -> 1, -0.0 -> +0.0's key)."""
    bits = np.asarray(values, np.float32).view(np.uint32).copy()
    bits[bits == 0x80000000] = 0
    keys = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    return np.where((bits & 0x7FFFFFFF) > 0x7F800000, np.uint32(1), keys)


# The leader's candidate lists (kWarps lists of kCandidatesPerWarp in indexer_topk.cuh).
LISTS, LIST_CAPACITY = 16, 512


def leader_lists(chunks, first_bin: int):
    """GatherToLeader's layout: each CTA's candidate count (its own histogram's keys in bins >=
    first_bin, which PushFirstPass's leader reads from each CTA's counts from the top), and the
    entries each CTA writes, in position order after the CTAs before it, into LISTS
    contiguous lists of per_list = ceil(total / LISTS). Returns (keys, positions) read back list by
    list as the leader reads them, or None when the candidates number more than the lists hold."""
    counts = [int((np.bincount(keys >> 21, minlength=BINS)[first_bin:]).sum()) for _, keys in chunks]
    total = sum(counts)
    if total > LISTS * LIST_CAPACITY:
        return None
    per_list = -(-total // LISTS)
    assert per_list <= LIST_CAPACITY
    list_keys = np.zeros(LISTS * LIST_CAPACITY, np.int64)
    list_positions = np.full(LISTS * LIST_CAPACITY, -1, np.int64)
    written = np.zeros(LISTS * LIST_CAPACITY, bool)
    before = 0
    for (positions, keys), count in zip(chunks, counts):
        kept = (keys >> 21) >= first_bin
        assert kept.sum() == count  # the histograms' count is the CTA's
        index = before + np.arange(count)
        entry = (index // per_list) * LIST_CAPACITY + index % per_list
        assert not written[entry].any()
        written[entry] = True
        list_keys[entry], list_positions[entry] = keys[kept], positions[kept]
        before += count
    list_counts = [min(max(total - w * per_list, 0), per_list) for w in range(LISTS)]
    read = np.concatenate([w * LIST_CAPACITY + np.arange(c) for w, c in enumerate(list_counts)])
    assert written.sum() == total == len(read) and written[read].all()
    return list_keys[read].astype(np.uint32), list_positions[read]


def cluster_top_k_model(row: np.ndarray, lead: int, k: int, ctas: int,
                        leader: bool = True) -> np.ndarray:
    """One row of len positions (its start `lead` floats past a 16-byte boundary) through C CTAs,
    as TopKClusterKernel computes it; int64 [k]. leader: the candidates go to the leader after the
    first pass where the lists hold them (the host left room), else every pass runs cluster-wide."""
    length = len(row)
    if length <= k:
        return np.concatenate([np.arange(length), np.full(k - length, -1)])
    groups = -(-(length + lead) // 4)
    per_cta = -(-groups // ctas)
    chunks = []  # per CTA: (positions of its in-row slots, their keys)
    for rank in range(ctas):
        g_begin = min(rank * per_cta, groups)
        n_groups = min(per_cta, groups - g_begin)
        first_position = g_begin * 4 - lead
        lo = max(0, -first_position)
        hi = max(0, min(n_groups * 4, length - first_position))
        positions = first_position + np.arange(lo, hi)
        chunks.append((positions, order_keys(row[positions])))
    prefix = mask = 0
    remaining = k
    for pass_index, (shift, digit_mask) in enumerate(PASSES):
        hist = np.zeros(BINS, np.int64)
        for _, keys in chunks:  # each CTA's histogram, summed over the cluster
            matching = keys[(keys & mask) == prefix]
            hist += np.bincount((matching >> shift) & digit_mask, minlength=BINS)
        above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0]])  # keys in higher bins
        chosen = int(np.flatnonzero((above < remaining) & (above + hist >= remaining))[0])
        remaining -= int(above[chosen])
        prefix |= chosen << shift
        mask |= digit_mask << shift
        decided = hist[chosen] == remaining
        if pass_index == 0 and leader:
            gathered = leader_lists(chunks, chosen)
            if gathered is not None:  # the leader ends the select over the candidates alone
                chunks = [(gathered[1], gathered[0])]
                if not decided:
                    return one_cta_refine(chunks[0], k, prefix, mask, remaining)
        if decided:
            break
    out = np.full(k, -1, np.int64)
    above_seen = ties_seen = 0  # in the CTAs before this one
    for positions, keys in chunks:
        is_above = (keys & mask) > prefix
        is_tie = (keys & mask) == prefix
        above_before = above_seen + np.cumsum(is_above) - is_above
        ties_before = ties_seen + np.cumsum(is_tie) - is_tie
        kept = is_above | (is_tie & (ties_before < remaining))
        slots = above_before + np.minimum(ties_before, remaining)
        assert (slots[kept] < k).all() and len(np.unique(slots[kept])) == kept.sum()
        out[slots[kept]] = positions[kept]
        above_seen += int(is_above.sum())
        ties_seen += int(is_tie.sum())
    return out


def one_cta_refine(candidates, k: int, prefix: int, mask: int, remaining: int) -> np.ndarray:
    """The leader's later passes and compaction over the candidates in position order (the one-CTA
    kernel's CountCandidates, RadixPass and CompactCandidates); int64 [k]."""
    positions, keys = candidates
    for shift, digit_mask in PASSES[1:]:
        matching = keys[(keys & mask) == prefix]
        hist = np.bincount((matching >> shift) & digit_mask, minlength=BINS)
        above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0]])
        chosen = int(np.flatnonzero((above < remaining) & (above + hist >= remaining))[0])
        remaining -= int(above[chosen])
        prefix |= chosen << shift
        mask |= digit_mask << shift
        if hist[chosen] == remaining:
            break
    is_above, is_tie = (keys & mask) > prefix, (keys & mask) == prefix
    ties_before = np.cumsum(is_tie) - is_tie
    kept = is_above | (is_tie & (ties_before < remaining))
    slots = np.cumsum(is_above) - is_above + np.minimum(ties_before, remaining)
    out = np.full(k, -1, np.int64)
    out[slots[kept]] = positions[kept]
    return out


def adversarial_row(rng: np.random.Generator, case: int, width: int) -> np.ndarray:
    """float32 [width]: the selection rule's hard cases (ties, NaN, infinities, signed zeros,
    subnormals, one value over the whole row, ties straddling the chunk boundaries)."""
    row = rng.standard_normal(width).astype(np.float32)
    if case == 1:
        row[:] = rng.integers(0, 4, width)
    elif case == 2:
        row[rng.random(width) < 0.3] = np.nan
        row[rng.random(width) < 0.2] = -np.inf
    elif case == 3:
        row[:] = np.where(rng.random(width) < 0.5, np.nan, -np.inf)
    elif case == 4:
        row[:] = (np.uint32(0x3F900000)
                  | rng.integers(0, 1 << 10, width).astype(np.uint32)).view(np.float32)
        row[rng.random(width) < 0.5] = row[0]
    elif case == 5:
        row[:] = np.where(rng.random(width) < 0.5, -0.0, 0.0)
        row[rng.random(width) < 0.1] = -1.0
    elif case == 6:
        row[:] = rng.integers(-5, 6, width).astype(np.float32) * np.float32(1e-45)
    elif case == 7:
        row[:] = 0.25
    elif case == 8:
        row[:] = np.nan
    elif case == 9:  # one value tied across the whole row's second half, larger values before it
        row[width // 2:] = 1.0
        row[: width // 2] = rng.uniform(2, 3, width // 2)
    return row


@pytest.mark.parametrize("ctas", [1, 2, 3, 4, 5, 7, 8, 16])  # any width the plan may pick
@pytest.mark.parametrize("lead", [0, 1, 3])
@pytest.mark.parametrize("width,k", [(5000, 2048), (20001, 2048), (2049, 2048), (37, 5),
                                     (65536, 2048), (9, 1)])
@pytest.mark.parametrize("leader", [True, False])
def test_model_matches_the_rule(ctas, lead, width, k, leader):
    rng = np.random.default_rng(ctas * 1000 + lead * 100 + width + k)
    for case in range(10):
        row = adversarial_row(rng, case, width)
        expected = top_k_np(row, 0, width, k)
        np.testing.assert_array_equal(cluster_top_k_model(row, lead, k, ctas, leader), expected,
                                      err_msg=f"case {case}")


def test_model_takes_both_paths_after_the_first_pass():
    """The grid above reaches the leader's lists (normal rows) and the cluster passes (a tie-heavy
    row whose threshold bin holds more than the lists)."""
    rng = np.random.default_rng(0)
    normal = order_keys(adversarial_row(rng, 0, 65536))
    tied = order_keys(adversarial_row(rng, 7, 65536))
    positions = np.arange(65536)

    def first_bin(keys):
        hist = np.bincount(keys >> 21, minlength=BINS)
        return int(np.flatnonzero(np.cumsum(hist[::-1])[::-1] >= 2048)[-1])

    assert leader_lists([(positions, normal)], first_bin(normal)) is not None
    assert leader_lists([(positions, tied)], first_bin(tied)) is None


def test_model_rows_shorter_than_the_cluster():
    """Rows with fewer groups than CTAs leave CTAs without keys; they still take part."""
    rng = np.random.default_rng(5)
    for width in (6, 9, 13):
        for case in range(10):
            row = adversarial_row(rng, case, width)
            for lead in range(4):
                np.testing.assert_array_equal(cluster_top_k_model(row, lead, 3, 8),
                                              top_k_np(row, 0, width, 3))


# --- the host plan ---------------------------------------------------------------------------------

PLAN_DRIVER = r"""
#include <cstdio>
#include "sm90/indexer_topk_plan.h"
// stdin: lines "R S num_sms wide"; stdout: lines "ok ctas groups_capacity".
int main() {
  namespace topk = jax_sparse_mla::indexer_topk;
  long long rows, width;
  int sms, wide;
  while (std::scanf("%lld %lld %d %d", &rows, &width, &sms, &wide) == 4) {
    topk::ClusterPlan plan{0, 0};
    // As many clusters of C at once as SMs / C hold (the GPU's occupancy calculator, on an ideal
    // part); none above the portable 8 where `wide` is 0 (a device that refuses them:
    // MaxActiveClusters counts 0).
    topk::ActiveClusters active;
    for (int c = 1; c <= topk::kMaxFastClusterSize; ++c) {
      active[c - 1] = c > topk::kMaxClusterSize && !wide ? 0 : sms / c;
    }
    const bool ok = topk::PlanCluster(rows, width, active, &plan);
    std::printf("%d %d %lld\n", ok ? 1 : 0, plan.ctas, static_cast<long long>(plan.groups_capacity));
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def plan_driver(tmp_path_factory) -> pathlib.Path:
    return compile_host_program(PLAN_DRIVER, tmp_path_factory.mktemp("topk_plan"))


def plan(driver, cases, wide: bool = True):
    """PlanCluster's (ok, ctas, groups_capacity) for each (rows, width, SMs); wide: the device runs
    clusters above the portable 8 CTAs."""
    text = "".join(f"{r} {s} {sms} {int(wide)}\n" for r, s, sms in cases)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, check=True)
    return [tuple(int(x) for x in line.split()) for line in out.stdout.splitlines()]


def test_plan_accepts_exactly_the_checked_widths(plan_driver):
    widest = topk.MAX_CLUSTER_WIDTH
    results = plan(plan_driver, [(1, widest, 132), (1, widest + 1, 132), (4096, widest, 132),
                                 (4096, widest + 1, 132)])
    assert [ok for ok, _, _ in results] == [1, 0, 1, 0]


def test_plan_of_the_benchmarked_shapes(plan_driver):
    """The split docs/kernels/sm90-indexer.md quotes for an H200 (132 SMs)."""
    cases = {(1, 131072): 16, (1, 65536): 16, (1, 8192): 4, (32, 65536): 4, (32, 131072): 4,
             (128, 8192): 1, (128, 65536): 2, (4096, 131072): 3, (40, 65536): 3, (24, 131072): 5,
             (16, 98304): 8}
    results = plan(plan_driver, [(r, s, 132) for r, s in cases])
    assert [ctas for _, ctas, _ in results] == list(cases.values())


def test_plan_without_wide_clusters_stays_portable(plan_driver):
    """A device that runs no cluster above 8 CTAs (its occupancy query refuses them) gets the
    portable plan: every row still fits, batch 1 at 8 CTAs."""
    cases = [(1, 131072, 132), (1, 65536, 132), (2, 65536, 132), (1, topk.MAX_CLUSTER_WIDTH, 132)]
    results = plan(plan_driver, cases, wide=False)
    assert [(ok, ctas) for ok, ctas, _ in results] == [(1, 8), (1, 8), (1, 8), (1, 8)]


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_plan_fits_every_row_and_fills_the_gpu(plan_driver, sms):
    cases = [(r, s, sms) for r in (1, 2, 4, 17, 32, 128, 4096)
             for s in (1, 100, 2048, 2049, 8192, 65536, 131072, 262144, topk.MAX_CLUSTER_WIDTH)]
    for (rows, width, _), (ok, ctas, capacity) in zip(cases, plan(plan_driver, cases)):
        assert ok == 1
        assert 1 <= ctas <= 16
        groups = -(-(width + 3) // 4)  # the most groups a row of this width spans (lead <= 3)
        assert capacity == -(-groups // ctas) and capacity * 16 <= 176 * 1024
        fewest = -(-groups // 11264)
        if ctas > fewest:
            # Widened only while the grid stayed in one wave (one CTA per SM) and chunks kept
            # >= 2048 keys.
            assert rows * ctas <= sms and capacity * 4 >= 2048
        else:
            assert ctas == max(1, fewest)
        for wider in range(ctas + 1, 17):
            # Not widened although one wave had room: the chunks would have been too small.
            assert rows * wider > sms or -(-groups // wider) * 4 < 2048


# --- the registration ------------------------------------------------------------------------------

OPS = {"top_k_per_row": (topk.TARGET, topk.TARGET_STREAM, topk.TARGET_CLUSTER),
       "top_k_per_row_decode": (topk.TARGET_DECODE, topk.TARGET_DECODE_STREAM,
                                topk.TARGET_DECODE_CLUSTER)}


@pytest.fixture
def fake_sm90(monkeypatch):
    """A faked SM90 device whose extension holds all six top-k targets and sm_90a code."""
    monkeypatch.setattr(registry, "current_device_capability", lambda: (9, 0))
    monkeypatch.setattr(native, "targets", frozenset(t for ts in OPS.values() for t in ts))
    monkeypatch.setattr(native, "module", object())
    monkeypatch.setattr(native, "build_info", lambda: {"sm90": "90a"})


@pytest.mark.parametrize("op", sorted(OPS))
def test_registered_validated_with_a_shape_rule(op):
    ours = [k for k in registry.registered_op_kernels(op) if k.name == "sm90_topk_cluster"]
    assert len(ours) == 1
    kernel = ours[0]
    assert kernel.native and kernel.capability_majors == (9,) and kernel.validated
    assert kernel.check is topk.check_cluster_problem
    assert kernel.slower_here is topk.cluster_slower_here


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("width,rows", [(2048, 1), (8192, 32), (8192, 128), (8193, 1), (8193, 48),
                                        (8193, 49), (65536, 48), (65536, 49), (65536, 132),
                                        (65536, 133), (131072, 24), (131072, 25), (131072, 34),
                                        (327677, 12), (327677, 13), (327677, 200)])
def test_auto_picks_the_form_that_measured_fastest(fake_sm90, monkeypatch, op, width, rows):
    """native prefers the cluster wherever it fits. auto: the register build for rows of at most
    8192 positions and for more rows than SMs (132 here); the cluster for wider rows, at most 48
    of them, whose smallest clusters take at most 3/4 of the SMs; the streaming build for the other
    wide rows."""
    monkeypatch.setattr(registry, "device_sm_count", lambda: 132)
    call = problem(op, num_keys=width, num_rows=rows)
    assert registry.select_op_kernel(op, "native", call).name == "sm90_topk_cluster"
    if width <= 8192 or rows > 132:
        want = "sm90_topk"
    elif rows <= 48 and rows * topk.min_cluster_size(width) <= 0.75 * 132:
        want = "sm90_topk_cluster"
    else:
        want = "sm90_topk_stream"
    assert registry.select_op_kernel(op, "auto", call).name == want


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("rows,want", [(8, "sm90_topk_stream"), (132, "sm90_topk_stream"),
                                       (133, "sm90_topk")])
def test_rows_wider_than_a_cluster_run_one_cta(fake_sm90, monkeypatch, op, rows, want):
    monkeypatch.setattr(registry, "device_sm_count", lambda: 132)
    wide = problem(op, num_keys=topk.MAX_CLUSTER_WIDTH + 1, num_rows=rows)
    assert registry.select_op_kernel(op, "native", wide).name == "sm90_topk_stream"
    assert registry.select_op_kernel(op, "auto", wide).name == want


def test_a_cluster_wider_than_one_wave_runs_one_cta(fake_sm90, monkeypatch):
    """10 rows of 8-CTA clusters on 100 SMs: more than 3/4 of them, so auto streams them instead."""
    monkeypatch.setattr(registry, "device_sm_count", lambda: 100)
    call = problem("top_k_per_row", num_keys=327677, num_rows=10)
    assert registry.select_op_kernel("top_k_per_row", "auto", call).name == "sm90_topk_stream"
    assert "10 rows x 8 CTAs exceed 75% of 100 SMs" in topk.cluster_slower_here(call)


def test_min_cluster_size_is_where_the_plan_starts(plan_driver):
    """min_cluster_size(S) is PlanCluster's cluster before it widens (with no SMs to widen into)."""
    widths = [1, 2048, 8192, 45053, 45054, 65536, 90109, 90110, 131072, 135165, 135166, 180221,
              180222, topk.MAX_CLUSTER_WIDTH]
    results = plan(plan_driver, [(1, s, 0) for s in widths])
    assert [ctas for _, ctas, _ in results] == [topk.min_cluster_size(s) for s in widths]
    assert [topk.min_cluster_size(s) for s in (45053, 45054, 90109, 90110, 131072, 135166,
                                               topk.MAX_CLUSTER_WIDTH)] == [1, 2, 2, 3, 3, 4, 8]


def test_shape_rule_says_why(monkeypatch):
    monkeypatch.setattr(registry, "device_sm_count", lambda: 132)
    assert topk.cluster_slower_here(problem("top_k_per_row", num_keys=8193)) is None
    why = topk.cluster_slower_here(problem("top_k_per_row", num_keys=4096))
    assert "4096 <= 8192" in why and "one-CTA kernel measured faster" in why
    why = topk.cluster_slower_here(problem("top_k_per_row", num_keys=65536, num_rows=49))
    assert "49 rows > 48" in why and "streaming build measured faster" in why
    assert topk.stream_slower_here(problem("top_k_per_row", num_keys=65536, num_rows=132)) is None
    why = topk.stream_slower_here(problem("top_k_per_row", num_keys=8192, num_rows=8))
    assert "8192 <= 8192" in why and "register build measured faster" in why
    why = topk.stream_slower_here(problem("top_k_per_row", num_keys=65536, num_rows=133))
    assert "133 rows exceed one CTA per SM on 132 SMs" in why


@pytest.mark.parametrize("override,message", [
    (dict(num_keys=topk.MAX_CLUSTER_WIDTH + 1), "exceeds the 360445 positions"),
    (dict(num_rows=topk.MAX_CLUSTER_ROWS + 1), "R (rows) must be at most"),
    (dict(top_k=0), "k must be positive"),
    (dict(dtypes=("bfloat16", "int32", "int32")), "needs float32 logits"),
])
def test_check_rejects(fake_sm90, override, message):
    assert message in topk.check_cluster_problem(problem("top_k_per_row", **override), (9, 0))


def test_check_accepts_the_limits(fake_sm90):
    edge = problem("top_k_per_row", num_keys=topk.MAX_CLUSTER_WIDTH,
                   num_rows=topk.MAX_CLUSTER_ROWS)
    assert topk.check_cluster_problem(edge, (9, 0)) is None


def test_public_ops_lower_to_the_cluster_calls(fake_sm90):
    logits = jax.ShapeDtypeStruct((6, 5000), jnp.float32)
    rows = jax.ShapeDtypeStruct((6,), jnp.int32)
    text = jax.jit(lambda l, s, e: jsm.top_k_per_row(l, s, e, k=2048, implementation="native")
                   ).lower(logits, rows, rows).as_text()
    assert f"@{topk.TARGET_CLUSTER}(" in text and "tensor<6x2048xi32>" in text
    lens = jax.ShapeDtypeStruct((3,), jnp.int32)
    text = jax.jit(lambda l, c: jsm.top_k_per_row_decode(l, c, next_n=2, k=64,
                                                          implementation="native")
                   ).lower(logits, lens).as_text()
    assert f"@{topk.TARGET_DECODE_CLUSTER}(" in text and "next_n = 2" in text
    text = jax.jit(lambda l, s, e: jsm.top_k_per_row(l, s, e, k=2048, implementation="auto")
                   ).lower(logits, rows, rows).as_text()
    assert f"@{topk.TARGET}(" in text and topk.TARGET_CLUSTER not in text


def test_extension_registers_the_cluster_targets_as_graph_safe():
    module = require_native()
    if "sm90" not in module.build_info():
        pytest.skip("the extension was built without the sm90 family")
    cluster_targets = {topk.TARGET_CLUSTER, topk.TARGET_DECODE_CLUSTER}
    assert cluster_targets <= set(module.registrations())
    assert cluster_targets <= set(module.command_buffer_targets())
