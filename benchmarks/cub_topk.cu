// CUB's batched top-k (cub::DeviceBatchedTopK, CCCL 3.6) and FlashInfer's own top-k (its filtered one-CTA
// and multi-CTA radix kernels, through its dispatcher) timed at the indexer's shapes, for
// benchmarks/bench_indexer.py --cub. A standalone program: it lives beside the benchmarks, is built by
// them with nvcc from the CCCL and FlashInfer headers of FlashInfer's data/ folder, and is never part of
// the package.
//
// It calls CUB the way FlashInfer 0.7.2's ragged transform does: fp32 rows read through a strided
// iterator, per-row lengths read on the device (a deferred sequence), values = positions, keys
// discarded, k immediate, unsorted output. Three CUB modes:
//   default        FlashInfer's: determinism::not_guaranteed, tie_break::unspecified
//   ties_to_lower  determinism::gpu_to_gpu, tie_break::prefer_smaller_index (our selection rule,
//                  without our ascending order)
//   ascending      ties_to_lower, then each row's k positions sorted ascending by a second kernel
//                  (one CTA a row, cub::BlockRadixSort over the bits of the row width): our whole
//                  output contract, what a library calling CUB for our op would run (k <= 4096)
// and two modes of FlashInfer's own top-k, called as its top_k_ragged_transform calls it:
// flashinfer::sampling::TopKRaggedTransformDispatch<float, int32_t> on the same fp32 rows (row r at
// r * width: row_starts null, max_len = width), lengths read on the device, offsets all 0 (so the
// outputs are positions in the row), and a 1 MiB zero-initialised row-state buffer (the size
// FlashInfer's Python allocates), allocated once per shape; the dispatcher picks its filtered one-CTA
// kernel or its multi-CTA radix kernel by shape (FLASHINFER_TOPK_ALGO=filtered or multi_cta in the
// environment forces one, as in FlashInfer):
//   flashinfer_radix                deterministic=false, tie_break None: FlashInfer's default (ties and
//                                   order unspecified)
//   flashinfer_radix_deterministic  deterministic=true (repeatable; ties still unspecified; its filtered
//                                   kernel adds a second, finalize kernel, inside the same graph)
//
// Timing: one CUDA graph of --calls calls over --inputs distinct inputs (input i = input 0 * 2^i: the
// same order, every mantissa bit kept), replayed --reps times and timed with CUDA events; reported per
// call: the median, min and max over the replays. Host work of a call (CUB's or FlashInfer's launch
// set-up) happens at capture, outside the timing.
// Check: before and after the timing, the output set of the first --check-rows rows against a host
// top-k: in ties_to_lower mode the set of positions must equal the host's (ties to the lower
// position), and in ascending mode come in ascending order as well; in default mode and both
// FlashInfer modes (ties unspecified) the selected values must equal the k largest values as a
// multiset, with distinct in-range positions.
//
// Usage: cub_topk [-k 2048] [--calls 50] [--inputs 4] [--reps 7] [--check-rows 4] [--seed 1234]
//                 [--causal] [--modes MODE,MODE,...] ROWSxWIDTH [ROWSxWIDTH ...]
//   --modes: a comma-separated subset of the five modes above (default: all of them), run and
//   printed in the order above.
// Output, one line per (shape, mode), machine-readable (space-separated key=value after the tag):
//   cub_topk mode=default rows=32 width=65536 k=2048 us=23.61 min_us=23.58 max_us=23.66 calls=50
//            check=ok ws_bytes=1
// (ws_bytes: CUB's temporary storage; in the FlashInfer modes, the row-state buffer.)
// Exit status: 0, or 3 when a check failed (every line is still printed), or 1 on a CUDA/usage error
// (a FlashInfer or CUB call that does not return cudaSuccess included).
//
// Build (FI: FlashInfer's data/ folder):
//   nvcc -O3 -std=c++20 -arch=sm_90a --expt-relaxed-constexpr --extended-lambda \
//        -I$FI/cccl/cub -I$FI/cccl/libcudacxx/include -I$FI/cccl/thrust -I$FI/include \
//        -o cub_topk cub_topk.cu
#define CUB_DISABLE_TOPK_UNSUPPORTED_ARCH_ASSERT
#include <cuda/__execution/determinism.h>
#include <cuda/__execution/output_ordering.h>
#include <cuda/__execution/require.h>
#include <cuda/__execution/tie_break.h>
#include <cuda/std/__execution/env.h>
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_batched_topk.cuh>
#include <cuda/argument>
#include <cuda/iterator>
#include <cuda/std/limits>
// FlashInfer's topk.cuh calls math::ptx_rcp without including math.cuh (its own csrc/topk.cu includes
// sampling.cuh, which does, first).
#include <flashinfer/math.cuh>
#include <flashinfer/topk.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

