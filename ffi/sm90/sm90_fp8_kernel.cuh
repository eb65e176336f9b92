// Sparse MLA decode over an fp8 KV cache for SM90, our own kernel (no FlashInfer code).
//
// One CTA computes kHeads = 16 heads of one query token over one split of its top-k slot list, with
// 8 consumer warps and 4 producer warps. Per tile of 64 slots:
//   1. the producers issue bulk copies (the copy engine, one per valid slot: a 576- or 656-byte row)
//      that bring the tile's rows into a raw fp8 stage and complete on the stage's mbarrier;
//      invalid slots (-1 holes, out of range, past the valid count) are never read, and whatever
//      their stage rows hold is discarded by selects. A copy takes uniform operands, so a warp's
//      copies go out one after another: in warps of their own they no longer hold up the MMAs;
//   2. S = Q K^T with f16 mma.sync (fp32 accumulate). The consumers split the work by keys (two
//      halves of 32) and by dims (four groups: one 128-dim latent tile plus 16 RoPE dims each), so
//      every fp8 value of the tile is read from shared memory and converted once per CTA, and each
//      warp keeps its slice of Q in registers for the whole split. The four dim groups' partial
//      scores go through shared memory;
//   3. a softmax pass over whole rows (16 threads per row) sums the partials, masks invalid slots,
//      updates the running max and sum (base 2) and writes P once;
//   4. O += P V with mma.sync, each consumer warp owning 64 of the 512 output columns for all heads
//      (the running output is rescaled only when some row's max moved).
// Between two consumer barriers each warp runs the softmax of tile t + 1, P V of tile t and the
// scores of tile t + 2 (partial scores, P and rescale factors are double-buffered), so one warp's
// MMAs overlap another's softmax latencies; then a consumer releases tile t's stage to the
// producers through the stage's `freed` mbarrier.
// The MMAs read the fp8 rows where the copies put them (ldmatrix moves byte pairs as 16-bit
// elements). For S, each register of four keys' bytes becomes two f16 pairs through the
// conversion instructions (exact); Q is held after a power-of-two row scale (ScaleQueryRows; the
// dims that meet fp8 keys as f16), undone on the fp32 scores. A thread holds dims 4q..4q+3 of a
// 16-dim block where the MMA expects 2q, 2q+1, 2q+8, 2q+9; Q is stored with the same permutation,
// which leaves every dot product unchanged. For P V (ldmatrix.trans), a register holds two keys of
// two adjacent columns: a byte permute and two conversions make the even and odd columns' f16
// pairs for f16 MMAs with P as f16 (e4m3 rows); fp8_ds_mla rows are widened to bf16 with integer
// operations instead (exact, see PlacedE4m3ToScaledBf16) because their P carries the tile scales,
// which need bf16's range. The even and odd columns feed two MMAs, and the output columns are put
// back in order when written. The per-tensor scale multiplies the scores and the output,
// fp8_ds_mla's tile scales multiply each 128-dim partial dot product and, for P V, the
// probabilities of each key (one P per 128-column tile).
// The raw stages form a kStages-deep ring: the copies of later tiles overlap steps 2-4.
//
// With one split the CTA writes out / lse directly; otherwise it writes a normalised fp32 partial
// and its base-2 lse, and MergeSplits (sm90_merge_splits.cu) combines the splits. A row with no
// valid slot ends with l = 0: out 0, lse -inf (never NaN).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "sm90/sm90_async.cuh"

namespace jax_sparse_mla::fp8 {

inline constexpr int kQkDim = 576;
inline constexpr int kVDim = 512;
// Warps 0-7 compute (the consumers); warps 8-11 gather the tiles' rows (the producers).
inline constexpr int kConsumerThreads = 256;
inline constexpr int kConsumerWarps = kConsumerThreads / 32;
inline constexpr int kProducerWarps = 4;
inline constexpr int kThreads = kConsumerThreads + 32 * kProducerWarps;
inline constexpr int kBlockN = 64;  // slots per tile
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
  int keys_per_split;       // a multiple of kBlockN, <= kMaxKeysPerSplit
  float score_scale_log2;   // bmm1_scale * log2(e)
  float out_scale;          // bmm2_scale
  bool lse_base_e;
};

