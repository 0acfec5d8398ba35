// Warp-level tensor-core and shared-memory helpers of the CUDA kernels (attention_cuda.cu, quant_gmm_cuda.cu):
// mma.sync m16n8k16 (bfloat16 in, float32 accumulate), ldmatrix and 16-byte cp.async. sm_80 and later.
#pragma once

#include <cstdint>

namespace oc128 {

// c += a b: a 16x16 (row major), b 16x8 (column major), c 16x8 float32.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t shared_address(const void* at) { return uint32_t(__cvta_generic_to_shared(at)); }

// Four 8x8 b16 matrices from shared memory: lane l gives the row address l % 8 of matrix l / 8; r[m] is the
// lane's fragment of matrix m (row l / 4, columns 2 (l % 4) and + 1; with kTrans, of the transposed matrix).
template <bool kTrans = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
}

// 16 bytes from global `from` to shared `to`, asynchronously (L2 only); zeros instead where !valid (then
// `from` is not read).
__device__ __forceinline__ void cp_async16(void* to, const void* from, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(to)), "l"(from),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace oc128
