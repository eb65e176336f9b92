"""Per-kernel device times of one SM90 decode call: the native handler's kernels vs FlashInfer from torch.

Run under Nsight Compute, which times each kernel on its own (no launch gaps, no dispatch):

    ncu --clock-control none --metrics gpu__time_duration.sum \
        --kernel-name regex:"BatchMLAPageAttentionHopper|PackAndClamp" \
        python benchmarks/kernel_times_sm90.py [--shapes 8x16 128x16 128x128]

For each T x H (K = 2048, bf16 cache, the realistic layout of bench_sm90.py), in this order: three
calls of jax.jit(sparse_mla_decode(..., implementation="native")) (kernels: PackAndClamp, then
FlashInfer's BatchMLAPageAttentionHopperKernel as compiled by this package's build) and three
BatchMLAPagedAttentionWrapper(backend="fa3").run() calls (the same kernel as compiled by FlashInfer's
JIT). The script prints the order; ncu prints the times.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from bench_sm90 import K, SCALE, TorchFa3, index_sets, make_inputs  # noqa: E402

CALLS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x16", "128x16", "128x128"],
                        help="TxH pairs")
    args = parser.parse_args()
    cache, _ = make_inputs()
    torch_fa3 = TorchFa3()
    for shape in args.shapes:
        num_tokens, num_heads = (int(n) for n in shape.split("x"))
        sets = index_sets(num_tokens)
        q = jax.random.normal(jax.random.key(num_tokens * num_heads), (num_tokens, num_heads, 576),
                              jnp.bfloat16)
        decode = jax.jit(lambda q, cache, slots: jsm.sparse_mla_decode(
            q, cache.reshape(-1, 64, 576), slots, scale=SCALE, implementation="native")[0])
        for _ in range(CALLS):
            jax.block_until_ready(decode(q, cache, sets[0]))
        run_torch = torch_fa3.runner(q, cache, sets[:1], "bf16", calls=CALLS)
        run_torch()
        torch_fa3.torch.cuda.synchronize()
        print(f"T={num_tokens} H={num_heads} K={K}: {CALLS} native calls, then {CALLS} torch calls",
              flush=True)


if __name__ == "__main__":
    main()
