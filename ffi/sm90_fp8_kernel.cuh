// Sparse MLA decode over an fp8 KV cache for SM90, our own kernel (no FlashInfer code).
//
// One CTA computes `kHeads` heads (16, 32 or 64) of one query token over one split of its top-k
// slot list. Per tile of kBlockN slots:
//   1. cp.async gathers the tile's rows (576 or 656 bytes each) into a raw fp8 stage; invalid slots
//      (-1 holes, out of range, past the valid count) are never read: their bytes are zero-filled;
//   2. all threads dequantise the raw stage into a bf16 tile (exact for per-tensor e4m3, whose
//      scale is applied to the scores and the output; fp8_ds_mla multiplies by its tile scale);
//   3. S = Q K^T with bf16 mma.sync (fp32 accumulate): the warps of a row group share 16 heads and
//      split the tile's keys; S goes through shared memory so that every warp sees whole rows;
//   4. online softmax (base 2) and O += P V, each warp of a row group owning a slice of the 512
//      output columns (the accumulator of 16 rows x 512 columns does not fit in one warp).
// The raw stages form a kStages-deep pipeline: the gathers of the next kStages tiles overlap
// steps 2-4.
//
// With one split the CTA writes out / lse directly; otherwise it writes a normalised fp32 partial
// and its base-2 lse, and MergeSplits combines the splits. A row with no valid slot ends with
// l = 0: out 0, lse -inf (never NaN).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_sparse_mla::fp8 {

inline constexpr int kQkDim = 576;
inline constexpr int kVDim = 512;
inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
// Largest slot range one split covers: the split's slots are staged in shared memory.
inline constexpr int kMaxKeysPerSplit = 2048;

enum class KvLayout : int {
  kE4m3 = 0,   // 576 e4m3 values, one per-tensor scale (applied outside the kernel's dequant)
  kDsMla = 1,  // 512 e4m3 + 4 fp32 scales (one per 128 latent values) + 64 bf16 RoPE = 656 bytes
};

template <KvLayout kLayout>
inline constexpr int kRowBytes = kLayout == KvLayout::kE4m3 ? 576 : 656;

struct DecodeParams {
  const __nv_bfloat16* q;       // [T, H, 576]
  const uint8_t* kv;            // [num_slots, row bytes]
  const int32_t* indices;       // [T, K]
  const int32_t* valid_counts;  // [T]
  __nv_bfloat16* out;           // [T, H, 512]
  float* lse;                   // [T, H]
  float* partial_out;           // [num_splits, T, H, 512] (num_splits > 1)
  float* partial_lse;           // [num_splits, T, H] base 2 (num_splits > 1)
  int64_t num_slots;
  int num_tokens;
  int num_heads;
  int num_keys;
  int num_splits;
  int keys_per_split;       // a multiple of the tile size, <= kMaxKeysPerSplit
  float score_scale_log2;   // bmm1_scale * log2(e)
  float out_scale;          // bmm2_scale
  bool lse_base_e;
};

// Tile shapes per head count. Every warp of a row group computes kBlockN / kWarpsPerGroup keys of
// S (a multiple of 8, the MMA's N) and kVDim / kWarpsPerGroup output columns.
template <int kHeads_, KvLayout kLayout_>
struct TileConfig {
  static constexpr int kHeads = kHeads_;
  static constexpr KvLayout kLayout = kLayout_;
  static constexpr int kRowGroups = kHeads / 16;
  static constexpr int kWarpsPerGroup = kWarps / kRowGroups;
  static constexpr int kBlockN = kHeads == 64 ? 32 : 64;
  static constexpr int kStages = kHeads == 64 ? 3 : 2;
  static constexpr int kKeysPerWarp = kBlockN / kWarpsPerGroup;
  static constexpr int kColsPerWarp = kVDim / kWarpsPerGroup;
  static constexpr int kRowBytes = fp8::kRowBytes<kLayout>;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  // bf16 rows padded by 16 bytes: ldmatrix's 8 row addresses then fall on distinct bank groups.
  static constexpr int kStride = kQkDim + 8;
  static constexpr int kScoreStride = kBlockN + 8;  // fp32 scores, padded against bank conflicts

