"""Whether this process can run any native kernel, and if not, why and the one command that fixes it.

On a machine with an NVIDIA GPU the package can still end up running pure JAX everywhere, silently:

* the CPU jaxlib is installed (plain `pip install jax`, what `pip install .` pulls), so JAX computes
  on the CPU next to the GPU;
* the native extension was not built (no nvcc at install time, JAX_SPARSE_MLA_CUDA=OFF), or does not
  load;
* it was built for other GPU families than this GPU's (JAX_SPARSE_MLA_ARCHS="sm90" on a B200).

`unavailable_reason()` names the case in one line (None when a native kernel can run here, and on a
machine without an NVIDIA driver, where pure JAX is the expected path); `python -m jax_sparse_mla`
prints it, and the first public op that falls back to pure JAX under implementation="auto" for that
reason warns with it once per process (`warn_once`, a `NativeKernelsUnavailableWarning`). A kernel
passed over because pure JAX measured faster at the call's shape is a different matter: there the
kernels are usable, the reason is None and nothing is said.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import warnings

import jax

from . import native

# The fixes, each in one place. The CUDA jaxlib for a CUDA major ("cuda13"); without -U pip keeps the
# installed jax and adds the plugin of that exact version.
JAX_CUDA_INSTALL = 'pip install "jax[{cuda}]"'
JAX_CUDA = "cuda13"
# CUDA 13's minimum driver (NVIDIA's CUDA 13.0 release notes: r580).
JAX_CUDA_MIN_DRIVER = 580
# The native build, run in the jax-sparse-mla checkout; {archs} is empty or `JAX_SPARSE_MLA_ARCHS="..." `.
NATIVE_REINSTALL = "JAX_SPARSE_MLA_CUDA=ON {archs}pip install --force-reinstall --no-deps ."

# The handler families of ffi/CMakeLists.txt by the compute-capability major they run on.
FAMILIES = {9: "sm90", 10: "sm100", 12: "sm120"}
FAMILY_GPUS = "SM90 (H100/H200), SM100/SM103 (B200/B300) and SM120/SM121 (RTX Pro 6000, DGX Spark)"
# Machine code that an older nvcc leaves out of its family (ffi/CMakeLists.txt).
_CODE_NEEDS = {"121a": "nvcc >= 13.0"}

_PREFIX = "jax-sparse-mla runs without its native kernels: "
# Where a driver shows itself without starting a process: its version file, and the control device
# node (one of those JAX itself checks, jax/_src/hardware_utils.py).
_PROC_DRIVER = pathlib.Path("/proc/driver/nvidia/version")
_DEVICE_NODE = pathlib.Path("/dev/nvidiactl")
_CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt", "jax-cuda12-pjrt")


class NativeKernelsUnavailableWarning(UserWarning):
    """An op fell back to pure JAX on a machine with an NVIDIA GPU because no native kernel can run
    in this process; the message says why and how to fix it. Emitted once per process."""


def cuda_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a JAX device when it is a CUDA GPU, else None."""
    if device.platform != "gpu":
        return None
    capability = getattr(device, "compute_capability", None)
    if not capability:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major), int(minor or 0)


@functools.cache
def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version when one is present ("" when present but unreadable), else None.

    /proc/driver/nvidia/version first (no process started), then `nvidia-smi` (WSL has no such file),
    then the device node JAX itself looks for."""
    if _PROC_DRIVER.is_file():
        text = _PROC_DRIVER.read_text(errors="replace")
        # "... Kernel Module  580.95.05  ..." or "... Open Kernel Module for x86_64  580.95.05  ..."
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
        return found.group(1) if found else ""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            answer = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.SubprocessError):
            answer = None
        if answer is not None and answer.returncode == 0:
            return answer.stdout.strip().splitlines()[0].strip() if answer.stdout.strip() else ""
    return "" if _DEVICE_NODE.exists() else None


def _default_device() -> tuple[str, str, tuple[int, int] | None]:
    """(platform, device_kind, CUDA capability or None) of JAX's default device."""
    device = jax.devices()[0]
    return device.platform, device.device_kind, cuda_capability(device)


def _cuda_plugin() -> tuple[str, str] | None:
    """(distribution, version) of an installed JAX CUDA plugin, else None (a CPU-only jaxlib)."""
    for name in _CUDA_PLUGINS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _jax_platforms() -> str:
    """The jax_platforms setting (JAX_PLATFORMS or jax.config.update), "" when unset."""
    return getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")


def _platforms_chosen_without_cuda() -> bool:
    """True when jax_platforms names platforms and no CUDA one: the CPU was the user's choice."""
    names = {name.strip() for name in _jax_platforms().split(",") if name.strip()}
    return bool(names) and not names & {"cuda", "gpu"}


def _jax_cuda_fix(cuda: str = JAX_CUDA) -> str:
    return JAX_CUDA_INSTALL.format(cuda=cuda)


def _native_fix(archs: str = "") -> tuple[str, str]:
    """(where, command) of the native build, for `_fix`."""
    command = NATIVE_REINSTALL.format(archs=f'JAX_SPARSE_MLA_ARCHS="{archs}" ' if archs else "")
    return "in the jax-sparse-mla checkout", command


def _fix(fix: tuple[str, str]) -> str:
    where, command = fix
    return f"Fix, {where}: {command}" if where else f"Fix: {command}"


