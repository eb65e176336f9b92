// Sparse MLA decode over an fp8 KV cache for SM90, our own kernel (no FlashInfer code).
//
// One CTA computes `kHeads` heads (16, 32 or 64) of one query token over one split of its top-k
// slot list. Per tile of kBlockN slots:
//   1. cp.async gathers the tile's rows (576 or 656 bytes each) into a raw fp8 stage; invalid slots
//      (-1 holes, out of range, past the valid count) are never read: their bytes are zero-filled;
//   2. S = Q K^T with bf16 mma.sync (fp32 accumulate), the warps of a row group sharing 16 heads and
//      splitting the tile's keys; S goes through shared memory so that every warp sees whole rows;
//   3. online softmax (base 2) and O += P V, each warp of a row group owning a slice of the 512
//      output columns (the accumulator of 16 rows x 512 columns does not fit in one warp).
// The MMAs read the fp8 rows where cp.async put them: ldmatrix moves byte pairs as 16-bit
// elements, and each register is widened to two bf16 pairs in place. For S, a thread then holds
// dims 4q..4q+3 of a 16-dim block where the MMA expects 2q, 2q+1, 2q+8, 2q+9; Q is stored with the
// same permutation, which leaves every dot product unchanged. For P V (ldmatrix.trans), a register
// holds two keys of two adjacent columns; the even and odd columns feed two MMAs, and the output
// columns are put back in order when written. Widening is exact (see E4m3PairToBf16); the
// per-tensor scale multiplies the scores and the output, fp8_ds_mla's tile scales multiply each
// 128-dim partial dot product and, for P V, the probabilities of each key.
// The raw stages form a kStages-deep pipeline: the gathers of later tiles overlap steps 2-3.
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
  static constexpr int kStages = kHeads == 32 ? 3 : 4;
  static constexpr int kKeysPerWarp = kBlockN / kWarpsPerGroup;
  static constexpr int kColsPerWarp = kVDim / kWarpsPerGroup;
  static constexpr int kRowBytes = fp8::kRowBytes<kLayout>;
  // Shared-memory row strides whose 8 ldmatrix row addresses fall on distinct bank groups:
  // 592 = 576 + 16 bytes for e4m3 rows (656 already qualifies); Q rows of 576 bf16 + 8.
  static constexpr int kRawStride = kLayout == KvLayout::kE4m3 ? 592 : 656;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kQStride = kQkDim + 8;
  static constexpr int kScoreStride = kBlockN + 8;  // fp32 scores, padded against bank conflicts

  static constexpr int kQBytes = kHeads * kQStride * 2;
  static constexpr int kRawBytes = kStages * kBlockN * kRawStride;
  static constexpr int kScoreBytes = kHeads * kScoreStride * 4;
  static constexpr int kSlotBytes = kMaxKeysPerSplit * 4;
  static constexpr int kSmemBytes = kQBytes + kRawBytes + kScoreBytes + kSlotBytes;

  static_assert(kHeads == 16 || kHeads == 32 || kHeads == 64);
  static_assert(kKeysPerWarp % 8 == 0 && kColsPerWarp % 32 == 0);
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

// Two e4m3 bytes of `fp8x4` (picked by `selector`, see the Selector* constants) as a bf16 pair,
// with integer operations (the conversion instructions run at a quarter of the ALU rate). An e4m3
// byte s.eeee.mmm placed as s.0000eeee.mmm0000 is the bf16 of its value times 2^-120 (bf16's
// exponent bias is 120 above e4m3's), subnormals included; multiplying by 2^120 in bf16 is exact.
// The e4m3 NaN code becomes a finite value, like every byte pattern of a row the caller selected.
__device__ __forceinline__ uint32_t E4m3PairToBf16(uint32_t fp8x4, uint32_t selector) {
  const uint32_t placed = __byte_perm(fp8x4, 0, selector);  // bytes into the high byte of each half
  const uint32_t scaled_bits = (placed & 0x80008000u) | ((placed & 0x7f007f00u) >> 4);
  const __nv_bfloat162 scaled = *reinterpret_cast<const __nv_bfloat162*>(&scaled_bits);
  const __nv_bfloat162 value = __hmul2(scaled, __floats2bfloat162_rn(0x1p120f, 0x1p120f));
  return *reinterpret_cast<const uint32_t*>(&value);
}

// __byte_perm selectors placing bytes (i, j) of a register in the high bytes of a bf16 pair.
inline constexpr uint32_t kBytes01 = 0x1404, kBytes23 = 0x3424, kBytes02 = 0x2404, kBytes13 = 0x3414;

