"""Per-kernel device times of one SM90 decode call: the native handler's kernels vs FlashInfer from torch.

Run under Nsight Compute, which times each kernel on its own (no launch gaps, no dispatch):

    ncu --clock-control none --metrics gpu__time_duration.sum \
        --kernel-name regex:"BatchMLAPageAttentionHopper|PackAndClamp|SparseMla|MergeSplits|sparse|mla_combine" \
        python benchmarks/kernel_times_sm90.py [--shapes 8x16 128x16 128x128] [--kv-dtype fp8] \
        [--calls 3] [--flashmla] > kernel_times.csv  # with ncu's --csv
    python benchmarks/kernel_times_sm90.py --summarize kernel_times.csv

For each T x H (K = 2048, the realistic layout of bench_sm90.py), in this order: `--calls` jitted
calls of each native backend of bench_sm90.py for the cache (bf16: "native", PackAndClamp then
FlashInfer's BatchMLAPageAttentionHopperKernel as compiled by this package's build; fp8: "native_fp8",
our SparseMlaFp8DecodeKernel, or SparseMlaFp8WideDecodeKernel with more than 16 heads, and
"native_fa3_fp8"; fp8_ds_mla: "native_fp8"; our kernels followed by MergeSplitsKernel when the plan
splits) and, for bf16 and fp8 caches, as many BatchMLAPagedAttentionWrapper(backend="fa3").run()
calls (the same FlashInfer kernel as compiled by FlashInfer's JIT), and with `--flashmla` as many
calls of FlashMLA's sparse kernel for the cache (benchmarks/flashmla_anchor.py; bf16:
flash_mla_sparse_fwd, fp8_ds_mla: flash_mla_with_kvcache and its combine kernel). The script prints
the order; ncu prints the times (other sections than the duration compare the kernels' use of the SM). `--summarize` reads ncu's CSV output and prints the median, min and max time per
kernel and grid.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import flashmla_anchor  # noqa: E402
from bench_sm90 import (  # noqa: E402
    BACKENDS, K, LAYOUT_BACKENDS, ROW_BYTES, SCALE, TorchFa3, decode, decode_kwargs, index_sets,
    make_inputs)

NANOSECONDS = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}


def summarize(csv_path: str) -> None:
    """Median / min / max of gpu__time_duration.sum per kernel and grid in ncu --csv output."""
    with open(csv_path) as f:
        lines = f.read().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    times_us = collections.defaultdict(list)
    for row in csv.DictReader(lines[header:]):
        if row["Metric Name"] == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            kernel = row["Kernel Name"].removeprefix("void ")
            kernel = kernel[:kernel.rfind("(")].replace("jax_sparse_mla::fp8::", "")  # no params
            times_us[(kernel, row["Grid Size"])].append(value * NANOSECONDS[row["Metric Unit"]] / 1e3)
    for (kernel, grid), times in times_us.items():
        print(f"{kernel} grid {grid}: {len(times)} calls, median {statistics.median(times):.1f} us "
              f"(min {min(times):.1f}, max {max(times):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x16", "128x16", "128x128"],
                        help="TxH pairs")
    parser.add_argument("--kv-dtype", default="bf16", choices=list(ROW_BYTES))
    parser.add_argument("--no-torch", action="store_true", help="skip FlashInfer from torch")
    parser.add_argument("--calls", type=int, default=3, help="calls per shape and implementation")
    parser.add_argument("--flashmla", action="store_true",
                        help="also call FlashMLA's SM90 sparse kernel (needs flash_mla)")
    parser.add_argument("--summarize", metavar="CSV", help="summarize ncu --csv output and exit")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    cache = make_inputs([args.kv_dtype])[args.kv_dtype]
    torch_fa3 = None if args.no_torch or args.kv_dtype == "fp8_ds_mla" else TorchFa3()
    flashmla = flashmla_anchor.TorchFlashMLA() if args.flashmla else None
    kwargs = decode_kwargs(args.kv_dtype)
    for shape in args.shapes:
        num_tokens, num_heads = (int(n) for n in shape.split("x"))
        sets = index_sets(num_tokens)
        q = jax.random.normal(jax.random.key(num_tokens * num_heads), (num_tokens, num_heads, 576),
                              jnp.bfloat16)
        backends = [b for b in LAYOUT_BACKENDS[args.kv_dtype] if b != "xla"]
        for backend in backends:
            implementation, kernel = BACKENDS[backend]
            call = jax.jit(lambda q, cache, slots: decode(
                q, cache.reshape(-1, 64, cache.shape[-1]), slots, implementation, kernel, kwargs))
            for _ in range(args.calls):
                jax.block_until_ready(call(q, cache, sets[0]))
        if torch_fa3 is not None:
            run_torch = torch_fa3.runner(q, cache, sets[:1], args.kv_dtype, calls=args.calls)
            run_torch()
            torch_fa3.torch.cuda.synchronize()
        flashmla_reason = (flashmla_anchor.why_not(args.kv_dtype, num_heads, K)
                           if flashmla is not None else "not asked for")
        if flashmla_reason is None:
            call, _ = flashmla.runner(q, cache, sets[:1], args.kv_dtype, SCALE)
            for _ in range(args.calls):
                call(0)
            flashmla.torch.cuda.synchronize()
        print(f"T={num_tokens} H={num_heads} K={K} {args.kv_dtype}: {args.calls} calls of each of "
              + ", ".join(backends)
              + (f", then {args.calls} torch calls" if torch_fa3 is not None else "")
              + (f", then {args.calls} FlashMLA calls" if flashmla_reason is None
                 else f"; no FlashMLA calls ({flashmla_reason})"), flush=True)


if __name__ == "__main__":
    main()
