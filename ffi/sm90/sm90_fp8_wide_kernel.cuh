// Sparse MLA decode over an fp8 cache (per-tensor e4m3 or fp8_ds_mla rows) for SM90 with 64 heads
// per CTA and warpgroup MMAs, for H > 16 (where the 16-head kernel of sm90_fp8_kernel.cuh would
// convert every row once per 16 heads and feed mma.sync from registers).
//
// One CTA of three warpgroups computes 64 heads of one query token over one split of its top-k slot
// list:
//   - warpgroup 2 (the producer) gathers the tile's rows with 16-byte loads (issued a round of 32
//     rows ahead), converts them and stores them into one of two shared-memory buffers as wgmma
//     operands: e4m3 values to f16 (exact); fp8_ds_mla values times their tile scale to bf16
//     (rounded once, from the float32 product) beside the bf16 RoPE dims as they are. Rows of
//     invalid slots become zeros and are marked invalid (one bit per row). With two head groups
//     (H in (64, 128]) the two CTAs of a token form a cluster (kPaired) and each producer converts
//     half of every tile into both CTAs' buffers (the other CTA's half through distributed shared
//     memory);
//   - warpgroup 0 computes S = Q K^T (e4m3: f16 wgmma with Q as f16 after a power-of-two row scale,
//     as in the 16-head kernel; fp8_ds_mla: bf16 wgmma with Q as it is), the online softmax (with
//     no per-key masking when the whole tile is valid), P (f16 or bf16) and O[:, 0:256] += P V with
//     P from its registers;
//   - warpgroup 1 computes O[:, 256:512] += P V from the same P, which warpgroup 0 also stores into
//     shared memory for it, alongside warpgroup 0's half.
// Shared-memory operands are unswizzled core matrices: 16-byte column c (8 values along the dims)
// of row m (a head or a key) at c * kColumnBytes + m * 16. For S both operands are K-major; for
// P V the key rows serve as V in MN-major order (8 dims contiguous per key).
//
// The epilogue follows the 16-head kernel: with one split out / lse directly (out staged through
// Q's shared memory for row-contiguous 16-byte stores), otherwise normalised fp32 partials and
// base-2 lse for MergeSplits. A row with no valid slot: out 0, lse -inf.
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "sm90/sm90_fp8_kernel.cuh"
#include "sm90/sm90_wgmma.cuh"

namespace jax_sparse_mla::fp8::wide {

using sm90::Descriptor;
using sm90::FenceProxyAsync;

inline constexpr int kHeads = 64;
inline constexpr int kWarpgroups = 3;
inline constexpr int kThreads = 128 * kWarpgroups;
inline constexpr int kBuffers = 2;
inline constexpr int kColumnBytes = kBlockN * 16;  // one 16-byte column of 64 rows
inline constexpr int kOperandBytes = kQkDim / 8 * kColumnBytes;  // 16-bit [64 x 576]
// Registers per thread after setmaxnreg (the launch gives 168 to each of the 384 threads).
inline constexpr int kLaunchRegisters = 168;
inline constexpr int kScoreRegisters = 208, kValueRegisters = 168, kProducerRegisters = 128;
static_assert(kScoreRegisters + kValueRegisters + kProducerRegisters <= 3 * kLaunchRegisters);

// Named barriers (0 is __syncthreads): P of a tile is ready / has been read by warpgroup 1; the
// 256 consumer threads; the 128 threads of warpgroup w's output staging (kStaging + w) and its
// release of a key buffer (kRelease + w); with kPaired, warpgroup 0 has read buffer b's valid-row
// words (kWordsRead + b, warpgroup 0 arriving and the producer waiting).
inline constexpr int kProbsReady = 1, kProbsRead = 2, kConsumers = 3, kStaging = 4, kRelease = 6;
inline constexpr int kWordsRead = 8;

struct Shared {
  uint8_t q[kOperandBytes];                // Q [64 heads x 576], f16 or bf16 (Operands)
  uint8_t keys[kBuffers][kOperandBytes];   // converted rows [64 keys x 576], f16 or bf16
  uint8_t probs[kBlockN / 8 * kColumnBytes];  // P [64 heads x 64 keys], f16 or bf16
  float rescale[kHeads];                   // factor on the running output before this tile's P V
  float query_unscale[kHeads];             // 1 / Q's row scales
  float inverse_sum[kHeads];               // 1 / l per row, for the epilogue
  // Word j of a buffer: bit i is set when row 8 j + i holds a valid slot (the 8 rows of one
  // producer warp's round).
  alignas(16) uint32_t valid_rows[kBuffers][kBlockN / 8];
  uint64_t ready[kBuffers];         // this CTA's producer -> consumers: its rows of a tile are in
  uint64_t peer_ready[kBuffers];    // paired CTAs: the peer's rows of a tile are in (byte count)
  uint64_t freed[kBuffers];         // consumers -> producer: this CTA's consumers are done
  uint64_t peer_freed[kBuffers];    // paired CTAs: the peer's consumers are done with the buffer
};
static_assert(sizeof(Shared) <= 227 * 1024);

__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void ArriveBarrier(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddress(barrier))
               : "memory");
}

