// The quantized grouped matmul op (oc128_quant_gmm): the rows of a padded layout (tiles of block_rows rows, each
// tile one expert's; a linear layer's groups are its experts) by their tile's expert's weights in one of
// DeepSeek-V4's released formats, which the codes' dtype names:
//   FP4 (uint8 codes): e2m1 codes packed two a byte along K, the low nibble the even column; one e8m0 scale per
//       32 columns of a row (the routed experts);
//   FP8 (float8_e4m3fn codes): one e4m3 code a byte; one scale per 128 columns of a row (the last group may be
//       partial), e8m0 or float32 (the 128 x 128 block scales repeated over their rows: the linear layers, and
//       the FP8 experts of the Base checkpoints with float32 scales).
// Shared by the CPU handler (a reference loop, quant_gmm_cpu.cc) and the CUDA kernel (quant_gmm_cuda.cu): the
// operands, their checks and the decoding. The platform supplies a Backend with
//   template <class T> ffi::Error quant_gmm(const QuantGmmArgs<T>&);
//
// Operands (row-major):
//   x            [tiles * block_rows, K]     float32 or bfloat16: the layout's rows
//   codes        [experts, N, K / 2] uint8 (FP4, K % 32 == 0) or [experts, N, K] float8_e4m3fn (FP8, K % 16 == 0)
//   scales       [experts, N, K / 32] uint8 (FP4) or [experts, N, ceil(K / 128)] uint8 or float32 (FP8):
//                uint8 an e8m0 exponent e, 2^(e - 127) (0: 2^-127; 255: NaN)
//   tile_expert  [tiles]                     int32: each tile's expert; outside [0, experts): an unused tile
//   tile_rows    [tiles]                     int32: how many of the tile's first rows hold a pair (clipped
//                                            to [0, block_rows]); the rest are padding
//   out          [tiles * block_rows, N]     float32, or gated [.., N / 2] in x's dtype
//   workspace    [0] or [splits * tiles * block_rows * N], splits >= 2   float32: the CUDA kernel's split of K
//                into `splits` parts, each part's products summed there, then the parts in their order (the CPU
//                handler does not split: it takes [0] only)
//   gated        attribute (int64, 0 or 1): N holds each expert's gate rows then its up rows, and out is
//                silu(min(g, limit)) * clip(u, -limit, limit) of the gate's and the up projection's products
//   limit        attribute (float32, > 0; +inf: no limit)
// out[row, n] = sum_k x[row, k] * w[e, n, k] in float32, e the row's tile's expert and w its weight: the code's
// value times its scale in float32, rounded to x's dtype (as the model dequantizes it, quant.dequantize; exact
// for e8m0 scales of the exponents the loader accepts), for the rows a tile holds; 0 for its padding rows and the
// rows of unused tiles (whose x is never read). An e4m3 NaN code (0x7F, 0xFF) is NaN. The CUDA kernel takes
// bfloat16 x and e8m0 scales only, and is exact for the exponents the loader accepts (quant.EXPONENTS: FP4
// [2, 252], FP8 [10, 246]: every weight a normal bfloat16 number).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "oc128_ffi.h"

namespace oc128 {

enum class Format { kFp4, kFp8 };

// The value of an e2m1 code (0..15): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0.
OC128_FN float e2m1_value(uint32_t code) {
  const uint32_t exponent = (code >> 1) & 3u, mantissa = code & 1u;
  const float magnitude = exponent ? float(2 + mantissa) * float(1u << exponent) * 0.25f : 0.5f * float(mantissa);
  return code & 8u ? -magnitude : magnitude;
}

// The value of an e4m3fn code (0..255): sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; no
// infinities, magnitude 0x7F NaN. Normals built as float32 bits, subnormals (exponent 0) as mantissa * 2^-9.
OC128_FN float e4m3_value(uint32_t code) {
  const uint32_t exponent = (code >> 3) & 15u, mantissa = code & 7u;
  if ((code & 0x7Fu) == 0x7Fu) return float_from_bits(0x7FC00000u);
  const float magnitude =
      exponent ? float_from_bits(((exponent + 120u) << 23) | (mantissa << 20)) : float(mantissa) * 0.001953125f;
  return code & 0x80u ? -magnitude : magnitude;
}

// The value of an e8m0 scale byte: 2^(e - 127), built as float32 bits (0: the subnormal 2^-127; 255: NaN).
OC128_FN float e8m0_value(uint8_t e) {
  return float_from_bits(e == 0 ? (1u << 22) : e == 255 ? 0x7FC00000u : uint32_t(e) << 23);
}

// Per format: the columns a byte of codes holds, the columns a scale covers, and the value of column c of a
// row's codes.
template <Format F>
struct CodeFormat;

template <>
struct CodeFormat<Format::kFp4> {
  static constexpr int64_t kPerByte = 2, kGroup = 32;
  OC128_FN static float value(const uint8_t* row, int64_t c) {
    return e2m1_value(c % 2 ? row[c / 2] >> 4 : row[c / 2] & 15u);
  }
};

template <>
struct CodeFormat<Format::kFp8> {
  static constexpr int64_t kPerByte = 1, kGroup = 128;
  OC128_FN static float value(const uint8_t* row, int64_t c) { return e4m3_value(row[c]); }
};

// silu(min(g, limit)) * clip(u, -limit, limit): the gated value of a gate/up pair of products.
OC128_FN float swiglu_value(float g, float u, float limit) {
  g = fminf(g, limit);
  u = fminf(fmaxf(u, -limit), limit);
  return g / (1.0f + expf(-g)) * u;
}

template <typename T>
struct QuantGmmArgs {
  const T* x;
  const uint8_t* codes;
  const void* scales;  // uint8 e8m0 exponents, or float (float_scales)
  const int32_t* tile_expert;
  const int32_t* tile_rows;
  void* out;         // float (not gated) or T (gated)
  float* workspace;  // splits > 1: [splits, tiles * block_rows, n]
  Format format;
  bool float_scales;
  int64_t tiles, block_rows, experts, n, k, out_cols, splits;
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

