// nanobind module exposing the CUDA handlers defined in cuda_kernels.cu.
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_compress_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_verify_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_commit_cuda);

NB_MODULE(_oc128_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict targets;
    targets["oc128_compress"] = nanobind::capsule(reinterpret_cast<void*>(oc128_compress_cuda));
    targets["oc128_verify"] = nanobind::capsule(reinterpret_cast<void*>(oc128_verify_cuda));
    targets["oc128_commit"] = nanobind::capsule(reinterpret_cast<void*>(oc128_commit_cuda));
    return targets;
  });
}
