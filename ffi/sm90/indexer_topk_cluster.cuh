// The lightning indexer's top-k with one row spread over a thread-block cluster (SM90): the same
// exact radix select and ordered compaction as indexer_topk.cuh, the same array bit for bit, but
// the row is read from global memory once, by every CTA of its cluster, and the passes run over
// keys held in shared memory.
//
// Why: one CTA per row leaves most SMs idle at small batch (one 131072-wide row: 1 of 132 SMs) and
// rereads the row from global memory or L2 in each of its up to four passes. Here a row of len
// positions is split into C contiguous chunks, one per CTA of a cluster of C (1 to 16, chosen on the
// host from the static shape R x S by PlanCluster in indexer_topk_plan.h, so that R x C CTAs cover
// the SMs while every chunk still fits in shared memory; the chunk boundaries follow each row's
// actual length on the device). Per CTA:
//
//  1. load: its chunk's float4 groups become order-preserving keys (OrderKey) in shared memory,
//     and the first pass's histogram is built while they arrive;
//  2. radix passes (11, 11, 10 bits): each CTA histograms its own keys. Where the host left room
//     for the one-CTA kernel's candidate lists after the keys, the first pass's round is pushed
//     (PushFirstPass): every CTA adds its non-zero bins into rank 0's sum, rank 0 alone chooses
//     the threshold bin and hands it out with each CTA's place among the candidates (two cluster
//     barriers); where the candidates fit the lists, every CTA writes its own into rank 0's lists
//     and rank 0 alone ends the select over them (GatherToLeader: one more cluster barrier instead
//     of two passes and step 3). Otherwise (no room, or too many candidates) a pass's round is
//     pulled: one cluster barrier, then every CTA sums the C histograms through distributed shared
//     memory (each thread its 4 bins from each CTA, the loads in flight together) and finds the
//     same threshold bin, so all CTAs agree without a second barrier. Histograms are
//     double-buffered: a CTA clears the buffer of the next pass right after the barrier, when
//     every CTA has finished reading it;
//  3. compaction: each CTA counts its keys above the threshold and tied with it; one cluster
//     barrier; each CTA sums the counts of the CTAs before it (lower positions), which is where its
//     kept positions start in the output, then writes them in position order exactly as the
//     one-CTA kernel does (ties kept up to `needed` in position order across the whole row).
//
// A row of at most k positions writes 0 .. len - 1 and then -1 without reading its logits, each CTA
// a share of the k slots. The kernel never leaves a CTA's shared memory to be read after it exits:
// the last remote read (the counts) is followed by a cluster arrive, and each CTA waits on that
// barrier before it returns; on the leader's path, the barrier after the candidates' writes is the
// last remote access.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>
#include <type_traits>

#include "sm90/indexer_topk.cuh"
#include "sm90/indexer_topk_plan.h"

