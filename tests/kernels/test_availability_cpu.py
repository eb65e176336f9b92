"""CPU tests of kernels/availability.py: the one line that says why the package runs without its native
kernels on a machine with an NVIDIA GPU (a CPU-only jaxlib, no extension, other GPU families) and the
command that fixes it; that the first pure-JAX fallback of a public op warns with it once; and that a
machine without an NVIDIA driver, or one where the kernels are usable, hears nothing.

Every input of the diagnosis is faked (the default device, the driver, the installed CUDA plugin, the
extension and its build), so the tests run the same on any machine.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import __main__ as self_description
from jax_sparse_mla.kernels import availability, native, registry
from jax_sparse_mla.ops import index_conversion

CPU = ("cpu", "cpu", None)
H100 = ("gpu", "NVIDIA H100 80GB HBM3", (9, 0))
B200 = ("gpu", "NVIDIA B200", (10, 0))
B300 = ("gpu", "NVIDIA B300", (10, 3))
SPARK = ("gpu", "NVIDIA GB10", (12, 1))
A100 = ("gpu", "NVIDIA A100-SXM4-80GB", (8, 0))
ALL_FAMILIES = {"sm90": "90a", "sm100": "100a,103a", "sm120": "120a,121a",
                "common": "90a,100a,103a,120a,121a"}
PREFIX = "jax-sparse-mla runs without its native kernels: "
REBUILD = ("Fix, in the jax-sparse-mla checkout: "
           "JAX_SPARSE_MLA_CUDA=ON pip install --force-reinstall --no-deps .")


@pytest.fixture
def machine(monkeypatch):
    """machine(...) fakes what the diagnosis reads; the defaults are a CPU machine without a driver."""
    def fake(*, device=CPU, driver=None, plugin=None, jaxlib="0.10.2", platforms="", module=None,
             build_info=None, build_config=None):
        monkeypatch.setattr(availability, "_default_device", lambda: device)
        monkeypatch.setattr(availability, "nvidia_driver_version", lambda: driver)
        monkeypatch.setattr(availability, "_cuda_plugin", lambda: plugin)
        monkeypatch.setattr(availability, "_jaxlib_version", lambda: jaxlib)
        monkeypatch.setattr(availability, "_jax_platforms", lambda: platforms)
        monkeypatch.setattr(native, "module", module)
        monkeypatch.setattr(native, "build_info", lambda: dict(build_info or {}))
        monkeypatch.setattr(native, "build_config", lambda: dict(build_config or {}))
        monkeypatch.setattr(availability, "_warned", False)
    return fake


# --- the message -------------------------------------------------------------------------------------

def test_a_machine_without_an_nvidia_driver_hears_nothing(machine):
    machine()
    assert availability.unavailable_reason() is None
    machine(plugin=("jax-cuda13-plugin", "0.10.2"))  # a CUDA jaxlib on a machine without a GPU
    assert availability.unavailable_reason() is None


def test_cpu_jaxlib_next_to_a_driver_names_the_cuda_jaxlib(machine):
    machine(driver="580.95.05", module=object(), build_info=ALL_FAMILIES)
    assert availability.unavailable_reason() == (
        PREFIX + "an NVIDIA GPU is present (driver 580.95.05) but the installed jaxlib 0.10.2 is "
        'CPU-only, so JAX runs every op on the CPU. Fix: pip install "jax[cuda13]"')
    machine(driver="", module=object())  # found through /dev/nvidiactl: version unknown
    assert availability.unavailable_reason().startswith(
        PREFIX + "an NVIDIA GPU is present but the installed jaxlib 0.10.2 is CPU-only")


def test_cpu_jaxlib_and_no_extension_names_both_steps(machine):
    machine(driver="580.95.05", build_config={"native": False,
                                             "reason": "no CUDA compiler (nvcc) was found"})
    assert availability.unavailable_reason() == (
        PREFIX + "an NVIDIA GPU is present (driver 580.95.05) but the installed jaxlib 0.10.2 is "
        'CPU-only, so JAX runs every op on the CPU. Fix: pip install "jax[cuda13]"; then, since the '
        "native extension was not built at install time (no CUDA compiler (nvcc) was found), in the "
        "jax-sparse-mla checkout: JAX_SPARSE_MLA_CUDA=ON pip install --force-reinstall --no-deps .")


def test_a_driver_too_old_for_cuda_13_is_named_with_the_fix(machine):
    machine(driver="550.54.15", module=object())
    reason = availability.unavailable_reason()
    assert 'Fix: pip install "jax[cuda13]"' in reason
    assert reason.endswith("(CUDA 13 needs NVIDIA driver >= 580; this one is 550.54.15: update the "
                           "driver first)")


def test_the_cpu_chosen_through_jax_platforms_is_not_a_problem(machine):
    machine(driver="580.95.05", platforms="cpu")
    assert availability.unavailable_reason() is None
    machine(driver="580.95.05", platforms="cuda,cpu")
    assert "is CPU-only" in availability.unavailable_reason()


def test_a_cuda_plugin_that_does_not_start(machine):
    machine(driver="580.95.05", plugin=("jax-cuda12-plugin", "0.9.0"), jaxlib="0.10.2")
    assert availability.unavailable_reason() == (
        PREFIX + "an NVIDIA GPU is present (driver 580.95.05) and jax-cuda12-plugin 0.9.0 is installed, "
        "but it does not match jaxlib 0.10.2, so JAX runs every op on the CPU. "
        'Fix: pip install "jax[cuda12]"')
    machine(driver="580.95.05", plugin=("jax-cuda13-plugin", "0.10.2"), jaxlib="0.10.2")
    reason = availability.unavailable_reason()
    assert "jax-cuda13-plugin 0.10.2 is installed, but JAX did not start its CUDA backend" in reason
    assert reason.endswith("python -c \"import jax; jax.devices('cuda')\" shows JAX's error")


def test_an_extension_not_built_for_lack_of_nvcc_names_the_native_build(machine):
    machine(device=H100, build_config={"native": False, "reason": "no CUDA compiler (nvcc) was found"})
    assert availability.unavailable_reason() == (
        PREFIX + "the native extension was not built at install time (no CUDA compiler (nvcc) was "
        "found), so every op runs pure JAX on the GPU. " + REBUILD)


def test_a_source_checkout_an_empty_install_and_a_failed_load(machine, monkeypatch, tmp_path):
    package = tmp_path / "jax_sparse_mla"
    package.mkdir()
    monkeypatch.setattr(availability, "_package_dir", lambda: package)
    machine(device=H100)
    assert availability.unavailable_reason() == (
        PREFIX + f"there is no compiled extension in {package}, so every op runs pure JAX on the GPU. "
        + REBUILD)
    (tmp_path / "ffi").mkdir()
    (tmp_path / "ffi" / "CMakeLists.txt").write_text("")
    reason = availability.unavailable_reason()
    assert reason.startswith(PREFIX + f"jax_sparse_mla was imported from the source checkout {tmp_path}")
    assert reason.endswith("run from another folder, or with python -P (python -P -m jax_sparse_mla)")
    (package / "_jax_sparse_mla_native.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.setattr(native, "import_error",
                        ImportError("libcudart.so.13: cannot open shared object file"))
    assert availability.unavailable_reason() == (
        PREFIX + "the native extension failed to load (libcudart.so.13: cannot open shared object "
        "file), so every op runs pure JAX on the GPU. " + REBUILD)


def test_an_extension_built_for_other_families_names_both(machine):
    machine(device=B200, module=object(), build_info={"sm90": "90a", "common": "90a"})
    assert availability.unavailable_reason() == (
        PREFIX + "the native extension holds sm90 (sm_90a) but this GPU (NVIDIA B200, compute "
        "capability 10.0) needs sm100 (sm_100a), so every op runs pure JAX on the GPU. Fix, in the "
        'jax-sparse-mla checkout: JAX_SPARSE_MLA_CUDA=ON JAX_SPARSE_MLA_ARCHS="sm90;sm100" '
        "pip install --force-reinstall --no-deps .")
    machine(device=SPARK, module=object(), build_info={"sm90": "90a", "sm120": "120a",
                                                       "common": "90a,120a"})
    reason = availability.unavailable_reason()
    assert ("holds sm90 (sm_90a), sm120 (sm_120a) but this GPU (NVIDIA GB10, compute capability 12.1) "
            "needs sm_121a, which its sm120 family lacks (sm_121a needs nvcc >= 13.0)") in reason
    assert reason.endswith(REBUILD)


def test_a_gpu_no_family_targets_is_said_without_a_fix(machine):
    machine(device=A100, module=object(), build_info=ALL_FAMILIES)
    reason = availability.unavailable_reason()
    assert reason.startswith(PREFIX + "they target SM90 (H100/H200), SM100/SM103 (B200/B300) and SM120")
    assert "this GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0) is none of them" in reason
    assert "Fix" not in reason


@pytest.mark.parametrize("device", [H100, B200, B300, SPARK], ids=lambda d: d[1])
def test_usable_kernels_and_non_cuda_gpus_hear_nothing(machine, device):
    machine(device=device, driver="580.95.05", module=object(), build_info=ALL_FAMILIES)
    assert availability.unavailable_reason() is None
    machine(device=("gpu", "AMD Instinct MI300X", None))  # a GPU, not a CUDA one
    assert availability.unavailable_reason() is None


def test_self_description_prints_the_line_before_the_dispatch_table(monkeypatch, capsys):
    line = PREFIX + "(a faked reason). Fix: a command"
    monkeypatch.setattr(availability, "unavailable_reason", lambda: line)
    self_description.main()
    printed = capsys.readouterr().out.splitlines()
    assert line in printed
    assert printed.index(line) < next(i for i, text in enumerate(printed) if text.startswith("dispatch"))
    monkeypatch.setattr(availability, "unavailable_reason", lambda: None)
    self_description.main()
    assert PREFIX not in capsys.readouterr().out


# --- finding the driver ------------------------------------------------------------------------------

@pytest.fixture
def driver_sources(monkeypatch, tmp_path):
    """Points the driver probes at tmp_path (nothing there yet) and PATH at an empty folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setattr(availability, "_PROC_DRIVER", tmp_path / "version")
    monkeypatch.setattr(availability, "_DEVICE_NODE", tmp_path / "nvidiactl")
    monkeypatch.setenv("PATH", str(bin_dir))
    return tmp_path


