// CUDA handler of the FP4 grouped matmul op (fp4_gmm_ffi.h): a memory-bound W4A16 kernel for decode sizes,
// where a tile holds few real rows. One block per (tile, kCols output columns): it skips a tile of no expert and
// its padding rows (only zeros are written there) and streams its expert's kRows weight rows (kCols; gated: the
// kCols gate rows and the kCols up rows of the same outputs) once per pass of kPass of the tile's rows.
// Thread c of a block owns the 16 bytes c of every weight row (columns 32c..32c+31, one scale group): it holds
// its columns of the pass's x rows in registers, loads kUnroll weight rows' 16 bytes at once (wide, coalesced:
// a warp reads 512 contiguous bytes of a row), decodes each e2m1 code by a 16-entry table in shared memory
// (conflict free: 16 words in 16 banks), sums code * x in float32 and multiplies the sum by its group's scale.
// The partial sums of a warp are reduced by a reduce-scatter of shuffles and the warps' in shared memory, in a
// fixed order: deterministic run to run. The handler only launches on XLA's stream.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "fp4_gmm_ffi.h"

namespace oc128 {
namespace {

constexpr int kPass = 2;          // the most x rows per pass over the weights (a last odd row: a pass of one)
constexpr int kUnroll = 8;        // weight rows loaded at once
constexpr int kRows = 32;         // weight rows per block
constexpr int kMaxThreads = 512;  // K <= 32 * 512; 128 registers a thread
constexpr int kSteps = kRows / kUnroll;

__device__ __forceinline__ float load_x(float v) { return v; }
__device__ __forceinline__ float load_x(Bf16 v) { return to_float(v); }

// Halves the partial sums p[0, M) of each lane by a shuffle at `kOffset`: the lanes with that bit set keep the
// upper half, the others the lower, each adding its partner's copy of the half it keeps.
template <int M, int kOffset, int V>
__device__ __forceinline__ void halve(float (&p)[V], bool upper) {
#pragma unroll
  for (int v = 0; v < M / 2; ++v) {
    const float keep = upper ? p[M / 2 + v] : p[v], send = upper ? p[v] : p[M / 2 + v];
    p[v] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
  }
  if constexpr (M > 2) halve<M / 2, kOffset / 2>(p, threadIdx.x & (kOffset / 2));
}

// The lane's share of a reduce-scatter of the V partial sums p over the warp: the warp's sum of
// p[lane / (32 / V)] (the 32 / V lanes of a run alike), each sum added in the same order every run.
template <int V>
__device__ __forceinline__ float reduce_scatter(float (&p)[V]) {
  static_assert(V >= 2 && V <= 16 && (V & (V - 1)) == 0, "V: a power of two in [2, 16]");
  halve<V, 16>(p, threadIdx.x & 16);
  float sum = p[0];
#pragma unroll
  for (int offset = 16 / (V / 2) / 2; offset >= 1; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// One block's work on a tile's rows r0.. r0 + P - 1 (all real): each weight row's products with them, summed
// over the block's threads into total[weight row][row] (see the file's comment).
template <int P, typename T>
__device__ __forceinline__ void pass(const Fp4GmmArgs<T>& a, int64_t row0, const uint4* codes, const uint8_t* scales,
                                     const float* table, float (*partial)[kRows * kPass], float (*total)[kPass],
                                     int64_t cols, int64_t c0) {
  constexpr int V = kUnroll * P;  // partial sums per thread per step
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, warps = blockDim.x / 32;
  const int64_t groups = a.k / kFp4Group;
  const bool owns = tid < groups;
  float x[P][kFp4Group];
#pragma unroll
  for (int r = 0; r < P; ++r) {
    const T* row = a.x + (row0 + r) * a.k + tid * kFp4Group;
#pragma unroll
    for (int i = 0; i < kFp4Group; ++i) x[r][i] = owns ? load_x(row[i]) : 0.0f;
  }
  __syncthreads();  // the table; the previous pass's totals stored
#pragma unroll 1
  for (int step = 0; step < kSteps; ++step) {
    uint4 word[kUnroll];
    uint8_t scale[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = step * kUnroll + u;  // the block's weight row: gated, j < cols the gate's, the rest the up's
      const int64_t c = c0 + (a.gated && j >= cols ? j - cols : j);
      const bool load = owns && c < a.out_cols;
      const int64_t at = (a.gated && j >= cols ? a.out_cols + c : c) * groups;
      word[u] = load ? codes[at] : make_uint4(0, 0, 0, 0);
      scale[u] = load ? scales[at] : uint8_t(127);
    }
    float p[V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t w[4] = {word[u].x, word[u].y, word[u].z, word[u].w};
      float s[P] = {};
#pragma unroll
      for (int i = 0; i < kFp4Group; ++i) {
        const float v = table[(w[i / 8] >> (4 * (i % 8))) & 15u];
#pragma unroll
        for (int r = 0; r < P; ++r) s[r] = fmaf(v, x[r][i], s[r]);
      }
      const float scaled = e8m0_value(scale[u]);
#pragma unroll
      for (int r = 0; r < P; ++r) p[u * P + r] = s[r] * scaled;
    }
    const float sum = reduce_scatter<V>(p);
    if (lane % (32 / V) == 0) partial[warp][step * V + lane / (32 / V)] = sum;  // index: weight row * P + row
  }
  __syncthreads();
  for (int i = tid; i < kRows * P; i += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < warps; ++w) sum += partial[w][i];
    total[i / P][i % P] = sum;
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads) fp4_gmm_kernel(Fp4GmmArgs<T> a) {
  __shared__ float table[16];
  __shared__ float partial[kMaxThreads / 32][kRows * kPass];
  __shared__ float total[kRows][kPass];
  const int tid = threadIdx.x;
  const int64_t t = blockIdx.y, groups = a.k / kFp4Group;
  const int cols = a.gated ? kRows / 2 : kRows;  // output columns of the block
  const int64_t c0 = int64_t(blockIdx.x) * cols, e = a.expert(t), rows = a.rows(t);
  if (tid < 16) table[tid] = e2m1_value(tid);

  // zeros for the padding rows (and every row of an unused tile)
  for (int64_t i = tid; i < (a.block_rows - rows) * cols; i += blockDim.x) {
    const int64_t row = t * a.block_rows + rows + i / cols, c = c0 + i % cols;
    if (c < a.out_cols) a.store(row, c, 0.0f, 0.0f);
  }
  const int64_t first = (e < 0 ? 0 : e) * a.n * groups + tid;  // the expert's first row, the thread's bytes
  const uint4* codes = reinterpret_cast<const uint4*>(a.codes) + first;
  const uint8_t* scales = a.scales + first;
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {
    const int64_t row0 = t * a.block_rows + r0;
    const int here = rows - r0 < kPass ? int(rows - r0) : kPass;
    if (here == 1)
      pass<1>(a, row0, codes, scales, table, partial, total, cols, c0);
    else
      pass<kPass>(a, row0, codes, scales, table, partial, total, cols, c0);
    for (int i = tid; i < cols * here; i += blockDim.x) {
      const int64_t j = i / here, r = i % here, c = c0 + j;
      if (c < a.out_cols) a.store(row0 + r, c, total[j][r], a.gated ? total[j + cols][r] : 0.0f);
    }
  }
}

struct Fp4GmmCuda {
  cudaStream_t stream;

  template <typename T>
  ffi::Error fp4_gmm(const Fp4GmmArgs<T>& args) {
    const int64_t groups = args.k / kFp4Group, cols = args.gated ? kRows / 2 : kRows;
    if (groups > kMaxThreads)
      return invalid("x: K must be at most " + std::to_string(32 * kMaxThreads) + " on the GPU, got " +
                     std::to_string(args.k));
    if (args.tiles > 65535)
      return invalid("tile_expert: at most 65535 tiles on the GPU, got " + std::to_string(args.tiles));
    const unsigned threads = unsigned((groups + 31) / 32 * 32);
    const dim3 grid(unsigned((args.out_cols + cols - 1) / cols), unsigned(args.tiles));
    fp4_gmm_kernel<T><<<grid, threads, 0, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return ffi::Error::Success();
    return ffi::Error::Internal(std::string("jax_oc128: fp4_gmm launch failed: ") + cudaGetErrorString(err));
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
