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
// Two kernels: a tile kernel for the in-place conversion without counts (a CTA maps a
// kTileElems-wide slice of one row, 16-byte loads and stores, so small batches still fill the GPU)
// and a row kernel for counts and/or compaction (a CTA walks its row in tiles; a block-wide scan
// of each tile's valid flags gives every kept slot its place, so the pack is stable without
// atomics; the tail is then filled with -1). K is a multiple of 128 (the public functions check
// it), so every row starts 512-byte aligned and 4-element vectors never straddle rows.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cstdint>

namespace jax_sparse_mla::index_conversion {

struct ConversionParams {
  const int32_t* req_id;      // [T]
  const int32_t* block_table;  // [R, W]
  const int32_t* tokens;      // [T, K]
  const int32_t* rank;        // [1] this DCP rank (read when dcp_size > 1)
  const int32_t* pref_ids;    // [T] or nullptr
  const int32_t* pref_starts;  // [P] or nullptr (P = 0)
  int32_t* out;               // [T, K]
  int32_t* counts;            // [T] or nullptr
  int64_t top_k;              // K
  int32_t num_reqs;           // R
  int32_t table_width;        // W
  int32_t num_starts;         // P
  int32_t block_size;
  int32_t dcp_size;           // N
  int32_t interleave;         // I
};

constexpr int kThreads = 256;
constexpr int kVec = 4;                          // int32 per 16-byte access
constexpr int kTileElems = kThreads * kVec;      // 1024 positions per CTA tile

// What every element of one row shares: the clipped request, the rank, the workspace flag and start.
struct RowState {
  int32_t req;
  int32_t rank;
  bool is_pref;
  int32_t start;
};

__device__ __forceinline__ RowState LoadRow(const ConversionParams& p, int64_t row) {
  RowState s;
  // Request ids are trusted but clipped, as the pure-JAX version does, so a bad id cannot read
  // outside the table.
  s.req = min(max(p.req_id[row], 0), max(p.num_reqs - 1, 0));
  s.rank = p.dcp_size > 1 ? p.rank[0] : 0;
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
// arithmetic), computed unsigned so that the wrap is defined.
__device__ __forceinline__ int32_t Convert(const ConversionParams& p, const RowState& s,
                                           int32_t tok, bool* valid) {
  const int32_t pos = max(tok, 0);  // non-negative: truncating division is floor division
  int32_t local = pos;
  bool rejected = false;
  if (p.dcp_size > 1) {
    const int32_t group = p.dcp_size * p.interleave;
    local = (pos / group) * p.interleave + pos % p.interleave;
    rejected = (pos / p.interleave) % p.dcp_size != s.rank;
  }
  const int32_t blk = local / p.block_size;
  const int32_t off = local % p.block_size;
  rejected = rejected || blk >= p.table_width;
  if (s.is_pref) rejected = false;
  *valid = tok >= 0 && !rejected;
  if (!*valid) return -1;
  if (s.is_pref) {
    return static_cast<int32_t>(static_cast<uint32_t>(s.start) + static_cast<uint32_t>(tok));
  }
  // An empty table (R = 0) has no entry to read: 0, as in the pure-JAX version.
  const int32_t entry =
      p.num_reqs == 0 ? 0 : __ldg(p.block_table + static_cast<int64_t>(s.req) * p.table_width + blk);
  return static_cast<int32_t>(static_cast<uint32_t>(entry) * static_cast<uint32_t>(p.block_size) +
                              static_cast<uint32_t>(off));
}

// grid (ceil(K / kTileElems), T): in place, no counts.
__global__ void __launch_bounds__(kThreads) ConvertTileKernel(const ConversionParams p) {
  const int64_t row = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileElems + threadIdx.x * kVec;
  if (col >= p.top_k) return;
  const RowState s = LoadRow(p, row);
  const int64_t at = row * p.top_k + col;
  const int4 tok = __ldg(reinterpret_cast<const int4*>(p.tokens + at));
  bool valid;
  int4 out;
  out.x = Convert(p, s, tok.x, &valid);
  out.y = Convert(p, s, tok.y, &valid);
  out.z = Convert(p, s, tok.z, &valid);
  out.w = Convert(p, s, tok.w, &valid);
  *reinterpret_cast<int4*>(p.out + at) = out;
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
    const int64_t col = tile + threadIdx.x * kVec;
    const bool in_row = col < p.top_k;
    int32_t vals[kVec];
    bool valid[kVec] = {false, false, false, false};
    if (in_row) {
      const int4 tok = __ldg(reinterpret_cast<const int4*>(tokens + col));
      vals[0] = Convert(p, s, tok.x, &valid[0]);
      vals[1] = Convert(p, s, tok.y, &valid[1]);
      vals[2] = Convert(p, s, tok.z, &valid[2]);
      vals[3] = Convert(p, s, tok.w, &valid[3]);
    }
    const int mine = valid[0] + valid[1] + valid[2] + valid[3];
    int before = 0, in_tile = 0;
    BlockScan(scan_storage).ExclusiveSum(mine, before, in_tile);
    if constexpr (kCompact) {
      int64_t dest = kept + before;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (valid[i]) out[dest++] = vals[i];
      }
    } else if (in_row) {
      *reinterpret_cast<int4*>(out + col) = make_int4(vals[0], vals[1], vals[2], vals[3]);
    }
    kept += in_tile;
    __syncthreads();  // scan_storage is reused by the next tile's scan
  }
  if constexpr (kCompact) {
    // The tail [kept, K) is -1. The scatter above wrote only below `kept`: disjoint columns.
    for (int64_t col = kept + threadIdx.x; col < p.top_k; col += kThreads) out[col] = -1;
  }
  if (p.counts != nullptr && threadIdx.x == 0) p.counts[row] = static_cast<int32_t>(kept);
}

}  // namespace jax_sparse_mla::index_conversion
