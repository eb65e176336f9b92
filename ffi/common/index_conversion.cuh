// The top-k index conversion (jax_sparse_mla/ops/index_conversion.py) as CUDA kernels: request
// positions [T, K] -> physical cache slots through the request's block table, with the DCP owner
// filter, the prefill workspace rows, valid counts and stable compaction; the per-position rule is
// index_conversion_rule.h.
//
// The kernels stream two int32 arrays and gather from a small table, so what decides their speed is
// how many loads each thread has in flight and how few instructions an element costs:
//  * every thread maps kElemsPerThread = 8 positions (two 16-byte vectors, both loaded before any
//    is converted), and its eight table gathers are one straight run of loads with no branch
//    between them (ConvertPositions), so they are in flight together;
//  * the divisors are runtime attributes, divided by multiply-high and shift (fast_divmod.h), and
//    tok / (N*I) is computed as (tok / I) / N, which needs only the two divisions owner needs anyway.
//
// Two kernels: a tile kernel for the in-place conversion without counts (a CTA maps a
// kTileElems-wide slice of one row, so small batches still fill the GPU) and a row kernel for
// counts and/or compaction (a CTA walks its row in tiles; a block-wide scan of each tile's valid
// counts gives every kept slot its place, so the pack is stable without atomics; the kept slots
// are gathered in shared memory and written out with coalesced stores, -1 after them). K is a
// multiple of 4 (the handler checks it), and rows start 16-byte aligned, so a 4-element vector
// never straddles a row or the row's end.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "common/index_conversion_rule.h"

namespace jax_sparse_mla::index_conversion {

constexpr int kThreads = 256;
constexpr int kVec = 4;                                      // int32 per 16-byte access
constexpr int kVecsPerThread = 2;
constexpr int kElemsPerThread = kVec * kVecsPerThread;       // 8
constexpr int kTileElems = kThreads * kElemsPerThread;       // 2048 positions per CTA tile

// A thread's share of one tile: kVecsPerThread vectors kThreads * kVec apart, so each load
// instruction of a warp reads 512 contiguous bytes. in_row[v]: vector v lies inside the row
// (K % 4 == 0: all of it or none).
struct TileSlice {
  int4 tok[kVecsPerThread];
  bool in_row[kVecsPerThread];
  int32_t vals[kElemsPerThread];
  bool valid[kElemsPerThread];

  __device__ __forceinline__ static int64_t Column(int64_t tile, int v) {
    return tile + v * (kThreads * kVec) + threadIdx.x * kVec;
  }

  // Issues the loads of the slice's positions. Called before LoadRow, so that these loads and the
  // row's request id are in flight together rather than one after the other.
  __device__ __forceinline__ void Load(const ConversionParams& p, const int32_t* tokens,
                                       int64_t tile) {
#pragma unroll
    for (int v = 0; v < kVecsPerThread; ++v) {
      const int64_t col = Column(tile, v);
      in_row[v] = col < p.top_k;
      tok[v] = in_row[v] ? __ldg(reinterpret_cast<const int4*>(tokens + col))
                         : make_int4(-1, -1, -1, -1);
    }
  }

  __device__ __forceinline__ void Convert(const ConversionParams& p, const RowState& s) {
    int32_t positions[kElemsPerThread];
#pragma unroll
    for (int v = 0; v < kVecsPerThread; ++v) {
      positions[v * kVec + 0] = tok[v].x;
      positions[v * kVec + 1] = tok[v].y;
      positions[v * kVec + 2] = tok[v].z;
      positions[v * kVec + 3] = tok[v].w;
    }
    const int32_t* table = s.table;
    ConvertPositions(p, s, positions, [table](uint32_t block) { return __ldg(table + block); },
                     vals, valid);
  }

