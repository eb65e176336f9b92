"""A per-lane NumPy model of the SM90 indexer logits' warpgroup MMAs
(ffi/sm90/indexer_logits.cuh: StoreQueryOperand, LoadKeyFragment, WgmmaTile), run on CPU.

Two forms: the paged kernel's, keys as A from registers with a dim permutation shared by A and B,
and the ragged kernel's, keys as A from shared memory in the 128-byte swizzle (written by a TMA
load, read through SwizzledKMajorDescriptor) with the query in dim order.

The model moves bytes exactly as the kernel does and combines them exactly as PTX defines the
instruction: `wgmma.mma_async.m64nNk32.f32.e4m3.e4m3` with A from registers (per warp the m16n8k32
A fragment: register r of lane (g, t) holds row 16 w + g + 8 (r % 2), k 4 t + 16 (r // 2) + byte)
and B from shared memory through an unswizzled K-major descriptor (element (n, k) at
start + (k // 16) * LBO + (n // 8) * SBO + (n % 8) * 16 + k % 16), with the kernel's start, LBO and
SBO for each k-step. It checks that every accumulator is the dot product of its key and query column
over the 128 real dims (the dim permutation of A and B agree), for every operand width (32, 64 and
128 columns), that the accumulator layout is the one HeadSums reads, and that QuadResult's
reduce-scatter across a quad gives each lane the whole sum of the row and key it stores. Bytes stand for e4m3
values as small integers: the question is where each byte goes, not the arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest

DIM = 128
TILE_KEYS = 64


def store_query_operand(query: np.ndarray) -> np.ndarray:
    """StoreQueryOperand for one group: query [N, 128] -> the operand's N * 128 bytes; K chunk c of
    column n at c * N * 16 + n * 16 holds the column's 32-bit words c, 8 + c, 16 + c, 24 + c."""
    columns = len(query)
    operand = np.zeros(columns * DIM, np.int64)
    words = query.reshape(columns, 32, 4)  # [column, word, byte]
    for n in range(columns):
        for chunk in range(8):
            sixteen = np.concatenate([words[n, 8 * i + chunk] for i in range(4)])
            start = chunk * columns * 16 + n * 16
            operand[start:start + 16] = sixteen
    return operand


def store_query_operand_by_halves(query: np.ndarray) -> np.ndarray:
    """StoreQueryOperand's loop as the kernel runs it: half h of column n loads the 16-byte pieces
    at bytes 32 j + 16 h (j = 0..3), then stores chunk 4 h + c as word c of each piece."""
    columns = len(query)
    operand = np.zeros(columns * DIM, np.int64)
    for i in range(columns * 2):
        n, half = divmod(i, 2)
        pieces = [query[n, 32 * j + 16 * half:32 * j + 16 * half + 16].reshape(4, 4)
                  for j in range(4)]  # pieces[j][c] = word 8 j + 4 half + c (4 bytes)
        for c in range(4):
            chunk = 4 * half + c
            start = chunk * columns * 16 + n * 16
            operand[start:start + 16] = np.concatenate([pieces[j][c] for j in range(4)])
    return operand


def key_fragments(tile: np.ndarray, warp: int, lane: int):
    """LoadKeyFragment: rows g and g + 8 of the warp's m16 tile, the lane's 32-byte chunk of each,
    as 8 words of 4 bytes (the bank-conflict swap leaves the registers as they are)."""
    g, t = lane // 4, lane % 4
    row = 16 * warp + g
    lo = tile[row, 32 * t:32 * t + 32].reshape(8, 4)
    hi = tile[row + 8, 32 * t:32 * t + 32].reshape(8, 4)
    return lo, hi


