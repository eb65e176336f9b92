"""A mixed step as vLLM schedules it: D decode tokens of other requests plus one prefill chunk, in one
call of examples/generate.py's DeepSeek-V3.2 decoder, against the same tokens as two calls.

    PYTHONPATH=benchmarks python -P benchmarks/bench_mixed_step.py [--out benchmarks/results]

Requests 0..D-1 hold --context positions and decode one token each; request D holds --context
positions and prefills the next --chunk. Three jitted steps over the same caches (donated, the same
rows rewritten every call), each timed by device time (timing.device_times: its kernels' busy time,
median of the calls) and wall time:

  decode   the D decode tokens alone
  chunk    the chunk alone
  mixed    decode tokens first, then the chunk (vLLM's order), one call

and the row reports mixed against decode + chunk. Rows go to <out>/mixed_step_<card>.json. Without a
GPU (a smoke run) the times are wall times.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from timing import device_times, wall_times

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    """examples/generate.py as a module (its decoder, layout and metadata helpers)."""
    spec = importlib.util.spec_from_file_location("generate_example", os.path.join(ROOT, "examples",
                                                                                   "generate.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def time_steps(ex, *, preset: str, decodes: int, context: int, chunk: int, layers: int,
               kv_cache_dtype: str, implementation: str, calls: int) -> dict:
    """Device and wall µs of the decode, chunk and mixed steps (dicts of DeviceTimes.summary())."""
    from flax import nnx
    from jax_sparse_mla.flax import PRESETS, empty_layer_cache

    config = PRESETS[preset]
    model = ex.Decoder(config, layers, 512, rngs=nnx.Rngs(0), kv_cache_dtype=kv_cache_dtype,
                       implementation=implementation)
    graphdef, state = nnx.split(model)
    layout = ex.PagedLayout(1 + decodes, -(-(context + chunk) // ex.BLOCK_SIZE))
    caches = tuple(empty_layer_cache(config, layout.num_blocks, ex.BLOCK_SIZE, kv_cache_dtype)
                   for _ in range(layers))
    caches = ex.fill_context(caches, layout, config, context, 0, kv_cache_dtype)
    rng = np.random.default_rng(0)
    decode_ids = np.arange(decodes, dtype=np.int32)
    decode_positions = np.full(decodes, context, np.int32)
    chunk_ids = np.full(chunk, decodes, np.int32)
    chunk_positions = np.arange(context, context + chunk, dtype=np.int32)
    # Tokens in request order, so the decode tokens come first in the mixed step (vLLM's order).
    steps = dict(
        decode=(decode_ids, decode_positions, [1] * decodes + [0]),
        chunk=(chunk_ids, chunk_positions, [0] * decodes + [chunk]),
        mixed=(np.concatenate([decode_ids, chunk_ids]),
               np.concatenate([decode_positions, chunk_positions]), [1] * decodes + [chunk]),
    )

    def forward(state, tokens, positions, caches, metadata):
        logits, caches, _ = nnx.merge(graphdef, state)(tokens, positions, caches, metadata)
        return logits, caches

    run = jax.jit(forward, donate_argnums=3)
    held = [caches]
    results = {}
    for name, (req_ids, positions, query_lens) in steps.items():
        req_ids, positions = jnp.asarray(req_ids), jnp.asarray(positions)
        metadata = ex.step_metadata(layout, config, req_ids, positions, np.asarray(query_lens))
        tokens = jnp.asarray(rng.integers(0, 512, len(req_ids)), jnp.int32)

        def call():
            logits, held[0] = run(state, tokens, positions, held[0], metadata)
            return logits

        timer = device_times if jax.default_backend() == "gpu" else wall_times
        results[name] = timer(call, [()], calls).summary()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--decodes", type=int, nargs="+", default=[32])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8_ds_mla"])
    parser.add_argument("--implementation", default="auto")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for mixed_step_<card>.json")
    args = parser.parse_args()
    from records import card_name

    ex = load_example()
    device_kind = jax.devices()[0].device_kind
    header = dict(device=device_kind, card=card_name(device_kind), jax=jax.__version__,
                  command=" ".join(["python", *sys.argv]), context=args.context, chunk=args.chunk,
                  layers=args.layers, implementation=args.implementation)
    rows = []
    for kv_cache_dtype in args.kv_cache_dtypes:
        for decodes in args.decodes:
            times = time_steps(ex, preset=args.preset, decodes=decodes, context=args.context, chunk=args.chunk,
                               layers=args.layers, kv_cache_dtype=kv_cache_dtype,
                               implementation=args.implementation, calls=args.calls)
            apart = {key: times["decode"][key] + times["chunk"][key] for key in ("us", "wall_us")}
            rows.append(dict(kv_cache_dtype=kv_cache_dtype, decodes=decodes, **times, apart=apart))
            clock = "device" if jax.default_backend() == "gpu" else "wall (no GPU)"
            print(f"{kv_cache_dtype:10s} {decodes} decodes + chunk {args.chunk} at context "
                  f"{args.context}: mixed {times['mixed']['us'] / 1e3:.2f} ms {clock} "
                  f"({times['mixed']['wall_us'] / 1e3:.2f} wall) vs decode "
                  f"{times['decode']['us'] / 1e3:.2f} + chunk {times['chunk']['us'] / 1e3:.2f} = "
                  f"{apart['us'] / 1e3:.2f} ms {clock} ({apart['wall_us'] / 1e3:.2f} wall)",
                  flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"mixed_step_{header['card']}.json"), "w") as f:
            json.dump(dict(header, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
