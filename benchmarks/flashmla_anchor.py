"""FlashMLA (github.com/deepseek-ai/FlashMLA) beside our kernels, called from torch on the same device
buffers as ours: `bench_sm90.py --flashmla` (and `make gpu-check` where `import flash_mla` works).

FlashMLA is never a dependency of the package: it is built from its public source on the benchmark
machine, outside the tree (docs/benchmarks.md, "SM90 decode beside FlashMLA", has the commands).
Its SM90 sparse kernels, as vLLM runs them for DeepSeek-V3.2:

  bf16 cache        flash_mla_sparse_fwd(q [T, Hp, 576], kv [rows, 1, 576], indices [T, 1, K], scale)
                    (the sparse prefill kernel; FlashMLA has no sparse bf16 decode kernel)
  fp8_ds_mla cache  flash_mla_with_kvcache(q [T, 1, Hp, 576], cache [rows / 64, 64, 1, 656], ...,
                    is_fp8_kvcache=True, indices [T, 1, K]): the T tokens as T requests of one query
                    token each, so that its persistent grid and split scheduler run as in decode

Hp: the heads padded to 64 or 128 (FlashMLA's kernels take no other count; the padded rows are
computed and dropped, as a server padding 16 heads would). The index sets are ours: flat rows of the
cache (= block * 64 + offset), every entry valid (FlashMLA reads only -1 as a hole).

Timing: the sum of the CUDA kernels' durations per call from torch's profiler (CUPTI), the median
over calls, as timing.device_times does for ours; FlashMLA's decode is two kernels (the split
attention and the combine), both counted.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("bf16", "fp8_ds_mla")


def padded_heads(num_heads: int) -> int | None:
    """The head count FlashMLA's SM90 sparse kernels run for `num_heads` (64 or 128), or None."""
    if num_heads <= 64:
        return 64
    if num_heads <= 128:
        return 128
    return None


def why_not(kv_dtype: str, num_heads: int, top_k: int) -> str | None:
    """None when FlashMLA has an SM90 sparse kernel for this row, else why not."""
    if kv_dtype not in LAYOUTS:
        return f"no FlashMLA SM90 sparse kernel for a {kv_dtype} cache"
    if padded_heads(num_heads) is None:
        return f"{num_heads} heads: FlashMLA's sparse kernels take at most 128"
    multiple = 128 if kv_dtype == "bf16" else 64
    if top_k % multiple:
        return f"K = {top_k}: FlashMLA's {kv_dtype} kernel needs a multiple of {multiple}"
    return None


def flashmla_indices(sets: np.ndarray, num_rows: int) -> np.ndarray:
    """[S, T, K] int32 flat cache rows -> FlashMLA's indices [S, T, 1, K]: every entry outside
    [0, num_rows) becomes exactly -1, the only hole FlashMLA's fp8 decode kernel recognises (any
    other value is read as a row address)."""
    sets = np.asarray(sets)
    valid = (sets >= 0) & (sets < num_rows)
    return np.where(valid, sets, -1).astype(np.int32)[:, :, None, :]


class TorchFlashMLA:
    """FlashMLA's SM90 sparse kernels from torch, on JAX's device buffers (shared through DLPack)."""

    def __init__(self):
        import flash_mla
        import torch

        self.torch = torch
        self.flash_mla = flash_mla

    def as_torch(self, array):
        return self.torch.from_dlpack(array)

    def runner(self, q, cache, sets, kv_dtype: str, scale: float):
        """(run, out_of_first_set): run(i) makes one call over index set i % S; out_of_first_set()
        the [T, H, 512] bf16 output of set 0 as a JAX array (for the cross-check)."""
        torch = self.torch
        num_tokens, num_heads, _ = q.shape
        heads = padded_heads(num_heads)
        q_t = self.as_torch(q)
        if heads != num_heads:
            q_t = torch.nn.functional.pad(q_t, (0, 0, 0, heads - num_heads))
        q_t = q_t.contiguous()
        rows = int(cache.shape[0])
        indices = [torch.from_numpy(s).to("cuda") for s in flashmla_indices(np.asarray(sets), rows)]
        if kv_dtype == "bf16":
            kv = self.as_torch(cache).view(rows, 1, cache.shape[-1])

            def call(i):
                out, _, _ = self.flash_mla.flash_mla_sparse_fwd(q_t, kv, indices[i % len(indices)],
                                                                scale, 512)
                return out
        else:
            kv = self.as_torch(cache).view(rows // 64, 64, 1, cache.shape[-1])
            q_decode = q_t.view(num_tokens, 1, heads, q_t.shape[-1])
            metadata, _ = self.flash_mla.get_mla_metadata()  # filled by the first call, then reused

            def call(i):
                out, _ = self.flash_mla.flash_mla_with_kvcache(
                    q_decode, kv, None, None, 512, metadata, None, softmax_scale=scale,
                    causal=False, is_fp8_kvcache=True,
                    indices=indices[i % len(indices)].view(num_tokens, 1, -1))
                return out.view(num_tokens, heads, 512)

        def first():
            out = call(0)[:, :num_heads].contiguous()
            torch.cuda.synchronize()
            return jnp.asarray(np.asarray(out.float().cpu()), jnp.bfloat16)

        return call, first

    def device_seconds(self, call, calls: int = 20) -> float:
        """Median over `calls` calls of the sum of each call's CUDA kernel durations (torch's
        profiler), after two warm-up calls (FlashMLA's decode builds its schedule on the first)."""
        torch = self.torch
        call(0)
        call(1)
        torch.cuda.synchronize()
        per_call = []
        for i in range(calls):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                call(i)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            per_call.append(sum(e.time_range.elapsed_us() for e in kernels) * 1e-6)
        return statistics.median(per_call)


def max_relative_error(ours: jax.Array, theirs: jax.Array) -> float:
    """max |ours - theirs| / max |ours| over the output (fp32)."""
    ours = np.asarray(ours, np.float32)
    theirs = np.asarray(theirs, np.float32)
    return float(np.max(np.abs(ours - theirs)) / max(float(np.max(np.abs(ours))), 1e-30))
