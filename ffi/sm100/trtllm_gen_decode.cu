// XLA FFI handler: sparse MLA decode on SM100/SM103 through FlashInfer's TRTLLM-gen kernels, the
// kernel vLLM's FlashInferMLASparseImpl calls (trtllm_batch_decode_with_kv_cache_mla with
// sparse_mla_top_k = K).
//
// Compiled against flashinfer-python FLASHINFER_SM100_VERSION (ffi/sm100/trtllm_gen_table.py, 0.6.13)
// and the kernel table of the flashinfer-cubin wheel of the same version: the table's struct, the
// runner's parameters and the KernelParams layout the cubins read all change between releases, and
// the newest flashinfer-cubin is older than the flashinfer-python of the other families. Line
// references "launcher.cu" below are to 0.6.13's data/csrc/trtllm_fmha_kernel_launcher.cu.
//
// FlashInfer's launcher (data/csrc/trtllm_fmha_kernel_launcher.cu) is written against tvm-ffi:
// compiling it would pull tvm-ffi's runtime library into the process. Its body is a translation of
// tensor arguments into TllmGenFmhaRunnerParams followed by TllmGenFmhaRunner::run, and that runner
// (data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh + fmhaKernels.cuh, plus fmhaReduction.cu) is
// plain C++/CUDA. So this file fills the same TllmGenFmhaRunnerParams as
// trtllm_paged_attention_launcher does for ForGen mode (launcher.cu:97-275, the values
// trtllm_paged_attention_decode passes for MLA: launcher.cu:300-440), restricted to the sparse MLA
// decode: static token sparsity, one KV head, shared K/V pool, no sinks, no block scales, no
// sliding window, no skip-softmax. Each deviation from that code is commented.
//
// The kernels themselves are cubins that FlashInfer loads lazily per configuration; our callback
// (cubin_loader.cc) reads them from disk and checks their sha256. No Python and no download at run
// time.
//
// SelectTrtllmGenKernel runs the same code without a GPU: the same parameters, FlashInfer's own
// TllmGenFmhaKernel (kernel selection, cubin request through our loader, TMA descriptors, launch
// configuration) up to cuLaunchKernelEx, with the driver calls recorded instead of made
// (driver_dry_run.h).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <flashinfer/allocator.h>
#include <flashinfer/trtllm/fmha/fmhaRunner.cuh>
#include <flashinfer/trtllm/fmha/fmhaRunnerParams.h>

// FlashInfer's cubin hook: getCubin() asks a callback, which answers through
// FlashInferSetCurrentCubin (the launcher includes the header the same way, launcher.cu:1279).
namespace flashinfer::trtllm_cubin_loader {
#include <flashinfer/cubin_loader.h>
}  // namespace flashinfer::trtllm_cubin_loader

#include "common/cubin_loader.h"
#include "common/sha256.h"
#include "sm100/driver_dry_run.h"
#include "sm100/trtllm_gen.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kHeadDimQk = 576;  // kv_lora_rank 512 + qk_rope_head_dim 64
constexpr int64_t kHeadDimVo = 512;
// launcher.cu kTrtllmGenSoftmaxStatsGuardBytes: pad after the softmax-stats carve-out.
constexpr size_t kSoftmaxStatsGuardBytes = 1 << 20;
// FlashInfer launches the requests along the grid's z dimension (fmhaKernels.cuh: numCtasZ =
// mBatchSize), which CUDA bounds at 65535. A larger batch must be rejected before the launch: the
// launch's cuErrCheck only prints a failed cuLaunchKernelEx, and cudaGetLastError does not see
// driver-API errors, so the call would return Success with out and lse never written.
constexpr int64_t kMaxBatch = 65535;

#ifdef JAX_SPARSE_MLA_TRTLLM_GEN_STUB_METAINFO
constexpr int64_t kNumKernels = 0;
#else
constexpr int64_t kNumKernels = sizeof(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos) /
                                sizeof(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos[0]);
#endif
constexpr unsigned kTableSize = sizeof(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos) /
                                sizeof(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos[0]);

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_sparse_mla trtllm-gen decode: " + what);
}

