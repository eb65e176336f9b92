// The per-position rule of the top-k index conversion (jax_sparse_mla/ops/index_conversion.py), as
// the CUDA kernels of index_conversion.cuh apply it: request positions -> physical cache slots
// through the request's block table, with the DCP owner filter and the prefill workspace rows. Per
// element (N = dcp_size, I = interleave, r = rank):
//
//   owner = (tok / I) % N                 local = (tok / (N*I)) * I + tok % I
//   blk, off = divmod(local, block_size)  phys  = block_table[req, blk] * block_size + off
//   prefill workspace row (pref_id >= 0): phys  = workspace_starts[pref_id] + tok
//   invalid = tok < 0 | (not prefill & (blk >= W | owner != r))     -> -1
//
// Header-only and usable from host code, so a CPU test compiles this very code
// (tests/kernels/test_index_conversion_rule_cpu.py).
#pragma once

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

// What every element of one row shares: the request's table row, the rank, the workspace flag and
// start.
struct RowState {
  const int32_t* table;  // block_table[req] (nullptr when the table has no entry to read)
  int32_t rank;
  bool is_pref;
  int32_t start;
};

JAX_SPARSE_MLA_HOST_DEVICE int32_t ClampInt(int32_t x, int32_t lo, int32_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

JAX_SPARSE_MLA_HOST_DEVICE RowState LoadRow(const ConversionParams& p, int64_t row) {
  RowState s;
  // Request ids are trusted but clipped, as the pure-JAX version does, so a bad id cannot read
  // outside the table. An empty table (R = 0 or W = 0) reads nothing: every position is then out
  // of width (blk >= W) or, with R = 0, reads the entry 0, as in the pure-JAX version.
  const int32_t req = ClampInt(p.req_id[row], 0, p.num_reqs > 0 ? p.num_reqs - 1 : 0);
  s.table = p.num_reqs > 0 && p.table_width > 0
                ? p.block_table + static_cast<int64_t>(req) * p.table_width
                : nullptr;
  s.rank = p.dcp_size.divisor > 1 ? p.rank[0] : 0;
  s.is_pref = false;
  s.start = 0;
  if (p.pref_ids != nullptr) {
    const int32_t pref_id = p.pref_ids[row];
    s.is_pref = pref_id >= 0;
    if (p.num_starts > 0) s.start = p.pref_starts[ClampInt(pref_id, 0, p.num_starts - 1)];
  }
  return s;
}

// kN positions of one row -> their slots (vals, -1 where invalid) and valid flags. gather(b)
// returns row.table[b] for a block b in [0, W). Products and sums wrap as int32 (JAX's arithmetic),
// computed unsigned so that the wrap is defined.
//
// The branches here depend only on the row (is_pref, dcp_size, whether the table is empty), and
// each one holds a whole loop over the kN positions rather than sitting inside a per-position
// loop: so the kN table gathers are one straight run of loads, all in flight together on a GPU
// thread. With the branches inside the loop, the compiler emitted each gather behind its own branch
// and waited for it before the next position's (kN dependent round trips per thread).
template <int kN, typename Gather>
JAX_SPARSE_MLA_HOST_DEVICE void ConvertPositions(const ConversionParams& p, const RowState& s,
                                                 const int32_t (&tok)[kN], Gather gather,
                                                 int32_t (&vals)[kN], bool (&valid)[kN]) {
  if (s.is_pref) {
    for (int i = 0; i < kN; ++i) {
      valid[i] = tok[i] >= 0;
      vals[i] = valid[i] ? static_cast<int32_t>(static_cast<uint32_t>(s.start) +
                                                static_cast<uint32_t>(tok[i]))
                         : -1;
    }
    return;
  }
  uint32_t local[kN];
  bool remote[kN];
  if (p.dcp_size.divisor > 1) {
    for (int i = 0; i < kN; ++i) {
      const uint32_t pos = static_cast<uint32_t>(tok[i] > 0 ? tok[i] : 0);
      uint32_t group_index, in_group, owner_group, owner;
      p.interleave.DivMod(pos, &group_index, &in_group);       // tok / I, tok % I
      p.dcp_size.DivMod(group_index, &owner_group, &owner);    // tok / (N*I), (tok / I) % N
      local[i] = owner_group * p.interleave.divisor + in_group;  // <= pos: no overflow
      remote[i] = static_cast<int32_t>(owner) != s.rank;
    }
  } else {
    for (int i = 0; i < kN; ++i) {
      local[i] = static_cast<uint32_t>(tok[i] > 0 ? tok[i] : 0);
      remote[i] = false;
    }
  }
  uint32_t blk[kN], off[kN];
  for (int i = 0; i < kN; ++i) p.block_size.DivMod(local[i], &blk[i], &off[i]);
  const uint32_t width = static_cast<uint32_t>(p.table_width);
  int32_t entry[kN];
  if (s.table != nullptr) {
    // Every position reads an entry at a clamped, in-bounds block, valid or not: no per-position
    // branch around the loads.
    for (int i = 0; i < kN; ++i) entry[i] = gather(blk[i] < width ? blk[i] : width - 1u);
  } else {
    for (int i = 0; i < kN; ++i) entry[i] = 0;
  }
  for (int i = 0; i < kN; ++i) {
    valid[i] = tok[i] >= 0 && !remote[i] && blk[i] < width;
    vals[i] = valid[i] ? static_cast<int32_t>(static_cast<uint32_t>(entry[i]) *
                                                  p.block_size.divisor +
                                              off[i])
                       : -1;
  }
}

}  // namespace jax_sparse_mla::index_conversion
