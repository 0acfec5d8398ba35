// Probe (issue 42: the FP4 experts at their byte floor at decode sizes): the CUDA quantized grouped matmul
// kernel (ffi/quant_gmm_cuda.cu, included whole) alone on V4-Flash's routed experts, FP4 codes, bfloat16 rows,
// tiles of 16 rows as the decode's layout makes them: 8 tokens (48 pairs over 42 experts, 51 tiles) and 64
// tokens (384 pairs over 205 experts, 280 tiles), the gated gate/up projection (N 2 x 2048, K 4096) and the
// down projection (N 4096, K 2048). Prints us per call (median of 5 rounds of 20 back-to-back launches, CUDA
// events), the used experts' codes + scales read per second, and the call against the floor of reading them
// once at a device-to-device copy's rate (reads + writes, as bench_ops.copy_bandwidth counts). Random codes,
// e8m0 scales in [112, 127] (a released checkpoint's range: weights below 6), rows in [-1, 1).
// quant_gmm_probe.sh builds it per variant of the kernel's constants. Not the project's code path.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "quant_gmm_cuda.cu"

namespace {

__global__ void fill(uint8_t* p, int64_t n, uint32_t seed, int lo, int span) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * int64_t(blockDim.x)) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = uint8_t(span ? lo + int(h % uint32_t(span)) : h);
  }
}

__global__ void fill_rows(oc128::Bf16* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * int64_t(blockDim.x)) {
    const float v = float(int((uint32_t(i) * 2654435761u) >> 20) % 2048 - 1024) / 1024.0f;
    p[i] = oc128::from_float<oc128::Bf16>(v);
  }
}

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

template <typename F>
float median_us(F launch, cudaStream_t stream) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> rounds;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < 20; ++i) launch();
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    rounds.push_back(ms * 1000.0f / 20);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[2];
}

void run(const char* name, int tokens, int used, int tiles, int64_t n, int64_t k, bool gated) {
  constexpr int64_t kExperts = 256, kBlockRows = 16;
  const int64_t pairs = 6 * int64_t(tokens), code_bytes = kExperts * n * k / 2, scale_bytes = kExperts * n * k / 32;
  const int64_t rows = tiles * kBlockRows, out_cols = gated ? n / 2 : n;
  uint8_t *codes, *scales, *copy;
  oc128::Bf16 *x, *out_bf16;
  float* out_f32;
  int32_t *tile_expert, *tile_rows;
  CHECK(cudaMalloc(&codes, code_bytes));
  CHECK(cudaMalloc(&scales, scale_bytes));
  CHECK(cudaMalloc(&copy, code_bytes));
  CHECK(cudaMalloc(&x, rows * k * 2));
  CHECK(cudaMalloc(&out_bf16, rows * out_cols * 2));
  CHECK(cudaMalloc(&out_f32, rows * out_cols * 4));
  CHECK(cudaMalloc(&tile_expert, tiles * 4));
  CHECK(cudaMalloc(&tile_rows, tiles * 4));
  fill<<<1024, 256>>>(codes, code_bytes, 1u, 0, 0);
  fill<<<1024, 256>>>(scales, scale_bytes, 2u, 112, 16);
  fill_rows<<<1024, 256>>>(x, rows * k);
  // tiles 0 .. used - 1: experts spread over the 256, pairs dealt round robin; the rest unused (-1)
  std::vector<int32_t> expert(tiles, -1), count(tiles, 0);
  for (int t = 0; t < used; ++t) expert[t] = int32_t(t * kExperts / used);
  for (int64_t p = 0; p < pairs; ++p) count[p % used] += 1;
  CHECK(cudaMemcpy(tile_expert, expert.data(), tiles * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(tile_rows, count.data(), tiles * 4, cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());
  const oc128::QuantGmmArgs<oc128::Bf16> args{
      x,          codes,
      scales,     tile_expert,
      tile_rows,  gated ? static_cast<void*>(out_bf16) : static_cast<void*>(out_f32),
      nullptr,    oc128::Format::kFp4,
      false,      tiles,
      kBlockRows, kExperts,
      n,          k,
      out_cols,   1,
      gated,      10.0f};
  cudaStream_t stream = 0;
  oc128::QuantGmmCuda backend{stream};
  const float kernel = median_us([&] { (void)backend.launch<oc128::Format::kFp4>(args); }, stream);
  CHECK(cudaGetLastError());
  const int64_t bytes = int64_t(used) * n * (k / 2 + k / 32);
  const float copy_us =
      median_us([&] { CHECK(cudaMemcpyAsync(copy, codes, bytes, cudaMemcpyDeviceToDevice, stream)); }, stream);
  // a copy reads and writes its bytes: the floor of reading them once is half its time
  std::printf(
      "%-8s tokens %3d experts %3d tiles %3d: kernel %8.1f us %6.0f GB/s | copy (read + write) %6.0f GB/s"
      " | %.2fx the read floor\n",
      name, tokens, used, tiles, kernel, bytes / kernel / 1e3, 2 * bytes / copy_us / 1e3, kernel / (copy_us / 2));
  for (void* p : {(void*)codes, (void*)scales, (void*)copy, (void*)x, (void*)out_bf16, (void*)out_f32,
                  (void*)tile_expert, (void*)tile_rows})
    CHECK(cudaFree(p));
}

}  // namespace

int main() {
  for (auto [tokens, used, tiles] : {std::tuple{8, 42, 51}, std::tuple{64, 205, 280}}) {
    run("gate_up", tokens, used, tiles, 2 * 2048, 4096, true);
    run("down", tokens, used, tiles, 4096, 2048, false);
  }
  return 0;
}
