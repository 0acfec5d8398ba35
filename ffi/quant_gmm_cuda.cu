// CUDA handler of the quantized grouped matmul op (quant_gmm_ffi.h): a memory-bound kernel for decode sizes
// (W4A16 and W8A16), where a tile holds few real rows, on the tensor cores (mma.sync m16n8k16, bfloat16 in,
// float32 accumulate), one template over the code format.
// One block of kWarps warps per (tile, kGroups x 16 weight rows, part of K): it skips a tile of no expert and
// its padding rows (only zeros are written there) and streams those weight rows of its expert once per pass of
// up to 16 of the tile's rows (two MMAs of 8 rows per decoded fragment). A group of 16 weight rows is the MMA's
// M: gated, 8 gate rows and the 8 up rows of the same outputs (a lane then holds both products of an output);
// plain, 16 outputs. The MMA's N is 8 rows of x, its K 16 columns. A row's codes are read in 16-byte loads (FP4
// 32 columns, one scale group; FP8 16 columns, an eighth of one), four to a chunk of a row. Warp w owns the
// chunks w, w + kWarps, ... of its part of K; lane (g = lane / 4, t = lane % 4) of a chunk owns its load 4 chunk
// + t: 16 bytes of weight rows g and g + 8 (a warp reads 64 contiguous bytes of 8 rows) and the same columns of
// x rows g (and 8 + g), read a 4-byte word of codes' worth (the B operand of its MMAs) just before their MMAs.
// Each code is decoded in registers to bfloat16 times its e8m0 scale, exactly for the scales the loader accepts
// (Decoder): FP4 codes j and j + 4 of a word as one pair by a mask, a multiply and a mask (x's columns paired
// alike), FP8 in column order; one multiply a pair by the scale where the scale times the decoding's offset is a
// bfloat16 number, else two (chosen per warp and chunk by a vote). The registers are bounded for kMinBlocks
// blocks a multiprocessor. The warps' float32 products are summed in shared memory in a fixed order; with a
// split of K (the workspace given) each part's sums go to the workspace and a second kernel adds the parts in
// their order: deterministic run to run. bfloat16 rows and e8m0 scales only. The handler only launches on XLA's
// stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda_check.h"
#include "mma.h"
#include "quant_gmm_ffi.h"