  __device__ __forceinline__ void Store(int32_t* out, int64_t tile) const {
#pragma unroll
    for (int v = 0; v < kVecsPerThread; ++v) {
      if (!in_row[v]) continue;
      *reinterpret_cast<int4*>(out + Column(tile, v)) =
          make_int4(vals[v * kVec], vals[v * kVec + 1], vals[v * kVec + 2], vals[v * kVec + 3]);
    }
  }
};

// grid (T * tiles_per_row): in place, no counts; CTA b maps tile b % tiles_per_row of row
// b / tiles_per_row (32-bit, by multiply-high: a 64-bit division would cost more than the tile's
// own arithmetic at small T).
__global__ void __launch_bounds__(kThreads) ConvertTileKernel(const ConversionParams p,
                                                              FastDivmod tiles_per_row) {
  uint32_t row, tile_in_row;
  tiles_per_row.DivMod(blockIdx.x, &row, &tile_in_row);
  const int64_t tile = int64_t{tile_in_row} * kTileElems;
  TileSlice slice;
  slice.Load(p, p.tokens + row * p.top_k, tile);
  slice.Convert(p, LoadRow(p, row));
  slice.Store(p.out + row * p.top_k, tile);
}

// grid (T): one CTA walks its row in tiles of kTileElems; counts and/or stable compaction.
//
// Compaction: one block scan per tile places every kept slot. Each thread's two vectors are
// counted in one scanned word (vector 0's count in the low 16 bits, vector 1's in the high: a
// tile holds at most 1024 elements of each, so the halves never carry into each other), because
// vector 0 of every thread precedes vector 1 of every thread in column order. The kept slots are
// gathered in shared memory first, so the row is written with coalesced stores: when the row is a
// single tile (K <= kTileElems, the decode case), the whole row, kept slots then -1, goes out in
// 16-byte stores and no tail pass is needed.
template <bool kCompact>
__global__ void __launch_bounds__(kThreads) ConvertRowKernel(const ConversionParams p) {
  // Warp scans, not the default raking: one barrier, no serial raking step (the row kernel is
  // latency-bound at small T).
  using BlockScan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using BlockReduce = cub::BlockReduce<int, kThreads>;
  __shared__ union {
    typename BlockScan::TempStorage scan;
    typename BlockReduce::TempStorage reduce;
  } storage;
  __shared__ alignas(16) int32_t kept_slots[kCompact ? kTileElems : 1];  // the tile's, in order
  const int64_t row = blockIdx.x;
  const int32_t* tokens = p.tokens + row * p.top_k;
  TileSlice slice;
  slice.Load(p, tokens, 0);  // in flight with the row's request id (K >= 1: the handler checks)
  const RowState s = LoadRow(p, row);
  int32_t* out = p.out + row * p.top_k;
  const bool single_tile = p.top_k <= kTileElems;
  int64_t kept = 0;  // valid slots before this tile (in compaction, the same in every thread)
  for (int64_t tile = 0; tile < p.top_k; tile += kTileElems) {
    if (tile > 0) slice.Load(p, tokens, tile);
    slice.Convert(p, s);
    const bool(&valid)[kElemsPerThread] = slice.valid;
    const int32_t(&vals)[kElemsPerThread] = slice.vals;
    if constexpr (kCompact) {
      static_assert(kVecsPerThread == 2 && kThreads * kVec < (1 << 16));
      const int in_vec0 = valid[0] + valid[1] + valid[2] + valid[3];
      const int in_vec1 = valid[4] + valid[5] + valid[6] + valid[7];
      int before, total;
      BlockScan(storage.scan).ExclusiveSum(in_vec0 | (in_vec1 << 16), before, total);
      const int total0 = total & 0xffff, in_tile = total0 + (total >> 16);
      int at[kVecsPerThread] = {before & 0xffff, total0 + (before >> 16)};
#pragma unroll
      for (int v = 0; v < kVecsPerThread; ++v) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          if (valid[v * kVec + i]) kept_slots[at[v]++] = vals[v * kVec + i];
        }
      }
      __syncthreads();  // kept_slots is complete
      if (single_tile) {
        for (int col = threadIdx.x * kVec; col < p.top_k; col += kThreads * kVec) {
          // One 16-byte shared load (words at or past in_tile hold nothing kept, and become -1).
          int4 slots = *reinterpret_cast<const int4*>(kept_slots + col);
          slots.x = col + 0 < in_tile ? slots.x : -1;
          slots.y = col + 1 < in_tile ? slots.y : -1;
          slots.z = col + 2 < in_tile ? slots.z : -1;
          slots.w = col + 3 < in_tile ? slots.w : -1;
          *reinterpret_cast<int4*>(out + col) = slots;
        }
      } else {
        for (int j = threadIdx.x; j < in_tile; j += kThreads) out[kept + j] = kept_slots[j];
        __syncthreads();  // kept_slots and the scan storage are reused by the next tile
      }
      kept += in_tile;
    } else {
      slice.Store(out, tile);
      int mine = 0;
#pragma unroll
      for (int i = 0; i < kElemsPerThread; ++i) mine += valid[i];
      kept += BlockReduce(storage.reduce).Sum(mine);  // meaningful in thread 0 only
      __syncthreads();  // the reduce storage is reused by the next tile's reduction
    }
  }
  if constexpr (kCompact) {
    // Rows of several tiles: the tail [kept, K) is -1. The copies above wrote only below `kept`:
    // disjoint columns.
    if (!single_tile) {
      for (int64_t col = kept + threadIdx.x; col < p.top_k; col += kThreads) out[col] = -1;
    }
  }
  if (p.counts != nullptr && threadIdx.x == 0) p.counts[row] = static_cast<int32_t>(kept);
}

}  // namespace jax_sparse_mla::index_conversion
