"""GPU tests of the SM90 native kernels for bf16 caches (FlashInfer's Hopper MLA kernel) and per-tensor
fp8 caches, each behind an XLA FFI custom call.

Each case compares the native kernel with the pure-JAX kernel (implementation="xla") on the same
inputs: a cache larger than the H200's 60 MB L2 whose unselected rows (row 0 among them) are NaN,
random slots with -1 holes and out-of-range slots at random places, rows that select nothing, and
optional valid_counts. fp8 caches are compared with the same pure-JAX path, which dequantises
exactly in float32. Skipped without an SM90 GPU or without the compiled extension; set
JAX_SPARSE_MLA_REQUIRE_GPU=1 to make that skip a failure. The sanitizer cases run the small grid
under `compute-sanitizer --tool memcheck` and `--tool racecheck`.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import native, registry, sm90
from gpu_subprocess import assert_sanitizer_clean, run_with_command_buffers
from reference import assert_native_matches
from requirements import gpu_test_marks, sm90_skip_reason

SCALE = 192 ** -0.5 * 1.2
NUM_BLOCKS, BLOCK_SIZE = 1024, 64  # 65536 rows: 75 MB bf16, larger than L2
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
FP8_K_SCALE = 0.75


@functools.cache
def skip_reason() -> str:
    return sm90_skip_reason()


pytestmark = gpu_test_marks(skip_reason(), "the SM90 tests")


@functools.cache
def caches():
    """(bf16 cache, fp8 cache, clean slots): NaN rows everywhere except at the clean slots."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((NUM_SLOTS, 576), np.float32)
    poisoned = rng.random(NUM_SLOTS) < 0.25
    poisoned[0] = True  # the row the kernel's address fallback points at
    values[poisoned] = np.nan
    bf16 = jnp.asarray(values.astype(ml_dtypes.bfloat16)).reshape(NUM_BLOCKS, BLOCK_SIZE, 576)
    fp8 = jnp.asarray((values / FP8_K_SCALE).astype(ml_dtypes.float8_e4m3fn))
    return bf16, fp8.reshape(NUM_BLOCKS, BLOCK_SIZE, 576), np.flatnonzero(~poisoned)


def make_indices(rng, num_tokens: int, num_keys: int, clean_slots: np.ndarray,
                 num_slots: int = NUM_SLOTS) -> np.ndarray:
    """[T, K] clean slots with -1 holes and slots >= num_slots at random places, and empty rows."""
    indices = rng.choice(clean_slots, size=(num_tokens, num_keys)).astype(np.int32)
    holes = rng.random(indices.shape)
    indices[holes < 0.15] = -1
    indices[holes > 0.95] = num_slots + rng.integers(0, 1000, (holes > 0.95).sum())
    indices[num_tokens // 2] = -1  # selects nothing
    if num_tokens > 2:
        indices[1] = num_slots + 7  # selects nothing either: every slot out of range
    return indices


def run(q, cache, indices, *, implementation, **kwargs):
    return jsm.sparse_mla_decode(q, cache, indices, scale=SCALE, implementation=implementation,
                                 **kwargs)


def assert_matches(native, reference, *, out_rtol: float):
    assert_native_matches(native, reference, out_rtol=out_rtol, lse_atol=5e-3)
    (out, _), (out_ref, _) = native, reference
    out, out_ref = np.asarray(out, np.float64), np.asarray(out_ref, np.float64)
    assert np.abs(out - out_ref).max() <= 0.1 * np.abs(out_ref).max() + 1e-3


def check_case(num_tokens, num_heads, num_keys, kv_dtype, lse_base, *, seed=1, valid_counts=False):
    bf16_cache, fp8_cache, clean = caches()
    rng = np.random.default_rng(seed + 7 * num_tokens + num_heads + num_keys)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, 576), np.float32), jnp.bfloat16)
    indices = jnp.asarray(make_indices(rng, num_tokens, num_keys, clean))
    kwargs = dict(lse_base=lse_base)
    if valid_counts:
        kwargs["valid_counts"] = jnp.asarray(rng.integers(0, num_keys + 1, num_tokens), jnp.int32)
    if kv_dtype == "fp8":
        cache, kwargs["k_scale"], out_rtol = fp8_cache, FP8_K_SCALE, 2e-2
    else:
        cache, out_rtol = bf16_cache, 1e-2
    native = run(q, cache, indices, implementation="native", **kwargs)
    reference = run(q, cache, indices, implementation="xla", **kwargs)
    assert native[0].shape == (num_tokens, num_heads, 512) and native[0].dtype == jnp.bfloat16
    assert native[1].shape == (num_tokens, num_heads) and native[1].dtype == jnp.float32
    assert_matches(native, reference, out_rtol=out_rtol)


