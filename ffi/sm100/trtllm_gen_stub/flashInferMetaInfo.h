// Stand-in for FlashInfer's generated TRTLLM-gen kernel table (include/flashInferMetaInfo.h of the
// trtllm-gen cubin artifact). That header is not part of the flashinfer-python wheel: FlashInfer's
// JIT downloads it with the cubins. ffi/CMakeLists.txt uses the real header when it finds one
// (JAX_SPARSE_MLA_TRTLLM_GEN_METAINFO, $FLASHINFER_CUBIN_DIR, the flashinfer-cubin package or
// ~/.cache/flashinfer/cubins) and this stand-in otherwise, so that the launcher code still compiles
// for sm_100a. Built against it, the TRTLLM-gen handler knows no kernel and every call fails with
// "Missing TRTLLM-GEN kernel"; Python sees trtllm_gen_build_info()["num_kernels"] == 0 and reports
// the kernel as unavailable before any call.
//
// The struct lists the fields that fmhaKernels.cuh, kernelParams.h and fmhaReduction.cu of
// flashinfer-python 0.7.2.post1 read; their order does not matter here because the table is empty.
#pragma once

#include <flashinfer/trtllm/fmha/kernelParams.h>

#define JAX_SPARSE_MLA_TRTLLM_GEN_STUB_METAINFO 1

namespace tensorrt_llm {
namespace kernels {

struct TllmGenFmhaKernelMetaInfo {
  Data_type mDataTypeQ;
  Data_type mDataTypeKv;
  Data_type mDataTypeK;
  Data_type mDataTypeV;
  Data_type mDataTypeO;
  int mTileSizeQ;
  int mTileSizeKv;
  int mStepQ;
  int mStepKv;
  int mHeadDimPerCtaV;
  int mHeadDimQk;
  int mHeadDimV;
  int mSM;
  const unsigned char* mCubin;
  unsigned int mCubinSize;
  const char* mFuncName;
  int mSharedMemBytes;
  int mThreadsPerCTA;
  int mQkvLayout;
  int mNumTokensPerPage;
  int mMaskType;
  int mKernelType;
  int mTileScheduler;
  int mMultiCtasKvMode;
  int mNumEltsPerSageAttnBlkQ;
  int mNumEltsPerSageAttnBlkK;
  int mNumEltsPerSageAttnBlkP;
  int mNumEltsPerSageAttnBlkV;
  bool mGroupsHeadsQ;
  bool mGroupsTokensHeadsQ;
  bool mReuseSmemKForV;
  bool m2CtaMma;
  int mSparseAttn;
  bool mSkipsSoftmaxWhenPossible;
  bool mFp16Softmax;
  bool mUsesSpcompress;
  bool mEnablesBf16QFp8KvKOnlyTransform;
  bool mSeparateTransformedKv;
  bool mFusesDsv4InvRopeFp8Quant;
  bool mUsesDsv4Ue8m0ScaleO;
  const char* sha256;
};

// One entry for SM 0, which no GPU matches (C++ has no empty arrays): the table is empty in effect.
static const TllmGenFmhaKernelMetaInfo sTllmGenFmhaKernelMetaInfos[] = {
    {DATA_TYPE_UNKNOWN, DATA_TYPE_UNKNOWN, DATA_TYPE_UNKNOWN, DATA_TYPE_UNKNOWN, DATA_TYPE_UNKNOWN,
     0, 0, 0, 0, 0, 0, 0, /*mSM=*/0, nullptr, 0, "", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, false,
     false, false, false, 0, false, false, false, false, false, false, false, ""}};

}  // namespace kernels
}  // namespace tensorrt_llm