void check_cuda(cudaError_t status, const char* what, int line) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "cub_topk: %s failed at line %d: %s\n", what, line, cudaGetErrorString(status));
    std::exit(1);
  }
}
#define CUDA_OK(call) check_cuda((call), #call, __LINE__)

// The output row of segment `row`: k positions per row, rows packed.
struct RowOutput {
  int32_t* base;
  int64_t k;
  __host__ __device__ int32_t* operator()(int64_t row) const { return base + row * k; }
};

// One DeviceBatchedTopK::MaxPairs call (or the workspace query, when workspace is null), as FlashInfer
// issues it: `rows` segments of `width` fp32 keys at a stride of `width`, lengths read from `lengths`
// on the device, values = positions 0, 1, ... in each row, keys not written.
template <typename Requirements>
cudaError_t batched_topk(void* workspace, size_t& workspace_bytes, const float* scores, int32_t* positions,
                         const int32_t* lengths, int64_t rows, int64_t width, int64_t k,
                         Requirements requirements, cudaStream_t stream) {
  constexpr int64_t kMaxSegment = int64_t{1} << 21;  // the largest row length (and k) we promise CUB
  constexpr int32_t kLowest = cuda::std::numeric_limits<int32_t>::min();
  auto env = cuda::std::execution::env{requirements, cuda::stream_ref{stream}};
  auto keys_in = cuda::make_strided_iterator(cuda::make_counting_iterator(scores), width);
  auto keys_out = cuda::make_constant_iterator(cuda::discard_iterator{});
  auto values_in = cuda::make_constant_iterator(cuda::make_counting_iterator(int32_t{0}));
  auto values_out = cuda::make_transform_iterator(cuda::make_counting_iterator(int64_t{0}), RowOutput{positions, k});
  auto segment_sizes = cuda::args::deferred_sequence{lengths, cuda::args::bounds<kLowest, int32_t{kMaxSegment}>(),
                                                     cuda::args::bounds(kLowest, static_cast<int32_t>(width))};
  auto k_arg = cuda::args::immediate{k, cuda::args::bounds<int64_t{1}, kMaxSegment>()};
  auto num_segments = cuda::args::immediate{rows};
  return cub::DeviceBatchedTopK::MaxPairs(workspace, workspace_bytes, keys_in, keys_out, values_in, values_out,
                                          segment_sizes, k_arg, num_segments, env);
}

// The ascending mode's second kernel: row blockIdx.x's k positions sorted ascending in place. Positions
// are below 2^end_bit (the row width's bits), so the radix sort covers only those bits; the slots past k
// hold the largest such value and sort last.
constexpr int kSortThreads = 512;
constexpr int kSortItems = 8;
constexpr int64_t kMaxSortedK = int64_t{kSortThreads} * kSortItems;

__global__ void __launch_bounds__(kSortThreads) sort_rows(int32_t* positions, int64_t k, int end_bit) {
  using BlockSort = cub::BlockRadixSort<uint32_t, kSortThreads, kSortItems>;
  __shared__ typename BlockSort::TempStorage temp;
  uint32_t* row = reinterpret_cast<uint32_t*>(positions) + blockIdx.x * k;
  const uint32_t pad = (uint32_t{1} << end_bit) - 1u;
  uint32_t items[kSortItems];
  for (int i = 0; i < kSortItems; ++i) {
    const int64_t slot = int64_t{threadIdx.x} * kSortItems + i;  // blocked: thread t holds t*8 .. t*8+7
    items[i] = slot < k ? row[slot] : pad;
  }
  BlockSort(temp).Sort(items, 0, end_bit);
  for (int i = 0; i < kSortItems; ++i) {
    const int64_t slot = int64_t{threadIdx.x} * kSortItems + i;
    if (slot < k) row[slot] = items[i];
  }
}

