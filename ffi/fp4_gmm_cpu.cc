// CPU handler of the FP4 grouped matmul op (fp4_gmm_ffi.h): a plain reference loop, one (row, output column) at
// a time, each weight decoded (code value times its group's scale, exact) and the products summed in float32 in
// column order. Padding rows and the rows of unused tiles are zero.
#include <cstring>
#include <utility>

#include "fp4_gmm_ffi.h"

namespace oc128 {
namespace {

struct Fp4GmmCpu {
  // The float32 product of layout row `row` (x's row pointer) and weight row n of expert e.
  template <typename T>
  static float dot(const Fp4GmmArgs<T>& a, const T* row, int64_t e, int64_t n) {
    const uint8_t* codes = a.codes + (e * a.n + n) * (a.k / 2);
    const uint8_t* scales = a.scales + (e * a.n + n) * (a.k / kFp4Group);
    float acc = 0.0f;
    for (int64_t c = 0; c < a.k; ++c) {
      const uint32_t code = c % 2 ? codes[c / 2] >> 4 : codes[c / 2] & 15u;
      acc += to_float(row[c]) * (e2m1_value(code) * e8m0_value(scales[c / kFp4Group]));
    }
    return acc;
  }

  template <typename T>
  ffi::Error fp4_gmm(const Fp4GmmArgs<T>& a) {
    const size_t out_bytes = a.gated ? sizeof(T) : sizeof(float);
    std::memset(a.out, 0, size_t(a.tiles * a.block_rows * a.out_cols) * out_bytes);
    for (int64_t t = 0; t < a.tiles; ++t) {
      const int64_t e = a.expert(t);
      for (int64_t r = 0; r < a.rows(t); ++r) {
        const int64_t row = t * a.block_rows + r;
        const T* x = a.x + row * a.k;
        for (int64_t c = 0; c < a.out_cols; ++c)
          a.store(row, c, dot(a, x, e, c), a.gated ? dot(a, x, e, a.out_cols + c) : 0.0f);
      }
    }
    return ffi::Error::Success();
  }
};

constexpr auto on_cpu = [](auto... operands) {
  Fp4GmmCpu backend;
  return Fp4Gmm::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_fp4_gmm_cpu, oc128::on_cpu, oc128::bind<oc128::Fp4Gmm>(xla::ffi::Ffi::Bind()));
