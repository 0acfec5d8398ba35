// CUDA handler of the lightning indexer's scores op (indexer_ffi.h). One block of 4 warps per (tile of kKeys
// keys, tile of kQueries queries, batch row); warp w owns kWarpKeys of the keys, whose fragments it reads from
// global memory once and keeps in registers for every query of the tile. Per query (the 4 warps on the same one,
// so its q is read from global memory once a block and from L1 by the others), the warp streams the query's heads
// 16 at a time: the q . k of 16 heads x 8 keys by mma.sync m16n8k16 (bfloat16 in, float32 accumulate), relu and
// the head weights in registers, summed over the heads (the lanes' own rows, then across lanes by shuffles), one
// write of its keys' scores. No [L, heads, E] tensor exists, and no shared memory is used. The k order of the
// MMA is permuted alike for q and the keys (lane t holds channels 8 t .. 8 t + 7 of each 32: one 16-byte load),
// which the sum over k does not see. A warp does no matmul for a query that sees none of its keys (their scores
// are -inf). dim 128 and heads a multiple of 16 only. The handler only launches on XLA's stream.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "indexer_ffi.h"
#include "mma.h"

namespace oc128 {
namespace {

constexpr int kDim = 128;              // channels per key (V4's index_head_dim)
constexpr int kChunks = kDim / 32;     // 32-channel chunks: two MMA k steps each, 16 bytes a lane
constexpr int kTiles = 4;              // 8-key tiles a warp owns
constexpr int kWarpKeys = 8 * kTiles;  // keys a warp owns
constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kKeys = kWarps * kWarpKeys;  // keys per block
constexpr int kQueries = 64;               // queries per block

__global__ void __launch_bounds__(kThreads, 3) indexer_kernel(IndexerArgs a) {
  const int64_t b = blockIdx.z, l0 = int64_t(blockIdx.y) * kQueries;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t e0 = int64_t(blockIdx.x) * kKeys + warp * kWarpKeys;  // the warp's first key
  if (e0 >= a.count) return;
  const int queries = int(a.tokens - l0 < kQueries ? a.tokens - l0 : kQueries);

  // B: key e0 + 8 j + g, channels 32 c + 8 t .. (zeros past E)
  uint4 bf[kTiles][kChunks];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int64_t e = e0 + 8 * j + g;
    const uint4* row = reinterpret_cast<const uint4*>(a.keys + (b * a.count + (e < a.count ? e : 0)) * kDim);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) bf[j][c] = e < a.count ? row[4 * c + t] : make_uint4(0, 0, 0, 0);
  }

  for (int i = 0; i < queries; ++i) {
    const int64_t bl = b * a.tokens + l0 + i, seen = a.limit[bl];
    float sum[kTiles][2] = {};
    if (e0 < seen) {  // uniform over the warp
      const uint4* q = reinterpret_cast<const uint4*>(a.q + bl * a.heads * kDim);
      const float* weights = a.weights + bl * a.heads;
      for (int64_t h0 = 0; h0 < a.heads; h0 += 16) {
        // A: heads h0 + g (r = 0) and h0 + g + 8 (r = 1), channels 32 c + 8 t ..
        uint4 af[kChunks][2];
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
          for (int r = 0; r < 2; ++r) af[c][r] = q[(h0 + g + 8 * r) * (kDim / 8) + 4 * c + t];
        const float w0 = weights[h0 + g], w1 = weights[h0 + g + 8];
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          float acc[4] = {};
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            const uint32_t first[4] = {af[c][0].x, af[c][1].x, af[c][0].y, af[c][1].y};
            const uint32_t second[4] = {af[c][0].z, af[c][1].z, af[c][0].w, af[c][1].w};
            mma(acc, first, bf[j][c].x, bf[j][c].y);
            mma(acc, second, bf[j][c].z, bf[j][c].w);
          }
          // acc: heads (g, g + 8) x keys e0 + 8 j + 2 t (+ 1)
          sum[j][0] += w0 * fmaxf(acc[0], 0.0f) + w1 * fmaxf(acc[2], 0.0f);
          sum[j][1] += w0 * fmaxf(acc[1], 0.0f) + w1 * fmaxf(acc[3], 0.0f);
        }
      }
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int v = 0; v < 2; ++v)
#pragma unroll
          for (int offset = 4; offset < 32; offset *= 2) sum[j][v] += __shfl_xor_sync(0xFFFFFFFFu, sum[j][v], offset);
    }
    // every lane holds the sums of keys e0 + 8 j + 2 t (+ 1); lane (g, t) writes those of tile j = g
    float* out = a.out + bl * a.count;
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      if (j != g) continue;
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int64_t e = e0 + 8 * j + 2 * t + v;
        if (e < a.count) out[e] = e < seen ? sum[j][v] * a.scale : -INFINITY;
      }
    }
  }
}

struct IndexerCuda {
  cudaStream_t stream;

  ffi::Error indexer_scores(const IndexerArgs& args) {
    if (args.dim != kDim)
      return invalid("q: the CUDA kernel takes dim " + std::to_string(kDim) + ", got " + std::to_string(args.dim));
    if (args.heads % 16)
      return invalid("q: the CUDA kernel takes heads a multiple of 16, got " + std::to_string(args.heads));
    const int64_t key_tiles = (args.count + kKeys - 1) / kKeys, query_tiles = (args.tokens + kQueries - 1) / kQueries;
    if (query_tiles > 65535 || args.batch > 65535 || key_tiles > 0x7FFFFFFF)
      return invalid("q: too many queries or rows for the CUDA kernel's grid");
    const dim3 grid(unsigned(key_tiles), unsigned(query_tiles), unsigned(args.batch));
    indexer_kernel<<<grid, kThreads, 0, stream>>>(args);
    return launched("indexer_scores launch");
  }
};

constexpr auto on_cuda = [](cudaStream_t stream, auto... operands) {
  IndexerCuda backend{stream};
  return IndexerScores::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    oc128_indexer_scores_cuda, oc128::on_cuda,
    oc128::bind<oc128::IndexerScores>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
