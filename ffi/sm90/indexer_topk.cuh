// The lightning indexer's top-k selection (top_k_per_row / top_k_per_row_decode) as a CUDA kernel:
// one CTA per row, an exact radix select of the row's k-th best key, then one stable compaction
// pass that writes the chosen positions in ascending order. The result is the pure-JAX reference's
// (jax_sparse_mla/ops/indexer.py: _order_keys, _top_k_rows) bit for bit; docs/indexer.md states
// the rule.
//
// Per row, with len = end - start positions in range (after clamping as the reference does):
//  * len <= k: every position is chosen (the reference keeps all of them whatever their values),
//    so the row writes 0, 1, ..., len - 1 and then -1 without reading the logits.
//  * len > k: each value becomes an order-preserving uint32 key (OrderKey). Three histogram passes
//    of 11, 11 and 10 bits, each over the keys whose higher digits match the digits chosen so far,
//    find the k-th largest key T digit by digit (the bin where the count of larger keys crosses
//    the number still wanted). Once a pass leaves few enough keys that can still be kept, they are
//    gathered in position order into shared-memory lists (GatherCandidates), and the remaining
//    passes and the compaction read only those (CountCandidates, CompactCandidates); long rows
//    gather speculatively during the first pass, from a sampled estimate (EstimateGatherKey). Where
//    the lists cannot hold them (heavy ties), every pass rereads the row, so no amount of ties can
//    truncate anything. With needed = k - #(key > T), the compaction keeps every key > T and the
//    first `needed` keys == T in position order; a block-wide prefix sum of (kept above, seen ties)
//    gives each kept position its output slot, so the output is ascending with no sort and
//    deterministic. When a pass's threshold bin holds exactly the keys still wanted, the digits
//    chosen so far already separate the kept keys from the rest and the remaining passes are
//    skipped (the comparison then uses the matched high bits only, which selects the same set).
//
// Two builds (TopKPerRowKernel<kStream>): two CTAs per SM reading the row into registers
// (LoadReader), or one CTA per SM streaming it through shared memory with bulk copies
// (StreamReader).
#pragma once

#include <cstdint>
#include <type_traits>

#include "sm90/sm90_async.cuh"

namespace jax_sparse_mla::indexer_topk {

constexpr int kThreads = 512;                   // one CTA per row
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 4;                         // floats per thread per step (one float4)
constexpr int kBins = 2048;                     // the widest digit has 11 bits
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kNumPasses = 3;
static_assert(kBins % kThreads == 0, "every thread owns the same number of bins");
// The compaction scan packs two per-chunk counts (each <= kThreads * kVec) into 16 bits each.
static_assert(kThreads * kVec < (1 << 16), "per-chunk counts must fit 16 bits");

struct TopKParams {
  const float* logits;         // [num_rows, width] row-major
  int32_t* out;                // [num_rows, k]
  const int32_t* row_starts;   // [num_rows] (prefill rows; nullptr for decode)
  const int32_t* row_ends;     // [num_rows] (prefill rows; nullptr for decode)
  const int32_t* context_lens; // [num_rows / next_n] (decode rows; nullptr for prefill)
  int32_t next_n;              // decode: query tokens per request
  int32_t width;               // S
  int32_t k;
};

// float32 -> uint32 key in the selection order, exactly as _order_keys: NaN (either sign) -> 1;
// numbers above it in numeric order, -inf -> 0x007FFFFF ... +inf -> 0xFF800000; -0.0 -> +0.0's key.
// Integer operations only, so subnormals keep their order. (0 is "not in the row" in the reference;
// the kernel never looks at positions outside the row.)
__device__ __forceinline__ uint32_t OrderKey(float value) {
  uint32_t bits = __float_as_uint(value);
  if (bits == 0x80000000u) bits = 0u;
  const uint32_t key = (bits & 0x80000000u) != 0u ? ~bits : (bits | 0x80000000u);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? 1u : key;
}

// A row's values seen as groups of four at 16-byte-aligned addresses: group g holds positions
// [4 g - lead, 4 g - lead + 4) where lead = the row start's misalignment in floats (0..3), so the
// interior groups are single float4 loads whatever the row's start and the width; the first and
// last groups may be partial and are read element by element.
struct RowView {
  const float* data;  // position 0 of the row
  int64_t len;        // positions in the row
  int lead;           // (address of position 0 / 4) mod 4
  int64_t groups;     // ceil((len + lead) / 4)
};

__device__ __forceinline__ RowView MakeRowView(const float* data, int64_t len) {
  RowView row;
  row.data = data;
  row.len = len;
  row.lead = static_cast<int>((reinterpret_cast<uintptr_t>(data) >> 2) & 3u);
  row.groups = (len + row.lead + kVec - 1) / kVec;
  return row;
}

// Loads group g: v[j] is the value at position first + j, valid[j] whether it lies in the row.
__device__ __forceinline__ void LoadGroup(const RowView& row, int64_t g, float (&v)[kVec],
                                          bool (&valid)[kVec], int64_t& first) {
  first = g * kVec - row.lead;
  if (first >= 0 && first + kVec <= row.len) {
    // data + first is 16-byte aligned by the choice of lead.
    const float4 x = *reinterpret_cast<const float4*>(row.data + first);
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
#pragma unroll
    for (int j = 0; j < kVec; ++j) valid[j] = true;
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t p = first + j;
    valid[j] = p >= 0 && p < row.len;
    v[j] = valid[j] ? row.data[p] : 0.0f;
  }
}

// Exclusive prefix sum of `value` over the CTA's threads in thread order; *total receives the sum
// over all threads. Every thread must call it (it synchronises the CTA); `warp_sums` is kWarps
// words of shared memory, free again when it returns.
__device__ __forceinline__ uint32_t BlockExclusiveSum(uint32_t value, uint32_t* warp_sums,
                                                      uint32_t* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  uint32_t inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint32_t other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    uint32_t sum = lane < kWarps ? warp_sums[lane] : 0u;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const uint32_t other = __shfl_up_sync(0xFFFFFFFFu, sum, offset);
      if (lane >= offset) sum += other;
    }
    if (lane < kWarps) warp_sums[lane] = sum;  // inclusive over warps
  }
  __syncthreads();
  const uint32_t before = warp == 0 ? 0u : warp_sums[warp - 1];
  *total = warp_sums[kWarps - 1];
  __syncthreads();  // the next call overwrites warp_sums
  return before + inclusive - value;
}

