"""The lightning indexer on an SM90 GPU: decode (paged logits, top-k, the whole select of a layer) and
prefill (ragged logits over a chunk of query rows, their top-k), beside pure JAX and torch.

Run: python benchmarks/bench_indexer.py [--out benchmarks/results] [--batch 1 32 128]
     [--context 8192 65536 131072] [--prefill-keys 8192 65536 131072]
     [--backends native auto xla torch] [--cub [--cub-calls 50] [--cub-arch sm_90a]]
     [--smoke]

Decode, for B in {1, 32, 128} x context L in {8192, 65536, 131072} (every request of length L,
next_n = 1, H = 64, k = 2048):
  logits  fp8_paged_mqa_logits(..., max_context_len=L): "native" (implementation="native": the
          preferred SM90 kernel, validated or not), "auto" (what implementation="auto" runs: the
          validated kernels, and per shape the faster where two measured differently; not in the
          default --backends), "xla" (pure JAX)
  topk    top_k_per_row_decode on those logits: "native", "auto", "xla", "lax_top_k"
          (jax.lax.top_k(logits, 2048) alone, the bound the pure-JAX op is held to), "torch"
          (torch.topk(logits, 2048)) and, with --backends one_cta / one_cta_stream / cluster, the
          SM90 kernels called by name (`sm90_topk`, the one-CTA register build,
          `sm90_topk_stream`, the one-CTA build that streams rows through shared memory, and
          `sm90_topk_cluster`, one row per cluster): they show where "auto"'s shape rule comes from
  cub     with --cub, beside the topk rows: CUB's batched top-k (cub::DeviceBatchedTopK, CCCL 3.6,
          what FlashInfer's top_k runs for fp32 rows at most of these shapes) on rows of the same
          B x L, k = 2048, in three modes: "cub" (FlashInfer's default: ties unspecified),
          "cub_lower" (deterministic, ties to the lower position: our set, unsorted) and
          "cub_ascending" (cub_lower, then a kernel that sorts each row's k positions: our output,
          what calling CUB for our op would cost); and FlashInfer's own top-k (its filtered one-CTA
          or multi-CTA radix kernel, as its dispatcher TopKRaggedTransformDispatch picks by shape)
          in two modes: "fi_radix" (FlashInfer's default: ties and order unspecified) and
          "fi_radix_det" (deterministic=True; ties still unspecified). The benchmark
          compiles benchmarks/cub_topk.cu with nvcc against the CCCL and FlashInfer headers of
          FlashInfer's data/ folder (FLASHINFER_DATA_DIR, else found or fetched as
          ffi/flashinfer_headers.py does for the build) into a temporary folder and runs it per
          decode point: normal fp32 rows, lengths read on the device, --cub-calls calls in one CUDA
          graph over 4 inputs, timed with CUDA events (per-call time of the graph, median of 7
          replays), the selected set checked against a host top-k (in cub, fi_radix and
          fi_radix_det, whose ties are unspecified: the selected values). The prefill rows get the
          same five (--causal: the same row lengths, 6 calls over 2 inputs). Without nvcc or the
          headers it says so and skips them. Never imported by, and no dependency of, the package.
  select  logits + top-k in one jitted function (one indexer layer's selection): "native", "auto",
          "xla"
  GB/s counts the bytes the op must move at least: logits the fp8 keys, 132 bytes per cached token
  (B * L * 132), plus the fp32 logits written (B * L * 4); topk the logits read and the indices
  written (B * L * 4 + B * k * 4); select the keys and the indices.
Prefill, for a chunk of M = 4096 query rows (the last M tokens of a sequence of N keys, N in {8192,
65536, 131072}; row i sees keys [0, N - M + i + 1), causal):
  prefill_logits  fp8_mqa_logits: "native", "auto", and "xla" where N <= --xla-prefill-max-keys
  prefill_topk    top_k_per_row over those rows: "native", "auto", "xla" (same limit), "torch"
                  (torch.topk over the whole width, whose -inf columns stand outside the rows)
  TFLOP/s counts the in-range products, 2 * 64 * 128 * sum_i len_i; GB/s the logits written (fp32).
Ceilings in the same run (benchmarks/rooflines.py, torch): `peak_gbps`, a 4 GiB device-to-device copy
(bytes read + written); `peak_tflops_fp8`, an e4m3 8192^3 product through torch._scaled_mm.
Timing (benchmarks/timing.py): per-call device time from the JAX profiler's trace, the median over
--calls calls (each on its own query or logits array, rotating over 4) of the sum of the call's
kernel durations, with the spread of the calls ((max - min) / median). A row whose implied GB/s
exceeds the copy ceiling is measured again, then flagged (records.py). torch: --calls calls
captured in one CUDA graph, replayed and timed with CUDA events.
Writes <out>/indexer_<card>.json (card: h100, h200, ...): header (device, card, date, command,
ceilings) and rows (op, backend, B, context, us, spread, span_us, wall_us, gbps; prefill rows add M
and tflops). A backend that cannot run (no SM90 GPU, no extension, no torch) is reported and skipped.
--smoke runs tiny shapes with the pure-JAX backend only (CPU is fine, wall times) and writes nothing.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from jax_sparse_mla.kernels import registry  # noqa: E402
import records  # noqa: E402
from timing import device_times, torch_graph_seconds, wall_times  # noqa: E402

HEADS = 64
DIM = 128
TOP_K = 2048
BLOCK = 64
KEY_BYTES = 132  # fp8 values + fp32 scale per cached token
PREFILL_ROWS = 4096
# Distinct query / logits arrays the timed calls rotate over (decode; prefill logits are 1-2 GB).
DECODE_SETS = 4
PREFILL_SETS = 2
PREFILL_CALLS = 6
# Kernels the --backends of these names call by their registered name: top-k (decode rows) and
# logits (decode and prefill).
TOPK_BY_NAME = {"one_cta": "sm90_topk", "one_cta_stream": "sm90_topk_stream",
                "cluster": "sm90_topk_cluster"}


def registered(op, name):
    """The binding of the native kernel `name` of `op` (the public function's checked arguments)."""
    return next(k.fn for k in registry.registered_op_kernels(op) if k.name == name)


def make_decode_inputs(batch, context, seed=0):
    """q [B, 1, 64, 128] e4m3, index cache (each request its own blocks), weights, lengths,
    block table."""
    rng = np.random.default_rng(seed)
    blocks = -(-context // BLOCK)
    num_blocks = batch * blocks
    # Random bytes through JAX on the device (NumPy would take long for GBs): e4m3 values of a
    # normal distribution, scales 2^-6.
    values = jax.random.normal(jax.random.key(seed), (num_blocks, BLOCK * DIM), jnp.float32).astype(
        jnp.float8_e4m3fn)
    scales = jnp.full((num_blocks, BLOCK), 2.0 ** -6, jnp.float32)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(num_blocks, -1)
    pages = jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.uint8), scale_bytes], axis=1)
    cache = pages.reshape(num_blocks, BLOCK, KEY_BYTES)
    table = jnp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks))
    q = jax.random.normal(jax.random.key(seed + 1), (batch, 1, HEADS, DIM)).astype(jnp.float8_e4m3fn)
    weights = jax.random.normal(jax.random.key(seed + 2), (batch, HEADS), jnp.float32) * 0.1
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, cache, weights, lengths, table


