// Empty stand-in for cuBLAS's cublas_v2.h. FlashInfer's trtllm/common/cudaUtils.h includes it but uses
// nothing from it, and fmhaReduction.cu (the only file built with this folder on its include path)
// should not require a cuBLAS install: the CUDA toolkit in CI ships nvcc without cuBLAS headers.
#pragma once
