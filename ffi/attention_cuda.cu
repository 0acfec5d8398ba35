// CUDA handler of the attention op (attention_ffi.h). One block per (query, tile of 64 heads): MQA, so the heads
// of a query share every key. Per tile of 32 of the query's keys, gathered into shared memory as bfloat16:
//   S = Q K^T (tensor cores, mma.sync m16n8k16 bf16, float32 accumulate), the online softmax of S's rows
//   (float32 statistics in shared memory; P as bfloat16), O = O * alpha + P V with O in registers.
// 8 warps: for S, warp w has heads 16 (w % 4).. and keys 16 (w / 4)..; for O, heads 16 (w % 4).. and the half
// w / 4 of head_dim. Rows of the pool the query does not name are never read (their tile rows are zero).
// float32 inputs are rounded to bfloat16 as they are loaded. The handler only launches on XLA's stream.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "attention_ffi.h"

namespace oc128 {
namespace {

constexpr int kHeads = 64;  // heads per block (rows of Q), padded with zero rows
constexpr int kKeys = 32;   // keys per tile
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kScoreStride = kKeys + 4, kProbStride = kKeys + 8;

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(Bf16 x) { return to_float(x); }

__device__ __forceinline__ uint32_t word(const bf16* at) { return *reinterpret_cast<const uint32_t*>(at); }

__device__ __forceinline__ uint32_t pair(bf16 lo, bf16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}

// c += a b: a 16x16 (row major), b 16x8 (column major), c 16x8 float32.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of rows `row`.. and columns `col`.. of a bf16 matrix with row stride `stride`.
__device__ __forceinline__ void fragment_a(uint32_t (&a)[4], const bf16* m, int stride, int row, int col) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = col + (lane % 4) * 2;
  a[0] = word(m + (row + g) * stride + c);
  a[1] = word(m + (row + g + 8) * stride + c);
  a[2] = word(m + (row + g) * stride + c + 8);
  a[3] = word(m + (row + g + 8) * stride + c + 8);
}

// Shared memory of a block for head_dim D: Q [64][D + 8], K [32][D + 8] (bf16), S [64][36] (float32),
// P [64][40] (bf16), the softmax's running max, sum and last rescale per head, the tile's pool rows.
template <int D>
constexpr int kRowStride = D + 8;  // bf16: consecutive rows 16 bytes apart mod 128: no bank conflicts

template <int D>
constexpr size_t smem_bytes() {
  return size_t(kHeads + kKeys) * kRowStride<D> * 2 + kHeads * kScoreStride * 4 + kHeads * kProbStride * 2 +
         3 * kHeads * 4 + kKeys * 4;
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(AttentionArgs<T> a) {
  constexpr int QS = kRowStride<D>, NT = D / 16;  // NT: n8 tiles of O per warp (D / 2 columns)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = qs + kHeads * QS;
  float* ss = reinterpret_cast<float*>(ks + kKeys * QS);
  bf16* ps = reinterpret_cast<bf16*>(ss + kHeads * kScoreStride);
  float* top = reinterpret_cast<float*>(ps + kHeads * kProbStride);
  float* total = top + kHeads;
  float* rescale = total + kHeads;
  int* rows = reinterpret_cast<int*>(rescale + kHeads);

  const int64_t bq = blockIdx.x, b = bq / a.tokens;
  const int h0 = blockIdx.y * kHeads, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tg = lane % 4, mt = warp % 4, half = warp / 4;
  const float inf = __int_as_float(0x7f800000);

  for (int i = tid; i < kHeads * D; i += kThreads) {
    const int r = i / D, c = i % D, h = h0 + r;
    qs[r * QS + c] = __float2bfloat16_rn(h < a.heads ? load(a.q[(bq * a.heads + h) * D + c]) : 0.0f);
  }
  if (tid < kHeads) {
    top[tid] = -inf;
    total[tid] = 0.0f;
  }
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  __syncthreads();

  const int64_t keys = a.count(bq);
  for (int64_t k0 = 0; k0 < keys; k0 += kKeys) {
    if (tid < kKeys) rows[tid] = k0 + tid < keys ? int(a.key(bq, k0 + tid)) : -1;
    if (!__syncthreads_or(tid < kKeys && rows[tid] >= 0)) continue;  // no key in this tile
    for (int i = tid; i < kKeys * D; i += kThreads) {
      const int j = i / D, c = i % D, row = rows[j];
      ks[j * QS + c] = __float2bfloat16_rn(row >= 0 ? load(a.kv[(b * a.pool + row) * D + c]) : 0.0f);
    }
    __syncthreads();

    {  // S: heads 16 mt.., keys 16 half.. (two n8 tiles)
      float s[2][4] = {};
#pragma unroll 4
      for (int kk = 0; kk < D; kk += 16) {
        uint32_t af[4];
        fragment_a(af, qs, QS, mt * 16, kk);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const bf16* kb = ks + ((half * 2 + n) * 8 + g) * QS + kk + tg * 2;
          mma(s[n], af, word(kb), word(kb + 8));
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int col = (half * 2 + n) * 8 + tg * 2, row = mt * 16 + g;
        ss[row * kScoreStride + col] = s[n][0] * a.scale;
        ss[row * kScoreStride + col + 1] = s[n][1] * a.scale;
        ss[(row + 8) * kScoreStride + col] = s[n][2] * a.scale;
        ss[(row + 8) * kScoreStride + col + 1] = s[n][3] * a.scale;
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
        s[j] = rows[col] >= 0 ? ss[row * kScoreStride + col] : -inf;
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
        fragment_a(af, ps, kProbStride, mt * 16, kk);
        const bf16* v = ks + (kk + tg * 2) * QS + half * (D / 2) + g;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          const bf16* vi = v + i * 8;
          mma(acc[i], af, pair(vi[0], vi[QS]), pair(vi[8 * QS], vi[9 * QS]));
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int part = 0; part < 2; ++part) {  // rows g and g + 8 of the warp's 16 heads
    const int row = mt * 16 + g + part * 8, h = h0 + row;
    if (h >= a.heads) continue;
    const float most = top[row], sink = a.sinks[h], last = fmaxf(most, sink);
    const float norm = expf(most - last) / (total[row] * expf(most - last) + expf(sink - last));
    float* out = a.out + (bq * a.heads + h) * D + half * (D / 2) + tg * 2;
#pragma unroll
    for (int i = 0; i < NT; ++i)
      *reinterpret_cast<float2*>(out + i * 8) = make_float2(acc[i][2 * part] * norm, acc[i][2 * part + 1] * norm);
  }
}

ffi::Error launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_oc128: attention ") + what + " failed: " + cudaGetErrorString(err));
}

struct AttentionCuda {
  cudaStream_t stream;

  template <int D, typename T>
  ffi::Error launch(const AttentionArgs<T>& args) {
    constexpr size_t bytes = smem_bytes<D>();
    // per launch: the attribute is the current device's
    if (cudaFuncSetAttribute(attention_kernel<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) !=
        cudaSuccess)
      return launched("shared memory setup");
    const dim3 grid(unsigned(args.batch * args.tokens), unsigned((args.heads + kHeads - 1) / kHeads));
    attention_kernel<D, T><<<grid, kThreads, bytes, stream>>>(args);
    return launched("launch");
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