// The slots of the CTA's split: positions [key_begin, key_end) of its token's list (the split's
// range, cut at the token's valid count), num_tiles tiles of kBlockN.
struct SplitRange {
  int key_begin, key_end, num_tiles;
};
__device__ __forceinline__ SplitRange SplitOf(const DecodeParams& p, int token, int split) {
  const int valid_count = min(max(p.valid_counts[token], 0), p.num_keys);
  const int key_begin = split * p.keys_per_split;
  const int key_end = min(key_begin + p.keys_per_split, valid_count);
  return {key_begin, key_end,
          key_end > key_begin ? (key_end - key_begin + kBlockN - 1) / kBlockN : 0};
}

template <KvLayout kLayout_>
struct TileConfig {
  static constexpr int kHeads = 16;  // one 16-row MMA tile
  static constexpr KvLayout kLayout = kLayout_;
  static constexpr bool kDsMla = kLayout == KvLayout::kDsMla;
  static constexpr int kStages = 4;
  static constexpr int kRowBytes = fp8::kRowBytes<kLayout>;
  // Shared-memory row strides whose 8 ldmatrix row addresses fall on distinct bank groups:
  // 592 = 576 + 16 bytes for e4m3 rows (656 already qualifies); Q rows of 576 bf16 + 8; partial
  // scores of 64 fp32 + 8 and P rows of 64 bf16 + 8.
  static constexpr int kRawStride = kDsMla ? 656 : 592;
  static constexpr int kQStride = kQkDim + 8;
  static constexpr int kPartialStride = kBlockN + 8;
  static constexpr int kPStride = kBlockN + 8;
  static constexpr int kPVersions = kDsMla ? 4 : 1;  // P times each 128-column tile's key scales
  // P V as bf16 MMAs on integer-widened values (fp8_ds_mla), or as f16 MMAs on converted ones.
  static constexpr bool kPvBf16 = kDsMla;

  // Q is only read before the first tile, so the partial scores reuse its bytes. Partial scores,
  // P and the rescale factors are double-buffered: a tile's softmax runs beside the next tile's
  // scores and the previous tile's P V.
  static constexpr int kQBytes = kHeads * kQStride * 2;
  static constexpr int kPartialBytes = 2 * 4 * kHeads * kPartialStride * 4;
  static constexpr int kUnionBytes = kQBytes > kPartialBytes ? kQBytes : kPartialBytes;
  static constexpr int kRawBytes = kStages * kBlockN * kRawStride;
  static constexpr int kPBytes = 2 * kPVersions * kHeads * kPStride * 2;
  static constexpr int kRowBytesShared = 4 * kHeads * 4;  // 2 rescales, final 1/sum, 1/Q's scale
  static constexpr int kSlotBytes = kMaxKeysPerSplit * 4;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int kSmemBytes =
      kUnionBytes + kRawBytes + kPBytes + kRowBytesShared + kSlotBytes + kBarrierBytes;

  static_assert(kMaxKeysPerSplit % kBlockN == 0);
  static_assert(kSmemBytes <= 227 * 1024);
};

// ---- PTX wrappers ---------------------------------------------------------------------------------

using sm90::ArriveExpectBytes;
using sm90::CopyBulk;
using sm90::SmemAddress;
using sm90::WaitBarrier;

// Every barrier here is fenced for the copy engine as soon as it is initialised.
__device__ __forceinline__ void InitBarrier(uint64_t* barrier, int arrivals) {
  sm90::InitBarrier(barrier, arrivals);
  sm90::FenceBarrierInit();
}

__device__ __forceinline__ void Arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddress(barrier)) : "memory");
}

// The consumer warps' barrier (the producers never wait on it).
__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// 2^x (ex2.approx.ftz: 2^-inf = 0, NaN stays NaN; results below 2^-126 flush to 0).
__device__ __forceinline__ float Exp2(float x) {
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(result) : "f"(x));
  return result;
}

__device__ __forceinline__ void LoadMatrixX4(uint32_t (&regs)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(SmemAddress(row_address)));
}

__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&regs)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(SmemAddress(row_address)));
}

enum class MmaInputs { kBf16, kF16 };

// acc[16x8] += a[16x16] * b[16x8] with fp32 accumulators; a and b hold bf16 or f16 pairs.
template <MmaInputs kInputs>
__device__ __forceinline__ void Mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#define JSM_MMA_M16N8K16(TYPE)                                                                  \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                           \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"         \
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (kInputs == MmaInputs::kBf16) {
    JSM_MMA_M16N8K16("bf16");
  } else {
    JSM_MMA_M16N8K16("f16");
  }
#undef JSM_MMA_M16N8K16
}

