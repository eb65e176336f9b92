"""The compiled extension `_jax_sparse_mla_native`, when it was built, and its XLA FFI targets.

Importing this module registers every handler of the extension with JAX for the CUDA platform. Without
the extension (no nvcc or no flashinfer-python at install time, see ffi/CMakeLists.txt) `module` is
None, `available()` is False and the package runs its pure-JAX kernels.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib

import jax
from jaxlib import xla_client

try:
    from .. import _jax_sparse_mla_native as module
except ImportError as error:  # built without CUDA, or not built at all
    module = None
    import_error: ImportError | None = error
else:
    import_error = None
    _command_buffer_targets = frozenset(module.command_buffer_targets())
    for _name, _capsule in module.registrations().items():
        # The trait lets XLA record the call in a command buffer (CUDA graph); without it XLA runs
        # the custom call outside, whatever the handler symbol declares.
        _traits = (xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
                   if _name in _command_buffer_targets else xla_client.CustomCallTargetTraits.DEFAULT)
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA", traits=_traits)

# Names of the XLA FFI targets the extension registered (empty without it).
targets: frozenset[str] = frozenset(module.registrations()) if module is not None else frozenset()


def flashinfer_cubin_package_dir() -> str:
    """The flashinfer-cubin package's cubins/ folder when its version is the one the SM100 family needs.

    The TRTLLM-gen handler is compiled against the kernel table of one flashinfer-cubin release
    (build_info()["trtllm_gen_flashinfer_version"], ffi/sm100/trtllm_gen_table.py); a package of another
    version holds another artifact and is ignored unless FLASHINFER_DISABLE_VERSION_CHECK is set
    (FlashInfer's rule, flashinfer/jit/env.py). The loader checks each cubin's sha256 against the table
    either way. Found without importing the package.
    """
    if module is None:
        return ""
    wanted = dict(module.build_info()).get("trtllm_gen_flashinfer_version", "")
    spec = importlib.util.find_spec("flashinfer_cubin")
    if not wanted or spec is None or not spec.submodule_search_locations:
        return ""
    try:
        cubin_version = importlib.metadata.version("flashinfer-cubin")
    except importlib.metadata.PackageNotFoundError:
        return ""
    if cubin_version != wanted and not os.environ.get("FLASHINFER_DISABLE_VERSION_CHECK"):
        return ""
    return str(pathlib.Path(next(iter(spec.submodule_search_locations))) / "cubins")


if module is not None:
    module.set_cubin_package_dir(flashinfer_cubin_package_dir())


def build_config() -> dict:
    """jax_sparse_mla/_build_config.json, written by the install's CMake step: what was built, or
    {"native": false, "reason": ...} (ffi/CMakeLists.txt); {} in a source tree."""
    path = pathlib.Path(__file__).resolve().parent.parent / "_build_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def build_info() -> dict:
    """What the extension was built with (module.build_info(); {} without the extension)."""
    if module is None:
        return {}
    return dict(module.build_info())


def has_target(name: str) -> bool:
    """True when the extension registered the XLA FFI target `name`."""
    return name in targets


def built_for(family: str, capability: tuple[int, int]) -> bool:
    """Whether the `family` handlers ("sm90", "sm100", "sm120") hold machine code for `capability`."""
    gencode = build_info().get(family, "")
    return f"{capability[0]}{capability[1]}a" in gencode.split(",")


def available() -> bool:
    """True when the extension is importable (its kernels still need a suitable GPU)."""
    return module is not None


def missing_reason() -> str:
    """Why the extension is unavailable, for error messages and test skips."""
    if module is not None:
        return ""
    package = pathlib.Path(__file__).resolve().parent.parent
    if not list(package.glob("_jax_sparse_mla_native*")):
        why = f"there is no compiled extension in {package}"
        if (package.parent / "ffi" / "CMakeLists.txt").is_file():
            why += " (a source checkout: use the installed package, e.g. run from another folder)"
    else:
        why = f"it failed to load: {import_error}"
    return (
        f"the native extension jax_sparse_mla._jax_sparse_mla_native is unavailable: {why}; "
        "it is built by `pip install .` on a machine with nvcc (JAX_SPARSE_MLA_CUDA=ON makes a "
        "missing toolchain an error)"
    )