  static constexpr int kQBytes = kHeads * kStride * 2;
  static constexpr int kKBytes = kBlockN * kStride * 2;
  static constexpr int kRawBytes = kStages * kBlockN * kRowBytes;
  static constexpr int kScoreBytes = kHeads * kScoreStride * 4;
  static constexpr int kSlotBytes = kMaxKeysPerSplit * 4;
  static constexpr int kSmemBytes = kQBytes + kKBytes + kRawBytes + kScoreBytes + kSlotBytes;

  static_assert(kHeads == 16 || kHeads == 32 || kHeads == 64);
  static_assert(kKeysPerWarp % 8 == 0 && kColsPerWarp % 16 == 0);
  static_assert(kMaxKeysPerSplit % kBlockN == 0);
  static_assert(kSmemBytes <= 227 * 1024);
};

// ---- PTX wrappers ---------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(dst)),
               "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void CommitAsync() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void WaitAsync() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LoadMatrixX4(uint32_t (&regs)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(SmemAddress(row_address)));
}

// Lanes 0-15 give the row addresses of two 8x8 matrices.
__device__ __forceinline__ void LoadMatrixX2(uint32_t (&regs)[2], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(regs[0]), "=r"(regs[1])
               : "r"(SmemAddress(row_address)));
}

__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&regs)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(SmemAddress(row_address)));
}

// acc[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void MmaBf16(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// e4m3 -> bf16 with integer operations (the conversion instructions run at a quarter of the ALU
// rate and made the kernel dequant-bound). An e4m3 byte s.eeee.mmm placed as s.0000eeee.mmm0000
// is the bf16 of its value times 2^-120 (bf16's exponent bias is 120 above e4m3's), subnormals
// included; multiplying by 2^120 in bf16 is exact. The e4m3 NaN code becomes a finite value, like
// every byte pattern of a row the caller selected (the op never selects unwritten rows).
__device__ __forceinline__ uint32_t E4m3PairToBf16(uint32_t fp8x4, uint32_t selector) {
  const uint32_t placed = __byte_perm(fp8x4, 0, selector);  // bytes into the high byte of each half
  const uint32_t magnitude = (placed & 0x7f007f00u) >> 4;
  const uint32_t scaled_bits = (placed & 0x80008000u) | magnitude;
  const __nv_bfloat162 scaled = *reinterpret_cast<const __nv_bfloat162*>(&scaled_bits);
  const __nv_bfloat162 value = __hmul2(scaled, __floats2bfloat162_rn(0x1p120f, 0x1p120f));
  return *reinterpret_cast<const uint32_t*>(&value);
}

// e4m3 byte `index` of `fp8x4` as a float32 times 2^-120 (same placement, f32's bias is 120 above).
__device__ __forceinline__ float E4m3ToScaledFloat(uint32_t fp8x4, int index) {
  const uint32_t placed = fp8x4 << (24 - 8 * index);
  return __uint_as_float((placed & 0x80000000u) | ((placed & 0x7f000000u) >> 4));
}

// 16 e4m3 bytes -> 16 bf16 values (two 16-byte stores). kScaled false: exact per-tensor
// conversion; otherwise each value times `scale` in float32, rounded once to bf16 (fp8_ds_mla tile scales).
template <bool kScaled>
__device__ __forceinline__ void DequantChunk(const uint8_t* src, __nv_bfloat16* dst, float scale) {
  const uint4 bytes = *reinterpret_cast<const uint4*>(src);
  const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
  uint32_t pairs[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kScaled) {  // two exact steps: folding 2^120 into the scale could overflow
      float values[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) values[j] = E4m3ToScaledFloat(words[i], j) * 0x1p120f * scale;
      pairs[2 * i] = PackBf16(values[0], values[1]);
      pairs[2 * i + 1] = PackBf16(values[2], values[3]);
    } else {
      pairs[2 * i] = E4m3PairToBf16(words[i], 0x1404);
      pairs[2 * i + 1] = E4m3PairToBf16(words[i], 0x3424);
    }
  }
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
}

