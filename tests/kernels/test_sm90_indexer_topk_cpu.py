"""CPU tests of the SM90 indexer top-k binding (kernels/sm90_indexer_topk.py): its registration
("auto" and "native" run it on SM90), its `check`, the custom calls it
lowers to on a faked SM90 device, and, with the extension built, that both FFI targets are
registered and command-buffer compatible. The kernels themselves run in
test_sm90_indexer_topk_gpu.py.

The extension tests skip when it is not importable; JAX_SPARSE_MLA_REQUIRE_NATIVE=1 turns that skip
into a failure.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels import native, registry, sm90_indexer_topk as topk
from jax_sparse_mla.kernels.registry import IndexerProblem
from requirements import require_native

OPS = {"top_k_per_row": topk.TARGET, "top_k_per_row_decode": topk.TARGET_DECODE}
STREAM_OPS = {"top_k_per_row": topk.TARGET_STREAM,
              "top_k_per_row_decode": topk.TARGET_DECODE_STREAM}


def problem(op="top_k_per_row", **override):
    base = dict(num_rows=8, num_keys=131072, top_k=2048,
                dtypes=("float32", "int32", "int32") if op == "top_k_per_row" else
                ("float32", "int32"))
    if op == "top_k_per_row_decode":
        base.update(batch=4, next_n=2)
    base.update(override)
    return IndexerProblem(op, **base)


@pytest.fixture
def fake_sm90(monkeypatch):
    """Pretends the default device is a CUDA GPU of `capability` whose extension holds our targets
    and (unless `gencode` says otherwise) sm_90a code."""
    def set_device(capability=(9, 0), gencode="90a"):
        monkeypatch.setattr(registry, "current_device_capability", lambda: capability)
        monkeypatch.setattr(native, "targets", frozenset(OPS.values()))
        monkeypatch.setattr(native, "module", object())
        monkeypatch.setattr(native, "build_info", lambda: {"sm90": gencode} if gencode else {})
    return set_device


@pytest.mark.parametrize("op", sorted(OPS))
def test_registered_native_and_validated(op):
    ours = [k for k in registry.registered_op_kernels(op) if k.name == "sm90_topk"]
    assert len(ours) == 1
    kernel = ours[0]
    assert kernel.native and kernel.capability_majors == (9,) and kernel.validated
    assert kernel.check is topk.check_problem


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("override", [
    {}, dict(top_k=1), dict(top_k=100_000), dict(num_keys=1), dict(num_rows=1),
    dict(num_rows=2**31 - 1), dict(num_keys=2**31 - 1),
])
def test_check_accepts(fake_sm90, op, override):
    fake_sm90()
    assert topk.check_problem(problem(op, **override), (9, 0)) is None


@pytest.mark.parametrize("override,message", [
    (dict(num_rows=2**31), "R (rows) must be below 2^31"),
    (dict(num_keys=2**31), "S (logits width) must be below 2^31"),
    (dict(top_k=2**31), "k must be below 2^31"),
    (dict(top_k=0), "k must be positive"),
    (dict(dtypes=("bfloat16", "int32", "int32")), "needs float32 logits, got bfloat16"),
    (dict(dtypes=("float32", "int64", "int32")), "needs int32 row ranges"),
])
def test_check_rejects(fake_sm90, override, message):
    fake_sm90()
    assert message in topk.check_problem(problem(**override), (9, 0))


def test_check_names_a_build_without_sm90_code(monkeypatch):
    monkeypatch.setattr(native, "build_info", lambda: {"sm120": "120a"})
    assert "no sm_90a code (built for none)" in topk.check_problem(problem(), (9, 0))


@pytest.mark.parametrize("op", sorted(OPS))
def test_auto_and_native_select_it_on_sm90(fake_sm90, op):
    fake_sm90()
    assert registry.select_op_kernel(op, "auto", problem(op)).name == "sm90_topk"
    assert registry.select_op_kernel(op, "native", problem(op)).name == "sm90_topk"
    assert registry.select_op_kernel(op, "xla", problem(op)).name == "xla"


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_streaming_build_is_registered_validated_with_a_shape_rule(fake_sm90, monkeypatch, op):
    """sm90_topk_stream is registered after sm90_topk: with its targets present, "native" prefers
    it, and "auto" runs it for rows wider than 8192 positions, at most one per SM."""
    fake_sm90()
    monkeypatch.setattr(native, "targets", frozenset(OPS.values()) | frozenset(STREAM_OPS.values()))
    monkeypatch.setattr(registry, "device_sm_count", lambda: 132)
    stream = [k for k in registry.registered_op_kernels(op) if k.name == "sm90_topk_stream"]
    assert len(stream) == 1 and stream[0].native and stream[0].validated
    assert stream[0].available() and stream[0].slower_here is topk.stream_slower_here
    assert registry.select_op_kernel(op, "native", problem(op)).name == "sm90_topk_stream"
    assert registry.select_op_kernel(op, "auto", problem(op)).name == "sm90_topk_stream"
    for narrow_or_many in (dict(num_keys=8192), dict(num_rows=133)):
        call = problem(op, **narrow_or_many)
        assert registry.select_op_kernel(op, "auto", call).name == "sm90_topk"


@pytest.mark.parametrize("op", sorted(OPS))
def test_native_elsewhere_is_a_clear_error(fake_sm90, op):
    fake_sm90((10, 0))
    with pytest.raises(ValueError, match=r"sm90_topk: needs compute capability major \(9,\)"):
        registry.select_op_kernel(op, "native", problem(op))
    fake_sm90((9, 0), gencode="")
    with pytest.raises(ValueError, match="sm90_topk: the extension has no sm_90a code"):
        registry.select_op_kernel(op, "native", problem(op))
    assert registry.select_op_kernel(op, "auto", problem(op)).name == "xla"


def test_public_ops_lower_to_the_custom_calls(fake_sm90):
    """On a faked SM90 device, implementation="native" lowers each op to its FFI target with the
    operands and result the handler checks (nothing is compiled or run)."""
    fake_sm90()
    logits = jax.ShapeDtypeStruct((6, 5000), jnp.float32)
    rows = jax.ShapeDtypeStruct((6,), jnp.int32)
    text = jax.jit(lambda l, s, e: jsm.top_k_per_row(l, s, e, k=2048, implementation="native")
                   ).lower(logits, rows, rows).as_text()
    assert topk.TARGET in text and "tensor<6x2048xi32>" in text
    lens = jax.ShapeDtypeStruct((3,), jnp.int32)
    text = jax.jit(lambda l, c: jsm.top_k_per_row_decode(l, c, next_n=2, k=64,
                                                          implementation="native")
                   ).lower(logits, lens).as_text()
    assert topk.TARGET_DECODE in text and "tensor<6x64xi32>" in text
    assert "next_n = 2" in text


def test_empty_shapes_need_no_kernel(fake_sm90):
    """R = 0 or S = 0: the binding returns the reference's all -1 array without a custom call (so
    these run on the CPU even with "native")."""
    fake_sm90()
    for shape in ((0, 100), (3, 0)):
        logits = jnp.zeros(shape, jnp.float32)
        rows = jnp.zeros(shape[:1], jnp.int32)
        out = jsm.top_k_per_row(logits, rows, rows + shape[1], k=16, implementation="native")
        ref = jsm.top_k_per_row(logits, rows, rows + shape[1], k=16, implementation="xla")
        assert out.shape == (shape[0], 16) and out.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    out = jsm.top_k_per_row_decode(jnp.zeros((4, 0), jnp.float32), jnp.zeros(2, jnp.int32),
                                   next_n=2, k=8, implementation="native")
    np.testing.assert_array_equal(np.asarray(out), np.full((4, 8), -1))


# --- the built extension -------------------------------------------------------------------------

def test_extension_registers_both_targets_as_graph_safe():
    module = require_native()
    if "sm90" not in module.build_info():
        pytest.skip("the extension was built without the sm90 family")
    targets = set(OPS.values()) | set(STREAM_OPS.values())
    assert targets <= set(module.registrations())
    assert targets <= set(module.command_buffer_targets())
    assert all(native.has_target(t) for t in targets)
    # Registered with JAX for CUDA by kernels/native.py, so the binding is available().
    for op in OPS:
        kernel = next(k for k in registry.registered_op_kernels(op) if k.name == "sm90_topk")
        assert kernel.available()
