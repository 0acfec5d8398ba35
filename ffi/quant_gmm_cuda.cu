// CUDA handler of the quantized grouped matmul op (quant_gmm_ffi.h): a memory-bound kernel for decode sizes
// (W4A16 and W8A16), where a tile holds few real rows, on the tensor cores (mma.sync m16n8k16, bfloat16 in,
// float32 accumulate), one template over the code format.
// One block of kWarps warps per (tile, kGroups x 16 weight rows, part of K): it skips a tile of no expert and its
// padding rows (only zeros are written there) and streams those weight rows of its expert once per pass of up to
// 16 of the tile's rows (two MMAs of 8 rows per decoded fragment). A group of 16 weight rows is the MMA's M:
// gated, 8 gate rows and the 8 up rows of the same outputs (a lane then holds both products of an output); plain,
// 16 outputs. The MMA's N is 8 rows of x, its K 16 columns.
// A row's codes are read in 16-byte loads (FP4 32 columns, one scale group; FP8 16 columns, an eighth of one),
// four to a chunk of a row. Warp w owns the chunks w, w + kWarps, ... of its part of K; lane (g = lane / 4,
// t = lane % 4) of a chunk owns its load 4 chunk + t: 16 bytes of weight rows g and g + 8 (a warp reads 64
// contiguous bytes of 8 rows) and the same columns of x rows g (and 8 + g), read a 4-byte word of codes' worth
// (the B operand of its MMAs) just before their MMAs. Each code is decoded in registers to bfloat16 times its
// e8m0 scale, exactly for the scales the loader accepts (Decoder): FP4 as gmm_pallas does (nn/grouped_matmul.py,
// FP4_BF16_PTX), the k order of A and B permuted alike; FP8 in column order. The registers are bounded for
// kMinBlocks blocks a multiprocessor. The warps' float32 products are summed in shared memory in a fixed order;
// with a split of K (the workspace given) each part's sums go to the workspace and a second kernel adds the parts
// in their order: deterministic run to run. bfloat16 rows and e8m0 scales only. The handler only launches on
// XLA's stream.
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
constexpr int kMinBlocks = 3;  // blocks a multiprocessor holds at once: the registers' bound
constexpr int kXRows = 8;      // x rows of an MMA (its N); a pass takes up to two of them
constexpr int kHalvesMax = 2;
constexpr int kCombineThreads = 256;

// The bfloat16 pairs of one nibble of bytes 0, 1 (d[0]) and 2, 3 (d[1]) of `w`, low nibbles (kHigh false) or
// high ones, times the scale pair s: gmm_pallas's FP4_BF16_PTX.
template <bool kHigh>
__device__ __forceinline__ void decode_e2m1(uint32_t w, uint32_t s, uint32_t& d0, uint32_t& d1) {
  uint32_t q0, q1, t0, t1;
  asm("prmt.b32 %0, %2, 0, 0x1404;\n prmt.b32 %1, %2, 0, 0x3424;" : "=r"(q0), "=r"(q1) : "r"(w));
  if (!kHigh) {
    q0 <<= 4;
    q1 <<= 4;
  }
  t0 = (q0 >> 6) & 0x01C001C0u;
  t1 = (q1 >> 6) & 0x01C001C0u;
  asm("lop3.b32 %0, %0, 0x80008000, %1, 0xEA;" : "+r"(q0) : "r"(t0));
  asm("lop3.b32 %0, %0, 0x80008000, %1, 0xEA;" : "+r"(q1) : "r"(t1));
  asm("mul.rn.bf16x2 %0, %0, %3;\n mul.rn.bf16x2 %0, %0, %2;\n mul.rn.bf16x2 %1, %1, %3;\n mul.rn.bf16x2 %1, %1, %2;"
      : "+r"(q0), "+r"(q1)
      : "r"(s), "r"(0x7E807E80u));  // 2^126 in both halves
  d0 = q0;
  d1 = q1;
}

// The bfloat16 pairs of the e4m3 codes of bytes 0, 1 (d0) and 2, 3 (d1) of `w`, times the scale pair s. Each
// byte goes to bits 8-15 of its half (prmt) and its magnitude to bits 4-10: the code's sign, exponent and
// mantissa as bfloat16's sign, exponent bits 3-0 and first mantissa bits, its value times 2^-120 (the subnormal
// codes too, as bfloat16 subnormals), which a multiply by 2^120 makes the value and one by the scale the weight,
// both exact (powers of two; the loader keeps every weight normal). A NaN code (magnitude 0x7F, whose byte of n
// has its top bit set) has its half set to all ones by prmt's sign replication: a bfloat16 NaN, NaN after the
// multiplies.
__device__ __forceinline__ void decode_e4m3(uint32_t w, uint32_t s, uint32_t& d0, uint32_t& d1) {
  const uint32_t n = (w & 0x7F7F7F7Fu) + 0x01010101u;
  uint32_t q0, q1, nan0, nan1;
  asm("prmt.b32 %0, %2, 0, 0x1404;\n prmt.b32 %1, %2, 0, 0x3424;" : "=r"(q0), "=r"(q1) : "r"(w));
  asm("prmt.b32 %0, %2, 0, 0x9988;\n prmt.b32 %1, %2, 0, 0xBBAA;" : "=r"(nan0), "=r"(nan1) : "r"(n));
  q0 = (q0 & 0x80008000u) | ((q0 >> 4) & 0x07F007F0u) | nan0;
  q1 = (q1 & 0x80008000u) | ((q1 >> 4) & 0x07F007F0u) | nan1;
  asm("mul.rn.bf16x2 %0, %0, %3;\n mul.rn.bf16x2 %0, %0, %2;\n mul.rn.bf16x2 %1, %1, %3;\n mul.rn.bf16x2 %1, %1, %2;"
      : "+r"(q0), "+r"(q1)
      : "r"(s), "r"(0x7B807B80u));  // 2^120 in both halves
  d0 = q0;
  d1 = q1;
}

