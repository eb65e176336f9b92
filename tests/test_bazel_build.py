"""The Bazel build (BUILD.bazel) produces the same extension module as the CMake build (pip install).

Compares the Bazel-built `_jax_sparse_mla_native.so` with the installed, CMake-built
`jax_sparse_mla._jax_sparse_mla_native`, on the CPU (no GPU is needed):
- importing each (in its own interpreter) gives the same registrations() keys, all capsules, the same
  functions, the same build_info() (handler families, their machine-code targets, the TRTLLM-gen
  kernel table) and the same answers of the host planner sm90_schedule;
- both export the same dynamic symbols (the handler symbols and PyInit);
- both embed the same device code: the .nv_fatbin sections hold the same cubins, byte for byte once
  the per-file hash nvcc puts in internal-linkage names (derived from the source path, which is
  absolute under CMake and workspace-relative under Bazel) is blanked.

The Bazel-built module is $JAX_SPARSE_MLA_BAZEL_EXT (CI sets it to
build/bazel-bin/_jax_sparse_mla_native.so after .ci/build_bazel.sh); when it is set, a missing module
on either side is a failure. Unset, the tests skip, saying how to run them (a Bazel output left in
build/ is not picked up on its own: it may be older or newer than the installed package).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import pytest

ENV = "JAX_SPARSE_MLA_BAZEL_EXT"
REPO = pathlib.Path(__file__).resolve().parent.parent
MODULE = "_jax_sparse_mla_native"
# Symbols the linker defines in any shared object (present or not depending on its flags).
LINKER_SYMBOLS = {"__bss_start", "_edata", "_end"}

# Runs in a fresh interpreter: loads the extension at argv[1] under its module name and prints what
# it exposes. The planner is asked twice: once with arguments it rejects before touching CUDA, once
# for device 0 (an error naming the device on a machine without a GPU, a schedule on a GPU).
_PROBE = r"""
import importlib.machinery, importlib.util, json, sys
loader = importlib.machinery.ExtensionFileLoader(sys.argv[2], sys.argv[1])
spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1], loader=loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)
registrations = module.registrations()

def plan(*args):
    try:
        result = module.sm90_schedule(*args)
    except Exception as error:
        return [type(error).__name__, str(error)]
    return {k: (v.hex() if isinstance(v, bytes) else v) for k, v in sorted(result.items())}

print(json.dumps({
    "registrations": sorted(registrations),
    "capsules": sorted({type(v).__name__ for v in registrations.values()}),
    "functions": sorted(n for n in dir(module) if not n.startswith("__")),
    "doc": module.__doc__,
    "build_info": module.build_info() if hasattr(module, "build_info") else None,
    "plan_rejected": plan(0, 16, 64, 0),
    "plan_device_0": plan(4, 16, 2048, 0),
}))
"""


def _required() -> bool:
    return bool(os.environ.get(ENV))


def _missing(reason: str):
    if _required():
        pytest.fail(f"{ENV} is set, so both builds must be present: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def bazel_module() -> pathlib.Path:
    path = os.environ.get(ENV)
    if not path:
        pytest.skip(
            f"{ENV} is unset: to compare the Bazel-built extension with the installed one, run "
            f".ci/build_bazel.sh, then {ENV}=build/bazel-bin/{MODULE}.so pytest tests/{pathlib.Path(__file__).name}"
        )
    path = pathlib.Path(path)
    if not path.is_absolute() and not path.exists():
        path = REPO / path  # relative to the checkout, as CI writes it
    if not path.is_file():
        pytest.fail(f"{ENV}={path} does not exist; build it with .ci/build_bazel.sh")
    return path


@pytest.fixture(scope="module")
def cmake_module() -> pathlib.Path:
    try:
        spec = importlib.util.find_spec(f"jax_sparse_mla.{MODULE}")
    except ImportError as error:
        spec = None
        reason = str(error)
    else:
        reason = "jax_sparse_mla has no compiled extension"
    if spec is None or not spec.origin:
        _missing(
            f"no CMake-built extension to compare with ({reason}); install the package with "
            "JAX_SPARSE_MLA_CUDA=ON pip install --no-build-isolation ."
        )
    return pathlib.Path(spec.origin)


def _probe(path: pathlib.Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), MODULE],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"importing {path} failed:\n{result.stderr}"
    return json.loads(result.stdout)


def _sections(path: pathlib.Path) -> dict[str, bytes]:
    """Name -> contents of the sections of a little-endian ELF64 file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not ELF64 LE"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    names = data[names[4]:names[4] + names[5]]
    sections = {}
    for name, kind, _, _, offset, size, *_ in headers:
        label = names[name:names.index(b"\0", name)].decode()
        sections[label] = b"" if kind == 8 else data[offset:offset + size]  # 8: SHT_NOBITS
    return sections


def _exported_symbols(path: pathlib.Path) -> set[str]:
    """Defined global/weak symbols of .dynsym (what nm -D --defined-only lists)."""
    sections = _sections(path)
    dynsym, dynstr = sections[".dynsym"], sections[".dynstr"]
    names = set()
    for offset in range(0, len(dynsym), 24):
        name, info, _, shndx = struct.unpack_from("<IBBH", dynsym, offset)
        if name and shndx != 0 and info >> 4 in (1, 2):  # defined, STB_GLOBAL or STB_WEAK
            names.add(dynstr[name:dynstr.index(b"\0", name)].decode())
    return names - LINKER_SYMBOLS


def _cubins(path: pathlib.Path) -> list[bytes]:
    """The fat binaries of .nv_fatbin (one per .cu file), sorted, with nvcc's path hashes blanked."""
    blob = _sections(path).get(".nv_fatbin", b"")
    fatbins, offset = [], 0
    while offset < len(blob):
        magic, _, header, size = struct.unpack_from("<IHHQ", blob, offset)
        assert magic == 0xBA55ED50, f"unexpected fatbin magic {magic:#x} in {path}"
        fatbin = blob[offset:offset + header + size]
        # _GLOBAL__N__<hash>_<n>_<file> / ..._INTERNAL_<hash>_<n>_<file>: <hash> comes from the path.
        fatbins.append(re.sub(rb"(INTERNAL|__N_)_[0-9a-f]{8}_", rb"\1_00000000_", fatbin))
        offset += header + size
        offset += -offset % 8
    return sorted(fatbins)


def test_bazel_module_registers_the_same_handlers(bazel_module, cmake_module):
    bazel, cmake = _probe(bazel_module), _probe(cmake_module)
    assert bazel["registrations"], "the Bazel-built module registers no FFI targets"
    assert bazel["registrations"] == cmake["registrations"]
    assert bazel["capsules"] == cmake["capsules"] == ["PyCapsule"]
    assert bazel == cmake


def test_bazel_module_exports_the_same_symbols(bazel_module, cmake_module):
    bazel, cmake = _exported_symbols(bazel_module), _exported_symbols(cmake_module)
    assert f"PyInit_{MODULE}" in bazel
    assert bazel == cmake


def test_bazel_module_embeds_the_same_device_code(bazel_module, cmake_module):
    bazel, cmake = _cubins(bazel_module), _cubins(cmake_module)
    assert bazel, "the Bazel-built module embeds no device code"
    assert [len(c) for c in bazel] == [len(c) for c in cmake]
    assert bazel == cmake, "the cubins differ: nvcc flags or headers differ between the two builds"