namespace jax_sparse_mla::indexer_topk {

static_assert(kGroupPositions == kVec, "the plan counts the kernel's float4 groups");

// Groups whose loads a thread issues together while loading its chunk.
constexpr int kLoadBatch = 4;
// Consecutive groups a thread compacts per chunk on long chunks: a chunk costs one block scan
// (three barriers), so 16 keys a thread take a quarter of the scans of 4.
constexpr int kCompactGroups = 4;

struct alignas(16) ClusterShared {
  union {
    uint32_t hist[2][kBins];  // pass p uses hist[p % 2]; read as uint4 by other CTAs
    // The leader's state for refining the gathered candidates (GatherToLeader): used once no
    // other CTA reads this CTA's histograms any more.
    Shared leader;
  };
  uint32_t warp_sums[kWarps];
  Threshold chosen;
  // From the leader after the first pass (PushFirstPass): the candidates in the CTAs before this
  // one and in all of them.
  uint32_t candidates_before;
  uint32_t candidates_total;
  // This CTA's keys above the threshold (high half) and tied with it (low half), read by the CTAs
  // after it: one word, so that one distributed-shared-memory load a CTA brings both.
  uint32_t kept;
};

static_assert(sizeof(Shared) <= sizeof(uint32_t) * 2 * kBins, "the leader's state fits the histograms");

// CTAs per batch of distributed-shared-memory loads in the pulled passes.
constexpr int kPullBatch = 8;

// Whether the candidate lists fit after the keys: kCandidateBytes more dynamic shared memory than
// `chunk_bytes` (the most any CTA of this row's cluster keeps for its keys), which the host adds
// where the plan's chunk leaves room for it (LaunchCluster). The same in every CTA of a cluster.
__device__ __forceinline__ bool HasCandidateRoom(int64_t chunk_bytes) {
  uint32_t dynamic_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
  return chunk_bytes + kCandidateBytes <= static_cast<int64_t>(dynamic_bytes);
}

// The first pass's cluster round where the leader's lists can take the candidates (the host left
// them room): every CTA adds its non-zero bins into the leader's (rank 0's) hist[1], which every
// CTA cleared before the cluster barrier that the kernel arrives at first, and turns its own
// histogram into counts from the top (keys in bins >= b) in place; the leader alone scans the sum
// and chooses the threshold bin, reads each CTA's count at that bin (its candidates) and hands
// every CTA the threshold, the candidates in the CTAs before it and their total.
// Why not every CTA pulling every CTA's bins, as the later passes do: that moves C x 8 KB of
// histograms into each SM through the cluster's network, where a row's keys fill a few dozen
// bins of the first digit (normal scores span a few binades), and those few adds are all the
// leader needs. The pulled round's cost grows with C; this one's does not (on an H100, 1 x 65536
// went from 15.6 to 13.9 µs at 8 CTAs, and clusters of 16, slower than 8 with the pulled round,
// took it to 12.6).
// Returns whether the first digit decides the selection; every thread of every CTA calls it.
__device__ __forceinline__ bool PushFirstPass(const cooperative_groups::cluster_group& cluster,
                                              int lowest_bin, RadixState* state,
                                              ClusterShared& smem) {
  uint32_t* own = smem.hist[0];
  __syncthreads();  // this CTA's histogram is complete
  const uint4 mine = *reinterpret_cast<const uint4*>(own + lowest_bin);
  // counts[j]: bin kBins - 1 - (threadIdx.x * kBinsPerThread + j), from the top as
  // ChooseThresholdBin takes them.
  const uint32_t counts[kBinsPerThread] = {mine.w, mine.z, mine.y, mine.x};
  cluster.barrier_wait();  // the kernel's first arrival: the leader's hist[1] is clear
  uint32_t* summed = cluster.map_shared_rank(smem.hist[1], 0);
  uint32_t owned = 0u;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    if (counts[j] != 0u) atomicAdd(summed + kBins - 1 - (threadIdx.x * kBinsPerThread + j), counts[j]);
    owned += counts[j];
  }
  uint32_t ignored;
  uint32_t from_top = BlockExclusiveSum(owned, smem.warp_sums, &ignored);
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    from_top += counts[j];
    own[kBins - 1 - (threadIdx.x * kBinsPerThread + j)] = from_top;  // only this thread's bins
  }
  cluster.sync();  // every CTA's adds are in the leader's sum, and its counts from the top are set
  const uint32_t rank = cluster.block_rank();
  bool decided = false;
  if (rank == 0) {
    uint4* sum = reinterpret_cast<uint4*>(smem.hist[1] + lowest_bin);
    const uint4 bins = *sum;
    *sum = make_uint4(0u, 0u, 0u, 0u);  // pass 1's histogram, where the cluster passes follow
    const uint32_t cluster_counts[kBinsPerThread] = {bins.w, bins.z, bins.y, bins.x};
    decided = ChooseThresholdBin(cluster_counts, 0, state, smem.warp_sums, &smem.chosen);
    if (threadIdx.x < 32) {  // lane q serves CTA q
      const uint32_t q = threadIdx.x, ctas = cluster.num_blocks();
      const uint32_t bin = state->prefix >> PassShift(0);
      const uint32_t count = q < ctas ? *cluster.map_shared_rank(smem.hist[0] + bin, q) : 0u;
      uint32_t inclusive = count;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const uint32_t other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
        if (q >= offset) inclusive += other;
      }
      const uint32_t total = __shfl_sync(0xFFFFFFFFu, inclusive, 31);
      if (q < ctas) {
        ClusterShared* target = cluster.map_shared_rank(&smem, q);
        target->candidates_before = inclusive - count;
        target->candidates_total = total;
        // The leader's own threads have read smem.chosen already (ChooseThresholdBin).
        if (q != 0) target->chosen = smem.chosen;
      }
    }
  }
  cluster.sync();  // the leader's hand-out is in every CTA
  if (rank != 0) decided = ApplyThreshold(smem.chosen, 0, state);
  return decided;
}