// ---- the decode kernel ----------------------------------------------------------------------------

template <typename Config>
struct SharedTile {
  __nv_bfloat16* q;   // [kHeads, kStride]
  __nv_bfloat16* k;   // [kBlockN, kStride]
  uint8_t* raw;       // [kStages, kBlockN, kRowBytes]
  float* scores;      // [kHeads, kScoreStride]
  int32_t* slots;     // [kMaxKeysPerSplit]: the split's slots, -1 where invalid

  __device__ explicit SharedTile(uint8_t* base)
      : q(reinterpret_cast<__nv_bfloat16*>(base)),
        k(reinterpret_cast<__nv_bfloat16*>(base + Config::kQBytes)),
        raw(base + Config::kQBytes + Config::kKBytes),
        scores(reinterpret_cast<float*>(base + Config::kQBytes + Config::kKBytes +
                                        Config::kRawBytes)),
        slots(reinterpret_cast<int32_t*>(base + Config::kQBytes + Config::kKBytes +
                                         Config::kRawBytes + Config::kScoreBytes)) {}
};

template <typename Config>
__device__ __forceinline__ void GatherTile(const SharedTile<Config>& smem, const uint8_t* kv,
                                           int tile, int stage) {
  uint8_t* raw = smem.raw + stage * Config::kBlockN * Config::kRowBytes;
  constexpr int kChunks = Config::kBlockN * Config::kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    if (kChunks % kThreads != 0 && chunk >= kChunks) break;
    const int row = chunk / Config::kChunksPerRow;
    const int column = chunk % Config::kChunksPerRow;
    const int32_t slot = smem.slots[tile * Config::kBlockN + row];
    const uint8_t* src = kv + (slot >= 0 ? int64_t{slot} * Config::kRowBytes + column * 16 : 0);
    CopyAsync16(raw + row * Config::kRowBytes + column * 16, src, slot >= 0 ? 16 : 0);
  }
}

template <typename Config>
__device__ __forceinline__ void DequantTile(const SharedTile<Config>& smem, int stage) {
  const uint8_t* raw = smem.raw + stage * Config::kBlockN * Config::kRowBytes;
  if constexpr (Config::kLayout == KvLayout::kE4m3) {
    constexpr int kChunks = kQkDim / 16, kUnits = Config::kBlockN * kChunks;
#pragma unroll
    for (int i = 0; i < (kUnits + kThreads - 1) / kThreads; ++i) {
      const int unit = threadIdx.x + i * kThreads;
      if (kUnits % kThreads != 0 && unit >= kUnits) break;
      const int row = unit / kChunks, chunk = unit % kChunks;
      DequantChunk<false>(raw + row * Config::kRowBytes + chunk * 16,
                          smem.k + row * Config::kStride + chunk * 16, 0.0f);
    }
  } else {
    // 32 latent chunks of 16 e4m3 values (scale per 128), then 8 chunks of 8 bf16 RoPE values.
    constexpr int kLatentChunks = kVDim / 16, kRopeChunks = 8;
    constexpr int kUnitsPerRow = kLatentChunks + kRopeChunks;
    constexpr int kUnits = Config::kBlockN * kUnitsPerRow;
#pragma unroll
    for (int i = 0; i < (kUnits + kThreads - 1) / kThreads; ++i) {
      const int unit = threadIdx.x + i * kThreads;
      if (kUnits % kThreads != 0 && unit >= kUnits) break;
      const int row = unit / kUnitsPerRow, chunk = unit % kUnitsPerRow;
      const uint8_t* raw_row = raw + row * Config::kRowBytes;
      __nv_bfloat16* k_row = smem.k + row * Config::kStride;
      if (chunk < kLatentChunks) {
        const float scale = reinterpret_cast<const float*>(raw_row + kVDim)[chunk / 8];
        DequantChunk<true>(raw_row + chunk * 16, k_row + chunk * 16, scale);
      } else {
        const int rope = chunk - kLatentChunks;
        *reinterpret_cast<uint4*>(k_row + kVDim + rope * 8) =
            *reinterpret_cast<const uint4*>(raw_row + kVDim + 16 + rope * 16);
      }
    }
  }
}