def make_prefill_inputs(num_rows, num_keys, seed=0):
    """q [M, 64, 128] e4m3, keys [N, 128] e4m3 and their scales, weights, causal row ranges."""
    key = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(key[0], (num_rows, HEADS, DIM)).astype(jnp.float8_e4m3fn)
    k_fp8 = jax.random.normal(key[1], (num_keys, DIM)).astype(jnp.float8_e4m3fn)
    k_scale = jnp.exp2(jax.random.randint(key[2], (num_keys,), -8, -4)).astype(jnp.float32)
    weights = jax.random.normal(key[3], (num_rows, HEADS), jnp.float32) * 0.1
    starts = jnp.zeros((num_rows,), jnp.int32)
    ends = jnp.maximum(jnp.arange(num_keys - num_rows + 1, num_keys + 1, dtype=jnp.int32), 0)
    return q, k_fp8, k_scale, weights, starts, ends


def timed(timer, make_call, operands, shared, calls):
    """timer's DeviceTimes of jit(make_call)(operand, *shared) over `calls` calls rotating over
    `operands` (one distinct array per set); shared: the arrays every call reads (cache, lengths,
    ...), passed as arguments of the jit (closed over, they would be constants that XLA spends
    seconds folding)."""
    fn = jax.jit(make_call)
    return timer(fn, [(operand, *shared) for operand in operands], calls)


