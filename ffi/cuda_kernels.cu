// CUDA handlers of jax_oc128: one thread per channel (one 16-byte word for commit), running the work
// items of oc128_math.h. A CUDA block covers a chunk of 128 channels (32 where head_dim is not a multiple
// of 128) of one (layer, row[, segment]) unit: small blocks keep many units resident per SM, which is
// what hides the memory latency of these short, bandwidth-bound kernels. Every thread of a block takes
// part in deciding whether its row is processed (Rows::processed, the earlier rows split among them).
// Handlers only launch kernels on XLA's stream (no allocation, no host synchronisation), so XLA may
// capture them in command buffers.
#include <cuda_runtime.h>

#include "cuda_check.h"
#include "oc128_ffi.h"

namespace oc128 {
namespace {

constexpr unsigned kThreads = 128;

// Rows::processed of `row`, the earlier rows checked by all threads of the block together: every thread
// of the block must call it (it holds a barrier), and gets the same answer.
__device__ bool row_processed(const Rows& rows, int64_t row) {
  const bool taken = __syncthreads_or(rows.slot_taken(row, threadIdx.x, blockDim.x));
  return rows.valid(row) && !taken;
}

// Threads per block of the per-channel kernels: head_dim is a multiple of 32.
unsigned channel_threads(int64_t dim) { return dim % kThreads == 0 ? kThreads : 32; }

template <typename T>
__global__ void __launch_bounds__(kThreads) compress_kernel(CompressArgs<T> args, unsigned segments) {
  const unsigned chunks = unsigned(args.layout.dim) / blockDim.x, unit = blockIdx.x / chunks;
  const int64_t d = (blockIdx.x % chunks) * blockDim.x + threadIdx.x;
  const unsigned g = unit % segments, row = (unit / segments) % unsigned(args.rows);
  compress_channel(args, unit / segments / unsigned(args.rows), row, g, d, row_processed(args.call_rows(), row));
}

template <int N, bool kTree, bool kBanks, typename T>
__global__ void __launch_bounds__(kThreads) verify_kernel(VerifyArgs<T> args) {
  const unsigned chunks = unsigned(args.layout.dim) / blockDim.x, unit = blockIdx.x / chunks;
  const int64_t d = (blockIdx.x % chunks) * blockDim.x + threadIdx.x;
  const unsigned row = unit % unsigned(args.rows);
  verify_channel<N, kTree, kBanks>(args, unit / unsigned(args.rows), row, d, row_processed(args.call_rows(), row));
}

__global__ void __launch_bounds__(kThreads) commit_kernel(CommitArgs args, unsigned chunks) {
  const unsigned unit = blockIdx.x / chunks, row = unit % unsigned(args.rows);
  const int64_t w = (blockIdx.x % chunks) * blockDim.x + threadIdx.x;
  const bool processed = row_processed(args.call_rows(), row);
  if (w < args.words_per_slot) commit_word(args, unit / unsigned(args.rows), row, w, processed);
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
    const unsigned threads = channel_threads(args.layout.dim);
    const int64_t blocks = call_layers * args.rows * segments * (args.layout.dim / threads);
    OC128_RETURN_IF_ERROR(check_grid(blocks));
    compress_kernel<<<unsigned(blocks), threads, 0, stream>>>(args, unsigned(segments));
    return launched("compress launch");
  }

  template <int N, bool kTree, bool kBanks, typename T>
  ffi::Error verify(const VerifyArgs<T>& args, int64_t call_layers) {
    const unsigned threads = channel_threads(args.layout.dim);
    const int64_t blocks = call_layers * args.rows * (args.layout.dim / threads);
    OC128_RETURN_IF_ERROR(check_grid(blocks));
    verify_kernel<N, kTree, kBanks><<<unsigned(blocks), threads, 0, stream>>>(args);
    return launched("verify launch");
  }

  ffi::Error commit(const CommitArgs& args, int64_t num_layers) {
    const int64_t chunks = (args.words_per_slot + kThreads - 1) / kThreads;
    const int64_t blocks = num_layers * args.rows * chunks;
    OC128_RETURN_IF_ERROR(check_grid(blocks));
    commit_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(args, unsigned(chunks));
    return launched("commit launch");
  }
};

// The handler of Op: XLA's stream, then Op's operands as its binding (bind<Op> after the stream) decodes them.
template <typename Op>
constexpr auto on_cuda = [](cudaStream_t stream, auto... operands) {
  CudaBackend backend{stream};
  return Op::run(backend, std::move(operands)...);
};

template <typename Op>
auto bind_cuda() {
  return bind<Op>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>());
}

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_compress_cuda, oc128::on_cuda<oc128::Compress>, oc128::bind_cuda<oc128::Compress>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_verify_cuda, oc128::on_cuda<oc128::Verify>, oc128::bind_cuda<oc128::Verify>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_commit_cuda, oc128::on_cuda<oc128::Commit>, oc128::bind_cuda<oc128::Commit>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
