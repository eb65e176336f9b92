#!/usr/bin/env bash
# Compiles the native extension (ffi/) exactly as `pip install .` does, with the CUDA build required,
# so that a compile break fails CI. Needs nvcc, jax and flashinfer-python in the environment; no GPU.
# The wheel lands in build/native-wheel/ (git-ignored); nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_SPARSE_MLA_CUDA=ON
export JAX_SPARSE_MLA_NVCC_JOBS="${JAX_SPARSE_MLA_NVCC_JOBS:-2}"
start=$SECONDS
python -m pip wheel --no-build-isolation --no-deps --wheel-dir build/native-wheel . 2>&1 |
  grep -v "^ *$" | tail -n 25
wheel=$(ls -t build/native-wheel/jax_sparse_mla-*.whl | head -n 1)
python -m zipfile -l "$wheel" | grep -q "_jax_sparse_mla_native" ||
  { echo "build_native: $wheel holds no native extension" >&2; exit 1; }
echo "build_native: built $wheel in $((SECONDS - start)) s"

# The extension imports without a GPU driver (no libcuda link): check from the unpacked wheel that it
# registers every handler family (sm90, sm100 TRTLLM-gen, sm120) and run its CPU tests (SHA-256, cubin
# lookup, SM120 plan, validation, dispatch). Run from the unpacked folder so that it, not the source
# tree, provides jax_sparse_mla.
unpacked=build/native-wheel/unpacked
rm -rf "$unpacked" && mkdir -p "$unpacked"
python -m zipfile -e "$wheel" "$unpacked"
tests=$PWD/tests
(cd "$unpacked" && JAX_SPARSE_MLA_REQUIRE_NATIVE=1 PYTHONPATH=. python -m pytest -q -p no:cacheprovider \
  "$tests/test_native_cpu.py" 2>&1 | tail -n 3; exit "${PIPESTATUS[0]}")
echo "build_native: the extension's CPU tests passed"