def distinct_copies(scores, count):
    """`count` distinct arrays of the same difficulty for a top-k: scores times 2^i keep every
    mantissa bit and the order (adding a constant instead would crowd the values into a few
    exponents, the worst case of a radix select, in all but the first)."""
    return [scores * 2.0 ** i for i in range(count)]


def torch_topk_seconds(score_sets, repeats):
    """torch.topk(k=2048) over each of `score_sets` (JAX arrays, shared through DLPack), one CUDA
    graph of those calls; None without torch or a CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tensors = [torch.from_dlpack(s) for s in score_sets]

    def run_all():
        for x in tensors:
            torch.topk(x, TOP_K, dim=1)

    return torch_graph_seconds(run_all, len(tensors), repeats)


def skipped(log, what, error):
    log(f"  {what}: skipped ({str(error)[:200]})")


# ---- CUB's batched top-k (benchmarks/cub_topk.cu, --cub) -------------------------------------------
# A standalone CUDA program, built here with nvcc; nothing of it is part of the package.
CUB_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cub_topk.cu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# cub_topk's mode name -> the backend name of its rows (CUB's three, FlashInfer's own two).
CUB_BACKENDS = {"default": "cub", "ties_to_lower": "cub_lower", "ascending": "cub_ascending",
                "flashinfer_radix": "fi_radix", "flashinfer_radix_deterministic": "fi_radix_det"}
CUB_INT_FIELDS = ("rows", "width", "k", "calls", "ws_bytes")
CUB_FLOAT_FIELDS = ("us", "min_us", "max_us")


class CubUnavailable(Exception):
    """nvcc or the CCCL / FlashInfer headers are missing, or cub_topk.cu did not build: CUB and
    FlashInfer's top-k are skipped."""


def find_nvcc():
    """nvcc: $NVCC, the PATH, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda; None when none is found."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    candidates += [os.path.join(root, "bin", "nvcc")
                   for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
                   if root]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _flashinfer_headers_module():
    """ffi/flashinfer_headers.py of this checkout (loaded by path: ffi/ is no package), or None."""
    path = os.path.join(REPO, "ffi", "flashinfer_headers.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("flashinfer_headers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flashinfer_data_dir():
    """FlashInfer's data/ folder (cccl/ and include/ under it), found as the native build finds it:
    $FLASHINFER_DATA_DIR, else ffi/flashinfer_headers.py's fetch (the installed pinned
    flashinfer-python, a build folder's unpacked copy of it, or the wheel unpacked into
    ~/.cache/jax-sparse-mla/flashinfer through pip). Raises CubUnavailable."""
    data = os.environ.get("FLASHINFER_DATA_DIR")
    if not data:
        headers = _flashinfer_headers_module()
        if headers is None:
            raise CubUnavailable("set FLASHINFER_DATA_DIR (no ffi/flashinfer_headers.py beside "
                                 "the benchmarks)")
        version = headers.FLASHINFER_VERSION
        # Build folders that hold the pinned version already (their VERSION stamp; no pip), then
        # a cache folder of our own (pip download, which fails cleanly offline).
        destinations = [d for d in sorted(glob.glob(os.path.join(REPO, "build", "*", "flashinfer")))
                        if _read(os.path.join(d, "VERSION")) == version]
        destinations.append(os.path.join(os.path.expanduser("~"), ".cache", "jax-sparse-mla", "flashinfer"))
        errors = []
        for destination in destinations:
            try:
                os.makedirs(destination, exist_ok=True)
                data = str(headers.fetch(headers.pathlib.Path(destination).resolve(), version))
                break
            except (headers.FetchError, OSError) as error:
                errors.append(str(error).strip().splitlines()[0] if str(error).strip() else repr(error))
        else:
            raise CubUnavailable("FlashInfer's headers could not be found or fetched "
                                 f"({'; '.join(errors)}); set FLASHINFER_DATA_DIR")
    header = os.path.join(data, "cccl", "cub", "cub", "device", "device_batched_topk.cuh")
    if not os.path.isfile(header):
        raise CubUnavailable(f"no cub::DeviceBatchedTopK under {data} ({header} is missing)")
    header = os.path.join(data, "include", "flashinfer", "topk.cuh")
    if not os.path.isfile(header):
        raise CubUnavailable(f"no FlashInfer top-k under {data} ({header} is missing)")
    return data


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cub_compile_command(nvcc, data, output, arch="sm_90a"):
    """The nvcc command line that builds cub_topk.cu against the CCCL headers and FlashInfer's own
    headers (include/) of FlashInfer's data/ folder `data`."""
    cccl = os.path.join(data, "cccl")
    return [nvcc, "-O3", "-std=c++20", f"-arch={arch}", "--expt-relaxed-constexpr", "--extended-lambda",
            "-I" + os.path.join(cccl, "cub"), "-I" + os.path.join(cccl, "libcudacxx", "include"),
            "-I" + os.path.join(cccl, "thrust"), "-I" + os.path.join(data, "include"),
            "-o", output, CUB_SOURCE]