// What the threads of a CTA agree on after each radix pass.
struct Threshold {
  uint32_t bin;    // the threshold bin of the current pass
  uint32_t above;  // keys (matching the prefix) in higher bins
  uint32_t count;  // keys in the threshold bin
};

// The radix select's state, the same in every thread: after the passes, a key is "above" when
// (key & mask) > prefix and "tied" when (key & mask) == prefix; `remaining` is how many tied keys
// are kept (all of them on an early exit, the first ones in position order otherwise).
struct RadixState {
  uint32_t prefix;
  uint32_t mask;
  uint32_t remaining;
};

// Digits of 11, 11 and 10 bits, most significant first.
__device__ __forceinline__ int PassShift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
__device__ __forceinline__ uint32_t PassDigitMask(int pass) { return pass == 2 ? 0x3FFu : 0x7FFu; }

// Appends pass `pass`'s threshold bin to the state; returns true when every key of that bin is
// kept (the digits so far decide the selection).
__device__ __forceinline__ bool ApplyThreshold(const Threshold& threshold, int pass,
                                               RadixState* state) {
  state->remaining -= threshold.above;
  state->prefix |= threshold.bin << PassShift(pass);
  state->mask |= PassDigitMask(pass) << PassShift(pass);
  return threshold.count == state->remaining;
}

// Ends radix pass `pass` from this thread's bin counts: counts[j] is the count (over the keys
// matching the prefix) of bin kBins - 1 - (threadIdx.x * kBinsPerThread + j), so thread t owns
// kBinsPerThread consecutive bins counted from the top and an exclusive prefix sum in thread order
// counts the keys in higher bins. Exactly one bin b has above(b) < remaining <= above(b) + count(b):
// remaining >= 1 and the matching keys number at least `remaining` (len > k on the first pass, the
// previous threshold bin's count later). Appends b to the prefix; returns true when every key of
// that bin is kept, so that the digits so far decide the selection. Every thread must call it (it
// synchronises the CTA).
__device__ __forceinline__ bool ChooseThresholdBin(const uint32_t (&counts)[kBinsPerThread],
                                                   int pass, RadixState* state,
                                                   uint32_t* warp_sums, Threshold* chosen) {
  uint32_t owned = 0u;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) owned += counts[j];
  uint32_t total;
  uint32_t above = BlockExclusiveSum(owned, warp_sums, &total);
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    if (above < state->remaining && above + counts[j] >= state->remaining) {
      *chosen = Threshold{static_cast<uint32_t>(kBins - 1 - (threadIdx.x * kBinsPerThread + j)),
                          above, counts[j]};
    }
    above += counts[j];
  }
  __syncthreads();
  // No barrier after the read: the next call writes *chosen only after its block scan's barriers.
  return ApplyThreshold(*chosen, pass, state);
}

