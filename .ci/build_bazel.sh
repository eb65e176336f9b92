#!/usr/bin/env bash
# Builds the native extension with Bazel (BUILD.bazel) from local inputs: the XLA FFI headers of the
# jaxlib in .venv (`make demo` made it), nanobind (installed into .venv here), the pinned FlashInfer
# headers and the SM100 kernel table (the scripts under ffi/, which take them from pip's cache or
# fetch them, without torch) and this machine's CUDA toolkit. Installs Debian's Bazel
# (bazel-bootstrap, 4.2.3) when there is no bazel. The module lands in
# build/bazel-bin/_jax_sparse_mla_native.so, the Bazel state in build/bazel (both git-ignored).
# Then JAX_SPARSE_MLA_BAZEL_EXT=build/bazel-bin/_jax_sparse_mla_native.so pytest
# tests/test_bazel_build.py checks it against the installed CMake-built module.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

if ! command -v bazel >/dev/null 2>&1; then
  echo "build_bazel: installing bazel-bootstrap (Debian's Bazel)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bazel-bootstrap >/dev/null
fi

# The interpreter whose site-packages hold jax and nanobind (bazel/local_deps.bzl).
export PYTHON_BIN_PATH="${PYTHON_BIN_PATH:-$PWD/.venv/bin/python}"
"$PYTHON_BIN_PATH" -m pip install --quiet "nanobind==3.1.0"
output_base="${JAX_SPARSE_MLA_BAZEL_OUTPUT_BASE:-$PWD/build/bazel}"
# Each SM90 kernel file takes ~30 s and a few GB in nvcc; as many at once as the pip build allows.
jobs="${JAX_SPARSE_MLA_NVCC_JOBS:-2}"

status=0
bazel --output_base="$output_base" build --jobs="$jobs" --show_progress_rate_limit=30 //... ||
  status=$?
bazel --output_base="$output_base" shutdown
if [[ $status -ne 0 ]]; then
  echo "build_bazel: bazel build //... failed (exit $status)" >&2
  exit $status
fi
test -f build/bazel-bin/_jax_sparse_mla_native.so ||
  { echo "build_bazel: build/bazel-bin/_jax_sparse_mla_native.so was not produced" >&2; exit 1; }
echo "build_bazel: built build/bazel-bin/_jax_sparse_mla_native.so in $((SECONDS - start)) s"