def wgmma_register_a(columns: int, operand: np.ndarray, tile: np.ndarray) -> np.ndarray:
    """D [64, N] of the four k-steps, from the lanes' A registers and the B descriptor."""
    leading, stride = columns * 16, 128  # the kernel's Descriptor(..., N * 16, 128)
    a = np.zeros((4, TILE_KEYS, 32), np.int64)  # [k-step, m, logical k]
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            lo, hi = key_fragments(tile, warp, lane)
            for ks in range(4):
                registers = (lo[2 * ks], hi[2 * ks], lo[2 * ks + 1], hi[2 * ks + 1])
                for r, register in enumerate(registers):
                    m = 16 * warp + g + 8 * (r % 2)
                    k0 = 4 * t + 16 * (r // 2)
                    a[ks, m, k0:k0 + 4] = register
    d = np.zeros((TILE_KEYS, columns), np.int64)
    for ks in range(4):
        start = ks * 2 * columns * 16  # query + ks * kStep (in bytes)
        n, k = np.meshgrid(np.arange(columns), np.arange(32), indexing="ij")
        address = start + (k // 16) * leading + (n // 8) * stride + (n % 8) * 16 + k % 16
        b = operand[address]  # [N, 32]
        d += a[ks] @ b.T
    return d


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_wgmma_operands_give_every_dot_product(columns):
    rng = np.random.default_rng(columns)
    query = rng.integers(-7, 8, (columns, DIM))
    tile = rng.integers(-7, 8, (TILE_KEYS, DIM))
    d = wgmma_register_a(columns, store_query_operand(query), tile)
    np.testing.assert_array_equal(d, tile @ query.T)


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_the_kernels_store_loop_writes_that_layout(columns):
    query = np.random.default_rng(columns + 1).integers(-7, 8, (columns, DIM))
    np.testing.assert_array_equal(store_query_operand_by_halves(query),
                                  store_query_operand(query))


def test_a_wrong_word_order_is_caught():
    """The model can fail: the query's words in plain order (no permutation) give other sums."""
    rng = np.random.default_rng(1)
    query = rng.integers(-7, 8, (64, DIM))
    tile = rng.integers(-7, 8, (TILE_KEYS, DIM))
    plain = np.zeros(64 * DIM, np.int64)
    for n in range(64):
        for chunk in range(8):
            plain[chunk * 64 * 16 + n * 16:chunk * 64 * 16 + n * 16 + 16] = \
                query[n, 16 * chunk:16 * chunk + 16]
    assert not np.array_equal(wgmma_register_a(64, plain, tile), tile @ query.T)


def store_query_operand_in_dim_order(query: np.ndarray) -> np.ndarray:
    """StoreQueryOperand<L, false>'s loop: item i = (column n, chunk c) stores the column's bytes
    [16 c, 16 c + 16) at c * N * 16 + n * 16."""
    columns = len(query)
    operand = np.zeros(columns * DIM, np.int64)
    for i in range(columns * 8):
        n, chunk = divmod(i, 8)
        start = chunk * columns * 16 + n * 16
        operand[start:start + 16] = query[n, 16 * chunk:16 * chunk + 16]
    return operand


def swizzle_128b(address: np.ndarray) -> np.ndarray:
    """The 128-byte swizzle of TMA (CU_TENSOR_MAP_SWIZZLE_128B) and of wgmma descriptors (layout
    type B128), on byte offsets from a 1024-byte aligned base: bits 4-6 ^= bits 7-9."""
    return address ^ (((address >> 7) & 7) << 4)


def tma_load_swizzled(tile: np.ndarray) -> np.ndarray:
    """A 64 x 128-byte box (CopyTensor2d) into a stage: byte b of row r at swizzle(128 r + b)."""
    stage = np.zeros(TILE_KEYS * DIM, np.int64)
    r, b = np.meshgrid(np.arange(TILE_KEYS), np.arange(DIM), indexing="ij")
    stage[swizzle_128b(128 * r + b)] = tile[r, b]
    return stage


def wgmma_shared_a(columns: int, operand: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """D [64, N] of WgmmaTile::IssueShared's four k-steps: A (m, k) through the swizzled K-major
    descriptor at stage + 32 ks with SBO 1024 (8-row atoms), B as in the register form."""
    leading, stride = columns * 16, 128
    d = np.zeros((TILE_KEYS, columns), np.int64)
    m, k = np.meshgrid(np.arange(TILE_KEYS), np.arange(32), indexing="ij")
    n, kb = np.meshgrid(np.arange(columns), np.arange(32), indexing="ij")
    for ks in range(4):
        a = stage[swizzle_128b(32 * ks + (m // 8) * 1024 + (m % 8) * 128 + k)]  # [64, 32]
        start = ks * 2 * columns * 16
        b = operand[start + (kb // 16) * leading + (n // 8) * stride + (n % 8) * 16 + kb % 16]
        d += a @ b.T
    return d


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_shared_key_operand_gives_every_dot_product(columns):
    rng = np.random.default_rng(columns + 2)
    query = rng.integers(-7, 8, (columns, DIM))
    tile = rng.integers(-7, 8, (TILE_KEYS, DIM))
    d = wgmma_shared_a(columns, store_query_operand_in_dim_order(query), tma_load_swizzled(tile))
    np.testing.assert_array_equal(d, tile @ query.T)


def test_shared_keys_with_the_permuted_query_are_caught():
    """The model can fail: the register form's permuted query against swizzled shared keys."""
    rng = np.random.default_rng(3)
    query = rng.integers(-7, 8, (128, DIM))
    tile = rng.integers(-7, 8, (TILE_KEYS, DIM))
    d = wgmma_shared_a(128, store_query_operand(query), tma_load_swizzled(tile))
    assert not np.array_equal(d, tile @ query.T)


def test_unswizzled_keys_are_caught():
    """The model can fail: a plain (unswizzled) copy of the keys read through the B128 descriptor."""
    rng = np.random.default_rng(4)
    query = rng.integers(-7, 8, (64, DIM))
    tile = rng.integers(-7, 8, (TILE_KEYS, DIM))
    d = wgmma_shared_a(64, store_query_operand_in_dim_order(query), tile.reshape(-1))
    assert not np.array_equal(d, tile @ query.T)


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_accumulator_layout_is_the_one_head_sums_reads(columns):
    """wgmma's f32 accumulator i of lane (g, t) in warp w is (row 16 w + g + 8 ((i / 2) % 2),
    column 8 (i / 4) + 2 t + i % 2); HeadSums reads acc[n][j] = element 4 n + j as (key 16 w + g +
    8 (j / 2), column 8 n + 2 t + j % 2): the m16n8 layout, the same map."""
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(columns // 2):
                wgmma = (16 * warp + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * t + i % 2)
                n, j = divmod(i, 4)
                head_sums = (16 * warp + g + 8 * (j // 2), 8 * n + 2 * t + j % 2)
                assert wgmma == head_sums


def quad_result(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """QuadResult for the 4 lanes of a quad: lo, hi [4 lanes, warp rows] (each lane's partial head
    sums) -> the value each lane returns, with __shfl_xor_sync(v, m) read as lane t ^ m's v."""
    rows = lo.shape[1]
    lanes = np.arange(4)
    if rows == 2:
        upper = (lanes & 2) != 0
        send_lo = np.where(upper, lo[:, 0], lo[:, 1])
        send_hi = np.where(upper, hi[:, 0], hi[:, 1])
        low = np.where(upper, lo[:, 1], lo[:, 0]) + send_lo[lanes ^ 2]
        high = np.where(upper, hi[:, 1], hi[:, 0]) + send_hi[lanes ^ 2]
    else:
        low = lo[:, 0] + lo[lanes ^ 2, 0]
        high = hi[:, 0] + hi[lanes ^ 2, 0]
    odd = (lanes & 1) != 0
    return np.where(odd, high, low) + np.where(odd, low, high)[lanes ^ 1]


@pytest.mark.parametrize("rows", [1, 2])
def test_quad_result_is_the_stored_rows_whole_sum(rows):
    """Lane t stores row t / 2 of the warp, key g + 8 (t % 2) (the epilogues' `row` and
    `key_in_tile`): its value must be that row's and key's sum over all four lanes' partials."""
    rng = np.random.default_rng(rows)
    lo, hi = rng.standard_normal((2, 4, rows))
    result = quad_result(lo, hi)
    for t in range(2 * rows):
        partials = hi if t % 2 else lo
        np.testing.assert_allclose(result[t], partials[:, t // 2].sum(), rtol=1e-12)