// One chunk of the compaction in position order: this thread's kKeys keys at positions
// first + j (relative to the row start) are above the threshold or tied with it where bit j of
// above_mask / tie_mask is set; thread t's keys precede thread t + 1's. kThreads * kKeys < 2^16, so
// the two counts share one scanned word.
// A kept key's output slot is (kept above-threshold keys before it) + min(ties before it, needed);
// *above_seen and *ties_seen count the keys before this chunk (the same in every thread) and are
// advanced past it. Only the flagged keys are visited (a few in a chunk: about k of the row's keys
// are), so a thread's work after the block scan is its flagged keys, not its kKeys. Returns true
// once all k slots are written (no later key is kept). Every thread must call it (it synchronises
// the CTA).
template <int kKeys>
__device__ __forceinline__ bool CompactChunk(uint32_t above_mask, uint32_t tie_mask, int64_t first,
                                             uint32_t needed, uint32_t want, uint32_t* above_seen,
                                             uint32_t* ties_seen, uint32_t* warp_sums,
                                             int32_t* out) {
  static_assert(kThreads * kKeys < (1 << 16) && kKeys <= 32);
  uint32_t chunk_total;
  const uint32_t before = BlockExclusiveSum((__popc(above_mask) << 16) | __popc(tie_mask),
                                            warp_sums, &chunk_total);
  const uint32_t above_before = *above_seen + (before >> 16);
  const uint32_t ties_before = *ties_seen + (before & 0xFFFFu);
  for (uint32_t pending = above_mask | tie_mask; pending != 0u; pending &= pending - 1u) {
    const int j = __ffs(pending) - 1;
    const uint32_t lower = (1u << j) - 1u;  // this thread's keys before key j
    const uint32_t ties = ties_before + __popc(tie_mask & lower);
    if (((above_mask >> j) & 1u) != 0u || ties < needed) {
      const uint32_t slot = above_before + __popc(above_mask & lower) + min(ties, needed);
      // slot < k by construction; the test only guards memory if that reasoning were wrong.
      if (slot < want) out[slot] = static_cast<int32_t>(first + j);
    }
  }
  *above_seen += chunk_total >> 16;
  *ties_seen += chunk_total & 0xFFFFu;
  return *above_seen + min(*ties_seen, needed) >= want;
}

// After the first pass, the keys whose first digit is at or above its threshold bin (every key the
// selection can keep: fewer than k above the bin, plus the bin) are gathered once from the row into
// shared memory, so that the later passes and the compaction read them there instead of the row.
// Warp w gathers from its own contiguous slice of the row into its own list of at most
// kCandidatesPerWarp keys, in position order; the lists in warp order are then the candidates in
// position order. A row where any warp's slice holds more (heavy ties in the bin, k near the list
// size) takes the rereading passes instead.
constexpr int kCandidatesPerWarp = 512;
constexpr int kCandidateCapacity = kWarps * kCandidatesPerWarp;
// Dynamic shared memory: the candidates' keys, then their positions.
constexpr int kCandidateBytes = kCandidateCapacity * (sizeof(uint32_t) + sizeof(int32_t));
// A pass gathers the candidates only when they number at most this many: with fewer than 3/4 of
// the lists' room in all, one warp's slice rarely holds more than its list's (the gather is then a
// wasted pass over the row).
constexpr uint32_t kGatherMaxCandidates = kCandidateCapacity / 4 * 3;
// Rows at least this long first estimate, from a sample, a key low enough that the k largest are
// at or above it, and gather the keys at or above it while the first pass counts them: one read
// of the row instead of two when the estimate holds (the first pass's threshold bin at or above
// it, and every list big enough). On an H100 (k = 2048) this took 32 x 131072 from 88.3 to 53.3
// µs, 128 x 131072 from 95.5 to 90.2 and 4096 causal rows of up to 131072 from 1632 to 1190, but
// 128 x 65536 from 42.0 to 50.6 (the sample is a larger share of a shorter row): rows from 96K
// positions up.
constexpr int64_t kSpeculateMinLen = 98304;
// Groups sampled per thread (evenly spaced over the row): kThreads * 4 * 4 = 8192 keys.
constexpr int kSampleGroupsPerThread = 4;
// Groups a lane loads before it counts or gathers from any (LoadReader: bytes in flight per warp
// 32 x 16 x this, 64 registers a thread at two CTAs per SM).
constexpr int kGatherUnroll = 4;
// StreamReader (the build for one CTA per SM): each warp's two stages of kStreamGroups groups
// (4 KB each), 128 KB for the CTA.
constexpr int kStreamStages = 2;
constexpr int kStreamGroups = 256;
constexpr int kStreamBytes = kWarps * kStreamStages * kStreamGroups * 16;

struct Shared {
  uint32_t hist[kBins];
  uint32_t warp_sums[kWarps];
  uint32_t candidate_counts[kWarps];  // keys in warp w's list
  uint32_t warp_above[kWarps];        // compaction: kept keys above the threshold in lists < w
  uint32_t warp_ties[kWarps];         //   and keys tied with it in lists < w
  Threshold chosen;
};