template <typename Config>
__global__ void __launch_bounds__(kThreads, 1) SparseMlaFp8DecodeKernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t shared_bytes[];
  const SharedTile<Config> smem(shared_bytes);
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kStages = Config::kStages;

  const int split = blockIdx.x;
  const int head_begin = blockIdx.y * Config::kHeads;
  const int token = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_group = warp / Config::kWarpsPerGroup;
  const int group_warp = warp % Config::kWarpsPerGroup;

  const int valid_count = min(max(p.valid_counts[token], 0), p.num_keys);
  const int key_begin = split * p.keys_per_split;
  const int key_end = min(key_begin + p.keys_per_split, valid_count);
  const int num_tiles = key_end > key_begin ? (key_end - key_begin + kBlockN - 1) / kBlockN : 0;

  // The split's slots, with every entry the op must not read as -1.
  const int32_t* token_indices = p.indices + int64_t{token} * p.num_keys;
  for (int i = threadIdx.x; i < num_tiles * kBlockN; i += kThreads) {
    const int position = key_begin + i;
    const int32_t slot = position < key_end ? token_indices[position] : -1;
    smem.slots[i] = (slot >= 0 && slot < p.num_slots) ? slot : -1;
  }
  // Q rows of this CTA's heads (rows past num_heads are zero).
  for (int chunk = threadIdx.x; chunk < Config::kHeads * (kQkDim / 8); chunk += kThreads) {
    const int row = chunk / (kQkDim / 8), column = chunk % (kQkDim / 8);
    const int head = head_begin + row;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (head < p.num_heads) {
      value = *reinterpret_cast<const uint4*>(
          p.q + (int64_t{token} * p.num_heads + head) * kQkDim + column * 8);
    }
    *reinterpret_cast<uint4*>(smem.q + row * Config::kStride + column * 8) = value;
  }
  __syncthreads();

#pragma unroll
  for (int stage = 0; stage < kStages; ++stage) {
    if (stage < num_tiles) GatherTile(smem, p.kv, stage, stage);
    CommitAsync();
  }

  // Per thread: rows lane/4 and lane/4 + 8 of the warp's 16; columns 2 * (lane % 4) + {0, 1} of
  // every 8-wide MMA tile (the m16n8 accumulator layout).
  constexpr int kOutTiles = Config::kColsPerWarp / 8;
  float acc[kOutTiles][4];