namespace oc128 {
namespace {

constexpr int kGroups = 2;     // groups of 16 weight rows per block
constexpr int kWarps = 8;      // warps per block: chunks of K
constexpr int kMinBlocks = 4;  // blocks a multiprocessor holds at once: the registers' bound
constexpr int kXRows = 8;      // x rows of an MMA (its N); a pass takes up to two of them
constexpr int kHalvesMax = 2;
constexpr int kCombineThreads = 256;

// a * b on bfloat16 pairs.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// 2^(e - 127) in both halves of a bfloat16 pair, for the exponent field e in [1, 254].
__device__ __forceinline__ uint32_t pow2_pair(uint32_t e) { return e * 0x00800080u; }

// A decoded pair (the codes' values times 2^-kShift, exact) times the scale pair s: kWide, by 2^kShift and then
// by s = 2^(e - 127); else by s = 2^(e - 127 + kShift) at once, a bfloat16 number where e <= 254 - kShift.
// Powers of two: both exact where the weight is a normal bfloat16 number (the exponents the loader accepts).
template <bool kWide, uint32_t kShift>
__device__ __forceinline__ uint32_t scaled(uint32_t pair, uint32_t s) {
  return mul_bf16x2(kWide ? mul_bf16x2(pair, pow2_pair(127 + kShift)) : pair, s);
}

// The bfloat16 pair of codes j (low half) and j + 4 (high half) of a word of FP4 codes (code c at bits 4c to
// 4c + 3), j = 0 or 1, each the code's value times 2^-126: its sign to bit 15 of its half, its exponent and
// mantissa to bits 6-8 (bfloat16's two lowest exponent bits and first mantissa bit; exponent 0 makes the
// subnormal 0.5 m). The two codes' nibbles, masked, are shifted both ways at once by one multiply (the two
// shifted copies do not overlap: no carries), then masked to the bits that are kept.
template <int J>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t w) {
  constexpr uint32_t kShifts = (1u << (12 - 4 * J)) + (1u << (6 - 4 * J));
  return ((w & (0x000F000Fu << 4 * J)) * kShifts) & 0x81C081C0u;
}

// The bfloat16 pairs of the e4m3 codes of bytes 0, 1 (d0) and 2, 3 (d1) of `w`, each the code's value times
// 2^-120. Each byte goes to bits 8-15 of its half (prmt) and its magnitude to bits 4-10: the code's sign,
// exponent and mantissa as bfloat16's sign, exponent bits 3-0 and first mantissa bits (the subnormal codes as
// bfloat16 subnormals). A NaN code (magnitude 0x7F, whose byte of n has its top bit set) has its half set to all
// ones by prmt's sign replication: a bfloat16 NaN, NaN after the multiplies.
__device__ __forceinline__ void e4m3_pairs(uint32_t w, uint32_t& d0, uint32_t& d1) {
  const uint32_t n = (w & 0x7F7F7F7Fu) + 0x01010101u;
  uint32_t q0, q1, nan0, nan1;
  asm("prmt.b32 %0, %2, 0, 0x1404;\n prmt.b32 %1, %2, 0, 0x3424;" : "=r"(q0), "=r"(q1) : "r"(w));
  asm("prmt.b32 %0, %2, 0, 0x9988;\n prmt.b32 %1, %2, 0, 0xBBAA;" : "=r"(nan0), "=r"(nan1) : "r"(n));
  d0 = (q0 & 0x80008000u) | ((q0 >> 4) & 0x07F007F0u) | nan0;
  d1 = (q1 & 0x80008000u) | ((q1 >> 4) & 0x07F007F0u) | nan1;
}

// Per format: the MMAs one 4-byte word of a weight row feeds (kMmas, each 4 of its columns a lane), its
// decoded A operand's pairs (weights: 2 kMmas pairs, those of MMA j at 2j and 2j + 1, times the scale pair) and
// x's same columns as the B operand's pairs in the same k order (x: from x's first column of the word); a
// decoded code is its value times 2^-kShift before the scale.
template <Format F>
struct Decoder;

template <>
struct Decoder<Format::kFp4> {
  static constexpr int kMmas = 2;
  static constexpr uint32_t kShift = 126;

  // k pairs (8m, 8m + 4), (8m + 1, 8m + 5), (8m + 2, 8m + 6), (8m + 3, 8m + 7) of word m's 8 columns (the
  // last two: the first two of the word shifted by a byte)
  template <bool kWide>
  __device__ __forceinline__ static void weights(uint32_t w, uint32_t s, uint32_t (&d)[4]) {
    d[0] = scaled<kWide, kShift>(e2m1_pair<0>(w), s);
    d[1] = scaled<kWide, kShift>(e2m1_pair<1>(w), s);
    d[2] = scaled<kWide, kShift>(e2m1_pair<0>(w >> 8), s);
    d[3] = scaled<kWide, kShift>(e2m1_pair<1>(w >> 8), s);
  }

  __device__ __forceinline__ static void x(const Bf16* x, uint32_t (&b)[4]) {
    const uint4 q = *reinterpret_cast<const uint4*>(x);
    b[0] = __byte_perm(q.x, q.z, 0x5410);
    b[1] = __byte_perm(q.x, q.z, 0x7632);
    b[2] = __byte_perm(q.y, q.w, 0x5410);
    b[3] = __byte_perm(q.y, q.w, 0x7632);
  }
};

template <>
struct Decoder<Format::kFp8> {
  static constexpr int kMmas = 1;
  static constexpr uint32_t kShift = 120;

  // k pairs (4m, 4m + 1), (4m + 2, 4m + 3) of word m's 4 columns
  template <bool kWide>
  __device__ __forceinline__ static void weights(uint32_t w, uint32_t s, uint32_t (&d)[2]) {
    e4m3_pairs(w, d[0], d[1]);
    d[0] = scaled<kWide, kShift>(d[0], s);
    d[1] = scaled<kWide, kShift>(d[1], s);
  }

