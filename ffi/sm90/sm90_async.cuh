// PTX wrappers for the SM90 kernels' asynchronous copies: shared-memory addresses, mbarriers and
// bulk copies by the copy engine. Shared by our fp8 decode kernels and the indexer kernels.
#pragma once

#include <cstdint>

namespace jax_sparse_mla::sm90 {

__device__ __forceinline__ uint32_t SmemAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Initialises an mbarrier expecting `arrivals` arrivals per phase. Make the initialisation visible
// to the copy engine (FenceBarrierInit) before any copy completes on it.
__device__ __forceinline__ void InitBarrier(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddress(barrier)),
               "r"(arrivals));
}

__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival on the barrier, announcing bytes that copies completing on it will bring (copies of
// other arrivals may complete first: the phase ends only when every arrival is in).
__device__ __forceinline__ void ArriveExpectBytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   SmemAddress(barrier)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void WaitBarrier(uint64_t* barrier, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(SmemAddress(barrier)),
      "r"(phase)
      : "memory");
}

// Orders this thread's shared-memory accesses (generic proxy) before the async proxy's: threads'
// stores before wgmma reads them, threads' reads before a bulk copy overwrites the buffer.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One bulk copy (the copy engine, not the threads, moves the bytes) of `bytes` (a multiple of 16,
// both addresses 16-byte aligned) that completes on `barrier`.
__device__ __forceinline__ void CopyBulk(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddress(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddress(barrier))
      : "memory");
}

// One tiled TMA load of the box at coordinates (x, y) (x innermost) of the 2-D tensor `map` describes
// (a __grid_constant__ kernel parameter or global memory), which completes on `barrier`.
__device__ __forceinline__ void CopyTensor2d(void* dst, const void* map, int x, int y,
                                             uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(SmemAddress(dst)),
      "l"(map), "r"(x), "r"(y), "r"(SmemAddress(barrier))
      : "memory");
}

}  // namespace jax_sparse_mla::sm90
