"""The lightning indexer's decode path on an SM90 GPU: logits, top-k and the whole select per layer.

Run: python benchmarks/bench_indexer.py [--out benchmarks/results] [--batch 1 32 128]
     [--context 8192 65536 131072] [--backends native xla torch] [--smoke]

For B in {1, 32, 128} x context L in {8192, 65536, 131072} (every request of length L, next_n = 1,
H = 64, k = 2048), per backend:
  logits  fp8_paged_mqa_logits(..., max_context_len=L): "native" (implementation="native", the SM90
          kernel of ffi/sm90/indexer_logits.cuh) and "xla" (pure JAX)
  topk    top_k_per_row_decode on those logits: "native", "xla", and "torch" (torch.topk on the same
          scores, only when torch is importable)
  select  logits + top-k in one jitted function (one indexer layer's selection): "native", "xla"
GB/s counts the fp8 key bytes the logits read, 132 per cached token (B * L * 132), for every op, so
the numbers compare with the copy roofline `peak_gbps` of the same run: a 4 GiB device-to-device
copy timed the same way (bytes read + written).
Timing: per-call device time in steady state, as in bench_sm90.py: jitted functions making n1 and
n2 unrolled calls (each on its own query / logits array, so that XLA cannot merge them); the
per-call time is the slope of the median wall times (benchmarks/timing.py), which cancels the fixed
cost of a jitted call. torch: CUDA events around n calls after a warm-up.
Writes <out>/indexer_h200.json: device, date, command, peak_gbps, rows (op, backend, B, context,
us, gbps). A backend that cannot run (no SM90 GPU, no extension) is reported and skipped.
--smoke runs tiny shapes with the pure-JAX backend only (CPU is fine) and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm
from timing import median_seconds

HEADS = 64
TOP_K = 2048
BLOCK = 64
PAGE_BYTES = BLOCK * 132
KEY_BYTES = 132  # fp8 values + fp32 scale per cached token


def make_inputs(batch, context, seed=0):
    """q [B, 1, 64, 128] e4m3, index cache (each request its own blocks), weights, lengths,
    block table."""
    rng = np.random.default_rng(seed)
    blocks = -(-context // BLOCK)
    num_blocks = batch * blocks
    key = jax.random.key(seed)
    # Random bytes through JAX on the device (NumPy would take long for GBs): e4m3 values of a
    # normal distribution, scales 2^-6.
    values = jax.random.normal(key, (num_blocks, BLOCK * 128), jnp.float32).astype(
        jnp.float8_e4m3fn)
    scales = jnp.full((num_blocks, BLOCK), 2.0 ** -6, jnp.float32)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(num_blocks, -1)
    pages = jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.uint8), scale_bytes], axis=1)
    cache = pages.reshape(num_blocks, BLOCK, 132)
    table = jnp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks))
    q = jax.random.normal(jax.random.key(seed + 1), (batch, 1, HEADS, 128)).astype(
        jnp.float8_e4m3fn)
    weights = jax.random.normal(jax.random.key(seed + 2), (batch, HEADS), jnp.float32) * 0.1
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, cache, weights, lengths, table


def slope_seconds(make_call, operands, calls, repeats):
    """Per-call seconds: slope of the median wall times of n1 and n2 unrolled calls in one jit.
    make_call(operand, shared) -> output; operands: one distinct array per call (n2 of them)."""
    n1, n2 = calls

    def seconds(num_calls):
        fn = jax.jit(lambda ops: [make_call(ops[i]) for i in range(num_calls)])
        return median_seconds(lambda: fn(operands[:num_calls]), repeats)

    return max(seconds(n2) - seconds(n1), 0.0) / (n2 - n1)


def copy_roofline_gbps(calls, repeats, nbytes=4 << 30):
    """Bytes read + written per second of a device-to-device copy of `nbytes`, timed the same
    way."""
    n = nbytes // 4
    sources = [jnp.full((n,), float(i), jnp.float32) for i in range(calls[1])]
    per_call = slope_seconds(lambda x: x + 0.0, sources, calls, repeats)  # one read, one write
    del sources
    return 2 * nbytes / per_call / 1e9 if per_call > 0 else float("nan")


def bench_config(batch, context, backends, calls, repeats, log):
    rows = []
    q, cache, weights, lengths, table = make_inputs(batch, context)
    key_bytes = batch * context * KEY_BYTES
    queries = [q * (i % 3 + 1) for i in range(calls[1])]  # distinct arrays, same magnitudes

    def row(op, backend, seconds):
        us = seconds * 1e6
        gbps = key_bytes / seconds / 1e9 if seconds > 0 else float("nan")
        rows.append(dict(op=op, backend=backend, B=batch, context=context, us=us, gbps=gbps))
        log(f"  {op:6s} {backend:6s} B={batch:4d} L={context:6d}: {us:9.1f} us  {gbps:7.1f} GB/s")

    logits_ref = None
    for backend in [b for b in backends if b in ("native", "xla")]:
        def logits(qi, backend=backend):
            return jsm.fp8_paged_mqa_logits(qi, cache, weights, lengths, table,
                                            max_context_len=context, implementation=backend)

        def select(qi, backend=backend):
            return jsm.top_k_per_row_decode(logits(qi), lengths, k=TOP_K, implementation=backend)

        try:
            row("logits", backend, slope_seconds(logits, queries, calls, repeats))
            scores = jax.jit(logits)(q)
            if logits_ref is None:
                logits_ref = scores
            score_sets = [scores + float(i) for i in range(calls[1])]
            row("topk", backend, slope_seconds(
                lambda s, backend=backend: jsm.top_k_per_row_decode(s, lengths, k=TOP_K,
                                                                    implementation=backend),
                score_sets, calls, repeats))
            del score_sets
            row("select", backend, slope_seconds(select, queries, calls, repeats))
        except (ValueError, RuntimeError) as error:  # e.g. no native kernel on this device
            log(f"  {backend}: skipped ({str(error)[:200]})")
    if "torch" in backends and logits_ref is not None:
        seconds = torch_topk_seconds(logits_ref, calls[1], repeats)
        if seconds is not None:
            row("topk", "torch", seconds)
    return rows


def torch_topk_seconds(scores, calls, repeats):
    """torch.topk(k=2048) on the same scores (through DLPack), CUDA events, median of repeats."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.from_dlpack(scores)
    torch.topk(x, TOP_K, dim=1)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            torch.topk(x, TOP_K, dim=1)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return float(np.median(times))


