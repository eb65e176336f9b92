"""CPU tests of the Blackwell native kernels at prefill sizes, where a launch limit or a split-K
scratch would otherwise break a call:

- SM100 (TRTLLM-gen): the tokens are the launch grid's z dimension (CUDA: at most 65535), so
  `sm100_trtllm_gen` runs a larger call as several launches, and the handler (through its CPU dry
  run, which shares its checks) rejects a larger batch with an error.
- SM120: where the tokens' CTAs alone fill more than 3 waves, the split-K plan (ffi/sm120/sm120_plan.cc)
  takes one split, so the scratch [T, scratch_heads, splits, 512] stays the output's size instead of
  FlashInfer's 32 times (64 GiB at T = 16384, H = 128).

Shapes are traced with jax.make_jaxpr (no memory, no GPU); the plan and the dry run need the built
extension (skipped without it, failed under JAX_SPARSE_MLA_REQUIRE_NATIVE=1).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.kernels import registry, sm120
from jax_sparse_mla.kernels import sm100_trtllm_gen as trtllm_gen
from requirements import require_native

GRID_Z_LIMIT = 65535  # CUDA's gridDim.z bound
BF16_BYTES = 2
V_DIM = 512


def _ffi_calls(jaxpr, target: str) -> list:
    """The ffi_call equations of `target` in a jaxpr and its sub-jaxprs, in program order."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ffi_call" and eqn.params["target_name"] == target:
            calls.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    calls.extend(_ffi_calls(inner, target))
    return calls


# --- SM100: more tokens than the grid holds ----------------------------------------------------------

def _trace_trtllm_gen(num_tokens: int, num_heads: int, num_keys: int = 64):
    """The jaxpr of the TRTLLM-gen binding for a bf16 call of these sizes (shapes only)."""
    kernel = functools.partial(trtllm_gen._trtllm_gen_kernel, bmm1_scale=0.1, bmm2_scale=1.0,
                               lse_base="e")
    return jax.make_jaxpr(kernel)(
        jax.ShapeDtypeStruct((num_tokens, num_heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, num_keys), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens,), jnp.int32))


@pytest.mark.parametrize("num_tokens", [1, GRID_Z_LIMIT, GRID_Z_LIMIT + 1, 65536 + 5,
                                        2 * GRID_Z_LIMIT + 1])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_trtllm_gen_launches_stay_within_the_grid(num_tokens, num_heads):
    """Each launch takes at most 65535 tokens, the fewest launches do, together they take every
    token, and each launch's workspace is sized for its own tokens."""
    closed = _trace_trtllm_gen(num_tokens, num_heads)
    calls = _ffi_calls(closed.jaxpr, trtllm_gen.TARGET)
    batches = [eqn.invars[0].aval.shape[0] for eqn in calls]  # q [B, 1, H, 576]
    assert len(calls) == -(-num_tokens // GRID_Z_LIMIT)
    assert sum(batches) == num_tokens and max(batches) <= GRID_Z_LIMIT
    for eqn, batch in zip(calls, batches):
        assert eqn.invars[0].aval.shape == (batch, 1, num_heads, 576)
        out, lse, workspace, _counter = (aval.shape for aval in eqn.params["result_avals"])
        assert out == (batch, 1, num_heads, V_DIM) and lse == (batch, num_heads)
        # The handler's softmax-stats carve-out: 8 bytes x H x B x 256 (q_len 1 padded to 256).
        assert workspace[0] >= 8 * num_heads * batch * 256 + trtllm_gen.SCRATCH_BYTES
        assert workspace[0] < 8 * num_heads * (batch + 1) * 256 + trtllm_gen.SCRATCH_BYTES + (2 << 20)
    assert [v.aval.shape for v in closed.jaxpr.outvars] == [(num_tokens, num_heads, V_DIM),
                                                            (num_tokens, num_heads)]


def test_trtllm_gen_pieces_keep_each_tokens_inputs(monkeypatch):
    """Past the grid limit, every token's result still comes from its own query, slots and valid
    count, in order: the launch is replaced by a stand-in that computes per token from them."""
    num_tokens, num_keys, num_slots = GRID_Z_LIMIT + 7, 8, 16 * 64
    seen = []

    def stand_in(q, indices, valid_counts, *, kv_cache, bmm1_scale, bmm2_scale, lse_base):
        seen.append(q.shape[0])
        valid = jnp.arange(num_keys)[None, :] < valid_counts[:, None]
        score = jnp.where(valid, indices, 0).sum(axis=1).astype(jnp.float32)  # [T]
        out = jnp.broadcast_to(q[:, :, :1], q.shape[:2] + (V_DIM,))
        return out, jnp.broadcast_to(score[:, None], q.shape[:2]) * bmm1_scale

    monkeypatch.setattr(trtllm_gen, "_trtllm_gen_launch", stand_in)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((num_tokens, 1, 576)).astype(np.float32)
    indices = rng.integers(0, num_slots, (num_tokens, num_keys)).astype(np.int32)
    counts = rng.integers(0, num_keys + 1, num_tokens).astype(np.int32)
    out, lse = trtllm_gen._trtllm_gen_kernel(
        jnp.asarray(q, jnp.bfloat16), jnp.zeros((16, 64, 576), jnp.bfloat16), jnp.asarray(indices),
        jnp.asarray(counts), bmm1_scale=0.5, bmm2_scale=1.0, lse_base="e")
    assert len(seen) == 2 and max(seen) <= GRID_Z_LIMIT and sum(seen) == num_tokens
    want_out = q[:, :, :1].astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out[:, :, :1], np.float32), want_out)
    want_lse = np.array([row[:count].sum() for row, count in zip(indices, counts)], np.float32) * 0.5
    np.testing.assert_array_equal(np.asarray(lse[:, 0]), want_lse)


