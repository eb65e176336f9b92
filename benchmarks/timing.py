"""Timing shared by the benchmarks: wall-clock medians of jitted JAX calls, and CUDA-graph replays of
torch calls."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


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
