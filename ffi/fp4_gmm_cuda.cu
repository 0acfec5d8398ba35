// CUDA handler of the FP4 grouped matmul op (fp4_gmm_ffi.h): a memory-bound W4A16 kernel for decode sizes,
// where a tile holds few real rows, on the tensor cores (mma.sync m16n8k16, bfloat16 in, float32 accumulate).
// One block of kWarps warps per (tile, kGroups x 16 weight rows): it skips a tile of no expert and its padding
// rows (only zeros are written there) and streams those weight rows of its expert once per pass of up to 16 of
// the tile's rows (two MMAs of 8 rows per decoded fragment). A group of 16 weight rows is the MMA's M: gated,
// 8 gate rows and the 8 up rows of the same outputs (a lane then holds both products of an output); plain, 16
// outputs. The MMA's N is 8 rows of x, its K 16 columns.
// Warp w owns the 128-column chunks w, w + kWarps, ... of K; lane (g = lane / 4, t = lane % 4) of a chunk owns
// its scale group 4 chunk + t: 16 bytes of weight rows g and g + 8 (one 16-byte load each: a warp reads 64
// contiguous bytes of 8 rows) and the same 32 columns of x rows g (and 8 + g), read 8 columns (the B operand of
// two MMAs) just before their MMAs. Each code is decoded in registers as in gmm_pallas (nn/grouped_matmul.py,
// FP4_BF16_PTX: an e2m1 code placed as bfloat16 bits, times 2^126 and times its scale, exact for the scales the
// loader accepts), the k order of A and B permuted alike. The registers are bounded for kMinBlocks blocks a
// multiprocessor. The warps' float32 products are summed in shared memory in a fixed order: deterministic run
// to run. bfloat16 rows only. The handler only launches on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda_check.h"
#include "fp4_gmm_ffi.h"
#include "mma.h"

