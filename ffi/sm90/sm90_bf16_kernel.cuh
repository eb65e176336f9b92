// Sparse MLA decode over a bf16 cache for SM90, our own kernel: 64 heads per CTA on warpgroup
// MMAs, with the operand layout, Q load, P V steps and epilogue of the 64-head fp8 kernel
// (sm90_fp8_wide_kernel.cuh). bf16 rows need no conversion, so nothing runs before the kernel and
// no thread touches a row: the producer copies rows straight into the operand layout.
//
// One CTA of three warpgroups computes 64 heads of one query token over one split of its top-k slot
// list, two 64-key tiles at a time (tile 2i in buffer 0, tile 2i + 1 in buffer 1):
//   - warpgroup 2 (the producer) issues 16-byte cp.async copies from the rows into the operand
//     layout, zero-filled for invalid slots (negative, >= num_slots or past the valid count: a
//     source size of 0 reads nothing) and marked invalid (one bit per row). Each buffer is two
//     halves, dims [0, 256) (columns 0-31) and [256, 576) (columns 32-71), each with its own
//     `ready` and `freed` barriers, refilled in the order the consumers free them, so the next
//     pair's first half lands while the consumers still read the other;
//   - the consumers split both the scores and P V: warpgroup 0 computes S of tile 2i and warpgroup
//     1 S of tile 2i + 1; each keeps half of the output, O[:, 0:256] (warpgroup 0) and
//     O[:, 256:512] (warpgroup 1), and adds P V of both tiles to it, its own tile's P from its
//     registers and the other's from shared memory. The two softmaxes share one running max per
//     row: warpgroup 0's tile max goes first (with the max of the previous pairs), warpgroup 1
//     takes the larger of that and its own and hands it back, and warpgroup 0 rescales its P and
//     output to it before sharing P. So one warpgroup's softmax runs beside the other's MMAs, and
//     both warpgroups issue the same MMA work (per pair one S, and P V of both tiles over their
//     256 columns).
// P of tile 2i goes into buffer 0's RoPE columns (read by S only, which is done by then); P of tile
// 2i + 1 into a buffer of its own (buffer 1's second half, with its RoPE columns, is freed as soon
// as warpgroup 1's own P V is done, before warpgroup 0 reads that P).
// A split with an odd number of tiles ends on a pair whose second tile is all invalid slots.
//
// The epilogue is the fp8 kernel's, after the two warpgroups add their row sums: with one split
// out / lse directly, otherwise normalised fp32 partials and base-2 lse for MergeSplits. A row with
// no valid slot: out 0, lse -inf.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "sm90/sm90_fp8_wide_kernel.cuh"

namespace jax_sparse_mla::fp8::bf16 {

using sm90::FenceProxyAsync;
using wide::kBuffers;
using wide::kColumnBytes;
using wide::kHeads;
using wide::kKMajorStep;
using wide::kOperandBytes;
using wide::kThreads;

inline constexpr KvLayout kLayout = KvLayout::kBf16;
using Operands = wide::Operands<kLayout>;

// Registers per thread after setmaxnreg: both consumer warpgroups hold half of O (128), S (32) and
// P (16); the producer only addresses.
inline constexpr int kConsumerRegisters = 208, kProducerRegisters = 88;
static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * wide::kLaunchRegisters);

// Buffer halves: dims [0, 256) (columns [0, 32), k-steps [0, 16) of S) and [256, 576) (columns
// [32, 72), k-steps [16, 36)).
inline constexpr int kHalves = 2;
inline constexpr int kSplitColumn = 256 / 8, kColumns = kQkDim / 8;
inline constexpr int kSplitStep = 256 / 16, kSteps = kQkDim / 16;
// P of a pair's first tile: its buffer's RoPE columns, [64 heads x 64 keys].
inline constexpr int kRopeProbsOffset = kVDim / 8 * kColumnBytes;
static_assert(kBlockN / 8 * kColumnBytes == kOperandBytes - kRopeProbsOffset);

// Named barriers (0 is __syncthreads; kConsumers and kStaging + w as in the fp8 kernel): the row
// maxima of a pair's first / second tile are in `row_max`, its P is in shared memory.
inline constexpr int kFirstMax = 1, kSecondMax = 2, kFirstProbs = 6, kSecondProbs = 7;
static_assert(wide::kConsumers == 3 && wide::kStaging == 4);

