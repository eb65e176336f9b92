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

Timing: per-call device time in steady state. A jitted function makes n calls back to back (each
on its own index set, an optimization barrier between calls so XLA cannot fuse calls together);
the per-call time is the slope (t(n2) - t(n1)) / (n2 - n1) of the medians, so the one-off dispatch
cost cancels. `us_call` is the wall time of one jitted call with block_until_ready (dispatch
included; what a T = 1 caller pays outside a larger jit).
Bytes per call = req_id (T*4) + token_indices (T*K*4) + gathered table entries (T*K*4) + output
(T*K*4) + counts (T*4, when returned). Roofline in the same run: an XLA elementwise copy of
2 GiB int32 (--copy-gib; bytes read + written), timed by the same slope. Writes DIR/index_conversion_h200.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import convert_req_index_to_global_index, filter_and_convert_dcp_index
from jax_sparse_mla.kernels.registry import current_device_capability
from timing import median_seconds

NUM_REQS, BLOCK_SIZE, TABLE_WIDTH = 64, 64, 1024
MODES = ("plain", "plain_compact", "dcp2_compact")
GPU_IMPLEMENTATIONS = ("native", "pallas")
CALLS = (2, 10)  # n1, n2 of the slope
REPEATS = 30


def copy_gbps(gib: float) -> float:
    """Device copy bandwidth (bytes read + written) of a `gib` GiB int32 array, in GB/s, timed
    like the conversions (slope over chained calls, so dispatch cancels)."""
    x = jnp.zeros((int(gib * (1 << 28)),), jnp.int32)

    def chained_copies(num_calls):
        def run(x):
            for _ in range(num_calls):  # an XLA streaming kernel: one read, one write per element
                x = jax.lax.optimization_barrier(x + 1)
            return x
        return jax.jit(run)

    n1, n2 = CALLS
    t1 = median_seconds(functools.partial(chained_copies(n1), x), REPEATS)
    t2 = median_seconds(functools.partial(chained_copies(n2), x), REPEATS)
    return 2 * x.nbytes * (n2 - n1) / (t2 - t1) / 1e9


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


def chained(fn, num_calls: int):
    """A jitted function running `fn` on index sets 0..num_calls-1, one after the other."""

    def run(req_ids, table, toks):
        outs = []
        tok = toks[0]
        for i in range(num_calls):
            outs.append(fn(req_ids[i], table, tok))
            if i + 1 < num_calls:
                # Orders call i+1 after call i and keeps XLA from fusing the calls into one.
                outs[-1], tok = jax.lax.optimization_barrier((outs[-1], toks[i + 1]))
        return outs

    return jax.jit(run)


def bytes_per_call(mode: str, num_tokens: int, top_k: int) -> int:
    counts = num_tokens * 4 if mode != "plain" else 0
    return num_tokens * 4 + 3 * num_tokens * top_k * 4 + counts


def measure(mode: str, implementation: str, num_tokens: int, top_k: int, sets) -> dict:
    req_ids, toks, table = sets
    fn = convert_fn(mode, implementation)
    n1, n2 = CALLS
    t1 = median_seconds(functools.partial(chained(fn, n1), req_ids, table, toks), REPEATS)
    t2 = median_seconds(functools.partial(chained(fn, n2), req_ids, table, toks), REPEATS)
    per_call = max((t2 - t1) / (n2 - n1), 1e-9)
    single = jax.jit(fn)
    us_call = median_seconds(lambda: single(req_ids[0], table, toks[0]), REPEATS) * 1e6
    return dict(impl=implementation, mode=mode, T=num_tokens, K=top_k, us=per_call * 1e6,
                us_call=us_call, gbps=bytes_per_call(mode, num_tokens, top_k) / per_call / 1e9)


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
    parser.add_argument("--out", required=True, help="directory for index_conversion_h200.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 1024, 8192])
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy roofline")
    args = parser.parse_args()
    impls = [*GPU_IMPLEMENTATIONS, "xla"]
    if current_device_capability() is None:
        print(f"no CUDA GPU (default device {jax.devices()[0].platform}): measuring xla only",
              file=sys.stderr)
        impls = ["xla"]
    device = jax.devices()[0]
    peak = copy_gbps(args.copy_gib)
    print(f"device: {device.device_kind}; copy bandwidth {peak:.0f} GB/s; jax {jax.__version__}")
    print("vLLM is not installed on this machine: its torch Triton kernels are not measured.")
    rows = []
    header = f"{'mode':>14} {'T':>5} {'impl':>6} {'us':>9} {'us_call':>8} {'GB/s':>7} {'%copy':>6}"
    print(header)
    for num_tokens in args.tokens:
        sets = index_sets(CALLS[1], num_tokens, args.top_k)
        for mode in MODES:
            if len(impls) > 1:
                check_equal(mode, sets)
            for impl in impls:
                row = measure(mode, impl, num_tokens, args.top_k, sets)
                row["pct_of_copy"] = 100 * row["gbps"] / peak
                rows.append(row)
                print(f"{mode:>14} {num_tokens:>5} {impl:>6} {row['us']:>9.2f} "
                      f"{row['us_call']:>8.1f} {row['gbps']:>7.0f} {row['pct_of_copy']:>5.1f}%")
        del sets
    if len(impls) > 1:
        print("\nfaster per (mode, T) (see index_conversion._select_core):")
        for mode in MODES:
            for num_tokens in args.tokens:
                us = {r["impl"]: r["us"] for r in rows
                      if r["mode"] == mode and r["T"] == num_tokens}
                best = min(us, key=us.get)
                print(f"  {mode:>14} T={num_tokens:>5}: {best} ("
                      + ", ".join(f"{impl}/xla time = {us[impl] / us['xla']:.2f}"
                                  for impl in GPU_IMPLEMENTATIONS) + ")")
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        device=device.device_kind,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        jax_version=jax.__version__,
        peak_gbps=peak,
        vllm="not installed on the benchmark machine; its torch Triton kernels are not measured",
        rows=rows,
    )
    path = os.path.join(args.out, "index_conversion_h200.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
