"""Wall-clock timing shared by the benchmarks."""

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
