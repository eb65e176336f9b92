"""The PEP 517 backend of jax-sparse-mla: scikit-build-core, plus what the native build needs.

`pip install .` runs the build in an isolated environment that holds only the build requirements.
The native extension needs jax there (its XLA FFI headers) and pip (ffi/flashinfer_headers.py
fetches FlashInfer's headers with it, without torch), but a machine without nvcc or a GPU builds
the pure-JAX package and should not download jaxlib for nothing. So those requirements are added
only when the native build is wanted: JAX_SPARSE_MLA_CUDA=ON, or AUTO (the default) with nvcc found
where CMake looks or an NVIDIA driver present (nvidia-smi answers).

Most JAX GPU users have a driver and no CUDA toolkit (jax[cuda13] brings NVIDIA's runtime wheels).
When the native build is wanted and no system nvcc is found, NVIDIA's compiler and headers from the
package index (PIP_CUDA_TOOLKIT) join the build requirements, and the build hooks point CMake at
that nvcc. JAX_SPARSE_MLA_SYSTEM_NVCC=0 ignores any system nvcc (tests use it to exercise the pip
toolkit on a machine with /usr/local/cuda; it also sidesteps a system toolkit too old for sm100 and
sm120).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)

# The handlers are compiled against the XLA FFI headers of this jaxlib, the oldest the package
# supports: an extension built against them loads in every newer jaxlib, while one built against a
# newer jaxlib's headers may not load in an older one.
NATIVE_BUILD_REQUIRES = ["jax==0.10.2", "jaxlib==0.10.2", "pip"]

# NVIDIA's CUDA 13.0 compiler and headers as wheels, installing a toolkit under
# site-packages/nvidia/cu13/{bin,include,lib,nvvm}: nvcc, ptxas, fatbinary and nvlink (nvcc), cicc
# and libdevice (nvvm), the crt/ headers nvcc includes (crt), cuda_runtime.h and libcudart_static.a
# (runtime), CUB/Thrust/libcu++ (cccl). Every one is pinned: nvidia-cuda-nvcc requires the others
# unpinned, and a 13.0 nvcc with a newer release's headers is a mix NVIDIA never ships. 13.0.88 is
# the nvcc CI builds with; CUDA 13.0 code runs on the drivers jax[cuda13] needs (>= 580).
PIP_CUDA_TOOLKIT = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
]


def _cuda_mode(config_settings: dict | None) -> str:
    setting = (config_settings or {}).get("cmake.define.JAX_SPARSE_MLA_CUDA")
    return str(setting or os.environ.get("JAX_SPARSE_MLA_CUDA", "AUTO")).upper()


def system_nvcc() -> str | None:
    """nvcc where CMake's check_language(CUDA) looks: $CUDACXX, PATH, $CUDA_HOME / $CUDA_PATH,
    /usr/local/cuda. None under JAX_SPARSE_MLA_SYSTEM_NVCC=0."""
    if os.environ.get("JAX_SPARSE_MLA_SYSTEM_NVCC") == "0":
        return None
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [str(pathlib.Path(os.environ[name]) / "bin" / "nvcc")
                   for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)]
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def pip_nvcc() -> str | None:
    """The nvcc of NVIDIA's pip toolkit (PIP_CUDA_TOOLKIT) on this interpreter's sys.path: pip's
    isolated build environment once it has installed them, or an environment with jax[cuda13]."""
    for entry in sys.path:
        nvcc = pathlib.Path(entry or ".") / "nvidia" / "cu13" / "bin" / "nvcc"
        if os.access(nvcc, os.X_OK):
            return str(nvcc)
    return None


def nvcc_path() -> str | None:
    """The nvcc the native build uses: the system's, else the pip toolkit's."""
    return system_nvcc() or pip_nvcc()


def driver_present() -> bool:
    """Whether an NVIDIA driver answers nvidia-smi (it fails without a GPU or a loaded driver)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def native_build_requested(config_settings: dict | None = None) -> bool:
    mode = _cuda_mode(config_settings)
    if mode == "OFF":
        return False
    return mode == "ON" or nvcc_path() is not None or driver_present()


def _with_native(requires: list[str], config_settings: dict | None) -> list[str]:
    if not native_build_requested(config_settings):
        return requires
    return requires + NATIVE_BUILD_REQUIRES + ([] if nvcc_path() else PIP_CUDA_TOOLKIT)


def _with_nvcc(config_settings: dict | None) -> dict:
    """config_settings naming the nvcc found for CMake, so that a pip toolkit is used even where
    /usr/local/cuda exists (JAX_SPARSE_MLA_SYSTEM_NVCC=0) and a -C setting of the caller wins."""
    settings = dict(config_settings or {})
    nvcc = nvcc_path()
    if nvcc and _cuda_mode(settings) != "OFF":
        settings.setdefault("cmake.define.CMAKE_CUDA_COMPILER", nvcc)
    return settings


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return _with_native(_scikit_build.get_requires_for_build_wheel(config_settings),
                        config_settings)


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
    return _with_native(_scikit_build.get_requires_for_build_editable(config_settings),
                        config_settings)


def build_wheel(wheel_directory: str, config_settings: dict | None = None,
                metadata_directory: str | None = None) -> str:
    return _scikit_build.build_wheel(wheel_directory, _with_nvcc(config_settings),
                                     metadata_directory)


def build_editable(wheel_directory: str, config_settings: dict | None = None,
                   metadata_directory: str | None = None) -> str:
    return _scikit_build.build_editable(wheel_directory, _with_nvcc(config_settings),
                                        metadata_directory)