# A subset of T in {1, 7, 128, 1024} x H in {16, 32, 64, 128} x K in {128, 2048} that visits each
# value and both planner regimes (one CTA per cluster for H <= 64, two above; KV splits at small T).
BF16_GRID = [(1, 16, 128), (1, 128, 2048), (7, 32, 2048), (7, 64, 128), (128, 16, 2048),
             (128, 128, 2048), (1024, 64, 2048), (1024, 128, 128)]
FP8_GRID = [(1, 128, 2048), (7, 16, 128), (128, 64, 2048), (1024, 16, 2048)]


@pytest.mark.parametrize("num_tokens,num_heads,num_keys", BF16_GRID)
def test_bf16_matches_pure_jax(num_tokens, num_heads, num_keys):
    check_case(num_tokens, num_heads, num_keys, "bf16", "e" if num_tokens % 2 else "2")


@pytest.mark.parametrize("num_tokens,num_heads,num_keys", FP8_GRID)
def test_fp8_cache_matches_dequantised_reference(num_tokens, num_heads, num_keys):
    check_case(num_tokens, num_heads, num_keys, "fp8", "e" if num_tokens % 2 else "2")


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens,num_heads,num_keys", [(7, 16, 2048), (128, 128, 2048)])
def test_valid_counts(num_tokens, num_heads, num_keys, kv_dtype):
    check_case(num_tokens, num_heads, num_keys, kv_dtype, "e", valid_counts=True)


@pytest.mark.parametrize("num_heads", [16, 128])
def test_split_kv_with_empty_splits(num_heads):
    """T = 1 splits K = 2048 over many work items; short valid counts leave most splits empty."""
    bf16_cache, _, clean = caches()
    rng = np.random.default_rng(num_heads)
    q = jnp.asarray(rng.standard_normal((7, num_heads, 576), np.float32), jnp.bfloat16)
    indices = jnp.asarray(rng.choice(clean, size=(7, 2048)).astype(np.int32))
    counts = jnp.asarray([0, 1, 63, 64, 65, 1000, 2048], jnp.int32)
    for t in range(7):
        native = run(q[t:t + 1], bf16_cache, indices[t:t + 1], implementation="native",
                     valid_counts=counts[t:t + 1])
        reference = run(q[t:t + 1], bf16_cache, indices[t:t + 1], implementation="xla",
                        valid_counts=counts[t:t + 1])
        assert_matches(native, reference, out_rtol=1e-2)
    assert_matches(run(q, bf16_cache, indices, implementation="native", valid_counts=counts),
                   run(q, bf16_cache, indices, implementation="xla", valid_counts=counts),
                   out_rtol=1e-2)


def sampled_tokens(rng, num_tokens: int, max_tokens: int) -> np.ndarray:
    """Random tokens plus both sides of every boundary between the pieces of at most max_tokens."""
    edges = [edge for start, _ in registry.token_pieces(num_tokens, max_tokens)
             for edge in (start - 1, start)]
    picked = set(rng.choice(num_tokens, 40, replace=False).tolist()) | set(edges) | {num_tokens - 1}
    return np.asarray(sorted(t for t in picked if 0 <= t < num_tokens))


