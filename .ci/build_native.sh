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
