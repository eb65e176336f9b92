"""Test setup: 8 host devices for the DCP/shard_map tests, and the `gpu` marker's skip rule."""

import os

# Must happen before jax is imported anywhere: the DCP tests shard over 8 CPU devices.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
