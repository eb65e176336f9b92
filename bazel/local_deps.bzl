"""Repository rules that take the native build's external inputs from this machine.

Nothing is downloaded: each rule locates an installed package the way ffi/CMakeLists.txt does (with
the same overrides), symlinks the directory into an external repository and writes its BUILD file
from a template in bazel/third_party/.

  @local_config_python  Python headers of the interpreter (sysconfig's include dir)
  @nanobind             nanobind's sources and headers from its pip package (python -m nanobind)
  @xla_ffi              XLA FFI headers of the installed jaxlib (jax.ffi.include_dir())
  @flashinfer           flashinfer-python's data/ folder: FlashInfer, CUTLASS and CCCL headers, FlashInfer
                        sources, and the TRTLLM-gen kernel table when a cubin folder has it
  @local_config_cuda    the CUDA toolkit: nvcc, headers, libcudart_static

The interpreter is $PYTHON_BIN_PATH (as in jaxlib's build), else python3, else python on PATH.
XLA_FFI_INCLUDE_DIR, FLASHINFER_DATA_DIR, JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO and CUDA_PATH (or
CUDA_HOME) override the discovery, like the CMake cache variables of the same names (the TRTLLM-gen
search also reads FLASHINFER_CUBIN_DIR, FLASHINFER_WORKSPACE_BASE and HOME, as CMake does). Set
them in the environment or with --repo_env=NAME=...; a change re-runs the rule, and so does
`bazel sync` after installing packages elsewhere.
"""

_PYTHON_ENV = ["PYTHON_BIN_PATH", "PATH"]

def _python(rctx):
    path = rctx.os.environ.get("PYTHON_BIN_PATH", "")
    if path:
        if not rctx.path(path).exists:
            fail("PYTHON_BIN_PATH=%s does not exist" % path)
        return path
    for name in ("python3", "python"):
        found = rctx.which(name)
        if found:
            return str(found)
    fail("no python3 or python on PATH; set PYTHON_BIN_PATH to the interpreter that has jax, " +
         "nanobind and flashinfer-python installed")

def _python_output(rctx, code, what):
    python = _python(rctx)
    result = rctx.execute([python, "-c", code])
    if result.return_code != 0:
        fail("@%s: could not locate %s with %s:\n%s" % (rctx.name, what, python, result.stderr))
    return result.stdout.strip()

def _require(rctx, path, what, hint):
    if not rctx.path(path).exists:
        fail("@%s: %s not found at %s (%s)" % (rctx.name, what, path, hint))

def _write_build(rctx, substitutions = {}):
    rctx.template("BUILD.bazel", rctx.attr.build_file, substitutions, executable = False)

def _local_python_impl(rctx):
    include = _python_output(
        rctx,
        "import sysconfig; print(sysconfig.get_paths()['include'])",
        "the Python headers",
    )
    _require(rctx, include + "/Python.h", "Python.h", "install the interpreter's development headers")
    rctx.symlink(include, "include")
    _write_build(rctx)

local_python_repository = repository_rule(
    implementation = _local_python_impl,
    attrs = {"build_file": attr.label(default = Label("//bazel/third_party:python.BUILD"))},
    environ = _PYTHON_ENV,
    local = True,
)

def _local_nanobind_impl(rctx):
    root = _python_output(
        rctx,
        "import nanobind, os; print(os.path.dirname(os.path.abspath(nanobind.__file__)))",
        "the nanobind pip package (pip install nanobind)",
    )
    _require(rctx, root + "/src/nb_func.cpp", "nanobind's sources", "this nanobind install has no src/")
    _require(rctx, root + "/ext/robin_map/include/tsl/robin_map.h", "robin_map", "nanobind's ext/")
    rctx.symlink(root, "nanobind")
    _write_build(rctx)

local_nanobind_repository = repository_rule(
    implementation = _local_nanobind_impl,
    attrs = {"build_file": attr.label(default = Label("//bazel/third_party:nanobind.BUILD"))},
    environ = _PYTHON_ENV,
    local = True,
)

