// XLA FFI handler: sparse MLA decode on SM100/SM103 through FlashInfer's TRTLLM-gen kernels, the
// kernel vLLM's FlashInferMLASparseImpl calls (trtllm_batch_decode_with_kv_cache_mla with
// sparse_mla_top_k = K).
//
// FlashInfer's launcher (data/csrc/trtllm_fmha_kernel_launcher.cu) is written against tvm-ffi:
// compiling it would pull tvm-ffi's runtime library into the process. Its body is a translation of
// tensor arguments into TllmGenFmhaRunnerParams followed by TllmGenFmhaRunner::run, and that runner
// (data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh + fmhaKernels.cuh, plus fmhaReduction.cu) is
// plain C++/CUDA. So this file fills the same TllmGenFmhaRunnerParams as
// trtllm_paged_attention_launcher does for ForGen mode (launcher.cu:165-390, the values
// trtllm_paged_attention_decode passes for MLA: launcher.cu:455-640), restricted to the sparse MLA
// decode: static token sparsity, one KV head, shared K/V pool, no sinks, no block scales, no
// sliding window, no skip-softmax. Each deviation from that code is commented.
//
// The kernels themselves are cubins that FlashInfer loads lazily per configuration; our callback
// (cubin_loader.cc) reads them from disk and checks their sha256. No Python and no download at run
// time.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include <flashinfer/allocator.h>
#include <flashinfer/trtllm/fmha/fmhaRunner.cuh>
#include <flashinfer/trtllm/fmha/fmhaRunnerParams.h>

// FlashInfer's cubin hook: getCubin() asks a callback, which answers through
// FlashInferSetCurrentCubin (the launcher includes the header the same way, launcher.cu:1279).
namespace flashinfer::trtllm_cubin_loader {
#include <flashinfer/cubin_loader.h>
}  // namespace flashinfer::trtllm_cubin_loader

#include "common/cubin_loader.h"
#include "sm100/trtllm_gen.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sparse_mla {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kHeadDimQk = 576;  // kv_lora_rank 512 + qk_rope_head_dim 64
constexpr int64_t kHeadDimVo = 512;
// launcher.cu kTrtllmGenSoftmaxStatsGuardBytes: pad after the softmax-stats carve-out.
constexpr size_t kSoftmaxStatsGuardBytes = 1 << 20;

#ifdef JAX_SPARSE_MLA_TRTLLM_GEN_STUB_METAINFO
constexpr int64_t kNumKernels = 0;
#else
constexpr int64_t kNumKernels = sizeof(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos) /
                                sizeof(tensorrt_llm::kernels::sTllmGenFmhaKernelMetaInfos[0]);
#endif

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

