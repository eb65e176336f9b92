"""What the native-kernel tests need, and how they skip (or fail) without it.

JAX_SPARSE_MLA_REQUIRE_NATIVE=1 turns "the extension is not built" into a failure (CI, which builds
it); JAX_SPARSE_MLA_REQUIRE_GPU=1 turns "no suitable GPU" into a failure (the GPU machine).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from jax_sparse_mla.kernels import native, registry


def require_native():
    """The extension module, or a skip (a failure under JAX_SPARSE_MLA_REQUIRE_NATIVE=1)."""
    if native.module is None:
        if os.environ.get("JAX_SPARSE_MLA_REQUIRE_NATIVE") == "1":
            pytest.fail(f"JAX_SPARSE_MLA_REQUIRE_NATIVE=1 but {native.missing_reason()}")
        pytest.skip(native.missing_reason())
    return native.module


def sm90_skip_reason(*targets: str) -> str:
    """"" when an SM90 GPU and an extension with `targets` are present, else why the tests skip."""
    if not native.available():
        return native.missing_reason()
    capability = registry.current_device_capability()
    if capability is None:
        return "needs a CUDA GPU (the default device is not one)"
    if capability[0] != 9:
        return f"needs an SM90 GPU, the device has compute capability {capability}"
    for target in targets:
        if not native.has_target(target):
            return f"the extension was built without the target {target}"
    return ""


def gpu_test_marks(reason: str, what: str) -> list:
    """The `pytestmark` of a GPU test module that cannot run for `reason` ("" when it can); raises
    under JAX_SPARSE_MLA_REQUIRE_GPU=1 instead of skipping."""
    if reason and os.environ.get("JAX_SPARSE_MLA_REQUIRE_GPU") == "1":
        raise RuntimeError(f"JAX_SPARSE_MLA_REQUIRE_GPU=1 but {what} cannot run: {reason}")
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reason), reason=reason or "-")]


def compile_host_program(source: str, work: pathlib.Path) -> pathlib.Path:
    """Compiles the C++17 `source` (with ffi/ on the include path, so it can include our host-side
    headers) into an executable in `work`; a skip without a C++ compiler (a failure under
    JAX_SPARSE_MLA_REQUIRE_NATIVE=1, as in CI)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        if os.environ.get("JAX_SPARSE_MLA_REQUIRE_NATIVE") == "1":
            pytest.fail("JAX_SPARSE_MLA_REQUIRE_NATIVE=1 but no C++ compiler is on PATH")
        pytest.skip("needs a C++ compiler (c++ or g++) on PATH")
    ffi_dir = pathlib.Path(__file__).resolve().parents[2] / "ffi"
    (work / "program.cc").write_text(source)
    subprocess.run([compiler, "-std=c++17", "-O2", f"-I{ffi_dir}", str(work / "program.cc"), "-o",
                    str(work / "program")], check=True, capture_output=True)
    return work / "program"
