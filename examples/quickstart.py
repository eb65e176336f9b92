"""The smallest end-to-end use of jax-sparse-mla: write a paged MLA cache, convert request-local top-k
positions to physical slots, and run sparse MLA decode under jax.jit, checked against dense attention
over the same selection. Runs on CPU in seconds: `python examples/quickstart.py`."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm

NUM_HEADS, BLOCK_SIZE, TOPK = 16, 64, 128
SCALE = 192 ** -0.5  # DeepSeek-V3.2's softmax scale without YaRN


def main() -> None:
    rng = np.random.default_rng(0)
    seq_lens = np.array([100, 37, 250], np.int32)  # three requests decoding one token each
    blocks = -(-seq_lens // BLOCK_SIZE)
    block_table = np.zeros((3, blocks.max()), np.int32)
    starts = np.concatenate([[1], 1 + np.cumsum(blocks)[:-1]])  # block 0 stays unused
    for r in range(3):
        block_table[r, : blocks[r]] = starts[r] + np.arange(blocks[r])
    cache = jnp.zeros((1 + blocks.sum(), BLOCK_SIZE, 576), jnp.bfloat16)

    # Write every request's latent KV (kv_c [n, 512], k_pe [n, 64]) at its slots.
    for r, n in enumerate(seq_lens):
        positions = np.arange(n)
        slots = block_table[r, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_c = jnp.asarray(rng.standard_normal((n, 512)), jnp.bfloat16)
        k_pe = jnp.asarray(rng.standard_normal((n, 64)), jnp.bfloat16)
        cache = jsm.concat_and_cache_mla(kv_c, k_pe, cache, jnp.asarray(slots, jnp.int32))

    # The indexer's output: up to TOPK request-local positions per token, -1 where there are fewer.
    topk = np.full((3, TOPK), -1, np.int32)
    for r, n in enumerate(seq_lens):
        chosen = rng.choice(n, min(n, TOPK), replace=False)
        topk[r, : chosen.size] = chosen
    q = jnp.asarray(rng.standard_normal((3, NUM_HEADS, 576)), jnp.bfloat16)

    @jax.jit
    def decode(q, cache, block_table, topk):
        req_ids = jnp.arange(3, dtype=jnp.int32)  # token t belongs to request t
        slots = jsm.convert_req_index_to_global_index(req_ids, block_table, topk, block_size=BLOCK_SIZE)
        return jsm.sparse_mla_decode(q, cache, slots, scale=SCALE)

    out, lse = decode(q, cache, jnp.asarray(block_table), jnp.asarray(topk))

    # Dense attention over the same selection, in float64.
    rows = np.asarray(cache, np.float64).reshape(-1, 576)
    worst = 0.0
    for r in range(3):
        chosen = topk[r][topk[r] >= 0]
        keys = rows[block_table[r, chosen // BLOCK_SIZE] * BLOCK_SIZE + chosen % BLOCK_SIZE]
        logits = np.asarray(q[r], np.float64) @ keys.T * SCALE
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        expected = (weights / weights.sum(-1, keepdims=True)) @ keys[:, :512]
        worst = max(worst, np.abs(np.asarray(out[r], np.float64) - expected).max())
    print(f"out {out.shape} {out.dtype}, lse {lse.shape}; max |error| vs float64 dense: {worst:.2e}")
    if worst > 2e-2:
        raise SystemExit("sparse attention does not match dense attention over the selection")


if __name__ == "__main__":
    main()