// ---- the decode kernel ----------------------------------------------------------------------------

template <typename Config>
struct SharedTile {
  __nv_bfloat16* q;   // [kHeads, kQStride], fp8 dims permuted (StoreQueryRows)
  uint8_t* raw;       // [kStages, kBlockN, kRawStride]
  float* scores;      // [kHeads, kScoreStride]
  int32_t* slots;     // [kMaxKeysPerSplit]: the split's slots, -1 where invalid

  __device__ explicit SharedTile(uint8_t* base)
      : q(reinterpret_cast<__nv_bfloat16*>(base)),
        raw(base + Config::kQBytes),
        scores(reinterpret_cast<float*>(base + Config::kQBytes + Config::kRawBytes)),
        slots(reinterpret_cast<int32_t*>(base + Config::kQBytes + Config::kRawBytes +
                                         Config::kScoreBytes)) {}
};

template <typename Config>
__device__ __forceinline__ void GatherTile(const SharedTile<Config>& smem, const uint8_t* kv,
                                           int tile, int stage) {
  uint8_t* raw = smem.raw + stage * Config::kBlockN * Config::kRawStride;
  constexpr int kChunks = Config::kBlockN * Config::kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    if (kChunks % kThreads != 0 && chunk >= kChunks) break;
    const int row = chunk / Config::kChunksPerRow;
    const int column = chunk % Config::kChunksPerRow;
    const int32_t slot = smem.slots[tile * Config::kBlockN + row];
    const uint8_t* src = kv + (slot >= 0 ? int64_t{slot} * Config::kRowBytes + column * 16 : 0);
    CopyAsync16(raw + row * Config::kRawStride + column * 16, src, slot >= 0 ? 16 : 0);
  }
}

// Q rows of the CTA's heads (zero past num_heads). Within each 16-dim block of the fp8 dims, the
// bf16 pairs go in the order 0, 2, 4, 6, 1, 3, 5, 7: the MMA's k slots 2q, 2q+1, 2q+8, 2q+9 then
// hold dims 4q..4q+3, as the fp8 K fragments do (fp8_ds_mla's bf16 RoPE dims keep their order).
template <typename Config>
__device__ __forceinline__ void StoreQueryRows(const SharedTile<Config>& smem,
                                               const DecodeParams& p, int token, int head_begin) {
  constexpr int kBlocks = kQkDim / 16;
  constexpr int kFp8Blocks = (Config::kLayout == KvLayout::kE4m3 ? kQkDim : kVDim) / 16;
  for (int unit = threadIdx.x; unit < Config::kHeads * kBlocks; unit += kThreads) {
    const int row = unit / kBlocks, block = unit % kBlocks;
    const int head = head_begin + row;
    uint4 low = make_uint4(0, 0, 0, 0), high = low;
    if (head < p.num_heads) {
      const uint4* src = reinterpret_cast<const uint4*>(
          p.q + (int64_t{token} * p.num_heads + head) * kQkDim + block * 16);
      low = src[0];
      high = src[1];
    }
    uint4* dst = reinterpret_cast<uint4*>(smem.q + row * Config::kQStride + block * 16);
    if (block < kFp8Blocks) {
      dst[0] = make_uint4(low.x, low.z, high.x, high.z);
      dst[1] = make_uint4(low.y, low.w, high.y, high.w);
    } else {
      dst[0] = low;
      dst[1] = high;
    }
  }
}

// fp8_ds_mla tile scale of `key` for latent dims [128 t, 128 t + 128).
template <typename Config>
__device__ __forceinline__ float TileScale(const uint8_t* raw, int key, int t) {
  return reinterpret_cast<const float*>(raw + key * Config::kRawStride + kVDim)[t];
}

template <typename Config>
__global__ void __launch_bounds__(kThreads, 1) SparseMlaFp8DecodeKernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t shared_bytes[];
  const SharedTile<Config> smem(shared_bytes);
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kStages = Config::kStages;
  constexpr bool kDsMla = Config::kLayout == KvLayout::kDsMla;

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
  StoreQueryRows(smem, p, token, head_begin);
  __syncthreads();

#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (stage < num_tiles) GatherTile(smem, p.kv, stage, stage);
    CommitAsync();
  }

  // Per thread: rows lane/4 and lane/4 + 8 of the warp's 16. O: per 32 columns, four m16n8 tiles
  // (even and odd columns of two 16-column blocks), columns 4 * (lane % 4) + {0..3} of each block.
  constexpr int kOutTiles = Config::kColsPerWarp / 8;
  float acc[kOutTiles][4];