def _trtllm_gen_dry_run(batch: int, num_heads: int) -> dict:
    module = require_native()
    if not hasattr(module, "trtllm_gen_select_kernel"):
        if os.environ.get("JAX_SPARSE_MLA_REQUIRE_NATIVE") == "1":
            pytest.fail("JAX_SPARSE_MLA_REQUIRE_NATIVE=1 but the extension has no sm100 family")
        pytest.skip("the extension was built without the sm100 (TRTLLM-gen) family")
    return dict(module.trtllm_gen_select_kernel("bfloat16", "bfloat16", 64, num_heads, 1, 2048,
                                                batch=batch, read_cubins=False))


@pytest.mark.parametrize("num_heads", [16, 128])
def test_trtllm_gen_handler_rejects_a_batch_past_the_grid(num_heads):
    """FlashInfer would launch B along gridDim.z and only print the failed launch: the handler's
    checks (shared by the dry run) reject B > 65535 with a message, and B = 65535 reaches the
    launch with grid z = B when the build has FlashInfer's kernel table."""
    rejected = _trtllm_gen_dry_run(GRID_Z_LIMIT + 1, num_heads)
    assert "batch must be at most 65535" in rejected["error"] and "65536" in rejected["error"]
    assert not rejected["launched"]
    accepted = _trtllm_gen_dry_run(GRID_Z_LIMIT, num_heads)
    assert "batch must be" not in accepted["error"]
    if require_native().build_info().get("trtllm_gen_num_kernels"):
        assert accepted["error"] == "" and accepted["launched"]
        assert accepted["grid"][2] == GRID_Z_LIMIT


# --- SM120: the split-K plan at prefill sizes --------------------------------------------------------

SM120_SM_COUNTS = (170, 188)  # RTX 5090, RTX PRO 6000


def _sm120_plan(num_tokens: int, num_heads: int, num_keys: int, sm_count: int) -> dict:
    return dict(require_native().sm120_plan(num_tokens, num_heads, num_keys, sm_count))


def _scratch_bytes(num_tokens: int, plan: dict) -> int:
    """Bytes of the bf16 split-K partials [T, scratch_heads, splits, 512] (kernels/sm120.py)."""
    return num_tokens * plan["scratch_heads"] * plan["num_splits"] * V_DIM * BF16_BYTES


