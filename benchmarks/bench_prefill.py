"""Time to first token: long prompts through examples/generate.py's DeepSeek-V3.2 decoder in chunks.

    PYTHONPATH=benchmarks python -P benchmarks/bench_prefill.py [--out benchmarks/results]

For each cache layout, implementation and (batch, prompt length) the example runs in its own process
(`--preset deepseek-v3.2 --layers 4 --prefill-chunk C`: every prompt in chunks of C tokens, each
chunk one jitted step over the cache written so far, caches donated; then a few decode steps from the
prefilled caches), so each row's peak device memory is its own. A row holds:

  ttft_ms       wall time of all chunks of all requests (each chunk waited for: vLLM samples after
                each step), after compilation and one warm-up call of the chunk step, as a server
                makes at start
  warmup_ms     that warm-up call: its first execution also loads the kernels
  tokens_per_s  prompt tokens over ttft_ms
  peak_bytes    JAX's peak device memory of the process (caches, weights and one chunk's work)
  limit_ms      the prefill's FLOPs over the rates measured in this run: GEMMs and sparse attention at
                the bf16 matmul rate, the indexer's logits at the e4m3 rate (flops_by_kind)
  kernel_us     with --trace (default): device time of the last chunk of request 0 by kind, from a
                trace of that chunk run again (the same rows rewritten)
  chunk_ms      wall time of each chunk (first -> last shows the growth with the context)

Rows go to <out>/prefill_<card>.json as they come. Pure JAX (`xla`) runs only --xla-prompts (1 x
32768: its chunks take over 10x auto's).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

from timing import device_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "generate.py")

# DeepSeek-V3.2 (jax_sparse_mla.flax.DEEPSEEK_V32) as the example's decoder uses it: the layer's
# projections plus the example's d -> d -> d MLP; the LM head of its toy vocabulary is negligible.
HIDDEN, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD = 7168, 128, 1536, 512, 64, 128, 128
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048

# Kernel names -> kinds, first match wins (FlashInfer's MLA kernel and ours; XLA's fusions by name).
KINDS = (
    ("logits", r"MqaLogits"),
    ("top-k", r"TopK"),
    ("attention", r"MLA|Mla|PackAndClamp|MergeSplits"),
    ("index conversion", r"Convert(Row|Tile)Kernel|conver"),
    ("cache writes (scatter)", r"scatter"),
    ("gathers", r"gather"),
    ("GEMMs", r"gemm|Gemm|GEMM|nvjet|xmma|cutlass|cublas|matmul"),
)


def gemm_flops_per_token() -> float:
    """Multiply-adds x 2 of one token's GEMMs in one layer (about 608 MFLOP)."""
    macs = (HIDDEN * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + HIDDEN * (KV_LORA + ROPE)
            + HEADS * NOPE * KV_LORA + HEADS * KV_LORA * V_HEAD + HEADS * V_HEAD * HIDDEN
            + Q_LORA * INDEX_HEADS * INDEX_DIM + HIDDEN * INDEX_DIM + HIDDEN * INDEX_HEADS
            + 2 * HIDDEN * HIDDEN)
    return 2.0 * macs


def flops_by_kind(prompt_len: int, batch: int, layers: int) -> dict[str, float]:
    """FLOPs of prefilling `batch` prompts of prompt_len tokens: token p attends min(p + 1, top-k)
    keys (QK over 576 dims, PV over 512) and scores p + 1 indexer keys (64 heads x 128 dims)."""
    positions = prompt_len * (prompt_len + 1) / 2  # sum of p + 1 over the prompt
    full = max(prompt_len - TOPK, 0)
    keys = TOPK * (TOPK + 1) / 2 + full * TOPK if prompt_len > TOPK else positions
    per_layer = dict(gemm=gemm_flops_per_token() * prompt_len,
                     attention=2.0 * HEADS * (KV_LORA + ROPE + KV_LORA) * keys,
                     logits=2.0 * INDEX_HEADS * INDEX_DIM * positions)
    return {kind: flops * batch * layers for kind, flops in per_layer.items()}


