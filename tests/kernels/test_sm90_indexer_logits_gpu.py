"""GPU tests of the SM90 indexer logits kernels (ffi/sm90/indexer_logits.cuh) behind
fp8_paged_mqa_logits / fp8_mqa_logits.

Each case runs the kernel (implementation="native") and compares the result with the pure-JAX path
(implementation="xla") on the same fp8 inputs over the whole output, and with a float64 NumPy
reference on sampled columns of every row:
  - the -inf masks are identical and equal to the contract's (col < L - next_n + j + 1 for decode,
    start <= col < end for prefill), and no valid entry is NaN or infinite;
  - calc_diff (upstream's criterion, 1 - 2 sum(xy) / sum(x^2 + y^2) in float64) < 1e-3;
  - |native - exact| <= 1e-4 * k_scale[s] * sum_h |w_h| sum_d |q_hd k_d|. The products of e4m3
    values are exact in fp32; only the accumulation of 128 dims and then of H <= 64 heads rounds, by
    at most (128 + 64) * 2^-24 ~ 1.1e-5 of that magnitude sum in IEEE fp32. The bound leaves ~10x
    for the tensor cores' fp32 accumulation, which aligns addends before adding (not IEEE).
Poison: cache tokens past each request's length (the rest of its last block) and the spare blocks
hold e4m3 NaN values and NaN scales, and block-table entries past each context are junk (negative,
past the cache, or other requests' blocks), so any read of a masked position would show as NaN or
a wrong mask. Skipped without an SM90 GPU or without the compiled extension;
JAX_SPARSE_MLA_REQUIRE_GPU=1 makes that a failure. `test_sanitizer_clean` runs a small grid under
compute-sanitizer memcheck and racecheck.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import sm90_indexer_logits
from gpu_subprocess import assert_matches_inside_command_buffers, assert_sanitizer_clean
from requirements import gpu_test_marks, sm90_skip_reason

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = 64
PAGE = BLOCK * 132


SKIP_REASON = sm90_skip_reason(sm90_indexer_logits.PAGED_TARGET, sm90_indexer_logits.RAGGED_TARGET)
pytestmark = gpu_test_marks(SKIP_REASON, "the SM90 indexer-logits tests")

def calc_diff(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


def random_e4m3(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape, np.float32) * 8).astype(E4M3)


def random_scales(rng, shape) -> np.ndarray:
    return np.exp2(rng.integers(-9, -3, shape)).astype(np.float32)


# --- decode ---------------------------------------------------------------------------------------

def make_paged(rng, batch, next_n, heads, lengths, max_context_len):
    """(q, cache, weights, lengths, table) as NumPy arrays, poisoned as the module docstring
    says."""
    lengths = np.asarray(lengths, np.int32)
    blocks = [-(-int(length) // BLOCK) for length in lengths]
    width = -(-max_context_len // BLOCK) + 2  # wider than needed
    num_blocks = sum(blocks) + 3  # 3 spare (poisoned) blocks
    order = rng.permutation(num_blocks).astype(np.int32)
    table = rng.integers(-3, num_blocks + 3, (batch, width)).astype(np.int32)  # junk everywhere
    values = random_e4m3(rng, (num_blocks, BLOCK, 128)).view(np.uint8)
    scales = random_scales(rng, (num_blocks, BLOCK))
    used = np.zeros((num_blocks, BLOCK), bool)
    start = 0
    for b, (length, count) in enumerate(zip(lengths, blocks)):
        ids = order[start:start + count]
        start += count
        table[b, :count] = ids
        for i, block in enumerate(ids):
            used[block, : min(BLOCK, int(length) - i * BLOCK)] = True
    values[~used] = 0x7F  # e4m3 NaN
    scales[~used] = np.nan
    cache = np.concatenate([values.reshape(num_blocks, -1), scales.view(np.uint8)], axis=1)
    q = random_e4m3(rng, (batch, next_n, heads, 128))
    weights = (rng.standard_normal((batch * next_n, heads), np.float32) * 0.1).astype(np.float32)
    return q, cache.reshape(num_blocks, BLOCK, 132), weights, lengths, table


def paged_reference(q, cache, weights, lengths, table, rows_cols):
    """float64 logits and magnitude bounds at the given (row, column) pairs (valid ones only)."""
    batch, next_n, heads, _ = q.shape
    pages = cache.reshape(cache.shape[0], PAGE)
    rows, cols = rows_cols
    b = rows // next_n
    block = np.clip(table[b, cols // BLOCK], 0, cache.shape[0] - 1)
    offset = cols % BLOCK
    k = pages[block[:, None], offset[:, None] * 128 + np.arange(128)].view(E4M3).astype(np.float64)
    scale = pages[block[:, None], BLOCK * 128 + offset[:, None] * 4 + np.arange(4)].copy()
    scale = scale.view(np.float32)[:, 0].astype(np.float64)
    qr = q.reshape(batch * next_n, heads, 128)[rows].astype(np.float64)  # [P, H, 128]
    products = qr * k[:, None, :]
    dots = products.sum(-1)
    w = weights[rows].astype(np.float64)
    exact = scale * (w * np.maximum(dots, 0)).sum(-1)
    magnitude = scale * (np.abs(w) * np.abs(products).sum(-1)).sum(-1)
    return exact, magnitude


def sample_positions(rng, limits, width, per_row=256):
    rows, cols = [], []
    for r, limit in enumerate(limits):
        hi = min(max(int(limit), 0), width)
        if hi == 0:
            continue
        picks = {0, hi - 1, hi // 2}
        picks.update(rng.integers(0, hi, min(per_row, hi)).tolist())
        rows += [r] * len(picks)
        cols += sorted(picks)
    return np.asarray(rows, np.int64), np.asarray(cols, np.int64)


def check_against_references(out, ref_out, exact_at, magnitude_at, positions, expected_valid):
    out, ref_out = np.asarray(out), np.asarray(ref_out)
    assert out.dtype == np.float32 and out.shape == expected_valid.shape
    np.testing.assert_array_equal(np.isneginf(out), ~expected_valid)
    np.testing.assert_array_equal(np.isneginf(ref_out), ~expected_valid)
    assert np.isfinite(out[expected_valid]).all()
    if expected_valid.any():
        assert calc_diff(out[expected_valid], ref_out[expected_valid]) < 1e-3
        bound = 1e-4 * magnitude_at + 1e-30
        error = np.abs(out[positions].astype(np.float64) - exact_at)
        assert (error <= bound).all(), float((error / bound).max())


def check_paged(batch, next_n, heads, lengths, max_context_len, seed=0, jit=False):
    rng = np.random.default_rng(seed)
    q, cache, weights, lengths, table = make_paged(rng, batch, next_n, heads, lengths,
                                                   max_context_len)
    args = (jnp.asarray(q), jnp.asarray(cache), jnp.asarray(weights), jnp.asarray(lengths),
            jnp.asarray(table))

    native_fn = functools.partial(jsm.fp8_paged_mqa_logits, max_context_len=max_context_len,
                                  implementation="native")
    out = (jax.jit(native_fn) if jit else native_fn)(*args)
    ref_out = jsm.fp8_paged_mqa_logits(*args, max_context_len=max_context_len,
                                       implementation="xla")
    limits = (lengths[:, None] - next_n + 1 + np.arange(next_n)).reshape(-1)
    expected_valid = np.arange(max_context_len)[None, :] < limits[:, None]
    positions = sample_positions(rng, limits, max_context_len)
    exact, magnitude = paged_reference(q, cache, weights, lengths, table, positions)
    check_against_references(out, ref_out, exact, magnitude, positions, expected_valid)


# (B, next_n, H, lengths, max_context_len); lengths "r<max>" draws B random lengths in [0, max].
PAGED_GRID = [
    (1, 1, 64, [1], 64),
    (1, 1, 32, [0], 64),
    (3, 2, 64, [0, 1, 2], 128),           # empty, shorter than next_n, exactly next_n
    (4, 1, 32, [37, 64, 65, 200], 256),   # mid-block, full block, one past, mid-block
    (5, 2, 32, [1, 65, 130, 255, 256], 256),  # up to max_context_len
    (4, 2, 64, [256, 3, 128, 129], 300),  # max_context_len not a multiple of 64
    (7, 3, 64, [0, 2, 3, 4, 100, 64, 65], 128),  # next_n = 3: flattened
    (6, 4, 32, [5, 70, 130, 1, 0, 192], 192),    # next_n = 4: flattened
    (32, 1, 64, "r8192", 8192),
    (32, 2, 32, "r8192", 8192),
    (128, 1, 64, "r16384", 16384),
    (128, 2, 64, "r16384", 16384),
    (1, 1, 64, [131072], 131072),
    (2, 2, 64, [131072, 70001], 131072),
    (2, 1, 32, [131072, 9], 131072),
]


def lengths_for(spec, batch, seed):
    if isinstance(spec, str):
        rng = np.random.default_rng(seed + 99)
        top = int(spec[1:])
        lengths = rng.integers(0, top + 1, batch)
        lengths[0] = top
        return lengths.tolist()
    return spec


@pytest.mark.parametrize("batch,next_n,heads,lengths,max_context_len", PAGED_GRID)
def test_paged_matches_references(batch, next_n, heads, lengths, max_context_len):
    check_paged(batch, next_n, heads, lengths_for(lengths, batch, batch), max_context_len)


@pytest.mark.parametrize("next_n,heads", [(1, 64), (2, 32), (3, 64)])
def test_paged_under_jit(next_n, heads):
    check_paged(9, next_n, heads, [0, 1, 2, 63, 64, 65, 500, 1000, 1024], 1024, seed=3,
                jit=True)


def test_paged_lowers_to_the_custom_call():
    rng = np.random.default_rng(0)
    q, cache, weights, lengths, table = make_paged(rng, 2, 1, 64, [10, 70], 128)
    fn = jax.jit(functools.partial(jsm.fp8_paged_mqa_logits, max_context_len=128,
                                   implementation="native"))
    text = fn.lower(q, cache, weights, lengths, table).as_text()
    assert f"@{sm90_indexer_logits.PAGED_TARGET}(" in text


def test_paged_lengths_past_the_width_under_jit_are_cut():
    """Under jit a length > max_context_len cannot be rejected: the row is cut at the width."""
    rng = np.random.default_rng(5)
    q, cache, weights, lengths, table = make_paged(rng, 2, 2, 64, [256, 256], 256)
    args = (jnp.asarray(q), jnp.asarray(cache), jnp.asarray(weights), jnp.asarray([256, 300]),
            jnp.asarray(table))
    run = lambda impl: jax.jit(functools.partial(  # noqa: E731
        jsm.fp8_paged_mqa_logits, max_context_len=200, implementation=impl))(*args)
    out, ref_out = np.asarray(run("native")), np.asarray(run("xla"))
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref_out))
    valid = ~np.isneginf(ref_out)
    assert calc_diff(out[valid], ref_out[valid]) < 1e-3


# --- prefill --------------------------------------------------------------------------------------

def make_ragged(rng, num_rows, num_keys, heads, ranges):
    q = random_e4m3(rng, (num_rows, heads, 128))
    k = random_e4m3(rng, (num_keys, 128))
    k_scale = random_scales(rng, (num_keys,))
    weights = (rng.standard_normal((num_rows, heads), np.float32) * 0.1).astype(np.float32)
    starts, ends = (np.asarray(x, np.int32) for x in ranges)
    return q, k, k_scale, weights, starts, ends


def ranges_for(kind, rng, num_rows, num_keys):
    if kind == "causal":  # requests of random sizes, concatenated; a row sees its prefix
        starts, ends = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
        row, key = 0, 0
        while row < num_rows:
            size = int(rng.integers(1, max(2, num_rows // 3) + 1))
            size = min(size, num_rows - row)
            room = max(1, (num_keys - key) - size)
            context = int(rng.integers(0, room + 1)) if key < num_keys else 0
            for i in range(size):
                starts[row + i] = min(key, num_keys)
                ends[row + i] = min(key + context + i + 1, num_keys)
            key += context + size
            row += size
        return starts, ends
    if kind == "random":  # any ranges, a quarter of them empty or reversed
        a = rng.integers(0, num_keys + 1, num_rows)
        b = rng.integers(0, num_keys + 1, num_rows)
        starts, ends = np.minimum(a, b), np.maximum(a, b)
        flip = rng.random(num_rows) < 0.25
        starts[flip], ends[flip] = ends[flip], starts[flip]
        return starts.astype(np.int32), ends.astype(np.int32)
    if kind == "full":
        return np.zeros(num_rows, np.int32), np.full(num_rows, num_keys, np.int32)
    raise ValueError(kind)


def ragged_reference(q, k, k_scale, weights, positions):
    rows, cols = positions
    products = q[rows].astype(np.float64) * k[cols].astype(np.float64)[:, None, :]
    dots = products.sum(-1)
    w = weights[rows].astype(np.float64)
    scale = k_scale[cols].astype(np.float64)
    return (scale * (w * np.maximum(dots, 0)).sum(-1),
            scale * (np.abs(w) * np.abs(products).sum(-1)).sum(-1))


def check_ragged(num_rows, num_keys, heads, kind, seed=0, jit=False):
    rng = np.random.default_rng(seed + num_rows + num_keys)
    q, k, k_scale, weights, starts, ends = make_ragged(
        rng, num_rows, num_keys, heads, ranges_for(kind, rng, num_rows, num_keys))
    args = tuple(jnp.asarray(x) for x in (q, k, k_scale, weights, starts, ends))

    native_fn = functools.partial(jsm.fp8_mqa_logits, implementation="native")
    out = (jax.jit(native_fn) if jit else native_fn)(*args)
    ref_out = jsm.fp8_mqa_logits(*args, implementation="xla")
    columns = np.arange(num_keys)[None, :]
    expected_valid = (columns >= starts[:, None]) & (columns < ends[:, None])
    rows, cols = [], []
    for r in range(num_rows):
        if ends[r] > starts[r]:
            picks = {int(starts[r]), int(ends[r]) - 1}
            picks.update(rng.integers(starts[r], ends[r], 64).tolist())
            rows += [r] * len(picks)
            cols += sorted(picks)
    positions = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    exact, magnitude = ragged_reference(q, k, k_scale, weights, positions)
    check_against_references(out, ref_out, exact, magnitude, positions, expected_valid)


RAGGED_GRID = [
    (1, 1, 64, "full"),
    (3, 70, 32, "random"),       # rows not a multiple of the CTA's, keys not of the tile
    (5, 64, 64, "causal"),
    (37, 1000, 64, "random"),
    (64, 4099, 32, "causal"),
    (257, 2048, 64, "causal"),
    (1024, 8192, 64, "causal"),
    (2048, 16384, 32, "causal"),
    (4, 131072 + 37, 64, "random"),
]


@pytest.mark.parametrize("num_rows,num_keys,heads,kind", RAGGED_GRID)
def test_ragged_matches_references(num_rows, num_keys, heads, kind):
    check_ragged(num_rows, num_keys, heads, kind)


@pytest.mark.parametrize("heads", [32, 64])
def test_ragged_under_jit(heads):
    check_ragged(41, 700, heads, "random", seed=4, jit=True)


@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 5, 7])
def test_every_count_of_tiles_per_cta(tiles, monkeypatch):
    """CTAs of 1 to 7 tiles, and chunks cut short by a request's length or the row ranges: the
    kernels run a CTA's tiles two at a time and peel the last one or two."""
    monkeypatch.setattr(sm90_indexer_logits, "tiles_per_cta", lambda *_: tiles)
    check_paged(3, 1, 64, [1000, 448, 1], 1024, seed=tiles)
    check_paged(2, 2, 32, [1000, 200], 1024, seed=tiles)
    check_ragged(9, 1000, 64, "causal", seed=tiles)
    check_ragged(11, 900, 32, "random", seed=tiles)


