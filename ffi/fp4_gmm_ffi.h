// The FP4 grouped matmul op (oc128_fp4_gmm): the rows of a mixture of experts' padded layout (tiles of
// block_rows rows, each tile one expert's) by their tile's expert's FP4 weights, as DeepSeek-V4 releases them
// (e2m1 codes packed two a byte along K, the low nibble the even column; one e8m0 scale per 32 columns of a
// row). Shared by the CPU handler (a reference loop, fp4_gmm_cpu.cc) and the CUDA kernel (fp4_gmm_cuda.cu): the
// operands, their checks and the decoding. The platform supplies a Backend with
//   template <class T> ffi::Error fp4_gmm(const Fp4GmmArgs<T>&);
//
// Operands (row-major):
//   x            [tiles * block_rows, K]     float32 or bfloat16: the layout's rows
//   codes        [experts, N, K / 2]         uint8: two e2m1 codes a byte
//   scales       [experts, N, K / 32]        uint8: e8m0 exponents e, 2^(e - 127) (0: 2^-127; 255: NaN)
//   tile_expert  [tiles]                     int32: each tile's expert; outside [0, experts): an unused tile
//   tile_rows    [tiles]                     int32: how many of the tile's first rows hold a pair (clipped
//                                            to [0, block_rows]); the rest are padding
//   out          [tiles * block_rows, N]     float32, or gated [.., N / 2] in x's dtype
//   gated        attribute (int64, 0 or 1): N holds each expert's gate rows then its up rows, and out is
//                silu(min(g, limit)) * clip(u, -limit, limit) of the gate's and the up projection's products
//   limit        attribute (float32, > 0; +inf: no limit)
// out[row, n] = sum_k x[row, k] * value(codes[e, n, k]) * scale(scales[e, n, k / 32]) in float32, e the row's
// tile's expert, for the rows a tile holds; 0 for its padding rows and the rows of unused tiles (whose x is
// never read). The CUDA kernel takes bfloat16 x only, and is exact for the exponents the loader accepts
// ([2, 252], quant.EXPONENTS: every weight a normal bfloat16 number).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "oc128_ffi.h"

namespace oc128 {

constexpr int64_t kFp4Group = 32;  // columns per scale: 16 bytes of codes

// The value of an e2m1 code (0..15): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0.
OC128_FN float e2m1_value(uint32_t code) {
  const uint32_t exponent = (code >> 1) & 3u, mantissa = code & 1u;
  const float magnitude = exponent ? float(2 + mantissa) * float(1u << exponent) * 0.25f : 0.5f * float(mantissa);
  return code & 8u ? -magnitude : magnitude;
}

// The value of an e8m0 scale byte: 2^(e - 127), built as float32 bits (0: the subnormal 2^-127; 255: NaN).
OC128_FN float e8m0_value(uint8_t e) {
  return float_from_bits(e == 0 ? (1u << 22) : e == 255 ? 0x7FC00000u : uint32_t(e) << 23);
}

// silu(min(g, limit)) * clip(u, -limit, limit): the gated value of a gate/up pair of products.
OC128_FN float swiglu_value(float g, float u, float limit) {
  g = fminf(g, limit);
  u = fminf(fmaxf(u, -limit), limit);
  return g / (1.0f + expf(-g)) * u;
}

template <typename T>
struct Fp4GmmArgs {
  const T* x;
  const uint8_t* codes;
  const uint8_t* scales;
  const int32_t* tile_expert;
  const int32_t* tile_rows;
  void* out;  // float (not gated) or T (gated)
  int64_t tiles, block_rows, experts, n, k, out_cols;
  bool gated;
  float limit;

  // The expert of tile t, or -1 for an unused tile.
  OC128_FN int64_t expert(int64_t t) const {
    const int32_t e = tile_expert[t];
    return e >= 0 && e < experts ? e : -1;
  }

  // How many of tile t's first rows hold a pair (0 for an unused tile).
  OC128_FN int64_t rows(int64_t t) const {
    const int32_t r = tile_rows[t];
    return expert(t) < 0 || r <= 0 ? 0 : r < block_rows ? r : block_rows;
  }