#pragma unroll
  for (int i = 0; i < kOutTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; reduced over the quad at the end

  const int quad = lane / 4, quad_lane = lane % 4;
  const __nv_bfloat16* q_lane =
      smem.q + (row_group * 16 + lane % 16) * Config::kQStride + (lane / 16) * 8;
  float* score_rows = smem.scores + (row_group * 16) * Config::kScoreStride;
  const int key0 = group_warp * Config::kKeysPerWarp;
  const int column0 = group_warp * Config::kColsPerWarp;

  for (int tile = 0; tile < num_tiles; ++tile) {
    WaitAsync<kStages - 2>();
    __syncthreads();  // the tile landed; the previous tile's stage and scores are no longer read
    if (tile + kStages - 1 < num_tiles) {
      GatherTile(smem, p.kv, tile + kStages - 1, (tile + kStages - 1) % kStages);
    }
    CommitAsync();
    const uint8_t* raw = smem.raw + (tile % kStages) * kBlockN * Config::kRawStride;

    // S[16, kKeysPerWarp] over 576 dims: one partial sum per 128-dim latent tile (fp8_ds_mla
    // scales them; they also give the MMAs independent accumulators) and one for the RoPE dims.
    {
      constexpr int kKeyTiles = Config::kKeysPerWarp / 8;
      float partial[5][kKeyTiles][4];
#pragma unroll
      for (int t = 0; t < 5; ++t)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) partial[t][n][j] = 0.0f;
      // ldmatrix rows: key key0 + n * 8 + lane % 8, 16-byte block lane / 8 of 64 dims.
      const uint8_t* k_lane = raw + (key0 + lane % 8) * Config::kRawStride + (lane / 8) * 16;
      constexpr int kFp8Quarters = kDsMla ? 8 : 9;  // 64-dim groups held in fp8
#pragma unroll
      for (int quarter = 0; quarter < kFp8Quarters; ++quarter) {
        // Latent quarters visit the four 128-dim tiles in turn (independent accumulators).
        const int d0 = quarter < 8 ? (quarter % 4) * 128 + (quarter / 4) * 64 : kVDim;
        const int t = quarter < 8 ? quarter % 4 : 4;
        uint32_t k_frag[kKeyTiles][4];
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          LoadMatrixX4(k_frag[n], k_lane + n * 8 * Config::kRawStride + d0);
        }
#pragma unroll
        for (int step = 0; step < 4; ++step) {
          uint32_t a[4];
          LoadMatrixX4(a, q_lane + d0 + step * 16);
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) {
            MmaBf16(partial[t][n], a, E4m3PairToBf16(k_frag[n][step], kBytes01),
                    E4m3PairToBf16(k_frag[n][step], kBytes23));
          }
        }
      }
      if constexpr (kDsMla) {  // RoPE: 64 bf16 values after the latent bytes and the scales
        const uint8_t* rope_lane = raw + (key0 + lane % 8) * Config::kRawStride + kVDim + 16 +
                                   (lane / 8) * 16;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) {
            uint32_t b[4];  // dims 32 half + {0, 8, 16, 24}.. of keys n * 8..
            LoadMatrixX4(b, rope_lane + n * 8 * Config::kRawStride + half * 64);
            uint32_t a[4];
            LoadMatrixX4(a, q_lane + kVDim + half * 32);
            MmaBf16(partial[4][n], a, b[0], b[1]);
            LoadMatrixX4(a, q_lane + kVDim + half * 32 + 16);
            MmaBf16(partial[4][n], a, b[2], b[3]);
          }
        }
      }
      const int32_t* tile_slots = smem.slots + tile * kBlockN;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        const int key = key0 + n * 8 + 2 * quad_lane;
        float scale[4][2];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          scale[t][0] = kDsMla ? TileScale<Config>(raw, key, t) : 1.0f;
          scale[t][1] = kDsMla ? TileScale<Config>(raw, key + 1, t) : 1.0f;
        }
        const bool valid0 = tile_slots[key] >= 0, valid1 = tile_slots[key + 1] >= 0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float dot[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            dot[c] = partial[4][n][2 * half + c];
#pragma unroll
            for (int t = 0; t < 4; ++t) dot[c] += scale[t][c] * partial[t][n][2 * half + c];
          }
          const float2 value = make_float2(valid0 ? dot[0] * p.score_scale_log2 : -INFINITY,
                                           valid1 ? dot[1] * p.score_scale_log2 : -INFINITY);
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

