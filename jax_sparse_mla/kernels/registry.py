"""The kernel registry: which implementation of the sparse-MLA decode kernel (and of each indexer op)
runs where.

Every kernel has the same contract, so the public op does its argument checking and scale folding
once and then hands over:

    out, lse = kernel.fn(q, kv_cache, indices, valid_counts, *, bmm1_scale, bmm2_scale, lse_base)

    q:          [T, H, 576] bf16 / f16, or float8_e4m3fn (raw values; q_scale is folded into bmm1_scale)
    kv_cache:   [num_blocks, block_size, 576] bf16 / f16 / float8_e4m3fn, or uint8 [.., 656] (fp8_ds_mla)
    indices:    [T, K] int32 physical slots (block * block_size + offset), as the caller gave them:
                negative entries and entries >= num_blocks * block_size are invalid and must never be
                read; holes may sit anywhere in a row. A kernel that wants every invalid entry as -1
                calls `sanitize_indices` (the SM90 kernel does the same test in its packing kernel).
    valid_counts: [T] int32 or None: row t uses only its first valid_counts[t] entries (clamped to
                [0, K]).
    bmm1_scale: float, applied to the raw dot products q . kv[:576]
    bmm2_scale: float, applied to the output (the per-tensor k_scale of an fp8 cache, else 1.0)
    lse_base:   "e" or "2"
    out:        [T, H, 512], bf16 for bf16 / fp8 queries, f16 for f16 queries
    lse:        [T, H] float32. A row with no valid index has out = 0 and lse = -inf.

A kernel is chosen at trace time from the device that JAX computes on (platform and CUDA compute
capability), the cache layout, the query dtype and, for kernels with shape limits, the problem's
static shapes (`Problem`, checked by the kernel's `check`). The pure-JAX kernel runs everywhere and is
the reference.

The lightning-indexer ops (ops/indexer_cache.py, ops/indexer.py) are registered the same way, one list
per op name (`OpKernel`, `register_op_kernel`, `select_op_kernel`): each op registers its pure-JAX
implementation, and a native kernel registered later under the same op name takes over on the devices
it fits, with the same `implementation=` semantics. Both registries pick through `_choose`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp

from . import availability

IMPLEMENTATIONS = ("auto", "xla", "native")


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one decode call that a native kernel may reject.

    num_tokens: T (all leading dims of q flattened); num_heads: H; num_keys: K (top-k width);
    block_size: the cache's second dim; kv_layout: as in SparseMLAKernel; q_dtype: dtype name.
    """

    num_tokens: int
    num_heads: int
    num_keys: int
    block_size: int
    kv_layout: str
    q_dtype: str


@dataclasses.dataclass(frozen=True)
class SparseMLAKernel:
    """One implementation of the decode kernel.

    name:            short name shown in errors and benchmarks ("xla", "sm90_flashinfer_fa3", ...).
    native:          True for custom-call kernels that need a GPU and the compiled extension.
    capability_majors: CUDA compute-capability majors it runs on; empty means any device.
    kv_layouts:      cache layouts it accepts: "bfloat16", "float16", "fp8_e4m3", "fp8_ds_mla".
    q_dtypes:        query dtype names it accepts.
    fn:              the kernel (contract in the module docstring).
    available:       whether it can run in this process (extension built and loaded).
    check:           optional check(problem, (major, minor)) -> None, or the reason the kernel cannot
                     run this problem on this device (shape limits, dtype pairing, built targets).
    validated:       False for a native kernel that has not yet passed its GPU tests on the hardware
                     it targets: implementation="native" runs it, "auto" passes it over (and says so).
    slower_than_pure_jax: optional slower_than_pure_jax(problem) -> None, or the measurement by which
                     this kernel lost to the pure-JAX kernel on problems of this shape class on its
                     GPU: "auto" then passes it over, "native" still runs it.
    """

    name: str
    native: bool
    capability_majors: tuple[int, ...]
    kv_layouts: tuple[str, ...]
    q_dtypes: tuple[str, ...]
    fn: Callable
    available: Callable[[], bool] = lambda: True
    check: Callable[[Problem, tuple[int, int]], str | None] | None = None
    validated: bool = True
    slower_than_pure_jax: Callable[[Problem], str | None] | None = None


