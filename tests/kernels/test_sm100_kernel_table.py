"""CPU proof of the SM100 (TRTLLM-gen) path against FlashInfer's real kernel table and cubins.

No B200 here: nothing runs on SM100 hardware. What runs is the extension's
`trtllm_gen_select_kernel`, which builds the TRTLLM-gen handler's runner parameters for a configuration
and runs FlashInfer's own host code on them (TllmGenFmhaKernel of flashinfer-python 0.6.13 over the
flashInferMetaInfo.h table of flashinfer-cubin 0.6.13: kernel selection with its re-selection passes,
the cubin request through the handler's loader, which reads the file and checks its sha256, module
load, TMA descriptors and launch configuration) up to cuLaunchKernelEx, where the driver shim records
the launch instead of making it. These tests check, for every configuration the handler accepts, that a
kernel is found, that the cubin it names is in the installed flashinfer-cubin with the sha256 the table
lists, and that configurations the table lacks are rejected with FlashInfer's message before any cubin
is requested or launch set up.

Skips when the extension (with the sm100 family) or flashinfer-cubin of the version the extension was
built against is not installed; JAX_SPARSE_MLA_REQUIRE_NATIVE=1 turns those skips into failures.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import os
import pathlib
import re

import pytest

from jax_sparse_mla.kernels import native
from jax_sparse_mla.kernels import sm100_trtllm_gen as trtllm_gen
from jax_sparse_mla.kernels.registry import Problem

KV_LAYOUT = {"bfloat16": "bfloat16", "float16": "float16", "float8_e4m3fn": "fp8_e4m3"}
TABLE_DTYPES = ("bfloat16", "float8_e4m3fn")
PAGE_SIZES = (32, 64)
Q_LENS = (1, 2, 3, 4)
# DeepSeek-V3.2 / GLM-5 under tensor parallelism (128 / TP) and the other head counts FlashInfer takes.
HEADS = (8, 16, 32, 40, 48, 64, 128, 256)
# 2048 is the models' index_topk; the kernel takes any positive multiple of 4.
TOP_KS = (4, 128, 512, 1000, 2048, 4096)
BATCHES = (1, 2, 8, 64, 512)
# (SM, SM count): B200 (sm_100, 148 SMs); B300 (sm_103, 148 SMs) and a 160-SM part, since the
# launcher's split-KV and tile choices depend on the SM count.
GPUS = ((100, 148), (103, 148), (103, 160))


def _require(reason: str):
    if os.environ.get("JAX_SPARSE_MLA_REQUIRE_NATIVE") == "1":
        pytest.fail(f"JAX_SPARSE_MLA_REQUIRE_NATIVE=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def ext():
    if native.module is None:
        _require(f"the native extension is not importable ({native.import_error})")
    if not hasattr(native.module, "trtllm_gen_select_kernel"):
        _require("the native extension was built without the sm100 (TRTLLM-gen) family")
    return native.module


@pytest.fixture(scope="module")
def table(ext):
    """The installed flashinfer-cubin's artifact folder of the table compiled in."""
    info = native.build_info()
    version = info["trtllm_gen_flashinfer_version"]
    spec = importlib.util.find_spec("flashinfer_cubin")
    if spec is None or not spec.submodule_search_locations:
        _require(f"flashinfer-cubin=={version} is not installed (pip install flashinfer-cubin=={version})")
    installed = importlib.metadata.version("flashinfer-cubin")
    if installed != version:
        _require(f"flashinfer-cubin {installed} is installed, the extension's table is {version}'s")
    cubins = pathlib.Path(next(iter(spec.submodule_search_locations))) / "cubins"
    assert native.flashinfer_cubin_package_dir() == str(cubins)
    assert str(cubins) in ext.cubin_search_dirs()
    return cubins / info["trtllm_gen_cubin_path"]


@functools.lru_cache(maxsize=None)
def file_sha256(path: pathlib.Path) -> tuple[str, int]:
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


@functools.lru_cache(maxsize=None)
def requested_hashes(table: pathlib.Path) -> frozenset[str]:
    """sha256s the artifact's checksums.txt lists."""
    return frozenset(line.split()[0] for line in (table / "checksums.txt").read_text().splitlines()
                     if line.strip())