// After the first pass (PushFirstPass), where the keys that can still be kept ((key & mask) >=
// prefix) number at most kCandidateCapacity: each CTA writes its own, in position order, into the
// leader's (rank 0's) candidate lists at its place after the CTAs before it, one cluster barrier
// makes them visible, and the leader alone ends the select over them (the later passes and the
// compaction of the one-CTA kernel, no cluster rounds). The ordered candidates are cut into kWarps
// contiguous lists of at most kCandidatesPerWarp, the layout of the one-CTA kernel's gather. Every
// thread of every CTA calls it.
__device__ __forceinline__ void GatherToLeader(
    const cooperative_groups::cluster_group& cluster, const RadixState& state, bool decided,
    const uint32_t* keys, int lo, int hi, int64_t first_position, uint32_t* candidate_smem,
    ClusterShared& smem, int k, int32_t* out) {
  const uint32_t rank = cluster.block_rank();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t before = smem.candidates_before, total = smem.candidates_total;

  // Position order: warp w walks its contiguous slice of the slots [lo, hi) 32 at a time.
  const int per_warp = (hi - lo + kWarps - 1) / kWarps;
  const int begin = min(hi, lo + warp * per_warp), end = min(hi, begin + per_warp);
  auto is_candidate = [&](int s) { return s < end && (keys[s] & state.mask) >= state.prefix; };
  uint32_t warp_count = 0u;
  for (int base = begin; base < end; base += 32) {
    warp_count += __popc(__ballot_sync(0xFFFFFFFFu, is_candidate(base + lane)));
  }
  uint32_t ignored;
  // BlockExclusiveSum over threads: only lane 0 of each warp contributes.
  uint32_t slot = before + BlockExclusiveSum(lane == 0 ? warp_count : 0u, smem.warp_sums, &ignored);
  slot = __shfl_sync(0xFFFFFFFFu, slot, 0);
  const uint32_t per_list = (total + kWarps - 1) / kWarps;  // <= kCandidatesPerWarp
  uint32_t* leader_keys = cluster.map_shared_rank(candidate_smem, 0);
  int32_t* leader_positions =
      reinterpret_cast<int32_t*>(cluster.map_shared_rank(candidate_smem, 0)) + kCandidateCapacity;
  const uint32_t lt = LaneMaskLt();
  for (int base = begin; base < end; base += 32) {
    const int s = base + lane;
    const bool kept = is_candidate(s);
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, kept);
    if (kept) {
      const uint32_t i = slot + __popc(ballot & lt);
      const uint32_t entry = (i / per_list) * kCandidatesPerWarp + i % per_list;
      leader_keys[entry] = keys[s];
      leader_positions[entry] = static_cast<int32_t>(first_position + s);
    }
    slot += __popc(ballot);
  }
  cluster.sync();  // the candidates are in the leader's lists; no CTA reads another's memory again
  if (rank != 0) return;

  Shared& leader = smem.leader;
  if (threadIdx.x < kWarps) {
    const int64_t filled = static_cast<int64_t>(total) - static_cast<int64_t>(threadIdx.x) * per_list;
    leader.candidate_counts[threadIdx.x] =
        static_cast<uint32_t>(min(max(filled, int64_t{0}), static_cast<int64_t>(per_list)));
  }
  __syncthreads();
  const Candidates candidates{candidate_smem, reinterpret_cast<int32_t*>(candidate_smem) +
                                                  kCandidateCapacity};
  RadixState refined = state;
#pragma unroll 1
  for (int pass = 1; pass < kNumPasses && !decided; ++pass) {
    decided = RadixPass(pass, &refined, &leader, [&](uint32_t* hist) {
      CountCandidates(candidates, leader, refined, pass, hist);
    });
  }
  CompactCandidates(candidates, &leader, refined, static_cast<uint32_t>(k), out);
}

