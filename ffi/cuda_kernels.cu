// CUDA handlers of jax_oc128: one CUDA block per (layer, row[, segment]) work unit and one thread per
// channel, running the work items of oc128_math.h. Handlers only launch kernels on XLA's stream (no
// allocation, no host synchronisation), so XLA may capture them in command buffers.
#include <cuda_runtime.h>

#include "oc128_ffi.h"

namespace oc128 {
namespace {

constexpr int kChannelThreads = 512;  // threads per block for the per-channel kernels
constexpr int kCommitThreads = 128;

int channel_threads(int64_t dim) { return dim < kChannelThreads ? int(dim) : kChannelThreads; }

template <typename T>
__global__ void compress_kernel(CompressArgs<T> args, int64_t segments) {
  const int64_t g = blockIdx.x % segments, unit = blockIdx.x / segments;
  const int64_t row = unit % args.rows, lk = unit / args.rows;
  for (int64_t d = threadIdx.x; d < args.layout.dim; d += blockDim.x) compress_channel(args, lk, row, g, d);
}

template <typename T>
__global__ void verify_kernel(VerifyArgs<T> args) {
  const int64_t row = blockIdx.x % args.rows, lk = blockIdx.x / args.rows;
  for (int64_t d = threadIdx.x; d < args.layout.dim; d += blockDim.x) verify_channel(args, lk, row, d);
}

__global__ void commit_kernel(CommitArgs args) {
  const int64_t row = blockIdx.x % args.rows, l = blockIdx.x / args.rows;
  for (int64_t w = threadIdx.x; w < args.words_per_slot; w += blockDim.x) commit_word(args, l, row, w);
}

ffi::Error launched(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_oc128: ") + kernel + " launch failed: " + cudaGetErrorString(err));
}

ffi::Error check_grid(int64_t blocks) {
  if (blocks <= 0x7FFFFFFF) return ffi::Error::Success();
  return invalid("too many (layer, row, segment) units for one launch: " + std::to_string(blocks));
}

struct CudaBackend {
  cudaStream_t stream;

  ffi::Error copy(void* dst, const void* src, size_t bytes) {
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) return launched("copy");
    return ffi::Error::Success();
  }

  template <typename T>
  ffi::Error compress(const CompressArgs<T>& args, int64_t call_layers, int64_t segments) {
    const int64_t blocks = call_layers * args.rows * segments;
    OC128_RETURN_IF_ERROR(check_grid(blocks));
    compress_kernel<<<unsigned(blocks), channel_threads(args.layout.dim), 0, stream>>>(args, segments);
    return launched("compress");
  }

  template <typename T>
  ffi::Error verify(const VerifyArgs<T>& args, int64_t call_layers) {
    const int64_t blocks = call_layers * args.rows;
    OC128_RETURN_IF_ERROR(check_grid(blocks));
    verify_kernel<<<unsigned(blocks), channel_threads(args.layout.dim), 0, stream>>>(args);
    return launched("verify");
  }

  ffi::Error commit(const CommitArgs& args, int64_t num_layers) {
    const int64_t blocks = num_layers * args.rows;
    OC128_RETURN_IF_ERROR(check_grid(blocks));
    commit_kernel<<<unsigned(blocks), kCommitThreads, 0, stream>>>(args);
    return launched("commit");
  }
};

ffi::Error CompressCuda(cudaStream_t stream, ffi::AnyBuffer state, ffi::Buffer<ffi::F32> kv_score,
                        ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> new_lens, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<ffi::F32> ape, ffi::Result<ffi::AnyBuffer> state_out,
                        ffi::Result<ffi::Buffer<ffi::F32>> entries, ffi::Result<ffi::Buffer<ffi::S32>> entry_blocks,
                        int64_t layer) {
  CudaBackend backend{stream};
  return compress(backend, state, kv_score, seq_lens, new_lens, slots, ape, state_out, entries, entry_blocks, layer);
}

ffi::Error VerifyCuda(cudaStream_t stream, ffi::AnyBuffer state, ffi::Buffer<ffi::F32> kv_score,
                      ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> ape,
                      ffi::Result<ffi::AnyBuffer> state_out, ffi::Result<ffi::Buffer<ffi::F32>> entries,
                      ffi::Result<ffi::Buffer<ffi::S32>> entry_blocks, int64_t layer) {
  CudaBackend backend{stream};
  return verify(backend, state, kv_score, seq_lens, slots, ape, state_out, entries, entry_blocks, layer);
}

ffi::Error CommitCuda(cudaStream_t stream, ffi::AnyBuffer state, ffi::Buffer<ffi::S32> seq_lens,
                      ffi::Buffer<ffi::S32> accept_lens, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<ffi::AnyBuffer> state_out, int64_t layer, int64_t num_layers) {
  CudaBackend backend{stream};
  return commit(backend, state, seq_lens, accept_lens, slots, state_out, layer, num_layers);
}

template <typename B>
auto with_stream(B binding) {
  return std::move(binding).template Ctx<ffi::PlatformStream<cudaStream_t>>();
}

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_compress_cuda, oc128::CompressCuda,
                              oc128::bind_compress(oc128::with_stream(xla::ffi::Ffi::Bind())),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_verify_cuda, oc128::VerifyCuda,
                              oc128::bind_verify(oc128::with_stream(xla::ffi::Ffi::Bind())),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_commit_cuda, oc128::CommitCuda,
                              oc128::bind_commit(oc128::with_stream(xla::ffi::Ffi::Bind())),
                              {xla::ffi::Traits::kCmdBufferCompatible});