struct Shared {
  uint8_t q[kOperandBytes];               // Q [64 heads x 576] bf16; then the output staging
  uint8_t keys[kBuffers][kOperandBytes];  // rows [64 keys x 576] bf16 of tiles 2i and 2i + 1
  uint8_t probs[kBlockN / 8 * kColumnBytes];  // P of tile 2i + 1 [64 heads x 64 keys] bf16
  float row_max[kHeads];                  // the running max per row, passed between warpgroups
  float row_sum[2][kHeads];               // each warpgroup's sum per row, for the epilogue
  float inverse_sum[2][kHeads];           // 1 / l per row, each warpgroup's copy
  float query_unscale[kHeads];            // 1 (LoadQuery's, for scaled f16 queries)
  // Word j of a buffer: bit i is set when row 8 j + i holds a valid slot.
  alignas(16) uint32_t valid_rows[kBuffers][kBlockN / 8];
  uint64_t ready[kBuffers][kHalves];  // producer -> consumers: a half of a tile has landed
  uint64_t freed[kBuffers][kHalves];  // consumers -> producer: a half is no longer read
};
static_assert(sizeof(Shared) <= 227 * 1024);

// Arrivals per phase on `ready`: one ArriveOnCopies per producer thread, and on the half a tile
// starts with, one per producer warp after its valid-row words (the copies' arrivals order none
// of the threads' own stores). Buffer 0 starts with its first half, buffer 1 with its second (the
// order the consumers free them). Each half is freed by the one warpgroup that reads it last.
__host__ __device__ constexpr int FirstHalf(int buffer) { return buffer == 0 ? 0 : 1; }
__host__ __device__ constexpr int ReadyArrivals(int buffer, int half) {
  return half == FirstHalf(buffer) ? 128 + 4 : 128;
}

// Warpgroup 2: tiles 2i and 2i + 1 of the split into buffers 0 and 1, per pair in the order the
// consumers free the halves: buffer 0 first half, buffer 1 second half, buffer 0 second half,
// buffer 1 first half. Lane l of warp w copies rows 8 w + l % 8 and 32 more, columns 4 k + l / 8
// of the half: a warp reads 64 contiguous bytes of each of its 8 rows per instruction, and each
// quarter warp writes 8 rows' 16 bytes of one column, 128 contiguous bytes. The slots of the next
// pair are read before the first wait of this one.
__device__ __forceinline__ void CopyTiles(Shared& smem, const DecodeParams& p, int token,
                                          int key_begin, int key_end, int num_pairs, int thread) {
  constexpr int kRows = 2;  // per thread and tile
  constexpr int kRowBytes = fp8::kRowBytes<kLayout>;
  const int lane = thread % 32, part = lane / 8;
  const int first_row = 8 * (thread / 32) + lane % 8;
  const int32_t* token_indices = p.indices + int64_t{token} * p.num_keys;
  const auto slot_of = [&](int tile, int r) {
    const int position = key_begin + tile * kBlockN + first_row + 32 * r;
    return position < key_end ? token_indices[position] : -1;
  };
  int32_t slots[kBuffers][kRows] = {{slot_of(0, 0), slot_of(0, 1)}, {slot_of(1, 0), slot_of(1, 1)}};
  for (int pair = 0; pair < num_pairs; ++pair) {
    const int32_t next_slots[kBuffers][kRows] = {
        {slot_of(2 * pair + 2, 0), slot_of(2 * pair + 2, 1)},
        {slot_of(2 * pair + 3, 0), slot_of(2 * pair + 3, 1)}};
    // One half of one buffer (both std::integral_constant: the loops unroll).
    const auto copy_half = [&](auto buffer_constant, auto half_constant) {
      constexpr int buffer = decltype(buffer_constant)::value, half = decltype(half_constant)::value;
      constexpr int first_column = half == 0 ? 0 : kSplitColumn;
      constexpr int end_column = half == 0 ? kSplitColumn : kColumns;
      static_assert((end_column - first_column) % 4 == 0);
      constexpr bool first = half == FirstHalf(buffer);
      if (pair > 0) WaitBarrier(&smem.freed[buffer][half], (pair - 1) % 2);
      uint8_t* keys = smem.keys[buffer];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = first_row + 32 * r;
        const int32_t slot = slots[buffer][r];
        const bool valid = slot >= 0 && slot < p.num_slots;
        const uint8_t* source = p.kv + (valid ? int64_t{slot} * kRowBytes : 0);
#pragma unroll
        for (int k = 0; k < (end_column - first_column) / 4; ++k) {
          const int column = first_column + 4 * k + part;
          sm90::CopyAsync16(keys + column * kColumnBytes + row * 16, source + column * 16, valid);
        }
        if constexpr (first) {  // the warp's 8 rows (lanes 0-7) of these 32: word row / 8
          const uint32_t flags = __ballot_sync(0xffffffffu, valid) & 0xffu;
          if (lane == 0) smem.valid_rows[buffer][row / 8] = flags;
        }
      }
      sm90::ArriveOnCopies(&smem.ready[buffer][half]);
      if (first && lane == 0) wide::ArriveBarrier(&smem.ready[buffer][half]);
    };
    using Zero = std::integral_constant<int, 0>;
    using One = std::integral_constant<int, 1>;
    copy_half(Zero{}, Zero{});
    copy_half(One{}, One{});
    copy_half(Zero{}, One{});
    copy_half(One{}, Zero{});
#pragma unroll
    for (int buffer = 0; buffer < kBuffers; ++buffer)
#pragma unroll
      for (int r = 0; r < kRows; ++r) slots[buffer][r] = next_slots[buffer][r];
  }
  sm90::WaitAllCopies();  // no thread leaves with copies in flight
}