# Prefill-sized calls (vLLM's max_num_batched_tokens is 8192-16384): FlashInfer's planner holds
# about 16k tokens (fewer at more than 64 heads, whose tokens are one cluster tile each but whose
# clusters reserve items), so 16384 tokens run as two launches; both used to crash the planner.
@pytest.mark.parametrize("num_heads", [16, 64, 128])
@pytest.mark.parametrize("num_tokens", [8192, 16384])
def test_bf16_prefill_sized_calls(num_tokens, num_heads):
    bf16_cache, _, clean = caches()
    rng = np.random.default_rng(num_tokens + num_heads)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, 576), np.float32), jnp.bfloat16)
    indices = make_indices(rng, num_tokens, 2048, clean)
    native = jax.jit(lambda q, idx: run(q, bf16_cache, idx, implementation="native"))(
        q, jnp.asarray(indices))
    assert native[0].shape == (num_tokens, num_heads, 512)
    max_tokens = sm90.plan_token_limit(num_heads, 2048, registry.device_sm_count())
    rows = sampled_tokens(rng, num_tokens, max_tokens)
    reference = run(q[rows], bf16_cache, jnp.asarray(indices[rows]), implementation="xla")
    assert_matches((native[0][rows], native[1][rows]), reference, out_rtol=1e-2)


def test_planner_limit_is_what_flashinfer_plans():
    """At the limit the planner plans (no crash, within its work-item arrays); one token more it
    raises a ValueError naming the limit; the op itself splits such calls (above)."""
    sm_count = registry.device_sm_count()
    for num_heads in (16, 64, 128):
        limit = sm90.plan_token_limit(num_heads, 2048, sm_count)
        assert 16384 - sm_count <= limit < 16384  # one cluster tile per token at <= 128 heads
        plan = sm90.plan_schedule(limit, num_heads, 2048, 0)
        assert plan.num_works <= 16384
        with pytest.raises(ValueError, match=f"at most {limit} tokens"):
            native.module.sm90_schedule(limit + 1, num_heads, 2048, 0)


# bf16 caches (FlashInfer's kernel) at 16 and 128 heads; the fp8 kernels' grid is
# test_sm90_fp8_gpu.py's.
MEMCHECK_GRID = [(1, 16, 128), (3, 128, 256)]
MEMCHECK_SCRIPT = textwrap.dedent("""
    import test_sm90_gpu as cases
    for shape in cases.MEMCHECK_GRID:
        cases.check_case(*shape, "bf16", "e")
    print("MEMCHECK GRID PASSED")
""")


@pytest.mark.sanitizer
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(tmp_path, tool):
    """The small grid under compute-sanitizer (memcheck: out-of-bounds and misaligned accesses;
    racecheck: shared-memory hazards): every case matches and the tool reports nothing."""
    assert_sanitizer_clean(MEMCHECK_SCRIPT, tmp_path, tool)


def test_fp8_query_and_scales():
    _, fp8_cache, clean = caches()
    rng = np.random.default_rng(3)
    q = jnp.asarray((rng.standard_normal((16, 32, 576)) * 4).astype(ml_dtypes.float8_e4m3fn))
    indices = jnp.asarray(make_indices(rng, 16, 512, clean))
    kwargs = dict(q_scale=0.25, k_scale=FP8_K_SCALE, lse_base="2")
    assert_matches(run(q, fp8_cache, indices, implementation="native", **kwargs),
                   run(q, fp8_cache, indices, implementation="xla", **kwargs), out_rtol=2e-2)