def build_cub(directory, log, arch="sm_90a"):
    """Compiles cub_topk.cu into `directory`; its path. Raises CubUnavailable."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CubUnavailable("no nvcc (set NVCC or CUDA_HOME, or put nvcc on the PATH)")
    data = flashinfer_data_dir()
    binary = os.path.join(directory, "cub_topk")
    command = cub_compile_command(nvcc, data, binary, arch)
    log(f"building CUB's batched top-k and FlashInfer's top-k: {' '.join(command)}")
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as error:
        raise CubUnavailable(f"nvcc ran past {error.timeout:.0f} s") from None
    if result.returncode != 0:
        raise CubUnavailable(f"nvcc failed ({result.returncode}): {(result.stderr or result.stdout)[-1500:]}")
    log(f"  built in {time.perf_counter() - start:.0f} s")
    return binary


def parse_cub_line(line):
    """One result line of cub_topk ("cub_topk mode=... rows=... us=... check=ok ...") as a dict
    (numbers converted, `backend` added), or None for any other line."""
    words = line.split()
    if not words or words[0] != "cub_topk":
        return None
    fields = dict(word.split("=", 1) for word in words[1:] if "=" in word)
    if "mode" not in fields or "us" not in fields:
        return None
    for name in CUB_INT_FIELDS:
        if name in fields:
            fields[name] = int(fields[name])
    for name in CUB_FLOAT_FIELDS:
        if name in fields:
            fields[name] = float(fields[name])
    fields["backend"] = CUB_BACKENDS.get(fields["mode"], "cub_" + fields["mode"])
    return fields


def run_cub(binary, rows, width, calls, inputs=DECODE_SETS, causal=False):
    """cub_topk's rows (parse_cub_line) for `rows` rows of `width`, k = TOP_K, every mode; causal:
    row i holds width - rows + 1 + i positions (the prefill rows). Raises RuntimeError when it
    fails (a check failing still gives its rows, check=FAIL)."""
    command = [binary, "-k", str(TOP_K), "--calls", str(calls), "--inputs", str(inputs),
               *(["--causal"] if causal else []), f"{rows}x{width}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    rows = [row for row in map(parse_cub_line, result.stdout.splitlines()) if row is not None]
    if result.returncode not in (0, 3) or not rows:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: "
                           f"{(result.stderr or result.stdout)[-500:]}")
    return rows


def bench_cub(cub, record, op, label, nbytes, *, rows, width, calls, inputs=DECODE_SETS,
              causal=False, **shape):
    """CUB's and FlashInfer's rows (every mode of cub_topk) beside ours: cub = (binary, calls per
    graph at decode); op, label ("B=... L=..."), nbytes and shape as ours at that point; rows x
    width, causal: run_cub's."""
    try:
        results = run_cub(cub[0], rows, width, calls, inputs=inputs, causal=causal)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        skipped(record.log, "cub", error)
        return
    for row in results:
        spread = (row["max_us"] - row["min_us"]) / row["us"] if row.get("max_us") and row["us"] else None
        record.add(f"{op:14s} {row['backend']:9s} {label}", dict(us=row["us"], spread=spread),
                   nbytes, op=op, backend=row["backend"], **shape, cub_mode=row["mode"],
                   check=row.get("check"), timing="cuda_graph_events", ws_bytes=row.get("ws_bytes"))
        if row.get("check") != "ok":
            record.log(f"    {row['backend']} ({row['mode']}): the selection differs from the host "
                       f"top-k (check={row.get('check')})")


