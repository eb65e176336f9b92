"""The compiled extension `_jax_sparse_mla_native`, when it was built, and its XLA FFI targets.

Importing this module registers every handler of the extension with JAX for the CUDA platform. Without
the extension (no nvcc or no flashinfer-python at install time, see ffi/CMakeLists.txt) `module` is
None, `available()` is False and the package runs its pure-JAX kernels.
"""

from __future__ import annotations

import jax

try:
    from . import _jax_sparse_mla_native as module
except ImportError as error:  # built without CUDA, or not built at all
    module = None
    import_error: ImportError | None = error
else:
    import_error = None
    for _name, _capsule in module.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def available() -> bool:
    """True when the extension is importable (its kernels still need a suitable GPU)."""
    return module is not None


def missing_reason() -> str:
    """Why the extension is unavailable, for error messages and test skips."""
    if module is not None:
        return ""
    return (
        f"the native extension jax_sparse_mla._jax_sparse_mla_native is not built ({import_error}); "
        "install with nvcc and flashinfer-python present: "
        "JAX_SPARSE_MLA_CUDA=ON pip install --no-build-isolation ."
    )