// Bits that hold every position of a row of `width`.
int position_bits(int64_t width) {
  int bits = 1;
  while ((int64_t{1} << bits) < width) ++bits;
  return bits;
}

// Every mode, in the order they run and print (--modes picks a subset).
const char* const kModes[] = {"default", "ties_to_lower", "ascending", "flashinfer_radix",
                              "flashinfer_radix_deterministic"};

struct Options {
  int64_t k = 2048;
  int calls = 50;
  int inputs = 4;
  int reps = 7;
  int64_t check_rows = 4;
  unsigned seed = 1234;
  bool causal = false;  // row r holds width - rows + 1 + r positions (a prefill chunk's last rows)
  std::set<std::string> modes{std::begin(kModes), std::end(kModes)};
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (rows, width)
};

// The host reference of one row: its top-k positions, ties to the lower position.
std::vector<int32_t> host_topk(const float* row, int64_t width, int64_t k) {
  std::vector<int32_t> order(width);
  for (int64_t i = 0; i < width; ++i) order[i] = static_cast<int32_t>(i);
  auto before = [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), before);
  order.resize(k);
  return order;
}

// Whether `got` (k positions of one row) is a correct selection for `want` (the host's), in ascending
// order where `ascending`.
bool selection_ok(const float* row, int64_t length, std::vector<int32_t> got, std::vector<int32_t> want,
                  bool ties_to_lower, bool ascending) {
  if (ascending && !std::is_sorted(got.begin(), got.end())) return false;
  std::sort(got.begin(), got.end());
  if (std::adjacent_find(got.begin(), got.end()) != got.end()) return false;  // a position twice
  if (got.front() < 0 || got.back() >= length) return false;
  if (ties_to_lower) {
    std::sort(want.begin(), want.end());
    return got == want;
  }
  // Ties unspecified: any k positions holding the k largest values (as a multiset) will do.
  std::vector<float> got_values, want_values;
  for (int32_t i : got) got_values.push_back(row[i]);
  for (int32_t i : want) want_values.push_back(row[i]);
  std::sort(got_values.begin(), got_values.end());
  std::sort(want_values.begin(), want_values.end());
  return got_values == want_values;
}

struct Result {
  float median_us, min_us, max_us;
  bool check_ok;
  size_t workspace_bytes;
};

// One shape's inputs and outputs, shared by every mode.
struct Problem {
  const Options& opt;
  int64_t rows, width;
  std::vector<float> host_scores;                // input 0, rows x width
  std::vector<int32_t> host_lengths;             // each row's length
  std::vector<std::vector<int32_t>> reference;   // the host top-k of the first --check-rows rows
  std::vector<float*> inputs;                    // device: input i = input 0 * 2^i
  int32_t* positions;                            // device [rows, k]: every mode's output
  int32_t* lengths;                              // device [rows]: host_lengths
  cudaStream_t stream;
};