// grid (R * C), clusters of C along x: cluster r selects row r; dynamic shared memory of
// 16 * groups_capacity bytes, groups_capacity >= ceil(groups / C) for every row (the host's plan),
// and kCandidateBytes more where they fit within kMaxClusterDynamicBytes (HasCandidateRoom).
__global__ void __launch_bounds__(kThreads, 1) TopKClusterKernel(const TopKParams params) {
  namespace cg = cooperative_groups;
  __shared__ ClusterShared smem;
  extern __shared__ uint4 key_groups[];  // [groups_capacity]: key_groups[j] = group g_begin + j
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(key_groups);
  const cg::cluster_group cluster = cg::this_cluster();
  const uint32_t rank = cluster.block_rank();
  const uint32_t ctas = cluster.num_blocks();
  const int64_t r = blockIdx.x / ctas;
  int32_t start, end;
  RowBounds(params, r, &start, &end);
  const int64_t len = static_cast<int64_t>(end) - start;
  const int k = params.k;
  int32_t* out = params.out + r * k;

  if (len <= k) {  // cluster-uniform: every CTA of the row returns here, none reads another
    WriteWholeRow(out, len, k, static_cast<int64_t>(rank) * kThreads + threadIdx.x,
                  static_cast<int64_t>(ctas) * kThreads);
    return;
  }

  // This CTA's groups [g_begin, g_begin + n_groups) of the row's float4 groups; its key slot s
  // holds position first_position + s, and the slots [lo, hi) are in the row.
  const RowView row =
      MakeRowView(params.logits + r * static_cast<int64_t>(params.width) + start, len);
  const int64_t per_cta = (row.groups + ctas - 1) / ctas;
  const int64_t g_begin = min(static_cast<int64_t>(rank) * per_cta, row.groups);
  const int n_groups = static_cast<int>(min(per_cta, row.groups - g_begin));
  const int64_t first_position = g_begin * kVec - row.lead;
  const int lo = static_cast<int>(max(int64_t{0}, -first_position));
  const int hi = static_cast<int>(
      max(int64_t{0}, min(static_cast<int64_t>(n_groups) * kVec, len - first_position)));

  // The candidate lists (GatherToLeader), after the largest chunk of keys, where the host left room.
  const bool candidate_room = HasCandidateRoom(per_cta * 16);
  uint32_t* candidate_smem = reinterpret_cast<uint32_t*>(
      reinterpret_cast<uint8_t*>(key_groups) + (candidate_room ? per_cta * 16 : 0));
  // Where the lists have room, the first pass's round adds into the leader's hist[1] (PushFirstPass),
  // so every CTA clears it before its first arrival at the cluster barrier; otherwise hist[1] is
  // cleared after the first pass's barrier, like every next pass's buffer.
  for (int i = threadIdx.x; i < kBins; i += kThreads) smem.hist[0][i] = 0u;
  if (candidate_room) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) smem.hist[1][i] = 0u;
    __syncthreads();
    cluster.barrier_arrive();  // waited for in PushFirstPass, after the load
  } else {
    __syncthreads();
  }

  // 1. Load, and the first pass's histogram (no prefix to match yet). Slots outside the row hold
  // 0 and are never read. Each thread issues kLoadBatch groups' loads before it converts any (the
  // atomics between them would otherwise keep the compiler from overlapping the loads): with few
  // CTAs on a long row (batch 1) the time to bring the chunk in is set by the loads in flight.
  // Groups [j_whole, j_end) of this CTA lie wholly in the row (all but the row's first and last
  // group, where the row start or end cuts one): they are float4 loads from `whole` with no
  // per-key test; the others go through LoadGroup's element-wise path.
  const int64_t first_whole = row.lead == 0 ? 0 : 1;             // the row's first whole group
  const int64_t end_whole = (row.len + row.lead) / kVec;          // one past its last whole group
  const int j_whole = static_cast<int>(min(max(first_whole - g_begin, int64_t{0}), int64_t{n_groups}));
  const int j_end = static_cast<int>(
      min(max(end_whole - g_begin, static_cast<int64_t>(j_whole)), int64_t{n_groups}));
  const float4* whole = reinterpret_cast<const float4*>(row.data + (first_whole * kVec - row.lead)) +
                        (g_begin + j_whole - first_whole);  // group g_begin + j_whole