Data_type ToTllm(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::BF16:
      return DATA_TYPE_BF16;
    case ffi::DataType::F16:
      return DATA_TYPE_FP16;
    case ffi::DataType::F8E4M3FN:
      return DATA_TYPE_E4M3;
    default:
      return DATA_TYPE_UNKNOWN;
  }
}

// What the loader was last asked for on this thread (read by SelectTrtllmGenKernel).
struct CubinRequest {
  bool active = false;  // a dry run is recording
  bool read = true;     // read the files (false: answer with a placeholder, table check only)
  // Every cubin FlashInfer's loadKernel asked for (its selection passes may load several), as
  // {path, sha256, size of the file read and sha256-checked (0 when not read)}.
  std::vector<std::tuple<std::string, std::string, int64_t>> requests;
};

CubinRequest& CurrentCubinRequest() {
  thread_local CubinRequest request;
  return request;
}

void CubinCallback(const char* path, const char* sha256) {
  CubinRequest& request = CurrentCubinRequest();
  if (request.active) {
    request.requests.emplace_back(path, sha256, 0);
    if (!request.read) {
      static const char kPlaceholder[] = "dry run";
      flashinfer::trtllm_cubin_loader::FlashInferSetCurrentCubin(kPlaceholder,
                                                                 sizeof(kPlaceholder));
      return;
    }
  }
  std::string data, error;
  // Exceptions cross FlashInfer's getCubin() (C++ calling a C++ function through a pointer) and
  // reach the handler's catch below.
  if (!ResolveCubin(path, sha256, &data, &error)) throw std::runtime_error(error);
  if (request.active) std::get<2>(request.requests.back()) = static_cast<int64_t>(data.size());
  flashinfer::trtllm_cubin_loader::FlashInferSetCurrentCubin(data.data(),
                                                             static_cast<int>(data.size()));
}

// FlashInfer keeps one TllmGenFmhaRunner per dtype combination (TllmGenFmhaRunnerCache) and the
// runner caches loaded CUmodules process-wide, in the CUDA context current at first use. Modules
// are not valid in another device's context, so this handler serves one device per process and
// says so instead of failing inside the driver.
struct RunnerCache {
  std::mutex mutex;
  int device = -1;
  std::unordered_map<int, std::shared_ptr<TllmGenFmhaRunner>> runners;  // key: q | kv << 8
};

RunnerCache& Runners() {
  static RunnerCache cache;
  return cache;
}

int SmCount(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = counts.find(device);
  if (it != counts.end()) return it->second;
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  counts[device] = count;
  return count;
}

// Makes `device` current for the call (FlashInfer's CUDADeviceGuard) and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = -1;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

// One decode call as the launcher sees it (the handler's buffers' shapes, or a dry run's query).
struct Shape {
  Data_type q_type = DATA_TYPE_UNKNOWN;
  Data_type kv_type = DATA_TYPE_UNKNOWN;
  int64_t batch = 0, q_len = 0, num_heads = 0;
  int64_t num_pages = 0, page_size = 0;
  int64_t top_k = 0;
  int sm_count = 0;
};

// The handler's own checks (FlashInfer's mla/_core.py and launcher checks for this path, and the
// launch grid's batch limit), shared with the dry run. "" when the shape is accepted.
std::string CheckShape(const Shape& shape) {
  if (shape.batch > kMaxBatch) {
    // sm100_trtllm_gen.py runs a call of more tokens (one request each) as several launches.
    return "batch must be at most 65535 (the launch grid's z dimension), got " +
           std::to_string(shape.batch);
  }
  if (shape.page_size != 32 && shape.page_size != 64) return "page_size must be 32 or 64";
  if (shape.num_heads > 64 && shape.num_heads < 128) {
    return "64 < num_heads < 128 is not supported";
  }
  if (shape.top_k <= 0 || shape.top_k % 4 != 0) {
    return "sparse_mla_top_k must be a positive multiple of 4";
  }
  // vLLM's rule (FlashInferMLASparseImpl): trtllm-gen takes a query of the cache's dtype.
  if (shape.q_type == DATA_TYPE_UNKNOWN || shape.q_type != shape.kv_type) {
    return "q and kv_cache must both be bf16, both f16 or both float8_e4m3fn";
  }
  return "";
}