// One mode's timing and check: `call(scores)` enqueues one top-k of `scores` (a device input, rows x
// width) into p.positions on p.stream, capturable into a CUDA graph; ties_to_lower and ascending are
// what the check asks of its output; workspace_bytes is reported with the result.
template <typename Call>
Result bench_mode(const Problem& p, Call&& call, bool ties_to_lower, bool ascending, size_t workspace_bytes) {
  const Options& opt = p.opt;
  const int64_t k = opt.k;

  // The output of the last call is compared with the host's top-k of input 0 (every input has its order).
  auto check = [&]() {
    CUDA_OK(cudaStreamSynchronize(p.stream));
    const int64_t checked = std::min(p.rows, opt.check_rows);
    std::vector<int32_t> out(checked * k);
    CUDA_OK(cudaMemcpy(out.data(), p.positions, out.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < checked; ++r) {
      std::vector<int32_t> got(out.begin() + r * k, out.begin() + (r + 1) * k);
      if (!selection_ok(p.host_scores.data() + r * p.width, p.host_lengths[r], got, p.reference[r], ties_to_lower,
                        ascending)) {
        return false;
      }
    }
    return true;
  };

  CUDA_OK(cudaMemsetAsync(p.positions, 0xff, p.rows * k * sizeof(int32_t), p.stream));
  call(p.inputs[0]);
  bool ok = check();

  // One graph of opt.calls calls, rotating over the inputs.
  cudaGraph_t graph;
  cudaGraphExec_t graph_exec;
  CUDA_OK(cudaStreamBeginCapture(p.stream, cudaStreamCaptureModeGlobal));
  for (int c = 0; c < opt.calls; ++c) call(p.inputs[c % p.inputs.size()]);
  CUDA_OK(cudaStreamEndCapture(p.stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));

  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  CUDA_OK(cudaGraphLaunch(graph_exec, p.stream));  // warm-up
  CUDA_OK(cudaStreamSynchronize(p.stream));
  std::vector<float> per_call_us;
  for (int rep = 0; rep < opt.reps; ++rep) {
    CUDA_OK(cudaEventRecord(start, p.stream));
    CUDA_OK(cudaGraphLaunch(graph_exec, p.stream));
    CUDA_OK(cudaEventRecord(stop, p.stream));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    per_call_us.push_back(ms * 1000.f / opt.calls);
  }
  ok = check() && ok;  // the graph's last call
  std::sort(per_call_us.begin(), per_call_us.end());

  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaGraphDestroy(graph));
  return Result{per_call_us[per_call_us.size() / 2], per_call_us.front(), per_call_us.back(), ok, workspace_bytes};
}

// A CUB mode: DeviceBatchedTopK under `requirements` (its workspace queried and allocated outside the
// graph), followed by sort_rows where `ascending`.
template <typename Requirements>
Result bench_cub(const Problem& p, Requirements requirements, bool ties_to_lower, bool ascending) {
  const int64_t k = p.opt.k;
  size_t workspace_bytes = 0;
  CUDA_OK(batched_topk(nullptr, workspace_bytes, p.inputs[0], p.positions, p.lengths, p.rows, p.width, k,
                       requirements, p.stream));
  void* workspace = nullptr;
  CUDA_OK(cudaMalloc(&workspace, std::max<size_t>(workspace_bytes, 1)));
  const int end_bit = position_bits(p.width);
  auto call = [&](const float* scores) {
    CUDA_OK(batched_topk(workspace, workspace_bytes, scores, p.positions, p.lengths, p.rows, p.width, k,
                         requirements, p.stream));
    if (ascending) {
      sort_rows<<<static_cast<unsigned>(p.rows), kSortThreads, 0, p.stream>>>(p.positions, k, end_bit);
      CUDA_OK(cudaGetLastError());
    }
  };
  const Result result = bench_mode(p, call, ties_to_lower, ascending, workspace_bytes);
  CUDA_OK(cudaFree(workspace));
  return result;
}

// FlashInfer's row-state buffer: the size flashinfer/topk.py gives it (1 MiB, zero-initialised, one per
// device, shared by every call: each multi-CTA launch leaves its state reset for the next).
constexpr size_t kRowStatesBytes = size_t{1} << 20;

// What FlashInfer's modes share at one shape: the row-state buffer and per-row offsets of 0.
struct FlashInferBuffers {
  flashinfer::sampling::RadixRowState* row_states;
  int32_t* offsets;
};

// Allocates (zeroed) FlashInfer's buffers for `rows` rows, after checking the row-state buffer is large
// enough: the multi-CTA radix kernel uses one RadixRowState per group of CTAs, then (deterministic) one
// RadixDeterministicCollectScratch per group after them (MaybeGetRadixDeterministicCollectScratchBuffer),
// and runs at most one group per SM.
FlashInferBuffers flashinfer_buffers(int64_t rows) {
  namespace fi = flashinfer::sampling;
  int device = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t needed =
      static_cast<size_t>(sms) * (sizeof(fi::RadixRowState) + sizeof(fi::RadixDeterministicCollectScratch));
  if (needed > kRowStatesBytes) {
    std::fprintf(stderr, "cub_topk: FlashInfer's row-state buffer (%zu bytes) is below the %zu bytes %d SMs may use\n",
                 kRowStatesBytes, needed, sms);
    std::exit(1);
  }
  FlashInferBuffers buffers;
  CUDA_OK(cudaMalloc(&buffers.row_states, kRowStatesBytes));
  CUDA_OK(cudaMemset(buffers.row_states, 0, kRowStatesBytes));
  CUDA_OK(cudaMalloc(&buffers.offsets, rows * sizeof(int32_t)));
  CUDA_OK(cudaMemset(buffers.offsets, 0, rows * sizeof(int32_t)));
  return buffers;
}