// ---- The pair of CTAs of one cluster (both head groups of a token, kPaired) ----------------------

__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// All non-exited threads of both CTAs (the producer warpgroups return early).
__device__ __forceinline__ void ClusterSync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The shared::cluster address of `pointer`'s counterpart in the CTA of rank `rank`.
__device__ __forceinline__ uint32_t PeerAddress(const void* pointer, uint32_t rank) {
  uint32_t address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(address)
               : "r"(SmemAddress(pointer)), "r"(rank));
  return address;
}

// An arrival on the peer CTA's barrier `peer_barrier`, as CUTLASS's cluster pipelines release a
// buffer (the default .release.cta semantics: a cluster-scope release costs a GPU-wide fence).
__device__ __forceinline__ void ArrivePeerBarrier(uint32_t peer_barrier) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(peer_barrier) : "memory");
}

// Stores into the peer CTA's shared memory that complete on its barrier `peer_barrier` (counted in
// bytes there), so the peer's consumers wait for them like for a bulk copy.
__device__ __forceinline__ void StorePeer(uint32_t peer_address, uint4 value,
                                          uint32_t peer_barrier) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
      ::"r"(peer_address), "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w),
      "r"(peer_barrier)
      : "memory");
}
__device__ __forceinline__ void StorePeer(uint32_t peer_address, uint32_t value,
                                          uint32_t peer_barrier) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n"
      ::"r"(peer_address), "r"(value), "r"(peer_barrier)
      : "memory");
}

// Sets this warpgroup's registers per thread: setmaxnreg.inc may only raise the count the launch
// gave, and .dec only lower it (either the wrong way is an illegal instruction).
template <int kCount>
__device__ __forceinline__ void SetRegisters() {
  if constexpr (kCount > kLaunchRegisters) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
  } else if constexpr (kCount < kLaunchRegisters) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
  }
}

// K-major operand of 64 rows at its first k-step; k-step s adds s * kKMajorStep.
__device__ __forceinline__ uint64_t KMajor(const uint8_t* operand) {
  return Descriptor(operand, kColumnBytes, 128);
}

// V of the tile's first 16 keys, dims first_dim + [0, 256), MN-major over the key rows: the next 8
// keys are 128 bytes on, the next 8 dims one column on. Keys 16 s + [0, 16): add s * kValueStep.
__device__ __forceinline__ uint64_t ValueOperand(const uint8_t* keys, int first_dim) {
  return Descriptor(keys + first_dim / 8 * kColumnBytes, 128, kColumnBytes);
}

// A descriptor moves on by adding to its start address (bits 0-13, in 16-byte units): shared
// addresses stay below 2^18 bytes, so the sum never carries out of the field.
inline constexpr uint64_t kKMajorStep = 2 * kColumnBytes / 16;  // 16 values along K: two columns
inline constexpr uint64_t kValueStep = 2 * 128 / 16;            // 16 keys: two core matrices

template <typename Op, int kRegs, size_t... kI>
__device__ __forceinline__ void RunMma(uint64_t a, uint64_t b, float (&d)[kRegs], bool accumulate,
                                       std::index_sequence<kI...>) {
  Op::fma(a, b, d[kI]...,
          accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Operand types per cache layout: e4m3 rows convert exactly to f16, and Q meets them as f16 after
// a power-of-two row scale; fp8_ds_mla rows are dequantised to bf16 (value times tile scale,
// rounded once) next to their bf16 RoPE dims, and Q stays bf16. P takes the operands' type.
template <KvLayout kLayout>
struct Operands {
  static constexpr bool kDsMla = kLayout == KvLayout::kDsMla;
  using ScoresMma = std::conditional_t<
      kDsMla,
      cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                    cute::SM90::GMMA::Major::K>,
      cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<cute::SM90::GMMA::Major::K,
                                                  cute::SM90::GMMA::Major::K>>;
  using ValuesMma = std::conditional_t<
      kDsMla,
      cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                     cute::SM90::GMMA::Major::MN>,
      cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<cute::SM90::GMMA::Major::K,
                                                   cute::SM90::GMMA::Major::MN>>;
  // P V with P from registers (warpgroup 0, which computed it).
  using ValuesMmaRs = std::conditional_t<
      kDsMla,
      cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,
                                                     cute::SM90::GMMA::Major::MN>,
      cute::SM90::GMMA::MMA_64x256x16_F32F16F16_RS<cute::SM90::GMMA::Major::K,
                                                   cute::SM90::GMMA::Major::MN>>;
  __device__ static uint32_t Pack(float low, float high) {
    return kDsMla ? PackBf16(low, high) : PackF16(low, high);
  }
};

template <int kRegs>
__device__ __forceinline__ void FenceAccumulators(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) cute::warpgroup_fence_operand(d[i]);
}

// One register-A wgmma: A (P, 64 x 16) from the four registers at `a`.
template <typename Op, int kRegs, size_t... kI>
__device__ __forceinline__ void RunMmaFromRegisters(const uint32_t* a, uint64_t b,
                                                    float (&d)[kRegs],
                                                    std::index_sequence<kI...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[kI]..., cute::SM90::GMMA::ScaleOut::One);
}

