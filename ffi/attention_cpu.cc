// CPU handler of the attention op (attention_ffi.h): a plain reference loop, one (query, head) at a time, online
// softmax over the query's keys in list order, float32 accumulation.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "attention_ffi.h"

namespace oc128 {
namespace {

struct AttentionCpu {
  template <typename T>
  ffi::Error attention(const AttentionArgs<T>& a) {
    const int64_t dim = a.dim;
    std::vector<float> acc(dim);
    for (int64_t bq = 0; bq < a.batch * a.tokens; ++bq) {
      const int64_t b = bq / a.tokens, keys = a.count(bq);
      for (int64_t h = 0; h < a.heads; ++h) {
        const T* q = a.q + (bq * a.heads + h) * dim;
        float top = -std::numeric_limits<float>::infinity(), total = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < keys; ++k) {
          const int64_t row = a.key(bq, k);
          if (row < 0) continue;
          const T* v = a.kv + (b * a.pool + row) * dim;
          float logit = 0.0f;
          for (int64_t d = 0; d < dim; ++d) logit += to_float(q[d]) * to_float(v[d]);
          logit *= a.scale;
          const float next = std::max(top, logit), rescale = std::exp(top - next), weight = std::exp(logit - next);
          total = total * rescale + weight;
          for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * rescale + weight * to_float(v[d]);
          top = next;
        }
        const float sink = a.sinks[h], last = std::max(top, sink);
        const float norm = std::exp(top - last) / (total * std::exp(top - last) + std::exp(sink - last));
        float* out = a.out + (bq * a.heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) out[d] = acc[d] * norm;
      }
    }
    return ffi::Error::Success();
  }
};

constexpr auto on_cpu = [](auto... operands) {
  AttentionCpu backend;
  return Attention::run(backend, std::move(operands)...);
};

}  // namespace
}  // namespace oc128

XLA_FFI_DEFINE_HANDLER_SYMBOL(oc128_attention_cpu, oc128::on_cpu, oc128::bind<oc128::Attention>(xla::ffi::Ffi::Bind()));