// S = Q K^T over k-steps [kFirstStep, kLastStep) of `keys` into `score`, issued and committed;
// `clear` starts the accumulators from zero at the first step.
template <int kFirstStep, int kLastStep>
__device__ __forceinline__ void IssueScores(uint64_t query_operand, const uint8_t* keys,
                                            float (&score)[32], bool clear) {
  const uint64_t keys_operand = wide::KMajor(keys);
  wide::FenceAccumulators(score);
  cute::warpgroup_arrive();
#pragma unroll
  for (int step = kFirstStep; step < kLastStep; ++step) {
    wide::RunMma<Operands::ScoresMma>(query_operand + step * kKMajorStep,
                                      keys_operand + step * kKMajorStep, score,
                                      !(clear && step == kFirstStep),
                                      std::make_index_sequence<32>{});
  }
  cute::warpgroup_commit_batch();
}

// The masked, scaled scores of a tile and their max per row (row0: i % 4 < 2, row1), over the
// thread's quad. Key 8 j + c (c < 8) is valid when bit c of valid_rows word j is set; most tiles
// are all valid.
__device__ __forceinline__ void MaskedScores(float (&score)[32], const uint32_t* valid_rows,
                                             float score_scale, int column_in_block,
                                             float (&tile_max)[2]) {
  const uint4 words_low = *reinterpret_cast<const uint4*>(valid_rows);
  const uint4 words_high = *reinterpret_cast<const uint4*>(valid_rows + 4);
  const uint32_t words[8] = {words_low.x,  words_low.y,  words_low.z,  words_low.w,
                             words_high.x, words_high.y, words_high.z, words_high.w};
  uint32_t all_valid = 0xffu;
#pragma unroll
  for (int j = 0; j < 8; ++j) all_valid &= words[j];
  tile_max[0] = tile_max[1] = -INFINITY;
  if (all_valid == 0xffu) {  // the same branch for the whole warpgroup
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      score[i] *= score_scale;
      tile_max[(i / 2) % 2] = fmaxf(tile_max[(i / 2) % 2], score[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const bool valid = (words[i / 4] >> (column_in_block + i % 2)) & 1u;
      score[i] = valid ? score[i] * score_scale : -INFINITY;
      tile_max[(i / 2) % 2] = fmaxf(tile_max[(i / 2) % 2], score[i]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
  }
}

// The exponent a row's probabilities are taken relative to: its max, or 0 while the row has seen
// only invalid keys (max -inf; exp2 of -inf then gives 0, never NaN).
__device__ __forceinline__ float ExponentBase(float row_max) {
  return row_max == -INFINITY ? 0.0f : row_max;
}

// score[i] = 2^(score[i] - base of its row), in place; adds them to row_sum.
__device__ __forceinline__ void Exponentiate(float (&score)[32], const float (&base)[2],
                                             float (&row_sum)[2]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    score[i] = Exp2(score[i] - base[(i / 2) % 2]);
    row_sum[(i / 2) % 2] += score[i];
  }
}

// P (the probabilities in `score`, times factor[row]) as bf16 pairs in the A-operand register
// layout of the P V MMAs: k-step s takes probs[4 s + 0..3].
__device__ __forceinline__ void PackProbs(const float (&score)[32], const float (&factor)[2],
                                          uint32_t (&probs)[16]) {
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const float f = factor[(i / 2) % 2];
    probs[i / 2] = Operands::Pack(score[i] * f, score[i + 1] * f);
  }
}

// Warpgroup kWarpgroup (0 or 1) of the consumers, from loading Q to writing its half of the output.
template <int kWarpgroup>
__device__ __forceinline__ void Consume(Shared& smem, const DecodeParams& p, int token, int split,
                                        int head_begin, int num_pairs, int thread) {
  using ValuesMma = Operands::ValuesMma;
  using ValuesMmaRs = Operands::ValuesMmaRs;
  const int lane = thread % 32;
  // Waits until `half` of `buffer` holds pair `pair`'s tile. The rows were written by cp.async
  // (the generic proxy) and no thread fenced them for wgmma's reads (the async proxy): each
  // consumer fences once they are visible to it. A warpgroup also waits (already complete) before
  // P V on a half the other warpgroup waited for, for the same reason.
  const auto wait_for_half = [&](int buffer, int half, int pair) {
    WaitBarrier(&smem.ready[buffer][half], pair % 2);
    FenceProxyAsync();
  };
  const auto free_half = [&](int buffer, int half) {
    if (thread == 0) wide::ArriveBarrier(&smem.freed[buffer][half]);
  };
  wide::LoadQuery<kLayout>(smem.q, p, token, head_begin, 128 * kWarpgroup + thread, smem.query_unscale);
  const uint64_t query_operand = wide::KMajor(smem.q);
  // Rows of this thread's accumulators: 16 w + l / 4 and 8 more.
  const int row0 = wide::AccumulatorRow(thread, 0), row1 = wide::AccumulatorRow(thread, 2);
  const int column_in_block = 2 * (lane % 4);
  const float score_scale = p.score_scale_log2;  // bf16 queries are not scaled
  float out[128] = {};
  float score[32];
  float row_max[2] = {-INFINITY, -INFINITY};  // the max all of O is relative to
  float row_sum[2] = {0.0f, 0.0f};  // this warpgroup's tiles, this thread's columns
  uint32_t probs[16];
  // Hands the row maxima `published` to the other warpgroup (shared memory, then `barrier`), then
  // turns the tile's scores into P relative to `base`: in place, added to row_sum, and as bf16
  // pairs in `probs`.
  const auto publish_max_and_exponentiate = [&](const float(&published)[2], int barrier,
                                                const float(&base)[2]) {
    if (lane % 4 == 0) {
      smem.row_max[row0] = published[0];
      smem.row_max[row1] = published[1];
    }
    wide::NamedBarrierArrive(barrier, 256);
    Exponentiate(score, base, row_sum);
    constexpr float kOne[2] = {1.0f, 1.0f};
    PackProbs(score, kOne, probs);
  };
  if constexpr (kWarpgroup == 0) {
    const auto issue_scores = [&](int pair) {
      wait_for_half(0, 0, pair);
      IssueScores<0, kSplitStep>(query_operand, smem.keys[0], score, true);
      wait_for_half(0, 1, pair);
      IssueScores<kSplitStep, kSteps>(query_operand, smem.keys[0], score, false);
    };
    // S of each pair's tile 2i is waited for within the iteration that issued it: ptxas serialises
    // every wgmma of a kernel whose accumulators are pending across a loop's back edge.
    if (num_pairs > 0) {
      issue_scores(0);
      cute::warpgroup_wait<0>();
    }
    for (int pair = 0; pair < num_pairs; ++pair) {
      wide::FenceAccumulators(score);
      // Softmax of tile 2i against the max of the previous pairs; the new max goes to warpgroup 1.
      float tile_max[2], base[2], rescale[2];
      MaskedScores(score, smem.valid_rows[0], score_scale, column_in_block, tile_max);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float first_max = fmaxf(row_max[r], tile_max[r]);
        base[r] = ExponentBase(first_max);
        rescale[r] = Exp2(row_max[r] - base[r]);
        row_max[r] = first_max;
        row_sum[r] *= rescale[r];
      }
      publish_max_and_exponentiate(row_max, kFirstMax, base);
      // O[:, 0:256] += P V of tile 2i, P from registers; then buffer 0's first half is free.
      wide::RescaleRows(out, rescale[0], rescale[1]);
      wide::IssueValues<ValuesMmaRs>(out, probs, wide::ValueOperand(smem.keys[0], 0));
      cute::warpgroup_wait<0>();
      wide::FinishValues(out, probs);
      free_half(0, 0);
      // The pair's max from warpgroup 1: P of tile 2i and O move to it, and P goes to warpgroup 1.
      wide::NamedBarrierSync(kSecondMax, 256);
      float factor[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float pair_max = smem.row_max[r == 0 ? row0 : row1];
        factor[r] = Exp2(row_max[r] - ExponentBase(pair_max));
        row_max[r] = pair_max;
        row_sum[r] *= factor[r];
      }
      PackProbs(score, factor, probs);
      wide::StoreProbs(smem.keys[0] + kRopeProbsOffset, probs, row0, row1, column_in_block);
      FenceProxyAsync();
      wide::NamedBarrierArrive(kFirstProbs, 256);
      // O[:, 0:256] += P V of tile 2i + 1 with warpgroup 1's P, while the next pair's S starts.
      wide::NamedBarrierSync(kSecondProbs, 256);
      wait_for_half(1, 0, pair);
      wide::RescaleRows(out, factor[0], factor[1]);
      const uint64_t second_probs = wide::KMajor(smem.probs);
      wide::IssueValues<ValuesMma>(out, second_probs, wide::ValueOperand(smem.keys[1], 0));
      if (pair + 1 < num_pairs) {
        wait_for_half(0, 0, pair + 1);
        IssueScores<0, kSplitStep>(query_operand, smem.keys[0], score, true);
        cute::warpgroup_wait<1>();
        wide::FinishValues(out, second_probs);
        free_half(1, 0);
        wait_for_half(0, 1, pair + 1);
        IssueScores<kSplitStep, kSteps>(query_operand, smem.keys[0], score, false);
        cute::warpgroup_wait<0>();
      } else {
        cute::warpgroup_wait<0>();
        wide::FinishValues(out, second_probs);
        free_half(1, 0);
      }
    }
  } else {
    for (int pair = 0; pair < num_pairs; ++pair) {
      // S of tile 2i + 1, second half first (the order the producer fills buffer 1).
      wait_for_half(1, 1, pair);
      IssueScores<kSplitStep, kSteps>(query_operand, smem.keys[1], score, true);
      wait_for_half(1, 0, pair);
      IssueScores<0, kSplitStep>(query_operand, smem.keys[1], score, false);
      cute::warpgroup_wait<0>();
      wide::FenceAccumulators(score);
      float tile_max[2], base[2], rescale[2];
      MaskedScores(score, smem.valid_rows[1], score_scale, column_in_block, tile_max);
      // The pair's max: warpgroup 0's (the previous pairs and tile 2i) and this tile's.
      wide::NamedBarrierSync(kFirstMax, 256);
      float pair_max[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        pair_max[r] = fmaxf(smem.row_max[r == 0 ? row0 : row1], tile_max[r]);
        base[r] = ExponentBase(pair_max[r]);
        rescale[r] = Exp2(row_max[r] - base[r]);
        row_max[r] = pair_max[r];
        row_sum[r] *= rescale[r];
      }
      __syncwarp();  // every lane of a row's quad has read warpgroup 0's max
      publish_max_and_exponentiate(pair_max, kSecondMax, base);
      // O[:, 256:512] += P V of tile 2i + 1 (P from registers), then of tile 2i (warpgroup 0's P).
      wide::RescaleRows(out, rescale[0], rescale[1]);
      wide::IssueValues<ValuesMmaRs>(out, probs, wide::ValueOperand(smem.keys[1], 256));
      wide::StoreProbs(smem.probs, probs, row0, row1, column_in_block);
      wide::NamedBarrierSync(kFirstProbs, 256);
      wait_for_half(0, 1, pair);
      const uint64_t first_probs = wide::KMajor(smem.keys[0] + kRopeProbsOffset);
      wide::IssueValues<ValuesMma>(out, first_probs, wide::ValueOperand(smem.keys[0], 256));
      FenceProxyAsync();  // this warpgroup's P, before warpgroup 0's MMAs read it
      wide::NamedBarrierArrive(kSecondProbs, 256);
      cute::warpgroup_wait<1>();
      wide::FinishValues(out, probs);
      free_half(1, 1);
      cute::warpgroup_wait<0>();
      wide::FinishValues(out, first_probs);
      free_half(0, 1);
    }
  }

  // l per row (both warpgroups' sums, added in the same order by both), then lse and the output.
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  if (lane % 4 == 0) {
    smem.row_sum[kWarpgroup][row0] = row_sum[0];
    smem.row_sum[kWarpgroup][row1] = row_sum[1];
  }
  wide::NamedBarrierSync(wide::kConsumers, 256);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r == 0 ? row0 : row1;
    const float sum = smem.row_sum[0][row] + smem.row_sum[1][row];
    const bool empty = sum == 0.0f;  // a NaN row (NaN or infinite q) stays NaN
    if (lane % 4 != 0) continue;
    smem.inverse_sum[kWarpgroup][row] = empty ? 0.0f : 1.0f / sum;
    const int head = head_begin + row;
    if (kWarpgroup == 0 && head < p.num_heads) {
      const float lse_log2 = empty ? -INFINITY : row_max[r] + log2f(sum);
      const int64_t row_index = int64_t{token} * p.num_heads + head;
      if (p.num_splits == 1) {
        p.lse[row_index] = p.lse_base_e ? lse_log2 * kLn2 : lse_log2;
      } else {
        p.partial_lse[int64_t{split} * p.num_tokens * p.num_heads + row_index] = lse_log2;
      }
    }
  }
  __syncwarp();  // each row's 1 / l, written by lane 4 q, for the whole quad
  wide::WriteOutput(out, p, smem.inverse_sum[kWarpgroup], token, split, head_begin, kWarpgroup, row0,
                    row1, column_in_block, smem.q);
}

