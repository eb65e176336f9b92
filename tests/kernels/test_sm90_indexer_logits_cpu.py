"""CPU tests of the SM90 indexer logits binding (kernels/sm90_indexer_logits.py): its problem
checks, its work split, its registration ("auto" and "native" on an SM90 device select it) and,
with the extension built, that both targets are registered as command-buffer compatible. The
extension tests skip when it is not importable;
JAX_SPARSE_MLA_REQUIRE_NATIVE=1 turns that skip into a failure.
"""

from __future__ import annotations


import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import native, registry
from jax_sparse_mla.kernels import sm90_indexer_logits as logits
from jax_sparse_mla.kernels.registry import IndexerProblem
from requirements import require_native

TARGETS = {logits.PAGED_TARGET, logits.RAGGED_TARGET}
PAGED_DTYPES = ("float8_e4m3fn", "uint8", "float32", "int32", "int32")
RAGGED_DTYPES = ("float8_e4m3fn", "float8_e4m3fn", "float32", "float32", "int32", "int32")


@pytest.fixture
def fake_sm90(monkeypatch):
    """Pretends the default device is an SM90 GPU and the extension holds the logits targets."""
    monkeypatch.setattr(registry, "current_device_capability", lambda: (9, 0))
    monkeypatch.setattr(native, "targets", frozenset(TARGETS))
    monkeypatch.setattr(native, "module", object())
    monkeypatch.setattr(native, "build_info", lambda: {"sm90": "90a"})


def paged(**override):
    base = dict(num_rows=8, num_heads=64, num_keys=8192, batch=8, next_n=1, block_size=64,
                dtypes=PAGED_DTYPES)
    base.update(override)
    return IndexerProblem("fp8_paged_mqa_logits", **base)


def ragged(**override):
    base = dict(num_rows=100, num_heads=64, num_keys=5000, dtypes=RAGGED_DTYPES)
    base.update(override)
    return IndexerProblem("fp8_mqa_logits", **base)


@pytest.mark.parametrize("override", [
    {}, dict(num_heads=32), dict(next_n=2, num_rows=16), dict(next_n=3, num_rows=24),
    dict(batch=65535, num_rows=65535), dict(num_keys=1),
])
def test_paged_check_accepts(fake_sm90, override):
    assert logits.check_paged(paged(**override), (9, 0)) is None


@pytest.mark.parametrize("override,message", [
    (dict(num_heads=16), "needs H = 32 or 64"),
    (dict(num_heads=128), "needs H = 32 or 64"),
    (dict(block_size=16), "block size 64"),
    (dict(dtypes=("bfloat16",) + PAGED_DTYPES[1:]), "needs dtypes"),
    (dict(batch=65536, num_rows=65536), "at most 65535 requests"),
    (dict(batch=30000, next_n=3, num_rows=90000), "at most 65535 requests"),
])
def test_paged_check_rejects(fake_sm90, override, message):
    assert message in logits.check_paged(paged(**override), (9, 0))


@pytest.mark.parametrize("override,message", [
    (dict(num_heads=48), "needs H = 32 or 64"),
    (dict(dtypes=("float8_e4m3fn",) * 2 + ("bfloat16",) + RAGGED_DTYPES[3:]), "needs dtypes"),
])
def test_ragged_check_rejects(fake_sm90, override, message):
    assert logits.check_ragged(ragged(), (9, 0)) is None
    assert message in logits.check_ragged(ragged(**override), (9, 0))


def test_check_names_a_missing_build(fake_sm90, monkeypatch):
    monkeypatch.setattr(native, "build_info", lambda: {"sm90": "90a"})
    assert "no sm_91a code" in logits.check_paged(paged(), (9, 1))
    monkeypatch.setattr(native, "targets", frozenset())
    assert "has no jax_sparse_mla_sm90_paged_mqa_logits" in logits.check_paged(paged(), (9, 0))


@pytest.mark.parametrize("grid", [logits.PAGED_GRID, logits.RAGGED_GRID])
@pytest.mark.parametrize("ctas,num_tiles", [(1, 2048), (1, 1), (1, 3), (128, 2048), (32, 128),
                                            (1000, 5), (1, 10 ** 6), (1, 1024), (32, 1024),
                                            (1024, 1024), (512, 128)])
