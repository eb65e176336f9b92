// Division of non-negative int32 values by a divisor fixed at launch, as one multiply-high and one
// shift: what a compiler emits for a constant divisor, here for divisors that arrive as runtime
// attributes (block_size, dcp_size, interleave). A generic 32-bit division costs about twenty
// instructions per element, which is most of the index conversion's arithmetic.
//
// Why it is exact: for a divisor d in [2, 2^31) let l = ceil(log2 d) and m = ceil(2^(31 + l) / d),
// so m < 2^32 (d > 2^(l - 1)) and m d = 2^(31 + l) + e with 0 <= e < d. For n in [0, 2^31),
// n m / 2^(31 + l) = n / d + n e / (d 2^(31 + l)), and the added term is below
// 2^31 d / (d 2^(31 + l)) = 2^-l <= 1 / d. The fraction of n / d is at most (d - 1) / d, so the sum
// never reaches the next integer: floor(n m / 2^(31 + l)) = floor(n / d). The high word of n m is
// floor(n m / 2^32), and shifting it right by l - 1 more bits gives floor(n m / 2^(31 + l)).
// d = 1 (l = 0) would need a shift by -1 and is passed through instead.
//
// Header-only and usable from host code, so a CPU test compiles this very code
// (tests/kernels/test_fast_divmod_cpu.py).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_SPARSE_MLA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAX_SPARSE_MLA_HOST_DEVICE inline
#endif

namespace jax_sparse_mla {

struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;  // m; unused for d = 1
  uint32_t shift = 0;       // l - 1; unused for d = 1

  // d must be in [1, 2^31).
  static FastDivmod Make(uint32_t d) {
    FastDivmod f;
    f.divisor = d;
    if (d > 1) {
      uint32_t l = 0;
      while ((uint64_t{1} << l) < d) ++l;
      f.multiplier = static_cast<uint32_t>(((uint64_t{1} << (31 + l)) + d - 1) / d);
      f.shift = l - 1;
    }
    return f;
  }

  // floor(n / divisor) for n in [0, 2^31).
  JAX_SPARSE_MLA_HOST_DEVICE uint32_t Div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(n, multiplier);
#else
    const uint32_t high = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return divisor == 1 ? n : high >> shift;
  }

  // *quotient = floor(n / divisor), *remainder = n - *quotient * divisor, for n in [0, 2^31).
  JAX_SPARSE_MLA_HOST_DEVICE void DivMod(uint32_t n, uint32_t* quotient,
                                         uint32_t* remainder) const {
    *quotient = Div(n);
    *remainder = n - *quotient * divisor;
  }
};

}  // namespace jax_sparse_mla
