"""Per-op indexer implementations: examples/generate.py's --implementation -> indexer ops mapping
(checked against the kernel registry), the Flax Indexer's `implementation` as a string or a mapping
(validation at construction, each call site passing its own op's choice) and MLASparseAttention's
indexer_implementation."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_sparse_mla.flax import TINY, Indexer, MLASparseAttention  # noqa: E402
from jax_sparse_mla.flax.layers import INDEXER_OPS  # noqa: E402
from jax_sparse_mla.kernels import registry  # noqa: E402
from test_flax_indexer import batch_metadata, empty_cache  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "generate.py"
# The ops with only a pure-JAX implementation (everywhere), which broke --implementation native.
PURE_JAX_OPS = ("indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache")
# Which Indexer path calls each op: the prefill path gathers and scores ragged keys, a decode scores
# the paged cache; both write this step's keys first.
PREFILL_OPS = ("indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache", "fp8_mqa_logits",
               "top_k_per_row")
DECODE_OPS = ("indexer_k_quant_and_cache", "fp8_paged_mqa_logits", "top_k_per_row_decode")
# Small: two requests over 3 blocks each, one longer than index_topk = 128 so selection truncates.
SEQ_LENS = (150, 70)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    # The example's dataclasses resolve their (string) annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def natively_registered(op):
    return any(kernel.native for kernel in registry.registered_op_kernels(op))


def test_indexer_ops_are_the_registered_ones():
    assert set(PREFILL_OPS) | set(DECODE_OPS) == set(INDEXER_OPS)
    for op in INDEXER_OPS:
        assert registry.registered_op_kernels(op), f"no kernel is registered for {op}"


@pytest.mark.parametrize("flag", ["auto", "xla"])
def test_example_passes_auto_and_xla_to_every_indexer_op(example, flag):
    assert example.indexer_implementations(flag) == {op: flag for op in INDEXER_OPS}


def test_example_native_only_where_a_native_kernel_is_registered(example):
    mapping = example.indexer_implementations("native")
    assert set(mapping) == set(INDEXER_OPS)
    assert set(mapping.values()) <= {"native", "xla"}
    native = {op for op, value in mapping.items() if value == "native"}
    assert native == {op for op in INDEXER_OPS if natively_registered(op)}
    assert native  # the SM90 logits and top-k kernels
    for op in PURE_JAX_OPS:
        assert mapping[op] == "xla"
    line = example.describe_indexer_implementations("native")
    assert all(op in line for op in PURE_JAX_OPS) and "pure JAX" in line
    with pytest.raises(ValueError, match="implementation must be one of"):
        example.indexer_implementations("pallas")


def test_indexer_takes_the_example_mapping(example):
    mapping = example.indexer_implementations("native")
    indexer = Indexer(TINY, rngs=nnx.Rngs(0), implementation=mapping)
    assert indexer.implementations == tuple((op, mapping[op]) for op in INDEXER_OPS)
    assert all(indexer.implementation_for(op) == mapping[op] for op in INDEXER_OPS)


def test_indexer_implementation_string_and_partial_mapping():
    assert Indexer(TINY, rngs=nnx.Rngs(0), implementation="xla").implementations == tuple(
        (op, "xla") for op in INDEXER_OPS)
    partial = Indexer(TINY, rngs=nnx.Rngs(0), implementation={"top_k_per_row": "xla"})
    assert partial.implementation_for("top_k_per_row") == "xla"
    assert all(partial.implementation_for(op) == "auto" for op in INDEXER_OPS if op != "top_k_per_row")


@pytest.mark.parametrize("implementation,error,match", [
    ({"fp8_mqa_logit": "xla"}, ValueError,
     r"implementation names unknown indexer op\(s\) \['fp8_mqa_logit'\]"),
    ({"top_k_per_row": "pallas"}, ValueError, r"implementation\['top_k_per_row'\] must be one of"),
    ({"top_k_per_row": None}, TypeError, r"implementation\['top_k_per_row'\] must be a string"),
    ("cuda", ValueError, r"implementation must be one of \('auto', 'xla', 'native'\)"),
    (["xla"], TypeError, "implementation must be a string"),
])
def test_indexer_rejects_bad_implementations_at_construction(implementation, error, match):
    with pytest.raises(error, match=match):
        Indexer(TINY, rngs=nnx.Rngs(0), implementation=implementation)


def test_attention_layer_names_its_indexer_argument():
    with pytest.raises(ValueError, match=r"indexer_implementation names unknown indexer op"):
        MLASparseAttention(TINY, rngs=nnx.Rngs(0), indexer_implementation={"gather": "xla"})
    layer = MLASparseAttention(TINY, rngs=nnx.Rngs(0), implementation="xla",
                               indexer_implementation={"fp8_mqa_logits": "xla"})
    assert layer.indexer.implementation_for("fp8_mqa_logits") == "xla"
    assert layer.indexer.implementation_for("top_k_per_row") == "auto"


def step(path, cache=None):
    """(x, q_a, positions, index_cache, metadata) of a small prefill of every token into an empty
    cache, or of a decode (next_n = 1) of each request's last token over `cache` (the prefill's: the
    token's own key is rewritten with the same bytes)."""
    total = sum(SEQ_LENS)
    x = jax.random.normal(jax.random.key(1), (total, TINY.hidden_size), jnp.bfloat16)
    q_a = jax.random.normal(jax.random.key(2), (total, TINY.q_lora_rank), jnp.bfloat16)
    if path == "prefill":
        metadata, positions, _, _ = batch_metadata(SEQ_LENS, SEQ_LENS)
        return x, q_a, positions, empty_cache() if cache is None else cache, metadata
    last = np.cumsum(SEQ_LENS) - 1
    metadata, positions, _, _ = batch_metadata(SEQ_LENS, (1,) * len(SEQ_LENS))
    return x[last], q_a[last], positions, empty_cache() if cache is None else cache, metadata


