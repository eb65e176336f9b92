"""The indexer benchmark's code paths on tiny shapes (pure JAX, any device), so that the H200 run does
not meet a broken script."""

from __future__ import annotations

import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_bench_indexer_smoke():
    result = subprocess.run([sys.executable, "-P", os.path.join(BENCHMARKS, "bench_indexer.py"),
                             "--smoke"], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                filter(None, [BENCHMARKS, os.environ.get("PYTHONPATH")]))))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "smoke OK" in result.stdout
