"""Prefill-sized sparse attention over an fp8_ds_mla cache: the fp8 kernel against the bf16 workspace
(ops/ds_mla_workspace.py: the request's rows dequantised once, then the bf16 kernel).

    PYTHONPATH=benchmarks python -P benchmarks/bench_ds_mla_workspace.py

One request whose context fills a shuffled block table; T query tokens, each selecting K = 2048
distinct positions. Device times (timing.device_times, median of 5 calls) of
`sparse_mla_decode(implementation="native")` on the fp8_ds_mla cache, of the workspace plus the bf16
kernel, and of the workspace alone; and the largest difference between the two outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm
from jax_sparse_mla.ops.ds_mla_workspace import bf16_workspace
from timing import device_times, wall_times

SHAPES = ((8192, 128, 131072), (2048, 128, 131072), (1024, 128, 65536), (8192, 64, 131072),
          (2048, 64, 65536))  # (T, H, context rows)
TOPK, BLOCK, SCALE = 2048, 64, 192 ** -0.5


def compare(num_tokens: int, num_heads: int, context: int, calls: int = 5, topk: int = TOPK,
            implementation: str = "native") -> dict:
    """The two routes at one shape (implementation="xla" and wall times: a CPU smoke run)."""
    rng = np.random.default_rng(0)
    num_blocks = context // BLOCK
    kv_c = jax.random.normal(jax.random.key(0), (context, 512), jnp.bfloat16)
    k_pe = jax.random.normal(jax.random.key(1), (context, 64), jnp.bfloat16)
    cache = jsm.concat_and_cache_ds_mla(kv_c, k_pe, jnp.zeros((num_blocks, BLOCK, 656), jnp.uint8),
                                        jnp.arange(context, dtype=jnp.int32))
    table = jnp.asarray(rng.permutation(num_blocks).astype(np.int32))[None]
    rows = np.stack([rng.choice(context, topk, replace=False) for _ in range(64)]).astype(np.int32)
    local = jnp.asarray(np.resize(rows, (num_tokens, topk)))
    req_ids = jnp.zeros(num_tokens, jnp.int32)
    q = jax.random.normal(jax.random.key(2), (num_tokens, num_heads, 576), jnp.bfloat16)
    physical = jsm.convert_req_index_to_global_index(req_ids, table, local, block_size=BLOCK)

    fp8 = jax.jit(lambda q, cache, slots: jsm.sparse_mla_decode(
        q, cache, slots, scale=SCALE, implementation=implementation)[0])
    workspace = jax.jit(lambda cache, table, local, physical: bf16_workspace(
        cache, table, req_ids, local, physical))

    @jax.jit
    def through_workspace(q, cache, table, local, physical):
        rows, indices = bf16_workspace(cache, table, req_ids, local, physical)
        return jsm.sparse_mla_decode(q, rows, indices, scale=SCALE, implementation=implementation)[0]

    difference = jnp.max(jnp.abs(fp8(q, cache, physical).astype(jnp.float32)
                                 - through_workspace(q, cache, table, local, physical)))
    flops = 2 * num_tokens * num_heads * topk * (576 + 512)
    timer = device_times if implementation == "native" else wall_times
    fp8_us = timer(fp8, [(q, cache, physical)], calls).us
    routed_us = timer(through_workspace, [(q, cache, table, local, physical)], calls).us
    workspace_us = timer(workspace, [(cache, table, local, physical)], calls).us
    return dict(num_tokens=num_tokens, num_heads=num_heads, context=context, fp8_us=fp8_us,
                workspace_bf16_us=routed_us, workspace_us=workspace_us,
                fp8_tflops=flops / fp8_us / 1e6, workspace_bf16_tflops=flops / routed_us / 1e6,
                max_difference=float(difference))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny shape in pure JAX, wall times (checks the script on a CPU)")
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}, µs (TFLOP/s)")
    runs = [dict(num_tokens=64, num_heads=16, context=1024, calls=1, topk=128,
                 implementation="xla")] if args.smoke else [dict(zip(("num_tokens", "num_heads",
                                                                       "context"), s)) for s in SHAPES]
    for kwargs in runs:
        r = compare(**kwargs)
        print(f"T={r['num_tokens']} H={r['num_heads']} context={r['context']}: fp8 kernel "
              f"{r['fp8_us']:.0f} ({r['fp8_tflops']:.0f}) | workspace + bf16 kernel "
              f"{r['workspace_bf16_us']:.0f} ({r['workspace_bf16_tflops']:.0f}), of which the "
              f"workspace {r['workspace_us']:.0f} | max difference {r['max_difference']:.3g}",
              flush=True)
    if args.smoke:
        assert r["max_difference"] < 0.1, r
        print("smoke OK")


if __name__ == "__main__":
    main()
