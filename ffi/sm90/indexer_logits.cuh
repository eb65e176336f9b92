// The lightning indexer's fp8 MQA logits on SM90, our own kernels (no DeepGEMM / vLLM code):
//
//   logits[row, s] = k_scale[s] * sum_h weights[row, h] * relu(q[row, h, :] . k[s, :])
//
// with e4m3 q and k (exact products), fp32 accumulation, and -inf at every column outside the
// row's range (never uninitialised memory). Two kernels share the warp-level code below:
//
//   PagedMqaLogitsKernel  (decode) one CTA per (request, chunk of `tiles_per_cta` 64-token cache
//                         blocks). Each block of the index cache is one contiguous 8448-byte page
//                         (64 x 128 e4m3 values token-major, then 64 fp32 scales), so one bulk copy
//                         brings a whole page, scales included, into a ring of kStages stages.
//   RaggedMqaLogitsKernel (prefill) one CTA per (group of kRows query rows, chunk of 64-key tiles
//                         of the gathered key buffer); each key tile is reused by all its rows.
//                         A TMA load brings each tile (64 rows x 128 bytes) into the ring in the
//                         128-byte swizzle, the layout a wgmma shared-memory operand reads.
//
// Work of one CTA on one 64-key tile: the query columns (row, head) it owns are split into groups
// of at most 64 columns (128 in the ragged kernel at 64 heads); each group is one warpgroup (4
// warps), and warp w of a group takes keys [16 w, 16 w + 16) of the tile against all the group's
// columns. The dot products are warpgroup MMAs (wgmma m64 n(32, 64 or 128) k32, e4m3 x e4m3 -> f32,
// which Hopper runs natively), K = 128 in 4 k-steps, with the group's query columns as B from shared
// memory, stored there once per CTA, and the keys as A: from registers in the paged kernel (each
// warp loads its 16 key rows from the stage), straight from the stage in the ragged kernel (no
// instruction of the warps touches a key byte there). The epilogue applies relu and the head weight
// to each accumulator, sums over heads (in-thread over its columns, then over the 4 threads of a
// quad with shuffles), multiplies by the key's scale and stores fp32 straight to global memory, or
// -inf where the key is outside the row's range. Each warpgroup issues tile i + 1's MMAs before it
// runs tile i's epilogue, so that the tensor cores work while it runs (RunTiles).
//
// Why the paged kernel keeps register A: its pages (values, then the 64 scales) come whole by one
// bulk copy, which cannot swizzle, and decode is bound by memory, not by issue slots. In the prefill
// kernel, which is bound by issue, loading key fragments took about a fifth of its instructions
// (docs/kernels/sm90-indexer.md), hence its shared-memory A.
//
// Dim permutation (register A): a dot product does not depend on the order of its 128 terms, so the
// MMA's logical K index need not be the memory dim, as long as A and B use the same map. We let
// thread (group g = lane / 4, t = lane % 4) hold the 32 contiguous bytes [32 t, 32 t + 32) of its key
// rows: 32-bit word 2 ks + half of that chunk feeds k-step ks, register half (logical dims 32 ks + 16
// half + 4 t + 0..3), and the query operand is stored with the same map. Keys load with 16-byte
// vector loads. Shared-memory banks: key rows are 128 bytes apart (the copy engine cannot pad them),
// so the two rows of one 8-lane phase of a 16-byte load would hit the same banks; lanes of odd g load
// their two 16-byte halves in the opposite order (then swap registers), which makes the phase
// conflict-free without changing any value. With shared-memory A the query is stored in dim order.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing here calls the driver)
#include <cuda_runtime_api.h>

#include <cstdint>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "sm90/sm90_async.cuh"
#include "sm90/sm90_wgmma.cuh"