  // The value of scale i (of the flattened scales).
  OC128_FN float scale(int64_t i) const {
    return float_scales ? static_cast<const float*>(scales)[i] : e8m0_value(static_cast<const uint8_t*>(scales)[i]);
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
ffi::Error quant_gmm(Backend& backend, ffi::AnyBuffer x, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                     ffi::Buffer<ffi::S32> tile_expert, ffi::Buffer<ffi::S32> tile_rows,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> workspace, int64_t gated,
                     float limit) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), td = tile_expert.dimensions();
  if (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16)
    return invalid("x: dtype must be float32 or bfloat16");
  if (codes.element_type() != ffi::U8 && codes.element_type() != ffi::F8E4M3FN)
    return invalid("codes: dtype must be uint8 (FP4, two e2m1 codes a byte) or float8_e4m3fn (FP8)");
  const Format format = codes.element_type() == ffi::U8 ? Format::kFp4 : Format::kFp8;
  const bool fp4 = format == Format::kFp4;
  if (xd.size() != 2) return invalid("x: expected rank 2 [rows, K], got " + shape_string(xd));
  if (cd.size() != 3)
    return invalid(std::string("codes: expected rank 3 [experts, N, ") + (fp4 ? "K / 2" : "K") + "], got " +
                   shape_string(cd));
  if (td.size() != 1) return invalid("tile_expert: expected rank 1 [tiles], got " + shape_string(td));
  const int64_t rows = xd[0], k = xd[1], experts = cd[0], n = cd[1], tiles = td[0];
  const int64_t multiple = fp4 ? 32 : 16;  // FP4: whole scale groups; FP8: whole 16-byte loads of a row
  const int64_t group = fp4 ? CodeFormat<Format::kFp4>::kGroup : CodeFormat<Format::kFp8>::kGroup;
  if (k % multiple)
    return invalid("x: K must be a multiple of " + std::to_string(multiple) + (fp4 ? " (FP4)" : " (FP8)") + ", got " +
                   std::to_string(k));
  OC128_RETURN_IF_ERROR(check_shape("codes", cd, {experts, n, fp4 ? k / 2 : k}));
  OC128_RETURN_IF_ERROR(check_shape("scales", scales.dimensions(), {experts, n, (k + group - 1) / group}));
  const bool float_scales = scales.element_type() == ffi::F32;
  if (scales.element_type() != ffi::U8 && !(float_scales && !fp4))
    return invalid(fp4 ? "scales: dtype must be uint8 (e8m0) for FP4"
                       : "scales: dtype must be uint8 (e8m0) or float32 for FP8");
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
  const auto wd = workspace->dimensions();
  const int64_t unit = rows * n, splits = wd.size() == 1 && wd[0] > 0 && unit > 0 ? wd[0] / unit : 1;
  if (wd.size() != 1 || (wd[0] != 0 && (splits < 2 || wd[0] != splits * unit)))
    return invalid("workspace: expected [0] or [splits * " + std::to_string(unit) + "] with splits >= 2, got " +
                   shape_string(wd));
  if (rows * out_cols == 0) return ffi::Error::Success();
  auto run = [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const QuantGmmArgs<T> args{typed,
                               static_cast<const uint8_t*>(codes.untyped_data()),
                               scales.untyped_data(),
                               tile_expert.typed_data(),
                               tile_rows.typed_data(),
                               out->untyped_data(),
                               workspace->typed_data(),
                               format,
                               float_scales,
                               tiles,
                               rows / tiles,
                               experts,
                               n,
                               k,
                               out_cols,
                               splits,
                               gated == 1,
                               limit};
    return backend.quant_gmm(args);
  };
  const void* data = x.untyped_data();
  return x.element_type() == ffi::F32 ? run(static_cast<const float*>(data)) : run(static_cast<const Bf16*>(data));
}

struct QuantGmm {
  static constexpr const char* kTarget = "oc128_quant_gmm";
  static constexpr auto kOperands = std::make_tuple(
      NamedArg<ffi::AnyBuffer>{"x"}, NamedArg<ffi::AnyBuffer>{"codes"}, NamedArg<ffi::AnyBuffer>{"scales"},
      NamedArg<ffi::Buffer<ffi::S32>>{"tile_expert"}, NamedArg<ffi::Buffer<ffi::S32>>{"tile_rows"},
      NamedRet<ffi::AnyBuffer>{"out"}, NamedRet<ffi::Buffer<ffi::F32>>{"workspace"}, NamedAttr<int64_t>{"gated"},
      NamedAttr<float>{"limit"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return quant_gmm(backend, std::move(operands)...);
  }
};

}  // namespace oc128
