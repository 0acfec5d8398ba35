// CPU handlers of jax_oc128: loop over the work items of oc128_math.h, exposed through nanobind.
#include <cstring>
#include <utility>

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
    for (int64_t row = 0; row < args.rows; ++row) {
      const bool processed = args.call_rows().processed(row);
      for (int64_t lk = 0; lk < call_layers; ++lk)
        for (int64_t g = 0; g < segments; ++g)
          for (int64_t d = 0; d < args.layout.dim; ++d) compress_channel(args, lk, row, g, d, processed);
    }
    return ffi::Error::Success();
  }

  template <int N, bool kTree, bool kBanks, typename T>
  ffi::Error verify(const VerifyArgs<T>& args, int64_t call_layers) {
    for (int64_t row = 0; row < args.rows; ++row) {
      const bool processed = args.call_rows().processed(row);
      for (int64_t lk = 0; lk < call_layers; ++lk)
        for (int64_t d = 0; d < args.layout.dim; ++d) verify_channel<N, kTree, kBanks>(args, lk, row, d, processed);
    }
    return ffi::Error::Success();
  }

  ffi::Error commit(const CommitArgs& args, int64_t num_layers) {
    for (int64_t row = 0; row < args.rows; ++row) {
      const bool processed = args.call_rows().processed(row);
      for (int64_t l = 0; l < num_layers; ++l)
        for (int64_t w = 0; w < args.words_per_slot; ++w) commit_word(args, l, row, w, processed);
    }
    return ffi::Error::Success();
  }
};

// The handler of Op: its operands as its binding (bind<Op>) decodes them.
template <typename Op>
constexpr auto on_cpu = [](auto... operands) {
  CpuBackend backend;
  return Op::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_compress_cpu, oc128::on_cpu<oc128::Compress>,
                              oc128::bind<oc128::Compress>(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_verify_cpu, oc128::on_cpu<oc128::Verify>,
                              oc128::bind<oc128::Verify>(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_commit_cpu, oc128::on_cpu<oc128::Commit>,
                              oc128::bind<oc128::Commit>(xla::ffi::Ffi::Bind()));

XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_attention_cpu);       // attention_cpu.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_quant_gmm_cpu);       // quant_gmm_cpu.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(oc128_indexer_scores_cpu);  // indexer_cpu.cc

NB_MODULE(cpu, m) {
  oc128::define_module(m, oc128_compress_cpu, oc128_verify_cpu, oc128_commit_cpu, oc128_attention_cpu,
                       oc128_quant_gmm_cpu, oc128_indexer_scores_cpu);
}
