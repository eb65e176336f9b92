// Finding FlashInfer's TRTLLM-gen cubins on disk, without Python and without downloading.
//
// FlashInfer loads each TRTLLM-gen kernel lazily: its launcher asks a callback for
// "<artifact path>/<kernel>.cubin" with the sha256 its kernel table carries (cubin_loader.h in the
// flashinfer-python wheel; Python installs the callback with ctypes). Our callback (installed from
// C++ in trtllm_gen_decode.cu) reads the file from, in this order:
//   1. $FLASHINFER_CUBIN_DIR;
//   2. the flashinfer-cubin package's cubins/ folder, which Python registers at import when that
//      package's version equals flashinfer-python's (SetCubinPackageDir);
//   3. FlashInfer's cache, ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/cubins.
// FlashInfer itself uses only the first of these that exists and downloads what is missing; we try
// each in turn, accept the first file whose sha256 matches (FLASHINFER_CUBIN_CHECKSUM_DISABLED=1
// skips the check, as in FlashInfer) and never download: a miss is an error naming the file and
// every place tried.
#pragma once

#include <string>
#include <vector>

namespace jax_sparse_mla {

// The flashinfer-cubin package's cubin folder ("" when absent or of another version).
void SetCubinPackageDir(const std::string& dir);

// The folders searched, in order (read from the environment at each call).
std::vector<std::string> CubinSearchDirs();

// Reads `relative_path` (as FlashInfer names it, e.g. "<hash>/fmha/trtllm-gen//<kernel>.cubin")
// from the first search folder holding it with sha256 `sha256` (lower-case hex). Returns true with
// the bytes in *data, or false with a message in *error that names the file and each place tried.
bool ResolveCubin(const std::string& relative_path, const std::string& sha256, std::string* data,
                  std::string* error);

}  // namespace jax_sparse_mla
