"""SM90 (H100 / H200) kernels of the lightning indexer's top-k: `top_k_per_row` and
`top_k_per_row_decode` (ops/indexer.py) as XLA FFI custom calls (`ffi/sm90/indexer_topk.cu`).

The kernel returns the pure-JAX reference's array bit for bit (the rule is in docs/indexer.md):
one CTA of 512 threads per row. A row of at most k positions writes 0 .. len - 1 and then -1
without reading its logits. A longer row maps every value to an order-preserving uint32 key (NaN
below -inf, -0.0 equal to +0.0, as `_order_keys`) and finds the k-th largest key exactly with three
histogram passes (11, 11 and 10 bits, each restricted to the keys that match the digits chosen so
far; 2048 bins in shared memory, a block-wide prefix sum to find the threshold bin). As soon as a
pass leaves few enough keys that can still be kept (those above the threshold bin and in it: at
most 6144), one more pass over the row gathers them, in position order, into shared memory (each
warp from its own slice of the row into its own list of 512), and the remaining passes and the
compaction read only those. Where they are too many (heavy ties) or one warp's slice holds more
than its list, every pass rereads the row, so no amount of ties can truncate the selection. The
compaction keeps every key above the threshold and the lowest-positioned ties, writing each kept
position at its prefix-sum rank: ascending positions, deterministic, no sort. Rows are read as
aligned float4 groups whatever the row start.

The one-CTA kernel comes in two builds. The register build ("sm90_topk", two CTAs per SM) loads
each thread's groups into registers; the streaming build ("sm90_topk_stream", one CTA per SM) has
each warp stream its slice of the row through two 4 KB stages of shared memory filled by the copy
engine (cp.async.bulk), so that 64 KB per CTA are in flight while the warps count or gather. The
cluster form (`ffi/sm90/indexer_topk_cluster.cuh`, "sm90_topk_cluster") gives the same array with
one row spread over a thread-block cluster of up to 8 CTAs (up to 16, the non-portable size, for a
few long rows where the device runs such clusters: for speed only), the row read once into shared
memory, the first pass's histograms added into one CTA that chooses the threshold for all and,
where they fit, the candidates it leaves refined on that CTA (rows of at most MAX_CLUSTER_WIDTH
positions).

All three passed their GPU tests on an H100 (tests/kernels/test_sm90_indexer_topk_gpu.py, memcheck,
racecheck and command buffers included). "native" prefers the cluster form wherever it fits, then
the streaming build. "auto" runs, per shape, the one that measured fastest on an H100: the register
build for rows of at most ONE_CTA_MAX_WIDTH positions and for more rows than SMs (prefill); the
cluster form for wider rows, at most CLUSTER_MAX_ROWS of them, whose smallest clusters take at most
CLUSTER_SM_SHARE of the SMs (decode at small and middle batch); the streaming build for the other wide rows. The numbers are in
docs/kernels/sm90-indexer.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry

TARGET = "jax_sparse_mla_sm90_top_k_per_row"
TARGET_DECODE = "jax_sparse_mla_sm90_top_k_per_row_decode"
TARGET_CLUSTER = "jax_sparse_mla_sm90_top_k_per_row_cluster"
TARGET_DECODE_CLUSTER = "jax_sparse_mla_sm90_top_k_per_row_decode_cluster"
TARGET_STREAM = "jax_sparse_mla_sm90_top_k_per_row_stream"
TARGET_DECODE_STREAM = "jax_sparse_mla_sm90_top_k_per_row_decode_stream"
# The kernel indexes rows with the grid's x dimension and holds positions, the width S and k as
# int32 (the handler rejects anything larger).
MAX_DIM = 2**31 - 1
# The cluster form (ffi/sm90/indexer_topk_plan.h): a row needs at most kMaxClusterSize = 8 CTAs
# (any count, not only powers of two), each holding at most kMaxClusterGroupsPerCta = 11264 float4
# groups of keys (176 KB); a row of S positions spans up to ceil((S + 3) / 4) groups. The plan
# widens clusters up to 16 CTAs only while the R clusters run in one wave (R <= 8 for 16), so the
# grid has at most R x 8 CTAs beyond that.
MAX_CLUSTER_SIZE = 8
CLUSTER_GROUPS_PER_CTA = 11264
MAX_CLUSTER_WIDTH = MAX_CLUSTER_SIZE * CLUSTER_GROUPS_PER_CTA * 4 - 3
MAX_CLUSTER_ROWS = MAX_DIM // MAX_CLUSTER_SIZE
# Rows this wide or narrower: "auto" runs the one-CTA kernel's register build (device times on an
# H100, k = 2048, bench_indexer.py's decode logits, in microseconds, register build vs streaming
# build vs cluster: 1 x 8192 9.6 vs 12.7 vs 12.7, 32 x 8192 9.9 vs 13.1 vs 20.3, 128 x 8192 10.6 vs
# 14.1 vs 15.6).
ONE_CTA_MAX_WIDTH = 8192
# Wider rows, at most this many, whose smallest clusters fill at most CLUSTER_SM_SHARE of the SMs:
# "auto" runs the cluster form; other wide rows run the streaming build. Clusters are placed within
# GPCs, so not every SM takes one. One H100, one call, µs, cluster vs streaming build: 16 x 65536
# 17.1 vs 32.5, 24 x 65536 19.2 vs 32.6, 40 x 65536 30.0 vs 32.9, 48 x 65536 31.1 vs 34.0
# (clusters of 2); 16 x 131072 23.0 vs 44.7, 24 x 131072 30.1 vs 47.7, 40 x 131072 56.8 vs 48.6
# (clusters of 3: 120 CTAs); 48 x 131072 61.6 vs 72.6 is the one measured point the rule gets
# wrong (R x 3 = 144 CTAs, more than 3/4 of the SMs: the streaming build runs).
CLUSTER_MAX_ROWS = 48
CLUSTER_SM_SHARE = 0.75


def min_cluster_size(width: int) -> int:
    """The fewest CTAs whose shared memory holds a row of `width` positions (at most
    MAX_CLUSTER_SIZE): the cluster the host plan (PlanCluster) takes where no wider one runs in one
    wave."""
    groups = -(-(width + 3) // 4)
    return min(MAX_CLUSTER_SIZE, max(1, -(-groups // CLUSTER_GROUPS_PER_CTA)))


def check_problem(problem: registry.IndexerProblem,
                  capability: tuple[int, int] | None = None) -> str | None:
    """None when the kernel takes this top-k call, else why not.

    problem: the op's IndexerProblem (num_rows R, num_keys S, top_k k, dtypes in signature order).
    """
    if problem.dtypes and problem.dtypes[0] != "float32":
        return f"needs float32 logits, got {problem.dtypes[0]}"
    if any(d != "int32" for d in problem.dtypes[1:]):
        return f"needs int32 row ranges, got {problem.dtypes[1:]}"
    for name, value in (("R (rows)", problem.num_rows), ("S (logits width)", problem.num_keys),
                        ("k", problem.top_k)):
        if value > MAX_DIM:
            return f"{name} must be below 2^31, got {value}"
    if problem.top_k < 1:
        return f"k must be positive, got {problem.top_k}"
    if problem.next_n < 1:
        return f"next_n must be positive, got {problem.next_n}"
    if capability is not None and not native.built_for("sm90", capability):
        return (f"the extension has no sm_{capability[0]}{capability[1]}a code "
                f"(built for {native.build_info().get('sm90', 'none')})")
    return None


def check_cluster_problem(problem: registry.IndexerProblem,
                          capability: tuple[int, int] | None = None) -> str | None:
    """None when the cluster form takes this top-k call, else why not (check_problem's rules, and
    rows that fit a cluster's shared memory)."""
    reason = check_problem(problem, capability)
    if reason is not None:
        return reason
    if problem.num_keys > MAX_CLUSTER_WIDTH:
        return (f"S (logits width) {problem.num_keys} exceeds the {MAX_CLUSTER_WIDTH} positions "
                f"that a cluster's shared memory holds")
    if problem.num_rows > MAX_CLUSTER_ROWS:
        return f"R (rows) must be at most {MAX_CLUSTER_ROWS}, got {problem.num_rows}"
    return None


def cluster_slower_here(problem: registry.IndexerProblem) -> str | None:
    """rows of at most 8192 positions (ONE_CTA_MAX_WIDTH), more than CLUSTER_MAX_ROWS rows, and
    rows whose smallest clusters take more than CLUSTER_SM_SHARE of the SMs (R x
    min_cluster_size(S) CTAs): where the one-CTA kernel measured faster"""
    if problem.num_keys <= ONE_CTA_MAX_WIDTH:
        return (f"rows of {problem.num_keys} <= {ONE_CTA_MAX_WIDTH} positions, where the one-CTA "
                f"kernel measured faster (H100, 32 x 8192: 9.9 vs 20.3 us)")
    if problem.num_rows > CLUSTER_MAX_ROWS:
        return (f"{problem.num_rows} rows > {CLUSTER_MAX_ROWS}, where the one-CTA kernel's "
                f"streaming build measured faster (H100, 64 x 65536: 34.1 vs 34.1 us)")
    ctas = min_cluster_size(problem.num_keys)
    sm_count = registry.device_sm_count()
    if problem.num_rows * ctas > CLUSTER_SM_SHARE * sm_count:
        return (f"{problem.num_rows} rows x {ctas} CTAs exceed {CLUSTER_SM_SHARE:.0%} of "
                f"{sm_count} SMs, more than the clusters fill in one wave, where the one-CTA "
                f"kernel's streaming build measured faster (H100, 32 x 131072: 47.7 vs 51.8 us)")
    return None


def stream_slower_here(problem: registry.IndexerProblem) -> str | None:
    """rows of at most 8192 positions (ONE_CTA_MAX_WIDTH), and more rows than SMs: where the
    register build measured faster"""
    if problem.num_keys <= ONE_CTA_MAX_WIDTH:
        return (f"rows of {problem.num_keys} <= {ONE_CTA_MAX_WIDTH} positions, where the register "
                f"build measured faster (H100, 32 x 8192: 9.9 vs 13.1 us)")
    sm_count = registry.device_sm_count()
    if problem.num_rows > sm_count:
        return (f"{problem.num_rows} rows exceed one CTA per SM on {sm_count} SMs, where the "
                f"register build measured faster (H100, 256 x 65536: 64.7 vs 72.8 us)")
    return None


def _empty(num_rows: int, k: int) -> jax.Array:
    return jnp.full((num_rows, k), -1, jnp.int32)


def _top_k_per_row(logits: jax.Array, row_starts: jax.Array, row_ends: jax.Array, *, k: int,
                   target: str = TARGET) -> jax.Array:
    """logits f32 [R, S], row_starts / row_ends int32 [R] -> int32 [R, k] (contract:
    ops.indexer.top_k_per_row), through the FFI `target`."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:  # nothing to read; the reference's answer, no launch
        return _empty(num_rows, k)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                            vmap_method="sequential")
    return call(logits, row_starts, row_ends)


def _top_k_per_row_decode(logits: jax.Array, context_lens: jax.Array, *, next_n: int, k: int,
                          target: str = TARGET_DECODE) -> jax.Array:
    """logits f32 [B * next_n, S], context_lens int32 [B] -> int32 [B * next_n, k] (contract:
    ops.indexer.top_k_per_row_decode), through the FFI `target`."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return _empty(num_rows, k)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                            vmap_method="sequential")
    return call(logits, context_lens, next_n=np.int64(next_n))


def _register(name: str, check, target: str, target_decode: str, slower_here=None,
              validated: bool = True) -> None:
    for op, fn, op_target in (("top_k_per_row", _top_k_per_row, target),
                              ("top_k_per_row_decode", _top_k_per_row_decode, target_decode)):
        registry.register_op_kernel(registry.OpKernel(
            op=op,
            name=name,
            native=True,
            capability_majors=(9,),
            fn=functools.partial(fn, target=op_target),
            available=lambda op_target=op_target: native.has_target(op_target),
            check=check,
            slower_here=slower_here,
            validated=validated,
        ))


_register("sm90_topk", check_problem, TARGET, TARGET_DECODE)
# Registered later, so preferred by "native" where it fits (by "auto": where it measured faster).
_register("sm90_topk_stream", check_problem, TARGET_STREAM, TARGET_DECODE_STREAM,
          slower_here=stream_slower_here)
_register("sm90_topk_cluster", check_cluster_problem, TARGET_CLUSTER, TARGET_DECODE_CLUSTER,
          slower_here=cluster_slower_here)