#pragma unroll
  for (int i = 0; i < kOutTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; reduced over the quad at the end

  const int quad = lane / 4, quad_lane = lane % 4;
  const __nv_bfloat16* q_rows = smem.q + (row_group * 16) * Config::kStride;
  float* score_rows = smem.scores + (row_group * 16) * Config::kScoreStride;

  for (int tile = 0; tile < num_tiles; ++tile) {
    WaitAsync<kStages - 1>();
    __syncthreads();  // the tile landed; the previous tile's bf16 rows are no longer read
    DequantTile(smem, tile % kStages);
    __syncthreads();
    // Its raw stage is free again: the gather of tile + kStages overlaps this tile's MMAs, so
    // kStages tiles stay in flight.
    if (tile + kStages < num_tiles) GatherTile(smem, p.kv, tile + kStages, tile % kStages);
    CommitAsync();

    // S[16, kKeysPerWarp] for this warp's keys, over 576 dims. Dependent MMAs on one accumulator
    // issue one per MMA latency, so the dims split over kChains independent partial sums.
    {
      constexpr int kKeyTiles = Config::kKeysPerWarp / 8;
      constexpr int kChains = kKeyTiles == 1 ? 4 : 2;
      constexpr int kStepsPerChain = kQkDim / 16 / kChains;
      static_assert((kQkDim / 16) % kChains == 0);
      float partial[kChains][kKeyTiles][4];
#pragma unroll
      for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) partial[c][n][j] = 0.0f;
      const int key0 = group_warp * Config::kKeysPerWarp;
      const __nv_bfloat16* q_lane = q_rows + (lane % 16) * Config::kStride + (lane / 16) * 8;
      const __nv_bfloat16* k_lane =
          smem.k + (key0 + lane % 8) * Config::kStride + (lane / 8 % 2) * 8;
#pragma unroll 3
      for (int step = 0; step < kStepsPerChain; ++step) {
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
          const int k0 = (step * kChains + c) * 16;
          uint32_t a[4];
          LoadMatrixX4(a, q_lane + k0);
#pragma unroll
          for (int n = 0; n < kKeyTiles; n += 2) {
            // Matrices 0-1: keys n*8.. at dims k0.., k0+8..; matrices 2-3: the next 8 keys.
            if constexpr (kKeyTiles == 1) {
              uint32_t b[2];
              LoadMatrixX2(b, k_lane + k0);
              MmaBf16(partial[c][n], a, b[0], b[1]);
            } else {
              uint32_t b[4];
              LoadMatrixX4(b, k_lane + (n * 8 + (lane / 16) * 8) * Config::kStride + k0);
              MmaBf16(partial[c][n], a, b[0], b[1]);
              MmaBf16(partial[c][n + 1], a, b[2], b[3]);
            }
          }
        }
      }
      float scores[kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          scores[n][j] = partial[0][n][j];
#pragma unroll
          for (int c = 1; c < kChains; ++c) scores[n][j] += partial[c][n][j];
        }
      const int32_t* tile_slots = smem.slots + tile * kBlockN;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        const int key = key0 + n * 8 + 2 * quad_lane;
        const bool valid0 = tile_slots[key] >= 0, valid1 = tile_slots[key + 1] >= 0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 value = make_float2(
              valid0 ? scores[n][2 * half] * p.score_scale_log2 : -INFINITY,
              valid1 ? scores[n][2 * half + 1] * p.score_scale_log2 : -INFINITY);
          *reinterpret_cast<float2*>(score_rows + (quad + 8 * half) * Config::kScoreStride + key) =
              value;
        }
      }
    }
    __syncthreads();

    // Online softmax over the whole tile row (every warp of the group reads the same rows), then
    // O[:, this warp's columns] += P V.
    constexpr int kKeySteps = kBlockN / 16;
    float probs[kKeySteps][2][4];  // [k-step][row half][a-fragment column]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float* row = score_rows + (quad + 8 * half) * Config::kScoreStride;
      float tile_max = -INFINITY;
#pragma unroll
      for (int step = 0; step < kKeySteps; ++step) {
        const float2 low = *reinterpret_cast<const float2*>(row + step * 16 + 2 * quad_lane);
        const float2 high = *reinterpret_cast<const float2*>(row + step * 16 + 8 + 2 * quad_lane);
        probs[step][half][0] = low.x;
        probs[step][half][1] = low.y;
        probs[step][half][2] = high.x;
        probs[step][half][3] = high.y;
        tile_max = fmaxf(tile_max, fmaxf(fmaxf(low.x, low.y), fmaxf(high.x, high.y)));
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[half], tile_max);
      // While a row has seen only invalid keys its max is -inf: subtract 0 instead (exp2 -> 0).
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float rescale = exp2f(row_max[half] - base);
      row_max[half] = new_max;
      row_sum[half] *= rescale;
#pragma unroll
      for (int i = 0; i < kOutTiles; ++i) {
        acc[i][2 * half] *= rescale;
        acc[i][2 * half + 1] *= rescale;
      }
#pragma unroll
      for (int step = 0; step < kKeySteps; ++step) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          probs[step][half][j] = exp2f(probs[step][half][j] - base);
          row_sum[half] += probs[step][half][j];
        }
      }
    }

    const int column0 = group_warp * Config::kColsPerWarp;
