"""Calls of the native decode top-k kernels to profile under Nsight Compute, beside cub_topk.cu.

Each named kernel of `top_k_per_row_decode` runs `--calls` times per shape on the same kind of rows as
benchmarks/cub_topk.cu fills (normal fp32 scores, every row its full width, k = 2048), so that ncu's
sections of our kernels and of CUB's batched top-k compare like for like:

    ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --kernel-name regex:"TopK" --launch-skip 1 --launch-count 1 \\
        python -P benchmarks/kernel_times_topk.py --shapes 1x65536 --kernels sm90_topk_cluster
    ncu (the same sections) --kernel-name regex:"[Tt]op[Kk]" --launch-skip 1 --launch-count 1 \\
        cub_topk --calls 1 --inputs 1 --reps 2 --check-rows 0 1x65536

(cub_topk built as `bench_indexer.py --cub` builds it; see docs/kernels/sm90-indexer.md.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_sparse_mla.kernels import registry

TOP_K = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x65536", "32x131072"], help="ROWSxWIDTH")
    parser.add_argument("--kernels", nargs="+", default=["sm90_topk_cluster"],
                        help="registered top_k_per_row_decode kernels (sm90_topk, sm90_topk_stream, "
                             "sm90_topk_cluster)")
    parser.add_argument("--calls", type=int, default=3, help="calls per shape and kernel")
    args = parser.parse_args()
    kernels = {k.name: k.fn for k in registry.registered_op_kernels("top_k_per_row_decode")}
    for shape in args.shapes:
        rows, width = (int(n) for n in shape.split("x"))
        scores = jax.random.normal(jax.random.key(rows * width), (rows, width), jnp.float32)
        lengths = jnp.full((rows,), width, jnp.int32)
        for name in args.kernels:
            call = jax.jit(lambda s, n, fn=kernels[name]: fn(s, n, next_n=1, k=TOP_K))
            for _ in range(args.calls):
                jax.block_until_ready(call(scores, lengths))
            print(f"{rows}x{width}: {args.calls} calls of {name}", flush=True)


if __name__ == "__main__":
    main()
