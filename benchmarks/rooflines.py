"""The GPU's ceilings, measured through torch in the benchmark's own run: a device-to-device copy
and large matrix products, each timed with CUDA events after a warm-up. The buffers are freed on
return (call torch.cuda.empty_cache() to hand the memory back to other allocators)."""

from __future__ import annotations

MATMUL_DIM = 8192
COPY_BYTES = 4 << 30


def _events_seconds(fn, calls: int) -> float:
    """Seconds per call of `calls` back-to-back fn() calls, timed with CUDA events after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def copy_gbps() -> float:
    """Bytes read + written per second of a 4 GiB device-to-device copy (random bytes)."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = _events_seconds(lambda: dst.copy_(src), 10)
    return 2 * COPY_BYTES / seconds / 1e9


def matmul_tflops(dtype: str = "bf16") -> float:
    """TFLOP/s of an 8192^3 product on random data: "bf16" (torch.matmul) or "fp8" (e4m3 x e4m3 with
    fp32 scales and a bf16 result through torch._scaled_mm, the tensor cores' fp8 rate)."""
    import torch

    n = MATMUL_DIM
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    if dtype == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
        fn = lambda: a @ b  # noqa: E731
    elif dtype == "fp8":
        a = a.to(torch.float8_e4m3fn)
        b = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device="cuda")
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
    seconds = _events_seconds(fn, 10)
    return 2 * n ** 3 / seconds / 1e12
