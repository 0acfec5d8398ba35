// CUDA handler of the attention op (attention_ffi.h). One block per (query, tile of 64 heads, split of the
// query's keys): MQA, so the heads of a query share every key. Warp 0 gathers the next 32 keys of the query's
// list that name a pool row (keys that name none are skipped: tiles are dense); their rows are copied into
// shared memory as bfloat16 by 16-byte cp.async, double-buffered (tile i + 1 is in flight while tile i is
// computed). Per tile:
//   S = Q K^T (tensor cores, mma.sync m16n8k16 bf16, float32 accumulate; fragments by ldmatrix), the online
//   softmax of S's rows (float32 statistics in shared memory; P as bfloat16), O = O * alpha + P V with O in
//   registers (V's fragments by ldmatrix.trans).
// 8 warps: for S, warp w has heads 16 (w % 4).. and keys 16 (w / 4)..; for O, heads 16 (w % 4).. and the half
// w / 4 of head_dim. Rows of the pool the query does not name are never read (cp.async of zeros).
// Split (flash-decoding, where there are few queries: attention_op.splits): split s of S takes keys
// [count s / S, count (s + 1) / S) of the list and writes its unnormalized O, running max and sum to the
// workspace; a second kernel combines the splits in their order (deterministic) with the sink.
// float32 inputs are rounded to bfloat16 as they are loaded (synchronously). The handler only launches on XLA's
// stream.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "attention_ffi.h"
#include "cuda_check.h"
#include "mma.h"

namespace oc128 {
namespace {

constexpr int kHeads = 64;  // heads per block (rows of Q), padded with zero rows
constexpr int kKeys = 32;   // keys per tile: one per lane of the gathering warp
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kScoreStride = kKeys + 4, kProbStride = kKeys + 8;
constexpr int kCombineThreads = 128;

using bf16 = __nv_bfloat16;

// Shared memory of a block for head_dim D: Q [64][D + 8], two K tiles [32][D + 8] (bf16), S [64][36]
// (float32), P [64][40] (bf16), the softmax's running max, sum and last rescale per head, the two tiles' pool
// rows.
template <int D>
constexpr int kRowStride = D + 8;  // bf16: consecutive rows 16 bytes apart mod 128: ldmatrix without conflicts

template <int D>
constexpr size_t smem_bytes() {
  return size_t(kHeads + 2 * kKeys) * kRowStride<D> * 2 + kHeads * kScoreStride * 4 + kHeads * kProbStride * 2 +
         3 * kHeads * 4 + 2 * kKeys * 4;
}

// 8 columns from `from` (a 16-byte aligned run of row `from`'s dtype) to shared `to` as bf16; zeros where
// !valid. bf16: one cp.async; float32: two 16-byte loads, rounded, one store.
__device__ __forceinline__ void load8(bf16* to, const Bf16* from, bool valid) { cp_async16(to, from, valid); }
__device__ __forceinline__ void load8(bf16* to, const float* from, bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (valid) {
    const float4 x = *reinterpret_cast<const float4*>(from), y = *reinterpret_cast<const float4*>(from + 4);
    const auto pack = [](float lo, float hi) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&p);
    };
    v = make_uint4(pack(x.x, x.y), pack(x.z, x.w), pack(y.x, y.y), pack(y.z, y.w));
  }
  *reinterpret_cast<uint4*>(to) = v;
}

// n rows of D columns of `from` into shared `to` [n][D + 8]: row r of it is from's row row_of(r) (< 0: zeros).
template <int D, typename T, typename RowOf>
__device__ __forceinline__ void load_rows(bf16* to, const T* from, int n, RowOf row_of) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < n * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks * 8;
    const int64_t row = row_of(r);
    load8(to + r * kRowStride<D> + c, from + (row < 0 ? 0 : row) * D + c, row >= 0);
  }
}

