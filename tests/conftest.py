"""Test setup: 8 host devices for the DCP/shard_map tests; on a GPU, no memory preallocation."""

import os

# JAX would otherwise take 75% of the GPU at the first call, leaving too little for the child
# processes that some GPU tests start (compute-sanitizer, command-buffer dumps).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Must happen before jax is imported anywhere: the DCP tests shard over 8 CPU devices.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
