"""The GPU index-conversion kernels (Pallas' Triton kernels and the CUDA kernels of the extension)
against the pure-JAX version, bit for bit.

`gpu` tests run both on a CUDA GPU (the public functions with implementation="pallas" and
"native" vs "xla") over vLLM's converter grid: block sizes {16, 64, 128},
K in {128, 256, 512, 2048, 2176, 4224}, holes, negatives, out-of-width positions, the prefill
workspace, DCP sizes {1, 2, 4, 8} x interleave {1, 2, 4}, plus random inputs. Compaction is checked
against the (stable) pure version exactly, and also as sets with a -1 tail. They skip without a
CUDA GPU; JAX_SPARSE_MLA_REQUIRE_GPU=1 turns that skip into a failure.

The other tests run everywhere: the Pallas kernels in Pallas' interpreter on a small subset, their
lowering for CUDA (Pallas -> Triton IR, no GPU needed), the `implementation` keyword and what
"auto" falls back to.
"""

from __future__ import annotations

import functools
import itertools
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.ops import index_conversion
from jax_sparse_mla.kernels import index_conversion_native, index_conversion_pallas
from jax_sparse_mla.ops.index_conversion import (
    convert_req_index_to_global_index,
    filter_and_convert_dcp_index,
)
from jax_sparse_mla.kernels.registry import current_device_capability
from gpu_subprocess import assert_sanitizer_clean


@functools.cache
def skip_reason() -> str:
    if current_device_capability() is None:
        return f"needs a CUDA GPU (the default device is {jax.devices()[0].platform!r})"
    return ""


if skip_reason() and os.environ.get("JAX_SPARSE_MLA_REQUIRE_GPU") == "1":
    raise RuntimeError(
        f"JAX_SPARSE_MLA_REQUIRE_GPU=1 but the index-conversion GPU tests cannot run: {skip_reason()}"
    )



def on_cuda(test):
    """Marks a test `gpu` and skips it (with the reason) unless the default device is a CUDA GPU."""
    skip = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "-")
    return pytest.mark.gpu(skip(test))


# The GPU kernels checked against pure JAX: Pallas (Triton) and CUDA ("native").
GPU_IMPLEMENTATIONS = ("pallas", "native")


def require_kernels(implementation: str) -> str:
    """`implementation` when its kernels can run here; else a skip (a failure under
    JAX_SPARSE_MLA_REQUIRE_GPU=1) with the reason, e.g. no compiled extension for "native"."""
    reason = index_conversion.unavailable_reason(implementation)
    if reason:
        if os.environ.get("JAX_SPARSE_MLA_REQUIRE_GPU") == "1":
            pytest.fail(f"JAX_SPARSE_MLA_REQUIRE_GPU=1 but {implementation!r} cannot run: {reason}")
        pytest.skip(reason)
    return implementation


@pytest.fixture(params=GPU_IMPLEMENTATIONS)
def impl(request) -> str:
    return require_kernels(request.param)
BLOCK_SIZES = (16, 64, 128)
TOP_KS = (128, 256, 512, 2048, 2176, 4224)


def i32(x) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.int32)