// O += P V over one tile for one warpgroup's 256 value dims (`values_operand`), issued and
// committed, not waited for. P comes from shared memory (`probs` a descriptor, ValuesMma) or from
// the registers of the warpgroup that computed it (`probs` 16 registers: k-step s takes
// probs[4 s + 0..3], the layout of the S accumulators; ValuesMmaRs), which must then stay
// unchanged until the MMAs complete (FinishValues).
template <typename ValuesMma, typename Probs>
__device__ __forceinline__ void IssueValues(float (&out)[128], Probs& probs,
                                            uint64_t values_operand) {
  FenceAccumulators(out);
  constexpr bool kFromRegisters = !std::is_same_v<Probs, const uint64_t>;
  if constexpr (kFromRegisters) {
#pragma unroll
    for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(probs[i]);
  }
  cute::warpgroup_arrive();
#pragma unroll
  for (int step = 0; step < kBlockN / 16; ++step) {
    if constexpr (kFromRegisters) {
      RunMmaFromRegisters<ValuesMma>(probs + 4 * step, values_operand + step * kValueStep, out,
                                     std::make_index_sequence<128>{});
    } else {
      RunMma<ValuesMma>(probs + step * kKMajorStep, values_operand + step * kValueStep, out, true,
                        std::make_index_sequence<128>{});
    }
  }
  cute::warpgroup_commit_batch();
}

// After the MMAs IssueValues issued have completed (a warpgroup_wait): their registers are free.
template <typename Probs>
__device__ __forceinline__ void FinishValues(float (&out)[128], Probs& probs) {
  FenceAccumulators(out);
  if constexpr (!std::is_same_v<Probs, const uint64_t>) {
#pragma unroll
    for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(probs[i]);
  }
}

// out *= rescale0 on the thread's rows row0 (i % 4 < 2), rescale1 on row1.
__device__ __forceinline__ void RescaleRows(float (&out)[128], float rescale0, float rescale1) {
#pragma unroll
  for (int i = 0; i < 128; ++i) out[i] *= (i / 2) % 2 == 0 ? rescale0 : rescale1;
}

// out = out * rescale + P V over one tile (IssueValues), waiting for the MMAs; `while_running`
// runs between issuing the MMAs and waiting.
template <typename ValuesMma, typename Probs, typename WhileRunning>
__device__ __forceinline__ void AccumulateValues(float (&out)[128], float rescale0, float rescale1,
                                                 Probs& probs, uint64_t values_operand,
                                                 WhileRunning&& while_running) {
  RescaleRows(out, rescale0, rescale1);
  IssueValues<ValuesMma>(out, probs, values_operand);
  while_running();
  cute::warpgroup_wait<0>();
  FinishValues(out, probs);
}

// P of a tile (16 registers of pairs in the S accumulators' layout) as the K-major A operand of
// P V at `operand` ([64 heads x 64 keys], 8 columns of kColumnBytes).
__device__ __forceinline__ void StoreProbs(uint8_t* operand, const uint32_t (&probs)[16], int row0,
                                           int row1, int column_in_block) {
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int key = 8 * (i / 4) + column_in_block;
    const int row = (i / 2) % 2 == 0 ? row0 : row1;
    *reinterpret_cast<uint32_t*>(operand + key / 8 * kColumnBytes + row * 16 + (key % 8) * 2) =
        probs[i / 2];
  }
}

// Accumulator element i of a thread (warp w of its warpgroup, lane l): row 16 w + l / 4 +
// 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
__device__ __forceinline__ int AccumulatorRow(int thread, int i) {
  return 16 * (thread / 32) + (thread % 32) / 4 + 8 * ((i / 2) % 2);
}

