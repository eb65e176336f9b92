"""Every GPU number in README from one command, on the local card: build, GPU suite, benchmarks, example.

    make gpu-check                      # = python benchmarks/gpu_check.py --out benchmarks/results
    python benchmarks/gpu_check.py [--out DIR] [--no-build] [--workers N] [--only STEP ...]

Steps, in order (each one's output goes to DIR/gpu_check_<card>.log; a failing step is reported
and the next one runs):
  build      pip install of this checkout for the local card's family only (sm90 for compute
             capability 9.x, sm100 for 10.x, sm120 for 12.x) with JAX_SPARSE_MLA_CUDA=ON; without
             build isolation when scikit-build-core and nanobind are importable (offline machines:
             set FLASHINFER_DATA_DIR to a FlashInfer data/ folder)
  info       python -P -m jax_sparse_mla (what was built and what `auto` runs here)
  tests      JAX_SPARSE_MLA_REQUIRE_GPU=1 pytest tests/kernels -n WORKERS (pytest-xdist)
  sm90       bench_sm90.py at README's attention shapes (T 128 and 512, H 16 and 128, three caches,
             the T = 1 decode loop); where `import flash_mla` works (FlashMLA built on the machine,
             never a dependency), FlashMLA's sparse kernels beside ours at those shapes and at
             prefill sizes (T 4096 and 8192, H 64 and 128, bf16 and fp8_ds_mla: sm90_prefill_<card>.json)
  indexer    bench_indexer.py: decode B {1, 32, 128} x L {8192, 65536, 131072}, native / auto /
             pure JAX / torch.topk / both one-CTA top-k builds by name / CUB's batched top-k in
             three modes and FlashInfer's own top-k in two (--cub: built with nvcc from FlashInfer's
             CCCL and FlashInfer headers, skipped without them), prefill at N = 65536
  conversion bench_index_conversion.py at T {1, 128, 1024, 8192}
  example    examples/generate.py --preset deepseek-v3.2 --layers 4 --fill-context at batch x context
             32 x 65536 (--implementation auto, xla and native), 1 x 131072 and 128 x 8192 (auto and
             xla): wall ms/step as printed (15 steps, no profiler),
             and the device time per step from a profiler trace of 15 more steps (the sum of their
             kernel durations / 15; span: first kernel start to last kernel end / 15), and where a
             step's idle time goes (timing.decode_gaps: a summary line here, the table in the log)
  prefill    bench_prefill.py: time to first token of 1 x {8192, 32768, 65536, 131072} and 8 x 8192
             prompts in chunks of 8192 (bf16 and fp8_ds_mla caches, auto; pure JAX up to 32768),
             beside the prefill's FLOP limit at the run's measured rates; bench_mixed_step.py: 32
             decode tokens and a chunk of 8192 in one call against the two apart
Results: DIR/sm90_<card>.json (+ .png), indexer_<card>.json, index_conversion_<card>.json,
prefill_<card>.json, mixed_step_<card>.json, gpu_check_<card>.json (the steps' status and times, the example's steps), gpu_check_<card>.log.
The last thing printed is a one-screen summary. Tests and benchmarks import the installed package
(python -P), never the source tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

STEPS = ("build", "info", "tests", "sm90", "indexer", "conversion", "example", "prefill")
FAMILIES = {9: "sm90", 10: "sm100", 12: "sm120"}
# The decode step from random context rows (a prefill of 32 x 65536 is long).
EXAMPLE = ["--preset", "deepseek-v3.2", "--layers", "4", "--fill-context"]
# (batch, context, implementations): README's decode shapes.
EXAMPLE_SHAPES = ((32, 65536, ("auto", "xla", "native")), (1, 131072, ("auto", "xla")),
                  (128, 8192, ("auto", "xla")))
EXAMPLE_STEPS = 65  # --new-tokens: the first step compiles, the other 64 are timed (and 64 traced);
# over 15 the loop's start and final wait were 7-10% of the wall time (docs/benchmarks.md)


class Log:
    """Appends every step's output to one file and echoes the step lines."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w").close()

    def write(self, text: str) -> None:
        with open(self.path, "a") as f:
            f.write(text)

    def run(self, title: str, args: list[str], env: dict | None = None,
            timeout: float = 900) -> tuple[int, str, float]:
        """Runs `args` from the checkout's root, logs its output; (exit status, output, seconds)."""
        print(f"== {title}: {' '.join(args)}", flush=True)
        self.write(f"\n== {title}: {' '.join(args)}\n")
        start = time.perf_counter()
        try:
            result = subprocess.run(args, cwd=ROOT, env=dict(os.environ, **(env or {})),
                                    capture_output=True, text=True, timeout=timeout)
            status, output = result.returncode, result.stdout + result.stderr
        except subprocess.TimeoutExpired as error:
            status = 124
            output = (f"{error.stdout or ''}{error.stderr or ''}"
                      if isinstance(error.stdout, str) else "")
            output += f"\n(killed after {timeout:.0f} s)\n"
        seconds = time.perf_counter() - start
        self.write(output + f"\n== {title}: exit status {status} after {seconds:.0f} s\n")
        print(f"   exit status {status} after {seconds:.0f} s", flush=True)
        return status, output, seconds


