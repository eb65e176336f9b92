// The top-k index conversion (jax_sparse_mla/ops/index_conversion.py) as CUDA kernels: request
// positions [T, K] -> physical cache slots through the request's block table, with the DCP owner
// filter, the prefill workspace rows, valid counts and stable compaction. Per element (N = dcp_size,
// I = interleave, r = rank):
//
//   owner = (tok / I) % N                 local = (tok / (N*I)) * I + tok % I
//   blk, off = divmod(local, block_size)  phys  = block_table[req, blk] * block_size + off
//   prefill workspace row (pref_id >= 0): phys  = workspace_starts[pref_id] + tok
//   invalid = tok < 0 | (not prefill & (blk >= W | owner != r))     -> -1
//
// The kernels stream two int32 arrays and gather from a small table, so what decides their speed is
// how many loads each thread has in flight and how few instructions an element costs:
//  * every thread maps kElemsPerThread = 8 positions (two 16-byte vectors, both loaded before any
//    is converted), and every lane reads its table entry at a clamped, in-bounds block whether or
//    not the position is valid, so the eight gathers issue together with no per-lane branch;
//  * the divisors are runtime attributes, divided by multiply-high and shift (fast_divmod.h), and
//    tok / (N*I) is computed as (tok / I) / N, which needs only the two divisions owner needs anyway.
//
// Two kernels: a tile kernel for the in-place conversion without counts (a CTA maps a
// kTileElems-wide slice of one row, so small batches still fill the GPU) and a row kernel for
// counts and/or compaction (a CTA walks its row in tiles; a block-wide scan of each tile's valid
// counts gives every kept slot its place, so the pack is stable without atomics; the tail is then
// filled with -1). K is a multiple of 4 (the handler checks it), and rows start 16-byte aligned,
// so a 4-element vector never straddles a row or the row's end.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "common/fast_divmod.h"