_KERNELS: list[SparseMLAKernel] = []


def sanitize_indices(indices: jax.Array, num_slots: int, valid_counts: jax.Array | None) -> jax.Array:
    """Marks every entry that must not be attended with -1.

    indices: [T, K] int32 physical slots. Invalid: negative, >= num_slots, or (when valid_counts
    [T] int32 is given) at a position >= valid_counts[t]. Counts outside [0, K] act as clamped.
    """
    valid = (indices >= 0) & (indices < num_slots)
    if valid_counts is not None:
        positions = jnp.arange(indices.shape[1], dtype=jnp.int32)
        valid &= positions[None, :] < valid_counts[:, None]
    return jnp.where(valid, indices, -1)


def mask_empty_rows(out: jax.Array, lse: jax.Array, empty_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out [T, H, D] = 0 and lse [T, H] = -inf where empty_rows [T] bool: the contract's value for rows
    with no valid index, for kernels that leave such rows undefined (as vLLM masks after TRTLLM-gen)."""
    empty = empty_rows[:, None]
    return (jnp.where(empty[..., None], jnp.zeros((), out.dtype), out),
            jnp.where(empty, -jnp.inf, lse))


def token_pieces(num_tokens: int, max_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering `num_tokens` tokens in pieces of at most `max_tokens`, as even as
    possible: all but the last have the same size, so a piecewise kernel traces at most two shapes."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if num_tokens <= max_tokens:
        return [(0, num_tokens)]
    size = -(-num_tokens // -(-num_tokens // max_tokens))
    return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]


def in_token_pieces(kernel: Callable[..., tuple[jax.Array, jax.Array]], max_tokens: int,
                    q: jax.Array, indices: jax.Array, valid_counts: jax.Array | None,
                    ) -> tuple[jax.Array, jax.Array]:
    """Runs kernel(q, indices, valid_counts) -> (out [T, H, D], lse [T, H]) once per piece of at most
    `max_tokens` tokens (`token_pieces`) and concatenates the results: for kernels whose launch or
    plan bounds the tokens of one call. Tokens are independent, so the result is the whole call's."""
    pieces = token_pieces(q.shape[0], max_tokens)
    if len(pieces) == 1:
        return kernel(q, indices, valid_counts)
    results = [kernel(q[a:b], indices[a:b], None if valid_counts is None else valid_counts[a:b])
               for a, b in pieces]
    return (jnp.concatenate([out for out, _ in results]),
            jnp.concatenate([lse for _, lse in results]))


def register_kernel(kernel: SparseMLAKernel) -> None:
    """Adds a kernel; native kernels registered later take precedence for their devices."""
    if any(k.name == kernel.name for k in _KERNELS):
        raise ValueError(f"a kernel named {kernel.name!r} is already registered.")
    _KERNELS.append(kernel)


def registered_kernels() -> tuple[SparseMLAKernel, ...]:
    return tuple(_KERNELS)


def current_device_capability() -> tuple[int, int] | None:
    """(major, minor) of the default device when it is a CUDA GPU, else None."""
    return availability.cuda_capability(jax.devices()[0])


def device_sm_count() -> int:
    """Streaming multiprocessors of the default device (for the native kernels' static plans)."""
    count = getattr(jax.devices()[0], "core_count", None)
    if not count:
        raise RuntimeError("a native kernel needs the GPU's SM count (jax Device.core_count)")
    return int(count)


def _device_reason(capability: tuple[int, int] | None,
                   capability_majors: tuple[int, ...]) -> str | None:
    """Why a native kernel built for `capability_majors` cannot run on a device of `capability`."""
    if capability is None:
        return "the default device is not a CUDA GPU"
    if capability[0] not in capability_majors:
        return (f"needs compute capability major {capability_majors}, "
                f"device has {capability[0]}.{capability[1]}")
    return None


def _build_reason(available: Callable[[], bool], check: Callable | None, problem: Any,
                  capability: tuple[int, int]) -> str | None:
    """Why a kernel that suits the device still cannot run: not built, or the problem's shapes."""
    if not available():
        return "the native extension is not built or failed to load"
    if problem is not None and check is not None:
        return check(problem, capability)
    return None


_Kernel = TypeVar("_Kernel")
# Why "auto" passes over a kernel registered with validated=False.
UNVALIDATED = ("not validated on its GPU (implementation='native' runs it where it fits and no kernel "
               "registered after it does)")


def _choose(kernels: Sequence[_Kernel], implementation: str, reason: Callable[[_Kernel], str | None],
            subject: str = "") -> _Kernel:
    """The selection rule both registries share.

    kernels: the candidates in registration order, exactly one of them pure JAX (native=False); later
    native kernels win. reason(kernel) is None when a native kernel can run this call, else why not.
    "xla" returns the pure-JAX kernel, "auto" the last validated native kernel that fits or else the
    pure-JAX one, "native" the last native kernel that fits (validated or not) or a ValueError listing
    every candidate's reason. When "auto" falls back for an op that has native kernels, and no native
    kernel can run in this process on a machine with an NVIDIA GPU, the first such fallback warns
    (availability.warn_once).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
    fallback = next(k for k in kernels if not k.native)
    if implementation == "xla":
        return fallback
    reasons = []
    for kernel in reversed(kernels):
        if not kernel.native:
            continue
        why = UNVALIDATED if implementation == "auto" and not kernel.validated else reason(kernel)
        if why is None:
            return kernel
        reasons.append(f"{kernel.name}: {why}")
    if implementation == "native":
        detail = "; ".join(reasons) if reasons else "no native kernel is registered"
        raise ValueError(
            f"implementation='native' was requested{subject} but no native kernel fits: {detail}.")
    if reasons:
        availability.warn_once()
    return fallback


def rejection_reason(kernel: SparseMLAKernel, kv_layout: str, q_dtype_name: str,
                     problem: Problem | None = None) -> str | None:
    """Why the native `kernel` cannot run this call on the default device, or None when it can."""
    capability = current_device_capability()
    reason = _device_reason(capability, kernel.capability_majors)
    if reason is not None:
        return reason
    if kv_layout not in kernel.kv_layouts:
        return f"kv layout {kv_layout!r} not in {kernel.kv_layouts}"
    if q_dtype_name not in kernel.q_dtypes:
        return f"query dtype {q_dtype_name} not in {kernel.q_dtypes}"
    return _build_reason(kernel.available, kernel.check, problem, capability)


def auto_rejection_reason(kernel: SparseMLAKernel, kv_layout: str, q_dtype_name: str,
                          problem: Problem | None = None) -> str | None:
    """Why implementation="auto" does not run the validated native `kernel` for this call: it cannot
    (rejection_reason), or it measured slower than pure JAX on problems like this one."""
    why = rejection_reason(kernel, kv_layout, q_dtype_name, problem)
    if why is None and problem is not None and kernel.slower_than_pure_jax is not None:
        why = kernel.slower_than_pure_jax(problem)
    return why


def select_kernel(kv_layout: str, q_dtype_name: str, implementation: str = "auto",
                  problem: Problem | None = None) -> SparseMLAKernel:
    """Picks the kernel for this device, cache layout and query dtype.

    implementation: "auto" (a validated native kernel when one fits and has not measured slower than
    pure JAX for this shape, else pure JAX), "xla" (always pure JAX) or "native" (a native kernel,
    or a clear error saying why none fits).
    problem: the call's static shapes, checked by kernels that have limits (None skips the checks).
    """
    reason = auto_rejection_reason if implementation == "auto" else rejection_reason
    return _choose(_KERNELS, implementation,
                   lambda kernel: reason(kernel, kv_layout, q_dtype_name, problem))


# --- the indexer ops ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IndexerProblem:
    """The static description of one indexer-op call that a native kernel may reject.

    op: the public function's name. Fields an op does not have are 0 (next_n: 1).
    num_rows:   rows of the result: T keys written, R gathered rows, M query tokens, B * next_n
                decode rows, R logits rows of a top-k.
    num_heads:  H (logits ops).
    num_keys:   keys per row: the cache's slots (writer), num_tokens (gather), N (fp8_mqa_logits),
                max_context_len (fp8_paged_mqa_logits), S (top-k).
    batch:      requests: R (gather), B (paged logits, decode top-k).
    next_n:     query tokens per request (paged logits, decode top-k).
    top_k:      k (top-k ops).
    block_size: the index cache's tokens per block (writer, gather, paged logits).
    dtypes:     the array arguments' dtype names, in signature order.
    """

    op: str
    num_rows: int = 0
    num_heads: int = 0
    num_keys: int = 0
    batch: int = 0
    next_n: int = 1
    top_k: int = 0
    block_size: int = 0
    dtypes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class OpKernel:
    """One implementation of a named op other than the decode kernel (the indexer ops).

    op:               the public function's name ("fp8_paged_mqa_logits", ...); fn takes that function's
                      checked arguments (its static sizes as keywords, no `implementation`) and returns
                      its result, with the semantics in the public docstring.
    name:             short name shown in errors ("xla", "sm90_deepgemm", ...).
    native, capability_majors, available: as in SparseMLAKernel.
    check:            optional check(problem: IndexerProblem, (major, minor)) -> None or the reason.
    validated:        as in SparseMLAKernel.
    slower_here:      optional slower_here(problem) -> None, or the measurement by which this kernel
                      lost to another validated kernel of the op (registered before it) on problems of
                      this shape on its GPU: "auto" then passes it over, "native" still runs it.
    """

    op: str
    name: str
    native: bool
    capability_majors: tuple[int, ...]
    fn: Callable
    available: Callable[[], bool] = lambda: True
    check: Callable[[IndexerProblem, tuple[int, int]], str | None] | None = None
    validated: bool = True
    slower_here: Callable[[IndexerProblem], str | None] | None = None


_OP_KERNELS: dict[str, list[OpKernel]] = {}


def register_op_kernel(kernel: OpKernel) -> None:
    """Adds an implementation of kernel.op; native kernels registered later take precedence."""
    kernels = _OP_KERNELS.setdefault(kernel.op, [])
    if any(k.name == kernel.name for k in kernels):
        raise ValueError(f"a kernel named {kernel.name!r} is already registered for {kernel.op}.")
    if not kernel.native and any(not k.native for k in kernels):
        raise ValueError(f"{kernel.op} already has a pure-JAX kernel.")
    kernels.append(kernel)


def registered_op_kernels(op: str | None = None) -> tuple[OpKernel, ...]:
    """The kernels registered for `op` (all ops when None), in registration order."""
    if op is not None:
        return tuple(_OP_KERNELS.get(op, ()))
    return tuple(k for kernels in _OP_KERNELS.values() for k in kernels)


def op_rejection_reason(kernel: OpKernel, problem: IndexerProblem | None = None) -> str | None:
    """Why the native op `kernel` cannot run this call on the default device, or None when it can."""
    capability = current_device_capability()
    reason = _device_reason(capability, kernel.capability_majors)
    if reason is not None:
        return reason
    return _build_reason(kernel.available, kernel.check, problem, capability)


def op_auto_rejection_reason(kernel: OpKernel, problem: IndexerProblem | None = None) -> str | None:
    """Why implementation="auto" does not run the validated native op `kernel` for this call: it
    cannot (op_rejection_reason), or another kernel of the op measured faster on problems like this."""
    why = op_rejection_reason(kernel, problem)
    if why is None and problem is not None and kernel.slower_here is not None:
        why = kernel.slower_here(problem)
    return why


def select_op_kernel(op: str, implementation: str = "auto",
                     problem: IndexerProblem | None = None) -> OpKernel:
    """Picks the implementation of `op` for this device (the rules of select_kernel)."""
    if op not in _OP_KERNELS:
        raise KeyError(f"no kernel is registered for the op {op!r}.")
    reason = op_auto_rejection_reason if implementation == "auto" else op_rejection_reason
    return _choose(_OP_KERNELS[op], implementation, lambda kernel: reason(kernel, problem),
                   f" for {op}")
