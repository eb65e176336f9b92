"""Repository rules that take the native build's external inputs from this machine.

Each rule locates its input the way ffi/CMakeLists.txt does (with the same overrides), symlinks the
directory into an external repository and writes its BUILD file from a template in
bazel/third_party/. Bazel downloads nothing itself; FlashInfer's headers and the SM100 kernel table
come from the same scripts under ffi/ that CMake runs (installed packages, else pip, without torch).

  @local_config_python  Python headers of the interpreter (sysconfig's include dir)
  @nanobind             nanobind's sources and headers from its pip package (python -m nanobind)
  @xla_ffi              XLA FFI headers of the installed jaxlib (jax.ffi.include_dir())
  @flashinfer           the pinned flashinfer-python's data/ folder (ffi/flashinfer_headers.py):
                        FlashInfer, CUTLASS and CCCL headers and FlashInfer sources
  @flashinfer_sm100     the SM100 family's FlashInfer release and its TRTLLM-gen kernel table
                        (ffi/sm100/trtllm_gen_table.py)
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

def _script_lines(rctx, script, args, what):
    """Runs one of ffi/'s Python scripts (the ones CMake runs) and returns its output lines."""
    result = rctx.execute([_python(rctx), str(rctx.path(script))] + args, quiet = True)
    if result.return_code != 0:
        fail("@%s: %s failed:\n%s" % (rctx.name, what, result.stderr))
    return [line.strip() for line in result.stdout.strip().split("\n")]

def _local_flashinfer_impl(rctx):
    # FLASHINFER_DATA_DIR, else ffi/flashinfer_headers.py: the pinned flashinfer-python's data/
    # folder, installed or fetched without torch into this repository, as the CMake build does.
    data = rctx.os.environ.get("FLASHINFER_DATA_DIR", "")
    if not data:
        data = _script_lines(rctx, rctx.attr._headers_script, [str(rctx.path("fetched"))],
                             "ffi/flashinfer_headers.py")[-1]
    _require(
        rctx,
        data + "/include/flashinfer/attention/mla_hopper.cuh",
        "FlashInfer's MLA headers",
        "set FLASHINFER_DATA_DIR to flashinfer-python's data/ folder",
    )
    rctx.symlink(data, "data")
    rctx.file("trtllm_gen_metainfo/.none", "", executable = False)
    rctx.template("headers.bzl", rctx.attr._headers_bzl, {}, executable = False)
    _write_build(rctx)

local_flashinfer_repository = repository_rule(
    implementation = _local_flashinfer_impl,
    attrs = {
        "build_file": attr.label(default = Label("//bazel/third_party:flashinfer.BUILD")),
        "_headers_bzl": attr.label(default = Label("//bazel:headers.bzl")),
        "_headers_script": attr.label(default = Label("//:ffi/flashinfer_headers.py")),
    },
    environ = _PYTHON_ENV + ["FLASHINFER_DATA_DIR"],
    local = True,
)

# The SM100 family's FlashInfer release and its TRTLLM-gen kernel table, as ffi/CMakeLists.txt
# finds them: ffi/sm100/trtllm_gen_table.py (JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO, FLASHINFER_CUBIN_DIR,
# the installed flashinfer-cubin, FlashInfer's cache, else the pinned wheel fetched with pip; the
# table verified against the release's checksums). Without a table the family is left out
# (trtllm_gen.bzl: TRTLLM_GEN_FOUND = False), as CMake does under AUTO.
def _local_flashinfer_sm100_impl(rctx):
    args = [str(rctx.path("fetched"))]
    metainfo = rctx.os.environ.get("JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO", "")
    if metainfo:
        args += ["--metainfo", metainfo]
    result = rctx.execute([_python(rctx), str(rctx.path(rctx.attr._table_script))] + args,
                          quiet = True)
    found = result.return_code == 0
    if found:
        data, artifact, header, digest, version = [
            line.strip()
            for line in result.stdout.strip().split("\n")
        ]
        rctx.symlink(data, "data")
        rctx.symlink(rctx.path(header).dirname, "trtllm_gen_metainfo")
    else:
        # buildifier: disable=print
        print("@%s: building without the sm100 family: %s" % (rctx.name, result.stderr))
        artifact, digest, version = "", "", ""
        rctx.file("data/.none", "", executable = False)
        rctx.file("trtllm_gen_metainfo/.none", "", executable = False)
    rctx.file("trtllm_gen.bzl", "\n".join([
        '"""The SM100 family of FlashInfer: its release and kernel table (bazel/local_deps.bzl)."""',
        "",
        "TRTLLM_GEN_FOUND = %s" % found,
        'TRTLLM_GEN_FMHA_CUBIN_PATH = "%s"' % artifact,
        'TRTLLM_GEN_FMHA_METAINFO_HASH = "%s"' % digest,
        'TRTLLM_GEN_FLASHINFER_VERSION = "%s"' % version,
        "",
    ]), executable = False)
    rctx.template("headers.bzl", rctx.attr._headers_bzl, {}, executable = False)
    _write_build(rctx)

local_flashinfer_sm100_repository = repository_rule(
    implementation = _local_flashinfer_sm100_impl,
    attrs = {
        "build_file": attr.label(default = Label("//bazel/third_party:flashinfer.BUILD")),
        "_headers_bzl": attr.label(default = Label("//bazel:headers.bzl")),
        "_table_script": attr.label(default = Label("//:ffi/sm100/trtllm_gen_table.py")),
    },
    environ = _PYTHON_ENV + [
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
    local_flashinfer_sm100_repository(name = "flashinfer_sm100")
    local_cuda_repository(name = "local_config_cuda")