  // Stores the float32 product(s) of output column c of layout row `row`: not gated, `first` itself; gated,
  // the gated value of `first` (the gate's) and `second` (the up projection's), in T.
  OC128_FN void store(int64_t row, int64_t c, float first, float second) const {
    if (gated)
      static_cast<T*>(out)[row * out_cols + c] = from_float<T>(swiglu_value(first, second, limit));
    else
      static_cast<float*>(out)[row * out_cols + c] = first;
  }
};

template <typename Backend>
ffi::Error fp4_gmm(Backend& backend, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> scales,
                   ffi::Buffer<ffi::S32> tile_expert, ffi::Buffer<ffi::S32> tile_rows, ffi::Result<ffi::AnyBuffer> out,
                   int64_t gated, float limit) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), td = tile_expert.dimensions();
  if (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16)
    return invalid("x: dtype must be float32 or bfloat16");
  if (xd.size() != 2) return invalid("x: expected rank 2 [rows, K], got " + shape_string(xd));
  if (cd.size() != 3) return invalid("codes: expected rank 3 [experts, N, K / 2], got " + shape_string(cd));
  if (td.size() != 1) return invalid("tile_expert: expected rank 1 [tiles], got " + shape_string(td));
  const int64_t rows = xd[0], k = xd[1], experts = cd[0], n = cd[1], tiles = td[0];
  if (k % kFp4Group) return invalid("x: K must be a multiple of 32, got " + std::to_string(k));
  OC128_RETURN_IF_ERROR(check_shape("codes", cd, {experts, n, k / 2}));
  OC128_RETURN_IF_ERROR(check_shape("scales", scales.dimensions(), {experts, n, k / kFp4Group}));
  OC128_RETURN_IF_ERROR(check_shape("tile_rows", tile_rows.dimensions(), {tiles}));
  if (tiles == 0 ? rows != 0 : rows % tiles)
    return invalid("x: rows must be tiles * block_rows, got " + std::to_string(rows) + " rows for " +
                   std::to_string(tiles) + " tiles");
  if (gated != 0 && gated != 1) return invalid("gated: must be 0 or 1, got " + std::to_string(gated));
  if (gated && n % 2) return invalid("codes: gated, N must be even, got " + std::to_string(n));
  if (!(limit > 0.0f)) return invalid("limit: must be > 0 (+inf: none)");
  const int64_t out_cols = gated ? n / 2 : n;
  OC128_RETURN_IF_ERROR(check_shape("out", out->dimensions(), {rows, out_cols}));
  const auto out_type = gated ? x.element_type() : ffi::F32;
  if (out->element_type() != out_type) return invalid("out: dtype must be x's gated, float32 otherwise");
  if (rows * out_cols == 0) return ffi::Error::Success();
  auto run = [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const Fp4GmmArgs<T> args{typed,
                             codes.typed_data(),
                             scales.typed_data(),
                             tile_expert.typed_data(),
                             tile_rows.typed_data(),
                             out->untyped_data(),
                             tiles,
                             rows / tiles,
                             experts,
                             n,
                             k,
                             out_cols,
                             gated == 1,
                             limit};
    return backend.fp4_gmm(args);
  };
  const void* data = x.untyped_data();
  return x.element_type() == ffi::F32 ? run(static_cast<const float*>(data)) : run(static_cast<const Bf16*>(data));
}

struct Fp4Gmm {
  static constexpr const char* kTarget = "oc128_fp4_gmm";
  static constexpr auto kOperands = std::make_tuple(
      NamedArg<ffi::AnyBuffer>{"x"}, NamedArg<ffi::Buffer<ffi::U8>>{"codes"}, NamedArg<ffi::Buffer<ffi::U8>>{"scales"},
      NamedArg<ffi::Buffer<ffi::S32>>{"tile_expert"}, NamedArg<ffi::Buffer<ffi::S32>>{"tile_rows"},
      NamedRet<ffi::AnyBuffer>{"out"}, NamedAttr<int64_t>{"gated"}, NamedAttr<float>{"limit"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return fp4_gmm(backend, std::move(operands)...);
  }
};

}  // namespace oc128