// The four e4m3 values of `fp8x4` as two f16 pairs (bytes 0 and 1, then 2 and 3), with one
// conversion instruction per pair (e4m3 values, subnormals included, are exact in f16).
__device__ __forceinline__ void E4m3ToF16Pairs(uint32_t fp8x4, uint32_t& low, uint32_t& high) {
  asm("{\n"
      ".reg .b16 low_bytes, high_bytes;\n"
      "mov.b32 {low_bytes, high_bytes}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, low_bytes;\n"
      "cvt.rn.f16x2.e4m3x2 %1, high_bytes;\n"
      "}\n"
      : "=r"(low), "=r"(high)
      : "r"(fp8x4));
}

// For P V on e4m3 rows: bytes 0 and 2 (`even`) and 1 and 3 (`odd`) of `fp8x4` as f16 pairs, one
// byte permute and two conversions.
__device__ __forceinline__ void E4m3EvenOddToF16(uint32_t fp8x4, uint32_t& even, uint32_t& odd) {
  E4m3ToF16Pairs(__byte_perm(fp8x4, 0, 0x3120), even, odd);
}

__device__ __forceinline__ uint32_t PackBf16(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ uint32_t PackF16(float low, float high) {
  const __half2 pair = __floats2half2_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// For P V on fp8_ds_mla rows: e4m3 bytes 0 and 2 (E4m3Bytes02) or 1 and 3 (E4m3Bytes13) of
// `fp8x4` as a bf16 pair of their values times 2^-120, with integer operations (there is no
// e4m3 -> bf16 conversion instruction). An e4m3 byte s.eeee.mmm placed as s.0000eeee.mmm0000 is
// the bf16 of its value times 2^-120 (bf16's exponent bias is 120 above e4m3's), subnormals
// included (they become bf16 subnormals, which the MMAs take as they are). The e4m3 NaN code
// becomes a finite value, like every byte pattern of a row. The 2^-120 is paid back by
// kOperandScale on P and kResultScale on the fp32 outputs.
__device__ __forceinline__ uint32_t PlacedE4m3ToScaledBf16(uint32_t placed) {
  // `placed` holds the two bytes in the high byte of each 16-bit half; other bits are ignored.
  return (placed & 0x80008000u) | ((placed & 0x7f007f00u) >> 4);
}
__device__ __forceinline__ uint32_t E4m3Bytes02(uint32_t fp8x4) {
  return PlacedE4m3ToScaledBf16(fp8x4 << 8);
}
__device__ __forceinline__ uint32_t E4m3Bytes13(uint32_t fp8x4) {
  return PlacedE4m3ToScaledBf16(fp8x4);
}

// fp8_ds_mla's P (P <= 1 times a tile scale) enters the MMAs times 2^60, so that its products with
// the 2^-120-scaled values stay far above fp32's subnormals; the outputs are multiplied by 2^60 to
// undo the rest. Bf16 keeps fp32's exponent range, which any tile scale needs; e4m3 rows, without
// tile scales, take P as f16 (P <= 1; finer than bf16) and the values converted exactly to f16.
inline constexpr float kOperandScale = 0x1p60f;
inline constexpr float kResultScale = 0x1p60f;



// ---- the decode kernel ----------------------------------------------------------------------------

template <typename Config>
struct SharedTile {
  uint16_t* q;            // [kHeads, kQStride]: Q as StoreQueryRows leaves it; before tile 0
  float* partial;         // [2][4 dim groups, kHeads, kPartialStride] scores; the bytes of q
  uint8_t* raw;           // [kStages, kBlockN, kRawStride]
  uint16_t* probs;        // [2][kPVersions, kHeads, kPStride]: P as f16 (e4m3) / bf16 (fp8_ds_mla)
  float* rescale;         // [2][kHeads]: factor on the running output before a tile's P V
  float* inverse_sum;     // [kHeads]: 1 / l after the last tile, 0 for a row without valid slots
  float* query_unscale;   // [kHeads]: 1 / the power of two Q's row was scaled by
  int32_t* slots;         // [kMaxKeysPerSplit]: the split's slots, -1 where invalid
  uint64_t* landed;       // [kStages]: mbarriers, a stage's rows have arrived
  uint64_t* freed;        // [kStages]: mbarriers, the consumers are done with a stage's rows

  __device__ explicit SharedTile(uint8_t* base)
      : q(reinterpret_cast<uint16_t*>(base)),
        partial(reinterpret_cast<float*>(base)),
        raw(base + Config::kUnionBytes),
        probs(reinterpret_cast<uint16_t*>(raw + Config::kRawBytes)),
        rescale(reinterpret_cast<float*>(raw + Config::kRawBytes + Config::kPBytes)),
        inverse_sum(rescale + 2 * Config::kHeads),
        query_unscale(inverse_sum + Config::kHeads),
        slots(reinterpret_cast<int32_t*>(query_unscale + Config::kHeads)),
        landed(reinterpret_cast<uint64_t*>(slots + kMaxKeysPerSplit)),
        freed(landed + Config::kStages) {}
};

// Producer warp `producer` issues one bulk copy per valid slot among its kRowsPerWarp rows of the
// tile (the copy takes uniform operands, so the lanes' copies go out one after another) and
// arrives once on the stage's barrier. Rows of invalid slots keep whatever the stage held (possibly
// another CTA's bytes): scores and scales computed from them are discarded by selects on the slot,
// never by multiplying by 0. Their values, which P V's f16 MMAs multiply by P = 0, are zeroed
// before the arrival that publishes them (an e4m3 NaN code would convert to NaN; integer widening
// makes every byte finite).
inline constexpr int kRowsPerWarp = kBlockN / kProducerWarps;

template <typename Config>
__device__ __forceinline__ void GatherTile(const SharedTile<Config>& smem, const uint8_t* kv,
                                           int tile, int stage, int producer, int lane) {
  const int row = producer * kRowsPerWarp + lane;
  uint64_t* landed = smem.landed + stage;
  const int32_t slot = lane < kRowsPerWarp ? smem.slots[tile * kBlockN + row] : -1;
  const int valid_rows = __popc(__ballot_sync(0xffffffffu, slot >= 0));
  if constexpr (!Config::kPvBf16) {
    uint32_t invalid_rows = __ballot_sync(0xffffffffu, lane < kRowsPerWarp && slot < 0);
    if (invalid_rows != 0) {
      static_assert(kVDim == 32 * 16);
      do {
        const int invalid_row = producer * kRowsPerWarp + __ffs(invalid_rows) - 1;
        reinterpret_cast<uint4*>(
            smem.raw + (stage * kBlockN + invalid_row) * Config::kRawStride)[lane] =
            make_uint4(0, 0, 0, 0);
        invalid_rows &= invalid_rows - 1;
      } while (invalid_rows != 0);
      // Ordered before later bulk copies into these rows (the copy engine is another proxy).
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncwarp();  // every lane's zeros before lane 0's arrival
    }
  }
  if (lane == 0) ArriveExpectBytes(landed, valid_rows * Config::kRowBytes);
  if (slot >= 0) {
    CopyBulk(smem.raw + (stage * kBlockN + row) * Config::kRawStride,
             kv + int64_t{slot} * Config::kRowBytes, Config::kRowBytes, landed);
  }
}

// Q rows of the CTA's heads (bf16, zero past num_heads), as given.
template <typename Config>
__device__ __forceinline__ void StoreQueryRows(const SharedTile<Config>& smem,
                                               const DecodeParams& p, int token, int head_begin) {
  constexpr int kChunks = kQkDim / 8;
  for (int unit = threadIdx.x; unit < Config::kHeads * kChunks; unit += kThreads) {
    const int row = unit / kChunks, chunk = unit % kChunks;
    const int head = head_begin + row;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (head < p.num_heads) {
      value = reinterpret_cast<const uint4*>(
          p.q + (int64_t{token} * p.num_heads + head) * kQkDim)[chunk];
    }
    reinterpret_cast<uint4*>(smem.q + row * Config::kQStride)[chunk] = value;
  }
}

// In place, each Q row is scaled by the power of two that puts its largest |q| in [2^14, 2^15),
// undone on the fp32 scores, and its dims that meet e4m3 keys become f16. f16 then holds every
// bf16 value of the row exactly down to 2^-31 of the largest; smaller ones round to f16's
// subnormal spacing, an error below 2^-38 of the largest (fp8_ds_mla's RoPE dims stay bf16,
// scaled exactly). Within each 16-dim
// block the pairs go in the order 0, 2, 4, 6, 1, 3, 5, 7: the MMA's k slots 2q, 2q+1, 2q+8, 2q+9
// then hold dims 4q..4q+3, as the key fragments do (bytes 0 and 1, then 2 and 3, of a register).
// Run by the consumer threads.
template <typename Config>
__device__ __forceinline__ void ScaleQueryRows(const SharedTile<Config>& smem) {
  constexpr int kThreadsPerRow = kConsumerThreads / Config::kHeads;
  constexpr int kFp8Blocks = (Config::kDsMla ? kVDim : kQkDim) / 16;
  const int row = threadIdx.x / kThreadsPerRow, first = threadIdx.x % kThreadsPerRow;
  uint16_t* q_row = smem.q + row * Config::kQStride;
  float largest = 0.0f;
  for (int block = first; block < kQkDim / 16; block += kThreadsPerRow) {
    for (int d = 0; d < 16; ++d) {
      const float value = __bfloat162float(__ushort_as_bfloat16(q_row[block * 16 + d]));
      largest = fmaxf(largest, fabsf(value));
    }
  }
#pragma unroll
  for (int offset = 1; offset < kThreadsPerRow; offset *= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  // Rows of zeros (padding heads) keep a scale of 1; past bf16's range the row is clamped.
  const int exponent = largest > 0.0f ? ilogbf(largest) : 14;
  const float scale = ldexpf(1.0f, 14 - max(exponent, -110));
  for (int block = first; block < kFp8Blocks; block += kThreadsPerRow) {
    uint32_t pairs[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __half2 converted = __floats2half2_rn(
          __bfloat162float(__ushort_as_bfloat16(q_row[block * 16 + 2 * i])) * scale,
          __bfloat162float(__ushort_as_bfloat16(q_row[block * 16 + 2 * i + 1])) * scale);
      pairs[i] = *reinterpret_cast<const uint32_t*>(&converted);
    }
    uint4* dst = reinterpret_cast<uint4*>(q_row + block * 16);
    dst[0] = make_uint4(pairs[0], pairs[2], pairs[4], pairs[6]);
    dst[1] = make_uint4(pairs[1], pairs[3], pairs[5], pairs[7]);
  }
  // fp8_ds_mla's RoPE dims stay bf16, scaled by the same power of two (exact).
  for (int block = kFp8Blocks + first; block < kQkDim / 16; block += kThreadsPerRow) {
    for (int d = 0; d < 16; ++d) {
      const float value = __bfloat162float(__ushort_as_bfloat16(q_row[block * 16 + d])) * scale;
      q_row[block * 16 + d] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
    }
  }
  if (first == 0) smem.query_unscale[row] = 1.0f / scale;
}

// fp8_ds_mla tile scales of `key`: one per 128 latent dims.
template <typename Config>
__device__ __forceinline__ float4 TileScales(const uint8_t* raw, int key) {
  return *reinterpret_cast<const float4*>(raw + key * Config::kRawStride + kVDim);
}

__device__ __forceinline__ float Component(const float4& values, int i) {
  return i == 0 ? values.x : i == 1 ? values.y : i == 2 ? values.z : values.w;
}

template <typename Config>
__global__ void __launch_bounds__(kThreads, 1) SparseMlaFp8DecodeKernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t shared_bytes[];
  const SharedTile<Config> smem(shared_bytes);
  constexpr int kHeads = Config::kHeads;
  constexpr int kStages = Config::kStages;
  constexpr int kStride = Config::kRawStride;
  constexpr bool kDsMla = Config::kDsMla;

  const int head_begin = blockIdx.x * kHeads;
  const int split = blockIdx.y;
  const int token = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad = lane / 4, quad_lane = lane % 4;

  const SplitRange range = SplitOf(p, token, split);
  const int key_begin = range.key_begin, key_end = range.key_end, num_tiles = range.num_tiles;

  // The split's slots, with every entry the op must not read as -1.
  const int32_t* token_indices = p.indices + int64_t{token} * p.num_keys;
  for (int i = threadIdx.x; i < num_tiles * kBlockN; i += kThreads) {
    const int position = key_begin + i;
    const int32_t slot = position < key_end ? token_indices[position] : -1;
    smem.slots[i] = (slot >= 0 && slot < p.num_slots) ? slot : -1;
  }
  if (threadIdx.x < kStages) {
    InitBarrier(smem.landed + threadIdx.x, kProducerWarps);
    InitBarrier(smem.freed + threadIdx.x, 1);
  }
  StoreQueryRows(smem, p, token, head_begin);
  __syncthreads();  // the slots, barriers and Q are in shared memory

  // The producers gather every tile as soon as its stage is free: tile t + kStages goes into the
  // stage of tile t once the consumers have released it.
  if (warp >= kConsumerWarps) {
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int stage = tile % kStages;
      if (tile >= kStages) WaitBarrier(smem.freed + stage, (tile / kStages - 1) % 2);
      GatherTile(smem, p.kv, tile, stage, warp - kConsumerWarps, lane);
    }
    return;
  }

  ScaleQueryRows(smem);
  ConsumerSync();

  // Scores: this warp's keys 32 * key_half + [0, 32) over dim group `dim_group`: latent dims
  // 128 * dim_group + [0, 128) (k-steps 0-7) and RoPE dims 512 + 16 * dim_group + [0, 16)
  // (k-step 8).
  const int key_half = warp / 4, dim_group = warp % 4;
  uint32_t q_frag[9][4];
#pragma unroll
  for (int step = 0; step < 9; ++step) {
    const int dim = step < 8 ? 128 * dim_group + 16 * step : kVDim + 16 * dim_group;
    LoadMatrixX4(q_frag[step], smem.q + (lane % 16) * Config::kQStride + dim + (lane / 16) * 8);
  }
  ConsumerSync();  // Q is in registers: its bytes now hold partial scores

  // Softmax: kThreadsPerRow threads per row, each holding keys 4 * chunk + [0, 4). Its row's score
  // scale also undoes the power of two Q's row was scaled by.
  constexpr int kThreadsPerRow = kConsumerThreads / kHeads;
  const int softmax_row = threadIdx.x / kThreadsPerRow;
  const int softmax_chunk = threadIdx.x % kThreadsPerRow;
  const float score_scale = p.score_scale_log2 * smem.query_unscale[softmax_row];
  float row_max = -INFINITY;
  float row_sum = 0.0f;  // this thread's keys only; reduced over the row at the end

  // P V: this warp's 64 output columns for all rows. Per 16 columns, two m16n8 tiles (even and odd
  // columns); a thread holds columns 4 * quad_lane + {0..3} of each 16.
  const int column0 = warp * 64;
  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  // Tile t's partial scores, P and rescale factors live in buffer t % 2.
  const auto partial_buffer = [&](int tile) {
    return smem.partial + (tile % 2) * 4 * kHeads * Config::kPartialStride;
  };
  const auto probs_buffer = [&](int tile) {
    return smem.probs + (tile % 2) * Config::kPVersions * kHeads * Config::kPStride;
  };
  const auto rescale_buffer = [&](int tile) { return smem.rescale + (tile % 2) * kHeads; };

  // Partial scores of this warp's keys and dim group for `tile` (its rows have landed).
  const auto scores = [&](int tile) {
    const uint8_t* raw = smem.raw + (tile % kStages) * kBlockN * kStride;
    float score[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) score[n][0] = score[n][1] = score[n][2] = score[n][3] = 0.0f;
    // ldmatrix rows: key 32 * key_half + 8 n + lane % 8, 16-byte block lane / 8 of 64 dims.
    const uint8_t* k_lane =
        raw + (32 * key_half + lane % 8) * kStride + 128 * dim_group + (lane / 8) * 16;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t k_frag[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) LoadMatrixX4(k_frag[n], k_lane + n * 8 * kStride + 64 * half);
#pragma unroll
      for (int step = 0; step < 4; ++step) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          uint32_t b0, b1;
          E4m3ToF16Pairs(k_frag[n][step], b0, b1);
          Mma<MmaInputs::kF16>(score[n], q_frag[4 * half + step], b0, b1);
        }
      }
    }
    if constexpr (kDsMla) {
      // Apply the latent tile's scale per key, then add the bf16 RoPE dims (they meet Q's row
      // scaled too): each ldmatrix.x4 covers dims [0, 8) and [8, 16) of two 8-key tiles.
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int key = 32 * key_half + 8 * n + 2 * quad_lane;
        const float scale0 = Component(TileScales<Config>(raw, key), dim_group);
        const float scale1 = Component(TileScales<Config>(raw, key + 1), dim_group);
        score[n][0] *= scale0;
        score[n][1] *= scale1;
        score[n][2] *= scale0;
        score[n][3] *= scale1;
      }
      const uint8_t* rope_lane = raw + (32 * key_half + 8 * (lane / 16) + lane % 8) * kStride +
                                 kVDim + 16 + 32 * dim_group + ((lane / 8) % 2) * 16;
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        uint32_t b[4];
        LoadMatrixX4(b, rope_lane + 16 * pair * kStride);
        Mma<MmaInputs::kBf16>(score[2 * pair], q_frag[8], b[0], b[1]);
        Mma<MmaInputs::kBf16>(score[2 * pair + 1], q_frag[8], b[2], b[3]);
      }
    } else {  // e4m3 RoPE dims: one 8-key matrix of 16 bytes per key tile
      uint32_t b[4];
      LoadMatrixX4(b, raw + (32 * key_half + lane) * kStride + kVDim + 16 * dim_group);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        uint32_t b0, b1;
        E4m3ToF16Pairs(b[n], b0, b1);
        Mma<MmaInputs::kF16>(score[n], q_frag[8], b0, b1);
      }
    }
    float* partial = partial_buffer(tile) + dim_group * kHeads * Config::kPartialStride;
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = quad + 8 * half;
        const int key = 32 * key_half + 8 * n + 2 * quad_lane;
        *reinterpret_cast<float2*>(partial + row * Config::kPartialStride + key) =
            make_float2(score[n][2 * half], score[n][2 * half + 1]);
      }
  };

  // Softmax over whole rows of `tile`: sum the dim groups, mask, online max and sum, P.
  const auto softmax = [&](int tile) {
    const uint8_t* raw = smem.raw + (tile % kStages) * kBlockN * kStride;
    const float* partial = partial_buffer(tile);
    const int key = 4 * softmax_chunk;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float4 part = *reinterpret_cast<const float4*>(
          partial + (g * kHeads + softmax_row) * Config::kPartialStride + key);
      sum.x += part.x;
      sum.y += part.y;
      sum.z += part.z;
      sum.w += part.w;
    }
    const int4 slot = *reinterpret_cast<const int4*>(smem.slots + tile * kBlockN + key);
    const bool valid[4] = {slot.x >= 0, slot.y >= 0, slot.z >= 0, slot.w >= 0};
    float prob[4] = {valid[0] ? sum.x * score_scale : -INFINITY,
                     valid[1] ? sum.y * score_scale : -INFINITY,
                     valid[2] ? sum.z * score_scale : -INFINITY,
                     valid[3] ? sum.w * score_scale : -INFINITY};
    float tile_max = fmaxf(fmaxf(prob[0], prob[1]), fmaxf(prob[2], prob[3]));