void CubinCallback(const char* path, const char* sha256) {
  std::string data, error;
  // Exceptions cross FlashInfer's getCubin() (C++ calling a C++ function through a pointer) and
  // reach the handler's catch below.
  if (!ResolveCubin(path, sha256, &data, &error)) throw std::runtime_error(error);
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
  const int64_t batch = q_dims[0], q_len = q_dims[1], num_heads = q_dims[2];
  if (kv_dims.size() != 3 || kv_dims[2] != kHeadDimQk) {
    return Invalid("kv_cache must be [num_pages, page_size, 576]");
  }
  const int64_t num_pages = kv_dims[0], page_size = kv_dims[1];
  if (page_size != 32 && page_size != 64) return Invalid("page_size must be 32 or 64");
  if (num_heads > 64 && num_heads < 128) return Invalid("64 < num_heads < 128 is not supported");
  if (sparse_mla_top_k <= 0 || sparse_mla_top_k % 4 != 0) {
    return Invalid("sparse_mla_top_k must be a positive multiple of 4");
  }
  if (table_dims.size() != 3 || table_dims[0] != batch || table_dims[1] != q_len ||
      table_dims[2] != sparse_mla_top_k) {
    return Invalid("block_tables must be [B, q_len, sparse_mla_top_k]");
  }
  if (seq_lens.dimensions().size() != 1 || seq_lens.dimensions()[0] != batch) {
    return Invalid("seq_lens must be [B]");
  }
  const Data_type q_type = ToTllm(q.element_type());
  const Data_type kv_type = ToTllm(kv_cache.element_type());
  // vLLM's rule (FlashInferMLASparseImpl): trtllm-gen takes a query of the cache's dtype.
  if (q_type == DATA_TYPE_UNKNOWN || q_type != kv_type) {
    return Invalid("q and kv_cache must both be bf16, both f16 or both float8_e4m3fn");
  }
  const int sm_count = SmCount(device);
  if (sm_count <= 0) return ffi::Error::Internal("trtllm-gen decode: cannot read the SM count");
  const int64_t counter_bytes = TrtllmGenCounterBytes(batch, num_heads, sm_count);
  if (static_cast<int64_t>(counter->size_bytes()) < counter_bytes) {
    return Invalid("the counter buffer has " + std::to_string(counter->size_bytes()) +
                   " bytes, the kernel needs " + std::to_string(counter_bytes));
  }
  if (reinterpret_cast<std::uintptr_t>(counter->untyped_data()) % 16 != 0) {
    return Invalid("the counter buffer must be 16-byte aligned");
  }
  if (batch == 0 || q_len == 0 || num_heads == 0) return ffi::Error::Success();

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
      const int key = int(q_type) | (int(kv_type) << 8);
      auto it = cache.runners.find(key);
      if (it == cache.runners.end()) {
        // The output is always bf16 for MLA (mla/_core.py allocates it so).
        it = cache.runners
                 .emplace(key, std::make_shared<TllmGenFmhaRunner>(q_type, kv_type, kv_type,
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

    TllmGenFmhaRunnerParams params{};
    params.mBf16QFp8KvTransformMode = static_cast<Bf16QFp8KvTransformMode>(0);
    params.qPtr = q.untyped_data();
    params.kPtr = kv_cache.untyped_data();
    params.vPtr = kv_cache.untyped_data();  // K and V are views of the same latent rows
    params.slidingWindowKvPoolPtr = nullptr;
    params.kvPageIdxPtr = block_tables.typed_data();
    params.kSfBasePtr = nullptr;
    params.vSfBasePtr = nullptr;
    params.seqLensKvPtr = seq_lens.typed_data();
    params.oPtr = out->untyped_data();
    params.mHeadDimQk = kHeadDimQk;
    params.mHeadDimV = kHeadDimVo;
    params.mNumHeadsQ = num_heads;
    params.mNumHeadsKv = 1;
    params.mNumHeadsQPerKv = num_heads;
    params.mBatchSize = batch;
    params.mMaxSeqLenKv = sparse_mla_top_k;  // max_seq_len = K, as vLLM passes
    params.mMaxNumPagesPerSeqKv = sparse_mla_top_k;  // block_tables.size(-1)
    params.mNumTokensPerPage = page_size;  // the sparse kernels use 1 (fmhaKernels.cuh:549)
    params.mQkvLayout = QkvLayout::PagedKv;
    params.mMultiProcessorCount = sm_count;
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
    params.mNumPagesInMemPool = num_pages;  // shared K/V pool
    params.stream = stream;
    params.outputScale = bmm2_scale;
    params.outputScalePtr = nullptr;
    params.mScaleSfKv = 1.0f;
    params.kvSfScalePtr = nullptr;
    params.scaleSoftmaxLog2 = bmm1_scale * M_LOG2E;
    params.scaleSoftmaxLog2Ptr = nullptr;
    params.oSfPtr = nullptr;
    params.dsv4InvRopeCosSinCachePtr = nullptr;
    params.dsv4OScalePtr = nullptr;
    params.mDsv4ScaleBufM = 0;
    params.mFusesDsv4InvRopeFp8Quant = false;
    params.mSfStartTokenIdx = 0;
    params.mScaleSfO = -1.0;  // o_sf_scale = -1: no fp4 output
    params.mChunkedAttentionSize = INT_MAX;
    params.mAttentionWindowSize = INT_MAX;  // window_left = -1
    params.mMaxSeqLenQ = q_len;
    params.mSumOfSeqLensQ = batch * q_len;
    params.mUsesSharedPagedKvIdx = true;
    params.ptrAttentionSinks = nullptr;
    params.enable_pdl = false;  // the previous kernel on XLA's stream does not trigger PDL
    params.mUseBlockSparseAttention = false;
    params.mSparseMlaType = TrtllmGenSparseMlaType::StaticTokenSparse;
    params.mSparseMlaTopK = sparse_mla_top_k;
    params.sparseMlaTopKLensPtr = nullptr;
    params.mHasSlidingWindowKvPool = false;
    // Generation mode (launcher.cu ForGen branch; MLA decode uses the dense mask).
    params.mMaskType = TrtllmGenAttentionMaskType::Dense;
    params.mKernelType = FmhaKernelType::Generation;
    params.mTileScheduler = TileScheduler::Static;
    params.mMultiCtasKvMode = true;
    params.cumSeqLensQPtr = nullptr;
    params.cumSeqLensKvPtr = nullptr;
    params.multiCtasKvCounterPtr = reinterpret_cast<int32_t*>(counter->untyped_data());

    // Workspace carve-outs in the launcher's order: softmax stats (LSE requested), then the
    // multi-CTA scratch takes the rest.
    flashinfer::AlignedAllocator allocator(workspace->untyped_data(), workspace->size_bytes());
    const size_t softmax_slots = static_cast<size_t>(num_heads) * static_cast<size_t>(batch) *
                                 static_cast<size_t>((q_len + 255) / 256 * 256);
    params.softmaxStatsPtr = allocator.aligned_alloc<float2>(
        sizeof(float2) * softmax_slots + kSoftmaxStatsGuardBytes, 16, "trtllm_gen_softmax_workspace");
    params.lsePtr = lse->typed_data();
    params.lseScale = 1.0f;  // base 2, FlashInfer's default for trtllm-gen
    params.lseStrideTokens = num_heads;
    params.lseStrideHeads = 1;
    params.multiCtasKvScratchPtr =
        allocator.aligned_alloc<void>(0, 16, "trtllm_gen_scratch_workspace");
    params.mSkipsSoftmaxWhenPossible = false;
    params.mSkipSoftmaxThresholdScaleFactor = 0.0f;
    params.mUseFp16Softmax = false;
    params.mUsesSpcompress = false;

    auto [found, info] = runner->isSupportedWithInfo(params);
    if (!found) {
      std::string message = "Missing TRTLLM-GEN kernel (decode): " + info;
      if (kNumKernels == 0) {
        message +=
            " (this build has no TRTLLM-gen kernel table: flashInferMetaInfo.h was not found at "
            "build time; see ffi/CMakeLists.txt JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO)";
      }
      return ffi::Error::Internal(message);
    }
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

}  // namespace

TrtllmGenBuildInfo GetTrtllmGenBuildInfo() {
#ifdef JAX_SPARSE_MLA_TRTLLM_GEN_STUB_METAINFO
  const std::string hash;
#else
  const std::string hash = tllm_gen_fmha_metainfo_hash;
#endif
  return {kNumKernels, tllm_gen_fmha_cubin_path, hash};
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