namespace jax_sparse_mla::index_conversion {

struct ConversionParams {
  const int32_t* req_id;       // [T]
  const int32_t* block_table;  // [R, W]
  const int32_t* tokens;       // [T, K]
  const int32_t* rank;         // [1] this DCP rank (read when dcp_size > 1)
  const int32_t* pref_ids;     // [T] or nullptr
  const int32_t* pref_starts;  // [P] or nullptr (P = 0)
  int32_t* out;                // [T, K]
  int32_t* counts;             // [T] or nullptr
  int64_t top_k;               // K
  int32_t num_reqs;            // R
  int32_t table_width;         // W
  int32_t num_starts;          // P
  FastDivmod block_size;
  FastDivmod dcp_size;         // N
  FastDivmod interleave;       // I
};

constexpr int kThreads = 256;
constexpr int kVec = 4;                                      // int32 per 16-byte access
constexpr int kVecsPerThread = 2;
constexpr int kElemsPerThread = kVec * kVecsPerThread;       // 8
constexpr int kTileElems = kThreads * kElemsPerThread;       // 2048 positions per CTA tile

// What every element of one row shares: the request's table row, the rank, the workspace flag and
// start.
struct RowState {
  const int32_t* table;  // block_table[req] (nullptr when the table has no entry to read)
  int32_t rank;
  bool is_pref;
  int32_t start;
};

__device__ __forceinline__ RowState LoadRow(const ConversionParams& p, int64_t row) {
  RowState s;
  // Request ids are trusted but clipped, as the pure-JAX version does, so a bad id cannot read
  // outside the table. An empty table (R = 0 or W = 0) reads nothing: every position is then out
  // of width (blk >= W) or, with R = 0, reads the entry 0, as in the pure-JAX version.
  const int32_t req = min(max(p.req_id[row], 0), max(p.num_reqs - 1, 0));
  s.table = p.num_reqs > 0 && p.table_width > 0
                ? p.block_table + static_cast<int64_t>(req) * p.table_width
                : nullptr;
  s.rank = p.dcp_size.divisor > 1 ? p.rank[0] : 0;
  s.is_pref = false;
  s.start = 0;
  if (p.pref_ids != nullptr) {
    const int32_t pref_id = p.pref_ids[row];
    s.is_pref = pref_id >= 0;
    if (p.num_starts > 0) s.start = p.pref_starts[min(max(pref_id, 0), p.num_starts - 1)];
  }
  return s;
}

// One position -> its slot or -1; *valid says which. Products and sums wrap as int32 (JAX's
// arithmetic), computed unsigned so that the wrap is defined. No branch depends on the lane:
// dcp_size and is_pref are the same for the whole CTA.
__device__ __forceinline__ int32_t Convert(const ConversionParams& p, const RowState& s,
                                           int32_t tok, bool* valid) {
  if (s.is_pref) {
    *valid = tok >= 0;
    return *valid ? static_cast<int32_t>(static_cast<uint32_t>(s.start) +
                                         static_cast<uint32_t>(tok))
                  : -1;
  }
  const uint32_t pos = static_cast<uint32_t>(max(tok, 0));
  uint32_t local = pos;
  bool remote = false;
  if (p.dcp_size.divisor > 1) {
    uint32_t group_index, in_group, owner_group, owner;
    p.interleave.DivMod(pos, &group_index, &in_group);        // tok / I, tok % I
    p.dcp_size.DivMod(group_index, &owner_group, &owner);     // tok / (N*I), (tok / I) % N
    local = owner_group * p.interleave.divisor + in_group;    // <= pos: no overflow
    remote = static_cast<int32_t>(owner) != s.rank;
  }
  uint32_t blk, off;
  p.block_size.DivMod(local, &blk, &off);
  const bool in_width = blk < static_cast<uint32_t>(p.table_width);
  const int32_t entry =
      s.table == nullptr
          ? 0
          : __ldg(s.table + min(blk, static_cast<uint32_t>(p.table_width) - 1u));
  *valid = tok >= 0 && !remote && in_width;
  return *valid ? static_cast<int32_t>(static_cast<uint32_t>(entry) * p.block_size.divisor + off)
                : -1;
}

// Loads the thread's vectors of the tile at `tile` (kVecsPerThread vectors kThreads * kVec apart,
// so each load instruction of a warp reads 512 contiguous bytes) and converts them.
// in_row[v]: vector v lies inside the row (K % 4 == 0: all of it or none).
__device__ __forceinline__ void ConvertTile(const ConversionParams& p, const RowState& s,
                                            const int32_t* tokens, int64_t tile,
                                            bool (&in_row)[kVecsPerThread],
                                            int32_t (&vals)[kElemsPerThread],
                                            bool (&valid)[kElemsPerThread]) {
  int4 tok[kVecsPerThread];
#pragma unroll
  for (int v = 0; v < kVecsPerThread; ++v) {
    const int64_t col = tile + v * (kThreads * kVec) + threadIdx.x * kVec;
    in_row[v] = col < p.top_k;
    tok[v] = in_row[v] ? __ldg(reinterpret_cast<const int4*>(tokens + col))
                       : make_int4(-1, -1, -1, -1);
  }
#pragma unroll
  for (int v = 0; v < kVecsPerThread; ++v) {
    vals[v * kVec + 0] = Convert(p, s, tok[v].x, &valid[v * kVec + 0]);
    vals[v * kVec + 1] = Convert(p, s, tok[v].y, &valid[v * kVec + 1]);
    vals[v * kVec + 2] = Convert(p, s, tok[v].z, &valid[v * kVec + 2]);
    vals[v * kVec + 3] = Convert(p, s, tok[v].w, &valid[v * kVec + 3]);
  }
}

__device__ __forceinline__ void StoreTile(int32_t* out, int64_t tile,
                                          const bool (&in_row)[kVecsPerThread],
                                          const int32_t (&vals)[kElemsPerThread]) {
#pragma unroll
  for (int v = 0; v < kVecsPerThread; ++v) {
    if (!in_row[v]) continue;
    const int64_t col = tile + v * (kThreads * kVec) + threadIdx.x * kVec;
    *reinterpret_cast<int4*>(out + col) =
        make_int4(vals[v * kVec], vals[v * kVec + 1], vals[v * kVec + 2], vals[v * kVec + 3]);
  }
}

// grid (T * tiles_per_row): in place, no counts; CTA b maps tile b % tiles_per_row of row
// b / tiles_per_row.
__global__ void __launch_bounds__(kThreads) ConvertTileKernel(const ConversionParams p,
                                                              int64_t tiles_per_row) {
  const int64_t row = blockIdx.x / tiles_per_row;
  const int64_t tile = (blockIdx.x % tiles_per_row) * kTileElems;
  const RowState s = LoadRow(p, row);
  bool in_row[kVecsPerThread];
  int32_t vals[kElemsPerThread];
  bool valid[kElemsPerThread];
  ConvertTile(p, s, p.tokens + row * p.top_k, tile, in_row, vals, valid);
  StoreTile(p.out + row * p.top_k, tile, in_row, vals);
}

// grid (T): one CTA walks its row in tiles of kTileElems; counts and/or stable compaction.
template <bool kCompact>
__global__ void __launch_bounds__(kThreads) ConvertRowKernel(const ConversionParams p) {
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int64_t row = blockIdx.x;
  const RowState s = LoadRow(p, row);
  const int32_t* tokens = p.tokens + row * p.top_k;
  int32_t* out = p.out + row * p.top_k;
  int64_t kept = 0;  // valid slots before this tile, the same in every thread
  for (int64_t tile = 0; tile < p.top_k; tile += kTileElems) {
    bool in_row[kVecsPerThread];
    int32_t vals[kElemsPerThread];
    bool valid[kElemsPerThread];
    ConvertTile(p, s, tokens, tile, in_row, vals, valid);
    int before = 0, in_tile = 0;
    // Thread t's elements are not contiguous (two vectors kThreads * kVec apart), so the scan runs
    // per vector: vector 0 of every thread precedes vector 1 of every thread in column order.
    if constexpr (kCompact) {
      int64_t dest = kept;
#pragma unroll
      for (int v = 0; v < kVecsPerThread; ++v) {
        const int in_vec = valid[v * kVec] + valid[v * kVec + 1] + valid[v * kVec + 2] +
                           valid[v * kVec + 3];
        BlockScan(scan_storage).ExclusiveSum(in_vec, before, in_tile);
        int64_t at = dest + before;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          if (valid[v * kVec + i]) out[at++] = vals[v * kVec + i];
        }
        dest += in_tile;
        __syncthreads();  // scan_storage is reused by the next scan
      }
      kept = dest;
    } else {
      StoreTile(out, tile, in_row, vals);
      int mine = 0;
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) mine += valid[i];
      BlockScan(scan_storage).ExclusiveSum(mine, before, in_tile);
      kept += in_tile;
      __syncthreads();  // scan_storage is reused by the next tile's scan
    }
  }
  if constexpr (kCompact) {
    // The tail [kept, K) is -1. The scatter above wrote only below `kept`: disjoint columns.
    for (int64_t col = kept + threadIdx.x; col < p.top_k; col += kThreads) out[col] = -1;
  }
  if (p.counts != nullptr && threadIdx.x == 0) p.counts[row] = static_cast<int32_t>(kept);
}

}  // namespace jax_sparse_mla::index_conversion