#pragma unroll
    for (int step = 0; step < kKeySteps; ++step) {
      // ldmatrix.trans rows: keys step * 16 + lane % 16, 16-byte column block lane / 16 of 32.
      const uint8_t* v_lane = raw + (step * 16 + lane % 16) * Config::kRawStride + column0 +
                              (lane / 16) * 16;
      // P's A fragment holds keys 2q, 2q+1 (a0, a1) and 2q+8, 2q+9 (a2, a3); fp8_ds_mla scales
      // each key's probability by the key's scale of the 128-column tile being multiplied.
      uint32_t a[4];
      int a_tile = -1;
#pragma unroll
      for (int pair = 0; pair < Config::kColsPerWarp / 32; ++pair) {
        const int tile_of_pair = (column0 + pair * 32) / 128;
        if (pair == 0 || (kDsMla && tile_of_pair != a_tile)) {
          float key_scale[4] = {1.0f, 1.0f, 1.0f, 1.0f};
          if constexpr (kDsMla) {
            const int k = step * 16 + 2 * quad_lane;
            key_scale[0] = TileScale<Config>(raw, k, tile_of_pair);
            key_scale[1] = TileScale<Config>(raw, k + 1, tile_of_pair);
            key_scale[2] = TileScale<Config>(raw, k + 8, tile_of_pair);
            key_scale[3] = TileScale<Config>(raw, k + 9, tile_of_pair);
          }
          a[0] = PackBf16(probs[step][0][0] * key_scale[0], probs[step][0][1] * key_scale[1]);
          a[1] = PackBf16(probs[step][1][0] * key_scale[0], probs[step][1][1] * key_scale[1]);
          a[2] = PackBf16(probs[step][0][2] * key_scale[2], probs[step][0][3] * key_scale[3]);
          a[3] = PackBf16(probs[step][1][2] * key_scale[2], probs[step][1][3] * key_scale[3]);
          a_tile = tile_of_pair;
        }
        uint32_t v[4];  // keys 0-7 / 8-15 of column block 0, then of column block 1
        LoadMatrixX4Trans(v, v_lane + pair * 32);
#pragma unroll
        for (int block = 0; block < 2; ++block) {
          float* even = acc[4 * pair + 2 * block];
          float* odd = acc[4 * pair + 2 * block + 1];
          MmaBf16(*reinterpret_cast<float(*)[4]>(even), a,
                  E4m3PairToBf16(v[2 * block], kBytes02), E4m3PairToBf16(v[2 * block + 1], kBytes02));
          MmaBf16(*reinterpret_cast<float(*)[4]>(odd), a,
                  E4m3PairToBf16(v[2 * block], kBytes13), E4m3PairToBf16(v[2 * block + 1], kBytes13));
        }
      }
    }
  }
  WaitAsync<0>();

  // Epilogue: rows quad and quad + 8 of this warp's row group; per 16-column block, the thread's
  // columns 4 * quad_lane + {0, 1, 2, 3} are (even[0], odd[0], even[1], odd[1]) of its two tiles.
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
    const int64_t partial_row = int64_t{split} * p.num_tokens * p.num_heads + row_index;
    const float scale = p.num_splits == 1 ? inverse * p.out_scale : inverse;
#pragma unroll
    for (int block = 0; block < kOutTiles / 2; ++block) {
      const float* even = acc[2 * block];
      const float* odd = acc[2 * block + 1];
      const float values[4] = {even[2 * half] * scale, odd[2 * half] * scale,
                               even[2 * half + 1] * scale, odd[2 * half + 1] * scale};
      const int column = column0 + block * 16 + 4 * quad_lane;
      if (p.num_splits == 1) {
        *reinterpret_cast<uint2*>(p.out + row_index * kVDim + column) =
            make_uint2(PackBf16(values[0], values[1]), PackBf16(values[2], values[3]));
      } else {
        *reinterpret_cast<float4*>(p.partial_out + partial_row * kVDim + column) =
            make_float4(values[0], values[1], values[2], values[3]);
      }
    }
    if (group_warp == 0 && quad_lane == 0) {
      if (p.num_splits == 1) {
        p.lse[row_index] = p.lse_base_e ? lse_log2 * kLn2 : lse_log2;
      } else {
        p.partial_lse[partial_row] = lse_log2;
      }
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
