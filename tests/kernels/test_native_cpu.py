"""CPU tests of the native paths' host side: the shared argument validation of the SM100 (TRTLLM-gen) and
SM120 kernels, dispatch by compute capability, the index compaction in front of TRTLLM-gen, and, when
the extension is built, its registrations, SHA-256 and cubin lookup (ffi/common/cubin_loader.cc).

The extension tests skip when it is not importable; JAX_SPARSE_MLA_REQUIRE_NATIVE=1 (set by
.ci/run) turns that skip into a failure.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import native, registry, sm120, sm90_fp8
from jax_sparse_mla.kernels import sm100_trtllm_gen as trtllm_gen
from jax_sparse_mla.kernels.registry import Problem
from requirements import require_native

# The XLA FFI targets of each handler family; an extension holds the families it was built for
# (JAX_SPARSE_MLA_ARCHS, e.g. "sm90" alone on a Hopper machine).
FAMILY_TARGETS = {
    "sm90": {
        "jax_sparse_mla_sm90_decode_bf16",
        "jax_sparse_mla_sm90_decode_fp8",
        "jax_sparse_mla_sm90_fp8_decode",
        "jax_sparse_mla_sm90_paged_mqa_logits",
        "jax_sparse_mla_sm90_mqa_logits",
        "jax_sparse_mla_sm90_top_k_per_row",
        "jax_sparse_mla_sm90_top_k_per_row_decode",
        "jax_sparse_mla_sm90_top_k_per_row_cluster",
        "jax_sparse_mla_sm90_top_k_per_row_decode_cluster",
        "jax_sparse_mla_sm90_top_k_per_row_stream",
        "jax_sparse_mla_sm90_top_k_per_row_decode_stream",
    },
    "sm100": {"jax_sparse_mla_trtllm_gen_decode"},
    "sm120": {"jax_sparse_mla_sm120_decode"},
}
# Kernels of no one family, built for every family's machine code.
COMMON_TARGETS = {"jax_sparse_mla_index_conversion", "jax_sparse_mla_index_conversion_counts"}
ALL_TARGETS = set().union(COMMON_TARGETS, *FAMILY_TARGETS.values())
# Machine code each family must hold when built.
FAMILY_GENCODES = {"sm90": {"90a"}, "sm100": {"100a"}, "sm120": {"120a"}}


def built_families(module) -> list[str]:
    families = [f for f in FAMILY_TARGETS if f in module.build_info()]
    assert families, f"the extension holds no handler family: {dict(module.build_info())}"
    return families


def problem(**override):
    base = dict(num_tokens=4, num_heads=128, num_keys=2048, block_size=64, kv_layout="bfloat16",
                q_dtype="bfloat16")
    base.update(override)
    return Problem(**base)


# --- shared validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("override", [
    {}, dict(num_heads=64), dict(num_heads=16), dict(num_heads=8), dict(block_size=32),
    dict(num_keys=4), dict(kv_layout="fp8_e4m3", q_dtype="float8_e4m3fn"),
])
def test_trtllm_gen_accepts(override):
    assert trtllm_gen.check_problem(problem(**override)) is None


@pytest.mark.parametrize("override,message", [
    (dict(num_heads=96), "64 < num_heads < 128"),
    (dict(num_heads=65), "64 < num_heads < 128"),
    (dict(block_size=16), "block_size must be 32 or 64"),
    (dict(block_size=128), "block_size must be 32 or 64"),
    (dict(num_keys=2046), "positive multiple of 4"),
    (dict(num_keys=0), "positive multiple of 4"),
    (dict(kv_layout="fp8_e4m3", q_dtype="bfloat16"), "needs a float8_e4m3fn query"),
    (dict(kv_layout="bfloat16", q_dtype="float16"), "needs a bfloat16 query"),
    (dict(kv_layout="fp8_ds_mla", q_dtype="bfloat16"), "kv layout 'fp8_ds_mla'"),
    # FlashInfer's kernel table has no float16 sparse kernel and no kernel for these head counts.
    (dict(kv_layout="float16", q_dtype="float16"), "Missing TRTLLM-GEN kernel (decode)"),
    (dict(num_heads=1), "take 8, 16, 32, 33..64 or a multiple of 64 heads"),
    (dict(num_heads=20), "take 8, 16, 32, 33..64 or a multiple of 64 heads"),
])
def test_trtllm_gen_rejects(override, message):
    assert message in trtllm_gen.check_problem(problem(**override))


@pytest.mark.parametrize("override", [
    dict(num_heads=128), dict(num_heads=8), dict(num_heads=100), dict(num_heads=1),
    dict(num_keys=2047), dict(block_size=256),
])
def test_sm120_accepts(override):
    assert sm120.check_problem(problem(kv_layout="fp8_ds_mla", **override)) is None


@pytest.mark.parametrize("override,message", [
    (dict(num_heads=129), "num_heads must be in [1, 128]"),
    (dict(q_dtype="float16"), "needs a bfloat16 query"),
    (dict(kv_layout="bfloat16"), "needs an fp8_ds_mla cache"),
    (dict(num_keys=0), "K must be positive"),
])
def test_sm120_rejects(override, message):
    assert message in sm120.check_problem(problem(**{"kv_layout": "fp8_ds_mla", **override}))


def test_capability_checks_name_the_missing_build(monkeypatch):
    monkeypatch.setattr(native, "build_info", lambda: {"sm100": "100a", "sm120": "120a",
                                                        "trtllm_gen_num_kernels": 0})
    assert "no sm_103a code (built for 100a)" in trtllm_gen.check_problem(problem(), (10, 3))
    assert "without FlashInfer's TRTLLM-gen kernel table" in trtllm_gen.check_problem(problem(), (10, 0))
    assert "no sm_121a code" in sm120.check_problem(problem(kv_layout="fp8_ds_mla"), (12, 1))
    assert sm120.check_problem(problem(kv_layout="fp8_ds_mla"), (12, 0)) is None


# --- dispatch by compute capability --------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretends the default device is a CUDA GPU of a given capability with every native target built."""
    def set_capability(capability, build=None):
        monkeypatch.setattr(registry, "current_device_capability", lambda: capability)
        monkeypatch.setattr(native, "targets", frozenset(ALL_TARGETS))
        monkeypatch.setattr(native, "module", object())
        monkeypatch.setattr(native, "build_info", lambda: build if build is not None else {
            "sm90": "90a", "sm100": "100a,103a", "sm120": "120a,121a", "trtllm_gen_num_kernels": 5})
    return set_capability