def _driver_words(version: str) -> str:
    return f"an NVIDIA GPU is present (driver {version})" if version else "an NVIDIA GPU is present"


def _cpu_reason(driver: str) -> str:
    """The default device is not a GPU although a driver is: no CUDA jaxlib, or it did not start."""
    plugin = _cuda_plugin()
    jaxlib = _jaxlib_version()
    if plugin is None:
        message = (f"{_PREFIX}{_driver_words(driver)} but the installed jaxlib {jaxlib} is CPU-only, "
                   f"so JAX runs every op on the CPU. Fix: {_jax_cuda_fix()}")
        major = driver.split(".")[0]
        if major.isdigit() and int(major) < JAX_CUDA_MIN_DRIVER:
            message += (f" (CUDA 13 needs NVIDIA driver >= {JAX_CUDA_MIN_DRIVER}; this one is "
                        f"{driver}: update the driver first)")
        if not native.available():  # the GPU would then run pure JAX: say the second step now
            cause, fix = _extension_missing()
            where, command = fix
            message += f"; then, since {cause}, " + (f"{where}: {command}" if where else command)
        return message
    name, version = plugin
    cuda = "cuda12" if "cuda12" in name else "cuda13"
    if version != jaxlib:
        return (f"{_PREFIX}{_driver_words(driver)} and {name} {version} is installed, but it does not "
                f"match jaxlib {jaxlib}, so JAX runs every op on the CPU. Fix: {_jax_cuda_fix(cuda)}")
    return (f"{_PREFIX}{_driver_words(driver)} and {name} {version} is installed, but JAX did not start "
            f"its CUDA backend, so it runs every op on the CPU. "
            f"python -c \"import jax; jax.devices('cuda')\" shows JAX's error")


def _package_dir() -> pathlib.Path:
    """The folder of the jax_sparse_mla package this process imported."""
    return pathlib.Path(native.__file__).resolve().parent.parent


def _extension_missing() -> tuple[str, tuple[str, str]]:
    """(cause, (where, command)) when the extension is not importable: not built, a source
    checkout, or it failed to load."""
    config = native.build_config()
    package = _package_dir()
    if config.get("native") is False:
        return (f"the native extension was not built at install time "
                f"({config.get('reason', 'no reason recorded')})", _native_fix())
    if not list(package.glob("_jax_sparse_mla_native*")):
        if (package.parent / "ffi" / "CMakeLists.txt").is_file():
            return (f"jax_sparse_mla was imported from the source checkout {package.parent}, which "
                    "holds no compiled extension", ("", "import the installed package: run from "
                    "another folder, or with python -P (python -P -m jax_sparse_mla)"))
        return f"there is no compiled extension in {package}", _native_fix()
    return f"the native extension failed to load ({native.import_error})", _native_fix()


def _family_reason(kind: str, capability: tuple[int, int]) -> str | None:
    """None when the extension holds this GPU's family and machine code, else the message."""
    major, minor = capability
    gpu = f"this GPU ({kind}, compute capability {major}.{minor})"
    family = FAMILIES.get(major)
    if family is None:
        return (f"{_PREFIX}they target {FAMILY_GPUS} GPUs, and {gpu} is none of them: the "
                "pure-JAX kernels are what runs here, whatever is installed")
    info = native.build_info()
    if native.built_for(family, capability):
        return None
    code = f"{major}{minor}a"
    built = [f"{name} ({', '.join(f'sm_{c}' for c in info[name].split(','))})"
             for name in FAMILIES.values() if info.get(name)]
    holds = ", ".join(built) if built else "no GPU family"
    if family in info:
        need = f"sm_{code}, which its {family} family lacks"
        if code in _CODE_NEEDS:
            need += f" (sm_{code} needs {_CODE_NEEDS[code]})"
        archs = ""
    else:
        need = f"{family} (sm_{code})"
        archs = ";".join([name for name in FAMILIES.values() if name in info] + [family])
    return (f"{_PREFIX}the native extension holds {holds} but {gpu} needs {need}, so every op runs "
            f"pure JAX on the GPU. {_fix(_native_fix(archs))}")


def unavailable_reason() -> str | None:
    """None when a native kernel can run in this process, or when no NVIDIA GPU is in sight (pure JAX
    is then the package's normal path); else one line: why the package runs without its native
    kernels on this machine's NVIDIA GPU, and the command that fixes it."""
    platform, kind, capability = _default_device()
    if platform != "gpu":
        driver = nvidia_driver_version()
        if driver is None or _platforms_chosen_without_cuda():
            return None
        return _cpu_reason(driver)
    if capability is None:  # a GPU that is not CUDA's
        return None
    if not native.available():
        cause, fix = _extension_missing()
        return f"{_PREFIX}{cause}, so every op runs pure JAX on the GPU. {_fix(fix)}"
    return _family_reason(kind, capability)


_warned = False


def warn_once() -> None:
    """Warns with unavailable_reason() the first time it is called in the process and is not None.

    Called where implementation="auto" falls back to pure JAX for an op that has native kernels
    (registry._choose, index_conversion._select_core). The machine does not change within a process,
    so the reason is worked out once either way."""
    global _warned
    if _warned:
        return
    _warned = True
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(reason, NativeKernelsUnavailableWarning, stacklevel=3)