def topk_table(rows, log):
    """The decode top-k rows side by side: one line per B x L, one column per backend (us)."""
    topk = [r for r in rows if r.get("op") == "topk"]
    backends = list(dict.fromkeys(r["backend"] for r in topk))
    if not topk:
        return
    width = {b: max(10, len(b)) for b in backends}  # a column as wide as its name
    log("top-k per call (us), decode:")
    log("  " + f"{'B x L':>14s}" + "".join(f" {b:>{width[b]}s}" for b in backends))
    for shape in dict.fromkeys((r["B"], r["context"]) for r in topk):
        cells = {r["backend"]: r["us"] for r in topk if (r["B"], r["context"]) == shape}
        text = "".join(f" {cells[b]:{width[b]}.1f}" if cells.get(b) is not None
                       else f" {'-':>{width[b]}s}" for b in backends)
        log(f"  {shape[0]:>5d} x {shape[1]:6d}{text}")


def bench_decode(batch, context, backends, calls, timer, record):
    q, cache, weights, lengths, table = make_decode_inputs(batch, context)
    shared = (cache, weights, lengths, table)
    key_bytes = batch * context * KEY_BYTES
    logits_bytes = batch * context * 4
    index_bytes = batch * TOP_K * 4
    queries = [q * (i % 3 + 1) for i in range(DECODE_SETS)]  # distinct arrays, same magnitudes
    shape = dict(B=batch, context=context)
    score_sets = None

    def measure(op, backend, run, nbytes):
        record.measure(f"{op:14s} {backend:9s} B={batch:4d} L={context:6d}", run, nbytes,
                       op=op, backend=backend, **shape)

    for backend in [b for b in backends if b in ("native", "auto", "xla")]:
        def logits(qi, cache, weights, lengths, table, backend=backend):
            return jsm.fp8_paged_mqa_logits(qi, cache, weights, lengths, table,
                                            max_context_len=context, implementation=backend)

        def top_k(s, lengths, backend=backend):
            return jsm.top_k_per_row_decode(s, lengths, k=TOP_K, implementation=backend)

        def select(qi, cache, weights, lengths, table, backend=backend):
            return top_k(logits(qi, cache, weights, lengths, table), lengths)

        try:
            measure("logits", backend, lambda: timed(timer, logits, queries, shared, calls),
                    key_bytes + logits_bytes)
            if score_sets is None:
                scores = jax.jit(logits)(q, *shared)
                score_sets = distinct_copies(scores, DECODE_SETS)
            measure("topk", backend, lambda: timed(timer, top_k, score_sets, (lengths,), calls),
                    logits_bytes + index_bytes)
            measure("select", backend, lambda: timed(timer, select, queries, shared, calls),
                    key_bytes + index_bytes)
        except (ValueError, RuntimeError) as error:  # e.g. no native kernel on this device
            skipped(record.log, backend, error)
    if score_sets is None:
        return
    if "xla" in backends:
        measure("topk", "lax_top_k",
                lambda: timed(timer, lambda s: jax.lax.top_k(s, TOP_K)[1], score_sets, (), calls),
                logits_bytes + index_bytes)
    for backend in [b for b in backends if b in TOPK_BY_NAME]:
        kernel = registered("top_k_per_row_decode", TOPK_BY_NAME[backend])
        measure("topk", backend,
                lambda: timed(timer, lambda s, lengths: kernel(s, lengths, next_n=1, k=TOP_K),
                              score_sets, (lengths,), calls),
                logits_bytes + index_bytes)
    if "torch" in backends:
        seconds = torch_topk_seconds(score_sets, calls)
        if seconds is not None:
            record.add(f"{'topk':14s} {'torch':9s} B={batch:4d} L={context:6d}",
                       dict(us=seconds * 1e6), logits_bytes + index_bytes, op="topk",
                       backend="torch", **shape)


