// CPU handler of the quantized grouped matmul op (quant_gmm_ffi.h): a plain reference loop, one (row, output
// column) at a time, each weight decoded (code value times its group's scale in float32, rounded to x's dtype)
// and the products summed in float32 in column order. Padding rows and the rows of unused tiles are zero. It
// does not split K (the workspace is [0]).
#include <cstring>
#include <utility>

#include "quant_gmm_ffi.h"

namespace oc128 {
namespace {

struct QuantGmmCpu {
  // The float32 product of layout row `row` (x's row pointer) and weight row n of expert e.
  template <Format F, typename T>
  static float dot(const QuantGmmArgs<T>& a, const T* row, int64_t e, int64_t n) {
    using Codes = CodeFormat<F>;
    const int64_t groups = (a.k + Codes::kGroup - 1) / Codes::kGroup;
    const uint8_t* codes = a.codes + (e * a.n + n) * (a.k / Codes::kPerByte);
    float acc = 0.0f;
    for (int64_t c = 0; c < a.k; ++c) {
      const float weight = Codes::value(codes, c) * a.scale((e * a.n + n) * groups + c / Codes::kGroup);
      acc += to_float(row[c]) * to_float(from_float<T>(weight));
    }
    return acc;
  }

  template <Format F, typename T>
  static void run(const QuantGmmArgs<T>& a) {
    const size_t out_bytes = a.gated ? sizeof(T) : sizeof(float);
    std::memset(a.out, 0, size_t(a.tiles * a.block_rows * a.out_cols) * out_bytes);
    for (int64_t t = 0; t < a.tiles; ++t) {
      const int64_t e = a.expert(t);
      for (int64_t r = 0; r < a.rows(t); ++r) {
        const int64_t row = t * a.block_rows + r;
        const T* x = a.x + row * a.k;
        for (int64_t c = 0; c < a.out_cols; ++c)
          a.store(row, c, dot<F>(a, x, e, c), a.gated ? dot<F>(a, x, e, a.out_cols + c) : 0.0f);
      }
    }
  }

  template <typename T>
  ffi::Error quant_gmm(const QuantGmmArgs<T>& a) {
    if (a.splits > 1) return invalid("workspace: the CPU handler does not split K, expected [0]");
    if (a.format == Format::kFp4)
      run<Format::kFp4>(a);
    else
      run<Format::kFp8>(a);
    return ffi::Error::Success();
  }
};

constexpr auto on_cpu = [](auto... operands) {
  QuantGmmCpu backend;
  return QuantGmm::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_quant_gmm_cpu, oc128::on_cpu, oc128::bind<oc128::QuantGmm>(xla::ffi::Ffi::Bind()));
