"""examples/generate.py's decode loop (the tiny preset, pure JAX on the CPU): one jitted call of N
decode steps (make_decode_step with steps=N, a lax.scan feeding each greedy token back on the device)
gives exactly what N calls of one step give, keeps the donated caches in place, and the example runs
with --steps-per-call and prints the tokens it prints with one step per call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from jax_sparse_mla.flax import TINY  # noqa: E402

from decoder_example import VOCAB, build, prefill_all  # noqa: E402
from decoder_example import example as load_example  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.fixture(scope="module")
def prefilled():
    """Two requests, one prompt longer than index_topk = 128 (the indexer selects), prefilled;
    (graphdef, state, layout, caches, the next positions)."""
    graphdef, state, layout, caches = build(TINY, 2, 256)
    rng = np.random.default_rng(0)
    lens = (150, 37)
    for request, n in enumerate(lens):
        prompt = rng.integers(0, VOCAB, n).astype(np.int32)
        _, _, caches = prefill_all(TINY, graphdef, state, layout, caches, prompt, request, 64)
    return graphdef, state, layout, caches, jnp.asarray(lens, jnp.int32)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)  # the step donates its caches


def test_steps_per_call_equal_single_steps(example, prefilled):
    graphdef, state, layout, caches, positions = prefilled
    params, treedef = jax.tree.flatten(state)
    tokens = jnp.asarray([3, 500], jnp.int32)

    one = example.make_decode_step(graphdef, treedef, layout, TINY, 1)
    single, t, p, c = [], tokens, positions, copy(caches)
    for _ in range(STEPS):
        generated, t, p, c, topks = one(params, t, p, c)
        assert generated.shape == (1, 2) and (np.asarray(generated[0]) == np.asarray(t)).all()
        single.append(np.asarray(generated[0]))

    many = example.make_decode_step(graphdef, treedef, layout, TINY, STEPS)
    generated, t_n, p_n, c_n, topks_n = many(params, tokens, positions, copy(caches))
    assert generated.shape == (STEPS, 2) and generated.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(generated), np.stack(single))
    assert len(set(np.asarray(generated)[:, 0].tolist())) > 1  # not a constant sequence
    np.testing.assert_array_equal(np.asarray(t_n), single[-1])
    np.testing.assert_array_equal(np.asarray(p_n), np.asarray(positions) + STEPS)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(p_n))
    for a, b in zip(jax.tree.leaves((c, topks)), jax.tree.leaves((c_n, topks_n))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_steps_per_call_keep_the_caches_in_place(example):
    """The scan's carry aliases the donated caches: the N-step call needs no more temporary memory
    than the one-step call plus a small fraction of the caches (a copy would add all of them)."""
    graphdef, state, layout, caches = build(TINY, 2, 4096)
    params, treedef = jax.tree.flatten(state)
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(caches))
    args = (params, jnp.zeros(2, jnp.int32), jnp.asarray([100, 7], jnp.int32), caches)
    temp = {}
    for steps in (1, STEPS):
        compiled = example.make_decode_step(graphdef, treedef, layout, TINY, steps).lower(*args).compile()
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= cache_bytes  # the caches are donated
        temp[steps] = memory.temp_size_in_bytes
    assert temp[STEPS] - temp[1] < cache_bytes / 4, (temp, cache_bytes)


def _generated(output: str) -> str:
    return re.search(r"request 0 generated: (.*)", output).group(1)


def test_example_runs_several_steps_per_call(example, capsys, tmp_path):
    common = ["--batch", "2", "--check-tokens", "2", "--new-tokens", "8", "--implementation", "xla"]
    one = example.main(common)
    one_out = capsys.readouterr().out
    assert one["steps_per_call"] == 1 and one["timed_steps"] == 7 and one["traced_steps"] == 0
    result = example.main([*common, "--steps-per-call", "4", "--trace-dir", str(tmp_path / "trace"),
                           "--json", str(tmp_path / "run.json")])
    out = capsys.readouterr().out
    # 2 calls of 4 steps (the first compiles), then 1 more call of 4 under the profiler.
    assert result["steps_per_call"] == 4 and result["timed_steps"] == 4 and result["traced_steps"] == 4
    assert "check: " in out and "PASS" in out
    assert "decode: " in out and "(batch 2; 4 steps in 1 calls of 4)" in out
    assert "trace: 4 decode steps (1 calls of 4)" in out
    assert list((tmp_path / "trace").glob("**/perfetto_trace.json.gz"))
    assert (tmp_path / "run.json").exists()
    assert _generated(out) == _generated(one_out)  # the same greedy tokens