// Per format: the MMAs one 4-byte word of a weight row feeds (kMmas, each 4 of its columns a lane), its
// decoded A operand's pairs (weights: 2 kMmas pairs, those of MMA j at 2j and 2j + 1) and x's same columns as
// the B operand's pairs in the same k order (x: from x's first column of the word).
template <Format F>
struct Decoder;

template <>
struct Decoder<Format::kFp4> {
  static constexpr int kMmas = 2;

  // k pairs (8m, 8m + 2), (8m + 1, 8m + 3), (8m + 4, 8m + 6), (8m + 5, 8m + 7) of word m's 8 columns
  __device__ __forceinline__ static void weights(uint32_t w, uint32_t s, uint32_t (&d)[4]) {
    decode_e2m1<false>(w, s, d[0], d[2]);
    decode_e2m1<true>(w, s, d[1], d[3]);
  }

  __device__ __forceinline__ static void x(const Bf16* x, uint32_t (&b)[4]) {
    const uint4 q = *reinterpret_cast<const uint4*>(x);
    b[0] = (q.x & 0xFFFFu) | (q.y << 16);
    b[1] = (q.x >> 16) | (q.y & 0xFFFF0000u);
    b[2] = (q.z & 0xFFFFu) | (q.w << 16);
    b[3] = (q.z >> 16) | (q.w & 0xFFFF0000u);
  }
};

template <>
struct Decoder<Format::kFp8> {
  static constexpr int kMmas = 1;

  // k pairs (4m, 4m + 1), (4m + 2, 4m + 3) of word m's 4 columns
  __device__ __forceinline__ static void weights(uint32_t w, uint32_t s, uint32_t (&d)[2]) {
    decode_e4m3(w, s, d[0], d[1]);
  }

  __device__ __forceinline__ static void x(const Bf16* x, uint32_t (&b)[2]) {
    const uint2 q = *reinterpret_cast<const uint2*>(x);
    b[0] = q.x;
    b[1] = q.y;
  }
};

// The e8m0 exponent e as a pair of bfloat16 scales.
__device__ __forceinline__ uint32_t scale_pair(uint8_t e) { return (uint32_t(e) << 7) | (uint32_t(e) << 23); }

// Word m of a 16-byte load.
__device__ __forceinline__ uint32_t word(const uint4& q, int m) {
  return m == 0 ? q.x : m == 1 ? q.y : m == 2 ? q.z : q.w;
}

using Partial = float[kWarps][kGroups][kHalvesMax][32][4];

// One pass over the weight rows of a block, its part of K, for kHalves x 8 of its tile's rows from layout row
// row0 (`here` of them real): the warp's products into partial[warp].
template <Format F, int kHalves>
__device__ __forceinline__ void pass(const QuantGmmArgs<Bf16>& a, const uint4* codes, const uint8_t* scales, int64_t c0,
                                     int64_t row0, int64_t here, Partial& partial) {
  using Codes = CodeFormat<F>;
  using Dec = Decoder<F>;
  constexpr int kLoadCols = 16 * Codes::kPerByte, kWordCols = kLoadCols / 4, kPairs = 2 * Dec::kMmas;
  constexpr bool kOneGroup = kLoadCols == Codes::kGroup;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const int64_t loads = a.k / kLoadCols, groups = (a.k + Codes::kGroup - 1) / Codes::kGroup, chunks = (loads + 3) / 4;
  const int group_cols = a.gated ? 8 : 16;
  float c[kGroups][kHalves][4] = {};
  // the block's part of K: chunks [q0, q1) (every chunk without a split)
  const int64_t q0 = chunks * blockIdx.z / a.splits, q1 = chunks * (blockIdx.z + 1) / a.splits;
  for (int64_t q = q0 + warp; q < q1; q += kWarps) {
    const int64_t load = 4 * q + tg;
    const bool in_k = load < loads;
    uint4 words[kGroups][2];
    uint32_t s[kGroups][2];
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // the lane's output column and weight row of group i: row g (and g + 8)
        const int64_t column = c0 + i * group_cols + (a.gated ? g : g + 8 * half);
        const int64_t row = a.gated && half ? a.out_cols + column : column;
        const bool read = in_k && column < a.out_cols;
        const int64_t at = row * loads + load;  // FP4: also its scale's index (a load is a scale group)
        words[i][half] = read ? codes[at] : make_uint4(0, 0, 0, 0);
        const int64_t scale = kOneGroup ? at : row * groups + load * kLoadCols / Codes::kGroup;
        s[i][half] = scale_pair(read ? scales[scale] : uint8_t(127));
      }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t b[kHalves][kPairs];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        if (in_k && kXRows * h + g < here) {
          Dec::x(a.x + (row0 + kXRows * h + g) * a.k + load * kLoadCols + kWordCols * m, b[h]);
        } else {
#pragma unroll
          for (int j = 0; j < kPairs; ++j) b[h][j] = 0;
        }
      }
#pragma unroll
      for (int i = 0; i < kGroups; ++i) {
        uint32_t low[kPairs], high[kPairs];  // weight rows g and g + 8
        Dec::weights(word(words[i][0], m), s[i][0], low);
        Dec::weights(word(words[i][1], m), s[i][1], high);
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