def select(ext, dtype, page_size, heads, q_len, top_k, batch=1, gpu=(100, 148), read_cubins=True):
    sm, sm_count = gpu
    return ext.trtllm_gen_select_kernel(dtype, dtype, page_size, heads, q_len, top_k, batch=batch,
                                        sm=sm, sm_count=sm_count, read_cubins=read_cubins)


def problem(dtype, page_size, heads, top_k, batch=1):
    return Problem(num_tokens=batch, num_heads=heads, num_keys=top_k, block_size=page_size,
                   kv_layout=KV_LAYOUT[dtype], q_dtype=dtype)


def test_build_records_the_real_table(ext, table):
    info = native.build_info()
    header = table / "include" / "flashInferMetaInfo.h"
    text = header.read_text()
    entries = len(re.findall(r"^\{ DATA_TYPE_", text, flags=re.M))
    assert info["trtllm_gen_num_kernels"] == entries > 0
    assert info["trtllm_gen_metainfo_hash"] == file_sha256(header)[0]
    # The header is the one FlashInfer's checksums.txt of that artifact lists.
    listed = dict(reversed(line.split()) for line in (table / "checksums.txt").read_text().splitlines()
                  if line.strip())
    assert listed["include/flashInferMetaInfo.h"] == info["trtllm_gen_metainfo_hash"]


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_every_accepted_configuration_selects_a_listed_cubin(ext, table, dtype, page_size):
    checked = 0
    for heads, q_len, top_k, batch, gpu in itertools.product(HEADS, Q_LENS, TOP_KS, BATCHES, GPUS):
        assert trtllm_gen.check_problem(problem(dtype, page_size, heads, top_k, batch)) is None
        where = f"{dtype} page {page_size} H={heads} q_len={q_len} K={top_k} B={batch} sm{gpu}"
        result = select(ext, dtype, page_size, heads, q_len, top_k, batch, gpu)
        assert result["error"] == "", where
        # Each selection pass may load a kernel; every cubin requested passed the loader's check.
        assert result["launched"] and result["modules_loaded"] == len(result["requested_cubins"]) >= 1
        for requested in result["requested_cubins"]:
            assert file_sha256(table / pathlib.Path(requested).name)[0] in requested_hashes(table), where
        name = result["function_name"]
        assert name.startswith("fmhaSm10") and "StaticTokenSparse" in name, (where, name)
        assert result["table_index"] >= 0, where
        # The loader was asked for <artifact>/<function>.cubin with the table's sha256 ...
        relative = re.sub(r"/+", "/", result["cubin_path"])
        assert relative == native.build_info()["trtllm_gen_cubin_path"].rstrip("/") + f"/{name}.cubin"
        assert result["cubin_sha256"] == result["table_sha256"], where
        # ... and the file in flashinfer-cubin has exactly that sha256 (hashed here, independently).
        digest, size = file_sha256(table / f"{name}.cubin")
        assert digest == result["cubin_sha256"], where
        assert size == result["cubin_bytes"], where
        assert result["shared_mem_bytes"] == result["table_shared_mem_bytes"], where
        assert result["block"][0] == result["table_threads"], where
        assert min(result["grid"]) >= 1, where
        checked += 1
    assert checked == len(HEADS) * len(Q_LENS) * len(TOP_KS) * len(BATCHES) * len(GPUS)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float8_e4m3fn"))
def test_check_problem_is_the_tables_rule(ext, dtype):
    """For H = 1..520: the Python-side check accepts exactly the shapes FlashInfer's selection finds."""
    for heads in range(1, 521):
        if 64 < heads < 128:
            continue
        accepted = trtllm_gen.check_problem(problem(dtype, 64, heads, 2048)) is None
        for page_size, q_len, top_k, batch, gpu in itertools.product(
                PAGE_SIZES, (1, 4), (4, 2048), (1, 512), GPUS):
            result = select(ext, dtype, page_size, heads, q_len, top_k, batch, gpu, read_cubins=False)
            assert (result["error"] == "") == accepted, (dtype, heads, page_size, q_len, top_k, batch,
                                                         gpu, result["error"])