// Warp 0: the pool rows of the next (up to) kKeys keys of query bq's list in [cursor, end) that name one, into
// rows[0..kKeys) (-1 after them); the cursor moves past the last key taken.
template <typename T>
__device__ __forceinline__ void gather(const AttentionArgs<T>& a, int64_t bq, int64_t& cursor, int64_t end, int* rows) {
  static_assert(kKeys == 32, "one key per lane");
  const int lane = threadIdx.x % 32;
  int got = 0;
  while (got < kKeys && cursor < end) {
    const int64_t k = cursor + lane, row = k < end ? a.key(bq, k) : -1;
    const unsigned named = __ballot_sync(0xffffffffu, row >= 0);
    const int at = got + __popc(named & ((1u << lane) - 1u));
    if (row >= 0 && at < kKeys) rows[at] = int(row);
    if (got + __popc(named) <= kKeys) {
      cursor += 32;
      got += __popc(named);
    } else {  // the tile fills at the lane that takes its last place
      cursor += __ffs(__ballot_sync(0xffffffffu, row >= 0 && at == kKeys - 1));
      got = kKeys;
    }
  }
  if (lane >= got) rows[lane] = -1;
  __syncwarp();
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(AttentionArgs<T> a) {
  constexpr int QS = kRowStride<D>, NT = D / 16;  // NT: n8 tiles of O per warp (D / 2 columns)
  static_assert(NT % 2 == 0, "V's fragments come in pairs of n8 tiles");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = qs + kHeads * QS;  // two tiles
  float* ss = reinterpret_cast<float*>(ks + 2 * kKeys * QS);
  bf16* ps = reinterpret_cast<bf16*>(ss + kHeads * kScoreStride);
  float* top = reinterpret_cast<float*>(ps + kHeads * kProbStride);
  float* total = top + kHeads;
  float* rescale = total + kHeads;
  int* rows = reinterpret_cast<int*>(rescale + kHeads);  // two tiles

  const int64_t bq = blockIdx.x, b = bq / a.tokens;
  const int h0 = blockIdx.y * kHeads, split = blockIdx.z, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tg = lane % 4, mt = warp % 4, half = warp / 4;
  const float inf = __int_as_float(0x7f800000);
  const T* pool = a.kv + b * a.pool * D;

  const int64_t keys = a.count(bq), end = keys * (split + 1) / a.splits;
  int64_t cursor = keys * split / a.splits;  // warp 0's
  if (warp == 0) {
    gather(a, bq, cursor, end, rows);
    gather(a, bq, cursor, end, rows + kKeys);
  }
  if (tid < kHeads) {
    top[tid] = -inf;
    total[tid] = 0.0f;
  }
  __syncthreads();
  load_rows<D>(qs, a.q, kHeads, [&](int r) { return h0 + r < a.heads ? bq * a.heads + h0 + r : int64_t(-1); });
  load_rows<D>(ks, pool, kKeys, [&](int r) { return int64_t(rows[r]); });
  cp_async_commit();
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  // lane addresses of the ldmatrix fragments (module comment)
  const int m = lane / 8;
  const bf16* q_at = qs + (mt * 16 + lane % 16) * QS + lane / 16 * 8;
  const bf16* p_at = ps + (mt * 16 + lane % 16) * kProbStride + lane / 16 * 8;
  const int k_at = (half * 16 + m / 2 * 8 + lane % 8) * QS + m % 2 * 8;
  const int v_at = (m % 2 * 8 + lane % 8) * QS + half * (D / 2) + m / 2 * 8;

  for (int tile = 0;; ++tile) {
    const int cur = tile % 2;
    int* here = rows + cur * kKeys;
    const bf16* kc = ks + cur * kKeys * QS;
    if (rows[(1 - cur) * kKeys] >= 0) {  // the next tile, while this one is computed
      const int* next = rows + (1 - cur) * kKeys;
      load_rows<D>(ks + (1 - cur) * kKeys * QS, pool, kKeys, [&](int r) { return int64_t(next[r]); });
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (here[0] < 0) break;  // the keys are used up (tiles are dense)

    {  // S: heads 16 mt.., keys 16 half.. (two n8 tiles)
      float s[2][4] = {};
#pragma unroll 8
      for (int kk = 0; kk < D; kk += 16) {
        uint32_t af[4], bf[4];
        ldmatrix_x4(af, q_at + kk);
        ldmatrix_x4(bf, kc + k_at + kk);
        mma(s[0], af, bf[0], bf[1]);
        mma(s[1], af, bf[2], bf[3]);
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int col = (half * 2 + n) * 8 + tg * 2, row = mt * 16 + g;
        *reinterpret_cast<float2*>(ss + row * kScoreStride + col) = make_float2(s[n][0] * a.scale, s[n][1] * a.scale);
        *reinterpret_cast<float2*>(ss + (row + 8) * kScoreStride + col) =
            make_float2(s[n][2] * a.scale, s[n][3] * a.scale);
      }
    }
    __syncthreads();

    {  // the online softmax: 4 threads per head, 8 keys each
      const int row = tid / 4, part = tid % 4;
      const float before = top[row];
      float s[8], most = before;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = part * 8 + j;
        s[j] = here[col] >= 0 ? ss[row * kScoreStride + col] : -inf;
        most = fmaxf(most, s[j]);
      }
      most = fmaxf(most, __shfl_xor_sync(0xffffffffu, most, 1));
      most = fmaxf(most, __shfl_xor_sync(0xffffffffu, most, 2));
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bf16 p = __float2bfloat16_rn(most == -inf ? 0.0f : expf(s[j] - most));
        ps[row * kProbStride + part * 8 + j] = p;
        sum += __bfloat162float(p);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      __syncwarp();
      if (part == 0) {
        const float alpha = before == -inf ? 0.0f : expf(before - most);
        total[row] = total[row] * alpha + sum;
        top[row] = most;
        rescale[row] = alpha;
      }
    }
    __syncthreads();
    if (warp == 0) gather(a, bq, cursor, end, here);  // the tile after the next, into this tile's rows

    {  // O = O * alpha + P V: heads 16 mt.., columns half * D / 2..
      const float alpha0 = rescale[mt * 16 + g], alpha1 = rescale[mt * 16 + g + 8];
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        acc[i][0] *= alpha0;
        acc[i][1] *= alpha0;
        acc[i][2] *= alpha1;
        acc[i][3] *= alpha1;
      }
#pragma unroll
      for (int kk = 0; kk < kKeys; kk += 16) {
        uint32_t af[4];
        ldmatrix_x4(af, p_at + kk);
#pragma unroll
        for (int i = 0; i < NT; i += 2) {
          uint32_t bf[4];
          ldmatrix_x4<true>(bf, kc + v_at + kk * QS + i * 8);
          mma(acc[i], af, bf[0], bf[1]);
          mma(acc[i + 1], af, bf[2], bf[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  const int64_t parts = a.batch * a.tokens * a.splits * a.heads;  // the workspace's O rows
#pragma unroll
  for (int part = 0; part < 2; ++part) {  // rows g and g + 8 of the warp's 16 heads
    const int row = mt * 16 + g + part * 8, h = h0 + row;
    if (h >= a.heads) continue;
    const float most = top[row], sum = total[row];
    float norm = 1.0f, *out;
    if (a.splits == 1) {
      const float sink = a.sinks[h], last = fmaxf(most, sink);
      norm = expf(most - last) / (sum * expf(most - last) + expf(sink - last));
      out = a.out + (bq * a.heads + h) * D;
    } else {
      const int64_t at = (bq * a.splits + split) * a.heads + h;
      out = a.workspace + at * D;
      if (half == 0 && tg == 0) *reinterpret_cast<float2*>(a.workspace + parts * D + at * 2) = make_float2(most, sum);
    }
    out += half * (D / 2) + tg * 2;
#pragma unroll
    for (int i = 0; i < NT; ++i)
      *reinterpret_cast<float2*>(out + i * 8) = make_float2(acc[i][2 * part] * norm, acc[i][2 * part + 1] * norm);
  }
}

// One block per (query, head): the splits' partial results, in split order, with the sink.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(AttentionArgs<T> a) {
  const int64_t bq = blockIdx.x / a.heads, h = blockIdx.x % a.heads, S = a.splits, D = a.dim;
  const float* stats = a.workspace + a.batch * a.tokens * S * a.heads * D;
  const float sink = a.sinks[h];
  float last = sink;
  for (int64_t s = 0; s < S; ++s) last = fmaxf(last, stats[((bq * S + s) * a.heads + h) * 2]);
  float denominator = expf(sink - last);
  for (int64_t s = 0; s < S; ++s) {
    const float* st = stats + ((bq * S + s) * a.heads + h) * 2;
    denominator += expf(st[0] - last) * st[1];
  }
  for (int64_t c = threadIdx.x; c < D; c += kCombineThreads) {
    float o = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t at = (bq * S + s) * a.heads + h;
      o += expf(stats[at * 2] - last) * a.workspace[at * D + c];
    }
    a.out[(bq * a.heads + h) * D + c] = o / denominator;
  }
}

struct AttentionCuda {
  cudaStream_t stream;

  template <int D, typename T>
  ffi::Error launch(const AttentionArgs<T>& args) {
    constexpr size_t bytes = smem_bytes<D>();
    // per launch: the attribute is the current device's
    if (cudaFuncSetAttribute(attention_kernel<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) !=
        cudaSuccess)
      return launched("attention shared memory setup");
    const int64_t queries = args.batch * args.tokens;
    const dim3 grid(unsigned(queries), unsigned((args.heads + kHeads - 1) / kHeads), unsigned(args.splits));
    attention_kernel<D, T><<<grid, kThreads, bytes, stream>>>(args);
    if (args.splits == 1) return launched("attention launch");
    combine_kernel<T><<<unsigned(queries * args.heads), kCombineThreads, 0, stream>>>(args);
    return launched("attention combine launch");
  }

  // head_dim D in {32, 64, 128, 256, 512}: one kernel per D.
  template <int D = 32, typename T>
  ffi::Error attention(const AttentionArgs<T>& args) {
    if constexpr (D > 512) {
      return invalid("q: head_dim must be 32, 64, 128, 256 or 512 on the GPU, got " + std::to_string(args.dim));
    } else {
      return args.dim == D ? launch<D>(args) : attention<2 * D>(args);
    }
  }
};

constexpr auto on_cuda = [](cudaStream_t stream, auto... operands) {
  AttentionCuda backend{stream};
  return Attention::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    oc128_attention_cuda, oc128::on_cuda,
    oc128::bind<oc128::Attention>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
