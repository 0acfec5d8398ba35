// The check every CUDA handler makes after its launches (cuda_kernels.cu, attention_cuda.cu, quant_gmm_cuda.cu,
// indexer_cuda.cu): the last CUDA error, as the handler's result.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "oc128_ffi.h"

namespace oc128 {

// Success, or an internal error "jax_oc128: <what> failed: <CUDA's message>"; clears CUDA's last error.
inline ffi::Error launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_oc128: ") + what + " failed: " + cudaGetErrorString(err));
}

}  // namespace oc128