@pytest.mark.parametrize("num_tokens", [16384, 65536])
@pytest.mark.parametrize("num_heads", [16, 64, 128])
@pytest.mark.parametrize("sm_count", SM120_SM_COUNTS)
def test_sm120_plan_takes_one_split_at_prefill_sizes(num_tokens, num_heads, sm_count):
    """T x ceil(H / 16) CTAs fill more than 3 waves: one split over all 32 chunks of K = 2048, and
    a scratch the size of the output (FlashInfer's rule would make 32 splits: 64 GiB at
    T = 16384, H = 128)."""
    plan = _sm120_plan(num_tokens, num_heads, 2048, sm_count)
    assert plan == dict(chunks=32, chunks_per_block=32, num_splits=1, scratch_heads=num_heads)
    assert _scratch_bytes(num_tokens, plan) == num_tokens * num_heads * V_DIM * BF16_BYTES


def _sweep_tokens(heads_blocks: int, sm_count: int) -> list[int]:
    """Token counts on both sides of 1.5 and 3 waves of CTAs, and up to prefill sizes."""
    edges = [w * sm_count // (2 * heads_blocks) for w in (3, 6)]  # 1.5 and 3 waves, in tokens
    near = [t + d for t in edges for d in range(-2, 3)]
    return sorted({t for t in [1, 2, 7, 31, 64, 100, *near, 512, 4096, 16384, 65536, 131071]
                   if t >= 1})


@pytest.mark.parametrize("num_heads", [8, 16, 20, 64, 128])
@pytest.mark.parametrize("num_keys", [64, 100, 2048, 4096])
@pytest.mark.parametrize("sm_count", SM120_SM_COUNTS)
def test_sm120_plan_splits_only_to_fill_waves(num_heads, num_keys, sm_count):
    """At every T: the splits cover each 64-key chunk once; above 1.5 waves of tokens (where only
    one split keeps a launch within 3 waves, so FlashInfer's rule takes one too, up to 3 waves)
    there is one split; below, the splits keep the launch within 3 waves. So the scratch never
    exceeds the larger of one split's (the output's size) and 3 waves of 16-head partials."""
    chunks = -(-num_keys // 64)
    head_blocks = -(-num_heads // 16)
    for num_tokens in _sweep_tokens(head_blocks, sm_count):
        plan = _sm120_plan(num_tokens, num_heads, num_keys, sm_count)
        where = f"T={num_tokens}"
        splits, cpb = plan["num_splits"], plan["chunks_per_block"]
        assert plan["chunks"] == chunks and splits == -(-chunks // cpb) and cpb <= chunks, where
        ctas = num_tokens * head_blocks
        if 2 * ctas > 3 * sm_count:
            assert splits == 1, where
        else:
            assert ctas * splits <= 3 * sm_count, where
        one_split = num_tokens * plan["scratch_heads"] * V_DIM * BF16_BYTES
        assert _scratch_bytes(num_tokens, plan) <= max(one_split,
                                                       3 * sm_count * 16 * V_DIM * BF16_BYTES), where


def test_sm120_call_allocates_one_split_at_prefill_sizes(monkeypatch):
    """The binding sizes the custom call's scratch from the plan: at T = 65536, H = 128 it asks XLA
    for [T, 128, 1, 512] bf16 partials (8 GiB), not FlashInfer's 32 splits (256 GiB)."""
    require_native()
    monkeypatch.setattr(registry, "device_sm_count", lambda: 188)
    num_tokens, num_heads = 65536, 128
    kernel = functools.partial(sm120._sm120_kernel, bmm1_scale=0.1, bmm2_scale=1.0, lse_base="e")
    closed = jax.make_jaxpr(kernel)(
        jax.ShapeDtypeStruct((num_tokens, num_heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((16, 64, 656), jnp.uint8),
        jax.ShapeDtypeStruct((num_tokens, 2048), jnp.int32),
        None)
    (call,) = _ffi_calls(closed.jaxpr, sm120.TARGET)
    shapes = [aval.shape for aval in call.params["result_avals"]]
    assert shapes == [(num_tokens, num_heads, V_DIM), (num_tokens, num_heads),
                      (num_tokens, num_heads, 1, V_DIM), (num_tokens, num_heads, 1)]
    assert dict(call.params["attributes"])["num_splits"] == 1