#pragma unroll 1
  for (int base = 0; base < n_groups; base += kLoadBatch * kThreads) {
    float v[kLoadBatch][kVec];
    bool valid[kLoadBatch][kVec];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int j = base + u * kThreads + threadIdx.x;
      if (j >= j_whole && j < j_end) {
        const float4 x = whole[j - j_whole];
        v[u][0] = x.x, v[u][1] = x.y, v[u][2] = x.z, v[u][3] = x.w;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) valid[u][e] = false;
        int64_t first;
        if (j < n_groups) LoadGroup(row, g_begin + j, v[u], valid[u], first);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int j = base + u * kThreads + threadIdx.x;
      uint32_t key[kVec];
      if (j >= j_whole && j < j_end) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          key[e] = OrderKey(v[u][e]);
          atomicAdd(&smem.hist[0][key[e] >> PassShift(0)], 1u);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          key[e] = valid[u][e] ? OrderKey(v[u][e]) : 0u;
          if (valid[u][e]) atomicAdd(&smem.hist[0][key[e] >> PassShift(0)], 1u);
        }
      }
      if (j < n_groups) key_groups[j] = make_uint4(key[0], key[1], key[2], key[3]);
    }
  }

  // 2. Radix passes over the cluster's histograms.
  RadixState state{0u, 0u, static_cast<uint32_t>(k)};
  // This thread's kBinsPerThread bins, counted from the top, are [lowest_bin, lowest_bin + 4).
  static_assert(kBinsPerThread == 4, "a thread reads its bins as one uint4");
  const int lowest_bin = kBins - kBinsPerThread * (threadIdx.x + 1);
  bool decided = false;
  int first_pulled_pass = 0;
  if (candidate_room) {
    decided = PushFirstPass(cluster, lowest_bin, &state, smem);
    if (smem.candidates_total <= static_cast<uint32_t>(kCandidateCapacity)) {  // cluster-uniform
      GatherToLeader(cluster, state, decided, keys, lo, hi, first_position, candidate_smem, smem, k,
                     out);
      return;
    }
    first_pulled_pass = 1;  // the leader cleared its hist[1]; the others never wrote theirs
  }
#pragma unroll 1
  for (int pass = first_pulled_pass; pass < kNumPasses && !decided; ++pass) {
    uint32_t* hist = smem.hist[pass & 1];
    if (pass > 0) {
      const int shift = PassShift(pass);
      const uint32_t digit_mask = PassDigitMask(pass);
      // Eight keys loaded before their atomics: the compiler cannot tell the keys from the
      // histogram (both shared memory), so a fused loop would wait for each load in turn.
      constexpr int kStaged = 8;
      int s = lo + threadIdx.x;
      for (; s + (kStaged - 1) * kThreads < hi; s += kStaged * kThreads) {
        uint32_t staged[kStaged];
#pragma unroll
        for (int u = 0; u < kStaged; ++u) staged[u] = keys[s + u * kThreads];
#pragma unroll
        for (int u = 0; u < kStaged; ++u) {
          if ((staged[u] & state.mask) == state.prefix) {
            atomicAdd(&hist[(staged[u] >> shift) & digit_mask], 1u);
          }
        }
      }
      for (; s < hi; s += kThreads) {
        const uint32_t key = keys[s];
        if ((key & state.mask) == state.prefix) atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
      }
    }
    cluster.sync();  // every CTA's histogram of this pass is complete and visible
    if (pass + 1 < kNumPasses) {
      // Every CTA read the other buffer (the previous pass's) before arriving at the barrier.
      uint32_t* next = smem.hist[(pass + 1) & 1];
      for (int i = threadIdx.x; i < kBins; i += kThreads) next[i] = 0u;
    }
    // Every CTA's 4 bins are requested before any is added, in batches of kPullBatch CTAs: a
    // distributed-shared-memory load takes hundreds of cycles, and a loop over a run-time `ctas`
    // would wait for each in turn (all 16 at once would take more registers than the kernel has).
    uint32_t counts[kBinsPerThread] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int first = 0; first < kMaxFastClusterSize; first += kPullBatch) {
      if (first >= static_cast<int>(ctas)) break;
      uint4 remote[kPullBatch];
#pragma unroll
      for (int i = 0; i < kPullBatch; ++i) {
        if (first + i < ctas) {
          remote[i] =
              *reinterpret_cast<const uint4*>(cluster.map_shared_rank(hist + lowest_bin, first + i));
        }
      }
#pragma unroll
      for (int i = 0; i < kPullBatch; ++i) {
        if (first + i < ctas) {
          counts[0] += remote[i].w;  // bin lowest_bin + 3 = kBins - 1 - 4 t
          counts[1] += remote[i].z;
          counts[2] += remote[i].y;
          counts[3] += remote[i].x;
        }
      }
    }
    // The same sums in every CTA, so every CTA chooses the same bin and exits at the same pass.
    decided = ChooseThresholdBin(counts, pass, &state, smem.warp_sums, &smem.chosen);
  }

  // 3. Compaction. This CTA's counts, published for the CTAs after it.
  // Group j's flags go to bits [offset, offset + kVec) of *above / *tie. Slot s is in the row when
  // s - lo < row_slots as unsigned numbers (one compare).
  const uint32_t row_slots = static_cast<uint32_t>(max(hi - lo, 0));
  auto classify = [&](int j, uint32_t* above, uint32_t* tie, int offset) {
    const uint4 group = j < n_groups ? key_groups[j] : make_uint4(0u, 0u, 0u, 0u);
    const uint32_t key[kVec] = {group.x, group.y, group.z, group.w};
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int s = j * kVec + e;
      const bool in_row = static_cast<uint32_t>(s - lo) < row_slots;
      const uint32_t masked = key[e] & state.mask;
      *above |= static_cast<uint32_t>(in_row && masked > state.prefix) << (offset + e);
      *tie |= static_cast<uint32_t>(in_row && masked == state.prefix) << (offset + e);
    }
  };
  uint32_t n_above = 0u, n_tie = 0u;