def make_case(seed: int, *, num_tokens: int, top_k: int, block_size: int, num_reqs: int = 4,
              width: int = 40, positions: int | None = None, prefill: bool = False) -> dict:
    """Inputs shaped like vLLM's converter tests.

    Returns numpy int32 arrays: req_id [T] (one token with a negative id and one with an id >= R,
    both clipped by the converter), block_table [R, W], token_indices [T, K] with -1 holes, other
    negatives, positions at and past the table width, and a row with nothing valid; with
    `prefill`, pref_ids [T] (-1 = paged) and pref_starts [P].
    """
    rng = np.random.default_rng(seed)
    positions = positions or block_size * width
    req_id = rng.integers(0, num_reqs, num_tokens)
    if num_tokens > 3:
        req_id[1], req_id[2] = -1, num_reqs
    block_table = rng.integers(0, 5000, (num_reqs, width))
    tok = rng.integers(0, positions, (num_tokens, top_k))
    draw = rng.random(tok.shape)
    tok[draw < 0.1] = -1
    tok[(draw >= 0.1) & (draw < 0.12)] = -rng.integers(2, 1000)
    tok[draw > 0.95] = block_size * width + rng.integers(0, 3 * block_size)  # out of width
    tok[num_tokens // 2] = -1
    case = dict(req_id=req_id, block_table=block_table, tok=tok)
    if prefill:
        paged = rng.random(num_tokens) < 0.5
        case["pref_ids"] = np.where(paged, -1, rng.integers(0, 3, num_tokens))
        case["pref_starts"] = np.array([0, 70000, 150000])
    return {name: np.asarray(a, np.int32) for name, a in case.items()}


def plain(case: dict, implementation: str, **kwargs):
    """convert_req_index_to_global_index on the case under jax.jit, where its out-of-range request
    ids are clipped (called eagerly they are a ValueError)."""
    arrays = dict(req_id_per_token=i32(case["req_id"]), block_table=i32(case["block_table"]),
                  token_indices=i32(case["tok"]))
    if "pref_ids" in case:
        arrays.update(prefill_workspace_request_ids=i32(case["pref_ids"]),
                      prefill_workspace_starts=i32(case["pref_starts"]))
    return jax.jit(lambda arrays: convert_req_index_to_global_index(
        **arrays, implementation=implementation, **kwargs))(arrays)


def check_compaction(compacted: np.ndarray, counts: np.ndarray, in_place: np.ndarray) -> None:
    """Every row holds its valid in-place slots (as a multiset) in front, then -1s."""
    np.testing.assert_array_equal(counts, (in_place >= 0).sum(1))
    for row, n in enumerate(counts):
        assert (compacted[row, n:] == -1).all()
        np.testing.assert_array_equal(
            np.sort(compacted[row, :n]), np.sort(in_place[row][in_place[row] >= 0])
        )


def assert_same(got, want) -> None:
    got, want = jax.tree.map(np.asarray, (got, want))
    jax.tree.map(np.testing.assert_array_equal, got, want)


# ----------------------------------------------------------------------------- GPU (Triton)


# Every (block size, K) pair, half of them with prefill workspace rows: each variant is a separate
# Triton compilation, so the grid is not doubled (the random tests mix both again).
PLAIN_GRID = [
    (block_size, top_k, i % 2 == 1)
    for i, (block_size, top_k) in enumerate(itertools.product(BLOCK_SIZES, TOP_KS))
]


@on_cuda
@pytest.mark.parametrize("block_size, top_k, prefill", PLAIN_GRID)
def test_plain_grid_matches_xla(impl, block_size, top_k, prefill):
    case = make_case(top_k + block_size, num_tokens=37, top_k=top_k, block_size=block_size,
                     prefill=prefill)
    in_place = plain(case, impl, block_size=block_size)
    assert_same(in_place, plain(case, "xla", block_size=block_size))
    for compact in (False, True):
        got = plain(case, impl, block_size=block_size, return_valid_counts=True,
                    compact=compact)
        assert_same(got, plain(case, "xla", block_size=block_size, return_valid_counts=True,
                               compact=compact))
    check_compaction(np.asarray(got[0]), np.asarray(got[1]), np.asarray(in_place))


def dcp_over_ranks(case: dict, implementation: str, *, dcp_size: int, interleave: int, **kwargs):
    """filter_and_convert_dcp_index over `case`, jitted as a function of the rank: the rank is
    traced, as under shard_map, so one compilation serves every rank."""
    return jax.jit(lambda rank: filter_and_convert_dcp_index(
        i32(case["req_id"]), i32(case["block_table"]), i32(case["tok"]),
        dcp_size=dcp_size, dcp_rank=rank, cp_kv_cache_interleave_size=interleave,
        implementation=implementation, **kwargs,
    ))


@on_cuda
@pytest.mark.parametrize("dcp_size, interleave", list(itertools.product([1, 2, 4, 8], [1, 2, 4])))
def test_dcp_grid_matches_xla(impl, dcp_size, interleave):
    block_size = 64
    top_k = 2176 if interleave == 2 else 2048
    case = make_case(10 * dcp_size + interleave, num_tokens=29, top_k=top_k,
                     block_size=block_size, width=16, positions=block_size * 16 * dcp_size + 500)

    def run(implementation, compact):
        return dcp_over_ranks(case, implementation, dcp_size=dcp_size, interleave=interleave,
                              block_size=block_size, return_valid_counts=True, compact=compact)

    gpu_in_place, gpu_compact = run(impl, False), run(impl, True)
    xla_in_place, xla_compact = run("xla", False), run("xla", True)
    for rank in range(dcp_size):
        rank = jnp.int32(rank)
        in_place = gpu_in_place(rank)
        compacted = gpu_compact(rank)
        assert_same(in_place, xla_in_place(rank))
        assert_same(compacted, xla_compact(rank))
        check_compaction(np.asarray(compacted[0]), np.asarray(compacted[1]),
                         np.asarray(in_place[0]))


@on_cuda
@pytest.mark.parametrize("seed", range(4))
def test_random_inputs_match_xla(impl, seed):
    rng = np.random.default_rng(100 + seed)
    block_size = int(rng.choice(BLOCK_SIZES))
    top_k = 128 * int(rng.integers(1, 40))
    num_tokens = int(rng.integers(1, 300))
    case = make_case(seed, num_tokens=num_tokens, top_k=top_k, block_size=block_size,
                     num_reqs=int(rng.integers(1, 9)), width=int(rng.integers(1, 80)),
                     prefill=bool(seed % 2))
    for count, compact in itertools.product((False, True), repeat=2):
        kwargs = dict(block_size=block_size, return_valid_counts=count, compact=compact)
        assert_same(plain(case, impl, **kwargs), plain(case, "xla", **kwargs))
    n = int(rng.choice([2, 4, 8]))
    kwargs = dict(dcp_size=n, dcp_rank=int(rng.integers(0, n)), block_size=block_size,
                  cp_kv_cache_interleave_size=int(rng.choice([1, 2, 4])),
                  return_valid_counts=True)
    args = (i32(case["req_id"]), i32(case["block_table"]), i32(case["tok"]))
    dcp = lambda implementation: jax.jit(lambda *args: filter_and_convert_dcp_index(  # noqa: E731
        *args, implementation=implementation, **kwargs))(*args)  # jit: ids outside the table clip
    assert_same(dcp(impl), dcp("xla"))


@on_cuda
@pytest.mark.parametrize(
    "num_tokens, num_reqs, width, num_starts",
    [(0, 4, 8, 2), (5, 0, 8, 2), (5, 4, 0, 2), (5, 4, 8, 0), (66000, 4, 8, 2)],
)
def test_edge_shapes_match_xla(impl, num_tokens, num_reqs, width, num_starts):
    """Empty batch, empty table, no workspace starts, and more rows than a CUDA y-grid holds."""
    rng = np.random.default_rng(7)
    case = dict(
        req_id=rng.integers(0, max(num_reqs, 1), num_tokens),
        block_table=rng.integers(0, 100, (num_reqs, width)),
        tok=rng.integers(-2, 600, (num_tokens, 128)),
        pref_ids=rng.integers(-1, 3, num_tokens),
        pref_starts=rng.integers(0, 1000, num_starts),
    )
    for count in (False, True):
        kwargs = dict(block_size=16, return_valid_counts=count, compact=count)
        assert_same(plain(case, impl, **kwargs), plain(case, "xla", **kwargs))


@on_cuda
@pytest.mark.parametrize("impl, marker", [("pallas", "triton"),
                                          ("native", "jax_sparse_mla_index_conversion")])
def test_runs_inside_jit(impl, marker):
    require_kernels(impl)
    case = make_case(3, num_tokens=64, top_k=2048, block_size=64, prefill=True)
    f = jax.jit(functools.partial(plain, implementation=impl, block_size=64,
                                  return_valid_counts=True, compact=True))
    hlo = jax.jit(lambda: f(case)).lower().as_text()
    assert marker in hlo.lower()  # the kernel, not the XLA fallback
    assert_same(f(case), plain(case, "xla", block_size=64, return_valid_counts=True, compact=True))


# Cases run under compute-sanitizer: paged rows with prefill workspace rows, a K that is no multiple of
# the tile, DCP with interleave, and more rows than a CUDA y-grid holds; in place (the tile kernel),
# with counts and compacted (the row kernel).
SANITIZER_CASES = [
    dict(seed=1, num_tokens=37, top_k=2048, block_size=64, prefill=True),
    dict(seed=2, num_tokens=5, top_k=2176, block_size=16, width=16, positions=16 * 16 * 4 + 500,
         dcp_size=4, interleave=2),
    dict(seed=3, num_tokens=66000, top_k=128, block_size=128, width=8),
]


def check_against_cpu(implementation: str, spec: dict) -> None:
    """The GPU kernels of `implementation` on one SANITIZER_CASES case against pure JAX run on the
    CPU device, so that under a sanitizer only the kernels under test run on the GPU."""
    spec = dict(spec)
    dcp_size, interleave = spec.pop("dcp_size", 1), spec.pop("interleave", 1)
    case = make_case(spec.pop("seed"), **spec)
    block_size = spec["block_size"]

    def run(implementation: str, count: bool, compact: bool, rank: int):
        kwargs = dict(block_size=block_size, return_valid_counts=count, compact=compact)
        if dcp_size == 1:
            return plain(case, implementation, **kwargs)
        return dcp_over_ranks(case, implementation, dcp_size=dcp_size, interleave=interleave,
                              **kwargs)(jnp.int32(rank))

    forms = [(False, False), (True, False), (True, True)]  # (counts, compact)
    for (count, compact), rank in itertools.product(forms, range(dcp_size)):
        got = run(implementation, count, compact, rank)
        with jax.default_device(jax.devices("cpu")[0]):
            want = run("xla", count, compact, rank)
        assert_same(got, want)


SANITIZER_SCRIPT = textwrap.dedent("""
    import test_index_conversion_gpu as cases
    for implementation in cases.GPU_IMPLEMENTATIONS:
        for spec in cases.SANITIZER_CASES:
            cases.check_against_cpu(implementation, spec)
    print("MEMCHECK GRID PASSED")
""")


@on_cuda
@pytest.mark.sanitizer
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(tmp_path, tool):
    """Both GPU implementations' kernels over SANITIZER_CASES under compute-sanitizer (memcheck:
    out-of-bounds and misaligned accesses; racecheck: shared-memory hazards), each case matching
    pure JAX bit for bit."""
    for implementation in GPU_IMPLEMENTATIONS:
        require_kernels(implementation)
    assert_sanitizer_clean(SANITIZER_SCRIPT, tmp_path, tool)


# ----------------------------------------------------------------------------- any backend


def _interpret_cases():
    for block_size, top_k, prefill in [(16, 128, True), (64, 256, False), (128, 384, True)]:
        yield pytest.param(dict(block_size=block_size, top_k=top_k, prefill=prefill, dcp_size=1,
                                interleave=1, rank=0), id=f"plain-bs{block_size}-k{top_k}")
    for dcp_size, interleave in [(2, 1), (4, 2), (8, 4)]:
        yield pytest.param(dict(block_size=16, top_k=256, prefill=False, dcp_size=dcp_size,
                                interleave=interleave, rank=dcp_size - 1),
                           id=f"dcp{dcp_size}-i{interleave}")


@pytest.mark.parametrize("spec", list(_interpret_cases()))
@pytest.mark.parametrize("count, compact", list(itertools.product((False, True), repeat=2)))
def test_kernels_in_interpret_mode_match_xla(spec, count, compact):
    """The kernels themselves, in Pallas' interpreter (no GPU needed), against `_convert`."""
    case = make_case(spec["top_k"], num_tokens=9, top_k=spec["top_k"],
                     block_size=spec["block_size"], width=6,
                     positions=spec["block_size"] * 6 * spec["dcp_size"] + 40,
                     prefill=spec["prefill"])
    args = (i32(case["req_id"]), i32(case["block_table"]), i32(case["tok"]), spec["rank"],
            i32(case["pref_ids"]) if spec["prefill"] else None,
            i32(case["pref_starts"]) if spec["prefill"] else None)
    static = dict(block_size=spec["block_size"], dcp_size=spec["dcp_size"],
                  interleave=spec["interleave"], compact=compact, count=count)
    got = index_conversion_pallas.convert(*args, interpret=True, **static)
    assert_same(got, index_conversion._convert(*args, **static))


def test_multi_tile_rows_in_interpret_mode():
    """K > 4096: compaction spans two row tiles and must stay a stable pack."""
    case = make_case(5, num_tokens=3, top_k=4224, block_size=64, width=80)
    args = (i32(case["req_id"]), i32(case["block_table"]), i32(case["tok"]), 0, None, None)
    static = dict(block_size=64, dcp_size=1, interleave=1, compact=True, count=True)
    got = index_conversion_pallas.convert(*args, interpret=True, **static)
    assert_same(got, index_conversion._convert(*args, **static))


@pytest.mark.parametrize("count, compact", list(itertools.product((False, True), repeat=2)))
def test_kernels_lower_for_cuda(count, compact):
    """Pallas -> Triton IR lowering succeeds for CUDA on any host (PTX compilation needs a GPU)."""
    case = make_case(1, num_tokens=8, top_k=2176, block_size=64, prefill=True)
    f = functools.partial(index_conversion_pallas.convert, block_size=64, dcp_size=4,
                          interleave=2, compact=compact, count=count)
    lowered = jax.jit(f).trace(
        i32(case["req_id"]), i32(case["block_table"]), i32(case["tok"]), jnp.int32(1),
        i32(case["pref_ids"]), i32(case["pref_starts"]),
    ).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


def test_xla_implementation_is_forced_everywhere():
    case = make_case(2, num_tokens=4, top_k=128, block_size=16)
    forced = plain(case, "xla", block_size=16, return_valid_counts=True)
    assert_same(forced, plain(case, "auto", block_size=16, return_valid_counts=True))
    hlo = jax.jit(lambda: plain(case, "xla", block_size=16)).lower().as_text()
    assert "triton" not in hlo.lower()


@pytest.mark.skipif(not skip_reason(), reason="checks the error raised without a CUDA GPU")
@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_pallas_without_cuda_gpu_raises(fn):
    args = (i32(np.zeros(2)), i32(np.zeros((1, 4))), i32(np.zeros((2, 128))))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        if fn == "plain":
            convert_req_index_to_global_index(*args, implementation="pallas")
        else:
            filter_and_convert_dcp_index(*args, dcp_size=2, dcp_rank=0, implementation="pallas")


@pytest.mark.parametrize("fn", ["plain", "dcp"])
def test_rejects_unknown_implementation(fn):
    args = (i32(np.zeros(2)), i32(np.zeros((1, 4))), i32(np.zeros((2, 128))))
    with pytest.raises(ValueError, match="implementation must be one of"):
        if fn == "plain":
            convert_req_index_to_global_index(*args, implementation="triton")
        else:
            filter_and_convert_dcp_index(*args, dcp_size=2, dcp_rank=0, implementation="triton")


def test_auto_takes_the_first_kernels_that_can_run(monkeypatch):
    """auto_order on a CUDA GPU: the CUDA row kernel first for compaction with DCP and, without
    DCP, from NATIVE_COMPACT_MIN_TOKENS tokens, Pallas first elsewhere; CUDA in Pallas' place only
    for compaction; then pure JAX. A forced choice runs its kernels or says why it cannot."""
    many = index_conversion.NATIVE_COMPACT_MIN_TOKENS
    reasons = {"pallas": None, "native": None}
    monkeypatch.setattr(index_conversion, "unavailable_reason", lambda name: reasons[name])

    def select(implementation, num_tokens, compact, dcp_size=1):
        return index_conversion._select_core(implementation, num_tokens=num_tokens,
                                             compact=compact, dcp_size=dcp_size)

    assert select("auto", many, True) is index_conversion_native.convert
    assert select("auto", many - 1, True) is index_conversion_pallas.convert
    assert select("auto", 1, True, dcp_size=2) is index_conversion_native.convert
    assert select("auto", many, False) is index_conversion_pallas.convert
    reasons["pallas"] = "the Pallas Triton backend is gone"
    assert select("auto", 1, True) is index_conversion_native.convert
    assert select("auto", 1, False) is index_conversion._convert
    assert select("native", 1, False) is index_conversion_native.convert
    reasons["native"] = "no extension"
    assert select("auto", many, True) is index_conversion._convert
    with pytest.raises(ValueError, match="implementation='native' cannot run the index "
                                         "conversion: no extension"):
        select("native", 1, True)


def test_a_pallas_lowering_failure_is_a_reason_not_an_error(monkeypatch):
    def broken(*args, **kwargs):
        raise NotImplementedError("no Triton lowering here")

    monkeypatch.setattr(index_conversion, "current_device_capability", lambda: (9, 0))
    monkeypatch.setattr(index_conversion_pallas, "convert", broken)
    index_conversion_pallas.lowering_error.cache_clear()
    try:
        reason = index_conversion.unavailable_reason("pallas")
    finally:
        index_conversion_pallas.lowering_error.cache_clear()
    assert "do not lower" in reason and "no Triton lowering here" in reason


def test_unavailable_reason_names_only_gpu_kernels():
    with pytest.raises(ValueError, match="implementation must be one of"):
        index_conversion.unavailable_reason("xla")