// A view of the candidate lists in dynamic shared memory: warp w's list holds counts[w] entries
// from index w * kCandidatesPerWarp.
struct Candidates {
  uint32_t* keys;
  int32_t* positions;  // relative to the row start
};

__device__ __forceinline__ uint32_t LaneMaskLt() {
  uint32_t mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// The exclusive prefix over the warp's lanes of `count` (0..7) and the warp's total, from three
// ballots.
__device__ __forceinline__ uint32_t WarpExclusiveCount(uint32_t count, uint32_t* total) {
  const uint32_t b0 = __ballot_sync(0xFFFFFFFFu, count & 1u);
  const uint32_t b1 = __ballot_sync(0xFFFFFFFFu, count & 2u);
  const uint32_t b2 = __ballot_sync(0xFFFFFFFFu, count & 4u);
  const uint32_t lt = LaneMaskLt();
  *total = __popc(b0) + 2u * __popc(b1) + 4u * __popc(b2);
  return __popc(b0 & lt) + 2u * __popc(b1 & lt) + 4u * __popc(b2 & lt);
}

// ---- Reading the row ------------------------------------------------------------------------
//
// The counting passes and the gathers read the row through a reader: visit(v, valid, first) sees
// one group (v[j] at position first + j, valid[j] whether it lies in the row); it may use warp
// collectives: every lane of a warp makes the same calls.
//   Slice(row, begin, end, visit, stop): groups [begin, end) by this warp, lane l seeing groups
//     begin + 32 i + l in order of i (so the warp sees them in position order, 32 at a time);
//     after each batch or chunk, ends if stop() (warp-uniform) says so.
//   All(row, visit): every group of the row once, over the CTA, in no particular order.

// Loads into registers: each lane loads kGatherUnroll groups before it visits any. All() strides
// over the whole CTA (thread t: groups t, t + kThreads, ...).
struct LoadReader {
  template <class Visit, class Stop>
  __device__ __forceinline__ void Slice(const RowView& row, int64_t begin, int64_t end,
                                        Visit&& visit, Stop&& stop) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int64_t base = begin; base < end; base += 32 * kGatherUnroll) {
      float v[kGatherUnroll][kVec];
      bool valid[kGatherUnroll][kVec];
      int64_t first[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t g = base + u * 32 + lane;
        first[u] = 0;
#pragma unroll
        for (int j = 0; j < kVec; ++j) valid[u][j] = false;
        if (g < end) LoadGroup(row, g, v[u], valid[u], first[u]);
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) visit(v[u], valid[u], first[u]);
      if (stop()) break;
    }
  }

  template <class Visit>
  __device__ __forceinline__ void All(const RowView& row, Visit&& visit) {
#pragma unroll 1
    for (int64_t base = threadIdx.x; base < row.groups; base += kThreads * kGatherUnroll) {
      float v[kGatherUnroll][kVec];
      bool valid[kGatherUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t g = base + u * kThreads;
        int64_t first;
#pragma unroll
        for (int j = 0; j < kVec; ++j) valid[u][j] = false;
        if (g < row.groups) LoadGroup(row, g, v[u], valid[u], first);
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        visit(v[u], valid[u], (base + u * kThreads) * kVec - row.lead);
      }
    }
  }
};

// Streams through shared memory (the build for one CTA per SM): each warp reads its slice in chunks
// of kStreamGroups groups, which lane 0 has the copy engine bring into the warp's two stages
// (cp.async.bulk completing on the stage's mbarrier), the next chunk in flight while the warp
// visits one. The copies bring only the row's whole groups: a partial first or last group (a row
// start or end inside a 16-byte word) is loaded by its lane, so no copy reads outside the row's
// 16-byte words. All() is each warp's slice of the whole row.
struct StreamReader {
  float4* stages;   // this warp's [kStreamStages][kStreamGroups]
  uint64_t* full;   // this warp's kStreamStages mbarriers (one arrival: lane 0's)
  uint32_t phases;  // bit s: the parity in which stage s completes next (the same in every lane)