  __device__ __forceinline__ static void x(const Bf16* x, uint32_t (&b)[2]) {
    const uint2 q = *reinterpret_cast<const uint2*>(x);
    b[0] = q.x;
    b[1] = q.y;
  }
};

// Word m of a 16-byte load.
__device__ __forceinline__ uint32_t word(const uint4& q, int m) {
  return m == 0 ? q.x : m == 1 ? q.y : m == 2 ? q.z : q.w;
}

using Partial = float[kWarps][kGroups][kHalvesMax][32][4];

// One chunk of a lane's pass: its loads of weight rows g and g + 8 of each group (`words`, their scales'
// exponents `e`) by the same columns of its x rows (`x`; zeros where !in_k), into c. kWide: a lane of the warp
// has a scale past the one-multiply range.
template <Format F, int kHalves, bool kWide>
__device__ __forceinline__ void chunk(const uint4 (&words)[kGroups][2], const uint32_t (&e)[kGroups][2],
                                      const Bf16* const (&x)[kHalves], bool in_k, float (&c)[kGroups][kHalves][4]) {
  using Dec = Decoder<F>;
  constexpr int kWordCols = 4 * CodeFormat<F>::kPerByte, kPairs = 2 * Dec::kMmas;
  uint32_t s[kGroups][2];
#pragma unroll
  for (int i = 0; i < kGroups; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) s[i][half] = pow2_pair(kWide ? e[i][half] : e[i][half] + Dec::kShift);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint32_t b[kHalves][kPairs];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      if (in_k) {
        Dec::x(x[h] + kWordCols * m, b[h]);
      } else {
#pragma unroll
        for (int j = 0; j < kPairs; ++j) b[h][j] = 0;
      }
    }
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      uint32_t low[kPairs], high[kPairs];  // weight rows g and g + 8
      Dec::template weights<kWide>(word(words[i][0], m), s[i][0], low);
      Dec::template weights<kWide>(word(words[i][1], m), s[i][1], high);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int j = 0; j < Dec::kMmas; ++j) {
          const uint32_t fragment[4] = {low[2 * j], high[2 * j], low[2 * j + 1], high[2 * j + 1]};
          mma(c[i][h], fragment, b[h][2 * j], b[h][2 * j + 1]);
        }
      }
    }
  }
}

// One pass over the weight rows of a block, its part of K, for kHalves x 8 of its tile's rows from layout row
// row0 (`here` of them real): the warp's products into partial[warp]. A lane's x row past the real ones reads
// row row0 instead (its products go to outputs no store takes).
template <Format F, int kHalves>
__device__ __forceinline__ void pass(const QuantGmmArgs<Bf16>& a, const uint4* codes, const uint8_t* scales, int64_t c0,
                                     int64_t row0, int64_t here, Partial& partial) {
  using Codes = CodeFormat<F>;
  constexpr int kLoadCols = 16 * Codes::kPerByte, kLoadsPerScale = Codes::kGroup / kLoadCols;
  constexpr bool kOneGroup = kLoadsPerScale == 1;
  constexpr uint32_t kNarrow = 254 - Decoder<F>::kShift;  // the largest exponent of one multiply
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const int64_t loads = a.k / kLoadCols, groups = (a.k + Codes::kGroup - 1) / Codes::kGroup, chunks = (loads + 3) / 4;
  const int group_cols = a.gated ? 8 : 16;
  float c[kGroups][kHalves][4] = {};
  // the block's part of K: chunks [q0, q1) (every chunk without a split); the lane's first load
  const int64_t q0 = chunks * blockIdx.z / a.splits, q1 = chunks * (blockIdx.z + 1) / a.splits;
  const int64_t first = 4 * (q0 + warp) + tg;
  // the lane's weight rows (row g and g + 8 of each group) as offsets into the expert's codes and scales, from
  // its load's codes and scale (FP4: a load is a scale group, the same offset), which advance a chunk at a time
  const uint4* lane_codes = codes + first;
  const uint8_t* lane_scales = scales + first / kLoadsPerScale;
  uint32_t at[kGroups][2], scale_at[kGroups][2];
  bool real[kGroups][2];
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // the lane's output column and weight row (32-bit: the offsets are, N * loads < 2^32)
      const uint32_t column = uint32_t(c0) + i * group_cols + (a.gated ? g : g + 8 * half);
      const uint32_t row = a.gated && half ? uint32_t(a.out_cols) + column : column;
      real[i][half] = column < uint32_t(a.out_cols);
      at[i][half] = row * uint32_t(loads);
      scale_at[i][half] = kOneGroup ? at[i][half] : row * uint32_t(groups);
    }
  }
  const Bf16* x[kHalves];
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    const int n = kXRows * h + g;
    x[h] = a.x + (row0 + (n < here ? n : 0)) * a.k + first * kLoadCols;
  }
  for (int64_t q = q0 + warp; q < q1; q += kWarps) {
    const bool in_k = 4 * q + tg < loads;
    uint4 words[kGroups][2];
    uint32_t e[kGroups][2], top = 0;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool read = in_k && real[i][half];
        words[i][half] = read ? lane_codes[at[i][half]] : make_uint4(0, 0, 0, 0);
        e[i][half] = read ? lane_scales[scale_at[i][half]] : 127u;
        top = e[i][half] > top ? e[i][half] : top;
      }
    }
    lane_codes += 4 * kWarps;
    lane_scales += 4 * kWarps / kLoadsPerScale;
    if (__any_sync(0xFFFFFFFFu, top > kNarrow))
      chunk<F, kHalves, true>(words, e, x, in_k, c);
    else
      chunk<F, kHalves, false>(words, e, x, in_k, c);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) x[h] += 4 * kWarps * kLoadCols;
  }