def smoke():
    """Tiny shapes, pure JAX, on any device: the benchmark's code paths run."""
    rows = bench_config(2, 4096, ("xla",), calls=(1, 2), repeats=1, log=print)
    assert {r["op"] for r in rows} == {"logits", "topk", "select"}, rows
    print("smoke OK")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 65536, 131072])
    parser.add_argument("--backends", nargs="+", default=["native", "xla", "torch"],
                        choices=["native", "xla", "torch"])
    parser.add_argument("--calls", type=int, nargs=2, default=[4, 12],
                        help="n1 n2: unrolled calls of the two timed functions (slope)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, pure JAX only, writes nothing (CPU is fine)")
    args = parser.parse_args(argv)
    if args.smoke:
        smoke()
        return
    device = jax.devices()[0]
    print(f"device: {device.device_kind}")
    peak = copy_roofline_gbps(tuple(args.calls), args.repeats)
    print(f"copy roofline: {peak:.0f} GB/s")
    rows = []
    for batch in args.batch:
        for context in args.context:
            rows += bench_config(batch, context, args.backends, tuple(args.calls), args.repeats,
                                 print)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "indexer_h200.json")
    with open(path, "w") as f:
        json.dump(dict(device=device.device_kind, date=datetime.date.today().isoformat(),
                       command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                       peak_gbps=peak, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
