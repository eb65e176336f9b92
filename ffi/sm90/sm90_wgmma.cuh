// Helpers for warpgroup MMAs (wgmma) on SM90 with operands in shared memory: the operand
// descriptor (the proxy fence between threads' stores and wgmma's reads is sm90_async.cuh's
// FenceProxyAsync). Shared by the fp8 decode kernel (sm90_fp8_wide_kernel.cuh) and the indexer
// logits (indexer_logits.cuh).
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cstdint>

#include "sm90/sm90_async.cuh"

namespace jax_sparse_mla::sm90 {

// Descriptor of an unswizzled wgmma operand at `start`: core matrices 16 bytes wide, 8 rows of 16
// bytes each; `leading` and `stride` are the byte offsets of the next core matrix along the two
// dimensions (K-major: along K, then along M/N; MN-major: along K, then along M/N as well, in the
// canonical forms of CUTLASS's make_gmma_desc).
__device__ __forceinline__ uint64_t Descriptor(const void* start, int leading, int stride) {
  cute::GmmaDescriptor descriptor;
  descriptor.desc_ = 0;
  descriptor.bitfield.start_address_ = static_cast<uint16_t>(SmemAddress(start) >> 4);
  descriptor.bitfield.leading_byte_offset_ = static_cast<uint16_t>(leading >> 4);
  descriptor.bitfield.stride_byte_offset_ = static_cast<uint16_t>(stride >> 4);
  return descriptor.desc_;
}

// Descriptor of a K-major wgmma operand at `start` (1024-byte aligned, or a k offset of at most 96
// bytes from such an address) in the 128-byte swizzle: rows of 128 bytes of K, the 16-byte chunk c
// of row r stored at chunk c ^ (r % 8), 8-row atoms 1024 bytes apart, as a TMA load with
// CU_TENSOR_MAP_SWIZZLE_128B writes a box 128 bytes wide. A k-step of 32 bytes starts `32 ks` bytes
// in: the hardware applies the swizzle to the full address.
__device__ __forceinline__ uint64_t SwizzledKMajorDescriptor(const void* start) {
  cute::GmmaDescriptor descriptor;
  descriptor.desc_ = 0;
  descriptor.bitfield.start_address_ = static_cast<uint16_t>(SmemAddress(start) >> 4);
  descriptor.bitfield.leading_byte_offset_ = 1;  // unused: a k-step stays within one 128-byte row
  descriptor.bitfield.stride_byte_offset_ = 1024 >> 4;
  descriptor.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return descriptor.desc_;
}

}  // namespace jax_sparse_mla::sm90