def _local_xla_ffi_impl(rctx):
    include = rctx.os.environ.get("XLA_FFI_INCLUDE_DIR", "")
    if not include:
        include = _python_output(
            rctx,
            "import jax.ffi; print(jax.ffi.include_dir())",
            "the XLA FFI headers (jax.ffi.include_dir(); pip install jax jaxlib)",
        )
    _require(rctx, include + "/xla/ffi/api/ffi.h", "xla/ffi/api/ffi.h", "set XLA_FFI_INCLUDE_DIR")
    rctx.symlink(include, "include")
    _write_build(rctx)

local_xla_ffi_repository = repository_rule(
    implementation = _local_xla_ffi_impl,
    attrs = {"build_file": attr.label(default = Label("//bazel/third_party:xla_ffi.BUILD"))},
    environ = _PYTHON_ENV + ["XLA_FFI_INCLUDE_DIR"],
    local = True,
)

# FlashInfer's TRTLLM-gen kernel table (flashInferMetaInfo.h) ships with the cubins, not with the
# wheel: found as ffi/CMakeLists.txt finds it (JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO, else
# <cubin folder>/<TRTLLM_GEN_FMHA artifact>/include/ in $FLASHINFER_CUBIN_DIR, the flashinfer-cubin
# package, ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/cubins). Prints the artifact
# path, the header (or an empty line) and its sha256 (or an empty line).
_TRTLLM_GEN_LOCATE = """
import hashlib, importlib.util, os, pathlib, re, sys
data = pathlib.Path(sys.argv[1])
text = (data.parent / "artifacts.py").read_text()
artifact = re.search(r'TRTLLM_GEN_FMHA: str = "([^"]+)"', text).group(1)
metainfo = os.environ.get("JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO", "")
if not metainfo:
    dirs = []
    if "FLASHINFER_CUBIN_DIR" in os.environ:
        dirs.append(os.environ["FLASHINFER_CUBIN_DIR"])
    spec = importlib.util.find_spec("flashinfer_cubin")
    if spec:
        dirs.append(str(pathlib.Path(next(iter(spec.submodule_search_locations))) / "cubins"))
    if "FLASHINFER_WORKSPACE_BASE" in os.environ:
        dirs.append(os.environ["FLASHINFER_WORKSPACE_BASE"] + "/.cache/flashinfer/cubins")
    elif "HOME" in os.environ:
        dirs.append(os.environ["HOME"] + "/.cache/flashinfer/cubins")
    for d in dirs:
        candidate = pathlib.Path(d) / artifact / "include" / "flashInferMetaInfo.h"
        if candidate.exists():
            metainfo = str(candidate)
            break
digest = hashlib.sha256(pathlib.Path(metainfo).read_bytes()).hexdigest() if metainfo else ""
print(artifact)
print(metainfo)
print(digest)
"""

def _local_flashinfer_impl(rctx):
    data = rctx.os.environ.get("FLASHINFER_DATA_DIR", "")
    if not data:
        # find_spec locates the package without importing it (importing flashinfer pulls in torch).
        data = _python_output(
            rctx,
            "import importlib.util, pathlib; s = importlib.util.find_spec('flashinfer'); " +
            "print(pathlib.Path(next(iter(s.submodule_search_locations))) / 'data')",
            "flashinfer-python (pip install flashinfer-python)",
        )
    _require(
        rctx,
        data + "/include/flashinfer/attention/mla_hopper.cuh",
        "FlashInfer's MLA headers",
        "set FLASHINFER_DATA_DIR to flashinfer-python's data/ folder",
    )
    rctx.symlink(data, "data")
    python = _python(rctx)
    result = rctx.execute([python, "-c", _TRTLLM_GEN_LOCATE, data])
    if result.return_code != 0:
        fail("@%s: cannot read TRTLLM_GEN_FMHA from flashinfer/artifacts.py:\n%s" % (
            rctx.name,
            result.stderr,
        ))
    lines = (result.stdout + "\n\n").split("\n")
    trtllm_gen = {"artifact": lines[0].strip(), "metainfo": lines[1].strip(), "hash": lines[2].strip()}
    if trtllm_gen["metainfo"]:
        rctx.symlink(rctx.path(trtllm_gen["metainfo"]).dirname, "trtllm_gen_metainfo")
    else:
        # ffi/CMakeLists.txt then compiles the SM100 handler against ffi/trtllm_gen_stub (no kernel).
        rctx.file("trtllm_gen_metainfo/.none", "", executable = False)
    rctx.file("trtllm_gen.bzl", "\n".join([
        '"""The TRTLLM-gen artifact of FlashInfer (written by bazel/local_deps.bzl)."""',
        "",
        'TRTLLM_GEN_FMHA_CUBIN_PATH = "%s"' % trtllm_gen["artifact"],
        'TRTLLM_GEN_FMHA_METAINFO_HASH = "%s"' % trtllm_gen["hash"],
        "TRTLLM_GEN_METAINFO_FOUND = %s" % bool(trtllm_gen["metainfo"]),
        'TRTLLM_GEN_METAINFO = "%s"' % trtllm_gen["metainfo"],
        "",
    ]), executable = False)
    rctx.template("headers.bzl", rctx.attr._headers_bzl, {}, executable = False)
    _write_build(rctx)