def bench_prefill(num_keys, backends, timer, record, xla_max_keys, num_rows=PREFILL_ROWS, cub=None):
    q, k_fp8, k_scale, weights, starts, ends = make_prefill_inputs(num_rows, num_keys)
    shared = (k_fp8, k_scale, weights, starts, ends)
    products = float(np.sum(np.asarray(ends - starts, np.float64)))
    flop = 2.0 * HEADS * DIM * products
    logits_bytes = num_rows * num_keys * 4
    queries = [q * (i % 3 + 1) for i in range(PREFILL_SETS)]
    score_sets = None

    for backend in [b for b in backends if b in ("native", "auto", "xla")]:
        if backend == "xla" and num_keys > xla_max_keys:
            continue

        def logits(qi, k_fp8, k_scale, weights, starts, ends, backend=backend):
            return jsm.fp8_mqa_logits(qi, k_fp8, k_scale, weights, starts, ends,
                                      implementation=backend)

        def top_k(s, starts, ends, backend=backend):
            return jsm.top_k_per_row(s, starts, ends, k=TOP_K, implementation=backend)

        try:
            row = record.measure(f"prefill_logits {backend:9s} M={num_rows:4d} N={num_keys:6d}",
                                 lambda: timed(timer, logits, queries, shared, PREFILL_CALLS),
                                 logits_bytes, op="prefill_logits", backend=backend, B=1,
                                 context=num_keys, M=num_rows)
            row["tflops"] = flop / row["us"] / 1e6 if row["us"] else None
            record.save()
            if row["tflops"] is not None:
                record.log(f"    {row['tflops']:.1f} TFLOP/s")
            if score_sets is None:
                scores = jax.jit(logits)(q, *shared)
                score_sets = distinct_copies(scores, PREFILL_SETS)
                del scores
            record.measure(f"prefill_topk   {backend:9s} M={num_rows:4d} N={num_keys:6d}",
                           lambda: timed(timer, top_k, score_sets, (starts, ends), PREFILL_CALLS),
                           logits_bytes, op="prefill_topk", backend=backend, B=1,
                           context=num_keys, M=num_rows)
        except (ValueError, RuntimeError) as error:
            skipped(record.log, backend, error)
    if cub is not None:  # the same causal rows; 2 inputs of 1-2 GB, 6 calls a graph
        bench_cub(cub, record, "prefill_topk", f"M={num_rows:4d} N={num_keys:6d}", logits_bytes,
                  rows=num_rows, width=num_keys, calls=PREFILL_CALLS, inputs=PREFILL_SETS,
                  causal=True, B=1, context=num_keys, M=num_rows)
    if "torch" in backends and score_sets is not None:
        seconds = torch_topk_seconds(score_sets, PREFILL_CALLS)
        if seconds is not None:
            record.add(f"prefill_topk   {'torch':9s} M={num_rows:4d} N={num_keys:6d}",
                       dict(us=seconds * 1e6), logits_bytes, op="prefill_topk", backend="torch",
                       B=1, context=num_keys, M=num_rows)