#pragma unroll
    for (int offset = 1; offset < kThreadsPerRow; offset *= 2) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
    }
    const float new_max = fmaxf(row_max, tile_max);
    // While a row has seen only invalid keys its max is -inf: subtract 0 instead (exp2 -> 0).
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float rescale = Exp2(row_max - base);
    row_max = new_max;
    row_sum *= rescale;
    if (softmax_chunk == 0) rescale_buffer(tile)[softmax_row] = rescale;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      prob[c] = Exp2(prob[c] - base);
      row_sum += prob[c];
    }
    float4 key_scales[4];
    if constexpr (kDsMla) {
#pragma unroll
      for (int c = 0; c < 4; ++c) key_scales[c] = TileScales<Config>(raw, key + c);
    }
    uint16_t* probs = probs_buffer(tile);
#pragma unroll
    for (int version = 0; version < Config::kPVersions; ++version) {
      float value[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        // An invalid slot's row (and so its scales) is whatever the stage held: select 0.
        value[c] = valid[c] ? (kDsMla ? prob[c] * kOperandScale * Component(key_scales[c], version)
                                      : prob[c])
                            : 0.0f;
      }
      *reinterpret_cast<uint2*>(probs + (version * kHeads + softmax_row) * Config::kPStride + key) =
          Config::kPvBf16 ? make_uint2(PackBf16(value[0], value[1]), PackBf16(value[2], value[3]))
                          : make_uint2(PackF16(value[0], value[1]), PackF16(value[2], value[3]));
    }
  };

  // O[:, this warp's columns] *= `tile`'s rescale factors.
  const auto rescale_output = [&](int tile) {
    const float* rescale_rows = rescale_buffer(tile);
    float rescale[2];
    bool any_rescale = false;  // once the row maxima settle, most tiles rescale by 1
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rescale[half] = rescale_rows[quad + 8 * half];
      any_rescale |= rescale[half] != 1.0f;
    }
    if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[i][2 * half] *= rescale[half];
          acc[i][2 * half + 1] *= rescale[half];
        }
      }
    }
  };

  // O[:, this warp's columns] += P V for `tile`.
  const auto accumulate = [&](int tile) {
    const uint8_t* raw = smem.raw + (tile % kStages) * kBlockN * kStride;
    // fp8_ds_mla: the P whose keys carry the scales of this warp's 128-column tile.
    const uint16_t* p_lane =
        probs_buffer(tile) + ((kDsMla ? column0 / 128 : 0) * kHeads + lane % 16) * Config::kPStride +
        (lane / 16) * 8;
#pragma unroll
    for (int step = 0; step < kBlockN / 16; ++step) {
      uint32_t a[4];
      LoadMatrixX4(a, p_lane + 16 * step);
      // ldmatrix.trans rows: keys step * 16 + lane % 16, 16-byte column block lane / 16 of 32.
      const uint8_t* v_lane =
          raw + (step * 16 + lane % 16) * kStride + column0 + (lane / 16) * 16;
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        uint32_t v[4];  // keys 0-7 / 8-15 of column block 0, then of column block 1
        LoadMatrixX4Trans(v, v_lane + pair * 32);
#pragma unroll
        for (int block = 0; block < 2; ++block) {
          uint32_t even0, even1, odd0, odd1;
          if constexpr (Config::kPvBf16) {
            even0 = E4m3Bytes02(v[2 * block]);
            even1 = E4m3Bytes02(v[2 * block + 1]);
            odd0 = E4m3Bytes13(v[2 * block]);
            odd1 = E4m3Bytes13(v[2 * block + 1]);
          } else {
            E4m3EvenOddToF16(v[2 * block], even0, odd0);
            E4m3EvenOddToF16(v[2 * block + 1], even1, odd1);
          }
          constexpr MmaInputs kPvInputs = Config::kPvBf16 ? MmaInputs::kBf16 : MmaInputs::kF16;
          Mma<kPvInputs>(acc[4 * pair + 2 * block], a, even0, even1);
          Mma<kPvInputs>(acc[4 * pair + 2 * block + 1], a, odd0, odd1);
        }
      }
    }
  };

  // One barrier per tile: between two barriers every warp runs the softmax of tile t + 1, P V of
  // tile t and the scores of tile t + 2, which touch different buffers, so the MMAs of one warp
  // overlap the softmax latencies of another. The first two tiles' scores and the first softmax
  // come before the loop.
  if (num_tiles > 0) {
    WaitBarrier(smem.landed, 0);
    scores(0);
  }
  ConsumerSync();
  if (num_tiles > 0) softmax(0);
  if (num_tiles > 1) {
    WaitBarrier(smem.landed + 1, 0);
    scores(1);
  }
  ConsumerSync();
  for (int tile = 0; tile < num_tiles; ++tile) {
    // The stage of tile - 1 is free: its last reader, P V of tile - 1, came before the barrier.
    if (tile > 0 && threadIdx.x == 0) Arrive(smem.freed + (tile - 1) % kStages);
    if (tile + 1 < num_tiles) softmax(tile + 1);
    rescale_output(tile);
    accumulate(tile);
    if (tile + 2 < num_tiles) {
      WaitBarrier(smem.landed + (tile + 2) % kStages, ((tile + 2) / kStages) % 2);
      scores(tile + 2);
    }
    ConsumerSync();
  }

  // l per row, then the epilogue: rows quad (+ 8) of this warp's 64 columns; per 16-column block,
  // the thread's columns 4 * quad_lane + {0, 1, 2, 3} are (even[0], odd[0], even[1], odd[1]).
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int offset = 1; offset < kThreadsPerRow; offset *= 2) {
    row_sum += __shfl_xor_sync(0xffffffffu, row_sum, offset);
  }
  if (softmax_chunk == 0) {
    const bool empty = row_sum == 0.0f;  // a NaN row (NaN or infinite q) stays NaN
    smem.inverse_sum[softmax_row] = empty ? 0.0f : 1.0f / row_sum;
    const int head = head_begin + softmax_row;
    if (head < p.num_heads) {
      const float lse_log2 = empty ? -INFINITY : row_max + log2f(row_sum);
      const int64_t row_index = int64_t{token} * p.num_heads + head;
      if (p.num_splits == 1) {
        p.lse[row_index] = p.lse_base_e ? lse_log2 * kLn2 : lse_log2;
      } else {
        p.partial_lse[int64_t{split} * p.num_tokens * p.num_heads + row_index] = lse_log2;
      }
    }
  }
  ConsumerSync();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = quad + 8 * half;
    const int head = head_begin + row;
    if (head >= p.num_heads) continue;
    const int64_t row_index = int64_t{token} * p.num_heads + head;
    const int64_t partial_row = int64_t{split} * p.num_tokens * p.num_heads + row_index;
    const float scale = smem.inverse_sum[row] * (Config::kPvBf16 ? kResultScale : 1.0f) *
                        (p.num_splits == 1 ? p.out_scale : 1.0f);
#pragma unroll
    for (int block = 0; block < 4; ++block) {
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
  }
}

}  // namespace jax_sparse_mla::fp8
