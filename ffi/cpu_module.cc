// CPU handlers of jax_oc128: loop over the work items of oc128_math.h, exposed through nanobind.
#include <cstring>

#include "oc128_ffi.h"
#include "registrations.h"

namespace oc128 {
namespace {

struct CpuBackend {
  ffi::Error copy(void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return ffi::Error::Success();
  }

  template <typename T>
  ffi::Error compress(const CompressArgs<T>& args, int64_t call_layers, int64_t segments) {
    for (int64_t lk = 0; lk < call_layers; ++lk)
      for (int64_t row = 0; row < args.rows; ++row)
        for (int64_t g = 0; g < segments; ++g)
          for (int64_t d = 0; d < args.layout.dim; ++d) compress_channel(args, lk, row, g, d);
    return ffi::Error::Success();
  }

  template <int N, typename T>
  ffi::Error verify(const VerifyArgs<T>& args, int64_t call_layers) {
    for (int64_t lk = 0; lk < call_layers; ++lk)
      for (int64_t row = 0; row < args.rows; ++row)
        for (int64_t d = 0; d < args.layout.dim; ++d) verify_channel<N>(args, lk, row, d);
    return ffi::Error::Success();
  }

  ffi::Error commit(const CommitArgs& args, int64_t num_layers) {
    for (int64_t l = 0; l < num_layers; ++l)
      for (int64_t row = 0; row < args.rows; ++row)
        for (int64_t w = 0; w < args.words_per_slot; ++w) commit_word(args, l, row, w);
    return ffi::Error::Success();
  }
};

ffi::Error CompressCpu(ffi::AnyBuffer state, ffi::Buffer<ffi::F32> kv_score, ffi::Buffer<ffi::S32> seq_lens,
                       ffi::Buffer<ffi::S32> new_lens, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> ape,
                       ffi::Result<ffi::AnyBuffer> state_out, ffi::Result<ffi::Buffer<ffi::F32>> entries,
                       ffi::Result<ffi::Buffer<ffi::S32>> entry_blocks, int64_t layer) {
  CpuBackend backend;
  return compress(backend, state, kv_score, seq_lens, new_lens, slots, ape, state_out, entries, entry_blocks, layer);
}

ffi::Error VerifyCpu(ffi::AnyBuffer state, ffi::Buffer<ffi::F32> kv_score, ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> ape, ffi::Buffer<ffi::S32> pending,
                     ffi::Result<ffi::AnyBuffer> state_out, ffi::Result<ffi::Buffer<ffi::F32>> entries,
                     ffi::Result<ffi::Buffer<ffi::S32>> entry_blocks, int64_t layer) {
  CpuBackend backend;
  return verify(backend, state, kv_score, seq_lens, slots, ape, pending, state_out, entries, entry_blocks, layer);
}

ffi::Error CommitCpu(ffi::AnyBuffer state, ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> accept_lens,
                     ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> state_out, int64_t layer,
                     int64_t num_layers) {
  CpuBackend backend;
  return commit(backend, state, seq_lens, accept_lens, slots, state_out, layer, num_layers);
}

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_compress_cpu, oc128::CompressCpu, oc128::bind_compress(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_verify_cpu, oc128::VerifyCpu, oc128::bind_verify(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_commit_cpu, oc128::CommitCpu, oc128::bind_commit(xla::ffi::Ffi::Bind()));

NB_MODULE(_oc128_cpu, m) {
  m.def("registrations", []() { return oc128::registrations(oc128_compress_cpu, oc128_verify_cpu, oc128_commit_cpu); });
}