def ceilings(backends, log):
    """(copy GB/s, fp8 TFLOP/s) measured through torch, NaN where torch cannot run."""
    if "torch" not in backends:
        return float("nan"), float("nan")
    try:
        import torch

        import rooflines
        peak_gbps, peak_fp8 = rooflines.copy_gbps(), rooflines.matmul_tflops("fp8")
        torch.cuda.empty_cache()
        return peak_gbps, peak_fp8
    except Exception as error:  # noqa: BLE001  (report and go on without the ceilings)
        skipped(log, "rooflines (torch)", error)
        return float("nan"), float("nan")


def smoke():
    """Tiny shapes, pure JAX, on any device (wall times): the benchmark's code paths run."""
    record = records.Recorder(print)
    bench_decode(2, 4096, ("xla",), 2, wall_times, record)
    bench_prefill(512, ("xla",), wall_times, record, xla_max_keys=512, num_rows=64)
    assert {(r["op"], r["backend"]) for r in record.rows} == {
        ("logits", "xla"), ("topk", "xla"), ("select", "xla"), ("topk", "lax_top_k"),
        ("prefill_logits", "xla"), ("prefill_topk", "xla")}, record.rows
    print("smoke OK")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 65536, 131072])
    parser.add_argument("--prefill-keys", type=int, nargs="*", default=[8192, 65536, 131072])
    parser.add_argument("--xla-prefill-max-keys", type=int, default=8192,
                        help="largest N whose prefill rows also run pure JAX (it is slow)")
    parser.add_argument("--backends", nargs="+", default=["native", "xla", "torch"],
                        choices=["native", "auto", "xla", "torch", *TOPK_BY_NAME])
    parser.add_argument("--calls", type=int, default=20, help="timed calls per decode row")
    parser.add_argument("--cub", action="store_true",
                        help="also time CUB's batched top-k (three modes) and FlashInfer's "
                             "own top-k (two modes) through benchmarks/cub_topk.cu, built "
                             "with nvcc, at every decode point and prefill size; skipped "
                             "without nvcc or the headers")
    parser.add_argument("--cub-calls", type=int, default=50,
                        help="CUB calls per CUDA graph (per-call time = graph time / calls)")
    parser.add_argument("--cub-arch", default="sm_90a", help="nvcc -arch for cub_topk.cu")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, pure JAX only, writes nothing (CPU is fine)")
    args = parser.parse_args(argv)
    if args.smoke:
        smoke()
        return
    start = time.perf_counter()
    device = jax.devices()[0]
    print(f"device: {device.device_kind} (jax {jax.__version__})")
    peak_gbps, peak_fp8 = ceilings(args.backends, print)
    print(f"rooflines: copy {peak_gbps:.0f} GB/s, fp8 matmul {peak_fp8:.0f} TFLOP/s")
    os.makedirs(args.out, exist_ok=True)
    record = records.Recorder(print, records.result_path(args.out, "indexer"),
                              records.run_header(peak_gbps, peak_tflops_fp8=peak_fp8), peak_gbps)
    with tempfile.TemporaryDirectory(prefix="cub_topk_") as cub_dir:
        cub = None
        if args.cub:
            try:
                cub = (build_cub(cub_dir, print, args.cub_arch), args.cub_calls)
            except CubUnavailable as error:
                print(f"CUB's batched top-k and FlashInfer's top-k: skipped ({error})")
        for batch in args.batch:
            for context in args.context:
                bench_decode(batch, context, args.backends, args.calls, device_times, record)
                if cub is not None:  # CUB's rows right after ours at the same point
                    bench_cub(cub, record, "topk", f"B={batch:4d} L={context:6d}",
                              batch * context * 4 + batch * TOP_K * 4, rows=batch, width=context,
                              calls=cub[1], B=batch, context=context)
        if cub is not None:
            topk_table(record.rows, print)
        for num_keys in args.prefill_keys:
            bench_prefill(num_keys, args.backends, device_times, record, args.xla_prefill_max_keys,
                          cub=cub)
    elapsed = time.perf_counter() - start
    record.save(seconds=round(elapsed))
    print(f"benchmark took {elapsed:.0f} s; wrote {record.path}")


if __name__ == "__main__":
    main()