namespace jax_sparse_mla::indexer {

inline constexpr int kHeadDim = 128;
inline constexpr int kTileKeys = 64;                          // keys per tile = cache block size
inline constexpr int kTileValueBytes = kTileKeys * kHeadDim;  // 8192
inline constexpr int kPageBytes = kTileKeys * (kHeadDim + 4);  // 8448: values then fp32 scales
// Ring of key tiles in shared memory. Decode is bandwidth-bound: with 8 stages a CTA keeps up to
// 7 pages (58 KB) in flight, enough on its own to cover HBM latency at ~1/132 of the bandwidth.
inline constexpr int kStages = 8;
inline constexpr int kSmemBytes = kStages * kPageBytes + kStages * 8;  // stages + mbarriers

struct PagedParams {
  const uint8_t* q;             // [B, next_n, H, 128] e4m3
  const uint8_t* cache;         // [num_blocks] pages of kPageBytes
  const float* weights;         // [B * next_n, H]
  const int32_t* context_lens;  // [B]
  const int32_t* block_table;   // [B, table_width]
  float* out;                   // [B * next_n, width]
  int64_t num_blocks;           // >= 1
  int table_width;              // table_width * 64 >= width
  int width;                    // max_context_len
  int tiles_per_cta;
};

struct RaggedParams {
  const uint8_t* q;        // [M, H, 128] e4m3 (the keys come through the kernel's tensor map)
  const float* key_scale;  // [N]
  const float* weights;    // [M, H]
  const int32_t* starts;   // [M]
  const int32_t* ends;     // [M]
  float* out;              // [M, N]
  int num_rows;            // M
  int num_keys;            // N
  int tiles_per_cta;
};

// How a CTA's kRows query rows of kHeads heads split over warps: groups (warpgroups) of at most
// kMaxGroupCols query columns, each the N of its wgmmas.
template <int kHeads_, int kRows_, int kMaxGroupCols = 64>
struct Layout {
  static constexpr int kHeads = kHeads_;
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kHeads * kRows;                   // (row, head) pairs
  static constexpr int kWarpCols = kCols < kMaxGroupCols ? kCols : kMaxGroupCols;  // per warp
  static constexpr int kGroups = kCols / kWarpCols;               // groups of 4 warps
  static constexpr int kThreads = 128 * kGroups;
  static constexpr int kNTiles = kWarpCols / 8;                   // n8 MMA tiles per warp
  static constexpr int kWarpRows = kWarpCols / kHeads;            // whole rows per warp
  static_assert(kHeads % 8 == 0 && kWarpCols % kHeads == 0 && kCols % kWarpCols == 0);
  static_assert(2 * kWarpRows <= 4, "a quad's 4 lanes store 2 keys x kWarpRows rows");
};

// ---- PTX wrappers -------------------------------------------------------------------------------

using sm90::ArriveExpectBytes;
using sm90::CopyBulk;
using sm90::CopyTensor2d;
using sm90::Descriptor;
using sm90::FenceBarrierInit;
using sm90::FenceProxyAsync;
using sm90::InitBarrier;
using sm90::SmemAddress;
using sm90::SwizzledKMajorDescriptor;
using sm90::WaitBarrier;

__device__ __forceinline__ float NegativeInfinity() { return __int_as_float(0xff800000); }

// relu that keeps NaN (as jnp.maximum(x, 0) does; fmaxf would turn NaN into 0), in one
// instruction (a compare and a select otherwise).
__device__ __forceinline__ float Relu(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}

// ---- warp-level pieces shared by both kernels --------------------------------------------------

// The head weights of the two accumulator columns a thread holds per n8 tile of its accumulators.
template <class L>
struct HeadWeights {
  float w[L::kNTiles][2];
};

// An n8 tile lies within one query row; rows >= valid_rows do not exist (ragged tail).
template <class L>
__device__ __forceinline__ bool TilePresent(int group, int n, int valid_rows) {
  return (group * L::kWarpCols + n * 8) / L::kHeads < valid_rows;
}

// w_cta: the CTA's first row of weights ([kRows, H]); absent rows: zero weight.
template <class L>
__device__ __forceinline__ void LoadHeadWeights(HeadWeights<L>& hw, const float* w_cta, int group,
                                                int lane, int valid_rows) {
  const int t = lane & 3;
#pragma unroll
  for (int n = 0; n < L::kNTiles; ++n) {
    float2 w = make_float2(0.0f, 0.0f);
    if (TilePresent<L>(group, n, valid_rows)) {
      w = *reinterpret_cast<const float2*>(w_cta + group * L::kWarpCols + n * 8 + 2 * t);
    }
    hw.w[n][0] = w.x, hw.w[n][1] = w.y;
  }
}

// Loads the 32-byte dim chunk of this thread for one key row of a tile in shared memory.
__device__ __forceinline__ void LoadKeyChunk(uint32_t (&words)[8], const uint8_t* row, int t,
                                             bool swap) {
  const uint8_t* chunk = row + 32 * t;
  // Odd groups load the upper half first: the two key rows of an 8-lane phase then use
  // different banks (module comment). The registers end up the same either way.
  // Plain loads (the compiler sees shared memory): ordered after the stage's barrier wait, whose
  // asm clobbers memory.
  const uint4 first = *reinterpret_cast<const uint4*>(chunk + (swap ? 16 : 0));
  const uint4 second = *reinterpret_cast<const uint4*>(chunk + (swap ? 0 : 16));
  const uint4 lo = swap ? second : first, hi = swap ? first : second;
  words[0] = lo.x, words[1] = lo.y, words[2] = lo.z, words[3] = lo.w;
  words[4] = hi.x, words[5] = hi.y, words[6] = hi.z, words[7] = hi.w;
}

// The quad's share of the warp's head sums from its accumulators (acc[n][0..1]: key g, columns 2t,
// 2t + 1 of n8 tile n; acc[n][2..3]: key g + 8, same columns): lo[r] / hi[r] = this thread's part of
// the sum over the heads of the warp's row r of w * relu(q . k). Two instructions per accumulator
// (relu, then a fused multiply-add into the row's sum).
template <class L>
__device__ __forceinline__ void HeadSums(const float (&acc)[L::kNTiles][4],
                                         const HeadWeights<L>& hw, float (&lo)[L::kWarpRows],
                                         float (&hi)[L::kWarpRows]) {
#pragma unroll
  for (int r = 0; r < L::kWarpRows; ++r) lo[r] = hi[r] = 0.0f;
#pragma unroll
  for (int n = 0; n < L::kNTiles; ++n) {
    const int r = n * 8 / L::kHeads;
    lo[r] = fmaf(hw.w[n][0], Relu(acc[n][0]), lo[r]);
    lo[r] = fmaf(hw.w[n][1], Relu(acc[n][1]), lo[r]);
    hi[r] = fmaf(hw.w[n][0], Relu(acc[n][2]), hi[r]);
    hi[r] = fmaf(hw.w[n][1], Relu(acc[n][3]), hi[r]);
  }
}

// Completes the sums across the quad and returns the one lane t stores: row t / 2 of the warp, key
// g + 8 (t % 2) of the m16 tile (lanes with t >= 2 kWarpRows return a value they do not store). A
// reduce-scatter: each exchange sends the partner the half of the values it keeps, so 2 x 2 values
// cost 3 shuffles and 3 adds (summing all four in every lane, then picking one, would cost 8 and 8).
template <class L>
__device__ __forceinline__ float QuadResult(const float (&lo)[L::kWarpRows],
                                            const float (&hi)[L::kWarpRows], int t) {
  float low = lo[0], high = hi[0];  // this lane's row: row t / 2 (row 0 where there is one)
  if constexpr (L::kWarpRows == 2) {
    // Across lanes t and t ^ 2: lanes with t < 2 keep row 0 and send row 1, the others the reverse.
    const bool upper = (t & 2) != 0;
    const float send_lo = upper ? lo[0] : lo[1], send_hi = upper ? hi[0] : hi[1];
    low = (upper ? lo[1] : lo[0]) + __shfl_xor_sync(0xffffffffu, send_lo, 2);
    high = (upper ? hi[1] : hi[0]) + __shfl_xor_sync(0xffffffffu, send_hi, 2);
  } else {
    low += __shfl_xor_sync(0xffffffffu, low, 2);
    high += __shfl_xor_sync(0xffffffffu, high, 2);
  }
  // Across lanes t and t ^ 1: even lanes keep key g (low) and send key g + 8, odd lanes the reverse.
  const bool odd = (t & 1) != 0;
  return (odd ? high : low) + __shfl_xor_sync(0xffffffffu, odd ? low : high, 1);
}

// Key rows g and g + 8 of the warp's m16 tile (16 * mtile + [0, 16)) of the tile at `tile` (64 rows
// of 128 e4m3 bytes in shared memory): this thread's 32-byte dim chunk of each.
__device__ __forceinline__ void LoadKeyFragment(const uint8_t* tile, int mtile, int lane,
                                                uint32_t (&a_lo)[8], uint32_t (&a_hi)[8]) {
  const int g = lane >> 2, t = lane & 3;
  const uint8_t* row = tile + (16 * mtile + g) * kHeadDim;
  LoadKeyChunk(a_lo, row, t, (g & 1) != 0);
  LoadKeyChunk(a_hi, row + 8 * kHeadDim, t, (g & 1) != 0);
}

// ---- the warpgroup MMAs ------------------------------------------------------------------------
//
// Warp w of a warpgroup holds keys [16 w, 16 w + 16) of the tile in the register layout of a wgmma
// A operand (rows 16 w + g and + 8, bytes 4 t.. and 16 + 4 t.. of each 32-wide k-step), so one
// wgmma m64 n(kWarpCols) k32 per k-step takes the keys from registers and the group's query
// columns as B from shared memory, with the dim permutation of the module comment (k-step ks,
// logical k = 16 h + 4 t + j reads memory dim 32 t + 8 ks + 4 h + j). The accumulators come out in
// the layout HeadSums reads (element 4 n + j is acc[n][j]: key g for j < 2, g + 8 otherwise,
// columns 8 n + 2 t + j % 2).
//
// The B operand of a group: K-major, unswizzled core matrices (8 columns x 16 bytes of K, 128
// bytes each): the 16-byte K chunk c (logical k [16 c, 16 c + 16)) of column n lives at
// c * kWarpCols * 16 + n * 16. With the permutation, chunk c of a column holds its 32-bit words
// c, 8 + c, 16 + c and 24 + c.

template <class L>
inline constexpr int kQueryOperandBytes = L::kCols * kHeadDim;  // every group's B operand

// One register-A wgmma: acc (kRegs accumulators) = or += A (four registers) x B (descriptor).
template <typename Mma, int kRegs, size_t... kI>
__device__ __forceinline__ void RunWgmma(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t b, float (&d)[kRegs], bool accumulate,
                                         std::index_sequence<kI...>) {
  Mma::fma(a0, a1, a2, a3, b, d[kI]...,
           accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// One shared-memory wgmma: acc = or += A (descriptor) x B (descriptor).
template <typename Mma, int kRegs, size_t... kI>
__device__ __forceinline__ void RunWgmma(uint64_t a, uint64_t b, float (&d)[kRegs],
                                         bool accumulate, std::index_sequence<kI...>) {
  Mma::fma(a, b, d[kI]...,
           accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <int kN>
using WgmmaE4m3 = std::conditional_t<
    kN == 128, cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_RS_TN<>,
    std::conditional_t<kN == 64, cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_RS_TN<>,
                       cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_RS_TN<>>>;

template <int kN>
using WgmmaE4m3Shared = std::conditional_t<
    kN == 128, cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>,
    std::conditional_t<kN == 64, cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>,
                       cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_SS_TN<>>>;

// Writes the CTA's query columns (all groups) into `operand` in the layout above, with the dim
// permutation where the keys come from registers (kPermuted) and in dim order where they come from
// shared memory; absent rows are zero. Every thread of the CTA takes part; the caller fences
// (FenceProxyAsync) and synchronises before any wgmma reads it.
template <class L, bool kPermuted>
__device__ __forceinline__ void StoreQueryOperand(uint8_t* operand, const uint8_t* q_cta,
                                                  int valid_rows) {
  if constexpr (!kPermuted) {
    // Chunk c of a column is its bytes [16 c, 16 c + 16).
    for (int i = threadIdx.x; i < L::kCols * 8; i += L::kThreads) {
      const int column = i / 8, chunk = i % 8;
      const int group = column / L::kWarpCols, n = column % L::kWarpCols;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (column / L::kHeads < valid_rows) {
        v = *reinterpret_cast<const uint4*>(q_cta + static_cast<int64_t>(column) * kHeadDim +
                                            16 * chunk);
      }
      *reinterpret_cast<uint4*>(operand + group * L::kWarpCols * kHeadDim + chunk * L::kWarpCols * 16 +
                                n * 16) = v;
    }
  } else {
    // Half h of a column holds K chunks 4 h .. 4 h + 3, which take words 8 j + 4 h + (0..3) for
    // j = 0..3: four 16-byte loads of the column, then four 16-byte stores.
    for (int i = threadIdx.x; i < L::kCols * 2; i += L::kThreads) {
      const int column = i / 2, half = i % 2;
      const int group = column / L::kWarpCols, n = column % L::kWarpCols;
      uint32_t words[4][4] = {};  // words[j][c] = the column's word 8 j + 4 half + c
      if (column / L::kHeads < valid_rows) {
        const uint8_t* source = q_cta + static_cast<int64_t>(column) * kHeadDim + 16 * half;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 v = *reinterpret_cast<const uint4*>(source + 32 * j);
          words[j][0] = v.x, words[j][1] = v.y, words[j][2] = v.z, words[j][3] = v.w;
        }
      }
      uint8_t* column_base = operand + group * L::kWarpCols * kHeadDim + n * 16;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int chunk = 4 * half + c;
        *reinterpret_cast<uint4*>(column_base + chunk * L::kWarpCols * 16) =
            make_uint4(words[0][c], words[1][c], words[2][c], words[3][c]);
      }
    }
  }
}

// One tile's MMAs and head sums, in two halves, so that a warpgroup can run one tile's epilogue
// while the next tile's MMAs execute (RunTiles): Issue loads a tile's key fragments into `keys` and
// issues its four k-steps into `acc` as one batch; Sums, once a warpgroup_wait has retired that
// batch, reduces `acc`. The key fragments are read by the MMAs until they complete, so `keys` is
// reloaded only after a wait that retires them.
struct KeyFragment {
  uint32_t lo[8], hi[8];
};

template <class L>
struct WgmmaTile {
  float acc[L::kNTiles][4];

  // The warpgroup `group` (all 128 threads together), B operand described by `query` (k-step 0).
  __device__ __forceinline__ void Issue(KeyFragment& keys, const uint8_t* tile, int mtile, int lane,
                                        uint64_t query) {
    using Mma = WgmmaE4m3<L::kWarpCols>;
    // A k-step is 32 logical k: two 16-byte K chunks, in descriptor units of 16 bytes.
    constexpr uint64_t kStep = 2 * L::kWarpCols * 16 / 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // the MMAs that read them before have completed
      cute::warpgroup_fence_operand(keys.lo[i]);
      cute::warpgroup_fence_operand(keys.hi[i]);
    }
    LoadKeyFragment(tile, mtile, lane, keys.lo, keys.hi);
    float(&d)[L::kNTiles * 4] = reinterpret_cast<float(&)[L::kNTiles * 4]>(acc);
#pragma unroll
    for (int i = 0; i < L::kNTiles * 4; ++i) cute::warpgroup_fence_operand(d[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      RunWgmma<Mma>(keys.lo[2 * ks], keys.hi[2 * ks], keys.lo[2 * ks + 1], keys.hi[2 * ks + 1],
                    query + ks * kStep, d, ks > 0, std::make_index_sequence<L::kNTiles * 4>{});
    }
    cute::warpgroup_commit_batch();
  }

  // The same with the keys as A from shared memory: `keys` describes a stage in the 128-byte
  // swizzle (SwizzledKMajorDescriptor), its 64 rows the warpgroup's M; query columns in dim order.
  __device__ __forceinline__ void IssueShared(uint64_t keys, uint64_t query) {
    using Mma = WgmmaE4m3Shared<L::kWarpCols>;
    constexpr uint64_t kStep = 2 * L::kWarpCols * 16 / 16;  // B: two 16-byte K chunks
    float(&d)[L::kNTiles * 4] = reinterpret_cast<float(&)[L::kNTiles * 4]>(acc);
#pragma unroll
    for (int i = 0; i < L::kNTiles * 4; ++i) cute::warpgroup_fence_operand(d[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // A: 32 bytes of each row per k-step, 2 descriptor units
      RunWgmma<Mma>(keys + 2 * ks, query + ks * kStep, d, ks > 0,
                    std::make_index_sequence<L::kNTiles * 4>{});
    }
    cute::warpgroup_commit_batch();
  }

  // The value lane t of the quad stores (QuadResult).
  __device__ __forceinline__ float Sums(const HeadWeights<L>& hw, int t) {
    float(&d)[L::kNTiles * 4] = reinterpret_cast<float(&)[L::kNTiles * 4]>(acc);
#pragma unroll
    for (int i = 0; i < L::kNTiles * 4; ++i) cute::warpgroup_fence_operand(d[i]);
    float lo[L::kWarpRows], hi[L::kWarpRows];
    HeadSums<L>(acc, hw, lo, hi);
    return QuadResult<L>(lo, hi, t);
  }
};

// ---- decode: paged logits -----------------------------------------------------------------------

// Dynamic shared memory of a kernel: the ring of stages and its barriers, then the query operand
// (16-byte aligned: kSmemBytes is a multiple of 16).
template <class L>
inline constexpr int kKernelSmemBytes = kSmemBytes + kQueryOperandBytes<L>;
static_assert(kSmemBytes % 16 == 0);

// Stores the CTA's query columns into `operand` (every thread of the CTA takes part; a
// __syncthreads must follow before the first tile) and returns this warpgroup's B descriptor at
// k-step 0.
template <class L, bool kPermuted>
__device__ __forceinline__ uint64_t LoadQuery(const uint8_t* q_cta, uint8_t* operand, int group,
                                              int valid_rows) {
  StoreQueryOperand<L, kPermuted>(operand, q_cta, valid_rows);
  FenceProxyAsync();
  return Descriptor(operand + group * L::kWarpCols * kHeadDim, L::kWarpCols * 16, 128);
}

// The tile loop of both kernels over the CTA's num_loads tiles in the ring (tile i in stage
// i % kStages, kStageBytes apart, complete when full[stage] flips; kSharedKeys: the MMAs read the
// keys from the stage, else from registers loaded from it): per tile, `epilogue(i, page, value)` stores the
// lane's result (QuadResult), then the CTA synchronises and `refill(i)` may refill the stage (every
// warp is done with it). Tile i + 1's MMAs are issued before tile i's epilogue, which then runs
// while they execute. `query`: the warpgroup's B descriptor (LoadQuery).
template <class L, int kStageBytes, bool kSharedKeys, class Epilogue, class Refill>
__device__ __forceinline__ void RunTiles(uint64_t query,
                                         const uint8_t* stages, uint64_t* full, int num_loads,
                                         int mtile, int lane, const HeadWeights<L>& hw,
                                         Epilogue&& epilogue, Refill&& refill) {
  const int t = lane & 3;
  auto page = [&](int i) { return stages + (i % kStages) * kStageBytes; };
  auto wait = [&](int i) { WaitBarrier(&full[i % kStages], (i / kStages) & 1); };
  auto finish = [&](int i, float value) {
    epilogue(i, page(i), value);
    __syncthreads();  // every warp is done with this stage (its MMAs that read it have retired)
    refill(i);
  };
  // Tiles 2j and 2j + 1 accumulate in two named sets of registers, so that tile i's epilogue
  // runs while tile i + 1's MMAs execute; one set of key fragments serves both, reloaded after
  // the wait that retires the MMAs reading it. ptxas tracks which accumulators a wait retires
  // only where every path issues the same MMAs, so the loop body issues unconditionally (`even`
  // in flight at its top and at its end) and the last one or two tiles are peeled after it: with
  // an issue under a condition it serialises every wgmma of the kernel.
  KeyFragment keys;
  // Shared-memory A: stage s's descriptor is stage 0's with the start address (in 16-byte units, the
  // descriptor's low bits) s * kStageBytes further.
  [[maybe_unused]] const uint64_t stage_keys = kSharedKeys ? SwizzledKMajorDescriptor(stages) : 0;
  WgmmaTile<L> even, odd;
  auto issue = [&](int i, WgmmaTile<L>& tile) {
    wait(i);
    if constexpr (kSharedKeys) {
      tile.IssueShared(stage_keys + static_cast<uint64_t>((i % kStages) * (kStageBytes >> 4)),
                       query);
    } else {
      tile.Issue(keys, page(i), mtile, lane, query);
    }
  };
  auto sums_and_finish = [&](int i, WgmmaTile<L>& tile) { finish(i, tile.Sums(hw, t)); };
  issue(0, even);
  int i = 0;
  for (; i + 2 < num_loads; i += 2) {
    cute::warpgroup_wait<0>();  // tile i's MMAs are done
    issue(i + 1, odd);
    sums_and_finish(i, even);
    cute::warpgroup_wait<0>();
    issue(i + 2, even);
    sums_and_finish(i + 1, odd);
  }
  cute::warpgroup_wait<0>();
  if (i + 1 < num_loads) {
    issue(i + 1, odd);
    sums_and_finish(i, even);
    cute::warpgroup_wait<0>();
    sums_and_finish(i + 1, odd);
  } else {
    sums_and_finish(i, even);
  }
}

// CTAs resident per SM the kernels are compiled for: 3 of 128 threads (168 registers each); one
// where a warp's columns are 128 (two sets of 64 accumulators need about 200 registers); else as
// many as 128 registers a thread allow (2 of 256 threads, 1 of 512: the two accumulator sets would
// otherwise take 143 and leave fewer).
template <class L>
inline constexpr int kMinCtasPerSm = L::kThreads == 128  ? 3
                                     : L::kWarpCols == 128 ? 1
                                                           : 65536 / (L::kThreads * 128);

template <class L>
__global__ void __launch_bounds__(L::kThreads, (kMinCtasPerSm<L>))
    PagedMqaLogitsKernel(const PagedParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kPageBytes);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Uniform in the compiler's eyes (the ragged kernel says why).
  const int mtile = warp & 3, group = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int batch_index = blockIdx.y;
  const int width = p.width;
  const int num_tiles = (width + kTileKeys - 1) / kTileKeys;
  const int t0 = blockIdx.x * p.tiles_per_cta;
  const int t1 = min(t0 + p.tiles_per_cta, num_tiles);
  const int length = p.context_lens[batch_index];
  // Keys any row of the request sees: [0, min(L, width)); the pages of later tiles are never read.
  const int seen = min(max(length, 0), width);
  const int load_end = min(max((seen + kTileKeys - 1) / kTileKeys, t0), t1);
  const int num_loads = load_end - t0;
  const int first_row = batch_index * L::kRows;
  float* out = p.out + static_cast<int64_t>(first_row) * width;

  // Columns of unloaded tiles are outside every row's range.
  const int fill_end = min(t1 * kTileKeys, width);
  for (int r = 0; r < L::kRows; ++r) {
    for (int s = load_end * kTileKeys + tid; s < fill_end; s += L::kThreads) {
      out[static_cast<int64_t>(r) * width + s] = NegativeInfinity();
    }
  }
  if (num_loads <= 0) return;

  const int32_t* table = p.block_table + static_cast<int64_t>(batch_index) * p.table_width;
  auto issue = [&](int stage, int tile) {
    // Entries past a request's last block may hold anything; clamped as the pure-JAX path does
    // (the keys they bring are outside every row's range).
    const int64_t block = min(max(static_cast<int64_t>(table[tile]), int64_t{0}), p.num_blocks - 1);
    ArriveExpectBytes(&full[stage], kPageBytes);
    CopyBulk(smem + stage * kPageBytes, p.cache + block * kPageBytes, kPageBytes, &full[stage]);
  };
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) InitBarrier(&full[s], 1);
    FenceBarrierInit();
    for (int s = 0; s < kStages && s < num_loads; ++s) issue(s, t0 + s);
  }

  const uint64_t query =
      LoadQuery<L, true>(p.q + static_cast<int64_t>(first_row) * L::kHeads * kHeadDim,
                         smem + kSmemBytes, group, L::kRows);
  HeadWeights<L> hw;
  LoadHeadWeights<L>(hw, p.weights + static_cast<int64_t>(first_row) * L::kHeads, group, lane,
                     L::kRows);
  const int t = lane & 3;  // the lane's result (QuadResult): warp row t / 2, key offset 8 (t % 2)
  const bool stores = t < 2 * L::kWarpRows;
  const int row = group * L::kWarpRows + (t >> 1);  // row j of the request
  // Row j sees [0, L - next_n + j + 1).
  const int limit = length - L::kRows + row + 1;
  const int key_in_tile = 16 * mtile + (lane >> 2) + 8 * (t & 1);
  __syncthreads();  // the barriers are initialised (and the query operand stored)

  RunTiles<L, kPageBytes, false>(
      query, smem, full, num_loads, mtile, lane, hw,
      [&](int i, const uint8_t* page, float value) {
        const int key = (t0 + i) * kTileKeys + key_in_tile;
        if (stores && key < width) {
          const float scale = reinterpret_cast<const float*>(page + kTileValueBytes)[key_in_tile];
          out[static_cast<int64_t>(row) * width + key] = key < limit ? value * scale
                                                                     : NegativeInfinity();
        }
      },
      [&](int i) {
        if (tid == 0 && i + kStages < num_loads) issue(i % kStages, t0 + i + kStages);
      });
}

// ---- prefill: ragged logits ---------------------------------------------------------------------

// Query columns (row, head) per CTA of the ragged kernel: 4 rows of 64 heads (two warpgroups of two
// rows, N = 128) or 8 of 32 (four of two rows, N = 64), so that
// each key tile brought from L2 serves that many rows (its binding,
// kernels/sm90_indexer_logits.py, sizes the grid by the same number).
inline constexpr int kRaggedColumns = 256;

// The ragged kernel's ring: one TMA load per tile in the 128-byte swizzle into stages of 8192 bytes,
// 1024-byte aligned as that swizzle needs, read by the MMAs as shared-memory A (no fragment loads,
// no moves assembling A registers). Its shared memory: the ring, its barriers, the query operand,
// plus up to 1023 bytes to align the ring (the base alignment of dynamic shared memory is not
// specified).
inline constexpr int kRaggedRingBytes = kStages * kTileValueBytes + kStages * 8;
template <class L>
inline constexpr int kRaggedSmemBytes = 1024 + kRaggedRingBytes + kQueryOperandBytes<L>;
static_assert(kRaggedRingBytes % 16 == 0);

// keys_map: the keys [N, 128] e4m3 as a 2-D tensor, boxes of 64 rows x 128 bytes in the 128-byte
// swizzle (rows past N read as zeros). A parameter of its own: TMA needs the map's address, which
// __grid_constant__ gives.
template <class L>
__global__ void __launch_bounds__(L::kThreads, (kMinCtasPerSm<L>))
    RaggedMqaLogitsKernel(const RaggedParams p, const __grid_constant__ CUtensorMap keys_map) {
  extern __shared__ __align__(1024) uint8_t dynamic_smem[];
  uint8_t* smem = dynamic_smem + ((1024 - (SmemAddress(dynamic_smem) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kTileValueBytes);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup index through a shuffle from lane 0: the compiler then knows it is the same in
  // every lane (as CUTLASS's canonical_warp_group_idx does), so the query descriptor derived from
  // it stays in uniform registers instead of being moved there for every wgmma.
  const int mtile = warp & 3, group = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int num_keys = p.num_keys;
  const int first_row = blockIdx.x * L::kRows;
  const int valid_rows = min(L::kRows, p.num_rows - first_row);
  const int num_tiles = (num_keys + kTileKeys - 1) / kTileKeys;
  const int t0 = blockIdx.y * p.tiles_per_cta;
  const int t1 = min(t0 + p.tiles_per_cta, num_tiles);

  // The union of the rows' ranges (cut to [0, N); empty ranges add nothing): only its tiles load.
  int lo_key = num_keys, hi_key = 0;
  for (int r = 0; r < valid_rows; ++r) {
    const int s = min(max(p.starts[first_row + r], 0), num_keys);
    const int e = min(max(p.ends[first_row + r], 0), num_keys);
    if (s < e) lo_key = min(lo_key, s), hi_key = max(hi_key, e);
  }
  int load_begin = min(max(lo_key / kTileKeys, t0), t1);
  int load_end = min(max((hi_key + kTileKeys - 1) / kTileKeys, t0), t1);
  if (load_begin >= load_end) load_begin = load_end = t1;
  const int num_loads = load_end - load_begin;
  float* out = p.out + static_cast<int64_t>(first_row) * num_keys;

  // Columns of the chunk outside the union are outside every row's range.
  const int fill_end = min(t1 * kTileKeys, num_keys);
  for (int r = 0; r < valid_rows; ++r) {
    float* out_row = out + static_cast<int64_t>(r) * num_keys;
    // Cut at fill_end too: with no tile to load, load_begin is t1, whose tile may be partial (the
    // last chunk), and t1 * 64 would run past the row's end into the next row / past the buffer.
    for (int s = t0 * kTileKeys + tid; s < min(load_begin * kTileKeys, fill_end); s += L::kThreads) {
      out_row[s] = NegativeInfinity();
    }
    for (int s = load_end * kTileKeys + tid; s < fill_end; s += L::kThreads) {
      out_row[s] = NegativeInfinity();
    }
  }
  if (num_loads <= 0) return;

  auto issue = [&](int stage, int tile) {
    // A whole box always arrives: rows past N (in the last tile) read as zeros, and their results
    // are never stored (MMA rows do not mix).
    ArriveExpectBytes(&full[stage], kTileValueBytes);
    CopyTensor2d(smem + stage * kTileValueBytes, &keys_map, 0, tile * kTileKeys, &full[stage]);
  };
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) InitBarrier(&full[s], 1);
    FenceBarrierInit();
    for (int s = 0; s < kStages && s < num_loads; ++s) issue(s, load_begin + s);
  }

  const uint64_t query =
      LoadQuery<L, false>(p.q + static_cast<int64_t>(first_row) * L::kHeads * kHeadDim,
                          smem + kRaggedRingBytes, group, valid_rows);
  HeadWeights<L> hw;
  LoadHeadWeights<L>(hw, p.weights + static_cast<int64_t>(first_row) * L::kHeads, group, lane,
                     valid_rows);
  const int t = lane & 3;  // the lane's result (QuadResult): warp row t / 2, key offset 8 (t % 2)
  const int row = group * L::kWarpRows + (t >> 1);  // row of the CTA
  const bool stores = t < 2 * L::kWarpRows && row < valid_rows;
  const int start = stores ? p.starts[first_row + row] : 0;
  const int end = stores ? p.ends[first_row + row] : 0;
  const int key_in_tile = 16 * mtile + (lane >> 2) + 8 * (t & 1);
  __syncthreads();  // the barriers are initialised (and the query operand stored)

  // The key scales come from global memory (the stages hold only values), each tile's loaded one
  // tile ahead, so that its latency hides behind a tile's work instead of stalling the epilogue.
  auto load_scale = [&](int i) {
    const int key = (load_begin + i) * kTileKeys + key_in_tile;
    return stores && key < num_keys ? __ldg(p.key_scale + key) : 0.0f;
  };
  float next_scale = load_scale(0);
  RunTiles<L, kTileValueBytes, true>(
      query, smem, full, num_loads, mtile, lane, hw,
      [&](int i, const uint8_t*, float value) {
        const int key = (load_begin + i) * kTileKeys + key_in_tile;
        const float scale = next_scale;
        if (i + 1 < num_loads) next_scale = load_scale(i + 1);
        if (stores && key < num_keys) {
          out[static_cast<int64_t>(row) * num_keys + key] =
              key >= start && key < end ? value * scale : NegativeInfinity();
        }
      },
      [&](int i) {
        if (tid == 0 && i + kStages < num_loads) issue(i % kStages, load_begin + i + kStages);
      });
}

}  // namespace jax_sparse_mla::indexer