__global__ void __launch_bounds__(kThreads, 1) SparseMlaBf16DecodeKernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t shared_bytes[];
  Shared& smem = *reinterpret_cast<Shared*>(shared_bytes);
  const int head_begin = blockIdx.x * kHeads;
  const int split = blockIdx.y;
  const int token = blockIdx.z;
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;

  const SplitRange range = SplitOf(p, token, split);
  const int key_begin = range.key_begin, key_end = range.key_end, num_tiles = range.num_tiles;
  const int num_pairs = (num_tiles + 1) / 2;

  if (threadIdx.x < kBuffers * kHalves) {
    const int buffer = threadIdx.x / kHalves, half = threadIdx.x % kHalves;
    InitBarrier(&smem.ready[buffer][half], ReadyArrivals(buffer, half));
    InitBarrier(&smem.freed[buffer][half], 1);
  }
  __syncthreads();

  if (warpgroup == 2) {
    wide::SetRegisters<kProducerRegisters>();
    CopyTiles(smem, p, token, key_begin, key_end, num_pairs, thread);
    return;
  }
  // Each consumer warpgroup runs its own code to the end: ptxas allocates the registers that
  // setmaxnreg grants only to code that no other register count reaches.
  wide::SetRegisters<kConsumerRegisters>();
  if (warpgroup == 0) {
    Consume<0>(smem, p, token, split, head_begin, num_pairs, thread);
  } else {
    Consume<1>(smem, p, token, split, head_begin, num_pairs, thread);
  }
}

}  // namespace jax_sparse_mla::fp8::bf16
