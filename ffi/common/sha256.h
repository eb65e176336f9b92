// A small self-contained SHA-256 (FIPS 180-4), for checking FlashInfer's cubins against the digests
// their kernel table carries. No OpenSSL: the extension must load on machines without it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_sparse_mla {

// Lower-case hexadecimal SHA-256 digest of `size` bytes at `data`.
std::string Sha256Hex(const void* data, size_t size);

}  // namespace jax_sparse_mla
