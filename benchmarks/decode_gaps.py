"""Where a decode step's idle time goes: the example's decode steps under the JAX profiler, and per
step the kernel (device) busy time, the span, the gaps between consecutive kernels with the kernels
on either side, and the host's activity during the large gaps.

    PYTHONPATH=benchmarks python -P benchmarks/decode_gaps.py -- --preset deepseek-v3.2 --layers 4 \\
        --batch 32 --context 65536 --fill-context --new-tokens 16 [--steps-per-call 8]
    PYTHONPATH=benchmarks python benchmarks/decode_gaps.py --trace-dir DIR --steps K   # a trace taken before

The first form runs examples/generate.py with the arguments after `--` plus --trace-dir (a temporary
folder) and --json, and prints the wall ms/step the example measured without the profiler beside the
device times of its traced steps, then the gap table (timing.DecodeGaps.table). Under the profiler the
host dispatches more slowly than without it, so the traced steps' span and period are not the wall time:
a wall time above the period says that the host, not the GPU, sets the step. CPU runs have no device
events; the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from timing import decode_gaps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "generate.py")


def run_example(example_args: list[str], trace_dir: str) -> dict:
    """examples/generate.py with example_args, --trace-dir trace_dir and --json: its JSON result."""
    out = os.path.join(trace_dir, "example.json")
    command = [sys.executable, "-P", EXAMPLE, *example_args, "--trace-dir", trace_dir, "--json", out]
    print("==", " ".join(command), flush=True)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"the example failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-dir", help="analyse this trace instead of running the example")
    parser.add_argument("--steps", type=int, help="decode steps in --trace-dir's trace")
    parser.add_argument("--marker", help="the device event that begins each step (default: the first "
                                         "event of the trace that runs exactly once per step)")
    parser.add_argument("--large-us", type=float, default=10.0,
                        help="gaps at least this long (and each step's largest) list host events")
    parser.add_argument("--pairs", type=int, default=8, help="kernel pairs to list by idle time")
    parser.add_argument("--json", help="write the per-step numbers and the summary line here")
    parser.add_argument("example_args", nargs="*", help="after --: examples/generate.py's arguments")
    args = parser.parse_args(argv)
    wall = None
    if args.trace_dir:
        if args.example_args or not args.steps:
            parser.error("--trace-dir takes --steps and no example arguments")
        trace_dir, steps = args.trace_dir, args.steps
    else:
        trace_dir = tempfile.mkdtemp(prefix="decode_gaps_")
        example = run_example(args.example_args, trace_dir)
        steps, wall = example["traced_steps"], example
    try:
        gaps = decode_gaps(trace_dir, steps, marker=args.marker, large_us=args.large_us)
    except ValueError as error:
        if not str(error).startswith("no device events"):  # no event once per step: say which
            sys.exit(f"gaps: {error}")
        print(f"gaps: nothing to analyse in {trace_dir}: {error}")  # a CPU run
        return
    p = gaps.per_step()
    if wall:
        period = f"{p['period_ms']:.3f}" if p["period_ms"] is not None else "-"
        print(f"wall {wall['step_ms']:.3f} ms/step untraced ({wall['timed_steps']} steps, "
              f"{wall['steps_per_call']} per call) | kernels {p['busy_ms']:.3f} | span {p['span_ms']:.3f} "
              f"| period {period} ms/step traced; wall / kernels {wall['step_ms'] / p['busy_ms']:.2f}x")
    print("\n".join(gaps.table(pairs=args.pairs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(p, summary=gaps.summary(), marker=gaps.marker,
                           wall_ms=wall["step_ms"] if wall else None,
                           steps_per_call=wall["steps_per_call"] if wall else None), f, indent=1)


if __name__ == "__main__":
    main()