// Device pointers and scalars of one call (stand-ins in a dry run).
struct Pointers {
  void* q = nullptr;
  void* kv_cache = nullptr;
  int32_t* block_tables = nullptr;
  int32_t* seq_lens = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int32_t* counter = nullptr;
  cudaStream_t stream = nullptr;
  float bmm1_scale = 1.0f, bmm2_scale = 1.0f;
};

// TllmGenFmhaRunnerParams as trtllm_paged_attention_launcher fills them for ForGen mode with the
// values trtllm_paged_attention_decode passes for sparse MLA (launcher.cu:97-275, 300-440).
TllmGenFmhaRunnerParams MakeRunnerParams(const Shape& shape, const Pointers& ptr) {
  const int64_t batch = shape.batch, q_len = shape.q_len, num_heads = shape.num_heads;
  const int64_t page_size = shape.page_size, top_k = shape.top_k;
  TllmGenFmhaRunnerParams params{};
  params.qPtr = ptr.q;
  params.kPtr = ptr.kv_cache;
  params.vPtr = ptr.kv_cache;  // K and V are views of the same latent rows
  params.slidingWindowKvPoolPtr = nullptr;
  params.kvPageIdxPtr = ptr.block_tables;
  params.kSfBasePtr = nullptr;
  params.vSfBasePtr = nullptr;
  params.seqLensKvPtr = ptr.seq_lens;
  params.oPtr = ptr.out;
  params.mHeadDimQk = kHeadDimQk;
  params.mHeadDimV = kHeadDimVo;
  params.mNumHeadsQ = num_heads;
  params.mNumHeadsKv = 1;
  params.mNumHeadsQPerKv = num_heads;
  params.mBatchSize = batch;
  params.mMaxSeqLenKv = top_k;         // max_seq_len = K, as vLLM passes
  params.mMaxNumPagesPerSeqKv = top_k;  // block_tables.size(-1)
  params.mNumTokensPerPage = page_size;  // the sparse kernels use 1 (selectNumTokensPerPage)
  params.mQkvLayout = QkvLayout::PagedKv;
  params.mMultiProcessorCount = shape.sm_count;
  // Element strides of the [sumQ, H, 576] query and the HND view [pages, 1, page_size, 576].
  params.qStrideTokens = num_heads * kHeadDimQk;
  params.qStrideHeads = kHeadDimQk;
  params.kStrideKeysValues = kHeadDimQk;
  params.kStrideHeads = page_size * kHeadDimQk;
  params.kStrideBatch = page_size * kHeadDimQk;
  params.vStrideKeysValues = kHeadDimQk;
  params.vStrideHeads = page_size * kHeadDimQk;
  params.vStrideBatch = page_size * kHeadDimQk;
  params.kSfStrideHeads = 0;
  params.kSfStrideBatch = 0;
  params.vSfStrideHeads = 0;
  params.vSfStrideBatch = 0;
  params.mNumPagesInMemPool = shape.num_pages;  // shared K/V pool
  params.stream = ptr.stream;
  params.outputScale = ptr.bmm2_scale;
  params.outputScalePtr = nullptr;
  params.mScaleSfKv = 1.0f;
  params.kvSfScalePtr = nullptr;
  params.scaleSoftmaxLog2 = ptr.bmm1_scale * M_LOG2E;
  params.scaleSoftmaxLog2Ptr = nullptr;
  params.oSfPtr = nullptr;
  params.mSfStartTokenIdx = 0;
  params.mScaleSfO = -1.0;  // o_sf_scale = -1: no fp4 output
  params.mChunkedAttentionSize = INT_MAX;
  params.mAttentionWindowSize = INT_MAX;  // window_left = -1
  params.mMaxSeqLenQ = q_len;
  params.mSumOfSeqLensQ = batch * q_len;
  params.mUsesSharedPagedKvIdx = true;
  params.ptrAttentionSinks = nullptr;
  params.enable_pdl = false;  // the previous kernel on XLA's stream does not trigger PDL
  params.mSparseMlaType = TrtllmGenSparseMlaType::StaticTokenSparse;
  params.mSparseMlaTopK = top_k;
  params.sparseMlaTopKLensPtr = nullptr;
  params.mHasSlidingWindowKvPool = false;
  // Generation mode (launcher.cu ForGen branch; MLA decode uses the dense mask).
  params.mMaskType = TrtllmGenAttentionMaskType::Dense;
  params.mKernelType = FmhaKernelType::Generation;
  params.mTileScheduler = TileScheduler::Static;
  params.mMultiCtasKvMode = true;
  params.cumSeqLensQPtr = nullptr;
  params.cumSeqLensKvPtr = nullptr;
  // 0.6.13 carves an 8 MB counter from the front of the workspace; this handler takes it as its
  // own (zeroed) buffer of the size the kernel indexes, round_up(max(B * H, SMs), 8) int32.
  params.multiCtasKvCounterPtr = ptr.counter;

  // Workspace carve-outs in the launcher's order: softmax stats (LSE requested), then the
  // multi-CTA scratch takes the rest.
  flashinfer::AlignedAllocator allocator(ptr.workspace, ptr.workspace_bytes);
  const size_t softmax_slots = static_cast<size_t>(num_heads) * static_cast<size_t>(batch) *
                               static_cast<size_t>((q_len + 255) / 256 * 256);
  params.softmaxStatsPtr = allocator.aligned_alloc<float2>(
      sizeof(float2) * softmax_slots + kSoftmaxStatsGuardBytes, 16, "trtllm_gen_softmax_workspace");
  params.lsePtr = ptr.lse;  // base 2 (0.6.13 has no LSE scale)
  params.lseStrideTokens = num_heads;
  params.lseStrideHeads = 1;
  params.multiCtasKvScratchPtr =
      allocator.aligned_alloc<void>(0, 16, "trtllm_gen_scratch_workspace");
  params.mSkipsSoftmaxWhenPossible = false;
  params.mSkipSoftmaxThresholdScaleFactor = 0.0f;
  return params;
}

