"""`python -m jax_sparse_mla`: what this installation holds and what each op would run here.

Prints the versions (Python, jax, jaxlib, the FlashInfer headers the extension was built against), the
default device, the native kernel families the extension holds and their machine code, and for this
machine the implementation each public op would dispatch to under implementation="auto", with the
registry's reason for every native kernel it passed over. On a machine with an NVIDIA GPU where no
native kernel can run (a CPU-only jaxlib, no extension, or one built for other GPU families) it says
so in one line with the command that fixes it (kernels/availability.py), before the dispatch table.
"""

from __future__ import annotations

import importlib.metadata
import platform

import jax

from . import __version__
from .kernels import availability, native, registry
from .ops import index_conversion

# A DeepSeek-V3.2 decode step (128 heads, top-k 2048, block size 64): the shapes the per-kernel
# checks see when the dispatch table is printed.
_EXAMPLE_PROBLEM = dict(num_tokens=128, num_heads=128, num_keys=2048, block_size=64)
_CACHE_LAYOUTS = (("bf16", "bfloat16"), ("fp8 (e4m3)", "fp8_e4m3"), ("fp8_ds_mla", "fp8_ds_mla"))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_line() -> str:
    device = jax.devices()[0]
    line = f"{device.platform} ({device.device_kind}"
    capability = registry.current_device_capability()
    if capability is not None:
        line += f", compute capability {capability[0]}.{capability[1]}"
    return line + f"), {jax.device_count()} device(s)"


def _extension_lines() -> list[str]:
    config = native.build_config()
    if native.module is None:
        reason = config.get("reason") or native.missing_reason()
        return [f"native extension: not built, pure JAX only ({reason})"]
    info = native.build_info()
    lines = ["native extension: built"
             + (f" against jaxlib {config['jaxlib']} and CUDA {config['cuda']}; FlashInfer "
                f"{config['flashinfer']} headers (sm90, sm120)" if config.get("native") else "")]
    families = {"sm90": "SM90 (H100/H200)", "sm100": "SM100/SM103 TRTLLM-gen (B200/B300)",
                "sm120": "SM120/SM121 (RTX Pro 6000, DGX Spark)"}
    for family, name in families.items():
        if family in info:
            codes = ", ".join(f"sm_{code}" for code in info[family].split(","))
            lines.append(f"  {family:6s} {name}: machine code {codes}")
    if "sm100" in info:
        lines.append(f"  TRTLLM-gen kernel table {info['trtllm_gen_metainfo_hash']} "
                     f"({info['trtllm_gen_num_kernels']} kernels), FlashInfer "
                     f"{info['trtllm_gen_flashinfer_version']} launcher")
        cubins = native.flashinfer_cubin_package_dir()
        lines.append(f"  TRTLLM-gen cubins: {cubins}" if cubins else
                     f"  TRTLLM-gen cubins: flashinfer-cubin=={info['trtllm_gen_flashinfer_version']} "
                     "is not installed (FLASHINFER_CUBIN_DIR or FlashInfer's cache are searched at "
                     "run time; pip install \"jax-sparse-mla[sm100]\" installs it)")
    return lines


def _dispatch_lines(label: str, natives: list, reason) -> list[str]:
    """`label: <kernel>` for the first validated native kernel (in precedence order) whose
    reason(kernel) is None, else pure JAX, then one line per native kernel passed over with why."""
    chosen, passed_over = "xla (pure JAX)", []
    for kernel in natives:
        why = registry.UNVALIDATED if not kernel.validated else reason(kernel)
        if why is None:
            chosen = kernel.name
            break
        passed_over.append(f"      not {kernel.name}: {why}")
    return [f"  {label}: {chosen}"] + passed_over


def _attention_lines() -> list[str]:
    if registry.current_device_capability() is None:
        return [f"  sparse_mla_decode, {label} cache: xla (pure JAX: the default device is not a "
                "CUDA GPU)" for label, _ in _CACHE_LAYOUTS]
    lines = []
    natives = [k for k in reversed(registry.registered_kernels()) if k.native]
    for label, layout in _CACHE_LAYOUTS:
        problem = registry.Problem(**_EXAMPLE_PROBLEM, kv_layout=layout, q_dtype="bfloat16")
        lines += _dispatch_lines(
            f"sparse_mla_decode, {label} cache", natives,
            lambda kernel: registry.auto_rejection_reason(kernel, layout, "bfloat16", problem))
    return lines


def _index_conversion_lines() -> list[str]:
    names = {"pallas": "pallas (Triton)", "native": "native (CUDA)"}
    many = index_conversion.NATIVE_COMPACT_MIN_TOKENS
    cases = [("in place or counts only", index_conversion.auto_order(1, False, 1)),
             (f"compact, T < {many}, no DCP", index_conversion.auto_order(1, True, 1)),
             (f"compact, T >= {many} or DCP", index_conversion.auto_order(many, True, 1))]
    lines = ["  convert_req_index_to_global_index, filter_and_convert_dcp_index:"]
    for label, order in cases:
        chosen, passed_over = "xla (pure JAX)", []
        for name in order:
            why = index_conversion.unavailable_reason(name)
            if why is None:
                chosen = names[name]
                break
            passed_over.append(f"        not {name}: {why}")
        lines += [f"    {label}: {chosen}", *passed_over]
    return lines


def _indexer_lines() -> list[str]:
    lines = []
    ops = dict.fromkeys(k.op for k in registry.registered_op_kernels())
    for op in ops:
        natives = [k for k in reversed(registry.registered_op_kernels(op)) if k.native]
        if natives:
            block = _dispatch_lines(op, natives, registry.op_rejection_reason)
            chosen = next((k for k in natives if block[0].endswith(f": {k.name}")), None)
            if chosen is not None and chosen.slower_here is not None:
                # A shape rule needs the call's shapes: say where "auto" runs another kernel.
                block.append(f"      (not {chosen.name} for {chosen.slower_here.__doc__})")
            lines += block
        else:
            lines.append(f"  {op}: xla (pure JAX: no native kernel is registered for it)")
    return lines


def main() -> None:
    print(f"jax-sparse-mla {__version__}")
    print(f"  Python {platform.python_version()}, jax {_version('jax')}, jaxlib {_version('jaxlib')}, "
          f"flax {_version('flax')}")
    print(f"  default device: {_device_line()}")
    for line in _extension_lines():
        print(line)
    reason = availability.unavailable_reason()
    if reason is not None:
        print(reason)
    shape = ", ".join(f"{k}={v}" for k, v in _EXAMPLE_PROBLEM.items())
    print(f'dispatch here with implementation="auto" (bf16 query, {shape}):')
    for line in _attention_lines() + _index_conversion_lines() + _indexer_lines():
        print(line)


if __name__ == "__main__":
    main()