// A FlashInfer mode: its dispatcher, as flashinfer.top_k_ragged_transform calls it, tie_break None.
Result bench_flashinfer(const Problem& p, const FlashInferBuffers& buffers, bool deterministic) {
  namespace fi = flashinfer::sampling;
  auto call = [&](const float* scores) {
    // FlashInfer takes the scores as float*; the ragged transform only reads them.
    CUDA_OK((fi::TopKRaggedTransformDispatch<float, int32_t>(
        const_cast<float*>(scores), p.positions, buffers.offsets, p.lengths, /*row_starts=*/nullptr,
        static_cast<uint32_t>(p.rows), static_cast<uint32_t>(p.opt.k), static_cast<uint32_t>(p.width),
        buffers.row_states, deterministic, fi::TopKTieBreak::None, p.stream)));
  };
  return bench_mode(p, call, /*ties_to_lower=*/false, /*ascending=*/false, kRowStatesBytes);
}

// The chosen modes at one shape (ascending where k <= kMaxSortedK); returns false when a check failed.
bool bench_shape(const Options& opt, int64_t rows, int64_t width) {
  namespace ex = cuda::execution;
  const int64_t k = opt.k;
  Problem p{opt, rows, width};
  CUDA_OK(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking));

  // Input 0: normal fp32 scores; input i: input 0 * 2^i.
  std::mt19937 generator(opt.seed);
  std::normal_distribution<float> normal;
  p.host_scores.resize(rows * width);
  for (float& x : p.host_scores) x = normal(generator);
  p.inputs.resize(opt.inputs);
  std::vector<float> scaled(p.host_scores.size());
  for (int i = 0; i < opt.inputs; ++i) {
    const float scale = std::ldexp(1.0f, i);
    for (size_t j = 0; j < scaled.size(); ++j) scaled[j] = p.host_scores[j] * scale;
    CUDA_OK(cudaMalloc(&p.inputs[i], scaled.size() * sizeof(float)));
    CUDA_OK(cudaMemcpy(p.inputs[i], scaled.data(), scaled.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaMalloc(&p.positions, rows * k * sizeof(int32_t)));
  CUDA_OK(cudaMalloc(&p.lengths, rows * sizeof(int32_t)));
  p.host_lengths.assign(rows, static_cast<int32_t>(width));  // every row whole
  if (opt.causal)
    for (int64_t r = 0; r < rows; ++r) p.host_lengths[r] = static_cast<int32_t>(width - rows + 1 + r);
  CUDA_OK(cudaMemcpy(p.lengths, p.host_lengths.data(), rows * sizeof(int32_t), cudaMemcpyHostToDevice));

  for (int64_t r = 0; r < std::min(rows, opt.check_rows); ++r)
    p.reference.push_back(host_topk(p.host_scores.data() + r * width, p.host_lengths[r], k));

  const bool flashinfer = opt.modes.count("flashinfer_radix") + opt.modes.count("flashinfer_radix_deterministic") > 0;
  const FlashInferBuffers fi_buffers = flashinfer ? flashinfer_buffers(rows) : FlashInferBuffers{nullptr, nullptr};

  bool all_ok = true;
  // Runs `bench` (returning a Result) and prints its line, where --modes has `mode`.
  auto run = [&](const char* mode, auto&& bench) {
    if (opt.modes.count(mode) == 0) return;
    const Result res = bench();
    std::printf("cub_topk mode=%s rows=%lld width=%lld causal=%d k=%lld us=%.3f min_us=%.3f max_us=%.3f calls=%d "
                "check=%s ws_bytes=%zu\n",
                mode, static_cast<long long>(rows), static_cast<long long>(width), opt.causal ? 1 : 0,
                static_cast<long long>(k), res.median_us, res.min_us, res.max_us, opt.calls,
                res.check_ok ? "ok" : "FAIL", res.workspace_bytes);
    std::fflush(stdout);
    all_ok = res.check_ok && all_ok;
  };
  const auto fast_requirements =
      ex::require(ex::determinism::not_guaranteed, ex::tie_break::unspecified, ex::output_ordering::unsorted);
  const auto exact_requirements =
      ex::require(ex::determinism::gpu_to_gpu, ex::tie_break::prefer_smaller_index, ex::output_ordering::unsorted);
  run("default", [&] { return bench_cub(p, fast_requirements, false, false); });
  run("ties_to_lower", [&] { return bench_cub(p, exact_requirements, true, false); });
  if (k <= kMaxSortedK) run("ascending", [&] { return bench_cub(p, exact_requirements, true, true); });
  run("flashinfer_radix", [&] { return bench_flashinfer(p, fi_buffers, false); });
  run("flashinfer_radix_deterministic", [&] { return bench_flashinfer(p, fi_buffers, true); });

  if (flashinfer) {
    CUDA_OK(cudaFree(fi_buffers.row_states));
    CUDA_OK(cudaFree(fi_buffers.offsets));
  }
  for (float* input : p.inputs) CUDA_OK(cudaFree(input));
  CUDA_OK(cudaFree(p.positions));
  CUDA_OK(cudaFree(p.lengths));
  CUDA_OK(cudaStreamDestroy(p.stream));
  return all_ok;
}

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr,
               "cub_topk: %s\nusage: cub_topk [-k K] [--calls N] [--inputs N] [--reps N] [--check-rows N] "
               "[--seed S] [--causal] [--modes MODE,MODE,...] ROWSxWIDTH [ROWSxWIDTH ...]\n"
               "modes (default: all): default, ties_to_lower, ascending, flashinfer_radix, "
               "flashinfer_radix_deterministic\n",
               message);
  std::exit(1);
}