// FlashInfer's message for a configuration its kernel table lacks (launcher.cu:267-273).
std::string MissingKernelMessage(const std::string& info) {
  std::string message = "Missing TRTLLM-GEN kernel (decode): " + info;
  if (kNumKernels == 0) {
    message +=
        " (this build has no TRTLLM-gen kernel table: flashInferMetaInfo.h was not found at "
        "build time; see ffi/CMakeLists.txt JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO)";
  }
  return message;
}

ffi::Error TrtllmGenDecode(cudaStream_t stream, int32_t device,
                           ffi::AnyBuffer q,                    // [B, q_len, H, 576]
                           ffi::AnyBuffer kv_cache,             // [num_pages, page_size, 576]
                           ffi::Buffer<ffi::S32> block_tables,  // [B, q_len, K] physical slots
                           ffi::Buffer<ffi::S32> seq_lens,      // [B] keys used per request
                           ffi::ResultBuffer<ffi::BF16> out,    // [B, q_len, H, 512]
                           ffi::ResultBuffer<ffi::F32> lse,     // [B * q_len, H], base 2
                           ffi::ResultBuffer<ffi::U8> workspace,  // [workspace_bytes] scratch
                           ffi::ResultBuffer<ffi::U8> counter,    // [counter_bytes] scratch
                           float bmm1_scale, float bmm2_scale, int64_t sparse_mla_top_k) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_cache.dimensions();
  const auto table_dims = block_tables.dimensions();
  if (q_dims.size() != 4 || q_dims[3] != kHeadDimQk) return Invalid("q must be [B, q_len, H, 576]");
  if (kv_dims.size() != 3 || kv_dims[2] != kHeadDimQk) {
    return Invalid("kv_cache must be [num_pages, page_size, 576]");
  }
  Shape shape;
  shape.q_type = ToTllm(q.element_type());
  shape.kv_type = ToTllm(kv_cache.element_type());
  shape.batch = q_dims[0];
  shape.q_len = q_dims[1];
  shape.num_heads = q_dims[2];
  shape.num_pages = kv_dims[0];
  shape.page_size = kv_dims[1];
  shape.top_k = sparse_mla_top_k;
  if (std::string error = CheckShape(shape); !error.empty()) return Invalid(error);
  if (table_dims.size() != 3 || table_dims[0] != shape.batch || table_dims[1] != shape.q_len ||
      table_dims[2] != sparse_mla_top_k) {
    return Invalid("block_tables must be [B, q_len, sparse_mla_top_k]");
  }
  if (seq_lens.dimensions().size() != 1 || seq_lens.dimensions()[0] != shape.batch) {
    return Invalid("seq_lens must be [B]");
  }
  shape.sm_count = SmCount(device);
  if (shape.sm_count <= 0) return ffi::Error::Internal("trtllm-gen decode: cannot read the SM count");
  const int64_t counter_bytes = TrtllmGenCounterBytes(shape.batch, shape.num_heads, shape.sm_count);
  if (static_cast<int64_t>(counter->size_bytes()) < counter_bytes) {
    return Invalid("the counter buffer has " + std::to_string(counter->size_bytes()) +
                   " bytes, the kernel needs " + std::to_string(counter_bytes));
  }
  if (reinterpret_cast<std::uintptr_t>(counter->untyped_data()) % 16 != 0) {
    return Invalid("the counter buffer must be 16-byte aligned");
  }
  if (shape.batch == 0 || shape.q_len == 0 || shape.num_heads == 0) return ffi::Error::Success();

  InstallTrtllmGenCubinCallback();
  DeviceGuard guard(device);
  try {
    std::shared_ptr<TllmGenFmhaRunner> runner;
    {
      RunnerCache& cache = Runners();
      std::lock_guard<std::mutex> lock(cache.mutex);
      if (cache.device < 0) cache.device = device;
      if (cache.device != device) {
        return ffi::Error::Internal(
            "trtllm-gen decode: FlashInfer's TRTLLM-gen runner caches its kernels for one CUDA "
            "device per process (first used: " + std::to_string(cache.device) +
            ", now: " + std::to_string(device) + "); run one GPU per process");
      }
      const int key = int(shape.q_type) | (int(shape.kv_type) << 8);
      auto it = cache.runners.find(key);
      if (it == cache.runners.end()) {
        // The output is always bf16 for MLA (mla/_core.py allocates it so).
        it = cache.runners
                 .emplace(key, std::make_shared<TllmGenFmhaRunner>(shape.q_type, shape.kv_type,
                                                                   DATA_TYPE_BF16))
                 .first;
      }
      runner = it->second;
    }

    // The counter must be zero when the kernel starts; the kernel leaves it zeroed, but XLA hands
    // out fresh scratch each call, so zero it here, on the stream (a few KB).
    if (cudaError_t status = cudaMemsetAsync(counter->untyped_data(), 0, counter_bytes, stream);
        status != cudaSuccess) {
      return ffi::Error::Internal(std::string("trtllm-gen counter memset: ") +
                                  cudaGetErrorString(status));
    }

    Pointers ptr;
    ptr.q = q.untyped_data();
    ptr.kv_cache = kv_cache.untyped_data();
    ptr.block_tables = block_tables.typed_data();
    ptr.seq_lens = seq_lens.typed_data();
    ptr.out = out->untyped_data();
    ptr.lse = lse->typed_data();
    ptr.workspace = workspace->untyped_data();
    ptr.workspace_bytes = workspace->size_bytes();
    ptr.counter = reinterpret_cast<int32_t*>(counter->untyped_data());
    ptr.stream = stream;
    ptr.bmm1_scale = bmm1_scale;
    ptr.bmm2_scale = bmm2_scale;
    const TllmGenFmhaRunnerParams params = MakeRunnerParams(shape, ptr);

    auto [found, info] = runner->isSupportedWithInfo(params);
    if (!found) return ffi::Error::Internal(MissingKernelMessage(info));
    runner->run(params);
  } catch (const std::exception& error) {
    return ffi::Error::Internal(std::string("trtllm-gen decode: ") + error.what());
  }
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) {
    return ffi::Error::Internal(std::string("trtllm-gen decode launch: ") +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

Data_type DtypeFromName(const std::string& name) {
  if (name == "bfloat16") return DATA_TYPE_BF16;
  if (name == "float16") return DATA_TYPE_FP16;
  if (name == "float8_e4m3fn") return DATA_TYPE_E4M3;
  return DATA_TYPE_UNKNOWN;
}

// Sets the dry-run recorders for one thread and clears them on every exit path.
class DryRunScope {
 public:
  DryRunScope(DriverDryRun* driver, bool read_cubins) {
    CurrentDriverDryRun() = driver;
    CubinRequest& request = CurrentCubinRequest();
    request = CubinRequest{};
    request.active = true;
    request.read = read_cubins;
  }
  ~DryRunScope() {
    CurrentDriverDryRun() = nullptr;
    CurrentCubinRequest().active = false;
  }
};

}  // namespace

TrtllmGenBuildInfo GetTrtllmGenBuildInfo() {
#ifdef JAX_SPARSE_MLA_TRTLLM_GEN_STUB_METAINFO
  const std::string hash;
#else
  const std::string hash = tllm_gen_fmha_metainfo_hash;
#endif
  return {kNumKernels, tllm_gen_fmha_cubin_path, hash, JAX_SPARSE_MLA_TRTLLM_GEN_FLASHINFER_VERSION};
}

int64_t TrtllmGenCounterBytes(int64_t batch_size, int64_t num_heads, int64_t sm_count) {
  const int64_t slots = std::max(batch_size * num_heads, sm_count);
  return (slots + 7) / 8 * 8 * static_cast<int64_t>(sizeof(uint32_t));
}

void InstallTrtllmGenCubinCallback() {
  static std::once_flag once;
  std::call_once(once, [] {
    flashinfer::trtllm_cubin_loader::FlashInferSetCubinCallback(&CubinCallback);
  });
}

TrtllmGenSelection SelectTrtllmGenKernel(const TrtllmGenQuery& query) {
  TrtllmGenSelection result;
  CurrentCubinRequest().requests.clear();
  Shape shape;
  shape.q_type = DtypeFromName(query.q_dtype);
  shape.kv_type = DtypeFromName(query.kv_dtype);
  shape.batch = query.batch;
  shape.q_len = query.q_len;
  shape.num_heads = query.num_heads;
  shape.page_size = query.page_size;
  shape.num_pages = query.num_pages;
  shape.top_k = query.top_k;
  shape.sm_count = query.sm_count;
  if (std::string error = CheckShape(shape); !error.empty()) {
    result.error = "jax_sparse_mla trtllm-gen decode: " + error;
    return result;
  }
  if (query.sm != kSM_100 && query.sm != kSM_103) {
    result.error = "sm must be 100 or 103 (FlashInfer's TRTLLM-gen runner checks the same)";
    return result;
  }
  if (shape.batch <= 0 || shape.q_len <= 0 || shape.num_heads <= 0 || shape.num_pages <= 0 ||
      shape.sm_count <= 0) {
    result.error = "batch, q_len, num_heads, num_pages and sm_count must be positive";
    return result;
  }
  InstallTrtllmGenCubinCallback();

  // Stand-ins for device pointers: distinct, 256-byte aligned, never dereferenced on the host
  // (only TMA descriptors, which the dry run records instead of encoding, take their values).
  auto fake = [](uintptr_t slot) { return reinterpret_cast<void*>((uintptr_t{1} << 40) * slot); };
  Pointers ptr;
  ptr.q = fake(1);
  ptr.kv_cache = fake(2);
  ptr.block_tables = static_cast<int32_t*>(fake(3));
  ptr.seq_lens = static_cast<int32_t*>(fake(4));
  ptr.out = fake(5);
  ptr.lse = static_cast<float*>(fake(6));
  ptr.workspace = fake(7);
  // The workspace the Python side allocates for this shape (sm100_trtllm_gen.workspace_bytes).
  ptr.workspace_bytes = 8 * shape.num_heads * shape.batch * ((shape.q_len + 255) / 256 * 256) +
                        kSoftmaxStatsGuardBytes + (size_t{128} << 20) + 256;
  ptr.counter = static_cast<int32_t*>(fake(8));
  const TllmGenFmhaRunnerParams params = MakeRunnerParams(shape, ptr);

  DriverDryRun driver;
  try {
    // What TllmGenFmhaRunner(q, kv, bf16) holds for a GPU of this SM (TllmFmhaKernelFactory::
    // getKernels), built here directly: the factory keys its cache on the current CUDA device.
    TllmGenFmhaKernel kernels(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos, kTableSize,
                              shape.q_type, shape.kv_type, shape.kv_type, DATA_TYPE_BF16,
                              static_cast<unsigned>(query.sm));
    kernels.loadKernels();
    result.candidate_kernels = static_cast<int64_t>(kernels.getNumLoadedKernels());
    auto [found, info] = kernels.checkIfKernelExist(params);  // runner->isSupportedWithInfo
    result.info = info;
    if (!found) {
      result.error = MissingKernelMessage(info);
      return result;
    }
    DryRunScope scope(&driver, query.read_cubins);
    try {
      kernels.run(params);  // runner->run: ends at cuLaunchKernelEx in dry-run mode
      result.error = "the launcher returned without reaching cuLaunchKernelEx";
    } catch (const DriverDryRunLaunch&) {
      // Reached the launch.
    }
  } catch (const std::exception& error) {
    result.error = std::string("trtllm-gen decode: ") + error.what();
  }
  result.function_name = driver.function_name;
  // The cubins requested, and among them the launched function's (the last request may be another
  // kernel's when a later selection pass returns to a kernel loaded before).
  const std::string launched_file = "/" + driver.function_name + ".cubin";
  for (const auto& [path, sha256, bytes] : CurrentCubinRequest().requests) {
    result.requested_cubins.push_back(path);
    const bool is_launched = !driver.function_name.empty() && path.size() >= launched_file.size() &&
                             path.compare(path.size() - launched_file.size(), launched_file.size(),
                                          launched_file) == 0;
    if (is_launched || (driver.function_name.empty() && result.cubin_path.empty())) {
      result.cubin_path = path;
      result.cubin_sha256 = sha256;
      result.cubin_bytes = bytes;
    }
  }
  result.launched = driver.launched;
  result.modules_loaded = driver.modules_loaded;
  result.tensor_maps = driver.tensor_maps;
  for (int i = 0; i < 3; ++i) {
    result.grid[i] = driver.grid[i];
    result.block[i] = driver.block[i];
    result.cluster[i] = driver.cluster[i];
  }
  result.shared_mem_bytes = driver.shared_mem_bytes;
  // The table entry the launched function came from.
  for (unsigned i = 0; i < kTableSize && !driver.function_name.empty(); ++i) {
    const auto& meta = tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos[i];
    if (driver.function_name == meta.mFuncName && isSMCompatible(query.sm, meta.mSM)) {
      result.table_index = i;
      result.table_sha256 = meta.sha256;
      result.table_sm = meta.mSM;
      result.table_shared_mem_bytes = meta.mSharedMemBytes;
      result.table_threads = meta.mThreadsPerCTA;
      result.multi_ctas_kv_mode = meta.mMultiCtasKvMode;
      break;
    }
  }
  return result;
}

}  // namespace jax_sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxSparseMlaTrtllmGenDecode, jax_sparse_mla::TrtllmGenDecode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()               // q
                                  .Arg<xla::ffi::AnyBuffer>()               // kv_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block_tables
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seq_lens
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // lse
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // counter
                                  .Attr<float>("bmm1_scale")
                                  .Attr<float>("bmm2_scale")
                                  .Attr<int64_t>("sparse_mla_top_k"));