  template <class Visit, class Stop>
  __device__ __forceinline__ void Slice(const RowView& row, int64_t begin, int64_t end,
                                        Visit&& visit, Stop&& stop) {
    const int lane = threadIdx.x & 31;
    const int64_t chunks = end > begin ? (end - begin + kStreamGroups - 1) / kStreamGroups : 0;
    // Group g is whole when 4 g - lead >= 0 and 4 g - lead + 4 <= len.
    const int64_t whole_begin = row.lead == 0 ? 0 : 1;
    const int64_t whole_end = (row.len + row.lead) / kVec;
    const float* aligned = row.data - row.lead;  // group g at aligned + 4 g, 16-byte aligned
    auto issue = [&](int64_t chunk) {  // lane 0
      const int stage = static_cast<int>(chunk % kStreamStages);
      const int64_t c0 = begin + chunk * kStreamGroups;
      const int64_t c1 = min(c0 + kStreamGroups, end);
      const int64_t w0 = max(c0, whole_begin), w1 = min(c1, whole_end);
      const uint32_t bytes = w1 > w0 ? static_cast<uint32_t>(w1 - w0) * 16u : 0u;
      // With no whole group, the arrival alone completes the phase.
      sm90::ArriveExpectBytes(&full[stage], bytes);
      if (bytes > 0u) {
        sm90::CopyBulk(stages + stage * kStreamGroups + (w0 - c0), aligned + w0 * kVec, bytes,
                       &full[stage]);
      }
    };
    int64_t issued = min(static_cast<int64_t>(kStreamStages), chunks);
    if (lane == 0 && issued > 0) {
      sm90::FenceProxyAsync();  // the lanes' reads of the stages in an earlier walk (synchronised
                                // since) before the copies' writes
      for (int64_t c = 0; c < issued; ++c) issue(c);
    }
    int64_t consumed = 0;
    bool go = true;
    auto wait = [&](int64_t chunk) {
      const int stage = static_cast<int>(chunk % kStreamStages);
      sm90::WaitBarrier(&full[stage], (phases >> stage) & 1u);
      phases ^= 1u << stage;
    };
#pragma unroll 1
    while (go && consumed < chunks) {
      wait(consumed);
      const int64_t c0 = begin + consumed * kStreamGroups;
      const float4* chunk = stages + (consumed % kStreamStages) * kStreamGroups;
#pragma unroll 2
      for (int i = 0; i < kStreamGroups / 32; ++i) {
        const int local = i * 32 + lane;
        const int64_t g = c0 + local;
        float v[kVec];
        bool valid[kVec];
        int64_t first = g * kVec - row.lead;
        if (g < end && g >= whole_begin && g < whole_end) {
          const float4 x = chunk[local];
          v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
#pragma unroll
          for (int j = 0; j < kVec; ++j) valid[j] = true;
        } else if (g < end) {
          LoadGroup(row, g, v, valid, first);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) v[j] = 0.0f, valid[j] = false;
        }
        visit(v, valid, first);
      }
      go = !stop();
      ++consumed;
      __syncwarp();  // every lane is done with the stage before it is refilled
      if (go && issued < chunks) {
        if (lane == 0) {
          sm90::FenceProxyAsync();  // the lanes' reads before the copy's writes
          issue(issued);
        }
        ++issued;
      }
    }
    // Chunks in flight after an early stop: waited for, so that no copy lands in a stage after the
    // walk and the phases stay in step for the next one.
    while (consumed < issued) wait(consumed++);
  }

  template <class Visit>
  __device__ __forceinline__ void All(const RowView& row, Visit&& visit) {
    const int warp = threadIdx.x >> 5;
    const int64_t groups_per_warp = (row.groups + kWarps - 1) / kWarps;
    const int64_t begin = min(row.groups, warp * groups_per_warp);
    Slice(row, begin, min(row.groups, begin + groups_per_warp), visit, [] { return false; });
  }
};

// Gathers every key of the row at or above min_key into the warps' lists (see kCandidatesPerWarp);
// after a pass, min_key = the prefix chosen so far keeps exactly the keys with (key & mask) >=
// prefix. With kCountFirstDigit, it also counts every key of the row into hist by its first digit
// (the first radix pass, made in the same read), and goes on counting after a list is full.
// Returns, in every thread, whether every list held its keys. Every thread must call it (it
// synchronises the CTA).
template <bool kCountFirstDigit = false, class Reader>
__device__ __forceinline__ bool GatherCandidates(Reader& reader, const RowView& row,
                                                 uint32_t min_key, const Candidates& candidates,
                                                 Shared* smem, uint32_t* hist = nullptr) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t groups_per_warp = (row.groups + kWarps - 1) / kWarps;
  const int64_t slice_begin = min(row.groups, warp * groups_per_warp);
  const int64_t slice_end = min(row.groups, slice_begin + groups_per_warp);
  uint32_t* keys = candidates.keys + warp * kCandidatesPerWarp;
  int32_t* positions = candidates.positions + warp * kCandidatesPerWarp;
  uint32_t count = 0u;
  bool overflow = false;
  auto visit = [&](const float (&v)[kVec], const bool (&valid)[kVec], int64_t first) {
    uint32_t key[kVec];
    bool keep[kVec];
    uint32_t kept = 0u;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      key[j] = OrderKey(v[j]);
      keep[j] = valid[j] && key[j] >= min_key;
      kept += keep[j];
      if constexpr (kCountFirstDigit) {
        if (valid[j]) atomicAdd(&hist[key[j] >> PassShift(0)], 1u);
      }
    }
    uint32_t total;
    uint32_t slot = count + WarpExclusiveCount(kept, &total);
    if (count + total > kCandidatesPerWarp) overflow = true;
    if (!overflow) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (keep[j]) {
          keys[slot] = key[j];
          positions[slot] = static_cast<int32_t>(first + j);
          ++slot;
        }
      }
    }
    count += total;
  };
  // A full list ends the gather (the row is read again), unless it also counts the first pass.
  reader.Slice(row, slice_begin, slice_end, visit,
               [&] { return overflow && !kCountFirstDigit; });  // warp-uniform
  if (lane == 0) smem->candidate_counts[warp] = count;
  return __syncthreads_or(overflow) == 0;
}