run = jax.jit(lambda module, *args: module(*args))


@pytest.fixture(scope="module")
def xla_prefill():
    """(topk, index cache) of the prefill step through Indexer(implementation="xla")."""
    return run(Indexer(TINY, rngs=nnx.Rngs(0), implementation="xla"), *step("prefill"))


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_all_xla_mapping_selects_like_the_xla_string(xla_prefill, path):
    """Same parameters (Rngs(0)), so the same top-k and cache; the mapping given in another order."""
    by_mapping = Indexer(TINY, rngs=nnx.Rngs(0), implementation={op: "xla" for op in reversed(INDEXER_OPS)})
    assert by_mapping.implementations == tuple((op, "xla") for op in INDEXER_OPS)
    topk, cache = run(by_mapping, *step(path, None if path == "prefill" else xla_prefill[1]))
    topk = np.asarray(topk)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(xla_prefill[1]))
    if path == "prefill":
        expected = np.asarray(xla_prefill[0])
    else:  # a decode token selects as it did in the prefill
        expected = np.asarray(xla_prefill[0])[np.cumsum(SEQ_LENS) - 1]
    np.testing.assert_array_equal(topk, expected)
    # Not vacuous: every token keeps min(position + 1, top-k) keys.
    positions = np.asarray(step(path)[2])
    np.testing.assert_array_equal((topk >= 0).sum(1), np.minimum(positions + 1, TINY.index_topk))


@pytest.mark.parametrize("op", INDEXER_OPS)
def test_each_call_site_passes_its_own_ops_implementation(op):
    """{op: "native", the rest: "xla"}: tracing the step that calls op raises for op (no native kernel
    fits on CPU, or none exists), and the other path, when it does not call op, traces. The kernel is
    chosen at trace time, so eval_shape checks it without compiling."""
    if natively_registered(op) and jax.default_backend() != "cpu":
        pytest.skip(f"a native {op} kernel may fit this {jax.default_backend()} device")
    indexer = Indexer(TINY, rngs=nnx.Rngs(0),
                      implementation={other: "native" if other == op else "xla" for other in INDEXER_OPS})
    calls = "prefill" if op in PREFILL_OPS else "decode"
    with pytest.raises(ValueError, match=f"implementation='native' was requested for {op} but"):
        jax.eval_shape(lambda *args: indexer(*args), *step(calls))
    if op not in PREFILL_OPS or op not in DECODE_OPS:
        other = step("decode" if calls == "prefill" else "prefill")
        topk, _ = jax.eval_shape(lambda *args: indexer(*args), *other)
        assert topk.shape == (other[0].shape[0], TINY.index_topk)


def test_example_decoder_with_shared_indexer_layers(example):
    """--index-topk-freq 2 --index-skip-topk-offset 1 over 3 layers: layers 0 and 2 run their
    indexers, layer 1 attends over layer 0's selection; the example's own check passes."""
    result = example.main(["--layers", "3", "--batch", "2", "--new-tokens", "2", "--check-tokens", "2",
                           "--index-topk-freq", "2", "--index-skip-topk-offset", "1",
                           "--implementation", "xla"])
    assert result["layers"] == 3 and result["check_error"] < 2e-2
    model = example.Decoder(TINY, 3, 16, rngs=nnx.Rngs(0), implementation="xla",
                            indexer_types=("full", "shared", "full"))
    assert [b.attn.indexer is None for b in model.blocks] == [False, True, False]
    with pytest.raises(ValueError, match="the first 'full'"):
        example.Decoder(TINY, 2, 16, rngs=nnx.Rngs(0), indexer_types=("shared", "full"))


def test_example_names_the_attention_kernel_of_each_step(example, monkeypatch):
    """describe_attention as on an SM90 GPU (select_kernel answering with native kernels): a prefill
    chunk over fp8_ds_mla goes through the bf16 workspace and asks for the bf16 kernel; a decode step
    and a bf16 cache do not."""
    from jax_sparse_mla.flax import DEEPSEEK_V32

    asked = []

    def select_kernel(kv_layout, q_dtype, implementation="auto", problem=None):
        asked.append(kv_layout)
        kernel = registry.SparseMLAKernel(name=f"native_{kv_layout}", native=True,
                                          capability_majors=(9,), kv_layouts=(kv_layout,),
                                          q_dtypes=(q_dtype,), fn=None)
        return kernel

    monkeypatch.setattr(registry, "select_kernel", select_kernel)
    layout = example.PagedLayout(32, 65536 // example.BLOCK_SIZE)
    line = example.describe_attention(DEEPSEEK_V32, "fp8_ds_mla", "auto", layout,
                                      {"prefill": 8192, "decode": 32})
    assert line == ("sparse attention: prefill steps of 8192 tokens on native_bfloat16 over a bf16 "
                    "workspace of the fp8_ds_mla rows; decode steps of 32 tokens on native_fp8_ds_mla")
    line = example.describe_attention(DEEPSEEK_V32, "auto", "auto", layout, {"prefill": 8192})
    assert line == "sparse attention: prefill steps of 8192 tokens on native_bfloat16"
    line = example.describe_attention(DEEPSEEK_V32, "fp8_ds_mla", "native", layout, {"prefill": 8192})
    assert line == "sparse attention: prefill steps of 8192 tokens on native_fp8_ds_mla"