@pytest.mark.parametrize("text", [
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 09:55:41 UTC 2025\n",
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder)\n",
])
def test_the_driver_version_file_is_read(driver_sources, text):
    (driver_sources / "version").write_text(text + "GCC version:  gcc version 12.3.0\n")
    assert availability.nvidia_driver_version.__wrapped__() == "580.95.05"


def test_nvidia_smi_and_the_device_node_stand_in_for_the_file(driver_sources):
    probe = availability.nvidia_driver_version.__wrapped__
    assert probe() is None
    (driver_sources / "nvidiactl").write_text("")
    assert probe() == ""
    smi = driver_sources / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 575.57.08\n")
    smi.chmod(0o755)
    assert probe() == "575.57.08"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")  # installed, no driver
    (driver_sources / "nvidiactl").unlink()
    assert probe() is None


# --- the warning -------------------------------------------------------------------------------------

def _run_public_ops():
    """Two decode traces (two shapes) and a top-k, each under implementation="auto"."""
    for tokens in (3, 5):
        q = jnp.zeros((tokens, 7, 576), jnp.bfloat16)
        kv = jnp.zeros((2, 16, 576), jnp.bfloat16)
        indices = jnp.zeros((tokens, 12), jnp.int32)
        jax.block_until_ready(jsm.sparse_mla_decode(q, kv, indices, scale=0.1))
    logits = jnp.zeros((3, 2100), jnp.float32)
    starts, ends = jnp.zeros(3, jnp.int32), jnp.full(3, 2100, jnp.int32)
    jax.block_until_ready(jsm.top_k_per_row(logits, starts, ends, k=2048))


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, jsm.NativeKernelsUnavailableWarning)]


