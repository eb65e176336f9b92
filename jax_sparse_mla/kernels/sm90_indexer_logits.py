"""SM90 (H100 / H200) native kernels for the lightning indexer's fp8 MQA logits.

Our own CUDA kernels (`ffi/sm90/indexer_logits.cuh`) behind XLA FFI custom calls, registered for the
ops `fp8_paged_mqa_logits` (decode) and `fp8_mqa_logits` (prefill) of ops/indexer.py, with the same
contract as their pure-JAX references: k_scale[s] * sum_h w[row, h] * relu(q[row, h] . k[s]) with
fp32 accumulation inside each row's range and -inf everywhere else.

  paged   one CTA per (request, chunk of `tiles_per_cta` 64-token cache blocks); every block is one
          8448-byte page (values, then scales) brought by one bulk copy into an 8-stage ring;
          columns past the request's length are written -inf without reading any key.
  ragged  one CTA per (4 rows of 64 heads or 8 of 32, chunk of up to 128 64-key tiles); each
          warpgroup takes two rows (wgmma N = 128 at 64 heads, 64 at 32); only the tiles that
          meet the union of the rows' ranges are read, and each serves all the CTA's rows. Each
          tile comes by a TMA load in the 128-byte swizzle (the handler encodes the keys' tensor
          map per call) into a 1024-byte aligned ring.

Both run warpgroup MMAs (wgmma m64 n(32, 64 or 128) k32, e4m3 natively) with the query columns
from shared memory; the paged kernel takes the keys from registers (loaded from the page), the
ragged one straight from the ring (no instruction of the warps touches a key byte). Each warpgroup
issues tile i + 1's MMAs before it runs tile i's epilogue (relu, head weights, the head sum in
registers and shuffles, fp32 stores straight to the output), so that the tensor cores work
meanwhile. next_n of 1 and 2 run natively; larger next_n is flattened here into next_n = 1 rows
(each row its own length and a copy of its request's block-table row; keys are then read once per
row).

They passed their GPU tests on an H100 (tests/kernels/test_sm90_indexer_logits_gpu.py, memcheck,
racecheck and command buffers included) and measured faster than every earlier form of them at
every benchmarked shape (docs/kernels/sm90-indexer.md): implementation="auto" runs them on SM90.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import native, registry

PAGED_TARGET = "jax_sparse_mla_sm90_paged_mqa_logits"
RAGGED_TARGET = "jax_sparse_mla_sm90_mqa_logits"
# Query columns (row, head) per CTA of the ragged kernel (kRaggedColumns in indexer_logits.cuh).
RAGGED_COLUMNS = 256
# Must match ffi/sm90/indexer_logits.cuh / .cu.
TILE_KEYS = 64
MAX_GRID_Y = 65535
# Keys per row (max_context_len, N): the kernels index keys with int32 (ffi/sm90/indexer_logits.cu).
MAX_KEYS = 2**31 - 1024
NATIVE_NEXT_N = (1, 2)
HEADS = (32, 64)


class GridModel(NamedTuple):
    """How a kernel's CTAs share the GPU, for choosing its tiles per CTA: `ctas_per_sm` resident
    CTAs per SM, a fixed cost per CTA of about `fixed_cost_tiles` tiles of work (the query load, the
    first page's latency, the last tile's epilogue with no MMA under it), at most `max_tiles`."""

    ctas_per_sm: int
    fixed_cost_tiles: int
    max_tiles: int


# The paged kernels (128 threads; 256 at next_n = 2 and 64 heads) fit 3 CTAs per SM, whose fixed
# costs overlap each other's tiles. The ragged kernel fits one CTA per SM (256 or 512 threads at up
# to 236 registers), so nothing hides its fixed cost: on an H100, 4096 x 65536 ran 6745 us at 16
# tiles per CTA, 5458 at 64, 5312 at 128 and 5697 at 256 (docs/kernels/sm90-indexer.md), which a
# cost of about 5 tiles per CTA fits.
PAGED_GRID = GridModel(ctas_per_sm=3, fixed_cost_tiles=1, max_tiles=16)
RAGGED_GRID = GridModel(ctas_per_sm=1, fixed_cost_tiles=5, max_tiles=128)


def _sm_count() -> int:
    try:
        return registry.device_sm_count()
    except RuntimeError:  # no GPU device: only reached when tracing without one
        return 132


def tiles_per_cta(grid: GridModel, num_ctas_at_one_tile: int, num_tiles: int,
                  sm_count: int) -> int:
    """Tiles (64 keys) per CTA, chosen for whole waves: with W = grid.ctas_per_sm * sm_count
    resident CTAs, a grid of C CTAs of t tiles runs ceil(C / W) waves, each about as long as one
    CTA (its t tiles plus grid.fixed_cost_tiles), so t minimises
    ceil(C(t) / W) * (t + grid.fixed_cost_tiles) over [2, grid.max_tiles] (ties to more tiles: fewer
    query loads); 1 for single-tile rows. C(t) = num_ctas_at_one_tile * ceil(num_tiles / t)."""
    if num_tiles <= 1:
        return 1
    resident = grid.ctas_per_sm * sm_count
    best_tiles, best_cost = 0, None
    for tiles in range(min(grid.max_tiles, num_tiles), 1, -1):
        ctas = num_ctas_at_one_tile * -(-num_tiles // tiles)
        cost = -(-ctas // resident) * (tiles + grid.fixed_cost_tiles)
        if best_cost is None or cost < best_cost:
            best_tiles, best_cost = tiles, cost
    return best_tiles


def _paged_native(q, index_cache, weights, context_lens, block_table, *, max_context_len):
    """fp8_paged_mqa_logits' kernel contract (ops/indexer.py): q [B, next_n, H, 128] e4m3,
    index_cache uint8 [num_blocks, 64, 132], weights [B * next_n, H] f32, context_lens [B] i32,
    block_table [B, W] i32 -> [B * next_n, max_context_len] f32."""
    batch, next_n, num_heads, dim = q.shape
    rows = batch * next_n
    if rows == 0 or index_cache.shape[0] == 0:
        return jnp.full((rows, max_context_len), -jnp.inf, jnp.float32)
    if next_n not in NATIVE_NEXT_N:
        # Row j of request b as its own request of one token: length L_b - next_n + j + 1.
        offsets = jnp.arange(next_n, dtype=jnp.int32) - (next_n - 1)
        context_lens = (context_lens[:, None] + offsets[None, :]).reshape(rows)
        block_table = jnp.repeat(block_table, next_n, axis=0)
        q = q.reshape(rows, 1, num_heads, dim)
        batch, next_n = rows, 1
    num_tiles = -(-max_context_len // TILE_KEYS)
    call = jax.ffi.ffi_call(
        PAGED_TARGET, jax.ShapeDtypeStruct((rows, max_context_len), jnp.float32),
        vmap_method="sequential")
    return call(q, index_cache, weights, context_lens, block_table,
                tiles_per_cta=np.int64(tiles_per_cta(PAGED_GRID, batch, num_tiles, _sm_count())))


def _ragged_native(q, k_fp8, k_scale, weights, row_starts, row_ends):
    """fp8_mqa_logits' kernel contract: q [M, H, 128] e4m3, k_fp8 [N, 128] e4m3, k_scale [N] f32,
    weights [M, H] f32, row_starts / row_ends [M] i32 -> [M, N] f32."""
    num_rows, num_heads, _ = q.shape
    num_keys = k_fp8.shape[0]
    if num_rows == 0 or num_keys == 0:
        return jnp.full((num_rows, num_keys), -jnp.inf, jnp.float32)
    rows_per_cta = RAGGED_COLUMNS // num_heads
    num_tiles = -(-num_keys // TILE_KEYS)
    tiles = tiles_per_cta(RAGGED_GRID, -(-num_rows // rows_per_cta), num_tiles, _sm_count())
    tiles = max(tiles, -(-num_tiles // MAX_GRID_Y))  # at most 65535 key chunks (grid y)
    call = jax.ffi.ffi_call(
        RAGGED_TARGET, jax.ShapeDtypeStruct((num_rows, num_keys), jnp.float32),
        vmap_method="sequential")
    return call(q, k_fp8, k_scale, weights, row_starts, row_ends, tiles_per_cta=np.int64(tiles))


def _common_reason(problem: registry.IndexerProblem, capability, target: str) -> str | None:
    if not native.has_target(target):
        return f"the extension has no {target} target"
    if capability is not None and not native.built_for("sm90", capability):
        return (f"the sm90 handlers hold no sm_{capability[0]}{capability[1]}a code "
                f"(built for {native.build_info().get('sm90', 'nothing')})")
    if problem.num_heads not in HEADS:
        return f"needs H = 32 or 64 query heads, got {problem.num_heads}"
    return None


def check_paged(problem: registry.IndexerProblem, capability=None) -> str | None:
    """Why the SM90 paged-logits kernel cannot run `problem` (None when it can)."""
    reason = _common_reason(problem, capability, PAGED_TARGET)
    if reason is not None:
        return reason
    if problem.block_size != TILE_KEYS:
        return f"needs an index cache of block size 64, got {problem.block_size}"
    expected = ("float8_e4m3fn", "uint8", "float32", "int32", "int32")
    if problem.dtypes and tuple(problem.dtypes) != expected:
        return f"needs dtypes {expected}, got {tuple(problem.dtypes)}"
    # One grid row per request; next_n > 2 runs as B * next_n single-token requests.
    requests = problem.batch if problem.next_n in NATIVE_NEXT_N else problem.num_rows
    if problem.num_keys > MAX_KEYS:
        return f"max_context_len must be at most {MAX_KEYS}, got {problem.num_keys}"
    if requests > MAX_GRID_Y:
        return (f"at most {MAX_GRID_Y} requests per call (B * next_n when next_n > 2), "
                f"got {requests}")
    return None


def check_ragged(problem: registry.IndexerProblem, capability=None) -> str | None:
    """Why the SM90 ragged-logits kernel cannot run `problem` (None when it can)."""
    reason = _common_reason(problem, capability, RAGGED_TARGET)
    if reason is not None:
        return reason
    expected = ("float8_e4m3fn", "float8_e4m3fn", "float32", "float32", "int32", "int32")
    if problem.dtypes and tuple(problem.dtypes) != expected:
        return f"needs dtypes {expected}, got {tuple(problem.dtypes)}"
    if problem.num_rows >= 2 ** 31 or problem.num_keys > MAX_KEYS:
        return f"needs M below 2^31 and N at most {MAX_KEYS}"
    return None


def _register() -> None:
    for op, fn, check, target in (
            ("fp8_paged_mqa_logits", _paged_native, check_paged, PAGED_TARGET),
            ("fp8_mqa_logits", _ragged_native, check_ragged, RAGGED_TARGET)):
        registry.register_op_kernel(registry.OpKernel(
            op=op, name="sm90_mqa_logits", native=True, capability_majors=(9,), fn=fn,
            available=lambda target=target: native.has_target(target), check=check))


_register()