def test_jit_lowers_to_the_custom_call_and_vmap_runs_per_element():
    bf16_cache, _, clean = caches()
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((3, 4, 16, 576), np.float32), jnp.bfloat16)
    indices = jnp.asarray(np.stack([make_indices(rng, 4, 256, clean) for _ in range(3)]))
    step = jax.jit(lambda q, idx, cache: run(q, cache, idx, implementation="auto"))
    assert "jax_sparse_mla_sm90_decode_bf16" in step.lower(q[0], indices[0], bf16_cache).as_text()
    batched = jax.vmap(step, in_axes=(0, 0, None))(q, indices, bf16_cache)
    for b in range(3):
        assert_matches((batched[0][b], batched[1][b]), step(q[b], indices[b], bf16_cache),
                       out_rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_forward_mqa_native_matches_xla(kv_dtype, num_heads):
    from test_backend import build_batch  # the lead's paged batch builder (NaN-filled cache)

    rng = np.random.default_rng(num_heads)
    seq_lens, query_lens = [300, 130, 260], [1, 1, 4]
    k_scale = 2.0 if kv_dtype == "fp8" else 1.0
    batch = build_batch(rng, seq_lens, query_lens, num_heads, 64, kv_dtype, k_scale)
    num_tokens = sum(query_lens)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, 576), np.float32), jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    common = jsm.CommonAttentionMetadata(
        query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens, jnp.int32),
        block_table_tensor=jnp.asarray(batch["block_table"]),
        slot_mapping=jnp.asarray(batch["slot_mapping"]), num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(qsl), seq_lens_cpu=tuple(seq_lens))
    metadata = jsm.FlashInferMLASparseMetadataBuilder(
        num_heads=num_heads, block_size=64, topk_tokens=batch["topk"].shape[1]).build(common)
    layer = jsm.LayerScales(_q_scale_float=1.0, _k_scale_float=k_scale)
    results = {}
    for implementation in ("native", "xla"):
        impl = jsm.FlashInferMLASparseImpl(num_heads, 576, SCALE, 1, None, None, kv_dtype, None,
                                           "decoder", None, implementation=implementation)
        step = jax.jit(lambda q, cache, md, topk: impl.forward_mqa(q, cache, md, layer,
                                                                   topk_indices=topk))
        results[implementation] = step(q, batch["cache"], metadata, jnp.asarray(batch["topk"]))[0]
    out, out_ref = (np.asarray(results[k], np.float64) for k in ("native", "xla"))
    assert not np.isnan(out).any()
    assert np.all(out[1] == 0)  # build_batch's token 1 selects nothing
    assert np.linalg.norm(out - out_ref) <= 2e-2 * np.linalg.norm(out_ref)


COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_sparse_mla as jsm
    rng = np.random.default_rng(0)
    cache_dtype, target = (jnp.bfloat16, "jax_sparse_mla_sm90_decode_bf16") if sys.argv[2] == "bf16" else (
        jnp.float8_e4m3fn, "jax_sparse_mla_sm90_fp8_decode")
    cache = jnp.asarray(rng.standard_normal((4096, 576), np.float32), cache_dtype).reshape(64, 64, 576)
    num_heads = int(sys.argv[3])
    q = jnp.asarray(rng.standard_normal((8, num_heads, 576), np.float32), jnp.bfloat16)
    idx = rng.integers(0, 4096, (8, 512)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[3] = -1
    idx = jnp.asarray(idx)

    def loop(impl):
        def run(q, cache, idx):
            def body(i, acc):
                # Elementwise (a fusion), not a dynamic slice: XLA would wrap a custom call whose
                # operand is a dynamic slice into a dynamic-slice fusion of its own.
                moved = jnp.where(idx >= 0, (idx + 61 * i) % 4096, -1)
                out, _ = jsm.sparse_mla_decode(q, cache, moved, scale=0.1, implementation=impl)
                return acc + out.astype(jnp.float32)
            return jax.lax.fori_loop(0, 4, body, jnp.zeros((8, num_heads, 512), jnp.float32))
        return jax.jit(run)(q, cache, idx)

    native, reference = loop("native"), loop("xla")
    error = float(jnp.linalg.norm(native - reference) / jnp.linalg.norm(reference))
    from gpu_subprocess import custom_calls_in_command_buffers
    custom_calls, captured, shown = custom_calls_in_command_buffers(sys.argv[1], [target])
    print("THUNKS", *shown, sep="\\n")
    print("FILES", sorted(os.listdir(sys.argv[1]))[:60])
    hits = custom_calls > 0 and captured == custom_calls
    print("RESULT", error, bool(hits), bool(jnp.isnan(native).any()))
""")


# fp8 at 128 heads: the 64-head kernel.
@pytest.mark.parametrize("kv_dtype,num_heads", [("bf16", 16), ("fp8", 16), ("fp8", 128)])
def test_under_command_buffers(tmp_path, kv_dtype, num_heads):
    """The handlers claim kCmdBufferCompatible: run them inside XLA command buffers (CUDA graphs)."""
    result = run_with_command_buffers(COMMAND_BUFFER_SCRIPT, [kv_dtype, str(num_heads)], tmp_path)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT"))
    _, error, in_command_buffer, has_nan = line.split()
    assert has_nan == "False"
    assert float(error) < 1e-2, line
    assert in_command_buffer == "True", (
        "no XLA dump shows the custom call inside a command buffer:\n" + result.stdout[-3000:])
