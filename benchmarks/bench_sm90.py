"""Sparse MLA decode on an SM90 GPU: the native handler vs pure JAX vs FlashInfer's fa3 kernel from torch.

Run: python benchmarks/bench_sm90.py [--out benchmarks/results] [--tokens ..] [--heads ..]
     [--fp8-tokens ..] [--fp8-heads ..] [--kv-dtypes bf16 fp8 fp8_ds_mla]

In one process, by default for T in {1, 8, 32, 128, 512} x H in {16, 64, 128}, K = 2048, bf16 cache,
and T in {8, 128, 512} x H in {16, 128} with fp8 caches (per-tensor e4m3 "fp8", and "fp8_ds_mla"):
  native            bf16 cache: FlashInfer's Hopper MLA kernel behind our XLA FFI handler (what
                    implementation="auto" and "native" run), jitted
  native_fp8        jax.jit(sparse_mla_decode(..., implementation="native")) with an fp8 cache: our fp8
                    kernels (ffi/sm90/sm90_fp8_kernel.cuh, sm90_fp8_wide_kernel.cuh)
  native_fa3_fp8    FlashInfer's Hopper MLA kernel on the per-tensor fp8 cache behind our handler
  xla               jax.jit(sparse_mla_decode(..., implementation="xla"))     (pure JAX)
  flashinfer_torch  FlashInfer's BatchMLAPagedAttentionWrapper(backend="fa3"), page_size = 1, from torch
                    (bf16 and per-tensor fp8; FlashInfer has no SM90 kernel for fp8_ds_mla)
  flashmla          with --flashmla, where `import flash_mla` works: FlashMLA's SM90 sparse kernels
                    from torch on the same buffers and index sets (bf16: flash_mla_sparse_fwd;
                    fp8_ds_mla: flash_mla_with_kvcache; heads padded to 64 or 128), timed by the sum
                    of their kernels' durations per call; each row carries the max relative
                    difference of its output from `auto`'s (benchmarks/flashmla_anchor.py)
Realistic layout: token t of index set s draws its K distinct slots from its own region of 8192 rows
(region s * T + t of 512), so no row is shared between tokens and consecutive calls rotate through
index sets holding 512 * 2048 rows (1.2 GB bf16) in all: every gathered byte comes from HBM. Above
T = 512 (prefill-sized calls) there is one index set and token t draws from region t % 512, so
tokens 512 apart share a region, as a prompt's tokens share its cache; pure JAX runs only up to
--xla-max-tokens (its gather of T x K rows grows past the device's memory).

Timing: per-call device time in steady state (benchmarks/timing.py).
  JAX: the median over 20 jitted calls (pure JAX: 6), each on its own query and index set, of the
       sum of the call's kernel durations in the JAX profiler's trace, with the spread of the calls
       ((max - min) / median); a row above the copy ceiling is measured again, then flagged.
  torch: n run() calls captured in one CUDA graph, replayed and timed with CUDA events (the
       wrapper's Python overhead is not in the number; without a graph it would dominate small T).
FLOP = 2*T*H*K*(576+512); bytes = T*K*row_bytes + T*H*(576+512)*2 (q in, out out), row_bytes =
1152 (bf16), 576 (fp8) or 656 (fp8_ds_mla).
Roofline in the same run: bf16 8192^3 matmul (torch) and a 4 GiB device copy (bytes read + written).
Also: T = 1 per-iteration time of a jitted decode loop (lax.fori_loop of 200 steps) for each cache
of --kv-dtypes and each native backend above (FlashInfer from torch aside) and pure JAX: the device
span of the loop over 200 (the kernels and the gaps between them), and its busy time over 200.
Writes <out>/<name>_<card>.json and <out>/<name>_<card>.png (--result-name, default sm90; card: h100,
h200, ...).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import flashmla_anchor  # noqa: E402
import jax_sparse_mla as jsm  # noqa: E402
import records  # noqa: E402
import rooflines  # noqa: E402
from timing import device_times, torch_graph_seconds  # noqa: E402

K = 2048
REGION_ROWS = 8192
NUM_REGIONS = 512  # each index set uses min(T, 512) regions
TOKENS = (1, 8, 32, 128, 512)
HEADS = (16, 64, 128)
# fp8 runs on a subset by default (device time); --fp8-tokens / --fp8-heads widen it.
FP8_TOKENS = (8, 128, 512)
FP8_HEADS = (16, 128)
SCALE = 192 ** -0.5
K_SCALE = 0.5


def flop(t, h):
    return 2 * t * h * K * (576 + 512)


ROW_BYTES = {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656}


def nbytes(t, h, kv_dtype):
    return t * K * ROW_BYTES[kv_dtype] + t * h * (576 + 512) * 2


def decode_kwargs(kv_dtype):
    """sparse_mla_decode's cache arguments for each benchmarked cache."""
    return {"bf16": dict(kv_cache_dtype="bfloat16"),
            "fp8": dict(kv_cache_dtype="fp8_e4m3", k_scale=K_SCALE),
            "fp8_ds_mla": dict(kv_cache_dtype="fp8_ds_mla")}[kv_dtype]