def test_tiles_per_cta_minimises_whole_waves(grid, ctas, num_tiles):
    tiles = logits.tiles_per_cta(grid, ctas, num_tiles, 132)
    assert 1 <= tiles <= min(grid.max_tiles, num_tiles)
    if num_tiles == 1:
        assert tiles == 1
        return

    def cost(t):  # waves of ctas_per_sm x 132 CTAs, each as long as t tiles plus the fixed cost
        return (-(-(ctas * -(-num_tiles // t)) // (grid.ctas_per_sm * 132))
                * (t + grid.fixed_cost_tiles))

    candidates = range(2, min(grid.max_tiles, num_tiles) + 1)
    assert cost(tiles) == min(cost(t) for t in candidates)
    assert tiles == max(t for t in candidates if cost(t) == cost(tiles))


def test_tiles_per_cta_fills_whole_waves_at_the_decode_points():
    # 1 x 65536 and 1 x 131072: one wave of 342 CTAs instead of 512 (1.29 waves); 32 x 65536:
    # 2,368 CTAs (5.98 waves) instead of 2,048 (5.17).
    assert logits.tiles_per_cta(logits.PAGED_GRID, 1, 1024, 132) == 3
    assert logits.tiles_per_cta(logits.PAGED_GRID, 1, 2048, 132) == 6
    assert logits.tiles_per_cta(logits.PAGED_GRID, 32, 1024, 132) == 14


def test_tiles_per_cta_at_the_prefill_points():
    # 4096 rows (1024 CTAs of 4 rows) against 65536 keys: 9 chunks of 114 tiles (69.8 waves)
    # rather than 8 of 128 (62.1 waves, the fastest of the H100 sweep over 16 to 256 tiles); against
    # 131072 keys: 128.
    assert logits.tiles_per_cta(logits.RAGGED_GRID, 1024, 1024, 132) == 114
    assert logits.tiles_per_cta(logits.RAGGED_GRID, 1024, 2048, 132) == 128


@pytest.mark.parametrize("op,problem", [("fp8_paged_mqa_logits", paged()),
                                        ("fp8_mqa_logits", ragged())])
def test_auto_and_native_select_it_on_sm90(fake_sm90, op, problem):
    kernels = {k.name: k for k in registry.registered_op_kernels(op) if k.native}
    assert set(kernels) == {"sm90_mqa_logits"}
    assert kernels["sm90_mqa_logits"].validated
    assert kernels["sm90_mqa_logits"].capability_majors == (9,)
    assert registry.select_op_kernel(op, "auto", problem).name == "sm90_mqa_logits"
    assert registry.select_op_kernel(op, "native", problem).name == "sm90_mqa_logits"
    assert registry.select_op_kernel(op, "xla", problem).name == "xla"


def test_the_ops_lower_to_the_targets(fake_sm90):
    import jax
    q = jax.ShapeDtypeStruct((2, 1, 64, 128), jnp.float8_e4m3fn)
    cache = jax.ShapeDtypeStruct((4, 64, 132), jnp.uint8)
    weights = jax.ShapeDtypeStruct((2, 64), jnp.float32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    text = jax.jit(lambda *a: jsm.fp8_paged_mqa_logits(*a, max_context_len=256,
                                                       implementation="native")
                   ).lower(q, cache, weights, lens, table).as_text()
    assert f"@{logits.PAGED_TARGET}(" in text
    text = jax.jit(lambda *a: jsm.fp8_paged_mqa_logits(*a, max_context_len=256)
                   ).lower(q, cache, weights, lens, table).as_text()
    assert f"@{logits.PAGED_TARGET}(" in text  # auto runs it too
    qr = jax.ShapeDtypeStruct((5, 64, 128), jnp.float8_e4m3fn)
    keys = jax.ShapeDtypeStruct((300, 128), jnp.float8_e4m3fn)
    rows = jax.ShapeDtypeStruct((5,), jnp.int32)
    text = jax.jit(lambda *a: jsm.fp8_mqa_logits(*a, implementation="native")).lower(
        qr, keys, jax.ShapeDtypeStruct((300,), jnp.float32),
        jax.ShapeDtypeStruct((5, 64), jnp.float32), rows, rows).as_text()
    assert f"@{logits.RAGGED_TARGET}(" in text


def test_native_explains_a_rejected_problem(fake_sm90):
    with pytest.raises(ValueError, match="sm90_mqa_logits: needs H = 32 or 64"):
        registry.select_op_kernel("fp8_mqa_logits", "native", ragged(num_heads=48))
    with pytest.raises(ValueError, match="sm90_mqa_logits: needs an index cache of block size 64"):
        registry.select_op_kernel("fp8_paged_mqa_logits", "native", paged(block_size=16))


def test_public_op_builds_the_problem_the_check_sees(fake_sm90):
    """Block size 16 rules the kernel out at trace time, before any custom call."""
    q = jnp.zeros((2, 1, 64, 128), jnp.float8_e4m3fn)
    cache = jnp.zeros((4, 16, 132), jnp.uint8)
    with pytest.raises(ValueError, match="block size 64, got 16"):
        jsm.fp8_paged_mqa_logits(q, cache, jnp.zeros((2, 64), jnp.float32),
                                 jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4), jnp.int32),
                                 max_context_len=64, implementation="native")


def test_without_gpu_auto_is_pure_jax(monkeypatch):
    monkeypatch.setattr(registry, "current_device_capability", lambda: None)  # as on a CPU or TPU
    assert registry.select_op_kernel("fp8_paged_mqa_logits", "auto", paged()).name == "xla"


# --- the built extension --------------------------------------------------------------------------

def test_extension_registers_the_logits_targets_as_graph_safe():
    module = require_native()
    if "sm90" not in module.build_info():
        pytest.skip("the extension was built without the sm90 family")
    assert TARGETS <= set(module.registrations())
    assert TARGETS <= set(module.command_buffer_targets())
    assert all(native.has_target(t) for t in TARGETS)


@pytest.mark.parametrize("heads,rows_per_cta", [(64, 4), (32, 8)])
def test_ragged_grid_counts_the_kernels_rows_per_cta(fake_sm90, monkeypatch, heads, rows_per_cta):
    """The binding sizes the work split by the CTAs the handler launches: ceil(M / rows per CTA),
    the rows of 256 query columns."""
    import jax
    seen = []
    monkeypatch.setattr(logits, "tiles_per_cta",
                        lambda grid, ctas, tiles, sms: seen.append(ctas) or 1)
    num_rows = 37
    jax.eval_shape(lambda *a: logits._ragged_native(*a),
                   jax.ShapeDtypeStruct((num_rows, heads, 128), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((300, 128), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((300,), jnp.float32),
                   jax.ShapeDtypeStruct((num_rows, heads), jnp.float32),
                   jax.ShapeDtypeStruct((num_rows,), jnp.int32),
                   jax.ShapeDtypeStruct((num_rows,), jnp.int32))
    assert seen == [-(-num_rows // rows_per_cta)]
