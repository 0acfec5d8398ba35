// CPU handler of the lightning indexer's scores op (indexer_ffi.h): a plain reference loop, one (query, key) at
// a time, each head's dot product summed in float32 in channel order, the heads' weighted relus in head order.
#include <cmath>
#include <limits>
#include <utility>

#include "indexer_ffi.h"

namespace oc128 {
namespace {

struct IndexerCpu {
  ffi::Error indexer_scores(const IndexerArgs& a) {
    for (int64_t bl = 0; bl < a.batch * a.tokens; ++bl) {
      const int64_t b = bl / a.tokens, seen = a.limit[bl];
      const Bf16* q = a.q + bl * a.heads * a.dim;
      const float* w = a.weights + bl * a.heads;
      for (int64_t e = 0; e < a.count; ++e) {
        float score = -std::numeric_limits<float>::infinity();
        if (e < seen) {
          const Bf16* k = a.keys + (b * a.count + e) * a.dim;
          float total = 0.0f;
          for (int64_t h = 0; h < a.heads; ++h) {
            float dot = 0.0f;
            for (int64_t d = 0; d < a.dim; ++d) dot += to_float(q[h * a.dim + d]) * to_float(k[d]);
            total += w[h] * (dot > 0.0f ? dot : 0.0f);
          }
          score = total * a.scale;
        }
        a.out[bl * a.count + e] = score;
      }
    }
    return ffi::Error::Success();
  }
};

constexpr auto on_cpu = [](auto... operands) {
  IndexerCpu backend;
  return IndexerScores::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_indexer_scores_cpu, oc128::on_cpu,
                              oc128::bind<oc128::IndexerScores>(xla::ffi::Ffi::Bind()));
