"""Top-k index conversion on the GPU: the Pallas (Triton) kernels vs the XLA-fused pure-JAX version.

Run: python benchmarks/bench_index_conversion.py --out DIR [--tokens 1 128 1024 8192] [--top-k 2048]

In one process, for each T and K = 2048, three modes, each as
  pallas  jax.jit(<public function>(..., implementation="pallas"))
  xla     jax.jit(<public function>(..., implementation="xla"))
modes:
  plain          convert_req_index_to_global_index, in place, no counts (tile kernel)
  plain_compact  convert_req_index_to_global_index, return_valid_counts + compact (row kernel)
  dcp2_compact   filter_and_convert_dcp_index, N = 2, I = 1, rank 0, counts + compact (row kernel)
vLLM's own Triton kernels (from torch) are not measured: vLLM is not installed on the H200 machine.

Inputs: 64 requests, block_size 64, a 1024-block table per request (65536 positions; 512 blocks
per rank for DCP); token positions uniform over the request with 10% -1 holes.

Timing (benchmarks/timing.py): per-call device time, the median over 20 jitted calls (rotating
over 10 index sets) of the sum of the call's kernel durations in the JAX profiler's trace, with the
spread of the calls ((max - min) / median); a row above the copy ceiling is measured again, then
flagged. `wall_us` is the host's time for one jitted call with block_until_ready (dispatch
included; what a T = 1 caller pays outside a larger jit).
Bytes per call, the fewest that must move through HBM = req_id (T*4) + token_indices (T*K*4) +
output (T*K*4) + counts (T*4, when returned); the block-table entries a row gathers come from a
256 KB table that stays in L2, and are not counted. Roofline in the same run: an XLA elementwise copy of
2 GiB int32 (--copy-gib; bytes read + written), timed the same way. Writes
DIR/index_conversion_<card>.json (card: h100, h200, ...).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import convert_req_index_to_global_index, filter_and_convert_dcp_index
from jax_sparse_mla.kernels.registry import current_device_capability
from jax_sparse_mla.ops.index_conversion import auto_order
import records
from timing import device_times, wall_times

NUM_REQS, BLOCK_SIZE, TABLE_WIDTH = 64, 64, 1024
MODES = ("plain", "plain_compact", "dcp2_compact")
GPU_IMPLEMENTATIONS = ("native", "pallas")
NUM_SETS = 10
CALLS = 20


def copy_gbps(gib: float) -> float:
    """Device copy bandwidth (bytes read + written) of a `gib` GiB int32 array, in GB/s: an XLA
    streaming kernel (one read, one write per element) timed like the conversions."""
    x = jnp.zeros((int(gib * (1 << 28)),), jnp.int32)
    times = device_times(jax.jit(lambda x: x + 1), [(x,)], 10)
    return 2 * x.nbytes / times.us / 1e3


def index_sets(num_sets: int, num_tokens: int, top_k: int, seed: int = 0):
    """Device arrays: S x req_id [T], S x token_indices [T, K] (10% -1), block_table [R, W].

    The sets are separate arrays, not slices of one stacked array: a slice would be copied before
    each Pallas call (a custom call needs its own buffer) and timed with it."""
    key_req, key_tok, key_hole, key_table = jax.random.split(jax.random.key(seed), 4)
    req_id = jax.random.randint(key_req, (num_sets, num_tokens), 0, NUM_REQS, jnp.int32)
    tok = jax.random.randint(key_tok, (num_sets, num_tokens, top_k), 0,
                             BLOCK_SIZE * TABLE_WIDTH, jnp.int32)
    tok = jnp.where(jax.random.uniform(key_hole, tok.shape) < 0.1, -1, tok)
    table = jax.random.randint(key_table, (NUM_REQS, TABLE_WIDTH), 0, 1 << 20, jnp.int32)
    return [req_id[s] for s in range(num_sets)], [tok[s] for s in range(num_sets)], table


def convert_fn(mode: str, implementation: str):
    """(req_id [T], block_table [R, W], tok [T, K]) -> the mode's outputs."""
    if mode == "plain":
        return functools.partial(convert_req_index_to_global_index, block_size=BLOCK_SIZE,
                                 implementation=implementation)
    if mode == "plain_compact":
        return functools.partial(convert_req_index_to_global_index, block_size=BLOCK_SIZE,
                                 return_valid_counts=True, compact=True,
                                 implementation=implementation)
    # Each rank's table covers half the positions.
    return lambda req, table, tok: filter_and_convert_dcp_index(
        req, table[:, : TABLE_WIDTH // 2], tok, dcp_size=2, dcp_rank=0, block_size=BLOCK_SIZE,
        return_valid_counts=True, compact=True, implementation=implementation,
    )


def bytes_per_call(mode: str, num_tokens: int, top_k: int) -> int:
    counts = num_tokens * 4 if mode != "plain" else 0
    return num_tokens * 4 + 2 * num_tokens * top_k * 4 + counts


def measure(mode: str, implementation: str, num_tokens: int, top_k: int, sets, timer=device_times):
    """timing.DeviceTimes of the jitted mode over CALLS calls rotating over the index sets (timer:
    timing.wall_times without a GPU)."""
    req_ids, toks, table = sets
    fn = jax.jit(convert_fn(mode, implementation))
    return timer(fn, [(req, table, tok) for req, tok in zip(req_ids, toks)], CALLS)


def check_equal(mode: str, sets) -> None:
    """The two implementations agree bit for bit on the benchmark's own inputs."""
    req_ids, toks, table = sets
    want = jax.jit(convert_fn(mode, "xla"))(req_ids[0], table, toks[0])
    for impl in GPU_IMPLEMENTATIONS:
        got = jax.jit(convert_fn(mode, impl))(req_ids[0], table, toks[0])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for index_conversion_<card>.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 1024, 8192])
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy roofline")
    args = parser.parse_args()
    impls, timer = [*GPU_IMPLEMENTATIONS, "xla"], device_times
    if current_device_capability() is None:
        print(f"no CUDA GPU (default device {jax.devices()[0].platform}): measuring xla only, "
              "with wall times", file=sys.stderr)
        impls, timer = ["xla"], wall_times
    device = jax.devices()[0]
    peak = copy_gbps(args.copy_gib) if timer is device_times else float("nan")
    print(f"device: {device.device_kind}; copy bandwidth {peak:.0f} GB/s; jax {jax.__version__}")
    print("vLLM is not installed on this machine: its torch Triton kernels are not measured.")
    os.makedirs(args.out, exist_ok=True)
    record = records.Recorder(print, records.result_path(args.out, "index_conversion"),
                              records.run_header(peak, vllm=(
                                  "not installed on the benchmark machine; its torch Triton "
                                  "kernels are not measured")), peak)
    for num_tokens in args.tokens:
        sets = index_sets(NUM_SETS, num_tokens, args.top_k)
        for mode in MODES:
            if len(impls) > 1:
                check_equal(mode, sets)
            for impl in impls:
                row = record.measure(
                    f"{mode:>14} T={num_tokens:>5} {impl:>6}",
                    lambda: measure(mode, impl, num_tokens, args.top_k, sets, timer),
                    bytes_per_call(mode, num_tokens, args.top_k), impl=impl, mode=mode,
                    T=num_tokens, K=args.top_k)
                row["pct_of_copy"] = 100 * row["gbps"] / peak if row["gbps"] else None
    record.save()
    rows = [r for r in record.rows if r["us"] is not None]
    if len(impls) > 1:
        print("\nfaster per (mode, T), and the first kernel index_conversion.auto_order tries:")
        for mode in MODES:
            for num_tokens in args.tokens:
                us = {r["impl"]: r["us"] for r in rows
                      if r["mode"] == mode and r["T"] == num_tokens}
                if "xla" not in us or len(us) < len(impls):
                    continue
                best = min(us, key=us.get)
                auto = auto_order(num_tokens, compact=mode != "plain",
                                  dcp_size=2 if mode == "dcp2_compact" else 1)
                print(f"  {mode:>14} T={num_tokens:>5}: {best}, auto {auto[0]} ("
                      + ", ".join(f"{impl}/xla time = {us[impl] / us['xla']:.2f}"
                                  for impl in GPU_IMPLEMENTATIONS) + ")")
    print(f"wrote {record.path}")


if __name__ == "__main__":
    main()
