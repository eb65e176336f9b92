"""Fetches the FlashInfer headers and sources that the native build compiles against, without torch.

FlashInfer is a build-time source of headers only: nothing imports it at run time. Its wheel
(flashinfer-python) declares torch as a dependency, so instead of installing it this script asks pip
for the wheel alone (`pip download --no-deps`) and unpacks the parts the build reads into DEST:

    DEST/flashinfer/data/{include, cutlass/include, cutlass/tools/util/include, cccl/...,
                          csrc/fmhaReduction.cu}
    DEST/flashinfer/{artifacts.py, _build_meta.py}   (the TRTLLM-gen cubin artifact path, the version)

and prints DEST/flashinfer/data (CMake's and Bazel's FLASHINFER_DATA_DIR). When flashinfer-python of
the pinned version is installed already, its data/ folder is printed instead (found without importing
it: importing flashinfer imports torch); a DEST that already holds the pinned version is reused. pip's own index settings (PIP_INDEX_URL, PIP_FIND_LINKS, a wheel
cache) apply, so an offline machine can point pip at a folder holding the wheel.

    python ffi/flashinfer_headers.py DEST [--version VERSION]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys
import tempfile
import zipfile

# The FlashInfer release every native family is built and tested against.
FLASHINFER_VERSION = "0.7.2.post1"

# Members of the wheel the build reads (prefixes of paths inside it).
_MEMBERS = (
    "flashinfer/artifacts.py",
    "flashinfer/_build_meta.py",
    "flashinfer/data/include/",
    "flashinfer/data/cutlass/include/",
    "flashinfer/data/cutlass/tools/util/include/",
    "flashinfer/data/cccl/cub/",
    "flashinfer/data/cccl/thrust/",
    "flashinfer/data/cccl/libcudacxx/include/",
    "flashinfer/data/csrc/fmhaReduction.cu",
)


class FetchError(Exception):
    pass


def installed_package_dir(distribution: str, module: str, version: str) -> pathlib.Path | None:
    """The folder of `module` when `distribution` of exactly `version` is installed, else None.
    Found without importing it (importing flashinfer imports torch)."""
    try:
        if importlib.metadata.version(distribution) != version:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def unpack_wheel(requirement: str, dest: pathlib.Path, prefixes: tuple[str, ...]) -> None:
    """`pip download --no-deps requirement` and unpacks the members under `prefixes` into dest."""
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", "--dest", download, requirement]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise FetchError(f"`{' '.join(command)}` failed:\n{result.stderr}")
        wheels = list(pathlib.Path(download).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"expected one wheel for {requirement}, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist() if name.startswith(prefixes)]
            missing = [prefix for prefix in prefixes if not any(m.startswith(prefix) for m in members)]
            if missing:
                raise FetchError(f"{wheels[0].name} lacks {missing}")
            wheel.extractall(dest, members)


def fetch(dest: pathlib.Path, version: str = FLASHINFER_VERSION) -> pathlib.Path:
    """The data/ folder of flashinfer-python `version`: installed, or unpacked into dest."""
    installed = installed_package_dir("flashinfer-python", "flashinfer", version)
    if installed is not None and (installed / "data" / "include").is_dir():
        return installed / "data"
    data = dest / "flashinfer" / "data"
    stamp = dest / "VERSION"
    if stamp.is_file() and stamp.read_text().strip() == version and data.is_dir():
        return data
    unpack_wheel(f"flashinfer-python=={version}", dest, _MEMBERS)
    stamp.write_text(version + "\n")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=pathlib.Path)
    parser.add_argument("--version", default=FLASHINFER_VERSION)
    args = parser.parse_args()
    try:
        print(fetch(args.dest.resolve(), args.version))
    except FetchError as error:
        raise SystemExit(f"flashinfer_headers: {error}") from None


if __name__ == "__main__":
    main()
