"""The pip build (build_backend/jax_sparse_mla_backend.py, Makefile) and what it produces.

- What pip's isolated build environment gets, on simulated machines: PATH holds only a folder of
  stand-in nvidia-smi / nvcc scripts, JAX_SPARSE_MLA_SYSTEM_NVCC=0 hides /usr/local/cuda, and no
  pip CUDA toolkit is found (pip's isolated environment has none when the hook answers, while the
  environment running these tests may have jax[cuda13]'s).
  Neither a driver nor nvcc: nothing beyond scikit-build-core and nanobind. nvcc: jax and pip. A
  driver (nvidia-smi answers) or JAX_SPARSE_MLA_CUDA=ON without nvcc: those plus NVIDIA's compiler.
- The build hooks name the nvcc found (the pip toolkit's, once installed) to CMake.
- make installs the CUDA jaxlib where nvidia-smi answers or GPU=1, the CPU one elsewhere or GPU=0.
- The installed extension links only libraries every Linux has (nothing of a CUDA toolkit, nothing
  that only jax[cuda13]'s library path would provide).
- The wheel of `make wheel`, given as $JAX_SPARSE_MLA_WHEEL (skipped, saying so, when unset): a
  manylinux tag, the same linkage, and in a fresh environment whose PATH has no nvcc,
  `python -m jax_sparse_mla` lists the GPU families it was built with.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

from jax_sparse_mla.kernels import native

REPO = pathlib.Path(__file__).resolve().parent.parent
WHEEL_ENV = "JAX_SPARSE_MLA_WHEEL"

# What the extension may link: glibc's and GCC's runtime libraries (all in auditwheel's manylinux
# set). CUDA's runtime is linked statically (CUDA::cudart_static), which opens the driver itself.
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                  "ld-linux-x86-64.so.2", "libdl.so.2", "libpthread.so.0", "librt.so.1"}


def _load_backend():
    spec = importlib.util.spec_from_file_location(
        "jax_sparse_mla_backend", REPO / "build_backend" / "jax_sparse_mla_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


backend = _load_backend()
_pip_nvcc = backend.pip_nvcc


def _script(folder: pathlib.Path, name: str, exit_code: int = 0) -> pathlib.Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine with no driver and no nvcc; returns the PATH folder for stand-in tools."""
    tools = tmp_path / "bin"
    tools.mkdir()
    monkeypatch.setenv("PATH", str(tools))
    for name in ("CUDACXX", "CUDA_HOME", "CUDA_PATH", "JAX_SPARSE_MLA_CUDA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_SPARSE_MLA_SYSTEM_NVCC", "0")
    monkeypatch.setattr(backend, "pip_nvcc", lambda: None)
    monkeypatch.chdir(REPO)  # scikit-build-core reads pyproject.toml from the working folder
    return tools


def _extra_requires(config_settings=None) -> list[str]:
    plain = backend._scikit_build.get_requires_for_build_wheel(config_settings)
    requires = backend.get_requires_for_build_wheel(config_settings)
    assert requires[:len(plain)] == plain
    return requires[len(plain):]


def test_neither_driver_nor_nvcc_downloads_nothing_for_the_native_build(machine):
    assert backend.nvcc_path() is None and not backend.driver_present()
    assert _extra_requires() == []
    _script(machine, "nvidia-smi", exit_code=9)  # installed, but no GPU or no driver loaded
    assert _extra_requires() == []


def test_driver_without_nvcc_adds_jax_and_nvidias_compiler(machine):
    _script(machine, "nvidia-smi")
    assert _extra_requires() == backend.NATIVE_BUILD_REQUIRES + backend.PIP_CUDA_TOOLKIT


@pytest.mark.parametrize("how", ["environment", "config_settings"])
def test_cuda_on_without_nvcc_adds_nvidias_compiler(machine, monkeypatch, how):
    settings = None
    if how == "environment":
        monkeypatch.setenv("JAX_SPARSE_MLA_CUDA", "ON")
    else:
        settings = {"cmake.define.JAX_SPARSE_MLA_CUDA": "ON"}
    assert _extra_requires(settings) == backend.NATIVE_BUILD_REQUIRES + backend.PIP_CUDA_TOOLKIT


def test_system_nvcc_is_used_instead_of_nvidias_wheels(machine, monkeypatch):
    monkeypatch.delenv("JAX_SPARSE_MLA_SYSTEM_NVCC")
    nvcc = _script(machine, "nvcc")
    _script(machine, "nvidia-smi")
    assert backend.nvcc_path() == str(nvcc)
    assert _extra_requires() == backend.NATIVE_BUILD_REQUIRES
    monkeypatch.setenv("JAX_SPARSE_MLA_SYSTEM_NVCC", "0")
    assert _extra_requires() == backend.NATIVE_BUILD_REQUIRES + backend.PIP_CUDA_TOOLKIT


def test_cuda_off_adds_nothing_even_with_a_driver(machine, monkeypatch):
    _script(machine, "nvidia-smi")
    monkeypatch.setenv("JAX_SPARSE_MLA_CUDA", "OFF")
    assert _extra_requires() == []


def test_pip_toolkit_is_one_pinned_cuda_13_0_release():
    pins = dict(r.split("==") for r in backend.PIP_CUDA_TOOLKIT)
    assert set(pins) == {"nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt",
                         "nvidia-cuda-runtime", "nvidia-cuda-cccl"}
    assert all(v.startswith("13.0.") for v in pins.values()), pins