// One radix pass over the candidates: counts, into hist (zeroed by the caller), the keys matching
// the prefix by their digit of `pass`. Thread `lane` of warp w reads entries lane, lane + 32, ...
// of list w.
__device__ __forceinline__ void CountCandidates(const Candidates& candidates, const Shared& smem,
                                                const RadixState& state, int pass,
                                                uint32_t* hist) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint32_t* keys = candidates.keys + warp * kCandidatesPerWarp;
  const uint32_t count = smem.candidate_counts[warp];
  const int shift = PassShift(pass);
  const uint32_t digit_mask = PassDigitMask(pass);
  for (uint32_t i = lane; i < count; i += 32) {
    const uint32_t key = keys[i];
    if ((key & state.mask) == state.prefix) atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
  }
}

// The compaction over the candidates, which hold every kept key in position order: a kept key's
// output slot is (kept above-threshold keys before it) + min(ties before it, needed), as in
// CompactChunk. Each warp counts its list's above and tied keys, one thread turns the counts into
// the counts before each list, and each warp then walks its list 32 entries at a time with ballots.
// Every thread must call it (it synchronises the CTA).
__device__ __forceinline__ void CompactCandidates(const Candidates& candidates, Shared* smem,
                                                  const RadixState& state, uint32_t want,
                                                  int32_t* out) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint32_t* keys = candidates.keys + warp * kCandidatesPerWarp;
  const int32_t* positions = candidates.positions + warp * kCandidatesPerWarp;
  const uint32_t count = smem->candidate_counts[warp];
  uint32_t n_above = 0u, n_tie = 0u;
  for (uint32_t i = lane; i < count; i += 32) {
    const uint32_t masked = keys[i] & state.mask;
    n_above += masked > state.prefix;
    n_tie += masked == state.prefix;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    n_above += __shfl_xor_sync(0xFFFFFFFFu, n_above, offset);
    n_tie += __shfl_xor_sync(0xFFFFFFFFu, n_tie, offset);
  }
  if (lane == 0) {
    smem->warp_above[warp] = n_above;
    smem->warp_ties[warp] = n_tie;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t above = 0u, ties = 0u;
    for (int w = 0; w < kWarps; ++w) {
      const uint32_t a = smem->warp_above[w], t = smem->warp_ties[w];
      smem->warp_above[w] = above;
      smem->warp_ties[w] = ties;
      above += a;
      ties += t;
    }
  }
  __syncthreads();
  uint32_t above_before = smem->warp_above[warp];
  uint32_t ties_before = smem->warp_ties[warp];
  const uint32_t needed = state.remaining;
  const uint32_t lt = LaneMaskLt();
  for (uint32_t base = 0; base < count; base += 32) {
    const uint32_t i = base + lane;
    const uint32_t masked = i < count ? (keys[i] & state.mask) : 0u;
    const bool is_above = i < count && masked > state.prefix;
    const bool is_tie = i < count && masked == state.prefix;
    const uint32_t above_mask = __ballot_sync(0xFFFFFFFFu, is_above);
    const uint32_t tie_mask = __ballot_sync(0xFFFFFFFFu, is_tie);
    const uint32_t my_above = above_before + __popc(above_mask & lt);
    const uint32_t my_ties = ties_before + __popc(tie_mask & lt);
    if (is_above || (is_tie && my_ties < needed)) {
      const uint32_t slot = my_above + min(my_ties, needed);
      // slot < k by construction; the test only guards memory if that reasoning were wrong.
      if (slot < want) out[slot] = positions[i];
    }
    above_before += __popc(above_mask);
    ties_before += __popc(tie_mask);
  }
}

// Row r's range [start, end) of logits positions: prefill rows over [row_starts[r], row_ends[r]),
// decode row r = b * next_n + j over [0, context_lens[b] - next_n + j + 1); both clamped as the
// reference clamps: start to [0, S], end to [start, S].
__device__ __forceinline__ void RowBounds(const TopKParams& params, int64_t r, int32_t* start,
                                          int32_t* end) {
  if (params.context_lens != nullptr) {
    *start = 0;
    // int32 arithmetic with wrap-around, as the reference computes it in int32.
    const uint32_t context = static_cast<uint32_t>(params.context_lens[r / params.next_n]);
    *end = static_cast<int32_t>(context - static_cast<uint32_t>(params.next_n) + 1u +
                                static_cast<uint32_t>(r % params.next_n));
  } else {
    *start = params.row_starts[r];
    *end = params.row_ends[r];
  }
  *start = min(max(*start, 0), params.width);
  *end = min(max(*end, *start), params.width);
}