def device_family() -> tuple[str, str]:
    """(family to build, the card's name) from nvidia-smi, without importing jax (which the build
    may replace)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.splitlines()[0]
    name, capability = (part.strip() for part in out.split(","))
    major = int(capability.split(".")[0])
    if major not in FAMILIES:
        raise SystemExit(f"gpu-check: no kernel family for compute capability {capability} ({name})")
    return FAMILIES[major], name


def build(log: Log, family: str) -> tuple[int, float]:
    isolated = []
    try:
        import nanobind  # noqa: F401
        import scikit_build_core  # noqa: F401
        isolated = ["--no-build-isolation"]
    except ImportError:
        pass
    env = dict(JAX_SPARSE_MLA_CUDA="ON", JAX_SPARSE_MLA_ARCHS=family,
               JAX_SPARSE_MLA_NVCC_JOBS=str(max(2, (os.cpu_count() or 2) - 2)))
    status, _, seconds = log.run("build", [sys.executable, "-m", "pip", "install", "-q",
                                           "--no-deps", "--force-reinstall", *isolated, "."],
                                 env=env, timeout=1200)
    return status, seconds


def suite_summary(output: str) -> str:
    """pytest's last line ('924 passed, 1 failed, ... in 119.48s') and the failed tests' names."""
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    failed = re.findall(r"^FAILED (\S+)", output, re.MULTILINE)
    summary = lines[-1] if lines else "no pytest summary (see the log)"
    return summary + "".join(f"\n      FAILED {name}" for name in failed)


def example_run(log: Log, batch: int, context: int, implementation: str) -> dict:
    """The example at one decode shape: wall ms/step as it prints it, device ms/step from its
    trace."""
    from timing import decode_gaps, read_trace

    trace_dir = tempfile.mkdtemp(prefix="gpu_check_example_")
    status, output, seconds = log.run(
        f"example {batch} x {context} {implementation}",
        [sys.executable, "-P", "examples/generate.py", *EXAMPLE, "--batch", str(batch),
         "--context", str(context), "--new-tokens", str(EXAMPLE_STEPS),
         "--implementation", implementation, "--trace-dir", trace_dir], timeout=900)
    result = dict(implementation=implementation, batch=batch, context=context, status=status,
                  seconds=round(seconds))
    match = re.search(r"decode: ([\d.]+) ms/step", output)
    _, kernels = read_trace(trace_dir) if status == 0 else ([], [])
    if match and kernels:
        steps = EXAMPLE_STEPS - 1
        result.update(wall_ms=float(match.group(1)),
                      device_ms=sum(d for _, d in kernels) / steps / 1e3,
                      span_ms=(kernels[-1][0] + kernels[-1][1] - kernels[0][0]) / steps / 1e3)
        try:  # where the idle time of a step goes (docs/benchmarks.md): the table to the log
            gaps = decode_gaps(trace_dir, steps)
            log.write("\n".join(gaps.table()) + "\n")
            result["gaps"] = gaps.summary()
        except ValueError as error:
            result["gaps"] = f"gaps: {error}"
        print(f"   {result['gaps']}", flush=True)
    return result


def rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["rows"]


def summary_lines(out: str, card: str, state: dict) -> list[str]:
    lines = [f"gpu-check on {state['device']} ({card}): {state['minutes']:.1f} min"]
    for step, info in state["steps"].items():
        lines.append(f"  {step:10s} exit {info['status']}, {info['seconds']:.0f} s"
                     + (f": {info['detail']}" if info.get("detail") else ""))
    indexer = rows(os.path.join(out, f"indexer_{card}.json"))
    pick = {(r["op"], r["backend"], r["B"], r["context"]): r["us"] for r in indexer}
    if indexer:
        lines.append("  indexer (us; auto / pure JAX):")
        for batch, context in ((1, 131072), (32, 65536), (128, 131072)):
            cells = []
            for op in ("logits", "topk", "select"):
                auto, xla = pick.get((op, "auto", batch, context)), pick.get((op, "xla", batch, context))
                cells.append(f"{op} {_us(auto)} / {_us(xla)}")
            lines.append(f"    {batch:3d} x {context:6d}: " + ", ".join(cells))
        # The top-k beside bench_indexer --cub's rows: CUB's three modes, FlashInfer's own two.
        beside = (("auto", "auto"), ("cub_lower", "CUB ties to the lower index"),
                  ("cub", "CUB default"),
                  ("cub_ascending", "CUB ties to the lower index, then sorted ascending"),
                  ("fi_radix", "FlashInfer's top-k"),
                  ("fi_radix_det", "FlashInfer's top-k, deterministic"))
        cub = [r for r in indexer if r["backend"] == "cub_lower"]
        if cub:
            lines.append("  top-k (us; " + " / ".join(name for _, name in beside) + "):")
            for r in cub:
                key = (r["B"], r["context"])
                shape = (f"prefill {r['M']} x {key[1]:6d}" if r["op"] == "prefill_topk"
                         else f"{key[0]:3d} x {key[1]:6d}")
                lines.append(f"    {shape}: " + " / ".join(
                    _us(pick.get((r["op"], backend, *key))) for backend, _ in beside))
    attention = rows(os.path.join(out, f"sm90_{card}.json"))
    attention += rows(os.path.join(out, f"sm90_prefill_{card}.json"))
    if attention:
        lines.append("  attention (us; ours / pure JAX / FlashMLA):")
        for r in attention:
            if r["backend"] in ("native", "native_fp8"):
                other = {x["backend"]: x["us"] for x in attention
                         if (x["T"], x["H"], x["kv_dtype"]) == (r["T"], r["H"], r["kv_dtype"])}
                lines.append(f"    T={r['T']:4d} H={r['H']:3d} {r['kv_dtype']:>10}: "
                             f"{_us(r['us'])} / {_us(other.get('xla'))} / {_us(other.get('flashmla'))}")
    examples = state.get("example", [])
    if examples:
        lines.append("  decode step, 4 DeepSeek-V3.2 layers (ms/step: wall, kernels, wall / kernels; "
                     "tokens/s by wall):")
        for e in examples:
            head = f"    {e['batch']:3d} x {e['context']:6d} {e['implementation']:6s}"
            if "device_ms" not in e:
                lines.append(f"{head} failed (exit {e['status']}; see the log)")
                continue
            lines.append(f"{head} {e['wall_ms']:6.2f} {e['device_ms']:6.2f} "
                         f"{e['wall_ms'] / e['device_ms']:5.2f}x {e['batch'] / e['wall_ms'] * 1e3:9,.0f}")
            if e.get("gaps"):
                lines.append(f"           {e['gaps']}")
        by = {(e["batch"], e["context"], e["implementation"]): e for e in examples if "wall_ms" in e}
        for batch, context, _ in EXAMPLE_SHAPES:
            auto, xla = by.get((batch, context, "auto")), by.get((batch, context, "xla"))
            if auto and xla:
                lines.append(f"    {batch} x {context}: auto / pure JAX {xla['wall_ms'] / auto['wall_ms']:.2f}x "
                             f"tokens/s (wall), {xla['device_ms'] / auto['device_ms']:.2f}x (kernels)")
    prefill = rows(os.path.join(out, f"prefill_{card}.json"))
    if prefill:
        lines.append("  prefill, 4 DeepSeek-V3.2 layers, chunks of 8192 (TTFT ms; limit; tokens/s):")
        for r in prefill:
            head = f"    {r['kv_cache_dtype']:>10} {r['implementation']:4s} {r['batch']} x {r['prompt_len']:6d}"
            if "ttft_ms" in r:
                lines.append(f"{head}: {r['ttft_ms']:8.1f} (limit {r['limit_ms']:.1f}, "
                             f"{r['ttft_ms'] / r['limit_ms']:.2f}x), {r['prefill_tokens_per_s']:,.0f}")
            else:
                lines.append(f"{head}: failed (see the log)")
    mixed = rows(os.path.join(out, f"mixed_step_{card}.json"))
    if mixed:
        lines.append("  mixed step: decode tokens + one prefill chunk in one call vs two (device ms):")
        for r in mixed:
            lines.append(f"    {r['kv_cache_dtype']:>10} {r['decodes']} decodes + chunk: "
                         f"{r['mixed']['us'] / 1e3:.2f} vs {r['apart']['us'] / 1e3:.2f}")
    return lines


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--no-build", action="store_true", help="use the installed package")
    parser.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="pytest-xdist workers for the GPU suite")
    parser.add_argument("--only", nargs="+", choices=STEPS, help="run only these steps")
    args = parser.parse_args()
    start = time.perf_counter()
    family, device = device_family()
    from records import card_name

    card = card_name(device)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    log = Log(os.path.join(out, f"gpu_check_{card}.log"))
    steps = [s for s in STEPS if (args.only is None or s in args.only)
             and not (s == "build" and args.no_build)]
    state = dict(device=device, card=card, family=family, steps={}, example=[])
    bench_env = dict(PYTHONPATH=HERE)
    python = [sys.executable, "-P"]

    def record(step: str, status: int, seconds: float, detail: str = "") -> None:
        state["steps"][step] = dict(status=status, seconds=round(seconds), detail=detail)
        state["minutes"] = (time.perf_counter() - start) / 60
        with open(os.path.join(out, f"gpu_check_{card}.json"), "w") as f:
            json.dump(state, f, indent=1)

    for step in steps:
        if step == "build":
            status, seconds = build(log, family)
            record(step, status, seconds, family)
            if status:
                break
        elif step == "info":
            status, output, seconds = log.run("info", [*python, "-m", "jax_sparse_mla"])
            record(step, status, seconds)
        elif step == "tests":
            try:
                import xdist  # noqa: F401
                workers = ["-n", str(args.workers)] if args.workers > 1 else []
            except ImportError:
                workers = []
            status, output, seconds = log.run(
                "tests", [*python, "-m", "pytest", "tests/kernels", *workers, "-q",
                          "-p", "no:cacheprovider", "--durations=15"],
                env=dict(JAX_SPARSE_MLA_REQUIRE_GPU="1"), timeout=900)
            record(step, status, seconds, suite_summary(output))
        elif step == "sm90":
            flashmla = ["--flashmla"] if importlib.util.find_spec("flash_mla") else []
            status, _, seconds = log.run("sm90", [
                *python, os.path.join(HERE, "bench_sm90.py"), "--out", out, "--no-torch",
                "--kv-dtypes", "bf16", "fp8", "fp8_ds_mla", "--tokens", "128", "512",
                "--heads", "16", "128", "--fp8-tokens", "128", "512", "--fp8-heads", "16", "128",
                *flashmla], env=bench_env)
            if flashmla and not status:
                status, _, more = log.run("sm90 prefill sizes", [
                    *python, os.path.join(HERE, "bench_sm90.py"), "--out", out, "--no-torch",
                    "--no-loop", "--flashmla", "--result-name", "sm90_prefill", "--xla-max-tokens", "0",
                    "--kv-dtypes", "bf16", "fp8_ds_mla", "--tokens", "4096", "8192", "--heads", "64",
                    "128", "--fp8-tokens", "4096", "8192", "--fp8-heads", "64", "128"],
                    env=bench_env, timeout=1200)
                seconds += more
            record(step, status, seconds, "with FlashMLA" if flashmla else "")
        elif step == "indexer":
            status, _, seconds = log.run("indexer", [
                *python, os.path.join(HERE, "bench_indexer.py"), "--out", out,
                "--backends", "native", "auto", "xla", "torch", "one_cta", "one_cta_stream",
                "--cub", "--prefill-keys", "65536"],
                env=bench_env)
            record(step, status, seconds)
        elif step == "conversion":
            status, _, seconds = log.run("conversion", [
                *python, os.path.join(HERE, "bench_index_conversion.py"), "--out", out],
                env=bench_env)
            record(step, status, seconds)
        elif step == "example":
            seconds = 0.0
            for batch, context, implementations in EXAMPLE_SHAPES:
                for implementation in implementations:
                    result = example_run(log, batch, context, implementation)
                    state["example"].append(result)
                    seconds += result["seconds"]
            record(step, max(e["status"] for e in state["example"]), seconds)
        elif step == "prefill":
            status, _, seconds = log.run("prefill", [
                *python, os.path.join(HERE, "bench_prefill.py"), "--out", out], env=bench_env,
                timeout=1800)
            mixed_status, _, mixed_seconds = log.run("mixed step", [
                *python, os.path.join(HERE, "bench_mixed_step.py"), "--out", out], env=bench_env,
                timeout=900)
            record(step, max(status, mixed_status), seconds + mixed_seconds)
    lines = summary_lines(out, card, state)
    log.write("\n".join(["", "== summary", *lines, ""]))
    print("\n" + "\n".join(lines))
    sys.exit(1 if any(info["status"] for info in state["steps"].values()) else 0)


if __name__ == "__main__":
    main()
