"""Test setup: 8 host devices for the DCP/shard_map tests; on a GPU, no memory preallocation and a
cap on what one test process may hold."""

import os

# JAX would otherwise take 75% of the GPU at the first call, leaving too little for the child
# processes that some GPU tests start (compute-sanitizer, command-buffer dumps). Without
# preallocation its pool still keeps what earlier tests grew it to: the cap bounds that, so a child
# finds most of the card free whatever ran before it in this process (or in the other workers of a
# `pytest -n` run). The GPU suite passes under it on an H100 (80 GB: 11.9 GB per test process).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.15")

# Must happen before jax is imported anywhere: the DCP tests shard over 8 CPU devices.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(items):
    """Sanitizer tests first, so each runs before its process has run any other GPU test: on an
    H100, a memcheck child started from a pytest process that had just run
    test_sm90_fp8_gpu.py::test_holes_see_nothing_left_by_other_ctas stalled (GPU idle, nothing
    printed, killed after 75 s), while the same child passed in 14 s from a fresh process, after
    the same tests in another process that had exited, or after other tests in its own process.
    The cause is not known. (Under pytest-xdist each worker takes its first tests in this order.)"""
    items.sort(key=lambda item: item.get_closest_marker("sanitizer") is None)
