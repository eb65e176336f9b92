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

Decode steps: `decode_gaps` reads a trace of K steps run back to back (not waited for one by one:
the examples/generate.py --trace-dir loop) and gives, per step, the device busy time, the span and
the gaps between consecutive device events with the events on either side, plus the host events
(threads and XLA / CUDA / Python annotations) that overlap the large gaps (benchmarks/decode_gaps.py).
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
import numpy as np

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


def _read_events(trace_dir: str) -> tuple[list[dict], dict, dict]:
    """(the events of the Perfetto trace that jax.profiler.trace wrote, {pid: process name},
    {(pid, tid): thread name})."""
    paths = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if len(paths) != 1:
        raise RuntimeError(f"expected one perfetto_trace.json.gz under {trace_dir}, found {paths}")
    with gzip.open(paths[0]) as f:
        events = json.load(f)["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return events, process_names, thread_names


def _trace_events(trace_dir: str) -> tuple[list[dict], Callable[[dict], bool]]:
    """(the events of the Perfetto trace that jax.profiler.trace wrote, a test for the GPU's stream
    events). The stream lines hold the kernels and device copies; other lines of the GPU process (if
    any) summarise them and would count them twice."""
    events, process_names, thread_names = _read_events(trace_dir)
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


# Where a decode step's idle time goes: the gaps between consecutive device events of a trace of K
# decode steps, per step, with the host's activity during the large ones.


@dataclasses.dataclass(frozen=True)
class Gap:
    """An interval in which no device event ran, in microseconds on the trace's clock: its start and
    length, the names of the event that ended last before it and of the event that began it, and
    the host events that overlap it as (thread name, event name, overlap in us), innermost first
    (only for the gaps `kernel_gaps` calls large)."""

    start: float
    us: float
    before: str
    after: str
    host: tuple[tuple[str, str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepGaps:
    """One decode step's device events: from its first event (the step's marker; for the first step,
    the trace's first event) to the next step's marker. `gaps` holds the gap before the step's first
    event (the step boundary; none for the first step) and those between its events."""

    start: float
    end: float
    kernels: int
    busy_us: float
    gaps: tuple[Gap, ...]

    @property
    def span_us(self) -> float:
        """First event start to last event end."""
        return self.end - self.start

    @property
    def idle_us(self) -> float:
        return sum(g.us for g in self.gaps)

    @property
    def largest(self) -> Gap | None:
        return max(self.gaps, key=lambda g: g.us, default=None)


@dataclasses.dataclass(frozen=True)
class DecodeGaps:
    """The gaps of a trace of len(steps) decode steps (`kernel_gaps`, `decode_gaps`). Per-step
    numbers are totals over the trace divided by the steps, or medians over the steps where named."""

    steps: tuple[StepGaps, ...]
    marker: str
    busy_us: float  # every device event's duration, summed
    span_us: float  # the trace's first event start to its last event end
    periods_us: tuple[float, ...]  # marker to the next step's marker: a step's device time, idle included

    @property
    def idle_us(self) -> float:
        return sum(s.idle_us for s in self.steps)

    def per_step(self) -> dict:
        n = len(self.steps)
        largest = [s.largest.us if s.largest else 0.0 for s in self.steps]
        return dict(steps=n, kernels_per_step=statistics.median(s.kernels for s in self.steps),
                    busy_ms=self.busy_us / n / 1e3, span_ms=self.span_us / n / 1e3,
                    period_ms=statistics.median(self.periods_us) / 1e3 if self.periods_us else None,
                    idle_ms=self.idle_us / n / 1e3,
                    gaps_per_step=sum(len(s.gaps) for s in self.steps) / n,
                    largest_gap_us=statistics.median(largest))

    def by_pair(self) -> list[tuple[str, str, float, float, list[tuple[str, str, float]]]]:
        """Idle time by the pair of events around it, largest first: (before, after, us per step,
        gaps per step, host events during those gaps as (thread, name, us per step), largest first)."""
        n = len(self.steps)
        idle, count, host = {}, {}, {}
        for step in self.steps:
            for g in step.gaps:
                key = (g.before, g.after)
                idle[key] = idle.get(key, 0.0) + g.us
                count[key] = count.get(key, 0) + 1
                for thread, name, us in g.host:
                    pair_host = host.setdefault(key, {})
                    pair_host[(thread, name)] = pair_host.get((thread, name), 0.0) + us
        rows = []
        for key, us in sorted(idle.items(), key=lambda kv: -kv[1]):
            seen = sorted(((t, name, us / n) for (t, name), us in host.get(key, {}).items()),
                          key=lambda h: -h[2])
            rows.append((*key, us / n, count[key] / n, seen))
        return rows

    def summary(self) -> str:
        """One line: kernel, span, period and idle time per step, the median of the steps' largest
        gaps and the pair of events with the most idle time between them."""
        p = self.per_step()
        period = f"{p['period_ms']:.3f}" if p["period_ms"] is not None else "-"
        pairs = self.by_pair()
        where = (f"; most idle between {_short(pairs[0][0])} -> {_short(pairs[0][1])} "
                 f"({pairs[0][2]:.1f} us/step)" if pairs else "")
        return (f"gaps: {p['steps']} steps, {p['kernels_per_step']:g} device events/step: kernels "
                f"{p['busy_ms']:.3f} ms/step, span {p['span_ms']:.3f} ms/step, period {period} ms (median), "
                f"idle {p['idle_ms']:.3f} ms/step in {p['gaps_per_step']:.1f} gaps/step; largest gap "
                f"{p['largest_gap_us']:.1f} us (median over steps){where}")

    def table(self, pairs: int = 8, host: int = 3) -> list[str]:
        """The summary, a row per step and the `pairs` kernel pairs with the most idle time between
        them, each with the `host` host events that overlapped those gaps the longest."""
        lines = [self.summary(),
                 "  step  events     busy us  span us  idle us  largest gap (us, before -> after)"]
        for i, s in enumerate(self.steps):
            g = s.largest
            gap = f"{g.us:8.1f}  {_short(g.before)} -> {_short(g.after)}" if g else "       -"
            lines.append(f"  {i:4d}  {s.kernels:6d}  {s.busy_us:10.1f}  {s.span_us:7.1f}  "
                         f"{s.idle_us:7.1f}  {gap}")
        lines.append("  idle by the events around it (us/step, gaps/step): host events during those gaps")
        for before, after, us, gaps, seen in self.by_pair()[:pairs]:
            lines.append(f"  {us:8.1f} {gaps:5.1f}  {_short(before)} -> {_short(after)}")
            for thread, name, overlap in seen[:host]:
                lines.append(f"                 host {overlap:7.1f}  [{_short(thread, 32)}] {_short(name)}")
        return lines


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def kernel_gaps(events: Sequence[tuple[float, float, str]], steps: int, *, marker: str | None = None,
                host: Sequence[tuple[float, float, str, str]] = (), large_us: float = 10.0,
                host_per_gap: int = 6) -> DecodeGaps:
    """The gaps between device events (start, duration, name in microseconds, as `device_events`
    gives them) of a trace of `steps` decode steps.

    Steps begin at `marker`, the name of a device event that runs once per step; by default the
    first event of the trace whose name occurs exactly `steps` times. Events before the first
    marker belong to the first step. A gap runs from the end of every event begun so far (streams
    may overlap) to the next start, and belongs to the step of the event that ends it.

    host: host events (start, duration, thread name, name) on the same clock (`host_events`); each
    gap of at least `large_us`, and each step's largest, lists up to `host_per_gap` of those that
    overlap it, the longest overlap first and, among equal ones, the shortest event (innermost)
    first.
    """
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}.")
    events = sorted(events)
    if not events:
        raise ValueError("no device events: was the trace taken on a GPU?")
    counts: dict[str, int] = {}
    for _, _, name in events:
        counts[name] = counts.get(name, 0) + 1
    if marker is None:
        marker = next((name for _, _, name in events if counts[name] == steps), None)
        if marker is None:
            raise ValueError(f"no device event runs exactly once in each of {steps} steps "
                             f"({len(events)} events); pass the step's first kernel as marker")
    elif counts.get(marker, 0) != steps:
        raise ValueError(f"marker {marker!r} occurs {counts.get(marker, 0)} times in a trace of "
                         f"{steps} steps")
    begins = [i for i, (_, _, name) in enumerate(events) if name == marker]
    begins[0] = 0
    step_of = np.searchsorted(np.asarray(begins), np.arange(len(events)), side="right") - 1

    gaps: list[list[Gap]] = [[] for _ in range(steps)]
    end, before = events[0][0] + events[0][1], events[0][2]
    for i, (ts, dur, name) in enumerate(events[1:], start=1):
        if ts > end:
            gaps[step_of[i]].append(Gap(end, ts - end, before, name))
        if ts + dur >= end:
            end, before = ts + dur, name

    if host:
        starts = np.asarray([h[0] for h in host], np.float64)
        ends = starts + np.asarray([h[1] for h in host], np.float64)
        for step_gaps in gaps:
            largest = max(step_gaps, key=lambda g: g.us, default=None)
            for j, g in enumerate(step_gaps):
                if g.us < large_us and g is not largest:
                    continue
                hit = np.nonzero((starts < g.start + g.us) & (ends > g.start))[0]
                overlap = np.minimum(ends[hit], g.start + g.us) - np.maximum(starts[hit], g.start)
                order = sorted(range(len(hit)), key=lambda k: (-round(overlap[k], 3), host[hit[k]][1]))
                step_gaps[j] = dataclasses.replace(g, host=tuple(
                    (host[hit[k]][2], host[hit[k]][3], float(overlap[k])) for k in order[:host_per_gap]))

    result = []
    for k in range(steps):
        mine = events[begins[k]:begins[k + 1] if k + 1 < steps else len(events)]
        result.append(StepGaps(start=mine[0][0], end=max(ts + dur for ts, dur, _ in mine),
                               kernels=len(mine), busy_us=sum(dur for _, dur, _ in mine),
                               gaps=tuple(gaps[k])))
    marks = [ts for ts, _, name in events if name == marker]
    return DecodeGaps(steps=tuple(result), marker=marker, busy_us=sum(d for _, d, _ in events),
                      span_us=max(ts + dur for ts, dur, _ in events) - events[0][0],
                      periods_us=tuple(b - a for a, b in zip(marks, marks[1:])))


def host_events(trace_dir: str) -> list[tuple[float, float, str, str]]:
    """The host's events in a trace as (start, duration in microseconds, thread name, name), by start:
    every complete event outside the GPU's processes (the Python thread's dispatch, XLA's executable
    and thunk annotations, the CUDA API calls CUPTI records, the Python tracer's calls when on)."""
    events, process_names, thread_names = _read_events(trace_dir)
    devices = {pid for pid, name in process_names.items() if name.startswith("/device:")}
    return sorted((float(e["ts"]), float(e.get("dur", 0.0)),
                   thread_names.get((e["pid"], e.get("tid")), str(e.get("tid"))), e.get("name", "?"))
                  for e in events if e.get("ph") == "X" and e["pid"] not in devices)


def decode_gaps(trace_dir: str, steps: int, **kwargs) -> DecodeGaps:
    """`kernel_gaps` of the trace jax.profiler.trace wrote into trace_dir (K decode steps: for the
    example, `examples/generate.py --trace-dir DIR`, whose JSON gives traced_steps), with its host
    events."""
    return kernel_gaps(device_events(trace_dir), steps, host=host_events(trace_dir), **kwargs)
