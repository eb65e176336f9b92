// PTX wrappers for the SM90 kernels' asynchronous copies: shared-memory addresses, mbarriers, bulk
// copies by the copy engine and 16-byte cp.async copies. Shared by our decode kernels and the
// indexer kernels.
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

// 16 bytes from global `source` into shared `destination` (both 16-byte aligned), or 16 zero bytes
// when `valid` is false: a source size of 0 reads nothing, so `source` then only has to be some
// address of the same allocation. Cached in L2 only (.cg).
__device__ __forceinline__ void CopyAsync16(void* destination, const void* source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(destination)),
               "l"(source), "r"(valid ? 16 : 0)
               : "memory");
}

// An arrival on `barrier` triggered once every cp.async this thread has issued so far completed.
// .noinc: the arrival is one of the arrivals the barrier was initialised to expect.
__device__ __forceinline__ void ArriveOnCopies(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddress(barrier))
               : "memory");
}

// Waits until every cp.async this thread issued has completed.
__device__ __forceinline__ void WaitAllCopies() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace jax_sparse_mla::sm90
