// How the cluster top-k (indexer_topk_cluster.cuh) splits rows: host code only, so that a CPU test
// compiles it (tests/kernels/test_sm90_indexer_topk_cluster_cpu.py) and checks it against the
// Python side's limit (kernels/sm90_indexer_topk.py: MAX_CLUSTER_WIDTH).
#pragma once

#include <cstdint>

namespace jax_sparse_mla::indexer_topk {

constexpr int kMaxClusterSize = 8;  // the portable cluster size
// Positions per group: the kernels read rows as float4 groups (kVec in indexer_topk.cuh).
constexpr int kGroupPositions = 4;
// The dynamic shared memory for one CTA's keys (16 bytes per group); with the static part (two
// histograms, 16 KB) a CTA stays well under the 227 KB an SM90 CTA may use.
constexpr int kMaxClusterKeyBytes = 160 * 1024;
// The most dynamic shared memory a cluster CTA is given: its keys and, where they fit beside them,
// the leader's candidate lists (with the 16.6 KB static part, within the 227 KB a CTA may use).
constexpr int kMaxClusterDynamicBytes = 208 * 1024;
constexpr int64_t kMaxClusterGroupsPerCta = kMaxClusterKeyBytes / (4 * kGroupPositions);
// Below this many keys per CTA, splitting a row further costs more in cluster barriers than the
// smaller chunks save.
constexpr int64_t kMinClusterKeysPerCta = 2048;

struct ClusterPlan {
  int ctas;                 // C: CTAs per row, a power of two up to kMaxClusterSize
  int64_t groups_capacity;  // groups of keys per CTA (the dynamic shared memory / 16 bytes)
};

// Clusters of 1, 2, 4 and 8 CTAs (entry i: 2^i CTAs) that the GPU runs at once: the GPCs, not the
// SM count alone, bound them (on an H100 of 132 SMs, 32 clusters of 4 CTAs took two waves).
using ActiveClusters = int[4];

// The cluster for R rows of width S: the fewest CTAs whose chunks of a row fit
// kMaxClusterKeyBytes, doubled while R clusters of the doubled size still run at once
// (`active`: one CTA per SM, 512 threads of ~126 registers) and the chunks keep at least
// kMinClusterKeysPerCta keys. A second wave would double the latency that the smaller chunks save.
// A row's groups number ceil((len + lead) / 4) <= ceil((S + 3) / 4) (lead <= 3: the row start's
// misalignment in floats). False when even kMaxClusterSize CTAs cannot hold a row: S >
// kMaxClusterSize * kMaxClusterGroupsPerCta * 4 - 3.
inline bool PlanCluster(int64_t num_rows, int64_t width, const ActiveClusters& active,
                        ClusterPlan* plan) {
  const int64_t max_groups = (width + 3 + kGroupPositions - 1) / kGroupPositions;
  auto per_cta = [&](int ctas) { return (max_groups + ctas - 1) / ctas; };
  auto log2 = [](int ctas) { return ctas == 1 ? 0 : ctas == 2 ? 1 : ctas == 4 ? 2 : 3; };
  int ctas = 1;
  while (ctas < kMaxClusterSize && per_cta(ctas) > kMaxClusterGroupsPerCta) ctas *= 2;
  if (per_cta(ctas) > kMaxClusterGroupsPerCta) return false;
  while (ctas < kMaxClusterSize && num_rows <= active[log2(2 * ctas)] &&
         per_cta(2 * ctas) * kGroupPositions >= kMinClusterKeysPerCta) {
    ctas *= 2;
  }
  plan->ctas = ctas;
  plan->groups_capacity = per_cta(ctas);
  return true;
}

}  // namespace jax_sparse_mla::indexer_topk
