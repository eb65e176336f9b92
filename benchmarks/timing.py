"""Timing shared by the benchmarks: per-call device times of jitted JAX calls read from the GPU's own
clock (the JAX profiler's trace), and CUDA-graph replays of torch calls.

JAX calls: `device_times` runs a jitted function over rotating argument sets inside
`jax.profiler.trace`, each call waited for and wrapped in a host annotation. The trace's device
events (kernels and device copies on the GPU's streams, timed by CUPTI) are assigned to the call
whose annotation they fall in, so each call gets

    busy_us   the sum of its kernels' durations: the device time the call costs in steady state
              (launch gaps between its kernels excluded)
    span_us   first kernel start to last kernel end: busy time plus the gaps inside the call
    wall_us   the host's time for the call, dispatch and synchronisation included (a cross-check:
              a device time above it is impossible)

and the row reports the median over the calls and the spread of the calls, (max - min) / median.
`wall_times` gives the same fields from host wall times alone, for smoke runs without a GPU.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import statistics
import tempfile
import time
from typing import Callable, Sequence

import jax

_ANNOTATION = "jax_sparse_mla_timed_call"


@dataclasses.dataclass(frozen=True)
class DeviceTimes:
    """Per-call times in microseconds of the calls `device_times` traced (one entry per call)."""

    busy_us: tuple[float, ...]
    span_us: tuple[float, ...]
    wall_us: tuple[float, ...]
    kernels_per_call: float

    @property
    def us(self) -> float:
        """The median busy time: the number a benchmark row reports."""
        return statistics.median(self.busy_us)

    @property
    def spread(self) -> float:
        """(max - min) / median of the calls' busy times."""
        return (max(self.busy_us) - min(self.busy_us)) / self.us if self.us > 0 else float("nan")

    def summary(self) -> dict:
        return dict(us=self.us, spread=self.spread, span_us=statistics.median(self.span_us),
                    wall_us=statistics.median(self.wall_us), calls=len(self.busy_us),
                    kernels_per_call=self.kernels_per_call)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, each waited for with jax.block_until_ready,
    after one untimed warm-up call (compilation, first touch)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_times(fn: Callable, arg_sets: Sequence[tuple], calls: int) -> DeviceTimes:
    """Per-call device times of `fn` (a jitted function) on the default GPU.

    fn(*arg_sets[i % len(arg_sets)]) is called `calls` times after one untimed call per argument
    set (compilation, first touch); rotating sets keep one call's inputs out of the cache the
    previous call warmed. Raises RuntimeError when the trace holds no device event for a call (no
    GPU, or a profiler that records none).
    """
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="jax_sparse_mla_trace_")
    walls = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(calls):
            with jax.profiler.TraceAnnotation(_ANNOTATION):
                start = time.perf_counter()
                jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
                walls.append((time.perf_counter() - start) * 1e6)
    windows, kernels = read_trace(trace_dir)
    if len(windows) != calls:
        raise RuntimeError(f"the trace holds {len(windows)} annotations for {calls} calls")
    return per_call_times(windows, kernels, walls)


def per_call_times(windows: Sequence[tuple[float, float]], kernels: Sequence[tuple[float, float]],
                   walls: Sequence[float]) -> DeviceTimes:
    """DeviceTimes from the calls' host windows and the device events (start, duration), all in
    microseconds on one clock: an event belongs to the call whose window holds its start."""
    busy, span, count = [], [], 0
    for i, (begin, end) in enumerate(windows):
        mine = [(ts, dur) for ts, dur in kernels if begin <= ts < end]
        if not mine:
            raise RuntimeError(f"the trace holds no device event for call {i} (no GPU, or the "
                               "profiler records none)")
        busy.append(sum(dur for _, dur in mine))
        span.append(max(ts + dur for ts, dur in mine) - min(ts for ts, _ in mine))
        count += len(mine)
    return DeviceTimes(tuple(busy), tuple(span), tuple(walls), count / len(windows))


def wall_times(fn: Callable, arg_sets: Sequence[tuple], calls: int) -> DeviceTimes:
    """device_times' shape from host wall times alone, for runs without a GPU (smoke runs on the
    CPU): every field holds the call's wall time, dispatch included. Not a device time."""
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    walls = []
    for i in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
        walls.append((time.perf_counter() - start) * 1e6)
    return DeviceTimes(tuple(walls), tuple(walls), tuple(walls), float("nan"))


def _trace_events(trace_dir: str) -> tuple[list[dict], Callable[[dict], bool]]:
    """(the events of the Perfetto trace that jax.profiler.trace wrote, a test for the GPU's stream
    events). The stream lines hold the kernels and device copies; other lines of the GPU process (if
    any) summarise them and would count them twice."""
    paths = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if len(paths) != 1:
        raise RuntimeError(f"expected one perfetto_trace.json.gz under {trace_dir}, found {paths}")
    with gzip.open(paths[0]) as f:
        events = json.load(f)["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpus = {pid for pid, name in process_names.items() if name.startswith("/device:GPU")}
    return events, lambda e: (e.get("ph") == "X" and e["pid"] in gpus and
                              thread_names.get((e["pid"], e.get("tid")), "").startswith("Stream"))


def device_events(trace_dir: str) -> list[tuple[float, float, str]]:
    """The GPU's kernels and copies in a trace as (start, duration in microseconds, name), by start."""
    events, on_stream = _trace_events(trace_dir)
    return sorted((float(e["ts"]), float(e["dur"]), e.get("name", "?")) for e in events if on_stream(e))


def read_trace(trace_dir: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(the timed calls' host windows, the device events as (start, duration)), in microseconds on
    the trace's common clock, from the Perfetto trace that jax.profiler.trace wrote."""
    events, on_stream = _trace_events(trace_dir)
    windows = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                     if e.get("ph") == "X" and e.get("name") == _ANNOTATION)
    return windows, sorted((float(e["ts"]), float(e["dur"])) for e in events if on_stream(e))


def torch_graph_seconds(run_all: Callable[[], object], calls: int, repeats: int) -> float:
    """Seconds per call of `run_all` (which makes `calls` torch calls), captured once in a CUDA graph
    and replayed: the median over `repeats` replays timed with CUDA events, so that no Python or
    launch overhead of the calls is in the number (as a serving stack runs them)."""
    import torch

    run_all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run_all()  # warm up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            run_all()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)