def kernel_time_by_kind(trace_dir: str) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(µs per kind, the 12 kernels with the most time) of the GPU kernels in a JAX profiler trace."""
    by_kind, by_name = collections.defaultdict(float), collections.defaultdict(float)
    for _, duration, name in device_events(trace_dir):
        kind = next((k for k, pattern in KINDS if re.search(pattern, name)), "rest")
        by_kind[kind] += duration
        by_name[name[:90]] += duration
    top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
    return dict(by_kind), top


def run_example(batch: int, prompt_len: int, chunk: int, kv_cache_dtype: str, implementation: str,
                trace: bool, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_prefill_") as scratch:
        out = os.path.join(scratch, "result.json")
        command = [sys.executable, "-P", EXAMPLE, "--preset", "deepseek-v3.2", "--layers", "4",
                   "--batch", str(batch), "--context", str(prompt_len), "--prefill-chunk", str(chunk),
                   "--kv-cache-dtype", kv_cache_dtype, "--implementation", implementation,
                   "--new-tokens", "4", "--json", out]
        if trace:
            command += ["--prefill-trace-dir", os.path.join(scratch, "trace")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if result.returncode != 0:
            return dict(error=(result.stdout + result.stderr)[-2000:])
        row = json.load(open(out))
        if trace:
            row["kernel_us"], row["top_kernels"] = kernel_time_by_kind(os.path.join(scratch, "trace"))
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="1x8192,1x32768,1x65536,1x131072,8x8192",
                        help="comma-separated BATCHxPROMPT_LEN")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8_ds_mla"])
    parser.add_argument("--implementations", nargs="+", default=["auto", "xla"])
    parser.add_argument("--xla-prompts", default="1x32768",
                        help="the BATCHxPROMPT_LEN that pure JAX runs (comma-separated)")
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per example run")
    parser.add_argument("--out", default=None, help="folder for prefill_<card>.json")
    args = parser.parse_args()

    import jax
    import rooflines
    from records import card_name

    import torch

    # The rates through torch, whose memory is handed back: this process never starts JAX's GPU
    # client, which would take most of the memory the example processes need.
    bf16_tflops, e4m3_tflops = rooflines.matmul_tflops("bf16"), rooflines.matmul_tflops("fp8")
    torch.cuda.empty_cache()
    device_kind = torch.cuda.get_device_name()
    header = dict(device=device_kind, card=card_name(device_kind), jax=jax.__version__,
                  command=" ".join(["python", *sys.argv]), bf16_tflops=bf16_tflops,
                  e4m3_tflops=e4m3_tflops, chunk=args.chunk, layers=4)
    print(f"{device_kind}: bf16 matmul {bf16_tflops:.0f} TFLOP/s, e4m3 {e4m3_tflops:.0f} TFLOP/s",
          flush=True)
    path = os.path.join(args.out, f"prefill_{header['card']}.json") if args.out else None
    rows = []
    for kv_cache_dtype in args.kv_cache_dtypes:
        for implementation in args.implementations:
            for shape in args.prompts.split(","):
                batch, prompt_len = (int(x) for x in shape.split("x"))
                if implementation == "xla" and shape not in args.xla_prompts.split(","):
                    continue
                flops = flops_by_kind(prompt_len, batch, 4)
                limit_ms = 1e3 * ((flops["gemm"] + flops["attention"]) / (bf16_tflops * 1e12)
                                  + flops["logits"] / (e4m3_tflops * 1e12))
                result = run_example(batch, prompt_len, args.chunk, kv_cache_dtype, implementation,
                                     not args.no_trace, args.timeout)
                row = dict(result, kv_cache_dtype=kv_cache_dtype, implementation=implementation,
                           batch=batch, prompt_len=prompt_len, limit_ms=limit_ms, flops=flops)
                rows.append(row)
                if "error" in result:
                    print(f"{kv_cache_dtype:10s} {implementation:5s} {batch}x{prompt_len}: FAILED\n"
                          f"{result['error']}", flush=True)
                else:
                    kinds = " ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(
                        row.get("kernel_us", {}).items(), key=lambda item: -item[1]))
                    print(f"{kv_cache_dtype:10s} {implementation:5s} {batch}x{prompt_len}: TTFT "
                          f"{row['ttft_ms']:8.1f} ms (limit {limit_ms:7.1f}, "
                          f"{row['ttft_ms'] / limit_ms:4.2f}x), {row['prefill_tokens_per_s']:9,.0f} "
                          f"tokens/s, peak {row.get('peak_bytes', 0) / 2**30:5.2f} GiB, chunks "
                          f"{row['chunk_ms'][0]:.1f} -> {row['chunk_ms'][-1]:.1f} ms, decode "
                          f"{row['step_ms']:.2f} ms/step; last chunk ms: {kinds}", flush=True)
                    for name, us in row.get("top_kernels", [])[:6]:
                        print(f"      {us / 1e3:8.2f} ms  {name}", flush=True)
                if path:
                    with open(path, "w") as f:
                        json.dump(dict(header, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