#pragma unroll
  for (int i = 0; i < kGroups; ++i)
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int v = 0; v < 4; ++v) partial[warp][i][h][lane][v] = c[i][h][v];
}

template <Format F>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks) quant_gmm_kernel(QuantGmmArgs<Bf16> a) {
  __shared__ Partial partial;
  using Codes = CodeFormat<F>;
  const int64_t t = blockIdx.y, loads = a.k / (16 * Codes::kPerByte);
  const int64_t groups = 16 * Codes::kPerByte == Codes::kGroup ? loads : (a.k + Codes::kGroup - 1) / Codes::kGroup;
  const int group_cols = a.gated ? 8 : 16, cols = kGroups * group_cols;  // output columns of a group, a block
  const int64_t c0 = int64_t(blockIdx.x) * cols, e = a.expert(t), rows = a.rows(t);
  const bool whole = a.splits == 1;  // else this block's part of K, to the workspace

  // zeros for the padding rows (and every row of an unused tile); with a split, the combine writes them
  for (int64_t i = threadIdx.x; whole && i < (a.block_rows - rows) * cols; i += blockDim.x) {
    const int64_t row = t * a.block_rows + rows + i / cols, c = c0 + i % cols;
    if (c < a.out_cols) a.store(row, c, 0.0f, 0.0f);
  }
  if (rows == 0) return;
  const uint4* codes = reinterpret_cast<const uint4*>(a.codes) + e * a.n * loads;
  const uint8_t* scales = static_cast<const uint8_t*>(a.scales) + e * a.n * groups;
  for (int64_t r0 = 0; r0 < rows; r0 += kHalvesMax * kXRows) {
    const int64_t row0 = t * a.block_rows + r0, left = rows - r0;
    const int64_t here = left < kHalvesMax * kXRows ? left : kHalvesMax * kXRows;
    const int halves = here > kXRows ? 2 : 1;  // one MMA of 8 rows per fragment where a pass has at most 8
    if (halves == 2)
      pass<F, 2>(a, codes, scales, c0, row0, here, partial);
    else
      pass<F, 1>(a, codes, scales, c0, row0, here, partial);
    __syncthreads();
    // c[i][h][v]: weight row g (v < 2) or g + 8, x row 8 h + 2 tg + v % 2; summed over the warps in order
    for (int item = threadIdx.x; item < kGroups * halves * 32 * 2; item += blockDim.x) {
      const int parity = item % 2, l = item / 2 % 32, h = item / 64 % halves, i = item / (64 * halves);
      const int n = kXRows * h + 2 * (l % 4) + parity;
      float first = 0.0f, second = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        first += partial[w][i][h][l][parity];
        second += partial[w][i][h][l][parity + 2];
      }
      if (n >= here) continue;
      const int64_t cg = c0 + i * group_cols + l / 4, row = row0 + n;
      if (whole && a.gated) {  // first: the gate's product, second: the up projection's
        if (cg < a.out_cols) a.store(row, cg, first, second);
      } else if (whole) {  // first: output column cg, second: cg + 8
        if (cg < a.out_cols) a.store(row, cg, first, 0.0f);
        if (cg + 8 < a.out_cols) a.store(row, cg + 8, second, 0.0f);
      } else {  // to the workspace by weight row: first row cg's, second cg + 8's (gated: out_cols + cg's)
        float* products = a.workspace + (blockIdx.z * a.tiles * a.block_rows + row) * a.n;
        if (cg < a.out_cols) products[cg] = first;
        if ((a.gated ? cg : cg + 8) < a.out_cols) products[a.gated ? a.out_cols + cg : cg + 8] = second;
      }
    }
    __syncthreads();
  }
}

