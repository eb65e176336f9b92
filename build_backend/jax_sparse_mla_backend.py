"""The PEP 517 backend of jax-sparse-mla: scikit-build-core, plus what the native build needs.

`pip install .` runs the build in an isolated environment that holds only the build requirements.
The native extension needs jax there (its XLA FFI headers) and pip (ffi/flashinfer_headers.py fetches
FlashInfer's headers with it, without torch), but a machine without nvcc builds the pure-JAX package
and should not download jaxlib for nothing. So those requirements are added only when the native
build will run: JAX_SPARSE_MLA_CUDA=ON, or AUTO (the default) with nvcc found where CMake looks.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)

# The handlers are compiled against the XLA FFI headers of this jaxlib, the oldest the package
# supports: an extension built against them loads in every newer jaxlib, while one built against a
# newer jaxlib's headers may not load in an older one.
NATIVE_BUILD_REQUIRES = ["jax==0.10.2", "jaxlib==0.10.2", "pip"]


def _cuda_mode(config_settings: dict | None) -> str:
    setting = (config_settings or {}).get("cmake.define.JAX_SPARSE_MLA_CUDA")
    return str(setting or os.environ.get("JAX_SPARSE_MLA_CUDA", "AUTO")).upper()


def nvcc_path() -> str | None:
    """nvcc where CMake's check_language(CUDA) looks: $CUDACXX, PATH, $CUDA_HOME / $CUDA_PATH,
    /usr/local/cuda."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [str(pathlib.Path(os.environ[name]) / "bin" / "nvcc")
                   for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)]
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def native_build_requested(config_settings: dict | None = None) -> bool:
    mode = _cuda_mode(config_settings)
    if mode == "OFF":
        return False
    return mode == "ON" or nvcc_path() is not None


def _with_native(requires: list[str], config_settings: dict | None) -> list[str]:
    return requires + (NATIVE_BUILD_REQUIRES if native_build_requested(config_settings) else [])


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return _with_native(_scikit_build.get_requires_for_build_wheel(config_settings),
                        config_settings)


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
    return _with_native(_scikit_build.get_requires_for_build_editable(config_settings),
                        config_settings)