def test_build_hooks_name_the_pip_nvcc_to_cmake(machine, monkeypatch, tmp_path):
    site = tmp_path / "site-packages"
    (site / "nvidia" / "cu13" / "bin").mkdir(parents=True)
    nvcc = _script(site / "nvidia" / "cu13" / "bin", "nvcc")
    monkeypatch.syspath_prepend(str(site))  # searched first, before any jax[cuda13] nvcc
    monkeypatch.setattr(backend, "pip_nvcc", _pip_nvcc)
    seen = []
    for hook in ("build_wheel", "build_editable"):
        monkeypatch.setattr(backend._scikit_build, hook,
                            lambda directory, settings, metadata: seen.append(settings))
    backend.build_wheel("dist")
    backend.build_editable("dist", {"cmake.define.CMAKE_CUDA_COMPILER": "/mine/nvcc"})
    monkeypatch.setenv("JAX_SPARSE_MLA_CUDA", "OFF")
    backend.build_wheel("dist")
    assert [s.get("cmake.define.CMAKE_CUDA_COMPILER") for s in seen] == [str(nvcc), "/mine/nvcc",
                                                                         None]
    # Installed already (pip's isolated environment after get_requires, or jax[cuda13]'s nvcc).
    assert _extra_requires({"cmake.define.JAX_SPARSE_MLA_CUDA": "ON"}) == \
        backend.NATIVE_BUILD_REQUIRES


def _make_install_line(path: str, *args: str) -> str:
    """The pip install line `make install` would run into a fresh virtual environment."""
    # Not the settings of a make running these tests (`make test GPU=0` passes GPU in MAKEFLAGS).
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPU", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["PATH"] = path
    out = subprocess.run(["make", "-n", "install", "VENV=/nonexistent/venv", "EXTRAS=flax,test",
                          *args], cwd=REPO,
                         env=env, capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if "pip install" in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_installs_the_cuda_jaxlib_where_a_driver_answers_or_when_asked(tmp_path):
    path = f"{tmp_path}:{os.environ['PATH']}"
    _script(tmp_path, "nvidia-smi")
    assert '".[flax,test,cuda13]"' in _make_install_line(path)
    assert '".[flax,test]"' in _make_install_line(path, "GPU=0")
    _script(tmp_path, "nvidia-smi", exit_code=9)
    assert '".[flax,test]"' in _make_install_line(path)
    assert '".[flax,test,cuda13]"' in _make_install_line(path, "GPU=1")


def _needed(shared_object: pathlib.Path) -> set[str]:
    if shutil.which("readelf") is None:
        pytest.skip("needs readelf (binutils)")
    dynamic = subprocess.run(["readelf", "-d", str(shared_object)], capture_output=True, text=True,
                             check=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))


def test_installed_extension_links_only_system_libraries():
    if native.module is None:
        if os.environ.get("JAX_SPARSE_MLA_REQUIRE_NATIVE") == "1":
            pytest.fail(f"JAX_SPARSE_MLA_REQUIRE_NATIVE=1 but {native.missing_reason()}")
        pytest.skip(native.missing_reason())
    needed = _needed(pathlib.Path(native.module.__file__))
    assert "libc.so.6" in needed
    assert needed <= ALLOWED_NEEDED, needed - ALLOWED_NEEDED


@pytest.fixture
def wheel() -> pathlib.Path:
    if not os.environ.get(WHEEL_ENV):
        pytest.skip(f"set {WHEEL_ENV} to a wheel of `make wheel` (dist/*.whl) to test it")
    return pathlib.Path(os.environ[WHEEL_ENV])


def test_wheel_is_manylinux_and_links_only_system_libraries(wheel, tmp_path):
    assert re.search(r"-manylinux_\d+_\d+_x86_64\.whl$", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        [member] = [n for n in archive.namelist() if re.search(r"_jax_sparse_mla_native.*\.so$", n)]
        extension = pathlib.Path(archive.extract(member, tmp_path))
    needed = _needed(extension)
    assert needed <= ALLOWED_NEEDED, needed - ALLOWED_NEEDED


def test_wheel_installs_without_a_compiler_and_lists_its_families(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        config = json.loads(archive.read("jax_sparse_mla/_build_config.json"))
    assert config["native"] and config["families"], config
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--quiet", "--disable-pip-version-check", str(wheel)], check=True)
    # The wheel's dependencies (jax, numpy, ml_dtypes) come from this interpreter's site-packages,
    # behind the fresh environment's own: no download, and the wheel's jax_sparse_mla comes first.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    pathlib.Path(site, "outer.pth").write_text("\n".join(ours) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CUDACXX")}
    env["PATH"] = os.pathsep.join([str(env_dir / "bin")] + [
        p for p in os.environ["PATH"].split(os.pathsep)
        if p and not os.path.exists(os.path.join(p, "nvcc"))])
    assert shutil.which("nvcc", path=env["PATH"]) is None
    out = subprocess.run([str(python), "-P", "-c",
                          "import runpy, jax_sparse_mla; print(jax_sparse_mla.__file__); "
                          "runpy.run_module('jax_sparse_mla', run_name='__main__')"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0].startswith(site), out
    assert "native extension: built" in out, out
    for family in config["families"]:
        assert re.search(rf"^  {family} +SM", out, re.M), (family, out)