def test_the_first_fallback_warns_once_with_the_line(machine, monkeypatch):
    machine(driver="580.95.05")
    monkeypatch.setattr(registry, "current_device_capability", lambda: None)  # auto: pure JAX
    caught = _warnings_of(_run_public_ops)
    assert [str(w.message) for w in caught] == [availability.unavailable_reason()]
    assert 'pip install "jax[cuda13]"' in str(caught[0].message)
    assert _warnings_of(_run_public_ops) == []


def test_no_warning_on_a_cpu_machine(machine, monkeypatch):
    machine()
    monkeypatch.setattr(registry, "current_device_capability", lambda: None)
    assert _warnings_of(_run_public_ops) == []


def test_the_index_conversion_fallback_warns_too(machine, monkeypatch):
    machine(device=H100, build_config={"native": False, "reason": "no CUDA compiler (nvcc) was found"})
    monkeypatch.setattr(index_conversion, "unavailable_reason", lambda name: "faked: cannot run")

    def convert():
        req = jnp.zeros(2, jnp.int32)
        table = jnp.zeros((1, 4), jnp.int32)
        tokens = jnp.asarray(np.arange(2 * 128).reshape(2, 128) % 7, jnp.int32)
        jsm.convert_req_index_to_global_index(req, table, tokens, block_size=64, compact=True)

    caught = _warnings_of(convert)
    assert len(caught) == 1
    assert "the native extension was not built at install time" in str(caught[0].message)


def _kernels(*native_kernels):
    pure = registry.OpKernel(op="fake", name="xla", native=False, capability_majors=(), fn=None)
    return [pure, *native_kernels]


def test_no_warning_when_a_usable_kernel_is_passed_over_for_speed(machine):
    machine(device=H100, driver="580.95.05", module=object(), build_info=ALL_FAMILIES)
    slower = registry.OpKernel(op="fake", name="sm90_fake", native=True, capability_majors=(9,),
                               fn=None)
    caught = _warnings_of(lambda: registry._choose(
        _kernels(slower), "auto", lambda kernel: "measured slower than pure JAX at this shape"))
    assert caught == []
    assert availability._warned  # the machine was looked at: its kernels are usable


def test_no_warning_for_an_op_without_native_kernels(machine):
    machine(driver="580.95.05")  # the CPU jaxlib next to a GPU: every other op would warn
    caught = _warnings_of(lambda: registry._choose(_kernels(), "auto", lambda kernel: None))
    assert caught == []
    assert not availability._warned
    # "xla" was asked for: not a fallback either.
    fake = registry.OpKernel(op="fake", name="sm90_fake", native=True, capability_majors=(9,), fn=None)
    assert _warnings_of(lambda: registry._choose(_kernels(fake), "xla", lambda kernel: "no")) == []
    assert not availability._warned
