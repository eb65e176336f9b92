"""Multi-GPU decode scaling: a DeepSeek-V3.2 MLA layer decode step under DCP / TP (jax_sparse_mla.parallel).

Run (one multi-GPU host; all its GPUs by default):
    python benchmarks/bench_parallel.py --out benchmarks/results
    python benchmarks/bench_parallel.py --smoke        # tiny sizes on 8 forced CPU host devices
Several hosts: start one process per host with --distributed (jax.distributed.initialize() reads the
cluster from the environment: SLURM, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID);
process 0 prints and writes the results.

What one decode step is (DeepSeek-V3.2 shapes: H = 128, kv_lora 512 + rope 64, qk_nope 128, v_head 128,
hidden 7168, top-k 2048, bf16, block size 64), for `batch` requests at `context` cached positions each:
  1. write the new token's latent row into its owner's cache shard (dcp_slot_mapping +
     sharded_concat_and_cache_mla);
  2. absorb W_UK into the query per head (heads sharded over tp x dcp, no communication);
  3. sharded_sparse_mla_decode: all-gather q over dcp, per-rank top-k filter + compaction + sparse
     attention (the native kernel on H100/H200), LSE all-gather + rescale + reduce-scatter over dcp;
  4. W_UV per head, then o_proj [H*128 -> 7168] with its all-reduce over all devices (GSPMD inserts it).
Not in the step: q_a/q_b and kv_a projections, the lightning indexer (top-k indices are fixed: the new
token plus 2047 distinct positions drawn uniformly from the context), MoE/MLP. The timed call runs
`--steps` steps in one jitted fori_loop with the caches donated; per-step time = median call time /
steps, tokens/s = batch / per-step time. "attn" is step 3 alone, timed the same way.

Layouts per GPU count G (--gpus, default 1, 2, 4, ... up to all devices): tp=1 x dcp=G (KV split G ways,
every device attends for all 128 heads over its 1/G of the keys) and tp=G x dcp=1 (KV replicated,
128/G heads per device); --meshes TPxDCP ... picks others. "KV GiB/GPU" is the cache shard one device
holds (num_blocks * 64 * 576 * 2 bytes). Each layout's step output is checked against the 1 x 1 layout
on the same logical KV (cache rows are a hash of (request, position, column), whatever the sharding):
"max err" is the largest |difference| / max |reference| of the layer output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on 8 forced CPU host devices (checks that the script works)")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (one process per host)")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 32")
    parser.add_argument("--context", type=int, default=None, help="default 131072")
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="GPU counts (default powers of two up to all devices)")
    parser.add_argument("--meshes", nargs="+", default=None,
                        help="explicit TPxDCP layouts, e.g. 1x8 2x4 8x1 (overrides --gpus)")
    parser.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per timed call")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point")
    parser.add_argument("--implementation", default="auto", choices=("auto", "xla", "native"))
    parser.add_argument("--out", default=None, help="folder for the JSON results")
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flag = "--xla_force_host_platform_device_count=8"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_sparse_mla import parallel as par  # noqa: E402
from jax_sparse_mla.flax.config import DEEPSEEK_V32  # noqa: E402
from timing import median_seconds  # noqa: E402

BLOCK_SIZE = 64


class Shapes:
    def __init__(self, smoke: bool):
        cfg = DEEPSEEK_V32
        self.heads = 16 if smoke else cfg.num_heads
        self.hidden = 256 if smoke else cfg.hidden_size
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.lora = cfg.kv_lora_rank
        self.v_head = cfg.v_head_dim
        self.topk = 128 if smoke else cfg.index_topk
        self.scale = cfg.softmax_scale


def _hash_rows(req, pos, cols):
    """Deterministic values in [-1, 1) from (request, position, column), uint32 arithmetic."""
    h = (req.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)) ^ (pos.astype(jnp.uint32) * jnp.uint32(0x85EBCA77))
    h = h ^ (cols.astype(jnp.uint32) * jnp.uint32(0xC2B2AE3D))
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x2C1B3C6D)
    h = h ^ (h >> 12)
    return ((h >> 8).astype(jnp.float32) * (2.0 ** -23) - 1.0)


def make_caches(mesh, batch, context, interleave, seed):
    """Per-rank block tables [N, B, W] (random block ids, block 0 unused) and bf16 caches
    [N, 1 + B*W, 64, 576] whose row for (request, global position p) is _hash_rows(request, p, .),
    made on the devices with the kv sharding."""
    n = mesh.shape[par.DCP_AXIS]
    width = -(-(context + 1) // (BLOCK_SIZE * n))
    num_blocks = 1 + batch * width
    rng = np.random.default_rng(seed)
    tables = np.stack([(1 + rng.permutation(batch * width)).reshape(batch, width)
                       for _ in range(n)]).astype(np.int32)
    owner_req = np.full((n, num_blocks), -1, np.int32)
    owner_k = np.zeros((n, num_blocks), np.int32)
    for r in range(n):
        owner_req[r, tables[r].ravel()] = np.repeat(np.arange(batch), width)
        owner_k[r, tables[r].ravel()] = np.tile(np.arange(width), batch)

    @jax.jit
    def fill(owner_req, owner_k):
        rank = jax.lax.broadcasted_iota(jnp.int32, (n, num_blocks, BLOCK_SIZE, 576), 0)
        off = jax.lax.broadcasted_iota(jnp.int32, (n, num_blocks, BLOCK_SIZE, 576), 2)
        col = jax.lax.broadcasted_iota(jnp.int32, (n, num_blocks, BLOCK_SIZE, 576), 3)
        req = owner_req[:, :, None, None]
        local = owner_k[:, :, None, None] * BLOCK_SIZE + off
        pos = (local // interleave) * (n * interleave) + rank * interleave + local % interleave
        rows = _hash_rows(req, pos, col)
        return jnp.where(req >= 0, rows, 0.0).astype(jnp.bfloat16)

    fill = jax.jit(fill, out_shardings=par.kv_sharding(mesh))
    caches = fill(jnp.asarray(owner_req), jnp.asarray(owner_k))
    tables = jax.device_put(jnp.asarray(tables), par.kv_sharding(mesh))
    return caches, tables


def make_inputs(shapes, batch, context, seed):
    """Queries, new-token rows, weights and top-k: identical values for every mesh."""
    k = iter(jax.random.split(jax.random.key(seed), 8))
    h, s = shapes.heads, shapes
    bf = jnp.bfloat16
    q_nope = jax.random.normal(next(k), (batch, h, s.nope), bf)
    q_pe = jax.random.normal(next(k), (batch, h, s.rope), bf)
    kv_c = _hash_rows(jnp.arange(batch)[:, None], jnp.full((batch, 1), context),
                      jnp.arange(s.lora)[None]).astype(bf)
    k_pe = _hash_rows(jnp.arange(batch)[:, None], jnp.full((batch, 1), context),
                      s.lora + jnp.arange(s.rope)[None]).astype(bf)
    w_uk = (jax.random.normal(next(k), (h, s.nope, s.lora), jnp.float32) * s.nope ** -0.5).astype(bf)
    w_uv = (jax.random.normal(next(k), (h, s.lora, s.v_head), jnp.float32) * s.lora ** -0.5).astype(bf)
    w_o = (jax.random.normal(next(k), (h * s.v_head, s.hidden), jnp.float32)
           * (h * s.v_head) ** -0.5).astype(bf)
    rng = np.random.default_rng(seed)
    topk = np.stack([np.concatenate([[context], rng.choice(context, s.topk - 1, replace=False)])
                     for _ in range(batch)]).astype(np.int32)
    return dict(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, w_uk=w_uk, w_uv=w_uv, w_o=w_o,
                topk=jnp.asarray(topk), req=jnp.arange(batch, dtype=jnp.int32),
                positions=jnp.full((batch,), context, jnp.int32))


def shard_inputs(mesh, x):
    heads = par.head_sharding(mesh)
    rep = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P((par.TP_AXIS, par.DCP_AXIS)))
    put = {"q_nope": heads, "q_pe": heads, "w_uk": NamedSharding(mesh, P((par.TP_AXIS, par.DCP_AXIS))),
           "w_uv": NamedSharding(mesh, P((par.TP_AXIS, par.DCP_AXIS))), "w_o": rows}
    return {name: jax.device_put(val, put.get(name, rep)) for name, val in x.items()}


def build_step(mesh, shapes, interleave, steps, implementation):
    n = mesh.shape[par.DCP_AXIS]
    heads = par.head_sharding(mesh)

    def attention(q, caches, tables, x):
        return par.sharded_sparse_mla_decode(
            mesh, q, caches, tables, x["topk"], x["req"], scale=shapes.scale,
            interleave=interleave, implementation=implementation)

    def layer(caches, tables, x, dep):
        x = dict(x, q_nope=x["q_nope"] + dep)  # dep = 0 from the previous step: nothing is hoisted
        slots = par.dcp_slot_mapping(x["req"], x["positions"], tables, block_size=BLOCK_SIZE,
                                     dcp_size=n, interleave=interleave)
        caches = par.sharded_concat_and_cache_mla(mesh, x["kv_c"], x["k_pe"], caches, slots)
        ql_nope = jnp.einsum("bhp,hpl->bhl", x["q_nope"], x["w_uk"])
        q = jax.lax.with_sharding_constraint(jnp.concatenate([ql_nope, x["q_pe"]], -1), heads)
        out = attention(q, caches, tables, x)
        v = jnp.einsum("bhl,hlv->bhv", out, x["w_uv"])
        y = v.reshape(v.shape[0], -1) @ x["w_o"]
        return caches, y

    def run_layer(caches, tables, x):
        def body(_, carry):
            caches, acc = carry
            caches, y = layer(caches, tables, x, (acc[:, :1, None] * 0).astype(jnp.bfloat16))
            return caches, acc + y.astype(jnp.float32)
        acc = jnp.zeros((x["req"].shape[0], shapes.hidden), jnp.float32)
        caches, acc = jax.lax.fori_loop(0, steps, body, (caches, acc))
        # One more step, whose output is checked across meshes.
        _, y = layer(caches, tables, x, jnp.zeros((), jnp.bfloat16))
        return caches, acc, y

    def run_attention(caches, tables, x):
        q = jax.lax.with_sharding_constraint(
            jnp.concatenate([jnp.einsum("bhp,hpl->bhl", x["q_nope"], x["w_uk"]), x["q_pe"]], -1),
            heads)

        def body(_, acc):  # acc * 0 keeps XLA from hoisting the attention out of the loop
            out = attention(q + (acc * 0).astype(q.dtype), caches, tables, x)
            return acc + out.astype(jnp.float32).sum(-1, keepdims=True)
        return jax.lax.fori_loop(0, steps, body, jnp.zeros(q.shape[:2] + (1,), jnp.float32))

    return (jax.jit(run_layer, donate_argnums=(0,)), jax.jit(run_attention))


def layouts(args, num_devices):
    if args.meshes:
        return [tuple(int(v) for v in m.lower().split("x")) for m in args.meshes]
    gpus = args.gpus or [g for g in (1, 2, 4, 8, 16, 32, 64) if g <= num_devices]
    out = []
    for g in gpus:
        for m in ((1, g), (g, 1)):
            if m not in out:
                out.append(m)
    return out


def main():
    args = ARGS
    if args.distributed:
        jax.distributed.initialize()
    smoke = args.smoke
    shapes = Shapes(smoke)
    batches = args.batch or ([1, 4] if smoke else [1, 32])
    context = args.context or (1024 if smoke else 131072)
    steps = args.steps or (2 if smoke else 20)
    repeats = args.repeats or (1 if smoke else 5)
    lead = jax.process_index() == 0
    device = jax.devices()[0]
    if lead:
        print(f"{len(jax.devices())} x {device.device_kind} ({device.platform}), "
              f"{jax.process_count()} process(es); H={shapes.heads}, top-k {shapes.topk}, "
              f"context {context}, interleave {args.interleave}, {steps} steps per call")
        print(f"{'GPUs':>4} {'tp':>3} {'dcp':>3} {'batch':>5} {'step ms':>9} {'attn ms':>9} "
              f"{'tokens/s':>10} {'KV GiB/GPU':>10} {'max err':>9}")
    rows = []
    for batch in batches:
        inputs = make_inputs(shapes, batch, context, seed=batch)
        reference = None
        for tp, dcp in layouts(args, len(jax.devices())):
            mesh = par.make_decode_mesh(tp, dcp)
            x = shard_inputs(mesh, inputs)
            caches, tables = make_caches(mesh, batch, context, args.interleave, seed=0)
            kv_bytes = caches.addressable_shards[0].data.nbytes
            run_layer, run_attention = build_step(mesh, shapes, args.interleave, steps,
                                                  args.implementation)
            state = {"caches": caches}

            def layer_call():
                state["caches"], acc, y = run_layer(state["caches"], tables, x)
                state["y"] = y
                return acc

            layer_s = median_seconds(layer_call, repeats) / steps  # after a warm-up call
            attn_call = lambda: run_attention(state["caches"], tables, x)  # noqa: E731
            attn_s = median_seconds(attn_call, repeats) / steps
            y = np.asarray(jax.device_get(state["y"]), np.float32) if jax.process_count() == 1 \
                else None
            err = None
            if y is not None:
                if reference is None and (tp, dcp) == (1, 1):
                    reference = y
                if reference is not None:
                    err = float(np.abs(y - reference).max() / max(np.abs(reference).max(), 1e-30))
            row = dict(gpus=tp * dcp, tp=tp, dcp=dcp, batch=batch, context=context,
                       interleave=args.interleave, step_ms=layer_s * 1e3, attn_ms=attn_s * 1e3,
                       tokens_per_s=batch / layer_s, kv_gib_per_gpu=kv_bytes / 2**30,
                       max_rel_err_vs_1x1=err)
            rows.append(row)
            if lead:
                print(f"{tp * dcp:>4} {tp:>3} {dcp:>3} {batch:>5} {row['step_ms']:>9.3f} "
                      f"{row['attn_ms']:>9.3f} {row['tokens_per_s']:>10.1f} "
                      f"{row['kv_gib_per_gpu']:>10.3f} {'-' if err is None else f'{err:.2e}':>9}")
            del state, caches
    if args.out and lead:
        os.makedirs(args.out, exist_ok=True)
        name = "parallel_smoke.json" if smoke else f"parallel_{device.platform}.json"
        path = os.path.join(args.out, name)
        with open(path, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), device=device.device_kind,
                           num_devices=len(jax.devices()), jax=jax.__version__,
                           implementation=args.implementation, rows=rows), f, indent=1)
        print(f"wrote {path}")
    bad = [r for r in rows if r["max_rel_err_vs_1x1"] is not None and r["max_rel_err_vs_1x1"] > 5e-2]
    if bad:
        print(f"FAIL: {len(bad)} layout(s) differ from 1x1 by more than 5e-2 (relative to max |y|)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