Options parse(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> long long {
      if (i + 1 >= argc) usage(("missing value after " + arg).c_str());
      return std::atoll(argv[++i]);
    };
    if (arg == "-k" || arg == "--k") opt.k = value();
    else if (arg == "--causal") opt.causal = true;
    else if (arg == "--calls") opt.calls = static_cast<int>(value());
    else if (arg == "--inputs") opt.inputs = static_cast<int>(value());
    else if (arg == "--reps") opt.reps = static_cast<int>(value());
    else if (arg == "--check-rows") opt.check_rows = value();
    else if (arg == "--seed") opt.seed = static_cast<unsigned>(value());
    else if (arg == "--modes") {
      if (i + 1 >= argc) usage("missing value after --modes");
      opt.modes.clear();
      const std::string list = argv[++i];
      for (size_t begin = 0, comma; begin <= list.size(); begin = comma + 1) {
        comma = std::min(list.find(',', begin), list.size());
        const std::string mode = list.substr(begin, comma - begin);
        if (std::find_if(std::begin(kModes), std::end(kModes), [&](const char* m) { return mode == m; }) ==
            std::end(kModes))
          usage(("unknown mode: '" + mode + "'").c_str());
        opt.modes.insert(mode);
      }
    }
    else {
      long long rows = 0, width = 0;
      char tail = 0;
      if (std::sscanf(arg.c_str(), "%lldx%lld%c", &rows, &width, &tail) != 2 || rows < 1 || width < 1)
        usage(("not a shape ROWSxWIDTH: " + arg).c_str());
      opt.shapes.emplace_back(rows, width);
    }
  }
  if (opt.shapes.empty()) usage("no shape given");
  if (opt.calls < 1 || opt.inputs < 1 || opt.inputs > 24 || opt.reps < 1 || opt.k < 1) usage("bad option value");
  for (auto [rows, width] : opt.shapes)
    if (width - (opt.causal ? rows - 1 : 0) < opt.k || width > (int64_t{1} << 21))
      usage("every row's length must be in [k, 2^21]");
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  bool all_ok = true;
  for (auto [rows, width] : opt.shapes) all_ok = bench_shape(opt, rows, width) && all_ok;
  return all_ok ? 0 : 3;
}