#pragma unroll 4
  for (int j = threadIdx.x; j < n_groups; j += kThreads) {
    uint32_t above = 0u, tie = 0u;
    classify(j, &above, &tie, 0);
    n_above += __popc(above);
    n_tie += __popc(tie);
  }
  // Both counts in one scanned word: a CTA holds at most kMaxClusterGroupsPerCta * 4 < 2^16 keys.
  static_assert(kMaxClusterGroupsPerCta * kVec < (1 << 16));
  uint32_t totals;
  BlockExclusiveSum((n_above << 16) | n_tie, smem.warp_sums, &totals);
  if (threadIdx.x == 0) smem.kept = totals;
  cluster.sync();
  uint32_t above_seen = 0u, ties_seen = 0u;  // in the CTAs before this one
  uint32_t remote_kept[kMaxFastClusterSize];  // all requested first
#pragma unroll
  for (int q = 0; q < kMaxFastClusterSize; ++q) {
    if (q < rank) remote_kept[q] = *cluster.map_shared_rank(&smem.kept, q);
  }
#pragma unroll
  for (int q = 0; q < kMaxFastClusterSize; ++q) {
    if (q < rank) {
      above_seen += remote_kept[q] >> 16;  // halves summed apart: 16 CTAs' ties may pass 2^16
      ties_seen += remote_kept[q] & 0xFFFFu;
    }
  }
  // The last read of another CTA's shared memory: CTAs may leave once everyone has arrived.
  cluster.barrier_arrive();

  const uint32_t want = static_cast<uint32_t>(k);
  if (above_seen + min(ties_seen, state.remaining) < want) {
    // Chunks of G * kThreads groups, thread t taking G consecutive ones so that thread order is
    // position order: G = kCompactGroups where the CTA's chunk fills such chunks, else 1 (on
    // short chunks a thread's serial work would outweigh the barriers saved).
    const auto compact = [&](auto groups_per_thread) {
      constexpr int kGroups = decltype(groups_per_thread)::value;
      constexpr int kKeys = kGroups * kVec;
#pragma unroll 1
      for (int base = 0; base < n_groups; base += kGroups * kThreads) {
        uint32_t above = 0u, tie = 0u;
        const int j0 = base + threadIdx.x * kGroups;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) classify(j0 + g, &above, &tie, g * kVec);
        const int64_t first = first_position + static_cast<int64_t>(j0) * kVec;
        if (CompactChunk<kKeys>(above, tie, first, state.remaining, want, &above_seen, &ties_seen,
                                smem.warp_sums, out)) {
          break;
        }
      }
    };
    if (n_groups >= kCompactGroups * kThreads) {
      compact(std::integral_constant<int, kCompactGroups>{});
    } else {
      compact(std::integral_constant<int, 1>{});
    }
  }
  cluster.barrier_wait();
}

}  // namespace jax_sparse_mla::indexer_topk