def make_inputs(kv_dtypes, seed=0):
    """{kv_dtype: cache [rows, row width]} over NUM_REGIONS regions, made on device."""
    from jax_sparse_mla.ops.kv_cache import pack_ds_mla_rows

    rows = NUM_REGIONS * REGION_ROWS
    bf16 = jax.random.normal(jax.random.key(seed), (rows, 576), jnp.bfloat16)
    caches = {"bf16": bf16}
    if "fp8" in kv_dtypes:
        caches["fp8"] = (bf16.astype(jnp.float32) / K_SCALE).astype(jnp.float8_e4m3fn)
    if "fp8_ds_mla" in kv_dtypes:
        caches["fp8_ds_mla"] = jax.jit(lambda x: pack_ds_mla_rows(x[:, :512], x[:, 512:]))(bf16)
    return caches


def index_sets(num_tokens, seed=1):
    """[S, T, K] int32: set s, token t draws K distinct rows of region (s * T + t) % NUM_REGIONS, with
    S = max(1, NUM_REGIONS // T): no row is shared between tokens up to T = NUM_REGIONS."""
    num_sets = max(1, NUM_REGIONS // num_tokens)
    regions = min(num_sets * num_tokens, NUM_REGIONS)
    keys = jax.random.uniform(jax.random.key(seed), (regions, REGION_ROWS))
    picks = jnp.argsort(keys, axis=1)[:, :K].astype(jnp.int32)
    slots = picks + (jnp.arange(regions, dtype=jnp.int32) * REGION_ROWS)[:, None]
    tokens = jnp.arange(num_sets * num_tokens) % regions
    return slots[tokens].reshape(num_sets, num_tokens, K)


def time_jax(implementation, q, cache, sets, kv_dtype, calls, kernel=None):
    """timing.DeviceTimes of jit(sparse_mla_decode) over `calls` calls, call i on query i (scaled
    copies of q) and index set i. `kernel`: a registered kernel name to call instead of the one the
    op would pick."""
    kwargs = decode_kwargs(kv_dtype)
    num_sets = min(sets.shape[0], calls)
    # Queries and index sets are separate arrays: a slice of one stacked array would be copied
    # before each custom call and timed with it.
    arg_sets = [(q * (i + 1), cache, sets[i]) for i in range(num_sets)]
    fn = jax.jit(lambda q, cache, slots: decode(q, cache.reshape(-1, 64, cache.shape[-1]), slots,
                                                implementation, kernel, kwargs))
    return device_times(fn, arg_sets, calls)


def decode(q, cache, indices, implementation, kernel, kwargs):
    """out of sparse_mla_decode, or of the registered kernel named `kernel` on the same arguments."""
    if kernel is None:
        return jsm.sparse_mla_decode(q, cache, indices, scale=SCALE, implementation=implementation,
                                     **kwargs)[0]
    from jax_sparse_mla.kernels import registry

    fn = next(k for k in registry.registered_kernels() if k.name == kernel).fn
    k_scale = kwargs.get("k_scale", 1.0)
    return fn(q, cache, indices, None, bmm1_scale=SCALE * k_scale, bmm2_scale=k_scale,
              lse_base="e")[0]


# Backend name -> (implementation, registered kernel name or None for the op's own choice).
BACKENDS = {"native": ("native", "sm90_flashinfer_fa3"), "native_fp8": ("native", None),
            "native_fa3_fp8": ("native", "sm90_flashinfer_fa3"), "xla": ("xla", None)}
# The backends timed per cache layout (beside FlashInfer from torch).
LAYOUT_BACKENDS = {"bf16": ("native", "xla"),
                   "fp8": ("native_fp8", "native_fa3_fp8", "xla"),
                   "fp8_ds_mla": ("native_fp8", "xla")}


def time_decode_loop(backend, q, cache, sets, kv_dtype, steps=200):
    """(span, busy) microseconds per iteration of a jitted lax.fori_loop whose body is one T = 1
    decode: the loop's device span (kernels and the gaps between them) and kernel time, over
    `steps`, medians over 5 calls."""
    num_sets = sets.shape[0]
    implementation, kernel = BACKENDS[backend]
    kwargs = decode_kwargs(kv_dtype)

    def loop(q, cache, sets):
        # The carry takes the whole output: a carry of one element would let XLA slice the pure-JAX
        # kernel down to the heads and columns it needs.
        def body(i, acc):
            out = decode(q, cache.reshape(-1, 64, cache.shape[-1]), sets[i % num_sets],
                         implementation, kernel, kwargs)
            return acc + out[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((q.shape[1], 512), jnp.float32))

    times = device_times(jax.jit(loop), [(q, cache, sets)], 5).summary()
    return times["span_us"] / steps, times["us"] / steps


class TorchFa3:
    """FlashInfer's fa3 MLA kernel from torch on the same device buffers (shared through DLPack)."""

    def __init__(self):
        import torch
        import flashinfer  # noqa: F401  (imported for its side effects: JIT module registry)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.torch = torch
        self.wrapper_cls = BatchMLAPagedAttentionWrapper
        self.workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def as_torch(self, array):
        if array.dtype == jnp.float8_e4m3fn:  # export the bytes, view them as fp8 again
            u8 = jax.lax.bitcast_convert_type(array, jnp.uint8)
            return self.torch.from_dlpack(u8).view(self.torch.float8_e4m3fn)
        return self.torch.from_dlpack(array)

    def runner(self, q, cache, sets, kv_dtype, calls):
        """A function making `calls` run() calls, planned for index sets `sets` [S, T, K]."""
        torch = self.torch
        num_sets, num_tokens, _ = sets.shape
        num_heads = q.shape[1]
        q_t = self.as_torch(q)
        kv = self.as_torch(cache)
        ckv, kpe = kv[:, None, :512], kv[:, None, 512:]
        q_nope, q_pe = q_t[..., :512], q_t[..., 512:]
        out = torch.empty((num_tokens, num_heads, 512), dtype=torch.bfloat16, device="cuda")
        qo_indptr = torch.arange(num_tokens + 1, dtype=torch.int32, device="cuda")
        kv_indptr = qo_indptr * K
        kv_len = torch.full((num_tokens,), K, dtype=torch.int32, device="cuda")
        sets_t = self.as_torch(sets)
        wrappers = []
        for s in range(min(num_sets, calls)):
            wrapper = self.wrapper_cls(self.workspace, backend="fa3")
            wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                         kv_indices=sets_t[s].reshape(-1).contiguous(), kv_len_arr=kv_len,
                         num_heads=num_heads, head_dim_ckv=512, head_dim_kpe=64, page_size=1,
                         causal=False, sm_scale=SCALE,
                         q_data_type=torch.bfloat16,
                         kv_data_type=torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16)
            wrappers.append(wrapper)
        scales = dict(ckv_scale=K_SCALE, kpe_scale=K_SCALE) if kv_dtype == "fp8" else {}

        def run_all():
            for i in range(calls):
                wrappers[i % len(wrappers)].run(q_nope, q_pe, ckv, kpe, out=out, **scales)

        return run_all

    def time(self, q, cache, sets, kv_dtype, calls=32, repeats=10):
        return torch_graph_seconds(self.runner(q, cache, sets, kv_dtype, calls), calls, repeats)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["kv_dtype"], r["H"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    colors = {"native": "C0", "native_fp8": "C3", "native_fa3_fp8": "C4", "flashinfer_torch": "C1",
              "xla": "C2"}
    for ax, (kv_dtype, heads) in zip(axes[0], panels):
        for backend, color in colors.items():
            pts = sorted((r["T"], r["us"]) for r in rows if r["backend"] == backend
                         and r["H"] == heads and r["kv_dtype"] == kv_dtype and r["us"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=backend, color=color)
        ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="µs per call",
               title=f"{kv_dtype} cache, H={heads}, K={K}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="T values (bf16)")
    parser.add_argument("--heads", type=int, nargs="+", default=HEADS, help="H values (bf16)")
    parser.add_argument("--fp8-tokens", type=int, nargs="*", default=FP8_TOKENS)
    parser.add_argument("--fp8-heads", type=int, nargs="*", default=FP8_HEADS)
    parser.add_argument("--kv-dtypes", nargs="+", default=list(ROW_BYTES), choices=list(ROW_BYTES))
    parser.add_argument("--no-torch", action="store_true", help="skip FlashInfer from torch")
    parser.add_argument("--flashmla", action="store_true",
                        help="also time FlashMLA's SM90 sparse kernels from torch (needs flash_mla)")
    parser.add_argument("--xla-max-tokens", type=int, default=NUM_REGIONS,
                        help="largest T whose rows also run pure JAX")
    parser.add_argument("--result-name", default="sm90", help="<out>/<name>_<card>.json")
    parser.add_argument("--no-loop", action="store_true", help="skip the T = 1 decode loop")
    parser.add_argument("--loop-only", action="store_true",
                        help="only the T = 1 decode loop (e.g. to compare XLA_FLAGS settings)")
    args = parser.parse_args()
    grids = {"bf16": (args.tokens, args.heads), "fp8": (args.fp8_tokens, args.fp8_heads),
             "fp8_ds_mla": (args.fp8_tokens, args.fp8_heads)}
    device = jax.devices()[0]
    try:
        peak_tflops, peak_gbps = rooflines.matmul_tflops("bf16"), rooflines.copy_gbps()
    except Exception as error:  # noqa: BLE001  (report and go on without the ceilings)
        print(f"torch unavailable, no ceilings: {error!r}", file=sys.stderr)
        peak_tflops, peak_gbps = float("nan"), float("nan")
    try:
        torch_fa3 = None if args.no_torch else TorchFa3()
    except Exception as error:  # noqa: BLE001  (report and go on without the torch column)
        print(f"torch / flashinfer unavailable: {error!r}", file=sys.stderr)
        torch_fa3 = None
    flashmla = None
    if args.flashmla:
        try:
            flashmla = flashmla_anchor.TorchFlashMLA()
        except Exception as error:  # noqa: BLE001  (report and go on without the FlashMLA rows)
            print(f"FlashMLA unavailable: {error!r}", file=sys.stderr)
    print(f"device {device.device_kind}; roofline: {peak_tflops:.1f} TFLOP/s bf16, {peak_gbps:.0f} GB/s copy",
          flush=True)

    caches = make_inputs(args.kv_dtypes)
    loops = []
    os.makedirs(args.out, exist_ok=True)
    record = records.Recorder(print, records.result_path(args.out, args.result_name), records.run_header(
        round(peak_gbps, 1), peak_tflops=round(peak_tflops, 1),
        layout=f"per-token regions of {REGION_ROWS} rows, no row shared up to T = {NUM_REGIONS}, "
               "index sets rotated"),
        peak_gbps)

    sets = index_sets(1)
    for kv_dtype in () if args.no_loop else args.kv_dtypes:
        for h in (16, 128):
            q = jax.random.normal(jax.random.key(h), (1, h, 576), jnp.bfloat16)
            for backend in LAYOUT_BACKENDS[kv_dtype]:
                span_us, busy_us = time_decode_loop(backend, q, caches[kv_dtype], sets, kv_dtype)
                loops.append(dict(backend=backend, T=1, H=h, K=K, kv_dtype=kv_dtype,
                                  us_per_iteration=round(span_us, 2),
                                  busy_us_per_iteration=round(busy_us, 2),
                                  xla_flags=os.environ.get("XLA_FLAGS", "")))
                print(f"decode loop T=1 H={h} {kv_dtype} {backend}: {span_us:.1f} us/iteration "
                      f"({busy_us:.1f} in kernels)", flush=True)
                record.save(decode_loop=loops)
    flashmla_points = []
    for kv_dtype in () if args.loop_only else args.kv_dtypes:
        cache = caches[kv_dtype]
        tokens, heads_list = grids[kv_dtype]
        for t in tokens:
            sets = index_sets(t)
            for h in heads_list:
                q = jax.random.normal(jax.random.key(t * h), (t, h, 576), jnp.bfloat16)
                shape = dict(T=t, H=h, K=K, kv_dtype=kv_dtype)
                for backend in LAYOUT_BACKENDS[kv_dtype]:
                    implementation, kernel = BACKENDS[backend]
                    if implementation == "xla" and t > args.xla_max_tokens:
                        continue
                    calls = 6 if implementation == "xla" else 20
                    row = record.measure(
                        f"{backend:>17} T={t:4d} H={h:3d} {kv_dtype:>10}",
                        lambda: time_jax(implementation, q, cache, sets, kv_dtype, calls, kernel),
                        nbytes(t, h, kv_dtype), backend=backend, **shape)
                    _add_rate(row, t, h)
                if torch_fa3 is not None and kv_dtype != "fp8_ds_mla":
                    try:
                        seconds = torch_fa3.time(q, cache, sets, kv_dtype)
                    except Exception as error:  # noqa: BLE001
                        print(f"flashinfer_torch T={t} H={h} {kv_dtype}: {error!r}", file=sys.stderr)
                    else:
                        row = record.add(f"{'flashinfer_torch':>17} T={t:4d} H={h:3d} {kv_dtype:>10}",
                                         dict(us=seconds * 1e6), nbytes(t, h, kv_dtype),
                                         backend="flashinfer_torch", **shape)
                        _add_rate(row, t, h)
                if flashmla is not None:
                    flashmla_points.append((q, cache, sets, kv_dtype, shape))
                record.save(decode_loop=loops)
    # FlashMLA after all of ours: once torch's profiler has run, JAX's records no device event.
    for point in flashmla_points:
        time_flashmla(flashmla, record, *point)

    record.save(decode_loop=loops)
    rows = record.rows
    if rows:
        plot(rows, os.path.splitext(record.path)[0] + ".png")

    print(f"\n{'backend':>17} {'T':>4} {'H':>4} {'kv':>10} {'us':>9} {'spread':>6} {'TF/s':>7} {'%TF':>6} "
          f"{'GB/s':>7} {'%BW':>6}")
    for r in rows:
        if r["us"] is None:
            print(f"{r['backend']:>17} {r['T']:>4} {r['H']:>4} {r['kv_dtype']:>10}  {r['flag']}")
            continue
        spread = f"{100 * r['spread']:5.1f}%" if r.get("spread") is not None else "     -"
        print(f"{r['backend']:>17} {r['T']:>4} {r['H']:>4} {r['kv_dtype']:>10} {r['us']:>9.1f} "
              f"{spread} {r['tflops']:>7.1f} {100 * r['tflops'] / peak_tflops:>5.1f}% {r['gbps']:>7.0f} "
              f"{100 * r['gbps'] / peak_gbps:>5.1f}%")
    for r in loops:
        print(f"decode loop T=1 H={r['H']} {r['kv_dtype']} {r['backend']}: "
              f"{r['us_per_iteration']:.1f} us/iteration")


def time_flashmla(flashmla, record, q, cache, sets, kv_dtype, shape):
    """FlashMLA's row at one point (skipped with the reason where it has no kernel), with the max
    relative difference of its output from what `auto` gives for index set 0."""
    t, h = shape["T"], shape["H"]
    reason = flashmla_anchor.why_not(kv_dtype, h, K)
    if reason is not None:
        print(f"{'flashmla':>17} T={t:4d} H={h:3d} {kv_dtype:>10}: skipped ({reason})")
        return
    try:
        call, first = flashmla.runner(q, cache, sets, kv_dtype, SCALE)
        seconds = flashmla.device_seconds(call)
        ours = jax.jit(lambda q, cache, slots: decode(q, cache.reshape(-1, 64, cache.shape[-1]), slots,
                                                      "auto", None, decode_kwargs(kv_dtype)))(
            q, cache, sets[0])
        difference = flashmla_anchor.max_relative_error(ours, first())
    except Exception as error:  # noqa: BLE001  (a FlashMLA build or API mismatch: report, go on)
        print(f"{'flashmla':>17} T={t:4d} H={h:3d} {kv_dtype:>10}: {error!r}", file=sys.stderr)
        return
    row = record.add(f"{'flashmla':>17} T={t:4d} H={h:3d} {kv_dtype:>10}", dict(us=seconds * 1e6),
                     nbytes(t, h, kv_dtype), backend="flashmla", heads_run=flashmla_anchor.padded_heads(h),
                     max_rel_diff_from_auto=round(difference, 5), timing="torch_profiler_kernels", **shape)
    _add_rate(row, t, h)


def _add_rate(row, t, h):
    """TFLOP/s of a recorded row (None when flagged)."""
    row["tflops"] = round(flop(t, h) / row["us"] / 1e6, 2) if row["us"] else None


if __name__ == "__main__":
    main()