namespace oc128 {
namespace {

constexpr int kGroups = 2;     // groups of 16 weight rows per block
constexpr int kWarps = 8;      // warps per block: 128-column chunks of K
constexpr int kMinBlocks = 3;  // blocks a multiprocessor holds at once: the registers' bound
constexpr int kXRows = 8;      // x rows of an MMA (its N); a pass takes up to two of them
constexpr int kHalvesMax = 2;

// The bfloat16 pairs of one nibble of bytes 0, 1 (d[0]) and 2, 3 (d[1]) of `w`, low nibbles (kHigh false) or
// high ones, times the scale pair s: gmm_pallas's FP4_BF16_PTX.
template <bool kHigh>
__device__ __forceinline__ void decode(uint32_t w, uint32_t s, uint32_t& d0, uint32_t& d1) {
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

// The e8m0 exponent e as a pair of bfloat16 scales.
__device__ __forceinline__ uint32_t scale_pair(uint8_t e) { return (uint32_t(e) << 7) | (uint32_t(e) << 23); }

// Word m of a 16-byte load.
__device__ __forceinline__ uint32_t word(const uint4& q, int m) {
  return m == 0 ? q.x : m == 1 ? q.y : m == 2 ? q.z : q.w;
}

// x's 8 columns 8m .. 8m + 7 of a scale group (one 16-byte load at x) as the B operand's pairs of k (8m, 8m + 2),
// (8m + 1, 8m + 3) (b[0], b[1]) and (8m + 4, 8m + 6), (8m + 5, 8m + 7) (b[2], b[3]): decode's order.
__device__ __forceinline__ void x_pairs(const Bf16* x, uint32_t (&b)[4]) {
  const uint4 q = *reinterpret_cast<const uint4*>(x);
  b[0] = (q.x & 0xFFFFu) | (q.y << 16);
  b[1] = (q.x >> 16) | (q.y & 0xFFFF0000u);
  b[2] = (q.z & 0xFFFFu) | (q.w << 16);
  b[3] = (q.z >> 16) | (q.w & 0xFFFF0000u);
}

using Partial = float[kWarps][kGroups][kHalvesMax][32][4];

// One pass over the weight rows of a block for kHalves x 8 of its tile's rows from layout row row0 (`here` of
// them real): the warp's products into partial[warp].
template <int kHalves>
__device__ __forceinline__ void pass(const Fp4GmmArgs<Bf16>& a, const uint4* codes, const uint8_t* scales, int64_t c0,
                                     int64_t row0, int64_t here, Partial& partial) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
  const int64_t groups = a.k / kFp4Group, chunks = (groups + 3) / 4;
  const int group_cols = a.gated ? 8 : 16;
  float c[kGroups][kHalves][4] = {};
  for (int64_t q = warp; q < chunks; q += kWarps) {
    const int64_t grp = 4 * q + tg;
    const bool in_k = grp < groups;
    uint4 words[kGroups][2];
    uint32_t s[kGroups][2];
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // the lane's output column and weight row of group i: row g (and g + 8)
        const int64_t column = c0 + i * group_cols + (a.gated ? g : g + 8 * half);
        const int64_t row = a.gated && half ? a.out_cols + column : column, at = row * groups + grp;
        const bool load = in_k && column < a.out_cols;
        words[i][half] = load ? codes[at] : make_uint4(0, 0, 0, 0);
        s[i][half] = scale_pair(load ? scales[at] : uint8_t(127));
      }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t b[kHalves][4];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        if (in_k && kXRows * h + g < here) {
          x_pairs(a.x + (row0 + kXRows * h + g) * a.k + grp * kFp4Group + 8 * m, b[h]);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) b[h][j] = 0;
        }
      }
#pragma unroll
      for (int i = 0; i < kGroups; ++i) {
        // the fragments of k (8m, 8m + 2), (8m + 1, 8m + 3) and of (8m + 4, 8m + 6), (8m + 5, 8m + 7)
        uint32_t dl[4], dh[4];
        decode<false>(word(words[i][0], m), s[i][0], dl[0], dl[2]);
        decode<true>(word(words[i][0], m), s[i][0], dl[1], dl[3]);
        decode<false>(word(words[i][1], m), s[i][1], dh[0], dh[2]);
        decode<true>(word(words[i][1], m), s[i][1], dh[1], dh[3]);
        const uint32_t first[4] = {dl[0], dh[0], dl[1], dh[1]}, second[4] = {dl[2], dh[2], dl[3], dh[3]};
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          mma(c[i][h], first, b[h][0], b[h][1]);
          mma(c[i][h], second, b[h][2], b[h][3]);
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

__global__ void __launch_bounds__(32 * kWarps, kMinBlocks) fp4_gmm_kernel(Fp4GmmArgs<Bf16> a) {
  __shared__ Partial partial;
  const int64_t t = blockIdx.y, groups = a.k / kFp4Group;
  const int group_cols = a.gated ? 8 : 16, cols = kGroups * group_cols;  // output columns of a group, a block
  const int64_t c0 = int64_t(blockIdx.x) * cols, e = a.expert(t), rows = a.rows(t);

  // zeros for the padding rows (and every row of an unused tile)
  for (int64_t i = threadIdx.x; i < (a.block_rows - rows) * cols; i += blockDim.x) {
    const int64_t row = t * a.block_rows + rows + i / cols, c = c0 + i % cols;
    if (c < a.out_cols) a.store(row, c, 0.0f, 0.0f);
  }
  if (rows == 0) return;
  const uint4* codes = reinterpret_cast<const uint4*>(a.codes) + e * a.n * groups;
  const uint8_t* scales = a.scales + e * a.n * groups;
  for (int64_t r0 = 0; r0 < rows; r0 += kHalvesMax * kXRows) {
    const int64_t row0 = t * a.block_rows + r0, left = rows - r0;
    const int64_t here = left < kHalvesMax * kXRows ? left : kHalvesMax * kXRows;
    const int halves = here > kXRows ? 2 : 1;  // one MMA of 8 rows per fragment where a pass has at most 8
    if (halves == 2)
      pass<2>(a, codes, scales, c0, row0, here, partial);
    else
      pass<1>(a, codes, scales, c0, row0, here, partial);
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
      if (a.gated) {
        if (cg < a.out_cols) a.store(row, cg, first, second);
      } else {
        if (cg < a.out_cols) a.store(row, cg, first, 0.0f);
        if (cg + 8 < a.out_cols) a.store(row, cg + 8, second, 0.0f);
      }
    }
    __syncthreads();
  }
}

struct Fp4GmmCuda {
  cudaStream_t stream;

  template <typename T>
  ffi::Error fp4_gmm(const Fp4GmmArgs<T>& args) {
    if constexpr (!std::is_same_v<T, Bf16>) {
      return invalid("x: the CUDA kernel takes bfloat16 rows (its matmul's operands), got float32");
    } else {
      if (args.tiles > 65535)
        return invalid("tile_expert: at most 65535 tiles on the GPU, got " + std::to_string(args.tiles));
      const int64_t cols = kGroups * (args.gated ? 8 : 16);
      const dim3 grid(unsigned((args.out_cols + cols - 1) / cols), unsigned(args.tiles));
      fp4_gmm_kernel<<<grid, 32 * kWarps, 0, stream>>>(args);
      return launched("fp4_gmm launch");
    }
  }
};

constexpr auto on_cuda = [](cudaStream_t stream, auto... operands) {
  Fp4GmmCuda backend{stream};
  return Fp4Gmm::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    oc128_fp4_gmm_cuda, oc128::on_cuda,
    oc128::bind<oc128::Fp4Gmm>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