# --- compute-sanitizer ----------------------------------------------------------------------------

MEMCHECK_SCRIPT = textwrap.dedent("""
    import test_sm90_indexer_logits_gpu as cases
    for shape in cases.MEMCHECK_PAGED:
        cases.check_paged(*shape)
    for shape in cases.MEMCHECK_RAGGED:
        cases.check_ragged(*shape)
    print("MEMCHECK GRID PASSED")
""")
MEMCHECK_PAGED = [(3, 2, 64, [0, 1, 130], 192), (4, 1, 32, [64, 65, 3, 256], 256),
                  (3, 3, 64, [5, 0, 64], 64)]
MEMCHECK_RAGGED = [(5, 70, 64, "random"), (9, 300, 32, "causal")]


@pytest.mark.sanitizer
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(tool, tmp_path):
    """A small grid under compute-sanitizer (memcheck: out-of-bounds and misaligned accesses;
    racecheck: shared-memory hazards): every case matches and the tool reports nothing."""
    assert_sanitizer_clean(MEMCHECK_SCRIPT, tmp_path, tool)


# --- command buffers ------------------------------------------------------------------------------

COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_sparse_mla as jsm
    from jax_sparse_mla.kernels import sm90_indexer_logits as logits
    import test_sm90_indexer_logits_gpu as cases
    rng = np.random.default_rng(0)
    paged = tuple(jnp.asarray(x) for x in cases.make_paged(rng, 4, 2, 64, [5, 70, 130, 256], 256))
    ragged = tuple(jnp.asarray(x) for x in cases.make_ragged(
        rng, 9, 300, 32, cases.ranges_for("causal", rng, 9, 300)))

    def loop(impl):
        def run(paged, ragged):
            q, cache, weights, lengths, table = paged
            def body(i, acc):
                # Lengths that change per iteration, so that the custom calls' operands are
                # computed inside the loop and both paths see the same inputs.
                a = jsm.fp8_paged_mqa_logits(q, cache, weights, lengths - i, table,
                                             max_context_len=256, implementation=impl)
                b = jsm.fp8_mqa_logits(*ragged[:5], ragged[5] - i, implementation=impl)
                return (acc[0] + jnp.where(jnp.isneginf(a), 0.0, a),
                        acc[1] + jnp.where(jnp.isneginf(b), 0.0, b))
            zeros = (jnp.zeros((8, 256), jnp.float32), jnp.zeros((9, 300), jnp.float32))
            return jax.lax.fori_loop(0, 3, body, zeros)
        return jax.jit(run)(paged, ragged)

    native, reference = loop("native"), loop("xla")
    close = all(cases.calc_diff(np.asarray(x), np.asarray(y)) < 1e-3
                for x, y in zip(native, reference))
    targets = (logits.PAGED_TARGET, logits.RAGGED_TARGET)
    from gpu_subprocess import custom_calls_in_command_buffers
    custom_calls, captured, _ = custom_calls_in_command_buffers(sys.argv[1], targets)
    print("RESULT", close, custom_calls, captured)
""")


def test_under_command_buffers(tmp_path):
    """The handlers claim kCmdBufferCompatible: run both ops (native) inside XLA command buffers,
    against pure JAX."""
    assert_matches_inside_command_buffers(COMMAND_BUFFER_SCRIPT, tmp_path)