@pytest.mark.parametrize("dtype,heads,fragment", [
    ("float16", 128, "Missing TRTLLM-GEN kernel (decode): qkvLayout=2"),
    ("float16", 16, "Missing TRTLLM-GEN kernel (decode): qkvLayout=2"),
    ("bfloat16", 4, "Missing TRTLLM-GEN kernel (decode): qkvLayout=2"),
    ("float8_e4m3fn", 1, "Missing TRTLLM-GEN kernel (decode): qkvLayout=2"),
    ("bfloat16", 24, "The tileSizeQ and tileSizeKv must be power of 2."),
    ("float8_e4m3fn", 129, "The numHeadsQ/numHeadsKv is not supported."),
])
def test_configurations_the_table_lacks_are_rejected_before_any_launch(ext, table, dtype, heads,
                                                                       fragment):
    """FlashInfer's own message, raised by its host code before a cubin is requested or launched."""
    assert trtllm_gen.check_problem(problem(dtype, 64, heads, 2048)) is not None
    result = select(ext, dtype, 64, heads, 1, 2048)
    assert fragment in result["error"]
    assert not result["launched"]
    if "Missing TRTLLM-GEN kernel" in fragment:
        assert result["cubin_path"] == "" and result["modules_loaded"] == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(page_size=16), "page_size must be 32 or 64"),
    (dict(heads=96), "64 < num_heads < 128 is not supported"),
    (dict(top_k=2046), "sparse_mla_top_k must be a positive multiple of 4"),
])
def test_handler_rules_reject_first(ext, kwargs, message):
    args = dict(dtype="bfloat16", page_size=64, heads=128, q_len=1, top_k=2048)
    args.update(kwargs)
    result = select(ext, **args)
    assert result["error"] == f"jax_sparse_mla trtllm-gen decode: {message}"
    assert result["info"] == "" and not result["launched"]


def test_mixed_dtypes_are_rejected(ext):
    result = ext.trtllm_gen_select_kernel("bfloat16", "float8_e4m3fn", 64, 128, 1, 2048)
    assert "q and kv_cache must both be" in result["error"]


def test_missing_or_altered_cubin_is_an_error_not_a_download(ext, table, tmp_path, monkeypatch):
    good = select(ext, "bfloat16", 64, 128, 1, 2048, batch=32)
    name = good["function_name"]
    artifact = native.build_info()["trtllm_gen_cubin_path"]
    package = native.flashinfer_cubin_package_dir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path / "cubins"))
    try:
        ext.set_cubin_package_dir("")
        missing = select(ext, "bfloat16", 64, 128, 1, 2048, batch=32)
        assert f"{name}.cubin" in missing["error"] and "never downloads" in missing["error"]
        assert not missing["launched"]
        altered = tmp_path / "cubins" / artifact / f"{name}.cubin"
        altered.parent.mkdir(parents=True)
        altered.write_bytes((table / f"{name}.cubin").read_bytes() + b"\0")
        wrong = select(ext, "bfloat16", 64, 128, 1, 2048, batch=32)
        assert f"expected {good['cubin_sha256']}" in wrong["error"] and not wrong["launched"]
    finally:
        ext.set_cubin_package_dir(package)
    assert select(ext, "bfloat16", 64, 128, 1, 2048, batch=32)["error"] == ""


def test_sm100_extra_pins_the_table_release(ext):
    """`pip install "jax-sparse-mla[sm100]"` installs the flashinfer-cubin the table was compiled from."""
    try:
        requirements = importlib.metadata.requires("jax-sparse-mla") or []
    except importlib.metadata.PackageNotFoundError:
        _require("jax-sparse-mla is not installed (its metadata holds the sm100 extra)")
    pins = [r.split(";")[0].strip() for r in requirements
            if r.startswith("flashinfer-cubin") and 'extra == "sm100"' in r]
    version = native.build_info()["trtllm_gen_flashinfer_version"]
    assert pins == [f"flashinfer-cubin=={version}"], requirements