// A row of len <= k positions: every position is chosen whatever its value, in order, then -1.
// The calling threads write out[i] for i = first, first + stride, ... (int64: k may be close to
// 2^31).
__device__ __forceinline__ void WriteWholeRow(int32_t* out, int64_t len, int k, int64_t first,
                                              int64_t stride) {
  for (int64_t i = first; i < k; i += stride) out[i] = i < len ? static_cast<int32_t>(i) : -1;
}

// The estimate for the speculative gather: the sample's keys counted by first digit, then the bin
// where the count of higher sampled keys crosses 1.5 x the k largest's expected share of the
// sample plus 32 (a margin of several standard deviations of that share). Returns that bin's
// lowest key. Every thread must call it (it synchronises the CTA).
__device__ __forceinline__ uint32_t EstimateGatherKey(const RowView& row, int k, Shared* smem) {
  constexpr int kSampleGroups = kThreads * kSampleGroupsPerThread;
  for (int i = threadIdx.x; i < kBins; i += kThreads) smem->hist[i] = 0u;
  __syncthreads();
  uint32_t sampled = 0u;
#pragma unroll
  for (int u = 0; u < kSampleGroupsPerThread; ++u) {
    const int64_t g = (int64_t{threadIdx.x + u * kThreads} * row.groups) / kSampleGroups;
    float v[kVec];
    bool valid[kVec];
    int64_t first;
    LoadGroup(row, g, v, valid, first);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (valid[j]) {
        atomicAdd(&smem->hist[OrderKey(v[j]) >> PassShift(0)], 1u);
        ++sampled;
      }
    }
  }
  uint32_t total_sampled;
  BlockExclusiveSum(sampled, smem->warp_sums, &total_sampled);  // synchronises: hist complete
  // The expected count of the k largest in the sample, rounded up; >= 1 since the row has > k keys.
  const uint64_t expected = (uint64_t{static_cast<uint32_t>(k)} * total_sampled +
                             static_cast<uint64_t>(row.len) - 1) / static_cast<uint64_t>(row.len);
  const uint64_t wanted = expected + expected / 2 + 32;
  const uint32_t target = wanted < total_sampled ? static_cast<uint32_t>(wanted) : total_sampled;
  uint32_t counts[kBinsPerThread];
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    counts[j] = smem->hist[kBins - 1 - (threadIdx.x * kBinsPerThread + j)];
  }
  RadixState estimate{0u, 0u, target};
  ChooseThresholdBin(counts, 0, &estimate, smem->warp_sums, &smem->chosen);
  return estimate.prefix;
}

// The radix passes' count over the row (the first pass's, and the later passes' until the
// candidates are gathered): into hist (zeroed by the caller), the keys matching the prefix by their
// digit of `pass`.
template <class Reader>
__device__ __forceinline__ void CountRow(Reader& reader, const RowView& row,
                                         const RadixState& state, int pass, uint32_t* hist) {
  const int shift = PassShift(pass);
  const uint32_t digit_mask = PassDigitMask(pass);
  reader.All(row, [&](const float (&v)[kVec], const bool (&valid)[kVec], int64_t) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t key = OrderKey(v[j]);
      if (valid[j] && (key & state.mask) == state.prefix) {
        atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
      }
    }
  });
}

// One radix pass: zeroes the histogram, counts with count(hist), and chooses the threshold bin
// (ChooseThresholdBin). Returns true when the digits so far decide the selection. Every thread
// must call it (it synchronises the CTA).
template <typename Count>
__device__ __forceinline__ bool RadixPass(int pass, RadixState* state, Shared* smem, Count count) {
  for (int i = threadIdx.x; i < kBins; i += kThreads) smem->hist[i] = 0u;
  __syncthreads();
  count(smem->hist);
  __syncthreads();
  uint32_t counts[kBinsPerThread];
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    counts[j] = smem->hist[kBins - 1 - (threadIdx.x * kBinsPerThread + j)];
  }
  return ChooseThresholdBin(counts, pass, state, smem->warp_sums, &smem->chosen);
}

// Dynamic shared memory of the two builds: the candidate lists, then (kStream) the warps' stream
// stages and their mbarriers.
template <bool kStream>
inline constexpr int kKernelSmemBytes =
    kCandidateBytes + (kStream ? kStreamBytes + kWarps * kStreamStages * 8 : 0);

