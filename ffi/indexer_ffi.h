// The lightning indexer's scores op (oc128_indexer_scores): each query's score of each key, the weighted sum over
// the index heads of relu(q . k), as DeepSeek-V4's CSA indexer scores its compressed keys. Shared by the CPU
// handler (a reference loop, indexer_cpu.cc) and the CUDA kernel (indexer_cuda.cu): the operands and their
// checks. The platform supplies a Backend with
//   ffi::Error indexer_scores(const IndexerArgs&);
//
// Operands (row-major):
//   q        [batch, L, heads, dim]   bfloat16: the queries' index heads
//   keys     [batch, E, dim]          bfloat16: the indexer keys
//   weights  [batch, L, heads]        float32: each query's weight of each head
//   limit    [batch, L]               int32: a query sees the keys below it (<= 0: none; >= E: all)
//   out      [batch, L, E]            float32
//   scale    attribute (float32)
// out[b, l, e] = scale * sum_h weights[b, l, h] * relu(sum_d q[b, l, h, d] k[b, e, d]) (float32) where e <
// limit[b, l], -inf elsewhere. The keys a query does not see are never part of its seen scores (they may hold NaN).
#pragma once

#include <cstdint>
#include <utility>

#include "oc128_ffi.h"

namespace oc128 {

struct IndexerArgs {
  const Bf16* q;
  const Bf16* keys;
  const float* weights;
  const int32_t* limit;
  float* out;
  int64_t batch, tokens, heads, dim, count;
  float scale;
};

template <typename Backend>
ffi::Error indexer_scores(Backend& backend, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> keys,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> limit,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, float scale) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (qd.size() != 4) return invalid("q: expected rank 4 [batch, L, heads, dim], got " + shape_string(qd));
  if (kd.size() != 3) return invalid("keys: expected rank 3 [batch, E, dim], got " + shape_string(kd));
  const int64_t batch = qd[0], tokens = qd[1], heads = qd[2], dim = qd[3], count = kd[1];
  OC128_RETURN_IF_ERROR(check_shape("keys", kd, {batch, count, dim}));
  OC128_RETURN_IF_ERROR(check_shape("weights", weights.dimensions(), {batch, tokens, heads}));
  OC128_RETURN_IF_ERROR(check_shape("limit", limit.dimensions(), {batch, tokens}));
  OC128_RETURN_IF_ERROR(check_shape("out", out->dimensions(), {batch, tokens, count}));
  if (batch * tokens * count == 0) return ffi::Error::Success();
  const IndexerArgs args{reinterpret_cast<const Bf16*>(q.untyped_data()),
                         reinterpret_cast<const Bf16*>(keys.untyped_data()),
                         weights.typed_data(),
                         limit.typed_data(),
                         out->typed_data(),
                         batch,
                         tokens,
                         heads,
                         dim,
                         count,
                         scale};
  return backend.indexer_scores(args);
}

struct IndexerScores {
  static constexpr const char* kTarget = "oc128_indexer_scores";
  static constexpr auto kOperands =
      std::make_tuple(NamedArg<ffi::Buffer<ffi::BF16>>{"q"}, NamedArg<ffi::Buffer<ffi::BF16>>{"keys"},
                      NamedArg<ffi::Buffer<ffi::F32>>{"weights"}, NamedArg<ffi::Buffer<ffi::S32>>{"limit"},
                      NamedRet<ffi::Buffer<ffi::F32>>{"out"}, NamedAttr<float>{"scale"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return indexer_scores(backend, std::move(operands)...);
  }
};

}  // namespace oc128