// The CTA's Q rows as the wgmma operand at `query` (kOperandBytes): for e4m3 rows as f16, each
// scaled by the power of two that puts its largest |q| in [2^14, 2^15) (as ScaleQueryRows does),
// with 1 / that scale per row into `query_unscale`; for fp8_ds_mla rows as they are (bf16,
// unscale 1). Rows past num_heads are zero. Run by the 256 consumer threads; returns once all of
// them have written Q.
template <KvLayout kLayout>
__device__ __forceinline__ void LoadQuery(uint8_t* query, const DecodeParams& p, int token,
                                          int head_begin, int thread, float* query_unscale) {
  constexpr bool kScaled = kLayout == KvLayout::kE4m3;
  constexpr int kColumns = kQkDim / 8 / 4;  // 16-byte columns per thread
  // Lane l of warp w holds columns 4 k + l / 8 of row 8 w + l % 8: a quarter warp stores one
  // column of 8 rows, 128 contiguous bytes. All of a thread's loads go out at once.
  const int lane = thread % 32, part = lane / 8;
  const int row = 8 * (thread / 32) + lane % 8;
  const int head = head_begin + row;
  const __nv_bfloat16* q_row = p.q + (int64_t{token} * p.num_heads + head) * kQkDim;
  uint4 raw[kColumns];
#pragma unroll
  for (int k = 0; k < kColumns; ++k) {
    raw[k] = head < p.num_heads ? *reinterpret_cast<const uint4*>(q_row + (4 * k + part) * 8)
                                : make_uint4(0, 0, 0, 0);
  }
  float largest = 0.0f;  // the row's largest |q|, over its four threads
  if constexpr (kScaled) {
    // In bf16 pairs (exact; NaN ignored as by fmaxf), so that no float copy of Q stays live.
    __nv_bfloat162 largest_pair = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int k = 0; k < kColumns; ++k) {
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[k]);
#pragma unroll
      for (int i = 0; i < 4; ++i) largest_pair = __hmax2(largest_pair, __habs2(pairs[i]));
    }
    largest = fmaxf(__low2float(largest_pair), __high2float(largest_pair));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 8));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 16));
  }
  const int exponent = largest > 0.0f ? ilogbf(largest) : 14;
  const float scale = ldexpf(1.0f, 14 - max(exponent, -110));
  if (part == 0) query_unscale[row] = kScaled ? 1.0f / scale : 1.0f;
#pragma unroll
  for (int k = 0; k < kColumns; ++k) {
    uint4 packed = raw[k];
    if constexpr (kScaled) {
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[k]);
      uint32_t* out = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 values = __bfloat1622float2(pairs[i]);
        out[i] = PackF16(values.x * scale, values.y * scale);
      }
    }
    *reinterpret_cast<uint4*>(query + (4 * k + part) * kColumnBytes + row * 16) = packed;
  }
  FenceProxyAsync();
  NamedBarrierSync(kConsumers, 256);  // all of Q is written
}

// The 16-byte chunks of a row that one of its 4 producer threads (part p) loads: the value chunks
// 4 i + p (dims 16 (4 i + p) + [0, 16): 9 of e4m3 rows, 8 of fp8_ds_mla's latent values), then for
// fp8_ds_mla the RoPE chunks 4 j + p (8 bf16 each: dims 512 + 8 (4 j + p) + [0, 8)) and the 16
// bytes of tile scales.
template <KvLayout kLayout>
struct RowChunks {
  static constexpr int kParts = 4;
  static constexpr bool kDsMla = kLayout == KvLayout::kDsMla;
  static constexpr int kValues = (kDsMla ? kVDim : kQkDim) / (16 * kParts);
  static constexpr int kRope = kDsMla ? (kQkDim - kVDim) / (8 * kParts) : 0;
  static constexpr int kCount = kValues + kRope + (kDsMla ? 1 : 0);
  static constexpr int kScales = kCount - 1;  // fp8_ds_mla: the chunk of tile scales
  // Byte offset of chunk k in the row.
  __device__ static int Offset(int k, int part) {
    if (k < kValues) return 16 * (kParts * k + part);
    if (k < kValues + kRope) return kVDim + 16 + 16 * (kParts * (k - kValues) + part);
    return kVDim;
  }
};

