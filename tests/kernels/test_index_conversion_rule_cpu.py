"""The CUDA index conversion's per-position rule (ffi/common/index_conversion_rule.h: LoadRow and
ConvertPositions, the code the kernels run, compiled here as host C++) against the pure-JAX
conversion, bit for bit.

The kernels' own structure (vector loads, the tile and row kernels, compaction) runs only on a GPU
(test_index_conversion_gpu.py); this checks on any machine what every position becomes: the DCP owner
filter with interleave, the block division by runtime divisors, clipped request ids, prefill
workspace rows, out-of-width blocks, empty tables and int32 wrap-around.
"""

from __future__ import annotations

import pathlib
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.ops import index_conversion
from requirements import compile_host_program

DRIVER = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "common/index_conversion_rule.h"

using namespace jax_sparse_mla;
using namespace jax_sparse_mla::index_conversion;

template <typename T>
bool Read(std::vector<T>* v, int64_t n) {
  v->resize(n > 0 ? n : 1);
  return n == 0 || std::fread(v->data(), sizeof(T), n, stdin) == static_cast<size_t>(n);
}

// stdin: int64 T, K, R, W, P, block_size, dcp_size, interleave, rank, has_pref; then int32 req_id
// [T], block_table [R, W], tokens [T, K], pref_ids [T] (when has_pref), pref_starts [P].
// stdout: int32 slots [T, K], then counts [T]. K is a multiple of 8.
int main() {
  std::vector<int64_t> h;
  if (!Read(&h, 10)) return 1;
  const int64_t T = h[0], K = h[1], R = h[2], W = h[3], P = h[4];
  std::vector<int32_t> req, table, tokens, pref_ids, starts;
  if (!Read(&req, T) || !Read(&table, R * W) || !Read(&tokens, T * K)) return 1;
  const bool has_pref = h[9] != 0;
  if (has_pref && (!Read(&pref_ids, T) || !Read(&starts, P))) return 1;
  const int32_t rank = static_cast<int32_t>(h[8]);
  ConversionParams p{};
  p.req_id = req.data();
  p.block_table = table.data();
  p.tokens = tokens.data();
  p.rank = &rank;
  p.pref_ids = has_pref ? pref_ids.data() : nullptr;
  p.pref_starts = has_pref ? starts.data() : nullptr;
  p.top_k = K;
  p.num_reqs = static_cast<int32_t>(R);
  p.table_width = static_cast<int32_t>(W);
  p.num_starts = has_pref ? static_cast<int32_t>(P) : 0;
  p.block_size = FastDivmod::Make(static_cast<uint32_t>(h[5]));
  p.dcp_size = FastDivmod::Make(static_cast<uint32_t>(h[6]));
  p.interleave = FastDivmod::Make(static_cast<uint32_t>(h[7]));
  std::vector<int32_t> out(T * K), counts(T);
  for (int64_t row = 0; row < T; ++row) {
    const RowState s = LoadRow(p, row);
    int32_t count = 0;
    for (int64_t col = 0; col < K; col += 8) {
      int32_t tok[8], vals[8];
      bool valid[8];
      for (int i = 0; i < 8; ++i) tok[i] = tokens[row * K + col + i];
      const int32_t* row_table = s.table;
      ConvertPositions(p, s, tok, [row_table](uint32_t b) { return row_table[b]; }, vals, valid);
      for (int i = 0; i < 8; ++i) {
        out[row * K + col + i] = vals[i];
        count += valid[i];
      }
    }
    counts[row] = count;
  }
  const bool ok = std::fwrite(out.data(), sizeof(int32_t), out.size(), stdout) == out.size() &&
                  std::fwrite(counts.data(), sizeof(int32_t), T, stdout) == static_cast<size_t>(T);
  return ok ? 0 : 1;
}
"""
INT32_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> pathlib.Path:
    return compile_host_program(DRIVER, tmp_path_factory.mktemp("index_conversion_rule"))


def run_driver(binary, req, table, tokens, *, block_size, dcp_size, interleave, rank,
               pref_ids=None, pref_starts=None):
    num_tokens, top_k = tokens.shape
    num_reqs, width = table.shape
    num_starts = 0 if pref_starts is None else len(pref_starts)
    header = np.array([num_tokens, top_k, num_reqs, width, num_starts, block_size, dcp_size,
                       interleave, rank, pref_ids is not None], np.int64)
    parts = [header, req, table, tokens]
    if pref_ids is not None:
        parts += [pref_ids, pref_starts]
    stdin = b"".join(np.ascontiguousarray(a, a.dtype if a is header else np.int32).tobytes()
                     for a in parts)
    result = subprocess.run([str(binary)], input=stdin, capture_output=True, check=True)
    out = np.frombuffer(result.stdout, np.int32)
    return out[: num_tokens * top_k].reshape(num_tokens, top_k), out[num_tokens * top_k:]


def reference(req, table, tokens, *, block_size, dcp_size, interleave, rank, pref_ids=None,
              pref_starts=None):
    vals, counts = index_conversion._convert(
        jnp.asarray(req), jnp.asarray(table), jnp.asarray(tokens), rank,
        None if pref_ids is None else jnp.asarray(pref_ids),
        None if pref_starts is None else jnp.asarray(pref_starts),
        block_size=block_size, dcp_size=dcp_size, interleave=interleave, compact=False, count=True)
    return np.asarray(vals), np.asarray(counts)


def assert_matches_pure_jax(driver, req, table, tokens, **kwargs):
    got_slots, got_counts = run_driver(driver, req, table, tokens, **kwargs)
    want_slots, want_counts = reference(req, table, tokens, **kwargs)
    np.testing.assert_array_equal(got_slots, want_slots)
    np.testing.assert_array_equal(got_counts, want_counts)


def random_case(rng, *, num_tokens, top_k, num_reqs, width, block_size, dcp_size, interleave):
    req = rng.integers(-2, num_reqs + 2, num_tokens)  # out-of-range ids are clipped
    table = rng.integers(0, 1 << 20, (num_reqs, width))
    span = max(width * block_size * dcp_size, 1)
    tokens = rng.integers(0, 2 * span, (num_tokens, top_k))  # half past the table's width
    tokens = np.where(rng.random(tokens.shape) < 0.15, rng.integers(-5, 0, tokens.shape), tokens)
    return req.astype(np.int32), table.astype(np.int32), tokens.astype(np.int32)


@pytest.mark.parametrize("dcp_size,interleave,block_size", [
    (1, 1, 64), (1, 1, 1), (1, 1, 7), (2, 1, 64), (2, 2, 64), (4, 8, 64), (3, 5, 15), (8, 1, 2)])
@pytest.mark.parametrize("width", [0, 1, 33])
def test_paged_positions_match_pure_jax(driver, dcp_size, interleave, block_size, width):
    rng = np.random.default_rng(dcp_size * 1000 + interleave * 100 + block_size + width)
    for num_reqs in (0, 1, 5):
        req, table, tokens = random_case(rng, num_tokens=6, top_k=64, num_reqs=num_reqs,
                                         width=width, block_size=block_size, dcp_size=dcp_size,
                                         interleave=interleave)
        for rank in range(min(dcp_size, 3)):
            kwargs = dict(block_size=block_size, dcp_size=dcp_size, interleave=interleave,
                          rank=rank)
            assert_matches_pure_jax(driver, req, table, tokens, **kwargs)


def test_prefill_workspace_rows_match_pure_jax(driver):
    rng = np.random.default_rng(7)
    req, table, tokens = random_case(rng, num_tokens=9, top_k=32, num_reqs=3, width=8,
                                     block_size=16, dcp_size=1, interleave=1)
    pref_ids = np.array([-1, 0, 2, -1, 1, 2, -3, 0, 1], np.int32)
    for pref_starts in (np.array([0, 1000, INT32_MAX - 20], np.int32),  # the last one wraps
                        np.zeros((0,), np.int32)):
        ids = pref_ids if len(pref_starts) else np.minimum(pref_ids, -1)
        kwargs = dict(block_size=16, dcp_size=1, interleave=1, rank=0, pref_ids=ids,
                      pref_starts=pref_starts)
        assert_matches_pure_jax(driver, req, table, tokens, **kwargs)


def test_slots_wrap_as_int32(driver):
    """Large table entries times the block size wrap in int32, as the pure-JAX arithmetic does."""
    table = np.array([[INT32_MAX, 1 << 30, 3]], np.int32)
    tokens = np.array([[0, 5, 64, 70, 128, 129, 191, -1]], np.int32)
    kwargs = dict(block_size=64, dcp_size=1, interleave=1, rank=0)
    assert_matches_pure_jax(driver, np.zeros(1, np.int32), table, tokens, **kwargs)