@pytest.mark.parametrize("capability,layout,q_dtype,expected", [
    ((10, 0), "bfloat16", "bfloat16", "sm100_flashinfer_trtllm_gen"),
    ((10, 3), "fp8_e4m3", "float8_e4m3fn", "sm100_flashinfer_trtllm_gen"),
    ((10, 0), "float16", "float16", "xla"),  # no float16 kernel in FlashInfer's table
    ((12, 0), "fp8_ds_mla", "bfloat16", "sm120_flashinfer_sparse_mla"),
    ((12, 1), "fp8_ds_mla", "bfloat16", "sm120_flashinfer_sparse_mla"),
    ((9, 0), "bfloat16", "bfloat16", "sm90_flashinfer_fa3"),
    ((9, 0), "fp8_e4m3", "bfloat16", "sm90_fp8"),
    ((9, 0), "fp8_e4m3", "float8_e4m3fn", "sm90_fp8"),
    ((9, 0), "fp8_ds_mla", "bfloat16", "sm90_fp8"),
    ((8, 0), "bfloat16", "bfloat16", "xla"),
    ((10, 0), "fp8_ds_mla", "bfloat16", "xla"),  # no SM100 kernel for fp8_ds_mla
    ((12, 0), "bfloat16", "bfloat16", "xla"),  # no SM120 kernel for a bf16 cache
])
def test_dispatch_by_capability(fake_gpu, capability, layout, q_dtype, expected):
    fake_gpu(capability)
    p = problem(kv_layout=layout, q_dtype=q_dtype)
    assert registry.select_kernel(layout, q_dtype, "auto", p).name == expected


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 128, 8192])
@pytest.mark.parametrize("num_heads", [1, 16, 20, 32, 64, 128])
@pytest.mark.parametrize("num_keys", [0, 1, 128, 2048, 2049, 4224])
def test_sm90_fp8_plan_covers_every_key(num_tokens, num_heads, num_keys):
    p = sm90_fp8.plan(num_tokens, num_heads, num_keys, 132)
    assert p.heads_per_cta == (16 if num_heads <= 16 else 64)
    assert p.keys_per_split % 64 == 0 and 0 < p.keys_per_split <= 2048
    assert p.num_splits * p.keys_per_split >= num_keys  # every key lies in a split
    assert (p.num_splits - 1) * p.keys_per_split < max(num_keys, 1)  # no split wholly past K
    # Splits only to fill idle SMs, or because a split holds at most 2048 keys.
    ctas = num_tokens * -(-num_heads // p.heads_per_cta)
    assert p.num_splits <= max(1, -(-num_keys // 2048), 132 // ctas)


@pytest.mark.parametrize("num_heads", [16, 128])
def test_auto_runs_pure_jax_where_flashinfer_measured_slower(fake_gpu, num_heads):
    """One token over a bf16 cache: FlashInfer's kernel lost to pure JAX in the H200 decode loop, so
    "auto" passes it over (saying so); "native" still runs a native kernel, and other shapes and
    caches keep theirs."""
    fake_gpu((9, 0))
    one = problem(num_tokens=1, num_heads=num_heads)
    assert registry.select_kernel("bfloat16", "bfloat16", "auto", one).name == "xla"
    fa3 = next(k for k in registry.registered_kernels() if k.name == "sm90_flashinfer_fa3")
    assert "pure JAX measured faster" in registry.auto_rejection_reason(fa3, "bfloat16", "bfloat16", one)
    assert registry.rejection_reason(fa3, "bfloat16", "bfloat16", one) is None
    assert registry.select_kernel("bfloat16", "bfloat16", "native", one).name == "sm90_flashinfer_fa3"
    two = problem(num_tokens=2, num_heads=num_heads)
    assert registry.select_kernel("bfloat16", "bfloat16", "auto", two).name == "sm90_flashinfer_fa3"
    ds_mla = problem(num_tokens=1, num_heads=num_heads, kv_layout="fp8_ds_mla")
    assert registry.select_kernel("fp8_ds_mla", "bfloat16", "auto", ds_mla).name == "sm90_fp8"


@pytest.mark.parametrize("num_heads", [16, 128])
def test_auto_runs_pure_jax_for_one_token_over_an_e4m3_cache(fake_gpu, num_heads):
    """One token over an e4m3 cache: both native kernels lost to pure JAX in the H100 decode loop, so
    "auto" passes over both (not from ours to FlashInfer's); "native" still runs ours; two tokens
    keep it."""
    fake_gpu((9, 0))
    one = problem(num_tokens=1, num_heads=num_heads, kv_layout="fp8_e4m3")
    assert registry.select_kernel("fp8_e4m3", "bfloat16", "auto", one).name == "xla"
    for name in ("sm90_fp8", "sm90_flashinfer_fa3"):
        kernel = next(k for k in registry.registered_kernels() if k.name == name)
        why = registry.auto_rejection_reason(kernel, "fp8_e4m3", "bfloat16", one)
        assert "pure JAX measured faster with one token over an e4m3 cache" in why
    assert registry.select_kernel("fp8_e4m3", "bfloat16", "native", one).name == "sm90_fp8"
    two = problem(num_tokens=2, num_heads=num_heads, kv_layout="fp8_e4m3")
    assert registry.select_kernel("fp8_e4m3", "bfloat16", "auto", two).name == "sm90_fp8"


def test_auto_falls_back_and_native_explains(fake_gpu):
    fake_gpu((10, 0))
    bad = problem(num_heads=96)
    assert registry.select_kernel("bfloat16", "bfloat16", "auto", bad).name == "xla"
    with pytest.raises(ValueError, match="sm100_flashinfer_trtllm_gen: 64 < num_heads < 128"):
        registry.select_kernel("bfloat16", "bfloat16", "native", bad)
    mixed = problem(kv_layout="fp8_e4m3", q_dtype="bfloat16")
    with pytest.raises(ValueError, match="needs a float8_e4m3fn query"):
        registry.select_kernel("fp8_e4m3", "bfloat16", "native", mixed)


def test_native_without_kernel_table_is_a_clear_error(fake_gpu):
    fake_gpu((10, 0), build={"sm100": "100a,103a", "trtllm_gen_num_kernels": 0})
    with pytest.raises(ValueError, match="without FlashInfer's TRTLLM-gen kernel table"):
        registry.select_kernel("bfloat16", "bfloat16", "native", problem())
    assert registry.select_kernel("bfloat16", "bfloat16", "auto", problem()).name == "xla"


def test_public_op_checks_shapes_before_a_native_call(fake_gpu):
    """The op builds the Problem from its arguments: block size 16 rules TRTLLM-gen out at trace time."""
    fake_gpu((10, 0))
    q = jnp.zeros((2, 16, 576), jnp.bfloat16)
    cache = jnp.zeros((4, 16, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_size must be 32 or 64, got 16"):
        jsm.sparse_mla_decode(q, cache, jnp.zeros((2, 8), jnp.int32), scale=0.1,
                              implementation="native")


# --- the compaction in front of TRTLLM-gen ------------------------------------------------------------

def test_compact_slots_keeps_order_and_counts():
    rng = np.random.default_rng(0)
    indices = rng.integers(0, 1000, (7, 32)).astype(np.int32)
    indices[rng.random(indices.shape) < 0.4] = -1
    indices[3] = -1  # a row with nothing valid
    slots, counts = jax.jit(trtllm_gen.compact_slots)(jnp.asarray(indices))
    for row, out, count in zip(indices, np.asarray(slots), np.asarray(counts)):
        valid = row[row >= 0]
        assert count == len(valid)
        np.testing.assert_array_equal(out[:count], valid)
        assert (out[count:] == -1).all()


def test_scratch_sizes():
    assert trtllm_gen.counter_bytes(1, 16) == 1024 * 4  # at least one slot per possible SM
    assert trtllm_gen.counter_bytes(512, 128) == 512 * 128 * 4
    assert trtllm_gen.workspace_bytes(4, 16) >= trtllm_gen.SCRATCH_BYTES + 8 * 4 * 16 * 256


# --- the built extension ---------------------------------------------------------------------------------

def test_extension_registers_the_handlers_of_its_families():
    module = require_native()
    families = built_families(module)
    assert set(module.registrations()) == set().union(COMMON_TARGETS,
                                                      *(FAMILY_TARGETS[f] for f in families))
    info = module.build_info()
    for family in families:
        assert FAMILY_GENCODES[family] <= set(info[family].split(",")), (family, info[family])
        # The common kernels carry every family's machine code.
        assert set(info[family].split(",")) <= set(info["common"].split(",")), info
    if "sm100" in families:
        assert info["trtllm_gen_cubin_path"].endswith("fmha/trtllm-gen/")


def test_command_buffer_targets_are_the_graph_safe_handlers():
    # TRTLLM-gen may load a cubin module on its first call, which a CUDA graph capture must not do.
    module = require_native()
    built = set().union(COMMON_TARGETS, *(FAMILY_TARGETS[f] for f in built_families(module)))
    assert set(module.command_buffer_targets()) == built - {"jax_sparse_mla_trtllm_gen_decode"}


@pytest.mark.parametrize("size", [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 1000, 100_000])
def test_sha256_matches_hashlib(size):
    module = require_native()
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert module.sha256_hex(data) == hashlib.sha256(data).hexdigest()


@pytest.fixture
def cubin_dirs(tmp_path, monkeypatch):
    """Three cubin folders: FLASHINFER_CUBIN_DIR, a registered package folder, the workspace cache."""
    module = require_native()
    env_dir, package_dir, base = tmp_path / "env", tmp_path / "package", tmp_path / "base"
    cache_dir = base / ".cache" / "flashinfer" / "cubins"
    for d in (env_dir, package_dir, cache_dir):
        d.mkdir(parents=True)
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(env_dir))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(base))
    monkeypatch.delenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", raising=False)
    module.set_cubin_package_dir(str(package_dir))
    yield module, env_dir, package_dir, cache_dir
    module.set_cubin_package_dir(native.flashinfer_cubin_package_dir())


def _write(folder, relative, data):
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_cubin_search_order(cubin_dirs):
    module, env_dir, package_dir, cache_dir = cubin_dirs
    assert module.cubin_search_dirs() == [str(env_dir), str(package_dir), str(cache_dir)]
    good = b"\x7fELF good cubin"
    sha = hashlib.sha256(good).hexdigest()
    name = "abc/fmha/trtllm-gen/kernel.cubin"
    _write(cache_dir, name, good)
    # FlashInfer joins "<artifact>/" + "/" + name: the double slash is accepted.
    assert module.resolve_cubin("abc/fmha/trtllm-gen//kernel.cubin", sha) == good
    _write(env_dir, name, b"corrupt")  # wrong sha256 in the first folder: skipped, not fatal
    assert module.resolve_cubin(name, sha) == good
    _write(package_dir, name, good)
    assert module.resolve_cubin(name, sha) == good


def test_missing_cubin_names_file_and_folders(cubin_dirs):
    module, env_dir, package_dir, cache_dir = cubin_dirs
    name = "abc/fmha/trtllm-gen/missing.cubin"
    _write(package_dir, name, b"stale")
    with pytest.raises(RuntimeError) as error:
        module.resolve_cubin(name, "0" * 64)
    message = str(error.value)
    assert f"FlashInfer cubin {name} (sha256 {'0' * 64}) was not found" in message
    assert "never downloads" in message
    assert f"{env_dir}/{name} (missing)" in message
    assert f"{package_dir}/{name} (sha256 {hashlib.sha256(b'stale').hexdigest()}, expected" in message
    assert f"{cache_dir}/{name} (missing)" in message


def test_checksum_check_can_be_disabled(cubin_dirs, monkeypatch):
    module, env_dir, _, _ = cubin_dirs
    _write(env_dir, "k.cubin", b"anything")
    with pytest.raises(RuntimeError):
        module.resolve_cubin("k.cubin", "f" * 64)
    monkeypatch.setenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", "1")
    assert module.resolve_cubin("k.cubin", "f" * 64) == b"anything"


def _plan_reference(tokens, heads, top_k, sm_count):
    """FlashInfer's resolve_wave_cpb and decode branch (attention_resolve.cu), in Python, except where
    even one split needs more than 3 waves: there FlashInfer keeps the most splits, the plan one."""
    chunks = -(-top_k // 64)
    per_token_head = tokens * -(-heads // 16)
    if per_token_head > 3 * sm_count:
        return dict(chunks=chunks, chunks_per_block=chunks, num_splits=1,
                    scratch_heads=8 if heads == 8 else -(-heads // 16) * 16)
    cpb, best_gap = 1, 2.0
    for candidate in range(1, chunks + 1):
        active = per_token_head * -(-chunks // candidate)
        ceil_w = -(-active // sm_count)
        if ceil_w > 3:
            continue
        gap = float(np.float32(ceil_w) - np.float32(active) / np.float32(sm_count))
        if gap < best_gap - 1e-6 or (gap < best_gap + 1e-6 and candidate > cpb):
            best_gap, cpb = gap, candidate
    return dict(chunks=chunks, chunks_per_block=cpb, num_splits=-(-chunks // cpb),
                scratch_heads=8 if heads == 8 else -(-heads // 16) * 16)


@pytest.mark.parametrize("tokens,heads,top_k", [
    (1, 128, 2048), (4, 8, 2048), (32, 16, 2048), (512, 128, 2048), (3, 100, 100), (64, 64, 512),
])
def test_sm120_plan_matches_flashinfer(tokens, heads, top_k):
    module = require_native()
    assert dict(module.sm120_plan(tokens, heads, top_k, 188)) == _plan_reference(tokens, heads, top_k, 188)
    with pytest.raises(ValueError, match="num_heads"):
        module.sm120_plan(1, 129, 2048, 188)


def _mla_plan_work_items(num_tokens, num_heads, kv_len, num_sms):
    """Work items FlashInfer's MLAPlan (attention/scheduler.cuh) makes for num_tokens one-query
    requests of kv_len keys: cluster tiles of 64 heads per CTA, 2-CTA clusters above 64 heads, each
    tile split into KV chunks of the rounded mean KV per cluster."""
    cluster = 2 if num_heads > 64 else 1
    tiles = num_tokens * -(-num_heads // (64 * cluster))
    mean = max(-(-tiles * kv_len // (num_sms // cluster)), 1)
    split = next((cap for bound, cap in ((8, 32), (16, 64), (32, 128), (64, 192)) if mean <= bound),
                 -(-mean // 256) * 256)
    return tiles * -(-kv_len // split)


@pytest.mark.parametrize("num_heads", [1, 16, 64, 65, 128, 200])
@pytest.mark.parametrize("padded_keys", [64, 2048, 65536])
@pytest.mark.parametrize("num_sms", [78, 132, 148])
def test_sm90_plan_token_limit_bounds_flashinfers_work_items(num_heads, padded_keys, num_sms):
    """At the limit MLAPlan stays within its 16384-entry work arrays, and the limit gives away at most
    one item per SM; its packed rows (tokens x padded_keys) fit int32."""
    module = require_native()
    if not hasattr(module, "sm90_plan_token_limit"):
        pytest.skip("the extension was built without the sm90 family")
    limit = module.sm90_plan_token_limit(num_heads, padded_keys, num_sms)
    assert limit >= 1
    assert _mla_plan_work_items(limit, num_heads, padded_keys, num_sms) <= 16384
    assert limit * padded_keys < 2 ** 31
    largest = max(t for t in range(limit, limit + num_sms + 2)
                  if _mla_plan_work_items(t, num_heads, padded_keys, num_sms) <= 16384)
    assert largest - limit <= num_sms
    assert module.sm90_plan_token_limit(num_heads, 2 ** 31, num_sms) == 0


def test_sm90_schedule_rejects_with_a_message():
    """The planner's errors carry the numbers (built without std::ostringstream, whose numeric
    insertion crashed a build with a statically linked C++ runtime)."""
    module = require_native()
    if not hasattr(module, "sm90_schedule"):
        pytest.skip("the extension was built without the sm90 family")
    with pytest.raises(ValueError, match=r"multiple of 64; got 0, 16, 64"):
        module.sm90_schedule(0, 16, 64, 0)
    with pytest.raises(ValueError, match=r"multiple of 64; got 4, 16, 100"):
        module.sm90_schedule(4, 16, 100, 0)


@pytest.mark.parametrize("num_tokens,max_tokens", [(1, 1), (5, 8), (8, 8), (9, 8), (16384, 16318),
                                                   (70001, 65535), (100, 7)])
def test_token_pieces_cover_in_even_pieces(num_tokens, max_tokens):
    pieces = registry.token_pieces(num_tokens, max_tokens)
    assert pieces[0][0] == 0 and pieces[-1][1] == num_tokens
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    sizes = [b - a for a, b in pieces]
    assert max(sizes) <= max_tokens and min(sizes) >= 1
    assert len(pieces) == -(-num_tokens // max_tokens)
    assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
