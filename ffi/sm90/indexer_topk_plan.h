// How the cluster top-k (indexer_topk_cluster.cuh) splits rows: host code only, so that a CPU test
// compiles it (tests/kernels/test_sm90_indexer_topk_cluster_cpu.py) and checks it against the
// Python side's limit (kernels/sm90_indexer_topk.py: MAX_CLUSTER_WIDTH).
#pragma once

#include <cstdint>

namespace jax_sparse_mla::indexer_topk {

constexpr int kMaxClusterSize = 8;  // the portable cluster size: the most CTAs a row may need
// Clusters of up to 16 CTAs (the non-portable size SM90 allows) are taken for speed only, where the
// device runs them at once (its occupancy query says so): no row needs more than kMaxClusterSize
// CTAs' shared memory, so a device that runs none still takes every row.
constexpr int kMaxFastClusterSize = 16;
// Positions per group: the kernels read rows as float4 groups (kVec in indexer_topk.cuh).
constexpr int kGroupPositions = 4;
// The dynamic shared memory for one CTA's keys (16 bytes per group); with the static part (two
// histograms, 16.6 KB) a CTA stays under the 227 KB an SM90 CTA may use. 176 KB lets three CTAs
// hold a 131072-wide row (10923 groups each), so that 32 such rows run in one wave of 96 CTAs.
constexpr int kMaxClusterKeyBytes = 176 * 1024;
// The most dynamic shared memory a cluster CTA is given: its keys and, where they fit beside them,
// the leader's candidate lists (with the 16.6 KB static part, within the 227 KB a CTA may use).
constexpr int kMaxClusterDynamicBytes = 208 * 1024;
constexpr int64_t kMaxClusterGroupsPerCta = kMaxClusterKeyBytes / (4 * kGroupPositions);
// Below this many keys per CTA, splitting a row further costs more in cluster barriers than the
// smaller chunks save.
constexpr int64_t kMinClusterKeysPerCta = 2048;

struct ClusterPlan {
  int ctas;                 // C: CTAs per row, 1 .. kMaxFastClusterSize
  int64_t groups_capacity;  // groups of keys per CTA (the dynamic shared memory / 16 bytes)
};

// Clusters of c CTAs (entry c - 1, c = 1 .. kMaxClusterSize) that the GPU runs at once: the GPCs,
// not the SM count alone, bound them (on an H100 of 132 SMs, 32 clusters of 4 CTAs took two waves).
using ActiveClusters = int[kMaxFastClusterSize];

// The cluster for R rows of width S: the widest C whose R clusters still run at once (`active`:
// one CTA per SM, 512 threads of ~126 registers) and whose chunks keep at least
// kMinClusterKeysPerCta keys, or, where none is wider, the fewest CTAs whose chunks of a row fit
// kMaxClusterKeyBytes. Any C, not only powers of two: 32 rows of 65536 run in one wave as
// clusters of 3 (96 CTAs), not of 4. A second wave would double the latency that the smaller
// chunks save. A row's groups number ceil((len + lead) / 4) <= ceil((S + 3) / 4) (lead <= 3: the
// row start's misalignment in floats). False when even kMaxClusterSize CTAs cannot hold a row: S >
// kMaxClusterSize * kMaxClusterGroupsPerCta * 4 - 3.
inline bool PlanCluster(int64_t num_rows, int64_t width, const ActiveClusters& active,
                        ClusterPlan* plan) {
  const int64_t max_groups = (width + 3 + kGroupPositions - 1) / kGroupPositions;
  auto per_cta = [&](int ctas) { return (max_groups + ctas - 1) / ctas; };
  const int64_t fewest = (max_groups + kMaxClusterGroupsPerCta - 1) / kMaxClusterGroupsPerCta;
  if (fewest > kMaxClusterSize) return false;
  int ctas = fewest < 1 ? 1 : static_cast<int>(fewest);
  for (int wider = ctas + 1; wider <= kMaxFastClusterSize; ++wider) {
    if (num_rows <= active[wider - 1] &&
        per_cta(wider) * kGroupPositions >= kMinClusterKeysPerCta) {
      ctas = wider;
    }
  }
  plan->ctas = ctas;
  plan->groups_capacity = per_cta(ctas);
  return true;
}

}  // namespace jax_sparse_mla::indexer_topk
