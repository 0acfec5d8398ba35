// nanobind module exposing the CUDA handlers defined in cuda_kernels.cu.
#include "registrations.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_compress_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_verify_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_commit_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_attention_cuda);       // attention_cuda.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_quant_gmm_cuda);       // quant_gmm_cuda.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_indexer_scores_cuda);  // indexer_cuda.cu

NB_MODULE(cuda, m) {
  oc128::define_module(m, oc128_compress_cuda, oc128_verify_cuda, oc128_commit_cuda, oc128_attention_cuda,
                       oc128_quant_gmm_cuda, oc128_indexer_scores_cuda);
}
