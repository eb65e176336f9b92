"""GPU tests of the SM90 indexer top-k kernels (ffi/sm90/indexer_topk.cuh, one CTA per row, in its
two builds, and ffi/sm90/indexer_topk_cluster.cuh, one cluster per row; behind
kernels/sm90_indexer_topk.py).

Every case runs each kernel (KERNELS, called through its registered binding, since
implementation="native" picks only the preferred one) and compares it with the pure-JAX reference
(implementation="xla") on the same GPU and asserts the two int32 arrays are identical (np.array_equal): the rule leaves no
freedom (NaN below every number, -0.0 == +0.0, ties to the lower position, ascending positions,
then -1). The data cycles through the hard cases of the rule row by row (heavy ties, vLLM's
"10LSBits" rows, all-equal rows, NaN rows and scattered NaN, -inf, +inf, signed zeros, subnormals,
ties inside the threshold bin, a run of equal values longer than one warp's candidate list, values
in one exponent, large values where the kernel samples the row: the one-CTA kernel's candidates
gathered speculatively with the first pass, after the first or a later pass, or never)
and the ranges through full rows, non-zero and unaligned starts, empty and reversed ranges, rows of
exactly k and k + 1 positions and rows shorter than k. Widths go up to 131072, batches from 1 to
256. The sanitizer cases run a small grid under compute-sanitizer memcheck and racecheck; the
command-buffer case runs the kernels inside XLA command buffers (CUDA graphs). Skipped without an SM90 GPU or without the
compiled extension; JAX_SPARSE_MLA_REQUIRE_GPU=1 turns that skip into a failure.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import registry, sm90_indexer_topk
from gpu_subprocess import assert_matches_inside_command_buffers, assert_sanitizer_clean
from reference import top_k_np
from requirements import gpu_test_marks, sm90_skip_reason


SKIP_REASON = sm90_skip_reason(
    sm90_indexer_topk.TARGET, sm90_indexer_topk.TARGET_DECODE, sm90_indexer_topk.TARGET_CLUSTER,
    sm90_indexer_topk.TARGET_DECODE_CLUSTER, sm90_indexer_topk.TARGET_STREAM,
    sm90_indexer_topk.TARGET_DECODE_STREAM)
pytestmark = gpu_test_marks(SKIP_REASON, "the SM90 top-k tests")

KERNELS = ("sm90_topk", "sm90_topk_cluster", "sm90_topk_stream")


@functools.cache
def kernel_fn(op: str, name: str):
    """The registered native kernel `name` of `op`, jitted: its binding takes the public function's
    checked arguments (logits, row_starts, row_ends, k= / logits, context_lens, next_n=, k=)."""
    kernel = next(k for k in registry.registered_op_kernels(op) if k.name == name)
    static = ("k",) if op == "top_k_per_row" else ("next_n", "k")
    return jax.jit(kernel.fn, static_argnames=static)

NUM_CASES = 16


def hard_rows(rng, num_rows: int, width: int) -> np.ndarray:
    """float32 [num_rows, width]: row r holds case r % NUM_CASES of the selection rule."""
    logits = rng.standard_normal((num_rows, width)).astype(np.float32)
    for r in range(num_rows):
        row = logits[r]
        case = r % NUM_CASES
        if case == 1:  # heavy ties on a few values
            row[:] = rng.integers(0, 4, width)
        elif case == 2:  # scattered NaN of both signs
            row[rng.random(width) < 0.3] = np.nan
            row[rng.random(width) < 0.1] = -np.nan
        elif case == 3:  # -inf (a candidate, above NaN) and NaN
            row[rng.random(width) < 0.5] = -np.inf
            row[rng.random(width) < 0.2] = np.nan
        elif case == 4:  # only NaN and -inf
            row[:] = np.where(rng.random(width) < 0.5, np.nan, -np.inf)
        elif case == 5:  # +inf and huge values of both signs
            row[rng.random(width) < 0.05] = np.inf
            row[rng.random(width) < 0.05] = -3e38
            row[rng.random(width) < 0.05] = 3e38
        elif case == 6:  # vLLM's "10LSBits": top 22 bits 0x3F900000, random low bits
            row[:] = (np.uint32(0x3F900000)
                      | rng.integers(0, 1 << 10, width).astype(np.uint32)).view(np.float32)
        elif case == 7:  # the same with half the row tied to one value
            row[:] = (np.uint32(0x3F900000)
                      | rng.integers(0, 1 << 10, width).astype(np.uint32)).view(np.float32)
            row[rng.random(width) < 0.5] = row[0]
        elif case == 8:  # signed zeros tie with each other
            row[:] = np.where(rng.random(width) < 0.5, -0.0, 0.0)
            row[rng.random(width) < 0.1] = -1.0
        elif case == 9:  # subnormals of both signs
            row[:] = rng.integers(-5, 6, width).astype(np.float32) * np.float32(1e-45)
        elif case == 10:  # all equal
            row[:] = 0.25
        elif case == 11:  # all NaN
            row[:] = np.nan
        elif case == 12:  # normal values in steps of 1/8: ties inside the threshold bin
            row[:] = np.round(row * 8) / 8
        elif case == 13:  # a run of 600 equal top values: more than one warp's candidate list
            first = rng.integers(0, max(1, width - 600))
            row[first:first + 600] = 5.0
        elif case == 14:  # 3 + N(0, 0.1): the first digit's threshold bin holds half the row
            row[:] = 3 + row * np.float32(0.1)
        elif case == 15:  # 2000 large values where the one-CTA kernel samples a 131072-wide row
            row[(np.arange(500)[:, None] * (width // 512) + np.arange(4)).ravel() % width] = 10.0
    return logits


def hard_ranges(rng, num_rows: int, width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 [num_rows] starts and ends cycling through the range patterns (clipped to the width
    where a pattern would pass it; eager calls reject ends > width)."""
    starts = np.zeros(num_rows, np.int64)
    ends = np.full(num_rows, width, np.int64)
    for r in range(num_rows):
        pattern = (r // NUM_CASES + r) % 8
        if pattern == 1:  # unaligned start to the end
            starts[r] = rng.integers(1, 8)
        elif pattern == 2:  # random sub-range
            a, b = sorted(rng.integers(0, width + 1, 2))
            starts[r], ends[r] = a, b
        elif pattern == 3:  # exactly k positions
            starts[r] = rng.integers(0, 5)
            ends[r] = starts[r] + k
        elif pattern == 4:  # k + 1 positions
            starts[r] = rng.integers(0, 5)
            ends[r] = starts[r] + k + 1
        elif pattern == 5:  # shorter than k
            starts[r] = rng.integers(0, 5)
            ends[r] = starts[r] + rng.integers(0, k)
        elif pattern == 6:  # empty or reversed
            starts[r] = rng.integers(0, width + 1)
            ends[r] = starts[r] - rng.integers(0, 3)
        elif pattern == 7:  # long range ending early, unaligned at both ends
            starts[r] = rng.integers(0, 8)
            ends[r] = max(starts[r], width - rng.integers(1, 8))
    starts = np.clip(starts, 0, width)
    ends = np.clip(ends, 0, width)
    return starts.astype(np.int32), ends.astype(np.int32)


_top_k = jax.jit(jsm.top_k_per_row, static_argnames=("k", "implementation"))
_top_k_decode = jax.jit(jsm.top_k_per_row_decode,
                        static_argnames=("next_n", "k", "implementation"))


def assert_identical(native_out, reference, shape):
    native_out, reference = np.asarray(native_out), np.asarray(reference)
    assert native_out.shape == shape and native_out.dtype == np.int32
    if not np.array_equal(native_out, reference):
        rows = np.flatnonzero((native_out != reference).any(axis=1))
        r = int(rows[0])
        cols = np.flatnonzero(native_out[r] != reference[r])[:8]
        raise AssertionError(
            f"{len(rows)} rows differ, first row {r} at columns {cols.tolist()}: native "
            f"{native_out[r, cols].tolist()} vs reference {reference[r, cols].tolist()}")


def numpy_rows(logits, starts, ends, k: int) -> np.ndarray:
    """The float64 NumPy rule (tests/reference.py), row by row: the reference the memcheck grid uses,
    so that no pure-JAX kernel runs under the sanitizer."""
    return np.stack([top_k_np(row, s, e, k) for row, s, e in zip(np.asarray(logits), starts, ends)])


def check_rows(num_rows: int, width: int, k: int, kernel: str, *, seed: int = 0,
               numpy_reference: bool = False):
    rng = np.random.default_rng(seed + 31 * num_rows + width + k)
    logits = jnp.asarray(hard_rows(rng, num_rows, width))
    starts, ends = hard_ranges(rng, num_rows, width, k)
    native_out = kernel_fn("top_k_per_row", kernel)(logits, jnp.asarray(starts),
                                                    jnp.asarray(ends), k=k)
    if numpy_reference:
        reference = numpy_rows(logits, starts, ends, k)
    else:
        reference = _top_k(logits, jnp.asarray(starts), jnp.asarray(ends), k=k,
                           implementation="xla")
    assert_identical(native_out, reference, (num_rows, k))


def check_decode(context_lens, width: int, next_n: int, k: int, kernel: str, *, seed: int = 0,
                 numpy_reference: bool = False):
    context_lens = np.asarray(context_lens, np.int32)
    rng = np.random.default_rng(seed + width + next_n + k + len(context_lens))
    logits = jnp.asarray(hard_rows(rng, len(context_lens) * next_n, width))
    lens = jnp.asarray(context_lens)
    native_out = kernel_fn("top_k_per_row_decode", kernel)(logits, lens, next_n=next_n, k=k)
    if numpy_reference:
        # Row b * next_n + j ranges over [0, L_b - next_n + j + 1), in int32 as the op computes it.
        ends = (np.repeat(context_lens, next_n) - next_n + 1
                + np.tile(np.arange(next_n, dtype=np.int32), len(context_lens)))
        reference = numpy_rows(logits, np.zeros_like(ends), ends, k)
    else:
        reference = _top_k_decode(logits, lens, next_n=next_n, k=k, implementation="xla")
    assert_identical(native_out, reference, (len(context_lens) * next_n, k))


def test_native_prefers_the_cluster_form_where_it_fits_then_the_streaming_build():
    for op, args in (("top_k_per_row", {}), ("top_k_per_row_decode", dict(batch=4, next_n=2))):
        for width, name in ((4096, "sm90_topk_cluster"),
                            (sm90_indexer_topk.MAX_CLUSTER_WIDTH, "sm90_topk_cluster"),
                            (sm90_indexer_topk.MAX_CLUSTER_WIDTH + 1, "sm90_topk_stream")):
            problem = registry.IndexerProblem(op, num_rows=8, num_keys=width, top_k=2048, **args)
            assert registry.select_op_kernel(op, "native", problem).name == name


# (rows, width, k): widths up to 131072, batches 1 to 256, odd widths (every row start has its own
# alignment), k above the width, k = 1.
ROW_GRID = [
    (1, 131072, 2048), (4, 131071, 2048), (24, 32768, 2048), (256, 8192, 2048),
    (256, 4097, 2048), (36, 20001, 1), (36, 20001, 64), (24, 5000, 3000), (12, 3001, 4096),
    (48, 2049, 2048), (12, 100, 2048), (3, 131072, 512),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_rows,width,k", ROW_GRID)
def test_top_k_per_row_matches_pure_jax(num_rows, width, k, kernel):
    check_rows(num_rows, width, k, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_top_k_per_row_large_batch_long_rows(kernel):
    check_rows(256, 131072, 2048, kernel, seed=1)


@pytest.mark.parametrize("num_rows,width", [(32, 131072), (40, 65536), (24, 131072)])
def test_cluster_form_in_clusters_of_any_width(num_rows, width):
    """Shapes whose plan takes clusters that are not a power of two on a 132-SM part (3 CTAs at
    32 x 131072, their 175 KB chunks leaving no room for the leader's lists: the cluster passes;
    3 at 40 x 65536; 5 at 24 x 131072, as the occupancy calculator allows)."""
    check_rows(num_rows, width, 2048, "sm90_topk_cluster")


@pytest.mark.parametrize("num_rows,width", [(1, 262144), (2, 327677), (1, 327677), (1, 360445)])
def test_cluster_form_at_its_widest_rows(num_rows, width):
    """The widest rows a cluster holds (8 CTAs, their shared memory full), every lead."""
    check_rows(num_rows, width, 2048, "sm90_topk_cluster")


@pytest.mark.parametrize("num_rows,width", [(24, 131072), (48, 8192), (12, 3001)])
def test_pure_jax_matches_numpy_on_this_gpu(num_rows, width):
    """The pure-JAX op (lax.top_k over order keys, whose ties go to the lower index) on the GPU's own
    XLA top-k: the NumPy rule's array, every hard case, so the reference the other tests use is
    itself checked here."""
    rng = np.random.default_rng(num_rows + width)
    logits = hard_rows(rng, num_rows, width)
    starts, ends = hard_ranges(rng, num_rows, width, 2048)
    out = _top_k(jnp.asarray(logits), jnp.asarray(starts), jnp.asarray(ends), k=2048,
                 implementation="xla")
    assert_identical(out, numpy_rows(logits, starts, ends, 2048), (num_rows, 2048))


def test_eager_calls_match():
    rng = np.random.default_rng(24)
    logits = jnp.asarray(hard_rows(rng, 24, 9000))
    starts, ends = (jnp.asarray(x) for x in hard_ranges(rng, 24, 9000, 2048))
    out = jsm.top_k_per_row(logits, starts, ends, k=2048, implementation="native")
    reference = jsm.top_k_per_row(logits, starts, ends, k=2048, implementation="xla")
    assert_identical(out, reference, (24, 2048))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("batch,width", [(1, 131072), (64, 32768), (256, 8192)])
def test_decode_matches_pure_jax(batch, width, next_n, kernel):
    rng = np.random.default_rng(batch + next_n)
    if batch == 1:  # the long-context latency case: one request over the whole width
        lens = np.array([width])
    else:
        special = [0, 1, next_n - 1, 2047, 2048, 2049, 2048 + next_n, width, width - 1, 4099]
        lens = rng.integers(0, width + 1, batch)
        lens[:len(special)] = special
    check_decode(np.clip(lens, 0, width), width, next_n, 2048, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_short_and_negative_contexts(next_n, kernel):
    """Lengths <= 0 (padding requests) give -1 rows; int32 wrap-around of L - next_n + j + 1 is
    computed as the reference computes it."""
    lens = [0, -1, -5, 1, 2, 100, 2048, 2049, 3000, -2**31, 3001]
    check_decode(lens, 3001, next_n, 2048, kernel)
    check_decode(lens, 3001, next_n, 16, kernel)


def test_jit_lowers_to_the_custom_calls_and_vmap_runs_per_element():
    rng = np.random.default_rng(9)
    logits = jnp.asarray(hard_rows(rng, 3 * 8, 5000)).reshape(3, 8, 5000)
    starts = jnp.zeros((3, 8), jnp.int32)
    ends = jnp.asarray(rng.integers(0, 5001, (3, 8)), jnp.int32)
    step = jax.jit(lambda l, s, e: jsm.top_k_per_row(l, s, e, k=2048, implementation="native"))
    # implementation="native" prefers the cluster form.
    assert sm90_indexer_topk.TARGET_CLUSTER in step.lower(logits[0], starts[0], ends[0]).as_text()
    batched = jax.vmap(step)(logits, starts, ends)
    for b in range(3):
        reference = jsm.top_k_per_row(logits[b], starts[b], ends[b], k=2048, implementation="xla")
        assert_identical(batched[b], reference, (8, 2048))
    decode = jax.jit(lambda l, c: jsm.top_k_per_row_decode(l, c, next_n=2, k=64,
                                                            implementation="native"))
    assert sm90_indexer_topk.TARGET_DECODE_CLUSTER in decode.lower(
        logits[0], jnp.full((4,), 100, jnp.int32)).as_text()


# (2, 131072): the speculative gather (row 0) and the rereading path (row 1, heavy ties).
MEMCHECK_GRID = [(5, 3001, 64), (13, 20001, 2048), (12, 100, 2048), (2, 131072, 2048)]
MEMCHECK_SCRIPT = textwrap.dedent("""
    import test_sm90_indexer_topk_gpu as cases
    for kernel in cases.KERNELS:
        for shape in cases.MEMCHECK_GRID:
            cases.check_rows(*shape, kernel, numpy_reference=True)
        cases.check_decode([0, 1, 3000, 2049, -3], 3001, 2, 2048, kernel, numpy_reference=True)
    print("MEMCHECK GRID PASSED")
""")


@pytest.mark.sanitizer
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(tool, tmp_path):
    """A small grid under compute-sanitizer (memcheck: out-of-bounds and misaligned accesses;
    racecheck: shared-memory hazards): every case matches and the tool reports nothing."""
    assert_sanitizer_clean(MEMCHECK_SCRIPT, tmp_path, tool)


COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_sparse_mla as jsm
    from jax_sparse_mla.kernels import sm90_indexer_topk
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((16, 6000), np.float32))
    lens = jnp.asarray(rng.integers(0, 6001, 8), jnp.int32)
    starts = jnp.asarray(rng.integers(0, 7, 16), jnp.int32)
    ends = jnp.asarray(rng.integers(0, 6001, 16), jnp.int32)

    def loop(impl):
        def run(logits, starts, ends, lens):
            def body(i, acc):
                # Elementwise and exact (sign flips; a fusion), so that the custom calls'
                # operands are not slices and both paths see the same bits.
                flip = (jnp.arange(6000) + i) % 3 == 0
                moved = jnp.where(flip, -logits, logits)
                a = jsm.top_k_per_row(moved, starts, ends, k=2048, implementation=impl)
                b = jsm.top_k_per_row_decode(moved, lens, next_n=2, k=2048, implementation=impl)
                return acc + a * 3 + b
            return jax.lax.fori_loop(0, 4, body, jnp.zeros((16, 2048), jnp.int32))
        return jax.jit(run)(logits, starts, ends, lens)

    same = bool((loop("native") == loop("xla")).all())
    targets = (sm90_indexer_topk.TARGET, sm90_indexer_topk.TARGET_DECODE,
               sm90_indexer_topk.TARGET_CLUSTER, sm90_indexer_topk.TARGET_DECODE_CLUSTER)
    # Every kCustomCall thunk of the modules that hold our targets must sit below a
    # kCommandBuffer thunk in the dumped thunk sequences.
    from gpu_subprocess import custom_calls_in_command_buffers
    custom_calls, captured, _ = custom_calls_in_command_buffers(sys.argv[1], targets)
    print("RESULT", same, custom_calls, captured)
""")


def test_under_command_buffers(tmp_path):
    """The handlers claim kCmdBufferCompatible: run them inside XLA command buffers."""
    assert_matches_inside_command_buffers(COMMAND_BUFFER_SCRIPT, tmp_path)