// One CTA per row (blockIdx.x), with kKernelSmemBytes<kStream> of dynamic shared memory. Two
// builds: two CTAs per SM reading the row into registers (LoadReader), or, with kStream, one CTA
// per SM streaming it through shared memory (StreamReader).
template <bool kStream>
__global__ void __launch_bounds__(kThreads, kStream ? 1 : 2)
    TopKPerRowKernel(const TopKParams params) {
  extern __shared__ uint4 candidate_smem[];
  __shared__ Shared smem;
  const int64_t r = blockIdx.x;
  int32_t start, end;
  RowBounds(params, r, &start, &end);
  const int64_t len = static_cast<int64_t>(end) - start;
  const int k = params.k;
  int32_t* out = params.out + r * k;

  if (len <= k) {  // block-uniform branch
    WriteWholeRow(out, len, k, threadIdx.x, kThreads);
    return;
  }

  const RowView row =
      MakeRowView(params.logits + r * static_cast<int64_t>(params.width) + start, len);
  std::conditional_t<kStream, StreamReader, LoadReader> reader;
  if constexpr (kStream) {
    uint8_t* stream_smem = reinterpret_cast<uint8_t*>(candidate_smem) + kCandidateBytes;
    uint64_t* barriers = reinterpret_cast<uint64_t*>(stream_smem + kStreamBytes);
    const int warp = threadIdx.x >> 5;
    reader.stages = reinterpret_cast<float4*>(stream_smem) + warp * kStreamStages * kStreamGroups;
    reader.full = barriers + warp * kStreamStages;
    reader.phases = 0u;
    if (threadIdx.x == 0) {
      for (int i = 0; i < kWarps * kStreamStages; ++i) sm90::InitBarrier(&barriers[i], 1);
      sm90::FenceBarrierInit();
    }
    __syncthreads();  // the barriers are initialised
  }

  // Radix passes over the row until the keys that can still be kept (those above the threshold
  // bin and in it) are few enough to gather, then the rest over the gathered candidates.
  RadixState state{0u, 0u, static_cast<uint32_t>(k)};
  const Candidates candidates{
      reinterpret_cast<uint32_t*>(candidate_smem),
      reinterpret_cast<int32_t*>(candidate_smem) + kCandidateCapacity};
  int pass = 0;
  bool decided = false, gathered = false;
  // After a pass, gathers the keys that can still be kept (those with (key & mask) >= prefix) if
  // they are few enough. Block-uniform: smem.chosen is read after ChooseThresholdBin's barriers,
  // and written again only after the next pass's.
  auto gather_if_few = [&]() {
    const uint32_t num_candidates = static_cast<uint32_t>(k) - state.remaining + smem.chosen.count;
    return num_candidates <= kGatherMaxCandidates &&
           GatherCandidates(reader, row, state.prefix, candidates, &smem);
  };
  if (len >= kSpeculateMinLen) {  // block-uniform branch
    const uint32_t min_key = EstimateGatherKey(row, k, &smem);
    bool held = false;
    decided = RadixPass(0, &state, &smem, [&](uint32_t* hist) {
      held = GatherCandidates<true>(reader, row, min_key, candidates, &smem, hist);
    });
    pass = 1;
    // The lists hold every key >= min_key; the keys that can still be kept are those >= prefix.
    gathered = (held && state.prefix >= min_key) || gather_if_few();
  }
#pragma unroll 1
  while (!gathered && pass < kNumPasses && !decided) {
    decided = RadixPass(pass, &state, &smem,
                        [&](uint32_t* hist) { CountRow(reader, row, state, pass, hist); });
    ++pass;
    gathered = gather_if_few();
  }
  if (gathered) {
#pragma unroll 1
    for (; pass < kNumPasses && !decided; ++pass) {
      decided = RadixPass(pass, &state, &smem, [&](uint32_t* hist) {
        CountCandidates(candidates, smem, state, pass, hist);
      });
    }
    CompactCandidates(candidates, &smem, state, static_cast<uint32_t>(k), out);
    return;
  }

  // Compaction in position order, a chunk of kThreads groups at a time.
  uint32_t above_seen = 0u, ties_seen = 0u;
#pragma unroll 1
  for (int64_t base = 0; base < row.groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    float v[kVec];
    bool valid[kVec] = {false, false, false, false};
    int64_t first = 0;
    if (g < row.groups) LoadGroup(row, g, v, valid, first);
    uint32_t above_mask = 0u, tie_mask = 0u;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t masked = valid[j] ? (OrderKey(v[j]) & state.mask) : 0u;
      above_mask |= static_cast<uint32_t>(valid[j] && masked > state.prefix) << j;
      tie_mask |= static_cast<uint32_t>(valid[j] && masked == state.prefix) << j;
    }
    if (CompactChunk<kVec>(above_mask, tie_mask, first, state.remaining, static_cast<uint32_t>(k),
                           &above_seen, &ties_seen, smem.warp_sums, out)) {
      break;
    }
  }
}

}  // namespace jax_sparse_mla::indexer_topk