// 16 fp8_ds_mla latent values (one chunk) times their tile scale, as two bf16 operand columns.
__device__ __forceinline__ void ScaledBf16Columns(uint4 bytes, float scale, uint4& low,
                                                  uint4& high) {
  const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
  uint32_t packed[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t f16_pairs[2];
    E4m3ToF16Pairs(words[w], f16_pairs[0], f16_pairs[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 values = __half22float2(*reinterpret_cast<const __half2*>(&f16_pairs[h]));
      packed[2 * w + h] = PackBf16(values.x * scale, values.y * scale);
    }
  }
  low = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  high = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// Bytes the peer's producer stores into a CTA's buffer per tile (kPaired): its 32 rows of 72
// columns and, per warp, the valid flags of its 8 rows.
inline constexpr uint32_t kPeerTileBytes = kBlockN / 2 * (kOperandBytes / kBlockN) + 4 * 4;

// Warpgroup 2: the CTA's rows of every tile of the split into buffer tile % 2, once all consumers
// freed it, in rounds of 32 rows with 4 threads per row. Alone (kPaired false) a CTA's producer
// converts all 64 rows of a tile in two rounds; paired, each CTA's producer converts half of them
// (rows 32 rank + [0, 32), one round per tile) into both CTAs' buffers, so each row is gathered
// and converted once per token for 128 heads. Lane l of warp w takes row 8 w + l % 8 of the round
// and the chunks of part l / 8 (RowChunks): a warp reads 64 contiguous bytes per row, and each
// quarter warp stores 8 rows' 16 bytes of one column, 128 contiguous bytes (no bank conflicts).
// The loads of round r + 1 go into the other of two register sets and are issued before round r is
// converted (and before its wait for a free buffer), so their latency overlaps a whole round; the
// slots are read one round earlier still.
template <KvLayout kLayout, bool kPaired>
__device__ __forceinline__ void ProduceTiles(Shared& smem, const DecodeParams& p, int token,
                                             int key_begin, int key_end, int num_tiles,
                                             int thread) {
  using Chunks = RowChunks<kLayout>;
  using Registers = uint4[Chunks::kCount];
  constexpr int kRounds = kPaired ? 1 : 2;  // rounds per tile
  const int lane = thread % 32, part = lane / 8;
  const int row_in_round = 8 * (thread / 32) + lane % 8;
  const uint32_t rank = kPaired ? ClusterRank() : 0, peer = rank ^ 1;
  const int num_rounds = num_tiles * kRounds;
  const auto row_of = [&](int round) {
    return 32 * (kPaired ? static_cast<int>(rank) : round % kRounds) + row_in_round;
  };
  const int32_t* token_indices = p.indices + int64_t{token} * p.num_keys;
  const auto slot_of = [&](int round) {
    const int position = key_begin + round / kRounds * kBlockN + row_of(round);
    return position < key_end ? token_indices[position] : -1;
  };
  const auto is_valid = [&](int32_t slot) { return slot >= 0 && slot < p.num_slots; };
  // Loads only for valid slots, straight into `raw` (a select here would wait for the loads).
  const auto issue_loads = [&](int32_t slot, Registers& raw) {
    if (!is_valid(slot)) return;
    const uint8_t* source = p.kv + int64_t{slot} * kRowBytes<kLayout>;
#pragma unroll
    for (int k = 0; k < Chunks::kCount; ++k) {
      raw[k] = __ldg(reinterpret_cast<const uint4*>(source + Chunks::Offset(k, part)));
    }
  };
  const auto convert = [&](int round, bool valid, const Registers& raw) {
    const int tile = round / kRounds, buffer = tile % kBuffers, row = row_of(round);
    if (round % kRounds == 0 && tile >= kBuffers) {
      WaitBarrier(smem.freed + buffer, (tile / kBuffers - 1) % 2);
      if constexpr (kPaired) {
        WaitBarrier(smem.peer_freed + buffer, (tile / kBuffers - 1) % 2);
        // Warpgroup 0 has read this buffer's valid-row words of tile - 2. `freed` orders that
        // already (warpgroup 0's bar.sync, then its thread 0's arrival); this barrier states the
        // order where racecheck sees it, which it lost in the paired kernel whenever another
        // process ran kernels on the GPU (docs/kernels/sm90-fp8.md, Tests).
        NamedBarrierSync(kWordsRead + buffer, 256);
      }
    }
    uint8_t* keys = smem.keys[buffer];
    uint32_t peer_keys = 0, peer_ready = 0;
    if constexpr (kPaired) {
      // The previous phase of this buffer's peer_ready ended before its consumers freed it.
      if (thread == 0) ArriveExpectBytes(smem.peer_ready + buffer, kPeerTileBytes);
      peer_keys = PeerAddress(keys, peer) + row * 16;
      peer_ready = PeerAddress(smem.peer_ready + buffer, peer);
    }
    // The warp's 8 rows (lanes 0-7) are word row / 8 of valid_rows.
    const uint32_t flags = __ballot_sync(0xffffffffu, valid) & 0xffu;
    if (lane == 0) {
      uint32_t* word = &smem.valid_rows[buffer][row / 8];
      *word = flags;
      if constexpr (kPaired) StorePeer(PeerAddress(word, peer), flags, peer_ready);
    }
    const auto store = [&](int column, uint4 value) {
      *reinterpret_cast<uint4*>(keys + column * kColumnBytes + row * 16) = value;
      if constexpr (kPaired) StorePeer(peer_keys + column * kColumnBytes, value, peer_ready);
    };
    float4 scales = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if constexpr (Chunks::kDsMla) scales = *reinterpret_cast<const float4*>(&raw[Chunks::kScales]);
#pragma unroll
    for (int k = 0; k < Chunks::kValues; ++k) {
      const int chunk = Chunks::kParts * k + part;  // dims 16 chunk + [0, 16): 2 columns
      const uint4 bytes = valid ? raw[k] : make_uint4(0, 0, 0, 0);  // invalid rows: zeros
      uint4 low, high;
      if constexpr (Chunks::kDsMla) {
        ScaledBf16Columns(bytes, valid ? Component(scales, chunk / 8) : 0.0f, low, high);
      } else {
        E4m3ToF16Pairs(bytes.x, low.x, low.y);
        E4m3ToF16Pairs(bytes.y, low.z, low.w);
        E4m3ToF16Pairs(bytes.z, high.x, high.y);
        E4m3ToF16Pairs(bytes.w, high.z, high.w);
      }
      store(2 * chunk, low);
      store(2 * chunk + 1, high);
    }
#pragma unroll
    for (int j = 0; j < Chunks::kRope; ++j) {  // fp8_ds_mla's RoPE dims: bf16 as they are
      store(kVDim / 8 + Chunks::kParts * j + part,
            valid ? raw[Chunks::kValues + j] : make_uint4(0, 0, 0, 0));
    }
    if (round % kRounds == kRounds - 1) {
      FenceProxyAsync();
      ArriveBarrier(smem.ready + buffer);
    }
  };
  Registers raw_a = {}, raw_b = {};
  int32_t slot = slot_of(0), next_slot = slot_of(1);
  issue_loads(slot, raw_a);
  // One round: the next round's loads into `next`, then this round's rows from `current`.
  const auto run_round = [&](int round, const Registers& current, Registers& next) {
    const int32_t slot_after_next = slot_of(round + 2);
    issue_loads(next_slot, next);
    convert(round, is_valid(slot), current);
    slot = next_slot;
    next_slot = slot_after_next;
  };
  for (int round = 0; round < num_rounds; round += 2) {  // the register sets alternate
    run_round(round, raw_a, raw_b);
    if (round + 1 < num_rounds) run_round(round + 1, raw_b, raw_a);
  }
}

// The epilogue of one consumer warpgroup: its 256 columns, element i of `out` at column
// 256 warpgroup + 8 (i / 4) + 2 (l % 4) + i % 2 of rows row0 (i % 4 < 2) and row1. With one split
// `staging` (64 rows of 1040 bytes, no longer read by any MMA) takes the bf16 rows first.
__device__ __forceinline__ void WriteOutput(const float (&out)[128], const DecodeParams& p,
                                            const float* inverse_sum, int token, int split,
                                            int head_begin, int warpgroup, int row0, int row1,
                                            int column_in_block, uint8_t* staging) {
  if (p.num_splits == 1) {
    // Through shared memory (Q's, free once all S MMAs are done), for 16-byte row-contiguous
    // stores: rows of 512 bf16 plus 16 bytes, so the quad-strided writes hit distinct banks.
    constexpr int kStagingStride = kVDim * 2 + 16;
    static_assert(kHeads * kStagingStride <= kOperandBytes);
    const int thread = threadIdx.x % 128;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r == 0 ? row0 : row1;
      const float scale = inverse_sum[row] * p.out_scale;
#pragma unroll
      for (int block = 0; block < 32; ++block) {
        const int column = 256 * warpgroup + 8 * block + column_in_block;
        *reinterpret_cast<uint32_t*>(staging + row * kStagingStride + column * 2) =
            PackBf16(out[4 * block + 2 * r] * scale, out[4 * block + 2 * r + 1] * scale);
      }
    }
    NamedBarrierSync(kStaging + warpgroup, 128);
    // Warp w copies rows 16 w + [0, 16) of this warpgroup's 256 columns: 512 bytes a row.
    const int warp = thread / 32, lane = thread % 32;
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
      const int row = 16 * warp + i;
      const int head = head_begin + row;
      if (head >= p.num_heads) break;
      const uint4 chunk = *reinterpret_cast<const uint4*>(
          staging + row * kStagingStride + warpgroup * 512 + lane * 16);
      *reinterpret_cast<uint4*>(p.out + (int64_t{token} * p.num_heads + head) * kVDim +
                                256 * warpgroup + lane * 8) = chunk;
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r == 0 ? row0 : row1;
    const int head = head_begin + row;
    if (head >= p.num_heads) continue;
    const int64_t row_index = int64_t{token} * p.num_heads + head;
    const int64_t partial_row = int64_t{split} * p.num_tokens * p.num_heads + row_index;
    const float scale = inverse_sum[row] * (p.num_splits == 1 ? p.out_scale : 1.0f);
#pragma unroll
    for (int block = 0; block < 32; ++block) {
      const float value0 = out[4 * block + 2 * r] * scale;
      const float value1 = out[4 * block + 2 * r + 1] * scale;
      const int column = 256 * warpgroup + 8 * block + column_in_block;
      if (p.num_splits == 1) {
        *reinterpret_cast<uint32_t*>(p.out + row_index * kVDim + column) = PackBf16(value0, value1);
      } else {
        *reinterpret_cast<float2*>(p.partial_out + partial_row * kVDim + column) =
            make_float2(value0, value1);
      }
    }
  }
}

// kPaired: launched in clusters of 2 CTAs along x (the two head groups of a token, H in (64, 128]),
// whose producers share the conversion of each tile.
template <KvLayout kLayout, bool kPaired>
__global__ void __launch_bounds__(kThreads, 1) SparseMlaFp8WideDecodeKernel(const DecodeParams p) {
  using ScoresMma = typename Operands<kLayout>::ScoresMma;
  using ValuesMma = typename Operands<kLayout>::ValuesMma;
  using ValuesMmaRs = typename Operands<kLayout>::ValuesMmaRs;
  extern __shared__ __align__(128) uint8_t shared_bytes[];
  Shared& smem = *reinterpret_cast<Shared*>(shared_bytes);
  const int head_begin = blockIdx.x * kHeads;
  const int split = blockIdx.y;
  const int token = blockIdx.z;
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
  const int lane = thread % 32;

  const SplitRange range = SplitOf(p, token, split);
  const int key_begin = range.key_begin, key_end = range.key_end, num_tiles = range.num_tiles;

  if (threadIdx.x < kBuffers) {
    InitBarrier(smem.ready + threadIdx.x, 128);
    InitBarrier(smem.peer_ready + threadIdx.x, 1);
    InitBarrier(smem.freed + threadIdx.x, 2);
    InitBarrier(smem.peer_freed + threadIdx.x, 2);
  }
  if constexpr (kPaired) {
    ClusterSync();  // both CTAs' barriers are initialised before either touches the other's
  } else {
    __syncthreads();
  }

  if (warpgroup == 2) {
    SetRegisters<kProducerRegisters>();
    ProduceTiles<kLayout, kPaired>(smem, p, token, key_begin, key_end, num_tiles, thread);
    return;
  }
  // Waits until buffer `tile % 2` holds the tile (with kPaired, the peer's rows too). The waits are
  // CTA-scoped also where the other CTA completes the phase (its st.async bytes, its arrivals on
  // `peer_freed`), as in CUTLASS's cluster pipelines: the barrier and the data are this CTA's.
  const auto wait_for_tile = [&](int tile) {
    const int buffer = tile % kBuffers;
    WaitBarrier(smem.ready + buffer, (tile / kBuffers) % 2);
    if constexpr (kPaired) WaitBarrier(smem.peer_ready + buffer, (tile / kBuffers) % 2);
  };
  // One warpgroup's arrival on the buffer's `freed` (with kPaired, also on the peer's
  // `peer_freed`). An mbarrier arrival releases only the arriving thread's own accesses, so the
  // warpgroup meets first: every thread's reads of the buffer (the valid-row words) come before the
  // producers' next stores. The peer's arrivals go to a barrier of their own, so that `freed`,
  // which orders this CTA's reads before its producer's stores, completes only through this CTA's
  // threads.
  const auto free_buffer = [&](int buffer) {
    NamedBarrierSync(kRelease + warpgroup, 128);
    if (thread != 0) return;
    ArriveBarrier(smem.freed + buffer);
    if constexpr (kPaired) {
      ArrivePeerBarrier(PeerAddress(smem.peer_freed + buffer, ClusterRank() ^ 1));
    }
  };
  float* query_unscale = smem.query_unscale;
  float* inverse_sum = smem.inverse_sum;
  // Rows of this thread's accumulators: 16 w + l / 4 and 8 more.
  const int row0 = AccumulatorRow(thread, 0), row1 = AccumulatorRow(thread, 2);
  const int column_in_block = 2 * (lane % 4);
  // Each consumer warpgroup runs its own code to the end: ptxas allocates the registers that
  // setmaxnreg grants only to code that no other register count reaches.
  if (warpgroup == 0) {
    SetRegisters<kScoreRegisters>();
    LoadQuery<kLayout>(smem.q, p, token, head_begin, threadIdx.x, query_unscale);
    float out[128] = {};
    const float score_scale0 = p.score_scale_log2 * query_unscale[row0];
    const float score_scale1 = p.score_scale_log2 * query_unscale[row1];
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};  // this thread's columns; reduced over the quad at the end
    const uint64_t query_operand = KMajor(smem.q);
    float score[32];
    // S = Q K^T of a tile into `score`, issued and committed, not waited for.
    const auto issue_scores = [&](int tile) {
      const uint64_t keys_operand = KMajor(smem.keys[tile % kBuffers]);
      FenceAccumulators(score);
      cute::warpgroup_arrive();
#pragma unroll
      for (int step = 0; step < kQkDim / 16; ++step) {
        RunMma<ScoresMma>(query_operand + step * kKMajorStep, keys_operand + step * kKMajorStep,
                          score, step > 0, std::make_index_sequence<32>{});
      }
      cute::warpgroup_commit_batch();
    };
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int buffer = tile % kBuffers;
      const uint64_t values_operand = ValueOperand(smem.keys[buffer], 0);
      wait_for_tile(tile);
      issue_scores(tile);
      cute::warpgroup_wait<0>();
      FenceAccumulators(score);

      // Online softmax (base 2) over the tile's 64 keys of rows row0 (i % 4 < 2) and row1. Key
      // 8 j + c (c < 8) is valid when bit c of valid_rows word j is set; most tiles are all valid.
      const uint4 words_low = *reinterpret_cast<const uint4*>(&smem.valid_rows[buffer][0]);
      const uint4 words_high = *reinterpret_cast<const uint4*>(&smem.valid_rows[buffer][4]);
      if constexpr (kPaired) {  // the producer waits for this before it stores tile + 2's words
        if (tile + kBuffers < num_tiles) NamedBarrierArrive(kWordsRead + buffer, 256);
      }
      const uint32_t words[8] = {words_low.x,  words_low.y,  words_low.z,  words_low.w,
                                 words_high.x, words_high.y, words_high.z, words_high.w};
      uint32_t all_valid = 0xffu;
#pragma unroll
      for (int j = 0; j < 8; ++j) all_valid &= words[j];
      float tile_max[2] = {-INFINITY, -INFINITY};
      if (all_valid == 0xffu) {  // the same branch for the whole warpgroup
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          const int r = (i / 2) % 2;
          score[i] *= r == 0 ? score_scale0 : score_scale1;
          tile_max[r] = fmaxf(tile_max[r], score[i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          const int r = (i / 2) % 2;
          const bool valid = (words[i / 4] >> (column_in_block + i % 2)) & 1u;
          score[i] = valid ? score[i] * (r == 0 ? score_scale0 : score_scale1) : -INFINITY;
          tile_max[r] = fmaxf(tile_max[r], score[i]);
        }
      }
      float rescale[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r]);
        // While a row has seen only invalid keys its max is -inf: subtract 0 (exp2 -> 0).
        base[r] = new_max == -INFINITY ? 0.0f : new_max;
        rescale[r] = Exp2(row_max[r] - base[r]);
        row_max[r] = new_max;
        row_sum[r] *= rescale[r];
      }
      // P in the A-operand register layout of the P V MMAs: k-step s takes probs[4 s + 0..3].
      uint32_t probs[16];
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int r = (i / 2) % 2;
        const float p0 = Exp2(score[i] - base[r]), p1 = Exp2(score[i + 1] - base[r]);
        row_sum[r] += p0 + p1;
        probs[i / 2] = Operands<kLayout>::Pack(p0, p1);
      }
      // P for warpgroup 1, once it has read the previous tile's P and rescale factors.
      const auto share_probs = [&] {
        if (tile > 0) NamedBarrierSync(kProbsRead, 256);
        StoreProbs(smem.probs, probs, row0, row1, column_in_block);
        if (lane % 4 == 0) {
          smem.rescale[row0] = rescale[0];
          smem.rescale[row1] = rescale[1];
        }
        FenceProxyAsync();
        NamedBarrierArrive(kProbsReady, 256);
      };
      AccumulateValues<ValuesMmaRs>(out, rescale[0], rescale[1], probs, values_operand,
                                    share_probs);
      free_buffer(buffer);
    }
    // l and lse per row; 1 / l for both warpgroups.
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      const int row = r == 0 ? row0 : row1;
      const bool empty = row_sum[r] == 0.0f;  // a NaN row (NaN or infinite q) stays NaN
      if (lane % 4 == 0) {
        inverse_sum[row] = empty ? 0.0f : 1.0f / row_sum[r];
        const int head = head_begin + row;
        if (head < p.num_heads) {
          const float lse_log2 = empty ? -INFINITY : row_max[r] + log2f(row_sum[r]);
          const int64_t row_index = int64_t{token} * p.num_heads + head;
          if (p.num_splits == 1) {
            p.lse[row_index] = p.lse_base_e ? lse_log2 * kLn2 : lse_log2;
          } else {
            p.partial_lse[int64_t{split} * p.num_tokens * p.num_heads + row_index] = lse_log2;
          }
        }
      }
    }
    NamedBarrierSync(kConsumers, 256);
    WriteOutput(out, p, inverse_sum, token, split, head_begin, 0, row0, row1, column_in_block,
                smem.q);
    // The peer may still arrive on this CTA's barriers until it is done with its last tile.
    if constexpr (kPaired) ClusterSync();
  } else {
    SetRegisters<kValueRegisters>();
    LoadQuery<kLayout>(smem.q, p, token, head_begin, threadIdx.x, query_unscale);
    float out[128] = {};
    const uint64_t probs_operand = KMajor(smem.probs);
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int buffer = tile % kBuffers;
      const uint64_t values_operand = ValueOperand(smem.keys[buffer], 256);
      NamedBarrierSync(kProbsReady, 256);
      // Already complete (warpgroup 0 waited before its scores): orders the producers' stores
      // before this warpgroup's MMAs directly.
      wait_for_tile(tile);
      AccumulateValues<ValuesMma>(out, smem.rescale[row0], smem.rescale[row1], probs_operand,
                                  values_operand, [] {});
      free_buffer(buffer);
      // Both sides wait: warpgroup 0 reaches this barrier before it needs the next P anyway.
      if (tile + 1 < num_tiles) NamedBarrierSync(kProbsRead, 256);
    }
    NamedBarrierSync(kConsumers, 256);  // inverse_sum is written
    WriteOutput(out, p, inverse_sum, token, split, head_begin, 1, row0, row1, column_in_block,
                smem.q);
    if constexpr (kPaired) ClusterSync();
  }
}

}  // namespace jax_sparse_mla::fp8::wide
