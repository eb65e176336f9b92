"""Finds the FlashInfer release the SM100 (TRTLLM-gen) family is built against, and its kernel table.

The TRTLLM-gen launcher code (headers of the flashinfer-python wheel) and the kernel table
(include/flashInferMetaInfo.h of the TRTLLM-gen cubin artifact, shipped by the flashinfer-cubin
wheel) must come from the same FlashInfer release: the table's struct and the KernelParams layout the
cubins read change between releases, and each release pins its own artifact (flashinfer/artifacts.py:
ArtifactPath.TRTLLM_GEN_FMHA and CheckSumHash.TRTLLM_GEN_FMHA). The newest flashinfer-cubin on PyPI
is older than the flashinfer-python the other families use, so this family is pinned to a pair of the
same version, FLASHINFER_SM100_VERSION.

    python ffi/sm100/trtllm_gen_table.py DEST [--metainfo FILE]

prints five lines for ffi/CMakeLists.txt (and bazel/local_deps.bzl):

    <flashinfer data/ folder of FLASHINFER_SM100_VERSION>   (headers; ffi/flashinfer_headers.py)
    <artifact path, e.g. 158f6fa.../fmha/trtllm-gen/>
    <path of the verified flashInferMetaInfo.h>
    <its sha256>
    <FLASHINFER_SM100_VERSION>

The table is taken from, in this order: --metainfo (JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO);
$FLASHINFER_CUBIN_DIR; the installed flashinfer-cubin package when its version is
FLASHINFER_SM100_VERSION; ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/cubins; else the
flashinfer-cubin wheel of that version is fetched with pip (`pip download --no-deps`, ~460 MB, a
cache hit when it was pip-installed before) and only the header and checksums.txt are unpacked into
DEST. Whatever the source, the header must match the chain of hashes FlashInfer itself checks:
sha256(checksums.txt) == CheckSumHash.TRTLLM_GEN_FMHA of the pinned flashinfer-python, and the
header's sha256 == its line in checksums.txt. Exits non-zero with a message otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import re
import sys

# flashinfer-python and flashinfer-cubin of this version: the newest flashinfer-cubin on PyPI.
FLASHINFER_SM100_VERSION = "0.6.13"

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
import flashinfer_headers  # noqa: E402  (ffi/flashinfer_headers.py)


class TableError(Exception):
    pass


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pinned_artifact(data_dir: pathlib.Path) -> tuple[str, str]:
    """(ArtifactPath.TRTLLM_GEN_FMHA, CheckSumHash.TRTLLM_GEN_FMHA) from artifacts.py next to data/."""
    text = (data_dir.parent / "artifacts.py").read_text()
    path = re.search(r'TRTLLM_GEN_FMHA: str = "([^"]+)"', text)
    checksum = re.search(r'TRTLLM_GEN_FMHA: str = \(\s*"([0-9a-f]{64})"\s*\)', text)
    if path is None or checksum is None:
        raise TableError(f"cannot read TRTLLM_GEN_FMHA from {data_dir.parent / 'artifacts.py'}")
    return path.group(1), checksum.group(1)


def verify(metainfo: pathlib.Path, checksums_sha256: str) -> str:
    """The header's sha256 after checking it against its artifact's checksums.txt."""
    checksums = metainfo.parent.parent / "checksums.txt"
    if not checksums.is_file():
        raise TableError(f"{checksums} is missing (needed to verify {metainfo})")
    actual = _sha256(checksums)
    if actual != checksums_sha256:
        raise TableError(f"{checksums}: sha256 {actual}, FlashInfer {FLASHINFER_SM100_VERSION} "
                         f"pins {checksums_sha256}")
    listed = None
    for line in checksums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == "include/flashInferMetaInfo.h":
            listed = parts[0]
    digest = _sha256(metainfo)
    if listed != digest:
        raise TableError(f"{metainfo}: sha256 {digest}, checksums.txt lists {listed}")
    return digest


def cubin_package_dir() -> pathlib.Path | None:
    """cubins/ of an installed flashinfer-cubin of FLASHINFER_SM100_VERSION."""
    package = flashinfer_headers.installed_package_dir("flashinfer-cubin", "flashinfer_cubin",
                                                       FLASHINFER_SM100_VERSION)
    return None if package is None else package / "cubins"


def cubin_dirs() -> list[pathlib.Path]:
    dirs = []
    if os.environ.get("FLASHINFER_CUBIN_DIR"):
        dirs.append(pathlib.Path(os.environ["FLASHINFER_CUBIN_DIR"]))
    package = cubin_package_dir()
    if package is not None:
        dirs.append(package)
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.environ.get("HOME")
    if base:
        dirs.append(pathlib.Path(base) / ".cache/flashinfer/cubins")
    return dirs


def fetch_from_wheel(dest: pathlib.Path, artifact: str) -> pathlib.Path:
    """Unpacks <artifact>/{include/flashInferMetaInfo.h, checksums.txt} of the pinned wheel into dest."""
    prefix = "flashinfer_cubin/cubins/" + artifact.rstrip("/") + "/"
    members = (prefix + "include/flashInferMetaInfo.h", prefix + "checksums.txt")
    target = dest / members[0]
    if target.is_file() and (dest / members[1]).is_file():
        return target
    try:
        flashinfer_headers.unpack_wheel(f"flashinfer-cubin=={FLASHINFER_SM100_VERSION}", dest, members)
    except flashinfer_headers.FetchError as error:
        raise TableError(str(error)) from None
    return target


def find(dest: pathlib.Path, metainfo: str = "") -> tuple[pathlib.Path, str, pathlib.Path, str]:
    """(data dir, artifact path, verified metainfo header, its sha256)."""
    data_dir = flashinfer_headers.fetch(dest / "flashinfer", FLASHINFER_SM100_VERSION)
    artifact, checksums_sha256 = pinned_artifact(data_dir)
    if metainfo:
        path = pathlib.Path(metainfo).resolve()
        return data_dir, artifact, path, verify(path, checksums_sha256)
    rejected = []
    for folder in cubin_dirs():
        candidate = folder / artifact / "include" / "flashInferMetaInfo.h"
        if candidate.is_file():
            try:
                return data_dir, artifact, candidate, verify(candidate, checksums_sha256)
            except TableError as error:
                rejected.append(str(error))
    for message in rejected:
        print(f"trtllm_gen_table: skipped: {message}", file=sys.stderr)
    path = fetch_from_wheel(dest / "flashinfer-cubin", artifact)
    return data_dir, artifact, path, verify(path, checksums_sha256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=pathlib.Path)
    parser.add_argument("--metainfo", default="")
    args = parser.parse_args()
    try:
        data_dir, artifact, path, digest = find(args.dest.resolve(), args.metainfo)
    except (TableError, SystemExit) as error:
        raise SystemExit(f"trtllm_gen_table: {error}") from None
    print(data_dir)
    print(artifact)
    print(path)
    print(digest)
    print(FLASHINFER_SM100_VERSION)


if __name__ == "__main__":
    main()
