"""The index-conversion kernels' division by runtime divisors (ffi/common/fast_divmod.h), compiled
as host C++ from the header the kernels include, against NumPy's exact integer division.

The kernels divide positions (int32 >= 0) by block_size, dcp_size and interleave with one
multiply-high and a shift; a wrong multiplier or shift would put a position in the wrong block only
for some (divisor, position) pairs, so the grid holds every divisor up to 4096, every power of two
and its neighbours up to 2^31 - 1, random divisors, and for each the positions around every
multiple that matters (0, d - 1, d, the last multiples below 2^31) plus random ones.
"""

from __future__ import annotations

import pathlib
import subprocess

import numpy as np
import pytest

from requirements import compile_host_program

DRIVER = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "common/fast_divmod.h"

// stdin: int64 count, then count (divisor, n) pairs of uint32; stdout: count (quotient,
// remainder) pairs of uint32.
int main() {
  int64_t count = 0;
  if (std::fread(&count, sizeof(count), 1, stdin) != 1) return 1;
  std::vector<uint32_t> pairs(2 * count);
  if (std::fread(pairs.data(), sizeof(uint32_t), pairs.size(), stdin) != pairs.size()) return 1;
  std::vector<uint32_t> out(2 * count);
  for (int64_t i = 0; i < count; ++i) {
    const jax_sparse_mla::FastDivmod divmod = jax_sparse_mla::FastDivmod::Make(pairs[2 * i]);
    divmod.DivMod(pairs[2 * i + 1], &out[2 * i], &out[2 * i + 1]);
  }
  return std::fwrite(out.data(), sizeof(uint32_t), out.size(), stdout) == out.size() ? 0 : 1;
}
"""
INT32_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> pathlib.Path:
    return compile_host_program(DRIVER, tmp_path_factory.mktemp("fast_divmod"))


def run_driver(binary: pathlib.Path, divisors: np.ndarray, numerators: np.ndarray):
    pairs = np.stack([divisors, numerators], axis=1).astype(np.uint32)
    stdin = np.int64(len(pairs)).tobytes() + pairs.tobytes()
    result = subprocess.run([str(binary)], input=stdin, capture_output=True, check=True)
    out = np.frombuffer(result.stdout, np.uint32).reshape(-1, 2)
    return out[:, 0], out[:, 1]


def divisor_grid(rng: np.random.Generator) -> np.ndarray:
    powers = 2 ** np.arange(31, dtype=np.int64)
    near_powers = np.concatenate([powers - 1, powers, powers + 1])
    divisors = np.concatenate([
        np.arange(1, 4097), near_powers, rng.integers(1, INT32_MAX, 2000, endpoint=True),
        [INT32_MAX, INT32_MAX - 1, 3 * 2**29, 10**9, 1_000_003],
    ])
    return np.unique(divisors[(divisors >= 1) & (divisors <= INT32_MAX)])


def numerator_grid(d: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[D, 16] positions per divisor: the edges of its multiples and random ones."""
    top = (INT32_MAX // d) * d  # the last multiple of d in range
    edges = np.stack([np.zeros_like(d), np.ones_like(d), d - 1, d, d + 1, 2 * d - 1, 2 * d,
                      top - 1, top, np.minimum(top + d - 1, INT32_MAX),
                      np.full_like(d, INT32_MAX), np.full_like(d, INT32_MAX - 1)], axis=1)
    random = rng.integers(0, INT32_MAX, (len(d), 4), endpoint=True)
    return np.clip(np.concatenate([edges, random], axis=1), 0, INT32_MAX)


def test_fast_divmod_is_exact_division(driver):
    rng = np.random.default_rng(0)
    d = divisor_grid(rng)
    n = numerator_grid(d, rng)
    d = np.broadcast_to(d[:, None], n.shape).reshape(-1)
    n = n.reshape(-1)
    quotient, remainder = run_driver(driver, d, n)
    np.testing.assert_array_equal(quotient.astype(np.int64), n // d)
    np.testing.assert_array_equal(remainder.astype(np.int64), n % d)


@pytest.mark.parametrize("d", [1, 3, 64, 100, 2**30 + 1, INT32_MAX])
def test_fast_divmod_dense_random_numerators(driver, d):
    n = np.random.default_rng(d).integers(0, INT32_MAX, 200_000, endpoint=True)
    quotient, remainder = run_driver(driver, np.full_like(n, d), n)
    np.testing.assert_array_equal(quotient.astype(np.int64), n // d)
    np.testing.assert_array_equal(remainder.astype(np.int64), n % d)