// Every output of a split call: each real row's parts' products (the workspace) summed in split order, then
// stored (gated: the gate's and the up projection's); 0 for padding rows and the rows of unused tiles.
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(QuantGmmArgs<Bf16> a) {
  const int64_t rows = a.tiles * a.block_rows, outputs = rows * a.out_cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < outputs; i += gridDim.x * int64_t(blockDim.x)) {
    const int64_t row = i / a.out_cols, c = i % a.out_cols;
    float first = 0.0f, second = 0.0f;
    if (row % a.block_rows < a.rows(row / a.block_rows)) {
      for (int64_t s = 0; s < a.splits; ++s) {
        const float* products = a.workspace + (s * rows + row) * a.n;
        first += products[c];
        if (a.gated) second += products[a.out_cols + c];
      }
    }
    a.store(row, c, first, second);
  }
}

struct QuantGmmCuda {
  cudaStream_t stream;

  template <Format F>
  ffi::Error launch(const QuantGmmArgs<Bf16>& args) {
    const int64_t cols = kGroups * (args.gated ? 8 : 16);
    const dim3 grid(unsigned((args.out_cols + cols - 1) / cols), unsigned(args.tiles), unsigned(args.splits));
    quant_gmm_kernel<F><<<grid, 32 * kWarps, 0, stream>>>(args);
    if (args.splits == 1) return launched("quant_gmm launch");
    OC128_RETURN_IF_ERROR(launched("quant_gmm launch"));
    const int64_t outputs = args.tiles * args.block_rows * args.out_cols;
    const int64_t blocks = (outputs + kCombineThreads - 1) / kCombineThreads;
    combine_kernel<<<unsigned(blocks < 65535 ? blocks : 65535), kCombineThreads, 0, stream>>>(args);
    return launched("quant_gmm combine launch");
  }

  template <typename T>
  ffi::Error quant_gmm(const QuantGmmArgs<T>& args) {
    if constexpr (!std::is_same_v<T, Bf16>) {
      return invalid("x: the CUDA kernel takes bfloat16 rows (its matmul's operands), got float32");
    } else {
      if (args.float_scales) return invalid("scales: the CUDA kernel takes e8m0 (uint8) scales, got float32");
      if (args.tiles > 65535)
        return invalid("tile_expert: at most 65535 tiles on the GPU, got " + std::to_string(args.tiles));
      if (args.n * (args.k / (args.format == Format::kFp4 ? 32 : 16)) > int64_t(UINT32_MAX))
        return invalid("codes: the CUDA kernel takes at most 2^32 16-byte loads of codes an expert, got N " +
                       std::to_string(args.n) + ", K " + std::to_string(args.k));
      if (args.splits > 65535)
        return invalid("workspace: at most 65535 splits on the GPU, got " + std::to_string(args.splits));
      return args.format == Format::kFp4 ? launch<Format::kFp4>(args) : launch<Format::kFp8>(args);
    }
  }
};

constexpr auto on_cuda = [](cudaStream_t stream, auto... operands) {
  QuantGmmCuda backend{stream};
  return QuantGmm::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    oc128_quant_gmm_cuda, oc128::on_cuda,
    oc128::bind<oc128::QuantGmm>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