local_flashinfer_repository = repository_rule(
    implementation = _local_flashinfer_impl,
    attrs = {
        "build_file": attr.label(default = Label("//bazel/third_party:flashinfer.BUILD")),
        "_headers_bzl": attr.label(default = Label("//bazel:headers.bzl")),
    },
    environ = _PYTHON_ENV + [
        "FLASHINFER_DATA_DIR",
        "JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO",
        "FLASHINFER_CUBIN_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        "HOME",
    ],
    local = True,
)

def _cuda_root(rctx):
    for name in ("CUDA_PATH", "CUDA_HOME"):
        path = rctx.os.environ.get(name, "")
        if path:
            return path
    if rctx.path("/usr/local/cuda/bin/nvcc").exists:
        return "/usr/local/cuda"
    nvcc = rctx.which("nvcc")
    if nvcc:
        return str(nvcc.realpath.dirname.dirname)
    fail("@%s: no CUDA toolkit: set CUDA_PATH (no /usr/local/cuda, no nvcc on PATH)" % rctx.name)

def _local_cuda_impl(rctx):
    root = str(rctx.path(_cuda_root(rctx)).realpath)
    _require(rctx, root + "/bin/nvcc", "nvcc", "set CUDA_PATH to the CUDA toolkit")
    result = rctx.execute([root + "/bin/nvcc", "--version"])
    if result.return_code != 0:
        fail("@%s: %s/bin/nvcc --version failed:\n%s" % (rctx.name, root, result.stderr))
    version = None
    for line in result.stdout.splitlines():
        if "release " in line:
            version = line.split("release ")[1].split(",")[0].strip()
    if not version:
        fail("@%s: no release in nvcc --version:\n%s" % (rctx.name, result.stdout))
    libdir = None
    for candidate in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if rctx.path("%s/%s/libcudart_static.a" % (root, candidate)).exists:
            libdir = candidate
            break
    if not libdir:
        fail("@%s: no libcudart_static.a under %s" % (rctx.name, root))
    rctx.symlink(root, "cuda")
    rctx.file("defs.bzl", "\n".join([
        '"""The local CUDA toolkit (written by @jax_sparse_mla//bazel:local_deps.bzl)."""',
        "",
        'CUDA_PATH = "%s"' % root,
        "CUDA_VERSION = (%s)" % ", ".join(version.split(".")),
        "",
    ]), executable = False)
    _write_build(rctx, {"%{libdir}": libdir})

local_cuda_repository = repository_rule(
    implementation = _local_cuda_impl,
    attrs = {"build_file": attr.label(default = Label("//bazel/third_party:cuda.BUILD"))},
    environ = ["CUDA_PATH", "CUDA_HOME", "PATH"],
    local = True,
)

def jax_sparse_mla_local_deps():
    """Declares the external repositories of the native build (call from WORKSPACE)."""
    local_python_repository(name = "local_config_python")
    local_nanobind_repository(name = "nanobind")
    local_xla_ffi_repository(name = "xla_ffi")
    local_flashinfer_repository(name = "flashinfer")
    local_cuda_repository(name = "local_config_cuda")