#pragma unroll
    for (int step = 0; step < kKeySteps; ++step) {
      const uint32_t a[4] = {PackBf16(probs[step][0][0], probs[step][0][1]),
                             PackBf16(probs[step][1][0], probs[step][1][1]),
                             PackBf16(probs[step][0][2], probs[step][0][3]),
                             PackBf16(probs[step][1][2], probs[step][1][3])};
      const __nv_bfloat16* v_rows =
          smem.k + (step * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * Config::kStride + column0 +
          (lane / 16) * 8;
#pragma unroll
      for (int n = 0; n < kOutTiles; n += 2) {
        uint32_t b[4];
        LoadMatrixX4Trans(b, v_rows + n * 8);
        MmaBf16(acc[n], a, b[0], b[1]);
        MmaBf16(acc[n + 1], a, b[2], b[3]);
      }
    }
  }
  WaitAsync<0>();

  // Epilogue: rows quad and quad + 8 of this warp's row group.
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int head = head_begin + row_group * 16 + quad + 8 * half;
    if (head >= p.num_heads) continue;
    const bool empty = !(sum > 0.0f);
    const float inverse = empty ? 0.0f : 1.0f / sum;
    const float lse_log2 = empty ? -INFINITY : row_max[half] + log2f(sum);
    const int64_t row_index = int64_t{token} * p.num_heads + head;
    const int column0 = group_warp * Config::kColsPerWarp + 2 * quad_lane;
    if (p.num_splits == 1) {
      __nv_bfloat16* out_row = p.out + row_index * kVDim + column0;
      const float scale = inverse * p.out_scale;
#pragma unroll
      for (int i = 0; i < kOutTiles; ++i) {
        *reinterpret_cast<uint32_t*>(out_row + i * 8) =
            PackBf16(acc[i][2 * half] * scale, acc[i][2 * half + 1] * scale);
      }
      if (group_warp == 0 && quad_lane == 0) {
        p.lse[row_index] = p.lse_base_e ? lse_log2 * kLn2 : lse_log2;
      }
    } else {
      const int64_t partial_row = int64_t{split} * p.num_tokens * p.num_heads + row_index;
      float* out_row = p.partial_out + partial_row * kVDim + column0;
#pragma unroll
      for (int i = 0; i < kOutTiles; ++i) {
        *reinterpret_cast<float2*>(out_row + i * 8) =
            make_float2(acc[i][2 * half] * inverse, acc[i][2 * half + 1] * inverse);
      }
      if (group_warp == 0 && quad_lane == 0) p.partial_lse[partial_row] = lse_log2;
    }
  }
}

// Combines the splits of each (token, head): weights 2^(lse_s - max) over the splits that saw a
// valid slot. One block of 128 threads per row, 4 columns per thread.
__global__ void __launch_bounds__(128) MergeSplitsKernel(const DecodeParams p) {
  const int64_t row = blockIdx.x;  // token * num_heads + head
  const int64_t rows = int64_t{p.num_tokens} * p.num_heads;
  float max_lse = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) max_lse = fmaxf(max_lse, p.partial_lse[s * rows + row]);
  float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
  float weight_sum = 0.0f;
  if (max_lse != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float weight = exp2f(p.partial_lse[s * rows + row] - max_lse);
      if (weight == 0.0f) continue;  // an empty split: its partial is 0, its lse -inf
      const float4 part =
          reinterpret_cast<const float4*>(p.partial_out + (s * rows + row) * kVDim)[threadIdx.x];
      total.x += weight * part.x;
      total.y += weight * part.y;
      total.z += weight * part.z;
      total.w += weight * part.w;
      weight_sum += weight;
    }
  }
  const float scale = weight_sum > 0.0f ? p.out_scale / weight_sum : 0.0f;
  uint2 packed;
  packed.x = PackBf16(total.x * scale, total.y * scale);
  packed.y = PackBf16(total.z * scale, total.w * scale);
  reinterpret_cast<uint2*>(p.out + row * kVDim)[threadIdx.x] = packed;
  if (threadIdx.x == 0) {
    const float lse_log2 = weight_sum > 0.0f ? max_lse + log2f(weight_sum) : -INFINITY;
    p.lse[row] = p.lse_base_e ? lse_log2 * 0.6931471805599453f : lse_log2;
  }
}

}  // namespace jax_sparse_mla::fp8
